"""Uncertainty for every number labkit compares: throughput, speedup vs DDP, accuracy.

Base layer: numpy and scipy only, working on results (labkit.core.results.Result, the model
of a result file), so the report, the terminal summary and bench can all call it. The choices, and why,
are docs/report-and-statistics.md (after Hoefler and Belli, SC'15: a mean with its confidence interval,
and a difference claimed only when it is larger than the noise). In short:

* **One run: batch means over the steady-state steps, with t quantiles.** Step times of one
  run are not independent, so the steps are grouped into units (the epochs when the run has 3
  or more, else blocks of about sqrt(n) steps within each epoch) and the units are what is
  counted; the mean step time is all time over all steps, its variance from the units (delta
  method), the interval Student t with units - 1 degrees of freedom. Not a bootstrap, which
  called false winners too often on simulated ties. One run is not judged when other work
  took over ``LOAD_LIMIT`` of the machine (``machine_load``); repeats in rotated order see
  what one run cannot.
* **Several repeats: a t-interval over the repeats**, the repeat being the independent unit.
* **Speedup vs DDP = throughput ratio**, an interval on its logarithm: one run each, the
  variances add (Welch-Satterthwaite degrees of freedom); repeats, a paired t-interval on the
  per-repeat log ratios.
* **Verdict**: faster / slower only when the 95% CI of the speedup excludes 1.00.
* **Accuracy**: one seed cannot separate two methods; several seeds give a paired t-interval.

Nothing is random, so the same files always render the same intervals. Files without
``step_times`` (the original guide's scripts) give an ``Interval`` whose ``available`` is
False and whose ``note`` says why; nothing raises.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

import numpy as np

from .results import Result

CONFIDENCE = 0.95
MIN_BLOCKS = 3  # fewer blocks than this (under 2 degrees of freedom): no interval
# one run is not judged when other work took more of the machine's CPU time than this while a
# compared method ran (labkit.training.instruments.timers.MachineLoad; see compare_speed)
LOAD_LIMIT = 0.10

Runs = Union[Result, Sequence[Result]]  # one result, or one per repeat


@dataclass(frozen=True)
class Interval:
    """A point estimate with its confidence interval (low/high None when not available)."""
    value: Optional[float]
    low: Optional[float] = None
    high: Optional[float] = None
    n: int = 0             # what it rests on: steady-state steps, or repeats
    basis: str = ""        # its units: "epochs", "steps" (blocks of), "repeats" or "trials"
    note: str = ""         # why there is no interval
    confidence: float = CONFIDENCE

    @property
    def available(self) -> bool:
        return self.low is not None and self.high is not None

    def ci_text(self, digits: int = 2, ref: Optional[float] = None, scale: float = 1.0) -> str:
        """'1.03-1.11', or 'n/a'. With ``ref`` (1.0 for a speedup) a bound that excludes ref
        gets more digits rather than being printed as ref itself; ``scale`` multiplies both
        bounds (100: a share in percent)."""
        if not self.available:
            return "n/a"
        return interval_text(self.low * scale, self.high * scale, digits, ref)

    def with_ci(self, digits: int, top: float = math.inf) -> str:
        """"4.2 (3.1-5.3)": the value and its interval, clipped to what the quantity can be (a
        time is not negative, an accuracy not above 100%); "value (why)" without an interval;
        without a value "not reached (why)" where the note says so, else "-"."""
        if self.value is None:
            return f"not reached ({self.note})" if "reached" in self.note else "-"
        if not self.available:
            return f"{self.value:.{digits}f} ({self.note})"
        clipped = interval_text(max(0.0, self.low), min(top, self.high), digits)
        return f"{self.value:.{digits}f} ({clipped})"


@dataclass(frozen=True)
class Verdict:
    label: str      # speedup: faster | slower | within noise | busy machine | not available
                    # accuracy: higher | lower | within noise | single seed | not available
    sentence: str
    interval: Interval = field(repr=False, default=None)


# ------------------------------------------------------------------ reading results
def step_times(doc: Result) -> Optional[list[np.ndarray]]:
    """Per epoch, the steady-state step durations (s); None if any epoch lacks them."""
    out = [np.asarray(e.step_times or [], dtype=float) for e in doc.epochs]
    if not out or any(len(x) == 0 for x in out):
        return None
    return out


def trainers_of(doc: Result) -> int:
    """The processes that train (PS: rank 0 serves and trains none)."""
    return int(doc.trainers or doc.num_workers or doc.world_size)


def images_per_step(doc: Result) -> int:
    """Units one step trains over all trainers: images, or a workload's units (tokens: the
    samples x the units each holds, labkit.core.results.Result.units_per_sample)."""
    return int(doc.batch_size) * trainers_of(doc) * doc.units_per_sample


def _listed(runs: Runs) -> list[Result]:
    return [runs] if isinstance(runs, Result) else list(runs)


def interval_text(low: float, high: float, digits: int = 2, ref: Optional[float] = None,
                  sep: str = "-", unit: str = "") -> str:
    """The one way an interval is written, "1.03-1.11": each bound with ``digits`` (more near
    ``ref``, see Interval.ci_text) and ``unit``, ``sep`` between them (the Interval's methods,
    and bounds kept apart from one: a run's row in `labkit runs`)."""
    return f"{_fmt(low, digits, ref)}{unit}{sep}{_fmt(high, digits, ref)}{unit}"


def _fmt(x: float, digits: int, ref: Optional[float]) -> str:
    s = f"{x:.{digits}f}"
    while ref is not None and x != ref and float(s) == ref and digits < 6:
        digits += 1
        s = f"{x:.{digits}f}"
    return s


# ------------------------------------------------------------------ batch means
def blocks(epochs: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(block sums, block step counts): contiguous blocks of about sqrt(n) steps, never
    spanning an epoch boundary (validation runs in between)."""
    sums, counts = [], []
    for x in epochs:
        b = max(1, round(math.sqrt(len(x))))
        for chunk in np.array_split(x, max(1, len(x) // b)):
            sums.append(chunk.sum())
            counts.append(len(chunk))
    return np.asarray(sums), np.asarray(counts, dtype=float)


def units(epochs: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray, str]:
    """(unit sums, unit step counts, basis): the epochs themselves when there are
    ``MIN_BLOCKS`` or more ("epochs"), else blocks of steps within them ("steps").

    Why epochs: a shared machine's speed wanders on a scale of tens of seconds, longer than a
    block of a few steps, so blocks of one epoch look independent when they are not and the
    interval comes out too narrow; epochs, a validation pass apart, are the longest units one
    run has and carry that wander into the interval (docs/report-and-statistics.md). Fewer than 3 epochs
    cannot give an interval from epochs, so blocks are used and the interval sees only the
    noise within epochs."""
    if len(epochs) >= MIN_BLOCKS:
        return (np.asarray([x.sum() for x in epochs]),
                np.asarray([len(x) for x in epochs], dtype=float), "epochs")
    return (*blocks(epochs), "steps")


def log_mean(epochs: Sequence[np.ndarray]) -> tuple[float, float, int, str]:
    """(log of the mean step time, its variance, number of units, their basis) by batch means over
    ``units``: the mean is all time over all steps (a ratio estimator over the units), its
    variance from the units' linearised residuals (delta method), so units of unequal length
    are weighted right."""
    sums, counts, basis = units(epochs)
    m = sums.sum() / counts.sum()
    z = (sums - m * counts) / counts.mean()
    var = z.var(ddof=1) / len(z) / (m * m) if len(z) > 1 else math.inf
    return math.log(m), var, len(z), basis


def _too_few(n_blocks: int, n_steps: int) -> str:
    return (f"too few steady-state steps for an interval ({n_steps} steps in {n_blocks} "
            f"block{'s' if n_blocks != 1 else ''}, need {MIN_BLOCKS}): run more steps or --repeats")


NO_STEPS = "no per-step times in the result file (written before labkit recorded step_times)"


# ------------------------------------------------------------------ (a) throughput
def _point(doc: Result) -> Optional[float]:
    """Steady-state throughput of one run: from its step times, else the guide's summary."""
    epochs = step_times(doc)
    if epochs is None:
        return doc.summary.avg_train_throughput
    return images_per_step(doc) * sum(len(x) for x in epochs) / sum(float(x.sum()) for x in epochs)


def throughput(runs: Runs, *, confidence: float = CONFIDENCE) -> Interval:
    """Steady-state throughput (images/s) with its CI: batch means over the steps of one run,
    or a t-interval over repeats when ``runs`` holds several. Over repeats the interval is
    taken on log throughput (value = geometric mean), as the speedup's is: with 2-3 repeats a
    t-interval on raw throughput reaches below zero, which no throughput can."""
    docs = _listed(runs)
    if len(docs) > 1:
        vals = [_point(d) for d in docs]
        if None in vals or min(vals) <= 0:
            return Interval(None, note="a repeat has no throughput")
        return t_interval(np.log(np.asarray(vals)), confidence, np.exp)
    doc = docs[0]
    epochs = step_times(doc)
    value = _point(doc)
    if epochs is None:
        return Interval(value, note=NO_STEPS)
    n = sum(len(x) for x in epochs)
    lm, var, nb, basis = log_mean(epochs)
    if nb < MIN_BLOCKS:
        return Interval(value, n=n, note=_too_few(nb, n))
    h = t_quantile(confidence, nb - 1) * math.sqrt(var)
    # throughput = k / mean step time: the interval of log(mean), mapped through k / exp
    k = images_per_step(doc)
    return Interval(value, k * math.exp(-lm - h), k * math.exp(-lm + h), n=n,
                    basis=basis, confidence=confidence)


def t_quantile(confidence: float, df: float) -> float:
    """The two-sided ``confidence`` quantile of Student's t with ``df`` degrees of freedom.

    scipy.stats is imported here, on first use, not with this module: it takes 1-2 s of CPU
    to import, which every notebook kernel and CLI process that only names a rotation or
    checks its input would otherwise pay."""
    from scipy import stats

    return float(stats.t.ppf((1 + confidence) / 2, df))


def t_interval(x: np.ndarray, confidence: float, back, basis: str = "repeats") -> Interval:
    """t-interval of the mean of ``x`` (one value per unit: repeat, round), through ``back``."""
    if np.ptp(x) == 0:
        lo = hi = x[0]
    else:
        from scipy import stats

        lo, hi = stats.ttest_1samp(x, 0.0).confidence_interval(confidence)
    return Interval(float(back(x.mean())), float(back(lo)), float(back(hi)), n=len(x),
                    basis=basis, confidence=confidence)


# ------------------------------------------------------------------ (b) speedup vs DDP
def speedup(runs: Runs, baseline: Runs, *, confidence: float = CONFIDENCE) -> Interval:
    """Throughput of ``runs`` / throughput of ``baseline`` (DDP), with its CI.

    One run each: the two runs are independent samples; the log ratio's variance is the sum
    of their batch-means variances, with Welch-Satterthwaite degrees of freedom. Repeats (the
    same number for both, repeat i paired with repeat i): t-interval on the log ratios."""
    a, b = _listed(runs), _listed(baseline)
    if len(a) > 1 or len(b) > 1:
        if len(a) != len(b):
            return Interval(None, note=f"{len(a)} repeats against {len(b)}: cannot pair them")
        ta, tb = [_point(x) for x in a], [_point(y) for y in b]
        if None in ta or None in tb:
            return Interval(None, note="a repeat has no throughput")
        return t_interval(np.log(np.asarray(ta) / np.asarray(tb)), confidence, np.exp)
    pa, pb = _point(a[0]), _point(b[0])
    value = pa / pb if pa and pb else None
    ea, eb = step_times(a[0]), step_times(b[0])
    if ea is None or eb is None:
        return Interval(value, note=NO_STEPS)
    (_, va, na, ba), (_, vb, nb, bb) = log_mean(ea), log_mean(eb)
    n = min(sum(len(x) for x in ea), sum(len(x) for x in eb))
    if min(na, nb) < MIN_BLOCKS:
        return Interval(value, n=n, note=_too_few(min(na, nb), n))
    basis = "epochs" if ba == bb == "epochs" else "steps"
    return _welch_log_ratio(value, va, na, vb, nb, n, basis, confidence)


def _welch_log_ratio(value: float, va: float, na: int, vb: float, nb: int, n: int, basis: str,
                     confidence: float) -> Interval:
    """``value`` (a ratio of two independent means) with the CI of its logarithm: variances
    ``va``, ``vb`` of the two log means from ``na``, ``nb`` units, Welch-Satterthwaite df."""
    df = (va + vb) ** 2 / (va ** 2 / (na - 1) + vb ** 2 / (nb - 1)) if va + vb > 0 else math.inf
    h = t_quantile(confidence, df) * math.sqrt(va + vb)
    return Interval(value, value * math.exp(-h), value * math.exp(h), n=n, basis=basis,
                    confidence=confidence)


def ratio_over_trials(num: Sequence[float], den: Sequence[float], *,
                      confidence: float = CONFIDENCE) -> Interval:
    """mean(num) / mean(den) for two independent sets of timed trials (``labkit bench``: the
    trials of one job, the trials of another, or a collective's repetitions), each trial one
    independent unit: the same delta-method interval on the log ratio as ``speedup``, with
    the trials in place of blocks. For a throughput ratio pass (DDP's step times, the
    method's step times). Needs 2 trials on each side."""
    a, b = np.asarray(num, dtype=float), np.asarray(den, dtype=float)
    if len(a) == 0 or len(b) == 0 or a.mean() <= 0 or b.mean() <= 0:
        return Interval(None, note="no trials")
    value = float(a.mean() / b.mean())
    n = min(len(a), len(b))
    if n < 2:
        return Interval(value, n=n, note="one trial: no interval (run more --trials)")
    va = a.var(ddof=1) / len(a) / a.mean() ** 2
    vb = b.var(ddof=1) / len(b) / b.mean() ** 2
    return _welch_log_ratio(value, va, len(a), vb, len(b), n, "trials", confidence)


# ------------------------------------------------------------------ (c) the verdict
def speedup_verdict(name: str, iv: Interval, baseline_name: str = "DDP") -> Verdict:
    """'faster' / 'slower' only when the CI excludes 1.00, else 'within noise'."""
    pct = f"{100 * iv.confidence:.0f}% CI"
    if iv.value is None:
        return Verdict("not available", f"{name}: no speedup vs {baseline_name} ({iv.note})", iv)
    head = f"{name}: {iv.value:.2f}x {baseline_name}"
    if not iv.available:
        return Verdict("not available", f"{head} (no confidence interval: {iv.note})", iv)
    ci = iv.ci_text(ref=1.0)
    if iv.low > 1.0:
        return Verdict("faster", f"{head}, {pct} {ci}", iv)
    if iv.high < 1.0:
        return Verdict("slower", f"{head}, {pct} {ci}", iv)
    if iv.basis == "repeats":
        noise, fix = f"the run-to-run noise of {iv.n} repeats", "more --repeats would resolve it"
    elif iv.basis == "trials":
        noise, fix = f"the trial-to-trial noise of {iv.n} trials", "more --trials or --steps would resolve it"
    else:
        noise, fix = "the measurement noise of this run", "more steps or --repeats would resolve it"
    return Verdict("within noise", f"{head}, within {noise} ({pct} {ci}); {fix}", iv)


def machine_load(doc: Result) -> Optional[float]:
    """The largest share of the machine's CPU time that went to other work (other processes,
    and the hypervisor's steal) in any timed epoch of this run; None when not recorded (files
    from before labkit recorded ``machine_load``, or the original guide's)."""
    shares = []
    for e in doc.epochs:
        x = e.machine_load
        parts = [x.get(k, 0.0) for k in ("background", "steal")] if isinstance(x, dict) else None
        # a hand-edited or foreign entry that is not numbers counts as not recorded
        if parts and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in parts):
            shares.append(float(sum(parts)))
    return max(shares) if shares else None


def compare_speed(name: str, runs: Runs, baseline: Runs, baseline_name: str = "DDP",
                  **kw) -> Verdict:
    """speedup() and speedup_verdict() in one call, and the load rule: one run of each method
    is not judged when other work took more than ``LOAD_LIMIT`` of the machine's CPU time while
    either ran. Its methods ran one after another, so a load that came and went falls on one
    method and not the other, and the run's own interval cannot see it (two runs, one beside
    other jobs, reached opposite verdicts: docs/performance.md). Repeats in rotated order
    spread such load over all methods and their interval holds it: they are judged as usual."""
    iv = speedup(runs, baseline, **kw)
    verdict = speedup_verdict(name, iv, baseline_name)
    a, b = _listed(runs), _listed(baseline)
    if len(a) > 1 or len(b) > 1 or not iv.available:
        return verdict
    over = [(who, x) for who, x in ((name, machine_load(a[0])), (baseline_name, machine_load(b[0])))
            if x is not None and x > LOAD_LIMIT]
    if not over:
        return verdict
    where = " and ".join(f"{100 * x:.0f}% while {who} ran" for who, x in over)
    return Verdict("busy machine",
                   f"{name}: {iv.value:.2f}x {baseline_name} ({100 * iv.confidence:.0f}% CI "
                   f"{iv.ci_text(ref=1.0)}), not judged: other work took {where} (of the "
                   f"machine's CPU time; the limit for judging one run is "
                   f"{100 * LOAD_LIMIT:.0f}%), which one run cannot tell apart from the methods' "
                   f"own speed; rerun on an idle machine or with --repeats", iv)


# ------------------------------------------------------------------ (d) accuracy
def _acc(doc: Result, final: bool = False) -> Optional[float]:
    """The summary's best validation accuracy (``final``: its final one); the guide's DDP
    summary has no final_val_accuracy: the epochs do."""
    v = doc.summary.final_val_accuracy if final else doc.summary.best_val_accuracy
    accs = [e.val_accuracy for e in doc.epochs if e.val_accuracy is not None]
    if v is None and accs:
        v = accs[-1] if final else max(accs)
    return v


@dataclass(frozen=True)
class Measure:
    """A validation figure as a verdict compares it: what it is called ("accuracy"), each
    run's value of it (None: not recorded), a value as written ("97.22%"), a difference as
    written ("+0.12") and the unit of a difference ("points"; "" for none)."""
    what: str
    of: Callable[[Result], Optional[float]]
    text: Callable[[float], str]
    signed: Callable[[float], str]
    diff_unit: str = ""

    def difference(self, v: float) -> str:
        return f"{self.signed(v)} {self.diff_unit}".rstrip()


def accuracy(final: bool = False) -> Measure:
    """The best (``final``: the final) validation accuracy, in percentage points."""
    return Measure("accuracy", lambda d: _acc(d, final), lambda v: f"{v:.2f}%",
                   lambda v: f"{v:+.2f}", "points")


def accuracy_verdict(name: str, runs: Runs, baseline: Runs, baseline_name: str = "DDP",
                     final: bool = False, confidence: float = CONFIDENCE) -> Verdict:
    """Accuracy difference (percentage points, method - baseline) and what it supports: of the
    best validation accuracy, or with ``final`` of the final one (:func:`figure_verdict`)."""
    return figure_verdict(name, runs, baseline, accuracy(final), baseline_name, confidence)


def figure_verdict(name: str, runs: Runs, baseline: Runs, measure: Measure,
                   baseline_name: str = "DDP", confidence: float = CONFIDENCE) -> Verdict:
    """A validation figure's difference (method - baseline; ``measure``: which figure, and how
    it is written) and what it supports. 'higher' / 'lower' name the difference's sign, not
    which is better: a caller that knows the figure's direction says that.

    One seed: no verdict (seed-to-seed variation is not measured by one run). Repeats with
    different seeds: paired t-interval of the per-repeat differences; 'higher'/'lower' only
    when it excludes 0."""
    a, b = _listed(runs), _listed(baseline)
    pa, pb = [measure.of(d) for d in a], [measure.of(d) for d in b]
    if None in pa or None in pb or len(a) != len(b):
        return Verdict("not available", f"{name}: {measure.what} not comparable with {baseline_name}",
                       Interval(None, note=f"missing {measure.what} or unequal repeats"))
    diff = np.asarray(pa) - np.asarray(pb)
    what = (f"{name}: {measure.text(np.mean(pa))} vs {baseline_name} {measure.text(np.mean(pb))} "
            f"({measure.difference(diff.mean())})")
    seeds = {d.config.get("seed") for d in a + b}
    if len(a) < 2 or len(seeds) < 2:
        why = ("a single seed cannot separate them" if len(a) < 2 else
               f"the {len(a)} repeats share one seed, so they cannot separate them")
        return Verdict("single seed", f"{what}; {why} (repeats with different seeds would)",
                       Interval(float(diff.mean()), n=len(a), note="single seed"))
    iv = t_interval(diff, confidence, lambda x: x)
    ci = (f"{100 * confidence:.0f}% CI {measure.signed(iv.low)} to "
          f"{measure.difference(iv.high)} over {len(a)} seeds")
    if iv.low > 0:
        return Verdict("higher", f"{what}, {ci}", iv)
    if iv.high < 0:
        return Verdict("lower", f"{what}, {ci}", iv)
    return Verdict("within noise", f"{what}, within the seed-to-seed noise ({ci}); more repeats "
                                   f"would resolve it", iv)


# ------------------------------------------------------------------ (e) repeats
@dataclass
class Aggregate:
    """One method's repeats: the throughput with its CI (over repeats if several, over steps
    if one), each repeat's throughput, the mean best and final accuracies (None when a repeat
    has none), the seeds."""
    repeats: int
    throughput: "Interval"
    throughput_per_repeat: list[float]
    best_accuracy: Optional[float]
    final_accuracy: Optional[float]
    seeds: list


def aggregate(runs: Sequence[Result], **kw) -> Aggregate:
    """One method's repeats in one :class:`Aggregate`."""
    docs = _listed(runs)
    return Aggregate(repeats=len(docs), throughput=throughput(docs, **kw),
                     throughput_per_repeat=[_point(d) for d in docs],
                     best_accuracy=_mean_of(_acc(d) for d in docs),
                     final_accuracy=_mean_of(_acc(d, final=True) for d in docs),
                     seeds=[d.config.get("seed") for d in docs])


def _mean_of(values) -> Optional[float]:
    """Mean of the values, None when any is missing (a repeat without validation)."""
    vals = list(values)
    return None if not vals or any(v is None for v in vals) else float(np.mean(vals))


def rotated_order(methods: Sequence[str], repeats: int) -> list[list[str]]:
    """Run order per repeat, rotated by one each time (ABC, BCA, CAB, ABC, ...), so a shared
    machine's slow drift falls on every method alike rather than always on the last one."""
    if repeats < 1:
        raise ValueError(f"repeats must be 1 or more (got {repeats})")
    m = list(methods)
    return [m[i % len(m):] + m[:i % len(m)] for i in range(repeats)] if m else [[] for _ in range(repeats)]
