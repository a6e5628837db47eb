"""Where the time goes: the breakdown of a step for every method (DDP's communication timed
through its hook), overlap with its interval, the rank the others waited for, and time to
accuracy (labkit.analysis.breakdown and the report that shows them)."""
import shutil

import numpy as np
import pytest
import torch

from helpers import HOOKS, TINY, check_ok, load_json, torchrun
from labkit.analysis import breakdown, report
from labkit.analysis.report import load_files
from labkit.core.methods import SHORT

# enough steady-state steps in one epoch for a batch-means interval that a busy 2-core machine
# does not swamp: 41 steps in 6 blocks of about 7 (with 12 steps in 4 blocks of 3, the overlap
# interval of a full suite run once reached down to 0). Steps of 16 images take tens of ms:
# the launch, not the steps, is what these runs cost.
STEPS = [a for a in TINY if a not in ("--max-steps-per-epoch", "5", "--batch-size", "8")] + [
    "--max-steps-per-epoch", "44", "--batch-size", "16"]


# ------------------------------------------------------------------ the definitions, by hand
def test_split_adds_the_parts_up_to_the_step():
    parts = {"data": [1.0], "pull": [2.0], "compute": [10.0], "sync": [3.0], "optimizer": [0.5],
             "other": [0.25]}
    s = breakdown.split(parts, compute_only=8.0, busy=[9.0], server=[1.5])
    # synchronisation added 2.0 to forward+backward, plus 2.0 pull and 3.0 sync waits = 7.0,
    # of which the trainers spent 1.5 waiting for the server's update
    assert s["compute"][0] == 8.0 and s["exposed"][0] == 5.5 and s["optimizer"][0] == 2.0
    assert s["hidden"][0] == 3.5  # 9.0 of collectives running, 5.5 of them exposed
    assert sum(s[k][0] for k in breakdown.ORDER) == sum(v[0] for v in parts.values())
    # a compute-only step slower than the synchronised one: compute is capped, nothing exposed
    s = breakdown.split({**parts, "pull": [0.0], "sync": [0.0]}, compute_only=12.0)
    assert s["compute"][0] == 10.0 and s["exposed"][0] == 0.0 and np.isnan(s["hidden"][0])


def test_overlap_interval_and_who_arrived_last():
    rng = np.random.default_rng(0)
    hidden = [rng.normal(3.0, 0.3, 16)]
    total = [h + rng.normal(3.0, 0.3, 16) for h in hidden]
    iv = breakdown.ratio_interval(hidden, total)
    assert iv.available and iv.low < 0.5 < iv.high and 0.4 < iv.value < 0.6
    none = breakdown.ratio_interval([np.zeros(16)], total)
    assert none.value == 0.0 and none.low == 0.0

    # held in compute + pull + sync per step, against each rank's own compute-only time
    doc = {"epochs": [{"sync_held": {"ranks": [0, 1, 2], "times": [[15, 15, 16, 15], [10, 11, 10, 10],
                                                                  [14, 10.5, 13, 14]]}}],
           "calibration": {"rank_compute": [10.0, 10.0, 10.0]}}
    w = breakdown.waits(doc)
    assert w.last == 1 and w.last_share == [0.0, 0.75, 0.25] and w.mean_wait[0] == 5.25


def test_time_to_accuracy_and_not_reached():
    doc = {"epochs": [{"epoch": i + 1, "val_accuracy": a, "train_time": 2.0, "val_time": 0.5,
                       "steps": 10} for i, a in enumerate([50.0, 80.0, 90.0])]}
    r = breakdown.time_to_accuracy(doc, 85.0)
    assert (r.seconds, r.steps, r.epoch) == (7.5, 30, 3)
    assert not breakdown.time_to_accuracy(doc, 95.0).reached
    assert breakdown.target_accuracy({"a": doc}) == pytest.approx(0.95 * 90.0)
    assert breakdown.target_accuracy({"a": doc}, 70.0) == 70.0


