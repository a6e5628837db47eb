"""One typed config for a training run.

Every flag of ``python -m labkit.train`` is a field here, with its help text next to it, so the
command line, the papermill parameters cell and the config logged into every result file are
the same thing.  ``auto`` values are resolved once, by :func:`resolve`, against the machine.
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

METHODS = ("ddp", "allreduce", "ps")
DATASETS = ("imagefolder", "digits", "synthetic")
DIGITS_MAX_SIDE = 224  # 1.1 GiB of upsampled digits per process; above, a laptop runs out of memory
MODELS = ("resnet50", "resnet18", "resnet10", "resnet50_small", "resnet18_small", "resnet10_small")
AMP_MODES = ("off", "bf16", "fp16")
PS_MODES = ("collective", "p2p")
COMPRESS = ("none", "fp16")
BACKENDS = ("nccl", "gloo")

# The guide's result file per method (contract: names and "method" strings are the guide's).
RESULT_FILES = {
    "ddp": "results_baseline_ddp.json",
    "allreduce": "results_all_reduce.json",
    "ps": "results_ps.json",
}
METHOD_NAMES = {
    "ddp": "Baseline DDP (PyTorch)",
    "allreduce": "Manual All-Reduce",
    "ps": "Parameter Server (PS)",
}

#: Named variants of the methods (labkit bench --variants, labkit experiment --methods):
#: name -> the TrainConfig fields that make it
VARIANTS: dict[str, dict] = {
    "ddp": dict(method="ddp"),
    "allreduce": dict(method="allreduce"),
    "ps": dict(method="ps", ps_mode="collective"),
    "ps-p2p": dict(method="ps", ps_mode="p2p"),
    "ps-sharded": dict(method="ps", ps_mode="collective", ps_servers=2),
    "ps-async": dict(method="ps", ps_mode="collective", ps_staleness=2),
    "ddp-fp16": dict(method="ddp", compress="fp16"),
    "allreduce-fp16": dict(method="allreduce", compress="fp16"),
    "ps-fp16": dict(method="ps", ps_mode="collective", compress="fp16"),
}
DEFAULT_VARIANTS = ("ddp", "allreduce", "ps", "ps-p2p")  # labkit bench


class ConfigError(ValueError):
    """Bad input: shown to the user as one line, never as a traceback."""

    def _render_traceback_(self) -> list[str]:
        # IPython shows this instead of the traceback in a notebook cell (JupyterLab, papermill):
        # the frames of labkit's own checks would bury the one line that says what to change
        return [f"\x1b[0;31m{type(self).__name__}\x1b[0m: {self}"]


def _f(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class TrainConfig:
    method: str = _f("ddp", "synchronisation method: ddp (DistributedDataParallel), allreduce "
                     "(hand-written bucketed all-reduce), ps (parameter server on rank 0)",
                     choices=METHODS)
    # --- the original guide's flags, unchanged ---
    epochs: int = _f(3, "epochs to train")
    batch_size: int = _f(64, "batch size per training process (for PS: per worker)")
    workers: Optional[int] = _f(None, "DataLoader worker processes per rank (default: 0 for the "
                                "in-memory digits/synthetic sets, else min(8, CPUs per local rank))")
    data_dir: Optional[str] = _f(None, "dataset root holding train/ and val/ with one folder per "
                                 "class (imagefolder; default ./)")
    backend: Optional[str] = _f(None, "process-group backend (default: nccl with GPUs, gloo without)",
                                choices=BACKENDS)
    # --- the lab's own flags ---
    dataset: Optional[str] = _f(None, "imagefolder | digits | synthetic (default: imagefolder when "
                                "--data-dir is given, else digits without GPUs, synthetic with GPUs)",
                                choices=DATASETS)
    model: Optional[str] = _f(None, "resnet50 | resnet18 | resnet10, plain or with a _small suffix "
                              "(3x3 stem, no max-pool, for small images); default: resnet10_small "
                              "on digits, else resnet50", choices=MODELS)
    weights: Optional[str] = _f(None, "local state_dict to start from (e.g. resnet50-0676ba61.pth); "
                                "loaded with weights_only; a classifier head of another size is "
                                "re-initialised")
    num_classes: int = _f(1000, "classes of the synthetic dataset")
    image_size: Optional[int] = _f(None, "image side the model sees: digits are upsampled to it (default "
                                   "16, twice the scans' 8x8; at most 224), synthetic images drawn at it and "
                                   "imagefolder images cropped to it (default 32 for _small models, "
                                   "else 224)")
    synthetic_samples: int = _f(2048, "training samples in the synthetic dataset (val: a quarter)")
    skip_bad_images: bool = _f(False, "imagefolder: leave out images PIL cannot open or verify "
                               "(truncated, not images, unreadable) with a warning, instead of "
                               "stopping with an error naming them")
    lr: Optional[float] = _f(None, "SGD learning rate (default: 0.1 x global batch / 256, the "
                             "linear scaling rule of Goyal et al.)")
    momentum: float = _f(0.9, "SGD momentum")
    weight_decay: float = _f(1e-4, "SGD weight decay")
    seed: int = _f(0, "seed for model init, data order and augmentation")
    out: Optional[str] = _f(None, "folder for the result file, logs and final model "
                            "(default: runs/<date>_<time>_<method>; never overwritten)")
    max_steps_per_epoch: Optional[int] = _f(None, "cap on training steps per epoch, for quick runs")
    max_val_steps: Optional[int] = _f(None, "cap on validation batches per trainer, for quick runs")
    warmup_steps: int = _f(3, "steps per epoch left out of the steady-state throughput")
    amp: str = _f("off", "mixed precision on GPUs: off | bf16 | fp16", choices=AMP_MODES)
    channels_last: bool = _f(False, "use channels_last memory format (GPUs)")
    bucket_mb: float = _f(25.0, "allreduce and ps collective: gradient bucket size in MiB (the "
                          "first bucket, the first gradients backward produces, at most 1 MiB "
                          "as in DDP)")
    no_overlap: bool = _f(False, "allreduce: all-reduce after backward instead of overlapping it")
    ps_mode: str = _f("collective", "ps: collective (flat reduce + broadcast) or p2p (the guide's "
                      "per-tensor send/recv)", choices=PS_MODES)
    ps_servers: int = _f(1, "ps: server ranks (0..K-1); K > 1 shards the flattened parameters "
                         "across them, each server owning one slice (collective mode)")
    ps_staleness: Optional[int] = _f(None, "ps: asynchronous with bounded staleness S: the server "
                                     "applies each worker's gradient as it arrives and a worker "
                                     "runs at most S steps ahead of the slowest (default: "
                                     "synchronous)")
    compress: str = _f("none", "gradient compression for communication: none | fp16 (allreduce "
                       "and ps send fp16 gradients; ddp uses its fp16_compress_hook)",
                       choices=COMPRESS)
    compile: bool = _f(False, "torch.compile the model (GPUs; the first steps compile and count "
                       "as warm-up)")
    timeout: float = _f(600.0, "seconds a collective may wait before the run is aborted (a hung "
                        "or dead rank ends the run after this long)")
    resume: bool = _f(False, "continue from the last epoch checkpoint in --out (also automatic "
                      "after a torchrun --max-restarts restart)")
    progress: bool = _f(True, "show tqdm progress bars (--no-progress to turn off)")
    pin_cpus: bool = _f(True, "without GPUs: bind each rank to its even share of the cores (Linux; "
                        "where no even share exists, e.g. 3 ranks on 2 cores, the OS places them), "
                        "so that where the OS puts the ranks does not change a launch's speed "
                        "(--no-pin-cpus: the OS places them)")

    # --- helpers ---
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def trainers(self, world_size: int) -> int:
        """Ranks that train: all of them, except a parameter server's server ranks."""
        return world_size - self.ps_servers if self.method == "ps" else world_size

    @property
    def result_file(self) -> str:
        return RESULT_FILES[self.method]


