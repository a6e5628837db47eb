"""Inside the emulated cluster: the switch, each node, and the goodput probe.

labkit.launch.cluster starts this file; nobody runs it by hand. It imports the standard library
only and is run by its file path (``python .../cluster_node.py``, not ``-m``), so that it
starts in milliseconds, never imports torch, and an unprivileged user can run it from a copy.

``switch`` is PID 1 of the outer namespaces (``unshare --user --map-root-user --net --mount
--pid --fork --mount-proc``): it brings up loopback and the bridge, starts one ``unshare --net
--uts --mount`` per node running this file's ``node``, and once a node says it is inside its
namespaces, joins it to the bridge by a veth pair (the bridge's end shaped here: the node's
download). Then it says "go" to every node at once, reaps every process (as PID 1, orphans come
to it), prints ``exit K CODE`` per node on stdout, stops the nodes when its stdin ends (the
launcher asked, or died), and exits when they have: the kernel then kills whatever is left in
the PID namespace, so nothing outlives a run.

With ``--warm-socket``, the switch first starts the cluster's warm process (labkit.launch.warm
``--join-namespaces``, importing ``--warm-preload``) in its own namespaces, so that its imports
run while the nodes come up and probe their links; each node's command is then a thin client
of it (labkit.launch.emulated), whose process it forks into that node's namespaces.

``node`` brings up its loopback (unshaped: its ranks talk over it) and its address, shapes its
end of the veth (its upload), takes its hostname (node0, node1, ...) and an /etc/hosts naming
every node (a bind mount in its own mount namespace), optionally runs the goodput probe, and
then becomes the node's command (exec: its PID, its exit code).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

BRIDGE = "br0"
NODE_DEV = "eth0"
NET = "198.18.0.0/15"  # RFC 2544's benchmarking range: never routed, and no route out is set
PREFIX = 15
MAX_NODES = 250  # node k is 198.18.0.(k+1)
STOP_SIGNAL = signal.SIGINT  # as Ctrl-C on each node's terminal: labkit records the run as interrupted
GRACE_S = 10.0  # after STOP_SIGNAL, what a node has to end before the kernel kills it
READY_S = 20.0  # for a node to be in its namespaces (a Python start under load)
PROBE_CONNECT_S = 8.0  # for every node of the probe to be up and listening
PROBE_WARMUP_S = 0.5  # TCP's slow start, left out of the measurement
#: where tc, ip and mount are when PATH lacks the sbin folders (an unprivileged user's PATH)
SBIN = ("/usr/sbin", "/sbin")


def tool(name: str) -> Optional[str]:
    """The path of a system tool, looked up in PATH and then the sbin folders."""
    path = os.pathsep.join([os.environ.get("PATH", ""), *SBIN])
    return shutil.which(name, path=path)


def hostname(k: int) -> str:
    return f"node{k}"


def address(k: int) -> str:
    return f"198.18.0.{k + 1}"


def hosts_text(nodes: int) -> str:
    """Every node's /etc/hosts: loopback, and each node's name at its address."""
    lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
    lines += [f"{address(k)}\t{hostname(k)}" for k in range(nodes)]
    # torch's store names a peer by its IPv4-mapped IPv6 address: without these its reverse
    # lookup goes to DNS, which no namespace reaches ("hostname ... cannot be retrieved")
    lines += [f"::ffff:{address(k)}\t{hostname(k)}" for k in range(nodes)]
    return "\n".join(lines) + "\n"


def shape_commands(dev: str, rate_bit: int, burst: int, latency_ms: float,
                   delay_us: int) -> list[list[str]]:
    """The tc commands that shape ``dev``'s egress: tbf at ``rate_bit`` (0: no tbf), with
    netem delaying by ``delay_us`` inside it (0: no netem)."""
    tc = tool("tc") or "tc"
    out: list[list[str]] = []
    if rate_bit:
        out.append([tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf",
                    "rate", f"{rate_bit}bit", "burst", str(burst), "latency", f"{latency_ms:g}ms"])
    if delay_us:
        where = ["parent", "1:1"] if rate_bit else ["root"]
        out.append([tc, "qdisc", "add", "dev", dev, *where, "handle", "10:", "netem",
                    "delay", f"{delay_us}us"])
    return out


def sh(*argv: str) -> None:
    """One system command, its output to ours (the node's log, or the switch's), checked."""
    subprocess.run([tool(argv[0]) or argv[0], *argv[1:]], check=True, stdin=subprocess.DEVNULL)


def link_args(a: argparse.Namespace) -> list[str]:
    return ["--rate-bit", str(a.rate_bit), "--burst", str(a.burst), "--latency-ms",
            str(a.latency_ms), "--delay-us", str(a.delay_us), "--nodes", str(a.nodes),
            "--log-dir", a.log_dir, "--probe-s", str(a.probe_s), "--probe-port", str(a.probe_port)]


def shape(dev: str, a: argparse.Namespace) -> None:
    for cmd in shape_commands(dev, a.rate_bit, a.burst, a.latency_ms, a.delay_us):
        subprocess.run(cmd, check=True, stdin=subprocess.DEVNULL)


# ------------------------------------------------------------------ the switch
class Switch:
    """PID 1 of the outer namespaces: the bridge, the nodes, their exit codes."""

    def __init__(self, a: argparse.Namespace, commands: list[list[str]]):
        self.a, self.commands = a, commands
        self.pids: dict[int, int] = {}  # pid -> node
        self.codes: dict[int, int] = {}  # node -> exit code
        self.lock = threading.Lock()
        self.ready = False
        self.ended = threading.Event()
        self.warm: Optional[subprocess.Popen] = None  # held: its stdin is the warm process's owner

    def say(self, line: str) -> None:
        with self.lock:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()

    def start(self) -> None:
        sh("ip", "link", "set", "lo", "up")
        self.start_warm()
        sh("ip", "link", "add", BRIDGE, "type", "bridge")
        sh("ip", "link", "set", BRIDGE, "up")
        Path(self.a.log_dir, "hosts").write_text(hosts_text(self.a.nodes))
        gos = []
        for k, command in enumerate(self.commands):
            pid, go = self.start_node(k, command)
            self.connect(k, pid)
            gos.append(go)
        for go in gos:  # all at once: the probe's streams overlap
            os.write(go, b"g")
            os.close(go)
        self.ready = True
        self.say("ready")

    def start_warm(self) -> None:
        """The cluster's warm process, here in the cluster's user and PID namespaces; what it
        prints goes to the switch's log (its stdout is the launcher's pipe). Its end:
        :meth:`stop_warm`, or the PID namespace's where the switch is killed."""
        if self.a.warm_socket:
            self.warm = subprocess.Popen(
                [sys.executable, "-m", "labkit.launch.warm", "--join-namespaces",
                 self.a.warm_socket, *filter(None, self.a.warm_preload.split(","))],
                stdin=subprocess.PIPE, stdout=sys.stderr.fileno())

    def stop_warm(self) -> None:
        """Once the nodes have ended: the warm process's owner pipe closed, so that it ends on
        its own at once (nothing it forked runs), and reaped here, its CPU counted in this
        switch's children as cold agents' was, rather than lost with the PID namespace."""
        if self.warm is not None:
            self.warm.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.warm.wait(5)

    def start_node(self, k: int, command: list[str]) -> tuple[int, int]:
        """Node ``k`` in its own network, UTS and mount namespaces, waiting for "go" (the
        write end returned) once it has said it is in them."""
        ready_r, ready_w = os.pipe()
        go_r, go_w = os.pipe()
        argv = [tool("unshare") or "unshare", "--net", "--uts", "--mount", "--propagation",
                "private", sys.executable, __file__, "node", *link_args(self.a), "--index",
                str(k), "--ready-fd", str(ready_w), "--go-fd", str(go_r), "--", *command]
        with open(Path(self.a.log_dir, f"node{k}.log"), "ab") as log:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, pass_fds=(ready_w, go_r),
                                    start_new_session=True)
        os.close(ready_w)
        os.close(go_r)
        self.pids[proc.pid] = k
        if not select.select([ready_r], [], [], READY_S)[0] or os.read(ready_r, 1) != b"r":
            raise RuntimeError(f"node{k} did not start (see node{k}.log)")
        os.close(ready_r)
        return proc.pid, go_w

    def connect(self, k: int, pid: int) -> None:
        """A veth pair: ``v<k>`` on the bridge, shaped, and its peer moved into the node."""
        dev = f"v{k}"
        sh("ip", "link", "add", dev, "type", "veth", "peer", "name", NODE_DEV, "netns", str(pid))
        sh("ip", "link", "set", dev, "master", BRIDGE)
        shape(dev, self.a)
        sh("ip", "link", "set", dev, "up")

    def reap(self) -> None:
        """Wait for every process (PID 1 reaps orphans too) until each node has ended."""
        while len(self.codes) < len(self.pids):
            try:
                pid, status = os.wait()
            except ChildProcessError:
                break
            if pid in self.pids:
                k = self.pids[pid]
                self.codes[k] = os.waitstatus_to_exitcode(status)
                self.say(f"exit {k} {self.codes[k]}")
        self.ended.set()

    def stop(self) -> None:
        """STOP_SIGNAL to every node still running; after GRACE_S, exit (the kernel kills
        what is left). Before the nodes are all up there is nothing to be gentle with."""
        if self.ready:
            for pid, k in list(self.pids.items()):
                if k not in self.codes:
                    try:
                        os.killpg(pid, STOP_SIGNAL)
                    except ProcessLookupError:
                        pass
            if self.ended.wait(GRACE_S):
                return
        self.say("killed")
        os._exit(137)

    def watch_stdin(self) -> None:
        """The launcher's pipe: its end (the launcher closed it, or died) means stop."""
        try:
            while os.read(0, 4096):  # unbuffered: no lock held at the interpreter's exit
                pass
        except OSError:
            pass
        self.stop()


