"""The lab: run folders, environment snapshots, notebook parameters, and the experiment.

An experiment = papermill runs notebooks/run_method.ipynb once per method (each spawns
torchrun through labkit.lab.launch), then notebooks/report.ipynb; everything lands in one new,
self-describing folder runs/<YYYY-MM-DD_HH-MM-SS>[_<tag>]/.
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import platform
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import IO, Any, Callable, Optional

from labkit.core.config import METHODS, VARIANTS, ConfigError, TrainConfig
from .launch import Nodes, settle_results, validate
from labkit.core.files import atomic_write_json, folder_stamp, now_str
from .kernels import kernel_name, kernel_options
from .record import portable, snapshot, write_record
from labkit.analysis.stats import rotated_order

PACKAGE_DIR = Path(__file__).resolve().parents[1]
REPO_DIR = PACKAGE_DIR.parent  # a source checkout (its git commit goes into environment.json)
# the notebooks ship as package data (labkit/notebooks links to the repository's notebooks/),
# so an installed labkit runs experiments from any folder
NOTEBOOKS = Path(str(resources.files("labkit") / "notebooks"))
# launcher parameters of run_method.ipynb besides TrainConfig's fields
LAUNCH_PARAMS = {"nproc": (int, type(None)), "nnodes": (int,), "node_rank": (int,),
                 "rdzv_endpoint": (str, type(None)), "max_restarts": (int,)}


# ------------------------------------------------------------------ defaults for this machine
def machine_defaults() -> dict:
    """Without GPUs: gloo, digits, the small ResNet-18, 4 processes, batch 32 (minutes on a
    2-core laptop). With GPUs: nccl, one process per GPU, ResNet-50, synthetic data unless a
    data dir is given (then imagefolder) -- the dataset/model/backend part is config.resolve's."""
    import torch

    if torch.cuda.is_available():
        return {"nproc": torch.cuda.device_count(), "batch_size": 64, "epochs": 3}
    return {"nproc": 4, "batch_size": 32, "epochs": 3}


# ------------------------------------------------------------------ notebook parameters
def _type_ok(value: Any, annot: str) -> bool:
    base = annot.replace("Optional[", "").rstrip("]")
    if value is None:
        return annot.startswith("Optional[")
    if base == "bool":
        return isinstance(value, bool)
    if base == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if base == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, str)


def check_params(params: dict) -> None:
    """Reject unknown names and wrong types (one message naming the parameter)."""
    fields = {f.name: str(f.type) for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(params) - set(fields) - set(LAUNCH_PARAMS))
    if unknown:
        raise ConfigError(f"unknown parameter(s): {', '.join(unknown)}; known: "
                          f"{', '.join(list(fields) + list(LAUNCH_PARAMS))}")
    for k, v in params.items():
        ok = (_type_ok(v, fields[k]) if k in fields
              else isinstance(v, LAUNCH_PARAMS[k]) and not isinstance(v, bool))
        if not ok:
            want = fields.get(k) or " or ".join(t.__name__ for t in LAUNCH_PARAMS[k])
            raise ConfigError(f"parameter {k}={v!r} has type {type(v).__name__}; expected {want}")


def notebook_params(namespace: dict) -> tuple[TrainConfig, int, Nodes]:
    """The parameters cell's variables -> (TrainConfig, processes per node, Nodes).

    Called first thing after the parameters cell, so any other plain value in the namespace
    was injected by papermill (``-p name value``) under a name the notebook does not know.
    """
    names = [f.name for f in dataclasses.fields(TrainConfig)] + list(LAUNCH_PARAMS)
    injected = {k: v for k, v in namespace.items()
                if not k.startswith("_") and k not in names and k not in ("In", "Out")
                and isinstance(v, (bool, int, float, str, list, dict, type(None)))}
    params = {k: namespace[k] for k in names if k in namespace}
    check_params({**params, **injected})
    cfg = TrainConfig(**{k: v for k, v in params.items() if k not in LAUNCH_PARAMS})
    nproc = params.get("nproc")
    nproc = machine_defaults()["nproc"] if nproc is None else nproc  # None: auto; 0 is bad input
    nodes = Nodes(params.get("nnodes", 1), params.get("node_rank", 0), params.get("rdzv_endpoint"),
                  max_restarts=params.get("max_restarts", 0))
    return cfg, nproc, nodes


