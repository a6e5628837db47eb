"""`labkit check METHOD`: is a method exact? It trains a few steps on the embedded default
(digits, ResNet-10, gloo on the CPU) beside the single-process reference
(labkit.training.exactness), in seconds. A method of one's own that claims exactness is checked
this way before `labkit run` or `labkit experiment` measures it: one that is not exact fails in
one line naming the parameter that differs and by how much, and nothing else runs.
"""
from __future__ import annotations

import io
import logging
import os
import tempfile
from typing import Optional

from labkit.core.config import ConfigError, TrainConfig
from labkit.core.methods import METHOD_ORDER, absolute, find

CHECK_STEPS, CHECK_NPROC = 3, 2
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


def cmd_check(args: dict) -> int:
    exact, line = check_method(args["method"], args.get("nproc", CHECK_NPROC),
                               args.get("steps", CHECK_STEPS))
    print(f"labkit check: {line}")  # the command's verdict: printed, with -q too
    return 0 if exact else 1


def check_method(method: str, nproc: int = CHECK_NPROC, steps: int = CHECK_STEPS
                 ) -> tuple[bool, str]:
    """(exact or approximate, one line). ConfigError for a method that does not load."""
    import torch

    from labkit.core.config import resolve
    from labkit.training import exactness
    from labkit.training.sync import load_method

    from .launch import launch

    ref = absolute(method)
    load_method(ref)
    s = find(ref)
    if not s.exact:
        return True, (f"{s.key} is approximate (exact = False): judged by time to accuracy and "
                      f"final accuracy against DDP, not by its parameters")
    cfg = TrainConfig(method=ref, dataset="digits", model="resnet10_small", batch_size=8,
                      epochs=1, max_steps_per_epoch=steps, max_val_steps=1, lr=0.01,
                      calibrate_steps=0, checkpoint=False, progress=False, pin_cpus=False,
                      backend="gloo", device="cpu", workers=0)
    with tempfile.TemporaryDirectory(prefix="labkit-check-") as tmp:
        out = os.path.join(tmp, s.key)
        res = launch(cfg, nproc, out, stream=io.StringIO())
        if not res.ok:
            return False, f"{s.key} could not be checked: {res.message}"
        final = torch.load(os.path.join(out, "final_model.pt"), map_location="cpu",
                           weights_only=True)
    trainers = cfg.trainers(nproc)
    reference = exactness.reference_state(resolve(cfg, False, nproc), trainers, steps)
    v = exactness.compare(final, reference)
    return v.exact, v.line(s.key, steps, trainers)


def check_before_measuring(method: str, nproc: int = CHECK_NPROC) -> Optional[str]:
    """For a method of one's own that claims exactness: its check's line; ConfigError (one
    line, nothing else run) when it is not exact. None for the built-ins (the tests check
    them) and approximate methods."""
    from labkit.training.sync import load_method

    load_method(absolute(method))  # ConfigError, one line, for a method that does not load
    s = find(absolute(method))
    if s.builtin or not s.exact:
        return None
    exact, line = check_method(method, max(2, min(nproc, CHECK_NPROC)))
    if not exact:
        raise ConfigError(line)
    return f"check: {line}"


def checked_launch(cfg: TrainConfig, nproc: int, out: str, nodes, **kw):
    """`labkit run`: the exactness check of a method of one's own, then its launch."""
    from .launch import launch

    line = check_before_measuring(cfg.method, nproc)
    if line:
        log.info("%s", line)
    return launch(cfg, nproc, out, nodes, **kw)

