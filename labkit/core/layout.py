"""Every file and folder name of a run folder, in one place.

    runs/
      latest -> <the newest run folder>
      <YYYY-MM-DD_HH-MM-SS>[_<tag>]/           one experiment (labkit experiment, reproduce)
        config.json  environment.json  experiment.json  requirements.lock  [code.diff]
        [reproduction.json]                      labkit reproduce: the comparison
        <method>/                                one per method; with --repeats N:
          results_<...>.json                     repeat-<i>/<method>/
          run_method.ipynb  resolved.json  launch.json  train.log  checkpoint.pt  final_model.pt
          logs/                                  torchrun's per-rank logs, torchrun.log
        report/                                  report.ipynb .html .pdf,
          plots/  performance_report.txt         the guide's plots and text report
      <...>_bench/    bench.json bench.txt bench.png  bench/<variant>_x<n>/bench_result.json
      <...>_sweep/    sweep.json  <point>/ (an experiment each)  report/ (scaling.png ...)
                      [slurm/]  --slurm: points.json, the jobs' scripts and their logs

Paths stored in a run folder's JSON that point inside it are relative to it (:func:`portable`),
so a copied or moved folder still works; readers resolve them with :func:`resolve_in_run`.
"""
from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any, Optional

from .files import folder_stamp

# ---- a run folder
RUNS = "runs"                          # the project's folder of run folders (runs_root)
LATEST = "latest"                      # runs/latest: a link to the newest run folder
RUNS_INDEX = "index.html"              # runs/index.html: every run folder (labkit runs)
CONFIG = "config.json"                 # the experiment's configs (labkit reproduce reruns them)
ENVIRONMENT = "environment.json"       # what ran where (labkit.runs.record)
EXPERIMENT = "experiment.json"         # the methods' statuses, the run order
LOCK = "requirements.lock"             # every installed distribution
DIFF = "code.diff"                     # uncommitted changes of the code that ran
REPRODUCTION = "reproduction.json"     # a reproduction's verdicts against the recorded run
REPORT_DIR = "report"                  # the executed report notebook, HTML and PDF
PLOTS_DIR = "plots"                    # under the report folder: the guide's five plots and more
TEXT_REPORT = "performance_report.txt"
REPEAT_PREFIX = "repeat-"              # repeat-<i>/<method>/ with --repeats

# ---- a method's folder (its --out)
METHOD_NOTEBOOK = "run_method.ipynb"
CHECKPOINT = "checkpoint.pt"           # after every epoch: what --resume continues from
FINAL_MODEL = "final_model.pt"
TRAIN_LOG = "train.log"                # rank 0's lines for people
LOGS_DIR = "logs"                      # torchrun's per-rank logs
TORCHRUN_LOG = "torchrun.log"          # the command and everything torchrun printed
RANK_STDERR = "stderr.log"             # torchrun's: logs/.../attempt_<k>/<local rank>/stderr.log

# ---- a bench and a sweep
BENCH = "bench.json"
BENCH_TEXT = "bench.txt"
BENCH_PLOT = "bench.png"
BENCH_JOBS_DIR = "bench"               # bench/<variant>_x<nproc>/
BENCH_RESULT = "bench_result.json"     # one job's measurements, by its rank 0
SWEEP = "sweep.json"
SLURM_DIR = "slurm"                    # a sweep with --slurm: the jobs' scripts, specs and logs
SLURM_POINTS = "points.json"           # under it: each grid point's checked parameters


def launch_file(node_rank: int = 0) -> str:
    """launch.json, or launch_node<k>.json for node k > 0 (nodes may share one --out)."""
    return "launch.json" if node_rank == 0 else f"launch_node{node_rank}.json"


def resolved_file(node_rank: int = 0) -> str:
    """resolved.json (labkit.core.resolved), or resolved_node<k>.json for node k > 0: each node
    resolves for its own machine, and nodes may share one --out."""
    return "resolved.json" if node_rank == 0 else f"resolved_node{node_rank}.json"


#: a run folder's name: the time it was made (files.folder_stamp) and an optional _<tag>
RUN_NAME = re.compile(r"^(\d{4}-\d{2}-\d{2})_(\d{2})-(\d{2})-(\d{2})(?:_(.+))?$")


