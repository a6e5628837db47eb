"""The lab notebook across runs: `labkit runs` (one row per run folder, only the parameters that
differ), runs/index.html, `labkit diff A B`, and `labkit experiment --continue RUN` after a
SIGKILL. Every run folder is made for real by labkit: conftest's `reproduced` (a sweep of two
runs one parameter apart, a run copied from it and its reproduction) and `failed_experiment`, one
stopped by SIGTERM, one killed with SIGKILL half way; and one of them hand-edited."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from helpers import (HTML_ONLY, check_ok, labkit, load_json, Pause, start_labkit as start,
                     tiny_flags)
from warm import warm_run
from labkit.core.status import Status

pytestmark = pytest.mark.xdist_group("labnotebook")

# labkit experiment with TINY's settings (helpers.TINY is the torchrun form); the killed run's
# training settings, which its uninterrupted reference trains with on warm ranks
SETTINGS = tiny_flags(epochs=None, max_steps_per_epoch=3, max_val_steps=1, timeout=60)
EXP = ["--nproc", "2", "--methods", "ddp,allreduce,ps", *SETTINGS]


def completed(path: Path) -> bool:
    try:
        return json.loads(path.read_text())["status"] == Status.COMPLETED
    except (OSError, ValueError, KeyError):
        return False


def in_process(args: list, cwd: Path, capsys, monkeypatch) -> subprocess.CompletedProcess:
    """`labkit ARGS` run by labkit.cli.main in this process, in ``cwd``: its exit code and what it
    printed, a second or two sooner than a new Python (each command's first call in this
    module starts `python -m labkit` for real; the further calls check the command's options)."""
    from labkit.cli import main

    monkeypatch.chdir(cwd)
    capsys.readouterr()
    handler = signal.getsignal(signal.SIGTERM)  # main() installs labkit's own
    try:
        code = main([str(a) for a in args])
    except SystemExit as e:  # argparse's usage errors
        code = e.code
    finally:
        signal.signal(signal.SIGTERM, handler)
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out.out, out.err)


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
def runs_dir(tmp_path_factory, reproduced, killed, failed_experiment) -> Path:
    """One runs/ folder holding one of each kind of run folder, each written by labkit: the
    shared ones copied in (cp -r, as a user gathers runs), the rest run into it."""
    base = tmp_path_factory.mktemp("lab")
    runs = base / "runs"
    runs.mkdir()

    def copy(src: Path, name: str) -> Path:
        return shutil.copytree(src, runs / name, symlinks=True,
                               ignore=shutil.ignore_patterns("kernel-ipc-*"))  # a killed kernel's sockets

    # "a" and "c": two runs that differ only in --bucket-mb, with enough steps for a throughput
    # interval (a sweep's two points: "a" is the first, "c" the second copied out of it);
    # "repro": a's reproduction; the sweep itself
    a = copy(reproduced.original, reproduced.original.name)
    copy(reproduced.points[10.0], reproduced.sweep.name.replace("_sweep", "_c"))
    copy(reproduced.run, reproduced.run.name)
    copy(reproduced.sweep, reproduced.sweep.name)
    copy(killed[0], killed[0].name)  # stopped without finishing
    copy(failed_experiment.run, failed_experiment.run.name)  # "fail": ps failed, ddp kept
    edited = copy(a, a.name.removesuffix("_a") + "_edited")
    (edited / "config.json").write_text('{"experiment": ')  # cut short by hand
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
    return runs


