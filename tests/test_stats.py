"""labkit.core.stats: intervals checked against independent computations, verdicts that respect the
noise, and result files without step_times."""
from __future__ import annotations

import math
import re

import numpy as np
import pytest
from scipy import stats as sps

from labkit.core import stats as S
from labkit.core.results import Result

Z = sps.norm.ppf(0.975)


#: the figures every epoch of a result file has (the guide's); these tests do not read them
GUIDE_EPOCH = {"train_loss": 1.0, "train_accuracy": 50.0, "train_time": 1.0, "train_throughput": 100.0}


def doc(times, batch=32, trainers=4, epochs=3, acc=90.0, seed=0) -> Result:
    """A result holding ``times`` as steady-state step times over ``epochs`` epochs."""
    per = np.array_split(np.asarray(times, dtype=float), epochs)
    return Result.from_dict(
        {"method": "x", "batch_size": batch, "world_size": trainers, "trainers": trainers,
         "epochs": [{**GUIDE_EPOCH, "epoch": i + 1, "step_times": p.tolist(), "val_accuracy": acc}
                    for i, p in enumerate(per)],
         "summary": {"avg_train_throughput": 123.0, "best_val_accuracy": acc},
         "config": {"seed": seed}})


def guide_doc(throughput=90.0) -> Result:
    """A result file as the original guide's scripts write it: no step_times."""
    return Result.from_dict(
        {"method": "Baseline DDP (PyTorch)", "world_size": 4, "batch_size": 32,
         "epochs": [{**GUIDE_EPOCH, "epoch": 1, "train_throughput": throughput, "val_accuracy": 97.0}],
         "summary": {"avg_train_throughput": throughput, "best_val_accuracy": 97.0}})


# ------------------------------------------------------------------ against independent computations
def test_throughput_ci_matches_delta_method():
    """Large iid normal sample in one epoch (blocks of steps are the units): the CI of k/mean
    agrees with the analytic delta-method interval k/m +- z * k * sd / (sqrt(n) m^2)."""
    g = np.random.default_rng(7)
    n, k = 3000, 32 * 4
    t = g.normal(0.30, 0.03, n)
    iv = S.throughput(doc(t, epochs=1))
    m, sd = t.mean(), t.std(ddof=1)
    assert iv.value == pytest.approx(k / m, rel=1e-12)  # images over time, as train_throughput
    half = Z * k * sd / (math.sqrt(n) * m * m)
    assert iv.available and iv.basis == "steps" and iv.n == n
    assert iv.low == pytest.approx(k / m - half, abs=0.2 * half)
    assert iv.high == pytest.approx(k / m + half, abs=0.2 * half)


def test_speedup_ci_matches_delta_method():
    """Ratio of two independent throughputs (one epoch each): delta method on the log ratio,
    var = sa^2/(na ma^2) + sb^2/(nb mb^2); images per step differ (PS: 3 trainers of 4)."""
    g = np.random.default_rng(8)
    a, b = g.normal(0.28, 0.04, 2500), g.normal(0.30, 0.03, 2000)
    iv = S.speedup(doc(a, trainers=3, epochs=1), doc(b, trainers=4, epochs=1))
    r = (96 / a.mean()) / (128 / b.mean())
    assert iv.value == pytest.approx(r, rel=1e-12)
    se = math.sqrt(a.var(ddof=1) / (len(a) * a.mean() ** 2) + b.var(ddof=1) / (len(b) * b.mean() ** 2))
    lo, hi = r * math.exp(-Z * se), r * math.exp(Z * se)
    tol = 0.2 * (hi - lo) / 2
    assert iv.low == pytest.approx(lo, abs=tol) and iv.high == pytest.approx(hi, abs=tol)


@pytest.mark.parametrize("epochs", [1, 3])  # blocks of steps; epochs
def test_block_bootstrap_widens_for_correlated_steps(epochs):
    """Step times that drift (AR(1), phi 0.8) hold less information than as many independent
    ones: the interval (units: blocks of steps in one epoch, or the epochs) is wider than a
    plain per-step percentile bootstrap, and covers the true throughput more often over many
    simulated runs."""
    g = np.random.default_rng(3)
    k, mu, hits_block, hits_iid, wider = 128, 0.3, 0, 0, 0
    runs = 150
    for _ in range(runs):
        e = np.empty(600)
        e[0] = g.normal(0, 0.02)
        for i in range(1, len(e)):
            e[i] = 0.8 * e[i - 1] + g.normal(0, 0.02 * math.sqrt(1 - 0.64))
        t = mu + e
        iv = S.throughput(doc(t, epochs=epochs))
        assert iv.basis == ("steps" if epochs == 1 else "epochs")
        # independent comparison: a hand-written percentile bootstrap resampling single steps
        boot = k / g.choice(t, size=(999, len(t))).mean(axis=1)
        lo, hi = np.quantile(boot, [0.025, 0.975])
        hits_block += iv.low <= k / mu <= iv.high
        hits_iid += lo <= k / mu <= hi
        wider += (iv.high - iv.low) > (hi - lo)
    assert wider / runs > 0.9
    assert hits_block > hits_iid
    assert hits_block / runs >= 0.8


