"""An analytic cost model of one data-parallel training step (issue 7).

It predicts the step time of the lab's methods from four numbers: the compute time of one step
without any synchronisation (forward + backward + optimizer), the gradient size ``n`` in bytes,
the number of data-parallel workers ``p``, and a link described by the alpha-beta model:
sending ``m`` bytes in one message costs ``alpha + m * beta`` (``alpha``: latency in seconds,
``beta``: seconds per byte, i.e. 1 / bandwidth).

Methods (the names ``predict_step`` takes):

- ``ddp``        PyTorch DDP: gradients in 25 MiB buckets, each bucket ring-all-reduced while
                 backward still runs;
- ``allreduce``  the lab's hand-written bucketed all-reduce: the same model with its own bucket
                 size, overlapped with backward unless ``overlap=False``;
- ``ps``         a central parameter server: each step every worker pulls the parameters from
                 the server and pushes its gradients to it; the server's link carries it all;
- ``ps_sharded`` ``k`` servers, each owning 1/k of the parameters.

The formulas, with the assumptions behind them, are in the docstrings below and, for the
report, in ``formulas_markdown()``.  ``calibrate`` fits alpha and beta to the all-reduce sweep
of a ``labkit bench`` file, ``validate`` compares the model with the step times measured in the
same file, and ``project`` predicts larger machines on named interconnects (``INTERCONNECTS``).

Command line::

    python -m labkit.model BENCH_JSON [--compute-ms X] [--grad-mb Y] [--batch B] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence, Union

MiB = 2 ** 20
GB = 1e9  # bandwidths are in decimal GB/s, as vendors state them

BACKWARD_FRACTION = 2 / 3        # backward ~ 2x forward; the optimizer step is small
DDP_BUCKET_BYTES = 25 * MiB      # DistributedDataParallel's bucket_cap_mb default
GPUS_PER_NODE = 8                # an HGX/DGX box
ERROR_TARGET_PCT = 25.0          # validate(): a prediction within this is "ok"

METHODS = ("ddp", "allreduce", "ps", "ps_sharded")
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

    - ``ddp`` / ``allreduce``: buckets of ``bucket_bytes`` (default 25 MiB), each ring
      all-reduced; comm = sum of the buckets' all-reduce times; exposed = ``exposed_comm`` with
      backward = ``backward_fraction * compute`` (no overlap if ``overlap=False``).
    - ``ps``: one server; comm = pull + push (``server_broadcast_time`` + ``server_reduce_time``);
      nothing overlaps (the pull comes before forward, the push after backward), so
      exposed = comm.
    - ``ps_sharded``: the same with ``servers`` servers (default: as many as workers).

    Returns ``{"method", "p", "servers", "buckets", "compute", "comm", "exposed", "step"}``
    (seconds) with step = compute + exposed.
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r} (known: {', '.join(METHODS)})")
    if p < 1:
        raise ValueError(f"p must be at least 1 (got {p})")
    buckets = 0
    if method in ("ddp", "allreduce"):
        sizes = bucket_sizes(grad_bytes, bucket_bytes or DDP_BUCKET_BYTES)
        times = [allreduce_time(s, p, link, intra, gpus_per_node) for s in sizes]
        comm = sum(times)
        exposed = exposed_comm(sizes, times, backward_fraction * compute, overlap)
        buckets = len(sizes)
        servers = 0
    else:
        if method == "ps":
            if servers not in (None, 1):
                raise ValueError("method 'ps' has one server; use 'ps_sharded' for more")
            servers = 1
        elif servers is None:
            servers = p
        comm = (server_broadcast_time(grad_bytes, p, link, servers)
                + server_reduce_time(grad_bytes, p, link, servers))
        exposed = comm
    return {"method": method, "p": p, "servers": servers, "buckets": buckets,
            "compute": compute, "comm": comm, "exposed": exposed, "step": compute + exposed}


def formulas_markdown() -> str:
    """The model, its formulas and its assumptions, as Markdown for the report.

    Plain Markdown, no math engine needed: formulas are Unicode in code spans and fenced
    blocks.  No leading heading (the report puts its own above it)."""
    return """\
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


