"""Model factory: torchvision ResNets, an optional small-image stem, local weights only."""
from __future__ import annotations

import os
from collections.abc import Mapping

import torch
from torch import nn
from torchvision.models.resnet import BasicBlock, Bottleneck, ResNet

from . import architectures
from labkit.core.config import ConfigError

_BLOCKS = {"basic": BasicBlock, "bottleneck": Bottleneck}


def build_model(name: str, num_classes: int, weights: str | None = None) -> tuple[nn.Module, str]:
    """Return (model, note). ``name`` is resnet10|18|50 with an optional ``_small`` suffix
    (labkit.core.architectures: the table)."""
    base, small = architectures.parse(name)
    block, layers = architectures.RESNETS[base]
    model = ResNet(_BLOCKS[block], list(layers), num_classes=num_classes)
    if small:
        # small inputs (16-32 px): a 3x3 stride-1 stem and no max-pool keep the 4 stages' resolution
        model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    note = ""
    if weights:
        note = load_weights(model, weights, name)
    return model, note


def read_state_dict(path: str) -> Mapping[str, torch.Tensor]:
    if not os.path.isfile(path):
        raise ConfigError(f"weights file {path!r} not found (pretrained weights are only read "
                          f"from a local file; nothing is downloaded)")
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file gets the same one-line message
        raise ConfigError(f"weights file {path!r} is not a loadable state_dict "
                          f"({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
    if isinstance(sd, Mapping) and "state_dict" in sd and isinstance(sd["state_dict"], Mapping):
        sd = sd["state_dict"]
    if not isinstance(sd, Mapping) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise ConfigError(f"weights file {path!r} does not hold a state_dict of tensors")
    return {k.removeprefix("module."): v for k, v in sd.items()}


def load_weights(model: nn.Module, path: str, name: str) -> str:
    sd = dict(read_state_dict(path))
    own = model.state_dict()
    missing = sorted(set(own) - set(sd))
    unexpected = sorted(set(sd) - set(own))
    bad_shape = sorted(k for k in set(own) & set(sd) if own[k].shape != sd[k].shape)
    head = {"fc.weight", "fc.bias"}
    if missing or unexpected or set(bad_shape) - head:
        first = (missing or unexpected or bad_shape)[0]
        raise ConfigError(
            f"weights file {path!r} does not match model {name}: "
            f"{len(missing)} missing, {len(unexpected)} unexpected, {len(bad_shape)} mis-shaped "
            f"tensors (first: {first})")
    note = f"loaded weights from {path}"
    if bad_shape:  # another class count: keep the backbone, start the classifier afresh
        for k in bad_shape:
            sd[k] = own[k]
        note += f" (classifier re-initialised for {own['fc.weight'].shape[0]} classes)"
    model.load_state_dict(sd)
    return note


def forward_flops(model: str, num_classes: int, image_size: int) -> int:
    """FLOPs of one forward of one image (torch.utils.flop_counter: convolutions and matrix
    products, 2 per multiply-add), counted on the meta device: no memory, no compute, nothing
    of the training model touched."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        net, _ = build_model(model, num_classes)
        x = torch.empty(1, 3, image_size, image_size)
    # eval mode: the same FLOPs, and BatchNorm takes one image at 1x1 (8 px inputs reach that)
    with FlopCounterMode(display=False) as counter:
        net.eval()(x)
    return int(counter.get_total_flops())
