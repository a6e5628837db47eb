"""Loader workers on an image folder (issue 35): started from a fork server, never forked from a
rank with threads, so crossing many epoch boundaries never hangs; nothing a run starts outlives
it, however it ends; a worker that stops delivering is one line naming its rank and loader.

Every process of a run is followed from outside: the tests poll the process tree under the
torchrun (or `labkit run`) they start and remember every pid, so "nothing left" covers the
ranks, their fork servers and every loader worker, whatever their command lines say.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from helpers import make_image_tree, rank_of

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("loader_workers"), pytest.mark.cold]

# 2 classes x 8 training images of 32 px: 2 steps of 4 per rank an epoch, a real ImageFolder
# with its PIL decoding and random crops in the workers
ARGS = ["--dataset", "imagefolder", "--model", "resnet10_small", "--image-size", "32",
        "--batch-size", "4", "--workers", "2", "--calibrate-steps", "0", "--backend", "gloo",
        "--no-pin-cpus", "--timeout", "120", "--lr", "0.01"]


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    return make_image_tree(tmp_path_factory.mktemp("loader_tree"), n_train=8, n_val=4, size=32)


TREES: list["Tree"] = []


@pytest.fixture(autouse=True)
def kill_what_is_left():
    """A failed test leaves no run behind: whatever its trees still hold is SIGKILLed."""
    yield
    while TREES:
        t = TREES.pop()
        t.root.kill()
        t.poll()
        for p in t.seen.values():
            try:
                p.kill()
            except psutil.Error:
                pass


class Tree:
    """Every process ever seen under one root process (pids pinned by their start times)."""

    def __init__(self, root: subprocess.Popen):
        self.root, self.seen = root, {}  # pid -> psutil.Process (create time pins the pid)
        TREES.append(self)

    def poll(self) -> list[psutil.Process]:
        try:
            now = psutil.Process(self.root.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        for p in now:
            self.seen.setdefault(p.pid, p)
        return now

    def alive(self) -> list[str]:
        left = []
        for p in self.seen.values():
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    left.append(f"{p.pid} {' '.join(p.cmdline())[:100]}")
            except psutil.NoSuchProcess:
                pass
        return left

    def gone_within(self, seconds: float) -> list[str]:
        deadline = time.monotonic() + seconds
        while (left := self.alive()) and time.monotonic() < deadline:
            time.sleep(0.5)
        return left


@pytest.fixture
def run_tmp():
    """The run's own $TMPDIR, to see what a run leaves there: short, since the fork server's
    socket (multiprocessing's pymp-* directory in it) must fit a Unix socket's 108 bytes."""
    path = Path(tempfile.mkdtemp(prefix="lw-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def pymp_dirs(tmp: Path) -> list[str]:
    """multiprocessing's directories left in a run's $TMPDIR (torch's there, its compile cache
    and torchrun's log directory, are torch's to keep or remove)."""
    return sorted(p.name for p in tmp.iterdir() if p.name.startswith("pymp-"))


def start(cmd: list[str], cwd: Path, tmp: Path) -> subprocess.Popen:
    """``cmd`` running, its output into files (a pipe nobody reads would stop it when full),
    its temporary files in ``tmp``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp)}
    with open(cwd / "stdout.txt", "w") as out, open(cwd / "stderr.txt", "w") as err:
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=err)


def stderr(cwd: Path) -> str:
    return (cwd / "stderr.txt").read_text()


def torchrun(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            "-m", "labkit.train", "--method", "ddp", *args]


def is_rank(p: psutil.Process) -> bool:
    return rank_of(p) is not None  # -m labkit.train, or a warm rank (labkit.launch.agent)


def worker_pids(tree: Tree) -> set[int]:
    """pids of the loader workers alive now: grandchildren of a rank (the fork server's)."""
    pids = set()
    for p in tree.poll():
        try:
            if is_rank(p):
                pids |= {c.pid for c in p.children(recursive=True) if c.ppid() != p.pid}
        except psutil.Error:
            pass
    return pids


def server_sockets(tree: Tree) -> set[str]:
    """The paths of the Unix sockets the ranks' fork servers listen on."""
    paths = set()
    for p in list(tree.seen.values()):
        try:
            if "multiprocessing.forkserver" in " ".join(p.cmdline()):
                paths |= {c.laddr for c in p.net_connections("unix") if c.laddr}
        except psutil.Error:
            pass
    return paths


