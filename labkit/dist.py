"""Process-group setup in one place, and collective helpers that are no-ops at world size 1.

torchrun exports RANK / WORLD_SIZE / LOCAL_RANK; without them we run as one process, so every
code path also runs in a plain ``python -m labkit.train`` and in unit tests.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str
    device: torch.device

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def env_world() -> tuple[int, int, int, int]:
    """(rank, world_size, local_rank, local_world_size) from torchrun's environment."""
    g = os.environ.get
    return (int(g("RANK", 0)), int(g("WORLD_SIZE", 1)), int(g("LOCAL_RANK", 0)),
            int(g("LOCAL_WORLD_SIZE", g("WORLD_SIZE", 1))))


def init(backend: str, timeout_s: float) -> DistContext:
    rank, world, local_rank, local_world = env_world()
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        kw = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kw)
    return DistContext(rank, world, local_rank, local_world, backend, device)


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def is_distributed() -> bool:
    """A process group is up and has peers: collectives would do something."""
    return dist.is_initialized() and dist.get_world_size() > 1


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum ``t`` in place over all ranks (no-op for one process)."""
    if is_distributed():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def sync_device(device: torch.device) -> None:
    """Wait for queued device work, so a host clock read after it means something."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
