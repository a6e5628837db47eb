"""An emulated cluster on one machine: nodes with their own hostnames, joined by shaped links.

Every method labkit compares differs only in what it sends, yet ranks on one machine talk over
loopback, where sending is almost free. This builds the slow network a real cluster has, without
root and without leaving the machine: an outer user + network + mount + PID namespace holds a
bridge (the switch); each node is a further network + UTS + mount namespace with its own
hostname (node0, node1, ...) and /etc/hosts, joined to the bridge by a veth pair whose two ends
are shaped by ``tc tbf`` (full duplex, one port per node). Ranks of one node talk over its own
loopback, unshaped. Addresses come from 198.18.0.0/15 (benchmarking), there is no route out,
and the PID namespace makes teardown the kernel's job: when the run ends, fails, is stopped or
its launcher is killed, nothing it started is left.

    from labkit.launch.cluster import ClusterSpec, parse_link, check_machine, run_cluster
    spec = ClusterSpec(nodes=2, ranks_per_node=1, link=parse_link("100mbit"))  # ConfigError
    check_machine(spec)             # ConfigError: one line naming what is missing, and the fix
    res = run_cluster(spec, labkit_run_commands(spec, "ddp", ["--epochs", "1"]), "logs",
                      probe_s=2.0)  # ClusterResult: exit code and log per node, goodput
    link_record(spec, res.goodput)  # the link as a run records it

- ``parse_link("100mbit")``, ``"2.5gbit"``, ``"500kbit"``, ``"unshaped"``; a one-way node to
  node delay as ``"100mbit:5ms"`` or ``parse_link("100mbit", delay="5ms")`` (half on each veth
  end; needs sch_netem, which check_machine tries for). The tbf burst is max(64 KB, 2 ms at the
  rate): a smaller one halves the goodput at 1gbit. The queue holds LATENCY_MS at the rate.
- ``run_cluster(spec, commands, log_dir, env=None, cwd=None, probe_s=0, timeout=None)``: one
  argv per node, run inside it (env and cwd as given, the same filesystem), each node's output
  in ``log_dir/node<K>.log``. With ``probe_s`` the goodput probe runs first in every node
  (labkit.launch.cluster_node.probe). Ctrl-C (KeyboardInterrupt) and a timeout stop the nodes
  (SIGINT to each node's commands, SIGKILL by the kernel after a grace) before returning or
  re-raising; a SIGTERM or kill -9 of this process ends the cluster through the pipe it held.
- ``labkit_run_commands``: each node a node of the lab's multi-node path (``labkit run METHOD
  --nnodes N --node-rank K --rdzv-endpoint node0:PORT``); each node's network is new: the port
  is free. docs/emulated-cluster.md: the recipe, measured goodput, what it models and not.
"""
from __future__ import annotations

import functools
import math
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from labkit.core.errors import ConfigError
from labkit.core.procs import die_with_parent

from . import cluster_node as node

__all__ = ["Link", "ClusterSpec", "Goodput", "ClusterResult", "parse_link", "check_machine",
           "netem_available", "run_cluster", "probe", "read_goodput", "labkit_run_commands",
           "link_record"]

MIN_BURST = 64 * 1024  # bytes: below this, tbf cannot keep a fast link busy
BURST_S = 0.002  # the burst holds 2 ms at the rate: with less, 1gbit gave ~460 Mbit/s
LATENCY_MS = 20.0  # tbf's queue: what it holds, in time at the rate, before dropping
RDZV_PORT = 29400  # node0's c10d rendezvous
PROBE_PORT = 5201
NODE_FILE = str(Path(node.__file__).resolve())
UNITS = {"": 1, "k": 10 ** 3, "m": 10 ** 6, "g": 10 ** 9, "t": 10 ** 12}
RATE = re.compile(r"(\d+(?:\.\d+)?|\.\d+)([kmgt]?)bit")
NUMBER = re.compile(r"-?(\d+(?:\.\d*)?|\.\d+)")
DELAY = re.compile(r"(\d+(?:\.\d+)?)(us|ms|s)")
RATE_HELP = "give e.g. 100mbit, 1gbit, 2.5gbit, 500kbit or unshaped"
NO_DELAY = "delay not emulated on this kernel (no sch_netem)"


