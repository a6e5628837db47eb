"""One method on an emulated cluster (labkit.launch.cluster): the lab's multi-node path, each
node a network namespace of this machine joined to the others by a shaped link.

    launch(cfg, nproc=1, out_dir, Nodes(emulate_nodes=2, link="100mbit"))  # via labkit.launch.launch

Each node runs the same torchrun command a real node would (``--nnodes N --node-rank K
--rdzv-endpoint node0:29400``), so the ranks, their result file and their logs are those of a
multi-node run (``<out>/logs/node<K>/``); the cluster's own logs and the goodput probe's
files are in ``<out>/logs/cluster/``. Before the first step the probe measures each node's
link both ways; the link as set and as measured goes into the result file (``link``) and the
launch file. The emulation changes time, never results: ranks, data shards and the order of
every sum are those of the same world on one machine.

Every node's agent and ranks are forked from one warm process of the cluster's (labkit.launch.warm,
started by the cluster's switch while the nodes come up), each into its node's network,
hostname and mount namespaces: torch and the workload are imported once per launch, not by an
agent and a fork server on every node. The launch file records the agents' commands as a
node runs them cold.
"""
from __future__ import annotations

import os
import shlex
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Optional

from labkit.core import layout
from labkit.core.config import ConfigError, TrainConfig
from labkit.core.files import atomic_write_json
from labkit.core.methods import key_of
from labkit.core.procs import EMULATED_NODES
from labkit.core.resources import duration, oom_kills, size
from labkit.core.results import read_result
from labkit.core.status import INTERRUPTED_WHY, Status
from labkit.training.budget import STALL_TIMEOUTS, step_link_bytes

from .cluster import (RDZV_PORT, ClusterSpec, Link, check_machine, link_record, parse_link,
                      read_goodput, run_cluster)
from .agent import AGENT, preload_for_workload
from .cluster_node import hostname
from .failures import Explanation, explain_failure, quote
from .launch_params import Nodes
from .torchrun_job import (LaunchResult, Throttle, checked_for_machine, environment, log_dir_of,
                          mark_ended, shown_ranks, torchrun_command, warn, write_resolved)
from .torchrun_output import TorchrunOutput
from .warm import as_client
from .warm_client import ENV

PROBE_S = 2.0  # seconds the probe measures each link, both ways at once, before training
CLUSTER_LOGS = "cluster"  # <out>/logs/cluster: each node's console, the probe's files
#: a node's goodput below this share of the link's rate is this machine's limit, not the
#: link's (the probe measures ~95% of the rate where the CPUs keep up: docs/emulated-cluster.md)
CPU_BOUND = 0.8


def cluster_spec(nodes: Nodes, nproc: int, machine: bool = True) -> Optional[ClusterSpec]:
    """The emulated cluster ``nodes`` asks for, checked against this machine unless not
    ``machine`` (ConfigError, one line, before anything starts); None for none."""
    if not nodes.emulated:  # a --link without --emulate-nodes: refused by Nodes itself
        return None
    if nodes.multi:
        raise ConfigError("--emulate-nodes builds its nodes on this machine: drop --nnodes, "
                          "--node-rank and --rdzv-endpoint (those start real nodes)")
    if nproc < 1:
        raise ConfigError(f"--nproc must be at least 1 (got {nproc}): the ranks of each emulated node")
    spec = ClusterSpec(nodes.emulate_nodes, nproc, parse_link(nodes.link or "unshaped"))
    if machine:
        check_machine(spec)
    return spec


