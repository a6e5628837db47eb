"""The preflight of the machine: will this run fit on the disk, in /dev/shm and in host memory?

labkit.core.resources holds the arithmetic and the wording; this module supplies the run's
figures: the model's size (counted from labkit.core.architectures' table, the one the model
factory builds from, so neither torch nor torchvision is imported and no weights are read), the
checkpoint and the data a rank holds. The launcher checks before it spawns anything
(labkit.launch.launch, labkit.orchestrate.experiment); a rank of the bare torchrun command, which
no launcher checked for, checks the disk and /dev/shm before its process group exists. A shortfall
is bad input: ConfigError, one line, exit 2.
"""
from __future__ import annotations

from typing import Optional

from labkit.core.architectures import state_values
from labkit.core.config import ConfigError, TrainConfig
from labkit.core.resources import Need, disk_need, memory_need, shm_need

FLOAT = 4  # bytes of a float32 value: weights, gradients and optimizer state are kept in fp32


def checkpoint_bytes(cfg: TrainConfig, values: int) -> int:
    """A checkpoint: the model, and SGD's momentum buffer (one value per weight) when it has one."""
    return FLOAT * values * (2 if cfg.momentum else 1)


def data_bytes(cfg: TrainConfig) -> int:
    """What an in-memory dataset holds in each rank (the digits at the chosen side; the
    synthetic images are a small pool; image folders are read from disk)."""
    if cfg.dataset == "digits":
        return 1797 * 3 * cfg.image_size ** 2 * FLOAT * 2  # the images, and their upsampling
    return 0


def needs(cfg: TrainConfig, num_classes: int, ranks: int, workers: int, where: str,
          methods: int = 1, flags: str = "--out") -> list[Need]:
    """What a resolved ``cfg`` needs: disk for ``methods`` runs in ``where``, /dev/shm for the
    loader workers of the ``ranks`` on this node, host memory for those ranks."""
    values = state_values(cfg.model, num_classes)
    model = FLOAT * values
    batch = cfg.batch_size * (3 * cfg.image_size ** 2 * FLOAT + 8)
    out = [disk_need(where, checkpoint_bytes(cfg, values), model, methods, cfg.checkpoint, flags)]
    if workers:
        out.append(shm_need(workers, 2, ranks, batch))
    out.append(memory_need(ranks, workers, model, data_bytes(cfg)))
    return out


def check(found: list[Need], only: Optional[tuple[str, ...]] = None) -> list[str]:
    """Refuse the first shortfall (ConfigError, its one line); return the warnings for margins
    that are only tight. ``only``: the kinds of resource to look at (e.g. a rank checks the
    disk and /dev/shm, not memory the other ranks are taking as it looks)."""
    found = [n for n in found if only is None or n.what in only]
    for n in found:
        if n.short:
            raise ConfigError(n.line())
    return [n.line() for n in found if n.tight]


def classes(cfg: TrainConfig) -> int:
    """The number of classes, cheaply: an image folder's class folders are counted, not read
    (labkit.training.data.check_image_folder has already checked them)."""
    if cfg.dataset == "imagefolder":
        import os

        train = os.path.join(cfg.data_dir, "train")
        return sum(1 for e in os.scandir(train) if e.is_dir())
    return 10 if cfg.dataset == "digits" else cfg.num_classes


def machine(cfg: TrainConfig, ranks: int, where: str, methods: int = 1, flags: str = "--out",
            only: Optional[tuple[str, ...]] = None) -> list[str]:
    """Check a resolved, validated ``cfg`` against this machine: ConfigError on a shortfall,
    the warnings of tight margins returned (the caller says them, once)."""
    from .data import default_workers

    workers = default_workers(cfg, cfg.dataset != "imagefolder", ranks)
    return check(needs(cfg, classes(cfg), ranks, workers, where, methods, flags), only)
