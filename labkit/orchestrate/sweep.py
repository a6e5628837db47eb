"""`labkit sweep`, the launcher side: one experiment per point of a parameter grid, in one
folder, then the scaling report.

    labkit sweep nproc=2,3,4 --methods ddp,allreduce --epochs 1      # a scaling study
    labkit sweep nproc=2,4 batch_size=16,32                         # a 2 x 2 grid
    labkit sweep link=100mbit,1gbit,unshaped --emulate-nodes 2      # the link (docs/sweep.md)

Every grid point is checked (names, values, and the whole experiment it makes, as `labkit
experiment` checks it) before any folder or process exists; then papermill runs each point's
experiment into ``runs/<date>_<time>_sweep/<point>/``, a normal experiment folder, and
notebooks/sweep.ipynb renders ``report/sweep.html``: throughput against processes with the
ideal linear line, and scaling efficiency with 95% confidence intervals
(labkit.report.sweep, which also serves `labkit report <sweep folder>`). With
``--slurm``, labkit.orchestrate.slurm runs each point as a Slurm job instead, and gathers them.
"""
from __future__ import annotations

import dataclasses
import itertools
import re
from pathlib import Path
from typing import IO, Any, Optional

from labkit.core import layout, params
from labkit.core.config import ConfigError, TrainConfig
from labkit.core.files import atomic_write_json, now_str
from labkit.core.log import transcript
from labkit.core.params import FieldType
from labkit.core.status import Status
from labkit.launch.cluster import parse_link
from labkit.launch.launch_params import Nodes
from labkit.runs.runs_dir import write_index

from .experiment import Prepared, prepare, run_experiment
from .render import make_sweep_report, report_or_why

# what a grid may vary: the process count, an emulated cluster's nodes and link, and the
# training config; the method is --methods, and the output folder, resuming and real nodes
# are the sweep's own business
NOT_SWEPT = ("method", "out", "resume")
#: the launcher's parameters a grid may vary (the rest of a point is its TrainConfig)
LAUNCH_SWEPT = ("nproc", "emulate_nodes", "link")


def sweepable() -> dict[str, FieldType]:
    """Parameter -> its type, for every parameter a grid may vary."""
    fields = {k: t for k, t in params.field_types(TrainConfig).items() if k not in NOT_SWEPT}
    nodes = params.field_types(Nodes)
    return {"nproc": FieldType("nproc", int, False, None),
            **{k: nodes[k] for k in LAUNCH_SWEPT[1:]}, **fields}


def parse_grid(specs: list[str] | dict) -> dict[str, list]:
    """``["nproc=2,3", "batch_size=16,32"]`` (or a YAML mapping of name to a list or a
    comma-separated string) -> {"nproc": [2, 3], "batch_size": [16, 32]}, values typed."""
    items = list(specs.items()) if isinstance(specs, dict) else []
    for spec in [] if isinstance(specs, dict) else specs:
        name, sep, values = spec.partition("=")
        if not sep:
            raise ConfigError(f"sweep {spec!r} is not NAME=V1,V2,... (e.g. nproc=2,4)")
        items.append((name, values))
    grid: dict[str, list] = {}
    for name, values in items:
        name = name.strip().replace("-", "_")
        if name in grid:
            raise ConfigError(f"{name} is swept twice")
        grid[name] = _values(name, values)
    if not grid:
        raise ConfigError("nothing to sweep: give NAME=V1,V2,... (e.g. nproc=2,4)")
    return grid


def _values(name: str, values) -> list:
    known = sweepable()
    if name not in known:
        raise ConfigError(f"cannot sweep over unknown parameter {name!r}; known: {', '.join(known)}")
    texts = [str(v).strip() for v in (values if isinstance(values, list) else str(values).split(","))]
    try:
        vals = [known[name].parse(t) for t in texts if t]
    except ValueError:
        want = " | ".join(known[name].choices or ()) or known[name].base.__name__
        raise ConfigError(f"sweep {name}={values}: a value does not parse as {want}") from None
    if not vals:
        raise ConfigError(f"sweep {name}= has no values")
    if name == "link":  # each a link as --link takes it; 1gbit and 1000mbit are one link
        vals = [v.lower() for v in vals]
        try:
            same = [parse_link(v) for v in vals]
        except ConfigError as e:
            raise ConfigError(f"sweep link={values}: {e}") from None
    else:
        same = list(map(repr, vals))
    if len(set(same)) != len(vals):
        raise ConfigError(f"sweep {name}={values} repeats a value")
    return vals


