"""The preflight of the machine: will this run fit on the disk, in /dev/shm and in host memory?

labkit.core.resources holds the arithmetic and the wording; this module supplies what needs
torch: the model's size (counted on the meta device, so nothing is allocated and no weights are
read) and the run's figures. The launcher checks before it spawns anything (labkit.lab.launch,
labkit.lab.experiment); a rank of the bare torchrun command, which no launcher checked for,
checks the disk and /dev/shm before its process group exists. A shortfall is bad input:
ConfigError, one line, exit 2.
"""
from __future__ import annotations

from typing import Optional

from labkit.core.config import ConfigError, TrainConfig
from labkit.core.resources import Need, disk_need, memory_need, shm_need

FLOAT = 4  # bytes of a float32 value: weights, gradients and optimizer state are kept in fp32


#: torchvision's ResNets as labkit.training.models builds them: (bottleneck?, blocks per stage)
_ARCH = {"resnet10": (False, (1, 1, 1, 1)), "resnet18": (False, (2, 2, 2, 2)),
         "resnet50": (True, (3, 4, 6, 3))}


def model_values(model: str, num_classes: int) -> int:
    """Floating-point values in the model's state_dict (weights and BatchNorm statistics),
    counted from the architecture: importing torchvision to build it would cost the launcher
    seconds (tests/test_resources.py checks the count against the built models)."""
    base = model[: -len("_small")] if model.endswith("_small") else model
    if base not in _ARCH:
        raise ConfigError(f"unknown model {model!r}")
    bottleneck, blocks = _ARCH[base]
    expansion = 4 if bottleneck else 1
    stem = 3 if model.endswith("_small") else 7
    n, inplanes = 3 * 64 * stem * stem + _bn(64), 64
    for stage, count in enumerate(blocks):
        planes = 64 << stage
        for i in range(count):
            n += _block(inplanes, planes, bottleneck)
            if i == 0 and (stage > 0 or inplanes != planes * expansion):
                n += inplanes * planes * expansion + _bn(planes * expansion)  # downsample
            inplanes = planes * expansion
    return n + inplanes * num_classes + num_classes


def _bn(c: int) -> int:
    return 4 * c  # weight, bias, running mean, running variance


def _block(inplanes: int, planes: int, bottleneck: bool) -> int:
    if bottleneck:
        return (inplanes * planes + 9 * planes * planes + planes * planes * 4
                + 2 * _bn(planes) + _bn(4 * planes))
    return 9 * inplanes * planes + 9 * planes * planes + 2 * _bn(planes)


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
    values = model_values(cfg.model, num_classes)
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
