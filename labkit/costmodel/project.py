"""Projection to larger machines, the model's tables and its figure."""
from __future__ import annotations

import math
from typing import Optional, Sequence, Union

from labkit.core.files import atomic_path

from .alphabeta import (BACKWARD_FRACTION, DDP_BUCKET_BYTES, DEFAULT_GPUS, DEFAULT_NETWORKS, GB,
                        GPUS_PER_NODE, MODELLED_METHODS, PATTERNS, SHARDED, Link, MiB, get_link,
                        predict_step)


def project(compute_time: float, grad_bytes: float,
            links: Sequence[Union[str, Link]] = DEFAULT_NETWORKS,
            gpus: Sequence[int] = DEFAULT_GPUS, methods: Sequence[str] = MODELLED_METHODS, *,
            batch: Optional[int] = None, intra: Union[str, Link, None] = "nvlink",
            gpus_per_node: int = GPUS_PER_NODE, bucket_bytes: float = DDP_BUCKET_BYTES,
            ps_servers: Optional[int] = None,
            backward_fraction: float = BACKWARD_FRACTION) -> list[dict]:
    """Predicted step time, throughput and scaling efficiency for each link x GPU count x method.

    Topology (the stated choice): nodes of ``gpus_per_node`` GPUs joined by ``intra`` (NVLink)
    inside and by the named link across, one network link per GPU.  All-reduce is hierarchical
    (``hierarchical_allreduce_time``), so beyond one node the network carries ``n / 8`` per GPU.
    ``intra=None`` uses the named link for everything (a flat ring).  A sharded method (FSDP,
    ZeRO-3 by the model's default) gathers and reduce-scatters hierarchically the same way, in
    ``SHARD_UNITS`` units.  A parameter server gets no
    help from NVLink: servers are separate machines, each with one named link; ``ps`` has one,
    ``ps_sharded`` has ``ps_servers`` (default: as many as GPUs, BytePS's balanced case).

    Each row: link (key), link_name, gpus, method, servers, compute, comm, exposed, step (s),
    throughput (samples/s, when ``batch`` per GPU is given, else None) and efficiency =
    compute / step.
    """
    intra_link = get_link(intra) if intra is not None else None
    rows = []
    for key in links:
        link = get_link(key)
        for p in gpus:
            for method in methods:
                sharded = method.endswith(SHARDED) and method not in PATTERNS
                servers = ps_servers if sharded else None
                pred = predict_step(method, compute_time, grad_bytes, p, link,
                                    bucket_bytes=bucket_bytes, servers=servers,
                                    backward_fraction=backward_fraction,
                                    intra=(intra_link if PATTERNS.get(method) in ("ring", "sharded")
                                           else None),
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


def projection_table(rows: list[dict], wide: bool = False, rate: str = "img/s") -> list[dict]:
    """``project`` rows as a table with short column names and rounded numbers.

    Long (default): one row per link, GPU count and method.  ``wide=True``: one row per link
    and GPU count with each method's efficiency in % as a column. ``rate``: the throughput's
    unit (the workload's: img/s, tokens/s).
    """
    if not wide:
        return [{"link": r["link"], "GPUs": r["gpus"], "method": r["method"],
                 "step ms": round(1e3 * r["step"], 2), "exposed ms": round(1e3 * r["exposed"], 2),
                 rate: round(r["throughput"], 1) if r["throughput"] else None,
                 "eff %": round(100 * r["efficiency"], 1)} for r in rows]
    table: dict[tuple, dict] = {}
    for r in rows:
        line = table.setdefault((r["link"], r["gpus"]), {"link": r["link"], "GPUs": r["gpus"]})
        line[f"{r['method']} eff %"] = round(100 * r["efficiency"], 1)
    return list(table.values())


def validation_table(rows: list[dict]) -> list[dict]:
    """``compare_with_bench`` rows with short column names, times in ms ("exposed ms" is the measured
    step - compute, "pred. exposed ms" the model's)."""
    def ms(x):
        return None if x is None else round(1e3 * x, 1)

    return [{"variant": r["variant"], "nproc": r["nproc"], "compute ms": ms(r["compute"]),
             "measured ms": ms(r["measured"]), "predicted ms": ms(r["predicted"]),
             "error %": None if r["error_pct"] is None else round(r["error_pct"], 1),
             "exposed ms": ms(r["measured_exposed"]), "pred. exposed ms": ms(r["predicted_exposed"]),
             "ok": {True: "yes", False: "NO", None: "-"}[r["ok"]], "note": r["note"]}
            for r in rows]


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
    # the first ring method (DDP) wide underneath: with equal bucket sizes the next one's
    # (the hand-written all-reduce's) line lies on top of it
    rings = [m for m in methods if PATTERNS.get(m) == "ring"]
    styles = {**dict(zip(rings, [("o-", 4), ("s--", 1.5)])),
              **{m: ("^-", 1.5) for m in methods if PATTERNS.get(m) == "server"},
              **{m: ("v:", 2) for m in methods if m.endswith(SHARDED) and m not in PATTERNS},
              **{m: ("D-.", 1.5) for m in methods if PATTERNS.get(m) == "sharded"}}
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
    with atomic_path(path) as tmp:  # never a half-written PNG
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)
    return path
