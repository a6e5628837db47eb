"""Issue 71, item 7: what the docs name exists, and their measured figures stay on the
performance pages. (tests/test_docs.py checks the commands' flags, the links and the anchors.)

- Every `labkit.x.y` module path, every `python -m X` / `torchrun -m X` and every project file
  path (`labkit/x/y.py`, `tests/...`, `tools/...`) in README.md and docs/*.md names a module or
  file that is there. A dotted path may end in names inside its module
  (`labkit.orchestrate.render.make_report`, `labkit.core.run_folder.RunFolder`): each is looked
  up in the module's source with ast, and no module is imported, so the check costs
  milliseconds.
- A dated figure, a date (2026-11-28, 2026-11, Nov 2026, 28 November 2026) in the same
  section (heading to heading) as a number with a unit (s, min, ms, GiB, MB/s, Mbit/s, %, 1.07x,
  CPU s, img/s, ...), appears only on the pages that keep them: docs/performance.md (the current
  figures), docs/performance-log.md (the dated log) and docs/testing-log.md (the suite's
  history). Run-folder names (`runs/2026-11-24_16-53-31`) and link targets are no dates.
"""
from __future__ import annotations

import ast
import importlib.util
import re
from functools import lru_cache
from pathlib import Path

import pytest

from helpers import ROOT

pytestmark = pytest.mark.unit

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: the pages that keep dated figures: the current ones, the dated log, the suite's history
FIGURE_PAGES = {"performance.md", "performance-log.md", "testing-log.md"}
#: names the docs write like module paths that are names the code gives things: the profiler's
#: ranges (labkit/training/trainer.py, instruments/timers.py), the stack line's mark
#: (core/stacks.py), the result file's schema (core/results.py), the entry-point group of a
#: user's methods (core/methods.py)
NOT_MODULES = {"labkit.forward", "labkit.backward", "labkit.sync", "labkit.step", "labkit.comm",
               "labkit.pull", "labkit.push", "labkit.stack", "labkit.results", "labkit.methods"}
#: pytest's markers (pyproject.toml): `pytest -m unit` selects tests, it names no module
MARKERS = {"unit", "warm", "slow", "torchrun", "e2e"}
#: the project's folders whose file paths the docs name (a user's `my_methods/mine.py` is not one)
FOLDERS = ("labkit", "tests", "tools", "notebooks", "examples", "slurm")

DOTTED = re.compile(r"(?<![\w./-])labkit(?:\.[A-Za-z_]\w*)+(?::[A-Za-z_][\w.]*)?")
DASH_M = re.compile(r"(?<![\w-])-m +([A-Za-z_][\w.]*)")
FILE = re.compile(r"(?<![\w./-])((?:%s)/[\w./-]*\w)" % "|".join(FOLDERS))

MONTH = r"(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]*\.?"
DATE = re.compile(r"(?<![\w-])20\d\d-[01]\d(?:-[0-3]\d)?(?![\w-])"
                  rf"|\b(?:\d{{1,2}} )?{MONTH},? (?:\d{{1,2}},? )?20\d\d\b")
UNIT = (r"CPU s(?:econds?)?|img/s|tokens?/s|steps?/s|samples/s|ms/step|TFLOP/s|[KMGT]i?B/s"
        r"|[kKMGT]bit/s|Gbps|[KMGT]iB|[kKMGT]B|ms|us|µs|ns|s|sec(?:onds?)?|min(?:utes?)?"
        r"|h(?:ours?)?|%")
FIGURE = re.compile(rf"(?<![\w.])\d(?:[\d,]*\d)?(?:\.\d+)?(?:x|×| ?×| ?(?:{UNIT}))(?![\w/])")
LINK_TARGET = re.compile(r"\]\([^)]*\)")


# ------------------------------------------------------------------ modules and files
@lru_cache(maxsize=None)
def module_file(name: str) -> Path | None:
    """The source file of module ``name`` (a package's __init__.py), found on disk without
    importing it or its parents: the top package by importlib's finders, the rest by its
    folders. None when there is no such module."""
    top, *rest = name.split(".")
    if top == "labkit":
        spec_dirs, origin = [ROOT / "labkit"], ROOT / "labkit" / "__init__.py"
    else:
        try:
            spec = importlib.util.find_spec(top)
        except (ImportError, ValueError):
            return None
        if spec is None:
            return None
        origin = Path(spec.origin) if spec.origin and spec.has_location else None
        spec_dirs = [Path(d) for d in (spec.submodule_search_locations or [])]
        if not rest:
            return origin or (spec_dirs[0] if spec_dirs else Path(top))
    path = origin
    for part in rest:
        found = None
        for d in spec_dirs:
            if (d / part / "__init__.py").is_file():
                found, spec_dirs = d / part / "__init__.py", [d / part]
                break
            if (d / f"{part}.py").is_file():
                found, spec_dirs = d / f"{part}.py", []
                break
        if found is None:
            return None
        path = found
    return path


