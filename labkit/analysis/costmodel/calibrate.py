"""The model against a `labkit bench` document: alpha and beta fitted to its all-reduce sweep,
and each measured step beside the model's prediction."""
from __future__ import annotations

import math
import statistics
from typing import Iterable, Optional

from labkit.analysis.bench_view import check
from .alphabeta import DDP_BUCKET_BYTES, ERROR_TARGET_PCT, Link, MiB, predict_step


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
    "points", "fit_rms_pct", "compute", "grad_bytes", "problem"}}``; where no fit is possible
    (one process, no timings) alpha and beta are None and ``problem`` says why.
    """
    check(bench_doc)
    by_nproc: dict[int, list[dict]] = {}
    for row in bench_doc["results"]:
        by_nproc.setdefault(int(row.get("world_size") or row["nproc"]), []).append(row)
    out = {}
    for nproc, rows in sorted(by_nproc.items()):
        points = [pt for row in rows for pt in _sweep(row)]
        computes = [c for c in (median_of(r["compute_time"]) for r in rows) if c is not None]
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
    compute = median_of(row["compute_time"])
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
