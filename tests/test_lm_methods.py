"""Every built-in method on the transformer language model (issue 69, items 2 and 3): each runs
on `--workload lm`, through the same loop and instruments as on images; the exact ones end
where the single-process reference with the workload's own optimizer (AdamW, its schedule) ends;
DDP's and the hand-written all-reduce's bytes per step agree, and equal the parameter bytes times
the ring's 2(n-1)/n; DiLoCo's inner optimizer is the workload's (AdamW's two moments per weight).

One run per method for the whole module (4 steps of the tiny model on 32-token windows), its
ranks forked from the worker's warm interpreter (tests/warm.py), as the equivalence runs are."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from helpers import check_ok, labkit, load_json
from warm import warm_run

pytestmark = pytest.mark.xdist_group("lm_runs")

STEPS, SEQ = 4, 32
LM = ["--workload", "lm", "--model", "tiny", "--seq-len", str(SEQ), "--batch-size", "8",
      "--epochs", "1", "--max-steps-per-epoch", str(STEPS), "--max-val-steps", "2",
      "--calibrate-steps", "2", "--no-progress", "--timeout", "120", "--no-pin-cpus",
      "--local-steps", "2", "--powersgd-start-iter", "2"]
# name -> (processes, flags): 2 trainers each (the parameter server's 3 processes too)
RUNS = {"ddp": (2, ["--method", "ddp"]),
        "allreduce": (2, ["--method", "allreduce", "--bucket-mb", "0.25"]),
        "ps": (3, ["--method", "ps"]),
        "nosync": (2, ["--method", "nosync"]),
        "localsgd": (2, ["--method", "localsgd"]),
        "diloco": (2, ["--method", "diloco"]),
        "powersgd": (2, ["--method", "powersgd"])}
EXACT = ("ddp", "allreduce", "ps")


@pytest.fixture(scope="module")
def lm_runs(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("lm")
    out = {}
    for name, (nproc, flags) in RUNS.items():
        check_ok(warm_run(nproc, LM + flags + ["--out", str(base / name)], cwd=base))
        out[name] = base / name
    return out


def _doc(folder: Path) -> dict:
    return load_json(next(folder.glob("results_*.json")))


def _param_bytes() -> int:
    """The tiny transformer's fp32 parameter bytes, counted from a model built here (its tied
    embedding once, as parameters() and every method see it)."""
    from labkit.core.config import TrainConfig
    from labkit.workloads import make_workload, resolve

    cfg = resolve(TrainConfig(workload="lm", model="tiny", seq_len=SEQ, batch_size=8), False, 2)
    return sum(p.numel() * 4 for p in make_workload(cfg).build_model().parameters())


@pytest.mark.parametrize("name", list(RUNS))
def test_every_built_in_method_trains_the_language_model(lm_runs, name):
    """Completed, judged by validation loss and perplexity (no accuracy anywhere), throughput in
    tokens: the workload's words, recorded in the file for the report."""
    doc = _doc(lm_runs[name])
    assert doc["status"] == "completed", doc.get("error")
    w = doc["workload"]
    assert (w["name"], w["unit"], w["rate"], w["units_per_sample"]) == ("lm", "tokens", "tokens/s", SEQ)
    assert [f["key"] for f in w["figures"]] == ["val_loss", "val_perplexity"]
    assert not any(f["higher_is_better"] for f in w["figures"])
    e = doc["epochs"][-1]
    assert e["val_perplexity"] == pytest.approx(torch.tensor(e["val_loss"]).exp().item(), rel=1e-6)
    assert e["train_accuracy"] is None and e.get("val_accuracy") is None
    assert "best_val_accuracy" not in doc["summary"]
    assert doc["summary"]["final_val_loss"] == e["val_loss"]
    # a step's tokens over its time: trainers x batch x window per steady-state step. The
    # throughput's window closes after the last step's mark (the step parts' close-out), so on
    # a busy machine a stall there counts in it and not in the steps: 12% of these runs' ~0.1 s
    # windows seen in a full-suite run. A wrong unit (a factor of trainers, batch or window) is
    # 2x or more.
    steady = e["step_times"]
    assert e["train_throughput"] == pytest.approx(2 * 8 * SEQ * len(steady) / sum(steady), rel=0.25)
    assert e["train_throughput"] <= 2 * 8 * SEQ * len(steady) / sum(steady) * 1.001


