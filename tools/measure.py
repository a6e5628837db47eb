"""Run a command and report its wall time and the peak memory of its whole process tree.

    python tools/measure.py [--interval S] -- COMMAND [ARGS...]

Memory is sampled from /proc (Linux) every ``--interval`` seconds over the command and all its
descendants (torchrun agents, ranks, Jupyter kernels, Chromium). Two sums are reported:
RSS (resident pages, shared libraries counted once per process, so it overstates) and PSS
(proportional set size, shared pages divided among the processes sharing them: the tree's real
footprint). Used for the README's performance figures; the command's output passes through.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        kids.setdefault(ppid, []).append(int(d))
    return kids


def tree(root: int) -> list[int]:
    kids, out, todo = _children(), [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += kids.get(pid, [])
    return out


def memory_kib(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of one process in KiB; (0, 0) when it is gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line and not line[0].isdigit())
        return int(fields["Rss"].split()[0]), int(fields["Pss"].split()[0])
    except (OSError, KeyError, ValueError):
        return 0, 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--interval", type=float, default=0.5, help="seconds between samples (0.5)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    a = p.parse_args(argv)
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        p.error("no command given (put it after --)")
    peak = {"rss": 0, "pss": 0, "procs": 0}
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd)
    done = threading.Event()

    def sample() -> None:
        while not done.wait(a.interval):
            pids = tree(proc.pid)
            mem = [memory_kib(pid) for pid in pids]
            peak["rss"] = max(peak["rss"], sum(m[0] for m in mem))
            peak["pss"] = max(peak["pss"], sum(m[1] for m in mem))
            peak["procs"] = max(peak["procs"], len(pids))

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        rc = proc.wait()
    except KeyboardInterrupt:
        proc.wait()
        rc = 130
    done.set()
    t.join()
    wall = time.monotonic() - t0
    print(f"measure: exit {rc} | wall {wall:.1f} s ({int(wall // 60)} min {wall % 60:.0f} s) | "
          f"peak memory of the process tree: PSS {peak['pss'] / 2**20:.2f} GiB, "
          f"RSS sum {peak['rss'] / 2**20:.2f} GiB | up to {peak['procs']} processes",
          file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
