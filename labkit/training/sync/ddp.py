"""Baseline: PyTorch's DistributedDataParallel, configured the way users configure it.

``--compress fp16`` registers PyTorch's own ``fp16_compress_hook`` (each bucket is cast to
fp16, divided by the world size, all-reduced and cast back), the reference the hand-written
all-reduce's compression is checked against; ``--compress bf16`` its ``bf16_compress_hook`` (the
same in bfloat16: fp32's range, 8 bits of mantissa). A subclass runs another of PyTorch's hooks
by overriding :meth:`DDPStrategy.comm_hook` (PowerSGD: labkit.training.sync.powersgd).

DDP's all-reduce runs inside backward, where the loop cannot see it. ``--time-comm stats``
(the default) leaves DDP's built-in C++ path alone and reads the reducer's own runtime
statistics (:class:`ReducerStats`: from the first bucket's all-reduce to the end of the last
one, gradients written back), of every step on the CPU and of one step in
``SAMPLE_EVERY["cuda"]`` on a GPU. ``--time-comm hook`` times each bucket instead: a
communication hook does what DDP's built-in all-reduce does (each gradient multiplied by 1/world
size as it is copied into its bucket, then a summing all-reduce of the bucket) and notes when
each bucket's all-reduce started and when its future completed. ``--time-comm off`` times
nothing. The tests check that the three give the same parameters, bit for bit;
docs/where-the-time-goes.md says what each counts.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import (bf16_compress_hook,
                                                                      fp16_compress_hook)
from torch.nn.parallel import DistributedDataParallel

from labkit.core.params import option

from .base import Strategy

#: --compress: PyTorch's hook for each wire format (2 bytes an element on the wire for both)
COMPRESS_HOOKS = {"fp16": fp16_compress_hook, "bf16": bf16_compress_hook}

#: The reducer times one synchronised step in this many (its runtime-logging sampling rate; it
#: always times its first 10), by device type. On the CPU a timed step costs nothing measurable;
#: on a GPU the reducer waits for a timed step's CUDA events at the next forward, which stalls
#: the host's run-ahead (docs/where-the-time-goes.md, "The reducer's statistics on a GPU").
SAMPLE_EVERY = {"cpu": 1, "cuda": 20}


@dataclass
class DDPOptions:
    find_unused_parameters: bool = option(
        False, "let the model have parameters that a step gives no gradient (a forward that uses "
        "some layers on some batches only): ddp and powersgd pass it to DDP, which then walks "
        "the autograd graph from the outputs after every forward to find them, a cost each step "
        "(the other methods need no flag for them). Without it the check before a run refuses "
        "such a model, naming them")


class DDPStrategy(Strategy):
    key = "ddp"
    title, short, result_file = "Baseline DDP (PyTorch)", "Baseline DDP", "results_baseline_ddp.json"
    phases = ()  # DDP's all-reduce runs inside backward: the reducer's statistics time it
    order, guide, baseline, default = 0, True, True, True
    Options = DDPOptions
    variants = {"ddp": {}, "ddp-fp16": {"compress": "fp16"}, "ddp-bf16": {"compress": "bf16"}}
    bench_variants = ("ddp",)
    preload = ("torch.nn.parallel", "torch.distributed.algorithms.ddp_comm_hooks.default_hooks")
    cost_model = "ring"

    # report-quote: ddp-setup  (quoted in the report: labkit/report/implementation.py)
    def setup(self, model: nn.Module) -> nn.Module:
        self.stats: Optional[ReducerStats] = None  # the reducer's figures (--time-comm)
        if not self.ctx.distributed:
            return model
        ids = [self.ctx.device.index] if self.ctx.device.type == "cuda" else None
        # defaults on purpose: 25 MiB buckets, broadcast_buffers=True, no bucket views
        self.ddp = DistributedDataParallel(model, device_ids=ids,
                                           find_unused_parameters=self.cfg.find_unused_parameters)
        self._grad_bytes: Optional[int] = None  # every gradient's bytes (after_backward)
        state, hook = self.comm_hook()
        self.hooked = hook is not None
        if hook is not None:
            self.ddp.register_comm_hook(state, self._timed(hook))
        if self.cfg.times_comm:  # with the hook, the reducer's figures too, to compare
            channel = "busy" if self.cfg.time_comm == "stats" else "reducer"
            self.stats = ReducerStats(self.ddp, channel, SAMPLE_EVERY.get(self.ctx.device.type, 1))
        return self.ddp

    def comm_hook(self) -> tuple[Any, Optional[Callable]]:
        """(state, hook) DDP runs on each gradient bucket: PyTorch's compression hook with
        --compress, else with --time-comm hook the timing copy of DDP's built-in all-reduce,
        else no hook: DDP's built-in path."""
        if self.cfg.compress != "none":
            return None, COMPRESS_HOOKS[self.cfg.compress]
        if self.cfg.time_comm == "hook":
            return None, self._allreduce_mean
        return None, None

    def count_bucket(self, buf: torch.Tensor) -> None:
        """Count one bucket's all-reduce, before the hook runs on it: the bucket's elements at
        the width they travel at (2 bytes with --compress, else the gradients' own)."""
        self._count(buf.numel(), 2 if self.cfg.compress != "none" else buf.element_size())

    def _count(self, numel: int, element_size: int) -> None:
        """The bytes of one bucket's all-reduce (a ring: 2(n-1)/n of the bucket each way), as
        the lab counts every method's collectives (labkit.training.sync.collectives)."""
        n = self.ctx.world_size
        b = 2 * (n - 1) / n * numel * element_size
        self.count_bytes("comm", b, b)

    def after_backward(self) -> None:
        """DDP's built-in path (no hook to see its buckets: --time-comm stats or off): one
        all-reduce of every gradient, counted from the gradients (their bytes summed once, not
        every step)."""
        if self.ctx.distributed and self.sync and not self.hooked:
            if self._grad_bytes is None:
                self._grad_bytes = sum(p.numel() * p.element_size()
                                       for p in self.ddp.parameters() if p.requires_grad)
            self._count(self._grad_bytes, 1)

    def _allreduce_mean(self, state, bucket):  # no annotations: DDP checks them, and this
        # module's are strings (from __future__ import annotations)
        """DDP's built-in all-reduce: with no hook the reducer multiplies each gradient by
        1/world size while copying it into the bucket; with a hook it copies it unscaled, so
        the same product is taken here, then the same summing all-reduce."""
        buf = bucket.buffer()
        buf.mul_(1.0 / self.ctx.world_size)
        work = dist.all_reduce(buf, async_op=True)
        return work.get_future().then(lambda f: f.value()[0])

    def _timed(self, hook):
        def timed(state, bucket):
            self.count_bucket(bucket.buffer())
            if self.parts is None or self.cfg.time_comm != "hook":
                return hook(state, bucket)
            started = self.parts.stamp()
            return self.parts.issued(hook(state, bucket), started)
        return timed

    def step(self, optimizer: Optional[torch.optim.Optimizer], scaler=None) -> None:
        # the reducer's figures are read here, so that the read (its cost: the bench's
        # instrument rounds, docs/where-the-time-goes.md) counts in the optimizer's part of the
        # step, not as communication
        if self.stats is not None and self.sync and self.parts is not None:
            self.stats.read(self.parts)
        super().step(optimizer, scaler)

    @contextmanager
    def accumulating(self) -> Iterator[None]:
        """--grad-accum: DDP's own ``no_sync`` (nanoGPT's ``require_backward_grad_sync``): the
        backward fills the gradients, the reducer all-reduces at the step's last micro-batch."""
        with super().accumulating():
            if not self.ctx.distributed:
                yield
                return
            with self.ddp.no_sync():
                yield

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        with super().no_sync():
            if not self.ctx.distributed:
                yield
                return
            with self.ddp.no_sync():  # DDP's own switch: backward fills buckets, no all-reduce
                yield


