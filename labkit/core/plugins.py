"""Loading a plug-in's class (a method, a workload) from a user's ``path/to/file.py:Class`` or
``package.module:Class``. A reference that does not load is bad input in one line naming the
plug-in and the user's file and line, never a traceback (ConfigError)."""
from __future__ import annotations

import hashlib
import importlib
import importlib.abc
import importlib.util
import inspect
import os
import sys
import sysconfig
import traceback
from typing import Optional

from .errors import ConfigError

#: the plug-in files this process loaded, and its children inherit: one "module=path" a line.
#: A process that unpickles an object of a plug-in's class (a DataLoader worker sent a dataset
#: whose class the user's workload file defines) imports the file under the same module name
ENV = "LABKIT_PLUGIN_FILES"


class _PluginFiles(importlib.abc.MetaPathFinder):
    """Finds ``labkit_<kind>_<hash>`` modules: the plug-in files :data:`ENV` names."""

    def find_spec(self, name, path=None, target=None):
        if not name.startswith("labkit_"):
            return None
        for entry in os.environ.get(ENV, "").splitlines():
            mod, _, file = entry.partition("=")
            if mod == name and os.path.isfile(file):
                return importlib.util.spec_from_file_location(name, file)
        return None


if not any(isinstance(f, _PluginFiles) for f in sys.meta_path):  # once, across re-imports
    sys.meta_path.append(_PluginFiles())


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
    known = os.environ.get(ENV, "").splitlines()
    if f"{mod}={path}" not in known:  # for the processes this one starts (see ENV)
        os.environ[ENV] = "\n".join([*known, f"{mod}={path}"])
    return module


def _import_failure(kind: str, name: str, e: BaseException, path: Optional[str]) -> str:
    """One line: the plug-in, the user's file and line, and what went wrong there."""
    if isinstance(e, SyntaxError) and e.filename:
        return f"{kind} {name}: {e.filename}:{e.lineno}: SyntaxError: {e.msg}"
    return f"{kind} {name}: {user_frame(e, path)}: {type(e).__name__}: {e}"


def user_frame(e: BaseException, path: Optional[str] = None) -> str:
    """``file:line`` of the innermost frame of ``e`` in the user's code: ``path`` if given,
    else the innermost frame outside labkit and the Python and torch libraries ("?" without
    frames; the innermost frame where none is the user's)."""
    frames = traceback.extract_tb(e.__traceback__)
    f = (_own_frames(frames, path) or frames or [None])[-1]
    return f"{f.filename}:{f.lineno}" if f else "?"


def own_frame(e: BaseException) -> Optional[str]:
    """``file:line`` of the innermost frame of ``e`` outside labkit and the Python and torch
    libraries, or None where every frame is theirs (a torch module the user only built)."""
    mine = _own_frames(traceback.extract_tb(e.__traceback__), None)
    return f"{mine[-1].filename}:{mine[-1].lineno}" if mine else None


def _own_frames(frames, path: Optional[str]) -> list:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    libs = (here, *{sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib")})
    return [f for f in frames if (os.path.abspath(f.filename) == path if path else
                                  not f.filename.startswith(libs) and not f.filename.startswith("<"))]


def raised_in(e: BaseException, path: str) -> Optional[str]:
    """``file:line in function()`` of the innermost frame of ``e`` in the file ``path`` (a
    user's plug-in), or None where ``e`` did not pass through that file."""
    path = os.path.abspath(path)
    mine = [f for f in traceback.extract_tb(e.__traceback__) if os.path.abspath(f.filename) == path]
    return f"{mine[-1].filename}:{mine[-1].lineno} in {mine[-1].name}()" if mine else None


def source_file(cls: type) -> Optional[str]:
    """The absolute path of the file ``cls`` is defined in, or None."""
    try:
        return os.path.abspath(inspect.getsourcefile(cls))
    except (TypeError, OSError):
        return None


def where_defined(obj, fallback: str) -> str:
    """``file:line`` where ``obj`` is defined, else ``fallback``."""
    try:
        return f"{inspect.getsourcefile(obj)}:{inspect.getsourcelines(obj)[1]}"
    except (TypeError, OSError):
        return fallback
