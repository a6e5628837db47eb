"""The scaling study of a `labkit sweep` folder: throughput against the number of processes,
per method, beside the ideal linear line from the smallest point, and scaling efficiency with
95% confidence intervals. A sweep over another parameter (local SGD's ``local_steps``,
PowerSGD's ``powersgd_rank``) is also a study: time to the target accuracy (over seeds, with
``--repeats``) and bytes per step against the parameter, as curves with intervals.

Efficiency at n processes = T(n) / (n / n0 * T(n0)), n0 the smallest process count of the
sweep. Its interval is that of the throughput ratio T(n) / T(n0) (labkit.core.stats.speedup: the
delta method on the log ratio over the step blocks of one run each, or a t-interval over the
repeats when there are several), scaled by n0 / n, a constant. Reads files only.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from labkit.core import stats
from labkit.core import layout
from labkit.core.files import atomic_path
from labkit.core.methods import METHOD_ORDER, SPECS, label
from labkit.core.run_folder import RunFolder
from labkit.core.results import Result
from labkit.core.status import Status
from labkit.core.texttable import text_table

from .figures import COLORS, save_figure
from .load import RunResults, load_env, load_run
from .workload_view import WorkloadView, view_of_docs


class SweepError(ValueError):
    """Not a sweep folder, or an unreadable sweep.json."""


@dataclass
class Point:
    name: str
    params: dict                 # the swept values of this grid point
    res: RunResults
    env: Optional[dict] = None


@dataclass
class Sweep:
    path: Path
    doc: dict
    points: list[Point] = field(default_factory=list)

    @property
    def grid(self) -> dict:
        return self.doc.get("grid", {})

    @property
    def view(self) -> WorkloadView:
        """What its points trained and how they are judged, in the report's words."""
        return view_of_docs([d for p in self.points for ds in p.res.repeats.values() for d in ds])


def is_sweep(path: str | os.PathLike) -> bool:
    return (Path(path) / layout.SWEEP).is_file()


def load_sweep(path: str | os.PathLike) -> Sweep:
    root = Path(path)
    try:
        doc = RunFolder(root).read(layout.SWEEP)
    except FileNotFoundError:
        raise SweepError(f"{root}: no {layout.SWEEP} (labkit sweep makes sweep folders)") from None
    except (OSError, json.JSONDecodeError) as e:
        raise SweepError(f"{root / layout.SWEEP}: unreadable ({e.__class__.__name__})") from None
    sw = Sweep(root, doc)
    for p in doc.get("points", []):
        d = root / p["dir"]
        if d.is_dir():
            sw.points.append(Point(p["name"], p["params"], load_run(d), load_env(d)))
    return sw


#: the swept parameters that change the process count: the scaling study's axis
SCALED = ("nproc", "emulate_nodes")


def _processes(doc: Result) -> int:
    return int(doc.world_size)


def series(sw: Sweep) -> dict[tuple[str, str], list[tuple[int, list[Result]]]]:
    """(method, the other swept values as text) -> [(processes, its repeats' documents)],
    by process count (emulated nodes x nproc). A grid over nproc and batch_size gives one
    series per method and batch."""
    out: dict[tuple[str, str], list[tuple[int, list[Result]]]] = {}
    for p in sw.points:
        other = ", ".join(f"{k}={v}" for k, v in p.params.items() if k not in SCALED)
        for m in METHOD_ORDER:
            docs = [d for d in (p.res.repeats.get(m) or []) if d.epochs]
            if docs and all(d.status == Status.COMPLETED for d in docs):
                out.setdefault((m, other), []).append((_processes(docs[0]), docs))
    return {k: sorted(v, key=lambda x: x[0]) for k, v in out.items()}


