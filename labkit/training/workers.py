"""The ranks' DataLoader worker processes: started without forking the rank, ended with it.

Why not fork. A rank has threads of its own by the time its loaders start workers: the SIGTERM
taker (labkit.training.lifecycle), rank 0's heartbeat, tqdm's monitor, gloo's threads, and the
queue feeders and pin-memory thread of the loader whose iterator is shutting down at that
moment. ``fork`` copies only the calling thread, with every lock as it was: a child forked
while another thread held one of the interpreter's locks (a thread being created or torn down)
waits for it forever, inside the fork, before any code of its own runs. Since training loaders
start new workers every epoch (each epoch's seed), image-folder runs hung at an epoch boundary
in 3 of 11 tries on a 2-core machine. So every loader of a rank uses a fork server
(multiprocessing's "forkserver"): a fresh interpreter started once per rank by fork+exec (safe
with threads: nothing but exec runs in the child), that imports torch and the datasets once
(labkit.training.worker_server) and forks each worker from its one Python thread. The workers
draw the same random numbers as forked ones would (the loader seeds them from its generator in
the rank), so crops, resumed runs and the plain loop's equality are unchanged.

Why nothing outlives the rank. The fork server dies with the rank (it asks for SIGKILL on its
parent's exit, :mod:`labkit.core.procs`), and each worker with the fork server
(:func:`worker_init`): a worker that is stopped, stuck in a system call or in a deadlock ends
with its run, and none is left as an orphan. Nor is the server's socket directory (the rank's
``$TMPDIR/pymp-*``): a rank that ends without the interpreter's teardown removes it
(:func:`remove_temp_dir`), and starting the server leaves SIGTERM to the rank's SIGTERM thread.

Why a worker that stops delivering is one line. While the rank's main thread waits for a
batch, :class:`LoaderWatch` keeps time; past its bound it interrupts the wait with SIGALRM,
sent to that thread alone, whose handler raises :class:`LoaderStalled`; labkit.training.exhaustion
turns it into one line naming the rank and the loader, instead of the collective timeout its
peers would report minutes later, blaming this rank as hung. (DataLoader's own ``timeout``
covers only the wait on its queue: a worker stopped after it queued a batch, but before it
handed over the batch's shared memory, leaves the rank waiting in that hand-over for ever.) And
a worker killed by a signal (SIGBUS when /dev/shm is full, SIGKILL from the OOM killer or a
person) is not the rank's child, so :func:`batches` names the signal from the worker's exit
code, as torch does for forked workers; :func:`oom_killed` tells which SIGKILL it was.
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
from multiprocessing import resource_tracker
import signal
import threading
import time
from typing import Any, Iterable, Iterator, Optional

import psutil

from labkit.core.procs import die_with_parent
from labkit.core.resources import oom_kills

SERVER_PRELOAD = ["labkit.training.worker_server"]


def loader_options(workers: int) -> dict[str, Any]:
    """DataLoader keyword arguments for ``workers`` worker processes that start from the fork
    server and die with it; none for 0 workers (the rank loads in its own thread)."""
    if workers <= 0:
        return {}
    return {"multiprocessing_context": context(), "worker_init_fn": worker_init}


def context() -> multiprocessing.context.BaseContext:
    """The fork-server context, the server started now if it is not running. Called from the
    thread that builds the loaders (the rank's main thread): the server's life is tied to the
    thread that starts it."""
    global _SERVER_READY
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(SERVER_PRELOAD)
    _short_temp_dir()  # before multiprocessing makes its own directory for the server's socket
    # multiprocessing starts its resource tracker with SIGTERM blocked, then unblocks it in
    # the calling thread: in this one, that would undo lifecycle.take_sigterm, and SIGTERM
    # would kill the rank in its main thread before rank 0 marked its result file. So the
    # tracker is started from a thread of its own, whose mask (blocked, as this one's) is the
    # tracker's; the server's start below finds it running and leaves masks alone.
    tracker = threading.Thread(target=resource_tracker.ensure_running, name="labkit-tracker")
    tracker.start()
    tracker.join()
    multiprocessing.forkserver.ensure_running()
    if not _SERVER_READY:
        count_oom_kills()  # before this rank's first worker exists
        # the server imports torch before it forks anything (seconds on a busy machine): one
        # process started and joined now waits for that here, while the loaders are built,
        # not in the first step's data wait, where --loader-timeout would count it
        p = ctx.Process(target=_ready, daemon=True)
        p.start()
        p.join()
        _SERVER_READY = True
    return ctx


_SERVER_READY = False
#: the kernel's count of out-of-memory kills before this rank's first loader worker started
#: (labkit.core.resources.oom_kills; None: not read, or not readable here)
_OOM_KILLS: Optional[int] = None


def count_oom_kills() -> None:
    """Read the kernel's count of out-of-memory kills now, before this rank's loader workers
    start: a worker killed later is put on memory only where the count grew (oom_killed)."""
    global _OOM_KILLS
    _OOM_KILLS = oom_kills()


def oom_killed() -> Optional[bool]:
    """Whether the kernel counted an out-of-memory kill since this rank's workers began
    (count_oom_kills); None where either count is not known."""
    now = oom_kills()
    return None if _OOM_KILLS is None or now is None else now > _OOM_KILLS


# A Unix socket's path holds at most 107 bytes: the server's is <tempdir>/pymp-XXXXXXXX/
# listener-XXXXXXXX, 32 more than the temp dir's own path
_SOCKET_ROOM = 107 - 32


def _short_temp_dir() -> None:
    """Where $TMPDIR is too long for the server's socket (a cluster's per-job temp dir often is:
    the server then failed with "OSError: AF_UNIX path too long"), make multiprocessing's
    directory under the first short one of /tmp, /var/tmp and /dev/shm instead, before
    multiprocessing makes its own; removed at exit as its own would be."""
    import shutil
    import tempfile
    from multiprocessing import util

    config = multiprocessing.current_process()._config  # util.get_temp_dir's
    if config.get("tempdir") is not None or len(tempfile.gettempdir()) <= _SOCKET_ROOM:
        return
    for base in ("/tmp", "/var/tmp", "/dev/shm"):
        if os.path.isdir(base) and os.access(base, os.W_OK | os.X_OK):
            config["tempdir"] = path = tempfile.mkdtemp(prefix="pymp-", dir=base)
            util.Finalize(None, shutil.rmtree, args=(path, True), exitpriority=-100)
            return


def _ready() -> None:
    """The fork server's first child: nothing to do (see context())."""


