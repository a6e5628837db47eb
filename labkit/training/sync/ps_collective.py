"""Parameter Server with collectives (``--ps-mode collective``, the default): the improvement the
guide itself proposes.

Parameters and gradients live in one flat buffer each (parameters and ``.grad`` are views into
them, laid out in the order backward produces the gradients), cut into buckets (``--bucket-mb``,
a small first one as in DDP). Push: each bucket is reduced to the server asynchronously from a
gradient hook as soon as backward has produced it, so the push overlaps backward. Pull: the
server broadcasts every bucket as soon as its step is done; a worker does not wait for the
parameters there, but in a forward pre-hook of each layer, for that layer's buckets only, so
the pull overlaps loading the next batch and the forward of the layers before.

``--compress fp16`` pushes fp16 gradients, with DDP's fp16_compress_hook arithmetic: each
worker casts, divides by the number of workers (in fp16) and the reduce sums in fp16; the
server casts the sum back. Pulls stay fp32: the parameters must be exact.

The sharded server (``--ps-servers K``, ps_sharded.py) is this protocol with the flat buffer
cut into K slices, each owned by one server. What every parameter-server protocol shares (the
roles, the flat layout) is here too, first.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Literal, Optional

import torch
from torch import nn

from labkit.core.config import ConfigError
from labkit.core.params import option
from labkit.training.instruments.timers import label

from .base import Strategy
from .buckets import BucketOptions, InOrder, backward_order, group_params


# ---------------------------------------------------------------- what every protocol shares
# (p2p, collective, sharded, async), as a mixin and helpers rather than one protocol inheriting
# another: the server/worker roles, the rules on the options a parameter server takes, and the
# flat-buffer layout
SERVER = 0  # the (first) server's rank


@dataclass
class PSOptions(BucketOptions):
    ps_mode: Literal["collective", "p2p"] = option(
        "collective", "ps: collective (flat reduce + broadcast) or p2p (the guide's per-tensor "
        "send/recv)")
    ps_servers: int = option(1, "ps: server ranks (0..K-1); K > 1 shards the flattened parameters "
                             "across them, each server owning one slice (collective mode)", at_least=1)
    ps_staleness: Optional[int] = option(
        None, "ps: asynchronous with bounded staleness S: the server applies each worker's "
        "gradient as it arrives and a worker runs at most S steps ahead of the slowest (default: "
        "synchronous)", at_least=0)


class ServerRoles:
    """Roles of a parameter-server job, mixed into a Strategy: ranks 0..servers-1 serve (they
    hold the parameters and the optimizer), the others train. Needs ``self.servers`` and
    ``self.ctx``. Every protocol of the parameter server (labkit.training.sync.ps) takes its
    options."""
    servers: int
    Options = PSOptions

    @classmethod
    def check(cls, cfg, world: int) -> None:
        if world <= cfg.ps_servers:
            need = cfg.ps_servers + 1
            raise ConfigError(f"ps needs at least {need} processes ({cfg.ps_servers} server"
                              f"{'s' if cfg.ps_servers > 1 else ''} + workers); got {world} (use "
                              f"{need} or more: --nproc with labkit, --nproc_per_node with torchrun)")
        if cfg.amp == "fp16":
            raise ConfigError("--amp fp16 is not supported with ps (the server would have to "
                              "unscale gradients); use --amp bf16")

    def describe(self) -> str:
        return f"{self.cfg.method} ({self.cfg.ps_mode})"

    def server_progress(self, step: int) -> str:
        """The server's progress bar: its own side of each phase, per step. Its push starts
        when it is ready for gradients, so it holds the workers' forward and backward; the
        epoch line's push (the workers' side) does not."""
        names = {"pull": "params", "push": "grads+compute"}
        t = {k: 1000 * v / (step + 1) for k, v in self.timer.totals.items()}
        return " ".join(f"{names.get(k, k)}={v:.0f}ms" for k, v in t.items())

    @property
    def trainers(self) -> int:
        return self.ctx.world_size - self.servers

    # report-quote: ps-trainer-index  (quoted in the report: labkit/report/implementation.py)
    @property
    def trainer_index(self) -> Optional[int]:
        return None if self.is_server else self.ctx.rank - self.servers

    @property
    def first_trainer(self) -> int:
        return self.servers

    # report-quote: ps-steps-optimizer  (quoted in the report: labkit/report/implementation.py)
    @property
    def steps_optimizer(self) -> bool:
        return self.is_server

    @property
    def is_server(self) -> bool:
        return self.ctx.rank < self.servers


def flatten(params: list[nn.Parameter], fp16: bool
            ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Parameters and gradients become views into one flat buffer each, laid out in the order
    of ``params``. Returns (flat parameters, flat gradients, the fp16 buffer a compressed push
    sends, or None)."""
    dev, dt = params[0].device, params[0].dtype
    n = sum(p.numel() for p in params)
    flat_params = torch.empty(n, dtype=dt, device=dev)
    flat_grads = torch.zeros(n, dtype=dt, device=dev)
    off = 0
    for p in params:
        k = p.numel()
        flat_params[off:off + k].copy_(p.data.reshape(-1))
        p.data = flat_params[off:off + k].view_as(p)
        p.grad = flat_grads[off:off + k].view_as(p)
        off += k
    half = torch.empty(n, dtype=torch.float16, device=dev) if fp16 else None
    return flat_params, flat_grads, half


