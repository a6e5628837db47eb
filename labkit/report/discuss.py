"""The report's Discussion, per method: first how the methods are judged (the rule, the load,
the bound, which methods are exact), then one paragraph per method (its speed, where its time
went, its accuracy and time to the target, its replicas, its problem if any), then what holds
for all of them (the exact methods' accuracy range, the device, the link, the CPU).

A method's paragraph starts with its name and a colon, then its speed verdict as the terminal
prints it ("Manual All-Reduce: 1.06x DDP, 95% CI 1.02-1.10, faster than DDP."); a method whose
loss diverged starts with that instead. Every sentence is computed from the result files."""
from __future__ import annotations

from statistics import mean

from labkit.core import breakdown, stats
from labkit.core import efficiency
from labkit.core.health import diverged_where, replicas_verdict
from labkit.core.methods import BASELINE, METHOD_ORDER, SHORT, SPECS, label
from labkit.core.results import NAN

from .blocks import Block, Markdown
from .findings import accuracy_apart, exact_range_lines
from .load import RunResults
from .tables import chance_only, target
from .text import (RULE, accuracy_verdicts, context_lines, figure_heading, link_lines,
                   reference_lines, shared_device_line, speed_sentence, speed_verdicts,
                   target_rule, waits_lines)
from .workload_view import sent_until, time_to_target

#: what the accuracy verdicts need before they call a difference (stats.accuracy_verdict)
OVER_SEEDS = ("called higher or lower only over several seeds, when the 95% CI of the "
              "difference excludes 0.")
ACCURACY_RULE = f"Accuracy (best validation accuracy against DDP): {OVER_SEEDS}"


def judged_lines(res: RunResults) -> list[str]:
    """How the methods are judged, before any method's paragraph."""
    docs = res.ok
    if len(docs) < 2:
        return []
    if BASELINE not in docs:
        return ["No Baseline DDP result, so no speedup or accuracy verdicts."]
    lines = [f"Speed: {RULE}."] + context_lines(res, speed_verdicts(res))
    chance = chance_only(res)
    view = res.view
    lines.append(chance or f"{figure_heading(res)}: {OVER_SEEDS}")
    t = target(res)
    if t is not None and not chance:
        lines.append(f"Time to {view.goal(t)} ({target_rule(res)}, MLPerf's measure): the wall "
                     f"time of the epochs until a method first reached it"
                     + ("" if view.guide else f" ({view.target.side} it)") + ", in its paragraph."
                     + ("" if view.guide else first_line(res, t)))
    return lines


def first_line(res: RunResults, t: float) -> str:
    """" First to reach it: Manual All-Reduce, in 3.2 s, having sent 14.47 MB per trainer."
    (a sentence to follow the target's; " No method reached it." where none did)."""
    view, got = res.view, []
    for m in METHOD_ORDER:
        if m in res.ok:
            r = time_to_target(view, res.ok[m], t)
            if r.reached:
                got.append((r.seconds, m, sent_until(res.ok[m], r.epoch)))
    if not got:
        return " No method reached it."
    seconds, m, mb = min(got)
    cost = f", having sent {mb:.2f} MB per trainer on the wire" if mb is not None else ""
    return f" First to reach it: {label(m)}, in {seconds:.1f} s{cost}."


def _speed(res: RunResults, m: str) -> str:
    """The paragraph's first sentence: the speed verdict against DDP (without the name that
    starts it), or DDP's own throughput."""
    docs = res.ok
    if m == BASELINE or BASELINE not in docs or len(docs) < 2:
        what = "accuracy" if res.view.guide else res.view.target.label
        ref = f"the reference for speed and {what}, " if m == BASELINE and len(docs) > 1 else ""
        return f"{ref}{docs[m].overall.avg_train_throughput:.1f} {res.view.rate} on average."
    others = [k for k in METHOD_ORDER if k in docs and k != BASELINE]
    return speed_sentence(res, m, speed_verdicts(res)[others.index(m)]).split(": ", 1)[1]


