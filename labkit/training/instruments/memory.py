"""Memory per rank (the epoch's ``memory``, the run's ``memory_model``): what each rank holds of
the model's parameters, gradients and optimizer state, the most it holds during a step, and the
method's own declaration of it (its class's ``memory_per_rank``) beside it.

Held: after each epoch's last step, the bytes of the storages of the model's parameters (a
DTensor's local shard, zero3's pieces and its whole parameters, whose storage is empty between
steps), of their gradients and of the optimizer state the method says it keeps
(``Strategy.optimizer_state``), each storage counted once, so views into one flat buffer count
it once and a padded shard counts its padding.

The step's peak. On a GPU, the allocator's: ``torch.cuda.max_memory_allocated``, reset at each
epoch's start, so it is the most any of that epoch's steps held. On a CPU there is no such
counter, so one step of each epoch is followed tensor by tensor (:class:`StepTracker`, a
TorchDispatchMode, as PyTorch's own torch.distributed._tools.MemTracker does it): every storage
an operator reads, writes or makes is counted from then until it dies (a weakref callback on
the storage), the model's parameters, gradients, buffers and optimizer state from the step's
start, and ``UntypedStorage.resize_``, which no operator sees and with which FSDP2 and zero3
gather and free the whole parameters, is followed too. After each operator the live total, the
parameters' and the gradients' bytes are read: their most are the step's peak and the most of
each held during it (zero3's memory_per_rank declares that most: its shards and the units a
step gathers; FSDP's declares what stays between steps). Why not the profiler's memory events
(``torch.profiler.profile(profile_memory=True)``, a running total of the allocator's
allocations and frees): it reports no free of a block allocated before it started, so the
running total of a step climbs by every gradient and batch of the step before that the step
frees, and it gives no name to what is live. What the tracker cannot see: memory no operator of
the step touches (a C++ object's buffer the step never reads), operators run on other threads
(gloo's own), and what is not a tensor (the interpreter, gloo's buffers); tests/test_memory.py
checks it against the arithmetic of an MLP (parameters, gradients, optimizer state and the
activations live at its peak, to within 0.1%).

The tracker costs a Python call per operator, so the step it follows is one the steady-state
figures leave out: the last warm-up step of the epoch (``--warmup-steps``, 3 by default; the
first step where it is the only one, which also makes the optimizer's state), none where an
epoch has no warm-up step or the model is compiled (a TorchDispatchMode under compiled code is
not the code that runs). The epoch's train_time includes it.
"""
from __future__ import annotations

import math
import weakref
from contextlib import nullcontext
from functools import partial
from typing import Iterable, Iterator, Optional

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from labkit.core.config import TrainConfig
from labkit.core.resources import RANK_BASE, memory_capacity
from labkit.training import budget
from labkit.training.dist import DistContext, all_reduce_sum

#: what an epoch records per rank, in this order (each a list over the ranks, None unmeasured)
HELD = ("parameters", "gradients", "optimizer")
STEP = ("step_parameters", "step_gradients", "tracked_peak", "allocator_peak")


def storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages a tensor's bytes live in on this rank: its own, or a wrapper subclass's
    inner tensors' (a DTensor's local shard)."""
    if type(t) is torch.Tensor or type(t) is nn.Parameter:  # most of them, quickly
        return [t.untyped_storage()]
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        inner = (getattr(t, n) for n in names)  # a tensor, or an opaque object (its mesh)
        return [s for x in inner if isinstance(x, torch.Tensor) for s in storages(x)]
    return [t.untyped_storage()]


def count(*groups: Iterable[torch.Tensor]) -> list[int]:
    """The bytes of each group's storages, every storage counted once, in the first group that
    holds it (a parameter's storage is not counted again as a gradient's)."""
    seen: set[int] = set()
    out = []
    for group in groups:
        n = 0
        for t in group:
            for st in storages(t):
                if id(st) not in seen:
                    seen.add(id(st))
                    n += st.nbytes()
        out.append(n)
    return out


def parameters(model: nn.Module) -> Iterator[nn.Parameter]:
    """Every parameter a module of ``model`` holds now: those it registers (FSDP2 registers
    the whole ones while a unit is gathered) and those set on it past its registry (zero3's
    whole parameters, read by forward from the module's __dict__)."""
    for m in model.modules():
        yield from (p for p in m._parameters.values() if p is not None)
        yield from (v for k, v in vars(m).items() if isinstance(v, nn.Parameter))


def held(model: nn.Module, optimizer_state: list[torch.Tensor]) -> list[int]:
    """Bytes of the parameters, of their gradients and of the optimizer state, as HELD."""
    ps = list(parameters(model))
    return count(ps, [p.grad for p in ps if p.grad is not None], optimizer_state)


class StepTracker(TorchDispatchMode):
    """The tensors of one step, followed from the storages the model and its optimizer hold
    (see the module's docstring): ``peak``, the most bytes live after any operator, and
    ``most``, the most bytes of the parameters and of the gradients."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """False: TorchDispatchMode would wrap __torch_dispatch__ in dynamo's disable, whose first
        call imports torch._dynamo (1.4 CPU s in every rank); nothing is compiled under the
        tracker (MemoryMeter.start_epoch follows no step of a compiled model)."""
        return False

    def __init__(self, model: nn.Module, optimizer_state: list[torch.Tensor]):
        super().__init__()
        self.start = [*optimizer_state, *model.buffers()]
        # where the parameters are, read after every operator: each module's registry (whose
        # entries FSDP2 swaps) and the parameters set past it (zero3's, set once at its setup)
        modules = list(model.modules())
        self.registries = [m._parameters for m in modules]
        self.unregistered = [(vars(m), k) for m in modules for k, v in vars(m).items()
                             if isinstance(v, nn.Parameter)]
        self.bytes: dict[int, int] = {}            # id(storage) -> its bytes as last counted
        self.refs: dict[int, weakref.ref] = {}     # id(storage) -> a weakref that uncounts it
        self.now = self.peak = 0
        #: id(storage) -> 0 for a parameter's, 1 for a gradient's: every storage seen as one
        #: during the step (FSDP2 swaps a unit's shards out of the module while it is whole)
        self.kind: dict[int, int] = {}
        self.held = [0, 0]  # the bytes of the live storages of each kind, now
        self.most = [0, 0]  # and the most
        #: why the tracker stopped counting (its figures are then not recorded), or None
        self.failed: Optional[str] = None

    def track(self, st: torch.UntypedStorage, kind: Optional[int] = None) -> None:
        """Count ``st`` from now until it dies (``kind``: it is a parameter's, a gradient's)."""
        k, n = id(st), st.nbytes()
        if k not in self.refs:
            self.refs[k] = weakref.ref(st, partial(self._gone, k))
            self.bytes[k] = 0
        delta = n - self.bytes[k]  # seen: a resize (an out= operator's, resize_) changes it
        self.now += delta
        self.bytes[k] = n
        if kind is not None and k not in self.kind:
            self.kind[k] = kind
            self.held[kind] += n
        elif k in self.kind:
            self.held[self.kind[k]] += delta

    def _gone(self, k: int, _ref) -> None:
        n = self.bytes.pop(k, 0)
        self.now -= n
        if k in self.kind:
            self.held[self.kind.pop(k)] -= n
        self.refs.pop(k, None)

    def _read(self, tensors: Iterable = (), resized: Optional[torch.UntypedStorage] = None) -> None:
        """After each operator: its tensors' storages counted, then the live total, the
        parameters' and the gradients' bytes read. Never raises: a tracker that fails stops
        counting (the step itself goes on, on every rank alike)."""
        if self.failed is not None:
            return
        try:
            if resized is not None:
                self.track(resized)
            for t in tensors:
                if isinstance(t, torch.Tensor):
                    for st in storages(t):
                        self.track(st)
            ps = [p for r in self.registries for p in r.values() if p is not None]
            ps += [p for d, k in self.unregistered if (p := d.get(k)) is not None]
            for kind, ts in enumerate((ps, [p.grad for p in ps if p.grad is not None])):
                for t in ts:
                    for st in storages(t):
                        if id(st) not in self.kind:  # a storage keeps its kind while it lives
                            self.track(st, kind)
            self.peak = max(self.peak, self.now)
            self.most = [max(a, b) for a, b in zip(self.most, self.held)]
        except Exception as e:  # noqa: BLE001 - a figure, never a reason to stop a step
            self.failed = f"{type(e).__name__}: {e}"

    def __enter__(self):
        self._read(self.start)  # and the parameters and gradients, as after every operator
        self._resize, tracker = torch.UntypedStorage.resize_, self

        def resize_(st, size):  # no operator: FSDP2 and zero3 gather and free with it
            out = tracker._resize(st, size)
            tracker._read(resized=st)
            return out

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        self.refs.clear()  # storages that die later are no longer this step's
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._read(tree_leaves((args, kwargs, out)))
        return out


class MemoryMeter:
    """The loop's memory instrument (labkit.training.trainer): made before the method's
    setup, which may shard the model; every rank calls :meth:`start_epoch`, :meth:`watch`
    around each step and :meth:`epoch` at each epoch's end, and rank 0 records :attr:`model`."""

    def __init__(self, cfg: TrainConfig, ctx: DistContext, strategy, model: nn.Module, workload):
        self.cfg, self.ctx, self.s = cfg, ctx, strategy
        self.cuda = ctx.device.type == "cuda"
        self.at: Optional[int] = None  # the step of this epoch the tracker follows
        self.tracker: Optional[StepTracker] = None
        #: the fp32 weights the method holds a share of: the trainable parameters, each once
        #: (a tied embedding is one), counted before setup shards them
        self.values = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self.model: Optional[dict] = None
        if ctx.is_main:  # rank 0 writes the file; a declaration that fails leaves it out
            try:
                self.model = self.declared(workload)
            except Exception:  # noqa: BLE001 - a figure of the report, never a reason to stop
                self.model = None

    def declared(self, workload) -> dict:
        """The run's ``memory_model``: per rank, what the method's class declares it holds of
        this model (memory_per_rank), the preflight's estimate of a rank's tensors, this
        machine's memory per rank, and the most weights a model of this workload could have
        and fit it (labkit.training.budget.largest_fit)."""
        cfg, world, spv = self.cfg, max(1, self.ctx.world_size), workload.optimizer_state_per_value
        per_rank = budget.held_per_rank(cfg, self.values, spv, world)
        capacity, what = self.capacity()
        overhead = 0 if self.cuda else RANK_BASE + workload.data_bytes()
        out = {"values": self.values, "state_values": workload.state_values(),
               "state_per_value": spv, "world": world,
               **{k: [round(getattr(h, k)) for h in per_rank] for k in HELD},
               "tensors": budget.tensors_per_rank(cfg, workload, world),
               "capacity_per_rank": capacity, "capacity": what, "overhead": overhead}
        if capacity:
            out["largest_values"] = budget.largest_fit(cfg, workload, world, capacity, overhead)
        return out

    def capacity(self) -> tuple[Optional[int], str]:
        """This machine's memory per rank: the GPU's, shared by the ranks on it, or the host's
        (its MemTotal, or a smaller cgroup limit) over this node's ranks."""
        local = max(1, self.ctx.local_world_size)
        if self.cuda:
            per_gpu = -(-local // max(1, torch.cuda.device_count()))
            total = torch.cuda.get_device_properties(self.ctx.device).total_memory
            return total // per_gpu, "GPU memory"
        total = memory_capacity()
        return (total // local if total else None), "host memory"

    # ------------------------------------------------------------------ per epoch, every rank
    def start_epoch(self, warmup: int) -> None:
        """Before an epoch's first step: the step to follow (the last of ``warmup`` untimed
        ones), and on a GPU the allocator's peak reset."""
        self.at = warmup - 1 if warmup >= 1 and not self.cfg.compile else None
        self.tracker = None
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.ctx.device)

    def watch(self, step: int, model: nn.Module, optimizer):
        """Around one step: the tracker on the step chosen, else nothing."""
        if step != self.at:
            return nullcontext()
        self.tracker = StepTracker(model, self.s.optimizer_state(optimizer))
        return self.tracker

    def epoch(self, model: nn.Module, optimizer) -> dict:
        """The epoch's ``memory`` record: every rank's figures, in rank order (every rank
        calls it: they are summed into one list)."""
        try:
            mine = held(model, self.s.optimizer_state(optimizer))
        except Exception:  # noqa: BLE001 - a figure, never a reason to stop: NaN is "not known"
            mine = [math.nan] * len(HELD)
        t = self.tracker if self.tracker is not None and self.tracker.failed is None else None
        self.tracker = None  # it holds the step's optimizer state, which a resume replaces
        mine += [*t.most, t.peak] if t is not None else [math.nan] * 3
        mine.append(torch.cuda.max_memory_allocated(self.ctx.device) if self.cuda else math.nan)
        keys, world = HELD + STEP, max(1, self.ctx.world_size)
        v = torch.zeros((world, len(keys)), dtype=torch.float64, device=self.ctx.device)
        v[self.ctx.rank] = torch.tensor(mine, dtype=torch.float64)
        every = all_reduce_sum(v).tolist()
        out: dict = {"step": self.at + 1 if t is not None else None}
        for i, k in enumerate(keys):
            col = [row[i] for row in every]
            out[k] = None if any(math.isnan(x) for x in col) else [int(x) for x in col]
        return out
