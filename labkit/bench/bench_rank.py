"""The rank side of `labkit bench`: what every rank runs under torchrun
(``python -m labkit.bench.bench_rank``), one (variant, process count) per job. Each rank, in one
process group:

1. runs warm-up steps (left out), then ``--trials`` trials of ``--steps`` synchronised steps;
2. runs as many compute-only steps: the same forward, backward and optimizer step with no
   communication at all (``Strategy.no_sync``; every trainer updates its own copy, so the
   copies drift apart -- ``param_spread`` shows it);
3. times the raw collectives on buffers of the bytes the method moves, in the same process
   group: one all-reduce, one reduce, one broadcast, and an all-reduce size sweep (the cost
   model fits latency and bandwidth to it, see labkit.costmodel).

Step 1's trials run in rounds (plain_loop.rounds) with those of Trainers that differ from the
job's by one instrument, in the same processes, from the same weights, on the same batches: the
bench's ``instruments``, what each instrument costs (labkit.bench.pricing says which loops,
and times the loop's work that has no switch; labkit.bench.instrument_cost, the figures).

A trial's time is the slowest rank's: a step is over when its last rank is. Steps cycle over
a few batches already on the device, so data loading is not in these figures (training
reports its data wait per epoch). Rank 0 writes ``bench_result.json`` in ``--out``; the
launcher (labkit.orchestrate.bench) gathers those into the bench document
(labkit.bench.bench_view).
"""
from __future__ import annotations

if __name__ == "__main__":
    # the same life as a training rank (labkit/train.py): SIGTERM taken by a thread before
    # torch is imported, errors as one line and torchrun's error file, then leave(). This
    # module runs as __main__ before its own imports; main is the one of the module imported
    # by its name, as every other module of the package sees it
    from labkit.training import lifecycle

    lifecycle.begin_rank()
    from labkit.bench.bench_rank import main

    lifecycle.leave(main())

import os
import statistics
import sys
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from labkit.core import layout
from labkit.core.config import ConfigError, TrainConfig, build_parser
from labkit.core.files import atomic_path, atomic_write_json
from labkit.training import lifecycle
from labkit.training.dist import env_world, is_distributed
from labkit.training.instruments.timers import PARTS, Stopwatch, busy_figures
from labkit.training.preflight import add_resolved, rank_config
from labkit.training.sync import load_method

from .plain_loop import rounds
from .pricing import (AS_RUN, instrument_loops, instrument_pairs, loops_agree, per_step_work,
                      slowest, trial_stats)

PROG = "labkit.bench"  # how the rank names itself in its one-line errors


def _barrier() -> None:
    if is_distributed():
        dist.barrier()


def param_spread(model: torch.nn.Module, device: torch.device) -> float:
    """Largest difference of any parameter element between any two ranks (0: all equal)."""
    v = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
    hi, lo = v.clone(), v.clone()
    if is_distributed():
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    return (hi - lo).max().item()


REPS_BUDGET_S, MIN_REPS = 4.0, 3  # time_collective's reps on a slow link: docs/emulated-cluster.md


def time_collective(fn: Callable[[], Any], device: torch.device, reps: int) -> list[float]:
    """The slowest rank's time for ``fn``, ``reps`` times (fewer where they would take over
    REPS_BUDGET_S, MIN_REPS at least: a slow link), after one call that counts them, every rank alike."""
    clock = Stopwatch(device)
    clock.start()
    fn()
    first = slowest(clock.stop(), device)
    times = []
    for _ in range(min(reps, max(MIN_REPS, int(REPS_BUDGET_S / first))) if first > 0 else reps):
        _barrier()
        clock.start()
        fn()
        times.append(slowest(clock.stop(), device))
    return times


def _bw(nbytes: int, times: list[float], factor: float) -> dict:
    """Median time and bandwidths; ``times`` kept, for the intervals of ratios to it."""
    t = statistics.median(times)
    alg = nbytes / t if t > 0 else float("nan")
    return {"bytes": nbytes, "time": t, "algbw": alg, "busbw": alg * factor, "times": times}


