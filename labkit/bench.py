"""`labkit bench`: where a step's time goes, per method, against DDP and the raw collectives.

For every variant (ddp, allreduce, ps, ps-p2p, ...) and process count, one torchrun job runs
this module on every rank (``python -m labkit.bench``). Each rank, in one process group:

1. runs warm-up steps (left out), then ``--trials`` trials of ``--steps`` synchronised steps;
2. runs as many compute-only steps: the same forward, backward and optimizer step with no
   communication at all (``Strategy.no_sync``; every trainer updates its own copy, so the
   copies drift apart -- ``param_spread`` shows it);
3. times the raw collectives on buffers of the bytes the method moves, in the same process
   group: one all-reduce, one reduce, one broadcast, and an all-reduce size sweep (the cost
   model fits latency and bandwidth to it, see labkit.model).

A trial's time is the slowest rank's: a step is over when its last rank is. Steps cycle over
a few batches already on the device, so data loading is not in these figures (training
reports its data wait per epoch). Then

    exposed communication = median synchronised step - median compute-only step
    algbw = bytes / time;  busbw = algbw * 2(n-1)/n for all-reduce, = algbw for reduce and
    broadcast (as nccl-tests defines them)

The launcher side (:func:`bench`) validates every combination first, then launches them one
after another into ``runs/<date>_<time>_bench/`` and writes ``bench.json``, ``bench.txt`` and
``bench.png`` there (``bench.json`` after every job, so a failure keeps what was measured).
"""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import IO, Any, Callable, Optional

import torch
import torch.distributed as dist

from .config import VARIANTS, ConfigError, TrainConfig, build_parser, config_from_args
from .metrics import Stopwatch, atomic_path, atomic_write_json

RESULT = "bench_result.json"



# ================================================================== one rank (under torchrun)
def _stats(xs: list[float]) -> dict:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs),
            "iqr": q[2] - q[0], "trials": xs}


def _slowest(t: float, device: torch.device) -> float:
    """The largest of every rank's ``t``."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        v = torch.tensor([t], dtype=torch.float64, device=device)
        dist.all_reduce(v, op=dist.ReduceOp.MAX)
        t = v.item()
    return t


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def param_spread(model: torch.nn.Module, device: torch.device) -> float:
    """Largest difference of any parameter element between any two ranks (0: all equal)."""
    v = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
    hi, lo = v.clone(), v.clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    return (hi - lo).max().item()


def time_collective(fn: Callable[[], Any], device: torch.device, reps: int) -> float:
    """Median over ``reps`` of the slowest rank's time for ``fn`` (after one untimed call)."""
    clock = Stopwatch(device)
    fn()
    times = []
    for _ in range(reps):
        _barrier()
        clock.start()
        fn()
        times.append(_slowest(clock.stop(), device))
    return statistics.median(times)


