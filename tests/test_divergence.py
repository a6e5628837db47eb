"""Training that goes wrong without crashing (issue 28): a loss that diverges and replicas that
drift apart stop the run with one line and a failed, strict-JSON result file; unperturbed runs
say their replicas were identical after every epoch; readers take nulls and old NaN files."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from helpers import TINY, check_ok, labkit
from warm import warm_run


def reject(token: str):
    raise ValueError(f"not strict JSON: {token}")


def strict(path: Path) -> dict:
    """The file parsed as strict JSON (NaN, Infinity and -Infinity refused)."""
    return json.loads(Path(path).read_text(), parse_constant=reject)


def all_strict(folder: Path) -> list[Path]:
    """Every *.json under ``folder`` parses strictly; returns them."""
    files = sorted(Path(folder).rglob("*.json"))
    for f in files:
        strict(f)
    return files


def result_of(out: Path) -> dict:
    return strict(next(Path(out).glob("results_*.json")))


# ------------------------------------------------------------------ a loss that diverges
def test_a_learning_rate_that_diverges_fails_in_one_line(tmp_path):
    """The issue's command: exit 1, one line with epoch and step, no traceback, strict JSON."""
    out = tmp_path / "ddp"
    p = labkit(["run", "ddp", "--nproc", "2", "--lr", "1000", "--epochs", "2",
                "--max-steps-per-epoch", "6", "--batch-size", "16",
                "--no-progress", "--no-pin-cpus", "--timeout", "120", "--out", str(out)], tmp_path)
    assert p.returncode == 1, p.stdout + p.stderr
    lines = [l for l in p.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("labkit: ddp failed: the loss diverged at epoch 1, step 6 of 6"), lines
    assert "lr 1000" in lines[0] and "--lr" in lines[0]
    assert "Traceback" not in p.stdout + p.stderr and 'File "' not in p.stdout + p.stderr
    assert "diverged" not in p.stdout  # said once, on stderr
    all_strict(out)  # the result file, launch.json
    # the command ran forked beside the worker's warm process, as under `labkit warm`
    # (labkit.cli._run_warm), and said the same one line
    assert strict(out / "launch.json")["launched_from"] == "warm process"
    r = result_of(out)
    assert r["status"] == "failed" and "diverged" in r["error"]
    assert r["diverged"]["epoch"] == 1 and r["diverged"]["step"] == 6
    assert r["diverged"]["val_loss"] is None and r["diverged"]["value"] == "nan"
    assert r["epochs"] == []  # the diverged epoch is not kept as a result
    assert "diverged" in (out / "train.log").read_text()


def perturbed_run(tmp_path, method: str, nproc: int, perturb: str):
    """2 epochs of 3 steps with LABKIT_TEST_PERTURB=<method>:<perturb>: it fails (exit != 0) and
    the ranks say it in exactly one line; returns the run folder and that line."""
    out = tmp_path / method
    p = warm_run(nproc, TINY + ["--method", method, "--epochs", "2", "--max-steps-per-epoch", "3",
                                "--out", str(out)], tmp_path,
                 env={"LABKIT_TEST_PERTURB": f"{method}:{perturb}"})
    assert p.returncode != 0
    said = [l for l in p.stderr.splitlines() if "labkit.train: error:" in l]
    assert len(said) == 1, p.stderr[-3000:]
    return out, said


@pytest.mark.slow  # not in make test-fast (not a method's exactness or bytes)
def test_a_loss_that_turns_nan_stops_at_its_step_keeping_the_epochs_before(tmp_path):
    """A NaN weight on one parameter-server worker before global step 4 (epoch 2, step 2 of
    3): the method stops at that step, epoch 1 is kept, and every rank, the server too, ends
    alike (no hang)."""
    method, nproc, rank = "ps", 3, 1
    out, said = perturbed_run(tmp_path, method, nproc, f"{rank}:4:nan")
    assert f"{method} failed: the loss diverged at epoch 2, step 2 of 3 (training loss nan" in said[0]
    r = result_of(out)
    assert r["status"] == "failed" and [e["epoch"] for e in r["epochs"]] == [1]
    assert r["diverged"]["global_step"] == 5 and r["diverged"]["of"] == "train_loss"
    losses = r["diverged"]["train_losses"]
    assert math.isfinite(losses[0]) and losses[1] is None  # null where not a number
    assert r["epochs"][0]["replicas"]["identical"] is True


# ------------------------------------------------------------------ replicas that drift apart
@pytest.mark.slow  # not in make test-fast (not a method's exactness or bytes)
@pytest.mark.parametrize("method,nproc,rank", [("ddp", 2, 1), ("allreduce", 2, 1), ("ps", 3, 2)])
def test_a_perturbed_replica_is_named_at_the_end_of_its_epoch(tmp_path, method, nproc, rank):
    """One ulp in one element of one rank's first parameter, before global step 4 (epoch 2):
    the check at the end of epoch 2 names that rank and tensor; epoch 1 was identical."""
    out, said = perturbed_run(tmp_path, method, nproc, f"{rank}:4")
    assert (f"{method} failed: replicas diverged at the end of epoch 2: rank {rank} holds another "
            f"conv1.weight than rank 0") in said[0], said
    r = result_of(out)
    assert r["status"] == "failed" and "replicas diverged" in r["error"]
    bad = r["replicas_differ"]
    assert (bad["epoch"], bad["rank"], bad["tensor"]) == (2, rank, "conv1.weight")
    assert bad["tensors_differing"] == 1 and bad["sum"] != bad["reference_sum"]
    assert [e["epoch"] for e in r["epochs"]] == [1] and r["epochs"][0]["replicas"]["identical"]


@pytest.mark.xdist_group("equivalence_runs")  # the session's runs, built once on one worker
def test_unperturbed_runs_say_identical_after_every_epoch(equivalence_runs):
    from labkit import report

    for name, (out, _) in equivalence_runs.items():
        r = result_of(out)
        assert r["status"] == "completed", name
        for e in r["epochs"]:
            rep = e["replicas"]
            assert rep["identical"] is True and rep["tensors"] > 0 and rep["seconds"] >= 0, name
            assert rep["ranks"] == (3 if name.startswith("ps") else 2), name
        assert f"replicas identical after epoch {len(r['epochs'])}" in report.text_report(
            report.load_files([next(Path(out).glob("results_*.json"))]))
        all_strict(out)


@pytest.mark.slow  # not in make test-fast (not a method's exactness or bytes)
def test_no_check_replicas_turns_the_check_off(tmp_path):
    out = tmp_path / "ddp"
    check_ok(warm_run(2, TINY + ["--method", "ddp", "--max-steps-per-epoch", "2",
                                 "--calibrate-steps", "0", "--no-check-replicas", "--out", str(out)],
                      tmp_path, env={"LABKIT_TEST_PERTURB": "ddp:1:1"}))
    r = result_of(out)
    assert r["status"] == "completed" and "replicas" not in r["epochs"][0]


# ------------------------------------------------------------------ the pieces, in one process
def test_compare_names_the_odd_rank_and_the_first_tensor():
    import torch

    from labkit.training import guards

    ts = [torch.arange(6, dtype=torch.float32), torch.ones(3), torch.tensor(7),
          torch.tensor([True, False, True]), torch.ones(2, dtype=torch.bfloat16)]
    names = ["a", "b", "c", "d", "e"]
    rows = [guards.fingerprint(ts) for _ in range(3)]
    assert guards.compare(names, torch.stack(rows), 1) is None
    odd = [t.clone() for t in ts]
    odd[1][2] = torch.nextafter(odd[1][2], torch.tensor(2.0))  # one ulp
    odd[2] += 1
    table = torch.stack([rows[0], guards.fingerprint(odd), rows[1]])  # rank 1 is the odd one
    bad = guards.compare(names, table, 3)
    assert (bad["rank"], bad["tensor"], bad["reference_rank"], bad["tensors_differing"]) == (1, "b", 0, 2)
    text = guards.mismatch_text({**bad, "sum": 3.0000001, "reference_sum": 3.0})
    assert text.startswith("replicas diverged at the end of epoch 3: rank 1 holds another b and 1 "
                           "more tensor than rank 0 (float64 sums")
    # three ranks, rank 0 the odd one: the copy most ranks hold is the reference
    bad = guards.compare(names, torch.stack([guards.fingerprint(odd), rows[0], rows[1]]), 1)
    assert (bad["rank"], bad["reference_rank"], bad["ranks_differing"]) == (0, 1, 1)
    # the checksum is exact integer arithmetic: independent of the order of summation
    assert guards.fingerprint([ts[0].flip(0)])[0] == guards.fingerprint([ts[0]])[0]


def test_the_gpus_one_pass_checksum_equals_the_per_tensor_one():
    """guards._word_sums_at_once (a GPU's fingerprint) against _word_sum tensor by tensor (a
    CPU's), on the CPU: mixed word sizes, empty tensors, and sums far past 2^32 both ways, so the
    prefix sums wrap. On a GPU, the GPU's fingerprint against the CPU's of the same tensors."""
    import torch

    from labkit.training import guards

    g = torch.Generator().manual_seed(3)
    big = torch.randint(-2 ** 31, 2 ** 31 - 1, (50_000,), generator=g, dtype=torch.int32)
    ts = [torch.randn(1000, generator=g), big.view(torch.float32), torch.tensor(7), torch.zeros(0),
          torch.tensor([True, False, True]), torch.ones(5, dtype=torch.bfloat16),
          torch.full((40_000,), 2 ** 31 - 1, dtype=torch.int32), torch.randn(3, 3, generator=g),
          torch.tensor([3], dtype=torch.uint8), torch.arange(10, dtype=torch.float64)]
    words = [guards._words(t.contiguous().view(-1)) for t in ts]
    one_by_one = torch.stack([guards._word_sum(w) for w in words])
    assert torch.equal(guards._word_sums_at_once(words), one_by_one)
    assert one_by_one[3] == 0 and len(set(one_by_one.tolist())) == len(ts)  # all distinct
    # a wrapped sum: 40,000 x (2^31 - 1) modulo 2^32, as a signed 32-bit word
    assert one_by_one[6] == ((40_000 * (2 ** 31 - 1) + 2 ** 31) % 2 ** 32) - 2 ** 31
    if torch.cuda.is_available():
        assert torch.equal(guards.fingerprint([t.cuda() for t in ts]).cpu(), guards.fingerprint(ts))


def test_every_json_labkit_writes_is_strict(tmp_path):
    from labkit.core.files import atomic_write_json, finite

    doc = {"a": float("nan"), "b": [1.0, float("inf"), -float("inf")], "c": {"d": (2.5, float("nan"))},
           "e": "nan", "f": None, "g": 3}
    path = tmp_path / "x.json"
    atomic_write_json(str(path), doc)
    assert strict(path) == {"a": None, "b": [1.0, None, None], "c": {"d": [2.5, None]}, "e": "nan",
                            "f": None, "g": 3}
    assert finite(doc)["b"] == [1.0, None, None] and math.isnan(doc["a"])  # doc unchanged


def old_style_result(tmp_path: Path) -> Path:
    """A result file as labkit wrote one before the check: NaN tokens, status completed."""
    from labkit.core.methods import RESULT_FILES

    def epoch(i, losses, val_loss):
        return {"epoch": i, "train_loss": sum(losses) / len(losses), "train_accuracy": 10.0,
                "train_time": 1.0, "train_throughput": 100.0, "avg_batch_time": 0.1,
                "val_loss": val_loss, "val_accuracy": 10.0, "all_losses": losses}

    ep = [epoch(1, [2.3, 1.1e17], float("nan")), epoch(2, [float("nan"), float("nan")], float("nan"))]
    doc = {"method": "Baseline DDP (PyTorch)", "world_size": 2, "batch_size": 16, "epochs": ep,
           "summary": {"avg_train_throughput": 100.0, "best_val_accuracy": 10.0,
                       "final_val_accuracy": 10.0, "avg_train_time_per_epoch": 1.0},
           "all_losses": ep[0]["all_losses"] + ep[1]["all_losses"], "status": "completed"}
    path = tmp_path / RESULT_FILES["ddp"]
    path.write_text(json.dumps(doc))  # Python's default: NaN tokens
    assert "NaN" in path.read_text()
    return path


def test_old_nan_files_and_new_null_files_load_in_the_report_and_explorer(tmp_path):
    from labkit.runs import explore
    from labkit import report

    (tmp_path / "old").mkdir()
    old = old_style_result(tmp_path / "old")
    res = report.load_files([old])
    text = report.text_report(res)
    assert "Baseline DDP: diverged at epoch 1 step 2 (of 2: the validation loss after it is not a number)" in text
    report.write_report(res, tmp_path / "rep_old")
    # the same file written strictly (nulls), as a run folder the explorer lists
    new = tmp_path / "runs" / "2026-11-24_00-00-00" / "ddp"
    new.mkdir(parents=True)
    from labkit.core.files import atomic_write_json
    atomic_write_json(str(new / old.name), json.loads(old.read_text()))
    doc = strict(new / old.name)
    assert doc["epochs"][1]["all_losses"] == [None, None]
    res = report.load_files([new / old.name])
    assert math.isnan(res.docs["ddp"].epochs[1].val_loss)  # read back as NaN
    assert "diverged at epoch 1 step 2" in report.text_report(res)
    report.write_report(res, tmp_path / "rep_new")
    runs = explore.load_runs(explore.find_runs(tmp_path / "runs"))
    rows = explore.comparison_rows(runs)
    assert rows[0]["health"].startswith("diverged at epoch 1 step 2")
    assert "diverged at epoch 1" in explore.comparison_table(runs)
    explore.plot_overlay(runs, "all_losses")
    explore.plot_overlay(runs, "val_loss")


def test_the_launcher_shows_a_failed_runs_line_alone(tmp_path):
    from labkit.launch.failures import explain_failure

    log = tmp_path / "logs" / "run" / "attempt_0" / "0"
    log.mkdir(parents=True)
    (log / "stderr.log").write_text("labkit.train: error: ps failed: replicas diverged at the end "
                                    "of epoch 1: rank 2 holds another fc.bias than rank 0 (...)\n")
    why = explain_failure("ps", 1, "rank: 0 (local_rank: 0)\n  exitcode  : 1\n", str(tmp_path / "logs"))
    assert why.message == ("ps failed: replicas diverged at the end of epoch 1: rank 2 holds "
                           "another fc.bias than rank 0 (...)")
