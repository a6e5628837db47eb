"""Asynchronous parameter server with bounded staleness (``--ps-staleness S``): the Stale
Synchronous Parallel model of Ho et al. (NIPS 2013). One server (rank 0), N workers (1..N).

A worker's step t (t counted from 0 over the run; ``done[w]`` = gradients of worker w the
server has applied):
  worker  before_forward: send REQ(t), wait for the parameters
          forward, backward
          after_backward: send its gradient (fp16 with --compress fp16)
  server  answers REQ(t) of worker w only when  t - min_v done[v] <= S , with a snapshot of
          the parameters at that moment. A request too far ahead of the slowest worker is
          deferred, and answered as soon as enough of the slowest worker's gradients have come
          in. S = 0 gives lock-step rounds: everyone's step t starts from the parameters after
          all of round t-1's gradients.
          applies each gradient on arrival: one SGD step with the learning rate divided by N
          (the loop's optimizer, lr restored after), so one round of N updates has the size of
          one synchronous step: without momentum and with gradients taken at the same point
          it is exactly lr * (g_1 + ... + g_N) / N and lr * wd * p. With momentum each
          arrival also advances the momentum, so rounds match synchronous steps only in
          their steady-state size.

Fitting the one loop: every rank runs the same number of iterations per epoch; the server's
iteration (its ``step``) returns after applying N gradients, from whichever workers they come,
so an epoch's totals match (N x steps). While waiting it answers requests as they arrive.
At the end of an epoch (finish_epoch) every worker sends END where its next request would be;
the server waits for all of them, so no receive is left posted, then broadcasts the
parameters (and the first worker its BatchNorm buffers), as the synchronous server does.
No deadlock: a worker with the fewest applied gradients is always within the bound, so the
slowest worker never waits for a grant, and the server keeps serving while it waits.

Transport: point-to-point isend/irecv on one 2-rank process group per worker (on an eagerly
initialised NCCL group, unbatched p2p ops are serialised with every other op of that group; one
group per pair keeps a pending receive from one worker from holding up another's reply or
the epoch's all-reduces). The server keeps at most one receive posted per worker, into that
worker's own buffers (NCCL has no receive-from-any-source), in the order that worker sends:
REQ, [reply], gradient, REQ, ... It polls them with short sleeps: NCCL work answers
is_completed(); gloo's point-to-point work only completes inside wait(), so a small helper
thread waits for each gloo receive.

Observability: the server counts the gap ``t - min done`` of every grant; the loop writes the
epoch's largest as ``max_staleness_observed`` (and the count per gap as
``staleness_histogram``) into the result file.

Hooks for tests and experiments (public attributes, set from outside, e.g. by a
labkit.training.extensions trainer hook): ``step_delay`` (seconds a worker sleeps after each backward, so
the others run ahead and the bound has to hold them back) and ``tracer`` (called by the server
with one dict per grant {"event": "grant", "rank", "step", "slowest"} and per applied gradient
{"event": "apply", "rank", "step"}).
"""
from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from labkit.training.step_options import ClipRecord

from .base import Strategy
from .collectives import nbytes
from .ps_collective import SERVER, ServerRoles, flatten

END = -1  # a worker's last message of an epoch, in place of a request
IDLE, WAIT_REQ, ASKED, WAIT_GRAD, ENDED = range(5)  # the server's view of one worker
NAP_MIN, NAP_MAX = 1e-4, 2e-3  # polling sleeps (s): short after progress, longer when idle


class _Recv:
    """A posted receive that can be polled. NCCL work answers is_completed(); gloo's
    point-to-point work completes only inside wait(), so a daemon thread waits on it."""

    def __init__(self, work, threaded: bool):
        self.work, self.error = work, None
        self.thread = threading.Thread(target=self._wait, daemon=True) if threaded else None
        if self.thread is not None:
            self.thread.start()

    def _wait(self) -> None:
        try:
            self.work.wait()
        except BaseException as e:  # noqa: BLE001 - handed to the main thread by done()
            self.error = e

    def done(self) -> bool:
        if self.thread is None:
            return self.work.is_completed()
        if self.thread.is_alive():
            return False
        if self.error is not None:
            raise self.error
        return True

    def finish(self) -> None:
        """After done(): on NCCL, order the compute stream after the receive."""
        if self.thread is None:
            self.work.wait()


