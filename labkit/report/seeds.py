"""Methods judged over seeds (`labkit experiment --repeats N`: repeat i trains every method
from seed + i - 1): time and steps to the target accuracy, final accuracy and bytes on the
wire, each with its interval, and a verdict per method against DDP (and against DDP with bf16
gradients where it ran) that says both how fast and whether accuracy was lost.

This is how an approximate method (compression, local SGD, DiLoCo) is judged fairly: a method
that sends less is worth it only if it reaches the same accuracy sooner, and one seed cannot
show that (Agarwal et al., MLSys 2022).

The scoring rule, MLPerf Training's: each seed's time to the target is the wall time of its
epochs (training and validation) up to the first validation at or above it; a seed that never
reaches it (or diverged) counts as infinitely slow, not as missing; where N >= 5 the fastest
and the slowest seed are dropped; the mean of the rest is the method's time, with a t-interval
over them. If a seed that remains never reached the target, the method has no time to target:
it is reported as "not reached" with how many seeds did reach it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from labkit.core import stats
from labkit.core.config import VARIANTS
from labkit.core.health import diverged_where
from labkit.core.methods import BASELINE, METHOD_ORDER, SHORT, SPECS, label  # noqa: F401 (SHORT: tests read seeds.SHORT)
from labkit.core.results import Result
from labkit.core.status import Status
from labkit.core.texttable import text_table, two_decimals

from .blocks import Block, Figure, Markdown, Shown, Table, TableCaption, plain, shown
from .figures import COLORS, plot_key
from .load import RunResults, runs_of
from .tables import target, target_text, wire_mb
from .workload_view import measure, target_value, time_to_target, view_of_docs

#: where N >= DROP_FROM, the fastest and the slowest seed are dropped (MLPerf's rule)
DROP_FROM = 5
#: the baselines every method is judged against, in this order, where they ran: the guide's
#: baseline (DDP), then its variant with bf16 gradients
BASELINES = tuple(v for v, fields in VARIANTS.items() if fields["method"] == BASELINE
                  and fields.get("compress", "none") in ("none", "bf16"))


@dataclass
class Seeds:
    """One method's runs, one per seed, scored by the rule above."""
    method: str
    seeds: list                                   # each run's seed
    seconds: list[float]                          # to the target; inf: never reached
    steps: list[float]                            # the same, in training steps
    final: list[Optional[float]]                  # final value of the first figure (accuracy, %)
    failed: list[str] = field(default_factory=list)  # "seed 3: diverged at epoch 2 step 4 (of 9)"
    mb_per_step: Optional[float] = None           # sent per trainer per step, mean over seeds

    @property
    def n(self) -> int:
        return len(self.seconds)

    @property
    def reached(self) -> int:
        return sum(math.isfinite(s) for s in self.seconds)

    def kept(self, values: list[float]) -> list[float]:
        """``values`` (per seed) with the fastest and slowest seed's dropped where N >= 5 (by
        time to target, never-reached seeds the slowest)."""
        if self.n < DROP_FROM:
            return list(values)
        order = sorted(range(self.n), key=lambda i: self.seconds[i])
        return [values[i] for i in sorted(order[1:-1])]

    def time(self) -> stats.Interval:
        return _mean_interval(self.kept(self.seconds), f"{self.reached} of {self.n} seeds reached it")

    def steps_to(self) -> stats.Interval:
        return _mean_interval(self.kept(self.steps), f"{self.reached} of {self.n} seeds reached it")

    def final_accuracy(self) -> stats.Interval:
        return _mean_interval([v for v in self.final if v is not None], "no validation accuracy")


def _mean_interval(values: list[float], note: str) -> stats.Interval:
    """Mean with a t-interval over seeds; None (with ``note``) where any seed never got there."""
    if not values or not all(math.isfinite(v) for v in values):
        return stats.Interval(None, n=len(values), basis="seeds", note=note)
    if len(values) < 2:
        return stats.Interval(values[0], n=1, basis="seeds", note="one seed")
    return stats.t_interval(np.asarray(values, dtype=float), stats.CONFIDENCE, lambda x: x, "seeds")


def _exact(m: str) -> bool:
    return SPECS[m].exact if m in SPECS else VARIANTS[m].get("compress", "none") == "none"


def score(res: RunResults, m: str, goal: float) -> Seeds:
    """Method ``m``'s runs against the target ``goal`` of the first figure (the guide's
    validation accuracy, %)."""
    s = Seeds(m, [], [], [], [])
    mbs, view = [], res.view
    for d in runs_of(res, m):
        seed = d.config.get("seed", "-")
        tta = time_to_target(view, d, goal)
        s.seeds.append(seed)
        s.seconds.append(tta.seconds if tta.reached else math.inf)
        s.steps.append(float(tta.steps) if tta.reached and tta.steps is not None else math.inf)
        if view.guide:
            accs = [e.val_accuracy for e in d.epochs if e.val_accuracy is not None]
            s.final.append(accs[-1] if accs else None)
        else:
            s.final.append(d.final_figure(view.target.key))
        why = diverged_where(d) or (d.error if d.status is Status.FAILED else None)
        if why or d.status is not Status.COMPLETED:
            s.failed.append(f"seed {seed}: {why or d.status.value}")
        w = wire_mb(d) if d.epochs else None
        if w is not None:
            mbs.append(w[0])
    s.mb_per_step = float(np.mean(mbs)) if mbs else None
    return s


