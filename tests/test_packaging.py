"""Packaging: the two dependency lists (pip's pyproject.toml and conda's environment.yml) must
agree, and the test tooling must do what `make test` relies on."""
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


def test_xdist_groups_keep_a_fixture_on_one_worker(tmp_path):
    """`make test` relies on --dist loadgroup to build each expensive fixture once; with
    pytest 9.2 and pytest-xdist 3.8 the grouping silently stopped (pytest-xdist#1386)."""
    import subprocess
    import sys

    (tmp_path / "test_g.py").write_text(
        "import os, pytest\n"
        "pytestmark = pytest.mark.xdist_group('g')\n"
        "@pytest.mark.parametrize('i', range(6))\n"
        "def test_a(i):\n"
        "    open(os.path.join(os.path.dirname(__file__), f'w{i}'), 'w').write(os.environ['PYTEST_XDIST_WORKER'])\n"
        "@pytest.mark.parametrize('i', range(6))\n"
        "def test_b(i):\n"
        "    pass\n")
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
                        "--dist", "loadgroup", str(tmp_path)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    workers = {(tmp_path / f"w{i}").read_text() for i in range(6)}
    assert len(workers) == 1, workers


def test_wheel_ships_the_notebooks_and_templates(tmp_path):
    """A non-editable install must find the notebooks and the export template inside the
    package (lab.NOTEBOOKS comes from importlib.resources); the wheel is built without deps."""
    import subprocess
    import sys
    import zipfile

    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-2000:]
    (wheel,) = tmp_path.glob("labkit-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for nb in ("run_method", "report", "explore"):
        assert f"labkit/notebooks/{nb}.ipynb" in names
    assert "labkit/templates/offline/index.html.j2" in names
    assert not any(n.startswith("tests/") for n in names)


def test_notebook_imports_leave_torch_and_scipy_out():
    """Every notebook kernel starts by importing labkit; torch + torchvision (which pulls in
    torch._dynamo) and scipy.stats cost ~7 s of CPU per process on 2 cores. The report kernels
    never need them, a method's kernel needs torch only for its input checks (labkit.training.checks),
    and scipy.stats is imported when an interval is computed: the notebooks' import lines
    alone must load none of them."""
    import json
    import subprocess
    import sys

    heavy = ("torch", "torchvision", "scipy.stats", "matplotlib.pyplot")
    for name in ("run_method", "report", "sweep", "explore"):
        nb = json.loads((ROOT / "notebooks" / f"{name}.ipynb").read_text())
        imports = [line for c in nb["cells"] if c["cell_type"] == "code"
                   for line in "".join(c["source"]).splitlines()
                   if line.startswith(("import ", "from "))]
        assert any("labkit" in line for line in imports), name
        code = "\n".join(imports + ["import sys",
                                    f"print(','.join(m for m in {heavy!r} if m in sys.modules))"])
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr[-2000:]
        loaded = p.stdout.strip()
        if name == "explore":  # draws interactively: pyplot is its point, torch is not
            loaded = ",".join(m for m in loaded.split(",") if m != "matplotlib.pyplot")
        assert loaded == "", f"{name}.ipynb's imports load {loaded}"
