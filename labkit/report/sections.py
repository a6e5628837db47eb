"""The report's parts as blocks (labkit.report.blocks): the results (with a reproduction's
verdicts), the method variants, the benchmark with the cost model, and the environment with
the installed packages. Each ``*_section`` is a part as the notebook shows it, for the tests and
callers that read it alone."""
from __future__ import annotations

import html
from pathlib import Path
from typing import Optional

from labkit import costmodel
from labkit.bench import bench_view
from labkit.core import layout
from labkit.core.config import VARIANTS
from labkit.core.files import atomic_path
from labkit.core.methods import BASELINE, label
from labkit.core.run_folder import RunFolder
from labkit.core.status import Status

from .accounting import account, account_rows
from .accounting import summary_lines as account_summary
from .blocks import (Block, Figure, Html, Later, Markdown, Page, Shown, Table, TableCaption, Text,
                     shown)
from .load import RunResults, load_reproduction, load_variants
from .plots import PLOTS
from .tables import (communication_rows, config_rows, efficiency_rows, environment_rows, epoch_rows,
                     html_table, reproduction_rows, text_table, variant_rows)
from .text import load_bench, ran_on_gpu, reproduction_summary
from .workload_view import WorkloadView


def results_blocks(page: Page) -> list[Block]:
    """The Results part: a reproduction's verdicts (a run made by `labkit reproduce`), the
    communication table, GPU use (GPU runs only) and the figures but the step breakdown (the
    summary's)."""
    res, view = page.res, page.view
    blocks = reproduction_blocks(page.run)
    if not res.ok:
        blocks.append(Markdown("*No training results in this folder.*"))
    blocks += [TableCaption("communication"), Table(communication_rows(res))]
    if ran_on_gpu(res):  # on a CPU run every column but the data wait would be "-"
        blocks += [TableCaption("efficiency", view), Table(efficiency_rows(res))]
    # the seeds' figures are the seeds part's
    blocks += [Figure(k, png, view) for k, png in page.plots.items()
               if k in PLOTS and k != "communication_overhead"]
    return blocks + [Text((f"Figures: the PNG files in {layout.PLOTS_DIR}/ beside this file "
                           f"(report.html shows them with their captions).", ""))]


def _plots(out: Optional[Path]) -> Path:
    """The folder the notebook's own figures go in, made."""
    plots = Path(out if out is not None else ".") / layout.PLOTS_DIR
    plots.mkdir(parents=True, exist_ok=True)
    return plots


def bench_blocks(run: Path, out: Optional[Path]) -> list[Block]:
    """The benchmark part (blocks): the bench table and figure, its failed or skipped jobs, and
    (the notebook's alone) the cost model's formulas, its validation against the bench, and its
    projection; figures under ``out``/plots/."""
    doc = load_bench(run)
    if doc is None:  # the report's "Not in this run" line says how to add one
        return []
    c = doc["config"]
    blocks: list[Block] = [TableCaption("bench", fields=dict(
        created=doc["created"], model=c.get("model"), dataset=c.get("dataset"),
        batch_size=c.get("batch_size"), backend=doc["backend"], device=doc["device"],
        trials=doc["trials"], steps=doc["steps"], warmup=doc["warmup"]))]
    if doc.get("results"):
        blocks.append(Table(bench_view.rows(doc), bench_view.text_table(doc)))
        if bench_view.verdicts(doc):
            blocks.append(Markdown("\n".join(f"- {v}" for v in bench_view.verdicts(doc))))
        blocks.append(Figure("bench_figure",
                             lambda: bench_view.plot(doc, _plots(out) / layout.BENCH_PLOT)))
    else:
        blocks.append(Text(("(no bench results)", "")))
    # the bench document lists its failed jobs under the status's name
    for s in doc.get("skipped", []) + doc.get(Status.FAILED, []):
        blocks.append(Markdown(f"- {s['variant']} with {s['nproc']} processes: "
                             f"{'skipped: ' + s['reason'] if 'reason' in s else 'failed: ' + s['error']}"))
    if doc.get("results"):
        blocks.append(Later(lambda: cost_model_blocks(doc, out)))
    return blocks


def cost_model_blocks(doc: dict, out: Optional[Path]) -> list[Block]:
    """The cost model of a bench with results: its formulas, its predictions against the bench's
    steps, and its projection to large machines (figure under ``out``/plots/)."""
    blocks: list[Block] = [Markdown("### Cost model (labkit.model)\n\n" + costmodel.formulas_markdown())]
    checks = costmodel.compare_with_bench(doc)
    ok = [r["ok"] for r in checks if r["ok"] is not None]
    blocks += [TableCaption("costmodel", fields=dict(ok=sum(ok), total=len(ok),
                                                     target=costmodel.ERROR_TARGET_PCT)),
               Table(costmodel.validation_table(checks))]
    base = sorted(doc["results"], key=lambda r: (r["method"] != BASELINE, r["nproc"]))[0]
    compute, grad = base["compute_time"]["median"], float(base["grad_bytes"])
    rows = costmodel.project(compute, grad, batch=base["batch_size"])
    where = ("measured on this CPU, so the curves show what each network would do to a step of "
             "this length; run the bench on a GPU for GPU figures"
             if doc["device"] == "cpu" else "measured on this GPU")
    blocks.append(Markdown(f"**Projection.** Compute per step: {1e3 * compute:.1f} ms, {where}. "
                         f"Gradients: {grad / 2**20:.1f} MiB. Links: nominal figures, NVLink inside "
                         f"8-GPU nodes. Scaling efficiency = compute / step."))
    blocks.append(Figure("projection", lambda: Path(costmodel.plot_projection(
        rows, str(_plots(out) / "projection.png")))))
    return blocks + [Table(costmodel.projection_table(rows, wide=True))]


