"""The bench document (``bench.json`` of a `labkit bench` run folder) as the analysis reads it:
one loader, the derived figures, the table and the figure. The launcher (labkit.orchestrate.bench)
writes the document with these helpers; the report and the cost model read it; neither needs the
launcher or the training loop.

    the parts of a step (exposed and hidden communication among them): labkit.core.breakdown,
    the same definitions as the experiment's report; for bench files written before the parts
    were recorded, exposed communication = median synchronised step - median compute-only step
    algbw = bytes / time;  busbw = algbw * 2(n-1)/n for all-reduce, = algbw for reduce and
    broadcast (as nccl-tests defines them)
"""
from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import Optional

from labkit.core import breakdown, stats
from labkit.core import layout
from labkit.core.files import atomic_path
from labkit.core.methods import BASELINE, MethodSpec, find, register
from labkit.core.run_folder import read_json
from labkit.core.texttable import short_number
from labkit.core.texttable import text_table as _table

from .instrument_cost import instrument_text, paired_line, paired_ratio

KIND = "labkit.bench"


def _serves(r: dict) -> bool:
    """Whether a bench row's method serves (a parameter server): from the registry, which a
    method of one's own joins from the spec its row records."""
    s = find(r["method"])
    if s is None and isinstance(r.get("method_spec"), dict):
        s = register(MethodSpec.from_dict(r["method_spec"]), r["method"])
    return bool(s and s.serves)


class BenchError(ValueError):
    """A file that is not a readable ``labkit bench`` result."""


