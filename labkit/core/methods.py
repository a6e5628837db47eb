"""The three methods as the files know them: names, result files, timed phases, roles.

What a method *does* lives in its strategy class (labkit.training.sync); what every layer
needs to *know* about it without importing the training code (the launcher, the result
writer, the report) is declared here, once:

- the guide's ``"method"`` string and result file name (a contract with the guide's users);
- the communication phases it times, which name its result keys (``avg_comm_time`` for the
  all-reduce, ``avg_comm_time_pull`` / ``_push`` for the parameter server);
- whether some of its ranks serve rather than train (the parameter server's).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

Method = Literal["ddp", "allreduce", "ps"]
METHODS: tuple[str, ...] = get_args(Method)


@dataclass(frozen=True)
class MethodSpec:
    key: str                   # ddp | allreduce | ps: the --method flag
    guide_name: str            # the guide's "method" string in the result file
    short: str                 # the report's name for it
    result_file: str           # the guide's result file name
    phases: tuple[str, ...]    # communication phases a trainer's blocked time is timed in
    serves: bool               # ranks 0..K-1 serve (hold parameters and optimizer), not train


SPECS: dict[str, MethodSpec] = {
    "ddp": MethodSpec("ddp", "Baseline DDP (PyTorch)", "Baseline DDP",
                      "results_baseline_ddp.json", (), False),
    "allreduce": MethodSpec("allreduce", "Manual All-Reduce", "Manual All-Reduce",
                            "results_all_reduce.json", ("comm",), False),
    "ps": MethodSpec("ps", "Parameter Server (PS)", "Parameter Server", "results_ps.json",
                     ("pull", "push"), True),
}
# the order of every table and figure
METHOD_ORDER: tuple[str, ...] = METHODS
RESULT_FILES = {m: s.result_file for m, s in SPECS.items()}
METHOD_NAMES = {m: s.guide_name for m, s in SPECS.items()}
SHORT = {m: s.short for m, s in SPECS.items()}


def spec(method: str) -> MethodSpec:
    return SPECS[method]


def server_ranks(method: str, ps_servers: int) -> int:
    """How many ranks serve: ``ps_servers`` for a parameter server, none otherwise."""
    return ps_servers if SPECS[method].serves else 0


def comm_key(phase: str) -> str:
    """Result key of a communication phase: the guide's ``avg_comm_time`` for the all-reduce,
    ``avg_comm_time_pull`` / ``avg_comm_time_push`` for the parameter server."""
    return "avg_comm_time" if phase == "comm" else f"avg_comm_time_{phase}"


def comm_times_key(phase: str) -> str:
    """Per-epoch key of a phase's per-step times (steady-state steps, mean over trainers):
    ``comm_times`` for the all-reduce, ``comm_times_pull`` / ``comm_times_push`` for the PS."""
    return "comm_times" if phase == "comm" else f"comm_times_{phase}"
