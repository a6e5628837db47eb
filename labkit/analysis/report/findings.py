"""Claims the report makes about each method's health and accuracy, each said only where the
data supports it: a diverged loss, replicas that stayed identical (not for the bound, whose
check cannot fail), and the accuracies of the exact methods apart from the others."""
from __future__ import annotations

from labkit.core.health import diverged_where, replicas_verdict
from labkit.core.methods import METHOD_ORDER, SHORT, SPECS

from .load import RunResults


def accuracy_lines(acc: dict[str, float]) -> list[str]:
    """The best validation accuracies: the range of the exact methods, which apply the same
    averaged SGD step, and each other method's apart (an approximate one, or the bound, whose
    ranks never average: the reason is not summation order)."""
    acc = {m: a for m, a in acc.items() if a == a}
    spec = {m: SPECS.get(m) for m in acc}
    exact = {m: a for m, a in acc.items() if spec[m] is not None and spec[m].exact and not spec[m].bound}
    lines = []
    if len(exact) >= 2:
        lo, hi = min(exact.values()), max(exact.values())
        names = ", ".join(SHORT[m] for m in exact)
        lines.append(f"Best validation accuracy of the exact methods ({names}) ranged from {lo:.2f}% "
                     f"to {hi:.2f}%: they apply the same averaged SGD step, so differences come from "
                     f"float summation order and, for PS, a different number of trainers; repeats "
                     f"with different seeds (--repeats) measure whether they exceed the "
                     f"seed-to-seed noise.")
    for m, a in acc.items():
        if m in exact and len(exact) >= 2:
            continue
        why = ("its ranks never average, so it bounds speed, not accuracy" if spec[m] and spec[m].bound
               else "an approximate method: Table 10 judges its accuracy over seeds"
               if spec[m] and not spec[m].exact else "")
        if why and len(acc) >= 2:
            lines.append(f"{SHORT.get(m, m)} reached {a:.2f}% best validation accuracy: {why}.")
    return lines


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
            out.append(f"{SHORT[m]}: {'; '.join(said)}.")
    return out