def judged(res: RunResults) -> list[str]:
    """The methods this part judges: every one that ran, in the registry's order, but a bound
    (nosync's ranks drift apart: its accuracy means nothing)."""
    methods = [m for m in METHOD_ORDER if runs_of(res, m) and not SPECS[m].bound]
    return methods + [v for v in VARIANTS if v not in SPECS and runs_of(res, v)]


def has_seeds(res: RunResults) -> bool:
    """Whether some method ran from more than one seed."""
    return any(len({d.config.get("seed") for d in runs_of(res, m)}) > 1
               for m in judged(res))


def rows(res: RunResults) -> list[dict]:
    """One row per method: seeds, how many reached the target, time and steps to it and the
    final accuracy (mean, 95% CI over seeds), MB per step on the wire, failed seeds."""
    goal, view = target(res), res.view
    f = view.target
    final = ("Final accuracy (%, 95% CI)" if view.guide else
             f"Final {f.label} ({f.unit + ', ' if f.unit else ''}95% CI)")
    out = []
    for m in judged(res):
        s = score(res, m, goal) if goal is not None else None
        if s is None:
            continue
        out.append({"Method": label(m), "Exact": "yes" if _exact(m) else "no",
                    "Seeds": s.n, "Reached": f"{s.reached} of {s.n}",
                    "Time to target (s, 95% CI)": s.time().with_ci(1),
                    "Steps to target (95% CI)": s.steps_to().with_ci(0),
                    final: s.final_accuracy().with_ci(2, 100.0) if view.guide
                    else s.final_accuracy().with_ci(3),
                    "MB/step sent": f"{s.mb_per_step:.3f}" if s.mb_per_step is not None else "-",
                    "Failed": "; ".join(s.failed) or "-"})
    return out


# ------------------------------------------------------------------ verdicts
def time_ratio(a: Seeds, b: Seeds) -> stats.Interval:
    """Time to target of ``a`` over ``b``'s: the ratio of the kept seeds' mean times with the
    delta-method interval of two independent sets (labkit.core.stats.ratio_over_trials);
    None where either has no time (a kept seed never reached the target)."""
    ta, tb = a.kept(a.seconds), b.kept(b.seconds)
    if not all(math.isfinite(t) for t in ta + tb):
        return stats.Interval(None, note="a seed never reached the target")
    iv = stats.ratio_over_trials(ta, tb)
    return stats.Interval(iv.value, iv.low, iv.high, iv.n, "seeds", iv.note.replace("trial", "seed"))


def verdict(res: RunResults, m: str, base: str, goal: float) -> str:
    """One line: ``m`` against ``base`` on time to target (faster / slower / within noise /
    not reached) and on final accuracy (lost / gained / kept within noise)."""
    a, b = score(res, m, goal), score(res, base, goal)
    name, bname, view = label(m), label(base), res.view
    if a.reached < a.n and not math.isfinite(max(a.kept(a.seconds))):
        at = f"{goal:.2f}%" if view.guide else view.target.text(goal)
        speed = (f"did not reach {at} in {a.n - a.reached} of {a.n} seeds, so it has no "
                 f"time to target (counted as not reached, not dropped)")
    else:
        iv = time_ratio(a, b)
        if iv.value is None:
            speed = f"no time ratio against {bname} ({iv.note})"
        elif not iv.available:
            speed = f"{iv.value:.2f}x {bname}'s time to target ({iv.note})"
        else:
            word = ("faster" if iv.high < 1 else "slower" if iv.low > 1 else "within noise")
            speed = (f"{word}: {iv.value:.2f}x {bname}'s time to target "
                     f"(95% CI {iv.ci_text(ref=1.0)} over {a.n} and {b.n} seeds)")
    acc = stats.figure_verdict(name, runs_of(res, m), runs_of(res, base), measure(view, final=True), bname)
    return f"{name} vs {bname}: {speed}; {_lost(view, acc.label)}: {acc.sentence.split(': ', 1)[-1]}"


def _lost(view, verdict: str) -> str:
    """A final figure's verdict in words: "accuracy lost" (lower accuracy), "validation loss
    worse" (higher loss), "no accuracy lost beyond the noise"."""
    f = view.target
    what = "accuracy" if view.guide else f.label
    if view.guide:
        words = {"lower": "accuracy lost", "higher": "accuracy gained"}
    else:
        worse, better = ("lower", "higher") if f.higher_is_better else ("higher", "lower")
        words = {worse: f"{what} worse", better: f"{what} better"}
    words["within noise"] = (f"no {what} lost beyond the noise" if view.guide else
                             f"{what} the same within the noise")
    return words.get(verdict, f"{what}: {verdict}")


