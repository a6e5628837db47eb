"""A process's life tied to its parent's, so that nothing a run starts outlives it.

Linux's ``PR_SET_PDEATHSIG``: the kernel sends the chosen signal to this process when the
thread that started it exits, however that happens (an exception, SIGKILL, the OOM killer), and
the signal reaches a process that is stopped or stuck as well. The launcher's torchrun, every
rank, the ranks' loader-worker fork server and each loader worker ask for it
(labkit.launch.launch, labkit.training.lifecycle, labkit.training.workers).
"""
from __future__ import annotations

import os

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
#: in a process forked by a warm process (labkit.launch.warm, which sets it): that
#: process's socket; None in a process started any other way
warm_server: str | None = None
#: set (to the node count) in every process of an emulated cluster (labkit.launch.emulated), whose
#: PID namespace holds the whole run: its ranks count every node's processes as the run's own
EMULATED_NODES = "LABKIT_EMULATED_NODES"


def die_with_parent(sig: int) -> bool:
    """Get ``sig`` when the parent exits; True where the kernel took the request (Linux). A
    parent that is already gone (this process was reparented before it asked) sends nothing:
    a caller that can tell checks ``os.getppid()`` after asking."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig)) == 0
    except (OSError, AttributeError):  # not Linux: no such call
        return False


def started_by() -> str:
    """How this process started: forked by a warm process (labkit.launch.warm: an experiment's,
    or ``labkit warm``'s), by a launch's own fork server of ranks (labkit.launch.agent), or as
    an interpreter."""
    import multiprocessing

    return ("warm process" if warm_server else
            "agent's fork server" if multiprocessing.parent_process() else "interpreter")


def started_at() -> float:
    """When this process started, in seconds since the epoch, to a clock tick: its age (the
    system's uptime less its start in ticks since boot, /proc) taken from now. psutil's
    create_time adds the start to /proc/stat's boot time, which is whole seconds: up to a second
    early, the same for every process of one boot (1.0 s on a VM here), which moved a second
    from the accounting's rank start to its agent row."""
    import time

    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rpartition(")")[2].split()[19])  # field 22: starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):  # not Linux
        import psutil

        return psutil.Process().create_time()
