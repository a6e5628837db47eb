"""`labkit bench` on an emulated cluster (issue 57): every job of the bench runs on the nodes, the
alpha-beta bandwidth fitted to its all-reduce sweep recovers the link (within 10% of the set
rate or of the goodput its probe measured, at 100mbit), and the document, bench.txt and the summary lines state the link; bad cluster
input is one line, exit 2, nothing created. The slow test shares tests/test_cluster.py's
xdist group and its skip condition (test modules import from helpers only, so the few lines
are repeated here): the cluster's tests run one after the other."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import pytest

from helpers import BENCH_FLAGS, labkit, needs_namespaces_mark
from labkit.bench.bench_view import link_fit_line, link_lines
from labkit.costmodel.calibrate import BURST_MARGIN, calibrate, link_fit

pytestmark = pytest.mark.xdist_group("cluster")


needs_namespaces = needs_namespaces_mark()  # tests/helpers.py: why it cannot, where it cannot


def processes(marker: str) -> list[str]:
    """`ps`'s lines whose command line holds ``marker``."""
    out = subprocess.run(["ps", "-ww", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    return [l for l in out.splitlines() if marker in l]


# ------------------------------------------------------------------ the fit, on paper
def _doc(points: list[tuple[int, float]], world: int, nodes: int = 2) -> dict:
    """A bench document of one ddp row at ``world`` ranks whose all-reduce sweep is ``points``,
    on ``nodes`` emulated nodes at 100mbit (burst 64 KiB), probed at 94 Mbit/s both ways."""
    probe = {"goodput_mbit": [{"node": f"node{k}", "up": 94.0, "down": 94.0} for k in range(nodes)]}
    row = {"method": "ddp", "variant": "ddp", "nproc": world // nodes, "world_size": world,
           "step_time": {"median": 1.0}, "compute_time": {"median": 0.1}, "grad_bytes": 20 << 20,
           "collectives": {"all_reduce_sweep": [{"bytes": n, "time": t} for n, t in points]},
           "link": {"nodes": nodes, "link": "100mbit", **probe}}
    return {"kind": "labkit.bench", "results": [row],
            "link": {"nodes": nodes, "link": "100mbit", "rate_bit": 100_000_000,
                     "burst_bytes": 65536, "ranks_per_node": [world // nodes],
                     "queue": "tbf latency 20 ms", "delay": "none", "probes": [probe]}}


@pytest.mark.unit
@pytest.mark.parametrize("nodes,ranks", [(2, 1), (2, 2), (3, 1)])
def test_the_fit_recovers_the_links_goodput_from_a_token_bucket(nodes, ranks):
    """A ring of p = nodes x ranks: each edge moves 2n(p-1)/p bytes; a link edge is the
    slowest, so T = 2n(p-1)/p / goodput, and the fit's bandwidth is the link's goodput, not p
    or ranks times it. The worst case of tbf's bucket: full before every all-reduce, its burst
    passing at once. Sizes within BURST_MARGIN bursts per edge are left out: kept, they pull
    the fit far above the rate."""
    p, goodput = nodes * ranks, 94e6 / 8  # bytes/s
    edge = lambda n: 2 * n * (p - 1) / p
    points = [(n, 1e-3 + max(0.0, edge(n) - 65536) / goodput)
              for n in (4096, 32768, 262144, 2 << 20, 16 << 20, 20 << 20)]
    [f] = link_fit(_doc(points, p, nodes))
    assert f["world_size"] == p and f["ranks_per_node"] == ranks
    # what a full bucket still takes off the kept sizes' times: at most 6% above the goodput
    # (measured, the bucket refills little between the timed calls: within 2% of the probe)
    assert 94.0 <= f["bandwidth_mbit"] <= 94.0 * 1.06, f
    assert f["of_set"] == f["bandwidth_mbit"] / 100 and f["probe_mbit"] == 94.0
    assert f["left_out"] == sum(edge(n) <= BURST_MARGIN * 65536 for n, _ in points) >= 2
    assert re.fullmatch(r"alpha-beta bandwidth 9\d\.\d Mbit/s: 9\d% of the set 100mbit, probe 94\.0 "
                        r"Mbit/s \(the fit is \d+% of it\); world \d = .*", link_fit_line(f))
    # without the link's burst (a bench on one machine) every size is fitted: far off here
    doc = _doc(points, p, nodes)
    doc["link"]["burst_bytes"] = 0
    assert 8 * calibrate(doc)[p]["bandwidth"] / 1e6 > 110


@pytest.mark.unit
def test_a_bench_on_one_machine_has_no_link_lines():
    doc = _doc([(1 << 20, 0.01), (8 << 20, 0.08)], 2)
    assert link_fit({**doc, "link": None}) == [] and link_lines({**doc, "link": None}) == []
    unshaped = {**doc, "link": {**doc["link"], "rate_bit": 0}}
    assert link_fit(unshaped) == []
    doc["link_fit"] = link_fit(doc)
    first, fit = link_lines(doc)
    assert first.startswith("emulated cluster: 2 nodes x 1 rank(s), each node's link 100mbit")
    assert "probe goodput 94.0 Mbit/s (median of 4 streams" in first and fit.startswith("alpha-beta")


# ------------------------------------------------------------------ bad input, in this process
@pytest.mark.unit
@pytest.mark.parametrize("args, says", [
    (["--emulate-nodes", "2", "--link", "fast"], "link rate 'fast' is no rate"),
    (["--emulate-nodes", "2", "--link", "0"], "link rate must be above 0"),
    (["--emulate-nodes", "0", "--link", "100mbit"], "give --emulate-nodes N too"),
    (["--link", "100mbit"], "give --emulate-nodes N too"),
    (["--emulate-nodes", "-1", "--link", "100mbit"], "cluster nodes must be a whole number"),
], ids=["not-a-rate", "zero", "zero-nodes", "link-without-nodes", "negative-nodes"])
def test_bad_bench_cluster_input_is_one_line_and_creates_nothing(tmp_path, capsys, monkeypatch,
                                                                 args, says):
    from labkit import cli

    monkeypatch.chdir(tmp_path)  # the default runs/ would be made here
    handler = signal.getsignal(signal.SIGTERM)  # main() installs labkit's own
    try:
        code = cli.main(["bench", *BENCH_FLAGS, "--variants", "ddp", "--nproc", "1", *args,
                         "--runs-dir", str(tmp_path / "runs")])
    finally:
        signal.signal(signal.SIGTERM, handler)
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if l.strip()]
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith("labkit bench: error: ") and says in lines[0], err
    assert os.listdir(tmp_path) == []  # no run folder, no runs/


# ------------------------------------------------------------------ on this machine
@needs_namespaces
@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_bench_on_two_nodes_at_100mbit_fits_the_rate_and_records_the_link(tmp_path):
    """2 nodes x 1 rank at 100mbit, ddp-fp16 (half the bytes of ddp: the bench's collectives
    and steps take half as long on the link; bytes are bytes to it) and the overhead job (fp32
    DDP): both run on the cluster, each probed; the alpha-beta bandwidth of the sweep is within
    10% of the set rate or of the probe's goodput, and not above the set rate. About 80 s on a 2-vCPU VM (115 s beside another emulated cluster's
    runs), most of it moving 10 and 20 MB at 12 MB/s."""
    p = labkit(["bench", *BENCH_FLAGS, "--steps", 1, "--warmup", 0, "--variants", "ddp-fp16",
                "--nproc", 1, "--emulate-nodes", 2, "--link", "100mbit", "--no-pricing",
                "--no-report", "--runs-dir", tmp_path / "runs"], cwd=tmp_path, timeout=220)
    said = p.stdout + p.stderr
    assert p.returncode == 0, said[-4000:]
    # nothing of its clusters is left (a node's namespaces go with its last process); this
    # test's own, by its folder: another cluster may run on the machine
    deadline = time.monotonic() + 15
    while processes(str(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes(str(tmp_path)) == []
    run = (tmp_path / "runs" / "latest").resolve()
    doc = json.loads((run / "bench.json").read_text())
    link = doc["link"]
    assert (link["link"], link["rate_bit"], link["nodes"]) == ("100mbit", 100_000_000, 2)
    assert link["burst_bytes"] == 65536 and link["queue"].startswith("tbf latency")
    assert sorted(x["job"] for x in link["probes"]) == ["ddp-fp16_x1", "overhead_x1"]
    for x in link["probes"]:  # measured before each job: never above the rate
        assert all(0 < g[k] <= 101 for g in x["goodput_mbit"] for k in ("up", "down")), x
    [r] = doc["results"]
    assert r["world_size"] == 2 and r["link"]["link"] == "100mbit" and doc["overhead"]
    for job in ("ddp-fp16_x1", "overhead_x1"):
        assert json.loads((run / "bench" / job / "launch.json").read_text())["emulated"]["nodes"] == 2
    [f] = doc["link_fit"]
    assert f["world_size"] == 2 and f["left_out"] >= 1 and f["points"] >= 2
    # the fit recovers the link: within 10% of the set rate, or of the goodput its probe measured
    # in this run (link_fit's docstring: ~94% of the set rate, the frames' and ACKs' share
    # taken), and never above the set rate. A machine busy with another test's ranks slows what
    # it meets: one CI run fitted 89.2 Mbit/s; another fitted 93.5 beside a probe of 75.5; here,
    # idle, one size's repetitions spread 0.83-0.92 s. The fit and the probe run at different
    # moments, so one of them is measured on the link alone.
    near_set = 90 <= f["bandwidth_mbit"] <= 110
    near_probe = bool(f["probe_mbit"]) and 0.9 <= f["bandwidth_mbit"] / f["probe_mbit"] <= 1.1
    assert near_set or near_probe, f
    assert 80 <= f["bandwidth_mbit"] <= 101, f
    assert f["bandwidth_mbit"] == pytest.approx(8 * calibrate(doc)[2]["bandwidth"] / 1e6)
    fit = re.compile(r"alpha-beta bandwidth [\d.]+ Mbit/s: \d+% of the set 100mbit, probe [\d.]+ Mbit/s")
    text = (run / "bench.txt").read_text()
    assert fit.search(text) and fit.search(said), text
    assert "emulated cluster: 2 nodes x 1 rank(s), each node's link 100mbit each way" in text
    assert re.search(r"ddp-fp16 x1: step .* img/s; 2 emulated nodes, link 100mbit, probe [\d.]+ "
                     r"Mbit/s", said), said[-4000:]
