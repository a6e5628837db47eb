"""Compare a run folder with its reproduction, method by method, and the environments they
ran in.

    rec_a, rec_b = load_run_record("runs/a"), load_run_record("runs/b")
    doc = compare_runs(rec_a, rec_b, tolerance=None)   # {"methods": {m: verdict, ...}, ...}
    write_reproduction(rec_b.path, doc)                 # reproduction.json

A method's verdict is "identical" (every per-step loss, per-epoch metric and final parameter
equal bit for bit), "equal within tolerance" (max abs difference <= tolerance), or "different"
(naming the first diverging step and metric, or the data fingerprint that differs). Timings
never decide a verdict: they are compared with a confidence interval.

Bad input (not a run folder, a missing or corrupt config.json, a method the run did not
have) raises :class:`ReproduceError`, a ConfigError: one line, exit 2 in the CLI.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

from labkit.core import layout
from labkit.core.config import ConfigError
from labkit.core.files import atomic_write_json
from labkit.core.layout import portable, resolve_in_run
from labkit.core.lockfile import PROJECT, parse_lock
from labkit.core.methods import METHODS, RESULT_FILES
from labkit.core.status import Status, status_of

SCHEMA = "labkit.reproduction/1"
# per-epoch metrics that must reproduce (timings are compared apart, never for equality)
EPOCH_METRICS = ("train_loss", "train_accuracy", "val_loss", "val_accuracy")
STEP_LOSSES = "all_losses"  # the guide's per-epoch list of per-step losses (mean over trainers)
IDENTICAL, WITHIN, DIFFERENT = "identical", "equal within tolerance", "different"


class ReproduceError(ConfigError):
    """Bad input for a comparison: one line naming the problem."""


# ------------------------------------------------------------------ reading run folders
@dataclass
class RunRecord:
    """A run folder as the comparison reads it."""
    path: Path
    config: dict                       # config.json
    methods: dict[str, dict]           # method (or variant) -> its resolved TrainConfig dict
    env: dict = field(default_factory=dict)  # environment.json ({} when absent)

    def method_dir(self, method: str) -> Path:
        return self.path / method

    def result_path(self, method: str) -> Path:
        return self.method_dir(method) / RESULT_FILES[self.methods[method]["method"]]

    def result(self, method: str) -> Optional[dict]:
        """The method's result file, or None when it is missing or unreadable."""
        try:
            return json.loads(self.result_path(method).read_text())
        except (OSError, ValueError):
            return None


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ReproduceError(f"{str(path)!r} is not valid JSON (line {e.lineno}, column "
                             f"{e.colno}): the {what} is corrupt") from None
    except OSError as e:
        raise ReproduceError(f"cannot read {str(path)!r}: {e.strerror}") from None


def load_run_record(run_dir: str | os.PathLike) -> RunRecord:
    """Read a run folder written by ``labkit experiment``; ReproduceError when it is not one."""
    run = Path(run_dir)
    if not run.exists():
        raise ReproduceError(f"{str(run)!r} does not exist")
    if not run.is_dir():
        raise ReproduceError(f"{str(run)!r} is not a folder (expected a run folder made by "
                             f"labkit experiment)")
    cfg_path = run / layout.CONFIG
    if not cfg_path.exists():
        if (run / layout.EXPERIMENT).exists() or (run / layout.ENVIRONMENT).exists():
            raise ReproduceError(f"{str(run)!r} has no config.json: the run folder is incomplete "
                                 f"and cannot be reproduced")
        raise ReproduceError(f"{str(run)!r} is not a run folder (no config.json; labkit "
                             f"experiment makes run folders)")
    config = _read_json(cfg_path, "run's config")
    resolved = config.get("resolved") if isinstance(config, dict) else None
    if not isinstance(resolved, dict) or not resolved or not all(
            isinstance(c, dict) and c.get("method") in METHODS for c in resolved.values()):
        raise ReproduceError(f"{str(cfg_path)!r} is not a labkit experiment config (no "
                             f"'resolved' methods)")
    env_path = run / layout.ENVIRONMENT
    env = _read_json(env_path, "environment record") if env_path.exists() else {}
    return RunRecord(run, config, resolved, env if isinstance(env, dict) else {})


