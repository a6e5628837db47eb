"""The run explorer's building blocks: find run folders, load them, overlay a metric, compare.

``notebooks/explore.ipynb`` is a thin layer of widgets over these functions, so everything it
shows can be tested (and reused) without a notebook.  Loading goes through :mod:`labkit.report`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

from labkit import report
from labkit.core import breakdown
from labkit.core import layout
from labkit.core.health import diverged_where, replicas_verdict
from labkit.core.methods import METHOD_NAMES, label
from labkit.core.results import Epoch, Result, comm_phase
from labkit.core.run_folder import RunFolder

# What can be overlaid: (key, axis label with its unit).  Per-epoch keys come first; "all_losses"
# is the per-step loss over the whole run.  A tuple, not a dict: modules are re-imported in live
# kernels and nothing here should be mutable.
METRICS = (
    ("all_losses", "training loss (per step)"),
    ("train_loss", "training loss (epoch mean)"),
    ("val_loss", "validation loss"),
    ("train_accuracy", "training accuracy (%)"),
    ("val_accuracy", "validation accuracy (%)"),
    ("train_throughput", "training throughput (images/s)"),
    ("train_time", "training time per epoch (s)"),
    ("avg_batch_time", "average batch time (s)"),
    ("avg_comm_time", "all-reduce time per step (s)"),
    ("avg_comm_time_pull", "PS pull time per step (s)"),
    ("avg_comm_time_push", "PS push time per step (s)"),
)

@dataclass(frozen=True)
class Run:
    """One run folder, loaded: results by method key, and problems (failed/corrupt) by method."""
    name: str
    path: Path
    docs: dict[str, Result]
    problems: dict[str, str]


def _views(runs: list[Run]) -> list[report.WorkloadView]:
    """The workload view of every loaded result (labkit.report.workload_view)."""
    return [report.view_of_result(d) for run in runs for d in run.docs.values()]


def metric_label(metric: str, runs: Optional[list[Run]] = None) -> str:
    """A metric's axis label with its unit; with ``runs``, in their workloads' words (tokens/s
    for a language model's throughput; a workload's own figure, such as its perplexity)."""
    views = _views(runs or [])
    rates = {v.rate for v in views}
    if metric == "train_throughput" and rates - {report.IMAGES.rate}:  # not only images/s
        return f"training throughput ({rates.pop() if len(rates) == 1 else 'each run in its unit'})"
    own = {f.key: f.column for v in views for f in v.extra_figures()}
    return dict(METRICS).get(metric) or own.get(metric, metric)


def has_results(run_dir: str | os.PathLike) -> bool:
    """Whether report.load_run would find a result file: in a method subfolder or directly."""
    return RunFolder(run_dir).has_results()


def find_runs(runs_dir: str | os.PathLike) -> list[Path]:
    """Run folders under ``runs_dir`` holding at least one result file, newest first.

    Symlinks (``latest``) are skipped so the newest run is not listed twice; a missing
    ``runs_dir`` is simply empty.
    """
    return [p for p in reversed(layout.run_folders(runs_dir)) if has_results(p)]


def load_runs(run_dirs: Iterable[str | os.PathLike]) -> list[Run]:
    """Load each run folder with :func:`report.load_run` (same order as given)."""
    runs = []
    for d in run_dirs:
        res = report.load_run(d)
        runs.append(Run(Path(d).name, Path(d), res.docs, res.problems))
    return runs


def _method_keys(methods: Optional[Iterable[str]]) -> list[str]:
    """The chosen method keys in the report's order (None = all)."""
    if methods is None:
        return list(report.METHOD_ORDER)
    chosen = set(methods)
    return [m for m in report.METHOD_ORDER if m in chosen]


def _select(runs: list[Run], run_names: Optional[Iterable[str]],
            methods: Optional[Iterable[str]]) -> list[tuple[Run, str, Result]]:
    """(run, method key, result) for the chosen runs x methods that have a result file."""
    names = None if run_names is None else set(run_names)
    keys = _method_keys(methods)
    return [(r, m, r.docs[m]) for r in runs if names is None or r.name in names
            for m in keys if m in r.docs]


def _figure(e: Epoch, metric: str):
    """One epoch's figure of ``metric``: a phase's communication time, one of the epoch's
    figures, or one of the method's own (None where the epoch has none)."""
    phase = comm_phase(metric)
    if phase is not None:
        return e.comm.get(phase)
    return getattr(e, metric) if metric in Epoch.__dataclass_fields__ else e.extra.get(metric)


