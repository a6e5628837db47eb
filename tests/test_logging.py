"""labkit's console (issue 39, item 5): every module logs through its own logger, the console
reads as before, -q and -v change the level; torchrun's output is read by one adapter
(labkit.launch.torchrun_output), tested here on lines real torchrun runs printed."""
from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from helpers import EXPERIMENT_METHODS, EXPERIMENT_REPEATS, ROOT, labkit, tiny_flags

from labkit.core import log as console
from labkit.launch.torchrun_output import TorchrunOutput, failures, knows

# ------------------------------------------------------------------ torchrun's output, for real
# torch 2.14.1's torchrun, 2026-11-26, `labkit run` on 2 gloo ranks (what torchrun.log keeps);
# the parameter server's run of the embedded default: two reporting ranks, progress bars
PS_RUN = """\
[rank0]: epoch 1/3 [server]:   0%|                                                 | 0/14 [00:00<?, ?batch/s]
[rank0]: labkit 0.1.0 | ps (collective) | world 4 (3 trainers) | gloo on cpu | resnet10_small on digits (1438 train / 359 val) | batch 32/trainer | 14 steps/epoch
[rank1]: epoch 1/3:   0%|                                                          | 0/14 [00:00<?, ?batch/s]
[rank0]: epoch 1/3 [server]: 100%|#######| 14/14 [00:04<00:00,  3.40batch/s, params=13ms grads+compute=257ms]
[rank1]: epoch 1/3: 100%|###############| 14/14 [00:04<00:00,  3.39batch/s, loss=0.9195 acc=76.34% 325 img/s]
[rank0]: epoch 1/3: train loss 0.9193 acc 75.15% | val loss 0.2885 acc 94.15% | 359.1 img/s, 4.1s | pull 40.1 ms/step | push 38.9 ms/step
[rank0]: results: ./results_ps.json
"""
# LABKIT_TEST_FAULT=ddp:1:2:raise: rank 1 raised, rank 0 lost its peer (its traceback cut to
# three of its 38 lines), then torchrun's own log, traceback and failure summary (trimmed)
RAISED = """\
[rank0]: labkit 0.1.0 | ddp | world 2 (2 trainers) | gloo on cpu | resnet10_small on digits (1438 train / 359 val) | batch 8/trainer | 5 steps/epoch
[rank0]: epoch 1/1:   0%|                                                           | 0/5 [00:00<?, ?batch/s]
[rank0]: Traceback (most recent call last):
[rank0]:   File "/work/main/labkit/training/lifecycle.py", line 154, in run_rank
[rank0]:     dist._broadcast_coalesced(
[rank0]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:27048. This is typically caused by a remote worker crashing.
[rank0]: labkit.train: error: rank 0: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:27048.
[rank0]: epoch 1/1:  40%|######8          | 2/5 [00:00<00:00,  7.14batch/s, loss=2.2790 acc=18.75% 125 img/s]
W1126 01:41:38.493000 24970 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 24975 closing signal SIGTERM
E1126 01:41:38.694000 24970 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) local_rank: 1 (pid: 24976) of binary: /work/main/.venv/bin/python
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError: 
============================================================
labkit.train FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-26_01:41:36
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 24975) 
  error_file: raise/logs/b0cad00c-e82a-465e-a1ac-6d1140602f8b_nlq2puio/attempt_0/0/error.json
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-26_01:41:36
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 24976) 
  error_file: raise/logs/b0cad00c-e82a-465e-a1ac-6d1140602f8b_nlq2puio/attempt_0/1/error.json
============================================================
"""
# LABKIT_TEST_FAULT=ddp:1:2:kill: the summary's root cause, a rank killed by a signal
KILLED = """\
Root Cause (first observed failure):
[0]:
  time      : 2026-11-26_01:41:48
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 25050)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 25050
============================================================
"""


def _read(text: str):
    reader = TorchrunOutput()
    return [line for raw in text.splitlines(keepends=True) for line in reader.feed(raw)]


def test_every_reporting_rank_line_is_streamed_and_the_bars_are_marked():
    lines = _read(PS_RUN)
    assert [l.text for l in lines if l.shown] == PS_RUN.splitlines()
    assert [l.progress for l in lines] == [True, False, True, True, True, False, False]


def test_a_ranks_traceback_and_torchruns_own_dump_stay_in_the_log():
    shown = [l.text for l in _read(RAISED) if l.shown]
    lines = RAISED.splitlines()
    # the rank's one-line error ends its traceback; its next progress bar streams again
    assert shown == [lines[0], lines[1], lines[6], lines[7]]


def test_the_failure_summary_names_each_failed_rank_with_its_exit_code():
    assert failures(RAISED) == [(0, 0, 1), (1, 1, 1)]
    assert failures(KILLED) == [(1, 1, -9)]
    assert failures(PS_RUN) == []


