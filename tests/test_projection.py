"""Each method projected to large machines from what it was measured to send (issue 37, item
6: labkit.costmodel.measured and the report's Table 11). The inputs are built here, so
what the projection must say follows from the alpha-beta formulas written out below, not from
the code under test."""
from __future__ import annotations

import math

import pytest

from labkit.costmodel import INTERCONNECTS
from labkit.costmodel.measured import (break_even, project_one, project_methods,
                                                round_bytes, trainers_wire, where_it_wins)
from labkit.core.results import Result

MB = 1e6


def test_the_round_is_read_back_from_the_ring_arithmetic():
    # 4 trainers all-reducing 40 MB every step send 2 * 3/4 * 40 MB = 60 MB each
    assert round_bytes(60 * MB, 1.0, 4) == pytest.approx(40 * MB)
    # ... and every 8th step only: 7.5 MB per step on average, 40 MB per round
    assert round_bytes(7.5 * MB, 1 / 8, 4) == pytest.approx(40 * MB)
    assert round_bytes(0.0, 1.0, 4) == 0.0 and round_bytes(5 * MB, 1.0, 1) == 0.0
    guide = {"epoch": 1, "train_loss": 1.0, "train_accuracy": 50.0, "train_time": 1.0,
             "train_throughput": 100.0}  # the keys every epoch of a result file has
    doc = Result.from_dict({"method": "Baseline DDP", "epochs": [{**guide, "wire": {
        "sent_per_step": [0.0, 6.0, 8.0], "trainer": [False, True, True],
        "sending_steps": [0.0, 0.5, 0.25]}}]})
    assert trainers_wire(doc) == (7.0, 0.375, 2)  # the trainers' mean; the server left out


def test_local_sgd_pays_one_rounds_latency_per_round_not_per_step():
    """On 10 GbE at 1024 GPUs latency dominates a small model: a method that all-reduces the
    whole model every 8 steps must be charged one round per 8 steps, not 8 small rounds."""
    link, intra = INTERCONNECTS["10gbe"], INTERCONNECTS["nvlink"]
    every = {"compute": 0.1, "round": 20 * MB, "period": 1.0, "sent": 0.0}
    local = {"compute": 0.1, "round": 20 * MB, "period": 8.0, "sent": 0.0}
    a = project_one(every, 1024, link, serves=False)
    b = project_one(local, 1024, link, serves=False)
    # the hierarchical all-reduce of the model's formulas: inside 8-GPU nodes on NVLink, then
    # a ring of 128 nodes on 10 GbE carrying 1/8 of the bytes
    g, nodes, n = 8, 128, 20 * MB
    inside = 2 * ((g - 1) * intra.alpha + n * (g - 1) / g * intra.beta)
    across = 2 * (nodes - 1) * link.alpha + 2 * (n / g) * (nodes - 1) / nodes * link.beta
    assert a["comm"] == pytest.approx(inside + across, rel=1e-6)
    assert b["comm"] == pytest.approx(a["comm"] / 8, rel=1e-6) and b["exposed"] == b["comm"]
    assert b["step"] < a["step"]


def test_where_a_method_that_sends_less_starts_to_win():
    ddp = {"compute": 0.05, "round": 40 * MB, "period": 1.0, "sent": 0.0}
    eighth = {"compute": 0.05, "round": 5 * MB, "period": 1.0, "sent": 0.0}
    rows = project_methods({"ddp": ddp, "small": eighth}, {"ddp": False, "small": False},
                           links=("nvlink", "10gbe"), gpus=(8, 64, 1024))
    wins = where_it_wins(rows, "small")
    # on NVLink inside one node 40 MB take ~0.16 ms, hidden behind backward: nothing to gain
    assert wins["nvlink"] is None
    # on 10 GbE, crossing nodes, 40 MB cost ~2 x 5 MB x 7/8 / 1.25 GB/s = 7 ms: a win
    assert wins["10gbe"] == 64
    step = {(r["method"], r["link"], r["gpus"]): r for r in rows}
    assert step[("small", "10gbe", 64)]["step"] < step[("ddp", "10gbe", 64)]["step"]
    assert math.isclose(step[("small", "nvlink", 8)]["step"], step[("ddp", "nvlink", 8)]["step"],
                        rel_tol=0.01)


