"""Issue 61, item 6: no state leaks from one test into the next on an xdist worker. A labkit
command run in-process (labkit.cli.main) installs labkit's SIGTERM handler and console
logging; conftest's guard restores what the test found, so the test after it, in either
order, sees the process as it was."""
from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from helpers import ROOT, process_state

START = process_state()  # collected before any test of this worker ran


def test_a_command_run_in_process_changes_the_process(tmp_path, monkeypatch):
    from labkit.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    assert main(["-v", "runs", str(tmp_path / "runs")]) == 0
    now = process_state()
    assert now[0][signal.SIGTERM] != START[0][signal.SIGTERM]  # labkit's own handler ...
    assert now[3] is False and now[4] == "DEBUG"  # ... and its console, at -v's level


def test_the_next_test_finds_the_process_as_it_was():
    assert process_state() == START


@pytest.mark.e2e
@pytest.mark.parametrize("order", [("changes", "finds"), ("finds", "changes")])
def test_both_orders_on_one_worker(order):
    names = {"changes": "test_a_command_run_in_process_changes_the_process",
             "finds": "test_the_next_test_finds_the_process_as_it_was"}
    ids = [f"tests/test_state_leaks.py::{names[k]}" for k in order]
    p = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:randomly", "-p", "no:xdist",
                        "-p", "no:cacheprovider", "-v", *ids], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    ran = [l.split("::")[1].split()[0] for l in p.stdout.splitlines() if " PASSED" in l and "::" in l]
    assert ran == [names[k] for k in order], p.stdout[-3000:]
