"""The guide's result files: same names, same keys, plus the lab's extras.

Written by rank 0 only, atomically, after every epoch, so a crash keeps the finished epochs.
"""
from __future__ import annotations

import os
import platform
import socket
import threading
from statistics import mean
from typing import Optional

import torch

from labkit import __version__
from labkit.core.config import TrainConfig
from labkit.core.files import atomic_write_json, now_str
from labkit.core.layout import portable
from labkit.core.methods import comm_key, spec
from labkit.core.status import Status, stamp

from .dist import DistContext, determinism

SCHEMA = "labkit.results/1"
# the guide's per-epoch keys, common to every method
EPOCH_KEYS = ("epoch", "train_loss", "train_accuracy", "train_time", "train_throughput",
              "avg_batch_time", "val_loss", "val_accuracy")


def torchrun_world() -> dict:
    keys = ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE",
            "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")
    return {k.lower(): os.environ[k] for k in keys if k in os.environ}


class ResultFile:
    """The rank-0 writer of one method's result file (readers: labkit.report.load)."""

    def __init__(self, cfg: TrainConfig, ctx: DistContext, trainers: int, out: str,
                 phases: tuple[str, ...], previous: Optional[dict] = None):
        self.path = os.path.join(out, cfg.result_file)
        # the main thread, the heartbeat and the SIGTERM thread all write the file
        self.lock = threading.RLock()
        self.phases = phases  # the strategy's timed communication phases
        self.doc = {
            "method": spec(cfg.method).guide_name,
            "world_size": ctx.world_size,
            "batch_size": cfg.batch_size,
            "start_time": now_str(),
            "end_time": None,
            "epochs": [],
            "summary": {},
            "all_losses": [],
            # --- extras ---
            "schema": SCHEMA,
            "status": Status.RUNNING.value,  # plain values: the checkpoint pickles this doc
            "method_key": spec(cfg.method).key,
            # the method as the registry knows it: the report registers a user's method from it
            "method_spec": spec(cfg.method).to_dict(),
            "trainers": trainers,
            # config.out relative to this file's folder ("."): the file stays right when its
            # run folder is copied or moved (data_dir and weights, elsewhere, stay absolute)
            "config": portable(cfg.to_dict(), out),
            # gpus: this node's GPU count; more local ranks than GPUs on cuda: they shared one
            "world": {**torchrun_world(), "backend": ctx.backend, "device": str(ctx.device),
                      "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0},
            # this rank's threads and deterministic settings: what a bit-for-bit rerun needs
            "determinism": determinism(cfg.seed, ctx.backend),
            "versions": {"labkit": __version__, "python": platform.python_version(),
                         "torch": str(torch.__version__), "host": socket.gethostname()},
        }
        if spec(cfg.method).serves:  # the guide's PS file names its workers
            self.doc["num_workers"] = trainers
        if previous:  # a resumed run continues its own file: finished epochs, losses, start time
            for k in ("start_time", "epochs", "all_losses", "summary"):
                self.doc[k] = previous[k]
            self.doc["resumed"] = previous.get("resumed", []) + [
                {"at_epoch": len(previous["epochs"]) + 1, "time": now_str()}]

    def add_epoch(self, epoch: int, m: dict) -> None:
        e = {"epoch": epoch, **{k: m[k] for k in EPOCH_KEYS[1:]}}
        for p in self.phases:
            e[comm_key(p)] = m[comm_key(p)]
        e.update({k: v for k, v in m.items() if k not in e})  # extras, all_losses included
        with self.lock:  # the heartbeat never writes half an epoch
            self.doc["epochs"].append(e)
            self.doc["all_losses"].extend(m["all_losses"])
            self.doc["summary"] = self.summary()
            self.write()

    def set(self, key: str, value) -> None:
        """A top-level entry of the lab's own (e.g. "calibration"), written at once."""
        with self.lock:
            self.doc[key] = value
            self.write()

    def summary(self) -> dict:
        ep = self.doc["epochs"]
        s = {
            "avg_train_throughput": mean(e["train_throughput"] for e in ep),
            "avg_train_time_per_epoch": mean(e["train_time"] for e in ep),
            "best_val_accuracy": max(e["val_accuracy"] for e in ep),
            "final_train_accuracy": ep[-1]["train_accuracy"],
            "final_val_accuracy": ep[-1]["val_accuracy"],
        }
        for p in self.phases:
            s[comm_key(p)] = mean(e[comm_key(p)] for e in ep)
        return s

    def finish(self, status: Status, error: Optional[str] = None) -> None:
        with self.lock:
            self.doc["status"] = Status(status).value
            self.doc["end_time"] = now_str()
            if error:
                self.doc["error"] = error
            self.write()

    def stop(self, why: str) -> None:
        """Called from the SIGTERM thread: mark a still-running file failed and keep the lock,
        so no later write of the main thread (about to die) can mark it running again."""
        if self.lock.acquire(timeout=10) and self.doc["status"] == Status.RUNNING:
            self.finish(Status.FAILED, error=why)

    def write(self) -> None:
        with self.lock:
            self.doc["heartbeat"] = stamp()
            atomic_write_json(self.path, self.doc)

    def beat(self) -> bool:
        """One heartbeat while the run is running; False once it has ended."""
        with self.lock:
            if self.doc["status"] != Status.RUNNING:
                return False
            self.write()
            return True
