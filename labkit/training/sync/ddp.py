"""Baseline: PyTorch's DistributedDataParallel, configured the way users configure it.

``--compress fp16`` registers PyTorch's own ``fp16_compress_hook`` (each bucket is cast to
fp16, divided by the world size, all-reduced and cast back), the reference the hand-written
all-reduce's compression is checked against; ``--compress bf16`` its ``bf16_compress_hook`` (the
same in bfloat16: fp32's range, 8 bits of mantissa). A subclass runs another of PyTorch's hooks
by overriding :meth:`DDPStrategy.comm_hook` (PowerSGD: labkit.training.sync.powersgd).

DDP's all-reduce runs inside backward, where the loop cannot see it. To time it without
changing what DDP computes, a communication hook does what DDP's built-in all-reduce does
(each gradient multiplied by 1/world size as it is copied into its bucket, then a summing
all-reduce of the bucket) and notes when each bucket's all-reduce started and when its future
completed. ``--no-time-comm`` leaves DDP's built-in path alone (the tests check that both give
the same parameters, bit for bit).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import (bf16_compress_hook,
                                                                      fp16_compress_hook)
from torch.nn.parallel import DistributedDataParallel

from .base import Strategy

#: --compress: PyTorch's hook for each wire format (2 bytes an element on the wire for both)
COMPRESS_HOOKS = {"fp16": fp16_compress_hook, "bf16": bf16_compress_hook}


class DDPStrategy(Strategy):
    # report-quote: ddp-setup  (quoted in the report: labkit/analysis/report/implementation.py)
    def setup(self, model: nn.Module) -> nn.Module:
        if not self.ctx.distributed:
            return model
        ids = [self.ctx.device.index] if self.ctx.device.type == "cuda" else None
        # defaults on purpose: 25 MiB buckets, broadcast_buffers=True, no bucket views
        self.ddp = DistributedDataParallel(model, device_ids=ids)
        self._grad_bytes: Optional[int] = None  # every gradient's bytes (after_backward)
        state, hook = self.comm_hook()
        self.hooked = hook is not None
        if hook is not None:
            self.ddp.register_comm_hook(state, self._timed(hook))
        return self.ddp

    def comm_hook(self) -> tuple[Any, Optional[Callable]]:
        """(state, hook) DDP runs on each gradient bucket: PyTorch's compression hook with
        --compress, else the timing copy of DDP's built-in all-reduce, else (--no-time-comm)
        no hook: DDP's built-in path."""
        if self.cfg.compress != "none":
            return None, COMPRESS_HOOKS[self.cfg.compress]
        if self.cfg.time_comm:
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
        """DDP's built-in path (--no-time-comm, no hook to see its buckets): one all-reduce of
        every gradient, counted from the gradients (their bytes summed once, not every step)."""
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
            if self.parts is None or not self.cfg.time_comm:
                return hook(state, bucket)
            started = self.parts.stamp()
            return self.parts.issued(hook(state, bucket), started)
        return timed

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        with super().no_sync():
            if not self.ctx.distributed:
                yield
                return
            with self.ddp.no_sync():  # DDP's own switch: backward fills buckets, no all-reduce
                yield
