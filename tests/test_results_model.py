"""The result file's one typed model (issue 58, item 3: labkit.core.results): the guide's own
files, a file of the lab written before the model (tests/data/run-before-issue-58, labkit at
f79ac0f) and files written through it (the session experiment) read into the same types, and
what the lab wrote reads back to the very same document."""
from __future__ import annotations

import json
import math

import pytest

from labkit.core.files import finite
from labkit.core.results import SCHEMA, Epoch, Result, ResultError, read_result
from labkit.core.status import Status

from helpers import ROOT

OLD_RUN = ROOT / "tests" / "data" / "run-before-issue-58"
OLD_FILES = sorted(OLD_RUN.glob("*/results_*.json"))


def as_json(doc: dict) -> dict:
    """What the writer puts on disk (strict JSON: NaN as null)."""
    return json.loads(json.dumps(finite(doc)))


# The guide's results_ps.json, as experiment-guide.md shows it (its keys and example values)
GUIDE_PS = {
    "method": "Parameter Server (PS)", "world_size": 4, "batch_size": 64, "num_workers": 3,
    "start_time": "2025-12-12 10:00:00", "end_time": "2025-12-12 10:15:00",
    "epochs": [{"epoch": 1, "train_loss": 0.5234, "train_accuracy": 85.23, "train_time": 300.5,
                "train_throughput": 512.3, "avg_batch_time": 0.125, "val_loss": 0.4567,
                "val_accuracy": 87.45, "avg_comm_time_pull": 0.03, "avg_comm_time_push": 0.05}],
    "summary": {"avg_train_throughput": 510.2, "avg_train_time_per_epoch": 305.3,
                "best_val_accuracy": 88.67, "avg_comm_time_pull": 0.03, "avg_comm_time_push": 0.05},
    "all_losses": [0.9, 0.7, 0.5, 0.4]}


def test_a_result_file_of_the_guides_scripts_reads(tmp_path):
    path = tmp_path / "results_ps.json"
    path.write_text(json.dumps(GUIDE_PS))
    r = read_result(path)
    assert (r.method, r.world_size, r.batch_size, r.num_workers) == ("Parameter Server (PS)", 4, 64, 3)
    assert r.schema is None and r.status is Status.COMPLETED  # no status: the guide's files are complete
    e = r.epochs[0]
    assert isinstance(e, Epoch) and (e.epoch, e.train_loss, e.val_accuracy) == (1, 0.5234, 87.45)
    assert e.comm == {"pull": 0.03, "push": 0.05} and r.phases == ["pull", "push"]
    # what the guide's files do not have is None, not a made-up number
    assert e.steps is None and e.step_times is None and e.wire is None and r.efficiency is None
    assert r.summary.best_val_accuracy == 88.67 and r.summary.final_val_accuracy is None
    assert r.overall.final_val_accuracy != r.overall.final_val_accuracy  # NaN: not recomputed
    assert r.all_losses == [0.9, 0.7, 0.5, 0.4]


def test_the_overall_figures_are_recomputed_from_the_epochs_where_a_summary_lacks_them():
    doc = {**GUIDE_PS, "summary": {}, "epochs": [
        {**GUIDE_PS["epochs"][0], "epoch": i, "train_throughput": t, "train_time": 10.0 * i,
         "val_accuracy": a, "avg_comm_time_pull": c} for i, t, a, c in ((1, 100.0, 50.0, 0.1), (2, 200.0, 40.0, 0.3))]}
    o = Result.from_dict(doc).overall
    assert o.avg_train_throughput == 150.0 and o.avg_train_time_per_epoch == 15.0
    assert o.best_val_accuracy == 50.0 and math.isclose(o.comm["pull"], 0.2)
    # the summary's own figures win; a phase only the summary times is the summary's
    doc["summary"] = {"avg_train_throughput": 1.0, "avg_comm_time_push": 0.5}
    doc["epochs"] = [{k: v for k, v in e.items() if k != "avg_comm_time_pull"} for e in doc["epochs"]]
    o = Result.from_dict(doc).overall
    assert o.avg_train_throughput == 1.0 and o.comm == {"push": 0.5}
    empty = Result.from_dict({**doc, "epochs": []}).overall
    assert empty.avg_train_throughput == 1.0 and math.isnan(empty.best_val_accuracy)


@pytest.mark.parametrize("path", OLD_FILES, ids=[p.parent.name for p in OLD_FILES])
def test_a_result_file_written_before_the_model_reads_back_to_the_same_document(path):
    doc = json.loads(path.read_text())
    r = read_result(path)
    assert r.schema == SCHEMA and r.status is Status.COMPLETED and r.method_key == path.parent.name
    assert len(r.epochs) == len(doc["epochs"]) and r.epochs[-1].train_loss == doc["epochs"][-1]["train_loss"]
    assert r.efficiency is not None and r.efficiency.precision == doc["efficiency"]["precision"]
    assert as_json(r.to_dict()) == doc


