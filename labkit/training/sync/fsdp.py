"""``--method fsdp``: PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``), as PyTorch ships
it: each shard unit (``--fsdp-units``, by default the workload's ``shard_units``: the language
model's transformer blocks, a ResNet's four stages) is ``fully_shard``-ed, then the root, which
holds the rest (embeddings, the stem, the head). Every parameter becomes a DTensor sharded on its
first dimension over the ranks (padded to a multiple of their number), so each rank holds 1/N of
every parameter, gradient and optimizer state; the loop's optimizer (the workload's: AdamW for
lm, SGD for images) is made over those DTensors after setup and steps each rank's shard.

Per step, forward all-gathers each unit's parameters before it runs and backward all-gathers
them again (``--reshard-after-forward``, the default: ZeRO-3; ``--no-reshard-after-forward``
keeps them from forward to backward: ZeRO-2's traffic, one all-gather a step), and backward
reduce-scatters each unit's gradients, averaged over the ranks. The root's parameters are
gathered once a step either way: FSDP2 keeps the root unsharded from its forward to its
backward, since backward needs it at once. Exact: the gradients are averaged before the
optimizer, as DDP's are.

The bytes on the wire are counted the lab's way (labkit.training.sync.collectives): FSDP's own
collectives are its ``set_custom_all_gather`` / ``set_custom_reduce_scatter`` interface, and
here both issue FSDP's own call (``all_gather_single``, ``reduce_scatter_single``) through the
strategy, which stamps and counts it: (n-1)/n of the gathered buffer, and of the buffer
reduce-scattered, each way (a ring's). What crosses on gloo differs for the reduce-scatter:
gloo has none, and PyTorch emulates it with an all-reduce of the whole buffer. Measured (the
bytes a rank wrote to its sockets, /proc/self/io's wchar, around one call): with 2 gloo ranks
and a 16 MB buffer, all_reduce 16.0 MB, reduce_scatter_single 16.0 MB (a ring's: 8.0),
all_gather_single 8.0 MB; with 3 ranks and 12 MB, 16.0, 16.0 (a ring's: 8.0) and 8.0. So on
gloo a step's gradients cost what DDP's all-reduce costs, twice the count here; the count is
what a ring (NCCL's) moves, as ``bytes_per_step`` models it and the report states it.

PyTorch issue 162338 reports FSDP2 on gloo summing the gradients where it should average them
(ReduceOp.AVG in the reduce-scatter). The exactness check is what shows whether it happens: with
torch 2.14.1 it does not (gloo's AVG averages; tests/test_fsdp.py ends at the single-process
reference, and a subclass that makes FSDP sum fails the same comparison), so the method keeps
FSDP's own reduction.

BatchNorm buffers are not sharded (FSDP2 shards parameters only): each rank's running
statistics follow its own batches and ``finish_epoch`` gives every rank the first trainer's, as
for every method. Nothing here runs without communication, so there are no compute-only steps
(``calibrates``); ``no_sync`` still gathers and reduces. One process holds the whole model:
refused (``check``), as there is nothing to shard.

HSDP (``--fsdp-replicas R``, the variant ``hsdp``: R = 2): a 2-D DeviceMesh (dp_replicate R,
dp_shard S = world / R), fully_shard(mesh=...) as torchtitan builds it from its
data_parallel_replicate_degree (its shard degree the rest, -1). The mesh is row-major over the
ranks, so each shard group is S consecutive ranks: one node's, where S is the ranks of a node
(torchrun numbers a node's ranks consecutively), and each parameter is Replicate() across the
R groups and Shard(0) within one. Forward and backward gather within the shard group; backward
reduce-scatters within it and then all-reduces each rank's shard of the gradients across the
replicas (the ranks holding the same shard: the mesh's dp_replicate group). So only that
all-reduce leaves a node: 2(R-1)/R of the shard from each rank, 2(R-1)/R of the gradients
through each node's port, where fsdp over every rank sends 3(n-1)/n (ZeRO-3) of them through
it. FSDP2 issues that all-reduce itself (``dist.all_reduce``, outside the custom collectives);
its hook after it (``set_all_reduce_hook``) counts it, a ring's, and stamps it from the end of
the reduce-scatter, where FSDP starts it. A rank holds 1/S of the model, not 1/n. R is a number,
as torchtitan's degree is, rather than "one replica per node": the launcher checks a config
against the world before any rank knows its node's size, and R = the nodes is that layout.

On a node of an emulated cluster (labkit.launch.emulated) the bytes its port carried per
training step are read from the node's own interfaces (:class:`LinkMeter`): what crossed the
link, against the collectives' count, which cannot say which of them left the node.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from labkit.core.config import ConfigError, TrainConfig
from labkit.core.params import option
from labkit.core.procs import EMULATED_NODES
from labkit.workloads import make_workload

from .base import FLOAT, Held, Strategy, broadcast_parameters, refuse_compress
from .collectives import nbytes

BF16 = 2  # bytes of a bf16 value: what --fsdp-bf16 gathers


@dataclass
class FSDPOptions:
    reshard_after_forward: bool = option(
        True, "fsdp: free each unit's gathered parameters after its forward and gather them "
        "again in backward (ZeRO-3, FSDP2's default); --no-reshard-after-forward keeps them "
        "until its backward: one all-gather a step, the whole parameters held meanwhile (ZeRO-2)")
    fsdp_units: Optional[str] = option(
        None, "fsdp: the modules sharded one by one, comma-separated names as the model's "
        "named_modules() gives them (default: the workload's units, e.g. blocks.0,blocks.1 for "
        "lm, layer1,...,layer4 for images); an empty list shards the whole model as one unit")
    fsdp_bf16: bool = option(
        False, "fsdp: gather the parameters in bf16 for forward and backward and reduce the "
        "gradients in fp32 (FSDP2's MixedPrecisionPolicy, as torchtitan); on a GPU only")
    fsdp_replicas: int = option(
        1, "fsdp: HSDP's replicas R (torchtitan's data_parallel_replicate_degree): each "
        "parameter sharded over a group of world/R consecutive ranks, one node's where that is "
        "a node's ranks, and replicated across the R groups; the gradients reduce-scattered in "
        "a group and all-reduced across the replicas; 1: sharded over every rank (FSDP)",
        at_least=1)


def unit_names(cfg: TrainConfig, model: nn.Module) -> list[str]:
    """The modules to shard one by one: --fsdp-units, else the workload's shard units."""
    if cfg.fsdp_units is None:
        return make_workload(cfg).shard_units(model)
    return list(dict.fromkeys(n.strip() for n in cfg.fsdp_units.split(",") if n.strip()))


