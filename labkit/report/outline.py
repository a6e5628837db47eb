"""The report's outline: its parts in order, each one entry of SECTIONS (its anchor, its
heading, whether a run has its data, and the function that returns its blocks), read by both
renderers: report.ipynb shows ``page_blocks`` (labkit.report.blocks.shown) and
performance_report.txt prints them (labkit.report.textreport). The answer first, then the
results, the optional parts a run has data for, the projection and the discussion, then the
appendix (how to read the report, the code, the environment). A new part is one function that
returns blocks and one entry here, which declares the captions of its tables and figures too
(``Section.captions``: labkit.report.captions numbers them after the built-in parts', in this
order).

A part appears only when the run has its data; what the run did not include is one line at
the end of the body (not_in_run), with how to add each."""
from __future__ import annotations

from pathlib import Path
from types import MappingProxyType
from typing import Callable, Mapping, NamedTuple, Optional

from labkit.core.methods import METHOD_ORDER, SPECS

from . import projection, reading
from .blocks import Block, Markdown, Page
from . import captions
from .captions import Caption, ref
from .discuss import discussion_blocks
from .examples import examples_blocks, samples_of
from .implementation import code_blocks
from .load import RunResults, load_reproduction, load_variants
from .memory_table import has_memory, memory_blocks
from .repeats import has_repeats, repeats_blocks
from .sections import bench_blocks, environment_blocks, results_blocks, variants_blocks
from .seeds import has_seeds, seeds_blocks
from .summary import summary_blocks
from .text import load_bench, ran_on_gpu
from .workload_view import WorkloadView


class Section(NamedTuple):
    key: str                                          # its anchor (the contents link to it)
    title: str                                        # its heading
    has: Callable[[RunResults, Optional[Path]], bool]  # whether a run (its folder) has its data
    blocks: Callable[[Page], list[Block]]             # what it shows, in both renderers
    #: the captions of the tables and figures it adds, by key (the built-in parts' are in
    #: captions.CAPTIONS, whose numbers they keep)
    captions: Mapping[str, Caption] = MappingProxyType({})


def _training(res: RunResults, run: Optional[Path]) -> bool:
    return bool(res.docs or res.problems)


def _always(res: RunResults, run: Optional[Path]) -> bool:
    return True


def _bench(res: RunResults, run: Optional[Path]) -> bool:
    doc = load_bench(run) if run else None
    return doc is not None


def reading_blocks(page: Page) -> list[Block]:
    """Appendix A: the definitions of the terms of the tables this report shows."""
    present = captions_shown(page.res, page.run)
    return [Markdown(reading.reading_markdown(present, page.view),
                     plain=tuple(reading.reading_text(present, view=page.view)))]


#: every part of the report in its order
SECTIONS: tuple[Section, ...] = (
    Section("summary", "Summary", lambda res, run: bool(res.ok), summary_blocks),
    Section("results", "Results", _training, results_blocks),
    Section("memory", "Memory per rank", lambda res, run: has_memory(res), memory_blocks),
    Section("repeats", "Repeats", lambda res, run: has_repeats(res),
            lambda p: repeats_blocks(p.res)),
    Section("seeds", "Time to accuracy over seeds", lambda res, run: has_seeds(res),
            lambda p: seeds_blocks(p.res, list(p.plots.values()))),
    Section("variants", "Method variants", lambda res, run: bool(run and load_variants(run)),
            lambda p: variants_blocks(p.run, p.res, p.out)),
    Section("bench", "Benchmark: where the time goes", _bench, lambda p: bench_blocks(p.run, p.out)),
    Section("projection", "Projection to larger clusters",
            lambda res, run: bool(res.ok) and projection.projected(res) is not None,
            lambda p: projection.projection_blocks(p.res)),
    Section("discussion", "Discussion", _training, lambda p: discussion_blocks(p.res)),
    Section("examples", "What the model wrote", lambda res, run: bool(samples_of(res)),
            lambda p: examples_blocks(p.res)),
    Section(reading.ANCHOR, f"Appendix A. {reading.TITLE}", _always, reading_blocks),
    Section("code", "Appendix B. Implementation: the code", _always,
            lambda p: code_blocks(p.view.optimizer_step)),
    Section("environment", "Appendix C. Environment and configuration", _always, environment_blocks),
)
APPENDIX = reading.ANCHOR  # the first part of the appendix


def declared() -> dict[str, Caption]:
    """The captions the parts declare, in the outline's order (read when a number is needed, so
    a part added to SECTIONS is numbered at once)."""
    out: dict[str, Caption] = {}
    for s in SECTIONS:
        for k, c in s.captions.items():
            if k in captions.CAPTIONS or k in out:
                raise ValueError(f"the report part {s.key!r} declares the caption {k!r}, which "
                                 f"another part already has: give it a key of its own")
            out[k] = c
    return out


captions.declared = declared


def titles() -> dict[str, str]:
    """Each part's heading, by anchor."""
    return {s.key: s.title for s in SECTIONS}


def present(res: RunResults, run: Optional[Path]) -> dict[str, bool]:
    """Per part, whether this run has its data."""
    return {s.key: s.has(res, run) for s in SECTIONS}


