"""The cost model (labkit.costmodel): hand-computed cases, calibration on a synthetic bench file
made from known alpha and beta, validation arithmetic, the projection and the command line."""
from __future__ import annotations

import json
import math

import pytest

from labkit import costmodel
from labkit.costmodel import Link, MiB

ALPHA = 1e-5             # 10 us
BETA = 1 / 10e9          # 10 GB/s
LINK = Link("test", ALPHA, BETA)


# --- collectives, by hand ----------------------------------------------------------------------

def test_ring_allreduce_by_hand():
    # p = 4, n = 100 MB: 2*3*1e-5 + 2*1e8*3/4/1e10 = 6e-5 + 0.015
    assert costmodel.ring_allreduce_time(1e8, 4, LINK) == pytest.approx(0.01506)


def test_one_process_has_no_comm():
    assert costmodel.ring_allreduce_time(1e8, 1, LINK) == 0.0
    for method in ("ddp", "allreduce"):
        pred = costmodel.predict_step(method, 0.2, 1e8, 1, LINK)
        assert pred["comm"] == 0.0 and pred["exposed"] == 0.0 and pred["step"] == 0.2


def test_hierarchical_allreduce_by_hand():
    intra = Link("nvl", 1e-6, 1 / 400e9)
    inter = Link("net", 1e-5, 1 / 50e9)
    n = 8e8
    # inside one node it is a ring on the intra-node link
    assert costmodel.hierarchical_allreduce_time(n, 8, intra, inter) == pytest.approx(
        costmodel.ring_allreduce_time(n, 8, intra))
    # 32 GPUs = 4 nodes: 2*(7e-6 + 8e8*7/8/400e9) + 2*3*1e-5 + 2*(8e8/8)*3/4/50e9
    expected = 2 * (7e-6 + 8e8 * 7 / 8 / 400e9) + 6e-5 + 2 * 1e8 * 0.75 / 50e9
    assert costmodel.hierarchical_allreduce_time(n, 32, intra, inter) == pytest.approx(expected)


def test_central_ps_is_server_bound():
    # 4 workers, n = 100 MB: the server sends 4 copies (pull) and receives 4 (push)
    pull = 4 * ALPHA + 4 * 1e8 * BETA             # 0.04004 > a worker's 1e-5 + 0.01
    assert costmodel.server_broadcast_time(1e8, 4, LINK) == pytest.approx(0.04004)
    pred = costmodel.predict_step("ps", 0.3, 1e8, 4, LINK)
    assert pred["comm"] == pytest.approx(2 * pull)
    assert pred["exposed"] == pred["comm"]        # pull and push do not overlap compute
    assert pred["step"] == pytest.approx(0.3 + 0.08008)


def test_sharded_ps_divides_server_load():
    link = Link("bw only", 0.0, BETA)
    central = costmodel.predict_step("ps", 0.0, 1e8, 16, link)["comm"]
    for k in (2, 4, 8, 16):
        sharded = costmodel.predict_step("ps_sharded", 0.0, 1e8, 16, link, servers=k)["comm"]
        assert sharded == pytest.approx(central / k)
    # more servers than workers: a worker's own link (n per phase) is the limit
    assert costmodel.predict_step("ps_sharded", 0.0, 1e8, 4, link, servers=8)["comm"] == \
        pytest.approx(2 * 1e8 * BETA)
    # with latency: server side W*alpha + W*n/k*beta = 16e-5 + 0.04
    assert costmodel.server_reduce_time(1e8, 16, LINK, servers=4) == pytest.approx(16e-5 + 0.04)
    with pytest.raises(ValueError):
        costmodel.predict_step("ps", 0.1, 1e8, 4, LINK, servers=2)


# --- overlap ---------------------------------------------------------------------------------

def test_bucket_sizes():
    assert costmodel.bucket_sizes(100 * MiB, 25 * MiB) == [25 * MiB] * 4
    assert costmodel.bucket_sizes(60 * MiB, 25 * MiB) == [25 * MiB, 25 * MiB, 10 * MiB]
    assert costmodel.bucket_sizes(0, 25 * MiB) == []


