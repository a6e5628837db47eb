"""The suite's census (tests/hooks' LABKIT_TEST_CENSUS and tools/suite_census.py): every Python
process a test starts is recorded with the test that started it, and counted by kind."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers import HOOKS, ROOT

pytestmark = pytest.mark.e2e  # it starts Python processes (tiny ones: `-c pass`)

# command lines as the suite starts them, and the kind each one is counted as
STARTS = {
    "rank": [sys.executable, "-c", "pass", "-m", "labkit.train", "--method", "ddp"],
    "torchrun agent": [sys.executable, "-c", "pass", "-m", "torch.distributed.run", "--standalone"],
    # labkit's agent and the warm process it forks ranks from (labkit.launch.agent)
    "warm process": [sys.executable, "-c", "pass", "from multiprocessing.forkserver import main; "
                     "main(3, 4, ['torch', 'labkit.training.rank'])"],
    # what an experiment's warm process forks for: a kernel, an agent or a rank (labkit.launch.warm)
    "warm client": [sys.executable, "-c", "pass", "-m", "labkit.launch.warm_client", "-m",
                    "ipykernel_launcher", "-f", "k.json"],
    "kernel": [sys.executable, "-c", "pass", "-m", "ipykernel_launcher", "-f", "k.json"],
    "labkit command": [sys.executable, "-c", "pass", "-m", "labkit", "experiment"],
}


def test_every_process_is_recorded_with_its_test_and_counted_by_kind(tmp_path):
    # a -c program ignores what follows it: each process starts with the command line of its kind
    env = {**os.environ, "PYTHONPATH": HOOKS, "LABKIT_TEST_CENSUS": str(tmp_path),
           "PYTEST_CURRENT_TEST": "tests/test_x.py::test_y (call)"}
    for argv in STARTS.values():
        subprocess.run(argv, env=env, check=True, timeout=60)
    other = {**env, "PYTEST_CURRENT_TEST": "tests/test_x.py::test_z[a/b] (setup)"}  # a path in its id
    subprocess.run([sys.executable, "-c", "pass"], env=other, check=True, timeout=60)
    lines = (tmp_path / "starts.tsv").read_text().splitlines()
    assert len(lines) == len(STARTS) + 1, lines
    pid, parent, test, argv = lines[0].split("\t")
    assert int(parent) == os.getpid() and test == "tests/test_x.py::test_y" and argv.endswith("--method ddp")

    p = subprocess.run([sys.executable, str(ROOT / "tools" / "suite_census.py"), str(tmp_path)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    said = p.stdout.splitlines()
    assert said[0] == f"{len(STARTS) + 1} Python processes started by the tests:"
    for kind in STARTS:
        assert f"  {kind:15s} {1:5d}" in said, (kind, said)
    assert f"  {'other Python':15s} {1:5d}" in said
    row = next(l for l in said if l.startswith("test_x.py::test_y "))
    assert row.split()[1] == str(len(STARTS)), row  # test_y started one of each kind, test_z one
    assert any(l.startswith("test_x.py::test_z[a/b] ") for l in said), said  # a path in its id kept


def test_a_census_folder_without_a_census_or_with_a_broken_junit_file_is_one_line(tmp_path):
    tool = [sys.executable, str(ROOT / "tools" / "suite_census.py"), str(tmp_path)]
    p = subprocess.run(tool, capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and p.stderr.strip().splitlines() == [
        f"suite_census: {tmp_path}/starts.tsv not found (run the suite with LABKIT_TEST_CENSUS={tmp_path})"]
    (tmp_path / "starts.tsv").write_text("1\t0\ttests/test_x.py::test_y\tpython -c pass\n")
    (tmp_path / "junit.xml").write_text("<testsuites><testcase")  # cut short
    p = subprocess.run(tool, capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert p.stderr.startswith(f"suite_census: {tmp_path}/junit.xml is not a junit XML file (")
