"""Extension points for code outside the package: fault injection and tracing in the tests,
a profiler or a logger in an experiment. Nothing in labkit installs a hook; the training loop
only calls what was installed.

    from . import extensions

    @extensions.on_trainer
    def slow_down(trainer):                  # called once per Trainer, after it is built
        trainer.step_callbacks.append(lambda tr, step: ...)   # before each training step
        trainer.strategy.step_delay = 0.5    # a strategy's own hooks (e.g. AsyncParameterServer)

A hook must be installed in the process that trains: under torchrun that is every rank, so a
test installs it from a module the rank imports at start-up (tests/hooks/sitecustomize.py).
The registry is the one piece of module-level state, on purpose: the ranks' entry point
(``python -m labkit.train``) cannot take Python objects as arguments.
"""
from __future__ import annotations

from typing import Any, Callable

TrainerHook = Callable[[Any], None]

_trainer_hooks: list[TrainerHook] = []


def on_trainer(fn: TrainerHook) -> TrainerHook:
    """Call ``fn(trainer)`` for every Trainer built from now on in this process."""
    _trainer_hooks.append(fn)
    return fn


def trainer_built(trainer: Any) -> None:
    """Called by labkit.training.trainer.Trainer at the end of its construction."""
    for fn in list(_trainer_hooks):
        fn(trainer)
