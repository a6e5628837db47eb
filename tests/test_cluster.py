"""The emulated cluster (labkit.launch.cluster, issue 57): links and node counts are checked in one
line each; nodes get their own hostnames, addresses and shaped links; the probe and a gloo
all_reduce across two nodes at 100mbit come within 10% of the rate; labkit's multi-node
`labkit run` trains across them; a finished, failed, timed-out, Ctrl-C'd or kill -9'd run
leaves no namespace and no process (lsns, ps); and the rootless path works for an unprivileged
user. The cluster's tests are one xdist group: they run one after the other, so the namespaces
one of them sees are its own."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import pytest

import torch

from helpers import ROOT, TINY, labkit, needs_namespaces_mark, tiny_flags
from labkit.core.errors import ConfigError
from labkit.launch import cluster, cluster_node
from labkit.launch.cluster import ClusterSpec, Link, check_machine, parse_link, run_cluster

pytestmark = pytest.mark.xdist_group("cluster")
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}


needs_namespaces = needs_namespaces_mark()  # tests/helpers.py: why it cannot, where it cannot


# ------------------------------------------------------------------ links and specs
@pytest.mark.unit
@pytest.mark.parametrize("text,rate,burst,name", [
    ("100mbit", 100_000_000, 65536, "100mbit"), ("1gbit", 10 ** 9, 250_000, "1gbit"),
    ("2.5gbit", 2_500_000_000, 625_000, "2500mbit"), ("10GBIT", 10 ** 10, 2_500_000, "10gbit"),
    ("500kbit", 500_000, 65536, "500kbit"), ("unshaped", 0, 0, "unshaped"),
    ("100mbit:5ms", 100_000_000, 65536, "100mbit:5ms")])
def test_a_link_is_its_rate_and_a_burst_of_at_least_2_ms(text, rate, burst, name):
    link = parse_link(text)
    assert (link.rate_bit, link.burst, str(link)) == (rate, burst, name)
    assert parse_link("1gbit", delay="500us") == Link(10 ** 9, 500)


@pytest.mark.unit
@pytest.mark.parametrize("text,says", [
    ("fast", "'fast' is no rate"), ("100mbps", "'100mbps' is no rate"), ("0mbit", "above 0"),
    ("-5mbit", "above 0"), ("0", "above 0"), ("", "no rate given"), ("100bit", "below 1kbit"),
    ("100mbit:soon", "'soon' is no delay"), ("100mbit:-1ms", "must not be negative")])
def test_a_bad_link_is_one_line(text, says):
    with pytest.raises(ConfigError, match=says) as e:
        parse_link(text)
    assert "\n" not in str(e.value)


@pytest.mark.unit
@pytest.mark.parametrize("nodes,ranks", [(0, 1), (-2, 1), (1.5, 1), (True, 1), (2, 0), ("2", 1)])
def test_a_bad_node_or_rank_count_is_one_line(nodes, ranks):
    with pytest.raises(ConfigError, match="must be a whole number from 1") as e:
        ClusterSpec(nodes, ranks)
    assert "\n" not in str(e.value)


@pytest.mark.unit
def test_each_node_is_a_node_of_labkits_multinode_path():
    from labkit.cli import build_parser

    spec = ClusterSpec(3, 2, parse_link("1gbit"))
    cmds = cluster.labkit_run_commands(spec, "ddp", ["--epochs", "1"], program=["labkit"])
    assert [c[-6:] for c in cmds] == [["--nnodes", "3", "--node-rank", str(k), "--rdzv-endpoint",
                                       "node0:29400"] for k in range(3)]
    assert all(c[c.index("--nproc") + 1] == "2" for c in cmds)
    build_parser().parse_args(cmds[1][1:])  # labkit run takes it


@pytest.mark.unit
def test_a_missing_tool_or_user_namespace_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(cluster_node, "SBIN", ())
    with pytest.raises(ConfigError, match="needs `unshare`, not found: apt-get install util-linux"):
        check_machine(ClusterSpec(2))
    (tmp_path / "kernel").mkdir()
    (tmp_path / "kernel" / "apparmor_restrict_unprivileged_userns").write_text("1\n")
    assert cluster.userns_hint(tmp_path).startswith(
        "kernel.apparmor_restrict_unprivileged_userns is 1; as root: sysctl -w "
        "kernel.apparmor_restrict_unprivileged_userns=0")
    (tmp_path / "kernel" / "unprivileged_userns_clone").write_text("0\n")
    assert "sysctl -w kernel.unprivileged_userns_clone=1" in cluster.userns_hint(tmp_path)


@pytest.mark.unit
def test_the_record_states_rate_burst_queue_and_delay(monkeypatch):
    monkeypatch.setattr(cluster, "netem_available", lambda: False)
    spec = ClusterSpec(2, 1, parse_link("1gbit"))
    g = cluster.Goodput([940.0, 950.0], [950.0, 940.0], "cubic")
    doc = cluster.link_record(spec, g)
    assert doc["burst_bytes"] == 250_000 and doc["queue"].startswith("tbf latency 20 ms")
    assert doc["delay"] == "delay not emulated on this kernel (no sch_netem)"
    assert doc["tcp_congestion_control"] == "cubic"
    assert doc["goodput_mbit"][0] == {"node": "node0", "up": 950.0, "down": 940.0}


# ------------------------------------------------------------------ on this machine
@needs_namespaces
@pytest.mark.e2e
def test_a_delay_without_netem_is_refused_before_anything_starts():
    spec = ClusterSpec(2, 1, parse_link("100mbit:5ms"))
    if cluster.netem_available():
        check_machine(spec)  # this kernel has sch_netem: a delay is fine
        return
    with pytest.raises(ConfigError, match="link delay 5ms needs sch_netem") as e:
        check_machine(spec)
    assert "\n" not in str(e.value)


SHOW = textwrap.dedent("""
    import socket, subprocess
    print("host", socket.gethostname(), socket.gethostbyname("node0"), socket.gethostbyname("node1"))
    print(subprocess.run(["tc", "qdisc", "show", "dev", "eth0"], capture_output=True, text=True).stdout)
    print("routes", subprocess.run(["ip", "-4", "route"], capture_output=True, text=True).stdout)
