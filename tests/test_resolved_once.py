"""A config is resolved and checked once (issue 39 item 2): in `labkit experiment`, by the
driver, before anything is spawned; the notebook's kernel and every rank read the method's
resolved.json and decide nothing again. The bare `torchrun -m labkit.train --flags`, which no
launcher checked for, still checks in every rank. The calls are counted in each process by the
LABKIT_TEST_COUNT hook (tests/hooks/sitecustomize.py). `labkit bench` likewise: test_bench.py counts
on its session bench."""
from __future__ import annotations

from collections import Counter

import pytest

from helpers import EXPERIMENT_METHODS, EXPERIMENT_REPEATS, calls, load_json, of, tiny_flags, torchrun

CHECKS = ("check_values", "resolve", "preflight", "machine", "validate")


# conftest's session experiment (its group: the worker that builds it), whose processes counted
# their calls: 3 methods x 2 repeats, each method on 2 ranks (instead of an experiment of its own)
@pytest.mark.xdist_group("experiment")
def test_an_experiment_resolves_and_checks_once_in_the_driver(experiment):
    from labkit.core.layout import method_dir

    assert experiment.returncode == 0, experiment.stdout[-2000:] + experiment.stderr[-2000:]
    found = calls(experiment.cwd / experiment.CALLS)
    methods = len(EXPERIMENT_METHODS)
    # the driver: the parameters checked once; each method's config resolved and checked,
    # and the machine's budget, once per method, not once per repeat
    [driver] = of(found, "driver")
    assert {fn: driver[fn] for fn in CHECKS} == {"check_values": 1, **dict.fromkeys(CHECKS[1:], methods)}
    # each repeat's kernel and ranks: their method's resolved.json read once each, nothing
    # resolved or checked (the report's kernel reads none)
    kernels, ranks = of(found, "kernel"), of(found, "rank")
    assert kernels == [Counter(read=1)] * (methods * EXPERIMENT_REPEATS)
    assert ranks == [Counter(read=1)] * (methods * EXPERIMENT_REPEATS * 2)
    # what they read is what config.json records as resolved, with the method's folder as out
    # and the repeat's seed (repeat i trains from seed + i - 1)
    run = experiment.run
    for m in EXPERIMENT_METHODS:
        recorded = load_json(run / "config.json")["resolved"][m]
        for r in range(1, EXPERIMENT_REPEATS + 1):
            folder = method_dir(run, m, r, EXPERIMENT_REPEATS)
            written = load_json(folder / "resolved.json")
            assert written["train"] == {**recorded, "out": ".", "seed": recorded["seed"] + r - 1}, (m, r)
            assert written["nproc"] == 2
            launched = load_json(folder / "launch.json")["command"]
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