def point_name(params: dict) -> str:
    """nproc=2, batch_size=16 -> 'nproc-2_batch_size-16' (a folder name)."""
    return "_".join(f"{k}-{re.sub(r'[^A-Za-z0-9.]+', '-', str(v))}" for k, v in params.items())


def sweep(cfg: TrainConfig, exp, grid: dict[str, list],
          stream: Optional[IO[str]] = None) -> tuple[Path, dict]:
    """Check every point, then run them one after another; write the sweep report."""
    stream = stream or transcript(__name__)
    points = prepare_points(cfg, exp, grid)
    root, doc = new_sweep(exp, grid, points)

    def write() -> None:
        atomic_write_json(str(root / layout.SWEEP), doc)

    write()
    stream.write(f"sweep: {root} ({len(points)} points)\n")
    for entry, (_, prepared) in zip(doc["points"], points):
        stream.write(f"\n##### sweep point {entry['name']} #####\n")
        entry["status"] = Status.RUNNING
        write()
        try:
            _, status = run_experiment(prepared.cfg, prepared.exp, stream, prepared=prepared,
                                       run=root / entry["dir"])
        except KeyboardInterrupt:
            entry["status"] = doc["status"] = Status.INTERRUPTED
            write()
            raise
        entry["status"] = status["status"]
        write()
    finish(root, doc, exp.cell_timeout, stream)
    return root, doc


def new_sweep(exp, grid: dict[str, list], points: list[tuple[dict, Prepared]]) -> tuple[Path, dict]:
    """The sweep's new folder and its sweep.json document (not written yet): every point
    pending."""
    from labkit.runs.runs_dir import new_run_dir

    root = new_run_dir(exp.runs_dir, exp.tag or "sweep").resolve()
    doc: dict[str, Any] = {"grid": grid, "started": now_str(), "status": Status.RUNNING,
                           "methods": list(exp.methods), "repeats": exp.repeats,
                           "points": [{"name": point_name(p), "params": p, "dir": point_name(p),
                                       "status": Status.PENDING} for p, _ in points]}
    return root, doc


def finish(root: Path, doc: dict, cell_timeout: int, stream: IO[str]) -> None:
    """Every point has ended: the sweep's status (complete when all points are), its report
    (of the points that completed), sweep.json, and runs/index.html."""
    from .kernels import kernel_name

    ok = all(p["status"] == Status.COMPLETED for p in doc["points"])
    doc["status"] = Status.COMPLETED if ok else Status.FAILED
    _report(root, doc, kernel_name(), cell_timeout, stream)
    doc["finished"] = now_str()
    atomic_write_json(str(root / layout.SWEEP), doc)
    write_index(root.parent)


def prepare_points(cfg: TrainConfig, exp, grid: dict[str, list]) -> list[tuple[dict, Prepared]]:
    """Every grid point's experiment, checked as `labkit experiment` checks one."""
    if "link" in grid and not exp.nodes.emulate_nodes and "emulate_nodes" not in grid:
        raise ConfigError(f"sweep link={','.join(grid['link'])} shapes the links of an emulated "
                          f"cluster: give --emulate-nodes N too")
    points = []
    for values in itertools.product(*grid.values()):
        point = dict(zip(grid, values))
        train = {k: v for k, v in point.items() if k not in LAUNCH_SWEPT}
        try:
            nodes = dataclasses.replace(exp.nodes, **{k: point[k] for k in LAUNCH_SWEPT[1:]
                                                      if k in point})
            pexp = dataclasses.replace(exp, nproc=point.get("nproc", exp.nproc), nodes=nodes)
            prepared = prepare(dataclasses.replace(cfg, **train), pexp)
        except ConfigError as e:
            raise ConfigError(f"sweep point {point_name(point)}: {e}") from None
        points.append((point, prepared))
    return points


def _report(root: Path, doc: dict, kernel: str, timeout: int, stream: IO[str]) -> None:
    html, why = report_or_why(lambda: make_sweep_report(root, kernel, timeout, stream), root,
                              stream, "SWEEP REPORT")
    doc["report"] = str(html.relative_to(root)) if html else f"report failed: {why}"
    if why:
        doc["status"] = Status.FAILED
