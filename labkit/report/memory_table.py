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
from labkit.core.methods import METHOD_ORDER, label
from labkit.core.results import Result

from .blocks import Block, Markdown, Page, Table, TableCaption
from .captions import ref
from .load import RunResults
from .tables import WIRE, intervals, listed, wire_mb, wire_text

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
    from .summary import memory_line  # (the summary reads this module's figures)

    notes = [n for n in (memory_line(res, "Each sharded method against DDP: "),
                         fits_note(res)) if n]
    return [TableCaption("memory", page.view, {"peak": peak}), Table(memory_rows(res)),
            *(Markdown(n, plain=(n, "")) for n in notes)]


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
