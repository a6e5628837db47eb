"""The options of a method or workload of one's own: its class's ``Options`` dataclass
(labkit.training.sync.Strategy.Options, labkit.workloads.Workload.Options), whose fields become
flags of every command that trains (`labkit run`, `experiment`, `sweep`, `bench`, `check`, and
a rank's own ``-m labkit.train``), listed by ``--help`` once the method or workload is named,
and whose values travel in the config's ``options`` (labkit.core.config.General.options): the
record of the run, resolved.json, the ranks. A built-in's options are fields of TrainConfig.

A command line is read twice: first for the names of the methods and the workload (the other
flags are not known yet), then, with their options' flags added, for everything.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
from typing import Callable, Iterable, Optional

from labkit.core import methods, params
from labkit.core.config import VARIANTS, ConfigError
from labkit.workloads.catalog import is_builtin, load_workload


def classes(names: Iterable[str], workload: Optional[str]) -> list[type]:
    """The Options dataclasses of the methods and the workload of one's own among ``names``
    and ``workload`` (a built-in's are TrainConfig's already), each once; none that has no
    fields."""
    own = [n for n in names if n and methods.is_name(n) and not _builtin_method(n)]
    found = []
    if own:  # a method of one's own imports torch (seconds): only when one is named
        from .sync.registry import load_method

        # by its absolute reference: the spec registered names the file from any folder
        found = [load_method(methods.absolute(n)).Options for n in own]
    if workload and not is_builtin(workload):
        found.append(load_workload(workload).Options)
    return [c for c in dict.fromkeys(found) if dataclasses.fields(c)]


def _builtin_method(name: str) -> bool:
    s = methods.find(name)
    return s is not None and s.builtin or name in VARIANTS


def add_flags(parser: argparse.ArgumentParser, found: list[type], owner: str = "") -> None:
    """Each field of the ``found`` Options classes as a flag of ``parser``; one line naming the
    flag where it is one labkit has already."""
    for cls in found:
        try:
            params.add_arguments(parser, cls, defaults=False)
        except argparse.ArgumentError as e:
            raise ConfigError(f"{cls.__qualname__} of {cls.__module__}: its option {e.argument_name} "
                              f"is a flag labkit has already: give it another name") from None


def names_in(ns: argparse.Namespace) -> tuple[list[str], Optional[str]]:
    """The method names and the workload a first reading of a command line found."""
    named = [getattr(ns, "method", None)]
    for many in ("methods", "variants"):
        named += str(getattr(ns, many, "") or "").split(",")
    return [n.strip() for n in named if n and n.strip()], getattr(ns, "workload", None)


def parse(build: Callable[[list[type]], argparse.ArgumentParser], argv: list[str]
          ) -> tuple[argparse.Namespace, tuple[str, ...]]:
    """``argv`` parsed by ``build(options)``, the options classes of the plug-ins it names
    (:func:`classes`) found by a first, quiet reading; and the names of those options' fields.
    A first reading that fails (a mistyped flag, a method that does not load) adds nothing:
    the second says what is wrong, in one line."""
    found: list[type] = []
    quiet = [a for a in argv if a not in ("-h", "--help")]
    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            ns, _ = build([]).parse_known_args(quiet)
        found = classes(*names_in(ns))
    except (SystemExit, ConfigError):
        pass
    ns = build(found).parse_args(argv)
    return ns, tuple(f.name for c in found for f in dataclasses.fields(c))


def into_options(values: dict, names: tuple[str, ...]) -> dict:
    """``values`` with the plug-ins' options (``names``) moved into its ``options``."""
    own = {k: values.pop(k) for k in names if k in values}
    if own:
        values["options"] = {**values.get("options", {}), **own}
    return values
