"""Finding a workload's class by name: a built-in (``images``, ``lm``), or a user's
``path/to/file.py:Class`` / ``package.module:Class`` (labkit.core.plugins loads it). A name
that does not load is bad input in one line (ConfigError), never a traceback."""
from __future__ import annotations

import dataclasses
import importlib
import os
from contextlib import contextmanager
from typing import Iterator, Optional

from labkit.core import builtins, params, plugins
from labkit.core.config import (DEFAULT_WORKLOAD, ConfigError, TrainConfig, check_optimizer,
                                resolve_machine)

from .contract import Workload

#: the built-in workloads: name -> module:Class, as their classes declare them (labkit.core.
#: builtins is written from the classes: :func:`builtin_classes`)
BUILTIN = {name: d["source"] for name, d in builtins.WORKLOADS.items()}
DEFAULT = DEFAULT_WORKLOAD
HINT = "a workload subclasses labkit.workloads.Workload (docs/workloads.md)"


def builtin_classes() -> list[type[Workload]]:
    """Every built-in workload's class: in each package of labkit/workloads, a Workload
    subclass that declares a ``name`` of its own (labkit.workloads.contract). Found by looking,
    so that a new built-in workload is one new package and nothing lists them."""
    import pkgutil

    found = []
    for info in pkgutil.iter_modules([os.path.dirname(__file__)]):
        if info.ispkg:
            module = importlib.import_module(f"{__package__}.{info.name}")
            found += [c for c in vars(module).values() if isinstance(c, type)
                      and issubclass(c, Workload) and vars(c).get("name") and c.__module__ == module.__name__]
    return found


def is_builtin(name: str) -> bool:
    return name in BUILTIN


def load_workload(name: str) -> type[Workload]:
    """The class ``name`` names (a built-in's, or a user's file or module)."""
    if name in BUILTIN:
        module, _, cls = BUILTIN[name].partition(":")
        return getattr(importlib.import_module(module), cls)
    if ":" not in name:
        raise ConfigError(f"unknown workload {name!r}: choose one of {', '.join(BUILTIN)}, or name "
                          f"your own as path/to/file.py:Class (docs/workloads.md)")
    return plugins.load_class("workload", name, name, Workload, HINT)


def raised_line(e: BaseException, name: str) -> Optional[str]:
    """"workload NAME: FILE:LINE in FUNCTION(): TypeError: ..." for an exception ``e`` raised in
    the file of a user's workload ``name``, else None (a built-in's, labkit's or torch's own)."""
    if name in BUILTIN or not isinstance(e, Exception) or isinstance(e, ConfigError):
        return None
    try:
        path = plugins.source_file(load_workload(name))
    except ConfigError:
        return None
    where = plugins.raised_in(e, path) if path else None
    if where is None:
        return None
    what = (str(e).strip().splitlines() or [""])[0]
    return f"workload {name}: {where}: {type(e).__name__}: {what}".rstrip(": ")


@contextmanager
def own_code(name: str) -> Iterator[None]:
    """Inside, an exception raised in the file of the user's workload ``name`` (its resolve,
    datasets, model or loss, while the launcher checks it) becomes one line (ConfigError),
    the way a file that fails to import already is; anything else passes unchanged."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - only the user's own code is turned into a line
        line = raised_line(e, name)
        if line is None:
            raise
        raise ConfigError(line) from None


def absolute(name: str) -> str:
    """``name`` with the file of a ``path/to/file.py:Class`` reference made absolute, so it
    names the same class from any folder (the ranks run in their method's folder)."""
    where, _, cls = name.rpartition(":")
    if name in BUILTIN or not where.endswith(".py"):
        return name
    return f"{os.path.abspath(where)}:{cls}"


def make_workload(cfg: TrainConfig) -> Workload:
    """The workload of a resolved ``cfg``."""
    return load_workload(cfg.workload)(cfg)


def resolve(cfg: TrainConfig, cuda_available: bool, world_size: int = 1) -> TrainConfig:
    """Fill in every automatic (None) field for this machine and workload, and check ranges:
    the machine's part (labkit.core.config.resolve_machine), then the workload's (its dataset,
    model, input size and learning rate). ConfigError with one line naming the problem."""
    c = resolve_machine(dataclasses.replace(cfg, workload=absolute(cfg.workload)), cuda_available)
    cls = load_workload(c.workload)
    cls.resolve(c, cuda_available, c.trainers(world_size))
    if c.grad_clip is None:
        c.grad_clip = cls.grad_clip
    params.check_ranges(params.options_of(cls.Options, c))  # as its Options declares them
    check_optimizer(c)
    return c
