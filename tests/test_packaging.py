"""Packaging: the two dependency lists (pip's pyproject.toml and conda's environment.yml) must
agree, and the test tooling must do what `make test` relies on."""
import json
import os
import re
import tomllib
from pathlib import Path

import pytest
import yaml

from helpers import HTML_ONLY, ROOT


def _pyproject_deps():
    with open(ROOT / "pyproject.toml", "rb") as f:
        return set(tomllib.load(f)["project"]["dependencies"])


def _conda_pip():
    with open(ROOT / "environment.yml") as f:
        env = yaml.safe_load(f)
    return next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d), env


def _conda_pip_deps():
    return {d for d in _conda_pip()[0] if not d.startswith("-e")}


def test_environment_yml_matches_pyproject():
    py, conda = _pyproject_deps(), _conda_pip_deps()
    assert py == conda, f"only in pyproject: {sorted(py - conda)}; only in environment.yml: {sorted(conda - py)}"


def test_environment_yml_is_the_same_install_as_make_setup():
    """The conda path installs what `make setup` does: labkit itself with the test extras, a
    Python that requires-python admits, and the same kernel registration."""
    pip, env = _conda_pip()
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"pip install -e '(\.\[test\])'", makefile).group(1) == ".[test]"
    assert "-e .[test]" in pip
    python = next(d for d in env["dependencies"] if isinstance(d, str) and d.startswith("python="))
    assert tuple(map(int, python.removeprefix("python=").split("."))) >= requires_python()
    kernel = re.search(r"python -m (ipykernel install .*)", makefile).group(1)
    assert f"python -m {kernel}" in (ROOT / "environment.yml").read_text()
    assert f"python -m {kernel}" in (ROOT / "docs" / "notebooks.md").read_text()


# Standard-library names newer than 3.10, by the version that added them: a module that uses
# one needs requires-python to admit only that version and later.
NEWER_STDLIB = {
    "enum.StrEnum": (3, 11), "tomllib": (3, 11), "typing.Self": (3, 11),
    "typing.LiteralString": (3, 11), "typing.Never": (3, 11), "typing.assert_never": (3, 11),
    "typing.reveal_type": (3, 11), "datetime.UTC": (3, 11), "asyncio.TaskGroup": (3, 11),
    "asyncio.timeout": (3, 11), "hashlib.file_digest": (3, 11), "operator.call": (3, 11),
    "contextlib.chdir": (3, 11), "wsgiref.types": (3, 11),
    "itertools.batched": (3, 12), "typing.override": (3, 12), "typing.TypeAliasType": (3, 12),
    "calendar.Month": (3, 12), "calendar.Day": (3, 12),
    "warnings.deprecated": (3, 13), "copy.replace": (3, 13), "typing.ReadOnly": (3, 13),
    "typing.TypeIs": (3, 13), "typing.NoDefault": (3, 13), "typing.get_protocol_members": (3, 13),
}


def requires_python() -> tuple[int, int]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        spec = tomllib.load(f)["project"]["requires-python"]
    major, minor = spec.removeprefix(">=").split(".")[:2]
    assert spec.startswith(">="), spec
    return int(major), int(minor)


def stdlib_uses(tree) -> set[str]:
    """Dotted stdlib names a module uses: from-imports, and attributes of imported modules."""
    import ast

    modules, used = {}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                modules[a.asname or a.name] = a.name
                used.add(a.name)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            used.add(node.module)
            used |= {f"{node.module}.{a.name}" for a in node.names}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id in modules:
            used.add(f"{modules[node.value.id]}.{node.attr}")
    return used


def newer_than(minimum: tuple[int, int], root: Path) -> list[str]:
    """Each module's syntax parsed as of ``minimum`` (ast's feature_version), and its stdlib
    names against NEWER_STDLIB: what needs a newer Python than ``minimum``."""
    import ast

    found = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        try:
            tree = ast.parse(text, feature_version=minimum)
        except SyntaxError as e:
            found.append(f"{path.name}:{e.lineno}: syntax newer than {minimum}: {e.msg}")
            continue
        found += [f"{path.name}: {name} (Python {'.'.join(map(str, NEWER_STDLIB[name]))})"
                  for name in sorted(stdlib_uses(tree)) if NEWER_STDLIB.get(name, (0,)) > minimum]
    return found