# ------------------------------------------------------------------ real runs
@pytest.mark.slow
def test_no_overlap_hides_nothing_and_overlap_hides_some(tmp_path):
    """The same data, allreduce with and without overlapping backward: with --no-overlap every
    bucket starts after backward, so nothing is hidden; with overlap some communication runs
    behind backward, and the interval says so."""
    got = {}
    for name, extra in (("overlap", []), ("no_overlap", ["--no-overlap"])):
        out = tmp_path / name
        check_ok(torchrun(2, STEPS + ["--method", "allreduce", "--bucket-mb", "1", *extra,
                                      "--out", str(out)], cwd=tmp_path))
        got[name] = breakdown.of_result(load_json(out / "results_all_reduce.json"))
    off, on = got["no_overlap"].overlap, got["overlap"].overlap
    assert off.value is not None and off.value < 0.05, off
    assert on.available and on.low > 0, on
    for b in got.values():  # the parts add up to the measured step
        assert b.total == pytest.approx(b.measured, rel=0.05)


@pytest.mark.slow
def test_a_late_rank_is_named_as_the_one_the_others_waited_for(tmp_path):
    out = tmp_path / "ddp"
    check_ok(torchrun(2, STEPS + ["--method", "ddp", "--out", str(out)], cwd=tmp_path,
                      env={"PYTHONPATH": HOOKS, "LABKIT_TEST_LATE": "1:0.1"}))
    doc = load_json(out / "results_baseline_ddp.json")
    w = breakdown.waits(doc)
    assert w.last == 1 and w.last_share[1] > 0.8, w
    # rank 0 waited the 100 ms rank 1 slept (more than a busy 2-core machine's own jitter)
    assert w.mean_wait[0] > w.mean_wait[1] + 0.06
    text = report.text_report(load_files([str(out)]))
    assert "rank 1 arrived last at the synchronisation point" in text
    # DDP's communication is a number in Table 2 now, not "inside PyTorch"
    ddp_row = next(r for r in report.communication_rows(load_files([str(out)]))
                   if r["Method"] == SHORT["ddp"])
    assert isinstance(ddp_row["Total comm time (ms)"], float) and ddp_row["Total comm time (ms)"] > 0


@pytest.mark.slow
def test_timing_ddp_changes_no_parameter(tmp_path, ddp_run):
    """ddp_run timed DDP's all-reduce through the communication hook (the default); the
    same run with DDP's built-in path must end with the same parameters, bit for bit."""
    out = tmp_path / "builtin"
    check_ok(torchrun(2, TINY + ["--method", "ddp", "--no-time-comm", "--out", str(out)],
                      cwd=tmp_path))
    timed = torch.load(ddp_run / "final_model.pt", weights_only=True)
    builtin = torch.load(out / "final_model.pt", weights_only=True)
    assert timed.keys() == builtin.keys()
    for k in timed:
        assert torch.equal(timed[k], builtin[k]), k
    hooked = load_json(ddp_run / "results_baseline_ddp.json")["epochs"][0]
    plain = load_json(out / "results_baseline_ddp.json")["epochs"][0]
    assert "comm_busy_times" in hooked and "comm_busy_times" not in plain
    # the bytes on the wire: counted per bucket by the hook, from the gradients without it
    for key in ("sent_per_step", "received_per_step"):
        assert plain["wire"][key] == pytest.approx(hooked["wire"][key], rel=1e-6), key
        assert min(plain["wire"][key]) > 0, key


def test_table_1_says_not_reached(tmp_path, ddp_run):
    shutil.copytree(ddp_run, tmp_path / "run")
    res = load_files([str(tmp_path / "run")])
    res.target_accuracy = 100.0
    row = report.comparison_rows(res)[0]
    assert row["Time to target (s)"] == "not reached" and row["Steps to target"] == "not reached"
    text = report.text_report(res)
    assert "not reached" in text and "validation accuracy first reaching 100.00%" in text
    res.target_accuracy = 1.0
    row = report.comparison_rows(res)[0]
    assert row["Time to target (s)"] > 0 and row["Steps to target"] == 5
