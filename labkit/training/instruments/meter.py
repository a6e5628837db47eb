"""What one epoch of training measures, step by step, and its figures once the epoch is over.

The loop (labkit.training.trainer) only tells the meter where a step begins and ends and what
it computed; the meter keeps the per-step loss and accuracy on the device (no host
synchronisation per step), rank 0's step boundaries (labkit.training.instruments.timers.StepClock),
the time spent waiting for data, each communication phase's time per steady-state step, and how
busy the rest of the machine was; then reduces it all over the ranks in one collective per
kind and returns the epoch's entry of the result file. The per-step losses are also where a
diverged run shows (labkit.training.guards reads the reduced ones for the first that is not
finite), so detecting it adds nothing to a step.
"""
from __future__ import annotations

import sys
import time
from typing import Callable, Optional

import torch

from labkit.core.log import Lines
from labkit.core.results import Epoch
from labkit.training.dist import all_reduce_sum, sync_device

from .timers import PARTS, MachineLoad, StepClock, StepParts, busy_figures

#: the progress bar's refresh interval in seconds on a terminal, and in a log (one line each)
BAR_REFRESH, LOG_REFRESH = 0.5, 5.0


def summed(figures: dict[str, object], device: torch.device) -> dict[str, torch.Tensor]:
    """Named figures (each a number, a row of numbers or rows of equal length) summed over the
    ranks, float64, in one all-reduce: packed one after the other in the dict's order (the
    same on every rank) and unpacked by name, each in its shape. The one place that knows
    where a figure lies in the collective's buffer."""
    shaped = {name: torch.tensor(v, dtype=torch.float64) for name, v in figures.items()}
    flat = torch.cat([t.reshape(-1) for t in shaped.values()]).to(device)
    all_reduce_sum(flat)
    pieces = flat.split([t.numel() for t in shaped.values()])
    return {name: x.view(t.shape) for (name, t), x in zip(shaped.items(), pieces)}


