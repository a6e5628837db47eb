"""Fixtures and markers only: the session's real runs, the guard every test runs under, the
kind of each test (unit / torchrun / e2e) and the order xdist starts them in. The helpers the
tests call are in helpers.py."""
from __future__ import annotations

import fcntl
import inspect
import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import types
from pathlib import Path

import pytest

# helpers first: it puts tests/hooks on PYTHONPATH for every process the tests start. Test
# modules import from helpers, never from here (tests/test_architecture.py checks it)
from helpers import (EQUIVALENCE_RUNS, EXPERIMENT_FLAGS, EXPERIMENT_REPEATS, HTML_ONLY, PAIR_FLAGS,
                     PAIR_GRID, TINY, Experiment, Reproduced, check_ok, labkit, make_image_tree,
                     process_state, restore_process_state, snapshot_tree)
from warm import reaped_cpu_seconds, server_cpu_seconds, warm_run

# A shell without job control starts a background command (`make test &` in a script) with
# SIGINT ignored, and an ignored signal stays ignored in every program started from there:
# the Ctrl-C tests' SIGINT would reach ranks that ignore it. Python's own handler here (each
# xdist worker imports this file) makes every process the tests start get SIGINT's default.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def image_tree(tmp_path_factory) -> Path:
    return make_image_tree(tmp_path_factory.mktemp("imagenet"))


def shared_dir(tmp_path_factory, name: str, build) -> Path:
    """The folder ``build(folder)`` makes, built once per test session: under xdist by whichever
    worker asks first, while any other worker asking waits for it (a file lock) and then reads
    the same folder. For finished runs that tests in several xdist groups only read; a test
    that changes one works on a copy (shutil.copytree to its tmp_path)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):  # one process: a plain session fixture
        folder = tmp_path_factory.mktemp(name) / name
        build(folder)
        return folder
    root = tmp_path_factory.getbasetemp().parent / "shared"  # this session's, all workers'
    root.mkdir(exist_ok=True)
    folder, done = root / name, root / f"{name}.done"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)  # what a failed build left
            build(folder)
            done.touch()
    return folder


def _ddp_tiny(out: Path) -> None:
    check_ok(warm_run(2, TINY + ["--method", "ddp", "--out", str(out)], cwd=out.parent))


# TINY ddp on 2 gloo ranks is what the equivalence, result-file, reproduce and multi-node tests
# all start from: two real runs for the whole session (two, so that the tests of determinism
# compare two trainings), not one per test module (2026-11-23: five). Their ranks are forked
# from the worker's warm interpreter (tests/warm.py): these runs are read for their numbers,
# which are torchrun's bit for bit (test_multinode and test_cluster compare real torchrun runs
# with ddp_run with torch.equal; test_compression_methods the other methods); torchrun itself
# is tested where it is the subject.
@pytest.fixture(scope="session")
def ddp_run(tmp_path_factory) -> Path:
    """The output folder of one real TINY ddp run on 2 gloo ranks (read-only)."""
    return shared_dir(tmp_path_factory, "ddp_run", _ddp_tiny)


@pytest.fixture(scope="session")
def ddp_rerun(tmp_path_factory) -> Path:
    """A second, independent TINY ddp run from the same seed (read-only)."""
    return shared_dir(tmp_path_factory, "ddp_rerun", _ddp_tiny)


@pytest.fixture(scope="session")
def equivalence_runs(tmp_path_factory, ddp_run):
    """{name: (out_dir, completed process)} for EQUIVALENCE_RUNS, run for real on warm ranks
    (tests/warm.py; ddp's process is None: it is ddp_run, which may have run on another xdist
    worker)."""
    base = tmp_path_factory.mktemp("equiv")
    out = {"ddp": (ddp_run, None)}
    for name, (nproc, args) in EQUIVALENCE_RUNS.items():
        if name in out:
            continue
        d = base / name
        proc = warm_run(nproc, TINY + args + ["--out", str(d)], cwd=base)
        check_ok(proc)
        out[name] = (d, proc)
    return out


# ------------------------------------------------------------------ the session's experiment
# One real `labkit experiment` of the three methods with 2 repeats, as a user runs it (a YAML
# parameters file, the CPU default binding ranks to cores, the PDF): the run folder, the
# record, the report's HTML, text and PDF, the repeats' rotation and aggregation, strict JSON
# and the runs index are all asserted on it (test_experiment.py, test_repeats_sweep.py), and
# copies of it are what the explorer, the notebooks in a browser and --continue after a kill
# read (test_explore.py, test_browser.py, test_continue_record.py),
# instead of one experiment per test (2026-11-25: two, 4 min of the suite). Its tests are one
# xdist group: one worker runs it while the other goes on. Every process of it counts its
# config checks (LABKIT_TEST_COUNT into Experiment.CALLS: test_resolved_once), which changes
# nothing it does.
def _experiment(folder: Path) -> None:
    folder.mkdir(parents=True)
    (folder / "params.yaml").write_text("epochs: 1\nmax_steps_per_epoch: 3\ndataset: digits\n")
    # one warm-up step: 2 of the 3 steps timed, so that no clock's window holds the first
    # step's lazy start (0.3-0.7 s of the trainers' first forward), which a PS server's clock
    # (rank 0) sees only in part (its window opens when it starts serving)
    p = labkit(["experiment", "-f", "params.yaml", "--repeats", str(EXPERIMENT_REPEATS),
                *EXPERIMENT_FLAGS, "--pin-cpus",  # the CPU default (the last flag wins)
                "--warmup-steps", "1", "--runs-dir", "runs", "--tag", "tiny"], cwd=folder,
               timeout=900,
               env={"LABKIT_TEST_COUNT": str(folder / Experiment.CALLS)})
    Experiment.record(folder, p)


@pytest.fixture(scope="session")
def experiment(tmp_path_factory) -> Experiment:
    """The session's real experiment (read-only; a test that changes it works on a copy)."""
    return Experiment(shared_dir(tmp_path_factory, "experiment", _experiment))


