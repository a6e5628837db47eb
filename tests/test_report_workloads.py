"""The report speaks the workload's language (issue 69, item 4): a run of a language model is
judged by its validation loss (lower is better) and says tokens/s, loss and perplexity, never
img/s or accuracy; its target is reached at or below a loss, by default 105% of the lowest any
method reached; its samples and its reference (the unigram entropy) are shown. A run folder
without a workload, or with the images workload, reads exactly as before (the old code's own
output: tests/test_old_run_folders.py).

The result files are built here by hand, as a language model's rank writes them
(labkit.workloads.contract.Workload.describe), so every figure the report states is known
before it is computed; nothing is trained."""
from __future__ import annotations

import json
import math
import re

import pytest

from labkit import report
from labkit.core.results import Result
from labkit.report import seeds
from labkit.report.load import RunResults

NAMES = {"ddp": "Baseline DDP (PyTorch)", "allreduce": "Manual All-Reduce", "ps": "Parameter Server (PS)"}
FILES = {"ddp": "results_baseline_ddp.json", "allreduce": "results_all_reduce.json", "ps": "results_ps.json"}
UNITS = 64          # tokens in one sample (the context window)
BATCH, TRAINERS = 8, 2
STEPS = 20          # per epoch
SENT = 4e6          # bytes a trainer sends per step
REFERENCE = "unigram entropy of the validation text (nats/token)"
FORBIDDEN = re.compile(r"img/s|accura", re.I)


def workload(entropy: float = 3.1) -> dict:
    return {"name": "lm", "title": "language modelling", "unit": "tokens", "rate": "tokens/s",
            "units_per_sample": UNITS,
            "figures": [{"key": "val_loss", "label": "validation loss", "unit": "nats/token",
                         "higher_is_better": False, "short": "loss"},
                        {"key": "val_perplexity", "label": "validation perplexity", "unit": "",
                         "higher_is_better": False, "short": "ppl"}],
            "optimizer": "AdamW (linear warm-up, cosine decay)", "flops_rule": "6N per token",
            "references": {REFERENCE: entropy}}


def lm_doc(method: str, losses: list[float], epoch_s: float = 10.0, seed: int = 0,
           entropy: float = 3.1, text: str = "def f(x):\n    return x") -> dict:
    """A language model's result file: one epoch per validation loss, each ``epoch_s`` seconds
    (9/10 training, 1/10 validation) of STEPS steps, SENT bytes per step from each trainer."""
    step = 0.9 * epoch_s / STEPS
    epochs = [{"epoch": i + 1, "train_loss": v + 0.1, "train_accuracy": None,
               "train_time": 0.9 * epoch_s, "val_time": 0.1 * epoch_s,
               "train_throughput": BATCH * TRAINERS * UNITS / step, "avg_batch_time": step,
               "val_loss": v, "val_accuracy": None, "val_perplexity": math.exp(v), "steps": STEPS,
               "step_times": [step * (1 + 0.01 * (k % 3)) for k in range(STEPS)],
               "wire": {"sent_per_step": [SENT] * TRAINERS, "received_per_step": [SENT] * TRAINERS,
                        "trainer": [True] * TRAINERS}}
              for i, v in enumerate(losses)]
    return {"method": NAMES[method], "method_key": method, "world_size": TRAINERS,
            "batch_size": BATCH, "trainers": TRAINERS, "status": "completed", "epochs": epochs,
            "config": {"seed": seed, "model": "tiny", "dataset": "embedded"},
            "summary": {"avg_train_throughput": epochs[0]["train_throughput"],
                        "avg_train_time_per_epoch": 0.9 * epoch_s,
                        "best_val_loss": min(losses), "final_val_loss": losses[-1]},
            "all_losses": [v + 0.2 for v in losses], "workload": workload(entropy),
            "examples": {"samples": [{"prompt": "import torch\n", "text": text}]}}


def write_run(d, docs: dict[str, dict], experiment: dict | None = None):
    """A run folder: the result files loose in it, and config.json's experiment parameters."""
    d.mkdir(parents=True, exist_ok=True)
    for m, doc in docs.items():
        (d / FILES[m]).write_text(json.dumps(doc))
    (d / "config.json").write_text(json.dumps({"experiment": experiment or {}}))
    return d


# ddp reaches its lowest loss last; allreduce gets under 105% of it one epoch sooner; ps never
LOSSES = {"ddp": [3.5, 3.0, 2.8], "allreduce": [3.4, 2.9, 2.85], "ps": [3.6, 3.5, 3.45]}