class FSDP(Strategy):
    key, title, short = "fsdp", "FSDP2 (PyTorch fully_shard)", "FSDP"
    exact, replicates, calibrates = True, False, False
    compute_measured = ("not separated from the communication: FSDP's forward gathers the "
                        "parameters, so no step runs without it")
    phases = ()  # its collectives run inside forward and backward, as DDP's: stamped, not timed
    order = 7
    Options = FSDPOptions
    # hsdp: two replicas, the two nodes of the lab's emulated cluster (--emulate-nodes 2), each
    # sharded over its node's ranks; more nodes: --fsdp-replicas N
    variants = {"fsdp": {}, "fsdp-zero2": {"reshard_after_forward": False},
                "hsdp": {"fsdp_replicas": 2}}
    preload = ("torch.distributed.fsdp", "torch.distributed.checkpoint.state_dict",
               "torch.distributed.device_mesh")
    # labkit.costmodel: gathers per unit before its forward (and its backward, ZeRO-3) and a
    # reduce-scatter after its backward, prefetched one unit ahead of the compute
    cost_model = "sharded"

    @classmethod
    def check(cls, cfg: TrainConfig, world: int) -> None:
        refuse_compress(cfg, "fsdp reduces the gradients in fp32 (bf16 parameters on a GPU: "
                             "--fsdp-bf16)")
        if world < 2:
            raise ConfigError(f"fsdp shards the model over the ranks: it needs at least 2 "
                              f"processes (got {world}); one process holds the whole model "
                              f"(--method ddp)")
        _check_replicas(cfg.fsdp_replicas, world)
        if cfg.fsdp_bf16 and cfg.device != "cuda":
            raise ConfigError(f"--fsdp-bf16 runs on a GPU only (--device cuda): bf16 compute on "
                              f"the {cfg.device} is not what it measures")
        if cfg.fsdp_units is not None:
            with torch.device("meta"):  # the names only: no weights made
                model = make_workload(cfg).build_model()
            _check_units(unit_names(cfg, model), model, cfg)

    @classmethod
    def bytes_per_step(cls, cfg: TrainConfig, grad_bytes: int) -> tuple[int, int]:
        """In units of one ring all-reduce of the gradients (2(n-1)/n of them each way): each
        all-gather moves (n-1)/n of the parameters and the reduce-scatter (n-1)/n of the
        gradients, so ZeRO-3's two gathers and a reduce-scatter are 1.5 all-reduces and
        ZeRO-2's one gather 1 (the root, gathered once either way, makes ZeRO-3's a little
        less); with --fsdp-bf16 the gathers carry half the bytes. With --grad-accum K the
        gathers run for every micro-batch, the reduce-scatter once (accumulating()).

        HSDP (--fsdp-replicas R > 1): what crosses between the replicas, the one collective that
        leaves a shard group (a node): the all-reduce of the gradients, each rank's shard of
        them, the whole gradients from a group's ranks together: 1 all-reduce, ZeRO-3 or 2.
        The gathers and the reduce-scatter stay inside the group (loopback, NVLink)."""
        if cfg.fsdp_replicas > 1:
            return grad_bytes, 0
        gathers = (2 if cfg.reshard_after_forward else 1) * cfg.grad_accum
        width = BF16 / FLOAT if cfg.fsdp_bf16 else 1.0
        return round(grad_bytes * (gathers * width + 1) / 2), 0

    @classmethod
    def memory_per_rank(cls, cfg: TrainConfig, values: int, state_per_value: int,
                        world: int) -> list[Held]:
        """Each rank holds 1/N of the fp32 parameters, of the gradients (reduce-scattered) and
        of the optimizer state. ZeRO-3 gathers one unit at a time (a unit's parameters beside
        the shards, freed after its forward and its backward: not counted here); ZeRO-2
        (--no-reshard-after-forward) also holds every gathered parameter from its forward to
        the end of its backward: the whole model once more (in bf16 with --fsdp-bf16). HSDP
        (--fsdp-replicas R) shards over a group of world/R ranks: R/N of each."""
        shard = FLOAT * values * cfg.fsdp_replicas / world
        parameters = shard
        if not cfg.reshard_after_forward:
            parameters += (BF16 if cfg.fsdp_bf16 else FLOAT) * values
        return [Held(parameters, shard, shard * state_per_value)] * world

    def setup(self, model: nn.Module) -> nn.Module:
        broadcast_parameters(model)  # every rank's shard is cut from rank 0's weights
        mesh = self.mesh()
        policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                  if self.cfg.fsdp_bf16 else MixedPrecisionPolicy())
        # ZeRO-3 is FSDP2's own default (None): the units reshard after forward, the root does
        # not (backward needs it at once); ZeRO-2: none does
        kw = dict(mesh=mesh, reshard_after_forward=None if self.cfg.reshard_after_forward else False,
                  mp_policy=policy)
        # innermost first: fully_shard of a module leaves out the parameters of units inside it
        names = sorted(unit_names(self.cfg, model), key=lambda n: -n.count("."))
        self.units: list[FSDPModule] = [fully_shard(model.get_submodule(n), **kw) for n in names]
        self.units.append(fully_shard(model, **kw))
        for unit in self.units:
            self.configure(unit)
        return model

    def mesh(self):
        """FSDP's mesh: 1-D over every rank, or HSDP's (dp_replicate R, dp_shard world/R),
        row-major, so a shard group is consecutive ranks (a node's); its replicate group, the
        ranks holding this rank's shard, kept for the replica check and the count."""
        r = self.cfg.fsdp_replicas
        #: the ranks that hold this rank's shard (HSDP), None where no two ranks do (FSDP)
        self.replicate = None
        self.scattered = None  # when the last reduce-scatter ended: where FSDP starts the all-reduce
        #: what this node's port carried (on an emulated cluster; None elsewhere)
        self.link = LinkMeter.on_emulated_node()
        if r == 1:
            return init_device_mesh(self.ctx.device.type, (self.ctx.world_size,))
        mesh = init_device_mesh(self.ctx.device.type, (r, self.ctx.world_size // r),
                                mesh_dim_names=("dp_replicate", "dp_shard"))
        self.replicate = mesh.get_group("dp_replicate")
        return mesh

    def configure(self, unit: FSDPModule) -> None:
        """Each FSDP module's collectives go through the strategy (timed, counted); HSDP's
        all-reduce, which FSDP issues itself, is counted by the hook it calls after it."""
        unit.set_custom_all_gather(_AllGather(self))
        unit.set_custom_reduce_scatter(_ReduceScatter(self))
        if self.replicate is not None:
            unit.set_all_reduce_hook(self.replicas_reduced)

    def issue(self, call: Callable[[], dist.Work], whole: torch.Tensor, group, async_op: bool,
              phase: str):
        """One of FSDP's collectives, ``whole`` being the gathered buffer or the one
        reduce-scattered: (n-1)/n of it each way, stamped into the step as the helpers'."""
        n = group.size()
        b = (n - 1) / n * nbytes(whole)
        work = self._issue(call, async_op, b, b, phase)
        if self.replicate is not None and phase == "reduce_scatter" and not async_op:
            self.scattered = self._stamp()
        return work

    def replicas_reduced(self, shard: torch.Tensor) -> None:
        """HSDP: FSDP has all-reduced ``shard``, this rank's part of a unit's gradients, across
        the replicas (its own ``dist.all_reduce``, then this hook): counted as a ring's 2(R-1)/R
        of it each way, and stamped from the end of the unit's reduce-scatter, where FSDP
        starts it, to now (on a GPU: on the all-reduce's stream, after it)."""
        r = self.replicate.size()
        b = 2 * (r - 1) / r * nbytes(shard)
        self.count_bytes("all_reduce", b, b)
        if self.scattered is not None:
            done = torch.futures.Future()
            done.set_result(None)
            self.parts.issued(done, self.scattered)  # completed: the interval ends now
        self.scattered = None

    def _stamp(self):
        """Now, as the step's collectives are stamped (None outside a step or --time-comm off)."""
        parts = self.parts if self.cfg.times_comm else None
        return parts.stamp() if parts is not None and parts.steps else None

    shards_gradients = True  # --grad-clip's norm: over every shard

    @property
    def gradient_copies(self) -> int:
        return self.cfg.fsdp_replicas  # HSDP: each shard is held by R ranks

    @contextmanager
    def accumulating(self) -> Iterator[None]:
        """--grad-accum: FSDP2's ``set_requires_gradient_sync(False)``: the micro-batches'
        gradients add up unsharded, reduce-scattered once, at the last; the parameters are
        still gathered for every micro-batch's forward and backward."""
        root = self.units[-1]
        with super().accumulating():
            root.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                root.set_requires_gradient_sync(True)

    def step(self, optimizer: Optional[torch.optim.Optimizer], scaler=None) -> None:
        super().step(optimizer, scaler)
        if self.link is not None:
            self.link.read()  # the end of a step: its collectives are done

    def epoch_metrics(self) -> dict:
        """The FSDP modules (the shard units and the root: the cost model's units), and on an
        emulated cluster what this node's port carried per step."""
        out = {"shard_units": len(self.units)}
        if self.link is not None and (per_step := self.link.take()) is not None:
            out["link_bytes_per_step"] = per_step
        return out

    # --- the model as a whole: each rank holds a shard of every parameter ---
    def full_state(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer]
                   ) -> tuple[Optional[dict], Optional[dict]]:
        """Every rank gathers; rank 0 alone keeps the whole tensors (on the CPU), the others
        get empty dicts. The optimizer's state is keyed by parameter name."""
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(model, options=opts)
        if optimizer is None:
            return state, None
        return state, get_optimizer_state_dict(model, optimizer, options=opts)

    def load_full_state(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer],
                        model_state: dict, optimizer_state: Optional[dict]) -> None:
        """Every rank has read the checkpoint: each cuts its own shard of it."""
        opts = StateDictOptions(full_state_dict=True)
        set_model_state_dict(model, model_state, options=opts)
        if optimizer is not None and optimizer_state is not None:
            set_optimizer_state_dict(model, optimizer, optimizer_state, options=opts)

    def replicas(self, model: nn.Module) -> tuple[list[tuple[str, torch.Tensor]], Any]:
        """FSDP: the buffers only (FSDP2 does not shard them; finish_epoch gave every rank the
        first trainer's): no two ranks hold the same shard of a parameter. HSDP: this rank's
        shard of every parameter and the buffers, alike on the ranks of its replicate group."""
        buffers = list(model.named_buffers())
        if self.replicate is None:
            return buffers, None
        shards = [(n, p.to_local() if hasattr(p, "to_local") else p)
                  for n, p in model.named_parameters()]
        return shards + buffers, self.replicate

    def whole_model(self, model: nn.Module, state: Optional[dict],
                    build: Callable[[], nn.Module]) -> nn.Module:
        """A plain model of the workload's, on rank 0's device, holding the gathered state."""
        whole = build()
        whole.load_state_dict(state)
        return whole.to(self.ctx.device)


