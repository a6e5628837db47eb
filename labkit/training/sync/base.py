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
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

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


class Strategy(Collectives):
    # --- what a method of one's own declares (labkit.training.sync.registry.spec_of reads it
    # into its MethodSpec). A built-in declares none of it: its MethodSpec line in
    # labkit.core.methods is the one place (tests/test_methods.py holds it), and a running
    # strategy reads its spec (self.phases), never these class attributes ---
    #: the report's name for it (default: the class name)
    title: str = ""
    #: True: the same parameters as DDP up to summation order (checked); False: approximate
    exact: bool = True
    #: the communication phases it times with ``self.timer(phase)`` (result keys
    #: avg_comm_time for "comm", avg_comm_time_<phase> for the others)
    phases: tuple[str, ...] = ("comm",)
    #: ranks 0..K-1 serve rather than train (then override the role properties below)
    serves: bool = False

    def __init__(self, cfg: TrainConfig, ctx: DistContext):
        self.cfg, self.ctx = cfg, ctx
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
