"""`labkit model BENCH_JSON`: calibrate on a bench file, compare, project; print and write
projection.png and projection.json. The tables are the command's product (print, stdout, shown
with -q too); its note and errors go through its logger."""
from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Optional

from labkit.bench.bench_view import BenchError
from labkit.bench.bench_view import link_fit_line
from labkit.bench.bench_view import load as load_bench
from labkit.core.cliparser import OneLineParser
from labkit.core.files import atomic_write_json
from labkit.core.methods import BASELINE
from labkit.core.texttable import text_table

from .alphabeta import BACKWARD_FRACTION, ERROR_TARGET_PCT, GPUS_PER_NODE, INTERCONNECTS, MiB
from .calibrate import median_of, calibrate, compare_with_bench, link_fit
from .project import plot_projection, project, projection_table, validation_table

log = logging.getLogger(__name__)


def _table(rows: list[dict]) -> str:
    return text_table(rows, strip=True)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="labkit model",
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
    rows = sorted(doc["results"], key=lambda r: (r["method"] != BASELINE, r["nproc"]))
    base = rows[0]
    compute = args.compute_ms / 1e3 if args.compute_ms else median_of(base["compute_time"])
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
            log.error("labkit model: error: --%s must be positive (got %s)", name.replace("_", "-"),
                      value)
            return 2
    try:
        doc = load_bench(args.bench)
        compute, grad, batch = _projection_inputs(doc, args)
    except BenchError as e:
        log.error("labkit model: error: %s", e)
        return 2

    cal = calibrate(doc)
    if doc.get("device") == "cpu" and not args.compute_ms:
        log.info("note: the projection uses the compute time measured on this CPU; "
                 "give --compute-ms for a GPU's\n")
    print("Calibration (ring all-reduce fitted to the measured sweep):")
    print(_table([{"nproc": c["nproc"],
                         "alpha us": None if c["alpha"] is None else round(1e6 * c["alpha"], 1),
                         "bandwidth MB/s": None if c["beta"] is None else round(c["bandwidth"] / 1e6, 1),
                         "points": c["points"],
                         "fit rms %": None if c["fit_rms_pct"] is None else round(c["fit_rms_pct"], 1),
                         "compute ms": None if c["compute"] is None else round(1e3 * c["compute"], 1),
                         "problem": c["problem"]} for c in cal.values()]))
    for f in link_fit(doc):  # a bench on an emulated cluster: the fit against its link
        print(link_fit_line(f))
    checks = compare_with_bench(doc, cal)
    print(f"\nValidation (target: within {ERROR_TARGET_PCT:g}%):")
    print(_table(validation_table(checks)))
    ok = [c["ok"] for c in checks if c["ok"] is not None]
    print(f"{sum(ok)} of {len(ok)} predictions within {ERROR_TARGET_PCT:g}%")

    rows = project(compute, grad, batch=batch)
    print(f"\nProjection: compute {1e3 * compute:.1f} ms/step, gradients {grad / MiB:.1f} MiB, "
          f"batch {batch} per GPU; nominal link figures, NVLink inside 8-GPU nodes; "
          "scaling efficiency = compute / step:")
    print(_table(projection_table(rows, wide=True)))

    out = args.out or os.path.dirname(os.path.abspath(args.bench))
    try:
        os.makedirs(out, exist_ok=True)
        png = plot_projection(rows, os.path.join(out, "projection.png"))
        path = os.path.join(out, "projection.json")
        atomic_write_json(path, {
            "kind": "labkit.model", "version": 1, "bench": os.path.abspath(args.bench),
            "inputs": {"compute": compute, "grad_bytes": grad, "batch": batch,
                       "backward_fraction": BACKWARD_FRACTION, "gpus_per_node": GPUS_PER_NODE},
            "links": {k: {"name": v.name, "alpha": v.alpha, "beta": v.beta,
                          "bandwidth": v.bandwidth, "source": v.source}
                      for k, v in INTERCONNECTS.items()},
            "calibration": list(cal.values()), "validation": checks, "projection": rows})
    except OSError as e:
        log.error("labkit model: error: cannot write to %r: %s", out, e.strerror)
        return 2
    log.info("\nwrote %s and %s", png, path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