""")


@needs_namespaces
@pytest.mark.e2e
@pytest.mark.timeout(100)
def test_nodes_have_their_names_and_shaped_links_and_the_probe_measures_the_rate(tmp_path):
    spec = ClusterSpec(2, 1, parse_link("100mbit"))
    with no_leftovers():
        res = run_cluster(spec, [[sys.executable, "-c", SHOW]] * 2, tmp_path, probe_s=1.5,
                          timeout=40)
    assert res.ok, (res, [res.log(k).read_text() for k in range(2)])
    for k in range(2):
        log = res.log(k).read_text()
        assert f"host node{k} 198.18.0.1 198.18.0.2" in log
        assert "tbf 1: root" in log and "rate 100Mbit burst 64Kb lat 20ms" in log
        assert "default" not in log.split("routes", 1)[1]  # no route out
    g = res.goodput
    assert g.congestion_control and not g.errors
    # both ways at once, in one of two probes: a probe on a machine busy with another test's
    # ranks read 81-82 Mbit/s (a full suite's start, 2026-11-29), and a busy machine only ever
    # slows one; never above the rate
    if not all(90 <= v <= 100 for v in g.up_mbit + g.down_mbit):
        assert all(v <= 100 for v in g.up_mbit + g.down_mbit), g
        with no_leftovers():
            again = run_cluster(spec, [[sys.executable, "-c", "pass"]] * 2, tmp_path / "again",
                                probe_s=1.5, timeout=40)
        assert again.ok, again
        g = again.goodput
    assert all(90 <= v <= 100 for v in g.up_mbit + g.down_mbit), g


@needs_namespaces
@pytest.mark.e2e
@pytest.mark.timeout(60)
def test_a_failed_node_and_a_timeout_are_reported_and_leave_nothing(tmp_path):
    spec = ClusterSpec(2)
    fail = [sys.executable, "-c", "import sys; print('failing'); sys.exit(3)"]
    with no_leftovers():
        res = run_cluster(spec, [fail, ["true"]], tmp_path / "a", timeout=30)
    assert res.returncodes == [3, 0] and not res.ok and not res.error
    assert "failing" in res.log(0).read_text()
    t0 = time.monotonic()
    with no_leftovers():
        res = run_cluster(spec, [["sleep", "60"]] * 2, tmp_path / "b", timeout=2)
    assert res.timed_out and not res.ok and time.monotonic() - t0 < 10
    assert res.returncodes == [-signal.SIGINT] * 2  # stopped as by Ctrl-C, within the grace


LAUNCHER = textwrap.dedent("""
    import sys
    from labkit.launch.cluster import ClusterSpec, parse_link, run_cluster
    cmd = [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(300)",
           sys.argv[2]]
    run_cluster(ClusterSpec(2, 1, parse_link("100mbit")), [cmd, cmd], sys.argv[1])
