"""Loading result files, tables and figures (the notebooks' building blocks)."""
from __future__ import annotations

import html
import json
import os
from pathlib import Path
from typing import Any, Optional

from .config import METHOD_NAMES, RESULT_FILES

METHOD_ORDER = ("ddp", "allreduce", "ps")


class ResultError(ValueError):
    """A result file that is missing, unreadable or of another schema."""


def load_result(path: str | os.PathLike) -> dict:
    try:
        with open(path) as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise ResultError(f"{path}: missing") from None
    except json.JSONDecodeError as e:
        raise ResultError(f"{path}: not valid JSON (line {e.lineno}): truncated or corrupt") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("epochs"), list) or "method" not in doc:
        raise ResultError(f"{path}: not a result file (needs 'method' and 'epochs')")
    return doc


def load_run(run_dir: str | os.PathLike) -> tuple[dict[str, dict], dict[str, str]]:
    """({method: result}, {method: problem}) for a run folder's method subfolders."""
    run = Path(run_dir)
    docs, problems = {}, {}
    status = {}
    if (run / "experiment.json").exists():
        status = json.loads((run / "experiment.json").read_text()).get("methods", {})
    methods = [m for m in METHOD_ORDER if (run / m).is_dir() or m in status]
    for m in methods:
        try:
            docs[m] = load_result(run / m / RESULT_FILES[m])
        except ResultError as e:
            problems[m] = str(e)
        if status.get(m, {}).get("status") not in (None, "completed"):
            problems[m] = f"{status[m]['status']}: {status[m].get('error', '')}".strip(": ")
    return docs, problems


def html_table(rows: list[dict], columns: Optional[list[str]] = None, floatfmt: str = "{:.4g}") -> str:
    columns = columns or (list(rows[0]) if rows else [])
    def cell(v: Any) -> str:
        return html.escape(floatfmt.format(v) if isinstance(v, float) else str(v))
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{cell(r.get(c, ''))}</td>" for c in columns) + "</tr>"
                   for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def epoch_rows(doc: dict) -> list[dict]:
    keys = ("epoch", "train_loss", "train_accuracy", "val_loss", "val_accuracy", "train_time",
            "train_throughput", "avg_batch_time", "avg_comm_time", "avg_comm_time_pull",
            "avg_comm_time_push")
    return [{k: e[k] for k in keys if k in e} for e in doc["epochs"]]


def summary_rows(docs: dict[str, dict], problems: dict[str, str]) -> list[dict]:
    rows = []
    for m in METHOD_ORDER:
        if m in docs:
            d, s = docs[m], docs[m].get("summary", {})
            rows.append({"method": d["method"], "status": d.get("status", "completed"),
                         "epochs": len(d["epochs"]),
                         "avg throughput (img/s)": s.get("avg_train_throughput", float("nan")),
                         "avg train time/epoch (s)": s.get("avg_train_time_per_epoch", float("nan")),
                         "best val accuracy (%)": s.get("best_val_accuracy", float("nan"))})
        if m in problems:
            rows.append({"method": METHOD_NAMES[m], "status": problems[m]})
    return rows


def plot_losses(docs: dict[str, dict], ax=None):
    """Per-step training loss of each method, on one axis."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.5))
    for m, d in docs.items():
        losses = d.get("all_losses") or []
        ax.plot(range(1, len(losses) + 1), losses, label=d.get("method", m), lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("Loss convergence")
    ax.grid(alpha=0.3)
    if docs:
        ax.legend()
    return ax.figure