# ---------------------------------------------------------------------------------------------
# Bench files: calibration and validation
# ---------------------------------------------------------------------------------------------

class BenchError(ValueError):
    """A file that is not a readable ``labkit bench`` result."""


def load_bench(path: str) -> dict:
    """Read and check a ``bench.json`` written by ``labkit bench``."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except OSError as e:
        raise BenchError(f"cannot read {path!r}: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BenchError(f"{path!r} is not JSON ({e})") from None
    check_bench(doc, repr(path))
    return doc


def check_bench(doc, where: str = "the document") -> None:
    """Raise ``BenchError`` unless ``doc`` is a labkit bench document with results."""
    if not isinstance(doc, dict) or doc.get("kind") != "labkit.bench":
        raise BenchError(f"{where} is not a labkit bench file (no \"kind\": \"labkit.bench\")")
    results = doc.get("results")
    if not isinstance(results, list) or not results:
        raise BenchError(f"{where} has no results")
    for i, r in enumerate(results):
        for key in ("method", "nproc", "step_time", "compute_time", "grad_bytes"):
            if not isinstance(r, dict) or key not in r:
                raise BenchError(f"{where}: result {i} has no {key!r}")


def fit_alpha_beta(points: Iterable[tuple[float, float]], p: int) -> tuple[float, float, float]:
    """Fit the ring formula ``T = 2(p-1) alpha + 2 n (p-1)/p beta`` to ``(n, T)`` points.

    A straight line ``T = a + b n`` is fitted by least squares on the relative error
    (weights ``1 / T^2``, so a 4 KiB point counts as much as a 40 MiB one), then
    ``alpha = a / (2(p-1))`` and ``beta = b p / (2(p-1))``.  A negative intercept is refitted
    with ``alpha = 0``.  Returns ``(alpha, beta, rms relative error of the fit)``.
    """
    pts = [(float(n), float(t)) for n, t in points if t > 0]
    if p < 2:
        raise ValueError("an all-reduce needs at least 2 processes")
    if not pts:
        raise ValueError("no all-reduce timings")
    w = [1.0 / t ** 2 for _, t in pts]
    sw = sum(w)
    swx = sum(wi * n for wi, (n, _) in zip(w, pts))
    swxx = sum(wi * n * n for wi, (n, _) in zip(w, pts))
    swt = sum(wi * t for wi, (_, t) in zip(w, pts))
    swxt = sum(wi * n * t for wi, (n, t) in zip(w, pts))
    det = sw * swxx - swx * swx
    one_size = len({n for n, _ in pts}) < 2 or det <= 0
    if not one_size:
        a = (swxx * swt - swx * swxt) / det
        b = (sw * swxt - swx * swt) / det
    if one_size or a < 0:  # fit the bandwidth alone
        a, b = 0.0, swxt / swxx
    if b <= 0:
        raise ValueError("all-reduce time does not grow with size")
    rms = math.sqrt(sum(((a + b * n) / t - 1) ** 2 for n, t in pts) / len(pts))
    return a / (2 * (p - 1)), b * p / (2 * (p - 1)), rms


def _median(stat) -> Optional[float]:
    """The median of a bench statistic (``{"median": ...}``) or a bare number."""
    if isinstance(stat, dict):
        stat = stat.get("median")
    return float(stat) if isinstance(stat, (int, float)) else None


def _sweep(row: dict) -> list[tuple[float, float]]:
    """The ``(bytes, seconds)`` all-reduce timings of one result row."""
    coll = row.get("collectives") or {}
    points = [(s["bytes"], s["time"]) for s in coll.get("all_reduce_sweep") or []]
    if not points and coll.get("all_reduce"):
        points = [(coll["all_reduce"]["bytes"], coll["all_reduce"]["time"])]
    return points


def calibrate(bench_doc: dict) -> dict[int, dict]:
    """Per process count: alpha and beta fitted to the all-reduce sweep, and the compute time.

    All rows with the same ``world_size`` (the processes in the sweep's all-reduce) pool their
    sweep points into one ``fit_alpha_beta``.  ``compute`` is the median of the rows'
    ``compute_time.median``.  Returns ``{nproc: {"nproc", "alpha", "beta", "bandwidth",
    "points", "fit_rms_pct", "compute", "grad_bytes", "problem"}}``; where no fit is possible
    (one process, no timings) alpha and beta are None and ``problem`` says why.
    """
    check_bench(bench_doc)
    by_nproc: dict[int, list[dict]] = {}
    for row in bench_doc["results"]:
        by_nproc.setdefault(int(row.get("world_size") or row["nproc"]), []).append(row)
    out = {}
    for nproc, rows in sorted(by_nproc.items()):
        points = [pt for row in rows for pt in _sweep(row)]
        computes = [c for c in (_median(r["compute_time"]) for r in rows) if c is not None]
        cal = {"nproc": nproc, "alpha": None, "beta": None, "bandwidth": None,
               "points": len(points), "fit_rms_pct": None,
               "compute": statistics.median(computes) if computes else None,
               "grad_bytes": rows[0]["grad_bytes"], "problem": None}
        try:
            alpha, beta, rms = fit_alpha_beta(points, nproc)
            cal.update(alpha=alpha, beta=beta, bandwidth=1 / beta, fit_rms_pct=100 * rms)
        except ValueError as e:
            cal["problem"] = str(e)
        out[nproc] = cal
    return out


def _row_overlap(row: dict, config: dict) -> bool:
    """Whether a bench row's all-reduce overlapped backward (its variant, else the config)."""
    if "overlap" in row:
        return bool(row["overlap"])
    if "no_overlap" in row:
        return not row["no_overlap"]
    variant = str(row.get("variant", "")).lower().replace("-", " ").replace("_", " ")
    if "no overlap" in variant or "nooverlap" in variant:
        return False
    return not config.get("no_overlap", False)


def predict_row(row: dict, link: Link, config: Optional[dict] = None) -> dict:
    """``predict_step`` for one bench result row, with its own compute time, workers, servers
    and bucket size."""
    config = config or {}
    method = row["method"]
    n = float(row["grad_bytes"])
    compute = _median(row["compute_time"])
    nproc = int(row.get("world_size") or row["nproc"])
    if method == "ps":
        servers = int(row.get("servers") or config.get("ps_servers") or 1)
        workers = int(row.get("trainers") or nproc - servers)
        return predict_step("ps" if servers == 1 else "ps_sharded", compute, n, workers, link,
                            servers=servers)
    bucket_mb = row.get("bucket_mb") or config.get("bucket_mb") or DDP_BUCKET_BYTES / MiB
    overlap = True if method == "ddp" else _row_overlap(row, config)
    return predict_step(method, compute, n, nproc, link, bucket_bytes=bucket_mb * MiB,
                        overlap=overlap)


def _row_note(row: dict) -> str:
    variant = str(row.get("variant", "")).lower()
    if "p2p" in variant or row.get("ps_mode") == "p2p":
        return "p2p: one message per tensor, latency underestimated"
    if "async" in variant or "stale" in variant:
        return "asynchronous: modelled as synchronous"
    return ""


def validate(bench_doc: dict, calibration: Optional[dict[int, dict]] = None) -> list[dict]:
    """Each bench result's measured median step time next to the model's prediction.

    The prediction uses the row's own measured compute time and the alpha and beta calibrated
    at its process count.  error_pct = 100 (predicted - measured) / measured; ``ok`` when
    ``|error_pct| <= 25``.  Rows without a calibration get ``predicted = None``.
    """
    check_bench(bench_doc)
    calibration = calibration if calibration is not None else calibrate(bench_doc)
    config = bench_doc.get("config") or {}
    rows = []
    for r in bench_doc["results"]:
        nproc = int(r.get("world_size") or r["nproc"])
        cal = calibration.get(nproc) or {}
        measured = _median(r["step_time"])
        out = {"method": r["method"], "variant": r.get("variant", r["method"]), "nproc": nproc,
               "measured": measured, "predicted": None, "error_pct": None,
               "compute": _median(r["compute_time"]),
               "measured_exposed": r.get("exposed_comm"), "predicted_exposed": None,
               "predicted_comm": None, "ok": None, "note": _row_note(r)}
        if cal.get("beta") is not None and out["compute"] is not None:
            link = Link(f"calibrated p={nproc}", cal["alpha"], cal["beta"])
            pred = predict_row(r, link, config)
            out.update(predicted=pred["step"], predicted_exposed=pred["exposed"],
                       predicted_comm=pred["comm"])
            if measured:
                out["error_pct"] = 100 * (pred["step"] - measured) / measured
                out["ok"] = abs(out["error_pct"]) <= ERROR_TARGET_PCT
        else:
            out["note"] = cal.get("problem") or "no calibration at this process count"
        rows.append(out)
    return rows


# ---------------------------------------------------------------------------------------------
# Projection to larger machines
# ---------------------------------------------------------------------------------------------

def project(compute_time: float, grad_bytes: float,
            links: Sequence[Union[str, Link]] = DEFAULT_NETWORKS,
            gpus: Sequence[int] = DEFAULT_GPUS, methods: Sequence[str] = METHODS, *,
            batch: Optional[int] = None, intra: Union[str, Link, None] = "nvlink",
            gpus_per_node: int = GPUS_PER_NODE, bucket_bytes: float = DDP_BUCKET_BYTES,
            ps_servers: Optional[int] = None,
            backward_fraction: float = BACKWARD_FRACTION) -> list[dict]:
    """Predicted step time, throughput and scaling efficiency for each link x GPU count x method.

    Topology (the stated choice): nodes of ``gpus_per_node`` GPUs joined by ``intra`` (NVLink)
    inside and by the named link across, one network link per GPU.  All-reduce is hierarchical
    (``hierarchical_allreduce_time``), so beyond one node the network carries ``n / 8`` per GPU.
    ``intra=None`` uses the named link for everything (a flat ring).  A parameter server gets no
    help from NVLink: servers are separate machines, each with one named link; ``ps`` has one,
    ``ps_sharded`` has ``ps_servers`` (default: as many as GPUs, BytePS's balanced case).

    Each row: link (key), link_name, gpus, method, servers, compute, comm, exposed, step (s),
    throughput (images/s, when ``batch`` per GPU is given, else None) and efficiency =
    compute / step.
    """
    intra_link = get_link(intra) if intra is not None else None
    rows = []
    for key in links:
        link = get_link(key)
        for p in gpus:
            for method in methods:
                servers = ps_servers if method == "ps_sharded" else None
                pred = predict_step(method, compute_time, grad_bytes, p, link,
                                    bucket_bytes=bucket_bytes, servers=servers,
                                    backward_fraction=backward_fraction,
                                    intra=intra_link if method in ("ddp", "allreduce") else None,
                                    gpus_per_node=gpus_per_node)
                rows.append({
                    "link": key if isinstance(key, str) else link.name,
                    "link_name": link.name, "bandwidth": link.bandwidth,
                    "intra": intra_link.name if intra_link else None, "gpus": p, "method": method,
                    "servers": pred["servers"], "grad_bytes": grad_bytes,
                    "compute": pred["compute"], "comm": pred["comm"],
                    "exposed": pred["exposed"], "step": pred["step"],
                    "throughput": p * batch / pred["step"] if batch else None,
                    "efficiency": pred["compute"] / pred["step"]})
    return rows


def projection_table(rows: list[dict], wide: bool = False) -> list[dict]:
    """``project`` rows as a table with short column names and rounded numbers.

    Long (default): one row per link, GPU count and method.  ``wide=True``: one row per link
    and GPU count with each method's efficiency in % as a column.
    """
    if not wide:
        return [{"link": r["link"], "GPUs": r["gpus"], "method": r["method"],
                 "step ms": round(1e3 * r["step"], 2), "exposed ms": round(1e3 * r["exposed"], 2),
                 "img/s": round(r["throughput"], 1) if r["throughput"] else None,
                 "eff %": round(100 * r["efficiency"], 1)} for r in rows]
    table: dict[tuple, dict] = {}
    for r in rows:
        line = table.setdefault((r["link"], r["gpus"]), {"link": r["link"], "GPUs": r["gpus"]})
        line[f"{r['method']} eff %"] = round(100 * r["efficiency"], 1)
    return list(table.values())


def validation_table(rows: list[dict]) -> list[dict]:
    """``validate`` rows with short column names, times in ms ("exposed ms" is the measured
    step - compute, "pred. exposed ms" the model's)."""
    def ms(x):
        return None if x is None else round(1e3 * x, 1)

    return [{"variant": r["variant"], "nproc": r["nproc"], "compute ms": ms(r["compute"]),
             "measured ms": ms(r["measured"]), "predicted ms": ms(r["predicted"]),
             "error %": None if r["error_pct"] is None else round(r["error_pct"], 1),
             "exposed ms": ms(r["measured_exposed"]), "pred. exposed ms": ms(r["predicted_exposed"]),
             "ok": {True: "yes", False: "NO", None: "-"}[r["ok"]], "note": r["note"]}
            for r in rows]


def format_table(rows: list[dict]) -> str:
    """A plain-text table of dicts with the same keys; None shows as '-'."""
    if not rows:
        return "(empty)"
    cols = list(rows[0])
    cells = [[("-" if r.get(c) is None else str(r.get(c))) for c in cols] for r in rows]
    widths = [max(len(c), *(len(line[i]) for line in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip(),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(line, widths)).rstrip() for line in cells]
    return "\n".join(lines)


def plot_projection(rows: list[dict], path: str) -> str:
    """Scaling efficiency against GPUs (log2 axis): one panel per interconnect, one line per
    method.  Writes ``path`` (PNG) and returns it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = list(dict.fromkeys(r["link"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    ncols = min(3, len(links))
    nrows = math.ceil(len(links) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.6 * ncols, 3.6 * nrows),
                             sharex=True, sharey=True, squeeze=False)
    # ddp wide underneath: with equal bucket sizes allreduce's line lies on top of it
    styles = {"ddp": ("o-", 4), "allreduce": ("s--", 1.5), "ps": ("^-", 1.5), "ps_sharded": ("v:", 2)}
    gpus = sorted({r["gpus"] for r in rows})
    for ax, key in zip(axes.flat, links):
        mine = [r for r in rows if r["link"] == key]
        for m in methods:
            pts = sorted((r["gpus"], r["efficiency"]) for r in mine if r["method"] == m)
            fmt, width = styles.get(m, ("x-", 1.5))
            ax.plot([x for x, _ in pts], [100 * y for _, y in pts], fmt, lw=width, label=m)
        ax.set_xscale("log", base=2)
        ax.set_xticks(gpus, [str(g) for g in gpus])
        ax.minorticks_off()
        ax.set_ylim(0, 105)
        ax.grid(True, alpha=0.3)
        ax.set_title(f"{mine[0]['link_name']} ({mine[0]['bandwidth'] / GB:g} GB/s per GPU)",
                     fontsize=10)
    for ax in axes.flat[len(links):]:
        ax.set_visible(False)
    for ax in axes[-1]:
        ax.set_xlabel("GPUs")
    for ax in axes[:, 0]:
        ax.set_ylabel("scaling efficiency (%)")
    first = rows[0]
    inside = f", {first['intra']} inside nodes" if first["intra"] else ""
    fig.suptitle(f"Predicted scaling efficiency: compute {1e3 * first['compute']:.1f} ms/step, "
                 f"gradients {first['grad_bytes'] / MiB:.1f} MiB{inside}")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(methods), frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 0.95))
    from .metrics import atomic_path

    with atomic_path(path) as tmp:  # never a half-written PNG
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, like every labkit command
        print(f"labkit model: error: {message}", file=sys.stderr)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="labkit model",
                description="Calibrate the cost model on a bench file, validate it, and project "
                            "to larger machines.")
    p.add_argument("bench", metavar="BENCH_JSON", help="bench.json written by `labkit bench`")
    p.add_argument("--compute-ms", type=float, help="compute time per step to project, ms "
                   "(default: the bench's DDP compute time at the fewest processes)")
    p.add_argument("--grad-mb", type=float, help="gradient size to project, MiB (default: the bench's)")
    p.add_argument("--batch", type=int, help="per-GPU batch for throughput (default: the bench's)")
    p.add_argument("--out", help="where projection.png and projection.json go "
                                 "(default: the bench file's folder)")
    return p


def _projection_inputs(doc: dict, args) -> tuple[float, float, Optional[int]]:
    """compute (s), gradient bytes and batch: the flags, else the bench's first DDP row at its
    fewest processes (else its first row)."""
    rows = sorted(doc["results"], key=lambda r: (r["method"] != "ddp", r["nproc"]))
    base = rows[0]
    compute = args.compute_ms / 1e3 if args.compute_ms else _median(base["compute_time"])
    grad = args.grad_mb * MiB if args.grad_mb else float(base["grad_bytes"])
    batch = args.batch or base.get("batch_size") or (doc.get("config") or {}).get("batch_size")
    if not compute or compute <= 0:
        raise BenchError("the bench has no compute time; give --compute-ms")
    return compute, grad, batch


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("compute_ms", "grad_mb", "batch"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            print(f"labkit model: error: --{name.replace('_', '-')} must be positive (got {value})",
                  file=sys.stderr)
            return 2
    try:
        doc = load_bench(args.bench)
        compute, grad, batch = _projection_inputs(doc, args)
    except BenchError as e:
        print(f"labkit model: error: {e}", file=sys.stderr)
        return 2

    cal = calibrate(doc)
    if doc.get("device") == "cpu" and not args.compute_ms:
        print("note: the projection uses the compute time measured on this CPU; "
              "give --compute-ms for a GPU's\n")
    print("Calibration (ring all-reduce fitted to the measured sweep):")
    print(format_table([{"nproc": c["nproc"],
                         "alpha us": None if c["alpha"] is None else round(1e6 * c["alpha"], 1),
                         "bandwidth MB/s": None if c["beta"] is None else round(c["bandwidth"] / 1e6, 1),
                         "points": c["points"],
                         "fit rms %": None if c["fit_rms_pct"] is None else round(c["fit_rms_pct"], 1),
                         "compute ms": None if c["compute"] is None else round(1e3 * c["compute"], 1),
                         "problem": c["problem"]} for c in cal.values()]))
    checks = validate(doc, cal)
    print(f"\nValidation (target: within {ERROR_TARGET_PCT:g}%):")
    print(format_table(validation_table(checks)))
    ok = [c["ok"] for c in checks if c["ok"] is not None]
    print(f"{sum(ok)} of {len(ok)} predictions within {ERROR_TARGET_PCT:g}%")

    rows = project(compute, grad, batch=batch)
    print(f"\nProjection: compute {1e3 * compute:.1f} ms/step, gradients {grad / MiB:.1f} MiB, "
          f"batch {batch} per GPU; nominal link figures, NVLink inside 8-GPU nodes; "
          "scaling efficiency = compute / step:")
    print(format_table(projection_table(rows, wide=True)))

    out = args.out or os.path.dirname(os.path.abspath(args.bench))
    try:
        os.makedirs(out, exist_ok=True)
        png = plot_projection(rows, os.path.join(out, "projection.png"))
        path = os.path.join(out, "projection.json")
        from .metrics import atomic_write_json

        atomic_write_json(path, {
            "kind": "labkit.model", "version": 1, "bench": os.path.abspath(args.bench),
            "inputs": {"compute": compute, "grad_bytes": grad, "batch": batch,
                       "backward_fraction": BACKWARD_FRACTION, "gpus_per_node": GPUS_PER_NODE},
            "links": {k: {"name": v.name, "alpha": v.alpha, "beta": v.beta,
                          "bandwidth": v.bandwidth, "source": v.source}
                      for k, v in INTERCONNECTS.items()},
            "calibration": list(cal.values()), "validation": checks, "projection": rows})
    except OSError as e:
        print(f"labkit model: error: cannot write to {out!r}: {e.strerror}", file=sys.stderr)
        return 2
    print(f"\nwrote {png} and {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
