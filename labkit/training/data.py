"""Trainer shards and loaders, whatever the workload.

Every method reads data the same way: trainer k of T gets shard k of T from a
DistributedSampler with the same arguments, so equal trainer counts see identical batches.
The datasets themselves are the workload's (labkit.workloads).
"""
from __future__ import annotations

import os
from typing import Iterator, Optional

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from labkit.core.config import ConfigError, TrainConfig

# ---------------------------------------------------------------- shards and loaders
class ShardSampler(Sampler[int]):
    """Shard k of T of a dataset in order, without the padding DistributedSampler adds, so
    validation counts every sample exactly once over all trainers."""

    def __init__(self, n: int, num_shards: int, shard: int):
        self.indices = list(range(shard, n, num_shards))

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def train_sampler(ds: Dataset, trainers: int, trainer: int, seed: int) -> DistributedSampler:
    # drop_last: every trainer gets the same number of samples, hence of steps (collectives match)
    return DistributedSampler(ds, num_replicas=trainers, rank=trainer, shuffle=True, seed=seed,
                              drop_last=True)


def steps_per_epoch(n_train: int, trainers: int, batch_size: int, cap: Optional[int]) -> int:
    if n_train < trainers:
        raise ConfigError(f"{trainers} training processes but only {n_train} training samples")
    steps = (n_train // trainers) // batch_size
    if steps == 0:
        raise ConfigError(
            f"batch size {batch_size} x {trainers} trainer(s) is more than the {n_train} training "
            f"samples: no full batch per trainer (lower --batch-size)")
    return min(steps, cap) if cap else steps


def default_workers(cfg: TrainConfig, in_memory: bool, local_world_size: int) -> int:
    if cfg.workers is not None:
        return cfg.workers
    per_rank = max(1, min(8, (os.cpu_count() or 1) // max(1, local_world_size)))
    if in_memory:
        # On a CPU the workers would compete with training for the same cores. On a GPU the
        # main thread's batching of in-memory images is not free (ResNet-50 on synthetic
        # images waited for data most of the step without workers: docs/performance.md), so a
        # few workers prepare the next batches while the GPU computes.
        return min(4, per_rank) if cfg.backend == "nccl" else 0
    return per_rank


def make_loader(ds: Dataset, sampler: Sampler, batch_size: int, workers: int, pin: bool,
                drop_last: bool, seed: int, persistent: bool = True) -> DataLoader:
    """A DataLoader whose workers' RNG (the augmentation's) is seeded from ``generator``, and
    whose workers start from the rank's fork server (labkit.training.workers says why).

    ``persistent=False`` for a training loader: a worker's RNG is seeded once, when the
    iterator that starts it is made, so persistent workers would carry epoch 1's random state
    into epoch 2 and ignore the trainer's per-epoch reseeding (labkit.training.trainer). A
    resumed run, or the plain loop of `labkit bench`, would then draw other crops than an
    uninterrupted run. New workers each epoch, as torch's default, cost their start-up once
    per epoch."""
    from .workers import loader_options

    return DataLoader(
        ds, batch_size=batch_size, sampler=sampler, num_workers=workers, pin_memory=pin,
        drop_last=drop_last, persistent_workers=persistent and workers > 0,
        # seeds the workers' augmentation RNG: same seed, same crops on a rerun
        generator=torch.Generator().manual_seed(seed), **loader_options(workers),
    )
