"""`labkit report RUN --html`: the report labkit experiment writes (report.ipynb executed,
report.html, report.pdf where Chromium is), made again with one command for a run folder that
has none, was moved, or was written up by an older labkit (issue 71, item 6). The folder is the
session's real experiment (conftest), copied elsewhere as a `--no-report` run leaves it; the
report notebook is executed once, by the module's fixture, and the tests after it reuse its
notebook instead of running the kernel again."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from helpers import EXPERIMENT_METHODS, labkit, load_json, snapshot_tree
from labkit import cli
from labkit.core.methods import SHORT

# conftest's session experiment: its worker; the first test here may be the one that waits for
# it to be built (conftest gives that 900 s)
pytestmark = [pytest.mark.xdist_group("experiment"), pytest.mark.timeout(900)]

NOT_MADE = "not made (--no-report)"


def no_report_copy(experiment, where: Path) -> Path:
    """The session's experiment copied to ``where`` as `--no-report` leaves a run folder: no
    report/, experiment.json saying so. The models (*.pt) are not copied: no report reads one."""
    run = shutil.copytree(experiment.run, where / experiment.run.name, symlinks=True,
                          ignore=shutil.ignore_patterns("*.pt"))
    shutil.rmtree(run / "report")
    status = load_json(run / "experiment.json")
    (run / "experiment.json").write_text(json.dumps({**status, "report": NOT_MADE}))
    return run


@pytest.fixture(scope="module")
def remade(experiment, tmp_path_factory):
    """(the moved run folder, its files' mtimes before, the finished `labkit report RUN --html`
    run from another folder): the one execution of the report notebook in this module."""
    assert experiment.returncode == 0, experiment.stderr[-3000:]
    base = tmp_path_factory.mktemp("remake")
    run = no_report_copy(experiment, base / "elsewhere")
    before = snapshot_tree(run)
    return run, before, labkit(["report", str(run), "--html"], cwd=base, timeout=600)


def temp_files(rep: Path) -> list[str]:
    return sorted(p.name for p in rep.iterdir() if p.name.startswith(".") or ".tmp" in p.name)


def test_a_moved_no_report_run_gets_its_report_from_one_command(experiment, remade):
    from labkit.orchestrate.export import find_chromium

    run, before, p = remade
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rep = run / "report"
    html_path = rep / "report.html"
    assert p.stdout.splitlines()[-1] == f"report: {html_path}", p.stdout[-2000:]
    # complete: the summary, Table 1 with every method, the appendix at its end
    html = html_path.read_text()
    assert '<h2 id="Summary">' in html and html.rstrip().endswith("</html>")
    table1 = html.split("Table 1. Performance comparison.", 1)[1].split("</table>", 1)[0]
    assert all(SHORT[m] in table1 for m in EXPERIMENT_METHODS), table1[-2000:]
    assert '<h2 id="Appendix-C.-Environment-and-configuration">' in html
    # read where it now lies, not where config.json and the record say it ran
    assert f"<code>{run}</code>" in html and str(experiment.run) not in html
    assert (rep / "report.ipynb").is_file() and (rep / "performance_report.txt").is_file()
    assert temp_files(rep) == [] and not (rep / "error.log").exists()
    if find_chromium() is not None:
        pdf = rep / "report.pdf"
        assert f"pdf: {pdf}" in p.stdout
        info = subprocess.run(["pdfinfo", str(pdf)], capture_output=True, text=True).stdout
        assert int(info.split("Pages:")[1].split()[0]) >= 1, info
    else:
        assert "PDF skipped: no Chromium found" in p.stdout and not (rep / "report.pdf").exists()
    # only report/ is written: the results and the record are read, not changed
    assert {k: v for k, v in snapshot_tree(run).items() if not k.startswith("report")} == before
    assert load_json(run / "experiment.json")["report"] == NOT_MADE


def test_a_remade_report_replaces_the_previous_one_whole_or_not_at_all(remade, tmp_path,
                                                                        monkeypatch, capsys):
    """A second remake replaces the report and says so (its PDF, with no Chromium now, is
    removed: it showed the old report); one whose notebook fails leaves the report as it was,
    and no temp file. The notebook is the fixture's, copied in (a kernel costs 10-20 CPU s)."""
    from labkit.orchestrate import render

    run = Path(shutil.copytree(remade[0], tmp_path / remade[0].name, symlinks=True))
    rep = run / "report"
    executed = remade[0] / "report" / "report.ipynb"
    monkeypatch.setattr(render, "execute", lambda name, out, *a, **k: shutil.copyfile(executed, out))
    monkeypatch.setenv("LABKIT_CHROMIUM", "/nonexistent/chromium")
    had_pdf = (rep / "report.pdf").exists()
    old = (rep / "report.html").stat().st_mtime_ns
    assert cli.main(["report", str(run), "--html"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == f"report: {rep / 'report.html'}"
    assert any(l.startswith("replaced the report of ") and "report.html" in l for l in out), out
    assert (rep / "report.html").stat().st_mtime_ns > old and not (rep / "report.pdf").exists()
    if had_pdf:
        assert any("the previous report.pdf was removed" in l for l in out), out
    assert temp_files(rep) == []

    def broken(name, out, *a, **k):
        Path(out).write_text('{"cells": [')  # half a notebook, then the kernel dies
        raise RuntimeError("the kernel died")
    monkeypatch.setattr(render, "execute", broken)
    kept = {f: (rep / f).read_bytes() for f in ("report.html", "report.ipynb")}
    assert cli.main(["report", str(run), "--html"]) == 1
    err = capsys.readouterr().err
    assert "REPORT FAILED: RuntimeError: the kernel died (the results are kept" in err, err
    assert {f: (rep / f).read_bytes() for f in kept} == kept and temp_files(rep) == []


@pytest.mark.parametrize("case", ["not a run folder", "no completed method", "a file",
                                  "two folders", "--out"])
def test_a_folder_it_cannot_write_up_is_one_line_and_nothing_is_written(case, experiment,
                                                                         tmp_path, capsys):
    folder = tmp_path / "folder"
    folder.mkdir()
    args, says = [str(folder)], None
    if case == "not a run folder":
        (folder / "notes.txt").write_text("a folder of my own\n")
        says = f"{str(folder)!r} is not a run folder (no config.json"
    elif case == "no completed method":  # an experiment killed before any method finished
        for name in ("config.json", "experiment.json", "environment.json"):
            shutil.copyfile(experiment.run / name, folder / name)
        says = f"{str(folder)!r} has no completed method (ddp, allreduce, ps: "
    elif case == "a file":
        args = [str(folder / "results_ddp.json")]
        (folder / "results_ddp.json").write_text("{}")
        says = f"{args[0]!r} is not a folder"
    elif case == "two folders":
        args, says = [str(folder), str(folder)], "--html takes one run folder"
    else:
        args, says = [str(folder), "--out", str(tmp_path / "out")], (
            "--html takes one run folder and writes into its report/ folder, as labkit "
            "experiment does; --out is for the text report")
    before = snapshot_tree(tmp_path)
    assert cli.main(["report", *args, "--html"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1, err
    assert err.startswith(f"labkit report: error: {says}"), err
    assert snapshot_tree(tmp_path) == before
