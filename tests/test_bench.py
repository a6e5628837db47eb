"""`labkit bench`: every field, compute-only steps that really skip synchronisation, the
profiler trace, and the cost model calibrated on a real (tiny) bench run."""
from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from helpers import BENCH_FLAGS as BENCH, calls, labkit, load_json, of, strict_json


# its module-scoped fixture is built once: the whole module on one xdist worker
pytestmark = pytest.mark.xdist_group("bench")


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    """One real bench: ddp, allreduce and ps with 2 gloo processes, profiled, the overhead job
    with its A/A control (test_methods' bench runs it without)."""
    cwd = tmp_path_factory.mktemp("bench")
    p = labkit(["bench", *BENCH, "--nproc", "2", "--variants", "ddp,allreduce,ps",
                "--profile-steps", "1", "--runs-dir", "runs", "--no-report", "--overhead-control"], cwd,
               env={"LABKIT_TEST_COUNT": str(cwd / "calls.txt")})  # what checks ran where
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    run = (cwd / "runs" / "latest").resolve()
    return run, strict_json(run / "bench.json"), p  # no NaN or Infinity: JSON, strictly


def test_bench_checks_each_job_once_in_the_driver(bench_run):
    """Each job's config is resolved and checked once, by the bench's planner, before anything
    is spawned (issue 39): it was checked again by the launcher and a third time in every rank.
    The ranks read the job's resolved.json and check nothing (LABKIT_TEST_COUNT's record)."""
    run, doc, _ = bench_run
    found = calls(run.parent.parent / "calls.txt")
    jobs = len(doc["results"]) + len(doc["overhead"])  # ddp, allreduce, ps and the overhead job
    assert jobs == 4
    [driver] = of(found, "driver")
    assert driver["validate"] == driver["preflight"] == jobs and driver["read"] == 0
    ranks = of(found, "rank")
    assert len(ranks) == 2 * jobs and all(c == Counter(read=1) for c in ranks)
    for r in [*doc["results"], *doc["overhead"]]:
        written = load_json(run / r["folder"] / "resolved.json")
        assert written["nproc"] == 2 and written["train"]["out"] == str(run / r["folder"])


