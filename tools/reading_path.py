"""What a student reads to understand one training step of a method: the functions, their
lines, the files (issue 58: at most 250 lines of functions in at most 4 files per guide method).

    .venv/bin/python tools/reading_path.py [ddp allreduce ps] [--root DIR] [--list] [--instruments]

Static (ast only, nothing is imported), deterministic, and simple on purpose. What counts:

1. The entry is ``labkit/train.py``. From its top-level code the calls are followed (see 4) to
   find the *step*: the first function reached, breadth first in source order, that calls
   ``.backward()``, or the caller of that function, and so on up, the first that its own
   caller calls inside a loop (the loop over the batches, not a step's own loop over its
   micro-batches, whose body enters the method's ``accumulating()``). A function that calls ``.backward()``
   with no loop around it up to the entry (a check of a workload's first batch, run once) is
   not the step: the search goes on. While searching, a function of the package passed to a
   call is followed as called (a rank's work handed to ``lifecycle.run_rank``); in the step
   it is not (``meter.next_batch(it, self.to_device)`` is an instrument's call, read where
   it is written).
2. One step is what runs between two batches:
   - the body of the loop, in the step's caller, around the call of the step (fetching the
     batch, the instruments it calls inline), counted by its own lines, not the whole caller;
   - the step function, and every function of the package it calls, transitively;
   - the method's code the step runs without calling it by name: a bound method of the
     method's classes referenced without being called (handed to torch as a hook:
     ``register_..._hook(self.f)``, ``partial(self.f, ...)``, or returned as one), and the
     calls written inside a ``register_*hook(...)`` call's arguments (a wrapper such as
     ``self._timed(hook)``).
   Set-up, logging, checkpoints, validation and the CLI are outside it unless the step calls
   them: they are never reached from the step. The instruments (``INSTRUMENTS``: the modules
   that measure a step) are named components around it: a call into one is read where it is
   written, its module is not followed (issue 58: "profiling, checkpointing and metrics as
   named components around it"); so are the step's options that are off by default
   (``labkit.training.step_options``: --grad-accum's micro-batches, --grad-clip).
3. A function counts with all its lines, from its ``def`` (decorators included) to its last
   line: docstring, comments and nested functions included, every branch included (static:
   the script cannot know a config, and a student reads every branch of what the step calls).
   Each function counts once per method; the files are the distinct files of those functions.
4. Calls are resolved through the package's own imports only (torch and the standard library
   are not read): names of the module, ``from``-imports, modules; ``obj.f`` through the type of
   ``obj`` (a parameter's annotation, a local or attribute assigned a constructor or a call
   whose return annotation names a class, ``self``); ``Class(...)`` is its ``__init__``;
   reading a ``@property`` is calling it. An object whose class is a base of the method's
   class (the loop's ``Strategy``) is the method's class: its hooks resolve on that class's
   MRO, so ``s.after_backward()`` reads DDP's for ddp and the parameter server's for ps.
5. The method's class is the one that declares its key (``key = "ddp"``), whose
   ``package.module:Class`` labkit/core/builtins.py names (its spec's ``source``).

``obj(...)`` is ``__call__``, ``super().f`` the next class's ``f`` in the method's MRO. Calls
the script cannot resolve (an unannotated parameter's methods, a callback from a list, torch's
own code) are not read: the count is a floor, the same floor for every method.

Prints per method the total lines and the number of files (``--list``: each function read,
``module:Class.function  lines``, first), and beside them the same count with the instruments
followed too, so that what the rule leaves out stays in sight.
"""
from __future__ import annotations

import argparse
import ast
import os
import sys
from typing import Optional

GUIDE = ("ddp", "allreduce", "ps")
ENTRY = "labkit.train"
REGISTRY = "labkit.core.builtins"
#: the instruments: modules that measure a step (its parts' times, the epoch's figures, the
#: bytes on the wire). The step calls them as named components, read at the call site
#: (``meter.step_ends(...)``, ``mark("sync")``), like torchtitan's metrics and profiler.
INSTRUMENTS = ("labkit.training.instruments.meter", "labkit.training.instruments.timers",
               "labkit.training.instruments.memory", "labkit.training.sync.collectives",
               "labkit.training.step_options")


