"""A node's torchrun agent whose ranks start warm: torch, torchvision and labkit imported once per
node, not once per rank.

    python -m labkit.launch.agent --nproc-per-node=4 --standalone ... -m labkit.train --resolved F

takes torchrun's own flags and does what ``torchrun`` does (torch.distributed.run: the same
LaunchConfig, rendezvous, restarts, log files, ``--tee``, prefixes, error files, the failure
summary), with one change: each rank is a function entry point started by multiprocessing's
``forkserver`` method (``elastic_launch`` runs function entry points under
torch.distributed.elastic's MultiprocessContext), whose server process imports what the ranks
will (:func:`preload_for`: torch, labkit's training layer, the launch's workload) once, before
the first rank, and forks every rank from there. A rank then runs the module given
after ``-m`` as ``python -m`` would (labkit.training.lifecycle.warm_rank), so nothing in a rank
knows how it started.

Why this way, not a warm process of our own with thin clients under torchrun: the agent,
its supervision of each rank and the fork server are torch's and Python's, kept by them; what
labkit adds is the preload and the entry point. The fork server is started by this agent
(single-threaded, no torch op run, no CUDA initialised), so a fork from it is safe where a fork
from the agent (the rendezvous store's threads, the log tailers) is not.

The server is this agent's child and dies with it; each rank asks to get SIGTERM when the server
dies (labkit.training.lifecycle), so a killed server stops its ranks, and the agent, which then
sees every rank gone, says so in one line (:data:`SERVER_KILLED`).
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import multiprocessing.util
import os
import signal
import sys
import uuid

from labkit.core import builtins

#: what every rank imports before its first step, measured with ``python -X importtime``: torch
#: and its distributed packages, labkit's training layer; torch._dynamo too, which the first
#: call of any torch.optim optimizer imports (torch._disable_dynamo: 1.4 s); then every built-in
#: method's module and what it declares it imports (its class's ``preload``)
COMMON = [
    "torch", "torch._dynamo", "torch.distributed", "torch.distributed.elastic.multiprocessing.errors",
    "torch.utils.flop_counter", "torch.utils.data", "psutil",
    "labkit.training.lifecycle", "labkit.training.rank", "labkit.training.trainer",
    "labkit.training.data", "labkit.training.sync.registry", "labkit.workloads.catalog",
    "labkit.training.instruments.exactness",
    *dict.fromkeys(m for d in builtins.METHODS.values() for m in d["preload"]),
]
#: what a built-in workload's ranks import beyond COMMON, as its class declares it: the
#: language model's need no torchvision
BY_WORKLOAD = {name: list(d["preload"]) for name, d in builtins.WORKLOADS.items()}
#: what the warm process imports when the launch's workload is not known: every built-in's
PRELOAD = COMMON + [m for mods in BY_WORKLOAD.values() for m in mods]
#: what an experiment's warm process (labkit.launch.warm) imports beyond a workload's preload:
#: what this agent imports, so that the agent it forks starts with nothing left to import (not
#: this module itself: it runs as __main__, which runpy warns of for a module imported before)
AGENT = ["torch.distributed.run", "torch.distributed.launcher.api",
         "torch.distributed.elastic.agent.server.local_elastic_agent", "labkit.launch.warm"]
#: the line the agent prints when the fork server died under its ranks
SERVER_KILLED = "the warm process that forks this node's ranks"


def main(argv: list[str] | None = None) -> None:
    from labkit.launch import warm

    shared = warm.served_by()  # this agent was forked by an experiment's warm process
    if not shared:
        # the fork server first: its imports run while this agent imports torch for itself
        multiprocessing.set_forkserver_preload(preload_for(sys.argv[1:] if argv is None else argv))
        multiprocessing.forkserver.ensure_running()
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    from labkit.training.lifecycle import warm_rank

    args = torchrun.parse_args(argv)
    if not args.module:
        sys.exit("labkit.launch.agent: give the ranks' module with -m (e.g. -m labkit.train)")
    if args.standalone:  # as torch.distributed.run.run does
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    config, _, _ = torchrun.config_from_args(args)
    _quick_rendezvous_records()
    try:
        if shared:  # each rank a thin client that the same warm process forks for
            elastic_launch(config=config, entrypoint=sys.executable)(
                "-u", "-m", "labkit.launch.warm_client", "-m", args.training_script,
                *args.training_script_args)
        else:
            config.start_method = "forkserver"
            _report_every_failed_rank()
            elastic_launch(config=config, entrypoint=warm_rank)(args.training_script,
                                                                 *args.training_script_args)
    except ChildFailedError:
        _say_if_server_died()
        raise
    finally:
        _stop_server()


def _method_name(depth: int = 2) -> str:
    """What torch's rendezvous names each of its event records by, the function ``depth``
    frames up (the caller of the caller), read from the frame itself."""
    try:
        return sys._getframe(depth).f_code.co_name  # noqa: SLF001
    except ValueError:  # a stack shallower than that
        return "no_method_name"


def _quick_rendezvous_records() -> None:
    """torch's c10d rendezvous names every event it records (nine in a one-node rendezvous)
    with inspect.stack(), which reads the source of every frame and, for each, searches the
    modules torch loaded: about half a second of each launch's rendezvous on a 2-vCPU VM
    (docs/performance-log.md). The same name, taken from the frame."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    dynamic_rendezvous.get_method_name = _method_name


