"""The house: folders by capability whose imports run one way (the graph of
docs/architecture.md), no import circles (imports inside functions included), no private name
imported from another module, small functions, and the run statuses spelled in one module. A
long module is a warning, not a failure: a line cap split files into circles (issue 58). Each
rule is checked on labkit/ and on a small tree made to break it, so the check is seen to fail
when it should."""
from __future__ import annotations

import ast
import re
import warnings
from pathlib import Path

import pytest

from helpers import ROOT

# what each capability folder may import, besides itself (docs/architecture.md draws it); the
# entry (cli, __main__, train) may import all. The thin part of the design card: training (the
# loop, the methods in training/sync), launch (torchrun)
LAYERS = {
    "core": set(),
    "workloads": {"core"},
    "training": {"core", "workloads"},
    "launch": {"core", "workloads", "training"},
    "bench": {"core", "workloads", "training"},
    "costmodel": {"core", "bench"},
    "report": {"core", "bench", "costmodel"},
    "runs": {"core", "workloads", "training", "bench", "report"},
    "orchestrate": {"core", "workloads", "training", "launch", "bench", "costmodel", "report", "runs"},
}
# a function over MAX_FUNCTION lines fails; a module over LONG_MODULE lines is a warning
MAX_FUNCTION, LONG_MODULE = 60, 800


def _module(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, root: Path) -> list[tuple[int, str]]:
    """(line, imported labkit module) of every import in the file, in functions too."""
    me = _module(path, root)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # `from labkit.runs import x`: x may be a module of that package
            out += [(node.lineno, f"{target}.{a.name}") for a in node.names]
    return [(line, t) for line, t in out if t == "labkit" or t.startswith("labkit.")]


def _layer(module: str) -> str | None:
    """The capability folder of ``module`` (a key of LAYERS), or None for the entry and the
    package root."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def layer_violations(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        mine = _layer(_module(path, root))
        if mine is None:
            continue
        for line, target in _imports(path, root):
            theirs = _layer(target)
            if theirs is None and target.split(".")[1:2] not in ([], ["__version__"]):
                found.append(f"{path.relative_to(root.parent)}:{line} imports the entry {target}")
            elif theirs is not None and theirs != mine and theirs not in LAYERS[mine]:
                found.append(f"{path.relative_to(root.parent)}:{line} ({mine}) imports {target} ({theirs})")
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    """{module: the other modules of ``root`` it imports}, imports inside functions included;
    ``from m import name`` is an arrow to m.name where that is a module, else to m."""
    paths = {_module(p, root): p for p in sorted(root.rglob("*.py"))}
    graph = {}
    for me, path in paths.items():
        targets = {t if t in paths else t.rpartition(".")[0] for _, t in _imports(path, root)}
        graph[me] = {t for t in targets if t in paths and t != me}
    return graph


def _reached(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for t in graph[todo.pop()] - seen:
            seen.add(t)
            todo.append(t)
    return seen


def import_circles(root: Path) -> list[tuple[str, ...]]:
    """Each set of modules that import one another round a circle, its names sorted."""
    graph = import_graph(root)
    reached = {m: _reached(graph, m) for m in graph}
    return sorted({tuple(sorted(o for o in reached[m] if m in reached[o]))
                   for m in graph if m in reached[m]})


def private_imports(root: Path) -> list[str]:
    """'file:line target' for each private name (one leading underscore) imported from another
    module: what two modules share is public, in the module that owns it."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for line, target in _imports(path, root):
            name = target.rpartition(".")[2]
            if name.startswith("_") and not name.startswith("__"):
                found.append(f"{path.relative_to(root.parent)}:{line} {target}")
    return found


def long_modules(root: Path) -> list[str]:
    """'file: N lines' for each module over LONG_MODULE lines (a warning, not a rule)."""
    lines = {p: len(p.read_text().splitlines()) for p in sorted(root.rglob("*.py"))}
    return [f"{p.relative_to(root.parent)}: {n} lines (a warning above {LONG_MODULE})"
            for p, n in lines.items() if n > LONG_MODULE]


def size_violations(root: Path) -> list[str]:
    """'file:line name: N lines' for each function over MAX_FUNCTION lines."""
    found = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        where = path.relative_to(root.parent)
        for n in ast.walk(ast.parse(text)):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = n.end_lineno - n.lineno + 1
                if length > MAX_FUNCTION:
                    found.append(f"{where}:{n.lineno} {n.name}: {length} lines (at most {MAX_FUNCTION})")
    return found


STATUS_WORDS = re.compile(r'"(running|completed|failed|interrupted|stopped|pending)"')


