"""`labkit check METHOD`: is a method exact? It trains a few steps on the embedded default
(digits, ResNet-10, gloo on the CPU) beside the single-process reference
(labkit.training.instruments.exactness), in seconds. A method of one's own that claims exactness is
checked this way before `labkit run` or `labkit experiment` measures it: one that is not exact
fails in one line naming the parameter that differs and by how much, and nothing else runs.
"""
from __future__ import annotations

import io
import logging
import os
import shutil
import tempfile
from typing import Optional

from labkit.core.config import ConfigError, TrainConfig
from labkit.core.methods import METHOD_ORDER, absolute, find
from labkit.workloads.catalog import DEFAULT as DEFAULT_WORKLOAD
from labkit.workloads.catalog import absolute as workload_path

CHECK_STEPS, CHECK_NPROC = 3, 2
# how long a collective of the check may wait (s): its steps take a second or two on a laptop,
# so a method whose ranks wait longer than this hangs; `labkit check --timeout` and a run's own
# smaller --timeout lower it, `labkit check --timeout` raises it
CHECK_TIMEOUT = 60.0
log = logging.getLogger(__name__)


def method_help() -> str:
    """What `labkit run`'s METHOD may be."""
    return f"{' | '.join(METHOD_ORDER)} | path/to/file.py:Class | package.module:Class"


def add_check_parser(sub) -> None:
    c = sub.add_parser("check", help="is a method exact? a few steps on the embedded default "
                       "beside the single-process reference (seconds)")
    c.add_argument("method", help=method_help())
    c.add_argument("--nproc", type=int, default=CHECK_NPROC, help="processes (default 2)")
    c.add_argument("--steps", type=int, default=CHECK_STEPS, help="training steps (default 3)")
    c.add_argument("--workload", default=DEFAULT_WORKLOAD,
                   help="what the check trains: images (digits on ResNet-10, the default), lm, "
                        "or your own path/to/file.py:Class (docs/workloads.md), at the "
                        "workload's small check size")
    c.add_argument("--timeout", type=float, default=CHECK_TIMEOUT,
                   help=f"seconds a collective may wait before the check stops, naming where "
                        f"each rank stood (default {CHECK_TIMEOUT:g})")


def cmd_check(args: dict) -> int:
    timeout = args.get("timeout", CHECK_TIMEOUT)
    if not timeout > 0:
        raise ConfigError(f"--timeout must be a positive number of seconds (got {timeout:g})")
    exact, line = check_method(args["method"], args.get("nproc", CHECK_NPROC),
                               args.get("steps", CHECK_STEPS), timeout,
                               say=lambda l: print(f"labkit check: {l}", flush=True),
                               workload=args.get("workload", DEFAULT_WORKLOAD))
    print(f"labkit check: {line}")  # the command's verdict: printed, with -q too
    return 0 if exact else 1


def checking_line(key: str, nproc: int, steps: int, timeout: float, workload: str = "") -> str:
    """The line said before the check starts: what it does, and how long it may take."""
    on = f" of the {workload} workload" if workload and workload != DEFAULT_WORKLOAD else ""
    return (f"checking that {key} is exact: {steps} steps{on} on {nproc} ranks beside the "
            f"single-process reference (usually under a minute; a collective that waits "
            f"{timeout:g} s (--timeout) stops it, and a step stuck for {2 * timeout:g} s)")


def check_method(method: str, nproc: int = CHECK_NPROC, steps: int = CHECK_STEPS,
                 timeout: float = CHECK_TIMEOUT, say=None,
                 workload: str = DEFAULT_WORKLOAD, options: Optional[dict] = None) -> tuple[bool, str]:
    """(exact or approximate, one line). ConfigError for a method that does not load.
    ``timeout``: how long a collective may wait; ``say``: called with the line that says what
    is being checked and how long it may take, before the ranks start. The ranks run with the
    debug switch (--debug-collectives) for a method of one's own, so collectives that differ
    between ranks are named (the built-ins' collectives are the tests'; DDP's constructor dies
    of SIGSEGV under TORCH_DISTRIBUTED_DEBUG=DETAIL with gloo in torch 2.14.1).
    ``workload``: what they train, at its small check size (its ``check_config``).
    A check that fails keeps its folder (the ranks' logs, named in the line)."""
    import torch

    from labkit.workloads import load_workload, resolve
    from labkit.training.instruments import exactness
    from labkit.training.sync import load_method

    from labkit.launch.launch import launch

    ref = absolute(method)
    load_method(ref)
    s = find(ref)
    if not s.exact:
        return True, (f"{s.key} is approximate (exact = False): judged by time to accuracy and "
                      f"final accuracy against DDP, not by its parameters")
    workload = workload_path(workload)
    small = load_workload(workload).check_config  # e.g. digits on ResNet-10
    cfg = TrainConfig(method=ref, workload=workload, batch_size=8, epochs=1,
                      max_steps_per_epoch=steps, max_val_steps=1, lr=0.01, calibrate_steps=0,
                      checkpoint=False, progress=False, pin_cpus=False, backend="gloo",
                      device="cpu", workers=0, timeout=timeout, debug_collectives=not s.builtin,
                      options=dict(options or {}), **small)
    (say or log.info)(checking_line(s.key, nproc, steps, timeout, workload))
    tmp = tempfile.mkdtemp(prefix="labkit-check-")
    out = os.path.join(tmp, s.key)
    res = launch(cfg, nproc, out, stream=io.StringIO())
    if not res.ok:  # its logs stay for the user to read: the message names them
        return False, f"{s.key} could not be checked (its logs: {res.log_dir}): {res.message}"
    final = torch.load(os.path.join(out, "final_model.pt"), map_location="cpu", weights_only=True)
    shutil.rmtree(tmp, ignore_errors=True)
    trainers = cfg.trainers(nproc)
    reference = exactness.reference_state(resolve(cfg, False, nproc), trainers, steps)
    v = exactness.compare(final, reference)
    return v.exact, v.line(s.key, steps, trainers)


def check_before_measuring(method: str, nproc: int = CHECK_NPROC, timeout: float = CHECK_TIMEOUT,
                           workload: str = DEFAULT_WORKLOAD,
                           options: Optional[dict] = None) -> Optional[str]:
    """For a method of one's own that claims exactness: its check's line; ConfigError (one
    line, nothing else run) when it is not exact. None for the built-ins (the tests check
    them) and approximate methods. ``timeout``: the run's --timeout, the check's own bound
    (CHECK_TIMEOUT) where that is longer; ``options``: the method's own (checked first, and
    the check runs with them)."""
    from labkit.core import params
    from labkit.training.sync import load_method

    cls = load_method(absolute(method))  # ConfigError, one line, for a method that does not load
    params.check_ranges(params.options_of(cls.Options, TrainConfig(options=dict(options or {}))))
    s = find(absolute(method))
    if s.builtin or not s.exact:
        return None
    exact, line = check_method(method, max(2, min(nproc, CHECK_NPROC)),
                               timeout=min(timeout, CHECK_TIMEOUT), workload=workload,
                               options=options)
    if not exact:
        raise ConfigError(line)
    return f"check: {line}"


def checked_launch(cfg: TrainConfig, nproc: int, out: str, nodes, **kw):
    """`labkit run`: the exactness check of a method of one's own, then its launch."""
    from labkit.launch.launch import launch

    line = check_before_measuring(cfg.method, nproc, cfg.timeout, cfg.workload, cfg.options)
    if line:
        log.info("%s", line)
    return launch(cfg, nproc, out, nodes, **kw)