@dataclass(frozen=True)
class Link:
    """One node's port: ``rate_bit`` each way (0: unshaped) and a one-way delay."""
    rate_bit: int = 0
    delay_us: int = 0

    @property
    def shaped(self) -> bool:
        return self.rate_bit > 0

    @property
    def burst(self) -> int:
        """tbf's burst in bytes: max(64 KB, 2 ms at the rate)."""
        return max(MIN_BURST, math.ceil(self.rate_bit / 8 * BURST_S)) if self.shaped else 0

    @property
    def queue_bytes(self) -> int:
        """What tbf queues before dropping: LATENCY_MS at the rate, plus the burst."""
        return int(self.rate_bit / 8 * LATENCY_MS / 1000) + self.burst if self.shaped else 0

    def __str__(self) -> str:
        rate = "unshaped"
        if self.shaped:
            unit = max((u for u, f in UNITS.items() if self.rate_bit % f == 0), key=UNITS.get)
            rate = f"{self.rate_bit // UNITS[unit]}{unit}bit"
        return rate + (f":{self.delay_us / 1000:g}ms" if self.delay_us else "")


def _parse_rate(text: str) -> int:
    if text == "unshaped":
        return 0
    m, number = RATE.fullmatch(text), NUMBER.match(text)
    if number and float(number.group()) <= 0:
        raise ConfigError(f"link rate must be above 0 (got {text}): {RATE_HELP}")
    if not m:
        raise ConfigError(f"link rate {text!r} is no rate: {RATE_HELP}")
    bits = round(float(m.group(1)) * UNITS[m.group(2)])
    if bits < 1000:
        raise ConfigError(f"link rate {text} is below 1kbit: {RATE_HELP}")
    return bits


def _parse_delay(text: str) -> int:
    m = DELAY.fullmatch(text)
    if text.startswith("-"):
        raise ConfigError(f"link delay must not be negative (got {text}): give e.g. 5ms or 500us")
    if not m:
        raise ConfigError(f"link delay {text!r} is no delay: give e.g. 5ms or 500us")
    return round(float(m.group(1)) * {"us": 1, "ms": 1e3, "s": 1e6}[m.group(2)])


def parse_link(text: str, delay: Optional[str] = None) -> Link:
    """``"100mbit"``, ``"2.5gbit"``, ``"unshaped"``, ``"100mbit:5ms"`` (or ``delay="5ms"``) ->
    Link; ConfigError (one line) for anything else."""
    text = str(text).strip().lower()
    rate, _, inline = text.partition(":")
    if inline and delay is not None:
        raise ConfigError(f"link {text!r} has a delay already: give the delay once")
    if not rate:
        raise ConfigError(f"link: no rate given: {RATE_HELP}")
    delay_text = (inline or (delay or "")).strip().lower()
    return Link(_parse_rate(rate), _parse_delay(delay_text) if delay_text else 0)


@dataclass(frozen=True)
class ClusterSpec:
    """``nodes`` emulated nodes of ``ranks_per_node`` ranks each, every node on ``link``."""
    nodes: int
    ranks_per_node: int = 1
    link: Link = field(default_factory=Link)

    def __post_init__(self):
        for name, value, top in (("nodes", self.nodes, node.MAX_NODES),
                                 ("ranks per node", self.ranks_per_node, 1024)):
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= top:
                raise ConfigError(f"cluster {name} must be a whole number from 1 to {top} "
                                  f"(got {value!r})")

    @property
    def hostnames(self) -> list[str]:
        return [node.hostname(k) for k in range(self.nodes)]


