"""The thin client of a warm process (labkit.launch.warm): what torchrun, or labkit's launcher,
starts in place of a cold ``python -m module ...``.

    python -m labkit.launch.warm_client -m labkit.train --resolved resolved.json

It imports the standard library and labkit.core.procs only (a start of tens of milliseconds),
hands its stdin, stdout and stderr, environment, working directory and arguments to the warm process named by
``LABKIT_WARM``, which forks the process that runs them, passes on every signal it gets, and
ends as that process ended: its exit code, or killed by the same signal. Where no warm process
answers, it runs the same command cold (``exec``), and says so in one line.

The ``labkit`` program does the same beside ``labkit warm`` (labkit.cli._run_warm:
:func:`run_through`), where the warm process fits it (:func:`fits`: what a fork would inherit
from the warm process rather than from the program is the same), and runs in place elsewhere.
"""
from __future__ import annotations

import os
import signal
import socket
import struct
import sys
from typing import Callable, Optional

from labkit.core.procs import die_with_parent  # (the standard library's os only)

#: the environment variable that names the warm process's socket (labkit.launch.warm.node sets it)
ENV = "LABKIT_WARM"
#: in a client's environment: the modules its process needs, comma-separated (a notebook's
#: kernel: labkit.orchestrate.kernels.KERNEL); the warm process forks it once those are
#: imported, even while the rest of its preload runs. Not passed on to the process.
NEEDS = "LABKIT_WARM_NEEDS"
#: the signals passed on to the forked process (SIGKILL and SIGSTOP cannot be caught: a
#: SIGKILLed client's process is killed by the warm process, which sees the client gone); a
#: terminal's Ctrl-Z (SIGTSTP) stops the process and this client, and SIGCONT goes on to it
RELAYED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
           signal.SIGUSR2, signal.SIGTSTP)
#: what the client says when the warm process died under the process it forked
GONE = "the warm process that forks this experiment's processes"
#: the file beside a warm process's socket that names the interpreter and labkit it runs
#: (:func:`identity`; labkit.launch.warm.serve writes it before it listens)
WHOSE = "labkit"
#: what a process forked from a warm process keeps of that process rather than of the one that
#: asked: /proc/PID/status's lines (user, groups, umask, CPUs, seccomp) beside its namespaces,
#: cgroup, resource limits and niceness, which :func:`fits` also compares
STATUS = ("Uid", "Gid", "Groups", "Umask", "Cpus_allowed_list", "NoNewPrivs", "Seccomp")


def main(argv: list[str]) -> None:
    if [a for a in argv if a != "-u"][:1] != ["-m"] or len(argv) < 2:
        sys.exit("usage: python -m labkit.launch.warm_client -m MODULE [ARG ...]")
    address = os.environ.get(ENV, "")
    sock = connect(address)
    if sock is None:
        print(f"labkit: note: no warm process answers at {address or '(none)'} ({ENV}); "
              f"starting cold", file=sys.stderr, flush=True)
        os.environ.pop(NEEDS, None)  # the warm process's to read, not the process's
        os.execv(sys.executable, [sys.executable, *argv])
    die_with_parent(signal.SIGTERM)  # torchrun SIGKILLed: this client gets SIGTERM, passes it on
    run_through(sock, argv)


def run_through(sock: socket.socket, argv: list[str],
                before_fork: Optional[Callable[[int, object], None]] = None) -> None:
    """Have the warm process at the other end of ``sock`` fork ``argv`` (``-m MODULE ...``)
    with this process's streams, environment and directory; pass on the signals this process
    gets (but those it ignores, as under ``nohup`` or in a shell script's background job), and
    end as the forked process ended. Never returns, unless ``before_fork`` (the ``labkit``
    program's SIGTERM handler) raises: it takes a SIGINT or SIGTERM that comes before the warm
    process forked (which waits for its imports, seconds after its start), so that the caller
    ends as a command stopped then does, and the warm process kills the fork it then makes
    for a client gone. Passed on, the signal would reach a process that has not yet set its
    handlers: a silent death by SIGTERM, or a KeyboardInterrupt's traceback."""
    server = peer_pid(sock)
    pending: list[int] = []
    child = [0]

    def relay(sig: int, _frame: object) -> None:
        if not child[0]:
            if before_fork is not None and sig in (signal.SIGINT, signal.SIGTERM):
                before_fork(sig, _frame)
            pending.append(sig)
            return
        try:
            if sig == signal.SIGTSTP:  # Ctrl-Z: the process stops with this one, goes on with it
                os.kill(child[0], signal.SIGSTOP)
                signal.signal(sig, signal.SIG_DFL)
                os.kill(os.getpid(), sig)  # stopped here until the shell's SIGCONT (fg, bg)
                signal.signal(sig, relay)
                os.kill(child[0], signal.SIGCONT)
            else:
                os.kill(child[0], sig)
        except ProcessLookupError:
            pass

    for sig in RELAYED:
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, relay)
    body = encode(argv, dict(os.environ), os.getcwd())
    socket.send_fds(sock, [struct.pack("!Q", len(body))], [0, 1, 2])
    sock.sendall(body)
    status = None
    for word, value in _messages(sock):
        if word == "pid":
            child[0] = value
            for sig in pending:
                relay(sig, None)
        elif word == "exit":
            status = value
    if status is None:
        print(f"labkit: error: {GONE} (pid {server}) is gone; what it forked for this run "
              f"(pid {child[0] or '?'}) was stopped with it", file=sys.stderr, flush=True)
        os._exit(1)
    _end_as(status)


