"""The analysis: the guide's analyze_results.py, for a run folder or any result files.

    labkit report runs/latest                      # a run folder
    labkit report results_*.json --out analysis/   # files from the original scripts work too

Prints the comparison and communication tables, writes the guide's five plots under plots/
and performance_report.txt. A missing, failed or corrupt result file is named and the rest
still renders. Result files are only read, never modified.
"""
from __future__ import annotations

import html
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from statistics import mean
from typing import Any, Optional

from . import lifecycle
from .config import METHOD_NAMES, RESULT_FILES

METHOD_ORDER = ("ddp", "allreduce", "ps")
SHORT = {"ddp": "Baseline DDP", "allreduce": "Manual All-Reduce", "ps": "Parameter Server"}
COLORS = {"ddp": "#4C72B0", "allreduce": "#55A868", "ps": "#C44E52"}
PLOTS = ("throughput_comparison", "training_time_comparison", "loss_curves", "accuracy_curves",
         "communication_overhead")
NAN = float("nan")


class ResultError(ValueError):
    """A result file that is missing, unreadable or of another schema."""


# ------------------------------------------------------------------ loading
def method_key(doc: dict, path: str | os.PathLike = "") -> Optional[str]:
    """ddp | allreduce | ps, from the lab's own key, the guide's method name or the file name."""
    if doc.get("method_key") in METHOD_ORDER:
        return doc["method_key"]
    by_name = {v: k for k, v in METHOD_NAMES.items()}
    if doc.get("method") in by_name:
        return by_name[doc["method"]]
    by_file = {v: k for k, v in RESULT_FILES.items()}
    return by_file.get(os.path.basename(str(path)))