class AsyncParameterServer(ServerRoles, Strategy):
    def __init__(self, cfg, ctx):
        super().__init__(cfg, ctx)
        self.servers = 1  # rank 0 (the config refuses --ps-servers > 1 with --ps-staleness)
        self.step_delay = 0.0  # seconds a worker sleeps after backward (a slow worker)
        self.tracer: Optional[Callable[[dict], None]] = None  # the server's grants and applies

    def setup(self, model: nn.Module) -> nn.Module:
        self.params = [p for p in model.parameters() if p.requires_grad]
        # the flat layout of the collective protocol, whatever --ps-mode
        self.flat_params, self.flat_grads, self.half = flatten(self.params,
                                                               self.cfg.compress == "fp16")
        world, rank = self.ctx.world_size, self.ctx.rank
        self.bound = self.cfg.ps_staleness
        self.workers = list(range(1, world))
        # one 2-rank group per worker; new_group is collective: same order on every rank
        self.pair = {w: dist.new_group([SERVER, w]) for w in self.workers}
        self.threaded = dist.get_backend() != "nccl"
        dev, n = self.flat_params.device, self.flat_params.numel()
        if self.is_server:
            gdt = torch.float16 if self.half is not None else self.flat_grads.dtype
            self.grad_in = {w: torch.empty(n, dtype=gdt, device=dev) for w in self.workers}
            self.req_in = {w: torch.empty(1, dtype=torch.int64, device=dev) for w in self.workers}
            self.snap = {w: torch.empty_like(self.flat_params) for w in self.workers}
            self.reply: dict[int, Optional[dist.Work]] = {w: None for w in self.workers}
            self.posted: dict[int, Optional[_Recv]] = {w: None for w in self.workers}
            self.state = {w: IDLE for w in self.workers}
            self.done = {w: 0 for w in self.workers}
            self.asked: list[int] = []  # deferred requests, in arrival order
            self.gaps: Counter = Counter()  # this epoch's grants per gap
            self.clip = ClipRecord()  # --grad-clip: each arrival's norm before clipping
        else:
            self.my_pair = self.pair[rank]
            self.req_out = torch.empty(1, dtype=torch.int64, device=dev)
            self.steps_done = 0
        return model

    def zero_grad(self, optimizer) -> None:
        self.flat_grads.zero_()

    # ------------------------------------------------------------------ workers
    def before_forward(self) -> None:
        if self.is_server:
            return
        with self.timer("pull"):
            self.req_out.fill_(self.steps_done)
            ask = self.send(self.req_out, dst=SERVER, group=self.my_pair, async_op=True,
                            phase="pull")
            self.recv(self.flat_params, src=SERVER, group=self.my_pair, phase="pull")  # the grant
            ask.wait()

    def after_backward(self) -> None:
        if self.is_server:
            return
        if self.step_delay:
            time.sleep(self.step_delay)  # a slow worker (set from outside, see the docstring)
        with self.timer("push"):
            g = self.flat_grads if self.half is None else self.half.copy_(self.flat_grads)
            self.send(g, dst=SERVER, group=self.my_pair, phase="push")
        self.steps_done += 1

    def gradients(self, optimizer) -> list[torch.Tensor]:
        """None at the step: --grad-clip clips each worker's gradient as it arrives (_apply)."""
        return []

    # ------------------------------------------------------------------ the server
    def step(self, optimizer: Optional[torch.optim.Optimizer], scaler=None) -> None:
        if not self.is_server:
            super().step(optimizer, scaler)  # a worker: nothing, or its local optimizer (no_sync)
        elif optimizer is not None:  # (None: a compute-only step, the server idles)
            with self.timer("serve"):  # not a trainer phase: only the server's progress bar
                self._serve(optimizer)

    def _serve(self, optimizer: torch.optim.Optimizer) -> None:
        """Answer requests and apply gradients until N gradients have been applied."""
        for w in self.workers:
            if self.state[w] == IDLE:
                self._post(w, self.req_in[w], WAIT_REQ)
        applied = 0
        # the lambda reads ``applied`` as it is when the generator asks (late binding)
        for w in self._arrivals(lambda: applied == len(self.workers)):  # noqa: B023
            if self.state[w] == WAIT_GRAD:
                if applied == len(self.workers):
                    continue  # this one belongs to the next iteration; it stays posted
                self._apply(w, optimizer)
                applied += 1
                self._post(w, self.req_in[w], WAIT_REQ)
            else:
                self._take_request(w)
            self._grant()

    def _arrivals(self, finished):
        """Yield workers whose posted receive has completed, until ``finished()``; sleep
        briefly when nothing has arrived, and give up after the run's --timeout of silence."""
        nap, last = NAP_MIN, time.monotonic()
        while not finished():
            ready = [w for w in self.workers
                     if self.posted[w] is not None and self.posted[w].done()]
            yield from ready
            if ready:
                nap, last = NAP_MIN, time.monotonic()
                continue
            if time.monotonic() - last > self.cfg.timeout:
                raise TimeoutError(f"async PS server: no message from any worker for "
                                   f"{self.cfg.timeout:.0f}s")
            time.sleep(nap)
            nap = min(2 * nap, NAP_MAX)

    def _post(self, w: int, buf: torch.Tensor, state: int) -> None:
        self.posted[w] = _Recv(dist.irecv(buf, src=w, group=self.pair[w]), self.threaded)
        self.state[w] = state

    def _take_request(self, w: int) -> None:
        self.posted[w].finish()
        self.posted[w] = None
        self.count_bytes("pull", 0, nbytes(self.req_in[w]))
        t = int(self.req_in[w].item())
        if t == END:
            self.state[w] = ENDED
            return
        if t != self.done[w]:
            raise RuntimeError(f"async PS: rank {w} asked for step {t} but the server has "
                               f"applied {self.done[w]} of its gradients")
        self.state[w] = ASKED
        self.asked.append(w)

    def _grant(self) -> None:
        """Answer every deferred request that the bound now allows."""
        slowest = min(self.done.values())
        waiting = []
        for w in self.asked:
            gap = self.done[w] - slowest
            if gap > self.bound:
                waiting.append(w)
                continue
            if self.reply[w] is not None:
                self.reply[w].wait()  # the previous snapshot is out (w has used it long since)
            self.snap[w].copy_(self.flat_params)  # later updates must not leak into the send
            self.reply[w] = dist.isend(self.snap[w], dst=w, group=self.pair[w])
            self.count_bytes("pull", nbytes(self.snap[w]), 0)
            self._post(w, self.grad_in[w], WAIT_GRAD)
            self.gaps[gap] += 1
            self._trace(event="grant", rank=w, step=self.done[w], slowest=slowest)
        self.asked = waiting

    def _apply(self, w: int, optimizer: torch.optim.Optimizer) -> None:
        self.posted[w].finish()
        self.posted[w] = None
        self.count_bytes("push", 0, nbytes(self.grad_in[w]))
        self.flat_grads.copy_(self.grad_in[w])  # (from fp16 when compressed)
        if self.cfg.grad_clip:  # each worker's gradient, as it arrives
            self.clip.add(self.clip_gradients(None, self.cfg.grad_clip, grads=[self.flat_grads]))
        lrs = [g["lr"] for g in optimizer.param_groups]
        try:
            for g in optimizer.param_groups:
                g["lr"] = g["lr"] / len(self.workers)
            optimizer.step()
        finally:
            for g, lr in zip(optimizer.param_groups, lrs):
                g["lr"] = lr
        self._trace(event="apply", rank=w, step=self.done[w])
        self.done[w] += 1

    def _trace(self, **event) -> None:
        if self.tracer is not None:
            self.tracer(event)

    def epoch_metrics(self) -> dict:
        if not self.is_server:
            return {}
        m = {"max_staleness_observed": max(self.gaps, default=0),
             "staleness_histogram": [self.gaps[g] for g in range(self.bound + 1)],
             **self.clip.epoch(self.cfg.grad_clip)}  # (clipped_steps: gradients, here)
        self.gaps.clear()
        return m

    # ------------------------------------------------------------------ end of an epoch
    def finish_epoch(self, model: nn.Module) -> None:
        if self.is_server:
            self._drain()
        else:
            self.req_out.fill_(END)
            dist.send(self.req_out, dst=SERVER, group=self.my_pair)
        dist.broadcast(self.flat_params, src=SERVER)
        super().finish_epoch(model)  # BatchNorm buffers from the first worker

    def _drain(self) -> None:
        """Receive every worker's END; afterwards nothing is posted or in flight."""
        for w in self.workers:
            if self.state[w] in (ASKED, WAIT_GRAD):
                raise RuntimeError(f"async PS: the epoch ended with rank {w}'s step in flight "
                                   f"(every rank must run the same number of steps)")
            if self.state[w] == IDLE:
                self._post(w, self.req_in[w], WAIT_REQ)
        for w in self._arrivals(lambda: all(s == ENDED for s in self.state.values())):
            self._take_request(w)
            if self.state[w] != ENDED:
                raise RuntimeError(f"async PS: rank {w} asked for a step after its epoch ended")
        for w in self.workers:
            self.state[w] = IDLE
            if self.reply[w] is not None:
                self.reply[w].wait()
                self.reply[w] = None

