"""Why a torchrun launch failed, in one message: which rank failed first, how, and its last words.

The evidence, most direct first:

1. torchrun's error file of each failed rank (``<log dir>/<run id>/attempt_<k>/<local rank>/
   error.json``), written by the rank's ``record`` (labkit.training.lifecycle.run_rank): the
   exception and the second it was raised;
2. torchrun's failure summary on the console ("rank: N (local_rank: M) exitcode: ..."): the
   ranks killed by a signal, which write no error file, and local-to-global rank numbers;
3. the tail of each rank's log.

torchrun's own "root cause" is the earliest error file, often a rank that only failed because
its peer was gone; so a failure that reads like a lost peer or a timeout counts as a
consequence, and the first failure that is not one is blamed.
"""
from __future__ import annotations

import glob
import os
import re
import signal
from dataclasses import dataclass, field
from typing import Optional

from labkit.core import layout, stacks
from labkit.core.errors import RUN_FAILED_LINE
from labkit.core.run_folder import read_json

from .torchrun_output import failures as torchrun_failures
from .torchrun_output import rendezvous_failed

ERROR_FILE = "error.json"  # torchrun's name (TORCHELASTIC_ERROR_FILE)
# errors a rank gets because another rank is gone: not the cause. "Monitored Barrier": the
# fingerprint check of a collective (TORCH_DISTRIBUTED_DEBUG=DETAIL) that found its peer gone,
# at times with gloo's reason empty
_SECONDARY = re.compile(r"closed by peer|reset by peer|remote worker|Broken pipe|timed out|Timeout|"
                        r"monitored ?barrier|NCCL communicator was aborted", re.I)


def is_consequence(text: str) -> bool:
    """Whether a rank's error only says it lost its peers, timed out waiting for them, or was
    stopped by torchrun: not why the run failed. A rank that stalled in its own code (its
    watchdog's line, which names --timeout) is a cause."""
    if stacks.STALLED in text:
        return False
    return bool(_SECONDARY.search(text)) or text.startswith("stopped by SIGTERM")


_OWN_ERROR = re.compile(r"labkit\.(train|bench): error:")  # the one line a rank prints on failure
_TIMEOUT = stacks.TIMED_OUT


@dataclass
class Failure:
    """One failed rank, with what is known of it."""
    rank: int                      # global rank (the local one where the console lost it)
    local_rank: int
    exitcode: Optional[int]        # None: known from its error file only
    error: Optional[str] = None    # "RuntimeError: ..." from torchrun's error file
    error_file: Optional[str] = None
    raised_at: float = float("inf")  # when, from the error file (seconds since the epoch)
    lines: list[str] = field(default_factory=list)  # the last lines of its log
    where: str = ""                # where it stood in the method's code (labkit.core.stacks)
    mismatch: Optional[str] = None  # its collective differed from another rank's


@dataclass
class Explanation:
    message: str
    rank: Optional[int] = None     # the rank blamed, if any
    lines: list[str] = field(default_factory=list)
    error_file: Optional[str] = None  # the torchrun error file the message rests on
    lost_peers: bool = False       # this node's ranks only lost their peers or timed out waiting


# ------------------------------------------------------------------ reading the evidence
def rank_logs(log_dir: str, local_rank: int) -> list[str]:
    """torchrun's per-rank log files (newest attempt last)."""
    pat = os.path.join(log_dir, "**", "attempt_*", str(local_rank), "*.log")
    return sorted(glob.glob(pat, recursive=True), key=os.path.getmtime)


def read_lines(path: str) -> list[str]:
    """A log's non-blank lines ([] if it cannot be read)."""
    try:
        with open(path, errors="replace") as f:
            text = f.read().replace("\r", "\n")
    except OSError:
        return []
    return [l for l in text.splitlines() if l.strip()]


def tail(path: str, n: int = 15) -> list[str]:
    """A log's last ``n`` lines, the rank's stack dump (labkit.core.stacks) left out."""
    return [l for l in read_lines(path) if not stacks.is_dump(l)][-n:]


