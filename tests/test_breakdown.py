"""Where the time goes: the breakdown of a step for every method (DDP's communication from its
reducer's statistics or its timing hook, and the two compared), overlap with its interval,
the rank the others waited for, and time to accuracy (labkit.core.breakdown and the
report that shows them)."""
import shutil

import numpy as np
import pytest
import torch
from scipy import stats as sps

from helpers import check_ok, load_json, tiny_flags
from warm import warm_run
from labkit.core import breakdown
from labkit.core.results import Result
from labkit import report
from labkit.report import load_files
from labkit.core.methods import SHORT
from labkit.training.instruments.timers import StepParts, busy_figures

# enough steady-state steps in one epoch for a batch-means interval that a busy 2-core machine
# does not swamp: 41 steps in 6 blocks of about 7 (with 12 steps in 4 blocks of 3, the overlap
# interval of a full suite run once reached down to 0). On a slow CPU the steps, not the
# launches, are what these runs cost, so TINY's batch of 8 at the digits' own 8x8 pixels: the
# statistics ask for many steps, not large ones (the overlap test's hidden communication is then
# most of each step's, far above its interval).
# 6 calibration steps (the default is 4): these runs weigh each rank's compute-only time against
# its steps
STEPS = tiny_flags(max_steps_per_epoch=44, calibrate_steps=6)


# ------------------------------------------------------------------ the definitions, by hand
def result(epochs: list[dict], **top) -> Result:
    """A result of ``epochs`` (each given the guide's figures, which these tests do not read,
    and its number where it has none) and the top-level entries ``top``."""
    guide = {"train_loss": 1.0, "train_accuracy": 50.0, "train_time": 1.0, "train_throughput": 100.0}
    return Result.from_dict({"method": "x", "epochs": [{"epoch": i + 1, **guide, **e}
                                                       for i, e in enumerate(epochs)], **top})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (CUDA events)")
def test_a_gpus_marks_reuse_their_events_and_still_tile_the_step():
    """On a GPU the marks are CUDA events from one pool: an epoch's events are recorded again in
    the next once their times are read, and the parts still add up to each step."""
    from labkit.training.instruments.timers import StepClock, events

    dev = torch.device("cuda")
    parts, clock = StepParts(dev), StepClock(dev)
    pool = events(dev)
    assert parts.events is clock.events is pool  # one pool per device

    def epoch():
        for _ in range(3):
            parts.begin()
            clock.mark()
            torch.cuda._sleep(2_000_000)  # about a millisecond of device work, no host wait
            parts.mark("compute")
        clock.mark()
        parts.close()
        return parts.take()["parts"], clock.durations()

    got = [epoch()]
    first = {id(e) for e in pool.free}
    got.append(epoch())
    assert {id(e) for e in pool.free} == first and len(first) >= 11  # 3 x 2 marks, close, 4 ends
    for p, steps in got:
        assert len(steps) == 3 and all(t > 1e-4 for t in p["compute"])
        totals = [sum(p[k][i] for k in p) for i in range(3)]
        assert totals == pytest.approx(steps, rel=0.01, abs=5e-5)


def test_split_adds_the_parts_up_to_the_step():
    parts = {"data": [1.0], "pull": [2.0], "compute": [10.0], "sync": [3.0], "optimizer": [0.5],
             "other": [0.25]}
    s = breakdown.split(parts, compute_only=8.0, busy=[9.0], server=[1.5])
    # synchronisation added 2.0 to forward+backward, plus 2.0 pull and 3.0 sync waits = 7.0,
    # of which the trainers spent 1.5 waiting for the server's update
    assert s["compute"][0] == 8.0 and s["exposed"][0] == 5.5 and s["optimizer"][0] == 2.0
    assert s["hidden"][0] == 3.5  # 9.0 of collectives running, 5.5 of them exposed
    assert sum(s[k][0] for k in breakdown.ORDER) == sum(v[0] for v in parts.values())
    # a compute-only step slower than the synchronised one: compute is capped, nothing exposed
    s = breakdown.split({**parts, "pull": [0.0], "sync": [0.0]}, compute_only=12.0)
    assert s["compute"][0] == 10.0 and s["exposed"][0] == 0.0 and np.isnan(s["hidden"][0])