# ---------------------------------------------------------------- the collective protocol
class CollectiveParameterServer(ServerRoles, Strategy):
    def __init__(self, cfg, ctx):
        super().__init__(cfg, ctx)
        self.servers = cfg.ps_servers  # ranks 0..servers-1 serve

    def setup(self, model: nn.Module) -> nn.Module:
        self.params = backward_order(model)  # the flat layout: buckets fill front to back
        self.flat_params, self.flat_grads, self.half = flatten(self.params,
                                                               self.cfg.compress == "fp16")
        self.shards = self._shards()
        self.mine = [self.shards[self.ctx.rank]] if self.is_server else self.shards
        self._plan_buckets(model)
        self.in_epoch = 0  # steps taken in this epoch
        return model

    def _shards(self) -> list[tuple]:
        """(server rank, lo, hi, process group) of every slice of the flat buffer: one server
        serves the whole buffer over the default group."""
        return [(SERVER, 0, self.flat_params.numel(), None)]

    def _plan_buckets(self, model: nn.Module) -> None:
        """Buckets over the flat layout, each cut at the slice boundaries into pieces
        (server, lo, hi, group): one collective per piece. A server takes part in its own
        slice's pieces only, in the same bucket order as the workers."""
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

    def zero_grad(self, optimizer) -> None:
        self.flat_grads.zero_()  # the server's zeros are its contribution to the reduce

    # (1) pull
    def before_forward(self) -> None:
        if self.pulls is None:  # none in flight: the first step, or after finish_epoch/no_sync
            self._start_pull()
        if not self.layer_waits:  # a server (its sends must finish before its next step), or
            self._await_pull()    # --compile: the whole pull now

    # report-quote: ps-start-pull  (quoted in the report: labkit/report/implementation.py)
    def _start_pull(self) -> None:
        """Every bucket's broadcast, in the order the forward needs them (the flat layout is
        backward's order, so the last bucket first)."""
        self.pulls = [[] for _ in self.buckets]
        for i in reversed(range(len(self.buckets))):
            for s, lo, hi, g in self.buckets[i]:
                self.pulls[i].append(self.broadcast(self.flat_params[lo:hi], src=s, group=g,
                                                    async_op=True, phase="pull"))

    def _wait(self, works: list, phase: str) -> None:
        """Wait for ``works``; the host time blocked counts as ``phase`` (on a GPU a wait only
        orders the streams, and blocks nothing)."""
        t0 = time.perf_counter()
        for w in works:
            w.wait()
        self.timer.totals[phase] += time.perf_counter() - t0

    # report-quote: ps-await-layer  (quoted in the report: labkit/report/implementation.py)
    def _await_layer(self, buckets: list[int], module, args) -> None:
        """Forward pre-hook: a layer's forward waits for its own parameters only."""
        if self.pulls is not None:
            with label("labkit.pull"):
                for i in buckets:
                    self._wait(self.pulls[i], "pull")
                    self.pulls[i] = []

    def _await_pull(self) -> None:
        if self.pulls is not None:
            with label("labkit.pull"):
                self._wait([w for ws in self.pulls for w in ws], "pull")
            self.pulls = None

    # (3) push and (4) average
    # report-quote: ps-grad-ready  (quoted in the report: labkit/report/implementation.py)
    def _grad_ready(self, p: nn.Parameter) -> None:
        """A worker's gradient hook: push every consecutive bucket, from the next one in
        order, whose gradients are all in."""
        if not self.sync:
            return
        for i in self.order.ready(self.bucket_of[p]):
            self._push(i)

    # report-quote: ps-push  (quoted in the report: labkit/report/implementation.py)
    def _push(self, i: int) -> None:
        for s, lo, hi, g in self.buckets[i]:
            if self.half is None:
                t = self.flat_grads[lo:hi]
            else:  # fp16_compress_hook's order: cast, divide, sum in fp16
                t = self.half[lo:hi]
                t.copy_(self.flat_grads[lo:hi]).div_(self.trainers)
            self.pushes.append(self.reduce(t, dst=s, group=g, async_op=True, phase="push"))

    # report-quote: ps-after-backward  (quoted in the report: labkit/report/implementation.py)
    def after_backward(self) -> None:
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

    @property
    def shards_gradients(self) -> bool:
        return self.servers > 1  # --grad-clip's norm: over every server's slice

    def gradients(self, optimizer) -> list[torch.Tensor]:
        """A server's averaged slice of the gradients (what it steps); a worker's: none."""
        if not self.is_server:
            return []
        _, lo, hi, _ = self.mine[0]
        return [self.flat_grads[lo:hi]]

    @contextmanager
    def no_sync(self):
        """Compute-only steps: first let any pull in flight land (it writes the parameters)."""
        self._await_pull()
        with super().no_sync():
            yield

    # (5) the server's step, then the next step's parameters go out at once
    def step(self, optimizer: Optional[torch.optim.Optimizer], scaler=None) -> None:
        self._update(optimizer, scaler)
        if self.sync:
            self.in_epoch += 1
            # the epoch's last update reaches the workers in finish_epoch, outside the steps
            # (as the p2p server's does): each step of an epoch then pulls once
            if self.in_epoch != self.steps_per_epoch:
                self._start_pull()

    def _update(self, optimizer: Optional[torch.optim.Optimizer], scaler=None) -> None:
        """The Strategy default: only the server holds an optimizer."""
        super().step(optimizer, scaler)

    def finish_epoch(self, model: nn.Module) -> None:
        self.deliver()
        super().finish_epoch(model)

    def deliver(self) -> None:
        """Every worker gets the parameters after the epoch's last update."""
        if self.pulls is None:
            self._start_pull()
        self._await_pull()
        self.in_epoch = 0
