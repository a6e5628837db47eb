"""Every table and figure caption of the report, in one order that numbers them: the n-th
table of ``all_captions()`` is "Table n", the n-th figure "Figure n". That order is CAPTIONS' (the
built-in parts' captions, whose numbers the guide's users cite), then the captions a part
declares in its outline entry (labkit.report.outline.Section.captions), in the outline's order.
No number is typed anywhere: the report names a table or figure by its key, and ``ref(key)`` (or
``{ref[key]}`` in a caption's or a definition's text) reads as its number when the report is
rendered. So a new part's table takes the next number, and moving an entry renumbers every
caption and every reference with it. Texts may hold ``{fields}`` filled in by the caller.
A caption says what its table shows in at most three lines (MAX_CHARS); what its terms mean is
said once, in the appendix (labkit.report.reading) the caption links to
(labkit.report.blocks.caption)."""
from __future__ import annotations

import re
from typing import Callable, NamedTuple, Optional

from .workload_view import WorkloadView


#: a caption's most characters, its fields filled in (three lines of the PDF's ~120)
MAX_CHARS = 360
TABLE, FIGURE = "Table", "Figure"


class Caption(NamedTuple):
    kind: str     # TABLE or FIGURE: its number is its place among the captions of its kind
    title: str    # the bold lead, and the heading of the plain-text report
    note: str     # the heading's parenthesis in the plain-text report ("" for none)
    text: str     # what follows the bold lead in the notebook


