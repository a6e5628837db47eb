"""`labkit bench`, the launcher side: where a step's time goes, per method, against DDP and the
raw collectives.

For every variant (ddp, allreduce, ps, ps-p2p, ...) and process count, one torchrun job runs
labkit.bench.bench_rank on every rank (timed synchronised steps, compute-only steps, the raw
collectives: see its docstring). :func:`bench` validates every combination first, once (each
job's checked config goes into its folder as resolved.json, which its ranks read), then
launches them one after another into ``runs/<date>_<time>_bench/`` and writes ``bench.json``,
``bench.txt`` and ``bench.png`` there (``bench.json`` after every job, so a failure keeps what
was measured). The document's derived figures (exposed communication, bus bandwidth), table
and plot are labkit.bench.bench_view, which the report and the cost model read.

Then, for every process count, one more job: labkit's own overhead (``overhead_x<n>``), a
plain PyTorch DDP loop and labkit's DDP training loop alternating in the same processes, both
loading their data (labkit.bench.plain_loop says why one job); the document's ``overhead``
holds labkit DDP / plain loop with its 95% interval.

Each method's job also prices the lab's instruments (its result's ``instruments``, see
labkit.bench.bench_rank): its synchronised trials run in rounds with those of
Trainers that differ by one instrument, and the table gives each instrument's paired ratio
on / off with its interval over the rounds (labkit.bench.instrument_cost),
and the loop's per-step work without a switch, timed directly.

On an emulated cluster (``--emulate-nodes N --link RATE``, labkit.launch.emulated) every job runs
on N nodes of ``--nproc`` ranks each (world N x nproc), the cluster checked once before
anything is created; the document's ``link`` holds the link as set and each job's probe, and
``link_fit`` the alpha-beta bandwidth fitted to the all-reduce sweep beside the set rate and
the probe's goodput (labkit.costmodel.calibrate.link_fit says why they should agree).
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import IO, Any, Optional

from labkit.bench.bench_view import (
    KIND, compare_to_ddp, derive, derive_overhead, link_lines, overhead_line, summary_line,
    write_outputs)
from labkit.bench.instrument_cost import instrument_lines
from labkit.core import layout
from labkit.core.config import DEFAULT_VARIANTS, VARIANTS, ConfigError, TrainConfig
from labkit.core.files import atomic_write_json, now_str
from labkit.core.methods import BASELINE, absolute, is_name, key_of, spec
from labkit.core.run_folder import read_json
from labkit.core.status import Status
from labkit.costmodel.calibrate import link_fit
from labkit.launch.cluster import link_record
from labkit.launch.emulated import cluster_spec
from labkit.launch.launch import LaunchResult, launch, validate, write_resolved
from labkit.launch.launch_params import Nodes, with_absolute_paths
from labkit.runs.record import snapshot, write_record
from labkit.runs.runs_dir import new_run_dir, write_index

from .kernels import kernel_name
from .render import make_report, report_or_why

RANK_MODULE = "labkit.bench.bench_rank"  # what torchrun runs on every rank of a bench job
OVERHEAD_MODULE = "labkit.bench.plain_loop"  # the overhead job's ranks
OVERHEAD = "overhead"  # the overhead jobs' name in the document and the jobs' folders


@dataclasses.dataclass
class BenchPlan:
    variants: list[str]
    nprocs: list[int]
    steps: int = 10
    trials: int = 3
    warmup: int = 3
    profile_steps: int = 0
    runs_dir: Optional[str] = None  # None: the project's runs/ (layout.runs_root)
    tag: Optional[str] = None
    report: bool = True
    pricing: bool = True  # the instrument rounds beside each job's own loop (labkit.bench.pricing)
    control: bool = False  # the overhead job's A/A control: the plain loop a second time
    nodes: Nodes = dataclasses.field(default_factory=Nodes)  # an emulated cluster, or none


def bench_params(args: dict) -> tuple[TrainConfig, BenchPlan]:
    """`labkit bench`'s flags (``args``, the plan's taken out) -> (TrainConfig with the machine's
    defaults, BenchPlan). One GPU and only --nproc 1: one rank owns it, over nccl, as `labkit run
    --nproc 1`; any larger count shares it over gloo (launch_params.machine_defaults)."""
    from labkit.launch.launch_params import (
        gpu_count, nproc_or_default, split_params, with_machine_defaults)

    keys = ("variants", "nproc", "steps", "trials", "warmup", "profile_steps", "runs_dir", "tag",
            "report", "pricing", "control")
    kw = {k: args.pop(k) for k in keys if k in args}
    kw["variants"] = parse_list(kw.get("variants", ",".join(DEFAULT_VARIANTS)), "--variants")
    kw["nprocs"] = parse_list(kw.pop("nproc", str(nproc_or_default(None)) if gpu_count() else "2,4"),
                              "--nproc", int)
    train, launch_params = split_params({**args, "nproc": 1} if kw["nprocs"] == [1] else args)
    kw["nodes"] = launch_params.nodes()  # --emulate-nodes, --link (a --link alone: refused there)
    return TrainConfig(**with_machine_defaults(train, launch_params.nproc)), BenchPlan(**kw)


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
    stream = stream or sys.stdout
    _check(plan)
    # the emulated cluster, checked once against this machine before a folder or process exists
    spec = cluster_spec(plan.nodes, max(plan.nprocs))
    jobs, skipped = _jobs(with_absolute_paths(cfg), plan)
    overheads = _overhead_jobs(with_absolute_paths(cfg), plan, skipped)
    run = new_run_dir(plan.runs_dir, plan.tag or "bench").resolve()
    env = write_record(run, snapshot({f"{v}_x{n}": c for v, n, c in jobs}, cfg.seed))
    atomic_write_json(str(run / layout.ENVIRONMENT), layout.portable(env, run))
    doc: dict[str, Any] = {
        "kind": KIND, "version": 1, "created": now_str(),
        "status": Status.RUNNING, "device": jobs[0][2].device,
        "backend": jobs[0][2].backend, "steps": plan.steps, "trials": plan.trials,
        "warmup": plan.warmup, "config": jobs[0][2].to_dict(),
        # the jobs that failed are listed under the status's name
        "plan": dataclasses.asdict(plan), "results": [], "skipped": skipped, Status.FAILED: [],
        OVERHEAD: [],  # labkit DDP against the plain loop, per process count
    }
    if spec is not None:  # the link as set; each job's probe joins it (_job_link)
        doc["link"] = {**link_record(spec), "ranks_per_node": plan.nprocs, "probes": []}
    path = str(run / layout.BENCH)
    atomic_write_json(path, doc)
    stream.write(f"bench: {run}\n")
    for s in skipped:
        stream.write(f"  skipped {s['variant']} with {s['nproc']} processes: {s['reason']}\n")
    _run_all(run, doc, jobs, overheads, plan, stream)
    doc["status"] = Status.FAILED if doc[Status.FAILED] else Status.COMPLETED
    doc["finished"] = now_str()
    atomic_write_json(path, doc)
    write_outputs(doc, run)
    if "link" in doc:
        stream.write("\n" + "\n".join(link_lines(doc)) + "\n")
    if plan.report and doc["results"]:
        _report(run, stream)
    write_index(run.parent)
    return run, doc


def _run_all(run: Path, doc: dict, jobs: list, overheads: list, plan: BenchPlan,
             stream: IO[str]) -> None:
    """Every job, then every overhead job; the document written after each (an interrupted
    bench keeps what was measured, marked interrupted)."""
    path = str(run / layout.BENCH)
    try:
        for v, n, vcfg in jobs:
            _run_job(run, doc, v, n, vcfg, plan, stream)
            atomic_write_json(path, doc)
        for n, vcfg in overheads:
            _run_overhead(run, doc, n, vcfg, plan, stream)
            atomic_write_json(path, doc)
    except KeyboardInterrupt:
        doc["status"] = Status.INTERRUPTED
        atomic_write_json(path, doc)
        raise


def _check(plan: BenchPlan) -> None:
    unknown = [v for v in plan.variants if v not in VARIANTS and not is_name(v)]
    if unknown:
        raise ConfigError(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}"
                          f", or a method of your own: path/to/file.py:Class (docs/methods.md)")
    for name, v in (("--steps", plan.steps), ("--trials", plan.trials)):
        if v < 1:
            raise ConfigError(f"{name} must be at least 1 (got {v})")
    if plan.warmup < 0 or plan.profile_steps < 0:
        raise ConfigError("--warmup and --profile-steps must be 0 or more")
    if any(n < 1 for n in plan.nprocs):
        raise ConfigError(f"--nproc values must be at least 1 (got {plan.nprocs})")
    _refuse_uncalibrated(plan.variants)


def _refuse_uncalibrated(variants: list[str]) -> None:
    """A bench times each method's synchronised steps against compute-only ones: one line for
    a method that cannot run those (its forward communicates: a sharded model gathers)."""
    from labkit.training.sync import load_method

    for v in variants:
        cls = load_method(VARIANTS[v]["method"] if v in VARIANTS else absolute(v))
        if not cls.calibrates:
            raise ConfigError(f"{v} cannot run the bench's compute-only steps ({cls.compute_measured}); "
                              f"time it with labkit run or labkit experiment, whose step breakdown "
                              f"says so")

def _jobs(cfg: TrainConfig, plan: BenchPlan) -> tuple[list, list]:
    """Every (variant, process count, checked config); those that cannot run are skipped with
    their reason. All bad input fails here, before a folder or a process exists."""
    jobs, skipped = [], []
    for n in plan.nprocs:
        for v in plan.variants:
            # a method of one's own: named by its key (its folder), its class by absolute path
            fields = VARIANTS[v] if v in VARIANTS else {"method": absolute(v)}
            v = v if v in VARIANTS else key_of(absolute(v))
            vcfg = dataclasses.replace(cfg, out=None, **fields)
            try:
                jobs.append((v, n, validate(vcfg, n, plan.nodes)))
            except ConfigError as e:
                skipped.append({"variant": v, "nproc": n, "reason": str(e)})
    if not jobs:
        raise ConfigError("nothing to run: " + "; ".join(f"{s['variant']} x{s['nproc']}: "
                                                         f"{s['reason']}" for s in skipped))
    return jobs, skipped


def _overhead_jobs(cfg: TrainConfig, plan: BenchPlan, skipped: list) -> list:
    """(process count, checked DDP config) of every overhead job; those that cannot run are
    added to ``skipped`` with their reason."""
    from labkit.bench.plain_loop import unsupported

    out = []
    for n in plan.nprocs:
        vcfg = dataclasses.replace(cfg, out=None, **VARIANTS[BASELINE])
        try:
            why = unsupported(vcfg)
            if why:
                raise ConfigError(why)
            out.append((n, validate(vcfg, n, plan.nodes)))
        except ConfigError as e:
            skipped.append({"variant": OVERHEAD, "nproc": n, "reason": str(e)})
    return out


def _run_overhead(run: Path, doc: dict, n: int, vcfg: TrainConfig, plan: BenchPlan,
                  stream: IO[str]) -> None:
    out = run / layout.BENCH_JOBS_DIR / f"{OVERHEAD}_x{n}"
    stream.write(f"\n=== labkit DDP against a plain DDP loop, both loading data: {n} processes ===\n")
    stream.flush()
    extra = ("--overhead", "--steps", str(plan.steps), "--trials", str(plan.trials),
             "--bench-warmup", str(plan.warmup), "--profile-steps", str(plan.profile_steps),
             *(("--control",) if plan.control else ()))
    res = _launch(vcfg, n, out, stream, OVERHEAD_MODULE, extra, plan.nodes)
    _job_link(doc, out, f"{OVERHEAD}_x{n}")
    if not res.ok:
        doc[Status.FAILED].append({"variant": OVERHEAD, "nproc": n, "error": res.message})
        stream.write(f"{OVERHEAD} x{n} FAILED: {res.message}\n")
        return
    o = read_json(out / layout.BENCH_RESULT)
    o["folder"] = str(out.relative_to(run))
    doc[OVERHEAD].append(derive_overhead(o))
    stream.write(overhead_line(o) + "\n")


def _launch(vcfg: TrainConfig, n: int, out: Path, stream: IO[str], module: str,
            extra: tuple[str, ...], nodes: Nodes) -> LaunchResult:
    """One job under torchrun (on each node of an emulated cluster): its config, checked once
    by the planner (_jobs, _overhead_jobs), written into the job's folder for its ranks to
    read, not checked again."""
    cfg = dataclasses.replace(vcfg, out=str(out))
    return launch(cfg, n, str(out), nodes, stream=stream, module=module, extra=extra,
                  resolved=write_resolved(cfg, n, str(out), nodes))


def _job_link(doc: dict, out: Path, job: str) -> Optional[dict]:
    """An emulated job's link as its launch file records it (the set link and its probe's
    goodput), added to the document's ``link.probes``; None on one machine."""
    if "link" not in doc:
        return None
    try:
        link = read_json(out / layout.launch_file(0)).get("emulated")
    except (OSError, ValueError):
        link = None
    if link:
        doc["link"]["probes"].append({"job": job, **{k: link[k] for k in (
            "ranks_per_node", "goodput_mbit", "tcp_congestion_control", "goodput_errors")
            if k in link}})
    return link


