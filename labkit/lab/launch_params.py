"""The launcher's parameters beside the training config, the machine's defaults, and the
papermill parameters cell of run_method.ipynb read into typed objects.

Both parameter dataclasses go through labkit.core.params, so a notebook parameter, a YAML
parameters file, a flag and a sweep value of one name are checked by one rule.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from labkit.core import layout, params
from labkit.core.config import TrainConfig, default_batch_size
from labkit.core.methods import absolute, key_of


def _f(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass
class LaunchParams:
    """How torchrun is started for one method, and where its folder goes without ``out`` (the
    rest is the TrainConfig)."""
    nproc: Optional[int] = _f(None, "processes per node (default: one per GPU, 2 sharing a "
                                    "single GPU, else 4)")
    nnodes: int = _f(1, "nodes (multi-node: also node_rank and rdzv_endpoint)")
    node_rank: int = _f(0, "this node's number, 0..nnodes-1")
    rdzv_endpoint: Optional[str] = _f(None, "host:port of the torchrun c10d rendezvous")
    max_restarts: int = _f(0, "torchrun restarts after a failure (each resumes from the last "
                              "checkpoint)")
    runs_dir: Optional[str] = _f(None, "without out: the new run folder goes under this folder "
                                       "(default: the project's runs/, from any working directory)")


LAUNCH_PARAMS = tuple(f.name for f in dataclasses.fields(LaunchParams))


# ------------------------------------------------------------------ defaults for this machine
# one GPU: the fewest ranks every method runs with (the parameter server serves on rank 0 and
# trains on the others), sharing the GPU over gloo, which moves CUDA tensors (nccl needs one GPU
# per process)
SHARED_GPU_RANKS = 2


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def machine_defaults(nproc: Optional[int] = None) -> dict:
    """The defaults for this machine and the process count asked for (None: auto).

    No GPU: 4 processes over gloo, batch 32 (minutes on a 2-core laptop). Two or more GPUs: one
    process per GPU over nccl, batch 64. One GPU: SHARED_GPU_RANKS processes share it over gloo
    (``--backend gloo --device cuda``), so every method runs; an explicit ``--nproc 1`` keeps
    nccl. The dataset, model and backend otherwise are labkit.core.config.resolve's."""
    gpus = gpu_count()
    batch = {"batch_size": default_batch_size(gpus > 0), "epochs": 3}  # recorded as given
    if gpus == 0:
        return {"nproc": 4, **batch}
    if gpus == 1 and nproc != 1:
        return {"nproc": SHARED_GPU_RANKS, **batch, "backend": "gloo", "device": "cuda"}
    return {"nproc": gpus, **batch}


def with_machine_defaults(train: dict, nproc: Optional[int]) -> dict:
    """Training values as given, the machine's defaults for those not given."""
    return {**{k: v for k, v in machine_defaults(nproc).items() if k != "nproc"}, **train}


def nproc_or_default(nproc: Optional[int]) -> int:
    """The process count asked for, or the machine's default for ``None`` (auto); 0 stays 0,
    which the launcher refuses as bad input. The one place that knows the default."""
    return machine_defaults()["nproc"] if nproc is None else nproc


def plan_lines(resolved: dict[str, TrainConfig], nproc: int, asked: Optional[int],
               nnodes: int = 1) -> list[str]:
    """What an experiment will run on this machine and why: its first printed lines, recorded
    in config.json. ``resolved``: each method's checked config; ``asked``: --nproc (None: auto)."""
    c = next(iter(resolved.values()))
    gpus = gpu_count()
    shared = c.device == "cuda" and nproc > gpus
    how = f"{nproc} processes" + (f" on each of {nnodes} nodes" if nnodes > 1 else "")
    first = (f"plan: {', '.join(resolved)}; {how}, backend {c.backend}, device {c.device}, "
             f"{c.dataset} data, {c.model}, batch {c.batch_size} per trainer, {c.epochs} epochs")
    if asked is not None:
        why = f"--nproc {asked} as asked, on a machine with {gpus or 'no'} GPU(s)"
    elif gpus == 0:
        why = "no GPU: 4 processes on the CPU over gloo"
    elif shared:
        why = (f"one GPU: {nproc} ranks share it over gloo (nccl needs a GPU per process), the "
               f"fewest every method runs with (the parameter server needs {SHARED_GPU_RANKS})")
    else:
        why = f"{gpus} GPUs: one process per GPU over nccl"
    lines = [first, f"why: {why}"]
    if shared:
        lines.append("note: the ranks share one device, so communication timings measure gloo "
                     "copies through host memory, not links between GPUs")
    return lines


def method_out(cfg: TrainConfig, runs_dir: Optional[str] = None) -> str:
    """A method's output folder: ``cfg.out`` as given, else a new folder under ``runs_dir`` or
    the project's runs/ (labkit.core.layout.runs_root), never one relative to whichever folder
    the notebook or the command happens to run in. run_method.ipynb and `labkit run` share it."""
    return cfg.out or layout.default_out(key_of(cfg.method), layout.runs_root(runs_dir))


def with_absolute_paths(cfg: TrainConfig) -> TrainConfig:
    """Paths as the user meant them: relative to where the command was run, not the run folder."""
    return dataclasses.replace(
        cfg, method=absolute(cfg.method),
        data_dir=os.path.abspath(cfg.data_dir) if cfg.data_dir else None,
        weights=os.path.abspath(cfg.weights) if cfg.weights else None)


# ------------------------------------------------------------------ notebook and file parameters
def check_params(values: dict) -> None:
    """Reject unknown names and wrong types (one message naming the parameter)."""
    params.check_values(values, TrainConfig, LaunchParams)


def split_params(values: dict) -> tuple[dict, LaunchParams]:
    """Checked parameters -> (TrainConfig fields, LaunchParams)."""
    check_params(values)
    launch = {k: v for k, v in values.items() if k in LAUNCH_PARAMS}
    train = {k: v for k, v in values.items() if k not in LAUNCH_PARAMS}
    return train, LaunchParams(**launch)


def notebook_params(namespace: dict):
    """The parameters cell's variables -> (TrainConfig, processes per node, Nodes).

    Called first thing after the parameters cell, so any other plain value in the namespace
    was injected by papermill (``-p name value``) under a name the notebook does not know.
    """
    from .launch import Nodes

    names = [f.name for f in dataclasses.fields(TrainConfig)] + list(LAUNCH_PARAMS)
    injected = {k: v for k, v in namespace.items()
                if not k.startswith("_") and k not in names and k not in ("In", "Out")
                and isinstance(v, (bool, int, float, str, list, dict, type(None)))}
    given = {k: namespace[k] for k in names if k in namespace}
    check_params({**given, **injected})
    train, lp = split_params(given)
    # the parameters cell leaves backend and device None (auto): on one GPU, the ranks share it
    auto = {k: v for k, v in with_machine_defaults({}, lp.nproc).items()
            if k in ("backend", "device") and train.get(k) is None}
    return TrainConfig(**{**train, **auto}), nproc_or_default(lp.nproc), Nodes.of(lp)