def test_bench_writes_every_field(bench_run):
    run, doc, p = bench_run
    assert doc["kind"] == "labkit.bench" and doc["status"] == "completed"
    assert [r["variant"] for r in doc["results"]] == ["ddp", "allreduce", "ps"]
    for r in doc["results"]:
        for k in ("median", "min", "max", "iqr"):
            assert r["step_time"][k] > 0 and r["compute_time"][k] > 0
        assert len(r["step_time"]["trials"]) == 2 == len(r["compute_time"]["trials"])
        # per-repetition collective times, for the CI of sync / raw
        assert len(r["collectives"]["all_reduce"]["times"]) == 5
        assert r["collectives"]["all_reduce"]["time"] == pytest.approx(
            sorted(r["collectives"]["all_reduce"]["times"])[2])
        assert r["step_time"]["min"] <= r["step_time"]["median"] <= r["step_time"]["max"]
        # what a trainer sent per step, counted from the method's collectives: with 2 ranks a
        # ring all-reduce sends 2(n-1)/n = 1 x the gradients, a PS worker pushes them once
        # (the request of none here: the synchronous server pulls by broadcast)
        assert r["sent_per_step"] == pytest.approx(r["grad_bytes"], rel=0.01), r["variant"]
        # where the step goes, by the experiment's definitions (labkit.core.breakdown): the
        # marked parts of the synchronised steps (a mean over the trainers) tile a step, so they
        # add up to the trials' step (the slowest rank's); compute is the compute-only one
        b = r["breakdown"]
        assert set(b) == {"data", "compute", "exposed", "optimizer", "rest"}
        assert r["exposed_comm"] == b["exposed"] >= 0
        # paired, trial by trial (the parts are the trials' steps in the order they ran): each
        # trial's parts add up to that trial's own step, to within less than one compute-only
        # forward + backward of the same job (the ranks' windows open and close milliseconds
        # apart, far less than that; a step's forward + backward missed or counted twice is not)
        parts, trials = r["step_parts"]["parts"], r["step_time"]["trials"]
        per_step = np.sum([parts[k] for k in parts], axis=0)
        assert len(per_step) == len(trials) * doc["steps"], r["variant"]
        per_trial = per_step.reshape(len(trials), doc["steps"]).mean(axis=1)
        assert sum(b.values()) == pytest.approx(per_step.mean())
        one_compute = min(r["compute_parts"]["parts"]["compute"])
        assert (abs(per_trial - trials) < one_compute).all(), (r["variant"], per_trial, trials, one_compute)
        assert b["compute"] <= max(r["compute_parts"]["parts"]["compute"])
        assert r["hidden_comm"] >= 0 and 0 <= r["overlap"] <= 1
        c = r["collectives"]
        for k in ("all_reduce", "reduce", "broadcast"):
            assert c[k]["time"] > 0 and c[k]["algbw"] == pytest.approx(c[k]["bytes"] / c[k]["time"])
        # nccl-tests' bus bandwidth: all-reduce moves 2(n-1)/n of the data per rank, n = 2 here
        assert c["all_reduce"]["busbw"] == pytest.approx(c["all_reduce"]["algbw"] * 2 * 1 / 2)
        assert c["reduce"]["busbw"] == pytest.approx(c["reduce"]["algbw"])
        sizes = [s["bytes"] for s in c["all_reduce_sweep"]]
        assert sizes == sorted(sizes) and len(sizes) >= 3 and sizes[-1] == c["all_reduce"]["bytes"]
        assert r["throughput"] == pytest.approx(r["global_batch"] / r["step_time"]["median"])
    ddp, ar, ps = doc["results"]
    # the gradient bytes are the model's parameters in fp32; PS also pulls the parameters
    n_params = ddp["grad_bytes"] // 4
    assert 1_000_000 < n_params < 10_000_000  # resnet10_small: ~4.9 M parameters
    assert ar["bytes_per_step"] == ar["grad_bytes"] and ps["bytes_per_step"] == 2 * ps["grad_bytes"]
    assert ps["trainers"] == 1 and ps["servers"] == 1 and set(ps["phases"]) == {"pull", "push"}
    assert ddp["throughput_vs_ddp"] == 1.0
    assert ar["throughput_vs_ddp"] == pytest.approx(ar["throughput"] / ddp["throughput"])
    # each method's own communication time beside the raw collective of the same bytes
    from labkit.bench.bench_view import rows

    by = {r["variant"]: r for r in rows(doc)}
    ps_sync = sum(ps["phases"].values())
    # per-trial sync times average to the phases' per-step total
    assert len(ps["sync_trials"]) == 2 and sum(ps["sync_trials"]) / 2 == pytest.approx(ps_sync)
    assert by["allreduce"]["sync / raw 95% CI"] not in (None, "n/a")
    assert by["ddp"]["sync / raw 95% CI"] is None and by["ddp"]["x DDP 95% CI"] is None
    assert by["ps"]["sync ms"] == pytest.approx(1000 * ps_sync)
    assert by["ps"]["sync / raw"] == pytest.approx(
        ps_sync / ps["collectives"]["reduce_broadcast"]["time"])
    assert by["allreduce"]["sync / raw"] == pytest.approx(
        ar["phases"]["comm"] / ar["collectives"]["all_reduce"]["time"])
    assert by["ddp"]["sync ms"] is None  # DDP's reducer has no phase timer
    table = (run / "bench.txt").read_text()
    assert "sync / raw" in table
    assert "exposed comm ms" in table and "busbw GB/s" in table and "x DDP" in table
    assert (run / "bench.png").stat().st_size > 10_000
    assert "x DDP" in p.stdout  # the terminal table


