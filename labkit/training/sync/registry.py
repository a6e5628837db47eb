"""Loading a method's class: the built-ins, an installed package's entry point, or a user's
``path/to/file.py:Class`` / ``package.module:Class``, all through the one registry of specs
(labkit.core.methods). A reference that does not load is bad input in one line naming the
method and the user's file and line, never a traceback.
"""
from __future__ import annotations

import importlib
import inspect
import os
import pkgutil
import traceback
from typing import Optional

from labkit.core import methods, plugins
from labkit.core.errors import ConfigError, Exhausted, RunFailed
from labkit.core.config import TrainConfig
from labkit.core.methods import MethodSpec
from labkit.workloads.catalog import raised_line

from .base import Strategy


def load_method(method: str) -> type[Strategy]:
    """The class ``method`` names, its spec registered (once per process). A built-in's class
    must declare what labkit.core.builtins says of it (that file is written from the classes)."""
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
    elif s.builtin and spec_of(cls, key, ref, builtin=True) != s:
        raise ConfigError(f"method {key}: its class declares another spec than labkit/core/builtins.py "
                          f"holds: run `python tools/builtins.py` to write that file again")
    return cls


def builtin_classes() -> list[type[Strategy]]:
    """Every built-in method's class, in table order: in this package, each Strategy subclass
    that declares a ``key`` of its own (labkit.training.sync.base). Found by looking, so that a
    new built-in method is one new module and nothing lists them."""
    found = []
    for info in pkgutil.iter_modules([os.path.dirname(__file__)]):
        module = importlib.import_module(f"{__package__}.{info.name}")
        found += [c for c in vars(module).values() if inspect.isclass(c) and issubclass(c, Strategy)
                  and c.__module__ == module.__name__ and vars(c).get("key")]
    return sorted(found, key=lambda c: c.order)


def spec_of(cls: type[Strategy], key: str, ref: str, builtin: bool = False) -> MethodSpec:
    """A method's spec, from its class's declarations (labkit.training.sync.base.Strategy):
    its names and result file as the class itself declares them (a subclass of another method
    is a method of its own), the rest as it inherits them."""
    title = own(cls, "title") or cls.__name__
    return MethodSpec(key, title, own(cls, "short") or title,
                      own(cls, "result_file") or f"results_{key}.json", tuple(cls.phases),
                      bool(cls.serves), bool(cls.exact), ref, builtin, bool(cls.bound))


def own(cls: type, name: str):
    """What ``cls`` itself declares as ``name`` (Strategy's default where it does not): the
    declarations that name one method (its title, result file, variants) are not inherited."""
    return vars(cls).get(name, getattr(Strategy, name))


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
