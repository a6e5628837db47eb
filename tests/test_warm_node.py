"""A warm process (labkit.launch.warm: an experiment's, or `labkit warm`'s) and its thin client
(labkit.launch.warm_client): the forked process gets the client's arguments, environment,
directory and streams; the client ends as it did (code or signal), passes signals on, takes it
along when killed, and starts cold where no warm process answers. A warm process that imports
only the standard library: these are the protocol's checks; test_warm_agent.py trains under it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from helpers import labkit, start_labkit
from labkit.launch import warm
from labkit.launch.warm_client import encode

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("warm_node")]

SCRIPT = """import os, sys, time
print(os.environ["GREETING"], os.getcwd(), sys.argv[1:], flush=True)
print("to stderr", file=sys.stderr, flush=True)
what = sys.argv[1]
if what == "kill":
    os.kill(os.getpid(), 9)
if what == "sleep":
    time.sleep(60)
if what == "backend":
    import matplotlib
    print(matplotlib.rcParams["backend"], flush=True)
    what = "0"
if what == "tempdir":
    import tempfile
    print(tempfile.gettempdir(), flush=True)
    what = "0"
sys.exit(int(what))
"""


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mods")
    (folder / "warm_probe.py").write_text(SCRIPT)
    with warm.node(["json", "matplotlib"]) as address:
        yield address, folder


def _client(node, *args, **kw):
    address, folder = node
    env = dict(os.environ, LABKIT_WARM=address, GREETING="hello",
               PYTHONPATH=os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")]))
    return [sys.executable, "-m", "labkit.launch.warm_client", "-m", "warm_probe", *args], env


@pytest.mark.unit
def test_a_request_reads_back_as_it_was_sent():
    env = {"A": "1", "WITH_EQUALS": "x=y", "EMPTY": "", "ODD": "caf\udce9"}
    argv = ["-m", "labkit.train", "--resolved", "a b.json", ""]
    assert warm.decode(encode(argv, env, "/tmp/some where")) == {
        "cwd": "/tmp/some where", "argv": argv, "env": env, "needs": []}
    # what the process needs is the server's to read, not the process's
    needs = warm.decode(encode(argv, {**env, warm.NEEDS: "json,IPython.display"}, "/"))
    assert needs["needs"] == ["json", "IPython.display"] and needs["env"] == env


def test_the_forked_process_runs_with_the_clients_arguments_environment_and_streams(node, tmp_path):
    cmd, env = _client(node, "3")
    p = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert p.returncode == 3, p.stderr
    assert p.stdout == f"hello {tmp_path} ['3']\n" and p.stderr == "to stderr\n"
    assert _forked_pid(node, wait_s=0) is None  # nothing left forked once the client ended


def test_a_forked_process_killed_by_a_signal_ends_its_client_by_the_same(node, tmp_path):
    cmd, env = _client(node, "kill")
    p = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert p.returncode == -signal.SIGKILL, p.stderr


def test_signals_are_passed_on_and_a_killed_client_takes_its_process_along(node, tmp_path):
    cmd, env = _client(node, "sleep")
    for sig, code in ((signal.SIGTERM, -signal.SIGTERM), (signal.SIGKILL, -signal.SIGKILL)):
        p = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().startswith("hello")
        forked = psutil.Process(_forked_pid(node))
        assert "-m warm_probe sleep" in " ".join(forked.cmdline())  # its own command, in ps too
        p.send_signal(sig)
        assert p.wait(30) == code
        assert not psutil.wait_procs([forked], timeout=10)[1], "left running"


def test_a_module_that_read_the_environment_when_preloaded_follows_the_clients(node, tmp_path):
    """What the warm process imported read its environment then: the fork applies the client's
    where the module allows (matplotlib's backend: a Jupyter kernel's inline one;
    test_warm_agent trains under torch's threads)."""
    cmd, env = _client(node, "backend")
    for backend in ("svg", "pdf"):
        env["MPLBACKEND"] = backend
        p = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert p.returncode == 0 and p.stdout.splitlines()[-1] == backend, p.stderr
    # the temporary folder: matplotlib's import asked tempfile for it (cached from then on)
    cmd, env = _client(node, "tempdir")
    for name in ("a", "b"):
        env["TMPDIR"] = str(tmp_path / name)
        (tmp_path / name).mkdir()
        p = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert p.returncode == 0 and p.stdout.splitlines()[-1] == str(tmp_path / name), p.stderr


def test_a_request_that_names_what_it_needs_is_forked_while_the_rest_is_imported(tmp_path):
    """A notebook's kernel needs IPython, not torch: a request naming its modules in
    LABKIT_WARM_NEEDS is forked once they are imported, between two modules of the preload
    (here two that take 3 s each), not after all of it; one that names nothing waits for all of
    it. Neither process sees the variable."""
    folder = tmp_path / "mods"
    folder.mkdir()
    for slow in ("slow_a", "slow_b"):
        (folder / f"{slow}.py").write_text("import time\ntime.sleep(3)\n")
    (folder / "what_is_in.py").write_text(
        "import os, sys\nprint('slow_b' in sys.modules, os.environ.get('LABKIT_WARM_NEEDS'))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")]))
    env.pop("LABKIT_WARM", None)
    address = str(tmp_path / "socket")
    server = subprocess.Popen([sys.executable, "-m", "labkit.launch.warm", address, "json",
                               "slow_a", "slow_b"], stdin=subprocess.PIPE, env=env)
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(address) and time.monotonic() < deadline:
            time.sleep(0.01)
        cmd = [sys.executable, "-m", "labkit.launch.warm_client", "-m", "what_is_in"]
        early = subprocess.Popen(cmd, env=dict(env, LABKIT_WARM=address, LABKIT_WARM_NEEDS="json"),
                                 stdout=subprocess.PIPE, text=True)
        late = subprocess.Popen(cmd, env=dict(env, LABKIT_WARM=address), stdout=subprocess.PIPE,
                                text=True)
        assert early.communicate(timeout=60)[0] == "False None\n"  # forked before slow_b
        assert late.communicate(timeout=60)[0] == "True None\n"
    finally:
        server.stdin.close()
        server.wait(30)


