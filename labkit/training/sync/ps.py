"""Parameter Server: server ranks hold the parameters and the optimizer, the other ranks train.

Each step: (1) pull: the server sends the current parameters to every worker; (2) workers run
forward and backward on their own batches; (3) push: workers send their gradients to the
server, which (4) averages them and (5) applies the SGD step.

Protocols (the asynchronous one, ``--ps-staleness``, is in ps_async.py):
- ``p2p``: the original guide's, one ``send``/``recv`` per parameter tensor and per worker,
  with the server looping over the workers for every parameter. Kept as the reference.
- ``collective``: the guide's own proposed improvement. Parameters and gradients live in one
  flat buffer each (parameters and ``.grad`` are views into them, laid out in the order
  backward produces the gradients), cut into buckets (``--bucket-mb``, a small first one as
  in DDP). Push: each bucket is reduced to the server asynchronously from a gradient hook as
  soon as backward has produced it, so the push overlaps backward. Pull: the server
  broadcasts every bucket as soon as its step is done; a worker does not wait for the
  parameters there, but in a forward pre-hook of each layer, for that layer's buckets only,
  so the pull overlaps loading the next batch and the forward of the layers before.
- ``collective`` with ``--ps-servers K`` (K > 1), sharded as in Li et al. (OSDI 2014) and
  BytePS: server ranks 0..K-1 each own one contiguous slice of the flat parameters, workers
  are ranks K..world-1. Server s talks only to the workers, through a process group
  {s} + workers: pull = each server broadcasts its slice, push = each slice's gradients are
  reduced to its server, which averages them and applies SGD to its slice only (SGD with
  momentum and weight decay is elementwise, so an optimizer over a slice takes exactly the
  full optimizer's step there). A bucket that spans two slices is one collective per slice,
  all in flight together, so no single server carries all the traffic.

``--compress fp16`` pushes fp16 gradients, with DDP's fp16_compress_hook arithmetic: each
worker casts, divides by the number of workers (in fp16) and the reduce sums in fp16; the
server casts the sum back. Pulls stay fp32: the parameters must be exact.
"""
from __future__ import annotations

import time
from functools import partial
from contextlib import contextmanager
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from .base import Strategy
from .buckets import InOrder, backward_order, group_params
from .ps_common import SERVER, ServerRoles, flatten


def shard_bounds(n: int, k: int) -> list[tuple[int, int]]:
    """``k`` contiguous slices of ``range(n)`` whose sizes differ by at most one."""
    q, r = divmod(n, k)
    bounds, lo = [], 0
    for s in range(k):
        hi = lo + q + (s < r)
        bounds.append((lo, hi))
        lo = hi
    return bounds


