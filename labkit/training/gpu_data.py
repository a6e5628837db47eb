"""Data on the GPU, so that a GPU run measures the methods rather than the data loader.

- In-memory sets (synthetic, digits): the images sit on the device and each batch is gathered
  there (:class:`DeviceBatches`), as ``labkit bench`` cycles batches already on the device; the
  sampler, hence every trainer's indices and the batches' values, are those of the DataLoader
  path, bit for bit.
- ImageFolder JPEGs with ``--decode gpu``: loader workers only read the files
  (:class:`JpegFiles`); a thread of the rank decodes each batch with torchvision's nvJPEG
  decoder (``torchvision.io.decode_jpeg(list, device="cuda")``) and applies the standard
  transforms on the GPU (:func:`train_transform`, :func:`val_transform`) on a side stream, one
  batch ahead of the training step (:class:`DecodedBatches`). Same file list, classes and
  sampler as the CPU path, so the same labels reach the same trainer in the same order.

On a CPU device (``--device cpu``) the DataLoaders of labkit.training.data are used unchanged.
"""
from __future__ import annotations

import math
import queue
import random
import sys
import threading
from contextlib import nullcontext
from typing import Optional

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, Sampler, TensorDataset

from labkit.core.config import ConfigError, TrainConfig

from labkit.workloads.datasets import Datasets
from labkit.workloads.images.image_sets import IMAGENET_MEAN, IMAGENET_STD, SyntheticImages
from labkit.workloads.images.jpeg_files import JpegFiles, collate_files

from .data import make_loader
from .workers import batches, loader_options

# an in-memory set goes onto the GPU when it takes at most this share of the free memory
DEVICE_SHARE = 0.25
PREFETCH = 2  # decoded batches ready ahead of the step


