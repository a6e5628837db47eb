"""Issue 71, items 4 and 5. A result file that lies about its types (a loss written as "abc", an
instrument's record cut short on one rank) is refused as it is read, in one line naming the file,
the epoch and the key, and `labkit report` reports the other files and exits 1 with that line;
what the guide's files leave out or write as null still reads. A folder made by `labkit run
--out DIR` (its result file straight in the folder, beside resolved.json and launch.json) is a
row of the lab notebook (`labkit runs`), with its method, status and throughput in its
workload's unit. In-process: the files are the lab's own (tests/data/run-before-issue-58, whose
method folders have the very shape a `labkit run` folder has), changed where a test says."""
from __future__ import annotations

import copy
import json
import math
import shutil
from pathlib import Path

import pytest

from labkit.core.results import Result, ResultError, read_result
from labkit.core.run_folder import RunFolder
from labkit.runs import readers, runs_index

from helpers import ROOT

OLD_RUN = ROOT / "tests" / "data" / "run-before-issue-58"
PS_DOC = json.loads((OLD_RUN / "ps" / "results_ps.json").read_text())


def lying(change) -> dict:
    """The lab's results_ps.json with ``change`` applied to its first epoch."""
    doc = copy.deepcopy(PS_DOC)
    change(doc["epochs"][0])
    return doc


def cut_short(e: dict) -> None:
    """One rank's record of the time it was held in synchronisation lost its last step."""
    e["sync_held"] = {"ranks": [0, 1], "times": [[0.07, 0.06], [0.08]]}


def rank_held(e: dict) -> None:
    e["sync_held"] = {"ranks": [0, 1], "times": [[0.07, 0.06]]}


def parts_cut(e: dict) -> None:
    e["step_parts"] = {**e["step_parts"], "sync": e["step_parts"]["sync"][:1]}


# each lie, and what the user is told after the file's path
LIES = {
    "text loss": (lambda e: e.update(train_loss="abc"), 'epoch 1: train_loss is "abc", not a number'),
    "sync_held cut short": (cut_short, "epoch 1: sync_held times differ in length: rank 1 has 1 "
                                       "where the others have 2 steps (a record cut short)"),
    "sync_held rank lost": (rank_held, "epoch 1: sync_held has 2 ranks but 1 lists of times"),
    "step_parts cut short": (parts_cut, "epoch 1: step_parts lists differ in length: sync has 1 "
                                        "where the others have 2 steps (a record cut short)"),
    "loss in all_losses": (lambda e: e["all_losses"].__setitem__(2, "nan?"),
                           'epoch 1: all_losses[2] is "nan?", not a number'),
    "step_times not a list": (lambda e: e.update(step_times=0.07),
                              "epoch 1: step_times is 0.07, not a list"),
    "phase time": (lambda e: e.update(comm_times_pull=[0.01, "0.02"]),
                   'epoch 1: comm_times_pull[1] is "0.02", not a number'),
    "wire": (lambda e: e.update(wire="19612968"), 'epoch 1: wire is "19612968", not an object'),
    "epoch number": (lambda e: e.update(epoch="1"), 'epochs[0]: epoch is "1", not a whole number'),
}


@pytest.mark.parametrize("lie", LIES, ids=list(LIES))
def test_a_result_file_that_lies_about_its_types_is_refused_in_one_line(tmp_path, lie):
    change, why = LIES[lie]
    path = tmp_path / "results_ps.json"
    path.write_text(json.dumps(lying(change)))
    with pytest.raises(ResultError) as e:
        read_result(path)
    assert str(e.value) == f"{path}: {why}"


def test_a_summary_or_a_files_figure_that_lies_is_refused_too():
    doc = {**copy.deepcopy(PS_DOC), "summary": {**PS_DOC["summary"], "best_val_accuracy": "88.67"}}
    with pytest.raises(ResultError, match=r'^f: summary: best_val_accuracy is "88.67", not a number$'):
        Result.from_dict(doc, "f")
    with pytest.raises(ResultError, match=r'^f: world_size is "2", not a whole number$'):
        Result.from_dict({**PS_DOC, "world_size": "2"}, "f")


def test_what_the_guides_files_leave_out_or_write_null_still_reads():
    """The guide's keys only, ints where floats are expected, nulls where a figure was not
    known (NaN), null lists and records of the lab: all legal."""
    guide = {"method": "Parameter Server (PS)", "world_size": 4, "batch_size": 64,
             "epochs": [{"epoch": 1, "train_loss": 1, "train_accuracy": None, "train_time": 300,
                         "train_throughput": 512.3, "avg_comm_time_pull": None}],
             "summary": {"avg_train_throughput": 510, "best_val_accuracy": None},
             "all_losses": [0.9, None, 0.5]}
    r = Result.from_dict(guide)
    e = r.epochs[0]
    assert e.train_loss == 1 and math.isnan(e.train_accuracy) and math.isnan(e.comm["pull"])
    assert r.summary.avg_train_throughput == 510 and math.isnan(r.all_losses[1])
    lab = lying(lambda e: e.update(mfu=None, step_times=[0.1, None], sync_held=None, wire=None,
                                   comm_busy_times=[0.05, None], step_parts=None))
    assert Result.from_dict(lab).epochs[0].sync_held is None


