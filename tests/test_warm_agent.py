"""Ranks that start warm (labkit.launch.agent): one interpreter per node imports torch,
torchvision and labkit, and every rank is forked from it; the steps are those of the guide's
bare torchrun command, bit for bit; a killed warm process ends the run in one line, nothing
left; and the run's result file says where rank 0's time went (labkit.report.accounting)."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from helpers import ROOT, TINY, Pause, as_flags, leftovers, load_json, start_labkit, tiny_cfg
from labkit.core.config import TrainConfig
from labkit.launch.launch import launch

pytestmark = [pytest.mark.xdist_group("warm_agent"), pytest.mark.cold]

CFG = tiny_cfg(epochs=1, max_steps_per_epoch=2, max_val_steps=1)
RESULT = "results_baseline_ddp.json"


def _census_kinds(folder) -> list[str]:
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        from suite_census import kind
    finally:
        sys.path.pop(0)
    return [kind(line.split("\t")[3]) for line in (folder / "starts.tsv").read_text().splitlines()]


@pytest.fixture(scope="module")
def warm_run(tmp_path_factory):
    """ddp on 2 ranks launched by labkit (the warm agent), with the suite's census of every
    Python process started: (its folder, the census's folder)."""
    tmp = tmp_path_factory.mktemp("warm")
    census = tmp / "census"
    census.mkdir()
    os.environ["LABKIT_TEST_CENSUS"] = str(census)
    try:
        launch(TrainConfig(**CFG), 2, str(tmp / "warm"), stream=open(os.devnull, "w")).check()
    finally:
        os.environ.pop("LABKIT_TEST_CENSUS")
    return tmp / "warm", census


def test_ranks_are_forked_from_one_warm_process_per_node(warm_run):
    out, census = warm_run
    kinds = _census_kinds(census)
    # the agent and its fork server start Python; the two ranks are forks, not interpreters
    assert kinds.count("torchrun agent") == 1 and kinds.count("warm process") == 1, kinds
    assert "rank" not in kinds, kinds
    doc = load_json(out / RESULT)
    assert doc["status"] == "completed" and doc["world_size"] == 2


def test_warm_ranks_take_the_same_steps_as_the_guides_torchrun_command(warm_run, tmp_path):
    """The guide's bare command (torch's own torchrun, a fresh interpreter per rank) and the
    warm agent train the same parameters, bit for bit, in the same number of steps."""
    out, _ = warm_run
    flags = ["--method", "ddp", "--out", str(tmp_path / "cold"), *as_flags(CFG)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "labkit.train", *flags]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    warm = torch.load(out / "final_model.pt", weights_only=True)
    cold = torch.load(tmp_path / "cold" / "final_model.pt", weights_only=True)
    assert warm.keys() == cold.keys()
    assert all(torch.equal(warm[k], cold[k]) for k in warm), "the warm ranks trained other parameters"
    docs = [load_json(d / RESULT) for d in (out, tmp_path / "cold")]
    assert len(docs[0]["all_losses"]) == len(docs[1]["all_losses"]) > 0
    # a warm rank's start (fork to its Trainer) leaves out the imports a cold one pays for
    warm_cpu, cold_cpu = (d["timeline"]["start_cpu_s"] for d in docs)
    assert 0 < warm_cpu < cold_cpu, (warm_cpu, cold_cpu)


def test_the_result_file_accounts_for_rank_0s_time(warm_run):
    from labkit.report.accounting import method_account

    out, _ = warm_run
    doc, launched = load_json(out / RESULT), load_json(out / "launch.json")
    tl = doc["timeline"]
    assert launched["started_at"] < tl["process_start"] < tl["now"] < launched["ended_at"]
    assert tl["spent"]["train"] > 0 and tl["spent"]["validation"] > 0
    entry = {"started_at": launched["started_at"] - 1.0, "ended_at": launched["ended_at"] + 2.0}
    acc = method_account(entry, launched, tl)
    phases = sum(v for k, v in acc.items() if k != "total")
    assert abs(phases - acc["total"]) < 1e-6 and acc["kernel"] == 1.0 and acc["notebook_end"] == 2.0
    assert all(v >= 0 for v in acc.values()), acc


@pytest.mark.unit
def test_the_agents_rendezvous_records_are_named_as_torchs_own_names_them():
    """labkit's agent names torch's rendezvous events from the frame, not inspect.stack() (half
    a second of every launch): the same name as torch's function, the caller of the recorder."""
    import inspect

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    from labkit.launch.agent import _method_name

    def _record(namer):
        return namer()

    def join_the_round(namer):
        return _record(namer)

    namers = [_method_name, lambda depth=2: inspect.stack()[depth].function]  # torch's way
    if dynamic_rendezvous.get_method_name is not _method_name:  # torch's own, where unpatched
        namers.append(dynamic_rendezvous.get_method_name)
    assert [join_the_round(n) for n in namers] == ["join_the_round"] * len(namers)
    assert _method_name(10_000) == "no_method_name"


@pytest.mark.unit
def test_the_account_gives_trainings_share_and_the_epochs():
    """The table's last rows and its line: training's share of the wall time, and the guide's
    epochs' (training, validation and checkpoints: the issue's measure)."""
    from labkit.report.accounting import PHASES, account_rows, all_methods_line

    acc = dict.fromkeys((k for k, _ in PHASES), 0.0)
    acc.update(kernel=1.0, agent=1.0, train=6.0, validation=1.0, checkpoint=0.5, calibration=0.5,
               total=10.0)
    rows = {r["where the time went"]: r["m"] for r in account_rows({"m": acc})}
    assert rows["total (s)"] == "10.0" and rows["share that was training"] == "60%"
    assert rows["share that was the epochs (with validation, checkpoints)"] == "75%"
    line = all_methods_line({"m": acc, "n": acc})
    assert line.startswith("2 methods: 20.0 s, of which training epochs 12.0 s (60%)"), line
    assert line.endswith("with validation and checkpoints 15.0 s (75%)"), line


@pytest.mark.unit
def test_the_accounts_lines_add_the_experiments_start_report_and_whole(tmp_path):
    """Under the table: the experiment's start (before its first method, which waits for the
    warm process's imports), its methods, its report and its whole wall time, with training's
    share of the whole; each only where experiment.json has it."""
    from labkit.report.accounting import PHASES, all_methods_line, summary_lines

    acc = dict.fromkeys((k for k, _ in PHASES), 0.0)
    acc.update(train=6.0, validation=1.0, checkpoint=0.5, total=10.0)
    accounts = {"m": acc, "n": acc}
    (tmp_path / "experiment.json").write_text(json.dumps({"methods": {}}))
    assert summary_lines(tmp_path, accounts) == [all_methods_line(accounts)]
    (tmp_path / "experiment.json").write_text(json.dumps(
        {"methods": {}, "start_s": 4.0, "report_s": 9.0, "wall_s": 33.0}))
    start, methods, report, whole = summary_lines(tmp_path, accounts)
    assert start.startswith("before the first method") and start.endswith(": 4.0 s")
    assert methods == all_methods_line(accounts) and report == "then the report, 9.0 s"
    # 12 of 33 s training epochs, 15 of 33 s with validation and checkpoints
    assert whole == ("the experiment in all: 33.0 s, of which training epochs 36%, "
                     "with validation and checkpoints 45%"), whole


def _kill_the_warm_process(tmp_path, around=contextlib.nullcontext):
    """A ddp launch (inside ``around()``) whose ranks are held at their first step while the
    process that forked them is SIGKILLed: (its LaunchResult, its folder, every process that
    process had forked: their command lines are its own, which leftovers() cannot see)."""
    import psutil

    pause = Pause(tmp_path, method="ddp", rank="*", epoch=1, step=1)
    out = tmp_path / "killed"
    os.environ.update(pause.env)
    got = {}
    try:
        with around():
            t = threading.Thread(target=lambda: got.update(res=launch(
                TrainConfig(**CFG), 2, str(out), stream=open(os.devnull, "w"))))
            t.start()
            held = pause.wait(count=2)
            server = {psutil.Process(pid).ppid() for pid in held.values()}
            assert len(server) == 1, server  # both ranks forked by the same process
            forked = psutil.Process(next(iter(server))).children(recursive=True)
            os.kill(server.pop(), signal.SIGKILL)
            pause.release()
            t.join(120)
    finally:
        os.environ.pop("LABKIT_TEST_PAUSE")
    assert not t.is_alive(), "the launch did not end"
    assert not got["res"].ok
    assert load_json(out / RESULT)["status"] == "failed"
    assert not leftovers(str(out))
    assert not psutil.wait_procs(forked, timeout=20)[1], "a forked process was left running"
    return got["res"], out, forked


def test_a_killed_warm_process_ends_the_run_in_one_line_with_nothing_left(tmp_path):
    res, _, forked = _kill_the_warm_process(tmp_path)
    first = res.message.splitlines()[0]
    assert "the warm process that forks this node's ranks" in first and "SIGKILL" in first, res.message
    assert len(forked) >= 2, forked  # both ranks


@pytest.mark.unit
def test_every_module_the_warm_process_preloads_imports():
    """multiprocessing's fork server passes over a preload module that fails to import: a name
    that moved would silently make every rank import it again, cold (and an experiment's warm
    process, every agent and kernel)."""
    import importlib

    from labkit.launch.agent import AGENT, PRELOAD
    from labkit.orchestrate.kernels import KERNEL

    missing = []
    for name in PRELOAD + AGENT + KERNEL:
        try:
            importlib.import_module(name)
        except ImportError as e:
            missing.append(f"{name}: {e}")
    assert not missing, missing


@pytest.mark.unit
def test_the_warm_process_preloads_nothing_labkit_never_imports():
    """Every module the warm process imports is one a rank uses: named in an import statement
    somewhere in labkit (at the top or inside a function), or pulled in by those of a package
    labkit imports (torch._dynamo: torch.optim's optimizers and torchvision.ops import it). A preload no rank needs costs
    each node's start its import (scikit-learn's datasets: 1.3 CPU s on VM F, for a digits file
    read without it) and finds nothing to warm."""
    import ast
    import importlib

    from labkit.launch.agent import PRELOAD

    named = set()
    for path in (ROOT / "labkit").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                named.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                named.add(node.module)
    by_name = [m for m in PRELOAD if any(n == m or n.startswith(m + ".") for n in named)]
    for m in by_name:
        importlib.import_module(m)
    tops = {n.split(".")[0] for n in named}
    unused = [m for m in PRELOAD if m not in by_name
              and (m.split(".")[0] not in tops or m not in sys.modules)]
    assert not unused, f"preloaded, but no rank imports them: {unused}"


@pytest.mark.unit
def test_the_warm_process_imports_what_the_launchs_workload_needs(tmp_path):
    """preload_for reads the workload from the ranks' resolved file or --workload flag: a
    language model's node does not import torchvision; a workload or method of one's own is not
    preloaded (its import may touch CUDA before the ranks' fork); where nothing says, every
    built-in's; the built-ins are labkit.workloads.catalog's."""
    import json

    from labkit.launch.agent import BY_WORKLOAD, COMMON, PRELOAD, preload_for
    from labkit.workloads.catalog import BUILTIN

    assert set(BY_WORKLOAD) == set(BUILTIN)

    def resolved(workload, source="labkit.training.sync.ddp:DDPStrategy", builtin=True):
        path = tmp_path / f"{len(list(tmp_path.iterdir()))}.json"
        path.write_text(json.dumps({"train": {"workload": workload}, "nproc": 2,
                                    "method_spec": {"source": source, "builtin": builtin}}))
        return ["--nproc-per-node=2", "--standalone", "-m", "labkit.train", "--resolved", str(path)]

    lm = preload_for(resolved("lm"))
    assert "labkit.workloads.lm.model" in lm and "torchvision" not in lm
    assert "torchvision" in preload_for(resolved("images"))
    assert preload_for(resolved("mypkg.work:Mine", "mypkg.sync:Mine", builtin=False)) == COMMON
    assert preload_for(resolved("lm", "mypkg.sync:M", builtin=False)) == lm
    flags = ["--standalone", "-m", "labkit.train", "--method", "ddp"]
    assert preload_for([*flags, "--workload=lm"]) == lm
    assert preload_for([*flags, "--workload", "images"]) == preload_for(resolved("images"))
    assert preload_for(flags) == PRELOAD  # the default workload, not named: every built-in's
    broken = resolved("lm")
    Path(broken[-1]).write_text("{")
    assert preload_for(broken) == PRELOAD  # the ranks say what is wrong with it
    preload_for(resolved("images")).append("x")
    assert "x" not in preload_for(resolved("images"))  # a caller's list, not the table


# ------------------------------------------------------------------ an experiment's warm process
@pytest.fixture(scope="module")
def shared_run(tmp_path_factory):
    """The same ddp run inside an experiment's warm process (labkit.launch.warm, as `labkit
    experiment` starts it), with the census: (its folder, the census's folder)."""
    from labkit.launch import warm
    from labkit.launch.agent import AGENT, PRELOAD

    tmp = tmp_path_factory.mktemp("shared")
    census = tmp / "census"
    census.mkdir()
    os.environ["LABKIT_TEST_CENSUS"] = str(census)
    try:
        with warm.node(PRELOAD + AGENT):
            launch(TrainConfig(**CFG), 2, str(tmp / "run"), stream=open(os.devnull, "w")).check()
    finally:
        os.environ.pop("LABKIT_TEST_CENSUS")
    return tmp / "run", census


def test_an_experiments_warm_process_forks_the_agent_and_every_rank(shared_run, warm_run):
    """One interpreter imports for the agent and both ranks: each is a thin client's fork, and
    trains the parameters the agent's own fork server's ranks train (those are the guide's
    command's, bit for bit: the test above), in as many steps."""
    out, census = shared_run
    kinds = _census_kinds(census)
    assert kinds.count("warm process") == 1 and kinds.count("warm client") == 3, kinds
    assert "torchrun agent" not in kinds and "rank" not in kinds, kinds
    doc = load_json(out / RESULT)
    assert doc["status"] == "completed" and doc["timeline"]["started_by"] == "warm process"
    assert load_json(warm_run[0] / RESULT)["timeline"]["started_by"] == "agent's fork server"
    shared = torch.load(out / "final_model.pt", weights_only=True)
    alone = torch.load(warm_run[0] / "final_model.pt", weights_only=True)
    assert shared.keys() == alone.keys() and all(torch.equal(shared[k], alone[k]) for k in shared)
    assert len(doc["all_losses"]) == len(load_json(warm_run[0] / RESULT)["all_losses"]) > 0


def test_a_killed_experiment_warm_process_ends_the_run_in_one_line_with_nothing_left(tmp_path):
    from labkit.launch import warm
    from labkit.launch.agent import AGENT, PRELOAD

    res, _, forked = _kill_the_warm_process(tmp_path, lambda: warm.node(PRELOAD + AGENT))
    first = res.message.splitlines()[0]
    assert "the warm process that forks this experiment's processes" in first, res.message
    assert len(forked) >= 3, forked  # the agent and both ranks


@pytest.mark.unit
def test_a_notebooks_kernel_is_a_thin_client_where_an_experiment_has_a_warm_process(monkeypatch):
    """papermill's kernels (labkit.orchestrate.kernels): forked by the experiment's warm process
    when there is one, with ipykernel's own default backend named for the fork; a backend the
    user chose stands; any other kernel, or no warm process, starts as its spec says. (A warm
    process that answers and fits this one: test_warm_node.py.)"""
    from labkit.launch import warm
    from labkit.launch.warm import ENV
    from labkit.orchestrate.kernels import INLINE, KERNEL, warm_kernel

    monkeypatch.setattr(warm, "answers", lambda address: address == "/tmp/warm/socket")

    spec = ["/venv/bin/python", "-Xfrozen_modules=off", "-m", "ipykernel_launcher", "-f", "/k.json"]
    env = {ENV: "/tmp/warm/socket"}
    assert warm_kernel(spec, env) == ["/venv/bin/python", "-m", "labkit.launch.warm_client",
                                      "-m", "ipykernel_launcher", "-f", "/k.json"]
    assert env["MPLBACKEND"] == INLINE
    assert env["LABKIT_WARM_NEEDS"] == ",".join(KERNEL)  # forked before torch is in
    mine = {ENV: "/tmp/warm/socket", "MPLBACKEND": "svg"}
    warm_kernel(spec, mine)
    assert mine["MPLBACKEND"] == "svg"
    assert warm_kernel(spec, {}) == spec and warm_kernel(spec, None) == spec
    other = ["/usr/bin/R", "--slave", "-e", "IRkernel::main()", "--args", "/k.json"]
    untouched = {ENV: "/tmp/warm/socket"}
    assert warm_kernel(other, untouched) == other and "MPLBACKEND" not in untouched


def test_a_killed_warm_process_fails_the_experiments_method_in_one_line_and_the_rest_start_cold(tmp_path):
    """labkit experiment forks every notebook's kernel from its warm process too: killed while
    ddp trains, it takes the kernel with the agent and ranks; ddp fails saying why in one line
    (its result file too), nosync then starts cold, and nothing is left running."""
    import psutil

    pause = Pause(tmp_path, method="ddp", rank="*", epoch=1, step=1)
    proc = start_labkit(["experiment", *TINY, "--nproc", "2", "--methods", "ddp,nosync",
                         "--no-report", "--runs-dir", "runs"], tmp_path, env=pause.env)
    try:
        held = pause.wait(240, proc, count=2)
        server = {psutil.Process(pid).ppid() for pid in held.values()}
        assert len(server) == 1, server
        forked = psutil.Process(next(iter(server))).children(recursive=True)
        assert any("ipykernel_launcher" in " ".join(p.cmdline()) for p in forked), forked
        os.kill(server.pop(), signal.SIGKILL)
    finally:
        pause.release()
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1 and "Traceback" not in out, out[-3000:]
    failed = [line for line in out.splitlines() if "ddp FAILED" in line]
    assert len(failed) == 1 and "warm process ended (killed by SIGKILL)" in failed[0], out[-3000:]
    run = (tmp_path / "runs" / "latest").resolve()
    methods = load_json(run / "experiment.json")["methods"]
    assert (methods["ddp"]["status"], methods["nosync"]["status"]) == ("failed", "completed")
    assert load_json(run / "ddp" / RESULT)["status"] == "failed"
    assert load_json(run / "nosync" / "launch.json")["launched_from"] == "interpreter"
    assert not psutil.wait_procs(forked, timeout=20)[1], "a forked process was left running"
    assert not leftovers(str(run))