def title(key: str, view: Optional[WorkloadView] = None) -> str:
    """A part's heading, in the words of ``view``'s workload (None: the guide's)."""
    if key == "seeds" and view is not None and not view.guide:
        return "Time to target over seeds"
    return titles()[key]


def outline(res: RunResults, run: Optional[Path]) -> list[tuple[str, str]]:
    """The parts this run's report has, in order: (anchor, heading)."""
    has = present(res, run)
    return [(s.key, title(s.key, res.view)) for s in SECTIONS if has[s.key]]


def captions_shown(res: RunResults, run: Optional[Path]) -> set[str]:
    """The CAPTIONS keys of the tables the report shows (the appendix defines their terms)."""
    has = present(res, run)
    keys = {"comparison", "communication"} if has["results"] else set()
    keys |= {"efficiency"} if has["results"] and ran_on_gpu(res) else set()
    keys |= {k for k in ("repeats", "seeds", "variants", "bench", "memory") if has[k]}
    keys |= {"projection_methods"} if has["projection"] else set()
    keys |= {"reproduction"} if run and load_reproduction(run) else set()
    return keys | {k for s in SECTIONS if has[s.key] for k in s.captions}


def toc_markdown(parts: list[tuple[str, str]]) -> str:
    """The HTML's table of contents: one line of links to the parts' anchors."""
    body = [f"[{t}](#{k})" for k, t in parts if not t.startswith("Appendix")]
    appendix = [f"[{t.split('. ', 1)[0].split()[-1]}. {t.split('. ', 1)[1]}](#{k})"
                for k, t in parts if t.startswith("Appendix")]
    return ("**Contents:** " + " · ".join(body)
            + (" · Appendix: " + " · ".join(appendix) if appendix else ""))


def toc_text(parts: list[tuple[str, str]]) -> str:
    return "Contents: " + "; ".join(t for _, t in parts)


def heading_markdown(key: str, view: Optional[WorkloadView] = None) -> str:
    """A part's heading with its anchor (the table of contents links to it)."""
    return f'## <a id="{key}"></a>{title(key, view)}'


def heading_text(key: str, view: Optional[WorkloadView] = None) -> list[str]:
    t = title(key, view)
    return [t, "-" * len(t), ""]


def front_blocks(page: Page, parts: list[tuple[str, str]]) -> list[Block]:
    """What the report opens with: the run folder, its problems and the contents (the text
    report: its title, the folder and the contents)."""
    res, run, env = page.res, page.run, page.env
    lines = [f"**Run folder:** `{run}`" + (f", recorded {env.get('time')} on `{env.get('host')}`"
                                           if env else "")]
    if res.problems:
        lines.append("\n**Problems** (the rest of the report still renders):\n")
        lines += [f"- <span style='color:#a00'>{p}</span>" for p in res.problems.values()]
    if not _training(res, run):
        lines.append("\nThis folder holds no training result files: see *Benchmark* below.")
    lines.append("\n" + toc_markdown(parts))
    return [Markdown("\n".join(lines), plain=("labkit performance report", "=" * 25, "",
                                               *([f"run: {run}"] if run else []),
                                               toc_text(parts), ""))]


def page_blocks(page: Page) -> list[Block]:
    """The whole report as blocks, in the outline's order: the front, then each part this run
    has under its heading, with the line of what the run did not include before the appendix."""
    parts = outline(page.res, page.run)
    missing = not_in_run(page.res, page.run)
    blocks, of = front_blocks(page, parts), {s.key: s for s in SECTIONS}
    for key, _ in parts:
        if key == APPENDIX and missing:
            blocks.append(Markdown(f"*{missing}*", plain=(missing, "")))
        blocks.append(Markdown(heading_markdown(key, page.view),
                               plain=tuple(heading_text(key, page.view))))
        blocks += of[key].blocks(page)
    return blocks


def not_in_run(res: RunResults, run: Optional[Path]) -> Optional[str]:
    """One line: the parts this run did not include, and how to add each (None: it has all)."""
    has = present(res, run)
    missing = []
    if res.ok and not has["repeats"]:
        to = "accuracy" if res.view.guide else "target"
        missing.append("repeats (`labkit experiment --repeats N`: the spread between launches, "
                       f"and time to {to} over seeds)")
    if res.ok and not has["variants"]:
        missing.append("variants (`--methods ddp,ps,ps-async,allreduce-fp16`, or ps-sharded, "
                       "ddp-fp16, ps-fp16)")
    if not has["bench"]:
        missing.append("bench (`labkit bench --variants ddp,allreduce,ps`: each step against "
                       "compute-only steps and the raw collectives, with the cost model)")
    bound = [m for m in METHOD_ORDER if m in SPECS and SPECS[m].bound]
    if res.ok and bound and not any(m in res.ok for m in bound):
        missing.append(f"the no-communication bound (`--methods ...,{bound[0]}`: what "
                       f"communication costs at most)")
    if res.ok and not has["projection"]:
        missing.append("the projection (DDP and another method, each with its compute-only "
                       "calibration)")
    if res.ok and not ran_on_gpu(res):
        missing.append(f"GPU use ({ref('efficiency')}: a run on GPUs)")
    return "Not in this run: " + "; ".join(missing) + "." if missing else None
