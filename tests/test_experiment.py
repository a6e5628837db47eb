"""`labkit experiment`: a complete, self-describing run folder; a failed method is recorded
and the others are kept."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import nbformat
import pytest
from PIL import Image

from helpers import (EXPERIMENT_FLAGS, EXPERIMENT_METHODS, EXPERIMENT_REPEATS, HTML_ONLY, Pause, labkit,
                     leftovers, load_json, running_in, strict_json, strict_loads, wait_for)

TINY_FLAGS = EXPERIMENT_FLAGS
FILES = {"ddp": "results_baseline_ddp.json", "allreduce": "results_all_reduce.json",
         "ps": "results_ps.json"}
REPEATS = [f"repeat-{i}" for i in range(1, EXPERIMENT_REPEATS + 1)]

# the session's experiment (conftest): one worker builds it and runs every test reading it
on_the_experiment = pytest.mark.xdist_group("experiment")


@on_the_experiment
def test_experiment_makes_a_complete_run_folder(experiment):
    p, run = experiment, experiment.run
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    runs = [d for d in (p.cwd / "runs").iterdir() if d.is_dir() and not d.is_symlink()]
    assert len(runs) == 1 and runs[0].name.endswith("_tiny")
    assert (p.cwd / "runs" / "latest").resolve() == runs[0].resolve() == run
    assert f"report: {run / 'report' / 'report.html'}" in p.stdout
    # the terminal ends with Table 1 (with its CI columns) and the verdicts
    tail = p.stdout.rsplit("report: ", 1)[1]
    assert "Table 1. Performance comparison" in tail and "Speedup 95% CI" in tail
    assert "Manual All-Reduce: " in tail and "x DDP" in tail
    assert "without encryption" not in p.stdout + p.stderr  # no kernel start-up noise

    cfg = load_json(run / "config.json")
    assert cfg["train"]["epochs"] == 1 and cfg["train"]["max_steps_per_epoch"] == 3  # from YAML
    assert cfg["experiment"]["nproc"] == 2                                          # from flags
    env = load_json(run / "environment.json")
    for k in ("git", "python", "torch", "torchvision", "cuda", "cudnn", "nccl", "gpus", "cpu", "host", "seed"):
        assert k in env
    # the versions as the packages name their builds (+cu130, +cpu), torchvision's read from its
    # version.py by the experiment, which does not import it
    import torch
    import torchvision
    assert (env["torch"], env["torchvision"]) == (torch.__version__, torchvision.__version__)
    assert set(env["torchrun_commands"]) == {f"{r}/{m}" for r in REPEATS for m in EXPERIMENT_METHODS}
    assert "labkit.launch.agent" in env["torchrun_commands"]["repeat-1/ps"]  # torchrun's, ranks warm
    status = load_json(run / "experiment.json")
    assert {m: e["status"] for m, e in status["methods"].items()} == dict.fromkeys(EXPERIMENT_METHODS, "completed")
    # its start (to the first method), every method's notebook and the report, one after the
    # other inside its whole wall time; the terminal's account ends with that whole
    walls = [r["wall_time"] for e in status["methods"].values() for r in e.get("repeats") or [e]]
    assert len(walls) == len(REPEATS) * len(EXPERIMENT_METHODS)
    parts = status["start_s"] + sum(walls) + status["report_s"]
    assert 0 < status["start_s"] and parts <= status["wall_s"] + 0.05, (status, walls)
    assert f"the experiment in all: {status['wall_s']:.1f} s, of which training epochs " in p.stdout

    for r in REPEATS:
        for m in EXPERIMENT_METHODS:
            d = run / r / m
            res = load_json(d / FILES[m])
            assert res["status"] == "completed" and len(res["epochs"]) == 1
            # run_method.ipynb ran under papermill: the per-epoch table and the loss curve are in it
            nb = nbformat.read(d / "run_method.ipynb", as_version=4)
            outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
            assert any("<table>" in o.get("data", {}).get("text/html", "") for o in outputs)
            assert any("image/png" in o.get("data", {}) for o in outputs)
            assert (d / "logs" / "torchrun.log").exists()
            # the notebook's kernel was forked by the experiment's warm process, not started
            assert load_json(d / "launch.json")["launched_from"] == "warm process"
            assert list((d / "logs").glob("**/attempt_0/1/stderr.log"))


@on_the_experiment
def test_every_json_the_experiment_wrote_is_strict(experiment):
    """No NaN or Infinity tokens in any result file, record or notebook (issue 28)."""
    files = [*experiment.run.rglob("*.json"), *experiment.run.rglob("*.ipynb")]
    assert len(files) > 3 * len(EXPERIMENT_METHODS) * EXPERIMENT_REPEATS
    for f in files:
        strict_json(f)


@on_the_experiment
def test_the_record_is_complete_and_the_run_folder_works_from_anywhere(experiment, tmp_path):
    """The environment record is complete, and the run folder works from anywhere (issue 14)."""
    run = experiment.run
    env = load_json(run / "environment.json")
    assert (run / env["packages"]["file"]).read_text().count("==") > 50  # requirements.lock
    assert set(env["data"]) == set(EXPERIMENT_METHODS) and env["data"]["ddp"]["dataset"] == "digits"
    assert env["determinism"]["seed"] == 0 and env["determinism"]["backend"] == "gloo"
    assert "untracked" in env["git"] and (run / "code.diff").exists() == bool(env["git"]["diff_file"])
    assert load_json(run / "repeat-1" / "ddp" / FILES["ddp"])["determinism"]["torch_num_threads"] >= 1
    for name in ("config.json", "environment.json", "experiment.json"):
        assert str(run) not in (run / name).read_text(), name  # paths inside are relative
    status = load_json(run / "experiment.json")
    assert status["run_dir"] == "."
    assert [r["notebook"] for r in status["methods"]["ps"]["repeats"]] == [f"{r}/ps/run_method.ipynb" for r in REPEATS]
    assert status["report"] == "report/report.html"
    moved = shutil.copytree(run, tmp_path / "elsewhere" / "moved", symlinks=True)
    p = labkit(["report", str(moved)], cwd=tmp_path, env=HTML_ONLY)
    assert p.returncode == 0, p.stderr
    assert (moved / "report" / "performance_report.txt").stat().st_mtime > (run / "report" / "performance_report.txt").stat().st_mtime
    # the copy's report, from the copy's files alone, is the original's, but for where it lies
    # (labkit.runs.compare reads a run's <method>/ folders, not repeat-<i>/: the copy's
    # compare_runs verdict is test_reproduce's, on a copied single run)
    def report_text(folder):
        return [l for l in (folder / "report" / "performance_report.txt").read_text().splitlines()
                if str(folder) not in l]
    assert report_text(moved) == report_text(run) and len(report_text(run)) > 20


@on_the_experiment
def test_the_report_has_both_tables_every_figure_and_no_code(experiment):
    """The exported write-up: both tables, every figure inline, the verdicts, no code."""
    from labkit.core import breakdown
    from labkit import report

    run = experiment.run
    rep = run / "report"
    html = (rep / "report.html").read_text()
    for header in ("Avg throughput (img/s)", "Speedup vs DDP", "Param pull (ms)", "Total comm time (ms)",
                   "Throughput 95% CI", "Speedup 95% CI"):
        assert header in html, header
    assert "error bars: the 95% confidence interval" in html  # Figures 1-2 say what they draw
    res = report.load_run(run)
    # the verdicts (speed, then accuracy over the seeds) are the discussion's sentences, each
    # in its method's paragraph
    accuracy = [v.sentence.split(": ", 1) for v in report.accuracy_verdicts(res)]
    paragraphs = {l.split(": ", 1)[0]: l for l in report.discussion(res)}
    assert accuracy and all(html_text(s) in html_text(paragraphs[m]) for m, s in accuracy), accuracy
    assert all(html_text(l) in html_text(html) for l in paragraphs.values())
    # the guide's five, the per-rank waits and the bytes on the wire, and what repeats add:
    # every plot inline once
    plots = {p.stem for p in (rep / "plots").glob("*.png")}
    assert plots >= {"throughput_comparison", "training_time_comparison", "loss_curves",
                     "accuracy_curves", "communication_overhead", "sync_waits", "wire"}
    assert len(re.findall(r"<img[^>]*src=\"data:image/png;base64", html)) == len(plots)
    for name in plots:
        assert (rep / "plots" / f"{name}.png").stat().st_size > 0
    for code in ("report.write_report(", "display(HTML(", "import matplotlib"):  # no code cells
        assert code not in html, code
    assert not re.search(r"<(script|link)[^>]+(src|href)=\"https?:", html)  # opens offline
    txt = (rep / "performance_report.txt").read_text()
    assert "Communication time per training step" in txt
    discussion = txt.split("\nDiscussion\n", 1)[1]
    ps = next(l for l in discussion.splitlines() if l.startswith("- Parameter Server: "))
    assert "replicas identical after epoch 1." in ps  # checked every epoch
    # where the time goes, for every method, DDP included (labkit.core.breakdown)
    for m in EXPERIMENT_METHODS:
        b = breakdown.of_result(res.ok[m])
        assert b is not None and b.comm > 0, m
        # the parts (a mean over the trainers) add up to the step (rank 0's clock): within 5%
        # on the embedded default (docs/performance.md: 0.4%); here 2 timed steps of 4 ranks
        # (the first, warm-up, step left out: conftest's _experiment) on a busy 2-core machine,
        # where the ranks' windows open tens of milliseconds apart (10.1% seen once under
        # three test workers; with the first step timed, a PS server's clock saw 0.216 s of
        # steps whose parts were 0.387 s). A parameter server's rank 0 is the server: its clock
        # times other windows than its lone trainer's parts, and when the other worker's load
        # falls on the trainer's two steps they part (33% seen in two full suites, 2026-11-29,
        # the trainer's forward and backward at three times its compute-only time; the same
        # experiment alone or beside two busy loops: 1-8%)
        within = 0.45 if m == "ps" else 0.30
        assert b.total == pytest.approx(b.measured, rel=within), m  # 17% seen under the full suite
    ddp_row = report.communication_rows(res)[0]
    assert isinstance(ddp_row["Total comm time (ms)"], float), ddp_row
    assert "Time to target (s)" in txt and "Time to target (s)" in html
    assert re.search(r"Time to [\d.]+% validation accuracy", txt)
    assert "each rank bound to its share of them (--pin-cpus)" in txt  # the CPU default binds


def html_text(s: str) -> str:
    """Letters and digits only: a sentence as the HTML and the PDF's text both hold it
    (entities, hyphens and line breaks aside)."""
    import html

    return re.sub(r"[^0-9A-Za-z]", "", html.unescape(re.sub(r"<[^>]+>", "", s)))


def pdf_table_headers(layout: str, table: str, first_row: str) -> list[str]:
    """The header cells of the table captioned ``table`` ("Table 1.") whose first row starts
    with ``first_row``, from ``pdftotext -layout`` text. The header lies between the caption's
    last line (ending with a full stop) and the first line holding a number; a cell's words
    wrap onto several lines in one column, so the pieces are joined by the columns they overlap."""
    lines = layout.splitlines()
    caption = next(i for i, l in enumerate(lines) if l.strip().startswith(table))
    row = next(i for i in range(caption, len(lines)) if lines[i].strip().startswith(first_row))
    top = max(i for i in range(caption, row) if lines[i].rstrip().endswith(".")) + 1
    bottom = next((i for i in range(top, row) if re.search(r"\d\.\d", lines[i])), row)
    cells: list[list] = []  # [start, end, words]
    for line in lines[top:bottom]:
        for m in re.finditer(r"\S+(?: \S+)*", line):
            a, b = m.span()
            for c in cells:
                if a < c[1] and c[0] < b:
                    c[0], c[1], c[2] = min(a, c[0]), max(b, c[1]), c[2] + [m.group()]
                    break
            else:
                cells.append([a, b, [m.group()]])
    return [" ".join(c[2]) for c in sorted(cells)]


@on_the_experiment
def test_the_report_pdf_reads_table_1_and_every_verdict(experiment):
    """The PDF itself, as text (poppler's pdftotext): Table 1's headers as the HTML's table
    has them, and each verdict line of the discussion; a real PDF of several pages, not blank."""
    from labkit import report
    from labkit.orchestrate.export import find_chromium
    from screenshot import screenshot

    run = experiment.run
    rep = run / "report"
    if find_chromium() is None:
        pytest.skip("no Chromium: PDF and screenshot not checked (make system-deps installs it)")
    pdf = rep / "report.pdf"
    assert pdf.read_bytes().startswith(b"%PDF-")
    pages = subprocess.run(["pdfinfo", str(pdf)], capture_output=True, text=True).stdout
    assert int(re.search(r"Pages:\s+(\d+)", pages).group(1)) >= 2
    layout = subprocess.run(["pdftotext", "-layout", str(pdf), "-"], capture_output=True, text=True,
                            check=True).stdout
    html = (rep / "report.html").read_text()
    table1 = re.search(r"<table>.*?</table>", html.split("Table 1.", 1)[1], re.S).group()
    headers = re.findall(r"<th>(.*?)</th>", table1)
    assert "Speedup 95% CI" in headers and len(headers) >= 8, headers
    assert pdf_table_headers(layout, "Table 1.", "Baseline DDP") == headers
    flat = html_text(subprocess.run(["pdftotext", str(pdf), "-"], capture_output=True, text=True,
                                    check=True).stdout)
    lines = report.discussion(report.load_run(run))
    assert any("x DDP" in l for l in lines) and any("Accuracy" in l for l in lines)
    missing = [l for l in lines if html_text(l) not in flat]
    assert not missing, missing
    png = screenshot(rep / "report.html", experiment.cwd / f"shot-{os.getpid()}.png", width=1000, height=1400)
    with Image.open(png) as im:
        colours = im.convert("RGB").getcolors(maxcolors=1_000_000)
    assert colours is None or len(colours) > 50  # text, tables and plots, not a blank page


@on_the_experiment
def test_the_report_answers_on_page_one_within_eight_pages(experiment):
    """Issue 59: the summary first, its figures the tables' own; the parts the run has data
    for (its --repeats 2: Repeats and time to accuracy over seeds), the others named in one
    line; a table of contents; and the PDF's body, before the appendix, at most 8 pages, with
    the whole summary on page 1."""
    from labkit import report
    from labkit.orchestrate.export import find_chromium

    run = experiment.run
    rep = run / "report"
    res, env = report.load_run(run), report.load_env(run)
    keys = [k for k, _ in report.outline(res, run)]
    assert {"summary", "repeats", "seeds", "discussion"} <= set(keys)
    assert not {"variants", "bench"} & set(keys)
    html = (rep / "report.html").read_text()
    assert "Table 6. Repeats" in html and "Table 10. Time to accuracy over seeds" in html
    for k in keys:  # the table of contents links to every part, and every part has its anchor
        assert f'href="#{k}"' in html and f'id="{k}"' in html, k
    missing = report.not_in_run(res, run)
    assert "repeats (" not in missing and "variants (" in missing and "bench (" in missing
    assert html_text(missing) in html_text(html)
    # every figure of the summary is one the text report's tables and discussion state
    summary = report.summary_lines(res, env)
    txt = (rep / "performance_report.txt").read_text()
    rest = "\n".join(l for l in txt.splitlines() if l.lstrip("- ") not in summary)
    said = set(re.findall(r"\d[\d,]*\.\d+x?|\d+%", " ".join(summary)))
    assert said and said <= set(re.findall(r"\d[\d,]*\.\d+x?|\d+%", rest)), said
    assert txt.index("\nSummary\n") < txt.index("Table 1.") < txt.index("\nResults\n")
    if find_chromium() is None:
        pytest.skip("no Chromium: no PDF to count pages of (make system-deps installs it)")
    text = subprocess.run(["pdftotext", str(rep / "report.pdf"), "-"], capture_output=True,
                          text=True, check=True).stdout
    pages = text.split("\f")
    appendix = next(i for i, p in enumerate(pages) if "Appendix A. How to read" in p)
    print(f"report.pdf: {len(pages) - 1} pages, {appendix} before the appendix")
    assert 1 <= appendix <= 8, appendix
    first = html_text(pages[0])
    assert all(html_text(line) in first for line in summary), [l for l in summary if html_text(l) not in first]


@on_the_experiment
def test_the_runs_index_lists_the_experiment(experiment, tmp_path):
    """`labkit runs` reads the real run folder: one row, complete, with its tag; and
    runs/index.html, written at the experiment's end, has its row."""
    runs = shutil.copytree(experiment.cwd / "runs", tmp_path / "runs", symlinks=True)
    index = (experiment.cwd / "runs" / "index.html").read_text()
    assert index.count('<tr class="run">') == 1 and experiment.run.name in index
    p = labkit(["runs", str(runs), "--json"], cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    rows = strict_loads(p.stdout)
    assert [(r["kind"], r["status_label"], r["tag"]) for r in rows] == [("repeats", "complete", "tiny")]


def test_a_failed_method_is_recorded_and_the_others_kept(failed_experiment):
    """conftest's failed experiment: ps's rank 1 fails at its second step, and no Chromium:
    the report is still written, as HTML, and says why no PDF."""
    p, run = failed_experiment, failed_experiment.run
    assert p.returncode == 1
    status = load_json(run / "experiment.json")
    assert status["status"] == "failed"
    assert status["methods"]["ddp"]["status"] == "completed"
    ps = status["methods"]["ps"]
    assert ps["status"] == "failed" and "LaunchError" in ps["error"]
    # rank 1 either exits on its own or is stopped by torchrun first, or torchrun's summary lost
    # its exit code and only its error file tells (labkit.launch.failures._blame; seen once in a
    # full suite, 2026-11-26): each names it, with its error
    assert re.search(r"rank 1 (exited with code 1|failed first \(torchrun then stopped it|raised an "
                     r"exception \(known from its error file only\))", ps["error"]), ps["error"]
    assert "injected fault" in ps["error"]
    assert load_json(run / "ddp" / "results_baseline_ddp.json")["status"] == "completed"
    assert load_json(run / "ps" / "results_ps.json")["status"] == "failed"
    assert "ps" in p.stdout and "failed" in p.stdout
    assert "failed" in (run / "report" / "report.html").read_text()
    assert "PDF skipped" in p.stdout and not (run / "report" / "report.pdf").exists()


def test_bad_yaml_and_unknown_parameters(tmp_path, monkeypatch, capsys):
    from labkit.cli import main

    monkeypatch.chdir(tmp_path)
    bad = tmp_path / "bad.yaml"
    bad.write_text("epochs: [1\n")
    unk = tmp_path / "unk.yaml"
    unk.write_text("epochs: 1\nlearning_rate: 0.1\n")
    for argv, needle in ((["-f", str(bad)], "is not valid YAML"),
                         (["-f", str(unk)], "unknown parameter(s): learning_rate"),
                         (["--methods", "ddp,sgd"], "unknown method(s) sgd")):
        assert main(["experiment", *argv]) == 2
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "runs").exists()


def test_ctrl_c_on_the_experiment_stops_everything(tmp_path):
    import signal

    # Ctrl-C while ddp trains: both ranks held before epoch 1's second step (the pause hook),
    # so training has begun and is far from its end; Ctrl-C, then both go on together (one
    # released before the other would wait for it in a collective)
    pause = Pause(tmp_path, "ddp", rank="*", epoch=1, step=1)
    proc = subprocess.Popen([sys.executable, "-m", "labkit", "experiment", *TINY_FLAGS, "--epochs", "50",
                             "--methods", "ddp", "--runs-dir", "runs"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **pause.env})
    try:
        pause.wait(240, proc, count=2)
    finally:
        proc.send_signal(signal.SIGINT)
        pause.release()
    out, _ = proc.communicate(timeout=90)
    assert proc.returncode == 130, out[-2000:]
    run = (tmp_path / "runs" / "latest").resolve()
    result = run / "ddp" / "results_baseline_ddp.json"
    assert load_json(run / "experiment.json")["status"] == "interrupted"
    assert not leftovers(str(run))
    # torchrun runs in the method's folder with relative paths (--out .), so its command line
    # does not name the run: look for anything still running in the run folder
    wait_for(lambda: not running_in(run), 20, "no process left working in the run folder")
    assert load_json(result)["status"] == "interrupted"
