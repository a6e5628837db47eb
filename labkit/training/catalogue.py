"""The built-ins' declarations written out as Python: labkit/core/builtins.py, for the processes
that must not import torch (the command line, which builds every built-in's flags before the
warm process starts; the report, the runs index and the explorer, which read result files).

A built-in method's declaration lives in its class (labkit.training.sync.base.Strategy: its spec,
options, variants, preloads, cost model) and a built-in workload's in its class
(labkit.workloads.contract.Workload: its name, options, preloads); each class's module imports
torch, 2 CPU s on a 2-vCPU VM, so those processes read this written copy instead. Write it
again after changing a declaration:

    .venv/bin/python tools/builtins.py

tests/test_builtins.py holds the file equal to :func:`source`, and a rank that loads a built-in
method checks its class against the file (labkit.training.sync.registry.load_method).
"""
from __future__ import annotations

import dataclasses
import pprint
import typing
from typing import Any

from labkit.workloads.catalog import builtin_classes as workload_classes

from .sync.registry import builtin_classes as method_classes
from .sync.registry import own, spec_of

HEADER = '''"""The built-in methods and workloads as their classes declare them, for the processes that
do not import torch: the command line's flags, the report, the runs index (labkit.core.methods
and labkit.core.config read it). Written by `python tools/builtins.py` from the classes
(labkit.training.catalogue); tests/test_builtins.py holds it equal to them. Edit the classes,
never this file."""
# flake8: noqa: E501
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from .params import option
'''


def _type(t: Any) -> str:
    """A field's type as source: int, Optional[float], Literal['a', 'b']."""
    origin = typing.get_origin(t)
    if origin is typing.Union:
        [inner] = [a for a in typing.get_args(t) if a is not type(None)]
        return f"Optional[{_type(inner)}]"
    if origin is typing.Literal:
        return f"Literal[{', '.join(map(repr, typing.get_args(t)))}]"
    return t.__name__


def _text(s: str, indent: int) -> str:
    """A long string as adjacent literals of about 90 characters, each ending at a space."""
    parts, line = [], ""
    for word in s.split(" "):
        if line and len(line) + len(word) > 84 - indent:
            parts.append(line)
            line = ""
        line += word + " "
    parts.append(line[:-1])
    return ("\n" + " " * indent).join(repr(p) for p in parts)


def _options(owners: list[tuple[str, type]]) -> str:
    """The dataclass of every built-in's option fields, each once (a field two methods share
    must be declared alike), commented with the components that declare it."""
    fields: dict[str, tuple[dataclasses.Field, Any, list[str]]] = {}
    for owner, cls in owners:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name in fields:
                have = fields[f.name]
                if (have[0].default, dict(have[0].metadata), have[1]) != (f.default, dict(f.metadata), hints[f.name]):
                    raise ValueError(f"option {f.name} is declared differently by {have[2][0]} and {owner}")
                have[2].append(owner)
            else:
                fields[f.name] = (f, hints[f.name], [owner])
    lines = ["@dataclass", "class BuiltinOptions:",
             '    """Every built-in method\'s and workload\'s options, flat, as TrainConfig holds them."""']
    for name, (f, t, who) in fields.items():
        meta = dict(f.metadata)
        help_, group = meta.pop("help"), meta.pop("group")
        extra = "".join(f", {k}={v!r}" for k, v in meta.items())
        lines += [f"    # {', '.join(who)}",
                  f"    {name}: {_type(t)} = option(\n        {f.default!r}, {_text(help_, 8)},\n"
                  f"        {group!r}{extra})"]
    return "\n".join(lines)


def _method(cls) -> dict:
    ref = f"{cls.__module__}:{cls.__qualname__}"
    return {"spec": spec_of(cls, cls.key, ref, builtin=True).to_dict(), "order": cls.order,
            "guide": own(cls, "guide"), "baseline": own(cls, "baseline"),
            "default": own(cls, "default"), "variants": dict(own(cls, "variants")),
            "bench_variants": tuple(own(cls, "bench_variants")),
            "preload": (cls.__module__, *own(cls, "preload")), "cost_model": cls.cost_model,
            "options": tuple(f.name for f in dataclasses.fields(cls.Options))}


def source() -> str:
    """labkit/core/builtins.py as the classes declare it today."""
    methods = {c.key: _method(c) for c in method_classes()}
    workloads = {c.name: {"source": f"{c.__module__}:{c.__qualname__}", "default": c.default,
                          "preload": tuple(c.preload),
                          "worker_preload": tuple(c.worker_preload),
                          "options": tuple(f.name for f in dataclasses.fields(c.Options))}
                 for c in workload_classes()}
    # a method's key names its defaults first, then every other variant, methods in order
    variants = {v: {"method": k, **fields} for k, d in methods.items()
                for v, fields in d["variants"].items() if v == k}
    variants |= {v: {"method": k, **fields} for k, d in methods.items()
                 for v, fields in d["variants"].items() if v != k}
    owners = [(c.key, c.Options) for c in method_classes()] + [(c.name, c.Options) for c in workload_classes()]
    fmt = lambda x: pprint.pformat(x, width=100, sort_dicts=False)  # noqa: E731
    return "\n".join([
        HEADER,
        "#: every built-in method, in the order of every table: its spec (what a result file",
        "#: records of it) and what the launcher, the cost model and the report read of it",
        f"METHODS = {fmt(methods)}",
        "", "#: every built-in workload: where its class lives, its preloads and options",
        f"WORKLOADS = {fmt(workloads)}",
        "", "#: the methods' variants: name -> the TrainConfig fields that make it",
        f"VARIANTS = {fmt(variants)}",
        "#: the variants labkit bench times without --variants",
        f"BENCH_VARIANTS = {fmt(tuple(v for d in methods.values() for v in d['bench_variants']))}",
        "", "", _options(owners), ""])