# the first test of the module builds runs_dir (three experiments here, the sweep and the
# reproduction of conftest's `reproduced` when no other worker built them first), which took
# 173 s in a full suite on the shared machine (five experiments and two torchrun jobs then)
# and passed 300 s under a busy loop on both cores: pytest-timeout's limit counts that set-up
@pytest.mark.timeout(900)
def test_runs_lists_every_kind_with_its_status(runs_dir, capsys, monkeypatch):
    p = labkit(["runs", str(runs_dir), "--json"], runs_dir)
    assert p.returncode == 0, p.stderr
    rows = {r["tag"] or r["name"]: r for r in json.loads(p.stdout, parse_constant=pytest.fail)}
    assert {k: (r["kind"], r["status_label"]) for k, r in rows.items()
            if k in ("a", "c", "repro", "sweep", "fail", "term", "killed")} == {
        "a": ("experiment", "complete"), "c": ("experiment", "complete"),
        "repro": ("reproduction", "complete"), "sweep": ("sweep", "complete"),
        "fail": ("experiment", "failed"), "term": ("experiment", "interrupted"),
        "killed": ("experiment", "stopped without finishing")}
    assert rows["edited"]["problem"] == "unreadable: config.json is not valid JSON (line 1, column 16)"
    # a sweep's methods and code, from sweep.json and its points (its folder has no record)
    assert rows["sweep"]["methods"] == ["ddp"]
    assert rows["sweep"]["commit"] == rows["a"]["commit"] and rows["a"]["commit"]
    a = rows["a"]["results"]["ddp"]
    assert a["low"] < a["throughput"] < a["high"]  # with its 95% CI
    # runs/latest is a link, not a row
    assert len(rows) == len([d for d in runs_dir.iterdir() if d.is_dir() and not d.is_symlink()]) == 8

    def runs(*args):
        return in_process(["runs", runs_dir, *args], runs_dir, capsys, monkeypatch)

    text = runs().stdout
    header = text.splitlines()[0].split()
    assert "bucket_mb" in header            # it differs between a and c
    assert "lr" not in header               # it does not
    assert "lr" in runs("--all").stdout.splitlines()[0].split()
    only = runs("--status", "failed", "--json").stdout
    assert [r["tag"] for r in json.loads(only)] == ["fail"]
    assert runs("--since", "yesterday").returncode == 2


def test_the_index_page_is_written_at_the_end_of_an_experiment(runs_dir):
    """The interrupted experiment above, the last to end there, ended by writing runs/index.html
    (an interrupted experiment writes it as a finished one does: it lists every run folder)."""
    page = (runs_dir / "index.html").read_text()
    assert page.count('<tr class="run">') >= 5 and "bucket_mb" in page
    term = run_tagged(runs_dir, "term")
    assert term.name in page and "interrupted" in page


def run_tagged(runs_dir: Path, tag: str) -> Path:
    (run,) = runs_dir.glob(f"*_{tag}")
    return run


def test_diff_names_the_one_changed_parameter(runs_dir, tmp_path, capsys, monkeypatch):
    b, c = run_tagged(runs_dir, "a"), run_tagged(runs_dir, "c")
    p = labkit(["diff", str(b), str(c)], tmp_path)
    assert p.returncode == 0, p.stderr
    changed = p.stdout.split("changed:")[1].split("what came of it")[0]
    assert [l.strip() for l in changed.strip().splitlines()] == ["bucket_mb: 25.0 -> 10.0"]
    line = next(l for l in p.stdout.splitlines() if l.strip().startswith("Baseline DDP: results"))
    assert re.search(r"throughput \d+\.\d\dx A.*95% CI \d+\.\d+-\d+\.\d+", line), line
    assert (tmp_path / f"diff_{b.name}_vs_{c.name}.png").stat().st_size > 5000
    a = run_tagged(runs_dir, "a")
    p = in_process(["diff", a, run_tagged(runs_dir, "repro")], tmp_path, capsys, monkeypatch)
    assert p.returncode == 0 and p.stdout.splitlines()[3].startswith("identical")


def test_bad_input_is_one_line_and_creates_nothing(runs_dir, tmp_path, capsys, monkeypatch):
    for i, args in enumerate((["diff", str(tmp_path), str(run_tagged(runs_dir, "a"))],
                              # the runs folder for a run in it (a complete run continued
                              # is done, exit 0: test_continue_record)
                              ["experiment", "--continue", str(runs_dir)],
                              ["experiment", "--continue", str(tmp_path / "nope")],
                              ["runs", str(runs_dir), "--status", "complet"])):
        # the first as a user runs it, the others in this process
        p = labkit(args, tmp_path) if i == 0 else in_process(args, tmp_path, capsys, monkeypatch)
        assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
        assert "Traceback" not in p.stderr
    assert list(tmp_path.iterdir()) == []
    # a typo in a filter is named with the choices, not shown as an empty notebook
    assert "'complet' is not a run status; choose from complete, failed, " in p.stderr