# ------------------------------------------------------------------ the session's failed experiment
# ddp and ps, ps's worker (rank 1) failing at its second step, no Chromium: the experiment is
# recorded as failed, ddp's results kept, the report written as HTML saying why no PDF
# (test_experiment), and, copied into a runs/ folder, the failed row of the runs index
# (test_lab_notebook: hence its tag and the lab notebook's calibration steps) and the older,
# partial run beside the session experiment (test_explore, test_browser)
def _failed_experiment(folder: Path) -> None:
    folder.mkdir(parents=True)
    p = labkit(["experiment", *EXPERIMENT_FLAGS, "--epochs", "1", "--max-steps-per-epoch", "3",
                "--calibrate-steps", "2", "--methods", "ddp,ps", "--runs-dir", "runs",
                "--tag", "fail"], cwd=folder, timeout=600,
               env={"LABKIT_TEST_FAULT": "ps:1:1", "LABKIT_CHROMIUM": "/nonexistent/chromium"})
    Experiment.record(folder, p)


@pytest.fixture(scope="session")
def failed_experiment(tmp_path_factory) -> Experiment:
    """An experiment whose ps failed and whose ddp completed (read-only; copy to change)."""
    return Experiment(shared_dir(tmp_path_factory, "failed_experiment", _failed_experiment))


# ------------------------------------------------------------------ a run and its reproduction
# Two real ddp runs differing only in --bucket-mb (the points of one `labkit sweep`), the first
# copied to runs/ as a user copies a run folder and reproduced with `labkit reproduce
# runs/latest`: the run folders of test_reproduce (compare, the record, the command) and of
# test_lab_notebook's runs index and diff (a run, its reproduction, a sweep, two runs one
# parameter apart), which were written by hand around bare torchrun output before (issue 40)
def _reproduced(folder: Path) -> None:
    folder.mkdir(parents=True)
    grid = [f"{k}={','.join(map(str, v))}" for k, v in PAIR_GRID.items()]
    check_ok(labkit(["sweep", *grid, *PAIR_FLAGS, "--no-report", "--runs-dir", "sweeps"], cwd=folder,
                    env=HTML_ONLY))
    sweep = (folder / "sweeps" / "latest").resolve()
    (key,) = PAIR_GRID
    points = {str(p["params"][key]): p["dir"]
              for p in json.loads((sweep / "sweep.json").read_text())["points"]}
    first = sweep / points[str(PAIR_GRID[key][0])]
    runs = folder / "runs"
    runs.mkdir()
    original = shutil.copytree(first, runs / sweep.name.replace("_sweep", "_a"))  # cp -r
    (runs / "latest").symlink_to(original.name)
    before = snapshot_tree(original)
    Experiment.record(folder, labkit(["reproduce", "runs/latest"], cwd=folder, env=HTML_ONLY))
    (folder / "reproduced.json").write_text(json.dumps({
        "sweep": str(sweep.relative_to(folder)), "points": points,
        "original": str(original.relative_to(folder)), "before": before}))


@pytest.fixture(scope="session")
def reproduced(tmp_path_factory) -> Reproduced:
    """The sweep, the run copied from its first point and that run's reproduction (read-only;
    a test that changes one works on a copy)."""
    return Reproduced(shared_dir(tmp_path_factory, "reproduced", _reproduced))


