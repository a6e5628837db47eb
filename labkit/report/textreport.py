"""performance_report.txt: the notebook's report as plain text, in the same order
(labkit.report.outline): the summary with Table 1, the results, the parts the run has
data for, the projection, the discussion, what the run did not include, then the appendix."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Optional

from labkit.bench import bench_view
from labkit.core import layout
from labkit.core.config import VARIANTS
from labkit.core.files import atomic_path
from labkit.core.methods import label

from . import outline, reading
from .captions import heading
from .discuss import discussion
from .examples import examples_text
from .implementation import QUOTES
from .load import RunResults, load_reproduction, load_variants
from .plots import write_plots
from .projection import projection_text
from .repeats import repeats_text
from .seeds import seeds_text
from .summary import summary_lines
from .tables import (communication_rows, comparison_rows, efficiency_rows, epoch_rows, target,
                     text_table, variant_rows)
from .text import load_bench, ran_on_gpu, reproduction_summary


def _summary(res: RunResults, run: Optional[Path], env: Optional[dict]) -> list[str]:
    t, view = target(res), res.view
    f = view.target
    reaching = (f"the validation accuracy first reaching {t:.2f}%" if view.guide else
                f"the {f.label} first reaching {f.text(t)} ({f.side} it)") if t is not None else ""
    return [*(f"- {line}" for line in summary_lines(res, env)), "",
            heading("comparison"), "", text_table(comparison_rows(res)),
            f"(time and steps to target: {reaching})" if t is not None else "", ""]


def _results(res: RunResults, run: Optional[Path], env: Optional[dict]) -> list[str]:
    parts = []
    rep = load_reproduction(run) if run else None
    if rep:
        parts += [reproduction_summary(rep) + f" ({rep['original']})"]
        parts += [f"  {label(m)}: {v['verdict']}" + "".join(f"; {r}" for r in v.get("reasons") or [])
                  for m, v in rep["methods"].items()] + [""]
    parts += [heading("communication"), "", text_table(communication_rows(res)), ""]
    if ran_on_gpu(res):  # on a CPU run every column but the data wait would be "-"
        parts += [heading("efficiency", res.view), "", text_table(efficiency_rows(res)), ""]
    parts += [f"Figures: the PNG files in {layout.PLOTS_DIR}/ beside this file (report.html shows "
              f"them with their captions).", ""]
    return parts


def _variants(res: RunResults, run: Optional[Path], env: Optional[dict]) -> list[str]:
    variants = load_variants(run)
    methods = {VARIANTS[v]["method"] for v in variants}
    base = {label(m): d for m, d in res.docs.items() if m in methods}
    return [heading("variants"), "", text_table(variant_rows(base, variants)), ""]


def _bench(res: RunResults, run: Optional[Path], env: Optional[dict]) -> list[str]:
    doc = load_bench(run)
    table = bench_view.text_table(doc) if doc.get("results") else "(no bench results)"
    return [heading("bench"), "", table, ""]


def _environment(res: RunResults, run: Optional[Path], env: Optional[dict]) -> list[str]:
    parts = []
    if env:
        gpus = ", ".join(g["name"] for g in env.get("gpus", [])) or "none"
        parts.append(f"machine: {env.get('host')} | CPU: {env.get('cpu')} ({env.get('cpu_count')} cores) | "
                     f"GPUs: {gpus}")
        parts.append(f"versions: python {env.get('python')}, torch {env.get('torch')}, "
                     f"CUDA {env.get('cuda')}, NCCL {env.get('nccl')} | git {str(env.get('git', {}).get('commit'))[:10]}"
                     f"{' (dirty)' if env.get('git', {}).get('dirty') else ''}")
    for m, d in res.ok.items():
        cfg = d.config
        parts.append(f"{label(m)}: world size {d.world_size}, batch {d.batch_size}/trainer"
                     + (f", {cfg.get('model')} on {cfg.get('dataset')}, backend {cfg.get('backend')}" if cfg else "")
                     + f", {len(d.epochs)} epoch(s), {d.start_time} -> {d.end_time}")
    parts.append("")
    for m, d in res.ok.items():
        parts += [f"{d.method}: per epoch", "", text_table(epoch_rows(d)), ""]
    return parts


Part = Callable[[RunResults, Optional[Path], Optional[dict]], list[str]]
PARTS: dict[str, Part] = {
    "summary": _summary,
    "results": _results,
    "repeats": lambda res, run, env: repeats_text(res),
    "seeds": lambda res, run, env: seeds_text(res),
    "variants": _variants,
    "bench": _bench,
    "projection": lambda res, run, env: projection_text(res),
    "discussion": lambda res, run, env: [f"- {line}" for line in discussion(res)] + [""],
    "examples": lambda res, run, env: examples_text(res),
    reading.ANCHOR: lambda res, run, env: reading.reading_text(outline.captions_shown(res, run),
                                                               view=res.view),
    "code": lambda res, run, env: [
        f"report.html quotes the code of each method from labkit's own source ({len(QUOTES)} "
        f"functions: the parameter server's pull and push, the manual all-reduce's hooks, "
        f"DDP's setup).", ""],
    "environment": _environment,
}


def text_report(res: RunResults, env: Optional[dict] = None) -> str:
    run = Path(res.run_dir) if res.run_dir else None
    parts = ["labkit performance report", "=" * 25, ""]
    if run:
        parts.append(f"run: {run}")
    sections = outline.outline(res, run)
    parts += [outline.toc_text(sections), ""]
    missing = outline.not_in_run(res, run)
    for key, _ in sections:
        if key == outline.APPENDIX and missing:
            parts += [missing, ""]
        parts += outline.heading_text(key, res.view) + PARTS[key](res, run, env)
    return "\n".join(parts)


def write_report(res: RunResults, out_dir: str | os.PathLike, env: Optional[dict] = None) -> dict[str, Any]:
    """plots/*.png and performance_report.txt in ``out_dir``; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pngs = write_plots(res, out) if res.docs or res.problems else []  # none for a bench folder
    txt = out / layout.TEXT_REPORT
    with atomic_path(str(txt)) as tmp, open(tmp, "w") as f:
        f.write(text_report(res, env))
    return {"plots": pngs, "text": txt}