def test_bench_holds_labkits_overhead_against_the_plain_loop(bench_run):
    """Every bench also times a plain DDP loop against labkit's DDP training loop, both loading
    their data, trials alternating in one job (labkit.bench.plain_loop): the document holds
    the ratio with its 95% interval, the two loops ended with the same parameters, and the
    table prints it. A figure and its interval, not a speed: speeds are the bench's own."""
    run, doc, p = bench_run
    [o] = doc["overhead"]
    assert o["nproc"] == 2 and o["trials"] == 2 and o["steps"] == 2 and o["warmup"] == 1
    # alternating, each loop before and after each other once (with the A/A control's third
    # loop: ABC, CBA)
    assert o["order"] == ["plain", "labkit_ddp", "plain_again", "plain_again", "labkit_ddp", "plain"]
    plain, labkit = o["plain"]["step_time"]["trials"], o["labkit_ddp"]["step_time"]["trials"]
    again = o["plain_again"]["step_time"]["trials"]
    assert len(plain) == len(labkit) == len(again) == 2 and min(plain + labkit + again) > 0
    # the geometric mean of the two rounds' ratios; the control's likewise, the plain loop's
    # second run against its first
    assert o["ratio"] == pytest.approx((plain[0] / labkit[0] * plain[1] / labkit[1]) ** 0.5)
    assert o["control_ratio"] == pytest.approx((plain[0] / again[0] * plain[1] / again[1]) ** 0.5)
    low, high = o["ratio_ci"]
    assert 0 < low <= o["ratio"] <= high
    assert o["control_ratio_ci"][0] <= o["control_ratio"] <= o["control_ratio_ci"][1]
    assert o["params_equal"] is True and o["params_differing"] == 0
    assert o["control_params_differing"] == 0  # the plain loop twice: the same parameters
    # both loops computed where the methods' jobs did (the overhead job once ignored --device)
    assert o["device"] == doc["device"] == doc["config"]["device"]
    assert {r["device"] for r in doc["results"]} == {doc["device"]}
    assert (run / o["folder"] / "bench_result.json").is_file()
    for text in ((run / "bench.txt").read_text(), p.stdout):
        assert "labkit DDP / plain loop x2: " in text and "95% CI" in text
        assert f"; A/A control, the plain loop against itself: {o['control_ratio']:.3f}, 95% CI " in text


def test_bench_prices_each_instrument_in_paired_rounds(bench_run):
    """Every method's job runs its synchronised trials in rounds with Trainers that
    differ by one instrument (--time-comm off; for DDP also its hook): the job's own trials are
    the 'on' side, each instrument's figure is the geometric mean of the rounds' paired ratios,
    timing changes no parameter, and the loop's work without a switch is timed call by call."""
    run, doc, p = bench_run
    for r in doc["results"]:
        ins, v = r["instruments"], r["variant"]
        ddp = v == "ddp"  # TINY has no progress bar: no --no-progress loop
        loops = ["as run", "--time-comm off"] + (["--time-comm hook"] if ddp else [])
        assert list(ins["loops"]) == loops, v
        # rounds: the loops in order, then backwards (each pair both ways round), the job's first
        assert ins["order"] == loops + loops[::-1], v
        assert ins["loops"]["as run"]["step_time"]["trials"] == r["step_time"]["trials"]
        assert [(x["instrument"], x["on"], x["off"]) for x in ins["pairs"]] == [
            ("--time-comm stats", "as run", "--time-comm off")] + (
            [("--time-comm hook", "--time-comm hook", "--time-comm off")] if ddp else [])
        # the same steps on the same batches from the same weights: equal, bit for bit
        assert ins["params_differing"] == {k: 0 for k in loops[1:]}, v
        from labkit.bench.instrument_cost import instrument_intervals

        for pair, iv in instrument_intervals(r):
            on = ins["loops"][pair["on"]]["step_time"]["trials"]
            off = ins["loops"][pair["off"]]["step_time"]["trials"]
            assert iv.value == pytest.approx((off[0] / on[0] * off[1] / on[1]) ** 0.5)
            assert iv.n == 2 and iv.low <= iv.value <= iv.high
        work = {w["work"].split(" (")[0]: w for w in ins["work"]["items"]}
        assert ins["work"]["step"] == r["step_time"]["median"]
        for w in work.values():
            every = ins["work"]["epoch_steps"] if w["every"] == "epoch" else 1
            assert 0 < w["per_step"] <= w["seconds"] and w["per_step"] * every <= w["seconds"] * 1.0001
        # item 5 of issue 41: the loop's own per-step work below 0.5% of a step, measured here
        # against this job's step (two figures of the same run)
        for name in ("step-part marks", "per-step loss and accuracy", "progress bar: update"):
            assert work[name]["per_step"] < 0.005 * r["step_time"]["median"], (v, name)
        assert "replica check" in work  # 2 processes: the check compares them
    for text in ((run / "bench.txt").read_text(), p.stdout):
        assert "--time-comm stats on ddp x2, on / off: " in text and "--time-comm hook on ddp x2" in text
        assert "--time-comm stats on ps x2, on / off: " in text
    assert "what the lab's instruments cost" in (run / "bench.txt").read_text()


