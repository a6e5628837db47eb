"""What the ranks' loader-worker fork server (labkit.training.workers) runs once, at its start,
and nothing else imports: the server dies with its rank, takes SIGTERM as any process does,
and holds torch, torchvision's datasets and labkit's data modules, so that each worker it forks
starts without importing them."""
import signal

from labkit.core.procs import die_with_parent

# the rank that started this server blocks SIGTERM in every thread (a dedicated thread takes
# it: labkit.training.lifecycle), and exec keeps a blocked signal blocked
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
die_with_parent(signal.SIGKILL)

import torch  # noqa: E402,F401 - imported once here, inherited by every worker
import torchvision.datasets  # noqa: E402,F401
import torchvision.transforms  # noqa: E402,F401

import labkit.core.plugins  # noqa: E402,F401 - a user's dataset class unpickles from its file
import labkit.workloads.images.image_sets  # noqa: E402,F401
import labkit.workloads.images.jpeg_files  # noqa: E402,F401
from .dist import steady_malloc  # noqa: E402

steady_malloc()  # as in the ranks; the workers it forks inherit it
