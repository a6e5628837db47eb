"""The floor labkit's own overhead is measured against: a plain PyTorch DDP loop, and the rank
side of the `labkit bench` job that times it beside labkit's DDP.

The loop (:class:`PlainDDP`) is what a user's script does and nothing else: on a CPU a torch
DataLoader (torch's defaults: no persistent workers, the default prefetch; its workers start
from a fork server, as labkit's do, since forking a rank can hang), on a GPU the batches as
labkit's loop takes them there (an in-memory set gathered on the device, an image folder
decoded there: labkit.training.gpu_data), so the job compares the loops, not two data paths;
forward, cross-entropy, backward through ``DistributedDataParallel`` with its defaults (no comm
hook), ``torch.optim.SGD`` with the run's lr, momentum and weight decay. No timers, meters,
progress bars or hooks. It reads THE SAME data as labkit's DDP: the datasets of
labkit.training.data, trainer k's ``train_sampler``, and the loader's generator reseeded per
epoch as labkit.training.trainer does (seed + 1000 k + epoch), so the batches are identical;
from ``torch.manual_seed(seed)`` before ``build_model``, as labkit.training.rank does, it
computes the same parameters bit for bit (tests/test_overhead.py).

    torchrun --nproc_per_node=2 -m labkit.bench.plain_loop [labkit.train flags] --out DIR
        trains ``--epochs`` epochs as labkit.train would (without validation) and writes rank
        0's final_model.pt in DIR;
    ... --overhead --steps S --trials T --bench-warmup W --out DIR
        the bench's overhead job (labkit.orchestrate.bench): bench_result.json in DIR;
    ... --overhead --control ...
        the same with the plain loop a second time in every round, its A/A control
        (`labkit bench --overhead-control`): two identical loops' ratio, the job's noise floor;
    ... --overhead --profile-steps K ...
        then a torch.profiler trace of K steps of each loop (`labkit bench --profile`), in DIR.

Why the overhead is one job that alternates the two loops in the same processes, in rounds
of one trial each (plain, labkit | labkit, plain | plain, labkit ...: :func:`rounds`), rather
than one job per loop like the methods' jobs: a difference of 1% is far below what separates
two launches on a shared machine (where the OS places the ranks, what else runs; see
docs/performance.md), and each launch's own interval cannot see that. In one job both loops
run in the same processes, process group, placement and warm caches, trial after trial, so a
drift of the machine hits both loops of a round alike and each round's ratio holds only the
loops' difference (the figure and its interval are over the rounds:
labkit.bench.bench_view.overhead_interval). Both load their data through their own
loaders, made by the same function from the same datasets (the bench's method jobs cycle
batches already on the device, which would leave loading out); each trial is one epoch of W + S + 1 steps, both sides timed by the same clock: a
timestamp at the start of every step (for labkit, from a step callback of Trainer.train_epoch;
on a GPU after synchronising), S full steps from the start of step W (warm-up and worker
start left out), the slowest rank's. Both models start from the same weights and see the same
batches, so after the trials their parameters must be equal: the job checks it
(``params_equal``), so the two loops are seen to have done the same work.
"""
from __future__ import annotations

if __name__ == "__main__":
    # the same life as a training rank (labkit/train.py): SIGTERM taken by a thread before
    # torch is imported, errors as one line and torchrun's error file, then leave()
    from labkit.training import lifecycle

    lifecycle.begin_rank()
    from labkit.bench.plain_loop import main

    lifecycle.leave(main())

import dataclasses
import os
import time
from typing import Callable, Optional

import torch

from labkit.core import layout
from labkit.core.methods import BASELINE
from labkit.core.config import ConfigError, TrainConfig, build_parser
from labkit.core.files import atomic_write_json
from labkit.training import lifecycle
from labkit.training.dist import DistContext, sync_device
from labkit.training.preflight import add_resolved, rank_config

from .pricing import count_differing, repeatable, slowest, trial_stats

PROG = "labkit.plain_loop"  # how the rank names itself in its one-line errors
LOOPS = ("plain", "labkit_ddp")  # the overhead job's two loops (rounds() says in which order)
CONTROL = "plain_again"  # --control: the plain loop a second time, its A/A control


