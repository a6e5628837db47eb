"""Loading a plug-in's class (a method, a workload) from a user's ``path/to/file.py:Class`` or
``package.module:Class``. A reference that does not load is bad input in one line naming the
plug-in and the user's file and line, never a traceback (ConfigError)."""
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

from .errors import ConfigError


def load_class(kind: str, name: str, ref: str, base: type, hint: str) -> type:
    """The class ``ref`` names, which must subclass ``base``; ``kind`` ("method", "workload")
    and ``name`` (what the user wrote) begin every error line, ``hint`` ends the one for a class
    of the wrong kind (e.g. "a method subclasses labkit.training.sync.Strategy (docs/methods.md)")."""
    where, _, cls_name = ref.rpartition(":")
    module = (_import_file(kind, name, where) if where.endswith(".py")
              else _import_module(kind, name, where))
    cls = getattr(module, cls_name, None)
    if cls is None:
        raise ConfigError(f"{kind} {name}: {where} has no class {cls_name}")
    if not (inspect.isclass(cls) and issubclass(cls, base)):
        raise ConfigError(f"{kind} {name}: {cls_name} ({where_defined(cls, where)}) is not a "
                          f"{kind}: {hint}")
    return cls


def _import_module(kind: str, name: str, module: str):
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and module.startswith(e.name):
            raise ConfigError(f"{kind} {name}: no module {module!r} (a file is named as "
                              f"path/to/file.py:Class)") from None
        raise ConfigError(_import_failure(kind, name, e, None)) from None
    except Exception as e:  # noqa: BLE001 - the user's module failed: one line
        raise ConfigError(_import_failure(kind, name, e, None)) from None


def _import_file(kind: str, name: str, path: str):
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise ConfigError(f"{kind} {name}: no file {path}")
    # one module per file, whatever folder it was named from (so a plug-in loads once)
    mod = f"labkit_{kind}_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    if mod in sys.modules:
        return sys.modules[mod]
    spec = importlib.util.spec_from_file_location(mod, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod] = module  # dataclasses and pickling look the module up by name
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - the user's file failed: one line
        del sys.modules[mod]
        raise ConfigError(_import_failure(kind, name, e, path)) from None
    return module


def _import_failure(kind: str, name: str, e: BaseException, path: Optional[str]) -> str:
    """One line: the plug-in, the user's file and line, and what went wrong there."""
    if isinstance(e, SyntaxError) and e.filename:
        return f"{kind} {name}: {e.filename}:{e.lineno}: SyntaxError: {e.msg}"
    return f"{kind} {name}: {user_frame(e, path)}: {type(e).__name__}: {e}"


def user_frame(e: BaseException, path: Optional[str] = None) -> str:
    """``file:line`` of the innermost frame of ``e`` in the user's code: ``path`` if given,
    else the innermost frame outside labkit and the Python and torch libraries."""
    frames = traceback.extract_tb(e.__traceback__)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    libs = (here, *{sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib")})
    mine = [f for f in frames if (os.path.abspath(f.filename) == path if path else
                                  not f.filename.startswith(libs) and not f.filename.startswith("<"))]
    f = (mine or frames or [None])[-1]
    return f"{f.filename}:{f.lineno}" if f else "?"


def where_defined(obj, fallback: str) -> str:
    """``file:line`` where ``obj`` is defined, else ``fallback``."""
    try:
        return f"{inspect.getsourcefile(obj)}:{inspect.getsourcelines(obj)[1]}"
    except (TypeError, OSError):
        return fallback
