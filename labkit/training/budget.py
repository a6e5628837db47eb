"""The preflight of the machine: will this run fit on the disk, in /dev/shm and in host memory?

labkit.core.resources holds the arithmetic and the wording; this module supplies the run's
figures: the model's size (counted by the workload without building it on a device: the
images workload from its table, so neither torch nor torchvision is imported and no weights are
read), the checkpoint and the data a rank holds. The launcher checks before it spawns anything
(labkit.launch.launch, labkit.orchestrate.experiment); a rank of the bare torchrun command, which
no launcher checked for, checks the disk and /dev/shm before its process group exists. A shortfall
is bad input: ConfigError, one line, exit 2.
"""
from __future__ import annotations

from typing import Optional

from labkit.core.config import ConfigError, TrainConfig
from labkit.core.methods import server_ranks, spec
from labkit.core.resources import REPLICA_TIMES, Need, disk_need, memory_need, shm_need
from labkit.workloads import Workload, make_workload

FLOAT = 4  # bytes of a float32 value: weights, gradients and optimizer state are kept in fp32
#: a training step that has not ended after this many --timeout is ended by its rank
#: (labkit.training.rank's stall watchdog): the run then fails, whatever the step waits for
STALL_TIMEOUTS = 2


def checkpoint_bytes(values: int, state_per_value: int) -> int:
    """A checkpoint: the model, and the optimizer's state, ``state_per_value`` values per weight
    (SGD's momentum buffer: 1 when it has one; AdamW's two moments: 2)."""
    return FLOAT * values * (1 + state_per_value)


def needs(cfg: TrainConfig, workload: Workload, ranks: int, workers: int, where: str,
          methods: int = 1, flags: str = "--out", nodes: int = 1) -> list[Need]:
    """What a resolved ``cfg`` needs: disk for ``methods`` runs in ``where``, /dev/shm for the
    loader workers of the ``ranks`` on this machine, host memory for those ranks (of ``nodes``
    nodes emulated on it, or of this one node)."""
    values = workload.state_values()
    model = FLOAT * values
    batch = cfg.batch_size * workload.sample_bytes() or cfg.batch_size * 8
    ckpt = checkpoint_bytes(values, workload.optimizer_state_per_value)
    out = [disk_need(where, ckpt, model, methods, cfg.checkpoint, flags)]
    if workers:
        out.append(shm_need(workers, 2, ranks, batch, workload.shared_bytes()))
    share = replica_share(cfg, values, workload.optimizer_state_per_value, ranks)
    out.append(memory_need(ranks, workers, model, workload.data_bytes(), nodes, share, cfg.method))
    return out


def held_per_rank(cfg: TrainConfig, values: int, state_per_value: int, world: int) -> list:
    """What each of ``world`` ranks holds of a model of ``values`` fp32 weights by the method's
    own declaration (its class's memory_per_rank: a list of Held, in bytes)."""
    from .sync import load_method  # torch: only once a run is being checked

    return load_method(cfg.method).memory_per_rank(cfg, values, state_per_value, world)


def replica_share(cfg: TrainConfig, values: int, state_per_value: int, world: int) -> float:
    """What the fullest of ``world`` ranks holds of what a replica holds (DDP's weights,
    gradients and optimizer state): 1 for a method that keeps a replica on every rank, about
    1/world for one that shards all three (FSDP's ZeRO-3), more where a step gathers. The
    preflight scales a replica's estimate by it. ``world``: the ranks the preflight checks
    (this machine's; a real multi-node run's world is larger, so its share is smaller than
    this: the estimate errs high)."""
    from .sync.base import Strategy

    replica = Strategy.memory_per_rank(cfg, values, state_per_value, 1)[0].total
    held = max(h.total for h in held_per_rank(cfg, values, state_per_value, world))
    return held / replica if replica else 1.0


def check(found: list[Need], only: Optional[tuple[str, ...]] = None) -> list[str]:
    """Refuse the first shortfall (ConfigError, its one line); return the warnings for margins
    that are only tight. ``only``: the kinds of resource to look at (e.g. a rank checks the
    disk and /dev/shm, not memory the other ranks are taking as it looks)."""
    found = [n for n in found if only is None or n.what in only]
    for n in found:
        if n.short:
            raise ConfigError(n.line())
    return [n.line() for n in found if n.tight]


def machine(cfg: TrainConfig, ranks: int, where: str, methods: int = 1, flags: str = "--out",
            only: Optional[tuple[str, ...]] = None, nodes: int = 1) -> list[str]:
    """Check a resolved, validated ``cfg`` against this machine: ConfigError on a shortfall,
    the warnings of tight margins returned (the caller says them, once). ``ranks``: every
    rank this machine runs (an emulated cluster's ``nodes`` nodes' together)."""
    from .data import default_workers

    workload = make_workload(cfg)
    workers = default_workers(cfg, workload.in_memory, ranks // nodes)  # as each node's ranks decide
    return check(needs(cfg, workload, ranks, workers, where, methods, flags, nodes), only)


def step_link_bytes(cfg: TrainConfig, nodes: int, ranks_per_node: int) -> Optional[float]:
    """About how many bytes one training step of a resolved ``cfg`` moves each way over a
    node's link, its ranks on ``nodes`` nodes of ``ranks_per_node``: from the model's size
    and what the method sends (its class's bytes_per_step). An all-reduce of the
    gradients (DDP, the hand-written all-reduce) carries 2 (N-1)/N of them over each of N
    nodes' links, the least any all-reduce can (a ring's share); a parameter server's node
    that holds no server pushes the gradients out and pulls the parameters in. None where
    that is not known: one node, a method that sends less or not in every step (PowerSGD,
    local SGD, DiLoCo, the bound, a method of one's own), an asynchronous parameter server,
    or servers on every node."""
    from .sync import load_method  # torch: only once a run is being checked

    s = spec(cfg.method)
    if nodes < 2 or not (s.builtin and s.exact) or cfg.ps_staleness:
        return None
    push, pull = load_method(cfg.method).bytes_per_step(cfg, FLOAT * make_workload(cfg).state_values())
    if not s.serves:
        return 2 * (nodes - 1) / nodes * push
    if server_ranks(cfg.method, cfg.ps_servers) > (nodes - 1) * ranks_per_node:
        return None
    return max(push, pull)


def tensors_per_rank(cfg: TrainConfig, workload: Workload, world: int) -> int:
    """The bytes of tensors the host-memory preflight expects the fullest of ``world`` ranks
    to hold (a replica's 5 x the model, scaled by the method's share of a replica's state):
    the figure beside the measured peak in the report's memory table."""
    values = workload.state_values()
    share = replica_share(cfg, values, workload.optimizer_state_per_value, world)
    return round(REPLICA_TIMES * FLOAT * values * share)


def largest_fit(cfg: TrainConfig, workload: Workload, world: int, capacity: float,
                overhead: float) -> int:
    """The most fp32 weights a model of this workload could have and fit ``capacity`` bytes on
    each of ``world`` ranks, projected by the preflight's arithmetic (a replica's 5 x the model,
    scaled by the method's share of a replica's state) for the model scaled as a whole, so that
    the method's share stays what it is for this one. ``overhead``: what a rank holds besides
    the model's tensors (torch itself and its copy of the data on a CPU; nothing on a GPU)."""
    per_value = tensors_per_rank(cfg, workload, world) / max(1, workload.state_values())
    return max(0, int((capacity - overhead) / per_value)) if per_value else 0
