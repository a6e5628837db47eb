"""Methods judged over seeds (issue 37): time and steps to the target with MLPerf's scoring,
final accuracy with its interval, a verdict per method against DDP on speed AND on accuracy,
and the two figures. Result documents are built here by hand, so each figure the report
states is known before it is computed; a real experiment with repeats is test_repeats_sweep's."""
from __future__ import annotations

import math

import numpy as np
import pytest

from labkit.core.results import Result
from labkit.report import seeds
from labkit.report.load import RunResults

GOAL = 80.0  # --target-accuracy of these runs


def doc(seed: int, accs: list[float], epoch_s: float = 10.0, sent: float = 4e6,
        status: str = "completed", **top) -> dict:
    """A result document: one epoch per accuracy, each ``epoch_s`` seconds (9 training, 1
    validation) of 20 steps, ``sent`` bytes per step from each of 2 trainers."""
    epochs = [{"epoch": i + 1, "steps": 20, "train_loss": 1.0, "train_accuracy": a, "train_time": 0.9 * epoch_s, "val_time": 0.1 * epoch_s,
               "train_throughput": 320 / epoch_s,
               "val_accuracy": a, "wire": {"sent_per_step": [sent, sent], "received_per_step": [sent, sent],
                                           "trainer": [True, True]}}
              for i, a in enumerate(accs)]
    return {"method": "Manual All-Reduce", "world_size": 2, "batch_size": 8, "config": {"seed": seed}, "status": status, "epochs": epochs, **top}


def results(**methods: list[dict]) -> RunResults:
    """The runs of each method (result documents, as doc() builds them), read as results."""
    runs = {m: [Result.from_dict(d) for d in docs] for m, docs in methods.items()}
    return RunResults(docs={m: r[0] for m, r in runs.items()}, repeats=runs, target_accuracy=GOAL)


def test_mlperf_scoring_drops_the_fastest_and_slowest_and_counts_a_miss_as_slowest():
    # 5 seeds: reaching 80% after 1, 2, 2, 3 epochs and never; the miss is the slowest seed
    runs = [doc(0, [85, 86]), doc(1, [70, 81]), doc(2, [75, 82]), doc(3, [60, 70, 90]),
            doc(4, [50, 60, 70])]
    s = seeds.score(results(ddp=runs), "ddp", GOAL)
    assert s.reached == 4 and math.isinf(s.seconds[4])
    kept = [20.0, 20.0, 30.0]  # the fastest (10 s) and the miss dropped
    iv = s.time()
    assert iv.value == pytest.approx(np.mean(kept)) and iv.n == 3 and iv.available
    assert s.steps_to().value == pytest.approx(np.mean([40, 40, 60]))
    row = seeds.rows(results(ddp=runs))[0]
    assert row["Reached"] == "4 of 5" and row["Time to target (s, 95% CI)"].startswith("23.3 (")


def test_a_method_that_misses_the_target_is_reported_not_dropped():
    ddp = [doc(s, [70, 85]) for s in range(3)]
    lossy = [doc(0, [70, 85]), doc(1, [60, 70]), doc(2, [70, 82])]
    res = results(ddp=ddp, allreduce=lossy)  # (registered keys stand for any method here)
    row = {r["Method"]: r for r in seeds.rows(res)}[seeds.SHORT["allreduce"]]
    s = seeds.score(res, "allreduce", GOAL)
    assert s.reached == 2 and s.time().value is None and "2 of 3" in s.time().note
    line = seeds.verdict(res, "allreduce", "ddp", GOAL)
    assert "did not reach 80.00% in 1 of 3 seeds" in line and "not dropped" in line
    assert row["Time to target (s, 95% CI)"] == "not reached (2 of 3 seeds reached it)"


def test_a_diverged_seed_is_named():
    runs = [doc(0, [85]), doc(1, [85]), doc(2, [], status="failed",
                                            diverged={"epoch": 1, "step": 4, "steps": 20})]
    s = seeds.score(results(ddp=runs), "ddp", GOAL)
    assert s.failed == ["seed 2: diverged at epoch 1 step 4 (of 20)"] and s.reached == 2


def test_an_interrupted_seed_is_left_out_not_counted_as_a_miss():
    """A run the user stopped (Ctrl-C, a sweep stopped half way) ended early through no fault
    of the method: its last accuracy is not final, and not reaching the target is no miss."""
    stopped = doc(2, [70], status="interrupted")
    s = seeds.score(results(ddp=[doc(0, [85]), doc(1, [85]), stopped]), "ddp", GOAL)
    assert (s.n, s.reached) == (2, 2) and s.final_accuracy().n == 2
    only = results(ddp=[doc(0, [85]), doc(1, [85])], allreduce=[stopped])
    assert seeds.judged(only) == ["ddp"]


def test_the_verdict_says_faster_and_accuracy_lost_only_beyond_the_noise():
    ddp = [doc(s, [70, 84 + 0.1 * s], epoch_s=10 + 0.2 * s) for s in range(4)]
    # the same accuracy curve's target in half the time per epoch, but 2 points lower at the end
    quick = [doc(s, [70, 82 + 0.1 * s], epoch_s=5 + 0.1 * s, sent=0.5e6) for s in range(4)]
    same = [doc(s, [70, 84 + 0.1 * s + (0.3 if s % 2 else -0.3)], epoch_s=10 + (0.5 if s % 2 else -0.5))
            for s in range(4)]
    res = results(ddp=ddp, allreduce=quick, ps=same)
    line = seeds.verdict(res, "allreduce", "ddp", GOAL)
    assert "faster: 0.50x" in line and "accuracy lost" in line, line
    line = seeds.verdict(res, "ps", "ddp", GOAL)
    assert "within noise" in line and "no accuracy lost beyond the noise" in line, line
    row = {r["Seeds"]: r for r in seeds.rows(res) if r["MB/step sent"] == "0.500"}
    assert row, seeds.rows(res)  # bytes per step per trainer, in MB


