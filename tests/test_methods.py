"""Bring your own method (issue 36): one registry holds the built-in three and a user's method
alike; a class in a file outside the project, a module or an installed package's entry point
runs through `-m labkit.train`, `labkit run` and the report with nothing in labkit/ edited."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from helpers import HTML_ONLY, ROOT, TINY, TINY_CFG, check_ok, labkit, load_json
from warm import warm_run
from labkit.core import methods
from labkit.core.errors import ConfigError
from labkit.training.sync import Strategy, load_method

RING = ROOT / "examples" / "methods" / "ring.py"
# the guide's contract: these names, flags and result files never change
GUIDE = {"ddp": ("Baseline DDP (PyTorch)", "results_baseline_ddp.json"),
         "allreduce": ("Manual All-Reduce", "results_all_reduce.json"),
         "ps": ("Parameter Server (PS)", "results_ps.json")}


@pytest.fixture(scope="module")
def ring_cmd(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """`labkit run my_methods/ring.py:RingAllReduce` from a folder outside the project, the
    method named from there by a relative path: its exactness check, then a real TINY run on 2
    gloo ranks. (run folder, the command's output)"""
    base = tmp_path_factory.mktemp("own")
    (base / "my_methods").mkdir()
    shutil.copy(RING, base / "my_methods" / "ring.py")
    # gloo, as helpers.torchrun gives the equivalence runs on a machine with fewer GPUs than ranks
    # with an option of the method's own (issue 84): 2 messages per round instead of 1
    p = _labkit(base, "run", "my_methods/ring.py:RingAllReduce", "--nproc", "2", *TINY,
                "--backend", "gloo", "--runs-dir", "runs", "--ring-segments", "2")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    found = list((base / "runs").glob("*_ring_all_reduce/results_ring_all_reduce.json"))
    assert len(found) == 1, found
    return found[0].parent, p


#: the tests that read the ring's run: one xdist worker runs them all, so the module's ring
#: trains once (each worker that ran one of them trained its own: twice, 17 CPU seconds each)
ring = pytest.mark.xdist_group("ring")


@pytest.fixture(scope="module")
def ring_run(ring_cmd) -> Path:
    """The ring's output folder (ring_cmd's run folder), trained as the equivalence tests'
    TINY runs are."""
    return ring_cmd[0]


def test_the_built_ins_are_registered_as_a_users_method_is():
    assert list(methods.METHOD_ORDER)[:3] == list(GUIDE)
    for key, (guide_name, result_file) in GUIDE.items():
        s = methods.spec(key)
        assert (s.guide_name, s.result_file, methods.RESULT_FILES[key]) == (guide_name, result_file, result_file)
        # the same path as a user's method: the class its spec's source names
        module, _, name = s.source.partition(":")
        cls = load_method(key)
        assert issubclass(cls, Strategy) and (cls.__module__, cls.__name__) == (module, name)


def test_a_built_ins_metadata_is_its_spec_alone():
    """Issue 58: DDP's class inherited Strategy's phases ("comm",) while its spec said (): two
    places that disagreed. Issue 84: the class is the one place, a built-in's as a user's: its
    spec is made of its declarations (registry.spec_of), the registry's spec of a built-in is
    that one, and a strategy's running phases are its spec's."""
    from labkit.core.config import TrainConfig
    from labkit.training.dist import DistContext
    from labkit.training.sync.registry import spec_of

    declared = {}
    ctx = DistContext(0, 1, 0, 1, "gloo", torch.device("cpu"))
    for key in methods.METHOD_ORDER:
        s = methods.spec(key)
        if not s.builtin:
            continue
        cls = load_method(key)
        declared[key] = vars(cls).get("key")
        assert spec_of(cls, key, s.source, builtin=True) == s, key
        assert cls(TrainConfig(method=key), ctx).phases == s.phases, key
    assert {"ddp", "allreduce", "ps", "nosync", "localsgd"} <= set(declared)
    assert declared == {k: k for k in declared}  # each class declares its own key


def test_a_users_key_and_result_file_come_from_its_class_name():
    assert methods.key_of("x/ring.py:RingAllReduce") == "ring_all_reduce"
    assert methods.result_file_of("pkg.mod:HTTPRing") == "results_http_ring.json"
    assert methods.key_of("ddp") == "ddp" and methods.result_file_of("ps") == "results_ps.json"


@ring
def test_a_users_method_trains_to_the_reference_parameters(ring_run):
    """A ring written from send/recv is exact: the final parameters equal the single-process
    reference of the equivalence tests, up to summation order."""
    from helpers import ATOL, RTOL, reference_state

    doc = load_json(ring_run / "results_ring_all_reduce.json")
    assert doc["status"] == "completed" and doc["method"] == "Ring All-Reduce"
    assert doc["method_key"] == "ring_all_reduce" and doc["method_spec"]["exact"] is True
    assert doc["method_spec"]["source"].endswith("my_methods/ring.py:RingAllReduce")
    assert all("avg_comm_time" in e for e in doc["epochs"])  # its timed phase, as allreduce's
    final = torch.load(ring_run / "final_model.pt", weights_only=True)
    for k, ref in reference_state(2).items():
        torch.testing.assert_close(final[k], ref, atol=ATOL, rtol=RTOL, msg=lambda m: f"{k}: {m}")


@ring
def test_the_report_lists_a_users_method_from_its_result_file(ring_run, ddp_run, tmp_path):
    """A fresh process that never imported the user's file: the report finds the method in the
    run folder (its result file records its spec) and gives it a row beside DDP."""
    run = tmp_path / "run"
    shutil.copytree(ddp_run, run / "ddp")
    shutil.copytree(ring_run, run / "ring_all_reduce")
    p = subprocess.run([sys.executable, "-m", "labkit", "report", str(run), "--out", str(tmp_path / "r")],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    table1 = p.stdout.split("Table 2")[0]
    assert "Ring All-Reduce" in table1 and "Baseline DDP" in table1, p.stdout[:3000]


def _package(root: Path, name: str = "ringpkg") -> None:
    (root / name).mkdir()
    (root / name / "__init__.py").write_text("")
    shutil.copy(RING, root / name / "ring.py")


def test_a_module_and_an_entry_point_name_a_method(tmp_path, monkeypatch):
    _package(tmp_path)
    info = tmp_path / "ringpkg-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ringpkg\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[{methods.ENTRY_POINT_GROUP}]\nhandring = ringpkg.ring:RingAllReduce\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cls = load_method("ringpkg.ring:RingAllReduce")
    assert cls.__name__ == "RingAllReduce" and methods.spec("ringpkg.ring:RingAllReduce").key == "ring_all_reduce"
    assert load_method("handring").__name__ == "RingAllReduce"
    s = methods.spec("handring")
    assert (s.key, s.result_file, s.source) == ("handring", "results_handring.json", "ringpkg.ring:RingAllReduce")


@ring
def test_labkit_run_takes_a_users_method(ring_cmd):
    """`labkit run path.py:Class` from the user's folder: the method's exactness check first
    (the check's verdict, as `labkit check` gives it), then the run; the run folder and the
    result file are named after the method."""
    out, p = ring_cmd
    assert out.name.endswith("_ring_all_reduce") and load_json(out / "results_ring_all_reduce.json")[
        "status"] == "completed"
    # labkit check's verdict on the ring (test_the_sharded_optimizer_is_exact... checks the
    # command's own line: "labkit check: <key> is exact: ...", exit 0)
    said = [l for l in p.stdout.splitlines() if l.startswith("check: ")]
    assert len(said) == 1 and said[0].startswith(
        "check: ring_all_reduce is exact: after 3 steps on 2 trainers"), p.stdout[-3000:]


@ring
def test_a_users_method_has_flags_of_its_own(ring_run, capsys):
    """A method's Options dataclass makes its flags (issue 84): `labkit run FILE:Class --help`
    lists the ring's --ring-segments; the run was given 2, which its result file records under
    the config's options and the ranks were handed (the resolved.json they read)."""
    from labkit import cli

    with pytest.raises(SystemExit) as done:
        cli.main(["run", str(RING) + ":RingAllReduce", "--help"])
    assert done.value.code == 0
    assert "--ring-segments RING_SEGMENTS" in capsys.readouterr().out
    doc = load_json(ring_run / "results_ring_all_reduce.json")
    assert doc["config"]["options"] == {"ring_segments": 2}
    assert load_json(ring_run / "resolved.json")["train"]["options"] == {"ring_segments": 2}
    with pytest.raises(SystemExit):  # a built-in's help does not list another method's options
        cli.main(["run", "ddp", "--help"])
    assert "--ring-segments" not in capsys.readouterr().out


def test_a_name_that_names_no_method_is_one_line():
    with pytest.raises(ConfigError, match="unknown method 'sgd'.*path/to/file.py:Class"):
        methods.check_name("sgd")


def test_a_users_class_may_not_take_a_built_in_key(tmp_path):
    (tmp_path / "ddp.py").write_text(textwrap.dedent("""
        from labkit.training.sync import Strategy
        class Ddp(Strategy):
            pass
    """))
    with pytest.raises(ConfigError, match="method name 'ddp' of .*ddp.py:Ddp is taken by labkit"):
        load_method(f"{tmp_path / 'ddp.py'}:Ddp")


@pytest.fixture(autouse=True)
def registry():
    """Each test's methods leave the process's registry as they found it (other tests in this
    worker list every registered method)."""
    specs, aliases = dict(methods.REGISTRY.specs), dict(methods.REGISTRY.aliases)
    yield
    methods.REGISTRY.specs, methods.REGISTRY.aliases = specs, aliases


def _lists_of_methods(path: Path) -> list[str]:
    """Literal tuples, lists, sets and dicts (their keys) of method keys holding all three
    built-ins: a list of methods of the module's own."""
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        elts = node.keys if isinstance(node, ast.Dict) else getattr(node, "elts", None)
        if not isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)) or not elts:
            continue
        words = {e.value for e in elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
        if len(words) == len(elts) and set(GUIDE) <= words <= set(methods.METHOD_ORDER):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_only_the_registry_lists_the_methods():
    """The report, notebooks, runs index and bench take methods, names and result files from
    labkit.core.methods, which reads them from the classes' declarations written out
    (labkit/core/builtins.py): no other module lists the three, and a result file is spelled
    only by the class that declares it."""
    written = ROOT / "labkit" / "core" / "builtins.py"
    sources = [p for p in (ROOT / "labkit").rglob("*.py") if p != written]
    own = {f: ROOT / (methods.spec(k).source.partition(":")[0].replace(".", "/") + ".py")
           for k, (_, f) in GUIDE.items()}
    lists = [where for p in sources for where in _lists_of_methods(p)]
    files = [f"{p.relative_to(ROOT)}: {f}" for p in sources + list((ROOT / "notebooks").glob("*.ipynb"))
             for _, f in GUIDE.values() if f in p.read_text() and p != own[f]]
    assert lists == [] and files == []
    assert _lists_of_methods(written), "the check finds a list of the three"
    assert all(f in own[f].read_text() for f in own)


# ------------------------------------------------------------------ a method that cannot run
BROKEN = {
    # a file that raises while it is imported: the line names the file and its line 4
    "raises.py": ("RaisesOnImport", "from labkit.training.sync import Strategy\n\n\nx = undefined_name\n",
                  "raises.py:4: NameError: name 'undefined_name' is not defined"),
    "syntax.py": ("Syntax", "from labkit.training.sync import Strategy\nclass Syntax(Strategy)\n    pass\n",
                  "syntax.py:2: SyntaxError"),
    # a class that is not a method: named with the line it is defined on
    "plain.py": ("NotAMethod", "import torch\n\n\nclass NotAMethod:\n    pass\n",
                 "NotAMethod (", "plain.py:4) is not a method: a method subclasses "
                 "labkit.training.sync.Strategy"),
    "missing.py": ("Nowhere", "x = 1\n", "missing.py has no class Nowhere"),
}


@pytest.mark.parametrize("name", list(BROKEN))
def test_a_method_that_does_not_load_is_one_line_on_each_entry(name, tmp_path, capsys):
    from helpers import expect_error

    cls, text, *needles = BROKEN[name]
    (tmp_path / name).write_text(text)
    ref = f"{tmp_path / name}:{cls}"
    expect_error(TINY + ["--method", ref, "--out", str(tmp_path / "o")], capsys, f"method {ref}: ",
                 *needles)
    assert not (tmp_path / "o").exists()


def test_no_such_file_or_module_is_one_line(tmp_path, capsys):
    from helpers import expect_error

    expect_error(TINY + ["--method", "gone/ring.py:Ring"], capsys, "method gone/ring.py:Ring: no file ",
                 "gone/ring.py")
    expect_error(TINY + ["--method", "no_such_pkg.ring:Ring"], capsys,
                 "method no_such_pkg.ring:Ring: no module 'no_such_pkg.ring'")


def _labkit(cwd: Path, *argv: str) -> subprocess.CompletedProcess:
    """`labkit ARGV` in ``cwd``, one thread per rank, reports as HTML only (no test here reads
    a PDF)."""
    return labkit(argv, cwd, env=HTML_ONLY, timeout=300)


def test_labkit_run_and_experiment_refuse_a_broken_method_before_anything_starts(tmp_path):
    (tmp_path / "plain.py").write_text(BROKEN["plain.py"][1])
    for argv in (["run", "plain.py:NotAMethod", *TINY],
                 ["experiment", "--methods", "ddp,plain.py:NotAMethod", *TINY]):
        p = _labkit(tmp_path, *argv, "--runs-dir", "runs")
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 2 and len(lines) == 1, p.stderr
        # the method as the run names it: the file made absolute, so from any folder
        assert f"method {tmp_path}/plain.py:NotAMethod: NotAMethod (" in lines[0], lines[0]
        assert f"{tmp_path}/plain.py:4) is not a method" in lines[0]
        assert "Traceback" not in p.stdout + p.stderr
    assert not (tmp_path / "runs").exists()


FAILS = """
from labkit.training.sync import Strategy


class FailsFirstStep(Strategy):
    exact = False  # not checked for exactness first: the timed run itself meets the error
    def after_backward(self):
        if self.ctx.rank == 1:
            raise ValueError("no gradients for me")
"""


def test_a_method_raising_in_its_first_step_fails_in_one_line(tmp_path):
    """The rank that raised names the method, the user's file and line and the step; the run is
    failed with that reason, and no process is left. (Claiming exactness, it meets the error in
    its check, before any run: the same line, exit 2, no run folder: `labkit run` stops at a
    failing check as `labkit experiment` does at a method that is not exact.)"""
    from helpers import running_in

    (tmp_path / "exact.py").write_text(FAILS.replace("exact = False", "exact = True"))
    p = _labkit(tmp_path, "run", "exact.py:FailsFirstStep", "--nproc", "2", *TINY, "--out", "o")
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and not (tmp_path / "o").exists(), p.stderr
    assert re.search(r"could not be checked \(its logs: \S+\): ", lines[0]), lines[0]
    assert f"{tmp_path / 'exact.py'}:9 (at epoch 1" in lines[0]
    (tmp_path / "fails.py").write_text(FAILS)
    p = _labkit(tmp_path, "run", "fails.py:FailsFirstStep", "--nproc", "2", *TINY, "--out", "out")
    assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-2000:]
    said = [l for l in p.stderr.splitlines() if l.strip()]  # rank 0's live output is stdout
    assert len(said) == 1 and "Traceback" not in p.stdout + p.stderr, p.stdout + p.stderr
    assert said[0].startswith("labkit: fails_first_step failed: rank 1: ValueError: no gradients "
                              "for me at "), said
    assert f"{tmp_path / 'fails.py'}:9 (at epoch 1, step 1 of 5)" in said[0]
    doc = load_json(tmp_path / "out" / "results_fails_first_step.json")
    assert doc["status"] == "failed" and "fails.py:9" in doc["error"]
    assert running_in(tmp_path) == []