def series(doc: Result, metric: str) -> tuple[list, list]:
    """(x, y) of one metric in one result: per step for "all_losses", else per epoch.

    Epochs lacking the metric are left out (e.g. no all-reduce time in a DDP result).
    """
    if metric == "all_losses":
        ys = doc.all_losses
        return list(range(1, len(ys) + 1)), list(ys)
    pts = [(e.epoch, v) for e in doc.epochs
           if isinstance(v := _figure(e, metric), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_overlay(runs: list[Run], metric: str, run_names: Optional[Iterable[str]] = None,
                 methods: Optional[Iterable[str]] = None, ax=None):
    """Overlay ``metric`` for the chosen runs x methods on one axis; returns the axis.

    One line per (run, method) that has the metric, labelled "<run folder> / <method name>".
    Colour encodes the method and line style the run, so the same method reads the same
    across runs.  ``None`` for run_names / methods means all of them.
    """
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 4))
    styles = ("-", "--", ":", "-.")
    run_index = {r.name: i for i, r in enumerate(runs)}
    per_step = metric == "all_losses"
    drawn, epochs = 0, set()
    for run, m, doc in _select(runs, run_names, methods):
        x, y = series(doc, metric)
        if not y:
            continue
        epochs.update(x)
        ax.plot(x, y, label=f"{run.name} / {doc.method}",
                color=report.COLORS.get(m),  # the report's colours, so figures read alike
                linestyle=styles[run_index[run.name] % len(styles)],
                lw=1.0 if per_step else 1.5, marker=None if per_step else "o", ms=4)
        drawn += 1
    ax.set_xlabel("step (over all epochs)" if per_step else "epoch")
    ax.set_ylabel(metric_label(metric, runs))
    ax.set_title(metric_label(metric, runs))
    if not per_step and 0 < len(epochs) <= 20:
        ax.set_xticks(sorted(epochs))  # one tick per epoch (a 1-epoch run got ticks 0.95 .. 1.05)
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # no "epoch 1.5"
    ax.grid(alpha=0.3)
    if drawn > 4:  # several runs: a legend inside would cover the curves
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    elif drawn:
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, f"no selected run/method has {metric!r}", ha="center", va="center",
                transform=ax.transAxes, color="grey")
    return ax


def available_metrics(runs: list[Run]) -> list[str]:
    """The METRICS keys that at least one loaded result has a number of, in METRICS order, then
    the workloads' own validation figures that one has (a language model's perplexity)."""
    docs = [doc for run in runs for doc in run.docs.values()]
    own = list(dict.fromkeys(f.key for v in _views(runs) for f in v.extra_figures()))
    keys = [k for k, _ in METRICS] + [k for k in own if k not in dict(METRICS)]
    # a figure written as null reads as NaN: a workload without accuracy has no accuracy to plot
    return [k for k in keys if any(v == v for doc in docs for v in series(doc, k)[1])]


def comparison_rows(runs: list[Run], run_names: Optional[Iterable[str]] = None,
                    methods: Optional[Iterable[str]] = None) -> list[dict]:
    """One row per chosen (run, method); failed or unreadable methods get a row with status."""
    names = None if run_names is None else set(run_names)
    keys = _method_keys(methods)
    rows = []
    for run in runs:
        if names is not None and run.name not in names:
            continue
        for m in keys:
            row = {"run": run.name, "method": METHOD_NAMES.get(m, m)}
            doc = run.docs.get(m)
            if doc is not None:
                row["method"] = doc.method
                row["status"] = doc.status
                epochs = doc.epochs
                row["epochs"] = len(epochs)
                # the overall figures fall back to the epochs when the summary lacks one; a
                # value not recorded at all (NaN) is left as an empty cell rather than "nan"
                for col, v in _overall(doc):
                    if v is not None and v == v:
                        row[col] = float(v)
                if epochs:
                    row["final train loss"] = float(epochs[-1].train_loss)
                said = [t for t in (diverged_where(doc), replicas_verdict(doc)) if t]
                if said:
                    row["health"] = "; ".join(said)
            if m in run.problems:
                row["status"] = run.problems[m]
            if doc is not None or m in run.problems:
                rows.append(row)
    return rows


