"""Issue 58, item 2: one training step of each guide method reads in at most 250 lines of
functions in at most 4 files, as tools/reading_path.py counts them (its docstring says what
counts); and the counter is seen to work, on a made-up package whose figures are known."""
from __future__ import annotations

import ast
import runpy
import textwrap

import pytest

from helpers import ROOT

pytestmark = pytest.mark.unit

#: issue 58's bound on one step of a guide method: lines of functions, and files
BOUND, FILES = 250, 4
GUIDE = ("ddp", "allreduce", "ps")


@pytest.fixture
def script() -> dict:
    return runpy.run_path(str(ROOT / "tools" / "reading_path.py"))


@pytest.mark.parametrize("method", GUIDE)
def test_one_step_of_a_guide_method_reads_within_the_bound(script, method):
    r = script["reading_path"](str(ROOT), method)
    assert r["lines"] <= BOUND and r["files"] <= FILES, (method, r)
    # the step, the method's own hooks and its synchronisation are all in what is read
    read = r["functions"]
    assert "labkit.training.trainer:Trainer.train_step" in read, sorted(read)
    assert any(f.endswith(".after_backward") and "labkit.training.sync." in f for f in read), sorted(read)
    # nothing of set-up, validation or checkpoints
    assert not [f for f in read if f.split(".")[-1] in ("setup", "validate", "fit", "__init__")], sorted(read)


def test_the_script_prints_lines_and_files_per_method(script, capsys):
    assert script["main"](list(GUIDE)) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in out] == list(GUIDE), out
    for line, method in zip(out, GUIDE):
        r = script["reading_path"](str(ROOT), method)
        full = script["reading_path"](str(ROOT), method, instruments=True)
        assert line == (f"{method}: {r['lines']} lines in {r['files']} files (following the "
                        f"instruments too: {full['lines']} lines in {full['files']} files)"), line


# ------------------------------------------------------------------ the counter on a made-up package
TOY = {
    "labkit/__init__.py": "",
    # the entry as labkit/train.py's: the rank's main imported and called; main hands its work
    # to the rank's life by name (run_rank), which calls it
    "labkit/train.py": """\
        if __name__ == "__main__":
            from labkit.training import life

            life.begin()
            from labkit.training.rank import main

            life.leave(main())
        """,
    "labkit/training/__init__.py": "",
    "labkit/training/life.py": """\
        def begin():
            pass


        def run(work, *args):
            return work(*args)


        def leave(code):
            return code
        """,
    "labkit/training/rank.py": """\
        from .life import run
        from .loop import Loop


        def main():
            return run(_train)


        def _train():
            loop = Loop()
            loop.fit()
        """,
    # the loop: fit's for-loop is 3 lines, step 6 (the step: backprop calls backward, step is
    # what the loop calls), backprop 2; __init__ and log are set-up and logging
    "labkit/training/loop.py": """\
        from labkit.training.instruments import meter
        from labkit.training.sync import make


        class Loop:
            def __init__(self):
                self.strategy = make()

            def fit(self):
                self.log()
                for i in range(3):
                    meter.tick(i)
                    self.step(i)

            def log(self):
                print("not a step's")

            def step(self, loss):
                s, n = self.strategy, 0
                s.zero_grad()
                self.backprop(loss)
                s.after_backward()
                return loss

            def backprop(self, loss):
                loss.backward()
        """,
    # an instrument: read where it is called, not followed (2 lines)
    "labkit/training/instruments/meter.py": """\
        def tick(i):
            return i
        """,
    "labkit/training/sync/__init__.py": """\
        from .base import Strategy


        def make() -> Strategy:
            from .toy import Toy
            return Toy()
        """,
    # the base's zero_grad (2 lines) and average (3) are read; after_backward is Toy's
    "labkit/training/sync/base.py": """\
        class Strategy:
            def zero_grad(self):
                pass

            def after_backward(self):
                pass

            def average(self, t):
                from .helpers import halve
                return halve(t)
        """,
    # Toy: after_backward 4 lines, its hook 2, _part 2 through a property (3); setup is not read
    "labkit/training/sync/toy.py": """\
        from .base import Strategy
        from . import helpers


        class Toy(Strategy):
            def setup(self, model):
                model.register_post_accumulate_grad_hook(self._ready)
                return model

            def after_backward(self):
                self.average(self.size)
                helpers.halve(1.0)
                return self._part()

            def _ready(self, p):
                return p

            def _part(self):
                return 1

            @property
            def size(self):
                return 2.0

            def unused(self):
                return helpers.unused()
        """,
    "labkit/training/sync/helpers.py": """\
        def halve(t):
            return t / 2


        def unused():
            return 0
        """,
    "labkit/core/__init__.py": "",
    "labkit/core/builtins.py": """\
        METHODS = {"toy": {"spec": {"key": "toy", "source": "labkit.training.sync.toy:Toy"}}}
        """,
}