def test_an_experiment_beside_ddp_with_the_lab_notebook_diff_and_reproduce(tmp_path):
    """The issue's path: a ring in the user's folder, run by `labkit experiment` beside ddp;
    the report's Tables 1-2 have its row, `labkit runs` its throughput, and `labkit reproduce`
    runs it again from the record (then `labkit diff` compares the two)."""
    from helpers import EXPERIMENT_FLAGS as TINY_FLAGS

    (tmp_path / "my_methods").mkdir()
    shutil.copy(RING, tmp_path / "my_methods" / "ring.py")
    flags = [*TINY_FLAGS, "--epochs", "1", "--max-steps-per-epoch", "3", "--runs-dir", "runs"]
    p = _labkit(tmp_path, "experiment", *flags, "--methods", "ddp,my_methods/ring.py:RingAllReduce")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    run = (tmp_path / "runs" / "latest").resolve()
    doc = load_json(run / "ring_all_reduce" / "results_ring_all_reduce.json")
    assert doc["status"] == "completed" and load_json(run / "experiment.json")["methods"][
        "ring_all_reduce"]["status"] == "completed"
    text = (run / "report" / "performance_report.txt").read_text()
    for table in ("Table 1.", "Table 2."):  # the tables' headings (the summary names them too)
        part = text.split("\n" + table, 1)[1].split("\nTable ", 1)[0]
        assert "Ring All-Reduce" in part and "Baseline DDP" in part, part
    runs = _labkit(tmp_path, "runs", "runs")
    assert runs.returncode == 0 and "Ring All-Reduce img/s" in runs.stdout, runs.stdout + runs.stderr
    # the user's method only: ddp's reproduction is test_reproduce's
    again = _labkit(tmp_path / "my_methods", "reproduce", str(run), "--methods", "ring_all_reduce",
                    "--tolerance", "1e-3")
    # reproduced: the same folder, code and seed give the same losses and parameters
    assert again.returncode == 0 and "ring_all_reduce" in again.stdout, again.stdout + again.stderr
    new = [d for d in (tmp_path / "runs").iterdir() if d.is_dir() and not d.is_symlink() and d != run]
    assert len(new) == 1 and load_json(new[0] / "ring_all_reduce" / "results_ring_all_reduce.json")[
        "status"] == "completed"
    diff = _labkit(tmp_path, "diff", str(run), str(new[0]))
    assert diff.returncode == 0 and "Ring All-Reduce" in diff.stdout, diff.stdout + diff.stderr


