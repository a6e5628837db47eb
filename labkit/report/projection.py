"""The projection's table (caption key projection_methods): every method of the run projected
to 1024 GPUs on each interconnect from its measured bytes (labkit.costmodel.measured), and
where each would start to beat DDP: on which interconnect, and below which compute time per
step (a CPU run's long steps hide what a GPU's short ones expose). The speed side of a method
that sends less, which the accuracy side (the seeds' table) completes."""
from __future__ import annotations

from typing import Optional

from labkit.core import breakdown
from labkit.core.config import VARIANTS
from labkit.core.methods import BASELINE, SPECS, label
from labkit.core.run_folder import goodputs
from labkit.core.texttable import text_table
from labkit.costmodel import INTERCONNECTS, get_link
from labkit.costmodel.alphabeta import Link
from labkit.costmodel.measured import (
    break_even, measured_inputs, project_methods, project_one, where_it_wins)

from .blocks import Block, Markdown, Shown, Table, TableCaption, Text, plain, shown
from .captions import ref
from .load import RunResults, runs_of
from .seeds import judged

AT = 1024  # the GPU count of the table's cells


def _serves(m: str) -> bool:
    s = SPECS.get(m) or SPECS.get(VARIANTS.get(m, {}).get("method", ""))
    return bool(s and s.serves)


def inputs_of(res: RunResults) -> Optional[dict[str, dict]]:
    """{method: its measured inputs} for every judged method with a breakdown and wire figures
    (DDP among them, and at least one other), every method given DDP's compute; else None."""
    inputs = {}
    for m in judged(res):
        runs = [d for d in runs_of(res, m) if d.epochs]
        x = measured_inputs(runs[0]) if runs else None
        if x is not None:
            inputs[m] = x
    if BASELINE not in inputs or len(inputs) < 2:
        return None
    for x in inputs.values():  # the same compute: the projection compares what each sends
        x["compute"] = inputs[BASELINE]["compute"]
    return inputs


def _ms(seconds: float) -> str:
    return f"{seconds:.3g} s" if seconds >= 1 else f"{1e3 * seconds:.3g} ms"


def _when(span: Optional[tuple[float, float]]) -> str:
    """When a method wins, as a few words: "below 85 ms", "any", "never"."""
    if span is None:
        return "never"
    lo, hi = span
    if lo <= GRID[0] * 1.001 and hi >= GRID[1] * 0.999:
        return "any"
    if lo <= GRID[0] * 1.001:
        return f"below {_ms(hi)}"
    if hi >= GRID[1] * 0.999:
        return f"above {_ms(lo)}"
    return f"{_ms(lo)} to {_ms(hi)}"


GRID = (1e-4, 10.0)  # the compute times per step break_even searches (s)


def projected(res: RunResults) -> Optional[tuple[float, dict[str, dict[str, tuple]]]]:
    """(DDP's compute per step, {method: {link: (its throughput at 1024 GPUs relative to DDP's,
    whether it beats DDP there now, when it would: _when's words)}}), or None where there is
    nothing to project. Computed once for the table and the lines."""
    inputs = inputs_of(res)
    if inputs is None:
        return None
    serves = {m: _serves(m) for m in inputs}
    proj = project_methods(inputs, serves, gpus=(AT,))
    step = {(r["method"], r["link"]): r["step"] for r in proj}
    links = list(dict.fromkeys(r["link"] for r in proj))
    out: dict[str, dict[str, tuple]] = {}
    for m, x in inputs.items():
        now = where_it_wins(proj, m) if m != BASELINE else {}
        out[m] = {k: (step[(BASELINE, k)] / step[(m, k)], now.get(k) is not None,
                      None if m == BASELINE else
                      _when(break_even(x, inputs[BASELINE], AT, get_link(k), serves=serves[m],
                                       base_serves=serves[BASELINE], low=GRID[0], high=GRID[1])))
                  for k in links}
    return inputs[BASELINE]["compute"], out


def _as_ddp(cells: dict[str, tuple]) -> bool:
    """Whether every cell of a method says what DDP's does: 1.00x, and never faster."""
    return all(f"{ratio:.2f}" == "1.00" and when == "never" for ratio, _, when in cells.values())


def _never(cells: dict[str, tuple]) -> bool:
    return all(when == "never" for _, _, when in cells.values())


def rows(got) -> list[dict]:
    """One row per method of ``got`` (projected()) that differs from DDP somewhere: its
    projected throughput at 1024 GPUs relative to DDP's on each interconnect at this run's
    compute, and the compute times per step at which it would beat DDP there (said once, in
    lines(), for a method that never would). DDP's own row (1.00x) and a method whose every
    cell says the same are no rows: lines() states them in one line."""
    return [{"Method": label(m),
             **{INTERCONNECTS[k].name: f"{ratio:.2f}x" + ("" if _never(cells) or when == "never"
                                                          else f"; wins: {when}")
                for k, (ratio, _, when) in cells.items()}}
            for m, cells in got[1].items() if m != BASELINE and not _as_ddp(cells)]


def lines(got) -> list[str]:
    """What the table does not say, once per method: that a method is DDP on every
    interconnect, or that it never beats DDP at any compute time per step."""
    out = []
    for m, cells in got[1].items():
        if m == BASELINE:
            continue
        if _as_ddp(cells):
            out.append(f"{label(m)}: the same as DDP (1.00x) on every interconnect, at any "
                       f"compute time per step.")
        elif _never(cells):
            out.append(f"{label(m)}: never beats DDP at {AT} GPUs, on any interconnect, at any "
                       f"compute time per step from 0.1 ms to 10 s.")
    return out