def test_comm_inside_backward_exposes_only_the_last_bucket():
    # 4 buckets of 25 MiB on 4 processes: each ~3.9 ms, 15.7 ms in all < backward 200 ms
    pred = costmodel.predict_step("ddp", 0.3, 100 * MiB, 4, LINK)
    t_bucket = costmodel.ring_allreduce_time(25 * MiB, 4, LINK)
    assert pred["buckets"] == 4
    assert pred["comm"] == pytest.approx(4 * t_bucket)
    assert pred["exposed"] == pytest.approx(t_bucket)
    assert pred["step"] == pytest.approx(0.3 + t_bucket)


def test_comm_longer_than_backward_exposes_what_does_not_fit():
    slow = Link("slow", ALPHA, 1 / 100e6)          # 100 MB/s
    pred = costmodel.predict_step("allreduce", 0.3, 100 * MiB, 4, slow, bucket_bytes=25 * MiB)
    t_bucket = costmodel.ring_allreduce_time(25 * MiB, 4, slow)
    backward = 0.2
    # closed form for m equal buckets: max(t_b, T_comm - backward (m-1)/m)
    expected = max(t_bucket, 4 * t_bucket - backward * 3 / 4)
    assert pred["exposed"] == pytest.approx(expected)
    assert pred["exposed"] > t_bucket


def test_no_overlap_exposes_all_comm():
    pred = costmodel.predict_step("allreduce", 0.3, 100 * MiB, 4, LINK, overlap=False)
    assert pred["exposed"] == pytest.approx(pred["comm"])
    assert pred["step"] == pytest.approx(0.3 + 4 * costmodel.ring_allreduce_time(25 * MiB, 4, LINK))


def test_exposed_comm_schedule_by_hand():
    # buckets ready at 0.5 and 1.0 (backward 1.0); 0.7 s each: first ends 1.2, second 1.9
    assert costmodel.exposed_comm([1, 1], [0.7, 0.7], backward=1.0) == pytest.approx(0.9)
    assert costmodel.exposed_comm([1, 1], [0.1, 0.1], backward=1.0) == pytest.approx(0.1)
    assert costmodel.exposed_comm([1, 1], [0.1, 0.1], backward=1.0, overlap=False) == pytest.approx(0.2)


# --- the sharded step (FSDP: ZeRO-3, ZeRO-2, HSDP) ------------------------------------------

def test_all_gather_and_reduce_scatter_by_hand():
    # p = 4, n = 100 MB: 3*1e-5 + 1e8*3/4/1e10 each, half the ring all-reduce
    assert costmodel.ring_allgather_time(1e8, 4, LINK) == pytest.approx(3e-5 + 0.0075)
    assert costmodel.ring_reduce_scatter_time(1e8, 4, LINK) == pytest.approx(3e-5 + 0.0075)
    assert costmodel.ring_allgather_time(1e8, 1, LINK) == 0.0
    intra, inter = Link("nvl", 1e-6, 1 / 400e9), Link("net", 1e-5, 1 / 50e9)
    n = 8e8
    # 32 GPUs = 4 nodes of 8: across on each GPU's n/8, then inside on n
    expected = 3 * 1e-5 + (n / 8) * 3 / 4 / 50e9 + 7e-6 + n * 7 / 8 / 400e9
    assert costmodel.hierarchical_allgather_time(n, 32, intra, inter) == pytest.approx(expected)
    assert costmodel.hierarchical_reduce_scatter_time(n, 32, intra, inter) == pytest.approx(expected)
    # a reduce-scatter and an all-gather make the hierarchical all-reduce
    assert 2 * expected == pytest.approx(costmodel.hierarchical_allreduce_time(n, 32, intra, inter))
    assert costmodel.allgather_time(n, 8, inter, intra) == pytest.approx(
        costmodel.ring_allgather_time(n, 8, intra))  # one node: a ring on the intra link


