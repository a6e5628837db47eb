"""The guide's result files: same names, same keys, plus the lab's extras.

Written by rank 0 only, atomically, after every epoch, so a crash keeps the finished epochs.
"""
from __future__ import annotations

import os
import platform
import socket
import threading
from typing import Optional

import torch

from labkit import __version__
from labkit.core.config import TrainConfig
from labkit.core.files import atomic_write_json, now_str
from labkit.core.layout import portable
from labkit.core.methods import spec
from labkit.core.results import SCHEMA, Epoch, Result, Summary
from labkit.core.status import Status, stamp

from .dist import DistContext, determinism

def torchrun_world() -> dict:
    keys = ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE",
            "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")
    return {k.lower(): os.environ[k] for k in keys if k in os.environ}


class ResultFile:
    """The rank-0 writer of one method's result file (its model: labkit.core.results.Result;
    readers: labkit.report.load)."""

    def __init__(self, cfg: TrainConfig, ctx: DistContext, trainers: int, out: str,
                 phases: tuple[str, ...], previous: Optional[Result] = None,
                 workload: Optional[dict] = None):
        self.path = os.path.join(out, cfg.result_file)
        # the main thread, the heartbeat and the SIGTERM thread all write the file
        self.lock = threading.RLock()
        self.phases = phases  # the strategy's timed communication phases
        method = spec(cfg.method)
        self.result = Result(
            method=method.guide_name, world_size=ctx.world_size, batch_size=cfg.batch_size,
            start_time=now_str(), schema=SCHEMA, status=Status.RUNNING, method_key=method.key,
            # the guide's PS file names its workers
            num_workers=trainers if method.serves else None,
            # the method as the registry knows it: the report registers a user's method from it
            method_spec=method.to_dict(), trainers=trainers,
            # config.out relative to this file's folder ("."): the file stays right when its
            # run folder is copied or moved (data_dir and weights, elsewhere, stay absolute)
            config=portable(cfg.to_dict(), out),
            # gpus: this node's GPU count; more local ranks than GPUs on cuda: they shared one
            world={**torchrun_world(), "backend": ctx.backend, "device": str(ctx.device),
                   "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0},
            # this rank's threads and deterministic settings: what a bit-for-bit rerun needs
            determinism=determinism(cfg.seed, ctx.backend),
            versions={"labkit": __version__, "python": platform.python_version(),
                      "torch": str(torch.__version__), "host": socket.gethostname()},
            workload=workload)
        if previous:  # a resumed run continues its own file: finished epochs, losses, start time
            r = self.result
            r.start_time, r.epochs, r.all_losses = previous.start_time, previous.epochs, previous.all_losses
            r.summary = previous.summary
            r.resumed = (previous.resumed or []) + [
                {"at_epoch": len(previous.epochs) + 1, "time": now_str()}]

    def add_epoch(self, e: Epoch) -> None:
        with self.lock:  # the heartbeat never writes half an epoch
            self.result.epochs.append(e)
            self.result.all_losses.extend(e.all_losses)
            self.result.summary = Summary.of(self.result.epochs, self.phases)
            self.write()

    def update(self, **fields) -> None:
        """Top-level fields of the lab's own (e.g. ``calibration=...``), written at once."""
        with self.lock:
            for name, value in fields.items():
                if not hasattr(self.result, name):
                    raise AttributeError(f"a result file has no field {name!r}")
                setattr(self.result, name, value)
            self.write()

    def finish(self, status: Status, error: Optional[str] = None) -> None:
        with self.lock:
            self.result.status = Status(status)
            self.result.end_time = now_str()
            if error:
                self.result.error = error
            self.write()

    def stop(self, why: str) -> None:
        """Called from the SIGTERM thread: mark a still-running file failed and keep the lock,
        so no later write of the main thread (about to die) can mark it running again."""
        if self.lock.acquire(timeout=10) and self.result.status == Status.RUNNING:
            self.finish(Status.FAILED, error=why)

    def write(self) -> None:
        with self.lock:
            self.result.heartbeat = stamp()
            atomic_write_json(self.path, self.result.to_dict())

    def beat(self) -> bool:
        """One heartbeat while the run is running; False once it has ended."""
        with self.lock:
            if self.result.status != Status.RUNNING:
                return False
            self.write()
            return True
