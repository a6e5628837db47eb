"""A sweep over the link of an emulated cluster (``labkit sweep link=100mbit,1gbit,unshaped
--emulate-nodes 2 --methods ddp,powersgd,localsgd``): per method, throughput and time to the
target accuracy against the link rate, and the crossovers, the rate below which a method beats
DDP.

The rate of a point is the one its result files record (``link.rate_bit``, 0: unshaped), on a
log axis in Mbit/s; "unshaped" has no rate and is drawn UNSHAPED_GAP times right of the fastest
shaped rate, labelled as such. A method beats DDP at a rate when it is faster by more than the
noise: on throughput, the 95% CI of the throughput ratio (labkit.core.stats.compare_speed,
over each run's step blocks or the repeats, and its machine-load rule); on time to the target,
the 95% CI of the ratio of times over the seeds (report.seeds.time_ratio) excludes 1. The
crossover lies between the highest rate where it beats DDP and the next rate up, where it does
not; a method that beats DDP at every rate or at none has no crossover in the swept range.
Reads files only (labkit.report.sweep loads them).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from labkit.core import stats
from labkit.core.files import atomic_path
from labkit.core.methods import BASELINE, METHOD_ORDER, SPECS, label
from labkit.core.results import Result
from labkit.core.status import Status
from labkit.core.texttable import text_table

from .figures import COLORS, save_figure

#: on the log axis, unshaped sits this factor right of the fastest shaped rate
UNSHAPED_GAP = 4.0
#: on the log axis, each method's points sit this factor apart at one rate
DODGE = 1.06
#: a method beats DDP at a rate: the label its comparison gets there
FASTER, SLOWER, NOISE, SKIP = "faster", "slower", "within noise", "not judged"
BASE = BASELINE


def is_link_sweep(sw) -> bool:
    return "link" in sw.grid


# ------------------------------------------------------------------ the axis
def rate_text(rate_bit: int) -> str:
    """100_000_000 -> '100 Mbit/s'; 0 -> 'unshaped'."""
    return f"{rate_bit / 1e6:g} Mbit/s" if rate_bit else "unshaped"


def order(rate_bit: int) -> float:
    """Slow to fast; unshaped (0) fastest."""
    return rate_bit if rate_bit else math.inf


def x_positions(rates_bit) -> dict[int, float]:
    """Each rate (bit/s; 0: unshaped) -> its x in Mbit/s on a log axis: a shaped rate at
    itself, unshaped UNSHAPED_GAP x the fastest shaped rate (at 1 with none)."""
    shaped = [r for r in rates_bit if r > 0]
    top = max(shaped) / 1e6 * UNSHAPED_GAP if shaped else 1.0
    return {r: (r / 1e6 if r > 0 else top) for r in rates_bit}


def link_of(docs: list[Result]) -> Optional[dict]:
    """The link a point's runs record (labkit.launch.cluster.link_record), the first that has one."""
    return next((d.link for d in docs if isinstance(d.link, dict)
                 and isinstance(d.link.get("rate_bit"), int)), None)


# ------------------------------------------------------------------ the points
@dataclass
class At:
    """One method at one link: its runs (one per repeat) and where they ran."""
    rate_bit: int
    point: object                  # the sweep's Point
    docs: list[Result]
    goodput: Optional[float]       # the least goodput the probe measured, Mbit/s


def series(sw) -> dict[tuple[str, str], list[At]]:
    """(method, the other swept values as text) -> its completed runs per link, slow to fast."""
    out: dict[tuple[str, str], list[At]] = {}
    for p in sw.points:
        other = ", ".join(f"{k}={v}" for k, v in p.params.items() if k != "link")
        for m in METHOD_ORDER:
            docs = [d for d in (p.res.repeats.get(m) or []) if d.epochs]
            link = link_of(docs)
            if docs and link and all(d.status == Status.COMPLETED for d in docs):
                put = [g[k] for g in link.get("goodput_mbit") or [] for k in ("up", "down")
                       if isinstance(g.get(k), (int, float))]
                out.setdefault((m, other), []).append(
                    At(link["rate_bit"], p, docs, min(put) if put else None))
    return {k: sorted(v, key=lambda a: order(a.rate_bit)) for k, v in out.items()}


def _scores(sw) -> dict[tuple[str, str], dict[int, object]]:
    """(method, other) -> {rate: its seeds.Seeds against the sweep's one target}."""
    from . import seeds
    from .seeds import points_target

    goal = points_target(sw.points)
    if goal is None:
        return {}
    return {key: {a.rate_bit: seeds.score(a.point.res, key[0], goal) for a in ats}
            for key, ats in series(sw).items() if not SPECS[key[0]].bound}


