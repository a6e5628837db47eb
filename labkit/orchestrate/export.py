"""Exporting an executed report notebook to one self-contained HTML file, a PDF and a PNG.

The PDF and the PNG come from a system headless Chromium.  nbconvert's own ``webpdf`` is not
used: it downloads a Chromium of its own at first use, which fails on machines that only reach
package registries.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

import nbformat
from nbconvert import HTMLExporter

from labkit.core.files import atomic_path

# the Makefile's system-deps looks for the same names (tests/test_export.py checks it)
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")
CHROMIUM_TIMEOUT_S = 120
INSTALL_HINT = ("install it with `make system-deps` (Debian: apt-get install chromium; Ubuntu: "
                "snap install chromium) or set LABKIT_CHROMIUM")

# Needed here: we run as root (no sandbox), with no GPU and no network (nothing in the
# background may phone home or wait for it), and with a fresh profile per run so two exports
# never share one, nor an old profile's state.
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync")


class ChromiumError(RuntimeError):
    """Chromium is missing, failed, timed out or wrote nothing."""


def export_html(nb_path: str | os.PathLike, html_path: str | os.PathLike,
                title: Optional[str] = None) -> Path:
    """Write the notebook as one HTML file: outputs only (no code, no prompts), images inline.
    ``title``: the page's title, when not the notebook file's name (a temp file's)."""
    exporter = HTMLExporter(
        template_name="offline",      # labkit/templates/offline: lab, minus CDN scripts
        extra_template_basedirs=[str(Path(__file__).parent / "templates")],
        exclude_input=True,           # a report shows results, not the code behind them
        exclude_input_prompt=True,
        exclude_output_prompt=True,   # "Out[3]:" means nothing once the code is hidden
        embed_images=True,            # markdown images too, not only outputs (which are inline)
    )
    # the notebook's folder, so that relative markdown images are found beside it
    nb_path = Path(nb_path)
    meta = {"name": title or nb_path.stem, "path": str(nb_path.parent)}
    body, _ = exporter.from_notebook_node(nbformat.read(nb_path, as_version=4),
                                          resources={"metadata": meta})
    html_path = Path(html_path)
    with atomic_path(str(html_path)) as tmp:
        Path(tmp).write_text(body, encoding="utf-8")
    return html_path


def find_chromium() -> Optional[str]:
    """LABKIT_CHROMIUM if set (it must exist), else the first Chromium on PATH that runs, else
    None. Ubuntu's chromium-browser without its snap is a stub that only says to install the
    snap: a name on PATH counts only when ``--version`` answers."""
    env = os.environ.get("LABKIT_CHROMIUM")
    if env:
        return shutil.which(env)  # a path or a name; None when it is not there
    for name in CHROMIUM_NAMES:
        found = shutil.which(name)
        if found and _answers(found):
            return found
    return None


def _answers(exe: str) -> bool:
    try:
        p = subprocess.run([exe, "--version"], stdin=subprocess.DEVNULL, capture_output=True,
                           text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return p.returncode == 0 and any(w in p.stdout for w in ("Chromium", "Chrome"))


def run_chromium(output_flag: str, suffix: str, html_path: Path, dest: str, extra: list[str]) -> None:
    """Have headless Chromium render ``html_path`` with ``output_flag``; copy the file to ``dest``.

    Chromium writes into a scratch folder (beside its throw-away profile) because it picks the
    image format from the file name, so it cannot write to atomic_path's ``.tmp`` name directly.
    """
    exe = find_chromium()
    if exe is None:
        raise ChromiumError(f"no Chromium found; {INSTALL_HINT}")
    with tempfile.TemporaryDirectory(prefix="labkit-chromium-", ignore_cleanup_errors=True) as scratch:
        out = Path(scratch, "out" + suffix)
        cmd = [exe, *CHROMIUM_FLAGS, f"--user-data-dir={Path(scratch, 'profile')}",
               f"{output_flag}={out}", *extra, html_path.resolve().as_uri()]
        # its own process group, so a timeout kills the renderer and GPU helpers too
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, start_new_session=True)
        except OSError as e:
            raise ChromiumError(f"cannot start {exe}: {e.strerror}") from None
        try:
            _, err = proc.communicate(timeout=CHROMIUM_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise ChromiumError(f"{exe} timed out after {CHROMIUM_TIMEOUT_S} s") from None
        # Chromium can exit 0 having written nothing, so the file is what counts
        if proc.returncode != 0 or not out.exists() or out.stat().st_size == 0:
            # its stderr is mostly harmless D-Bus noise; the last line is the likeliest cause
            last = (err.strip().splitlines() or ["no output"])[-1]
            raise ChromiumError(f"{exe} exited {proc.returncode} without writing {out.name}: {last}")
        # copy, not move: atomic_path made dest with the permissions a result file should have
        shutil.copyfile(out, dest)


def export_pdf(html_path: str | os.PathLike, pdf_path: str | os.PathLike) -> tuple[Optional[Path], str]:
    """Print the HTML to PDF: (pdf path, "") or, when Chromium is missing or fails, (None, why)."""
    pdf_path = Path(pdf_path)
    try:
        with atomic_path(str(pdf_path)) as tmp:
            run_chromium("--print-to-pdf", ".pdf", Path(html_path), tmp, ["--no-pdf-header-footer"])
    except ChromiumError as e:
        return None, f"PDF skipped: {e}"
    return pdf_path, ""

