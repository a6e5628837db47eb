"""From one seed, the three methods with the same number of trainers take the same SGD steps.

Each method runs for real under torchrun (gloo, CPU) for 5 steps; its final parameters must
equal a single-process reference that runs each trainer's shard in turn and averages the
gradients (as PyTorch's own DDP tests check DDP), up to float32 summation order.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from conftest import EQUIVALENCE_RUNS as RUNS  # shared with the result-file tests
from conftest import load_json
from labkit.config import TrainConfig, resolve
from labkit.data import build_datasets, train_sampler
from labkit.models import build_model

STEPS = 5
TRAINERS = 2
# With 2 trainers on gloo/CPU the sums happen to be bit-identical (measured max abs diff 0.0,
# 2026-11-22); the tolerance leaves room for other summation orders (NCCL rings, more
# trainers), while a real semantic difference (a missing average, a skipped step) is orders of
# magnitude larger (test_reference_is_sensitive). lr is small so 5 steps stay in the stable
# regime where float rounding is not amplified.
ATOL, RTOL = 5e-5, 1e-4



def reference_state(trainers: int) -> dict:
    """Single process: each step, every trainer's batch in turn, gradients averaged, one SGD
    step; BatchNorm buffers are trainer 0's (DDP's default)."""
    torch.set_num_threads(1)  # as each torchrun rank (OMP_NUM_THREADS=1): same conv kernels
    cfg = resolve(TrainConfig(dataset="digits", model="resnet10_small", batch_size=8,
                                   lr=0.01), False)
    data = build_datasets(cfg)
    torch.manual_seed(cfg.seed)
    model, _ = build_model(cfg.model, data.num_classes)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                          weight_decay=cfg.weight_decay)
    iters = []
    for k in range(trainers):
        s = train_sampler(data.train, trainers, k, cfg.seed)
        s.set_epoch(1)
        iters.append(iter(DataLoader(data.train, batch_size=cfg.batch_size, sampler=s, drop_last=True)))
    params = [p for p in model.parameters()]
    model.train()
    for _ in range(STEPS):
        buffers = {n: b.clone() for n, b in model.named_buffers()}
        grads = [torch.zeros_like(p) for p in params]
        new_buffers = None
        for k in range(trainers):
            for n, b in model.named_buffers():
                b.copy_(buffers[n])
            x, y = next(iters[k])
            model.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            for g, p in zip(grads, params):
                g += p.grad / trainers
            if k == 0:
                new_buffers = {n: b.clone() for n, b in model.named_buffers()}
        for g, p in zip(grads, params):
            p.grad = g
        opt.step()
        for n, b in model.named_buffers():
            b.copy_(new_buffers[n])
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def runs(equivalence_runs):
    return equivalence_runs


@pytest.fixture(scope="module")
def reference():
    return reference_state(TRAINERS)


def _final(d) -> dict:
    return torch.load(d / "final_model.pt", weights_only=True)


def _max_diff(a: dict, b: dict, keys) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in keys)


@pytest.mark.parametrize("name", list(RUNS))
def test_method_matches_single_process_reference(runs, reference, name):
    final = _final(runs[name][0])
    assert set(final) == set(reference)
    for k, ref in reference.items():
        torch.testing.assert_close(final[k], ref, atol=ATOL, rtol=RTOL, msg=lambda m: f"{name}: {k}: {m}")


def test_reference_is_sensitive(reference):
    """The tolerance is tight enough to catch a real difference: training with one trainer
    (no averaging over two shards) must fall outside it, and training must move the weights."""
    params = [k for k in reference if "running" not in k and "num_batches" not in k]
    one = reference_state(1)
    assert _max_diff(one, reference, params) > 100 * ATOL
    torch.manual_seed(0)
    init, _ = build_model("resnet10_small", 10)
    assert _max_diff(init.state_dict(), reference, params) > 100 * ATOL


def test_methods_log_the_same_losses(runs):
    """Same batches, same weights: the per-step losses agree across methods too."""
    losses = {n: load_json(next(d.glob("results_*.json")))["all_losses"] for n, (d, _) in runs.items()}
    base = losses["ddp"]
    assert len(base) == STEPS
    for n, l in losses.items():
        assert l == pytest.approx(base, rel=1e-4, abs=1e-5), n
