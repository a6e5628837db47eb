"""An emulated cluster is checked as what it is, every node on this machine (issue 71, items 1
and 2): a cluster whose ranks together need more memory than is free, or a link on which one
step's bytes cannot cross before the run gives up, is refused in one line before any network
namespace exists; a probe far below the set rate says so; and a run on which no rank failed
first is explained from every node's logs, naming the link where one step needs longer than
--timeout, not as a failure "on another node".

All in-process and CPU-cheap: the refusals run `labkit run` and `labkit experiment`
(labkit.cli.main) with the namespaces, the cluster and an experiment's methods replaced by a
tripwire; the explanation reads node logs made the way a real run at a slow link left them
(gloo's timeouts in DDP's first broadcast, 2026-11-29)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from labkit import cli
from labkit.core import resources
from labkit.core.config import TrainConfig
from labkit.launch import emulated
from labkit.launch.cluster import ClusterSpec, parse_link
from labkit.training.budget import FLOAT
from labkit.workloads.images.architectures import state_values

pytestmark = pytest.mark.unit

GiB = resources.GiB


@pytest.fixture
def no_namespaces(monkeypatch):
    """A refusal must come before the cluster is tried or built, and before any method of an
    experiment starts: each fails the test."""
    from labkit.launch import cluster
    from labkit.orchestrate import experiment

    def tripwire(*a, **kw):
        raise AssertionError("a network namespace was made before the refusal")
    monkeypatch.setattr(emulated, "check_machine", tripwire)
    monkeypatch.setattr(emulated, "run_cluster", tripwire)
    monkeypatch.setattr(cluster, "check_machine", tripwire)  # `labkit experiment` tries it
    monkeypatch.setattr(experiment, "run_method_notebook", tripwire)


def refused(command: str, flags: list, tmp_path: Path, capsys) -> str:
    """`labkit run ddp FLAGS --out DIR` or `labkit experiment FLAGS --runs-dir DIR` (its
    default methods, ddp first) in-process: exit 2 and its one line on stderr, nothing on
    stdout, DIR not made."""
    folder = tmp_path / "out"
    argv = ["ddp", *flags, "--out", folder] if command == "run" else [*flags, "--runs-dir", folder]
    code = cli.main([command, *map(str, argv)])
    out, err = capsys.readouterr()
    lines = [l for l in err.splitlines() if l.strip()]
    assert code == 2 and len(lines) == 1, (code, out, err)
    assert "Traceback" not in out + err
    assert not folder.exists()
    return lines[0]


# the commands; `labkit experiment` took them as one node's ranks, after the namespaces
BIG = ["--emulate-nodes", 40, "--nproc", 2, "--link", "1gbit", "--model", "resnet50", "--dataset",
       "synthetic", "--batch-size", 8]
SLOW = ["--emulate-nodes", 2, "--nproc", 1, "--link", "10kbit", "--timeout", 20, "--model",
        "resnet10_small", "--dataset", "digits"]


@pytest.mark.parametrize("command", ["run", "experiment"])
def test_a_cluster_bigger_than_the_machine_is_refused_naming_every_rank(command, tmp_path, capsys,
                                                                        monkeypatch, no_namespaces):
    """The issue's command: 40 nodes x 2 ranks of ResNet-50 on a machine with 22 GiB free."""
    monkeypatch.setattr(resources, "free_memory", lambda: 22 * GiB)
    line = refused(command, BIG, tmp_path, capsys)
    model = FLOAT * state_values("resnet50", 1000)
    need = resources.size(80 * (resources.RANK_BASE + 5 * model))
    assert line.startswith(f"labkit {command}: error: not enough host memory in this machine: the "
                           f"run needs about {need} (80 ranks (40 emulated nodes x 2) x "), line
    assert "22.0 GiB free; lower --nproc or --emulate-nodes" in line, line


def step_bytes(model: str = "resnet10_small", classes: int = 10, nodes: int = 2) -> float:
    """DDP's gradients all-reduced over ``nodes`` nodes: 2 (N-1)/N of them cross each link."""
    return 2 * (nodes - 1) / nodes * FLOAT * state_values(model, classes)