class ReducerStats:
    """DDP's reducer's own runtime statistics (``_get_ddp_logging_data``), as each step's busy
    communication time: ``backward_comm_time``, from the first bucket's all-reduce being
    launched to the end of the reducer's finalize (every bucket's all-reduce finished and its
    gradients written back), measured in C++ with the host's clock (CUDA events on a GPU).

    The reducer publishes an iteration's figures only when the next synchronised forward
    begins (``Logger.set_runtime_stats_and_log``, called from DDP's forward), so figures read
    during step k are step k-1's: each read hands them to the previous synchronised step's
    reporter (labkit.training.instruments.timers.StepParts.reporter) and takes this step's. The
    last step before the figures are collected (an epoch's, a bench stretch's) gets none, nor does
    a step the reducer did not time (``every`` > 1: it times one synchronised step in ``every``
    after its first 10); the breakdown averages over the steps that have them. A reading already
    handed on (the same forward start: no synchronised step ran since, e.g. after compute-only
    steps, or the reducer timed none) is not handed on twice. Beside the timing hook
    (--time-comm hook), its figures go to their own channel (the result file's
    comm_reducer_times), to compare the two on the same steps."""

    def __init__(self, ddp: DistributedDataParallel, channel: str = "busy", every: int = 1):
        self.ddp, self.channel = ddp, channel  # StepParts.reporter's
        # one iteration in ``every`` (PyTorch's default: the first 10, then every 100th)
        ddp._set_ddp_runtime_logging_sample_rate(every)
        self.pending: Optional[Callable[[float], None]] = None  # the last synchronised step's
        self.seen: Optional[int] = None  # forward start (ns) of the figures last handed on

    def read(self, parts) -> None:
        d = self.ddp._get_ddp_logging_data()
        start, comm = d.get("forward_compute_time_start"), d.get("backward_comm_time")
        if self.pending is not None and start and start != self.seen and comm:
            self.pending(comm / 1e9)
            self.seen = start
        self.pending = parts.reporter(self.channel)
