"""The result file's one model: what a method's ``results_*.json`` holds, typed, read and written
here and nowhere else (the only module that spells its keys; tests/test_architecture.py holds
that).

    result = read_result(path)                     # a Result, or ResultError: one line
    result.epochs[-1].val_accuracy, result.overall.avg_train_throughput, result.status
    result.to_dict()                               # the document the writer writes

Three shapes read the same: the guide's scripts' files (its keys only, no schema), the lab's
files of schema ``labkit.results/1`` (the guide's keys first, then the lab's), and files of a
newer minor version of that schema (unknown keys kept in ``extra``). A file of another major
version is refused in one line. A figure written as null (labkit writes strict JSON:
labkit.core.files.finite) reads as NaN, as files written before the nulls read; a count or a
list of bytes written as null is None. A field the file does not have is None (a list: empty),
so "not recorded" and "not a number" stay apart.

Records written whole by one instrument (a replica check, the wire's bytes, the calibration's
parts, the machine's load, the heartbeat) stay plain dicts: their shape is their writer's.
"""
from __future__ import annotations

import json
import math
import numbers
import os
from collections import Counter
from dataclasses import dataclass, field, fields, replace
from statistics import mean
from typing import Any, Iterable, Optional

from .status import Status, writer_gone

SCHEMA = "labkit.results/1"
NAN = float("nan")


class ResultError(ValueError):
    """A result file that is missing, unreadable or of another schema: one line."""


def major(schema: Any) -> Optional[str]:
    """"labkit.results/1" of "labkit.results/1" and "labkit.results/1.2" (a newer minor version
    adds keys, which read into ``extra``); None for anything else."""
    if not isinstance(schema, str) or "/" not in schema:
        return None
    name, _, version = schema.partition("/")
    return f"{name}/{version.split('.')[0]}"


def _num(v: Any) -> Any:
    """A figure as the readers see it: null is NaN (in a list too); anything else as written."""
    if v is None:
        return NAN
    if isinstance(v, list):
        return [NAN if x is None else x for x in v]
    return v


def comm_phase(key: str) -> Optional[str]:
    """The communication phase whose mean time per step a key names ("avg_comm_time" -> "comm",
    "avg_comm_time_pull" -> "pull"); None for any other key."""
    return _phase(key, "avg_comm_time")


def _phase(key: str, prefix: str) -> Optional[str]:
    """The communication phase a key names: "comm" for the guide's all-reduce key, else the
    suffix (``avg_comm_time_pull`` -> "pull"); None for a key of anything else."""
    if key == prefix:
        return "comm"
    return key[len(prefix) + 1:] if key.startswith(prefix + "_") else None


def _phase_key(prefix: str, phase: str) -> str:
    return prefix if phase == "comm" else f"{prefix}_{phase}"


def comm_key(phase: str) -> str:
    """The result key of a communication phase's mean time per step: the guide's
    ``avg_comm_time`` for the all-reduce, ``avg_comm_time_pull`` / ``_push`` for the PS."""
    return _phase_key("avg_comm_time", phase)


def comm_times_key(phase: str) -> str:
    """The per-epoch key of a phase's per-step times: ``comm_times``, ``comm_times_pull``..."""
    return _phase_key("comm_times", phase)


# ---------------------------------------------------------------------------- what a file may hold
# What each key of an epoch, of the summary and of the file must hold, checked as a file is read:
# a file that lies about its types (a loss written as "abc", one rank's record cut short) is
# refused in one line naming the key, never shown or computed with. Null is legal wherever a
# value may be absent (a figure reads as NaN); an int is a number; a key not listed is free (a
# method's own figures, a newer minor version's keys, the records of one instrument).
NUMBER, COUNT, INDEX, TEXT, RECORD = "number", "count", "index", "text", "record"
NUMBERS, COUNTS, INDEXES = "numbers", "counts", "indexes"   # lists (of NUMBER, COUNT, INDEX)
SYNC_HELD, PARTS = "sync_held", "parts"                     # records checked for their shape


