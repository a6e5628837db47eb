"""Parameter Server, the original guide's protocol (``--ps-mode p2p``), kept as the reference.

Rank 0 serves; ranks 1..N-1 train. Each step: (1) pull: the server sends every parameter
tensor to every worker, one ``send``/``recv`` per tensor and per worker; (2) workers run forward
and backward; (3) push: each worker sends every gradient tensor, the server receiving them
worker by worker for every parameter, (4) summing and averaging; (5) the server's SGD step.
Everything is blocking, so the pull and push times are exactly the time a worker waited.
"""
from __future__ import annotations

import torch
from torch import nn

from labkit.core.config import ConfigError

from .base import Strategy
from .ps_collective import SERVER, ServerRoles


class P2PParameterServer(ServerRoles, Strategy):
    def __init__(self, cfg, ctx):
        super().__init__(cfg, ctx)
        self.servers = 1  # strategy_class refuses --ps-servers > 1 with p2p

    @classmethod
    def check(cls, cfg, world: int) -> None:
        super().check(cfg, world)
        if cfg.channels_last:
            raise ConfigError("--channels-last is not supported with --ps-mode p2p (send/recv "
                              "need contiguous tensors); use --ps-mode collective")

    def setup(self, model: nn.Module) -> nn.Module:
        self.params = [p for p in model.parameters() if p.requires_grad]
        # the server accumulates each parameter's gradient from the workers in here
        self.recv_buf = [torch.empty_like(p) for p in self.params] if self.is_server else None
        for p in self.params:
            p.grad = torch.zeros_like(p)
        return model

    def zero_grad(self, optimizer) -> None:
        for p in self.params:
            p.grad.zero_()

    # (1) pull
    def before_forward(self) -> None:
        with self.timer("pull"):
            self._pull()

    def _pull(self) -> None:
        if self.is_server:
            for p in self.params:
                for w in range(1, self.ctx.world_size):
                    self.send(p.data, dst=w, phase="pull")
        else:
            for p in self.params:
                self.recv(p.data, src=SERVER, phase="pull")

    # (3) push and (4) average
    def after_backward(self) -> None:
        with self.timer("push"):
            self._push()

    def _push(self) -> None:
        if self.is_server:
            for p, buf in zip(self.params, self.recv_buf):
                for w in range(1, self.ctx.world_size):
                    self.recv(buf, src=w, phase="push")
                    p.grad.add_(buf)
                p.grad.div_(self.trainers)
        else:
            for p in self.params:
                self.send(p.grad, dst=SERVER, phase="push")

    # (5) the server's step is the Strategy default: only the server holds an optimizer
    def finish_epoch(self, model: nn.Module) -> None:
        self._pull()  # workers get the parameters after the epoch's last update
        super().finish_epoch(model)