def test_instrument_lines_say_what_the_interval_supports():
    """A cost is called a cost only when the rounds' interval excludes 1.00; a loop whose
    parameters differ is flagged, except for an asynchronous PS, where timing decides them."""
    from labkit.bench import instrument_cost

    def row(on, off, differing=0, timing_dependent=False, repeatable=None):
        return {"variant": "m", "nproc": 2, "instruments": {
            "loops": {"as run": {"step_time": {"trials": on}},
                      "--time-comm off": {"step_time": {"trials": off}}},
            "pairs": [{"instrument": "--time-comm stats", "on": "as run", "off": "--time-comm off"}],
            "params_differing": {"--time-comm off": differing}, "timing_dependent": timing_dependent,
            "device_repeatable": repeatable}}

    off = [0.100, 0.120, 0.090, 0.110]
    [line] = instrument_cost.instrument_lines(row([x * 1.02 for x in off], off))
    assert "it costs (+2.0% per step)" in line and line.startswith("--time-comm stats on m x2")
    tie = instrument_cost.instrument_lines(row(off[::-1], off, differing=3))
    assert "within the trial-to-trial noise of 4 trials" in tie[0]
    assert tie[1].startswith("WARNING: m x2: parameters differ") and "(3 tensors)" in tie[1]
    assert len(instrument_cost.instrument_lines(row(off, off, differing=3, timing_dependent=True))) == 1
    [table_row] = instrument_cost.instrument_rows({"results": [row(off, off, 3, True)]})
    assert table_row["same parameters"] == "n/a (asynchronous)" and table_row["on / off"] == 1.0
    # a GPU whose two identical backward passes differed (pricing.repeatable): a note, not a
    # warning; one that repeats itself keeps the warning
    gpu = row(off, off, differing=3, repeatable=False)
    assert instrument_cost.instrument_lines(gpu)[1].startswith("note: m x2: parameters differ")
    assert "not deterministic" in instrument_cost.instrument_lines(gpu)[1]
    [table_row] = instrument_cost.instrument_rows({"results": [gpu]})
    assert table_row["same parameters"] == "n/a (GPU not deterministic)"
    assert instrument_cost.instrument_lines(row(off, off, 3, repeatable=True))[1].startswith("WARNING")
    [table_row] = instrument_cost.instrument_rows({"results": [row(off, off, 3, repeatable=True)]})
    assert table_row["same parameters"] == "NO"


def test_compute_only_steps_skip_synchronisation(bench_run):
    """Synchronised steps keep every rank's parameters equal; compute-only steps, with each
    rank on its own batches, make them drift apart -- so no communication happened."""
    _, doc, _ = bench_run
    for r in doc["results"]:
        assert r["param_spread"]["sync"] == 0.0, r["variant"]
        assert r["param_spread"]["compute_only"] > 1e-6, r["variant"]


def test_profile_trace_labels_the_phases(bench_run):
    run, _, _ = bench_run
    names = {}
    for v in ("ddp", "allreduce", "ps"):
        trace = json.loads((run / "bench" / f"{v}_x2" / "trace_rank0.json").read_text())
        names[v] = {e.get("name") for e in trace["traceEvents"]}
    assert {"labkit.forward", "labkit.backward", "labkit.sync", "labkit.step"} <= names["ddp"]
    assert "labkit.comm" in names["allreduce"] and any("all_reduce" in n for n in names["allreduce"] if n)
    assert {"labkit.pull", "labkit.push"} <= names["ps"]  # rank 0 is the server
    # the overhead job traces the same step of each loop (--profile-steps 1), after its checks:
    # labkit's phases in labkit's trace only, DDP's forward in both
    steps = {}
    for loop in ("plain", "labkit_ddp"):
        trace = json.loads((run / "bench" / "overhead_x2" / f"trace_{loop}_rank0.json").read_text())
        names[loop] = {e.get("name") for e in trace["traceEvents"]} - {None}
        steps[loop] = {n for n in names[loop] if n.startswith("ProfilerStep#")}
        assert any("DistributedDataParallel.forward" in n for n in names[loop]), loop
    assert len(steps["plain"]) == 1 and steps["plain"] == steps["labkit_ddp"]
    assert "labkit.forward" in names["labkit_ddp"] and not any(n.startswith("labkit.") for n in names["plain"])


