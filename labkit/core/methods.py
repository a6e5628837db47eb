"""The methods as every layer knows them: one registry of specs, the built-ins included.

A method is its class (labkit.training.sync.Strategy, or a user's subclass in a file or package
of their own), which declares everything about it; what every layer needs to *know* about it
without importing the training code (the launcher, the result writer, the report) is its
:class:`MethodSpec`, made of the class's declarations (labkit.training.sync.registry.spec_of):

- its key (the folder and report name) and the guide's ``"method"`` string and result file
  name (for the built-ins a contract with the guide's users; for a user's method derived from
  its name: ``results_<key>.json``);
- the communication phases it times, which name its result keys (``avg_comm_time`` for the
  all-reduce, ``avg_comm_time_pull`` / ``_push`` for the parameter server);
- whether some of its ranks serve rather than train (the parameter server's);
- whether it is exact (DDP's parameters up to summation order) or approximate;
- where its class lives (``package.module:Class`` or ``path/to/file.py:Class``).

``--method`` takes a registered key, the name of an installed package's entry point in the
group :data:`ENTRY_POINT_GROUP`, or such a reference. The training side loads the class
(labkit.training.sync.registry) and registers its spec here with :func:`register`, the
function the built-ins are registered with, from labkit.core.builtins (their classes'
declarations, written out for the processes that import no torch); a result file records its
method's spec, so the report registers a user's method from the file without importing the
user's code.
"""
from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from importlib import metadata
from typing import Callable, Iterator, Optional

from . import builtins
from .errors import ConfigError

ENTRY_POINT_GROUP = "labkit.methods"


@dataclass(frozen=True)
class MethodSpec:
    key: str                   # the --method name, the method's folder and result-file stem
    guide_name: str            # the guide's "method" string in the result file
    short: str                 # the report's name for it
    result_file: str           # the guide's result file name
    phases: tuple[str, ...]    # communication phases a trainer's blocked time is timed in
    serves: bool               # ranks 0..K-1 serve (hold parameters and optimizer), not train
    exact: bool = True         # same parameters as DDP up to summation order
    source: str = ""           # where the class lives: package.module:Class or file.py:Class
    builtin: bool = False      # one of labkit's own
    bound: bool = False        # a reference that never communicates: speed only, no verdicts

    def to_dict(self) -> dict:
        return {**asdict(self), "phases": list(self.phases)}

    @classmethod
    def from_dict(cls, d: dict) -> "MethodSpec":
        names = cls.__dataclass_fields__
        return cls(**{**{k: v for k, v in d.items() if k in names},
                      "phases": tuple(d.get("phases", ())), "builtin": False})


class Registry:
    """Specs by key, in the order they were registered (the order of every table and figure),
    and the references (``file.py:Class``) and entry-point names that name them."""

    def __init__(self) -> None:
        self.specs: dict[str, MethodSpec] = {}
        self.aliases: dict[str, str] = {}

    def register(self, s: MethodSpec, *aliases: str) -> MethodSpec:
        """Add ``s`` (again: no change); a key taken by another class is bad input."""
        have = self.specs.get(s.key)
        if have is not None and have.source and s.source and have.source != s.source:
            raise ConfigError(f"method name {s.key!r} of {s.source} is taken by {have.source}")
        if have is None or (not have.builtin and s != have and s.source == have.source):
            self.specs[s.key] = s
        for a in aliases:
            if a != s.key:
                self.aliases[a] = s.key
        return self.specs[s.key]

    def find(self, method: str) -> Optional[MethodSpec]:
        return self.specs.get(self.aliases.get(method, method))


REGISTRY = Registry()
register = REGISTRY.register
find = REGISTRY.find

# the built-ins, in table order, as their classes declare them (labkit.core.builtins is written
# from the classes for the processes that import no torch)
for _d in builtins.METHODS.values():
    register(MethodSpec(**{**_d["spec"], "phases": tuple(_d["spec"]["phases"])}))

#: the guide's three: every comparison table has a row for each (a missing one says why)
GUIDE_METHODS: tuple[str, ...] = tuple(k for k, d in builtins.METHODS.items() if d["guide"])
#: what `labkit experiment` runs without --methods: the guide's three and the no-communication
#: bound, which puts an upper limit on what any method could gain by communicating less
DEFAULT_METHODS: tuple[str, ...] = tuple(k for k, d in builtins.METHODS.items() if d["default"])
#: the guide's baseline: the reference every speedup, verdict and projection is measured against
BASELINE: str = next(k for k, d in builtins.METHODS.items() if d["baseline"])


