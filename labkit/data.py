"""Datasets (imagefolder, digits, synthetic), trainer shards and loaders.

Every method reads data the same way: trainer k of T gets shard k of T from a
DistributedSampler with the same arguments, so equal trainer counts see identical batches.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, TensorDataset

from .config import ConfigError, TrainConfig

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


@dataclass
class Datasets:
    train: Dataset
    val: Dataset
    num_classes: int
    in_memory: bool  # tensors already in RAM: loader workers would only add overhead


# ---------------------------------------------------------------- imagefolder
def check_image_folder(root: str) -> list[str]:
    """Check the guide's layout (root/train/<class>/*, root/val/<class>/*); return the classes.

    Raises ConfigError naming what is wrong, before any process group or GPU is touched.
    """
    if not os.path.isdir(root):
        raise ConfigError(f"data dir {root!r} does not exist (pass --data-dir DIR holding train/ and val/)")
    for split in ("train", "val"):
        if not os.path.isdir(os.path.join(root, split)):
            raise ConfigError(f"data dir {root!r} has no {split}/ folder (expected {split}/<class>/<image>)")
    classes = {}
    for split in ("train", "val"):
        d = os.path.join(root, split)
        found = sorted(e.name for e in os.scandir(d) if e.is_dir())
        if not found:
            raise ConfigError(f"{d!r} has no class folders (expected {split}/<class>/<image>)")
        empty = [c for c in found if not _has_image(os.path.join(d, c))]
        if len(empty) == len(found):
            raise ConfigError(f"{d!r} holds no images ({', '.join(IMG_EXTENSIONS)})")
        if empty:
            raise ConfigError(f"class folder(s) without images in {d!r}: {', '.join(empty[:5])}")
        classes[split] = found
    missing = sorted(set(classes["train"]) - set(classes["val"]))
    extra = sorted(set(classes["val"]) - set(classes["train"]))
    if missing or extra:
        what = (f"train/ classes missing from val/: {', '.join(missing[:5])}" if missing
                else f"val/ classes not in train/: {', '.join(extra[:5])}")
        raise ConfigError(f"{root!r}: {what}")
    return classes["train"]


def _has_image(d: str) -> bool:
    for _, _, files in os.walk(d):
        if any(f.lower().endswith(IMG_EXTENSIONS) for f in files):
            return True
    return False


def _image_folder(cfg: TrainConfig) -> Datasets:
    from torchvision import datasets, transforms

    check_image_folder(cfg.data_dir)
    norm = transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)
    size = cfg.image_size
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(size), transforms.RandomHorizontalFlip(),
        transforms.ToTensor(), norm])
    val_tf = transforms.Compose([
        transforms.Resize(int(round(size * 256 / 224))), transforms.CenterCrop(size),
        transforms.ToTensor(), norm])
    train = datasets.ImageFolder(os.path.join(cfg.data_dir, "train"), train_tf)
    val = datasets.ImageFolder(os.path.join(cfg.data_dir, "val"), val_tf)
    return Datasets(train, val, len(train.classes), in_memory=False)


# ---------------------------------------------------------------- digits
def _digits(cfg: TrainConfig) -> Datasets:
    """scikit-learn's 1,797 real 8x8 handwritten digits (shipped with the package), as RGB 32x32."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0       # N,1,8,8 in [0,1]
    x = torch.nn.functional.interpolate(x, size=(32, 32), mode="bilinear", align_corners=False)
    y = torch.tensor(d.target, dtype=torch.int64)
    # a fixed stratified split: the same 80/20 on every machine, whatever --seed says
    idx_train, idx_val = train_test_split(range(len(y)), test_size=0.2, stratify=d.target,
                                          random_state=0)
    mean, std = x[idx_train].mean(), x[idx_train].std()
    x = ((x - mean) / std).expand(-1, 3, -1, -1).contiguous()
    return Datasets(TensorDataset(x[idx_train], y[idx_train]), TensorDataset(x[idx_val], y[idx_val]),
                    10, in_memory=True)


# ---------------------------------------------------------------- synthetic
class SyntheticImages(Dataset):
    """Random images of the model's input shape, for throughput: a small pool reused by index,
    so making a sample costs nothing and the loader never limits the measurement."""

    POOL = 64

    def __init__(self, length: int, image_size: int, num_classes: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.length = length
        self.images = torch.randn(self.POOL, 3, image_size, image_size, generator=g)
        self.labels = torch.randint(0, num_classes, (length,), generator=g)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int):
        return self.images[i % self.POOL], self.labels[i]


def _synthetic(cfg: TrainConfig) -> Datasets:
    n = cfg.synthetic_samples
    return Datasets(SyntheticImages(n, cfg.image_size, cfg.num_classes, seed=1),
                    SyntheticImages(max(1, n // 4), cfg.image_size, cfg.num_classes, seed=2),
                    cfg.num_classes, in_memory=True)


def build_datasets(cfg: TrainConfig) -> Datasets:
    return {"imagefolder": _image_folder, "digits": _digits, "synthetic": _synthetic}[cfg.dataset](cfg)


# ---------------------------------------------------------------- shards and loaders
class ShardSampler(Sampler[int]):
    """Shard k of T of a dataset in order, without the padding DistributedSampler adds, so
    validation counts every sample exactly once over all trainers."""

    def __init__(self, n: int, num_shards: int, shard: int):
        self.indices = list(range(shard, n, num_shards))

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def train_sampler(ds: Dataset, trainers: int, trainer: int, seed: int) -> DistributedSampler:
    # drop_last: every trainer gets the same number of samples, hence of steps (collectives match)
    return DistributedSampler(ds, num_replicas=trainers, rank=trainer, shuffle=True, seed=seed,
                              drop_last=True)


def steps_per_epoch(n_train: int, trainers: int, batch_size: int, cap: Optional[int]) -> int:
    if n_train < trainers:
        raise ConfigError(f"{trainers} training processes but only {n_train} training samples")
    steps = (n_train // trainers) // batch_size
    if steps == 0:
        raise ConfigError(
            f"batch size {batch_size} x {trainers} trainer(s) is more than the {n_train} training "
            f"samples: no full batch per trainer (lower --batch-size)")
    return min(steps, cap) if cap else steps


def default_workers(cfg: TrainConfig, in_memory: bool, local_world_size: int) -> int:
    if cfg.workers is not None:
        return cfg.workers
    if in_memory:
        return 0
    return max(1, min(8, (os.cpu_count() or 1) // max(1, local_world_size)))


def make_loader(ds: Dataset, sampler: Sampler, batch_size: int, workers: int, pin: bool,
                drop_last: bool, seed: int) -> DataLoader:
    return DataLoader(
        ds, batch_size=batch_size, sampler=sampler, num_workers=workers, pin_memory=pin,
        drop_last=drop_last, persistent_workers=workers > 0,
        # seeds the workers' augmentation RNG: same seed, same crops on a rerun
        generator=torch.Generator().manual_seed(seed),
    )

