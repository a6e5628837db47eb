"""One small strategy per method; the training loop is shared (labkit.train)."""
from labkit.core.config import TrainConfig
from labkit.training.dist import DistContext
from .allreduce import AllReduceStrategy
from .base import Strategy
from .ddp import DDPStrategy
from .ps import PSStrategy
from .ps_async import AsyncPSStrategy

STRATEGIES = {"ddp": DDPStrategy, "allreduce": AllReduceStrategy, "ps": PSStrategy}


def make_strategy(cfg: TrainConfig, ctx: DistContext) -> Strategy:
    if cfg.method == "ps" and cfg.ps_staleness is not None:
        return AsyncPSStrategy(cfg, ctx)  # one server, bounded staleness
    return STRATEGIES[cfg.method](cfg, ctx)