def test_ready_waits_for_the_preload_and_its_marker_goes_with_the_process(tmp_path, monkeypatch):
    """warm.ready(), where labkit experiment waits before its first method (so no method's wall
    time holds the shared imports): it returns once the preload is imported (a module taking
    2 s here), not before; the marker it reads beside the socket goes with the warm process."""
    (tmp_path / "slow_c.py").write_text("import time\ntime.sleep(2)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.delenv("LABKIT_WARM", raising=False)  # not the worker's (conftest): one of its own
    with warm.node(["slow_c"]) as address:
        marker = os.path.join(os.path.dirname(address), warm.READY)
        assert not os.path.exists(marker)
        assert warm.ready() >= 1.0 and os.path.exists(marker)
        assert warm.ready() < 0.5  # ready now: no second wait
    assert not os.path.exists(marker) and not os.path.exists(os.path.dirname(address))


def test_without_a_warm_process_the_client_starts_cold_and_says_so(node, tmp_path):
    cmd, env = _client(node, "0")
    env["LABKIT_WARM"] = str(tmp_path / "no-socket")
    p = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.startswith("hello")
    assert p.stderr.splitlines()[0].startswith("labkit: note: no warm process answers at")


def test_the_warm_process_ends_with_its_owner(tmp_path, monkeypatch):
    monkeypatch.delenv("LABKIT_WARM", raising=False)  # not the worker's (conftest): one of its own
    before = os.environ.get("LABKIT_WARM")
    with warm.node([]) as address:
        server = [c for c in psutil.Process().children() if address in " ".join(c.cmdline())]
        assert len(server) == 1 and os.environ["LABKIT_WARM"] == address
    assert not psutil.wait_procs(server, timeout=10)[1]
    assert os.environ.get("LABKIT_WARM") == before and not os.path.exists(address)


def test_a_node_under_a_warm_process_is_served_by_it(tmp_path, monkeypatch, capfd):
    """An experiment started under `labkit warm` (or any process with LABKIT_WARM naming one
    that answers) uses that one: node() starts and stops nothing, and leaves LABKIT_WARM as it
    was. The server takes the probe's empty connection without a word. A socket file whose
    process was killed does not answer."""
    monkeypatch.delenv("LABKIT_WARM", raising=False)
    def servers() -> list:
        return [c.pid for c in psutil.Process().children()
                if "labkit.launch.warm" in " ".join(c.cmdline())]

    with warm.node([]) as outer:
        before = servers()
        with warm.node(["json"]) as inner:
            assert inner == outer and servers() == before, (before, servers())
        assert os.environ["LABKIT_WARM"] == outer and warm.answers(outer)
    assert "bad request" not in capfd.readouterr().err
    import socket

    stale = str(tmp_path / "socket")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(stale)  # the file stays; nobody listens
    assert os.path.exists(stale) and not warm.answers(stale) and not warm.answers("")


# the command `labkit warm` runs: says where its warm process is and whether it answers, then
# waits to be stopped, and ends with 3 when SIGTERM comes (passed on by labkit warm)
WAITER = """import os, signal, sys, time
from labkit.launch import warm
address = os.environ["LABKIT_WARM"]
signal.signal(signal.SIGTERM, lambda *_: sys.exit(3))
print(address, warm.answers(address), flush=True)
time.sleep(60)
"""


def test_labkit_warm_runs_a_command_beside_its_warm_process(tmp_path, monkeypatch):
    """`labkit warm -- COMMAND`: COMMAND finds LABKIT_WARM naming a warm process that answers
    (what it launches forks there); a SIGTERM to labkit warm reaches COMMAND, labkit warm ends
    with COMMAND's exit code, and its warm process and socket are gone. Without a command, or
    with one that does not exist: one line, exit 2."""
    monkeypatch.delenv("LABKIT_WARM", raising=False)  # not the worker's: one of its own
    proc = start_labkit(["warm", "--", sys.executable, "-c", WAITER], tmp_path)
    try:
        address, answered = proc.stdout.readline().split()
        assert answered == "True"
        server = [c for c in psutil.Process(proc.pid).children() if address in c.cmdline()]
        assert len(server) == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 3
    finally:
        proc.kill()
    assert not psutil.wait_procs(server, timeout=10)[1] and not os.path.exists(address)
    for argv, says in (([], "give the command to run"), (["--", "no-such-program-x"],
                                                         "cannot run 'no-such-program-x'")):
        p = labkit(["warm", *argv], cwd=tmp_path)
        assert p.returncode == 2 and says in p.stderr, p.stderr
        assert len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_a_warm_process_whose_owner_was_killed_ends_and_leaves_no_socket(tmp_path):
    """The owner's pipe closed without node()'s clean-up (a kill -9 of the experiment): the
    server stops, removes its socket and folder itself, and exits."""
    address = str(tmp_path / "warm" / "socket")
    os.mkdir(os.path.dirname(address))
    server = subprocess.Popen([sys.executable, "-m", "labkit.launch.warm", address],
                              stdin=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while not os.path.exists(address) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert os.path.exists(address)
    server.stdin.close()
    assert server.wait(15) == 0
    assert not os.path.exists(os.path.dirname(address))


def _reaches(pid: int, status: str, wait_s: float = 10.0) -> bool:
    """Whether process ``pid`` is in ``status`` (psutil's) within ``wait_s``."""
    end = time.monotonic() + wait_s
    while psutil.Process(pid).status() != status:
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def _forked_pid(node, wait_s: float = 5.0):
    """The one process the module's warm process has forked now, else None."""
    address, _ = node
    server = [c for c in psutil.Process().children() if address in " ".join(c.cmdline())][0]
    end = time.monotonic() + wait_s
    while True:
        kids = [c.pid for c in server.children() if c.status() != psutil.STATUS_ZOMBIE]
        if kids or time.monotonic() > end:
            return kids[0] if kids else None
        time.sleep(0.05)


@pytest.mark.unit
def test_nothing_a_client_runs_as_main_is_imported_before_the_fork():
    """runpy warns ("found in sys.modules ... prior to execution") when the module it runs as
    __main__ was imported already: the warm process preloads none of the modules the launcher
    and the agent run that way (the warning reached an experiment's output once)."""
    from labkit.launch.agent import AGENT, PRELOAD

    entries = {"labkit.launch.agent", "labkit.train", "labkit.bench.bench_rank"}
    assert not entries & set(PRELOAD + AGENT)


def test_bad_input_to_the_client_and_the_server_is_one_line(tmp_path):
    client = subprocess.run([sys.executable, "-m", "labkit.launch.warm_client"], capture_output=True,
                            text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert client.returncode == 1 and client.stderr.startswith("usage:"), client.stderr
    server = subprocess.run([sys.executable, "-m", "labkit.launch.warm", str(tmp_path / "no" / "s")],
                            capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert server.returncode == 2 and server.stderr.count("\n") == 1, server.stderr
    assert "cannot listen on" in server.stderr


def test_the_labkit_program_relays_to_a_warm_process_that_fits_it(tmp_path):
    """`labkit COMMAND` where LABKIT_WARM names a warm process that answers (`labkit warm`'s):
    it sends ``-m labkit COMMAND ...`` with its directory and environment, passes on the
    signals it gets, but not one it ignores (``nohup``'s SIGHUP), stops and goes on with the
    command (Ctrl-Z, then fg), and exits with the forked command's code. Under ``nice`` (or another labkit, namespace, cgroup, CPU set, resource
    limits) it runs in place instead. A stand-in warm process here (this test): it answers with
    the pid of a process of the test's own, which shows what was passed on."""
    import socket
    import struct

    from labkit.launch.warm_client import WHOSE, identity

    address = str(tmp_path / "socket")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(1)
    listener.settimeout(30)
    (tmp_path / WHOSE).write_text(identity())
    stand_in = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    env = dict(os.environ, LABKIT_WARM=address)

    def start(*wrap):  # a process group of its own, in this session: as a shell's job
        return subprocess.Popen([*wrap, sys.executable, "-m", "labkit", "runs", "somewhere"],
                                cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, process_group=0)

    client, fds = start("nohup"), []  # SIGHUP ignored, as nohup leaves it; SIGUSR1 as it is
    try:
        conn, _ = listener.accept()
        head, fds, _, _ = socket.recv_fds(conn, 8, 3)
        body = b""
        while len(body) < struct.unpack("!Q", head)[0]:
            body += conn.recv(65536)
        request = warm.decode(body)
        assert request["argv"] == ["-m", "labkit", "runs", "somewhere"]
        assert request["cwd"] == str(tmp_path) and request["env"]["LABKIT_WARM"] == address
        conn.sendall(f"pid {stand_in.pid}\n".encode())
        client.send_signal(signal.SIGHUP)  # ignored: not passed on
        time.sleep(0.5)
        assert stand_in.poll() is None
        # Ctrl-Z: the process stops with the program, and goes on when the shell continues it
        # (the kernel stops the program only where its process group is not orphaned, as a
        # shell's job is not: here the parent, this test, is in another group of the session)
        client.send_signal(signal.SIGTSTP)
        assert _reaches(stand_in.pid, psutil.STATUS_STOPPED)
        assert _reaches(client.pid, psutil.STATUS_STOPPED)
        client.send_signal(signal.SIGCONT)
        assert _reaches(stand_in.pid, psutil.STATUS_SLEEPING)
        client.send_signal(signal.SIGUSR1)
        assert stand_in.wait(10) == -signal.SIGUSR1
        conn.sendall(f"exit {3 << 8}\n".encode())  # the forked command's wait status
        conn.close()
        assert client.wait(10) == 3
        niced = start("nice", "-n", "5")  # connects, compares, closes, runs here
        probe, _ = listener.accept()
        probe.settimeout(30)
        assert probe.recv(1) == b""  # asked nothing
        _, err = niced.communicate(timeout=30)
        assert niced.returncode == 2 and "is not a folder of runs" in err, err
    finally:
        for p in (client, stand_in):
            p.kill()
        for fd in fds:
            os.close(fd)
        listener.close()


def test_a_process_unlike_the_warm_process_is_not_served(node, monkeypatch):
    """warm_client.fits: a process whose forks from the warm process would not run as its own
    children would (another niceness, CPU set, resource limits, mount namespace, Slurm job,
    another interpreter environment or labkit) is told what differs, and labkit runs it in place
    (the program, a launch's agent, an experiment's kernels)."""
    from labkit.launch import warm_client

    address, _ = node
    probe = ("import sys; from labkit.launch.warm_client import fits; "
             "print(fits(sys.argv[1])[1] or 'fits')")
    wraps = {(): "fits", ("nice", "-n", "3"): "its niceness",
             ("prlimit", "--nofile=512:512"): "its limits",
             ("unshare", "--mount"): "its mnt namespace"}
    if len(os.sched_getaffinity(0)) > 1:
        wraps[("taskset", "-c", "0")] = "its Cpus_allowed_list"
    wraps[("env", "SLURM_JOB_ID=12")] = "its Slurm job"  # a job's processes stay in the job
    for wrap, says in wraps.items():
        p = subprocess.run([*wrap, sys.executable, "-c", probe, address], capture_output=True,
                           text=True, timeout=60)
        if wrap[:1] == ("unshare",) and p.returncode != 0:
            continue  # no mount namespace for this user here
        assert p.returncode == 0 and p.stdout.strip().endswith(says), (wrap, p.stdout, p.stderr)
    assert warm.answers(address)
    monkeypatch.setattr(warm_client, "identity", lambda: "another venv\n")
    sock, why = warm_client.fits(address)
    assert sock is None and why.endswith("another interpreter environment or labkit"), why
    assert not warm.answers(address)
    assert warm.through([sys.executable, "-m", "labkit.train"], {"LABKIT_WARM": address}) == [
        sys.executable, "-m", "labkit.train"]  # the launch starts its agent cold
