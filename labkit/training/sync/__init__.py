"""One small strategy per method; the training loop is shared (labkit.training.trainer).

Which class runs a config, and whether a config is one any class can run, is decided here and
in the classes' ``check``: the per-method rules live with the methods.
"""
from __future__ import annotations

from labkit.core.config import ConfigError, TrainConfig
from labkit.training.dist import DistContext

from .allreduce import AllReduceStrategy
from .base import Strategy
from .ddp import DDPStrategy
from .ps_async import AsyncParameterServer
from .ps_collective import CollectiveParameterServer
from .ps_p2p import P2PParameterServer
from .ps_sharded import ShardedParameterServer

STRATEGIES: dict[str, type[Strategy]] = {"ddp": DDPStrategy, "allreduce": AllReduceStrategy}


def strategy_class(cfg: TrainConfig) -> type[Strategy]:
    """The strategy that runs ``cfg``; ConfigError for parameter-server options that no
    protocol combines."""
    if cfg.method in STRATEGIES:
        return STRATEGIES[cfg.method]
    if cfg.ps_staleness is not None:  # asynchronous, bounded staleness
        if cfg.ps_mode == "p2p":
            raise ConfigError("--ps-staleness (asynchronous PS) has its own protocol; drop "
                              "--ps-mode p2p")
        if cfg.ps_servers > 1:
            raise ConfigError("--ps-staleness (asynchronous PS) runs with one server; drop "
                              "--ps-servers")
        return AsyncParameterServer
    if cfg.ps_mode == "p2p":
        if cfg.ps_servers > 1:
            raise ConfigError("--ps-servers > 1 (sharded PS) needs --ps-mode collective")
        if cfg.compress != "none":
            raise ConfigError("--compress with ps needs --ps-mode collective (p2p is the guide's "
                              "uncompressed reference)")
        return P2PParameterServer
    return ShardedParameterServer if cfg.ps_servers > 1 else CollectiveParameterServer


def make_strategy(cfg: TrainConfig, ctx: DistContext) -> Strategy:
    return strategy_class(cfg)(cfg, ctx)
