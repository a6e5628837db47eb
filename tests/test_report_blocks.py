"""One report renderer (issue 84, item 3): each part of the report is a function returning blocks,
the notebook shows them and the text report prints the same blocks, and tables and figures are
numbered by their place (the built-in parts' captions, then those a part declares in its outline
entry, in the outline's order) and referred to by key. So a new table is one function and one
outline entry, which holds its caption; here one is added without touching labkit."""
from __future__ import annotations

import ast
import importlib
import json
import re

import pytest

from helpers import ROOT
from labkit import report
from labkit.core.methods import label
from labkit.report import captions
from labkit.report.blocks import Later, Markdown, Page, Table, TableCaption, plain, shown

# the module (labkit.report's own name ``outline`` is its function, the parts a run has)
outline = importlib.import_module("labkit.report.outline")
pytestmark = pytest.mark.unit


def guide_run(tmp_path):
    """Three result files with only the guide's keys (what the original scripts wrote)."""
    common = {"world_size": 4, "batch_size": 64, "start_time": "2025-12-12 10:00:00",
              "end_time": "2025-12-12 10:15:00"}
    for name, method, thr in (("results_baseline_ddp.json", "Baseline DDP (PyTorch)", 510.2),
                              ("results_all_reduce.json", "Manual All-Reduce", 459.18),
                              ("results_ps.json", "Parameter Server (PS)", 255.1)):
        epochs = [{"epoch": i, "train_loss": 0.5 / i, "train_accuracy": 85.0 + i, "train_time": 300.0,
                   "train_throughput": thr, "avg_batch_time": 0.125, "val_loss": 0.45 / i,
                   "val_accuracy": 87.0 + i} for i in (1, 2)]
        (tmp_path / name).write_text(json.dumps({
            "method": method, **common, "epochs": epochs, "all_losses": [0.9, 0.7, 0.5],
            "summary": {"avg_train_throughput": thr, "avg_train_time_per_epoch": 300.0,
                        "best_val_accuracy": 88.0}}))
    return report.load_run(tmp_path)


def epochs_blocks(page: Page) -> list:
    """The new part: a table of how many epochs each method ran, and a sentence that refers to
    it by key."""
    rows = [{"Method": label(m), "Epochs": len(d.epochs)} for m, d in page.res.ok.items()]
    said = f"Every method ran both epochs ({captions.ref('epochs_run')})."
    return [TableCaption("epochs_run"), Table(rows), Markdown(said, plain=(said, ""))]


EPOCHS_RUN = captions.Caption(captions.TABLE, "Epochs per method", "",
                              "per method: the epochs its result file holds.")


def add_part(monkeypatch, section, after: str) -> None:
    """``section`` in the outline after the part ``after``, as a user's one entry there."""
    sections = list(outline.SECTIONS)
    sections.insert([s.key for s in sections].index(after) + 1, section)
    monkeypatch.setattr(outline, "SECTIONS", tuple(sections))


@pytest.fixture
def new_table(monkeypatch):
    """The new table as a user adds it: its part, one outline entry after Results that declares
    its caption (numbered after the built-in parts' captions: the next number)."""
    add_part(monkeypatch, outline.Section("epochs", "Epochs run", lambda res, run: bool(res.ok),
                                          epochs_blocks, {"epochs_run": EPOCHS_RUN}), "results")


def notebook_of(res, run) -> list:
    """What report.ipynb displays for ``res``: its blocks, as the notebook shows them."""
    return shown(outline.page_blocks(Page(res, run)))


def test_a_new_table_is_one_function_and_one_outline_entry(tmp_path, new_table):
    res = guide_run(tmp_path)
    assert "epochs_run" not in captions.CAPTIONS  # captions.py untouched
    assert captions.ref("epochs_run") == "Table 14"  # after the thirteen tables before it
    assert "epochs_run" in outline.captions_shown(res, tmp_path)  # the appendix knows it is shown
    text = report.text_report(res)
    # the text report: its heading in the outline's place, its numbered table, the reference
    at = [text.index(f"\n{t}\n{'-' * len(t)}\n") for t in ("Results", "Epochs run", "Discussion")]
    assert at == sorted(at)
    part = text[at[1]:at[2]]
    assert "\nTable 14. Epochs per method\n" in part and "Every method ran both epochs (Table 14)." in part
    assert re.search(r"\nParameter Server +2 *\n", part), part
    assert "Contents: Summary; Results; Epochs run; Discussion;" in text
    # the notebook: the same part, in the same place, from the same blocks
    shown_ = notebook_of(res, tmp_path)
    assert all(isinstance(b, (report.Markdown, report.Html)) for b in shown_)
    said = [b.text for b in shown_]
    heads = [next(i for i, s in enumerate(said) if s.startswith(f'## <a id="{k}"></a>'))
             for k in ("results", "epochs", "discussion")]
    assert heads == sorted(heads)
    mine = said[heads[1]:heads[2]]
    assert mine[1].startswith("**Table 14. Epochs per method** per method: the epochs its result")
    assert "<th>Epochs</th>" in mine[2] and "<td>Parameter Server</td><td>2</td>" in mine[2]
    assert mine[3] == "Every method ran both epochs (Table 14)."
    assert "[Epochs run](#epochs)" in said[0]  # the contents link to it


