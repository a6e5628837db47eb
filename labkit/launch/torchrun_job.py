"""One torchrun job's parts, shared by the launcher of one machine (labkit.launch.launch) and that
of an emulated cluster (labkit.launch.emulated): the checks before any rank starts, the torchrun
command, the environment and log folder its ranks get, the lines streamed, and how a job that
ended badly is recorded. Neither launcher imports the other's internals: launch chooses,
emulated builds on these.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from typing import IO, Optional

from labkit.core import layout, params
from labkit.core import resolved as resolved_file
from labkit.core.config import ConfigError, TrainConfig
from labkit.core.files import atomic_write_json, now_str
from labkit.core.methods import absolute, server_ranks
from labkit.core.results import ResultError, read_result
from labkit.core.status import Status
from labkit.training import budget
from labkit.workloads.catalog import absolute as workload_path
from labkit.workloads.catalog import own_code

from .failures import is_consequence
from .launch_params import Nodes
from .torchrun_output import PREFIX_TEMPLATE
from .torchrun_output import knows as torchrun_knows

log = logging.getLogger("labkit.launch.launch")  # the launcher's warnings, as before the split


class LaunchError(RuntimeError):
    """A launch that failed: the message names the method, the rank, its exit code and the
    last lines of that rank's log."""

    # in a notebook cell, the message (with the rank's log lines) rather than the launcher's frames
    _render_traceback_ = ConfigError._render_traceback_


@dataclass
class LaunchResult:
    method: str
    returncode: int
    out_dir: str
    log_dir: str
    command: list[str]
    wall_time: float
    message: str = ""
    failed_rank: Optional[int] = None
    log_tail: list[str] = field(default_factory=list)
    explained_from: Optional[str] = None  # torchrun's error file the message rests on
    started_at: float = 0.0  # seconds since the epoch when the launcher started torchrun

    def times(self) -> dict:
        """When torchrun started and ended (seconds since the epoch: the ranks' clock), for the
        launch file (labkit.report.accounting)."""
        return {"started_at": self.started_at, "ended_at": self.started_at + self.wall_time}

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def check(self) -> "LaunchResult":
        if not self.ok:
            raise LaunchError(self.message)
        return self


def validate(cfg: TrainConfig, nproc: int, nodes: Nodes = Nodes()) -> TrainConfig:
    """Resolve and check the inputs in this process, in seconds, before any rank is spawned:
    the config every rank will run (labkit.core.resolved)."""
    from labkit.training.data import steps_per_epoch
    from labkit.training.preflight import preflight
    from labkit.workloads import make_workload

    if nproc < 1:
        raise ConfigError(f"--nproc must be at least 1 (got {nproc}); --nproc auto: one per GPU, "
                          f"2 sharing a single GPU, else 4")
    world = nproc * nodes.node_count
    with own_code(cfg.workload):  # a user's workload that raises: one line, its file and line
        cfg = preflight(cfg, world=world, local_world=nproc)
        # the workload's own checks (an image folder's layout, a user's model on a first batch)
        data = make_workload(cfg).check()
    if data is not None:  # datasets built: the steps an epoch has (ranks count an image folder)
        steps_per_epoch(len(data.train), cfg.trainers(world), cfg.batch_size, cfg.max_steps_per_epoch)
    check_out(cfg)
    return cfg


def check_out(cfg: TrainConfig) -> None:
    """The output folder's part of the checks: a checkpoint there to --resume from, else no
    result file to overwrite (labkit experiment checks it once a method's folder exists)."""
    from labkit.training.checkpoint import find, refuse_overwrite

    if cfg.resume:
        if find(cfg) is None:  # --resume without --out raised inside already
            raise ConfigError(f"nothing to resume in {cfg.out!r}")
    elif cfg.out:
        refuse_overwrite(cfg.out, cfg)


def torchrun_command(cfg: TrainConfig, nproc: int, log_dir: str, nodes: Nodes = Nodes(),
                     show_ranks: tuple[int, ...] = (0,), module: str = "labkit.train",
                     extra: tuple[str, ...] = (), resolved: Optional[str] = None) -> list[str]:
    """The torchrun command line (labkit's agent, labkit.launch.agent, whose ranks start warm)
    for ``module`` (labkit.train, or the bench's ranks: labkit.bench.bench_rank): ``--resolved FILE`` when the config was written there (the
    ranks read it instead of resolving the flags again), else ``cfg`` as flags."""
    # torchrun's agent with ranks forked warm (labkit.launch.agent): the same flags
    cmd = [sys.executable, "-m", "labkit.launch.agent", f"--nproc-per-node={nproc}"]
    if nodes.multi:
        cmd += [f"--nnodes={nodes.nnodes}", f"--node-rank={nodes.node_rank}",
                "--rdzv-backend=c10d", f"--rdzv-endpoint={nodes.rdzv_endpoint}",
                f"--rdzv-id={nodes.rdzv_id}"]
    else:
        # single node: torchrun's standalone c10d store on a free port, and the ranks' process
        # group on loopback (--local-addr). An explicit "--rdzv-endpoint 127.0.0.1:0" instead
        # breaks --max-restarts (the restarted ranks' gloo mesh never connects), and either
        # way PyTorch's TCPStore listens on every interface: it has no bind address.
        cmd += ["--standalone", "--local-addr=127.0.0.1"]
    if nodes.max_restarts:
        cmd.append(f"--max-restarts={nodes.max_restarts}")
    cmd += [f"--log-dir={log_dir}", "--tee=3"]
    if torchrun_knows("--log-line-prefix-template"):
        cmd.append(f"--log-line-prefix-template={PREFIX_TEMPLATE}")
    cmd += [f"--local-ranks-filter={','.join(map(str, show_ranks))}",
            "-m", module, *(["--resolved", resolved] if resolved else params.to_flags(cfg)),
            *extra]
    return cmd


