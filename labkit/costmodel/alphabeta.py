"""The alpha-beta model: links, collective times, bucket overlap, one step's prediction, and the
formulas as the report shows them."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

from labkit.core import builtins

MiB = 2 ** 20
GB = 1e9  # bandwidths are in decimal GB/s, as vendors state them

BACKWARD_FRACTION = 2 / 3        # backward ~ 2x forward; the optimizer step is small
DDP_BUCKET_BYTES = 25 * MiB      # DistributedDataParallel's bucket_cap_mb default
GPUS_PER_NODE = 8                # an HGX/DGX box
ERROR_TARGET_PCT = 25.0          # compare_with_bench(): a prediction within this is "ok"

#: method -> how the model predicts its step, as its class declares it (labkit.core.builtins):
#: "ring" (bucketed ring all-reduces, overlapped with backward) or "server" (a parameter server)
PATTERNS: dict[str, str] = {k: d["cost_model"] for k, d in builtins.METHODS.items() if d["cost_model"]}
#: a parameter server sharded over several servers, as the model names it: "<method>_sharded"
SHARDED = "_sharded"
#: the names predict_step takes: the methods with a model, and each server's sharded form
MODELLED_METHODS = (*PATTERNS, *(k + SHARDED for k, p in PATTERNS.items() if p == "server"))
DEFAULT_GPUS = (8, 16, 32, 64, 128, 256, 512, 1024)


# ---------------------------------------------------------------------------------------------
# Links
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Link:
    """A link in the alpha-beta model: one message of ``m`` bytes takes ``alpha + m * beta``.

    ``alpha`` is the per-message latency in seconds, ``beta`` the time per byte in seconds
    (``1 / bandwidth`` with bandwidth in bytes/s, one direction).
    """
    name: str
    alpha: float
    beta: float
    source: str = ""

    @classmethod
    def from_bandwidth(cls, name: str, bandwidth: float, alpha: float, source: str = "") -> "Link":
        """A link of ``bandwidth`` bytes/s per direction and latency ``alpha`` seconds."""
        return cls(name, alpha, 1.0 / bandwidth, source)

    @property
    def bandwidth(self) -> float:
        """Bytes per second, one direction."""
        return 1.0 / self.beta


# Nominal per-GPU figures: the line rate one GPU has per direction, and an order-of-magnitude
# latency for a small message through the communication library.  They are vendor and standard
# figures, NOT measurements; what a job gets is lower (protocol overhead, congestion).  For a
# node whose GPUs share one NIC, divide the bandwidth by the GPUs per node.
INTERCONNECTS: dict[str, Link] = {
    "nvlink": Link.from_bandwidth(
        "NVLink 4 (H100)", 450 * GB, 2e-6,
        "NVIDIA H100 Tensor Core GPU datasheet: NVLink 900 GB/s per GPU, both directions together"),
    "ib_ndr": Link.from_bandwidth(
        "InfiniBand NDR 400 Gb/s", 400e9 / 8, 3e-6,
        "InfiniBand Trade Association roadmap (NDR, 4x port); one ConnectX-7 NIC per GPU as in DGX H100"),
    "ib_hdr": Link.from_bandwidth(
        "InfiniBand HDR 200 Gb/s", 200e9 / 8, 3e-6,
        "InfiniBand Trade Association roadmap (HDR, 4x port)"),
    "100gbe": Link.from_bandwidth(
        "100 GbE (RoCE)", 100e9 / 8, 10e-6, "IEEE 802.3ba/802.3cd line rate"),
    "25gbe": Link.from_bandwidth(
        "25 GbE (TCP)", 25e9 / 8, 30e-6, "IEEE 802.3by line rate"),
    "10gbe": Link.from_bandwidth(
        "10 GbE (TCP)", 10e9 / 8, 50e-6, "IEEE 802.3ae line rate"),
}
DEFAULT_NETWORKS = ("nvlink", "ib_ndr", "ib_hdr", "100gbe", "25gbe", "10gbe")


def get_link(link: Union[str, Link]) -> Link:
    """A ``Link`` itself, or the one ``INTERCONNECTS`` names."""
    if isinstance(link, Link):
        return link
    try:
        return INTERCONNECTS[link]
    except KeyError:
        raise ValueError(f"unknown interconnect {link!r} (known: {', '.join(INTERCONNECTS)})") from None


# ---------------------------------------------------------------------------------------------
# Collectives
# ---------------------------------------------------------------------------------------------

def ring_allreduce_time(n: float, p: int, link: Link) -> float:
    """Ring all-reduce of ``n`` bytes over ``p`` processes (Thakur, Rabenseifner & Gropp 2005).

        T = 2 (p - 1) alpha + 2 n (p - 1) / p * beta

    A reduce-scatter then an all-gather, each ``p - 1`` steps of ``n / p`` bytes.  ``p = 1``
    costs nothing.
    """
    if p <= 1:
        return 0.0
    return 2 * (p - 1) * link.alpha + 2 * n * (p - 1) / p * link.beta


def ring_reduce_scatter_time(n: float, p: int, link: Link) -> float:
    """Ring reduce-scatter (or all-gather) of ``n`` bytes: ``(p - 1) alpha + n (p - 1) / p beta``."""
    if p <= 1:
        return 0.0
    return (p - 1) * link.alpha + n * (p - 1) / p * link.beta


def hierarchical_allreduce_time(n: float, p: int, intra: Link, inter: Link,
                                gpus_per_node: int = GPUS_PER_NODE) -> float:
    """All-reduce over ``p`` GPUs in nodes of ``g = gpus_per_node`` (p <= g: one ring on ``intra``).

        T = 2 [(g - 1) alpha_intra + n (g - 1) / g beta_intra]      reduce-scatter + all-gather
            + 2 (N - 1) alpha_inter + 2 (n / g) (N - 1) / N beta_inter   in the node, ring
                                                                     all-reduce of each GPU's
                                                                     n / g shard across N nodes

    with ``N = ceil(p / g)`` nodes.  Each GPU has its own ``inter`` link (one NIC per GPU), so the
    ``g`` cross-node all-reduces run side by side.  This is also what NCCL's multi-channel ring
    achieves across nodes: the network carries ``n / g`` per GPU, not ``n``.
    """
    if p <= gpus_per_node:
        return ring_allreduce_time(n, p, intra)
    nodes = math.ceil(p / gpus_per_node)
    inside = 2 * ring_reduce_scatter_time(n, gpus_per_node, intra)
    across = ring_allreduce_time(n / gpus_per_node, nodes, inter)
    return inside + across


def allreduce_time(n: float, p: int, link: Link, intra: Optional[Link] = None,
                   gpus_per_node: int = GPUS_PER_NODE) -> float:
    """A flat ring on ``link``, or, given an ``intra``-node link, the hierarchical all-reduce."""
    if intra is None:
        return ring_allreduce_time(n, p, link)
    return hierarchical_allreduce_time(n, p, intra, link, gpus_per_node)


def server_broadcast_time(n: float, workers: int, link: Link, servers: int = 1) -> float:
    """A parameter-server pull: ``servers`` servers, each holding ``n / k`` bytes, send them to
    every one of ``workers`` workers.

        T = max( W alpha + W (n / k) beta ,   k alpha + n beta )
                 one server's link             one worker's link

    The server's link sends ``W`` copies of its shard one after another; a worker receives
    ``k`` shards adding up to ``n``.  Whichever link carries more is the bottleneck (BytePS,
    OSDI 2020: with ``k`` servers and ``W`` workers the server side needs ``W n / (k B)``).
    """
    k = servers
    server_side = workers * link.alpha + workers * (n / k) * link.beta
    worker_side = k * link.alpha + n * link.beta
    return max(server_side, worker_side)


def server_reduce_time(n: float, workers: int, link: Link, servers: int = 1) -> float:
    """A parameter-server push: every worker sends each server its ``n / k`` gradient bytes.

    The same traffic as a pull in the other direction, so the same time as
    ``server_broadcast_time``; the server's summing is not counted (it runs at memory speed).
    """
    return server_broadcast_time(n, workers, link, servers)


# ---------------------------------------------------------------------------------------------
# Overlap of bucketed all-reduce with backward
# ---------------------------------------------------------------------------------------------

def bucket_sizes(n: float, bucket_bytes: float) -> list[float]:
    """``n`` bytes cut into buckets of ``bucket_bytes``, in the order backward fills them: all
    full except the last, which holds the remainder (the first layers' gradients)."""
    if n <= 0:
        return []
    full = int(n // bucket_bytes)
    rest = n - full * bucket_bytes
    sizes = [float(bucket_bytes)] * full
    if rest > 0:
        sizes.append(rest)
    return sizes


def exposed_comm(sizes: Sequence[float], times: Sequence[float], backward: float,
                 overlap: bool = True) -> float:
    """Communication time left after backward ends (the part that lengthens the step).

    Model: backward produces gradient bytes at a constant rate, so bucket ``i`` is ready at
    ``backward * (bytes in buckets 1..i) / n``.  Buckets are all-reduced one at a time, in order,
    each as soon as it is ready and the previous one is done.  Exposed = time the last one
    finishes - ``backward``.  Without overlap every bucket starts when backward ends, so
    exposed = total comm.

    For ``m`` equal buckets of time ``t_b`` (total ``T_comm = m t_b``) this is

        exposed = max( t_b ,  T_comm - backward (m - 1) / m )

    i.e. only the last bucket when comm fits inside backward, else what does not fit.
    """
    if not overlap:
        return float(sum(times))
    total = float(sum(sizes))
    ready = 0.0
    done = 0.0
    filled = 0.0
    for size, t in zip(sizes, times):
        filled += size
        ready = backward * filled / total
        done = max(ready, done) + t
    return max(0.0, done - backward)


# ---------------------------------------------------------------------------------------------
# One step
# ---------------------------------------------------------------------------------------------

def predict_step(method: str, compute: float, grad_bytes: float, p: int, link: Link, *,
                 bucket_bytes: Optional[float] = None, overlap: bool = True,
                 servers: Optional[int] = None, backward_fraction: float = BACKWARD_FRACTION,
                 intra: Optional[Link] = None, gpus_per_node: int = GPUS_PER_NODE) -> dict:
    """Predicted time of one step of ``method`` on ``p`` workers.

    ``compute``: seconds of forward + backward + optimizer without synchronisation;
    ``grad_bytes``: the gradient (= parameter) bytes ``n``; ``p``: workers that compute (for a
    parameter server, the servers are extra processes); ``link``: the link between workers, or
    between nodes when ``intra`` (the link inside a node) is given.

    - a "ring" method (:data:`PATTERNS`: ddp, allreduce): buckets of ``bucket_bytes`` (default 25 MiB), each ring
      all-reduced; comm = sum of the buckets' all-reduce times; exposed = ``exposed_comm`` with
      backward = ``backward_fraction * compute`` (no overlap if ``overlap=False``).
    - a "server" method (ps): one server; comm = pull + push (``server_broadcast_time`` + ``server_reduce_time``);
      nothing overlaps (the pull comes before forward, the push after backward), so
      exposed = comm.
    - its ``<method>_sharded`` (ps_sharded): the same with ``servers`` servers (default: as many
      as workers).

    Returns ``{"method", "p", "servers", "buckets", "compute", "comm", "exposed", "step"}``
    (seconds) with step = compute + exposed.
    """
    if method not in MODELLED_METHODS:
        raise ValueError(f"unknown method {method!r} (known: {', '.join(MODELLED_METHODS)})")
    if p < 1:
        raise ValueError(f"p must be at least 1 (got {p})")
    buckets = 0
    if PATTERNS.get(method) == "ring":
        sizes = bucket_sizes(grad_bytes, bucket_bytes or DDP_BUCKET_BYTES)
        times = [allreduce_time(s, p, link, intra, gpus_per_node) for s in sizes]
        comm = sum(times)
        exposed = exposed_comm(sizes, times, backward_fraction * compute, overlap)
        buckets = len(sizes)
        servers = 0
    else:
        if method in PATTERNS:
            if servers not in (None, 1):
                raise ValueError(f"method {method!r} has one server; use {method + SHARDED!r} for more")
            servers = 1
        elif servers is None:
            servers = p
        comm = (server_broadcast_time(grad_bytes, p, link, servers)
                + server_reduce_time(grad_bytes, p, link, servers))
        exposed = comm
    return {"method": method, "p": p, "servers": servers, "buckets": buckets,
            "compute": compute, "comm": comm, "exposed": exposed, "step": compute + exposed}


# The model, its formulas and its assumptions, as Markdown for the report. Plain Markdown, no
# math engine needed: formulas are Unicode in code spans and fenced blocks. No leading heading
# (the report puts its own above it).
FORMULAS_MARKDOWN = """\
**Link (α-β model).** A message of `m` bytes takes `α + m·β`: α is the latency (s), β the
time per byte (s/byte, `1/bandwidth`).

**Inputs.** `T_compute`: one step's forward + backward + optimizer without synchronisation;
`n`: gradient bytes; `p`: workers; backward `T_b = f·T_compute` with `f = 2/3` (backward about
twice forward, the optimizer small).

**Ring all-reduce** (Thakur, Rabenseifner & Gropp 2005):

```
T_ar(n, p) = 2(p−1)·α + 2·(p−1)/p · n·β        T_ar(n, 1) = 0
```

**Beyond one node** (`g = 8` GPUs per node on NVLink, `N = ⌈p/g⌉` nodes, one network link per
GPU): reduce-scatter and all-gather inside the node, and an all-reduce of each GPU's `n/g` shard
across the nodes:

```
T_ar = 2·[(g−1)·α_NVL + (g−1)/g · n·β_NVL] + 2(N−1)·α_net + 2·(N−1)/N · (n/g)·β_net
```

**DDP and the hand-written all-reduce (bucketed, overlapped).** The gradients are cut into
`m = ⌈n/b⌉` buckets of `b` bytes (25 MiB for DDP), each all-reduced:
`T_comm = Σ_i T_ar(b_i, p)`. Backward produces gradient bytes at a constant rate, so bucket `i`
is ready at `T_b·(b_1 + … + b_i)/n`; buckets are all-reduced one at a time, each as soon as it is
ready and the previous one is done. The exposed communication is the time the last one ends
minus `T_b`. For `m` equal buckets of time `t_b`:

```
T_exposed = max(t_b, T_comm − (m−1)/m · T_b)
```

(only the last bucket shows when communication fits inside backward). Without overlap
`T_exposed = T_comm`.

**Parameter server** (BytePS, OSDI 2020). Each step every worker pulls the `n` parameter bytes
and pushes `n` gradient bytes; with `k` servers each holds `n/k`. A server sends (and receives)
`W` copies of its shard (`W = p` workers), a worker `k` shards; the busier link sets the time of
each phase (`B = 1/β`, the bandwidth):

```
T_pull = T_push = max(W·α + (W·n/k)·β,  k·α + n·β)
T_comm = T_pull + T_push ≈ 2·n·W / (k·B)
```

Central PS: `k = 1`. The model charges the whole pull and push: `T_exposed = T_comm`. The
lab's PS overlaps its push with backward and its pull with the next forward, but the server's
link carries all of it and the server's update sits between the last push and the first
pull, so little of it hides on a busy server link; this is an upper bound where it does.

**Step.** `T_step = T_compute + T_exposed`; throughput `p·batch / T_step`; scaling efficiency
`T_compute / T_step` (= throughput / (p × one GPU's throughput)).

**Calibration.** α and β are fitted per process count by least squares (on relative error) of
`T_ar(n, p)` to the measured all-reduce sweep; `T_compute` is the measured compute-only step.
Interconnect figures in projections are nominal line rates, not measurements.

**Not modelled:** contention between communication and compute for the same cores or memory,
DDP's smaller first bucket, per-tensor messages of the p2p parameter server, the server's
summing, stragglers, and asynchronous (stale) parameter-server updates.
"""


def formulas_markdown() -> str:
    """The cost model as the report explains it (:data:`FORMULAS_MARKDOWN`)."""
    return FORMULAS_MARKDOWN
