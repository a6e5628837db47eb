"""The lab notebook across runs: one row per run folder under runs/ (experiments, repeats,
sweeps, benches, reproductions, one method's `labkit run`), for `labkit runs`, runs/index.html
and notebooks/runs.ipynb.

It only reads what is on disk and never fails on a folder: a folder it cannot read is a row
that says why. Of the parameters, only those that differ between the listed runs are shown
(as ``dvc exp show --only-changed`` does), unless all are asked for.
"""
from __future__ import annotations

import html
import json
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from labkit.core import layout
from labkit.core.files import finite
from labkit.core.methods import BASELINE, METHOD_ORDER, RESULT_FILES, label
from labkit.core.results import read_result
from labkit.core.run_folder import NOT_PARAMETERS, RunFolder, parameters
from labkit.core.stats import interval_text
from labkit.core.status import Status, experiment_status, status_of
from labkit.core.texttable import text_table
from labkit.workloads.catalog import DEFAULT as DEFAULT_WORKLOAD

UNREADABLE = "unreadable"  # the status label of a folder whose files cannot be read


@dataclass
class Row:
    name: str
    path: str
    kind: str = "?"
    when: str = ""                     # "YYYY-MM-DD HH:MM:SS", from the folder's name
    tag: str = ""
    commit: str = ""                   # short commit, "+dirty" when the tree was
    status: str = ""                   # a Status value
    methods: list[str] = field(default_factory=list)
    nproc: Optional[int] = None
    link: str = ""                     # an emulated cluster's link, as set and as measured
    params: dict[str, Any] = field(default_factory=dict)
    results: dict[str, dict] = field(default_factory=dict)  # method -> throughput, CI, verdict
    rate: str = ""                     # throughput's unit, its workload's ("img/s", "tokens/s")
    report: Optional[str] = None
    jobs: str = ""                     # a sweep on Slurm (--slurm): each point's job and state
    problem: Optional[str] = None      # why the folder could not be read (whole or in part)

    @property
    def status_label(self) -> str:
        try:
            return Status(self.status).label
        except ValueError:
            return self.status or UNREADABLE

    def to_json(self) -> dict:
        """Strict JSON: a number that is not finite becomes null."""
        return finite({**asdict(self), "status_label": self.status_label})



def _json(folder: RunFolder, name: str) -> Any:
    """A document of the folder; a missing one raises OSError, a corrupt one ValueError."""
    try:
        return folder.read(name)
    except json.JSONDecodeError as e:
        raise ValueError(f"{Path(name).name} is not valid JSON (line {e.lineno}, column {e.colno})") from None


def row_params(config: dict) -> dict[str, Any]:
    """A run's parameters as its row shows them; a run from before workloads trained the
    guide's images, so its row says so beside an lm run's."""
    out = {k: v for k, v in parameters(config).items() if k != "methods"}
    if config.get("train") and "workload" not in config["train"]:
        out["workload"] = DEFAULT_WORKLOAD
    return {k: (",".join(map(str, v)) if isinstance(v, list) else v) for k, v in out.items()}


def _commit(folder: RunFolder) -> str:
    try:
        git = _json(folder, layout.ENVIRONMENT).get("git") or {}
    except (OSError, ValueError):
        return ""
    c = str(git.get("commit") or "")[:10]
    return c + ("+dirty" if c and git.get("dirty") else "")


def _results(folder: RunFolder, row: Row) -> None:
    """Each method's steady-state throughput with its 95% CI and its verdict against DDP."""
    from labkit import report

    res = report.load_run(folder.path)
    row.rate = res.view.rate if res.ok else ""
    ivs = report.intervals(res)
    verdicts = dict(zip([m for m in METHOD_ORDER if m in res.ok and m != BASELINE],
                        report.speed_verdicts(res)))
    for m in METHOD_ORDER:
        if m in ivs:
            thr, sp = ivs[m]["throughput"], ivs[m]["speedup"]
            row.results[m] = {"throughput": thr.value, "low": thr.low, "high": thr.high,
                              "vs_ddp": sp.value if sp else None,
                              "verdict": verdicts[m].label if m in verdicts else None}