def test_repeats_give_a_t_interval_over_repeats():
    """Several repeats: the CI is the t-interval of the per-repeat throughputs; a speedup's is
    the paired t-interval of log ratios, exponentiated (hand-computed here)."""
    g = np.random.default_rng(4)
    meth = [doc(g.normal(m, 0.02, 30)) for m in (0.30, 0.31, 0.29, 0.30)]
    base = [doc(g.normal(m, 0.02, 30)) for m in (0.32, 0.33, 0.31, 0.33)]
    thr = np.array([128 * 30 / sum(sum(e.step_times) for e in d.epochs) for d in meth])
    iv = S.throughput(meth)
    lt = np.log(thr)  # on log throughput: the geometric mean and bounds that stay positive
    h = sps.t.ppf(0.975, 3) * lt.std(ddof=1) / 2
    assert iv.basis == "repeats" and iv.n == 4
    assert (iv.value, iv.low, iv.high) == pytest.approx(tuple(np.exp([lt.mean(), lt.mean() - h, lt.mean() + h])))
    thb = np.array([128 * 30 / sum(sum(e.step_times) for e in d.epochs) for d in base])
    lr = np.log(thr / thb)
    h = sps.t.ppf(0.975, 3) * lr.std(ddof=1) / 2
    sp = S.speedup(meth, base)
    assert (sp.value, sp.low, sp.high) == pytest.approx(tuple(np.exp([lr.mean(), lr.mean() - h, lr.mean() + h])))
    agg = S.aggregate(meth)
    assert agg.repeats == 4 and agg.throughput_per_repeat == pytest.approx(thr.tolist())
    assert "CI" in S.speedup_verdict("M", S.speedup(meth[:2], base[:2])).sentence


def test_two_wildly_different_repeats_keep_a_positive_interval():
    """With 2 repeats the t quantile is 12.7: a raw-scale interval went below zero."""
    g = np.random.default_rng(5)
    reps = [doc(g.normal(m, 0.005, 30)) for m in (0.2, 0.6)]
    iv = S.throughput(reps)
    assert iv.available and 0 < iv.low < iv.value < iv.high


def test_aggregate_tolerates_a_repeat_without_validation():
    g = np.random.default_rng(6)
    reps = [doc(g.normal(0.3, 0.01, 30)) for _ in range(2)]
    reps[1].summary.best_val_accuracy = None
    for e in reps[1].epochs:
        e.val_accuracy = None
    agg = S.aggregate(reps)
    assert agg.repeats == 2 and agg.throughput.available
    assert agg.best_accuracy is None and agg.final_accuracy is None


def test_percentile_bootstrap_agrees_for_independent_steps():
    """An independent computation: a hand-written percentile bootstrap over single steps (right
    when steps are independent) gives the same interval for a large iid sample."""
    g = np.random.default_rng(5)
    t = g.gamma(50, 0.006, 3000)  # skewed like real step times; 2 epochs: ~76 blocks of steps
    iv = S.throughput(doc(t, epochs=2))
    boot = 128 / g.choice(t, size=(4000, len(t))).mean(axis=1)
    lo, hi = np.quantile(boot, [0.025, 0.975])
    tol = 0.2 * (hi - lo) / 2
    assert iv.low == pytest.approx(lo, abs=tol) and iv.high == pytest.approx(hi, abs=tol)
    assert S.throughput(doc(t, epochs=2)) == iv  # nothing random: the same files, the same interval


# ------------------------------------------------------------------ verdicts
SENT = re.compile(r"^Manual All-Reduce: \d\.\d\dx DDP, 95% CI \d\.\d{2,}-\d\.\d{2,}$")


