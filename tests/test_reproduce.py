"""labkit.runs.compare and labkit.runs.record: a run and its rerun from one seed agree bit for bit on
CPU; an edited loss or a changed data fingerprint is named; bad input is one clear error; the
environment record installs (format) and a copied run folder still works. The runs are real:
conftest's `reproduced` (a point of a real sweep, copied, and its `labkit reproduce`)."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from helpers import HTML_ONLY, labkit, load_json, snapshot_tree
from labkit.runs import record
from labkit.runs import compare
from labkit.core import layout, lockfile
from labkit.core.config import ConfigError
from labkit.core.run_folder import RunFolder
from labkit.runs.compare import DIFFERENT, IDENTICAL, WITHIN, ReproduceError

# conftest's `reproduced` is this module's and test_lab_notebook's: one xdist group, so that one
# worker builds it and reads it while the other goes on (in two groups, the second worker to
# ask would wait on the first's build)
pytestmark = pytest.mark.xdist_group("labnotebook")


@pytest.fixture(scope="module")
def runs(reproduced):
    """Two runs of one config from one seed, each trained on its own: a run folder written by
    labkit (a sweep's point, copied) and its reproduction (read-only: tests change copies)."""
    return reproduced.original, reproduced.run


def steps_of(run: Path) -> int:
    """The training steps the run's config asked for."""
    train = load_json(run / "config.json")["train"]
    return train["epochs"] * train["max_steps_per_epoch"]


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_json(path: Path, change) -> None:
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))


def test_same_seed_twice_is_identical(runs, tmp_path):
    # the reproduction's own reproduction.json is rewritten below: on a copy
    a, b = RunFolder.experiment(runs[0]), RunFolder.experiment(copy_run(runs[1], tmp_path / "b"))
    doc = compare.compare_runs(a, b)
    v = doc["methods"]["ddp"]
    assert v["verdict"] == IDENTICAL, v
    assert v["max_abs_diff"] == 0.0 and v["first_divergence"] is None
    assert v["compared"]["steps"] == steps_of(runs[0]) and v["compared"]["parameters"] > 10
    assert doc["reproduced"] is True
    assert doc["environment"] == []  # same machine, same code, same packages and data
    # the timings are compared (a ratio), never for equality
    assert v["timing"]["speed_ratio"] > 0
    assert compare.summary_lines(doc) == ["ddp: identical"]
    path = compare.write_reproduction(b.path, doc)
    written = json.loads(path.read_text())
    assert written["reproduction"] == "." and written["original"] == str(a.path)
    assert written["methods"]["ddp"]["verdict"] == IDENTICAL


def test_an_edited_loss_is_different_at_its_step(runs, tmp_path):
    a = RunFolder.experiment(runs[0])
    c = copy_run(runs[1], tmp_path / "c")
    res = c / "ddp" / "results_baseline_ddp.json"
    edit_json(res, lambda d: d["epochs"][0]["all_losses"].__setitem__(
        2, d["epochs"][0]["all_losses"][2] + 1e-3))
    doc = compare.compare_runs(a, RunFolder.experiment(c))
    v = doc["methods"]["ddp"]
    assert v["verdict"] == DIFFERENT and doc["reproduced"] is False
    assert v["first_divergence"]["step"] == 3 and v["first_divergence"]["metric"] == "loss"
    assert any("first differs at step 3 (epoch 1, step 3)" in r for r in v["reasons"]), v["reasons"]
    assert v["max_abs_diff"] == pytest.approx(1e-3, rel=1e-3)
    # with a tolerance above the edit it is equal within tolerance, and says by how much
    loose = compare.compare_runs(a, RunFolder.experiment(c), tolerance=1e-2)
    assert loose["methods"]["ddp"]["verdict"] == WITHIN and loose["reproduced"] is True
    assert "max abs difference 0.001" in compare.summary_lines(loose)[0]


