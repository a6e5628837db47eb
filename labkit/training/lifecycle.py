"""How a result file ends when its run is stopped from outside, on the bare torchrun path too.

Two layers, because neither covers every case alone:

1. :func:`take_sigterm` (in the ranks): when one rank dies, torchrun stops the others with
   SIGTERM, then SIGKILL after its grace period. A Python signal handler runs only in the main
   thread between bytecodes, so a rank blocked in a C++ collective could not run one. Instead
   SIGTERM is blocked in every thread and taken by a dedicated thread with ``sigwait``: it runs
   the registered callbacks (rank 0 marks its result file "failed", atomically) and then dies
   of the same SIGTERM, so torchrun still sees exit code -15.
2. :func:`heartbeat` / :func:`settle` (writer and readers): SIGKILL, the OOM killer or a lost
   node cannot be caught. Rank 0 stamps its file with host, pid and time, refreshed every
   ``HEARTBEAT_S`` by a thread; every reader (``labkit report``, the report notebook, the
   explorer) passes the file through :func:`settle`, which shows a "running" file whose writer
   is gone as "stopped" (stopped without finishing).

And how a rank that finished ends: :func:`leave`, without the interpreter's teardown.
"""
from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from typing import Callable, Optional

HEARTBEAT_S = 30.0
# a writer on another host (or in another PID namespace) cannot be looked up: it is taken as
# gone when its heartbeat is this old (generous: clocks of two hosts differ, a loaded host lags)
STALE_S = 10 * HEARTBEAT_S

_callbacks: list[Callable[[], None]] = []


# ------------------------------------------------------------------ SIGTERM in the ranks
def take_sigterm() -> None:
    """Block SIGTERM in this thread and every thread started after it, and take it in a
    dedicated thread. Call first thing in the main thread, before torch starts its threads."""
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return  # someone else handles SIGTERM here
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    # forked children (DataLoader workers) must stay killable by SIGTERM
    os.register_at_fork(after_in_child=_unblock)
    threading.Thread(target=_wait_for_sigterm, name="labkit-sigterm", daemon=True).start()


def on_sigterm(callback: Callable[[], None]) -> None:
    """Run ``callback`` (in the SIGTERM thread) before the process dies of SIGTERM."""
    _callbacks.append(callback)


def _unblock() -> None:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def _wait_for_sigterm() -> None:
    signal.sigwait({signal.SIGTERM})
    for cb in list(_callbacks):
        try:
            cb()
        except Exception:  # noqa: BLE001 - the process must still die as asked
            pass
    # die of SIGTERM (default action) from this thread, the only one that does not block it
    _unblock()
    signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
    time.sleep(1)
    os._exit(128 + signal.SIGTERM)


# ------------------------------------------------------------------ heartbeat (writer side)
def _pid_start(pid: int) -> Optional[str]:
    """The process's start time in clock ticks since boot (tells a reused pid apart)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid: int, start: Optional[str]) -> bool:
    if start is not None:  # Linux: the same process, not another one given the same pid
        return _pid_start(pid) == start
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _pid_namespace() -> Optional[str]:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def stamp() -> dict:
    """This process's heartbeat: who writes the file, and when it last did."""
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "pid_start": _pid_start(pid),
            "pid_namespace": _pid_namespace(), "time": time.strftime("%Y-%m-%d %H:%M:%S"),
            "unix_time": time.time(), "every_s": HEARTBEAT_S}


def heartbeat(write: Callable[[], bool], every: float = HEARTBEAT_S) -> threading.Thread:
    """Call ``write`` every ``every`` seconds in a daemon thread until it returns False."""
    def beat() -> None:
        while True:
            time.sleep(every)
            try:
                if not write():
                    return
            except OSError:
                pass  # a full or unmounted disk: the next beat tries again
    t = threading.Thread(target=beat, name="labkit-heartbeat", daemon=True)
    t.start()
    return t


def leave(code: int) -> None:
    """End a rank that has finished (labkit.train, labkit.training.bench_rank) without Python's
    teardown of torch and torchvision. Nothing is left to do by then (result files and
    checkpoints are written with fsync, the process group is gone), and the teardown costs ~1 s
    of CPU per rank: 4 ranks on 2 cores kept torchrun waiting 4 s after the last line of every
    run (measured 2026-11-23). DataLoader workers are the rank's children until their loader
    is collected: while any lives, it exits the ordinary way, which shuts them down. A rank
    that failed exits the ordinary way too: failures are rare, and torchrun's error files and
    restarts read what it leaves."""
    import psutil

    sys.stdout.flush()
    sys.stderr.flush()
    if code == 0 and not psutil.Process().children():
        os._exit(code)
    sys.exit(code)


# ------------------------------------------------------------------ readers
def writer_gone(doc: dict, now: Optional[float] = None) -> Optional[str]:
    """Why a "running" result file's writer is known to be gone, or None (alive, finished, or a
    file without a heartbeat)."""
    hb = doc.get("heartbeat")
    if doc.get("status") != "running" or not isinstance(hb, dict):
        return None
    who = f"pid {hb.get('pid')} on {hb.get('host')}, last update {hb.get('time')}"
    if hb.get("host") == socket.gethostname() and hb.get("pid_namespace") == _pid_namespace():
        pid = hb.get("pid")
        return None if isinstance(pid, int) and _alive(pid, hb.get("pid_start")) else f"its writer ({who}) is gone"
    age = (now or time.time()) - float(hb.get("unix_time") or 0)
    stale = max(STALE_S, 10 * float(hb.get("every_s") or HEARTBEAT_S))
    if age > stale:
        return f"no heartbeat for {age / 60:.0f} min from its writer ({who})"
    return None


def settle(doc: dict) -> dict:
    """The result as a reader should show it: a "running" file whose writer is gone becomes
    status "stopped" with an error saying so (the file itself is left as it is)."""
    why = writer_gone(doc)
    if why is None:
        return doc
    return {**doc, "status": "stopped", "error": f"stopped without finishing: {why}"}
