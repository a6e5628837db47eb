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

from . import builtins, params
from .builtins import BuiltinOptions
from .errors import ConfigError
from .methods import BASELINE, check_name, result_file_of, server_ranks

#: the workload a run trains unless --workload names another (its class declares it: the guide's)
DEFAULT_WORKLOAD = next(name for name, d in builtins.WORKLOADS.items() if d["default"])

__all__ = ["ConfigError", "TrainConfig", "VARIANTS", "DEFAULT_VARIANTS", "resolve_machine",
           "build_parser"]

Amp = Literal["off", "bf16", "fp16"]
Compress = Literal["none", "fp16", "bf16"]
Backend = Literal["nccl", "gloo"]
Device = Literal["cuda", "cpu"]
CompileBackend = Literal["inductor", "aot_eager", "eager"]
TimeComm = Literal["stats", "hook", "off"]

#: Named variants of the methods (labkit bench --variants, labkit experiment --methods):
#: name -> the TrainConfig fields that make it, as each method's class declares them
VARIANTS: dict[str, dict] = builtins.VARIANTS
DEFAULT_VARIANTS = builtins.BENCH_VARIANTS  # labkit bench


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
class General:
    """The settings of a run that are no method's or workload's own, flat as the flags are;
    each field belongs to one concern of GROUPS (its metadata's ``group``), under which
    ``--help`` lists it, and its help text says what it holds."""

    method: str = _f("method", BASELINE, "synchronisation method: ddp (DistributedDataParallel), allreduce "
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
    workload: str = _f("model", DEFAULT_WORKLOAD, "what is trained and how it is judged: images (the guide's "
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
                              "size, tiny | small | gpt2 (GPT-2 small, 124M) | shakespeare "
                              "(nanoGPT's 6x384x6) | cs336-small | cs336-medium | cs336-large "
                              "| cs336-xl | cs336-2.7b, or a shape LxDxH (layers x width x "
                              "heads, e.g. 6x384x6); default tiny (docs/workloads.md)")
    weights: Optional[str] = _f("model", None, "local state_dict to start from, loaded with "
                                "weights_only. images: e.g. resnet50-0676ba61.pth; a classifier "
                                "head of another size is re-initialised. lm: a warm start from "
                                "a labkit lm run's final_model.pt (or its method's folder), "
                                "of the same --model and --seq-len")
    lr: Optional[float] = _f("optimisation", None, "learning rate (default: the workload's; images: 0.1 x "
                             "global batch / 256, the linear scaling rule of Goyal et al.)")
    momentum: float = _f("optimisation", 0.9, "SGD momentum")
    weight_decay: Optional[float] = _f("optimisation", None, "weight decay (default: the workload's: "
                                       "1e-4 with SGD for images, 0.1 with AdamW for lm)")
    seed: int = _f("optimisation", 0, "seed for model init, data order and augmentation")
    grad_accum: int = _f("optimisation", 1, "gradient accumulation: each step's batch of --batch-size "
                         "computed as K micro-batches of batch/K (K must divide it), the loss of "
                         "each scaled by 1/K, the method communicating once per step where its "
                         "semantics put it (ddp: no_sync on all but the last); the activations' "
                         "memory is that of one micro-batch")
    grad_clip: Optional[float] = _f("optimisation", None, "clip the global gradient norm at this value "
                                    "before each optimizer step: the norm of the synchronised "
                                    "(averaged) gradient, over every shard for a sharded method, "
                                    "at the server for a parameter server, each inner step's for "
                                    "local SGD and DiLoCo; 0: off (default: the workload's: 1.0 for "
                                    "lm as nanoGPT's, off for images)")
    out: Optional[str] = _f("run", None, "folder for the result file, logs and final model "
                            "(default: runs/<date>_<time>_<method>; never overwritten)")
    max_steps_per_epoch: Optional[int] = _f("run", None, "cap on training steps per epoch, for quick runs")
    max_val_steps: Optional[int] = _f("run", None, "cap on validation batches per trainer, for quick runs")
    warmup_steps: int = _f("measurement", 3, "steps per epoch left out of the steady-state throughput")
    amp: Amp = _f("model", "off", "mixed precision on GPUs: off | bf16 | fp16")
    channels_last: bool = _f("model", False, "use channels_last memory format (GPUs)")
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
    options: dict = field(default_factory=dict, metadata={
        "help": "the options of a method or workload of one's own, by name (its Options "
                "dataclass makes their flags; a built-in's are fields of their own)",
        "group": "method", "flag": False})


@dataclass
class TrainConfig(BuiltinOptions, General):
    """One run's settings, flat as the flags are: the general fields (:class:`General`), every
    built-in method's and workload's options as their classes declare them
    (labkit.core.builtins.BuiltinOptions), and a plug-in's options in ``options``."""
    GROUPS: ClassVar[dict[str, str]] = GROUPS

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
        """The config as every record holds it (``options`` only where a plug-in has some)."""
        d = dataclasses.asdict(self)
        if not d["options"]:
            del d["options"]
        return d

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
    """--device against the machine."""
    if c.device is None:
        c.device = "cuda" if c.backend == "nccl" else "cpu"
    if c.device == "cuda" and not cuda_available:
        raise ConfigError("--device cuda needs a CUDA GPU and none is available (use --device cpu)")
    if c.backend == "nccl" and c.device != "cuda":
        raise ConfigError("backend nccl runs on GPUs only: --device cpu needs --backend gloo")


def _check_ranges(c: TrainConfig) -> None:
    """The general fields' ranges, then the options' (each as its owner declares it:
    labkit.core.params.option), of every built-in's, so a mistyped option is refused whichever
    method runs."""
    for name in ("epochs", "batch_size"):
        if getattr(c, name) < 1:
            raise ConfigError(f"{params.flag(name)} must be at least 1 (got {getattr(c, name)})")
    for name in ("max_steps_per_epoch", "max_val_steps"):
        v = getattr(c, name)
        if v is not None and v < 1:
            raise ConfigError(f"{params.flag(name)} must be at least 1 (got {v})")
    for name in ("workers", "warmup_steps", "calibrate_steps"):
        v = getattr(c, name)
        if v is not None and v < 0:
            raise ConfigError(f"{params.flag(name)} must be 0 or more (got {v})")
    if c.grad_accum < 1 or c.batch_size % c.grad_accum:
        raise ConfigError(f"--grad-accum must be at least 1 and divide --batch-size "
                          f"{c.batch_size} into equal micro-batches (got {c.grad_accum})")
    if c.grad_clip is not None and not c.grad_clip >= 0:
        raise ConfigError(f"--grad-clip must be 0 (off) or a positive norm (got {c.grad_clip})")
    for name in ("timeout", "loader_timeout"):
        if not getattr(c, name) > 0:
            raise ConfigError(f"{params.flag(name)} must be positive (got {getattr(c, name)})")
    params.check_ranges(c, tuple(f.name for f in dataclasses.fields(BuiltinOptions)))


def check_optimizer(c: TrainConfig) -> None:
    """The optimizer's settings, once the workload has decided its defaults."""
    if not c.lr > 0:
        raise ConfigError(f"--lr must be positive (got {c.lr})")
    if not 0 <= c.momentum < 1:
        raise ConfigError(f"--momentum must be in [0, 1) (got {c.momentum})")
    if c.weight_decay < 0:
        raise ConfigError(f"--weight-decay must be 0 or more (got {c.weight_decay})")
