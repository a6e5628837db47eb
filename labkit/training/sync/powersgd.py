"""``--method powersgd``: DDP with PyTorch's PowerSGD communication hook (Vogels et al.,
NeurIPS 2019), as PyTorch ships it: ``powerSGD_hook`` with a ``PowerSGDState`` whose
``matrix_approximation_rank`` is ``--powersgd-rank`` and whose ``start_powerSGD_iter`` is
``--powersgd-start-iter``; error feedback and warm start on (PyTorch's defaults).

For the first ``start_powerSGD_iter`` steps the hook all-reduces each bucket as DDP does. After
that, each gradient viewed as an n x m matrix (n = its first dimension) is sent as two rank-r
factors, P (n x r) and Q (m x r), each all-reduced in one buffer per bucket; a tensor that
would not shrink at least twofold, (n + m) r x 2 >= n m (every bias and BatchNorm weight),
goes uncompressed in one more buffer. What PowerSGD drops is kept on each rank (error
feedback) and added to the next step's gradient. Approximate: the ranks agree on every update,
but it is not DDP's. The state is not checkpointed: ``--resume`` starts it afresh.

The bytes on the wire are counted from the all-reduces the hook itself issues: the hook's own
code runs with ``dist`` (and the plain all-reduce of its first steps) bound to a counting view of
torch.distributed for this strategy alone, which counts each tensor the lab's way (a ring,
labkit.training.sync.collectives) and issues the call unchanged. Nothing of PyTorch is copied
or patched.
"""
from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

from labkit.core.config import ConfigError, TrainConfig
from labkit.core.params import option

from .base import refuse_compress
from .ddp import DDPOptions, DDPStrategy


@dataclass
class PowerSGDOptions(DDPOptions):
    powersgd_rank: int = option(2, "powersgd: rank of the low-rank approximation of each gradient "
                                "matrix (PowerSGDState's matrix_approximation_rank; 2 matched SGD's "
                                "accuracy on CIFAR-10 ResNets in Vogels et al., 2019)", at_least=1)
    powersgd_start_iter: int = option(10, "powersgd: steps of plain all-reduce before compression "
                                      "starts (PowerSGDState's start_powerSGD_iter; at least 2)")


class PowerSGD(DDPStrategy):
    key, title, short = "powersgd", "DDP with PowerSGD (PyTorch)", "PowerSGD"
    exact, order = False, 4
    Options = PowerSGDOptions
    preload = ("torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook",)
    cost_model = ""  # compressed: the model's ring all-reduce of every gradient is not its step

    @classmethod
    def check(cls, cfg: TrainConfig, world: int) -> None:
        refuse_compress(cfg, "powersgd compresses the gradients itself (drop --compress)")
        if cfg.powersgd_start_iter < 2:  # PowerSGDState asserts it (error feedback, warm start)
            raise ConfigError(f"--powersgd-start-iter must be at least 2: PyTorch's PowerSGD takes "
                              f"two plain all-reduce steps first (got {cfg.powersgd_start_iter})")

    def comm_hook(self) -> tuple[Any, Optional[Callable]]:
        # the seed draws the first random Q factors: the same on every rank, by the run's seed
        self.state = PowerSGDState(process_group=None,
                                   matrix_approximation_rank=self.cfg.powersgd_rank,
                                   start_powerSGD_iter=self.cfg.powersgd_start_iter,
                                   random_seed=self.cfg.seed)
        hook = counted(powerSGD_hook, self._count_tensor)
        return self.state, in_order(hook) if dist.get_backend() == "gloo" else hook

    def count_bucket(self, buf: torch.Tensor) -> None:
        """Nothing here: each all-reduce the hook issues is counted as it is issued."""

    def _count_tensor(self, t: torch.Tensor) -> None:
        self._count(t.numel(), t.element_size())


def in_order(hook: Callable) -> Callable:
    """``hook``, each bucket's all-reduces done before the hook returns. PowerSGD issues two of
    its three all-reduces from callbacks of the first; with gloo those run on another thread,
    so without this one rank could start the next bucket's all-reduce before this bucket's
    second while another rank does the opposite, and gloo aborts on the mismatch. The cost:
    a bucket's communication no longer overlaps the rest of backward."""
    def run(state, bucket):  # no annotations: DDP checks them
        fut = hook(state, bucket)
        fut.wait()
        return fut
    return run


class _Counting:
    """A module (torch.distributed, or its default hooks) as a hook sees it: ``all_reduce`` and
    the default hooks' ``_allreduce_fut`` call ``count(tensor)`` first; everything else is the
    module's own."""

    def __init__(self, module: types.ModuleType, **calls: Callable):
        self._module, self._calls = module, calls

    def __getattr__(self, name: str) -> Any:
        return self._calls.get(name) or getattr(self._module, name)


def counted(hook: Callable, count: Callable[[torch.Tensor], None]) -> Callable:
    """``hook`` (PyTorch's function, its own code) with the names ``dist`` and ``default`` it
    looks up at call time bound to counting views: every all-reduce it (or a callback it chains)
    issues is passed to ``count`` before it is issued."""
    def all_reduce(tensor, *args, **kwargs):
        count(tensor)
        return dist.all_reduce(tensor, *args, **kwargs)

    def allreduce_fut(group, tensor):
        count(tensor)
        return default_hooks._allreduce_fut(group, tensor)

    names = {"dist": _Counting(dist, all_reduce=all_reduce),
             "default": _Counting(default_hooks, _allreduce_fut=allreduce_fut)}
    fn = types.FunctionType(hook.__code__, {**hook.__globals__, **names}, hook.__name__,
                            hook.__defaults__, hook.__closure__)
    fn.__kwdefaults__ = hook.__kwdefaults__
    return fn
