"""What the lab's instruments cost, rank side: the loops `labkit bench` pairs with each
method's job, and the loop's work without a switch, timed call by call.

An instrument with a switch is priced in paired rounds (labkit.bench.bench_rank): the job's
own Trainer ("as run") beside Trainers that differ from it by one instrument
(:func:`instrument_loops`: ``--time-comm off``, DDP's other timing, ``--no-progress``), in the
same processes, from the same weights, on the same batches. The work that has no switch, and
the per-epoch checks, which a round of a few steps cannot resolve, are timed directly
(:func:`per_step_work`). After the rounds every loop's parameters are compared with the job's
(:func:`loops_agree`; on a GPU against the device's own repeatability, :func:`repeatable`).
labkit.bench.instrument_cost turns both into the bench's figures.
"""
from __future__ import annotations

import dataclasses
import io
import statistics
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from labkit.core.config import TrainConfig
from labkit.core.methods import BASELINE
from labkit.core.results import Epoch
from labkit.training import guards
from labkit.training.dist import is_distributed, sync_device
from labkit.training.instruments.meter import BAR_REFRESH
from labkit.training.instruments.timers import StepClock, StepParts

AS_RUN = "as run"  # the rounds' name for the job's own loop (its config as given)
#: what the loop marks in every step, in order (Trainer.train_epoch, then train_step)
STEP_MARKS = ("other", "data", "pull", "compute", "sync", "optimizer")


def trial_stats(xs: list[float]) -> dict:
    """The trials' times as the bench's documents give them: median, min, max, IQR, all."""
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs),
            "iqr": q[2] - q[0], "trials": xs}


def slowest(t: float, device: torch.device) -> float:
    """The largest of every rank's ``t``."""
    if is_distributed():
        v = torch.tensor([t], dtype=torch.float64, device=device)
        dist.all_reduce(v, op=dist.ReduceOp.MAX)
        t = v.item()
    return t