def preload_for(argv: list[str]) -> list[str]:
    """What this launch's warm process imports: COMMON and its built-in workload's modules, the
    workload read from the ranks' ``--resolved`` file, else their ``--workload`` flag, without
    importing anything (the server starts before the agent imports torch); where neither says,
    every built-in's (:data:`PRELOAD`). A workload or method of one's own is not preloaded: each
    rank imports it, as before. labkit's modules are known not to touch CUDA or start threads
    at import, which a fork from the server relies on; a module of one's own may (a device
    chosen with torch.cuda.is_available() at import), and multiprocessing's fork server dies of
    any exception a preload raises but an ImportError."""
    from labkit.core.run_folder import read_json

    ranks = argv[argv.index("-m") + 2:] if "-m" in argv else []
    workload, path = _flag(ranks, "--workload"), _flag(ranks, "--resolved")
    if path:
        try:
            workload = read_json(path)["train"]["workload"]
        except (OSError, ValueError, KeyError, TypeError):
            workload = None  # the ranks say what is wrong with the file
    return preload_for_workload(workload)


def preload_for_workload(workload: str | None) -> list[str]:
    """COMMON and built-in ``workload``'s modules; every built-in's where it is None; COMMON
    alone for a workload of one's own (:func:`preload_for` says why)."""
    if workload is None:
        return list(PRELOAD)
    return COMMON + BY_WORKLOAD.get(workload, [])


def _flag(argv: list[str], name: str) -> str | None:
    """The value of ``name`` in ``argv`` (``--name V`` or ``--name=V``), else None."""
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(name + "="):
            return a[len(name) + 1:]
    return None


def _report_every_failed_rank() -> None:
    """torch's MultiprocessContext reports the first rank that failed, and not the ranks it
    stopped after it (torchrun's SubprocessContext lists every rank that ended badly, SIGTERM
    included): where a rank hung outside a collective, the failure summary must name it
    (labkit.launch.failures tells the hung rank from the ones that timed out by it). So this
    agent's function entry points get a context that lists them all."""
    import torch.distributed.elastic.multiprocessing as tem
    from torch.distributed.elastic.multiprocessing.api import MultiprocessContext, ProcessFailure

    class EveryFailure(MultiprocessContext):
        def _poll(self):
            result = super()._poll()
            if result is not None and result.failures:  # the others stopped by now (close())
                for local, proc in enumerate(self._pc.processes):
                    if local not in result.failures and proc.exitcode not in (0, None):
                        result.failures[local] = ProcessFailure(
                            local_rank=local, pid=proc.pid, exitcode=proc.exitcode,
                            error_file=self.error_files[local])
            return result

    tem.MultiprocessContext = EveryFailure  # start_processes reads it from its module


def _stop_server(wait_s: float = 5.0) -> None:
    """End the fork server and reap it, so that its CPU time and its ranks' (it reaped them)
    count as this agent's children's: what a process's parent measures of it
    (resource.getrusage, the tests' CPU count) stays whole. By then every rank has ended and its
    exit code been read, so the server has nothing left to do, and it is killed rather than left
    to Python's teardown of torch and torchvision, which took 1.2 s of a 2-vCPU VM after each
    launch's last rank (strace of a `labkit run ddp`, docs/performance-log.md)."""
    import time

    server = multiprocessing.forkserver._forkserver  # noqa: SLF001 - no public API
    pid, alive = getattr(server, "_forkserver_pid", None), getattr(server, "_forkserver_alive_fd", None)
    if pid is None:
        return
    try:
        os.close(alive)  # where the kill cannot be sent, it leaves on this pipe's end
    except (OSError, TypeError):
        pass
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    end = time.monotonic() + wait_s
    while time.monotonic() < end:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return
        except ChildProcessError:  # reaped already (_say_if_server_died)
            return
        time.sleep(0.01)


def _leave(code: int) -> None:
    """End the agent without Python's teardown of torch (0.6 s on the same VM): its streams and
    logs flushed and multiprocessing's folder (the fork server's socket) removed, the only
    things that teardown does for it."""
    import logging
    import shutil

    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    shutil.rmtree(multiprocessing.util.get_temp_dir(), ignore_errors=True)
    os._exit(code)


def _say_if_server_died() -> None:
    """One line on stderr when the fork server is gone: its ranks' exits then read 255."""
    pid = getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)  # noqa: SLF001 - no public API
    if pid is None:
        return
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        done, status = pid, 0
    if done != pid:
        return
    how = (f"killed by {signal.Signals(os.WTERMSIG(status)).name}" if os.WIFSIGNALED(status)
           else f"gone (exit code {os.waitstatus_to_exitcode(status)})")
    print(f"labkit: error: {SERVER_KILLED} (pid {pid}) was {how}; its ranks were stopped with "
          f"it", file=sys.stderr, flush=True)


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    record(main)()  # a failure raises: the ordinary exit, with torchrun's error file and summary
    _leave(0)
