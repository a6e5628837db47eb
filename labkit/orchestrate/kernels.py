"""The Jupyter kernels papermill runs labkit's notebooks on: which kernel, and how it starts
and stops (labkit.orchestrate.experiment runs the experiment's notebooks with these settings)."""
from __future__ import annotations

import time

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
    - The kernel is killed when its last cell is done (nbclient's shutdown_kernel="immediate"):
      all it makes is on disk by then, and a graceful shutdown waited seconds per notebook for
      Python's teardown of torch and matplotlib (docs/performance.md).
    - Except while it still runs a launch (the experiment was interrupted): jupyter_client
      interrupts a kernel before it kills it, and the kill came before launch could stop
      torchrun's process group; torchrun, left to its parent-death SIGTERM, now and then hung
      on with its ranks dead (seen once in a clean-clone suite). So a kernel with
      child processes is interrupted and given ``STOP_GRACE_S`` to see them gone first.
    """
    import asyncio

    import psutil
    from jupyter_client.manager import AsyncKernelManager

    class IPCKernelManager(AsyncKernelManager):
        def __init__(self, **kw):
            kw.setdefault("transport", "ipc")
            super().__init__(**kw)

        async def shutdown_kernel(self, now: bool = False, restart: bool = False) -> None:
            pid = getattr(self.provisioner, "pid", None) if self.has_kernel else None
            try:
                busy = pid is not None and psutil.Process(pid).children()
            except psutil.Error:
                busy = False
            if busy:
                await self.interrupt_kernel()  # KeyboardInterrupt in launch(): launch._stop
                deadline = time.monotonic() + STOP_GRACE_S
                while time.monotonic() < deadline and _running(busy):
                    await asyncio.sleep(0.1)
            await super().shutdown_kernel(now=now, restart=restart)

    return {"kernel_manager_class": IPCKernelManager, "shutdown_kernel": "immediate"}


def kernel_name() -> str:
    """The project's named Jupyter kernel when installed (make setup does), else python3."""
    try:
        from jupyter_client.kernelspec import KernelSpecManager
        return KERNEL_NAME if KERNEL_NAME in KernelSpecManager().find_kernel_specs() else "python3"
    except Exception:  # noqa: BLE001
        return "python3"
