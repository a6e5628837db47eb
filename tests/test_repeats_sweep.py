"""Issue 13, items 4 and 5: `labkit experiment --repeats N` (rotated order, one subfolder per
repeat, aggregated report) and `labkit sweep` (one experiment per grid point, the scaling
chart and efficiency table with CIs); bad input for both."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as sps

from helpers import (EXPERIMENT_METHODS, EXPERIMENT_REPEATS, HTML_ONLY, labkit, load_json, strict_json,
                     strict_loads, tiny_flags)

# the real sweep's experiments
TINY = tiny_flags(dataset=None, max_steps_per_epoch=4, max_val_steps=1, timeout=60)
FILES = {"ddp": "results_baseline_ddp.json", "allreduce": "results_all_reduce.json",
         "ps": "results_ps.json"}
RAN = {m: FILES[m] for m in EXPERIMENT_METHODS}  # the session experiment's, each repeated
NAMES = {"ddp": "Baseline DDP (PyTorch)", "allreduce": "Manual All-Reduce", "ps": "Parameter Server (PS)"}


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("argv, needle", [
    (["experiment", "--repeats", "0"], "--repeats must be a whole number, 1 or more (got 0)"),
    (["sweep", "nproc=2,x"], "sweep nproc=2,x: a value does not parse as int"),
    (["sweep", "lr=0.1,fast"], "sweep lr=0.1,fast: a value does not parse as float"),
    (["sweep", "learning_rate=0.1,0.2"], "cannot sweep over unknown parameter 'learning_rate'"),
    (["sweep", "method=ddp,ps"], "cannot sweep over unknown parameter 'method'"),  # --methods is
    (["sweep", "--repeats", "0", "nproc=2,3"], "--repeats must be"),
    (["sweep", "nproc=1,2", "--methods", "ps"], "sweep point nproc-1:"),  # PS needs 2 processes
    (["sweep"], "nothing to sweep"),
])
def test_bad_input_is_one_line_exit_2_nothing_created(argv, needle, tmp_path, monkeypatch, capsys):
    from labkit.cli import main

    monkeypatch.chdir(tmp_path)
    assert main([*argv, "--runs-dir", "runs"]) == 2
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if l.strip()]
    assert len(lines) == 1 and needle in lines[0] and lines[0].startswith(f"labkit {argv[0]}: error: "), err
    assert not (tmp_path / "runs").exists() and not list(tmp_path.iterdir())


def test_repeats_in_the_parameters_file_are_checked_too(tmp_path, monkeypatch, capsys):
    from labkit.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.yaml").write_text("repeats: 0\n")
    assert main(["experiment", "-f", "p.yaml"]) == 2
    assert "--repeats must be" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_rotated_plan_and_seeds():
    from labkit.orchestrate.experiment import repeat_plan

    plan = repeat_plan(["ddp", "allreduce", "ps"], 4, seed=7)
    assert [o for _, _, o in plan] == [["ddp", "allreduce", "ps"], ["allreduce", "ps", "ddp"],
                                      ["ps", "ddp", "allreduce"], ["ddp", "allreduce", "ps"]]
    assert [(i, s) for i, s, _ in plan] == [(1, 7), (2, 8), (3, 9), (4, 10)]


def test_grid_parsing_types_values():
    from labkit.orchestrate.sweep import parse_grid, point_name

    g = parse_grid(["nproc=2,4", "batch-size=16,32", "amp=off,bf16", "max_steps_per_epoch=none,5"])
    assert g == {"nproc": [2, 4], "batch_size": [16, 32], "amp": ["off", "bf16"],
                 "max_steps_per_epoch": [None, 5]}
    assert parse_grid({"nproc": [2, 3]}) == {"nproc": [2, 3]}  # the -f file's `sweep:` mapping
    assert point_name({"nproc": 2, "batch_size": 16}) == "nproc-2_batch_size-16"


# ------------------------------------------------------------------ repeats, for real
@pytest.mark.xdist_group("experiment")  # conftest's session experiment: its worker
def test_repeats_run_rotated_and_the_report_aggregates_them(experiment):
    p = experiment
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    run = p.run
    status = load_json(run / "experiment.json")
    order = [list(EXPERIMENT_METHODS[i:] + EXPERIMENT_METHODS[:i]) for i in range(EXPERIMENT_REPEATS)]
    assert status["order"] == order == [["ddp", "allreduce", "ps"], ["allreduce", "ps", "ddp"]]
    assert status["repeats"] == 2 and status["seeds"] == [0, 1]
    # the order the notebooks really ran in, from the console
    ran = re.findall(r"=== (\w+), repeat (\d) of 2", p.stdout)
    assert ran == [(m, str(i + 1)) for i, ms in enumerate(order) for m in ms]
    for m, f in RAN.items():
        assert not (run / m).exists()  # with repeats, every method lives under repeat-<i>/
        reps = status["methods"][m]["repeats"]
        assert [(r["repeat"], r["seed"], r["status"]) for r in reps] == [(1, 0, "completed"), (2, 1, "completed")]
        for i in (1, 2):
            doc = load_json(run / f"repeat-{i}" / m / f)
            assert doc["status"] == "completed" and doc["config"]["seed"] == i - 1
    assert set(load_json(run / "environment.json")["torchrun_commands"]) == {
        f"repeat-{i}/{m}" for i in (1, 2) for m in RAN}

    from labkit import report
    from labkit.core import stats

    res = report.load_run(run)
    assert {m: len(v) for m, v in res.repeats.items()} == dict.fromkeys(RAN, 2)
    assert res.docs["ddp"] is res.repeats["ddp"][0]  # single-run tables show repeat 1
    thr = stats.throughput(res.repeats["allreduce"])
    assert thr.n == 2 and thr.basis == "repeats"
    per = [stats.throughput(d).value for d in res.repeats["allreduce"]]
    assert thr.value == pytest.approx((per[0] * per[1]) ** 0.5)  # geometric mean (log scale)
    html = (run / "report" / "report.html").read_text()
    assert "Table 6. Repeats" in html and "repeat 2: allreduce, ps, ddp" in html
    assert f"{per[0]:,.2f}" in html and f"{per[1]:,.2f}" in html and f"{thr.value:,.2f}" in html
    txt = (run / "report" / "performance_report.txt").read_text()
    assert "repeat 2 ran: allreduce, ps, ddp" in txt
    # two seeds per method: time to accuracy over seeds, with a verdict on speed and accuracy
    # (issue 37; its scoring is tests/test_seeds.py's), and its two figures
    for text in (html, txt):
        assert "Table 10. Time to accuracy over seeds" in text
        assert "Manual All-Reduce vs Baseline DDP: " in text and "accuracy" in text.split(
            "Manual All-Reduce vs Baseline DDP: ", 1)[1].split("\n", 1)[0]
    assert "Figure 12. Validation accuracy against wall time" in html
    assert "Figure 13. Validation accuracy against the MB a trainer sent" in html
    assert {p.name for p in (run / "report" / "plots").iterdir()} >= {"accuracy_vs_time.png",
                                                                   "accuracy_vs_bytes.png"}


def test_loss_and_accuracy_figures_draw_every_repeat():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from labkit.core.results import Result
    from labkit.report import RunResults, plot_accuracy, plot_losses

    docs = [Result.from_dict(_doc("ddp", 2, [[0.5] * 9], seed=s)) for s in (0, 1, 2)]
    res = RunResults(docs={"ddp": docs[0]}, repeats={"ddp": docs})
    fig, ax = plt.subplots()
    plot_losses(res.ok, ax, res.repeats)
    faint = [l for l in ax.lines if (l.get_alpha() or 1) < 1]
    assert len(ax.lines) == 3 and len(faint) == 2
    fig, ax = plt.subplots()
    plot_accuracy(res, ax)
    assert len([l for l in ax.lines if (l.get_alpha() or 1) < 1]) == 4  # train and val, 2 repeats
    plt.close("all")


# ------------------------------------------------------------------ sweep: constructed folders
def _doc(m: str, world: int, epochs_steps: list[list[float]], seed: int = 0, batch: int = 8) -> dict:
    trainers = world - 1 if m == "ps" else world
    return {"method": NAMES[m], "method_key": m, "world_size": world, "batch_size": batch,
            "trainers": trainers, "status": "completed", "config": {"seed": seed},
            "world": {"device": "cpu"}, "all_losses": [2.0, 1.5, 1.2],
            "epochs": [{"epoch": i + 1, "train_loss": 1.0, "train_accuracy": 50.0, "val_accuracy": 60.0,
                        "train_time": sum(st), "train_throughput": batch * trainers * len(st) / sum(st),
                        "step_times": st} for i, st in enumerate(epochs_steps)]}


def _sweep_folder(root: Path, per_point: dict[int, dict[str, list[dict]]]) -> Path:
    root.mkdir(parents=True)
    points = []
    for n, methods in per_point.items():
        name = f"nproc-{n}"
        reps = len(next(iter(methods.values())))
        for m, docs in methods.items():
            for i, d in enumerate(docs, 1):
                d_dir = root / name / (m if reps == 1 else f"repeat-{i}/{m}")
                d_dir.mkdir(parents=True)
                (d_dir / FILES[m]).write_text(json.dumps(d))
        (root / name / "environment.json").write_text(json.dumps({"cpu_count": 2}))
        points.append({"name": name, "params": {"nproc": n}, "dir": name, "status": "completed"})
    (root / "sweep.json").write_text(json.dumps({"grid": {"nproc": list(per_point)}, "points": points,
                                                 "methods": ["ddp", "allreduce"], "repeats": 1}))
    return root


def test_scaling_efficiency_ci_over_repeats_matches_an_independent_computation(tmp_path):
    from labkit.report import sweep as rs

    # 3 repeats per point, constant steps within a run: each repeat's throughput is exact
    step2 = {"ddp": [0.50, 0.52, 0.49], "allreduce": [0.45, 0.47, 0.46]}
    step4 = {"ddp": [0.70, 0.75, 0.69], "allreduce": [0.60, 0.66, 0.61]}
    pts = {n: {m: [_doc(m, n, [[s] * 12, [s] * 12], seed=i) for i, s in enumerate(steps[m])]
               for m in steps} for n, steps in ((2, step2), (4, step4))}
    sw = rs.load_sweep(_sweep_folder(tmp_path / "sw", pts))
    rows = {(r["Method"], r["Processes"]): r for r in rs.scaling_rows(sw)}
    for m, short in (("ddp", "Baseline DDP"), ("allreduce", "Manual All-Reduce")):
        t2 = 8 * 2 / np.asarray(step2[m])
        t4 = 8 * 4 / np.asarray(step4[m])
        logr = np.log(t4 / t2)  # repeat i of each point paired, as stats.speedup pairs them
        h = sps.t.ppf(0.975, 2) * logr.std(ddof=1) / math.sqrt(3)
        lo, hi = (math.exp(logr.mean() - h) / 2, math.exp(logr.mean() + h) / 2)
        r = rows[(short, 4)]
        assert r["Efficiency"] == f"{math.exp(logr.mean()) / 2:.2f}"
        assert r["Efficiency 95% CI"] == f"{lo:.2f}-{hi:.2f}"
        assert r["Ideal (img/s)"] == f"{t2.mean() * 2:,.1f}" and r["Throughput (img/s)"] == f"{t4.mean():,.1f}"
        assert r["CI over"] == "repeats" and rows[(short, 2)]["Efficiency"] == "1.00"


def test_sweep_chart_and_table_from_constructed_runs(tmp_path):
    from labkit.cli import main
    from labkit.report import sweep as rs

    rng = np.random.default_rng(0)

    def steps(mean):  # 3 epochs of 30 noisy steps: a CI over the epochs
        return [list(rng.normal(mean, 0.03 * mean, 30)) for _ in range(3)]

    pts = {2: {"ddp": [_doc("ddp", 2, steps(0.5))], "allreduce": [_doc("allreduce", 2, steps(0.45))]},
           3: {"ddp": [_doc("ddp", 3, steps(0.9))], "allreduce": [_doc("allreduce", 3, steps(0.8))]}}
    root = _sweep_folder(tmp_path / "sw", pts)
    assert main(["report", str(root)]) == 0
    png, txt = root / "report" / "scaling.png", (root / "report" / "scaling.txt").read_text()
    assert png.stat().st_size > 10_000
    sw = rs.load_sweep(root)
    rows = rs.scaling_rows(sw)
    assert [(r["Method"], r["Processes"]) for r in rows] == [
        ("Baseline DDP", 2), ("Baseline DDP", 3), ("Manual All-Reduce", 2), ("Manual All-Reduce", 3)]
    r = rows[1]
    lo, hi = map(float, r["Efficiency 95% CI"].split("-"))
    assert lo <= float(r["Efficiency"]) <= hi and hi - lo < 0.05 and r["CI over"] == "epochs"
    assert rows[0]["Efficiency"] == "1.00" and rows[0]["Efficiency 95% CI"] == "-"  # the reference
    assert 0.5 < float(r["Efficiency"]) < 0.65  # 3/2 the work at 0.9/0.5 the step time: 0.56
    assert "Efficiency 95% CI" in txt and "2 CPU cores" in txt
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots()
    rs.plot_scaling(sw, ax)
    labels = ax.get_legend_handles_labels()[1]
    assert sorted(labels) == ["Baseline DDP", "Manual All-Reduce", "ideal linear, Baseline DDP",
                              "ideal linear, Manual All-Reduce"]
    ideal = [l for l in ax.lines if l.get_linestyle() == "--"][0]
    t0 = rs.stats.throughput(sw.points[0].res.repeats["ddp"]).value
    assert list(ideal.get_xdata()) == [2, 3] and ideal.get_ydata()[1] == pytest.approx(t0 * 1.5)
    plt.close("all")
    # two methods at the same throughput at 3 processes: their efficiency labels must not
    # cover each other (a CPU sweep of 2026-11-23 printed 0.45 over 1.15)
    same = {2: {"ddp": [_doc("ddp", 2, steps(0.5))], "allreduce": [_doc("allreduce", 2, steps(0.5))]},
            3: {"ddp": [_doc("ddp", 3, steps(0.9))], "allreduce": [_doc("allreduce", 3, steps(0.9))]}}
    fig, ax = plt.subplots()
    rs.plot_scaling(rs.load_sweep(_sweep_folder(tmp_path / "same", same)), ax)
    fig.canvas.draw()
    boxes = [a.get_window_extent() for a in ax.texts]
    assert len(boxes) == 2 and not boxes[0].overlaps(boxes[1]), boxes
    plt.close("all")


# ------------------------------------------------------------------ sweep, for real
def test_a_small_real_sweep_renders_its_report(tmp_path):
    p = labkit(["sweep", "nproc=1,2", "--methods", "ddp", "--no-report", *TINY, "--runs-dir", "runs"],
               cwd=tmp_path, env=HTML_ONLY)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    root = (tmp_path / "runs" / "latest").resolve()
    assert root.name.endswith("_sweep")
    doc = strict_json(root / "sweep.json")  # no NaN or Infinity: JSON, strictly
    assert [(x["name"], x["status"]) for x in doc["points"]] == [("nproc-1", "completed"), ("nproc-2", "completed")]
    for n in (1, 2):  # each point a normal experiment folder, the guide's layout
        assert load_json(root / f"nproc-{n}" / "ddp" / FILES["ddp"])["world_size"] == n
        assert load_json(root / f"nproc-{n}" / "config.json")["experiment"]["nproc"] == n
        assert not (root / f"nproc-{n}" / "report").exists()  # --no-report: results only
    html = (root / "report" / "sweep.html").read_text()
    assert "Table 7. Scaling efficiency" in html and "Figure 10." in html
    assert len(re.findall(r"<img[^>]*src=\"data:image/png;base64", html)) == 1
    assert "ideal" in html and "CPU cores" in html
    assert (root / "report" / "scaling.png").stat().st_size > 10_000
    assert "import matplotlib" not in html and "rs.load_sweep" not in html  # no code cells
    assert "PDF skipped" in p.stdout and f"sweep report: {root / 'report' / 'sweep.html'}" in p.stdout
    # the lab notebook lists the sweep as one row, and its page was written at the sweep's end
    rows = strict_loads(labkit(["runs", "runs", "--json"], cwd=tmp_path).stdout)
    assert [(r["kind"], r["status_label"]) for r in rows] == [("sweep", "complete")]
    assert (tmp_path / "runs" / "index.html").read_text().count('<tr class="run">') == 1
