"""Page one of the report: the answer in a few sentences, each built from the functions that
build the tables (the comparison's rows, the communication's, the verdicts, the bound, the
projection), so every number in it is one the tables show, and each names the table it comes
from by key (captions.ref). The notebook and the text report print the same sentences."""
from __future__ import annotations

from typing import Optional

from labkit.core import breakdown, stats
from labkit.core.methods import BASELINE, METHOD_ORDER, SPECS, label
from labkit.core.texttable import two_decimals

from . import memory_table, projection
from .blocks import Block, Figure, Markdown, Page, Table, TableCaption
from .captions import ref
from .load import RunResults
from .seeds import has_seeds
from .tables import (SENT, SPEED_CI, STA, THR_CI, TTA, chance_only, communication_rows,
                     comparison_rows, intervals, target, target_text, throughput_column)
from .text import WORDS, bound_claim, link_lines, reference_lines, speed_verdicts, target_rule

def _bound(m: str) -> bool:
    return m in SPECS and SPECS[m].bound


def _row(rows: list[dict], m: str) -> Optional[dict]:
    return next((r for r in rows if r["Method"] == label(m)), None)


def fastest_line(res: RunResults) -> Optional[str]:
    """Which method was fastest here and by how much: the comparison's throughput and speedup
    with their intervals and the verdict words of its rule (a bound is no candidate)."""
    rows, rate = comparison_rows(res), res.view.rate
    methods = [m for m in METHOD_ORDER if m in res.ok and not _bound(m)]
    thr = {m: _row(rows, m)[throughput_column(res.view)] for m in methods}
    thr = {m: v for m, v in thr.items() if isinstance(v, float) and v == v}
    if not thr or BASELINE not in res.ok:
        return None
    others = [m for m in METHOD_ORDER if m in res.ok and m != BASELINE]  # speed_verdicts' order
    verdict = {m: v.label for m, v in zip(others, speed_verdicts(res))}
    top = max(thr, key=thr.get)
    r = _row(rows, top)
    said = f"{label(top)}, {two_decimals(thr[top])} {rate} (95% CI {r[THR_CI]})"
    if top != BASELINE:
        said += f", {r['Speedup vs DDP']} DDP (95% CI {r[SPEED_CI]}: {WORDS[verdict[top]]})"
    sure = (verdict.get(top) == "faster" if top != BASELINE else
            all(verdict[m] == "slower" for m in methods if m != BASELINE))
    lead = (f"Fastest here ({ref('comparison')})" if sure else
            f"Highest measured throughput ({ref('comparison')}; no verdict: see its interval)")
    rest = [f"{label(m)} {_row(rows, m)['Speedup vs DDP']} DDP (95% CI {_row(rows, m)[SPEED_CI]}: "
            f"{WORDS[verdict[m]]})" for m in methods if m not in (BASELINE, top)]
    return f"{lead}: {said}" + (f"; {'; '.join(rest)}" if rest else "") + "."


def time_line(res: RunResults) -> Optional[str]:
    """Where each method's step went (the step breakdown's figure): its largest part, with the
    communication table's exposed communication where that is the largest."""
    comm = {r["Method"]: r for r in communication_rows(res)}
    by_part: dict[str, list[str]] = {}
    for m in METHOD_ORDER:
        b = breakdown.of_result(res.ok[m]) if m in res.ok else None
        if b is not None:
            by_part.setdefault(max(breakdown.ORDER, key=lambda k: b.parts[k]), []).append(m)
    if not by_part:
        return None
    said = []
    for part, ms in by_part.items():
        ms_ = [comm.get(label(m), {}).get("Exposed (ms)") for m in ms]
        numbers = (f" ({', '.join(two_decimals(x) for x in ms_)} ms per step, "
                   f"{ref('communication')}'s Exposed)"
                   if part == "exposed" and all(isinstance(x, float) for x in ms_) else "")
        said.append(f"{breakdown.LABELS[part]} for {', '.join(label(m) for m in ms)}{numbers}")
    return (f"Where the time went ({ref('communication_overhead')}), the largest part of each "
            f"step: {'; '.join(said)}.")


