"""What the test suite starts: every Python process, by kind and by test (issue 40).

The suite is CPU-bound on 2 cores, and nearly all of its CPU goes into the processes its tests
start, each of which imports torch before it does anything. This counts them. Collect, then
read:

    mkdir -p /tmp/census && LABKIT_TEST_CENSUS=/tmp/census make test ARGS="--junitxml=/tmp/census/junit.xml"
    python tools/suite_census.py /tmp/census [--top 25]

tests/hooks/sitecustomize.py writes one line per process start to <folder>/starts.tsv (pid,
parent, the test, the command line). With the junit file beside it, each module's and test's
CPU seconds (tests/conftest.py's cpu_s) are shown beside their processes.
"""
from __future__ import annotations

import argparse
import collections
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

KINDS = ("rank", "warm rank", "torchrun agent", "warm process", "warm client", "labkit command",
         "kernel", "papermill", "loader server", "pytest worker", "other Python")


def kind(argv: str) -> str:
    """The kind of process a command line starts."""
    if "labkit.launch.warm_client" in argv:
        return "warm client"  # a kernel, agent or rank forked by an experiment's warm process
    if re.search(r"-m labkit\.launch\.warm\b", argv):
        return "warm process"  # an experiment's (labkit.launch.warm)
    if ("torch.distributed.run" in argv or "labkit.launch.agent" in argv
            or re.search(r"/torchrun\b", argv)):
        return "torchrun agent"  # torch's, or labkit's with warm ranks (labkit.launch.agent)
    if "multiprocessing.forkserver" in argv and "labkit.training.rank" in argv:
        return "warm process"  # a node's fork server of ranks (labkit.launch.agent.preload_for)
    if re.search(r" warm -m labkit\.train\b", argv):
        return "warm rank"  # forked from a pytest worker's warm server (tests/warm.py)
    if re.search(r" -m labkit\.(train|training\.\w+)\b", argv):
        return "rank"
    if "ipykernel" in argv:
        return "kernel"
    if re.search(r" -m labkit\b|/bin/labkit\b|labkit/__main__\.py", argv):
        return "labkit command"
    if "papermill" in argv:
        return "papermill"
    if "multiprocessing.forkserver" in argv or "multiprocessing.resource_tracker" in argv:
        return "loader server"  # a rank's DataLoader fork server and its resource tracker
    if "exec(eval(" in argv or "pytest" in argv:
        return "pytest worker"
    return "other Python"


def read_starts(folder: Path) -> list[tuple[str, str, str]]:
    """[(test, module, kind)] of every process start recorded in ``folder``."""
    path = folder / "starts.tsv"
    if not path.is_file():
        sys.exit(f"suite_census: {path} not found (run the suite with LABKIT_TEST_CENSUS={folder})")
    out = []
    for line in path.read_text().splitlines():
        parts = line.split("\t", 3)
        if len(parts) == 4:
            test = parts[2].rsplit(" (", 1)[0]  # "(call)": the phase, as pytest sets it
            path, _, name = test.partition("::")
            module = path.rsplit("/", 1)[-1]  # tests/test_x.py -> test_x.py
            out.append((f"{module}::{name}" if name else test, module, kind(parts[3])))
    return out


def read_cpu(folder: Path) -> dict[str, float]:
    """{test id: CPU seconds} from the junit file pytest wrote into ``folder`` (if any)."""
    path = folder / "junit.xml"
    if not path.is_file():
        return {}
    try:
        tree = ET.parse(path)
    except ET.ParseError as e:
        sys.exit(f"suite_census: {path} is not a junit XML file ({e})")
    cpu: dict[str, float] = {}
    for case in tree.iter("testcase"):
        module = case.get("classname", "").rsplit(".", 1)[-1] + ".py"
        for p in case.iter("property"):
            if p.get("name") == "cpu_s":
                cpu[f"{module}::{case.get('name')}"] = float(p.get("value"))
    return cpu


def table(rows: dict[str, collections.Counter], cpu: dict[str, float], top: int) -> None:
    cols = [k for k in KINDS if any(c[k] for c in rows.values())]
    print(f"{'':60s} {'all':>5s} " + " ".join(f"{k.split()[-1][:7]:>7s}" for k in cols)
          + ("   CPU s" if cpu else ""))
    ranked = sorted(rows.items(), key=lambda kv: -sum(kv[1].values()))
    for name, c in ranked[:top]:
        extra = f" {cpu[name]:7.0f}" if name in cpu else ""
        print(f"{name[:60]:60s} {sum(c.values()):5d} " + " ".join(f"{c[k]:7d}" for k in cols) + extra)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path, help="the LABKIT_TEST_CENSUS folder")
    ap.add_argument("--top", type=int, default=20, help="tests and modules to list (default 20)")
    a = ap.parse_args(argv)
    starts = [s for s in read_starts(a.folder) if s[0] != "-"]  # "-": started by no test
    cpu = read_cpu(a.folder)
    by_kind = collections.Counter(k for _, _, k in starts)
    print(f"{len(starts)} Python processes started by the tests:")
    for k in KINDS:
        if by_kind[k]:
            print(f"  {k:15s} {by_kind[k]:5d}")
    if cpu:
        print(f"the tests' CPU seconds (setup to teardown, children waited for): {sum(cpu.values()):.0f}")
    modules: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    tests: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for test, module, k in starts:
        modules[module][k] += 1
        tests[test.split("@")[0]][k] += 1  # "@group": xdist's loadgroup suffix
    mod_cpu = collections.Counter()
    for t, s in cpu.items():
        mod_cpu[t.split("::")[0]] += s
    print("\nby module:")
    table(modules, dict(mod_cpu), a.top)
    print("\nby test (a session fixture counts in the test that built it):")
    table(tests, {t.split("@")[0]: s for t, s in cpu.items()}, a.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
