"""Every method of an experiment projected to large machines from what it was measured to do:
its compute-only step and the bytes the lab counted on the wire (issue 37). So a method that
sends less (bf16 gradients, PowerSGD, local SGD, DiLoCo) is placed on the interconnects where
it would start to beat DDP, which a 2-core CPU run cannot show by itself.

Per method, from its result file (repeat 1):

- ``compute``: the compute-only forward + backward and the optimizer step of the run's
  breakdown (labkit.core.breakdown: calibrated steps with synchronisation skipped); the
  report gives every method DDP's, so the projection compares what each sends, not the noise
  of each run's compute;
- ``round``: the bytes one communication round all-reduces. An all-reduce of ``B`` bytes moves
  ``2 (n-1)/n B`` per rank (a ring), so ``B = sent x n / (2 (n-1))`` from the bytes a trainer
  sent per step; a method that sent in only a share ``s`` of its steps (local SGD every H
  steps: s = 1/H) all-reduces ``B / s`` once every ``1 / s`` steps;
- a parameter server (a method whose ranks serve) is the model's ``ps``: its workers pull and
  push what they were measured to send;
- a sharded method (its class's cost model "sharded": fsdp, and HSDP as its replicas) is the
  model's sharded step: from the bytes it was measured to gather and to reduce-scatter per
  step, the parameters ``n`` and how many times a step it gathers them (ZeRO-3's 2, 1.42 where
  the root is gathered once, ZeRO-2's 1), in the run's own units (its ``shard_units``). It
  runs no compute-only steps: its compute is DDP's (the report's, for every method).

Projected step = compute + exposed communication, with the all-reduce rounds on the model's
topology (hierarchical: NVLink inside nodes of 8, the named link across; alphabeta). A method
that sends in every step is taken to all-reduce 25 MiB buckets while backward runs, as the
model's DDP (optimistic for one that all-reduces only after backward); one that talks every
few steps waits for its round (no overlap). Not modelled: the
compute a method adds to compress (PowerSGD's matrix products), stragglers, and accuracy,
which the report's table of time to accuracy over seeds judges.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from labkit.core import breakdown
from labkit.core.methods import BASELINE
from labkit.core.results import Result

from .alphabeta import (BACKWARD_FRACTION, DDP_BUCKET_BYTES, DEFAULT_GPUS, DEFAULT_NETWORKS,
                        INTERCONNECTS, PATTERNS, SHARD_UNITS, Link, allreduce_time, bucket_sizes,
                        exposed_comm, get_link, predict_step)

#: the one-server parameter server's model, which every method whose ranks serve is projected
#: by (the model's "server" pattern, as the built-in parameter server declares it)
SERVER = next(k for k, p in PATTERNS.items() if p == "server")
#: the model of a sharded step (fsdp's; the measured bytes say how many gathers it made)
SHARDED_STEP = next(k for k, p in PATTERNS.items() if p == "sharded")
#: a sharded method's phases by what they carry: fsdp's names, then the manual zero3's
GATHERS, SCATTERS, ACROSS = ("all_gather", "gather"), ("reduce_scatter", "reduce"), ("all_reduce",)
#: the link between a node's ranks on an emulated cluster: loopback, as good as free against
#: the shaped port
LOOPBACK = Link("loopback", 0.0, 0.0)


def trainers_wire(doc: Result) -> Optional[tuple[float, float, int]]:
    """(bytes a trainer sent per step, the share of steps it sent in, trainers) from the last
    epoch's wire figures; None without them."""
    ep = [e for e in doc.epochs if isinstance(e.wire, dict)]
    if not ep:
        return None
    w = ep[-1].wire
    ranks = [i for i, t in enumerate(w.get("trainer") or []) if t]
    if not ranks or not w.get("sent_per_step"):
        return None
    sent = float(np.mean([w["sent_per_step"][i] for i in ranks]))
    share = float(np.mean([w["sending_steps"][i] for i in ranks])) if w.get("sending_steps") else 1.0
    return sent, share, len(ranks)


def round_bytes(sent: float, share: float, n: int) -> float:
    """The bytes one round all-reduces, from a trainer's bytes sent per step (a ring moves
    2(n-1)/n of them per rank) and the share of steps it sent in."""
    if n < 2 or sent <= 0 or share <= 0:
        return 0.0
    return sent * n / (2 * (n - 1)) / share


def measured_inputs(doc: Result) -> Optional[dict]:
    """{"compute", "trainers", "round", "period", "sent"} for one result file (and a sharded
    method's: sharded_inputs), or None where it lacks a breakdown or wire figures. A sharded
    method has no breakdown (no compute-only steps): its "compute" is None, DDP's to be given."""
    b = breakdown.of_result(doc)
    w = trainers_wire(doc)
    sharded = PATTERNS.get(doc.method_key or "") == "sharded"
    if w is None or (b is None and not sharded):
        return None
    sent, share, n = w
    out = {"compute": b.parts["compute"] + b.parts["optimizer"] if b is not None else None,
           "trainers": n, "round": round_bytes(sent, share, n),
           "period": 1.0 / share if share > 0 else 1.0, "sent": sent}
    if sharded:
        more = sharded_inputs(doc, n)
        if more is None:
            return None
        out.update(more)
    return out


