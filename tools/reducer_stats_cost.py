"""What DDP's runtime statistics cost a step, isolated from the rest of labkit (issue 41).

labkit's DDP default (`--time-comm stats`) sets the reducer's sampling rate, so that the reducer
times iterations in C++ (CUDA events on a GPU, which it waits for at the next forward), and
reads the figures back every step with ``_get_ddp_logging_data()``. This runs a bare DDP
loop on synthetic data (no loader, no labkit loop) in alternating rounds of three variants:

  off     PyTorch's own default: the reducer samples the first 10 iterations, then every 100th;
          nothing read
  every   every iteration sampled and read back (labkit's default on the CPU)
  sampled one iteration in SAMPLE_EVERY["cuda"] sampled, every one read (labkit's default on a GPU)

and prints, per variant against `off`, the paired ratio of step times over the rounds with its
95% interval (labkit.bench.instrument_cost.paired_ratio) and the difference per step.

    torchrun --standalone --nproc_per_node=2 tools/reducer_stats_cost.py              # CPU, gloo
    python tools/reducer_stats_cost.py --device cuda --model resnet18 --image-size 224 --batch-size 64
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from labkit.bench.instrument_cost import paired_ratio
from labkit.core.stats import t_quantile
from labkit.training.dist import sync_device
from labkit.workloads.images.models import build_model
from labkit.training.sync.ddp import SAMPLE_EVERY

# (the reducer's sampling rate, read the figures every this many steps)
VARIANTS = {"off": (100, 0), "every": (1, 1), "sampled": (SAMPLE_EVERY["cuda"], 1)}


def timed(ddp, opt, x, y, device, steps: int, read_every: int) -> float:
    """Seconds per step over ``steps`` steps, the device drained before and after only."""
    loss_fn = torch.nn.CrossEntropyLoss()
    sync_device(device)
    dist.barrier()
    t = time.perf_counter()
    for i in range(steps):
        opt.zero_grad(set_to_none=True)
        loss_fn(ddp(x), y).backward()
        opt.step()
        if read_every and i % read_every == 0:
            ddp._get_ddp_logging_data()
    sync_device(device)
    return (time.perf_counter() - t) / steps


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="(default cpu)")
    p.add_argument("--backend", help="nccl on a GPU, gloo on the CPU by default; gloo lets 2 ranks share one GPU")
    p.add_argument("--model", default="resnet10_small", help="labkit model name (resnet10_small)")
    p.add_argument("--image-size", type=int, default=16, help="square input side in px (16)")
    p.add_argument("--batch-size", type=int, default=32, help="per process (32)")
    p.add_argument("--steps", type=int, default=50, help="timed steps per variant and round (50)")
    p.add_argument("--rounds", type=int, default=20, help="alternating rounds (20)")
    a = p.parse_args()
    if "RANK" not in os.environ:  # one process without torchrun
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29517"))
    cuda = a.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("reducer_stats_cost: --device cuda, but torch sees no CUDA device")
    # two gloo ranks may share one GPU (--backend gloo)
    local = int(os.environ["LOCAL_RANK"]) % max(1, torch.cuda.device_count())
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    dist.init_process_group(a.backend or ("nccl" if cuda else "gloo"))
    torch.manual_seed(0)
    model, _ = build_model(a.model, 10)
    ddp = DistributedDataParallel(model.to(device), device_ids=[device] if cuda else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(a.batch_size, 3, a.image_size, a.image_size, device=device)
    y = torch.randint(0, 10, (a.batch_size,), device=device)
    names = list(VARIANTS)
    times: dict[str, list[float]] = {n: [] for n in names}
    timed(ddp, opt, x, y, device, 10, 0)  # warm-up
    for r in range(a.rounds):
        for n in (names if r % 2 == 0 else names[::-1]):  # ABC CBA: drift cancels
            rate, every = VARIANTS[n]
            ddp._set_ddp_runtime_logging_sample_rate(rate)
            timed(ddp, opt, x, y, device, 3, every)  # the new rate in force
            times[n].append(timed(ddp, opt, x, y, device, a.steps, every))
    if dist.get_rank() == 0:
        world = dist.get_world_size()
        print(f"{a.model} at {a.image_size} px, batch {a.batch_size} x {world} on {device.type} ({dist.get_backend()}), "
              f"{a.rounds} rounds of {a.steps} steps; torch {torch.__version__}")
        off = np.asarray(times["off"])
        print(f"  off      median step {np.median(off) * 1e3:8.3f} ms")
        for n in names[1:]:
            t = np.asarray(times[n])
            iv = paired_ratio(off, t)  # off / variant: < 1 means the variant is slower
            d = (t - off) * 1e6
            half = t_quantile(0.95, len(d) - 1) * d.std(ddof=1) / np.sqrt(len(d))
            print(f"  {n:8} median step {np.median(t) * 1e3:8.3f} ms; off / {n} = {iv.value:.4f} "
                  f"(95% CI {iv.low:.4f}-{iv.high:.4f}); {d.mean():+.1f} +- {half:.1f} us a step")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
