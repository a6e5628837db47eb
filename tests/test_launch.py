"""The launcher: argument lists, validation before spawning, and a failed rank's message."""
from __future__ import annotations

import json
import re
import time

import pytest

from helpers import load_json, tiny_cfg
from labkit.core.config import ConfigError, TrainConfig
from labkit.launch.launch import launch, torchrun_command
from labkit.launch.launch_params import Nodes

TINY_CFG = tiny_cfg(max_steps_per_epoch=4, max_val_steps=1, timeout=60, pin_cpus=None)


def test_single_node_command_is_an_argument_list_on_loopback(tmp_path):
    cmd = torchrun_command(TrainConfig(method="ps", **TINY_CFG), 3, str(tmp_path))
    assert isinstance(cmd, list) and all(isinstance(a, str) for a in cmd)
    assert "--standalone" in cmd and "--local-addr=127.0.0.1" in cmd
    assert cmd[cmd.index("-m", 3) + 1] == "labkit.train"
    assert cmd[cmd.index("--method") + 1] == "ps" and "--no-progress" in cmd


def test_multi_node_options_pass_through(tmp_path):
    nodes = Nodes(nnodes=2, node_rank=1, rdzv_endpoint="10.0.0.5:29400")
    cmd = torchrun_command(TrainConfig(**TINY_CFG), 4, str(tmp_path), nodes)
    assert {"--nnodes=2", "--node-rank=1", "--rdzv-endpoint=10.0.0.5:29400", "--rdzv-backend=c10d"} <= set(cmd)
    assert "--local-addr=127.0.0.1" not in cmd


@pytest.mark.parametrize("kw,nproc,msg", [
    (dict(method="ps"), 1, "ps needs at least 2 processes"),
    (dict(dataset="imagefolder", data_dir="/no/such/dir"), 2, "does not exist"),
    (dict(batch_size=0), 2, "--batch-size must be at least 1"),
])
def test_bad_input_fails_before_spawning(tmp_path, kw, nproc, msg):
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=msg):
        launch(TrainConfig(**{**TINY_CFG, **kw}), nproc, str(tmp_path / "out"))
    assert time.monotonic() - t0 < 10
    assert not (tmp_path / "out").exists()  # nothing spawned, nothing written


def test_failed_rank_is_named_with_its_log(tmp_path, monkeypatch):
    """A real rank crashes mid-epoch (test-only fault switch): the launcher names that rank,
    not the peers that failed after it, and shows the last line of its log."""
    monkeypatch.setenv("LABKIT_TEST_FAULT", "ps:2:1")
    out = tmp_path / "ps"
    res = launch(TrainConfig(method="ps", **TINY_CFG), 3, str(out), stream=open(tmp_path / "stream.txt", "w"))
    assert not res.ok and res.returncode != 0
    assert res.failed_rank == 2
    # torchrun may record the crashed rank as SIGTERM when it stops it while it is exiting, or
    # lose its exit code, when only its error file tells (as test_experiment's failed ps once did)
    assert re.search(r"ps failed: rank 2 (exited with code 1|failed first \(torchrun then stopped it: "
                     r"exit code -15 \(SIGTERM\)\)|raised an exception \(known from its error file "
                     r"only\))", res.message), res.message
    assert "injected fault" in res.message
    # every rank's log is kept, and the partial result says what happened
    for r in range(3):
        assert list(out.glob(f"logs/**/attempt_0/{r}/stderr.log"))
    assert load_json(out / "results_ps.json")["status"] == "failed"
    assert load_json(out / "launch.json")["failed_rank"] == 2
    # the explanation rests on torchrun's error file of that rank
    assert res.explained_from and res.explained_from.endswith("/attempt_0/2/error.json")
    assert load_json(out / "launch.json")["explained_from"].endswith("/attempt_0/2/error.json")


def _rank_dir(log_dir, local_rank):
    d = log_dir / "run-id" / "attempt_0" / str(local_rank)
    d.mkdir(parents=True)
    return d