@pytest.mark.parametrize("p", [2, 4, 16, 1024])
def test_zero3_sends_one_and_a_half_all_reduces_and_zero2_one(p):
    """The model's bytes a worker sends per step: ZeRO-3's two gathers and a reduce-scatter,
    (n-1)/n each, are 1.5 times the ring all-reduce's 2(n-1)/n; ZeRO-2's one gather, once. On a
    link of bandwidth only the times are in the same ratio."""
    n, link = 1e8, Link("bandwidth only", 0.0, BETA)
    ddp = costmodel.predict_step("ddp", 0.0, n, p, link, overlap=False)
    zero3 = costmodel.predict_step("fsdp", 0.0, n, p, link, overlap=False)
    zero2 = costmodel.predict_step("fsdp", 0.0, n, p, link, overlap=False, gathers=1)
    assert ddp["sent"] == pytest.approx(2 * (p - 1) / p * n)
    assert zero3["sent"] == pytest.approx(1.5 * ddp["sent"])
    assert zero2["sent"] == pytest.approx(ddp["sent"])
    assert zero3["comm"] == pytest.approx(1.5 * ddp["comm"])
    assert zero2["comm"] == pytest.approx(ddp["comm"])
    assert costmodel.sharded_bytes(n, p, 2) == pytest.approx(zero3["sent"])


def test_hsdp_sends_across_nodes_what_the_hierarchical_all_reduce_does():
    """HSDP on 64 GPUs in nodes of 8: the gathers and the reduce-scatter inside the node, the
    all-reduce of each GPU's n/8 across the 8 nodes: 2(N-1)/N n/8, the hierarchical
    all-reduce's network share, where FSDP over all 64 sends 1.5 times that across (ZeRO-3)."""
    n, g, nodes = 1e8, 8, 8
    got = costmodel.sharded_bytes(n, 64, 2, hsdp=True)
    assert got == pytest.approx(3 * (g - 1) / g * n + 2 * (nodes - 1) / nodes * n / g)
    net, nvl = Link("net", 0.0, 1 / 1e9), Link("nvl", 0.0, 0.0)  # NVLink free: the network alone
    hsdp = costmodel.predict_step("fsdp", 0.0, n, 64, net, intra=nvl, hsdp=True, overlap=False)
    fsdp = costmodel.predict_step("fsdp", 0.0, n, 64, net, intra=nvl, overlap=False)
    ddp = costmodel.predict_step("ddp", 0.0, n, 64, net, intra=nvl, overlap=False)
    assert hsdp["comm"] == pytest.approx(2 * (nodes - 1) / nodes * (n / g) / 1e9)
    assert hsdp["comm"] == pytest.approx(ddp["comm"])
    assert fsdp["comm"] == pytest.approx(1.5 * hsdp["comm"])


def test_the_sharded_schedule_by_hand():
    """2 units; forward 1 s and backward 2 s of compute per unit. Gathers of 1 s each: the
    first of forward and of backward show, the next hide behind the unit before; the last
    reduce-scatter shows: 3 s (ZeRO-3), 2 s (ZeRO-2, no backward gathers). Of 3 s each, the
    link is the step: forward gathers 0-3, 3-6; backward's 7-10, 10-13, reduce-scatters 13-16
    and 16-19, for 6 s of compute: 13 s exposed."""
    assert costmodel.sharded_exposed(1, 1, 2, forward=2, backward=4) == pytest.approx(3)
    assert costmodel.sharded_exposed(1, 1, 2, forward=2, backward=4, again=0) == pytest.approx(2)
    assert costmodel.sharded_exposed(3, 3, 2, forward=2, backward=4) == pytest.approx(13)
    assert costmodel.sharded_exposed(3, 3, 2, 2, 4, overlap=False) == pytest.approx(18)
    # one unit hides nothing: every collective's time
    assert costmodel.sharded_exposed(1, 1, 1, forward=5, backward=5) == pytest.approx(3)
    pred = costmodel.predict_step("fsdp", 0.3, 1e8, 16, LINK, units=4)
    gather, reduce = costmodel.sharded_unit_times(1e8, 16, LINK, units=4)
    assert pred["comm"] == pytest.approx(4 * (2 * gather + reduce))
    assert pred["exposed"] == pytest.approx(costmodel.sharded_exposed(gather, reduce, 4, 0.1, 0.2))