# ------------------------------------------------------------------ bytes on the wire
def _gradient_bytes() -> int:
    """The model's fp32 gradient bytes, from its parameter count (not from labkit's counts)."""
    from labkit.workloads.images.models import build_model

    model, _ = build_model("resnet10_small", 10)
    return sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)


def _wire(out: Path) -> dict:
    doc = load_json(next(out.glob("results_*.json")))
    assert all("wire" in e for e in doc["epochs"])
    return doc["epochs"][-1]["wire"]


@pytest.mark.xdist_group("equivalence_runs")
@pytest.mark.parametrize("name", ["ddp", "allreduce"])
def test_an_all_reduce_moves_the_ring_arithmetic(equivalence_runs, name):
    """Each of 2 ranks sends and receives 2(n-1)/n of the gradient bytes per step."""
    n, g = 2, _gradient_bytes()
    w = _wire(equivalence_runs[name][0])
    assert w["trainer"] == [True] * n
    for key in ("sent_per_step", "received_per_step"):
        assert len(w[key]) == n
        for b in w[key]:
            assert b == pytest.approx(2 * (n - 1) / n * g, rel=0.01), (key, b, g)


@pytest.mark.xdist_group("equivalence_runs")
@pytest.mark.parametrize("name", ["ps_collective", "ps_p2p"])
def test_a_parameter_server_trainer_pulls_and_pushes_the_model(equivalence_runs, name):
    """Per step each trainer (ranks 1 and 2) pulls every parameter and pushes every gradient;
    the server (rank 0) sends the parameters to, and receives the gradients from, each."""
    g, w = _gradient_bytes(), _wire(equivalence_runs[name][0])
    assert w["trainer"] == [False, True, True]
    pull, push = w["by_phase"]["pull"], w["by_phase"]["push"]
    for r in (1, 2):
        assert pull["received"][r] == pytest.approx(g, rel=0.01) and pull["sent"][r] == 0
        assert push["sent"][r] == pytest.approx(g, rel=0.01) and push["received"][r] == 0
    assert pull["sent"][0] == pytest.approx(2 * g, rel=0.01)
    assert push["received"][0] == pytest.approx(2 * g, rel=0.01)


