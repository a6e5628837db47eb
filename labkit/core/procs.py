"""A process's life tied to its parent's, so that nothing a run starts outlives it.

Linux's ``PR_SET_PDEATHSIG``: the kernel sends the chosen signal to this process when the
thread that started it exits, however that happens (an exception, SIGKILL, the OOM killer), and
the signal reaches a process that is stopped or stuck as well. The launcher's torchrun, every
rank, the ranks' loader-worker fork server and each loader worker ask for it
(labkit.launch.launch, labkit.training.lifecycle, labkit.training.workers).
"""
from __future__ import annotations

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
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

