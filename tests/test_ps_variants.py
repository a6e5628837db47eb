"""Parameter-server variants (issue 7) on real jobs (gloo, CPU; ranks forked from the worker's
warm interpreter, tests/warm.py): asynchronous PS with bounded staleness, and a sharded PS
stopped and resumed. (Sharded PS against the reference, its checkpoint and fp16 compression:
test_equivalence.)"""
from __future__ import annotations

import json

import pytest
import torch

from helpers import TINY, check_ok, load_json
from warm import warm_run
from labkit.core.config import ConfigError, TrainConfig
from labkit.workloads.images.models import build_model
from labkit.training.sync.ps_sharded import shard_bounds
from helpers import ATOL, RTOL, STEPS, reference_state  # the single-process reference


def _assert_matches(final: dict, reference: dict) -> None:
    assert set(final) == set(reference)
    for k, ref in reference.items():
        torch.testing.assert_close(final[k], ref, atol=ATOL, rtol=RTOL, msg=lambda m: f"{k}: {m}")


def _final(d) -> dict:
    return torch.load(d / "final_model.pt", weights_only=True)


def _trace(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_async_lockstep_is_synchronous_sgd(tmp_path):
    """S = 0: every worker's step t starts from the parameters after all of round t-1's
    gradients, and the server applies each gradient on arrival with lr / N. Without momentum
    and weight decay a round is then one synchronous SGD step on the averaged gradient, taken
    in N pieces: the run ends at the single-process reference that applies the same gradients
    in the server's arrival order (from its trace), bit for bit (measured). (Against the
    averaged reference the pieces' rounding, ~1e-7, is amplified by these first steps of
    training to ~1e-4, beyond the equivalence tolerance.)"""
    out, trace = tmp_path / "ssp0", tmp_path / "trace.jsonl"
    check_ok(warm_run(3, TINY + ["--method", "ps", "--ps-staleness", "0", "--momentum", "0",
                                 "--weight-decay", "0", "--out", str(out)], cwd=tmp_path,
                      env={"LABKIT_TEST_TRACE": str(trace)}))
    applied = [ev for ev in _trace(trace) if ev["event"] == "apply"]
    # lock-step: round t is both workers' gradient t, before any of round t+1
    rounds = [applied[i:i + 2] for i in range(0, len(applied), 2)]
    assert len(rounds) == STEPS
    for t, r in enumerate(rounds):
        assert sorted(ev["rank"] for ev in r) == [1, 2] and {ev["step"] for ev in r} == {t}, r
    order = [[ev["rank"] - 1 for ev in r] for r in rounds]  # trainer index = rank - 1
    _assert_matches(_final(out), reference_state(2, order=order, momentum=0.0, weight_decay=0.0))
    e = load_json(out / "results_ps.json")["epochs"][0]
    assert e["max_staleness_observed"] == 0 and e["staleness_histogram"] == [2 * STEPS]
    # on the wire, per step: each worker asks (one int64), pulls the parameters and pushes
    # its gradients (counted by the lab; the server's per-step figures depend on which of its
    # iterations a message arrives in, so only the workers' are exact)
    model_bytes = sum(p.numel() * 4 for p in build_model("resnet10_small", 10)[0].parameters())
    w = e["wire"]
    assert w["trainer"] == [False, True, True]
    for r in (1, 2):
        assert w["sent_per_step"][r] == pytest.approx(model_bytes + 8)
        assert w["received_per_step"][r] == pytest.approx(model_bytes)
        assert w["by_phase"]["push"]["sent"][r] == pytest.approx(model_bytes)
    assert w["sent_per_step"][0] > 0 and w["received_per_step"][0] > 0


@pytest.mark.slow  # not in make test-fast (not a method's exactness or bytes)
def test_async_staleness_bound_is_reached_and_never_exceeded(tmp_path):
    """S = 2 with worker rank 1 slowed down: the other worker runs ahead until the bound holds
    it back. Replaying the server's trace of grants and applied gradients checks every grant:
    it starts the worker's next step, and that step is at most S ahead of the slowest
    worker's applied gradients -- and exactly S at least once (the bound was active)."""
    S, steps = 2, 6
    out, trace = tmp_path / "ssp2", tmp_path / "trace.jsonl"
    env = {"LABKIT_TEST_SLOW": "1:0.4", "LABKIT_TEST_TRACE": str(trace)}
    check_ok(warm_run(3, TINY + ["--method", "ps", "--ps-staleness", str(S), "--max-steps-per-epoch",
                                 str(steps), "--compress", "fp16", "--out", str(out)],
                      cwd=tmp_path, env=env))
    done = {1: 0, 2: 0}  # gradients applied per worker rank
    gaps = []
    for ev in _trace(trace):
        assert ev["step"] == done[ev["rank"]], ev  # requests and gradients in order
        if ev["event"] == "grant":
            assert ev["slowest"] == min(done.values()), ev
            gaps.append(ev["step"] - min(done.values()))
        else:
            done[ev["rank"]] += 1
    assert done == {1: steps, 2: steps} and len(gaps) == 2 * steps
    assert max(gaps) == S and min(gaps) >= 0, gaps
    r = load_json(out / "results_ps.json")
    e = r["epochs"][0]
    assert e["max_staleness_observed"] == S
    assert sum(e["staleness_histogram"]) == 2 * steps
    assert r["status"] == "completed" and all(0 < l < 10 for l in r["all_losses"])


@pytest.mark.slow  # not in make test-fast (not a method's exactness or bytes)
def test_sharded_ps_resumes_to_the_same_parameters(tmp_path):
    """2 servers + 1 worker, stopped after epoch 1 and resumed for epoch 2: rank 0's
    checkpoint holds both servers' momentum slices, the resumed servers take theirs back,
    and the run ends at the single-process reference's parameters after 2 epochs."""
    out = tmp_path / "sharded"
    args = TINY + ["--method", "ps", "--ps-servers", "2", "--out", str(out)]
    check_ok(warm_run(3, args, cwd=tmp_path))
    check_ok(warm_run(3, args + ["--epochs", "2", "--resume"], cwd=tmp_path))
    _assert_matches(_final(out), reference_state(1, epochs=2))
    r = load_json(out / "results_ps.json")
    assert [e["epoch"] for e in r["epochs"]] == [1, 2] and r["resumed"][0]["at_epoch"] == 2


def test_shards_cover_the_parameters_once():
    for n, k in ((10, 3), (7, 7), (4_900_000, 2), (5, 1)):
        b = shard_bounds(n, k)
        assert b[0][0] == 0 and b[-1][1] == n and len(b) == k
        assert all(hi == lo2 for (_, hi), (lo2, _) in zip(b, b[1:]))
        assert max(hi - lo for lo, hi in b) - min(hi - lo for lo, hi in b) <= 1


@pytest.mark.parametrize("kw, needle", [
    (dict(ps_staleness=1, ps_mode="p2p"), "drop --ps-mode p2p"),
    (dict(compress="fp16", ps_mode="p2p"), "--ps-mode collective"),
    (dict(ps_staleness=1, ps_servers=2), "one server"),
    (dict(ps_servers=2, ps_mode="p2p"), "collective"),
    (dict(ps_staleness=-1), "0 or more"),
])
def test_variant_flags_that_do_not_combine(kw, needle):
    """Refused before any process starts (the strategy classes' rules, checked in preflight)."""
    from labkit.training.preflight import preflight

    with pytest.raises(ConfigError, match=needle):
        preflight(TrainConfig(method="ps", backend="gloo", **kw), world=4, local_world=4)


def test_buckets_start_strictly_in_order():
    """Bucket 1 filling first starts nothing; bucket 0 completing then starts 0 and 1; rest()
    gives what is left after backward, and reset() starts a new step."""
    from labkit.training.sync.buckets import InOrder

    o = InOrder([2, 1, 2])
    assert list(o.ready(1)) == []
    assert list(o.ready(0)) == []
    assert list(o.ready(0)) == [0, 1]
    assert list(o.ready(2)) == []
    assert list(o.rest()) == [2] and list(o.rest()) == []
    o.reset()
    assert list(o.ready(0)) == [] and list(o.ready(0)) == [0]
