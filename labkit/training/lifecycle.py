"""How a rank's result file ends when its run is stopped from outside, on the bare torchrun
path too, and how a rank ends.

Two layers, because neither covers every case alone:

1. :func:`take_sigterm`: when one rank dies, torchrun stops the others with SIGTERM, then
   SIGKILL after its grace period. A Python signal handler runs only in the main thread between
   bytecodes, so a rank blocked in a C++ collective could not run one. Instead SIGTERM is
   blocked in every thread and taken by a dedicated thread with ``sigwait``: it runs the
   registered callbacks (rank 0 marks its result file failed, atomically) and then dies of the
   same SIGTERM, so torchrun still sees exit code -15.
2. :func:`heartbeat`: SIGKILL, the OOM killer or a lost node cannot be caught. Rank 0 stamps
   its file with host, pid and time (labkit.core.status.stamp), refreshed every
   ``HEARTBEAT_S`` by a thread; readers show a running file whose writer is gone as stopped
   (labkit.core.status.as_seen).

And how a rank that finished ends: :func:`leave`, without the interpreter's teardown.
"""
from __future__ import annotations

import multiprocessing
import os
import runpy
import signal
import sys
import threading
import time
import traceback
from typing import Callable, Optional

from labkit.core.status import HEARTBEAT_S

from . import stackdump

_callbacks: list[Callable[[], None]] = []


# ------------------------------------------------------------------ SIGTERM in the ranks
def take_sigterm() -> None:
    """Block SIGTERM in this thread and every thread started after it, and take it in a
    dedicated thread. Call first thing in the main thread, before torch starts its threads."""
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return  # someone else handles SIGTERM here
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    # forked children (DataLoader workers) must stay killable by SIGTERM
    os.register_at_fork(after_in_child=_unblock)
    threading.Thread(target=_wait_for_sigterm, name="labkit-sigterm", daemon=True).start()


def on_sigterm(callback: Callable[[], None]) -> None:
    """Run ``callback`` (in the SIGTERM thread) before the process dies of SIGTERM."""
    _callbacks.append(callback)


def _unblock() -> None:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def _wait_for_sigterm() -> None:
    signal.sigwait({signal.SIGTERM})
    # where this rank stood, into its log: torchrun stops the ranks that waited for one that
    # failed or hung, and a hung rank's position is what its author needs (labkit.launch.failures)
    for cb in [_dump_stacks, *_callbacks, _remove_temp_dir]:
        try:
            cb()
        except Exception:  # noqa: BLE001 - the process must still die as asked
            pass
    # die of SIGTERM (default action) from this thread, the only one that does not block it
    _unblock()
    signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
    time.sleep(1)
    os._exit(128 + signal.SIGTERM)


def _dump_stacks() -> None:
    stackdump.dump_live("stopped by SIGTERM")


def _remove_temp_dir() -> None:
    """The fork server's directory (labkit.training.workers), where a rank has one."""
    workers = sys.modules.get("labkit.training.workers")  # a rank without loaders has none
    if workers is not None:
        workers.remove_temp_dir()


# ------------------------------------------------------------------ heartbeat (writer side)
def heartbeat(write: Callable[[], bool], every: float = HEARTBEAT_S) -> threading.Thread:
    """Call ``write`` every ``every`` seconds in a daemon thread until it returns False."""
    def beat() -> None:
        while True:
            time.sleep(every)
            try:
                if not write():
                    return
            except OSError:
                pass  # a full or unmounted disk: the next beat tries again
    t = threading.Thread(target=beat, name="labkit-heartbeat", daemon=True)
    t.start()
    return t


def leave(code: int) -> None:
    """End a rank that has finished without Python's teardown of torch and torchvision.
    Nothing is left to do by then (result files and checkpoints are written with fsync, the
    process group is gone), and the teardown costs CPU time that, with several ranks per core,
    kept torchrun waiting seconds after the last line of every run (docs/performance.md).
    While a loader worker lives (a GPU run's decoding loaders keep theirs), it exits the
    ordinary way, which shuts them down. A rank that failed exits the ordinary way too
    (failures are rare, and torchrun's error files and restarts read what it leaves), its
    loader workers killed first: one may be why it failed (stopped, stuck)."""
    from . import workers

    sys.stdout.flush()
    sys.stderr.flush()
    if code == 0 and not workers.running():
        workers.remove_temp_dir()  # the one finaliser of the teardown skipped here that matters
        if multiprocessing.parent_process() is None:
            os._exit(code)
        # a warm rank (warm_rank) returns to the agent's multiprocessing context, which reads its
        # return and ends the process with os._exit itself: no teardown either
    if code != 0:
        workers.kill_all()
    sys.exit(code)


