"""papermill runs labkit's notebooks; the report notebooks are then exported as one HTML file
and a PDF (labkit.orchestrate.export).

The notebooks ship as package data (labkit/notebooks links to the repository's notebooks/),
so an installed labkit runs experiments from any folder.

A report is written whole or not at all: the notebook runs into a temp file beside
report.ipynb, and report.ipynb, report.html and report.pdf are each renamed into place once
complete (labkit.core.files.atomic_path), so a failure, a Ctrl-C or a full disk leaves the
previous report as it was and no temp file. ``labkit report RUN --html`` (:func:`remake_report`)
writes the report of a run folder made without one (--no-report), moved, or older than labkit.
"""
from __future__ import annotations

import logging
import os
import tempfile
import time
import traceback
from importlib import resources
from pathlib import Path
from typing import IO, Callable, Optional, TypeVar

from labkit.core import layout

from .kernels import drop_abandoned_tasks, kernel_name, kernel_options

log = logging.getLogger(__name__)
NOTEBOOKS = Path(str(resources.files("labkit") / "notebooks"))
REPORT_TIMEOUT_S = 3600  # seconds a cell of a remade report may run (labkit experiment's default)
T = TypeVar("T")


def execute(name: str, out: Path, parameters: dict, kernel: str, timeout: int,
            stream: Optional[IO[str]] = None) -> None:
    """Run notebooks/<name>.ipynb with papermill into ``out``, its kernel working in ``out``'s
    folder; with ``stream``, the kernel's output goes there as it comes."""
    import papermill as pm

    streams = {"stdout_file": stream, "stderr_file": stream} if stream is not None else {}
    drop_abandoned_tasks()  # what an interrupted cell left, not said after the one line
    pm.execute_notebook(str(NOTEBOOKS / f"{name}.ipynb"), str(out), parameters=parameters,
                        kernel_name=kernel, cwd=str(out.parent), execution_timeout=timeout,
                        progress_bar=False, **streams, **kernel_options())


def write_notebook_report(name: str, folder: Path, parameters: dict, kernel: str,
                          timeout: int) -> tuple[Path, Optional[Path], str]:
    """Execute notebooks/<name>.ipynb in ``folder``/report/ (its kernel runs there) and export
    it as one HTML file and a PDF, each replacing the previous one whole; (the HTML, the PDF or
    None, "pdf: PATH" or why there is no PDF). A PDF of a previous report is removed when no new
    one is made: it would show another report than the HTML beside it."""
    from .export import export_html, export_pdf

    rdir = folder / layout.REPORT_DIR
    rdir.mkdir(exist_ok=True)
    fd, scratch = tempfile.mkstemp(dir=rdir, prefix=f".{name}.", suffix=".ipynb")  # papermill: .ipynb
    os.close(fd)
    try:
        execute(name, Path(scratch), parameters, kernel, timeout)
        html = export_html(scratch, rdir / f"{name}.html", title=name)
        _keep_notebook(Path(scratch), rdir / f"{name}.ipynb")
    finally:
        Path(scratch).unlink(missing_ok=True)
    (rdir / "error.log").unlink(missing_ok=True)  # why an earlier try failed: no longer so
    pdf, why = export_pdf(html, rdir / f"{name}.pdf")
    old_pdf = rdir / f"{name}.pdf"
    if pdf is None and old_pdf.exists():
        old_pdf.unlink()
        why += f"; the previous {old_pdf.name} was removed (it showed the report replaced)"
    return html, pdf, f"pdf: {pdf}" if pdf else why


def _keep_notebook(scratch: Path, dest: Path) -> None:
    """The executed notebook, as ``dest``: papermill recorded the temp name as its output."""
    import nbformat

    from labkit.core.files import atomic_path

    nb = nbformat.read(scratch, as_version=nbformat.NO_CONVERT)
    nb.metadata.get("papermill", {})["output_path"] = str(dest)
    with atomic_path(str(dest)) as tmp:
        nbformat.write(nb, tmp)


def render_notebook(name: str, folder: Path, parameters: dict, kernel: str, timeout: int,
                    stream: IO[str], label: str = "report") -> Path:
    """Execute notebooks/<name>.ipynb into ``folder``/report/ (its kernel runs there) and export
    it as one HTML file and a PDF; return the HTML's path."""
    html, _, pdf_line = write_notebook_report(name, folder, parameters, kernel, timeout)
    stream.write(f"{label}: {html}\n{pdf_line}\n")
    return html