class Throttle:
    """Pass lines through, but at most one progress-bar refresh per ``interval`` seconds, so a
    notebook never floods."""

    def __init__(self, stream: IO[str], interval: float = 2.0):
        self.stream, self.interval, self.last = stream, interval, 0.0

    def line(self, text: str, is_progress: bool) -> None:
        now = time.monotonic()
        if is_progress and now - self.last < self.interval:
            return
        if is_progress:
            self.last = now
        self.stream.write(text + "\n")
        self.stream.flush()


def checked_config(cfg: TrainConfig, nproc: int, out_dir: str, nodes: Nodes,
             module: str) -> tuple[TrainConfig, Optional[str]]:
    """``cfg`` validated for ``out_dir``; for the training ranks also the machine checked and
    the result written where they read it (the bench's ranks take flags: (cfg, None))."""
    cfg = checked_for_machine(cfg, nproc, out_dir, nodes, module)
    if module != "labkit.train":
        return cfg, None
    return cfg, write_resolved(cfg, nproc, out_dir, nodes)


def checked_for_machine(cfg: TrainConfig, nproc: int, out_dir: str, nodes: Nodes, module: str,
                        here: int = 1) -> TrainConfig:
    """``cfg`` validated for ``out_dir``, nothing written; for the training ranks also this
    machine checked for the ranks of the ``here`` nodes it runs (an emulated cluster: all)."""
    # a method of one's own by its absolute file: the ranks and the record name it from anywhere
    cfg = validate(dataclasses.replace(cfg, out=out_dir, method=absolute(cfg.method),
                                       workload=workload_path(cfg.workload)), nproc, nodes)
    if module == "labkit.train":
        # disk, /dev/shm, memory: refused before anything is created
        warn(budget.machine(cfg, nproc * here, out_dir, flags="--out (or --runs-dir)", nodes=here))
    return cfg


def write_resolved(cfg: TrainConfig, nproc: int, out_dir: str, nodes: Nodes) -> str:
    """Write the checked ``cfg`` into ``out_dir`` (made if new) for the ranks; its path."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, layout.resolved_file(nodes.node_rank))
    resolved_file.write(path, cfg, nproc, dataclasses.asdict(nodes))
    return path


def shown_ranks(cfg: TrainConfig, nproc: int) -> tuple[int, ...]:
    """The ranks whose lines are streamed: rank 0, and the first trainer where ranks serve (a
    parameter server's training bar)."""
    return tuple(sorted({0, min(nproc - 1, server_ranks(cfg.method, cfg.ps_servers))}))


def warn(lines: list[str]) -> None:
    """Say each warning once, on stderr (the terminal, a notebook's cell output)."""
    for line in lines:
        log.warning("labkit: warning: %s", line)


def log_dir_of(out_dir: str, nodes: Nodes) -> str:
    log_dir = os.path.join(out_dir, layout.LOGS_DIR)
    if nodes.multi:
        # every node may be given the same --out on a shared filesystem: each keeps its own logs
        # (and launch file), so a failure is explained from this node's ranks only
        log_dir = os.path.join(log_dir, f"node{nodes.node_rank}")
    os.makedirs(log_dir, exist_ok=True)
    return log_dir


def environment(nproc: int, env: Optional[dict], restarts: int = 0) -> dict:
    full = {**os.environ, **(env or {})}
    full.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    full["PYTHONUNBUFFERED"] = "1"
    if restarts:
        # restarted ranks sharing torchrun's rendezvous store read the previous attempt's
        # addresses and cannot connect (pytorch/pytorch#135712): give each attempt its own
        # store. Only then: an own store is bound by rank 0 on a port torchrun found free
        # seconds before, which another process can take meanwhile (EADDRINUSE, seen in the
        # suite); the shared store is already listening
        full.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    return full


def mark_ended(out_dir: str, result_file: str, status: Status, why: str) -> None:
    """A run that ended badly must not leave a result file that says it is running (rank 0
    may have been the rank that was killed): write how it ended, keeping every finished
    epoch. (A Ctrl-C also overrides the failure the ranks recorded as they were stopped.)
    Where rank 0 recorded only a consequence (it lost its peer, or torchrun stopped it), the
    cause ``why`` replaces it; what rank 0 saw is kept as ``rank0_error``."""
    path = os.path.join(out_dir, result_file)
    try:  # as written (not as a reader sees it: a running file whose writer is gone is ours to end)
        result = read_result(path, as_seen=False)
    except ResultError:  # missing, or not a result file: nothing to end
        return
    was = result.status
    if was == Status.FAILED and status == Status.FAILED and is_consequence(result.error or ""):
        result.extra["rank0_error"], result.error = result.error, why
        atomic_write_json(path, result.to_dict())
    elif was == Status.RUNNING or (status == Status.INTERRUPTED and was == Status.FAILED):
        result.status = status
        if result.error is None:
            result.error = why
        result.end_time = result.end_time or now_str()
        atomic_write_json(path, result.to_dict())
