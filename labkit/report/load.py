"""Reading result files: one run folder, loose files from the original scripts, and the
variants an experiment ran. Result files are only read, never modified. Where they lie, and
the folder's other documents, come from labkit.core.run_folder.RunFolder; what they must hold
(the guide's keys) is checked here."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from labkit.core import layout
from labkit.core.config import VARIANTS
from labkit.core.methods import METHOD_NAMES, METHOD_ORDER, RESULT_FILES, SPECS
from labkit.core.run_folder import RunFolder, recorded
from labkit.core.results import NAN, Result, ResultError, read_result
from labkit.core.status import Status

from .workload_view import ACCURACY, WorkloadView, view_of


def method_key(doc: Result, path: str | os.PathLike = "") -> Optional[str]:
    """ddp | allreduce | ps, from the lab's own key, the guide's method name or the file name;
    a method of one's own from the spec its file records (registered here, so every table and
    figure lists it)."""
    recorded(doc)
    if doc.method_key in METHOD_ORDER:
        return doc.method_key
    by_name = {v: k for k, v in METHOD_NAMES.items()}
    if doc.method in by_name:
        return by_name[doc.method]
    by_file = {v: k for k, v in RESULT_FILES.items()}
    return by_file.get(os.path.basename(str(path)))


def load_result(path: str | os.PathLike) -> Result:
    """Read one result file: the lab's, or one with only the guide's keys (labkit.core.results)
    of a method this lab knows; ResultError (one line) otherwise."""
    doc = read_result(path)
    if method_key(doc, path) is None:
        raise ResultError(f"{path}: unknown method {doc.method!r}")
    return doc


@dataclass
class RunResults:
    """What a report is made of: the loaded results and the problems met on the way.
    (The writer of result files is labkit.training.result_file.ResultFile; this is their reader.)"""
    docs: dict[str, Result] = field(default_factory=dict)        # method key -> result
    problems: dict[str, str] = field(default_factory=dict)       # method key or file -> problem
    run_dir: Optional[Path] = None
    # method key -> one result per repeat (`labkit experiment --repeats N`, repeat 1 first);
    # a run without repeats: a list of one, the same document as in ``docs``, which keeps the
    # first repeat so every single-run table and figure reads as before
    repeats: dict[str, list[Result]] = field(default_factory=dict)
    # `labkit experiment --target-accuracy` (config.json): None, a share of the best accuracy
    target_accuracy: Optional[float] = None
    # `labkit experiment --target` (config.json): the target of the workload's first figure
    # (a validation loss for a language model); None: the default rule for its direction
    target: Optional[float] = None

    @property
    def ok(self) -> dict[str, Result]:
        """RunResults with at least one finished epoch (a failed run keeps its finished epochs)."""
        return {m: d for m, d in self.docs.items() if d.ok}

    @property
    def view(self) -> WorkloadView:
        """What the results trained and how they are judged, in the report's words."""
        return view_of(self)

    @property
    def given_target(self) -> tuple[Optional[float], Optional[str]]:
        """(the target a flag gave, that flag): --target, else --target-accuracy where the
        first figure is the guide's accuracy; (None, None) for the default rule."""
        if self.target is not None:
            return self.target, "--target"
        if self.target_accuracy is not None and self.view.target.key == ACCURACY:
            return self.target_accuracy, "--target-accuracy"
        return None, None


def load_run(run_dir: str | os.PathLike) -> RunResults:
    """A run folder (method subfolders, or repeat-<i>/ folders holding them) or a folder holding
    results_*.json directly."""
    folder = RunFolder(run_dir)
    res = RunResults(run_dir=folder.path, target_accuracy=folder.target_accuracy,
                     target=folder.target)
    status = {}
    if folder.has(layout.EXPERIMENT):
        try:
            status = folder.read(layout.EXPERIMENT).get("methods", {})
        except (OSError, ValueError):
            res.problems[layout.EXPERIMENT] = f"{folder.file(layout.EXPERIMENT)}: unreadable"
    folder.discover()
    for m in METHOD_ORDER:
        for i, path in enumerate(folder.result_paths(m)):
            if path.exists():
                _add(res, path, m, first=i == 0)
            elif path.parent.is_dir() or m in status:
                res.problems.setdefault(m, f"{path}: missing")
        st = status.get(m, {})
        if st.get("status") not in (None, Status.COMPLETED):
            res.problems[m] = f"{st['status']}: {st.get('error', '').strip()}".strip(": ")
    _variant_problems(folder, res)
    return res


