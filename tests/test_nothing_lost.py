"""Writes are atomic, run folders are never reused."""
from __future__ import annotations

import json

import pytest

from labkit.lab.runs_dir import new_run_dir
from labkit.core.files import atomic_write_json


def test_a_failed_write_leaves_the_old_file_whole_and_no_temp_file(tmp_path):
    path = tmp_path / "results_ps.json"
    atomic_write_json(str(path), {"status": "running", "epochs": [1]})
    with pytest.raises(TypeError):
        atomic_write_json(str(path), {"status": "completed", "bad": object()})  # fails mid-write
    assert json.loads(path.read_text()) == {"status": "running", "epochs": [1]}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results_ps.json"]


def test_written_files_are_readable_by_others(tmp_path):
    path = tmp_path / "r.json"
    atomic_write_json(str(path), {})
    assert path.stat().st_mode & 0o044  # not mkstemp's private 0600


def test_two_experiments_in_the_same_second_get_two_folders(tmp_path):
    a = new_run_dir(str(tmp_path), "x")
    b = new_run_dir(str(tmp_path), "x")
    assert a != b and a.is_dir() and b.is_dir()
    assert (tmp_path / "latest").resolve() == b.resolve()


def test_bad_tag_is_rejected(tmp_path):
    from labkit.core.config import ConfigError
    with pytest.raises(ConfigError, match="tag"):
        new_run_dir(str(tmp_path), "../escape")