def rank_error_lines(log_dir: str, local_rank: int) -> list[str]:
    """The last lines of a rank's log (stderr first, newest attempt first); labkit's own one-line
    error alone where the rank printed one."""
    lines: list[str] = []
    logs = rank_logs(log_dir, local_rank)[::-1]
    for p in [p for p in logs if p.endswith(layout.RANK_STDERR)] + logs:
        lines = tail(p)
        if lines:
            break
    own = [l for l in lines if _OWN_ERROR.search(l)]
    return own[-1:] if own else lines


def read_error_files(log_dir: str) -> dict[int, tuple[str, str, float]]:
    """{local rank: (error file, "Type: message", when)} of the newest attempt that has any.
    An empty or half-written file (a full disk) is skipped: the other evidence decides."""
    found: dict[int, tuple[str, str, float]] = {}
    paths = glob.glob(os.path.join(log_dir, "**", "attempt_*", "*", ERROR_FILE), recursive=True)
    for path in sorted(paths, key=os.path.getmtime):
        try:
            msg = read_json(path)["message"]
            text = msg["message"] if isinstance(msg, dict) else str(msg)
            when = float((msg.get("extraInfo") or {}).get("timestamp") or "inf")
            local = int(os.path.basename(os.path.dirname(path)))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
        found[local] = (path, text.strip().splitlines()[0] if text.strip() else text, when)
    return found


def collect(output: str, log_dir: str) -> list[Failure]:
    """Every failed rank this node saw: from the console's summary and the error files."""
    seen: dict[int, Failure] = {}
    for rank, local, code in torchrun_failures(output):
        seen.setdefault(local, Failure(rank, local, code))
    for local, (path, text, when) in read_error_files(log_dir).items():
        f = seen.setdefault(local, Failure(local, local, None))
        f.error, f.error_file, f.raised_at = text, path, when
    for f in seen.values():
        f.lines = rank_error_lines(log_dir, f.local_rank)
        _where(f, log_dir)
    return sorted(seen.values(), key=lambda f: f.rank)


def _where(f: Failure, log_dir: str) -> None:
    """Where ``f``'s rank stood (its own marker line, else faulthandler's dump of a rank that
    died of a signal) and whether its collective differed from another rank's."""
    every = [l for p in rank_logs(log_dir, f.local_rank) for l in read_lines(p)]
    marks = stacks.read_marks(every)
    # where it raised, over a later mark made while it was ending (torchrun's SIGTERM in its
    # exit functions, once another rank had failed too)
    raised = [m for m in marks if m.how.startswith("raised")]
    f.where = (raised or marks)[-1].where if marks else stacks.faulthandler_position(every)
    text = "\n".join([f.error or ""] + [l for l in every if not stacks.is_dump(l)])
    f.mismatch = stacks.mismatch(text)


# ------------------------------------------------------------------ deciding
def evidence(f: Failure) -> int:
    """How surely this failure is the cause: 0 a crash with its own error, 1 killed by a
    signal (no chance to say anything), 2 no message, 3 a consequence of another failure.

    The rank's own words decide before its exit code: a rank that raised its own error can
    still be recorded as SIGTERM when torchrun stops it while its interpreter exits."""
    said = ([f.error] if f.error else []) + f.lines
    if any(_SECONDARY.search(l) for l in said):
        return 3
    if f.error or any(_OWN_ERROR.search(l) for l in f.lines):
        return 0
    if f.exitcode == -signal.SIGTERM:
        return 3
    if f.exitcode is not None and f.exitcode < 0:
        return 1
    return 0 if f.lines else 2