# `make test` runs two xdist workers with --dist loadgroup: each xdist group's tests go to one
# worker together (the groups with the most tests first), every other test on its own, in
# collection order. On 2 cores the suite is CPU-bound, so what a good order saves is the end:
# one worker still on a minute-long test while the other has nothing left. These tests (seconds
# each, measured alone on 2 cores, 2026-11-23) go first, longest first; the many short ones fill
# in behind them. (Not in a group: a group's tests keep their order.)
LONGEST_FIRST = {
    # the session's experiment: its group's first test builds it
    "test_experiment.py::test_experiment_makes_a_complete_run_folder": 160,
    "test_experiment.py::test_a_failed_method_is_recorded_and_the_others_kept": 57,
    "test_repeats_sweep.py::test_a_small_real_sweep_renders_its_report": 56,
    "test_experiment.py::test_ctrl_c_on_the_experiment_stops_everything": 23,
    # four torchrun jobs at once, after the module's warm runs (test_ps_variants' three took
    # 34, 17 and 15 s under torchrun; on warm ranks 4-7 s, 2026-11-27: no longer listed)
    "test_compression_methods.py::test_warm_ranks_compute_what_torchrun_ranks_compute": 43,
    "test_data_checks.py::test_torchrun_with_skip_bad_images_warns_once": 14,
    "test_launch.py::test_failed_rank_is_named_with_its_log": 13,
    # its group's first test builds three DDP runs (--time-comm stats, hook, off)
    "test_breakdown.py::test_timing_ddp_changes_no_parameter": 30,
    # the lab notebook's group (test_reproduce's too) builds its run folders in its first
    # test's fixtures: `reproduced` and the module's own
    "test_lab_notebook.py::test_runs_lists_every_kind_with_its_status": 95,
    "test_resources.py::test_a_disk_that_fills_at_the_first_checkpoint_is_one_line": 24,
    "test_resources.py::test_a_rank_killed_as_by_the_oom_killer_is_one_line": 23,
    # one xdist group (one worker owns the Slurm daemons), ~90 s in all: started early
    "test_slurm.py::test_sweep_on_slurm_is_one_job_per_point_and_ends_with_the_sweep_report": 30,
    "test_slurm.py::test_the_sbatch_script_runs_each_method_on_two_nodes": 25,
    "test_slurm.py::test_a_failing_method_fails_the_job_with_labkits_line": 15,
    "test_slurm.py::test_scancel_stops_every_rank": 6,
}


def pytest_collection_modifyitems(config, items):
    def seconds(item) -> float:
        return LONGEST_FIRST.get(f"{item.path.name}::{item.name}", 0)

    for item in items:
        if not any(item.get_closest_marker(k) for k in KINDS):
            item.add_marker(getattr(pytest.mark, kind_of(item)))
    if config.pluginmanager.hasplugin("xdist"):
        _module_fixtures_on_one_worker(items)
    items.sort(key=lambda item: -seconds(item))  # stable: the others keep their order


#: module-scoped fixtures that start nothing, so that a worker building its own costs nothing
CHEAP_MODULE_FIXTURES = {
    "test_gpu_data.py::jpeg_tree",  # 36 small JPEGs written in this process
    "test_gpu_ranks.py::jpeg_tree",  # 96 small JPEGs, for tests that run on a GPU only
}

#: the same, conftest's own, in every module
CHEAP_EVERYWHERE = {"_cold_module"}  # sets one environment variable


def _module_fixtures_on_one_worker(items) -> None:
    """A module-scoped fixture is built by every xdist worker that runs one of its tests:
    the tests that ask for one must share an xdist_group, or the suite builds it once per
    worker (test_methods' ring trained twice, 17 CPU seconds each, until it had a group)."""
    groups: dict[str, set] = {}
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        mark = item.get_closest_marker("xdist_group")
        group = (mark.args[0] if mark.args else mark.kwargs.get("name")) if mark else None
        for name, defs in (info.name2fixturedefs.items() if info else ()):
            key = f"{item.path.name}::{name}"
            if (defs and defs[-1].scope == "module" and key not in CHEAP_MODULE_FIXTURES
                    and name not in CHEAP_EVERYWHERE):
                groups.setdefault(key, set()).add(group)
    split = {k: v for k, v in groups.items() if len(v) > 1 or None in v}
    if split:
        raise pytest.UsageError(
            "module-scoped fixtures whose tests do not share one xdist_group (each worker "
            "would build its own; tests/conftest.py): "
            + "; ".join(f"{k} (groups {sorted(map(str, v))})" for k, v in sorted(split.items())))