class Module:
    def __init__(self, name: str, path: str):
        self.name, self.path = name, path
        with open(path) as f:
            self.tree = ast.parse(f.read(), path)
        self.package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        self.defs: dict[str, ast.AST] = {}      # top-level functions and classes
        self.imports: dict[str, tuple] = {}     # name -> ("module", m) | ("name", m, n)
        for node in self.tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.defs[node.name] = node
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        self.imports[a.asname] = ("module", a.name)
                    else:
                        top = a.name.split(".")[0]
                        self.imports.setdefault(top, ("module", top))
            elif isinstance(node, ast.ImportFrom):
                base = self._absolute(node)
                for a in node.names:
                    self.imports[a.asname or a.name] = ("name", base, a.name)

    def _absolute(self, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        parts = self.package.split(".")
        parts = parts[:len(parts) - node.level + 1]
        return ".".join(parts + ([node.module] if node.module else []))


class Package:
    """Every module under ``root/<top>``, parsed once."""

    def __init__(self, root: str, top: str = "labkit"):
        self.root, self.top, self.modules = root, top, {}
        for folder, dirs, files in os.walk(os.path.join(root, top)):
            dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__pycache__")))
            for f in sorted(files):
                if f.endswith(".py"):
                    path = os.path.join(folder, f)
                    rel = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                    name = rel[:-len(".__init__")] if rel.endswith(".__init__") else rel
                    self.modules[name] = Module(name, path)

    def lookup(self, module: str, name: str, seen=()) -> Optional[tuple]:
        """What ``name`` is in ``module``: ("module", m), ("class", m, node), ("func", m, node)."""
        m = self.modules.get(module)
        if m is None or (module, name) in seen:
            return None
        seen = seen + ((module, name),)
        node = m.defs.get(name)
        if isinstance(node, ast.ClassDef):
            return ("class", module, node)
        if node is not None:
            return ("func", module, node, None)
        imp = m.imports.get(name)
        if imp is None:
            return None
        if imp[0] == "module":
            return ("module", imp[1]) if imp[1] in self.modules else None
        _, base, n = imp
        if f"{base}.{n}" in self.modules:
            return ("module", f"{base}.{n}")
        return self.lookup(base, n, seen)


def _decorators(node) -> list[str]:
    return [d.id if isinstance(d, ast.Name) else d.attr if isinstance(d, ast.Attribute) else ""
            for d in getattr(node, "decorator_list", [])]


def _first_line(node) -> int:
    return min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])


