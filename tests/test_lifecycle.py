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

from conftest import load_json
from labkit.core import status
from labkit.analysis import report

pytestmark = pytest.mark.xdist_group("lifecycle")

# 16 steps an epoch: epoch 2 is still running seconds after epoch 1 is written (measured on
# 2 CPU cores: 0.48 s a step with 3 ranks, 0.32 s with 2, so epoch 2 lasts 5-8 s), while the
# tests act on it within a poll of 0.2 s. (40 steps cost both tests 19 s more, waiting for epoch 1.)
ARGS = ["--method", "allreduce", "--dataset", "digits", "--model", "resnet10_small", "--batch-size", "8",
        "--epochs", "4", "--max-steps-per-epoch", "16", "--max-val-steps", "1", "--lr", "0.01",
        "--no-progress", "--timeout", "120"]


def start_torchrun(tmp_path, nproc: int):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "labkit.train", *ARGS, "--out", str(out)]
    log = open(tmp_path / "torchrun.log", "w")
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    return proc, out / "results_all_reduce.json", tmp_path / "torchrun.log"


def wait_for_epoch_1(proc, result, log):
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if len(load_json(result)["epochs"]) >= 1:
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    pytest.fail(f"epoch 1 never finished:\n{log.read_text()[-3000:]}")


def rank_pid(proc, rank: int) -> int:
    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank) and "labkit.train" in child.cmdline():
                return child.pid
        except psutil.NoSuchProcess:
            pass
    raise AssertionError(f"no rank {rank} among torchrun's children")


def leftovers(proc_pid: int, marker: str) -> list[str]:
    p = subprocess.run(["pgrep", "-af", marker], capture_output=True, text=True)
    return [l for l in p.stdout.splitlines() if "pgrep" not in l]


def finish(proc, timeout: float) -> int:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise


def test_bare_torchrun_rank_killed_in_epoch_2(tmp_path):
    proc, result, log = start_torchrun(tmp_path, 3)
    wait_for_epoch_1(proc, result, log)
    os.kill(rank_pid(proc, 1), signal.SIGKILL)
    t0 = time.monotonic()
    code = finish(proc, 90)
    assert code != 0 and time.monotonic() - t0 < 90
    time.sleep(1)
    assert not leftovers(proc.pid, str(result.parent)), log.read_text()[-3000:]
    doc = load_json(result)
    assert doc["status"] == "failed", doc.get("status")
    assert [e["epoch"] for e in doc["epochs"]] == [1]  # the finished epoch is kept
    assert doc["end_time"] and doc["error"]
    # and what a user reads: labkit report names the run as failed, not as still going
    rep = subprocess.run([sys.executable, "-m", "labkit", "report", str(result), "--out",
                          str(tmp_path / "report")], capture_output=True, text=True, timeout=120)
    assert "status failed" in rep.stdout + rep.stderr and "status running" not in rep.stdout + rep.stderr


def test_sigterm_reaches_rank_0_blocked_in_a_collective(tmp_path):
    """Rank 1 stopped (SIGSTOP): rank 0 blocks in the all-reduce, where a Python signal handler
    could not run. SIGTERM (what torchrun sends) still marks the file, and rank 0 dies of it."""
    proc, result, log = start_torchrun(tmp_path, 2)
    wait_for_epoch_1(proc, result, log)
    r0, r1 = rank_pid(proc, 0), rank_pid(proc, 1)
    os.kill(r1, signal.SIGSTOP)
    try:
        time.sleep(3)  # rank 0 reaches the next all-reduce and waits there for rank 1
        assert load_json(result)["status"] == "running"
        os.kill(r0, signal.SIGTERM)
        deadline = time.monotonic() + 15
        while psutil.pid_exists(r0) and psutil.Process(r0).status() != psutil.STATUS_ZOMBIE \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        assert time.monotonic() < deadline, "rank 0 did not die of SIGTERM"
    finally:
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
    assert doc["status"] == "stopped" and "stopped without finishing" in doc["error"]
    assert json.loads(open(path).read())["status"] == "running"  # readers never modify the file
    rep = subprocess.run([sys.executable, "-m", "labkit", "report", path, "--out", str(tmp_path / "r")],
                         capture_output=True, text=True, timeout=120)
    assert "stopped without finishing" in rep.stdout, rep.stdout + rep.stderr


def test_running_file_whose_writer_lives_reads_as_running(tmp_path):
    assert report.load_result(running_doc(tmp_path))["status"] == "running"  # this process


def test_other_host_by_heartbeat_age(tmp_path):
    now = time.time()
    fresh = running_doc(tmp_path, host="elsewhere", unix_time=now - 60)
    assert report.load_result(fresh)["status"] == "running"
    old = running_doc(tmp_path, host="elsewhere", unix_time=now - 2 * status.STALE_S)
    assert "no heartbeat for" in report.load_result(old)["error"]


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
