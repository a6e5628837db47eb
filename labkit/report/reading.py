"""Appendix A, "How to read this report": every definition the captions point to, said once
(the captions stay at three lines). Each definition names the captions it serves, so a report
shows only those of the tables it has; the notebook and the text report read the same list. A
definition refers to a table or figure by its key (``{ref[key]}``, labkit.report.captions),
numbered as the report renders it."""
from __future__ import annotations

import textwrap
from typing import Iterable, NamedTuple, Optional

from .captions import resolve
from .workload_view import WorkloadView, rule_words

ANCHOR = "how-to-read"  # the HTML anchor the captions link to
TITLE = "How to read this report"
#: the link a caption ends with (Markdown); the text report has no captions, only headings
POINTER = f"Definitions: [{TITLE}](#{ANCHOR})."


class Definition(NamedTuple):
    term: str
    text: str
    captions: tuple[str, ...]  # the CAPTIONS keys it serves; shown when one of them is


DEFINITIONS: tuple[Definition, ...] = (
    Definition(
        "95% confidence intervals (CI)",
        "From the recorded step times: batch means with the epochs as units, or blocks of about "
        "sqrt(n) steps in runs of under 3 epochs, Student t; a speedup's on its logarithm, with "
        "Welch degrees of freedom; a t-interval over the repeats when the run has several, which "
        "also holds the run-to-run noise one launch cannot see. *n/a*: no step times in the "
        "result file (the original guide's scripts) or too few steps. Steady state: the first "
        "warm-up steps of each epoch are left out, all other steps pooled.",
        ("comparison", "communication", "repeats")),
    Definition(
        "Faster, slower, within the noise",
        "A method is called faster or slower than Baseline DDP only when its speedup's 95% CI "
        "excludes 1.00; else it is within the measurement noise. One run is not judged when "
        "other work took over 10% of the machine's CPU time while a compared method ran (the "
        "discussion lists the load). {judged} is called {lost} only over several seeds, "
        "when the paired differences' CI excludes 0.",
        ("comparison",)),
    Definition(
        "Time and steps to target",
        "The wall time (training and validation epochs) and the training steps until the "
        "{figure} first reached the target{side}; *not reached* where it never did. The "
        "target is {flag}, else {rule}.",
        ("comparison",)),
    Definition(
        "Communication time",
        "Milliseconds per step, mean over the trainers. *Param pull*, *grad push*: the time a "
        "PS worker is blocked in them. *All-Reduce* and *total*: the time the collectives ran, "
        "from each one's start to its completion (their union, so buckets in flight together "
        "count once); DDP's from its reducer's runtime statistics (with --time-comm hook, a "
        "communication hook timing each bucket).",
        ("communication",)),
    Definition(
        "Exposed and hidden communication",
        "*Exposed*: what synchronisation added to the step: the extra forward and backward time "
        "over compute-only steps (the same step with synchronisation skipped), plus the waits "
        "for pulls and gradients. *Hidden*: the rest of the communication, which ran while the "
        "trainer computed. *Overlap* = hidden / total, its CI by batch means over the same units "
        "as the throughput's. {ref[communication_overhead]} stacks the whole step: data wait, "
        "compute, exposed communication, optimizer and server update, the rest.",
        ("communication", "bench")),
    Definition(
        "On the wire",
        "The MB (10^6 bytes) a trainer sent and received per step, counted by the lab from the "
        "collectives the method issued: an all-reduce as a ring moves 2(n-1)/n of the gradient "
        "bytes each way; a PS worker pulls the parameters and pushes its gradients. *Optimizer "
        "state*: the bytes of optimizer state ({state}) each rank held at the end, in "
        "rank order (a PS: its server's; a sharded optimizer: its slice).",
        ("communication", "seeds", "variants")),
    Definition(
        "Repeats",
        "--repeats N runs each method once per repeat, the order rotated by one each repeat "
        "(ABC, BCA, CAB, ...) so a shared machine's drift falls on every method alike; repeat "
        "*i* trains from seed + *i* - 1. The single-run tables and figures show repeat 1; "
        "{ref[loss_curves,accuracy_curves]} draw the other repeats faintly.",
        ("repeats",)),
    Definition(
        "MLPerf's rule",
        "Time to {to} over seeds is scored as MLPerf Training scores it: a seed that never "
        "reaches the target (or diverged) counts as infinitely slow, not as missing; with 5 or "
        "more seeds the fastest and the slowest are dropped; a method with a kept seed that "
        "never reached the target has no time, only *not reached*. Time to target is compared "
        "as a ratio of mean times, final {final} as paired differences per seed. The "
        "no-communication bound is left out: its ranks drift apart.",
        ("seeds",)),
    Definition(
        "GPU use",
        "*GFLOP/{per}*: the model's FLOPs for one {per}, forward and backward ({flops}). *MFU*: "
        "those FLOPs x the steady-state throughput "
        "over the GPUs' dense peak for the precision used (H100, H200 and A100 by name). *Peak "
        "GPU memory*: torch.cuda.max_memory_allocated per rank. *Data wait*: the time a trainer "
        "waited for its next batch, as a share of the step; above 10% the run measured the data "
        "loader.",
        ("efficiency",)),
    Definition(
        "Memory per rank",
        "MiB (2^20 bytes) of the rank that held the most. *Held*: the storages of the model's "
        "parameters (a shard's, on a method that shards them), of their gradients and of the "
        "optimizer state, each storage counted once, after the epoch's last step; *most in a "
        "step*: the most bytes of parameters and the most of gradients live during one "
        "untimed step (a sharded method's gathered units included), with the optimizer state. *Modelled*: the method's own "
        "memory_per_rank for this model; FSDP's counts what stays between steps, zero3's the "
        "most in a step. *Peak*: every tensor live at the step's fullest moment: on a GPU the "
        "allocator's, on a CPU the tensors followed through that step "
        "(labkit/training/instruments/memory.py). *Preflight's estimate*: what the host-memory "
        "preflight allows a rank's tensors, a replica's 5 x the model scaled by the method's "
        "share. *Time per step*: the steady-state step, from the throughput and its CI.",
        ("memory",)),
    Definition(
        "Benchmark",
        "*Step*: the median over the trials of the slowest rank's time per step. *Compute-only*: "
        "the same steps with no synchronisation. *All-reduce* and *reduce+bcast*: the raw "
        "collectives on the same bytes in the same process group, bus bandwidth as nccl-tests "
        "defines it. *x DDP/trainer*: throughput per training process relative to DDP's (fair to "
        "a PS, whose servers do not train). Its CIs: a t-interval over the trials on the log of "
        "the ratio of mean times.",
        ("bench",)),
    Definition(
        "Projection",
        "The cost model (docs/bench-and-cost-model.md) from this run's measurements: DDP's "
        "compute-only step for every method, so only what each sends differs, and the bytes "
        "each method's trainers sent per step, read as the all-reduce they amount to; a "
        "parameter server as the model's PS. Nodes of 8 GPUs on NVLink, one link per GPU "
        "across nodes, nominal line rates, not measurements. Not modelled: the compute a method "
        "adds to compress, stragglers, and {final}. On an emulated link "
        "({ref[projection_on_link]}) the ring crosses each node's port once each way; the "
        "latency is TCP's through the kernel plus the link's delay.",
        ("projection_methods", "projection_on_link", "projection")),
    Definition(
        "Reproduction",
        "*identical*: every per-step loss, per-epoch metric and final parameter equal bit for "
        "bit; *equal within tolerance*: none differs by more than the tolerance; *different*: "
        "where the runs first part. *Speed*: this run's throughput over the recorded run's; "
        "machine load moves it, so it is not part of the verdict.",
        ("reproduction",)),
)


