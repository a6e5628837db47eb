"""The lab notebook across runs: `labkit runs` (one row per run folder, only the parameters that
differ), runs/index.html, `labkit diff A B`, and `labkit experiment --continue RUN` after a
SIGKILL. Run folders made for real by the tests: trained runs, a failed experiment, one
stopped by SIGTERM, one killed with SIGKILL half way, a sweep, a reproduction, a hand-edited one."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
from pathlib import Path

import pytest
import torch

from helpers import (HOOKS, TINY, check_ok, labkit, load_json, make_run, Pause, start_labkit as start,
                     tiny_flags, torchrun)
from labkit.analysis import compare
from labkit.core.run_folder import RunFolder
from labkit.core.status import Status

pytestmark = pytest.mark.xdist_group("labnotebook")

# labkit experiment with TINY's settings (conftest.TINY is the torchrun form)
EXP = ["--nproc", "2", "--methods", "ddp,allreduce,ps", *tiny_flags(epochs=None, max_steps_per_epoch=3, max_val_steps=1, timeout=60),
       "--calibrate-steps", "2"]


def completed(path: Path) -> bool:
    try:
        return json.loads(path.read_text())["status"] == Status.COMPLETED
    except (OSError, ValueError, KeyError):
        return False


def kill_everything_in(run: Path) -> None:
    """SIGKILL every process working in ``run`` (the kernel, torchrun and its ranks run in a
    method's folder): what a lost machine leaves."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if Path(os.readlink(f"/proc/{pid}/cwd")).is_relative_to(run):
                os.kill(int(pid), signal.SIGKILL)
        except OSError:
            pass


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> tuple[Path, bytes]:
    """An experiment (ddp, allreduce, ps) whose process group was SIGKILLed once ddp had
    finished and allreduce had written its first checkpoint; (run folder, ddp's result bytes)."""
    cwd = tmp_path_factory.mktemp("killed")
    # allreduce's rank 0 held before epoch 2's first step: its epoch-1 checkpoint is written,
    # and it cannot finish before the kill, however fast the machine (the pause hook)
    pause = Pause(cwd, "allreduce", rank=0, epoch=2, step=0)
    p = start(["experiment", *EXP, "--epochs", "2", "--runs-dir", "runs", "--tag", "killed"], cwd,
              env=pause.env)
    try:
        pause.wait(240, p)
        assert (cwd / "runs" / "latest" / "allreduce" / "checkpoint.pt").exists()
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    run = (cwd / "runs" / "latest").resolve()
    kill_everything_in(run)
    assert completed(run / "ddp" / "results_baseline_ddp.json")
    assert not completed(run / "allreduce" / "results_all_reduce.json")
    return run, (run / "ddp" / "results_baseline_ddp.json").read_bytes()


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory, ddp_run, ddp_rerun, killed) -> Path:
    """One runs/ folder holding one of each kind of run folder."""
    base = tmp_path_factory.mktemp("lab")
    runs = base / "runs"
    runs.mkdir()
    a = make_run(runs, "2026-11-20_10-00-00_a", ddp_run)
    # two runs that differ only in --bucket-mb, with enough steps for a throughput interval
    for name, extra in (("b", ()), ("c", ("--bucket-mb", "10"))):
        flags = ("--max-steps-per-epoch", "9", *extra)
        check_ok(torchrun(2, TINY + ["--method", "ddp", *flags, "--out", str(base / name)], cwd=base))
        make_run(runs, f"2026-11-20_11-00-00_{name}", base / name, flags)
    repro = make_run(runs, "2026-11-20_12-00-00_repro", ddp_rerun)
    compare.write_reproduction(repro, compare.compare_runs(RunFolder.experiment(a),
                                                           RunFolder.experiment(repro)))
    sweep = runs / "2026-11-20_13-00-00_sweep"
    sweep.mkdir()
    make_run(sweep, "nproc-2", ddp_run)
    (sweep / "sweep.json").write_text(json.dumps({
        "grid": {"nproc": [2]}, "status": Status.COMPLETED.value,
        "points": [{"name": "nproc-2", "params": {"nproc": 2, "methods": ["ddp"]}, "dir": "nproc-2",
                    "status": Status.COMPLETED.value}]}))
    p = labkit(["experiment", *EXP, "--methods", "ddp", "--epochs", "1", "--no-report",
                "--runs-dir", str(runs), "--tag", "fail"], base,
               env={"PYTHONPATH": HOOKS, "LABKIT_TEST_FAULT": "ddp:1:1"})
    assert p.returncode == 1, p.stdout[-2000:]
    # SIGTERM while allreduce trains (both ranks held at its first step, neither in a
    # collective), ddp finished
    pause = Pause(base, "allreduce", rank="*", epoch=1, step=0)
    p = start(["experiment", *EXP, "--methods", "ddp,allreduce", "--epochs", "1", "--no-report",
               "--runs-dir", str(runs), "--tag", "term"], base, env=pause.env)
    pause.wait(240, p, count=2)
    assert any(completed(d / "ddp" / "results_baseline_ddp.json") for d in runs.glob("*_term"))
    p.send_signal(signal.SIGTERM)
    pause.release()
    assert p.wait(timeout=120) == 130
    shutil.copytree(killed[0], runs / "2026-11-20_14-00-00_stopped", symlinks=True,
                    ignore=shutil.ignore_patterns("kernel-ipc-*"))  # the killed kernel's sockets
    edited = shutil.copytree(a, runs / "2026-11-20_15-00-00_edited")
    (edited / "config.json").write_text('{"experiment": ')  # cut short by hand
    return runs


