"""labkit report: the guide's tables, five plots and text report, from the lab's result files
or from files that carry only the guide's keys; problems are named, results never modified."""
from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys

import pytest
from PIL import Image

from labkit import report
from labkit.core.results import Result

PLOTS = ["throughput_comparison", "training_time_comparison", "loss_curves", "accuracy_curves",
         "communication_overhead"]


def guide_epoch(i, thr, extra=None):
    """One epoch with exactly the guide's keys (its example values, varied per epoch)."""
    e = {"epoch": i, "train_loss": 0.5234 / i, "train_accuracy": 85.23 + i, "train_time": 300.5 - i,
         "train_throughput": thr + i, "avg_batch_time": 0.125, "val_loss": 0.4567 / i,
         "val_accuracy": 87.45 + i}
    return {**e, **(extra or {})}


@pytest.fixture
def guide_dir(tmp_path):
    """Result files as the original scripts wrote them: only the guide's keys."""
    d = tmp_path / "guide"
    d.mkdir()
    common = {"world_size": 4, "batch_size": 64, "start_time": "2025-12-12 10:00:00",
              "end_time": "2025-12-12 10:15:00"}
    files = {
        "results_baseline_ddp.json": {
            "method": "Baseline DDP (PyTorch)", **common,
            "epochs": [guide_epoch(i, 512.3) for i in (1, 2)],
            "summary": {"avg_train_throughput": 510.2, "avg_train_time_per_epoch": 305.3,
                        "best_val_accuracy": 88.67},
            "all_losses": [0.9, 0.7, 0.5, 0.4]},
        "results_all_reduce.json": {
            "method": "Manual All-Reduce", **common,
            "epochs": [guide_epoch(i, 480.0, {"avg_comm_time": 0.02, "all_losses": [0.9, 0.6]}) for i in (1, 2)],
            "summary": {"avg_train_throughput": 459.18, "avg_train_time_per_epoch": 320.0,
                        "best_val_accuracy": 88.1, "final_train_accuracy": 87.0},
            "all_losses": [0.9, 0.6, 0.5, 0.45]},
        "results_ps.json": {
            "method": "Parameter Server (PS)", **common, "num_workers": 3,
            "epochs": [guide_epoch(i, 300.0, {"avg_comm_time_pull": 0.03, "avg_comm_time_push": 0.05})
                       for i in (1, 2)],
            "summary": {"avg_train_throughput": 255.1, "avg_train_time_per_epoch": 400.0,
                        "best_val_accuracy": 86.0, "avg_comm_time_pull": 0.03, "avg_comm_time_push": 0.05},
            "all_losses": [1.0, 0.8, 0.7, 0.6]},
    }
    for name, doc in files.items():
        (d / name).write_text(json.dumps(doc))
    return d


def labkit_report(args, cwd):
    return subprocess.run([sys.executable, "-m", "labkit", "report", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def digests(d):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.glob("results_*.json"))}


def check_pngs(plots_dir):
    for name in PLOTS:
        p = plots_dir / f"{name}.png"
        assert p.stat().st_size > 0, name
        with Image.open(p) as im:
            im.verify()
        with Image.open(p) as im:
            colours = im.convert("RGB").getcolors(maxcolors=1_000_000)
            assert colours is None or len(colours) > 20, f"{name} looks blank"


