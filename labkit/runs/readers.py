"""The commands that only read run folders: `labkit report` (a report from result files),
`labkit runs` (the lab notebook of every run folder) and `labkit diff` (two runs compared).
Bad input is a ConfigError: one line, exit 2 (labkit.cli). What they print is the command's
product (tables, JSON, diff lines): print to stdout, shown with -q too, so pipes keep working."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from labkit.core import layout
from labkit.core.config import ConfigError
from labkit.core.files import strict_dumps
from labkit.core.run_folder import RunFolder


def report_command(paths: list[str], out: Optional[str] = None) -> int:
    """`labkit report PATH...`: the text report and plots of result files, a run folder or a
    sweep folder; 1 when a result had a problem."""
    from labkit import report

    for p in paths:
        if not os.path.exists(p):
            raise ConfigError(f"{p!r} does not exist")
    from labkit.bench.bench_view import BenchError
    from labkit.bench.bench_view import load as load_bench
    from labkit.report import sweep as rs

    if len(paths) == 1 and rs.is_sweep(paths[0]):  # a `labkit sweep` folder: the scaling study
        try:
            sw = rs.load_sweep(paths[0])
        except rs.SweepError as e:
            raise ConfigError(str(e)) from None
        files = rs.write_sweep_report(sw, out or Path(paths[0]) / layout.REPORT_DIR)
        print(files["text"].read_text() + f"plot: {files['plot']}")
        if "study_text" in files:
            print("\n" + files["study_text"].read_text() + f"plot: {files['study_plot']}")
        if "link_text" in files:
            print("\n" + files["link_text"].read_text() + f"plot: {files['link_plot']}")
        return 0 if sw.points and all(not p.res.problems for p in sw.points) else 1
    res = report.load_files(paths)
    single_run = len(paths) == 1 and Path(paths[0]).is_dir()
    try:
        has_bench = single_run and bool(load_bench(paths[0], need_results=False))
    except BenchError:
        has_bench = False
    if not res.docs and not res.problems and not has_bench:
        raise ConfigError(f"no result files ({', '.join(report.RESULT_FILES.values())}) or "
                          f"bench.json in {', '.join(paths)}")
    run_folder = single_run and (RunFolder(paths[0]).has(layout.EXPERIMENT) or has_bench)
    out = out or (str(Path(paths[0]) / layout.REPORT_DIR) if run_folder else ".")
    files = report.write_report(res, out, report.load_env(res.run_dir))
    print(report.text_report(res, report.load_env(res.run_dir)))
    print(f"plots: {Path(out) / 'plots'}/ ({len(files['plots'])} files)\nreport: {files['text']}")
    if res.ok:  # end with what a reader looks for: the verdicts, which respect the noise
        print("\n" + "\n".join(report.verdict_lines(res)))
    return 1 if res.problems else 0


def runs_command(runs_dir: Optional[str], tag: Optional[str] = None, since: Optional[str] = None,
                 status: Optional[str] = None, sort: str = "when", reverse: bool = False,
                 all_params: bool = False, as_json: bool = False) -> int:
    """`labkit runs`: one row per run folder under ``runs_dir`` (None: the project's runs/),
    filtered and sorted."""
    from . import runs_index as ri

    runs_dir = str(layout.runs_root(runs_dir))
    if not os.path.isdir(runs_dir):
        raise ConfigError(f"{runs_dir!r} is not a folder of runs")
    try:
        rows = ri.select(ri.scan(runs_dir), tag, since, status, sort, reverse)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if as_json:
        print(strict_dumps([r.to_json() for r in rows], indent=1))
    elif not rows and (tag or since or status):
        print(f"(no run folder under {runs_dir} matches --tag, --since or --status)")
    else:
        print(ri.text(rows, all_params))
    return 0


def diff_command(run_a: str, run_b: str, everything: bool = False, figure: Optional[str] = None,
                 as_json: bool = False) -> int:
    """`labkit diff A B`: what changed and what came of it, and the loss curves on one figure."""
    from . import rundiff

    doc = rundiff.diff_runs(run_a, run_b)
    if as_json:
        print(strict_dumps(doc, indent=1, default=str))
        return 0
    print("\n".join(rundiff.diff_lines(doc, everything)))
    fig = figure or f"diff_{Path(run_a).resolve().name}_vs_{Path(run_b).resolve().name}.png"
    if rundiff.plot_losses(doc, fig):
        print(f"\nloss curves: {os.path.abspath(fig)}")
    return 0