@ring
def test_the_report_says_mb_per_step_on_the_wire(ring_run):
    """The ring moves 2(n-1)/n of the gradients each way, counted from its sends and recvs,
    and Table 2 says so in MB."""
    from labkit import report

    g = _gradient_bytes()
    w = _wire(ring_run)
    assert w["sent_per_step"] == [pytest.approx(g, rel=0.01)] * 2
    rows = report.communication_rows(report.load_files([str(ring_run)]))
    row = next(r for r in rows if r["Method"] == "Ring All-Reduce")
    assert row[report.tables.WIRE] == f"{g / 1e6:.2f} / {g / 1e6:.2f}"


# ------------------------------------------------------------------ exactness checked
WRONG = '''
"""One rank skips averaging one parameter: rank 1 adds its fc.weight gradient undivided."""
from labkit.training.sync import Strategy, broadcast_parameters


class SkipsOneAverage(Strategy):
    def setup(self, model):
        broadcast_parameters(model)
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        return model

    def after_backward(self):
        with self.timer("comm"):
            for name, p in self.named:
                if not (name == "fc.weight" and self.ctx.rank == 1):
                    p.grad.div_(self.ctx.world_size)
                self.all_reduce(p.grad)
'''


def test_a_method_that_is_not_exact_fails_its_check_and_nothing_else_runs(tmp_path):
    """The check names the parameter the method got wrong; `labkit experiment` runs it first and
    stops there (one line, exit 2, no run folder). (`labkit run` runs the same check first and
    stops the same way: test_a_method_raising_in_its_first_step_fails_in_one_line, on a method
    whose check fails; each check trains, so one command per failing check here.)"""
    (tmp_path / "wrong.py").write_text(WRONG)
    p = _labkit(tmp_path, "check", "wrong.py:SkipsOneAverage")
    assert p.returncode == 1 and "Traceback" not in p.stdout + p.stderr, p.stdout + p.stderr
    first, verdict = p.stdout.splitlines()[:2]  # what it checks and how long it may take, then
    assert first.startswith("labkit check: checking that skips_one_average is exact: 3 steps on 2 ranks")
    assert verdict.startswith("labkit check: skips_one_average is not exact: after 3 steps on 2 "
                              "trainers parameter fc.weight differs from the single-process "
                              "reference by "), p.stdout
    p = _labkit(tmp_path, "experiment", "--methods", "ddp,wrong.py:SkipsOneAverage", "--nproc", "2",
                *TINY, "--runs-dir", "runs")
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, p.stdout + p.stderr
    assert "skips_one_average is not exact" in lines[0] and "parameter fc.weight" in lines[0]
    assert not (tmp_path / "runs").exists()