# the first test of the module builds runs_dir (five experiments and two torchrun jobs), which
# took 173 s in a full suite on the shared machine and passed 300 s under a busy loop on both
# cores: pytest-timeout's limit counts that set-up
@pytest.mark.timeout(900)
def test_runs_lists_every_kind_with_its_status(runs_dir):
    p = labkit(["runs", str(runs_dir), "--json"], runs_dir)
    assert p.returncode == 0, p.stderr
    rows = {r["tag"] or r["name"]: r for r in json.loads(p.stdout, parse_constant=pytest.fail)}
    assert {k: (r["kind"], r["status_label"]) for k, r in rows.items()
            if k in ("a", "b", "repro", "sweep", "fail", "term", "stopped")} == {
        "a": ("experiment", "complete"), "b": ("experiment", "complete"),
        "repro": ("reproduction", "complete"), "sweep": ("sweep", "complete"),
        "fail": ("experiment", "failed"), "term": ("experiment", "interrupted"),
        "stopped": ("experiment", "stopped without finishing")}
    assert rows["edited"]["problem"] == "unreadable: config.json is not valid JSON (line 1, column 16)"
    b = rows["b"]["results"]["ddp"]
    assert b["low"] < b["throughput"] < b["high"]  # with its 95% CI
    assert len(rows) == 9  # runs/latest is a link, not a row

    text = labkit(["runs", str(runs_dir)], runs_dir).stdout
    header = text.splitlines()[0].split()
    assert "bucket_mb" in header            # it differs between b and c
    assert "lr" not in header               # it does not
    assert "lr" in labkit(["runs", str(runs_dir), "--all"], runs_dir).stdout.splitlines()[0].split()
    only = labkit(["runs", str(runs_dir), "--status", "failed", "--json"], runs_dir).stdout
    assert [r["tag"] for r in json.loads(only)] == ["fail"]
    assert labkit(["runs", str(runs_dir), "--since", "yesterday"], runs_dir).returncode == 2


def test_the_index_page_is_written_at_the_end_of_an_experiment(runs_dir):
    """The failed and the interrupted experiments above ended by writing runs/index.html (the
    latter is interrupted: the index is from the failed one, or later)."""
    page = (runs_dir / "index.html").read_text()
    assert page.count('<tr class="run">') >= 5 and "bucket_mb" in page


def test_diff_names_the_one_changed_parameter(runs_dir, tmp_path):
    b, c = runs_dir / "2026-11-20_11-00-00_b", runs_dir / "2026-11-20_11-00-00_c"
    p = labkit(["diff", str(b), str(c)], tmp_path)
    assert p.returncode == 0, p.stderr
    changed = p.stdout.split("changed:")[1].split("what came of it")[0]
    assert [l.strip() for l in changed.strip().splitlines()] == ["bucket_mb: 25.0 -> 10.0"]
    line = next(l for l in p.stdout.splitlines() if l.strip().startswith("Baseline DDP: results"))
    assert re.search(r"throughput \d+\.\d\dx A.*95% CI \d+\.\d+-\d+\.\d+", line), line
    assert (tmp_path / f"diff_{b.name}_vs_{c.name}.png").stat().st_size > 5000
    a = runs_dir / "2026-11-20_10-00-00_a"
    p = labkit(["diff", str(a), str(runs_dir / "2026-11-20_12-00-00_repro")], tmp_path)
    assert p.returncode == 0 and p.stdout.splitlines()[3].startswith("identical")


def test_bad_input_is_one_line_and_creates_nothing(runs_dir, tmp_path):
    for args in (["diff", str(tmp_path), str(runs_dir / "2026-11-20_10-00-00_a")],
                 ["experiment", "--continue", str(runs_dir / "2026-11-20_10-00-00_a")],
                 ["experiment", "--continue", str(tmp_path / "nope")],
                 ["runs", str(runs_dir), "--status", "complet"]):
        p = labkit(args, tmp_path)
        assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
        assert "Traceback" not in p.stderr
    assert list(tmp_path.iterdir()) == []
    # a typo in a filter is named with the choices, not shown as an empty notebook
    assert "'complet' is not a run status; choose from complete, failed, " in p.stderr


@pytest.mark.slow
def test_continue_finishes_a_killed_experiment(killed, tmp_path):
    run, ddp_bytes = killed
    p = labkit(["experiment", "--continue", str(run)], run.parent.parent)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "ddp: complete, kept" in p.stdout and "allreduce: resuming from its last checkpoint" in p.stdout
    assert (run / "ddp" / "results_baseline_ddp.json").read_bytes() == ddp_bytes  # not rerun
    status = load_json(run / "experiment.json")
    assert {m: e["status"] for m, e in status["methods"].items()} == dict.fromkeys(
        ("ddp", "allreduce", "ps"), Status.COMPLETED.value)
    assert status["continued"][0]["environment_changes"] == []
    assert (run / "allreduce.interrupted-1").is_dir()  # the first attempt is kept
    html = (run / "report" / "report.html").read_text()
    assert all(name in html for name in ("Baseline DDP", "Manual All-Reduce", "Parameter Server"))
    # the same parameters as an uninterrupted run from the same seed
    ref = labkit(["experiment", *EXP, "--methods", "allreduce,ps", "--epochs", "2", "--no-report",
                  "--runs-dir", "runs"], tmp_path)
    assert ref.returncode == 0, ref.stdout[-2000:]
    ref_run = (tmp_path / "runs" / "latest").resolve()
    for m in ("allreduce", "ps"):
        got = torch.load(run / m / "final_model.pt", weights_only=True)
        want = torch.load(ref_run / m / "final_model.pt", weights_only=True)
        assert all(torch.equal(got[k], want[k]) for k in want), m
    again = labkit(["experiment", "--continue", str(run)], tmp_path)
    assert again.returncode == 2 and "complete, nothing to continue" in again.stderr
