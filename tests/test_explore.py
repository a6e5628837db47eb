"""The run explorer: run discovery, overlay plot, comparison table, and its notebook.

The run folders are two that `labkit experiment` wrote (issue 61: not written by hand), copied
to the test's runs/ under the names the lab gave them: conftest's session experiment (``full``:
ddp, allreduce and ps, 2 repeats) and its failed experiment (``part``: ddp, and a ps that
failed); beside them a folder a run left before any result (the files the lab writes first),
runs/latest and a README. What the explorer shows is checked against the result files as the
trainer wrote them.
"""
from __future__ import annotations

import json
import os
import shutil
import types
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # tests draw figures without a display

import matplotlib.pyplot as plt  # noqa: E402
import nbformat  # noqa: E402
import papermill as pm  # noqa: E402
import pytest  # noqa: E402

from helpers import ROOT, load_json  # noqa: E402
from labkit.runs import explore
from labkit.core import layout
from labkit.core.methods import METHOD_NAMES, METHOD_ORDER, RESULT_FILES  # noqa: E402
from labkit.core.status import Status  # noqa: E402

# conftest's session experiment and failed experiment: on the worker that builds them, after
# them (on the other, a test would wait minutes for them)
pytestmark = pytest.mark.xdist_group("experiment")

NOTEBOOK = ROOT / "notebooks" / "explore.ipynb"


def kernel_name() -> str:
    from jupyter_client.kernelspec import KernelSpecManager
    return "labkit" if "labkit" in KernelSpecManager().find_kernel_specs() else "python3"


def result_path(run: Path, method: str) -> Path:
    """The method's result file the explorer reads: its first repeat's."""
    return sorted(run.rglob(RESULT_FILES[method]))[0]


def result(run: Path, method: str) -> dict:
    """The method's result file as the trainer wrote it."""
    return load_json(result_path(run, method))


def points(doc: dict, metric: str) -> int:
    """How many points a result file has of ``metric``: its steps' losses, or its epochs."""
    if metric == "all_losses":
        return len(doc.get("all_losses") or [])
    return sum(isinstance(e.get(metric), (int, float)) for e in doc.get("epochs", []))


@pytest.fixture
def lab_runs(tmp_path, experiment, failed_experiment) -> types.SimpleNamespace:
    """tmp_path/runs/ (``root``) and its runs' names: ``full``, ``part`` and ``newest_first``
    (the lab names a run folder by the time it started); ``methods``: {name: its methods}."""
    root = tmp_path / "runs"
    for e in (experiment, failed_experiment):
        shutil.copytree(e.run, root / e.run.name, symlinks=True, ignore=shutil.ignore_patterns("*.pt"))
    full, part = experiment.run.name, failed_experiment.run.name
    newest_first = sorted([full, part], reverse=True)
    # a run stopped before any result: what ExperimentFolder writes before the first method
    unfinished = root / "stopped-before-any-result"
    unfinished.mkdir()
    for name in (layout.CONFIG, layout.ENVIRONMENT, layout.LOCK):
        shutil.copy(experiment.run / name, unfinished / name)
    (root / "README.md").write_text("not a run")
    os.symlink(root / newest_first[0], root / "latest")
    return types.SimpleNamespace(root=root, full=full, part=part, newest_first=newest_first,
                                 methods={full: ["ddp", "allreduce", "ps"], part: ["ddp", "ps"]})


def test_find_runs_newest_first_skipping_latest_and_empty_folders(lab_runs, tmp_path):
    assert [p.name for p in explore.find_runs(lab_runs.root)] == lab_runs.newest_first
    assert explore.find_runs(tmp_path / "nowhere") == []


def test_load_runs_goes_through_report_load_run(lab_runs):
    runs = explore.load_runs(explore.find_runs(lab_runs.root))
    assert [r.name for r in runs] == lab_runs.newest_first
    for r in runs:
        assert set(r.docs) == set(lab_runs.methods[r.name])
    by = {r.name: r for r in runs}
    # a complete run has no problem; the failed experiment's one is its failed ps
    assert not by[lab_runs.full].problems
    assert list(by[lab_runs.part].problems) == ["ps"]
    assert by[lab_runs.part].problems["ps"].startswith(Status.FAILED)


