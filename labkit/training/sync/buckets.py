"""Flat gradient buckets: each parameter's .grad is a view into one contiguous buffer, so a
bucket is synchronised by one collective with no copy in or out."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch
from torch import nn

from labkit.core.params import option


@dataclass
class BucketOptions:
    """The gradient buckets' size: an option of every method that buckets its gradients."""
    bucket_mb: float = option(25.0, "allreduce and ps collective: gradient bucket size in MiB (the "
                              "first bucket, the first gradients backward produces, at most 1 MiB "
                              "as in DDP)", positive=True)


@dataclass
class Bucket:
    index: int
    params: list[nn.Parameter]
    flat: torch.Tensor
    slices: list[tuple[int, int]] = field(default_factory=list)
    #: fp16 copy of ``flat`` that goes over the wire with --compress fp16 (else None)
    half: Optional[torch.Tensor] = None


#: DDP's first bucket cap (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES): the first bucket
#: holds the first gradients backward produces, and a small one starts communication early
FIRST_BUCKET_BYTES = 2**20


def group_params(params: list[nn.Parameter], cap_bytes: float,
                 first_cap_bytes: float = FIRST_BUCKET_BYTES) -> list[list[nn.Parameter]]:
    """Consecutive runs of ``params`` of at most ``cap_bytes`` each (the first at most
    ``min(first_cap_bytes, cap_bytes)``; a parameter larger than the cap gets a run of its
    own), never mixing dtypes or devices."""
    groups: list[list[nn.Parameter]] = [[]]
    size, cap = 0, min(first_cap_bytes, cap_bytes)
    for p in params:
        nbytes = p.numel() * p.element_size()
        g = groups[-1]
        if g and (size + nbytes > cap or p.dtype != g[0].dtype or p.device != g[0].device):
            groups.append([])
            size, cap = 0, cap_bytes
        groups[-1].append(p)
        size += nbytes
    return [g for g in groups if g]


def make_buckets(params: list[nn.Parameter], cap_bytes: float, fp16: bool = False) -> list[Bucket]:
    """Group ``params`` in the given order into buckets (``group_params``) and point each
    ``.grad`` into its bucket. ``fp16``: also preallocate each bucket's fp16 buffer."""
    groups = group_params(params, cap_bytes)
    buckets = []
    for i, g in enumerate(groups):
        flat = torch.zeros(sum(p.numel() for p in g), dtype=g[0].dtype, device=g[0].device)
        b = Bucket(i, g, flat, half=torch.empty_like(flat, dtype=torch.float16) if fp16 else None)
        off = 0
        for p in g:
            n = p.numel()
            # autograd accumulates into an existing .grad in place, so the view stays a view
            p.grad = flat[off:off + n].view_as(p)
            b.slices.append((off, n))
            off += n
        buckets.append(b)
    return buckets


def backward_order(model: nn.Module) -> list[nn.Parameter]:
    """Trainable parameters in roughly the order backward produces their gradients (reverse
    registration order, as DDP assumes), so early buckets fill first and their all-reduce
    starts while backward still runs."""
    return [p for p in reversed(list(model.parameters())) if p.requires_grad]


class InOrder:
    """Which buckets to start, strictly in index order, as gradients arrive.

    Bucket i is ready once all ``sizes[i]`` of its parameters have their gradient; buckets are
    started in index order only (on every rank alike, so the collectives always match even if
    backward produces gradients in another order on another rank)."""

    def __init__(self, sizes: list[int]):
        self.sizes = sizes
        self.reset()

    def reset(self) -> None:
        """A new step: nothing in, nothing started."""
        self.pending = list(self.sizes)
        self.next = 0

    def ready(self, i: int) -> Iterator[int]:
        """One more gradient of bucket ``i`` is in: the buckets that can start now."""
        self.pending[i] -= 1
        while self.next < len(self.pending) and self.pending[self.next] == 0:
            self.next += 1
            yield self.next - 1

    def rest(self) -> Iterator[int]:
        """The buckets not started yet (after backward: those holding a parameter that got no
        gradient this step, or all of them without overlap)."""
        while self.next < len(self.pending):
            self.next += 1
            yield self.next - 1
