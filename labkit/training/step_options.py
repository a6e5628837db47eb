"""Two options of a training step, both off unless asked for: ``--grad-accum K`` (the batch as
K micro-batches) and ``--grad-clip NORM`` (the global gradient norm clipped before the
optimizer's step). The loop (labkit.training.trainer) calls them where they fall in a step; like
the instruments, they are read where the step calls them (tools/reading_path.py), outside the
guide's step."""
from __future__ import annotations

from contextlib import nullcontext
from typing import Optional

import torch


def micro_batches(trainer, x: torch.Tensor, y: torch.Tensor):
    """The step's forward and backward as ``--grad-accum`` K micro-batches of batch/K, each
    loss scaled by 1/K (the gradients add up to the whole batch's mean, as nanoGPT's), all but
    the last inside the method's ``accumulating()`` (nothing communicated): the loop calls the
    method's before_forward once before the first, after_backward and step once after the last.
    Returns (the mean loss, every micro-batch's logits), detached, as one forward would."""
    k, s = trainer.cfg.grad_accum, trainer.strategy
    if x is None:  # a parameter server's server: no batch
        return None
    outs = []
    for i, (xi, yi) in enumerate(zip(x.chunk(k), y.chunk(k))):
        with nullcontext() if i == k - 1 else s.accumulating():
            outs.append(trainer.forward_backward(xi, yi, 1 / k))
    return torch.stack([o[0] for o in outs]).mean(), torch.cat([o[1] for o in outs])


def clip(trainer) -> None:
    """``--grad-clip``: the synchronised gradients' global norm clipped (the method's
    ``clip_gradients``: over every shard of a sharded method, at the server of a parameter
    server), on every rank, and the norm before clipping recorded."""
    s, c = trainer.strategy, trainer.cfg
    trainer.clip.add(s.clip_gradients(trainer.optimizer, c.grad_clip, trainer.scaler))


class ClipRecord:
    """The gradient norms --grad-clip measured this epoch (before clipping), on a rank that
    clips: what an epoch records of them."""

    def __init__(self):
        self.norms: list[float] = []

    def add(self, norm: Optional[float]) -> None:
        if norm is not None:
            self.norms.append(norm)

    def epoch(self, max_norm: float) -> dict:
        norms, self.norms = self.norms, []
        if not max_norm or not norms:
            return {}
        return {"grad_norm_mean": sum(norms) / len(norms), "grad_norm_max": max(norms),
                "clipped_steps": sum(n > max_norm for n in norms)}
