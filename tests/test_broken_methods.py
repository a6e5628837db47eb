"""A user's method gone wrong (issue 60): deliberately broken methods written to a temporary
folder, run through `labkit check`, `labkit run` and `labkit experiment` as a person writing
their first method would. Each must end in bounded time, with one line that names the rank
whose failure was not a consequence of another's, its own words and its place in the user's
file; a hang says where every rank stood; collectives that differ are named as such; nothing
is left running.

The exact methods go through the exactness check (which `labkit run` and `labkit experiment`
run first, with the debug switch on); the approximate copies (``exact = False``) skip it, so
`labkit run` reaches the real launch with the debug switch off."""
from __future__ import annotations

import re
import textwrap
import time
from pathlib import Path

import pytest

from helpers import labkit, leftovers, load_json, tiny_flags
from labkit.core import stacks

HANG = '''
import threading
from labkit.training.sync import Strategy, broadcast_parameters


class Hang(Strategy):
    exact = EXACT

    def setup(self, model):
        broadcast_parameters(model)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.calls = 0
        return model

    def after_backward(self):
        self.calls += 1
        if self.ctx.rank == 1 and self.calls >= 2:
            threading.Event().wait()  # HANG_LINE: rank 1 stops calling collectives
        with self.timer("comm"):
            for p in self.params:
                self.all_reduce(p.grad)  # ALLREDUCE_LINE
                p.grad.div_(self.ctx.world_size)
'''

SETUP_RAISES = '''
from labkit.training.sync import Strategy, broadcast_parameters


class FailsOnRankOne(Strategy):
    exact = EXACT

    def setup(self, model):
        if self.ctx.rank == 1:
            raise RuntimeError("cannot build the buckets on rank 1")  # RAISE_LINE
        broadcast_parameters(model)
        return model
'''

SIZES_DIFFER = '''
import torch
from labkit.training.sync import Strategy, broadcast_parameters


class SizesDiffer(Strategy):
    exact = EXACT

    def setup(self, model):
        broadcast_parameters(model)
        self.params = [p for p in model.parameters() if p.requires_grad]
        return model

    def after_backward(self):
        with self.timer("comm"):
            flat = torch.cat([p.grad.reshape(-1) for p in self.params])
            if self.ctx.rank == 1:
                flat = flat[:-10]  # rank 1 all-reduces 10 elements fewer
            self.all_reduce(flat)  # ALLREDUCE_LINE
'''

KILLED = '''
import os
import signal
from labkit.training.sync import Strategy, broadcast_parameters


class Killed(Strategy):
    exact = False

    def setup(self, model):
        broadcast_parameters(model)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.calls = 0
        return model

    def after_backward(self):
        self.calls += 1
        if self.ctx.rank == 1 and self.calls == 2:
            os.kill(os.getpid(), signal.SIGKILL)  # as the kernel's out-of-memory killer would
        for p in self.params:
            self.all_reduce(p.grad)
            p.grad.div_(self.ctx.world_size)
'''

STALLS = '''
import time
from labkit.training.sync import Strategy, broadcast_parameters


class Stalls(Strategy):
    exact = False

    def setup(self, model):
        broadcast_parameters(model)
        return model

    def after_backward(self):
        while True:  # every rank waits in its own code: no collective can time out
            time.sleep(0.5)  # SLEEP_LINE
'''

TIMEOUT = 8  # --timeout of every run here (s): a hang ends after about this long
BOUND = 90   # what a run that hangs may take in all: torchrun's start, the timeout, the stop
RUN = tiny_flags(epochs=1, max_steps_per_epoch=3, max_val_steps=1)


def write(folder: Path, source: str, exact: bool) -> tuple[Path, dict[str, int]]:
    """The method's file, and the line numbers of its marked lines."""
    text = textwrap.dedent(source).replace("EXACT", str(exact))
    path = folder / "mine.py"
    path.write_text(text)
    lines = {m: i for i, l in enumerate(text.splitlines(), 1)
             for m in re.findall(r"# (\w+_LINE)", l)}
    return path, lines