# ------------------------------------------------------------------ run folders
def new_run_dir(runs_dir: str, tag: Optional[str] = None) -> Path:
    """Create runs/<YYYY-MM-DD_HH-MM-SS>[_<tag>]/; an existing folder is never reused."""
    if tag and not all(c.isalnum() or c in "-_." for c in tag):
        raise ConfigError(f"tag {tag!r} may only hold letters, digits, '-', '_' and '.'")
    root = Path(runs_dir)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create runs folder {str(root)!r}: {e.strerror}") from None
    if not os.access(root, os.W_OK):
        raise ConfigError(f"runs folder {str(root)!r} is not writable")
    while True:
        name = folder_stamp() + (f"_{tag}" if tag else "")
        d = root / name
        try:
            d.mkdir()
            break
        except FileExistsError:
            time.sleep(1.0)  # same second as another experiment: take the next one
    link = root / "latest"
    tmp = root / f".latest-{os.getpid()}"
    try:
        if tmp.is_symlink():
            tmp.unlink()
        tmp.symlink_to(name)
        os.replace(tmp, link)  # atomic switch of the pointer
    except OSError:
        pass  # a file system without symlinks: the folder itself is what matters
    return d


def _cmd(args: list[str], cwd: Path = REPO_DIR) -> Optional[str]:
    try:
        return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=20,
                              check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def environment(seed: Optional[int] = None) -> dict:
    """What ran where: git state, versions, devices, CPU, host."""
    import torch
    import torchvision

    env: dict[str, Any] = {
        "time": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "cpu": _cpu_name(), "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0], "executable": sys.executable,
        "torch": torch.__version__, "torchvision": torchvision.__version__,
        "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "nccl": None, "gpus": [], "driver": None, "seed": seed,
        "git": {"commit": _cmd(["git", "rev-parse", "HEAD"]),
                "dirty": bool(_cmd(["git", "status", "--porcelain"]))},
    }
    if torch.cuda.is_available():
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        env["gpus"] = [{"name": torch.cuda.get_device_name(i),
                        "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1)}
                       for i in range(torch.cuda.device_count())]
        env["driver"] = _cmd(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    for pkg in ("papermill", "nbconvert", "matplotlib", "numpy"):
        try:  # the installed version, without importing the package (matplotlib: 0.5 s)
            env[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:  # just not listed
            pass
    return env


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# ------------------------------------------------------------------ the experiment
@dataclass
class Experiment:
    """Parameters of `labkit experiment` (besides the training config)."""
    methods: list[str] = field(default_factory=lambda: list(METHODS))
    nproc: Optional[int] = None
    runs_dir: str = "runs"
    tag: Optional[str] = None
    cell_timeout: int = 3600
    nodes: Nodes = field(default_factory=Nodes)
    repeats: int = 1      # every method this many times, in rotated order (stats.rotated_order)
    report: bool = True   # False: results only, no report notebook (a sweep's points)


def with_absolute_paths(cfg: TrainConfig) -> TrainConfig:
    """Paths as the user meant them: relative to where the command was run, not the run folder."""
    return dataclasses.replace(
        cfg, data_dir=os.path.abspath(cfg.data_dir) if cfg.data_dir else None,
        weights=os.path.abspath(cfg.weights) if cfg.weights else None)


@dataclass
class Prepared:
    """An experiment whose every input was checked: what run_experiment needs, no folder yet."""
    cfg: TrainConfig
    exp: Experiment
    nproc: int
    resolved: dict[str, TrainConfig]
    snap: Any


def prepare(cfg: TrainConfig, exp: Experiment,
            resolved: Optional[dict[str, TrainConfig]] = None) -> Prepared:
    """All bad input fails here, in seconds, before a folder or a process exists.

    ``resolved`` ({method: config}, labkit reproduce): run exactly these recorded configs
    (checked again here) instead of deriving one per method from ``cfg``, so a reproduction
    does not re-decide what "auto" means on this machine."""
    if resolved is not None:
        exp = dataclasses.replace(exp, methods=list(resolved))
    bad = [m for m in exp.methods if m not in METHODS and m not in VARIANTS]
    if bad or not exp.methods:
        raise ConfigError(f"unknown method(s) {', '.join(bad) or '(none)'}; choose from "
                          f"{', '.join(METHODS)} or a variant: {', '.join(v for v in VARIANTS if v not in METHODS)}")
    if isinstance(exp.repeats, bool) or not isinstance(exp.repeats, int) or exp.repeats < 1:
        raise ConfigError(f"--repeats must be a whole number, 1 or more (got {exp.repeats!r})")
    nproc = machine_defaults()["nproc"] if exp.nproc is None else exp.nproc  # 0 is bad input
    cfg = with_absolute_paths(cfg)
    # a method runs with the config as given; a variant (ps-async, ...) adds its own fields
    if resolved is None:
        resolved = {m: dataclasses.replace(cfg, **({"method": m} if m in METHODS else VARIANTS[m]))
                    for m in exp.methods}
    resolved = {m: validate(c, nproc, exp.nodes) for m, c in resolved.items()}
    snap = snapshot(resolved, REPO_DIR)  # packages, code, data fingerprints: before any folder
    return Prepared(cfg, exp, nproc, resolved, snap)


def repeat_plan(methods: list[str], repeats: int, seed: int) -> list[tuple[int, int, list[str]]]:
    """[(repeat number from 1, its seed, its method order)]. Repeat i trains from seed + i - 1:
    the first repeat is exactly the run without repeats, and different seeds make the accuracy
    interval mean something (one seed cannot separate two methods) and keep the timed
    computations from being bit-identical reruns. The order rotates (ABC, BCA, CAB) so a shared
    machine's drift falls on every method alike."""
    return [(i + 1, seed + i, order) for i, order in enumerate(rotated_order(methods, repeats))]


def run_experiment(cfg: TrainConfig, exp: Experiment, stream: Optional[IO[str]] = None,
                   prepared: Optional[Prepared] = None, run: Optional[Path] = None, *,
                   before_report: Optional[Callable[[Path, dict], None]] = None) -> tuple[Path, dict]:
    """Run every method's notebook (``exp.repeats`` times each, in rotated order), then the
    report; return (run folder, status). A sweep passes its checked ``prepared`` experiment and
    the (new, empty) folder of one grid point as ``run``; labkit reproduce a ``prepared`` one
    made from the recorded configs. ``before_report(run, status)`` is called after the methods
    ran, before the report is made (reproduce writes its comparison there, so the report
    shows it)."""
    import papermill as pm

    stream = stream or sys.stdout
    p = prepared or prepare(cfg, exp)
    cfg, exp, nproc, resolved = p.cfg, p.exp, p.nproc, p.resolved
    if run is None:
        run = new_run_dir(exp.runs_dir, exp.tag).resolve()
    else:
        run.mkdir(parents=True)

    def write(name: str, doc: dict) -> None:
        # paths inside the run folder relative to it, so a copied or moved folder still works
        atomic_write_json(str(run / name), portable(doc, run))

    plan = repeat_plan(exp.methods, exp.repeats, cfg.seed)
    write("config.json", {
        "experiment": {**dataclasses.asdict(exp), "nproc": nproc},
        "train": cfg.to_dict(),
        "resolved": {m: c.to_dict() for m, c in resolved.items()},
    })
    env = {**environment(cfg.seed), **write_record(run, p.snap), "torchrun_commands": {},
           # the record's paths are relative to the run folder; each torchrun command names
           # paths relative to its method's folder (its --out), where it ran
           "paths": "relative to the run folder unless absolute; torchrun_commands run from "
                    "the method's folder"}
    write("environment.json", env)
    status: dict[str, Any] = {"run_dir": str(run), "started": now_str(),
                              "methods": {}, "status": "running", "repeats": exp.repeats,
                              "order": [order for _, _, order in plan],
                              "seeds": [seed for _, seed, _ in plan]}
    kernel = kernel_name()
    stream.write(f"experiment: {run}\n")
    for i, seed, order in plan:
        for m in order:
            # one repeat: the guide's layout, runs/<run>/<method>/; several: repeat-<i>/<method>/
            mdir = run / m if exp.repeats == 1 else run / f"repeat-{i}" / m
            mdir.mkdir(parents=True)
            entry: dict[str, Any] = {"status": "running", "notebook": str(mdir / "run_method.ipynb")}
            if exp.repeats == 1:
                status["methods"][m] = entry
            else:  # one entry per method, its repeats inside; the first problem is the method's
                agg = status["methods"].setdefault(m, {"status": "running", "repeats": []})
                agg["repeats"].append({"repeat": i, "seed": seed, **entry})
                entry = agg["repeats"][-1]
            write("experiment.json", status)
            try:
                _run_method(dataclasses.replace(resolved[m], seed=seed), mdir, nproc, exp, kernel,
                            stream, entry, pm, m if exp.repeats == 1
                            else f"{m}, repeat {i} of {exp.repeats} (seed {seed})")
            except KeyboardInterrupt:
                status["status"] = "interrupted"
                if exp.repeats > 1:
                    status["methods"][m]["status"] = "interrupted"
                write("experiment.json", status)
                raise
            if exp.repeats > 1:
                agg = status["methods"][m]
                bad = [r for r in agg["repeats"] if r["status"] != "completed"]
                agg["status"] = bad[0]["status"] if bad else ("completed" if len(agg["repeats"]) == exp.repeats else "running")
                if bad:
                    agg["error"] = f"repeat {bad[0]['repeat']}: {bad[0].get('error', '')}".strip()
            launch_file = mdir / "launch.json"
            if launch_file.exists():
                key = m if exp.repeats == 1 else f"repeat-{i}/{m}"
                env["torchrun_commands"][key] = json.loads(launch_file.read_text())["command_line"]
                write("environment.json", env)
            write("experiment.json", status)

    failed = [m for m, e in status["methods"].items() if e["status"] != "completed"]
    status["status"] = "failed" if failed else "completed"
    if before_report is not None:
        before_report(run, status)
    if exp.report:
        try:
            status["report"] = str(make_report(run, kernel, exp.cell_timeout, stream))
        except pm.PapermillExecutionError as e:  # the results are safe; say what broke the report
            status["status"] = "failed"
            status["report"] = f"report failed: {e.ename}: {e.evalue}"
            stream.write(f"\nREPORT FAILED: {e.ename}: {e.evalue} (executed notebook: {run / 'report'})\n")
    else:
        status["report"] = "not made (--no-report)"
    status["finished"] = now_str()
    write("experiment.json", status)
    return run, status


def _run_method(cfg: TrainConfig, mdir: Path, nproc: int, exp: Experiment, kernel: str,
                stream: IO[str], entry: dict, pm, label: str) -> None:
    """papermill runs run_method.ipynb for one method into ``mdir``; ``entry`` gets its status."""
    params = cfg.to_dict()
    # the kernel runs in mdir, so "." is the method's folder: the executed notebook, the
    # torchrun command line (launch.json) and the result file's config.out name no absolute
    # path, and a copied run folder still describes itself
    params.update(out=".", nproc=nproc, nnodes=exp.nodes.nnodes,
                  node_rank=exp.nodes.node_rank, rdzv_endpoint=exp.nodes.rdzv_endpoint,
                  max_restarts=exp.nodes.max_restarts)
    stream.write(f"\n=== {label}: {nproc} processes ===\n")
    stream.flush()
    t0 = time.monotonic()
    try:
        pm.execute_notebook(str(NOTEBOOKS / "run_method.ipynb"), str(mdir / "run_method.ipynb"),
                            parameters=params, kernel_name=kernel, cwd=str(mdir),
                            execution_timeout=exp.cell_timeout, progress_bar=False,
                            stdout_file=stream, stderr_file=stream, **kernel_options())
        entry["status"] = "completed"
    except pm.PapermillExecutionError as e:
        entry.update(status="failed", error=f"{e.ename}: {e.evalue}".strip())
        stream.write(f"\n{label} FAILED: {entry['error']}\n")
    except KeyboardInterrupt:
        # the kernel, and with it the launcher, is gone: mark the method's result file here
        settle_results(str(mdir), cfg.result_file, "interrupted", "interrupted by the user")
        entry["status"] = "interrupted"
        raise
    entry["wall_time"] = time.monotonic() - t0


def render_notebook(name: str, folder: Path, parameters: dict, kernel: str, timeout: int,
                    stream: IO[str], label: str = "report") -> Path:
    """Execute notebooks/<name>.ipynb into ``folder``/report/ (its kernel runs there) and export
    it as one HTML file and a PDF; return the HTML's path."""
    import papermill as pm

    from .export import export_html, export_pdf

    rdir = folder / "report"
    rdir.mkdir(exist_ok=True)
    nb_out = rdir / f"{name}.ipynb"
    pm.execute_notebook(str(NOTEBOOKS / f"{name}.ipynb"), str(nb_out),
                        parameters=parameters, kernel_name=kernel, cwd=str(rdir),
                        execution_timeout=timeout, progress_bar=False, **kernel_options())
    html = export_html(nb_out, rdir / f"{name}.html")
    pdf, msg = export_pdf(html, rdir / f"{name}.pdf")
    stream.write(f"{label}: {html}\n" + (f"pdf: {pdf}\n" if pdf else f"{msg}\n"))
    return html


def make_report(run: Path, kernel: str, timeout: int, stream: IO[str]) -> Path:
    """Execute notebooks/report.ipynb for ``run``; export it as one HTML file and a PDF."""
    # the kernel runs in run/report: ".." is the run folder, wherever it is moved
    return render_notebook("report", run, {"run_dir": ".."}, kernel, timeout, stream)
