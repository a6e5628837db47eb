"""labkit's communication overlap against Holistic Trace Analysis's, on the same traces.

    python tools/hta_compare.py BENCH_RUN_FOLDER [--json OUT.json]

BENCH_RUN_FOLDER is a `labkit bench --profile` run (bench.json, and jobs/<variant>_x<n>/
trace_rank<r>.json). For each profiled job it prints, side by side:

- labkit's figures from bench.json (host-side timers, over the timed trials): communication per
  step, the exposed and hidden parts, overlap = hidden / (hidden + exposed);
- HTA's (PyPI `holistictraceanalysis`, not a labkit dependency: install it beside labkit to run
  this), from the GPU kernels of the profiled steps: the time NCCL kernels ran per step (merged
  intervals, HTA's kernel classification), the share of it that overlapped a compute kernel
  (`get_comm_comp_overlap`), and GPU idle/compute/non-compute time (`get_temporal_breakdown`).

Host timers and the device can disagree under overlap; this is the cross-check. Where a trace
holds no communication kernel (one rank, or gloo, which moves CUDA tensors by memory copies
rather than NCCL kernels), HTA has no overlap to give, and the line says so.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path


def _steps_in(trace: Path) -> int:
    """The profiled steps: the loop labels each with a `labkit.step` range."""
    text = trace.read_text()
    return max(1, len(re.findall(r'"name": "labkit\.step"', text)))


def _hta_job(folder: Path) -> dict:
    from hta.trace_analysis import TraceAnalysis
    from hta.utils.utils import KernelType, get_kernel_type, merge_kernel_intervals

    files = {int(p.stem.removeprefix("trace_rank")): str(p) for p in sorted(folder.glob("trace_rank*.json"))}
    if not files:
        return {"error": f"no trace_rank*.json in {folder}"}
    ta = TraceAnalysis(trace_files=files, trace_dir=str(folder))
    syms = ta.t.symbol_table.get_sym_table()
    if not any(df["stream"].ne(-1).any() for df in ta.t.traces.values()):
        return {"error": "no GPU kernel in the traces (a CPU run): HTA analyses GPU kernels"}
    out = {}
    overlap = ta.get_comm_comp_overlap(visualize=False).set_index("rank")
    temporal = ta.get_temporal_breakdown(visualize=False).set_index("rank")
    for rank, df in ta.t.traces.items():
        k = df[df["stream"].ne(-1)].copy()
        k["kind"] = [get_kernel_type(syms[n]) for n in k["name"]]
        comm = merge_kernel_intervals(k[k["kind"].eq(KernelType.COMMUNICATION.name)].copy())
        steps = _steps_in(Path(files[rank]))
        comm_us = float((comm["end"] - comm["ts"]).sum()) if len(comm) else 0.0
        ratio = overlap.loc[rank, "comp_comm_overlap_ratio"] if comm_us else None
        t = temporal.loc[rank]
        out[int(rank)] = {
            "steps": steps,
            "comm_kernels": int(k["kind"].eq(KernelType.COMMUNICATION.name).sum()),
            "comm_ms_per_step": comm_us / 1e3 / steps,
            "overlap": None if ratio is None else float(ratio),
            "exposed_ms_per_step": None if ratio is None else comm_us * (1 - ratio) / 1e3 / steps,
            "idle_pctg": float(t["idle_time_pctg"]),
            "compute_pctg": float(t["compute_time_pctg"]),
            "non_compute_pctg": float(t["non_compute_time_pctg"]),
        }
    return out


def _ms(x) -> str:
    return "-" if x is None else f"{1000 * x:.2f} ms"


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def compare(run: Path) -> list[dict]:
    bench = json.loads((run / "bench.json").read_text())
    rows = []
    for r in bench.get("results", []):
        folder = run / r["folder"]
        if not any(folder.glob("trace_rank*.json")):
            continue
        hidden, exposed = r.get("hidden_comm"), r.get("exposed_comm")
        comm = None if hidden is None or exposed is None else hidden + max(0.0, exposed)
        rows.append({"variant": r["variant"], "nproc": r["nproc"],
                     "labkit": {"comm": comm, "exposed": exposed, "hidden": hidden,
                                "overlap": r.get("overlap"), "step": r["step_time"]["median"]},
                     "hta": _hta_job(folder)})
    return rows


def show(rows: list[dict]) -> None:
    for row in rows:
        lk = row["labkit"]
        print(f"== {row['variant']} x{row['nproc']}: labkit (host timers): step {_ms(lk['step'])}, "
              f"communication {_ms(lk['comm'])}, exposed {_ms(lk['exposed'])}, hidden "
              f"{_ms(lk['hidden'])}, overlap {_pct(lk['overlap'])}")
        hta = row["hta"]
        if "error" in hta:
            print(f"   HTA: {hta['error']}")
            continue
        for rank, h in sorted(hta.items()):
            if not h["comm_kernels"]:
                print(f"   HTA rank {rank}: no NCCL kernel in {h['steps']} profiled steps (nothing "
                      f"to overlap); GPU idle {h['idle_pctg']:.1f}%, compute {h['compute_pctg']:.1f}%, "
                      f"non-compute {h['non_compute_pctg']:.1f}%")
                continue
            print(f"   HTA rank {rank} (GPU kernels, {h['steps']} profiled steps): NCCL kernels "
                  f"{h['comm_ms_per_step']:.2f} ms/step ({h['comm_kernels']} kernels), overlapped "
                  f"with compute {_pct(h['overlap'])}, exposed {h['exposed_ms_per_step']:.2f} ms/step; "
                  f"GPU idle {h['idle_pctg']:.1f}%, compute {h['compute_pctg']:.1f}%, non-compute "
                  f"{h['non_compute_pctg']:.1f}%")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", type=Path, help="a labkit bench --profile run folder")
    p.add_argument("--json", type=Path, help="also write the figures here")
    a = p.parse_args(argv)
    if not (a.run / "bench.json").is_file():
        print(f"hta_compare: {a.run} has no bench.json (a labkit bench --profile run folder)",
              file=sys.stderr)
        return 2
    try:
        import hta  # noqa: F401
    except ImportError:
        print("hta_compare: needs Holistic Trace Analysis: pip install holistictraceanalysis",
              file=sys.stderr)
        return 2
    rows = compare(a.run)
    if not rows:
        print(f"hta_compare: no job of {a.run} has a trace (run labkit bench with --profile)",
              file=sys.stderr)
        return 2
    show(rows)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
