"""Writes are atomic, run folders are never reused."""
from __future__ import annotations

import builtins
import errno
import json

import pytest

from labkit.runs.runs_dir import new_run_dir
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


class _Interrupted:
    """A file whose writes raise ``exc`` once ``after`` bytes have gone through, as a Ctrl-C
    (or a full disk) in the middle of torch.save's zip records."""

    def __init__(self, f, exc: BaseException, after: int = 100_000):
        self.f, self.exc, self.left = f, exc, after

    def write(self, b) -> int:
        self.left -= len(b)
        if self.left < 0:
            raise self.exc
        return self.f.write(b)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), OSError(errno.ENOSPC, "No space left")],
                         ids=["ctrl-c", "disk-full"])
def test_a_checkpoint_write_stopped_half_way_says_what_stopped_it(tmp_path, monkeypatch, exc):
    """torch's zip writer, closed while the Ctrl-C unwinds through torch.save, raises an "enforce
    fail ... unexpected pos" RuntimeError over it: the rank reported that as a crash (exit 1)
    and its result file's error said so. The Ctrl-C (or the full disk) is what comes out, the
    old checkpoint is whole and no temp file is left."""
    import torch

    from labkit.training import checkpoint

    path = tmp_path / "checkpoint.pt"
    checkpoint.atomic_torch_save({"epoch": 1}, str(path))
    monkeypatch.setattr(checkpoint, "open", raising=False,
                        value=lambda p, mode: _Interrupted(builtins.open(p, mode), exc))
    with pytest.raises(type(exc)) as got:
        checkpoint.atomic_torch_save({"epoch": 2, "w": torch.zeros(100_000)}, str(path))
    if isinstance(exc, OSError):
        assert got.value.errno == errno.ENOSPC and got.value.filename == str(path)
    else:
        assert got.value is exc
    assert torch.load(path) == {"epoch": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]
