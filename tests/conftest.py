"""Shared helpers: tiny settings and a real torchrun launcher for multi-process tests."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

# every process the tests start imports tests/hooks/sitecustomize.py, which installs the
# LABKIT_TEST_* fault and tracing hooks from outside the package (labkit.hooks)
HOOKS = str(Path(__file__).resolve().parent / "hooks")
if HOOKS not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (HOOKS, os.environ.get("PYTHONPATH")) if p)

# tiny but real: the digits images, the smallest ResNet, a few steps
TINY = ["--dataset", "digits", "--model", "resnet10_small", "--batch-size", "8", "--epochs", "1",
        "--max-steps-per-epoch", "5", "--lr", "0.01", "--max-val-steps", "2", "--no-progress", "--timeout", "120"]


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
    """labkit.train.main(argv) in-process: exit 2, one `labkit.train: error:` line holding every
    needle, no traceback."""
    from labkit import train

    code = train.main(argv)
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


# Every method once, from one seed, 5 steps (PS with 3 processes = 2 trainers, like the others).
# Shared by the equivalence tests and the result-file tests: one run each for the whole session.
EQUIVALENCE_RUNS = {
    "ddp": (2, ["--method", "ddp"]),
    "allreduce": (2, ["--method", "allreduce", "--bucket-mb", "1"]),  # many buckets, overlapped
    "ps_collective": (3, ["--method", "ps", "--ps-mode", "collective", "--bucket-mb", "1"]),
    "ps_p2p": (3, ["--method", "ps", "--ps-mode", "p2p"]),
}


@pytest.fixture(scope="session")
def equivalence_runs(tmp_path_factory):
    """{name: (out_dir, completed process)} for EQUIVALENCE_RUNS, run for real under torchrun."""
    base = tmp_path_factory.mktemp("equiv")
    out = {}
    for name, (nproc, args) in EQUIVALENCE_RUNS.items():
        d = base / name
        proc = torchrun(nproc, TINY + args + ["--out", str(d)], cwd=base)
        check_ok(proc)
        out[name] = (d, proc)
    return out
