"""The report's optional parts as display blocks (labkit.report.blocks): the benchmark with the cost
model, the method variants, a reproduction's verdicts, and the installed packages."""
from __future__ import annotations

import html
from pathlib import Path
from typing import Optional

from labkit import costmodel
from labkit.bench import bench_view
from labkit.core import layout
from labkit.core.config import VARIANTS
from labkit.core.files import atomic_path
from labkit.core.methods import label
from labkit.core.run_folder import RunFolder
from labkit.core.status import Status

from .blocks import Block, Html, Markdown
from .captions import caption, figure_caption
from .figures import figure_html
from .load import RunResults, load_reproduction, load_variants
from .tables import html_table, reproduction_rows, variant_rows
from .text import load_bench, reproduction_summary


def bench_section(run: Path, out: Path) -> list[Block]:
    """The report's benchmark part as display blocks (labkit.report.blocks): the bench table and
    figure, the cost model's formulas, its validation against the bench, and its projection."""
    doc = load_bench(run)
    if doc is None:  # the report's "Not in this run" line says how to add one
        return []
    plots = Path(out) / layout.PLOTS_DIR
    plots.mkdir(parents=True, exist_ok=True)
    c = doc["config"]
    blocks = [Markdown(caption("bench", created=doc["created"], model=c.get("model"),
                             dataset=c.get("dataset"), batch_size=c.get("batch_size"),
                             backend=doc["backend"], device=doc["device"], trials=doc["trials"],
                             steps=doc["steps"], warmup=doc["warmup"]))]
    if doc.get("results"):
        blocks.append(Html(html_table(bench_view.rows(doc))))
        if bench_view.verdicts(doc):
            blocks.append(Markdown("\n".join(f"- {v}" for v in bench_view.verdicts(doc))))
        png = bench_view.plot(doc, plots / layout.BENCH_PLOT)
        blocks.append(Html(figure_html(png, figure_caption("bench_figure"))))
    # the bench document lists its failed jobs under the status's name
    for s in doc.get("skipped", []) + doc.get(Status.FAILED, []):
        blocks.append(Markdown(f"- {s['variant']} with {s['nproc']} processes: "
                             f"{'skipped: ' + s['reason'] if 'reason' in s else 'failed: ' + s['error']}"))
    if not doc.get("results"):
        return blocks

    blocks.append(Markdown("### Cost model (labkit.model)\n\n" + costmodel.formulas_markdown()))
    checks = costmodel.compare_with_bench(doc)
    ok = [r["ok"] for r in checks if r["ok"] is not None]
    blocks.append(Markdown(caption("costmodel", ok=sum(ok), total=len(ok),
                                 target=costmodel.ERROR_TARGET_PCT)))
    blocks.append(Html(html_table(costmodel.validation_table(checks))))
    base = sorted(doc["results"], key=lambda r: (r["method"] != "ddp", r["nproc"]))[0]
    compute, grad = base["compute_time"]["median"], float(base["grad_bytes"])
    rows = costmodel.project(compute, grad, batch=base["batch_size"])
    png = costmodel.plot_projection(rows, str(plots / "projection.png"))
    where = ("measured on this CPU, so the curves show what each network would do to a step of "
             "this length; run the bench on a GPU for GPU figures"
             if doc["device"] == "cpu" else "measured on this GPU")
    blocks.append(Markdown(f"**Projection.** Compute per step: {1e3 * compute:.1f} ms, {where}. "
                         f"Gradients: {grad / 2**20:.1f} MiB. Links: nominal figures, NVLink inside "
                         f"8-GPU nodes. Scaling efficiency = compute / step."))
    blocks.append(Html(figure_html(Path(png), figure_caption("projection"))))
    blocks.append(Html(html_table(costmodel.projection_table(rows, wide=True))))
    return blocks


def variants_section(run: Path, res: RunResults, out: Path) -> list[Block]:
    """Each variant against its synchronous, uncompressed method: a table, and the loss and
    validation-accuracy curves side by side."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = load_variants(run)
    if not variants:  # the report's "Not in this run" line says how to add them
        return []
    methods = {VARIANTS[v]["method"] for v in variants}
    base = {label(m): d for m, d in res.docs.items() if m in methods}
    view = res.view
    f = view.target
    blocks = [Markdown(caption("variants"))]
    blocks.append(Html(html_table(variant_rows(base, variants))))
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
    for i, (name, d) in enumerate([*base.items(), *variants.items()]):
        losses = d.all_losses
        style = "-" if name in base else "--"
        a.plot(range(1, len(losses) + 1), losses, style, lw=1.2, label=name, color=f"C{i}")
        ep = d.epochs
        vals = ([e.val_accuracy for e in ep] if view.guide else
                [float("nan") if (v := e.figure(f.key)) is None else v for e in ep])
        b.plot([e.epoch for e in ep], vals,
               style + "o", lw=1.2, label=name, color=f"C{i}")
    a.set(xlabel="training step", ylabel="training loss", title="Loss per step")
    b.set(xlabel="epoch", ylabel="validation accuracy (%)" if view.guide else f.column,
          title="Validation accuracy" if view.guide else f.label[:1].upper() + f.label[1:])
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    png = Path(out) / layout.PLOTS_DIR / "variants.png"
    png.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(str(png)) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    blocks.append(Html(figure_html(png, figure_caption("variants_figure", view))))
    return blocks


def reproduction_section(run: Path) -> list[Block]:
    """A run made by ``labkit reproduce``: its verdicts against the recorded run, and what
    differed in the environment. No blocks for any other run."""
    doc = load_reproduction(run)
    if doc is None:
        return []
    ok = sum(v["verdict"] != "different" for v in doc["methods"].values())
    tol = doc.get("tolerance")
    blocks = [Markdown(f"## {reproduction_summary(doc)}"),
              Markdown(caption("reproduction", original=doc["original"], ok=ok, total=len(doc["methods"]),
                             tolerance=f" (tolerance {tol:g})" if tol is not None else "")),
              Html(html_table(reproduction_rows(doc)))]
    env = doc.get("environment_before") or doc.get("environment") or []
    blocks.append(Markdown("**Environment, this run against the recorded one:** "
                         + ("no difference that matters." if not env else
                            "\n\n" + "\n".join(f"- {l}" for l in env))))
    return blocks


def packages_html(env: dict, run: Optional[Path]) -> str:
    """Every installed package of the run's requirements.lock as a collapsed <details> table
    (the HTML report opens it on a click); "" when the run has no lock file."""
    folder = RunFolder(run) if run else None
    lock = folder.lock_file(env) if folder else None
    if lock is None:
        return ""
    pkgs = sorted(folder.package_versions(env).items())
    per_column = -(-len(pkgs) // 4)  # 4 name/version columns: ~150 packages in ~40 short rows
    rows = [pkgs[i::per_column] for i in range(per_column)]  # read down each column
    body = "".join("<tr>" + "".join(f"<td>{html.escape(n)}</td><td>{html.escape(v)}</td>" for n, v in r)
                   + "</tr>" for r in rows)
    return (f"<details><summary>{len(pkgs)} Python packages installed "
            f"({html.escape(lock.name)}; click to show)</summary>"
            f"<table><tbody>{body}</tbody></table></details>")