def test_a_step_reported_later_and_one_without_a_figure():
    """A method that reports a step's busy time itself (DDP's reducer: during the next step):
    the figure lands on the step it was handed for, a step never given one has NaN (None in
    the result file), and the breakdown's hidden time is over the steps that have one."""
    parts = StepParts(torch.device("cpu"))
    reporters = []
    for _ in range(3):
        parts.begin()
        parts.mark("compute")
        reporters.append(parts.reporter())
    reporters[0](0.25)
    reporters[1](0.5)  # the last step's figure never comes
    parts.close()
    busy = parts.take()["busy"]
    assert busy[:2] == [0.25, 0.5] and np.isnan(busy[2])
    assert busy_figures(torch.tensor(busy)) == [0.25, 0.5, None]
    assert busy_figures(torch.zeros(3)) == []  # nothing timed
    reporters[0](9.0)  # once taken, a late figure changes nothing
    assert parts.take()["busy"] == []
    zeros = [0.0] * 3
    epoch = {"step_parts": {"data": zeros, "pull": zeros, "compute": [1.0] * 3, "sync": zeros,
                            "optimizer": zeros, "other": zeros},
             "comm_busy_times": [0.25, 0.5, None], "avg_batch_time": 1.0}
    b = breakdown.of_result(result([epoch], calibration={"parts": {"compute": [1.0]}}))
    assert b.hidden == pytest.approx(0.375) and b.parts["exposed"] == 0.0


def test_ddp_in_one_process_reads_no_statistics():
    """At world size 1 DDP is not wrapped (no reducer): its step reads nothing and trains."""
    from labkit.core.config import TrainConfig
    from labkit.training.dist import DistContext
    from labkit.training.sync.ddp import DDPStrategy

    s = DDPStrategy(TrainConfig(), DistContext(0, 1, 0, 1, "gloo", torch.device("cpu")))
    model = s.setup(torch.nn.Linear(2, 2))
    before = model.weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(3, 2)).sum().backward()
    s.step(opt)
    assert s.stats is None and not torch.equal(model.weight, before)


def test_a_phase_is_a_profiler_range_only_while_a_profiler_records():
    """labkit's phase names (labkit.forward, ...) are record_function ranges in a torch.profiler
    trace; with no profiler recording, none is opened (each costs microseconds a step)."""
    from labkit.training.instruments.timers import PhaseTimer, label

    timer = PhaseTimer(torch.device("cpu"))
    with torch.profiler.profile() as prof:
        with label("labkit.forward"):
            torch.ones(2) + 1
        with timer("pull"):
            pass
    assert {"labkit.forward", "labkit.pull"} <= {e.name for e in prof.events()}
    assert not isinstance(label("labkit.forward"), torch.profiler.record_function)
    with timer("pull"):  # and the timer still times
        pass
    assert set(timer.pop()) == {"pull"}