def test_numbers_are_the_captions_order_and_references_follow(tmp_path, new_table, monkeypatch):
    """Moving a caption renumbers every table after it, and every reference by key with it:
    the summary's "(Table 1)", the headings, "Not in this run"'s GPU table."""
    res = guide_run(tmp_path)
    text = report.text_report(res)
    assert "Highest measured throughput (Table 1; no verdict" in text
    assert "\nTable 2. Communication time per training step" in text and "(Table 9: a run on GPUs)" in text
    first = {"epochs_run": EPOCHS_RUN, **captions.CAPTIONS}  # moved ahead of every built-in's
    monkeypatch.setattr(captions, "CAPTIONS", first)
    monkeypatch.setattr(captions, "declared", dict)
    text = report.text_report(res)
    assert "\nTable 1. Epochs per method\n" in text and "(Table 1)." in text
    assert "Highest measured throughput (Table 2; no verdict" in text
    assert "\nTable 2. Performance comparison" in text
    assert "\nTable 3. Communication time per training step" in text and "(Table 10: a run on GPUs)" in text
    shown_ = [b.text for b in notebook_of(res, tmp_path)]
    assert any(s.startswith("**Table 2. Performance comparison.** ") for s in shown_)
    assert captions.ref("loss_curves", "accuracy_curves") == "Figures 3-4"  # figures kept theirs


def test_the_parts_own_captions_are_numbered_in_the_outlines_order(tmp_path, new_table, monkeypatch):
    """A second part's table placed before the first in the outline takes the lower number; a
    caption key another part already has is refused, naming the part."""
    held = captions.Caption(captions.TABLE, "Steps per method", "", "per method: its steps.")
    add_part(monkeypatch, outline.Section("steps", "Steps run", lambda res, run: bool(res.ok),
                                          lambda page: [], {"steps_run": held}), "summary")
    assert (captions.ref("steps_run"), captions.ref("epochs_run")) == ("Table 14", "Table 15")
    add_part(monkeypatch, outline.Section("again", "Again", lambda res, run: True,
                                          lambda page: [], {"memory": held}), "summary")
    with pytest.raises(ValueError, match="part 'again' declares the caption 'memory'"):
        captions.ref("epochs_run")


def test_each_block_says_what_each_renderer_shows(tmp_path):
    """A table's caption and rows render both ways; what only the notebook shows (Later) is
    never made for the text report."""
    res = guide_run(tmp_path)

    def never():
        raise AssertionError("the text report made the notebook's part")

    blocks = [TableCaption("communication"), Table(report.communication_rows(res)), Later(never)]
    lines = plain(blocks)
    assert lines[0] == captions.heading("communication") and lines[1] == "" and lines[-1] == ""
    assert lines[2] == report.text_table(report.communication_rows(res))
    md, html = shown(blocks[:2])
    assert md.text == report.caption("communication") and md.text.startswith("**Table 2. ")
    assert html.text == report.html_table(report.communication_rows(res))
    # Jupyter shows a block as its own MIME type, with a short stand-in for plain text
    assert md._repr_mimebundle_() == {"text/markdown": md.text, "text/plain": "<Markdown block>"}


def test_no_number_is_typed_in_the_reports_text():
    """Every "Table N" or "Figure N" a reader sees is made from a key: no string in
    labkit/report types one (comments may still name tables by number; docstrings may not)."""
    typed = re.compile(r"\b(Tables?|Figures?) \d")
    found = []
    for path in sorted((ROOT / "labkit" / "report").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and typed.search(node.value):
                found.append(f"{path.name}:{node.lineno}: {typed.search(node.value).group(0)}")
    assert found == []
    nb = json.loads((ROOT / "notebooks" / "report.ipynb").read_text())
    assert not typed.search("".join("".join(c["source"]) for c in nb["cells"]))
