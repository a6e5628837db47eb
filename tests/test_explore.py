"""The run explorer: run discovery, overlay plot, comparison table, and its notebook.

Result files are written by hand in the trainer's schema (no training here): a fake runs dir
with two runs, the older one holding only ddp and ps.
"""
from __future__ import annotations

import json
import os

import matplotlib

matplotlib.use("Agg")  # tests draw figures without a display

import matplotlib.pyplot as plt  # noqa: E402
import nbformat  # noqa: E402
import papermill as pm  # noqa: E402
import pytest  # noqa: E402

from helpers import ROOT  # noqa: E402
from labkit.analysis import explore  # noqa: E402
from labkit.core.methods import METHOD_NAMES, RESULT_FILES  # noqa: E402

NOTEBOOK = ROOT / "notebooks" / "explore.ipynb"
OLD, NEW = "2026-01-01_10-00-00", "2026-01-02_09-30-00"


def kernel_name() -> str:
    from jupyter_client.kernelspec import KernelSpecManager
    return "labkit" if "labkit" in KernelSpecManager().find_kernel_specs() else "python3"


def result_doc(method: str, epochs: int = 2, steps: int = 3, offset: float = 0.0) -> dict:
    comm = {"allreduce": {"avg_comm_time": 0.02},
            "ps": {"avg_comm_time_pull": 0.01, "avg_comm_time_push": 0.05}}.get(method, {})
    eps, all_losses = [], []
    for e in range(1, epochs + 1):
        losses = [round(2.5 - 0.3 * e - 0.05 * s + offset, 4) for s in range(steps)]
        all_losses += losses
        eps.append({"epoch": e, "train_loss": sum(losses) / steps, "train_accuracy": 40.0 + 20 * e,
                    "train_time": 10.0, "train_throughput": 100.0 + e, "avg_batch_time": 0.3,
                    "val_loss": 2.0 - 0.4 * e, "val_accuracy": 50.0 + 15 * e, **comm,
                    "all_losses": losses})
    return {"method": METHOD_NAMES[method], "world_size": 4, "batch_size": 32,
            "status": "completed", "epochs": eps,
            "summary": {"avg_train_throughput": 101.5, "avg_train_time_per_epoch": 10.0,
                        "best_val_accuracy": 50.0 + 15 * epochs},
            "all_losses": all_losses}


def write_run(root, name: str, methods, **kw) -> None:
    for m in methods:
        d = root / name / m
        d.mkdir(parents=True)
        (d / RESULT_FILES[m]).write_text(json.dumps(result_doc(m, **kw)))
    (root / name / "config.json").write_text("{}")


@pytest.fixture
def fake_runs(tmp_path):
    root = tmp_path / "runs"
    write_run(root, OLD, ["ddp", "ps"], offset=0.2)
    write_run(root, NEW, ["ddp", "allreduce", "ps"])
    (root / "2026-01-03_00-00-00").mkdir()  # a run that failed before writing any result
    (root / "2026-01-03_00-00-00" / "config.json").write_text("{}")
    (root / "README.md").write_text("not a run")
    os.symlink(root / NEW, root / "latest")
    return root


def test_find_runs_newest_first_skipping_latest_and_empty_folders(fake_runs, tmp_path):
    assert [p.name for p in explore.find_runs(fake_runs)] == [NEW, OLD]
    assert explore.find_runs(tmp_path / "nowhere") == []


def test_load_runs_goes_through_report_load_run(fake_runs):
    runs = explore.load_runs(explore.find_runs(fake_runs))
    assert [r.name for r in runs] == [NEW, OLD]
    assert set(runs[0].docs) == {"ddp", "allreduce", "ps"} and set(runs[1].docs) == {"ddp", "ps"}
    assert not runs[0].problems and not runs[1].problems


@pytest.mark.parametrize("metric,n_points", [("train_loss", 2), ("val_accuracy", 2),
                                             ("all_losses", 6)])
def test_overlay_draws_one_labelled_line_per_run_and_method(fake_runs, metric, n_points):
    runs = explore.load_runs(explore.find_runs(fake_runs))
    ax = explore.plot_overlay(runs, metric)
    lines = ax.get_lines()
    expected = [f"{NEW} / {METHOD_NAMES[m]}" for m in ("ddp", "allreduce", "ps")] + \
               [f"{OLD} / {METHOD_NAMES[m]}" for m in ("ddp", "ps")]
    assert [l.get_label() for l in lines] == expected
    assert all(len(l.get_xdata()) == n_points for l in lines)
    assert [t.get_text() for t in ax.get_legend().get_texts()] == expected
    assert ax.get_xlabel() in ("epoch", "step (over all epochs)") and ax.get_ylabel()
    plt.close(ax.figure)


