"""Issue 37, the methods that communicate less: DDP with PyTorch's bf16 and PowerSGD hooks, local
SGD and DiLoCo. Each is trained for real on 2 gloo ranks (a few steps; the runs start together
and are read by several tests), and its bytes on the wire are checked against what its
algorithm predicts from the model's parameter shapes, computed here, not by labkit. The ranks
are forked from the worker's warm interpreter (tests/warm.py; make test-fast runs these); the
same runs under real torchrun end with the same bits (the last test)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from labkit.core.config import TrainConfig
from labkit.workloads import resolve
from warm import start_warm

N = 2  # ranks
BASE = ["--dataset", "digits", "--model", "resnet10_small", "--batch-size", "8", "--epochs", "1",
        "--lr", "0.01", "--max-val-steps", "1", "--no-progress", "--timeout", "120",
        "--no-pin-cpus", "--calibrate-steps", "0", "--no-checkpoint", "--workers", "0",
        "--backend", "gloo", "--device", "cpu"]
EXACT_STEPS = 3
RUNS = {
    # 2 epochs of 4 steps: epoch 1 holds PowerSGD's 2 plain all-reduce steps, epoch 2 none
    "powersgd": ["--method", "powersgd", "--powersgd-rank", "1", "--powersgd-start-iter", "2",
                 "--epochs", "2", "--max-steps-per-epoch", "4"],
    "localsgd_h8": ["--method", "localsgd", "--local-steps", "8", "--max-steps-per-epoch", "16"],
    "localsgd_h1": ["--method", "localsgd", "--local-steps", "1",
                    "--max-steps-per-epoch", str(EXACT_STEPS)],
    # outer lr 1 without momentum: a round ends at the ranks' mean, so H = 1 is DDP's step too
    "diloco_h1": ["--method", "diloco", "--local-steps", "1", "--outer-lr", "1",
                  "--outer-momentum", "0", "--max-steps-per-epoch", str(EXACT_STEPS)],
    "ddp_bf16": ["--method", "ddp", "--compress", "bf16", "--max-steps-per-epoch", "2"],
}


def trained(test):
    """A test that reads the runs: on the one xdist worker that trains them, once."""
    return pytest.mark.warm(pytest.mark.xdist_group("compression_methods")(test))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Every run of RUNS, on warm ranks (tests/warm.py), started at once."""
    base = tmp_path_factory.mktemp("less")
    procs = {name: start_warm(N, [*BASE, *args, "--out", str(base / name)], cwd=base, timeout=300)
             for name, args in RUNS.items()}
    failed = {}
    for name, launch in procs.items():
        p = launch.wait()
        if p.returncode:
            failed[name] = (p.stdout + p.stderr)[-2000:]
    assert not failed, failed
    return {name: base / name for name in RUNS}


def result(out: Path) -> dict:
    return json.loads(next(out.glob("results_*.json")).read_text())


def sent(doc: dict, epoch: int = -1) -> float:
    """Bytes a rank sent per step in an epoch (both ranks alike)."""
    per_rank = doc["epochs"][epoch]["wire"]["sent_per_step"]
    assert len(per_rank) == N and per_rank[0] == pytest.approx(per_rank[1])
    return per_rank[0]


def shapes() -> list[torch.Size]:
    from labkit.workloads.images.models import build_model

    model, _ = build_model("resnet10_small", 10)
    return [p.shape for p in model.parameters() if p.requires_grad]


def ring(nbytes: float) -> float:
    """What one rank sends in a ring all-reduce of ``nbytes``."""
    return 2 * (N - 1) / N * nbytes


def powersgd_bytes(rank: int) -> float:
    """PowerSGD's all-reduces per step, from the paper's scheme and PyTorch's rule for what it
    compresses: each gradient as a matrix n x m (n its first dimension) goes as P (n x r) and
    Q (m x r) when that is at least twice smaller, (n + m) r x 2 < n m; else as it is."""
    total = 0
    for s in shapes():
        n = s[0]
        m = s.numel() // n
        r = min(n, m, rank)
        total += (n + m) * r if (n + m) * r * 2 < n * m else s.numel()
    return ring(4 * total)


def gradient_bytes() -> float:
    return ring(4 * sum(s.numel() for s in shapes()))


@trained
def test_powersgd_sends_what_its_low_rank_factors_predict(runs):
    doc = result(runs["powersgd"])
    assert doc["status"] == "completed" and doc["method_spec"]["exact"] is False
    full, low = gradient_bytes(), powersgd_bytes(1)
    assert low < full / 50  # rank 1 of ResNet-10: what the comparison is about
    assert sent(doc) == pytest.approx(low, rel=0.05)  # epoch 2: compressed every step
    # epoch 1: 2 steps of plain all-reduce (start_powerSGD_iter), then 2 compressed
    assert sent(doc, 0) == pytest.approx((2 * full + 2 * low) / 4, rel=0.05)