def test_a_reducer_timing_one_step_in_k_gives_each_figure_to_its_own_step(tmp_path):
    """On a GPU the reducer times one synchronised step in SAMPLE_EVERY["cuda"] (a timed step
    makes the host wait at the next forward). A real reducer (one gloo process) timing one
    step in 4 times steps 1-10 and then every 4th (PyTorch's rule, counting steps from 1); each
    figure lands on the step it timed, and the steps it did not time have none."""
    from torch.distributed import FileStore, destroy_process_group, init_process_group
    from torch.nn.parallel import DistributedDataParallel
    from labkit.training.sync.ddp import SAMPLE_EVERY, ReducerStats

    assert SAMPLE_EVERY["cpu"] == 1 and SAMPLE_EVERY["cuda"] > 1
    init_process_group("gloo", store=FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        ddp = DistributedDataParallel(torch.nn.Linear(64, 64))
        stats, parts = ReducerStats(ddp, every=4), StepParts(torch.device("cpu"))
        for _ in range(24):
            parts.begin()
            ddp(torch.ones(8, 64)).sum().backward()
            parts.mark("compute")
            stats.read(parts)
        parts.close()
        busy = parts.take()["busy"]
    finally:
        destroy_process_group()
    timed = [n for n in range(1, 24) if n <= 10 or n % 4 == 0]  # the 24th's figure never comes
    assert [i + 1 for i, b in enumerate(busy) if not np.isnan(b)] == timed, busy
    assert all(b > 0 for b in busy if not np.isnan(b))


def test_time_comm_modes_and_the_older_spellings():
    """--time-comm stats|hook|off; --no-time-comm (the flag before the modes) is off, and a
    config recorded then (a bool: True was the hook) reads as the mode it ran."""
    from labkit.core import params
    from labkit.core.config import TrainConfig, build_parser, from_args

    p = build_parser()
    got = {tuple(a): from_args(p.parse_args(a)).time_comm
           for a in ([], ["--time-comm", "hook"], ["--no-time-comm"], ["--time-comm", "off"])}
    assert list(got.values()) == ["stats", "hook", "off", "off"]
    assert params.to_flags(TrainConfig(time_comm="off")) == ["--time-comm", "off"]
    assert TrainConfig(time_comm=True).time_comm == "hook"
    old = TrainConfig(time_comm=False)
    assert old.time_comm == "off" and not old.times_comm


def test_overlap_interval_and_who_arrived_last():
    rng = np.random.default_rng(0)
    hidden = [rng.normal(3.0, 0.3, 16)]
    total = [h + rng.normal(3.0, 0.3, 16) for h in hidden]
    iv = breakdown.ratio_interval(hidden, total)
    assert iv.available and iv.low < 0.5 < iv.high and 0.4 < iv.value < 0.6
    none = breakdown.ratio_interval([np.zeros(16)], total)
    assert none.value == 0.0 and none.low == 0.0

    # held in compute + pull + sync per step, against each rank's own compute-only time
    doc = result([{"sync_held": {"ranks": [0, 1, 2], "times": [[15, 15, 16, 15], [10, 11, 10, 10],
                                                               [14, 10.5, 13, 14]]}}],
                 calibration={"rank_compute": [10.0, 10.0, 10.0]})
    w = breakdown.waits(doc)
    assert w.last == 1 and w.last_share == [0.0, 0.75, 0.25] and w.mean_wait[0] == 5.25


@pytest.mark.parametrize("ranks, last, steps, held_back", [
    (2, 40, 41, True),    # two trainers, one step out of line: still the straggler
    (2, 27, 41, True),    # 27 of 41: p = 0.03 against a fair coin
    (2, 26, 41, False),   # 26 of 41: p = 0.06, within what chance gives
    (2, 3, 3, True),      # every step: twice the even share
    (3, 20, 30, True),    # twice a third
    (3, 18, 30, True),    # 0.6, under twice a third, but p = 0.002 against a third
    (3, 7, 12, False),    # 0.58 of 12 steps: p = 0.07
    (4, 22, 41, True),    # over half, which is twice a quarter
    (4, 20, 41, False),   # not over half
])
def test_a_straggler_is_last_more_often_than_chance(ranks, last, steps, held_back):
    """Waits.consistent: a rank held the others back when it was last in over half the steps
    and in at least twice its even share (1/n) or more often than chance (a one-sided binomial
    test against 1/n)."""
    rest = (steps - last) / (ranks - 1) / steps
    w = breakdown.Waits(list(range(ranks)), [0.0] * ranks, [last / steps] + [rest] * (ranks - 1), steps)
    assert w.last == 0 and w.consistent is held_back


def test_time_to_accuracy_and_not_reached():
    doc = result([{"epoch": i + 1, "val_accuracy": a, "train_time": 2.0, "val_time": 0.5,
                   "steps": 10} for i, a in enumerate([50.0, 80.0, 90.0])])
    r = breakdown.time_to_accuracy(doc, 85.0)
    assert (r.seconds, r.steps, r.epoch) == (7.5, 30, 3)
    assert not breakdown.time_to_accuracy(doc, 95.0).reached
    assert breakdown.target_accuracy({"a": doc}) == pytest.approx(0.95 * 90.0)
    assert breakdown.target_accuracy({"a": doc}, 70.0) == 70.0


# ------------------------------------------------------------------ real runs
def _above_zero(d: np.ndarray) -> bool:
    """Whether the 95% t-interval of the mean of paired per-step differences ``d`` (two
    figures of the same steps of one run) lies above 0."""
    return d.mean() - sps.t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / np.sqrt(len(d)) > 0


@pytest.mark.slow
def test_no_overlap_hides_nothing_and_overlap_hides_some(tmp_path):
    """The same data, allreduce with and without overlapping backward: with --no-overlap every
    bucket starts after backward, so nothing is hidden; with overlap some communication runs
    behind backward, and the interval says so. Each run against itself, step by step: without
    overlap every step's collectives ran inside that step's sync wait, so none of their time
    is hidden (exactly 0, no slack); with it, the collectives outlast the sync wait, and the
    overlap's interval over the run's own steps is above 0. Two epochs (82 steady-state steps):
    with one (41 steps in 6 blocks) a loaded CI machine once gave an overlap whose interval
    reached down to 0."""
    got, epochs = {}, {}
    for name, extra in (("overlap", []), ("no_overlap", ["--no-overlap"])):
        out = tmp_path / name
        check_ok(warm_run(2, STEPS + ["--epochs", "2", "--method", "allreduce", "--bucket-mb", "1",
                                      *extra, "--out", str(out)], cwd=tmp_path))
        doc = load_json(out / "results_all_reduce.json")
        got[name], epochs[name] = breakdown.of_result(Result.from_dict(doc)), doc["epochs"]
        assert len(epochs[name]) == 2
    busy = {n: np.concatenate([np.asarray(e["comm_busy_times"], dtype=float) for e in es])
            for n, es in epochs.items()}
    sync = {n: np.concatenate([np.asarray(e["step_parts"]["sync"], dtype=float) for e in es])
            for n, es in epochs.items()}
    off, on = got["no_overlap"].overlap, got["overlap"].overlap
    assert (busy["no_overlap"] <= sync["no_overlap"]).all(), busy["no_overlap"] - sync["no_overlap"]
    assert off.value == 0.0 and off.high == 0.0, off
    d = busy["overlap"] - sync["overlap"]  # paired, per step: communication outside the wait
    assert _above_zero(d), d
    assert on.available and on.low > 0, on
    for b in got.values():  # the parts add up to the measured step
        assert b.total == pytest.approx(b.measured, rel=0.05)


# the run under --time-comm off also has rank 1 sleep 0.1 s before every step
# (tests/hooks: LABKIT_TEST_LATE), so that rank 0 waits for it at every synchronisation point:
# lateness, like timing, changes no parameter, and the same run shows who the others waited for
LATE = {"LABKIT_TEST_LATE": "1:0.1"}


# session scope: built once although conftest's LONGEST_FIRST starts test_timing_ddp_changes_no_
# parameter before the module's other tests (a module fixture was torn down and built again
# when they ran without xdist)
@pytest.fixture(scope="session")
def ddp_timed(tmp_path_factory) -> dict:
    """The same DDP training under --time-comm stats, hook and off (off with rank 1 late,
    LATE): {mode: output folder}. STEPS' 41 steady-state steps, so that the modes' figures can
    be compared with their own step-to-step spread."""
    base = tmp_path_factory.mktemp("time_comm")
    out = {}
    for mode in ("stats", "hook", "off"):
        out[mode] = base / mode
        flags = ["--no-time-comm"] if mode == "off" else ["--time-comm", mode]  # the old alias
        check_ok(warm_run(2, STEPS + ["--method", "ddp", "--no-checkpoint", *flags,
                                      "--out", str(out[mode])], cwd=base,
                          env=LATE if mode == "off" else None))
    return out


@pytest.mark.slow
@pytest.mark.xdist_group("ddp_timed")  # its three runs, built once on one worker
def test_a_late_rank_is_named_as_the_one_the_others_waited_for(ddp_timed):
    out = ddp_timed["off"]  # rank 1 slept 0.1 s before every step
    doc = load_json(out / "results_baseline_ddp.json")
    w = breakdown.waits(Result.from_dict(doc))
    assert w.last == 1 and w.last_share[1] > 0.8, w
    # rank 0 waited for rank 1, step by step: the per-step differences of the two ranks' waits
    # (each held time less that rank's own compute-only forward + backward, measured in this
    # run) have a 95% interval above 0
    [epoch] = doc["epochs"]
    held = np.asarray(epoch["sync_held"]["times"], dtype=float)
    alone = np.asarray(doc["calibration"]["rank_compute"], dtype=float)[epoch["sync_held"]["ranks"]]
    wait = np.maximum(0.0, held - alone[:, None])
    assert wait.mean(axis=1).tolist() == pytest.approx(w.mean_wait)
    d = wait[0] - wait[1]
    assert _above_zero(d), d
    text = report.text_report(load_files([str(out)]))
    assert "rank 1 arrived last at the synchronisation point" in text
    # DDP's communication is a number in Table 2 now, not "inside PyTorch" (the default,
    # --time-comm stats)
    ddp_row = next(r for r in report.communication_rows(load_files([str(ddp_timed["stats"])]))
                   if r["Method"] == SHORT["ddp"])
    assert isinstance(ddp_row["Total comm time (ms)"], float) and ddp_row["Total comm time (ms)"] > 0


@pytest.mark.slow
@pytest.mark.xdist_group("ddp_timed")  # its three runs, built once on one worker
def test_timing_ddp_changes_no_parameter(ddp_timed):
    """DDP's built-in path with its reducer's statistics read (stats, the default), the timing
    hook (hook) and nothing timed (off, with a late rank) end with the same parameters, bit for
    bit."""
    models = {m: torch.load(d / "final_model.pt", weights_only=True) for m, d in ddp_timed.items()}
    for mode in ("stats", "hook"):
        assert models[mode].keys() == models["off"].keys()
        for k in models["off"]:
            assert torch.equal(models[mode][k], models["off"][k]), (mode, k)
    epochs = {m: load_json(d / "results_baseline_ddp.json")["epochs"][0]
              for m, d in ddp_timed.items()}
    assert "comm_busy_times" not in epochs["off"]
    # the reducer gives a step's figures during the next step: the epoch's last has none
    assert epochs["stats"]["comm_busy_times"][-1] is None
    assert all(t > 0 for t in epochs["stats"]["comm_busy_times"][:-1])
    assert all(t > 0 for t in epochs["hook"]["comm_busy_times"])
    # the bytes on the wire: counted per bucket by the hook, from the gradients without it
    for key in ("sent_per_step", "received_per_step"):
        for mode in ("stats", "hook"):
            assert epochs[mode]["wire"][key] == pytest.approx(epochs["off"]["wire"][key], rel=1e-6)
        assert min(epochs["off"]["wire"][key]) > 0, key


def _share(epoch: dict, key: str) -> np.ndarray:
    """Per step with a figure: ``key``'s communication time over the step's own forward +
    backward (a shared machine's load slows both, so the share drifts far less between runs
    than either time)."""
    busy = np.asarray([np.nan if x is None else x for x in epoch[key]], dtype=float)
    share = busy / np.asarray(epoch["step_parts"]["compute"], dtype=float)
    return share[np.isfinite(share)]


@pytest.mark.slow
@pytest.mark.xdist_group("ddp_timed")  # its three runs, built once on one worker
def test_ddp_stats_and_hook_agree_as_documented(ddp_timed):
    """docs/where-the-time-goes.md, "Two ways to time DDP": the reducer's figure (stats) is the
    span from the first bucket's all-reduce to the end of the last, gaps between buckets and
    the gradients' write-back included; the hook's is the union of the buckets' intervals,
    inside that span. The hook run also reads the reducer, so on the same steps the reducer's
    figure is never below the hook's, nor the hidden time taken from it. Run against run, the
    stats run's figure and the hook run's reducer figure agree, as a share of each step's
    forward + backward, within issue 41's 10% (or 3 standard errors of their difference from
    the steps' spread, if that is wider: between runs on a shared machine the share moved by
    up to 3.6 of them, 7%). Exposed communication is not compared run against run: it is
    taken against compute-only steps run after the epoch, which a shared machine's load moved
    by up to 60 ms between runs."""
    docs = {m: load_json(ddp_timed[m] / "results_baseline_ddp.json") for m in ("stats", "hook")}
    epochs = {m: d["epochs"][0] for m, d in docs.items()}
    for mode, e in epochs.items():
        # either figure lies inside the step's own forward + backward (the reducer's finalize
        # runs in backward's last callback): the reducer's, read a step late, lands on its step
        for busy, fb in zip(e["comm_busy_times"], e["step_parts"]["compute"]):
            assert busy is None or busy <= fb + 1e-4, (mode, busy, fb)
    e = epochs["hook"]
    pairs = [(r, h) for r, h in zip(e["comm_reducer_times"], e["comm_busy_times"]) if r is not None]
    assert len(pairs) == len(e["comm_busy_times"]) - 1  # all but the epoch's last step
    for reducer, hook in pairs:  # 0.1 ms: two clocks (the reducer's and perf_counter)
        assert reducer >= hook - 1e-4, (reducer, hook)
    compute_only = float(np.mean(docs["hook"]["calibration"]["parts"]["compute"]))
    hidden = {k: breakdown.split(e["step_parts"], compute_only, e[k])["hidden"][:-1]
              for k in ("comm_reducer_times", "comm_busy_times")}
    assert (hidden["comm_reducer_times"] >= hidden["comm_busy_times"] - 1e-4).all()
    stats, reducer = _share(epochs["stats"], "comm_busy_times"), _share(e, "comm_reducer_times")
    se = np.hypot(stats.std(ddof=1) / np.sqrt(len(stats)),
                  reducer.std(ddof=1) / np.sqrt(len(reducer)))
    tol = max(0.10 * (stats.mean() + reducer.mean()) / 2, 3 * se)
    assert abs(stats.mean() - reducer.mean()) <= tol, (stats.mean(), reducer.mean(), se)


def test_table_1_says_not_reached(tmp_path, ddp_run):
    shutil.copytree(ddp_run, tmp_path / "run")
    res = load_files([str(tmp_path / "run")])
    res.target_accuracy = 100.0
    row = report.comparison_rows(res)[0]
    assert row["Time to target (s)"] == "not reached" and row["Steps to target"] == "not reached"
    text = report.text_report(res)
    assert "not reached" in text and "validation accuracy first reaching 100.00%" in text
    res.target_accuracy = 1.0
    row = report.comparison_rows(res)[0]
    assert row["Time to target (s)"] > 0 and row["Steps to target"] == 5