def test_overlay_selection_and_metrics_some_methods_lack(fake_runs):
    runs = explore.load_runs(explore.find_runs(fake_runs))
    ax = explore.plot_overlay(runs, "train_throughput", run_names=[OLD], methods=["ps"])
    assert [l.get_label() for l in ax.get_lines()] == [f"{OLD} / {METHOD_NAMES['ps']}"]
    plt.close(ax.figure)
    # only the all-reduce records avg_comm_time: no empty lines for DDP / PS
    ax = explore.plot_overlay(runs, "avg_comm_time")
    assert [l.get_label() for l in ax.get_lines()] == [f"{NEW} / {METHOD_NAMES['allreduce']}"]
    plt.close(ax.figure)
    # nothing to draw: an explanation instead of an empty legend
    ax = explore.plot_overlay(runs, "avg_comm_time", run_names=[OLD])
    assert not ax.get_lines() and ax.get_legend() is None and ax.texts
    plt.close(ax.figure)


def test_available_metrics(fake_runs):
    runs = explore.load_runs(explore.find_runs(fake_runs))
    ms = explore.available_metrics(runs)
    assert ms[0] == "all_losses" and {"val_accuracy", "avg_comm_time", "avg_comm_time_push"} <= set(ms)
    assert explore.available_metrics(runs[1:]) == [m for m in ms if m != "avg_comm_time"]


def test_comparison_table_has_each_run_and_method(fake_runs):
    runs = explore.load_runs(explore.find_runs(fake_runs))
    html = explore.comparison_table(runs)
    assert html.startswith("<table>")
    for name in (NEW, OLD):
        assert html.count(f"<td>{name}</td>") == (3 if name == NEW else 2)
    for m in ("ddp", "allreduce", "ps"):
        assert METHOD_NAMES[m] in html
    for col in ("avg throughput (img/s)", "best val accuracy (%)", "final train loss"):
        assert f"<th>{col}</th>" in html
    rows = explore.comparison_rows(runs, run_names=[NEW], methods=["allreduce"])
    assert len(rows) == 1 and rows[0]["epochs"] == 2 and rows[0]["best val accuracy (%)"] == 80.0
    assert rows[0]["final train loss"] == pytest.approx((1.9 + 1.85 + 1.8) / 3)


def test_comparison_table_shows_a_corrupt_result(fake_runs):
    (fake_runs / OLD / "ps" / RESULT_FILES["ps"]).write_text('{"method": "Param')
    runs = explore.load_runs(explore.find_runs(fake_runs))
    rows = explore.comparison_rows(runs, run_names=[OLD])
    assert [r["method"] for r in rows] == [METHOD_NAMES["ddp"], METHOD_NAMES["ps"]]
    assert "not valid JSON" in rows[1]["status"]


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


def test_notebook_executes_and_holds_static_figures(fake_runs, tmp_path):
    outputs = execute(fake_runs, tmp_path)
    assert len(data_of(outputs, "image/png")) == 3  # loss, val accuracy, throughput
    tables = [h for h in data_of(outputs, "text/html") if "<table>" in h]
    assert tables and NEW in tables[0] and OLD in tables[0]


def test_notebook_on_an_empty_runs_dir(tmp_path):
    empty = tmp_path / "runs"
    empty.mkdir()
    outputs = execute(empty, tmp_path)
    assert not data_of(outputs, "image/png")
    assert any("No run folders with results under" in t for t in data_of(outputs, "text/markdown"))


def test_explorer_widgets_redraw_on_a_change(fake_runs, monkeypatch):
    """The widget path, without a kernel: changing the metric redraws that metric."""
    import matplotlib
    matplotlib.use("Agg")
    runs = explore.load_runs(explore.find_runs(fake_runs))
    drawn = []
    real = explore.plot_overlay
    monkeypatch.setattr(explore, "plot_overlay", lambda r, metric, *a, **k: drawn.append(metric) or real(r, metric, *a, **k))
    box = explore.explorer(runs)
    run_pick, method_pick, metric_pick = box.children[0].children
    assert list(run_pick.value) == [r.name for r in runs[:3]]
    assert drawn == []  # nothing drawn until a selection changes
    metric_pick.value = "val_accuracy"
    assert drawn == ["val_accuracy"]


def test_explorer_draws_the_default_selection_when_shown(fake_runs):
    """Displayed in a notebook, the explorer shows the default selection at once, no click."""
    import base64

    runs = explore.load_runs(explore.find_runs(fake_runs))
    box = explore.explorer(runs)
    out = box.children[2]
    assert out.outputs == ()  # building the box draws nothing
    assert "application/vnd.jupyter.widget-view+json" in box._repr_mimebundle_()
    png, table = out.outputs
    assert base64.b64decode(png["data"]["image/png"]).startswith(b"\x89PNG")
    assert NEW in table["data"]["text/html"] and OLD in table["data"]["text/html"]
