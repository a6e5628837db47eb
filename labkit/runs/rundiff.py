"""`labkit diff RUN_A RUN_B`: what changed between two run folders and what came of it.

It is `labkit reproduce`'s comparison made general (one implementation,
labkit.runs.compare.compare_runs): the environments' differences (code commit and diff,
packages, data fingerprints, machine) and, per method, whether the runs are identical, equal
within a tolerance or different, and B's throughput over A's with its 95% interval. On top of
it: the parameters that differ, the best accuracies (or the workload's first figure: the lowest
validation loss), and both runs' loss curves on one figure.
Only what differs is shown unless everything is asked for.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Optional

from labkit.core import stats
from labkit.core.files import atomic_path
from labkit.core.methods import label
from labkit.core.results import Result
from labkit.core.run_folder import RunFolder
from labkit.report.workload_view import FigureView, number, view_of_docs

from .compare import DIFFERENT, IDENTICAL, ReproduceError, compare_runs


def diff_runs(a_dir: str | os.PathLike, b_dir: str | os.PathLike) -> dict:
    """The comparison of two run folders (ReproduceError, one line, when one is not a run)."""
    a, b = RunFolder.experiment(a_dir), RunFolder.experiment(b_dir)
    common = [m for m in a.methods if m in b.methods]
    if not common:
        raise ReproduceError(f"{str(a.path)!r} and {str(b.path)!r} share no method "
                             f"({', '.join(a.methods)} against {', '.join(b.methods)})")
    doc = compare_runs(a, b, common)
    pa, pb = a.parameters, b.parameters
    doc["parameters"] = {k: [pa.get(k), pb.get(k)] for k in sorted(set(pa) | set(pb))}
    doc["changed"] = [k for k, (x, y) in doc["parameters"].items()
                      if json.dumps(x, sort_keys=True) != json.dumps(y, sort_keys=True)]
    doc["links"] = [a.link(), b.link()]  # the emulated links as the probes measured them
    doc["only_in"] = {"a": [m for m in a.methods if m not in b.methods],
                      "b": [m for m in b.methods if m not in a.methods]}
    for m, v in doc["methods"].items():
        ra, rb = a.result(m), b.result(m)
        v["accuracy"] = [_best_accuracy(r) for r in (ra, rb)]
        view = view_of_docs([r for r in (ra, rb) if r is not None])
        if not view.guide:  # judged on another figure (a validation loss): its best, by direction
            f = view.target
            v["best"] = {"figure": f.label, "unit": f.unit, "higher_is_better": f.higher_is_better,
                         "values": [r.best_figure(f.key, f.higher_is_better) if r is not None else None
                                    for r in (ra, rb)]}
        iv = (stats.speedup(rb, ra) if ra is not None and rb is not None
              else stats.Interval(None, note="no result"))
        # "throughput 1.02x A, within the noise ...": the verdict without its leading name
        v["speed_verdict"] = "throughput " + stats.speedup_verdict("B", iv, "A").sentence.split(": ", 1)[1]
    doc["identical"] = (not doc["changed"] and not doc["environment"]
                        and all(v["verdict"] == IDENTICAL for v in doc["methods"].values()))
    return doc


def _best_accuracy(r: Optional[Result]) -> Optional[float]:
    """The best validation accuracy a result's summary records; None where it has none (or
    recorded one that was not a number)."""
    best = r.summary.best_val_accuracy if r is not None else None
    return None if best is None or math.isnan(best) else best


def _best_text(v: dict) -> str:
    """"; best accuracy 97.00% -> 97.50%", "; lowest validation loss 3.025 -> 3.010 nats/token";
    "" where either run has none."""
    best = v.get("best")
    if best is None:
        acc = v["accuracy"]
        return f"; best accuracy {acc[0]:.2f}% -> {acc[1]:.2f}%" if None not in acc else ""
    x, y = best["values"]
    if x is None or y is None:
        return ""
    f = FigureView("", best["figure"], best["unit"], best["higher_is_better"])
    return f"; {f.best_word} {f.label} {f.text(x) if f.percent else number(x)} -> {f.text(y)}"


def _value(v: Any) -> str:
    return "-" if v is None else (",".join(map(str, v)) if isinstance(v, list) else str(v))


def diff_lines(doc: dict, everything: bool = False) -> list[str]:
    """The comparison as people read it: what changed, then what came of it."""
    lines = [f"A: {doc['original']}", f"B: {doc['reproduction']}", ""]
    if doc["identical"]:
        lines.append("identical: same parameters and environment, and every method's losses, "
                     "metrics and final parameters equal bit for bit")
    shown = list(doc["parameters"]) if everything else doc["changed"]
    lines.append("changed:" if doc["changed"] or doc["environment"] else "changed: nothing")
    for k in shown:
        x, y = doc["parameters"][k]
        mark = "" if k in doc["changed"] else "  (same)"
        lines.append(f"  {k}: {_value(x)} -> {_value(y)}{mark}")
    links = doc.get("links") or ["", ""]
    if any(links) and (links[0] != links[1] or everything):
        lines.append(f"  network: {links[0] or 'one machine'} -> {links[1] or 'one machine'}")
    lines += [f"  {e}" for e in doc["environment"]]
    for side, ms in doc["only_in"].items():
        if ms:
            lines.append(f"  methods only in {side.upper()}: {', '.join(ms)}")
    lines += ["", "what came of it (B against A):"]
    for m, v in doc["methods"].items():
        lines.append(f"  {label(m)}: results {v['verdict']}; {v['speed_verdict']}" + _best_text(v))
        if v["verdict"] == DIFFERENT or everything:
            lines += [f"    {r}" for r in v["reasons"]]
    return lines


def plot_losses(doc: dict, path: str | os.PathLike) -> Optional[Path]:
    """Both runs' per-step training loss per method on one figure (A solid, B dashed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from labkit.report.figures import COLORS

    a = RunFolder.experiment(doc["original"])
    b = RunFolder.experiment(doc["reproduction"])
    fig, ax = plt.subplots(figsize=(8, 4.2), dpi=110)
    drawn = 0
    for m in doc["methods"]:
        for rec, style, side in ((a, "-", "A"), (b, "--", "B")):
            r = rec.result(m)
            losses = r.all_losses if r is not None else []
            if losses:
                ax.plot(range(1, len(losses) + 1), losses, style, lw=1.2, label=f"{side}: {label(m)}",
                        color=COLORS.get(rec.methods[m].get("method", m)))
                drawn += 1
    if not drawn:
        plt.close(fig)
        return None
    ax.set_xlabel("step (over all epochs)")
    ax.set_ylabel("training loss")
    ax.set_title(f"A: {Path(doc['original']).name}  vs  B: {Path(doc['reproduction']).name}")
    ax.legend(fontsize="small", ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    with atomic_path(str(path)) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
    return Path(path)
