"""Parameter Server: rank 0 holds the parameters and the optimizer, ranks 1..N-1 train.

Each step: (1) pull: the server sends the current parameters to every worker; (2) workers run
forward and backward on their own batches; (3) push: workers send their gradients to the
server, which (4) averages them and (5) applies the SGD step.

Two protocols:
- ``p2p``: the original guide's, one ``send``/``recv`` per parameter tensor and per worker,
  with the server looping over the workers for every parameter. Kept as the reference.
- ``collective``: the guide's own proposed improvement. Parameters and gradients live in one
  flat buffer each (parameters and ``.grad`` are views into them), so a pull is one broadcast
  and a push is one reduce to rank 0.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from .base import Strategy

SERVER = 0


class PSStrategy(Strategy):
    phases = ("pull", "push")

    @property
    def trainers(self) -> int:
        return self.ctx.world_size - 1

    @property
    def trainer_index(self) -> Optional[int]:
        return None if self.ctx.rank == SERVER else self.ctx.rank - 1

    @property
    def first_trainer(self) -> int:
        return 1

    @property
    def steps_optimizer(self) -> bool:
        return self.ctx.rank == SERVER

    @property
    def is_server(self) -> bool:
        return self.ctx.rank == SERVER

    def setup(self, model: nn.Module) -> nn.Module:
        self.params = [p for p in model.parameters() if p.requires_grad]
        if self.cfg.ps_mode == "collective":
            dev, dt = self.params[0].device, self.params[0].dtype
            n = sum(p.numel() for p in self.params)
            self.flat_params = torch.empty(n, dtype=dt, device=dev)
            self.flat_grads = torch.zeros(n, dtype=dt, device=dev)
            off = 0
            for p in self.params:
                k = p.numel()
                self.flat_params[off:off + k].copy_(p.data.reshape(-1))
                p.data = self.flat_params[off:off + k].view_as(p)
                p.grad = self.flat_grads[off:off + k].view_as(p)
                off += k
        else:
            # the server accumulates each parameter's gradient from the workers in here
            self.recv_buf = [torch.empty_like(p) for p in self.params] if self.is_server else None
            for p in self.params:
                p.grad = torch.zeros_like(p)
        return model

    def zero_grad(self, optimizer) -> None:
        if self.cfg.ps_mode == "collective":
            self.flat_grads.zero_()  # the server's zeros are its contribution to the reduce
        else:
            for p in self.params:
                p.grad.zero_()

    # (1) pull
    def before_forward(self) -> None:
        with self.timer("pull"):
            self.pull()

    def pull(self) -> None:
        if self.cfg.ps_mode == "collective":
            dist.broadcast(self.flat_params, src=SERVER)
        elif self.is_server:
            for p in self.params:
                for w in range(1, self.ctx.world_size):
                    dist.send(p.data, dst=w)
        else:
            for p in self.params:
                dist.recv(p.data, src=SERVER)

    # (3) push and (4) average
    def after_backward(self) -> None:
        with self.timer("push"):
            if self.cfg.ps_mode == "collective":
                dist.reduce(self.flat_grads, dst=SERVER, op=dist.ReduceOp.SUM)
                if self.is_server:
                    self.flat_grads.div_(self.trainers)
            elif self.is_server:
                for p, buf in zip(self.params, self.recv_buf):
                    for w in range(1, self.ctx.world_size):
                        dist.recv(buf, src=w)
                        p.grad.add_(buf)
                    p.grad.div_(self.trainers)
            else:
                for p in self.params:
                    dist.send(p.grad, dst=SERVER)

    # (5) the server's step is the Strategy default (only the server holds an optimizer)

    def finish_epoch(self, model: nn.Module) -> None:
        self.pull()  # workers get the parameters after the epoch's last update
        super().finish_epoch(model)
