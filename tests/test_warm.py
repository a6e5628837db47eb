"""The warm launcher itself (tests/warm.py): a rank that fails ends the launch with its
traceback in the result, and a launch that outlives its timeout is killed, every rank of it.
(That it computes what torchrun's ranks compute: test_compression_methods' last test,
test_multinode and test_cluster, against the session's warm ddp_run.)"""
from __future__ import annotations

import subprocess
import time

import psutil
import pytest

from helpers import TINY
from warm import start_warm


def alive(launch) -> list[int]:
    """The launch's ranks still running (the warm server reaps its children: an ended rank is
    gone, not a zombie)."""
    def running(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False
    return [p.pid for p in launch.procs if running(p.pid)]

pytestmark = pytest.mark.slow  # make test: the inner loop needs no launcher's failure paths


def test_a_rank_that_raises_fails_the_launch_with_its_traceback(tmp_path):
    """Rank 1 raises at its second step: the launch exits 1 (as torchrun does), rank 1's
    traceback is in the result, rank 0 (left waiting in a collective) is stopped, not waited
    for until the collective's timeout."""
    out = tmp_path / "raised"
    start = time.monotonic()
    launch = start_warm(2, TINY + ["--method", "ddp", "--out", str(out)], tmp_path,
                        env={"LABKIT_TEST_FAULT": "ddp:1:1"})
    p = launch.wait()
    assert p.returncode == 1, p.stdout + p.stderr
    assert "Traceback (most recent call last)" in p.stderr, p.stderr
    assert "RuntimeError: injected fault (LABKIT_TEST_FAULT) at step 1" in p.stderr, p.stderr
    assert "warm: rank 1 exited with 1" in p.stderr, p.stderr
    assert time.monotonic() - start < 100  # TINY's collective timeout is 120 s
    assert alive(launch) == []


def test_a_launch_past_its_timeout_is_killed(tmp_path):
    """Rank 1 hangs outside any collective: after ``timeout`` seconds every rank is killed and
    TimeoutExpired raised, as subprocess.run does for helpers.torchrun. (Its 8 s: the ranks
    start from a fork within a second; the killing is the point, wherever they are by then.)"""
    out = tmp_path / "hung"
    launch = start_warm(2, TINY + ["--method", "ddp", "--out", str(out)], tmp_path,
                        env={"LABKIT_TEST_FAULT": "ddp:1:1:hang"}, timeout=8)
    with pytest.raises(subprocess.TimeoutExpired):
        launch.wait()
    assert alive(launch) == []