@trained
def test_local_sgd_every_8_steps_sends_an_eighth_of_ddps_bytes(runs):
    doc = result(runs["localsgd_h8"])
    assert doc["status"] == "completed"
    assert sent(doc) == pytest.approx(gradient_bytes() / 8, rel=0.05)
    assert doc["epochs"][0]["avg_comm_time"] > 0  # the averaging is timed as communication


@trained
def test_ddp_bf16_sends_half_the_bytes(runs):
    doc = result(runs["ddp_bf16"])
    assert doc["config"]["compress"] == "bf16"
    assert sent(doc) == pytest.approx(gradient_bytes() / 2, rel=0.01)


def averaged_steps(cfg: TrainConfig, trainers: int, steps: int, dtype=torch.float32) -> dict:
    """Local SGD with H = 1 in one process: every trainer takes the lab's SGD step from the
    same parameters on its own batch (its own momentum), then each parameter becomes the mean
    of the trainers' in the method's order (each divided by the trainers, then summed); the
    BatchNorm statistics are the first trainer's. The model after ``steps`` steps."""
    import copy

    from labkit.training.instruments import exactness
    from labkit.workloads.images.image_sets import build_datasets
    from labkit.workloads.images.models import build_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank runs: the same kernels
    try:
        data = build_datasets(cfg)
        torch.manual_seed(cfg.seed)
        model, _ = build_model(cfg.model, data.num_classes)
        models = [copy.deepcopy(model).to(dtype).train() for _ in range(trainers)]
        opts = [torch.optim.SGD(m.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                                weight_decay=cfg.weight_decay) for m in models]
        loaders = exactness.trainer_batches(data.train, cfg, trainers)
        for _ in range(steps):
            for m, opt, batches in zip(models, opts, loaders):
                x, y = next(batches)
                opt.zero_grad(set_to_none=True)
                torch.nn.functional.cross_entropy(m(x.to(dtype)), y).backward()
                opt.step()
            with torch.no_grad():
                for ps in zip(*(m.parameters() for m in models)):
                    mean = sum(p / trainers for p in ps)
                    for p in ps:
                        p.copy_(mean)
        return {k: v.detach().clone() for k, v in models[0].state_dict().items()}
    finally:
        torch.set_num_threads(threads)


def test_averaging_after_every_step_is_ddps_step_in_exact_arithmetic():
    """The mean of the trainers' SGD steps is the SGD step on their mean gradient: momentum and
    weight decay are linear in the gradient. In double precision, 3 steps of it end at the
    single-process reference of `labkit check` (DDP's step) to 1e-12.

    In float32 the two orders round differently after the first step, and on this data a
    rounding-sized change of the parameters can flip a ReLU in a later step and move that
    step's gradient by far more than rounding: after 3 steps the runs can end beyond the
    summation-order tolerance from DDP's parameters on one CPU and within it on another
    (measured in docs/testing.md). So the runs are compared with this computation in their
    own order (below), and the two orders with each other here, in double precision."""
    from labkit.training.instruments import exactness

    cfg = resolve(TrainConfig(method="localsgd", dataset="digits", model="resnet10_small",
                              batch_size=8, lr=0.01, max_steps_per_epoch=EXACT_STEPS), False, N)
    mine = averaged_steps(cfg, N, EXACT_STEPS, torch.float64)
    ddp = exactness.reference_state(cfg, N, EXACT_STEPS, torch.float64)
    assert mine.keys() == ddp.keys() and all(v.dtype == ddp[k].dtype for k, v in mine.items())

    def largest(a: dict) -> float:
        return max((a[k] - ddp[k]).abs().max().item() for k in ddp if ddp[k].is_floating_point())

    assert largest(mine) < 1e-12
    # what 1e-12 tells apart: one trainer training alone (its own batches, nothing averaged)
    # ends 1e-4 or more away
    assert largest(averaged_steps(cfg, 1, EXACT_STEPS, torch.float64)) > 1e-4