@lru_cache(maxsize=None)
def defined(path: Path) -> dict[str, ast.AST]:
    """The names a module's source defines at its top: functions, classes, assignments, and
    names it imports (a package's __init__ re-exports them)."""
    names: dict[str, ast.AST] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update({t.id: node for t in targets if isinstance(t, ast.Name)})
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update({(a.asname or a.name).split(".")[0]: node for a in node.names})
    return names


def members(node: ast.AST) -> set[str]:
    """A class's methods and class attributes (a dataclass's fields)."""
    out = set()
    for n in getattr(node, "body", []):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            out.add(n.target.id)
        elif isinstance(n, ast.Assign):
            out.update(t.id for t in n.targets if isinstance(t, ast.Name))
    return out


def resolves(dotted: str) -> bool:
    """Whether ``dotted`` (``a.b.c``, or ``a.b:c``) is a module, or names inside the longest
    module it starts with: a top-level name of its source, then a member of that class."""
    parts = dotted.replace(":", ".").split(".")
    for cut in range(len(parts), 0, -1):
        path = module_file(".".join(parts[:cut]))
        if path is None:
            continue
        rest = parts[cut:]
        if not rest:
            return True
        if path.suffix != ".py":
            return False
        node = defined(path).get(rest[0])
        if node is None:
            return False
        if len(rest) > 1 and isinstance(node, ast.ClassDef):
            return any(rest[1] in members(c) for c in with_bases(node, defined(path)))
        return True
    return False


def with_bases(node: ast.ClassDef, names: dict) -> list[ast.ClassDef]:
    """A class and the bases defined beside it in its module (TrainConfig's General), whose
    members are its members too."""
    bases = [names.get(b.id) for b in node.bases if isinstance(b, ast.Name)]
    return [node, *(c for b in bases if isinstance(b, ast.ClassDef) for c in with_bases(b, names))]


def path_problems(name: str, text: str) -> list[str]:
    """Module paths, `-m` modules and project files that ``text`` names and that are not there."""
    found = []
    for m in DOTTED.finditer(text):
        if m.group(0) not in NOT_MODULES and not resolves(m.group(0)):
            found.append(f"{name}: {m.group(0)}: no such module or name in labkit/")
    for m in DASH_M.finditer(text):
        module = m.group(1).rstrip(".")
        if module not in MARKERS and not DOTTED.fullmatch(module) and not resolves(module):
            found.append(f"{name}: -m {module}: no such module")
    for m in FILE.finditer(text):
        rel = m.group(1).split("::")[0].rstrip(".")
        if not (ROOT / rel).exists():
            found.append(f"{name}: {rel}: no such file")
    return found


# ------------------------------------------------------------------ dated figures
def sections(text: str) -> list[tuple[int, str]]:
    """The page's sections, each from its heading to the next (a heading in a code block is
    none), with the number of its first line."""
    out, start, lines, fenced = [], 1, [], False
    for i, line in enumerate(text.splitlines(), 1):
        fenced ^= line.lstrip().startswith("```")
        if line.startswith("#") and not fenced and lines:
            out.append((start, "\n".join(lines)))
            start, lines = i, []
        lines.append(line)
    return out + [(start, "\n".join(lines))]


def dated_figures(name: str, text: str) -> list[str]:
    """Every section of ``text`` that carries both a date and a number with a unit: a
    measurement's date and its figures may lie a paragraph apart, under one heading."""
    found = []
    for first, section in sections(text):
        plain = LINK_TARGET.sub("]", section)
        date, figure = DATE.search(plain), FIGURE.search(plain)
        if date and figure:
            line = first + plain[:date.start()].count("\n")
            found.append(f"{name}:{line}: {date.group(0)} beside {figure.group(0).strip()}")
    return found


# ------------------------------------------------------------------ the docs
@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_module_command_and_file_the_docs_name_is_there(page):
    assert path_problems(str(page.relative_to(ROOT)), page.read_text()) == []


