"""The memory table (caption key ``memory``) and its sentence on page one: per method, what the
fullest rank held of the model's parameters, gradients and optimizer state (between steps, and
the most during a step), its peak during a step, the method's own declaration of what it holds
(memory_per_rank) and the preflight's estimate, beside its time and bytes per step; and what of
the model's family each method would fit in this machine's memory per rank. Read from the
result files alone (the epoch's ``memory``, the run's ``memory_model``: written by
labkit.training.instruments.memory); a run whose files have neither (written before they were
recorded) has no table and no sentence."""
from __future__ import annotations

from typing import Optional

from labkit.core import stats
from labkit.core.methods import BASELINE, METHOD_ORDER, label
from labkit.core.results import Result

from .blocks import Block, Markdown, Page, Table, TableCaption
from .captions import ref
from .load import RunResults
from .tables import WIRE, intervals, listed, wire_mb, wire_text
from .text import WORDS, speed_verdicts

MiB = 2 ** 20
PARTS = ("parameters", "gradients", "optimizer")
HELD = "Held (MiB: params + grads + optimizer)"
MOST = "Most in a step (MiB)"
MODEL = "Modelled (MiB)"
PEAK = "Peak (MiB)"
PREFLIGHT = "Preflight (MiB)"
STEP = "Step (ms, 95% CI)"


def recorded(doc: Result) -> Optional[dict]:
    """The last epoch's memory record, None in a file written before it was recorded."""
    m = doc.epochs[-1].memory if doc.epochs else None
    return m if isinstance(m, dict) and m.get("parameters") else None


def has_memory(res: RunResults) -> bool:
    return any(recorded(d) for d in res.ok.values())


def fullest(lists: list[Optional[list]]) -> Optional[list[int]]:
    """Per rank, the sum of ``lists`` (each one value per rank), at the rank where it is the
    largest: [its parts..., the sum]; None where a list is missing."""
    if any(not x for x in lists):
        return None
    totals = [sum(col) for col in zip(*lists)]
    r = max(range(len(totals)), key=totals.__getitem__)
    return [x[r] for x in lists] + [totals[r]]


def held(doc: Result) -> dict[str, Optional[list[int]]]:
    """The fullest rank's bytes: between steps, the most in a step (the optimizer's state does
    not change within one), by the method's model, and its peak: each [parts..., total]."""
    m, model = recorded(doc) or {}, doc.memory_model or {}
    between = [m.get(k) for k in PARTS]
    peak = m.get("allocator_peak") or m.get("tracked_peak")
    return {"between": fullest(between),
            "most": fullest([m.get("step_parameters"), m.get("step_gradients"), m.get("optimizer")]),
            "model": fullest([model.get(k) for k in PARTS]),
            "peak": [max(peak)] if peak else None}


def _mib(parts: Optional[list[int]]) -> str:
    """"0.45 + 0.45 + 0.90 = 1.81", or the one figure, in MiB; "-" where not measured."""
    if not parts:
        return "-"
    said = [f"{b / MiB:.2f}" for b in parts]
    return said[0] if len(said) == 1 else f"{' + '.join(said[:-1])} = {said[-1]}"


def step_ms(res: RunResults, m: str) -> str:
    """Mean time per steady-state step with its 95% CI, from the throughput's (the same batch
    over the same trainers, so a step is the units of one step over the throughput)."""
    thr, doc = intervals(res)[m]["throughput"], res.ok[m]
    if not thr.value:
        return "-"
    k = 1000 * stats.images_per_step(doc)
    ci = f" ({k / thr.high:.1f}-{k / thr.low:.1f})" if thr.available else " (n/a)"
    return f"{k / thr.value:.1f}{ci}"


def memory_rows(res: RunResults) -> list[dict]:
    """One row per method with a memory record, in table order."""
    rows = []
    for m in listed(res):
        doc = res.ok.get(m)
        if doc is None or not recorded(doc):
            continue
        h, model = held(doc), doc.memory_model or {}
        rows.append({"Method": label(m), HELD: _mib(h["between"]),
                     MOST: _mib(h["most"][-1:] if h["most"] else None),
                     MODEL: _mib(h["model"][-1:] if h["model"] else None),
                     PEAK: _mib(h["peak"]),
                     PREFLIGHT: _mib([model["tensors"]] if model.get("tensors") else None),
                     STEP: step_ms(res, m), WIRE: wire_text(wire_mb(doc))})
    return rows


def memory_blocks(page: Page) -> list[Block]:
    """The memory part: its table, the fullest rank of each method."""
    res = page.res
    peak = ("the CUDA allocator's over the epoch's steps" if any(
        (recorded(d) or {}).get("allocator_peak") for d in res.ok.values())
        else "the tensors followed through one untimed step")
    notes = [n for n in (memory_line(res, "Each sharded method against DDP: "),
                         fits_note(res)) if n]
    return [TableCaption("memory", page.view, {"peak": peak}), Table(memory_rows(res)),
            *(Markdown(n, plain=(n, "")) for n in notes)]


