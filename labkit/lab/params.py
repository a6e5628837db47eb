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
from labkit.core.config import TrainConfig


def _f(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass
class LaunchParams:
    """How torchrun is started for one method, and where its folder goes without ``out`` (the
    rest is the TrainConfig)."""
    nproc: Optional[int] = _f(None, "processes per node (default: one per GPU, else 4)")
    nnodes: int = _f(1, "nodes (multi-node: also node_rank and rdzv_endpoint)")
    node_rank: int = _f(0, "this node's number, 0..nnodes-1")
    rdzv_endpoint: Optional[str] = _f(None, "host:port of the torchrun c10d rendezvous")
    max_restarts: int = _f(0, "torchrun restarts after a failure (each resumes from the last "
                              "checkpoint)")
    runs_dir: Optional[str] = _f(None, "without out: the new run folder goes under this folder "
                                       "(default: the project's runs/, from any working directory)")


LAUNCH_PARAMS = tuple(f.name for f in dataclasses.fields(LaunchParams))


# ------------------------------------------------------------------ defaults for this machine
def machine_defaults() -> dict:
    """Without GPUs: 4 processes, batch 32 (minutes on a 2-core laptop). With GPUs: one process
    per GPU, batch 64. The dataset, model and backend part is labkit.core.config.resolve's."""
    import torch

    if torch.cuda.is_available():
        return {"nproc": torch.cuda.device_count(), "batch_size": 64, "epochs": 3}
    return {"nproc": 4, "batch_size": 32, "epochs": 3}


def nproc_or_default(nproc: Optional[int]) -> int:
    """The process count asked for, or the machine's default for ``None`` (auto); 0 stays 0,
    which the launcher refuses as bad input. The one place that knows the default."""
    return machine_defaults()["nproc"] if nproc is None else nproc


def method_out(cfg: TrainConfig, runs_dir: Optional[str] = None) -> str:
    """A method's output folder: ``cfg.out`` as given, else a new folder under ``runs_dir`` or
    the project's runs/ (labkit.core.layout.runs_root), never one relative to whichever folder
    the notebook or the command happens to run in. run_method.ipynb and `labkit run` share it."""
    return cfg.out or layout.default_out(cfg.method, layout.runs_root(runs_dir))


def with_absolute_paths(cfg: TrainConfig) -> TrainConfig:
    """Paths as the user meant them: relative to where the command was run, not the run folder."""
    return dataclasses.replace(
        cfg, data_dir=os.path.abspath(cfg.data_dir) if cfg.data_dir else None,
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
    return TrainConfig(**train), nproc_or_default(lp.nproc), Nodes.of(lp)