def _sharded_result(replicas: int = 1) -> "Result":
    """An fsdp run's result file as its 4 trainers wrote it: 40 MB of parameters; ZeRO-3's
    units gathered twice, its root once (1.8 gathers a step), in 3 units; HSDP's 2 replicas
    shard over 2 ranks and all-reduce their half across."""
    from labkit.core.results import Result

    n, s = 4, 4 // replicas
    params = 40e6
    phases = {"all_gather": 1.8 * (s - 1) / s * params, "reduce_scatter": (s - 1) / s * params}
    if replicas > 1:
        phases["all_reduce"] = 2 * (replicas - 1) / replicas * params / s
    by_phase = {k: {"sent": [v] * n, "received": [v] * n} for k, v in phases.items()}
    epoch = {"epoch": 1, "train_loss": 1.0, "train_accuracy": None, "train_time": 1.0,
             "train_throughput": 10.0, "avg_batch_time": 0.5, "shard_units": 3,
             "wire": {"sent_per_step": [sum(phases.values())] * n, "trainer": [True] * n,
                      "sending_steps": [1.0] * n, "by_phase": by_phase}}
    return Result.from_dict({"method": "FSDP2 (PyTorch fully_shard)", "method_key": "fsdp",
                             "config": {"fsdp_replicas": replicas}, "epochs": [epoch]})


def test_a_measured_fsdp_run_is_projected_as_the_sharded_step():
    """The report's projection (Table 11: labkit.costmodel.measured) of an fsdp run: with no
    compute-only steps it has no breakdown, and is projected at DDP's compute, from what it
    was measured to gather and reduce-scatter: its row exists, and is the sharded model's."""
    from labkit.costmodel.measured import measured_inputs, project_methods

    x = measured_inputs(_sharded_result())
    assert x["compute"] is None and x["trainers"] == 4 and x["pattern"] == "sharded"
    assert (x["params"], x["gathers"], x["units"], x["replicas"]) == (
        pytest.approx(40e6), pytest.approx(1.8), 3, 1)
    ddp = {"compute": 0.05, "round": 40e6, "period": 1.0, "sent": 60e6, "trainers": 4}
    inputs = {"ddp": ddp, "fsdp": {**x, "compute": 0.05}}
    rows = project_methods(inputs, {"ddp": False, "fsdp": False}, links=("10gbe",), gpus=(1024,))
    row = next(r for r in rows if r["method"] == "fsdp")
    link, nvl = costmodel.INTERCONNECTS["10gbe"], costmodel.INTERCONNECTS["nvlink"]
    gather = costmodel.hierarchical_allgather_time(40e6 / 3, 1024, nvl, link)
    assert row["comm"] == pytest.approx(3 * (1.8 * gather + gather))  # reduce-scatter: a gather's
    assert row["step"] > next(r for r in rows if r["method"] == "ddp")["step"]  # 1.4x the bytes
    hsdp = measured_inputs(_sharded_result(replicas=2))
    assert hsdp["replicas"] == 2 and hsdp["params"] == pytest.approx(40e6)
    rows = project_methods({"hsdp": {**hsdp, "compute": 0.05}}, {"hsdp": False},
                           links=("10gbe",), gpus=(1024,))
    assert rows[0]["comm"] < row["comm"]  # its gathers on NVLink, only its all-reduce across