@pytest.mark.slow
def test_continue_finishes_a_killed_experiment(killed, tmp_path, capsys, monkeypatch):
    run, ddp_bytes = killed
    # HTML only (no Chromium): this test reads the report's HTML; test_experiment the PDF
    p = labkit(["experiment", "--continue", str(run)], run.parent.parent, env=HTML_ONLY)
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
    # the same parameters as an uninterrupted run of the same settings from the same seed: each
    # method trained once more, straight through, on ranks of its own (the training the
    # experiment's notebook launches, without a kernel or a launcher around it: issue 40; forked
    # from the warm interpreter, which computes what torchrun's ranks compute, test_warm_ranks_
    # compute_what_torchrun_ranks_compute)
    for m in ("allreduce", "ps"):
        check_ok(warm_run(2, [*SETTINGS, "--epochs", "2", "--method", m, "--out", str(tmp_path / m)],
                          cwd=tmp_path))
        got = torch.load(run / m / "final_model.pt", weights_only=True)
        want = torch.load(tmp_path / m / "final_model.pt", weights_only=True)
        assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want), m
    again = in_process(["experiment", "--continue", run], tmp_path, capsys, monkeypatch)
    assert again.returncode == 0 and "complete, nothing to continue" in again.stdout


def test_runs_and_diff_show_the_emulated_link_as_set_and_measured(experiment, tmp_path, capsys,
                                                                  monkeypatch):
    """Issue 57, item 3: `labkit runs` and `labkit diff` show the link a run had. The session's
    experiment copied twice; the second made a run on 2 emulated nodes at 100mbit as labkit
    records one (config.json's nodes, each result file's link)."""
    runs = tmp_path / "runs"
    a = shutil.copytree(experiment.run, runs / "2026-01-01_00-00-00_loop", symlinks=True)
    b = shutil.copytree(experiment.run, runs / "2026-01-01_00-10-00_slow", symlinks=True)
    config = load_json(b / "config.json")
    config["experiment"]["nodes"].update(emulate_nodes=2, link="100mbit")
    (b / "config.json").write_text(json.dumps(config))
    results = sorted(b.rglob("results_*.json"))  # every method's, every repeat's
    assert len(results) >= 3
    for i, f in enumerate(results):
        doc = load_json(f)
        doc["link"] = {"nodes": 2, "ranks_per_node": 1, "link": "100mbit", "rate_bit": 10 ** 8,
                       "goodput_mbit": [{"node": "node0", "up": 91.0 + i, "down": 94.0},
                                        {"node": "node1", "up": 93.0, "down": 92.0}]}
        f.write_text(json.dumps(doc))
    p = in_process(["diff", a, b], tmp_path, capsys, monkeypatch)
    assert p.returncode == 0, p.stderr
    changed = [l.strip() for l in p.stdout.split("changed:")[1].split("what came of it")[0].splitlines()]
    assert "emulate_nodes: - -> 2" in changed and "link: - -> 100mbit" in changed
    # the goodput of every method's probe: 91 to 94 (91 + the last result's index)
    top = 91 + len(results) - 1
    assert (f"network: one machine -> 2 nodes x 1 ranks, 100mbit, measured 91-{max(94, top)} Mbit/s"
            in changed), changed
    assert not p.stdout.splitlines()[3].startswith("identical")
    p = in_process(["runs", runs], tmp_path, capsys, monkeypatch)
    assert p.returncode == 0, p.stderr
    head, _, first, second = p.stdout.splitlines()[:4]
    assert "network" in head.split()
    assert "2 nodes x 1 ranks, 100mbit, measured" in second and "100mbit" not in first
    # `labkit reproduce` and `labkit experiment --continue` run it on the same link again
    from labkit.core.run_folder import RunFolder
    from labkit.orchestrate.continuation import _prepared as continuation
    from labkit.orchestrate.reproduce import plan as reproduction

    config["experiment"]["repeats"] = 1  # reproduce re-runs single-repeat experiments
    (b / "config.json").write_text(json.dumps(config))
    again = reproduction(b, methods=["ddp"], out=str(tmp_path / "again")).prepared.exp.nodes
    assert (again.emulate_nodes, again.link) == (2, "100mbit")
    assert not (tmp_path / "again").exists()  # planned only
    went_on = continuation(RunFolder.experiment(b)).exp.nodes
    assert (went_on.emulate_nodes, went_on.link) == (2, "100mbit")