class _Keys(Sequence):
    """The registered keys, in order, as they are when read (a live view)."""

    def __getitem__(self, i):
        return tuple(REGISTRY.specs)[i]

    def __len__(self) -> int:
        return len(REGISTRY.specs)

    def __contains__(self, m) -> bool:
        return m in REGISTRY.specs

    def __repr__(self) -> str:
        return repr(tuple(REGISTRY.specs))


class _Field(Mapping):
    """{key: one field of its spec} for every registered method (a live view)."""

    def __init__(self, get: Callable[[MethodSpec], str]):
        self.get_field = get

    def __getitem__(self, m: str) -> str:
        return self.get_field(REGISTRY.specs[m])

    def __iter__(self) -> Iterator[str]:
        return iter(tuple(REGISTRY.specs))

    def __len__(self) -> int:
        return len(REGISTRY.specs)


# the order of every table and figure: the built-ins, then methods in the order registered
METHOD_ORDER: Sequence[str] = _Keys()
SPECS: Mapping[str, MethodSpec] = _Field(lambda s: s)
RESULT_FILES: Mapping[str, str] = _Field(lambda s: s.result_file)
METHOD_NAMES: Mapping[str, str] = _Field(lambda s: s.guide_name)
SHORT: Mapping[str, str] = _Field(lambda s: s.short)


def spec(method: str) -> MethodSpec:
    """The spec of a registered key or of a reference or entry point already loaded; KeyError
    for one that is not (the training side loads it: labkit.training.sync.registry)."""
    s = find(method)
    if s is None:
        raise KeyError(method)
    return s


def label(method: str, detail: str = "") -> str:
    """A method's name in every table, figure and line of text: its short name (SHORT), or the
    key itself for one not registered (a variant such as ddp-bf16); ``detail`` in parentheses
    after it ("DDP (batch_size=64)")."""
    return SHORT.get(method, method) + (f" ({detail})" if detail else "")


# ------------------------------------------------------------------ naming a method
REFERENCE = re.compile(r"^(?P<where>[^:]+):(?P<cls>[A-Za-z_][A-Za-z0-9_]*)$")


def entry_points() -> dict[str, str]:
    """{name: package.module:Class} of the installed packages' methods (nothing is imported)."""
    return {ep.name: ep.value for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def derived_key(reference: str) -> str:
    """A user's method's key, from its class name: RingAllReduce -> ring_all_reduce."""
    cls = reference.rpartition(":")[2]
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", cls).lower()


def key_of(method: str) -> str:
    """The key (folder, result file, report name) a --method value will run under."""
    s = find(method)
    if s is not None:
        return s.key
    return method if method in entry_points() else derived_key(method)


def is_name(method: object) -> bool:
    """Whether ``method`` can name a method (whether its class loads is the training side's to
    say): a registered key, an entry point's name or a reference."""
    return isinstance(method, str) and bool(find(method) or REFERENCE.match(method)
                                            or method in entry_points())


def check_name(method: str) -> None:
    """Bad input unless ``method`` can name a method (:func:`is_name`)."""
    if is_name(method):
        return
    raise ConfigError(f"unknown method {method!r}; choose one of: {', '.join(METHOD_ORDER)}"
                      f"{''.join(', ' + n for n in entry_points())}, or a class of your own as "
                      f"path/to/file.py:Class or package.module:Class (docs/methods.md)")


def absolute(method: str) -> str:
    """``method`` with the file of a ``path/to/file.py:Class`` reference made absolute, so it
    names the same class from any folder (a notebook's kernel, a reproduction)."""
    m = REFERENCE.match(method)
    if find(method) or not m or not m["where"].endswith(".py"):
        return method
    return f"{os.path.abspath(m['where'])}:{m['cls']}"


def result_file_of(method: str) -> str:
    s = find(method)
    return s.result_file if s else f"results_{key_of(method)}.json"


def server_ranks(method: str, ps_servers: int) -> int:
    """How many ranks serve: ``ps_servers`` for a parameter server, none otherwise."""
    return ps_servers if spec(method).serves else 0