def accuracy_line(res: RunResults) -> Optional[str]:
    """Time to the target, fastest first, as the comparison table gives it; for a workload not
    judged on accuracy also the rule that set the target, the MB each method sent to get there,
    and which reached it first."""
    chance = chance_only(res)
    if chance:
        return chance.split(". ")[0] + " (synthetic data)."
    t = target(res)
    if t is None:
        return None
    rows, view = comparison_rows(res), res.view
    got = [(m, _row(rows, m)) for m in METHOD_ORDER if m in res.ok]
    reached = sorted(((m, r) for m, r in got if isinstance(r[TTA], float)), key=lambda x: x[1][TTA])
    never = [label(m) for m, r in got if r[TTA] == "not reached"]
    seeds = (f"; {ref('seeds')} judges it over seeds" if has_seeds(res) else
             "; one seed per method, so these are not verdicts")
    if view.guide:
        items = [f"{label(m)} {two_decimals(r[TTA])} s ({r[STA]} steps)" for m, r in reached]
        return (f"Time to {t:.2f}% validation accuracy ({ref('comparison')}): " + ", ".join(items)
                + (f"; not reached: {', '.join(never)}" if never else "") + seeds + ".")
    items = [f"{label(m)} {two_decimals(r[TTA])} s ({r[STA]} steps{_sent(r)})" for m, r in reached]
    first = (f"; first to reach it: {label(reached[0][0])}" if reached else "; no method reached it")
    return (f"Time to {view.goal(t)} ({target_rule(res)}; {ref('comparison')}): " + ", ".join(items)
            + (f"; not reached: {', '.join(never)}" if never else "") + first + seeds + ".")


def _sent(row: dict) -> str:
    """", 14.47 MB sent per trainer" from the comparison's row, "" where it does not count them."""
    mb = row.get(SENT)
    return f", {two_decimals(mb)} MB sent per trainer" if isinstance(mb, float) else ""


def machine_line(res: RunResults, env: Optional[dict]) -> Optional[str]:
    """The machine and the run's shape, in one sentence."""
    d = next(iter(res.ok.values()), None)
    if d is None:
        return None
    cfg, w = d.config, d.world
    where = ""
    if env:
        gpus = ", ".join(g["name"] for g in env.get("gpus", [])) or "no GPU"
        where = f" on {env.get('host')} ({env.get('cpu')}, {env.get('cpu_count')} cores; {gpus})"
    model = cfg.get("model") if res.view.guide else f"{cfg.get('model')} ({res.view.title})"
    what = ", ".join(x for x in (f"{model} on {cfg['dataset']}" if cfg.get("model") else "",
                                 f"{d.world_size} processes per method",
                                 cfg.get("backend") or w.get("backend") or "",
                                 f"{len(d.epochs)} epoch(s)") if x)
    return f"Measured{where}: {what}."


def summary_lines(res: RunResults, env: Optional[dict] = None) -> list[str]:
    """The report's first sentences: the fastest method, where the time went, what
    communication costs at most, time to accuracy, the projection, memory per rank and what
    fits, the machine (and link)."""
    got = projection.projected(res) if res.ok else None
    return [x for x in (fastest_line(res), time_line(res), bound_claim(res), accuracy_line(res),
                        *reference_lines(res), projection.sentence(got) if got else None,
                        memory_table.memory_line(res), memory_table.fits_line(res), machine_line(res, env))
            if x] + link_lines(res)


def summary_blocks(page: Page) -> list[Block]:
    """The Summary part: the sentences, the comparison table and the step breakdown's figure."""
    res, view = page.res, page.view
    t, f = target(res), view.target
    reaching = (f"the validation accuracy first reaching {t:.2f}%" if view.guide else
                f"the {f.label} first reaching {f.text(t)} ({f.side} it)") if t is not None else ""
    said = [f"- {line}" for line in summary_lines(res, page.env)]
    return [Markdown("\n".join(said), plain=(*said, "")),
            TableCaption("comparison", view, {"target": target_text(res)}),
            Table(comparison_rows(res),
                  notes=(f"(time and steps to target: {reaching})" if t is not None else "",)),
            *([Figure("communication_overhead", page.plots["communication_overhead"], view)]
              if "communication_overhead" in page.plots else [])]
