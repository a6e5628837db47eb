"""THE training loop, shared by all three methods.

A method differs only in its synchronisation strategy (labkit.training.sync); everything else
(data, model, optimizer, the per-step measurements of labkit.training.instruments.meter,
validation, checkpoints) is here, once. labkit.training.rank builds a Trainer on every rank and
runs it.
"""
from __future__ import annotations

import copy
import os
import time
from contextlib import nullcontext
from typing import Callable, Iterator, Optional

import torch

from labkit import __version__
from labkit.core import layout
from labkit.core.config import TrainConfig
from labkit.core.errors import RunFailed
from labkit.core.results import Epoch
from labkit.workloads import Datasets, Workload, make_workload

from . import extensions, guards, step_options
from . import checkpoint
from .checkpoint import atomic_torch_save
from .data import ShardSampler, default_workers, train_sampler
from .dist import DistContext, all_reduce_sum
from .gpu_data import make_loaders
from .instruments.flops import Efficiency
from .instruments.memory import MemoryMeter
from .instruments.meter import Bar, EpochMeter
from .instruments.timers import PARTS, StepParts, label
from .result_file import ResultFile
from .sync import make_strategy
from .workers import LoaderWatch, batches


def _cpu_seconds() -> float:
    """User and system CPU seconds of this process (a forked rank's count starts at its fork)."""
    t = os.times()
    return t.user + t.system


def steps_as_calibration(e: Epoch, n: int, world: int) -> dict:
    """The calibration (Trainer.calibrate's record) of a method whose training steps are
    compute-only steps (Strategy.steps_are_compute_only: nosync), read from the last ``n``
    steady-state steps of its last epoch ``e`` instead of run again: each part's mean over the
    trainers per step, and each trainer's own compute (its time held at the step's end: it
    synchronises nothing). Fewer than ``n`` where the epoch had fewer."""
    parts = {p: list(v[-n:]) for p, v in (e.step_parts or {}).items()}
    rank_compute = [0.0] * max(1, world)
    held = e.sync_held or {"ranks": [], "times": []}
    for r, times in zip(held["ranks"], held["times"]):
        last = times[-n:]
        rank_compute[r] = sum(last) / len(last) if last else 0.0
    return {"steps": len(parts.get("compute", [])), "parts": parts, "rank_compute": rank_compute,
            "seconds": 0.0, "from": "training steps"}


