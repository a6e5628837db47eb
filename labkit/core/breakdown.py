"""Where a step's time goes, for every method: one set of definitions for `labkit experiment`'s
report and `labkit bench`.

The loop marks the parts of every step on every trainer (labkit.training.instruments.timers.PARTS:
data, pull, compute = forward + backward, sync, optimizer, other; mean over the trainers) and each
method stamps its collectives from start to completion. A few compute-only steps (the same
step with synchronisation skipped) give the compute time the step would take alone. Then,
per step:

    data wait         = data
    compute           = the compute-only forward + backward (at most the step's own)
    exposed comm      = what synchronisation added to forward + backward, plus pull and sync
                        waits, less a parameter server's update the trainers waited through
    optimizer/server  = the optimizer step, plus that server update
    rest              = other (the loop's bookkeeping, step callbacks)
    hidden comm       = the communication's running time (the union of the collectives'
                        start-to-completion intervals; for DDP with --time-comm stats, its
                        reducer's span from the first bucket's all-reduce to the end of the
                        last) less exposed comm, at least 0: communication that ran while the
                        trainer computed (averaged over the steps that have a figure)
    overlap           = hidden / (hidden + exposed)

data + compute + exposed + optimizer/server + rest is the trainers' mean step, because the
marks tile each step; the report checks it against the step the throughput is measured from.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from . import stats
from .results import Result

#: the stacked parts, in the order a step runs them
ORDER = ("data", "compute", "exposed", "optimizer", "rest")
LABELS = {"data": "data wait", "compute": "compute (forward + backward)",
          "exposed": "exposed communication", "optimizer": "optimizer and server update",
          "rest": "the rest", "hidden": "communication hidden behind compute"}
UNTIMED = "communication not timed (--time-comm off)"
#: the default target of time to accuracy: this share of the best accuracy any method reached
TARGET_SHARE = 0.95


@dataclass(frozen=True)
class Breakdown:
    parts: dict[str, float]            # ORDER -> seconds per step
    hidden: Optional[float]            # seconds per step (over the steps with a communication
    #                                    figure); None when communication was not timed
    measured: Optional[float]          # the step the throughput is measured from (s)
    overlap: stats.Interval = field(default_factory=lambda: stats.Interval(None))

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    @property
    def comm(self) -> Optional[float]:
        """All communication per step: exposed + hidden (None if it was not timed)."""
        return None if self.hidden is None else self.parts["exposed"] + self.hidden


def split(parts: dict[str, Sequence[float]], compute_only: float,
          busy: Optional[Sequence[float]] = None,
          server: Optional[Sequence[float]] = None) -> dict[str, np.ndarray]:
    """Per step, ORDER's parts and "hidden" from the loop's parts of synchronised steps, the
    compute-only step's forward + backward, the collectives' running time (``busy``) and a
    parameter server's update time (``server``), all in seconds."""
    p = {k: np.asarray(v, dtype=float) for k, v in parts.items()}
    n = len(p["compute"])
    compute = np.minimum(p["compute"], compute_only)
    waited = p["compute"] - compute + p["pull"] + p["sync"]
    upd = np.minimum(np.asarray(server, dtype=float), waited) if server is not None else np.zeros(n)
    out = {"data": p["data"], "compute": compute, "exposed": waited - upd,
           "optimizer": p["optimizer"] + upd, "rest": p["other"]}
    out["hidden"] = (np.maximum(0.0, np.asarray(busy, dtype=float) - out["exposed"])
                     if busy is not None else np.full(n, np.nan))
    return out


def ratio_interval(num: Sequence[np.ndarray], den: Sequence[np.ndarray],
                   confidence: float = stats.CONFIDENCE) -> stats.Interval:
    """sum(num) / sum(den) over per-epoch arrays of per-step values, with its interval by batch
    means over the same units as the throughput's (stats.units: epochs, or blocks of steps),
    the ratio's variance by the delta method. Clipped to [0, 1] (a share)."""
    (ns, _, basis), (ds, _, _) = stats.units(num), stats.units(den)
    total = ds.sum()
    if total <= 0:
        return stats.Interval(None, note="no communication")
    r = float(ns.sum() / total)
    if len(ns) < stats.MIN_BLOCKS:
        return stats.Interval(r, n=len(ns), basis=basis, note="too few steps for an interval")
    z = (ns - r * ds) / ds.mean()
    half = stats.t_quantile(confidence, len(z) - 1) * math.sqrt(z.var(ddof=1) / len(z))
    return stats.Interval(r, max(0.0, r - half), min(1.0, r + half), len(z), basis,
                          confidence=confidence)