class PlainDDP:
    """A plain DDP training loop over labkit's data (see the module docstring)."""

    def __init__(self, cfg: TrainConfig, data, model: torch.nn.Module, ctx: DistContext,
                 total_steps: Optional[int] = None):
        from torch.nn.parallel import DistributedDataParallel

        from labkit.workloads import make_workload

        from labkit.training.data import ShardSampler, default_workers, train_sampler
        from labkit.training.gpu_data import make_loaders

        cuda = ctx.device.type == "cuda"
        self.device, self.rank, self.seed = ctx.device, ctx.rank, cfg.seed
        self.model = model.to(ctx.device)
        self.net = (DistributedDataParallel(self.model, device_ids=[ctx.device.index] if cuda else None)
                    if ctx.distributed else self.model)
        # the workload's optimizer, loss and schedule (over ``total_steps``: the Trainer's epochs
        # times its steps), as labkit's loop
        self.workload = make_workload(cfg)
        self.optimizer = self.workload.optimizer(self.model.parameters())
        self.step, self.total = 0, total_steps or cfg.epochs * (cfg.max_steps_per_epoch or 1)
        self.sampler = train_sampler(data.train, ctx.world_size, ctx.rank, cfg.seed)
        self.workers = default_workers(cfg, data.in_memory, ctx.local_world_size)
        # its batches come as labkit's loop takes them on this device (make_loaders): on a CPU
        # a DataLoader with torch's defaults (workers from the rank's fork server, as labkit's:
        # fork can hang a process with threads at an epoch boundary); on a GPU an in-memory
        # set's batches gathered on the device, an image folder decoded there. Two data paths
        # would put their difference into the job's ratio (docs/where-the-time-goes.md)
        self.loader = make_loaders(cfg, data, self.sampler,
                                   ShardSampler(len(data.val), ctx.world_size, ctx.rank),
                                   self.workers, ctx.device, seed=cfg.seed + ctx.rank)[0]
        self.generator = self.loader.generator  # reseeded per epoch, as labkit's _batches

    def train_epoch(self, epoch: int, steps: int,
                    at_step: Optional[Callable[[int], None]] = None) -> None:
        """``steps`` steps of ``epoch``; ``at_step(i)`` is called as step i begins."""
        self.model.train()
        self.sampler.set_epoch(epoch)
        self.generator.manual_seed(self.seed + 1000 * self.rank + epoch)  # as labkit's _batches
        batches = iter(self.loader)
        for i in range(steps):
            if at_step is not None:
                at_step(i)
            x, y = next(batches)
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            self.optimizer.zero_grad(set_to_none=True)
            loss = self.workload.loss(self.net(x), y)
            loss.backward()
            lr = self.workload.lr_at(self.step, self.total)
            if lr is not None:
                for group in self.optimizer.param_groups:
                    group["lr"] = lr
            self.step += 1
            self.optimizer.step()


def train(cfg: TrainConfig) -> None:
    """``cfg.epochs`` epochs of the plain loop, as many steps each as labkit.train takes; rank 0
    writes the final model (final_model.pt) in ``cfg.out``."""
    from labkit.training.data import steps_per_epoch
    from labkit.training.dist import env_world, init, teardown
    from labkit.training.checkpoint import atomic_torch_save
    from labkit.workloads import checks, make_workload

    data = checks.samples(make_workload(cfg))
    world = env_world()[1]
    steps = steps_per_epoch(len(data.train), world, cfg.batch_size, cfg.max_steps_per_epoch)
    [model] = _same_weights(cfg, 1)
    ctx = init(cfg.backend, cfg.timeout, cfg.pin_cpus, cfg.device)
    try:
        loop = PlainDDP(cfg, data, model, ctx, cfg.epochs * steps)
        for epoch in range(1, cfg.epochs + 1):
            loop.train_epoch(epoch, steps)
        if ctx.is_main:
            atomic_torch_save(model.state_dict(), os.path.join(cfg.out, layout.FINAL_MODEL))
    finally:
        teardown()


# ------------------------------------------------------------------ the bench's overhead job
def trial_steps(epoch_steps: int, warmup: int, steps: int) -> tuple[int, int]:
    """(warm-up steps, timed steps) of one trial, which must fit in one epoch of
    ``epoch_steps`` steps with one more step (the timed window ends where it begins)."""
    warmup = min(warmup, max(0, epoch_steps - 2))
    steps = min(steps, epoch_steps - warmup - 1)
    if steps < 1:
        raise ConfigError(f"one epoch holds {epoch_steps} step(s) per trainer: too few to time the "
                          f"plain loop against labkit's DDP (needs 2; use more data or a smaller "
                          f"--batch-size)")
    return warmup, steps


def rounds(trials: int, loops: tuple[str, ...] = LOOPS) -> list[tuple[str, ...]]:
    """The loops' order in each round: a rotation of ``loops``, then the same backwards, then
    the rotation by two, backwards, ... For two loops plain first, then labkit, then the other
    way round (ABBA); for three ABC, CBA, CAB, BAC, BCA, ACB (the bench's instrument rounds).
    Every two rounds each loop runs before each other as often as after, so a machine that
    speeds up or slows down within a round favours no loop of a pair."""
    n, out = len(loops), []
    for t in range(trials):
        k = (t - t % 2) % n
        turn = loops[k:] + loops[:k]
        out.append(turn if t % 2 == 0 else turn[::-1])
    return out