@pytest.mark.parametrize("name", EXACT)
def test_the_exact_methods_end_where_the_reference_with_adamw_ends(lm_runs, name):
    """The final parameters against one process taking the same steps with the gradients
    averaged exactly and AdamW at the scheduled learning rate (labkit check's reference)."""
    from labkit.core.config import TrainConfig
    from labkit.training.instruments import exactness
    from labkit.workloads import make_workload, resolve

    doc = _doc(lm_runs[name])
    cfg = resolve(TrainConfig(**{k: v for k, v in doc["config"].items() if k != "out"}), False,
                  doc["world_size"])
    assert cfg.lr == 0.003 and cfg.weight_decay == 0.1  # the workload's defaults, resolved
    reference = exactness.reference_state(cfg, 2, STEPS)
    final = torch.load(lm_runs[name] / "final_model.pt", map_location="cpu", weights_only=True)
    v = exactness.compare(final, reference)
    assert v.exact, v.line(name, STEPS, 2)
    # and not by chance: the model moved well beyond the tolerance from its initial weights
    torch.manual_seed(cfg.seed)
    start = make_workload(cfg).build_model().state_dict()
    assert not exactness.compare(start, reference).exact


def test_ddp_and_the_hand_written_all_reduce_move_the_rings_bytes(lm_runs):
    """Each of 2 ranks sends and receives 2(n-1)/n of the parameter bytes per step, in DDP's
    buckets and in the hand-written ones alike (within 1%)."""
    n, g = 2, _param_bytes()
    ddp, hand = (_doc(lm_runs[m])["epochs"][-1]["wire"] for m in ("ddp", "allreduce"))
    for key in ("sent_per_step", "received_per_step"):
        for a, b in zip(ddp[key], hand[key]):
            assert a == pytest.approx(b, rel=0.01), (key, a, b)
            assert a == pytest.approx(2 * (n - 1) / n * g, rel=0.01), (key, a, g)


def test_diloco_steps_the_workloads_adamw_inside(lm_runs):
    """DiLoCo's inner optimizer is the workload's AdamW, as the paper's: each rank holds its two
    moments per weight, as DDP's AdamW does (SGD's momentum would be one)."""
    g = _param_bytes()
    for name in ("ddp", "diloco"):
        held = _doc(lm_runs[name])["efficiency"]["optimizer_state_bytes"]
        assert all(h == pytest.approx(2 * g, rel=0.01) for h in held), (name, held, g)


def test_the_run_shows_the_text_it_learned_to_write(lm_runs):
    """The end of an lm run: samples of text after prompts from the validation text, in the
    result file and in the run's log, and the unigram entropy the loss is held against."""
    doc = _doc(lm_runs["ddp"])
    samples = doc["examples"]["samples"]
    assert len(samples) == 3 and all(s["prompt"] and len(s["text"]) > 0 for s in samples)
    ref = doc["workload"]["references"]
    (name, entropy), = ref.items()
    assert "unigram entropy" in name and 0 < entropy < math.log(256)  # 256 byte values at most
    log = (lm_runs["ddp"] / "train.log").read_text()
    assert f"against the {name}: {entropy:.4f}" in log and "sample: " in log


def test_labkit_check_says_ddp_is_exact_on_the_language_model(tmp_path):
    """`labkit check ddp --workload lm`: DDP beside its single-process reference with AdamW, at
    the workload's check size (DDP's constructor died of SIGSEGV under the check's collective
    debugging before the built-ins ran without it)."""
    p = labkit(["check", "ddp", "--workload", "lm"], cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    first, verdict = p.stdout.splitlines()[:2]
    assert "3 steps of the lm workload on 2 ranks" in first, p.stdout
    assert verdict.startswith("labkit check: ddp is exact: after 3 steps on 2 trainers"), p.stdout
