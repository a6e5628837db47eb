"""Ranks forked from a warm interpreter, for the tests that check arithmetic (equal parameters,
bytes on the wire, result-file contents) rather than torchrun itself.

A torchrun launch pays an agent's start-up (about 1.5 CPU s: it imports torch) and each rank's
(about 2.2 CPU s: torch, torchvision, torch._dynamo, labkit) before any step (docs/testing.md).
Here one interpreter per pytest worker, multiprocessing's fork server, imports those once
(``PRELOAD``), runs no torch op and starts no thread, and forks every rank from there. Each rank
is then what torchrun makes of one: its own process and session, RANK / WORLD_SIZE /
LOCAL_RANK / LOCAL_WORLD_SIZE / MASTER_ADDR / MASTER_PORT in its environment (with the test's
variables and one thread), the test hooks installed as at a Python start-up
(tests/hooks/sitecustomize.py), ``sys.argv`` as ``python -m labkit.train ARGS`` has it, and
then labkit/train.py run as ``__main__``: the same entry point (labkit.training.lifecycle's
begin_rank), so nothing in the package knows it was forked.

As torchrun: when a rank fails the others get SIGTERM (SIGKILL after ``GRACE`` s), and the
launch exits 1; a launch still running after ``timeout`` seconds is killed, every rank's group,
and subprocess.TimeoutExpired raised. Each rank's stdout and stderr go to files of its own,
read back into a CompletedProcess (every rank's stdout, then every rank's stderr, in rank
order), so a test's assertions on ``returncode``, ``stdout`` and ``stderr`` read the same as
with helpers.torchrun. What stays on torchrun: every test of the launcher, faults, signals,
loaders and the lab's commands (docs/testing.md).
"""
from __future__ import annotations

import io
import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import wait
from pathlib import Path

from helpers import HOOKS, ONE_THREAD, free_port

# what a rank imports: the product's own list (labkit.launch.agent, whose warm process forks
# the ranks of every labkit launch), and this module (each rank's target, unpickled in the child)
from labkit.launch.agent import PRELOAD as _PRODUCT  # noqa: E402

PRELOAD = [
    *_PRODUCT,
    "warm",  # this module: each rank's target, unpickled in the child
]
GRACE = 15.0  # seconds between SIGTERM and SIGKILL for the ranks left when one failed
TRAIN = str(Path(__file__).resolve().parents[1] / "labkit" / "train.py")
_TEST_VARS = "LABKIT_TEST_"  # the hooks' variables: per launch, never the server's


def _context() -> multiprocessing.context.BaseContext:
    """The fork-server context, its server started now if it is not running: with the
    preloaded modules, one thread per process, and none of the hooks' variables (a rank gets
    those from its launch, and installs the hooks then)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    # the server starts with this process's environment as it is now: changed for that moment
    removed = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith(_TEST_VARS)}
    before = {k: os.environ.get(k) for k in ONE_THREAD}
    os.environ.update(ONE_THREAD)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        os.environ.update(removed)
    return ctx


def server_cpu_seconds() -> float:
    """The fork server's CPU seconds: its own (the preload) and its reaped children's (every
    rank that ended). The ranks are its children, not the pytest worker's, so the suite's CPU
    count (tests/conftest.py) adds this."""
    pid = multiprocessing.forkserver._forkserver._forkserver_pid
    return 0.0 if pid is None else reaped_cpu_seconds(pid)


def reaped_cpu_seconds(pid: int) -> float:
    """A process's CPU seconds, its own and its reaped children's (0 where it is gone)."""
    try:
        import psutil

        t = psutil.Process(pid).cpu_times()
        return t.user + t.system + t.children_user + t.children_system
    except Exception:  # noqa: BLE001 - gone (the worker is ending): nothing more to count
        return 0.0


# ------------------------------------------------------------------ in the rank
def _rank(env: dict, argv: list[str], cwd: str, log: str) -> None:
    """The forked rank: what torchrun's ``python -u -m labkit.train ARGS`` would be."""
    os.setsid()  # a session of its own, as torchrun starts each rank: killpg reaches all of it
    signal.pthread_sigmask(signal.SIG_SETMASK, ())
    for fd, name in ((1, "out"), (2, "err")):
        f = os.open(f"{log}.{name}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    # -u: unbuffered
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True,
                                  errors="backslashreplace")
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.path.insert(0, cwd)  # python -m puts the working directory first
    sys.argv = [TRAIN, *argv]
    # what the census (LABKIT_TEST_CENSUS, tools/suite_census.py) records as its command line:
    # a warm rank, not the fork server it was forked from
    sys.orig_argv = [sys.executable, "warm", "-m", "labkit.train", *argv]
    hooks = Path(HOOKS) / "sitecustomize.py"
    if any(k.startswith(_TEST_VARS) for k in env) and hooks.is_file():
        runpy.run_path(str(hooks), run_name="sitecustomize")  # as at start-up, now with the env
    # then as a rank of the product's warm agent: labkit.train run as `python -m` runs it (its
    # own multiprocessing directory, not the pytest worker's, whose holds the server's socket)
    from labkit.training.lifecycle import warm_rank

    warm_rank("labkit.train", *argv)