""")


@needs_namespaces
@pytest.mark.e2e
@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["kill-9", "ctrl-c"])
def test_a_killed_or_interrupted_launcher_leaves_nothing(tmp_path, sig):
    marker = f"labkit-cluster-test-{uuid.uuid4().hex}"
    with no_leftovers(marker):
        p = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path), marker], cwd=ROOT)
        try:
            wait_for(lambda: all("started" in _text(tmp_path / f"node{k}.log") for k in range(2)), 30)
            assert len(processes(marker)) >= 4  # unshare, the switch, two nodes' commands
            p.send_signal(sig)
            p.wait(30)
        finally:
            p.kill()
            p.wait()
    if sig == signal.SIGINT:  # Ctrl-C reached every node's command
        assert all("KeyboardInterrupt" in _text(tmp_path / f"node{k}.log") for k in range(2))


ALLREDUCE = textwrap.dedent("""
    import statistics, sys, time
    import torch
    import torch.distributed as dist
    rank, world, nbytes = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group("gloo", init_method="tcp://node0:29500", rank=rank, world_size=world)
    x = torch.ones(nbytes // 4)
    dist.all_reduce(x)  # warm-up: gloo's connections
    times = []
    for _ in range(3):
        dist.barrier()
        t = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - t)
    algbw = 2 * (world - 1) / world * nbytes * 8 / statistics.median(times) / 1e6
    print(f"algbw_mbit={algbw:.1f}", flush=True)
    dist.destroy_process_group()