def run_labkit(tmp_path: Path, *args) -> tuple[int, str, float]:
    """(exit code, what it printed, seconds) of a labkit command run from ``tmp_path``, its
    temporary files there too (the check's folder), with nothing of it left running after."""
    t0 = time.monotonic()
    p = labkit(args, cwd=tmp_path, env={"TMPDIR": str(tmp_path)}, timeout=300)
    took = time.monotonic() - t0
    assert not leftovers(str(tmp_path)), "processes left running"
    return p.returncode, p.stdout + p.stderr, took


def error_line(out: str) -> str:
    lines = [l for l in out.splitlines() if re.match(r"labkit( \w+)?: (error: )?\S+ (failed|could not)", l)
             or l.startswith("labkit check: ") and "could not be checked" in l]
    assert lines, out[-3000:]
    return lines[-1]


# ------------------------------------------------------------------ labkit check
def test_check_of_a_hang_names_where_each_rank_stood(tmp_path):
    path, at = write(tmp_path, HANG, exact=True)
    code, out, took = run_labkit(tmp_path, "check", f"{path}:Hang", "--timeout", TIMEOUT)
    assert code == 1, out
    first = out.splitlines()[0]
    assert first.startswith("labkit check: checking that hang is exact") and f"{TIMEOUT} s" in first
    line = error_line(out)
    assert "rank 1 hung" in line, line
    assert f"rank 0 at {path}:{at['ALLREDUCE_LINE']} (after_backward) in all_reduce" in line, line
    assert f"rank 1 at {path}:{at['HANG_LINE']} (after_backward), waiting in threading." in line, line
    logs = re.search(r"\(stacks in (\S+)\)", line).group(1)
    assert list(Path(logs).glob("*/stderr.log")), f"no rank logs in {logs}"
    assert took < BOUND, took


def test_check_names_the_rank_whose_setup_raised(tmp_path):
    path, at = write(tmp_path, SETUP_RAISES, exact=True)
    code, out, _ = run_labkit(tmp_path, "check", f"{path}:FailsOnRankOne")
    assert code == 1, out
    line = error_line(out)
    assert (f"rank 1: RuntimeError: cannot build the buckets on rank 1 at {path}:{at['RAISE_LINE']}"
            in line), line
    assert "Connection closed" not in line and "rank 0" not in line, line


def test_check_names_collectives_that_differ(tmp_path):
    path, at = write(tmp_path, SIZES_DIFFER, exact=True)
    code, out, took = run_labkit(tmp_path, "check", f"{path}:SizesDiffer", "--timeout", TIMEOUT)
    assert code == 1, out
    line = error_line(out)
    m = re.search(r"the ranks' collectives differ \(collective #\d+\): rank (\d) calls allreduce "
                  r"of \[(\d+)\] float, rank (\d) calls allreduce of \[(\d+)\] float", line)
    assert m, line
    sizes = {m.group(1): int(m.group(2)), m.group(3): int(m.group(4))}
    assert sizes["0"] - sizes["1"] == 10, sizes
    assert f"{path}:{at['ALLREDUCE_LINE']} (after_backward)" in line, line
    assert took < BOUND, took


# ------------------------------------------------------------------ labkit run
def test_run_of_a_hang_ends_within_its_timeout(tmp_path):
    """Without the check (an approximate method) and without the debug switch: gloo's own
    timeout, the stopped rank's stack dump."""
    path, at = write(tmp_path, HANG, exact=False)
    code, out, took = run_labkit(tmp_path, "run", f"{path}:Hang", "--nproc", 2, *RUN,
                                 "--timeout", TIMEOUT, "--runs-dir", tmp_path / "runs")
    assert code == 1, out
    line = error_line(out)
    assert "rank 1 hung" in line and "timed out" in line, line
    assert f"rank 1 at {path}:{at['HANG_LINE']} (after_backward), waiting in threading." in line, line
    assert f"rank 0 at {path}:{at['ALLREDUCE_LINE']} (after_backward) in all_reduce" in line, line
    assert "labkit.stack" not in out, "the stack dumps stay in the logs"
    assert took < BOUND, took