def test_the_bench_measures_a_users_method_beside_ddp(tmp_path):
    """`labkit bench --variants ddp,file.py:Class`: the method's job is named by its key, and
    the bench's tables read it from the spec its row records. With --no-pricing each job times
    its own loop only: no instrument rounds (test_bench prices them)."""
    from helpers import BENCH_FLAGS as BENCH

    shutil.copy(RING, tmp_path / "ring.py")
    p = _labkit(tmp_path, "bench", *BENCH, "--nproc", "2", "--variants", "ddp,ring.py:RingAllReduce",
                "--runs-dir", "runs", "--no-report", "--no-pricing")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    run = (tmp_path / "runs" / "latest").resolve()
    doc = load_json(run / "bench.json")
    assert [r["variant"] for r in doc["results"]] == ["ddp", "ring_all_reduce"]
    for r in doc["results"]:
        assert list(r["instruments"]["loops"]) == ["as run"] and r["instruments"]["pairs"] == [], r["variant"]
    assert doc["results"][1]["method_spec"]["key"] == "ring_all_reduce"
    shown = _labkit(tmp_path, "report", str(run))
    assert shown.returncode == 0 and "ring_all_reduce" in shown.stdout, shown.stdout + shown.stderr


# ------------------------------------------------------------------ a method that does not replicate
NOT_REPLICATED = '''
import torch
from labkit.training.sync.allreduce import AllReduceStrategy


class Shards(AllReduceStrategy):
    """The all-reduce, but declaring what a sharded method declares, each hook visible: its
    ranks' last bias differs on purpose (a shard of one's own, as it were), its whole model is
    a sentinel, its forward 'cannot run without communication'."""
    replicates, calibrates, exact = False, False, False
    compute_measured = "the step less its measured communication (a test's words)"

    def finish_epoch(self, model):
        super().finish_epoch(model)
        with torch.no_grad():  # rank 1's copy of one tensor differs: its own shard
            list(model.parameters())[-1].add_(float(self.ctx.rank))

    def replicas(self, model):
        named = [(n, t) for n, t in model.named_parameters()][:-1]
        return named, None  # what the ranks hold alike: all but the last tensor

    def full_state(self, model, optimizer):
        state = {k: v.clone() for k, v in model.state_dict().items()}
        state[next(iter(state))].fill_(7.0)  # "gathered": what the loop must save
        return state, optimizer.state_dict() if optimizer is not None else None
'''