class PSStrategy(ServerRoles, Strategy):
    def __init__(self, cfg, ctx):
        super().__init__(cfg, ctx)
        self.servers = cfg.ps_servers  # ranks 0..servers-1 serve
        self.collective = cfg.ps_mode == "collective"
        self.bucketed = False  # set by _plan_buckets (the synchronous collective protocol)

    def setup(self, model: nn.Module) -> nn.Module:
        if self.collective:
            self.params = backward_order(model)  # the flat layout: buckets fill front to back
            self.flat_params, self.flat_grads, self.half = flatten(self.params,
                                                                   self.cfg.compress == "fp16")
            self._plan_shards()
            self._plan_buckets(model)
        else:
            self.params = [p for p in model.parameters() if p.requires_grad]
            # the server accumulates each parameter's gradient from the workers in here
            self.recv_buf = [torch.empty_like(p) for p in self.params] if self.is_server else None
            for p in self.params:
                p.grad = torch.zeros_like(p)
        return model

    def _plan_shards(self) -> None:
        """``self.shards``: (server rank, lo, hi, process group) for every slice;
        ``self.mine``: the slices this rank communicates (a worker: all, a server: its own)."""
        n = self.flat_params.numel()
        if self.servers == 1:  # one server: the whole buffer, the default group
            self.shards = [(SERVER, 0, n, None)]
        else:
            workers = list(range(self.servers, self.ctx.world_size))
            # new_group is collective: every rank creates every group, in the same order
            groups = [dist.new_group([s] + workers) for s in range(self.servers)]
            self.shards = [(s, lo, hi, groups[s])
                           for s, (lo, hi) in enumerate(shard_bounds(n, self.servers))]
        self.mine = [self.shards[self.ctx.rank]] if self.is_server else self.shards
        if self.servers > 1 and self.is_server:
            self._shard_optimizer()

    def _plan_buckets(self, model: nn.Module) -> None:
        """Buckets over the flat layout, each cut at the slice boundaries into pieces
        (server, lo, hi, group): one collective per piece. A server takes part in its own
        slice's pieces only, in the same bucket order as the workers."""
        self.bucketed = True
        self.buckets, self.bucket_of, off = [], {}, 0
        groups = group_params(self.params, self.cfg.bucket_mb * 2**20)
        for i, g in enumerate(groups):
            lo, hi = off, off + sum(p.numel() for p in g)
            off = hi
            pieces = [(s, max(lo, a), min(hi, b), grp) for s, a, b, grp in self.mine
                      if max(lo, a) < min(hi, b)]
            self.buckets.append(pieces)
            self.bucket_of.update((p, i) for p in g)
        self.order = InOrder([len(g) for g in groups])
        self.pushes: list = []          # this step's reduces in flight
        self.pulls: Optional[list] = None  # per bucket, its broadcasts in flight (None: no pull)
        # hooks off under --compile (a wait inside a compiled forward breaks the graph): the
        # whole pull is awaited before the forward then, and the push still overlaps backward
        self.layer_waits = not self.is_server and not self.cfg.compile
        if not self.is_server:
            for p in self.params:
                p.register_post_accumulate_grad_hook(self._grad_ready)
        if self.layer_waits:
            for m in model.modules():
                mine = sorted({self.bucket_of[p] for p in m.parameters(recurse=False)
                               if p in self.bucket_of})
                if mine:
                    m.register_forward_pre_hook(partial(self._await_layer, mine))

    def _shard_optimizer(self) -> None:
        """A sharded server's SGD over its slice alone. The slice is an nn.Parameter sharing
        memory with the model's parameters; its momentum lives in ``flat_momentum`` (full
        size), so finish_epoch can gather every server's momentum into rank 0's checkpoint."""
        _, lo, hi, _ = self.shards[self.ctx.rank]
        self.shard = nn.Parameter(self.flat_params[lo:hi])
        self.shard.grad = self.flat_grads[lo:hi]
        c = self.cfg
        self.shard_opt = torch.optim.SGD([self.shard], lr=c.lr, momentum=c.momentum,
                                         weight_decay=c.weight_decay)
        self.flat_momentum = torch.zeros_like(self.flat_params)
        # a zero buffer takes the same first step as SGD's lazily cloned one: 0 * m + g = g
        self.shard_opt.state[self.shard]["momentum_buffer"] = self.flat_momentum[lo:hi]

    def zero_grad(self, optimizer) -> None:
        if self.collective:
            self.flat_grads.zero_()  # the server's zeros are its contribution to the reduce
        else:
            for p in self.params:
                p.grad.zero_()

    # (1) pull
    def before_forward(self) -> None:
        if not self.collective:
            with self.timer("pull"):
                self._pull_p2p()
            return
        if self.pulls is None:  # none in flight: the first step, or after finish_epoch/no_sync
            self._start_pull()
        if not self.layer_waits:  # a server (its sends must finish before its next step), or
            self._await_pull()    # --compile: the whole pull now

    # report-quote: ps-start-pull  (quoted in the report: labkit/analysis/report/implementation.py)
    def _start_pull(self) -> None:
        """Every bucket's broadcast, in the order the forward needs them (the flat layout is
        backward's order, so the last bucket first)."""
        self.pulls = [[] for _ in self.buckets]
        for i in reversed(range(len(self.buckets))):
            for s, lo, hi, g in self.buckets[i]:
                self.pulls[i].append(
                    dist.broadcast(self.flat_params[lo:hi], src=s, group=g, async_op=True))

    def _wait(self, works: list, phase: str) -> None:
        """Wait for ``works``; the host time blocked counts as ``phase`` (on a GPU a wait only
        orders the streams, and blocks nothing)."""
        t0 = time.perf_counter()
        for w in works:
            w.wait()
        self.timer.totals[phase] += time.perf_counter() - t0

    # report-quote: ps-await-layer  (quoted in the report: labkit/analysis/report/implementation.py)
    def _await_layer(self, buckets: list[int], module, args) -> None:
        """Forward pre-hook: a layer's forward waits for its own parameters only."""
        if self.pulls is not None:
            with torch.profiler.record_function("labkit.pull"):
                for i in buckets:
                    self._wait(self.pulls[i], "pull")
                    self.pulls[i] = []

    def _await_pull(self) -> None:
        if self.pulls is not None:
            with torch.profiler.record_function("labkit.pull"):
                self._wait([w for ws in self.pulls for w in ws], "pull")
            self.pulls = None

    def _pull_p2p(self) -> None:
        if self.is_server:
            for p in self.params:
                for w in range(1, self.ctx.world_size):
                    dist.send(p.data, dst=w)
        else:
            for p in self.params:
                dist.recv(p.data, src=SERVER)

    # (3) push and (4) average
    # report-quote: ps-grad-ready  (quoted in the report: labkit/analysis/report/implementation.py)
    def _grad_ready(self, p: nn.Parameter) -> None:
        """A worker's gradient hook: push every consecutive bucket, from the next one in
        order, whose gradients are all in."""
        if not self.sync:
            return
        for i in self.order.ready(self.bucket_of[p]):
            self._push(i)

    # report-quote: ps-push  (quoted in the report: labkit/analysis/report/implementation.py)
    def _push(self, i: int) -> None:
        for s, lo, hi, g in self.buckets[i]:
            if self.half is None:
                t = self.flat_grads[lo:hi]
            else:  # fp16_compress_hook's order: cast, divide, sum in fp16
                t = self.half[lo:hi]
                t.copy_(self.flat_grads[lo:hi]).div_(self.trainers)
            self.pushes.append(dist.reduce(t, dst=s, op=dist.ReduceOp.SUM, group=g, async_op=True))

    # report-quote: ps-after-backward  (quoted in the report: labkit/analysis/report/implementation.py)
    def after_backward(self) -> None:
        if not self.collective:
            with self.timer("push"):
                self._push_p2p()
            return
        self._await_pull()  # (a layer the forward skipped; normally nothing is left)
        with self.timer("push"):
            # a server (zeros) pushes every bucket here; a worker what its hooks did not start
            for i in self.order.rest():
                self._push(i)
            for w in self.pushes:
                w.wait()
        self.pushes = []
        self.order.reset()
        if self.is_server:
            _, lo, hi, _ = self.mine[0]
            if self.half is None:
                self.flat_grads[lo:hi].div_(self.trainers)
            else:
                self.flat_grads[lo:hi].copy_(self.half[lo:hi])

    def _push_p2p(self) -> None:
        if self.is_server:
            for p, buf in zip(self.params, self.recv_buf):
                for w in range(1, self.ctx.world_size):
                    dist.recv(buf, src=w)
                    p.grad.add_(buf)
                p.grad.div_(self.trainers)
        else:
            for p in self.params:
                dist.send(p.grad, dst=SERVER)

    @contextmanager
    def no_sync(self):
        """Compute-only steps: first let any pull in flight land (it writes the parameters)."""
        if self.bucketed:
            self._await_pull()
        with super().no_sync():
            yield

    # (5) the server's step: the Strategy default with one server (only it holds an optimizer);
    # a sharded server steps its slice
    def step(self, optimizer: Optional[torch.optim.Optimizer], scaler=None) -> None:
        if self.servers > 1 and self.is_server and optimizer is not None:
            group, mine = optimizer.param_groups[0], self.shard_opt.param_groups[0]
            for k in ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize"):
                mine[k] = group[k]  # the loop's optimizer stays the one source of truth
            if group["momentum"]:
                self._adopt_momentum(optimizer)
            self.shard_opt.step()
        else:
            super().step(optimizer, scaler)
        if self.bucketed and self.sync:
            self._start_pull()  # the next step's parameters go out at once

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
        if self.bucketed:
            self._await_pull()  # every worker now holds the parameters after the last update
        if self.collective and self.servers > 1:
            # every rank, servers included, gets every slice (rank 0 saves the final model)
            for s, lo, hi, _ in self.shards:
                dist.broadcast(self.flat_params[lo:hi], src=s)
            self._gather_momentum()
        elif not self.collective:
            self._pull_p2p()  # workers get the parameters after the epoch's last update
        super().finish_epoch(model)

    def _gather_momentum(self) -> None:
        """Rank 0 receives every other server's momentum slice, for its checkpoint."""
        if not (self.is_server and self.cfg.momentum):
            return
        for s, lo, hi, _ in self.shards[1:]:
            if self.ctx.rank == SERVER:
                dist.recv(self.flat_momentum[lo:hi], src=s)
            elif self.ctx.rank == s:
                dist.send(self.flat_momentum[lo:hi], dst=SERVER)
