"""What HSDP saves across an emulated cluster's link (issue 85, item 4): fsdp over the 4 ranks of
2 emulated nodes of 2, and HSDP (--fsdp-replicas 2: each node's ranks a shard group, the two
nodes replicas), at 100mbit; the bytes each node's port carried per step, as its own
interfaces counted them (labkit.training.sync.fsdp.LinkMeter), against the model.

The model, with P the parameters' bytes: HSDP's gathers and reduce-scatter stay inside a node
(loopback), and only the all-reduce of each rank's half of the gradients across the replicas
leaves it, 2(R-1)/R = 1 of the half from each of a node's 2 ranks: P through the port each way.
fsdp's collectives are rings over the 4 ranks, which cross each node's port once each way, so
the port carries what one rank sends: its gathers' (n-1)/n = 3/4 of what they gather (the tiny
transformer's units twice, its root once: 1.84 P) and its reduce-scatter's, which gloo runs as
an all-reduce of the whole gradients (2 x 3/4 P, where NCCL's ring would send 3/4 P; the
collectives' count, a ring's, says the latter). So HSDP's port carries 1 / (0.75 x 1.84 + 1.5)
= 0.35 of fsdp's on gloo (0.47 with a ring's reduce-scatter), plus the kernel's framing (TCP/IP
headers, the other way's ACKs: measured 2%).

The tiny transformer (0.47 MB of parameters): 0.04 s of 100mbit a step for HSDP, 0.11 s for
fsdp; 3 steps, of which the two after the first are measured. In the cluster's xdist group
(tests/test_cluster.py): one cluster at a time."""
from __future__ import annotations

import json

import pytest

from helpers import labkit, needs_namespaces_mark, tiny_flags

#: the tiny language model, 3 steps (the meter reads from the end of the first), no checkpoint
LM = [*tiny_flags(dataset=None, image_size=None, model="tiny", max_steps_per_epoch=3,
                  max_val_steps=1), "--workload", "lm", "--seq-len", "32", "--no-checkpoint"]
CLUSTER = ["--emulate-nodes", 2, "--nproc", 2, "--link", "100mbit"]


def _run(tmp_path, name: str, *flags) -> dict:
    out = tmp_path / name
    p = labkit(["run", "fsdp", *LM, *CLUSTER, *flags, "--out", out], cwd=tmp_path, timeout=150)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads((out / "results_fsdp.json").read_text())


@needs_namespaces_mark()
@pytest.mark.xdist_group("cluster")  # tests/test_cluster.py's: one cluster at a time
@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_hsdp_sends_a_third_of_fsdps_bytes_across_the_link(tmp_path):
    fsdp = _run(tmp_path, "fsdp")
    hsdp = _run(tmp_path, "hsdp", "--fsdp-replicas", 2)
    port = {name: doc["epochs"][-1]["link_bytes_per_step"] for name, doc in
            (("fsdp", fsdp), ("hsdp", hsdp))}
    assert port["hsdp"]["steps"] == port["fsdp"]["steps"] == 2, port
    # HSDP: a rank reduce-scatters 1/2 of P over its 2-rank group (tests/test_fsdp.py holds it
    # to the model's size) and all-reduces its half across the replicas: P from a node's two
    counted = hsdp["epochs"][-1]["wire"]["by_phase"]
    P = 2 * counted["reduce_scatter"]["sent"][0]
    assert sum(counted["all_reduce"]["sent"][:2]) == pytest.approx(P, rel=1e-3)
    # the port: that and its framing (a step's boundary read on one rank of two: +-2%)
    for way in ("sent", "received"):
        assert 0.98 * P <= port["hsdp"][way] <= 1.08 * P, (way, port, P)
    # fsdp: a rank's gathers and gloo's all-reduce for the reduce-scatter, (3/4 of each) x 2
    phases = fsdp["epochs"][-1]["wire"]["by_phase"]
    one_rank = phases["all_gather"]["sent"][0] + 2 * phases["reduce_scatter"]["sent"][0]
    for way in ("sent", "received"):
        assert 0.98 * one_rank <= port["fsdp"][way] <= 1.08 * one_rank, (way, port, one_rank)
        ratio = port["hsdp"][way] / port["fsdp"][way]
        assert ratio == pytest.approx(P / one_rank, rel=0.05) and ratio < 0.4, (way, ratio)
