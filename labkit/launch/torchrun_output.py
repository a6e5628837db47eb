"""torchrun's console, read in one place: which of its lines the launcher streams, which are a
progress bar, which ranks its failure summary names, and which options this torchrun takes.

    reader = TorchrunOutput()
    for line in reader.feed(raw):     # each piece of what torchrun printed (a \\r splits a line)
        if line.shown: ...            # a rank's line worth streaming; line.progress: a tqdm bar
    failures(output)                  # [(rank, local_rank, exitcode)] from the failure summary
    rendezvous_failed(output)         # a multi-node rendezvous that never completed
    knows("--log-line-prefix-template")

Everything that depends on how torchrun words its output is here, and tests/test_logging.py
feeds it lines captured from real runs (torch 2.14.1): a torch upgrade that changes them fails
those tests, not the launcher, quietly.

What is streamed: the reporting ranks' lines (torchrun prefixes them ``[rank0]:``, or
``[default0]:`` without --log-line-prefix-template). What is not (it stays in torchrun.log and
the rank logs): torchrun's own warnings, its traceback and failure summary, the profiler's
log, a rank's traceback (from its "Traceback" line until its one-line error or its next
epoch), a rank's stack dump (labkit.core.stacks: where it stood), blank lines, and a failed
run's one line (labkit.core.errors.RunFailed), which the
launcher says itself.
"""
from __future__ import annotations

import functools
import os
import re
from typing import Iterator, NamedTuple

from labkit.core.errors import RUN_FAILED_LINE
from labkit.core.stacks import is_dump

PREFIX_TEMPLATE = "[rank${rank}]: "  # --log-line-prefix-template: a rank's lines read [rank3]:

_RANK = re.compile(r"^\[(?:rank|default)\d+\]:")  # a rank's line, as torchrun prefixes it
_OWN_LINE = re.compile(r"labkit\.(train|bench): error:")  # a rank's one-line error
_TRACE_START = re.compile(r'(File "|During handling of the above|The above exception)')
# the profiler library's (kineto's) log, e.g. "USDT:2026-11-22 04:49:54 11098:11098 X.cpp:39] ..."
_KINETO = re.compile(r"^(\[(?:rank|default)\d+\]:\s*)?[A-Z]+:\d{4}-\d\d-\d\d [\d:]+ \d+:\d+ \w+\.cpp:\d+\]")
# torchrun's own log lines ("W1126 01:41:38.493000 24970 torch/...] Sending process ..."), its
# C++ stack frames, its OMP note, a Python traceback's lines, its summary's rules
_NOISE = re.compile(r"^\[?(W|I|E)\d{4} |^frame #\d+: |^Exception raised from |^<omitting python "
                    r"frames>|^\*{5,}|^Setting OMP_NUM_THREADS|^\s*(Traceback|File \"|raise |"
                    r"torch\.distributed\.elastic)|^={5}|^-{5}")
# the failure summary: "  rank      : 1 (local_rank: 1)\n  exitcode  : -9 (pid: 25050)"
_SUMMARY = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


class Line(NamedTuple):
    text: str
    shown: bool      # streamed live; the rest is kept in torchrun.log (labkit -v shows it)
    progress: bool   # a tqdm bar's refresh (the launcher throttles these)


def is_rank_line(text: str) -> bool:
    return _RANK.match(text) is not None


def is_noise(text: str) -> bool:
    """torchrun's own warnings and failure dump, and the profiler's log."""
    return bool(_KINETO.match(text) or _NOISE.match(text))


class TorchrunOutput:
    """Reads torchrun's combined stdout and stderr line by line (its state: whether torchrun's
    own traceback has begun, and which ranks are inside one of theirs)."""

    def __init__(self):
        self.dump = False  # torchrun's own traceback and failure summary have begun
        self.inside: set[str] = set()  # ranks whose traceback is being printed

    def feed(self, raw: str) -> Iterator[Line]:
        for piece in raw.rstrip("\n").split("\r"):
            yield Line(piece, self._shown(piece), "batch/s" in piece or "s/batch" in piece)

    def _shown(self, piece: str) -> bool:
        rank_line = is_rank_line(piece)
        self.dump = self.dump or (not rank_line and piece.startswith("Traceback (most recent call last)"))
        return not (not _RANK.sub("", piece).strip() or is_noise(piece) or is_dump(piece)
                    or self._hides(piece)
                    or (self.dump and not rank_line) or RUN_FAILED_LINE.search(piece))

    def _hides(self, line: str) -> bool:
        """A rank's traceback stays in its log, up to its one-line error or its next epoch."""
        m = _RANK.match(line)
        if m is None:
            return False
        rank, text = m.group(0), line[m.end():].strip()
        # a traceback's header can reach us glued to another line (a progress bar's \r, a
        # second stream): its "File" lines open it as well
        if _TRACE_START.match(text) or "Traceback (most recent call last)" in text:
            self.inside.add(rank)
        elif rank in self.inside and (_OWN_LINE.match(text) or text.startswith("epoch ")):
            self.inside.discard(rank)
            return False
        return rank in self.inside


def failures(output: str) -> list[tuple[int, int, int]]:
    """(global rank, local rank, exit code) of each rank torchrun's failure summary names."""
    return [(int(r), int(local), int(code)) for r, local, code in _SUMMARY.findall(output)]


def rendezvous_failed(output: str) -> bool:
    """Whether torchrun gave up on its rendezvous (RendezvousTimeoutError and its kin)."""
    return re.search(r"Rendezvous\w*Error", output) is not None


def knows(flag: str) -> bool:
    """Whether this torch's torchrun takes ``flag``, read from its help (argparse's public
    text, not its private tables). An older torchrun (torch 2.11's, for one) takes an unknown
    option for the script to run, and every rank then dies in ``python --log-line-prefix-
    template=...``; without the prefix its lines read ``[default0]:`` instead of ``[rank0]:``."""
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", _torchrun_help()) is not None


@functools.lru_cache(maxsize=1)
def _torchrun_help() -> str:
    """The text torchrun's options are declared in, torch/distributed/run.py read as a file where
    it is one: importing torch to ask its parser took 1.7 s of every method's notebook kernel
    (2-vCPU VM), which imports torch for nothing else. Else the parser's help."""
    import importlib.util

    spec = importlib.util.find_spec("torch")  # a top-level package: found, not imported
    if spec is not None and spec.origin:
        try:
            with open(os.path.join(os.path.dirname(spec.origin), "distributed", "run.py")) as f:
                return f.read()
        except OSError:
            pass
    from torch.distributed.run import get_args_parser

    return get_args_parser().format_help()  # every alias, where usage names one