@pytest.mark.parametrize("metric", ["train_loss", "val_accuracy", "all_losses"])
def test_overlay_draws_one_labelled_line_per_run_and_method(lab_runs, metric):
    runs = explore.load_runs(explore.find_runs(lab_runs.root))
    ax = explore.plot_overlay(runs, metric)
    lines = ax.get_lines()
    # every (run, method) whose result file has the metric, newest run first, in method order
    drawn = [(name, m) for name in lab_runs.newest_first for m in METHOD_ORDER
             if m in lab_runs.methods[name] and points(result(lab_runs.root / name, m), metric)]
    expected = [f"{name} / {METHOD_NAMES[m]}" for name, m in drawn]
    assert len(drawn) >= 4  # both runs' ddp, the full run's allreduce and ps at least
    assert [l.get_label() for l in lines] == expected
    assert [len(l.get_xdata()) for l in lines] == [
        points(result(lab_runs.root / name, m), metric) for name, m in drawn]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == expected
    assert ax.get_xlabel() in ("epoch", "step (over all epochs)") and ax.get_ylabel()
    plt.close(ax.figure)


def test_overlay_selection_and_metrics_some_methods_lack(lab_runs):
    runs = explore.load_runs(explore.find_runs(lab_runs.root))
    part = lab_runs.part
    ax = explore.plot_overlay(runs, "train_throughput", run_names=[part], methods=["ddp"])
    assert [l.get_label() for l in ax.get_lines()] == [f"{part} / {METHOD_NAMES['ddp']}"]
    plt.close(ax.figure)
    # only the all-reduce records avg_comm_time: no empty lines for DDP / PS
    ax = explore.plot_overlay(runs, "avg_comm_time")
    assert [l.get_label() for l in ax.get_lines()] == [f"{lab_runs.full} / {METHOD_NAMES['allreduce']}"]
    plt.close(ax.figure)
    # nothing to draw (the failed experiment ran no all-reduce): an explanation instead of an
    # empty legend
    ax = explore.plot_overlay(runs, "avg_comm_time", run_names=[part])
    assert not ax.get_lines() and ax.get_legend() is None and ax.texts
    plt.close(ax.figure)


def test_available_metrics(lab_runs):
    runs = explore.load_runs(explore.find_runs(lab_runs.root))
    ms = explore.available_metrics(runs)
    assert ms[0] == "all_losses" and {"val_accuracy", "avg_comm_time", "avg_comm_time_push"} <= set(ms)
    part = [r for r in runs if r.name == lab_runs.part]
    # a run without the all-reduce (its ps failed before a step: no PS times either): the
    # metrics its result files record, in the same order, less the all-reduce's own
    recorded = [m for m in ms if any(points(result(lab_runs.root / lab_runs.part, x), m)
                                     for x in lab_runs.methods[lab_runs.part])]
    assert "avg_comm_time" not in recorded and len(recorded) >= 5
    assert explore.available_metrics(part) == recorded


def test_comparison_table_has_each_run_and_method(lab_runs):
    runs = explore.load_runs(explore.find_runs(lab_runs.root))
    html = explore.comparison_table(runs)
    assert html.startswith("<table>")
    for name in lab_runs.newest_first:
        assert html.count(f"<td>{name}</td>") == len(lab_runs.methods[name])
    for m in ("ddp", "allreduce", "ps"):
        assert METHOD_NAMES[m] in html
    for col in ("avg throughput (img/s)", "best val accuracy (%)", "final train loss"):
        assert f"<th>{col}</th>" in html
    rows = explore.comparison_rows(runs, run_names=[lab_runs.full], methods=["allreduce"])
    doc = result(lab_runs.root / lab_runs.full, "allreduce")
    assert len(rows) == 1 and rows[0]["epochs"] == len(doc["epochs"]) >= 1
    assert rows[0]["best val accuracy (%)"] == doc["summary"]["best_val_accuracy"]
    assert rows[0]["final train loss"] == pytest.approx(doc["epochs"][-1]["train_loss"])


