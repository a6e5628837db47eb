"""What every parameter-server protocol shares (p2p, collective, sharded, async), as a mixin and
helpers rather than one protocol inheriting another: the server/worker roles, the rules on the
options a parameter server takes, and the flat-buffer layout."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from labkit.core.config import ConfigError

SERVER = 0  # the (first) server's rank


class ServerRoles:
    """Roles of a parameter-server job, mixed into a Strategy: ranks 0..servers-1 serve (they
    hold the parameters and the optimizer), the others train. Needs ``self.servers`` and
    ``self.ctx``."""
    servers: int

    @classmethod
    def check(cls, cfg, world: int) -> None:
        if world <= cfg.ps_servers:
            need = cfg.ps_servers + 1
            raise ConfigError(f"ps needs at least {need} processes ({cfg.ps_servers} server"
                              f"{'s' if cfg.ps_servers > 1 else ''} + workers); got {world} (use "
                              f"{need} or more: --nproc with labkit, --nproc_per_node with torchrun)")
        if cfg.amp == "fp16":
            raise ConfigError("--amp fp16 is not supported with ps (the server would have to "
                              "unscale gradients); use --amp bf16")

    def describe(self) -> str:
        return f"{self.cfg.method} ({self.cfg.ps_mode})"

    def server_progress(self, step: int) -> str:
        """The server's progress bar: its own side of each phase, per step. Its push starts
        when it is ready for gradients, so it holds the workers' forward and backward; the
        epoch line's push (the workers' side) does not."""
        names = {"pull": "params", "push": "grads+compute"}
        t = {k: 1000 * v / (step + 1) for k, v in self.timer.totals.items()}
        return " ".join(f"{names.get(k, k)}={v:.0f}ms" for k, v in t.items())

    @property
    def trainers(self) -> int:
        return self.ctx.world_size - self.servers

    # report-quote: ps-trainer-index  (quoted in the report: labkit/analysis/report/implementation.py)
    @property
    def trainer_index(self) -> Optional[int]:
        return None if self.is_server else self.ctx.rank - self.servers

    @property
    def first_trainer(self) -> int:
        return self.servers

    # report-quote: ps-steps-optimizer  (quoted in the report: labkit/analysis/report/implementation.py)
    @property
    def steps_optimizer(self) -> bool:
        return self.is_server

    @property
    def is_server(self) -> bool:
        return self.ctx.rank < self.servers


def flatten(params: list[nn.Parameter], fp16: bool
            ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Parameters and gradients become views into one flat buffer each, laid out in the order
    of ``params``. Returns (flat parameters, flat gradients, the fp16 buffer a compressed push
    sends, or None)."""
    dev, dt = params[0].device, params[0].dtype
    n = sum(p.numel() for p in params)
    flat_params = torch.empty(n, dtype=dt, device=dev)
    flat_grads = torch.zeros(n, dtype=dt, device=dev)
    off = 0
    for p in params:
        k = p.numel()
        flat_params[off:off + k].copy_(p.data.reshape(-1))
        p.data = flat_params[off:off + k].view_as(p)
        p.grad = flat_grads[off:off + k].view_as(p)
        off += k
    half = torch.empty(n, dtype=torch.float16, device=dev) if fp16 else None
    return flat_params, flat_grads, half