def of_result(doc: Result) -> Optional[Breakdown]:
    """A method's breakdown from its result (None: written before labkit recorded the parts
    of a step, or without its compute-only calibration)."""
    cal = (doc.calibration or {}).get("parts", {}).get("compute")
    epochs = [e for e in doc.epochs if e.step_parts]
    if not cal or not epochs or len(epochs) != len(doc.epochs):
        return None
    compute_only = float(np.mean(cal))
    per_epoch = [split(e.step_parts, compute_only, e.comm_busy_times,
                       e.server_update_times) for e in epochs]
    steps = sum(len(s["compute"]) for s in per_epoch)
    if not steps:
        return None
    mean = {k: float(sum(s[k].sum() for s in per_epoch) / steps) for k in ORDER}
    timed = all(e.comm_busy_times is not None for e in epochs)
    hidden, overlap = _hidden(per_epoch) if timed else (None, stats.Interval(None, note=UNTIMED))
    measured = [e.avg_batch_time for e in epochs if e.avg_batch_time is not None]
    return Breakdown(mean, hidden, float(np.mean(measured)) if measured else None, overlap)


def _hidden(per_epoch: Sequence[dict[str, np.ndarray]]) -> tuple[Optional[float], stats.Interval]:
    """Hidden communication per step and the overlap, over the steps whose communication has a
    figure: all of them, but for DDP's reducer statistics (labkit.training.sync.ddp) an
    epoch's last step, whose figures the reducer would give only in the next step."""
    keep = [np.isfinite(s["hidden"]) for s in per_epoch]
    hidden = [s["hidden"][k] for s, k in zip(per_epoch, keep)]
    n = sum(len(h) for h in hidden)
    if not n:
        return None, stats.Interval(None, note="no step with a communication figure")
    total = [(s["hidden"] + s["exposed"])[k] for s, k in zip(per_epoch, keep)]
    return float(sum(h.sum() for h in hidden) / n), ratio_interval(hidden, total)


def of_bench(r: dict) -> Optional[Breakdown]:
    """A bench variant's breakdown: its synchronised trials against its compute-only ones."""
    sync, alone = r.get("step_parts"), r.get("compute_parts")
    if not sync or not alone or not sync["parts"]["compute"]:
        return None
    s = split(sync["parts"], float(np.mean(alone["parts"]["compute"])),
              sync.get("busy") or None, sync.get("server") or None)
    untimed = (None, stats.Interval(None, note=UNTIMED))
    hidden, overlap = _hidden([s]) if sync.get("busy") else untimed
    return Breakdown({k: float(s[k].mean()) for k in ORDER}, hidden,
                     (r.get("step_time") or {}).get("median"), overlap)


# ------------------------------------------------------------------ who the others waited for
#: how unlikely by chance a rank's count of last arrivals must be to call it the straggler
STRAGGLER_ALPHA = 0.05


@dataclass(frozen=True)
class Waits:
    ranks: list[int]                   # the trainers' global ranks
    mean_wait: list[float]             # per rank: seconds per step waited at the sync point
    last_share: list[float]            # per rank: share of steps it arrived last (waited least)
    steps: int

    @property
    def last(self) -> int:
        """The rank that most often arrived last: the one the others waited for."""
        return self.ranks[int(np.argmax(self.last_share))]

    @property
    def consistent(self) -> bool:
        """Whether one rank held the others back: last in over half the steps, and in at least
        twice its even share (with no straggler, each of n ranks is last in about 1/n of them)
        or more often than chance allows (a one-sided binomial test against 1/n, p <
        STRAGGLER_ALPHA). Twice the even share alone meant every step for two trainers: a rank
        last in 40 of 41 steps read as no straggler."""
        share = max(self.last_share)
        if share <= 0.5:
            return False
        if share >= 2 / len(self.ranks):
            return True
        from scipy.stats import binomtest  # 1-2 s of CPU to import: on first use (core.stats)

        last = round(share * self.steps)
        return bool(binomtest(last, self.steps, 1 / len(self.ranks),
                              alternative="greater").pvalue < STRAGGLER_ALPHA)


