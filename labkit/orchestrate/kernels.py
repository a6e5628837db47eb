"""The Jupyter kernels papermill runs labkit's notebooks on: which kernel, and how it starts
and stops (labkit.orchestrate.experiment runs the experiment's notebooks with these settings)."""
from __future__ import annotations

import logging
import time
from typing import Optional

log = logging.getLogger(__name__)

# the project's named kernel (make setup installs it into the venv)
KERNEL_NAME = "labkit"


# how long an interrupted kernel may take to stop what it launched (launch._stop: SIGINT to
# torchrun's group, SIGKILL after 10 s)
STOP_GRACE_S = 15.0


def _running(procs) -> bool:
    """Whether any of ``procs`` (psutil.Process) still runs; an exited one not yet reaped (a
    zombie) does not."""
    import psutil

    for p in procs:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                return True
        except psutil.Error:  # gone
            pass
    return False


def kernel_options() -> dict:
    """papermill's kernel settings for labkit's notebooks.

    - IPC (Unix socket) transport: a local kernel needs no TCP, and ipykernel warns on every
      start about unencrypted TCP, into the experiment's output.
    - Forked by the experiment's warm process where there is one (:func:`warm_kernel`).
    - The kernel is killed when its last cell is done (nbclient's shutdown_kernel="immediate"):
      all it makes is on disk by then, and a graceful shutdown waited seconds per notebook for
      Python's teardown of torch and matplotlib (docs/performance.md).
    - Except while it still runs a launch (the experiment was interrupted): jupyter_client
      interrupts a kernel before it kills it, and the kill came before launch could stop
      torchrun's process group; torchrun, left to its parent-death SIGTERM, now and then hung
      on with its ranks dead (seen once in a clean-clone suite). So a kernel with
      child processes (the warm fork's, :func:`kernel_processes`) is interrupted and given
      ``STOP_GRACE_S`` to see them gone first.
    """
    import asyncio

    import psutil
    from jupyter_client.manager import AsyncKernelManager

    class IPCKernelManager(AsyncKernelManager):
        def __init__(self, **kw):
            kw.setdefault("transport", "ipc")
            super().__init__(**kw)

        async def _async_pre_start_kernel(self, **kw):
            cmd, kw = await super()._async_pre_start_kernel(**kw)
            return warm_kernel(cmd, kw.get("env")), kw

        async def shutdown_kernel(self, now: bool = False, restart: bool = False) -> None:
            pid = getattr(self.provisioner, "pid", None) if self.has_kernel else None
            try:
                busy = pid is not None and [c for p in kernel_processes(pid, self.connection_file)
                                            for c in p.children()]
            except psutil.Error:
                busy = False
            if busy:
                await self.interrupt_kernel()  # KeyboardInterrupt in launch(): launch._stop
                deadline = time.monotonic() + STOP_GRACE_S
                while time.monotonic() < deadline and _running(busy):
                    await asyncio.sleep(0.1)
            await super().shutdown_kernel(now=now, restart=restart)

    return {"kernel_manager_class": IPCKernelManager, "shutdown_kernel": "immediate"}


def drop_abandoned_tasks() -> None:
    """papermill runs a notebook's cells on one asyncio loop (jupyter_core's, this thread's),
    each cell in a run_until_complete, and a KeyboardInterrupt (Ctrl-C, SIGTERM) leaves that
    call with the cell's tasks pending. The kernel's shutdown that follows runs the loop again,
    and ran them on: where scancel's SIGTERM had killed the kernel too, nbclient said "Kernel
    died while waiting for execute reply." and the cell's task ended in DeadKernelError, which
    nothing awaits any more, so that asyncio printed "Task exception was never retrieved" and a
    traceback, below the command's one line. So on this loop a new run's own task first cancels
    the tasks an earlier run left (each cell's tasks are awaited otherwise), and a task's error
    that no one retrieved is a debug line when it is the interruption's echo (the kernel's
    death, the KeyboardInterrupt itself); anything else the loop reports is as before."""
    from jupyter_core.utils import ensure_event_loop

    loop = ensure_event_loop()
    if loop.get_task_factory() is None:
        loop.set_task_factory(_new_task)
    if loop.get_exception_handler() is None:
        loop.set_exception_handler(_unretrieved)