@pytest.mark.parametrize("page", [p for p in PAGES if p.name not in FIGURE_PAGES],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_no_dated_figure_outside_the_performance_pages(page):
    assert dated_figures(str(page.relative_to(ROOT)), page.read_text()) == [], (
        "dated figures belong in docs/performance.md (current) or docs/performance-log.md "
        "(history); link to them from here")


def test_the_pages_that_keep_figures_exist():
    assert {p.name for p in PAGES} >= FIGURE_PAGES


# ------------------------------------------------------------------ the checks, seen to fail
def test_the_path_check_finds_what_moved():
    """Lines the docs carried before issue 71 (modules since moved) fail; their fixed forms pass."""
    old = ("torchrun --standalone --nproc_per_node=2 -m labkit.training.plain_loop --overhead\n"
           "made by `labkit.lab.render.make_report`; see labkit/analysis/report/text.py and\n"
           "labkit/lab/render.py; `labkit.core.run_folder.NoSuchName`; `python -m no_such_tool`\n"
           "tests/test_nothing_here.py::test_x\n")
    assert path_problems("old.md", old) == [
        "old.md: labkit.training.plain_loop: no such module or name in labkit/",
        "old.md: labkit.lab.render.make_report: no such module or name in labkit/",
        "old.md: labkit.core.run_folder.NoSuchName: no such module or name in labkit/",
        "old.md: -m no_such_tool: no such module",
        "old.md: labkit/analysis/report/text.py: no such file",
        "old.md: labkit/lab/render.py: no such file",
        "old.md: tests/test_nothing_here.py: no such file"]
    new = ("torchrun --standalone --nproc_per_node=2 -m labkit.bench.plain_loop --overhead\n"
           "made by `labkit.orchestrate.render.make_report`; see labkit/report/text.py,\n"
           "`labkit.core.run_folder.RunFolder`, `labkit.core.config.TrainConfig.method`,\n"
           "`python -m pytest -m unit`, `-m \"not e2e\"`, `python -m torch.distributed.run`,\n"
           "slurm/labkit.sbatch, `labkit.stack: rank 1`, `labkit.methods` entry points,\n"
           "`labkit check my_methods/mine.py:Mine`, tests/test_docs.py::test_x.\n")
    assert path_problems("new.md", new) == []
    assert resolves("labkit.train") and resolves("labkit.workloads.Workload")
    assert not resolves("labkit.training.plain_loop") and not resolves("torch.no_such_module")


def test_the_figure_check_finds_dated_figures():
    """Sections of the pages before issue 71 fail; what replaced them passes."""
    old = {
        "reproducibility.md": "Measured on 2026-11-23 on the 2-vCPU VM without GPU, commit "
                              "15f1d1b:\nafter `labkit experiment`, `labkit reproduce runs/latest` "
                              "printed\n**identical** and exited 0 in 4 min 03 s.\n",
        "failures.md": "## Measured cost\n\nMachine: the 2-core CPU box, torch 2.14.1, gloo; "
                       "2026-11-24.\n\n- **Fingerprint: 2.1-2.6 ms** for the 74 tensors\n",
        "testing.md": "## Section\n\n| Python | result |\n|---|---|\n| 3.12.1 | 288 passed, 108 s "
                      "with the install (Nov 2026) |\n",
        "x.md": "DDP ran at 1.07x on 25 November 2026.\n\n## Probe\n\nOn 2026-11 the probe: "
                "95.1 Mbit/s.\n",
    }
    assert {name: dated_figures(name, text) for name, text in old.items()} == {
        "reproducibility.md": ["reproducibility.md:1: 2026-11-23 beside 4 min"],
        "failures.md": ["failures.md:3: 2026-11-24 beside 2.6 ms"],
        "testing.md": ["testing.md:5: Nov 2026 beside 108 s"],
        "x.md": ["x.md:1: 25 November 2026 beside 1.07x", "x.md:5: 2026-11 beside 95.1 Mbit/s"]}
    new = ("# A page\n\nThe figures, 95% CI and all: [performance.md](performance.md#the-emulated-"
           "cluster), dated [there](performance-log.md#night-the-suite-2026-11-27).\n\n"
           "`labkit experiment --continue runs/2026-11-24_16-53-31` took 4 min.\n\n"
           "## Since when\n\nVersion 2.14.1 runs 3 epochs of 11 steps on 2 cores, since "
           "2026-11-28.\n")
    assert dated_figures("new.md", new) == []
