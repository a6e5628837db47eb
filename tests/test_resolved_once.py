"""A config is resolved and checked once (issue 39 item 2): in `labkit experiment`, by the
driver, before anything is spawned; the notebook's kernel and every rank read the method's
resolved.json and decide nothing again. The bare `torchrun -m labkit.train --flags`, which no
launcher checked for, still checks in every rank. The calls are counted in each process by the
LABKIT_TEST_COUNT hook (tests/hooks/sitecustomize.py). `labkit bench` likewise: test_bench.py counts
on its session bench."""
from __future__ import annotations

from collections import Counter

import pytest

from helpers import calls, labkit, load_json, of, tiny_flags, torchrun

CHECKS = ("check_values", "resolve", "preflight", "machine", "validate")


def test_an_experiment_resolves_and_checks_once_in_the_driver(tmp_path):
    path = tmp_path / "calls.txt"
    p = labkit(["experiment", "--methods", "ddp", "--nproc", "2", "--no-report",
                "--runs-dir", tmp_path / "runs", *tiny_flags()], cwd=tmp_path,
               env={"LABKIT_TEST_COUNT": str(path)})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    found = calls(path)
    # the driver: the parameters checked, the method's config resolved and checked, the
    # machine's budget: each once (one method)
    [driver] = of(found, "driver")
    assert {fn: driver[fn] for fn in CHECKS} == dict.fromkeys(CHECKS, 1)
    # the kernel and both ranks: the resolved.json read once each, nothing resolved or checked
    [kernel] = of(found, "kernel")
    ranks = of(found, "rank")
    assert kernel == Counter(read=1)
    assert ranks == [Counter(read=1)] * 2
    # what they read is what config.json records as resolved, with the method's folder as out
    run = next(d for d in (tmp_path / "runs").iterdir() if d.is_dir() and not d.is_symlink())
    written = load_json(run / "ddp" / "resolved.json")
    recorded = load_json(run / "config.json")["resolved"]["ddp"]
    assert written["train"] == {**recorded, "out": "."} and written["nproc"] == 2
    launched = load_json(run / "ddp" / "launch.json")["command"]
    assert launched[-2:] == ["--resolved", "resolved.json"]  # relative to the method's folder


def test_the_bare_torchrun_command_still_checks_in_every_rank(tmp_path):
    path = tmp_path / "calls.txt"
    p = torchrun(2, [*tiny_flags(max_steps_per_epoch=2, calibrate_steps=0),
                     "--out", str(tmp_path / "out")], tmp_path, env={"LABKIT_TEST_COUNT": str(path)})
    assert p.returncode == 0, p.stderr[-2000:]
    ranks = of(calls(path), "rank")
    assert len(ranks) == 2
    for c in ranks:
        assert c["preflight"] == c["resolve"] == c["machine"] == 1 and c["read"] == 0


@pytest.mark.unit
def test_resolved_takes_no_other_flag(capsys):
    from labkit.training import rank

    with pytest.raises(SystemExit) as e:
        rank.main(["--resolved", "resolved.json", "--epochs", "2"])
    assert e.value.code == 2
    assert "--resolved carries the whole config; give no other flags (got --epochs)" in capsys.readouterr().err