def write_run(run: Path, lie=None) -> Path:
    """The lab's run folder (ddp, allreduce, ps, nosync), ``lie`` applied to its ps file."""
    shutil.copytree(OLD_RUN, run)
    if lie is not None:
        (run / "ps" / "results_ps.json").write_text(json.dumps(lying(lie)))
    return run


@pytest.mark.parametrize("lie", ["text loss", "sync_held cut short"])
def test_labkit_report_names_the_lying_file_reports_the_others_and_exits_1(tmp_path, capsys, lie):
    """Before: "abc" in the per-epoch table and exit 0; numpy's "inhomogeneous shape" traceback."""
    change, why = LIES[lie]
    run = write_run(tmp_path / "run", change)
    assert readers.report_command([str(run)], str(tmp_path / "out")) == 1
    out = capsys.readouterr().out
    line = f"{run / 'ps' / 'results_ps.json'}: {why}"
    assert f"- Problem: Parameter Server: {line}" in out
    assert "abc" not in out.replace(line, "")
    # the rest of the report is written: the other methods' tables, the plots, the text report
    assert "Baseline DDP (PyTorch): per epoch" in out and "Manual All-Reduce" in out
    assert (tmp_path / "out" / "performance_report.txt").is_file()


def test_a_variants_lying_file_is_a_problem_of_the_run_too(tmp_path):
    """Before: a variant's file (`--methods ps,ps-async`) that could not be read was left out of
    the report without a word, and `labkit report` exited 0."""
    from labkit import report

    run = write_run(tmp_path / "run")
    (run / "ps-async").mkdir()
    bad = run / "ps-async" / "results_ps.json"
    bad.write_text(json.dumps(lying(cut_short)))
    res = report.load_run(run)
    assert res.problems == {"ps-async": f"{bad}: {LIES['sync_held cut short'][1]}"}
    assert set(res.docs) == {"ddp", "allreduce", "ps", "nosync"}


# the launcher's resolved.json of `labkit run ddp --workload lm --nproc 2` and what its result
# file records of the workload (a real run's, cut to the keys read here)
LM_WORKLOAD = {"name": "lm", "title": "language modelling", "unit": "tokens", "rate": "tokens/s",
               "units_per_sample": 64,
               "figures": [{"key": "val_loss", "label": "validation loss", "unit": "nats/token",
                            "higher_is_better": False, "short": "loss"}],
               "references": {}}


def labkit_run_folder(folder: Path, method: str, lm: bool = False) -> Path:
    """A folder as `labkit run METHOD --out DIR` leaves it: resolved.json, launch.json and the
    result file straight in it (an experiment's method folder has the same files)."""
    shutil.copytree(OLD_RUN / method, folder)
    if lm:
        resolved = json.loads((folder / "resolved.json").read_text())
        resolved["train"].update(workload="lm", dataset="embedded", model="tiny", seq_len=64)
        (folder / "resolved.json").write_text(json.dumps(resolved))
        result = next(folder.glob("results_*.json"))
        doc = json.loads(result.read_text())
        doc["workload"] = LM_WORKLOAD
        result.write_text(json.dumps(doc))
    return folder


def test_a_labkit_run_folder_is_a_row_of_the_lab_notebook(tmp_path):
    """Before: "unreadable: not a run folder (no config.json, experiment.json, result file,
    sweep.json or bench.json)" for a folder holding a result file."""
    runs = tmp_path / "runs"
    labkit_run_folder(runs / "ps3", "ps")
    labkit_run_folder(runs / "lm1", "ddp", lm=True)
    rows = {r.name: r for r in runs_index.scan(runs)}
    ps, lm = rows["ps3"], rows["lm1"]
    assert (ps.kind, ps.methods, ps.status, ps.nproc, ps.problem) == ("run", ["ps"], "completed", 2, None)
    assert ps.rate == "img/s" and ps.results["ps"]["throughput"] > 0
    assert (lm.kind, lm.methods, lm.rate, lm.problem) == ("run", ["ddp"], "tokens/s", None)
    assert lm.params["workload"] == "lm" and ps.params["workload"] == "images"
    text = runs_index.text(list(rows.values()))
    assert "unreadable" not in text and " tokens/s" in text and " img/s" in text


def test_a_labkit_run_that_failed_before_its_result_file_is_a_failed_row(tmp_path):
    folder = labkit_run_folder(tmp_path / "runs" / "ps3", "ps")
    (folder / "results_ps.json").unlink()
    launch = json.loads((folder / "launch.json").read_text())
    (folder / "launch.json").write_text(json.dumps({**launch, "returncode": 1}))
    (row,) = runs_index.scan(tmp_path / "runs")
    assert (row.kind, row.status, row.methods, row.problem) == ("run", "failed", ["ps"], None)
    # a folder of nothing labkit wrote is still no run folder, and says what one holds
    (tmp_path / "other").mkdir()
    with pytest.raises(ValueError, match=r"^not a run folder \(no config.json, experiment.json, "
                                         r"resolved.json, results_\*.json, sweep.json or bench.json\)$"):
        RunFolder(tmp_path / "other").kind
