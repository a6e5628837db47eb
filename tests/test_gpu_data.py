"""The GPU data path and the efficiency figures, checked where they can be on a CPU (seconds):
the device-side batches and the JPEG decoding run on the CPU device here with the same code
(labkit.training.gpu_data, labkit.workloads.images.gpu_decode), FLOPs are counted on the meta
device, MFU is arithmetic, and the report's data-loader flag reads a handmade result. The CUDA
runs are tests/test_gpu_ranks.py."""
from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

from helpers import ROOT, expect_error
from labkit.core import efficiency
from labkit.core.config import ConfigError, TrainConfig
from labkit.workloads import resolve
from labkit.training import gpu_data
from labkit.training.data import ShardSampler, make_loader, train_sampler
from labkit.workloads.images import gpu_decode
from labkit.workloads.images.image_sets import SyntheticImages, build_datasets
from labkit.workloads.images.jpeg_files import JpegFiles

sys.path.insert(0, str(ROOT / "tools"))
import make_jpeg_folder  # noqa: E402


@pytest.fixture(autouse=True)
def single_process(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)


@pytest.fixture(scope="module")
def jpeg_tree(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("jpegs")
    assert make_jpeg_folder.main([str(root), "--train", "24", "--val", "12", "--classes", "3",
                                  "--procs", "1"]) == 0
    return root


def _batches(loader):
    return [(x.clone(), y.clone()) for x, y in loader]


@pytest.mark.parametrize("kind", ["synthetic", "tensors"])
def test_device_batches_are_the_dataloaders_bit_for_bit(kind):
    if kind == "synthetic":
        ds = SyntheticImages(100, 8, 10, seed=1)
    else:
        ds = TensorDataset(torch.randn(100, 3, 8, 8), torch.randint(0, 10, (100,)))
    sampler = train_sampler(ds, 3, 1, seed=5)
    sampler.set_epoch(2)
    ref = _batches(make_loader(ds, sampler, 8, 0, False, drop_last=True, seed=0))
    got = _batches(gpu_data.DeviceBatches(*gpu_data._on_device(ds, torch.device("cpu")), sampler,
                                          8, drop_last=True))
    assert len(got) == len(ref) == 100 // 3 // 8
    for (a, b), (c, d) in zip(got, ref):
        assert torch.equal(a, c) and torch.equal(b, d)
    val = ShardSampler(len(ds), 3, 1)  # no drop_last: the last batch is short
    ref = _batches(make_loader(ds, val, 8, 0, False, drop_last=False, seed=0))
    got = _batches(gpu_data.DeviceBatches(*gpu_data._on_device(ds, torch.device("cpu")), val, 8,
                                          drop_last=False))
    assert [len(y) for _, y in got] == [len(y) for _, y in ref] == [8, 8, 8, 8, 1]
    assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(got, ref))


def _cfg(root, **kw) -> TrainConfig:
    return resolve(TrainConfig(dataset="imagefolder", data_dir=str(root), model="resnet10",
                               image_size=32, batch_size=4, progress=False, **kw), False)


def _decoded(root, split_cfg_decode: str):
    cfg = _cfg(root)
    cfg.decode = split_cfg_decode  # resolve() refuses gpu without CUDA; the code is the same
    return cfg, build_datasets(cfg)


def test_decoded_jpegs_match_the_cpu_path(jpeg_tree):
    """The JPEG path on the CPU device: same files, labels and order as ImageFolder's; the
    validation transform within rounding of PIL's (uint8 resize there, float here); the
    training crops drawn from the loader's generator (same seed, same batch)."""
    cfg, cpu = _decoded(jpeg_tree, "cpu")
    _, files = _decoded(jpeg_tree, "gpu")
    assert isinstance(files.train, JpegFiles)
    assert files.train.samples == cpu.train.samples and files.val.samples == cpu.val.samples
    val = ShardSampler(len(cpu.val), 2, 1)
    ref = _batches(make_loader(cpu.val, val, 4, 0, False, drop_last=False, seed=0))
    train_dl, val_dl = gpu_data.make_loaders(cfg, files, train_sampler(files.train, 2, 1, 0), val, 0,
                                             torch.device("cpu"), seed=0)
    got = _batches(val_dl)
    assert [y.tolist() for _, y in got] == [y.tolist() for _, y in ref]
    for (a, _), (b, _) in zip(got, ref):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert (a - b).abs().mean() < 0.03  # normalised units: ~2/255 / std
    train_dl.generator.manual_seed(7)
    first = _batches(train_dl)
    train_dl.generator.manual_seed(7)
    again = _batches(train_dl)
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(first, again))
    assert first[0][0].shape == (4, 3, 32, 32)
    cpu_train = make_loader(cpu.train, train_sampler(cpu.train, 2, 1, 0), 4, 0, False, True, 0)
    assert [y.tolist() for _, y in first] == [y.tolist() for _, y in cpu_train]


def test_crop_box_is_torchvisions_rule():
    rng = random.Random(0)
    for _ in range(200):
        h, w = rng.randint(20, 600), rng.randint(20, 600)
        t, l, ch, cw = gpu_decode.crop_box(h, w, rng)
        assert 0 <= t <= h - ch and 0 <= l <= w - cw and ch > 0 and cw > 0
    assert gpu_decode.crop_box(10, 1000, random.Random(0), scale=(1.0, 1.0)) == (0, 493, 10, 13)