def test_older_prefixes_blank_lines_and_the_profilers_log():
    text = ("[default0]: epoch 1/1: train loss 2.2335 acc 13.75%\n[rank0]: \n"
            "[rank0]: USDT:2026-11-22 04:49:54 11098:11098 CuptiActivityProfiler.cpp:39] log\n"
            "Setting OMP_NUM_THREADS environment variable for each process to be 1\n")
    assert [l.text for l in _read(text) if l.shown] == ["[default0]: epoch 1/1: train loss 2.2335 acc 13.75%"]


def test_torchruns_options_are_read_from_its_help_not_argparse_internals():
    assert knows("--tee") and knows("--log-line-prefix-template") and knows("--nproc_per_node")
    assert not knows("--no-such-option") and not knows("--te")
    private = [str(p.relative_to(ROOT)) for p in (ROOT / "labkit").rglob("*.py")
               if re.search(r"\._(actions|option_string_actions|subparsers)\b", p.read_text())]
    assert private == []


def test_torchruns_options_read_from_its_file_are_those_its_parser_takes():
    """knows() reads torch/distributed/run.py as text (a kernel need not import torch for it):
    every option the parser takes is found there, and an option it does not take is not."""
    import sys

    from torch.distributed.run import get_args_parser

    from labkit.launch import torchrun_output

    taken = [o for a in get_args_parser()._actions for o in a.option_strings  # noqa: SLF001
             if o not in ("-h", "--help")]  # argparse's own, not declared in the file
    assert len(taken) > 30 and "--log-line-prefix-template" in taken
    torchrun_output._torchrun_help.cache_clear()
    assert [o for o in taken if not knows(o)] == []
    assert not knows("--no-such-option") and not knows("--te")
    assert "torch" in sys.modules  # (imported above, by this test: knows itself reads a file)


# ------------------------------------------------------------------ the console and its levels
@pytest.fixture
def levels(monkeypatch):
    """setup() writes LABKIT_LOG_LEVEL and the labkit logger's level: both put back after."""
    monkeypatch.delenv(console.ENV, raising=False)
    yield console.setup
    console.setup(0)


def test_messages_print_bare_info_on_stdout_warnings_on_stderr_at_each_level(levels, capsys):
    log = logging.getLogger("labkit.orchestrate.somewhere")
    said = {}
    for verbosity in (1, 0, -1, -2):
        levels(verbosity)
        log.debug("torchrun: %s", "cmd")
        log.info("run folder: %s", "/r")
        log.warning("labkit: warning: %s", "w")
        log.error("labkit run: error: %s", "e")
        said[verbosity] = capsys.readouterr()
    assert said[1].out == "torchrun: cmd\nrun folder: /r\n"
    assert said[0].out == "run folder: /r\n"
    assert said[0].err == said[-1].err == "labkit: warning: w\nlabkit run: error: e\n"
    assert said[-1].out == said[-2].out == ""
    assert said[-2].err == "labkit run: error: e\n"
    # what a kernel or a Slurm job inherits: -v, never -q (an executed notebook and a job's log
    # are records, the same with -q or without; the command hides their lines itself)
    import os
    assert os.environ[console.ENV] == "INFO"
    levels(1)
    assert os.environ[console.ENV] == "DEBUG"


def test_a_transcript_logs_whole_lines_and_lets_labkits_warnings_through_quiet(levels, capsys):
    levels(0)
    t = console.transcript("labkit.orchestrate.experiment")
    t.write("=== ddp: 2 pro")
    assert capsys.readouterr().out == ""  # half a line waits for its end
    t.write("cesses ===\n[rank0]: labkit.train: warning: 3 images left out\nlabkit: warning: ")
    t.write("disk nearly full\n[rank0]: labkit.train: error: rank 0: lost its peer\n")
    out, err = capsys.readouterr()
    assert out == "=== ddp: 2 processes ===\n[rank0]: labkit.train: error: rank 0: lost its peer\n"
    assert err == "[rank0]: labkit.train: warning: 3 images left out\nlabkit: warning: disk nearly full\n"
    levels(-1)
    t.write("[rank0]: epoch 1/1: train loss 2.2\nlabkit sweep --slurm: error: no sbatch\n")
    assert capsys.readouterr() == ("", "labkit sweep --slurm: error: no sbatch\n")


