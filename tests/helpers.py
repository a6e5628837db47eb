"""The suite's one helpers module: the tiny settings, the ways the tests start labkit (torchrun,
the `labkit` command), strict JSON, leftover-process checks with a deadline, ports, and the
pause hook's test side. conftest.py holds fixtures and markers only and imports from here; test
modules import from here, never from each other (docs/testing.md: what was merged into what).
"""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterable

ROOT = Path(__file__).resolve().parents[1]

# every process the tests start imports tests/hooks/sitecustomize.py, which installs the
# LABKIT_TEST_* fault, pause and tracing hooks from outside the package (labkit.training.extensions)
HOOKS = str(Path(__file__).resolve().parent / "hooks")
if HOOKS not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (HOOKS, os.environ.get("PYTHONPATH")) if p)

# one thread per rank: what every process the tests start gets (two xdist workers share the
# cores; the in-process reference of test_equivalence sets the same to get the same kernels)
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
# no Chromium: a report is written as HTML only, seconds quicker (the session experiment of
# conftest reads the PDF)
HTML_ONLY = {"LABKIT_CHROMIUM": "/nonexistent/chromium"}


# ------------------------------------------------------------------ tiny settings, one source
# tiny but real: the digits images, the smallest ResNet, a few steps. TrainConfig's fields;
# tiny_flags() writes them as the command line, tiny_cfg() as keyword arguments (TrainConfig,
# the notebooks' parameters). A test changes only what it needs: tiny_flags(epochs=2).
# pin_cpus False: two xdist workers run jobs at once, and each job binding its ranks as if it
# had the machine to itself stacks them on the same cores (the suite took 10 min 33 s bound,
# 2026-11-23); the runs that check binding ask for it. calibrate_steps 2, not the default 4:
# the compute-only steps after the last epoch (2 untimed + N) would outnumber the 5 training
# steps (a two-rank TINY run cost 0.4 CPU s less with 2 than with 6, docs/performance.md); the
# tests that weigh the calibration against the step (test_breakdown) ask for 6. image_size 8:
# the digits' own pixels, not the embedded default's 16 (upsampled), a quarter of the compute
# of every step the suite takes; a test of the language model drops it (image_size=None)
TINY_CFG = dict(dataset="digits", model="resnet10_small", batch_size=8, epochs=1,
                max_steps_per_epoch=5, lr=0.01, max_val_steps=2, progress=False, timeout=120,
                pin_cpus=False, calibrate_steps=2, image_size=8)


def tiny_cfg(**over) -> dict:
    """TINY_CFG with ``over`` changed (a value None drops the key)."""
    return {k: v for k, v in {**TINY_CFG, **over}.items() if v is not None}


def as_flags(cfg: dict) -> list[str]:
    """{"batch_size": 8, "progress": False} -> ["--batch-size", "8", "--no-progress"]."""
    out: list[str] = []
    for k, v in cfg.items():
        flag = "--" + k.replace("_", "-")
        if v is True:
            out.append(flag)
        elif v is False:
            out.append("--no-" + flag[2:])
        else:
            out += [flag, str(v)]
    return out


def tiny_flags(**over) -> list[str]:
    """The tiny settings as `labkit.train` / `labkit run` / `labkit experiment` flags."""
    return as_flags(tiny_cfg(**over))


# the torchrun form most tests start from (conftest's ddp_run trains with exactly these)
TINY = tiny_flags()

# `labkit bench`'s form: the tiny settings without the training loop's (bench times steps, not
# epochs)
BENCH_FLAGS = [*tiny_flags(lr=0.05, epochs=None, max_steps_per_epoch=None, max_val_steps=None,
                           pin_cpus=None, calibrate_steps=None), "--steps", "2", "--trials", "2",
               "--warmup", "1"]


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