def test_requires_python_admits_only_versions_that_run_the_package():
    """requires-python was >=3.10 while labkit.core.status imported enum.StrEnum (3.11): the
    package installed on 3.10 and failed at import. Nothing may need a newer Python than the
    declared minimum, and the minimum may be no lower than what is needed."""
    minimum = requires_python()
    assert newer_than(minimum, ROOT / "labkit") == []
    below = (minimum[0], minimum[1] - 1)
    assert newer_than(below, ROOT / "labkit") != [], f"{below} would do: lower requires-python"


def test_the_python_check_finds_newer_syntax_and_names(tmp_path):
    (tmp_path / "a.py").write_text("from itertools import batched\nimport typing\nx: typing.Self\n")
    (tmp_path / "b.py").write_text("try:\n    pass\nexcept* OSError:\n    pass\n")
    found = newer_than((3, 10), tmp_path)
    assert found[:2] == ["a.py: itertools.batched (Python 3.12)", "a.py: typing.Self (Python 3.11)"]
    assert len(found) == 3 and found[2].startswith("b.py:4: syntax newer than (3, 10)")
    assert newer_than((3, 11), tmp_path) == ["a.py: itertools.batched (Python 3.12)"]


def test_torch_pins():
    deps = _pyproject_deps()
    assert "torch==2.14.1" in deps and "torchvision==0.29.1" in deps


def test_xdist_groups_keep_a_fixture_on_one_worker(tmp_path):
    """`make test` relies on --dist loadgroup to build each expensive fixture once; with
    pytest 9.2 and pytest-xdist 3.8 the grouping silently stopped (pytest-xdist#1386)."""
    import subprocess
    import sys

    (tmp_path / "test_g.py").write_text(
        "import os, pytest\n"
        "pytestmark = pytest.mark.xdist_group('g')\n"
        "@pytest.mark.parametrize('i', range(6))\n"
        "def test_a(i):\n"
        "    open(os.path.join(os.path.dirname(__file__), f'w{i}'), 'w').write(os.environ['PYTEST_XDIST_WORKER'])\n"
        "@pytest.mark.parametrize('i', range(6))\n"
        "def test_b(i):\n"
        "    pass\n")
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
                        "--dist", "loadgroup", str(tmp_path)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    workers = {(tmp_path / f"w{i}").read_text() for i in range(6)}
    assert len(workers) == 1, workers


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """labkit's wheel, built (without dependencies) from a clean copy of the working tree: a
    build/ folder that an earlier build left in the tree leaks its old modules into the wheel
    (seen: the previous layout's labkit/sync beside labkit/training/sync)."""
    import shutil
    import subprocess
    import sys

    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    for f in filter(None, files):
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        if (ROOT / f).is_symlink():
            (src / f).symlink_to(os.readlink(ROOT / f))
        elif (ROOT / f).is_file():
            shutil.copy2(ROOT / f, src / f)
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        "-w", str(out), str(src)], capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-2000:]
    (whl,) = out.glob("labkit-*.whl")
    return whl


@pytest.mark.xdist_group("wheel")  # the module's wheel, built once
def test_wheel_ships_the_notebooks_and_templates(wheel):
    """A non-editable install must find the notebooks and the export template inside the
    package (labkit.orchestrate.render.NOTEBOOKS comes from importlib.resources)."""
    import zipfile

    names = set(zipfile.ZipFile(wheel).namelist())
    for nb in ("run_method", "report", "explore"):
        assert f"labkit/notebooks/{nb}.ipynb" in names
    assert "labkit/orchestrate/templates/offline/index.html.j2" in names
    assert not any(n.startswith("tests/") for n in names)
    # exactly the package that is in the tree, nothing left over from an older layout
    tree = {str(p.relative_to(ROOT)) for p in (ROOT / "labkit").rglob("*.py")}
    assert {n for n in names if n.endswith(".py")} == tree