# ------------------------------------------------------------------ can this machine do it?
TOOLS = {"unshare": "util-linux", "ip": "iproute2", "tc": "iproute2", "mount": "mount"}
USERNS_SYSCTLS = (  # (file under /proc/sys, the value that forbids, how to allow)
    ("kernel/unprivileged_userns_clone", "0", "sysctl -w kernel.unprivileged_userns_clone=1"),
    ("kernel/apparmor_restrict_unprivileged_userns", "1",
     "sysctl -w kernel.apparmor_restrict_unprivileged_userns=0 (Ubuntu 24.04 and later)"),
    ("user/max_user_namespaces", "0", "sysctl -w user.max_user_namespaces=15000"),
)


def _inside(cmd: Sequence[str], *namespaces: str) -> subprocess.CompletedProcess:
    """``cmd`` in a throwaway user + network namespace (and ``namespaces``), which vanishes
    with it."""
    argv = [node.tool("unshare") or "unshare", "--user", "--map-root-user", "--net",
            *namespaces, "--", *cmd]
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=20,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(argv, 1, "", f"{cmd[0]} took over 20 s")


def userns_hint(proc_sys: Path = Path("/proc/sys")) -> str:
    """Why user namespaces are refused, with the fix, from the sysctls that forbid them."""
    for name, forbids, fix in USERNS_SYSCTLS:
        try:
            if (proc_sys / name).read_text().strip() == forbids:
                return f"{name.replace('/', '.')} is {forbids}; as root: {fix}"
        except OSError:
            continue
    return ("unshare is refused (a container without CAP_SYS_ADMIN or whose seccomp blocks "
            "unshare?): run on the host, or allow user namespaces in the container")