# conftest's session experiment: the guide's three (the default's fourth, the no-communication
# bound, is test_methods' and test_machine_plan's: leaving it out keeps this run a quarter
# shorter), 2 repeats
EXPERIMENT_METHODS = ("ddp", "allreduce", "ps")
EXPERIMENT_REPEATS = 2
# `labkit experiment` with the tiny settings (the method runs' epochs and steps given apart)
EXPERIMENT_FLAGS = ["--nproc", "2", "--methods", ",".join(EXPERIMENT_METHODS),
                    *tiny_flags(dataset=None, epochs=None, max_steps_per_epoch=None,
                                max_val_steps=1, timeout=60, calibrate_steps=None)]


class Experiment:
    """A finished `labkit experiment` run by conftest's session fixture: the folder it ran in
    (``cwd``), the run folder (``run``), its exit code and output (kept in files: the fixture
    may have run on another xdist worker)."""

    #: the LABKIT_TEST_COUNT file of the experiment's processes, in ``cwd``
    CALLS = "calls.txt"

    def __init__(self, cwd: Path):
        self.cwd = cwd
        self.run = (cwd / "runs" / "latest").resolve()
        self.returncode = int((cwd / "returncode").read_text())
        self.stdout = (cwd / "stdout.txt").read_text()
        self.stderr = (cwd / "stderr.txt").read_text()

    @staticmethod
    def record(cwd: Path, p: subprocess.CompletedProcess) -> None:
        (cwd / "stdout.txt").write_text(p.stdout)
        (cwd / "stderr.txt").write_text(p.stderr)
        (cwd / "returncode").write_text(str(p.returncode))


# conftest's `reproduced`: two real ddp runs that differ only in --bucket-mb, the two points of
# one `labkit sweep` (9 steps, 6 of them past the warm-up: a throughput interval), the first
# then reproduced with `labkit reproduce`. Read by test_reproduce and test_lab_notebook (runs
# index, diff), instead of run folders written by hand (issue 40)
PAIR_GRID = {"bucket_mb": (25.0, 10.0)}
PAIR_FLAGS = ["--nproc", "2", "--methods", "ddp",
              *tiny_flags(max_steps_per_epoch=9, max_val_steps=1, timeout=60)]


def snapshot_tree(root: Path) -> dict:
    """{relative path: mtime in ns} of everything under ``root``: compared before and after,
    it says that nothing was written there."""
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in sorted(root.rglob("*"))}


class Reproduced(Experiment):
    """conftest's `reproduced` (built in ``cwd``, maybe by another xdist worker): ``sweep`` (the
    real two-point sweep), ``points`` ({bucket_mb: its point's folder}), ``original`` (the
    first point, copied to runs/ with runs/latest at it, as a user copies a run folder),
    ``before`` (its files' mtimes then), and, as an Experiment, the `labkit reproduce
    runs/latest` that followed: ``run`` (the reproduction, where runs/latest now points), its
    exit code and output."""

    def __init__(self, cwd: Path):
        super().__init__(cwd)
        doc = json.loads((cwd / "reproduced.json").read_text())
        self.sweep = cwd / doc["sweep"]
        self.points = {float(k): self.sweep / v for k, v in doc["points"].items()}
        self.original = cwd / doc["original"]
        self.before = doc["before"]