def _experiment(folder: RunFolder, row: Row) -> None:
    """An experiment's folder; one holding only result files (the guide's scripts, copied
    method folders) is a row too, its status its result files'."""
    config = _json(folder, layout.CONFIG) if folder.has(layout.CONFIG) else {}
    row.params = row_params(config)
    found = folder.found_methods()
    row.methods = list((config.get("experiment") or {}).get("methods") or config.get("resolved") or found)
    row.nproc = (config.get("experiment") or {}).get("nproc")
    row.link = folder.link()
    rep = None
    if folder.has(layout.EXPERIMENT):
        st = _json(folder, layout.EXPERIMENT)
        row.status, rep = experiment_status(st).value, st.get("report")
    elif config:
        row.status = Status.STOPPED.value  # config written, nothing ran to the end
    else:
        row.status = experiment_status({"methods": {m: {"status": read_result(
            folder.path / m / RESULT_FILES[m]).status.value} for m in found}}).value
    html_report = folder.path / layout.REPORT_DIR / "report.html"
    row.report = str(html_report) if html_report.exists() else rep
    _results(folder, row)


def _run(folder: RunFolder, row: Row) -> None:
    """One method's run (`labkit run --out DIR`): its result file straight in the folder, its
    parameters from the resolved.json its launcher wrote; without a result file, failed where
    launch.json records a failed launch, else stopped (it never wrote one). The guide's
    scripts' loose result files read the same, without parameters."""
    name = layout.resolved_file()
    resolved = _json(folder, name) if folder.has(name) else {}
    train = resolved.get("train") or {}
    row.params = row_params({"train": train, "experiment": {
        k: resolved[k] for k in ("nproc", "nodes") if k in resolved}}) if train else {}
    row.methods = folder.loose_methods() or [str(train.get("method") or "?")]
    row.nproc = resolved.get("nproc")
    row.link = folder.link()
    statuses = {m: {"status": read_result(folder.path / RESULT_FILES[m]).status.value}
                for m in folder.loose_methods()}
    if statuses:
        row.status = experiment_status({"methods": statuses}).value
    else:
        launch = folder.get(layout.launch_file(), {})
        failed = isinstance(launch, dict) and launch.get("returncode") not in (None, 0)
        row.status = (Status.FAILED if failed else Status.STOPPED).value
    html_report = folder.path / layout.REPORT_DIR / "report.html"
    row.report = str(html_report) if html_report.exists() else None
    _results(folder, row)


def _sweep(folder: RunFolder, row: Row) -> None:
    doc = _json(folder, layout.SWEEP)
    row.status = status_of(doc, Status.RUNNING).value
    row.params = {"sweep": " ".join(f"{k}={','.join(map(str, v))}"
                                    for k, v in (doc.get("grid") or {}).items())}
    points = doc.get("points") or []
    row.methods = list(doc.get("methods") or sorted(
        {m for p in points for m in (p.get("params") or {}).get("methods") or []}))
    # the sweep's folder records no environment of its own: its points' name the code
    row.commit = row.commit or next(
        (c for p in points if (c := _commit(RunFolder(folder.path / str(p.get("dir")))))), "")
    rep = folder.path / layout.REPORT_DIR / "sweep.html"
    row.report = str(rep) if rep.exists() else doc.get("report")
    if doc.get("slurm"):
        row.jobs = ", ".join(f"{p.get('job')} {p.get('name')} {_point_state(folder, p)}"
                             for p in doc.get("points") or [])


def _point_state(sweep: RunFolder, point: dict) -> str:
    """A sweep point's state: sweep.json's once the sweep has gathered it; before, its
    experiment's own (its job writes it as it goes), or pending until that job starts."""
    recorded = status_of(point, Status.PENDING)
    exp = RunFolder(sweep.path / str(point.get("dir")))
    if not recorded.ended and exp.has(layout.EXPERIMENT):
        recorded = experiment_status(_json(exp, layout.EXPERIMENT))
    slurm = point.get("slurm_state")
    return recorded.label + (f" (Slurm: {slurm})" if slurm else "")