def _time(res: RunResults, m: str) -> list[str]:
    """Where the step's time went: the method's own communication, the waits at the
    synchronisation point, the data loader."""
    d = res.ok[m]
    ep, comm = d.epochs, d.overall.comm
    step = mean(e.avg_batch_time for e in ep if e.avg_batch_time is not None) if ep else NAN
    out = []
    s = SPECS[m]  # an exact method's "comm" phase is its gradients' all-reduce; a PS's, two
    a = comm.get("comm", NAN) if s.exact and "comm" in s.phases else NAN
    pull, push = ((comm.get("pull", NAN), comm.get("push", NAN)) if {"pull", "push"} <= set(s.phases)
                  else (NAN, NAN))
    if a == a and step == step:
        out.append(f"A trainer waited {1000 * a:.1f} ms per step for gradient all-reduce after "
                   f"backward, {100 * a / step:.0f}% of its {1000 * step:.0f} ms step.")
    if pull == pull and push == push and step == step:
        workers = d.num_workers if d.num_workers is not None else "?"
        out.append(f"A worker spent {1000 * pull:.1f} ms per step pulling parameters and "
                   f"{1000 * push:.1f} ms pushing gradients, {100 * (pull + push) / step:.0f}% of its "
                   f"{1000 * step:.0f} ms step, with {workers} workers on one server.")
    waits = [w for w in (e.waited_share for e in ep) if w is not None]
    if waits and mean(waits) > efficiency.DATA_WAIT_FLAG:
        out.append(f"Its trainers waited for data {100 * mean(waits):.0f}% of the step: "
                   f"{efficiency.LOADER_FLAG_TEXT}, not the method (more --workers; on a GPU, "
                   f"device-side data or --decode gpu).")
    elif waits and mean(waits) > 0.05:  # steady-state steps (warm-up ones start the workers)
        out.append(f"Waiting for data took {100 * mean(waits):.0f}% of the step time (raise --workers).")
    return out + ["Waits: " + w.split(": ", 1)[1] for w in waits_lines(res) if w.startswith(label(m) + ": ")]


def _accuracy(res: RunResults, m: str, verdicts: dict[str, stats.Verdict]) -> list[str]:
    """The method's best validation accuracy (its verdict against DDP's, or why it has none)
    and its time to the target accuracy."""
    if chance_only(res) is not None:
        return []
    if not res.view.guide:
        return _figure(res, m, verdicts)
    d = res.ok[m]
    acc = d.overall.best_val_accuracy
    apart = accuracy_apart(m, acc) if len(res.ok) > 1 else None
    if apart:
        out = [f"It reached {acc:.2f}% best validation accuracy: {apart}."]
    elif label(m) in verdicts:
        out = ["Accuracy: " + verdicts[label(m)].sentence.split(": ", 1)[1] + "."]
    else:
        out = [f"Best validation accuracy {acc:.2f}%." if acc == acc else ""]
    t = target(res)
    if t is not None:
        r = breakdown.time_to_accuracy(d, t)
        steps = f"{r.steps} steps, " if r.steps is not None else ""
        out.append(f"It reached {t:.2f}% in {r.seconds:.1f} s ({steps}epoch {r.epoch})." if r.reached
                   else f"It did not reach {t:.2f}% validation accuracy.")
    return [s for s in out if s]


def _figure(res: RunResults, m: str, verdicts: dict[str, stats.Verdict]) -> list[str]:
    """_accuracy for a workload judged on another figure (a validation loss): its best value
    with the other figures at that epoch, its verdict against DDP, and its time to the target
    with the MB it sent to get there."""
    d, view = res.ok[m], res.view
    f = view.target
    best = d.best_figure(f.key, f.higher_is_better)
    if best is None:
        return [f"No {f.label} recorded."]
    at = next(e for e in d.epochs if e.figure(f.key) == best)
    others = [f"{g.label} {g.text(v)}" for g in view.figures[1:] if (v := g.value(at)) is not None]
    apart = accuracy_apart(m, best, f.label) if len(res.ok) > 1 else None
    out = [f"Its {f.best_word} {f.label}: {f.text(best)} (epoch {at.epoch}"
           + "".join(f", {o}" for o in others) + ")" + (f": {apart}." if apart else ".")]
    if not apart and label(m) in verdicts:
        out.append("Against DDP: " + verdicts[label(m)].sentence.split(": ", 1)[1] + ".")
    t = target(res)
    if t is not None:
        r = time_to_target(view, d, t)
        steps = f"{r.steps} steps, " if r.steps is not None else ""
        mb = sent_until(d, r.epoch)
        cost = f", having sent {mb:.2f} MB per trainer" if mb is not None else ""
        out.append(f"It reached {f.text(t)} in {r.seconds:.1f} s ({steps}epoch {r.epoch}){cost}."
                   if r.reached else f"It did not reach {view.goal(t)}.")
    return out


