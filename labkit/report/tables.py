"""The report's tables as rows of dicts, and as HTML or plain text."""
from __future__ import annotations

import html
from typing import Optional

from labkit.core import breakdown, stats
from labkit.core.methods import BASELINE, GUIDE_METHODS, METHOD_ORDER, SPECS, find, label
from labkit.core.results import NAN, Efficiency, Result
from labkit.core.texttable import text_table as _text_table
from labkit.core.texttable import two_decimals

from . import workload_view as wv
from .load import RunResults
from .workload_view import WorkloadView, rule_words, target_value, view_of_docs, view_of_result

THR_CI, SPEED_CI = "Throughput 95% CI", "Speedup 95% CI"  # the comparison table's interval columns
TTA, STA = "Time to target (s)", "Steps to target"  # the comparison table's time to accuracy
SENT = "Sent to target (MB per trainer)"  # the comparison's, a workload not judged on accuracy
# the communication table's, counted by the lab
WIRE = "On the wire (MB/step per trainer, sent / received)"
STATE = "Optimizer state (MiB per rank)"


def _serves(method: str) -> bool:
    s = find(method)
    return bool(s and s.serves)


def chance_only(res: RunResults) -> Optional[str]:
    """Why no accuracy is compared, when every method trained on synthetic data: its labels
    are drawn at random (labkit.training.data.SyntheticImages), so no model can beat chance and
    time to accuracy would time noise. None otherwise."""
    cfgs = [d.config for d in res.ok.values()]
    if not cfgs or any(c.get("dataset") != "synthetic" for c in cfgs):
        return None
    classes = cfgs[0].get("num_classes")
    chance = f", {100 / classes:.2f}% with {classes} classes" if classes else ""
    return ("Accuracy: not compared. Synthetic data's labels are random, so every method's "
            f"validation accuracy is chance (1 in the number of classes{chance}) and there is "
            "no time to accuracy; synthetic data measures throughput. An image folder "
            "(--data-dir) or the embedded digits (--dataset digits) measure accuracy.")


def target(res: RunResults) -> Optional[float]:
    """The target of time to target, on the workload's first figure (the guide's: validation
    accuracy, %): the experiment's --target (or --target-accuracy), else the default rule for
    the figure's direction (labkit.report.workload_view); None on synthetic data (chance_only)."""
    if chance_only(res):
        return None
    return target_value(res.view, res.ok, res.given_target[0])


def target_text(res: RunResults) -> str:
    """The target as the comparison table's caption states it."""
    t, view = target(res), res.view
    if t is None:
        return ("a target (none here: synthetic data's labels are random, so accuracy stays at "
                "chance)" if chance_only(res) else
                f"the target (no {view.target.label} recorded)")
    flag = res.given_target[1]
    if not view.guide:
        return f"{view.target.text(t)} ({rule_words(view, flag)})"
    how = (f"set by {flag}" if flag else
           f"{100 * breakdown.TARGET_SHARE:.0f}% of the best validation accuracy any method reached")
    return f"{t:.2f}% ({how})"


def time_to_target(res: RunResults, m: str) -> tuple[object, object]:
    """The comparison table's two cells for method ``m``: seconds and steps, or "not reached"."""
    t = target(res)
    if t is None:
        return "-", "-"
    tta = wv.time_to_target(res.view, res.ok[m], t)
    if not tta.reached:
        return "not reached", "not reached"
    return tta.seconds, tta.steps if tta.steps is not None else "-"


def sent_to_target(res: RunResults, m: str) -> object:
    """The comparison table's MB a trainer of method ``m`` sent until it reached the target (its
    steps x the bytes per step on the wire, the communication table's), "not reached", or "-"
    where not counted."""
    t = target(res)
    if t is None:
        return "-"
    tta = wv.time_to_target(res.view, res.ok[m], t)
    if not tta.reached:
        return "not reached"
    mb = wv.sent_until(res.ok[m], tta.epoch)
    return mb if mb is not None else "-"


def throughput_column(view: WorkloadView) -> str:
    """The comparison table's throughput column: "Avg throughput (img/s)", "Avg throughput
    (tokens/s)"."""
    return f"Avg throughput ({view.rate})"