# ------------------------------------------------------------------ beating DDP, and the crossover
@dataclass(frozen=True)
class Judged:
    """A method against DDP at one rate: faster | slower | within noise | not judged (no
    interval, a busy machine) | not reached, and the figure that says so."""
    rate_bit: int
    label: str
    text: str


@dataclass(frozen=True)
class Crossover:
    method: str                  # its label (with the other swept values)
    quantity: str                # "throughput" or "time to <target>"
    low: Optional[int] = None    # the highest rate where it beats DDP (None: no crossover)
    high: Optional[int] = None   # the next rate up, where it does not (0: unshaped)
    line: str = ""

    @property
    def short(self) -> str:
        """What the figure's legend says of it."""
        if self.low is not None:
            return f"crossover {rate_text(self.low).split(' ')[0]}-{rate_text(self.high)}"
        return ("not judged (see crossovers.txt)" if "not judged at any rate" in self.line else
                "no crossover in the swept range" if "no crossover" in self.line else "no data")


def judge_throughput(docs: list[Result], base: list[Result], rate_bit: int) -> Judged:
    """Throughput against DDP's at one rate: the CI of the ratio, the machine-load rule."""
    v = stats.compare_speed("m", docs, base)
    iv = v.interval
    if iv is None or iv.value is None:
        return Judged(rate_bit, SKIP, "no throughput ratio")
    if v.label in (FASTER, SLOWER, NOISE):
        return Judged(rate_bit, v.label, f"{iv.value:.2f}x DDP's throughput (95% CI "
                                         f"{iv.ci_text(ref=1.0)})")
    if v.label == "busy machine":
        took = [f"{100 * x:.0f}% while {who} ran" for who, x in (
            ("it", stats.machine_load(docs[0])), ("DDP", stats.machine_load(base[0])))
            if x is not None and x > stats.LOAD_LIMIT]
        why = (f"busy machine: other work took the CPU {' and '.join(took)}; one run is "
               f"judged under {100 * stats.LOAD_LIMIT:.0f}%")
    else:
        why = f"no interval: {iv.note}"
    return Judged(rate_bit, SKIP, f"{iv.value:.2f}x DDP's throughput ({why})")


def judge_time(a, b, rate_bit: int) -> Judged:
    """Time to the target against DDP's (seeds.Seeds each): the CI of the ratio over seeds."""
    from .seeds import time_ratio

    done = lambda s: bool(s.seconds) and all(math.isfinite(t) for t in s.kept(s.seconds))
    if not done(a):
        return Judged(rate_bit, "not reached", f"in {a.n - a.reached} of {a.n} seeds")
    if not done(b):
        return Judged(rate_bit, FASTER, "reached the target; DDP did not")
    iv = time_ratio(a, b)
    if not iv.available:
        return Judged(rate_bit, SKIP, f"{iv.value:.2f}x DDP's time (no interval over one seed: "
                                      f"--repeats 2 or more)")
    word = FASTER if iv.high < 1 else SLOWER if iv.low > 1 else NOISE
    return Judged(rate_bit, word, f"{iv.value:.2f}x DDP's time (95% CI {iv.ci_text(ref=1.0)} "
                                  f"over {a.n} and {b.n} seeds)")


def _said(j: Judged) -> str:
    return f"at {rate_text(j.rate_bit)} {j.label}: {j.text}"


def crossover(method: str, quantity: str, judged: list[Judged]) -> Crossover:
    """Where ``method`` stops beating DDP, from its comparison at each rate (any order)."""
    pts = sorted(judged, key=lambda j: order(j.rate_bit))
    head = f"{method} vs DDP, {quantity}:"
    if not pts:
        return Crossover(method, quantity, line=f"{head} no rate where both ran")
    wins = [k for k, j in enumerate(pts) if j.label == FASTER]
    detail = "; ".join(_said(j) for j in pts)
    if not any(j.label in (FASTER, SLOWER, NOISE) for j in pts):
        return Crossover(method, quantity, line=f"{head} not judged at any rate ({detail})")
    if not wins:
        how = "within noise at every rate" if all(j.label == NOISE for j in pts) else \
            "it beats DDP at no rate"
        return Crossover(method, quantity, line=f"{head} no crossover in the swept range: "
                                                f"{how} ({detail})")
    k = wins[-1]
    if k == len(pts) - 1:
        every = "at every rate" if len(wins) == len(pts) else f"even at {rate_text(pts[k].rate_bit)}"
        return Crossover(method, quantity, line=f"{head} no crossover in the swept range: "
                                                f"beats DDP {every} ({detail})")
    lo, hi = pts[k], pts[k + 1]
    below = [rate_text(j.rate_bit) for j in pts[:k] if j.label != FASTER]
    odd = f"; not faster at {', '.join(below)} below it" if below else ""
    return Crossover(method, quantity, lo.rate_bit, hi.rate_bit,
                     f"{head} beats DDP below {rate_text(hi.rate_bit)}: the crossover lies "
                     f"between {rate_text(lo.rate_bit)} and {rate_text(hi.rate_bit)} "
                     f"({_said(lo)}; {_said(hi)}{odd})")