class Reader:
    """Follows one method's step through the package."""

    def __init__(self, pkg: Package, method_class: Optional[tuple]):
        self.pkg = pkg
        self.method_class = method_class  # (module, ClassDef) of the method
        self.mro_cache: dict = {}
        self.attr_cache: dict = {}

    # ---------------------------------------------------------------- classes
    def mro(self, module: str, cls: ast.ClassDef) -> list[tuple[str, ast.ClassDef]]:
        key = (module, cls.name)
        if key not in self.mro_cache:
            self.mro_cache[key] = []  # a cycle reads as no bases
            out = [(module, cls)]
            for b in cls.bases:
                t = self.value(b, {}, module, None)
                if t and t[0] == "class":
                    out += [c for c in self.mro(t[1], t[2]) if c not in out]
            self.mro_cache[key] = out
        return self.mro_cache[key]

    def dispatch(self, module: str, cls: ast.ClassDef) -> tuple[str, ast.ClassDef]:
        """The class an instance of ``cls`` is, for this method: the method's class where
        ``cls`` is one of its bases (the loop's Strategy)."""
        if self.method_class is not None:
            mm, mc = self.method_class
            if any(m == module and c.name == cls.name for m, c in self.mro(mm, mc)):
                return self.method_class
        return module, cls

    def member(self, module: str, cls: ast.ClassDef, name: str) -> Optional[tuple]:
        for m, c in self.mro(module, cls):
            for node in c.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                    return ("func", m, node, c)
        return None

    def attribute_type(self, module: str, cls: ast.ClassDef, name: str) -> Optional[tuple]:
        """The type of ``self.<name>``: from an annotation in a class body, or an assignment to
        ``self.<name>`` in one of the class's methods."""
        key = (module, cls.name, name)
        if key in self.attr_cache:
            return self.attr_cache[key]
        self.attr_cache[key] = None
        found = None
        for m, c in self.mro(module, cls):
            for node in c.body:
                if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                        and node.target.id == name):
                    found = found or self.annotation(node.annotation, m)
            for fn in c.body:
                if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or found:
                    continue
                for node in ast.walk(fn):
                    targets, ann = [], None
                    if isinstance(node, ast.Assign):
                        targets, value = node.targets, node.value
                    elif isinstance(node, ast.AnnAssign):
                        targets, value, ann = [node.target], node.value, node.annotation
                    if not any(isinstance(t, ast.Attribute) and t.attr == name
                               and isinstance(t.value, ast.Name) and t.value.id == "self"
                               for t in targets):
                        continue
                    t = self.annotation(ann, m) if ann is not None else None
                    if t is None and value is not None:
                        t = self.value(value, self.env(fn, m, c), m, c)
                    if t and t[0] == "inst":
                        found = t
                        break
            if found:
                break
        self.attr_cache[key] = found
        return found

    # ---------------------------------------------------------------- values
    def annotation(self, node, module: str) -> Optional[tuple]:
        """("inst", m, ClassDef) for an annotation naming a class of the package."""
        if node is None:
            return None
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            try:
                node = ast.parse(node.value, mode="eval").body
            except SyntaxError:
                return None
        if isinstance(node, ast.Subscript):  # Optional[X], type[X]: X
            inner = node.slice
            return self.annotation(inner.elts[0] if isinstance(inner, ast.Tuple) else inner, module)
        if isinstance(node, ast.BinOp):  # X | None
            return self.annotation(node.left, module) or self.annotation(node.right, module)
        t = self.value(node, {}, module, None)
        return ("inst", t[1], t[2]) if t and t[0] == "class" else None

    def env(self, fn, module: str, cls: Optional[ast.ClassDef]) -> dict:
        """The types of a function's names: ``self``, annotated parameters, assigned locals."""
        env: dict = {}
        args = fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
        for i, a in enumerate(args):
            if i == 0 and cls is not None and a.arg == "self":
                env["self"] = ("inst", module, cls)
            elif a.annotation is not None:
                env[a.arg] = self.annotation(a.annotation, module)
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign):
                pairs = [(target, node.value) for target in node.targets]
                for target, value in list(pairs):  # a, b = x, y
                    if (isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple)
                            and len(target.elts) == len(value.elts)):
                        pairs += list(zip(target.elts, value.elts))
                for target, value in pairs:
                    t = self.value(value, env, module, cls) if isinstance(target, ast.Name) else None
                    if t:
                        env.setdefault(target.id, t)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                env.setdefault(node.target.id, self.annotation(node.annotation, module))
        return env

    def value(self, node, env: dict, module: str, cls) -> Optional[tuple]:
        """What an expression is: ("module", m), ("class", m, C), ("inst", m, C), or
        ("func", m, fn, owner class or None)."""
        if isinstance(node, ast.Name):
            if node.id in env:
                return env[node.id]
            return self.pkg.lookup(module, node.id)
        if isinstance(node, ast.Attribute):
            t = self.value(node.value, env, module, cls)
            if t is None:
                return None
            if t[0] == "module":
                return self.pkg.lookup(t[1], node.attr)
            if t[0] == "super":  # super().f: the next class after the owner in self's MRO
                mro = self.mro(*self.dispatch(t[1], t[2]))
                after = [i for i, (m, c) in enumerate(mro) if m == t[1] and c.name == t[2].name]
                for m, c in mro[after[0] + 1 if after else len(mro):]:
                    got = self.member(m, c, node.attr)
                    if got is not None and got[3] is c:
                        return got
                return None
            if t[0] in ("inst", "class"):
                m, c = self.dispatch(t[1], t[2]) if t[0] == "inst" else (t[1], t[2])
                got = self.member(m, c, node.attr)
                if got is not None:
                    return got
                if t[0] == "inst":
                    return self.attribute_type(m, c, node.attr)
            return None
        if isinstance(node, ast.Call):
            if isinstance(node.func, ast.Name) and node.func.id == "super" and cls is not None:
                return ("super", module, cls)
            f = self.value(node.func, env, module, cls)
            if f is None:
                return None
            if f[0] == "class":
                return ("inst", f[1], f[2])
            if f[0] == "func":
                return self.annotation(f[2].returns, f[1])
        return None


