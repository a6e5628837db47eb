"""The model against a `labkit bench` document: alpha and beta fitted to its all-reduce sweep,
and each measured step beside the model's prediction; on an emulated cluster, the fitted
bandwidth beside the link's set rate and measured goodput (:func:`link_fit`)."""
from __future__ import annotations

import math
import statistics
from typing import Iterable, Optional

from labkit.bench.bench_view import check, probe_streams

from labkit.core import builtins

from .alphabeta import DDP_BUCKET_BYTES, ERROR_TARGET_PCT, PATTERNS, SHARDED, Link, MiB, predict_step


BURST_MARGIN = 4  # calibrate: sizes within 4 tbf bursts per ring edge are left out on a link


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


def median_of(stat) -> Optional[float]:
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
    "points", "left_out", "fit_rms_pct", "compute", "grad_bytes", "problem"}}``; where no fit
    is possible (one process, no timings) alpha and beta are None and ``problem`` says why.

    On an emulated cluster's shaped link (the document's ``link``) the sizes whose bytes per
    ring edge, ``2n(p-1)/p``, are at most BURST_MARGIN times tbf's burst are ``left_out``: what
    the bucket refilled between two timed all-reduces passes at loopback speed, so they time the
    bucket, not the rate (at 100mbit, 4 KiB and 32 KiB took 1.0 and 0.8 ms, where the rate
    alone gives 0.3 and 2.6 ms; kept, they pulled the fit to twice the rate). With the margin,
    even a full bucket is at most a quarter of a kept size's bytes.
    """
    check(bench_doc)
    link = bench_doc.get("link") or {}
    burst = (link.get("burst_bytes") or 0) if int(link.get("nodes") or 0) > 1 else 0
    by_nproc: dict[int, list[dict]] = {}
    for row in bench_doc["results"]:
        by_nproc.setdefault(int(row.get("world_size") or row["nproc"]), []).append(row)
    out = {}
    for nproc, rows in sorted(by_nproc.items()):
        swept = [pt for row in rows for pt in _sweep(row)]
        points = [(n, t) for n, t in swept if 2 * n * (nproc - 1) / nproc > BURST_MARGIN * burst]
        computes = [c for c in (median_of(r["compute_time"]) for r in rows) if c is not None]
        cal = {"nproc": nproc, "alpha": None, "beta": None, "bandwidth": None,
               "points": len(points), "left_out": len(swept) - len(points), "fit_rms_pct": None,
               "compute": statistics.median(computes) if computes else None,
               "grad_bytes": rows[0]["grad_bytes"], "problem": None}
        try:
            alpha, beta, rms = fit_alpha_beta(points, nproc)
            cal.update(alpha=alpha, beta=beta, bandwidth=1 / beta, fit_rms_pct=100 * rms)
        except ValueError as e:
            cal["problem"] = str(e)
        out[nproc] = cal
    return out


def link_fit(bench_doc: dict) -> list[dict]:
    """A bench on an emulated cluster (its document's ``link``, labkit.orchestrate.bench): per world
    size, the alpha-beta bandwidth of :func:`calibrate` in Mbit/s beside the link's set rate and
    the goodput its probe measured (the median of every stream, both ways, of the jobs at that
    world size), each as a ratio. [] for a bench on one machine or an unshaped link.

    Why the fit should recover the link. A ring all-reduce of ``n`` bytes over ``p`` ranks is a
    reduce-scatter and an all-gather of ``p - 1`` steps each; in every step each rank sends
    ``n/p`` bytes to the next rank and receives ``n/p`` from the previous one, so each rank, and
    each of the ring's ``p`` edges, moves ``2n(p-1)/p`` bytes each way: ``T = 2(p-1) alpha +
    2n(p-1)/p beta``, and ``1/beta`` is the bus bandwidth (algbw x 2(p-1)/p, nccl-tests' busbw),
    the rate of one edge. torchrun numbers a node's ranks consecutively, so of the ``p = N x
    R`` edges (N nodes of R ranks) N cross a link: one leaves each node's port and one enters
    it (node k's last rank to node k+1's first); the other ``p - N`` are loopback inside a node,
    unshaped. Every edge carries the same bytes in lockstep, so the ring goes at its slowest
    edge's pace, a link edge, and each port carries exactly one edge each way (full duplex:
    sending does not slow receiving). Hence ``1/beta`` = the link's goodput for any N >= 2 and
    any R, not R or N times it. With 2 nodes of 1 rank, ``p = 2``: each rank sends ``n`` bytes
    and receives ``n`` at once, ``T = 2 alpha + n / goodput``.

    The goodput is below the set rate: tbf meters whole frames (1514 bytes on the veth for
    1448 bytes of TCP payload, 95.6%) and the ACKs of the other direction share each port, so
    one TCP stream gets about 94% of the rate; the probe measures exactly that, and the fit
    should match the probe, so ~94% of the set rate. Sizes within a few of tbf's bursts (64 KB
    at 100mbit) pass partly at loopback speed and are left out (:func:`calibrate`); above them
    ``T ~ alpha + (m - refilled) / rate`` (``m`` the bytes per edge), an intercept at or below
    0, which fit_alpha_beta refits with alpha = 0: the bandwidth stands, but alpha is not the
    link's latency there. What it leaves out: all nodes share this machine's CPU, so with several
    ranks per node, or on a fast link, the loopback edges and the summing cost time too, and
    the fit then gives less than the link.
    """
    link = bench_doc.get("link") or {}
    rate, nodes = link.get("rate_bit") or 0, int(link.get("nodes") or 0)
    if not rate or nodes < 2:
        return []
    out = []
    for world, cal in calibrate(bench_doc).items():
        rows = [r for r in bench_doc["results"] if int(r.get("world_size") or r["nproc"]) == world]
        got = probe_streams([r["link"] for r in rows if r.get("link")] or link.get("probes") or [])
        probe = statistics.median(got) if got else None
        bw = None if cal["bandwidth"] is None else 8 * cal["bandwidth"] / 1e6
        out.append({"world_size": world, "nodes": nodes, "ranks_per_node": world // nodes,
                    "link": link.get("link"), "set_mbit": rate / 1e6, "bandwidth_mbit": bw,
                    "of_set": None if bw is None else bw / (rate / 1e6), "probe_mbit": probe,
                    "of_probe": bw / probe if bw is not None and probe else None,
                    "alpha": cal["alpha"], "fit_rms_pct": cal["fit_rms_pct"],
                    "points": cal["points"], "left_out": cal["left_out"], "problem": cal["problem"]})
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
    compute = median_of(row["compute_time"])
    nproc = int(row.get("world_size") or row["nproc"])
    if PATTERNS.get(method) == "server":
        servers = int(row.get("servers") or config.get("ps_servers") or 1)
        workers = int(row.get("trainers") or nproc - servers)
        return predict_step(method if servers == 1 else method + SHARDED, compute, n, workers,
                            link, servers=servers)
    bucket_mb = row.get("bucket_mb") or config.get("bucket_mb") or DDP_BUCKET_BYTES / MiB
    # a method without the option always overlaps (DDP); the others as the row says
    overlap = (_row_overlap(row, config) if "no_overlap" in builtins.METHODS[method]["options"]
               else True)
    return predict_step(method, compute, n, nproc, link, bucket_bytes=bucket_mb * MiB,
                        overlap=overlap)


def _row_note(row: dict) -> str:
    variant = str(row.get("variant", "")).lower()
    if "p2p" in variant or row.get("ps_mode") == "p2p":
        return "p2p: one message per tensor, latency underestimated"
    if "async" in variant or "stale" in variant:
        return "asynchronous: modelled as synchronous"
    return ""


def compare_with_bench(bench_doc: dict, calibration: Optional[dict[int, dict]] = None) -> list[dict]:
    """Each bench result's measured median step time next to the model's prediction.

    The prediction uses the row's own measured compute time and the alpha and beta calibrated
    at its process count.  error_pct = 100 (predicted - measured) / measured; ``ok`` when
    ``|error_pct| <= 25``.  Rows without a calibration get ``predicted = None``.
    """
    check(bench_doc)
    calibration = calibration if calibration is not None else calibrate(bench_doc)
    config = bench_doc.get("config") or {}
    rows = []
    for r in bench_doc["results"]:
        nproc = int(r.get("world_size") or r["nproc"])
        cal = calibration.get(nproc) or {}
        measured = median_of(r["step_time"])
        out = {"method": r["method"], "variant": r.get("variant", r["method"]), "nproc": nproc,
               "measured": measured, "predicted": None, "error_pct": None,
               "compute": median_of(r["compute_time"]),
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
