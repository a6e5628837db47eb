"""The interface a synchronisation method implements for the one training loop: the lab's own
methods and a user's (docs/methods.md) subclass :class:`Strategy` alike.

Per step the loop calls, on every rank:
    zero_grad -> before_forward -> [trainers: forward, backward] -> after_backward -> step
and once per epoch, before validation and saving, ``finish_epoch``.  ``labkit bench`` also
runs compute-only steps inside ``no_sync()``: zero_grad -> forward, backward -> step with a
local optimizer, and no communication.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from labkit.core import params
from labkit.core.config import ConfigError, TrainConfig
from labkit.core.methods import spec
from labkit.training.dist import DistContext, is_distributed
from labkit.training.instruments.timers import PhaseTimer, StepParts

from .collectives import Stamped, Wire, nbytes, wire_figures

SUM = dist.ReduceOp.SUM


def _size(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


class Collectives:
    """Mixin of :class:`~labkit.training.sync.base.Strategy`: ``torch.distributed``'s calls
    with the same arguments, timed and counted. ``async_op=True`` returns the Work (wait on it
    as usual); without, the call returns when it completed. ``phase`` names what the bytes
    count towards (the method's timed phase: "comm", or a PS's "pull" / "push")."""

    wire: Wire
    is_trainer: bool
    parts: Any  # the step's parts (labkit.training.instruments.timers.StepParts), None outside the loop
    cfg: Any
    count_phase: str = "comm"

    def wire_metrics(self, steps: int) -> dict:
        """Bytes per step sent and received by every rank, by phase (the epoch's ``wire``),
        over the ``steps`` steps since the last call; every rank calls it (the figures are
        gathered)."""
        mine = {"steps": self.wire.take(), "trainer": self.is_trainer}
        every = [mine]
        if dist.is_initialized() and dist.get_world_size() > 1:
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, mine)
        return wire_figures(every, steps)

    def count_bytes(self, phase: str, sent: float, received: float) -> None:
        """Count bytes this rank moved in the current step (the helpers below do; a method
        whose communication the lab cannot see, as DDP's inside PyTorch, calls it itself)."""
        step = len(self.parts.steps) if self.parts is not None else 0
        self.wire.add(phase, sent, received, step)

    def _issue(self, call: Callable[[], dist.Work], async_op: bool, sent: float, received: float,
               phase: Optional[str]):
        self.count_bytes(phase or self.count_phase, sent, received)
        parts = self.parts if self.cfg.times_comm else None
        started = parts.stamp() if parts is not None else None
        work = call()
        if parts is not None:
            try:
                parts.issued(work.get_future(), started)
            except RuntimeError:  # gloo's send and recv have no future: stamped at wait()
                work = Stamped(work, parts, started)
        if async_op:
            return work
        work.wait()
        return None

    def all_reduce(self, t, op=SUM, group=None, async_op=False, phase=None):
        n = _size(group)
        b = 2 * (n - 1) / n * nbytes(t)
        return self._issue(lambda: dist.all_reduce(t, op=op, group=group, async_op=True),
                           async_op, b, b, phase)

    def reduce_scatter(self, out, inp, op=SUM, group=None, async_op=False, phase=None):
        """``out`` (1/n of ``inp``): this rank's slice of the reduction of ``inp``."""
        n = _size(group)
        b = (n - 1) / n * nbytes(inp)
        return self._issue(lambda: dist.reduce_scatter_tensor(out, inp, op=op, group=group,
                                                              async_op=True), async_op, b, b, phase)

    def all_gather(self, out, inp, group=None, async_op=False, phase=None):
        """``out`` (n times ``inp``): every rank's ``inp``, in rank order."""
        n = _size(group)
        b = (n - 1) / n * nbytes(out)
        return self._issue(lambda: dist.all_gather_into_tensor(out, inp, group=group,
                                                               async_op=True), async_op, b, b, phase)

    def broadcast(self, t, src, group=None, async_op=False, phase=None):
        n, root = _size(group), dist.get_rank() == src
        sent, received = ((n - 1) * nbytes(t), 0) if root else (0, nbytes(t) if n > 1 else 0)
        return self._issue(lambda: dist.broadcast(t, src=src, group=group, async_op=True),
                           async_op, sent, received, phase)

    def reduce(self, t, dst, op=SUM, group=None, async_op=False, phase=None):
        n, root = _size(group), dist.get_rank() == dst
        sent, received = (0, (n - 1) * nbytes(t)) if root else (nbytes(t) if n > 1 else 0, 0)
        return self._issue(lambda: dist.reduce(t, dst=dst, op=op, group=group, async_op=True),
                           async_op, sent, received, phase)

    def send(self, t, dst, group=None, async_op=False, phase=None):
        return self._issue(lambda: dist.isend(t, dst=dst, group=group), async_op, nbytes(t), 0,
                           phase)

    def recv(self, t, src, group=None, async_op=False, phase=None):
        return self._issue(lambda: dist.irecv(t, src=src, group=group), async_op, 0, nbytes(t),
                           phase)


FLOAT = 4  # bytes of an fp32 value: the weights, gradients and optimizer state the lab keeps


@dataclass
class NoOptions:
    """A method without options of its own."""


@dataclass(frozen=True)
class Held:
    """Bytes one rank holds of the model: its parameters, gradients and optimizer state."""
    parameters: float
    gradients: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer


class Strategy(Collectives):
    # --- what a method declares, each in its own class: labkit.training.sync.registry.spec_of
    # makes its MethodSpec of them (what a result file records of it), and `python
    # tools/builtins.py` writes the built-ins' declarations into labkit.core.builtins for the
    # processes that do not import torch (the command line's flags, the report) ---
    #: a built-in's --method name, folder and report key (a user's: from its class name,
    #: RingAllReduce -> ring_all_reduce); a class that declares one here is a built-in method
    key: ClassVar[str] = ""
    #: its name, as the result file's "method" says it (the guide's, for the guide's three;
    #: default: the class name)
    title: ClassVar[str] = ""
    #: its name in the report's tables and figures (default: the title)
    short: ClassVar[str] = ""
    #: the result file (default: results_<key>.json; the guide's three: the guide's names)
    result_file: ClassVar[str] = ""
    #: True: the same parameters as DDP up to summation order (checked); False: approximate
    exact: ClassVar[bool] = True
    #: the communication phases it times with ``self.timer(phase)`` (result keys
    #: avg_comm_time for "comm", avg_comm_time_<phase> for the others)
    phases: ClassVar[tuple[str, ...]] = ("comm",)
    #: ranks 0..K-1 serve rather than train (then override the role properties below)
    serves: ClassVar[bool] = False
    #: a reference that never communicates (nosync): judged by speed only, no verdicts
    bound: ClassVar[bool] = False
    #: where it stands in every table and figure (a user's methods follow the built-ins, in
    #: the order they were named)
    order: ClassVar[float] = 100.0
    #: one of the experiment guide's three (every comparison table has a row for each)
    guide: ClassVar[bool] = False
    #: the guide's baseline, the reference every speedup is measured against (DDP)
    baseline: ClassVar[bool] = False
    #: run by `labkit experiment` when no --methods is given
    default: ClassVar[bool] = False
    #: its options, a dataclass whose fields become its flags (``ps_servers`` ->
    #: ``--ps-servers``); a running strategy reads them as ``self.options``
    Options: ClassVar[type] = NoOptions
    #: named variants (labkit bench --variants, labkit experiment --methods): name -> the
    #: option values that make it; the method's own key is a variant of its defaults
    variants: ClassVar[dict[str, dict[str, Any]]] = {}
    #: the variants labkit bench times without --variants
    bench_variants: ClassVar[tuple[str, ...]] = ()
    #: modules its ranks import beyond the training loop's, which a warm process imports once
    #: for all of them (labkit.launch.agent); a method of one's own is never preloaded
    preload: ClassVar[tuple[str, ...]] = ()
    #: how the alpha-beta cost model predicts its step (labkit.costmodel: "ring" all-reduce,
    #: "server" for a parameter server), or "" where it has no model
    cost_model: ClassVar[str] = ""
    #: every rank holds the whole model, its gradients and its optimizer state after
    #: ``finish_epoch`` (True: DDP, the all-reduce; the parameter server's workers hold the
    #: model and its servers the rest); False for a method that shards them (FSDP, ZeRO-2/3),
    #: which then overrides :meth:`full_state`, :meth:`load_full_state`, :meth:`replicas` and
    #: :meth:`whole_model`, and counts what it holds from its local tensors
    replicates: ClassVar[bool] = True
    #: whether its compute can be timed by compute-only steps (``no_sync``: forward, backward
    #: and optimizer with no communication): not for a method whose forward communicates (a
    #: sharded model gathers its parameters), whose run then has no calibration and whose step
    #: breakdown says so (:attr:`compute_measured`)
    calibrates: ClassVar[bool] = True
    #: how the step breakdown's compute of this method is measured, in words for the report
    compute_measured: ClassVar[str] = ("compute-only steps after the last epoch: forward, "
                                       "backward and optimizer with the synchronisation skipped")

    #: the gradients its optimizers step are split over the ranks (a sharded method): the
    #: norm --grad-clip clips sums their squares over every rank (:meth:`gradient_norm`)
    shards_gradients: ClassVar[bool] = False

    def __init__(self, cfg: TrainConfig, ctx: DistContext):
        self.cfg, self.ctx = cfg, ctx
        #: the method's options (its class's Options dataclass), as ``cfg`` holds them
        self.options = type(self).options_of(cfg)
        #: names of the communication phases this method times (keys of PhaseTimer.totals,
        #: and of its result keys: labkit.core.methods)
        self.phases: tuple[str, ...] = spec(cfg.method).phases
        self.timer = PhaseTimer(ctx.device)
        self.sync = True  # False inside no_sync(): compute-only steps
        #: the loop's record of each step's parts (labkit.training.instruments.timers.StepParts);
        #: each collective issued through Collectives is stamped in it, unless --time-comm off
        self.parts: Optional[StepParts] = None
        #: the training steps of each epoch, set by the loop (labkit bench: those of a trial)
        self.steps_per_epoch: Optional[int] = None
        #: bytes this rank's collectives moved (counted by the helpers of Collectives)
        self.wire = Wire()

    #: its training steps synchronise nothing (nosync): they are the compute-only steps the
    #: calibration would run, so the calibration reads its last ones (Trainer.calibrate)
    steps_are_compute_only: bool = False

    @classmethod
    def for_config(cls, cfg: TrainConfig) -> "type[Strategy]":
        """The class that runs ``cfg``: this one, unless a method picks among protocols by its
        options (the parameter server's); ConfigError for options that do not combine."""
        return cls

    @classmethod
    def check(cls, cfg: TrainConfig, world: int) -> None:
        """Reject a config this method cannot run with ``world`` processes (ConfigError, one
        line), before any process group exists. Nothing to check by default."""

    @classmethod
    def options_of(cls, cfg: TrainConfig) -> Any:
        """This method's options (an instance of :attr:`Options`) in ``cfg``: a built-in's are
        fields of the config, a user's method's are in ``cfg.options``; a field neither holds
        takes its default."""
        return params.options_of(cls.Options, cfg)

    @classmethod
    def server_ranks(cls, cfg: TrainConfig) -> int:
        """How many of the ranks serve rather than train (ranks 0..K-1): none by default."""
        return 0

    @classmethod
    def bytes_per_step(cls, cfg: TrainConfig, grad_bytes: int) -> tuple[int, int]:
        """(bytes a trainer reduces or pushes, bytes it pulls) in a synchronisation, its model's
        gradients being ``grad_bytes``: what its collectives carry before a ring's 2(n-1)/n,
        for the link preflight and the bench's reference collectives (one collective of the
        same bytes). By default one all-reduce of the gradients, at 2 bytes a value with
        --compress."""
        return (grad_bytes // 2 if cfg.compress != "none" else grad_bytes), 0

    @classmethod
    def memory_per_rank(cls, cfg: TrainConfig, values: int, state_per_value: int,
                        world: int) -> list[Held]:
        """What each of the ``world`` ranks holds of the model's ``values`` fp32 weights: its
        parameters, gradients and optimizer state (``state_per_value`` values per weight) in
        bytes. By default a replica on every rank (DDP's 16 bytes a weight with AdamW)."""
        one = Held(FLOAT * values, FLOAT * values, FLOAT * values * state_per_value)
        return [one] * world

    def describe(self) -> str:
        """The method as the first line of a run names it (a method of one's own: its key and
        where its class lives)."""
        s = spec(self.cfg.method)
        return s.key if s.builtin else f"{s.key} ({s.source})"

    # --- roles: every rank trains unless a method says otherwise ---
    @property
    def trainers(self) -> int:
        return self.ctx.world_size

    @property
    def trainer_index(self) -> Optional[int]:
        """Index of this rank among the trainers, None for a rank that does not train."""
        return self.ctx.rank

    @property
    def first_trainer(self) -> int:
        """Global rank of trainer 0: it shows the training bar and owns the BatchNorm buffers."""
        return 0

    @property
    def is_trainer(self) -> bool:
        return self.trainer_index is not None

    @property
    def steps_optimizer(self) -> bool:
        """Whether this rank holds an optimizer and applies the update."""
        return True

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Compute-only steps for ``labkit bench``: inside, the loop skips before_forward and
        after_backward, and a method that communicates from elsewhere (DDP's reducer, the
        all-reduce gradient hooks) must check ``self.sync`` or override this."""
        self.sync = False
        try:
            yield
        finally:
            self.sync = True

    @contextmanager
    def accumulating(self) -> Iterator[None]:
        """A micro-batch that is not its step's last (--grad-accum): its backward adds into the
        gradients and nothing is communicated; the loop calls before_forward once before the
        first micro-batch, after_backward and step once after the last. A method that
        communicates from a gradient hook checks ``self.sync`` (DDP overrides this with its
        own ``no_sync``)."""
        was, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = was

    # --- hooks ---
    def setup(self, model: nn.Module) -> nn.Module:
        """Prepare ``model`` (on its device); return the module trainers call forward on."""
        return model

    def zero_grad(self, optimizer: Optional[torch.optim.Optimizer]) -> None:
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)

    def before_forward(self) -> None:
        pass

    def after_backward(self) -> None:
        pass

    def step(self, optimizer: Optional[torch.optim.Optimizer], scaler=None) -> None:
        if optimizer is None:
            return
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()

    def gradients(self, optimizer: Optional[torch.optim.Optimizer]) -> list[torch.Tensor]:
        """The gradients this rank's optimizer steps, synchronised (after after_backward): what
        --grad-clip measures and scales in place. A rank without an optimizer has none."""
        if optimizer is None:
            return []
        return [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]

    def gradient_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The global norm of the gradient the method steps: the local squares summed, and over
        every rank for a method that shards them (called on every rank)."""
        local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]  # DTensor: shard
        sq = torch.zeros((), dtype=torch.float32, device=self.ctx.device)
        for g in local:
            sq += g.detach().float().pow(2).sum()
        if self.shards_gradients and self.ctx.distributed:
            dist.all_reduce(sq)  # 4 bytes a step: not counted on the wire
            sq /= self.gradient_copies
        return sq.sqrt()

    #: how many ranks hold each shard of a sharded gradient (HSDP: its replicas)
    gradient_copies: int = 1

    def clip_gradients(self, optimizer: Optional[torch.optim.Optimizer], max_norm: float,
                       scaler=None, grads: Optional[list[torch.Tensor]] = None
                       ) -> Optional[float]:
        """--grad-clip, on every rank between after_backward and step: the gradients
        (:meth:`gradients`, or ``grads``) scaled by max_norm / norm where the norm exceeds it
        (torch's clip_grad_norm_ arithmetic, 1e-6 added to the norm). Returns the norm before
        clipping; None on a rank that clips nothing (a parameter server's worker)."""
        if scaler is not None and optimizer is not None:
            scaler.unscale_(optimizer)  # the norm of the true gradient, not the scaled one
        grads = self.gradients(optimizer) if grads is None else grads
        if not grads and not self.shards_gradients:
            return None
        norm = self.gradient_norm(grads)
        norm = float(norm)
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)  # a DTensor's local shard too
        return norm

    def optimizer_state(self, optimizer: Optional[torch.optim.Optimizer]) -> list[torch.Tensor]:
        """The optimizer state this rank holds (the lab counts its bytes, every method alike):
        the tensors of the loop's optimizer by default. A method that keeps its own state (a
        sharded optimizer's slice of the momentum) returns that instead."""
        if optimizer is None:
            return []
        return [v for st in optimizer.state.values() for v in st.values()
                if isinstance(v, torch.Tensor)]

    def epoch_metrics(self) -> dict:
        """Method-specific figures for this epoch's results, read (and reset) by the loop at the
        end of each epoch's training on every rank; rank 0's go into the result file."""
        return {}

    # --- the model as a whole: a replica on every rank, unless the method shards it ---
    def full_state(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer]
                   ) -> tuple[Optional[dict], Optional[dict]]:
        """(the whole model's state dict, the optimizer's) as saved (a checkpoint, the final
        model) on rank 0, after ``finish_epoch``. Every rank calls it: a sharded method gathers
        its shards here. By default the rank's own, every rank holding the model."""
        return model.state_dict(), (optimizer.state_dict() if optimizer is not None else None)

    def load_full_state(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer],
                        model_state: dict, optimizer_state: Optional[dict]) -> None:
        """Load on every rank what :meth:`full_state` gave (a checkpoint to --resume from); a
        sharded method keeps its shard of it. In place, so views into flat buffers stay views."""
        model.load_state_dict(model_state)
        if optimizer is not None and optimizer_state is not None:
            optimizer.load_state_dict(optimizer_state)

    def replicas(self, model: nn.Module) -> tuple[list[tuple[str, torch.Tensor]], Any]:
        """What the ranks of a group must hold alike after ``finish_epoch``, for the replica
        check: (named tensors, the process group, None for every rank). By default the whole
        model's parameters and buffers on every rank. A sharded method returns its shard and
        the group of ranks that hold the same one (HSDP's replicas), or no tensors where no two
        ranks hold the same shard: the shards put together are checked by the exactness check."""
        from labkit.training.guards import tensors

        return tensors(model), None

    def whole_model(self, model: nn.Module, state: Optional[dict],
                    build: Callable[[], nn.Module]) -> nn.Module:
        """A module holding the whole model, on rank 0, for what the workload shows at the end
        (a language model's samples run forwards on rank 0 alone). ``state``: what
        :meth:`full_state` gave; ``build()``: a fresh, unsharded model of the workload's (on the
        CPU). The model itself by default; a sharded method loads ``state`` into one it builds."""
        return model

    # report-quote: bn-finish-epoch  (quoted in the report: labkit/report/implementation.py)
    def finish_epoch(self, model: nn.Module) -> None:
        """Make every rank hold the model as the method defines it (for validation and saving).

        BatchNorm running statistics follow DDP's default: the first trainer's are the model's.
        Running statistics never feed back into training-mode forward passes, so copying them
        once here gives the same model as DDP's broadcast before every forward, for less traffic.
        """
        if self.ctx.distributed:
            for b in model.buffers():
                dist.broadcast(b, src=self.first_trainer)


def refuse_compress(cfg: TrainConfig, why: str, takes: tuple[str, ...] = ("none",)) -> None:
    """ConfigError (a method's ``check``) for a --compress other than those it ``takes``."""
    if cfg.compress not in takes:
        raise ConfigError(f"--compress {cfg.compress}: {why}")


#: why allreduce and ps refuse bf16 (their compression is fp16's)
FP16_ONLY = ("{} compresses to fp16 only; bf16 is DDP's (PyTorch's bf16_compress_hook, "
             "--method ddp)")


def broadcast_parameters(model: nn.Module, src: int = 0) -> None:
    """Start every rank from rank ``src``'s weights (as DDP does when it wraps a model)."""
    if is_distributed():
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t.data, src=src)
