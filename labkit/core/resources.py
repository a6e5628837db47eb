"""What a run will need of the machine, what the machine has, and what to say when it is short.

A run that dies for want of disk, shared memory or host memory does so minutes or hours in,
and the user then reads a wall of tracebacks. The arithmetic here lets the launcher refuse
such a run before anything is spawned, in one line that names what is short, how much is
needed, how much is free and the flag that changes it. No torch here: the parameter count is
the caller's (labkit.training.budget counts it), so the figures are plain numbers and the
rules read in one place.

Estimates err on the generous side only where a refusal would be wrong to miss: a shortfall
is refused (ConfigError, exit 2), a margin that is only tight is a warning.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import Optional

MiB = 1 << 20
GiB = 1 << 30
#: below this share of headroom over the estimate, a check warns instead of staying quiet
TIGHT = 1.5
#: result files, logs, launch records, the executed notebook: per method, small but not nothing
PER_METHOD_FILES = 8 * MiB
#: a rank's interpreter with torch, gloo and its buffers before any model (measured RSS of an
#: idle TINY rank on the CPU box is 350-450 MiB; the figure errs high)
RANK_BASE = 500 * MiB
#: a replica's weights, gradients, optimizer state, communication buffers and the step's
#: temporaries, in models: DDP's 16 bytes a weight with AdamW and its gradient buckets
REPLICA_TIMES = 5
#: a DataLoader worker's own memory besides the batches it holds in shared memory
WORKER_BASE = 150 * MiB
#: batches each worker keeps in flight (DataLoader's default prefetch_factor)
PREFETCH = 2
#: batches besides those a rank holds in shared memory: the one in use and those received
HELD = 4
#: shared memory is taken in pages: a tensor sent from a worker, a lock or a semaphore
PAGE = 4096
#: multiprocessing's locks and semaphores (a page each) of a loader, and of each of its workers
LOCKS_PER_LOADER, LOCKS_PER_WORKER = 12, 3


@dataclass(frozen=True)
class Need:
    """One resource a run needs: ``needed`` bytes of ``what`` at ``where``, ``free`` there."""
    what: str             # "disk space", "shared memory", "host memory"
    where: str            # the folder or file it is measured at
    needed: int
    free: Optional[int]   # None: cannot be measured here (then nothing is said)
    detail: str           # what the estimate is made of
    remedy: str           # the flag or change that lowers the need or raises the supply

    @property
    def short(self) -> bool:
        return self.free is not None and self.needed > self.free

    @property
    def tight(self) -> bool:
        return self.free is not None and not self.short and self.needed * TIGHT > self.free

    def line(self) -> str:
        """The one line a refusal or a warning says."""
        verdict = "not enough" if self.short else "little headroom:"
        return (f"{verdict} {self.what} in {self.where}: the run needs about {size(self.needed)} "
                f"({self.detail}), {size(self.free or 0)} free; {self.remedy}")


def size(n: float) -> str:
    """Bytes for people: 512 KiB, 37.4 MiB, 2.1 GiB."""
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


# ------------------------------------------------------------------ what the machine has
def free_disk(path: str) -> Optional[int]:
    """Bytes an unprivileged writer may still use on the filesystem that holds ``path`` (or
    would hold it: the nearest folder that exists); None where it cannot be measured."""
    p = os.path.abspath(path)
    while not os.path.exists(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)
    try:
        st = os.statvfs(p)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def free_shm(path: str = "/dev/shm") -> Optional[int]:
    """Free bytes of the shared-memory filesystem DataLoader workers pass batches through."""
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def meminfo(key: str = "MemAvailable") -> Optional[int]:
    """A /proc/meminfo figure in bytes (Linux), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name == key:
                    return int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def cgroup_memory_left() -> Optional[int]:
    """What a cgroup (v2) memory limit still allows this container, or None without one: in a
    container MemAvailable is the host's, the limit is what the OOM killer enforces."""
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return None if limit == "max" else max(0, int(limit) - used)


def memory_capacity() -> Optional[int]:
    """This machine's memory as a process here is allowed it: MemTotal, or a cgroup (v2) limit
    where that is smaller (what a run could fill if nothing else ran)."""
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
    except OSError:
        limit = "max"
    known = [v for v in (meminfo("MemTotal"), None if limit == "max" else int(limit)) if v is not None]
    return min(known) if known else None


def free_memory() -> Optional[int]:
    """Host memory a new process can have: the smaller of MemAvailable and the cgroup's room."""
    known = [v for v in (meminfo(), cgroup_memory_left()) if v is not None]
    return min(known) if known else None


#: where the kernel counts its out-of-memory kills: this cgroup's (v2, as a container sees its
#: own), else the whole kernel's (cgroup v1 and hosts without a cgroup namespace: there the
#: root cgroup has no memory.events). A count of the whole kernel also counts other programs'
#: kills: it can blame memory wrongly only when one happened meanwhile, never miss one.
OOM_COUNTERS = (("/sys/fs/cgroup/memory.events", "oom_kill"), ("/proc/vmstat", "oom_kill"))