@trained
@pytest.mark.parametrize("name", ["localsgd_h1", "diloco_h1"])
def test_with_one_local_step_the_parameters_are_ddps(runs, name):
    """Averaging after every step: the runs end where the trainers' steps averaged in one
    process end (the same order of operations, so within summation order: DiLoCo with outer
    lr 1 and no momentum takes the mean as start - (start - mean)), which in exact arithmetic
    is DDP's step (the test above)."""
    from labkit.training.instruments import exactness

    cfg = resolve(TrainConfig(method=RUNS[name][1], dataset="digits", model="resnet10_small",
                              batch_size=8, lr=0.01, max_steps_per_epoch=EXACT_STEPS), False, N)
    final = torch.load(runs[name] / "final_model.pt", weights_only=True)
    verdict = exactness.compare(final, averaged_steps(cfg, N, EXACT_STEPS))
    assert verdict.exact, verdict.line(name, EXACT_STEPS, N)


@trained
def test_the_report_gives_each_method_its_bytes_per_step(runs):
    from labkit import report

    res = report.load_files([str(runs["powersgd"]), str(runs["localsgd_h8"])])
    rows = {r["Method"]: r[report.tables.WIRE] for r in report.communication_rows(res)}
    low, eighth = powersgd_bytes(1) / 1e6, gradient_bytes() / 8 / 1e6
    assert rows["PowerSGD"] == f"{low:.2f} / {low:.2f}"
    assert rows["Local SGD"] == f"{eighth:.2f} / {eighth:.2f}"


@pytest.mark.unit
@pytest.mark.parametrize("flags, needle", [
    (["--method", "localsgd", "--local-steps", "0"], "--local-steps must be at least 1 (got 0)"),
    (["--method", "diloco", "--local-steps", "-2"], "--local-steps must be at least 1 (got -2)"),
    (["--method", "diloco", "--outer-momentum", "1"], "--outer-momentum must be in [0, 1)"),
    (["--method", "diloco", "--outer-lr", "0"], "--outer-lr must be positive"),
    (["--method", "powersgd", "--powersgd-rank", "0"], "--powersgd-rank must be at least 1 (got 0)"),
    (["--method", "powersgd", "--powersgd-start-iter", "1"], "--powersgd-start-iter must be at least 2"),
    (["--method", "powersgd", "--compress", "fp16"], "powersgd compresses the gradients itself"),
    (["--method", "localsgd", "--compress", "bf16"], "localsgd sends parameters, not gradients"),
    (["--method", "allreduce", "--compress", "bf16"], "allreduce compresses to fp16 only; bf16 is DDP's"),
    (["--method", "ps", "--compress", "bf16"], "--compress bf16: ps compresses to fp16 only"),
])
def test_bad_parameters_are_one_line_and_exit_2(flags, needle, capsys, tmp_path):
    from labkit.training import rank

    code = rank.main([*BASE, *flags, "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("labkit.train: error: "), err
    assert needle in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------ the same runs under torchrun
#: the runs that are these methods' only ones in the suite: each once under real torchrun too
UNDER_TORCHRUN = ("powersgd", "localsgd_h1", "diloco_h1")
#: and the no-communication bound's (test_methods reads a warm one): here on both launchers
NOSYNC = ["--method", "nosync", "--max-steps-per-epoch", str(EXACT_STEPS)]


@pytest.mark.torchrun
@pytest.mark.xdist_group("compression_methods")
def test_warm_ranks_compute_what_torchrun_ranks_compute(runs, tmp_path):
    """The warm launcher changes no number: PowerSGD, local SGD, DiLoCo and the no-sync bound
    started by real torchrun (at once, as the runs above were) end with the warm runs'
    parameters, bit for bit, the same losses and the same bytes on the wire. (Their only runs
    under torchrun in the suite; DDP, the all-reduce and the parameter server run under it in
    the session's experiment.)"""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = {**{name: RUNS[name] for name in UNDER_TORCHRUN}, "nosync": NOSYNC}
    procs = {name: subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={N}",
         "-m", "labkit.train", *BASE, *a, "--out", str(tmp_path / name)],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for name, a in args.items()}
    warm = {**runs, "nosync": tmp_path / "warm" / "nosync"}
    check = start_warm(N, [*BASE, *NOSYNC, "--out", str(warm["nosync"])], cwd=tmp_path).wait()
    assert check.returncode == 0, (check.stdout + check.stderr)[-2000:]
    for name, p in procs.items():
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out[-2000:]
    for name in args:
        a = torch.load(tmp_path / name / "final_model.pt", weights_only=True)
        b = torch.load(warm[name] / "final_model.pt", weights_only=True)
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), (name, k, (a[k].double() - b[k].double()).abs().max().item())
        ra, rb = result(tmp_path / name), result(warm[name])
        assert ra["all_losses"] == rb["all_losses"], name
        assert [e["wire"] for e in ra["epochs"]] == [e["wire"] for e in rb["epochs"]], name
