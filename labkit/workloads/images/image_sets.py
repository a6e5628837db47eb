"""The images workload's datasets: an image folder (the guide's layout), scikit-learn's digits,
synthetic images; and the checks of an image folder before anything is spawned."""
from __future__ import annotations

import importlib.util
import os
import sys
from collections import Counter
from typing import Optional

import torch
from torch.utils.data import Dataset, TensorDataset

from labkit.core.config import ConfigError, TrainConfig
from labkit.workloads.datasets import Datasets

from .gpu_decode import IMAGENET_MEAN, IMAGENET_STD

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


# ---------------------------------------------------------------- imagefolder
def check_image_folder(root: str, skip_bad_images: bool = False, progress: bool = True) -> list[str]:
    """Check the guide's layout (root/train/<class>/*, root/val/<class>/*) and that PIL can read
    every image (:func:`find_bad_images`); return the classes.

    Raises ConfigError naming what is wrong, before any process group or GPU is touched.  With
    ``skip_bad_images`` unreadable images are not an error, unless they leave a class empty.
    """
    return _check_image_folder(root, skip_bad_images, progress)[0]


def _check_image_folder(root: str, skip_bad_images: bool, progress: bool
                        ) -> tuple[list[str], list[tuple[str, str]]]:
    """check_image_folder, also returning the bad images as (path under root, reason)."""
    classes = _check_layout(root)
    files, bad = find_bad_images(root, progress)
    if bad and not skip_bad_images:
        first, why = bad[0]
        raise ConfigError(
            f"{len(bad)} unreadable or corrupt image(s) under {root!r}, the first: "
            f"{os.path.join(root, first)} ({why}); fix or delete them, or pass --skip-bad-images "
            f"(skip_bad_images=True) to leave them out")
    if bad:
        left = Counter(tuple(f.split(os.sep)[:2]) for f in files)
        left.subtract(tuple(f.split(os.sep)[:2]) for f, _ in bad)
        for split in ("train", "val"):
            empty = [c for c in classes if left[(split, c)] <= 0]
            if empty:
                raise ConfigError(
                    f"class folder(s) in {os.path.join(root, split)!r} with no readable image left "
                    f"after --skip-bad-images left out {len(bad)} bad image(s): {', '.join(empty[:5])}")
    return classes, bad


def _check_layout(root: str) -> list[str]:
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


# Unreadable images (truncated downloads, HTML pages saved as .jpg, files without read
# permission) would otherwise crash a DataLoader worker in the middle of an epoch, on one rank.
# find_bad_images() finds them up front: PIL reads and verifies each file, in a thread pool
# (the work is I/O and C code). It runs in the launcher before spawning and again in every
# rank (torchrun may be used without the launcher, and all ranks must leave out the same
# files or their shards differ); after the first scan the files sit in the OS page cache, so
# the later scans cost a fraction of the first.


def _why(e: BaseException) -> str:
    from PIL import UnidentifiedImageError

    if isinstance(e, UnidentifiedImageError):
        return "not an image PIL can read"
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    text = " ".join(str(e).split())[:120]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def check_image(path: str) -> Optional[str]:
    """None if PIL can open and verify the image, else why not (one short line)."""
    from PIL import Image

    try:
        with open(path, "rb") as f:
            im = Image.open(f)
            fmt = im.format
            im.verify()  # PNG: walks every chunk and checks its CRC (catches truncation)
            if fmt in ("JPEG", "MPO"):
                # verify() does not look past a JPEG's header, yet a JPEG cut short (the
                # commonest corruption) fails when a loader decodes it. A whole JPEG ends with
                # the EOI marker FF D9; only a file without it near its end pays for a decode.
                size = f.seek(0, os.SEEK_END)
                f.seek(max(0, size - 1024))
                if b"\xff\xd9" not in f.read():
                    f.seek(0)
                    Image.open(f).load()
    except Exception as e:  # noqa: BLE001 - PIL raises OSError, SyntaxError, ValueError, ...
        return _why(e)
    return None


def find_bad_images(root: str, progress: bool = True) -> tuple[list[str], list[tuple[str, str]]]:
    """Every image under root/train and root/val (paths under root, sorted), and those PIL
    cannot open or verify, as (path under root, reason)."""
    from concurrent.futures import ThreadPoolExecutor

    from tqdm import tqdm

    from labkit.core.log import Lines

    files = sorted(os.path.relpath(os.path.join(d, f), root)
                   for split in ("train", "val")
                   for d, _, names in os.walk(os.path.join(root, split), followlinks=True)
                   for f in names if f.lower().endswith(IMG_EXTENSIONS))
    tty = sys.stderr.isatty()
    bar = tqdm(total=len(files), desc=f"checking images in {root}", unit="img", delay=2.0,
               disable=not progress, mininterval=0.5 if tty else 5.0,
               file=sys.stderr if tty else Lines(sys.stderr))  # shows itself after 2 s only
    with bar, ThreadPoolExecutor(min(32, 4 * (os.cpu_count() or 1))) as pool:
        reasons = []
        for why in pool.map(check_image, (os.path.join(root, f) for f in files), chunksize=64):
            reasons.append(why)
            bar.update(1)
    return files, [(f, why) for f, why in zip(files, reasons) if why is not None]