def test_error_file_names_the_rank_and_its_exception(tmp_path):
    """What a rank's error file says is what the message says, even when the console lost
    the failure summary and the rank's log is empty (a full disk); a rank that only lost
    its peer, and an empty error file, are not blamed."""
    from labkit.launch.failures import explain_failure

    first = _rank_dir(tmp_path, 1)
    (first / "error.json").write_text(json.dumps({"message": {
        "message": "ValueError: bad shard 7", "extraInfo": {"timestamp": "100"}}}))
    peer = _rank_dir(tmp_path, 0)
    (peer / "error.json").write_text(json.dumps({"message": {
        "message": "RuntimeError: Connection closed by peer", "extraInfo": {"timestamp": "99"}}}))
    (_rank_dir(tmp_path, 2) / "error.json").write_text("")  # half-written: skipped
    why = explain_failure("allreduce", 1, "torchrun crashed\n", str(tmp_path))
    assert why.rank == 1 and why.error_file == str(first / "error.json")
    assert why.message.startswith("allreduce failed: rank 1 raised an exception")
    assert "ValueError: bad shard 7" in why.message and "closed by peer" not in why.message


@pytest.mark.unit
def test_a_monitored_barrier_that_lost_its_peer_is_a_consequence():
    """ProcessGroupWrapper's words when the peer it waits for in a collective's fingerprint check
    is gone, with gloo's reason empty: seen on a 2-core AMD VM, where rank 1 raised in setup
    and rank 0 was blamed (test_broken_methods' check)."""
    from labkit.launch.failures import is_consequence

    lost = ("RuntimeError: ProcessGroupWrapper: Monitored Barrier encountered error running "
            "collective: CollectiveFingerPrint(SequenceNumber=0, OpType=BROADCAST, "
            "TensorShape=[64, 3, 3, 3], TensorDtypes=Float). Error: ")
    assert is_consequence(lost)
    assert is_consequence("RuntimeError: Rank 1 failed to pass monitoredBarrier in 600000 ms")
    assert not is_consequence("RuntimeError: cannot build the buckets on rank 1")


@pytest.mark.unit
def test_a_rank_that_raised_stood_where_it_raised_not_where_it_ended(tmp_path):
    """A rank that raised, then got torchrun's SIGTERM while its exit functions ran (the
    other rank had failed too), wrote two marks: it stood where it raised (a suite run named
    the warm process's run_main, where the exit functions ran, for a method's all_reduce)."""
    from labkit.core import stacks
    from labkit.launch.failures import collect

    raised = "/x/mine.py:19 (after_backward) in all_reduce"
    for rank in (0, 1):
        (_rank_dir(tmp_path, rank) / "error.json").write_text(json.dumps({"message": {
            "message": "RuntimeError: Detected mismatch", "extraInfo": {"timestamp": "100"}}}))
    (tmp_path / "run-id" / "attempt_0" / "0" / "stderr.log").write_text("\n".join([
        stacks.mark(0, "raised RuntimeError", raised), "labkit.train: error: it failed",
        stacks.mark(0, "stopped by SIGTERM", "/y/warm.py:410 (run_main), waiting in torch.x")]))
    (tmp_path / "run-id" / "attempt_0" / "1" / "stderr.log").write_text(
        stacks.mark(1, "stopped by SIGTERM", "/x/mine.py:30 (step), waiting in gloo"))
    where = {f.rank: f.where for f in collect("", str(tmp_path))}
    assert where == {0: raised, 1: "/x/mine.py:30 (step), waiting in gloo"}, where


def test_rank_prefix_only_where_torchrun_has_the_option(tmp_path, monkeypatch):
    """torch 2.11's torchrun has no --log-line-prefix-template: passed anyway, it became the
    script to run and every rank died (seen on an H100 box, 2026-11-23)."""
    from labkit.launch import torchrun_job as launch_mod

    assert launch_mod.torchrun_knows("--tee") and not launch_mod.torchrun_knows("--no-such-option")
    with_prefix = torchrun_command(TrainConfig(**TINY_CFG), 2, str(tmp_path))
    assert ("--log-line-prefix-template=[rank${rank}]: " in with_prefix) == launch_mod.torchrun_knows(
        "--log-line-prefix-template")
    monkeypatch.setattr(launch_mod, "torchrun_knows", lambda flag: False)
    cmd = torchrun_command(TrainConfig(**TINY_CFG), 2, str(tmp_path))
    assert not any(a.startswith("--log-line-prefix-template") for a in cmd)
    assert cmd[cmd.index("-m", 3) + 1] == "labkit.train" and "--tee=3" in cmd