class EpochMeter:
    def __init__(self, steps: int, warmup: int, strategy, device: torch.device, main: bool,
                 parts: StepParts, hits_of: Optional[Callable] = None, rate: str = "samples/s"):
        self.steps, self.warmup, self.s, self.dev = steps, warmup, strategy, device
        # the workload's right predictions of a batch, hits_of(output, target) (a tensor of
        # bools, or None): training accuracy where the workload has one
        self.hits_of, self.rate = hits_of, rate
        self.losses = torch.zeros(steps, device=device)   # per-step loss, summed over trainers
        self.correct = torch.zeros((), device=device)     # correct predictions, on the device
        self.images = 0                                   # samples judged, counted on the host
        # the steps' losses and right predictions since the last fold(), as the steps left them
        # on the device: a step adds no kernel of the meter's own (writing each loss into
        # ``losses`` and summing each step's hits into ``correct`` took three more per step)
        self.pending: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (step, loss, hits)
        self.data_time = 0.0
        # rank 0's steady-state steps, one mark per step boundary: the same clock and window as
        # train_throughput, so mean(step_times) is avg_batch_time (labkit.core.stats)
        self.clock = StepClock(device)
        # rank 0 (the one that writes the file): how busy the rest of the machine was meanwhile
        self.main, self.load = main, None  # MachineLoad, from start() to stop()
        self.step_comm: list[list[float]] = []  # per steady-state step, seconds in each phase
        self.seen = [0.0] * len(strategy.phases)
        self.machine: Optional[dict] = None
        self.parts = parts  # where each step went, on this rank (marked by the loop)

    def start(self) -> None:
        # the machine's load over the whole epoch, sampled here and at stop(): a sample reads
        # /proc for every process on the machine (milliseconds), which at the warm-up's end
        # held up the other ranks' first steady-state step in its collective
        if self.main:
            self.load = MachineLoad()  # its first sample
        sync_device(self.dev)
        self.t_start = self.t_window = time.perf_counter()

    def step_begins(self, step: int) -> None:
        """The boundary before ``step``: the steady-state window opens after the warm-up."""
        self.parts.begin()
        if step == self.warmup:
            if self.warmup:
                sync_device(self.dev)
            self.t_window = self.clock.mark()
        elif step > self.warmup:
            self.clock.mark()

    def next_batch(self, it, to_device):
        """The next batch from ``it`` on the device, the wait for it counted as data time."""
        t0 = time.perf_counter()
        x, y = next(it)
        self.data_time += time.perf_counter() - t0
        return to_device(x, y)

    def step_ends(self, step: int, out, y: Optional[torch.Tensor]) -> None:
        s = self.s
        if s.phases:
            now = [s.timer.totals.get(p, 0.0) for p in s.phases]
            if step >= self.warmup:
                self.step_comm.append([a - b for a, b in zip(now, self.seen)])
            self.seen = now
        if out is not None:
            loss, logits = out
            hits = self.hits_of(logits, y) if self.hits_of is not None else None
            self.pending.append((step, loss, hits))
            if hits is not None:
                self.images += hits.numel()

    def fold(self) -> None:
        """The pending steps into ``losses`` and ``correct``: a few kernels for all of them, as
        often as the bar shows its figures and once at the epoch's end."""
        if not self.pending:
            return
        steps, losses, hits = zip(*self.pending)
        self.pending = []
        self.losses[list(steps)] = torch.stack(losses).float()
        if hits[0] is not None:
            self.correct += torch.cat(hits).sum()

    def stop(self) -> None:
        self.clock.mark()
        self.parts.close()
        sync_device(self.dev)
        self.t_end = time.perf_counter()
        self.machine = self.load.stop() if self.load is not None else None

    def running_text(self, step: int, batch_units: int) -> str:
        """The progress bar's figures after ``step`` (a trainer's view): ``batch_units`` are the
        units (images, tokens) of one step over all trainers."""
        elapsed = time.perf_counter() - self.t_start
        ups = batch_units * (step + 1) / max(elapsed, 1e-9)
        self.fold()
        text = f"loss={self.losses[:step + 1].mean().item():.4f} "
        if self.hits_of is not None and self.images:
            text += f"acc={100.0 * self.correct.item() / max(1, self.images):.2f}% "
        return text + f"{ups:.0f} {self.rate}"

    def metrics(self, epoch: int, batch_images: int) -> Epoch:
        """Epoch ``epoch``'s figures, reduced over the ranks. A PS server contributes zeros (its own
        pull and push would count the same transfer twice), so sums are over trainers."""
        s, n = self.s, len(self.s.phases)
        self.fold()
        comm = s.timer.pop()
        # the loss and the right predictions stay on the device, float32, as the steps left
        # them (summed there, no host synchronisation first); the host's figures are float64
        counts = torch.stack([self.correct, torch.tensor(float(self.images), device=self.dev)])
        all_reduce_sum(self.losses)
        all_reduce_sum(counts)
        got = summed({"data_time": self.data_time,  # seconds waited for batches
                      "comm": [comm.get(p, 0.0) if s.is_trainer else 0.0 for p in s.phases],
                      # per steady-state step, a row of seconds per phase
                      "comm_steps": [row if s.is_trainer else [0.0] * n for row in self.step_comm]},
                     self.dev)
        correct, judged = counts.tolist()
        losses = (self.losses / s.trainers).tolist()
        window_steps, window_time = self.steps - self.warmup, self.t_end - self.t_window
        comm_steps = (got["comm_steps"] / s.trainers).view(-1, n).tolist() if n else []  # mean over trainers
        e = Epoch(
            epoch=epoch,
            train_loss=sum(losses) / len(losses),
            train_accuracy=100.0 * correct / max(1.0, judged) if judged else None,
            train_time=self.t_end - self.t_start,
            train_throughput=batch_images * window_steps / window_time,
            avg_batch_time=window_time / window_steps,
            comm={p: got["comm"][i].item() / s.trainers / self.steps for i, p in enumerate(s.phases)},
            comm_times={p: [row[i] for row in comm_steps] for i, p in enumerate(s.phases)},
            all_losses=losses,
            steps=self.steps,
            throughput_warmup_steps=self.warmup,
            avg_data_time=got["data_time"].item() / s.trainers / self.steps,
            step_times=self.clock.durations(),
            machine_load=self.machine)
        self.parts_metrics(e)
        return e

    def parts_metrics(self, e: Epoch) -> None:
        """Where the steady-state steps went (new keys of the result file, per step): each part
        and the time collectives ran, as the mean over the trainers; a parameter server's
        update time (mean over the servers); and, per trainer, the time it was held in
        synchronisation (compute, pull and sync: its wait once its own compute-only time is
        taken off, labkit.core.breakdown.waits), into ``e``."""
        s = self.s
        got = self.parts.take(self.warmup)
        n, world = self.steps - self.warmup, max(1, s.ctx.world_size)
        zeros, servers = [0.0] * n, world - s.trainers
        p = got["parts"]
        held = [[0.0] * n for _ in range(world)]  # a row per rank, each its own
        if s.is_trainer:
            held[s.ctx.rank] = [a + b + c for a, b, c in zip(p["compute"], p["pull"], p["sync"])]
        # a server's zeros in the trainers' figures, a trainer's in the server's update
        sums = summed({**{part: p[part] if s.is_trainer else zeros for part in PARTS},
                       "busy": got["busy"] if s.is_trainer else zeros,
                       "server_update": zeros if s.is_trainer else p["optimizer"],
                       "held": held}, self.dev)
        e.step_parts = {part: (sums[part] / s.trainers).tolist() for part in PARTS}
        busy = busy_figures(sums["busy"] / s.trainers) if s.cfg.times_comm else []
        if busy:  # None: a step without a figure (DDP's reducer: an epoch's last step)
            e.comm_busy_times = busy
        for channel, xs in got["also"].items():  # DDP's reducer's, beside its hook's
            v = torch.tensor(xs, dtype=torch.float64, device=self.dev)
            all_reduce_sum(v)
            e.extra[f"comm_{channel}_times"] = busy_figures(v / s.trainers)
        if servers:
            e.server_update_times = (sums["server_update"] / servers).tolist()
        ranks = list(range(servers, world))  # a parameter server's servers are ranks 0..K-1
        e.sync_held = {"ranks": ranks, "times": [sums["held"][r].tolist() for r in ranks]}