class Walk:
    """The functions one method's step reads."""

    def __init__(self, pkg: Package, method: Optional[str], instruments: bool = False):
        self.pkg, self.instruments = pkg, instruments
        self.reader = Reader(pkg, method_class(pkg, method) if method else None)
        self.read: dict[tuple[str, str], int] = {}  # (module, qualname) -> lines
        self.files: set[str] = set()

    def callees(self, body_nodes, fn, module: str, cls, passed: bool = False) -> list[tuple]:
        """The package's functions that ``body_nodes`` call, in source order; ``passed``: and
        those passed to a call as an argument (the search for the step, 1)."""
        r = self.reader
        env = r.env(fn, module, cls) if fn is not None else {}
        out = []
        for top in body_nodes:
            for node in ast.walk(top):
                t = None
                if isinstance(node, ast.Call):
                    t = r.value(node.func, env, module, cls)
                    if t and t[0] == "class":  # Class(...): its __init__
                        t = r.member(t[1], t[2], "__init__")
                    elif t and t[0] == "inst":  # obj(...): its __call__
                        t = r.member(*r.dispatch(t[1], t[2]), "__call__")
                    for a in node.args if passed else ():  # run_rank(work, ...): work()
                        if isinstance(a, (ast.Name, ast.Attribute)):
                            w = r.value(a, env, module, cls)
                            if w and w[0] == "func":
                                out.append(w)
                elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                    t = r.value(node, env, module, cls)
                    if not (t and t[0] == "func" and "property" in _decorators(t[2])):
                        t = None
                if t and t[0] == "func" and (self.instruments or t[1] not in INSTRUMENTS):
                    out.append(t)
        return out

    def count(self, module: str, fn, owner, lines: Optional[int] = None) -> bool:
        q = (module, f"{owner.name}.{fn.name}" if owner is not None else fn.name)
        if q in self.read:
            return False
        self.read[q] = lines if lines is not None else fn.end_lineno - _first_line(fn) + 1
        self.files.add(self.pkg.modules[module].path)
        return True

    def follow(self, roots: list[tuple]) -> None:
        todo = list(roots)
        while todo:
            _, module, fn, owner = todo.pop(0)
            if self.count(module, fn, owner):
                todo += self.callees(fn.body, fn, module, owner)

    def hooks(self) -> list[tuple]:
        """The method's code torch runs inside the step: its bound methods handed over uncalled,
        and the calls inside ``register_*hook(...)`` arguments."""
        r = self.reader
        if r.method_class is None:
            return []
        out = []
        for m, c in r.mro(*r.method_class):
            for fn in c.body:
                if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                called = {id(n.func) for n in ast.walk(fn) if isinstance(n, ast.Call)}
                for node in ast.walk(fn):
                    if (isinstance(node, ast.Attribute) and id(node) not in called
                            and isinstance(node.value, ast.Name) and node.value.id == "self"):
                        t = r.value(node, r.env(fn, m, c), m, c)
                        if t and t[0] == "func" and "property" not in _decorators(t[2]):
                            out.append(t)
                    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                            and node.func.attr.startswith("register_")
                            and node.func.attr.endswith("hook")):
                        out += self.callees(node.args, fn, m, c)
        return out


def method_class(pkg: Package, method: str) -> Optional[tuple]:
    """(module, ClassDef) whose ``package.module:Class`` labkit/core/builtins.py gives as the
    ``source`` of ``method``'s spec (read as text: nothing is imported)."""
    reg = pkg.modules.get(REGISTRY)
    for node in ast.walk(reg.tree) if reg else []:
        if isinstance(node, ast.Dict) and any(getattr(k, "value", None) == "key" for k in node.keys):
            d = {getattr(k, "value", None): getattr(v, "value", None) for k, v in zip(node.keys, node.values)}
            if d.get("key") == method and ":" in (d.get("source") or ""):
                mod, _, name = d["source"].partition(":")
                t = pkg.lookup(mod, name)
                if t and t[0] == "class":
                    return t[1], t[2]
    raise SystemExit(f"reading_path: no class registered for method {method!r} in {REGISTRY}")