def worker_init(worker_id: int) -> None:
    """First thing in every loader worker: SIGKILL when the fork server (its parent) exits. A
    server that ended while this worker was still starting (its rank killed at that moment)
    sends nothing: the worker sees that its parent is no fork server any more and ends."""
    die_with_parent(signal.SIGKILL)
    try:
        parent = " ".join(psutil.Process(os.getppid()).cmdline())
    except psutil.Error:
        parent = ""
    if "multiprocessing.forkserver" not in parent:
        os._exit(1)


class LoaderStalled(RuntimeError):
    """No batch came for the bound's seconds (torch's own words for its loader's timeout)."""

    def __init__(self, seconds: float):
        super().__init__(f"DataLoader timed out after {seconds:g} seconds")


class LoaderWatch:
    """Interrupts the rank's main thread when it waits for a batch longer than ``bound``
    seconds: a daemon thread checks the wait every second and sends SIGALRM to the main thread
    only (a signal sent to the process could reach another thread and leave the wait as it
    is), whose handler raises LoaderStalled there. Built in the main thread."""

    def __init__(self, bound: float):
        self.bound, self.since, self.main = bound, None, threading.get_ident()
        self._sent = False
        signal.signal(signal.SIGALRM, self._interrupt)
        threading.Thread(target=self._watch, name="labkit-loader-watch", daemon=True).start()

    def call(self, fn, *args):
        """``fn(*args)`` (``next(it)``; ``iter(loader)``, which waits for persistent workers to
        start the new epoch), timed by the watch."""
        self.since, self._sent = time.monotonic(), False
        try:
            return fn(*args)
        finally:
            self.since = None

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.bound / 4))
            since = self.since
            if since is not None and not self._sent and time.monotonic() - since > self.bound:
                self._sent = True
                signal.pthread_kill(self.main, signal.SIGALRM)

    def _interrupt(self, signum, frame) -> None:
        if self.since is not None:  # else the batch came in the meantime: nothing to do
            raise LoaderStalled(self.bound)


def batches(loader: Iterable, watch: Optional[LoaderWatch] = None) -> Iterator:
    """``iter(loader)``'s batches, each waited for under ``watch`` if given; a worker that died
    of a signal is named by it ("DataLoader worker (pid N) is killed by signal: Bus error",
    torch's own words for a forked worker)."""
    call = watch.call if watch is not None else (lambda fn, *args: fn(*args))
    it = None
    try:
        it = call(iter, loader)
        while True:
            try:
                batch = call(next, it)
            except StopIteration:
                return
            yield batch
    except RuntimeError as e:
        failure = _killed(e, it)
        # the run ends here: stopped or stuck workers would hold the rank's exit (torch's
        # shutdown of this iterator waits for each of them)
        kill_all()
        raise failure from e


def _killed(e: RuntimeError, it: object) -> RuntimeError:
    """torch's "exited unexpectedly" for a worker it cannot wait for (the fork server's child),
    with the signal read from the worker's exit code; ``e`` itself otherwise."""
    if "exited unexpectedly" not in str(e):
        return e
    # the iterator's worker processes (torch keeps them as _workers; where it does not, the
    # line says "exited unexpectedly", which is still one line)
    for w in getattr(it, "_workers", ()):
        code = w.exitcode
        if code is not None and code < 0:
            return RuntimeError(f"DataLoader worker (pid {w.pid}) is killed by signal: "
                                f"{signal.strsignal(-code)}. ")
    return e


def running() -> list:
    """This process's loader workers that are alive (psutil processes): the children of its
    children (the fork server's; the server and multiprocessing's resource tracker are
    children themselves)."""
    import psutil

    me, found = psutil.Process(), []
    for p in me.children(recursive=True):
        try:
            if p.ppid() != me.pid:
                found.append(p)
        except psutil.NoSuchProcess:
            continue
    return found


def remove_temp_dir() -> None:
    """Remove this process's multiprocessing directory (``$TMPDIR/pymp-*``, where the fork
    server's socket lives). multiprocessing removes it in a finaliser at the interpreter's
    exit, which a rank never reaches when it ends with ``os._exit`` (:func:`lifecycle.leave`)
    or dies of its own SIGTERM: each such run left one directory per rank in /tmp."""
    import shutil

    path = multiprocessing.current_process()._config.get("tempdir")  # util.get_temp_dir's
    if path:
        shutil.rmtree(path, ignore_errors=True)


def kill_all() -> None:
    """SIGKILL every loader worker of this process: a failed rank's exit would otherwise wait
    for a stopped or stuck one (torch's shutdown joins it, and its queue's feeder thread may
    be blocked writing to it)."""
    for p in running():
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