CAPTIONS: dict[str, Caption] = {
    "comparison": Caption(
        TABLE, "Performance comparison",
        "steady-state throughput, warm-up steps left out; 95% CIs from the step times",
        "Steady-state throughput of all trainers, time per epoch, best validation accuracy and "
        "speedup over Baseline DDP, with 95% CIs; *time* and *steps to target*: until the "
        "validation accuracy first reached {target}."),
    "communication": Caption(
        TABLE, "Communication time per training step",
        "time a trainer is blocked in synchronisation",
        "(ms per step, mean over the trainers): the time blocked in or spent by the collectives, "
        "how much of it was *exposed* on the step's path and how much *hidden* behind compute, "
        "the MB a trainer put *on the wire*, and the optimizer state each rank held."),
    "bench": Caption(
        TABLE, "Benchmark", "labkit bench",
        "(`labkit bench`, {created}): {model} on {dataset}, batch {batch_size} per trainer, "
        "{backend} on {device}; {trials} trials of {steps} steps after {warmup} warm-up steps, "
        "each against compute-only steps and the raw collectives on the same bytes."),
    "costmodel": Caption(
        TABLE, "Cost model against the bench", "",
        "Each row predicts the step from that process count's measured compute-only time and the "
        "latency and bandwidth fitted to its all-reduce sweep. {ok} of {total} predictions are "
        "within {target:g}% of the measured step."),
    "variants": Caption(
        TABLE, "Method variants", "",
        "against the synchronous, uncompressed run of the same method. *max staleness seen*: the "
        "largest number of steps a PS worker ran ahead of the slowest (asynchronous PS)."),
    "throughput_comparison": Caption(
        FIGURE, "Training throughput (images/s, all trainers); error bars: the 95% confidence "
        "interval of {ref[comparison]} (none where it is n/a)", "", ""),
    "training_time_comparison": Caption(
        FIGURE, "Training time per epoch (s); error bars: the 95% confidence interval of the "
        "throughput ({ref[comparison]}) carried over to the time per epoch", "", ""),
    "loss_curves": Caption(
        FIGURE, "Loss convergence: training loss per step, averaged over trainers", "", ""),
    "accuracy_curves": Caption(
        FIGURE, "Train (dashed) and validation (solid) accuracy per epoch", "", ""),
    "communication_overhead": Caption(
        FIGURE, "Where a trainer's step goes, per method: data wait, compute, exposed "
        "communication, optimizer and server update, the rest; black tick: the measured step "
        "of {ref[comparison]}; label: the share of communication hidden behind compute "
        "(95% CI)", "", ""),
    "sync_waits": Caption(
        FIGURE, "How long each trainer waited at the synchronisation point per step (from "
        "its last collective's start to the end of the step's synchronisation); the rank that "
        "waited least arrived last, and the others waited for it", "", ""),
    "bench_figure": Caption(
        FIGURE, "Where a step's time goes, and throughput relative to DDP at the same "
        "process count", "", ""),
    "projection": Caption(
        FIGURE, "Projected scaling efficiency, 8 to 1024 GPUs, per interconnect and method",
        "", ""),
    "variants_figure": Caption(
        FIGURE, "Variants (dashed) against their synchronous method (solid): loss and "
        "accuracy", "", ""),
    "repeats": Caption(
        TABLE, "Repeats", "each method N times, rotated order, seed + i",
        "(`--repeats`): first each method over its repeats, with the throughput's 95% CI over "
        "the repeats (with 2 repeats it is wide, honestly), then every repeat with its seed "
        "and its place in the rotated run order."),
    "scaling": Caption(
        TABLE, "Scaling efficiency", "labkit sweep",
        "(`labkit sweep`): steady-state throughput per method and process count with its 95% CI, "
        "the ideal linear throughput n / n0 x T(n0) from the smallest count n0, and the "
        "efficiency T(n) / (n / n0 x T(n0)), its 95% CI that of the ratio T(n) / T(n0) (over "
        "epochs, step blocks or repeats), times n0 / n."),
    "scaling_figure": Caption(
        FIGURE, "Throughput vs processes, per method, with the ideal linear line (dashed) "
        "and 95% CI error bars", "", ""),
    "wire": Caption(
        FIGURE, "MB per step on the wire: what a trainer sent (plain) and received "
        "(hatched) per step, counted by the lab from the collectives each method issued "
        "({ref[communication]}'s last column)", "", ""),
    "reproduction": Caption(
        TABLE, "Reproduction", "labkit reproduce",
        "of `{original}`: this run re-ran its recorded configs with `labkit reproduce` (same "
        "seed, process count and data); {ok} of {total} methods reproduced{tolerance}. *Speed*: "
        "this run's throughput over the recorded run's, with its 95% CI."),
    "efficiency": Caption(
        TABLE, "How much of the GPU each method used",
        "model FLOPs, MFU, peak memory, data wait",
        "per method: the model's FLOPs per image, the model FLOPs utilisation (MFU) against the "
        "GPUs' dense peak, the peak GPU memory of each rank, and the data wait as a share of "
        "the step."),
    "seeds": Caption(
        TABLE, "Time to accuracy over seeds",
        "MLPerf's scoring; 95% CIs over seeds",
        "per method, every repeat from its own seed: time and steps to {target} and the final "
        "accuracy (means with their 95% CIs over seeds), scored by MLPerf's rule; the verdicts "
        "below compare each method with Baseline DDP."),
    "projection_methods": Caption(
        TABLE, "Each method projected to 1024 GPUs from what it sent",
        "cost model; DDP's compute for every method",
        "Projected throughput at {at} GPUs relative to DDP's on each interconnect, at this run's "
        "compute time per step ({compute}), from the bytes each method sent; *wins*: the compute times per "
        "step at which it would beat DDP there by more than 1%."),
    "projection_on_link": Caption(
        TABLE, "{ref[projection_methods]}'s model on this run's emulated link, against the "
        "measured step", "cost model; flat ring over every rank",
        "Each method's step as {ref[projection_methods]}'s model predicts it on this run's link "
        "({link} per node, each way), beside the step it measured (the model's error in "
        "brackets), and at the bandwidth the link's probe measured."),
    "accuracy_vs_time": Caption(
        FIGURE, "Validation accuracy against wall time, every seed (faint) and their mean "
        "(bold); the dashed line is the target of {ref[seeds]}", "", ""),
    "accuracy_vs_bytes": Caption(
        FIGURE, "Validation accuracy against the MB a trainer sent (cumulative, log scale), "
        "every seed (faint) and their mean (bold): a method that sends less reaches "
        "the same accuracy further left", "", ""),
    "memory": Caption(
        TABLE, "Memory per rank", "the fullest rank; measured, and each method's own model",
        "per method, the fullest rank: the bytes of parameters, gradients and optimizer state "
        "it held between steps and at most in a step, what its memory_per_rank declares, its "
        "peak in a step ({peak}) and the preflight's estimate, beside its time and bytes per "
        "step."),
}


def _none() -> dict[str, Caption]:
    return {}


#: the captions the outline's parts declare, in its order (labkit.report.outline sets it to read
#: its SECTIONS when called, so this module needs no import of the outline)
declared: Callable[[], dict[str, Caption]] = _none


def all_captions() -> dict[str, Caption]:
    """Every caption in its numbering order: CAPTIONS', then those the parts declare."""
    return {**CAPTIONS, **declared()}