@pytest.mark.parametrize("command", ["run", "experiment"])
def test_a_link_too_slow_for_one_step_is_refused_before_anything_starts(command, tmp_path, capsys,
                                                                         no_namespaces):
    """The issue's command: 2 nodes at 10kbit, --timeout 20: one step needs hours."""
    line = refused(command, SLOW, tmp_path, capsys)
    moved = step_bytes()
    hours = moved * 8 / 10_000 / 3600
    assert line == (f"labkit {command}: error: --link 10kbit is too slow: one step of ddp moves "
                    f"about {resources.size(moved)} each way over a node's link, which needs about "
                    f"{hours:.1f} h at 10kbit, and a step may take at most 40 s (2 x --timeout "
                    f"20 s): give a faster --link, a smaller model or a longer --timeout"), line


def resolved(method: str = "ddp", **kw) -> TrainConfig:
    return TrainConfig(method=method, model="resnet10_small", dataset="digits", timeout=20, **kw)


@pytest.mark.parametrize("method, kw, link, known", [
    ("ddp", {}, "100mbit", True),        # 18.7 MiB: 1.6 s a step
    ("ddp", {}, "5mbit", True),          # 31 s: past --timeout, within the 40 s a step may take
    ("powersgd", {}, "10kbit", False),   # sends less than it all-reduces: its bytes are not known
    ("ps", {"ps_staleness": 2}, "10kbit", False),  # asynchronous: a step need not wait for them
    ("ddp", {}, "unshaped", False),
])
def test_a_link_is_refused_only_where_a_step_cannot_cross_it(method, kw, link, known):
    cfg, spec = resolved(method, **kw), ClusterSpec(2, 1, parse_link(link))
    need = emulated.link_time(cfg, spec)
    assert (need is not None) == known
    assert need is None or need[1] <= 2 * cfg.timeout
    emulated.check_link(cfg, spec)  # not refused: ConfigError would fail the test


def test_a_parameter_servers_step_is_its_push_or_pull(monkeypatch):
    """A node without a server pushes every gradient out and pulls every parameter in."""
    moved, seconds = emulated.link_time(resolved("ps"), ClusterSpec(2, 2, parse_link("1mbit")))
    assert moved == FLOAT * state_values("resnet10_small", 10) and seconds == moved * 8 / 1e6
    fp16 = emulated.link_time(resolved("ddp", compress="fp16"), ClusterSpec(4, 1, parse_link("1mbit")))
    assert fp16[0] == step_bytes(nodes=4) / 2  # 2 bytes a gradient, 2 x 3/4 of them


# a real run's node logs at a link too slow for DDP's first broadcast: node0's torchrun printed
# its failure summary; node1's lost the rendezvous store as node0 ended and printed none
GLOO = "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:{}] " \
       "Timed out waiting 20000ms for {} operation to complete"
NODE0 = """\
[rank0]: labkit.train: error: rank 0: {error}
E1129 02:07:05.450000 6 torch/distributed/elastic/multiprocessing/api.py:836] failed (exitcode: 1) local_rank: 0 (pid: 44) of fn: warm_rank (start_method: forkserver)
torch.distributed.elastic.multiprocessing.errors.ChildFailedError: 
============================================================
warm_rank FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-29_02:07:05
  host      : node0
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 44) 
  error_file: {log}/labkit_fme87xsl/attempt_0/0/error.json
  traceback : Traceback (most recent call last):
  {error}
============================================================
"""
NODE1 = """\
W1129 02:05:57.699000 11 torch/distributed/run.py:973] node_rank is only used for static rdzv_backend. It will be ignored for rdzv_backend=c10d.
[rank1]: labkit.train: error: rank 1: {error}
W1129 02:07:14.783000 11 torch/distributed/elastic/rendezvous/dynamic_rendezvous.py:1346] The node 'node1_11_0' has failed to send a keep-alive heartbeat to the rendezvous 'labkit' due to an error of type RendezvousConnectionError.
torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: The connection to the C10d store has failed. See inner exception for details.
"""


