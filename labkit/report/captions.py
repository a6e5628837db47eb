"""Every table and figure caption of the report, numbered, in one table. The notebook
(report.ipynb), the text report and the report's sections all read it, so a number or a
caption is changed here once. Texts may hold ``{fields}`` filled in by the caller. A caption
says what its table shows in at most three lines (MAX_CHARS); what its terms mean is said once,
in the appendix (labkit.report.reading) the caption links to."""
from __future__ import annotations

from typing import NamedTuple, Optional

from . import reading
from .workload_view import WorkloadView


#: a caption's most characters, its fields filled in (three lines of the PDF's ~120)
MAX_CHARS = 360


class Caption(NamedTuple):
    number: str   # "Table 1", "Figure 6"
    title: str    # the bold lead, and the heading of the plain-text report
    note: str     # the heading's parenthesis in the plain-text report ("" for none)
    text: str     # what follows the bold lead in the notebook


CAPTIONS: dict[str, Caption] = {
    "comparison": Caption(
        "Table 1", "Performance comparison",
        "steady-state throughput, warm-up steps left out; 95% CIs from the step times",
        "Steady-state throughput of all trainers, time per epoch, best validation accuracy and "
        "speedup over Baseline DDP, with 95% CIs; *time* and *steps to target*: until the "
        "validation accuracy first reached {target}."),
    "communication": Caption(
        "Table 2", "Communication time per training step",
        "time a trainer is blocked in synchronisation",
        "(ms per step, mean over the trainers): the time blocked in or spent by the collectives, "
        "how much of it was *exposed* on the step's path and how much *hidden* behind compute, "
        "the MB a trainer put *on the wire*, and the optimizer state each rank held."),
    "bench": Caption(
        "Table 3", "Benchmark", "labkit bench",
        "(`labkit bench`, {created}): {model} on {dataset}, batch {batch_size} per trainer, "
        "{backend} on {device}; {trials} trials of {steps} steps after {warmup} warm-up steps, "
        "each against compute-only steps and the raw collectives on the same bytes."),
    "costmodel": Caption(
        "Table 4", "Cost model against the bench", "",
        "Each row predicts the step from that process count's measured compute-only time and the "
        "latency and bandwidth fitted to its all-reduce sweep. {ok} of {total} predictions are "
        "within {target:g}% of the measured step."),
    "variants": Caption(
        "Table 5", "Method variants", "",
        "against the synchronous, uncompressed run of the same method. *max staleness seen*: the "
        "largest number of steps a PS worker ran ahead of the slowest (asynchronous PS)."),
    "throughput_comparison": Caption(
        "Figure 1", "Training throughput (images/s, all trainers); error bars: the 95% confidence "
        "interval of Table 1 (none where it is n/a)", "", ""),
    "training_time_comparison": Caption(
        "Figure 2", "Training time per epoch (s); error bars: the 95% confidence interval of the "
        "throughput (Table 1) carried over to the time per epoch", "", ""),
    "loss_curves": Caption(
        "Figure 3", "Loss convergence: training loss per step, averaged over trainers", "", ""),
    "accuracy_curves": Caption(
        "Figure 4", "Train (dashed) and validation (solid) accuracy per epoch", "", ""),
    "communication_overhead": Caption(
        "Figure 5", "Where a trainer's step goes, per method: data wait, compute, exposed "
        "communication, optimizer and server update, the rest; black tick: the measured step "
        "of Table 1; label: the share of communication hidden behind compute (95% CI)", "", ""),
    "sync_waits": Caption(
        "Figure 6", "How long each trainer waited at the synchronisation point per step (from "
        "its last collective's start to the end of the step's synchronisation); the rank that "
        "waited least arrived last, and the others waited for it", "", ""),
    "bench_figure": Caption(
        "Figure 7", "Where a step's time goes, and throughput relative to DDP at the same "
        "process count", "", ""),
    "projection": Caption(
        "Figure 8", "Projected scaling efficiency, 8 to 1024 GPUs, per interconnect and method",
        "", ""),
    "variants_figure": Caption(
        "Figure 9", "Variants (dashed) against their synchronous method (solid): loss and "
        "accuracy", "", ""),
    "repeats": Caption(
        "Table 6", "Repeats", "each method N times, rotated order, seed + i",
        "(`--repeats`): first each method over its repeats, with the throughput's 95% CI over "
        "the repeats (with 2 repeats it is wide, honestly), then every repeat with its seed "
        "and its place in the rotated run order."),
    "scaling": Caption(
        "Table 7", "Scaling efficiency", "labkit sweep",
        "(`labkit sweep`): steady-state throughput per method and process count with its 95% CI, "
        "the ideal linear throughput n / n0 x T(n0) from the smallest count n0, and the "
        "efficiency T(n) / (n / n0 x T(n0)), its 95% CI that of the ratio T(n) / T(n0) (over "
        "epochs, step blocks or repeats), times n0 / n."),
    "scaling_figure": Caption(
        "Figure 10", "Throughput vs processes, per method, with the ideal linear line (dashed) "
        "and 95% CI error bars", "", ""),
    "wire": Caption(
        "Figure 11", "MB per step on the wire: what a trainer sent (plain) and received "
        "(hatched) per step, counted by the lab from the collectives each method issued (Table "
        "2's last column)", "", ""),
    "reproduction": Caption(
        "Table 8", "Reproduction", "labkit reproduce",
        "of `{original}`: this run re-ran its recorded configs with `labkit reproduce` (same "
        "seed, process count and data); {ok} of {total} methods reproduced{tolerance}. *Speed*: "
        "this run's throughput over the recorded run's, with its 95% CI."),
    "efficiency": Caption(
        "Table 9", "How much of the GPU each method used",
        "model FLOPs, MFU, peak memory, data wait",
        "per method: the model's FLOPs per image, the model FLOPs utilisation (MFU) against the "
        "GPUs' dense peak, the peak GPU memory of each rank, and the data wait as a share of "
        "the step."),
    "seeds": Caption(
        "Table 10", "Time to accuracy over seeds",
        "MLPerf's scoring; 95% CIs over seeds",
        "per method, every repeat from its own seed: time and steps to {target} and the final "
        "accuracy (means with their 95% CIs over seeds), scored by MLPerf's rule; the verdicts "
        "below compare each method with Baseline DDP."),
    "projection_methods": Caption(
        "Table 11", "Each method projected to 1024 GPUs from what it sent",
        "cost model; DDP's compute for every method",
        "Projected throughput at {at} GPUs relative to DDP's on each interconnect, at this run's "
        "compute time per step ({compute}), from the bytes each method sent; *wins*: the compute times per "
        "step at which it would beat DDP there by more than 1%."),
    "projection_on_link": Caption(
        "Table 12", "Table 11's model on this run's emulated link, against the measured step",
        "cost model; flat ring over every rank",
        "Each method's step as Table 11's model predicts it on this run's link ({link} per "
        "node, each way), beside the step it measured (the model's error in brackets), and at "
        "the bandwidth the link's probe measured."),
    "accuracy_vs_time": Caption(
        "Figure 12", "Validation accuracy against wall time, every seed (faint) and their mean "
        "(bold); the dashed line is the target of Table 10", "", ""),
    "accuracy_vs_bytes": Caption(
        "Figure 13", "Validation accuracy against the MB a trainer sent (cumulative, log scale), "
        "every seed (faint) and their mean (bold): a method that sends less reaches "
        "the same accuracy further left", "", ""),
}