def make_toy(root) -> None:
    for name, text in TOY.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_the_counter_follows_the_calls_across_modules_and_counts_their_lines(script, tmp_path):
    make_toy(tmp_path)
    r = script["reading_path"](str(tmp_path), "toy")
    assert r["functions"] == {
        "labkit.training.loop:Loop.fit": 3,           # its loop around the step only
        "labkit.training.loop:Loop.step": 6,
        "labkit.training.loop:Loop.backprop": 2,
        "labkit.training.sync.base:Strategy.zero_grad": 2,
        "labkit.training.sync.toy:Toy.after_backward": 4,
        "labkit.training.sync.toy:Toy._ready": 2,    # a hook it hands to torch
        "labkit.training.sync.toy:Toy.size": 3,      # a property, decorator included
        "labkit.training.sync.base:Strategy.average": 3,
        "labkit.training.sync.toy:Toy._part": 2,
        "labkit.training.sync.helpers:halve": 2,
    }, r["functions"]
    assert r["lines"] == 29 and r["files"] == 4, r
    # the instruments followed too: meter.tick's 2 lines in a 5th file
    full = script["reading_path"](str(tmp_path), "toy", instruments=True)
    assert full["functions"]["labkit.training.instruments.meter:tick"] == 2
    assert full["lines"] == 31 and full["files"] == 5, full


def test_the_counter_sees_a_step_grow(script, tmp_path):
    """A line more in a function the step calls, in a module it reaches only through another,
    is a line more; a new module called from the step is a file more."""
    make_toy(tmp_path)
    helpers = tmp_path / "labkit/training/sync/helpers.py"
    helpers.write_text(helpers.read_text().replace("return t / 2", "t = t / 2\n    return t"))
    (tmp_path / "labkit/training/sync/extra.py").write_text("def more():\n    return 1\n")
    toy = tmp_path / "labkit/training/sync/toy.py"
    toy.write_text(toy.read_text().replace("from . import helpers",
                                           "from . import helpers\nfrom .extra import more")
                   .replace("        return p\n", "        return more()\n"))
    r = script["reading_path"](str(tmp_path), "toy")
    assert r["functions"]["labkit.training.sync.helpers:halve"] == 3
    assert r["functions"]["labkit.training.sync.extra:more"] == 2
    assert r["lines"] == 29 + 1 + 2 and r["files"] == 5, r


def test_a_backward_run_once_before_the_loop_is_not_the_step(script, tmp_path):
    """A check of the workload's first batch before training (labkit.workloads.checks) runs a
    backward once, with no loop around it up to the entry: reached first, breadth first, it is
    not the step, and the step read is the same."""
    make_toy(tmp_path)
    (tmp_path / "labkit/training/check.py").write_text("def first_batch(loss):\n    loss.backward()\n")
    rank = tmp_path / "labkit/training/rank.py"
    rank.write_text(rank.read_text().replace("from .loop import Loop",
                                             "from .check import first_batch\nfrom .loop import Loop")
                    .replace("    loop = Loop()\n", "    first_batch(1.0)\n    loop = Loop()\n"))
    r = script["reading_path"](str(tmp_path), "toy")
    assert "labkit.training.check:first_batch" not in r["functions"], r["functions"]
    assert r["lines"] == 29 and r["files"] == 4, r


def test_the_entry_calls_the_ranks_main_by_name():
    """Issue 84, item 4: labkit/train.py imports the rank's main and calls it (no module named
    by a string), and main hands lifecycle.run_rank a function of its own, not a lambda."""
    entry = ast.parse((ROOT / "labkit" / "train.py").read_text())
    named = [n.value for n in ast.walk(entry) if isinstance(n, ast.Call)
             for n in n.args if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    assert not named, named
    assert any(isinstance(n, ast.ImportFrom) and n.module == "training.rank"
               and [a.name for a in n.names] == ["main"] for n in ast.walk(entry))
    rank = ast.parse((ROOT / "labkit" / "training" / "rank.py").read_text())
    main = next(n for n in rank.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    assert not [n for n in ast.walk(main) if isinstance(n, ast.Lambda)]
