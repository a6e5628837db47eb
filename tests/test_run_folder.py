"""labkit.core.run_folder.RunFolder, the one reader of a run folder: every shape it opens, where
it looks for result files, and how it says a document cannot be read."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from labkit.core import layout
from labkit.core.methods import RESULT_FILES
from labkit.core.run_folder import RunFolder, RunFolderError


def _write(path: Path, doc) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return path


@pytest.mark.parametrize("files, kind", [
    ({layout.SWEEP: {}}, "sweep"),
    ({layout.BENCH: {}}, "bench"),
    ({layout.REPRODUCTION: {}, layout.CONFIG: {}}, "reproduction"),
    ({"repeat-1/ddp/x": ""}, "repeats"),
    ({layout.CONFIG: {}}, "experiment"),
    ({layout.EXPERIMENT: {}}, "experiment"),
    ({f"ddp/{RESULT_FILES['ddp']}": {}}, "experiment"),  # the guide's scripts: results only
])
def test_every_shape_has_its_kind(tmp_path, files, kind):
    for name, doc in files.items():
        _write(tmp_path / name, doc)
    assert RunFolder(tmp_path).kind == kind


def test_a_folder_of_nothing_is_no_run_folder(tmp_path):
    with pytest.raises(ValueError, match="not a run folder"):
        RunFolder(tmp_path).kind


def test_result_files_inside_loose_and_per_repeat(tmp_path):
    name = RESULT_FILES["ddp"]
    run = RunFolder(tmp_path / "run")
    assert run.result_paths("ddp") == [run.path / "ddp" / name]  # expected, though missing
    assert not run.has_results()
    _write(run.path / name, {})  # a loose file (the guide's scripts)
    assert run.result_paths("ddp") == [run.path / name] and run.has_results()
    _write(run.path / "ddp" / name, {})  # the method's folder wins
    assert run.result_paths("ddp") == [run.path / "ddp" / name]
    for i in (2, 1, 10):
        _write(run.path / f"repeat-{i}" / "ddp" / name, {})
    assert run.result_paths("ddp") == [run.path / f"repeat-{i}" / "ddp" / name for i in (1, 2, 10)]
    assert run.found_methods() == ["ddp"]


def test_documents_are_empty_when_absent_or_corrupt_and_read_says_why(tmp_path):
    run = RunFolder(tmp_path)
    assert (run.config, run.env, run.status, run.methods) == ({}, {}, {}, {})
    assert run.target_accuracy is None and run.package_versions() is None
    _write(tmp_path / layout.ENVIRONMENT, "{not json")
    assert RunFolder(tmp_path).env == {} and RunFolder(tmp_path).get(layout.ENVIRONMENT, 7) == 7
    with pytest.raises(ValueError):
        run.read(layout.ENVIRONMENT)
    with pytest.raises(RunFolderError, match=r"is not valid JSON \(line 1, column 2\): the env is corrupt"):
        run.strict(layout.ENVIRONMENT, "env")
    with pytest.raises(RunFolderError, match="cannot read .*config.json"):
        run.strict(layout.CONFIG, "config")


def test_an_experiments_config_and_environment(tmp_path):
    _write(tmp_path / "env.lock", "torch==2.5.0\n")
    _write(tmp_path / layout.ENVIRONMENT, {"packages": {"file": "env.lock"}, "host": "h"})
    _write(tmp_path / layout.CONFIG, {"experiment": {"target_accuracy": 0.9, "lr": 0.2, "tag": "t"},
                                      "train": {"lr": 0.1, "epochs": 2, "out": "x"},
                                      "resolved": {"ddp": {"method": "ddp"}}})
    _write(tmp_path / "ddp" / RESULT_FILES["ddp"], {"method": "DDP", "epochs": []})
    for run in (RunFolder(tmp_path), RunFolder.experiment(tmp_path)):
        assert run.methods == {"ddp": {"method": "ddp"}} and run.target_accuracy == 0.9
        assert run.env["host"] == "h" and run.package_versions() == {"torch": "2.5.0"}
        assert run.lock_file() == tmp_path / "env.lock" and run.lock_file({}) is None
        assert run.result("ddp").method == "DDP" and run.result("ddp").epochs == []
        # the experiment's value wins; where it went (out) and its tag are no parameters
        assert run.parameters == {"lr": 0.2, "epochs": 2, "target_accuracy": 0.9}
    with pytest.raises(RunFolderError, match="is not a run folder"):
        RunFolder.experiment(tmp_path / "ddp")
