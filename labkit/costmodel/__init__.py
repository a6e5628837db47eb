"""An analytic cost model of one data-parallel training step (issue 7).

It predicts the step time of the lab's methods from four numbers: the compute time of one step
without any synchronisation (forward + backward + optimizer), the gradient size ``n`` in bytes,
the number of data-parallel workers ``p``, and a link described by the alpha-beta model:
sending ``m`` bytes in one message costs ``alpha + m * beta`` (``alpha``: latency in seconds,
``beta``: seconds per byte, i.e. 1 / bandwidth).

Methods (the names ``predict_step`` takes):

- ``ddp``        PyTorch DDP: gradients in 25 MiB buckets, each bucket ring-all-reduced while
                 backward still runs;
- ``allreduce``  the lab's hand-written bucketed all-reduce: the same model with its own bucket
                 size, overlapped with backward unless ``overlap=False``;
- ``ps``         a central parameter server: each step every worker pulls the parameters from
                 the server and pushes its gradients to it; the server's link carries it all;
- ``ps_sharded`` ``k`` servers, each owning 1/k of the parameters;
- ``fsdp``       FSDP (PyTorch's fully_shard): each unit's parameters all-gathered before its
                 forward and again before its backward (ZeRO-3; ``gathers=1``: ZeRO-2) and its
                 gradients reduce-scattered after, prefetched one unit ahead of the compute;
                 ``hsdp=True``: sharded inside a node, the gradients all-reduced across nodes.

The formulas, with the assumptions behind them, are in the docstrings below and, for the
report, in ``formulas_markdown()``.  ``calibrate`` fits alpha and beta to the all-reduce sweep
of a ``labkit bench`` file, ``compare_with_bench`` compares the model with the step times measured in the
same file, and ``project`` predicts larger machines on named interconnects (``INTERCONNECTS``).

Modules: ``alphabeta`` (links, collectives, the step model, its formulas), ``calibrate`` (fit
to a bench and compare with it), ``project`` (larger machines, tables, the figure), ``cli``.

Command line::

    labkit model BENCH_JSON   (or python -m labkit.costmodel) [--compute-ms X] [--grad-mb Y] [--batch B] [--out DIR]
"""
from __future__ import annotations

from labkit.bench.bench_view import BenchError, check
from labkit.bench.bench_view import load as load_bench

from .alphabeta import (BACKWARD_FRACTION, DDP_BUCKET_BYTES, DEFAULT_GPUS, DEFAULT_NETWORKS,
                        ERROR_TARGET_PCT, GB, GPUS_PER_NODE, INTERCONNECTS, MODELLED_METHODS,
                        SHARD_UNITS, Link, MiB, allgather_time, allreduce_time, bucket_sizes,
                        exposed_comm, formulas_markdown, get_link, hierarchical_allgather_time,
                        hierarchical_allreduce_time, hierarchical_reduce_scatter_time,
                        predict_step, reduce_scatter_time, ring_allgather_time,
                        ring_allreduce_time, ring_reduce_scatter_time, server_broadcast_time,
                        server_reduce_time, sharded_bytes, sharded_exposed, sharded_unit_times)
from .calibrate import calibrate, compare_with_bench, fit_alpha_beta, predict_row
from .cli import main
from .project import plot_projection, project, projection_table, validation_table
