"""A run's checkpoint, in one place: the folder it goes to, finding it to continue from, writing
it atomically after every epoch, restoring a trainer from it, and carrying an unfinished
attempt's checkpoint into the folder that continues it (`labkit experiment --continue`).

After every epoch rank 0 writes ``checkpoint.pt`` (labkit.core.layout.CHECKPOINT): the epoch,
the model's and optimizer's state (rank 0 holds the optimizer for every method: a trainer for
ddp/allreduce, the server for ps), the AMP scaler's, and the result file so far. A run continues
from it with ``--resume --out DIR``, or by itself when torchrun restarts the ranks
(``--max-restarts``). torch is imported where needed, so the launcher and the lab import this
module without it.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Optional

from labkit.core import layout
from labkit.core.config import ConfigError, TrainConfig
from labkit.core.files import atomic_path
from labkit.core.methods import key_of
from labkit.core.results import Result


def atomic_torch_save(obj: Any, path: str) -> None:
    """torch.save, never half-written. Through a Python file object: torch's own writer, given a
    path, reports a full disk as an "enforce fail" about a file position; Python's write says
    ENOSPC (errno 28), which labkit.training.exhaustion names."""
    import torch

    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        torch.save(obj, f)


# ------------------------------------------------------------------ the run's folder
def refuse_overwrite(out: str, cfg: TrainConfig) -> None:
    """Results are never overwritten: an output folder that already holds this method's
    result file is bad input (unless the run continues there with --resume)."""
    target = os.path.join(out, cfg.result_file)
    if os.path.exists(target):
        raise ConfigError(f"{target!r} already exists; results are never overwritten "
                          f"(choose another --out, or --resume to continue that run)")


def prepare_out(cfg: TrainConfig, resuming: bool = False) -> str:
    """The output folder, made and checked writable (a new run's must hold no results)."""
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


# ------------------------------------------------------------------ continuing
def find(cfg: TrainConfig) -> Optional[dict]:
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
    try:
        got = results(ckpt).config
    except (KeyError, ValueError):
        raise ConfigError(f"checkpoint {path!r} is not a labkit checkpoint (no result file in it)") from None
    if got.get("method") != cfg.method or got.get("model") != cfg.model:
        raise ConfigError(f"checkpoint {path!r} is from another run "
                          f"({got.get('method')}, {got.get('model')})")
    return ckpt


def results(ckpt: dict) -> Result:
    """The result file as it stood when the checkpoint was saved (its finished epochs)."""
    return Result.from_dict(ckpt["results"], "the checkpoint's result file")


def restore(ckpt: dict, strategy, model, optimizer, scaler) -> int:
    """Model, optimizer and scaler as the checkpoint has them, loaded on every rank as the
    method keeps them (``strategy.load_full_state``: a replica, or a sharded method's shard);
    the epoch to start from."""
    strategy.load_full_state(model, optimizer, ckpt["model"], ckpt["optimizer"])
    if scaler is not None and ckpt.get("scaler"):
        scaler.load_state_dict(ckpt["scaler"])
    return ckpt["epoch"] + 1


def save(out: str, epoch: int, model_state: dict, optimizer_state: Optional[dict], scaler,
         result: Result) -> None:
    """Rank 0, after every epoch: everything needed to continue, the model's and optimizer's
    state as the method's full_state gave them (the result file as plain values: the
    checkpoint loads with weights_only)."""
    atomic_torch_save({"epoch": epoch, "model": model_state, "optimizer": optimizer_state,
                       "scaler": scaler.state_dict() if scaler else None,
                       "results": result.to_dict()},
                      os.path.join(out, layout.CHECKPOINT))


def carry_over(old: Path, new: Path) -> bool:
    """Put the checkpoint of an unfinished attempt in ``old`` into a fresh folder ``new``, to
    continue from; False (nothing made) when that attempt wrote none."""
    if not (old / layout.CHECKPOINT).exists():
        return False
    new.mkdir()
    shutil.copy2(old / layout.CHECKPOINT, new / layout.CHECKPOINT)
    return True