def test_hsdp_on_an_emulated_link_sends_the_gradients_once_through_each_port():
    """Table 12 (an emulated cluster's flat link, no intra-node link): HSDP's shard group is a
    node's 2 ranks on loopback (free), and their all-reduces of half the gradients share the
    node's port: per unit 2 alpha + (n/u) beta, the whole n through the port a step. fsdp's
    rings over the 4 ranks: (gathers + 1) x 3/4 n through it."""
    from labkit.costmodel.measured import measured_inputs, project_one

    link = Link("100mbit", ALPHA, 8 / 100e6)
    hsdp = {**measured_inputs(_sharded_result(replicas=2)), "compute": 0.0}
    got = project_one(hsdp, 4, link, serves=False, intra=None)
    assert got["comm"] == pytest.approx(3 * 2 * ALPHA + 40e6 * link.beta)
    fsdp = {**measured_inputs(_sharded_result()), "compute": 0.0}
    flat = project_one(fsdp, 4, link, serves=False, intra=None)
    assert flat["comm"] == pytest.approx(3 * 2.8 * 3 * ALPHA + 2.8 * 0.75 * 40e6 * link.beta)


def test_unknown_method():
    with pytest.raises(ValueError, match="unknown method"):
        costmodel.predict_step("horovod", 0.1, 1e8, 4, LINK)


# --- calibration and validation on a synthetic bench file ------------------------------------

TRUE_ALPHA = 40e-6
TRUE_BETA = 1 / 2e9
GRAD = 44_700_000
SIZES = [4096, 65536, 2 ** 20, 16 * 2 ** 20, GRAD]


def ring(n, p, alpha=TRUE_ALPHA, beta=TRUE_BETA):
    return 2 * (p - 1) * alpha + 2 * n * (p - 1) / p * beta


def stat(x):
    return {"median": x, "min": x, "max": x, "iqr": 0.0, "trials": [x, x, x]}


def bench_row(method, variant, nproc, step, compute, servers=0, noise=()):
    sweep = [{"bytes": n, "time": ring(n, nproc) * (1 + (noise[i] if noise else 0))}
             for i, n in enumerate(SIZES)]
    return {"method": method, "variant": variant, "nproc": nproc, "world_size": nproc,
            "trainers": nproc - servers, "servers": servers, "batch_size": 32,
            "global_batch": 32 * (nproc - servers),
            "step_time": stat(step), "compute_time": stat(compute),
            "exposed_comm": step - compute, "throughput": 1.0, "throughput_vs_ddp": None,
            "grad_bytes": GRAD, "bytes_per_step": GRAD, "bucket_mb": 25.0, "phases": {},
            "collectives": {"all_reduce": {"bytes": GRAD, "time": ring(GRAD, nproc)},
                            "all_reduce_sweep": sweep},
            "param_spread": {"sync": 0.0, "compute_only": 0.0}}


def bench_doc(rows):
    return {"kind": "labkit.bench", "version": 1, "created": "2026-11-22 10:00:00",
            "device": "cpu", "backend": "gloo", "steps": 10, "trials": 3, "warmup": 3,
            "config": {"model": "resnet18_small", "batch_size": 32, "bucket_mb": 25.0,
                       "ps_servers": 1}, "results": rows}


def test_calibration_recovers_alpha_and_beta():
    doc = bench_doc([bench_row("ddp", "ddp", 2, 0.2, 0.15),
                     bench_row("allreduce", "allreduce", 2, 0.2, 0.16),
                     bench_row("ddp", "ddp", 4, 0.3, 0.2)])
    cal = costmodel.calibrate(doc)
    assert sorted(cal) == [2, 4]
    for p in (2, 4):
        assert cal[p]["alpha"] == pytest.approx(TRUE_ALPHA, rel=0.01)
        assert cal[p]["beta"] == pytest.approx(TRUE_BETA, rel=0.01)
        assert cal[p]["problem"] is None
    assert cal[2]["compute"] == pytest.approx(0.155)     # median of the rows at 2 processes
    assert cal[2]["points"] == 2 * len(SIZES)


def test_calibration_with_noise():
    noise = (0.01, -0.01, 0.01, -0.01, 0.01)
    doc = bench_doc([bench_row("ddp", "ddp", 4, 0.3, 0.2, noise=noise)])
    cal = costmodel.calibrate(doc)[4]
    assert cal["beta"] == pytest.approx(TRUE_BETA, rel=0.02)
    assert cal["alpha"] == pytest.approx(TRUE_ALPHA, rel=0.05)
    assert 0 < cal["fit_rms_pct"] < 1.5


