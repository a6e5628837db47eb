"""The guide's five plots, the ranks' waits and the bytes on the wire (PLOTS); the seeds' two
with several seeds (labkit.report.seeds)."""
from __future__ import annotations

import os
from pathlib import Path
from statistics import mean
from typing import Optional

from labkit.core import breakdown
from labkit.core import layout
from labkit.core.files import atomic_path
from labkit.core.methods import METHOD_ORDER, SPECS, label
from labkit.core.results import Result, Summary

from .figures import COLORS, plot_stem
from .load import RunResults, method_key
from .seeds import SEED_PLOTS, has_seeds, plot_seeds
from .tables import comm_ms, intervals, target, wire_mb

PLOTS = ("throughput_comparison", "training_time_comparison", "loss_curves", "accuracy_curves",
         "communication_overhead", "sync_waits", "wire")  # the guide's five, the waits, the bytes


def _bar(ax, res: RunResults, throughput: bool, ylabel: str, title: str):
    """Bars of the throughput (``throughput``) or of the time per epoch, with the 95% CI as
    whiskers (the comparison table's interval; time per epoch ~ 1 / throughput, so its whiskers
    are the throughput's relative interval); none where no CI is available."""
    docs, ivs = res.ok, intervals(res)
    ms = [m for m in METHOD_ORDER if m in docs]
    thr = {m: ivs[m]["throughput"] for m in ms}

    def figure(s: Summary) -> float:
        return s.avg_train_throughput if throughput else s.avg_train_time_per_epoch

    vals = [thr[m].value if throughput and thr[m].value is not None
            else figure(docs[m].overall) for m in ms]
    lo, hi = [], []
    for m, v in zip(ms, vals):
        iv = thr[m]
        if not iv.available:
            lo.append(0.0), hi.append(0.0)
        elif throughput:
            lo.append(v - iv.low), hi.append(iv.high - v)
        else:  # epoch time = steps x step time: the same relative interval, mirrored
            lo.append(v - v * iv.value / iv.high), hi.append(v * iv.value / iv.low - v)
    bars = ax.bar([label(m) for m in ms], vals, color=[COLORS[m] for m in ms], yerr=[lo, hi],
                  capsize=6, ecolor="#333")
    # inside the bars: above them the labels would sit on the whiskers
    ax.bar_label(bars, labels=[f"{v:,.1f}" for v in vals], label_type="center", color="white",
                 fontweight="bold")
    for m, v in zip(ms, vals):  # the no-communication bound: the ceiling of every method
        if throughput and SPECS[m].bound:
            ax.axhline(v, ls="--", lw=1, color="#555", label=f"{label(m)}: the ceiling")
            ax.legend(fontsize=8, loc="lower right")
    ax.set_ylabel(ylabel)
    none = [label(m) for m in ms if not thr[m].available]
    ax.set_title(title + "\n(whiskers: 95% CI" + (f"; n/a for {', '.join(none)}" if none else "")
                 + ")", fontsize=10)
    ax.margins(y=0.2)
    _note_missing(ax, res)


def _note_missing(ax, res: RunResults) -> None:
    missing = [label(m) for m in METHOD_ORDER if m not in res.ok and m in res.problems]
    if missing:
        ax.text(0.99, 0.98, "no result: " + ", ".join(missing), transform=ax.transAxes,
                ha="right", va="top", fontsize=8, color="#a00")


def plot_throughput(res: RunResults, ax):
    _bar(ax, res, True, res.view.rate_axis, "Training throughput")


def plot_training_time(res: RunResults, ax):
    _bar(ax, res, False, "seconds per epoch", "Training time per epoch")


def _later_repeats(repeats: Optional[dict[str, list[Result]]], m: str) -> list[Result]:
    """Repeats 2..N of method ``m`` (repeat 1 is the main document, drawn in full)."""
    return [d for d in (repeats or {}).get(m, [])[1:] if d.epochs]


