"""`labkit experiment --continue RUN`: finish an interrupted experiment in its own folder.

The methods (and repeats) whose result files are complete are kept as they are. One left half
way resumes from its last epoch checkpoint when it wrote one, else runs again; either way its
earlier attempt is kept beside it as ``<method>.interrupted-<k>/`` (results are never lost).
The environment is compared with the one recorded first: a difference (code, packages, data)
is refused unless ``--allow-changed-env``, and then recorded in experiment.json. The report
is made at the end as if the experiment had run at once. (`labkit reproduce` never reuses
anything: it runs everything again into a new folder.)
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import IO, Optional

from labkit.core import layout
from labkit.core.config import ConfigError, TrainConfig
from labkit.core.files import now_str
from labkit.core.log import transcript
from labkit.core.methods import result_file_of
from labkit.core.results import ResultError, read_result
from labkit.core.run_folder import RunFolder
from labkit.core.status import Status, as_seen, experiment_status, stamp
from labkit.launch.launch_params import Nodes
from labkit.runs import compare
from labkit.runs.record import environment_now
from labkit.runs.runs_dir import write_index
from labkit.training import checkpoint

from .experiment import Experiment, ExperimentFolder, prepare
from .kernels import kernel_name


def _recorded(run: Path) -> tuple[RunFolder, dict]:
    """The run's record and its experiment.json; ConfigError when there is no run to continue
    or it is still running."""
    if not run.exists():
        raise ConfigError(f"--continue {str(run)!r}: no such folder")
    rec = RunFolder.experiment(run)
    try:
        status = as_seen(rec.read(layout.EXPERIMENT))
    except (OSError, ValueError):
        raise ConfigError(f"--continue {str(run)!r}: no readable experiment.json, so what ran "
                          f"is unknown") from None
    if experiment_status(status) == Status.RUNNING:
        alive = "its process is alive" if status.get("heartbeat") else "no heartbeat tells"
        raise ConfigError(f"--continue {str(run)!r}: the experiment is still running ({alive}; "
                          f"stop it first)")
    return rec, status


def _prepared(rec: RunFolder):
    exp = dict(rec.config.get("experiment") or {})
    nodes = Nodes.of_record(exp.pop("nodes", None))
    names = {f.name for f in dataclasses.fields(Experiment)}
    experiment = Experiment(**{k: v for k, v in exp.items() if k in names}, nodes=nodes)
    train = TrainConfig(**rec.config["train"])
    resolved = {m: TrainConfig(**{**c, "out": None, "resume": False}) for m, c in rec.methods.items()}
    return prepare(train, experiment, resolved)


def _environment_changes(rec: RunFolder, p) -> list[str]:
    return compare.environment_diff(compare.load_environment(rec),
                                    environment_now(p.resolved, p.cfg.seed))


def _complete(mdir: Path, method_key: str) -> bool:
    try:
        result = read_result(mdir / result_file_of(method_key))  # as seen: a dead writer's is stopped
    except ResultError:
        return False
    # a file without a status (the guide's, the one kind without a schema) was not completed
    # by this experiment: run it again
    return result.status == Status.COMPLETED and result.schema is not None


def _set_aside(mdir: Path) -> bool:
    """Move an unfinished attempt to <method>.interrupted-<k>/; put its checkpoint back in a
    fresh folder. True: the method resumes from it."""
    if not mdir.exists():
        return False
    k = 1
    while mdir.with_name(f"{mdir.name}.interrupted-{k}").exists():
        k += 1
    old = mdir.with_name(f"{mdir.name}.interrupted-{k}")
    mdir.rename(old)
    return checkpoint.carry_over(old, mdir)


def _forget(folder: ExperimentFolder, m: str, i: int) -> None:
    """Drop the status entry of method ``m``'s repeat ``i`` before it runs again."""
    entry = folder.status["methods"].get(m)
    if entry and "repeats" in entry:
        entry["repeats"] = [r for r in entry["repeats"] if r.get("repeat") != i]


def _continue_method(folder: ExperimentFolder, m: str, i: int, seed: int, kernel: str,
                     stream: IO[str]) -> None:
    """Method ``m``'s repeat ``i``: kept where its result file is complete, else run again
    (resumed from its last checkpoint where it wrote one), its earlier attempt set aside."""
    run, p = folder.run, folder.p
    mdir = layout.method_dir(run, m, i, p.exp.repeats)
    if _complete(mdir, p.resolved[m].method):
        stream.write(f"  {mdir.relative_to(run)}: complete, kept\n")
        folder.record_kept(m, i, seed)  # experiment.json follows the result file
        return
    _forget(folder, m, i)
    resume = _set_aside(mdir)
    stream.write(f"  {mdir.relative_to(run)}: "
                 + ("resuming from its last checkpoint\n" if resume else "running\n"))
    folder.run_method(m, i, seed, kernel, stream, resume=resume)


def continue_experiment(run_dir: str, allow_changed_env: bool = False,
                        stream: Optional[IO[str]] = None) -> tuple[Path, dict]:
    """Continue ``run_dir``; return (run folder, status) as run_experiment does. A complete run
    is left as it is (nothing written): continuing it again is done, as `make` of a made target."""
    stream = stream or transcript(__name__)
    run = Path(run_dir).resolve()
    rec, status = _recorded(run)
    if experiment_status(status) == Status.COMPLETED:
        stream.write(f"{run}: the experiment is complete, nothing to continue (labkit reproduce "
                     f"runs it again)\n")
        return run, status
    p = _prepared(rec)
    changes = _environment_changes(rec, p)
    if changes and not allow_changed_env:
        more = f" (and {len(changes) - 1} more)" if len(changes) > 1 else ""
        raise ConfigError(f"--continue {str(run)!r}: the environment changed since the run "
                          f"started: {changes[0]}{more}; --allow-changed-env continues anyway "
                          f"and records it")
    status.setdefault("continued", []).append({"time": now_str(), "environment_changes": changes})
    status.update(status=Status.RUNNING, heartbeat=stamp())
    status.pop("error", None)  # as_seen's "stopped without finishing"
    folder = ExperimentFolder.reopen(run, p, status)
    with folder.marked_if_interrupted():  # stopped again: interrupted, to be continued again
        kernel = kernel_name()
        stream.write(f"continuing: {run}\n")
        for i, seed, order in folder.plan:
            for m in order:
                _continue_method(folder, m, i, seed, kernel, stream)
        folder.finish(kernel, stream, None)
    write_index(run.parent)
    return run, folder.status
