"""`labkit reproduce RUN_DIR`: run a recorded experiment again and say whether it reproduced.

    1. read the run folder (labkit.core.run_folder.RunFolder.experiment; bad input is one line, exit 2)
    2. print how this machine differs from the recording (commit, diff, packages, data, threads)
    3. run the recorded configs again with labkit.orchestrate.experiment.run_experiment, same
    process count, into a
       NEW run folder (never the original)
    4. compare the two runs method by method and write reproduction.json into the new folder,
       before its report is made, so the report shows the comparison

Everything that can be checked is checked before a folder or a process exists.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import IO, Any, Iterable, Optional

from labkit.core import layout
from labkit.core.config import TrainConfig
from labkit.core.log import transcript
from labkit.core.run_folder import RunFolder
from labkit.launch.launch_params import Nodes
from labkit.runs import compare
from labkit.runs.compare import ReproduceError

TAG = "repro"


@dataclasses.dataclass
class Plan:
    """What a reproduction will run, decided before anything runs."""
    original: RunFolder
    methods: list[str]
    configs: dict[str, TrainConfig]   # the recorded resolved configs, checked on this machine
    train: TrainConfig                # the recorded experiment-wide config (config.json "train")
    nproc: int
    cell_timeout: int
    runs_dir: Path                    # where the new run folder goes
    prepared: Any                     # labkit.orchestrate.experiment.Prepared: checked once, here


def _config(d: dict, where: str) -> TrainConfig:
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ReproduceError(f"{where} has settings this labkit does not know ({', '.join(unknown)}): "
                             f"it was recorded by another version; check out the recorded commit")
    # a run recorded before labkit bound CPU ranks to cores (pin_cpus) ran unbound: rerun it
    # so. Never resume into, nor write to, the recorded folder: run_experiment gives each method
    # its folder in the new run
    return TrainConfig(**{"pin_cpus": False, **d, "out": None, "resume": False})


def plan(run_dir: str | os.PathLike, methods: Optional[Iterable[str]] = None,
         out: Optional[str] = None, tolerance: Optional[float] = None) -> Plan:
    """Read and check everything; ReproduceError (or ConfigError) names the first problem."""
    from .experiment import Experiment, prepare

    compare.check_tolerance(tolerance)
    # resolved now: runs/latest is a link that the new run folder will move
    rec = RunFolder.experiment(Path(run_dir).resolve())
    chosen = compare.select_methods(rec, methods)
    exp = rec.config.get("experiment") or {}
    nodes = exp.get("nodes") or {}
    if (nodes.get("nnodes") or 1) > 1:
        raise ReproduceError(f"{str(rec.path)!r} ran on {nodes['nnodes']} nodes: labkit reproduce "
                             f"re-runs single-node experiments only")
    if (exp.get("repeats") or 1) > 1:
        raise ReproduceError(f"{str(rec.path)!r} ran each method {exp['repeats']} times "
                             f"(--repeats): labkit reproduce re-runs single-repeat experiments only")
    nproc = exp.get("nproc")
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise ReproduceError(f"{str(rec.path / layout.CONFIG)!r} records no process count "
                             f"(experiment.nproc): cannot re-run it the same way")
    runs_dir = Path(out).resolve() if out else rec.path.parent
    if runs_dir == rec.path or rec.path in runs_dir.parents:
        raise ReproduceError(f"--out {out!r} is inside the run folder being reproduced; the "
                             f"reproduction never writes into the original")
    where = f"{str(rec.path / layout.CONFIG)!r}"
    configs = {m: _config(rec.methods[m], f"{where} (method {m})") for m in chosen}
    train = rec.config.get("train")
    train = _config(train, where) if isinstance(train, dict) else configs[chosen[0]]
    cell_timeout = int(exp.get("cell_timeout") or 3600)
    # bad data dir, nccl without GPUs...: every config checked once, before anything exists
    # (the experiment it runs takes them as checked)
    # an emulated cluster is part of what was measured: the same nodes and link again
    emulated = Nodes(emulate_nodes=nodes["emulate_nodes"], link=nodes.get("link") or "unshaped") \
        if nodes.get("emulate_nodes") else Nodes()
    prepared = prepare(train, Experiment(methods=chosen, nproc=nproc, runs_dir=str(runs_dir), tag=TAG,
                                         cell_timeout=cell_timeout, nodes=emulated), configs)
    return Plan(rec, chosen, configs, train, nproc, cell_timeout, runs_dir, prepared)


def current_environment(p: Plan) -> dict:
    """This machine described like a recorded environment (labkit.runs.compare.load_environment)."""
    from labkit.runs.record import environment_now

    return environment_now(p.configs, p.train.seed)


def _recorded_line(rec: RunFolder) -> str:
    env, git = rec.env, rec.env.get("git") or {}
    commit = (git.get("commit") or "unknown")[:10] + (" (dirty)" if git.get("dirty") else "")
    return (f"recorded {env.get('time', '?')} on {env.get('host', '?')}, commit {commit}; "
            f"methods {', '.join(rec.methods)}")


def run(p: Plan, tolerance: Optional[float] = None, stream: Optional[IO[str]] = None) -> tuple[Path, dict, dict]:
    """Print the environment comparison, re-run, compare; return (new run folder,
    reproduction document, experiment status)."""
    from .experiment import run_experiment

    stream = stream or transcript(__name__)
    rec = p.original
    stream.write(f"reproducing {rec.path}\n  {_recorded_line(rec)}\n")
    diff = compare.environment_diff(compare.load_environment(rec), current_environment(p))
    stream.write("environment now vs recorded:\n"
                 + ("".join(f"  {l}\n" for l in diff) if diff else "  no difference that matters\n"))
    stream.write(f"re-running {', '.join(p.methods)} with {p.nproc} processes each, seed "
                 f"{p.train.seed}, into a new run folder under {p.runs_dir}\n")
    stream.flush()
    holder: dict = {}

    def write_verdicts(run_dir: Path, status: dict) -> None:
        doc = compare.compare_runs(rec, RunFolder.experiment(run_dir), p.methods, tolerance)
        doc["environment_before"] = diff
        compare.write_reproduction(run_dir, doc)
        holder["doc"] = doc

    new_run, status = run_experiment(p.train, p.prepared.exp, stream, p.prepared,
                                     before_report=write_verdicts)
    return new_run, holder["doc"], status


def report_lines(new_run: Path, doc: dict, status: dict) -> list[str]:
    """What the command prints at the end: verdicts, timings, where things are."""
    ok = sum(v["verdict"] != compare.DIFFERENT for v in doc["methods"].values())
    lines = ["", f"reproduction of {doc['original']}", f"  in {new_run}", "verdict per method:"]
    lines += [f"  {l}" for l in compare.summary_lines(doc)]
    lines += ["speed of the reproduction (not part of the verdict):"]
    lines += [f"  {l}" for l in compare.timing_lines(doc)]
    lines += [f"reproduction.json: {new_run / layout.REPRODUCTION}",
              f"report: {status.get('report')}",
              f"{'REPRODUCED' if doc['reproduced'] else 'NOT REPRODUCED'}: {ok} of "
              f"{len(doc['methods'])} methods"
              + (f" (tolerance {doc['tolerance']:g})" if doc.get("tolerance") is not None else "")]
    return lines
