"""Bad input: one clear message naming the problem, a non-zero exit, nothing written."""
from __future__ import annotations

import os

import pytest
import torch

from helpers import TINY, expect_error, torchrun
from labkit.training import rank


@pytest.fixture(autouse=True)
def single_process(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)


def imagefolder_args(d, out):
    return TINY + ["--dataset", "imagefolder", "--data-dir", str(d), "--out", str(out)]


def test_missing_data_dir(tmp_path, capsys):
    out = tmp_path / "out"
    expect_error(imagefolder_args(tmp_path / "nope", out), capsys, "does not exist", "nope")
    assert not out.exists()  # nothing half-written


def test_data_dir_without_val(tmp_path, capsys):
    (tmp_path / "train" / "a").mkdir(parents=True)
    expect_error(imagefolder_args(tmp_path, tmp_path / "o"), capsys, "has no val/ folder")


def test_data_dir_without_train(tmp_path, capsys):
    (tmp_path / "val" / "a").mkdir(parents=True)
    expect_error(imagefolder_args(tmp_path, tmp_path / "o"), capsys, "has no train/ folder")


def test_data_dir_without_images(tmp_path, capsys):
    for s in ("train", "val"):
        (tmp_path / s / "a").mkdir(parents=True)
        (tmp_path / s / "a" / "notes.txt").write_text("x")
    expect_error(imagefolder_args(tmp_path, tmp_path / "o"), capsys, "holds no images")


def test_classes_missing_from_val(tmp_path, capsys, image_tree):
    import shutil
    d = tmp_path / "data"
    shutil.copytree(image_tree, d)
    shutil.rmtree(d / "val" / "dog")
    expect_error(imagefolder_args(d, tmp_path / "o"), capsys, "missing from val/", "dog")


def test_ps_needs_two_processes(tmp_path, capsys):
    expect_error(TINY + ["--method", "ps", "--out", str(tmp_path / "o")], capsys,
                 "ps needs at least 2 processes")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_nccl_without_gpus(tmp_path, capsys):
    expect_error(TINY + ["--backend", "nccl", "--out", str(tmp_path / "o")], capsys,
                 "nccl needs CUDA GPUs")


def test_unknown_method(tmp_path, capsys):
    """--method is open (a class of one's own may be named), so an unknown name is the lab's
    one line, listing the registered methods and how to name one's own."""
    expect_error(TINY + ["--method", "sgd", "--out", str(tmp_path / "o")], capsys,
                 "unknown method 'sgd'", "ddp, allreduce, ps", "path/to/file.py:Class")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("flag,value", [("--model", "vgg16"), ("--dataset", "mnist")])
def test_unknown_workload_names(capsys, flag, value):
    """--model and --dataset are the workload's to decide (labkit.workloads): an unknown one is
    the lab's one line naming it and what the workload offers."""
    expect_error(TINY + [flag, value], capsys, f"unknown {flag[2:]} '{value}' for the images workload",
                 "choose one of", "resnet18" if flag == "--model" else "digits")


