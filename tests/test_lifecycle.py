"""A run stopped from outside on the bare torchrun path (the guide's own commands): the result
file must not say "running" once its ranks are gone (labkit.training.lifecycle)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from helpers import ONE_THREAD, Pause, labkit, leftovers, load_json, tiny_flags, wait_for
from labkit.core import status
from labkit import report

pytestmark = pytest.mark.xdist_group("lifecycle")

# The tests act on epoch 2 at a moment the pause hook holds (tests/helpers.Pause): a rank waits
# before epoch 2's second step until the test is done with it, however fast or loaded the machine.
ARGS = ["--method", "allreduce",
        *tiny_flags(epochs=3, max_steps_per_epoch=4, max_val_steps=1, pin_cpus=None)]


def start_torchrun(tmp_path, nproc: int, env: dict):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "labkit.train", *ARGS, "--out", str(out)]
    log = open(tmp_path / "torchrun.log", "w")
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, **ONE_THREAD, **env}, start_new_session=True)
    return proc, out / "results_all_reduce.json", tmp_path / "torchrun.log"


def held_in_epoch_2(tmp_path, nproc: int, rank: int):
    """torchrun started, ``rank`` held before epoch 2's second step (epoch 1 written): (torchrun,
    result file, log, the pause)."""
    pause = Pause(tmp_path, "allreduce", rank=rank, epoch=2, step=1)
    proc, result, log = start_torchrun(tmp_path, nproc, pause.env)
    try:
        pause.wait(240, proc)
    except AssertionError:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"never held in epoch 2:\n{log.read_text()[-3000:]}")
    assert [e["epoch"] for e in load_json(result)["epochs"]] == [1]
    return proc, result, log, pause


def rank_pid(proc, rank: int) -> int:
    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank) and "labkit.train" in child.cmdline():
                return child.pid
        except psutil.NoSuchProcess:
            pass
    raise AssertionError(f"no rank {rank} among torchrun's children")


def finish(proc, timeout: float) -> int:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise


def test_bare_torchrun_rank_killed_in_epoch_2(tmp_path):
    proc, result, log, pause = held_in_epoch_2(tmp_path, 3, rank=0)
    os.kill(rank_pid(proc, 1), signal.SIGKILL)
    pause.release()
    t0 = time.monotonic()
    code = finish(proc, 90)
    assert code != 0 and time.monotonic() - t0 < 90
    assert not leftovers(str(result.parent)), log.read_text()[-3000:]
    doc = load_json(result)
    assert doc["status"] == "failed", doc.get("status")
    assert [e["epoch"] for e in doc["epochs"]] == [1]  # the finished epoch is kept
    assert doc["end_time"] and doc["error"]
    # and what a user reads: labkit report names the run as failed, not as still going
    rep = labkit(["report", str(result), "--out", str(tmp_path / "report")], tmp_path, timeout=120)
    assert "status failed" in rep.stdout + rep.stderr and "status running" not in rep.stdout + rep.stderr


def cpu_seconds(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def test_sigterm_reaches_rank_0_blocked_in_a_collective(tmp_path):
    """Rank 1 stopped (SIGSTOP): rank 0 blocks in the all-reduce, where a Python signal handler
    could not run. SIGTERM (what torchrun sends) still marks the file, and rank 0 dies of it."""
    proc, result, log, pause = held_in_epoch_2(tmp_path, 2, rank=1)
    r0, r1 = rank_pid(proc, 0), rank_pid(proc, 1)
    os.kill(r1, signal.SIGSTOP)
    try:
        # rank 0 goes on into step 2's all-reduce and waits there for rank 1: blocked once it
        # has been asleep, using no CPU, for a second (its backward computes, or waits for a
        # core on a loaded machine, runnable; gloo's wait sleeps)
        last = [cpu_seconds(r0), time.monotonic()]

        def blocked() -> bool:
            now = cpu_seconds(r0)
            if now - last[0] > 0.05 or psutil.Process(r0).status() != psutil.STATUS_SLEEPING:
                last[:] = [now, time.monotonic()]
            return time.monotonic() - last[1] >= 1.0
        wait_for(blocked, 120, "rank 0 to block in the all-reduce", 0.1)
        assert load_json(result)["status"] == "running"
        os.kill(r0, signal.SIGTERM)
        deadline = time.monotonic() + 15
        while psutil.pid_exists(r0) and psutil.Process(r0).status() != psutil.STATUS_ZOMBIE \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        assert time.monotonic() < deadline, "rank 0 did not die of SIGTERM"
    finally:
        pause.release()
        os.kill(r1, signal.SIGCONT)
    finish(proc, 90)
    assert "exitcode  : -15" in log.read_text()  # torchrun saw SIGTERM, as before
    doc = load_json(result)
    assert doc["status"] == "failed" and "SIGTERM" in doc["error"]
    assert [e["epoch"] for e in doc["epochs"]] == [1]


# ------------------------------------------------------------------ the heartbeat, reader side
def running_doc(tmp_path, **heartbeat) -> str:
    doc = {"method": "Manual All-Reduce", "method_key": "allreduce", "status": "running",
           "epochs": [], "all_losses": [], "heartbeat": {**status.stamp(), **heartbeat}}
    path = tmp_path / "results_all_reduce.json"
    path.write_text(json.dumps(doc))
    return str(path)


def test_running_file_whose_writer_is_gone_reads_as_stopped(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    path = running_doc(tmp_path, pid=dead.pid)
    doc = report.load_result(path)
    assert doc.status == "stopped" and "stopped without finishing" in doc.error
    assert json.loads(open(path).read())["status"] == "running"  # readers never modify the file
    rep = subprocess.run([sys.executable, "-m", "labkit", "report", path, "--out", str(tmp_path / "r")],
                         capture_output=True, text=True, timeout=120)
    assert "stopped without finishing" in rep.stdout, rep.stdout + rep.stderr


def test_running_file_whose_writer_lives_reads_as_running(tmp_path):
    assert report.load_result(running_doc(tmp_path)).status == "running"  # this process


def test_other_host_by_heartbeat_age(tmp_path):
    now = time.time()
    fresh = running_doc(tmp_path, host="elsewhere", unix_time=now - 60)
    assert report.load_result(fresh).status == "running"
    old = running_doc(tmp_path, host="elsewhere", unix_time=now - 2 * status.STALE_S)
    assert "no heartbeat for" in report.load_result(old).error


@pytest.mark.parametrize("children,exit_code", [("none", 0), ("server", 0), ("worker", 0),
                                                ("none", 3)])
def test_leave_keeps_the_exit_code_and_skips_teardown_only_without_loader_workers(
        children, exit_code, tmp_path):
    """lifecycle.leave ends a finished rank with os._exit (no interpreter teardown: ~1 s of CPU
    per rank) after flushing what it printed; a rank with a live loader worker (a child of its
    fork server: a grandchild) exits the ordinary way, so its atexit teardown still runs and
    shuts it down. A child alone (the fork server, the resource tracker) dies with the rank."""
    # children that die with their parent, as the fork server does (labkit.core.procs), and
    # keep none of its output open; a "worker" is the child of such a child
    sleeper = tmp_path / "sleeper.py"
    sleeper.write_text("import signal, subprocess, sys, time\n"
                       "from labkit.core.procs import die_with_parent\n"
                       "die_with_parent(signal.SIGKILL)\n"
                       "if sys.argv[1:] == ['server']:\n"
                       "    subprocess.Popen([sys.executable, __file__, 'worker'])\n"
                       "else:\n"
                       "    open(__file__ + '.ready', 'w').close()\n"
                       "time.sleep(60)\n")
    run = f"subprocess.Popen([sys.executable, {str(sleeper)!r}, {children!r}], " \
          "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)"
    start = {"none": "None", "server": run.replace("'server'", "'alone'"),
             "worker": run.replace("'worker'", "'server'")}[children]
    code = ("import atexit, os, subprocess, sys, time, psutil\n"
            "from labkit.training import lifecycle\n"
            "atexit.register(lambda: print('teardown ran'))\n"
            f"child = {start}\n"
            f"while child and not os.path.exists({str(sleeper) + '.ready'!r}):\n"
            "    time.sleep(0.05)  # the last one started has asked to die with its parent\n"
            "sys.stdout.write('done\\n')  # buffered: leave must flush it\n"
            "try:\n"
            f"    lifecycle.leave({exit_code})\n"
            "finally:\n"
            "    for c in psutil.Process().children(recursive=True):\n"
            "        c.kill()\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == exit_code, p.stderr
    # a failed rank (code != 0) also exits the ordinary way
    fast = exit_code == 0 and children != "worker"
    assert p.stdout.splitlines() == (["done"] if fast else ["done", "teardown ran"]), p.stdout