def unsupported(cfg: TrainConfig) -> Optional[str]:
    """Why the plain loop cannot stand beside labkit's DDP with ``cfg`` (None: it can)."""
    found = [f for f, on in (("--amp", cfg.amp != "off"), ("--compile", cfg.compile),
                             ("--channels-last", cfg.channels_last),
                             ("--compress", cfg.compress != "none")) if on]
    if found:
        return f"the plain loop has no {', '.join(found)}"
    return None


def measure_overhead(cfg: TrainConfig, steps: int, trials: int, warmup: int,
                     control: bool = False, profile_steps: int = 0) -> dict:
    """This rank's part of the overhead job; rank 0 returns the document (others: {}).
    ``control``: a third loop, the plain loop again (its own model from the same weights), in
    the same rounds: the plain loop against itself is the job's A/A control, what two identical
    loops differ by in this job (labkit.bench.bench_view.control_interval).
    ``profile_steps``: then a trace of that many steps of each loop (:func:`_trace`)."""
    from labkit.training.data import steps_per_epoch
    from labkit.training.dist import env_world, init, teardown
    from labkit.training.trainer import Trainer
    from labkit.workloads import checks, make_workload

    data = checks.samples(make_workload(cfg))
    world = env_world()[1]
    warmup, steps = trial_steps(steps_per_epoch(len(data.train), world, cfg.batch_size,
                                                cfg.max_steps_per_epoch), warmup, steps)
    n = warmup + steps + 1
    loops = LOOPS + ((CONTROL,) if control else ())
    models = _same_weights(cfg, len(loops))
    ctx = init(cfg.backend, cfg.timeout, cfg.pin_cpus, cfg.device)
    try:
        plain = PlainDDP(cfg, data, models[0], ctx, (trials + bool(profile_steps)) * n)
        # its progress bar counts the trials as epochs ("epoch 2/12"), not the run's --epochs
        tr = Trainer(dataclasses.replace(cfg, epochs=trials + bool(profile_steps)), ctx, None, data, models[1], n)
        stamps: list[float] = []

        def stamp(*_) -> None:  # the one clock of both loops: as a step begins
            sync_device(ctx.device)
            stamps.append(time.perf_counter())

        tr.step_callbacks.append(stamp)
        run = {"plain": lambda e: plain.train_epoch(e, n, stamp), "labkit_ddp": tr.train_epoch}
        if control:
            again = PlainDDP(cfg, data, models[2], ctx, plain.total)
            run[CONTROL] = lambda e: again.train_epoch(e, n, stamp)
        order = rounds(trials, loops)
        times = _time_rounds(run, order, stamps, warmup, steps, cfg.seed, ctx.device)
        differ = count_differing(plain.model, tr.model, ctx.device)
        control_differ = count_differing(plain.model, again.model, ctx.device) if control else None
        # on a GPU, the device's own difference or the loops'? (pricing.repeatable)
        repeatable = _repeatable(tr, plain) if differ and ctx.device.type == "cuda" else None
        if profile_steps:  # after the checks above: one more trial of each loop, traced
            _trace(plain, tr, trials + 1, n, warmup, profile_steps, ctx, cfg.out)
        if ctx.rank != 0:
            return {}
        gb, per = cfg.batch_size * world, tr.workload.units_per_sample  # per sample: tokens, images
        return {
            "nproc": world, "trainers": world, "batch_size": cfg.batch_size, "global_batch": gb,
            "units_per_sample": per, "rate": tr.workload.rate,
            "device": ctx.device.type,  # where both loops computed (cfg.device, as the methods' jobs)
            "steps": steps, "warmup": warmup, "trials": trials, "order": [n for pair in order for n in pair],
            "workers": plain.workers, "pin_cpus": cfg.pin_cpus, "time_comm": cfg.time_comm,
            **{k: {"step_time": trial_stats(v), "throughput": gb * per * len(v) / sum(v)} for k, v in times.items()},
            "paired_ratios": [p / q for p, q in zip(times["plain"], times["labkit_ddp"])],
            "params_equal": differ == 0, "params_differing": differ,
            **({"control_params_differing": control_differ} if control else {}),
            "device_repeatable": repeatable,  # None: not probed (nothing differed, or not a GPU)
        }
    finally:
        teardown()


