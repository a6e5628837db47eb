"""Issue 29: slurm/labkit.sbatch and `labkit sweep --slurm` submitted to a real Slurm.

The tests start their own cluster (the `cluster` fixture): munged, slurmctld and two slurmd,
Debian's slurm-wlm, in a temporary folder, with a slurm.conf generated for this host. The two
node daemons (node1, node2; `slurmd -N`, each on its own port) run on this one host, with the
host's CPU count each and no GPUs, so a job on two nodes runs torchrun's c10d rendezvous through
Slurm for real, over loopback. Everything stops at the end of the session, whatever happened:
the jobs are cancelled, the daemons killed by pid, and any process left with this cluster's
SLURM_CONF in its environment (a job's, a slurmstepd) is killed too.

Without Slurm (a laptop) or without root, the tests skip, saying how to install it; CI runs
`make test`, whose slurm-deps target installs slurm-wlm and munge first.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from helpers import ROOT, TINY, free_port, load_json, rank_of

pytestmark = [pytest.mark.xdist_group("slurm")]  # one worker owns the daemons

SBATCH = ROOT / "slurm" / "labkit.sbatch"
LABKIT = str(Path(sys.executable).parent / "labkit")
RESULT = {"ddp": "results_baseline_ddp.json", "allreduce": "results_all_reduce.json",
          "ps": "results_ps.json"}
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
INSTALL = "sudo apt-get install -y slurm-wlm munge (or `make slurm-deps` as root)"
HTML_ONLY = {"LABKIT_CHROMIUM": "/nonexistent/chromium"}  # sweep report: HTML, no PDF


def which(name: str) -> str | None:
    """A command on PATH, or in the sbin folders where Debian puts the daemons (a user's PATH
    may lack them)."""
    return shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]))


def pids_with(entry: str, exclude: int = -1) -> list[int]:
    """Processes whose environment holds ``entry`` (e.g. SLURM_JOB_ID=12)."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) in (os.getpid(), exclude):
            continue
        try:
            if entry.encode() in (d / "environ").read_bytes().split(b"\0"):
                found.append(int(d.name))
        except OSError:
            pass
    return found


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
    except OSError:
        return "(gone)"


def _is_rank(pid: int) -> bool:
    """A training rank: under torch's torchrun, or forked warm by labkit's agent (helpers.rank_of)."""
    import psutil

    try:
        return rank_of(psutil.Process(pid)) is not None
    except psutil.Error:
        return False