def method_runs(res: RunResults, m: str) -> list[Result]:
    """Method ``m``'s results: one per repeat (``res.repeats``, when the run folder has
    repeats), else its one result file."""
    reps = [d for d in res.repeats.get(m) or [] if d.epochs]
    return reps or [res.ok[m]]


def intervals(res: RunResults) -> dict[str, dict]:
    """Per method with results: its throughput and, against DDP, its speedup, each a
    ``stats.Interval`` (95% CI over steps, or over repeats)."""
    docs = res.ok
    base = method_runs(res, BASELINE) if BASELINE in docs else None
    out = {}
    for m in METHOD_ORDER:
        if m in docs:
            runs = method_runs(res, m)
            out[m] = {"throughput": stats.throughput(runs),
                      "speedup": stats.speedup(runs, base) if base and m != BASELINE else None}
    return out


def listed(res: RunResults) -> list[str]:
    """The methods a table has a row for: the guide's three always (a missing one says why),
    any other registered method only where these results hold it (a method of one's own that
    a live kernel registered for another run is no row here)."""
    return [m for m in METHOD_ORDER
            if m in GUIDE_METHODS or m in res.docs or m in res.problems]


def comparison_rows(res: RunResults) -> list[dict]:
    """Section 4.2, table 1: throughput with its 95% CI, time per epoch, best accuracy,
    speedup vs DDP with its 95% CI ("n/a" where the files hold no step times)."""
    docs, ivs, view = res.ok, intervals(res), res.view
    thr_col, best_col = throughput_column(view), view.best_column()
    rows = []
    for m in listed(res):
        if m not in docs:
            rows.append({"Method": label(m), thr_col: "-", THR_CI: "-",
                         "Avg train time/epoch (s)": "-", best_col: "-",
                         "Speedup vs DDP": "not available: " + res.problems.get(m, "no result"),
                         SPEED_CI: "-", TTA: "-", STA: "-", **({} if view.guide else {SENT: "-"})})
            continue
        thr, sp = ivs[m]["throughput"], ivs[m]["speedup"]
        if m == BASELINE:
            speed, speed_ci = "1.00x (baseline)", "-"
        elif sp is None or sp.value is None:
            speed, speed_ci = "n/a (no DDP result)", "n/a"
        else:
            speed, speed_ci = f"{sp.value:.2f}x", sp.ci_text(ref=1.0)
        overall = docs[m].overall
        rows.append({"Method": label(m),
                     thr_col: thr.value if thr.value is not None else overall.avg_train_throughput,
                     THR_CI: thr.ci_text(digits=1),
                     "Avg train time/epoch (s)": overall.avg_train_time_per_epoch,
                     best_col: best_value(view, docs[m]),
                     "Speedup vs DDP": speed, SPEED_CI: speed_ci})
        rows[-1][TTA], rows[-1][STA] = time_to_target(res, m)
        if not view.guide:
            rows[-1][SENT] = sent_to_target(res, m)
    return rows


def best_value(view: WorkloadView, doc: Result) -> object:
    """A method's best value of the first figure: the guide's best validation accuracy (NaN
    where it has none), else the best by the figure's direction (the lowest loss) as the
    report writes it ("3.025"; "-" where it has none)."""
    if view.guide:
        return doc.overall.best_val_accuracy
    f = view.target
    best = doc.best_figure(f.key, f.higher_is_better)
    return "-" if best is None else wv.number(best)


def comm_ms(res: RunResults) -> dict[str, dict[str, float]]:
    """Per-step communication times in ms (trainer blocked in sync), by each method's timed
    phases: {"comm": ...} for an all-reduce's phase, {"pull": ..., "push": ...} for a PS."""
    out = {}
    for m, d in res.ok.items():
        phases = SPECS[m].phases if m in SPECS else ()
        if phases:
            comm = d.overall.comm
            out[m] = {p: 1000 * comm.get(p, NAN) for p in phases}
    return out


