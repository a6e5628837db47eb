"""Each method writes the guide's result file with all of the guide's keys."""
from __future__ import annotations

import os

import pytest

from helpers import TINY, check_ok, load_json, torchrun

# the session's equivalence_runs are built once: every test using them on one xdist worker
pytestmark = pytest.mark.xdist_group("equivalence_runs")

# the guide's keys (../shared/reference/experiment-guide.md), per method
TOP = {"method", "world_size", "batch_size", "start_time", "end_time", "epochs", "summary", "all_losses"}
EPOCH = {"epoch", "train_loss", "train_accuracy", "train_time", "train_throughput",
         "avg_batch_time", "val_loss", "val_accuracy"}
SUMMARY = {"avg_train_throughput", "avg_train_time_per_epoch", "best_val_accuracy"}
GUIDE = {
    "ddp": ("results_baseline_ddp.json", "Baseline DDP (PyTorch)", TOP, EPOCH, SUMMARY),
    "allreduce": ("results_all_reduce.json", "Manual All-Reduce", TOP,
                  EPOCH | {"avg_comm_time", "all_losses"}, SUMMARY | {"final_train_accuracy"}),
    "ps": ("results_ps.json", "Parameter Server (PS)", TOP | {"num_workers"},
           EPOCH | {"avg_comm_time_pull", "avg_comm_time_push"},
           SUMMARY | {"avg_comm_time_pull", "avg_comm_time_push"}),
}
NPROC = {"ddp": 2, "allreduce": 2, "ps": 3}