def build_parser(prog: str = "labkit.train") -> argparse.ArgumentParser:
    """An argparse parser whose flags are TrainConfig's fields (``batch_size`` -> ``--batch-size``)."""
    p = argparse.ArgumentParser(
        prog=prog,
        description="Train an image classifier with one of three data-parallel methods. "
        "Launch with torchrun, e.g. torchrun --nproc_per_node=4 -m labkit.train --method ps",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_config_arguments(p)
    return p


def add_config_arguments(p: argparse.ArgumentParser, skip: tuple = (), defaults: bool = True) -> None:
    """One flag per TrainConfig field. ``defaults=False`` leaves flags that were not given out
    of the namespace, so they can override a parameters file."""
    for f in dataclasses.fields(TrainConfig):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        help_ = f.metadata["help"]
        if f.type in (bool, "bool"):
            # a flag whose name is already a negation (--no-overlap) has one form: no --no-no-...
            action = "store_true" if f.name.startswith("no_") else argparse.BooleanOptionalAction
            p.add_argument(flag, dest=f.name, action=action,
                           default=f.default if defaults else argparse.SUPPRESS, help=help_)
            continue
        typ = {"int": int, "float": float, "Optional[int]": int, "Optional[float]": float}.get(
            str(f.type), str)
        p.add_argument(flag, dest=f.name, type=typ, help=help_,
                       default=f.default if defaults else argparse.SUPPRESS,
                       choices=f.metadata.get("choices"), metavar=None)


def config_from_args(ns: argparse.Namespace) -> TrainConfig:
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in vars(ns).items() if k in names})


