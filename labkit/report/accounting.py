"""Where an experiment's wall time went, per method: the lab's own time beside training's.

Three clocks, all seconds since the epoch on the machine that ran them: experiment.json's entry
of each method (papermill's start and end: ``started_at``, ``ended_at``), the method's launch
file (torchrun's start and end, labkit.launch.torchrun_job.LaunchResult.times) and rank 0's
result file (``timeline``: its process's start, its end, and the seconds of each phase the
Trainer went through, labkit.training.trainer.Trainer.timeline). Each phase below is the
difference of two of them, so the phases add up to the method's wall time exactly; a method
whose files lack a clock (an older run, one that failed before its first step) has no account.

    account(run_folder)  ->  {method: {phase: seconds, ..., "total": s}}
    account_rows(accounts)  ->  the rows the terminal and the report print
    summary_lines(run, accounts)  ->  the lines under them (the experiment's start, its methods,
                                      its report, its whole wall time)
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from labkit.core import layout
from labkit.core.run_folder import RunFolder

#: (key, what the row says), in the order the time is spent
PHASES = (
    ("kernel", "notebook kernel start (papermill, the kernel, its imports, the checks)"),
    ("agent", "torchrun agent, rendezvous and the warm process's imports"),
    ("rank", "rank start (data, model, process group)"),
    ("setup", "method set-up before the first step"),
    ("train", "training epochs"),
    ("validation", "validation and replica checks"),
    ("checkpoint", "checkpoints"),
    ("calibration", "calibration (compute-only steps)"),
    ("final", "final model, what the run shows, result file"),
    ("rank_end", "ranks' and agent's end"),
    ("notebook_end", "notebook's end (saving the executed notebook)"),
)
#: the Trainer's phases (its ``doing``) and the row each is charged to
_TRAINER = {"start": "setup", "train": "train", "validation": "validation",
            "checkpoint": "checkpoint", "calibration": "calibration", "final": "final"}


def method_account(entry: dict, launch: dict, timeline: dict) -> Optional[dict]:
    """One method's phases in seconds (and ``total``), from its experiment entry, launch file
    and rank 0's timeline; None when a clock is missing."""
    try:
        t0, t_end = float(entry["started_at"]), float(entry["ended_at"])
        l0, l_end = float(launch["started_at"]), float(launch["ended_at"])
        r0, r_end = float(timeline["process_start"]), float(timeline["now"])
        spent = {k: float(v) for k, v in timeline["spent"].items()}
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    acc = dict.fromkeys((k for k, _ in PHASES), 0.0)
    for phase, s in spent.items():
        row = _TRAINER.get(phase, "final")  # a phase of a newer Trainer: with the end
        acc[row] += s
    acc["kernel"] = l0 - t0
    acc["agent"] = r0 - l0
    acc["rank"] = (r_end - r0) - sum(spent.values())
    acc["rank_end"] = l_end - r_end
    acc["notebook_end"] = t_end - l_end
    acc["total"] = t_end - t0
    return acc


def account(run: Path) -> dict[str, dict]:
    """Each method of the experiment in folder ``run`` that can be accounted (one repeat: the
    first), in the order they ran."""
    exp = RunFolder(run).get(layout.EXPERIMENT) or {}
    out: dict[str, dict] = {}
    for m, entry in (exp.get("methods") or {}).items():
        entry = (entry.get("repeats") or [entry])[0]
        mdir = layout.method_dir(Path(run), m, entry.get("repeat", 1), exp.get("repeats", 1))
        launch = RunFolder(mdir).get(layout.launch_file()) or {}
        result = _result(mdir)
        acc = method_account(entry, launch, (result or {}).get("timeline") or {})
        if acc is not None:
            out[m] = acc
    return out


def _result(mdir: Path) -> Optional[dict]:
    """Rank 0's result file in a method's folder (its timeline is all this module reads)."""
    for path in sorted(mdir.glob("results_*.json")):
        doc = RunFolder(mdir).get(path.name)
        if isinstance(doc, dict):
            return doc
    return None


