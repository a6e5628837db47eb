"""What the ranks' loader-worker fork server (labkit.training.workers) runs once, at its start,
and nothing else imports: the server dies with its rank, takes SIGTERM as any process does,
and holds torch and the modules the built-in workloads' loader workers import (each one's
``worker_preload``, read from labkit.core.builtins: no workload is named here), so that each
worker it forks starts without importing them."""
import importlib
import signal

from labkit.core.procs import die_with_parent

# the rank that started this server blocks SIGTERM in every thread (a dedicated thread takes
# it: labkit.training.lifecycle), and exec keeps a blocked signal blocked
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
die_with_parent(signal.SIGKILL)

import torch  # noqa: E402,F401 - imported once here, inherited by every worker

import labkit.core.plugins  # noqa: E402,F401 - a user's dataset class unpickles from its file
from labkit.core.builtins import WORKLOADS  # noqa: E402 - the written copy: no workload imported
from .dist import steady_malloc  # noqa: E402

for _name in dict.fromkeys(m for w in WORKLOADS.values() for m in w["worker_preload"]):
    # every built-in's: the server is started with module names only, not knowing which
    # workload its rank trains
    importlib.import_module(_name)

steady_malloc()  # as in the ranks; the workers it forks inherit it