def leave_now(code: int) -> None:
    """End this process at once from any thread (its main thread is stuck): loader workers
    killed, the fork server's folder removed, streams flushed."""
    workers = sys.modules.get("labkit.training.workers")
    if workers is not None:
        workers.kill_all()
        workers.remove_temp_dir()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ------------------------------------------------------------------ a rank's life
def begin_rank() -> None:
    """The first thing every rank entry point does under torchrun (labkit/train.py,
    labkit.bench.bench_rank), before it imports its ``main`` (and with it torch), then ends with
    ``leave(main())``: SIGTERM when torchrun dies (torchrun starts each rank in a session of its
    own, so a SIGKILLed torchrun would leave its ranks training on, orphaned), taken by a thread
    (before torch is imported, so its threads inherit the blocked signal); then glibc's malloc
    made steady (labkit.training.dist.steady_malloc)."""
    from labkit.core.procs import die_with_parent

    die_with_parent(signal.SIGTERM)
    take_sigterm()
    from .dist import steady_malloc

    steady_malloc()  # before the model and the data allocate anything (dist.py says why)


def warm_rank(module: str, *argv: str) -> None:
    """A rank started warm (labkit.launch.agent): forked from the node's fork server, which
    imported torch, torchvision and labkit once. Runs ``module`` as ``python -m module argv``
    would (labkit.train, labkit.bench.bench_rank: each calls :func:`begin_rank`); an exit 0
    returns to the agent's multiprocessing context, any other code exits with it."""
    # the process object came pickled from the agent, with the agent's multiprocessing
    # directory (where the fork server's socket lives): this rank makes its own (its loaders'
    # fork server), which it removes at its end (workers.remove_temp_dir), not the agent's
    multiprocessing.current_process()._config.pop("tempdir", None)  # util.get_temp_dir's
    sys.argv = [module, *argv]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def run_rank(work: Callable[..., object], prog: str, *args: object) -> int:
    """Run a rank's ``work(*args)`` and turn how it ends into an exit code and at most one line:

    - bad input (ConfigError), seen by every rank alike: one ``<prog>: error:`` line from rank
      0, exit 2 (the others wait a moment, so torchrun does not stop rank 0 before it printed);
    - a run that failed without crashing (RunFailed: a diverged loss, replicas that differ),
      seen by every rank alike: the same (from each node's local rank 0), exit 1, and no
      torchrun error file (its summary would print a traceback);
    - the machine ran out of something under this rank (Exhausted: a full disk or /dev/shm, a
      killed loader worker, GPU memory), which only this rank knows: the traceback into the
      rank's log, torchrun's error file written with the one line, and that line
      (``<prog>: error: <method> failed: rank N: ...``) from this rank, exit 1;
    - Ctrl-C: exit 130;
    - a crash: the full traceback into the rank's log, torchrun's error file written (its
      ``record`` decorator), then one ``<prog>: error: rank N: ...`` line, exit 1.
    """
    from torch.distributed.elastic.multiprocessing.errors import record

    from labkit.core.config import ConfigError
    from labkit.core.errors import Exhausted

    rank = int(os.environ.get("RANK", "0"))
    try:
        # record: on an exception, torchrun's per-rank error file (read by labkit.launch.failures)
        failed = record(_verdict)(work, *args)
    except ConfigError as e:
        return _one_line(prog, e, rank, 2)
    except KeyboardInterrupt:
        return 130
    except Exhausted as e:
        traceback.print_exc()
        stackdump.mark_raised(e.__cause__ or e)
        print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        return 1
    except Exception as e:  # noqa: BLE001 - a crash: its traceback is in the log, then one line
        traceback.print_exc()
        stackdump.mark_raised(e)
        print(f"{prog}: error: rank {rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    # a failed run: said on every node (by its local rank 0), so each node's launcher shows it
    return 0 if failed is None else _one_line(prog, failed, int(os.environ.get("LOCAL_RANK", rank)), 1)


def _verdict(work: Callable[..., object], *args: object) -> Optional[Exception]:
    """``work(*args)``; a failed run (RunFailed) is not a crash: returned past ``record()``,
    which would file it."""
    from labkit.core.errors import Exhausted, RunFailed

    try:
        work(*args)
    except Exhausted:
        raise  # this rank's own: filed by record()
    except RunFailed as e:
        return e
    return None


def _one_line(prog: str, e: Exception, rank: int, code: int) -> int:
    """What every rank saw alike, said once: ``rank`` 0 prints it, the others wait a moment
    (so torchrun does not stop it before it printed and, global rank 0, wrote its result file)."""
    if rank == 0:
        print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
    else:
        time.sleep(2)
    return code
