"""SIGTERM (what scancel, a job's time limit and kill send) to a running `labkit experiment` ends
it as Ctrl-C does (issue 83, item 4): one line and exit code 130, no traceback, nothing left
running, experiment.json "interrupted", and `labkit experiment --continue RUN` completes it.
Sent at several moments of the run, each reached with the pause hook or a file the run writes
(not a sleep): while a rank starts, while it trains (twice, the second during the first's
cleanup; and to every process of the experiment, as scancel does), as the method's notebook
ends, while the report notebook runs.

What went wrong before, each made to happen here in seconds: the KeyboardInterrupt SIGTERM
raises landed in a weakref callback (asyncio's WeakSet of tasks, all the time while a notebook
runs), where Python prints "Exception ignored" with the traceback and drops it, and the
experiment ran on to its end (once in two tries); one that passed through an exec() of source
text made `python -m labkit` die of SIGINT after its line (-2, not 130); a SIGTERM during the
report left experiment.json "running"; scancel's SIGTERM to the warm process and the kernel
added their own lines (the warm process "is gone", "Kernel died", a never-retrieved task's
traceback)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil
import pytest

from helpers import (HTML_ONLY, Pause, labkit, leftovers, load_json, running_in, start_labkit,
                     tiny_flags, wait_for)

FLAGS = ["--nproc", "2", "--methods", "ddp", *tiny_flags(max_val_steps=1, timeout=60),
         "--runs-dir", "runs"]
RESULT = "results_baseline_ddp.json"
LINE = "labkit experiment: interrupted; every child process was stopped"


def _status(path) -> str | None:
    try:
        return load_json(path).get("status")
    except (OSError, ValueError):
        return None


def _report_running(cwd):
    """The report notebook runs: papermill writes into its scratch file in report/ from its first
    cell (labkit.orchestrate.render.write_notebook_report)."""
    return any((cwd / "runs").glob("*/report/.report.*.ipynb"))


def _the_experiments_processes(cwd) -> list:
    """What scancel signals: every process of the experiment (the labkit command and its client,
    the kernel, torchrun's agent, the ranks: each works under ``cwd``), not this one nor the
    worker's warm process they were forked from."""
    found = []
    for p in psutil.process_iter():
        try:
            if (p.cwd() + "/").startswith(f"{cwd}/"):
                found.append(p)
        except psutil.Error:
            pass
    return found


def _sigterm(proc, cwd, how: str) -> None:
    if how == "scancel":
        for p in _the_experiments_processes(cwd):
            try:
                p.send_signal(signal.SIGTERM)
            except psutil.Error:  # gone meanwhile
                pass
    else:
        proc.send_signal(signal.SIGTERM)


# moment: ((epoch, step) the pause hook holds every rank at, or None: a file the run writes
# tells it; how: kill (the labkit command alone), twice (again while the first one's cleanup
# runs) or scancel (every process of the experiment at once, as scancel and a time limit do))
MOMENTS = {
    "a rank's start": ((1, 0), "kill"),  # each rank's start done (data, model, process group)
    "training": ((1, 2), "twice"),       # two steps of five taken
    "training, by scancel": ((1, 2), "scancel"),
    "the method notebook's end": (None, "kill"),  # its ranks wrote their result
    "the report": (None, "kill"),
}


@pytest.mark.e2e
@pytest.mark.parametrize("moment", list(MOMENTS))
def test_sigterm_ends_the_experiment_in_one_line_and_continue_completes_it(tmp_path, moment):
    held, how = MOMENTS[moment]
    pause = Pause(tmp_path, "ddp", rank="*", epoch=held[0], step=held[1]) if held else None
    proc = start_labkit(["experiment", *FLAGS], tmp_path,
                        env={**HTML_ONLY, **(pause.env if pause else {})})
    try:
        if pause:
            pause.wait(240, proc, count=2)  # both ranks held: neither waits in a collective
        elif moment == "the report":
            wait_for(lambda: _report_running(tmp_path) or proc.poll() is not None, 240,
                     "the report notebook to start", every=0.05)
        else:
            wait_for(lambda: any(_status(r) == "completed" for r in
                                 (tmp_path / "runs").glob(f"*/ddp/{RESULT}"))
                     or proc.poll() is not None, 240, "ddp's result file", every=0.05)
        assert proc.poll() is None, f"the experiment ended first:\n{proc.stdout.read()[-3000:]}"
        _sigterm(proc, tmp_path, how)
    finally:
        if pause:
            pause.release()
    if how == "twice":  # a second SIGTERM while the first one's cleanup runs
        try:
            proc.wait(0.3)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out[-3000:]
    # nothing else said of the stop: no traceback, no dropped exception, no child's own line
    for word in ("Traceback", "Exception ignored", "never retrieved", "Kernel died", "is gone",
                 "FAILED"):
        assert word not in out, out[-3000:]
    assert [line for line in out.splitlines() if "interrupted" in line] == [LINE], out[-3000:]

    run = (tmp_path / "runs" / "latest").resolve()
    assert load_json(run / "experiment.json")["status"] == "interrupted"
    assert not leftovers(str(run))
    # the kernel, torchrun and its ranks run in the method's folder with relative paths
    wait_for(lambda: not running_in(run), 20, "no process left working in the run folder")
    result = _status(run / "ddp" / RESULT)
    # scancel's SIGTERM reached the ranks too: rank 0 marks its file failed (stopped by
    # SIGTERM), which the command's interrupted overrides, unless rank 0's mark came later
    assert result in ({"interrupted", "failed"} if how == "scancel" else
                      {"interrupted" if held else "completed"}), result

    p = labkit(["experiment", "--continue", str(run)], tmp_path, env=HTML_ONLY)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "Traceback" not in p.stdout + p.stderr
    doc = load_json(run / "experiment.json")
    assert doc["status"] == "completed" and doc["methods"]["ddp"]["status"] == "completed"
    assert _status(run / "ddp" / RESULT) == "completed"
    assert (run / "report" / "report.html").is_file()


# `python -m labkit runs`, its command replaced by one during which SIGTERM's KeyboardInterrupt
# is raised where it once went wrong ({raise_it}), that would then run on for 10 s
PROGRAM = """import os, signal, sys, time, weakref
from labkit import cli
from labkit.runs import readers

def command(**_):
{raise_it}
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        time.sleep(0.01)
    print("ran to its end")
    return 0

readers.runs_command = command
sys.argv = ["labkit", "runs", "."]
sys.exit(cli.main())
"""
RAISED_IN = {
    # Python cannot raise an exception from a weakref callback (nor from a __del__, nor the
    # garbage collector's): it printed "Exception ignored in" with the traceback and dropped it,
    # and the command ran on to its end, exit 0. The traceback: asyncio's WeakSet of
    # tasks drops one all the time while a notebook runs
    "a weakref callback": """    class Thing:
        pass
    thing = Thing()
    ref = weakref.ref(thing, lambda _: os.kill(os.getpid(), signal.SIGTERM))
    del thing""",
    # source text run by exec(), as dataclasses and namedtuple do at every import (torch's take
    # seconds): the KeyboardInterrupt set CPython's "unhandled KeyboardInterrupt" flag, caught
    # or not, and `python -m labkit` killed itself with SIGINT at its exit (-2, not 130)
    "exec of source text": """    exec("os.kill(os.getpid(), signal.SIGTERM)\\nfor _ in range(1000): pass")""",
}


@pytest.mark.e2e
@pytest.mark.parametrize("where", list(RAISED_IN))
def test_a_sigterm_raised_where_python_mishandles_it_stops_the_command_in_one_line(tmp_path, where):
    (tmp_path / "program.py").write_text(PROGRAM.format(raise_it=RAISED_IN[where]))
    env = {k: v for k, v in os.environ.items() if k != "LABKIT_WARM"}  # here, not relayed
    p = subprocess.run([sys.executable, "-m", "program"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=60, env=env)
    assert p.returncode == 130, (p.returncode, p.stdout, p.stderr)
    assert "ran to its end" not in p.stdout and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.strip() == "labkit runs: interrupted; every child process was stopped"


PROBE = "import sys, time\nprint('forked', flush=True)\ntime.sleep(float(sys.argv[1]))\n"


@pytest.mark.e2e
def test_a_sigterm_to_the_warm_process_lets_what_it_forked_end_first(tmp_path):
    """scancel signals an experiment's own warm process too (labkit.launch.warm): it stops
    serving and gives what it forked its grace, as when its owner goes, rather than dying under
    its clients, each of which then said so ("the warm process ... is gone") below the
    command's one line."""
    (tmp_path / "probe.py").write_text(PROBE)
    address = str(tmp_path / "socket")
    env = {k: v for k, v in os.environ.items() if k != "LABKIT_WARM"}
    server = subprocess.Popen([sys.executable, "-m", "labkit.launch.warm", address, "json"],
                              stdin=subprocess.PIPE, env=env)
    try:
        wait_for(lambda: (tmp_path / "ready").exists() or server.poll() is not None, 60,
                 "the warm process's imports")
        client = subprocess.Popen(
            [sys.executable, "-m", "labkit.launch.warm_client", "-m", "probe", "2"], cwd=tmp_path,
            env={**env, "LABKIT_WARM": address,
                 "PYTHONPATH": os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert client.stdout.readline() == "forked\n"
        server.send_signal(signal.SIGTERM)
        _, err = client.communicate(timeout=60)
        assert client.returncode == 0 and "is gone" not in err, (client.returncode, err)
        assert server.wait(30) == 0  # then it ended, nothing left to wait for
    finally:
        server.kill()
        server.wait()


@pytest.mark.unit
def test_the_tasks_an_interrupted_cell_left_are_cancelled_not_run_on(monkeypatch, caplog):
    """papermill's run_until_complete of a cell, left by a KeyboardInterrupt with the cell's
    tasks pending, and the loop run again for the kernel's shutdown (labkit.orchestrate.kernels):
    the tasks are cancelled there rather than run on, to nbclient's "Kernel died" and the cell's
    DeadKernelError that asyncio printed as "Task exception was never retrieved"."""
    import asyncio
    import gc
    import threading

    from nbclient.exceptions import DeadKernelError

    from labkit.orchestrate.kernels import drop_abandoned_tasks

    said = []

    async def poll_kernel_alive():  # as nbclient's: says it died, then raises
        await asyncio.sleep(0.05)
        said.append("Kernel died while waiting for execute reply.")
        raise DeadKernelError("Kernel died")

    async def cell():
        try:
            await asyncio.ensure_future(poll_kernel_alive())
        except asyncio.CancelledError:  # as nbclient's cell
            raise DeadKernelError("Kernel died") from None

    def interrupt():
        raise KeyboardInterrupt  # where SIGTERM's handler raised it: between two callbacks

    loop = asyncio.new_event_loop()
    monkeypatch.setattr("jupyter_core.utils.ensure_event_loop", lambda: loop)

    def papermill() -> None:
        try:
            drop_abandoned_tasks()
            loop.call_later(0.01, interrupt)
            with pytest.raises(KeyboardInterrupt):
                loop.run_until_complete(cell())
            loop.run_until_complete(asyncio.sleep(0.2))  # the kernel's shutdown
            gc.collect()  # the cell's task, which nothing awaits any more
        except BaseException as e:  # noqa: BLE001 - raised again in the test's thread
            failed.append(e)
        finally:
            loop.close()

    # in a thread of its own: this worker's main thread may run a loop already (playwright's)
    failed: list[BaseException] = []
    runner = threading.Thread(target=papermill)
    runner.start()
    runner.join()
    if failed:
        raise failed[0]
    assert said == []
    assert not [r for r in caplog.records if r.name == "asyncio"], caplog.text
