"""`labkit sweep --slurm`: every grid point of a sweep is a Slurm job; the sweep folder and its
report are gathered when the jobs have ended.

    labkit sweep nproc=2,4 --methods ddp,allreduce --slurm
    labkit sweep nproc=4,8 --slurm --sbatch-args "--partition=gpu --gpus-per-node=8 --time=2:00:00"

One sbatch job array, one task per grid point: each task runs its point's experiment, as
`labkit sweep` runs it on one machine, into the point's folder of the sweep. Then a gather job,
which Slurm starts once every task has ended in any state (``--dependency=afterany``), records
each point's outcome in sweep.json (with the job's Slurm state) and renders the sweep report of
the points that completed. This command submits both and waits for the gather job, printing
each job's state as it changes; Ctrl-C stops the waiting, not the jobs.

Plain sbatch, not submitit: nothing to install, and the two scripts in ``<sweep>/slurm/`` are
ordinary batch scripts one can read, and submit again. The jobs run ``python -m
labkit.orchestrate.slurm point|gather <sweep folder> ...`` with the Python that submitted them, so
the nodes must see the same installation and the sweep folder (a shared filesystem), as
slurm/labkit.sbatch needs too.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any, Optional

from labkit.core import layout
from labkit.core.config import ConfigError, TrainConfig
from labkit.core.files import atomic_write_json
from labkit.core.log import transcript
from labkit.core.run_folder import RunFolder
from labkit.core.status import Status, experiment_status
from labkit.launch.launch_params import Nodes

from .experiment import Experiment, prepare, run_experiment
from .sweep import finish, new_sweep, prepare_points, sweep

log = logging.getLogger(__name__)

POLL_S = 2.0  # seconds between two looks at the queue while waiting
# Slurm's job states that mean the job has ended (squeue --states=all, scontrol show job)
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL",
         "DEADLINE", "OUT_OF_MEMORY")
# each point's job: one node to itself (--exclusive), so its timings are its own; never
# requeued (a rerun would find its folder taken); --sbatch-args adds to these
POINT_OPTIONS = ("--job-name=labkit-sweep", "--nodes=1", "--ntasks=1", "--exclusive", "--no-requeue")
GATHER_OPTIONS = ("--job-name=labkit-sweep-report", "--nodes=1", "--ntasks=1", "--no-requeue")
POINT_SCRIPT = """#!/bin/bash
{header}
#SBATCH --array=0-{last}
#SBATCH --output={logs}/point-%a.out
# grid point $SLURM_ARRAY_TASK_ID of {root} (points.json beside this script)
exec {python} -u -m labkit.orchestrate.slurm point {root} "$SLURM_ARRAY_TASK_ID"
"""
GATHER_SCRIPT = """#!/bin/bash
{header}
#SBATCH --output={logs}/gather.out
# after every point's job has ended: sweep.json's outcomes and the sweep report of {root}
exec {python} -u -m labkit.orchestrate.slurm gather {root}
"""


def require_sbatch() -> None:
    """Slurm's client commands on PATH, or one line saying what is missing."""
    missing = [c for c in ("sbatch", "squeue", "scontrol") if shutil.which(c) is None]
    if missing:
        raise ConfigError(f"--slurm needs Slurm's {', '.join(missing)} on PATH (not found): run it "
                          f"on a Slurm login node, or drop --slurm to run the points here")


def sweep_here_or_on_slurm(cfg: TrainConfig, exp: Experiment, grid: dict[str, list],
                           slurm: bool = False, sbatch_args: Optional[str] = None) -> tuple[Path, dict]:
    """`labkit sweep`: the points one after another here, or (``slurm``) as Slurm jobs."""
    if not slurm:
        if sbatch_args is not None:
            raise ConfigError("--sbatch-args goes with --slurm")
        return sweep(cfg, exp, grid)
    return sweep_on_slurm(cfg, exp, grid, sbatch_args)