def wire_mb(doc: Result) -> Optional[tuple[float, float]]:
    """MB (10^6 bytes) a trainer sent and received per step on the wire, the mean over the
    trainers of the last epoch (counted by the lab from the collectives the method issued:
    labkit.training.sync.collectives); None for a file written before they were counted."""
    ep = doc.epochs
    w = ep[-1].wire if ep else None
    if not isinstance(w, dict) or not w.get("sent_per_step"):
        return None
    ranks = [i for i, t in enumerate(w["trainer"]) if t] or list(range(len(w["trainer"])))
    return tuple(sum(w[k][i] for i in ranks) / len(ranks) / 1e6
                 for k in ("sent_per_step", "received_per_step"))


def wire_text(wire: Optional[tuple[float, float]]) -> str:
    """MB sent / received per step, as the communication and variants tables give them."""
    return "-" if wire is None else f"{wire[0]:.2f} / {wire[1]:.2f}"


def communication_rows(res: RunResults) -> list[dict]:
    """Section 4.2, table 2, ms per step: the guide's parameter pull, gradient push, all-reduce
    and total, then how much of it was exposed on the critical path and how much hidden behind
    compute, and the overlap with its 95% CI (labkit.core.breakdown); the bytes a trainer
    put on the wire per step and the optimizer state each rank held. Result files written
    before communication was timed per collective: the blocked times only."""
    c, rows = comm_ms(res), []
    for m in listed(res):
        row = {"Method": label(m), "Param pull (ms)": "-", "Grad push (ms)": "-",
               "All-Reduce (ms)": "-", "Total comm time (ms)": "not available",
               "Exposed (ms)": "-", "Hidden (ms)": "-", "Overlap (95% CI)": "-", WIRE: "-",
               STATE: "-"}
        rows.append(row)
        if m not in res.ok:
            continue
        b = breakdown.of_result(res.ok[m])
        total = b.comm * 1000 if b is not None and b.comm is not None else None
        row[WIRE] = wire_text(wire_mb(res.ok[m]))
        eff = res.ok[m].efficiency
        state = eff.optimizer_state_bytes if eff else None
        if state:
            row[STATE] = ", ".join(f"{b / 2**20:.2f}" for b in state)
        if {"pull", "push"} <= set(c.get(m, ())):
            row.update({"Param pull (ms)": c[m]["pull"], "Grad push (ms)": c[m]["push"],
                        "Total comm time (ms)": c[m]["pull"] + c[m]["push"]})
        elif m in c or total is not None:
            row["All-Reduce (ms)"] = total if total is not None else sum(c[m].values())
            row["Total comm time (ms)"] = row["All-Reduce (ms)"]
        elif m == BASELINE:  # a result file from before DDP's all-reduce was timed
            row["Total comm time (ms)"] = "(inside PyTorch)"
        if total is not None:
            ov = b.overlap
            row.update({"Total comm time (ms)": total, "Exposed (ms)": 1000 * b.parts["exposed"],
                        "Hidden (ms)": 1000 * b.hidden,
                        "Overlap (95% CI)": "n/a" if ov.value is None else
                        f"{100 * ov.value:.0f}% ({ov.ci_text(digits=2)})"})
    return rows


def efficiency_rows(res: RunResults) -> list[dict]:
    """GPU use (caption key efficiency), per method: model FLOPs per image or token (forward
    and backward), MFU against the GPU's peak for the precision used, peak GPU memory per rank,
    and the data wait as a share of the step (labkit.core.efficiency; "-" where a file has none,
    e.g. a CPU run's MFU)."""
    rows, per = [], res.view.per_unit
    for m in METHOD_ORDER:
        if m not in res.ok:
            continue
        d = res.ok[m]
        e = d.efficiency or Efficiency()
        waits = [w for w in (x.waited_share for x in d.epochs) if w is not None]
        mem = e.peak_memory_bytes
        rows.append({
            "Method": label(m),
            f"GFLOP/{per} (fwd+bwd)": e.flops_per_image / 1e9 if e.flops_per_image else "-",
            "Precision": e.precision or "-",
            "MFU (%)": 100 * e.mfu if e.mfu is not None else "-",
            "Peak GPU memory per rank (GiB)": ", ".join(f"{b / 2**30:.2f}" for b in mem) if mem else "-",
            "Data wait (% of step)": 100 * sum(waits) / len(waits) if waits else "-",
            "GPU": e.device_name or d.world.get("device", "-"),
        })
    return rows