def test_clear_win_and_loss_and_tie():
    g = np.random.default_rng(9)
    fast, slow = g.normal(0.25, 0.02, 24), g.normal(0.33, 0.02, 24)
    win = S.compare_speed("Manual All-Reduce", doc(fast), doc(slow))
    assert win.label == "faster" and SENT.match(win.sentence), win.sentence
    assert win.interval.low > 1
    loss = S.compare_speed("Manual All-Reduce", doc(slow), doc(fast))
    assert loss.label == "slower" and SENT.match(loss.sentence) and loss.interval.high < 1
    # a tie: the same step times in another order
    tie = S.compare_speed("Manual All-Reduce", doc(slow), doc(g.permutation(slow)))
    assert tie.label == "within noise", tie.sentence
    assert tie.sentence.startswith("Manual All-Reduce: 1.00x DDP, within the measurement noise of this run (95% CI 0.")
    assert tie.sentence.endswith("); more steps or --repeats would resolve it")


@pytest.mark.parametrize("ratio,phi,max_false,max_contradictions", [
    (1.0, 0.0, 0.07, 6),     # a true tie, independent steps
    (1.0, 0.5, 0.15, 15),    # a true tie, correlated steps (the method's known weak spot)
    (1.02, 0.0, None, 0),    # a small true difference, near the noise
    (1.03, 0.0, None, 0),    # a small true difference, just above it
])
def test_same_distribution_rarely_contradicts(ratio, phi, max_false, max_contradictions):
    """1000 pairs of runs whose step times come from the same distributions. A 95% interval
    calls a false winner in 5% of runs of a true tie (2.5% each way), so a pair of runs
    contradicts itself (one 'faster', one 'slower') with probability 2 x 0.025^2 = 0.125%:
    'never' is not a property any 95% interval has. Checked: the false-call rate is the
    nominal one (calibrated, neither too narrow nor uselessly wide), contradictions stay at
    the rate that implies (Poisson mean 1.25; 6 or fewer with probability 0.9998), and with a
    real difference two runs never contradict while many see it. The epochs are the units (3
    here, t with about 4 degrees of freedom for the ratio): a 2% difference with 3% step noise
    and 10 steps per epoch is seen by ~40% of runs, a 3% one by most."""
    g = np.random.default_rng(int(100 * ratio + 10 * phi))

    def steps(mu):
        e = np.empty(30)
        e[0] = g.normal(0, 0.03)
        for i in range(1, 30):
            e[i] = phi * e[i - 1] + g.normal(0, 0.03 * math.sqrt(1 - phi * phi))
        return mu * (1 + e)

    labels = [S.compare_speed("M", doc(steps(0.3 / ratio)), doc(steps(0.3))).label for _ in range(2000)]
    pairs = list(zip(labels[::2], labels[1::2]))
    contradictions = sum(set(p) == {"faster", "slower"} for p in pairs)
    assert contradictions <= max_contradictions
    if ratio == 1.0:
        false_calls = sum(l != "within noise" for l in labels) / len(labels)
        assert (0.03 if phi == 0 else 0.0) <= false_calls <= max_false, false_calls
    else:
        assert "slower" not in labels
        assert labels.count("faster") > len(labels) * (0.3 if ratio < 1.03 else 0.5)


def test_ci_text_never_prints_an_excluded_one_as_one():
    iv = S.Interval(1.03, 1.0004, 1.06, n=30, basis="steps")
    assert iv.ci_text(ref=1.0) == "1.0004-1.06"
    assert S.speedup_verdict("M", iv).label == "faster"


# ------------------------------------------------------------------ files without step_times
def test_missing_step_times_is_not_available():
    old, new = guide_doc(90.0), doc(np.full(30, 0.3))
    iv = S.throughput(old)
    assert not iv.available and iv.value == 90.0 and "step" in iv.note
    sp = S.speedup(old, guide_doc(80.0))
    assert not sp.available and sp.value == pytest.approx(90 / 80)
    v = S.speedup_verdict("Manual All-Reduce", sp)
    assert v.label == "not available" and "1.12x DDP" in v.sentence and "no confidence interval" in v.sentence
    assert S.compare_speed("M", new, old).label == "not available"
    half = doc(np.full(30, 0.3))
    half.epochs[1].step_times = None  # one epoch without: no interval rather than a partial one
    assert not S.throughput(half).available
    agg = S.aggregate([old])
    assert agg.throughput.value == 90.0 and not agg.throughput.available


def test_too_few_steps_is_not_available():
    # a tiny test run: 2 steady-state steps, i.e. 2 blocks (1 degree of freedom)
    iv = S.throughput(doc([0.3, 0.32], epochs=1))
    assert not iv.available and "too few" in iv.note and iv.value == pytest.approx(128 * 2 / 0.62)
    assert S.compare_speed("M", doc([0.3] * 2, epochs=1), doc([0.3] * 30)).label == "not available"