def sweep_on_slurm(cfg: TrainConfig, exp: Experiment, grid: dict[str, list],
                   sbatch_args: Optional[str] = None,
                   stream: Optional[IO[str]] = None) -> tuple[Path, dict]:
    """Check every point, submit them as one job array and the gather job, wait for it."""
    stream = stream or transcript(__name__)
    require_sbatch()
    if exp.nodes.multi:
        raise ConfigError("--slurm runs each grid point on one node; drop --nnodes and "
                          "--rdzv-endpoint (slurm/labkit.sbatch runs one method on several)")
    try:
        extra = shlex.split(sbatch_args or "")
    except ValueError as e:
        raise ConfigError(f"--sbatch-args {sbatch_args!r}: {e}") from None
    points = prepare_points(cfg, exp, grid)
    # the controller checks the jobs' options (partition, GPUs, ...) before any folder exists
    _sbatch(["--test-only", *POINT_OPTIONS, f"--array=0-{len(points) - 1}", *extra, "--wrap=true"])
    root, doc = new_sweep(exp, grid, points)
    logs = root / layout.SLURM_DIR
    logs.mkdir(parents=True)
    atomic_write_json(str(logs / layout.SLURM_POINTS), {
        "cell_timeout": exp.cell_timeout,
        "points": [{"dir": e["dir"], "train": p.cfg.to_dict(), "experiment": dataclasses.asdict(p.exp)}
                   for e, (_, p) in zip(doc["points"], points)]})
    try:
        _submit_all(root, doc, extra)
    except ConfigError:
        _discard(root)
        raise
    atomic_write_json(str(root / layout.SWEEP), doc)
    jobs = doc["slurm"]
    # the gather job was held until sweep.json, which it reads, named the jobs
    released = subprocess.run(["scontrol", "release", jobs["gather_job"]], capture_output=True,
                              text=True, timeout=120)
    if released.returncode != 0:
        subprocess.run(["scancel", jobs["array_job"], jobs["gather_job"]], capture_output=True)
        _discard(root)
        raise ConfigError(f"scontrol release {jobs['gather_job']} failed: "
                          f"{(released.stderr.strip().splitlines() or ['?'])[-1]}")
    stream.write(f"sweep: {root} ({len(points)} points): Slurm job array {jobs['array_job']}, "
                 f"then job {jobs['gather_job']} gathers them (logs: {logs})\n")
    return root, wait(root, doc, stream)


def _submit_all(root: Path, doc: dict, extra: list[str]) -> None:
    logs = root / layout.SLURM_DIR
    fill = {"last": len(doc["points"]) - 1, "logs": shlex.quote(str(logs)),
            "root": shlex.quote(str(root)), "python": shlex.quote(sys.executable)}
    for name, text, opts in (("point.sbatch", POINT_SCRIPT, POINT_OPTIONS),
                             ("gather.sbatch", GATHER_SCRIPT, GATHER_OPTIONS)):
        header = "\n".join(f"#SBATCH {o}" for o in opts)
        (logs / name).write_text(text.format(header=header, **fill))
    array = _sbatch([*extra, str(logs / "point.sbatch")])
    try:
        gather = _sbatch(["--hold", f"--dependency=afterany:{array}", str(logs / "gather.sbatch")])
    except ConfigError:
        subprocess.run(["scancel", array], capture_output=True)
        raise
    doc["slurm"] = {"array_job": array, "gather_job": gather, "sbatch_args": extra,
                    "scripts": [f"{layout.SLURM_DIR}/point.sbatch", f"{layout.SLURM_DIR}/gather.sbatch"]}
    for i, entry in enumerate(doc["points"]):
        entry.update(job=f"{array}_{i}", log=f"{layout.SLURM_DIR}/point-{i}.out")


def _discard(root: Path) -> None:
    """A sweep folder whose jobs could not be submitted: gone, and runs/latest with it."""
    shutil.rmtree(root, ignore_errors=True)
    latest = root.parent / layout.LATEST
    if latest.is_symlink() and Path(os.readlink(latest)).name == root.name:
        latest.unlink()


def _sbatch(args: list[str]) -> str:
    """Submit; the job's id, or sbatch's own complaint in one line."""
    try:
        proc = subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True,
                              timeout=120)
    except subprocess.TimeoutExpired:
        raise ConfigError("sbatch did not answer within 120 s: is the Slurm controller up?") from None
    if proc.returncode != 0:
        said = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
        raise ConfigError(f"sbatch refused the sweep's jobs: {said}")
    return proc.stdout.strip().split(";")[0]


# ------------------------------------------------------------------ waiting for the jobs
def job_states(ids: list[str]) -> Optional[dict[str, str]]:
    """{job id (array tasks as <array>_<i>): Slurm state} of jobs the controller still knows;
    None when it cannot be asked."""
    proc = subprocess.run(["squeue", "-h", "-r", "--states=all", "-j", ",".join(ids),
                           "-o", "%i %T"], capture_output=True, text=True)
    if proc.returncode != 0:
        return {} if "Invalid job id" in proc.stderr else None
    return dict(line.split()[:2] for line in proc.stdout.splitlines() if len(line.split()) >= 2)


def wait(root: Path, doc: dict, stream: IO[str], poll: float = POLL_S) -> dict:
    """Until the gather job has ended, print each job's state as it changes; then sweep.json
    as the gather job left it (gathered here, when that job could not do it)."""
    jobs = doc["slurm"]
    names = {e["job"]: f"point {e['name']}" for e in doc["points"]}
    names[jobs["gather_job"]] = "gather + sweep report"
    seen: dict[str, str] = {}
    failures = 0
    try:
        while True:
            states = job_states([jobs["array_job"], jobs["gather_job"]])
            failures = 0 if states is not None else failures + 1
            if failures > 30:
                stream.write("sweep: the Slurm controller does not answer; stopped waiting\n")
                break
            for job, state in sorted((states or {}).items()):
                if job in names and seen.get(job) != state:
                    seen[job] = state
                    stream.write(f"sweep: {names[job]} (Slurm job {job}): {state}\n")
            last = (states or {}).get(jobs["gather_job"])
            if states is not None and (last is None or last in ENDED):
                break
            time.sleep(poll)
    except KeyboardInterrupt:
        stream.write(f"\nlabkit sweep: stopped waiting; the jobs go on (scancel "
                     f"{jobs['array_job']} {jobs['gather_job']} stops them), and the sweep "
                     f"report will be in {root / layout.REPORT_DIR}\n")
        raise SystemExit(130) from None
    done = RunFolder(root).read(layout.SWEEP)
    if not Status(done["status"]).ended:  # the gather job did not finish its work
        done = gather(root, stream)
    return done