def test_a_file_the_gpu_decoder_cannot_read_is_named_or_left_out(tmp_path, jpeg_tree, image_tree):
    import shutil

    d = tmp_path / "mixed"
    shutil.copytree(jpeg_tree, d)
    png = next((image_tree / "train" / "cat").glob("*.png"))
    shutil.copy(png, d / "train" / "c0000" / "a.png")
    cfg, _ = _decoded(jpeg_tree, "gpu")
    cfg.data_dir = str(d)
    with pytest.raises(ConfigError, match=r"1 image\(s\) .*\(not JPEG\), the first: train/c0000/a.png"):
        build_datasets(cfg)
    cfg.skip_bad_images = True
    data = build_datasets(cfg)
    assert len(data.train) == 24 and "left out 1 image(s) that are not JPEG" in data.warning


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("flags, needle", [(["--decode", "gpu"], "--decode gpu needs"),
                                           (["--device", "cuda"], "--device cuda needs a CUDA GPU")])
def test_gpu_flags_without_cuda_are_one_line(capsys, flags, needle):
    expect_error(["--dataset", "digits", "--no-progress", *flags], capsys, needle)


def test_flops_are_counted_per_image():
    from torch.utils.flop_counter import FlopCounterMode

    from labkit.workloads.images.models import forward_flops
    from labkit.workloads.images.models import build_model

    n = forward_flops("resnet10_small", 10, 16)
    model, _ = build_model("resnet10_small", 10)
    with FlopCounterMode(display=False) as c:
        model(torch.randn(2, 3, 16, 16))
    assert n == c.get_total_flops() // 2  # per image, the same count as a real forward
    assert forward_flops("resnet50", 1000, 224) == pytest.approx(8.18e9, rel=0.01)  # 4.09 GMACs
    # 8 px images reach layer4 at 1x1: one image in BatchNorm (found on the H100, 2026-11-24)
    assert forward_flops("resnet10_small", 10, 8) > 0


def test_mfu_against_the_peak_of_the_gpu_by_name():
    assert efficiency.peak_flops("NVIDIA H100 80GB HBM3", "bf16") == pytest.approx(989.4e12)
    assert efficiency.peak_flops("NVIDIA H100 PCIe", "tf32") == pytest.approx(378e12)
    assert efficiency.peak_flops("NVIDIA H200", "fp16") == pytest.approx(989.4e12)
    assert efficiency.peak_flops("NVIDIA A100-SXM4-80GB", "tf32") == pytest.approx(156e12)
    assert efficiency.peak_flops("NVIDIA GeForce RTX 4090", "bf16") is None
    assert efficiency.peak_flops(None, "fp32") is None
    assert efficiency.precision("off", True) == "tf32" and efficiency.precision("bf16", True) == "bf16"
    # ResNet-50 fwd+bwd 24.5 GFLOP x 4,000 img/s on one H100 in bf16: 9.9%
    assert efficiency.mfu(3 * 8.18e9, 4000, 989.4e12, 1) == pytest.approx(0.0992, abs=1e-4)
    assert efficiency.mfu(3 * 8.18e9, 4000, 989.4e12, 2) == pytest.approx(0.0496, abs=1e-4)
    assert efficiency.mfu(3 * 8.18e9, 4000, None, 1) is None


def _doc(data_share: float) -> dict:
    step = 0.1
    ep = {"epoch": 1, "train_loss": 1.0, "train_accuracy": 50.0, "train_time": 10.0,
          "train_throughput": 2560.0, "avg_batch_time": step, "val_loss": 1.0, "val_accuracy": 50.0,
          "avg_data_time": data_share * step, "step_times": [step] * 10,
          "step_parts": {"data": [data_share * step] * 10}, "data_wait_share": data_share,
          "mfu": 0.2, "peak_memory_bytes": [2**30, 2**31]}
    return {"method": "Baseline DDP", "method_key": "ddp", "world_size": 2, "batch_size": 128,
            "epochs": [ep], "summary": {"avg_train_throughput": 2560.0, "avg_train_time_per_epoch": 10.0,
                                        "best_val_accuracy": 50.0, "final_train_accuracy": 50.0,
                                        "final_val_accuracy": 50.0},
            "all_losses": [1.0] * 10, "status": "completed", "trainers": 2,
            "efficiency": {"flops_per_image": 24.5e9, "mfu": 0.2, "precision": "bf16",
                           "device_name": "NVIDIA H100 80GB HBM3",
                           "peak_memory_bytes": [2**30, 2**31], "data_wait_share": data_share}}


@pytest.mark.parametrize("share, flagged", [(0.25, True), (0.04, False)])
def test_the_report_flags_a_run_that_measured_the_data_loader(share, flagged):
    from labkit import report

    from labkit.core.results import Result

    res = report.RunResults(docs={"ddp": Result.from_dict(_doc(share))}, problems={})
    lines = report.discussion(res)
    assert any(efficiency.LOADER_FLAG_TEXT in l for l in lines) == flagged
    row = report.efficiency_rows(res)[0]
    assert row["MFU (%)"] == pytest.approx(20.0) and row["Peak GPU memory per rank (GiB)"] == "1.00, 2.00"
    assert row["Data wait (% of step)"] == pytest.approx(100 * share)
    assert row["GFLOP/image (fwd+bwd)"] == pytest.approx(24.5)
