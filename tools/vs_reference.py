"""labkit's DDP against torchvision's reference classification script, on the same job.

    python tools/vs_reference.py REFERENCE_DIR [--rounds 8] [--epochs 3] [--data DIR] [--out DIR]

REFERENCE_DIR is references/classification of torchvision's source release (not shipped with
labkit: Debian's source package pytorch-vision carries it, e.g. `apt-get source --download-only
pytorch-vision` with a deb-src line, or a clone of github.com/pytorch/vision at the tag).

The job (issue 41): an image folder of 512 training and 64 validation JPEGs in 10 classes
(made with tools/make_jpeg_folder.py unless --data names one), resnet18 from scratch, 2
processes under torchrun with gloo on the CPU, batch 16 per process, 1 loader worker each, the
same number of epochs (so the same 16 steps per epoch). labkit runs as a user runs it
(`labkit run ddp`, its defaults otherwise); the reference runs unchanged but for what a CPU and
gloo need (tools/reference_rank.py).

Rounds alternate which of the two goes first. Each round compares the training loop's wall time
of the epochs after the first (labkit's result file's train_time; the reference's
train_one_epoch, timed around the call): labkit ÷ reference in throughput is the reference's time
over labkit's. The figure is the geometric mean over the rounds with its 95% t-interval on the
logs (labkit.core.stats.t_interval); each run's whole wall time is printed beside it.
The same ratio of the two programs' median step (each epoch's steps after labkit's
``--warmup-steps``, from labkit's step_parts and the reference's step ends,
tools/reference_rank.py) is given beside it: it discounts a slow spell shorter than an epoch,
not a machine slower for the minutes of a whole run (docs/performance-log.md, VM G).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
JOB = {"model": "resnet18", "batch": 16, "workers": 1, "nproc": 2}


def _run(name: str, cmd: list[str], log: Path, cwd: Path) -> float:
    t0 = time.perf_counter()
    with open(log, "w") as f:
        p = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=cwd)
    if p.returncode:
        raise SystemExit(f"vs_reference: {name} failed (exit {p.returncode}); see {log}")
    return time.perf_counter() - t0


def run_labkit(data: Path, epochs: int, out: Path, extra: list[str]) -> tuple[list[float], list, float, int]:
    cmd = [sys.executable, "-m", "labkit", "run", "ddp", "--nproc", str(JOB["nproc"]),
           "--dataset", "imagefolder", "--data-dir", str(data), "--model", JOB["model"],
           "--batch-size", str(JOB["batch"]), "--workers", str(JOB["workers"]),
           "--epochs", str(epochs), "--out", str(out), *extra]
    wall = _run("labkit run ddp", cmd, out.with_suffix(".log"), HERE.parent)
    doc = json.loads((out / "results_baseline_ddp.json").read_text())
    # each timed step (the warm-up steps are not in step_parts): its parts added up
    steps = [[sum(p) for p in zip(*e["step_parts"].values())] for e in doc["epochs"]]
    return [e["train_time"] for e in doc["epochs"]], steps, wall, doc["config"]["warmup_steps"]


def run_reference(ref: Path, data: Path, epochs: int, out: Path) -> tuple[list[float], list, float]:
    out.mkdir(parents=True)
    times = out / "epoch_times.json"
    # --log-dir: torchrun's error files stay with the run (by default a folder left in /tmp)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--log-dir",
           str(out / "torchrun"), "--nproc-per-node", str(JOB["nproc"]),
           str(HERE / "reference_rank.py"), str(ref),
           str(times), "--", "--data-path", str(data), "--model", JOB["model"],
           "--batch-size", str(JOB["batch"]), "--workers", str(JOB["workers"]),
           "--epochs", str(epochs), "--device", "cpu", "--output-dir", str(out)]
    wall = _run("the reference script", cmd, out / "train.log", out)
    doc = json.loads(times.read_text())
    return doc["epoch_times"], doc["step_times"], wall


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("reference", type=Path, help="torchvision's references/classification folder")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--epochs", type=int, default=3, help="epochs per run (the first is warm-up)")
    p.add_argument("--data", type=Path, help="an image folder (default: made under --out)")
    p.add_argument("--out", type=Path, default=Path("runs") / "vs_reference")
    p.add_argument("--labkit-flags", default="", help="more flags for labkit run, e.g. "
                   "\"--no-pin-cpus\" (to find where a gap lies)")
    a = p.parse_args(argv)
    if not (a.reference / "train.py").is_file() or not (a.reference / "utils.py").is_file():
        print(f"vs_reference: {a.reference} is not torchvision's references/classification "
              f"(no train.py and utils.py there)", file=sys.stderr)
        return 2
    if a.epochs < 2 or a.rounds < 2:
        print("vs_reference: --epochs and --rounds must be 2 or more", file=sys.stderr)
        return 2
    out = a.out.resolve() / time.strftime("%Y-%m-%d_%H-%M-%S")
    out.mkdir(parents=True)
    data = a.data
    if data is None:
        data = out / "data"
        subprocess.run([sys.executable, str(HERE / "make_jpeg_folder.py"), str(data), "--train",
                        "512", "--val", "64", "--classes", "10"], check=True, capture_output=True)
    from labkit.core import stats

    rounds = []
    for r in range(a.rounds):
        got = {}
        for who in (("labkit", "reference") if r % 2 == 0 else ("reference", "labkit")):
            got[who] = (run_labkit(data, a.epochs, out / f"labkit_{r}", a.labkit_flags.split()) if who == "labkit" else
                        run_reference(a.reference.resolve(), data, a.epochs, out / f"reference_{r}"))
        (lk, lk_steps, lk_wall, warmup), (ref, ref_steps, ref_wall) = got["labkit"], got["reference"]
        ref_steps = [e[warmup:] for e in ref_steps]  # as labkit's step_parts leave them out
        ratio = sum(ref[1:]) / sum(lk[1:])
        # a step's median discounts a slow spell within the epoch, as an epoch's sum does not
        step_ratio = float(np.median(sum(ref_steps[1:], [])) / np.median(sum(lk_steps[1:], [])))
        rounds.append({"labkit_epochs": lk, "reference_epochs": ref, "labkit_wall": lk_wall,
                       "reference_wall": ref_wall, "ratio": ratio, "labkit_steps": lk_steps,
                       "reference_steps": ref_steps, "step_ratio": step_ratio})
        print(f"round {r + 1}: epochs 2-{a.epochs}: labkit {sum(lk[1:]):.2f} s, reference "
              f"{sum(ref[1:]):.2f} s, labkit / reference {ratio:.3f}; median step "
              f"{np.median(sum(lk_steps[1:], [])):.3f} s and {np.median(sum(ref_steps[1:], [])):.3f} s, "
              f"{step_ratio:.3f}; whole runs {lk_wall:.1f} s and {ref_wall:.1f} s", flush=True)
    iv = stats.t_interval(np.log([x["ratio"] for x in rounds]), stats.CONFIDENCE, np.exp, "rounds")
    sv = stats.t_interval(np.log([x["step_ratio"] for x in rounds]), stats.CONFIDENCE, np.exp, "rounds")
    line = (f"labkit DDP / torchvision's reference script, throughput of epochs 2-{a.epochs}, "
            f"{a.rounds} alternating rounds: geometric mean {iv.value:.3f}, 95% CI "
            f"{iv.low:.3f}-{iv.high:.3f}; by the median step {sv.value:.3f}, 95% CI "
            f"{sv.low:.3f}-{sv.high:.3f}")
    print(line)
    doc = {"job": JOB, "labkit_flags": a.labkit_flags, "epochs": a.epochs, "data": str(data), "reference": str(a.reference),
           "rounds": rounds, "geomean": [iv.value, iv.low, iv.high],
           "median_step": [sv.value, sv.low, sv.high], "summary": line}
    tmp = out / "vs_reference.json.tmp"
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, out / "vs_reference.json")
    print(f"written: {out / 'vs_reference.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