#: the rows of the guide's epoch: training, then validation and the checkpoint (issue 70 measured
#: "the epochs' train and validation time over each method's wall time")
EPOCH = ("train", "validation", "checkpoint")


def training_share(acc: dict) -> float:
    """The share of the method's wall time that was training epochs."""
    return acc["train"] / acc["total"] if acc.get("total") else float("nan")


def epochs_share(acc: dict) -> float:
    """The share of the method's wall time that was the guide's epochs: training, validation
    and replica checks, checkpoints."""
    return sum(acc[k] for k in EPOCH) / acc["total"] if acc.get("total") else float("nan")


def account_rows(accounts: dict[str, dict]) -> list[dict]:
    """One row per phase, a column per method (seconds), then the total and training's share."""
    rows = [{"where the time went": what, **{m: f"{a[k]:.1f}" for m, a in accounts.items()}}
            for k, what in PHASES]
    rows.append({"where the time went": "total (s)",
                 **{m: f"{a['total']:.1f}" for m, a in accounts.items()}})
    rows.append({"where the time went": "share that was training",
                 **{m: f"{training_share(a):.0%}" for m, a in accounts.items()}})
    rows.append({"where the time went": "share that was the epochs (with validation, checkpoints)",
                 **{m: f"{epochs_share(a):.0%}" for m, a in accounts.items()}})
    return rows


def all_methods_line(accounts: dict[str, dict]) -> str:
    """One line over every method: their wall time, training's share of it and the epochs'."""
    total = sum(a["total"] for a in accounts.values())
    train = sum(a["train"] for a in accounts.values())
    epochs = sum(a[k] for a in accounts.values() for k in EPOCH)
    return (f"{len(accounts)} method{'s' if len(accounts) != 1 else ''}: {total:.1f} s, of which "
            f"training epochs {train:.1f} s ({train / total:.0%}), with validation and "
            f"checkpoints {epochs:.1f} s ({epochs / total:.0%})" if total else "")


def account_text(run: Path) -> str:
    """The table and its line, as the terminal's end of ``labkit experiment`` prints them
    ("" when no method can be accounted)."""
    from labkit.core.texttable import text_table

    accounts = account(run)
    if not accounts:
        return ""
    table = text_table(account_rows(accounts), right=True)
    return "where each method's wall time went (s):\n" + table + "\n" + "\n".join(
        summary_lines(run, accounts))


def summary_lines(run: Path, accounts: dict[str, dict]) -> list[str]:
    """Below the table: the experiment's start, its methods (all_methods_line), its report and
    its whole wall time, each where experiment.json has it (the report, made before the
    experiment ends, has no whole yet)."""
    exp = RunFolder(run).get(layout.EXPERIMENT) or {}
    lines = [all_methods_line(accounts)]
    if isinstance(exp.get("start_s"), (int, float)):
        lines.insert(0, f"before the first method (inputs checked, run folder made, the warm "
                        f"process's imports): {exp['start_s']:.1f} s")
    if isinstance(exp.get("report_s"), (int, float)):
        lines.append(f"then the report, {exp['report_s']:.1f} s")
    if isinstance(exp.get("wall_s"), (int, float)) and exp["wall_s"] > 0:
        lines.append(in_all_line(accounts, exp["wall_s"]))
    return lines


def in_all_line(accounts: dict[str, dict], wall_s: float) -> str:
    """The experiment's whole wall time (its start, every method, the report) and the share of
    it that was training epochs, and the epochs with validation and checkpoints."""
    train = sum(a["train"] for a in accounts.values())
    epochs = sum(a[k] for a in accounts.values() for k in EPOCH)
    return (f"the experiment in all: {wall_s:.1f} s, of which training epochs {train / wall_s:.0%}, "
            f"with validation and checkpoints {epochs / wall_s:.0%}")