def sharded_inputs(doc: Result, n: int) -> Optional[dict]:
    """{"pattern", "params", "gathers", "units", "replicas"} of a sharded method's run, from its
    trainers' bytes per step by phase (a ring's share: (s-1)/s of each buffer over its shard
    group of s = n / replicas ranks): the parameter bytes from the reduce-scatter, the gathers
    a step from the all-gathers against them; None without them."""
    w = doc.epochs[-1].wire if doc.epochs else None
    phases = (w or {}).get("by_phase") or {}
    ranks = [i for i, t in enumerate(w.get("trainer") or []) if t] if w else []

    def sent(names):
        return sum(float(np.mean([phases[k]["sent"][i] for i in ranks])) for k in names if k in phases)

    replicas = int(doc.config.get("fsdp_replicas") or 1)
    s = n // replicas
    scattered, gathered = sent(SCATTERS), sent(GATHERS)
    if not ranks or s < 2 or scattered <= 0:
        return None
    params = scattered * s / (s - 1)
    units = doc.epochs[-1].extra.get("shard_units") or SHARD_UNITS
    return {"pattern": "sharded", "params": params, "gathers": gathered / scattered,
            "units": int(units), "replicas": replicas}


def project_one(inputs: dict, p: int, link, *, serves: bool,
                intra=INTERCONNECTS["nvlink"]) -> dict:
    """One method's projected step on ``p`` GPUs: {"compute", "comm", "exposed", "step"} (s)."""
    c = inputs["compute"]
    if serves:  # a PS worker pulls and pushes what it sent: the model's one-server PS
        pred = predict_step(SERVER, c, inputs["sent"], p, link)
        return {k: pred[k] for k in ("compute", "comm", "exposed", "step")}
    if inputs.get("pattern") == "sharded":
        return project_sharded(inputs, p, link, intra)
    sizes = bucket_sizes(inputs["round"], DDP_BUCKET_BYTES)
    times = [allreduce_time(s, p, link, intra) for s in sizes]
    period = max(1.0, inputs["period"])
    comm = sum(times) / period  # one round every ``period`` steps
    if period == 1.0:  # every step, bucket by bucket while backward runs (as DDP)
        exposed = exposed_comm(sizes, times, BACKWARD_FRACTION * c)
    else:
        exposed = comm
    return {"compute": c, "comm": comm, "exposed": exposed, "step": c + exposed}


def project_sharded(inputs: dict, p: int, link, intra) -> dict:
    """A sharded method's projected step: FSDP over all ``p`` (hierarchical on ``intra``), or
    HSDP (a run with replicas) sharded inside each node and replicated across. Without
    ``intra`` (an emulated cluster's flat link, labkit.report.projection.on_link) HSDP's shard
    group is a node's ranks on loopback, and their all-reduces share the node's one port:
    each rank's part of it at 1/s of the link's rate."""
    x, kw = inputs, {}
    hsdp = x["replicas"] > 1
    if hsdp and intra is None:
        s = max(1, x["trainers"] // x["replicas"])
        link = Link(link.name, link.alpha, link.beta * s)
        kw = {"intra": LOOPBACK, "gpus_per_node": s}
    elif intra is not None:
        kw = {"intra": intra}
    pred = predict_step(SHARDED_STEP, x["compute"], x["params"], p, link, gathers=x["gathers"],
                        units=x["units"], hsdp=hsdp, **kw)
    return {k: pred[k] for k in ("compute", "comm", "exposed", "step")}


def project_methods(inputs: dict[str, dict], serves: dict[str, bool],
                    links: Sequence[str] = DEFAULT_NETWORKS,
                    gpus: Sequence[int] = DEFAULT_GPUS) -> list[dict]:
    """Rows {method, link, link_name, gpus, compute, comm, exposed, step, efficiency} for each
    method x link x GPU count; ``serves``: method -> whether its ranks serve (a PS)."""
    rows = []
    for key in links:
        link = get_link(key)
        for p in gpus:
            for m, x in inputs.items():
                pred = project_one(x, p, link, serves=serves[m])
                rows.append({"method": m, "link": key, "link_name": link.name, "gpus": p,
                             **pred, "efficiency": pred["compute"] / pred["step"]})
    return rows


def where_it_wins(rows: list[dict], m: str, base: str = BASELINE,
                  margin: float = 0.01) -> dict[str, Optional[int]]:
    """{link: the smallest GPU count at which ``m``'s projected step is shorter than
    ``base``'s by more than ``margin``, None if at none}."""
    out: dict[str, Optional[int]] = {}
    step = {(r["method"], r["link"], r["gpus"]): r["step"] for r in rows}
    for link in dict.fromkeys(r["link"] for r in rows):
        gpus = sorted({r["gpus"] for r in rows if r["link"] == link})
        out[link] = next((p for p in gpus if step[(m, link, p)] < (1 - margin) * step[(base, link, p)]),
                         None)
    return out


def break_even(inputs: dict, base: dict, p: int, link, *, serves: bool, base_serves: bool = False,
               margin: float = 0.01, low: float = 1e-4, high: float = 10.0) -> Optional[tuple[float, float]]:
    """The compute times per step (s) at which the method of ``inputs`` is projected to beat
    ``base`` (DDP) by more than ``margin`` on ``p`` GPUs over ``link``: (shortest, longest) of a
    log grid from ``low`` to ``high``, both given the same compute; None where at none. Less
    compute leaves more of the step to communication, so a method that sends less wins below
    some compute time, and a grid end means "at least / at most this"."""
    grid = np.geomspace(low, high, 121)
    wins = [c for c in grid
            if project_one({**inputs, "compute": c}, p, link, serves=serves)["step"]
            < (1 - margin) * project_one({**base, "compute": c}, p, link, serves=base_serves)["step"]]
    return (float(wins[0]), float(wins[-1])) if wins else None