def status_word_modules(root: Path) -> set[str]:
    return {str(p.relative_to(root.parent)) for p in root.rglob("*.py")
            if STATUS_WORDS.search(p.read_text())}


# the keys only a result file has (its guide's keys and the lab's; "epochs", "summary",
# "world_size", "trainers", "efficiency", "step_parts", "method_spec" also name other documents'
# entries: the bench's rows, config.json): read by key nowhere but the result model
RESULT_MODEL = "labkit/core/results.py"
RESULT_KEYS = (
    "train_loss", "train_accuracy", "train_time", "train_throughput", "avg_batch_time", "val_loss",
    "val_accuracy", "val_samples", "val_time", "all_losses", "avg_train_throughput",
    "avg_train_time_per_epoch", "best_val_accuracy", "final_train_accuracy", "final_val_accuracy",
    "step_times", "throughput_warmup_steps", "avg_data_time", "data_wait_share", "comm_busy_times",
    "server_update_times", "sync_held", "machine_load", "optimizer_state_bytes", "method_key",
    "num_workers", "calibration", "diverged", "replicas_differ", r"avg_comm_time\w*", r"comm_times\w*")
_KEY = "[\"']({})[\"']".format("|".join(RESULT_KEYS))
# d["val_accuracy"], d.get("val_accuracy"), "val_accuracy" in d, d.setdefault("val_accuracy", ...)
KEY_READ = re.compile(rf"\[\s*{_KEY}\s*\]|\.(?:get|setdefault|pop)\(\s*{_KEY}|{_KEY}\s+(?:not\s+)?in\b")


def result_key_readers(root: Path) -> list[str]:
    """Where a module other than the result model reads a result file's key by its name."""
    found = []
    for path in sorted(root.rglob("*.py")):
        name = str(path.relative_to(root.parent))
        if name == RESULT_MODEL:
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if m := KEY_READ.search(line):
                found.append(f"{name}:{i} {m.group(0)}")
    return found


# the modules that parse JSON: labkit.core.run_folder, every document of a run folder,
# labkit.core.results, the result files (the model reads its own), and labkit.core.lockfile,
# pip's report read from a pipe; any other reader of a run folder goes through RunFolder,
# its read_json or read_result
JSON_PARSERS = {"labkit/core/run_folder.py", "labkit/core/results.py", "labkit/core/lockfile.py"}


def json_parsers(root: Path) -> set[str]:
    """The modules that call json.load or json.loads, or import either by name."""
    found = set()
    for path in root.rglob("*.py"):
        for n in ast.walk(ast.parse(path.read_text())):
            called = (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                      and n.func.attr in ("load", "loads") and isinstance(n.func.value, ast.Name)
                      and n.func.value.id == "json")
            imported = (isinstance(n, ast.ImportFrom) and n.module == "json"
                        and {a.name for a in n.names} & {"load", "loads"})
            if called or imported:
                found.add(str(path.relative_to(root.parent)))
    return found


# module names that may appear twice, each for a reason (docs/glossary.md: one name, one meaning)
SHARED_NAMES = {
    "__init__.py": "a package's own", "__main__.py": "python -m of labkit and of its cost model",
    "cli.py": "labkit's command line, and labkit model's (costmodel/cli.py)",
    "sweep.py": "running a sweep (orchestrate) and its report (report)",
}