def run_switch(a: argparse.Namespace, commands: list[list[str]]) -> int:
    sw = Switch(a, commands)
    threading.Thread(target=sw.watch_stdin, daemon=True).start()
    for sig in (signal.SIGTERM, signal.SIGINT):  # PID 1 ignores what it does not handle
        signal.signal(sig, lambda *_: threading.Thread(target=sw.stop, daemon=True).start())
    try:
        sw.start()
    except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
        sw.say(f"error {e}")
        return 2
    sw.reap()
    sw.stop_warm()
    sw.say("done")
    return 0


# ------------------------------------------------------------------ a node
def run_node(a: argparse.Namespace, command: list[str]) -> int:
    os.write(a.ready_fd, b"r")  # we are in our namespaces (unshare ran before exec)
    os.close(a.ready_fd)
    if os.read(a.go_fd, 1) != b"g":  # the switch ended before our link was made
        return 125
    os.close(a.go_fd)
    k = a.index
    try:
        sh("ip", "link", "set", "lo", "up")
        sh("ip", "addr", "add", f"{address(k)}/{PREFIX}", "dev", NODE_DEV)
        sh("ip", "link", "set", NODE_DEV, "up")
        shape(NODE_DEV, a)
        socket.sethostname(hostname(k))
        sh("mount", "--bind", str(Path(a.log_dir, "hosts")), "/etc/hosts")
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"labkit cluster: node{k} could not be set up: {e}", flush=True)
        return 125
    if a.probe_s > 0 and a.nodes > 1:
        Path(a.log_dir, f"node{k}.probe").write_text(probe(k, a.nodes, a.probe_port, a.probe_s))
    if not command:
        return 0
    try:
        os.execvp(command[0], command)
    except OSError as e:
        print(f"labkit cluster: node{k} cannot run {command[0]!r}: {e}", flush=True)
        return 127


