"""What the lab's instruments cost, as `labkit bench` reports it: each instrument with a switch
priced in paired rounds, and the loop's work without one, timed call by call (the measurements:
labkit.bench.pricing, in every method's bench job; the document: the row's
``instruments``).

A round ran one trial of the job's own loop and one of each loop that differs from it by one
instrument, back to back in the same processes; so each round gives one ratio per instrument,
the loop without it over the loop with it (seconds per step: the throughput with the
instrument over that without), and the figure is their geometric mean with the t-interval over
the rounds (:func:`paired_ratio`, also the overhead job's). A drift of the machine between
rounds moves both loops of a round alike and leaves the ratio.
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

from labkit.core import stats
from labkit.core.texttable import short_number
from labkit.core.texttable import text_table as _table


def paired_ratio(num, den, confidence: float = stats.CONFIDENCE) -> stats.Interval:
    """exp(mean(log(num_k / den_k))) over the pairs k, with the t-interval of that mean."""
    n = min(len(num), len(den))
    if n == 0:
        return stats.Interval(None, note="no trials")
    d = np.log(np.asarray(num[:n], dtype=float) / np.asarray(den[:n], dtype=float))
    if n < 2:
        return stats.Interval(math.exp(d.mean()), n=n,
                              note="one trial: no interval (run more --trials)")
    return stats.t_interval(d, confidence, math.exp, basis="trials")


def paired_line(name: str, iv: stats.Interval, faster: str, slower: str) -> str:
    """'NAME: R, 95% CI LOW-HIGH: WHY', calling it ``faster`` or ``slower`` only when the
    interval excludes 1.00 (stats.speedup_verdict's rule), else within the rounds' noise."""
    if iv.value is None:
        return f"{name}: n/a ({iv.note})"
    head = f"{name}: {iv.value:.3f}"
    if not iv.available:
        return f"{head} (no confidence interval: {iv.note})"
    label = stats.speedup_verdict(name, iv).label
    why = {"faster": faster, "slower": slower}.get(
        label, f"within the trial-to-trial noise of {iv.n} trials")
    return f"{head}, {100 * iv.confidence:.0f}% CI {iv.ci_text(digits=3, ref=1.0)}: {why}"


INSTRUMENT_NOTE = ("what the lab's instruments cost: in each method's job its synchronised trials "
                   "ran in rounds, each pair of loops both ways round, with the same trials of "
                   "Trainers that differ from it by one instrument (same processes, initial weights and batches); on / off is the "
                   "throughput with the instrument over that without it (below 1.00 it costs), the "
                   "geometric mean of the rounds' paired ratios with its t-interval over the rounds")
WORK_NOTE = ("the loop's other work, timed call by call (the slowest rank's median): a per-epoch "
             "check spread over the steps of an epoch of this configuration; % of the job's "
             "median synchronised step")


def instrument_intervals(r: dict) -> list[tuple[dict, stats.Interval]]:
    """Each priced instrument of a bench row ({"instrument", "on", "off"}) with its throughput
    ratio on / off over the rounds (paired_ratio: trial k of each loop ran in round k)."""
    ins = r.get("instruments") or {}
    loops = ins.get("loops") or {}
    return [(p, paired_ratio(loops[p["off"]]["step_time"]["trials"], loops[p["on"]]["step_time"]["trials"]))
            for p in ins.get("pairs") or [] if p["on"] in loops and p["off"] in loops]


def instrument_lines(r: dict) -> list[str]:
    """One sentence per priced instrument of a bench row: it costs, or saves, only when the
    interval excludes 1.00; a warning when a loop's parameters differ from the job's."""
    out = []
    differing = _differing(r)
    for p, iv in instrument_intervals(r):
        cost = f" ({100 * (1 / iv.value - 1):+.1f}% per step)" if iv.value else ""
        out.append(paired_line(f"{p['instrument']} on {r['variant']} x{r['nproc']}, on / off", iv,
                               "faster with it", "it costs" + cost))
    bad = {k: v for k, v in (differing or {}).items() if v}
    if bad:
        which = ", ".join(f"{k} ({v} tensors)" for k, v in bad.items())
        if _unrepeatable(r):
            out.append(f"note: {r['variant']} x{r['nproc']}: parameters differ from the job's with "
                       f"{which}, and two identical backward passes differ on this GPU too (its "
                       f"kernels are not deterministic): the comparison says nothing of the "
                       f"instruments")
        else:
            out.append(f"WARNING: {r['variant']} x{r['nproc']}: parameters differ from the job's "
                       f"with {which}")
    return out


def _unrepeatable(r: dict) -> bool:
    """The device gave two identical backward passes different gradients (labkit.bench.pricing
    probes it on a GPU where a loop's parameters differed)."""
    return (r.get("instruments") or {}).get("device_repeatable") is False


def _differing(r: dict) -> Optional[dict]:
    """{loop: tensors differing from the job's}, None where they are not expected to match."""
    ins = r.get("instruments") or {}
    return None if ins.get("timing_dependent") else ins.get("params_differing") or {}


def instrument_rows(doc: dict) -> list[dict]:
    out = []
    for r in doc.get("results", []):
        differing = _differing(r)
        for p, iv in instrument_intervals(r):
            out.append({
                "variant": r["variant"], "procs": r["nproc"], "instrument": p["instrument"],
                "on / off": iv.value, "95% CI": iv.ci_text(digits=3, ref=1.0),
                "step time +%": 100 * (1 / iv.value - 1) if iv.value else None,
                "rounds": iv.n, "same parameters": (
                    "n/a (asynchronous)" if differing is None else
                    "yes" if not (differing.get(p["off"]) or differing.get(p["on"])) else
                    "n/a (GPU not deterministic)" if _unrepeatable(r) else "NO"),
            })
    return out


def work_rows(doc: dict) -> list[dict]:
    out = []
    for r in doc.get("results", []):
        w = (r.get("instruments") or {}).get("work")
        if not w:
            continue
        for it in w["items"]:
            out.append({"variant": r["variant"], "procs": r["nproc"], "work": it["work"],
                        "every": it["every"], "us per call": 1e6 * it["seconds"],
                        "us per step": 1e6 * it["per_step"],
                        "% of step": 100 * it["per_step"] / w["step"]})
    return out


def instrument_text(doc: dict) -> list[str]:
    out = []
    rs = instrument_rows(doc)
    if rs:
        out += ["", INSTRUMENT_NOTE, _table(rs, short_number, right=True), "",
                *(line for r in doc["results"] for line in instrument_lines(r))]
    ws = work_rows(doc)
    if ws:
        out += ["", WORK_NOTE, _table(ws, short_number, right=True)]
    return out

