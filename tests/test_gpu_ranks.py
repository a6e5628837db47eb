"""The CUDA code paths on ONE GPU: every method with several ranks sharing it (gloo moving CUDA
tensors: all-reduce, reduce and broadcast, which the three methods' collective modes use), the
device-side batches and the GPU JPEG decoding, and a run's efficiency figures. A device-placement
bug (a CPU tensor handed to a CUDA collective, a batch left on the host) fails here without a
machine of 4 GPUs. What still needs two or more GPUs: nccl itself (one process per GPU), the
PS's p2p and asynchronous modes (gloo has no CUDA send/recv), and every timing of communication
between GPUs (docs/performance.md)."""
from __future__ import annotations

import sys

import pytest
import torch

from helpers import EQUIVALENCE_RUNS, ROOT, TINY, check_ok, load_json, torchrun
from labkit.core.config import TrainConfig
from labkit.workloads import resolve
from labkit.core.methods import spec
from labkit.training import gpu_data, rank
from labkit.training.data import ShardSampler, make_loader, train_sampler
from labkit.workloads.images.image_sets import SyntheticImages, build_datasets

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA GPU (the same code on the CPU device: test_gpu_data.py)"),
    pytest.mark.xdist_group("equivalence_runs"),
]
CUDA = torch.device("cuda", 0)


@pytest.fixture(scope="module")
def jpeg_tree(tmp_path_factory):
    sys.path.insert(0, str(ROOT / "tools"))
    import make_jpeg_folder

    root = tmp_path_factory.mktemp("jpegs")
    assert make_jpeg_folder.main([str(root), "--train", "64", "--val", "32", "--classes", "4"]) == 0
    return root


@pytest.mark.parametrize("name", ["ddp", "allreduce", "ps_collective"])
def test_several_ranks_on_one_gpu_compute_what_the_cpu_computes(tmp_path, equivalence_runs, name):
    nproc, args = EQUIVALENCE_RUNS[name]
    out = tmp_path / name
    p = torchrun(nproc, TINY + args + ["--backend", "gloo", "--device", "cuda", "--out", str(out)],
                 cwd=tmp_path, env={"NVIDIA_TF32_OVERRIDE": "0"})  # true fp32, as on the CPU
    check_ok(p)
    method = args[1]
    doc = load_json(out / spec(method).result_file)
    ref = load_json(equivalence_runs[name][0] / spec(method).result_file)
    assert doc["status"] == "completed" and doc["world"]["device"].startswith("cuda")
    # the same first step from the same weights and batch; later ones drift by rounding only
    assert doc["all_losses"][0] == pytest.approx(ref["all_losses"][0], rel=1e-4)
    assert doc["all_losses"] == pytest.approx(ref["all_losses"], rel=2e-2)
    mem = doc["efficiency"]["peak_memory_bytes"]
    assert len(mem) == nproc and all(b > 0 for b in mem)


def test_device_batches_on_the_gpu_are_the_dataloaders():
    ds = SyntheticImages(256, 32, 10, seed=1)
    sampler = train_sampler(ds, 2, 0, seed=3)
    ref = list(make_loader(ds, sampler, 16, 0, False, drop_last=True, seed=0))
    on = gpu_data._on_device(ds, CUDA)
    assert on is not None and on[0].is_cuda
    got = list(gpu_data.DeviceBatches(*on, sampler, 16, drop_last=True))
    assert len(got) == len(ref)
    for (a, b), (c, d) in zip(got, ref):
        assert a.is_cuda and torch.equal(a.cpu(), c) and torch.equal(b.cpu(), d)


def test_gpu_decoding_matches_the_cpu_path(jpeg_tree):
    cfg = resolve(TrainConfig(dataset="imagefolder", data_dir=str(jpeg_tree), model="resnet10",
                              image_size=64, batch_size=8, progress=False), True)
    assert cfg.decode == "gpu"
    files = build_datasets(cfg)
    cfg_cpu = resolve(TrainConfig(dataset="imagefolder", data_dir=str(jpeg_tree), model="resnet10",
                                  image_size=64, batch_size=8, decode="cpu"), True)
    cpu = build_datasets(cfg_cpu)
    val = ShardSampler(len(cpu.val), 2, 0)
    ref = list(make_loader(cpu.val, val, 8, 0, False, drop_last=False, seed=0))
    train, vl = gpu_data.make_loaders(cfg, files, train_sampler(files.train, 2, 0, 0), val, 2, CUDA, 0)
    got = list(vl)
    assert [y.tolist() for _, y in got] == [y.tolist() for _, y in ref]
    for (a, _), (b, _) in zip(got, ref):
        assert a.is_cuda and a.shape == b.shape
        assert (a.cpu() - b).abs().mean() < 0.05  # nvJPEG's IDCT and a float resize: rounding
    x, y = next(iter(train))
    assert x.is_cuda and y.is_cuda and x.shape == (8, 3, 64, 64)
    x, y = next(iter(train))  # a second epoch's iterator replaces the first
    assert x.shape == (8, 3, 64, 64)


def test_a_gpu_run_records_flops_mfu_memory_and_data_wait(tmp_path, jpeg_tree, monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    out = tmp_path / "run"
    assert rank.main(["--dataset", "imagefolder", "--data-dir", str(jpeg_tree), "--model", "resnet10",
                      "--image-size", "64", "--batch-size", "8", "--epochs", "2", "--amp", "bf16",
                      "--channels-last", "--max-val-steps", "2", "--no-progress", "--no-pin-cpus",
                      "--out", str(out)]) == 0
    doc = load_json(out / "results_baseline_ddp.json")
    e = doc["efficiency"]
    assert doc["config"]["decode"] == "gpu" and e["precision"] == "bf16"
    assert e["flops_per_image"] > 0 and e["peak_memory_bytes"][0] > 0
    assert 0 <= e["data_wait_share"] < 1
    if e["peak_flops_per_gpu"]:  # an H100, H200 or A100
        assert 0 < e["mfu"] < 1 and all(0 < ep["mfu"] < 1 for ep in doc["epochs"])
