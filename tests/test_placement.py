"""CPU ranks bound to their share of the cores (labkit.training.dist.bind_cpus, --pin-cpus)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from labkit.orchestrate import reproduce
from labkit.core.config import TrainConfig
from labkit.training.dist import cpu_share

linux_only = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity call")


@pytest.mark.parametrize("allowed,ranks,shares", [
    ([0, 1], 4, [[0], [0], [1], [1]]),                   # the embedded default: 4 ranks, 2 cores
    ([0, 1], 3, [None, None, None]),                     # PS with 2 workers: no even share
    ([0, 1], 6, [[0], [0], [0], [1], [1], [1]]),
    ([0, 1, 2], 2, [[0], [1, 2]]),
    (list(range(8)), 2, [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ([3, 5], 1, [[3, 5]]),                               # one process keeps all it may use
    ([2, 5, 9], 3, [[2], [5], [9]]),                     # a taskset that is not contiguous
])
def test_each_rank_gets_an_even_contiguous_share(allowed, ranks, shares):
    assert [cpu_share(allowed, r, ranks) for r in range(ranks)] == shares


def test_shares_are_even_or_not_given():
    for n in range(1, 13):
        for w in range(1, 13):
            allowed = list(range(100, 100 + n))
            shares = [cpu_share(allowed, r, w) for r in range(w)]
            if w <= n:
                assert all(shares), shares  # every rank has a core of its own
                assert sorted(c for s in shares for c in s) == allowed  # each core to one rank
                assert max(map(len, shares)) - min(map(len, shares)) <= 1
            elif w % n == 0:
                # more ranks than cores: w/n neighbours on each core
                assert all(len(s) == 1 for s in shares)
                assert [sum(s == [c] for s in shares) for c in allowed] == [w // n] * n
            else:
                assert shares == [None] * w  # no even share: left to the OS


BIND = r"""
import json, os, subprocess, sys, threading
started = threading.Event()
t = threading.Thread(target=started.wait)
t.start()  # a thread that exists before the binding, as gloo's and the SIGTERM thread do
from labkit.training.dist import bind_cpus
cores = bind_cpus(1, 2)
child = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                       capture_output=True, text=True, check=True).stdout
print(json.dumps({"cores": cores, "main": sorted(os.sched_getaffinity(0)),
                  "thread": sorted(os.sched_getaffinity(t.native_id)), "child": json.loads(child)}))
started.set()
"""


@linux_only
def test_binding_reaches_every_thread_and_later_processes():
    allowed = sorted(os.sched_getaffinity(0))
    upper = allowed[len(allowed) // 2:]  # the second of two ranks: the upper half
    proc = subprocess.run([sys.executable, "-c", BIND], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got == {"cores": upper, "main": upper, "thread": upper, "child": upper}


def test_a_run_recorded_before_binding_is_rerun_unbound():
    recorded = {k: v for k, v in TrainConfig(method="ps").to_dict().items() if k != "pin_cpus"}
    assert reproduce._config(recorded, "config.json").pin_cpus is False
    assert reproduce._config({**recorded, "pin_cpus": True}, "config.json").pin_cpus is True