# ------------------------------------------------------------------ starting labkit
def torchrun(nproc: int, args: list[str], cwd, env: dict | None = None, timeout: float = 240):
    """Run ``torchrun --standalone --nproc_per_node=nproc -m labkit.train ARGS`` for real."""
    import torch

    if "--backend" not in args and nproc > torch.cuda.device_count():
        # the default on a GPU box is nccl, one GPU per process: with fewer GPUs than processes
        # (one H100, 2026-11-23) every multi-process test was refused before it started. These
        # tests check the methods' arithmetic, which gloo computes the same way (CI: no GPU,
        # gloo is the default already)
        args = [*args, "--backend", "gloo"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", "-m", "labkit.train", *args]
    return subprocess.run(cmd, cwd=cwd, env=command_env(env), capture_output=True, text=True,
                          timeout=timeout)


def labkit(args: Iterable, cwd=ROOT, env: dict | None = None, timeout: float = 400,
           wrap: Iterable[str] = (), **kw) -> subprocess.CompletedProcess:
    """``python -m labkit ARGS`` in ``cwd``, output captured; one thread per rank unless ``env``
    says otherwise; ``wrap``: a command to run it under (e.g. prlimit)."""
    return subprocess.run([*wrap, sys.executable, "-m", "labkit", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout, env=command_env(env), **kw)


def command_env(env: dict | None = None) -> dict:
    """The environment of a command the tests start: theirs, one thread per rank, ``env``."""
    return {**os.environ, **ONE_THREAD, **(env or {})}


def start_labkit(args: Iterable, cwd, env: dict | None = None, **kw) -> subprocess.Popen:
    """``python -m labkit ARGS`` started in its own session (os.killpg reaches all of it),
    stdout and stderr together in a pipe."""
    return subprocess.Popen([sys.executable, "-m", "labkit", *map(str, args)], cwd=cwd, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, env=command_env(env),
                            **kw)


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


# ------------------------------------------------------------------ JSON
def load_json(path) -> dict:
    with open(path) as f:
        return json.load(f)


def _reject(token: str):
    raise ValueError(f"not JSON: {token} (NaN and Infinity are JavaScript, not JSON)")


def strict_loads(text: str):
    """json.loads that refuses NaN, Infinity and -Infinity, as a strict JSON reader would."""
    return json.loads(text, parse_constant=_reject)


def strict_json(path):
    """The file at ``path`` parsed strictly (strict_loads), with the path in the error."""
    text = Path(path).read_text()
    try:
        return strict_loads(text)
    except ValueError as e:
        raise AssertionError(f"{path}: {e}") from None


# ------------------------------------------------------------------ waiting, without sleeping blind
def wait_for(cond: Callable[[], object], timeout: float = 240.0, what: str = "condition",
             every: float = 0.2):
    """Poll ``cond`` until it returns something true (returned) or ``timeout`` s pass (fail)."""
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s waiting for {what}"
        time.sleep(every)


def processes_naming(marker: str) -> list[str]:
    """Command lines of live processes (not zombies) that mention ``marker``, this one excluded,
    in their command line or in a file they hold open: a warm rank's command line is that of
    the fork server it was forked from (labkit.launch.agent), its log files are the run's."""
    import psutil

    found = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if p.info["pid"] == os.getpid() or p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            line = " ".join(p.info["cmdline"] or ())
            if marker in line or any(marker in f.path for f in p.open_files()):
                found.append(f"{p.info['pid']} {line}")
        except psutil.Error:
            pass
    return found


_RANK_LOG = re.compile(r"attempt_\d+/(\d+)/std(out|err)\.log$")


def rank_of(p) -> int | None:
    """The local rank a process (psutil.Process) runs as, or None when it is no rank. A rank
    of torch's own torchrun runs ``-m labkit.train`` with LOCAL_RANK in its environment; a warm
    rank (labkit.launch.agent) has the command line of the warm process it was forked from,
    its environment set after the fork (not in /proc), and its log files open
    (``attempt_K/<local rank>/stdout.log``), which no other process of the run holds as a
    warm-process child (loader servers and workers have another command line)."""
    line = " ".join(p.cmdline())
    if "labkit.train" in line and "multiprocessing" not in line:
        local = p.environ().get("LOCAL_RANK")
        return int(local) if local is not None else None
    if "multiprocessing.forkserver" in line and "labkit.training.rank" in line:
        for f in p.open_files():
            m = _RANK_LOG.search(f.path)
            if m:
                return int(m.group(1))
    return None


def leftovers(marker: str, deadline: float = 20.0) -> list[str]:
    """Processes (torchrun, ranks, loader workers, kernels) whose command line names ``marker``
    (a unique output folder) still alive ``deadline`` seconds from now; [] as soon as there
    are none. A rank's loader worker notices its rank is gone within a few seconds: the
    deadline is for a loaded machine, and a passing check returns at once."""
    end = time.monotonic() + deadline
    while True:
        left = processes_naming(marker)
        if not left or time.monotonic() >= end:
            return left
        time.sleep(0.2)


def running_in(folder) -> list[str]:
    """Command lines of the processes (not exited ones waiting to be reaped) whose working
    directory is ``folder`` or inside it."""
    import psutil

    found = []
    for p in psutil.process_iter():
        try:
            if p.status() != psutil.STATUS_ZOMBIE and (p.cwd() + os.sep).startswith(str(folder) + os.sep):
                found.append(" ".join(p.cmdline()))
        except psutil.Error:
            pass
    return found


# ------------------------------------------------------------------ ports
# Where a program can bind port 0 itself it does (JupyterLab: --port=0, then jupyter_port
# reads the port it got); free_port is for the others (a rendezvous endpoint two agents must
# both be told, Slurm's daemons), and with_free_port retries when another process took it first.
def free_port() -> int:
    """A port the OS has just handed out (bound to port 0, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def jupyter_port(runtime_dir: Path, proc: subprocess.Popen, timeout: float = 120.0) -> int:
    """The port a Jupyter server started with --port=0 bound: from the jpserver-<pid>.json it
    writes into its runtime folder once it listens."""
    def port():
        if proc.poll() is not None:
            raise AssertionError(f"the Jupyter server exited {proc.returncode}")
        for f in Path(runtime_dir).glob("jpserver-*.json"):
            try:
                return json.loads(f.read_text())["port"]
            except (OSError, ValueError, KeyError):
                pass
        return None
    return int(wait_for(port, timeout, f"a jpserver-*.json in {runtime_dir}"))


def with_free_port(start: Callable[[int], object], tries: int = 5,
                   in_use: Callable[[object], bool] = lambda r: False):
    """``start(port)`` on a port the OS handed out; again on a new port, up to ``tries`` times,
    while ``in_use(result)`` says another process took the port between the two."""
    for _ in range(tries):
        r = start(free_port())
        if not in_use(r):
            break
    return r


# ------------------------------------------------------------------ the pause hook
class Pause:
    """Hold a rank (``rank="*"``: every rank) at a chosen epoch and step until the test
    releases it (tests/hooks: LABKIT_TEST_PAUSE). ``env`` goes to the process that trains;
    ``wait()`` returns {rank: pid} once ``count`` ranks are held there; ``release()`` lets them
    go on.

        pause = Pause(tmp_path, method="allreduce", rank=0, epoch=2, step=0)
        proc = start_labkit([...], cwd, env=pause.env)
        pause.wait()          # rank 0 is before epoch 2's first step, epoch 1 written
        ...                   # kill, signal, inspect: the run is exactly there
        pause.release()

    A rank held alone leaves the others waiting for it in a collective, where no Python signal
    handler runs until the collective times out: to signal a run (Ctrl-C, SIGTERM) rather than
    kill it, hold every rank (rank="*", wait(count=nproc)).
    """

    def __init__(self, folder: Path, method: str = "*", rank: int | str = 0, epoch: int = 1,
                 step: int = 0):
        name = f"pause-{method}-{rank}-{epoch}-{step}".replace("*", "any")
        self.dir = Path(folder) / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.env = {"LABKIT_TEST_PAUSE": f"{method}:{rank}:{epoch}:{step}:{self.dir}"}

    def held(self) -> dict[int, int]:
        """{rank: pid} of the ranks held now."""
        out = {}
        for f in self.dir.glob("paused-*"):
            if not f.name.endswith(".tmp"):
                out[int(f.name.split("-")[1])] = int(f.read_text())
        return out

    def wait(self, timeout: float = 240.0, proc: subprocess.Popen | None = None,
             count: int = 1) -> dict[int, int]:
        """{rank: pid} once ``count`` ranks are held; fails after ``timeout`` s or when ``proc``
        (the process that started the run) ended first."""
        def ready():
            if proc is not None and proc.poll() is not None:
                raise AssertionError(f"the run ended (exit {proc.returncode}) before the pause")
            held = self.held()
            return held if len(held) >= count else None
        return wait_for(ready, timeout, f"{count} rank(s) held at {self.env['LABKIT_TEST_PAUSE']}", 0.05)

    def release(self) -> None:
        (self.dir / "release").touch()


# ------------------------------------------------------------------ the single-process reference
# what the equivalence tests (and the PS variants', the user methods') compare a run under
# torchrun with
STEPS = 5  # each of reference_state's epochs; conftest's TINY trains as many
# With 2 trainers on gloo/CPU the sums happen to be bit-identical (measured max abs diff 0.0,
# 2026-11-22); the tolerance leaves room for other summation orders (NCCL rings, more
# trainers), while a real semantic difference (a missing average, a skipped step) is orders of
# magnitude larger (test_reference_is_sensitive). lr is small so 5 steps stay in the stable
# regime where float rounding is not amplified.
ATOL, RTOL = 5e-5, 1e-4



def reference_config(**overrides):
    """The resolved config reference_state trains with: TINY's model and data, lr 0.01."""
    from labkit.core.config import TrainConfig
    from labkit.workloads import resolve

    return resolve(TrainConfig(dataset="digits", model="resnet10_small", batch_size=8, lr=0.01,
                               image_size=TINY_CFG["image_size"], **overrides), False)


# One reference implementation of the exact update (issue 61): the synchronous step is
# labkit's own (labkit.training.instruments.exactness, what `labkit check` holds a method of one's
# own to; test_reference_state.py pins this function to exactness.reference_state bit for bit). A
# copy kept here "to be independent" would check nothing more: the methods under test (DDP, the
# all-reduce, the PS) are implemented apart from it either way, and two copies drift. What
# exactness does not model stays here: more epochs, DDP's fp16 hook, the asynchronous PS.
def reference_state(trainers: int, epochs: int = 1, order=None, **overrides) -> dict:
    """Single process: each step, every trainer's batch in turn, gradients averaged, one SGD
    step; BatchNorm buffers are trainer 0's (DDP's default). ``epochs`` of STEPS steps each;
    ``overrides``: other TrainConfig values (e.g. momentum=0.0; compress="fp16" averages as
    DDP's fp16_compress_hook does: each gradient cast to fp16 and divided, summed in fp16).
    ``order`` (the asynchronous PS server in lock-step): instead of one averaged step, per
    step ``order[step]`` lists trainers whose gradients are applied one at a time, each as an
    SGD step with lr / trainers."""
    import torch
    from torch.utils.data import DataLoader

    from labkit.training.data import train_sampler
    from labkit.workloads.images.image_sets import build_datasets
    from labkit.training.instruments.exactness import exact_step
    from labkit.workloads.images.models import build_model

    torch.set_num_threads(1)  # as each torchrun rank (OMP_NUM_THREADS=1): same conv kernels
    cfg = reference_config(**overrides)
    data = build_datasets(cfg)
    torch.manual_seed(cfg.seed)
    model, _ = build_model(cfg.model, data.num_classes)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                          weight_decay=cfg.weight_decay)

    def shards(epoch: int) -> list:
        """Each trainer's batches in this epoch's order."""
        its = []
        for k in range(trainers):
            s = train_sampler(data.train, trainers, k, cfg.seed)
            s.set_epoch(epoch)
            its.append(iter(DataLoader(data.train, batch_size=cfg.batch_size, sampler=s, drop_last=True)))
        return its

    model.train()
    step = 0
    for epoch in range(1, epochs + 1):
        iters = shards(epoch)
        for _ in range(STEPS):
            batches = [next(it) for it in iters]
            if order is None and cfg.compress != "fp16":
                exact_step(model, opt, batches)  # labkit's exact update
            else:
                _variant_step(model, opt, batches, cfg.lr, None if order is None else order[step])
            step += 1
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _variant_step(model, opt, batches: list, lr: float, applied) -> None:
    """One step of what labkit's exact update does not model: ``applied`` None, the gradients
    averaged as DDP's fp16_compress_hook does; else the asynchronous PS's, the trainers'
    gradients in ``applied``'s order, one SGD step of lr / trainers each. BatchNorm buffers
    as in the exact update: every trainer starts from the same, trainer 0's are kept."""
    import torch
    import torch.nn.functional as F

    params, trainers = list(model.parameters()), len(batches)
    start = {n: b.clone() for n, b in model.named_buffers()}
    per_trainer, first = [], None
    for k, (x, y) in enumerate(batches):
        for n, b in model.named_buffers():
            b.copy_(start[n])
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        per_trainer.append([p.grad for p in params])
        if k == 0:
            first = {n: b.clone() for n, b in model.named_buffers()}
    if applied is None:
        for i, p in enumerate(params):
            g = torch.zeros_like(p, dtype=torch.float16)
            for grads in per_trainer:
                g += grads[i].half().div_(trainers)
            p.grad = g.to(p.dtype)
        opt.step()
    else:
        for k in applied:
            for p, g in zip(params, per_trainer[k]):
                p.grad = g
            opt.param_groups[0]["lr"] = lr / trainers
            opt.step()
    for n, b in model.named_buffers():
        b.copy_(first[n])


# ------------------------------------------------------------------ LABKIT_TEST_COUNT's record
def calls(path) -> dict:
    """{(who, pid): collections.Counter of the functions that process called}, from the file
    LABKIT_TEST_COUNT named (tests/hooks/sitecustomize.py)."""
    from collections import Counter

    out: dict = {}
    for line in Path(path).read_text().splitlines():
        who, pid, fn = line.split()
        out.setdefault((who, pid), Counter())[fn] += 1
    return out


def of(found: dict, who: str) -> list:
    """The Counters of the processes of one kind (driver, kernel or rank) in ``calls``'s result."""
    return [c for (w, _), c in found.items() if w == who]


# ------------------------------------------------------------------ state a test may leak
def process_state() -> tuple:
    """What a test run in-process may change and the next test on the worker would inherit:
    the signal handlers labkit.cli.main installs, labkit's console logger (handlers, level,
    propagation) and its level variable (labkit.core.log.setup)."""
    import logging
    import signal

    from labkit.core.log import ENV, ROOT

    log = logging.getLogger(ROOT)
    return ({sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)},
            _own(log.handlers), log.level, log.propagate, os.environ.get(ENV))


