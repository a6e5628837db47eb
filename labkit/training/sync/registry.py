"""Loading a method's class: the built-ins, an installed package's entry point, or a user's
``path/to/file.py:Class`` / ``package.module:Class``, all through the one registry of specs
(labkit.core.methods). A reference that does not load is bad input in one line naming the
method and the user's file and line, never a traceback.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
import sysconfig
import traceback
from typing import Optional

from labkit.core import methods
from labkit.core.errors import ConfigError, Exhausted, RunFailed
from labkit.core.methods import MethodSpec

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
    where, _, name = ref.rpartition(":")
    module = _import_file(method, where) if where.endswith(".py") else _import_module(method, where)
    cls = getattr(module, name, None)
    if cls is None:
        raise ConfigError(f"method {method}: {where} has no class {name}")
    if not (inspect.isclass(cls) and issubclass(cls, Strategy)):
        raise ConfigError(f"method {method}: {name} ({_where_defined(cls, where)}) is not a "
                          f"method: a method subclasses labkit.training.sync.Strategy "
                          f"(docs/methods.md)")
    return cls


def _import_module(method: str, name: str):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name and name.startswith(e.name):
            raise ConfigError(f"method {method}: no module {name!r} (a file is named as "
                              f"path/to/file.py:Class)") from None
        raise ConfigError(_import_failure(method, e, None)) from None
    except Exception as e:  # noqa: BLE001 - the user's module failed: one line
        raise ConfigError(_import_failure(method, e, None)) from None


def _import_file(method: str, path: str):
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise ConfigError(f"method {method}: no file {path}")
    # one module per file, whatever folder it was named from (so a method loads once)
    name = "labkit_method_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up by name
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - the user's file failed: one line
        del sys.modules[name]
        raise ConfigError(_import_failure(method, e, path)) from None
    return module


def _import_failure(method: str, e: BaseException, path: Optional[str]) -> str:
    """One line: the method, the user's file and line, and what went wrong there."""
    if isinstance(e, SyntaxError) and e.filename:
        return f"method {method}: {e.filename}:{e.lineno}: SyntaxError: {e.msg}"
    return f"method {method}: {user_frame(e, path)}: {type(e).__name__}: {e}"


def user_frame(e: BaseException, path: Optional[str] = None) -> str:
    """``file:line`` of the innermost frame of ``e`` in the user's code: ``path`` if given,
    else the innermost frame outside labkit and the Python and torch libraries."""
    frames = traceback.extract_tb(e.__traceback__)
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    libs = (here, *{sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib")})
    mine = [f for f in frames if (os.path.abspath(f.filename) == path if path else
                                  not f.filename.startswith(libs) and not f.filename.startswith("<"))]
    f = (mine or frames or [None])[-1]
    return f"{f.filename}:{f.lineno}" if f else "?"


def _where_defined(obj, fallback: str) -> str:
    try:
        return f"{inspect.getsourcefile(obj)}:{inspect.getsourcelines(obj)[1]}"
    except (TypeError, OSError):
        return fallback


class MethodRaised(Exhausted):
    """A method of one's own raised while training: said as one line naming the method, the
    user's file and line and where the run was, by the rank that raised (like the machine
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
    return MethodRaised(s.key, f"rank {rank}: {type(e).__name__}: {what} at {user_frame(e, path)} "
                               f"({at})")
