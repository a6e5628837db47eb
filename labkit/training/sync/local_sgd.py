"""``--method localsgd``: local SGD (Stich, ICLR 2019; Lin et al., "Don't use large
mini-batches, use local SGD", ICLR 2020). Every rank takes ``--local-steps`` H steps with its own
optimizer on its own batches, with no gradient communication, then the ranks replace their
parameters by the mean over the ranks: one all-reduce of every parameter (fp32) per H steps,
through the lab's helper, so it is timed and its bytes counted like any method's.

- Each rank keeps its own momentum (never communicated). SGD's momentum and weight decay are
  linear in the gradients, so with H = 1 the mean of the ranks' momentum buffers follows DDP's
  and the averaged parameters equal DDP's up to summation order (tests/test_compression_methods.py).
  With H > 1 the method is approximate.
- The last step of every epoch also synchronises (a shorter round), so that validation, the
  saved model and the replica check see one model; those bytes count in that step.
- BatchNorm running statistics follow the lab's rule (base ``finish_epoch``): the first
  trainer's. They never enter a training-mode forward, and rank 0's evolve from rank 0's batches
  exactly as under DDP (which broadcasts rank 0's before every forward), so H = 1 matches DDP's
  buffers too; averaging them would give other statistics than every other method's.
- ``--resume`` continues from rank 0's checkpoint: every rank restarts from rank 0's momentum.

:class:`~labkit.training.sync.diloco.DiLoCo` changes only what a synchronisation does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from labkit.core.config import TrainConfig
from labkit.core.methods import key_of
from labkit.core.params import option

from .base import Strategy, broadcast_parameters, refuse_compress


@dataclass
class LocalSGDOptions:
    local_steps: int = option(8, "localsgd and diloco: local optimizer steps H between two "
                              "synchronisations (no gradient communication in between)", at_least=1)


class LocalSGD(Strategy):
    key, title, short = "localsgd", "Local SGD", "Local SGD"
    exact, phases, order = False, ("comm",), 5
    Options = LocalSGDOptions

    @classmethod
    def check(cls, cfg: TrainConfig, world: int) -> None:
        refuse_compress(cfg, f"{key_of(cfg.method)} sends parameters, not gradients (drop "
                             f"--compress)")

    def setup(self, model: nn.Module) -> nn.Module:
        broadcast_parameters(model)
        self.params = [p for p in model.parameters() if p.requires_grad]
        first = self.params[0]
        # one buffer for every parameter: one all-reduce per synchronisation
        self.flat = torch.zeros(sum(p.numel() for p in self.params), dtype=first.dtype,
                                device=first.device)
        self.since = 0     # local steps since the last synchronisation
        self.in_epoch = 0  # steps taken in this epoch
        return model

    def step(self, optimizer: Optional[torch.optim.Optimizer], scaler=None) -> None:
        if self.sync and self.since == 0:
            self.round_starts()
        super().step(optimizer, scaler)
        if not (self.sync and self.ctx.distributed):
            return
        self.since += 1
        self.in_epoch += 1
        last = self.in_epoch == self.steps_per_epoch
        if self.since >= self.cfg.local_steps or last:
            with self.timer("comm"):
                self.synchronise()
            self.since = 0
        if last:
            self.in_epoch = 0

    def round_starts(self) -> None:
        """Before the first local step of a round (DiLoCo notes where the round starts)."""

    def synchronise(self) -> None:
        """Every rank's parameters replaced by their mean over the ranks (DDP's order: divide,
        then sum)."""
        self.gather(self.flat).div_(self.ctx.world_size)
        self.all_reduce(self.flat)
        self.scatter(self.flat)

    def gather(self, flat: torch.Tensor) -> torch.Tensor:
        """The parameters, copied into ``flat`` (returned)."""
        torch.cat([p.detach().reshape(-1) for p in self.params], out=flat)
        return flat

    def scatter(self, flat: torch.Tensor) -> None:
        """``flat`` copied back into the parameters."""
        off = 0
        for p in self.params:
            n = p.numel()
            p.data.copy_(flat[off:off + n].view_as(p))
            off += n

    def finish_epoch(self, model: nn.Module) -> None:
        """A round cut short outside the loop's epoch (labkit bench) ends here; then the first
        trainer's BatchNorm statistics, as every method's."""
        if self.ctx.distributed and self.since:
            self.synchronise()
            self.since = 0
        self.in_epoch = 0
        super().finish_epoch(model)