def load(path: str | os.PathLike, need_results: bool = True) -> dict:
    """Read and check a ``bench.json`` (or the one in a run folder ``path``). Raises
    ``BenchError`` naming the problem; ``need_results=False`` accepts a bench whose every job
    failed or was skipped (the report still lists them)."""
    p = Path(path)
    if p.is_dir():
        p = p / layout.BENCH
    try:
        doc = read_json(p)
    except OSError as e:
        raise BenchError(f"cannot read {str(p)!r}: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BenchError(f"{str(p)!r} is not JSON ({e})") from None
    check(doc, repr(str(p)), need_results)
    compare_to_ddp(doc.get("results", []))  # files from before a ratio was added get it too
    return doc


def check(doc, where: str = "the document", need_results: bool = True) -> None:
    """Raise ``BenchError`` unless ``doc`` is a labkit bench document (with results)."""
    if not isinstance(doc, dict) or doc.get("kind") != KIND:
        raise BenchError(f"{where} is not a labkit bench file (no \"kind\": \"{KIND}\")")
    results = doc.get("results")
    if not isinstance(results, list) or (need_results and not results):
        raise BenchError(f"{where} has no results")
    for i, r in enumerate(results):
        for key in ("method", "nproc", "step_time", "compute_time", "grad_bytes"):
            if not isinstance(r, dict) or key not in r:
                raise BenchError(f"{where}: result {i} has no {key!r}")


def derive(r: dict) -> dict:
    """Where the step goes (exposed communication among it) and throughput from the raw
    measurements."""
    step, comp = r["step_time"]["median"], r["compute_time"]["median"]
    b = breakdown.of_bench(r)
    r["exposed_comm"] = b.parts["exposed"] if b else step - comp
    r["breakdown"] = b.parts if b else None
    r["hidden_comm"] = b.hidden if b else None
    r["overlap"] = b.overlap.value if b else None
    r["throughput"] = r["global_batch"] * r.get("units_per_sample", 1) / step  # images, tokens
    r["throughput_vs_ddp"] = None
    return r


def _rate(r: dict) -> str:
    """Throughput's unit of a job (its workload's: img/s for the files before workloads)."""
    return r.get("rate", "img/s")


def compare_to_ddp(results: list[dict]) -> None:
    """Throughput ratio to (uncompressed) DDP at the same process count, where it was run;
    also per trainer, which is fair to a parameter server (its servers do not train)."""
    ddp = {r["nproc"]: r for r in results if r["variant"] == BASELINE}
    for r in results:
        d = ddp.get(r["nproc"])
        r["throughput_vs_ddp"] = r["throughput"] / d["throughput"] if d else None
        r["per_trainer_vs_ddp"] = ((r["throughput"] / r["trainers"]) / (d["throughput"] / d["trainers"])
                                   if d else None)


def vs_ddp_interval(r: dict, results: list[dict]) -> Optional[stats.Interval]:
    """Throughput relative to DDP at the same process count with its 95% CI over the two
    jobs' trials (stats.ratio_over_trials on the step times, scaled by the global batches);
    None without a DDP job, or for DDP itself."""
    d = next((x for x in results if x["variant"] == BASELINE and x["nproc"] == r["nproc"]), None)
    if d is None or d is r:
        return None
    iv = stats.ratio_over_trials(d["step_time"]["trials"], r["step_time"]["trials"])
    k = r["global_batch"] / d["global_batch"]
    return stats.Interval(iv.value * k if iv.value is not None else None,
                          iv.low * k if iv.available else None, iv.high * k if iv.available else None,
                          iv.n, iv.basis, iv.note, iv.confidence)


def sync_raw_interval(r: dict) -> Optional[stats.Interval]:
    """The method's blocked sync time per step over the raw collective moving the same bytes,
    with its 95% CI over the sync time's trials and the collective's repetitions; None when
    the method has no timed phases (DDP)."""
    c = r.get("collectives") or {}
    raw = c.get("reduce_broadcast") if _serves(r) else c.get("all_reduce")
    if not r.get("phases") or not raw:
        return None
    if not r.get("sync_trials") or not raw.get("times"):  # a bench.json from before they were kept
        return stats.Interval(None, note="per-trial times not recorded")
    return stats.ratio_over_trials(r["sync_trials"], raw["times"])


def verdicts(doc: dict) -> list[str]:
    """Each variant against DDP at its process count: faster / slower only when the 95% CI
    of the throughput ratio excludes 1.00 (stats.speedup_verdict)."""
    out = []
    for r in doc.get("results", []):
        iv = vs_ddp_interval(r, doc["results"])
        if iv is not None:
            out.append(stats.speedup_verdict(f"{r['variant']} x{r['nproc']}", iv).sentence)
    return out


# ------------------------------------------------------------------ labkit's own overhead
OVERHEAD_NAME = "labkit DDP / plain loop"


def overhead_interval(o: dict) -> stats.Interval:
    """labkit DDP's throughput over the plain loop's from one overhead job: trial k of the
    plain loop and trial k of labkit's ran back to back in the same processes (a round), so
    each round gives one ratio, plain step / labkit step, and the figure is their geometric
    mean with the t-interval over the rounds (a paired design: whatever the machine did
    between rounds hits both loops of a round alike and leaves the ratio, where the unpaired
    "x DDP" interval of two separate jobs would count it as noise)."""
    return paired_ratio(o["plain"]["step_time"]["trials"],
                        o["labkit_ddp"]["step_time"]["trials"])


#: the overhead job's A/A control (`labkit bench --overhead-control`): the plain loop run a
#: second time in the same rounds (labkit.bench.plain_loop.CONTROL)
CONTROL, CONTROL_NAME = "plain_again", "A/A control, the plain loop against itself"


def control_interval(o: dict) -> Optional[stats.Interval]:
    """The second plain loop's throughput over the first's, paired over the rounds as the
    overhead itself: what two identical loops differ by in this job (None: no control ran). Its
    interval should hold 1.00; one that does not says the job's order or placement shows."""
    if CONTROL not in o:
        return None
    return paired_ratio(o["plain"]["step_time"]["trials"], o[CONTROL]["step_time"]["trials"])


def derive_overhead(o: dict) -> dict:
    """Adds the ratio and its interval to an overhead job's result (``ratio``, ``ratio_ci``:
    [low, high], None without an interval; ``control_ratio``, ``control_ratio_ci`` where the
    A/A control ran)."""
    for key, iv in (("ratio", overhead_interval(o)), ("control_ratio", control_interval(o))):
        if iv is not None:
            o[key] = iv.value
            o[f"{key}_ci"] = [iv.low, iv.high] if iv.available else None
            o[f"{key}_confidence"] = iv.confidence
    return o


def overhead_line(o: dict) -> str:
    """One sentence: the ratio, its interval, and labkit slower or faster only when the
    interval excludes 1.00 (stats.speedup_verdict's rule)."""
    text = paired_line(f"{OVERHEAD_NAME} x{o['nproc']}", overhead_interval(o),
                       "labkit faster than the plain loop", "labkit slower than the plain loop")
    if not o.get("params_equal", True):
        text += (f"; the two loops' parameters differ ({o.get('params_differing')} tensors), as two "
                 f"identical backward passes do on this GPU (its kernels are not deterministic)"
                 if o.get("device_repeatable") is False else
                 f"; WARNING: the two loops' parameters differ ({o.get('params_differing')} tensors)")
    control = control_interval(o)
    if control is not None:
        text += "; " + paired_line(CONTROL_NAME, control, "the second run faster",
                                   "the second run slower")
    return text


def overhead_rows(doc: dict) -> list[dict]:
    out = []
    for o in doc.get("overhead") or []:
        p, l = o["plain"], o["labkit_ddp"]
        out.append({
            "procs": o["nproc"], f"plain loop {_rate(o)}": p["throughput"],
            f"labkit DDP {_rate(o)}": l["throughput"],
            OVERHEAD_NAME: overhead_interval(o).value,
            "95% CI": overhead_interval(o).ci_text(digits=3, ref=1.0),
            "trials": f"{o['trials']} x {o['steps']} steps",
            "same parameters": "yes" if o.get("params_equal") else (
                "n/a (GPU not deterministic)" if o.get("device_repeatable") is False else "NO"),
        })
    return out


OVERHEAD_NOTE = ("labkit's own overhead: a plain PyTorch DDP loop and labkit's DDP training loop, "
                 "trials alternating in one job, both loading their data as labkit's loop does on "
                 "that device (same data, same batches, same initial weights); a step timed from the start of "
                 "one to the start of the next, warm-up left out; the ratio and its CI are over the "
                 "rounds (one trial of each loop, back to back)")


def summary_line(r: dict) -> str:
    st, ct = r["step_time"], r["compute_time"]
    link = r.get("link")  # a job on an emulated cluster: its link as set and as probed
    return (f"{r['variant']} x{r['nproc']}: step {1000 * st['median']:.1f} ms "
            f"[{1000 * st['min']:.1f}-{1000 * st['max']:.1f}], compute-only {1000 * ct['median']:.1f} ms, "
            f"exposed comm {1000 * r['exposed_comm']:.1f} ms, {r['throughput']:.1f} {_rate(r)}"
            + (f"; {link['nodes']} emulated nodes, link {link['link']}, probe "
               f"{_mbit(probe_streams([link]))} Mbit/s" if link else ""))


# ------------------------------------------------------------------ an emulated cluster's link
def probe_streams(records: list[dict]) -> list[float]:
    """Every probed stream's goodput, Mbit/s (each node's up and down) of link ``records``."""
    return [v for rec in records for g in rec.get("goodput_mbit") or []
            for v in (g.get("up"), g.get("down")) if isinstance(v, (int, float))]


def _mbit(values: list[float]) -> str:
    return f"{statistics.median(values):.1f}" if values else "not measured"


def link_lines(doc: dict) -> list[str]:
    """A bench on an emulated cluster (``doc["link"]``): the link as set and as its jobs'
    probes measured it, then per world size the alpha-beta bandwidth against both
    (``doc["link_fit"]``, labkit.costmodel.calibrate.link_fit); [] on one machine."""
    link = doc.get("link")
    if not link:
        return []
    got = probe_streams(link.get("probes") or [])
    lines = [f"emulated cluster: {link['nodes']} nodes x {','.join(map(str, link['ranks_per_node']))}"
             f" rank(s), each node's link {link['link']} each way (tbf burst {link['burst_bytes']} "
             f"bytes, queue {link['queue']}, delay: {link['delay']}); probe goodput "
             f"{_mbit(got)} Mbit/s (median of {len(got)} streams, both ways, before each job)"]
    return lines + [link_fit_line(f) for f in doc.get("link_fit") or []]


def link_fit_line(f: dict) -> str:
    """``alpha-beta bandwidth 94.1 Mbit/s: 94% of the set 100mbit, probe 93.8 Mbit/s ...``"""
    where = f"world {f['world_size']} = {f['nodes']} nodes x {f['ranks_per_node']}"
    if f["bandwidth_mbit"] is None:
        return f"alpha-beta bandwidth: no fit ({f['problem']}); {where}"
    probe = ("no probe" if f["probe_mbit"] is None else
             f"probe {f['probe_mbit']:.1f} Mbit/s (the fit is {100 * f['of_probe']:.0f}% of it)")
    return (f"alpha-beta bandwidth {f['bandwidth_mbit']:.1f} Mbit/s: {100 * f['of_set']:.0f}% of "
            f"the set {f['link']}, {probe}; {where}, alpha {1e6 * f['alpha']:.0f} us, fit rms "
            f"{f['fit_rms_pct']:.1f}% over {f['points']} sizes ({f.get('left_out') or 0} small enough for tbf's burst left out)")


# ------------------------------------------------------------------ table and plot
def rows(doc: dict) -> list[dict]:
    """One row per (variant, process count): the figures the issue asks for."""
    out = []
    for r in doc.get("results", []):
        st, c = r["step_time"], r.get("collectives") or {}
        ar, rb = c.get("all_reduce"), c.get("reduce_broadcast")
        # the method's own communication phases (time a trainer was blocked in them), next to
        # the raw collective moving the same bytes: all-reduce, or reduce + broadcast for PS
        sync = sum(r.get("phases", {}).values()) if r.get("phases") else None
        raw = rb if _serves(r) else ar
        out.append({
            "variant": r["variant"], "procs": r["nproc"], "trainers": r["trainers"],
            "step ms (median)": 1000 * st["median"],
            "step ms (min-max)": f"{1000 * st['min']:.1f}-{1000 * st['max']:.1f}",
            "compute-only ms": 1000 * r["compute_time"]["median"],
            "exposed comm ms": 1000 * r["exposed_comm"],
            "hidden comm ms": 1000 * r["hidden_comm"] if r.get("hidden_comm") is not None else None,
            "overlap %": 100 * r["overlap"] if r.get("overlap") is not None else None,
            "MB/step": r["bytes_per_step"] / 1e6,
            # what a trainer sent, counted from the method's collectives (a compressed or
            # local-SGD method's payload model above does not know its bytes)
            "sent MB/step": r["sent_per_step"] / 1e6 if r.get("sent_per_step") is not None else None,
            "all-reduce ms": 1000 * ar["time"] if ar else None,
            "busbw GB/s": ar["busbw"] / 1e9 if ar and ar.get("busbw") is not None else None,
            "reduce+bcast ms": 1000 * rb["time"] if rb else None,
            "sync ms": 1000 * sync if sync is not None else None,
            "sync / raw": sync / raw["time"] if sync is not None and raw and raw["time"] else None,
            "sync / raw 95% CI": _ci(sync_raw_interval(r)),
            _rate(r): r["throughput"],
            "x DDP": r["throughput_vs_ddp"],
            "x DDP 95% CI": _ci(vs_ddp_interval(r, doc["results"])),
            "x DDP/trainer": r.get("per_trainer_vs_ddp"),
        })
    return out


def _ci(iv: Optional[stats.Interval]) -> Optional[str]:
    return None if iv is None else iv.ci_text(digits=2, ref=1.0)


CI_NOTE = ("95% CI: t-interval over the trials (delta method on the log of the ratio of mean "
           "times, Welch degrees of freedom; sync / raw over the trials and the collective's "
           "repetitions); a variant is faster or slower than DDP only when it excludes 1.00")


def text_table(doc: dict) -> str:
    rs = rows(doc)
    if not rs:
        return "(no measurements)"
    head = (f"labkit bench: {doc['config'].get('model')} on {doc['config'].get('dataset')}, batch "
            f"{doc['config'].get('batch_size')}/trainer, {doc['backend']} on {doc['device']}; "
            f"{doc['trials']} trials x {doc['steps']} steps after {doc['warmup']} warm-up steps\n"
            + "".join(line + "\n" for line in link_lines(doc)) + CI_NOTE)
    return "\n".join([head, _table(rs, short_number, right=True), "", *verdicts(doc),
                      *_overhead_text(doc), *instrument_text(doc)]).rstrip()


def _overhead_text(doc: dict) -> list[str]:
    rs = overhead_rows(doc)
    if not rs:
        return []
    return ["", OVERHEAD_NOTE, _table(rs, short_number, right=True), "",
            *(overhead_line(o) for o in doc["overhead"])]


def plot(doc: dict, path: str | os.PathLike) -> Optional[Path]:
    """Left: each variant's median step split into compute-only and exposed communication,
    with the trials' min-max as an error bar. Right: throughput relative to DDP."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rs = doc.get("results", [])
    if not rs:
        return None
    labels = [f"{r['variant']}\nx{r['nproc']}" for r in rs]
    x = range(len(rs))
    comp = [1000 * r["compute_time"]["median"] for r in rs]
    exposed = [max(0.0, 1000 * r["exposed_comm"]) for r in rs]
    step = [1000 * r["step_time"]["median"] for r in rs]
    err = [[s - 1000 * r["step_time"]["min"] for s, r in zip(step, rs)],
           [1000 * r["step_time"]["max"] - s for s, r in zip(step, rs)]]
    fig, (a, b) = plt.subplots(1, 2, figsize=(max(9, 1.3 * len(rs) + 4), 4.5),
                               gridspec_kw={"width_ratios": [3, 2]})
    a.bar(x, comp, color="#4c72b0", label="compute only (no sync)")
    a.bar(x, exposed, bottom=comp, color="#dd8452", label="exposed communication")
    a.errorbar(x, step, yerr=err, fmt="none", ecolor="black", capsize=3, label="step: min-max of trials")
    raw = [(i, 1000 * r["collectives"]["all_reduce"]["time"]) for i, r in enumerate(rs)
           if r.get("collectives") and not _serves(r)]
    raw += [(i, 1000 * r["collectives"]["reduce_broadcast"]["time"]) for i, r in enumerate(rs)
            if r.get("collectives") and _serves(r)]
    if raw:
        a.scatter([i for i, _ in raw], [c + t for (i, t), c in zip(raw, [comp[i] for i, _ in raw])],
                  marker="_", s=400, color="crimson", zorder=3,
                  label="compute + raw collective (all-reduce, or reduce+broadcast for PS)")
    a.set_xticks(list(x), labels, fontsize=8)
    a.set_ylabel("ms per step (median)")
    a.set_title("Where a step's time goes")
    a.set_ylim(0, 1.08 * max(1000 * r["step_time"]["max"] for r in rs))
    ratio = [r["throughput_vs_ddp"] for r in rs]
    b.bar(x, [v if v is not None else 0 for v in ratio], color="#55a868")
    b.axhline(1.0, color="gray", ls="--", lw=1)
    for i, v in enumerate(ratio):
        b.text(i, (v or 0) + 0.02, "-" if v is None else f"{v:.2f}", ha="center", fontsize=8)
    b.set_xticks(list(x), labels, fontsize=8)
    b.set_ylabel("throughput / DDP's (same process count)")
    b.set_title("Throughput relative to DDP")
    fig.suptitle(f"{doc['config'].get('model')}, batch {doc['config'].get('batch_size')}/trainer, "
                 f"{doc['backend']} on {doc['device']}", fontsize=10)
    handles, names = a.get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=2, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    path = Path(path)
    with atomic_path(str(path)) as tmp:
        fig.savefig(tmp, dpi=120, format=path.suffix.lstrip(".") or "png")
    plt.close(fig)
    return path


def write_outputs(doc: dict, run: Path) -> None:
    with atomic_path(str(run / layout.BENCH_TEXT)) as tmp, open(tmp, "w") as f:
        f.write(text_table(doc) + "\n")
    plot(doc, run / layout.BENCH_PLOT)
