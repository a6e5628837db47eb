"""Is a method exact? Its parameters after a few steps beside those of a single process that
takes the same steps with the gradients averaged exactly (labkit check, and before a method of
one's own that claims exactness is measured).

The reference: one process, each step every trainer's batch in turn (trainer k reads shard k,
as the loop's DistributedSampler gives it), the gradients averaged over the trainers, one step
of the workload's optimizer (SGD for images, AdamW for lm) at its scheduled learning rate; BatchNorm buffers are the first trainer's (DDP's default). An exact method differs from
it only by the order of floating-point sums, far inside the tolerance below; a method that
drops an average or a parameter differs by orders of magnitude more.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from labkit.core.config import TrainConfig
from labkit.training.data import train_sampler
from labkit.workloads import checks, make_workload

# summation order on float32: a few ulps per step, compounded over a few steps at a small lr
ATOL, RTOL = 5e-5, 1e-4


def reference_state(cfg: TrainConfig, trainers: int, steps: int,
                    dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The model after ``steps`` steps of epoch 1 (``cfg`` resolved; its workload, lr, momentum,
    weight decay and seed; the schedule over one epoch of ``steps``), as a state dict. ``dtype`` torch.float64 computes it in double precision
    (the tests' statements about arithmetic that is exact only in exact arithmetic)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank runs: the same convolution kernels
    try:
        w = make_workload(cfg)
        data = checks.samples(w)
        torch.manual_seed(cfg.seed)
        model = w.build_model()
        model.to(dtype)
        opt = w.optimizer(model.parameters())
        batches = trainer_batches(data.train, cfg, trainers)
        model.train()
        for i in range(steps):
            lr = w.lr_at(i, cfg.epochs * steps)
            if lr is not None:
                for group in opt.param_groups:
                    group["lr"] = lr
            exact_step(model, opt, [(x.to(dtype) if x.is_floating_point() else x, y)
                                    for x, y in (next(b) for b in batches)], w.loss,
                       cfg.grad_clip)
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    finally:
        torch.set_num_threads(threads)


def trainer_batches(train, cfg: TrainConfig, trainers: int) -> list:
    """Epoch 1's batches of each trainer (an iterator each): trainer k reads shard k, as the
    loop's DistributedSampler gives it."""
    out = []
    for k in range(trainers):
        sampler = train_sampler(train, trainers, k, cfg.seed)
        sampler.set_epoch(1)
        out.append(iter(DataLoader(train, batch_size=cfg.batch_size, sampler=sampler, drop_last=True)))
    return out


def exact_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batches: list,
               loss=F.cross_entropy, max_norm: float = 0.0) -> None:
    """One exact data-parallel step on one process: each trainer's batch from the same start
    (buffers reset between them), the gradients averaged (their global norm clipped at
    ``max_norm`` by torch's clip_grad_norm_, where --grad-clip asks), one optimizer step, the first
    trainer's buffers kept (DDP broadcasts rank 0's): the update every exact method must
    reproduce up to summation order; the tests' reference runs it too."""
    params = list(model.parameters())
    start = {n: b.clone() for n, b in model.named_buffers()}
    mean = [torch.zeros_like(p) for p in params]
    first = None
    for k, (x, y) in enumerate(batches):
        for n, b in model.named_buffers():
            b.copy_(start[n])
        model.zero_grad(set_to_none=True)
        loss(model(x), y).backward()
        for m, p in zip(mean, params):
            m += p.grad / len(batches)  # DDP's order: divide, then sum
        if k == 0:
            first = {n: b.clone() for n, b in model.named_buffers()}
    for p, m in zip(params, mean):
        p.grad = m
    if max_norm:
        torch.nn.utils.clip_grad_norm_(params, max_norm)
    opt.step()
    for n, b in model.named_buffers():
        b.copy_(first[n])


@dataclass
class Verdict:
    exact: bool
    # the tensor furthest beyond the tolerance (a mistake shows first, and most, in the tensor
    # it was made in; after a few steps it spreads to the others, by less)
    first: Optional[str]
    difference: float          # its largest absolute difference; else the largest of all

    def line(self, method: str, steps: int, trainers: int) -> str:
        if self.exact:
            return (f"{method} is exact: after {steps} steps on {trainers} trainers every "
                    f"parameter equals the single-process reference within summation order "
                    f"(largest difference {self.difference:.1e})")
        return (f"{method} is not exact: after {steps} steps on {trainers} trainers parameter "
                f"{self.first} differs from the single-process reference by {self.difference:.3g} "
                f"(summation order allows {ATOL:g} + {RTOL:g} x |value|)")


def compare(final: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> Verdict:
    """The tensor of ``reference`` missing from ``final`` or furthest beyond the tolerance
    (its difference over what summation order allows); else exact, with the largest
    difference of all."""
    largest, worst, excess = 0.0, None, 1.0
    for name, ref in reference.items():
        got = final.get(name)
        if got is None or got.shape != ref.shape:
            return Verdict(False, name, float("inf"))
        diff = (got.double() - ref.double()).abs()
        if not diff.numel():
            continue
        ratio = (diff / (ATOL + RTOL * ref.double().abs())).max().item()
        if ratio > excess:
            worst, excess = name, ratio
        largest = max(largest, diff.max().item())
    if worst is not None:
        diff = (final[worst].double() - reference[worst].double()).abs().max().item()
        return Verdict(False, worst, diff)
    return Verdict(True, None, largest)
