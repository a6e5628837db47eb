"""labkit: measure what data-parallel training really costs (DDP, all-reduce, parameter server)."""
__version__ = "0.1.0"

# every module logs through logging.getLogger(__name__); this gives the "labkit" logger its
# console handler, whichever entry imported labkit first (the CLI, a notebook's kernel, a job)
from .core import log as _log  # noqa: E402,F401
