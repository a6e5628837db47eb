"""The launcher's parameters beside the training config, the machine's defaults, and the
papermill parameters cell of run_method.ipynb read into typed objects.

Both parameter dataclasses go through labkit.core.params, so a notebook parameter, a YAML
parameters file, a flag and a sweep value of one name are checked by one rule.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

from labkit.core import layout, params, resolved
from labkit.core.config import ConfigError, TrainConfig, default_batch_size
from labkit.core.methods import absolute, key_of
from labkit.workloads.catalog import absolute as workload_path


def _f(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class Nodes:
    """torchrun's multi-node options (single node on loopback by default): the launcher's
    parameters that every node of a job gives alike, node_rank aside. LaunchParams holds these
    fields and two of its own; labkit.launch.launch builds the torchrun command from them."""
    nnodes: int = _f(1, "nodes (multi-node: also node_rank and rdzv_endpoint)")
    node_rank: int = _f(0, "this node's number, 0..nnodes-1")
    rdzv_endpoint: Optional[str] = _f(None, "host:port of the torchrun c10d rendezvous")
    max_restarts: int = _f(0, "torchrun restarts after a failure (each resumes from the last "
                              "checkpoint)")
    emulate_nodes: int = _f(0, "nodes of a cluster emulated on this machine, each with nproc "
                               "ranks (network namespaces joined by shaped links; "
                               "docs/emulated-cluster.md); 0: none")
    link: str = _f("unshaped", "with emulate_nodes: each node's link, each way (100mbit, 1gbit, "
                               "2.5gbit, ...; unshaped), and a one-way delay as 100mbit:5ms "
                               "(kernels with sch_netem)")
    #: torchrun's --rdzv-id for every labkit job (a constant, not a parameter)
    rdzv_id: ClassVar[str] = "labkit"

    def __post_init__(self):
        if not self.emulate_nodes and self.link not in (None, "", "unshaped"):
            raise ConfigError(f"--link {self.link} shapes the links of an emulated cluster: give "
                              f"--emulate-nodes N too")

    @property
    def multi(self) -> bool:
        return self.nnodes > 1 or self.rdzv_endpoint is not None

    @property
    def node_count(self) -> int:
        """How many nodes the ranks run on: real ones, or emulated ones on this machine."""
        return self.emulate_nodes or self.nnodes

    @property
    def emulated(self) -> bool:
        return bool(self.emulate_nodes)

    def node(self, k: int, endpoint: str) -> "Nodes":
        """Node ``k`` of the emulated cluster as a node of the multi-node path."""
        return Nodes(self.emulate_nodes, k, endpoint, self.max_restarts)

    @classmethod
    def of_record(cls, doc: Optional[dict]) -> "Nodes":
        """From a recorded dict (config.json's experiment, resolved.json, a Slurm job's spec);
        a key that is no field (runs recorded before 2026-11-26 hold rdzv_id) is left out."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in (doc or {}).items() if k in names})


@dataclass(frozen=True)
class LaunchParams(Nodes):
    """How torchrun is started for one method, and where its folder goes without ``out`` (the
    rest is the TrainConfig): Nodes' fields, the process count and the runs folder."""
    nproc: Optional[int] = _f(None, "processes per node (default: one per GPU, 2 sharing a "
                                    "single GPU, else 4)")
    runs_dir: Optional[str] = _f(None, "without out: the new run folder goes under this folder "
                                       "(default: the project's runs/, from any working directory)")

    def nodes(self) -> Nodes:
        """The multi-node part (None, as a YAML file may give it, read as the default)."""
        return Nodes(self.nnodes or 1, self.node_rank or 0, self.rdzv_endpoint,
                     self.max_restarts or 0, self.emulate_nodes or 0, self.link or "unshaped")


LAUNCH_PARAMS = tuple(f.name for f in dataclasses.fields(LaunchParams))
#: run_method.ipynb's own parameter, besides TrainConfig's and the launcher's: {name: help}
NOTEBOOK_ONLY = {"resolved": "a resolved.json to run exactly as it was decided and checked "
                             "(labkit experiment passes it; by hand: None)"}


# ------------------------------------------------------------------ defaults for this machine
# one GPU: the fewest ranks every method runs with (the parameter server serves on rank 0 and
# trains on the others), sharing the GPU over gloo, which moves CUDA tensors (nccl needs one GPU
# per process)
SHARED_GPU_RANKS = 2


#: device files through which a GPU's driver is reached: NVIDIA's, ROCm's, WSL's
GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")


def gpu_count() -> int:
    """The GPUs torch sees. Without any GPU driver's device file there are none, and torch,
    not imported yet, is not imported to say so: in `labkit experiment` that import (4 CPU
    seconds on a slow VM) came before the warm process could start."""
    if "torch" not in sys.modules and not any(os.path.exists(f) for f in GPU_DEVICE_FILES):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def machine_defaults(nproc: Optional[int] = None) -> dict:
    """The defaults for this machine and the process count asked for (None: auto).

    No GPU: 4 processes over gloo, batch 32 (minutes on a 2-core laptop). Two or more GPUs: one
    process per GPU over nccl, batch 64. One GPU: SHARED_GPU_RANKS processes share it over gloo
    (``--backend gloo --device cuda``), so every method runs; an explicit ``--nproc 1`` keeps
    nccl. The dataset, model and backend otherwise are labkit.core.config.resolve's."""
    gpus = gpu_count()
    # recorded as given (config.json's "train"); the epochs, like every other default, are
    # TrainConfig's, which run_method.ipynb's parameters cell is made from
    batch = {"batch_size": default_batch_size(gpus > 0)}
    if gpus == 0:
        return {"nproc": 4, **batch}
    if gpus == 1 and nproc != 1:
        return {"nproc": SHARED_GPU_RANKS, **batch, "backend": "gloo", "device": "cuda"}
    return {"nproc": gpus, **batch}


