"""What a workload's ``datasets()`` returns (labkit.workloads.contract)."""
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