def twice_named(root: Path) -> list[str]:
    """'name: path, path' for each module name that more than one module of ``root`` has."""
    seen: dict[str, list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        seen.setdefault(path.name, []).append(path.relative_to(root.parent).as_posix())
    return [f"{n}: {', '.join(ps)}" for n, ps in seen.items() if len(ps) > 1 and n not in SHARED_NAMES]


def test_imports_run_only_downward():
    assert layer_violations(ROOT / "labkit") == []


def test_no_import_circles():
    """plots <-> seeds and bench_rank <-> plain_loop <-> pricing were circles, hidden by imports
    inside functions (issue 58)."""
    assert import_circles(ROOT / "labkit") == []


def test_no_private_name_is_imported_from_another_module():
    assert private_imports(ROOT / "labkit") == []


def test_functions_stay_small_and_long_modules_are_named():
    assert size_violations(ROOT / "labkit") == []
    for note in long_modules(ROOT / "labkit"):
        warnings.warn(note)


def test_no_module_name_means_two_things():
    """health, params, hooks and checks each named two modules once (issue 39)."""
    assert twice_named(ROOT / "labkit") == []


def test_the_status_words_are_spelled_in_one_module():
    assert status_word_modules(ROOT / "labkit") == {"labkit/core/status.py"}


def test_the_result_files_keys_are_read_in_one_module():
    assert (ROOT / RESULT_MODEL).is_file()
    assert result_key_readers(ROOT / "labkit") == []


def test_one_module_reads_run_folders():
    assert json_parsers(ROOT / "labkit") == JSON_PARSERS


# the commands that read run folders: diff, reproduce, runs, the report's loader, the
# explorer, continue and the sweep report each open theirs with RunFolder
RUN_FOLDER_USERS = ("runs/rundiff.py", "orchestrate/reproduce.py", "runs/runs_index.py",
                    "report/load.py", "runs/explore.py", "orchestrate/continuation.py",
                    "report/sweep.py")


@pytest.mark.parametrize("user", RUN_FOLDER_USERS)
def test_each_command_reads_through_run_folder(user):
    root = ROOT / "labkit"
    assert "labkit.core.run_folder.RunFolder" in {t for _, t in _imports(root / user, root)}


def test_the_top_level_holds_only_the_entry():
    assert sorted(p.name for p in (ROOT / "labkit").glob("*.py")) == [
        "__init__.py", "__main__.py", "cli.py", "train.py"]
    assert all((ROOT / "labkit" / layer / "__init__.py").is_file() for layer in LAYERS)


@pytest.fixture
def broken_tree(tmp_path) -> Path:
    """A labkit-shaped tree with one of each violation."""
    root = tmp_path / "labkit"
    for layer in LAYERS:
        (root / layer).mkdir(parents=True)
        (root / layer / "__init__.py").write_text("")
    (root / "__init__.py").write_text("__version__ = '0'\n")
    (root / "cli.py").write_text("")
    (root / "core" / "ok.py").write_text("from labkit import __version__\nfrom . import ok\n")
    (root / "core" / "up.py").write_text("def f():\n    from labkit.orchestrate import experiment\n")
    (root / "report" / "side.py").write_text("from ..training.trainer import Trainer\n")
    (root / "training" / "entry.py").write_text("import labkit.cli\n")
    (root / "orchestrate" / "ok.py").write_text("")
    (root / "orchestrate" / "fine.py").write_text("from labkit.training import rank\nfrom ..core import x\n")
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION))
    (root / "orchestrate" / "long.py").write_text(f"def long():\n{body}\n" + "\n" * LONG_MODULE)
    # a circle closed by an import inside a function, and a private name from another module
    (root / "runs" / "ring_a.py").write_text("from . import ring_b\n\ndef _helper():\n    pass\n")
    (root / "runs" / "ring_b.py").write_text("def f():\n    from .ring_a import g\n")
    (root / "orchestrate" / "peek.py").write_text(
        "from labkit.runs.ring_a import _helper\nfrom .fine import __all__\n")
    (root / "orchestrate" / "words.py").write_text('STATE = "failed"\n')
    (root / "core" / "run_folder.py").write_text(
        "import json\nfrom . import layout\n\ndef read(run):\n"
        "    return json.loads((run / layout.CONFIG).read_text())\n")
    (root / "runs" / "second_reader.py").write_text(
        "import json\nfrom labkit.core import layout\n\ndef env(run):\n"
        "    path = run / layout.ENVIRONMENT\n    with open(path) as f:\n"
        "        return json.load(f)\n\ndef other(p):\n    return json.loads(p.read_text())\n")
    (root / "report" / "by_key.py").write_text(
        "def best(doc, e):\n    return doc['summary'].get('best_val_accuracy'), e.val_loss\n\n"
        "def has(e):\n    return 'avg_comm_time_pull' in e\n")
    (root / "orchestrate" / "results.py").write_text(
        "from json import loads\n\nclass R:\n    def doc(self, out):\n"
        "        return loads((out / 'results_ddp.json').read_text())\n")
    return root


def test_the_checks_fail_when_a_rule_is_broken(broken_tree):
    layers = layer_violations(broken_tree)
    assert len(layers) == 3, layers
    assert any("core/up.py:2 (core) imports labkit.orchestrate.experiment (orchestrate)" in v for v in layers)
    assert any("report/side.py:1 (report) imports labkit.training.trainer.Trainer" in v
               for v in layers)
    assert any("training/entry.py:1 imports the entry labkit.cli" in v for v in layers)
    assert size_violations(broken_tree) == ["labkit/orchestrate/long.py:1 long: 61 lines (at most 60)"]
    assert long_modules(broken_tree) == ["labkit/orchestrate/long.py: 861 lines (a warning above 800)"]
    assert import_circles(broken_tree) == [("labkit.runs.ring_a", "labkit.runs.ring_b")]
    assert private_imports(broken_tree) == ["labkit/orchestrate/peek.py:1 labkit.runs.ring_a._helper"]
    assert status_word_modules(broken_tree) == {"labkit/orchestrate/words.py"}
    assert twice_named(broken_tree) == ["ok.py: labkit/core/ok.py, labkit/orchestrate/ok.py"]
    assert result_key_readers(broken_tree) == ["labkit/report/by_key.py:2 .get('best_val_accuracy'",
                                               "labkit/report/by_key.py:5 'avg_comm_time_pull' in"]
    assert json_parsers(broken_tree) - JSON_PARSERS == {
        "labkit/runs/second_reader.py", "labkit/orchestrate/results.py"}