def select_methods(rec: RunRecord, methods: Optional[Iterable[str]] = None) -> list[str]:
    """The methods to compare: all of the run's, or those asked for, each one the run had."""
    if methods is None:
        return list(rec.methods)
    chosen = list(methods)
    missing = [m for m in chosen if m not in rec.methods]
    if missing or not chosen:
        raise ReproduceError(f"run {str(rec.path)!r} has no method {', '.join(missing) or '(none)'}"
                             f" (it ran: {', '.join(rec.methods)})")
    return chosen


# ------------------------------------------------------------------ comparing numbers
class _Diff:
    """The largest absolute difference met, and the first place where two sequences part
    (exactly, or by more than the tolerance)."""

    def __init__(self, tolerance: Optional[float]):
        self.tolerance = tolerance
        self.max_abs = 0.0
        self.exact = True
        self.first: Optional[dict] = None

    def value(self, a: float, b: float, where: dict) -> None:
        if a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)):
            return
        self.exact = False
        d = abs(a - b) if a is not None and b is not None else math.inf
        d = math.inf if math.isnan(d) else d
        self.max_abs = max(self.max_abs, d)
        beyond = self.tolerance is None or d > self.tolerance
        if beyond and self.first is None:
            self.first = {**where, "recorded": a, "reproduced": b, "abs_diff": d}

    def tensors(self, name: str, a, b) -> None:
        import torch

        if a.shape != b.shape or a.dtype != b.dtype:
            self.exact = False
            self.max_abs = math.inf
            if self.first is None:
                self.first = {"metric": f"final parameter {name}",
                              "recorded": f"{a.dtype} {list(a.shape)}",
                              "reproduced": f"{b.dtype} {list(b.shape)}", "abs_diff": math.inf}
            return
        if torch.equal(a, b):
            return
        d = (a.double() - b.double()).abs().max().item()
        self.value(0.0, d, {"metric": f"final parameter {name}"})  # records d as the difference


def _steps(doc: dict) -> list[tuple[int, int, float]]:
    """[(epoch, step within the epoch, loss)] over the run, from each epoch's all_losses."""
    return [(e["epoch"], i + 1, v) for e in doc.get("epochs", []) for i, v in enumerate(e.get(STEP_LOSSES, []))]


def _compare_results(a: dict, b: dict, diff: _Diff, reasons: list[str]) -> dict:
    sa, sb = _steps(a), _steps(b)
    for n, ((ep, st, va), (_, _, vb)) in enumerate(zip(sa, sb), 1):
        diff.value(va, vb, {"step": n, "epoch": ep, "step_in_epoch": st, "metric": "loss"})
    if len(sa) != len(sb):
        reasons.append(f"{len(sa)} recorded steps, {len(sb)} reproduced")
    ea, eb = a.get("epochs", []), b.get("epochs", [])
    for x, y in zip(ea, eb):
        for k in EPOCH_METRICS:
            if k in x and k in y:
                diff.value(x[k], y[k], {"epoch": x["epoch"], "metric": k})
    if len(ea) != len(eb):
        reasons.append(f"{len(ea)} recorded epochs, {len(eb)} reproduced")
    return {"steps": min(len(sa), len(sb)), "epochs": min(len(ea), len(eb))}


