"""labkit report: the guide's tables, five plots and text report, from the lab's result files
or from files that carry only the guide's keys; problems are named, results never modified."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest
from PIL import Image

from labkit import report

PLOTS = ["throughput_comparison", "training_time_comparison", "loss_curves", "accuracy_curves",
         "communication_overhead"]


def guide_epoch(i, thr, extra=None):
    """One epoch with exactly the guide's keys (its example values, varied per epoch)."""
    e = {"epoch": i, "train_loss": 0.5234 / i, "train_accuracy": 85.23 + i, "train_time": 300.5 - i,
         "train_throughput": thr + i, "avg_batch_time": 0.125, "val_loss": 0.4567 / i,
         "val_accuracy": 87.45 + i}
    return {**e, **(extra or {})}


@pytest.fixture
def guide_dir(tmp_path):
    """Result files as the original scripts wrote them: only the guide's keys."""
    d = tmp_path / "guide"
    d.mkdir()
    common = {"world_size": 4, "batch_size": 64, "start_time": "2025-12-12 10:00:00",
              "end_time": "2025-12-12 10:15:00"}
    files = {
        "results_baseline_ddp.json": {
            "method": "Baseline DDP (PyTorch)", **common,
            "epochs": [guide_epoch(i, 512.3) for i in (1, 2)],
            "summary": {"avg_train_throughput": 510.2, "avg_train_time_per_epoch": 305.3,
                        "best_val_accuracy": 88.67},
            "all_losses": [0.9, 0.7, 0.5, 0.4]},
        "results_all_reduce.json": {
            "method": "Manual All-Reduce", **common,
            "epochs": [guide_epoch(i, 480.0, {"avg_comm_time": 0.02, "all_losses": [0.9, 0.6]}) for i in (1, 2)],
            "summary": {"avg_train_throughput": 459.18, "avg_train_time_per_epoch": 320.0,
                        "best_val_accuracy": 88.1, "final_train_accuracy": 87.0},
            "all_losses": [0.9, 0.6, 0.5, 0.45]},
        "results_ps.json": {
            "method": "Parameter Server (PS)", **common, "num_workers": 3,
            "epochs": [guide_epoch(i, 300.0, {"avg_comm_time_pull": 0.03, "avg_comm_time_push": 0.05})
                       for i in (1, 2)],
            "summary": {"avg_train_throughput": 255.1, "avg_train_time_per_epoch": 400.0,
                        "best_val_accuracy": 86.0, "avg_comm_time_pull": 0.03, "avg_comm_time_push": 0.05},
            "all_losses": [1.0, 0.8, 0.7, 0.6]},
    }
    for name, doc in files.items():
        (d / name).write_text(json.dumps(doc))
    return d


def labkit_report(args, cwd):
    return subprocess.run([sys.executable, "-m", "labkit", "report", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def digests(d):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.glob("results_*.json"))}


def check_pngs(plots_dir):
    for name in PLOTS:
        p = plots_dir / f"{name}.png"
        assert p.stat().st_size > 0, name
        with Image.open(p) as im:
            im.verify()
        with Image.open(p) as im:
            colours = im.convert("RGB").getcolors(maxcolors=1_000_000)
            assert colours is None or len(colours) > 20, f"{name} looks blank"