def load_result(path: str | os.PathLike) -> dict:
    """Read one result file: the lab's, or one with only the guide's keys."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise ResultError(f"{path}: missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ResultError(f"{path}: not valid JSON ({e.__class__.__name__}): truncated or corrupt") from None
    if not isinstance(doc, dict) or "method" not in doc or not isinstance(doc.get("epochs"), list):
        raise ResultError(f"{path}: not a result file (needs 'method' and a list of 'epochs')")
    needed = ("epoch", "train_loss", "train_accuracy", "train_time", "train_throughput")
    for e in doc["epochs"]:
        if not isinstance(e, dict) or any(k not in e for k in needed):
            raise ResultError(f"{path}: an epoch lacks the guide's keys ({', '.join(needed)})")
    if method_key(doc, path) is None:
        raise ResultError(f"{path}: unknown method {doc.get('method')!r}")
    return lifecycle.settle(doc)  # "running" with its writer gone: stopped without finishing


@dataclass
class Results:
    """What a report is made of: the loaded results and the problems met on the way."""
    docs: dict[str, dict] = field(default_factory=dict)          # method key -> result
    problems: dict[str, str] = field(default_factory=dict)       # method key or file -> problem
    run_dir: Optional[Path] = None

    @property
    def ok(self) -> dict[str, dict]:
        """Results with at least one finished epoch (a failed run keeps its finished epochs)."""
        return {m: d for m, d in self.docs.items() if d["epochs"]}


def load_run(run_dir: str | os.PathLike) -> Results:
    """A run folder (method subfolders) or a folder holding results_*.json directly."""
    run = Path(run_dir)
    res = Results(run_dir=run)
    status = {}
    if (run / "experiment.json").exists():
        try:
            status = json.loads((run / "experiment.json").read_text()).get("methods", {})
        except (OSError, json.JSONDecodeError):
            res.problems["experiment.json"] = f"{run / 'experiment.json'}: unreadable"
    for m in METHOD_ORDER:
        candidates = [run / m / RESULT_FILES[m], run / RESULT_FILES[m]]
        path = next((p for p in candidates if p.exists()), None)
        if path is None:
            if (run / m).is_dir() or m in status:
                res.problems[m] = f"{candidates[0]}: missing"
        else:
            _add(res, path, m)
        st = status.get(m, {})
        if st.get("status") not in (None, "completed"):
            res.problems[m] = f"{st['status']}: {st.get('error', '').strip()}".strip(": ")
    return res


def load_files(paths: list[str | os.PathLike]) -> Results:
    res = Results()
    for p in paths:
        if Path(p).is_dir():
            sub = load_run(p)
            res.docs.update(sub.docs)
            res.problems.update(sub.problems)
            res.run_dir = res.run_dir or sub.run_dir
        else:
            _add(res, Path(p), None)
    return res


def _add(res: Results, path: Path, expected: Optional[str]) -> None:
    try:
        doc = load_result(path)
    except ResultError as e:
        res.problems[expected or path.name] = str(e)
        return
    m = method_key(doc, path)
    res.docs[m] = doc
    if doc.get("status", "completed") != "completed":
        res.problems[m] = f"{path}: status {doc['status']}" + (f" ({doc['error']})" if doc.get("error") else "")


# ------------------------------------------------------------------ numbers
def _epochs(doc: dict) -> list[dict]:
    return doc["epochs"]


def summary_value(doc: dict, key: str) -> float:
    """A summary figure; recomputed from the epochs when the file lacks it."""
    s = doc.get("summary") or {}
    if key in s:
        return s[key]
    ep = _epochs(doc)
    if not ep:
        return NAN
    if key == "avg_train_throughput":
        return mean(e["train_throughput"] for e in ep)
    if key == "avg_train_time_per_epoch":
        return mean(e["train_time"] for e in ep)
    if key == "best_val_accuracy":
        vals = [e["val_accuracy"] for e in ep if "val_accuracy" in e]
        return max(vals) if vals else NAN
    if key.startswith("avg_comm_time"):
        vals = [e[key] for e in ep if key in e]
        return mean(vals) if vals else NAN
    return NAN


def comparison_rows(res: Results) -> list[dict]:
    """Section 4.2, table 1: throughput, time per epoch, best accuracy, speedup vs DDP."""
    docs = res.ok
    base = summary_value(docs["ddp"], "avg_train_throughput") if "ddp" in docs else None
    rows = []
    for m in METHOD_ORDER:
        if m not in docs:
            rows.append({"Method": SHORT[m], "Avg throughput (img/s)": "-",
                         "Avg train time/epoch (s)": "-", "Best accuracy (%)": "-",
                         "Speedup vs DDP": "not available: " + res.problems.get(m, "no result")})
            continue
        thr = summary_value(docs[m], "avg_train_throughput")
        if m == "ddp":
            speed = "1.00x (baseline)"
        else:
            speed = f"{thr / base:.2f}x" if base else "n/a (no DDP result)"
        rows.append({"Method": SHORT[m], "Avg throughput (img/s)": thr,
                     "Avg train time/epoch (s)": summary_value(docs[m], "avg_train_time_per_epoch"),
                     "Best accuracy (%)": summary_value(docs[m], "best_val_accuracy"),
                     "Speedup vs DDP": speed})
    return rows


def comm_ms(res: Results) -> dict[str, dict[str, float]]:
    """Per-step communication times in ms (trainer blocked in sync)."""
    out = {}
    docs = res.ok
    if "allreduce" in docs:
        out["allreduce"] = {"allreduce": 1000 * summary_value(docs["allreduce"], "avg_comm_time")}
    if "ps" in docs:
        pull = 1000 * summary_value(docs["ps"], "avg_comm_time_pull")
        push = 1000 * summary_value(docs["ps"], "avg_comm_time_push")
        out["ps"] = {"pull": pull, "push": push}
    return out


def communication_rows(res: Results) -> list[dict]:
    """Section 4.2, table 2: parameter pull, gradient push, all-reduce, total (ms per step)."""
    c = comm_ms(res)
    rows = [{"Method": SHORT["ddp"], "Param pull (ms)": "-", "Grad push (ms)": "-",
             "All-Reduce (ms)": "-", "Total comm time (ms)": "(inside PyTorch)"}]
    if "allreduce" in c:
        a = c["allreduce"]["allreduce"]
        rows.append({"Method": SHORT["allreduce"], "Param pull (ms)": "-", "Grad push (ms)": "-",
                     "All-Reduce (ms)": a, "Total comm time (ms)": a})
    else:
        rows.append({"Method": SHORT["allreduce"], "Param pull (ms)": "-", "Grad push (ms)": "-",
                     "All-Reduce (ms)": "-", "Total comm time (ms)": "not available"})
    if "ps" in c:
        p = c["ps"]
        rows.append({"Method": SHORT["ps"], "Param pull (ms)": p["pull"], "Grad push (ms)": p["push"],
                     "All-Reduce (ms)": "-", "Total comm time (ms)": p["pull"] + p["push"]})
    else:
        rows.append({"Method": SHORT["ps"], "Param pull (ms)": "-", "Grad push (ms)": "-",
                     "All-Reduce (ms)": "-", "Total comm time (ms)": "not available"})
    return rows


def discussion(res: Results) -> list[str]:
    """Short findings computed from the measured numbers (no claims the numbers don't make)."""
    docs = res.ok
    lines = []
    thr = {m: summary_value(d, "avg_train_throughput") for m, d in docs.items()}
    if len(thr) >= 2:
        order = sorted(thr, key=thr.get, reverse=True)
        fast, slow = order[0], order[-1]
        ratio = thr[fast] / thr[slow]
        lines.append(f"{SHORT[fast]} was fastest at {thr[fast]:.1f} img/s, "
                     f"{ratio:.2f}x the slowest ({SHORT[slow]}, {thr[slow]:.1f} img/s)."
                     + (" A gap under 5% is within the epoch-to-epoch spread of such runs; the "
                        "whiskers in the throughput chart show it." if ratio < 1.05 else ""))
    for m, d in docs.items():
        ep = _epochs(d)
        step = mean(e["avg_batch_time"] for e in ep if "avg_batch_time" in e) if ep else NAN
        if m == "allreduce" and step == step:
            a = summary_value(d, "avg_comm_time")
            lines.append(f"Manual All-Reduce: a trainer waited {1000 * a:.1f} ms per step for gradient "
                         f"all-reduce after backward, {100 * a / step:.0f}% of its {1000 * step:.0f} ms step.")
        if m == "ps" and step == step:
            pull, push = summary_value(d, "avg_comm_time_pull"), summary_value(d, "avg_comm_time_push")
            lines.append(f"Parameter Server: a worker spent {1000 * pull:.1f} ms per step pulling parameters and "
                         f"{1000 * push:.1f} ms pushing gradients, {100 * (pull + push) / step:.0f}% of its "
                         f"{1000 * step:.0f} ms step; with {d.get('num_workers', '?')} workers on one server.")
        data = [e["avg_data_time"] for e in ep if "avg_data_time" in e]
        if data and step == step and mean(data) / step > 0.05:
            lines.append(f"{SHORT[m]}: waiting for data took {100 * mean(data) / step:.0f}% of the step time "
                         f"(raise --workers).")
    acc = {m: summary_value(d, "best_val_accuracy") for m, d in docs.items()}
    acc = {m: a for m, a in acc.items() if a == a}
    if len(acc) >= 2:
        lo, hi = min(acc.values()), max(acc.values())
        lines.append(f"Best validation accuracy ranged from {lo:.2f}% to {hi:.2f}%: the methods apply the same "
                     f"averaged SGD step, so differences come from float summation order and, for PS, "
                     f"a different number of trainers.")
    if any(d.get("world", {}).get("device") == "cpu" for d in docs.values()):
        lines.append("These are CPU (gloo) figures: processes share the CPU cores, so communication and "
                     "computation compete; GPU/NCCL runs separate them.")
    for k, p in res.problems.items():
        lines.append(f"Problem: {p}")
    return lines


# ------------------------------------------------------------------ tables as text and HTML
def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return "nan" if v != v else f"{v:,.2f}"
    return str(v)


def text_table(rows: list[dict]) -> str:
    if not rows:
        return "(no results)"
    cols = list(rows[0])
    cells = [[_fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    line = "  ".join(c.ljust(w) for c, w in zip(cols, widths))
    sep = "  ".join("-" * w for w in widths)
    body = "\n".join("  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells)
    return f"{line}\n{sep}\n{body}"


def html_table(rows: list[dict], columns: Optional[list[str]] = None) -> str:
    columns = columns or (list(rows[0]) if rows else [])
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(r.get(c, '')))}</td>" for c in columns)
                   + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def epoch_rows(doc: dict) -> list[dict]:
    keys = ("epoch", "train_loss", "train_accuracy", "val_loss", "val_accuracy", "train_time",
            "train_throughput", "avg_batch_time", "avg_comm_time", "avg_comm_time_pull",
            "avg_comm_time_push")
    rows = []
    for e in doc["epochs"]:
        r = {k: e[k] for k in keys if k in e}
        if e.get("avg_data_time") is not None and e.get("avg_batch_time"):
            # time a trainer waited for its next batch, as a share of the step (target: <= 5%)
            r["data_wait_pct"] = 100 * e["avg_data_time"] / e["avg_batch_time"]
        rows.append(r)
    return rows


# ------------------------------------------------------------------ the five plots
def _bar(ax, res: Results, key: str, ylabel: str, title: str):
    docs = res.ok
    ms = [m for m in METHOD_ORDER if m in docs]
    vals = [summary_value(docs[m], key) for m in ms]
    per_epoch = {"avg_train_throughput": "train_throughput", "avg_train_time_per_epoch": "train_time"}[key]
    # a file's own summary may lie outside its epochs' range (the guide's example does)
    lo = [max(0.0, v - min(e[per_epoch] for e in _epochs(docs[m]))) for m, v in zip(ms, vals)]
    hi = [max(0.0, max(e[per_epoch] for e in _epochs(docs[m])) - v) for m, v in zip(ms, vals)]
    bars = ax.bar([SHORT[m] for m in ms], vals, color=[COLORS[m] for m in ms], yerr=[lo, hi],
                  capsize=6, ecolor="#333")
    ax.bar_label(bars, labels=[f"{v:,.1f}" for v in vals], padding=3)
    ax.set_ylabel(ylabel)
    ax.set_title(title + "\n(bars: mean over epochs; whiskers: min-max)", fontsize=10)
    ax.margins(y=0.2)
    _note_missing(ax, res)


def _note_missing(ax, res: Results) -> None:
    missing = [SHORT.get(m, m) for m in METHOD_ORDER if m not in res.ok and m in res.problems]
    if missing:
        ax.text(0.99, 0.98, "no result: " + ", ".join(missing), transform=ax.transAxes,
                ha="right", va="top", fontsize=8, color="#a00")


def plot_throughput(res: Results, ax):
    _bar(ax, res, "avg_train_throughput", "images / second (all trainers, steady state)",
         "Training throughput")


def plot_training_time(res: Results, ax):
    _bar(ax, res, "avg_train_time_per_epoch", "seconds per epoch", "Training time per epoch")


def plot_losses(docs: dict[str, dict], ax=None):
    """Per-step training loss of each method, on one axis."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.5))
    for m, d in docs.items():
        losses = d.get("all_losses") or []
        k = method_key(d) or m
        ax.plot(range(1, len(losses) + 1), losses, label=d.get("method", m), lw=1.2,
                color=COLORS.get(k))
    ax.set_xlabel("training step")
    ax.set_ylabel("training loss (cross-entropy)")
    ax.set_title("Loss convergence")
    ax.grid(alpha=0.3)
    if docs:
        ax.legend()
    return ax.figure


def plot_accuracy(res: Results, ax):
    for m, d in res.ok.items():
        ep = _epochs(d)
        x = [e["epoch"] for e in ep]
        ax.plot(x, [e["train_accuracy"] for e in ep], "--o", color=COLORS[m], ms=4,
                label=f"{SHORT[m]} (train)")
        if all("val_accuracy" in e for e in ep):
            ax.plot(x, [e["val_accuracy"] for e in ep], "-s", color=COLORS[m], ms=4,
                    label=f"{SHORT[m]} (val)")
    from matplotlib.ticker import MaxNLocator
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("epoch")
    ax.set_ylabel("accuracy (%)")
    ax.set_title("Accuracy per epoch")
    ax.grid(alpha=0.3)
    if res.ok:  # no curves (every file failed or corrupt): no legend, _note_missing says why
        ax.legend(fontsize=8)
    _note_missing(ax, res)


def plot_communication(res: Results, ax):
    """PS vs All-Reduce: each step split into time blocked in communication and the rest."""
    docs, c = res.ok, comm_ms(res)
    labels, comm_parts, rest = [], [], []
    for m in ("allreduce", "ps"):
        if m not in docs:
            continue
        step = 1000 * mean(e["avg_batch_time"] for e in _epochs(docs[m]) if "avg_batch_time" in e)
        parts = c[m]
        labels.append(SHORT[m])
        comm_parts.append(parts)
        rest.append(max(0.0, step - sum(parts.values())))
    colors = {"allreduce": "#55A868", "pull": "#DD8452", "push": "#C44E52"}
    names = {"allreduce": "all-reduce", "pull": "parameter pull", "push": "gradient push"}
    bottom = [0.0] * len(labels)
    for part in ("allreduce", "pull", "push"):
        vals = [p.get(part, 0.0) for p in comm_parts]
        if any(vals):
            ax.bar(labels, vals, bottom=bottom, color=colors[part], label=names[part])
            bottom = [b + v for b, v in zip(bottom, vals)]
    ax.bar(labels, rest, bottom=bottom, color="#CCCCCC", label="compute and the rest")
    for i, p in enumerate(comm_parts):
        tot = sum(p.values())
        ax.text(i, bottom[i], f"{tot:.0f} ms communication", ha="center", va="bottom", fontsize=9,
                bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 1})
    ax.set_ylabel("ms per training step (trainer view)")
    ax.set_title("Communication overhead: PS vs All-Reduce")
    if labels:
        ax.legend(fontsize=8)
    _note_missing(ax, res)


def write_plots(res: Results, out_dir: str | os.PathLike) -> list[Path]:
    """The guide's five PNGs under <out_dir>/plots/."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .metrics import atomic_path

    plots = Path(out_dir) / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    makers = {"throughput_comparison": plot_throughput, "training_time_comparison": plot_training_time,
              "loss_curves": lambda r, ax: plot_losses(r.ok, ax), "accuracy_curves": plot_accuracy,
              "communication_overhead": plot_communication}
    paths = []
    for name in PLOTS:
        fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
        makers[name](res, ax)
        fig.tight_layout()
        path = plots / f"{name}.png"
        with atomic_path(str(path)) as tmp:
            fig.savefig(tmp, format="png")
        plt.close(fig)
        paths.append(path)
    return paths


# ------------------------------------------------------------------ text report and the command
def text_report(res: Results, env: Optional[dict] = None) -> str:
    parts = ["labkit performance report", "=" * 25, ""]
    if res.run_dir:
        parts.append(f"run: {res.run_dir}")
    if env:
        gpus = ", ".join(g["name"] for g in env.get("gpus", [])) or "none"
        parts.append(f"machine: {env.get('host')} | CPU: {env.get('cpu')} ({env.get('cpu_count')} cores) | "
                     f"GPUs: {gpus}")
        parts.append(f"versions: python {env.get('python')}, torch {env.get('torch')}, "
                     f"CUDA {env.get('cuda')}, NCCL {env.get('nccl')} | git {str(env.get('git', {}).get('commit'))[:10]}"
                     f"{' (dirty)' if env.get('git', {}).get('dirty') else ''}")
    for m, d in res.ok.items():
        cfg = d.get("config", {})
        parts.append(f"{SHORT[m]}: world size {d.get('world_size')}, batch {d.get('batch_size')}/trainer"
                     + (f", {cfg.get('model')} on {cfg.get('dataset')}, backend {cfg.get('backend')}" if cfg else "")
                     + f", {len(d['epochs'])} epoch(s), {d.get('start_time')} -> {d.get('end_time')}")
    parts += ["", "Performance comparison (steady-state throughput; warm-up steps left out)", "",
              text_table(comparison_rows(res)), "",
              "Communication time per training step (time a trainer is blocked in synchronisation)", "",
              text_table(communication_rows(res)), ""]
    for m, d in res.ok.items():
        parts += [f"{d['method']}: per epoch", "", text_table(epoch_rows(d)), ""]
    parts += ["Discussion", ""] + [f"- {l}" for l in discussion(res)] + [""]
    from . import bench

    doc = bench.load(res.run_dir) if res.run_dir else None
    if doc and doc.get("results"):
        parts += ["Benchmark (labkit bench)", "", bench.text_table(doc), ""]
    return "\n".join(parts)


def write_report(res: Results, out_dir: str | os.PathLike, env: Optional[dict] = None) -> dict[str, Any]:
    """plots/*.png and performance_report.txt in ``out_dir``; returns their paths."""
    from .metrics import atomic_path

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pngs = write_plots(res, out) if res.docs or res.problems else []  # none for a bench folder
    txt = out / "performance_report.txt"
    with atomic_path(str(txt)) as tmp, open(tmp, "w") as f:
        f.write(text_report(res, env))
    return {"plots": pngs, "text": txt}


def load_env(run_dir: Optional[Path]) -> Optional[dict]:
    if run_dir and (run_dir / "environment.json").exists():
        try:
            return json.loads((run_dir / "environment.json").read_text())
        except (OSError, json.JSONDecodeError):
            return None
    return None


# ------------------------------------------------------------------ the implementation section
def _source(obj) -> str:
    import inspect
    import textwrap

    return textwrap.dedent(inspect.getsource(obj)).rstrip()


def implementation_markdown() -> str:
    """Section 3.2: roles and communication flow of each method, with the key code taken from
    labkit's own source at report time, so the write-up never goes stale."""
    from .sync.allreduce import AllReduceStrategy
    from .sync.base import Strategy
    from .sync.ddp import DDPStrategy
    from .sync.ps import PSStrategy

    def code(obj) -> str:
        return f"```python\n{_source(obj)}\n```"

    return "\n\n".join([
        "### One training loop, three strategies",
        "All methods share one loop (`labkit/train.py`). Per step every rank calls "
        "`zero_grad -> before_forward -> [trainers: forward, backward] -> after_backward -> step`; "
        "a method is a small strategy object that fills in these hooks. Trainer *k* of *T* reads "
        "shard *k* of *T* of the data, gradients are averaged over the trainers, and the same SGD "
        "step is applied, so from one seed all methods reach the same parameters (checked by the "
        "tests against a single-process reference).",
        "### Parameter Server: roles",
        "Rank 0 is the server: it holds the parameters and the optimizer and never runs forward or "
        "backward. Ranks 1..N-1 are workers (trainers). The first worker (rank 1) shows the training "
        "bar and owns the BatchNorm statistics; the server shows batch progress and its "
        "communication times.",
        code(PSStrategy.trainer_index.fget) + "\n\n" + code(PSStrategy.steps_optimizer.fget),
        "### Parameter Server: communication flow",
        "Each step: (1) **pull**: the server sends the current parameters to every worker; (2) workers "
        "run forward and backward; (3) **push**: workers send their gradients to the server; (4) the "
        "server sums and averages them; (5) the server applies the SGD step. `--ps-mode p2p` is the "
        "original guide's protocol: one `send`/`recv` per parameter tensor and per worker, the server "
        "looping over the workers for every tensor. `--ps-mode collective` (default) is the improvement "
        "the guide proposes: parameters and gradients live in one flat buffer each (laid out in the "
        "order backward produces the gradients), cut into buckets. A gradient hook starts each "
        "bucket's `reduce` to rank 0 as soon as backward has produced it, so the push overlaps "
        "backward; right after its SGD step the server `broadcast`s every bucket, and a worker waits "
        "for a layer's parameters only when its forward reaches that layer, so the pull overlaps "
        "loading the next batch and the forward of the layers before. The pull and push times in "
        "the tables are the time a worker was blocked waiting.",
        "**Parameter pull: started after the server's step, awaited per layer**",
        code(PSStrategy._start_pull) + "\n\n" + code(PSStrategy._await_layer),
        "**Gradient push and aggregation**",
        code(PSStrategy._grad_ready) + "\n\n" + code(PSStrategy._push)
        + "\n\n" + code(PSStrategy.after_backward),
        "### Manual All-Reduce",
        "Gradients are views into flat buckets (about `--bucket-mb` MiB each, in the order backward "
        "produces them). A hook fires when a parameter's gradient is accumulated; when a bucket is "
        "complete its all-reduce starts asynchronously, so communication overlaps the rest of "
        "backward. Buckets start strictly in order on every rank, so the collectives always match. "
        "After backward the trainer only waits for what is still in flight: that wait is the "
        "`avg_comm_time` in the tables. `--no-overlap` starts every bucket after backward instead.",
        code(AllReduceStrategy._grad_ready) + "\n\n" + code(AllReduceStrategy._start)
        + "\n\n" + code(AllReduceStrategy.after_backward),
        "### Baseline DDP, and how the three compare",
        "DDP does the same bucketing and overlap inside PyTorch's C++ reducer (25 MiB buckets, "
        "gradient hooks, NCCL or gloo all-reduce), so its communication time is not visible from "
        "Python: the table shows it as *inside PyTorch*. Compared with the parameter server, both "
        "all-reduce methods spread the traffic over all ranks (a ring moves 2(N-1)/N of the gradient "
        "bytes per rank), while the server must receive every worker's gradients and send every "
        "worker the parameters, so its link carries N-1 times the model per step and becomes the "
        "bottleneck as workers are added.",
        code(DDPStrategy.setup),
        "BatchNorm running statistics follow DDP's default (the first trainer's are the model's):",
        code(Strategy.finish_epoch),
    ])


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
    return [{"": k, "value": v} for k, v in items]


def config_rows(res: Results) -> list[dict]:
    keys = ("world_size", "batch_size", "epochs", "dataset", "model", "backend", "lr", "momentum",
            "weight_decay", "amp", "channels_last", "bucket_mb", "no_overlap", "ps_mode",
            "max_steps_per_epoch", "workers")
    rows = []
    for k in keys:
        row = {"setting": k}
        for m, d in res.ok.items():
            cfg = d.get("config", {})
            v = cfg[k] if k in cfg else len(d["epochs"]) if k == "epochs" else d.get(k, "-")
            row[SHORT[m]] = "-" if v is None else v
        rows.append(row)
    return rows


# ------------------------------------------------------------------ benchmark and cost model
def figure_html(png: Path, caption: str) -> str:
    """A figure with its caption in one block that a PDF page break cannot split."""
    import base64

    b64 = base64.b64encode(Path(png).read_bytes()).decode()
    cap = html.escape(caption)
    return (f'<figure style="break-inside: avoid; margin: 0 0 1.5em 0"><figcaption><b>{cap}</b>'
            f'</figcaption><img src="data:image/png;base64,{b64}" alt="{cap}" style="max-width: 100%">'
            f'</figure>')


def bench_section(run: Path, out: Path) -> list[tuple[str, str]]:
    """The report's benchmark part as ("md" | "html", content) blocks: the bench table and
    figure, the cost model's formulas, its validation against the bench, and its projection."""
    from . import bench, model

    doc = bench.load(run)
    if doc is None:
        return [("md", "No benchmark in this run folder. `labkit bench` measures each method's "
                       "step against compute-only steps and the raw collectives; "
                       "`labkit report` on its run folder shows it here, with the cost model.")]
    plots = Path(out) / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    c = doc["config"]
    blocks = [("md", f"**Table 3. Benchmark** (`labkit bench`, {doc['created']}): {c.get('model')} on "
                     f"{c.get('dataset')}, batch {c.get('batch_size')} per trainer, {doc['backend']} on "
                     f"{doc['device']}; {doc['trials']} trials of {doc['steps']} steps after "
                     f"{doc['warmup']} warm-up steps. *Step*: median over the trials of the slowest "
                     "rank's time per step (min-max beside it). *Compute-only*: the same steps "
                     "with no synchronisation. *Exposed comm* = step - compute-only. *All-reduce* "
                     "and *reduce+bcast*: the raw collectives on the same bytes in the same process "
                     "group, bus bandwidth as nccl-tests defines it. *x DDP/trainer*: throughput "
                     "per training process relative to DDP's (fair to a PS, whose servers do not "
                     "train).")]
    if doc.get("results"):
        blocks.append(("html", html_table(bench.rows(doc))))
        png = bench.plot(doc, plots / "bench.png")
        blocks.append(("html", figure_html(png, "Figure 6. Where a step's time goes, and "
                                                "throughput relative to DDP at the same process count.")))
    for s in doc.get("skipped", []) + doc.get("failed", []):
        blocks.append(("md", f"- {s['variant']} with {s['nproc']} processes: "
                             f"{'skipped: ' + s['reason'] if 'reason' in s else 'failed: ' + s['error']}"))
    if not doc.get("results"):
        return blocks

    blocks.append(("md", "### Cost model (labkit.model)\n\n" + model.formulas_markdown()))
    checks = model.validate(doc)
    ok = [r["ok"] for r in checks if r["ok"] is not None]
    blocks.append(("md", f"**Table 4. Cost model against the bench.** Each row predicts the step "
                         f"from that process count's measured compute-only time and the latency "
                         f"and bandwidth fitted to its all-reduce sweep. {sum(ok)} of {len(ok)} "
                         f"predictions are within {model.ERROR_TARGET_PCT:g}% of the measured step."))
    blocks.append(("html", html_table(model.validation_table(checks))))
    base = sorted(doc["results"], key=lambda r: (r["method"] != "ddp", r["nproc"]))[0]
    compute, grad = base["compute_time"]["median"], float(base["grad_bytes"])
    rows = model.project(compute, grad, batch=base["batch_size"])
    png = model.plot_projection(rows, str(plots / "projection.png"))
    where = ("measured on this CPU, so the curves show what each network would do to a step of "
             "this length; run the bench on a GPU for GPU figures"
             if doc["device"] == "cpu" else "measured on this GPU")
    blocks.append(("md", f"**Projection.** Compute per step: {1e3 * compute:.1f} ms, {where}. "
                         f"Gradients: {grad / 2**20:.1f} MiB. Links: nominal figures, NVLink inside "
                         f"8-GPU nodes. Scaling efficiency = compute / step."))
    blocks.append(("html", figure_html(Path(png), "Figure 7. Projected scaling efficiency, 8 to "
                                                  "1024 GPUs, per interconnect and method.")))
    blocks.append(("html", html_table(model.projection_table(rows, wide=True))))
    return blocks


# ------------------------------------------------------------------ method variants
def load_variants(run: Path) -> dict[str, dict]:
    """Results of the variants an experiment ran besides the three methods (``labkit
    experiment --methods ps,ps-async,...``): {variant: result document}."""
    from .config import VARIANTS

    out = {}
    for v, fields in VARIANTS.items():
        path = Path(run) / v / RESULT_FILES[fields["method"]]
        if v not in METHOD_ORDER and path.exists():
            try:
                out[v] = load_result(path)
            except ResultError:
                continue
    return out


def variant_rows(base: dict[str, dict], variants: dict[str, dict]) -> list[dict]:
    rows = []
    for name, d in [*base.items(), *variants.items()]:
        c, ep = d.get("config", {}), _epochs(d)
        stale = [e["max_staleness_observed"] for e in ep if "max_staleness_observed" in e]
        rows.append({
            "run": name, "servers": c.get("ps_servers") if c.get("method") == "ps" else None,
            "staleness bound": c.get("ps_staleness"), "compress": c.get("compress", "none"),
            "img/s": summary_value(d, "avg_train_throughput"),
            "final train loss": ep[-1]["train_loss"] if ep else None,
            "best val acc %": summary_value(d, "best_val_accuracy"),
            "max staleness seen": max(stale) if stale else None,
            "status": d.get("status"),
        })
    return rows


def variants_section(run: Path, res: Results, out: Path) -> list[tuple[str, str]]:
    """Each variant against its synchronous, uncompressed method: a table, and the loss and
    validation-accuracy curves side by side."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .metrics import atomic_path

    variants = load_variants(run)
    if not variants:
        return [("md", "No variants in this run. `labkit experiment --methods ps,ps-async` (or "
                       "ps-sharded, allreduce-fp16, ddp-fp16, ps-fp16) adds them.")]
    from .config import VARIANTS

    methods = {VARIANTS[v]["method"] for v in variants}
    base = {SHORT[m]: d for m, d in res.docs.items() if m in methods}
    blocks = [("md", "**Table 5. Method variants** against the synchronous, uncompressed run of "
                     "the same method. *max staleness seen*: the largest number of steps a PS "
                     "worker ran ahead of the slowest (asynchronous PS).")]
    blocks.append(("html", html_table(variant_rows(base, variants))))
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
    for i, (name, d) in enumerate([*base.items(), *variants.items()]):
        losses = d.get("all_losses") or []
        style = "-" if name in base else "--"
        a.plot(range(1, len(losses) + 1), losses, style, lw=1.2, label=name, color=f"C{i}")
        ep = _epochs(d)
        b.plot([e["epoch"] for e in ep], [e.get("val_accuracy") for e in ep], style + "o", lw=1.2,
               label=name, color=f"C{i}")
    a.set(xlabel="training step", ylabel="training loss", title="Loss per step")
    b.set(xlabel="epoch", ylabel="validation accuracy (%)", title="Validation accuracy")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    png = Path(out) / "plots" / "variants.png"
    png.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(str(png)) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    blocks.append(("html", figure_html(png, "Figure 8. Variants (dashed) against their "
                                            "synchronous method (solid): loss and accuracy.")))
    return blocks
