"""A training rank: what ``torchrun -m labkit.train`` runs on every process.

    torchrun --nproc_per_node=4 -m labkit.train --method {ddp,allreduce,ps} [flags]

Without torchrun it runs as one process (PS needs two). Everything that can reject the input
happens before the process group exists; rank 0 writes the result file
(labkit.training.result_file) after every epoch; how the rank ends is
labkit.training.lifecycle's, shared with the bench's ranks.
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Optional

import torch

from labkit.core.config import TrainConfig, build_parser
from labkit.core.errors import RunFailed
from labkit.core.methods import key_of
from labkit.core.status import INTERRUPTED_WHY, Status
from labkit.workloads import checks, make_workload
from labkit.workloads.catalog import is_builtin, own_code

from . import budget, exhaustion, lifecycle, stackdump
from . import checkpoint
from .preflight import add_resolved, from_resolved, rank_config
from .data import steps_per_epoch
from .dist import env_world, init, teardown
from .result_file import ResultFile
from .sync.registry import method_failure, workload_failure
from .trainer import Trainer

PROG = "labkit.train"  # how the rank names itself in its one-line errors


def run(cfg: TrainConfig, checked: bool = False) -> Optional[str]:
    """Train with ``cfg`` (already resolved) on this process's rank; return the output folder.
    ``checked``: the launcher checked this machine for it too (a resolved.json)."""
    rank, world, _, local_world = env_world()
    # everything that can reject the input happens before the process group exists; a user's
    # workload that raises there is one line naming its file and line
    with own_code(cfg.workload):
        workload, data, model = _built(cfg, checked, rank)
    steps = steps_per_epoch(len(data.train), cfg.trainers(world), cfg.batch_size,
                            cfg.max_steps_per_epoch)
    note = getattr(workload, "note", "")  # e.g. the weights it loaded
    ckpt = checkpoint.find(cfg)
    if not checked:  # the bare torchrun path: the disk and /dev/shm, on every rank alike (a
        # launcher checked them, and host memory, before it spawned the ranks)
        budget.machine(cfg, local_world, cfg.out or ".", only=("disk space", "shared memory"))
    out = checkpoint.prepare_out(cfg, resuming=ckpt is not None) if rank == 0 else None
    if note and rank == 0:
        print(note, flush=True)

    ctx = init(cfg.backend, cfg.timeout, cfg.pin_cpus, cfg.device, cfg.debug_collectives)
    results = trainer = None
    try:
        trainer = Trainer(cfg, ctx, out, data, model, steps, workload)
        start = (checkpoint.restore(ckpt, trainer.strategy, trainer.model, trainer.optimizer,
                                    trainer.scaler)
                 if ckpt else 1)
        if ctx.is_main:
            results = ResultFile(cfg, ctx, trainer.strategy.trainers, out, trainer.strategy.phases,
                                 previous=checkpoint.results(ckpt) if ckpt else None,
                                 workload=workload.describe())
            results.write()
            # torchrun stops this rank with SIGTERM when another one dies: say so in the file
            lifecycle.on_sigterm(lambda: results.stop(
                "stopped by SIGTERM (torchrun stops the other ranks when one fails; or the job was killed)"))
            lifecycle.heartbeat(results.beat)
        _watch_for_stalls(cfg, ctx.rank, trainer, results)
        trainer.fit(results, start)
        if results is not None:
            results.update(timeline=trainer.timeline())
            results.finish(Status.COMPLETED)
            print(f"results: {results.path}", flush=True)
        return out
    except BaseException as e:
        at = trainer.position() if trainer else "before training"
        # the machine ran out of something, or a method of one's own raised: one line
        ran_out = (exhaustion.translate(e, cfg.method, ctx.rank, at, out or cfg.out)
                   or method_failure(e, cfg.method, ctx.rank, at)
                   or workload_failure(e, cfg, ctx.rank, at))
        if results is not None:
            _finish(results, ran_out or e)
        if ran_out is not None:
            raise ran_out from e  # one line (lifecycle.run_rank); the original stays chained
        raise
    finally:
        teardown()


def _built(cfg: TrainConfig, checked: bool, rank: int):
    """The workload, its datasets and the model, before any process group: the data must hold
    samples, and a user's model and loss are tried on a first batch where no launcher did
    (the bare torchrun path): one line each, before anything is made."""
    workload = make_workload(cfg)
    data = checks.samples(workload)
    if not checked and not is_builtin(cfg.workload):
        checks.first_batch(workload, data)
    if data.warning and rank == 0:  # every rank built the same datasets: one says so
        print(f"{PROG}: warning: {data.warning}", file=sys.stderr, flush=True)
    torch.manual_seed(cfg.seed)  # same initial weights on every rank
    return workload, data, workload.build_model()


def _watch_for_stalls(cfg: TrainConfig, rank: int, trainer: Trainer,
                      results: Optional[ResultFile]) -> None:
    """End this rank when a training step has not finished for twice --timeout: it waits in
    code where no collective times out (every rank in a method's own wait, say). Its stacks go
    into its log, one line says where it stood, rank 0's result file says failed, and the
    rank exits 1 (torchrun then stops the others, which dump theirs). Only training steps are
    watched: a long validation or checkpoint is not a stall, and its collectives are bounded
    by --timeout already."""
    bound, key = budget.STALL_TIMEOUTS * cfg.timeout, key_of(cfg.method)

    def progress():
        return (trainer.doing, trainer.global_step) if trainer.doing == "train" else time.monotonic()

    def give_up(where: str) -> None:
        line = stackdump.stalled_line(key, rank, bound, where)
        if results is not None:
            _finish(results, RunFailed(key, line.split(" failed: ", 1)[1]))
        print(f"{PROG}: error: {line}", file=sys.stderr, flush=True)
        lifecycle.leave_now(1)

    stackdump.watch(progress, bound, give_up)


def _finish(results: ResultFile, e: BaseException) -> None:
    """The result file of a run that ended by ``e``: failed (interrupted for Ctrl-C), with why.
    A disk still too full to write it leaves it running: the launcher marks it, or readers
    see its writer gone (labkit.core.status.as_seen)."""
    try:
        if isinstance(e, KeyboardInterrupt):
            results.finish(Status.INTERRUPTED, error=INTERRUPTED_WHY)
        else:
            results.finish(Status.FAILED, error=str(e) if isinstance(e, RunFailed)
                           else f"{type(e).__name__}: {e}")
    except OSError:
        pass


def parser() -> argparse.ArgumentParser:
    """labkit.train's flags: TrainConfig's, and --resolved."""
    p = build_parser()
    add_resolved(p)
    return p


def _flags_checked(args) -> TrainConfig:
    """The bare torchrun path's config, checked here (a user's workload's resolve may raise)."""
    with own_code(args.workload):
        return rank_config(args)


def _train(args: argparse.Namespace) -> Optional[str]:
    """The run ``args`` name, inside lifecycle.run_rank (a bad config is its one line): the
    launcher's resolved.json, checked there; or the guide's bare flags, checked here first."""
    if args.resolved is None:
        return run(_flags_checked(args))
    return run(from_resolved(args.resolved), True)


def main(argv: Optional[list[str]] = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.resolved is not None:
        flags = [a for a in (sys.argv[1:] if argv is None else argv) if a.startswith("--")]
        if any(not a.startswith("--resolved") for a in flags):
            p.error(f"--resolved carries the whole config; give no other flags (got "
                    f"{' '.join(a for a in flags if not a.startswith('--resolved'))})")
    return lifecycle.run_rank(_train, PROG, args)