# ------------------------------------------------------------------ the goodput probe
def probe(k: int, nodes: int, port: int, seconds: float) -> str:
    """Node ``k``'s link both ways at once: it sends to the next node while the previous one
    sends to it (a ring: every link carries one stream each way). Returns one line, ``from=
    NAME mbit=RECEIVED cc=ALGORITHM`` (or ``error=...``): what this node received; what it
    sent is what the next node received."""
    cc = Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()
    got: dict[str, object] = {}
    srv = socket.create_server(("", port))  # this node's own network: the port is free
    receiver = threading.Thread(target=_receive, args=(srv, seconds, got), daemon=True)
    receiver.start()
    deadline = time.monotonic() + PROBE_CONNECT_S + PROBE_WARMUP_S + seconds + 2
    try:
        _send(hostname((k + 1) % nodes), port, deadline)
    except OSError as e:
        got.setdefault("error", f"sending: {e}")
    receiver.join(max(0.0, deadline - time.monotonic()))
    srv.close()
    if "mbit" not in got:
        return f"from={hostname((k - 1) % nodes)} error={got.get('error', 'timed out')} cc={cc}\n"
    return f"from={hostname((k - 1) % nodes)} mbit={got['mbit']:.1f} cc={cc}\n"


def _send(host: str, port: int, deadline: float) -> None:
    """Send to ``host`` until it hangs up (its window is over) or the deadline."""
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=1.0)
            break
        except OSError:
            if time.monotonic() > deadline - 1:
                raise
            time.sleep(0.05)
    chunk = bytes(1 << 20)
    with sock:
        try:
            while time.monotonic() < deadline:
                sock.sendall(chunk)
        except OSError:  # the receiver closed: done
            pass