def test_calibration_without_timings_says_why():
    row = bench_row("ddp", "ddp", 1, 0.1, 0.1)
    row["collectives"] = {}
    cal = costmodel.calibrate(bench_doc([row]))[1]
    assert cal["alpha"] is None and cal["beta"] is None and cal["problem"]
    check = costmodel.compare_with_bench(bench_doc([row]))[0]
    assert check["predicted"] is None and check["ok"] is None


def test_validation_error_is_computed_correctly():
    link = Link("true", TRUE_ALPHA, TRUE_BETA)
    ddp = costmodel.predict_step("ddp", 0.15, GRAD, 2, link)["step"]
    nov = costmodel.predict_step("allreduce", 0.15, GRAD, 2, link, overlap=False)["step"]
    ps = costmodel.predict_step("ps", 0.15, GRAD, 2, link)["step"]            # 3 processes, 2 trainers
    shard = costmodel.predict_step("ps_sharded", 0.15, GRAD, 2, link, servers=2)["step"]
    doc = bench_doc([
        bench_row("ddp", "ddp", 2, ddp * 1.1, 0.15),                       # measured 10% slower
        bench_row("allreduce", "allreduce no-overlap", 2, nov / 2, 0.15),  # model 2x too slow
        bench_row("ps", "ps collective", 3, ps, 0.15, servers=1),
        bench_row("ps", "ps sharded x2", 4, shard * 0.8, 0.15, servers=2),
    ])
    rows = costmodel.compare_with_bench(doc)
    by = {r["variant"]: r for r in rows}
    assert by["ddp"]["predicted"] == pytest.approx(ddp, rel=1e-3)
    assert by["ddp"]["error_pct"] == pytest.approx(100 * (1 / 1.1 - 1), rel=1e-2)   # -9.1%
    assert by["ddp"]["ok"] is True
    assert by["allreduce no-overlap"]["error_pct"] == pytest.approx(100.0, rel=1e-2)
    assert by["allreduce no-overlap"]["ok"] is False
    assert by["ps collective"]["error_pct"] == pytest.approx(0.0, abs=0.5)
    assert by["ps sharded x2"]["error_pct"] == pytest.approx(25.0, rel=1e-2)
    assert by["ps sharded x2"]["nproc"] == 4
    table = costmodel.validation_table(rows)
    assert table[1]["ok"] == "NO" and table[0]["error %"] == pytest.approx(-9.1, abs=0.1)


def test_not_a_bench_doc():
    with pytest.raises(costmodel.BenchError):
        costmodel.calibrate({"kind": "something else", "results": []})
    with pytest.raises(costmodel.BenchError):
        costmodel.compare_with_bench(bench_doc([]))


# --- projection ------------------------------------------------------------------------------

def test_projection_rows():
    rows = costmodel.project(0.1, 100 * MiB, links=["ib_ndr", "10gbe"], gpus=(8, 64, 1024), batch=64)
    assert len(rows) == 2 * 3 * len(costmodel.MODELLED_METHODS)
    for r in rows:
        assert 0 < r["efficiency"] <= 1
        assert r["throughput"] == pytest.approx(r["gpus"] * 64 / r["step"])
        assert r["efficiency"] == pytest.approx(r["compute"] / r["step"])
    central = [r["efficiency"] for r in rows if r["link"] == "10gbe" and r["method"] == "ps"]
    assert central == sorted(central, reverse=True) and central[-1] < 0.01  # the server link
    ddp = {(r["link"], r["gpus"]): r for r in rows if r["method"] == "ddp"}
    assert ddp[("ib_ndr", 1024)]["efficiency"] > ddp[("10gbe", 1024)]["efficiency"]
    wide = costmodel.projection_table(rows, wide=True)
    assert len(wide) == 6 and "ddp eff %" in wide[0]
    assert set(costmodel.projection_table(rows)[0]) == {"link", "GPUs", "method", "step ms",
                                                    "exposed ms", "img/s", "eff %"}