# ------------------------------------------------------------------ accuracy
def test_accuracy_verdicts():
    one = S.accuracy_verdict("Manual All-Reduce", doc([0.3] * 30, acc=98.05), doc([0.3] * 30, acc=98.61))
    assert one.label == "single seed" and "a single seed cannot separate them" in one.sentence
    assert "-0.56 points" in one.sentence
    same_seed = S.accuracy_verdict("M", [doc([0.3], acc=a) for a in (97, 98)],
                                   [doc([0.3], acc=a) for a in (96, 97)])
    assert same_seed.label == "single seed" and "share one seed" in same_seed.sentence
    hi = S.accuracy_verdict("M", [doc([0.3], acc=a, seed=s) for s, a in enumerate((97.0, 97.5, 97.2, 97.4))],
                            [doc([0.3], acc=a, seed=s) for s, a in enumerate((95.0, 95.4, 95.3, 95.1))])
    d = np.array([2.0, 2.1, 1.9, 2.3])
    lo = d.mean() - sps.t.ppf(0.975, 3) * d.std(ddof=1) / 2
    assert hi.label == "higher" and hi.interval.low == pytest.approx(lo)
    noise = S.accuracy_verdict("M", [doc([0.3], acc=a, seed=s) for s, a in enumerate((97.0, 96.0, 97.5))],
                               [doc([0.3], acc=a, seed=s) for s, a in enumerate((96.5, 97.0, 96.8))])
    assert noise.label == "within noise" and "more repeats" in noise.sentence
    guide = S.accuracy_verdict("M", guide_doc(), guide_doc())
    assert guide.label == "single seed"


# ------------------------------------------------------------------ repeat order
def test_rotated_order():
    assert S.rotated_order(["ddp", "allreduce", "ps"], 4) == [
        ["ddp", "allreduce", "ps"], ["allreduce", "ps", "ddp"], ["ps", "ddp", "allreduce"],
        ["ddp", "allreduce", "ps"]]
    # every method takes every position equally often over a multiple of the methods
    order = S.rotated_order("ABC", 6)
    for pos in range(3):
        assert sorted(r[pos] for r in order) == ["A", "A", "B", "B", "C", "C"]
    assert S.rotated_order(["ddp"], 2) == [["ddp"], ["ddp"]]
    with pytest.raises(ValueError, match="repeats must be 1 or more"):
        S.rotated_order("ABC", 0)


# ------------------------------------------------------------------ epochs as the units
def test_epoch_units_give_the_t_interval_of_epoch_means():
    """Three or more epochs: the units are the epochs. With equal-length epochs the interval of
    log(mean step time) is the t-interval (E - 1 df) of the epoch means, by hand here."""
    g = np.random.default_rng(11)
    t = g.normal(0.3, 0.03, 40)
    iv = S.throughput(doc(t, epochs=4))
    means = np.array([p.mean() for p in np.array_split(t, 4)])
    m = means.mean()
    h = sps.t.ppf(0.975, 3) * means.std(ddof=1) / 2 / m  # sd / sqrt(4) / m: log scale
    assert iv.basis == "epochs" and iv.n == 40
    assert (iv.value, iv.low, iv.high) == pytest.approx((128 / m, 128 / m * math.exp(-h), 128 / m * math.exp(h)))


def test_drift_between_epochs_is_in_the_interval():
    """A machine whose speed changes from epoch to epoch (each epoch its own speed, sd 5%, plus
    3% step noise; measured on the embedded default: epochs of one method 56-66 img/s). For a
    true tie, intervals from blocks of steps (the units within one epoch, computed here by hand
    from stats.blocks) call a false winner in 30% of the runs (seed 12); the epochs as units
    in 3.7%, near the nominal 5%."""
    g = np.random.default_rng(12)

    def run():
        return np.concatenate([0.3 * (1 + g.normal(0, 0.05)) * (1 + g.normal(0, 0.03, 10))
                               for _ in range(3)])

    def blocks_interval(a, b):  # the delta-method log-ratio interval with blocks as units
        parts = []
        for t in (a, b):
            sums, counts = S.blocks(np.array_split(t, 3))
            m = sums.sum() / counts.sum()
            z = (sums - m * counts) / counts.mean()
            parts.append((z.var(ddof=1) / len(z) / m ** 2, len(z)))
        (va, na), (vb, nb) = parts
        df = (va + vb) ** 2 / (va ** 2 / (na - 1) + vb ** 2 / (nb - 1))
        r = math.log(b.sum() / a.sum())  # throughput ratio a/b = mean time b / mean time a
        h = sps.t.ppf(0.975, df) * math.sqrt(va + vb)
        return r - h > 0 or r + h < 0

    n, false_blocks, false_epochs = 600, 0, 0
    for _ in range(n):
        a, b = run(), run()
        false_blocks += blocks_interval(a, b)
        false_epochs += S.compare_speed("M", doc(a), doc(b)).label != "within noise"
    assert false_blocks / n > 0.2, false_blocks / n
    assert false_epochs / n < 0.08, false_epochs / n