def test_comparison_table_shows_a_corrupt_result(lab_runs):
    full = lab_runs.root / lab_runs.full
    result_path(full, "ps").write_text('{"method": "Param')
    runs = explore.load_runs(explore.find_runs(lab_runs.root))
    rows = explore.comparison_rows(runs, run_names=[lab_runs.full])
    assert [r["method"] for r in rows] == [METHOD_NAMES[m] for m in ("ddp", "allreduce", "ps")]
    assert "not valid JSON" in rows[2]["status"]


def test_committed_notebook_has_no_outputs_and_the_labkit_kernel():
    nb = json.loads(NOTEBOOK.read_text())
    assert nb["metadata"]["kernelspec"] == {"name": "labkit", "display_name": "Python (labkit)",
                                           "language": "python"}
    for c in nb["cells"]:
        if c["cell_type"] == "code":
            assert c["outputs"] == [] and c["execution_count"] is None
    params = next(c for c in nb["cells"] if "parameters" in c["metadata"].get("tags", []))
    assert "runs_dir = None" in "".join(params["source"])  # the project's runs/, from any folder
    assert "interactive = True" in "".join(params["source"])


def execute(runs_dir, tmp_path, interactive=False):
    out = tmp_path / "explore_out.ipynb"
    pm.execute_notebook(str(NOTEBOOK), str(out),
                        parameters={"runs_dir": str(runs_dir), "interactive": interactive},
                        kernel_name=kernel_name(), cwd=str(NOTEBOOK.parent), progress_bar=False,
                        execution_timeout=60)
    nb = nbformat.read(out, as_version=4)
    return [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]


def data_of(outputs, mime):
    return [o["data"][mime] for o in outputs if mime in o.get("data", {})]


def test_notebook_executes_and_holds_static_figures(lab_runs, tmp_path):
    outputs = execute(lab_runs.root, tmp_path)
    assert len(data_of(outputs, "image/png")) == 3  # loss, val accuracy, throughput
    tables = [h for h in data_of(outputs, "text/html") if "<table>" in h]
    assert tables and lab_runs.full in tables[0] and lab_runs.part in tables[0]


def test_notebook_on_an_empty_runs_dir(tmp_path):
    empty = tmp_path / "runs"
    empty.mkdir()
    outputs = execute(empty, tmp_path)
    assert not data_of(outputs, "image/png")
    assert any("No run folders with results under" in t for t in data_of(outputs, "text/markdown"))


def test_explorer_widgets_redraw_on_a_change(lab_runs, monkeypatch):
    """The widget path, without a kernel: changing the metric redraws that metric."""
    import matplotlib
    matplotlib.use("Agg")
    runs = explore.load_runs(explore.find_runs(lab_runs.root))
    drawn = []
    real = explore.plot_overlay
    monkeypatch.setattr(explore, "plot_overlay", lambda r, metric, *a, **k: drawn.append(metric) or real(r, metric, *a, **k))
    box = explore.explorer(runs)
    run_pick, method_pick, metric_pick = box.children[0].children
    assert list(run_pick.value) == [r.name for r in runs[:3]]
    assert drawn == []  # nothing drawn until a selection changes
    metric_pick.value = "val_accuracy"
    assert drawn == ["val_accuracy"]


def test_explorer_draws_the_default_selection_when_shown(lab_runs):
    """Displayed in a notebook, the explorer shows the default selection at once, no click."""
    import base64

    runs = explore.load_runs(explore.find_runs(lab_runs.root))
    box = explore.explorer(runs)
    out = box.children[2]
    assert out.outputs == ()  # building the box draws nothing
    assert "application/vnd.jupyter.widget-view+json" in box._repr_mimebundle_()
    png, table = out.outputs
    assert base64.b64decode(png["data"]["image/png"]).startswith(b"\x89PNG")
    assert all(name in table["data"]["text/html"] for name in lab_runs.newest_first)