def memory_line(res: RunResults, lead: str = "") -> Optional[str]:
    """What each method that shards the model holds of DDP's memory per rank (the memory
    table's fullest rank: its state at most in a step, and its peak) and what it costs in time
    per step against DDP: the inverse of the comparison's speedup, with its interval and the
    verdict of the same rule (a difference only where the interval excludes 1.00). ``lead``:
    the sentence's start (the memory part's note under its table says it too)."""
    if BASELINE not in res.ok or not recorded(res.ok[BASELINE]):
        return None
    base = held(res.ok[BASELINE])
    others = [m for m in METHOD_ORDER if m in res.ok and m != BASELINE]  # speed_verdicts' order
    verdict, ivs = dict(zip(others, speed_verdicts(res))), intervals(res)
    said = []
    for m in others:
        doc = res.ok[m]
        if not (recorded(doc) and sharded(doc)):
            continue
        h = held(doc)
        parts = [_share(h["most"], base["most"], "DDP's state per rank at most in a step"),
                 _share(h["peak"], base["peak"], "DDP's peak")]
        sp = ivs[m]["speedup"]
        if sp is not None and sp.value:
            ci = (f"95% CI {stats.interval_text(1 / sp.high, 1 / sp.low, ref=1.0)}: "
                  f"{WORDS[verdict[m].label]}" if sp.available else WORDS["not available"])
            parts.append(f"and takes {1 / sp.value:.2f}x DDP's time per step ({ci})")
        said.append(f"{label(m)} " + " ".join(p for p in parts if p))
    if not said:
        return None
    return (lead or f"Memory per rank against DDP ({ref('memory')}): ") + "; ".join(said) + "."


def _share(mine: Optional[list], base: Optional[list], what: str) -> str:
    """"saves 32% of DDP's state per rank at most in a step (1.23 of 1.81 MiB)," or "holds
    5% more than ..."; "" where either is not known."""
    if not mine or not base or not base[-1]:
        return ""
    a, b = mine[-1] / MiB, base[-1] / MiB
    said = f"saves {100 * (1 - a / b):.0f}% of" if a <= b else f"holds {100 * (a / b - 1):.0f}% more than"
    return f"{said} {what} ({a:.2f} of {b:.2f} MiB),"


def sharded(doc: Result) -> bool:
    """Whether the method's own model says its fullest rank holds less than a replica (DDP's
    weights, gradients and optimizer state, 4 bytes a value each)."""
    model = doc.memory_model or {}
    h = held(doc)["model"]
    values, spv = model.get("values"), model.get("state_per_value")
    return bool(h and values and spv is not None and h[-1] < 0.99 * 4 * values * (2 + spv))


def weights(n: float) -> str:
    """A count of weights for people: 118K, 560M, 2.2B."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def _fits(res: RunResults) -> Optional[tuple[str, str, str]]:
    """(this machine's memory per rank, each method's largest model, this model's weights)."""
    got = {m: (res.ok[m].memory_model or {}) for m in METHOD_ORDER
           if m in res.ok and recorded(res.ok[m])}
    got = {m: d for m, d in got.items() if d.get("largest_values") and d.get("capacity_per_rank")}
    if not got:
        return None
    model = next(iter(got.values()))
    room = (f"{model['capacity_per_rank'] / 2**30:.2f} GiB of {model['capacity']} a rank, "
            f"{model['world']} ranks")
    each = ", ".join(f"{label(m)} {weights(d['largest_values'])} weights" for m, d in got.items())
    return room, each, weights(model.get("state_values") or model["values"])


def fits_line(res: RunResults) -> Optional[str]:
    """The most weights a model of this workload could have and each method fit it in this
    machine's memory per rank, projected by its memory model as the preflight reckons it
    (labkit.training.budget.largest_fit: the model scaled as a whole), in one sentence; None
    where no file records it."""
    fits = _fits(res)
    if fits is None:
        return None
    room, each, this = fits
    return (f"Largest model that fits this machine's memory per rank ({room}), projected by each "
            f"method's memory model with the preflight's allowance for buffers, the model scaled "
            f"as a whole (activations not modelled; {ref('memory')}): {each}; this model has "
            f"{this}.")


def fits_note(res: RunResults) -> Optional[str]:
    """The same projection under the memory table, where the summary's figures come from."""
    fits = _fits(res)
    if fits is None:
        return None
    room, each, this = fits
    return (f"The largest model each method's memory model fits in {room} (the preflight's "
            f"allowance for buffers; activations not modelled): {each}; this run's has {this}.")
