"""`labkit run | experiment` (also `python -m labkit ...`)."""
from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
from typing import Optional

from .config import METHODS, ConfigError, TrainConfig, add_config_arguments


def _add_nodes(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("multi-node (torchrun c10d rendezvous; single node on loopback by default)")
    g.add_argument("--nnodes", type=int, help="number of nodes (default 1)")
    g.add_argument("--node-rank", dest="node_rank", type=int, help="this node's rank (default 0)")
    g.add_argument("--rdzv-endpoint", dest="rdzv_endpoint", help="host:port of the rendezvous")
    g.add_argument("--max-restarts", dest="max_restarts", type=int,
                   help="torchrun restarts of the worker group after a failure; each restart "
                        "resumes from the last epoch checkpoint (default 0)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="labkit", description="Measure what data-parallel training costs.")
    sub = p.add_subparsers(dest="command", required=True)

    # argument_default=SUPPRESS: only flags the user gave appear, so they can override a YAML file
    r = sub.add_parser("run", help="run one method under torchrun (validated, live output, per-rank logs)",
                       argument_default=argparse.SUPPRESS)
    r.add_argument("method", choices=METHODS)
    r.add_argument("--nproc", type=int, help="processes per node (default: one per GPU, else 4)")
    add_config_arguments(r, skip=("method",), defaults=False)
    _add_nodes(r)

    e = sub.add_parser("experiment", help="all methods via papermill notebooks, then the report",
                       argument_default=argparse.SUPPRESS)
    e.add_argument("-f", "--parameters-file", dest="parameters_file",
                   help="papermill-style YAML file of parameters (flags override it)")
    e.add_argument("--methods", help=f"comma-separated subset of {','.join(METHODS)} (default: all)")
    e.add_argument("--nproc", type=int, help="processes per node (default: one per GPU, else 4)")
    e.add_argument("--runs-dir", dest="runs_dir", help="where run folders go (default: runs)")
    e.add_argument("--tag", help="suffix of the run folder name")
    e.add_argument("--cell-timeout", dest="cell_timeout", type=int,
                   help="seconds a notebook cell may run (default 3600)")
    add_config_arguments(e, skip=("method", "out"), defaults=False)
    _add_nodes(e)

    rp = sub.add_parser("report", help="tables, the guide's five plots and performance_report.txt")
    rp.add_argument("paths", nargs="+", metavar="RUN_DIR_OR_FILES",
                    help="a run folder, a folder with results_*.json, or result files")
    rp.add_argument("--out", help="where plots/ and performance_report.txt go (default: <run>/report "
                    "for a run folder, else the current folder, as the guide's analyze_results.py)")
    return p


def _load_yaml(path: str) -> dict:
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except OSError as err:
        raise ConfigError(f"cannot read parameters file {path!r}: {err.strerror}") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise ConfigError(f"parameters file {path!r} is not valid YAML{where}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"parameters file {path!r} must be a mapping of name: value")
    return data


def _split(params: dict) -> tuple[TrainConfig, dict]:
    """Separate TrainConfig fields from the rest; check names and types like the notebook does."""
    from .lab import check_params, machine_defaults

    names = {f.name for f in dataclasses.fields(TrainConfig)}
    train = {k: v for k, v in params.items() if k in names}
    rest = {k: v for k, v in params.items() if k not in names}
    check_params(params)
    for k, v in machine_defaults().items():
        if k != "nproc":
            train.setdefault(k, v)
    return TrainConfig(**train), rest


def _nodes(rest: dict):
    from .launch import Nodes

    return Nodes(rest.get("nnodes") or 1, rest.get("node_rank") or 0, rest.get("rdzv_endpoint"),
                 max_restarts=rest.get("max_restarts") or 0)


def cmd_run(params: dict) -> int:
    from .lab import machine_defaults
    from .launch import launch
    from .train import default_out

    cfg, rest = _split(params)
    nproc = rest.get("nproc") or machine_defaults()["nproc"]
    out = cfg.out or default_out(cfg.method)
    res = launch(cfg, nproc, out, _nodes(rest))
    if not res.ok:
        print(f"labkit: {res.message}", file=sys.stderr)
        return 1
    print(f"labkit: {cfg.method} finished in {res.wall_time:.0f}s; results in {out}")
    return 0


def cmd_experiment(params: dict) -> int:
    from .lab import Experiment, run_experiment

    if "parameters_file" in params:
        params = {**_load_yaml(params.pop("parameters_file")), **params}
    exp_keys = ("methods", "runs_dir", "tag", "cell_timeout")
    exp_kw = {k: params.pop(k) for k in exp_keys if k in params}
    if isinstance(exp_kw.get("methods"), str):
        exp_kw["methods"] = [m.strip() for m in exp_kw["methods"].split(",") if m.strip()]
    cfg, rest = _split(params)
    exp = Experiment(**exp_kw, nproc=rest.get("nproc"), nodes=_nodes(rest))
    run, status = run_experiment(cfg, exp)
    print(f"\nrun folder: {run}")
    for m, e in status["methods"].items():
        print(f"  {m:10s} {e['status']}" + (f"  ({e['error']})" if e.get("error") else ""))
    print(f"report: {status['report']}")
    return 0 if status["status"] == "completed" else 1


def cmd_report(params: dict) -> int:
    from pathlib import Path

    from . import report

    paths = params["paths"]
    for p in paths:
        if not os.path.exists(p):
            raise ConfigError(f"{p!r} does not exist")
    res = report.load_files(paths)
    if not res.docs and not res.problems:
        raise ConfigError(f"no result files ({', '.join(report.RESULT_FILES.values())}) in {', '.join(paths)}")
    single_run = len(paths) == 1 and Path(paths[0]).is_dir()
    out = params.get("out") or (str(Path(paths[0]) / "report") if single_run and (Path(paths[0]) / "experiment.json").exists() else ".")
    files = report.write_report(res, out, report.load_env(res.run_dir))
    print(report.text_report(res, report.load_env(res.run_dir)))
    print(f"plots: {Path(out) / 'plots'}/ ({len(files['plots'])} files)\nreport: {files['text']}")
    return 1 if res.problems else 0


def _sigterm(signum, frame):
    raise KeyboardInterrupt  # a killed job cleans up like Ctrl-C: children stopped, run marked


def main(argv: Optional[list[str]] = None) -> int:
    signal.signal(signal.SIGTERM, _sigterm)
    args = vars(build_parser().parse_args(argv))
    command = args.pop("command")
    try:
        return {"run": cmd_run, "experiment": cmd_experiment, "report": cmd_report}[command](args)
    except ConfigError as e:
        print(f"labkit {command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"labkit {command}: interrupted; every child process was stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