def test_below_which_compute_time_a_method_that_sends_less_wins():
    """DDP hides its all-reduce behind backward (2/3 of the compute); a method sending an
    eighth wins only while DDP's exposed part is large, i.e. below some compute time."""
    link = INTERCONNECTS["10gbe"]
    ddp = {"compute": 0.0, "round": 40 * MB, "period": 1.0, "sent": 0.0}
    eighth = {**ddp, "round": 5 * MB}
    lo, hi = break_even(eighth, ddp, 1024, link, serves=False)
    assert lo == pytest.approx(1e-4)  # the shortest step searched: communication is all of it

    def steps(c):
        return (project_one({**eighth, "compute": c}, 1024, link, serves=False)["step"],
                project_one({**ddp, "compute": c}, 1024, link, serves=False)["step"])
    a, b = steps(0.9 * hi)
    assert a < 0.99 * b
    a, b = steps(2 * hi)
    assert a >= 0.99 * b  # past it, DDP's overlap hides what the smaller method saves
    # DDP's two 25 MiB buckets across 128 nodes on 10 GbE: ~13 ms of latency each plus ~4 ms of
    # bytes; the last bucket is never hidden, so what the eighth saves (~a few ms) stays above
    # 1% of the step until the step is a few hundred ms long
    assert 0.005 < hi < 1.0
    assert break_even(ddp, ddp, 1024, link, serves=False) is None  # the same bytes never win


def test_the_result_file_says_in_how_many_steps_a_rank_sent():
    from labkit.training.sync.collectives import Wire, wire_figures

    talks, every = Wire(), Wire()
    for step in range(1, 17):
        every.add("comm", 10.0, 10.0, step)
        if step % 8 == 0:  # local SGD with H = 8: one round every 8th step
            talks.add("comm", 80.0, 80.0, step)
    w = wire_figures([{"steps": talks.take(), "trainer": True},
                      {"steps": every.take(), "trainer": True}], 16)
    assert w["sending_steps"] == [1 / 8, 1.0] and w["sent_per_step"] == [10.0, 10.0]
    assert round_bytes(w["sent_per_step"][0], w["sending_steps"][0], 2) == pytest.approx(80.0)


def test_table_12_sets_the_models_step_on_the_runs_link_beside_the_measured_one(experiment):
    """Issue 57, item 5: for a run on an emulated link, Table 11's model of each method's step
    on that link beside the step it measured, the error per method. The session's experiment
    (ddp, allreduce, ps on 2 ranks) stands in for a run on 2 nodes x 1 rank at 100mbit: the
    link is put into its results here, so the prediction follows from the ring arithmetic
    below and the measured step from its own breakdown."""
    from labkit.core import breakdown
    from labkit.report.load import load_run
    from labkit.report.projection import TCP_ALPHA, inputs_of, on_link, on_link_text

    res = load_run(experiment.run)
    assert on_link(res) is None  # no emulated link: no Table 12
    link = {"nodes": 2, "ranks_per_node": 1, "link": "100mbit", "rate_bit": 100_000_000,
            "delay_us": 0, "goodput_mbit": [{"up": 90.0, "down": 94.0}, {"up": 92.0, "down": 93.0}]}
    for d in res.ok.values():
        d.link = link
    inputs = inputs_of(res)
    got = on_link(res)
    assert got is not None
    rows = {r["method"]: r for r in got[1]}
    assert set(rows) == set(inputs) >= {"ddp", "ps"}
    x, p = inputs["ddp"], inputs["ddp"]["trainers"]
    assert x["round"] < 25 * 2 ** 20  # one DDP bucket: all of its all-reduce is exposed
    for bit, key in ((100e6, "set"), (93e6, "goodput")):  # the goodput: the median of the four
        ring = 2 * (p - 1) * TCP_ALPHA + 2 * (p - 1) / p * x["round"] * 8 / bit
        assert rows["ddp"][key] == pytest.approx(x["compute"] + ring, rel=1e-6)
    measured = breakdown.of_result(res.docs["ddp"]).measured
    assert rows["ddp"]["measured"] == pytest.approx(measured)
    assert rows["ddp"]["set_error"] == pytest.approx(100 * (rows["ddp"]["set"] / measured - 1))
    # the server's port carries every worker's pull and push of what a worker sent
    ps = inputs["ps"]
    assert rows["ps"]["set"] > ps["compute"] + 2 * ps["trainers"] * ps["sent"] * 8 / 100e6
    text = "\n".join(on_link_text(res))
    assert "Table 12" in text and "100mbit" in text and f"{rows['ps']['set_error']:+.0f}%" in text