class Trainer:
    def __init__(self, cfg: TrainConfig, ctx: DistContext, out: Optional[str], data: Datasets,
                 model: torch.nn.Module, steps: int, workload: Optional[Workload] = None):
        self.cfg, self.ctx, self.out, self.steps = cfg, ctx, out, steps
        # what is trained and how it is judged (labkit.workloads): the loop knows no more of it
        self.workload = w = workload if workload is not None else make_workload(cfg)
        self.strategy = s = make_strategy(cfg, ctx)
        fmt = torch.channels_last if cfg.channels_last else torch.preserve_format
        self.model = model.to(ctx.device, memory_format=fmt)
        # where each step goes (labkit.training.instruments.timers.StepParts): the loop marks its
        # parts, the method stamps its collectives
        self.parts = s.parts = StepParts(ctx.device)
        s.steps_per_epoch = steps
        # memory per rank: the weights counted before setup may shard them
        self.memory = MemoryMeter(cfg, ctx, s, self.model, w)
        self.forward_model = s.setup(self.model)
        if cfg.compile:
            # compiles the forward (and, through AOTAutograd, its backward); the strategy's
            # hooks stay on the parameters, so synchronisation is unchanged
            self.forward_model = torch.compile(self.forward_model, backend=cfg.compile_backend)
        self.optimizer = w.optimizer(self.model.parameters()) if s.steps_optimizer else None
        cuda = ctx.device.type == "cuda"
        self.amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.amp)
        self.scaler = (torch.amp.GradScaler(ctx.device.type)
                       if cfg.amp == "fp16" and s.steps_optimizer else None)
        if cuda:
            torch.backends.cudnn.benchmark = True

        self.train_loader = self.val_loader = self.watch = None
        if s.is_trainer:
            workers = default_workers(cfg, data.in_memory, ctx.local_world_size)
            # workers that stop delivering end the run in one line (labkit.training.workers)
            self.watch = LoaderWatch(cfg.loader_timeout) if workers > 0 else None
            self.sampler = train_sampler(data.train, s.trainers, s.trainer_index, cfg.seed)
            # on a GPU the batches are made there (labkit.training.gpu_data); else DataLoaders
            self.train_loader, self.val_loader = make_loaders(
                cfg, data, self.sampler, ShardSampler(len(data.val), s.trainers, s.trainer_index),
                workers, ctx.device, seed=cfg.seed + s.trainer_index)
        self.num_train, self.num_val = len(data.train), len(data.val)
        self.data_line = w.summary_line(data)  # what is trained, for the first log line
        # FLOPs, MFU, peak memory, data wait share
        self.efficiency = Efficiency(cfg, ctx, w, data)
        self.global_step = 0
        # where the run is, for a one-line failure (labkit.training.exhaustion): see position()
        # the phases' seconds (``doing`` is a clock: see its setter), for timeline()
        self.spent: dict[str, float] = {}
        self._doing, self._since = "start", time.perf_counter()
        self._start_cpu = _cpu_seconds()  # this process's CPU so far: the rank's start
        self.epoch, self.step, self.doing = 0, 0, "start"
        self._local_opt: Optional[torch.optim.Optimizer] = None
        self.clip = step_options.ClipRecord()  # --grad-clip: each step's norm before clipping
        # called as fn(trainer, global_step) before each training step (labkit.training.extensions)
        self.step_callbacks: list[Callable[["Trainer", int], None]] = []
        if w.lr_at(0, 1) is not None:  # the workload's schedule, set before every step
            self.step_callbacks.append(Trainer._schedule)
        extensions.trainer_built(self)

    @property
    def doing(self) -> str:
        """What the rank is doing now: start, train, validation, checkpoint, calibration, final."""
        return self._doing

    @doing.setter
    def doing(self, what: str) -> None:
        """Move to phase ``what``; the phase left is charged the time since it began."""
        now = time.perf_counter()
        self.spent[self._doing] = self.spent.get(self._doing, 0.0) + now - self._since
        self._doing, self._since = what, now

    def timeline(self) -> dict:
        """Where this rank's time went, for the result file (labkit.report.accounting): the
        process's start and this moment (seconds since the epoch: the launcher's clock) and the
        seconds of each phase since the Trainer was built; what lies between the process's start
        and the first phase (imports, the data, the model, the process group) is the rank's start,
        whose CPU seconds are ``start_cpu_s`` (a warm rank's counted from its fork)."""
        from labkit.core import procs

        self.doing = self._doing  # the phase now running, charged up to now
        return {"process_start": procs.started_at(), "now": time.time(),
                "started_by": procs.started_by(), "start_cpu_s": round(self._start_cpu, 3),
                "spent": {k: round(v, 4) for k, v in self.spent.items()}}

    def _schedule(self, _global_step: int) -> None:
        """The workload's learning rate for this step of the run (counted from the epoch, so a
        resumed run continues the schedule), into the optimizer that steps (a server's, or a
        trainer's own)."""
        step = (self.epoch - 1) * self.steps + self.step
        lr = self.workload.lr_at(step, self.cfg.epochs * self.steps)
        for opt in (self.optimizer, self._local_opt):
            if opt is not None:
                for group in opt.param_groups:
                    group["lr"] = lr

    def position(self) -> str:
        """Where the run is, as a failure's line says it: "at epoch 2, step 5 of 11"."""
        e = self.epoch
        return {"start": "before the first step",
                "train": f"at epoch {e}, step {self.step + 1} of {self.steps}",
                "validation": f"in epoch {e}'s validation",
                "checkpoint": f"after epoch {e} (its checkpoint)",
                "calibration": "in the calibration steps after the last epoch",
                "final": "after the last epoch (the final model)"}[self.doing]

    def log(self, msg: str, echo: bool = True) -> None:
        """One line for people, from the rank that writes results (rank 0); ``echo`` False:
        into the run's train.log only."""
        if self.ctx.is_main:
            if echo:
                print(msg, flush=True)
            if self.out:
                with open(os.path.join(self.out, layout.TRAIN_LOG), "a") as f:
                    f.write(msg + "\n")

    def autocast(self):
        if self.amp_dtype is None:
            return nullcontext()
        return torch.autocast(self.ctx.device.type, dtype=self.amp_dtype)

    # -------------------------------------------------------------- one step
    def to_device(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dev = self.ctx.device
        x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)  # pinned -> async copy
        if self.cfg.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return x, y

    def train_step(self, x: Optional[torch.Tensor], y: Optional[torch.Tensor], sync: bool = True):
        """One step on every rank: a trainer passes its batch, a PS server ``None``. It reads
        top to bottom: the method's hooks (labkit.training.sync.base.Strategy) around the
        forward and backward, each part of the step marked for where the time goes.

        ``sync=False`` is the compute-only step ``labkit bench`` measures (compute_step).
        Returns (loss, logits) on trainers, None on a server.
        """
        if not sync:
            return self.compute_step(x, y)
        s, mark, k = self.strategy, self.parts.mark, self.cfg.grad_accum
        s.zero_grad(self.optimizer)
        s.before_forward()        # a parameter server's pull
        mark("pull")
        out = self.forward_backward(x, y) if k == 1 else step_options.micro_batches(self, x, y)
        mark("compute")
        with label("labkit.sync"):
            s.after_backward()    # the method's synchronisation of the gradients
        mark("sync")
        with label("labkit.step"):
            if self.cfg.grad_clip:
                step_options.clip(self)
            s.step(self.optimizer, self.scaler)
        mark("optimizer")
        return out

    def forward_backward(self, x: Optional[torch.Tensor], y: Optional[torch.Tensor],
                         scale: float = 1.0):
        """A trainer's forward and backward: (loss, logits), detached; None without a batch."""
        if x is None:
            return None
        with label("labkit.forward"), self.autocast():
            logits = self.forward_model(x)
            loss = self.workload.loss(logits, y)
        with label("labkit.backward"):
            scaled = loss * scale if scale != 1.0 else loss
            (self.scaler.scale(scaled) if self.scaler else scaled).backward()
        return loss.detach(), logits.detach()

    def compute_step(self, x: Optional[torch.Tensor], y: Optional[torch.Tensor]):
        """The same forward, backward and optimizer step with no communication at all, every
        trainer updating its own copy (so the copies drift apart, which the tests check)."""
        s, mark = self.strategy, self.parts.mark
        opt = self.local_optimizer()
        with s.no_sync():
            s.zero_grad(opt)
            mark("pull")
            out = (self.forward_backward(x, y) if self.cfg.grad_accum == 1
                   else step_options.micro_batches(self, x, y))
            mark("compute")
            mark("sync")
            with label("labkit.step"):
                s.step(opt, self.scaler if opt is self.optimizer else None)
            mark("optimizer")
        return out

    def local_optimizer(self) -> Optional[torch.optim.Optimizer]:
        """The optimizer of a compute-only step: the rank's own, or, for a PS worker (which has
        none), the workload's optimizer with the same settings. A server does not train: None."""
        if not self.strategy.is_trainer:
            return None
        if self.optimizer is not None:
            return self.optimizer
        if self._local_opt is None:
            self._local_opt = self.workload.optimizer(self.model.parameters())
        return self._local_opt

    # -------------------------------------------------------------- one epoch of training
    def train_epoch(self, epoch: int) -> Epoch:
        cfg, s = self.cfg, self.strategy
        self.model.train()
        warmup = cfg.warmup_steps if self.steps > cfg.warmup_steps else 0
        batches = self._batches(epoch)
        w = self.workload
        meter = EpochMeter(self.steps, warmup, s, self.ctx.device, self.ctx.is_main, self.parts,
                           hits_of=w.train_hits, rate=w.rate)
        bar = Bar(cfg, self.ctx, s, self.steps, epoch, w.units_per_sample)
        s.timer.pop()
        s.wire.take()  # bytes on the wire: this epoch's steps only
        self.memory.start_epoch(warmup)
        meter.start()
        self.epoch, self.doing = epoch, "train"
        for step in range(self.steps):
            self.step = step
            meter.step_begins(step)
            for callback in self.step_callbacks:
                callback(self, self.global_step)
            self.global_step += 1
            self.parts.mark("other")
            x, y = meter.next_batch(batches, self.to_device) if batches else (None, None)
            self.parts.mark("data")
            with self.memory.watch(step, self.model, self.optimizer):  # one untimed step
                out = self.train_step(x, y)
            meter.step_ends(step, out, y)
            bar.update(meter, step)
        meter.stop()
        bar.close()
        e = meter.metrics(epoch, cfg.batch_size * s.trainers * w.units_per_sample)
        self.efficiency.epoch(e)
        e.extra.update(self.clip.epoch(cfg.grad_clip))
        e.extra.update(s.epoch_metrics())  # a method's own figures, e.g. async PS: max_staleness_observed
        e.optimizer_state_bytes = self.efficiency.state_bytes(s.optimizer_state(self.optimizer))
        e.wire = s.wire_metrics(self.steps)  # bytes per rank per step (every rank gathers)
        e.memory = self.memory.epoch(self.model, self.optimizer)  # every rank's, gathered
        return e

    def _batches(self, epoch: int) -> Optional[Iterator]:
        """This epoch's batches for a trainer (None for a server)."""
        s = self.strategy
        if not s.is_trainer:
            return None
        self.sampler.set_epoch(epoch)
        # augmentation seeds depend only on (seed, trainer, epoch): a resumed run draws the
        # same crops as an uninterrupted one
        self.train_loader.generator.manual_seed(self.cfg.seed + 1000 * s.trainer_index + epoch)
        return batches(self.train_loader, self.watch)

    def _cycle(self) -> Iterator:
        """A trainer's batches after the last epoch, over and over (a small dataset may hold
        fewer batches than the calibration's steps)."""
        while True:
            empty = True
            for batch in self._batches(self.cfg.epochs + 1):
                empty = False
                yield batch
            if empty:
                return

    # -------------------------------------------------------------- compute-only calibration
    def calibrate(self, n: int, untimed: int = 2) -> dict:
        """``n`` compute-only steps (after ``untimed`` ones): the forward, backward and
        optimizer step with synchronisation skipped, timed part by part as training steps are.
        They follow the epochs, but the first step after validation is a third slower than the
        rest, and the second now and then still stands out (docs/performance-log.md), so two
        untimed steps.
        The report's breakdown of a step takes its compute time from here. The model, its
        BatchNorm statistics and the optimizer are restored afterwards, so what training
        produced is unchanged. Returns, per step, the mean over the trainers of each part."""
        s, t0 = self.strategy, time.perf_counter()
        saved = copy.deepcopy(self.model.state_dict())
        opt = copy.deepcopy(self.optimizer.state_dict()) if self.optimizer is not None else None
        self.model.train()
        batches = self._cycle() if s.is_trainer else None
        for _ in range(untimed + n):
            self.parts.begin()
            self.parts.mark("other")
            x, y = self.to_device(*next(batches)) if batches else (None, None)
            self.parts.mark("data")
            self.train_step(x, y, sync=False)
        self.parts.close()
        got = self.parts.take(untimed)["parts"]
        world = max(1, self.ctx.world_size)
        mine = [0.0] * world  # each trainer's own compute-only forward + backward (mean)
        if s.is_trainer:
            mine[self.ctx.rank] = sum(got["compute"]) / n
        vec = torch.tensor([got[p] if s.is_trainer else [0.0] * n for p in PARTS],
                           dtype=torch.float64, device=self.ctx.device)
        ranks = torch.tensor(mine, dtype=torch.float64, device=self.ctx.device)
        all_reduce_sum(vec)
        all_reduce_sum(ranks)
        self.model.load_state_dict(saved)  # in place: PS/allreduce views stay views
        if opt is not None:
            self.optimizer.load_state_dict(opt)
        self._local_opt = None
        return {"steps": n, "parts": {p: (vec[i] / s.trainers).tolist() for i, p in enumerate(PARTS)},
                "rank_compute": ranks.tolist(), "seconds": time.perf_counter() - t0}

    # -------------------------------------------------------------- validation
    @torch.no_grad()
    def validate(self, e: Epoch) -> None:
        s, dev = self.strategy, self.ctx.device
        self.doing = "validation"
        s.finish_epoch(self.model)
        self.model.eval()
        w = self.workload
        keys = w.val_sum_keys  # the workload's sums (loss, count, ...), summed over the trainers
        tot = torch.zeros(len(keys), device=dev, dtype=torch.float64)
        if s.is_trainer:
            for i, (x, y) in enumerate(batches(self.val_loader, self.watch)):
                if self.cfg.max_val_steps and i >= self.cfg.max_val_steps:
                    break
                x, y = self.to_device(x, y)
                with self.autocast():
                    logits = self.model(x)
                got = w.val_sums(logits, y)
                for j, k in enumerate(keys):
                    tot[j] += got[k]
        all_reduce_sum(tot)
        sums = dict(zip(keys, tot.tolist()))
        for k, v in w.val_figures(sums).items():
            if k in ("val_loss", "val_accuracy"):  # the guide's keys are Epoch's fields
                setattr(e, k, v)
            else:
                e.extra[k] = v
        e.val_samples = int(sums["count"])

    # -------------------------------------------------------------- training gone wrong
    def check_epoch(self, e: Epoch, results: Optional[ResultFile]) -> None:
        """After validation (``finish_epoch`` done): stop the run, on every rank alike, if this
        epoch's loss diverged or the replicas drifted apart (labkit.training.guards); else
        note the replica check in the epoch's figures ``e``."""
        cfg = self.cfg
        d = guards.divergence(cfg, e.epoch, self.steps, (e.epoch - 1) * self.steps, e)
        if d is not None:
            self._stop(results, guards.divergence_text(d, cfg, self.strategy.trainers), diverged=d)
        if cfg.check_replicas and self.ctx.distributed:  # one process: nothing to compare
            e.replicas, bad = guards.check_replicas(*self.strategy.replicas(self.model), e.epoch)
            if bad is not None:
                self._stop(results, guards.mismatch_text(bad), replicas_differ=bad)

    def _stop(self, results: Optional[ResultFile], text: str, **record: dict) -> None:
        """Record why in the result file (``diverged=`` or ``replicas_differ=``; the epoch
        itself is not added) and raise RunFailed: rank 0 prints its one line
        (labkit.training.lifecycle.run_rank), the log keeps it."""
        if results is not None:
            results.update(**record)
        self.log(f"{self.cfg.method} failed: {text}", echo=False)
        raise RunFailed(self.cfg.method, text)

    # -------------------------------------------------------------- the run
    def fit(self, results: Optional[ResultFile], start_epoch: int = 1) -> None:
        """The run on this rank: its epochs from ``start_epoch`` (a resumed run's first), then
        the end of the run. ``results``: rank 0's result file (None on the other ranks)."""
        self.train_epochs(results, start_epoch)
        self.end_run(results, trained=start_epoch <= self.cfg.epochs)

    def train_epochs(self, results: Optional[ResultFile], start_epoch: int) -> None:
        """The epochs: each one trained, validated and checked, its line logged, and on rank 0
        recorded in the result file (and the checkpoint)."""
        cfg, s = self.cfg, self.strategy
        self.log(f"labkit {__version__} | {s.describe()} | world {self.ctx.world_size}"
                 f" ({s.trainers} trainer{'s' if s.trainers > 1 else ''}) | {cfg.backend} on "
                 f"{self.ctx.device.type} | {self.data_line} | batch {cfg.batch_size}/trainer | "
                 f"{self.steps} steps/epoch")
        if start_epoch > 1:
            self.log(f"resuming at epoch {start_epoch} from "
                     f"{os.path.join(self.out or cfg.out, layout.CHECKPOINT)}")
        for epoch in range(start_epoch, cfg.epochs + 1):
            e = self.train_epoch(epoch)
            t0 = time.perf_counter()
            self.validate(e)
            e.val_time = time.perf_counter() - t0
            self.check_epoch(e, results)
            line = (f"epoch {epoch}/{cfg.epochs}: {self.workload.epoch_line(e)} | "
                    f"{e.train_throughput:.1f} {self.workload.rate}, {e.train_time:.1f}s")
            for p in s.phases:
                line += f" | {p} {1000 * e.comm[p]:.1f} ms/step"
            self.log(line)
            self.doing = "checkpoint"
            # every rank: a sharded method gathers its shards for rank 0 to save
            state = s.full_state(self.model, self.optimizer) if cfg.checkpoint else None
            if results is not None:
                results.add_epoch(e)
                results.update(efficiency=self.efficiency.summary(results.result.epochs),
                               memory_model=self.memory.model)
                if state is not None:
                    checkpoint.save(self.out, epoch, *state, self.scaler, results.result)

    def end_run(self, results: Optional[ResultFile], trained: bool) -> None:
        """After the last epoch: the calibration steps (where this run ``trained`` an epoch: one
        resumed past its last has none to calibrate), the final model, and the workload's last
        lines (the references, e.g. a language model's text)."""
        cfg, s = self.cfg, self.strategy
        self.doing = "calibration"
        if cfg.calibrate_steps and trained and not s.calibrates:
            self.log(f"no compute-only steps: {s.describe()} cannot skip its communication; its "
                     f"compute is {s.compute_measured}")
        elif cfg.calibrate_steps and trained:
            if not s.steps_are_compute_only:
                calibration = self.calibrate(cfg.calibrate_steps)
                if results is not None:
                    results.update(calibration=calibration)
            elif results is not None:  # nosync: its own last steps, read by the rank that records
                results.update(calibration=steps_as_calibration(
                    results.result.epochs[-1], cfg.calibrate_steps, self.ctx.world_size))
        self.doing = "final"
        # the validation loader's workers (kept between epochs) end now, not at the rank's exit
        self.train_loader = self.val_loader = None
        # every rank: after finish_epoch each holds the final model (the PS server included),
        # or its shard, which a sharded method gathers here
        model_state, _ = s.full_state(self.model, None)
        if self.ctx.is_main and self.out:
            atomic_torch_save(model_state, os.path.join(self.out, layout.FINAL_MODEL))
        if self.ctx.is_main and results is not None:
            refs, ep = (results.result.workload or {}).get("references") or {}, results.result.epochs
            for name, v in refs.items():  # e.g. the loss of a model that ignores context
                if ep and ep[-1].val_loss is not None:
                    self.log(f"final validation loss {ep[-1].val_loss:.4f} against the {name}: {v:.4f}")
            # e.g. a language model's text, from the whole model
            shown = self.workload.finish(s.whole_model(self.model, model_state,
                                                        self.workload.build_model))
            if shown:
                results.update(examples=shown)
                for line in self.workload.finish_lines(shown):
                    self.log(line)