def test_cost_model_calibrates_on_a_real_bench(bench_run):
    from labkit import costmodel as model

    _, doc, _ = bench_run
    cal = model.calibrate(doc)[2]
    assert cal["alpha"] >= 0 and cal["bandwidth"] > 1e6  # loopback gloo: well above 1 MB/s
    rows = model.compare_with_bench(doc)
    assert {r["variant"] for r in rows} == {"ddp", "allreduce", "ps"}
    for r in rows:
        measured = next(x for x in doc["results"] if x["variant"] == r["variant"])
        assert r["measured"] == measured["step_time"]["median"]
        assert r["error_pct"] == pytest.approx(100 * (r["predicted"] - r["measured"]) / r["measured"])
        # compute is measured, so the prediction can only be off by the communication part
        assert r["predicted"] >= measured["compute_time"]["median"]


def test_bench_bad_input_is_one_line(tmp_path):
    p = labkit(["bench", "--variants", "ddp,nope"], tmp_path, timeout=60)
    assert p.returncode == 2 and "unknown variant(s) nope" in p.stderr and "Traceback" not in p.stderr
    p = labkit(["bench", *BENCH, "--variants", "ps", "--nproc", "1"], tmp_path, timeout=60)
    assert p.returncode == 2 and "nothing to run" in p.stderr and "ps needs at least 2 processes" in p.stderr
    assert not (tmp_path / "runs").exists()  # nothing written for bad input


def test_report_shows_the_bench_and_the_cost_model(bench_run, tmp_path):
    from labkit import report

    run, doc, _ = bench_run
    blocks = report.bench_section(run, tmp_path)
    html = "\n".join(b.text for b in blocks if isinstance(b, report.Html))
    md = "\n".join(b.text for b in blocks if isinstance(b, report.Markdown))
    for v in ("ddp", "allreduce", "ps"):
        assert f"<td>{v}</td>" in html
    assert html.count("data:image/png;base64,") == 2  # the bench figure and the projection
    assert (tmp_path / "plots" / "bench.png").exists() and (tmp_path / "plots" / "projection.png").exists()
    assert "Table 4. Cost model against the bench" in md and "1024" in html
    assert "$" not in md  # formulas readable without a math engine (the HTML export has none)
    text = report.text_report(report.load_run(run), None)
    assert "Benchmark (labkit bench)" in text and "exposed comm ms" in text
    # a folder without a bench has no bench part; the report's last line says how to get one
    (tmp_path / "empty").mkdir()
    assert report.bench_section(tmp_path / "empty", tmp_path / "empty") == []
    assert "bench (`labkit bench" in report.not_in_run(report.RunResults(), tmp_path / "empty")


