"""Baseline: PyTorch's DistributedDataParallel, configured the way users configure it.

``--compress fp16`` registers PyTorch's own ``fp16_compress_hook`` (each bucket is cast to
fp16, divided by the world size, all-reduced and cast back), the reference the hand-written
all-reduce's compression is checked against."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
from torch.nn.parallel import DistributedDataParallel

from .base import Strategy


class DDPStrategy(Strategy):
    # DDP's all-reduce runs inside backward and is not timed here; its exposed cost is
    # measured by `labkit bench` as step time with sync minus step time without.

    # report-quote: ddp-setup  (quoted in the report: labkit/analysis/report/implementation.py)
    def setup(self, model: nn.Module) -> nn.Module:
        if not self.ctx.distributed:
            return model
        ids = [self.ctx.device.index] if self.ctx.device.type == "cuda" else None
        # defaults on purpose: 25 MiB buckets, broadcast_buffers=True, no bucket views
        self.ddp = DistributedDataParallel(model, device_ids=ids)
        if self.cfg.compress == "fp16":
            self.ddp.register_comm_hook(None, fp16_compress_hook)  # state None: the world group
        return self.ddp

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        with super().no_sync():
            if not self.ctx.distributed:
                yield
                return
            with self.ddp.no_sync():  # DDP's own switch: backward fills buckets, no all-reduce
                yield