def _own(handlers: list) -> list:
    """labkit's own handlers of a logger (pytest adds and removes its capture handlers itself)."""
    return [h for h in handlers if type(h).__module__.startswith("labkit")]


def restore_process_state(state: tuple) -> None:
    import logging
    import signal

    from labkit.core.log import ENV, ROOT

    handlers, log_handlers, level, propagate, env = state
    for sig, h in handlers.items():
        if signal.getsignal(sig) is not h and h is not None:
            signal.signal(sig, h)
    log = logging.getLogger(ROOT)
    log.handlers[:] = [h for h in log.handlers if h not in _own(log.handlers)] + log_handlers
    log.setLevel(level)
    log.propagate = propagate
    if env is None:
        os.environ.pop(ENV, None)
    else:
        os.environ[ENV] = env


# ------------------------------------------------------------------ the emulated cluster
def cluster_cannot() -> str:
    """Why this machine cannot build an emulated cluster of 2 nodes at 100mbit ('' when it can:
    labkit.launch.cluster.check_machine's one line)."""
    if sys.platform != "linux":
        return "Linux only"
    from labkit.core.errors import ConfigError
    from labkit.launch.cluster import ClusterSpec, check_machine, parse_link

    try:
        check_machine(ClusterSpec(2, 1, parse_link("100mbit")))
    except ConfigError as e:
        return str(e)
    return ""


def needs_namespaces_mark():
    """A skip mark for the tests that build an emulated cluster, naming why where it cannot."""
    import pytest

    why = cluster_cannot()
    return pytest.mark.skipif(bool(why), reason=f"no emulated cluster here: {why}")


def lm_workload(**fields):
    """The lm workload of a resolved config (batch 8, 1 epoch, 2 trainers, ``fields`` over
    them), built in this process."""
    from labkit.core.config import TrainConfig
    from labkit.workloads import make_workload, resolve

    cfg = resolve(TrainConfig(workload="lm", batch_size=8, epochs=1, **fields), False, 2)
    return make_workload(cfg)