def _variant_problems(folder: RunFolder, res: RunResults) -> None:
    """A variant's result file that is there but cannot be read (`labkit experiment --methods
    ps,ps-async`): a problem of the run, in one line, as a method's is (its section, which reads
    the variants through variant_runs, leaves the file out)."""
    for v in VARIANTS:
        if v in METHOD_ORDER:
            continue
        for d in [folder.path] + folder.repeats:
            path = d / v / RESULT_FILES[VARIANTS[v]["method"]]
            try:
                if path.exists():
                    load_result(path)
            except ResultError as e:
                res.problems.setdefault(v, str(e))


def load_files(paths: list[str | os.PathLike]) -> RunResults:
    res = RunResults()
    for p in paths:
        if Path(p).is_dir():
            sub = load_run(p)
            res.docs.update(sub.docs)
            res.repeats.update(sub.repeats)
            res.problems.update(sub.problems)
            res.run_dir = res.run_dir or sub.run_dir
            if res.target_accuracy is None:  # a run folder's flags (config.json)
                res.target_accuracy = sub.target_accuracy
            if res.target is None:
                res.target = sub.target
        else:
            _add(res, Path(p), None)
    return res


def _add(res: RunResults, path: Path, expected: Optional[str], first: bool = True) -> None:
    """Load one result file; ``first`` False: a later repeat, kept in ``repeats`` only."""
    try:
        doc = load_result(path)
    except ResultError as e:
        res.problems.setdefault(expected or path.name, str(e))
        return
    m = method_key(doc, path)
    if first or m not in res.docs:
        res.docs[m] = doc
        res.repeats[m] = [doc]
    else:
        res.repeats[m].append(doc)
    if doc.status != Status.COMPLETED:
        res.problems.setdefault(m, f"{path}: status {doc.status}" + (f" ({doc.error})" if doc.error else ""))


def runs_of(res: RunResults, m: str) -> list[Result]:
    """Every run of ``m`` (a method, or a variant such as ddp-bf16), one per seed, failed ones
    included (they count), interrupted ones not: the user stopped them before their last epoch,
    so their last accuracy is not a final one, nor their miss the method's."""
    if m in SPECS:
        docs = list(res.repeats.get(m) or ([res.docs[m]] if m in res.docs else []))
    else:
        docs = variant_runs(res.run_dir, m) if res.run_dir is not None else []
    return [d for d in docs if d.status != Status.INTERRUPTED]


def load_env(run_dir: Optional[Path]) -> Optional[dict]:
    """environment.json of a run folder, or None (none, or unreadable)."""
    return RunFolder(run_dir).get(layout.ENVIRONMENT) if run_dir else None


def load_reproduction(run_dir: Optional[Path]) -> Optional[dict]:
    """reproduction.json of a run made by ``labkit reproduce``, or None (none, or unreadable)."""
    doc = RunFolder(run_dir).get(layout.REPRODUCTION) if run_dir else None
    return doc if isinstance(doc, dict) and isinstance(doc.get("methods"), dict) else None


def load_variants(run: Path) -> dict[str, Result]:
    """Results of the variants an experiment ran besides the three methods (``labkit
    experiment --methods ps,ps-async,...``): {variant: result document} (repeat 1's)."""
    out = {}
    for v in VARIANTS:
        runs = variant_runs(run, v)
        if runs:
            out[v] = runs[0]
    return out


def variant_runs(run: Path, v: str) -> list[Result]:
    """Every readable result of variant ``v`` in run folder ``run``: its one folder, or one per
    repeat (repeat-<i>/<v>/) in order; [] for a name that is a method, not a variant."""
    if v not in VARIANTS or v in METHOD_ORDER:
        return []
    name = RESULT_FILES[VARIANTS[v]["method"]]
    out = []
    for d in [Path(run)] + RunFolder(run).repeats:
        try:
            out.append(load_result(d / v / name))
        except ResultError:  # missing (e.g. no repeats), truncated or not a result file
            continue
    return out
