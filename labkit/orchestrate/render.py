"""papermill runs labkit's notebooks; the report notebooks are then exported as one HTML file
and a PDF (labkit.orchestrate.export).

The notebooks ship as package data (labkit/notebooks links to the repository's notebooks/),
so an installed labkit runs experiments from any folder.
"""
from __future__ import annotations

import logging
import traceback
from importlib import resources
from pathlib import Path
from typing import IO, Callable, Optional

from labkit.core import layout

from .kernels import kernel_options

log = logging.getLogger(__name__)
NOTEBOOKS = Path(str(resources.files("labkit") / "notebooks"))


def execute(name: str, out: Path, parameters: dict, kernel: str, timeout: int,
            stream: Optional[IO[str]] = None) -> None:
    """Run notebooks/<name>.ipynb with papermill into ``out``, its kernel working in ``out``'s
    folder; with ``stream``, the kernel's output goes there as it comes."""
    import papermill as pm

    streams = {"stdout_file": stream, "stderr_file": stream} if stream is not None else {}
    pm.execute_notebook(str(NOTEBOOKS / f"{name}.ipynb"), str(out), parameters=parameters,
                        kernel_name=kernel, cwd=str(out.parent), execution_timeout=timeout,
                        progress_bar=False, **streams, **kernel_options())


def render_notebook(name: str, folder: Path, parameters: dict, kernel: str, timeout: int,
                    stream: IO[str], label: str = "report") -> Path:
    """Execute notebooks/<name>.ipynb into ``folder``/report/ (its kernel runs there) and export
    it as one HTML file and a PDF; return the HTML's path."""
    from .export import export_html, export_pdf

    rdir = folder / layout.REPORT_DIR
    rdir.mkdir(exist_ok=True)
    nb_out = rdir / f"{name}.ipynb"
    execute(name, nb_out, parameters, kernel, timeout)
    html = export_html(nb_out, rdir / f"{name}.html")
    pdf, msg = export_pdf(html, rdir / f"{name}.pdf")
    stream.write(f"{label}: {html}\n" + (f"pdf: {pdf}\n" if pdf else f"{msg}\n"))
    return html


def report_or_why(make: Callable[[], Path], folder: Path, stream: IO[str],
                  label: str = "REPORT") -> tuple[Optional[Path], Optional[str]]:
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
