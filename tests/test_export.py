"""Exporting an executed report notebook: HTML without code, a multi-page PDF, a real screenshot."""
from __future__ import annotations

import re
import shutil
import subprocess

import nbformat
import pytest
from nbclient import NotebookClient
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

# its module-scoped fixture is built once: the whole module on one xdist worker
pytestmark = pytest.mark.xdist_group("export")

from helpers import ROOT
from labkit.orchestrate import export
from labkit.orchestrate.export import export_html, export_pdf, find_chromium
from screenshot import screenshot

# Appears only in code cells, so finding it in the HTML means code leaked into the report.
CODE_MARKER = "labkit_code_marker_7f3a"

def test_a_chromium_stub_is_not_a_chromium(tmp_path, monkeypatch):
    """Ubuntu's chromium-browser without the snap only says to install the snap: labkit and the
    Makefile pass over it (HTML only) and take a Chromium that answers --version."""
    from labkit.orchestrate.export import CHROMIUM_NAMES

    stub = tmp_path / "chromium-browser"
    stub.write_text("#!/bin/sh\necho \"Command '$0' requires the chromium snap to be installed.\"\n"
                    "exit 1\n")
    stub.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("LABKIT_CHROMIUM", raising=False)
    assert find_chromium() is None
    real = tmp_path / "google-chrome"
    real.write_text("#!/bin/sh\necho 'Google Chrome 150.0'\n")
    real.chmod(0o755)
    assert find_chromium() == str(real)
    make = (ROOT / "Makefile").read_text()
    assert re.search(r"for b in ([a-z -]+); do", make).group(1).split() == list(CHROMIUM_NAMES)


needs_chromium = pytest.mark.skipif(
    find_chromium() is None,
    reason="no Chromium found: install it with `make system-deps` (apt-get install chromium)")

FIGURE_CELL = f"""\
import matplotlib.pyplot as plt  # {CODE_MARKER}
fig, ax = plt.subplots(figsize=(7, 4))
ax.plot(range(10), [i * i for i in range(10)], linewidth=3)
ax.set_title("figure {{n}}")
plt.show()
"""


@pytest.fixture(scope="module")
def report_nb(tmp_path_factory):
    """A small executed report: a heading, an HTML table, and enough figures for 2+ PDF pages."""
    cells = [
        new_markdown_cell("# Export test report\n\nA paragraph under the heading."),
        new_code_cell(f"from IPython.display import HTML, display  # {CODE_MARKER}\n"
                      "display(HTML('<table><tr><th>method</th><th>throughput</th></tr>'\n"
                      "             '<tr><td>ddp</td><td>123.4</td></tr></table>'))"),
    ]
    for n in range(4):
        cells.append(new_markdown_cell(f"## Section {n}\n\n" + "Some words about the results. " * 20))
        cells.append(new_code_cell(FIGURE_CELL.replace("{n}", str(n))))
    nb = new_notebook(cells=cells)
    NotebookClient(nb, kernel_name="python3", timeout=120).execute()
    path = tmp_path_factory.mktemp("export") / "report.ipynb"
    nbformat.write(nb, path)
    return path


@pytest.fixture(scope="module")
def report_html(report_nb):
    return export_html(report_nb, report_nb.with_suffix(".html"))


def count_pdf_pages(path) -> int:
    if shutil.which("pdfinfo"):
        out = subprocess.run(["pdfinfo", str(path)], capture_output=True, text=True, check=True).stdout
        return int(re.search(r"^Pages:\s+(\d+)", out, re.M).group(1))
    # without poppler: count page objects ("/Type /Page" but not "/Type /Pages")
    return len(re.findall(rb"/Type\s*/Page(?!s)", path.read_bytes()))


def test_html_has_outputs_and_no_code(report_html):
    text = report_html.read_text(encoding="utf-8")
    assert "<td>ddp</td><td>123.4</td>" in text
    assert "data:image/png;base64," in text
    assert "Export test report" in text
    assert CODE_MARKER not in text, "code cell input leaked into the HTML"
    assert "plt.subplots" not in text
    assert not list(report_html.parent.glob(".report.html.*.tmp")), "temp file left behind"


@needs_chromium
def test_pdf_is_multi_page(report_html, tmp_path):
    pdf, msg = export_pdf(report_html, tmp_path / "report.pdf")
    assert pdf == tmp_path / "report.pdf", msg
    assert pdf.read_bytes().startswith(b"%PDF-")
    assert count_pdf_pages(pdf) >= 2
    assert [p.name for p in tmp_path.iterdir()] == ["report.pdf"], "temp file left behind"