def test_interconnect_table():
    assert costmodel.INTERCONNECTS["nvlink"].bandwidth == pytest.approx(450e9)
    assert costmodel.INTERCONNECTS["ib_ndr"].bandwidth == pytest.approx(50e9)
    assert costmodel.INTERCONNECTS["10gbe"].bandwidth == pytest.approx(1.25e9)
    assert all(link.source for link in costmodel.INTERCONNECTS.values())


def test_plot_projection(tmp_path):
    rows = costmodel.project(0.1, 100 * MiB, gpus=(8, 16, 32), batch=32)
    path = costmodel.plot_projection(rows, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 10_000 and path.endswith("p.png")


def test_formulas_markdown():
    md = costmodel.formulas_markdown()
    # plain Markdown for an offline report: no LaTeX, no heading (the report adds its own)
    assert "$" not in md and "\\" not in md and not md.lstrip().startswith("#")
    ring = next(line for line in md.splitlines() if line.startswith("T_ar(n, p) ="))
    for term in ("2(p−1)·α", "(p−1)/p", "n·β"):
        assert term in ring
    assert md.count("```") % 2 == 0 and md.count("```") >= 8
    for needle in ("T_exposed = max(t_b, T_comm − (m−1)/m · T_b)", "⌈p/g⌉", "≈", "BytePS",
                   "Thakur", "Calibration", "Not modelled"):
        assert needle in md


# --- command line ----------------------------------------------------------------------------

def one_error_line(capsys, *needles):
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("labkit model: error: "), err
    for needle in needles:
        assert needle in lines[0]


def test_cli_missing_file(tmp_path, capsys):
    assert costmodel.main([str(tmp_path / "nope.json")]) == 2
    one_error_line(capsys, "nope.json")


def test_cli_not_json(tmp_path, capsys):
    (tmp_path / "b.json").write_text("not json")
    assert costmodel.main([str(tmp_path / "b.json")]) == 2
    one_error_line(capsys, "not JSON")


def test_cli_not_a_bench_file(tmp_path, capsys):
    (tmp_path / "b.json").write_text(json.dumps({"kind": "labkit.results", "results": []}))
    assert costmodel.main([str(tmp_path / "b.json")]) == 2
    one_error_line(capsys, "not a labkit bench file")
    assert not (tmp_path / "projection.json").exists()


def test_cli_bad_flags(tmp_path, capsys):
    (tmp_path / "b.json").write_text(json.dumps(bench_doc([bench_row("ddp", "ddp", 2, .2, .15)])))
    assert costmodel.main([str(tmp_path / "b.json"), "--batch", "0"]) == 2
    one_error_line(capsys, "--batch")
    with pytest.raises(SystemExit) as e:
        costmodel.main([str(tmp_path / "b.json"), "--compute-ms", "fast"])
    assert e.value.code == 2
    one_error_line(capsys, "--compute-ms")


def test_cli_writes_plot_and_json(tmp_path, capsys):
    doc = bench_doc([bench_row("ddp", "ddp", 2, 0.2, 0.15),
                     bench_row("ps", "ps collective", 3, 0.5, 0.15, servers=1)])
    (tmp_path / "bench.json").write_text(json.dumps(doc))
    out = tmp_path / "model"
    assert costmodel.main([str(tmp_path / "bench.json"), "--compute-ms", "50", "--grad-mb", "100",
                       "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "Validation" in text and "Projection" in text and "ddp eff %" in text
    saved = json.loads((out / "projection.json").read_text())
    assert saved["inputs"]["compute"] == pytest.approx(0.05)
    assert saved["inputs"]["grad_bytes"] == 100 * MiB
    assert saved["inputs"]["batch"] == 32
    assert len(saved["validation"]) == 2 and saved["projection"]
    assert math.isclose(saved["calibration"][0]["alpha"], TRUE_ALPHA, rel_tol=0.01)
    assert (out / "projection.png").stat().st_size > 10_000
