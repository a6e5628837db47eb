"""What `labkit experiment` plans on a machine with 0, 1 or 4 GPUs, the device count faked in
this process (torch.cuda.is_available/device_count): no GPU is today's CPU plan, one GPU runs
every method with ranks sharing it over gloo, several GPUs one process per GPU over nccl. The
GPU tests (test_gpu_ranks.py) check the one-GPU default on a real device."""
from __future__ import annotations

import pytest
import torch

from labkit import cli
from labkit.workloads import resolve
from labkit.orchestrate import bench, experiment
from labkit.launch.launch_params import SHARED_GPU_RANKS, machine_defaults


def fake_gpus(monkeypatch, n: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


def planned(monkeypatch, gpus: int, flags: dict | None = None) -> experiment.Prepared:
    fake_gpus(monkeypatch, gpus)
    cfg, exp, _ = cli._experiment_params(dict(flags or {}))
    return experiment.plan(cfg, exp)


def test_no_gpu_is_the_cpu_plan(monkeypatch):
    p = planned(monkeypatch, 0)
    assert p.nproc == 4 and list(p.resolved) == ["ddp", "allreduce", "ps", "nosync"]
    assert {(c.backend, c.device) for c in p.resolved.values()} == {("gloo", "cpu")}
    assert p.plan[0].startswith("plan: ddp, allreduce, ps, nosync; 4 processes, backend gloo, device cpu")
    assert p.plan[1] == "why: no GPU: 4 processes on the CPU over gloo"
    assert not any("share" in line for line in p.plan)


def test_one_gpu_runs_every_method_with_ranks_sharing_it(monkeypatch):
    p = planned(monkeypatch, 1)
    assert p.nproc == SHARED_GPU_RANKS >= 2  # the parameter server needs a server and a worker
    assert list(p.resolved) == ["ddp", "allreduce", "ps", "nosync"]  # validated: none refused
    assert {(c.backend, c.device) for c in p.resolved.values()} == {("gloo", "cuda")}
    assert p.plan[0].startswith(f"plan: ddp, allreduce, ps, nosync; {SHARED_GPU_RANKS} processes, "
                                f"backend gloo, device cuda")
    assert p.plan[1].startswith(f"why: one GPU: {SHARED_GPU_RANKS} ranks share it over gloo")
    assert "share one device" in p.plan[2]


def test_one_gpu_with_one_process_asked_keeps_nccl(monkeypatch):
    p = planned(monkeypatch, 1, {"nproc": 1, "methods": "ddp,allreduce"})
    assert p.nproc == 1 and {c.backend for c in p.resolved.values()} == {"nccl"}
    assert p.plan[1] == "why: --nproc 1 as asked, on a machine with 1 GPU(s)"
    fake_gpus(monkeypatch, 1)
    assert "backend" not in machine_defaults(1) and machine_defaults(None)["backend"] == "gloo"


def test_four_gpus_are_four_nccl_processes(monkeypatch):
    p = planned(monkeypatch, 4)
    assert p.nproc == 4
    assert {(c.backend, c.device) for c in p.resolved.values()} == {("nccl", "cuda")}
    assert p.plan[1] == "why: 4 GPUs: one process per GPU over nccl"
    assert len(p.plan) == 2


def test_the_plan_is_printed_first_and_recorded(monkeypatch, tmp_path):
    """run_experiment writes the plan right after the run folder's line, and config.json keeps it."""
    import contextlib
    import io
    import json

    p = planned(monkeypatch, 0, {"methods": "ddp"})
    monkeypatch.setattr(experiment.ExperimentFolder, "run_method", lambda *a, **k: None)
    monkeypatch.setattr(experiment.ExperimentFolder, "finish", lambda *a, **k: None)
    monkeypatch.setattr(experiment, "write_record", lambda run, snap: {})
    monkeypatch.setattr(experiment, "warm_node", lambda *a: contextlib.nullcontext())  # no methods run
    out = io.StringIO()
    run, _ = experiment.run_experiment(p.cfg, p.exp, out, prepared=p, run=tmp_path / "run")
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("experiment: ") and lines[1:3] == p.plan
    assert json.loads((run / "config.json").read_text())["plan"] == p.plan


@pytest.mark.parametrize("batch,world", [(32, 4), (64, 3), (16, 7), (24, 5)])
def test_the_default_lr_prints_as_the_decimal_it_is(batch, world):
    """0.1 x global batch / 256 as one division: the torchrun command line and the report show
    0.0375, not 0.037500000000000006."""
    from labkit.core.config import TrainConfig
    from labkit.workloads import resolve

    for method in ("ddp", "ps"):
        lr = resolve(TrainConfig(method=method, batch_size=batch), False, world).lr
        assert repr(lr) == f"{lr:.12g}"


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() != 1,
                    reason="needs exactly one CUDA GPU (the faked counts above run everywhere)")
def test_on_a_real_one_gpu_machine_every_method_is_planned():
    cfg, exp, _ = cli._experiment_params({})
    p = experiment.plan(cfg, exp)
    assert list(p.resolved) == ["ddp", "allreduce", "ps", "nosync"] and p.nproc == SHARED_GPU_RANKS
    assert {(c.backend, c.device) for c in p.resolved.values()} == {("gloo", "cuda")}


def _res(device: str, ranks: int, gpus: int):
    from labkit.core.results import Result
    from labkit.report import RunResults

    world = {"device": device, "local_world_size": str(ranks), "gpus": gpus, "backend": "gloo"}
    epoch = {"epoch": 1, "train_loss": 1.0, "train_accuracy": 50.0, "train_time": 1.0,
             "train_throughput": 100.0}  # the guide's keys, which every epoch has
    return RunResults(docs={"ddp": Result.from_dict({"method": "Baseline DDP", "epochs": [epoch],
                                                     "world": world})})


def test_the_report_says_when_ranks_shared_a_device_and_shows_table_9_only_for_gpu_runs():
    from labkit.report.text import ran_on_gpu, shared_device_line

    line = shared_device_line(_res("cuda:0", 2, 1))
    assert line.startswith("The ranks shared one device: 2 processes on 1 GPU(s), over gloo")
    assert shared_device_line(_res("cuda:0", 2, 2)) is None  # a GPU each
    assert shared_device_line(_res("cpu", 4, 0)) is None
    assert ran_on_gpu(_res("cuda:1", 2, 2)) and not ran_on_gpu(_res("cpu", 4, 0))


@pytest.mark.parametrize("gpus, flags, nprocs, backend, device", [
    (1, {}, [SHARED_GPU_RANKS], "gloo", "cuda"),      # the one-GPU default: ranks share it
    (1, {"nproc": "1"}, [1], "nccl", "cuda"),         # one rank owns it, as `labkit run --nproc 1`
    (1, {"nproc": "1,2"}, [1, 2], "gloo", "cuda"),    # one config for both counts: shared
    (4, {}, [4], "nccl", "cuda"),
    (0, {}, [2, 4], "gloo", "cpu"),
])
def test_bench_plans_as_the_experiment_does(monkeypatch, gpus, flags, nprocs, backend, device):
    """`labkit bench` on the same machines: --nproc 1 on one GPU keeps nccl (it once shared the
    GPU over gloo, with one rank), and the bench document says where the jobs computed."""
    fake_gpus(monkeypatch, gpus)
    cfg, plan = bench.bench_params(dict(flags))
    cfg = resolve(cfg, gpus > 0)  # as the bench's planner resolves each job
    assert plan.nprocs == nprocs and (cfg.backend, cfg.device) == (backend, device)
