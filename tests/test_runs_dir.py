"""Where run folders go (issue 31): the runs_dir given, else the project's runs/, whatever the
working directory (papermill runs the kernel in the shell's folder, JupyterLab in notebooks/);
an installed labkit, which has no project, uses the current folder's runs/. One rule,
labkit.core.layout.runs_root, for run_method.ipynb, `labkit run` and explore.ipynb.
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import nbformat
import papermill as pm
import pytest

from helpers import ROOT, tiny_cfg
from labkit.core import layout
from labkit.core.config import ConfigError
from labkit.orchestrate.kernels import kernel_name

PROJECT_RUNS = ROOT / "runs"
NOTEBOOK = ROOT / "notebooks" / "run_method.ipynb"
# one method, one process, one epoch of 2 steps: the run folder is the point, not the training
TINY = tiny_cfg(method="ddp", max_steps_per_epoch=2, max_val_steps=1, calibrate_steps=0, timeout=60.0,
                nproc=1)


# ------------------------------------------------------------------ the rule
def test_the_project_is_the_checkout_this_labkit_runs_from():
    assert layout.project_dir() == ROOT


@pytest.mark.parametrize("where", ["root", "notebooks", "elsewhere"])
def test_runs_root_is_the_same_from_any_folder(where, tmp_path, monkeypatch):
    cwd = {"root": ROOT, "notebooks": ROOT / "notebooks", "elsewhere": tmp_path}[where]
    monkeypatch.chdir(cwd)
    assert layout.runs_root() == PROJECT_RUNS
    assert layout.runs_root("given") == cwd / "given"  # a given one: relative to the current folder
    assert layout.runs_root(tmp_path / "x") == tmp_path / "x"


def test_an_installed_labkit_has_no_project_and_uses_the_current_folder(tmp_path, monkeypatch):
    installed = tmp_path / "site-packages" / "labkit"
    installed.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert layout.project_dir(installed) is None
    assert layout.runs_root(package=installed) == tmp_path / "runs"
    checkout = tmp_path / "checkout"  # a folder with notebooks/, labkit/ and pyproject.toml is one
    for d in ("notebooks", "labkit"):
        (checkout / d).mkdir(parents=True)
    (checkout / "pyproject.toml").touch()
    assert layout.runs_root(package=checkout / "labkit") == checkout / "runs"


def test_the_notebooks_runs_dir_is_a_checked_parameter():
    from labkit.launch.launch_params import notebook_params

    with pytest.raises(ConfigError, match="runs_dir"):
        notebook_params({"method": "ddp", "runs_dir": 3})
    notebook_params({"method": "ddp", "runs_dir": "somewhere"})


# ------------------------------------------------------------------ labkit run without --out
def launched_out(monkeypatch, argv: list[str]) -> Path:
    """The --out that `labkit run ARGV` hands the launcher (which is replaced: nothing runs)."""
    from labkit import cli
    from labkit.launch import launch

    seen = []
    monkeypatch.setattr(launch, "launch", lambda cfg, nproc, out, nodes: seen.append(out)
                        or SimpleNamespace(ok=False, message="stopped by the test"))
    assert cli.main(["run", "ddp", "--nproc", "1", "--dataset", "digits", *argv]) == 1
    (out,) = seen
    return Path(out)


def test_labkit_run_without_out_uses_the_projects_runs_from_any_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = launched_out(monkeypatch, [])
    assert out.parent == PROJECT_RUNS and out.name.endswith("_ddp") and not out.exists()
    assert launched_out(monkeypatch, ["--runs-dir", "mine"]).parent == tmp_path / "mine"
    assert launched_out(monkeypatch, ["--out", "here"]) == Path("here")  # --out as given
    assert list(tmp_path.iterdir()) == []


def test_the_explorer_reads_the_projects_runs_by_default(tmp_path, monkeypatch):
    from labkit.runs import explore

    looked = []
    monkeypatch.setattr(explore, "find_runs", lambda root: looked.append(root) or [])
    monkeypatch.chdir(tmp_path)
    assert explore.show() == [] and explore.show("given") == []
    assert looked == [PROJECT_RUNS, tmp_path / "given"]


def test_experiment_bench_sweep_and_runs_use_the_projects_runs_from_any_folder(tmp_path, monkeypatch,
                                                                              capsys):
    """Without --runs-dir, every command that makes or lists run folders uses the same runs/
    as the notebooks (here a stand-in project, so the checkout's runs/ stays untouched)."""
    import json

    from labkit import cli
    from labkit.orchestrate.bench import BenchPlan
    from labkit.orchestrate.experiment import Experiment
    from labkit.runs.runs_dir import new_run_dir

    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.setattr(layout, "project_dir", lambda package=None: project)
    monkeypatch.chdir(elsewhere)
    assert Experiment().runs_dir is None and BenchPlan(["ddp"], [2]).runs_dir is None
    made = new_run_dir(Experiment().runs_dir, "mine")  # what experiment, sweep and bench call
    assert made.parent == project / "runs" and made.name.endswith("_mine")
    assert (project / "runs" / "latest").resolve() == made
    assert new_run_dir("given").parent == elsewhere / "given"  # a given one: from here
    assert cli.main(["runs", "--json"]) == 0
    assert [r["name"] for r in json.loads(capsys.readouterr().out)] == [made.name]
    assert list(elsewhere.iterdir()) == [elsewhere / "given"]


@pytest.mark.parametrize("where", ["root", "elsewhere"])
def test_a_notebooks_run_folder_is_the_projects_latest_unless_given(where, tmp_path, monkeypatch):
    cwd = {"root": ROOT, "elsewhere": tmp_path}[where]
    monkeypatch.chdir(cwd)
    assert layout.run_or_latest() == (PROJECT_RUNS / "latest").resolve()
    assert layout.run_or_latest("given") == cwd / "given"


def test_no_notebook_parameter_is_a_path_relative_to_the_working_directory():
    """report, sweep, runs and explore read the project's runs/ by default (None), as
    run_method writes there: a literal "../runs" would point outside the project under
    papermill run from the repository root."""
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
        paths = re.findall(r"^(\w+_dir)\s*=\s*(.+?)\s*(?:#|$)", cell.source, re.M)
        assert all(value == "None" for _, value in paths), (path.name, paths)
        if path.stem != "run_method":
            assert paths, path.name  # every reading notebook names its folder as a parameter


# ------------------------------------------------------------------ run_method.ipynb under papermill
def printed_out(nb_path: Path) -> Path | None:
    """The method's folder as the notebook printed it ("ddp: 1 processes per node -> PATH")."""
    if not nb_path.exists():
        return None
    nb = nbformat.read(nb_path, as_version=4)
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    m = re.search(r"processes per node -> (.+)$", text, re.M)
    return Path(m.group(1).strip()) if m else None


@pytest.mark.slow
@pytest.mark.parametrize("where", ["root", "notebooks", "elsewhere"])
def test_papermill_from_any_folder_writes_under_the_projects_runs(where, tmp_path):
    """papermill as its usage says, the kernel in the shell's folder: from the repository root
    and from an unrelated folder the run lands in the project's runs/ (the default: the folder
    this test made is removed again, exactly that one); from notebooks/ in the runs_dir given.
    Nowhere else: not in runs/ beside or above the working directory."""
    cwd = {"root": ROOT, "notebooks": ROOT / "notebooks", "elsewhere": tmp_path / "elsewhere"}[where]
    cwd.mkdir(exist_ok=True)
    given = tmp_path / "given" if where == "notebooks" else None
    expected = given or PROJECT_RUNS
    wrong = [p for p in (cwd / "runs", cwd.parent / "runs") if p not in (PROJECT_RUNS, expected)]
    before = {p: sorted(p.iterdir()) if p.exists() else None for p in wrong}
    nb_out = tmp_path / "out.ipynb"
    params = {**TINY, **({"runs_dir": str(given)} if given else {})}
    out = None
    try:
        pm.execute_notebook(str(NOTEBOOK), str(nb_out), parameters=params, kernel_name=kernel_name(),
                            cwd=str(cwd), progress_bar=False, execution_timeout=180)
        out = printed_out(nb_out)
        assert out is not None and out.is_absolute()  # a path the user can open (issue 31, item 2)
        assert out.parent == expected
        assert (out / "results_baseline_ddp.json").is_file()
        if given:
            assert list(given.iterdir()) == [out]
        assert {p: sorted(p.iterdir()) if p.exists() else None for p in wrong} == before
        assert where != "elsewhere" or list(cwd.iterdir()) == []
    finally:
        made = out or printed_out(nb_out)
        if made is not None and made.parent == PROJECT_RUNS and made.name.endswith("_ddp"):
            shutil.rmtree(made, ignore_errors=True)