def launch_emulated(cfg: TrainConfig, nproc: int, out_dir: str, nodes: Nodes, stream: IO[str],
                    env: Optional[dict], throttle_s: float, module: str,
                    extra: tuple[str, ...], resolved: Optional[str]) -> LaunchResult:
    """labkit.launch.launch.launch for ``nodes.emulated``: one torchrun per node, node 0's rank 0
    streamed, a failure explained from the node where it happened."""
    spec = cluster_spec(nodes, nproc, machine=False)
    endpoint = f"{hostname(0)}:{RDZV_PORT}"
    # every node runs here: memory for all their ranks, a link a step can cross, then the
    # namespaces (tried in throwaway ones); nothing is written before all of them pass
    if resolved is None:
        cfg = checked_for_machine(cfg, nproc, out_dir, nodes.node(0, endpoint), module, spec.nodes)
    check_link(cfg, spec)
    check_machine(spec)
    if resolved is None and module == "labkit.train":
        resolved = write_resolved(cfg, nproc, out_dir, nodes.node(0, endpoint))
    show = shown_ranks(cfg, nproc)
    dirs = [log_dir_of(out_dir, nodes.node(k, endpoint)) for k in range(spec.nodes)]
    cmds = [torchrun_command(cfg, nproc, dirs[k], nodes.node(k, endpoint), show, module, extra,
                             resolved) for k in range(spec.nodes)]
    logs = os.path.join(out_dir, layout.LOGS_DIR, CLUSTER_LOGS)
    os.makedirs(logs, exist_ok=True)
    streamer = _Streamer(logs, spec, set(show), Throttle(stream, throttle_s))
    t0, started, kills = time.monotonic(), time.time(), oom_kills()
    # the cluster's warm process: its socket's folder made here and removed here too, where a
    # killed cluster ended it unawares; each node runs its agent as a thin client of it
    folder = tempfile.mkdtemp(prefix="labkit-warm-")
    warm = (os.path.join(folder, "socket"), preload_for_workload(cfg.workload) + AGENT)
    try:
        env = {**environment(nproc * spec.nodes, env, nodes.max_restarts),
               EMULATED_NODES: str(spec.nodes), ENV: warm[0]}
        res = run_cluster(spec, [as_client(c) for c in cmds], logs, env=env, cwd=os.getcwd(),
                          probe_s=PROBE_S, warm=warm)
    except KeyboardInterrupt:
        mark_ended(out_dir, cfg.result_file, Status.INTERRUPTED, INTERRUPTED_WHY)
        raise
    finally:
        streamer.stop()
        shutil.rmtree(folder, ignore_errors=True)
    texts = [_read(res.log(k)) for k in range(spec.nodes)]
    codes = [1 if c is None else c for c in res.returncodes]
    code = next((c for c in codes if c != 0), 0 if res.ok else 1)
    out = LaunchResult(cfg.method, code, out_dir, dirs[0], cmds[0], time.monotonic() - t0,
                       started_at=started)
    if code != 0:
        after = oom_kills()
        oom = None if kills is None or after is None else after > kills
        why = (Explanation(f"{key_of(cfg.method)} failed: {res.error}") if res.error
               else explain_nodes(cfg, spec, codes, texts, dirs, oom))
        out.message, out.failed_rank, out.log_tail = why.message, why.rank, why.lines
        out.explained_from = why.error_file
    _record(out, cfg, nproc, spec, res, cmds, texts, dirs)
    return out


def link_time(cfg: TrainConfig, spec: ClusterSpec) -> Optional[tuple[float, float]]:
    """(bytes one step of the resolved ``cfg`` moves each way over a node's link, seconds
    they need at the link's rate), where both are known (labkit.training.budget)."""
    moved = step_link_bytes(cfg, spec.nodes, spec.ranks_per_node) if spec.link.shaped else None
    return None if not moved else (moved, moved * 8 / spec.link.rate_bit)


def _step_needs(cfg: TrainConfig, spec: ClusterSpec, moved: float, seconds: float) -> str:
    return (f"one step of {key_of(cfg.method)} moves about {size(moved)} each way over a node's "
            f"link, which needs about {duration(seconds)} at {Link(spec.link.rate_bit)}")


def check_link(cfg: TrainConfig, spec: ClusterSpec) -> None:
    """Refuse (ConfigError, one line) a link on which one step's bytes need longer than a
    step may take (STALL_TIMEOUTS x --timeout, after which its rank ends the run): before
    any namespace exists."""
    need = link_time(cfg, spec)
    bound = STALL_TIMEOUTS * cfg.timeout
    if need is None or need[1] <= bound:
        return
    raise ConfigError(f"--link {spec.link} is too slow: {_step_needs(cfg, spec, *need)}, and a step "
                      f"may take at most {duration(bound)} ({STALL_TIMEOUTS} x --timeout "
                      f"{cfg.timeout:g} s): give a faster --link, a smaller model or a longer "
                      f"--timeout")


def explain_nodes(cfg: TrainConfig, spec: ClusterSpec, codes: list[int], texts: list[str],
                  dirs: list[str], oom: Optional[bool]) -> Explanation:
    """A failed run's explanation from every node's output and logs (this launcher holds them
    all): the rank blamed on whichever node it ran. Where no rank failed first (every node's
    ranks only lost their peers or timed out waiting), that is said of the whole cluster, and
    the link blamed where one step's bytes need longer than --timeout at its rate."""
    key = key_of(cfg.method)
    whys = [explain_failure(key, c, t, d, True, oom) for c, t, d in zip(codes, texts, dirs) if c != 0]
    # a rank blamed, else a node that did not only lose its peers (its torchrun's own failure)
    why = next((w for w in whys if w.rank is not None), None) or next(
        (w for w in whys if not w.lost_peers), whys[0] if whys else None)
    if why is None or not why.lost_peers:
        return why or Explanation(f"{key} failed (logs: {os.path.dirname(dirs[0])})")
    head = (f"{key} failed: no rank failed first: the ranks of all {spec.nodes} emulated nodes "
            f"only lost their peers or timed out waiting for them (--timeout {cfg.timeout:g} s)")
    need = link_time(cfg, spec)
    if need is not None and need[1] > cfg.timeout:
        return Explanation(f"{head}: {_step_needs(cfg, spec, *need)}, longer than --timeout; give "
                           f"a faster --link, a smaller model or a longer --timeout (logs: "
                           f"{os.path.dirname(dirs[0])})", None, why.lines, why.error_file)
    return Explanation(f"{head}. One of them said:\n" + quote(why.lines), None, why.lines,
                       why.error_file)