# ------------------------------------------------------------------ the launch
class Launch:
    """``nproc`` ranks of ``labkit.train ARGS`` forked from the warm server, started at once;
    ``wait()`` returns their CompletedProcess (a port another process took between free_port
    and rank 0's bind: started again on a new one, up to ``tries`` times)."""

    def __init__(self, nproc: int, args: list[str], cwd, env: dict | None = None,
                 timeout: float = 240, tries: int = 5):
        import torch

        if "--backend" not in args and nproc > torch.cuda.device_count():
            args = [*args, "--backend", "gloo"]  # as helpers.torchrun: the arithmetic is gloo's
        self.nproc, self.args, self.cwd, self.timeout, self.tries = nproc, list(args), str(cwd), timeout, tries
        self.env = {**os.environ, **ONE_THREAD, **(env or {})}
        self.cmd = ["warm", f"--nproc_per_node={nproc}", "-m", "labkit.train", *self.args]
        self._start()

    def _start(self) -> None:
        ctx = _context()
        self.port = free_port()
        self.logs = Path(tempfile.mkdtemp(prefix="labkit-warm-"))
        self.deadline = time.monotonic() + self.timeout
        self.procs = []
        for r in range(self.nproc):
            env = {**self.env, "RANK": str(r), "WORLD_SIZE": str(self.nproc),
                   "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": str(self.nproc), "GROUP_RANK": "0",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.port),
                   "TORCHELASTIC_RUN_ID": f"warm-{self.port}", "TORCHELASTIC_RESTART_COUNT": "0"}
            p = ctx.Process(target=_rank, args=(env, self.args, self.cwd, str(self.logs / f"rank{r}")),
                            name=f"rank{r}")
            p.start()
            self.procs.append(p)

    def wait(self) -> subprocess.CompletedProcess:
        for _ in range(self.tries):
            result = self._wait_once()
            if not (result.returncode and _port_taken(result.stderr)):
                return result
            self._start()
        return result

    def _wait_once(self) -> subprocess.CompletedProcess:
        pending = {p.sentinel: p for p in self.procs}
        codes: dict[int, int] = {}
        kill_at = None
        while pending:
            now = time.monotonic()
            if kill_at is not None and now >= kill_at:
                self._signal(pending.values(), signal.SIGKILL)
                kill_at = float("inf")
            if now >= self.deadline and kill_at is None:
                self._signal(pending.values(), signal.SIGKILL)
                for p in pending.values():
                    p.join()
                out, err = self._read()
                raise subprocess.TimeoutExpired(self.cmd, self.timeout, output=out, stderr=err)
            until = min(self.deadline if kill_at is None else kill_at, now + 3600)
            for s in wait(list(pending), timeout=max(0.0, until - now)):
                p = pending.pop(s)
                p.join()
                codes[int(p.name[4:])] = p.exitcode
                if p.exitcode != 0 and kill_at is None:  # as torchrun: stop the others
                    self._signal(pending.values(), signal.SIGTERM)
                    kill_at = time.monotonic() + GRACE
        started = {r for r in range(self.nproc) if (self.logs / f"rank{r}.err").exists()}
        out, err = self._read()
        failed = {r: c for r, c in sorted(codes.items()) if c != 0}
        if failed:  # a rank that failed before it ran (in multiprocessing's start) has no log
            err += "".join(f"warm: rank {r} exited with {c}"
                           f"{'' if r in started else ' before it ran: see the pytest worker stderr'}\n"
                           for r, c in failed.items())
        return subprocess.CompletedProcess(self.cmd, 1 if failed else 0, out, err)

    @staticmethod
    def _signal(procs, sig: int) -> None:
        for p in procs:
            try:
                os.killpg(p.pid, sig)  # the rank's session: it and anything it started
            except ProcessLookupError:  # not yet in a session of its own, or gone
                try:
                    os.kill(p.pid, sig)
                except ProcessLookupError:
                    pass

    def _read(self) -> tuple[str, str]:
        def text(name: str) -> str:
            path = self.logs / name
            return path.read_text(errors="backslashreplace") if path.exists() else ""
        out = "".join(text(f"rank{r}.out") for r in range(self.nproc))
        err = "".join(text(f"rank{r}.err") for r in range(self.nproc))
        shutil.rmtree(self.logs, ignore_errors=True)
        return out, err


def _port_taken(stderr: str) -> bool:
    """Rank 0 could not listen on MASTER_PORT: another process took it after free_port."""
    return "EADDRINUSE" in stderr or "Address already in use" in stderr


def start_warm(nproc: int, args: list[str], cwd, env: dict | None = None,
               timeout: float = 240) -> Launch:
    """Start ``nproc`` warm ranks of ``labkit.train ARGS`` (wait() for their result): several
    launches started before the first is waited for run at once."""
    return Launch(nproc, args, cwd, env, timeout)


def warm_run(nproc: int, args: list[str], cwd, env: dict | None = None,
             timeout: float = 240) -> subprocess.CompletedProcess:
    """helpers.torchrun's arithmetic, from warm ranks: ``labkit.train ARGS`` on ``nproc`` ranks
    forked from this worker's warm server; the same arguments and the same kind of result."""
    return Launch(nproc, args, cwd, env, timeout).wait()