def text_table(rows: list[dict]) -> str:
    return _text_table(rows, lambda v: two_decimals("" if v is None else v), empty="(no results)")


def html_table(rows: list[dict], columns: Optional[list[str]] = None) -> str:
    columns = columns or (list(rows[0]) if rows else [])
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(two_decimals(r.get(c, '')))}</td>" for c in columns)
                   + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


#: the per-epoch table's columns: (heading, the epoch's figure; None: the column is left out)
EPOCH_COLUMNS = (
    ("epoch", lambda e: e.epoch), ("train_loss", lambda e: e.train_loss),
    ("train_accuracy", lambda e: e.train_accuracy), ("val_loss", lambda e: e.val_loss),
    ("val_accuracy", lambda e: e.val_accuracy), ("train_time", lambda e: e.train_time),
    ("train_throughput", lambda e: e.train_throughput),
    ("avg_batch_time", lambda e: e.avg_batch_time),
    ("avg_comm_time", lambda e: e.comm.get("comm")),
    ("avg_comm_time_pull", lambda e: e.comm.get("pull")),
    ("avg_comm_time_push", lambda e: e.comm.get("push")),
)


#: columns left out where no epoch has them (a workload without accuracy writes them null)
ACCURACY_COLUMNS = ("train_accuracy", "val_accuracy")


def epoch_rows(doc: Result) -> list[dict]:
    """One row per epoch: the guide's figures (an accuracy no epoch has left out), the
    workload's other validation figures (perplexity), the times, the data wait."""
    absent = {k for k in ACCURACY_COLUMNS if all(e.figure(k) is None for e in doc.epochs)}
    extra = view_of_result(doc).extra_figures()
    rows = []
    for e in doc.epochs:
        r = {k: v for k, v in ((k, of(e)) for k, of in EPOCH_COLUMNS) if v is not None and k not in absent}
        r.update({f.key: e.figure(f.key) for f in extra if e.figure(f.key) is not None})
        if e.avg_data_time is not None and e.avg_batch_time:
            # time a trainer waited for its next batch, as a share of the step (target: <= 5%)
            r["data_wait_pct"] = 100 * e.avg_data_time / e.avg_batch_time
        rows.append(r)
    return rows


def environment_rows(env: dict) -> list[dict]:
    gpus = ", ".join(f"{g['name']} ({g['memory_gib']} GiB)" for g in env.get("gpus", [])) or "none"
    git = env.get("git", {})
    items = [("host", env.get("host")), ("CPU", f"{env.get('cpu')} ({env.get('cpu_count')} cores)"),
             ("GPUs", gpus), ("driver", env.get("driver") or "-"), ("platform", env.get("platform")),
             ("Python", env.get("python")), ("torch", env.get("torch")),
             ("torchvision", env.get("torchvision")), ("CUDA", env.get("cuda") or "-"),
             ("cuDNN", env.get("cudnn") or "-"), ("NCCL", env.get("nccl") or "-"),
             ("git commit", f"{git.get('commit')}{' (uncommitted changes)' if git.get('dirty') else ''}"),
             ("seed", env.get("seed")), ("recorded", env.get("time"))]
    items += _record_items(env)
    return [{"": k, "value": v} for k, v in items]


