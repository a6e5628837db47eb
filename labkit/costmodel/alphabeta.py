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

#: FSDP's units in a step the model is not told them for: a model's parameters in equal parts,
#: each gathered and reduce-scattered in one collective (a transformer's blocks are its units:
#: a few to a hundred; the report's projection of a measured run takes the run's own)
SHARD_UNITS = 8

#: method -> how the model predicts its step, as its class declares it (labkit.core.builtins):
#: "ring" (bucketed ring all-reduces, overlapped with backward), "server" (a parameter server)
#: or "sharded" (FSDP: each unit's parameters all-gathered, its gradients reduce-scattered)
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
    """Ring reduce-scatter of ``n`` bytes (the whole buffer; each process keeps ``n / p`` of the
    sum): ``(p - 1) alpha + n (p - 1) / p beta``, ``p - 1`` steps of ``n / p`` bytes."""
    if p <= 1:
        return 0.0
    return (p - 1) * link.alpha + n * (p - 1) / p * link.beta


def ring_allgather_time(n: float, p: int, link: Link) -> float:
    """Ring all-gather of ``n`` bytes (the gathered buffer; each process gives ``n / p``): the
    reduce-scatter's steps the other way, ``(p - 1) alpha + n (p - 1) / p beta``."""
    return ring_reduce_scatter_time(n, p, link)


def hierarchical_allgather_time(n: float, p: int, intra: Link, inter: Link,
                                gpus_per_node: int = GPUS_PER_NODE) -> float:
    """All-gather of ``n`` bytes over ``p`` GPUs in nodes of ``g = gpus_per_node`` (p <= g: one
    ring on ``intra``): first each GPU with its peers of the same place in the other nodes, then
    inside the node (the hierarchical all-reduce's second half, as NCCL's rings cross nodes):

        T = (N - 1) alpha_inter + (N - 1) / N (n / g) beta_inter     across: n / g per GPU
            + (g - 1) alpha_intra + (g - 1) / g n beta_intra          inside: the whole n

    with ``N = ceil(p / g)`` nodes, one network link per GPU.
    """
    if p <= gpus_per_node:
        return ring_allgather_time(n, p, intra)
    nodes = math.ceil(p / gpus_per_node)
    return (ring_allgather_time(n / gpus_per_node, nodes, inter)
            + ring_allgather_time(n, gpus_per_node, intra))


def hierarchical_reduce_scatter_time(n: float, p: int, intra: Link, inter: Link,
                                     gpus_per_node: int = GPUS_PER_NODE) -> float:
    """Reduce-scatter of ``n`` bytes over ``p`` GPUs in nodes of ``g``: inside the node first
    (each GPU keeps the node's sum of ``n / g``), then across the nodes of that shard: the
    all-gather's terms, so the same time. A reduce-scatter and an all-gather make the
    hierarchical all-reduce (:func:`hierarchical_allreduce_time`)."""
    return hierarchical_allgather_time(n, p, intra, inter, gpus_per_node)


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


def allgather_time(n: float, p: int, link: Link, intra: Optional[Link] = None,
                   gpus_per_node: int = GPUS_PER_NODE) -> float:
    """A flat ring all-gather on ``link``, or, given an ``intra``-node link, the hierarchical one."""
    if intra is None:
        return ring_allgather_time(n, p, link)
    return hierarchical_allgather_time(n, p, intra, link, gpus_per_node)


def reduce_scatter_time(n: float, p: int, link: Link, intra: Optional[Link] = None,
                        gpus_per_node: int = GPUS_PER_NODE) -> float:
    """A flat ring reduce-scatter on ``link``, or, given ``intra``, the hierarchical one."""
    if intra is None:
        return ring_reduce_scatter_time(n, p, link)
    return hierarchical_reduce_scatter_time(n, p, intra, link, gpus_per_node)


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
# A sharded step (FSDP, ZeRO-3 and ZeRO-2): each unit gathered before it runs
# ---------------------------------------------------------------------------------------------

def sharded_unit_times(n: float, p: int, link: Link, *, units: int = SHARD_UNITS,
                       hsdp: bool = False, intra: Optional[Link] = None,
                       gpus_per_node: int = GPUS_PER_NODE) -> tuple[float, float]:
    """(one unit's all-gather, the reduction of one unit's gradients) in seconds, the model's
    ``n`` bytes cut into ``units`` equal units. FSDP shards over all ``p``: an all-gather and a
    reduce-scatter of ``n / units`` over ``p`` (hierarchical given ``intra``). HSDP shards over a
    node's ``g = min(p, gpus_per_node)`` on ``intra`` (``link`` without it) and replicates across
    the ``ceil(p / g)`` nodes: the gradients reduce-scattered in the node, then each GPU's
    ``n / (units g)`` all-reduced across the nodes on ``link``."""
    m = n / units
    if not hsdp:
        return (allgather_time(m, p, link, intra, gpus_per_node),
                reduce_scatter_time(m, p, link, intra, gpus_per_node))
    g = min(p, gpus_per_node)
    inside = intra or link
    across = ring_allreduce_time(m / g, math.ceil(p / g), link)
    return ring_allgather_time(m, g, inside), ring_reduce_scatter_time(m, g, inside) + across