def test_a_changed_final_parameter_is_named(runs, tmp_path):
    import torch

    a = RunFolder.experiment(runs[0])
    c = copy_run(runs[1], tmp_path / "c")
    sd = torch.load(c / "ddp" / "final_model.pt", weights_only=True)
    name = next(k for k, t in sd.items() if t.is_floating_point())
    sd[name].view(-1)[0] += 0.5
    torch.save(sd, c / "ddp" / "final_model.pt")
    v = compare.compare_runs(a, RunFolder.experiment(c))["methods"]["ddp"]
    assert v["verdict"] == DIFFERENT
    assert v["first_divergence"]["metric"] == f"final parameter {name}"
    assert v["max_abs_diff"] == pytest.approx(0.5, rel=1e-3)


def test_a_changed_data_fingerprint_is_reported(runs, tmp_path):
    a = RunFolder.experiment(runs[0])
    d = copy_run(runs[1], tmp_path / "d")
    edit_json(d / "environment.json", lambda e: e["data"]["ddp"].update(sha256="0" * 64))
    doc = compare.compare_runs(a, RunFolder.experiment(d))
    v = doc["methods"]["ddp"]
    assert v["verdict"] == DIFFERENT
    assert v["reasons"][0].startswith("data fingerprint differs (digits: recorded ")
    assert v["data"]["reproduced"]["sha256"] == "0" * 64
    assert any(l.startswith("data (ddp): data fingerprint differs") for l in doc["environment"])


def test_environment_diff_names_commit_packages_and_threads(runs):
    env = compare.load_environment(RunFolder.experiment(runs[0]))
    other = json.loads(json.dumps(env))
    other["git"].update(commit="f" * 40, dirty=True, diff_sha256="ab" * 32)
    other["package_versions"]["torch"] = "0.0.1"
    del other["package_versions"]["numpy"]
    other["determinism"]["torch_num_threads"] = 64
    lines = compare.environment_diff(env, other)
    assert f"code: recorded {env['git']['commit'][:10]}" in lines[0] and "now ffffffffff (dirty, diff abab" in lines[0]
    assert any(l.startswith(f"packages changed: torch {env['package_versions']['torch']} -> 0.0.1") for l in lines)
    assert any(l.startswith("packages missing now: numpy ") for l in lines)
    assert f"torch_num_threads: recorded {env['determinism']['torch_num_threads']}, now 64" in lines
    # each rank 0 recorded its own thread count in its result file
    assert env["rank_determinism"]["ddp"]["torch_num_threads"] >= 1


def test_a_copied_run_folder_still_works(runs, tmp_path):
    """(`labkit report` of a copied run folder: test_labkit_reproduce_runs_latest_identical_and_
    relocatable, on the reproduction's copy.)"""
    moved = copy_run(runs[0], tmp_path / "moved")
    for name in ("config.json", "environment.json", "experiment.json"):
        text = (moved / name).read_text()
        assert str(runs[0]) not in text, name  # nothing points back at the original place
    nb = json.loads((moved / "experiment.json").read_text())["methods"]["ddp"]["notebook"]
    assert nb == "ddp/run_method.ipynb"
    assert layout.resolve_in_run(moved, nb) == moved / "ddp" / "run_method.ipynb"
    assert (moved / "ddp" / "run_method.ipynb").is_file()
    rec = RunFolder.experiment(moved)
    assert compare.load_environment(rec)["package_versions"]  # its lock, found in the copy
    assert compare.compare_runs(rec, RunFolder.experiment(runs[1]))["reproduced"]


def test_portable_paths():
    run = "/x/runs/r1"
    doc = {"run_dir": run, "nb": f"{run}/ddp/run_method.ipynb", "data_dir": "/data/imagenet",
           "cmd": f"python -m torch.distributed.run --log-dir={run}/ddp/logs --out {run}/ddp",
           "other": "/x/runs/r10/ddp", "n": 3}
    assert layout.portable(doc, run) == {
        "run_dir": ".", "nb": "ddp/run_method.ipynb", "data_dir": "/data/imagenet",
        "cmd": "python -m torch.distributed.run --log-dir=ddp/logs --out ddp",
        "other": "/x/runs/r10/ddp", "n": 3}