# ------------------------------------------------------------------ the kind of a test
# unit: in-process only; warm: trains on ranks forked from the worker's warm interpreter
# (tests/warm.py: arithmetic, no launcher; make test-fast runs the unit tests and the warm
# ones not marked slow); torchrun: starts real ranks under torchrun (or labkit.launch.launch);
# e2e: starts a labkit command, a notebook kernel, a browser, Slurm, or any other program. A
# test marked with one of them (itself or its module's pytestmark) is that kind; any other is
# judged by what it starts: the names its code, its fixtures' code and the functions of its
# module they call refer to. A test judged unit or warm that starts a Python process fails
# (the guard below), saying to mark it.
KINDS = ("unit", "warm", "torchrun", "e2e")
STARTS = {
    "e2e": {"labkit", "start_labkit", "subprocess", "Popen", "execute_notebook", "page",
            "export_pdf", "screenshot"},  # these two start Chromium
    "torchrun": {"torchrun", "launch", "start_torchrun"},
    "warm": {"warm_run", "start_warm"},  # ranks forked from the worker's warm server
}


def _names(fn, module, seen: set) -> set[str]:
    """The global and attribute names ``fn``'s code refers to, and those of the functions of
    ``module`` it calls (transitively)."""
    out: set[str] = set()
    code = getattr(fn, "__code__", None)
    if code is None or code in seen:
        return out
    seen.add(code)
    stack = [code]
    while stack:
        c = stack.pop()
        out.update(c.co_names)
        out.update(c.co_varnames[:c.co_argcount])  # fixtures by name: page, cluster
        stack += [k for k in c.co_consts if isinstance(k, types.CodeType)]
    for n in list(out):
        f = getattr(module, n, None)
        if isinstance(f, types.FunctionType) and getattr(f, "__module__", None) == module.__name__:
            out |= _names(f, module, seen)
    return out


def kind_of(item) -> str:
    fns = [(getattr(item, "function", None), item.module)]
    for name, defs in getattr(item, "_fixtureinfo", None) and item._fixtureinfo.name2fixturedefs.items() or ():
        for d in defs if name != "_guard" else ():
            f = inspect.unwrap(d.func)
            mod = sys.modules.get(getattr(f, "__module__", ""), None)
            if mod is not None and Path(getattr(mod, "__file__", "") or "").parent == Path(__file__).parent:
                fns.append((f, mod))
    names: set[str] = set()
    seen: set = set()
    for f, mod in fns:
        if f is not None and mod is not None:
            names |= _names(f, mod, seen)
    if names & STARTS["e2e"]:
        return "e2e"
    if names & STARTS["torchrun"]:
        return "torchrun"
    if names & STARTS["warm"]:
        return "warm"
    return "unit"


def _starts_python(args) -> bool:
    """Whether a command line starts what a unit test must not: Python (a labkit command,
    torchrun, a kernel, Jupyter). (Quick tools, git, pdfinfo or `chromium --version` when
    labkit looks for one, are let through.)"""
    argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
    first = os.path.basename(str(argv[0])) if argv else ""
    return first.startswith(("python", "torchrun", "jupyter")) or str(argv[0]) == sys.executable


# ------------------------------------------------------------------ the worker's warm process
@pytest.fixture(scope="session", autouse=True)
def _warm_process(request):
    """One warm process per pytest worker, the product's (labkit.launch.warm.node, what `labkit
    warm` gives a shell): it is named in LABKIT_WARM, which every process the tests start
    inherits, so each labkit command's launches fork their agents and ranks from it, and an
    experiment its kernels too, as they would under `labkit warm`: torch, torchvision, labkit
    and IPython imported once per worker, not once per launch (an agent's fork server and an
    experiment's warm process, 6-7 CPU s each, were a third of the suite's CPU). What runs
    cold stays tested: a test that needs its own process (an experiment's warm process killed,
    a cold agent's fork server) starts without LABKIT_WARM. Not started for a session of unit
    and warm tests only (make test-fast), which start no labkit process."""
    from labkit.launch import agent, warm
    from labkit.orchestrate.kernels import KERNEL

    if all(i.get_closest_marker("unit") or i.get_closest_marker("warm") for i in request.session.items):
        yield
        return
    import psutil

    with warm.node(KERNEL + agent.PRELOAD + agent.AGENT) as address:  # labkit warm's
        _WARM_PROCESS[:] = [c.pid for c in psutil.Process().children() if address in c.cmdline()]
        yield
    _WARM_PROCESS.clear()


_WARM_PROCESS: list = []  # the worker's warm process's pid while it runs


