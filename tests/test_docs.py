"""The README is a front door and docs/ holds the depth: every command the docs show parses with
the real argument parsers, every local link points at a file that exists, and the README stays
short and links every docs page."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from conftest import ROOT

DOCS = sorted((ROOT / "docs").glob("*.md"))
FENCE = re.compile(r"```[a-z]*\n(.*?)```", re.S)
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)]*)?\)")


def commands(text: str) -> list[str]:
    """The labkit, python -m labkit and torchrun -m labkit.train lines of fenced blocks and of
    inline code spans in tables (continued lines joined, a leading '$ ' dropped)."""
    found = []
    blocks = FENCE.findall(text) + re.findall(r"\|\s*`((?:labkit|torchrun) [^`]*)`", text)
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip().removeprefix("$ ").split(" #")[0].strip()
            if re.match(r"(\.venv/bin/)?labkit |python3? -m labkit(\.train)? |torchrun .* -m ", line):
                found.append(line)
    return found


def check(line: str) -> str | None:
    """None if ``line`` parses with the parser that will read it, else why not."""
    from labkit.analysis.costmodel.cli import build_parser as model_parser
    from labkit.cli import build_parser
    from labkit.core.config import build_parser as train_parser

    words = shlex.split(line)
    if words[0] == "torchrun" or "labkit.train" in words:
        if "labkit.train" not in words:
            return None  # torchrun of something else (a bench rank)
        parser, args = train_parser(), words[words.index("labkit.train") + 1:]
    else:
        args = words[words.index("labkit") + 1:] if "labkit" in words else words[3:]
        parser = build_parser()
        if args[:1] == ["model"]:
            parser, args = model_parser(), args[1:]
    try:
        parser.parse_args(args)
    except SystemExit as e:
        return None if e.code == 0 else f"does not parse: {line}"
    return None


def test_every_documented_command_parses(capsys):
    found = {p.name: commands(p.read_text()) for p in [ROOT / "README.md", *DOCS]}
    assert sum(map(len, found.values())) >= 20, found
    bad = [f"{name}: {why}" for name, lines in found.items() for l in lines if (why := check(l))]
    capsys.readouterr()  # argparse's usage lines
    assert bad == []


def test_the_checker_finds_a_broken_command(capsys):
    doc = "text\n```bash\nlabkit experiment --no-such-flag\nlabkit runs --json\n```\n"
    lines = commands(doc)
    assert lines == ["labkit experiment --no-such-flag", "labkit runs --json"]
    assert check(lines[0]) == "does not parse: labkit experiment --no-such-flag"
    assert check(lines[1]) is None
    capsys.readouterr()


def test_readme_is_a_front_door_to_docs():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    assert "make experiment" in readme and "make test" in readme
    linked = {Path(m.group(1)).name for m in LINK.finditer(readme)}
    assert {p.name for p in DOCS} <= linked, {p.name for p in DOCS} - linked


@pytest.mark.parametrize("page", [ROOT / "README.md", *DOCS], ids=lambda p: p.name)
def test_local_links_point_at_files(page):
    missing = [m.group(1) for m in LINK.finditer(page.read_text())
               if not m.group(1).startswith(("http://", "https://", "mailto:"))
               and not (page.parent / m.group(1)).exists()]
    assert missing == []
