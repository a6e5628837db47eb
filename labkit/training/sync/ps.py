"""``--method ps``: the parameter server whose protocol the options pick (collective, p2p,
sharded, asynchronous). Registered in labkit.core.methods like any other method."""
from __future__ import annotations

from labkit.core.config import ConfigError, TrainConfig

from .base import FP16_ONLY, Strategy, refuse_compress
from .ps_async import AsyncParameterServer
from .ps_collective import CollectiveParameterServer
from .ps_p2p import P2PParameterServer
from .ps_sharded import ShardedParameterServer


class ParameterServer(CollectiveParameterServer):
    """The collective parameter server, and the choice between the protocols."""

    @classmethod
    def for_config(cls, cfg: TrainConfig) -> type[Strategy]:
        """ConfigError for parameter-server options that no protocol combines."""
        refuse_compress(cfg, FP16_ONLY.format("ps"), ("none", "fp16"))
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
                raise ConfigError("--compress with ps needs --ps-mode collective (p2p is the "
                                  "guide's uncompressed reference)")
            return P2PParameterServer
        return ShardedParameterServer if cfg.ps_servers > 1 else CollectiveParameterServer
