"""performance_report.txt: the notebook's report as plain text, from the same blocks in the
same order (labkit.report.outline.page_blocks, printed by labkit.report.blocks.plain): the
summary with the comparison table, the results, the parts the run has data for, the
projection, the discussion, what the run did not include, then the appendix."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from labkit.core import layout
from labkit.core.files import atomic_path

from .blocks import Page, plain
from .figures import plot_key
from .load import RunResults
from .outline import page_blocks
from .plots import write_plots


def page_of(res: RunResults, env: Optional[dict] = None, out: Optional[Path] = None,
            pngs: Optional[list[Path]] = None) -> Page:
    """What the report's parts read: ``res`` with its run folder, ``env``, the folder the
    notebook's own figures go in and the figures write_plots drew."""
    return Page(res, Path(res.run_dir) if res.run_dir else None, env, out,
                {plot_key(png.stem): png for png in pngs or []})


def text_report(res: RunResults, env: Optional[dict] = None) -> str:
    return "\n".join(plain(page_blocks(page_of(res, env))))


def write_report(res: RunResults, out_dir: str | os.PathLike, env: Optional[dict] = None) -> dict[str, Any]:
    """plots/*.png and performance_report.txt in ``out_dir``; returns their paths, and the
    report's blocks (``blocks``), which the notebook shows (labkit.report.blocks.shown)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pngs = write_plots(res, out) if res.docs or res.problems else []  # none for a bench folder
    blocks = page_blocks(page_of(res, env, out, pngs))
    txt = out / layout.TEXT_REPORT
    with atomic_path(str(txt)) as tmp, open(tmp, "w") as f:
        f.write("\n".join(plain(blocks)))
    return {"plots": pngs, "text": txt, "blocks": blocks}
