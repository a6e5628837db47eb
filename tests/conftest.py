"""Shared helpers: tiny settings and a real torchrun launcher for multi-process tests."""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

# every process the tests start imports tests/hooks/sitecustomize.py, which installs the
# LABKIT_TEST_* fault and tracing hooks from outside the package (labkit.training.hooks)
HOOKS = str(Path(__file__).resolve().parent / "hooks")
if HOOKS not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (HOOKS, os.environ.get("PYTHONPATH")) if p)

# tiny but real: the digits images, the smallest ResNet, a few steps
# --no-pin-cpus: two xdist workers run jobs at once, and each job binding its ranks as if it
# had the machine to itself stacks them on the same cores (the suite took 10 min 33 s bound,
# 2026-11-23); the runs that check binding ask for it (EQUIVALENCE_RUNS, test_experiment)
TINY = ["--dataset", "digits", "--model", "resnet10_small", "--batch-size", "8", "--epochs", "1",
        "--max-steps-per-epoch", "5", "--lr", "0.01", "--max-val-steps", "2", "--no-progress", "--timeout", "120",
        "--no-pin-cpus"]


def torchrun(nproc: int, args: list[str], cwd, env: dict | None = None, timeout: float = 240):
    """Run ``torchrun --standalone --nproc_per_node=nproc -m labkit.train ARGS`` for real."""
    if "--backend" not in args and nproc > torch.cuda.device_count():
        # the default on a GPU box is nccl, one GPU per process: with fewer GPUs than processes
        # (one H100, 2026-11-23) every multi-process test was refused before it started. These
        # tests check the methods' arithmetic, which gloo computes the same way (CI: no GPU,
        # gloo is the default already)
        args = [*args, "--backend", "gloo"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", "-m", "labkit.train", *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True,
                          timeout=timeout)


def check_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


