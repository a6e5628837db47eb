"""Workloads as plug-ins: what a run trains (model, data, loss) and the figures it is judged by
(labkit.workloads.contract: the contract; docs/workloads.md). Built in: ``images`` and ``lm``."""
from .contract import Figure, Workload
from .datasets import Datasets
from .catalog import BUILTIN, load_workload, make_workload, resolve

__all__ = ["BUILTIN", "Datasets", "Figure", "Workload", "load_workload", "make_workload", "resolve"]