class Cluster:
    """A running test cluster: its folder, slurm.conf and the environment its clients need."""

    def __init__(self, root: Path):
        self.root, self.conf = root, root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.daemons: list[subprocess.Popen] = []

    def run(self, *cmd: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout)

    def start(self, name: str, *cmd: str) -> None:
        log = open(self.root / "log" / f"{name}.console", "w")
        self.daemons.append(subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                             start_new_session=True))
        log.close()

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n" + p.read_text(errors="replace")[-1500:]
                         for p in sorted((self.root / "log").iterdir()))

    def sbatch(self, args: list[str], cwd: Path, env: dict | None = None) -> str:
        proc = subprocess.run(["sbatch", "--parsable", *args], cwd=cwd, capture_output=True,
                              text=True, timeout=60, env={**self.env, **(env or {})})
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip().split(";")[0]

    def job(self, job: str) -> dict:
        """scontrol's record of a job (kept MinJobAge=600 s after it ends)."""
        out = self.run("scontrol", "show", "job", "-o", job).stdout.splitlines()
        return dict(f.split("=", 1) for f in (out[0].split() if out else []) if "=" in f)

    def wait(self, job: str, timeout: float = 150) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = self.job(job)
            if st.get("JobState") in ENDED:
                return st
            time.sleep(0.5)
        self.run("scancel", job)
        pytest.fail(f"Slurm job {job} did not end within {timeout:.0f}s: {self.job(job)}")

    def stop(self) -> None:
        """Jobs first (their slurmstepd would outlive slurmd), then the daemons, by pid."""
        try:
            if self.daemons:
                self.run("scancel", "--user", "root", timeout=30)
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline and self.run(
                        "squeue", "-h", timeout=30).stdout.strip():
                    time.sleep(0.5)
        except (OSError, subprocess.SubprocessError):
            pass
        for p in reversed(self.daemons):
            if p.poll() is None:
                p.terminate()
        for p in reversed(self.daemons):
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for pid in pids_with(f"SLURM_CONF={self.conf}"):  # anything the cluster left behind
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def slurm_conf(root: Path, cpus: int, ports: list[int], nodes: list[str]) -> str:
    host = socket.gethostname()
    lines = [
        "ClusterName=labkittest", f"SlurmctldHost={host}(127.0.0.1)", f"SlurmctldPort={ports[0]}",
        "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge", "CredType=cred/munge",
        f"AuthInfo=socket={root / 'munge' / 'munge.socket'}",
        f"StateSaveLocation={root / 'state'}", f"SlurmdSpoolDir={root / 'spool'}-%n",
        f"SlurmctldPidFile={root / 'slurmctld.pid'}", f"SlurmdPidFile={root / 'slurmd'}-%n.pid",
        f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
        f"SlurmdLogFile={root / 'log' / 'slurmd'}-%n.log",
        # no cgroups in a container: processes tracked through their parents, no task binding
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU", "ReturnToService=2",
        "MpiDefault=none", "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none", "JobCompType=jobcomp/none",
        "SchedulerType=sched/builtin", "KillWait=5", "MinJobAge=600", "InactiveLimit=0",
        "SlurmdTimeout=60", "SlurmctldTimeout=60",
    ]
    lines += [f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={p} CPUs={cpus} "
              f"State=UNKNOWN" for n, p in zip(nodes, ports[1:])]
    lines.append(f"PartitionName=debug Nodes={','.join(nodes)} Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


def _munge(c: Cluster) -> None:
    m = c.root / "munge"
    m.mkdir(mode=0o700)
    key = m / "munge.key"
    if which("mungekey"):
        subprocess.run([which("mungekey"), "-c", "-k", str(key)], check=True, capture_output=True)
    else:  # older munge: a key of random bytes does as well
        key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    c.start("munged", which("munged"), "-F", "--force", f"--socket={m / 'munge.socket'}",
            f"--key-file={key}", f"--log-file={c.root / 'log' / 'munged.log'}",
            f"--pid-file={m / 'munged.pid'}", f"--seed-file={m / 'munged.seed'}")
    deadline = time.monotonic() + 20
    while not (m / "munge.socket").exists():
        assert time.monotonic() < deadline, "munged did not start:\n" + c.logs()
        time.sleep(0.2)


@pytest.fixture(scope="session")
def cluster():
    """munged, slurmctld and two slurmd (node1, node2) on this host, for the session."""
    missing = [d for d in ("munged", "slurmctld", "slurmd", "sbatch") if which(d) is None]
    if missing:
        pytest.skip(f"Slurm is not installed ({', '.join(missing)} not found): {INSTALL}")
    if os.geteuid() != 0:
        pytest.skip("the Slurm tests start munged, slurmctld and slurmd as root (CI runs as root)")
    nodes = ["node1", "node2"]
    for attempt in range(3):  # the daemons' ports, free when asked, may be taken before they bind
        c = Cluster(Path(tempfile.mkdtemp(prefix="labkit-slurm-")))
        try:
            if _start_cluster(c, nodes):
                break
        except BaseException:
            c.stop()
            shutil.rmtree(c.root, ignore_errors=True)
            raise
        c.stop()
        shutil.rmtree(c.root, ignore_errors=True)
    else:
        pytest.fail("three times a Slurm daemon's port was taken before it could bind it")
    try:
        yield c
    finally:
        c.stop()
        shutil.rmtree(c.root, ignore_errors=True)


def _start_cluster(c: Cluster, nodes: list[str]) -> bool:
    """munged, slurmctld and the slurmd up, each node idle: True; False when a daemon exited
    because its port was in use (taken between free_port and its bind: try new ports)."""
    for d in ("log", "state"):
        (c.root / d).mkdir()
    c.conf.write_text(slurm_conf(c.root, os.cpu_count() or 1, [free_port() for _ in range(3)], nodes))
    _munge(c)
    c.start("slurmctld", which("slurmctld"), "-D", "-i", "-f", str(c.conf))
    for n in nodes:
        c.start(f"slurmd-{n}", which("slurmd"), "-D", "-f", str(c.conf), "-N", n)
    deadline = time.monotonic() + 60
    while c.run("sinfo", "-h", "-N", "-o", "%N %T").stdout.split() != [
            w for n in nodes for w in (n, "idle")]:
        if any(d.poll() is not None for d in c.daemons) and "Address already in use" in c.logs():
            return False
        assert time.monotonic() < deadline, "the nodes did not come up:\n" + c.logs()
        time.sleep(0.5)
    return True


def no_process_left(job: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while (left := pids_with(f"SLURM_JOB_ID={job}")) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, [cmdline(p) for p in left]


def submit_script(cluster: Cluster, cwd: Path, method: str, extra=(), env=None) -> str:
    return cluster.sbatch([str(SBATCH)], cwd, {
        "METHOD": method, "LABKIT": LABKIT, "RDZV_PORT": str(free_port()),
        "LABKIT_ARGS": " ".join([*TINY, *extra]), **(env or {})})


def port_taken(log: str) -> bool:
    """Whether the job failed because its rendezvous port, free when the test took it, was
    taken by another process before the first node bound it."""
    return "EADDRINUSE" in log or "Address already in use" in log


def job_ended(cluster: Cluster, cwd: Path, job: str, method: str, extra=(), env=None,
              tries: int = 3) -> tuple[str, dict, str]:
    """Wait for the sbatch job ``job``: (job, its state, its log). A job whose rendezvous port
    was taken meanwhile runs again on a new port (submit_script takes one), up to ``tries``."""
    for _ in range(tries):
        st = cluster.wait(job)
        log = (cwd / f"labkit-{job}.out").read_text()
        if st["JobState"] == "COMPLETED" or not port_taken(log):
            break
        job = submit_script(cluster, cwd, method, extra, env)
    return job, st, log


def show(record_property, line: str) -> None:
    """A job's state as Slurm recorded it, printed and kept with the test's report, so the
    suite's summary lists every job's state (conftest.pytest_terminal_summary), in CI too."""
    print(line)
    record_property("slurm", line)


# ------------------------------------------------------------------ the sbatch script
@pytest.mark.slow
def test_the_sbatch_script_runs_each_method_on_two_nodes(cluster, tmp_path, record_property):
    """All three at once (the two nodes fit two jobs of one CPU per node; the third waits)."""
    jobs = {m: submit_script(cluster, tmp_path, m) for m in RESULT}
    for m, job in jobs.items():
        job, st, log = job_ended(cluster, tmp_path, job, m)
        show(record_property, f"{m}: Slurm job {job} JobState={st['JobState']} ExitCode={st['ExitCode']} "
              f"NodeList={st['NodeList']} RunTime={st['RunTime']}")
        assert (st["JobState"], st["ExitCode"]) == ("COMPLETED", "0:0"), log[-3000:]
        assert (st["NumNodes"], st["NodeList"]) == ("2", "node[1-2]"), st
        out = tmp_path / "runs" / f"slurm-{job}_{m}"
        assert f"labkit: {m} on 2 nodes (node[1-2]), 1 rank(s) per node, 1 CPU(s) per node, " \
               f"1 thread(s) per rank, rendezvous 127.0.0.1:" in log, log
        for k in (0, 1):  # every node's own output, each line labelled with its task by srun
            assert re.search(rf"^{k}: labkit: {m} finished in \d+s; results in {re.escape(str(out))}$",
                             log, re.M), log
            assert (out / "logs" / f"node{k}" / "torchrun.log").exists()
        doc = load_json(out / RESULT[m])
        assert (doc["status"], doc["world_size"], doc["method_key"]) == ("completed", 2, m)
        no_process_left(job)


@pytest.mark.slow
def test_a_failing_method_fails_the_job_with_labkits_line(cluster, tmp_path, record_property):
    """Rank 1 (on either node) crashes at step 1: srun's --kill-on-bad-exit ends the other
    node, the job fails, and its log holds labkit's one line naming the rank."""
    fault = {"LABKIT_TEST_FAULT": "ddp:1:1"}
    job, st, log = job_ended(cluster, tmp_path, submit_script(cluster, tmp_path, "ddp", env=fault),
                             "ddp", env=fault)
    show(record_property, f"Slurm job {job} JobState={st['JobState']} ExitCode={st['ExitCode']}")
    assert st["JobState"] == "FAILED" and st["ExitCode"] != "0:0", (st, log[-3000:])
    # where it raised: the fault's hook (tests/hooks/sitecustomize.py), the innermost frame
    # outside labkit and the libraries
    said = re.findall(r"^[01]: labkit: ddp failed: rank 1 exited with code 1 at \S+/sitecustomize"
                      r"\.py:\d+ \(_fail\) \(logs: .*\)$", log, re.M)
    assert len(said) == 1, log
    assert "injected fault (LABKIT_TEST_FAULT) at step 1" in log
    assert "Traceback" not in log.split("labkit: ddp failed")[-1]
    no_process_left(job)


@pytest.mark.slow
def test_scancel_stops_every_rank(cluster, tmp_path, record_property):
    job = submit_script(cluster, tmp_path, "allreduce", ["--epochs", "200"])
    deadline = time.monotonic() + 90
    ranks: list[int] = []
    while len(ranks) < 2:  # both ranks training, one per node
        assert time.monotonic() < deadline, cluster.job(job)
        time.sleep(0.5)
        if cluster.job(job).get("JobState") in ENDED:  # its rendezvous port was taken: again
            assert port_taken((tmp_path / f"labkit-{job}.out").read_text()), cluster.job(job)
            job = submit_script(cluster, tmp_path, "allreduce", ["--epochs", "200"])
        ranks = [p for p in pids_with(f"SLURM_JOB_ID={job}") if _is_rank(p)]
    assert len(pids_with(f"SLURM_JOB_ID={job}")) >= 6  # batch shell, srun, 2 x (labkit, torchrun, rank)
    assert cluster.run("scancel", job).returncode == 0
    st = cluster.wait(job, 60)
    show(record_property, f"Slurm job {job} after scancel: JobState={st['JobState']}")
    assert st["JobState"] == "CANCELLED", st
    no_process_left(job)


# ------------------------------------------------------------------ labkit sweep --slurm
def labkit_cmd(args: list[str], cwd: Path, env: dict, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "labkit", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=kw.get("timeout", 60), env=env)


@pytest.mark.slow
def test_sweep_on_slurm_is_one_job_per_point_and_ends_with_the_sweep_report(cluster, tmp_path,
                                                                           record_property):
    """nproc=2,3: two jobs of one array, at once on the two nodes; rank 2, which only the
    nproc=3 point has, crashes: that point is reported failed, the other kept and reported."""
    from labkit.runs import runs_index

    env = {**cluster.env, **HTML_ONLY, "LABKIT_TEST_FAULT": "ddp:2:1"}
    cmd = [sys.executable, "-m", "labkit", "sweep", "nproc=2,3", "--methods", "ddp", "--no-report",
           *TINY, "--runs-dir", "runs", "--slurm"]
    with open(tmp_path / "sweep.txt", "w") as f:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=f, stderr=subprocess.STDOUT)
    seen = set()  # `labkit runs` while the jobs run: each point's state, from its own folder
    try:
        while proc.poll() is None:
            for row in runs_index.scan(tmp_path / "runs"):
                seen.add(row.jobs)
            time.sleep(0.5)
        proc.wait(240)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = (tmp_path / "sweep.txt").read_text()
    root = (tmp_path / "runs" / "latest").resolve()
    assert proc.returncode == 1, text[-3000:]  # a point failed
    doc = load_json(root / "sweep.json")
    array = doc["slurm"]["array_job"]
    print(text[:text.index("\nsweep folder")])
    for k in (0, 1):
        st = cluster.job(f"{array}_{k}")
        show(record_property, f"Slurm job {array}_{k}: JobState={st['JobState']} ExitCode={st['ExitCode']}")
    gathered = cluster.job(doc["slurm"]["gather_job"])["JobState"]
    show(record_property, f"gather job {doc['slurm']['gather_job']}: JobState={gathered}")
    assert gathered == "COMPLETED"  # it gathered, and wrote the report: a point's failure is not its own
    two, three = doc["points"]
    assert (two["name"], two["job"], two["status"], two["slurm_state"]) == (
        "nproc-2", f"{array}_0", "completed", "COMPLETED"), two
    assert (three["name"], three["job"], three["status"], three["slurm_state"]) == (
        "nproc-3", f"{array}_1", "failed", "FAILED"), three
    assert "rank 2" in three["error"], three
    assert load_json(root / "nproc-2" / "ddp" / RESULT["ddp"])["world_size"] == 2
    assert f"sweep: point nproc-2 (Slurm job {array}_0): RUNNING" in text
    assert "sweep report: report/sweep.html" in text and doc["status"] == "failed"
    html = (root / "report" / "sweep.html").read_text()
    assert "Table 7. Scaling efficiency" in html
    assert (root / "report" / "scaling.png").exists()
    # labkit runs: while the jobs ran, and after the gathering
    assert any(f"{array}_0 nproc-2 running" in s for s in seen), seen
    rows = json.loads(labkit_cmd(["runs", "runs", "--json"], tmp_path, env).stdout)
    assert [(r["kind"], r["status_label"]) for r in rows] == [("sweep", "failed")]
    assert rows[0]["jobs"] == (f"{array}_0 nproc-2 complete (Slurm: COMPLETED), "
                               f"{array}_1 nproc-3 failed (Slurm: FAILED)")


def in_process(argv: list[str], capsys) -> tuple[int, str]:
    """`labkit ARGV` in this process (no interpreter to start): exit code, stderr."""
    from labkit.cli import main

    code = main(argv)
    return code, capsys.readouterr().err


@pytest.mark.slow
def test_sweep_on_slurm_refused_by_the_controller_is_one_line_and_no_folder(cluster, tmp_path,
                                                                            monkeypatch, capsys):
    monkeypatch.setenv("SLURM_CONF", str(cluster.conf))
    runs = tmp_path / "runs"
    code, err = in_process(["sweep", "nproc=2", "--methods", "ddp", *TINY, "--runs-dir", str(runs),
                            "--slurm", "--sbatch-args=--partition=nope"], capsys)
    assert code == 2, err
    assert err.strip() == ("labkit sweep: error: sbatch refused the sweep's jobs: "
                           "allocation failure: Invalid partition name specified"), err
    assert not runs.exists() or not list(runs.iterdir())


def test_sweep_slurm_without_sbatch_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))  # no Slurm commands on it
    runs = tmp_path / "runs"
    for argv, said in (
            (["nproc=2", "--slurm"], "labkit sweep: error: --slurm needs Slurm's sbatch, squeue, "
                                     "scontrol on PATH (not found)"),
            (["nproc=2", "--sbatch-args=--time=5"], "labkit sweep: error: --sbatch-args goes "
                                                    "with --slurm")):
        code, err = in_process(["sweep", *argv, "--runs-dir", str(runs)], capsys)
        assert code == 2 and err.startswith(said), err
        assert len(err.strip().splitlines()) == 1 and not runs.exists()
