"""Checks before any process group: everything that can reject the input, in seconds.

The launcher (labkit.lab.launch.validate) runs them in the notebook or CLI process before it spawns
torchrun, and every rank runs them again first thing (labkit.training.rank.run). torch is imported where
a check needs it, so the launcher and the report can import this module without torch or
torchvision (seconds of start-up for each notebook kernel).
"""
from __future__ import annotations

import os
from typing import Optional

from labkit.core import layout
from labkit.core.config import ConfigError, TrainConfig, resolve
from labkit.core.methods import key_of


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
    strategy_class(cfg).check(cfg, world)  # the method's own rules (processes, options)
    return cfg


def refuse_overwrite(out: str, cfg: TrainConfig) -> None:
    """Results are never overwritten: an output folder that already holds this method's
    result file is bad input (unless the run continues there with --resume)."""
    target = os.path.join(out, cfg.result_file)
    if os.path.exists(target):
        raise ConfigError(f"{target!r} already exists; results are never overwritten "
                          f"(choose another --out, or --resume to continue that run)")


def prepare_out(cfg: TrainConfig, resuming: bool = False) -> str:
    out = cfg.out or layout.default_out(key_of(cfg.method))
    if not resuming:
        refuse_overwrite(out, cfg)
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create output folder {out!r}: {e.strerror}") from None
    if not os.access(out, os.W_OK):
        raise ConfigError(f"output folder {out!r} is not writable")
    return out


def find_checkpoint(cfg: TrainConfig) -> Optional[dict]:
    """The checkpoint to continue from: asked for with --resume, or automatic when torchrun
    restarts the workers (--max-restarts) and the first attempt left one in --out."""
    restarted = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
    if not (cfg.resume or restarted):
        return None
    if not cfg.out:
        if cfg.resume:
            raise ConfigError("--resume needs --out DIR: the folder of the run to continue")
        return None
    path = os.path.join(cfg.out, layout.CHECKPOINT)
    if not os.path.exists(path):
        if cfg.resume:
            raise ConfigError(f"nothing to resume: no {layout.CHECKPOINT} in {cfg.out!r} (a run writes it "
                              f"after its first epoch)")
        return None
    import torch

    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - one line for any unreadable checkpoint
        raise ConfigError(f"checkpoint {path!r} is unreadable ({type(e).__name__})") from None
    if ckpt["results"]["config"]["method"] != cfg.method or ckpt["results"]["config"]["model"] != cfg.model:
        raise ConfigError(f"checkpoint {path!r} is from another run "
                          f"({ckpt['results']['config']['method']}, {ckpt['results']['config']['model']})")
    return ckpt
