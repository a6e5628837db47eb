"""THE training loop, shared by all three methods; entry point under torchrun.

    torchrun --nproc_per_node=4 -m labkit.train --method {ddp,allreduce,ps} [flags]

Without torchrun it runs as one process (PS needs two).  A method differs only in its
synchronisation strategy (labkit.training.sync); everything else (data, model, optimizer, timing,
metrics, result file) is here, once.
"""
from __future__ import annotations

import os
import sys
import time
import traceback
from contextlib import nullcontext
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from labkit import __version__
from . import hooks
from . import lifecycle
from labkit.core import layout
from labkit.core.config import ConfigError, TrainConfig, build_parser, from_args
from labkit.core.methods import comm_key, comm_times_key
from labkit.core.status import Status
from .data import (Datasets, ShardSampler, build_datasets, default_workers, make_loader,
                   steps_per_epoch, train_sampler)
from .dist import DistContext, all_reduce_sum, env_world, init, sync_device, teardown
from .checks import find_checkpoint, preflight, prepare_out
from .timers import Lines, MachineLoad, StepClock, atomic_torch_save
from .models import build_model
from .result_file import ResultFile
from .sync import make_strategy


# ------------------------------------------------------------------ the loop
class Trainer:
    def __init__(self, cfg: TrainConfig, ctx: DistContext, out: Optional[str], data: Datasets,
                 model: torch.nn.Module, steps: int):
        self.cfg, self.ctx, self.out, self.steps = cfg, ctx, out, steps
        self.strategy = s = make_strategy(cfg, ctx)
        fmt = torch.channels_last if cfg.channels_last else torch.preserve_format
        self.model = model.to(ctx.device, memory_format=fmt)
        self.forward_model = s.setup(self.model)
        if cfg.compile:
            # compiles the forward (and, through AOTAutograd, its backward); the strategy's
            # hooks stay on the parameters, so synchronisation is unchanged
            self.forward_model = torch.compile(self.forward_model, backend=cfg.compile_backend)
        self.optimizer = (torch.optim.SGD(self.model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                                          weight_decay=cfg.weight_decay)
                          if s.steps_optimizer else None)
        cuda = ctx.device.type == "cuda"
        self.amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.amp)
        self.scaler = (torch.amp.GradScaler(ctx.device.type)
                       if cfg.amp == "fp16" and s.steps_optimizer else None)
        if cuda:
            torch.backends.cudnn.benchmark = True

        self.train_loader = self.val_loader = None
        if s.is_trainer:
            workers = default_workers(cfg, data.in_memory, ctx.local_world_size)
            self.sampler = train_sampler(data.train, s.trainers, s.trainer_index, cfg.seed)
            self.train_loader = make_loader(data.train, self.sampler, cfg.batch_size, workers, cuda,
                                            drop_last=True, seed=cfg.seed + s.trainer_index)
            self.val_loader = make_loader(data.val, ShardSampler(len(data.val), s.trainers, s.trainer_index),
                                          cfg.batch_size, workers, cuda, drop_last=False, seed=cfg.seed)
        self.num_train, self.num_val = len(data.train), len(data.val)
        self.global_step = 0
        self._local_opt: Optional[torch.optim.Optimizer] = None
        # called as fn(trainer, global_step) before each training step (labkit.training.hooks)
        self.step_callbacks: list[Callable[["Trainer", int], None]] = []
        hooks.trainer_built(self)

    def log(self, msg: str) -> None:
        """One line for people, from the rank that writes results (rank 0)."""
        if self.ctx.is_main:
            print(msg, flush=True)
            if self.out:
                with open(os.path.join(self.out, layout.TRAIN_LOG), "a") as f:
                    f.write(msg + "\n")

    def autocast(self):
        if self.amp_dtype is None:
            return nullcontext()
        return torch.autocast(self.ctx.device.type, dtype=self.amp_dtype)

    def progress(self, epoch: int):
        """The first trainer shows the training bar; a PS server shows its own batch bar."""
        s, cfg = self.strategy, self.cfg
        mine = self.ctx.rank == s.first_trainer or (not s.is_trainer and self.ctx.is_main)
        if not (cfg.progress and mine):
            return None
        from tqdm import tqdm
        desc = f"epoch {epoch}/{cfg.epochs}" + ("" if s.is_trainer else " [server]")
        tty = sys.stderr.isatty()
        return tqdm(total=self.steps, desc=desc, unit="batch", dynamic_ncols=tty, ncols=None if tty else 100,
                    leave=True, mininterval=0.5 if tty else 5.0, file=sys.stderr if tty else Lines(sys.stderr))

    # -------------------------------------------------------------- one step
    def to_device(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dev = self.ctx.device
        x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)  # pinned -> async copy
        if self.cfg.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return x, y

    def train_step(self, x: Optional[torch.Tensor], y: Optional[torch.Tensor], sync: bool = True):
        """One step on every rank: a trainer passes its batch, a PS server ``None``.

        ``sync=False`` is the compute-only step ``labkit bench`` measures: the same forward,
        backward and optimizer step with no communication at all, every trainer updating its
        own copy (so the copies drift apart, which the tests check).
        Returns (loss, logits) on trainers, None on a server.
        """
        s = self.strategy
        opt = self.optimizer if sync else self.local_optimizer()
        label = torch.profiler.record_function  # names the phases in a torch.profiler trace
        with nullcontext() if sync else s.no_sync():
            s.zero_grad(opt)
            if sync:
                s.before_forward()
            out = None
            if x is not None:
                with label("labkit.forward"), self.autocast():
                    logits = self.forward_model(x)
                    loss = F.cross_entropy(logits, y)
                with label("labkit.backward"):
                    (self.scaler.scale(loss) if self.scaler else loss).backward()
                out = loss.detach(), logits.detach()
            if sync:
                with label("labkit.sync"):
                    s.after_backward()
            with label("labkit.step"):
                s.step(opt, self.scaler if opt is self.optimizer else None)
        return out

    def local_optimizer(self) -> Optional[torch.optim.Optimizer]:
        """The optimizer of a compute-only step: the rank's own, or, for a PS worker (which has
        none), a local SGD with the same settings. A server does not train: None."""
        if not self.strategy.is_trainer:
            return None
        if self.optimizer is not None:
            return self.optimizer
        if self._local_opt is None:
            c = self.cfg
            self._local_opt = torch.optim.SGD(self.model.parameters(), lr=c.lr, momentum=c.momentum,
                                              weight_decay=c.weight_decay)
        return self._local_opt

    # -------------------------------------------------------------- one epoch of training
    def train_epoch(self, epoch: int) -> dict:
        cfg, s, dev = self.cfg, self.strategy, self.ctx.device
        self.model.train()
        losses = torch.zeros(self.steps, device=dev)          # per-step loss, summed over trainers
        counts = torch.zeros(2, device=dev)                   # correct, seen
        data_time = 0.0
        warmup = cfg.warmup_steps if self.steps > cfg.warmup_steps else 0
        batch_images = cfg.batch_size * s.trainers
        it = None
        if s.is_trainer:
            self.sampler.set_epoch(epoch)
            # augmentation seeds depend only on (seed, trainer, epoch): a resumed run draws the
            # same crops as an uninterrupted one
            self.train_loader.generator.manual_seed(cfg.seed + 1000 * s.trainer_index + epoch)
            it = iter(self.train_loader)
        bar = self.progress(epoch)
        refresh = max(1, self.steps // 50)
        s.timer.pop()
        # rank 0's steady-state steps, one mark per step boundary: the same clock and window as
        # train_throughput, so mean(step_times) is avg_batch_time (labkit.analysis.stats works from them)
        clock = StepClock(dev)
        # rank 0 (the one that writes the file): how busy the rest of the machine was meanwhile
        load = MachineLoad() if self.ctx.is_main else None
        step_comm: list[list[float]] = []  # per steady-state step, seconds in each timed phase
        seen = [0.0] * len(s.phases)
        sync_device(dev)
        t_start = t_window = time.perf_counter()
        for step in range(self.steps):
            if step == warmup:
                if warmup:
                    sync_device(dev)
                if load is not None:
                    load.start()
                t_window = clock.mark()
            elif step > warmup:
                clock.mark()
            for callback in self.step_callbacks:
                callback(self, self.global_step)
            self.global_step += 1
            x = y = None
            if it is not None:
                t0 = time.perf_counter()
                x, y = next(it)
                data_time += time.perf_counter() - t0
                x, y = self.to_device(x, y)
            out = self.train_step(x, y)
            if s.phases:
                now = [s.timer.totals.get(p, 0.0) for p in s.phases]
                if step >= warmup:
                    step_comm.append([a - b for a, b in zip(now, seen)])
                seen = now
            if out is not None:
                loss, logits = out
                losses[step] = loss.float()
                counts[0] += (logits.argmax(1) == y).sum()
                counts[1] += y.numel()
            if bar is not None:
                bar.update(1)
                if (step + 1) % refresh == 0 or step + 1 == self.steps:
                    bar.set_postfix_str(self._bar_text(losses, counts, step, t_start), refresh=False)
        clock.mark()
        sync_device(dev)
        t_end = time.perf_counter()
        machine = load.stop() if load is not None else None
        if bar is not None:
            bar.close()

        # reduce over ranks; a PS server contributes zeros (its own pull/push would count
        # the same transfer twice), so sums are over trainers
        comm = s.timer.pop()
        mine = [comm.get(p, 0.0) if s.is_trainer else 0.0 for p in s.phases]
        per_step = [t if s.is_trainer else 0.0 for row in step_comm for t in row]
        vec = torch.tensor([data_time] + mine + per_step, device=dev,
                           dtype=torch.float64)
        all_reduce_sum(losses)
        all_reduce_sum(counts)
        all_reduce_sum(vec)
        losses = (losses / s.trainers).tolist()
        window_steps = self.steps - warmup
        window_time = t_end - t_window
        m = {
            "train_loss": sum(losses) / len(losses),
            "train_accuracy": 100.0 * counts[0].item() / max(1.0, counts[1].item()),
            "train_time": t_end - t_start,
            "train_throughput": batch_images * window_steps / window_time,
            "avg_batch_time": window_time / window_steps,
            "all_losses": losses,
            "steps": self.steps,
            "throughput_warmup_steps": warmup,
            "avg_data_time": vec[0].item() / s.trainers / self.steps,
            "step_times": clock.durations(),
        }
        if machine is not None:
            m["machine_load"] = machine
        n = len(s.phases)
        comm_steps = (vec[1 + n:] / s.trainers).view(-1, n).tolist() if n else []  # mean over trainers
        for i, p in enumerate(s.phases):
            m[comm_key(p)] = vec[1 + i].item() / s.trainers / self.steps
            m[comm_times_key(p)] = [row[i] for row in comm_steps]
        m.update(s.epoch_metrics())  # e.g. async PS: max_staleness_observed
        return m

    def _bar_text(self, losses, counts, step, t_start) -> str:
        s = self.strategy
        if not s.is_trainer:  # the server: its own side of each phase, per step
            t = {k: 1000 * v / (step + 1) for k, v in s.timer.totals.items()}
            # the server's "push" starts when it is ready for gradients, so it holds the workers'
            # forward and backward; the epoch line's push (the workers' side) does not
            names = {"pull": "params", "push": "grads+compute"}
            return " ".join(f"{names.get(k, k)}={v:.0f}ms" for k, v in t.items())
        elapsed = time.perf_counter() - t_start
        ips = self.cfg.batch_size * s.trainers * (step + 1) / max(elapsed, 1e-9)
        acc = 100.0 * counts[0].item() / max(1.0, counts[1].item())
        return f"loss={losses[:step + 1].mean().item():.4f} acc={acc:.2f}% {ips:.0f} img/s"

    # -------------------------------------------------------------- validation
    @torch.no_grad()
    def validate(self) -> dict:
        s, dev = self.strategy, self.ctx.device
        s.finish_epoch(self.model)
        self.model.eval()
        tot = torch.zeros(3, device=dev, dtype=torch.float64)  # loss sum, correct, count
        if s.is_trainer:
            for i, (x, y) in enumerate(self.val_loader):
                if self.cfg.max_val_steps and i >= self.cfg.max_val_steps:
                    break
                x, y = self.to_device(x, y)
                with self.autocast():
                    logits = self.model(x)
                tot[0] += F.cross_entropy(logits.float(), y, reduction="sum")
                tot[1] += (logits.argmax(1) == y).sum()
                tot[2] += y.numel()
        all_reduce_sum(tot)
        n = max(1.0, tot[2].item())
        return {"val_loss": tot[0].item() / n, "val_accuracy": 100.0 * tot[1].item() / n,
                "val_samples": int(tot[2].item())}

    # -------------------------------------------------------------- the run
    def load_checkpoint(self, ckpt: dict) -> int:
        """Restore model, optimizer and scaler; return the epoch to start from."""
        self.model.load_state_dict(ckpt["model"])  # in place: PS/allreduce views stay views
        if self.optimizer is not None:
            self.optimizer.load_state_dict(ckpt["optimizer"])
        if self.scaler is not None and ckpt.get("scaler"):
            self.scaler.load_state_dict(ckpt["scaler"])
        return ckpt["epoch"] + 1

    def save_checkpoint(self, epoch: int, results: ResultFile) -> None:
        """Rank 0, after every epoch: everything needed to continue (rank 0 holds the optimizer
        for every method: it is a trainer for ddp/allreduce and the server for ps)."""
        atomic_torch_save({"epoch": epoch, "model": self.model.state_dict(),
                           "optimizer": self.optimizer.state_dict(),
                           "scaler": self.scaler.state_dict() if self.scaler else None,
                           "results": results.doc},
                          os.path.join(self.out, layout.CHECKPOINT))

    def fit(self, results: Optional[ResultFile], start_epoch: int = 1) -> None:
        cfg, s = self.cfg, self.strategy
        self.log(f"labkit {__version__} | {s.describe()} | world {self.ctx.world_size}"
                 f" ({s.trainers} trainer{'s' if s.trainers > 1 else ''}) | {cfg.backend} on "
                 f"{self.ctx.device.type} | {cfg.model} on {cfg.dataset} ({self.num_train} train / "
                 f"{self.num_val} val) | batch {cfg.batch_size}/trainer | {self.steps} steps/epoch")
        if start_epoch > 1:
            self.log(f"resuming at epoch {start_epoch} from "
                     f"{os.path.join(self.out or cfg.out, layout.CHECKPOINT)}")
        for epoch in range(start_epoch, cfg.epochs + 1):
            m = self.train_epoch(epoch)
            m.update(self.validate())
            line = (f"epoch {epoch}/{cfg.epochs}: train loss {m['train_loss']:.4f} acc "
                    f"{m['train_accuracy']:.2f}% | val loss {m['val_loss']:.4f} acc "
                    f"{m['val_accuracy']:.2f}% | {m['train_throughput']:.1f} img/s, "
                    f"{m['train_time']:.1f}s")
            for p in s.phases:
                line += f" | {p} {1000 * m[comm_key(p)]:.1f} ms/step"
            self.log(line)
            if results is not None:
                results.add_epoch(epoch, m)
                self.save_checkpoint(epoch, results)
        if self.ctx.is_main and self.out:
            # after finish_epoch every rank, the PS server included, holds the final model
            atomic_torch_save(self.model.state_dict(), os.path.join(self.out, layout.FINAL_MODEL))


def run(cfg: TrainConfig) -> Optional[str]:
    """Train with ``cfg`` (already resolved) on this process's rank; return the output folder."""
    rank, world, _, _ = env_world()
    # everything that can reject the input happens before the process group exists
    data = build_datasets(cfg)
    if data.warning and rank == 0:  # every rank built the same datasets: one says so
        print(f"labkit.train: warning: {data.warning}", file=sys.stderr, flush=True)
    trainers = cfg.trainers(world)
    steps = steps_per_epoch(len(data.train), trainers, cfg.batch_size, cfg.max_steps_per_epoch)
    torch.manual_seed(cfg.seed)  # same initial weights on every rank
    model, note = build_model(cfg.model, data.num_classes, cfg.weights)
    ckpt = find_checkpoint(cfg)
    out = prepare_out(cfg, resuming=ckpt is not None) if rank == 0 else None
    if note and rank == 0:
        print(note, flush=True)

    ctx = init(cfg.backend, cfg.timeout, cfg.pin_cpus)
    results = None
    try:
        trainer = Trainer(cfg, ctx, out, data, model, steps)
        start = trainer.load_checkpoint(ckpt) if ckpt else 1
        if ctx.is_main:
            results = ResultFile(cfg, ctx, trainer.strategy.trainers, out, trainer.strategy.phases,
                                 previous=ckpt["results"] if ckpt else None)
            results.write()
            # torchrun stops this rank with SIGTERM when another one dies: say so in the file
            lifecycle.on_sigterm(lambda: results.stop(
                "stopped by SIGTERM (torchrun stops the other ranks when one fails; or the job was killed)"))
            lifecycle.heartbeat(results.beat)
        trainer.fit(results, start)
        if results is not None:
            results.finish(Status.COMPLETED)
            print(f"results: {results.path}", flush=True)
        return out
    except BaseException as e:
        if results is not None:
            results.finish(Status.INTERRUPTED if isinstance(e, KeyboardInterrupt) else Status.FAILED,
                           error=f"{type(e).__name__}: {e}")
        raise
    finally:
        teardown()


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    rank = env_world()[0]
    try:
        cfg = preflight(from_args(args))
        run(cfg)
    except ConfigError as e:
        # Bad input is seen by every rank alike: one message, from rank 0.  The others wait a
        # moment so torchrun does not stop rank 0 before it has printed.
        if rank == 0:
            print(f"labkit.train: error: {e}", file=sys.stderr, flush=True)
        else:
            time.sleep(2)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - a crash: full traceback in the rank's log, then one line
        traceback.print_exc()
        _record_for_torchrun(e)
        print(f"labkit.train: error: rank {rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


def _record_for_torchrun(e: BaseException) -> None:
    """Write torchrun's error file, so its 'root cause' is the rank that failed first rather
    than one that failed after it because its peer was gone."""
    try:
        from torch.distributed.elastic.multiprocessing.errors import get_error_handler
        get_error_handler().record_exception(e)
    except Exception:  # noqa: BLE001 - best effort, outside torchrun there is no error file
        pass