def crossovers(sw) -> list[Crossover]:
    """Every method but DDP and a bound, on throughput and on time to the target, where DDP
    ran beside it."""
    from .seeds import points_target

    ser, scores, goal = series(sw), _scores(sw), points_target(sw.points)
    out = []
    for (m, other), ats in ser.items():
        base = {a.rate_bit: a for a in ser.get((BASE, other), [])}
        if m == BASE or not base or SPECS[m].bound:  # a bound (no sync) beats nothing
            continue
        name = label(m, other)
        both = [a for a in ats if a.rate_bit in base]
        out.append(crossover(name, "throughput", [
            judge_throughput(a.docs, base[a.rate_bit].docs, a.rate_bit) for a in both]))
        mine, ref = scores.get((m, other), {}), scores.get((BASE, other), {})
        if goal is not None and mine:
            at = f"{goal:.2f}% accuracy" if sw.view.guide else sw.view.goal(goal)
            out.append(crossover(name, f"time to {at}", [
                judge_time(mine[r], ref[r], r) for r in mine if r in ref]))
    return out


def crossover_lines(sw) -> list[str]:
    if not any(m == BASE for m, _ in series(sw)):
        return ["No DDP in this sweep: no crossover against it (add ddp to --methods)."]
    return [c.line for c in crossovers(sw)] or ["No method besides DDP ran at any link."]


# ------------------------------------------------------------------ the table, the figure, the files
def rows(sw) -> list[dict]:
    """One row per method and link: the goodput measured, throughput with its CI, time to the
    target with its CI over seeds."""
    scores, rate = _scores(sw), sw.view.rate
    out = []
    for key, ats in series(sw).items():
        for a in ats:
            t = stats.throughput(a.docs)
            s = scores.get(key, {}).get(a.rate_bit)
            out.append({"Method": label(*key), "Link": rate_text(a.rate_bit),
                        "Goodput (Mbit/s, least)": f"{a.goodput:.1f}" if a.goodput else "-",
                        f"Throughput ({rate})": f"{t.value:,.1f}" if t.value else "-",
                        "95% CI": t.ci_text(1), "CI over": t.basis if t.available else t.note or "-",
                        "Time to target (s, 95% CI)": s.time().with_ci(1) if s else "-",
                        "Seeds": s.n if s else len(a.docs)})
    return out


def _rate_axis(ax, xs: dict[int, float]) -> None:
    """Log scale in Mbit/s, a tick at each swept rate; unshaped's labelled so, not as a number."""
    from matplotlib.ticker import FixedLocator, NullLocator

    ax.set_xscale("log")
    ticks = sorted(xs.items(), key=lambda kv: kv[1])
    ax.xaxis.set_major_locator(FixedLocator([x for _, x in ticks]))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([f"{x:g}" if r else "unshaped" for r, x in ticks])
    if 0 in xs and len(xs) > 1:  # where the rates end: unshaped is no rate
        top = max(x for r, x in xs.items() if r)
        ax.axvline(math.sqrt(top * xs[0]), color="#999", ls=":", lw=1)
    lo, hi = min(xs.values()), max(xs.values())
    ax.set_xlim(lo / 1.6, hi * 1.6)
    ax.set_xlabel("link rate, each way (Mbit/s, log scale)")
    ax.grid(alpha=0.3)


