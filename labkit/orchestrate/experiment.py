"""The experiment: every method's notebook, then the report, in one new run folder.

papermill runs notebooks/run_method.ipynb once per method (each spawns torchrun through
labkit.launch.launch), then notebooks/report.ipynb; everything lands in one self-describing folder
runs/<YYYY-MM-DD_HH-MM-SS>[_<tag>]/ (its files: labkit.core.layout).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable, Iterator, Optional

from labkit.core import layout
from labkit.core.config import VARIANTS, ConfigError, TrainConfig
from labkit.core.files import atomic_write_json, now_str
from labkit.core.log import transcript
from labkit.core.methods import DEFAULT_METHODS, METHOD_ORDER, absolute, is_name, key_of
from labkit.core.run_folder import RunFolder, read_json
from labkit.core.stats import rotated_order
from labkit.core.status import INTERRUPTED_WHY, Status, stamp
from labkit.launch import cluster, warm
from labkit.launch.agent import AGENT, preload_for_workload
from labkit.launch.emulated import check_link, cluster_spec
from labkit.launch.launch import check_out, mark_ended, validate, warn, write_resolved
from labkit.launch.launch_params import Nodes, nproc_or_default, plan_lines, with_absolute_paths
from labkit.runs.record import snapshot, write_record
from labkit.runs.runs_dir import new_run_dir, write_index
from labkit.training import budget

from .check import check_before_measuring
from .kernels import KERNEL, kernel_name
from .render import execute, make_report, report_or_why

log = logging.getLogger(__name__)


@dataclass
class Experiment:
    """Parameters of `labkit experiment` (besides the training config)."""
    methods: list[str] = field(default_factory=lambda: list(DEFAULT_METHODS))
    nproc: Optional[int] = None
    runs_dir: Optional[str] = None  # None: the project's runs/ (layout.runs_root)
    tag: Optional[str] = None
    cell_timeout: int = 3600
    nodes: Nodes = field(default_factory=Nodes)
    repeats: int = 1      # every method this many times, in rotated order (stats.rotated_order)
    report: bool = True   # False: results only, no report notebook (a sweep's points)
    # the validation accuracy (%) whose time to reach the report gives per method; None: a
    # share of the best accuracy any method reached (labkit.core.breakdown.TARGET_SHARE)
    target_accuracy: Optional[float] = None
    # the target of the workload's first figure (e.g. a validation loss for lm), in its unit;
    # None: the report's default rule for that figure's direction
    target: Optional[float] = None


@dataclass
class Prepared:
    """An experiment whose every input was checked: what run_experiment needs, no folder yet."""
    cfg: TrainConfig
    exp: Experiment
    nproc: int
    resolved: dict[str, TrainConfig]
    snap: Any
    plan: list[str] = field(default_factory=list)  # what runs and why: printed first, recorded


def prepare(cfg: TrainConfig, exp: Experiment,
            resolved: Optional[dict[str, TrainConfig]] = None) -> Prepared:
    """All bad input fails here, in seconds, before a folder or a training process exists
    (labkit experiment's warm process, which imports meanwhile, is stopped at once)."""
    p = plan(cfg, exp, resolved)
    # an emulated cluster runs every node here: memory for all their ranks, a link one step of
    # each method can cross, then the namespaces (tried in throwaway ones), each refused in
    # one line
    spec = cluster_spec(p.exp.nodes, p.nproc, machine=False)
    check_machine(p.resolved, p.nproc, p.exp, spec.nodes if spec else 1)
    if spec is not None:
        for c in p.resolved.values():
            check_link(c, spec)
        cluster.check_machine(spec)
    # a method of one's own that claims exactness: checked first (seconds), or nothing runs
    checked = [line for c in p.resolved.values()
               if (line := check_before_measuring(c.method, p.nproc, c.timeout, c.workload,
                                                  c.options))]
    # packages, code, data fingerprints: before any folder
    return dataclasses.replace(p, snap=snapshot(p.resolved, p.cfg.seed), plan=p.plan + checked)


def plan(cfg: TrainConfig, exp: Experiment,
         resolved: Optional[dict[str, TrainConfig]] = None) -> Prepared:
    """Every method's checked config for this machine, and the lines saying what will run and
    why (Prepared.plan); no snapshot yet (``snap`` None).

    ``resolved`` ({method: config}, labkit reproduce): run exactly these recorded configs
    (checked again here) instead of deriving one per method from ``cfg``, so a reproduction
    does not re-decide what "auto" means on this machine."""
    if resolved is not None:
        exp = dataclasses.replace(exp, methods=list(resolved))
    check_names(exp, resolved)
    nproc = nproc_or_default(exp.nproc)
    cfg = with_absolute_paths(cfg)
    # a method runs with the config as given; a variant (ps-async, ...) adds its own fields
    if resolved is None:  # a method of one's own runs in the folder its key names
        resolved = {key_of(absolute(m)): dataclasses.replace(
            cfg, **(VARIANTS[m] if m in VARIANTS else {"method": absolute(m)})) for m in exp.methods}
        exp = dataclasses.replace(exp, methods=list(resolved))
    resolved = {m: validate(c, nproc, exp.nodes) for m, c in resolved.items()}
    return Prepared(cfg, exp, nproc, resolved, None,
                    plan_lines(resolved, nproc, exp.nproc, exp.nodes.node_count))


def check_names(exp: Experiment, resolved: Optional[dict[str, TrainConfig]] = None) -> None:
    """The experiment's own flags: known methods, a whole number of repeats (no import, no
    process: what a mistyped command line gets wrong, refused at once)."""
    bad = [m for m in exp.methods if m not in VARIANTS and not is_name(
        m if resolved is None else resolved[m].method)]
    if bad or not exp.methods:
        variants = ", ".join(v for v in VARIANTS if v not in METHOD_ORDER)
        raise ConfigError(f"unknown method(s) {', '.join(bad) or '(none)'}; choose from "
                          f"{', '.join(METHOD_ORDER)}, a variant: {variants}, or a class of "
                          f"your own as path/to/file.py:Class (docs/methods.md)")
    if isinstance(exp.repeats, bool) or not isinstance(exp.repeats, int) or exp.repeats < 1:
        raise ConfigError(f"--repeats must be a whole number, 1 or more (got {exp.repeats!r})")


def check_machine(resolved: dict[str, TrainConfig], nproc: int, exp: Experiment,
                  nodes: int = 1) -> None:
    """Room for every method's checkpoints and final model in --runs-dir, /dev/shm and memory
    for each (for the ranks of all ``nodes`` nodes, an emulated cluster's on this machine): a
    shortfall is refused here, before the run folder exists; tight margins warned about once."""
    runs = len(exp.methods) * exp.repeats
    said: list[str] = []
    where = str(layout.runs_root(exp.runs_dir))
    for c in resolved.values():
        said += [w for w in budget.machine(c, nproc * nodes, where, runs, "--runs-dir", nodes=nodes)
                 if w not in said]
    warn(said)


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
    began = time.monotonic()
    stream = stream or transcript(__name__)
    if prepared is None:
        check_names(exp)
    workloads = {c.workload for c in prepared.resolved.values()} if prepared else {cfg.workload}
    # the warm process imports while the inputs are checked (a bad one stops it at once)
    with warm_node((prepared.exp if prepared else exp).nodes, workloads):
        p = prepared or prepare(cfg, exp)
        if run is None:
            run = new_run_dir(p.exp.runs_dir, p.exp.tag).resolve()
        else:
            run.mkdir(parents=True)
        folder = ExperimentFolder(run, p, began)
        try:
            with folder.marked_if_interrupted():
                kernel = kernel_name()
                stream.write(f"experiment: {run}\n" + "".join(f"{line}\n" for line in p.plan))
                folder.ready()
                for i, seed, order in folder.plan:
                    for m in order:
                        if gone := warm.ended():  # between two methods: said once, not by each client
                            stream.write(f"\nlabkit: {gone}; what follows starts its own processes\n")
                        folder.run_method(m, i, seed, kernel, stream)
                folder.finish(kernel, stream, before_report)
        finally:  # interrupted too: the lab notebook lists the run as it was left
            if not (run.parent / layout.SWEEP).exists():  # a sweep's point: the sweep writes it
                write_index(run.parent)
    return run, folder.status


def warm_node(nodes: Nodes, workloads: set[str]) -> contextlib.AbstractContextManager:
    """One warm process for every notebook's kernel, method's agent and ranks
    (labkit.launch.warm): torch, the workload, IPython and matplotlib imported once per
    experiment, not in every process. Where the ranks run on this machine alone: an emulated
    node's run in network namespaces of their own, a real cluster's on other machines."""
    if nodes.multi or nodes.emulated:
        return contextlib.nullcontext()
    workload = next(iter(workloads)) if len(workloads) == 1 else None
    return warm.node(KERNEL + preload_for_workload(workload) + AGENT)  # a kernel is forked first


class ExperimentFolder:
    """An experiment's folder while it runs. experiment.json says what ran and how each method
    ended, environment.json gains each method's torchrun command; both are rewritten
    atomically as the experiment goes, with paths relative to the folder (so a copied or moved
    folder still describes itself)."""

    def __init__(self, run: Path, p: Prepared, began: Optional[float] = None):
        self.run, self.p = run, p
        self.began = time.monotonic() if began is None else began  # run_experiment's start
        exp = p.exp
        self.plan = repeat_plan(exp.methods, exp.repeats, p.cfg.seed)
        self.write(layout.CONFIG, {"experiment": {**dataclasses.asdict(exp), "nproc": p.nproc},
                                   "plan": p.plan,  # what ran on this machine, and why
                                   "train": p.cfg.to_dict(),
                                   "resolved": {m: c.to_dict() for m, c in p.resolved.items()}})
        # the record's paths are relative to the run folder; each torchrun command names paths
        # relative to its method's folder (its --out), where it ran
        self.env = {**write_record(run, p.snap), "torchrun_commands": {},
                    "paths": "relative to the run folder unless absolute; torchrun_commands run "
                             "from the method's folder"}
        self.write(layout.ENVIRONMENT, self.env)
        self.status: dict[str, Any] = {
            "run_dir": str(run), "started": now_str(), "methods": {}, "status": Status.RUNNING,
            "heartbeat": stamp(),  # who runs it: a reader tells a killed experiment (as_seen)
            "repeats": exp.repeats, "order": [order for _, _, order in self.plan],
            "seeds": [seed for _, seed, _ in self.plan]}

    @classmethod
    def reopen(cls, run: Path, p: Prepared, status: dict) -> "ExperimentFolder":
        """An existing experiment's folder, to continue it (labkit.orchestrate.continuation): its
        config.json and environment record stay as they were written."""
        self = cls.__new__(cls)
        self.run, self.p, self.status = run, p, status
        self.began = None  # a continuation: its wall time is not the experiment's
        self.plan = repeat_plan(p.exp.methods, p.exp.repeats, p.cfg.seed)
        self.env = RunFolder(run).get(layout.ENVIRONMENT, {})
        self.env.setdefault("torchrun_commands", {})
        return self

    def write(self, name: str, doc: dict) -> None:
        atomic_write_json(str(self.run / name), layout.portable(doc, self.run))

    def _entry(self, m: str, i: int, seed: int, mdir: Path) -> dict:
        """A new status entry for method ``m``'s repeat ``i``: the method's own with one
        repeat; with several, one per repeat inside the method's."""
        entry: dict[str, Any] = {"status": Status.RUNNING,
                                 "notebook": str(mdir / layout.METHOD_NOTEBOOK)}
        if self.p.exp.repeats == 1:
            self.status["methods"][m] = entry
            return entry
        agg = self.status["methods"].setdefault(m, {"status": Status.RUNNING, "repeats": []})
        agg["repeats"].append({"repeat": i, "seed": seed, **entry})
        return agg["repeats"][-1]

    def record_kept(self, m: str, i: int, seed: int) -> None:
        """Record method ``m``'s repeat ``i`` as complete: its result file says so (labkit
        experiment --continue keeps it). The record follows the result file, whatever
        experiment.json said: an experiment killed after the file was complete, before it
        recorded that, left it running there (issue 61)."""
        repeats = self.p.exp.repeats
        entry = self.status["methods"].get(m)
        if entry is not None and repeats > 1:
            entry = next((r for r in entry.get("repeats", []) if r.get("repeat") == i), None)
        if entry is None:
            entry = self._entry(m, i, seed, layout.method_dir(self.run, m, i, repeats))
        entry["status"] = Status.COMPLETED
        entry.pop("error", None)
        if repeats > 1:
            _sum_up_repeats(self.status["methods"][m], repeats)
        self.write(layout.EXPERIMENT, self.status)

    def ready(self) -> None:
        """Before the first method: wait for the experiment's warm process to have its imports,
        so that no method's wall time holds what they all share; the seconds since the
        experiment began (inputs checked, folder made, those imports) are its ``start_s``."""
        self.write(layout.EXPERIMENT, self.status)  # what runs, said while it waits
        warm.ready()
        self.status["start_s"] = round(time.monotonic() - self.began, 2)

    @contextlib.contextmanager
    def marked_if_interrupted(self) -> Iterator[None]:
        """experiment.json says interrupted when Ctrl-C or a SIGTERM stops what runs inside:
        a method, the waits before and between them, the report (the experiment's status was
        decided before it began), so that readers list the run as interrupted and `labkit
        experiment --continue` finishes it. Also before experiment.json was first written."""
        try:
            yield
        except KeyboardInterrupt:
            self.status["status"] = Status.INTERRUPTED
            self.write(layout.EXPERIMENT, self.status)
            raise

    def run_method(self, m: str, i: int, seed: int, kernel: str, stream: IO[str],
                   resume: bool = False) -> None:
        """Run method ``m``'s repeat ``i`` into its folder (new; with ``resume``, one that holds
        the checkpoint to continue from)."""
        repeats = self.p.exp.repeats
        mdir = layout.method_dir(self.run, m, i, repeats)
        mdir.mkdir(parents=True, exist_ok=resume)
        entry = self._entry(m, i, seed, mdir)
        self.write(layout.EXPERIMENT, self.status)
        label = m if repeats == 1 else f"{m}, repeat {i} of {repeats} (seed {seed})"
        try:
            run_method_notebook(dataclasses.replace(self.p.resolved[m], seed=seed, resume=resume),
                                mdir, self.p, kernel, stream, entry, label)
        except KeyboardInterrupt:  # experiment.json: marked_if_interrupted, around every method
            if repeats > 1:
                self.status["methods"][m]["status"] = Status.INTERRUPTED
            raise
        if repeats > 1:
            _sum_up_repeats(self.status["methods"][m], repeats)
        launch_json = mdir / layout.launch_file()
        if launch_json.exists():
            key = m if repeats == 1 else str(mdir.relative_to(self.run))
            self.env["torchrun_commands"][key] = read_json(launch_json)["command_line"]
            self.write(layout.ENVIRONMENT, self.env)
        self.write(layout.EXPERIMENT, self.status)

    def finish(self, kernel: str, stream: IO[str],
               before_report: Optional[Callable[[Path, dict], None]]) -> None:
        st = self.status
        failed = [m for m, e in st["methods"].items() if e["status"] != Status.COMPLETED]
        st["status"] = Status.FAILED if failed else Status.COMPLETED
        if before_report is not None:
            before_report(self.run, st)
        if self.p.exp.report:
            t0 = time.monotonic()
            html, why = report_or_why(
                lambda: make_report(self.run, kernel, self.p.exp.cell_timeout, stream),
                self.run, stream)
            st["report"] = str(html) if html else f"report failed: {why}"
            st["report_s"] = round(time.monotonic() - t0, 2)
            if why:
                st["status"] = Status.FAILED
        else:
            st["report"] = "not made (--no-report)"
        st["finished"] = now_str()
        if self.began is not None:
            st["wall_s"] = round(time.monotonic() - self.began, 2)
        self.write(layout.EXPERIMENT, st)


def _sum_up_repeats(agg: dict, repeats: int) -> None:
    """A method's status over its repeats: the first problem, else complete once all ran."""
    bad = [r for r in agg["repeats"] if r["status"] != Status.COMPLETED]
    done = len(agg["repeats"]) == repeats
    agg["status"] = bad[0]["status"] if bad else (Status.COMPLETED if done else Status.RUNNING)
    agg.pop("error", None)  # an earlier problem, gone once its repeat ran again (--continue)
    if bad:
        agg["error"] = f"repeat {bad[0]['repeat']}: {bad[0].get('error', '')}".strip()


def run_method_notebook(cfg: TrainConfig, mdir: Path, p: Prepared, kernel: str,
                        stream: IO[str], entry: dict, label: str) -> None:
    """papermill runs run_method.ipynb for one method into ``mdir``; ``entry`` gets its status."""
    import papermill as pm
    from nbclient.exceptions import DeadKernelError

    stream.write(f"\n=== {label}: {p.nproc} processes ===\n")
    stream.flush()
    t0 = time.monotonic()
    entry["started_at"] = time.time()  # the lab's own time, accounted (labkit.report.accounting)
    try:
        # resolved and checked by plan(); only the method's folder is new. The notebook and
        # the ranks read this file and decide nothing again; its values are passed beside it
        # only so that the executed notebook shows what ran
        params = _write_resolved(cfg, mdir, p)
        execute("run_method", mdir / layout.METHOD_NOTEBOOK, params, kernel,
                p.exp.cell_timeout, stream)
        entry["status"] = Status.COMPLETED
    except ConfigError as e:  # the method's folder refused (nothing to resume in it)
        entry.update(status=Status.FAILED, error=f"ConfigError: {e}")
        log.error("\n%s FAILED: %s", label, entry["error"])
    except pm.PapermillExecutionError as e:
        entry.update(status=Status.FAILED, error=f"{e.ename}: {e.evalue}".strip())
        log.error("\n%s FAILED: %s", label, entry["error"])
    except DeadKernelError:  # killed under the notebook: by the OOM killer, by hand, with the warm process
        entry.update(status=Status.FAILED, error=f"the notebook's kernel died: {warm.ended() or 'killed'}")
        mark_ended(str(mdir), cfg.result_file, Status.FAILED, entry["error"])
        log.error("\n%s FAILED: %s", label, entry["error"])
    except OSError as e:  # papermill could not write the executed notebook: a full disk
        entry.update(status=Status.FAILED, error=f"cannot write {e.filename or mdir}: {e.strerror}")
        log.error("\n%s FAILED: %s", label, entry["error"])
    except KeyboardInterrupt:
        # the kernel, and with it the launcher, is gone: mark the method's result file here
        mark_ended(str(mdir), cfg.result_file, Status.INTERRUPTED, INTERRUPTED_WHY)
        entry["status"] = Status.INTERRUPTED
        raise
    entry["wall_time"] = time.monotonic() - t0
    entry["ended_at"] = entry["started_at"] + entry["wall_time"]


def _write_resolved(cfg: TrainConfig, mdir: Path, p: Prepared) -> dict:
    """Method ``cfg``'s resolved.json in its folder ``mdir``, after the folder's own check; the
    notebook's parameters: ``resolved``, the name the kernel (which runs in ``mdir``) opens it
    by, and the values it holds. The kernel and the ranks run in mdir, so out "." is the
    method's folder: the executed notebook, the torchrun command line (launch.json) and the
    result file's config.out name no absolute path, and a copied run folder still describes
    itself."""
    check_out(dataclasses.replace(cfg, out=str(mdir)))
    cfg, nodes = dataclasses.replace(cfg, out="."), p.exp.nodes
    path = write_resolved(cfg, p.nproc, str(mdir), nodes)
    return {**cfg.to_dict(), "nproc": p.nproc, **dataclasses.asdict(nodes),
            "resolved": os.path.relpath(path, mdir)}