def _bench(folder: RunFolder, row: Row) -> None:
    doc = _json(folder, layout.BENCH)
    row.status = status_of(doc, Status.RUNNING).value
    row.params = {k: v for k, v in (doc.get("config") or {}).items() if k not in NOT_PARAMETERS}
    row.methods = sorted({r.get("variant") for r in doc.get("results") or []} - {None})
    rep = folder.path / layout.REPORT_DIR / "report.html"
    row.report = str(rep) if rep.exists() else None


def read_row(run: Path) -> Row:
    """One run folder as a row; never raises (a problem is the row's ``problem``)."""
    row = Row(run.name, str(run))
    when, row.tag = layout.run_name(run.name)
    row.when = when or ""
    folder = RunFolder(run)
    try:
        folder.discover()  # methods of one's own: their result files name them
        row.kind = folder.kind
        row.commit = _commit(folder)
        {"sweep": _sweep, "bench": _bench, "run": _run}.get(row.kind, _experiment)(folder, row)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        where = f" ({Path(e.filename).name})" if isinstance(e, OSError) and e.filename else ""
        row.problem = f"unreadable{where}: {why}"
    return row


def scan(runs_dir: str | Path) -> list[Row]:
    """Every run folder directly under ``runs_dir`` (not runs/latest), oldest first."""
    return [read_row(p) for p in layout.run_folders(runs_dir)]


def changed(rows: list[Row]) -> list[str]:
    """The parameters whose values differ between the rows that record them (a sweep's
    grid or an unreadable folder does not make every parameter of the others differ)."""
    keys = sorted({k for r in rows for k in r.params})
    return [k for k in keys
            if len({json.dumps(r.params[k], sort_keys=True) for r in rows if k in r.params}) > 1]


def _since(text: str) -> str:
    """--since: a date (2026-11-20), or an age (3d, 12h, 30m) -> 'YYYY-MM-DD HH:MM:SS'."""
    m = re.fullmatch(r"(\d+)([dhm])", text.strip())
    if m:
        secs = int(m.group(1)) * {"d": 86400, "h": 3600, "m": 60}[m.group(2)]
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(time.time() - secs))
    if re.fullmatch(r"\d{4}-\d{2}-\d{2}( \d{2}:\d{2}(:\d{2})?)?", text.strip()):
        return text.strip()
    raise ValueError(f"--since {text!r} is not a date (2026-11-20) or an age (3d, 12h, 30m)")


def select(rows: list[Row], tag: Optional[str] = None, since: Optional[str] = None,
           status: Optional[str] = None, sort: str = "when", reverse: bool = False) -> list[Row]:
    """Filter (tag substring, started since, status value or label) and sort (by a column
    or a parameter)."""
    if since:
        cut = _since(since)
        rows = [r for r in rows if r.when and r.when >= cut]
    if tag:
        rows = [r for r in rows if tag in r.tag]
    if status:
        labels = {st.label for st in Status} | {UNREADABLE}
        if status not in labels | {st.value for st in Status}:
            raise ValueError(f"--status {status!r} is not a run status; choose from "
                             + ", ".join(sorted(labels)))
        rows = [r for r in rows if status in (r.status, r.status_label)]

    def key(r: Row):
        v = getattr(r, sort, None) if sort in Row.__dataclass_fields__ else r.params.get(sort)
        return (v is None, str(v) if not isinstance(v, (int, float)) else f"{v:020.6f}")
    return sorted(rows, key=key, reverse=reverse)


def _result_cell(r: dict, rate: str = "") -> str:
    """A method's throughput [95% CI] and its ratio to DDP with the verdict; ``rate``: the unit
    written after the throughput (where the column's heading does not say it)."""
    if r.get("throughput") is None:
        return "-"
    text = f"{r['throughput']:.1f}" + (f" {rate}" if rate else "")
    if r.get("low") is not None:
        text += f" [{interval_text(r['low'], r['high'], 1)}]"
    if r.get("vs_ddp") is not None:
        text += f" {r['vs_ddp']:.2f}x {r.get('verdict') or ''}".rstrip()
    return text