def _real(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _whole(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


# a kind of value: (what it must be, in words; whether a value is one)
_KINDS = {
    NUMBER: ("a number", lambda v: v is None or _real(v)),
    COUNT: ("a whole number", lambda v: v is None or _whole(v)),
    INDEX: ("a whole number", _whole),
    TEXT: ("a string", lambda v: isinstance(v, str)),
    RECORD: ("an object", lambda v: v is None or isinstance(v, dict)),
}
_LISTS = {NUMBERS: NUMBER, COUNTS: COUNT, INDEXES: INDEX}  # a list (or null) of one kind

_EPOCH_KINDS = {
    "epoch": INDEX, "all_losses": NUMBERS, "step_parts": PARTS, "sync_held": SYNC_HELD,
    **dict.fromkeys(("train_loss", "train_accuracy", "train_time", "train_throughput",
                     "avg_batch_time", "val_loss", "val_accuracy", "avg_data_time",
                     "data_wait_share", "mfu", "val_time"), NUMBER),
    **dict.fromkeys(("steps", "throughput_warmup_steps", "val_samples"), COUNT),
    **dict.fromkeys(("step_times", "comm_busy_times", "server_update_times"), NUMBERS),
    **dict.fromkeys(("peak_memory_bytes", "optimizer_state_bytes"), COUNTS),
    **dict.fromkeys(("machine_load", "wire", "replicas", "memory"), RECORD),
}
_SUMMARY_KINDS = dict.fromkeys(
    ("avg_train_throughput", "avg_train_time_per_epoch", "best_val_accuracy",
     "final_train_accuracy", "final_val_accuracy", "best_val_loss", "final_val_loss"), NUMBER)
_RESULT_KINDS = {"method": TEXT, "all_losses": NUMBERS, "memory_model": RECORD,
                 **dict.fromkeys(("world_size", "batch_size", "trainers", "num_workers"), COUNT)}
# each communication phase's keys (avg_comm_time_pull, comm_times_push, ...)
_PHASE_KINDS = {"avg_comm_time": NUMBER, "comm_times": NUMBERS}


def _shown(v: Any) -> str:
    """A value as the file writes it, cut to a few words."""
    text = json.dumps(v, default=str)
    return text if len(text) <= 40 else text[:37] + "..."


def _first(whys: Iterable[Optional[str]]) -> Optional[str]:
    """The first problem of several (checked lazily, in order); None when there is none."""
    return next(filter(None, whys), None)


def _why(key: str, v: Any, kind: str) -> Optional[str]:
    """Why ``v``, the value of ``key``, is not of ``kind`` ('train_loss is "abc", not a
    number'); None when it is."""
    if kind in _LISTS:
        if v is not None and not isinstance(v, list):
            return f"{key} is {_shown(v)}, not a list"
        return _first(_why(f"{key}[{i}]", x, _LISTS[kind]) for i, x in enumerate(v or []))
    if kind == SYNC_HELD:
        return _why_sync_held(key, v)
    if kind == PARTS:
        return _why_parts(key, v)
    what, ok = _KINDS[kind]
    return None if ok(v) else f"{key} is {_shown(v)}, not {what}"


def _why_sync_held(key: str, v: Any) -> Optional[str]:
    """sync_held (labkit.training.instruments.meter): the trainers' ranks and one list of
    times per rank, all of one length (one time per steady-state step)."""
    if v is None:
        return None
    if not isinstance(v, dict) or not isinstance(v.get("ranks"), list) or not isinstance(v.get("times"), list):
        return f"{key} is {_shown(v)}, not an object of 'ranks' and their 'times'"
    ranks, times = v["ranks"], v["times"]
    if len(ranks) != len(times):
        return f"{key} has {len(ranks)} ranks but {len(times)} lists of times"
    why = _why(f"{key}.ranks", ranks, INDEXES) or _first(
        _why(f"{key}.times[{i}]", t, NUMBERS) for i, t in enumerate(times))
    return why or _uneven(f"{key} times", {f"rank {r}": t for r, t in zip(ranks, times)})


def _why_parts(key: str, v: Any) -> Optional[str]:
    """step_parts: each part of a step (data, compute, sync, ...) and its time per
    steady-state step, every list of one length."""
    if v is None:
        return None
    if not isinstance(v, dict):
        return f"{key} is {_shown(v)}, not an object of lists of times"
    why = _first(_why(f"{key}.{k}", t, NUMBERS) for k, t in v.items())
    return why or _uneven(f"{key} lists", v)


def _uneven(key: str, lists: dict[str, Optional[list]]) -> Optional[str]:
    """Lists that must be of one length (one entry per step) and are not: the ones whose length
    is not the most common one's."""
    lengths = {name: len(x or []) for name, x in lists.items()}
    common = Counter(lengths.values()).most_common(1)[0][0] if lengths else 0
    odd = [f"{name} has {n}" for name, n in lengths.items() if n != common]
    return (f"{key} differ in length: {', '.join(odd)} where the others have {common} steps (a "
            f"record cut short)") if odd else None


def _problem(doc: dict, kinds: dict[str, str], phases: bool = False) -> Optional[str]:
    """The first key of ``doc`` whose value is not of the kind ``kinds`` names (and, with
    ``phases``, a communication phase's key not of its kind), in one line; None when all are."""
    for key, v in doc.items():
        kind = kinds.get(key)
        if kind is None and phases:
            kind = next((k for prefix, k in _PHASE_KINDS.items() if _phase(key, prefix) is not None), None)
        if kind is not None and (why := _why(key, v, kind)):
            return why
    return None


# ---------------------------------------------------------------------------- an epoch
@dataclass
class Epoch:
    """One epoch of a result file: the guide's eight figures, each phase's communication time,
    and the lab's measurements of the step. Absent figures are None (files of the guide)."""
    epoch: int
    train_loss: float
    train_accuracy: float
    train_time: float
    train_throughput: float
    avg_batch_time: Optional[float] = None
    val_loss: Optional[float] = None
    val_accuracy: Optional[float] = None
    # phase ("comm" for the all-reduce, "pull", "push") -> mean seconds per step, and the
    # per-step times of the steady-state steps (mean over the trainers)
    comm: dict[str, float] = field(default_factory=dict)
    comm_times: dict[str, list[float]] = field(default_factory=dict)
    # --- the lab's
    all_losses: list[float] = field(default_factory=list)
    steps: Optional[int] = None
    throughput_warmup_steps: Optional[int] = None
    avg_data_time: Optional[float] = None
    step_times: Optional[list[float]] = None
    machine_load: Optional[dict] = None
    step_parts: Optional[dict[str, list[float]]] = None
    comm_busy_times: Optional[list[float]] = None
    server_update_times: Optional[list[float]] = None
    sync_held: Optional[dict] = None
    data_wait_share: Optional[float] = None
    mfu: Optional[float] = None
    peak_memory_bytes: Optional[list[int]] = None
    optimizer_state_bytes: Optional[list[int]] = None
    wire: Optional[dict] = None
    val_samples: Optional[int] = None
    val_time: Optional[float] = None
    replicas: Optional[dict] = None
    # bytes each rank held of the model and at its step's peak (labkit.training.instruments.memory)
    memory: Optional[dict] = None
    # a method's own figures (its epoch_metrics) and any key this version does not know
    extra: dict[str, Any] = field(default_factory=dict)

    # figures a lab epoch writes even when they are not known (null)
    _NULLABLE = ("avg_data_time", "data_wait_share", "mfu", "optimizer_state_bytes")

    @classmethod
    def from_dict(cls, d: dict, i: Optional[int] = None) -> "Epoch":
        """An epoch as the file holds it (``i``: its place in the file's list); ResultError
        (one line: 'epoch 2: train_loss is "abc", not a number') when a key is not of its
        kind."""
        if why := _problem(d, _EPOCH_KINDS, phases=True):
            raise ResultError(f"{_epoch_name(d, i)}: {why}")
        known = {f.name for f in fields(cls)} - {"comm", "comm_times", "extra"}
        figures = {f.name for f in fields(cls) if "float" in str(f.type)}  # null: NaN; else None
        kw: dict[str, Any] = {"comm": {}, "comm_times": {}, "extra": {}}
        for k, v in d.items():
            if (p := _phase(k, "avg_comm_time")) is not None:
                kw["comm"][p] = _num(v)
            elif (p := _phase(k, "comm_times")) is not None:
                kw["comm_times"][p] = _num(v)
            elif k in known:
                kw[k] = _num(v) if k in figures else v
            else:
                kw["extra"][k] = v
        if not isinstance(kw.get("all_losses"), list):
            kw["all_losses"] = []
        return cls(**kw)

    def to_dict(self) -> dict:
        out: dict[str, Any] = {"epoch": self.epoch}
        for k in ("train_loss", "train_accuracy", "train_time", "train_throughput",
                  "avg_batch_time", "val_loss", "val_accuracy"):
            out[k] = getattr(self, k)
        for p, v in self.comm.items():
            out[comm_key(p)] = v
        lab = self.steps is not None
        if lab or self.all_losses:
            out["all_losses"] = self.all_losses
        for f in fields(self):
            if f.name == "step_parts":  # the per-step times, before their parts (as written since)
                out.update({comm_times_key(p): v for p, v in self.comm_times.items()})
            if f.name in out or f.name in ("comm", "comm_times", "extra", "all_losses"):
                continue
            v = getattr(self, f.name)
            if v is not None or (lab and f.name in self._NULLABLE):
                out[f.name] = v
        out.update(self.extra)
        return out

    def figure(self, key: str) -> Optional[float]:
        """The validation figure ``key`` of this epoch (a field such as ``val_loss``, or a key
        of ``extra`` such as a workload's ``val_perplexity``); None where it is absent or not
        a finite number (null reads as NaN)."""
        v = getattr(self, key) if key in _EPOCH_FIELDS else self.extra.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            return None
        return float(v)

    @property
    def waited_share(self) -> Optional[float]:
        """The time a trainer waited for its next batch as a share of the step: the recorded
        share, else its steady-state parts (data over the step), else avg_data_time over
        avg_batch_time (the guide's files: None)."""
        if self.data_wait_share is not None and not math.isnan(self.data_wait_share):
            return self.data_wait_share
        data = (self.step_parts or {}).get("data")
        if data and self.step_times:
            return (sum(data) / len(data)) / (sum(self.step_times) / len(self.step_times))
        if self.avg_data_time is not None and self.avg_batch_time:
            return self.avg_data_time / self.avg_batch_time
        return None


_EPOCH_FIELDS = frozenset(f.name for f in fields(Epoch)) - {"comm", "comm_times", "extra"}


def _epoch_name(d: dict, i: Optional[int] = None) -> str:
    """An epoch as a message names it: by its number, else by its place in the file's list."""
    if _whole(d.get("epoch")):
        return f"epoch {d['epoch']}"
    return "an epoch" if i is None else f"epochs[{i}]"


# ---------------------------------------------------------------------------- the summary
@dataclass
class Summary:
    """The run's summary: the guide's five figures and each phase's mean communication time
    (None where a file lacks one)."""
    avg_train_throughput: Optional[float] = None
    avg_train_time_per_epoch: Optional[float] = None
    best_val_accuracy: Optional[float] = None
    final_train_accuracy: Optional[float] = None
    final_val_accuracy: Optional[float] = None
    # a workload judged by its loss (no accuracy): its best and final validation loss
    best_val_loss: Optional[float] = None
    final_val_loss: Optional[float] = None
    comm: dict[str, float] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, epochs: list[Epoch], phases: tuple[str, ...]) -> "Summary":
        """What the writer records after each epoch, over the epochs so far: the guide's
        accuracies where the epochs have them, else the validation loss's best and final."""
        accuracy = all(e.val_accuracy is not None for e in epochs)
        losses = [e.val_loss for e in epochs if e.val_loss is not None]
        return cls(avg_train_throughput=mean(e.train_throughput for e in epochs),
                   avg_train_time_per_epoch=mean(e.train_time for e in epochs),
                   best_val_accuracy=max(e.val_accuracy for e in epochs) if accuracy else None,
                   final_train_accuracy=epochs[-1].train_accuracy,
                   final_val_accuracy=epochs[-1].val_accuracy,
                   best_val_loss=min(losses) if losses and not accuracy else None,
                   final_val_loss=epochs[-1].val_loss if not accuracy else None,
                   comm={p: mean(e.comm[p] for e in epochs) for p in phases})

    @classmethod
    def from_dict(cls, d: dict) -> "Summary":
        if why := _problem(d, _SUMMARY_KINDS, phases=True):
            raise ResultError(f"summary: {why}")
        known = {f.name for f in fields(cls)} - {"comm", "extra"}
        kw: dict[str, Any] = {"comm": {}, "extra": {}}
        for k, v in d.items():
            if (p := _phase(k, "avg_comm_time")) is not None:
                kw["comm"][p] = _num(v)
            elif k in known:
                kw[k] = _num(v)
            else:
                kw["extra"][k] = v
        return cls(**kw)

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)
               if f.name not in ("comm", "extra") and getattr(self, f.name) is not None}
        out.update({comm_key(p): v for p, v in self.comm.items()})
        out.update(self.extra)
        return out