@pytest.fixture(scope="module", autouse=True)
def _cold_module(request):
    """A module marked ``cold`` runs without the worker's warm process: it checks the
    processes a launch starts for itself (an agent's fork server, an experiment's own warm
    process, each killed), or follows a run's processes down from its command (forks of the
    worker's warm process are that process's children, not the command's)."""
    if not request.node.get_closest_marker("cold"):
        yield
        return
    before = os.environ.pop("LABKIT_WARM", None)
    try:
        yield
    finally:
        if before is not None:
            os.environ["LABKIT_WARM"] = before


@pytest.fixture(autouse=True)
def _guard(request):
    """Every test: the torch, NumPy and Python random states and torch's thread counts it
    found are restored after it (an in-process reference seeds and sets one thread), and the
    signal handlers and logging an in-process labkit command sets (process_state); a unit
    or warm test that starts a Python process (a labkit command, torchrun, a kernel) fails,
    saying to mark it (the warm server and its ranks are forked without subprocess)."""
    import numpy as np
    import torch

    state = (torch.get_rng_state(), np.random.get_state(), random.getstate(),
             torch.get_num_threads(), torch.get_num_interop_threads())
    process = process_state()
    kind = next((k for k in ("unit", "warm") if request.node.get_closest_marker(k)), None)
    real = subprocess.Popen.__init__

    def watched(self, args, *a, **kw):
        if _starts_python(args):
            pytest.fail(f"{request.node.nodeid} is a {kind} test but starts {args!r}: mark it "
                        "@pytest.mark.e2e (or torchrun), tests/conftest.py", pytrace=False)
        return real(self, args, *a, **kw)
    if kind:
        subprocess.Popen.__init__ = watched
    try:
        yield
    finally:
        subprocess.Popen.__init__ = real
        restore_process_state(process)
        torch.set_rng_state(state[0])
        np.random.set_state(state[1])
        random.setstate(state[2])
        if torch.get_num_threads() != state[3]:
            torch.set_num_threads(state[3])
        # the inter-op pool can be sized once per process only: a test that changed it is told
        assert torch.get_num_interop_threads() == state[4], "a test changed torch's inter-op threads"


# ------------------------------------------------------------------ the CPU each test costs
# The suite computes rather than waits (docs/performance-log.md, "the suite on three workers"), so
# what a test costs is its CPU seconds: the worker's own and those of the processes it started
# and waited for (torchrun waits for its ranks, a kernel for torchrun), from the start of its
# setup (the session's runs it is the first to ask for included) to the end of its teardown.
def _cpu_seconds() -> float:
    # the warm ranks are the warm servers' children, not the worker's: their counts are added
    return server_cpu_seconds() + _warm_process_cpu_seconds() + sum(
        getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
        for f in ("ru_utime", "ru_stime"))


def _warm_process_cpu_seconds() -> float:
    """The worker's warm process's CPU seconds: its own and its reaped children's (every agent,
    rank and kernel it forked that ended)."""
    return sum(reaped_cpu_seconds(pid) for pid in _WARM_PROCESS)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item.cpu_at_start = _cpu_seconds()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    rep = (yield).get_result()
    if rep.when == "teardown" and hasattr(item, "cpu_at_start"):
        rep.user_properties.append(("cpu_s", round(_cpu_seconds() - item.cpu_at_start, 1)))


def _cpu_summary(terminalreporter, largest: int = 15) -> None:
    cpu = sorted(((v, rep.nodeid) for reps in terminalreporter.stats.values() for rep in reps
                  for k, v in getattr(rep, "user_properties", ()) if k == "cpu_s"), reverse=True)
    if cpu:
        terminalreporter.write_sep("-", f"CPU seconds by test: {sum(v for v, _ in cpu):.0f} in all, "
                                        f"the {min(largest, len(cpu))} largest (tests/conftest.py)")
        for v, nodeid in cpu[:largest]:
            terminalreporter.write_line(f"{v:7.1f}  {nodeid}")


def pytest_terminal_summary(terminalreporter):
    """The CPU seconds of the costliest tests; the Slurm jobs the tests submitted, with the
    states Slurm recorded (test_slurm.show): the suite's output says that the jobs ran on a
    real controller, and how they ended."""
    _cpu_summary(terminalreporter)
    lines = [v for key in ("passed", "failed") for rep in terminalreporter.stats.get(key, [])
             for k, v in getattr(rep, "user_properties", ()) if k == "slurm"]
    if lines:
        terminalreporter.write_sep("-", "Slurm jobs (tests/test_slurm.py)")
        for line in lines:
            terminalreporter.write_line(line)