def _new_task(loop, coro, **kw):
    import asyncio

    if not loop.is_running():  # a run_until_complete's own: nothing of an earlier run waits
        for task in asyncio.all_tasks(loop):
            task.cancel()
    return asyncio.Task(coro, loop=loop, **kw)


def _unretrieved(loop, context: dict) -> None:
    from nbclient.exceptions import DeadKernelError

    if isinstance(context.get("exception"), (KeyboardInterrupt, DeadKernelError)):
        log.debug("a notebook's task left by an interruption: %r", context.get("exception"))
        return
    loop.default_exception_handler(context)


#: what a labkit notebook's kernel imports (run_method.ipynb and report.ipynb: IPython's kernel,
#: labkit's launcher and report, matplotlib, which ipykernel's inline backend builds on), for the
#: experiment's warm process. Not that backend, which hooks into IPython when imported, nor
#: ipykernel.kernelapp (milliseconds on top of these), whose defaults read the kernel's
#: environment when imported (JPY_PARENT_PID: without it the kernel thinks it was started by
#: hand and prints so)
KERNEL = ["ipykernel.ipkernel", "IPython.display", "labkit.report", "labkit.launch.launch",
          "labkit.launch.launch_params", "matplotlib.pyplot"]
#: the backend ipykernel gives matplotlib when the environment names none (its kernelapp)
INLINE = "module://matplotlib_inline.backend_inline"


def warm_kernel(cmd: list[str], env: Optional[dict]) -> list[str]:
    """The kernel's command (``python [-X...] -m ipykernel_launcher -f FILE``) as the thin
    client of the experiment's warm process runs it, where ``env`` names one
    (labkit.launch.warm): the kernel is then forked with IPython, ipykernel, labkit's launcher
    and report and matplotlib imported, not started to import them (every method's notebook
    and the report's): as soon as those are, while the rest of the preload (torch) runs, where
    the preload lists :data:`KERNEL` first (an experiment's first kernel need not wait for
    torch). matplotlib read its backend from the warm process's environment, so the kernel's is
    named in ``env`` (ipykernel's own default), which the fork applies. Any other command, or
    no warm process: ``cmd`` unchanged."""
    from labkit.launch import warm

    if env is None:
        return cmd
    module = [a for a in cmd[1:] if not a.startswith("-X")]
    thin = warm.through([cmd[0], *module], env)
    if module[:2] != ["-m", "ipykernel_launcher"] or thin[1:3] != ["-m", "labkit.launch.warm_client"]:
        return cmd
    env.setdefault("MPLBACKEND", INLINE)
    env[warm.NEEDS] = ",".join(KERNEL)  # forked once these are in, torch or not (put first)
    return thin


def kernel_processes(pid: int, connection_file: str) -> list:
    """The kernel's processes (psutil): ``pid``, and where that is the warm process's thin
    client, the fork that runs the kernel, found by its connection file."""
    import psutil

    found = [psutil.Process(pid)]
    if "labkit.launch.warm_client" not in found[0].cmdline():
        return found
    for p in psutil.process_iter(["cmdline"]):
        line = " ".join(p.info["cmdline"] or ())
        if p.pid != pid and connection_file in line and "ipykernel_launcher" in line:
            found.append(p)
    return found


def kernel_name() -> str:
    """The project's named Jupyter kernel when installed (make setup does), else python3."""
    try:
        from jupyter_client.kernelspec import KernelSpecManager
        return KERNEL_NAME if KERNEL_NAME in KernelSpecManager().find_kernel_specs() else "python3"
    except Exception:  # noqa: BLE001
        return "python3"
