"""The README is a front door and docs/ holds the depth: every command the docs show parses with
the real argument parsers, every flag they name is one the code has, every local link and anchor
resolves, every code block closes, the notebooks' parameters are `labkit experiment`'s defaults,
and the README stays short and links every docs page."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from helpers import ROOT

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
    from labkit.costmodel.cli import build_parser as model_parser
    from labkit.cli import build_parser
    from labkit.training.rank import parser as train_parser

    words = shlex.split(line)
    if words[0] == "torchrun" or "labkit.train" in words:
        if "labkit.train" not in words:
            return None  # torchrun of something else (a bench rank)
        parser, args = train_parser(), words[words.index("labkit.train") + 1:]
    else:
        args = words[words.index("labkit") + 1:] if "labkit" in words else words[3:]
        # with the flags of the methods and workloads of one's own it names (their Options)
        parser = build_parser(example_options())
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


# inline code that is another program's command line: its flags are that program's
OTHER_COMMANDS = ("torchrun", "python", "pip", "make", "pytest", "sbatch", "srun", "salloc",
                  "jupyter", "papermill", "chromium", "git", "conda", "nvidia-smi", "apt-get",
                  "sudo", "bash", "time", "TORCH_", "NCCL_", "OMP_", "PYTHONPATH", "squeue",
                  "dvc", "docker", "unshare", "setpriv", "ARGS=")
# other programs' flags the docs name on their own: Slurm's (sbatch), Jupyter's, torchrun's
OTHER_FLAGS = {"--cpus-per-task", "--exclusive", "--nodes", "--time", "--account", "--dependency",
               "--allow-root", "--log-line-prefix-template"}
SPAN = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def example_options() -> tuple[type, ...]:
    """The Options dataclasses of the examples' methods and workloads (examples/), whose flags
    the docs show as they are given once a command names the example."""
    import ast

    from labkit.core.methods import REGISTRY
    from labkit.training.plugin_options import classes

    refs = [f"{p}:{n.name}" for p in sorted((ROOT / "examples").glob("*/*.py"))
            for n in ast.parse(p.read_text()).body if isinstance(n, ast.ClassDef)
            and any(getattr(b, "id", "") in ("Strategy", "Workload") for b in n.bases)]
    methods = [r for r in refs if "/methods/" in r]
    specs, aliases = dict(REGISTRY.specs), dict(REGISTRY.aliases)
    try:  # loading a method registers it: this process's other tests list what is registered
        return tuple(dict.fromkeys(classes(methods, None) + [c for r in refs if "/workloads/" in r
                                                              for c in classes([], r)]))
    finally:
        REGISTRY.specs, REGISTRY.aliases = specs, aliases


def labkit_flags() -> set[str]:
    """Every flag of every labkit subcommand, of labkit model and of labkit.train."""
    from labkit.costmodel.cli import build_parser as model_parser
    from labkit.cli import build_parser
    from labkit.training.rank import parser as train_parser

    top = build_parser(example_options())
    parsers = [top, model_parser(), train_parser(), *top.subcommands.choices.values()]
    return {f for p in parsers for f in FLAG.findall(p.format_help())}


def problems(page: Path, flags: set[str]) -> list[str]:
    """What is wrong with one Markdown page: an unclosed code block, a local link or anchor that
    resolves to nothing, a flag in inline code that no labkit parser has."""
    text = page.read_text()
    found = unclosed_blocks(page.name, text)
    prose = FENCE.sub("", text)
    for m in LINK.finditer(prose):
        target, anchor = m.group(1), (m.group(2) or "")[1:]
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path = page.parent / target
        if not path.exists():
            found.append(f"{page.name}: link to {target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            found.append(f"{page.name}: link to {target}#{anchor}: no such heading")
    for m in re.finditer(r"\]\(#([^)\s]+)\)", prose):
        if m.group(1) not in anchors(page):
            found.append(f"{page.name}: link to #{m.group(1)}: no such heading")
    for span in SPAN.findall(prose):
        if span.lstrip("$ ").startswith(OTHER_COMMANDS):
            continue
        found += [f"{page.name}: {flag} (in `{span}`) is no flag of labkit"
                  for flag in FLAG.findall(span) if flag not in flags | OTHER_FLAGS]
    return found


def default_problems(page: Path) -> list[str]:
    """The defaults a `| flag | default | meaning |` table quotes against TrainConfig's, where the
    cell is plain (a number, none, on, off; one per flag or one for all): prose defaults such as
    "nccl with GPUs" are left to the reader."""
    import dataclasses

    from labkit.core.config import TrainConfig
    from labkit.core.params import default

    fields = {f.name: default(f) for f in dataclasses.fields(TrainConfig)}
    plain = {"none": None, "on": True, "off": False}
    found, in_table = [], False
    for line in page.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[1].lower() == "default":
            in_table = True
            continue
        if not line.startswith("|"):
            in_table = False
        if not in_table or not cells[0].startswith("`--"):
            continue
        names = [f[2:].replace("-", "_") for f in re.findall(r"`(--[a-z0-9-]+)", cells[0])]
        values = [v.strip() for v in cells[1].split(",")]
        if len(values) not in (1, len(names)) or not all(
                v in plain or re.fullmatch(r"[0-9.]+", v) for v in values):
            continue
        for name, v in zip(names, values * len(names) if len(values) == 1 else values):
            if name not in fields:
                continue
            want = fields[name]
            got = plain[v] if v in plain else float(v)
            same = (want == got) if not isinstance(want, str) else (want == v)
            if not same:
                found.append(f"{page.name}: --{name.replace('_', '-')}'s default is {want!r}, "
                             f"the page says {v}")
    return found


def unclosed_blocks(name: str, text: str) -> list[str]:
    """Fenced blocks that do not close: a closing fence is backticks alone on their line, so
    "``` text" or "```bash" inside a block leaves it open (CommonMark), and so does the end."""
    found, open_at = [], None
    for i, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if not s.startswith("```"):
            continue
        if open_at is None:
            open_at = i
        else:
            if s.strip("`"):
                found.append(f"{name}:{open_at}: a code block that never closes (line {i} "
                             f"has text after its backticks)")
            open_at = None
    return found + ([f"{name}:{open_at}: a code block that never closes"] if open_at else [])


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to '-'."""
    heads = re.findall(r"^#+\s+(.*)$", FENCE.sub("", page.read_text()), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


@pytest.mark.parametrize("page", [ROOT / "README.md", *DOCS], ids=lambda p: p.name)
def test_links_anchors_code_blocks_and_flags_are_true(page):
    assert problems(page, labkit_flags()) == []
    assert default_problems(page) == []


def test_the_defaults_check_fails_on_a_made_up_default(tmp_path):
    page = tmp_path / "flags.md"
    page.write_text("| flag | default | meaning |\n|---|---|---|\n"
                    "| `--bucket-mb`, `--no-overlap` | 25, off | buckets |\n"
                    "| `--pin-cpus`, `--no-pin-cpus` | on | binding |\n"
                    "| `--max-steps-per-epoch N` | none | cap |\n"
                    "| `--backend` | nccl with GPUs, gloo without | prose: not checked |\n")
    assert default_problems(page) == []
    page.write_text(page.read_text().replace("25, off", "50, on").replace("| none |", "| 8 |"))
    assert default_problems(page) == [
        "flags.md: --bucket-mb's default is 25.0, the page says 50",
        "flags.md: --no-overlap's default is False, the page says on",
        "flags.md: --max-steps-per-epoch's default is None, the page says 8"]


def test_the_docs_check_fails_on_made_up_mistakes(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## A section (2026)\n")
    good = tmp_path / "good.md"
    good.write_text("# Good\n\nSee [other](other.md#a-section-2026) and [here](#good); run\n"
                    "`labkit run ddp --epochs 2`, or `torchrun --local-addr 127.0.0.1 ...`.\n"
                    "```bash\nlabkit runs --json\n```\n")
    assert problems(good, labkit_flags()) == []
    assert unclosed_blocks("x.md", "```bash\nlabkit runs\n``` and more\n```bash\nmake\n```\n") == [
        "x.md:1: a code block that never closes (line 3 has text after its backticks)"]
    bad = tmp_path / "bad.md"
    bad.write_text("# Bad\n\nSee [gone](gone.md), [other](other.md#no-such-part) and\n"
                   "[here](#nowhere); labkit takes `--local-addr` and `labkit run ddp --epoch-count 2`.\n"
                   "```bash\nlabkit runs --json\n")
    assert problems(bad, labkit_flags()) == [
        "bad.md:5: a code block that never closes",
        "bad.md: link to gone.md: no such file",
        "bad.md: link to other.md#no-such-part: no such heading",
        "bad.md: link to #nowhere: no such heading",
        "bad.md: --local-addr (in `--local-addr`) is no flag of labkit",
        "bad.md: --epoch-count (in `labkit run ddp --epoch-count 2`) is no flag of labkit"]


def test_notebook_parameters_are_the_experiments_defaults(monkeypatch):
    """run_method.ipynb run by hand trains what `labkit experiment` trains for that method on
    this machine (and on a GPU machine, the device count faked): every resolved field alike."""
    import ast
    import dataclasses

    import nbformat
    import torch

    from labkit import cli
    from labkit.workloads import resolve
    from labkit.launch.launch_params import notebook_params, nproc_or_default

    nb = nbformat.read(ROOT / "notebooks" / "run_method.ipynb", as_version=4)
    cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    values = {n.targets[0].id: ast.literal_eval(n.value) for n in ast.parse(cell.source).body}
    for gpus in (0, 1, 4):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
        nb_cfg, nb_nproc, _ = notebook_params(dict(values))
        cfg, exp, _ = cli._experiment_params({})
        assert nb_cfg.method == "ddp" and exp.methods[0] == "ddp"
        assert nb_nproc == nproc_or_default(exp.nproc)
        assert dataclasses.asdict(resolve(nb_cfg, gpus > 0, nb_nproc)) == dataclasses.asdict(
            resolve(dataclasses.replace(cfg, method="ddp"), gpus > 0, nb_nproc)), gpus


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
