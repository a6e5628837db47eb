"""Manual All-Reduce: hand-written, bucketed gradient averaging that overlaps with backward.

Each bucket's all-reduce is started asynchronously by a post-accumulate-grad hook as soon as
the last of its gradients is ready; after backward we only wait for what is still in flight.
Buckets are launched strictly in index order on every rank, so the collectives match even if
gradients become ready in a different order on different ranks.

``--compress fp16`` does what DDP's ``fp16_compress_hook`` does, in the same order: cast the
bucket to fp16 (into a buffer preallocated per bucket), divide by the world size, all-reduce
in fp16, copy the result back into the fp32 gradients. Half the bytes on the wire.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from labkit.core.config import TrainConfig
from labkit.core.params import option

from .base import FP16_ONLY, Strategy, broadcast_parameters, refuse_compress
from .buckets import Bucket, BucketOptions, InOrder, backward_order, make_buckets


@dataclass
class AllReduceOptions(BucketOptions):
    no_overlap: bool = option(False, "allreduce: all-reduce after backward instead of overlapping it")


class AllReduceStrategy(Strategy):
    key, title, short, result_file = ("allreduce", "Manual All-Reduce", "Manual All-Reduce",
                                      "results_all_reduce.json")
    phases = ("comm",)
    order, guide, default = 1, True, True
    Options = AllReduceOptions
    variants = {"allreduce": {}, "allreduce-fp16": {"compress": "fp16"}}
    bench_variants = ("allreduce",)
    cost_model = "ring"

    @classmethod
    def check(cls, cfg: TrainConfig, world: int) -> None:
        refuse_compress(cfg, FP16_ONLY.format("allreduce"), ("none", "fp16"))

    def setup(self, model: nn.Module) -> nn.Module:
        broadcast_parameters(model)
        self.buckets: list[Bucket] = make_buckets(backward_order(model), self.cfg.bucket_mb * 2**20,
                                                  fp16=self.cfg.compress == "fp16")
        self.bucket_of = {p: b.index for b in self.buckets for p in b.params}
        self.order = InOrder([len(b.params) for b in self.buckets])
        self.handles = []
        self.overlap = self.ctx.distributed and not self.cfg.no_overlap
        if self.overlap:
            for p in self.bucket_of:
                p.register_post_accumulate_grad_hook(self._grad_ready)
        return model

    # report-quote: allreduce-grad-ready  (quoted in the report: labkit/report/implementation.py)
    def _grad_ready(self, p: nn.Parameter) -> None:
        if not self.sync:
            return
        for i in self.order.ready(self.bucket_of[p]):
            self._start(self.buckets[i])

    # report-quote: allreduce-start  (quoted in the report: labkit/report/implementation.py)
    def _start(self, b: Bucket) -> None:
        if b.half is None:
            b.flat.div_(self.ctx.world_size)  # average as DDP does: divide first, then sum
            self.handles.append((self.all_reduce(b.flat, async_op=True), None))
        else:  # DDP's fp16_compress_hook: cast, divide (in fp16), all-reduce, copy back later
            b.half.copy_(b.flat).div_(self.ctx.world_size)
            self.handles.append((self.all_reduce(b.half, async_op=True), b))

    def zero_grad(self, optimizer) -> None:
        for b in self.buckets:
            b.flat.zero_()

    # report-quote: allreduce-after-backward  (quoted in the report: labkit/report/implementation.py)
    def after_backward(self) -> None:
        if not self.ctx.distributed:
            return
        with self.timer("comm"):
            # without overlap all buckets start here; with it, only those holding a parameter
            # that received no gradient this step
            for i in self.order.rest():
                self._start(self.buckets[i])
            for h, b in self.handles:
                h.wait()
                if b is not None:
                    b.flat.copy_(b.half)
        self.handles = []
        self.order.reset()