def plot_losses(docs: dict[str, Result], ax=None, repeats: Optional[dict[str, list[Result]]] = None):
    """Per-step training loss of each method, on one axis; with ``repeats`` (RunResults.repeats)
    every other repeat's curve is drawn faintly in the method's colour, so the spread shows."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.5))
    for m, d in docs.items():
        losses = d.all_losses
        k = method_key(d) or m
        ax.plot(range(1, len(losses) + 1), losses, label=d.method, lw=1.2,
                color=COLORS.get(k))
        for r in _later_repeats(repeats, m):
            rl = r.all_losses
            ax.plot(range(1, len(rl) + 1), rl, lw=0.8, alpha=0.35, color=COLORS.get(k))
    ax.set_xlabel("training step")
    ax.set_ylabel("training loss (cross-entropy)")
    ax.set_title("Loss convergence")
    ax.grid(alpha=0.3)
    if docs:
        ax.legend()
    return ax.figure


def plot_accuracy(res: RunResults, ax):
    """The accuracy_curves figure: train and validation accuracy per epoch; for a workload
    judged on another figure, that figure per epoch (plot_figure)."""
    if not res.view.guide:
        plot_figure(res, ax)
        return
    for m, d in res.ok.items():
        ep = d.epochs
        x = [e.epoch for e in ep]
        ax.plot(x, [e.train_accuracy for e in ep], "--o", color=COLORS[m], ms=4,
                label=f"{label(m)} (train)")
        if all(e.val_accuracy is not None for e in ep):
            ax.plot(x, [e.val_accuracy for e in ep], "-s", color=COLORS[m], ms=4,
                    label=f"{label(m)} (val)")
        for r in _later_repeats(res.repeats, m):  # faint: the other repeats' curves
            rx = [e.epoch for e in r.epochs]
            ax.plot(rx, [e.train_accuracy for e in r.epochs], "--", color=COLORS[m], lw=0.8, alpha=0.35)
            if all(e.val_accuracy is not None for e in r.epochs):
                ax.plot(rx, [e.val_accuracy for e in r.epochs], "-", color=COLORS[m], lw=0.8, alpha=0.35)
    from matplotlib.ticker import MaxNLocator
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("epoch")
    ax.set_ylabel("accuracy (%)")
    ax.set_title("Accuracy per epoch")
    ax.grid(alpha=0.3)
    if res.ok:  # no curves (every file failed or corrupt): no legend, _note_missing says why
        ax.legend(fontsize=8)
    _note_missing(ax, res)


def plot_figure(res: RunResults, ax):
    """The first validation figure (a language model's validation loss) per epoch, each
    method solid (its other repeats faint), the references its workload records in the same
    unit dashed (the unigram entropy of the validation text), the comparison table's target
    dotted."""
    from matplotlib.ticker import MaxNLocator

    f = res.view.target
    for i, (m, d) in enumerate(res.ok.items()):
        for k, r in enumerate([d, *_later_repeats(res.repeats, m)]):
            pts = [(e.epoch, v) for e in r.epochs if (v := f.value(e)) is not None]
            # distinct markers, larger first: the exact methods' curves lie on top of each other
            ax.plot([x for x, _ in pts], [y for _, y in pts], "-" + ("osD^v"[i % 5] if k == 0 else ""),
                    ms=7 - i % 3 * 2, color=COLORS[m], lw=1.5 if k == 0 else 0.8,
                    alpha=1.0 if k == 0 else 0.35, label=label(m) if k == 0 else None)
    for i, (what, v) in enumerate(res.view.target_references()):
        ax.axhline(v, ls="--", lw=1.2, color=("#555", "#999")[i % 2], label=f"{what} ({f.text(v)})")
    t = target(res)
    if t is not None:
        ax.axhline(t, ls=":", lw=1.2, color="#a00", label=f"target {f.text(t)}")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("epoch")
    ax.set_ylabel(f.column)
    ax.set_title(f"{f.label[:1].upper()}{f.label[1:]} per epoch")
    ax.grid(alpha=0.3)
    if res.ok:
        ax.legend(fontsize=8)
    _note_missing(ax, res)


def plot_communication(res: RunResults, ax):
    """The communication_overhead figure, where a trainer's step goes, for every method
    (labkit.core.breakdown); result files written before the parts of a step were recorded: PS
    vs All-Reduce, each step split into time blocked in communication and the rest."""
    items = {m: breakdown.of_result(d) for m, d in res.ok.items()}
    items = {m: b for m, b in items.items() if b is not None}
    if items and len(items) == len(res.ok):
        order = [m for m in METHOD_ORDER if m in items]
        breakdown.draw(ax, [label(m) for m in order], [items[m] for m in order])
        ax.set_title("Where a trainer's step goes")
        _note_missing(ax, res)
        return
    docs, c = res.ok, comm_ms(res)
    labels, comm_parts, rest = [], [], []
    # the methods that time their communication in phases: the hand-written all-reduce's "comm",
    # the parameter server's pull and push (DDP's is inside PyTorch: the breakdown's)
    for m in [m for m in METHOD_ORDER if m in docs and SPECS[m].phases]:
        step = 1000 * mean(e.avg_batch_time for e in docs[m].epochs if e.avg_batch_time is not None)
        parts = c[m]
        labels.append(label(m))
        comm_parts.append(parts)
        rest.append(max(0.0, step - sum(parts.values())))
    colors = {"comm": "#55A868", "pull": "#DD8452", "push": "#C44E52"}
    names = {"comm": "all-reduce", "pull": "parameter pull", "push": "gradient push"}
    bottom = [0.0] * len(labels)
    for part in ("comm", "pull", "push"):
        vals = [p.get(part, 0.0) for p in comm_parts]
        if any(vals):
            ax.bar(labels, vals, bottom=bottom, color=colors[part], label=names[part])
            bottom = [b + v for b, v in zip(bottom, vals)]
    ax.bar(labels, rest, bottom=bottom, color="#CCCCCC", label="compute and the rest")
    for i, p in enumerate(comm_parts):
        tot = sum(p.values())
        ax.text(i, bottom[i], f"{tot:.0f} ms communication", ha="center", va="bottom", fontsize=9,
                bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 1})
    ax.set_ylabel("ms per training step (trainer view)")
    ax.set_title("Communication overhead: PS vs All-Reduce")
    if labels:
        ax.legend(fontsize=8)
    _note_missing(ax, res)


def _items(res: RunResults, ax, of, none: str) -> list:
    """(method, ``of`` its result) for every method whose result has it, in the registry's
    order; none: says ``none`` on ``ax`` instead."""
    items = [(m, of(res.ok[m])) for m in METHOD_ORDER if m in res.ok]
    items = [(m, v) for m, v in items if v is not None]
    if not items:
        ax.text(0.5, 0.5, none, ha="center", transform=ax.transAxes)
        ax.set_axis_off()
    return items


def plot_sync_waits(res: RunResults, ax):
    """The sync_waits figure: per method, each trainer's mean wait at the synchronisation point
    (ms per step), the rank most often last named above its method."""
    items = _items(res, ax, breakdown.waits, "no per-rank waits in these result files")
    if not items:
        return
    width = 0.8 / max(len(w.ranks) for _, w in items)
    for i, (m, w) in enumerate(items):
        for j, (r, t) in enumerate(zip(w.ranks, w.mean_wait)):
            x = i - 0.4 + width * (j + 0.5)
            red = r == w.last and w.consistent
            ax.bar(x, 1000 * t, width * 0.9, color="#C44E52" if red else "#8C8C8C")
            ax.text(x, 1000 * t, f"r{r}", ha="center", va="bottom", fontsize=7)
        top = 1000 * max(w.mean_wait)
        share = w.last_share[w.ranks.index(w.last)]
        ax.text(i, 1.12 * top + 0.1, (f"last: rank {w.last}" if w.consistent else "no steady "
                                      f"straggler; most often rank {w.last}")
                + f" ({100 * share:.0f}% of steps)", ha="center", fontsize=8)
    ax.set_xticks(range(len(items)), [label(m) for m, _ in items])
    ax.set_ylabel("ms waited per step (mean)")
    ax.set_ylim(0, 1.3 * max(1000 * max(w.mean_wait) for _, w in items) + 0.5)
    ax.set_title("Who waited for whom (red: the rank the others waited for)")


def plot_wire(res: RunResults, ax):
    """MB per step on the wire: what a trainer sent and received per step, per method (counted
    by the lab from the collectives each method issued)."""
    items = _items(res, ax, wire_mb, "no bytes on the wire in these result files")
    if not items:
        return
    x = range(len(items))
    for shift, i, what, hatch in ((-0.2, 0, "sent", ""), (0.2, 1, "received", "//")):
        bars = ax.bar([k + shift for k in x], [w[i] for _, w in items], 0.4, label=what,
                      hatch=hatch, color=[COLORS[m] for m, _ in items], edgecolor="white")
        ax.bar_label(bars, labels=[f"{w[i]:.2f}" for _, w in items], fontsize=8)
    ax.set_xticks(list(x), [label(m) for m, _ in items])
    ax.set_ylabel("MB per step per trainer")
    ax.set_title("MB per step on the wire")
    ax.legend(fontsize=8)


def write_plots(res: RunResults, out_dir: str | os.PathLike) -> list[Path]:
    """The guide's five PNGs, the per-rank waits and the bytes on the wire, under
    <out_dir>/plots/; with several seeds per method also accuracy against wall time and
    against bytes sent (labkit.report.seeds). A workload not judged on accuracy: its figure
    in place of accuracy, in files named for it (figures.plot_stem)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots = Path(out_dir) / layout.PLOTS_DIR
    plots.mkdir(parents=True, exist_ok=True)
    makers = {"throughput_comparison": plot_throughput, "training_time_comparison": plot_training_time,
              "loss_curves": lambda r, ax: plot_losses(r.ok, ax, r.repeats), "accuracy_curves": plot_accuracy,
              "communication_overhead": plot_communication, "sync_waits": plot_sync_waits,
              "wire": plot_wire}
    makers.update({"accuracy_vs_time": lambda r, ax: plot_seeds(r, ax, "time"),
                   "accuracy_vs_bytes": lambda r, ax: plot_seeds(r, ax, "bytes")})
    paths, view = [], res.view
    for name in PLOTS + (SEED_PLOTS if has_seeds(res) else ()):
        fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
        makers[name](res, ax)
        fig.tight_layout()
        path = plots / f"{plot_stem(name, view)}.png"
        with atomic_path(str(path)) as tmp:
            fig.savefig(tmp, format="png")
        plt.close(fig)
        paths.append(path)
    return paths