def run_name(name: str) -> tuple[Optional[str], str]:
    """(when the folder was made, "YYYY-MM-DD HH:MM:SS", and its tag) from a run folder's name;
    (None, "") for a folder named by hand."""
    m = RUN_NAME.match(name)
    return (f"{m.group(1)} {m.group(2)}:{m.group(3)}:{m.group(4)}", m.group(5) or "") if m else (None, "")


def run_folders(runs_dir: str | os.PathLike) -> list[Path]:
    """Every run folder directly under ``runs_dir`` (not the ``latest`` link), oldest first:
    by the time in its name, which never changes (a folder's mtime moves whenever a report or
    a re-run method is written into it, so it orders only the folders named by hand), then by
    name. A missing ``runs_dir`` has none."""
    root = Path(runs_dir)
    if not root.is_dir():
        return []

    def made(p: Path) -> float:
        when, _ = run_name(p.name)
        return time.mktime(time.strptime(when, "%Y-%m-%d %H:%M:%S")) if when else p.stat().st_mtime

    return sorted((p for p in root.iterdir() if p.is_dir() and not p.is_symlink()),
                  key=lambda p: (made(p), p.name))


def method_dir(run: Path, method: str, repeat: int = 1, repeats: int = 1) -> Path:
    """A method's folder: <run>/<method>/, or <run>/repeat-<i>/<method>/ with repeats."""
    return run / method if repeats == 1 else run / f"{REPEAT_PREFIX}{repeat}" / method


def repeat_dirs(run: Path) -> list[Path]:
    """repeat-1/, repeat-2/, ... of a run with --repeats, in order; [] without repeats."""
    n = len(REPEAT_PREFIX)
    dirs = [d for d in run.glob(REPEAT_PREFIX + "*") if d.is_dir() and d.name[n:].isdigit()]
    return sorted(dirs, key=lambda d: int(d.name[n:]))


def project_dir(package: Optional[Path] = None) -> Optional[Path]:
    """The project this labkit belongs to: the folder around the ``labkit`` package (default:
    this one) that holds notebooks/, labkit/ and pyproject.toml, as a checkout or an editable
    install has; None for an installed labkit (site-packages holds no project)."""
    root = (package or Path(__file__).resolve().parents[1]).parent
    return root if all((root / m).exists() for m in ("pyproject.toml", "notebooks", "labkit")) else None


def runs_root(runs_dir: Optional[str | os.PathLike] = None, package: Optional[Path] = None) -> Path:
    """Where run folders go, the same from any working directory (a notebook under papermill
    runs wherever the shell is): ``runs_dir`` when given (relative to the current folder), else
    the project's runs/, else, for an installed labkit with no project, the current folder's."""
    if runs_dir:
        return Path(os.path.abspath(runs_dir))
    return (project_dir(package) or Path.cwd()) / RUNS


def run_or_latest(run_dir: Optional[str | os.PathLike] = None) -> Path:
    """The run folder a notebook reads: ``run_dir`` when given (relative to the current folder),
    else the project's runs/latest (:func:`runs_root`), resolved, from any working directory."""
    return Path(run_dir).resolve() if run_dir else (runs_root() / LATEST).resolve()


def default_out(method: str, runs_dir: str | os.PathLike = "runs") -> str:
    """A new folder under ``runs_dir`` for a run started without --out (never an existing one)."""
    base = os.path.join(runs_dir, folder_stamp() + f"_{method}")
    out, i = base, 1
    while os.path.exists(out):
        i += 1
        out = f"{base}-{i}"
    return out


# ------------------------------------------------------------------ portable paths
def portable(doc: Any, run_dir: str | os.PathLike) -> Any:
    """``doc`` with every path inside ``run_dir`` made relative to it (also inside command
    lines); paths elsewhere are kept as they are. For writing run-folder JSON files."""
    root = os.path.abspath(run_dir).rstrip(os.sep)
    real = os.path.realpath(root)

    def fix(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: fix(x) for k, x in v.items()}
        if isinstance(v, list):
            return [fix(x) for x in v]
        if not isinstance(v, str):
            return v
        for r in {root, real}:
            if v == r:
                return "."
            if v.startswith(r + os.sep):
                return v[len(r) + 1:]
            v = v.replace(r + os.sep, "")  # inside a command line
        return v

    return fix(doc)


def resolve_in_run(run_dir: str | os.PathLike, path: Optional[str]) -> Optional[Path]:
    """A path read from a run folder's JSON: relative ones are relative to that folder, wherever
    it lies now."""
    if path is None:
        return None
    p = Path(path)
    return p if p.is_absolute() else Path(run_dir) / p