def paragraph(res: RunResults, m: str, verdicts: dict[str, stats.Verdict]) -> str:
    """One method's paragraph: a diverged loss first, then speed, time, accuracy, replicas and
    the problem the lab recorded for it."""
    d = res.docs[m]
    said = [diverged_where(d) or ""]
    if m in res.ok:
        said += [_speed(res, m), *_time(res, m), *_accuracy(res, m, verdicts)]
    # the bound's ranks are made equal at each epoch's end: its check cannot fail
    replicas = None if (m in SPECS and SPECS[m].bound) else replicas_verdict(d)
    said += [f"Its check: {replicas}." if replicas else ""]
    problem = res.problems.get(m)
    said += [f"Problem: {problem}" if problem else ""]
    said = [s for s in said if s]
    if said and said[0].startswith("diverged"):
        said[0] += "."
    return f"{label(m)}: " + " ".join(said)


def step_option_lines(res: RunResults) -> list[str]:
    """The step's options every method ran with, in words: --grad-accum's micro-batches and
    --grad-clip's norm (nothing where neither is on; each method's own where they differ)."""
    said = []
    for m, d in res.ok.items():
        c = d.config
        k, clip = c.get("grad_accum") or 1, c.get("grad_clip") or 0
        parts = ([f"each step's batch of {c.get('batch_size')} per trainer computed as {k} "
                  f"micro-batches, communicated once a step where the method allows"] if k > 1
                 else [])
        parts += [f"the global gradient norm clipped at {clip:g} (of the synchronised "
                  f"gradient, before the optimizer's step)"] if clip else []
        said.append((m, "; ".join(parts)))
    texts = {t for _, t in said}
    if texts == {""}:
        return []
    if len(texts) == 1:
        return [f"Every method ran with {said[0][1]}."]
    return [f"{label(m)} ran with {t}." for m, t in said if t]


def common_lines(res: RunResults) -> list[str]:
    """What holds for every method: the exact methods' accuracy range, a shared device, the
    emulated link, a CPU run; the problems of files and of methods without a result."""
    docs, view = res.ok, res.view
    f = view.target
    best = ({m: d.overall.best_val_accuracy for m, d in docs.items()} if view.guide else
            {m: NAN if (v := d.best_figure(f.key, f.higher_is_better)) is None else v
             for m, d in docs.items()})
    lines = [] if chance_only(res) else exact_range_lines(best, None if view.guide else view)
    lines += reference_lines(res)
    lines += step_option_lines(res)
    shared = shared_device_line(res)
    lines += [shared] if shared else []
    lines += link_lines(res)
    cpu = [d for d in docs.values() if d.world.get("device") == "cpu"]
    if cpu:
        bound = (", each rank bound to its share of them (--pin-cpus)"
                 if all(d.config.get("pin_cpus") for d in cpu) else "")
        lines.append(f"These are CPU (gloo) figures: processes share the CPU cores{bound}, so "
                     f"communication and computation compete; GPU/NCCL runs separate them.")
    for k, p in res.problems.items():  # keyed by method, or by the file that is wrong
        if k not in res.docs:
            lines.append(f"Problem: {label(k)}: {p}" if k in SHORT and label(k) not in p else
                         f"Problem: {p}")
    return lines


def discussion(res: RunResults) -> list[str]:
    """The Discussion's lines: how the methods are judged, one paragraph per method, what holds
    for all (no claim the numbers don't make)."""
    verdicts = {v.sentence.split(": ", 1)[0]: v for v in accuracy_verdicts(res)}
    methods = [m for m in METHOD_ORDER if m in res.docs] + [m for m in res.docs if m not in METHOD_ORDER]
    return judged_lines(res) + [paragraph(res, m, verdicts) for m in methods] + common_lines(res)


def discussion_markdown(res: RunResults) -> str:
    """The Discussion as a Markdown list, each method's name in bold (report.ipynb's)."""
    names = tuple(f"{label(m)}: " for m in res.docs)
    return "\n".join(f"- **{l.split(': ', 1)[0]}:** {l.split(': ', 1)[1]}" if l.startswith(names)
                     else f"- {l}" for l in discussion(res))



def discussion_blocks(res: RunResults) -> list[Block]:
    """The Discussion part: a Markdown list in the notebook, the same lines in the text report."""
    return [Markdown(discussion_markdown(res) or "No results to discuss.",
                     plain=(*(f"- {line}" for line in discussion(res)), ""))]