def sentence(got) -> str:
    """The projection in one sentence, for the report's summary."""
    wins = {m: [INTERCONNECTS[k].name for k, (_, now, _) in cells.items() if now]
            for m, cells in got[1].items() if m != BASELINE}
    some = {m: when for m, cells in got[1].items() if m != BASELINE
            for _, _, when in cells.values() if when != "never"}
    now = "; ".join(f"{label(m)} on {', '.join(k)}" for m, k in wins.items() if k)
    head = (f"Projected to {AT} GPUs at this run's compute ({_ms(got[0])} per step; "
            f"{ref('projection_methods')}, speed only): ")
    if now:
        return head + f"faster than DDP: {now}."
    later = ", ".join(label(m) for m in some)
    return head + ("no method beats DDP on any interconnect"
                   + (f"; {later} would at other compute times per step "
                      f"({ref('projection_methods')})." if later
                      else ", at any compute time per step from 0.1 ms to 10 s."))


def projection_blocks(res: RunResults) -> list[Block]:
    """The report's part (blocks; none where there is nothing to project: the report's line of
    what the run did not include says so)."""
    got = projected(res)
    if got is None:
        return []
    table, said = rows(got), [f"- {line}" for line in lines(got)]
    return [TableCaption("projection_methods", fields={"at": AT, "compute": _ms(got[0])},
                         notes=(f"(at this run's compute, {_ms(got[0])} per step)",)),
            *([Table(table, text_table(table))] if table else []),
            Markdown("\n".join(said), plain=(*said, "")) if said else Text(("",)),
            *on_link_blocks(res)]


def projection_section(res: RunResults) -> list[Shown]:
    """The part as the notebook shows it."""
    return shown(projection_blocks(res))


def projection_text(res: RunResults) -> list[str]:
    """The same for performance_report.txt (empty where there is nothing to project)."""
    return plain(projection_blocks(res))


# ---------------------------------------------------------------------------------------------
# projection_on_link: the same model on the emulated link the run had, against the step it measured
# ---------------------------------------------------------------------------------------------

#: the per-message latency the model gives the emulated link: TCP through the kernel, as its
#: 10 GbE (the emulation adds no delay of its own unless the link asks for one)
TCP_ALPHA = INTERCONNECTS["10gbe"].alpha


def emulated(res: RunResults) -> Optional[dict]:
    """The emulated link the run's methods had (their result files' ``link``), or None."""
    return next((d.link for d in res.ok.values() if isinstance(d.link, dict)
                 and d.link.get("rate_bit")), None)


def goodput_bit(link: dict) -> Optional[float]:
    """The probe's goodput (bit/s): the median over the nodes and both directions."""
    got = sorted(g for g in goodputs(link) if g > 0)
    return 1e6 * got[len(got) // 2] if got else None


def _model_link(name: str, rate_bit: float, delay_s: float) -> Link:
    return Link.from_bandwidth(name, rate_bit / 8, TCP_ALPHA + delay_s)


def on_link(res: RunResults) -> Optional[tuple[dict, list[dict]]]:
    """(the link, one row per method): the projection's model of the method's step on the run's
    emulated link (a flat ring over every rank: the ring crosses each node's port once each way,
    so each port carries what one rank sends; a PS server's port every worker's copy), at the
    set rate and at the probe's goodput, beside the step the method measured, with the model's
    error. Its workers are the run's trainers. None for a run without an emulated link or
    without the projection's inputs (inputs_of)."""
    link, inputs = emulated(res), inputs_of(res)
    if link is None or inputs is None:
        return None
    delay = float(link.get("delay_us") or 0) / 1e6
    models = {"set": _model_link(link["link"], link["rate_bit"], delay)}
    if goodput_bit(link):
        models["goodput"] = _model_link("goodput", goodput_bit(link), delay)
    out = []
    for m, x in inputs.items():
        measured = _measured_step([d for d in runs_of(res, m) if d.epochs][0])
        row = {"method": m, "measured": measured}
        for k, lk in models.items():
            step = project_one(x, x["trainers"], lk, serves=_serves(m), intra=None)["step"]
            row[k] = step
            row[f"{k}_error"] = 100.0 * (step - measured) / measured
        out.append(row)
    return link, out


def _measured_step(doc) -> float:
    """The step a method measured: its breakdown's, else (a sharded method: no compute-only
    steps, no breakdown) its epochs' mean step time."""
    b = breakdown.of_result(doc)
    if b is not None:
        return b.measured or b.total
    return float(sum(e.avg_batch_time for e in doc.epochs) / len(doc.epochs))


def on_link_rows(got) -> list[dict]:
    link, rows = got
    return [{"Method": label(r["method"]), "Measured step": _ms(r["measured"]),
             f"Model at {link['link']}": f"{_ms(r['set'])} ({r['set_error']:+.0f}%)",
             **({"Model at the probe's goodput": f"{_ms(r['goodput'])} ({r['goodput_error']:+.0f}%)"}
                if "goodput" in r else {})} for r in rows]


def on_link_blocks(res: RunResults) -> list[Block]:
    got = on_link(res)
    if got is None:
        return []
    table = on_link_rows(got)
    return [TableCaption("projection_on_link", fields={"link": got[0]["link"]}),
            Table(table, text_table(table))]


def on_link_section(res: RunResults) -> list[Shown]:
    return shown(on_link_blocks(res))


def on_link_text(res: RunResults) -> list[str]:
    return plain(on_link_blocks(res))