def test_the_bound_is_not_judged_and_one_seed_is_no_section():
    from labkit.core.methods import SPECS

    bound = next(m for m, s in SPECS.items() if s.bound)
    two = results(ddp=[doc(0, [85]), doc(1, [85])], **{bound: [doc(0, [10]), doc(1, [10])]})
    assert seeds.judged(two) == ["ddp"] and seeds.has_seeds(two)
    one = results(ddp=[doc(0, [85])])
    assert not seeds.has_seeds(one)
    assert seeds.seeds_text(two)[0].startswith("Table 10. Time to accuracy over seeds")
    assert seeds.seeds_text(one) == []


def test_the_figures_draw_every_seed_and_their_mean(tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = results(ddp=[doc(s, [70, 85, 90]) for s in range(3)])
    for against in ("time", "bytes"):
        fig, ax = plt.subplots()
        seeds.plot_seeds(res, ax, against)
        lines = [ln for ln in ax.get_lines() if ln.get_label().startswith(seeds.SHORT["ddp"])]
        assert len(ax.get_lines()) == 3 + 1 + 1  # 3 seeds, their mean, the target
        x = lines[0].get_xdata()
        assert list(x) == ([10, 20, 30] if against == "time" else [80, 160, 240])  # MB sent
        plt.close(fig)


def test_a_sweep_over_a_methods_parameter_is_a_study_of_time_to_accuracy_and_bytes(tmp_path):
    """`labkit sweep local_steps=1,8 --repeats 3`: per grid point, time to the target over the
    seeds and the MB per step, as a table and two curves (one target for the whole sweep)."""
    import json

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from labkit.report import sweep as rs
    from labkit.cli import main

    # H=1 reaches 80% in 2 epochs of 10 s, H=8 in 3 epochs of 6 s sending an eighth
    grid = {1: [doc(s, [70, 81 + s, 88], epoch_s=10) for s in range(3)],
            8: [doc(s, [60, 75, 81 + s], epoch_s=6, sent=0.5e6) for s in range(3)]}
    root, points = tmp_path / "sw", []
    for h, docs in grid.items():
        for i, d in enumerate(docs, 1):
            d_dir = root / f"local_steps-{h}" / f"repeat-{i}" / "allreduce"
            d_dir.mkdir(parents=True)
            (d_dir / "results_all_reduce.json").write_text(json.dumps(d))
        (root / f"local_steps-{h}" / "config.json").write_text(json.dumps({"experiment": {"target_accuracy": GOAL}}))
        points.append({"name": f"local_steps-{h}", "params": {"local_steps": h},
                       "dir": f"local_steps-{h}", "status": "completed"})
    (root / "sweep.json").write_text(json.dumps({"grid": {"local_steps": [1, 8]}, "points": points,
                                                 "methods": ["allreduce"], "repeats": 3}))
    sw = rs.load_sweep(root)
    assert rs.studied(sw) == ["local_steps"] and rs.study_target(sw) == GOAL
    rows = {r["Point"]: r for r in rs.study_rows(sw)}
    assert rows["local_steps=1"]["Time to target (s, 95% CI)"].startswith("20.0 (")
    assert rows["local_steps=8"]["Time to target (s, 95% CI)"].startswith("18.0 (")
    assert rows["local_steps=8"]["MB/step sent"] == "0.500" and rows["local_steps=1"]["MB/step sent"] == "4.000"
    fig, axes = plt.subplots(1, 2)
    rs.plot_study(sw, axes)
    time_line = axes[0].containers[0].lines[0]  # the error bars' data line
    (mb_line,) = axes[1].get_lines()
    assert list(time_line.get_xdata()) == [1, 8] and list(time_line.get_ydata()) == [20.0, 18.0]
    assert list(mb_line.get_ydata()) == [4.0, 0.5]
    plt.close(fig)
    assert main(["report", str(root)]) == 0
    assert (root / "report" / "study.png").stat().st_size > 10_000
    assert "local_steps=8" in (root / "report" / "study.txt").read_text()


def test_a_variants_runs_are_read_from_its_folder_or_from_every_repeat(tmp_path):
    """ddp-bf16 beside DDP (the second baseline): one folder without repeats, repeat-<i>/ with;
    the variants table (load_variants) takes repeat 1's."""
    import json

    from labkit.report.load import load_variants, variant_runs

    def write(folder, seed):
        folder.mkdir(parents=True)
        (folder / "results_baseline_ddp.json").write_text(json.dumps(doc(seed, [85.0])))

    write(tmp_path / "one" / "ddp-bf16", 0)
    for i in (2, 1, 10):  # numeric order, not the folder listing's
        write(tmp_path / "reps" / f"repeat-{i}" / "ddp-bf16", i - 1)
    assert [d.config["seed"] for d in variant_runs(tmp_path / "one", "ddp-bf16")] == [0]
    assert [d.config["seed"] for d in variant_runs(tmp_path / "reps", "ddp-bf16")] == [0, 1, 9]
    assert variant_runs(tmp_path / "reps", "ddp") == []  # a method, not a variant
    assert load_variants(tmp_path / "reps")["ddp-bf16"].config["seed"] == 0
    res = RunResults(docs={}, repeats={}, run_dir=tmp_path / "reps", target_accuracy=GOAL)
    assert "ddp-bf16" in seeds.judged(res) and seeds.score(res, "ddp-bf16", GOAL).n == 3