def sharded_exposed(gather: float, reduce: float, units: int, forward: float, backward: float,
                    again: float = 1.0, overlap: bool = True) -> float:
    """The communication time a sharded step adds to its compute (seconds past
    ``forward + backward``), its ``units`` equal units taking ``forward / units`` and
    ``backward / units`` of compute each.

    Model (FSDP2's prefetch): one link, each collective using it whole, one after another in
    the order they are issued; a unit's all-gather is issued when the unit before it starts to
    compute (one unit ahead), so it runs during that unit's compute, and a unit computes once its
    own is done. Forward goes through the units in order, backward in reverse: each unit is
    gathered again first (``again`` of a gather: 1 for ZeRO-3, 0 for ZeRO-2, which keeps them
    from forward; between, a model part gathered once, as FSDP's root), and its gradients are
    reduced once its backward ends. The step ends when the last reduction has (the optimizer
    needs every shard's gradient). So the first gather of forward and of backward (nothing
    computes while they run) and the last reduction are never hidden, and the others are where
    a unit's communication outlasts a unit's compute. Without
    ``overlap`` nothing hides: every collective's time is added.
    """
    if not overlap:
        return units * ((1 + again) * gather + reduce)
    fwd, bwd = forward / units, backward / units
    link = done = issue = 0.0  # when the link is free, the compute is free, the next gather is issued
    for _ in range(units):  # forward
        link = max(link, issue) + gather
        issue = max(done, link)  # this unit starts: the next one's gather is issued
        done = issue + fwd
    ready = link = max(link, done) + again * gather  # backward's first unit, gathered again
    for k in range(units):  # backward, the last unit first
        start = max(done, ready)
        if k < units - 1:  # the next unit's gather, issued as this one starts
            ready = link = max(link, start) + again * gather
        done = start + bwd
        link = max(link, done) + reduce  # this unit's gradients, once its backward is done
    return max(done, link) - (forward + backward)


# ---------------------------------------------------------------------------------------------
# One step
# ---------------------------------------------------------------------------------------------

