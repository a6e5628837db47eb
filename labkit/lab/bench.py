"""`labkit bench`, the launcher side: where a step's time goes, per method, against DDP and the
raw collectives.

For every variant (ddp, allreduce, ps, ps-p2p, ...) and process count, one torchrun job runs
labkit.training.bench_rank on every rank (timed synchronised steps, compute-only steps, the raw
collectives: see its docstring). :func:`bench` validates every combination first, then
launches them one after another into ``runs/<date>_<time>_bench/`` and writes ``bench.json``,
``bench.txt`` and ``bench.png`` there (``bench.json`` after every job, so a failure keeps what
was measured). The document's derived figures (exposed communication, bus bandwidth), table
and plot are labkit.analysis.bench_view, which the report and the cost model read.
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import IO, Any, Optional

from labkit.analysis.bench_view import KIND, RESULT, compare_to_ddp, derive, summary_line, write_outputs
from labkit.core.config import VARIANTS, ConfigError, TrainConfig
from labkit.core.files import atomic_write_json, now_str
from .record import portable


@dataclasses.dataclass
class BenchPlan:
    variants: list[str]
    nprocs: list[int]
    steps: int = 10
    trials: int = 3
    warmup: int = 3
    profile_steps: int = 0
    runs_dir: str = "runs"
    tag: Optional[str] = None
    report: bool = True


def parse_list(text: str, what: str, conv=str) -> list:
    try:
        items = [conv(x.strip()) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{what} must be a comma-separated list (got {text!r})") from None
    if not items:
        raise ConfigError(f"{what} is empty")
    return items


def bench(cfg: TrainConfig, plan: BenchPlan, stream: Optional[IO[str]] = None) -> tuple[Path, dict]:
    """Run every (variant, process count) of ``plan``; return (run folder, bench document)."""
    from .experiment import environment, new_run_dir, with_absolute_paths
    from .launch import launch, validate

    stream = stream or sys.stdout
    unknown = [v for v in plan.variants if v not in VARIANTS]
    if unknown:
        raise ConfigError(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    for name, v in (("--steps", plan.steps), ("--trials", plan.trials)):
        if v < 1:
            raise ConfigError(f"{name} must be at least 1 (got {v})")
    if plan.warmup < 0 or plan.profile_steps < 0:
        raise ConfigError("--warmup and --profile-steps must be 0 or more")
    if any(n < 1 for n in plan.nprocs):
        raise ConfigError(f"--nproc values must be at least 1 (got {plan.nprocs})")
    cfg = with_absolute_paths(cfg)
    jobs, skipped = [], []
    for n in plan.nprocs:  # all bad input fails here, before a folder or a process exists
        for v in plan.variants:
            vcfg = dataclasses.replace(cfg, out=None, **VARIANTS[v])
            try:
                jobs.append((v, n, validate(vcfg, n)))
            except ConfigError as e:
                skipped.append({"variant": v, "nproc": n, "reason": str(e)})
    if not jobs:
        raise ConfigError("nothing to run: " + "; ".join(f"{s['variant']} x{s['nproc']}: "
                                                         f"{s['reason']}" for s in skipped))
    run = new_run_dir(plan.runs_dir, plan.tag or "bench").resolve()
    env = environment(cfg.seed)
    atomic_write_json(str(run / "environment.json"), portable(env, run))  # as labkit experiment's
    doc: dict[str, Any] = {
        "kind": KIND, "version": 1, "created": now_str(),
        "status": "running", "device": "cuda" if jobs[0][2].backend == "nccl" else "cpu",
        "backend": jobs[0][2].backend, "steps": plan.steps, "trials": plan.trials,
        "warmup": plan.warmup, "config": jobs[0][2].to_dict(),
        "plan": dataclasses.asdict(plan), "results": [], "skipped": skipped, "failed": [],
    }
    path = str(run / "bench.json")
    atomic_write_json(path, doc)
    stream.write(f"bench: {run}\n")
    for s in skipped:
        stream.write(f"  skipped {s['variant']} with {s['nproc']} processes: {s['reason']}\n")
    try:
        for v, n, vcfg in jobs:
            out = run / "bench" / f"{v}_x{n}"
            stream.write(f"\n=== {v}: {n} processes ===\n")
            stream.flush()
            extra = ("--steps", str(plan.steps), "--trials", str(plan.trials),
                     "--bench-warmup", str(plan.warmup), "--profile-steps", str(plan.profile_steps))
            res = launch(vcfg, n, str(out), stream=stream, module="labkit.training.bench_rank", extra=extra)
            if not res.ok:
                doc["failed"].append({"variant": v, "nproc": n, "error": res.message})
                stream.write(f"{v} x{n} FAILED: {res.message}\n")
            else:
                r = json.loads((out / RESULT).read_text())
                r.update(variant=v, nproc=n, folder=str(out.relative_to(run)),
                         compress=vcfg.compress, ps_mode=vcfg.ps_mode if vcfg.method == "ps" else None)
                doc["results"].append(derive(r))
                stream.write(summary_line(doc["results"][-1]) + "\n")
            compare_to_ddp(doc["results"])
            atomic_write_json(path, doc)
    except KeyboardInterrupt:
        doc["status"] = "interrupted"
        atomic_write_json(path, doc)
        raise
    doc["status"] = "failed" if doc["failed"] else "completed"
    doc["finished"] = now_str()
    atomic_write_json(path, doc)
    write_outputs(doc, run)
    if plan.report and doc["results"]:
        from .kernels import kernel_name
        from .experiment import make_report
        import papermill as pm

        try:
            make_report(run, kernel_name(), 3600, stream)
        except pm.PapermillExecutionError as e:  # the measurements are safe; say what broke
            stream.write(f"\nREPORT FAILED: {e.ename}: {e.evalue} (notebook: {run / 'report'})\n")
    return run, doc
