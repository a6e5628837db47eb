"""The report's repeats part (`labkit experiment --repeats N`): every repeat of every method,
with its seed and its place in the rotated run order, and each method aggregated over its
repeats (throughput: mean with a t-interval over the repeats, labkit.core.stats.aggregate)."""
from __future__ import annotations

from typing import Optional

from labkit.core import stats
from labkit.core import layout
from labkit.core.methods import METHOD_ORDER, label
from labkit.core.run_folder import RunFolder
from labkit.core.texttable import text_table, two_decimals

from .blocks import Block, Markdown, Shown, Table, TableCaption, Text, plain, shown
from .load import RunResults
from .workload_view import WorkloadView, number


def run_order(res: RunResults) -> Optional[list[list[str]]]:
    """experiment.json's ``order``: the methods of each repeat in the order they ran."""
    try:
        return RunFolder(res.run_dir).read(layout.EXPERIMENT).get("order")
    except (TypeError, OSError, ValueError):
        return None


def has_repeats(res: RunResults) -> bool:
    return any(len(v) > 1 for v in res.repeats.values())


def repeat_rows(res: RunResults) -> list[dict]:
    """One row per method and repeat."""
    order = run_order(res) or []
    view, rows = res.view, []
    for m in METHOD_ORDER:
        for i, d in enumerate(res.repeats.get(m, []), 1):
            agg = stats.aggregate([d])
            pos = order[i - 1].index(m) + 1 if i <= len(order) and m in order[i - 1] else None
            rows.append({"Method": label(m), "Repeat": i, "Seed": d.config.get("seed", "-"),
                         "Ran as": f"{pos} of {len(order[i - 1])}" if pos else "-",
                         f"Throughput ({view.rate})": agg.throughput_per_repeat[0],
                         view.best_column(): _best(view, [d], agg),
                         "Status": d.status})
    return rows


def _best(view: WorkloadView, docs: list, agg: stats.Aggregate) -> object:
    """The mean over ``docs`` of each one's best value of the first figure: the guide's best
    accuracy (``agg``'s), else the best by the figure's direction as the report writes it
    ("-" where one has none)."""
    if view.guide:
        return agg.best_accuracy
    f = view.target
    vals = [d.best_figure(f.key, f.higher_is_better) for d in docs]
    return "-" if not vals or None in vals else number(sum(vals) / len(vals))


def aggregate_rows(res: RunResults) -> list[dict]:
    """One row per method: mean over its repeats, with the 95% CI over repeats."""
    view, rows = res.view, []
    for m in METHOD_ORDER:
        docs = [d for d in res.repeats.get(m, []) if d.epochs]
        if not docs:
            continue
        agg = stats.aggregate(docs)
        iv = agg.throughput
        rows.append({"Method": label(m), "Repeats": agg.repeats,
                     f"Throughput ({view.rate})": iv.value if iv.value is not None else float("nan"),
                     "95% CI": iv.ci_text(1) + (f" (over {iv.basis})" if iv.available else ""),
                     view.best_column(): _best(view, docs, agg),
                     "Seeds": ", ".join(str(s) for s in agg.seeds)})
    return rows


def repeats_blocks(res: RunResults) -> list[Block]:
    """The report's part (blocks); none for a run without repeats (the report's "Not in this
    run" line says how to add them)."""
    if not has_repeats(res):
        return []
    ran = [", ".join(o) for o in run_order(res) or []]  # each repeat's methods, as they ran
    agg, each = aggregate_rows(res), repeat_rows(res)
    return [TableCaption("repeats"),
            *([Markdown("Run order: " + "; ".join(f"repeat {i}: {o}" for i, o in enumerate(ran, 1)))]
              if ran else []),
            Text((*(f"repeat {i} ran: {o}" for i, o in enumerate(ran, 1)), "")),
            Table(agg, text_table(agg, two_decimals)), Table(each, text_table(each, two_decimals))]


def repeats_section(res: RunResults) -> list[Shown]:
    """The part as the notebook shows it (none without repeats)."""
    return shown(repeats_blocks(res))


def repeats_text(res: RunResults) -> list[str]:
    """The same for performance_report.txt (empty without repeats)."""
    return plain(repeats_blocks(res))