""")


CEILING_MBIT = 100 * 1448 / 1514 / (1 + 66 / (2 * 1514))


@needs_namespaces
@pytest.mark.e2e
@pytest.mark.timeout(90)
def test_gloo_allreduce_across_two_nodes_at_100mbit_runs_at_the_rate(tmp_path):
    """Algorithm bandwidth 2(n-1)/n x bytes / time, median of 3 all_reduces of 8 MiB.

    The most it can reach is the rate times TCP's share of a frame: 1448 payload bytes in a
    1514-byte frame (tbf meters the Ethernet frame), less the ACKs for the other direction's
    data, which share the link (a 66-byte ACK per two frames): 93.6 Mbit/s at 100mbit. The test
    allows 10% below that for the stall between gloo's two phases and a busy 2-core machine
    (CI measured 89.8 once, under the old bound of 90)."""
    spec = ClusterSpec(2, 1, parse_link("100mbit"))
    script = tmp_path / "allreduce.py"
    script.write_text(ALLREDUCE)
    cmds = [[sys.executable, str(script), str(k), "2", str(8 << 20)] for k in range(2)]
    with no_leftovers():
        res = run_cluster(spec, cmds, tmp_path / "logs", env=ONE_THREAD, timeout=70)
    logs = [res.log(k).read_text() for k in range(2)]
    assert res.ok, (res, logs)
    for log in logs:
        algbw = float(log.split("algbw_mbit=")[1].split()[0])
        assert 0.9 * CEILING_MBIT <= algbw <= 100, log


@needs_namespaces
@pytest.mark.torchrun
@pytest.mark.timeout(200)
def test_labkit_run_on_two_emulated_nodes_changes_time_not_results(tmp_path, ddp_run):
    """`labkit run ddp --emulate-nodes 2 --nproc 1 --link 1gbit`: the lab's multi-node path,
    one torchrun per node; its final parameters bit-identical to the same 2 ranks on one
    machine (conftest's ddp_run), its result file stating the link as set and as measured.
    1gbit, not 100mbit: resnet10_small's 20 MB a step took 1.6 s at 100mbit (22 s against 13 s
    for the run); the probe's own test holds 100mbit's rate."""
    out = tmp_path / "out"
    with no_leftovers():
        p = labkit(["run", "ddp", *TINY, "--emulate-nodes", 2, "--nproc", 1, "--link", "1gbit",
                    "--out", out], cwd=tmp_path, timeout=180)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert re.search(r"emulated cluster: 2 nodes x 1 rank\(s\), link 1gbit each way; measured "
                     r"node0 received [\d.]+ Mbit/s", p.stdout + p.stderr)
    doc = json.loads((out / "results_baseline_ddp.json").read_text())
    assert doc["world_size"] == 2 and doc["world"]["master_addr"] == "node0"
    # forked by the cluster's own warm process into node 0 (test_an_emulated_run_is_forked...)
    assert doc["timeline"]["started_by"] == "warm process", doc["timeline"]
    link = doc["link"]
    assert link["rate_bit"] == 1_000_000_000 and link["nodes"] == 2
    # as measured: never above the set rate; how far below it depends on the machine's load
    # (the probe's own test, with nothing beside it, holds it within 10% of the rate)
    assert all(0 < g["down"] <= 1001 and 0 < g["up"] <= 1001 for g in link["goodput_mbit"]), link
    assert link["tcp_congestion_control"] and "delay" in link
    mine = torch.load(out / "final_model.pt", weights_only=True)
    ref = torch.load(ddp_run / "final_model.pt", weights_only=True)
    assert mine.keys() == ref.keys()
    differ = [k for k in ref if not torch.equal(mine[k], ref[k])]
    assert not differ, f"the link changed parameters: {differ[:5]}"
    assert json.loads((out / "launch.json").read_text())["emulated"]["link"] == "1gbit"
    report = labkit(["report", out], cwd=tmp_path, timeout=120)
    assert report.returncode == 0, report.stderr[-2000:]
    assert ("Network: an emulated cluster of 2 nodes x 1 rank(s), each node's link 1gbit each way"
            in report.stdout), report.stdout[-3000:]


#: the tiny language model for a run whose training is not the point: 0.5 MB of gradients
LM = [*tiny_flags(dataset=None, image_size=None, model="tiny", max_steps_per_epoch=2,
                  max_val_steps=1), "--workload", "lm", "--seq-len", "32"]


def run_processes(*paths: Path) -> list[str]:
    """The processes working in, or naming, any of ``paths``: what a run there started (its
    forked agents and ranks name neither, but work in its directory)."""
    import psutil

    left = []
    for p in psutil.process_iter(["pid", "cmdline", "cwd"]):
        text = " ".join([p.info["cwd"] or "", *(p.info["cmdline"] or [])])
        if p.pid != os.getpid() and any(str(x) in text for x in paths):
            left.append(f"{p.pid} {text[:160]}")
    return left


@needs_namespaces
@pytest.mark.torchrun
@pytest.mark.timeout(150)
@pytest.mark.parametrize("stop", ["ctrl-c", "kill-9-warm"])
def test_an_emulated_run_is_forked_into_its_nodes_and_stopping_it_leaves_nothing(tmp_path, stop):
    """Every node's ranks are forked by the cluster's own warm process, each into its node's
    network namespace. While they train, Ctrl-C on `labkit run`: exit 130, the result file
    interrupted; or a kill -9 of the cluster's warm process: exit 1, one line naming it. Either
    way no process and no network namespace of the run is left, and the warm process's socket
    is gone with its folder."""
    tmp = Path(tempfile.mkdtemp(prefix="lk-", dir="/tmp"))  # short: the socket's path is in it
    out = tmp_path / "out"
    try:
        with no_leftovers():
            p = subprocess.Popen([sys.executable, "-m", "labkit", "run", "ddp", *LM, "--epochs",
                                  "1000", "--emulate-nodes", "2", "--nproc", "1", "--out",
                                  str(out)], cwd=tmp_path, env={**ONE_THREAD, "TMPDIR": str(tmp)},
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 start_new_session=True)
            try:
                wait_for(lambda: len(_epochs(out)) >= 2 or p.poll() is not None, 90)
                assert p.poll() is None, p.communicate()[0][-3000:]
                assert list(tmp.glob("labkit-warm-*/socket")), list(tmp.iterdir())
                ranks = forked_ranks(tmp_path)
                assert len(ranks) == 2, ranks
                assert all("--join-namespaces" in " ".join(r.parent().cmdline()) for r in ranks)
                nets = {os.readlink(f"/proc/{r.pid}/ns/net") for r in ranks}
                assert len(nets) == 2 and os.readlink("/proc/self/ns/net") not in nets, nets
                if stop == "ctrl-c":
                    os.killpg(p.pid, signal.SIGINT)  # in its terminal
                else:
                    ranks[0].parent().kill()
                said = p.communicate(timeout=60)[0]
            finally:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
        doc = json.loads((out / "results_baseline_ddp.json").read_text())
        assert doc["world"]["master_addr"] == "node0"
        if stop == "ctrl-c":
            assert p.returncode == 130, said[-3000:]
            assert doc["status"] == "interrupted", doc["status"]
        else:
            assert p.returncode == 1, said[-3000:]
            ended = [line for line in said.splitlines() if line.startswith("labkit: ddp failed")]
            assert len(ended) == 1 and "the warm process that forks" in ended[0], said[-3000:]
            assert "Traceback" not in said, said[-3000:]
            assert doc["status"] == "failed", doc["status"]
        wait_for(lambda: not run_processes(tmp_path, tmp), 15)
        assert run_processes(tmp_path, tmp) == []
        assert list(tmp.glob("labkit-warm-*")) == []  # the cluster's warm socket, and its folder
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def forked_ranks(cwd: Path) -> list:
    """The ranks working in ``cwd`` (not their thin clients)."""
    import psutil

    def module(argv: list[str]) -> str:  # what `python [-u] -m MODULE ...` runs (a forked
        words = " ".join(argv).split()  # process's title is one string: labkit.launch.warm)
        return next((b for a, b in zip(words, words[1:]) if a == "-m"), "")
    return [p for p in psutil.process_iter(["cmdline", "cwd"]) if p.info["cwd"] == str(cwd)
            and module(p.info["cmdline"] or []) == "labkit.train"]


def _epochs(out: Path) -> list:
    try:
        return json.loads((out / "results_baseline_ddp.json").read_text())["epochs"]
    except (OSError, ValueError, KeyError):
        return []


@pytest.mark.e2e
@pytest.mark.parametrize("args, says", [
    (["--emulate-nodes", 2, "--link", "fast"], "link rate 'fast' is no rate"),
    (["--emulate-nodes", 2, "--link", "0mbit"], "link rate must be above 0"),
    (["--emulate-nodes", -1], "cluster nodes must be a whole number"),
    (["--link", "100mbit"], "give --emulate-nodes N too"),
    (["--emulate-nodes", 2, "--link", "100mbit:5ms"], "needs sch_netem"),
], ids=["not-a-rate", "zero", "negative-nodes", "link-without-nodes", "delay"])
def test_bad_cluster_input_is_one_line_and_creates_nothing(tmp_path, args, says):
    if "sch_netem" in says and cluster.netem_available():
        pytest.skip("this kernel has sch_netem: a delay is not refused here")
    p = labkit(["run", "ddp", *TINY, "--nproc", 1, *args, "--runs-dir", tmp_path / "runs"],
               cwd=tmp_path, timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    errors = [l for l in p.stderr.splitlines() if l.strip()]
    assert len(errors) == 1 and says in errors[0], p.stderr
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


ROOTLESS = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, sys.argv[1])
    from labkit.launch.cluster import ClusterSpec, check_machine, parse_link, run_cluster
    spec = ClusterSpec(2, 1, parse_link("100mbit"))
    check_machine(spec)
    cmd = [sys.executable, "-c", "import socket; print('I am', socket.gethostname())"]
    res = run_cluster(spec, [cmd, cmd], sys.argv[2], probe_s=1.0, timeout=40)
    print("uid", os.getuid(), "ok", res.ok, "goodput", res.goodput.down_mbit)
""")


