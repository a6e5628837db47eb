"""A ZeRO-1 style sharded optimizer (Rajbhandari et al., SC 2020, stage 1), written only through
labkit's public method interface (docs/methods.md):

    labkit check examples/methods/zero1.py:ShardedOptimizer
    labkit experiment --methods ddp,examples/methods/zero1.py:ShardedOptimizer

Every rank holds the whole model, but the optimizer's state (SGD's momentum) only for its
1/n slice of the flattened parameters. Per step:

1. the gradients, divided by n, are reduce-scattered: rank r receives the sum of slice r;
2. rank r takes the SGD step (weight decay, momentum) for its slice only;
3. the updated slices are all-gathered, so every rank holds every parameter again.

Reduce-scatter plus all-gather move the bytes of one ring all-reduce, so the wire carries what
DDP's does, while the momentum per rank is 1/n of DDP's. The step is SGD's own arithmetic
(torch.optim.SGD, no dampening or Nesterov), so the method is exact: `labkit check` compares it
with the single-process reference. (The loop's own optimizer is never stepped here, so it holds
no state; a checkpoint therefore carries no momentum, and a resumed run restarts it.)
"""
from __future__ import annotations

import torch
from torch import nn

from labkit.training.sync import Strategy, broadcast_parameters


class ShardedOptimizer(Strategy):
    title = "ZeRO-1 (sharded optimizer)"
    exact = True
    phases = ("comm",)

    def setup(self, model: nn.Module) -> nn.Module:
        broadcast_parameters(model)
        self.params = [p for p in model.parameters() if p.requires_grad]
        n, r = self.ctx.world_size, self.ctx.rank
        self.numel = sum(p.numel() for p in self.params)
        self.slice = -(-self.numel // n)  # padded, so every rank's slice is the same size
        device = self.params[0].device
        self.flat = torch.zeros(self.slice * n, device=device)  # every parameter, flattened
        self.grads = torch.zeros_like(self.flat)
        self.grad_slice = torch.zeros(self.slice, device=device)
        self.mine = slice(r * self.slice, (r + 1) * self.slice)
        self.momentum = None  # this rank's slice of SGD's momentum: 1/n of DDP's
        self._flatten([p.data for p in self.params], self.flat)
        return model

    def _flatten(self, tensors: list, into: torch.Tensor) -> None:
        torch.cat([t.reshape(-1) for t in tensors], out=into[:self.numel])

    def after_backward(self) -> None:
        if not self.sync:
            return
        n = self.ctx.world_size
        with self.timer("comm"):
            self._flatten([p.grad for p in self.params], self.grads)
            self.grads.div_(n)  # DDP's order: divide, then sum
            if n > 1:
                self.reduce_scatter(self.grad_slice, self.grads)
            else:
                self.grad_slice.copy_(self.grads)

    def step(self, optimizer, scaler=None) -> None:
        if not self.sync:  # compute-only steps (labkit bench, calibration): the loop's optimizer
            return super().step(optimizer, scaler)
        c = self.cfg
        w = self.flat[self.mine]
        d = self.grad_slice.add(w, alpha=c.weight_decay) if c.weight_decay else self.grad_slice
        if c.momentum:
            if self.momentum is None:
                self.momentum = d.clone()
            else:
                self.momentum.mul_(c.momentum).add_(d)
            d = self.momentum
        w.add_(d, alpha=-c.lr)
        with self.timer("comm"):
            if self.ctx.world_size > 1:
                self.all_gather(self.flat, w.clone())
        offset = 0
        for p in self.params:
            p.data.copy_(self.flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()

    def optimizer_state(self, optimizer) -> list:
        """The optimizer state this rank holds, which the lab counts for the report (DDP's SGD
        holds every parameter's momentum; this rank only its slice's)."""
        return [self.momentum] if self.momentum is not None else []
