"""Loading a method's class: the built-ins, an installed package's entry point, or a user's
``path/to/file.py:Class`` / ``package.module:Class``, all through the one registry of specs
(labkit.core.methods). A reference that does not load is bad input in one line naming the
method and the user's file and line, never a traceback.
"""
from __future__ import annotations

import inspect
import os
import traceback
from typing import Optional

from labkit.core import methods, plugins
from labkit.core.errors import ConfigError, Exhausted, RunFailed
from labkit.core.config import TrainConfig
from labkit.core.methods import MethodSpec
from labkit.workloads.catalog import raised_line

from .base import Strategy


def load_method(method: str) -> type[Strategy]:
    """The class ``method`` names, its spec registered (once per process)."""
    methods.check_name(method)
    s = methods.find(method)
    if s is not None:
        ref, key = s.source, s.key
    else:
        ref = methods.entry_points().get(method, method)
        key = methods.key_of(method)
    cls = _import_class(method, ref)
    if s is None:
        methods.register(spec_of(cls, key, ref), method)
    return cls


def spec_of(cls: type[Strategy], key: str, ref: str) -> MethodSpec:
    """A user's method's spec, from its class's attributes (docs/methods.md)."""
    title = cls.title or cls.__name__
    return MethodSpec(key, title, title, f"results_{key}.json", tuple(cls.phases),
                      bool(cls.serves), bool(cls.exact), ref)


def _import_class(method: str, ref: str) -> type[Strategy]:
    return plugins.load_class("method", method, ref, Strategy,
                              "a method subclasses labkit.training.sync.Strategy (docs/methods.md)")


class MethodRaised(Exhausted):
    """A method or a workload of one's own raised while training: said as one line naming it,
    the user's file and line and where the run was, by the rank that raised (like the machine
    running out: only that rank knows), the traceback kept in the rank's log."""


def method_failure(e: BaseException, method: str, rank: int, at: str) -> Optional[MethodRaised]:
    """MethodRaised for an exception raised in a user's method's file, else None."""
    s = methods.find(method)
    if s is None or s.builtin or not isinstance(e, Exception) or isinstance(e, RunFailed):
        return None
    try:
        path = os.path.abspath(inspect.getsourcefile(load_method(method)))
    except (ConfigError, TypeError, OSError):
        return None
    if not any(os.path.abspath(f.filename) == path for f in traceback.extract_tb(e.__traceback__)):
        return None
    what = (str(e).strip().splitlines() or [""])[0]
    return MethodRaised(s.key, f"rank {rank}: {type(e).__name__}: {what} at {plugins.user_frame(e, path)} "
                               f"({at})")


def workload_failure(e: BaseException, cfg: TrainConfig, rank: int, at: str) -> Optional[MethodRaised]:
    """MethodRaised for an exception raised in a user's workload's file (its loss, its model's
    forward, its figures) while the method trained, else None."""
    line = raised_line(e, cfg.workload)
    return MethodRaised(methods.key_of(cfg.method), f"rank {rank}: {line} ({at})") if line else None
