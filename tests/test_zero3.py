"""The fully sharded method written by hand, zero3 (issue 85, item 2), and ZeRO-1 stepping the
workload's own optimizer (item 3): zero3 ends where the single-process reference ends with
AdamW (lm) and with SGD (images), moves 1.5 times DDP's bytes as it declares, holds half of
the parameters and of DDP's optimizer state on each of 2 ranks, and continues from a checkpoint
to the same parameters; ZeRO-1 is exact with AdamW.

One run per case for the whole module (4 steps of the tiny transformer, or TINY's 5 steps of
the digits), its ranks forked from the worker's warm interpreter (tests/warm.py)."""
from __future__ import annotations

import runpy
import shutil
from pathlib import Path

import pytest
import torch

from helpers import ATOL, ROOT, RTOL, TINY, check_ok, load_json, reference_state
from warm import warm_run

pytestmark = pytest.mark.xdist_group("zero3_runs")

STEPS, SEQ, N = 4, 32, 2
LM = ["--workload", "lm", "--model", "tiny", "--seq-len", str(SEQ), "--batch-size", "8",
      "--epochs", "1", "--max-steps-per-epoch", str(STEPS), "--max-val-steps", "2",
      "--no-progress", "--timeout", "120", "--no-pin-cpus"]
ZERO1 = f"{ROOT / 'examples' / 'methods' / 'zero1.py'}:ShardedOptimizer"
RUNS = {"lm": LM + ["--method", "zero3"],
        "zero1_lm": LM + ["--method", ZERO1, "--calibrate-steps", "0"],
        "images": TINY + ["--method", "zero3"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Each of RUNS, and "resumed": a copy of the images run continued for a second epoch."""
    base = tmp_path_factory.mktemp("zero3")
    out = {}
    for name, flags in RUNS.items():
        check_ok(warm_run(N, flags + ["--out", str(base / name)], cwd=base))
        out[name] = base / name
    shutil.copytree(base / "images", base / "resumed")
    check_ok(warm_run(N, RUNS["images"] + ["--out", str(base / "resumed"), "--epochs", "2",
                                           "--resume"], cwd=base))
    out["resumed"] = base / "resumed"
    return out


def _doc(folder: Path) -> dict:
    return load_json(next(folder.glob("results_*.json")))


def _config(doc: dict):
    from labkit.core.config import TrainConfig
    from labkit.training.sync import load_method
    from labkit.workloads import resolve

    load_method(doc["config"]["method"])  # a method of one's own: registered as a run loads it
    return resolve(TrainConfig(**{k: v for k, v in doc["config"].items() if k != "out"}), False, N)


def _model(cfg) -> torch.nn.Module:
    from labkit.workloads import make_workload

    torch.manual_seed(cfg.seed)
    return make_workload(cfg).build_model()


def _param_bytes(cfg) -> int:
    """fp32 parameter bytes, the tied embedding once (as parameters() and DDP see it)."""
    return sum(p.numel() * 4 for p in _model(cfg).parameters())


@pytest.mark.warm
@pytest.mark.parametrize("name", ["lm", "zero1_lm"])
def test_zero3_and_zero1_end_where_the_reference_with_adamw_ends(runs, name):
    """The final parameters against one process taking the same steps with the gradients
    averaged exactly and the workload's AdamW at its scheduled learning rate; the model moved
    well beyond the tolerance from its start."""
    from labkit.training.instruments import exactness

    doc = _doc(runs[name])
    assert doc["status"] == "completed" and doc["method_spec"]["exact"], doc.get("error")
    cfg = _config(doc)
    reference = exactness.reference_state(cfg, N, STEPS)
    final = torch.load(runs[name] / "final_model.pt", map_location="cpu", weights_only=True)
    v = exactness.compare(final, reference)
    assert v.exact, v.line(name, STEPS, N)
    assert not exactness.compare(_model(cfg).state_dict(), reference).exact


@pytest.mark.warm
def test_zero3_ends_where_the_reference_with_sgd_ends_and_resumes_there(runs):
    """Images (SGD with momentum): after TINY's epoch, and after a second epoch resumed from its
    checkpoint, whose optimizer state is SGD's own format (each momentum in its parameter's
    shape: a plain model's SGD loads it)."""
    for name, epochs in (("images", 1), ("resumed", 2)):
        final = torch.load(runs[name] / "final_model.pt", weights_only=True)
        for k, ref in reference_state(N, epochs=epochs).items():
            torch.testing.assert_close(final[k], ref, atol=ATOL, rtol=RTOL,
                                       msg=lambda m: f"{name} {k}: {m}")
    doc = _doc(runs["resumed"])
    assert [e["epoch"] for e in doc["epochs"]] == [1, 2] and doc["resumed"][0]["at_epoch"] == 2
    ckpt = torch.load(runs["resumed"] / "checkpoint.pt", weights_only=True)
    plain = _model(_config(doc))
    plain.load_state_dict(ckpt["model"])
    sgd = torch.optim.SGD(plain.parameters(), lr=0.01, momentum=0.9)
    sgd.load_state_dict(ckpt["optimizer"])
    assert all(sgd.state[p]["momentum_buffer"].shape == p.shape for p in plain.parameters())


@pytest.mark.warm
def test_zero3_moves_one_and_a_half_times_ddps_bytes_as_it_declares(runs, ddp_run):
    """Each rank sends and receives the parameters twice (all-gathers) and the gradients once
    (reduce-scatter), (n-1)/n of them each: its declared bytes_per_step through a ring's
    2(n-1)/n, and 1.5 times DDP's measured all-reduce (images) or the ring's 2(n-1)/n of the
    parameter bytes that DDP measures on lm (tests/test_lm_methods.py)."""
    from labkit.training.sync.zero3 import ManualFullySharded

    doc = _doc(runs["lm"])
    g, ring = _param_bytes(_config(doc)), 2 * (N - 1) / N
    declared = ManualFullySharded.bytes_per_step(_config(doc), g)[0] * ring
    wire = doc["epochs"][-1]["wire"]
    for key in ("sent_per_step", "received_per_step"):
        assert wire[key] == [pytest.approx(declared, rel=1e-3)] * N, (key, wire[key], declared)
        assert wire[key][0] == pytest.approx(1.5 * ring * g, rel=1e-3)
    phases = wire["by_phase"]
    assert phases["gather"]["sent"][0] == pytest.approx(2 * phases["reduce"]["sent"][0], rel=1e-3)
    ddp = load_json(ddp_run / "results_baseline_ddp.json")["epochs"][-1]["wire"]
    images = _doc(runs["images"])["epochs"][-1]["wire"]
    for mine, theirs in zip(images["sent_per_step"], ddp["sent_per_step"]):
        assert mine / theirs == pytest.approx(1.5, rel=1e-3)


@pytest.mark.warm
def test_zero3_holds_half_of_the_parameters_and_of_ddps_optimizer_state(runs, ddp_run):
    """On 2 ranks: the optimizer state the lab counts is half of DDP's (AdamW's two moments per
    weight on lm, SGD's momentum on images; the step counts are per parameter); the parameters
    held between steps, measured from the live storage, are half; the most gathered at once is
    the root and the largest block, as memory_per_rank declares."""
    from labkit.training.sync.zero3 import ManualFullySharded, unit_params
    from labkit.workloads import make_workload

    doc = _doc(runs["lm"])
    cfg = _config(doc)
    g, model = _param_bytes(cfg), _model(cfg)
    steps = 4 * len(list(model.parameters()))  # AdamW's step, a float per parameter
    assert doc["efficiency"]["optimizer_state_bytes"] == [g + steps] * N  # DDP's: 2 g + steps
    ddp = load_json(ddp_run / "results_baseline_ddp.json")["efficiency"]["optimizer_state_bytes"]
    for mine, theirs in zip(_doc(runs["images"])["efficiency"]["optimizer_state_bytes"], ddp):
        assert mine == pytest.approx(theirs / 2, abs=4 * 16)  # padding: under a float a unit
    e = doc["epochs"][-1]
    assert e["parameter_bytes_held"] == pytest.approx(g / N, abs=4 * 8)
    units = {m: 4 * sum(p.numel() for p in ps)
             for m, ps in unit_params(model, make_workload(cfg).shard_units(model))}
    root = units.pop(model)
    assert len(units) == 2 and e["gathered_bytes_peak"] == root + max(units.values())
    held = ManualFullySharded.memory_per_rank(cfg, g // 4, 2, N)
    assert held[0].parameters == g / N + e["gathered_bytes_peak"] and held[0].optimizer == g
    # measured by the lab (labkit.training.instruments.memory), against the model the run
    # recorded, which declares the most a step holds: the shard between steps, the shard and
    # what zero3 itself counts as gathered at most in a step, and in all within 10% of the model
    mem, declared = e["memory"], doc["memory_model"]
    assert declared["parameters"] == [held[0].parameters] * N and declared["values"] == g // 4
    for r in range(N):
        assert mem["parameters"][r] == pytest.approx(g / N, abs=4 * 8)
        assert mem["step_parameters"][r] == pytest.approx(g / N + e["gathered_bytes_peak"], abs=4 * 8)
        measured = sum(mem[k][r] for k in ("step_parameters", "step_gradients", "optimizer"))
        modelled = sum(declared[k][r] for k in ("parameters", "gradients", "optimizer"))
        assert measured == pytest.approx(modelled, rel=0.10), (mem, declared)


@pytest.mark.unit
def test_one_step_of_zero3_reads_within_300_lines():
    """tools/reading_path.py on zero3: its step (the loop's, its hooks, its gathers and
    reduce-scatters) in at most 300 lines, none of set-up or of the checkpoint's gathering."""
    r = runpy.run_path(str(ROOT / "tools" / "reading_path.py"))["reading_path"](str(ROOT), "zero3")
    read = r["functions"]
    assert r["lines"] <= 300, r
    for f in ("_gather", "_after_forward", "_grad_ready", "_reduce", "after_backward"):
        assert f"labkit.training.sync.zero3:ManualFullySharded.{f}" in read, sorted(read)
    assert not [f for f in read if f.split(".")[-1] in ("setup", "full_state", "_shard")], sorted(read)


@pytest.mark.unit
@pytest.mark.parametrize("kw, world, needle", [
    ({}, 1, "at least 2 processes"),
    ({"compile": True}, 2, "without --compile"),
    ({"amp": "fp16"}, 2, "--amp bf16 runs"),
    ({"compress": "fp16"}, 2, "--compress fp16"),
])
def test_what_zero3_cannot_run_is_refused_before_anything_starts(kw, world, needle):
    """One process (nothing to shard), --compile (its hooks free storage), --amp fp16 (a scaler
    per shard would skip one rank's step alone), --compress: refused in preflight, one line."""
    from labkit.core.config import TrainConfig
    from labkit.core.errors import ConfigError
    from labkit.training.preflight import preflight

    with pytest.raises(ConfigError, match=needle):
        preflight(TrainConfig(method="zero3", backend="gloo", **kw), world=world, local_world=world)