def _figure_words(v: WorkloadView) -> dict[str, tuple[str, str]]:
    """The captions a workload judged on another figure than accuracy words its own way: key
    -> (title, text); the others read as CAPTIONS has them."""
    f = v.target
    name = f.label[:1].upper() + f.label[1:]
    references = "; ".join(w for w, _ in v.target_references())  # accuracy_curves' dashed lines
    return {
        "comparison": ("Performance comparison", (
            f"Steady-state throughput of all trainers, time per epoch, {f.best_word} {f.label} "
            f"and speedup over Baseline DDP, with 95% CIs; *time*, *steps* and *MB sent to "
            f"target*: until the {f.label} first reached {{target}}.")),
        "throughput_comparison": (
            f"Training throughput ({v.rate}, all trainers); error bars: the 95% confidence "
            f"interval of {{ref[comparison]}} (none where it is n/a)", ""),
        "accuracy_curves": (
            f"{name} per epoch (solid), each method" + (f"; dashed: {references}" if references else "")
            + "; dotted: the target of {ref[comparison]}", ""),
        "variants_figure": (
            f"Variants (dashed) against their synchronous method (solid): training loss and "
            f"{f.label}", ""),
        "seeds": ("Time to target over seeds", (
            f"per method, every repeat from its own seed: time and steps to {{target}} and the "
            f"final {f.label} (means with their 95% CIs over seeds), scored by MLPerf's rule; the "
            f"verdicts below compare each method with Baseline DDP.")),
        "accuracy_vs_time": (
            f"{name} against wall time, every seed (faint) and their mean (bold); the dashed line "
            f"is the target of {{ref[seeds]}}", ""),
        "accuracy_vs_bytes": (
            f"{name} against the MB a trainer sent (cumulative, log scale), every seed (faint) and "
            f"their mean (bold): a method that sends less reaches the same {f.label} further left", ""),
        "efficiency": ("How much of the GPU each method used", (
            f"per method: the model's FLOPs per {v.per_unit}, the model FLOPs utilisation (MFU) "
            f"against the GPUs' dense peak, the peak GPU memory of each rank, and the data wait "
            f"as a share of the step.")),
    }


def number(key: str) -> str:
    """The number of the table or figure ``key``: its kind and its place among the captions of
    that kind (``all_captions()``: "Table n" for the n-th table)."""
    every = all_captions()
    kind = every[key].kind
    return f"{kind} {[k for k, c in every.items() if c.kind == kind].index(key) + 1}"


def ref(*keys: str) -> str:
    """How the report refers to tables or figures by key: "Table n"; several of one kind
    "Figures m-n" (a run of numbers) or "Figures k, m and n"."""
    if len(keys) == 1:
        return number(keys[0])
    every = all_captions()
    kinds = {every[k].kind for k in keys}
    if len(kinds) != 1:
        raise ValueError(f"ref{keys}: one kind at a time (tables or figures)")
    ns = sorted(int(number(k).rsplit(" ", 1)[1]) for k in keys)
    said = (f"{ns[0]}-{ns[-1]}" if ns == list(range(ns[0], ns[-1] + 1)) else
            ", ".join(map(str, ns[:-1])) + f" and {ns[-1]}")
    return f"{kinds.pop()}s {said}"


#: a reference by key inside a text: {ref[comparison]}, {ref[loss_curves,accuracy_curves]}
REF = re.compile(r"\{ref\[([\w,]+)\]\}")


def resolve(text: str) -> str:
    """``text`` with each ``{ref[key]}`` read as the number of that table or figure (ref)."""
    return REF.sub(lambda m: ref(*m.group(1).split(",")), text)


def of(key: str, view: Optional[WorkloadView] = None) -> Caption:
    """The caption of ``key`` in the words of ``view``'s workload (None, or one judged on
    accuracy: CAPTIONS' own), its references numbered."""
    c = all_captions()[key]
    words = {} if view is None or view.guide else _figure_words(view)
    title, text = words.get(key, (c.title, c.text))
    return c._replace(title=resolve(title), text=resolve(text))


def lead(key: str, view: Optional[WorkloadView] = None, **fields) -> str:
    """A table's caption as Markdown: the bold number and title, then its text (a field not
    given reads "the target"), in the words of ``view``'s workload; blocks.caption adds the
    link to the definitions."""
    c = of(key, view)
    text = c.text.format_map(_Fields(fields))
    sep = " " if text.startswith("(") or text[:1].islower() else ". "
    bold = f"**{number(key)}. {c.title}**" if sep == " " else f"**{number(key)}. {c.title}.**"
    return f"{bold} {text}".rstrip() if text else f"**{number(key)}. {c.title}.**"


class _Fields(dict):
    def __missing__(self, key: str) -> str:
        return f"the {key}"


def figure_caption(key: str, view: Optional[WorkloadView] = None) -> str:
    """A figure's caption: "Figure N. Title." """
    return f"{number(key)}. {of(key, view).title}."


def heading(key: str, view: Optional[WorkloadView] = None) -> str:
    """The plain-text report's heading of a table."""
    c = of(key, view)
    return f"{number(key)}. {c.title}" + (f" ({c.note})" if c.note else "")
