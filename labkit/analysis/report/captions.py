"""Every table and figure caption of the report, numbered, in one table. The notebook
(report.ipynb), the text report and the report's sections all read it, so a number or a
caption is changed here once. Texts may hold ``{fields}`` filled in by the caller."""
from __future__ import annotations

from typing import NamedTuple


class Caption(NamedTuple):
    number: str   # "Table 1", "Figure 6"
    title: str    # the bold lead, and the heading of the plain-text report
    note: str     # the heading's parenthesis in the plain-text report ("" for none)
    text: str     # what follows the bold lead in the notebook


CAPTIONS: dict[str, Caption] = {
    "comparison": Caption(
        "Table 1", "Performance comparison",
        "steady-state throughput, warm-up steps left out; 95% CIs from the step times",
        "Steady-state throughput of all trainers (the first warm-up steps of each epoch are left "
        "out; from the recorded step times, all steps pooled), mean training time per epoch, best "
        "validation accuracy, and throughput relative to Baseline DDP. *95% CI*: the 95% "
        "confidence interval from the recorded step times (batch means with the epochs as units, "
        "or blocks of about sqrt(n) steps in runs of under 3 epochs, Student t; the speedup's on "
        "its logarithm, Welch degrees of freedom), or a t-interval over repeats when the run has "
        "several; *n/a* where the result file holds no step times (the original guide's scripts) "
        "or too few steps. A method is called faster or slower than DDP only when its speedup's "
        "interval excludes 1.00, and one run is not judged when other work took over 10% of the "
        "machine's CPU time while a compared method ran (the discussion lists the load). *Time "
        "to target* and *steps to target*: the wall time (training and validation epochs) and "
        "the training steps until the validation accuracy first reached {target}; *not "
        "reached* where it never did."),
    "communication": Caption(
        "Table 2", "Communication time per training step",
        "time a trainer is blocked in synchronisation",
        "(ms per step, mean over the trainers). *Param pull*, *grad push*: the time a PS worker "
        "is blocked in them. *All-Reduce* and *total*: the time the collectives ran, from each "
        "one's start to its completion (their union, so buckets in flight together count "
        "once); DDP's from its reducer's own runtime statistics, the span from its first "
        "bucket's all-reduce to the end of the last (with --time-comm hook: a communication hook "
        "that does what its built-in all-reduce does, each bucket's interval). "
        "*Exposed*: what synchronisation added to the step (the extra forward and backward time "
        "over compute-only steps, plus the waits for pulls and gradients); *hidden*: the rest "
        "of the communication, which ran while the trainer computed; *overlap* = hidden / "
        "total, its 95% CI by batch means over the same units as Table 1's. *On the wire*: the "
        "MB (10^6 bytes) a trainer sent and received per step, counted by the lab from the "
        "collectives the method issued (an all-reduce as a ring: 2(n-1)/n of the gradient "
        "bytes each way; a PS worker pulls the parameters and pushes its gradients). "
        "*Optimizer state*: the bytes of optimizer state (SGD's momentum) each rank held at the "
        "end of training, in rank order (a PS: its server's; a sharded optimizer: its slice). "
        "Figure 5 "
        "stacks the whole step the same way."),
    "bench": Caption(
        "Table 3", "Benchmark", "labkit bench",
        "(`labkit bench`, {created}): {model} on {dataset}, batch {batch_size} per trainer, "
        "{backend} on {device}; {trials} trials of {steps} steps after {warmup} warm-up steps. "
        "*Step*: median over the trials of the slowest rank's time per step (min-max beside it). "
        "*Compute-only*: the same steps with no synchronisation. *Exposed comm*, *hidden comm* "
        "and *overlap*: as in Table 2, the synchronised trials' parts against the compute-only "
        "trials' forward and backward. *All-reduce* and *reduce+bcast*: the raw collectives on the same bytes in "
        "the same process group, bus bandwidth as nccl-tests defines it. *x DDP/trainer*: "
        "throughput per training process relative to DDP's (fair to a PS, whose servers do not "
        "train). *95% CI* of x DDP and of sync / raw: a t-interval over the trials (and the raw "
        "collective's repetitions) on the log of the ratio of mean times; a variant is called "
        "faster or slower than DDP only when it excludes 1.00."),
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
        "Figure 5", "Where a trainer's step goes, per method: data wait, compute (compute-only "
        "forward and backward), exposed communication, optimizer and server update, the rest; "
        "the black tick is the measured step of Table 1's throughput, the label the share of "
        "communication hidden behind compute with its 95% CI", "", ""),
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
        "(`--repeats`): each method ran once per repeat, the order rotated by one each repeat "
        "(ABC, BCA, CAB, ...) so a shared machine's drift falls on every method alike; repeat "
        "*i* trained from seed + *i* - 1. First table: each method over its repeats (the 95% CI "
        "of the throughput is a t-interval over the repeats, which holds the run-to-run noise "
        "one run cannot see; with 2 repeats it is wide, honestly). Second: every repeat. The "
        "single-run tables and figures above show repeat 1; Figures 3-4 draw the other repeats "
        "faintly."),
    "scaling": Caption(
        "Table 7", "Scaling efficiency", "labkit sweep",
        "(`labkit sweep`): steady-state throughput per method and process count with its 95% CI, "
        "the ideal linear throughput from the smallest process count n0 (n / n0 x T(n0)), and "
        "the efficiency T(n) / (n / n0 x T(n0)); its 95% CI is that of the throughput ratio "
        "T(n) / T(n0) (delta method on the log ratio over epochs or step blocks, or a t-interval over "
        "repeats), times n0 / n."),
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
        "seed, process count and data); {ok} of {total} methods reproduced{tolerance}. "
        "*identical*: every per-step loss, per-epoch metric and final parameter equal bit for "
        "bit; *equal within tolerance*: none differs by more than the tolerance (the largest "
        "difference is shown); *different*: where the runs first part. *Speed*: this run's "
        "throughput over the recorded run's, with its 95% CI; machine load moves it, so it is "
        "not part of the verdict."),
    "efficiency": Caption(
        "Table 9", "How much of the GPU each method used",
        "model FLOPs, MFU, peak memory, data wait",
        "per method. *GFLOP/image*: the model's FLOPs for one image, forward and backward (3 x "
        "one forward counted by torch.utils.flop_counter: convolutions and matrix products). "
        "*MFU*: those FLOPs x the steady-state throughput over the GPUs' dense peak for the "
        "precision used (bf16/fp16 autocast, else TF32; H100, H200 and A100 by name; none on a "
        "CPU or another GPU). *Peak GPU memory*: torch.cuda.max_memory_allocated of each rank. "
        "*Data wait*: the time a trainer waited for its next batch (and its copy to the device) "
        "as a share of the steady-state step; above 10% the discussion says the run measured "
        "the data loader."),
    "seeds": Caption(
        "Table 10", "Time to accuracy over seeds",
        "MLPerf's scoring; 95% CIs over seeds",
        "per method, every repeat trained from its own seed (`--repeats N`: seed + *i* - 1). "
        "*Time to target*: the wall time (training and validation) until the first validation "
        "at or above {target}, the mean over seeds with its t-interval; *steps to target*: the "
        "same in training steps. Scored as MLPerf Training scores: a seed that never reaches the "
        "target (or diverged) counts as infinitely slow, not as missing; with {drop} or more "
        "seeds the fastest and the slowest are dropped; a method with a kept seed that never "
        "reached the target has no time, only *not reached*. *Final accuracy*: the last "
        "validation, mean over seeds with its t-interval. *MB/step sent*: per trainer, counted "
        "by the lab (Table 2). The verdicts below compare each method with Baseline DDP (and "
        "with DDP's bf16 gradients where it ran): time to target as a ratio of mean times "
        "(faster or slower only when its 95% CI excludes 1.00) and final accuracy as paired "
        "differences per seed (lost or gained only when their 95% CI excludes 0). The "
        "no-communication bound is left out: its ranks drift apart."),
    "projection_methods": Caption(
        "Table 11", "Each method projected to 1024 GPUs from what it sent",
        "cost model; DDP's compute for every method",
        "Projected throughput at {at} GPUs relative to DDP's on each interconnect at this "
        "run's compute time per step, and the compute times per step (searched from 0.1 ms to "
        "10 s) at which the method would beat DDP there by more than 1%: a GPU's steps are "
        "far shorter than a CPU's, and the shorter the step the more of it communication "
        "takes. From this run's measurements: DDP's "
        "compute-only step (forward, backward, optimizer) for every method, so only what each "
        "sends differs, and the bytes each method's trainers sent per step, read as the "
        "all-reduce they amount to (a ring moves 2(n-1)/n of it per rank; a method that sent in "
        "a share 1/H of its steps all-reduces H times as much every H steps); a parameter "
        "server as the cost model's PS. Topology, links and formulas: the cost model's "
        "(docs/bench-and-cost-model.md: nodes of 8 GPUs on NVLink, one link per GPU across "
        "nodes; nominal line rates, not measurements). Not modelled: the compute a method adds "
        "to compress, stragglers, and accuracy (Table 10)."),
    "projection_on_link": Caption(
        "Table 12", "Table 11's model on this run's emulated link, against the measured step",
        "cost model; flat ring over every rank",
        "Each method's step as Table 11's model predicts it on the link this run had ({link} "
        "per node, each way), from the same inputs (DDP's compute-only step for every method, "
        "the bytes each method sent), beside the step the method measured (mean over its "
        "steps); in brackets the model's error. A ring over every rank crosses each node's "
        "port once each way, so a port carries what one rank sends; a parameter server's port "
        "carries every worker's copy in the model, though the workers on the server's own node "
        "reach it over loopback here. *Model at the probe's goodput*: the same with the "
        "bandwidth the probe measured before the first step (TCP's overhead taken out). The "
        "latency is TCP's through the kernel (the model's 10 GbE), plus the link's delay."),
    "accuracy_vs_time": Caption(
        "Figure 12", "Validation accuracy against wall time, every seed (faint) and their mean "
        "(bold); the dashed line is the target of Table 10", "", ""),
    "accuracy_vs_bytes": Caption(
        "Figure 13", "Validation accuracy against the MB a trainer sent (cumulative, log scale), "
        "every seed (faint) and their mean (bold): a method that sends less reaches "
        "the same accuracy further left", "", ""),
}


def caption(key: str, **fields) -> str:
    """A table's caption as Markdown: the bold number and title, then its text (a field not
    given reads "the target")."""
    c = CAPTIONS[key]
    text = c.text.format_map(_Fields(fields))
    sep = " " if text.startswith("(") or text[:1].islower() else ". "
    lead = f"**{c.number}. {c.title}**" if sep == " " else f"**{c.number}. {c.title}.**"
    return f"{lead} {text}".rstrip() if text else f"**{c.number}. {c.title}.**"


class _Fields(dict):
    def __missing__(self, key: str) -> str:
        return f"the {key}"


def figure_caption(key: str) -> str:
    """A figure's caption: "Figure N. Title." """
    c = CAPTIONS[key]
    return f"{c.number}. {c.title}."


def heading(key: str) -> str:
    """The plain-text report's heading of a table."""
    c = CAPTIONS[key]
    return f"{c.number}. {c.title}" + (f" ({c.note})" if c.note else "")
