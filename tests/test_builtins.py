"""One declaration per method and per workload (issue 84): each built-in is its class, and
labkit/core/builtins.py, what the processes that import no torch read of them, is exactly what
the classes declare today; outside its own module, no built-in method's key or workload's name
is spelled in labkit/ (the exceptions below, each with its reason); a method's options are its
own dataclass's fields, their flags made from it."""
from __future__ import annotations

import ast

import pytest

from helpers import ROOT

pytestmark = pytest.mark.unit

#: (file, key) spelled outside the key's own module, and why that is no list of methods
EXCEPTIONS = {
    ("labkit/report/workload_view.py", "images"): "the unit the guide's throughput counts "
                                                  "(img/s), which the workload's name happens to be",
}


def test_the_written_declarations_are_the_classes():
    """A declaration changed in a class and not written out would leave the command line, the
    report and the runs index reading the old one: `python tools/builtins.py` writes it."""
    from labkit.training.catalogue import source

    written = (ROOT / "labkit" / "core" / "builtins.py").read_text()
    assert written == source(), "labkit/core/builtins.py is stale: run .venv/bin/python tools/builtins.py"


def _own_modules() -> dict[str, tuple[str, ...]]:
    from labkit.core import builtins

    own = {k: d["spec"]["source"].partition(":")[0] for k, d in builtins.METHODS.items()}
    own |= {n: d["source"].partition(":")[0] for n, d in builtins.WORKLOADS.items()}
    return {k: (m,) for k, m in own.items()}


def test_no_built_in_is_spelled_outside_its_own_module():
    """A string that is a built-in method's key or workload's name, in any module of labkit/
    but the class's own (and its package, for a workload) and the written declarations: each
    would be one more place a new method or workload must be added to, or a branch on one."""
    own = _own_modules()
    found = []
    for path in sorted((ROOT / "labkit").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        module = rel.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
        if module == "labkit.core.builtins":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Constant) and node.value in own):
                continue
            if any(module == m or module.startswith(m + ".") for m in own[node.value]):
                continue
            if (rel, node.value) not in EXCEPTIONS:
                found.append(f"{rel}:{node.lineno}: {node.value!r}")
    assert found == []


def test_the_check_finds_a_spelled_key(tmp_path):
    """The scan above is seen to find one: a module that branches on a method's key."""
    tree = ast.parse('if cfg.method == "ps":\n    pass\n')
    assert any(isinstance(n, ast.Constant) and n.value in _own_modules() for n in ast.walk(tree))


def test_a_methods_options_are_its_flags_and_its_fields():
    """The parameter server's options are its own dataclass's (PSOptions), TrainConfig holds
    them flat, the bench's variants are read from the classes, and each flag keeps its name."""
    import dataclasses

    from labkit.core.config import VARIANTS, TrainConfig, build_parser
    from labkit.training.sync import load_method

    ps = load_method("ps")
    names = [f.name for f in dataclasses.fields(ps.Options)]
    assert names == ["bucket_mb", "ps_mode", "ps_servers", "ps_staleness"]
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    assert set(names) <= fields
    assert VARIANTS["ps-sharded"] == {"method": "ps", **ps.variants["ps-sharded"]}
    ns = build_parser().parse_args(["--ps-servers", "2", "--ps-mode", "p2p"])
    assert ps.options_of(TrainConfig(ps_servers=ns.ps_servers, ps_mode=ns.ps_mode)) == \
        ps.Options(ps_mode="p2p", ps_servers=2)


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _imported(path, module: str) -> list[tuple[int, str]]:
    """(line, module) of every import in a file, functions' too, relative ones made absolute;
    ``from P import n`` names P, and P.n where n is a module of P."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            name = node.module if node.level == 0 else ".".join(p for p in (base, node.module) if p)
            found += [(node.lineno, name)] + [(node.lineno, f"{name}.{a.name}") for a in node.names
                                              if _is_module(f"{name}.{a.name}")]
    return found


def test_the_training_layer_imports_no_workloads_internals():
    """labkit/training is generic (issue 84): it reaches a workload through the contract
    (labkit.workloads, its contract, datasets, checks and catalog), never a module inside a
    workload's package, which would tie the training loop to that workload's data."""
    workloads = ROOT / "labkit" / "workloads"
    packages = sorted(p.parent.name for p in workloads.glob("*/__init__.py"))
    assert {"images", "lm"} <= set(packages)
    found = []
    for path in sorted((ROOT / "labkit" / "training").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        module = rel.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
        for line, name in _imported(path, module):
            parts = name.split(".")
            if parts[:2] == ["labkit", "workloads"] and len(parts) > 3 and parts[2] in packages:
                found.append(f"{rel}:{line}: {name}")
    assert found == []