def resolve(cfg: TrainConfig, cuda_available: bool, world_size: int = 1) -> TrainConfig:
    """Fill in every ``auto`` (None) field for this machine and check ranges.

    Raises ConfigError with one line naming the problem.
    """
    c = dataclasses.replace(cfg)
    for name, choices in (("method", METHODS), ("dataset", DATASETS), ("model", MODELS),
                          ("amp", AMP_MODES), ("ps_mode", PS_MODES), ("backend", BACKENDS),
                          ("compress", COMPRESS)):
        v = getattr(c, name)
        if v is not None and v not in choices:
            raise ConfigError(f"unknown {name} {v!r}; choose one of: {', '.join(choices)}")
    if c.backend is None:
        c.backend = "nccl" if cuda_available else "gloo"
    if c.backend == "nccl" and not cuda_available:
        raise ConfigError("backend nccl needs CUDA GPUs and none is available; use --backend gloo")
    if c.dataset is None:
        c.dataset = "imagefolder" if c.data_dir else ("synthetic" if cuda_available else "digits")
    if c.data_dir is None:
        c.data_dir = "./"
    if c.model is None:
        c.model = "resnet10_small" if c.dataset == "digits" else "resnet50"
    if c.image_size is None:
        # digits at 16x16: 3x the throughput of 32x32 on CPU and as accurate after 3 epochs
        # (2026-11-23, 4 gloo ranks on 2 cores: 167 vs 58 img/s, val 99.2% vs 96.4%)
        c.image_size = 16 if c.dataset == "digits" else 32 if c.model.endswith("_small") else 224
    for name in ("epochs", "batch_size", "num_classes", "synthetic_samples", "image_size"):
        if getattr(c, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(c, name)})")
    if c.dataset == "digits" and c.image_size > DIGITS_MAX_SIDE:
        # every process holds the upsampled set in memory: 1,797 x 3 x side^2 floats
        gib = 1797 * 3 * c.image_size ** 2 * 4 / 2**30
        raise ConfigError(f"--image-size {c.image_size} is too large for digits: the 8x8 scans are "
                          f"upsampled in memory, {gib:.1f} GiB in every process (at most "
                          f"{DIGITS_MAX_SIDE}; the default is 16)")
    for name in ("max_steps_per_epoch", "max_val_steps"):
        v = getattr(c, name)
        if v is not None and v < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1 (got {v})")
    if c.workers is not None and c.workers < 0:
        raise ConfigError(f"--workers must be 0 or more (got {c.workers})")
    if c.lr is None:
        trainers = max(1, c.trainers(world_size))
        c.lr = 0.1 * c.batch_size * trainers / 256
    if not c.lr > 0:
        raise ConfigError(f"--lr must be positive (got {c.lr})")
    if not 0 <= c.momentum < 1:
        raise ConfigError(f"--momentum must be in [0, 1) (got {c.momentum})")
    if c.weight_decay < 0:
        raise ConfigError(f"--weight-decay must be 0 or more (got {c.weight_decay})")
    if c.warmup_steps < 0:
        raise ConfigError(f"--warmup-steps must be 0 or more (got {c.warmup_steps})")
    if not c.bucket_mb > 0:
        raise ConfigError(f"--bucket-mb must be positive (got {c.bucket_mb})")
    if c.ps_servers < 1:
        raise ConfigError(f"--ps-servers must be at least 1 (got {c.ps_servers})")
    if c.ps_staleness is not None and c.ps_staleness < 0:
        raise ConfigError(f"--ps-staleness must be 0 or more (got {c.ps_staleness})")
    if c.method == "ps" and c.ps_servers > 1 and c.ps_mode != "collective":
        raise ConfigError("--ps-servers > 1 (sharded PS) needs --ps-mode collective")
    if c.method == "ps" and c.ps_staleness is not None and c.ps_servers > 1:
        raise ConfigError("--ps-staleness (asynchronous PS) runs with one server; drop --ps-servers")
    if c.method == "ps" and c.ps_mode == "p2p" and c.ps_staleness is not None:
        raise ConfigError("--ps-staleness (asynchronous PS) has its own protocol; drop --ps-mode p2p")
    if c.method == "ps" and c.ps_mode == "p2p" and c.compress != "none":
        raise ConfigError("--compress with ps needs --ps-mode collective (p2p is the guide's "
                          "uncompressed reference)")
    if not c.timeout > 0:
        raise ConfigError(f"--timeout must be positive (got {c.timeout})")
    return c