def waits(doc: Result) -> Optional[Waits]:
    """Each trainer's wait at the synchronisation point, over every steady-state step: the
    time it was held in forward + backward, pull and sync, less its own compute-only forward
    + backward (the calibration's), at least 0. The rank that waits least arrived last. None
    without per-rank times, or with a single trainer."""
    got = [e.sync_held for e in doc.epochs]
    alone = (doc.calibration or {}).get("rank_compute")
    if not got or any(g is None for g in got) or not alone or len(got[0]["ranks"]) < 2:
        return None
    ranks = got[0]["ranks"]
    held = np.concatenate([np.asarray(g["times"], dtype=float) for g in got], axis=1)
    if held.shape[1] == 0:
        return None
    table = np.maximum(0.0, held - np.asarray([alone[r] for r in ranks], dtype=float)[:, None])
    last = np.bincount(table.argmin(axis=0), minlength=len(ranks)) / table.shape[1]
    return Waits(ranks, table.mean(axis=1).tolist(), last.tolist(), table.shape[1])


# ------------------------------------------------------------------ time to accuracy
@dataclass(frozen=True)
class TimeToAccuracy:
    target: float                      # %
    seconds: Optional[float]           # training + validation time until it was reached
    steps: Optional[int]               # None: the file does not record steps per epoch
    epoch: Optional[int]               # None: not reached

    @property
    def reached(self) -> bool:
        return self.epoch is not None


def target_accuracy(docs: dict[str, Result], given: Optional[float] = None) -> Optional[float]:
    """The target: ``given``, else TARGET_SHARE of the best validation accuracy any method
    reached (None without any epoch)."""
    if given is not None:
        return float(given)
    best = [e.val_accuracy for d in docs.values() for e in d.epochs
            if e.val_accuracy is not None and math.isfinite(e.val_accuracy)]
    return round(TARGET_SHARE * max(best), 2) if best else None


def time_to_accuracy(doc: Result, target: float) -> TimeToAccuracy:
    """When a method's validation accuracy first reached ``target``: the wall time of its
    epochs up to then (training and validation) and the steps they trained."""
    seconds, steps = 0.0, 0
    for e in doc.epochs:
        seconds += e.train_time + (e.val_time if e.val_time is not None else 0.0)
        steps = None if steps is None or e.steps is None else steps + e.steps  # guide's: none
        acc = e.val_accuracy
        if acc is not None and acc >= target:
            return TimeToAccuracy(target, seconds, steps, e.epoch)
    return TimeToAccuracy(target, None, None, None)


# ------------------------------------------------------------------ the figure
COLORS = {"data": "#8172B3", "compute": "#4C72B0", "exposed": "#DD8452", "optimizer": "#55A868",
          "rest": "#CCCCCC"}


def draw(ax, labels: Sequence[str], items: Sequence[Breakdown]) -> None:
    """Stacked bars of each item's parts (ms per step) on a matplotlib axis, a black tick at
    the measured step, and the overlap with its interval above each bar."""
    x = list(range(len(items)))
    bottom = [0.0] * len(items)
    for part in ORDER:
        vals = [1000 * b.parts[part] for b in items]
        ax.bar(x, vals, bottom=bottom, color=COLORS[part], label=LABELS[part])
        bottom = [a + v for a, v in zip(bottom, vals)]
    measured = [(i, 1000 * b.measured) for i, b in enumerate(items) if b.measured]
    if measured:
        ax.scatter([i for i, _ in measured], [m for _, m in measured], marker="_", s=600,
                   color="black", zorder=3, label="measured step (throughput's)")
    top = max([*bottom, *(m for _, m in measured)], default=1.0)
    for i, b in enumerate(items):
        ov = b.overlap
        text = ("overlap n/a" if ov.value is None else f"overlap {100 * ov.value:.0f}%"
                + (f" [{ov.ci_text(0, scale=100)}]" if ov.available else ""))
        ax.text(i, max(bottom[i], 1000 * (b.measured or 0)) + 0.03 * top, text, ha="center",
                va="bottom", fontsize=8)
    ax.set_xticks(x, list(labels))
    ax.set_ylabel("ms per training step (mean over trainers)")
    ax.set_ylim(0, 1.45 * top)
    ax.legend(fontsize=7, loc="upper center", ncol=3, frameon=False)