def encode(argv: list[str], env: dict, cwd: str) -> bytes:
    """A request's body (labkit.launch.warm.decode): NUL-separated strings, none of which can
    hold a NUL: the directory, the number of arguments, the arguments, then ``NAME=value`` for
    each variable."""
    return "\0".join([cwd, str(len(argv)), *argv, *(f"{k}={v}" for k, v in env.items())]).encode(
        "utf-8", "surrogateescape")


def identity() -> str:
    """This process's interpreter environment and labkit, as :data:`WHOSE` holds them."""
    import labkit

    return f"{os.path.realpath(sys.prefix)}\n{os.path.realpath(os.path.dirname(labkit.__file__))}\n"


def fits(address: str) -> tuple[socket.socket | None, str]:
    """A connection to the warm process at ``address`` where what it forks runs as it would
    here: the same labkit of the same interpreter environment, in the same namespaces and
    cgroup, with the same user, umask, CPUs, resource limits and niceness, in the same Slurm
    job or none. Else None and what differs, in a few words: a command under ``unshare``,
    ``taskset``, ``prlimit`` or ``nice``, in a Slurm job or from another venv or checkout then
    runs where it was started."""
    sock = connect(address)
    if sock is None:
        return None, f"no warm process answers at {address or '(none)'}"
    why = _differs(address, peer_pid(sock))
    if why:
        sock.close()
        return None, f"the warm process at {address} differs from this process: {why}"
    return sock, ""


def _differs(address: str, pid: int) -> str:
    """What differs between this process and the warm process ``pid`` serving ``address``."""
    def read(path: str) -> str:
        with open(path) as f:
            return f.read()

    def status(who: str) -> dict:
        lines = (line.split(":", 1) for line in read(f"/proc/{who}/status").splitlines())
        return {k: v.strip() for k, v in lines if k in STATUS}

    try:
        if read(os.path.join(os.path.dirname(address), WHOSE)) != identity():
            return "another interpreter environment or labkit"
        if pid <= 0:
            return "its process is not visible from here"
        for ns in sorted(os.listdir("/proc/self/ns")):
            if os.readlink(f"/proc/self/ns/{ns}") != os.readlink(f"/proc/{pid}/ns/{ns}"):
                return f"its {ns} namespace"
        for name in ("cgroup", "limits"):
            if read(f"/proc/self/{name}") != read(f"/proc/{pid}/{name}"):
                return f"its {name}"
        mine, its = status("self"), status(str(pid))
        for key in STATUS:
            if mine.get(key) != its.get(key):
                return f"its {key}"
        if os.getpriority(os.PRIO_PROCESS, 0) != os.getpriority(os.PRIO_PROCESS, pid):
            return "its niceness"
        # a Slurm job's processes stay in the job (its accounting, limits and scancel), where
        # no cgroup tells them apart (proctrack/linuxproc); the environment it started with
        theirs = dict(v.split("=", 1) for v in read(f"/proc/{pid}/environ").split("\0") if "=" in v)
        if os.environ.get("SLURM_JOB_ID", "") != theirs.get("SLURM_JOB_ID", ""):
            return "its Slurm job"
    except OSError as e:
        return f"cannot read {e.filename or 'its process'} ({e.strerror})"
    return ""


def connect(address: str) -> socket.socket | None:
    """A connection to the warm process at ``address``; None where none answers."""
    if not address:
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(address)
    except OSError:
        sock.close()
        return None
    return sock


def peer_pid(sock: socket.socket) -> int:
    """The pid of the process at the other end of a Unix socket, as this process's PID
    namespace numbers it (0 where it cannot be read)."""
    try:
        return struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                    struct.calcsize("3i")))[0]
    except (OSError, AttributeError):
        return 0


def _messages(sock: socket.socket):
    """``(word, number)`` for each line the warm process sends, until it closes."""
    buf = b""
    while True:
        try:
            chunk = sock.recv(4096)
        except InterruptedError:
            continue
        except OSError:
            return
        if not chunk:
            return
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            word, _, value = line.decode().partition(" ")
            yield word, int(value)


def _end_as(status: int) -> None:
    """Exit as the forked process did: its code, or its signal (a SIGKILLed rank reads as a
    SIGKILLed process to torchrun)."""
    sys.stdout.flush()
    sys.stderr.flush()
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    main(sys.argv[1:])