def test_a_method_that_does_not_replicate_is_checked_saved_and_timed_by_its_own_hooks(tmp_path):
    """The contract without replicas (issue 84, item 2): the replica check compares what the
    method's replicas() says the ranks hold alike (its last tensor differs on rank 1, which the
    whole-model check would stop the run for), the checkpoint and the final model are what its
    full_state() gathers (a sentinel here), and a method that cannot skip its communication runs
    no compute-only steps: its log says how its compute is measured instead."""
    path = tmp_path / "shards.py"
    path.write_text(NOT_REPLICATED)
    out = tmp_path / "out"
    check_ok(warm_run(2, TINY + ["--method", f"{path}:Shards", "--out", str(out)], cwd=tmp_path))
    doc = load_json(out / "results_shards.json")
    assert doc["status"] == "completed" and doc["epochs"][-1]["replicas"]["identical"]
    assert "calibration" not in doc
    final = torch.load(out / "final_model.pt", weights_only=True)
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    first = next(iter(final))
    assert bool((final[first] == 7.0).all()) and bool((ckpt["model"][first] == 7.0).all())
    log = (out / "train.log").read_text()
    assert "no compute-only steps: shards" in log and "a test's words" in log


# ------------------------------------------------------------------ ZeRO-1, through the interface
ZERO1 = ROOT / "examples" / "methods" / "zero1.py"


