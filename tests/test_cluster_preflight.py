"""An emulated cluster is checked as what it is, every node on this machine (issue 71, item 1):
a cluster whose ranks together need more memory than is free is refused in one line before
any network namespace exists, and a probe far below the set rate says so.

All in-process and CPU-cheap: the refusal runs `labkit run` (labkit.cli.main) with the
namespaces and the cluster replaced by a tripwire."""
from __future__ import annotations

import re

import pytest

from labkit import cli
from labkit.core import resources
from labkit.launch import emulated
from labkit.launch.cluster import ClusterSpec, parse_link
from labkit.training.budget import FLOAT
from labkit.workloads.images.architectures import state_values

pytestmark = pytest.mark.unit

GiB = resources.GiB


@pytest.fixture
def no_namespaces(monkeypatch):
    """A refusal must come before the cluster is tried or built: either fails the test."""
    def tripwire(*a, **kw):
        raise AssertionError("a network namespace was made before the refusal")
    monkeypatch.setattr(emulated, "check_machine", tripwire)
    monkeypatch.setattr(emulated, "run_cluster", tripwire)


def refused(argv: list, capsys) -> str:
    """`labkit run ARGV` in-process: exit 2 and its one line on stderr, nothing on stdout."""
    code = cli.main(["run", *map(str, argv)])
    out, err = capsys.readouterr()
    lines = [l for l in err.splitlines() if l.strip()]
    assert code == 2 and len(lines) == 1, (code, out, err)
    assert "Traceback" not in out + err
    return lines[0]


def test_a_cluster_bigger_than_the_machine_is_refused_naming_every_rank(tmp_path, capsys,
                                                                        monkeypatch, no_namespaces):
    """The issue's command: 40 nodes x 2 ranks of ResNet-50 on a machine with 22 GiB free."""
    monkeypatch.setattr(resources, "free_memory", lambda: 22 * GiB)
    out = tmp_path / "ddp"
    line = refused(["ddp", "--emulate-nodes", 40, "--nproc", 2, "--link", "1gbit", "--model",
                    "resnet50", "--dataset", "synthetic", "--batch-size", 8, "--out", out], capsys)
    model = FLOAT * state_values("resnet50", 1000)
    need = resources.size(80 * (resources.RANK_BASE + 5 * model))
    assert line.startswith(f"labkit run: error: not enough host memory in this machine: the run "
                           f"needs about {need} (80 ranks (40 emulated nodes x 2) x "), line
    assert "22.0 GiB free; lower --nproc or --emulate-nodes" in line, line
    assert not out.exists()


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
