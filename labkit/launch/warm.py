"""A warm process shared by a whole experiment: torch, labkit, the workload's modules and a
notebook kernel's imported once, then a fork for every notebook kernel, torchrun agent and rank
that asks (``labkit experiment`` starts one for its methods and report and stops it at its end;
labkit.orchestrate.kernels runs the kernels through it).

    with warm.node(preload_for_workload("images")):   # LABKIT_WARM names its socket meanwhile
        launch(...)                                    # agent and ranks forked, not started

labkit.launch.agent alone keeps a fork server per launch (its own child, Python's
multiprocessing forkserver): every method then pays torch's imports twice more, once in the
agent and once in its fork server, about 4 s of a 2-vCPU VM per method
(docs/where-the-time-goes.md). Here the imports are paid once per experiment, and what asks
for a process is a thin client (labkit.launch.warm_client, the standard library only) that
torchrun starts and watches as it would the rank: its stdin, stdout and stderr, environment,
working directory and arguments go to the forked process, signals sent to the client are
passed on, and the client ends as the forked process did (exit code or signal). So torchrun's
supervision, log files, ``--tee``, error files and restarts see what they saw of a cold rank.

The protocol, one Unix stream connection per process: the client sends its three standard
streams as file descriptors with an 8-byte length, then its directory, arguments and environment
(labkit.launch.warm_client.encode); the
server forks and answers ``pid N``, then ``exit S`` (the wait status) when the process ended.
A client that goes away first (killed) takes its process with it (SIGKILL). The server keeps
no threads (a fork is safe) and imports nothing that touches CUDA (labkit.launch.agent's
preload lists); it ends when its owner's pipe closes or a SIGTERM comes (what runs is given its
grace first), and each forked process gets SIGTERM when the server dies.

An emulated cluster (labkit.launch.emulated) has one of its own, started by its switch inside
the cluster's user and PID namespaces with ``--join-namespaces``: each fork first joins the
network, hostname and mount namespaces of the client that asked (:func:`_join`), so a node's
agent and ranks are that node's processes, as a cold start there would make them.
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib
import io
import logging
import os
import select
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import traceback
from typing import Iterator, Optional

from labkit.core import procs

from .warm_client import ENV, NEEDS, fits, peer_pid  # noqa: F401 - the variables' one definition

log = logging.getLogger(__name__)


#: the warm process node() started in this process, while it runs
_node: Optional[subprocess.Popen] = None
#: the file beside the socket the server writes once its preload is imported (ready())
READY = "ready"


def served_by() -> Optional[str]:
    """The socket of the warm process that forked this process, else None (started cold)."""
    return procs.warm_server


def through(cmd: list[str], env: dict) -> list[str]:
    """``cmd`` (``python -m module ...``) as the thin client runs it, where ``env`` names a warm
    process that fits this process (:func:`answers`); else ``cmd`` unchanged."""
    if not env.get(ENV) or cmd[1:2] != ["-m"] or not answers(env[ENV]):
        return cmd
    return as_client(cmd)


def as_client(cmd: list[str]) -> list[str]:
    """``python -m module ...`` as the thin client of a warm process runs it."""
    return [cmd[0], "-m", "labkit.launch.warm_client", *cmd[1:]]


@contextlib.contextmanager
def node(preload: list[str]) -> Iterator[str]:
    """A warm process for what runs inside the ``with``: its socket in :data:`ENV` meanwhile
    (what this process starts inherits it); stopped, and ENV restored, at the end. The imports
    run while the caller goes on; the first client's connection waits for them. Where ENV
    already names one that answers (``labkit warm``'s, or the one that forked this process),
    that one serves, as it is: nothing is started or stopped here."""
    inherited = os.environ.get(ENV, "")
    if answers(inherited):
        yield inherited
        return
    folder = tempfile.mkdtemp(prefix="labkit-warm-")
    address = os.path.join(folder, "socket")
    proc = subprocess.Popen([sys.executable, "-m", "labkit.launch.warm", address, *preload],
                            stdin=subprocess.PIPE, start_new_session=True)
    _wait_for(address, proc)
    global _node
    before, outer = os.environ.get(ENV), _node
    if proc.poll() is None:
        os.environ[ENV] = address
        _node = proc
    else:  # said once here, rather than by every process that would have asked it
        print(f"labkit: warning: the warm process did not start (exit code {proc.returncode}); "
              f"each method starts its own processes", file=sys.stderr, flush=True)
    try:
        yield address
    except KeyboardInterrupt:
        raise  # what runs is stopping: the grace below lets it end its own way
    except BaseException:
        proc.kill()  # bad input found meanwhile: nothing of the caller's runs in it
        raise
    finally:
        _node = outer  # a node() inside another's (a test's): the outer one's again
        if before is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = before
        proc.stdin.close()  # the server's cue to end, once what runs has ended (serve's grace)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        _remove(address)  # the server's own removal, where it was killed before it got there


def ready(limit_s: float = 120.0) -> Optional[float]:
    """Wait until the warm process this process's node() started has imported its preload (or
    has ended, or ``limit_s`` passed); the seconds waited, None where node() started none.
    labkit experiment waits here before its first method, so that no method's wall time holds
    the imports every method shares."""
    import time

    if _node is None:
        return None
    marker = os.path.join(os.path.dirname(os.environ.get(ENV, "")), READY)
    t0 = time.monotonic()
    while _node.poll() is None and not os.path.exists(marker) and time.monotonic() - t0 < limit_s:
        time.sleep(0.02)
    return time.monotonic() - t0


def answers(address: str) -> bool:
    """Whether a warm process listens at ``address`` (a connection it takes, then closes
    unanswered: a socket file left by one that was killed refuses it) whose forks would run as
    this process's children would (labkit.launch.warm_client.fits); a reason it does not is a
    debug line."""
    probe, why = fits(address)
    if probe is None:
        if address:
            log.debug("%s", why)
        return False
    probe.close()
    return True


def ended() -> Optional[str]:
    """Why the warm process of this process's node() ended while it was wanted, in a few words
    (a kill -9, the machine's OOM killer), once; None while it runs, where there is none, and
    after it was said. What starts after this call starts cold: the processes it forked died
    with it (a notebook's kernel too), and a client that found no server would say so each time."""
    global _node
    if _node is None or _node.poll() is None:
        return None
    os.environ.pop(ENV, None)
    code, _node = _node.returncode, None
    try:
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
    except ValueError:
        how = f"killed by signal {-code}"
    return f"the experiment's warm process ended ({how}), and every process it had forked with it"


def _wait_for(address: str, proc: subprocess.Popen, limit_s: float = 30.0) -> None:
    """Until the server listens (it binds before its imports: a tenth of a second), or has
    ended; then a client that finds nothing starts cold and says so."""
    import time

    end = time.monotonic() + limit_s
    while not os.path.exists(address) and proc.poll() is None and time.monotonic() < end:
        time.sleep(0.01)


# ------------------------------------------------------------------ the server
def serve(address: str, preload: list[str], owner: int = 0, grace_s: float = 10.0,
          join: bool = False) -> None:
    """Listen on ``address``, import ``preload``, then fork a process per request until the
    ``owner`` pipe (stdin) closes; then no more, and at most ``grace_s`` for those running to
    end their own way (a Ctrl-C stops the experiment's launch while its runs are stopping).
    While the preload runs, a request that names the modules it needs (:data:`NEEDS`: a notebook's
    kernel needs IPython, not torch) is forked once those are imported. ``join``: :func:`_join`."""
    import time

    from labkit.core.files import atomic_path

    from .warm_client import WHOSE, identity

    # what it runs, for a client to compare with its own (warm_client.fits), then the socket
    with atomic_path(os.path.join(os.path.dirname(address), WHOSE)) as tmp, open(tmp, "w") as f:
        f.write(identity())
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)  # first: a client that connects meanwhile waits in the backlog
    listener.listen(128)
    _title(sys.orig_argv[1:])  # set up here: it finds the command line from the environment,
    wake_r, wake_w = os.pipe()  # which a fork replaces; each fork then names itself (_title)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes select through the pipe
    # SIGTERM too, and ends the serving as the owner's going does: scancel and a job's time
    # limit signal every process of the job at once, and the clients of a server that died
    # first each said it had gone under them (the experiment's kernel below its one line)
    signal.signal(signal.SIGTERM, lambda *_: None)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(wake_r, selectors.EVENT_READ, "child")
    sel.register(owner, selectors.EVENT_READ, "owner")
    clients: dict[int, socket.socket] = {}  # pid -> its client's connection

    def fork(got: tuple, waiting: list) -> None:  # the others waiting are not the fork's
        _fork(*got, address, sel, clients, [listener, wake_r, wake_w, *_files(waiting)], join)

    _import_serving(preload, listener, fork)
    with contextlib.suppress(OSError), open(os.path.join(os.path.dirname(address), READY), "w"):
        pass  # ready(): the preload is in (a folder removed meanwhile: its owner is gone)
    ending = None
    while ending is None or (clients and time.monotonic() < ending):
        for key, _ in sel.select(timeout=None if ending is None else 0.1):
            if key.data == "owner" and not os.read(owner, 4096) and ending is None:
                # the owner is gone: what runs gets its grace, then SIGTERM (die_with_parent)
                ending = _stop_serving(listener, owner, sel, address, grace_s)
            elif key.data == "accept":
                if got := _receive(listener):
                    fork(got, [])
            elif key.data == "child":  # a signal: SIGCHLD, or SIGTERM
                if signal.SIGTERM in os.read(wake_r, 4096) and ending is None:
                    ending = _stop_serving(listener, owner, sel, address, grace_s)
                _reap(sel, clients)
            elif isinstance(key.data, int):  # a client's connection: data (none expected) or gone
                _client_said(key.fileobj, key.data, sel, clients)


def _stop_serving(listener: socket.socket, owner: int, sel: selectors.BaseSelector,
                  address: str, grace_s: float) -> float:
    """No more requests; when the grace of those running ends (time.monotonic())."""
    import time

    _forget(listener, sel)
    _remove(address)
    sel.unregister(owner)
    return time.monotonic() + grace_s


def _import_serving(preload: list[str], listener: socket.socket, fork) -> None:
    """Import ``preload`` module by module; between two, the requests that came meanwhile are
    forked once what they need is in, the rest when all is."""
    waiting: list[tuple] = []
    for module in preload:
        _preload([module])
        while select.select([listener], [], [], 0)[0]:
            waiting += filter(None, [_receive(listener)])
        for got in [w for w in waiting if _ready(w[1])]:
            waiting.remove(got)
            fork(got, waiting)
    while waiting:
        fork(waiting.pop(0), waiting)


def _ready(request: dict) -> bool:
    """Whether every module a request needs (:data:`NEEDS`, else the whole preload: never
    before it ends) is imported."""
    needs = request["needs"]
    return bool(needs) and all(m in sys.modules for m in needs)


def _files(waiting) -> list:
    """The connections and descriptors of requests still waiting: not a fork's to keep."""
    return [f for conn, _, fds in waiting for f in (conn, *fds)]


def _remove(address: str) -> None:
    """The socket, the files naming its labkit and saying it is ready, and the folder node()
    made for them: gone once nothing more is served, also when the owner was killed before it
    could remove them."""
    from .warm_client import WHOSE

    for path in (address, *(os.path.join(os.path.dirname(address), f) for f in (WHOSE, READY))):
        with contextlib.suppress(OSError):
            os.unlink(path)
    with contextlib.suppress(OSError):
        os.rmdir(os.path.dirname(address))


def _preload(modules: list[str]) -> None:
    """Import ``modules``; one that fails is said in one line and left to the processes."""
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - the forked processes import it and say why
            print(f"labkit: warning: the warm process could not import {module} "
                  f"({type(e).__name__}: {e}); what it forks imports it again", file=sys.stderr,
                  flush=True)


def _receive(listener: socket.socket) -> Optional[tuple]:
    """The next client's (connection, request, its three descriptors); None for a probe
    (answers()) or a bad request, which is said in one line."""
    conn, _ = listener.accept()
    try:
        conn.settimeout(10)  # the client sends its request at once
        request, fds = _read_request(conn)
    except EOFError:  # closed before a byte: asked whether this process answers (answers())
        conn.close()
        return None
    except (OSError, ValueError) as e:
        print(f"labkit.launch.warm: a bad request ({e}); ignored", file=sys.stderr, flush=True)
        conn.close()
        return None
    conn.settimeout(None)
    return conn, request, fds


def _fork(conn: socket.socket, request: dict, fds: list[int], address: str,
          sel: selectors.BaseSelector, clients: dict, closing: list, join: bool = False) -> None:
    """Fork the request's process and tell its client the pid; the connection then tells
    when the client goes (labkit.launch.warm_client)."""
    pid = os.fork()
    if pid == 0:  # the new process: never returns
        code = 70
        try:
            others = [s.fileobj for s in sel.get_map().values()]
            sel.close()
            if join:
                _join(conn)
            _become(request, fds, address, [conn, *closing, *others])
            code = run_main(request["argv"])
        except BaseException:  # noqa: BLE001 - could not become the client's (its directory gone)
            traceback.print_exc()
        finally:
            os._exit(code)
    for fd in fds:
        os.close(fd)
    clients[pid] = conn
    try:
        conn.sendall(f"pid {pid}\n".encode())
        sel.register(conn, selectors.EVENT_READ, pid)
    except OSError:  # the client is gone already
        os.kill(pid, signal.SIGKILL)


def _read_request(conn: socket.socket) -> tuple[dict, list[int]]:
    head, fds, _, _ = socket.recv_fds(conn, 8, 3)
    if not head and not fds:
        raise EOFError
    if len(head) != 8 or len(fds) != 3:
        for fd in fds:
            os.close(fd)
        raise ValueError("no stdin, stdout and stderr")
    size, body = struct.unpack("!Q", head)[0], b""
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            raise ValueError("a request cut short")
        body += chunk
    return decode(body), fds


def decode(body: bytes) -> dict:
    """A request's directory, arguments and environment (labkit.launch.warm_client.encode)."""
    cwd, n, *rest = body.decode("utf-8", "surrogateescape").split("\0")
    argv, env = rest[:int(n)], rest[int(n):]
    env = dict(e.split("=", 1) for e in env if "=" in e)
    needs = [m for m in env.pop(NEEDS, "").split(",") if m]  # the server's, not the process's
    return {"cwd": cwd, "argv": argv, "env": env, "needs": needs}


def _reap(sel: selectors.BaseSelector, clients: dict) -> None:
    """Every child that ended: its wait status to its client, the connection closed."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = clients.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.sendall(f"exit {status}\n".encode())
            _forget(conn, sel)


def _client_said(conn: socket.socket, pid: int, sel: selectors.BaseSelector, clients: dict) -> None:
    try:
        data = conn.recv(4096)
    except OSError:
        data = b""
    if data:
        return
    # the client is gone while its process runs (torchrun SIGKILLed it): the process goes too
    if clients.pop(pid, None) is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    _forget(conn, sel)


def _forget(conn: socket.socket, sel: selectors.BaseSelector) -> None:
    with contextlib.suppress(KeyError, ValueError):
        sel.unregister(conn)
    conn.close()


# ------------------------------------------------------------------ the forked process
#: what a fork joins of its client's namespaces (an emulated node's own; the user and PID
#: namespaces are the cluster's, which the server shares)
JOINED = ("net", "uts", "mnt")


def _join(conn: socket.socket) -> None:
    """Join the network, hostname and mount namespaces of the process at the other end of
    ``conn`` where they differ from this one's. A fork is single-threaded, as setns(2) wants
    for a mount namespace, and the server's user namespace owns the node's (it is root there);
    joining a mount namespace moves the root and the directory, which :func:`_become` sets."""
    theirs = [f"/proc/{peer_pid(conn)}/ns/{ns}" for ns in JOINED]
    # opened before any is joined: the mount namespace's /proc may differ
    fds = [os.open(path, os.O_RDONLY) for path, ns in zip(theirs, JOINED)
           if os.stat(path).st_ino != os.stat(f"/proc/self/ns/{ns}").st_ino]
    libc = ctypes.CDLL(None, use_errno=True)
    for fd in fds:
        if libc.setns(fd, 0) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into the client's namespace: {os.strerror(err)}")
        os.close(fd)


def _become(request: dict, fds: list[int], address: str, closing: list) -> None:
    """Turn this fork into the client's process: the server's files closed, its signals
    reset, the client's streams, environment, directory and search path taken."""
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for f in closing:
        with contextlib.suppress(OSError):
            f.close() if hasattr(f, "close") else os.close(f)
    procs.die_with_parent(signal.SIGTERM)  # the server killed: this process stops
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    env = request["env"]
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # found again from the client's TMPDIR, not the server's
    os.chdir(request["cwd"])
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    sys.path[:1] = [request["cwd"], *extra]  # as `python -m` starts it
    _title(request["argv"])
    _streams(bool(env.get("PYTHONUNBUFFERED")))
    _threads(env.get("OMP_NUM_THREADS", ""))
    _backend(env.get("MPLBACKEND"))
    procs.warm_server = address


def _title(argv: list[str]) -> None:
    """This process's command line as ps, top and psutil show it: the command it runs
    (``python -m labkit.train ...``), not the warm process's it was forked from."""
    import shlex

    import setproctitle

    setproctitle.setproctitle(shlex.join([sys.executable, *argv]))


def _threads(omp: str) -> None:
    """torch's threads as the client's OMP_NUM_THREADS sets them: OpenMP read the server's
    environment once, when torch was imported (4 ranks of 2 threads each on 2 cores made every
    step 5x slower)."""
    torch = sys.modules.get("torch")
    if torch is not None and omp.isdigit() and int(omp) > 0:
        torch.set_num_threads(int(omp))


def _backend(name: Optional[str]) -> None:
    """matplotlib's backend as the client's MPLBACKEND names it (a Jupyter kernel's inline
    one): matplotlib read the server's environment once, when it was imported."""
    matplotlib = sys.modules.get("matplotlib")
    if matplotlib is not None and name:
        matplotlib.rcParams["backend"] = name


def _streams(unbuffered: bool) -> None:
    """sys.stdin, stdout and stderr on the client's descriptors, buffered as Python would
    buffer them for that environment."""
    def out(fd: int, **kw) -> io.TextIOWrapper:
        raw = open(fd, "wb", buffering=0 if unbuffered else -1, closefd=False)  # noqa: SIM115
        return io.TextIOWrapper(raw, encoding="utf-8", write_through=unbuffered,
                                line_buffering=kw.pop("line", os.isatty(fd)), **kw)
    sys.stdin = sys.__stdin__ = open(0, closefd=False, encoding="utf-8")  # noqa: SIM115
    sys.stdout = sys.__stdout__ = out(1)
    sys.stderr = sys.__stderr__ = out(2, errors="backslashreplace", line=True)


def run_main(argv: list[str]) -> int:
    """Run ``argv`` (``-m module args...``) as ``python`` would run it; its exit code. Exit
    functions run (as at Python's exit), the interpreter's teardown does not."""
    if argv[:1] == ["-u"]:
        argv = argv[1:]
    if argv[:1] != ["-m"] or len(argv) < 2:
        print(f"labkit.launch.warm: cannot run {argv[:2]}: give -m MODULE", file=sys.stderr)
        return 2
    import importlib.util
    import runpy

    try:
        found = importlib.util.find_spec(argv[1]) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        print(f"{sys.executable}: No module named {argv[1]}", file=sys.stderr)  # as python -m
        return 1
    sys.argv = [argv[1], *argv[2:]]
    # run fresh, as in a new interpreter (runpy warns otherwise); a package (python -m labkit)
    # runs its __main__, never imported before, and keeps the package its modules belong to
    package = importlib.util.find_spec(argv[1]).submodule_search_locations is not None
    sys.modules.pop(f"{argv[1]}.__main__" if package else argv[1], None)
    code = 0
    try:
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = _exit_code(e.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = 128 + signal.SIGINT
    except BaseException:  # noqa: BLE001 - as Python's own top level: the traceback, exit 1
        traceback.print_exc()
        code = 1
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()  # noqa: SLF001 - what Python's exit runs
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    return code


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    _join_them = sys.argv[1:2] == ["--join-namespaces"]
    _args = sys.argv[2:] if _join_them else sys.argv[1:]
    if not _args:
        sys.exit("usage: python -m labkit.launch.warm [--join-namespaces] SOCKET [MODULE ...]")
    try:
        serve(_args[0], _args[1:], join=_join_them)
    except OSError as e:  # the socket cannot be made there
        print(f"labkit.launch.warm: error: cannot listen on {_args[0]}: {e.strerror}",
              file=sys.stderr, flush=True)
        os._exit(2)
    os._exit(0)  # nothing to flush or save: Python's teardown of torch took 1.5 s here