#: the words the definitions hold ({judged} ...), the guide's image classification's
GUIDE_WORDS = {
    "judged": "Accuracy", "lost": "lost or gained", "figure": "validation accuracy", "side": "",
    "flag": "--target-accuracy", "rule": "95% of the best validation accuracy any method reached",
    "state": "SGD's momentum", "to": "accuracy", "final": "accuracy", "per": "image",
    "flops": "3 x one forward, counted by torch.utils.flop_counter",
}


def words(view: Optional[WorkloadView]) -> dict[str, str]:
    """The definitions' words for a workload (None or one judged on accuracy: the guide's)."""
    if view is None or view.guide:
        return GUIDE_WORDS
    f = view.target
    return {"judged": f.label[:1].upper() + f.label[1:], "lost": "better or worse",
            "figure": f.label, "side": f" ({f.side} it)", "flag": "--target",
            "rule": rule_words(view, None), "state": view.optimizer_step + "'s",
            "to": "target", "final": f.label, "per": view.per_unit,
            "flops": view.flops_rule or "3 x one forward"}


def shown(present: Iterable[str]) -> list[Definition]:
    """The definitions serving a caption in ``present`` (the CAPTIONS keys the report shows)."""
    keys = set(present)
    return [d for d in DEFINITIONS if keys & set(d.captions)]


def reading_markdown(present: Iterable[str], view: Optional[WorkloadView] = None) -> str:
    """The appendix's body as Markdown: one bold term and its definition per paragraph, in the
    words of ``view``'s workload (None: the guide's)."""
    w = words(view)
    return "\n\n".join(f"**{d.term}.** {resolve(d.text).format_map(w)}" for d in shown(present))


def reading_text(present: Iterable[str], width: int = 100,
                 view: Optional[WorkloadView] = None) -> list[str]:
    """The same for performance_report.txt, wrapped at ``width``."""
    out: list[str] = []
    w = words(view)
    for d in shown(present):
        out += textwrap.wrap(f"{d.term}. {resolve(d.text).format_map(w).replace('*', '')}", width) + [""]
    return out
