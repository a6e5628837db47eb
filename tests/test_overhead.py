"""The plain DDP loop (labkit.bench.plain_loop), the floor labkit's overhead is measured
against: it computes labkit's DDP parameters bit for bit, and the bench's figure of labkit
DDP / plain loop is paired over rounds that turn the loops' order round. Speeds are the bench's business
(`labkit bench`, docs/performance.md), not a test's."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from helpers import TINY, check_ok

# reads the session's ddp_run, as the equivalence tests do: on their xdist worker
pytestmark = pytest.mark.xdist_group("equivalence_runs")


def plain_torchrun(nproc: int, args: list[str], cwd, timeout: float = 240):
    """``torchrun -m labkit.bench.plain_loop ARGS`` for real (gloo, one thread per rank, as
    conftest.torchrun runs labkit.train)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", "-m", "labkit.bench.plain_loop", *args,
           "--backend", "gloo"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (the CPU case runs everywhere)"))])
def test_the_plain_loop_takes_its_batches_as_labkits_loop_does_on_the_device(device):
    """The overhead job compares two loops, not two data paths: on a GPU labkit's loop gathers an
    in-memory set's batches on the device, and a plain loop that copied host batches in was
    slower on the one-GPU default (ResNet-50 at 224 px), which the job reported as labkit's
    gain (docs/performance.md). Same kind of loader, and the same batches epoch by epoch."""
    from helpers import TINY_CFG
    from labkit.core.config import TrainConfig
    from labkit.workloads import resolve
    from labkit.workloads.images.image_sets import build_datasets
    from labkit.training.dist import DistContext
    from labkit.workloads.images.models import build_model
    from labkit.bench.plain_loop import PlainDDP
    from labkit.training.trainer import Trainer

    cfg = resolve(TrainConfig(**{**TINY_CFG, "device": device}), device == "cuda")
    ctx = DistContext(0, 1, 0, 1, "gloo", torch.device(device, 0 if device == "cuda" else None))
    data = build_datasets(cfg)
    plain = PlainDDP(cfg, data, build_model(cfg.model, data.num_classes, None)[0], ctx)
    tr = Trainer(cfg, ctx, None, data, build_model(cfg.model, data.num_classes, None)[0], 5)
    assert type(plain.loader) is type(tr.train_loader)
    for epoch in (1, 2):
        plain.sampler.set_epoch(epoch)
        plain.generator.manual_seed(cfg.seed + epoch)  # as train_epoch does for rank 0
        (x, y), (x2, y2) = next(iter(plain.loader)), next(tr._batches(epoch))
        assert x.device == x2.device and torch.equal(x, x2) and torch.equal(y, y2)


@pytest.mark.slow
def test_plain_loop_computes_labkits_ddp_parameters_bit_for_bit(ddp_run, tmp_path):
    """TINY on 2 gloo ranks: labkit's DDP (labkit.train, its timing comm hook, meters and
    all) and the plain loop over the same datasets, sampler shards, per-epoch loader seeds
    and initial weights end with the same state, every tensor equal bit for bit, and
    training moved the weights."""
    out = tmp_path / "plain"
    check_ok(plain_torchrun(2, TINY + ["--out", str(out)], cwd=tmp_path))
    plain = torch.load(out / "final_model.pt", weights_only=True)
    labkit = torch.load(ddp_run / "final_model.pt", weights_only=True)
    assert set(plain) == set(labkit)
    differ = [k for k in labkit if not torch.equal(plain[k], labkit[k])]
    assert differ == [], f"{len(differ)} tensors differ, the first {differ[0]}: max abs diff " \
                         f"{(plain[differ[0]].double() - labkit[differ[0]].double()).abs().max().item()}"
    from labkit.workloads.images.models import build_model

    torch.manual_seed(0)
    init = build_model("resnet10_small", 10)[0].state_dict()
    assert not torch.equal(init["fc.weight"], plain["fc.weight"])


@pytest.mark.slow
def test_the_overhead_job_on_an_image_folder_computes_the_same_parameters(image_tree, tmp_path):
    """The bench's overhead job on JPEG-style files read by a loader worker per rank, with
    random crops and flips, over two trials (two epochs of each loop): both loops reseed their
    workers' augmentation per epoch, so they draw the same crops and end equal. (Persistent
    training workers kept epoch 1's random state and made 124 tensors differ.)"""
    import json

    out = tmp_path / "overhead"
    args = ["--data-dir", str(image_tree), "--model", "resnet10_small", "--image-size", "32",
            "--batch-size", "2", "--workers", "1", "--epochs", "1", "--no-progress",
            "--no-pin-cpus", "--timeout", "120", "--overhead", "--steps", "2", "--trials", "2",
            "--bench-warmup", "0", "--out", str(out)]
    check_ok(plain_torchrun(2, args, cwd=tmp_path))
    doc = json.loads((out / "bench_result.json").read_text())
    assert doc["workers"] == 1 and doc["trials"] == 2
    assert doc["order"] == ["plain", "labkit_ddp", "labkit_ddp", "plain"]  # ABBA
    assert doc["params_equal"] and doc["params_differing"] == 0


