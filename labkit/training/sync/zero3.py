"""Manual fully sharded data parallelism (ZeRO-3, Rajbhandari et al., SC 2020): by hand, as the
Manual All-Reduce is to DDP, what FSDP (``--method fsdp``) does inside PyTorch.

The model is cut into units: the workload's ``shard_units`` (the lm's blocks, the ResNets'
stages) and the rest of the model, the root. A unit's parameters are one flat buffer, padded to
a multiple of the n ranks; rank r keeps slice r of it, its shard, and between uses nothing else:

1. before a unit's forward the shards are all-gathered into the flat buffer, which the module's
   parameters are views of; after its forward the buffer's storage is freed (resized to 0);
2. before its backward (when the gradient of its output arrives) it is gathered again;
3. once backward has made all its gradients they are flattened, divided by n and reduce-
   scattered (started at once, as the all-reduce's buckets are): rank r receives the average
   of slice r, its shard's gradient; the whole parameters and gradients are dropped;
4. the loop's optimizer, the workload's own (AdamW, SGD), steps the shards: the model's
   ``parameters()`` yield this rank's pieces of them (``_register``): the loop, unchanged.

Each unit, the root too (FSDP2 keeps its root from forward to backward), is gathered twice a
step and its gradients reduce-scattered once, (n-1)/n of them each: 3(n-1)/n of the parameter
bytes where DDP's all-reduce sends 2(n-1)/n, 1.5 times. A rank holds 1/n of the parameters,
gradients and optimizer state, and while a step runs the root and one unit whole.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from itertools import accumulate
from typing import Callable, Optional

import torch
from torch import nn

from labkit.core.config import ConfigError, TrainConfig
from labkit.workloads import make_workload

from .base import FLOAT, Held, Strategy, broadcast_parameters, refuse_compress
from .buckets import InOrder


@dataclass
class Unit:
    module: nn.Module
    params: list[nn.Parameter]    # the whole parameters: views into ``full``
    offsets: list[int]            # where each starts in ``full``
    full: torch.Tensor            # the unit gathered (its storage freed between uses)
    shard: torch.Tensor           # this rank's slice of ``full``: all it keeps
    grad: torch.Tensor            # the shard's gradient: the averaged slice of the gradients
    spans: list[tuple[int, int]] = field(default_factory=list)  # each piece's place in shard
    pieces: list[nn.Parameter] = field(default_factory=list)    # what the optimizer steps
    gathered: bool = False


def unit_params(model: nn.Module, names: list[str]) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """(module, trainable parameters) per unit, in the order backward finishes them: the shard
    units ``names`` last to first, then the root (the rest, and any parameter two units share:
    the root is gathered through the whole model's forward and through its backward)."""
    owners: dict[nn.Parameter, set[str]] = {}
    for mname, module in model.named_modules():
        unit = next((u for u in names if mname == u or mname.startswith(u + ".")), "")
        for p in module.parameters(recurse=False):
            if p.requires_grad:
                owners.setdefault(p, set()).add(unit)
    by_unit: dict[str, list[nn.Parameter]] = {u: [] for u in [*reversed(names), ""]}
    for p, units in owners.items():
        by_unit[units.pop() if len(units) == 1 else ""].append(p)
    modules = dict(model.named_modules())
    return [(modules[u], ps) for u, ps in by_unit.items() if ps]


class ManualFullySharded(Strategy):
    key, title, short = "zero3", "Manual fully sharded (ZeRO-3)", "Manual ZeRO-3"
    phases, order, cost_model = ("gather", "reduce"), 8, "sharded"
    replicates, calibrates, shards_gradients = False, False, True
    compute_measured = ("the step less its measured communication: its forward and backward "
                        "gather the parameters, so no step runs without communicating")

    @classmethod
    def check(cls, cfg: TrainConfig, world: int) -> None:
        refuse_compress(cfg, "zero3 gathers and reduces fp32 values")
        if world < 2:
            raise ConfigError(f"zero3 shards the model over the ranks: it needs at least 2 "
                              f"processes (got {world}); one holds the whole model (--method ddp)")
        if cfg.compile or cfg.amp == "fp16":  # hooks that free storage; a scaler per shard
            raise ConfigError("zero3 runs without --compile (its hooks free and gather the "
                              "parameters) and --amp fp16 (an overflow in one rank's shard "
                              "would skip that rank's step alone; --amp bf16 runs)")

    @classmethod
    def bytes_per_step(cls, cfg: TrainConfig, grad_bytes: int) -> tuple[int, int]:
        """All-gathers of the parameters and a reduce-scatter of the gradients, (n-1)/n of them
        each: two gathers and a reduce-scatter, 1.5 ring all-reduces. With --grad-accum K a unit
        gathered for a micro-batch's backward stays whole (its gradients wait for the last) and
        serves the next forward: K + 1 gathers, (K + 2)/2 all-reduces."""
        return (cfg.grad_accum + 2) * grad_bytes // 2, 0

    @classmethod
    def memory_per_rank(cls, cfg: TrainConfig, values: int, state_per_value: int,
                        world: int) -> list[Held]:
        """1/n of the parameters, gradients and optimizer state; while a step runs also the
        whole parameters and gradients of the root and of the largest other unit."""
        w = make_workload(cfg)
        with torch.device("meta"):  # the sizes only: no weights made
            model = w.build_model()
        size = {m: sum(p.numel() for p in ps) for m, ps in unit_params(model, w.shard_units(model))}
        held = FLOAT * (values / world + size.pop(model, 0) + max(size.values(), default=0))
        return [Held(held, held, FLOAT * values * state_per_value / world)] * world

    # ------------------------------------------------------------------ set-up: the shards
    def setup(self, model: nn.Module) -> nn.Module:
        broadcast_parameters(model)
        self.n, self.rank = self.ctx.world_size, self.ctx.rank
        self.held = self.peak = 0  # bytes of whole parameters gathered: now, and the most
        self.keys: dict[nn.Parameter, list[str]] = {}  # the state dict's names (tied: two)
        for k, t in model.state_dict(keep_vars=True).items():
            if isinstance(t, nn.Parameter):
                self.keys.setdefault(t, []).append(k)
        names = make_workload(self.cfg).shard_units(model)
        self.units = [self._shard(m, ps) for m, ps in unit_params(model, names)]
        self._register(model)
        self.unit_of = {p: i for i, u in enumerate(self.units) for p in u.params}
        self.order = InOrder([len(u.params) for u in self.units])  # reduce-scatters, in order
        self.handles: list = []
        for u in self.units:
            u.module.register_forward_pre_hook(partial(self._gather, u))
            u.module.register_forward_hook(partial(self._after_forward, u))
        for p in self.unit_of:
            p.register_post_accumulate_grad_hook(self._grad_ready)
        return model

    def _shard(self, module: nn.Module, params: list[nn.Parameter]) -> Unit:
        """The unit of ``params``: flattened, this rank's slice kept, each parameter made a
        view into the flat buffer, which is then freed."""
        numel = sum(p.numel() for p in params)
        size = -(-numel // self.n)  # padded: every rank's slice the same size
        full = params[0].new_zeros(size * self.n)
        offsets = [0, *accumulate(p.numel() for p in params)][:-1]
        for p, o in zip(params, offsets):
            full[o:o + p.numel()].copy_(p.detach().reshape(-1))
            p.data = full[o:o + p.numel()].view_as(p)
        lo = self.rank * size
        u = Unit(module, params, offsets, full, full[lo:lo + size].clone(), full.new_zeros(size))
        for p, o in zip(params, offsets):
            # the part of p in this rank's slice, as many dimensions as p has (the workload's
            # optimizer groups by them: AdamW decays the matrices only); maybe empty
            a, b = (min(max(x - lo, 0), size) for x in (o, o + p.numel()))
            shape = (b - a,) + (1,) * (p.dim() - 1)
            piece = nn.Parameter(u.shard[a:b].view(shape))  # a view: the optimizer steps shard
            piece.grad = u.grad[a:b].view(shape)             # filled by the reduce-scatter
            u.spans.append((a, b))
            u.pieces.append(piece)
        self._free(u)
        return u

    def _register(self, model: nn.Module) -> None:
        """Each module's ``parameters()`` (the loop's optimizer's, the state dict's) yield this
        rank's pieces under the parameters' names; its forward reads the whole one: Python finds
        ``self.weight`` in the module's ``__dict__`` before nn.Module looks in its registry."""
        piece_of = {p: pc for u in self.units for p, pc in zip(u.params, u.pieces)}
        for module in model.modules():
            for name, p in list(module.named_parameters(recurse=False)):
                if p in piece_of:
                    module.register_parameter(name, piece_of[p])
                    module.__dict__[name] = p

    # ------------------------------------------------------------------ one step
    def _gather(self, u: Unit, *hook_args) -> None:
        """The unit's parameters, whole: before its forward (a forward pre-hook), and before
        its backward (a hook on the gradient of its output, which backward computes first)."""
        if u.gathered:
            return
        u.full.untyped_storage().resize_(u.full.numel() * u.full.element_size())
        with self.timer("gather"):
            self.all_gather(u.full, u.shard, phase="gather")
        u.gathered = True
        self.held += u.full.nbytes
        self.peak = max(self.peak, self.held)

    def _free(self, u: Unit) -> None:
        # the views stay views: the next gather gives their storage back, what autograd saved
        # for backward included (nothing reads a parameter while it is freed)
        self.held -= u.full.nbytes if u.gathered else 0
        u.full.untyped_storage().resize_(0)
        u.gathered = False

    def _after_forward(self, u: Unit, module, args, output) -> None:
        self._free(u)
        for t in output if isinstance(output, (tuple, list)) else [output]:
            if isinstance(t, torch.Tensor) and t.requires_grad:  # not in validation
                t.register_hook(partial(self._gather, u))

    def _grad_ready(self, p: nn.Parameter) -> None:
        if not self.sync:  # --grad-accum: the whole gradients add up until the last micro-batch
            return
        for i in self.order.ready(self.unit_of[p]):
            self._reduce(self.units[i])

    def _reduce(self, u: Unit) -> None:
        """Start the reduce-scatter of the unit's gradients (divided first, as DDP does) into
        its shard's gradient; drop the whole gradients and parameters."""
        flat = u.full.new_zeros(u.full.numel())
        for p, o in zip(u.params, u.offsets):
            if p.grad is not None:  # else none this step: zeros, as DDP's
                flat[o:o + p.numel()].copy_(p.grad.reshape(-1))
                p.grad = None
        self._free(u)
        flat.div_(self.n)  # held (in handles) until the reduce-scatter is done with it
        self.handles.append((self.reduce_scatter(u.grad, flat, async_op=True, phase="reduce"),
                             flat))

    def zero_grad(self, optimizer) -> None:
        """Nothing: each reduce-scatter writes its shard's gradient whole (and the pieces'
        gradients must stay views into it), the whole gradients are dropped in _reduce."""

    def after_backward(self) -> None:
        with self.timer("reduce"):
            for i in self.order.rest():  # units holding a parameter that got no gradient
                self._reduce(self.units[i])
            for h, _ in self.handles:
                h.wait()
        self.handles = []
        self.order.reset()

    # ------------------------------------------------------------------ what a rank holds
    def epoch_metrics(self) -> dict:
        """Parameter bytes this rank holds between steps (live storage), and the most gathered."""
        held = sum(u.shard.nbytes + u.full.untyped_storage().nbytes() for u in self.units)
        out, self.peak = {"parameter_bytes_held": held, "gathered_bytes_peak": self.peak}, self.held
        return out

    def replicas(self, model: nn.Module):
        """The buffers (finish_epoch gave every rank the first trainer's): the shards differ."""
        return list(model.named_buffers()), None

    # ------------------------------------------------------------------ the whole model
    def _whole(self, u: Unit, shard: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``shard`` (a slice of u's flat values) put together: per parameter."""
        flat = shard.new_empty(u.full.numel())
        self.all_gather(flat, shard, phase="gather")
        return [flat[o:o + p.numel()].view_as(p).clone() for p, o in zip(u.params, u.offsets)]

    def _mine(self, u: Unit, whole: list[torch.Tensor]) -> torch.Tensor:
        """This rank's slice of u's flat values, from the whole tensors per parameter."""
        flat = u.full.new_zeros(u.full.numel())
        for t, o in zip(whole, u.offsets):
            flat[o:o + t.numel()].copy_(t.reshape(-1))
        return flat[self.rank * u.shard.numel():][:u.shard.numel()]

    @staticmethod
    def _moments(state: dict, like: torch.Tensor) -> list[str]:
        """The keys of ``state`` shaped ``like`` its parameter (AdamW's moments, SGD's momentum)."""
        return [k for k, v in state.items() if torch.is_tensor(v) and v.shape == like.shape]

    def full_state(self, model: nn.Module, optimizer) -> tuple[Optional[dict], Optional[dict]]:
        """The whole model's state dict and its optimizer's, in the optimizer's own format
        (each moment in its parameter's shape, as a plain model's optimizer holds it), on rank
        0; every rank takes part in the gathers."""
        state = model.state_dict()  # the buffers (the parameters' names hold pieces: replaced)
        for u in self.units:
            for p, t in zip(u.params, self._whole(u, u.shard)):
                for k in self.keys[p]:
                    state[k] = t
        if optimizer is None:
            return (state if self.rank == 0 else None), None
        opt, index = optimizer.state_dict(), self._index(optimizer)
        opt["state"] = {i: dict(s) for i, s in opt["state"].items()}  # not the live state
        for u in self.units:
            first = u.pieces[0]
            for k in self._moments(opt["state"].get(index[first], {}), first):
                shard = torch.zeros_like(u.shard)
                for pc, (a, b) in zip(u.pieces, u.spans):
                    shard[a:b] = opt["state"][index[pc]][k].reshape(-1)
                for pc, t in zip(u.pieces, self._whole(u, shard)):
                    opt["state"][index[pc]][k] = t
        return (state, opt) if self.rank == 0 else (None, None)

    def load_full_state(self, model: nn.Module, optimizer, model_state: dict,
                        optimizer_state: Optional[dict]) -> None:
        """Keep this rank's shard of a whole model and of its optimizer's state."""
        for u in self.units:
            u.shard.copy_(self._mine(u, [model_state[self.keys[p][0]] for p in u.params]))
        buffers = dict(model.named_buffers())
        model.load_state_dict({k: v for k, v in model_state.items() if k in buffers}, strict=False)
        if optimizer is None or optimizer_state is None:
            return
        state = optimizer_state["state"]
        mine = {**optimizer_state, "state": {i: dict(s) for i, s in state.items()}}
        index = self._index(optimizer)
        for u in self.units:
            for k in self._moments(mine["state"].get(index[u.pieces[0]], {}), u.params[0]):
                shard = self._mine(u, [mine["state"][index[pc]][k] for pc in u.pieces])
                for pc, (a, b) in zip(u.pieces, u.spans):
                    mine["state"][index[pc]][k] = shard[a:b].view_as(pc).clone()
        optimizer.load_state_dict(mine)

    @staticmethod
    def _index(optimizer) -> dict:
        """Each piece's number in the optimizer's state dict (its groups' parameters, in turn)."""
        return {p: i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}

    def whole_model(self, model: nn.Module, state: Optional[dict],
                    build: Callable[[], nn.Module]) -> nn.Module:
        """A plain model of the workload's (``build()``), on rank 0's device, holding ``state``."""
        net = build()
        net.load_state_dict(state)
        return net.to(self.ctx.device)
