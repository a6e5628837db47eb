"""A run folder written before a restructuring reads as it did (issue 58, item 6): `labkit
report` of tests/data/run-before-issue-58 (a TINY `labkit experiment` of ddp, allreduce, ps and
nosync written by labkit at BEFORE, the last commit before the capability folders; its result
files, records and configs, without checkpoints, notebooks or report) gives the same text, the
same tables and the same figures with today's code as with the code of BEFORE, taken from git
and run beside it. The expected output is not stored: the old code makes it, here, each time.

A change that means to alter the report (a new table, a reworded line) moves BEFORE to its own
parent commit, so this test keeps holding only what a restructuring must not change."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from io import BytesIO
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from helpers import ROOT

BEFORE = "f79ac0f53443ae42964d3d17b4fc8e630e22d2ba"
OLD_RUN = ROOT / "tests" / "data" / "run-before-issue-58"


def code_at(commit: str, dest: Path) -> Path:
    """labkit/ and notebooks/ as they were at ``commit`` (git archive), under ``dest``."""
    git = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "labkit", "notebooks"],
                         capture_output=True, timeout=60)
    if git.returncode != 0:  # a shallow clone, or no git: the old code cannot be had here
        pytest.skip(f"the code of {commit[:7]} is not in this checkout's history: "
                    f"{git.stderr.decode().strip()[:200]}")
    with tarfile.open(fileobj=BytesIO(git.stdout)) as tar:
        tar.extractall(dest, filter="tar")
    return dest


def report(code: Path, run: Path) -> subprocess.CompletedProcess:
    """`labkit report RUN` with the labkit found in ``code`` (first on the path)."""
    env = {**os.environ, "PYTHONPATH": str(code), "MPLBACKEND": "Agg"}
    return subprocess.run([sys.executable, "-m", "labkit", "report", str(run)], cwd=code, env=env,
                          capture_output=True, text=True, timeout=180)


def pixels(path: Path) -> np.ndarray:
    with Image.open(path) as im:
        return np.asarray(im.convert("RGBA"))


def test_labkit_report_of_a_run_folder_written_before_is_unchanged(tmp_path):
    old_code = code_at(BEFORE, tmp_path / "old")
    runs = {}
    for name, code in (("old", old_code), ("new", ROOT)):
        # the same path length for both copies: the report names its folder
        runs[name] = shutil.copytree(OLD_RUN, tmp_path / f"run-{name}")
        p = report(code, runs[name])
        assert p.returncode == 0, (name, p.stderr[-2000:])
        runs[name + "_stdout"] = p.stdout.replace(str(runs[name]), "RUN")
    # the old code really ran from its own tree: the capability folders did not exist there
    assert (old_code / "labkit" / "analysis").is_dir() and not (old_code / "labkit" / "report").exists()

    assert "Baseline DDP" in runs["new_stdout"] and "Parameter Server" in runs["new_stdout"]
    assert runs["new_stdout"] == runs["old_stdout"]
    old_dir, new_dir = runs["old"] / "report", runs["new"] / "report"
    old_text = (old_dir / "performance_report.txt").read_text().replace(str(runs["old"]), "RUN")
    new_text = (new_dir / "performance_report.txt").read_text().replace(str(runs["new"]), "RUN")
    assert new_text == old_text
    # every table of the text report: the same rows in the same words and numbers
    assert new_text.count("Table ") >= 3
    old_pngs = sorted(p.relative_to(old_dir) for p in old_dir.rglob("*.png"))
    new_pngs = sorted(p.relative_to(new_dir) for p in new_dir.rglob("*.png"))
    assert len(new_pngs) >= 5 and new_pngs == old_pngs
    differing = [str(rel) for rel in new_pngs
                 if not np.array_equal(pixels(new_dir / rel), pixels(old_dir / rel))]
    assert differing == []
    # the result files were read, never written
    for f in OLD_RUN.rglob("results_*.json"):
        assert (runs["new"] / f.relative_to(OLD_RUN)).read_bytes() == f.read_bytes()
