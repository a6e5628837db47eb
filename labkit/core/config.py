"""One typed config for a training run.

Every flag of ``python -m labkit.train`` is a field here, with its help text next to it, so the
command line, the papermill parameters cell and the config logged into every result file are
the same thing. A field's annotation is its type for every reader (labkit.core.params): a
``Literal`` lists its choices. ``None`` means automatic; :func:`resolve` decides it once,
against the machine.
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Optional

from . import params
from .errors import ConfigError
from .methods import check_name, result_file_of, server_ranks

__all__ = ["ConfigError", "TrainConfig", "VARIANTS", "DEFAULT_VARIANTS", "resolve_machine",
           "build_parser"]

Amp = Literal["off", "bf16", "fp16"]
PSMode = Literal["collective", "p2p"]
Compress = Literal["none", "fp16", "bf16"]
Backend = Literal["nccl", "gloo"]
Device = Literal["cuda", "cpu"]
Decode = Literal["gpu", "cpu"]
CompileBackend = Literal["inductor", "aot_eager", "eager"]
TimeComm = Literal["stats", "hook", "off"]

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
    "ddp-bf16": dict(method="ddp", compress="bf16"),
    "allreduce-fp16": dict(method="allreduce", compress="fp16"),
    "ps-fp16": dict(method="ps", ps_mode="collective", compress="fp16"),
}
DEFAULT_VARIANTS = ("ddp", "allreduce", "ps", "ps-p2p")  # labkit bench


#: the concerns TrainConfig's fields are grouped by (each field's ``group``), in the order
#: ``--help`` lists them; the flags themselves are flat (``--batch-size``, not ``--data.batch-size``)
GROUPS = {
    "method": "the method: how the ranks synchronise, and its own options",
    "data": "the data: which set, where, how it is read and decoded",
    "model": "the model and its numerics",
    "optimisation": "optimisation: epochs, batch and SGD",
    "measurement": "measurement: what is timed and checked, and how",
    "run": "the run: where results go, how long it may take, continuing",
}


def _f(group: str, default: Any, help: str, **meta: Any) -> Any:
    """A field of concern ``group`` (GROUPS) with its help text (and e.g. ``aliases``:
    {flag: value}, labkit.core.params)."""
    assert group in GROUPS, group
    return field(default=default, metadata={"help": help, "group": group, **meta})


@dataclass
class TrainConfig:
    """One run's settings, flat as the flags are; each field belongs to one concern of GROUPS
    (its metadata's ``group``), under which ``--help`` lists it, and its help text says what it
    holds."""
    GROUPS: ClassVar[dict[str, str]] = GROUPS

    method: str = _f("method", "ddp", "synchronisation method: ddp (DistributedDataParallel), allreduce "
                     "(hand-written bucketed all-reduce), ps (parameter server on rank 0), an "
                     "installed package's method, or your own class as path/to/file.py:Class or "
                     "package.module:Class (docs/methods.md)")
    # --- the original guide's flags, unchanged ---
    epochs: int = _f("optimisation", 3, "epochs to train")
    batch_size: Optional[int] = _f("optimisation", None, "batch size per training process (for PS: per worker; "
                                   "default: 64 with GPUs, 32 on a CPU)")
    workers: Optional[int] = _f("data", None, "DataLoader worker processes per rank (default: for the "
                                "in-memory digits/synthetic sets 0, or up to 4 on GPUs with nccl; "
                                "else min(8, CPUs per local rank))")
    data_dir: Optional[str] = _f("data", None, "dataset root holding train/ and val/ with one folder per "
                                 "class (imagefolder; default ./)")
    backend: Optional[Backend] = _f("method", None, "process-group backend (default: nccl with GPUs, gloo "
                                    "without)")
    # --- the lab's own flags ---
    device: Optional[Device] = _f("method", None, "where each rank computes: cuda (GPU local_rank) or cpu "
                                  "(default: cuda with nccl, cpu with gloo); --backend gloo "
                                  "--device cuda runs several ranks on one GPU, gloo moving CUDA "
                                  "tensors (tests of the CUDA code paths without one GPU per rank)")
    workload: str = _f("model", "images", "what is trained and how it is judged: images (the guide's "
                       "ResNet image classifiers), lm (a decoder-only transformer language "
                       "model), or your own class as path/to/file.py:Class or "
                       "package.module:Class (docs/workloads.md)")
    dataset: Optional[str] = _f("data", None, "images: imagefolder | digits | synthetic (default: "
                                "imagefolder when --data-dir is given, else digits without GPUs, "
                                "synthetic with GPUs); lm: embedded | text | tokens (default: "
                                "embedded, the Python source of the pinned torch; text or tokens "
                                "from --data-dir)")
    model: Optional[str] = _f("model", None, "images: resnet50 | resnet18 | resnet10, plain or with a "
                              "_small suffix (3x3 stem, no max-pool, for small images); default: "
                              "resnet10_small on digits, else resnet50. lm: the transformer's "
                              "size, tiny | small | gpt2 (GPT-2 small, 124M); default tiny "
                              "(docs/workloads.md)")
    seq_len: Optional[int] = _f("data", None, "lm: tokens in a sample's context window (default: 64 for "
                                "tiny, 256 for small, 1024 for gpt2)")
    weights: Optional[str] = _f("model", None, "local state_dict to start from (e.g. resnet50-0676ba61.pth); "
                                "loaded with weights_only; a classifier head of another size is "
                                "re-initialised")
    num_classes: int = _f("data", 1000, "classes of the synthetic dataset")
    image_size: Optional[int] = _f("data", None, "image side the model sees: digits are upsampled to it "
                                   "(default 16, twice the scans' 8x8; at most 224), synthetic "
                                   "images drawn at it and imagefolder images cropped to it "
                                   "(default 32 for _small models, else 224)")
    synthetic_samples: int = _f("data", 2048, "training samples in the synthetic dataset (val: a quarter)")
    skip_bad_images: bool = _f("data", False, "imagefolder: leave out images PIL cannot open or verify "
                               "(truncated, not images, unreadable) with a warning, instead of "
                               "stopping with an error naming them")
    decode: Optional[Decode] = _f("data", None, "imagefolder: where JPEGs are decoded and augmented: gpu "
                                  "(loader workers read the files, torchvision's nvJPEG decoder "
                                  "and the transforms run on the GPU) or cpu (PIL in the loader "
                                  "workers); default: gpu on a GPU, else cpu")
    lr: Optional[float] = _f("optimisation", None, "learning rate (default: the workload's; images: 0.1 x "
                             "global batch / 256, the linear scaling rule of Goyal et al.)")
    momentum: float = _f("optimisation", 0.9, "SGD momentum")
    weight_decay: Optional[float] = _f("optimisation", None, "weight decay (default: the workload's: "
                                       "1e-4 with SGD for images, 0.1 with AdamW for lm)")
    seed: int = _f("optimisation", 0, "seed for model init, data order and augmentation")
    out: Optional[str] = _f("run", None, "folder for the result file, logs and final model "
                            "(default: runs/<date>_<time>_<method>; never overwritten)")
    max_steps_per_epoch: Optional[int] = _f("run", None, "cap on training steps per epoch, for quick runs")
    max_val_steps: Optional[int] = _f("run", None, "cap on validation batches per trainer, for quick runs")
    warmup_steps: int = _f("measurement", 3, "steps per epoch left out of the steady-state throughput")
    amp: Amp = _f("model", "off", "mixed precision on GPUs: off | bf16 | fp16")
    channels_last: bool = _f("model", False, "use channels_last memory format (GPUs)")
    bucket_mb: float = _f("method", 25.0, "allreduce and ps collective: gradient bucket size in MiB (the "
                          "first bucket, the first gradients backward produces, at most 1 MiB "
                          "as in DDP)")
    no_overlap: bool = _f("method", False, "allreduce: all-reduce after backward instead of overlapping it")
    ps_mode: PSMode = _f("method", "collective", "ps: collective (flat reduce + broadcast) or p2p (the "
                         "guide's per-tensor send/recv)")
    ps_servers: int = _f("method", 1, "ps: server ranks (0..K-1); K > 1 shards the flattened parameters "
                         "across them, each server owning one slice (collective mode)")
    ps_staleness: Optional[int] = _f("method", None, "ps: asynchronous with bounded staleness S: the server "
                                     "applies each worker's gradient as it arrives and a worker "
                                     "runs at most S steps ahead of the slowest (default: "
                                     "synchronous)")
    time_comm: TimeComm = _f("measurement", "stats", "how communication is timed for the report's breakdown of "
                             "a step: stats (DDP: its reducer's own runtime statistics, read "
                             "every step, DDP's built-in C++ path untouched; the other methods: "
                             "every collective from its start to its completion), hook (DDP: a "
                             "communication hook doing what its built-in all-reduce does, "
                             "timing each bucket; the others: as stats), off (no communication "
                             "timings; --no-time-comm is the same)",
                             aliases={"--no-time-comm": "off"})
    check_replicas: bool = _f("measurement", True, "at the end of every epoch, compare every rank's parameters "
                              "and buffers (a checksum per tensor: the integer sum of its 32-bit "
                              "words); a rank whose copy differs stops the run, naming the rank "
                              "and the tensor (--no-check-replicas: for timing studies)")
    calibrate_steps: int = _f("measurement", 4, "compute-only steps after the last epoch (synchronisation "
                              "skipped, the model restored afterwards; two untimed steps before "
                              "them): the compute time the report's breakdown of a step starts "
                              "from (0: none)")
    compress: Compress = _f("method", "none", "gradient compression for communication: none | fp16 | "
                            "bf16 (allreduce and ps send fp16 gradients; ddp uses PyTorch's "
                            "fp16_compress_hook or bf16_compress_hook)")
    powersgd_rank: int = _f("method", 2, "powersgd: rank of the low-rank approximation of each gradient "
                            "matrix (PowerSGDState's matrix_approximation_rank; 2 matched SGD's "
                            "accuracy on CIFAR-10 ResNets in Vogels et al., 2019)")
    powersgd_start_iter: int = _f("method", 10, "powersgd: steps of plain all-reduce before compression "
                                  "starts (PowerSGDState's start_powerSGD_iter; at least 2)")
    find_unused_parameters: bool = _f("method", False, "let the model have parameters that a step "
                                      "gives no gradient (a forward that uses some layers on "
                                      "some batches only): ddp and powersgd pass it to DDP, "
                                      "which then walks the autograd graph from the outputs "
                                      "after every forward to find them, a cost each step "
                                      "(the other methods need no flag for them). Without it the "
                                      "check before a run refuses such a model, naming them")
    local_steps: int = _f("method", 8, "localsgd and diloco: local optimizer steps H between two "
                          "synchronisations (no gradient communication in between)")
    outer_lr: float = _f("method", 0.7, "diloco: the outer optimizer's learning rate (Nesterov SGD on the "
                         "averaged parameter change; 0.7 as in Douillard et al., 2023)")
    outer_momentum: float = _f("method", 0.9, "diloco: the outer optimizer's Nesterov momentum (0.9 as in "
                               "Douillard et al., 2023)")
    compile: bool = _f("model", False, "torch.compile the model (GPUs; the first steps compile and count "
                       "as warm-up)")
    compile_backend: CompileBackend = _f("model", "inductor", "torch.compile's backend with --compile: "
                                         "inductor (generates kernels), aot_eager (the same graph "
                                         "capture without code generation: seconds instead of "
                                         "minutes on a CPU), eager")
    timeout: float = _f("run", 600.0, "seconds a collective may wait before the run is aborted (a hung "
                        "or dead rank ends the run after this long)")
    debug_collectives: bool = _f("run", False, "check before every collective that all ranks call the "
                                 "same one with the same shapes, and name the ranks and shapes "
                                 "when they differ (torch's TORCH_DISTRIBUTED_DEBUG=DETAIL; "
                                 "slower: for debugging a method, not for measuring)")
    loader_timeout: float = _f("run", 120.0, "seconds a rank waits for a batch from its DataLoader "
                               "workers before the run fails naming the rank and the loader (a "
                               "worker stopped, stuck or far too slow); unused with --workers 0")
    resume: bool = _f("run", False, "continue from the last epoch checkpoint in --out (also automatic "
                      "after a torchrun --max-restarts restart)")
    checkpoint: bool = _f("run", True, "write checkpoint.pt after every epoch, to --resume from "
                          "(--no-checkpoint: none, for a folder short of space; no --resume)")
    progress: bool = _f("run", True, "show tqdm progress bars (--no-progress to turn off)")
    pin_cpus: bool = _f("measurement", True, "without GPUs: bind each rank to its even share of the cores "
                        "(Linux; where no even share exists, e.g. 3 ranks on 2 cores, the OS "
                        "places them), so that where the OS puts the ranks does not change a "
                        "launch's speed (--no-pin-cpus: the OS places them)")

    # --- helpers ---
    def __post_init__(self):
        # configs recorded before time_comm had modes hold a bool: True was the hook
        if isinstance(self.time_comm, bool):
            self.time_comm = "hook" if self.time_comm else "off"

    @property
    def times_comm(self) -> bool:
        """Whether communication is timed at all (--time-comm stats or hook)."""
        return self.time_comm != "off"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def trainers(self, world_size: int) -> int:
        """Ranks that train: all of them, less a parameter server's server ranks."""
        return world_size - server_ranks(self.method, self.ps_servers)

    @property
    def result_file(self) -> str:
        return result_file_of(self.method)


def build_parser(prog: str = "labkit.train") -> argparse.ArgumentParser:
    """An argparse parser whose flags are TrainConfig's fields (``batch_size`` -> ``--batch-size``)."""
    p = argparse.ArgumentParser(
        prog=prog,
        description="Train an image classifier with one of three data-parallel methods. "
        "Launch with torchrun, e.g. torchrun --nproc_per_node=4 -m labkit.train --method ps",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    params.add_arguments(p, TrainConfig)
    return p


def from_args(ns: argparse.Namespace) -> TrainConfig:
    return params.from_namespace(TrainConfig, ns)


# ------------------------------------------------------------------ resolving "auto"
def resolve_machine(c: TrainConfig, cuda_available: bool) -> TrainConfig:
    """Fill in, in place, the automatic (None) fields the machine decides (batch size, backend,
    device) and check the ranges every workload shares; return ``c``.

    Raises ConfigError with one line naming the problem. The rest is the workload's
    (labkit.workloads.resolve: dataset, model, input size, learning rate) and the method's
    (how many processes a parameter server needs, which PS options combine: the strategy
    classes', checked by labkit.training.preflight.preflight).
    """
    check_name(c.method)
    for name, ft in params.field_types(TrainConfig).items():
        if not ft.allows(getattr(c, name)):
            raise ConfigError(f"unknown {name} {getattr(c, name)!r}; choose one of: "
                              f"{', '.join(ft.choices)}")
    _resolve_machine(c, cuda_available)
    _check_ranges(c)
    return c


def default_batch_size(cuda_available: bool) -> int:
    """64 per process with GPUs (the guide's), 32 on a CPU: the embedded default, `labkit
    experiment` and run_method.ipynb alike."""
    return 64 if cuda_available else 32


def _resolve_machine(c: TrainConfig, cuda_available: bool) -> None:
    if c.batch_size is None:
        c.batch_size = default_batch_size(cuda_available)
    if c.backend is None:
        c.backend = "nccl" if cuda_available else "gloo"
    if c.backend == "nccl" and not cuda_available:
        raise ConfigError("backend nccl needs CUDA GPUs and none is available; use --backend gloo")
    _resolve_device(c, cuda_available)


def _resolve_device(c: TrainConfig, cuda_available: bool) -> None:
    """--device and --decode against the machine (labkit.training.gpu_data decodes on the GPU)."""
    if c.device is None:
        c.device = "cuda" if c.backend == "nccl" else "cpu"
    if c.device == "cuda" and not cuda_available:
        raise ConfigError("--device cuda needs a CUDA GPU and none is available (use --device cpu)")
    if c.backend == "nccl" and c.device != "cuda":
        raise ConfigError("backend nccl runs on GPUs only: --device cpu needs --backend gloo")
    if c.decode is None:
        c.decode = "gpu" if c.device == "cuda" else "cpu"
    if c.decode == "gpu" and c.device != "cuda":
        raise ConfigError("--decode gpu needs the ranks on a CUDA GPU" + (
            " and none is available (use --decode cpu)" if not cuda_available else
            " (--device cuda, or the default nccl backend)"))


def _check_ranges(c: TrainConfig) -> None:
    for name in ("epochs", "batch_size", "local_steps", "powersgd_rank"):
        if getattr(c, name) < 1:
            raise ConfigError(f"{params.flag(name)} must be at least 1 (got {getattr(c, name)})")
    for name in ("max_steps_per_epoch", "max_val_steps", "seq_len"):
        v = getattr(c, name)
        if v is not None and v < 1:
            raise ConfigError(f"{params.flag(name)} must be at least 1 (got {v})")
    for name in ("workers", "warmup_steps", "ps_staleness", "calibrate_steps"):
        v = getattr(c, name)
        if v is not None and v < 0:
            raise ConfigError(f"{params.flag(name)} must be 0 or more (got {v})")
    if c.ps_servers < 1:
        raise ConfigError(f"--ps-servers must be at least 1 (got {c.ps_servers})")
    if c.powersgd_start_iter < 2:  # PowerSGDState asserts it (error feedback, warm start)
        raise ConfigError(f"--powersgd-start-iter must be at least 2: PyTorch's PowerSGD takes "
                          f"two plain all-reduce steps first (got {c.powersgd_start_iter})")
    for name in ("bucket_mb", "timeout", "loader_timeout"):
        if not getattr(c, name) > 0:
            raise ConfigError(f"{params.flag(name)} must be positive (got {getattr(c, name)})")


def check_optimizer(c: TrainConfig) -> None:
    """The optimizer's settings, once the workload has decided its defaults."""
    if not c.lr > 0:
        raise ConfigError(f"--lr must be positive (got {c.lr})")
    if not 0 <= c.momentum < 1:
        raise ConfigError(f"--momentum must be in [0, 1) (got {c.momentum})")
    if c.weight_decay < 0:
        raise ConfigError(f"--weight-decay must be 0 or more (got {c.weight_decay})")
    if not c.outer_lr > 0:
        raise ConfigError(f"--outer-lr must be positive (got {c.outer_lr})")
    if not 0 <= c.outer_momentum < 1:
        raise ConfigError(f"--outer-momentum must be in [0, 1) (got {c.outer_momentum})")
