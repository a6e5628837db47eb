"""One rank of torchvision's reference classification script, on a CPU over gloo, timed per epoch.

    torchrun --nproc-per-node 2 tools/reference_rank.py REFERENCE_DIR TIMES_JSON -- train.py's flags

REFERENCE_DIR is torchvision's references/classification folder (train.py, utils.py, presets.py,
...), from torchvision's source release; it is not part of labkit and is not edited. The script
expects CUDA and NCCL; the only changes made here, from outside, are those that let it run on a
CPU with gloo (tools/vs_reference.py says why each):

- utils.init_distributed_mode: the same steps with backend gloo and no torch.cuda.set_device;
- DistributedDataParallel: built without device_ids (train.py passes [args.gpu], which a CPU
  module refuses);
- utils.reduce_across_processes: its tensor on the CPU instead of "cuda".

train_one_epoch is wrapped to record its wall time per epoch (rank 0 writes TIMES_JSON), the
same span as labkit's train_time: the epoch's training loop, evaluation and checkpoints apart.
A global optimizer step hook (torch.optim's, outside the script) stamps the end of every step,
so TIMES_JSON also holds each epoch's step times: from one step's end to the next's (the first
from the epoch's start), the whole of a step as labkit's step_parts add up to it.
"""
from __future__ import annotations

import json
import os
import sys
import time


def _patch(train, utils) -> dict[str, list]:
    import torch
    import torch.distributed as dist
    from torch.optim.optimizer import register_optimizer_step_post_hook

    def init_distributed_mode(args):
        args.rank, args.world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        args.gpu, args.distributed, args.dist_backend = None, True, "gloo"
        dist.init_process_group(backend="gloo", init_method=args.dist_url,
                                world_size=args.world_size, rank=args.rank)
        dist.barrier()
        utils.setup_for_distributed(args.rank == 0)

    def reduce_across_processes(val):
        t = torch.tensor(val)
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
            dist.all_reduce(t)
        return t

    ddp = torch.nn.parallel.DistributedDataParallel

    class CpuDDP(ddp):
        def __init__(self, module, device_ids=None, **kw):
            super().__init__(module, **kw)

    utils.init_distributed_mode = init_distributed_mode
    utils.reduce_across_processes = reduce_across_processes
    torch.nn.parallel.DistributedDataParallel = CpuDDP

    times: dict[str, list] = {"epoch_times": [], "step_times": []}
    ends: list[float] = []
    register_optimizer_step_post_hook(lambda *_: ends.append(time.perf_counter()))
    one_epoch = train.train_one_epoch

    def timed(*a, **kw):
        t0 = time.perf_counter()
        ends.clear()
        one_epoch(*a, **kw)
        times["epoch_times"].append(time.perf_counter() - t0)
        times["step_times"].append([b - a for a, b in zip([t0, *ends], ends)])

    train.train_one_epoch = timed
    return times


def main() -> int:
    ref, out, _, *flags = sys.argv[1:]
    sys.path.insert(0, ref)
    sys.argv = [os.path.join(ref, "train.py"), *flags]
    import train
    import utils

    times = _patch(train, utils)
    args = train.get_args_parser().parse_args(flags)
    train.main(args)
    if int(os.environ.get("RANK", "0")) == 0:
        tmp = out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(times, f)
        os.replace(tmp, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
