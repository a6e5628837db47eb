"""One small strategy per method; the training loop is shared (labkit.training.trainer).

The public interface of a method (docs/methods.md): subclass :class:`Strategy`, issue
collectives through its helpers, and name the class to ``--method`` as
``path/to/file.py:Class`` or ``package.module:Class``. Which class runs a config is decided by
the one registry (labkit.core.methods, loaded by :mod:`.registry`) and the class's
``for_config`` and ``check``: the per-method rules live with the methods.
"""
from __future__ import annotations

from labkit.core.config import TrainConfig
from labkit.training.dist import DistContext

from .base import Strategy, broadcast_parameters
from .registry import load_method


def strategy_class(cfg: TrainConfig) -> type[Strategy]:
    """The strategy that runs ``cfg``; ConfigError for a method that does not load or options
    its class refuses."""
    return load_method(cfg.method).for_config(cfg)


def make_strategy(cfg: TrainConfig, ctx: DistContext) -> Strategy:
    return strategy_class(cfg)(cfg, ctx)


__all__ = ["Strategy", "broadcast_parameters", "load_method", "make_strategy", "strategy_class"]
