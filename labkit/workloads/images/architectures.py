"""The ResNets labkit trains, as a table: the one source for the model factory
(labkit.training.models builds them with torchvision) and for the resource preflight
(labkit.training.budget counts their size without importing torch).

A name is ``resnet10 | resnet18 | resnet50``, plain (torchvision's 7x7 stem and max-pool, for
224 px images) or with a ``_small`` suffix (a 3x3 stride-1 stem and no max-pool, for 16-32 px).
"""
from __future__ import annotations

from labkit.core.errors import ConfigError

#: torchvision's layer tables: (block, blocks per stage); resnet10 is the smallest member
RESNETS = {
    "resnet10": ("basic", (1, 1, 1, 1)),
    "resnet18": ("basic", (2, 2, 2, 2)),
    "resnet50": ("bottleneck", (3, 4, 6, 3)),
}
SMALL = "_small"


def parse(model: str) -> tuple[str, bool]:
    """"resnet18_small" -> ("resnet18", True); an unknown name is one line (ConfigError)."""
    base, small = (model[: -len(SMALL)], True) if model.endswith(SMALL) else (model, False)
    if base not in RESNETS:
        raise ConfigError(f"unknown model {model!r} for the images workload; choose one of: "
                          f"{', '.join(RESNETS)}, each also with a {SMALL} suffix")
    return base, small


def state_values(model: str, num_classes: int) -> int:
    """Floating-point values in the model's state_dict (weights and BatchNorm statistics),
    counted from the table (tests/test_resources.py checks it against the built models)."""
    base, small = parse(model)
    block, stages = RESNETS[base]
    bottleneck = block == "bottleneck"
    expansion = 4 if bottleneck else 1
    stem = 3 if small else 7
    n, inplanes = 3 * 64 * stem * stem + _bn(64), 64
    for stage, count in enumerate(stages):
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
