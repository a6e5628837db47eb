"""Checks before any process group: everything that can reject the input, in seconds (the
output folder and the checkpoint to continue from: labkit.training.checkpoint).

The launcher (labkit.launch.torchrun_job.validate) runs them once, in the CLI or notebook process,
before it spawns torchrun, and hands its ranks the result (resolved.json, labkit.core.resolved);
only a rank of the bare ``torchrun -m labkit.train --flags`` runs them itself, first thing
(labkit.training.rank.main); the bench's ranks read it too (:func:`rank_config`). torch is
imported where
a check needs it, so the launcher and the report can import this module without torch or
torchvision (seconds of start-up for each notebook kernel).
"""
from __future__ import annotations

from typing import Optional

from labkit.core import params
from labkit.core.config import ConfigError, TrainConfig
from labkit.workloads import resolve


def preflight(cfg: TrainConfig, world: Optional[int] = None,
              local_world: Optional[int] = None) -> TrainConfig:
    """Resolve ``auto`` values and reject bad input before the process group or a GPU is touched.

    ``world``/``local_world`` default to torchrun's environment; the launcher passes the
    values it is about to launch with, so bad input fails before anything is spawned.
    """
    import torch

    from .dist import env_world
    from .sync import load_method, strategy_class

    cuda = torch.cuda.is_available()
    _, env_ws, _, env_lws = env_world()
    world = env_ws if world is None else world
    local_world = env_lws if local_world is None else local_world
    load_method(cfg.method)  # its spec registered, or one line on why its class does not load
    cfg = resolve(cfg, cuda, world)
    if cfg.backend == "nccl" and local_world > torch.cuda.device_count():
        raise ConfigError(f"{local_world} processes per node but only {torch.cuda.device_count()} "
                          f"GPU(s): nccl needs one GPU per process (lower --nproc_per_node)")
    params.check_ranges(load_method(cfg.method).options_of(cfg))  # as its Options declares
    strategy_class(cfg).check(cfg, world)  # the method's own rules (processes, options)
    return cfg


def add_resolved(p) -> None:
    """A rank's ``--resolved FILE`` (argparse parser ``p``): the launcher's resolved.json."""
    p.add_argument("--resolved", metavar="FILE", help="a resolved.json the launcher wrote "
                   "(labkit.core.resolved): run with exactly that config, decided and checked "
                   "before this rank was spawned, instead of the flags")


def from_resolved(path: str) -> TrainConfig:
    """The launcher's resolved config, for the world torchrun started; checked already."""
    from labkit.core import resolved

    from .dist import env_world

    cfg, nproc, nodes = resolved.read(path)
    resolved.check_world(path, nproc, nodes, env_world()[1])
    return cfg


def rank_config(args) -> TrainConfig:
    """A rank's config from its parsed flags: the resolved.json named by ``--resolved`` (the
    launcher checked it), else the flags, checked here (no launcher did)."""
    from labkit.core.config import from_args

    return preflight(from_args(args)) if args.resolved is None else from_resolved(args.resolved)