# ------------------------------------------------------------------ the suite's own rule
def _test_module_imports(tests: Path) -> list[str]:
    """'file:line name' for each import of conftest or another test module by a test module
    (docs/testing.md: test modules import from helpers, never from each other)."""
    bad = []
    for path in sorted(tests.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad += [f"{path.name}:{node.lineno} {n}" for n in names
                    if n == "conftest" or n.startswith("test_")]
    return bad


def test_test_modules_import_from_helpers_never_from_each_other(tmp_path):
    assert _test_module_imports(ROOT / "tests") == []
    (tmp_path / "test_a.py").write_text("def f():\n    from test_b import X\nimport conftest\n")
    (tmp_path / "test_b.py").write_text("from helpers import X\n")
    assert sorted(_test_module_imports(tmp_path)) == ["test_a.py:2 test_b", "test_a.py:3 conftest"]


def _accepts_any_exit(tests: Path) -> list[str]:
    """'file:line' of each comparison `X.returncode in (0, 1)` (any order, tuple, list or set):
    a test that accepts a command's failure as well as its success."""
    bad = []
    for p in sorted(tests.glob("test_*.py")):
        for n in ast.walk(ast.parse(p.read_text())):
            if (isinstance(n, ast.Compare) and isinstance(n.left, ast.Attribute)
                    and n.left.attr == "returncode" and isinstance(n.ops[0], ast.In)
                    and isinstance(n.comparators[0], (ast.Tuple, ast.List, ast.Set))
                    and {getattr(e, "value", None) for e in n.comparators[0].elts} >= {0, 1}):
                bad.append(f"{p.name}:{n.lineno}")
    return bad


def _asserting(trees: list[ast.AST]) -> set[str]:
    """The names of the functions (of every test file and helper) that assert, themselves or
    through another such function: an assert, pytest.raises / fail / skip, or a call."""
    funcs = {n.name: n for t in trees for n in ast.walk(t) if isinstance(n, ast.FunctionDef)}

    def direct(f) -> bool:
        for n in ast.walk(f):
            if isinstance(n, ast.Assert):
                return True
            if isinstance(n, ast.Attribute) and n.attr in ("raises", "fail", "skip", "warns"):
                return True
        return False

    def calls(f) -> set[str]:
        return {c.func.id if isinstance(c.func, ast.Name) else c.func.attr
                for c in ast.walk(f) if isinstance(c, ast.Call)
                and isinstance(c.func, (ast.Name, ast.Attribute))}

    yes = {name for name, f in funcs.items() if direct(f)}
    while True:
        more = {name for name, f in funcs.items() if name not in yes and calls(f) & yes}
        if not more:
            return yes
        yes |= more


def _assert_free(tests: Path) -> list[str]:
    """'file:name' of each test function that asserts nothing (directly or in what it calls)."""
    files = sorted(tests.glob("*.py"))
    trees = {p: ast.parse(p.read_text()) for p in files}
    yes = _asserting(list(trees.values()))
    return [f"{p.name}:{n.name}" for p, t in trees.items() if p.name.startswith("test_")
            for n in ast.walk(t) if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")
            and n.name not in yes]


def test_no_test_accepts_a_failure_or_asserts_nothing(tmp_path):
    """Issue 61: a test asserts something that could fail. Grep-able: no `returncode in (0, 1)`;
    every test function asserts, itself or through a helper that does."""
    assert _accepts_any_exit(ROOT / "tests") == []
    assert _assert_free(ROOT / "tests") == []
    (tmp_path / "helpers.py").write_text("def check(p):\n    assert p\n")
    (tmp_path / "test_a.py").write_text(
        "def test_ran():\n    run()\n"
        "def test_either(p):\n    assert p.returncode in (0, 1)\n"
        "def test_checked(p):\n    check(p)\n"
        "def test_raises():\n    with pytest.raises(ValueError):\n        f()\n")
    assert _accepts_any_exit(tmp_path) == ["test_a.py:4"]
    assert _assert_free(tmp_path) == ["test_a.py:test_ran"]
