"""ImageFolder files for the GPU decoder (``--decode gpu``): the loader workers only read each
file's bytes (:class:`JpegFiles`), the rank decodes and transforms them on the GPU
(:meth:`JpegFiles.prepare`, with :mod:`.gpu_decode`), one batch ahead of the step
(labkit.training.gpu_data.PreparedBatches, which knows no JPEG: labkit.workloads.datasets
documents what it asks of a dataset)."""
from __future__ import annotations

import dataclasses
import os
import random
import sys

import torch
from torch.utils.data import Dataset

from labkit.core.config import ConfigError, TrainConfig

from .gpu_decode import decode, train_transform, val_transform

JPEG_MAGIC = b"\xff\xd8\xff"


def collate_files(batch):
    """One flat byte tensor per batch (not one shared-memory tensor per file: 256 file
    descriptors a batch), the files' lengths, classes and indices."""
    data, labels, idx = zip(*batch)
    return (torch.cat(data), torch.tensor([len(d) for d in data]), torch.tensor(labels),
            torch.tensor(idx))


class JpegFiles(Dataset):
    """An ImageFolder's (path, class) list whose items are the files' bytes: the loader workers
    read, the rank decodes on the GPU. A dataset whose batches are made ready on the device
    (labkit.workloads.datasets): :attr:`collate_fn` and :meth:`prepare`. ``size``: the side
    the model sees; ``skip_bad``: --skip-bad-images, for a file only the decoder finds bad."""

    collate_fn = staticmethod(collate_files)  # a module function: pickled to workers by name

    def __init__(self, samples: list[tuple[str, int]], classes: list[str], size: int,
                 skip_bad: bool):
        self.samples, self.classes, self.size, self.skip_bad = samples, classes, size, skip_bad
        self.left_out: list[str] = []  # the files the decoder could not read, in the rank

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        with open(self.samples[i][0], "rb") as f:
            data = f.read()
        return torch.frombuffer(bytearray(data), dtype=torch.uint8), self.samples[i][1], i

    def prepare(self, batch, device: torch.device, train: bool,
                rng: random.Random) -> tuple[torch.Tensor, torch.Tensor]:
        """One batch of files -> (images, labels) on the device; the training crops and flips
        drawn from ``rng``."""
        data, lengths, labels, idx = batch
        try:
            images = decode(data, lengths, device)
        except RuntimeError:
            images, keep = self._one_by_one(data, lengths, idx, device)
            labels = labels[keep]
        x = train_transform(images, self.size, rng) if train else val_transform(images, self.size)
        return x, labels.to(device, non_blocking=True)

    def _one_by_one(self, data, lengths, idx, device) -> tuple[list[torch.Tensor], list[int]]:
        """After a batch failed: each file alone, naming the first the decoder cannot read
        (one line), or leaving such files out with --skip-bad-images."""
        images, keep, offsets = [], [], [0, *torch.cumsum(lengths, 0).tolist()]
        for k in range(len(lengths)):
            path = self.samples[int(idx[k])][0]
            try:
                images += decode(data[offsets[k]:offsets[k + 1]], lengths[k:k + 1], device)
                keep.append(k)
            except RuntimeError as e:
                why = " ".join(str(e).split())[:120]
                if not self.skip_bad:
                    raise ConfigError(f"the GPU JPEG decoder cannot read {path} ({why}); pass "
                                      f"--decode cpu, or --skip-bad-images to leave it out") from None
                if not self.left_out:
                    print(f"labkit.train: warning: --skip-bad-images: the GPU JPEG decoder cannot "
                          f"read {path} ({why}); left out", file=sys.stderr, flush=True)
                self.left_out.append(path)
        if not images:
            raise ConfigError(f"the GPU JPEG decoder could read no image of a batch, e.g. {path}; "
                              f"pass --decode cpu")
        return images, keep


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
        out.append(JpegFiles(keep, ds.classes, cfg.image_size, cfg.skip_bad_images))
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