def test_a_null_figure_reads_as_nan_an_absent_one_as_none():
    doc = json.loads(OLD_FILES[0].read_text())
    doc["epochs"][0]["train_throughput"] = None
    doc["epochs"][0]["step_times"] = [0.1, None]
    del doc["epochs"][0]["val_time"]
    doc["config"] = None
    r = Result.from_dict(doc)
    e = r.epochs[0]
    assert math.isnan(e.train_throughput) and e.step_times[0] == 0.1 and math.isnan(e.step_times[1])
    assert e.val_time is None
    assert r.config == {}  # a record that is not one reads as empty, never as None


def test_only_a_figure_reads_null_as_nan_a_count_or_a_list_of_bytes_stays_none():
    """A resumed run reads its checkpoint's document back through the model: an epoch that
    had no optimizer state (None) must not come back as NaN, which the efficiency summary would
    take for a list of bytes."""
    e = Epoch(epoch=1, train_loss=1.0, train_accuracy=2.0, train_time=3.0, train_throughput=4.0,
              steps=5, mfu=None, optimizer_state_bytes=None)
    back = Epoch.from_dict(e.to_dict())
    assert back.optimizer_state_bytes is None and math.isnan(back.mfu)
    assert Epoch.from_dict({**e.to_dict(), "val_samples": None, "steps": None}).steps is None


def test_a_newer_minor_version_reads_with_its_new_keys_kept_another_major_is_refused(tmp_path):
    doc = json.loads(OLD_FILES[0].read_text())
    newer = {**doc, "schema": SCHEMA + ".3", "novelty": {"x": 1},
             "epochs": [{**e, "new_figure": 2.5} for e in doc["epochs"]]}
    r = Result.from_dict(newer)
    assert r.extra == {"novelty": {"x": 1}} and r.epochs[0].extra == {"new_figure": 2.5}
    assert as_json(r.to_dict()) == newer  # nothing dropped on the way
    path = tmp_path / "results_baseline_ddp.json"
    path.write_text(json.dumps({**doc, "schema": "labkit.results/2"}))
    with pytest.raises(ResultError) as e:
        read_result(path)
    assert str(e.value) == (f"{path}: written in schema 'labkit.results/2', which this labkit cannot "
                            f"read (it reads '{SCHEMA}' and the guide's files): update labkit")


@pytest.mark.parametrize("text, why", [
    ('{"method": "Baseline DDP"', "not valid JSON (JSONDecodeError): truncated or corrupt"),
    ('{"epochs": []}', "not a result file (needs 'method' and a list of 'epochs')"),
    ('{"method": "x", "epochs": [{"epoch": 1}]}', "an epoch lacks the guide's keys (epoch, train_loss, "
                                                  "train_accuracy, train_time, train_throughput)"),
])
def test_what_is_not_a_result_file_is_one_line(tmp_path, text, why):
    path = tmp_path / "results_baseline_ddp.json"
    path.write_text(text)
    with pytest.raises(ResultError) as e:
        read_result(path)
    assert str(e.value) == f"{path}: {why}"
    with pytest.raises(ResultError, match="missing"):
        read_result(tmp_path / "none.json")


def test_a_running_file_whose_writer_is_gone_reads_as_stopped():
    doc = json.loads(OLD_FILES[0].read_text())
    gone = {**doc, "status": "running", "heartbeat": {**doc["heartbeat"], "pid": 2 ** 22 + 7,
                                                      "pid_start": "1"}}
    r = Result.from_dict(gone)
    assert r.status is Status.RUNNING  # the document as written
    seen = r.as_seen()
    assert seen.status is Status.STOPPED and seen.error.startswith("stopped without finishing")


def test_files_written_through_the_model_read_back_to_the_same_document_and_keep_every_key(experiment):
    """The session experiment's files (written by ResultFile through the model): each reads back
    to itself, and holds every key a file of the same method held before the model."""
    written = sorted(experiment.run.glob("repeat-*/*/results_*.json")) or sorted(experiment.run.glob("*/results_*.json"))
    assert written
    before = {p.parent.name: json.loads(p.read_text()) for p in OLD_FILES}
    for path in written:
        doc = json.loads(path.read_text())
        assert as_json(read_result(path).to_dict()) == doc, path
        old = before.get(path.parent.name)
        if old is not None:
            assert set(doc) >= set(old) - {"calibration"}, path  # calibration: as configured
            assert set(doc["epochs"][0]) >= set(old["epochs"][0]) - {"replicas"}, path
            assert set(doc["summary"]) == set(old["summary"]), path