def report_or_why(make: Callable[[], T], folder: Path, stream: IO[str],
                  label: str = "REPORT") -> tuple[Optional[T], Optional[str]]:
    """Make a report; (its HTML, None), or (None, why) in one line when anything broke it (a
    notebook cell, the export): the results it reads are safe on disk, so the command says so
    and goes on. The traceback goes to report/error.log, not the terminal."""
    try:
        return make(), None
    except Exception as e:  # noqa: BLE001 - one line for any failure of the report
        ename, evalue = (getattr(e, "ename", None), getattr(e, "evalue", None))
        why = f"{ename or type(e).__name__}: {evalue if ename else e}".strip()
        rdir = folder / layout.REPORT_DIR
        try:
            rdir.mkdir(exist_ok=True)
            (rdir / "error.log").write_text(traceback.format_exc())
        except OSError:  # a full disk: the one line below still says what broke
            pass
        log.error("\n%s FAILED: %s (the results are kept; details: %s)", label, why,
                  rdir / "error.log")
        return None, why


def make_report(run: Path, kernel: str, timeout: int, stream: IO[str]) -> Path:
    """The report of a run folder (an experiment or a bench)."""
    # the kernel runs in run/report: ".." is the run folder, wherever it is moved
    return render_notebook("report", run, {"run_dir": ".."}, kernel, timeout, stream)


def make_sweep_report(root: Path, kernel: str, timeout: int, stream: IO[str]) -> Path:
    """The scaling report of a sweep folder."""
    return render_notebook("sweep", root, {"sweep_dir": ".."}, kernel, timeout, stream,
                           "sweep report")


# ---------------------------------------------------------------- labkit report RUN --html
def reportable(path: str | os.PathLike) -> Path:
    """The folder ``path`` names (resolved) when the report notebook can write it up: an
    experiment's run folder (its repeats, a reproduction) with at least one completed method,
    or a bench's with results. Else a one-line RunFolderError, before anything is written."""
    from labkit.core.run_folder import RunFolder, RunFolderError

    where = Path(path)
    if (where / layout.BENCH).is_file():
        from labkit.bench.bench_view import BenchError, load

        try:
            load(where)
        except BenchError as e:
            raise RunFolderError(f"{e}: nothing to write up") from None
    else:
        folder = RunFolder.experiment(where)  # the line for a sweep, a file, no config.json
        if not _completed(folder.path):
            raise RunFolderError(
                f"{str(where)!r} has no completed method ({', '.join(folder.methods)}: no result "
                f"file says completed): nothing to write up; `labkit experiment --continue "
                f"{where}` finishes an interrupted experiment")
    rdir = where / layout.REPORT_DIR
    if not os.access(rdir if rdir.is_dir() else where, os.W_OK):
        raise RunFolderError(f"cannot write into {str(rdir)!r} (permission denied): copy the "
                             f"run folder to a place you can write and give that")
    return where.resolve()


def _completed(run: Path) -> bool:
    """Whether any result file of the run (any method, any repeat) says completed."""
    from labkit.core.status import Status
    from labkit.report import load_run

    return any(d.status == Status.COMPLETED for docs in load_run(run).repeats.values() for d in docs)


def previous_report(run: Path) -> str:
    """'' for a run folder without a report; else a line saying which files of the report made
    at what time the new one replaces."""
    rdir = run / layout.REPORT_DIR
    files = [f for f in ("report.html", "report.pdf", "report.ipynb") if (rdir / f).is_file()]
    if not files:
        return ""
    made = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime((rdir / files[0]).stat().st_mtime))
    return f"replaced the report of {made} ({', '.join(files)}), made again from the same result files"


def remake_report(path: str | os.PathLike, stream: IO[str]) -> tuple[Optional[Path], list[str]]:
    """`labkit report RUN --html`: the report labkit experiment (or bench) writes, made again for
    the run folder ``path`` wherever it now lies: report.ipynb executed, report.html and, where
    Chromium is, report.pdf in RUN/report/, each replacing its previous version whole. (the
    HTML, the lines to print before its path), or (None, []) when the notebook or the export
    failed, said in one line (report_or_why) with the previous report left as it was."""
    run = reportable(path)
    replaced = previous_report(run)
    stream.write(f"report of {run}: executing notebooks/report.ipynb, then the HTML and the PDF\n")
    made, _ = report_or_why(lambda: write_notebook_report(
        "report", run, {"run_dir": ".."}, kernel_name(), REPORT_TIMEOUT_S), run, stream)
    if made is None:
        return None, []
    html, _, pdf_line = made
    return html, [line for line in (replaced, pdf_line) if line]