def with_machine_defaults(train: dict, nproc: Optional[int]) -> dict:
    """Training values as given, the machine's defaults for those not given or None (auto):
    `labkit experiment`, `labkit run` and run_method.ipynb by hand alike."""
    given = {k: v for k, v in train.items() if v is not None}
    return {**{k: v for k, v in machine_defaults(nproc).items() if k != "nproc"}, **given}


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
    # what is trained: the data and model where the workload names them, else its class
    what = (", ".join(w for w in (c.dataset and f"{c.dataset} data", c.model) if w)
            or c.workload.rpartition(":")[2])
    first = (f"plan: {', '.join(resolved)}; {how}, backend {c.backend}, device {c.device}, "
             f"{what}, batch {c.batch_size} per trainer, {c.epochs} epochs")
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
        cfg, method=absolute(cfg.method), workload=workload_path(cfg.workload),
        data_dir=os.path.abspath(cfg.data_dir) if cfg.data_dir else None,
        weights=os.path.abspath(cfg.weights) if cfg.weights else None)


# ------------------------------------------------------------------ notebook and file parameters
def check_params(values: dict) -> None:
    """Reject unknown names and wrong types (one message naming the parameter)."""
    params.check_values(values, TrainConfig, LaunchParams)


def split_params(values: dict) -> tuple[dict, LaunchParams]:
    """Checked parameters -> (TrainConfig fields, LaunchParams)."""
    check_params(values)
    return _split(values)


def _split(values: dict) -> tuple[dict, LaunchParams]:
    launch = {k: v for k, v in values.items() if k in LAUNCH_PARAMS}
    train = {k: v for k, v in values.items() if k not in LAUNCH_PARAMS}
    return train, LaunchParams(**launch)


def notebook_params(namespace: dict):
    """The parameters cell's variables -> (TrainConfig, processes per node, Nodes).

    Called first thing after the parameters cell, so any other plain value in the namespace
    was injected by papermill (``-p name value``) under a name the notebook does not know.
    With ``resolved`` (labkit experiment's resolved.json) the config is read from that file,
    decided and checked already; by hand, the parameters are checked and the machine's defaults
    filled in as `labkit experiment` fills them in (the launcher resolves the rest).
    """
    names = [f.name for f in dataclasses.fields(TrainConfig)] + list(LAUNCH_PARAMS)
    injected = {k: v for k, v in namespace.items()
                if not k.startswith("_") and k not in names + list(NOTEBOOK_ONLY)
                and k not in ("In", "Out")
                and isinstance(v, (bool, int, float, str, list, dict, type(None)))}
    given = {k: namespace[k] for k in names if k in namespace}
    if namespace.get("resolved") is not None:
        cfg, nproc, nodes = _from_resolved(namespace["resolved"], given, injected)
        return cfg, nproc, Nodes.of_record(nodes)
    check_params({**given, **injected})
    train, lp = _split(given)
    return (TrainConfig(**with_machine_defaults(train, lp.nproc)), nproc_or_default(lp.nproc),
            lp.nodes())


def _from_resolved(path: str, given: dict, injected: dict):
    """(config, nproc, nodes) from a resolved.json. The file holds the whole config: another
    parameter is left as it is or names the file's own value (labkit experiment passes them
    too, so the executed notebook shows what ran); any other value is refused, not ignored."""
    cfg, nproc, nodes = resolved.read(path)
    held = {**cfg.to_dict(), **nodes, "nproc": nproc}
    defaults = {f.name: params.default(f) for c in (TrainConfig, LaunchParams) for f in dataclasses.fields(c)}
    other = {**{k: v for k, v in given.items() if v not in (defaults[k], held.get(k, defaults[k]))},
             **injected}
    if other:
        raise ConfigError(f"resolved={path!r} holds the whole config, decided already; leave the "
                          f"other parameters as they are (got "
                          f"{', '.join(f'{k}={v!r}' for k, v in other.items())})")
    return cfg, nproc, nodes


def parameters_cell(width: int = 100) -> str:
    """run_method.ipynb's parameters cell, made from the one source of every default and its
    help: TrainConfig's fields, the launcher's (LaunchParams), then NOTEBOOK_ONLY. The notebook
    holds exactly this (tests/test_notebooks.py); tools/parameters_cell.py writes it there."""
    lines = ["# Parameters: one per field of labkit.core.config.TrainConfig (the training flags), "
             "plus the", "# launcher's. papermill replaces them; by hand, edit and run all. "
             "None = automatic.", "# Made by tools/parameters_cell.py from those classes: "
             "edit their defaults, not this cell."]
    fields = [f for c in (TrainConfig, LaunchParams) for f in dataclasses.fields(c)]
    own = [(f.name, params.default(f), f.metadata.get("help", "")) for f in fields]
    for name, default, help_ in own + [(k, None, h) for k, h in NOTEBOOK_ONLY.items()]:
        line = f"{name} = {default!r}  # {help_}"
        lines.append(line if len(line) <= width else line[: width - 3] + "...")
    return "\n".join(lines)