def test_run_names_collectives_that_differ_without_the_debug_switch(tmp_path):
    path, at = write(tmp_path, SIZES_DIFFER, exact=False)
    code, out, took = run_labkit(tmp_path, "run", f"{path}:SizesDiffer", "--nproc", 2, *RUN,
                                 "--timeout", TIMEOUT, "--runs-dir", tmp_path / "runs")
    assert code == 1, out
    line = error_line(out)
    assert "the ranks' collectives differ" in line and "--debug-collectives" in line, line
    assert f"{path}:{at['ALLREDUCE_LINE']} (after_backward)" in line, line
    assert took < BOUND, took


def test_run_with_the_debug_switch_names_each_ranks_call(tmp_path):
    path, _ = write(tmp_path, SIZES_DIFFER, exact=False)
    code, out, _ = run_labkit(tmp_path, "run", f"{path}:SizesDiffer", "--nproc", 2, *RUN,
                              "--timeout", TIMEOUT, "--debug-collectives",
                              "--runs-dir", tmp_path / "runs")
    assert code == 1, out
    line = error_line(out)
    assert re.search(r"rank \d calls allreduce of \[\d+\] float, rank \d calls allreduce", line), line


def test_run_of_an_exact_method_whose_setup_raises_stops_at_the_check(tmp_path):
    path, at = write(tmp_path, SETUP_RAISES, exact=True)
    code, out, _ = run_labkit(tmp_path, "run", f"{path}:FailsOnRankOne", "--nproc", 2, *RUN,
                              "--runs-dir", tmp_path / "runs")
    assert code == 2, out
    line = error_line(out)
    assert f"rank 1: RuntimeError: cannot build the buckets on rank 1 at {path}:{at['RAISE_LINE']}" in line
    assert "checking that fails_on_rank_one is exact" in out
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").iterdir()), \
        "nothing measured after a failed check"


def test_a_sigkilled_rank_is_the_cause_not_the_ranks_that_lost_it(tmp_path):
    """A rank of a method of one's own killed mid-run: rank 0's "connection closed" in the
    user's code is a consequence, not the line."""
    path, _ = write(tmp_path, KILLED, exact=False)
    code, out, _ = run_labkit(tmp_path, "run", f"{path}:Killed", "--nproc", 2, *RUN,
                              "--timeout", TIMEOUT, "--runs-dir", tmp_path / "runs")
    assert code == 1, out
    line = error_line(out)
    assert "killed failed: rank 1 exited with code -9 (SIGKILL)" in line, line
    assert "Connection" not in line and "rank 0" not in line, line


def test_ranks_stuck_where_no_collective_waits_end_at_twice_the_timeout(tmp_path):
    path, at = write(tmp_path, STALLS, exact=False)
    code, out, took = run_labkit(tmp_path, "run", f"{path}:Stalls", "--nproc", 2, *RUN,
                                 "--timeout", 4, "--runs-dir", tmp_path / "runs")
    assert code == 1, out
    line = error_line(out)
    assert re.search(rf"stalls failed: rank (\d) made no progress for 8 s \(twice --timeout\) at "
                     rf"{re.escape(str(path))}:{at['SLEEP_LINE']} \(after_backward\)", line), line
    assert f"rank 1 at {path}:{at['SLEEP_LINE']}" in line or f"rank 0 at {path}:{at['SLEEP_LINE']}" in line, line
    result = next((tmp_path / "runs").glob("*/results_stalls.json"))
    doc = load_json(result)
    assert doc["status"] == "failed" and "made no progress" in doc["error"], doc.get("error")
    assert took < BOUND, took