@pytest.mark.xdist_group("wheel")  # the module's wheel, built once
def test_a_plain_install_runs_the_experiment_and_the_guides_command(wheel, tmp_path):
    """pip install of the wheel (not editable) into a fresh venv, then, from an empty folder,
    the experiment and the guide's torchrun command. The venv borrows the dependencies from
    the project's venv (a path in a .pth, so none of its own .pth files, the editable labkit's
    among them, applies), because installing torch again takes minutes; nbconvert's templates
    are data files of its installation, copied where an install would put them."""
    import shutil
    import subprocess
    import sys
    import sysconfig

    venv, work = tmp_path / "venv", tmp_path / "empty"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    shutil.copytree(Path(sys.prefix) / "share" / "jupyter" / "nbconvert",
                    venv / "share" / "jupyter" / "nbconvert")
    p = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", str(wheel)],
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-2000:]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env['PATH']}"
    env.update(HTML_ONLY)  # the report as HTML: the PDF's export is test_experiment's
    work.mkdir()
    where = subprocess.run([str(py), "-c", "import labkit; print(labkit.__file__)"], cwd=work,
                           env=env, capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(site)), where  # the installed copy, not the repository's
    p = subprocess.run(["labkit", "experiment", "--epochs", "1", "--max-steps-per-epoch", "2",
                        "--nproc", "2", "--methods", "ddp"], cwd=work, env=env,
                       capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    run = (work / "runs" / "latest").resolve()
    assert (run / "ddp" / "results_baseline_ddp.json").is_file()
    assert (run / "report" / "report.html").is_file()
    p = subprocess.run([str(py), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        "-m", "labkit.train", "--method", "ddp", "--dataset", "digits", "--epochs", "1",
                        "--max-steps-per-epoch", "2", "--out", "OUT"], cwd=work, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads((work / "OUT" / "results_baseline_ddp.json").read_text())
    assert doc["method"] == "Baseline DDP (PyTorch)" and doc["status"] == "completed"
    assert {"epochs", "summary", "all_losses", "world_size", "batch_size"} <= set(doc)


def test_notebook_imports_leave_torch_and_scipy_out():
    """Every notebook kernel starts by importing labkit; torch + torchvision (which pulls in
    torch._dynamo) and scipy.stats cost ~7 s of CPU per process on 2 cores. The report kernels
    never need them, a method's kernel needs torch only for its input checks (labkit.training.preflight),
    and scipy.stats is imported when an interval is computed: the notebooks' import lines
    alone must load none of them."""
    import json
    import subprocess
    import sys

    heavy = ("torch", "torchvision", "scipy.stats", "matplotlib.pyplot")
    for name in ("run_method", "report", "sweep", "explore"):
        nb = json.loads((ROOT / "notebooks" / f"{name}.ipynb").read_text())
        imports = [line for c in nb["cells"] if c["cell_type"] == "code"
                   for line in "".join(c["source"]).splitlines()
                   if line.startswith(("import ", "from "))]
        assert any("labkit" in line for line in imports), name
        code = "\n".join(imports + ["import sys",
                                    f"print(','.join(m for m in {heavy!r} if m in sys.modules))"])
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr[-2000:]
        loaded = p.stdout.strip()
        if name == "explore":  # draws interactively: pyplot is its point, torch is not
            loaded = ",".join(m for m in loaded.split(",") if m != "matplotlib.pyplot")
        assert loaded == "", f"{name}.ipynb's imports load {loaded}"


@pytest.mark.e2e
def test_labkits_commands_validate_notebooks_without_the_iri_grammars():
    """labkit.cli refuses rfc3987_syntax's import (2 of papermill's 2.4 CPU s): nbformat still
    accepts a good notebook and names what is wrong with a bad one."""
    import subprocess
    import sys

    code = """
import sys
from labkit.cli import _without_iri_grammars
_without_iri_grammars()
import nbformat, papermill
nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1")])
nbformat.validate(nb)
nb.cells[0]["cell_type"] = "no such type"
try:
    nbformat.validate(nb)
except nbformat.ValidationError:
    print("refused", sys.modules.get("rfc3987_syntax"))
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout == "refused None\n", p.stderr[-2000:]