# ---------------------------------------------------------------------------- efficiency
@dataclass
class Efficiency:
    """The run's "efficiency" entry (labkit.training.instruments.flops): FLOPs, MFU, memory."""
    forward_flops_per_image: Optional[int] = None
    flops_per_image: Optional[int] = None
    device_name: Optional[str] = None
    precision: Optional[str] = None
    peak_flops_per_gpu: Optional[float] = None
    gpus: Optional[int] = None
    mfu: Optional[float] = None
    peak_memory_bytes: Optional[list[int]] = None
    optimizer_state_bytes: Optional[list[int]] = None
    data_wait_share: Optional[float] = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict) -> "Efficiency":
        known = {f.name for f in fields(cls)} - {"extra"}
        return cls(**{k: v for k, v in d.items() if k in known},
                   extra={k: v for k, v in d.items() if k not in known})

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        out.update(self.extra)
        return out


# ---------------------------------------------------------------------------- the file
@dataclass
class Result:
    """One method's result file. The guide's fields first, then the lab's (None or empty in
    the guide's own files)."""
    method: str                        # the guide's name ("Baseline DDP", "All-Reduce", ...)
    epochs: list[Epoch] = field(default_factory=list)
    world_size: Optional[int] = None
    batch_size: Optional[int] = None
    start_time: Optional[str] = None
    end_time: Optional[str] = None
    summary: Summary = field(default_factory=Summary)
    all_losses: list[float] = field(default_factory=list)
    # --- the lab's
    schema: Optional[str] = None
    status: Status = Status.COMPLETED   # the guide's files have none: they are complete
    method_key: Optional[str] = None
    method_spec: Optional[dict] = None  # labkit.core.methods.MethodSpec.to_dict()
    trainers: Optional[int] = None
    config: dict = field(default_factory=dict)   # the resolved TrainConfig (config.to_dict())
    world: dict = field(default_factory=dict)
    determinism: dict = field(default_factory=dict)
    versions: dict = field(default_factory=dict)
    num_workers: Optional[int] = None   # the guide's parameter server: its workers
    error: Optional[str] = None
    resumed: Optional[list[dict]] = None
    heartbeat: Optional[dict] = None
    efficiency: Optional[Efficiency] = None
    calibration: Optional[dict] = None  # labkit.training.trainer.Trainer.calibrate
    diverged: Optional[dict] = None     # labkit.training.guards.divergence
    replicas_differ: Optional[dict] = None
    link: Optional[dict] = None         # an emulated cluster's link (labkit.launch.emulated)
    # what was trained and how it is judged (labkit.workloads: its title, unit, figures, the
    # figures a reader compares against); absent: the guide's image classification
    workload: Optional[dict] = None
    examples: Optional[dict] = None     # what the run shows a person at its end (lm: text)
    # where rank 0's time went: its process's start, its end and the seconds of each phase
    # (labkit.training.trainer.Trainer.timeline; labkit.report.accounting reads it)
    timeline: Optional[dict] = None
    # what the method declares each rank holds of this model (its memory_per_rank), the
    # preflight's estimate, this machine's memory per rank and the most weights that fit it
    # (labkit.training.instruments.memory.MemoryMeter.declared)
    memory_model: Optional[dict] = None
    extra: dict[str, Any] = field(default_factory=dict)

    _OBJECTS = {"epochs", "summary", "efficiency", "status", "all_losses", "extra"}

    @classmethod
    def from_dict(cls, d: dict, where: str = "result file") -> "Result":
        """A result document as JSON gives it; ResultError (one line) when it is not one."""
        if not isinstance(d, dict) or "method" not in d or not isinstance(d.get("epochs"), list):
            raise ResultError(f"{where}: not a result file (needs 'method' and a list of 'epochs')")
        schema = d.get("schema")
        if schema is not None and major(schema) != major(SCHEMA):
            raise ResultError(f"{where}: written in schema {schema!r}, which this labkit cannot "
                              f"read (it reads {SCHEMA!r} and the guide's files): update labkit")
        needed = ("epoch", "train_loss", "train_accuracy", "train_time", "train_throughput")
        for e in d["epochs"]:
            if not isinstance(e, dict) or any(k not in e for k in needed):
                raise ResultError(f"{where}: an epoch lacks the guide's keys ({', '.join(needed)})")
        if why := _problem(d, _RESULT_KINDS):
            raise ResultError(f"{where}: {why}")
        known = {f.name for f in fields(cls)} - cls._OBJECTS
        kw: dict[str, Any] = {k: v for k, v in d.items() if k in known}
        kw["extra"] = {k: v for k, v in d.items() if k not in known and k not in cls._OBJECTS}
        for name in ("config", "world", "determinism", "versions"):  # a record: {} when it is not one
            if not isinstance(kw.get(name), dict):
                kw.pop(name, None)
        try:
            kw["status"] = Status(d.get("status", Status.COMPLETED))
        except ValueError:
            kw["status"] = Status.FAILED  # a hand-edited word: not a result to trust
        try:  # each epoch and the summary checked as they are read: one line, naming the key
            kw["epochs"] = [Epoch.from_dict(e, i) for i, e in enumerate(d["epochs"])]
            kw["summary"] = Summary.from_dict(d["summary"]) if isinstance(d.get("summary"), dict) else Summary()
        except ResultError as e:
            raise ResultError(f"{where}: {e}") from None
        kw["all_losses"] = _num(d["all_losses"]) if isinstance(d.get("all_losses"), list) else []
        if isinstance(d.get("efficiency"), dict):
            kw["efficiency"] = Efficiency.from_dict(d["efficiency"])
        return cls(**kw)

    def to_dict(self) -> dict:
        """The file's JSON document: the guide's keys first, then the lab's (absent ones left
        out, end_time written while it is null)."""
        out: dict[str, Any] = {"method": self.method, "world_size": self.world_size,
                               "batch_size": self.batch_size, "start_time": self.start_time,
                               "end_time": self.end_time,
                               "epochs": [e.to_dict() for e in self.epochs],
                               "summary": self.summary.to_dict(), "all_losses": self.all_losses}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "status":
                out["status"] = Status(v).value
            elif f.name == "efficiency":
                if v is not None:
                    out["efficiency"] = v.to_dict()
            elif f.name not in out and f.name not in self._OBJECTS and v is not None:
                out[f.name] = v
        out.update(self.extra)
        return out

    # ------------------------------------------------------------------ what readers ask
    @property
    def ok(self) -> bool:
        """At least one finished epoch (a failed run keeps its finished epochs)."""
        return bool(self.epochs)

    @property
    def phases(self) -> list[str]:
        """The communication phases the file times, in the order its epochs record them."""
        seen: dict[str, None] = {}
        for e in self.epochs:
            seen.update(dict.fromkeys(e.comm))
        return list(seen or self.summary.comm)

    @property
    def overall(self) -> Summary:
        """The summary, with each figure the file lacks recomputed from its epochs: the mean
        throughput and time per epoch, the best validation accuracy, the best (lowest) and
        final validation loss, each phase's mean time (NaN where the epochs cannot give one;
        the final accuracies are not recomputed)."""
        s, ep = self.summary, self.epochs

        def given(recorded: Optional[float], recompute) -> float:
            return recorded if recorded is not None else recompute() if ep else NAN

        vals = [e.val_accuracy for e in ep if e.val_accuracy is not None]
        losses = self.figure_values("val_loss")
        phases = dict.fromkeys(p for e in ep for p in e.comm)
        comm = {p: mean(e.comm[p] for e in ep if p in e.comm) for p in phases}
        return Summary(
            avg_train_throughput=given(s.avg_train_throughput, lambda: mean(e.train_throughput for e in ep)),
            avg_train_time_per_epoch=given(s.avg_train_time_per_epoch, lambda: mean(e.train_time for e in ep)),
            best_val_accuracy=given(s.best_val_accuracy, lambda: max(vals) if vals else NAN),
            final_train_accuracy=given(s.final_train_accuracy, lambda: NAN),
            final_val_accuracy=given(s.final_val_accuracy, lambda: NAN),
            best_val_loss=given(s.best_val_loss, lambda: min(losses) if losses else NAN),
            final_val_loss=given(s.final_val_loss, lambda: losses[-1] if losses else NAN),
            comm={**comm, **s.comm})

    @property
    def units_per_sample(self) -> int:
        """Units (images, tokens) one sample holds, as its workload records it (1 for a file
        without one: an image); throughput counts samples x units."""
        n = (self.workload or {}).get("units_per_sample")
        return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1

    def figure_values(self, key: str) -> list[float]:
        """The validation figure ``key`` of each epoch that has it, in order."""
        return [v for v in (e.figure(key) for e in self.epochs) if v is not None]

    def best_figure(self, key: str, higher_is_better: bool) -> Optional[float]:
        """The best value of the validation figure ``key`` over the epochs, by its direction
        (the highest accuracy, the lowest loss); None where no epoch has it."""
        vals = self.figure_values(key)
        return (max(vals) if higher_is_better else min(vals)) if vals else None

    def final_figure(self, key: str) -> Optional[float]:
        """The last epoch's value of the validation figure ``key`` (None where none has it)."""
        vals = self.figure_values(key)
        return vals[-1] if vals else None

    def as_seen(self) -> "Result":
        """The result as a reader should show it: running, with its writer gone, is
        :attr:`Status.STOPPED` with an error saying so (the file itself is not changed)."""
        why = writer_gone({"status": self.status, "heartbeat": self.heartbeat})
        if why is None:
            return self
        return replace(self, status=Status.STOPPED, error=f"stopped without finishing: {why}")


def read_result(path: str | os.PathLike, as_seen: bool = True) -> Result:
    """One result file, as every reader sees it (:meth:`Result.as_seen`; ``as_seen=False``: as
    written, for the launcher that ends a file its rank 0 left running); ResultError, one line
    naming the file and the problem, when it is missing, corrupt or not a result file."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise ResultError(f"{path}: missing") from None
    except IsADirectoryError:
        raise ResultError(f"{path}: a folder, not a result file") from None
    except OSError as e:
        raise ResultError(f"{path}: cannot read it ({e.strerror})") from None
    except ValueError as e:  # a JSONDecodeError or a UnicodeDecodeError
        raise ResultError(f"{path}: not valid JSON ({e.__class__.__name__}): truncated or corrupt") from None
    result = Result.from_dict(doc, str(path))
    return result.as_seen() if as_seen else result


__all__ = ["SCHEMA", "ResultError", "Epoch", "Summary", "Efficiency", "Result", "read_result",
           "comm_key", "comm_times_key", "comm_phase"]