def table(rows: list[Row], all_params: bool = False) -> list[dict]:
    """The index as rows of dicts: the fixed columns, the (changed) parameters, each method's
    throughput [95% CI] (img/s, tokens/s: its workload's unit) and its ratio to DDP with the
    verdict, the report, and any problem."""
    params = sorted({k for r in rows for k in r.params}) if all_params else changed(rows)
    methods = [m for m in METHOD_ORDER if any(m in r.results for r in rows)]
    rates = {r.rate for r in rows if r.results} or {"img/s"}
    # one unit for every run: in the heading ("Baseline DDP img/s"); several (images and a
    # language model's tokens): in each cell
    unit = next(iter(rates)) if len(rates) == 1 else None
    out = []
    for r in rows:
        d = {"run": r.name, "when": r.when, "tag": r.tag, "kind": r.kind, "commit": r.commit,
             "status": r.status_label, "methods": ",".join(r.methods), "nproc": r.nproc}
        if any(x.link for x in rows):
            d["network"] = r.link or "-"
        d.update({p: r.params.get(p) for p in params})
        d.update({f"{label(m)} {unit or 'throughput'}":
                  _result_cell(r.results[m], "" if unit else r.rate) if m in r.results else "-"
                  for m in methods})
        d["report"] = r.report or "-"
        if any(x.jobs for x in rows):
            d["jobs"] = r.jobs or "-"
        if any(x.problem for x in rows):
            d["problem"] = r.problem or ""
        out.append(d)
    return out


def text(rows: list[Row], all_params: bool = False) -> str:
    return text_table(table(rows, all_params), empty="(no run folders)", strip=True)


def _relative(path: Path, root: Path) -> str:
    """A link from runs/index.html: relative when under runs/, so a moved runs/ still works."""
    full = path.resolve()
    return str(full.relative_to(root)) if full.is_relative_to(root) else full.as_uri()


def html_page(rows: list[Row], runs_dir: str | Path) -> str:
    """runs/index.html: the index as a page, each run's name linking to its report."""
    root = Path(runs_dir).resolve()
    body = table(rows)
    cols = list(body[0]) if body else []
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    lines = []
    for r, d in zip(rows, body):
        cells = []
        for c in cols:
            v = "" if d[c] is None else str(d[c])
            if c == "report" and r.report and Path(r.report).is_file():
                rel = _relative(Path(r.report), root)
                v = f'<a href="{html.escape(rel)}">{html.escape(rel)}</a>'
            else:
                v = html.escape(v)
            cells.append(f"<td>{v}</td>")
        lines.append(f'<tr class="run">{"".join(cells)}</tr>')
    style = ("body{font-family:sans-serif;margin:1.5em}table{border-collapse:collapse;font-size:"
             "13px}td,th{border:1px solid #ccc;padding:3px 6px;text-align:left}th{background:#eee}")
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>labkit runs</title>"
            f"<style>{style}</style></head><body><h1>labkit runs: {html.escape(str(root))}</h1>"
            f"<p>{len(rows)} run folder(s); parameters shown only where they differ.</p>"
            f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(lines)}</tbody></table>"
            f"</body></html>\n")


# ------------------------------------------------------------------ notebooks/runs.ipynb
def browser(runs_dir: str | Path):
    """The index as widgets for JupyterLab: the table, and a list of its rows; picking a row
    opens that run in the explorer below (labkit.runs.explore)."""
    import ipywidgets as w

    from . import explore

    rows = scan(runs_dir)
    table = w.HTML(html_page(rows, runs_dir).split("<body>")[1].split("</body>")[0])
    pick = w.Select(options=[("(pick a run to open it in the explorer)", None)]
                    + [(f"{r.name}  [{r.status_label}]", r.path) for r in reversed(rows)],
                    rows=min(10, len(rows) + 1), description="open", layout=w.Layout(width="90%"))
    out = w.Output()

    def opened(change) -> None:
        # set as the Output's state (as the explorer sets its figure), not captured with
        # `with out:`, which needs the browser to route the display message
        outputs = ()
        if change["new"]:
            box = explore.explorer(explore.load_runs([change["new"]]), newest=1)
            outputs = ({"output_type": "display_data", "metadata": {},
                        "data": box._repr_mimebundle_()},)
        out.outputs = outputs

    pick.observe(opened, names="value")
    return w.VBox([table, pick, out])
