"""The ``images`` workload, the guide's: a torchvision ResNet classifying images from an
ImageFolder tree (``--data-dir``), scikit-learn's digits (the embedded default) or synthetic
images (for throughput). Judged by validation accuracy (higher is better) and loss; SGD with
momentum, its lr from the linear scaling rule."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal, Optional

from labkit.core import params
from labkit.core.params import option
from labkit.core.config import ConfigError, TrainConfig
from labkit.workloads.contract import Figure, Workload
from labkit.workloads.datasets import Datasets

from . import architectures

DATASETS = ("imagefolder", "digits", "synthetic")
DIGITS_MAX_SIDE = 224  # 1.1 GiB of upsampled digits per process; above, a laptop runs out of memory
FLOAT = 4
INT64 = 8
DIGITS = 1797  # scikit-learn's digits: the images in its CSV
#: synthetic images are drawn from a pool of this many per dataset (image_sets.SyntheticImages)
SYNTHETIC_POOL = 64


def image_bytes(side: int) -> int:
    """One RGB image of ``side`` x ``side`` float32 pixels."""
    return 3 * side ** 2 * FLOAT


@dataclass
class ImagesOptions:
    num_classes: int = option(1000, "classes of the synthetic dataset", "data")
    image_size: Optional[int] = option(None, "image side the model sees: digits are upsampled to it "
                                       "(default 16, twice the scans' 8x8; at most 224), synthetic "
                                       "images drawn at it and imagefolder images cropped to it "
                                       "(default 32 for _small models, else 224)", "data")
    synthetic_samples: int = option(2048, "training samples in the synthetic dataset (val: a quarter)",
                                    "data")
    skip_bad_images: bool = option(False, "imagefolder: leave out images PIL cannot open or verify "
                                   "(truncated, not images, unreadable) with a warning, instead of "
                                   "stopping with an error naming them", "data")
    decode: Optional[Literal["gpu", "cpu"]] = option(
        None, "imagefolder: where JPEGs are decoded and augmented: gpu (loader workers read the "
        "files, torchvision's nvJPEG decoder and the transforms run on the GPU) or cpu (PIL in "
        "the loader workers); default: gpu on a GPU, else cpu", "data")


class Images(Workload):
    name, default = "images", True  # the guide's
    Options = ImagesOptions
    preload = ("torchvision", "labkit.workloads.images.models", "labkit.workloads.images.image_sets")
    worker_preload = ("torchvision.datasets", "torchvision.transforms",
                      "labkit.workloads.images.image_sets", "labkit.workloads.images.jpeg_files")
    title = "image classification"
    unit = "images"
    rate = "img/s"
    val_sum_keys = ("loss", "correct", "count")
    check_config = {"dataset": "digits", "model": "resnet10_small"}
    figures = (Figure("val_accuracy", "validation accuracy", "%", higher_is_better=True, short="acc"),
               Figure("val_loss", "validation loss", "", higher_is_better=False, short="loss"))

    @classmethod
    def resolve(cls, cfg: TrainConfig, cuda: bool, trainers: int) -> None:
        c = cfg
        if c.dataset is None:
            c.dataset = "imagefolder" if c.data_dir else ("synthetic" if cuda else "digits")
        if c.dataset not in DATASETS:
            raise ConfigError(f"unknown dataset {c.dataset!r} for the images workload; choose one "
                              f"of: {', '.join(DATASETS)}")
        if c.data_dir is None:
            c.data_dir = "./"
        if c.model is None:
            c.model = "resnet10_small" if c.dataset == "digits" else "resnet50"
        architectures.parse(c.model)  # an unknown name: one line
        if c.image_size is None:
            # digits at 16x16: as accurate as 32x32 after 3 epochs, at 3x the throughput on a
            # CPU (docs/performance.md)
            c.image_size = 16 if c.dataset == "digits" else 32 if c.model.endswith("_small") else 224
        cls._resolve_decode(c, cuda)
        for name in ("num_classes", "synthetic_samples", "image_size"):
            if getattr(c, name) < 1:
                raise ConfigError(f"{params.flag(name)} must be at least 1 (got {getattr(c, name)})")
        if c.dataset == "digits" and c.image_size > DIGITS_MAX_SIDE:
            # every process holds the upsampled set in memory
            gib = DIGITS * image_bytes(c.image_size) / 2**30
            raise ConfigError(f"--image-size {c.image_size} is too large for digits: the 8x8 scans "
                              f"are upsampled in memory, {gib:.1f} GiB in every process (at most "
                              f"{DIGITS_MAX_SIDE}; the default is 16)")
        super().resolve(cfg, cuda, trainers)

    @staticmethod
    def _resolve_decode(c: TrainConfig, cuda: bool) -> None:
        """--decode against the ranks' device (labkit.workloads.images.gpu_decode decodes on the
        GPU)."""
        if c.decode is None:
            c.decode = "gpu" if c.device == "cuda" else "cpu"
        if c.decode == "gpu" and c.device != "cuda":
            raise ConfigError("--decode gpu needs the ranks on a CUDA GPU" + (
                " and none is available (use --decode cpu)" if not cuda else
                " (--device cuda, or the default nccl backend)"))

    def shard_units(self, model) -> list[str]:
        """Each of the ResNet's four stages."""
        return [name for name in ("layer1", "layer2", "layer3", "layer4")
                if name in dict(model.named_children())]

    def check(self) -> Optional[Datasets]:
        """An image folder's layout and images (the ranks count them), else the in-memory
        sets; a weights file against the model."""
        from .image_sets import build_datasets, check_image_folder

        cfg, data = self.cfg, None
        if cfg.dataset == "imagefolder":
            classes = len(check_image_folder(cfg.data_dir, cfg.skip_bad_images))
        else:
            data = build_datasets(cfg)
            classes = data.num_classes
        if cfg.weights:  # torchvision (seconds to import) only to check a weights file
            from .models import build_model
            build_model(cfg.model, classes, cfg.weights)
        return data

    def datasets(self) -> Datasets:
        from .image_sets import build_datasets

        self._data = build_datasets(self.cfg)
        return self._data

    def build_model(self):
        from .models import build_model

        model, self.note = build_model(self.cfg.model, self.classes(), self.cfg.weights)
        return model

    def val_sums(self, output, target) -> dict:
        import torch.nn.functional as F

        return {"loss": F.cross_entropy(output.float(), target, reduction="sum"),
                "correct": (output.argmax(1) == target).sum(), "count": target.numel()}

    def val_figures(self, sums: dict[str, float]) -> dict[str, float]:
        n = max(1.0, sums["count"])
        return {"val_loss": sums["loss"] / n, "val_accuracy": 100.0 * sums["correct"] / n}

    def train_hits(self, output, target):
        return output.argmax(1) == target

    # ------------------------------------------------------------------ instruments
    def classes(self) -> int:
        """The number of classes, cheaply: the built datasets' count, else an image folder's
        class folders counted, not read (check_image_folder has checked them)."""
        data = getattr(self, "_data", None)
        if data is not None:
            return data.num_classes
        cfg = self.cfg
        if cfg.dataset == "imagefolder":
            train = os.path.join(cfg.data_dir, "train")
            return sum(1 for e in os.scandir(train) if e.is_dir())
        return 10 if cfg.dataset == "digits" else cfg.num_classes

    def state_values(self) -> int:
        # from the table the model factory builds from: neither torch nor torchvision imported
        return architectures.state_values(self.cfg.model, self.classes())

    @property
    def in_memory(self) -> bool:
        return self.cfg.dataset != "imagefolder"

    def sample_bytes(self) -> int:
        return image_bytes(self.cfg.image_size) + INT64

    def data_bytes(self) -> int:
        """The digits at the chosen side, and their upsampling (the synthetic images are a
        small pool; image folders are read from disk)."""
        if self.cfg.dataset == "digits":
            return DIGITS * image_bytes(self.cfg.image_size) * 2
        return 0

    def shared_bytes(self) -> int:
        """The digits once (the training and validation tensors) or the synthetic pools with
        their labels; an image folder's dataset is a list of paths."""
        if self.cfg.dataset == "digits":
            return DIGITS * self.sample_bytes()
        if self.cfg.dataset == "synthetic":
            n = self.cfg.synthetic_samples
            return 2 * SYNTHETIC_POOL * image_bytes(self.cfg.image_size) + (n + max(1, n // 4)) * INT64
        return 0

    def forward_flops(self, data: Datasets) -> Optional[int]:
        from .models import forward_flops

        return forward_flops(self.cfg.model, self.classes(), self.cfg.image_size)

    def fingerprint(self) -> dict:
        from .fingerprint import data_fingerprint

        return data_fingerprint(self.cfg)

    def summary_line(self, data: Datasets) -> str:
        c = self.cfg
        return f"{c.model} on {c.dataset} ({len(data.train)} train / {len(data.val)} val)"
