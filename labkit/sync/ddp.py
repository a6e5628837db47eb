"""Baseline: PyTorch's DistributedDataParallel, configured the way users configure it."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .base import Strategy


class DDPStrategy(Strategy):
    # DDP's all-reduce runs inside backward and is not timed here; its exposed cost is
    # measured by `labkit bench` as step time with sync minus step time without.
    phases = ()

    def setup(self, model: nn.Module) -> nn.Module:
        if not self.ctx.distributed:
            return model
        ids = [self.ctx.device.index] if self.ctx.device.type == "cuda" else None
        # defaults on purpose: 25 MiB buckets, broadcast_buffers=True, no bucket views
        self.ddp = DistributedDataParallel(model, device_ids=ids)
        return self.ddp

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        with super().no_sync():
            if not self.ctx.distributed:
                yield
                return
            with self.ddp.no_sync():  # DDP's own switch: backward fills buckets, no all-reduce
                yield