def explain_failure(method: str, returncode: int, output: str, log_dir: str,
                    multi_node: bool = False, oom: Optional[bool] = None) -> Explanation:
    """One message naming the rank that failed first (never one that only lost its peers);
    with several nodes, ``output`` and ``log_dir`` cover this node's ranks only. ``oom``: whether
    the kernel's out-of-memory killer killed a process meanwhile (None: not known here)."""
    gone = re.search(r"labkit: error: (the warm process .*)", output)  # labkit.launch.agent
    if gone:  # every rank stopped with the process they were forked from: nothing else to blame
        return Explanation(f"{method} failed: {gone.group(1)}", None, [gone.group(1)])
    failures = collect(output, log_dir)
    differ = _differ(method, failures, log_dir)
    if differ is not None:
        return differ
    said = _run_failed(failures, log_dir)
    if said is not None:
        return said
    if not failures:
        return _no_failed_rank(method, returncode, output, multi_node)
    ranked = sorted(failures, key=lambda f: (evidence(f), f.raised_at, f.rank))
    if evidence(ranked[0]) < 3:
        return _blame(method, ranked[0], log_dir, oom)
    # nobody crashed: ranks timed out waiting in a collective for a rank that hung
    timed_out = [f for f in failures if any(_TIMEOUT.search(l) for l in [f.error or ""] + f.lines)]
    hung = sorted(f.rank for f in failures if f not in timed_out) if timed_out else []
    if hung:
        who = timed_out[0]
        return Explanation(
            f"{method} failed: rank {', '.join(map(str, hung))} hung: the other ranks timed out "
            f"waiting for it in a collective (--timeout){_positions(failures, log_dir)}; "
            f"rank {who.rank} said:\n" + quote(who.lines), hung[0], who.lines, who.error_file)
    if multi_node:
        f = failures[0]
        ranks = ", ".join(str(x.rank) for x in failures)
        return Explanation(
            f"{method} failed on another node: rank {ranks} on this node only lost its peers "
            f"(or timed out waiting for them); the rank that failed first runs on another node: "
            f"see that node's labkit output and logs. Rank {f.rank} said:\n" + quote(f.lines),
            None, f.lines, f.error_file, lost_peers=True)
    return _blame(method, failures[0], log_dir, oom)


def _run_failed(failures: list[Failure], log_dir: str) -> Optional[Explanation]:
    """A run that failed without crashing (labkit.core.errors.RunFailed: a diverged loss,
    replicas that differ), or a rank that names its own failure (Exhausted, a method of one's
    own that raised): that one line says it all, and alone. A line that only says a rank lost
    its peer or timed out waiting is a consequence: never chosen (the rest of
    explain_failure then finds the cause)."""
    ordered = sorted(failures, key=lambda f: (f.raised_at, f.rank))
    for line in [l for f in ordered for l in f.lines] + rank_error_lines(log_dir, 0):
        m = RUN_FAILED_LINE.search(line)
        if m and not _raised_as_consequence(m.group(1)):
            said = re.search(r" failed: rank (\d+):? ", m.group(1))
            # a stalled rank: where the others stood too (each dumped its stack when stopped)
            more = _positions(failures, log_dir) if stacks.STALLED in m.group(1) else ""
            return Explanation(m.group(1) + more, int(said.group(1)) if said else 0, [m.group(1)])
    return None


# a rank's own line that wraps an exception (a method of one's own that raised, a crash):
# "<key> failed: rank 0: RuntimeError: <message> at mine.py:14 (...)"
_RAISED = re.compile(r" failed: rank \d+: [\w.]+: (.*)")


def _raised_as_consequence(line: str) -> bool:
    """Whether a rank's one line only wraps a consequence (its peer closed, a collective timed
    out waiting for another rank). Lines in labkit's own words (a full disk, a stalled loader
    that names --loader-timeout) are causes whatever words they use."""
    m = _RAISED.search(line)
    return bool(m) and is_consequence(m.group(1))


