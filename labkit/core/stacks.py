"""Where a rank stood, said in one line, and what a collective mismatch was: the words both the
ranks (labkit.training.stackdump, which writes them into the rank's log) and the launcher
(labkit.launch.failures, which reads them back) use, spelled here once.

A student whose hand-written method hangs needs to know where each rank waited *in their own
code*: "rank 0 at mine.py:14 (after_backward) in all_reduce; rank 1 at mine.py:10
(after_backward), waiting in threading.Event.wait". A rank's position is read from a Python
stack (an exception's traceback, or a live thread's frames) as three frames:

- the **user's frame**: the innermost one in code that is neither labkit's nor Python's nor a
  library's (a method of one's own); for the built-in methods, the innermost one in labkit's
  methods (``labkit/training/sync``); failing both, the innermost one in labkit;
- what it **called** there (the next frame), when that is one of labkit's collective helpers
  (``self.all_reduce``, ``self.send``, ...): "in all_reduce";
- what it **waits in**, when the innermost frame is outside labkit (``threading.Event.wait``,
  ``torch.distributed.recv``): "waiting in ...".

Each rank writes one marker line (:data:`MARK`), read back by :func:`read_marks`, before its
full stack; both stay in the rank's log, the console shows neither.
"""
from __future__ import annotations

import os
import re
import sysconfig
from typing import NamedTuple, Optional

_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../labkit
_METHODS = os.path.join(_HERE, "training", "sync")
# the lab's own parts of labkit/training/sync (the methods' base class and its helpers), not a method
_HELPERS = tuple(os.path.join(_METHODS, f) for f in ("base.py", "collectives.py", "registry.py",
                                                     "__init__.py"))
_LIBS = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib")})

#: the line a rank writes into its log before its stack: ``labkit.stack: rank 1 <how>: <where>``
MARK = "labkit.stack:"
#: the prefix of each line of the stack itself, so that readers can leave the dump out
DUMP = "labkit.stack|"
_MARK = re.compile(r"labkit\.stack: rank (\d+) ([^:]+): (.*\S)")


#: a collective that waited too long: gloo's and torch's words for it (torch's debug wrapper
#: says a rank "failed to pass monitoredBarrier")
TIMED_OUT = re.compile(r"timed out|Timeout|monitoredBarrier", re.I)


#: the words of a rank whose watchdog ended it (labkit.training.stackdump.stalled_line): a cause,
#: never a consequence, though its line names --timeout
STALLED = "made no progress for"


class Frame(NamedTuple):
    file: str
    line: int
    name: str  # the function's qualified name (``Event.wait``)


def _kind(f: Frame) -> str:
    path = os.path.abspath(f.file) if not f.file.startswith("<") else f.file
    if path.startswith(_METHODS) and not path.startswith(_HELPERS):
        return "method"
    if path.startswith(_HERE):
        return "labkit"
    if path.startswith("<") or path.startswith(_LIBS):
        return "library"
    return "user"


def _module(f: Frame) -> str:
    """``threading`` for .../threading.py, ``torch.distributed.distributed_c10d`` for a library."""
    path = os.path.abspath(f.file)
    for lib in _LIBS:
        if path.startswith(lib + os.sep):
            rel = os.path.relpath(path, lib)
            return rel[:-3].replace(os.sep, ".").removesuffix(".__init__") if rel.endswith(".py") else rel
    return os.path.splitext(os.path.basename(path))[0]


def position(frames: list[Frame], waiting: bool = True) -> str:
    """Where a rank stood, from its stack (outermost frame first), as a failure's line says it:
    ``mine.py:14 (after_backward) in all_reduce`` or ``mine.py:10 (after_backward), waiting in
    threading.Event.wait``. Empty for an empty stack. ``waiting`` False (a traceback: where it
    raised, not where it waits): no "waiting in"."""
    if not frames:
        return ""
    kinds = [_kind(f) for f in frames]
    at = None
    for wanted in ("user", "method", "labkit"):
        at = next((i for i in range(len(frames) - 1, -1, -1) if kinds[i] == wanted), None)
        if at is not None:
            break
    if at is None:
        at = len(frames) - 1
    f = frames[at]
    text = f"{f.file}:{f.line} ({f.name.rsplit('.', 1)[-1]})"
    if at + 1 < len(frames) and kinds[at] in ("user", "method") and kinds[at + 1] == "labkit":
        text += f" in {frames[at + 1].name.rsplit('.', 1)[-1]}"
    inner = frames[-1]
    if waiting and at < len(frames) - 1 and kinds[-1] == "library":
        text += f", waiting in {_module(inner)}.{inner.name}"
    return text


