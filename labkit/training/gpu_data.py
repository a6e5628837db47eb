"""Data on the GPU, so that a GPU run measures the methods rather than the data loader. It
knows no workload's datasets: it asks them for the optional parts documented in
labkit.workloads.datasets (issue 84).

- In-memory sets (a 2-tensor TensorDataset such as the digits, or a dataset's
  ``device_parts()`` such as the synthetic images): the samples sit on the device and each batch
  is gathered there (:class:`DeviceBatches`), as ``labkit bench`` cycles batches already on the
  device; the sampler, hence every trainer's indices and the batches' values, are those of the
  DataLoader path, bit for bit.
- A dataset with ``prepare`` (the images' JPEG files with ``--decode gpu``): loader workers
  only read and collate (its ``collate_fn``); a thread of the rank makes each batch ready on the
  device (its ``prepare``: for the JPEGs, nvJPEG decoding and the transforms) on a side stream,
  one batch ahead of the training step (:class:`PreparedBatches`). Same samples and sampler as
  the DataLoader path, so the same targets reach the same trainer in the same order.

On a CPU device (``--device cpu``) the DataLoaders of labkit.training.data are used unchanged
(but for a dataset with ``prepare``, which has no other path).
"""
from __future__ import annotations

import queue
import random
import threading
from contextlib import nullcontext
from typing import Optional

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, TensorDataset

from labkit.core.config import TrainConfig

from labkit.workloads.datasets import Datasets

from .data import make_loader
from .workers import batches, loader_options

# an in-memory set goes onto the GPU when it takes at most this share of the free memory
DEVICE_SHARE = 0.25
PREFETCH = 2  # prepared batches ready ahead of the step


# ---------------------------------------------------------------- in-memory sets on the device
class DeviceBatches:
    """The batches a DataLoader would make of an in-memory set (``drop_last`` as given), gathered
    on the device from images already there. ``pool``: the inputs are a pool indexed modulo
    its size (a dataset's ``device_parts()``, labkit.workloads.datasets)."""

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
    """(images, labels, pool) of an in-memory set moved to ``device``: a 2-tensor TensorDataset,
    or a dataset's ``device_parts()`` (labkit.workloads.datasets); None when it is another kind
    of set or would take more than DEVICE_SHARE of the free GPU memory."""
    if isinstance(ds, TensorDataset) and len(ds.tensors) == 2:
        (x, y), pool = ds.tensors, None
    elif hasattr(ds, "device_parts"):
        x, y, pool = ds.device_parts()
    else:
        return None
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        if x.numel() * x.element_size() > DEVICE_SHARE * free:
            return None
    return x.to(device), y.to(device), pool


# ---------------------------------------------------------------- prepared, one batch ahead
class PreparedBatches:
    """A loader of a dataset with ``prepare`` (labkit.workloads.datasets) whose batches come
    out ready on ``device``. ``generator``: seeded by the trainer per epoch; the dataset's
    random augmentation is drawn from it."""

    def __init__(self, files: DataLoader, device: torch.device, train: bool):
        self.files, self.device, self.train = files, device, train
        self.generator, self._live = torch.Generator(), None

    def __len__(self) -> int:
        return len(self.files)

    def __iter__(self):
        if self._live is not None:
            self._live.close()  # the DataLoader's (persistent) workers serve one iterator
        self._live = _Ahead(self, random.Random(self.generator.initial_seed()))
        return self._live

    def prepare(self, batch, rng: random.Random) -> tuple[torch.Tensor, torch.Tensor]:
        """One collated batch -> (inputs, targets) on the device, by its dataset."""
        return self.files.dataset.prepare(batch, self.device, self.train, rng)


class _Ahead:
    """One epoch's iterator: a thread reads, decodes and transforms the next batches on a side
    stream while the training step runs; the step's stream waits for a batch's event."""

    _END = object()

    def __init__(self, owner: PreparedBatches, rng: random.Random):
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
    if hasattr(data.train, "prepare"):  # made ready on the device (labkit.workloads.datasets)
        files = [DataLoader(ds, batch_size=cfg.batch_size, sampler=smp, num_workers=workers,
                            collate_fn=ds.collate_fn, drop_last=drop,
                            persistent_workers=workers > 0, prefetch_factor=4 if workers else None,
                            **loader_options(workers))
                 for ds, smp, drop in ((data.train, sampler, True), (data.val, val_sampler, False))]
        return PreparedBatches(files[0], device, True), PreparedBatches(files[1], device, False)
    if cuda:
        train, val = _on_device(data.train, device), _on_device(data.val, device)
        if train is not None and val is not None:
            return (DeviceBatches(*train, sampler, cfg.batch_size, drop_last=True),
                    DeviceBatches(*val, val_sampler, cfg.batch_size, drop_last=False))
    return (make_loader(data.train, sampler, cfg.batch_size, workers, cuda, drop_last=True, seed=seed,
                        persistent=False),  # reseeded per epoch (make_loader says why)
            make_loader(data.val, val_sampler, cfg.batch_size, workers, cuda, drop_last=False,
                        seed=cfg.seed))
