"""The link as a sweep axis (issue 57, item 4): `labkit sweep link=100mbit,1gbit,unshaped
--emulate-nodes 2`. Its values are checked in one line each before anything exists; the
report draws throughput and time to accuracy against the link rate (unshaped at the right
end, labelled so) and names the crossovers, the rate below which a method beats DDP. The
report's tests read sweep folders built here by hand, so every crossover they expect follows
from the step times and accuracies written; the last test runs the smallest real link sweep."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from helpers import labkit, load_json, needs_namespaces_mark, tiny_flags
from labkit.core.errors import ConfigError

MBIT = 10 ** 6
GOAL = 80.0
FILES = {"ddp": "results_baseline_ddp.json", "powersgd": "results_powersgd.json",
         "localsgd": "results_localsgd.json"}
NAMES = {"ddp": "Baseline DDP (PyTorch)", "powersgd": "PowerSGD", "localsgd": "Local SGD"}


# ------------------------------------------------------------------ parsing the grid
@pytest.mark.unit
def test_link_values_parse_as_links_and_emulate_nodes_as_a_count():
    from labkit.orchestrate.sweep import parse_grid, point_name, sweepable

    assert parse_grid(["link=100mbit, 1GBIT,unshaped"]) == {"link": ["100mbit", "1gbit", "unshaped"]}
    assert parse_grid({"link": ["10mbit", "100mbit"], "emulate_nodes": "2,3"}) == {  # -f's sweep:
        "link": ["10mbit", "100mbit"], "emulate_nodes": [2, 3]}
    assert point_name({"link": "100mbit:5ms"}) == "link-100mbit-5ms"
    assert {"nproc", "link", "emulate_nodes"} <= set(sweepable())


@pytest.mark.unit
@pytest.mark.parametrize("spec, says", [
    ("link=100mbit,fast", "sweep link=100mbit,fast: link rate 'fast' is no rate"),
    ("link=0mbit,1gbit", "sweep link=0mbit,1gbit: link rate must be above 0"),
    ("link=100mbps", "link rate '100mbps' is no rate"),
    ("link=1gbit,1000mbit", "sweep link=1gbit,1000mbit repeats a value"),  # one link, two spellings
    ("link=100mbit:soon", "'soon' is no delay"),
    ("emulate_nodes=2,two", "sweep emulate_nodes=2,two: a value does not parse as int"),
])
def test_a_bad_link_value_is_one_line_naming_it(spec, says):
    from labkit.orchestrate.sweep import parse_grid

    with pytest.raises(ConfigError, match=says) as e:
        parse_grid([spec])
    assert "\n" not in str(e.value)


@pytest.mark.unit
@pytest.mark.parametrize("argv, says", [
    (["link=100mbit,1gbit"], "sweep link=100mbit,1gbit shapes the links of an emulated cluster: "
                             "give --emulate-nodes N too"),
    (["link=100mbit,nope", "--emulate-nodes", "2"], "link rate 'nope' is no rate"),
    (["emulate_nodes=0,2", "link=100mbit"], "sweep point emulate_nodes-0_link-100mbit: --link "
                                            "100mbit shapes the links"),
], ids=["no-nodes", "bad-rate", "zero-nodes"])
def test_bad_link_sweeps_exit_2_in_one_line_and_create_nothing(argv, says, tmp_path, monkeypatch,
                                                               capsys):
    from labkit.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["sweep", *argv, "--methods", "ddp", "--runs-dir", "runs"]) == 2
    lines = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    assert len(lines) == 1 and says in lines[0], lines
    assert not list(tmp_path.iterdir())


# ------------------------------------------------------------------ a link sweep built by hand
def _doc(m: str, rate_bit: int, step_s: float, accs: list[float], seed: int, jitter: float) -> dict:
    """3 epochs of 20 steps of ``step_s`` x ``jitter`` (epoch k a further 1% slower), 2 ranks of
    batch 8 on 2 nodes at ``rate_bit``; validation accuracy ``accs[k]`` after epoch k."""
    epochs = []
    for k, acc in enumerate(accs):
        st = [step_s * jitter * (1 + 0.01 * k)] * 20
        epochs.append({"epoch": k + 1, "steps": 20, "train_loss": 1.0, "train_accuracy": acc,
                       "val_accuracy": acc, "train_time": sum(st), "val_time": 0.0,
                       "train_throughput": 16 * 20 / sum(st), "step_times": st})
    return {"method": NAMES[m], "method_key": m, "world_size": 2, "batch_size": 8, "trainers": 2,
            "status": "completed", "config": {"seed": seed}, "world": {"device": "cpu"},
            "epochs": epochs, "link": {"nodes": 2, "link": "x", "rate_bit": rate_bit,
                                       "goodput_mbit": [{"node": "node0", "up": 9.5, "down": 9.4}]}}


# step time (s) of each method at each link (bit/s; 0: unshaped), and its accuracy per epoch:
# PowerSGD halves DDP's step at 10 and 100 Mbit/s, ties it at 1 Gbit/s and loses unshaped, and
# needs one epoch more for 80%; local SGD's step is shorter than DDP's everywhere
STEPS = {"ddp": {10 * MBIT: 4.0, 100 * MBIT: 0.6, 1000 * MBIT: 0.2, 0: 0.15},
         "powersgd": {10 * MBIT: 2.0, 100 * MBIT: 0.3, 1000 * MBIT: 0.2, 0: 0.25},
         "localsgd": {10 * MBIT: 0.5, 100 * MBIT: 0.1, 1000 * MBIT: 0.1, 0: 0.1}}
ACCS = {"ddp": [70, 85, 90], "powersgd": [60, 75, 85], "localsgd": [70, 85, 90]}
# each seed's speed, differing between methods, so the ratio of two has a spread over seeds
JITTER = {"ddp": (1.00, 1.03, 0.98), "powersgd": (1.02, 0.99, 1.01), "localsgd": (0.99, 1.01, 1.0)}
TEXT = {10 * MBIT: "10mbit", 100 * MBIT: "100mbit", 1000 * MBIT: "1gbit", 0: "unshaped"}


def link_sweep(root: Path, seeds: int = 3, methods=("ddp", "powersgd", "localsgd")) -> Path:
    points = []
    for rate, text in TEXT.items():
        name = f"link-{text}"
        for m in methods:
            for i in range(seeds):
                d = root / name / (f"repeat-{i + 1}" if seeds > 1 else "") / m
                d.mkdir(parents=True)
                (d / FILES[m]).write_text(json.dumps(
                    _doc(m, rate, STEPS[m][rate], ACCS[m], i, JITTER[m][i])))
        (root / name / "config.json").write_text(json.dumps({"experiment": {"target_accuracy": GOAL}}))
        points.append({"name": name, "params": {"link": text}, "dir": name, "status": "completed"})
    (root / "sweep.json").write_text(json.dumps({"grid": {"link": list(TEXT.values())},
                                                 "points": points, "methods": list(methods),
                                                 "repeats": seeds}))
    return root


@pytest.mark.unit
def test_unshaped_sits_right_of_the_fastest_rate():
    from labkit.report.linkaxis import UNSHAPED_GAP, x_positions

    assert x_positions([0, 100 * MBIT, 1000 * MBIT]) == {100 * MBIT: 100.0, 1000 * MBIT: 1000.0,
                                                          0: 1000.0 * UNSHAPED_GAP}
    assert x_positions([500_000, 0]) == {500_000: 0.5, 0: 0.5 * UNSHAPED_GAP}
    assert x_positions([0]) == {0: 1.0}  # nothing shaped: unshaped alone


@pytest.mark.unit
@pytest.mark.parametrize("labels, low, high, says", [
    ("F F N S", 100, 1000, "beats DDP below 1000 Mbit/s: the crossover lies between 100 Mbit/s "
                           "and 1000 Mbit/s"),
    ("F F F N", 1000, 0, "between 1000 Mbit/s and unshaped"),
    ("N F S S", 100, 1000, "not faster at 10 Mbit/s below it"),       # not monotonic: said
    ("F F b S", 100, 1000, "at 1000 Mbit/s not judged: b-text"),      # not judged is not faster
    ("F F F F", None, None, "no crossover in the swept range: beats DDP at every rate"),
    ("S F S F", None, None, "no crossover in the swept range: beats DDP even at unshaped"),
    ("N N N N", None, None, "no crossover in the swept range: within noise at every rate"),
    ("S N S S", None, None, "no crossover in the swept range: it beats DDP at no rate"),
    ("b b b b", None, None, "not judged at any rate"),
])
def test_the_crossover_lies_between_the_last_win_and_the_next_rate_up(labels, low, high, says):
    from labkit.report.linkaxis import Judged, crossover

    word = {"F": "faster", "S": "slower", "N": "within noise", "b": "not judged"}
    rates = [10 * MBIT, 100 * MBIT, 1000 * MBIT, 0]
    judged = [Judged(r, word[w], f"{w}-text") for r, w in zip(rates, labels.split())]
    c = crossover("PowerSGD", "throughput", judged[::-1])  # any order: sorted by rate
    assert (c.low, c.high) == ((low * MBIT if low else None), (high * MBIT if high else
                                                               (0 if low else None)))
    assert c.line.startswith("PowerSGD vs DDP, throughput: ") and says in c.line, c.line
    if low:  # the two rates it lies between, each with its figure and what it says
        assert f"at {low} Mbit/s faster: F-text" in c.line


@pytest.mark.unit
def test_a_constructed_link_sweep_names_its_crossovers(tmp_path):
    """Over 3 seeds: PowerSGD is twice as fast as DDP per step at 10 and 100 Mbit/s, as fast at
    1 Gbit/s, slower unshaped; it needs 3 epochs for 80% where DDP needs 2. So on throughput and
    on time to 80% it beats DDP below 1 Gbit/s (at 1 Gbit/s: throughput within noise, time 1.5x
    DDP's, slower); local SGD beats DDP at every rate on both."""
    from labkit.report import linkaxis as la
    from labkit.report import sweep as rs

    sw = rs.load_sweep(link_sweep(tmp_path / "sw"))
    assert rs.studied(sw) == [] and la.is_link_sweep(sw)
    got = {(c.method, c.quantity): c for c in la.crossovers(sw)}
    assert set(got) == {(m, q) for m in ("PowerSGD", "Local SGD")
                        for q in ("throughput", "time to 80.00% accuracy")}
    for q in ("throughput", "time to 80.00% accuracy"):
        c = got[("PowerSGD", q)]
        assert (c.low, c.high) == (100 * MBIT, 1000 * MBIT), c.line
        assert "the crossover lies between 100 Mbit/s and 1000 Mbit/s" in c.line
        assert got[("Local SGD", q)].low is None
        assert "no crossover in the swept range: beats DDP at every rate" in got[("Local SGD", q)].line
    # the ratios, computed here: throughput over repeats paired (the geometric mean of each
    # seed's ratio), time to 80% a ratio of the mean times (DDP: 2 epochs, PowerSGD: 3)
    jd, jp = np.asarray(JITTER["ddp"]), np.asarray(JITTER["powersgd"])
    speed = lambda d, p: math.exp(np.log(d * jd / (p * jp)).mean())
    time = lambda d, p: (p * jp * (1 + 1.01 + 1.02)).mean() / (d * jd * (1 + 1.01)).mean()
    line = got[("PowerSGD", "throughput")].line
    assert f"at 100 Mbit/s faster: {speed(0.6, 0.3):.2f}x DDP's throughput (95% CI " in line
    assert f"at 1000 Mbit/s within noise: {speed(0.2, 0.2):.2f}x DDP's throughput (95% CI " in line
    line = got[("PowerSGD", "time to 80.00% accuracy")].line
    assert f"at 100 Mbit/s faster: {time(0.6, 0.3):.2f}x DDP's time (95% CI " in line
    assert f"at 1000 Mbit/s slower: {time(0.2, 0.2):.2f}x DDP's time (95% CI " in line
    rows = {(r["Method"], r["Link"]): r for r in la.rows(sw)}
    assert len(rows) == 12 and rows[("PowerSGD", "unshaped")]["Seeds"] == 3
    assert rows[("Baseline DDP", "10 Mbit/s")]["Goodput (Mbit/s, least)"] == "9.4"


@pytest.mark.unit
def test_the_figure_puts_unshaped_last_and_shades_each_crossover(tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from labkit.report import linkaxis as la
    from labkit.report import sweep as rs

    sw = rs.load_sweep(link_sweep(tmp_path / "sw"))
    fig, axes = plt.subplots(1, 2)
    la.plot_link(sw, axes)
    fig.canvas.draw()
    for ax in axes:
        assert ax.get_xscale() == "log"
        assert [t.get_text() for t in ax.get_xticklabels()] == ["10", "100", "1000", "unshaped"]
        assert list(ax.get_xticks()) == [10, 100, 1000, 1000 * la.UNSHAPED_GAP]
        spans = [p for p in ax.patches if "crossover" in (p.get_label() or "")]
        assert len(spans) == 1  # PowerSGD's, between 100 and 1000 Mbit/s
        p = spans[0]
        xs = p.get_patch_transform().transform(p.get_path().vertices)[:, 0]  # data x
        assert (min(xs), max(xs)) == (100, 1000)
    ddp = axes[0].containers[0].lines[0]  # DDP's throughput: 2 ranks x 8 / its step, per link
    aside = np.asarray(ddp.get_xdata()) / [10, 100, 1000, 4000]  # a little left of each rate
    assert np.allclose(aside, aside[0]) and 0.9 < aside[0] < 1.0, aside
    assert ddp.get_ydata()[1] == pytest.approx(16 / 0.6, rel=0.03)
    plt.close(fig)


@pytest.mark.unit
def test_labkit_report_of_a_link_sweep_writes_the_figure_and_the_crossovers(tmp_path, capsys):
    from labkit.cli import main

    root = link_sweep(tmp_path / "sw")
    assert main(["report", str(root)]) == 0
    out = capsys.readouterr().out
    assert (root / "report" / "link.png").stat().st_size > 10_000
    assert not (root / "report" / "study.png").exists()  # the link is no method's parameter
    text = (root / "report" / "crossovers.txt").read_text()
    assert "PowerSGD vs DDP, throughput: beats DDP below 1000 Mbit/s" in text
    assert text in out and f"plot: {root / 'report' / 'link.png'}" in out


@pytest.mark.unit
def test_one_seed_per_point_judges_throughput_but_not_time(tmp_path):
    """One seed: throughput has its interval within the run (its 3 epochs); time to the target
    has none over seeds, and the line says so instead of calling a crossover."""
    from labkit.report import linkaxis as la
    from labkit.report import sweep as rs

    sw = rs.load_sweep(link_sweep(tmp_path / "one", seeds=1, methods=("ddp", "powersgd")))
    lines = la.crossover_lines(sw)
    assert lines[0].startswith("PowerSGD vs DDP, throughput: beats DDP below 1000 Mbit/s")
    assert "not judged at any rate" in lines[1] and "one seed" in lines[1], lines
    only = rs.load_sweep(link_sweep(tmp_path / "noddp", seeds=1, methods=("powersgd",)))
    assert la.crossover_lines(only) == ["No DDP in this sweep: no crossover against it (add ddp to "
                                        "--methods)."]


@pytest.mark.unit
def test_a_sweep_over_emulated_nodes_is_a_scaling_study(tmp_path):
    """emulate_nodes=1,2 with --nproc 1: 1 and 2 processes, one series per method (not one per
    node count), and no study of a method's parameter."""
    from labkit.report import sweep as rs

    root, points = tmp_path / "sw", []
    for n in (1, 2):
        d = root / f"emulate_nodes-{n}" / "ddp"
        d.mkdir(parents=True)
        doc = {**_doc("ddp", 100 * MBIT, 0.5 * n, ACCS["ddp"], 0, 1.0), "world_size": n, "trainers": n}
        (d / FILES["ddp"]).write_text(json.dumps(doc))
        points.append({"name": f"emulate_nodes-{n}", "params": {"emulate_nodes": n},
                       "dir": f"emulate_nodes-{n}", "status": "completed"})
    (root / "sweep.json").write_text(json.dumps({"grid": {"emulate_nodes": [1, 2]}, "points": points,
                                                 "methods": ["ddp"], "repeats": 1}))
    sw = rs.load_sweep(root)
    assert [(k, [n for n, _ in pts]) for k, pts in rs.series(sw).items()] == [(("ddp", ""), [1, 2])]
    assert rs.studied(sw) == []
    eff = [r["Efficiency"] for r in rs.scaling_rows(sw)]
    assert eff == ["1.00", "0.50"]  # twice the work in twice the step time, on twice the ranks


@pytest.mark.unit
def test_one_run_beside_other_work_is_not_judged():
    """labkit's load rule (stats.compare_speed): one run of each, other work took 40% of the CPU
    while the method ran: twice DDP's throughput, yet no verdict, and no crossover from it."""
    from labkit.core.results import Result
    from labkit.report.linkaxis import judge_throughput

    ddp = Result.from_dict(_doc("ddp", 100 * MBIT, 0.6, ACCS["ddp"], 0, 1.0))
    fast = Result.from_dict(_doc("powersgd", 100 * MBIT, 0.3, ACCS["powersgd"], 0, 1.0))
    assert judge_throughput([fast], [ddp], 100 * MBIT).label == "faster"
    for e in fast.epochs:
        e.machine_load = {"background": 0.4, "steal": 0.0}
    j = judge_throughput([fast], [ddp], 100 * MBIT)
    assert j.label == "not judged" and j.text.startswith("2.00x DDP's throughput (busy machine: "
                                                         "other work took the CPU 40% while it ran")


# ------------------------------------------------------------------ for real


@needs_namespaces_mark()
@pytest.mark.xdist_group("cluster")  # tests/test_cluster.py's: one cluster at a time
@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_real_link_sweep_records_each_link_and_names_both_rates(tmp_path):
    """The smallest real link sweep: 2 rates, DDP and PowerSGD, 2 nodes of 1 rank, 3 epochs of
    2 steps (3 epochs: each run's throughput has an interval). The tiny language model: its
    0.5 MB of gradients cross 100mbit in 0.04 s a step, where resnet10_small's 20 MB took 1.6 s
    (the sweep's 100mbit point cost 48 s more than its unshaped one, both methods); PowerSGD
    compresses from its second step."""
    flags = [*tiny_flags(dataset=None, image_size=None, model="tiny", max_steps_per_epoch=2,
                         epochs=3, max_val_steps=1),
             "--workload", "lm", "--seq-len", "32", "--powersgd-start-iter", "2"]
    p = labkit(["sweep", "link=100mbit,unshaped", "--emulate-nodes", 2, "--nproc", 1,
                "--methods", "ddp,powersgd", "--no-report", *flags, "--runs-dir", "runs"],
               cwd=tmp_path, timeout=280)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    root = (tmp_path / "runs" / "latest").resolve()
    doc = load_json(root / "sweep.json")
    assert [(x["name"], x["status"]) for x in doc["points"]] == [
        ("link-100mbit", "completed"), ("link-unshaped", "completed")]
    for name, rate in (("link-100mbit", 100 * MBIT), ("link-unshaped", 0)):
        for m in ("ddp", "powersgd"):
            res = load_json(root / name / m / FILES[m])
            assert res["link"]["rate_bit"] == rate and res["link"]["nodes"] == 2, res["link"]
            assert res["world_size"] == 2
    assert (root / "report" / "link.png").stat().st_size > 10_000
    text = (root / "report" / "crossovers.txt").read_text()
    assert "PowerSGD vs DDP, throughput:" in text, text
    assert "at 100 Mbit/s" in text and "at unshaped" in text, text
    html = (root / "report" / "sweep.html").read_text()
    assert "Crossovers against DDP" in html and "PowerSGD vs DDP, throughput:" in html
