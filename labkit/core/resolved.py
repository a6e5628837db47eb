"""A method's resolved config in its folder (``resolved.json``): every automatic value decided
and every check passed, once, for this machine, by whoever launches (labkit experiment, the
launcher); run_method.ipynb and every rank read it instead of deciding again.

    {"train": {TrainConfig's fields, none automatic}, "nproc": 4,
     "nodes": {"nnodes": 1, "node_rank": 0, ...}, "method_spec": {the method's MethodSpec}}

The method's spec (its key, result file, whether it serves) travels with it, as in a result
file, so that a reader knows a method of one's own without importing its code first: the
notebook kernel never does, and a rank loads the class when it builds the trainer.

A bare ``torchrun -m labkit.train --flags`` has no such file: its ranks resolve and check the
flags themselves (labkit.training.preflight).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

from . import methods
from .config import TrainConfig
from .errors import ConfigError
from .files import atomic_write_json
from .run_folder import read_json


def write(path: str, cfg: TrainConfig, nproc: int, nodes: dict[str, Any]) -> None:
    """Write the resolved ``cfg`` with the processes it was checked for (``nodes``: the
    launcher's Nodes as a dict)."""
    atomic_write_json(path, {"train": cfg.to_dict(), "nproc": nproc, "nodes": nodes,
                             "method_spec": methods.spec(cfg.method).to_dict()})


def read(path: str) -> tuple[TrainConfig, int, dict[str, Any]]:
    """(config, processes per node, nodes) from a resolved.json; ConfigError, one line, when it
    cannot be read or is not one."""
    try:
        doc = read_json(path)
        train, nproc, nodes = dict(doc["train"]), int(doc["nproc"]), dict(doc.get("nodes") or {})
        spec = methods.MethodSpec.from_dict(doc["method_spec"])
    except OSError as e:
        raise ConfigError(f"cannot read the resolved config {path!r}: "
                          f"{e.strerror or e}") from None
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"{path!r} is not a resolved config ({type(e).__name__}: {e})") from None
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    if set(train) | {"options"} != names:  # written by another labkit: its fields are not these
        odd = sorted((set(train) | {"options"}) ^ names)  # (options: only a plug-in's are kept)
        raise ConfigError(f"{path!r} is not a resolved config of this labkit (field(s) "
                          f"{', '.join(odd)} differ)")
    methods.register(spec, train["method"])  # by its key and by the reference the config names
    return TrainConfig(**train), nproc, nodes


def check_world(path: str, nproc: int, nodes: dict[str, Any], world: int) -> None:
    """A resolved config holds for the processes it was checked for only (the default learning
    rate, a parameter server's ranks depend on them): refuse another world size."""
    planned = nproc * int(nodes.get("emulate_nodes") or nodes.get("nnodes") or 1)
    if world != planned:
        raise ConfigError(f"{os.path.basename(path)} was resolved for {planned} processes, not "
                          f"the {world} torchrun started: launch it as it was resolved, or run "
                          f"without --resolved (the flags are then checked here)")