def scaling_rows(sw: Sweep) -> list[dict]:
    """One row per method and process count: throughput with its CI, the ideal linear
    throughput from the smallest point, the efficiency with its CI."""
    rows, rate = [], sw.view.rate
    for key, pts in series(sw).items():
        n0, base = pts[0]
        t0 = stats.throughput(base)
        for n, docs in pts:
            t = stats.throughput(docs)
            ratio = stats.speedup(docs, base)  # T(n) / T(n0), with its CI
            k = n0 / n
            eff = ratio.value * k if ratio.value else None
            rows.append({
                "Method": label(*key), "Processes": n,
                "Trainers": stats.trainers_of(docs[0]),
                f"Throughput ({rate})": f"{t.value:,.1f}" if t.value else "-",
                "95% CI": t.ci_text(1),
                f"Ideal ({rate})": f"{t0.value * n / n0:,.1f}" if t0.value else "-",
                "Efficiency": f"{eff:.2f}" if eff is not None else "-",
                # n0 is the reference: 1.00 by definition, no interval
                "Efficiency 95% CI": "-" if n == n0 else ratio.ci_text(scale=k),
                "CI over": t.basis if t.available else "-",
            })
    return rows


def _label_points(ax, marks: list) -> None:
    """Each (x, y, text, color) beside its point; labels at one x are kept a line apart,
    highest first, so methods with about the same throughput stay readable."""
    from matplotlib.transforms import offset_copy

    if not marks:
        return
    gap = 0.06 * max(y for _, y, _, _ in marks)  # about one line of 8-point text
    at = offset_copy(ax.transData, fig=ax.figure, x=6, y=0, units="points")
    for x in sorted({m[0] for m in marks}):
        last = None
        for _, y, text, color in sorted((m for m in marks if m[0] == x), key=lambda m: -m[1]):
            last = y if last is None else min(y, last - gap)
            ax.text(x, last, text, transform=at, fontsize=8, color=color, va="center")