# ---------------------------------------------------------------- in-memory sets on the device
class DeviceBatches:
    """The batches a DataLoader would make of an in-memory set (``drop_last`` as given), gathered
    on the device from images already there. ``pool``: the synthetic set's images are a pool
    indexed modulo its size (labkit.training.data.SyntheticImages)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, pool: Optional[int],
                 sampler: Sampler, batch_size: int, drop_last: bool):
        self.images, self.labels, self.pool = images, labels, pool
        self.sampler, self.batch_size, self.drop_last = sampler, batch_size, drop_last
        self.generator = torch.Generator()  # seeded per epoch by the trainer; nothing random here

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self):
        idx = torch.tensor(list(self.sampler), dtype=torch.int64)
        n = len(self) * self.batch_size if self.drop_last else len(idx)
        idx = idx[:n].to(self.labels.device)
        for i in range(0, n, self.batch_size):
            j = idx[i:i + self.batch_size]
            yield (self.images.index_select(0, j % self.pool if self.pool else j),
                   self.labels.index_select(0, j))


def _on_device(ds: Dataset, device: torch.device) -> Optional[tuple]:
    """(images, labels, pool) of an in-memory set moved to ``device``; None when it is another
    kind of set or would take more than DEVICE_SHARE of the free GPU memory."""
    if isinstance(ds, SyntheticImages):
        x, y, pool = ds.images, ds.labels, ds.POOL
    elif isinstance(ds, TensorDataset) and len(ds.tensors) == 2:
        (x, y), pool = ds.tensors, None
    else:
        return None
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        if x.numel() * x.element_size() > DEVICE_SHARE * free:
            return None
    return x.to(device), y.to(device), pool


# ---------------------------------------------------------------- JPEG files for GPU decoding
# ---------------------------------------------------------------- the transforms on the GPU
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


# ---------------------------------------------------------------- decoding, one batch ahead
def decode(data: torch.Tensor, lengths: torch.Tensor, device: torch.device) -> list[torch.Tensor]:
    """A batch of JPEG files (one flat byte tensor and their lengths) decoded to uint8 RGB
    CHW images on ``device``: nvJPEG on a GPU, batched (libjpeg on a CPU)."""
    import warnings

    from torchvision.io import ImageReadMode, decode_jpeg

    files = list(torch.split(data, lengths.tolist()))
    with warnings.catch_warnings():  # torchvision 0.29 points to TorchCodec (docs/performance.md)
        warnings.simplefilter("ignore", DeprecationWarning)
        return decode_jpeg(files, mode=ImageReadMode.RGB, device=device)


class DecodedBatches:
    """A loader of JpegFiles whose batches come out decoded and transformed on ``device``.
    ``generator``: seeded by the trainer per epoch; the crops and flips are drawn from it."""

    def __init__(self, files: DataLoader, device: torch.device, size: int, train: bool,
                 skip_bad: bool):
        self.files, self.device, self.size, self.train = files, device, size, train
        self.skip_bad, self.generator, self._live = skip_bad, torch.Generator(), None
        self.left_out: list[str] = []

    def __len__(self) -> int:
        return len(self.files)

    def __iter__(self):
        if self._live is not None:
            self._live.close()  # the DataLoader's (persistent) workers serve one iterator
        self._live = _Ahead(self, random.Random(self.generator.initial_seed()))
        return self._live

    def prepare(self, batch, rng: random.Random) -> tuple[torch.Tensor, torch.Tensor]:
        """One batch of files -> (images, labels) on the device."""
        data, lengths, labels, idx = batch
        try:
            images = decode(data, lengths, self.device)
        except RuntimeError:
            images, keep = self._one_by_one(data, lengths, idx)
            labels = labels[keep]
        x = train_transform(images, self.size, rng) if self.train else val_transform(images, self.size)
        return x, labels.to(self.device, non_blocking=True)

    def _one_by_one(self, data, lengths, idx) -> tuple[list[torch.Tensor], list[int]]:
        """After a batch failed: each file alone, naming the first the decoder cannot read
        (one line), or leaving such files out with --skip-bad-images."""
        images, keep, offsets = [], [], [0, *torch.cumsum(lengths, 0).tolist()]
        for k in range(len(lengths)):
            path = self.files.dataset.samples[int(idx[k])][0]
            try:
                images += decode(data[offsets[k]:offsets[k + 1]], lengths[k:k + 1], self.device)
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


class _Ahead:
    """One epoch's iterator: a thread reads, decodes and transforms the next batches on a side
    stream while the training step runs; the step's stream waits for a batch's event."""

    _END = object()

    def __init__(self, owner: DecodedBatches, rng: random.Random):
        self.owner, self.rng, self.stop = owner, rng, threading.Event()
        self.q: queue.Queue = queue.Queue(maxsize=PREFETCH)
        dev = owner.device
        self.stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None
        self.thread = threading.Thread(target=self._work, name="labkit-decode", daemon=True)
        self.thread.start()

    def _work(self) -> None:
        try:
            if self.stream is not None:
                torch.cuda.set_device(self.owner.device)  # the current device is per thread
            with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
                for batch in batches(self.owner.files):
                    if self.stop.is_set():
                        return
                    x, y = self.owner.prepare(batch, self.rng)
                    ev = None
                    if self.stream is not None:
                        ev = torch.cuda.Event()
                        ev.record(self.stream)
                    self._put((x, y, ev))
            self._put(self._END)
        except BaseException as e:  # noqa: BLE001 - raised again in the training thread
            self._put(e)

    def _put(self, item) -> None:
        while not self.stop.is_set():
            try:
                self.q.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def __iter__(self):
        return self

    def __next__(self):
        item = self.q.get()
        if item is self._END:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        x, y, ev = item
        if ev is not None:
            cur = torch.cuda.current_stream(self.owner.device)
            cur.wait_event(ev)
            x.record_stream(cur)  # made on the side stream, used (and freed) on this one
            y.record_stream(cur)
        return x, y

    def close(self) -> None:
        self.stop.set()
        while self.thread.is_alive():
            try:
                self.q.get(timeout=0.1)
            except queue.Empty:
                pass
        self.thread.join()


# ---------------------------------------------------------------- the trainer's loaders
def make_loaders(cfg: TrainConfig, data: Datasets, sampler: Sampler, val_sampler: Sampler,
                 workers: int, device: torch.device, seed: int):
    """(train loader, validation loader) of one trainer: on a CPU device, and for sets that
    stay on the host, labkit.training.data's DataLoaders, unchanged."""
    cuda = device.type == "cuda"
    if isinstance(data.train, JpegFiles):
        files = [DataLoader(ds, batch_size=cfg.batch_size, sampler=smp, num_workers=workers,
                            collate_fn=collate_files, drop_last=drop,
                            persistent_workers=workers > 0, prefetch_factor=4 if workers else None,
                            **loader_options(workers))
                 for ds, smp, drop in ((data.train, sampler, True), (data.val, val_sampler, False))]
        return (DecodedBatches(files[0], device, cfg.image_size, True, cfg.skip_bad_images),
                DecodedBatches(files[1], device, cfg.image_size, False, cfg.skip_bad_images))
    if cuda:
        train, val = _on_device(data.train, device), _on_device(data.val, device)
        if train is not None and val is not None:
            return (DeviceBatches(*train, sampler, cfg.batch_size, drop_last=True),
                    DeviceBatches(*val, val_sampler, cfg.batch_size, drop_last=False))
    return (make_loader(data.train, sampler, cfg.batch_size, workers, cuda, drop_last=True, seed=seed,
                        persistent=False),  # reseeded per epoch (make_loader says why)
            make_loader(data.val, val_sampler, cfg.batch_size, workers, cuda, drop_last=False,
                        seed=cfg.seed))
