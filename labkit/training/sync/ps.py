"""``--method ps``: the parameter server whose protocol the options pick (collective, p2p,
sharded, asynchronous), declared here as any method is."""
from __future__ import annotations

from labkit.core.config import ConfigError, TrainConfig

from .base import FP16_ONLY, Held, Strategy, refuse_compress
from .ps_async import AsyncParameterServer
from .ps_collective import CollectiveParameterServer, PSOptions
from .ps_p2p import P2PParameterServer
from .ps_sharded import ShardedParameterServer


class ParameterServer(CollectiveParameterServer):
    """The collective parameter server, and the choice between the protocols."""
    key, title, short, result_file = ("ps", "Parameter Server (PS)", "Parameter Server",
                                      "results_ps.json")
    phases, serves = ("pull", "push"), True
    order, guide, default = 2, True, True
    Options = PSOptions
    variants = {"ps": {"ps_mode": "collective"}, "ps-p2p": {"ps_mode": "p2p"},
                "ps-sharded": {"ps_mode": "collective", "ps_servers": 2},
                "ps-async": {"ps_mode": "collective", "ps_staleness": 2},
                "ps-fp16": {"ps_mode": "collective", "compress": "fp16"}}
    bench_variants = ("ps", "ps-p2p")
    cost_model = "server"

    @classmethod
    def server_ranks(cls, cfg: TrainConfig) -> int:
        return cfg.ps_servers

    @classmethod
    def bytes_per_step(cls, cfg: TrainConfig, grad_bytes: int) -> tuple[int, int]:
        """A worker pushes its gradients (2 bytes a value with --compress) and pulls the fp32
        parameters."""
        return super().bytes_per_step(cfg, grad_bytes)[0], grad_bytes

    @classmethod
    def memory_per_rank(cls, cfg: TrainConfig, values: int, state_per_value: int,
                        world: int) -> list[Held]:
        """A server holds its slice of the parameters, of the summed gradients and of the
        optimizer state; a worker a replica of the parameters and its gradients."""
        k = cfg.ps_servers
        one = super().memory_per_rank(cfg, values, state_per_value, 1)[0]
        server = Held(one.parameters / k, one.gradients / k, one.optimizer / k)
        return [server] * k + [Held(one.parameters, one.gradients, 0.0)] * (world - k)

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
