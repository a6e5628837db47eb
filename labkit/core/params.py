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
    for f in dataclasses.fields(cls):
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
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if v == f.default:
            continue
        if isinstance(v, bool):
            args.append(flag(f.name) if v else "--no-" + f.name.replace("_", "-"))
        elif v is not None:
            args += [flag(f.name), str(v)]
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