def expect_error(argv, capsys, *needles) -> str:
    """labkit.training.rank.main(argv) in-process: exit 2, one `labkit.train: error:` line holding every
    needle, no traceback."""
    from labkit.training import rank

    code = rank.main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [l for l in err.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("labkit.train: error: "), err
    for n in needles:
        assert n in err, err
    assert "Traceback" not in err
    return err


def load_json(path) -> dict:
    with open(path) as f:
        return json.load(f)


def make_image_tree(root: Path, classes=("cat", "dog"), n_train=6, n_val=3, size=40) -> Path:
    """A tiny ImageNet-style tree: root/{train,val}/<class>/*.png with distinct colours."""
    from PIL import Image
    import random

    rng = random.Random(0)
    for split, n in (("train", n_train), ("val", n_val)):
        for ci, c in enumerate(classes):
            d = root / split / c
            d.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                base = (200 * ci, 80, 255 - 200 * ci)
                px = [tuple(min(255, max(0, v + rng.randint(-40, 40))) for v in base)
                      for _ in range(size * size)]
                im = Image.new("RGB", (size, size))
                im.putdata(px)
                im.save(d / f"{i}.png")
    return root


@pytest.fixture(scope="session")
def image_tree(tmp_path_factory) -> Path:
    return make_image_tree(tmp_path_factory.mktemp("imagenet"))


def shared_dir(tmp_path_factory, name: str, build) -> Path:
    """The folder ``build(folder)`` makes, built once per test session: under xdist by whichever
    worker asks first, while any other worker asking waits for it (a file lock) and then reads
    the same folder. For finished runs that tests in several xdist groups only read; a test
    that changes one works on a copy (shutil.copytree to its tmp_path)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):  # one process: a plain session fixture
        folder = tmp_path_factory.mktemp(name) / name
        build(folder)
        return folder
    root = tmp_path_factory.getbasetemp().parent / "shared"  # this session's, all workers'
    root.mkdir(exist_ok=True)
    folder, done = root / name, root / f"{name}.done"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)  # what a failed build left
            build(folder)
            done.touch()
    return folder


def _ddp_tiny(out: Path) -> None:
    check_ok(torchrun(2, TINY + ["--method", "ddp", "--out", str(out)], cwd=out.parent))


# TINY ddp on 2 gloo ranks is what the equivalence, result-file, reproduce and multi-node tests
# all start from: two real runs for the whole session (two, so that the tests of determinism
# compare two trainings), not one per test module (2026-11-23: five).
@pytest.fixture(scope="session")
def ddp_run(tmp_path_factory) -> Path:
    """The output folder of one real TINY ddp run on 2 gloo ranks (read-only)."""
    return shared_dir(tmp_path_factory, "ddp_run", _ddp_tiny)


@pytest.fixture(scope="session")
def ddp_rerun(tmp_path_factory) -> Path:
    """A second, independent TINY ddp run from the same seed (read-only)."""
    return shared_dir(tmp_path_factory, "ddp_rerun", _ddp_tiny)


# Every method once, from one seed, 5 steps (PS with 3 processes = 2 trainers, like the others).
# Shared by the equivalence tests and the result-file tests: one run each for the whole session
# (ddp's is ddp_run).
EQUIVALENCE_RUNS = {
    "ddp": (2, ["--method", "ddp"]),
    # many buckets, overlapped; bound to cores (--pin-cpus), so the equivalence tests show
    # that placement changes no number
    "allreduce": (2, ["--method", "allreduce", "--bucket-mb", "1", "--pin-cpus"]),
    "ps_collective": (3, ["--method", "ps", "--ps-mode", "collective", "--bucket-mb", "1"]),
    "ps_p2p": (3, ["--method", "ps", "--ps-mode", "p2p"]),
}


@pytest.fixture(scope="session")
def equivalence_runs(tmp_path_factory, ddp_run):
    """{name: (out_dir, completed process)} for EQUIVALENCE_RUNS, run for real under torchrun
    (ddp's process is None: it is ddp_run, which may have run on another xdist worker)."""
    base = tmp_path_factory.mktemp("equiv")
    out = {"ddp": (ddp_run, None)}
    for name, (nproc, args) in EQUIVALENCE_RUNS.items():
        if name in out:
            continue
        d = base / name
        proc = torchrun(nproc, TINY + args + ["--out", str(d)], cwd=base)
        check_ok(proc)
        out[name] = (d, proc)
    return out


# `make test` runs two xdist workers with --dist loadgroup: each xdist group's tests go to one
# worker together (the groups with the most tests first), every other test on its own, in
# collection order. On 2 cores the suite is CPU-bound, so what a good order saves is the end:
# one worker still on a minute-long test while the other has nothing left. These tests (seconds
# each, measured alone on 2 cores, 2026-11-23) go first, longest first; the many short ones fill
# in behind them. (Not in a group: a group's tests keep their order.)
LONGEST_FIRST = {
    "test_repeats_sweep.py::test_repeats_run_rotated_and_the_report_aggregates_them": 131,
    "test_experiment.py::test_experiment_makes_a_complete_run_folder": 96,
    "test_experiment.py::test_a_failed_method_is_recorded_and_the_others_kept": 57,
    "test_repeats_sweep.py::test_a_small_real_sweep_renders_its_report": 56,
    "test_ps_variants.py::test_sharded_ps_resumes_to_the_same_parameters": 34,
    "test_experiment.py::test_ctrl_c_on_the_experiment_stops_everything": 23,
    "test_ps_variants.py::test_async_staleness_bound_is_reached_and_never_exceeded": 17,
    "test_ps_variants.py::test_async_lockstep_is_synchronous_sgd": 15,
    "test_data_checks.py::test_torchrun_with_skip_bad_images_warns_once": 14,
    "test_launch.py::test_failed_rank_is_named_with_its_log": 13,
    "test_launch.py::test_launch_streams_the_reporting_rank": 12,
    # the lab notebook's group builds its run folders in its first test's fixtures
    "test_lab_notebook.py::test_runs_lists_every_kind_with_its_status": 95,
    "test_resources.py::test_a_disk_that_fills_at_the_first_checkpoint_is_one_line": 24,
    "test_resources.py::test_a_rank_killed_as_by_the_oom_killer_is_one_line": 23,
    # one xdist group (one worker owns the Slurm daemons), ~90 s in all: started early
    "test_slurm.py::test_sweep_on_slurm_is_one_job_per_point_and_ends_with_the_sweep_report": 30,
    "test_slurm.py::test_the_sbatch_script_runs_each_method_on_two_nodes": 25,
    "test_slurm.py::test_a_failing_method_fails_the_job_with_labkits_line": 15,
    "test_slurm.py::test_scancel_stops_every_rank": 6,
}


def pytest_collection_modifyitems(config, items):
    def seconds(item) -> float:
        return LONGEST_FIRST.get(f"{item.path.name}::{item.name}", 0)

    items.sort(key=lambda item: -seconds(item))  # stable: the others keep their order


def make_run(root: Path, name: str, trained: Path, extra: tuple[str, ...] = ()) -> Path:
    """A run folder as labkit experiment writes it (config.json, environment.json with the
    record, requirements.lock), with one method, ddp on 2 gloo ranks, trained for real: a copy
    of ``trained``, the output of torchrun with exactly this config (conftest's ddp_run or
    ddp_rerun; ``extra``: the flags it ran with besides TINY)."""
    from labkit.core import layout
    from labkit.core.config import build_parser, from_args
    from labkit.core.files import atomic_write_json
    from labkit.core.status import Status
    from labkit.lab import record
    from labkit.training.checks import preflight

    run = root / name
    run.mkdir()
    cfg = preflight(from_args(build_parser().parse_args(TINY + ["--method", "ddp", *extra])),
                    world=2, local_world=2)
    snap = record.snapshot({"ddp": cfg}, cfg.seed, ROOT)
    atomic_write_json(str(run / "config.json"), layout.portable(
        {"experiment": {"methods": ["ddp"], "nproc": 2}, "train": cfg.to_dict(),
         "resolved": {"ddp": cfg.to_dict()}}, run))
    env = record.write_record(run, snap)
    atomic_write_json(str(run / "environment.json"), layout.portable(env, run))
    atomic_write_json(str(run / "experiment.json"), layout.portable(
        {"run_dir": str(run), "methods": {"ddp": {"status": Status.COMPLETED.value,
                                                  "notebook": str(run / "ddp" / "x.ipynb")}}}, run))
    shutil.copytree(trained, run / "ddp")
    return run


def pytest_terminal_summary(terminalreporter):
    """The Slurm jobs the tests submitted, with the states Slurm recorded (test_slurm.show):
    the suite's output says that the jobs ran on a real controller, and how they ended."""
    lines = [v for key in ("passed", "failed") for rep in terminalreporter.stats.get(key, [])
             for k, v in getattr(rep, "user_properties", ()) if k == "slurm"]
    if lines:
        terminalreporter.write_sep("-", "Slurm jobs (tests/test_slurm.py)")
        for line in lines:
            terminalreporter.write_line(line)
