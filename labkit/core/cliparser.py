"""argparse with labkit's error style: one line naming the problem and where help is, exit 2.

argparse prints its whole usage (25 lines for `labkit run`) before a mistyped argument; every
other labkit error is one line. ``OneLineParser.error`` (argparse's documented hook for a
parser's errors) rewrites argparse's message into that line, and a subcommand's unknown flag is
reported by the subcommand's parser, naming the subcommand and the closest flag it has.
"""
from __future__ import annotations

import argparse
import difflib
import re
from typing import NoReturn

_CHOICE = re.compile(r"argument (\S+): invalid choice: '?([^' ]*)'? \(choose from (.*)\)")
_TYPE = re.compile(r"argument (\S+): invalid (int|float) value: '(.*)'")
_ARG = re.compile(r"argument (\S+): (.*)")
_KINDS = {"int": "a whole number", "float": "a number"}


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line: ``prog: error: what; see prog --help``.
    Subparsers made from it are OneLineParsers too (argparse uses the parent's class)."""

    def add_subparsers(self, **kwargs):
        self.subcommands = super().add_subparsers(**kwargs)
        return self.subcommands

    def parse_args(self, args=None, namespace=None):
        """As argparse's, except that arguments no parser knows are reported by the subcommand
        they were given to (its name and its flags), not by the top-level parser."""
        ns, extra = self.parse_known_args(args, namespace)
        if extra:
            subs = getattr(self, "subcommands", None)
            sub = subs.choices.get(getattr(ns, subs.dest, None)) if subs is not None else None
            (sub if isinstance(sub, OneLineParser) else self).error(
                f"unrecognized arguments: {' '.join(extra)}")
        return ns

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {plain(message, self.flags())}; see {self.prog} --help\n")

    def flags(self) -> list[str]:
        """The long flags this parser takes, read from its usage (public; no private tables)."""
        return sorted(set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", self.format_usage())))


def plain(message: str, flags: list[str]) -> str:
    """argparse's message in labkit's words: ``unknown method 'sgd'; choose from ddp, ps``,
    ``--steps: expected a whole number, got 'two'``, ``unknown flag --statuz (did you mean
    --status?)``; anything else as argparse says it."""
    if m := _CHOICE.match(message):
        name, value, choices = m.groups()
        choices = ", ".join(c.strip(" '") for c in choices.split(","))
        return f"unknown {name.lstrip('-').replace('-', ' ')} '{value}'; choose from {choices}"
    if m := _TYPE.match(message):
        return f"{m.group(1)}: expected {_KINDS[m.group(2)]}, got '{m.group(3)}'"
    if message.startswith("unrecognized arguments: "):
        words = message.removeprefix("unrecognized arguments: ").split()
        unknown = [w.split("=")[0] for w in words if w.startswith("-")]
        if not unknown:
            return f"unexpected argument(s): {' '.join(words)}"
        close = difflib.get_close_matches(unknown[0], flags, n=1, cutoff=0.75)
        return (f"unknown flag {unknown[0]}" + (f" (did you mean {close[0]}?)" if close else "")
                + (f" (and {' '.join(unknown[1:])})" if unknown[1:] else ""))
    if m := _ARG.match(message):
        return f"{m.group(1)}: {m.group(2)}"
    return message