# ------------------------------------------------------------------ in the jobs
def _load_point(root: Path, index: int) -> tuple[Path, TrainConfig, Experiment]:
    spec = RunFolder(root).read(f"{layout.SLURM_DIR}/{layout.SLURM_POINTS}")["points"][index]
    e = spec["experiment"]
    return root / spec["dir"], TrainConfig(**spec["train"]), Experiment(**{**e, "nodes": Nodes.of_record(e["nodes"])})


def run_point(root: Path, index: int, stream: IO[str]) -> int:
    """One array task: its grid point's experiment, checked again on this node."""
    run, cfg, exp = _load_point(root, index)
    prepared = prepare(cfg, exp)
    _, status = run_experiment(prepared.cfg, prepared.exp, stream, prepared=prepared, run=run)
    return 0 if status["status"] == Status.COMPLETED else 1


def _array_states(array: str) -> dict[int, str]:
    """{array task index: its Slurm state} as the controller recorded them."""
    proc = subprocess.run(["scontrol", "show", "job", "-o", array], capture_output=True, text=True)
    out = {}
    for line in proc.stdout.splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        if fields.get("ArrayTaskId", "").isdigit():
            out[int(fields["ArrayTaskId"])] = fields.get("JobState", "?")
    return out


def _outcome(root: Path, entry: dict, state: str) -> dict[str, Any]:
    """A point's status and error from its experiment.json; what Slurm said when the job
    ended before its experiment did."""
    point = RunFolder(root / entry["dir"])
    out: dict[str, Any] = {"slurm_state": state}
    st = experiment_status(point.read(layout.EXPERIMENT)) if point.has(layout.EXPERIMENT) else None
    if st is not None and st not in (Status.RUNNING, Status.STOPPED):
        out["status"] = st
        errors = [f"{m}: {e['error']}" for m, e in point.read(layout.EXPERIMENT)["methods"].items()
                  if e.get("error")]
        if errors:
            out["error"] = "; ".join(errors)
        return out
    log = root / entry.get("log", "")
    last = [l for l in log.read_text(errors="replace").splitlines() if l.strip()][-1:] \
        if log.is_file() else []
    began = "before its experiment ended" if st is not None else "before its experiment began"
    out.update(status=Status.FAILED, error=f"Slurm job {entry.get('job')} ended {state} {began}"
               + (f"; its log ({entry.get('log')}) ends: {last[0].strip()}" if last else ""))
    return out


def gather(root: Path, stream: IO[str]) -> dict:
    """After every point's job: record each point's outcome, then the sweep report."""
    doc = RunFolder(root).read(layout.SWEEP)
    spec = RunFolder(root).read(f"{layout.SLURM_DIR}/{layout.SLURM_POINTS}")
    states = _array_states(doc["slurm"]["array_job"])
    for i, entry in enumerate(doc["points"]):
        entry.update(_outcome(root, entry, states.get(i, "UNKNOWN")))
        stream.write(f"sweep point {entry['name']} (Slurm job {entry.get('job')}, "
                     f"{entry['slurm_state']}): {entry['status']}\n")
    finish(root, doc, spec["cell_timeout"], stream)
    return doc


def _sigterm(signum, frame):
    raise KeyboardInterrupt  # scancel: the experiment stops its children and marks itself


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m labkit.orchestrate.slurm point ROOT INDEX`` | ``gather ROOT`` (the jobs' scripts)."""
    argv = sys.argv[1:] if argv is None else argv
    signal.signal(signal.SIGTERM, _sigterm)
    try:
        if argv[:1] == ["point"] and len(argv) == 3:
            return run_point(Path(argv[1]), int(argv[2]), transcript(__name__))
        if argv[:1] == ["gather"] and len(argv) == 2:
            # the job did its work when the report exists, even of a sweep with failed points
            doc = gather(Path(argv[1]), transcript(__name__))
            return 1 if str(doc.get("report", "")).startswith("report failed") else 0
    except ConfigError as e:
        log.error("labkit sweep --slurm: error: %s", e)
        return 2
    except KeyboardInterrupt:
        log.error("labkit sweep --slurm: interrupted; every child process was stopped")
        return 130
    log.error("usage: python -m labkit.orchestrate.slurm point SWEEP_DIR INDEX | gather SWEEP_DIR")
    return 2


if __name__ == "__main__":
    sys.exit(main())
