"""Notebooks: stored without outputs, parameters = the config, executable under papermill."""
from __future__ import annotations

import ast
import dataclasses
import json

import nbformat
import papermill as pm
import pytest

from helpers import ROOT, tiny_cfg
from labkit.core.config import TrainConfig
from labkit.core.params import default
from labkit.orchestrate.kernels import kernel_name
from labkit.launch import launch_params
from labkit.launch.launch_params import LAUNCH_PARAMS, NOTEBOOK_ONLY, LaunchParams

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def parameters_cell(path) -> dict:
    nb = nbformat.read(path, as_version=4)
    cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    tree = ast.parse(cell.source)
    return {n.targets[0].id: ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_notebooks_have_no_outputs(path):
    nb = json.loads(path.read_text())
    for c in nb["cells"]:
        if c["cell_type"] == "code":
            assert not c["outputs"] and c["execution_count"] is None, path.name


def test_run_method_parameters_map_one_to_one_to_the_config():
    params = parameters_cell(ROOT / "notebooks" / "run_method.ipynb")
    fields = {f.name: default(f) for f in dataclasses.fields(TrainConfig)}
    assert set(params) == set(fields) | set(LAUNCH_PARAMS) | set(NOTEBOOK_ONLY)
    assert {k: params[k] for k in fields} == fields  # same defaults as the command line
    launcher = {f.name: default(f) for f in dataclasses.fields(LaunchParams)}
    assert {k: params[k] for k in launcher} == launcher and params["resolved"] is None


def test_run_method_parameters_cell_is_made_from_the_config():
    """The cell is the one source's (TrainConfig's and LaunchParams' defaults and help), not
    kept by hand: a changed default or help text fails here until tools/parameters_cell.py
    writes the cell again."""
    nb = nbformat.read(ROOT / "notebooks" / "run_method.ipynb", as_version=4)
    cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    assert cell.source == launch_params.parameters_cell(), "run tools/parameters_cell.py"


def by_hand_cells() -> dict:
    """run_method.ipynb's parameters cell and the cell that reads it, run as a kernel would
    with no parameters given (the cells after them launch torchrun): the cell's namespace."""
    nb = nbformat.read(ROOT / "notebooks" / "run_method.ipynb", as_version=4)
    code = [c.source for c in nb.cells if c.cell_type == "code"]
    assert "notebook_params(globals())" in code[1] and "launch(" not in code[0] + code[1]
    ns: dict = {}
    for source in code[:2]:
        exec(compile(source, "run_method.ipynb", "exec"), ns)
    return ns


def test_run_method_by_hand_trains_with_labkit_experiments_defaults(monkeypatch):
    """No parameters given: the notebook's config resolves to exactly what `labkit experiment`
    with no flags resolves for the same method on this machine (both through the machine's
    defaults, then the launcher's resolution), and with as many processes."""
    from labkit import cli
    from labkit.orchestrate import experiment
    from labkit.launch.launch import validate

    monkeypatch.setattr("builtins.print", lambda *a, **k: None)  # the cell's one line
    ns = by_hand_cells()
    by_hand = validate(dataclasses.replace(ns["cfg"], out=None), ns["nproc"], ns["nodes"])
    cfg, exp, _ = cli._experiment_params({"methods": "ddp"})
    planned = experiment.plan(cfg, exp)
    assert by_hand.to_dict() == planned.resolved["ddp"].to_dict()
    assert ns["nproc"] == planned.nproc and ns["nodes"] == planned.exp.nodes
    assert ns["cfg"].batch_size == cfg.batch_size  # the machine's default, as given, for both


def test_resolved_carries_the_whole_config(tmp_path):
    """With `resolved`, the notebook runs the file's config; another parameter beside it is
    refused rather than silently ignored."""
    from labkit.core import resolved
    from labkit.core.config import ConfigError

    path = str(tmp_path / "resolved.json")
    cfg = TrainConfig(**tiny_cfg(backend="gloo", device="cpu", lr=0.01))
    resolved.write(path, cfg, 2, {"nnodes": 1, "node_rank": 0})
    ns = {**parameters_cell(ROOT / "notebooks" / "run_method.ipynb"), "resolved": path}
    got, nproc, nodes = launch_params.notebook_params(ns)
    assert got == cfg and nproc == 2 and nodes.nnodes == 1
    # the file's own values beside it (labkit experiment passes them, for the record): the same
    assert launch_params.notebook_params({**ns, **cfg.to_dict(), "nproc": 2})[0] == cfg
    with pytest.raises(ConfigError, match="epochs=5"):
        launch_params.notebook_params({**ns, "epochs": 5})


TINY = tiny_cfg(max_steps_per_epoch=3, max_val_steps=1, timeout=60.0, pin_cpus=None)


def test_wrong_parameter_type_is_named(tmp_path):
    with pytest.raises(pm.PapermillExecutionError) as e:
        pm.execute_notebook(str(ROOT / "notebooks" / "run_method.ipynb"), str(tmp_path / "nb.ipynb"),
                            parameters={**TINY, "epochs": "three"}, kernel_name=kernel_name(),
                            cwd=str(tmp_path), progress_bar=False)
    assert e.value.ename == "ConfigError"
    assert "epochs='three' has type str" in e.value.evalue


def test_unknown_parameter_is_named(tmp_path):
    with pytest.raises(pm.PapermillExecutionError) as e:
        pm.execute_notebook(str(ROOT / "notebooks" / "run_method.ipynb"), str(tmp_path / "nb.ipynb"),
                            parameters={**TINY, "learning_rate": 0.1}, kernel_name=kernel_name(),
                            cwd=str(tmp_path), progress_bar=False)
    assert e.value.ename == "ConfigError" and "unknown parameter(s): learning_rate" in e.value.evalue