def constructed_bench(ddp_trials, ar_trials, ar_sync=None, raw=None, ps_batch=False):
    """A bench document holding known trials (only the fields the table reads)."""
    def result(variant, method, trials, trainers, phases=None, sync=None, raw_times=None):
        med = sorted(trials)[len(trials) // 2]
        r = {"variant": variant, "method": method, "nproc": 4, "trainers": trainers,
             "global_batch": 32 * trainers, "bytes_per_step": 4e6, "phases": phases or {},
             "step_time": {"median": med, "min": min(trials), "max": max(trials), "trials": trials},
             "compute_time": {"median": 0.3, "min": 0.3, "max": 0.3, "trials": [0.3] * len(trials)},
             "grad_bytes": 4e6, "collectives": {"all_reduce": {"time": 0.02, "busbw": 1e9,
                                                               **({"times": raw_times} if raw_times else {})}}}
        if sync is not None:
            r["sync_trials"] = sync
        return r
    from labkit.bench import bench_view
    results = [result("ddp", "ddp", ddp_trials, 4),
               result("allreduce", "allreduce", ar_trials, 3 if ps_batch else 4,
                      {"comm": sum(ar_sync) / len(ar_sync)} if ar_sync else {"comm": 0.03},
                      ar_sync, raw)]
    for r in results:
        bench_view.derive(r)
    bench_view.compare_to_ddp(results)
    return {"kind": "labkit.bench", "config": {"model": "m", "dataset": "d", "batch_size": 32},
            "backend": "gloo", "device": "cpu", "trials": len(ddp_trials), "steps": 5, "warmup": 2,
            "results": results}


def test_bench_ci_columns_against_an_independent_computation():
    """x DDP 95% CI over trials: the ratio of mean step times with a Welch interval on its
    log (delta method), computed here independently; sync / raw likewise against the
    collective's repetitions; the verdict follows the interval."""
    import math

    import numpy as np
    from scipy import stats as sps

    from labkit.bench import bench_view

    ddp, ar = [0.50, 0.52, 0.49, 0.51], [0.40, 0.41, 0.42, 0.40]
    sync, raw = [0.030, 0.034, 0.031, 0.033], [0.020, 0.021, 0.019, 0.022, 0.020]
    doc = constructed_bench(ddp, ar, sync, raw)
    by = {r["variant"]: r for r in bench_view.rows(doc)}

    def welch(num, den):
        a, b = np.asarray(num), np.asarray(den)
        va, vb = a.var(ddof=1) / len(a) / a.mean() ** 2, b.var(ddof=1) / len(b) / b.mean() ** 2
        df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
        r, h = a.mean() / b.mean(), sps.t.ppf(0.975, df) * math.sqrt(va + vb)
        return r * math.exp(-h), r * math.exp(h)

    lo, hi = welch(ddp, ar)  # throughput ratio = DDP's step / the variant's (same batch)
    assert by["allreduce"]["x DDP 95% CI"] == f"{lo:.2f}-{hi:.2f}"
    lo, hi = welch(sync, raw)
    assert by["allreduce"]["sync / raw 95% CI"] == f"{lo:.2f}-{hi:.2f}"
    table = bench_view.text_table(doc)
    assert "x DDP 95% CI" in table and "t-interval over the trials" in table
    assert "allreduce x4: " in table and f"95% CI {by['allreduce']['x DDP 95% CI']}" in table
    assert "within the" not in table  # a 25% win over 4 trials is clear

    # a tie: the same trials in another order, and a PS-like variant with 3 trainers of 4
    tie = constructed_bench(ddp, ddp[::-1])
    assert "within the trial-to-trial noise of 4 trials" in bench_view.text_table(tie)
    scaled = constructed_bench(ddp, ar, ps_batch=True)
    lo, hi = welch(ddp, ar)
    row = {r["variant"]: r for r in bench_view.rows(scaled)}["allreduce"]
    assert row["x DDP 95% CI"] == f"{0.75 * lo:.2f}-{0.75 * hi:.2f}"


def test_bench_files_without_trial_times_say_na():
    """A bench.json from before sync_trials and the collectives' times were kept, or with one
    trial: n/a, not a failure."""
    from labkit.bench import bench_view

    doc = constructed_bench([0.5], [0.4])
    by = {r["variant"]: r for r in bench_view.rows(doc)}
    assert by["allreduce"]["x DDP 95% CI"] == "n/a" and by["allreduce"]["sync / raw 95% CI"] == "n/a"
    assert "no confidence interval: one trial" in bench_view.text_table(doc)


def test_the_repeatability_probe_tells_a_deterministic_device_from_one_that_is_not():
    """pricing.repeatable: two identical backward passes, compared bit for bit. The CPU
    repeats itself; a model whose backward is not repeatable (noise drawn in forward, standing
    for a GPU's atomics) is caught, so a GPU's differing parameters are not blamed on an
    instrument."""
    import torch

    from labkit.bench.pricing import repeatable as _repeatable

    torch.manual_seed(0)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    steady = torch.nn.Linear(4, 3)
    assert _repeatable(steady, [(x, y)], torch.device("cpu")) is True

    class Noisy(torch.nn.Linear):
        def forward(self, t):
            return super().forward(t) * (1 + 1e-3 * torch.rand(()))

    assert _repeatable(Noisy(4, 3), [(x, y)], torch.device("cpu")) is False
    assert _repeatable(steady, [], torch.device("cpu")) is True  # a server: nothing to probe