def test_the_sharded_optimizer_is_exact_and_holds_a_slice_of_the_momentum(tmp_path, ddp_run):
    """examples/methods/zero1.py: DDP's parameters (the equivalence reference), each rank holding
    1/n of the momentum DDP's SGD holds: against DDP's state as the lab counted it in a DDP run,
    and against the parameter count; Table 2 of their report shows both."""
    from labkit import report
    from helpers import ATOL, RTOL, reference_state

    check_ok(warm_run(2, TINY + ["--method", f"{ZERO1}:ShardedOptimizer", "--out", str(tmp_path / "z")],
                      cwd=tmp_path))
    doc = load_json(tmp_path / "z" / "results_sharded_optimizer.json")
    ddp_momentum = _gradient_bytes()  # SGD's momentum: one fp32 value per parameter
    ddp_held = load_json(ddp_run / "results_baseline_ddp.json")["efficiency"]["optimizer_state_bytes"]
    assert ddp_held == [ddp_momentum, ddp_momentum]  # the loop's optimizer, counted by the lab
    held = doc["efficiency"]["optimizer_state_bytes"]
    assert len(held) == 2 and held == doc["epochs"][-1]["optimizer_state_bytes"]
    for h, d in zip(held, ddp_held):
        assert h == pytest.approx(d / 2, abs=4) and h < 0.51 * d
    rows = {r["Method"]: r for r in report.communication_rows(
        report.load_files([str(ddp_run), str(tmp_path / "z")]))}
    mib = lambda b: f"{b / 2**20:.2f}"  # noqa: E731
    assert rows["Baseline DDP"][report.tables.STATE] == f"{mib(ddp_momentum)}, {mib(ddp_momentum)}"
    assert rows[doc["method_spec"]["short"]][report.tables.STATE] == ", ".join(mib(h) for h in held)
    assert doc["epochs"][-1]["wire"]["sent_per_step"][0] == pytest.approx(ddp_momentum, rel=0.01)
    final = torch.load(tmp_path / "z" / "final_model.pt", weights_only=True)
    for k, ref in reference_state(2).items():
        torch.testing.assert_close(final[k], ref, atol=ATOL, rtol=RTOL, msg=lambda m: f"{k}: {m}")
    # `labkit check`'s own line for an exact method (labkit run's check of the ring says the
    # same verdict: test_labkit_run_takes_a_users_method)
    p = _labkit(tmp_path, "check", f"{ZERO1}:ShardedOptimizer")
    assert p.returncode == 0, p.stdout + p.stderr
    first, verdict = p.stdout.splitlines()[:2]
    assert first.startswith("labkit check: checking that sharded_optimizer is exact"), p.stdout
    assert verdict.startswith("labkit check: sharded_optimizer is exact: after 3 steps on 2 trainers"), p.stdout