def node_logs(out: Path) -> tuple[list[str], list[str]]:
    """(each node's console, each node's log folder) as the run left them."""
    texts, dirs = [], []
    for k, (console, line, op, run) in enumerate([(NODE0, 129, "send", "labkit_fme87xsl"),
                                                 (NODE1, 78, "recv", "labkit_rn6zbtnc")]):
        log, error = out / "logs" / f"node{k}", GLOO.format(line, op)
        rank = log / run / "attempt_0" / "0"
        rank.mkdir(parents=True)
        (rank / "error.json").write_text(json.dumps({"message": {
            "message": error, "extraInfo": {"timestamp": str(1795918025 + 9 * k)}}}))
        (rank / "stderr.log").write_text(
            f"Traceback (most recent call last):\n{error}\n"
            f"labkit.stack: rank {k} timed out: labkit/training/sync/ddp.py:52 (setup)\n"
            f"labkit.train: error: rank {k}: {error}\n")
        texts.append(console.format(error=error, log=log))
        dirs.append(str(log))
    return texts, dirs


def test_a_run_that_timed_out_everywhere_at_a_slow_link_names_the_link(tmp_path):
    """5mbit: one step's 18.7 MiB need 31 s, more than --timeout 20 s (not refused before:
    less than the 40 s a step may take); every rank timed out, none failed first."""
    texts, dirs = node_logs(tmp_path)
    why = emulated.explain_nodes(resolved(), ClusterSpec(2, 1, parse_link("5mbit")), [1, 1],
                                 texts, dirs, oom=False)
    moved = step_bytes()
    assert why.message == (
        f"ddp failed: no rank failed first: the ranks of all 2 emulated nodes only lost their "
        f"peers or timed out waiting for them (--timeout 20 s): one step of ddp moves about "
        f"{resources.size(moved)} each way over a node's link, which needs about "
        f"{moved * 8 / 5e6:.0f} s at 5mbit, longer than --timeout; give a faster --link, a "
        f"smaller model or a longer --timeout (logs: {tmp_path / 'logs'})"), why.message
    assert why.rank is None


def test_a_run_that_timed_out_everywhere_at_a_fast_link_is_not_put_on_another_node(tmp_path):
    """The launcher holds every node's logs: "failed on another node" is never its word."""
    texts, dirs = node_logs(tmp_path)
    why = emulated.explain_nodes(resolved(), ClusterSpec(2, 1, parse_link("1gbit")), [1, 1],
                                 texts, dirs, oom=False)
    first, *quoted = why.message.splitlines()
    assert first == ("ddp failed: no rank failed first: the ranks of all 2 emulated nodes only "
                     "lost their peers or timed out waiting for them (--timeout 20 s). One of "
                     "them said:"), why.message
    assert quoted and "Timed out waiting 20000ms" in quoted[-1]
    assert "another node" not in why.message


def test_a_probe_far_below_the_link_says_the_machine_limits_it():
    """The issue's 40 nodes x 2 ranks at 1gbit on 2 cores measured 215-405 Mbit/s; one node
    low at a slow link is the probe's scatter (5mbit: 2.7 and 4.8 Mbit/s, 2026-11-29)."""
    spec = ClusterSpec(40, 2, parse_link("1gbit"))
    got = [405.0, 215.0, None] + [300.5] * 37
    line = emulated.probe_warning(spec, got)
    assert line and re.match(r"the probe measured 215-405 Mbit/s on the 1gbit link, at most 40% of "
                             r"its rate on every node: this machine \(\d+ cores for 40 nodes x 2 "
                             r"rank\(s\)\), not the link, limits the traffic", line), line
    assert emulated.probe_warning(ClusterSpec(2, 1, parse_link("100mbit")), [95.5, 95.3]) is None
    assert emulated.probe_warning(ClusterSpec(2, 1, parse_link("5mbit")), [2.7, 4.8]) is None
    assert emulated.probe_warning(ClusterSpec(2, 1, parse_link("unshaped")), [6431.0, 20.0]) is None


def test_the_bound_a_refusal_names_is_the_one_the_ranks_watchdog_keeps(monkeypatch):
    """"a step may take at most STALL_TIMEOUTS x --timeout": the rank's stall watchdog ends a
    step after as long (labkit.training.rank), not after a figure of its own."""
    from labkit.training import budget, rank, stackdump

    monkeypatch.setattr(budget, "STALL_TIMEOUTS", 3)
    kept = []
    monkeypatch.setattr(stackdump, "watch", lambda progress, bound, give_up: kept.append(bound))
    rank._watch_for_stalls(resolved(), 0, None, None)
    assert kept == [3 * 20]