def _bw(nbytes: int, t: float, factor: float) -> dict:
    alg = nbytes / t if t > 0 else float("nan")
    return {"bytes": nbytes, "time": t, "algbw": alg, "busbw": alg * factor}


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
    sweep = []
    size = 4096
    while size < push_bytes:
        buf = torch.zeros(size // esize, dtype=dtype, device=device)
        sweep.append({"bytes": size, "time": time_collective(lambda: dist.all_reduce(buf), device,
                                                             reps + 2)})
        size *= 8
    sweep.append({"bytes": push.numel() * esize, "time": t_ar})
    return {
        "all_reduce": _bw(push.numel() * esize, t_ar, 2 * (n - 1) / n),
        "reduce": _bw(push.numel() * esize, t_red, 1.0),
        "broadcast": _bw(pull.numel() * 4, t_bc, 1.0),
        "reduce_broadcast": {"bytes": push.numel() * esize + pull.numel() * 4, "time": t_red + t_bc},
        "all_reduce_sweep": sweep,
    }


def moved_bytes(cfg: TrainConfig, grad_bytes: int) -> tuple[int, int]:
    """(bytes a trainer pushes or all-reduces per step, bytes it pulls per step)."""
    push = grad_bytes // 2 if cfg.compress == "fp16" else grad_bytes
    pull = grad_bytes if cfg.method == "ps" else 0  # PS pulls fp32 parameters
    return push, pull


def measure(cfg: TrainConfig, steps: int, trials: int, warmup: int, profile_steps: int,
            out: str) -> dict:
    """This rank's part of one bench job; rank 0 returns the measurements (others: {})."""
    from tqdm import tqdm

    from .data import build_datasets
    from .dist import env_world, init, teardown
    from .metrics import Lines
    from .models import build_model
    from .train import Trainer

    rank = env_world()[0]
    data = build_datasets(cfg)
    torch.manual_seed(cfg.seed)
    model, _ = build_model(cfg.model, data.num_classes, cfg.weights)
    ctx = init(cfg.backend, cfg.timeout)
    try:
        tr = Trainer(cfg, ctx, None, data, model, steps)
        s, dev = tr.strategy, ctx.device
        batches = []
        if s.is_trainer:  # a few real batches, on the device, cycled
            it = iter(tr.train_loader)
            for _ in range(min(4, len(tr.train_loader))):
                batches.append(tr.to_device(*next(it)))
        total = 2 * (warmup + trials * steps)
        bar = (tqdm(total=total, desc=f"bench {cfg.method}", unit="batch", ncols=100,
                    mininterval=5.0, file=Lines(sys.stderr))
               if rank == s.first_trainer and cfg.progress else None)

        def run(n: int, sync: bool) -> None:
            for i in range(n):
                x, y = batches[i % len(batches)] if batches else (None, None)
                tr.train_step(x, y, sync)
                if bar is not None:
                    bar.update(1)

        clock = Stopwatch(dev)

        def trial(sync: bool) -> float:
            _barrier()
            clock.start()
            run(steps, sync)
            return _slowest(clock.stop(), dev) / steps

        run(warmup, True)
        s.timer.pop()
        step_times = [trial(True) for _ in range(trials)]
        phase_sums = s.timer.pop()
        s.finish_epoch(tr.model)  # every rank holds the model as the method defines it
        spread_sync = param_spread(tr.model, dev)
        run(warmup, False)
        compute_times = [trial(False) for _ in range(trials)]
        spread_compute = param_spread(tr.model, dev)
        if bar is not None:
            bar.close()

        # phases: mean over the trainers of each one's time per step (servers count as 0)
        vec = torch.tensor([phase_sums.get(p, 0.0) if s.is_trainer else 0.0 for p in s.phases],
                           dtype=torch.float64, device=dev)
        if ctx.distributed and len(vec):
            dist.all_reduce(vec)
        phases = {p: vec[i].item() / s.trainers / (trials * steps) for i, p in enumerate(s.phases)}

        params = [p for p in tr.model.parameters() if p.requires_grad]
        grad_bytes = sum(p.numel() * p.element_size() for p in params)
        push, pull = moved_bytes(cfg, grad_bytes)
        collectives = (measure_collectives(push, max(pull, 4), torch.float16 if cfg.compress == "fp16"
                                           else params[0].dtype, dev)
                       if ctx.distributed else {})

        if profile_steps:
            profile(tr, run, profile_steps, out, rank, dev)
        if rank != 0:
            return {}
        return {
            "method": cfg.method, "world_size": ctx.world_size, "trainers": s.trainers,
            "servers": ctx.world_size - s.trainers, "batch_size": cfg.batch_size,
            "global_batch": cfg.batch_size * s.trainers, "device": dev.type, "backend": cfg.backend,
            "step_time": _stats(step_times), "compute_time": _stats(compute_times),
            "phases": phases, "grad_bytes": grad_bytes, "bytes_per_step": push + pull,
            "bucket_mb": cfg.bucket_mb, "collectives": collectives,
            "param_spread": {"sync": spread_sync, "compute_only": spread_compute},
        }
    finally:
        teardown()


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
    tr.strategy.finish_epoch(tr.model)  # e.g. async PS: drain in-flight messages
    path = os.path.join(out, f"trace_rank{rank}.json")
    with atomic_path(path) as tmp:
        prof.export_chrome_trace(tmp)


def worker_main(argv: Optional[list[str]] = None) -> int:
    from .dist import env_world
    from .train import preflight

    p = build_parser(prog="labkit.bench")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--bench-warmup", dest="bench_warmup", type=int, default=3)
    p.add_argument("--profile-steps", dest="profile_steps", type=int, default=0)
    a = p.parse_args(argv)
    rank = env_world()[0]
    try:
        cfg = preflight(config_from_args(a))
        if not cfg.out:
            raise ConfigError("--out is required (the folder for bench_result.json)")
        os.makedirs(cfg.out, exist_ok=True)
        doc = measure(cfg, a.steps, a.trials, a.bench_warmup, a.profile_steps, cfg.out)
        if rank == 0:
            atomic_write_json(os.path.join(cfg.out, RESULT), doc)
    except ConfigError as e:
        if rank == 0:
            print(f"labkit.bench: error: {e}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - full traceback in the rank's log, then one line
        traceback.print_exc()
        print(f"labkit.bench: error: rank {rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


# ================================================================== the launcher side
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
    from .lab import _absolute, environment, new_run_dir
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
    cfg = _absolute(cfg)
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
    atomic_write_json(str(run / "environment.json"), env)
    doc: dict[str, Any] = {
        "kind": "labkit.bench", "version": 1, "created": time.strftime("%Y-%m-%d %H:%M:%S"),
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
            res = launch(vcfg, n, str(out), stream=stream, module="labkit.bench", extra=extra)
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
    doc["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    atomic_write_json(path, doc)
    write_outputs(doc, run)
    if plan.report and doc["results"]:
        from .lab import kernel_name, make_report
        import papermill as pm

        try:
            make_report(run, kernel_name(), 3600, stream)
        except pm.PapermillExecutionError as e:  # the measurements are safe; say what broke
            stream.write(f"\nREPORT FAILED: {e.ename}: {e.evalue} (notebook: {run / 'report'})\n")
    return run, doc


def derive(r: dict) -> dict:
    """Exposed communication and throughput from the raw measurements."""
    step, comp = r["step_time"]["median"], r["compute_time"]["median"]
    r["exposed_comm"] = step - comp
    r["throughput"] = r["global_batch"] / step
    r["throughput_vs_ddp"] = None
    return r


def compare_to_ddp(results: list[dict]) -> None:
    """Throughput ratio to (uncompressed) DDP at the same process count, where it was run;
    also per trainer, which is fair to a parameter server (its servers do not train)."""
    ddp = {r["nproc"]: r for r in results if r["variant"] == "ddp"}
    for r in results:
        d = ddp.get(r["nproc"])
        r["throughput_vs_ddp"] = r["throughput"] / d["throughput"] if d else None
        r["per_trainer_vs_ddp"] = ((r["throughput"] / r["trainers"]) / (d["throughput"] / d["trainers"])
                                   if d else None)


def summary_line(r: dict) -> str:
    st, ct = r["step_time"], r["compute_time"]
    return (f"{r['variant']} x{r['nproc']}: step {1000 * st['median']:.1f} ms "
            f"[{1000 * st['min']:.1f}-{1000 * st['max']:.1f}], compute-only {1000 * ct['median']:.1f} ms, "
            f"exposed comm {1000 * r['exposed_comm']:.1f} ms, {r['throughput']:.1f} img/s")


# ------------------------------------------------------------------ table and plot
def rows(doc: dict) -> list[dict]:
    """One row per (variant, process count): the figures the issue asks for."""
    out = []
    for r in doc.get("results", []):
        st, c = r["step_time"], r.get("collectives") or {}
        ar, rb = c.get("all_reduce"), c.get("reduce_broadcast")
        # the method's own communication phases (time a trainer was blocked in them), next to
        # the raw collective moving the same bytes: all-reduce, or reduce + broadcast for PS
        sync = sum(r.get("phases", {}).values()) if r.get("phases") else None
        raw = rb if r["method"] == "ps" else ar
        out.append({
            "variant": r["variant"], "procs": r["nproc"], "trainers": r["trainers"],
            "step ms (median)": 1000 * st["median"],
            "step ms (min-max)": f"{1000 * st['min']:.1f}-{1000 * st['max']:.1f}",
            "compute-only ms": 1000 * r["compute_time"]["median"],
            "exposed comm ms": 1000 * r["exposed_comm"],
            "MB/step": r["bytes_per_step"] / 1e6,
            "all-reduce ms": 1000 * ar["time"] if ar else None,
            "busbw GB/s": ar["busbw"] / 1e9 if ar else None,
            "reduce+bcast ms": 1000 * rb["time"] if rb else None,
            "sync ms": 1000 * sync if sync is not None else None,
            "sync / raw": sync / raw["time"] if sync is not None and raw and raw["time"] else None,
            "img/s": r["throughput"],
            "x DDP": r["throughput_vs_ddp"],
            "x DDP/trainer": r.get("per_trainer_vs_ddp"),
        })
    return out


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def text_table(doc: dict) -> str:
    rs = rows(doc)
    if not rs:
        return "(no measurements)"
    cols = list(rs[0])
    cells = [[_fmt(r[c]) for c in cols] for r in rs]
    w = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    line = lambda xs: "  ".join(x.rjust(w[i]) if i > 0 else x.ljust(w[i]) for i, x in enumerate(xs))
    head = (f"labkit bench: {doc['config'].get('model')} on {doc['config'].get('dataset')}, batch "
            f"{doc['config'].get('batch_size')}/trainer, {doc['backend']} on {doc['device']}; "
            f"{doc['trials']} trials x {doc['steps']} steps after {doc['warmup']} warm-up steps")
    return "\n".join([head, line(cols), line(["-" * x for x in w]), *map(line, cells)])


def plot(doc: dict, path: str | os.PathLike) -> Optional[Path]:
    """Left: each variant's median step split into compute-only and exposed communication,
    with the trials' min-max as an error bar. Right: throughput relative to DDP."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rs = doc.get("results", [])
    if not rs:
        return None
    labels = [f"{r['variant']}\nx{r['nproc']}" for r in rs]
    x = range(len(rs))
    comp = [1000 * r["compute_time"]["median"] for r in rs]
    exposed = [max(0.0, 1000 * r["exposed_comm"]) for r in rs]
    step = [1000 * r["step_time"]["median"] for r in rs]
    err = [[s - 1000 * r["step_time"]["min"] for s, r in zip(step, rs)],
           [1000 * r["step_time"]["max"] - s for s, r in zip(step, rs)]]
    fig, (a, b) = plt.subplots(1, 2, figsize=(max(9, 1.3 * len(rs) + 4), 4.5),
                               gridspec_kw={"width_ratios": [3, 2]})
    a.bar(x, comp, color="#4c72b0", label="compute only (no sync)")
    a.bar(x, exposed, bottom=comp, color="#dd8452", label="exposed communication")
    a.errorbar(x, step, yerr=err, fmt="none", ecolor="black", capsize=3, label="step: min-max of trials")
    raw = [(i, 1000 * r["collectives"]["all_reduce"]["time"]) for i, r in enumerate(rs)
           if r.get("collectives") and r["method"] != "ps"]
    raw += [(i, 1000 * r["collectives"]["reduce_broadcast"]["time"]) for i, r in enumerate(rs)
            if r.get("collectives") and r["method"] == "ps"]
    if raw:
        a.scatter([i for i, _ in raw], [c + t for (i, t), c in zip(raw, [comp[i] for i, _ in raw])],
                  marker="_", s=400, color="crimson", zorder=3,
                  label="compute + raw collective (all-reduce, or reduce+broadcast for PS)")
    a.set_xticks(list(x), labels, fontsize=8)
    a.set_ylabel("ms per step (median)")
    a.set_title("Where a step's time goes")
    a.set_ylim(0, 1.08 * max(1000 * r["step_time"]["max"] for r in rs))
    ratio = [r["throughput_vs_ddp"] for r in rs]
    b.bar(x, [v if v is not None else 0 for v in ratio], color="#55a868")
    b.axhline(1.0, color="gray", ls="--", lw=1)
    for i, v in enumerate(ratio):
        b.text(i, (v or 0) + 0.02, "-" if v is None else f"{v:.2f}", ha="center", fontsize=8)
    b.set_xticks(list(x), labels, fontsize=8)
    b.set_ylabel("throughput / DDP's (same process count)")
    b.set_title("Throughput relative to DDP")
    fig.suptitle(f"{doc['config'].get('model')}, batch {doc['config'].get('batch_size')}/trainer, "
                 f"{doc['backend']} on {doc['device']}", fontsize=10)
    handles, names = a.get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=2, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    path = Path(path)
    with atomic_path(str(path)) as tmp:
        fig.savefig(tmp, dpi=120, format=path.suffix.lstrip(".") or "png")
    plt.close(fig)
    return path


def write_outputs(doc: dict, run: Path) -> None:
    with atomic_path(str(run / "bench.txt")) as tmp, open(tmp, "w") as f:
        f.write(text_table(doc) + "\n")
    plot(doc, run / "bench.png")


def load(run_dir: str | os.PathLike) -> Optional[dict]:
    """bench.json of a run folder, or None."""
    p = Path(run_dir) / "bench.json"
    try:
        doc = json.loads(p.read_text())
    except (OSError, ValueError):
        return None
    if doc.get("kind") != "labkit.bench":
        return None
    compare_to_ddp(doc.get("results", []))  # files from before a ratio was added get it too
    return doc


if __name__ == "__main__":
    sys.exit(worker_main())