# ------------------------------------------------------------------ bad input
def one_line_error(call, *needles) -> str:
    with pytest.raises(ReproduceError) as e:
        call()
    msg = str(e.value)
    assert isinstance(e.value, ConfigError) and "\n" not in msg, msg
    for n in needles:
        assert n in msg, msg
    return msg


def test_bad_run_folders_are_one_clear_error(runs, tmp_path):
    before = sorted(p.name for p in tmp_path.iterdir())
    one_line_error(lambda: RunFolder.experiment(tmp_path / "nope"), "does not exist")
    (tmp_path / "file.txt").write_text("x")
    one_line_error(lambda: RunFolder.experiment(tmp_path / "file.txt"), "is not a folder")
    (tmp_path / "empty").mkdir()
    one_line_error(lambda: RunFolder.experiment(tmp_path / "empty"), "is not a run folder")
    missing = copy_run(runs[0], tmp_path / "missing")
    (missing / "config.json").unlink()
    one_line_error(lambda: RunFolder.experiment(missing), "has no config.json")
    corrupt = copy_run(runs[0], tmp_path / "corrupt")
    text = (corrupt / "config.json").read_text()
    (corrupt / "config.json").write_text(text[: len(text) // 2])
    one_line_error(lambda: RunFolder.experiment(corrupt), "config.json' is not valid JSON (line")
    (corrupt / "config.json").write_text(json.dumps({"hello": 1}))
    one_line_error(lambda: RunFolder.experiment(corrupt), "is not a labkit experiment config")
    a = RunFolder.experiment(runs[0])
    one_line_error(lambda: compare.compare_runs(a, a, methods=["ps"]), "has no method ps",
                   "(it ran: ddp)")
    one_line_error(lambda: compare.compare_runs(a, a, tolerance=-1.0), "--tolerance")
    # nothing was written by any of these
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(before + ["file.txt", "empty", "missing", "corrupt"])
    assert not (Path(runs[0]) / layout.REPRODUCTION).exists()


# ------------------------------------------------------------------ the environment record
def test_requirements_lock_is_pip_installable_format(runs):
    import torch

    text = (runs[0] / layout.LOCK).read_text()
    reqs = {}
    for line in text.splitlines():
        assert line.startswith("#") or (line.count("==") == 1 and " " not in line), line
        if not line.startswith("#"):
            try:
                from packaging.requirements import Requirement
            except ImportError:  # pragma: no cover - packaging ships with pip's environments
                name, _, ver = line.partition("==")
            else:
                r = Requirement(line)
                (spec,) = r.specifier
                assert spec.operator == "==" and not r.marker and not r.url, line
                name, ver = r.name, spec.version
            key = lockfile.normalize(name)
            assert key not in reqs, f"{name} twice"
            reqs[key] = ver
    from importlib.metadata import version

    # the distribution's version (torch.__version__ may add a local build tag, +cu130)
    assert reqs["torch"] == version("torch") and torch.__version__.startswith(reqs["torch"])
    assert "numpy" in reqs
    assert "labkit" not in reqs and "# labkit==" in text  # this project: a comment, not a pin
    assert lockfile.parse_lock(text) == reqs
    assert len(reqs) > 50


def test_requirements_lock_comments_out_what_no_index_has():
    dists = {"labkit": {"name": "labkit", "version": "0.1.0", "direct_url": "editable: file:///w"},
             "my-tool": {"name": "My_Tool", "version": "1.0", "direct_url": "file:///src/my_tool"},
             "typing-extensions": {"name": "typing_extensions", "version": "4.12.2", "direct_url": None}}
    lines = lockfile.requirements_lock(dists).splitlines()
    assert "typing_extensions==4.12.2" in lines
    assert any(l.startswith("# My_Tool==1.0  (not from an index: file:///src/my_tool)") for l in lines)
    assert lockfile.parse_lock("\n".join(lines)) == {"typing-extensions": "4.12.2"}


def test_data_fingerprints(tmp_path):
    from helpers import make_image_tree
    from labkit.core.config import TrainConfig
    from labkit.workloads import resolve

    tree = make_image_tree(tmp_path / "img", n_train=2, n_val=1)
    cfg = resolve(TrainConfig(data_dir=str(tree)), False, 2)
    fp = record.data_fingerprint(cfg)
    assert fp["dataset"] == "imagefolder" and fp["classes"] == 2 and fp["images"] == 6
    # no change: same fingerprint; a touched file: new sha256, same layout; new content size: both
    assert record.data_fingerprint(cfg) == fp
    img = tree / "train" / "cat" / "0.png"
    st = img.stat()
    import os
    os.utime(img, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    touched = record.data_fingerprint(cfg)
    assert touched["sha256"] != fp["sha256"] and touched["layout_sha256"] == fp["layout_sha256"]
    img.write_bytes(img.read_bytes() + b"\0")
    grown = record.data_fingerprint(cfg)
    assert grown["layout_sha256"] != fp["layout_sha256"]
    syn = resolve(TrainConfig(dataset="synthetic"), False, 2)
    assert record.data_fingerprint(syn)["image_size"] == 224
    assert (record.data_fingerprint(syn)["sha256"]
            != record.data_fingerprint(resolve(TrainConfig(dataset="synthetic", num_classes=10), False, 2))["sha256"])


# ------------------------------------------------------------------ the command, end to end
# (one thread per rank as the recorded runs had, helpers.labkit; no Chromium: the report is
# written as HTML only, a few seconds quicker: these tests read the HTML, test_experiment's
# session experiment checks the PDF)


def test_labkit_reproduce_runs_latest_identical_and_relocatable(reproduced, tmp_path):
    """A copied run folder (cp -r), reached through runs/latest (conftest's `reproduced` ran
    `labkit reproduce runs/latest` on it): the reproduction lands in a new folder beside it, is
    identical, exit 0; the report says so; the new folder names no absolute path of its own and
    still reports after it is copied elsewhere."""
    p, orig, before = reproduced, reproduced.original, reproduced.before
    runs_dir = orig.parent
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = p.stdout
    # the environment is compared before anything runs
    assert out.index("environment now vs recorded:") < out.index("=== ddp: 2 processes ===")
    assert "verdict per method:\n  ddp: identical\n" in out and "REPRODUCED: 1 of 1 methods" in out
    (new,) = runs_dir.glob("*_repro")
    assert new == reproduced.run
    assert os.readlink(runs_dir / "latest") == new.name  # the link moved; the original did not
    assert snapshot_tree(orig) == before  # never written to
    doc = json.loads((new / layout.REPRODUCTION).read_text())
    # compared with the original, not with itself through the moved link
    assert doc["original"] == str(orig.resolve()) and doc["reproduction"] == "."
    assert (doc["methods"]["ddp"]["verdict"] == IDENTICAL
            and doc["methods"]["ddp"]["compared"]["steps"] == steps_of(orig))
    assert doc["methods"]["ddp"]["timing"]["speed_ratio"] > 0
    html = (new / "report" / "report.html").read_text()
    assert f"Reproduction of {orig.name}: reproduced (1 identical)" in html
    assert "<details><summary>" in html and "Python packages installed" in html
    # relocatable: nothing the run wrote about itself names its absolute place
    for f in ("config.json", "environment.json", "experiment.json", "reproduction.json",
              "ddp/launch.json", "ddp/results_baseline_ddp.json"):
        assert str(new) not in (new / f).read_text(), f
    assert json.loads((new / "ddp" / "results_baseline_ddp.json").read_text())["config"]["out"] == "."
    nb = json.loads((new / "ddp" / "run_method.ipynb").read_text())
    injected = next(c for c in nb["cells"] if "injected-parameters" in c["metadata"].get("tags", []))
    assert 'out = "."\n' in injected["source"]
    # a copied run folder still reports (its performance_report.txt made from the copy alone)
    moved = copy_run(new, tmp_path / "moved")
    r = labkit(["report", moved], cwd=tmp_path, env=HTML_ONLY)
    assert r.returncode == 0, r.stderr
    text = (moved / "report" / "performance_report.txt").read_text()
    assert f"Reproduction of {orig.name}: reproduced (1 identical)" in text


def test_labkit_reproduce_names_an_edited_loss_and_exits_1(runs, tmp_path):
    """The issue's check: a recorded loss edited by 1e-3 at step 3 makes the method different,
    named at that step, with a non-zero exit; the reproduction goes where --out says."""
    rec = copy_run(runs[0], tmp_path / "rec")
    edit_json(rec / "ddp" / "results_baseline_ddp.json", lambda d: d["epochs"][0]["all_losses"].__setitem__(
        2, d["epochs"][0]["all_losses"][2] + 1e-3))
    p = labkit(["reproduce", rec, "--out", tmp_path / "elsewhere"], cwd=tmp_path, env=HTML_ONLY)
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    assert "  ddp: different\n    first differs at step 3 (epoch 1, step 3): loss" in p.stdout
    assert "NOT REPRODUCED: 0 of 1 methods" in p.stdout
    (new,) = (tmp_path / "elsewhere").glob("*_repro")
    v = json.loads((new / layout.REPRODUCTION).read_text())["methods"]["ddp"]
    assert v["verdict"] == DIFFERENT and v["first_divergence"]["step"] == 3
    assert not list(tmp_path.glob("*_repro"))  # not beside the recorded run


def fake_run(root: Path, name: str, config) -> Path:
    """A run folder's files without training: enough for the checks made before a run."""
    run = root / name
    run.mkdir()
    (run / "experiment.json").write_text("{}")
    if config is not None:
        (run / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return run


def test_labkit_reproduce_bad_input_is_one_line_exit_2(tmp_path, capsys):
    from labkit import cli
    from labkit.core.config import TrainConfig

    good = {"experiment": {"methods": ["ddp"], "nproc": 2},
            "resolved": {"ddp": TrainConfig(method="ddp", dataset="digits").to_dict()}}
    (tmp_path / "plain").mkdir()
    (tmp_path / "sweep").mkdir()
    (tmp_path / "sweep" / "sweep.json").write_text("{}")
    fake_run(tmp_path / "sweep", "bucket_mb-25.0", good)
    cases = [
        ([str(tmp_path / "plain")], "is not a run folder (no config.json"),
        ([str(tmp_path / "sweep")], "is a sweep's folder: give one of its points (bucket_mb-25.0)"),
        ([str(fake_run(tmp_path, "noconfig", None))], "has no config.json"),
        ([str(fake_run(tmp_path, "corrupt", '{"experiment": {"me'))], "config.json' is not valid JSON (line 1"),
        ([str(fake_run(tmp_path, "good", good)), "--methods", "ddp,ps"], "has no method ps (it ran: ddp)"),
        ([str(tmp_path / "good"), "--out", str(tmp_path / "good" / "sub")], "is inside the run folder"),
        ([str(tmp_path / "good"), "--tolerance", "-1"], "--tolerance must be 0 or more"),
    ]
    before = snapshot_tree(tmp_path)
    for argv, needle in cases:
        code = cli.main(["reproduce", *argv])
        captured = capsys.readouterr()
        lines = [l for l in captured.err.splitlines() if l.strip()]
        assert code == 2, (argv, captured.err)
        assert len(lines) == 1 and lines[0].startswith("labkit reproduce: error: "), captured.err
        assert needle in lines[0], (needle, lines[0])
        assert captured.out == ""  # nothing printed before the check: nothing ran
    assert snapshot_tree(tmp_path) == before  # nothing created
