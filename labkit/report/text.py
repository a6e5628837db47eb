"""Findings computed from the numbers: the verdicts, the bound, the waits, the link (said per
method by the Discussion, discuss.py, and printed by the terminal and the plain-text report,
labkit.report.textreport)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from labkit.bench import bench_view
from labkit.core import breakdown
from labkit.core import stats
from labkit.core.methods import BASELINE, METHOD_ORDER, SPECS, label
from labkit.core.results import Result
from labkit.core.run_folder import goodputs

from .captions import heading
from .findings import health_lines
from .load import RunResults
from .seeds import seeds_text
from .tables import comparison_rows, method_runs, chance_only, target, text_table
from .workload_view import measure, rule_words, time_to_target


RULE = ("throughput relative to Baseline DDP with its 95% CI; a method is called faster or "
        "slower only when the CI excludes 1.00")


# A single run's interval comes from the epochs of one launch per method; what differs from one
# launch of a method to the next (where the ranks ran, the machine's state) is not in it: five
# runs of the embedded default spread wider than one run's interval (docs/performance.md).
ONE_LAUNCH = ("Each method ran once: a faster or slower verdict rests on the noise within each "
              "launch, not on the spread between two launches of the same method, which a "
              "shared machine adds; --repeats N (rotated order, an interval over the repeats) "
              "measures that spread too.")

#: the verdict words of the comparison table's rule, as the summary says them after an interval
WORDS = {"faster": "faster than DDP", "slower": "slower than DDP",
         "within noise": "within the measurement noise", "busy machine": "not judged: busy machine",
         "not available": "no interval"}


def _against_ddp(res: RunResults, judge, bounds: bool = True) -> list[stats.Verdict]:
    docs = res.ok
    if BASELINE not in docs:
        return []
    base = method_runs(res, BASELINE)
    return [judge(label(m), method_runs(res, m), base) for m in METHOD_ORDER
            if m in docs and m != BASELINE and (bounds or not _bound(m))]


def _bound(m: str) -> bool:
    return m in SPECS and SPECS[m].bound


def kind_lines(res: RunResults) -> list[str]:
    """Which methods are exact (DDP's parameters up to summation order) and which approximate
    (judged by time to target and the final figure), as their specs say."""
    kinds = {True: [], False: []}
    for m in METHOD_ORDER:
        if m in res.ok and m in SPECS and not SPECS[m].bound:
            kinds[SPECS[m].exact].append(label(m))
    judged = ("time to accuracy and final accuracy" if res.view.guide else
              f"time to target and final {res.view.target.label}")
    said = [f"exact (the same parameters as DDP up to summation order): {', '.join(kinds[True])}"
            if kinds[True] else "",
            f"approximate (judged by {judged} against DDP): "
            f"{', '.join(kinds[False])}" if kinds[False] else ""]
    return [f"Methods: {'; '.join(s for s in said if s)}."]


def bound_lines(res: RunResults) -> list[str]:
    """The no-communication bound (``nosync``): how much of DDP's step communication can cost
    at most, from DDP's throughput over the bound's, with its 95% CI."""
    claim = bound_claim(res)
    if claim is None:
        return []
    bound = next(m for m in METHOD_ORDER if m in res.ok and _bound(m))
    verdicts = "accuracy" if res.view.guide else res.view.target.label
    why = (f"{label(bound)} never communicates in a step: its ranks' parameters drift apart "
           f"within an epoch (rank 0's are copied to every rank at each epoch's end, outside the "
           f"timed steps), so it bounds speed only and is left out of the {verdicts} verdicts")
    return [f"{claim} {why}."]


def bound_claim(res: RunResults) -> Optional[str]:
    """What the bound says communication costs, in one sentence (the summary's), or None
    without a bound and DDP."""
    docs = res.ok
    bound = next((m for m in METHOD_ORDER if m in docs and _bound(m)), None)
    if bound is None or BASELINE not in docs:
        return None
    iv = stats.speedup(method_runs(res, BASELINE), method_runs(res, bound))
    if iv.value is None:
        return f"No-communication bound: not available ({iv.note or 'no throughput'})."
    if iv.value >= 1:  # a bound measured slower than DDP: the noise of the machine
        return (f"Communication cost nothing measurable here: DDP trained at {iv.value:.2f}x "
                f"the throughput of {label(bound)}.")
    share = lambda r: f"{100 * max(0.0, 1 - r):.0f}%"  # noqa: E731
    ci = "no interval" if iv.low is None else "95% CI " + stats.interval_text(
        100 * max(0.0, 1 - iv.high), 100 * max(0.0, 1 - iv.low), 0, sep=" to ", unit="%")
    return (f"Communication costs at most {share(iv.value)} of a step here ({ci}): "
            f"DDP trained at {iv.value:.2f}x the throughput of {label(bound)}.")


def speed_verdicts(res: RunResults) -> list[stats.Verdict]:
    """Each method against DDP (stats.compare_speed): faster / slower only when the 95% CI of
    its speedup excludes 1.00, else within the noise, or not available (no step times)."""
    return _against_ddp(res, stats.compare_speed)


def accuracy_verdicts(res: RunResults) -> list[stats.Verdict]:
    """Each method's best value of the first figure against DDP's (the best validation
    accuracy, the lowest validation loss: stats.figure_verdict); a bound, whose parameters
    drift apart, has none (bound_lines says why)."""
    if res.view.guide:
        return _against_ddp(res, stats.accuracy_verdict, bounds=False)
    best = measure(res.view)
    return _against_ddp(res, lambda name, runs, base: stats.figure_verdict(name, runs, base, best),
                        bounds=False)


def figure_heading(res: RunResults) -> str:
    """The words that open the figure's verdicts: "Accuracy (best validation accuracy against
    DDP)", "Validation loss (lowest validation loss against DDP)"."""
    f = res.view.target
    if res.view.guide:
        return "Accuracy (best validation accuracy against DDP)"
    return f"{f.label[:1].upper()}{f.label[1:]} ({f.best_word} {f.label} against DDP)"


def load_line(res: RunResults) -> Optional[str]:
    """How busy the rest of the machine was while each method's steps were timed (its busiest
    epoch; stats.machine_load), or None when no result file records it."""
    loads = {}
    for m in METHOD_ORDER:
        if m in res.ok:
            vals = [x for x in map(stats.machine_load, method_runs(res, m)) if x is not None]
            if vals:
                loads[label(m)] = max(vals)
    if not loads:
        return None
    return ("Machine load (share of the CPU time that other work took in the busiest timed epoch; "
            f"one run is judged only under {100 * stats.LOAD_LIMIT:.0f}%): "
            + ", ".join(f"{k} {100 * v:.0f}%" for k, v in loads.items()) + ".")


def verdict_lines(res: RunResults) -> list[str]:
    """The speed and accuracy verdicts as sentences: the discussion's and the terminal's."""
    docs = res.ok
    if len(docs) < 2:
        return []
    if BASELINE not in docs:
        return ["No Baseline DDP result, so no speedup or accuracy verdicts."]
    lines = [f"Speed ({RULE}):"]
    speed = speed_verdicts(res)
    others = [m for m in METHOD_ORDER if m in docs and m != BASELINE]  # speed_verdicts' order
    lines += [speed_sentence(res, m, v) for m, v in zip(others, speed)]
    lines += context_lines(res, speed)
    chance = chance_only(res)
    if chance:
        return lines + [chance]
    lines.append(figure_heading(res) + ":")
    lines += [v.sentence + "." for v in accuracy_verdicts(res)]
    tta = time_to_accuracy_line(res)
    if tta:
        lines.append(tta)
    return lines


def speed_sentence(res: RunResults, m: str, v: stats.Verdict) -> str:
    """A method's speed verdict against DDP, with the part of its step that differs most."""
    return (v.sentence + {"faster": ", faster than DDP", "slower": ", slower than DDP"}
            .get(v.label, "") + "." + phase_text(res.ok[m], res.ok[BASELINE]))


def context_lines(res: RunResults, speed: list[stats.Verdict]) -> list[str]:
    """What the speed verdicts rest on: one launch per method, the machine's load, the leader
    where no interval could be computed, the no-communication bound, the methods' kinds."""
    lines = []
    if any(v.label in ("faster", "slower") for v in speed) and len(method_runs(res, BASELINE)) == 1:
        lines.append(ONE_LAUNCH)
    load = load_line(res)
    lines += [load] if load else []
    if speed and all(v.label == "not available" for v in speed):
        thr = {m: d.overall.avg_train_throughput for m, d in res.ok.items()}
        top = max(thr, key=thr.get)
        lines.append(f"{label(top)} had the highest measured throughput ({thr[top]:.1f} {res.view.rate}), "
                     f"but without confidence intervals these files cannot say whether the "
                     f"differences exceed the measurement noise.")
    return lines + bound_lines(res) + kind_lines(res)


def phase_text(doc: Result, ddp: Result) -> str:
    """Which part of the step (labkit.core.breakdown) differs most from DDP's, as a
    sentence to follow a speed verdict ("" without both breakdowns)."""
    b, base = breakdown.of_result(doc), breakdown.of_result(ddp)
    if b is None or base is None:
        return ""
    diff = {k: b.parts[k] - base.parts[k] for k in breakdown.ORDER}
    top = max(diff, key=lambda k: abs(diff[k]))
    more = "more" if diff[top] > 0 else "less"
    return (f" Per step its {breakdown.LABELS[top]} took {1000 * b.parts[top]:.1f} ms against "
            f"DDP's {1000 * base.parts[top]:.1f} ms ({1000 * abs(diff[top]):.1f} ms {more}), "
            f"the part that differs most.")


def target_rule(res: RunResults) -> str:
    """Where the target came from: the flag, or the default rule (a share of the best any
    method reached: 95% of the highest accuracy, 105% of the lowest loss)."""
    flag = res.given_target[1]
    if not res.view.guide:
        return rule_words(res.view, flag)
    return (flag if flag else f"{100 * breakdown.TARGET_SHARE:.0f}% of the best any method reached")


def time_to_accuracy_line(res: RunResults) -> Optional[str]:
    """Time to the target per method, in one sentence (MLPerf's measure)."""
    t = target(res)
    if t is None:
        return None
    how, view = target_rule(res), res.view
    items = []
    for m in METHOD_ORDER:
        if m in res.ok:
            r = time_to_target(view, res.ok[m], t)
            steps = f"{r.steps} steps, " if r.steps is not None else ""
            items.append(f"{label(m)} {r.seconds:.1f} s ({steps}epoch {r.epoch})"
                         if r.reached else f"{label(m)} not reached")
    return f"Time to {view.goal(t)} ({how}): " + ", ".join(items) + "."


#: what beating a reference means, by a word of its name (the unigram entropy is the loss of
#: the best model that ignores context): (beyond it, not beyond it)
MEANINGS = {"unigram": ("the model uses context", "the model does not use context yet")}


def reference_lines(res: RunResults) -> list[str]:
    """The first figure against each reference its workload records in the same unit (a
    language model's validation loss against the unigram entropy of the validation text):
    with which methods its best went beyond it, and what that means."""
    f, out = res.view.target, []
    best = {m: d.best_figure(f.key, f.higher_is_better) for m, d in res.ok.items()}
    best = {m: v for m, v in best.items() if v is not None}
    for what, ref in res.view.target_references() if best else ():
        beyond = [m for m in METHOD_ORDER if m in best and best[m] != ref and f.reached(best[m], ref)]
        means = next((v for k, v in MEANINGS.items() if k in what.lower()), None)
        went, stayed = (("rose above", "stayed below") if f.higher_is_better else
                        ("fell below", "stayed above"))
        head = f"The {f.label}"
        if len(beyond) == len(best):
            out.append(f"{head} {went} the {what}, {f.text(ref)}, with every method"
                       + (f": {means[0]}." if means else "."))
        elif beyond:
            rest = [label(m) for m in METHOD_ORDER if m in best and m not in beyond]
            out.append(f"{head} {went} the {what}, {f.text(ref)}, with "
                       f"{', '.join(label(m) for m in beyond)}" + (f" ({means[0]})" if means else "")
                       + f"; it {stayed} it with {', '.join(rest)}.")
        else:
            out.append(f"{head} {stayed} the {what}, {f.text(ref)}, with every method"
                       + (f": {means[1]}." if means else "."))
    return out


def waits_lines(res: RunResults) -> list[str]:
    """Per method, who the trainers waited for at the synchronisation point."""
    out = []
    for m in METHOD_ORDER:
        w = breakdown.waits(res.ok[m]) if m in res.ok else None
        if w is None:
            continue
        share = w.last_share[w.ranks.index(w.last)]
        each = ", ".join(f"rank {r} {1000 * t:.1f} ms" for r, t in zip(w.ranks, w.mean_wait))
        who = (f"rank {w.last} arrived last at the synchronisation point in {100 * share:.0f}% "
               f"of {w.steps} steps, so the others waited for it" if w.consistent else
               f"no rank held the others back steadily (the most often last, rank {w.last}, "
               f"was last in {100 * share:.0f}% of {w.steps} steps)")
        out.append(f"{label(m)}: {who}; mean wait per step: {each}.")
    return out


def ran_on_gpu(res: RunResults) -> bool:
    """Whether any method's ranks computed on a GPU (the GPU use table, efficiency, is shown
    only then)."""
    return any(str(d.world.get("device", "")).startswith("cuda") for d in res.ok.values())


def shared_device_line(res: RunResults) -> Optional[str]:
    """A sentence when a method's ranks shared GPUs (more local ranks than GPUs on cuda: one
    GPU's default, labkit.launch.launch_params.machine_defaults), else None."""
    for d in res.ok.values():
        w = d.world
        ranks, gpus = int(w.get("local_world_size") or 1), int(w.get("gpus") or 0)
        if str(w.get("device", "")).startswith("cuda") and gpus and ranks > gpus:
            return (f"The ranks shared one device: {ranks} processes on {gpus} GPU(s), over "
                    f"{w.get('backend')}. Communication timings measure copies through host "
                    f"memory, not links between GPUs: compare the methods with each other, not "
                    f"with a run on one GPU per process.")
    return None


def link_lines(res: RunResults) -> list[str]:
    """One sentence per emulated link the methods ran on (the result file's ``link``, written
    by labkit.launch.emulated): the link as set, the goodput each method's probe measured on it
    (lowest to highest), and what the emulation does not model."""
    links: dict[str, list[float]] = {}
    cc: dict[str, str] = {}
    for d in res.ok.values():
        link = d.link
        if not isinstance(link, dict):
            continue
        text = (f"an emulated cluster of {link.get('nodes')} nodes x {link.get('ranks_per_node')} "
                f"rank(s), each node's link {link.get('link')} each way (burst "
                f"{link.get('burst_bytes')} B, queue {link.get('queue')}, delay: {link.get('delay')})")
        links.setdefault(text, []).extend(goodputs(link))
        cc[text] = link.get("tcp_congestion_control", "?")
    return [f"Network: {text}" + (f"; its probe measured {min(got):.0f}-{max(got):.0f} Mbit/s each "
                                  f"way at once before each method's first step (TCP {cc[text]})"
                                  if got else "")
            + ". It models bandwidth and one port per node; all nodes share this machine's CPU, "
              "so the compute is not a GPU cluster's." for text, got in links.items()]


def terminal_summary(res: RunResults) -> str:
    """What `labkit experiment` and `labkit report` end with: the comparison table and the
    verdicts (and, with several seeds per method, the seeds' table and its verdicts)."""
    if not res.ok:
        return ""
    seeds = seeds_text(res)  # several seeds: time to accuracy and its verdicts, too
    return "\n".join([heading("comparison"), "", text_table(comparison_rows(res)), "",
                       *link_lines(res), *verdict_lines(res), *health_lines(res),
                       *([""] + seeds if seeds else [])])


def reproduction_summary(doc: dict) -> str:
    """"Reproduction of <run>: ..." in one sentence (doc: reproduction.json)."""
    verdicts = [v["verdict"] for v in doc["methods"].values()]
    counts = ", ".join(f"{n} {word}" for word in ("identical", "equal within tolerance", "different")
                       if (n := verdicts.count(word)))
    return (f"Reproduction of {Path(str(doc['original'])).name}: "
            f"{'reproduced' if doc.get('reproduced') else 'NOT reproduced'} ({counts})")


def load_bench(run_dir: str | os.PathLike) -> Optional[dict]:
    """The run folder's bench document, or None when it has none (or not a readable one)."""
    try:
        return bench_view.load(run_dir, need_results=False)
    except bench_view.BenchError:
        return None
