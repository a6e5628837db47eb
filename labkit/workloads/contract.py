"""The workload contract: what a run trains and how it is judged (docs/workloads.md).

A workload answers the trainer five questions and nothing else: the model; the train and
validation data; the loss of a batch; how many units (images, tokens) a sample holds; and the
validation figures, each with its direction and unit. The trainer, the methods, the instruments,
the cost model and the report know a workload only through this class: the report's words
(tokens/s or img/s, loss or accuracy, a target above or below) come from :meth:`describe`,
which every result file records.

The built-ins are ``images`` (labkit.workloads.images) and ``lm`` (labkit.workloads.lm); a
user's is a subclass named as ``path/to/file.py:Class`` (labkit.workloads.catalog).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import ClassVar, Optional

from labkit.core import params
from labkit.core.config import TrainConfig

from .datasets import Datasets

#: the result file's key of the workload's description (``describe``)
KEY = "workload"


@dataclass(frozen=True)
class Figure:
    """One validation figure: its key in the result file's epochs (``val_loss``), its name for
    people, its unit, and its direction (lower loss is better, higher accuracy is better)."""
    key: str
    label: str
    unit: str = ""
    higher_is_better: bool = False
    short: str = ""  # in the terminal's epoch line: "acc", "ppl" (default: the label)

    def value(self, e) -> Optional[float]:
        """This figure of an epoch ``e`` (labkit.core.results.Epoch): a field, or an extra key."""
        return getattr(e, self.key, None) if hasattr(e, self.key) else e.extra.get(self.key)


VAL_LOSS = Figure("val_loss", "validation loss", "", higher_is_better=False, short="loss")


@dataclass
class NoOptions:
    """A workload without options of its own."""


class Workload:
    """Subclass it, give the class attributes and the methods below that have no default.

    ``cfg`` is the run's resolved config (labkit.core.config.TrainConfig): ``batch_size``,
    ``data_dir``, ``model``, ``seed``, ``lr`` ... A workload reads what it needs from it.
    """
    #: the workload's name for people ("image classification"; default: the class's name)
    title: ClassVar[str] = ""
    #: what a sample holds, as throughput counts it: "images", "tokens", "rows" ...
    unit: ClassVar[str] = "samples"
    #: the validation figures, the first being the one a target (time to target) is set on
    figures: ClassVar[tuple[Figure, ...]] = (VAL_LOSS,)
    #: the keys of :meth:`val_sums`, the same for every batch ("count": the samples counted)
    val_sum_keys: ClassVar[tuple[str, ...]] = ("loss", "count")
    #: throughput's unit for people (default: "<unit>/s")
    rate: ClassVar[str] = ""
    #: TrainConfig fields of the small run `labkit check` compares with its single-process
    #: reference (a few steps on 2 ranks: seconds on a CPU); the workload's defaults otherwise
    check_config: ClassVar[dict] = {}
    #: the optimizer's name for people, as the report states it
    optimizer_name: ClassVar[str] = "SGD (momentum, weight decay)"
    #: the global gradient norm its runs clip at unless --grad-clip says (0.0: none)
    grad_clip: ClassVar[float] = 0.0
    #: a built-in's --workload name (a class in labkit/workloads/ that declares one here is a
    #: built-in workload; a user's is named by its file or module and class)
    name: ClassVar[str] = ""
    #: the workload a run trains unless --workload names another (one built-in: the guide's)
    default: ClassVar[bool] = False
    #: its options, a dataclass whose fields become its flags (``seq_len`` -> ``--seq-len``),
    #: read as ``self.options`` (labkit.core.params.option declares a field)
    Options: ClassVar[type] = NoOptions
    #: modules its ranks import, which a warm process imports once for all of them
    #: (labkit.launch.agent); a workload of one's own is never preloaded
    preload: ClassVar[tuple[str, ...]] = ()
    #: modules its DataLoader workers import (its datasets' classes, what they transform with):
    #: the ranks' fork server (labkit.training.worker_server) imports every built-in's once, so
    #: that each worker it forks starts without importing them; a workload of one's own is not
    #: preloaded (its dataset class unpickles from its file)
    worker_preload: ClassVar[tuple[str, ...]] = ()
    #: where samples are dicts (Hugging Face's style): the key of the model's input and of the
    #: loss's target (labkit.workloads.checks.Pairs); a sample that is a pair is read as it is
    input_key: ClassVar[str] = "input_ids"
    target_key: ClassVar[str] = "labels"

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.options = params.options_of(type(self).Options, cfg)

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if not cls.rate:
            cls.rate = f"{cls.unit}/s"

    # ------------------------------------------------------------------ before any process
    @classmethod
    def resolve(cls, cfg: TrainConfig, cuda: bool, trainers: int) -> None:
        """Fill in, in place, the automatic (None) fields this workload decides (its dataset,
        model, input size, learning rate), and reject values it cannot train (ConfigError, one
        line). ``trainers``: the ranks that train. The default, for SGD: the linear scaling
        rule's lr (0.1 x global batch / 256) and a weight decay of 1e-4."""
        if cfg.lr is None:
            # 0.1 x global batch / 256 as one division, so the value is the decimal it prints as
            # in the torchrun command line (0.0375, not 0.1 * 32 * 3 / 256 = 0.037500000000000006)
            cfg.lr = cfg.batch_size * max(1, trainers) / 2560
        if cfg.weight_decay is None:
            cfg.weight_decay = 1e-4

    def check(self) -> Optional[Datasets]:
        """The checks before anything is spawned, in the launcher's process: ConfigError, one
        line naming what is wrong. Returns the datasets it built (None where it built none: an
        image folder's ranks count its images). The default builds the datasets and tries the
        model on a first batch of two samples (labkit.workloads.checks)."""
        from .checks import first_batch, samples

        data = samples(self)
        first_batch(self, data)
        return data

    # ------------------------------------------------------------------ the five questions
    def datasets(self) -> Datasets:
        """The train and validation datasets (every rank builds the same ones)."""
        raise NotImplementedError

    def build_model(self):
        """The model, built after ``torch.manual_seed(cfg.seed)`` on every rank alike: returns
        an ``nn.Module`` whose forward takes a batch's inputs."""
        raise NotImplementedError

    def loss(self, output, target):
        """The mean loss of a batch: a scalar tensor (cross-entropy by default)."""
        import torch.nn.functional as F

        return F.cross_entropy(output, target)

    @property
    def units_per_sample(self) -> int:
        """Units (the class's ``unit``) in one sample: 1 for an image, the sequence length for
        a language model's window. Throughput is samples x units per second."""
        return 1

    def val_sums(self, output, target) -> dict:
        """A validation batch's sums, as tensors on the device: summed over the trainers and
        batches, then handed to :meth:`val_figures`. The default: the loss summed over the
        batch's samples, and their count."""
        n = target.shape[0]
        return {"loss": self.loss(output.float(), target) * n, "count": target.new_tensor(n).float()}

    def val_figures(self, sums: dict[str, float]) -> dict[str, float]:
        """The validation figures (keys of ``figures``) from the summed ``val_sums``."""
        return {"val_loss": sums["loss"] / max(1.0, sums["count"])}

    def train_hits(self, output, target):
        """A training batch's correct predictions (a tensor on the device) for the training
        accuracy, or None where the workload has no accuracy (the default)."""
        return None

    # ------------------------------------------------------------------ optimisation
    def optimizer(self, params):
        """The optimizer every trainer steps (DiLoCo's inner one too): SGD with the run's lr,
        momentum and weight decay by default."""
        import torch

        c = self.cfg
        return torch.optim.SGD(params, lr=c.lr, momentum=c.momentum, weight_decay=c.weight_decay)

    def shard_units(self, model) -> list[str]:
        """The names (as ``model.named_modules()`` gives them) of the modules a method that
        shards the model treats one by one: each one's parameters gathered for its forward and
        its backward and freed after (FSDP's units). None by default: the whole model is one."""
        return []

    def lr_at(self, step: int, total: int) -> Optional[float]:
        """The learning rate of global step ``step`` (0-based) of ``total``, or None for a
        constant one (the default). The loop sets it before each step, so a resumed run
        continues the schedule where it stopped."""
        return None

    # ------------------------------------------------------------------ what instruments ask
    def state_values(self) -> int:
        """Floating-point values in the model's state_dict, for the resource preflight,
        counted without building the model on a device: on torch's meta device by default."""
        import torch

        with torch.device("meta"):
            model = self.build_model()
        return sum(t.numel() for t in model.state_dict().values() if t.is_floating_point())

    @property
    def optimizer_state_per_value(self) -> int:
        """Values of optimizer state per weight, for a checkpoint's size: SGD's momentum buffer
        (1, none without momentum) by default."""
        return 1 if self.cfg.momentum else 0

    @property
    def in_memory(self) -> bool:
        """Whether the datasets are tensors in memory (loader workers would only add overhead),
        decided without building them: True by default."""
        return True

    def sample_bytes(self) -> int:
        """Bytes of one sample in a batch (inputs and targets), for /dev/shm's preflight."""
        return 0

    def data_bytes(self) -> int:
        """Bytes each rank holds of an in-memory dataset, for host memory's preflight."""
        return 0

    def shared_bytes(self) -> int:
        """Bytes of tensors in the datasets a DataLoader worker is sent, for /dev/shm's
        preflight: the workers' forkserver pickles them into shared memory, once per rank.
        By default the in-memory dataset (``data_bytes``)."""
        return self.data_bytes()

    def forward_flops(self, data: Datasets) -> Optional[int]:
        """FLOPs of one forward of one sample (the validation set's first, of ``data``), for
        MFU: counted by torch.utils.flop_counter on the meta device by default (matrix products
        and convolutions, 2 per multiply-add); None where it cannot be counted."""
        import torch
        from torch.utils.flop_counter import FlopCounterMode

        x = data.val[0][0]
        with torch.device("meta"):
            net = self.build_model()
            x = torch.empty((1, *x.shape), dtype=x.dtype)
        with FlopCounterMode(display=False) as counter:
            net.eval()(x)
        return int(counter.get_total_flops())

    def fingerprint(self) -> dict:
        """What the run trains and validates on, for labkit reproduce to compare: a dict with a
        "sha256". The default: the workload, dataset and data folder, and a sha256 of the first
        and last 64 samples' tensors of each set (for in-memory data)."""
        import hashlib
        import json

        c = self.cfg
        fp = {"workload": c.workload, "dataset": c.dataset, "data_dir": c.data_dir}
        from .checks import samples

        h = hashlib.sha256(json.dumps(fp, sort_keys=True).encode())
        data = samples(self)
        for ds in (data.train, data.val):
            n = len(ds)
            for i in [*range(min(64, n)), *range(max(64, n - 64), n)]:
                for t in ds[i]:
                    h.update(t.contiguous().numpy().tobytes() if hasattr(t, "numpy") else repr(t).encode())
        fp["samples"] = [len(data.train), len(data.val)]
        fp["sha256"] = h.hexdigest()
        return fp

    def flops_rule(self) -> str:
        """How :meth:`forward_flops` counts, in words, for the report."""
        return "forward FLOPs counted by torch.utils.flop_counter (2 per multiply-add), x3 for a step"

    def epoch_line(self, e) -> str:
        """An epoch's figures in the terminal: "train loss 0.1234 acc 96.10% | val loss 0.0931
        acc 97.22%" (``e``: labkit.core.results.Epoch)."""
        line = f"train loss {e.train_loss:.4f}"
        if e.train_accuracy is not None:
            line += f" acc {e.train_accuracy:.2f}%"
        line += f" | val loss {e.val_loss:.4f}"
        for f in self.figures:
            v = f.value(e)
            if f.key != "val_loss" and v is not None:
                line += f" {f.short or f.label} {v:.2f}{f.unit if f.unit == '%' else ''}"
        return line

    def summary_line(self, data: Datasets) -> str:
        """What the run trains, for its first log line: "resnet18 on digits (1437 train / 360 val)"."""
        return (f"{self.cfg.model or type(self).__name__} ({len(data.train)} train / "
                f"{len(data.val)} val)")

    def finish(self, model) -> dict:
        """What a run shows a person at its end (e.g. text a language model generates), as
        keys of the result file; rank 0 calls it with the final model. The default: nothing."""
        return {}

    def finish_lines(self, shown: dict) -> list[str]:
        """What :meth:`finish` returned, as lines for the terminal and the run's log: for
        samples of text, each prompt and the start of what the model wrote after it (the whole
        text is in the result file)."""
        lines = []
        for s in shown.get("samples", []):
            if isinstance(s, dict) and "text" in s:
                lines.append(f"sample: {s.get('prompt', '')!r} -> {s['text'][:80]!r}")
        return lines

    # ------------------------------------------------------------------ how it is described
    def references(self) -> dict[str, float]:
        """Figures a reader compares the validation loss against, by name: e.g. the loss of a
        model that ignores context (the unigram entropy of the validation text). The default:
        none."""
        return {}

    def describe(self) -> dict:
        """The workload as the result file records it (under "workload"), which is all the
        report reads of it: its name, title, unit and figures, the optimizer, how FLOPs are
        counted and the reference figures."""
        cls = type(self)
        return {"name": self.cfg.workload, "title": cls.title or cls.__name__, "unit": cls.unit,
                "rate": cls.rate or f"{cls.unit}/s", "units_per_sample": self.units_per_sample,
                "figures": [asdict(f) for f in cls.figures], "optimizer": cls.optimizer_name,
                "flops_rule": self.flops_rule(), "references": self.references()}
