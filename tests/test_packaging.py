"""The two dependency lists (pip's pyproject.toml and conda's environment.yml) must agree."""
import tomllib

import yaml

from conftest import ROOT


def _pyproject_deps():
    with open(ROOT / "pyproject.toml", "rb") as f:
        return set(tomllib.load(f)["project"]["dependencies"])


def _conda_pip_deps():
    with open(ROOT / "environment.yml") as f:
        env = yaml.safe_load(f)
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    return {d for d in pip if not d.startswith("-e")}


def test_environment_yml_matches_pyproject():
    py, conda = _pyproject_deps(), _conda_pip_deps()
    assert py == conda, f"only in pyproject: {sorted(py - conda)}; only in environment.yml: {sorted(conda - py)}"


def test_torch_pins():
    deps = _pyproject_deps()
    assert "torch==2.14.1" in deps and "torchvision==0.29.1" in deps