def _curve(ax, xs: list[float], ivs: list, color: str, name: str, unshaped: bool) -> None:
    """Values with their 95% CI as error bars; the step to unshaped (no rate) dotted."""
    got = [(x, iv) for x, iv in zip(xs, ivs) if iv.value is not None]
    if not got:
        return
    vals = [iv.value for _, iv in got]
    err = [[v - max(0.0, iv.low) if iv.available else 0.0 for v, (_, iv) in zip(vals, got)],
           [iv.high - v if iv.available else 0.0 for v, (_, iv) in zip(vals, got)]]
    px = [x for x, _ in got]
    ax.errorbar(px, vals, yerr=err, fmt="o", capsize=4, color=color, label=name)
    cut = len(px) - 1 if unshaped and got[-1][0] == xs[-1] else len(px)
    ax.plot(px[:cut], vals[:cut], "-", color=color)
    ax.plot(px[max(0, cut - 1):], vals[max(0, cut - 1):], ":", color=color)


def plot_link(sw, axes) -> None:
    """Two panels against the link rate: throughput (error bars: its 95% CI) and time to the
    target (95% CI over seeds; x at 0: not reached); each crossover shaded in its method's
    colour on the panel of its quantity."""
    from .seeds import points_target

    ser, scores, goal = series(sw), _scores(sw), points_target(sw.points)
    rates = sorted({a.rate_bit for ats in ser.values() for a in ats}, key=order)
    pos = x_positions(rates)
    for k, (key, ats) in enumerate(ser.items()):
        # each method a little aside from the rate, so error bars at one rate do not cover
        # each other (the tick is the rate)
        aside = DODGE ** (k - (len(ser) - 1) / 2)
        color, xs = COLORS[key[0]], [pos[a.rate_bit] * aside for a in ats]
        unshaped = ats[-1].rate_bit == 0
        _curve(axes[0], xs, [stats.throughput(a.docs) for a in ats], color, label(*key), unshaped)
        if key in scores:
            ivs = [scores[key][a.rate_bit].time() for a in ats]
            _curve(axes[1], xs, ivs, color, label(*key), unshaped)
            missed = [x for x, iv in zip(xs, ivs) if iv.value is None and "reached" in iv.note]
            if missed:
                axes[1].plot(missed, [0] * len(missed), "x", color=color, ms=9,
                             label=f"{label(*key)}: not reached")
    said: dict[int, list[str]] = {0: [], 1: []}  # each panel's crossovers, in its legend's title
    for c in crossovers(sw):
        k = 0 if c.quantity == "throughput" else 1
        said[k].append(f"{c.method}: {c.short}")
        if c.low is not None:
            m = next(key for key in ser if label(*key) == c.method)[0]
            axes[k].axvspan(pos[c.low], pos[c.high], color=COLORS[m], alpha=0.13,
                            label=f"{c.method}: crossover (beats DDP below it)")
    axes[0].set_title("Throughput vs link rate (error bars: 95% CI)", fontsize=10)
    axes[0].set_ylabel(sw.view.rate_axis)
    one = all(s.n < 2 for per in scores.values() for s in per.values())
    axes[1].set_title((f"Time to {sw.view.goal(goal)}" if goal is not None else
                       "Time to target (no target)")
                      + (" (one seed: no interval)" if one else " (95% CI over seeds)"), fontsize=10)
    axes[1].set_ylabel("seconds")
    for k, ax in enumerate(axes):
        if pos:
            _rate_axis(ax, pos)
        ax.set_ylim(bottom=0)
        handles, names = ax.get_legend_handles_labels()
        if handles:  # below the panel, so the curves stay in view; the methods first
            both = sorted(zip(handles, names), key=lambda hn: "crossover" in hn[1])
            ax.legend(*zip(*both), fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16),
                      ncol=2, frameon=False, title="\n".join(said[k]) or None,
                      title_fontsize=8)
    if not ser:
        axes[0].text(0.5, 0.5, "no completed point with a recorded link", transform=axes[0].transAxes,
                     ha="center", color="#a00")


def write_link_axis(sw, out: str | os.PathLike) -> dict[str, Path]:
    """link.png and crossovers.txt under ``out`` for a sweep over the link; nothing otherwise."""
    if not is_link_sweep(sw):
        return {}

    out = Path(out)
    png = save_figure(out / "link.png", (11, 5.4), 2, lambda axes: plot_link(sw, axes))
    txt = out / "crossovers.txt"
    body = (f"Link sweep: {sw.path}\n\n" + text_table(rows(sw), empty="(no completed point with "
                                                                   "a recorded link)")
            + "\n\nCrossovers (the rate below which a method beats DDP by more than the noise):\n"
            + "\n".join(f"- {line}" for line in crossover_lines(sw)) + "\n")
    with atomic_path(str(txt)) as tmp:
        Path(tmp).write_text(body)
    return {"link_plot": png, "link_text": txt}
