"""The notebooks as a person uses them: JupyterLab in a real (headless) Chromium, driven with
Playwright as JupyterLab's own Galata tests do.

One JupyterLab server (127.0.0.1, random port, token) serves a temporary copy of notebooks/ and a
runs/ folder holding copies of two run folders `labkit experiment` wrote (conftest's session
experiment, all three methods, and its failed experiment, ddp and a failed ps), under the names
the lab gave them (issue 61: not assembled by hand). Each test opens a notebook,
runs it from the Run menu and looks at what the page shows; a full-page screenshot of each
notebook lands in the test's tmp folder (its path is printed: pytest -s shows it).
"""
from __future__ import annotations

import json
import re
import shutil
import types

import pytest

from browser_lab import LabServer, kernel_idle, prompts, run_all, screenshot, wait_all_ran
from helpers import ROOT
from labkit.core.methods import METHOD_NAMES
from labkit.core.status import Status

# conftest's session experiment and failed experiment: on the worker that builds them, after
# them (on the other, lab_root would wait minutes for them)
pytestmark = pytest.mark.xdist_group("experiment")
playwright = pytest.importorskip("playwright", reason="pip install -e '.[test]' installs playwright")

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="session")
def browser_type_launch_args(browser_type_launch_args):
    """pytest-playwright's browser, on the system Chromium (Playwright cannot download its own)."""
    if CHROMIUM is None:
        pytest.skip("no Chromium found: install it with `make system-deps` (apt-get install chromium)")
    return {**browser_type_launch_args, "executable_path": CHROMIUM}


@pytest.fixture(scope="session")
def browser_context_args(browser_context_args):
    return {**browser_context_args, "viewport": {"width": 1280, "height": 900}}


def set_parameters(src, dst, **values) -> None:
    """A copy of a notebook whose parameters cell sets ``values`` (as a person edits it)."""
    nb = json.loads(src.read_text())
    cell = next(c for c in nb["cells"] if "parameters" in c["metadata"].get("tags", []))
    lines = "".join(cell["source"]).splitlines()
    for name, v in values.items():
        i = next(i for i, l in enumerate(lines) if re.match(rf"{name}\s*=", l))
        lines[i] = f"{name} = {v!r}"
    cell["source"] = "\n".join(lines)
    dst.write_text(json.dumps(nb, indent=1))


@pytest.fixture(scope="module")
def run_names(experiment, failed_experiment) -> types.SimpleNamespace:
    """The names of lab_root's two runs: ``full``, the session's experiment (ddp, allreduce
    and ps, complete), ``part``, its failed one (ddp, and ps failed); ``newest_first``, as the
    explorer lists them (the lab names a run folder by the time it started)."""
    full, part = experiment.run.name, failed_experiment.run.name
    return types.SimpleNamespace(full=full, part=part, newest_first=sorted([full, part], reverse=True))


@pytest.fixture(scope="module")
def lab_root(tmp_path_factory, experiment, failed_experiment, run_names):
    """notebooks/ and runs/ as in a checkout after two `labkit experiment`s: copies of the
    session's experiment and its failed one under the names the lab gave them (``run_names``),
    runs/latest at the newer."""
    root = tmp_path_factory.mktemp("lab")
    shutil.copytree(ROOT / "notebooks", root / "notebooks")
    no_models = shutil.ignore_patterns("*.pt")
    for e in (experiment, failed_experiment):
        shutil.copytree(e.run, root / "runs" / e.run.name, symlinks=True, ignore=no_models)
    (root / "runs" / "latest").symlink_to(run_names.newest_first[0])
    nb = root / "notebooks"
    set_parameters(nb / "run_method.ipynb", nb / "run_tiny.ipynb", dataset="digits",
                   model="resnet10_small", nproc=2, epochs=1, batch_size=8, max_steps_per_epoch=10,
                   max_val_steps=2, lr=0.01, timeout=120.0, out=str(root / "runs" / "single_ddp"))
    set_parameters(nb / "run_method.ipynb", nb / "run_bad.ipynb", epochs="three")
    # a copy outside the project: by default these would read the checkout's runs/
    set_parameters(nb / "explore.ipynb", nb / "explore.ipynb", runs_dir=str(root / "runs"))
    set_parameters(nb / "runs.ipynb", nb / "runs.ipynb", runs_dir=str(root / "runs"))
    set_parameters(nb / "report.ipynb", nb / "report.ipynb", run_dir=str(root / "runs" / run_names.full))
    return root


