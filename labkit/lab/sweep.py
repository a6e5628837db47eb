"""`labkit sweep`, the launcher side: one experiment per point of a parameter grid, in one
folder, then the scaling report.

    labkit sweep nproc=2,3,4 --methods ddp,allreduce --epochs 1      # a scaling study
    labkit sweep nproc=2,4 batch_size=16,32                         # a 2 x 2 grid

Every grid point is checked (names, values, and the whole experiment it makes, as `labkit
experiment` checks it) before any folder or process exists; then papermill runs each point's
experiment into ``runs/<date>_<time>_sweep/<point>/``, a normal experiment folder, and
notebooks/sweep.ipynb renders ``report/sweep.html``: throughput against processes with the
ideal linear line, and scaling efficiency with 95% confidence intervals
(labkit.analysis.report.sweep, which also serves `labkit report <sweep folder>`).
"""
from __future__ import annotations

import dataclasses
import itertools
import re
import sys
from pathlib import Path
from typing import IO, Any, Optional

from labkit.core.config import ConfigError, TrainConfig
from labkit.core.files import atomic_write_json, now_str
from labkit.analysis.report.sweep import SWEEP_FILE

# what a grid may vary: the process count and the training config; the method is --methods,
# and the output folder, resuming and the nodes are the sweep's own business
NOT_SWEPT = ("method", "out", "resume")


def _convert(name: str, text: str, annot: str) -> Any:
    base = annot.replace("Optional[", "").rstrip("]")
    if annot.startswith("Optional[") and text.lower() in ("none", "auto"):
        return None
    if base == "int":
        return int(text)
    if base == "float":
        return float(text)
    if base == "bool":
        if text.lower() in ("true", "1", "yes", "on"):
            return True
        if text.lower() in ("false", "0", "no", "off"):
            return False
        raise ValueError(text)
    return text


def sweepable() -> dict[str, str]:
    """Parameter -> its type, for every parameter a grid may vary."""
    fields = {f.name: str(f.type) for f in dataclasses.fields(TrainConfig) if f.name not in NOT_SWEPT}
    return {"nproc": "int", **fields}


def parse_grid(specs: list[str] | dict) -> dict[str, list]:
    """``["nproc=2,3", "batch_size=16,32"]`` (or a YAML mapping of name to a list or a
    comma-separated string) -> {"nproc": [2, 3], "batch_size": [16, 32]}, values typed."""
    known = sweepable()
    items = list(specs.items()) if isinstance(specs, dict) else []
    for spec in [] if isinstance(specs, dict) else specs:
        name, sep, values = spec.partition("=")
        if not sep:
            raise ConfigError(f"sweep {spec!r} is not NAME=V1,V2,... (e.g. nproc=2,4)")
        items.append((name, values))
    grid: dict[str, list] = {}
    for name, values in items:
        name = name.strip().replace("-", "_")
        if name not in known:
            raise ConfigError(f"cannot sweep over unknown parameter {name!r}; known: {', '.join(known)}")
        if name in grid:
            raise ConfigError(f"{name} is swept twice")
        texts = [str(v).strip() for v in (values if isinstance(values, list) else str(values).split(","))]
        try:
            vals = [_convert(name, t, known[name]) for t in texts if t]
        except ValueError:
            raise ConfigError(f"sweep {name}={values}: a value does not parse as "
                              f"{known[name].replace('Optional[', '').rstrip(']')}") from None
        if not vals:
            raise ConfigError(f"sweep {name}= has no values")
        if len(set(map(repr, vals))) != len(vals):
            raise ConfigError(f"sweep {name}={values} repeats a value")
        grid[name] = vals
    if not grid:
        raise ConfigError("nothing to sweep: give NAME=V1,V2,... (e.g. nproc=2,4)")
    return grid


def point_name(params: dict) -> str:
    """nproc=2, batch_size=16 -> 'nproc-2_batch_size-16' (a folder name)."""
    return "_".join(f"{k}-{re.sub(r'[^A-Za-z0-9.]+', '-', str(v))}" for k, v in params.items())


def sweep(cfg: TrainConfig, exp, grid: dict[str, list],
          stream: Optional[IO[str]] = None) -> tuple[Path, dict]:
    """Check every point, then run them one after another; write the sweep report."""
    from .kernels import kernel_name
    from .experiment import new_run_dir, prepare, run_experiment

    stream = stream or sys.stdout
    points = []
    for values in itertools.product(*grid.values()):
        params = dict(zip(grid, values))
        train = {k: v for k, v in params.items() if k != "nproc"}
        pexp = dataclasses.replace(exp, nproc=params.get("nproc", exp.nproc))
        try:
            prepared = prepare(dataclasses.replace(cfg, **train), pexp)
        except ConfigError as e:
            raise ConfigError(f"sweep point {point_name(params)}: {e}") from None
        points.append((params, prepared))

    root = new_run_dir(exp.runs_dir, exp.tag or "sweep").resolve()
    doc: dict[str, Any] = {"grid": grid, "started": now_str(), "status": "running",
                           "methods": list(exp.methods), "repeats": exp.repeats,
                           "points": [{"name": point_name(p), "params": p, "dir": point_name(p),
                                       "status": "pending"} for p, _ in points]}
    atomic_write_json(str(root / SWEEP_FILE), doc)
    stream.write(f"sweep: {root} ({len(points)} points)\n")
    for entry, (params, prepared) in zip(doc["points"], points):
        stream.write(f"\n##### sweep point {entry['name']} #####\n")
        entry["status"] = "running"
        atomic_write_json(str(root / SWEEP_FILE), doc)
        try:
            _, status = run_experiment(prepared.cfg, prepared.exp, stream, prepared=prepared,
                                       run=root / entry["dir"])
        except KeyboardInterrupt:
            entry["status"] = doc["status"] = "interrupted"
            atomic_write_json(str(root / SWEEP_FILE), doc)
            raise
        entry["status"] = status["status"]
        atomic_write_json(str(root / SWEEP_FILE), doc)

    doc["status"] = "completed" if all(p["status"] == "completed" for p in doc["points"]) else "failed"
    import papermill as pm
    try:
        doc["report"] = str(make_sweep_report(root, kernel_name(), exp.cell_timeout, stream).relative_to(root))
    except pm.PapermillExecutionError as e:
        doc["status"] = "failed"
        doc["report"] = f"report failed: {e.ename}: {e.evalue}"
        stream.write(f"\nSWEEP REPORT FAILED: {e.ename}: {e.evalue}\n")
    doc["finished"] = now_str()
    atomic_write_json(str(root / SWEEP_FILE), doc)
    return root, doc


def make_sweep_report(root: Path, kernel: str, timeout: int, stream: IO[str]) -> Path:
    """Execute notebooks/sweep.ipynb for the sweep folder; export HTML and PDF."""
    from .experiment import render_notebook

    # the kernel runs in root/report: ".." is the sweep folder, wherever it is moved
    return render_notebook("sweep", root, {"sweep_dir": ".."}, kernel, timeout, stream,
                           "sweep report")
