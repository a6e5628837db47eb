"""Compare a run folder with its reproduction, method by method, and the environments they
ran in.

    rec_a, rec_b = RunFolder.experiment("runs/a"), RunFolder.experiment("runs/b")
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

import math
import os
from pathlib import Path
from typing import Any, Iterable, Optional

from labkit.core import layout
from labkit.core.files import atomic_write_json
from labkit.core.layout import portable
from labkit.core.results import Result
from labkit.core.run_folder import RunFolder
from labkit.core.run_folder import RunFolderError as ReproduceError
from labkit.core.status import Status

from .environments import environment_diff, fingerprint_reason, load_environment

__all__ = ["ReproduceError", "select_methods", "compare_runs", "environment_diff",
           "load_environment"]

SCHEMA = "labkit.reproduction/1"
# per-epoch metrics that must reproduce (labkit.core.results.Epoch's fields, named so in
# reproduction.json; timings are compared apart, never for equality)
EPOCH_METRICS = ("train_loss", "train_accuracy", "val_loss", "val_accuracy")
IDENTICAL, WITHIN, DIFFERENT = "identical", "equal within tolerance", "different"


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
        # null: a value that was not a number (strict JSON); files from before hold NaN
        a, b = (math.nan if x is None else x for x in (a, b))
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


def _steps(doc: Result) -> list[tuple[int, int, float]]:
    """[(epoch, step within the epoch, loss)] over the run, from each epoch's per-step losses
    (the guide's all_losses: the mean over the trainers)."""
    return [(e.epoch, i + 1, v) for e in doc.epochs for i, v in enumerate(e.all_losses)]


def _metrics(doc: Result) -> tuple[str, ...]:
    """EPOCH_METRICS, then the workload's other validation figures its result file records (a
    language model's perplexity), which must reproduce too."""
    keys = [f.get("key") for f in (doc.workload or {}).get("figures") or [] if isinstance(f, dict)]
    return EPOCH_METRICS + tuple(k for k in keys if isinstance(k, str) and k not in EPOCH_METRICS)


def _compare_results(a: Result, b: Result, diff: _Diff, reasons: list[str]) -> dict:
    sa, sb = _steps(a), _steps(b)
    for n, ((ep, st, va), (_, _, vb)) in enumerate(zip(sa, sb), 1):
        diff.value(va, vb, {"step": n, "epoch": ep, "step_in_epoch": st, "metric": "loss"})
    if len(sa) != len(sb):
        reasons.append(f"{len(sa)} recorded steps, {len(sb)} reproduced")
    ea, eb = a.epochs, b.epochs
    metrics = _metrics(a)
    for x, y in zip(ea, eb):
        for k in metrics:
            vx, vy = ((getattr(x, k), getattr(y, k)) if k in EPOCH_METRICS
                      else (x.extra.get(k), y.extra.get(k)))
            if vx is not None and vy is not None:
                diff.value(vx, vy, {"epoch": x.epoch, "metric": k})
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


def _data_of(rec: RunFolder, method: str) -> Optional[dict]:
    return (rec.env.get("data") or {}).get(method)


def compare_method(a: RunFolder, b: RunFolder, method: str,
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
            if doc.status != Status.COMPLETED:
                reasons.append(f"the {who} has status {doc.status}")
        compared = _compare_results(da, db, diff, reasons)
        if not compared["steps"]:
            notes.append("no per-step losses recorded")
    if method in b.methods:
        compared["parameters"] = _compare_models(a.method_dir(method) / layout.FINAL_MODEL,
                                                 b.method_dir(method) / layout.FINAL_MODEL, diff, reasons)
    fa, fb = _data_of(a, method), _data_of(b, method)
    data_why = fingerprint_reason(fa, fb)
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
            "timing": compare_timings(da, db) if da is not None and db is not None else None}


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
def compare_timings(a: Result, b: Result) -> dict:
    """Speed of the reproduction relative to the recording, never a pass/fail: labkit.core.stats'
    speedup (throughput of ``b`` / throughput of ``a``, > 1: the reproduction was faster) with
    its 95% interval (batch means over each run's steady-state step times, Welch degrees of
    freedom). Two runs of one experiment differ only by noise and machine load, so the
    interval says how large that was; a ratio near 1 is not evidence that the speeds agree."""
    from labkit.core import stats

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


# ------------------------------------------------------------------ the whole comparison
def select_methods(rec: RunFolder, methods: Optional[Iterable[str]] = None) -> list[str]:
    """The methods to compare: all of the run's, or those asked for, each one the run had."""
    if methods is None:
        return list(rec.methods)
    chosen = list(methods)
    missing = [m for m in chosen if m not in rec.methods]
    if missing or not chosen:
        raise ReproduceError(f"run {str(rec.path)!r} has no method {', '.join(missing) or '(none)'}"
                             f" (it ran: {', '.join(rec.methods)})")
    return chosen


def check_tolerance(tolerance: Optional[float]) -> None:
    """None (bit for bit) or a non-negative largest absolute difference."""
    if tolerance is not None and not tolerance >= 0:
        raise ReproduceError(f"--tolerance must be 0 or more (got {tolerance})")


def compare_runs(a: RunFolder, b: RunFolder, methods: Optional[Iterable[str]] = None,
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
