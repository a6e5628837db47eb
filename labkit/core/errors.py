"""Bad input, and runs that failed without crashing: shown to the user as one line naming the
problem, never as a traceback."""
from __future__ import annotations

import re


class ConfigError(ValueError):
    """Bad input (a flag, a parameter, a data folder, a file): one line, exit 2."""

    def _render_traceback_(self) -> list[str]:
        # IPython shows this instead of the traceback in a notebook cell (JupyterLab, papermill):
        # the frames of labkit's own checks would bury the one line that says what to change
        return [f"\x1b[0;31m{type(self).__name__}\x1b[0m: {self}"]


class RunFailed(RuntimeError):
    """Training that went wrong without crashing: a loss that diverged, replicas that drifted
    apart. A failure of the run (exit 1, its result file failed with this message as the
    reason), not bad input; said in one line, never as a traceback. Every rank raises it at the
    same point (the verdict rests on values every rank holds), rank 0 (each node's first)
    prints ``labkit.train: error: <method> failed: <what>`` and the launcher shows that line alone
    (:data:`RUN_FAILED_LINE`)."""

    def __init__(self, method: str, what: str):
        super().__init__(f"{method} failed: {what}")
        self.method, self.what = method, what


#: a rank's line that says its run failed (RunFailed): the launcher shows the message alone
RUN_FAILED_LINE = re.compile(r"labkit\.train: error: (\w+ failed: .*\S)")


class Exhausted(RunFailed):
    """The machine ran out of something under a rank: the disk, /dev/shm, host or GPU memory
    (labkit.training.exhaustion says which, where, at which epoch and step). Unlike its parent
    only the rank that ran out knows, so that rank says it (its line still matches
    :data:`RUN_FAILED_LINE`, so the launcher shows it alone), and torchrun's error file of that
    rank records it, the traceback kept in the rank's log."""
