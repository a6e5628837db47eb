"""One reader of a parameter dataclass's annotations, for every way parameters arrive.

A field's type (``int``, ``Optional[float]``, ``Literal["ddp", "allreduce", "ps"]``, ...) is
read once into a :class:`FieldType`, which then

- parses text: command-line flags, ``labkit sweep nproc=2,4`` grids (:meth:`FieldType.parse`);
- checks a Python value: the papermill parameters cell, a YAML parameters file
  (:meth:`FieldType.accepts`);
- makes the argparse flags (:func:`add_arguments`) and turns a config back into the flags that
  reproduce it (:func:`to_flags`).

TrainConfig (labkit.core.config) and the launcher's parameters (labkit.launch.launch_params) both
go through it, so a flag, a notebook parameter and a grid value of one name mean the same thing.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import typing
from dataclasses import dataclass
from typing import Any, Optional

from .errors import ConfigError

_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


@dataclass(frozen=True)
class FieldType:
    name: str
    base: type                          # int, float, bool or str
    optional: bool                      # None is a value ("auto", "none" as text)
    choices: Optional[tuple[str, ...]]  # a Literal's values

    def describe(self) -> str:
        """How the type reads in a message: int, Optional[float], one of a | b."""
        what = (" | ".join(self.choices) if self.choices else self.base.__name__)
        return f"Optional[{what}]" if self.optional else what

    def parse(self, text: str) -> Any:
        """A value from text; ValueError naming what was expected."""
        t = str(text).strip()
        if self.optional and t.lower() in ("none", "auto"):
            return None
        if self.base is bool:
            if t.lower() in _TRUE + _FALSE:
                return t.lower() in _TRUE
            raise ValueError(f"expected true or false, got {t!r}")
        try:
            value = self.base(t)
        except ValueError:  # int("two") says "invalid literal for int() with base 10"
            kind = {int: "a whole number", float: "a number"}.get(self.base, self.base.__name__)
            raise ValueError(f"expected {kind}, got {t!r}") from None
        if not self.allows(value):
            raise ValueError(f"expected one of {', '.join(self.choices)}, got {t!r}")
        return value

    def accepts(self, value: Any) -> bool:
        """Whether a Python value is of this type (a bool is not an int here); whether it is
        one of the choices is :meth:`allows`."""
        if value is None:
            return self.optional
        if self.base is bool:
            return isinstance(value, bool)
        if isinstance(value, bool):
            return False
        if self.base is float:
            return isinstance(value, (int, float))
        return isinstance(value, self.base)

    def allows(self, value: Any) -> bool:
        """Whether a value of the right type is one of the choices (always, without choices)."""
        return value is None or not self.choices or value in self.choices


def _read(name: str, hint: Any) -> FieldType:
    optional = False
    if typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional, hint = True, args[0]
    if typing.get_origin(hint) is typing.Literal:
        choices = tuple(typing.get_args(hint))
        return FieldType(name, type(choices[0]), optional, choices)
    return FieldType(name, hint, optional, None)


@functools.cache
def field_types(cls: type) -> dict[str, FieldType]:
    """{field name: FieldType} of a parameter dataclass, read from its annotations."""
    hints = typing.get_type_hints(cls)
    return {f.name: _read(f.name, hints[f.name]) for f in dataclasses.fields(cls)}


def option(default: Any, help: str, group: str = "method", **meta: Any) -> Any:
    """A field of a method's or workload's options dataclass (its ``Options``): its default,
    its help text for ``--help``, the concern it is listed under, and what it accepts:
    ``at_least=N`` (a whole number N or more), ``positive=True`` (more than 0), ``below=X``
    (less than X); None, where the type allows it, always passes."""
    return dataclasses.field(default=default, metadata={"help": help, "group": group, **meta})


def check_ranges(obj: Any, fields: Optional[tuple[str, ...]] = None) -> None:
    """ConfigError, one line, for the first field of the dataclass ``obj`` (of ``fields``, if
    given) whose value its metadata refuses (:func:`option`)."""
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if v is None or (fields is not None and f.name not in fields):
            continue
        m, low = f.metadata, f.metadata.get("at_least")
        if "below" in m and not (low or 0) <= v < m["below"]:
            raise ConfigError(f"{flag(f.name)} must be in [{low or 0}, {m['below']}) (got {v})")
        if low is not None and v < low:
            raise ConfigError(f"{flag(f.name)} must be {'0 or more' if low == 0 else f'at least {low}'}"
                              f" (got {v})")
        if m.get("positive") and not v > 0:
            raise ConfigError(f"{flag(f.name)} must be positive (got {v})")


def options_of(cls: type, cfg: Any) -> Any:
    """An instance of the options dataclass ``cls`` with the values a config ``cfg`` holds:
    each a field of the config (a built-in's), else a key of its ``options`` (a method or
    workload of one's own), else the field's default."""
    own = getattr(cfg, "options", None) or {}
    names = {f.name for f in dataclasses.fields(cfg)}
    kw = {f.name: getattr(cfg, f.name) if f.name in names else own[f.name]
          for f in dataclasses.fields(cls) if f.name in names or f.name in own}
    return cls(**kw)


def default(f: dataclasses.Field) -> Any:
    """A field's default, one of its default_factory's making where it has that instead."""
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def flagged(cls: type) -> list[dataclasses.Field]:
    """The fields of a parameter dataclass that are flags (not those marked ``flag=False``,
    such as the config's ``options`` of a plug-in, whose own dataclass makes their flags)."""
    return [f for f in dataclasses.fields(cls) if f.metadata.get("flag", True)]


def choices(cls: type, name: str) -> tuple[str, ...]:
    """The allowed values of a Literal field."""
    return field_types(cls)[name].choices or ()


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_arguments(p: argparse.ArgumentParser, cls: type, skip: tuple = (),
                  defaults: bool = True) -> None:
    """One flag per field (``batch_size`` -> ``--batch-size``), with the field's help text.
    ``defaults=False`` leaves flags that were not given out of the namespace, so they can
    override a parameters file."""
    types = field_types(cls)
    titles = getattr(cls, "GROUPS", None) or {}  # fields of a concern under one heading of --help
    groups = {g: p.add_argument_group(title) for g, title in titles.items()}
    parser = p
    for f in flagged(cls):
        if f.name in skip:
            continue
        p = groups.get(f.metadata.get("group"), parser)
        ft, help_ = types[f.name], f.metadata.get("help")
        default = f.default if defaults else argparse.SUPPRESS
        if ft.base is bool:
            # a flag whose name is already a negation (--no-overlap) has one form: no --no-no-...
            action = "store_true" if f.name.startswith("no_") else argparse.BooleanOptionalAction
            p.add_argument(flag(f.name), dest=f.name, action=action, default=default, help=help_)
        else:
            p.add_argument(flag(f.name), dest=f.name, type=_argparse_type(ft), help=help_,
                           default=default, choices=ft.choices)
        for alias, value in f.metadata.get("aliases", {}).items():  # an older flag's spelling
            p.add_argument(alias, dest=f.name, action="store_const", const=value,
                           default=argparse.SUPPRESS, help=f"the same as {flag(f.name)} {value}")


def _argparse_type(ft: FieldType):
    def convert(text: str) -> Any:
        try:
            return ft.parse(text) if not ft.choices else ft.base(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    convert.__name__ = ft.base.__name__  # argparse's "invalid int value" message
    return convert


def from_namespace(cls: type, ns: argparse.Namespace) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in vars(ns).items() if k in names})


def to_flags(obj: Any) -> list[str]:
    """A parameter dataclass -> the flags that give it (only values that differ from the
    defaults)."""
    args: list[str] = []
    values = [(f.name, getattr(obj, f.name), f.default) for f in flagged(type(obj))]
    # a plug-in's options: each a flag its own Options dataclass adds to the parser
    values += [(k, v, None) for k, v in (getattr(obj, "options", None) or {}).items()]
    for name, v, default in values:
        if v == default:
            continue
        if isinstance(v, bool):
            args.append(flag(name) if v else "--no-" + name.replace("_", "-"))
        elif v is not None:
            args += [flag(name), str(v)]
    return args


def check_values(values: dict, *classes: type, extra_known: tuple[str, ...] = ()) -> None:
    """Reject unknown names and values of the wrong type, with one message naming the
    parameter: what a notebook's parameters cell or a YAML file gives."""
    types: dict[str, FieldType] = {}
    for cls in classes:
        types.update(field_types(cls))
    unknown = sorted(set(values) - set(types) - set(extra_known))
    if unknown:
        raise ConfigError(f"unknown parameter(s): {', '.join(unknown)}; known: "
                          f"{', '.join(list(types) + list(extra_known))}")
    for k, v in values.items():
        if k in types and not types[k].accepts(v):
            raise ConfigError(f"parameter {k}={v!r} has type {type(v).__name__}; expected "
                              f"{types[k].describe()}")
        if k in types and not types[k].allows(v):
            raise ConfigError(f"unknown {k} {v!r}; choose one of: {', '.join(types[k].choices)}")