def _compare_models(pa: Path, pb: Path, diff: _Diff, reasons: list[str]) -> Optional[int]:
    import torch

    if not pa.exists() and not pb.exists():
        return None  # neither run kept its final model: losses and metrics decide
    if not (pa.exists() and pb.exists()):
        reasons.append(f"{layout.FINAL_MODEL} only in the {'recorded run' if pa.exists() else 'reproduction'}")
        return None
    try:
        ma = torch.load(pa, map_location="cpu", weights_only=True)
        mb = torch.load(pb, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable checkpoint is one reason
        reasons.append(f"{layout.FINAL_MODEL} unreadable ({type(e).__name__})")
        return None
    if set(ma) != set(mb):
        reasons.append(f"the final models hold different tensors "
                       f"({len(set(ma) ^ set(mb))} names in one only)")
    for name in sorted(set(ma) & set(mb)):
        diff.tensors(name, ma[name], mb[name])
    return len(set(ma) & set(mb))


def _fingerprint_reason(a: Optional[dict], b: Optional[dict]) -> Optional[str]:
    if not a or not b:
        return None
    if a.get("sha256") == b.get("sha256"):
        return None
    why = (f"data fingerprint differs ({a.get('dataset')}: recorded {str(a.get('sha256'))[:12]}, "
           f"reproduced {str(b.get('sha256'))[:12]})")
    if a.get("layout_sha256") and a.get("layout_sha256") == b.get("layout_sha256"):
        why += "; same image paths and sizes, only modification times differ (a copy?)"
    return why


def _data_of(rec: RunRecord, method: str) -> Optional[dict]:
    return (rec.env.get("data") or {}).get(method)


def compare_method(a: RunRecord, b: RunRecord, method: str,
                   tolerance: Optional[float] = None) -> dict:
    """The verdict for one method of ``a`` (recorded) against ``b`` (its reproduction)."""
    reasons: list[str] = []
    notes: list[str] = []
    diff = _Diff(tolerance)
    da, db = a.result(method), b.result(method) if method in b.methods else None
    compared: dict[str, Any] = {}
    if da is None:
        reasons.append(f"no readable result file in the recorded run ({a.result_path(method)})")
    if db is None:
        reasons.append("no readable result file in the reproduction")
    if da is not None and db is not None:
        for doc, who in ((da, "recorded run"), (db, "reproduction")):
            if status_of(doc) != Status.COMPLETED:
                reasons.append(f"the {who} has status {doc['status']}")
        compared = _compare_results(da, db, diff, reasons)
        if not compared["steps"]:
            notes.append("no per-step losses recorded")
    if method in b.methods:
        compared["parameters"] = _compare_models(a.method_dir(method) / layout.FINAL_MODEL,
                                                 b.method_dir(method) / layout.FINAL_MODEL, diff, reasons)
    fa, fb = _data_of(a, method), _data_of(b, method)
    data_why = _fingerprint_reason(fa, fb)
    if data_why:
        reasons.insert(0, data_why)
    elif not (fa and fb):
        notes.append("no data fingerprint recorded in "
                     + ("either run" if not (fa or fb) else "one run") + ": data not checked")
    if diff.first is not None:
        reasons.append(describe_divergence(diff.first))
    if reasons:
        verdict = DIFFERENT
    elif diff.exact:
        verdict = IDENTICAL
    else:
        verdict = WITHIN
    return {"method": method, "verdict": verdict,
            "max_abs_diff": diff.max_abs if not math.isinf(diff.max_abs) else None,
            "first_divergence": diff.first, "reasons": reasons, "notes": notes,
            "data": {"recorded": fa, "reproduced": fb} if data_why else None,
            "compared": compared,
            "timing": compare_timings(da, db) if da and db else None}


def describe_divergence(first: dict) -> str:
    """One line: where two runs first part."""
    if "step" in first:
        where = f"step {first['step']} (epoch {first['epoch']}, step {first['step_in_epoch']})"
    elif "epoch" in first:
        where = f"epoch {first['epoch']}"
    else:
        where = "the end"
    what = first["metric"]
    if what.startswith("final parameter"):
        return f"first differs at {where}: {what}, max abs difference {first['abs_diff']:.3g}"
    return (f"first differs at {where}: {what} {first['recorded']!r} recorded, "
            f"{first['reproduced']!r} reproduced")


# ------------------------------------------------------------------ timings
def compare_timings(a: dict, b: dict) -> dict:
    """Speed of the reproduction relative to the recording, never a pass/fail: labkit.analysis.stats'
    speedup (throughput of ``b`` / throughput of ``a``, > 1: the reproduction was faster) with
    its 95% interval (batch means over each run's steady-state step times, Welch degrees of
    freedom). Two runs of one experiment differ only by noise and machine load, so the
    interval says how large that was; a ratio near 1 is not evidence that the speeds agree."""
    from . import stats

    iv = stats.speedup(b, a)
    ci = [iv.low, iv.high] if iv.available else None
    out: dict[str, Any] = {"speed_ratio": iv.value, "ci95": ci, "steps": iv.n, "basis": iv.basis}
    if iv.value is None:
        out["note"] = f"no throughput to compare ({iv.note})" if iv.note else "no throughput to compare"
    elif ci is None:
        out["note"] = f"{iv.value:.2f}x the recorded throughput; no interval: {iv.note}"
    else:
        out["note"] = (f"{iv.value:.2f}x the recorded throughput (95% CI {iv.ci_text(ref=1.0)}, "
                       f"{iv.n} steady-state steps)")
    return out


def timing_lines(doc: dict) -> list[str]:
    """One line per method: the reproduction's speed relative to the recording."""
    return [f"{m}: {(v.get('timing') or {}).get('note', 'no result files to compare')}"
            for m, v in doc["methods"].items()]


# ------------------------------------------------------------------ environments
def load_environment(rec: RunRecord) -> dict:
    """What the comparison of environments reads from a run folder: environment.json, the
    packages of its requirements.lock, and each method's rank-0 determinism facts."""
    env = dict(rec.env)
    lock = (env.get("packages") or {}).get("file")
    path = resolve_in_run(rec.path, lock) if lock else None
    env["package_versions"] = parse_lock(path.read_text()) if path and path.exists() else None
    env["rank_determinism"] = {m: d.get("determinism") for m in rec.methods
                               if (d := rec.result(m)) and d.get("determinism")}
    return env


def _short(commit: Optional[str]) -> str:
    return commit[:10] if commit else "unknown"


def _code(git: dict) -> str:
    if not git.get("dirty"):
        return f"{_short(git.get('commit'))} (clean)"
    h = git.get("diff_sha256")
    return f"{_short(git.get('commit'))} (dirty" + (f", diff {h[:12]}" if h else "") + ")"


def environment_diff(recorded: dict, current: dict) -> list[str]:
    """Readable lines naming what differs between two environment records (as
    :func:`load_environment` returns, or environment.json plus "package_versions" for this
    machine): commit and uncommitted diff, package versions, data fingerprints, thread counts,
    device. No lines: nothing that matters differs."""
    lines: list[str] = []
    ga, gb = recorded.get("git") or {}, current.get("git") or {}
    if (ga.get("commit"), bool(ga.get("dirty")), ga.get("diff_sha256")) != \
            (gb.get("commit"), bool(gb.get("dirty")), gb.get("diff_sha256")):
        lines.append(f"code: recorded {_code(ga)}, now {_code(gb)}")
    ua, ub = set(ga.get("untracked") or []), set(gb.get("untracked") or [])
    if ua != ub:
        lines.append(f"untracked files: {len(ua - ub)} only in the recorded run, "
                     f"{len(ub - ua)} only now" + (f" (e.g. {sorted(ua ^ ub)[0]})" if ua ^ ub else ""))
    pa, pb = recorded.get("package_versions"), current.get("package_versions")
    if pa is None or pb is None:
        if pa is None:
            lines.append("packages: the recorded run has no requirements.lock (not compared)")
    else:
        changed = [f"{n} {pa[n]} -> {pb[n]}" for n in sorted(set(pa) & set(pb)) if pa[n] != pb[n]]
        gone = [f"{n} {pa[n]}" for n in sorted(set(pa) - set(pb))]
        new = [f"{n} {pb[n]}" for n in sorted(set(pb) - set(pa))]
        for what, items in (("changed", changed), ("missing now", gone), ("added", new)):
            if items:
                shown = ", ".join(items[:8]) + (f", ... ({len(items)} in all)" if len(items) > 8 else "")
                lines.append(f"packages {what}: {shown}")
    va = (recorded.get("packages") or {}).get(PROJECT)
    vb = (current.get("packages") or {}).get(PROJECT)
    if va and vb and va != vb:
        lines.append(f"{PROJECT} version: recorded {va}, now {vb}")
    for k in ("python", "torch", "platform"):
        if recorded.get(k) and current.get(k) and recorded[k] != current[k]:
            lines.append(f"{k}: recorded {recorded[k]}, now {current[k]}")
    da, db = recorded.get("data") or {}, current.get("data") or {}
    for m in sorted(set(da) & set(db)):
        why = _fingerprint_reason(da[m], db[m])
        if why:
            lines.append(f"data ({m}): {why}")
    xa, xb = recorded.get("determinism") or {}, current.get("determinism") or {}
    for k in ("torch_num_threads", "omp_num_threads_env", "deterministic_algorithms",
              "cudnn_deterministic", "cudnn_benchmark", "backend", "device", "seed"):
        if k in xa and k in xb and xa[k] != xb[k]:
            lines.append(f"{k}: recorded {xa[k]}, now {xb[k]}")
    ra, rb = recorded.get("rank_determinism") or {}, current.get("rank_determinism") or {}
    for m in sorted(set(ra) & set(rb)):
        for k in ("torch_num_threads", "deterministic_algorithms", "backend"):
            if ra[m].get(k) != rb[m].get(k):
                lines.append(f"{m} rank 0 {k}: recorded {ra[m].get(k)}, now {rb[m].get(k)}")
    gpa = [g.get("name") for g in recorded.get("gpus") or []]
    gpb = [g.get("name") for g in current.get("gpus") or []]
    if gpa != gpb:
        lines.append(f"GPUs: recorded {', '.join(gpa) or 'none'}, now {', '.join(gpb) or 'none'}")
    if recorded.get("cpu") and current.get("cpu") and recorded["cpu"] != current["cpu"]:
        lines.append(f"CPU: recorded {recorded['cpu']}, now {current['cpu']}")
    return lines


# ------------------------------------------------------------------ the whole comparison
def check_tolerance(tolerance: Optional[float]) -> None:
    """None (bit for bit) or a non-negative largest absolute difference."""
    if tolerance is not None and not tolerance >= 0:
        raise ReproduceError(f"--tolerance must be 0 or more (got {tolerance})")


def compare_runs(a: RunRecord, b: RunRecord, methods: Optional[Iterable[str]] = None,
                 tolerance: Optional[float] = None) -> dict:
    """Every chosen method of ``a`` against ``b``, plus the environments' differences; the
    document reproduction.json holds. ``reproduced``: every method identical (or within
    ``tolerance`` when one is given)."""
    check_tolerance(tolerance)
    chosen = select_methods(a, methods)
    verdicts = {m: compare_method(a, b, m, tolerance) for m in chosen}
    return {"schema": SCHEMA, "original": str(a.path), "reproduction": str(b.path),
            "tolerance": tolerance,
            "environment": environment_diff(load_environment(a), load_environment(b)),
            "methods": verdicts,
            "reproduced": all(v["verdict"] != DIFFERENT for v in verdicts.values())}


def summary_lines(doc: dict) -> list[str]:
    """The verdicts as people read them, one line per method (and one per reason)."""
    out = []
    for m, v in doc["methods"].items():
        line = f"{m}: {v['verdict']}"
        if v["verdict"] == WITHIN:
            line += f" (max abs difference {v['max_abs_diff']:.3g})"
        out.append(line)
        out += [f"  {r}" for r in v["reasons"]]
    return out


def write_reproduction(out_dir: str | os.PathLike, doc: dict) -> Path:
    """reproduction.json in ``out_dir`` (atomic; paths inside it stored relative to it)."""
    path = Path(out_dir) / layout.REPRODUCTION
    atomic_write_json(str(path), portable(doc, out_dir))
    return path