def _figure_words(v: WorkloadView) -> dict[str, tuple[str, str]]:
    """The captions a workload judged on another figure than accuracy words its own way: key
    -> (title, text); the others read as CAPTIONS has them."""
    f = v.target
    name = f.label[:1].upper() + f.label[1:]
    refs = "; ".join(w for w, _ in v.target_references())  # Figure 4's dashed lines
    return {
        "comparison": ("Performance comparison", (
            f"Steady-state throughput of all trainers, time per epoch, {f.best_word} {f.label} "
            f"and speedup over Baseline DDP, with 95% CIs; *time*, *steps* and *MB sent to "
            f"target*: until the {f.label} first reached {{target}}.")),
        "throughput_comparison": (
            f"Training throughput ({v.rate}, all trainers); error bars: the 95% confidence "
            f"interval of Table 1 (none where it is n/a)", ""),
        "accuracy_curves": (
            f"{name} per epoch (solid), each method" + (f"; dashed: {refs}" if refs else "")
            + "; dotted: the target of Table 1", ""),
        "variants_figure": (
            f"Variants (dashed) against their synchronous method (solid): training loss and "
            f"{f.label}", ""),
        "seeds": ("Time to target over seeds", (
            f"per method, every repeat from its own seed: time and steps to {{target}} and the "
            f"final {f.label} (means with their 95% CIs over seeds), scored by MLPerf's rule; the "
            f"verdicts below compare each method with Baseline DDP.")),
        "accuracy_vs_time": (
            f"{name} against wall time, every seed (faint) and their mean (bold); the dashed line "
            f"is the target of Table 10", ""),
        "accuracy_vs_bytes": (
            f"{name} against the MB a trainer sent (cumulative, log scale), every seed (faint) and "
            f"their mean (bold): a method that sends less reaches the same {f.label} further left", ""),
        "efficiency": ("How much of the GPU each method used", (
            f"per method: the model's FLOPs per {v.per_unit}, the model FLOPs utilisation (MFU) "
            f"against the GPUs' dense peak, the peak GPU memory of each rank, and the data wait "
            f"as a share of the step.")),
    }


def of(key: str, view: Optional[WorkloadView] = None) -> Caption:
    """The caption of ``key`` in the words of ``view``'s workload (None, or one judged on
    accuracy: CAPTIONS' own)."""
    c = CAPTIONS[key]
    if view is None or view.guide:
        return c
    title, text = _figure_words(view).get(key, (c.title, c.text))
    return c._replace(title=title, text=text)


def caption(key: str, view: Optional[WorkloadView] = None, **fields) -> str:
    """A table's caption as Markdown: the bold number and title, then its text (a field not
    given reads "the target"), in the words of ``view``'s workload."""
    c = of(key, view)
    text = c.text.format_map(_Fields(fields))
    sep = " " if text.startswith("(") or text[:1].islower() else ". "
    lead = f"**{c.number}. {c.title}**" if sep == " " else f"**{c.number}. {c.title}.**"
    said = f"{lead} {text}".rstrip() if text else f"**{c.number}. {c.title}.**"
    # the definitions are said once, in the appendix the caption links to
    return f"{said} {reading.POINTER}" if reading.shown([key]) else said


class _Fields(dict):
    def __missing__(self, key: str) -> str:
        return f"the {key}"


def figure_caption(key: str, view: Optional[WorkloadView] = None) -> str:
    """A figure's caption: "Figure N. Title." """
    c = of(key, view)
    return f"{c.number}. {c.title}."


def heading(key: str, view: Optional[WorkloadView] = None) -> str:
    """The plain-text report's heading of a table."""
    c = of(key, view)
    return f"{c.number}. {c.title}" + (f" ({c.note})" if c.note else "")