def test_report_from_guide_only_files(guide_dir, tmp_path):
    before = digests(guide_dir)
    out = tmp_path / "analysis"
    p = labkit_report([str(guide_dir), "--out", str(out)], cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    # the terminal shows both tables, with speedups computed from the files' own summaries
    assert "Avg throughput (img/s)" in p.stdout and "Speedup vs DDP" in p.stdout
    assert "1.00x (baseline)" in p.stdout
    assert f"{459.18 / 510.2:.2f}x" in p.stdout and f"{255.1 / 510.2:.2f}x" in p.stdout
    assert "Param pull (ms)" in p.stdout and "(inside PyTorch)" in p.stdout
    assert "80.00" in p.stdout  # PS total comm = 30 + 50 ms
    check_pngs(out / "plots")
    text = (out / "performance_report.txt").read_text()
    assert "Performance comparison" in text and "Communication time per training step" in text
    # no step times, so no CI: the discussion names the measured leader but calls no winner
    assert "Baseline DDP had the highest measured throughput" in text
    assert digests(guide_dir) == before  # results are only read


def test_report_without_out_writes_like_the_guide(guide_dir):
    """As analyze_results.py: plots/ and performance_report.txt in the current folder."""
    p = labkit_report(["results_baseline_ddp.json", "results_ps.json"], cwd=guide_dir)
    assert p.returncode == 0, p.stderr
    check_pngs(guide_dir / "plots")
    assert (guide_dir / "performance_report.txt").exists()


def test_corrupt_and_missing_files_are_named(guide_dir, tmp_path):
    full = (guide_dir / "results_all_reduce.json").read_text()
    (guide_dir / "results_all_reduce.json").write_text(full[: len(full) // 2])  # truncated
    (guide_dir / "results_ps.json").write_text(json.dumps({"hello": "world"}))  # another schema
    out = tmp_path / "analysis"
    p = labkit_report([str(guide_dir), "--out", str(out)], cwd=tmp_path)
    assert p.returncode == 1  # rendered, but something is wrong
    assert "results_all_reduce.json: not valid JSON" in p.stdout
    assert "results_ps.json: not a result file" in p.stdout
    check_pngs(out / "plots")  # the rest still renders
    text = (out / "performance_report.txt").read_text()
    assert "not valid JSON" in text and "Baseline DDP" in text


def test_failed_run_keeps_finished_epochs_in_the_report(guide_dir, tmp_path):
    doc = json.loads((guide_dir / "results_ps.json").read_text())
    doc.update(status="failed", error="RuntimeError: rank 2 died")
    doc["epochs"] = doc["epochs"][:1]
    (guide_dir / "results_ps.json").write_text(json.dumps(doc))
    res = report.load_run(guide_dir)
    assert "ps" in res.ok and "status failed" in res.problems["ps"]
    rows = report.comparison_rows(res)
    assert [r["Method"] for r in rows] == ["Baseline DDP", "Manual All-Reduce", "Parameter Server"]


def test_a_method_the_experiment_did_not_finish_is_named_in_its_problem(guide_dir, tmp_path):
    """experiment.json's status for a method that wrote no result (interrupted as it started):
    the report's problem line names the method, not only the status."""
    (tmp_path / "ddp").mkdir()
    (tmp_path / "ddp" / "results_baseline_ddp.json").write_text(
        (guide_dir / "results_baseline_ddp.json").read_text())
    (tmp_path / "experiment.json").write_text(json.dumps({"status": "interrupted", "methods": {
        "ddp": {"status": "completed"}, "allreduce": {"status": "interrupted"},
        "ps": {"status": "failed", "error": "LaunchError: rank 2 died "}}}))
    lines = [line for line in report.discussion(report.load_run(tmp_path)) if "Problem" in line]
    assert lines == ["Problem: Manual All-Reduce: interrupted",
                     "Problem: Parameter Server: failed: LaunchError: rank 2 died"]


def test_nothing_to_report_is_one_message(tmp_path):
    p = labkit_report([str(tmp_path)], cwd=tmp_path)
    assert p.returncode == 2 and "no result files" in p.stderr and "Traceback" not in p.stderr
    p = labkit_report([str(tmp_path / "nope")], cwd=tmp_path)
    assert p.returncode == 2 and "does not exist" in p.stderr


def test_implementation_section_quotes_the_current_source():
    md = report.implementation_markdown()
    from labkit.training.sync import ps_collective
    src = open(ps_collective.__file__).read()
    # each pull and push through the lab's helpers: timed and its bytes counted
    for line in ("self.pulls[i].append(self.broadcast(self.flat_params[lo:hi], src=s, group=g,",
                 "self.pushes.append(self.reduce(t, dst=s, group=g, async_op=True, phase=\"push\"))",
                 "def _await_layer(self, buckets: list[int], module, args) -> None:"):
        assert line in src, line  # guard: the quote is real code
        assert line in md, line   # and the report shows it
    assert "register_post_accumulate_grad_hook" not in md or "_grad_ready" in md


def test_every_quoted_function_has_exactly_one_marker(tmp_path, monkeypatch):
    """The implementation section quotes by ``# report-quote: NAME`` markers: each name it
    uses is marked once, above a function; a missing marker is an error, not a silent gap."""
    from labkit.report import implementation as impl

    found = impl.find_quotes()
    for name in impl.QUOTES:
        assert len(found.get(name, [])) == 1, name
        assert impl.quote(name, found).lstrip().startswith(("def ", "@")), name
    assert set(found) == set(impl.QUOTES)  # no stray marker either
    with pytest.raises(impl.QuoteError, match="'no-such-quote'"):
        impl.quote("no-such-quote", found)


def test_captions_are_numbered_once():
    """Each caption's number is its place among its kind's in the one captions table."""
    numbers = [report.captions.number(k) for k in report.CAPTIONS]
    assert len(numbers) == len(set(numbers))
    assert [n for n in numbers if n.startswith("Table")] == [f"Table {i}" for i in range(1, 14)]
    assert [n for n in numbers if n.startswith("Figure")] == [f"Figure {i}" for i in range(1, 14)]
    assert all(p in report.CAPTIONS for p in report.PLOTS + report.SEED_PLOTS)  # each plot has its caption


# ------------------------------------------------------------------ intervals and verdicts
def lab_doc(method, steps, *, trainers=4, world=4, epochs=3, acc=97.0, seed=0):
    """A lab result file whose steady-state step times are ``steps`` (split over ``epochs``)."""
    import numpy as np

    per = np.array_split(np.asarray(steps, dtype=float), epochs)
    names = {"ddp": "Baseline DDP (PyTorch)", "allreduce": "Manual All-Reduce",
             "ps": "Parameter Server (PS)"}
    eps = [{"epoch": i + 1, "train_loss": 1.0 / (i + 1), "train_accuracy": 90.0 + i,
            "train_time": float(p.sum()) * 1.1, "train_throughput": 32 * trainers / p.mean(),
            "avg_batch_time": float(p.mean()), "val_loss": 0.5, "val_accuracy": acc - 2 + i,
            "step_times": p.tolist()} for i, p in enumerate(per)]
    d = {"method": names[method], "method_key": method, "world_size": world, "batch_size": 32,
         "trainers": trainers, "epochs": eps, "status": "completed", "config": {"seed": seed},
         "summary": {"avg_train_throughput": sum(e["train_throughput"] for e in eps) / len(eps),
                     "avg_train_time_per_epoch": sum(e["train_time"] for e in eps) / len(eps),
                     "best_val_accuracy": acc}}
    if method == "ps":
        d["num_workers"] = trainers
    return d


def write_run(d, docs):
    d.mkdir(parents=True, exist_ok=True)
    files = {"ddp": "results_baseline_ddp.json", "allreduce": "results_all_reduce.json",
             "ps": "results_ps.json"}
    for m, doc in docs.items():
        (d / files[m]).write_text(json.dumps(doc))
    return d


def constructed(seed, win=0.90, sd=0.02, n=27):
    """DDP; allreduce a clear win (step time x ``win``); PS (3 trainers) the same throughput
    as DDP: its step is 3/4 of DDP's. Steps iid normal around 0.5 s, sd ``sd`` relative."""
    import numpy as np

    g = np.random.default_rng(seed)
    noise = lambda: 0.5 * (1 + sd * g.standard_normal(n))  # noqa: E731
    return {"ddp": lab_doc("ddp", noise()),
            "allreduce": lab_doc("allreduce", win * noise()),
            "ps": lab_doc("ps", 0.75 * noise(), trainers=3)}


def epoch_means(steps, epochs=3):
    """Independent batch means with the epochs as the batches (a run of 3 or more epochs)."""
    import numpy as np

    return np.asarray([p.mean() for p in np.array_split(np.asarray(steps, dtype=float), epochs)])


def test_table1_interval_and_verdicts_from_known_step_times(tmp_path):
    """9 steps in each of 3 epochs, the epochs the units: the throughput CI is the t-interval
    of the 3 epoch means (scipy), mapped through images/step / mean step; the speedup's, the
    log-ratio interval with Welch df. The clear win is called faster, the
    tie within the noise, and the sentences say so."""
    import numpy as np
    from scipy import stats as sps

    docs = constructed(1)
    res = report.load_run(write_run(tmp_path / "run", docs))
    rows = {r["Method"]: r for r in report.comparison_rows(res)}
    for m in ("ddp", "allreduce"):
        steps = np.concatenate([e["step_times"] for e in docs[m]["epochs"]])
        bm = epoch_means(steps)
        lo_t, hi_t = sps.ttest_1samp(bm, 0).confidence_interval(0.95)
        k = 32 * 4
        row = rows[report.SHORT[m]]
        assert row["Avg throughput (img/s)"] == pytest.approx(k / steps.mean(), rel=1e-9)
        lo, hi = map(float, row["Throughput 95% CI"].split("-"))
        assert lo == pytest.approx(k / hi_t, rel=2e-3) and hi == pytest.approx(k / lo_t, rel=2e-3)
    # speedup of allreduce: independent log-ratio interval
    a = np.concatenate([e["step_times"] for e in docs["allreduce"]["epochs"]])
    b = np.concatenate([e["step_times"] for e in docs["ddp"]["epochs"]])
    ba, bb = epoch_means(a), epoch_means(b)
    va, vb = ba.var(ddof=1) / 3 / ba.mean() ** 2, bb.var(ddof=1) / 3 / bb.mean() ** 2
    df = (va + vb) ** 2 / (va ** 2 / 2 + vb ** 2 / 2)
    r = b.mean() / a.mean()
    h = sps.t.ppf(0.975, df) * (va + vb) ** 0.5
    row = rows["Manual All-Reduce"]
    assert row["Speedup vs DDP"] == f"{r:.2f}x"
    lo, hi = map(float, row["Speedup 95% CI"].split("-"))
    assert lo == pytest.approx(r * np.exp(-h), abs=0.006) and hi == pytest.approx(r * np.exp(h), abs=0.006)
    assert lo > 1.0  # the constructed win is clear
    assert rows["Baseline DDP"]["Speedup 95% CI"] == "-"
    # the verdicts
    text = "\n".join(report.discussion(res))
    assert f"Manual All-Reduce: {r:.2f}x DDP, 95% CI {row['Speedup 95% CI']}, faster than DDP." in text
    ps_line = next(l for l in text.splitlines() if l.startswith("Parameter Server: 1.00x DDP"))
    assert "within the measurement noise of this run" in ps_line
    assert "more steps or --repeats would resolve it" in ps_line
    assert "faster" not in ps_line and "slower" not in ps_line
    assert "was fastest" not in text
    # one launch per method: the verdict says what its interval cannot see
    assert report.text.ONE_LAUNCH in text.splitlines()
    # accuracy: one seed each, so no accuracy verdict
    assert "a single seed cannot separate them" in text


def test_synthetic_data_compares_speed_and_says_why_not_accuracy(tmp_path):
    """Synthetic labels are random: the report still judges speed, but compares no accuracy and
    times no time to accuracy, saying why in one line; one method on real data brings them back."""
    docs = constructed(1)
    for d in docs.values():
        d["config"].update(dataset="synthetic", num_classes=1000)
    res = report.load_run(write_run(tmp_path / "synthetic", docs))
    text = report.discussion(res)
    assert any(l.startswith("Manual All-Reduce: ") and "faster than DDP" in l for l in text)
    said = [l for l in text if l.startswith("Accuracy")]
    assert said == [report.tables.chance_only(res)] and "0.10% with 1000 classes" in said[0]
    assert not any("validation accuracy (" in l or "a single seed cannot" in l for l in text)
    assert {(r["Time to target (s)"], r["Steps to target"]) for r in report.comparison_rows(res)} == {("-", "-")}
    assert "none here" in report.target_text(res)  # Table 1's caption
    docs["ddp"]["config"]["dataset"] = "digits"
    res = report.load_run(write_run(tmp_path / "mixed", docs))
    assert report.tables.chance_only(res) is None
    assert any(l.startswith("Accuracy (best validation accuracy against DDP)") for l in report.discussion(res))


def test_repeats_judge_without_the_one_launch_caveat():
    """Three repeats of a clear win: the interval is over the repeats (launches), so the
    caveat of a single run (report.text.ONE_LAUNCH) is not added."""
    runs = [{m: Result.from_dict(d) for m, d in constructed(s, win=0.8).items()} for s in (1, 2, 3)]
    res = report.RunResults(docs=runs[0], repeats={m: [r[m] for r in runs] for m in runs[0]})
    lines = report.discussion(res)
    assert any(l.startswith("Manual All-Reduce:") and "faster than DDP" in l for l in lines), lines
    assert report.text.ONE_LAUNCH not in lines


def verdict_labels(lines):
    out = {}
    for name in ("Manual All-Reduce", "Parameter Server"):
        line = next(l for l in lines if l.startswith(name + ":") and "x DDP" in l)
        out[name] = ("faster" if "faster than DDP" in line else
                     "slower" if "slower than DDP" in line else
                     "noise" if "within the measurement noise" in line else "?")
    return out


@pytest.mark.parametrize("win", [1.0, 0.98, 0.95, 0.90])
def test_two_runs_of_one_distribution_never_contradict(tmp_path, win):
    """Pairs of constructed runs drawn from the same distributions (a tie, small and clear
    wins): one run may call a method faster while the other says within the noise, never
    faster in one and slower in the other."""
    for pair in range(12):
        labels = []
        for k in range(2):
            res = report.load_run(write_run(tmp_path / f"{win}_{pair}_{k}",
                                            constructed(1000 * pair + k, win=win, sd=0.04)))
            labels.append(verdict_labels(report.discussion(res)))
        for name in labels[0]:
            got = {labels[0][name], labels[1][name]}
            assert "?" not in got, labels
            assert got != {"faster", "slower"}, (win, pair, labels)
    if win == 0.90:  # a 10% win with 4% noise is always seen
        assert labels[0]["Manual All-Reduce"] == "faster" == labels[1]["Manual All-Reduce"]


def test_a_run_on_a_busy_machine_is_not_judged(tmp_path):
    """The constructed clear win again, but while Manual All-Reduce ran other work took 35% of
    the machine's CPU time (as rank 0 records it): the discussion does not call it faster,
    says why, and lists every method's load."""
    docs = constructed(1)
    for m, share in (("ddp", 0.01), ("allreduce", 0.35), ("ps", 0.02)):
        for e in docs[m]["epochs"]:
            e["machine_load"] = {"run": 0.6, "background": share, "steal": 0.0, "cpus": 2}
    lines = report.discussion(report.load_run(write_run(tmp_path / "run", docs)))
    ar = next(l for l in lines if l.startswith("Manual All-Reduce:") and "x DDP" in l)
    assert "faster than DDP" not in ar and "not judged" in ar, ar
    assert "35% while Manual All-Reduce ran" in ar
    load = next(l for l in lines if l.startswith("Machine load"))
    assert "Baseline DDP 1%, Manual All-Reduce 35%, Parameter Server 2%" in load
    # the same run with the load under the limit is judged
    for e in docs["allreduce"]["epochs"]:
        e["machine_load"]["background"] = 0.05
    lines = report.discussion(report.load_run(write_run(tmp_path / "run2", docs)))
    assert any(l.startswith("Manual All-Reduce:") and "faster than DDP" in l for l in lines)


def test_guide_files_without_step_times_show_na(guide_dir, tmp_path):
    """Files from the original scripts have no step_times: the CI columns say n/a, the
    speedup is still computed from the summaries, the verdict says why there is none, and
    everything renders."""
    res = report.load_run(guide_dir)
    rows = report.comparison_rows(res)
    assert [r["Throughput 95% CI"] for r in rows] == ["n/a"] * 3
    assert [r["Speedup 95% CI"] for r in rows] == ["-", "n/a", "n/a"]
    assert rows[1]["Speedup vs DDP"] == f"{459.18 / 510.2:.2f}x"
    text = "\n".join(report.discussion(res))
    assert "no confidence interval: no per-step times in the result file" in text
    assert "faster than DDP" not in text and "slower than DDP" not in text
    out = tmp_path / "analysis"
    p = labkit_report([str(guide_dir), "--out", str(out)], cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "Throughput 95% CI" in p.stdout and "Speedup 95% CI" in p.stdout and "n/a" in p.stdout
    check_pngs(out / "plots")


def test_too_few_steps_is_na_with_the_reason(tmp_path):
    docs = {m: lab_doc(m, [0.5, 0.51], epochs=1) for m in ("ddp", "allreduce")}
    res = report.load_run(write_run(tmp_path / "run", docs))
    rows = {r["Method"]: r for r in report.comparison_rows(res)}
    assert rows["Manual All-Reduce"]["Speedup 95% CI"] == "n/a"
    assert rows["Baseline DDP"]["Throughput 95% CI"] == "n/a"
    assert "too few steady-state steps for an interval" in "\n".join(report.discussion(res))


def test_figures_1_2_whiskers_are_the_table_ci(tmp_path):
    """Figure 1's error bars span Table 1's throughput CI; Figure 2's the same relative
    interval on the time per epoch."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    docs = constructed(3)
    res = report.load_run(write_run(tmp_path / "run", docs))
    ivs = report.intervals(res)
    for plot, key in ((report.plot_throughput, "thr"), (report.plot_training_time, "time")):
        fig, ax = plt.subplots()
        plot(res, ax)
        from matplotlib.container import ErrorbarContainer
        eb = next(c for c in ax.containers if isinstance(c, ErrorbarContainer))
        segs = eb.lines[2][0].get_segments()
        for m, seg in zip(("ddp", "allreduce", "ps"), segs):
            iv = ivs[m]["throughput"]
            lo, hi = sorted(y for _, y in seg)
            if key == "thr":
                assert (lo, hi) == pytest.approx((iv.low, iv.high), rel=1e-9)
            else:
                t = docs[m]["summary"]["avg_train_time_per_epoch"]
                assert (lo, hi) == pytest.approx((t * iv.value / iv.high, t * iv.value / iv.low), rel=1e-9)
        assert "95% CI" in ax.get_title()
        plt.close(fig)
    assert "95% confidence interval" in report.figure_caption("throughput_comparison")
    assert "95% confidence interval" in report.figure_caption("training_time_comparison")


def test_terminal_summary_ends_with_the_verdicts(tmp_path):
    res = report.load_run(write_run(tmp_path / "run", constructed(2)))
    s = report.terminal_summary(res)
    assert s.startswith("Table 1. Performance comparison")
    assert "Speedup 95% CI" in s and "faster than DDP" in s and "within the measurement noise" in s
    p = labkit_report([str(tmp_path / "run"), "--out", str(tmp_path / "a")], cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    tail = p.stdout.rsplit("report: ", 1)[1]
    assert "faster than DDP" in tail and "a single seed cannot separate them" in tail


def test_the_accuracy_range_is_the_exact_methods_and_the_bound_is_said_apart():
    """Issue 59: "ranged from 93.04% to 99.16%: the methods apply the same averaged SGD step"
    was false where 93.04% was No sync's, whose ranks never average."""
    from labkit.report.findings import accuracy_apart, exact_range_lines

    acc = {"ddp": 99.16, "allreduce": 98.89, "ps": 99.0, "nosync": 93.04, "powersgd": 97.5}
    exact = next(l for l in exact_range_lines(acc) if "same averaged SGD step" in l)
    assert "from 98.89% to 99.16%" in exact and "93.04" not in exact and "97.50" not in exact
    assert "never average" in accuracy_apart("nosync", 93.04)
    assert "approximate" in accuracy_apart("powersgd", 97.5)
    assert [accuracy_apart(m, acc[m]) for m in ("ddp", "allreduce", "ps")] == ["", "", ""]
    # one exact method: no range to speak of
    assert exact_range_lines({"ddp": 99.0, "nosync": 90.0}) == []


def test_the_discussion_is_one_paragraph_per_method(tmp_path):
    """Issue 59: the Discussion per method, not per metric: each method's name starts exactly
    one line, which holds its speed, its accuracy and its time to the target; a method that
    failed after some epochs says its problem in its own paragraph, and one whose loss
    diverged says that first."""
    docs = constructed(1)
    docs["ps"].update(status="failed", error="RuntimeError: rank 2 died")
    lines = report.discussion(report.load_run(write_run(tmp_path / "run", docs)))
    names = ("Baseline DDP", "Manual All-Reduce", "Parameter Server")
    for name in names:
        own = [l for l in lines if l.startswith(name + ":")]
        assert len(own) == 1, (name, lines)
        assert "img/s" in own[0] if name == "Baseline DDP" else "x DDP" in own[0], own[0]
        assert re.search(r"(reached [\d.]+% in [\d.]+ s|did not reach [\d.]+%)", own[0]), own[0]
        assert ("Accuracy: " in own[0]) == (name != "Baseline DDP"), own[0]
    ar = next(l for l in lines if l.startswith("Manual All-Reduce:"))
    assert "faster than DDP" in ar and "Problem" not in ar
    ps = next(l for l in lines if l.startswith("Parameter Server:"))
    assert "Problem: " in ps and ps.endswith("status failed (RuntimeError: rank 2 died)"), ps
    assert "nan" not in ps  # the file times no pull or push: no sentence about them
    assert not any(l.startswith("Problem:") for l in lines)  # said once, in the paragraph
    # no line of the old per-metric shape ("Accuracy (...):" header followed by a list)
    assert not any(l.endswith(":") for l in lines), lines
    docs = constructed(1)
    docs["allreduce"]["diverged"] = {"epoch": 2, "step": 4, "steps": 9}
    lines = report.discussion(report.load_run(write_run(tmp_path / "diverged", docs)))
    ar = next(l for l in lines if l.startswith("Manual All-Reduce:"))
    assert ar.startswith("Manual All-Reduce: diverged at epoch 2 step 4 (of 9). "), ar


def test_the_bounds_replicas_are_not_called_identical():
    """Issue 59: "No sync (bound): replicas identical after each of 3 epochs": the lab copies
    rank 0's parameters to every rank at each epoch's end, so the check cannot fail for it."""
    from types import SimpleNamespace

    from labkit.report.findings import health_lines

    epochs = [{**guide_epoch(e, 100.0), "replicas": {"identical": True}} for e in (1, 2, 3)]
    doc = Result.from_dict({"method": "x", "epochs": epochs})
    lines = health_lines(SimpleNamespace(docs={"ddp": doc, "nosync": doc}))
    assert lines == ["Baseline DDP: replicas identical after each of 3 epochs."]


# ------------------------------------------------------------------ the write-up (issue 59)
def numbers(text):
    """The measured figures of a text: numbers with decimals, percentages and ratios."""
    return set(re.findall(r"\d[\d,]*\.\d+x?|\d+%", text))


def test_a_run_without_repeats_variants_or_bench_shows_none_and_names_them(tmp_path):
    """No empty sections: a run of one repeat, no variants and no bench has none of those parts
    (in the outline, the notebook's blocks and the text report), and one line at the end of the
    body names each with how to add it."""
    run = write_run(tmp_path / "run", constructed(1))
    res = report.load_run(run)
    keys = [k for k, _ in report.outline(res, run)]
    assert keys[:2] == ["summary", "results"] and keys[-3:] == ["how-to-read", "code", "environment"]
    assert not {"repeats", "seeds", "variants", "bench"} & set(keys)
    assert report.repeats_section(res) == [] and report.seeds_section(res) == []
    assert report.variants_section(run, res, tmp_path) == [] and report.bench_section(run, tmp_path) == []
    line = report.not_in_run(res, run)
    assert line.startswith("Not in this run: repeats (`labkit experiment --repeats N`")
    for what in ("variants (`--methods", "bench (`labkit bench", "the no-communication bound"):
        assert what in line, what
    text = report.text_report(res)
    for heading in ("Repeats", "Time to accuracy over seeds", "Method variants", "Benchmark"):
        assert f"\n{heading}\n" not in text, heading
    assert "Present when" not in text
    body, appendix = text.split("\nAppendix A. How to read this report\n", 1)
    assert body.rstrip().splitlines()[-1] == line  # the body's last line
    # the text report follows the outline's order, the notebook's
    at = [text.index(f"\n{t}\n{'-' * len(t)}\n") for _, t in report.outline(res, run)]
    assert at == sorted(at)


def test_a_run_with_a_variant_shows_its_section_and_no_longer_names_it(tmp_path):
    """Issue 59, the other side: the same run with a variant (ddp-bf16 beside DDP, as
    `--methods ddp,ddp-bf16` writes it) has the Method variants part in the outline and the
    text report, in the outline's order, and the last line of the body no longer names it."""
    run = write_run(tmp_path / "run", constructed(1))
    (run / "ddp-bf16").mkdir()
    (run / "ddp-bf16" / "results_baseline_ddp.json").write_text((run / "results_baseline_ddp.json").read_text())
    res = report.load_run(run)
    keys = [k for k, _ in report.outline(res, run)]
    assert "variants" in keys and keys.index("variants") < keys.index("discussion")
    text = report.text_report(res)
    assert "\nMethod variants\n" in text and "ddp-bf16" in text.split("\nMethod variants\n", 1)[1]
    line = report.not_in_run(res, run)
    assert "variants (" not in line and "bench (`labkit bench" in line
    at = [text.index(f"\n{t}\n{'-' * len(t)}\n") for _, t in report.outline(res, run)]
    assert at == sorted(at)


def test_summary_numbers_are_the_tables(tmp_path):
    """Every figure of the summary is one the report's tables or discussion state (computed by
    the same functions): a constructed run whose clear win the summary names as faster."""
    from labkit.core.texttable import text_table, two_decimals

    res = report.load_run(write_run(tmp_path / "run", constructed(1, win=0.8)))
    lines = report.summary_lines(res)
    assert lines[0].startswith("Highest measured throughput") or lines[0].startswith("Fastest here")
    rows = {r["Method"]: r for r in report.comparison_rows(res)}
    ar = rows["Manual All-Reduce"]
    # the clear win: named first, with Table 1's throughput, speedup and interval and the rule's word
    assert lines[0].startswith(f"Fastest here (Table 1): Manual All-Reduce, "
                               f"{two_decimals(ar['Avg throughput (img/s)'])} img/s "
                               f"(95% CI {ar['Throughput 95% CI']}), {ar['Speedup vs DDP']} DDP "
                               f"(95% CI {ar['Speedup 95% CI']}: faster than DDP)")
    tables = "\n".join([text_table(report.comparison_rows(res), two_decimals),
                        text_table(report.communication_rows(res), two_decimals),
                        *report.discussion(res)])
    said = numbers(" ".join(lines))
    assert said and said <= numbers(tables), said - numbers(tables)
    assert any(l.startswith("Time to ") and "(Table 1)" in l for l in lines)


def test_captions_are_three_lines_and_point_to_the_definitions():
    """Every caption, its fields filled as a real run fills them, is at most three lines
    (MAX_CHARS); a table's terms are defined once, in the appendix its caption links to."""
    from labkit.report import reading
    from labkit.report.captions import MAX_CHARS

    fields = dict(target="94.21% (95% of the best validation accuracy any method reached)", ok=3,
                  total=4, created="2026-11-27T19:50:18", model="resnet10_small", dataset="digits",
                  batch_size=32, backend="gloo", device="cpu", trials=10, steps=20, warmup=3,
                  original="runs/2026-11-27_19-50-18_em-100mbit", tolerance=" (tolerance 1e-06)",
                  link="100mbit", at=1024, compute="601 ms", drop=5)
    for key in report.CAPTIONS:
        text = report.caption(key, **{**fields, "target": 2.0} if key == "costmodel" else fields)
        plain = re.sub(r"\[([^]]*)\]\([^)]*\)", r"\1", text).replace("*", "").replace("`", "")
        assert len(plain) <= MAX_CHARS, (key, len(plain))
        for said_once in ("infinitely slow", "2(n-1)/n", "Welch", "ran while the trainer computed"):
            assert said_once not in text, (key, said_once)  # the definitions live apart
    for key in ("comparison", "communication", "seeds", "projection_methods"):
        assert report.caption(key).endswith(reading.POINTER), key
    md = report.reading_markdown(report.CAPTIONS)
    for term in ("95% confidence intervals", "Exposed and hidden", "MLPerf's rule", "On the wire"):
        assert md.count(f"**{term}") == 1, term


def test_table_11_collapses_what_says_the_same_as_ddp():
    """A method whose every cell is DDP's (1.00x, never faster) is one line, not a row; a
    method that never wins has its ratios in the row and "never" said once; DDP has no row."""
    from labkit.report import projection

    links = ("nvlink", "ib_ndr", "10gbe")
    got = (0.6, {"ddp": {k: (1.0, False, None) for k in links},
                 "allreduce": {k: (1.0, False, "never") for k in links},
                 "ps": {k: (r, False, "never") for k, r in zip(links, (0.87, 0.43, 0.02))},
                 "powersgd": {"nvlink": (0.99, False, "never"), "ib_ndr": (1.2, True, "any"),
                              "10gbe": (3.0, True, "below 85 ms")}})
    rows = {r["Method"]: r for r in projection.rows(got)}
    assert set(rows) == {"Parameter Server", "PowerSGD"}
    assert "wins" not in "".join(rows["Parameter Server"].values())
    assert rows["PowerSGD"]["10 GbE (TCP)"] == "3.00x; wins: below 85 ms"
    assert rows["PowerSGD"]["NVLink 4 (H100)"] == "0.99x"
    lines = projection.lines(got)
    assert [l.split(":")[0] for l in lines] == ["Manual All-Reduce", "Parameter Server"]
    assert "the same as DDP" in lines[0] and "never beats DDP" in lines[1]
    assert "PowerSGD on InfiniBand NDR" in projection.sentence(got)
