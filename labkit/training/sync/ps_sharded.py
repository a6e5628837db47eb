"""Sharded Parameter Server (``--ps-servers K``, K > 1), as in Li et al. (OSDI 2014) and BytePS.

Server ranks 0..K-1 each own one contiguous slice of the flat parameters of the collective
protocol (ps_collective.py); workers are ranks K..world-1. Server s talks only to the workers,
through a process group {s} + workers: pull = each server broadcasts its slice, push = each
slice's gradients are reduced to its server, which averages them and applies SGD to its slice
only (SGD with momentum and weight decay is elementwise, so an optimizer over a slice takes
exactly the full optimizer's step there). A bucket that spans two slices is one collective per
slice, all in flight together, so no single server carries all the traffic.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from .ps_collective import SERVER, CollectiveParameterServer


def shard_bounds(n: int, k: int) -> list[tuple[int, int]]:
    """``k`` contiguous slices of ``range(n)`` whose sizes differ by at most one."""
    q, r = divmod(n, k)
    bounds, lo = [], 0
    for s in range(k):
        hi = lo + q + (s < r)
        bounds.append((lo, hi))
        lo = hi
    return bounds


class ShardedParameterServer(CollectiveParameterServer):
    def _shards(self) -> list[tuple]:
        workers = list(range(self.servers, self.ctx.world_size))
        # new_group is collective: every rank creates every group, in the same order
        groups = [dist.new_group([s] + workers) for s in range(self.servers)]
        shards = [(s, lo, hi, groups[s])
                  for s, (lo, hi) in enumerate(shard_bounds(self.flat_params.numel(), self.servers))]
        if self.is_server:
            self._shard_optimizer(*shards[self.ctx.rank][1:3])
        return shards

    def _shard_optimizer(self, lo: int, hi: int) -> None:
        """A server's SGD over its slice alone. The slice is an nn.Parameter sharing memory with
        the model's parameters; its momentum lives in ``flat_momentum`` (full size), so
        finish_epoch can gather every server's momentum into rank 0's checkpoint."""
        self.shard = nn.Parameter(self.flat_params[lo:hi])
        self.shard.grad = self.flat_grads[lo:hi]
        c = self.cfg
        self.shard_opt = torch.optim.SGD([self.shard], lr=c.lr, momentum=c.momentum,
                                         weight_decay=c.weight_decay)
        self.flat_momentum = torch.zeros_like(self.flat_params)
        # a zero buffer takes the same first step as SGD's lazily cloned one: 0 * m + g = g
        self.shard_opt.state[self.shard]["momentum_buffer"] = self.flat_momentum[lo:hi]

    def _update(self, optimizer: Optional[torch.optim.Optimizer], scaler=None) -> None:
        """A server steps its slice; the loop's optimizer stays the one source of truth for the
        settings (and, through views, for the momentum rank 0 checkpoints)."""
        if not (self.is_server and optimizer is not None):
            return super()._update(optimizer, scaler)  # a worker: nothing, or no_sync's local SGD
        group, mine = optimizer.param_groups[0], self.shard_opt.param_groups[0]
        for k in ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize"):
            mine[k] = group[k]
        if group["momentum"]:
            self._adopt_momentum(optimizer)
        self.shard_opt.step()

    def _adopt_momentum(self, optimizer: torch.optim.Optimizer) -> None:
        """On a sharded server the loop's optimizer (over the model's parameters) never steps;
        its state holds views into ``flat_momentum`` instead, so rank 0's checkpoint saves the
        whole momentum in the one-server format (gathered by finish_epoch), and a checkpoint
        loaded into it (on every server, before the first step) is copied in here."""
        first = optimizer.state.get(self.params[0], {}).get("momentum_buffer")
        if first is not None and first.data_ptr() == self.flat_momentum.data_ptr():
            return  # already views
        off = 0
        for p in self.params:
            k = p.numel()
            view = self.flat_momentum[off:off + k].view_as(p)
            loaded = optimizer.state[p].get("momentum_buffer")
            if loaded is not None:
                view.copy_(loaded)
            optimizer.state[p]["momentum_buffer"] = view
            off += k

    def finish_epoch(self, model: nn.Module) -> None:
        super().finish_epoch(model)  # deliver(), then the BatchNorm buffers
        self._gather_momentum()

    def deliver(self) -> None:
        """Every rank, servers included, gets every slice (rank 0 saves the final model)."""
        self._await_pull()
        for s, lo, hi, _ in self.shards:
            dist.broadcast(self.flat_params[lo:hi], src=s)
        self.in_epoch = 0

    def _gather_momentum(self) -> None:
        """Rank 0 receives every other server's momentum slice, for its checkpoint."""
        if not (self.is_server and self.cfg.momentum):
            return
        for s, lo, hi, _ in self.shards[1:]:
            if self.ctx.rank == SERVER:
                dist.recv(self.flat_momentum[lo:hi], src=s)
            elif self.ctx.rank == s:
                dist.send(self.flat_momentum[lo:hi], dst=SERVER)
