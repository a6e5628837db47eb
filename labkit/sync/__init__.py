"""One small strategy per method; the training loop is shared (labkit.train)."""
from ..config import TrainConfig
from ..dist import DistContext
from .allreduce import AllReduceStrategy
from .base import Strategy
from .ddp import DDPStrategy
from .ps import PSStrategy

STRATEGIES = {"ddp": DDPStrategy, "allreduce": AllReduceStrategy, "ps": PSStrategy}


def make_strategy(cfg: TrainConfig, ctx: DistContext) -> Strategy:
    return STRATEGIES[cfg.method](cfg, ctx)
