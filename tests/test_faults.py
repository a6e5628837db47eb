"""Faults on real torchrun jobs (gloo, CPU): a killed rank, a hung rank, an interrupted run,
an elastic restart. Each must end in bounded time, name the rank, leave no process behind and
keep every finished epoch."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from helpers import leftovers, load_json, tiny_cfg, tiny_flags, wait_for
from labkit.core.config import TrainConfig
from labkit.launch.launch import launch
from labkit.launch.launch_params import Nodes

# its module-scoped fixture is built once: the whole module on one xdist worker
pytestmark = pytest.mark.xdist_group("faults")

CFG = tiny_cfg(epochs=2, max_steps_per_epoch=3, max_val_steps=1, timeout=20.0, pin_cpus=None)


def run(tmp_path, name, env=None, nodes=Nodes(), nproc=2, **cfg):
    """Launch one method for real; the result gets ``elapsed`` (s)."""
    out = tmp_path / name
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        with open(tmp_path / f"{name}.stream", "a") as stream:
            t0 = time.monotonic()
            res = launch(TrainConfig(**{**CFG, **cfg}), nproc, str(out), nodes, stream=stream)
            res.elapsed = time.monotonic() - t0
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return res, out


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """allreduce launched and left alone: (final parameters, result, output folder, what the
    launcher streamed). The reference of the resumed runs, and the launcher's streaming."""
    tmp = tmp_path_factory.mktemp("ref")
    res, out = run(tmp, "ref", method="allreduce")
    res.check()
    return (torch.load(out / "final_model.pt", weights_only=True), load_json(out / "results_all_reduce.json"),
            out, (tmp / "ref.stream").read_text())


def test_launch_streams_the_reporting_rank(uninterrupted):
    """The launcher streams rank 0's lines only, and keeps every rank's log (the uninterrupted
    run; test_launch's own run until they were merged, issue 40)."""
    *_, out, text = uninterrupted
    assert "[rank0]: epoch 1/2: train loss" in text and "[rank0]: epoch 2/2: train loss" in text
    assert "[rank1]" not in text
    logs = sorted(p.parent.name for p in out.glob("logs/**/attempt_0/*/stdout.log"))
    assert logs == ["0", "1"]
    assert load_json(out / "results_all_reduce.json")["status"] == "completed"


def test_hung_rank_ends_at_the_collective_timeout(tmp_path):
    res, out = run(tmp_path, "hung", env={"LABKIT_TEST_FAULT": "ddp:1:1:hang"}, method="ddp", timeout=8.0)
    assert not res.ok and res.failed_rank == 1
    assert "rank 1 hung" in res.message and "timed out" in res.message
    assert res.elapsed < 60
    assert load_json(out / "results_baseline_ddp.json")["status"] == "failed"
    assert not leftovers(str(out))


def test_resume_continues_to_the_same_parameters(tmp_path, uninterrupted):
    ref_model, ref_doc, *_ = uninterrupted
    res, out = run(tmp_path, "resumed", env={"LABKIT_TEST_FAULT": "allreduce:0:4:kill"}, method="allreduce")
    assert not res.ok and res.failed_rank == 0
    r = load_json(out / "results_all_reduce.json")
    assert r["status"] == "failed" and len(r["epochs"]) == 1  # rank 0 died: the launcher marked it
    res, out = run(tmp_path, "resumed", method="allreduce", resume=True)
    res.check()
    final = torch.load(out / "final_model.pt", weights_only=True)
    for k, v in ref_model.items():
        assert torch.equal(final[k], v), k
    r = load_json(out / "results_all_reduce.json")
    assert r["status"] == "completed" and [e["epoch"] for e in r["epochs"]] == [1, 2]
    assert r["all_losses"] == ref_doc["all_losses"]
    assert r["resumed"][0]["at_epoch"] == 2


def test_resume_without_a_checkpoint_is_one_message(tmp_path):
    from labkit.core.config import ConfigError
    with pytest.raises(ConfigError, match="nothing to resume"):
        run(tmp_path, "fresh", method="ddp", resume=True)


def test_elastic_restart_resumes_from_the_checkpoint(tmp_path, uninterrupted):
    ref_model, *_ = uninterrupted
    res, out = run(tmp_path, "elastic", env={"LABKIT_TEST_FAULT": "allreduce:1:4"}, method="allreduce",
                   nodes=Nodes(max_restarts=1))
    res.check()
    final = torch.load(out / "final_model.pt", weights_only=True)
    for k, v in ref_model.items():
        assert torch.equal(final[k], v), k
    r = load_json(out / "results_all_reduce.json")
    assert r["status"] == "completed" and len(r["epochs"]) == 2 and r["resumed"]


def test_ctrl_c_on_the_launcher_stops_every_process(tmp_path):
    out = tmp_path / "interrupted"
    cmd = [sys.executable, "-m", "labkit", "run", "ddp", "--nproc", "2",
           *tiny_flags(epochs=50, max_steps_per_epoch=None, lr=None, max_val_steps=1, timeout=None,
                       pin_cpus=None),
           "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    result = out / "results_baseline_ddp.json"
    wait_for(result.exists, 90, "training to start")
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, output[-2000:]
    assert "interrupted" in output
    assert not leftovers(str(out))
    doc = load_json(result)
    # rank 0's own words, or the launcher's where rank 0 could not write them: the same
    assert doc["status"] == "interrupted"
    assert doc["error"] == "stopped by Ctrl-C, SIGTERM or a notebook's stop"