@pytest.mark.parametrize("flag,value", [("--amp", "fp8")])
def test_unknown_names(capsys, flag, value):
    with pytest.raises(SystemExit) as e:
        rank.main(TINY + [flag, value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    # the rank's own entry point answers as argparse does: its usage, then one error line,
    # the last, naming the flag, the value and what it may be (`labkit run` says it in one
    # line: test_cli_errors)
    lines = [l for l in err.splitlines() if l.strip()]
    errors = [l for l in lines if "error:" in l]
    assert errors == lines[-1:] and lines[0].startswith("usage: labkit.train"), err
    assert f"invalid choice: '{value}'" in errors[0] and flag in errors[0] and "choose from" in errors[0]
    assert "Traceback" not in err


@pytest.mark.parametrize("flag,value,msg", [
    ("--batch-size", "0", "--batch-size must be at least 1"),
    ("--epochs", "0", "--epochs must be at least 1"),
    ("--lr", "-1", "--lr must be positive"),
    ("--workers", "-2", "--workers must be 0 or more"),
])
def test_out_of_range(tmp_path, capsys, flag, value, msg):
    expect_error(TINY + [flag, value, "--out", str(tmp_path / "o")], capsys, msg)


def test_batch_larger_than_dataset(tmp_path, capsys):
    expect_error(TINY + ["--batch-size", "5000", "--out", str(tmp_path / "o")], capsys,
                 "no full batch per trainer")


def test_missing_weights(tmp_path, capsys):
    expect_error(TINY + ["--weights", str(tmp_path / "resnet50-0676ba61.pth"), "--out", str(tmp_path / "o")],
                 capsys, "resnet50-0676ba61.pth", "not found")


def test_weights_of_another_architecture(tmp_path, capsys):
    from labkit.workloads.images.models import build_model
    w = tmp_path / "r18.pth"
    torch.save(build_model("resnet18", 10)[0].state_dict(), w)
    expect_error(TINY + ["--weights", str(w), "--out", str(tmp_path / "o")], capsys,
                 "does not match model resnet10_small")


def test_weights_not_a_state_dict(tmp_path, capsys):
    w = tmp_path / "junk.pth"
    w.write_bytes(b"this is not a checkpoint")
    expect_error(TINY + ["--weights", str(w), "--out", str(tmp_path / "o")], capsys,
                 "not a loadable state_dict")
    torch.save([1, 2, 3], w)
    expect_error(TINY + ["--weights", str(w), "--out", str(tmp_path / "o")], capsys,
                 "does not hold a state_dict")


def test_weights_with_another_head_are_loaded(tmp_path):
    """ImageNet weights (1000 classes) on a 10-class dataset: backbone loaded, head fresh."""
    from labkit.workloads.images.models import build_model
    src, _ = build_model("resnet10_small", 1000)
    w = tmp_path / "w.pth"
    torch.save(src.state_dict(), w)
    m, note = build_model("resnet10_small", 10, str(w))
    assert "re-initialised for 10 classes" in note
    torch.testing.assert_close(m.conv1.weight, src.conv1.weight)
    assert m.fc.weight.shape == (10, 512)


def test_existing_results_are_never_overwritten(tmp_path, capsys):
    out = tmp_path / "o"
    out.mkdir()
    (out / "results_baseline_ddp.json").write_text("{}")
    expect_error(TINY + ["--out", str(out)], capsys, "already exists")
    assert (out / "results_baseline_ddp.json").read_text() == "{}"


def test_bad_input_under_torchrun_prints_once(tmp_path):
    """Under torchrun every rank sees the bad input; the message appears once, exit is non-zero."""
    proc = torchrun(2, TINY + ["--dataset", "imagefolder", "--data-dir", str(tmp_path / "missing"),
                               "--out", str(tmp_path / "o")], cwd=tmp_path, timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.count("labkit.train: error: data dir") == 1, proc.stderr
    assert not (tmp_path / "o").exists()


def test_output_path_that_cannot_be_created(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    expect_error(TINY + ["--out", str(blocker / "run")], capsys, "cannot create output folder")


def test_more_processes_than_samples():
    from labkit.core.config import ConfigError
    from labkit.training.data import steps_per_epoch
    with pytest.raises(ConfigError, match="4 training processes but only 3 training samples"):
        steps_per_epoch(3, 4, 1, None)


# ------------------------------------------------------------------ labkit's own commands
@pytest.mark.parametrize("command", [["run", "ddp"], ["experiment", "--methods", "ddp"]])
def test_nproc_0_is_bad_input_not_automatic(tmp_path, capsys, monkeypatch, command):
    from labkit import cli
    monkeypatch.chdir(tmp_path)  # the default runs/ would be created here
    code = cli.main(command + ["--nproc", "0", "--dataset", "digits", "--epochs", "1",
                               "--runs-dir" if command[0] == "experiment" else "--out",
                               str(tmp_path / "made")])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [l for l in err.splitlines() if l.strip()]
    assert len(lines) == 1 and f"labkit {command[0]}: error: --nproc must be at least 1 (got 0)" in lines[0], err
    assert "auto" in lines[0]  # says how to ask for the automatic count
    assert os.listdir(tmp_path) == []  # nothing created: no out folder, no runs/


def test_nproc_auto_is_spelled_out(capsys):
    from labkit.cli import build_parser
    for cmd in (["run", "ddp"], ["experiment"]):
        assert build_parser().parse_args(cmd + ["--nproc", "auto"]).nproc is None
        assert build_parser().parse_args(cmd + ["--nproc", "3"]).nproc == 3
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(cmd + ["--nproc", "many"])
        assert e.value.code == 2 and "expected a number of processes or auto" in capsys.readouterr().err


def _option_strings(parser) -> list[str]:
    import argparse
    found = []
    for a in parser._actions:
        found += a.option_strings
        if isinstance(a, argparse._SubParsersAction):
            for sub in a.choices.values():
                found += _option_strings(sub)
    return found


def test_no_flag_reads_no_no():
    from labkit import cli
    from labkit.core import config
    parsers = [cli.build_parser(), config.build_parser()]
    flags = [f for p in parsers for f in _option_strings(p)]
    assert "--no-overlap" in flags and "--no-progress" in flags and "--progress" in flags
    assert not [f for f in flags if f.startswith("--no-no-")]
    ns = config.build_parser().parse_args(["--no-overlap"])
    assert ns.no_overlap is True and config.build_parser().parse_args([]).no_overlap is False


@pytest.mark.parametrize("content", ['{"method": "Manual All-Re', '{"x": 1}', "[1, 2]"])
def test_report_on_a_bad_file_prints_labkit_lines_only(tmp_path, content):
    import subprocess
    import sys
    bad = tmp_path / "results_all_reduce.json"
    bad.write_text(content)
    # -W default: show every warning, as a user's interpreter could
    p = subprocess.run([sys.executable, "-W", "default", "-m", "labkit", "report", str(bad), "--out",
                        str(tmp_path / "rep")], capture_output=True, text=True, timeout=180)
    assert p.returncode == 1
    assert str(bad) in p.stdout  # the problem is named
    for text in (p.stdout, p.stderr):
        assert "Warning" not in text and "No artists" not in text and "Traceback" not in text, text