@functools.cache
def netem_available() -> bool:
    """Whether this kernel can delay packets (sch_netem), tried in a throwaway namespace."""
    tc = node.tool("tc") or "tc"
    return _inside([tc, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"]).returncode == 0


def check_machine(spec: ClusterSpec) -> None:
    """Before anything starts: ConfigError, one line naming what this machine lacks for
    ``spec`` and how to enable it; None when it can build the cluster."""
    for name, package in TOOLS.items():
        if node.tool(name) is None:
            raise ConfigError(f"the emulated cluster needs `{name}`, not found: apt-get install "
                              f"{package}")
    ns = _inside(["true"], "--mount", "--pid", "--fork", "--mount-proc")
    if ns.returncode != 0:
        raise ConfigError(f"the emulated cluster needs unprivileged user namespaces: "
                          f"{userns_hint()} ({_last_line(ns.stderr)})")
    ip, tc = node.tool("ip"), node.tool("tc")
    tries = [([ip, "link", "add", "b0", "type", "bridge"], "bridge", "bridge (CONFIG_BRIDGE)"),
             ([ip, "link", "add", "a0", "type", "veth", "peer", "name", "a1"], "veth",
              "veth pairs (CONFIG_VETH)")]
    if spec.link.shaped:
        tries.append(([tc, "qdisc", "add", "dev", "lo", "root", "tbf", "rate", "1mbit", "burst",
                       str(MIN_BURST), "latency", "20ms"], "sch_tbf", "tc tbf (CONFIG_NET_SCH_TBF)"))
    for cmd, module, what in tries:
        p = _inside(cmd)
        if p.returncode != 0:
            raise ConfigError(f"the emulated cluster needs {what}, which this kernel refuses "
                              f"({_last_line(p.stderr)}): as root, modprobe {module}")
    if spec.link.delay_us and not netem_available():
        raise ConfigError(f"link delay {spec.link.delay_us / 1000:g}ms needs sch_netem, which this "
                          "kernel lacks: run without a delay, or on a kernel with it (stock "
                          "Debian and Ubuntu kernels: as root, modprobe sch_netem)")


def _last_line(text: str) -> str:
    lines = [l.strip() for l in (text or "").splitlines() if l.strip()]
    return lines[-1] if lines else "no message"


# ------------------------------------------------------------------ running it
@dataclass(frozen=True)
class Goodput:
    """What the probe measured, in Mbit/s per node: ``down`` what node K received while
    sending, ``up`` what it sent (the next node received); None where a stream failed."""
    down_mbit: list[Optional[float]]
    up_mbit: list[Optional[float]]
    congestion_control: str
    errors: list[str] = field(default_factory=list)


@dataclass
class ClusterResult:
    """How a run on the emulated cluster ended: per node, its exit code (None: never ended,
    the cluster was killed) and log; the probe's goodput; why the cluster failed, if it did."""
    spec: ClusterSpec
    log_dir: Path
    returncodes: list[Optional[int]]
    wall_s: float
    goodput: Optional[Goodput] = None
    error: str = ""
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return not self.error and not self.timed_out and all(c == 0 for c in self.returncodes)

    def log(self, k: int) -> Path:
        return self.log_dir / f"node{k}.log"


def _outer_command(spec: ClusterSpec, commands: Sequence[Sequence[str]], log_dir: Path,
                   probe_s: float, warm: Optional[tuple[str, Sequence[str]]] = None) -> list[str]:
    link = spec.link
    argv = [node.tool("unshare") or "unshare", "--user", "--map-root-user", "--net", "--mount",
            "--pid", "--fork", "--mount-proc", "--kill-child", sys.executable, "-P", NODE_FILE,
            "switch", "--rate-bit", str(link.rate_bit), "--burst", str(link.burst),
            "--latency-ms", str(LATENCY_MS), "--delay-us", str(link.delay_us // 2),
            "--nodes", str(spec.nodes), "--log-dir", str(log_dir), "--probe-s", str(probe_s),
            "--probe-port", str(PROBE_PORT)]
    if warm:
        argv += ["--warm-socket", warm[0], "--warm-preload", ",".join(warm[1])]
    for c in commands:
        argv += ["--argc", str(len(c)), *map(str, c)]
    return argv


def run_cluster(spec: ClusterSpec, commands: Sequence[Sequence[str]], log_dir, env=None,
                cwd=None, probe_s: float = 0.0, timeout: Optional[float] = None,
                warm: Optional[tuple[str, Sequence[str]]] = None) -> ClusterResult:
    """Build the cluster, run ``commands[K]`` in node K, wait, tear down (see the module's
    docstring). Call check_machine first: a machine that cannot is told in one line there.
    ``warm``: (socket, modules) of the cluster's warm process, which the switch starts
    (labkit.launch.cluster_node) for the nodes' thin clients."""
    if len(commands) != spec.nodes:
        raise ValueError(f"{len(commands)} commands for {spec.nodes} nodes")
    log_dir = Path(log_dir).resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    for old in log_dir.glob("node*.probe"):
        old.unlink()
    t0, lines, timed_out = time.monotonic(), [], False
    with open(log_dir / "switch.log", "ab") as err:
        proc = subprocess.Popen(_outer_command(spec, commands, log_dir, probe_s, warm),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env,
                                cwd=cwd, start_new_session=True, preexec_fn=_die_with_parent)
    reader = threading.Thread(target=_read_lines, args=(proc.stdout, lines), daemon=True)
    reader.start()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:  # Ctrl-C too: the nodes are stopped before KeyboardInterrupt goes on
        _stop(proc)
    reader.join(5)
    return _result(spec, log_dir, lines, time.monotonic() - t0, timed_out, probe_s)


def _read_lines(stream, into: list) -> None:
    into.extend(raw.decode(errors="replace").rstrip("\n") for raw in stream)  # as they come


def _die_with_parent() -> None:
    """In unshare, before exec: killed with this process (its --kill-child then kills the
    switch, and the PID namespace everything in it)."""
    die_with_parent(signal.SIGKILL)


def _stop(proc: subprocess.Popen) -> None:
    """End the cluster: closing the switch's stdin asks it to stop the nodes; after their
    grace, SIGKILL to unshare (its --kill-child kills the switch, the kernel the rest)."""
    try:
        proc.stdin.close()
    except OSError:
        pass
    try:
        proc.wait(node.GRACE_S + 5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _result(spec: ClusterSpec, log_dir: Path, lines: list[str], wall_s: float,
            timed_out: bool, probe_s: float) -> ClusterResult:
    codes: list[Optional[int]] = [None] * spec.nodes
    error = ""
    for line in lines:
        word, _, rest = line.partition(" ")
        if word == "exit":
            k, code = rest.split()
            codes[int(k)] = int(code)
        elif word == "error":
            error = f"the emulated cluster could not be built: {rest} (logs: {log_dir})"
    if not error and "done" not in lines and not timed_out:
        error = f"the emulated cluster ended early (logs: {log_dir})"
    goodput = read_goodput(spec, log_dir) if probe_s > 0 and spec.nodes > 1 else None
    return ClusterResult(spec, log_dir, codes, wall_s, goodput, error, timed_out)


def read_goodput(spec: ClusterSpec, log_dir: Path) -> Goodput:
    """What the probe wrote in ``log_dir`` (``node<K>.probe``: ``from=NAME mbit=X cc=NAME``
    or ``from=NAME error=... cc=NAME``)."""
    down: list[Optional[float]] = [None] * spec.nodes
    errors, cc = [], ""
    for k in range(spec.nodes):
        path = log_dir / f"node{k}.probe"
        if not path.exists():
            errors.append(f"node{k}: no probe result (see node{k}.log)")
            continue
        text = path.read_text().strip()
        fields = dict(w.split("=", 1) for w in text.split(" ") if "=" in w)
        cc = fields.get("cc", cc)
        if "mbit" in fields:
            down[k] = float(fields["mbit"])
        else:
            errors.append(f"node{k}: {text}")
    up = [down[(k + 1) % spec.nodes] for k in range(spec.nodes)]
    return Goodput(down, up, cc, errors)


def probe(spec: ClusterSpec, log_dir, seconds: float = 2.0) -> Goodput:
    """Only the probe: every link both ways at once for ``seconds`` after a 0.5 s warm-up."""
    if spec.nodes < 2:
        raise ConfigError("the goodput probe needs two nodes or more (one node has no link)")
    res = run_cluster(spec, [[]] * spec.nodes, log_dir, probe_s=seconds, timeout=seconds + 30)
    if res.error or res.goodput is None:
        raise RuntimeError(res.error or "the probe measured nothing")
    return res.goodput


def labkit_run_commands(spec: ClusterSpec, method: str, args: Sequence[str] = (),
                        port: int = RDZV_PORT, program: Optional[Sequence[str]] = None
                        ) -> list[list[str]]:
    """One ``labkit run METHOD ARGS --nproc R --nnodes N --node-rank K --rdzv-endpoint
    node0:PORT`` per node: torchrun's c10d rendezvous at node0, as on real nodes."""
    program = list(program or [sys.executable, "-m", "labkit"])
    return [[*program, "run", method, *args, "--nproc", str(spec.ranks_per_node), "--nnodes",
             str(spec.nodes), "--node-rank", str(k), "--rdzv-endpoint", f"{node.hostname(0)}:{port}"]
            for k in range(spec.nodes)]


def link_record(spec: ClusterSpec, goodput: Optional[Goodput] = None) -> dict:
    """The link as a run's records state it: rate, burst, queue, delay (or that this kernel
    cannot delay), TCP congestion control and the measured goodput per node."""
    link = spec.link
    delay = (f"{link.delay_us / 1000:g} ms one way" if link.delay_us
             else "none" if netem_available() else NO_DELAY)
    doc = {"nodes": spec.nodes, "ranks_per_node": spec.ranks_per_node, "link": str(link),
           "rate_bit": link.rate_bit, "burst_bytes": link.burst,
           "queue": f"tbf latency {LATENCY_MS:g} ms ({link.queue_bytes} bytes)" if link.shaped
           else "none (unshaped veth)", "delay": delay, "delay_us": link.delay_us}
    if goodput is not None:
        doc["tcp_congestion_control"] = goodput.congestion_control
        doc["goodput_mbit"] = [{"node": node.hostname(k), "up": goodput.up_mbit[k],
                                "down": goodput.down_mbit[k]} for k in range(spec.nodes)]
        if goodput.errors:
            doc["goodput_errors"] = goodput.errors
    return doc