def test_a_method_registered_elsewhere_is_no_row_of_another_runs_tables(ddp_run):
    """A live kernel that read a user's run keeps its method registered; the tables of a run
    without it still list only the guide's three (a missing one says why)."""
    from labkit import report

    methods.register(methods.MethodSpec("ghost", "Ghost", "Ghost", "results_ghost.json", ("comm",),
                                        False, True, "elsewhere.py:Ghost"))
    res = report.load_files([str(ddp_run)])
    for rows in (report.comparison_rows(res), report.communication_rows(res)):
        assert [r["Method"] for r in rows] == [methods.SHORT[m] for m in GUIDE]


# ------------------------------------------------------------------ the no-communication bound
def test_nosync_communicates_nothing_and_bounds_what_communication_costs(ddp_run, tmp_path):
    """`--method nosync`: no byte on the wire in any step, one model at the end of the epoch (the
    replica check passes); beside DDP the report states the bound from the two throughputs and
    leaves nosync out of the accuracy verdicts, saying why. Its steps are compute-only steps, so
    its calibration is its last ones, read rather than run: their parts, and each rank's own
    compute."""
    from labkit import report

    check_ok(warm_run(2, TINY + ["--method", "nosync", "--out", str(tmp_path / "nosync")], cwd=tmp_path))
    doc = load_json(tmp_path / "nosync" / "results_nosync.json")
    assert doc["status"] == "completed" and doc["method_spec"]["exact"] is False
    assert all(e["wire"]["sent_per_step"] == [0, 0] == e["wire"]["received_per_step"]
               for e in doc["epochs"])
    assert doc["epochs"][-1]["replicas"]["identical"] is True
    last, cal, n = doc["epochs"][-1], doc["calibration"], TINY_CFG["calibrate_steps"]
    assert cal["steps"] == n and cal["parts"] == {p: v[-n:] for p, v in last["step_parts"].items()}
    held = dict(zip(last["sync_held"]["ranks"], last["sync_held"]["times"]))
    assert cal["rank_compute"] == pytest.approx([sum(held[r][-n:]) / n for r in (0, 1)])
    assert cal["from"] == "training steps"
    res = report.load_files([str(ddp_run), str(tmp_path / "nosync")])
    thr = {m: v["throughput"].value for m, v in report.intervals(res).items()}
    lines = report.verdict_lines(res)
    bound = [l for l in lines if l.startswith("Communication cost")]
    assert len(bound) == 1, lines
    ratio = thr["ddp"] / thr["nosync"]  # a shared machine can make the bound the slower one
    assert bound[0].startswith(f"Communication costs at most {100 * (1 - ratio):.0f}% of a step"
                               if ratio < 1 else "Communication cost nothing measurable here")
    assert "left out of the accuracy verdicts" in bound[0]
    # the replica check passes because of the epoch-end copy, which the line says
    assert "copied to every rank at each epoch's end" in bound[0]
    accuracy = lines[lines.index("Accuracy (best validation accuracy against DDP):") + 1:]
    assert not any(l.startswith("No sync") for l in accuracy), lines


@ring
def test_the_report_says_which_methods_are_exact(ring_run, ddp_run, tmp_path):
    """Each method's kind, as its class declares it: the ring is exact; the same file declared
    approximate is listed as approximate."""
    from labkit import report

    lines = report.verdict_lines(report.load_files([str(ddp_run), str(ring_run)]))
    kinds = [l for l in lines if l.startswith("Methods: ")]
    assert kinds == ["Methods: exact (the same parameters as DDP up to summation order): "
                     "Baseline DDP, Ring All-Reduce."], lines
    doc = load_json(ring_run / "results_ring_all_reduce.json")
    doc["method_spec"].update(key="approx_ring", exact=False, title="Approximate ring",
                              short="Approximate ring", result_file="results_approx_ring.json")
    doc.update(method_key="approx_ring", method="Approximate ring")
    (tmp_path / "results_approx_ring.json").write_text(json.dumps(doc))
    lines = report.verdict_lines(report.load_files([str(ddp_run), str(tmp_path / "results_approx_ring.json")]))
    assert ("Methods: exact (the same parameters as DDP up to summation order): Baseline DDP; "
            "approximate (judged by time to accuracy and final accuracy against DDP): "
            "Approximate ring.") in lines, lines