def of_traceback(tb) -> list[Frame]:
    """The frames of an exception's traceback (outermost first)."""
    out = []
    while tb is not None:
        code = tb.tb_frame.f_code
        out.append(Frame(code.co_filename, tb.tb_lineno, getattr(code, "co_qualname", code.co_name)))
        tb = tb.tb_next
    return out


def of_frame(frame) -> list[Frame]:
    """The frames of a live thread's stack, from its innermost ``frame`` (outermost first)."""
    out = []
    while frame is not None:
        code = frame.f_code
        out.append(Frame(code.co_filename, frame.f_lineno, getattr(code, "co_qualname", code.co_name)))
        frame = frame.f_back
    return out[::-1]


def mark(rank: int, how: str, where: str) -> str:
    """The marker line: ``labkit.stack: rank 1 stopped by SIGTERM: mine.py:10 (...)``."""
    return f"{MARK} rank {rank} {how}: {where or 'no Python frame'}"


class Mark(NamedTuple):
    rank: int
    how: str
    where: str


def read_marks(lines: list[str]) -> list[Mark]:
    """Every marker line among ``lines`` (a rank's log), in order."""
    return [Mark(int(m.group(1)), m.group(2), m.group(3))
            for m in (_MARK.search(l) for l in lines) if m]


def is_dump(line: str) -> bool:
    """A line of a rank's stack dump (its marker included), which a rank's "last words" skip."""
    text = re.sub(r"^\[(?:rank|default)\d+\]:\s*", "", line)
    return text.startswith(MARK) or text.startswith(DUMP)


# faulthandler's dump of a rank that died of a fatal signal (gloo aborts on a receive of the
# wrong size): '  File "/x/mine.py", line 15 in after_backward', innermost first, per thread
_FAULT_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+) in (\S+)')
_FAULT_THREAD = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+ ")


def faulthandler_position(lines: list[str]) -> str:
    """Where the rank stood by faulthandler's dump among ``lines``: the position of the first
    thread whose stack reaches code of a method (the user's or labkit's); empty if none."""
    threads: list[list[Frame]] = []
    for line in lines:
        text = re.sub(r"^\[(?:rank|default)\d+\]:", "", line)
        if _FAULT_THREAD.match(text.strip()):
            threads.append([])
        elif (m := _FAULT_FRAME.match(text)) and threads:
            threads[-1].insert(0, Frame(m.group(1), int(m.group(2)), m.group(3)))
    for frames in threads:
        if any(_kind(f) in ("user", "method") for f in frames):
            return position(frames)
    return ""


# ------------------------------------------------------------------ collectives that differ
# torch's ProcessGroupWrapper (TORCH_DISTRIBUTED_DEBUG=DETAIL): "Detected mismatch between
# collectives on ranks. Rank 1 is running collective: CollectiveFingerPrint(SequenceNumber=74,
# OpType=ALLREDUCE, TensorShape=[4903232], TensorDtypes=Float, ...), but Rank 0 is running ..."
_PRINT = re.compile(r"Rank (\d+) is running collective: CollectiveFingerPrint\(SequenceNumber=(\d+), "
                    r"OpType=(\w+)(?:, TensorShape=(\[[^\]]*\]))?(?:, TensorDtypes=(\w+))?")
# gloo without the wrapper: a receive of another size than the one posted, which aborts
_GLOO_SIZE = re.compile(r"op\.preamble\.length <= op\.nbytes\. (\d+) vs (\d+)")


def mismatch(text: str) -> Optional[str]:
    """One clause for a collective whose arguments differ between ranks, or None:

    - with the debug switch (``--debug-collectives``), from torch's fingerprints: "the ranks'
      collectives differ (collective #74): rank 1 calls allreduce of [4903232] float, rank 0
      allreduce of [4903242] float";
    - without it, gloo's aborted receive: "the ranks' collectives differ: a rank received 980652
      bytes where its collective expected 980648 (--debug-collectives names each rank's call)".
    """
    prints = _PRINT.findall(text)
    if "Detected mismatch between collectives" in text and prints:
        calls = []
        for rank, _, op, shape, dtype in prints[:2]:  # the two ranks the first message compares
            calls.append(f"rank {rank} calls {op.lower()}" + (f" of {shape} {dtype.lower()}".rstrip()
                                                             if shape else ""))
        return f"the ranks' collectives differ (collective #{prints[0][1]}): " + ", ".join(calls)
    m = _GLOO_SIZE.search(text)
    if m:
        return (f"the ranks' collectives differ: a rank received {m.group(1)} bytes where its "
                f"collective expected {m.group(2)} (--debug-collectives names each rank's call)")
    return None
