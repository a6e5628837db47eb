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
from labkit.lab.kernels import kernel_name
from labkit.lab.launch_params import LAUNCH_PARAMS

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
    fields = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    assert set(params) == set(fields) | set(LAUNCH_PARAMS)
    assert {k: params[k] for k in fields} == fields  # same defaults as the command line


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
