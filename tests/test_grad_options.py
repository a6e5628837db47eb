"""Gradient accumulation and clipping for every method (issue 86, items 1 and 2): K micro-batches
of B/K end where one batch of B ends, for each exact method (the single-process reference takes
the whole batch), with the global norm clipped where the reference clips it (torch's
clip_grad_norm_ on the averaged gradient); DDP communicates once per step, not once per
micro-batch, so its bytes per token fall by K; and a clipped run of a learning rate that
diverges unclipped stays finite.

One run per method, 3 steps of the tiny transformer, ranks forked from the worker's warm
interpreter (tests/warm.py)."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from helpers import TINY, check_ok, labkit, load_json
from warm import warm_run

pytestmark = pytest.mark.xdist_group("lm_runs")

STEPS, SEQ, BATCH, K, NORM = 3, 32, 8, 2, 0.5
COMMON = ["--epochs", "1", "--max-steps-per-epoch", str(STEPS), "--max-val-steps", "1",
          "--calibrate-steps", "0", "--no-progress", "--timeout", "120", "--no-pin-cpus"]
#: clipping on the transformer (AdamW), with K micro-batches
LM = ["--workload", "lm", "--model", "tiny", "--seq-len", str(SEQ), "--batch-size", str(BATCH),
      "--grad-accum", str(K), "--grad-clip", str(NORM), *COMMON]
#: accumulation alone on a model without BatchNorm stepped by SGD, where the loss's 1/K scale
#: shows in the step (AdamW's would not: it divides by the gradient's own scale, and so does
#: clipping when it engages)
MLP = f'''
import torch
from torch import nn
from torch.utils.data import TensorDataset
from labkit.workloads import Datasets, Workload


class Mlp(Workload):
    def datasets(self):
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(96, 5, generator=g), torch.randint(0, 3, (96,), generator=g)
        return Datasets(TensorDataset(x, y), TensorDataset(x[:16], y[:16]), in_memory=True)

    def build_model(self):
        return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3))
'''
ACCUM = ["--batch-size", str(BATCH), "--grad-accum", "4", "--lr", "0.5", *COMMON]
# name -> (processes, flags): 2 trainers each (the parameter server's 3 processes too)
# (ddp's --time-comm hook: its bytes counted in the communication hook, each bucket as the
# reducer hands it over, rather than from the gradients' size once a step)
METHODS = {"ddp": (2, ["--method", "ddp", "--time-comm", "hook"]),
           "allreduce": (2, ["--method", "allreduce", "--bucket-mb", "0.25"]),
           "ps": (3, ["--method", "ps"]),
           "zero3": (2, ["--method", "zero3"]),
           "fsdp": (2, ["--method", "fsdp"])}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[tuple[str, str], Path]:
    base = tmp_path_factory.mktemp("accum")
    (base / "mlp.py").write_text(MLP)
    out = {}
    for name, (nproc, flags) in METHODS.items():
        for kind, args in (("clip", LM), ("accum", ["--workload", str(base / "mlp.py") + ":Mlp",
                                                   *ACCUM])):
            folder = base / f"{kind}_{name}"
            check_ok(warm_run(nproc, args + flags + ["--out", str(folder)], cwd=base))
            out[kind, name] = folder
    return out


def _doc(folder: Path) -> dict:
    return load_json(next(folder.glob("results_*.json")))


def _reference(doc: dict, **over) -> dict:
    """The single-process reference of the run's own config (``over`` changed): each trainer's
    whole batch at once, the averaged gradient clipped by torch's clip_grad_norm_ where the
    config clips."""
    from labkit.core.config import TrainConfig
    from labkit.training.instruments import exactness
    from labkit.workloads import resolve

    c = {**{k: v for k, v in doc["config"].items() if k != "out"}, **over}
    return exactness.reference_state(resolve(TrainConfig(**c), False, doc["world_size"]), 2,
                                     STEPS)


def _final(folder: Path) -> dict:
    return torch.load(folder / "final_model.pt", map_location="cpu", weights_only=True)


@pytest.mark.parametrize("name", list(METHODS))
def test_k_micro_batches_end_where_the_whole_batch_ends(runs, name):
    """--grad-accum 4 with SGD: the final parameters equal the reference's, which takes each
    trainer's batch of 8 at once, within summation order; and not by chance: a reference whose
    batches are the micro-batches' 2 ends elsewhere."""
    from labkit.training.instruments import exactness

    doc = _doc(runs["accum", name])
    assert doc["status"] == "completed", doc.get("error")
    assert doc["config"]["grad_accum"] == 4 and not doc["config"]["grad_clip"]
    final = _final(runs["accum", name])
    v = exactness.compare(final, _reference(doc))
    assert v.exact, v.line(name, STEPS, 2)
    assert not exactness.compare(final, _reference(doc, batch_size=BATCH // 4, grad_accum=1)).exact


@pytest.mark.parametrize("name", list(METHODS))
def test_the_clipped_norm_is_the_synchronised_gradients(runs, name):
    """--grad-clip 0.5 on the transformer (with 2 micro-batches): the final parameters equal
    the reference's, whose averaged gradient torch's clip_grad_norm_ clips; clipping engaged
    in every step (the recorded norms), and the unclipped reference ends elsewhere."""
    from labkit.training.instruments import exactness

    doc = _doc(runs["clip", name])
    assert doc["status"] == "completed", doc.get("error")
    assert (doc["config"]["grad_accum"], doc["config"]["grad_clip"]) == (K, NORM)
    e = doc["epochs"][-1]
    assert e["clipped_steps"] == STEPS and e["grad_norm_max"] > NORM, e
    final = _final(runs["clip", name])
    v = exactness.compare(final, _reference(doc))
    assert v.exact, v.line(name, STEPS, 2)
    assert not exactness.compare(final, _reference(doc, grad_clip=0.0)).exact


def test_ddp_communicates_once_per_step_so_bytes_per_token_fall_by_k(runs):
    """DDP's wire per step is one all-reduce of the parameters (2(n-1)/n of their bytes, 1 on
    2 ranks), not one per micro-batch: a step of 4 micro-batches moves what a step of one
    moves, for 4 times the samples. Counted by the communication hook (--time-comm hook), as
    the reducer hands each bucket over."""
    doc = _doc(runs["accum", "ddp"])
    g = 4 * (5 * 16 + 16 + 16 * 3 + 3)  # the MLP's fp32 parameter bytes
    for key in ("sent_per_step", "received_per_step"):
        for b in doc["epochs"][-1]["wire"][key]:
            assert b == pytest.approx(g, rel=0.01), (key, b, g)


def test_a_clipped_run_of_a_diverging_learning_rate_stays_finite(tmp_path):
    """test_divergence's learning rate (the guide's ResNet on digits, SGD at lr 1000 diverges
    within 6 steps): clipped at norm 1, each step moves the weights by at most lr x 1, and the
    run completes with a finite loss."""
    out = tmp_path / "clipped"
    p = labkit(["run", "ddp", "--nproc", "2", "--lr", "1000", "--grad-clip", "1", "--epochs", "1",
                "--max-steps-per-epoch", "6", "--batch-size", "16", "--max-val-steps", "1",
                "--calibrate-steps", "0", "--no-progress", "--no-pin-cpus", "--timeout", "120",
                "--out", str(out)], tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    doc = _doc(out)
    e = doc["epochs"][-1]
    assert doc["status"] == "completed" and math.isfinite(e["train_loss"]), e
    assert e["clipped_steps"] >= 1, e


def test_bad_values_are_one_line(tmp_path):
    """Each one line, exit 2, no folder: micro-batches that do not divide the batch, a negative
    norm, and (issue 85, item 8) an option of another method, which ddp would ignore."""
    for flags, needle in ((["--grad-accum", "3", "--batch-size", "8"], "--grad-accum"),
                          (["--grad-clip", "-1"], "--grad-clip"),
                          (["--no-reshard-after-forward"], "--reshard-after-forward is an option "
                                                           "of fsdp, which ddp does not read")):
        p = labkit(["run", "ddp", "--nproc", "2", *flags, "--out", str(tmp_path / "x")], tmp_path)
        assert p.returncode == 2, p.stdout + p.stderr
        lines = [l for l in p.stderr.splitlines() if l.strip()]
        assert len(lines) == 1 and needle in lines[0], p.stderr
        assert not (tmp_path / "x").exists()