def check_guide_file(d, method: str, epochs: int, steps: int) -> dict:
    fname, name, top, epoch_keys, summary_keys = GUIDE[method]
    r = load_json(d / fname)
    assert top <= set(r), top - set(r)
    assert r["method"] == name
    assert r["status"] == "completed"
    assert r["world_size"] == NPROC[method]
    assert r["end_time"] >= r["start_time"]
    assert len(r["epochs"]) == epochs
    for i, e in enumerate(r["epochs"], 1):
        assert epoch_keys <= set(e), epoch_keys - set(e)
        assert e["epoch"] == i
        assert 0 <= e["train_accuracy"] <= 100 and 0 <= e["val_accuracy"] <= 100
        assert e["train_time"] > 0 and e["train_throughput"] > 0 and e["avg_batch_time"] > 0
        assert e["val_samples"] > 0
        # issue 13: each steady-state step's duration (the warm-up steps left out, as in the
        # throughput), tiling the throughput window inside the epoch's training time
        warm = r["config"]["warmup_steps"] if steps > r["config"]["warmup_steps"] else 0
        st = e["step_times"]
        assert len(st) == steps - warm and all(t > 0 for t in st), st
        assert sum(st) <= e["train_time"]
        assert sum(st) / len(st) == pytest.approx(e["avg_batch_time"], rel=1e-3)
        for k in {"ddp": (), "allreduce": ("comm_times",),
                  "ps": ("comm_times_pull", "comm_times_push")}[method]:
            # comm times are the trainers' (averaged), step times rank 0's clock: inside the
            # window, where the ranks run in lockstep, a step's comm fits in the step. Its first
            # step is timed from each rank's own start, and a trainer may wait there for rank 0
            # (a PS server fsyncing the previous epoch's checkpoint: pull 0.30 s in a 0.26 s
            # step, clean-clone CI 2026-11-23), so only the later steps are bounded
            assert len(e[k]) == len(st) and all(c > 0 for c in e[k]), (k, e[k], st)
            assert all(c <= t for c, t in zip(e[k][1:], st[1:])), (k, e[k], st)
    assert summary_keys <= set(r["summary"]), summary_keys - set(r["summary"])
    assert r["summary"]["best_val_accuracy"] == max(e["val_accuracy"] for e in r["epochs"])
    assert len(r["all_losses"]) == epochs * steps
    if method == "ps":
        assert r["num_workers"] == NPROC["ps"] - 1
        assert all(e["avg_comm_time_pull"] > 0 and e["avg_comm_time_push"] > 0 for e in r["epochs"])
    if method == "allreduce":
        assert all(e["avg_comm_time"] > 0 for e in r["epochs"])
    # rank 0's cores: without GPUs its share of the cores the test may use (--pin-cpus, the
    # default) when the ranks can share them evenly, else all of them
    if hasattr(os, "sched_getaffinity"):
        allowed, w = sorted(os.sched_getaffinity(0)), NPROC[method]
        even = w <= len(allowed) or w % len(allowed) == 0
        share = allowed[:max(1, len(allowed) // w)]  # rank 0: the first share
        want = share if r["config"]["pin_cpus"] and even else allowed
        assert r["determinism"]["cpu_affinity"] == want, (r["config"]["pin_cpus"], want)
    # glibc's malloc thresholds fixed in the rank (dist.steady_malloc, called by every rank's
    # entry point): a rank that never called it records None
    if _glibc():
        assert r["determinism"]["malloc"] == {"mmap_threshold": 32 << 20, "trim_threshold": 64 << 20}
    assert (d / "final_model.pt").stat().st_size > 0
    assert "epoch 1/" in (d / "train.log").read_text()
    return r


def test_result_file_imagefolder(tmp_path, image_tree):
    """The guide's dataset, end to end under torchrun: PS, whose server loads no data and whose
    two workers each read their shard (the digits runs below cover every method's file)."""
    method = "ps"
    args = TINY[:]
    args[args.index("--dataset") + 1] = "imagefolder"
    out = tmp_path / "out"
    proc = torchrun(NPROC[method], args + ["--method", method, "--data-dir", str(image_tree),
                                           "--batch-size", "2", "--epochs", "2", "--out", str(out)],
                    cwd=tmp_path)
    check_ok(proc)
    r = check_guide_file(out, method, epochs=2, steps=min(5, (12 // (NPROC[method] - (method == "ps"))) // 2))
    assert r["config"]["dataset"] == "imagefolder"
    # 2 classes x 3 val images, each counted exactly once over the trainers
    assert r["epochs"][0]["val_samples"] == 6


@pytest.mark.parametrize("name,method", [("ddp", "ddp"), ("allreduce", "allreduce"),
                                         ("ps_collective", "ps"), ("ps_p2p", "ps")])
def test_result_files_digits(equivalence_runs, name, method):
    """The digits runs of the equivalence tests (1 epoch, 5 steps) wrote the guide's files."""
    r = check_guide_file(equivalence_runs[name][0], method, epochs=1, steps=5)
    assert r["config"]["pin_cpus"] is (name == "allreduce")  # conftest: the one bound run


@pytest.mark.slow  # not in make test-fast (not a method's exactness or bytes)
def test_same_seed_same_losses(equivalence_runs, ddp_rerun):
    """A rerun from the same seed logs exactly the same losses."""
    first = load_json(equivalence_runs["ddp"][0] / "results_baseline_ddp.json")["all_losses"]
    assert len(set(first)) == len(first)  # a real loss curve, not a constant
    again = ddp_rerun  # the session's second TINY ddp run, trained on its own (conftest)
    assert again != equivalence_runs["ddp"][0]
    assert load_json(again / "results_baseline_ddp.json")["all_losses"] == first


def _glibc() -> bool:
    import platform

    return platform.libc_ver()[0] == "glibc"


@pytest.mark.unit
def test_steady_malloc_fixes_glibcs_thresholds():
    """steady_malloc takes both thresholds where mallopt exists, and says so to determinism();
    a refused setting (musl's mallopt does nothing and answers 0) leaves it None, not claimed."""
    from unittest import mock

    from labkit.training import dist

    if not _glibc():
        assert dist.steady_malloc() is None
        return
    got = dist.steady_malloc()
    assert got == {"mmap_threshold": dist.MMAP_THRESHOLD, "trim_threshold": dist.TRIM_THRESHOLD}
    assert dist.determinism(0, "gloo")["malloc"] == got
    with mock.patch.object(dist, "_malloc", None), mock.patch("ctypes.CDLL") as libc:
        libc.return_value.mallopt.return_value = 0  # the C library refuses
        assert dist.steady_malloc() is None and dist.determinism(0, "gloo")["malloc"] is None


def test_an_epochs_loss_and_accuracy_are_its_steps_own():
    """The meter keeps each step's loss and right predictions as the step left them and folds
    them in as the bar reads them and at the epoch's end: the bar's figures after step 3 and the
    epoch's all_losses, train_loss and train_accuracy are the steps' own, computed here apart."""
    import torch

    from labkit.core.config import TrainConfig
    from labkit.training.dist import DistContext
    from labkit.training.instruments.meter import EpochMeter
    from labkit.training.sync.ddp import DDPStrategy
    from labkit.training.instruments.timers import StepParts

    cpu = torch.device("cpu")
    s = DDPStrategy(TrainConfig(), DistContext(0, 1, 0, 1, "gloo", cpu))
    meter = EpochMeter(7, 2, s, cpu, True, StepParts(cpu), hits_of=lambda out, y: out.argmax(1) == y)
    g = torch.Generator().manual_seed(0)
    losses, right, images = [], 0, 0
    meter.start()
    for step in range(7):
        meter.step_begins(step)
        logits, y = torch.randn(5, 3, generator=g), torch.randint(0, 3, (5,), generator=g)
        loss = torch.rand((), generator=g)
        meter.step_ends(step, (loss, logits), y)
        losses.append(loss.item())
        right, images = right + sum(int(a == b) for a, b in zip(logits.argmax(1).tolist(), y.tolist())), images + 5
        if step == 3:
            shown = meter.running_text(step, 5)
            assert shown.startswith(f"loss={sum(losses) / 4:.4f} acc={100 * right / images:.2f}% ")
    meter.stop()
    m = meter.metrics(1, 5)
    assert m.epoch == 1 and m.all_losses == pytest.approx(losses, rel=1e-6)
    assert m.train_loss == pytest.approx(sum(losses) / 7, rel=1e-6)
    assert m.train_accuracy == pytest.approx(100 * right / images)


def test_the_meters_figures_are_summed_by_name_each_in_its_shape():
    """The meter's collectives (issue 84, item 5): named figures packed into one buffer and
    unpacked by name, each in its own shape (a number, a row, rows, an empty row), none
    shifted into its neighbour's place (world size 1: the all-reduce is the identity)."""
    import torch

    from labkit.training.instruments.meter import summed

    got = summed({"data_time": 1.5, "comm": [2.0, 3.0], "held": [[4.0, 5.0], [6.0, 7.0]],
                  "none": [], "last": [8.0]}, torch.device("cpu"))
    assert list(got) == ["data_time", "comm", "held", "none", "last"]
    assert got["data_time"].shape == () and got["data_time"].item() == 1.5
    assert got["comm"].tolist() == [2.0, 3.0] and got["held"].tolist() == [[4.0, 5.0], [6.0, 7.0]]
    assert got["none"].tolist() == [] and got["last"].tolist() == [8.0]
    assert {t.dtype for t in got.values()} == {torch.float64}
