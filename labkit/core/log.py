"""labkit's console: every module logs through ``logging.getLogger(__name__)`` and this module
gives the ``labkit`` logger one handler that prints the bare message, so the console reads as
it did when these were prints.

    log = logging.getLogger(__name__)
    log.info("run folder: %s", run)          # stdout
    log.warning("labkit: warning: ...")      # stderr (as are errors)

``setup(verbosity)`` is called once, by the command line (``labkit -q ...``, ``labkit -v ...``):
-q shows only warnings, errors and what a command prints as its product (a table, JSON, the
experiment's summary, printed to stdout); -qq errors only; -v adds debug lines (the torchrun
command, torchrun's own lines that are otherwise only kept in torchrun.log). -v is passed on to
what the command starts (papermill kernels, Slurm jobs) in ``LABKIT_LOG_LEVEL``; -q is not:
they keep logging at INFO, so an executed notebook and a job's log are the same record with -q
or without, and the command hides their lines from its own console.

Without ``setup`` (a notebook run by hand, labkit imported as a library) the handler is there
all the same, at INFO, so a notebook's cell output is what the command line shows.

``LineLog`` is the file-like a command hands to what writes a transcript (papermill's kernel
output, the launcher's live rank lines): each whole line becomes a log record, so -q hides it.
"""
from __future__ import annotations

import io
import logging
import os
import re
import sys

ROOT = "labkit"
ENV = "LABKIT_LOG_LEVEL"  # the level a command passes on to the processes it starts (INFO or DEBUG)
LEVELS = {-2: logging.ERROR, -1: logging.WARNING, 0: logging.INFO, 1: logging.DEBUG}
# labkit's one-line warnings and errors in a transcript pass -q: "labkit: warning: ..." (a
# kernel's launcher), "[rank1]: labkit.train: warning: ..." (a rank), "labkit sweep: error: ...".
# A rank's error line is not raised: it is a consequence of another rank's failure or is quoted
# in the launcher's one line, which is the error said.
_SAYS = re.compile(r"^(?:(?:\[\w+\]:\s*)?labkit[\w.]*(?: [\w-]+)*: (warning)|labkit[\w.]*"
                   r"(?: [\w-]+)*: (error)): ")


class Console(logging.Handler):
    """The message alone; below WARNING on stdout, WARNING and above on stderr. The streams are
    looked up at each record (pytest's capture, a kernel's redirected streams), and flushed,
    so stdout and stderr lines keep their order in a terminal or a ``2>&1`` pipe."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:  # noqa: BLE001 - logging's own contract: report, never raise
            self.handleError(record)


def level_of(verbosity: int) -> int:
    """-qq -2, -q -1, neither 0, -v 1 (more of either: the last step)."""
    return LEVELS[max(-2, min(1, verbosity))]


def setup(verbosity: int = 0) -> int:
    """Set labkit's console level for this process (and, for -v, those it starts); the level."""
    level = level_of(verbosity)
    os.environ[ENV] = logging.getLevelName(min(level, logging.INFO))
    _install(level)
    return level


def _install(level: int) -> None:
    logger = logging.getLogger(ROOT)
    for h in [h for h in logger.handlers if isinstance(h, Console)]:
        logger.removeHandler(h)
    logger.addHandler(Console())
    logger.setLevel(level)
    logger.propagate = False  # a root handler someone configured would print every line twice


def _inherited() -> int:
    level = logging.getLevelName(os.environ.get(ENV, "INFO"))
    return level if isinstance(level, int) else logging.INFO


class LineLog(io.TextIOBase):
    """A text stream that logs each whole line written to it: labkit's warning and error lines
    at their level, the rest at ``level``. A line still open at ``close`` is logged then."""

    def __init__(self, logger: logging.Logger, level: int = logging.INFO):
        super().__init__()
        self.logger, self.level, self._open = logger, level, ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        *lines, self._open = (self._open + text).split("\n")
        for line in lines:
            self._log(line)
        return len(text)

    def close(self) -> None:
        if self._open:
            self._log(self._open)
            self._open = ""
        super().close()

    def _log(self, line: str) -> None:
        says = _SAYS.match(line)
        level = logging.getLevelName((says.group(1) or says.group(2)).upper()) if says else self.level
        self.logger.log(level, line)


def transcript(name: str) -> LineLog:
    """The stream a command's transcript goes to: lines of module ``name``'s logger at INFO."""
    return LineLog(logging.getLogger(name))


if not any(isinstance(h, Console) for h in logging.getLogger(ROOT).handlers):
    _install(_inherited())


class Lines:
    """A file for tqdm when stderr is a log or a pipe (torchrun --tee, the launcher, papermill):
    each refresh becomes one whole line instead of a carriage-return overwrite."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, s: str) -> None:
        s = s.replace("\r", "").strip("\n")
        if s.strip():
            self.stream.write(s + "\n")

    def flush(self) -> None:
        self.stream.flush()
