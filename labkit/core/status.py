"""What state a run is in, and how a reader sees a result file whose writer may be gone.

Every status a run folder's files hold is a :class:`Status`; no other module of labkit spells
one out. Statuses are stored as their plain string values, so files from older versions and
from the guide's scripts read the same.

A result file is written by its run's rank 0, which refreshes a heartbeat in it
(:func:`stamp`, every ``HEARTBEAT_S``). SIGKILL, the kernel's out-of-memory killer or a lost
node leave the file saying "running" with nobody behind it: every reader (``labkit report``,
the report notebook, the explorer) passes the file through :func:`as_seen`, which shows such a
file as :attr:`Status.STOPPED`. The file itself is left as it is.
"""
from __future__ import annotations

import os
import socket
import time
from enum import StrEnum
from typing import Optional

HEARTBEAT_S = 30.0
# a writer on another host (or in another PID namespace) cannot be looked up: it is taken as
# gone when its heartbeat is this old (generous: clocks of two hosts differ, a loaded host lags)
STALE_S = 10 * HEARTBEAT_S


# why an interrupted run ended, in its result file: Ctrl-C, SIGTERM to the launcher or a
# notebook's stop, each of which stops the ranks as Ctrl-C does (SIGINT); rank 0 writes it as
# the SIGINT reaches it, or the launcher, where rank 0 could not (killed after the grace period)
INTERRUPTED_WHY = "stopped by Ctrl-C, SIGTERM or a notebook's stop"


class Status(StrEnum):
    """The state of a run, a method, a repeat or a sweep point."""
    PENDING = "pending"          # not started yet (a sweep's later points)
    RUNNING = "running"          # started, not ended (or its writer is gone: see as_seen)
    COMPLETED = "completed"      # ended as planned
    FAILED = "failed"            # ended by an error, a failed rank, or a stop from outside
    INTERRUPTED = "interrupted"  # stopped by the user (Ctrl-C, the notebook's stop button)
    STOPPED = "stopped"          # a reader's verdict: on disk "running", but the writer is gone

    @property
    def ended(self) -> bool:
        return self not in (Status.PENDING, Status.RUNNING)

    @property
    def label(self) -> str:
        """How an index of runs shows it (``labkit runs``)."""
        return {Status.COMPLETED: "complete",
                Status.STOPPED: "stopped without finishing"}.get(self, self.value)


def status_of(doc: dict, default: Status = Status.COMPLETED) -> Status:
    """The status a document records; files without one (the guide's scripts) are complete."""
    try:
        return Status(doc.get("status", default))
    except ValueError:
        return Status.FAILED  # a hand-edited word: not a result to trust


# ------------------------------------------------------------------ the heartbeat
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


def writer_gone(doc: dict, now: Optional[float] = None) -> Optional[str]:
    """Why a running document's writer is known to be gone, or None (alive, ended, or a file
    without a heartbeat)."""
    hb = doc.get("heartbeat")
    if doc.get("status") != Status.RUNNING or not isinstance(hb, dict):
        return None
    who = f"pid {hb.get('pid')} on {hb.get('host')}, last update {hb.get('time')}"
    if hb.get("host") == socket.gethostname() and hb.get("pid_namespace") == _pid_namespace():
        pid = hb.get("pid")
        alive = isinstance(pid, int) and _alive(pid, hb.get("pid_start"))
        return None if alive else f"its writer ({who}) is gone"
    age = (now or time.time()) - float(hb.get("unix_time") or 0)
    stale = max(STALE_S, 10 * float(hb.get("every_s") or HEARTBEAT_S))
    if age > stale:
        return f"no heartbeat for {age / 60:.0f} min from its writer ({who})"
    return None


def as_seen(doc: dict) -> dict:
    """The document as a reader should show it: a running one whose writer is gone is
    :attr:`Status.STOPPED`, with an error saying so (the file itself is not changed)."""
    why = writer_gone(doc)
    if why is None:
        return doc
    return {**doc, "status": Status.STOPPED, "error": f"stopped without finishing: {why}"}


def experiment_status(doc: dict) -> Status:
    """An experiment's status as a reader sees it (experiment.json, or a sweep point's): the
    recorded one, a killed writer's as :attr:`Status.STOPPED`; a document without one (written
    by hand, or by an older labkit) from its methods: all completed, or the first problem."""
    methods = [e.get("status") for e in (doc.get("methods") or {}).values()]
    bad = [s for s in methods if s != Status.COMPLETED]
    derived = status_of({"status": bad[0]} if bad else {}, Status.COMPLETED if methods else Status.STOPPED)
    return status_of(as_seen(doc), derived)