class _Comm:
    """One of FSDP's two collectives as FSDP calls it (its custom all-gather / reduce-scatter
    interface: ``allocate`` its buffers, then call it), issued by the strategy."""

    def __init__(self, strategy: FSDP):
        self.strategy = strategy

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)  # FSDP's default allocation


class _AllGather(_Comm):
    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        return self.strategy.issue(lambda: dist.all_gather_single(
            output_tensor, input_tensor, group=group, async_op=True), output_tensor, group,
            async_op, "all_gather")


class _ReduceScatter(_Comm):
    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        return self.strategy.issue(lambda: dist.reduce_scatter_single(
            output_tensor, input_tensor, op=op, group=group, async_op=True), input_tensor, group,
            async_op, "reduce_scatter")


def _check_replicas(r: int, world: int) -> None:
    """ConfigError for HSDP replicas that do not cut ``world`` ranks into shard groups of two
    ranks or more (one rank a group shards nothing: every rank a replica, DDP's layout)."""
    if r == 1:
        return
    fits = [d for d in range(1, world) if world % d == 0 and world // d >= 2]
    give = f"give one of {', '.join(map(str, fits))}" if len(fits) > 1 else "give 1 (FSDP)"
    if world % r:
        raise ConfigError(f"--fsdp-replicas {r} does not divide the {world} ranks: HSDP's "
                          f"replicas are shard groups of equal size (ranks = replicas x ranks "
                          f"per group, a node's); {give}")
    if world // r < 2:
        raise ConfigError(f"--fsdp-replicas {r} of {world} ranks leaves one rank a shard group: "
                          f"nothing is sharded (every rank a whole replica: --method ddp); "
                          f"{give}")


class LinkMeter:
    """What a node's port carried per training step, each way: the bytes of the network
    namespace's interfaces other than loopback (/proc/net/dev, as the kernel counts them:
    frames with their TCP/IP headers, and the other direction's ACKs), read at the end of each
    step. On an emulated cluster a rank runs in its node's namespace, whose one port is its
    link (labkit.launch.cluster); the node's ranks share it, so every rank reads the node's."""

    def __init__(self):
        self.first: Optional[tuple[int, int]] = None
        self.last: Optional[tuple[int, int]] = None
        self.steps = 0

    @classmethod
    def on_emulated_node(cls) -> Optional["LinkMeter"]:
        """A meter where this process runs on an emulated node with a port to read, else None."""
        return cls() if os.environ.get(EMULATED_NODES) and port_bytes() is not None else None

    def read(self) -> None:
        now = port_bytes()
        if now is None:
            return
        if self.first is None:
            self.first = now  # the end of the epoch's first step: its start-up is left out
        else:
            self.last, self.steps = now, self.steps + 1

    def take(self) -> Optional[dict]:
        """{"sent", "received", "steps"}: per step over the epoch's steps after its first (None
        for fewer than 2); then starts again."""
        got = None
        if self.first is not None and self.last is not None and self.steps:
            got = {"sent": (self.last[0] - self.first[0]) / self.steps,
                   "received": (self.last[1] - self.first[1]) / self.steps, "steps": self.steps}
        self.first = self.last = None
        self.steps = 0
        return got


def port_bytes(path: str = "/proc/net/dev") -> Optional[tuple[int, int]]:
    """(bytes sent, bytes received) by this network namespace's interfaces but loopback; None
    where there is none, or the file cannot be read."""
    try:
        with open(path) as f:
            rows = f.read().splitlines()[2:]  # two header lines
    except OSError:
        return None
    sent = received = 0
    ports = 0
    for row in rows:
        name, _, fields = row.partition(":")
        if name.strip() == "lo" or not fields.split():
            continue
        values = fields.split()
        received, sent, ports = received + int(values[0]), sent + int(values[8]), ports + 1
    return (sent, received) if ports else None


def _check_units(names: list[str], model: nn.Module, cfg: TrainConfig) -> None:
    """ConfigError naming a unit the model does not have (with those it has, two levels down:
    a deeper one is named by its parents' names), or one that holds no parameters to shard."""
    have, what = dict(model.named_modules()), f"the {cfg.model} model" if cfg.model else "the model"
    for n in names:
        if n not in have:
            shown = [m for m, mod in have.items() if m and m.count(".") < 2
                     and any(True for _ in mod.parameters())]
            raise ConfigError(f"--fsdp-units: {what} has no module {n!r}; its "
                              f"modules, two levels down: {', '.join(shown)}")
        if not any(True for _ in have[n].parameters()):
            raise ConfigError(f"--fsdp-units: module {n!r} of {what} holds no "
                              f"parameters to shard")