def verdicts(res: RunResults) -> list[str]:
    goal = target(res)
    if goal is None:
        return []
    bases = [b for b in BASELINES if runs_of(res, b)]
    # each method against each baseline; a baseline against the ones before it only
    return [verdict(res, m, b, goal) for b in bases for m in judged(res)
            if m not in BASELINES[:BASELINES.index(b) + 1]]


# ------------------------------------------------------------------ the report's part
def seeds_blocks(res: RunResults, plots: Optional[list] = None) -> list[Block]:
    """The report's part (blocks): the table, the verdict lines and the two figures (accuracy
    against wall time and against bytes sent, from ``plots``: write_plots' PNGs); none for a
    run with one seed per method (the report's "Not in this run" line says how to add them)."""
    if not has_seeds(res):
        return []
    table, said = rows(res), [f"- {line}" for line in verdicts(res)]
    return [TableCaption("seeds", res.view, {"target": target_text(res), "drop": DROP_FROM}),
            Table(table, text_table(table, two_decimals)),
            Markdown("\n".join(said), plain=(*said, "")),
            *(Figure(plot_key(png.stem), png, res.view) for png in plots or []
              if plot_key(png.stem) in SEED_PLOTS)]


def seeds_section(res: RunResults, plots: Optional[list] = None) -> list[Shown]:
    """The part as the notebook shows it (none with one seed per method)."""
    return shown(seeds_blocks(res, plots))


def seeds_text(res: RunResults) -> list[str]:
    """The same for performance_report.txt (empty with one seed per method)."""
    return plain(seeds_blocks(res))


# ------------------------------------------------------------------ the figures
SEED_PLOTS = ("accuracy_vs_time", "accuracy_vs_bytes")


def _curve(d: Result, mb_per_step: Optional[float],
           key: str = "val_accuracy") -> tuple[list[float], list[float], list[float]]:
    """(seconds, MB sent per trainer, the validation figure ``key``) at each epoch's end."""
    t, mb, acc, st, sb = [], [], [], 0.0, 0.0
    for e in d.epochs:
        st += e.train_time + (e.val_time if e.val_time is not None else 0.0)
        w = e.wire or {}
        sent = [x for x, tr in zip(w.get("sent_per_step") or [], w.get("trainer") or []) if tr]
        per_step = float(np.mean(sent)) / 1e6 if sent else (mb_per_step or 0.0)
        sb += per_step * (e.steps if e.steps is not None else 0)
        v = e.val_accuracy if key == "val_accuracy" else e.figure(key)
        if v is not None:
            t.append(st), mb.append(sb), acc.append(v)
    return t, mb, acc


def plot_seeds(res: RunResults, ax, against: str) -> None:
    """Validation accuracy against wall time (``against`` "time") or against the MB a trainer
    sent (``"bytes"``): every seed faint, the mean over seeds bold, the target dashed."""
    goal, drawn, f = target(res), False, res.view.target
    for k, m in enumerate(judged(res)):
        curves = [_curve(d, None, f.key) for d in runs_of(res, m)]
        curves = [c for c in curves if c[2]]
        if not curves:
            continue
        x_of = (lambda c: c[0]) if against == "time" else (lambda c: c[1])
        if against == "bytes" and not any(x > 0 for c in curves for x in x_of(c)):
            continue  # nothing sent: no place on a log axis
        for c in curves:
            ax.plot(x_of(c), c[2], "-", color=COLORS[m], lw=0.8, alpha=0.3)
        n = min(len(c[2]) for c in curves)
        # distinct markers: exact methods' curves lie on top of each other
        ax.plot(np.mean([x_of(c)[:n] for c in curves], axis=0),
                np.mean([c[2][:n] for c in curves], axis=0), "-" + "osD^v"[k % 5],
                color=COLORS[m], ms=7 - k % 3 * 2, lw=2, label=f"{label(m)} ({len(curves)} seeds)")
        drawn = True
    if goal is not None:
        ax.axhline(goal, ls="--", color="#555", lw=1,
                   label=f"target {goal:.2f}%" if res.view.guide else f"target {f.text(goal)}")
    if against == "bytes":
        from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

        ax.set_xscale("log")
        ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1, 2, 5)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("MB sent per trainer (cumulative, log scale)")
    else:
        ax.set_xlabel("wall time (s): training and validation")
    name = "Accuracy" if res.view.guide else f.label[:1].upper() + f.label[1:]
    ax.set_title(f"{name} against {'bytes sent' if against == 'bytes' else 'wall time'}")
    ax.set_ylabel("validation accuracy (%)" if res.view.guide else f.column)
    ax.grid(alpha=0.3)
    if drawn:
        ax.legend(fontsize=8)


def points_target(points) -> Optional[float]:
    """One target for every point of a sweep (each with ``name`` and ``res``): the sweep's
    --target (or --target-accuracy), else the default rule over every point (95% of the best
    validation accuracy any method reached at any point: labkit.core.breakdown; 105% of the
    lowest loss: labkit.report.workload_view)."""
    given = next((g for p in points if (g := p.res.given_target[0]) is not None), None)
    docs = {f"{p.name}/{m}/{i}": d for p in points for m, ds in p.res.repeats.items()
            for i, d in enumerate(ds)}
    return target_value(view_of_docs(docs.values()), docs, given)