def _image_folder(cfg: TrainConfig) -> Datasets:
    from torchvision import datasets, transforms

    _, bad = _check_image_folder(cfg.data_dir, cfg.skip_bad_images, cfg.progress)
    valid_file, warning = None, None
    if bad:  # only with --skip-bad-images: _check_image_folder raised otherwise
        leave_out = {os.path.normpath(os.path.join(cfg.data_dir, f)) for f, _ in bad}

        def valid_file(path: str) -> bool:  # ImageFolder's own test, less the bad files
            return path.lower().endswith(IMG_EXTENSIONS) and os.path.normpath(path) not in leave_out

        shown = ", ".join(f for f, _ in bad[:3]) + (", ..." if len(bad) > 3 else "")
        warning = (f"--skip-bad-images: left out {len(bad)} unreadable or corrupt image(s) under "
                   f"{cfg.data_dir!r}: {shown}")
    norm = transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)
    size = cfg.image_size
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(size), transforms.RandomHorizontalFlip(),
        transforms.ToTensor(), norm])
    val_tf = transforms.Compose([
        transforms.Resize(int(round(size * 256 / 224))), transforms.CenterCrop(size),
        transforms.ToTensor(), norm])
    train = datasets.ImageFolder(os.path.join(cfg.data_dir, "train"), train_tf, is_valid_file=valid_file)
    val = datasets.ImageFolder(os.path.join(cfg.data_dir, "val"), val_tf, is_valid_file=valid_file)
    return Datasets(train, val, in_memory=False, warning=warning, num_classes=len(train.classes))


# ---------------------------------------------------------------- digits
def _digits_file() -> str:
    """scikit-learn's digits.csv.gz, found without importing scikit-learn (which would cost
    every rank about a second of start-up for a 1,797-row CSV)."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("--dataset digits needs scikit-learn, which ships the images: "
                        "pip install scikit-learn")
    path = os.path.join(spec.submodule_search_locations[0], "datasets", "data", "digits.csv.gz")
    if not os.path.isfile(path):
        raise ConfigError(f"scikit-learn's digits file is missing: {path}")
    return path


def stratified_split(y: torch.Tensor, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """A fixed stratified split: each class's indices shuffled by ``seed``, the first
    round(val_fraction x class size) of them to validation."""
    g = torch.Generator().manual_seed(seed)
    train, val = [], []
    for c in torch.unique(y).tolist():
        idx = torch.nonzero(y == c).flatten()
        idx = idx[torch.randperm(len(idx), generator=g)].tolist()
        k = round(val_fraction * len(idx))
        val += idx[:k]
        train += idx[k:]
    return sorted(train), sorted(val)


def _digits(cfg: TrainConfig) -> Datasets:
    """scikit-learn's 1,797 real 8x8 handwritten digits (shipped with the package), as RGB images
    of side ``cfg.image_size`` (bilinear upsampling)."""
    import numpy as np

    raw = torch.from_numpy(np.loadtxt(_digits_file(), delimiter=",", dtype=np.float32))
    x = raw[:, :64].reshape(-1, 1, 8, 8) / 16.0                                # N,1,8,8 in [0,1]
    side = cfg.image_size
    x = torch.nn.functional.interpolate(x, size=(side, side), mode="bilinear", align_corners=False)
    y = raw[:, 64].to(torch.int64)
    # the same 80/20 on every machine, whatever --seed says
    idx_train, idx_val = stratified_split(y, 0.2, seed=0)
    mean, std = x[idx_train].mean(), x[idx_train].std()
    x = ((x - mean) / std).expand(-1, 3, -1, -1).contiguous()
    return Datasets(TensorDataset(x[idx_train], y[idx_train]), TensorDataset(x[idx_val], y[idx_val]),
                    in_memory=True, num_classes=10)


# ---------------------------------------------------------------- synthetic
class SyntheticImages(Dataset):
    """Random images of the model's input shape, for throughput: a small pool reused by index,
    so making a sample costs nothing and the loader never limits the measurement."""

    POOL = 64  # the package's SYNTHETIC_POOL, which /dev/shm's preflight counts without torch

    def __init__(self, length: int, image_size: int, num_classes: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.length = length
        self.images = torch.randn(self.POOL, 3, image_size, image_size, generator=g)
        self.labels = torch.randint(0, num_classes, (length,), generator=g)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int):
        return self.images[i % self.POOL], self.labels[i]

    def device_parts(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """A dataset that can live on the device (labkit.workloads.datasets): the pool, every
        sample's label, and the pool's size (sample i's image is the pool's i mod POOL)."""
        return self.images, self.labels, self.POOL


def _synthetic(cfg: TrainConfig) -> Datasets:
    n = cfg.synthetic_samples
    return Datasets(SyntheticImages(n, cfg.image_size, cfg.num_classes, seed=1),
                    SyntheticImages(max(1, n // 4), cfg.image_size, cfg.num_classes, seed=2),
                    in_memory=True, num_classes=cfg.num_classes)


def build_datasets(cfg: TrainConfig) -> Datasets:
    data = {"imagefolder": _image_folder, "digits": _digits, "synthetic": _synthetic}[cfg.dataset](cfg)
    if cfg.dataset == "imagefolder" and cfg.decode == "gpu":
        from .jpeg_files import jpeg_files  # the workers read the files, the GPU decodes them

        data = jpeg_files(data, cfg)
    return data