def _run_job(run: Path, doc: dict, v: str, n: int, vcfg: TrainConfig, plan: BenchPlan,
             stream: IO[str]) -> None:
    out = run / layout.BENCH_JOBS_DIR / f"{v}_x{n}"
    stream.write(f"\n=== {v}: {n} processes ===\n")
    stream.flush()
    extra = ("--steps", str(plan.steps), "--trials", str(plan.trials),
             "--bench-warmup", str(plan.warmup), "--profile-steps", str(plan.profile_steps),
             *(() if plan.pricing else ("--no-pricing",)))
    res = _launch(vcfg, n, out, stream, RANK_MODULE, extra, plan.nodes)
    link = _job_link(doc, out, f"{v}_x{n}")
    if not res.ok:
        doc[Status.FAILED].append({"variant": v, "nproc": n, "error": res.message})
        stream.write(f"{v} x{n} FAILED: {res.message}\n")
    else:
        r = read_json(out / layout.BENCH_RESULT)
        r.update(variant=v, nproc=n, folder=str(out.relative_to(run)), compress=vcfg.compress,
                 ps_mode=vcfg.ps_mode if spec(vcfg.method).serves else None,
                 method_spec=spec(vcfg.method).to_dict())  # the report names a user's method
        if link:
            r["link"] = link
        doc["results"].append(derive(r))
        stream.write("\n".join([summary_line(doc["results"][-1]),
                                 *instrument_lines(doc["results"][-1])]) + "\n")
    compare_to_ddp(doc["results"])
    if "link" in doc and doc["results"]:
        doc["link_fit"] = link_fit(doc)


def _report(run: Path, stream: IO[str]) -> None:
    report_or_why(lambda: make_report(run, kernel_name(), 3600, stream), run, stream)