def _overall(doc: Result) -> list[tuple[str, Optional[float]]]:
    """(column, value) of a result's throughput and best first figure, in its workload's words:
    "avg throughput (img/s)" and "best val accuracy (%)" for the guide's images, "avg
    throughput (tokens/s)" and "best val loss (nats/token)" for a language model."""
    view, overall = report.view_of_result(doc), doc.overall
    thr = (f"avg throughput ({view.rate})", overall.avg_train_throughput)
    if view.guide:
        return [thr, ("best val accuracy (%)", overall.best_val_accuracy)]
    f = view.target
    name = f"best {f.label.replace('validation ', 'val ')}" + (f" ({f.unit})" if f.unit else "")
    return [thr, (name, doc.best_figure(f.key, f.higher_is_better))]


COLUMNS = ("run", "method", "status", "epochs", "avg throughput (img/s)",
           "best val accuracy (%)", "final train loss", "health")


def columns(docs: list[Result]) -> list[str]:
    """COLUMNS, its throughput and best-figure columns in the words of the workloads of
    ``docs`` (the guide's where they hold only images, or none), throughputs first."""
    named = list(dict.fromkeys(col for d in docs for col, _ in _overall(d))) or list(COLUMNS[4:6])
    named.sort(key=lambda c: not c.startswith("avg throughput"))  # stable: in the runs' order
    return [*COLUMNS[:4], *named, *COLUMNS[6:]]


def comparison_table(runs: list[Run], run_names: Optional[Iterable[str]] = None,
                     methods: Optional[Iterable[str]] = None) -> str:
    """The comparison rows as an HTML table (via report.html_table); empty cells = not recorded."""
    docs = [doc for _, _, doc in _select(runs, run_names, methods)]
    rows = comparison_rows(runs, run_names, methods)
    for r in rows:
        # html_table shows floats with 2 decimals, too coarse for a loss near 0.05
        for k in [k for k in r if k == "final train loss" or k.startswith("best val loss")]:
            r[k] = f"{r[k]:.4g}"
    return report.html_table(rows, columns(docs))


def _png_output(fig) -> dict:
    """A matplotlib figure as an Output widget's display_data (rendered here, in the kernel)."""
    import base64
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    return {"output_type": "display_data", "metadata": {},
            "data": {"image/png": base64.b64encode(buf.getvalue()).decode(),
                     "text/plain": f"<Figure: {fig.axes[0].get_title()}>"}}


# Views that are not one value per epoch: the report's figures of a step's breakdown and of the
# trainers' waits at the synchronisation point, for the picked runs
VIEWS = (
    ("breakdown", "where a trainer's step goes (ms per step)"),
    ("sync_waits", "each trainer's wait at the synchronisation point (ms per step)"),
)


def available_views(runs: list[Run]) -> list[str]:
    """The VIEWS that at least one loaded result can draw."""
    docs = [d for r in runs for d in r.docs.values()]
    have = {"breakdown": any(breakdown.of_result(d) for d in docs),
            "sync_waits": any(breakdown.waits(d) for d in docs)}
    return [k for k, _ in VIEWS if have[k]]


