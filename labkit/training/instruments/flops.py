"""A rank's efficiency figures (labkit.core.efficiency): model FLOPs per unit (image, token), MFU, peak GPU
memory and optimizer state per rank and the data wait as a share of the step, per epoch and for the whole run
(the result file's "efficiency")."""
from __future__ import annotations

from statistics import mean
from typing import Optional

import torch

from labkit.core.config import TrainConfig
from labkit.core import results
from labkit.core.efficiency import mfu, peak_flops, precision
from labkit.core.results import Epoch
from labkit.training.dist import DistContext, all_reduce_sum



def held_bytes(t: torch.Tensor) -> int:
    """The bytes this rank holds of ``t``: a DTensor's local shard (``to_local``), where its
    ``numel`` is the global tensor's."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()

class Efficiency:
    def __init__(self, cfg: TrainConfig, ctx: DistContext, workload, data):
        """``workload``: the run's (labkit.workloads), which counts the FLOPs of one sample's
        forward (of its Datasets ``data``); FLOPs and MFU are per unit (image, token)."""
        self.ctx, self.cuda = ctx, ctx.device.type == "cuda"
        self.device_name = torch.cuda.get_device_name(ctx.device) if self.cuda else None
        self.precision = precision(cfg.amp, self.cuda and torch.backends.cudnn.allow_tf32)
        self.peak = peak_flops(self.device_name, self.precision) if self.cuda else None
        # ranks sharing a GPU (--backend gloo --device cuda) count it once
        per_gpu = -(-ctx.local_world_size // max(1, torch.cuda.device_count())) if self.cuda else 1
        self.gpus = max(1, ctx.world_size // per_gpu) if self.cuda else 0
        self.forward: Optional[int] = None
        if ctx.is_main:  # rank 0 writes the file; a count that fails leaves FLOPs and MFU out
            try:
                flops = workload.forward_flops(data)
                self.forward = round(flops / workload.units_per_sample) if flops else None
            except Exception:  # noqa: BLE001 - a figure of the report, never a reason to stop
                self.forward = None

    def epoch(self, e: Epoch) -> None:
        """One epoch's efficiency figures, into its ``e`` (every rank calls it)."""
        e.data_wait_share = e.waited_share
        if self.cuda:
            v = torch.zeros(max(1, self.ctx.world_size), dtype=torch.float64, device=self.ctx.device)
            v[self.ctx.rank] = torch.cuda.max_memory_allocated(self.ctx.device)
            e.peak_memory_bytes = [int(b) for b in all_reduce_sum(v).tolist()]
        if self.forward:
            e.mfu = mfu(3 * self.forward, e.train_throughput, self.peak, self.gpus)

    def state_bytes(self, tensors: list[torch.Tensor]) -> list[int]:
        """Every rank's bytes of ``tensors`` (its optimizer state), in rank order (every rank
        calls it): what each holds, a sharded tensor's (a DTensor's) local shard, not its
        global size."""
        v = torch.zeros(max(1, self.ctx.world_size), dtype=torch.float64, device=self.ctx.device)
        v[self.ctx.rank] = sum(held_bytes(t) for t in tensors)
        return [int(b) for b in all_reduce_sum(v).tolist()]

    def summary(self, epochs: list[Epoch]) -> results.Efficiency:
        """The run's "efficiency" entry (rank 0), over its epochs so far."""
        waits = [e.data_wait_share for e in epochs if e.data_wait_share is not None]
        thr = [e.train_throughput for e in epochs if e.train_throughput]
        mem = [e.peak_memory_bytes for e in epochs if e.peak_memory_bytes]
        state = [e.optimizer_state_bytes for e in epochs if e.optimizer_state_bytes]
        flops = 3 * self.forward if self.forward else None
        return results.Efficiency(
            forward_flops_per_image=self.forward, flops_per_image=flops,
            device_name=self.device_name, precision=self.precision,
            peak_flops_per_gpu=self.peak, gpus=self.gpus,
            mfu=mfu(flops, mean(thr), self.peak, self.gpus) if thr else None,
            peak_memory_bytes=[max(col) for col in zip(*mem)] if mem else None,
            optimizer_state_bytes=[max(col) for col in zip(*state)] if state else None,
            data_wait_share=mean(waits) if waits else None)