def lm_run(tmp_path, experiment=None, **kw):
    return report.load_run(write_run(tmp_path / "lm", {m: lm_doc(m, v, **kw) for m, v in LOSSES.items()},
                                     experiment))


#: the tables of a run of methods (the bench's and the cost model's speak of neither)
TABLES = ("comparison", "communication", "efficiency", "repeats", "seeds", "variants")


def everything_said(res: RunResults, tmp_path) -> str:
    """The report's text, tables, captions and definitions as a reader meets them."""
    view = res.view
    files = report.write_report(res, tmp_path / "out")
    blocks = [*report.repeats_section(res), *report.seeds_section(res, files["plots"]),
              *report.examples_section(res)]
    return "\n".join([
        report.text_report(res), *report.summary_lines(res), report.discussion_markdown(res),
        report.html_table(report.comparison_rows(res)), report.html_table(report.communication_rows(res)),
        report.html_table(report.efficiency_rows(res)),
        *(report.html_table(report.epoch_rows(d)) for d in res.ok.values()),
        *(report.caption(k, view, target=report.target_text(res)) for k in TABLES),
        *(report.figure_caption(k, view) for k, c in report.CAPTIONS.items() if c.kind == report.captions.FIGURE),
        report.reading_markdown(report.CAPTIONS, view), *(b.text for b in blocks)])


def test_a_language_models_report_says_tokens_and_loss_never_images_or_accuracy(tmp_path):
    res = lm_run(tmp_path)
    said = everything_said(res, tmp_path)
    assert not FORBIDDEN.search(said), FORBIDDEN.search(said)
    assert "tokens/s" in said and "validation perplexity" in said and "nats/token" in said
    rows = {r["Method"]: r for r in report.comparison_rows(res)}
    # throughput counts tokens: samples per step x the tokens each holds, over the mean step
    step = sum(lm_doc("ddp", LOSSES["ddp"])["epochs"][0]["step_times"]) / STEPS
    assert rows["Baseline DDP"]["Avg throughput (tokens/s)"] == pytest.approx(BATCH * TRAINERS * UNITS / step)
    assert rows["Baseline DDP"]["Best validation loss (nats/token)"] == f"{min(LOSSES['ddp']):.3f}"
    # Figure 4 is the validation loss, in a file named for it
    assert {p.name for p in (tmp_path / "out" / "plots").iterdir()} >= {"validation_curves.png"}
    assert not (tmp_path / "out" / "plots" / "accuracy_curves.png").exists()


def test_the_target_is_a_loss_reached_at_or_below_it_and_the_first_is_named_with_its_bytes(tmp_path):
    res = lm_run(tmp_path, epoch_s=10.0)
    goal = 1.05 * min(min(v) for v in LOSSES.values())
    assert report.tables.target(res) == pytest.approx(goal, abs=5e-4)
    assert "105% of the lowest validation loss any method reached" in report.target_text(res)
    rows = {r["Method"]: r for r in report.comparison_rows(res)}
    first = {m: next(i for i, v in enumerate(LOSSES[m], 1) if v <= goal) for m in ("ddp", "allreduce")}
    assert first == {"ddp": 3, "allreduce": 2}
    for m, n in first.items():
        row = rows[report.SHORT[m]]
        assert row["Time to target (s)"] == pytest.approx(10.0 * n)
        assert row["Steps to target"] == STEPS * n
        assert row["Sent to target (MB per trainer)"] == pytest.approx(n * STEPS * SENT / 1e6)
    assert rows["Parameter Server"]["Time to target (s)"] == "not reached"
    line = next(l for l in report.summary_lines(res) if l.startswith("Time to "))
    assert "first to reach it: Manual All-Reduce" in line and "not reached: Parameter Server" in line
    assert f"{2 * STEPS * SENT / 1e6:.2f} MB sent per trainer" in line
    discussion = report.discussion(res)
    assert any(f"First to reach it: Manual All-Reduce, in {20.0:.1f} s, having sent "
               f"{2 * STEPS * SENT / 1e6:.2f} MB per trainer" in l for l in discussion)
    assert any(l.startswith("Parameter Server: ") and "It did not reach a validation loss of" in l
               for l in discussion)


