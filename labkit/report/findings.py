"""Claims the report makes about each method's health and accuracy, each said only where the
data supports it: a diverged loss, replicas that stayed identical (not for the bound, whose
check cannot fail), and the accuracies of the exact methods apart from the others."""
from __future__ import annotations

from typing import Optional

from labkit.core.health import diverged_where, replicas_verdict
from labkit.core.methods import METHOD_ORDER, SPECS, label

from .captions import ref
from .load import RunResults
from .workload_view import WorkloadView


def exact_range_lines(acc: dict[str, float], view: Optional[WorkloadView] = None) -> list[str]:
    """The range of the exact methods' best validation accuracies (with ``view``: the best
    values of its first figure), which apply the same averaged optimizer step (said only with
    two exact methods or more; the bound is not one of them)."""
    exact = {m: a for m, a in acc.items() if a == a and _exact(m)}
    if len(exact) < 2:
        return []
    lo, hi = min(exact.values()), max(exact.values())
    names = ", ".join(label(m) for m in exact)
    if view is None:
        head = f"Best validation accuracy of the exact methods ({names}) ranged from {lo:.2f}% to {hi:.2f}%"
        step = "SGD"
    else:
        f = view.target
        head = (f"The {f.best_word} {f.label} of the exact methods ({names}) ranged from "
                f"{f.text(lo)} to {f.text(hi)}")
        step = view.optimizer_step
    return [f"{head}: they apply the same averaged {step} step, so differences come from "
            f"float summation order and, for PS, a different number of trainers; repeats "
            f"with different seeds (--repeats) measure whether they exceed the "
            f"seed-to-seed noise."]


def _exact(m: str) -> bool:
    spec = SPECS.get(m)
    return spec is not None and spec.exact and not spec.bound


def accuracy_apart(m: str, acc: float, what: str = "accuracy") -> str:
    """Why a method's accuracy (``what``: the figure it is judged on) is not judged with the
    exact methods' ("" for an exact one): the bound's ranks never average, an approximate
    method is judged over seeds."""
    spec = SPECS.get(m)
    if acc != acc or spec is None:
        return ""
    return (f"its ranks never average, so it bounds speed, not {what}" if spec.bound
            else f"an approximate method: {ref('seeds')} judges its {what} over seeds"
            if not spec.exact else "")


def health_lines(res: RunResults) -> list[str]:
    """Per method, where its loss diverged and whether its replicas stayed identical
    (labkit.core.health): "Baseline DDP: replicas identical after each of 3 epochs."."""
    out = []
    for m in METHOD_ORDER:
        d = res.docs.get(m)
        # the bound's ranks are made equal at each epoch's end: its check cannot fail
        replicas = None if SPECS[m].bound or not d else replicas_verdict(d)
        said = [t for t in (diverged_where(d), replicas) if t] if d else []
        if said:
            out.append(f"{label(m)}: {'; '.join(said)}.")
    return out
