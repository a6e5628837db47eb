"""`labkit experiment --continue RUN` when experiment.json is behind the result files (issue 61,
item 7): a SIGKILL in the moment after a method's result file said completed, before the
experiment recorded it, left that method running in experiment.json. Its result file is
complete, so the method is complete: the record follows the result files and the run finishes,
report included. The folder is the session's real experiment (conftest), copied and put back
in the state the kill leaves; nothing is written by hand but that state."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from helpers import HTML_ONLY, labkit, load_json
from labkit.core import layout
from labkit.core.methods import RESULT_FILES
from labkit.core.status import Status

pytestmark = pytest.mark.xdist_group("experiment")  # conftest's session experiment: its worker


def _repeat(entry: dict, i: int) -> dict:
    return next(r for r in entry["repeats"] if r["repeat"] == i)


def killed_copy(experiment, tmp_path: Path) -> tuple[Path, str, str]:
    """The session's experiment copied to tmp_path/runs/ as two moments of a kill leave a method
    of its last repeat; (run, kept, rerun). ``kept``, the last method to run: killed after its
    result file said completed, before experiment.json recorded it (still running there).
    ``rerun``, the one before it: killed half way through its only epoch, its result file
    running too (a writer that is gone), no checkpoint yet. The experiment is left running
    under the heartbeat of its process, which has exited, with no report yet (it is made after
    the last method). Continuation treats each method on its own, so one folder holds both.
    The models (*.pt, 340 MB) are not copied: neither --continue nor the report reads one."""
    run = shutil.copytree(experiment.run, tmp_path / "runs" / experiment.run.name, symlinks=True,
                          ignore=shutil.ignore_patterns("*.pt"))
    status = load_json(run / layout.EXPERIMENT)
    last = len(status["order"])
    *_, rerun, kept = status["order"][-1]
    for m in (kept, rerun):
        status["methods"][m]["status"] = Status.RUNNING
        entry = _repeat(status["methods"][m], last)
        entry["status"] = Status.RUNNING
        entry.pop("wall_time", None)  # recorded when the notebook returned: it did not
    result = layout.method_dir(run, rerun, last, last) / RESULT_FILES[rerun]
    result.write_text(json.dumps({**load_json(result), "status": Status.RUNNING}))
    status["status"] = Status.RUNNING
    for k in ("report", "finished"):
        status.pop(k, None)
    (run / layout.EXPERIMENT).write_text(json.dumps(status))
    shutil.rmtree(run / "report")
    return run, kept, rerun


def test_continue_records_a_complete_result_file_as_complete(experiment, tmp_path):
    assert experiment.returncode == 0, experiment.stderr[-3000:]
    run, kept, rerun = killed_copy(experiment, tmp_path)
    last = len(load_json(run / layout.EXPERIMENT)["order"])
    kept_dir, rerun_dir = (layout.method_dir(run, m, last, last) for m in (kept, rerun))
    kept_bytes = (kept_dir / RESULT_FILES[kept]).read_bytes()
    # --allow-changed-env: the subject is the record, not the environment (a tree edited since
    # the session's experiment ran is named in experiment.json's "continued", and goes on)
    p = labkit(["experiment", "--continue", str(run), "--allow-changed-env"], tmp_path,
               env=HTML_ONLY, timeout=600)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert f"{kept_dir.relative_to(run)}: complete, kept" in p.stdout
    assert (kept_dir / RESULT_FILES[kept]).read_bytes() == kept_bytes  # not rerun
    # the other side: a result file that is not complete is run again (from the start: it
    # left no checkpoint), its attempt kept beside it
    assert f"{rerun_dir.relative_to(run)}: running\n" in p.stdout, p.stdout
    assert rerun_dir.with_name(f"{rerun}.interrupted-1").is_dir()
    assert load_json(rerun_dir / RESULT_FILES[rerun])["status"] == Status.COMPLETED
    # the summary, experiment.json and the report follow the result files
    summary = p.stdout.split("run folder:")[1].split("report:")[0]
    for m in (kept, rerun):
        assert re.search(rf"^\s+{m}\s+{Status.COMPLETED}$", summary, re.M), summary
    assert Status.RUNNING not in summary
    status = load_json(run / layout.EXPERIMENT)
    assert status["status"] == Status.COMPLETED
    assert {m: [e["status"], *(r["status"] for r in e["repeats"])]
            for m, e in status["methods"].items()} == {
        m: [Status.COMPLETED] * (last + 1) for m in status["methods"]}
    assert all("error" not in e for e in status["methods"].values())
    assert (run / "report" / "report.html").stat().st_size > 0
    assert status["report"].endswith("report.html")
    # a second --continue: the run is complete, so it is done (exit 0) and says so, with the
    # run's summary, and writes nothing (docs/lab-notebook.md)
    before = {f: f.read_bytes() for f in run.rglob("*") if f.is_file()}
    again = labkit(["experiment", "--continue", str(run)], tmp_path)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert "the experiment is complete, nothing to continue" in again.stdout
    assert "continuing" not in again.stdout and again.stderr.strip() == ""
    assert re.search(rf"^\s+{rerun}\s+{Status.COMPLETED}$", again.stdout, re.M), again.stdout
    assert {f: f.read_bytes() for f in run.rglob("*") if f.is_file()} == before