class Bar:
    """An epoch's progress bar: the first trainer shows the training bar, a PS server its own
    batch bar, any other rank none (nor any rank with --no-progress). Its figures (loss,
    accuracy, img/s) are set only as often as the bar can show them (its mininterval) and at
    the epoch's last step: they read the device, which on a GPU waits for the step's work to
    finish, a stall the step would not have otherwise. Set before the update, so the refresh
    that update makes shows this step's figures."""

    def __init__(self, cfg, ctx, strategy, steps: int, epoch: int, units_per_sample: int = 1):
        s = self.s = strategy
        self.steps, self.bar = steps, None
        self.batch_images = cfg.batch_size * s.trainers * units_per_sample
        if cfg.progress and (ctx.rank == s.first_trainer or (not s.is_trainer and ctx.is_main)):
            from tqdm import tqdm
            desc = f"epoch {epoch}/{cfg.epochs}" + ("" if s.is_trainer else " [server]")
            tty = sys.stderr.isatty()
            self.bar = tqdm(total=steps, desc=desc, unit="batch", dynamic_ncols=tty,
                            ncols=None if tty else 100, leave=True,
                            mininterval=BAR_REFRESH if tty else LOG_REFRESH,
                            file=sys.stderr if tty else Lines(sys.stderr))
        self.figures_at = time.perf_counter()

    def update(self, meter: EpochMeter, step: int) -> None:
        """One step on the bar."""
        bar = self.bar
        if bar is None:
            return
        now = time.perf_counter()
        if now - self.figures_at >= bar.mininterval or step + 1 == self.steps:
            self.figures_at = now
            text = (meter.running_text(step, self.batch_images) if self.s.is_trainer
                    else self.s.server_progress(step))
            bar.set_postfix_str(text, refresh=False)
        bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