def plot_scaling(sw: Sweep, ax) -> None:
    """Throughput against processes (error bars: the 95% CI), dashed: ideal linear scaling."""
    marks = []  # (processes, throughput, efficiency text, color)
    for key, pts in series(sw).items():
        color = COLORS[key[0]]
        ns = [n for n, _ in pts]
        ivs = [stats.throughput(docs) for _, docs in pts]
        vals = [iv.value or 0.0 for iv in ivs]
        err = [[v - iv.low if iv.available else 0.0 for v, iv in zip(vals, ivs)],
               [iv.high - v if iv.available else 0.0 for v, iv in zip(vals, ivs)]]
        ax.errorbar(ns, vals, yerr=err, fmt="-o", color=color, capsize=4, label=label(*key))
        if vals[0]:  # the efficiency beside each point past n0
            marks += [(n, v, f"{v / (vals[0] * n / ns[0]):.2f}", color) for n, v in zip(ns[1:], vals[1:])]
        if len(ns) > 1 and vals[0]:
            ax.plot([ns[0], ns[-1]], [vals[0], vals[0] * ns[-1] / ns[0]], "--", color=color,
                    alpha=0.6, label=f"ideal linear, {label(*key)}")
    _label_points(ax, marks)
    from matplotlib.ticker import MaxNLocator
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("processes")
    ax.set_ylabel(sw.view.rate_axis)
    ax.set_title("Throughput vs processes (error bars: 95% CI; dashed: ideal linear;\n"
                 "numbers: scaling efficiency)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.margins(x=0.1)  # room for the efficiency labels at the last point
    ax.set_ylim(bottom=0)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no completed grid point", transform=ax.transAxes, ha="center", color="#a00")


def limits(sw: Sweep) -> list[str]:
    """What bounds the scaling here, from the recorded environment: said, not implied."""
    lines = []
    ns = sorted({n for pts in series(sw).values() for n, _ in pts})
    devices = {d.world.get("device") for p in sw.points for ds in p.res.repeats.values()
               for d in ds}
    env = next((p.env for p in sw.points if p.env), {}) or {}
    cores = env.get("cpu_count")
    if "cpu" in devices:
        lines.append(
            f"CPU run (gloo) on {cores or '?'} CPU cores with {', '.join(map(str, ns))} processes: "
            "every process computes on the same cores, so total compute cannot grow past the "
            "core count; beyond it a process only takes time from the others and the ideal line "
            f"is out of reach by construction (at n > {cores or 'cores'} processes the efficiency is at most "
            f"{cores or 'cores'}/n). "
            "The Jupyter kernel, torchrun and the data loading share those cores too, and "
            "communication (gloo over loopback) competes with compute instead of overlapping it. "
            "Read a CPU sweep as a check of the machinery; GPU runs, one process per GPU, are "
            "where the ideal line is a reachable bound.")
    no_ci = {iv.note for pts in series(sw).values() for _, docs in pts
             for iv in [stats.throughput(docs)] if not iv.available and iv.note}
    for note in sorted(no_ci):
        lines.append(f"Some points have no confidence interval: {note}.")
    for m in dict.fromkeys(k[0] for k in series(sw) if k[0] in SPECS and SPECS[k[0]].serves):
        lines.append(f"{label(m)}: rank 0 serves and trains nothing, so n processes are n-1 "
                     "trainers (column Trainers); its ideal line is drawn per process, like the "
                     "others, which charges it for the server.")
    for p in sw.points:
        for m, prob in p.res.problems.items():
            lines.append(f"Problem at {p.name}: {label(m)}: {prob}")
    missing = [p["name"] for p in sw.doc.get("points", []) if not (sw.path / p["dir"]).is_dir()]
    if missing:
        lines.append(f"Not run: {', '.join(missing)}.")
    return lines


def write_sweep_report(sw: Sweep, out: str | os.PathLike) -> dict[str, Path]:
    """scaling.png and scaling.txt (the efficiency table and the limits) under ``out``; for a
    sweep over a method's parameter also study.png and study.txt (write_study), over the link
    of an emulated cluster link.png and crossovers.txt (linkaxis.write_link_axis)."""
    from .linkaxis import write_link_axis

    out = Path(out)
    png = save_figure(out / "scaling.png", (7, 4.5), 1, lambda ax: plot_scaling(sw, ax))
    txt = out / "scaling.txt"
    body = (f"Scaling study: {sw.path}\ngrid: {json.dumps(sw.grid)}\n\n"
            + text_table(scaling_rows(sw), empty="(no completed grid point)")
            + "\n\n" + "\n".join(f"- {l}" for l in limits(sw)) + "\n")
    with atomic_path(str(txt)) as tmp:
        Path(tmp).write_text(body)
    return {"plot": png, "text": txt, **write_study(sw, out), **write_link_axis(sw, out)}


# ------------------------------------------------------------------ a study over a method's parameter
def studied(sw: Sweep) -> list[str]:
    """The swept parameters other than the process count and the link (local_steps,
    powersgd_rank, ...): a sweep over one of them is a study of time to accuracy and bytes, not
    of scaling (the link's study is labkit.report.linkaxis)."""
    return [k for k in sw.grid if k not in (*SCALED, "link")]


def study_target(sw: Sweep) -> Optional[float]:
    """One target for every point (labkit.report.seeds.points_target)."""
    from .seeds import points_target

    return points_target(sw.points)


def study(sw: Sweep) -> dict[str, list[tuple[Point, "object"]]]:
    """{method: [(grid point, its seeds.Seeds)]}, in the grid's order."""
    from . import seeds

    goal, out = study_target(sw), {}
    if goal is None:
        return {}
    for p in sw.points:
        for m in seeds.judged(p.res):
            out.setdefault(m, []).append((p, seeds.score(p.res, m, goal)))
    return out


def study_rows(sw: Sweep) -> list[dict]:
    """One row per method and grid point: time and steps to the target and final accuracy
    (mean and 95% CI over seeds, MLPerf's scoring: labkit.report.seeds) and the MB a
    trainer sent per step."""
    rows, view = [], sw.view
    f = view.target
    final = ("Final accuracy (%, 95% CI)" if view.guide else
             f"Final {f.label} ({f.unit + ', ' if f.unit else ''}95% CI)")
    for m, pts in study(sw).items():
        for p, s in pts:
            rows.append({"Method": label(m), "Point": ", ".join(f"{k}={v}" for k, v in p.params.items()),
                         "Seeds": s.n,
                         "Reached": f"{s.reached} of {s.n}",
                         "Time to target (s, 95% CI)": s.time().with_ci(1),
                         "Steps to target (95% CI)": s.steps_to().with_ci(0),
                         final: s.final_accuracy().with_ci(2, 100.0) if view.guide
                         else s.final_accuracy().with_ci(3),
                         "MB/step sent": f"{s.mb_per_step:.3f}" if s.mb_per_step is not None else "-"})
    return rows


def plot_study(sw: Sweep, axes) -> None:
    """Two panels against the swept parameter: time to the target (error bars: 95% CI over
    seeds; an open marker at the top: not reached) and MB sent per step per trainer."""
    import numpy as np

    key = studied(sw)[0]
    goal = study_target(sw)
    for m, pts in study(sw).items():
        xs = [p.params.get(key) for p, _ in pts]
        ivs = [s.time() for _, s in pts]
        got = [(x, iv) for x, iv in zip(xs, ivs) if iv.value is not None]
        if got:
            vals = np.array([iv.value for _, iv in got])
            err = [[v - max(0.0, iv.low) if iv.available else 0.0 for v, (_, iv) in zip(vals, got)],
                   [iv.high - v if iv.available else 0.0 for v, (_, iv) in zip(vals, got)]]
            axes[0].errorbar([x for x, _ in got], vals, yerr=err, fmt="-o", capsize=4,
                             color=COLORS[m], label=label(m))
        missed = [x for x, iv in zip(xs, ivs) if iv.value is None]
        if missed:
            axes[0].plot(missed, [0] * len(missed), "x", color=COLORS[m], ms=9,
                         label=f"{label(m)}: not reached")
        mb = [(x, s.mb_per_step) for x, (_, s) in zip(xs, pts) if s.mb_per_step]
        if mb:
            axes[1].plot([x for x, _ in mb], [v for _, v in mb], "-o", color=COLORS[m], label=label(m))
    axes[0].set_title(f"Time to {sw.view.goal(goal)}" if goal is not None else "Time to target",
                      fontsize=10)
    axes[0].set_ylabel("seconds (mean over seeds, 95% CI)")
    axes[0].set_ylim(bottom=0)
    axes[1].set_title("MB sent per step per trainer", fontsize=10)
    axes[1].set_yscale("log")
    from matplotlib.ticker import FuncFormatter
    for fmt in (axes[1].yaxis.set_major_formatter, axes[1].yaxis.set_minor_formatter):
        fmt(FuncFormatter(lambda v, _: f"{v:g}"))
    for ax in axes:
        ax.set_xlabel(key)
        ax.grid(alpha=0.3)
        if all(isinstance(x, (int, float)) and x > 0 for x in sw.grid.get(key, [])):
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)


def write_study(sw: Sweep, out: str | os.PathLike) -> dict[str, Path]:
    """study.png and study.txt under ``out``; nothing for a sweep over processes only."""
    if not studied(sw):
        return {}
    out = Path(out)
    png = save_figure(out / "study.png", (10, 4.2), 2, lambda axes: plot_study(sw, axes))
    txt = out / "study.txt"
    with atomic_path(str(txt)) as tmp:
        Path(tmp).write_text(f"Study over {', '.join(studied(sw))}: {sw.path}\n\n"
                             + text_table(study_rows(sw), empty="(no grid point with a result)") + "\n")
    return {"study_plot": png, "study_text": txt}