@needs_chromium
@pytest.mark.skipif(shutil.which("pdftotext") is None, reason="pdftotext (poppler-utils) reads the PDF")
def test_a_wide_table_keeps_every_column_in_the_pdf(tmp_path):
    """Table 1 has ten columns: on screen the lab template lets a wide table scroll sideways,
    which a printed page cannot, so its last columns were cut off the PDF. Printed, tables are
    set smaller and wrap: every column's header is on the page."""
    from nbformat.v4 import new_output

    heads = [f"column{k:02d} heading words" for k in range(1, 13)]
    table = ("<table><thead><tr>" + "".join(f"<th>{h}</th>" for h in heads) + "</tr></thead><tbody><tr>"
             + "".join(f"<td>{1234.5678 * k:.4f} (0.91-1.12)</td>" for k in range(12)) + "</tr></tbody></table>")
    cell = new_code_cell("display(HTML(table))")
    cell.outputs = [new_output("display_data", data={"text/html": table})]
    nb_path = tmp_path / "wide.ipynb"
    nbformat.write(new_notebook(cells=[cell]), nb_path)
    pdf, msg = export_pdf(export_html(nb_path, tmp_path / "wide.html"), tmp_path / "wide.pdf")
    assert pdf is not None, msg
    text = " ".join(subprocess.run(["pdftotext", str(pdf), "-"], capture_output=True, text=True,
                                   check=True).stdout.split())
    missing = [h.split()[0] for h in heads if h.split()[0] not in text]
    assert missing == [], f"cut off the printed page: {missing}"


@needs_chromium
def test_screenshot_is_not_blank(report_html, tmp_path):
    from PIL import Image, ImageChops

    png = screenshot(report_html, tmp_path / "report.png", width=800, height=1000)
    with Image.open(png) as im:
        assert im.size == (800, 1000)
        rgb = im.convert("RGB")
        background = Image.new("RGB", rgb.size, rgb.getpixel((0, 0)))
        same = ImageChops.difference(rgb, background).convert("L").histogram()[0]
    share = 1 - same / (rgb.width * rgb.height)
    # text, table and the first figure's line and axes; a blank or error page is ~0
    assert share > 0.02, f"only {share:.1%} of the screenshot differs from the background"


def test_pdf_without_chromium(report_html, tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_CHROMIUM", str(tmp_path / "no-such-chromium"))
    monkeypatch.setenv("PATH", "")
    assert find_chromium() is None
    pdf, msg = export_pdf(report_html, tmp_path / "report.pdf")
    assert pdf is None
    assert "no Chromium found" in msg and "apt-get install chromium" in msg
    assert "LABKIT_CHROMIUM" in msg
    assert report_html.exists()
    assert list(tmp_path.iterdir()) == [], "a failed export must leave no file"


def test_screenshot_without_chromium_raises_clearly(report_html, tmp_path, monkeypatch):
    monkeypatch.setattr(export, "find_chromium", lambda: None)
    with pytest.raises(export.ChromiumError, match="apt-get install chromium"):
        screenshot(report_html, tmp_path / "report.png")
    assert list(tmp_path.iterdir()) == []


def fake_chromium(tmp_path, body: str) -> str:
    exe = tmp_path / "fake-chromium"
    exe.write_text("#!/bin/sh\n" + body + "\n")
    exe.chmod(0o755)
    return str(exe)


def test_pdf_when_chromium_writes_nothing(report_html, tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_CHROMIUM", fake_chromium(tmp_path, "echo 'it broke' >&2; exit 0"))
    pdf, msg = export_pdf(report_html, tmp_path / "report.pdf")
    assert pdf is None
    assert msg.startswith("PDF skipped:") and "it broke" in msg
    assert not (tmp_path / "report.pdf").exists()


def test_pdf_when_chromium_hangs(report_html, tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_CHROMIUM", fake_chromium(tmp_path, "sleep 60"))
    monkeypatch.setattr(export, "CHROMIUM_TIMEOUT_S", 1)
    pdf, msg = export_pdf(report_html, tmp_path / "report.pdf")
    assert pdf is None and "timed out after 1 s" in msg
    assert not (tmp_path / "report.pdf").exists()
