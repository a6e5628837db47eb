"""What a workload's ``datasets()`` returns (labkit.workloads.contract), and what the training
layer asks of its datasets beyond a map-style dataset's ``__len__`` and ``__getitem__``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass
class Datasets:
    """The train and validation data of a run: map-style datasets of (input, target) samples,
    which the lab's sampler shards over the trainers (trainer k of T reads shard k of T)."""
    train: Any
    val: Any
    in_memory: bool  # tensors already in RAM: loader workers would only add overhead
    warning: Optional[str] = None  # for people, printed once by rank 0 (e.g. images left out)
    num_classes: Optional[int] = None  # a classifier's classes (the images workload's)


# The two optional, duck-typed parts of a dataset that the training layer
# (labkit.training.gpu_data) looks for, so that it names no workload's classes (issue 84); a
# dataset with neither is loaded by labkit.training.data's DataLoaders. ``Datasets.train``
# decides which path both sets take, so a workload gives its train and val sets the same parts.
#
# A dataset whose batches are made ready on the device (the images' JpegFiles: the loader
# workers read the files' bytes, the rank decodes and transforms them on the GPU) offers
#
#   collate_fn                             what its DataLoader collates samples with; a
#                                          module-level function, pickled to the workers
#   prepare(batch, device, train, rng)     one collated batch -> (inputs, targets) on
#       -> (x, y)                          ``device``: ``train`` (bool) says which transform,
#                                          ``rng`` (random.Random, seeded per epoch by the
#                                          trainer) draws its random augmentation
#
# ``prepare`` runs in a thread of the rank, one batch ahead of the step, on a side CUDA stream
# (labkit.training.gpu_data.PreparedBatches), so that it overlaps the step; an error it
# raises reaches the training step, and a ConfigError is one line for people. Such a dataset is
# read this way on every device (its samples are not what a model takes: there is no other way).
#
# A dataset that can live on the device as tensors (the synthetic images) offers
#
#   device_parts() -> (inputs, targets, pool)   tensors on the host: sample i is
#                                               (inputs[i % pool], targets[i]) when ``pool`` is
#                                               an int, (inputs[i], targets[i]) when None
#
# and on a CUDA device, when the inputs take at most gpu_data.DEVICE_SHARE (a quarter) of its
# free memory, its batches are gathered there, as a DataLoader would make them, bit for bit (a
# 2-tensor TensorDataset of (inputs, targets) needs nothing: it is its own device parts).