def _same_weights(cfg: TrainConfig, count: int) -> list[torch.nn.Module]:
    """``count`` models from the same initial weights, as labkit.training.rank makes them."""
    from labkit.workloads import make_workload

    out = []
    for _ in range(count):
        torch.manual_seed(cfg.seed)
        out.append(make_workload(cfg).build_model())
    return out


def _trace(plain: PlainDDP, tr, epoch: int, n: int, warmup: int, steps: int, ctx: DistContext,
           out: str) -> None:
    """A torch.profiler trace of each loop over ``steps`` steps from step ``warmup`` of one
    more trial (``epoch``: the same batches for both), each step a ProfilerStep range and both
    synchronised as a step begins, as in the rounds: trace_plain_rank<r>.json and
    trace_labkit_ddp_rank<r>.json in ``out`` (Chrome trace format: chrome://tracing or
    ui.perfetto.dev), to read where labkit's steps spend what the plain loop's do not. The
    profiler stops as a step begins, with no collective in flight."""
    from torch.profiler import ProfilerActivity, profile, schedule

    from labkit.core.files import atomic_path

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.device.type == "cuda" else [])
    when = schedule(wait=warmup, warmup=1, active=max(1, min(steps, n - warmup)), repeat=1)
    for name in LOOPS:
        with profile(activities=acts, schedule=when) as prof:
            if name == "plain":
                plain.train_epoch(epoch, n, lambda *_: (sync_device(ctx.device), prof.step()))
            else:  # its step callbacks already synchronise (measure_overhead's stamp)
                step = lambda *_: prof.step()  # noqa: E731
                tr.step_callbacks.append(step)
                try:
                    tr.train_epoch(epoch)
                finally:
                    tr.step_callbacks.remove(step)
        with atomic_path(os.path.join(out, f"trace_{name}_rank{ctx.rank}.json")) as tmp:
            prof.export_chrome_trace(tmp)


def _time_rounds(run: dict, order: list, stamps: list, warmup: int, steps: int, seed: int,
                 device: torch.device) -> dict[str, list[float]]:
    """Each loop's seconds per step in each round (``run[name](epoch)`` trains one trial, its
    steps stamped into ``stamps``), the slowest rank's."""
    times: dict[str, list[float]] = {k: [] for k in run}
    for trial, loops in enumerate(order):
        for name in loops:
            stamps.clear()
            torch.manual_seed(seed + trial)  # augmentation in this process draws alike
            run[name](trial + 1)
            times[name].append(slowest(stamps[warmup + steps] - stamps[warmup], device) / steps)
    return times


def _repeatable(tr, plain: PlainDDP) -> bool:
    """pricing.repeatable on a batch of the plain loop's, on the device."""
    dev = tr.ctx.device
    x, y = next(iter(plain.loader))
    return repeatable(tr.model, [(x.to(dev), y.to(dev))], dev, tr.workload.loss)


def main(argv: Optional[list[str]] = None) -> int:
    p = build_parser(prog=PROG)
    p.add_argument("--overhead", action="store_true",
                   help="time the plain loop against labkit's DDP (the bench's overhead job)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--bench-warmup", dest="bench_warmup", type=int, default=3)
    p.add_argument("--control", action="store_true",
                   help="with --overhead: the plain loop a second time, an A/A control")
    p.add_argument("--profile-steps", dest="profile_steps", type=int, default=0,
                   help="with --overhead: then a torch.profiler trace of this many steps of each loop")
    add_resolved(p)
    a = p.parse_args(argv)

    def work() -> None:
        from labkit.training.dist import env_world

        cfg = rank_config(a)  # labkit bench's resolved.json (checked there), else the flags
        if not cfg.out:
            raise ConfigError("--out is required")
        if cfg.method != BASELINE:
            raise ConfigError(f"the plain loop is DDP's floor (got --method {cfg.method})")
        if a.control and not a.overhead:
            raise ConfigError("--control is the overhead job's A/A control: it needs --overhead")
        if a.profile_steps and not a.overhead:
            raise ConfigError("--profile-steps traces the overhead job's loops: it needs --overhead")
        if a.profile_steps < 0:
            raise ConfigError(f"--profile-steps must be 0 or more (got {a.profile_steps})")
        why = unsupported(cfg)
        if why:
            raise ConfigError(why)
        os.makedirs(cfg.out, exist_ok=True)
        if not a.overhead:
            train(cfg)
            return
        doc = measure_overhead(cfg, a.steps, a.trials, a.bench_warmup, a.control, a.profile_steps)
        if env_world()[0] == 0:
            atomic_write_json(os.path.join(cfg.out, layout.BENCH_RESULT), doc)

    return lifecycle.run_rank(work, PROG)