def test_a_target_given_is_reached_when_the_loss_equals_it(tmp_path):
    """--target (config.json) is the first figure's: a loss exactly at it counts (at or below);
    --target-accuracy means nothing to a loss and is not read as one."""
    res = lm_run(tmp_path, experiment={"target": 2.9, "target_accuracy": 50.0})
    assert res.target == 2.9 and report.tables.target(res) == 2.9
    assert report.target_text(res) == "2.900 nats/token (set by --target)"
    rows = {r["Method"]: r for r in report.comparison_rows(res)}
    assert rows["Manual All-Reduce"]["Steps to target"] == 2 * STEPS  # 2.9 at epoch 2
    assert rows["Baseline DDP"]["Steps to target"] == 3 * STEPS
    only_accuracy = lm_run(tmp_path / "b", experiment={"target_accuracy": 50.0})
    assert report.tables.target(only_accuracy) == pytest.approx(1.05 * 2.8, abs=5e-4)


def test_the_reference_is_a_dashed_line_and_a_sentence(tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = lm_run(tmp_path, entropy=3.1)  # ddp and allreduce get under it, ps does not
    said = report.summary_lines(res)
    line = next(l for l in said if "unigram entropy" in l)
    assert line.startswith("The validation loss fell below the unigram entropy of the validation "
                           "text, 3.100 nats/token, with Baseline DDP, Manual All-Reduce")
    assert "the model uses context" in line and "stayed above it with Parameter Server" in line
    fig, ax = plt.subplots()
    report.plot_accuracy(res, ax)
    dashed = [l for l in ax.get_lines() if l.get_linestyle() == "--"]
    assert [list(l.get_ydata()) for l in dashed] == [[3.1, 3.1]]
    plt.close(fig)
    above = lm_run(tmp_path / "b", entropy=2.0)
    assert any(l.startswith("The validation loss stayed above the unigram entropy") and
               "does not use context" in l for l in report.summary_lines(above))


def test_the_samples_are_shown_escaped_and_said_once_for_methods_that_wrote_the_same(tmp_path):
    docs = {m: lm_doc(m, v, text="<script>alert(1)</script> & more") for m, v in LOSSES.items()}
    docs["ps"]["examples"] = {"samples": [{"prompt": "x = ", "text": "another text"}]}
    res = report.load_run(write_run(tmp_path / "lm", docs))
    html = "".join(b.text for b in report.examples_section(res))
    assert "&lt;script&gt;alert(1)&lt;/script&gt; &amp; more" in html and "<script>" not in html
    assert html.count("&lt;script&gt;") == 1 and "<b>Baseline DDP, Manual All-Reduce</b>" in html
    assert "another text" in html
    assert "examples" in dict(report.outline(res, res.run_dir))
    assert "What the model wrote" in report.text_report(res)


def test_over_seeds_a_higher_loss_is_worse(tmp_path):
    """Table 10 and its verdicts on a loss: the final validation loss with its interval, and a
    method whose loss is higher beyond the noise called worse, not better."""
    base = [lm_doc("ddp", [3.0, f], seed=s) for s, f in enumerate((2.80, 2.81, 2.79))]
    worse = [lm_doc("allreduce", [3.0, f], seed=s) for s, f in enumerate((2.95, 2.97, 2.96))]
    runs = {"ddp": [Result.from_dict(d) for d in base], "allreduce": [Result.from_dict(d) for d in worse]}
    res = RunResults(docs={m: r[0] for m, r in runs.items()}, repeats=runs, target=2.9)
    row = {r["Method"]: r for r in seeds.rows(res)}["Manual All-Reduce"]
    assert row["Final validation loss (nats/token, 95% CI)"].startswith("2.960 (")
    assert row["Reached"] == "0 of 3"
    line = seeds.verdict(res, "allreduce", "ddp", 2.9)
    assert "did not reach 2.900 nats/token in 3 of 3 seeds" in line
    assert "validation loss worse: 2.960 nats/token vs Baseline DDP 2.800 nats/token (+0.160 nats/token)" in line
    assert not FORBIDDEN.search(line)


def test_the_explorer_and_the_runs_index_use_the_workloads_words(tmp_path):
    from labkit.runs import explore, runs_index

    write_run(tmp_path / "runs" / "2026-01-01_00-00-00_lm", {m: lm_doc(m, v) for m, v in LOSSES.items()})
    runs = explore.load_runs([tmp_path / "runs" / "2026-01-01_00-00-00_lm"])
    table = explore.comparison_table(runs)
    assert "<th>avg throughput (tokens/s)</th>" in table and "<th>best val loss (nats/token)</th>" in table
    assert not FORBIDDEN.search(table)
    assert "val_perplexity" in explore.available_metrics(runs)
    assert "val_accuracy" not in explore.available_metrics(runs)
    assert explore.metric_label("train_throughput", runs) == "training throughput (tokens/s)"
    index = runs_index.text(runs_index.scan(tmp_path / "runs"))
    assert "Baseline DDP tokens/s" in index and not FORBIDDEN.search(index)


def image_doc(method: str, accs: list[float], described: bool) -> dict:
    """The guide's image classification, with or without the workload the lab now records."""
    d = lm_doc(method, [1.0 - a / 100 for a in accs])
    d.pop("examples")
    for e, a in zip(d["epochs"], accs):
        e.update(train_accuracy=a - 1, val_accuracy=a, train_throughput=e["train_throughput"] / UNITS)
        e.pop("val_perplexity")
    d["summary"] = {"best_val_accuracy": max(accs), "final_val_accuracy": accs[-1]}
    d["workload"] = {"name": "images", "title": "image classification", "unit": "images",
                     "rate": "img/s", "units_per_sample": 1,
                     "figures": [{"key": "val_accuracy", "label": "validation accuracy", "unit": "%",
                                  "higher_is_better": True, "short": "acc"},
                                 {"key": "val_loss", "label": "validation loss", "unit": "",
                                  "higher_is_better": False, "short": "loss"}],
                     "optimizer": "SGD (momentum, weight decay)", "flops_rule": "x3", "references": {}}
    if not described:
        d.pop("workload")
    return d


def test_an_images_run_reads_the_same_with_or_without_its_workload(tmp_path):
    accs = {"ddp": [60.0, 80.0, 90.0], "allreduce": [70.0, 85.0, 89.0], "ps": [50.0, 60.0, 70.0]}
    said = {}
    for described in (False, True):
        d = write_run(tmp_path / f"img-{described}", {m: image_doc(m, a, described) for m, a in accs.items()})
        res = report.load_run(d)
        assert res.view.guide and res.view.rate == "img/s"
        said[described] = (report.text_report(res).replace(str(d), "RUN"), report.summary_lines(res),
                           report.discussion(res))
    assert said[True] == said[False]
    text = said[True][0]
    assert "Avg throughput (img/s)" in text and "Best accuracy (%)" in text
    assert "Time to 85.50% validation accuracy" in " ".join(said[True][1])  # 95% of the best, 90%
    assert "tokens" not in text and "What the model wrote" not in text


def test_a_language_models_captions_stay_three_lines(tmp_path):
    """The captions worded for a loss, their fields filled as this run fills them, keep the
    captions' limit (labkit.report.captions.MAX_CHARS)."""
    from labkit.report.captions import MAX_CHARS

    res = lm_run(tmp_path)
    for key in TABLES:
        text = report.caption(key, res.view, target=report.target_text(res), drop=5)
        plain = re.sub(r"\[([^]]*)\]\([^)]*\)", r"\1", text).replace("*", "").replace("`", "")
        assert len(plain) <= MAX_CHARS, (key, len(plain))
    assert "lowest validation loss" in report.caption("comparison", res.view)


def test_the_bench_counts_throughput_in_the_workloads_units():
    """A bench job of the language model: its throughput in tokens/s (samples x tokens per
    sample over the median step), said with its rate; a job without the keys is the guide's
    img/s, as bench files before workloads are."""
    from labkit.bench import bench_view

    def job(**extra):
        return {"variant": "ddp", "method": "ddp", "nproc": 2, "trainers": 2, "global_batch": 64,
                "step_time": {"median": 0.5, "min": 0.4, "max": 0.6},
                "compute_time": {"median": 0.4}, "grad_bytes": 1000, **extra}

    lm = bench_view.derive(job(units_per_sample=64, rate="tokens/s"))
    assert lm["throughput"] == 64 * 64 / 0.5
    assert "tokens/s" in bench_view.summary_line(lm)
    old = bench_view.derive(job())
    assert old["throughput"] == 64 / 0.5 and "img/s" in bench_view.summary_line(old)


def test_the_runs_index_shows_the_workload_where_runs_differ_in_it():
    """A run folder from before workloads trained the guide's images: beside an lm run, the
    index's changed parameters include the workload, images against lm."""
    from labkit.runs.runs_index import Row, changed, row_params

    old = row_params({"train": {"epochs": 2, "model": "resnet10_small"}})
    new = row_params({"train": {"epochs": 2, "workload": "lm"}})
    assert old["workload"] == "images" and new["workload"] == "lm"
    rows = [Row(name="a", path="a", params=old), Row(name="b", path="b", params=new)]
    assert "workload" in changed(rows)
