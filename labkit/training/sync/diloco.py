"""``--method diloco``: DiLoCo (Douillard et al., "DiLoCo: Distributed Low-Communication Training
of Language Models", 2023). Local SGD's rounds (labkit.training.sync.local_sgd: H =
``--local-steps`` local steps with each rank's own inner optimizer, the lab's SGD), but a
round ends with an outer optimizer step instead of a plain average:

    pseudo-gradient  = parameters at the round's start - this rank's parameters now
    all-reduce its mean over the ranks (one fp32 buffer of every parameter, timed and counted)
    outer step:        SGD with Nesterov momentum (--outer-lr, --outer-momentum) on the
                       round's starting parameters, which every rank then takes

The paper's defaults: outer learning rate 0.7, Nesterov momentum 0.9. The inner optimizer is the
workload's, as DDP's is (AdamW for the lm workload, as in the paper; SGD for images), so the
comparison with DDP changes the communication only.
With --outer-lr 1 and --outer-momentum 0 a round ends where local SGD's does. Each rank keeps
its inner optimizer's state between rounds, as in the paper and torchft's DiLoCo. The outer
momentum lives on every rank alike and is not in the checkpoint: ``--resume`` restarts it
from zero. Approximate.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from labkit.core.params import option

from .local_sgd import LocalSGD, LocalSGDOptions


@dataclass
class DiLoCoOptions(LocalSGDOptions):
    outer_lr: float = option(0.7, "diloco: the outer optimizer's learning rate (Nesterov SGD on the "
                             "averaged parameter change; 0.7 as in Douillard et al., 2023)",
                             positive=True)
    outer_momentum: float = option(0.9, "diloco: the outer optimizer's Nesterov momentum (0.9 as in "
                                   "Douillard et al., 2023)", at_least=0, below=1)


class DiLoCo(LocalSGD):
    key, title, short, order = "diloco", "DiLoCo", "DiLoCo", 6
    Options = DiLoCoOptions

    def setup(self, model: nn.Module) -> nn.Module:
        model = super().setup(model)
        #: the parameters at the start of the round (flat), which the outer optimizer steps;
        #: taken at the first step, after a checkpoint was loaded
        self.anchor: Optional[torch.Tensor] = None
        self.outer: Optional[torch.optim.Optimizer] = None
        return model

    def round_starts(self) -> None:
        if self.anchor is None:
            self.anchor = self.gather(torch.empty_like(self.flat))
            self.outer = torch.optim.SGD([self.anchor], lr=self.cfg.outer_lr,
                                         momentum=self.cfg.outer_momentum,
                                         nesterov=self.cfg.outer_momentum > 0)

    def synchronise(self) -> None:
        pseudo = self.gather(self.flat)
        torch.sub(self.anchor, pseudo, out=pseudo).div_(self.ctx.world_size)
        self.all_reduce(pseudo)
        self.anchor.grad = pseudo
        self.outer.step()
        self.anchor.grad = None
        self.scatter(self.anchor)