def test_report_from_guide_only_files(guide_dir, tmp_path):
    before = digests(guide_dir)
    out = tmp_path / "analysis"
    p = labkit_report([str(guide_dir), "--out", str(out)], cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    # the terminal shows both tables, with speedups computed from the files' own summaries
    assert "Avg throughput (img/s)" in p.stdout and "Speedup vs DDP" in p.stdout
    assert "1.00x (baseline)" in p.stdout
    assert f"{459.18 / 510.2:.2f}x" in p.stdout and f"{255.1 / 510.2:.2f}x" in p.stdout
    assert "Param pull (ms)" in p.stdout and "(inside PyTorch)" in p.stdout
    assert "80.00" in p.stdout  # PS total comm = 30 + 50 ms
    check_pngs(out / "plots")
    text = (out / "performance_report.txt").read_text()
    assert "Performance comparison" in text and "Communication time per training step" in text
    assert "Baseline DDP was fastest" in text
    assert digests(guide_dir) == before  # results are only read


def test_report_without_out_writes_like_the_guide(guide_dir):
    """As analyze_results.py: plots/ and performance_report.txt in the current folder."""
    p = labkit_report(["results_baseline_ddp.json", "results_ps.json"], cwd=guide_dir)
    assert p.returncode == 0, p.stderr
    check_pngs(guide_dir / "plots")
    assert (guide_dir / "performance_report.txt").exists()


def test_corrupt_and_missing_files_are_named(guide_dir, tmp_path):
    full = (guide_dir / "results_all_reduce.json").read_text()
    (guide_dir / "results_all_reduce.json").write_text(full[: len(full) // 2])  # truncated
    (guide_dir / "results_ps.json").write_text(json.dumps({"hello": "world"}))  # another schema
    out = tmp_path / "analysis"
    p = labkit_report([str(guide_dir), "--out", str(out)], cwd=tmp_path)
    assert p.returncode == 1  # rendered, but something is wrong
    assert "results_all_reduce.json: not valid JSON" in p.stdout
    assert "results_ps.json: not a result file" in p.stdout
    check_pngs(out / "plots")  # the rest still renders
    text = (out / "performance_report.txt").read_text()
    assert "not valid JSON" in text and "Baseline DDP" in text


def test_failed_run_keeps_finished_epochs_in_the_report(guide_dir, tmp_path):
    doc = json.loads((guide_dir / "results_ps.json").read_text())
    doc.update(status="failed", error="RuntimeError: rank 2 died")
    doc["epochs"] = doc["epochs"][:1]
    (guide_dir / "results_ps.json").write_text(json.dumps(doc))
    res = report.load_run(guide_dir)
    assert "ps" in res.ok and "status failed" in res.problems["ps"]
    rows = report.comparison_rows(res)
    assert [r["Method"] for r in rows] == ["Baseline DDP", "Manual All-Reduce", "Parameter Server"]


def test_nothing_to_report_is_one_message(tmp_path):
    p = labkit_report([str(tmp_path)], cwd=tmp_path)
    assert p.returncode == 2 and "no result files" in p.stderr and "Traceback" not in p.stderr
    p = labkit_report([str(tmp_path / "nope")], cwd=tmp_path)
    assert p.returncode == 2 and "does not exist" in p.stderr


def test_implementation_section_quotes_the_current_source():
    md = report.implementation_markdown()
    from labkit.sync import ps
    src = open(ps.__file__).read()
    for line in ("dist.broadcast(self.flat_params[lo:hi], src=s, group=g, async_op=True)",
                 "self.pushes.append(dist.reduce(t, dst=s, op=dist.ReduceOp.SUM, group=g, async_op=True))",
                 "def _await_layer(self, buckets: list[int], module, args) -> None:"):
        assert line in src, line  # guard: the quote is real code
        assert line in md, line   # and the report shows it
    assert "register_post_accumulate_grad_hook" not in md or "_grad_ready" in md


def test_every_quoted_function_has_exactly_one_marker(tmp_path, monkeypatch):
    """The implementation section quotes by ``# report-quote: NAME`` markers: each name it
    uses is marked once, above a function; a missing marker is an error, not a silent gap."""
    from labkit.report import implementation as impl

    found = impl.find_quotes()
    for name in impl.QUOTES:
        assert len(found.get(name, [])) == 1, name
        assert impl.quote(name, found).lstrip().startswith(("def ", "@")), name
    assert set(found) == set(impl.QUOTES)  # no stray marker either
    with pytest.raises(impl.QuoteError, match="'no-such-quote'"):
        impl.quote("no-such-quote", found)


def test_captions_are_numbered_once():
    numbers = [c.number for c in report.CAPTIONS.values()]
    assert len(numbers) == len(set(numbers))
    assert [n for n in numbers if n.startswith("Table")] == [f"Table {i}" for i in range(1, 7)]
    assert [n for n in numbers if n.startswith("Figure")] == [f"Figure {i}" for i in range(1, 9)]
    assert all(p in report.CAPTIONS for p in report.PLOTS)  # every plot has its caption