def _record_items(env: dict) -> list[tuple[str, str]]:
    """The environment record's rows (labkit.runs.record), each one readable line; absent parts of
    older run folders are left out."""
    items = []
    git, pk = env.get("git") or {}, env.get("packages") or {}
    if git.get("diff_file"):
        items.append(("uncommitted diff", f"{git['diff_file']} (sha256 {str(git.get('diff_sha256'))[:12]}); "
                                          f"git apply it on the commit above"))
    if git.get("untracked"):
        shown = ", ".join(git["untracked"][:5])
        items.append(("untracked files", f"{len(git['untracked'])}: {shown}"
                                         + (", ..." if len(git["untracked"]) > 5 else "")))
    if pk:
        items.append(("Python packages", f"{pk.get('count')} installed, every version in "
                                         f"{pk.get('file')} (pip install -r accepts it)"))
    if env.get("debian"):
        items.append(("Debian packages", ", ".join(f"{n} {v or '(not installed)'}"
                                                   for n, v in env["debian"].items())))
    d = env.get("determinism") or {}
    if d:
        items.append(("determinism", f"seed {d.get('seed')}, backend {d.get('backend')} on "
                                     f"{d.get('device')}, {d.get('torch_num_threads')} torch threads "
                                     f"(OMP_NUM_THREADS={d.get('omp_num_threads_env')}), deterministic "
                                     f"algorithms {'on' if d.get('deterministic_algorithms') else 'off'}, "
                                     f"cuDNN benchmark {'on' if d.get('cudnn_benchmark') else 'off'}"))
    by_fp: dict[str, list[str]] = {}
    for m, fp in (env.get("data") or {}).items():
        extra = {k: v for k, v in fp.items() if k not in ("dataset", "sha256", "layout_sha256")}
        text = (f"{fp.get('dataset')} sha256 {str(fp.get('sha256'))[:16]}"
                + (" (" + ", ".join(f"{k} {v}" for k, v in extra.items()) + ")" if extra else ""))
        by_fp.setdefault(text, []).append(m)
    for text, ms in by_fp.items():
        items.append((f"data ({', '.join(ms)})", text))
    return items


def reproduction_rows(doc: dict) -> list[dict]:
    """labkit reproduce's verdict per method, and the speed of the rerun (not a verdict)."""
    rows = []
    for m, v in doc["methods"].items():
        why = "; ".join(v.get("reasons") or []) or "-"
        t = v.get("timing") or {}
        speed = "-"
        if t.get("speed_ratio") is not None:
            ci = t.get("ci95")
            speed = f"{t['speed_ratio']:.2f}x" + (f" ({ci[0]:.2f}-{ci[1]:.2f})" if ci else " (no CI)")
        mad = v.get("max_abs_diff")
        rows.append({"Method": label(m), "Verdict": v["verdict"],
                     "Max abs difference": "-" if mad is None else f"{mad:.3g}",
                     "Where it differs": why, "Speed vs recorded (95% CI)": speed})
    return rows


def config_rows(res: RunResults) -> list[dict]:
    keys = ("world_size", "batch_size", "epochs", "dataset", "model", "backend", "lr", "momentum",
            "weight_decay", "grad_accum", "grad_clip", "amp", "channels_last", "bucket_mb", "no_overlap", "ps_mode",
            "max_steps_per_epoch", "workers", "pin_cpus")
    rows = []
    for k in keys:
        row = {"setting": k}
        for m, d in res.ok.items():
            # a file without a config (the guide's): its world and batch size, its epochs
            got = {"world_size": d.world_size, "batch_size": d.batch_size, "epochs": len(d.epochs)}
            v = d.config[k] if k in d.config else got.get(k, "-")
            row[label(m)] = "-" if v is None else v
        rows.append(row)
    return rows


def variant_rows(base: dict[str, Result], variants: dict[str, Result]) -> list[dict]:
    """The variants table: each variant beside its synchronous method, in the workload's words."""
    view = view_of_docs([*base.values(), *variants.values()])
    f = view.target
    best = ("best val acc %" if view.guide else
            f"best {f.label.replace('validation ', 'val ')}" + (f" ({f.unit})" if f.unit else ""))
    rows = []
    for name, d in [*base.items(), *variants.items()]:
        c, ep, overall = d.config, d.epochs, d.overall
        stale = [e.extra["max_staleness_observed"] for e in ep if "max_staleness_observed" in e.extra]
        rows.append({
            "run": name, "servers": c.get("ps_servers") if _serves(c.get("method", BASELINE)) else None,
            "staleness bound": c.get("ps_staleness"), "compress": c.get("compress", "none"),
            view.rate: overall.avg_train_throughput,
            "final train loss": ep[-1].train_loss if ep else None,
            best: best_value(view, d),
            "max staleness seen": max(stale) if stale else None,
            WIRE: wire_text(wire_mb(d)),
            "status": d.status,
        })
    return rows