# ------------------------------------------------------------------ a busy machine
def loaded(d: Result, background: float, steal: float = 0.0) -> Result:
    for e in d.epochs:
        e.machine_load = {"run": 0.5, "background": background, "steal": steal, "cpus": 2}
    return d


def test_one_run_on_a_busy_machine_is_not_judged():
    """A clear win measured while other work took 30% of the CPU time is not called faster:
    the label is 'busy machine' and the sentence names the load, the limit and the cure."""
    g = np.random.default_rng(13)
    fast, slow = g.normal(0.25, 0.01, 24), g.normal(0.33, 0.01, 24)
    assert S.compare_speed("Parameter Server", doc(fast), doc(slow)).label == "faster"
    v = S.compare_speed("Parameter Server", loaded(doc(fast), 0.25, 0.05), loaded(doc(slow), 0.02))
    assert v.label == "busy machine", v.sentence
    assert "other work took 30% while Parameter Server ran" in v.sentence
    assert "while DDP ran" not in v.sentence  # 2% is under the limit
    assert "limit for judging one run is 10%" in v.sentence and "--repeats" in v.sentence
    assert S.machine_load(loaded(doc(fast), 0.25, 0.05)) == pytest.approx(0.30)
    # under the limit, and files that do not record the load: judged as before
    assert S.compare_speed("M", loaded(doc(fast), 0.08), loaded(doc(slow), 0.0)).label == "faster"
    assert S.machine_load(guide_doc()) is None
    # a hand-edited entry that is not numbers: not recorded, not a traceback
    odd = doc(fast)
    odd.epochs[0].machine_load = {"background": "busy"}
    assert S.machine_load(odd) is None
    assert S.compare_speed("M", odd, doc(slow)).label == "faster"
    # repeats in rotated order carry the load in their interval: judged
    reps = [loaded(doc(g.normal(0.25, 0.01, 24)), 0.3) for _ in range(3)]
    base = [loaded(doc(g.normal(0.33, 0.01, 24)), 0.3) for _ in range(3)]
    assert S.compare_speed("M", reps, base).label == "faster"


def _hog(seconds: float, detached: bool, done=None):
    """A process that burns ``seconds`` of CPU time (not of wall time: on a busy machine it
    takes longer, and still burns as much): a child of this process, or (detached) one whose
    parent has exited, so it belongs to no process tree of ours; it creates the file ``done``
    (if given) when it has finished burning."""
    import subprocess
    import sys
    burn = f"import time\nt=time.process_time()\nwhile time.process_time()-t<{seconds}: pass\n"
    if done is not None:
        burn += f"open({str(done)!r}, 'w').close()\n"
    if detached:
        code = f"import os\nif os.fork(): os._exit(0)\n{burn}"
        subprocess.run([sys.executable, "-c", code], check=True)  # the fork's parent returns at once
        return None
    return subprocess.Popen([sys.executable, "-c", burn])


def test_machine_load_tells_this_run_from_other_processes(tmp_path):
    """MachineLoad (rank 0's meter): a busy child of this process counts as the run's own CPU
    time; the same work in a process outside its tree counts as background."""
    from helpers import wait_for
    from labkit.training.instruments.timers import MachineLoad
    meter = MachineLoad()
    child = _hog(1.5, detached=False)
    child.wait()
    own = meter.stop()
    meter.start()
    done = tmp_path / "burnt"
    _hog(1.5, detached=True, done=done)
    wait_for(done.exists, 60, "the detached process to finish burning")  # not ours to wait()
    other = meter.stop()
    assert own["cpus"] >= 1 and 0 <= own["steal"] <= 1
    # 1.5 CPU seconds in a window of at most wall x cpus: the share is about 1/cpus on an idle
    # machine; a busy one stretches the window, so the share falls, but not below 0.3/cpus
    # before the child waits for a CPU more than twice as long as it runs (test_stats under
    # tools/stress_racy.sh with one core busy: docs/testing.md)
    assert own["run"] > 0.3 / own["cpus"], own
    assert other["run"] < 0.1 and other["background"] > 0.3 / other["cpus"], other
