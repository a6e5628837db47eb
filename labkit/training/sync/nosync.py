"""``--method nosync``: the bound. Every rank takes the forward, backward and optimizer steps of
a training step and communicates nothing (what PyTorch's ``noop_hook`` does to DDP), so its
throughput bounds what any method could gain by communicating less. The ranks' parameters
drift apart: it is judged by speed only, never by accuracy. At the end of each epoch every rank
takes rank 0's parameters and buffers (outside the timed steps), so validation, the saved model
and the replica check see one model.
"""
from __future__ import annotations

from torch import nn

from .base import Strategy, broadcast_parameters


class NoSync(Strategy):
    key, title, short = "nosync", "No synchronisation (bound)", "No sync (bound)"
    exact, phases, bound = False, (), True
    order, default = 3, True
    steps_are_compute_only = True  # the calibration reads its last steps, runs none of its own

    def setup(self, model: nn.Module) -> nn.Module:
        broadcast_parameters(model)  # the same start as every method (once, not a step)
        return model

    def finish_epoch(self, model: nn.Module) -> None:
        broadcast_parameters(model)  # rank 0's model, parameters and buffers, on every rank