def predict_step(method: str, compute: float, grad_bytes: float, p: int, link: Link, *,
                 bucket_bytes: Optional[float] = None, overlap: bool = True,
                 servers: Optional[int] = None, backward_fraction: float = BACKWARD_FRACTION,
                 intra: Optional[Link] = None, gpus_per_node: int = GPUS_PER_NODE,
                 gathers: float = 2.0, units: int = SHARD_UNITS, hsdp: bool = False) -> dict:
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
    - a "sharded" method (fsdp): ``units`` equal units (``sharded_unit_times``), each gathered
      ``gathers`` times a step (2: ZeRO-3, forward and backward; 1: ZeRO-2; a measured run's
      1.42 where a part of the model is gathered once) and its gradients reduce-scattered once
      (and all-reduced across the nodes: ``hsdp``); comm = units x (gathers x gather +
      reduction); exposed = ``sharded_exposed`` with forward and backward of the compute.

    Returns ``{"method", "p", "servers", "buckets", "compute", "comm", "exposed", "step",
    "sent"}`` (seconds; "sent": the bytes a worker sends per step, a ring's share) with step =
    compute + exposed.
    """
    if method not in MODELLED_METHODS:
        raise ValueError(f"unknown method {method!r} (known: {', '.join(MODELLED_METHODS)})")
    if p < 1:
        raise ValueError(f"p must be at least 1 (got {p})")
    buckets, sent = 0, 2 * (p - 1) / p * grad_bytes
    if PATTERNS.get(method) == "ring":
        sizes = bucket_sizes(grad_bytes, bucket_bytes or DDP_BUCKET_BYTES)
        times = [allreduce_time(s, p, link, intra, gpus_per_node) for s in sizes]
        comm = sum(times)
        exposed = exposed_comm(sizes, times, backward_fraction * compute, overlap)
        buckets = len(sizes)
        servers = 0
    elif PATTERNS.get(method) == "sharded":
        gather, reduce = sharded_unit_times(grad_bytes, p, link, units=units, hsdp=hsdp,
                                            intra=intra, gpus_per_node=gpus_per_node)
        comm = units * (gathers * gather + reduce)
        exposed = sharded_exposed(gather, reduce, units, (1 - backward_fraction) * compute,
                                  backward_fraction * compute, gathers - 1, overlap)
        sent, servers = sharded_bytes(grad_bytes, p, gathers, hsdp, gpus_per_node), 0
    else:
        servers = _servers(method, servers, p)
        comm = exposed = (server_broadcast_time(grad_bytes, p, link, servers)
                          + server_reduce_time(grad_bytes, p, link, servers))
        sent = grad_bytes  # a worker pushes its gradients (and pulls the parameters)
    return {"method": method, "p": p, "servers": servers, "buckets": buckets,
            "compute": compute, "comm": comm, "exposed": exposed, "step": compute + exposed,
            "sent": sent}


def _servers(method: str, servers: Optional[int], p: int) -> int:
    """A parameter server's server count: 1 for the method itself, ``servers`` (default: as
    many as workers) for its ``_sharded`` form."""
    if method in PATTERNS:
        if servers not in (None, 1):
            raise ValueError(f"method {method!r} has one server; use {method + SHARDED!r} for more")
        return 1
    return p if servers is None else servers


def sharded_bytes(n: float, p: int, gathers: float = 2.0, hsdp: bool = False,
                  gpus_per_node: int = GPUS_PER_NODE) -> float:
    """The bytes a worker sends per sharded step (a ring's share; it receives as many):
    ``gathers`` all-gathers and one reduce-scatter of the ``n`` bytes, ``(p-1)/p`` of each, so
    ``(gathers + 1)(p-1)/p n``: ZeRO-3 1.5 times the ring all-reduce's ``2(p-1)/p n``, ZeRO-2
    once. HSDP: those over a node's ``g`` GPUs, and the all-reduce of its ``n / g`` shard across
    the ``N`` nodes, ``2(N-1)/N n / g`` (the only bytes that leave the node)."""
    if not hsdp:
        return (gathers + 1) * (p - 1) / p * n if p > 1 else 0.0
    g = min(p, gpus_per_node)
    nodes = math.ceil(p / g)
    return (gathers + 1) * (g - 1) / g * n + 2 * (nodes - 1) / nodes * n / g


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

**All-gather and reduce-scatter** (a ring: `p−1` steps of `n/p` bytes; `n` the gathered
buffer, or the one reduced), and beyond one node across the nodes on each GPU's `n/g`, then
inside the node (the all-reduce above is one of each):

```
T_ag(n, p) = T_rs(n, p) = (p−1)·α + (p−1)/p · n·β
T_ag = (N−1)·α_net + (N−1)/N · (n/g)·β_net + (g−1)·α_NVL + (g−1)/g · n·β_NVL
```

**FSDP (sharded: ZeRO-3 and ZeRO-2).** The parameters in `u` equal units (8 unless the run
says; FSDP's are the model's blocks). Per step each unit is all-gathered before its forward and
again before its backward (ZeRO-3; ZeRO-2 keeps it from forward: once), and its gradients
reduce-scattered after its backward: `T_comm = u·(k·T_ag(n/u, p) + T_rs(n/u, p))` with `k = 2`
or `1`; a worker sends `(k+1)·(p−1)/p·n`, 1.5 times the ring all-reduce's at ZeRO-3, the same
at ZeRO-2. Overlap (FSDP's prefetch): one link, collectives one after another in the order
issued; a unit's gather is issued as the unit before it starts computing, so it hides behind
that unit's compute (`T_f/u` forward, `T_b/u` backward, `T_f = T_compute − T_b`), and each
reduce-scatter behind the next unit's backward. The first gather of forward and of backward
(ZeRO-3) and the last reduce-scatter always show, and whatever of a unit's communication
outlasts a unit's compute:

```
T_exposed ≈ k·T_ag(n/u, p) + T_rs(n/u, p) + Σ_units max(0, unit's communication − unit's compute)
```

**HSDP** shards over a node's `g` GPUs and replicates across the `N` nodes: its gathers and
reduce-scatters run inside the node, and each GPU all-reduces its `n/(u·g)` share of a unit's
gradients across the nodes, `T_ar(n/(u·g), N)` on the network: the hierarchical all-reduce's
network bytes, where FSDP over every GPU sends 1.5 times those (ZeRO-3).

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
summing, stragglers, asynchronous (stale) parameter-server updates, FSDP's units of unequal
size and its all-gathers and reduce-scatters on separate streams sharing the link at once.
"""


def formulas_markdown() -> str:
    """The cost model as the report explains it (:data:`FORMULAS_MARKDOWN`)."""
    return FORMULAS_MARKDOWN