def test_plain_loop_refuses_what_it_does_not_do(tmp_path, capsys):
    """One line, exit 2, before any process group: the floor is DDP's, without labkit's options."""
    from labkit.bench import plain_loop

    for args, needle in ((["--method", "allreduce"], "the plain loop is DDP's floor"),
                         (["--compress", "fp16"], "the plain loop has no --compress"),
                         (["--control"], "--control is the overhead job's A/A control: it needs --overhead"),
                         (["--profile-steps", "2"], "--profile-steps traces the overhead job's loops: it needs --overhead"),
                         (["--overhead", "--profile-steps", "-1"], "--profile-steps must be 0 or more (got -1)")):
        code = plain_loop.main(TINY + args + ["--out", str(tmp_path / "x")])
        err = capsys.readouterr().err
        assert code == 2 and needle in err and "Traceback" not in err, err


def overhead_result(plain, labkit, nproc=2):
    """An overhead job's result holding known trials (only the fields the view reads)."""
    from labkit.bench.bench_view import derive_overhead

    def side(ts):
        return {"step_time": {"trials": ts}, "throughput": 16 * nproc * len(ts) / sum(ts)}
    return derive_overhead({"nproc": nproc, "trials": len(plain), "steps": 10, "params_equal": True,
                            "plain": side(plain), "labkit_ddp": side(labkit)})


def test_overhead_ratio_is_the_paired_interval_over_the_rounds():
    """labkit DDP / plain loop = the geometric mean of each round's plain step / labkit step,
    with the t-interval of the mean log ratio over the rounds, computed here independently;
    the sentence calls labkit slower only when the interval excludes 1.00."""
    import math

    import numpy as np
    from scipy import stats as sps

    from labkit.bench import bench_view

    plain, labkit = [2.00, 2.04, 1.98, 2.02], [2.10, 2.13, 2.08, 2.12]
    o = overhead_result(plain, labkit)
    d = np.log(np.asarray(plain) / np.asarray(labkit))
    r, h = math.exp(d.mean()), sps.t.ppf(0.975, 3) * d.std(ddof=1) / 2
    assert o["ratio"] == pytest.approx(r)
    assert o["ratio_ci"] == pytest.approx([math.exp(d.mean() - h), math.exp(d.mean() + h)])
    # paired: a machine that ran every round at another speed moves both loops alike, and a
    # spread between rounds far larger than the loops' difference leaves the interval as narrow
    drift = [1.0, 1.3, 0.8, 1.1]
    moved = overhead_result([p * k for p, k in zip(plain, drift)], [q * k for q, k in zip(labkit, drift)])
    assert moved["ratio"] == pytest.approx(r) and moved["ratio_ci"] == pytest.approx(o["ratio_ci"])
    assert moved["ratio_ci"][1] < 1.0
    line = bench_view.overhead_line(o)
    assert line.startswith(f"labkit DDP / plain loop x2: {r:.3f}, 95% CI ") and "labkit slower" in line
    # the A/A control (--overhead-control): the plain loop's second run against its first,
    # paired over the same rounds; none without it
    assert bench_view.control_interval(o) is None and "A/A" not in line and "control_ratio" not in o
    again = [2.01, 2.05, 1.97, 2.02]
    aa = bench_view.derive_overhead({**o, "plain_again": {"step_time": {"trials": again}}})
    c = np.log(np.asarray(plain) / np.asarray(again))
    hc = sps.t.ppf(0.975, 3) * c.std(ddof=1) / 2
    assert aa["control_ratio"] == pytest.approx(math.exp(c.mean()))
    assert aa["control_ratio_ci"] == pytest.approx([math.exp(c.mean() - hc), math.exp(c.mean() + hc)])
    assert aa["ratio"] == pytest.approx(r)  # the overhead itself unchanged
    assert bench_view.overhead_line(aa).endswith(
        f"; A/A control, the plain loop against itself: {math.exp(c.mean()):.3f}, 95% CI "
        f"{math.exp(c.mean() - hc):.3f}-{math.exp(c.mean() + hc):.3f}: within the trial-to-trial noise of 4 trials")
    tie = overhead_result(plain, plain[::-1])
    assert "within the trial-to-trial noise of 4 trials" in bench_view.overhead_line(tie)
    one = overhead_result([2.0], [2.1])
    assert one["ratio_ci"] is None and "no confidence interval" in bench_view.overhead_line(one)
    doc = {"overhead": [o]}
    row = bench_view.overhead_rows(doc)[0]
    assert row["95% CI"] == f"{o['ratio_ci'][0]:.3f}-{o['ratio_ci'][1]:.3f}"
    assert row["same parameters"] == "yes"
    # loops that ended apart: a warning, unless the GPU's own backward did not repeat itself
    # (pricing.repeatable, probed on a GPU where they differ)
    apart = {**o, "params_equal": False, "params_differing": 5}
    assert "WARNING: the two loops' parameters differ (5 tensors)" in bench_view.overhead_line(apart)
    assert bench_view.overhead_rows({"overhead": [apart]})[0]["same parameters"] == "NO"
    gpu = {**apart, "device_repeatable": False}
    assert "WARNING" not in bench_view.overhead_line(gpu)
    assert "not deterministic" in bench_view.overhead_line(gpu)
    assert bench_view.overhead_rows({"overhead": [gpu]})[0]["same parameters"] == "n/a (GPU not deterministic)"
