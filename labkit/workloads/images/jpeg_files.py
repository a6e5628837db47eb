"""ImageFolder files for the GPU decoder (``--decode gpu``): the loader workers only read each
file's bytes (:class:`JpegFiles`), the rank decodes them on the GPU (labkit.training.gpu_data).
Its own module so that labkit.training.data can switch to it without importing the GPU path."""
from __future__ import annotations

import dataclasses
import os

import torch
from torch.utils.data import Dataset

from labkit.core.config import ConfigError, TrainConfig

JPEG_MAGIC = b"\xff\xd8\xff"


class JpegFiles(Dataset):
    """An ImageFolder's (path, class) list whose items are the files' bytes: the loader workers
    read, the rank decodes on the GPU."""

    def __init__(self, samples: list[tuple[str, int]], classes: list[str]):
        self.samples, self.classes = samples, classes

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        with open(self.samples[i][0], "rb") as f:
            data = f.read()
        return torch.frombuffer(bytearray(data), dtype=torch.uint8), self.samples[i][1], i


def collate_files(batch):
    """One flat byte tensor per batch (not one shared-memory tensor per file: 256 file
    descriptors a batch), the files' lengths, classes and indices."""
    data, labels, idx = zip(*batch)
    return (torch.cat(data), torch.tensor([len(d) for d in data]), torch.tensor(labels),
            torch.tensor(idx))


def is_jpeg(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(3) == JPEG_MAGIC
    except OSError:
        return False


def jpeg_files(data, cfg: TrainConfig):
    """The ImageFolder datasets of ``data`` as JpegFiles, for --decode gpu. A file that is not a
    JPEG (the GPU decoder reads JPEGs only) is bad input, left out with --skip-bad-images (every
    rank leaves out the same files, so the shards stay identical)."""
    out, left = [], []
    for ds in (data.train, data.val):
        keep = []
        for path, label in ds.samples:
            (keep if is_jpeg(path) else left).append((path, label))
        out.append(JpegFiles(keep, ds.classes))
    warning = data.warning
    if left:
        first = os.path.relpath(left[0][0], cfg.data_dir)
        if not cfg.skip_bad_images:
            raise ConfigError(
                f"{len(left)} image(s) under {cfg.data_dir!r} the GPU decoder cannot read (not "
                f"JPEG), the first: {first}; pass --decode cpu, or --skip-bad-images to leave "
                f"them out")
        note = f"--decode gpu: left out {len(left)} image(s) that are not JPEG, the first: {first}"
        warning = f"{warning}; {note}" if warning else note
    return dataclasses.replace(data, train=out[0], val=out[1], in_memory=False, warning=warning)