# ------------------------------------------------------------------ labkit experiment
@pytest.mark.parametrize("source, cls, says", [
    (HANG, "Hang", [r"hang could not be checked", r"rank 1 hung",
                    r"rank 1 at {path}:{HANG_LINE} \(after_backward\)"]),
    (SETUP_RAISES, "FailsOnRankOne", [r"rank 1: RuntimeError: cannot build the buckets on rank 1 "
                                      r"at {path}:{RAISE_LINE}"]),
    (SIZES_DIFFER, "SizesDiffer", [r"the ranks' collectives differ \(collective #\d+\): rank \d "
                                   r"calls allreduce of \[\d+\] float",
                                   r"{path}:{ALLREDUCE_LINE} \(after_backward\)"]),
], ids=["hang", "setup-raises", "sizes-differ"])
def test_experiment_stops_at_the_check_naming_the_fault(tmp_path, source, cls, says):
    """labkit experiment checks a method of one's own before anything is measured: the check's
    line, bounded by the experiment's --timeout, and nothing else runs."""
    path, at = write(tmp_path, source, exact=True)
    code, out, took = run_labkit(tmp_path, "experiment", "--methods", f"ddp,{path}:{cls}",
                                 "--nproc", 2, *RUN, "--timeout", TIMEOUT,
                                 "--runs-dir", tmp_path / "runs")
    assert code == 2, out
    line = error_line(out)
    for pattern in says:
        assert re.search(pattern.format(path=re.escape(str(path)), **at), line), (pattern, line)
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").iterdir()), \
        "nothing measured after a failed check"
    assert took < BOUND, took


# ------------------------------------------------------------------ the words, in process
@pytest.mark.unit
def test_position_names_the_users_frame_what_it_called_and_where_it_waits(tmp_path):
    user, lab = str(tmp_path / "mine.py"), stacks._HERE + "/training/sync/collectives.py"
    lib = stacks._LIBS[0] + "/threading.py"
    trainer = stacks._HERE + "/training/trainer.py"
    frames = [stacks.Frame(trainer, 162, "Trainer.train_step"),
              stacks.Frame(user, 14, "Mine.after_backward"),
              stacks.Frame(lab, 144, "Collectives.all_reduce"),
              stacks.Frame(lab, 138, "Collectives._issue")]
    assert stacks.position(frames) == f"{user}:14 (after_backward) in all_reduce"
    waiting = frames[:2] + [stacks.Frame(lib, 629, "Event.wait"), stacks.Frame(lib, 327, "Condition.wait")]
    assert stacks.position(waiting) == f"{user}:14 (after_backward), waiting in threading.Condition.wait"
    assert stacks.position(waiting, waiting=False) == f"{user}:14 (after_backward)"
    # a built-in method: its module in labkit/training/sync is the code the line names
    builtin = [frames[0], stacks.Frame(stacks._HERE + "/training/sync/allreduce.py", 50,
                                       "ManualAllReduce.after_backward"), *frames[2:]]
    assert stacks.position(builtin).endswith("allreduce.py:50 (after_backward) in all_reduce")
    line = stacks.mark(1, "stopped by SIGTERM", stacks.position(waiting))
    assert stacks.read_marks(["[rank1]: " + line]) == [(1, "stopped by SIGTERM", stacks.position(waiting))]
    assert stacks.is_dump("[rank1]: " + line) and not stacks.is_dump("[rank1]: epoch 1/1")


@pytest.mark.unit
def test_faulthandlers_dump_gives_the_position_of_a_rank_killed_by_a_signal(tmp_path):
    user = str(tmp_path / "mine.py")
    dump = ["Fatal Python error: Aborted", "",
            "Thread 0x00007fc135cc86c0 (most recent call first):",
            f'  File "{stacks._LIBS[0]}/threading.py", line 82 in sigwait',
            "Thread 0x00007fc1369e7b80 (most recent call first):",
            f'  File "{stacks._HERE}/training/sync/collectives.py", line 138 in _issue',
            f'  File "{stacks._HERE}/training/sync/collectives.py", line 144 in all_reduce',
            f'  File "{user}", line 15 in after_backward',
            f'  File "{stacks._HERE}/training/trainer.py", line 162 in train_step']
    assert stacks.faulthandler_position(dump) == f"{user}:15 (after_backward) in all_reduce"