def find_step(pkg: Package) -> tuple[tuple, Optional[tuple]]:
    """(the step function, its caller): breadth first from the entry's top-level code to the
    first function that calls ``.backward()``, then up its callers to the first one that is
    called inside a loop (the loop over the batches); one with no loop up to the entry is a
    backward run once (a check), not the step, and the search goes on."""
    walk = Walk(pkg, None)
    entry = pkg.modules[ENTRY]
    body = [n for n in entry.tree.body
            if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    todo = [(t, None) for t in walk.callees(body, None, ENTRY, None, passed=True)]
    parent: dict = {}
    while todo:
        t, up = todo.pop(0)
        key = _key(t)
        if key in parent:
            continue
        parent[key] = up
        if any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
               and n.func.attr == "backward" for n in ast.walk(t[2])):
            step = t
            while parent[_key(step)] is not None and loop_around(parent[_key(step)], step[2]) is None:
                step = parent[_key(step)]
            if parent[_key(step)] is not None:
                return step, parent[_key(step)]
        todo += [(c, t) for c in walk.callees(t[2].body, t[2], t[1], t[3], passed=True)]
    raise SystemExit(f"reading_path: no function reached from {ENTRY} calls .backward()")


def _key(t: tuple) -> tuple:
    return t[1], t[2].name, t[3].name if t[3] is not None else ""


def loop_around(caller: tuple, step_fn) -> Optional[ast.AST]:
    """The innermost loop of ``caller`` whose body calls ``step_fn``; a loop over a step's
    micro-batches (its body enters the method's ``accumulating()``: --grad-accum) is the step's
    own, not the loop over the batches."""
    best = None
    for node in ast.walk(caller[2]):
        if isinstance(node, (ast.For, ast.While)) and not any(
                isinstance(n, ast.Attribute) and n.attr == "accumulating"
                for n in ast.walk(node)) and any(
                isinstance(n, ast.Attribute) and n.attr == step_fn.name
                or isinstance(n, ast.Name) and n.id == step_fn.name for n in ast.walk(node)):
            if best is None or node.lineno > best.lineno:
                best = node
    return best


def reading_path(root: str, method: str, instruments: bool = False,
                 pkg: Optional[Package] = None) -> dict:
    """{"functions": {"module:function": lines}, "lines": total, "files": n} for ``method``;
    ``instruments``: follow the calls into the instruments too. ``pkg``: ``root`` parsed."""
    pkg = pkg or Package(root)
    step, caller = find_step(pkg)
    walk = Walk(pkg, method, instruments)
    roots = [step]
    if caller is not None:
        loop = loop_around(caller, step[2])
        if loop is not None:
            _, module, fn, owner = caller
            walk.count(module, fn, owner, loop.end_lineno - loop.lineno + 1)
            roots += walk.callees(loop.body, fn, module, owner)
    walk.follow(roots + walk.hooks())
    functions = {f"{m}:{q}": n for (m, q), n in walk.read.items()}
    return {"functions": functions, "lines": sum(walk.read.values()), "files": len(walk.files)}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("methods", nargs="*", default=list(GUIDE))
    p.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                   help="the folder holding the package (default: this repository)")
    p.add_argument("--list", action="store_true", help="list the functions read")
    p.add_argument("--instruments", action="store_true",
                   help="follow the calls into the instruments too (INSTRUMENTS)")
    a = p.parse_args(argv)
    pkg = Package(a.root)
    for m in a.methods:
        try:
            r = reading_path(a.root, m, a.instruments, pkg)
        except SystemExit as e:  # bad input: the usage and one line, exit 2
            p.error(str(e).removeprefix("reading_path: "))
        if a.list:
            for name, n in r["functions"].items():
                print(f"  {name:60s} {n:4d}")
        full = r if a.instruments else reading_path(a.root, m, True, pkg)
        print(f"{m}: {r['lines']} lines in {r['files']} files (following the instruments too: "
              f"{full['lines']} lines in {full['files']} files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
