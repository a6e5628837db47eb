"""A mistyped argument to any labkit subcommand is one line naming it and where help is, exit 2:
not argparse's usage block (25 lines for `labkit run`) before the error."""
from __future__ import annotations


import pytest

from helpers import labkit
from labkit import cli

# labkit model has its own parser (labkit.costmodel.cli) behind a placeholder
POSITIONALS = {"model": ["bench.json"]}


def positionals(command: str) -> list[str]:
    """A value for each positional a subcommand requires, read from its usage line (public
    argparse), so that the bad flag is what goes wrong: also for subcommands added later."""
    if command in POSITIONALS:
        return POSITIONALS[command]
    usage = cli.build_parser().subcommands.choices[command].format_usage()
    depth, out = 0, []
    for w in usage.split()[3:]:  # after "usage: labkit <command>"
        if depth == 0 and not w.startswith(("-", "[")) and w != "...":
            out.append("ddp" if command in ("run", "check") else "x")
        depth += w.count("[") - w.count("]")
    return out


@pytest.mark.parametrize("args,first", [
    (["run", "sgd"], "labkit run: error: unknown method 'sgd'"),
    (["runs", "--statuz", "x"], "labkit runs: error: unknown flag --statuz (did you mean --status?)"),
    (["experiment", "--epochs", "two"], "labkit experiment: error: --epochs: expected a whole "
                                        "number, got 'two'"),
])
def test_the_three_mistypes_of_the_issue_are_one_line(args, first):
    p = labkit(args, timeout=120)
    lines = p.stderr.splitlines()
    assert p.returncode == 2 and p.stdout == ""
    assert len(lines) == 1 and lines[0].startswith(first), p.stderr
    if args[0] == "run":  # argparse's choices, or the method registry's own one line
        assert "ddp" in lines[0] and "allreduce" in lines[0] and "ps" in lines[0]
    else:
        assert lines[0].endswith(f"see labkit {args[0]} --help")


def subcommands() -> list[str]:
    return list(cli.build_parser().subcommands.choices)


def test_every_subcommand_is_checked():
    assert set(subcommands()) >= {"run", "experiment", "sweep", "bench", "model", "report",
                                  "reproduce", "runs", "diff"}


@pytest.mark.parametrize("command", subcommands())
def test_a_bad_flag_of_every_subcommand_is_one_line(command, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([command, *positionals(command), "--no-such-flag"])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == ""
    assert err.splitlines() == [f"labkit {command}: error: unknown flag --no-such-flag; "
                                f"see labkit {command} --help"]


@pytest.mark.parametrize("args,expected", [
    (["bench", "--steps", "x"], "labkit bench: error: --steps: expected a whole number, got 'x'"),
    (["run", "ddp", "--backend", "mpi"], "labkit run: error: unknown backend 'mpi'; choose from "
                                         "nccl, gloo"),
    (["report"], "labkit report: error: the following arguments are required: RUN_DIR_OR_FILES"),
    ([], "labkit: error: the following arguments are required: command"),
])
def test_other_argument_errors_are_one_line_too(args, expected, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.splitlines()) == 1 and err.startswith(expected), err


@pytest.fixture
def console_level(monkeypatch):
    """cli.main sets labkit's console level (labkit.core.log): back to the default after."""
    from labkit.core import log

    monkeypatch.delenv(log.ENV, raising=False)
    yield
    log.setup(0)


@pytest.mark.parametrize("flag", ["-q", "-qq", "-v", "--quiet", "--verbose"])
def test_quiet_or_verbose_the_errors_are_the_same_one_line(flag, tmp_path, capsys, console_level):
    """-q and -v go before the subcommand (labkit model's own parser included); an error is the
    one line it always was, whatever the level."""
    missing = str(tmp_path / "nope")
    assert cli.main([flag, "report", missing]) == 2
    assert cli.main([flag, "model", missing]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [
        f"labkit report: error: {missing!r} does not exist",
        f"labkit model: error: cannot read {missing!r}: No such file or directory"], err
    with pytest.raises(SystemExit) as e:
        cli.main(["report", flag, missing])  # a global flag, not the subcommand's
    assert e.value.code == 2
    assert capsys.readouterr().err.startswith(f"labkit report: error: unknown flag {flag}")


def test_help_lists_each_flag_under_its_concern():
    """TrainConfig is grouped by concern (issue 39): every field belongs to one of GROUPS, every
    group holds fields, and --help lists each flag under its group's heading; the flags stay flat."""
    import dataclasses

    from labkit.core.config import GROUPS, TrainConfig, build_parser
    from labkit.core.params import flag, flagged

    fields = flagged(TrainConfig)  # not `options`: a plug-in's own dataclass makes their flags
    assert {f.metadata["group"] for f in fields} == set(GROUPS)
    under, heading = {}, None
    for line in build_parser().format_help().splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            heading = line[:-1]
        elif line.startswith("  --"):
            under[line.split()[0].split("/")[0].rstrip(",")] = heading
    for f in fields:
        assert under.get(flag(f.name)) == GROUPS[f.metadata["group"]], (f.name, under.get(flag(f.name)))


def test_continue_with_other_flags_names_them_as_typed(tmp_path, capsys):
    code = cli.main(["experiment", "--continue", str(tmp_path), "--no-progress", "--epochs", "3"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("labkit experiment: error: --continue takes no other flags"), err
    assert sorted(err[0].split(" got ")[1].split(", ")) == ["--epochs", "--no-progress"], err


@pytest.mark.e2e
def test_reading_a_command_line_of_built_ins_imports_no_torch():
    """Reading the command line looks for the options of a method of one's own; with only
    built-ins named (or a name that is none), nothing imports torch: 4 CPU s here before a
    mistyped variant's line, and before the warm process can start. ff55d28 imported it for
    every training command, which made the suite 20% slower."""
    import subprocess
    import sys

    code = """
import sys
from labkit import cli
for argv in (["run", "ddp", "--nproc", "2"], ["experiment", "--methods", "ddp,allreduce,fsdp"],
             ["bench", "--variants", "ddp,nope"], ["sweep", "nproc=1,2", "--methods", "ddp"]):
    try:
        cli.parse_args(argv)
    except SystemExit:
        pass
print("torch" in sys.modules)
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "False", p.stdout + p.stderr[-2000:]