def oom_kills() -> Optional[int]:
    """How many processes the kernel's OOM killer has killed so far (OOM_COUNTERS: this
    cgroup's count, else the kernel's), or None where neither can be read. Read before and
    after a launch, it tells a rank killed for memory from one killed by a person."""
    for path, key in OOM_COUNTERS:
        try:
            with open(path) as f:
                for line in f:
                    name, _, value = line.partition(" ")
                    if name == key:
                        return int(value)
        except (OSError, ValueError):
            continue
    return None


def duration(seconds: float) -> str:
    """Seconds for people: 40 s, 12.5 min, 4.4 h, 3.2 days."""
    for unit, scale in (("days", 86400), ("h", 3600), ("min", 60)):
        if seconds >= scale:
            return f"{seconds / scale:.1f} {unit}"
    return f"{seconds:.0f} s"


# ------------------------------------------------------------------ what a run needs
def disk_need(where: str, state_bytes: int, model_bytes: int, methods: int, checkpoint: bool,
              flags: str) -> Need:
    """Disk for ``methods`` runs in ``where``: each keeps a checkpoint (model and optimizer
    state, ``state_bytes``) that is replaced atomically, so for a moment the old and the new
    one both exist, plus the final model and its small files."""
    per = model_bytes + PER_METHOD_FILES + (2 * state_bytes if checkpoint else 0)
    what = (f"2 checkpoints of {size(state_bytes)} while one replaces the other, "
            if checkpoint else "") + f"final model {size(model_bytes)}, logs"
    what = what if methods == 1 else f"{methods} x ({what})"
    remedy = ("free some space, or choose another " + flags
              + (", or --no-checkpoint (no checkpoint: no --resume)" if checkpoint else ""))
    return Need("disk space", where, methods * per, free_disk(where), what, remedy)


def shm_need(workers: int, loaders: int, ranks: int, batch_bytes: int, shared_bytes: int = 0) -> Need:
    """/dev/shm for DataLoader workers, on every rank: the in-memory dataset's tensors
    (``shared_bytes``: the workers' forkserver pickles them into shared memory, once per rank);
    ``PREFETCH`` batches per worker of each of the rank's ``loaders`` (training and validation
    keep their workers, and a fast loader's queue is full) and ``HELD`` more the rank is using
    or has received, each of a batch's two tensors in whole pages; and a page for each of
    multiprocessing's locks and semaphores.
    The figures are fitted to peaks measured on a tmpfs /dev/shm (docs/performance-log.md)."""
    batch = -(-batch_bytes // PAGE) * PAGE + PAGE
    batches = loaders * workers * PREFETCH + HELD
    locks = loaders * (LOCKS_PER_LOADER + LOCKS_PER_WORKER * workers) * PAGE
    need = ranks * (shared_bytes + batches * batch + locks)
    detail = (f"{ranks} rank(s) x (" + (f"{size(shared_bytes)} of in-memory data + " if shared_bytes else "")
              + f"{batches} batches of {size(batch)} in flight for {loaders} loaders x {workers} workers)")
    return Need("shared memory", "/dev/shm", need, free_shm(), detail,
                "--workers 0 loads in the rank itself, a smaller --batch-size shrinks each batch, "
                "or enlarge /dev/shm (docker run --shm-size)")


def memory_need(ranks: int, workers: int, model_bytes: int, data_bytes: int,
                nodes: int = 1, share: float = 1.0, method: str = "") -> Need:
    """Host memory for the ranks on this machine (of this node, or of the ``nodes`` nodes of
    an emulated cluster, all on it): each holds torch itself, the model several times over
    (weights, gradients, optimizer state, communication buffers) and its copy of an in-memory
    dataset; each worker its own interpreter. A method that shards the model holds ``share``
    of what a replica holds on its fullest rank (its memory_per_rank against a replica's, as
    labkit.training.budget finds it), and its ranks need that share of a replica's figure."""
    per_rank = (RANK_BASE + round(REPLICA_TIMES * model_bytes * share) + data_bytes
                + workers * 2 * WORKER_BASE)
    who = f"{ranks} rank(s)" if nodes == 1 else f"{ranks} ranks ({nodes} emulated nodes x {ranks // nodes})"
    held = f"{REPLICA_TIMES} x the {size(model_bytes)} model"
    if share != 1.0:  # the words of a replica's estimate stay as they were
        held += f" x {share:.3g} ({method} holds {100 * share:.3g}% of a replica's state per rank)"
    detail = (f"{who} x ({size(RANK_BASE)} for torch + {held} + {size(data_bytes)} of data"
              + (f" + {2 * workers} workers" if workers else "") + ")")
    remedy = "lower --nproc" + (" or --emulate-nodes" if nodes > 1 else "")
    return Need("host memory", "this node" if nodes == 1 else "this machine", ranks * per_rank,
                free_memory(), detail, remedy + (" or --workers" if workers else "") + ", or free memory")
