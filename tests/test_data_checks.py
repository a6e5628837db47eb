"""Corrupt or unreadable images in an imagefolder dataset: one clear error naming them before
anything starts, or, with --skip-bad-images, left out with one warning."""
from __future__ import annotations

import dataclasses
import io
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

from helpers import TINY, check_ok, expect_error, load_json, torchrun
from labkit.training import preflight
from labkit.core.config import ConfigError, TrainConfig
from labkit.workloads.images.image_sets import build_datasets, check_image
from labkit.launch.launch import validate

# the two bad files of the `bad_tree` fixture, as paths under the dataset root
TRUNCATED = os.path.join("train", "cat", "0.png")
NOT_AN_IMAGE = os.path.join("val", "dog", "notes.jpg")


@pytest.fixture(autouse=True)
def single_process(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)


@pytest.fixture
def bad_tree(tmp_path, image_tree):
    """image_tree (2 classes, 6 train + 3 val images each) with a truncated PNG in train/ and
    text saved as a .jpg in val/: 11 good train images, 6 good val images."""
    d = tmp_path / "data"
    shutil.copytree(image_tree, d)
    png = d / TRUNCATED
    png.write_bytes(png.read_bytes()[:len(png.read_bytes()) // 2])
    (d / NOT_AN_IMAGE).write_text("<html>404 Not Found</html>\n")
    return d


def args(d, out, *more):
    return TINY + ["--dataset", "imagefolder", "--data-dir", str(d), "--out", str(out),
                   "--batch-size", "2", *more]


def resolved(d, **kw):
    return preflight.preflight(TrainConfig(dataset="imagefolder", data_dir=str(d), model="resnet10_small",
                                       progress=False, **kw), world=1, local_world=1)


# ------------------------------------------------------------------ without --skip-bad-images
def test_corrupt_image_is_named_with_the_flag(tmp_path, capsys, bad_tree):
    out = tmp_path / "out"
    t0 = time.monotonic()
    err = expect_error(args(bad_tree, out), capsys, str(bad_tree / TRUNCATED),
                       "2 unreadable or corrupt image(s)", "--skip-bad-images")
    assert time.monotonic() - t0 < 10, err
    assert not out.exists()  # nothing half-written


def test_launcher_validate_names_the_corrupt_file(tmp_path, bad_tree):
    cfg = TrainConfig(dataset="imagefolder", data_dir=str(bad_tree), model="resnet10_small",
                      batch_size=2, out=str(tmp_path / "o"))
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as e:
        validate(cfg, nproc=2)
    assert time.monotonic() - t0 < 10
    msg = str(e.value)
    assert str(bad_tree / TRUNCATED) in msg and "2 unreadable" in msg and "--skip-bad-images" in msg
    assert "\n" not in msg


def test_text_saved_as_jpg_is_named(tmp_path, capsys, image_tree):
    d = tmp_path / "data"
    shutil.copytree(image_tree, d)
    (d / NOT_AN_IMAGE).write_text("not an image")
    expect_error(args(d, tmp_path / "o"), capsys, str(d / NOT_AN_IMAGE), "1 unreadable",
                 "not an image PIL can read")


# the check in a root test run (CI, containers): root reads any file through its capabilities
# CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH, so the check runs as root without them (setpriv
# takes them out of the bounding and inheritable sets before exec); root then meets a file's
# mode bits like any owner, and still enters the checkout and venv it owns, however private
# their folders (a clone under /root or mktemp -d, mode 0700: issue 61, item 8)
WITHOUT_DAC = ["setpriv", "--inh-caps=-all", "--bounding-set=-dac_override,-dac_read_search"]
CHECK = ("import sys\nfrom labkit.training import rank\nsys.exit(rank.main(sys.argv[1:]))\n")


def test_unreadable_file_is_named(tmp_path, capsys, image_tree):
    d = tmp_path / "data"
    shutil.copytree(image_tree, d)
    (d / "val" / "cat" / "1.png").chmod(0)
    if os.geteuid() != 0:
        expect_error(args(d, tmp_path / "o"), capsys, str(d / "val" / "cat" / "1.png"), "Permission denied")
        return
    assert shutil.which("setpriv"), "setpriv (util-linux) drops root's capabilities for the check"
    p = subprocess.run([*WITHOUT_DAC, sys.executable, "-c", CHECK, *args(d, tmp_path / "o")],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    lines = [l for l in p.stderr.splitlines() if l.strip()]
    assert p.returncode == 2, p.stdout + p.stderr
    assert len(lines) == 1 and lines[0].startswith("labkit.train: error: "), p.stderr
    assert str(d / "val" / "cat" / "1.png") in lines[0] and "Permission denied" in lines[0], lines
    assert "Traceback" not in p.stderr


def test_truncated_jpeg_is_found_and_trailing_bytes_are_not(tmp_path):
    from PIL import Image

    buf = io.BytesIO()
    Image.effect_noise((96, 96), 50).convert("RGB").save(buf, "JPEG", quality=95)
    whole = buf.getvalue()
    (tmp_path / "whole.jpg").write_bytes(whole)
    (tmp_path / "cut.jpg").write_bytes(whole[:len(whole) * 2 // 3])  # header intact, data cut
    (tmp_path / "trailing.jpg").write_bytes(whole + b"\0" * 4096)     # valid, bytes after EOI
    assert check_image(str(tmp_path / "whole.jpg")) is None
    assert check_image(str(tmp_path / "trailing.jpg")) is None
    assert "truncated" in check_image(str(tmp_path / "cut.jpg"))


# ------------------------------------------------------------------ with --skip-bad-images
def test_skip_bad_images_leaves_them_out(bad_tree):
    ds = build_datasets(resolved(bad_tree, skip_bad_images=True))
    assert (len(ds.train), len(ds.val)) == (11, 6)
    used = {os.path.normpath(p) for p, _ in ds.train.samples + ds.val.samples}
    assert str(bad_tree / TRUNCATED) not in used and str(bad_tree / NOT_AN_IMAGE) not in used
    assert ds.num_classes == 2
    assert "left out 2 unreadable or corrupt image(s)" in ds.warning
    assert TRUNCATED in ds.warning and NOT_AN_IMAGE in ds.warning
    ds.train[0], ds.val[len(ds.val) - 1]  # what is left loads


def test_class_left_without_images_is_an_error(tmp_path, capsys, image_tree):
    d = tmp_path / "data"
    shutil.copytree(image_tree, d)
    for p in (d / "val" / "dog").iterdir():
        p.write_bytes(b"garbage")
    expect_error(args(d, tmp_path / "o", "--skip-bad-images"), capsys,
                 "no readable image left", "dog", str(d / "val"))


def test_launcher_validate_accepts_skip_bad_images(tmp_path, bad_tree):
    cfg = TrainConfig(dataset="imagefolder", data_dir=str(bad_tree), model="resnet10_small",
                      batch_size=2, out=str(tmp_path / "o"))
    with pytest.raises(ConfigError):  # the bad images refuse the run ...
        validate(cfg, nproc=2)
    checked = validate(dataclasses.replace(cfg, skip_bad_images=True), nproc=2)  # ... unless skipped
    assert checked.skip_bad_images and checked.data_dir == str(bad_tree)


def test_torchrun_with_skip_bad_images_warns_once(tmp_path, bad_tree):
    out = tmp_path / "o"
    proc = torchrun(2, args(bad_tree, out, "--skip-bad-images"), cwd=tmp_path)
    check_ok(proc)
    text = proc.stdout + proc.stderr
    assert text.count("labkit.train: warning: --skip-bad-images: left out 2 ") == 1, text
    r = load_json(out / "results_baseline_ddp.json")
    assert r["status"] == "completed" and r["config"]["skip_bad_images"] is True


def test_digits_are_sklearns_images_with_a_fixed_stratified_split():
    """The digits set reads scikit-learn's own file (checked here against load_digits); the
    split keeps every class's share and is the same on every call, whatever the seed."""
    from sklearn.datasets import load_digits

    d = load_digits()
    a = build_datasets(TrainConfig(dataset="digits", seed=1, image_size=16))
    b = build_datasets(TrainConfig(dataset="digits", seed=7, image_size=16))
    ya, yb = a.train.tensors[1], b.train.tensors[1]
    assert torch.equal(ya, yb) and torch.equal(a.val.tensors[0], b.val.tensors[0])
    assert len(a.train) + len(a.val) == len(d.target) == 1797
    labels = torch.cat([ya, a.val.tensors[1]]).bincount()
    assert labels.tolist() == torch.tensor(d.target).bincount().tolist()
    for c, n in enumerate(torch.tensor(d.target).bincount().tolist()):
        assert abs(int((a.val.tensors[1] == c).sum()) - 0.2 * n) <= 0.5
    # RGB at the side asked for, normalised over the training images
    x = a.train.tensors[0]
    assert x.shape[1:] == (3, 16, 16) and abs(float(x.mean())) < 1e-4
    big = build_datasets(TrainConfig(dataset="digits", image_size=32)).train.tensors[0]
    assert big.shape == (x.shape[0], 3, 32, 32)


def test_digits_default_to_16_pixels_and_other_sets_keep_theirs():
    """The embedded default trains on digits at 16x16 (twice the scans' 8x8); synthetic and
    imagefolder keep 32 for _small models and 224 otherwise; --image-size wins everywhere."""
    from labkit.workloads import resolve

    def side(**kw) -> int:
        return resolve(TrainConfig(**kw), cuda_available=False, world_size=4).image_size

    assert side() == 16  # no GPU, no --data-dir: digits
    assert side(dataset="synthetic", model="resnet10_small") == 32
    assert side(dataset="synthetic") == 224
    assert side(dataset="imagefolder", data_dir="x", model="resnet18_small") == 32
    assert side(image_size=24) == 24


def test_digits_larger_than_memory_allows_are_refused():
    """digits are upsampled in memory in every process: a side that would take gigabytes per
    process is one clear error, not an out-of-memory kill."""
    from labkit.core.config import ConfigError
    from labkit.workloads.images import DIGITS_MAX_SIDE
    from labkit.workloads import resolve

    assert resolve(TrainConfig(image_size=DIGITS_MAX_SIDE), False, 4).image_size == DIGITS_MAX_SIDE
    gib = 1797 * 3 * 512 * 512 * 4 / 2**30  # float32 RGB images of all 1,797 scans
    with pytest.raises(ConfigError, match=rf"--image-size 512 is too large for digits: .* {gib:.1f} GiB in every process"):
        resolve(TrainConfig(image_size=512), False, 4)
    # other datasets are not held upsampled in memory
    assert resolve(TrainConfig(dataset="synthetic", image_size=512), False, 4).image_size == 512


def test_in_memory_data_gets_loader_workers_only_on_gpus():
    """CPU ranks batch in-memory data themselves (workers would take their cores); GPU ranks
    get workers, as the main thread's batching left an H100 waiting 64% of each step."""
    from labkit.core.config import TrainConfig
    from labkit.training.data import default_workers

    assert default_workers(TrainConfig(backend="gloo"), True, 4) == 0
    assert 1 <= default_workers(TrainConfig(backend="nccl"), True, 1) <= 4
    assert default_workers(TrainConfig(backend="nccl", workers=0), True, 1) == 0  # --workers wins
    assert default_workers(TrainConfig(backend="gloo"), False, 1) >= 1