def measure_collectives(push_bytes: int, pull_bytes: int, dtype: torch.dtype,
                        device: torch.device, reps: int = 5) -> dict:
    """The raw reference: the bytes a method moves, moved by single collectives."""
    n = dist.get_world_size()
    esize = torch.tensor([], dtype=dtype).element_size()
    push = torch.zeros(max(1, push_bytes // esize), dtype=dtype, device=device)
    pull = torch.zeros(max(1, pull_bytes // 4), dtype=torch.float32, device=device)
    t_ar = time_collective(lambda: dist.all_reduce(push), device, reps)
    t_red = time_collective(lambda: dist.reduce(push, dst=0), device, reps)
    t_bc = time_collective(lambda: dist.broadcast(pull, src=0), device, reps)
    sweep, size = [], 4096
    while size < push_bytes:
        buf = torch.zeros(size // esize, dtype=dtype, device=device)
        sweep.append({"bytes": size, "time": statistics.median(
            time_collective(lambda: dist.all_reduce(buf), device, reps + 2))})
        size *= 8
    sweep.append({"bytes": push.numel() * esize, "time": statistics.median(t_ar)})
    red, bc = _bw(push.numel() * esize, t_red, 1.0), _bw(pull.numel() * 4, t_bc, 1.0)
    return {
        "all_reduce": _bw(push.numel() * esize, t_ar, 2 * (n - 1) / n),
        "reduce": red, "broadcast": bc,
        # one reduce + broadcast sample per repetition: the i-th reduce with the i-th broadcast
        "reduce_broadcast": {"bytes": red["bytes"] + bc["bytes"], "time": red["time"] + bc["time"],
                             "times": [r + b for r, b in zip(t_red, t_bc)]},
        "all_reduce_sweep": sweep,
    }


class StepTimer:
    """Times trials of steps of one Trainer: synchronised, or compute-only (Strategy.no_sync).
    Steps cycle over a few real batches already on the device, so data loading is not in
    these figures. A trial's time is the slowest rank's: a step is over when its last rank is."""

    def __init__(self, tr, steps: int, show_bar: bool, total: int, batches: Optional[list] = None):
        from tqdm import tqdm

        from labkit.core.log import Lines

        self.tr, self.steps, self.dev = tr, steps, tr.ctx.device
        self.batches = [] if batches is None else batches  # another timer's: the same batches
        if batches is None and tr.strategy.is_trainer:  # a few real batches, on the device, cycled
            it = iter(tr.train_loader)
            for _ in range(min(4, len(tr.train_loader))):
                self.batches.append(tr.to_device(*next(it)))
        # position 0: several timers' bars (the instrument rounds') as lines, no cursor moves
        self.bar = (tqdm(total=total, desc=f"bench {tr.cfg.method}", unit="batch", ncols=100,
                         mininterval=5.0, file=Lines(sys.stderr), position=0) if show_bar else None)
        self.clock = Stopwatch(self.dev)

    def run(self, n: int, sync: bool) -> None:
        parts = self.tr.parts  # marked as the training loop marks them (labkit.core.breakdown)
        for i in range(n):
            parts.begin()
            parts.mark("other")
            x, y = self.batches[i % len(self.batches)] if self.batches else (None, None)
            parts.mark("data")
            self.tr.train_step(x, y, sync)
            if self.bar is not None:
                self.bar.update(1)

    def trial(self, sync: bool) -> float:
        """Seconds per step over one trial, the slowest rank's."""
        _barrier()
        self.clock.start()
        self.run(self.steps, sync)
        return slowest(self.clock.stop(), self.dev) / self.steps

    def trial_parts(self) -> dict:
        """One synchronised trial: {"time": seconds per step (the slowest rank's), "got": its
        steps' parts on this rank (StepParts.take), closed where the trial ends, before another
        loop's trial runs}."""
        t = self.trial(True)
        self.tr.parts.close()
        return {"time": t, "got": self.tr.parts.take()}

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def measure(cfg: TrainConfig, steps: int, trials: int, warmup: int, profile_steps: int,
            out: str, pricing: bool = True) -> dict:
    """This rank's part of one bench job; rank 0 returns the measurements (others: {}).
    ``pricing``: the instrument rounds too (labkit.bench.pricing), else the job's loop alone."""
    from labkit.training.dist import init, teardown
    from labkit.training.trainer import Trainer
    from labkit.workloads import checks, make_workload

    rank = env_world()[0]
    workload = make_workload(cfg)
    data = checks.samples(workload)
    loops = instrument_loops(cfg) if pricing else {AS_RUN: cfg}
    models = []
    for _ in loops:  # the same initial weights for every loop, the job's built first
        torch.manual_seed(cfg.seed)
        models.append(workload.build_model())
    ctx = init(cfg.backend, cfg.timeout, cfg.pin_cpus, cfg.device, cfg.debug_collectives)
    try:
        tr = Trainer(cfg, ctx, None, data, models[0], steps, workload)
        s = tr.strategy
        timer = StepTimer(tr, steps, rank == s.first_trainer and cfg.progress,
                          2 * (warmup + trials * steps))
        others = {}
        for (name, c), m in list(zip(loops.items(), models))[1:]:
            o = Trainer(c, ctx, None, data, m, steps)
            others[name] = StepTimer(o, steps, rank == s.first_trainer and c.progress,
                                     warmup + trials * steps, batches=timer.batches)
        doc = _time_steps(timer, trials, warmup, others)
        del others, models[1:]
        doc["instruments"]["work"] = per_step_work(tr, data, doc["step_time"]["median"])
        params = [p for p in tr.model.parameters() if p.requires_grad]
        grad_bytes = sum(p.numel() * p.element_size() for p in params)
        push, pull = load_method(cfg.method).bytes_per_step(cfg, grad_bytes)
        wire = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(cfg.compress, params[0].dtype)
        collectives = (measure_collectives(push, max(pull, 4), wire, ctx.device)
                       if ctx.distributed else {})
        if profile_steps:
            profile(tr, timer.run, profile_steps, out, rank, ctx.device)
        if rank != 0:
            return {}
        return {
            "method": cfg.method, "world_size": ctx.world_size, "trainers": s.trainers,
            "servers": ctx.world_size - s.trainers, "batch_size": cfg.batch_size,
            "global_batch": cfg.batch_size * s.trainers, "device": ctx.device.type,
            # throughput's unit: samples x units per sample (images, tokens), said as its rate
            "units_per_sample": workload.units_per_sample, "rate": workload.rate,
            "backend": cfg.backend, **doc, "grad_bytes": grad_bytes,
            "bytes_per_step": push + pull, "bucket_mb": cfg.bucket_mb, "collectives": collectives,
        }
    finally:
        teardown()


def _time_steps(timer: StepTimer, trials: int, warmup: int,
                others: Optional[dict[str, StepTimer]] = None) -> dict:
    """Synchronised trials in rounds with the ``others``' (the instrument loops: the same
    trials, one instrument off), then compute-only ones; each method's timed phases per
    trial."""
    tr, s, dev = timer.tr, timer.tr.strategy, timer.dev
    others = others or {}
    for t in (timer, *others.values()):
        t.run(warmup, True)
    s.timer.pop()
    _parts(tr, warmup)
    s.wire.take()  # the warm-up's bytes: no trial's
    loops = {AS_RUN: timer, **others}
    order = rounds(trials, tuple(loops))
    times, pieces, trial_phases = _rounds(loops, order)
    step_times = times[AS_RUN]
    sent = sum(v[0] for d in s.wire.take().values() for v in d.values()) if s.is_trainer else 0.0
    step_parts = _parts(tr, 0, _joined(pieces))
    s.finish_epoch(tr.model)  # every rank holds the model as the method defines it
    differing, repeatable = loops_agree(tr, others, timer.batches)
    spread_sync = param_spread(tr.model, dev)
    timer.run(warmup, False)
    _parts(tr, warmup)
    compute_times = [timer.trial(False) for _ in range(trials)]
    compute_parts = _parts(tr, 0)
    spread_compute = param_spread(tr.model, dev)
    timer.close()
    # phases: mean over the trainers of each one's time per step (servers count as 0), per
    # trial (rows) and phase (columns)
    vec = torch.tensor([[t.get(p, 0.0) if s.is_trainer else 0.0 for p in s.phases]
                        for t in trial_phases], dtype=torch.float64, device=dev)
    if tr.ctx.distributed and vec.numel():
        dist.all_reduce(vec)
    per_trial = (vec / (s.trainers * timer.steps)).cpu()
    # what a trainer sent per synchronised step, counted by the lab from the method's own
    # collectives (the same count as a run's "wire"), the mean over the trainers
    sent = torch.tensor([sent], dtype=torch.float64, device=dev)
    if tr.ctx.distributed:
        dist.all_reduce(sent)
    return {
        "sent_per_step": sent.item() / (s.trainers * trials * timer.steps),
        "step_time": trial_stats(step_times), "compute_time": trial_stats(compute_times),
        "phases": {p: per_trial[:, i].mean().item() for i, p in enumerate(s.phases)},
        "sync_trials": per_trial.sum(dim=1).tolist() if len(s.phases) else [],
        "param_spread": {"sync": spread_sync, "compute_only": spread_compute},
        "step_parts": step_parts, "compute_parts": compute_parts,
        "instruments": {"order": [n for pair in order for n in pair],
                        "loops": {k: {"step_time": trial_stats(v)} for k, v in times.items()},
                        "pairs": instrument_pairs(tr.cfg, list(loops)),
                        "params_differing": differing,
                        # two identical backward passes gave the same gradients on this device
                        # (None: not probed, nothing differed or not a GPU)
                        "device_repeatable": repeatable,
                        # an asynchronous PS applies what has arrived: its parameters depend on
                        # timing, so they are not expected to match
                        "timing_dependent": tr.cfg.ps_staleness is not None},
    }


def _rounds(loops: dict[str, StepTimer], order: list[tuple[str, ...]]) -> tuple[dict, list, list]:
    """One synchronised trial of each loop per round, in ``order``: (each loop's seconds per
    step per trial, the job's own ("as run") parts per trial, its timed phases per trial)."""
    for t in loops.values():  # the warm-up's parts: the job's were taken, the others' never are
        t.tr.parts.close()
        t.tr.parts.take()
    times: dict[str, list[float]] = {k: [] for k in loops}
    pieces, phases = [], []
    for pair in order:
        for name in pair:
            got = loops[name].trial_parts()
            times[name].append(got["time"])
            if name == AS_RUN:  # the phases per trial, for the interval of sync / raw
                pieces.append(got["got"])
                phases.append(loops[name].tr.strategy.timer.pop())
    return times, pieces, phases


def _joined(gots: list[dict]) -> dict:
    """StepParts.take()'s dicts of consecutive stretches as one."""
    if not gots:
        return {"parts": {p: [] for p in PARTS}, "busy": [], "also": {}}
    return {"parts": {p: [x for g in gots for x in g["parts"][p]] for p in PARTS},
            "busy": [x for g in gots for x in g["busy"]],
            "also": {c: [x for g in gots for x in g["also"].get(c, [])]
                     for c in sorted({c for g in gots for c in g["also"]})}}


def _parts(tr, first: int, got: Optional[dict] = None) -> dict:
    """The parts of the steps run since the last call (from step ``first``), or of ``got``
    (taken already), each the mean over the trainers, and the collectives' running time; a
    server's update time."""
    s, dev = tr.strategy, tr.ctx.device
    if got is None:
        tr.parts.close()
        got = tr.parts.take(first)
    zeros = [0.0] * len(got["busy"])  # every rank, a server too, ran as many steps
    rows = [got["parts"][p] if s.is_trainer else zeros for p in PARTS]
    rows += [got["busy"] if s.is_trainer else zeros,
             zeros if s.is_trainer else got["parts"]["optimizer"]]
    vec = torch.tensor(rows, dtype=torch.float64, device=dev)
    if tr.ctx.distributed:
        dist.all_reduce(vec)
    servers = tr.ctx.world_size - s.trainers
    per = vec[:len(PARTS) + 1] / s.trainers
    out = {"parts": dict(zip(PARTS, per[:-1].tolist())),
           "busy": busy_figures(per[-1]) if tr.cfg.times_comm else []}
    if servers:
        out["server"] = (vec[-1] / servers).tolist()
    return out


def profile(tr, run: Callable[[int, bool], None], steps: int, out: str, rank: int,
            dev: torch.device) -> None:
    """A torch.profiler trace of ``steps`` synchronised steps, in Chrome trace format (open
    it in chrome://tracing or https://ui.perfetto.dev). The loop's phases are labelled
    ``labkit.forward/backward/sync/step`` and the methods' ``labkit.comm/pull/push``."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with torch_profile(activities=acts, record_shapes=False) as prof:
        run(steps, True)
        # Drain what is still in flight (the PS's next pull, the async PS's messages) before
        # the profiler stops: stopping it with collectives running on gloo's threads corrupted
        # the heap once ('malloc(): unsorted double linked list corrupted' on the PS server,
        # right after profiler_stop, in the test suite).
        tr.strategy.finish_epoch(tr.model)
    path = os.path.join(out, f"trace_rank{rank}.json")
    with atomic_path(path) as tmp:
        prof.export_chrome_trace(tmp)


def main(argv: Optional[list[str]] = None) -> int:
    p = build_parser(prog=PROG)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--bench-warmup", dest="bench_warmup", type=int, default=3)
    p.add_argument("--profile-steps", dest="profile_steps", type=int, default=0)
    p.add_argument("--no-pricing", dest="pricing", action="store_false")
    add_resolved(p)
    a = p.parse_args(argv)

    def work() -> None:
        cfg = rank_config(a)  # labkit bench's resolved.json (checked there), else the flags
        if not cfg.out:
            raise ConfigError("--out is required (the folder for bench_result.json)")
        os.makedirs(cfg.out, exist_ok=True)
        doc = measure(cfg, a.steps, a.trials, a.bench_warmup, a.profile_steps, cfg.out, a.pricing)
        if env_world()[0] == 0:
            atomic_write_json(os.path.join(cfg.out, layout.BENCH_RESULT), doc)

    return lifecycle.run_rank(work, PROG)