# ------------------------------------------------------------------ the experiment's console
# The shape of each line of `labkit experiment`'s console, up to its summary (Table 1 and the
# verdicts, test_experiment's). The embedded default, 2026-11-26 before the loggers (4 methods,
# 1 repeat), and the session's experiment (3 methods x 2 repeats) both read this way.
SHAPES = [
    (r"experiment: /", "experiment: PATH"),
    (r"plan: ", "plan: ..."),
    (r"why: ", "why: ..."),
    (r"=== \w+(, repeat \d+ of \d+ \(seed \d+\))?: \d+ processes ===$", "=== METHOD: N processes ==="),
    (r"\w+: \d+ processes per node -> /", "METHOD: N processes per node -> PATH"),
    (r"\[rank\d+\]: ", "[rankN]: ..."),
    (r"finished in \d+s$", "finished in Ns"),
    (r"report: /\S+\.html$", "report: PATH"),
    (r"pdf: /|PDF skipped: ", "pdf: PATH (or why not)"),
    (r"run folder: /", "run folder: PATH"),
    (r"  \w+ +(completed|failed|interrupted)", "  METHOD STATUS"),
    (r"Table 1\. ", "Table 1. ..."),
    (r"$", ""),
]


def line_structure(text: str) -> list[str]:
    """Each line's shape (an unknown line as itself, marked), a run of rank lines as one, up
    to the summary's Table 1."""
    out: list[str] = []
    for line in text.splitlines():
        shape = next((s for pattern, s in SHAPES if re.match(pattern, line)), f"?? {line}")
        if not (shape == "[rankN]: ..." and out[-1:] == [shape]):
            out.append(shape)
        if shape == "Table 1. ...":
            break
    return out


def expected_structure(runs: int, methods: int) -> list[str]:
    one = ["", "=== METHOD: N processes ===", "METHOD: N processes per node -> PATH", "[rankN]: ...",
           "finished in Ns"]
    return (["experiment: PATH", "plan: ...", "why: ..."] + one * runs
            + ["report: PATH", "pdf: PATH (or why not)", "", "run folder: PATH"]
            + ["  METHOD STATUS"] * methods + ["report: PATH", "", "Table 1. ..."])


@pytest.mark.xdist_group("experiment")  # conftest's session experiment: its worker
def test_the_experiments_console_keeps_its_line_structure(experiment):
    n = len(EXPERIMENT_METHODS)
    assert experiment.returncode == 0, experiment.stderr[-3000:]
    assert line_structure(experiment.stdout) == expected_structure(n * EXPERIMENT_REPEATS, n)
    assert experiment.stderr == ""


def test_the_structure_check_fails_on_a_console_that_changed():
    ok = "\n".join(["experiment: /r", "plan: ddp", "why: no GPU", "", "=== ddp: 2 processes ===",
                    "ddp: 2 processes per node -> /r/ddp", "[rank0]: a", "[rank0]: b",
                    "finished in 3s", "report: /r/report/report.html", "pdf: /r/report/report.pdf",
                    "", "run folder: /r", "  ddp        completed", "report: /r/report/report.html",
                    "", "Table 1. Performance comparison", "whatever follows"])
    assert line_structure(ok) == expected_structure(1, 1)
    assert line_structure(ok.replace("finished in 3s", "INFO:labkit: finished in 3s")) != expected_structure(1, 1)
    assert line_structure(ok.replace("[rank0]: b\n", "")) == expected_structure(1, 1)  # rank lines vary


def test_quiet_experiment_prints_only_the_summary_and_errors(tmp_path):
    """`labkit -q experiment`: stdout is the summary alone, stderr the failed method's one
    error (allreduce's one rank fails at its first step), nothing of the kernels or the ranks."""
    from labkit.report import load_run, terminal_summary

    p = labkit(["-q", "experiment", "--methods", "ddp,allreduce", "--nproc", "1", "--no-report",
                *tiny_flags(max_steps_per_epoch=2, max_val_steps=1), "--runs-dir", "runs"],
               cwd=tmp_path, env={"LABKIT_TEST_FAULT": "allreduce:0:1:raise"})
    run = (tmp_path / "runs" / "latest").resolve()
    assert p.returncode == 1, p.stdout + p.stderr
    summary = terminal_summary(load_run(run))
    assert p.stdout.endswith("\n" + summary + "\n")
    head = p.stdout[:-len(summary) - 1].splitlines()
    assert head[:3] == ["", f"run folder: {run}", "  ddp        completed"], p.stdout
    assert head[3].startswith("  allreduce  failed  (LaunchError: allreduce failed: rank 0 exited ")
    assert head[-2:] == ["report: not made (--no-report)", ""], p.stdout
    err = p.stderr.splitlines()
    assert err[:2] == ["", err[1]] and err[1].startswith("allreduce FAILED: LaunchError: "
                                                         "allreduce failed: rank 0 exited"), p.stderr
    assert all(l.startswith("  | ") for l in err[2:]) and "injected fault" in p.stderr, p.stderr
    assert "[rank" not in p.stdout and "===" not in p.stdout and "experiment:" not in p.stdout
    # the kernels logged as ever: the executed notebook is the same record with -q or without
    assert "[rank0]: labkit 0.1.0 | ddp | world 1" in (run / "ddp" / "run_method.ipynb").read_text()