@needs_namespaces
@pytest.mark.e2e
@pytest.mark.timeout(60)
def test_the_rootless_path_works_for_an_unprivileged_user(tmp_path):
    """As nobody (uid 65534), from a copy of the code it can read (the checkout and the venv's Python
    may sit under a folder only root enters): the system Python, standard library only."""
    python = shutil.which("python3", path="/usr/bin:/bin")
    if os.geteuid() != 0 or not shutil.which("setpriv") or not python:
        pytest.skip("needs root (to become nobody), setpriv and a system python3")
    if subprocess.run([python, "-c", "import sys; sys.exit(sys.version_info < (3, 11))"]).returncode:
        pytest.skip(f"{python} is older than Python 3.11")
    root = Path(tempfile.mkdtemp(prefix="labkit-rootless-"))
    try:
        os.chmod(root, 0o755)
        shutil.copytree(ROOT / "labkit", root / "labkit", ignore=shutil.ignore_patterns(
            "__pycache__", "*.ipynb", "templates"))
        (root / "logs").mkdir(mode=0o777)
        os.chmod(root / "logs", 0o777)
        p = subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups",
                            "--reset-env", python, "-c", ROOTLESS, str(root), str(root / "logs")],
                           capture_output=True, text=True, timeout=50, cwd=root)
        if "ConfigError" in p.stderr:  # root may, an unprivileged user may not (AppArmor)
            pytest.skip(f"as an unprivileged user: {p.stderr.strip().splitlines()[-1]}")
        assert p.returncode == 0 and "ok True" in p.stdout, (p.stdout, p.stderr)
        assert p.stdout.split()[1] != "0"
        assert "I am node1" in (root / "logs" / "node1.log").read_text()
    finally:
        shutil.rmtree(root, ignore_errors=True)


# ------------------------------------------------------------------ nothing left
def processes(marker: str) -> list[str]:
    """`ps`'s lines whose command line holds ``marker``."""
    out = subprocess.run(["ps", "-ww", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    return [l for l in out.splitlines() if marker in l]


def net_namespaces() -> set[str]:
    """`lsns`'s network namespaces (those a process is in)."""
    out = subprocess.run(["lsns", "-J", "-t", "net"], capture_output=True, text=True).stdout
    return {str(n["ns"]) for n in json.loads(out or "{}").get("namespaces", [])}


class no_leftovers:
    """Around a run: afterwards (within a deadline: the kernel ends a PID namespace
    asynchronously) no network namespace it made and no process naming ``marker`` is left."""

    def __init__(self, marker: str = "cluster_node.py"):
        self.marker = marker

    def __enter__(self):
        self.before = net_namespaces()

    def __exit__(self, *exc):
        left = lambda: (net_namespaces() - self.before, processes(self.marker))
        wait_for(lambda: left() == (set(), []), 15)
        assert left() == (set(), []), left()


def wait_for(ok, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not ok() and time.monotonic() < deadline:
        time.sleep(0.1)


def _text(path: Path) -> str:
    return path.read_text() if path.exists() else ""
