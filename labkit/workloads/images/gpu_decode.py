"""The images' GPU decode and transforms for ``--decode gpu`` (:class:`~.jpeg_files.JpegFiles`'s
``prepare``): a batch of JPEG files decoded with torchvision's nvJPEG decoder
(``torchvision.io.decode_jpeg(list, device="cuda")``) and the CPU path's transforms applied on
the device (:func:`train_transform`, :func:`val_transform`), wherever the images are (the CPU
device runs the same code: tests/test_gpu_data.py)."""
from __future__ import annotations

import math
import random

import torch
import torch.nn.functional as F

# ImageNet's per-channel statistics, which both paths normalise with: here, not in image_sets
# (the CPU path's transforms, which imports them from here), since image_sets reaches this
# module through jpeg_files and an import back would close a circle
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def crop_box(h: int, w: int, rng: random.Random, scale=(0.08, 1.0),
             ratio=(3 / 4, 4 / 3)) -> tuple[int, int, int, int]:
    """RandomResizedCrop's box (top, left, height, width), torchvision's rule: ten tries at a
    random area and log-uniform aspect, else the whole image clamped to the ratios."""
    area, lo, hi = h * w, math.log(ratio[0]), math.log(ratio[1])
    for _ in range(10):
        target = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(lo, hi))
        cw, ch = int(round(math.sqrt(target * aspect))), int(round(math.sqrt(target / aspect)))
        if 0 < cw <= w and 0 < ch <= h:
            return rng.randint(0, h - ch), rng.randint(0, w - cw), ch, cw
    if w / h < ratio[0]:
        cw, ch = w, int(round(w / ratio[0]))
    elif w / h > ratio[1]:
        ch, cw = h, int(round(h * ratio[1]))
    else:
        cw, ch = w, h
    return (h - ch) // 2, (w - cw) // 2, ch, cw


def _resize(img: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """A uint8 CHW image to float (0-255) at h x w: bilinear with antialiasing, as PIL resizes."""
    return F.interpolate(img.unsqueeze(0).float(), size=(h, w), mode="bilinear",
                         antialias=True, align_corners=False)[0]


def _normalize(x: torch.Tensor) -> torch.Tensor:
    mean = torch.tensor(IMAGENET_MEAN, device=x.device).view(1, 3, 1, 1) * 255
    std = torch.tensor(IMAGENET_STD, device=x.device).view(1, 3, 1, 1) * 255
    return x.sub_(mean).div_(std)


def train_transform(images: list[torch.Tensor], size: int, rng: random.Random) -> torch.Tensor:
    """RandomResizedCrop(size) + RandomHorizontalFlip + ToTensor + Normalize on decoded uint8
    CHW images, wherever they are: a float batch N x 3 x size x size."""
    out = torch.empty(len(images), 3, size, size, device=images[0].device)
    flips = []
    for i, img in enumerate(images):
        t, l, ch, cw = crop_box(img.shape[-2], img.shape[-1], rng)
        out[i] = _resize(img[:, t:t + ch, l:l + cw], size, size)
        flips.append(rng.random() < 0.5)
    flip = torch.tensor(flips, device=out.device).view(-1, 1, 1, 1)
    return _normalize(torch.where(flip, out.flip(-1), out))


def val_transform(images: list[torch.Tensor], size: int) -> torch.Tensor:
    """Resize(round(size x 256/224)) + CenterCrop(size) + ToTensor + Normalize, as the CPU
    path's validation transform."""
    short = int(round(size * 256 / 224))
    out = torch.empty(len(images), 3, size, size, device=images[0].device)
    for i, img in enumerate(images):
        h, w = img.shape[-2:]
        nh, nw = (short, int(short * w / h)) if h <= w else (int(short * h / w), short)
        top, left = int(round((nh - size) / 2.0)), int(round((nw - size) / 2.0))
        out[i] = _resize(img, nh, nw)[:, top:top + size, left:left + size]
    return _normalize(out)


def decode(data: torch.Tensor, lengths: torch.Tensor, device: torch.device) -> list[torch.Tensor]:
    """A batch of JPEG files (one flat byte tensor and their lengths) decoded to uint8 RGB
    CHW images on ``device``: nvJPEG on a GPU, batched (libjpeg on a CPU)."""
    import warnings

    from torchvision.io import ImageReadMode, decode_jpeg

    files = list(torch.split(data, lengths.tolist()))
    with warnings.catch_warnings():  # torchvision 0.29 points to TorchCodec (docs/performance.md)
        warnings.simplefilter("ignore", DeprecationWarning)
        return decode_jpeg(files, mode=ImageReadMode.RGB, device=device)