def count_differing(a: torch.nn.Module, b: torch.nn.Module, device: torch.device) -> int:
    """How many tensors of the two models' state differ (not bit for bit), over all ranks."""
    sa, sb = a.state_dict(), b.state_dict()
    n = torch.tensor([sum(not torch.equal(sa[k], sb[k]) for k in sa) + len(set(sa) ^ set(sb))],
                     dtype=torch.int64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(n)
    return int(n.item())


def instrument_loops(cfg: TrainConfig) -> dict[str, TrainConfig]:
    """The loops of the instrument rounds, the job's own first: each other differs from it by
    one instrument turned off (``--time-comm off``, ``--no-progress``) or, for DDP, by its
    other timing (``stats`` or ``hook``: both are priced against ``off``)."""
    out = {AS_RUN: cfg}
    if cfg.times_comm:
        out["--time-comm off"] = dataclasses.replace(cfg, time_comm="off")
        if cfg.method == BASELINE and cfg.compress == "none":  # a hook of its own: no choice
            other = "hook" if cfg.time_comm == "stats" else "stats"
            out[f"--time-comm {other}"] = dataclasses.replace(cfg, time_comm=other)
    if cfg.progress:
        out["--no-progress"] = dataclasses.replace(cfg, progress=False)
    return out


def instrument_pairs(cfg: TrainConfig, loops: list[str]) -> list[dict]:
    """Each instrument the rounds price: {"instrument", "on": the loop with it, "off": the loop
    without it}."""
    out = []
    if "--time-comm off" in loops:
        out.append({"instrument": f"--time-comm {cfg.time_comm}", "on": AS_RUN, "off": "--time-comm off"})
        out += [{"instrument": name, "on": name, "off": "--time-comm off"}
                for name in ("--time-comm stats", "--time-comm hook") if name in loops]
    if "--no-progress" in loops:
        out.append({"instrument": "progress bar", "on": AS_RUN, "off": "--no-progress"})
    return out


class _PerCall:
    """Seconds per call of a function: the median of ``batches`` batches of ``reps`` calls (after
    one untimed call), the device's work included, the slowest rank's."""

    def __init__(self, device: torch.device, reps: int, batches: int):
        self.dev, self.reps, self.batches = device, reps, batches

    def __call__(self, fn: Callable[[], Any], reps: int = 0) -> float:
        n = reps or self.reps
        fn()
        got = []
        for _ in range(self.batches):
            sync_device(self.dev)
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            sync_device(self.dev)
            got.append((time.perf_counter() - t0) / n)
        return slowest(statistics.median(got), self.dev)


def per_step_work(tr, data, step: float, reps: int = 200, batches: int = 5) -> dict:
    """The training loop's per-step work that has no switch, and its per-epoch checks, timed
    directly on every rank (:class:`_PerCall`): {"epoch_steps": steps per epoch of a run of
    this config, over which a per-epoch check is spread, "step": the job's median step,
    "items": [{"work", "every": "step" or "epoch", "seconds": per call, "per_step"}]}."""
    from labkit.training.data import steps_per_epoch

    cfg, s = tr.cfg, tr.strategy
    epoch = steps_per_epoch(len(data.train), s.trainers, cfg.batch_size, cfg.max_steps_per_epoch)
    per_call = _PerCall(tr.ctx.device, reps, batches)
    items = _step_work(tr, data, step, per_call) + _epoch_checks(tr, epoch, per_call)
    return {"epoch_steps": epoch, "step": step,
            "items": [{"work": w, "every": e, "seconds": t, "per_step": t / k} for w, e, t, k in items]}


def _step_work(tr, data, step: float, per_call: _PerCall) -> list[tuple]:
    """(work, "step", seconds per call, calls' spacing in steps) of the loop's per-step work."""
    from tqdm import tqdm

    from labkit.training.instruments.meter import EpochMeter
    from labkit.core.log import Lines

    cfg, s, dev, reps = tr.cfg, tr.strategy, tr.ctx.device, per_call.reps
    parts, clock = StepParts(dev), StepClock(dev)

    def marks() -> None:  # a step's boundary (EpochMeter.step_begins), then the loop's marks
        parts.begin()
        clock.mark()
        for p in STEP_MARKS:
            parts.mark(p)

    t_marks = per_call(marks)
    parts.close()
    t0 = time.perf_counter()  # the epoch's end reads them all once: spread over the steps
    calls = len(parts.steps)
    parts.take()
    clock.durations()
    t_take = slowest((time.perf_counter() - t0) / calls, dev)
    meter = EpochMeter(reps, 0, s, dev, False, StepParts(dev), hits_of=tr.workload.train_hits)
    out, y = _an_output(tr, data)
    count = iter(range(10 ** 9))
    t_meter = per_call(lambda: meter.step_ends(next(count) % reps, out, y))
    # what the steps left pending is folded once per refresh of the bar and at the epoch's end
    # (EpochMeter.fold): its share, spread over the steps it folds
    folded = len(meter.pending)
    sync_device(dev)
    t0 = time.perf_counter()
    meter.fold()
    sync_device(dev)
    t_meter += slowest((time.perf_counter() - t0) / max(1, folded), dev)
    meter.start()
    bar = tqdm(total=10 ** 9, unit="batch", ncols=100, mininterval=5.0, file=Lines(io.StringIO()))
    t_update = per_call(lambda: bar.update(1))
    images = cfg.batch_size * s.trainers
    t_figures = per_call(lambda: bar.set_postfix_str(meter.running_text(reps - 1, images), refresh=False))
    bar.close()
    # meter.Bar's rule: the figures once per refresh of the bar, at most every
    # BAR_REFRESH seconds (a terminal's; a log's are further apart), so every step only where
    # a step takes longer
    every = max(1.0, BAR_REFRESH / step) if step > 0 else 1.0
    return [("step-part marks (StepParts, StepClock)", "step", t_marks + t_take, 1),
            ("per-step loss and accuracy (EpochMeter.step_ends)", "step", t_meter, 1),
            ("progress bar: update", "step", t_update, 1),
            (f"progress bar: figures (every {BAR_REFRESH} s)", "step", t_figures, every)]


def _epoch_checks(tr, epoch: int, per_call: _PerCall) -> list[tuple]:
    """(work, "epoch", seconds per call, ``epoch``) of the checks made once an epoch."""
    cfg = tr.cfg
    m = Epoch(epoch=epoch, train_loss=1.0, train_accuracy=0.0, train_time=0.0, train_throughput=0.0,
              val_loss=1.0, all_losses=[1.0] * epoch)  # an epoch as the check sees it
    tensors = [t for _, t in guards.tensors(tr.model)]
    out = [("divergence check", "epoch", per_call(lambda: guards.divergence(cfg, 1, epoch, 0, m), 20), epoch),
           ("replica fingerprint (one rank's tensors)", "epoch",
            per_call(lambda: guards.fingerprint(tensors), 1), epoch)]
    if cfg.check_replicas and tr.ctx.distributed:  # one process: nothing to compare
        out.append(("replica check (fingerprint, all-gather, compare)", "epoch",
                    per_call(lambda: guards.check_replicas(*tr.strategy.replicas(tr.model), 1), 1), epoch))
    return out


def loops_agree(tr, others: dict, batches: list) -> tuple[dict, Optional[bool]]:
    """After the rounds (each loop's method finished first, its timer closed): how many tensors
    of each instrument loop's model differ from the job's (``tr``'s), and, on a GPU where some
    do, whether the device repeats a backward pass at all (:func:`repeatable`; None: not
    probed). An instrument must not change what training computes."""
    dev, differing = tr.ctx.device, {}
    for name, o in others.items():
        o.tr.strategy.finish_epoch(o.tr.model)
        differing[name] = count_differing(tr.model, o.tr.model, dev)
        o.close()
    # on a GPU a difference can be the device's: probed only then (it costs two passes)
    probe = dev.type == "cuda" and any(differing.values())
    return differing, (repeatable(tr.model, batches, dev, tr.workload.loss) if probe else None)


def _an_output(tr, data) -> tuple:
    """((loss, output), target) of the model on a batch of the training set's first samples, as
    a step leaves them for the meter (every rank alike: a server too)."""
    from torch.utils.data import default_collate

    n = min(tr.cfg.batch_size, len(data.train))
    x, y = tr.to_device(*default_collate([data.train[i] for i in range(n)]))
    was = tr.model.training
    with torch.no_grad():
        output = tr.model.eval()(x)
    tr.model.train(was)
    return (tr.workload.loss(output, y), output), y


def repeatable(model: torch.nn.Module, batches: list, dev: torch.device, loss=None) -> bool:
    """Whether this device computes a backward pass twice alike, bit for bit, on every rank: two
    copies of the model (the same state) on the same batch, no communication. cuDNN's
    autotuned kernels and those that accumulate with atomics need not; where they do not, a
    loop's parameters differing from the job's say nothing about the instrument."""
    import copy

    import torch.nn.functional as F

    same = 1
    if batches:  # a trainer (a PS's server has no batches: it agrees)
        x, y = batches[0]
        grads = []
        for _ in range(2):
            m = copy.deepcopy(getattr(model, "module", model))
            (loss or F.cross_entropy)(m(x), y).backward()
            grads.append([q.grad for q in m.parameters() if q.grad is not None])
        same = int(all(torch.equal(a, b) for a, b in zip(*grads)))
    t = torch.tensor([same], dtype=torch.int64, device=dev)
    if is_distributed():
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())