def bench_section(run: Path, out: Path) -> list[Shown]:
    """The benchmark part as the notebook shows it (its figures drawn under ``out``/plots/)."""
    return shown(bench_blocks(run, out))


def variants_blocks(run: Path, res: RunResults, out: Optional[Path]) -> list[Block]:
    """Each variant against its synchronous, uncompressed method: a table, and the loss and
    validation-accuracy curves side by side (drawn under ``out``/plots/ when shown)."""
    variants = load_variants(run)
    if not variants:  # the report's "Not in this run" line says how to add them
        return []
    methods = {VARIANTS[v]["method"] for v in variants}
    base = {label(m): d for m, d in res.docs.items() if m in methods}
    return [TableCaption("variants"), Table(variant_rows(base, variants)),
            Figure("variants_figure", lambda: plot_variants(base, variants, res.view, out),
                   res.view)]


def plot_variants(base: dict, variants: dict, view: WorkloadView, out: Optional[Path]) -> Path:
    """plots/variants.png: loss per step and the first validation figure per epoch, each
    variant dashed beside its method solid."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    f = view.target
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
    png = _plots(out) / "variants.png"
    with atomic_path(str(png)) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    return png


def variants_section(run: Path, res: RunResults, out: Path) -> list[Shown]:
    """The variants part as the notebook shows it (its figure drawn under ``out``/plots/)."""
    return shown(variants_blocks(run, res, out))


def reproduction_blocks(run: Optional[Path]) -> list[Block]:
    """A run made by ``labkit reproduce``: its verdicts against the recorded run, and (the
    notebook's) their table and what differed in the environment. No blocks for any other run."""
    doc = load_reproduction(run)
    if doc is None:
        return []
    ok = sum(v["verdict"] != "different" for v in doc["methods"].values())
    tol = doc.get("tolerance")
    verdicts = [f"  {label(m)}: {v['verdict']}" + "".join(f"; {r}" for r in v.get("reasons") or [])
                for m, v in doc["methods"].items()]
    env = doc.get("environment_before") or doc.get("environment") or []
    return [Markdown(f"## {reproduction_summary(doc)}",
                     plain=(f"{reproduction_summary(doc)} ({doc['original']})", *verdicts, "")),
            TableCaption("reproduction", fields=dict(
                original=doc["original"], ok=ok, total=len(doc["methods"]),
                tolerance=f" (tolerance {tol:g})" if tol is not None else ""), in_text=False),
            Html(html_table(reproduction_rows(doc))),
            Markdown("**Environment, this run against the recorded one:** "
                     + ("no difference that matters." if not env else
                        "\n\n" + "\n".join(f"- {l}" for l in env)))]


def reproduction_section(run: Path) -> list[Shown]:
    """The reproduction's verdicts as the notebook shows them (none for any other run)."""
    return shown(reproduction_blocks(run))


def environment_blocks(page: Page) -> list[Block]:
    """Appendix C: the machine, the versions and each method's configuration; the text report
    has each method's per-epoch table, the notebook (Later) the environment's table, the
    installed packages, the torchrun commands, where each method's wall time went and the
    configurations' table."""
    res, env, parts = page.res, page.env, []
    if env:
        gpus = ", ".join(g["name"] for g in env.get("gpus", [])) or "none"
        parts.append(f"machine: {env.get('host')} | CPU: {env.get('cpu')} ({env.get('cpu_count')} cores) | "
                     f"GPUs: {gpus}")
        parts.append(f"versions: python {env.get('python')}, torch {env.get('torch')}, "
                     f"CUDA {env.get('cuda')}, NCCL {env.get('nccl')} | git {str(env.get('git', {}).get('commit'))[:10]}"
                     f"{' (dirty)' if env.get('git', {}).get('dirty') else ''}")
    for m, d in res.ok.items():
        cfg = d.config
        parts.append(f"{label(m)}: world size {d.world_size}, batch {d.batch_size}/trainer"
                     + (f", {cfg.get('model')} on {cfg.get('dataset')}, backend {cfg.get('backend')}" if cfg else "")
                     + f", {len(d.epochs)} epoch(s), {d.start_time} -> {d.end_time}")
    parts.append("")
    for m, d in res.ok.items():
        parts += [f"{d.method}: per epoch", "", text_table(epoch_rows(d)), ""]
    return [Text(tuple(parts)), Later(lambda: environment_shown(page))]


def environment_shown(page: Page) -> list[Block]:
    """Appendix C as the notebook shows it."""
    env, run = page.env, page.run
    if not env:
        blocks: list[Block] = [Markdown("No environment.json in this folder (result files from elsewhere).")]
    else:
        blocks = [Html(html_table(environment_rows(env)))]
        packages = packages_html(env, run)  # collapsed: ~150 lines would bury the rest
        blocks += [Html(packages)] if packages else []
        cmds = env.get("torchrun_commands", {})
        if cmds:
            blocks.append(Markdown("**torchrun commands** (each run from its method's folder)\n\n"
                                   + "\n\n".join(f"`{m}`: `{c}`" for m, c in cmds.items())))
    accounts = account(run) if run is not None else {}  # the lab's own time beside training's
    if accounts:
        blocks += [Markdown("**Where each method's wall time went** (seconds, from "
                            "experiment.json, each method's launch.json and rank 0's result file)"),
                   Html(html_table(account_rows(accounts))),
                   Markdown("  \n".join(account_summary(run, accounts)) + ".")]
    if page.res.ok:
        blocks.append(Html(html_table(config_rows(page.res))))
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
