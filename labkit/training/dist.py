"""Process-group setup in one place, and collective helpers that are no-ops at world size 1.

torchrun exports RANK / WORLD_SIZE / LOCAL_RANK; without them we run as one process, so every
code path also runs in a plain ``python -m labkit.train`` and in unit tests.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str
    device: torch.device

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def env_world() -> tuple[int, int, int, int]:
    """(rank, world_size, local_rank, local_world_size) from torchrun's environment."""
    g = os.environ.get
    return (int(g("RANK", 0)), int(g("WORLD_SIZE", 1)), int(g("LOCAL_RANK", 0)),
            int(g("LOCAL_WORLD_SIZE", g("WORLD_SIZE", 1))))


def cpu_share(allowed: list[int], local_rank: int, local_world_size: int) -> Optional[list[int]]:
    """The cores local rank r of w gets from the n ``allowed`` ones: an even, contiguous share,
    [r*n//w, (r+1)*n//w), when every rank can have a core of its own (w <= n); with more ranks
    than cores, one core shared by w/n neighbouring ranks when w is a multiple of n (4 ranks
    on 2 cores: ranks 0-1 on the first, 2-3 on the second). None otherwise: 3 ranks on 2
    cores bound would leave two ranks half a core each and the third a whole one, and a
    synchronous step waits for the slowest, so the OS, which moves them, does better."""
    n, w, r = len(allowed), local_world_size, local_rank
    if w > n and w % n:
        return None
    lo = r * n // w
    return allowed[lo:max(lo + 1, (r + 1) * n // w)]


# glibc's malloc made steady (steady_malloc): the mmap threshold fixed at the ceiling of glibc's
# own dynamic one on 64 bits, the trim threshold at twice it, as glibc sets both after a large
# free; <malloc.h>'s parameter numbers
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 64 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_malloc: Optional[dict] = None  # what steady_malloc set in this process (determinism() says)


def steady_malloc() -> Optional[dict]:
    """Fix glibc's malloc thresholds in this process; the settings, or None where there is no
    glibc ``mallopt`` (macOS, musl) and nothing changed. Every rank calls it first thing
    (labkit.training.lifecycle.begin_rank), and the loader workers' fork server.

    Why: by default glibc returns freed memory at the top of its heap to the OS once more than
    128 KiB is free (``M_TRIM_THRESHOLD``) and serves large blocks by fresh ``mmap``, each
    unmapped again when freed; it raises both thresholds only after it has freed some large
    block, and never past 32 MiB. A training step allocates and frees its activations and
    gradients, megabytes each, every step, so with the defaults each step faults those pages
    in again (system time), and how fast a run trained depended on whether something it did
    earlier happened to free a large block: the replica check's int64 temporaries did, and
    when they went (25764d2) the embedded default's Manual All-Reduce trained measurably
    slower, its forward and backward included. Fixed thresholds, as glibc's own after such a
    free, make a rank's speed independent of that history, and faster (docs/performance-log.md,
    "glibc's malloc", also for what they leave: blocks over 32 MiB, at 224 px, still mapped
    every step). What a rank keeps: at most TRIM_THRESHOLD of free heap, returned when
    exceeded."""
    global _malloc
    try:
        import ctypes

        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None
    settings = {"mmap_threshold": (_M_MMAP_THRESHOLD, MMAP_THRESHOLD),
                "trim_threshold": (_M_TRIM_THRESHOLD, TRIM_THRESHOLD)}
    if not all(mallopt(param, value) == 1 for param, value in settings.values()):
        return None
    _malloc = {name: value for name, (_, value) in settings.items()}
    return _malloc


def bind_cpus(local_rank: int, local_world_size: int) -> Optional[list[int]]:
    """Bind this process, every thread it has and every process it starts later (DataLoader
    workers) to its ``cpu_share`` of the cores it may use; None, with nothing changed, where
    the OS has no affinity call (macOS, Windows) or the ranks cannot share the cores evenly.

    Why: without GPUs the ranks compete for the cores (the embedded default runs 4 ranks on a
    2-core machine), and where the OS scheduler happens to put them sets the speed of a whole
    launch, which no interval from that launch can see: launches of one method left to the OS
    spread far more than bound ones (docs/performance.md). Bound runs are slower (ranks sharing
    a core take turns) but measure the methods rather than the placement; ``--no-pin-cpus``
    leaves placement to the OS.
    """
    if not hasattr(os, "sched_setaffinity"):
        return None
    cores = cpu_share(sorted(os.sched_getaffinity(0)), local_rank, local_world_size)
    if cores is None:  # no even share: placement stays with the OS
        return None
    # sched_setaffinity(0) binds the calling thread only: bind each thread that exists already
    # (threads and processes started later inherit the binding)
    tasks = os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ["0"]
    for tid in tasks:
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:  # the thread ended meanwhile
            pass
    return cores


def init(backend: str, timeout_s: float, pin_cpus: bool = False,
         device_type: Optional[str] = None, debug_collectives: bool = False) -> DistContext:
    """The process group from torchrun's environment. ``pin_cpus``: on CPU (not with nccl),
    ``bind_cpus`` first, so gloo's threads start bound. ``device_type`` "cuda" with gloo: the
    ranks share the GPUs there are (local rank modulo their number), gloo moving CUDA tensors
    (several ranks on one GPU: the CUDA code paths tested without one GPU per rank).
    ``debug_collectives``: torch's DETAIL debug level, whose process group wrapper compares
    every collective's kind and shapes across the ranks before running it, so a method whose
    ranks call different collectives fails naming them instead of hanging or aborting."""
    if debug_collectives:
        dist.set_debug_level(dist.DebugLevel.DETAIL)
    rank, world, local_rank, local_world = env_world()
    if backend == "nccl" or device_type == "cuda":
        device = torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        if pin_cpus:
            bind_cpus(local_rank, local_world)
    if world > 1 and not dist.is_initialized():
        kw = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kw)
    return DistContext(rank, world, local_rank, local_world, backend, device)


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def is_distributed() -> bool:
    """A process group is up and has peers: collectives would do something."""
    return dist.is_initialized() and dist.get_world_size() > 1


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum ``t`` in place over all ranks (no-op for one process)."""
    if is_distributed():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def sync_device(device: torch.device) -> None:
    """Wait for queued device work, so a host clock read after it means something."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def determinism(seed: Optional[int], backend: Optional[str]) -> dict:
    """What decides whether two runs from one seed agree bit for bit, in this process."""
    cudnn = torch.backends.cudnn
    return {
        "seed": seed, "backend": backend,
        "torch_num_threads": torch.get_num_threads(),
        "torch_num_interop_threads": torch.get_num_interop_threads(),
        "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS"),
        # the cores this process may run on (bind_cpus); None: no affinity call here
        "cpu_affinity": (sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                         else None),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        # glibc's malloc thresholds this process fixed (steady_malloc); None: the defaults
        "malloc": _malloc,
        "cudnn_deterministic": bool(cudnn.deterministic),
        "cudnn_benchmark": bool(cudnn.benchmark),
        "cudnn_allow_tf32": bool(cudnn.allow_tf32),
        "matmul_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
    }