def test_many_epoch_boundaries_never_hang_and_leave_nothing(tree, tmp_path, run_tmp):
    # 35 epochs x 2 ranks x 3 training workers (new each epoch) + the validation loaders'
    # workers: 216 worker starts, each while the rank's threads run (SIGTERM taker, heartbeat,
    # tqdm's monitor, gloo, the previous loader's queue threads shutting down) and a checkpoint
    # is written after every epoch. With a $TMPDIR as long as a cluster job's, too long for a
    # Unix socket's path under it: the fork servers failed there ("AF_UNIX path too long").
    epochs, out = 35, tmp_path / "run"
    long_tmp = run_tmp / ("t" * 80)
    long_tmp.mkdir()
    proc = start(torchrun([*ARGS, "--workers", "3", "--data-dir", str(tree),
                           "--epochs", str(epochs), "--out", str(out)]), tmp_path, long_tmp)
    t = Tree(proc)
    starts, sockets, deadline = set(), set(), time.monotonic() + 400
    while proc.poll() is None and time.monotonic() < deadline:
        starts |= worker_pids(t)
        if len(sockets) < 2:
            sockets |= server_sockets(t)
        time.sleep(0.05)
    if proc.poll() is None:
        stack = subprocess.run(["pgrep", "-af", "labkit.train|forkserver"], capture_output=True,
                               text=True).stdout
        proc.kill()
        pytest.fail(f"the run hung: not finished after 400 s\n{stack}")
    err = stderr(tmp_path)
    assert proc.returncode == 0, err[-3000:]
    doc = json.loads((out / "results_baseline_ddp.json").read_text())
    assert doc["status"] == "completed" and len(doc["epochs"]) == epochs
    # the workers really were started anew every epoch (polling sees most, not all, of them)
    assert len(starts) >= epochs, len(starts)
    assert not t.gone_within(10), t.alive()
    # each rank's fork server had its socket in a directory of its own, in a short temp dir
    # (not under the long $TMPDIR), and that directory is gone with the run
    assert len(sockets) == 2, sockets
    assert all(len(s) <= 107 and str(long_tmp) not in s for s in sockets), sockets
    assert not [s for s in sockets if Path(s).parent.exists()], sockets
    assert not pymp_dirs(long_tmp), pymp_dirs(long_tmp)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
@pytest.mark.parametrize("when", ["workers-starting", "mid-run"])
def test_a_killed_run_leaves_no_process(tree, tmp_path, run_tmp, sig, when):
    out = tmp_path / "run"
    proc = start(torchrun([*ARGS, "--data-dir", str(tree), "--epochs", "1000",
                           "--out", str(out)]), tmp_path, run_tmp)
    t = Tree(proc)
    deadline = time.monotonic() + 120
    # workers-starting: the first moment a worker exists; mid-run: after a few checkpoints
    while time.monotonic() < deadline and proc.poll() is None:
        if worker_pids(t) and (when == "workers-starting" or _epochs_done(out) >= 3):
            break
        time.sleep(0.02)
    assert proc.poll() is None, stderr(tmp_path)[-3000:]
    t.poll()
    os.kill(proc.pid, sig)
    proc.wait(60)
    left = t.gone_within(60)
    assert not left, left
    # the ranks die of SIGTERM either way (torchrun's, or their own when torchrun is killed),
    # taken by the rank's SIGTERM thread, not by its main thread, whose fork server's start
    # had unblocked it: the thread removed the fork server's directory, and mid-run rank 0
    # marked its result file
    assert not pymp_dirs(run_tmp), pymp_dirs(run_tmp)
    if when == "mid-run":
        doc = json.loads((out / "results_baseline_ddp.json").read_text())
        assert doc["status"] == "failed" and "SIGTERM" in doc["error"], doc["status"]


def _epochs_done(out: Path) -> int:
    try:
        return len(json.loads((out / "results_baseline_ddp.json").read_text())["epochs"])
    except (OSError, ValueError, KeyError):
        return 0


def test_a_stopped_worker_is_one_line_naming_its_rank_and_loader(tree, tmp_path, run_tmp):
    bound = 8.0
    out = tmp_path / "ddp"
    proc = start([sys.executable, "-m", "labkit", "run", "ddp", "--nproc", "2", *ARGS,
                  "--data-dir", str(tree), "--epochs", "1000", "--no-progress",
                  "--loader-timeout", str(bound), "--out", str(out)], tmp_path, run_tmp)
    t = Tree(proc)
    deadline, stopped = time.monotonic() + 120, []
    while time.monotonic() < deadline and proc.poll() is None and not stopped:
        for p in t.poll():
            try:
                if rank_of(p) == 1 and _epochs_done(out) >= 1:
                    stopped = [c for c in p.children(recursive=True) if c.ppid() != p.pid]
            except psutil.Error:
                pass
        time.sleep(0.05)
    assert stopped, stderr(tmp_path)[-3000:]
    for w in stopped:
        w.send_signal(signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        proc.wait(bound + 60)
    finally:
        took = time.monotonic() - t0
        if proc.poll() is None:
            proc.kill()
    err = [line for line in stderr(tmp_path).splitlines() if line.strip()]
    assert proc.returncode == 1, err
    assert len(err) == 1, err
    # the stopped workers are the training loader's or the validation loader's
    assert re.match(r"labkit: ddp failed: rank 1: the (training|validation) data loader's "
                    rf"workers sent nothing for {bound:g} s (at|in) epoch \d+", err[0]), err
    assert "--loader-timeout" in err[0]
    # the bound, plus at most the batches already made and the time to stop the other rank
    assert took < bound + 45, took
    print(f"stopped workers reported after {took:.1f} s (bound {bound:g} s)")
    assert not t.gone_within(60), t.alive()  # the stopped workers too (SIGKILL reaches them)
    assert not pymp_dirs(run_tmp), pymp_dirs(run_tmp)