def plot_view(runs: list[Run], view: str, run_names: Optional[Iterable[str]] = None,
              methods: Optional[Iterable[str]] = None, ax=None):
    """The report's figure of a step's breakdown (``breakdown``) or of the trainers' waits
    (``sync_waits``), one bar (or group
    of bars, one per trainer) per picked run x method; returns the axis."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 4))
    picked = [(f"{run.name}\n{label(m)}", doc) for run, m, doc in _select(runs, run_names, methods)]
    if view == "breakdown":
        items = [(label, breakdown.of_result(doc)) for label, doc in picked]
        items = [(label, b) for label, b in items if b is not None]
        if items:
            breakdown.draw(ax, [label for label, _ in items], [b for _, b in items])
    else:
        items = [(label, breakdown.waits(doc)) for label, doc in picked]
        items = [(label, w) for label, w in items if w is not None]
        for i, (_, w) in enumerate(items):  # not ``label``: a local would hide labkit's label()
            width = 0.8 / len(w.ranks)
            for j, (r, t) in enumerate(zip(w.ranks, w.mean_wait)):
                red = r == w.last and w.consistent
                ax.bar(i - 0.4 + width * (j + 0.5), 1000 * t, width * 0.9,
                       color="#C44E52" if red else "#8C8C8C")
        ax.set_xticks(range(len(items)), [label for label, _ in items], fontsize=8)
        ax.set_ylabel("ms waited per step (red: the rank the others waited for)")
    ax.set_title(dict(VIEWS)[view])
    if not items:
        ax.text(0.5, 0.5, f"no selected run/method has {view!r}", ha="center", va="center",
                transform=ax.transAxes, color="grey")
    return ax


def explorer(runs: list[Run], newest: int = 3):
    """The widgets of explore.ipynb: pick runs, methods and a metric; the overlay and the table
    are drawn when the box is displayed and redrawn whenever a selection changes.

    The figure and the table are set as the Output widget's outputs from the kernel (PNG bytes
    and HTML) rather than captured with ``with out:``, whose capture is a hand-off by message
    id to the widget in the browser; as widget state they need no hand-off and arrive after
    the widget, with or without a frontend.  Nothing is drawn while the box is only built.
    """
    import ipywidgets as w
    from IPython.display import HTML
    from matplotlib.figure import Figure

    metrics = available_metrics(runs)
    wide = {"description_width": "initial"}
    run_pick = w.SelectMultiple(options=[r.name for r in runs], value=[r.name for r in runs[:newest]],
                                rows=min(8, len(runs)), description="runs", style=wide)
    method_pick = w.SelectMultiple(options=[(METHOD_NAMES[m], m) for m in report.METHOD_ORDER],
                                   value=list(report.METHOD_ORDER), rows=len(report.METHOD_ORDER),
                                   description="methods", style=wide)
    views = dict(VIEWS)
    metric_pick = w.Dropdown(options=[(metric_label(k, runs), k) for k in metrics]
                             + [(views[k], k) for k in available_views(runs)],
                             value=metrics[0],  # METRICS order: the per-step loss first
                             description="metric", style=wide)
    out = w.Output()

    def redraw(change=None):
        # a Figure, not pyplot: no global figure left open for the inline backend to show later
        fig = Figure(figsize=(9, 4.5))
        draw = plot_view if metric_pick.value in views else plot_overlay
        draw(runs, metric_pick.value, run_pick.value, method_pick.value, ax=fig.subplots())
        table = comparison_table(runs, run_pick.value, method_pick.value)
        out.outputs = (_png_output(fig), {"output_type": "display_data", "metadata": {},
                                          "data": {"text/html": table, "text/plain": repr(HTML(table))}})

    for pick in (run_pick, method_pick, metric_pick):
        pick.observe(redraw, names="value")
    hint = w.HTML("<i>Hold Ctrl or Shift to pick several runs or methods; the overview below "
                  "shows the newest runs.</i>")

    class ExplorerBox(w.VBox):
        def _repr_mimebundle_(self, **kwargs):
            redraw()  # the default selection, drawn as the box is shown: no click needed
            return super()._repr_mimebundle_(**kwargs)

    return ExplorerBox([w.HBox([run_pick, method_pick, metric_pick]), hint, out])


def show(runs_dir: Optional[str | os.PathLike] = None, interactive: bool = True,
         newest: int = 3) -> list[Run]:
    """explore.ipynb in one call: the run folders under ``runs_dir`` (default: the project's
    runs/, from any working directory: labkit.core.layout.runs_root), the explorer's widgets
    when ``interactive`` (they need a live kernel), then static figures and the table of the
    ``newest`` runs, which an exported or papermill-executed copy keeps. Returns the runs."""
    import matplotlib.pyplot as plt
    from IPython.display import HTML, Markdown, display

    root = layout.runs_root(runs_dir)
    runs = load_runs(find_runs(root))
    if not runs:
        display(Markdown(f"**No run folders with results under `{root}`.** "
                         "Run `labkit experiment` (or `make experiment`) first."))
        return runs
    display(Markdown(f"**{len(runs)} run folder(s)** under `{root}`, newest first: "
                     + ", ".join(f"`{r.name}`" for r in runs)))
    if interactive:
        display(explorer(runs, newest))
    # widgets do not survive export or papermill; these figures and the table do
    shown = runs[:newest]
    judged = list(dict.fromkeys(v.target for v in _views(shown))) or [report.IMAGES.target]
    display(Markdown("### Static overview\n\nThe newest runs, all methods: per-step training "
                     f"loss, {' and '.join(f.label for f in judged)} and throughput. Runs: "
                     + ", ".join(f"`{r.name}`" for r in shown)))
    display(HTML(comparison_table(shown)))
    for metric in ("all_losses", *(f.key for f in judged), "train_throughput"):
        _, ax = plt.subplots(figsize=(9, 4.5))
        plot_overlay(shown, metric, ax=ax)
        plt.show()
    return runs