def _differ(method: str, failures: list[Failure], log_dir: str) -> Optional[Explanation]:
    """Ranks whose collectives differ (sizes, or calls): named as such, not as a crash or a
    hang (labkit.core.stacks.mismatch reads torch's and gloo's words for it)."""
    found = [f for f in failures if f.mismatch]
    if not found:
        return None
    # torch's fingerprints (the debug switch) name every rank's call: prefer them to gloo's
    f = min(found, key=lambda f: ("calls" not in (f.mismatch or ""), f.raised_at, f.rank))
    at = f" at {f.where}" if f.where else ""
    logs = rank_logs(log_dir, f.local_rank)
    where = f" (logs: {os.path.dirname(os.path.dirname(logs[-1]))})" if logs else ""
    return Explanation(f"{method} failed: {f.mismatch}; rank {f.rank} stopped{at}{where}",
                       f.rank, f.lines, f.error_file)


def _positions(failures: list[Failure], log_dir: str) -> str:
    """"; where each rank stood: rank 0 at mine.py:14 (after_backward) in all_reduce; rank 1
    at ... (stacks in <logs>)", from the ranks' marker lines; empty when none said."""
    said = [f"rank {f.rank} at {f.where}" for f in failures if f.where]
    if not said:
        return ""
    logs = rank_logs(log_dir, failures[0].local_rank)
    at = f" (stacks in {os.path.dirname(os.path.dirname(logs[-1]))})" if logs else ""
    return "; where each rank stood: " + "; ".join(said) + at


def _blame(method: str, f: Failure, log_dir: str, oom: Optional[bool] = None) -> Explanation:
    code, sig = f.exitcode, ""
    if code is not None and code < 0:
        try:
            sig = f" ({signal.Signals(-code).name})"
        except ValueError:
            pass
    logs = rank_logs(log_dir, f.local_rank)
    where = f" (logs: {os.path.dirname(logs[-1])})" if logs else ""
    if code == -signal.SIGTERM:
        how = f"failed first (torchrun then stopped it: exit code {code}{sig})"
    elif code is None:
        how = "raised an exception (known from its error file only)"
    else:
        how = f"exited with code {code}{sig}"
    if code == -signal.SIGKILL:  # it said nothing; its log's last lines are not why
        return Explanation(f"{method} failed: rank {f.rank} {how}: {killed(oom)}{where}", f.rank,
                           f.lines, f.error_file)
    if f.where:
        how += f" at {f.where}"
    lines = f.lines if f.lines else ([f.error] if f.error else [])
    if f.error and not any(f.error.split(":")[0] in l for l in lines):
        lines = lines + [f.error]  # the exception, from torchrun's error file
    return Explanation(f"{method} failed: rank {f.rank} {how}{where}\n" + quote(lines),
                       f.rank, lines, f.error_file)


def killed(oom: Optional[bool]) -> str:
    """Why a rank died of SIGKILL, as far as the kernel's count of out-of-memory kills tells
    (``oom``: one was counted while the run ran; None: the count cannot be read here)."""
    from labkit.core.resources import free_memory, size

    if oom is False:
        return ("killed from outside (a person or a program sent it SIGKILL): no out-of-memory "
                "kill counted by the kernel")
    now = free_memory()
    left = f"; {size(now)} available now" if now is not None else ""
    if oom:
        who = ("the kernel's out-of-memory killer killed it (the kernel counted an out-of-memory "
               "kill meanwhile): host memory ran out")
    else:
        who = ("killed from outside: by a person or a program, or by the kernel's out-of-memory "
               "killer if host memory ran out (its count cannot be read here; dmesg names its "
               "victims)")
    return f"{who}{left}; {'' if oom else 'if memory: '}lower --nproc, --batch-size or --workers"


def _no_failed_rank(method: str, returncode: int, output: str, multi_node: bool) -> Explanation:
    last = [l for l in output.replace("\r", "\n").splitlines() if l.strip()][-10:]
    why = ""
    if multi_node and rendezvous_failed(output):
        why = (" (the rendezvous failed: is --rdzv-endpoint reachable from this node, and did "
               "every node start within torchrun's join timeout, 600 s?)")
    return Explanation(f"{method} failed: torchrun exited with code {returncode}{why}\n"
                       + "\n".join(last), None, last)


def quote(lines: list[str]) -> str:
    """A rank's lines as a message quotes them, under its first line."""
    return "\n".join("  | " + l for l in lines)