def _record(out: LaunchResult, cfg: TrainConfig, nproc: int, spec: ClusterSpec, res,
            cmds: list[list[str]], texts: list[str], dirs: list[str]) -> None:
    """Each node's torchrun.log, the launch file (with the link), the link into the result
    file, and a failed run's result file marked failed."""
    link = link_record(spec, res.goodput)
    try:
        for text, d, cmd in zip(texts, dirs, cmds):
            with open(os.path.join(d, layout.TORCHRUN_LOG), "w") as f:
                f.write(" ".join(cmd) + "\n\n" + text)
        path = os.path.join(out.out_dir, cfg.result_file)
        if os.path.exists(path):
            result = read_result(path, as_seen=False)  # as written: no reader's verdict
            result.link = link
            atomic_write_json(path, result.to_dict())
        if not out.ok:
            mark_ended(out.out_dir, cfg.result_file, Status.FAILED, out.message.splitlines()[0])
        atomic_write_json(os.path.join(out.out_dir, layout.launch_file(0)), layout.portable({
            "method": cfg.method, "nproc": nproc, "emulated": link, "commands": cmds,
            "command": cmds[0], "command_line": " && ".join(shlex.join(c) for c in cmds), "returncodes": res.returncodes, "returncode": out.returncode,
            "wall_time": out.wall_time, "failed_rank": out.failed_rank, "message": out.message,
            "explained_from": out.explained_from, **out.times()}, out.out_dir))
    except (OSError, ValueError) as e:
        if out.ok:
            raise
        out.message += f"\n(could not record the failure in {out.out_dir}: {e})"


def _read(path) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


class _Streamer:
    """Follows every node's console while the cluster runs: the shown ranks' lines (rank 0
    runs on whichever node the rendezvous put it), and one line with the probe's goodput."""

    def __init__(self, logs: str, spec: ClusterSpec, show: set[int], out: Throttle):
        self.logs, self.spec, self.show, self.out = logs, spec, show, out
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._follow, name="labkit-cluster-stream", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.done.set()
        self.thread.join(5)

    def _follow(self) -> None:
        readers = [TorchrunOutput() for _ in range(self.spec.nodes)]
        offsets, rest = [0] * self.spec.nodes, [""] * self.spec.nodes
        said_probe = False
        while True:
            last = self.done.is_set()
            for k in range(self.spec.nodes):
                offsets[k], rest[k] = self._lines(k, offsets[k], rest[k], readers[k])
            if not said_probe:
                said_probe = self._probe()
            if last:
                return
            self.done.wait(0.5)

    def _lines(self, k: int, offset: int, rest: str, reader: TorchrunOutput) -> tuple[int, str]:
        try:
            with open(os.path.join(self.logs, f"node{k}.log"), errors="replace") as f:
                f.seek(offset)
                chunk = f.read()
                offset = f.tell()
        except OSError:
            return offset, rest
        *whole, rest = (rest + chunk).split("\n")
        for raw in whole:
            for line in reader.feed(raw):
                rank = line.text[5:line.text.find("]")] if line.text.startswith("[rank") else ""
                if line.shown and rank.isdigit() and int(rank) in self.show:
                    self.out.line(line.text, is_progress=line.progress)
        return offset, rest

    def _probe(self) -> bool:
        files = [os.path.join(self.logs, f"node{k}.probe") for k in range(self.spec.nodes)]
        if self.spec.nodes < 2 or not all(os.path.exists(f) for f in files):
            return self.spec.nodes < 2
        got = read_goodput(self.spec, Path(self.logs)).down_mbit
        self.out.line(f"emulated cluster: {self.spec.nodes} nodes x {self.spec.ranks_per_node} "
                      f"rank(s), link {self.spec.link} each way; measured "
                      + ", ".join(f"node{k} received {'?' if g is None else g} Mbit/s"
                                  for k, g in enumerate(got)), False)
        slow = probe_warning(self.spec, got)
        if slow:
            warn([slow])
        return True


def probe_warning(spec: ClusterSpec, got: list[Optional[float]]) -> Optional[str]:
    """The warning for a probe whose goodput (Mbit/s received per node, None: not measured)
    falls far below the set rate on every node (under CPU_BOUND of it): this machine cannot
    move the nodes' traffic as fast as the link would, so the run's times are its, not the
    link's. One slow node alone is not that: at slow rates one node's 2 s probe can read
    half the rate."""
    seen = [g for g in got if g is not None]
    rate = spec.link.rate_bit / 1e6
    if not spec.link.shaped or not seen or max(seen) >= CPU_BOUND * rate:
        return None
    return (f"the probe measured {min(seen):g}-{max(seen):g} Mbit/s on the {Link(spec.link.rate_bit)} "
            f"link, at most {max(seen) / rate:.0%} of its rate on every node: this machine "
            f"({os.cpu_count()} cores for {spec.nodes} nodes x {spec.ranks_per_node} rank(s)), "
            f"not the link, limits the traffic, so the run's communication times are not the "
            f"link's; fewer --emulate-nodes or a slower --link measure the link")