@pytest.fixture(scope="module")
def lab_server(lab_root, tmp_path_factory):
    server = LabServer(lab_root, tmp_path_factory.mktemp("lab_state"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def lab(lab_server):
    yield lab_server
    lab_server.shutdown_kernels()


def open_and_run(lab, page, name: str, timeout: float = 120) -> list[str]:
    lab.open(page, f"notebooks/{name}")
    # the project's kernel, found by the UI (not a "Select Kernel" dialog, not plain python3)
    assert page.locator(".jp-KernelName").first.inner_text() == "Python (labkit)"
    run_all(page)
    return wait_all_ran(page, timeout)


def label(text: str) -> str:
    """An option's label as ipywidgets renders it (spaces made non-breaking)."""
    return text.replace(" ", "\xa0")


def outputs_text(page) -> str:
    """What the cells printed and displayed (not their code), hidden or on screen."""
    return "\n".join(page.locator(".jp-OutputArea").all_text_contents())


def widget_problems(page) -> list[str]:
    text = outputs_text(page)
    return [s for s in ("Error displaying widget", "Loading widget", "Traceback") if s in text]


def test_explorer_draws_at_once_and_follows_the_widgets(lab, run_names, page, tmp_path):
    open_and_run(lab, page, "explore.ipynb")
    box = page.locator(".widget-vbox").first
    box.wait_for()
    page.wait_for_timeout(1000)  # give a slow widget a chance to show "Loading widget..."
    assert widget_problems(page) == []
    runs_pick, methods_pick = page.locator(".widget-select-multiple select").all()
    metric_pick = page.locator(".widget-dropdown select")
    assert runs_pick.locator("option").all_inner_texts() == run_names.newest_first
    assert metric_pick.locator("option:checked").inner_text() == label("training loss (per step)")

    # the default selection is drawn without a click (issue 15, item 3)
    plot = box.locator(".widget-output img")
    table = box.locator(".widget-output table")
    plot.wait_for(timeout=20_000)
    before = plot.get_attribute("src"), plot.screenshot(), table.text_content()
    assert run_names.full in before[2] and run_names.part in before[2]

    metric_pick.select_option(label=label("validation accuracy (%)"))
    page.wait_for_function("src => document.querySelector('.widget-output img').src !== src",
                           arg=before[0], timeout=20_000)
    after_metric = plot.get_attribute("src"), plot.screenshot(), table.text_content()
    assert after_metric[1] != before[1]

    runs_pick.select_option(label=[run_names.part])
    page.wait_for_function("src => document.querySelector('.widget-output img').src !== src",
                           arg=after_metric[0], timeout=20_000)
    after_runs = plot.screenshot(), table.text_content()
    assert after_runs[0] != after_metric[1]
    # the table follows the runs
    assert run_names.part in after_runs[1] and run_names.full not in after_runs[1]
    # a method the chosen run lacks (part has no all-reduce): an explanation, no lines
    methods_pick.select_option(label=[label(METHOD_NAMES["allreduce"])])
    page.wait_for_function("() => !document.querySelector('.widget-output table') || "
                           "!document.querySelector('.widget-output table').innerText.includes('Parameter')",
                           timeout=20_000)
    assert widget_problems(page) == []

    # below the widgets: the static overview (three figures and a table), outside the widget
    static = [img for img in page.locator(".jp-OutputArea-output img").all()
              if img.evaluate("i => !i.closest('.widget-output')")]
    assert len(static) == 3
    assert all(img.evaluate("i => i.naturalWidth") > 100 for img in static)
    screenshot(page, tmp_path, "explore")


NEWS = "@jupyterlab/apputils-extension:notification"


def test_no_jupyter_news_prompt(lab, page):
    """JupyterLab 4 asks every fresh set-up "Would you like to get notified about official
    Jupyter news?"; the project answers for its lab with settings overrides that make setup
    installs into the venv. The server runs the venv's jupyter with empty user settings, as
    `make lab` does: the page must not ask, and the schema it serves defaults to Never."""
    import urllib.request

    lab.open(page, "notebooks/run_method.ipynb")  # the app restored: the prompt would be up now
    page.wait_for_timeout(500)
    assert page.get_by_text("official Jupyter news").count() == 0, "run make setup (the overrides)"
    req = urllib.request.Request(f"{lab.url}/lab/api/settings/{NEWS}",
                                 headers={"Authorization": f"token {lab.token}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        served = json.load(r)
    assert served["schema"]["properties"]["fetchNews"]["default"] == "false"
    assert json.loads(served["raw"] or "{}") == {}  # from the overrides, not the user's settings


def test_make_setup_installs_the_lab_overrides(tmp_path):
    """The Makefile's set-up copies tools/jupyterlab/overrides.json into a venv's JupyterLab
    (here a fresh one, already installed: its stamp is newer than pyproject.toml), and a
    second make has nothing to do."""
    import os
    import subprocess

    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / ".installed-stamp").touch()
    target = venv / "share/jupyter/lab/settings/overrides.d/labkit.json"
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    make = ["make", "--no-print-directory", f"VENV={venv}", str(target)]
    first = subprocess.run(make, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert "cp tools/jupyterlab/overrides.json" in first.stdout
    assert json.loads(target.read_text())[NEWS] == {"fetchNews": "false"}
    again = subprocess.run(make, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert "up to date" in again.stdout and "cp " not in again.stdout
    dry = subprocess.run(["make", "--no-print-directory", "-n", "setup", f"VENV={venv}"], cwd=ROOT,
                         env=env, capture_output=True, text=True, check=True)
    assert "overrides.d/labkit.json" not in dry.stdout  # setup would not copy it again either


def test_run_method_from_the_ui_streams_progress(lab, page, tmp_path):
    lab.open(page, "notebooks/run_tiny.ipynb")
    run_all(page)
    launch = page.locator(".jp-CodeCell").filter(has_text="result = launch(")
    # the training's own output appears in the cell while the cell is still running
    live = launch.locator(".jp-OutputArea-output")
    page.wait_for_function(
        """() => { const c = [...document.querySelectorAll('.jp-CodeCell')]
                     .find(c => c.innerText.includes('result = launch('));
                   return c && c.querySelector('.jp-InputPrompt').innerText.includes('*')
                     && /step|it\\/s|\\d+%/.test(c.querySelector('.jp-OutputArea').innerText); }""",
        timeout=90_000, polling=100)
    assert not any("finished in" in t for t in live.all_text_contents())
    wait_all_ran(page, 180)
    out = outputs_text(page)
    assert "finished in" in out and "Traceback" not in out
    table = page.locator(".jp-OutputArea-output table")
    assert table.count() == 1 and "epoch" in table.text_content()
    loss = page.locator(".jp-Cell").last.locator(".jp-OutputArea-output img")
    assert loss.count() == 1 and loss.evaluate("i => i.naturalWidth") > 100
    screenshot(page, tmp_path, "run_method")


def test_a_bad_parameter_is_one_line_in_the_cell(lab, page, tmp_path):
    lab.open(page, "notebooks/run_bad.ipynb")
    run_all(page)
    err = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
    err.first.wait_for(timeout=60_000)
    kernel_idle(page)
    text = err.first.inner_text()
    lines = [l for l in text.splitlines() if l.strip()]
    assert len(lines) == 1 and "epochs='three'" in lines[0], text
    assert "Traceback" not in text and ".py" not in text
    assert err.count() == 1
    # Run All stops at the error: the launch cell never ran
    assert any(p.strip() == "[ ]:" for p in prompts(page))
    screenshot(page, tmp_path, "run_method_bad_parameter")


def test_report_renders_table_1_and_five_figures(lab, page, tmp_path):
    open_and_run(lab, page, "report.ipynb")
    text = outputs_text(page)
    assert "Traceback" not in text and "Error" not in text
    # the report's blocks are one cell's outputs: Table 1's caption, then the table itself
    t1 = page.locator(".jp-OutputArea-child", has_text="Table 1. Performance comparison").first
    table = t1.locator("xpath=following-sibling::div[contains(@class,'jp-OutputArea-child')][1]"
                       ).locator("table")
    assert all(m in table.text_content() for m in ("Baseline DDP", "All-Reduce", "Parameter Server"))
    figures = page.locator(".jp-OutputArea-output figure")
    # the five figures in order, each with its caption from the one captions table: the step
    # breakdown (Figure 5) with Table 1 in the summary, then Figures 1-4 in the results
    from labkit import report
    expected = [report.figure_caption(k) for k in (report.PLOTS[4], *report.PLOTS[:4])]
    assert [c.split(".")[0] for c in expected] == [f"Figure {i}" for i in (5, 1, 2, 3, 4)]
    assert figures.locator("figcaption").all_text_contents()[:5] == expected
    assert all(img.evaluate("i => i.complete && i.naturalWidth > 100")
               for img in figures.locator("img").all()[:5])
    screenshot(page, tmp_path, "report")


def test_runs_index_lists_every_run_and_opens_one_in_the_explorer(lab, lab_root, run_names, page,
                                                                 tmp_path):
    open_and_run(lab, page, "runs.ipynb")
    rows = page.locator(".jp-OutputArea tr.run")
    rows.first.wait_for(timeout=20_000)
    folders = [p for p in (lab_root / "runs").iterdir() if p.is_dir() and not p.is_symlink()]
    assert rows.count() == len(folders) >= 2  # one row per run folder; runs/latest is a link
    texts = rows.all_inner_texts()
    assert any(run_names.full in t and "complete" in t for t in texts)
    assert any(run_names.part in t and Status.FAILED.label in t for t in texts)
    pick = page.locator(".widget-select select").first
    pick.select_option(label=label(f"{run_names.part}  [{Status.FAILED.label}]"))
    explorer = page.locator(".widget-output .widget-vbox")
    explorer.wait_for(timeout=20_000)
    runs_pick = explorer.locator(".widget-select-multiple select").first
    assert runs_pick.locator("option").all_inner_texts() == [run_names.part]
    explorer.locator(".widget-output img").wait_for(timeout=20_000)  # its figure is drawn
    assert widget_problems(page) == []
    screenshot(page, tmp_path, "runs")


def test_the_runs_index_page_has_one_row_per_run_folder(lab_root, run_names, page, tmp_path):
    """runs/index.html as a person opens it from the file manager: the lab notebook's page,
    one row per run folder (runs/latest is a link, not a row), each naming its folder."""
    from labkit.runs.runs_dir import write_index

    runs = lab_root / "runs"
    index = write_index(runs)
    assert index == runs / "index.html"
    page.goto(index.as_uri())
    rows = page.locator("tr.run")
    folders = sorted(p.name for p in runs.iterdir() if p.is_dir() and not p.is_symlink())
    assert rows.count() == len(folders) >= 2
    texts = rows.all_inner_texts()
    assert all(any(name in t for t in texts) for name in folders), texts
    assert any(run_names.full in t and "complete" in t for t in texts)
    screenshot(page, tmp_path, "runs_index_page")