def _receive(srv: socket.socket, seconds: float, got: dict) -> None:
    """Accept one sender; count what arrives over ``seconds`` after the warm-up."""
    srv.settimeout(PROBE_CONNECT_S)
    try:
        conn, _ = srv.accept()
    except OSError as e:
        got["error"] = f"nobody connected: {e}"
        return
    buf = bytearray(1 << 20)
    with conn:
        conn.settimeout(2.0)
        try:
            conn.recv_into(buf)
            start = time.monotonic() + PROBE_WARMUP_S
            while time.monotonic() < start:
                conn.recv_into(buf)
            count, t0 = 0, time.monotonic()
            while (now := time.monotonic()) < t0 + seconds:
                n = conn.recv_into(buf)
                if not n:
                    break
                count += n
            got["mbit"] = count * 8 / max(now - t0, 1e-6) / 1e6
        except OSError as e:
            got["error"] = f"receiving: {e}"


# ------------------------------------------------------------------ the command line
def _commands(rest: list[str]) -> list[list[str]]:
    """``--argc N ARG...`` repeated: one command per node (empty: the node runs nothing)."""
    out, i = [], 0
    while i < len(rest):
        if rest[i] != "--argc":
            raise SystemExit(f"cluster_node: expected --argc, got {rest[i]!r}")
        n = int(rest[i + 1])
        out.append(rest[i + 2:i + 2 + n])
        i += 2 + n
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cluster_node")
    p.add_argument("role", choices=("switch", "node"))
    for name in ("--rate-bit", "--burst", "--delay-us", "--nodes", "--probe-port", "--index",
                 "--ready-fd", "--go-fd"):
        p.add_argument(name, type=int, default=0)
    p.add_argument("--latency-ms", type=float, default=20.0)
    p.add_argument("--probe-s", type=float, default=0.0)
    p.add_argument("--log-dir", required=True)
    p.add_argument("--warm-socket", default="")
    p.add_argument("--warm-preload", default="")
    return p


def main(argv: list[str]) -> int:
    mark = "--argc" if argv[:1] == ["switch"] else "--"  # the commands may hold a "--"
    cut = argv.index(mark) if mark in argv else len(argv)
    a = parser().parse_args(argv[:cut])
    rest = argv[cut:]
    if a.role == "switch":
        return run_switch(a, _commands(rest))
    return run_node(a, rest[1:] if rest[:1] == ["--"] else rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
