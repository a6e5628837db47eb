"""How the labkit program stops. SIGTERM (scancel, a job's time limit, kill) ends a command as
Ctrl-C does: a KeyboardInterrupt, which stops every child process on its way (a method's
kernel interrupted, torchrun's group stopped, the warm process ended) and marks the run
interrupted, then one line from labkit.cli.main and exit code 130; `labkit experiment
--continue RUN` finishes the experiment. Every time: from the program's first line
(labkit/__main__.py), once however many SIGTERMs come, and never lost where Python cannot
raise it. The standard library only: labkit/__main__.py installs it before labkit.cli is
imported."""
from __future__ import annotations

import _thread
import logging
import signal
from typing import Callable

log = logging.getLogger("labkit.cli")  # the line labkit.cli.main says

#: what the one line says after "labkit COMMAND: "
INTERRUPTED = "interrupted; every child process was stopped"


class Stop:
    """Where this process stands (labkit.cli.main sets it)."""
    #: a KeyboardInterrupt was raised for a SIGTERM, or the command is over: a second SIGTERM
    #: while the first one's cleanup runs (scancel and a job's time limit signal every process
    #: of the job at once, a kill may be repeated) is let pass, so that the cleanup is not cut
    #: short (the kernel interrupted and given its grace, experiment.json marked interrupted)
    raised = False
    #: a command runs: a KeyboardInterrupt Python had to drop is raised again (unraisable)
    running = False


def on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM's handler: KeyboardInterrupt, once (:attr:`Stop.raised`)."""
    if Stop.raised:
        return
    Stop.raised = True
    raise KeyboardInterrupt


def unraisable(hook: Callable) -> Callable:
    """sys.unraisablehook for the labkit program, around ``hook``. A KeyboardInterrupt raised
    where Python cannot raise one (a weakref callback, a __del__, the garbage collector:
    asyncio's WeakSet of tasks drops one all the time while a notebook runs) was printed as
    "Exception ignored in ..." with its traceback and then lost: the experiment ran on to its
    end, its SIGTERM or Ctrl-C gone. It is raised again instead, by :func:`on_sigterm` once
    this hook has returned; once the command is over (the process is ending), dropped."""
    def unraisable_hook(u) -> None:
        if not (isinstance(u.exc_type, type) and issubclass(u.exc_type, KeyboardInterrupt)):
            hook(u)
        elif Stop.running:
            Stop.raised = False
            # from another thread: the main thread runs a signal's handler at its next
            # bytecode, which would still be this hook's, where the KeyboardInterrupt is
            # dropped again ("Exception ignored in sys.unraisablehook")
            _thread.start_new_thread(_thread.interrupt_main, (signal.SIGTERM,))
    return unraisable_hook


def command_of(argv: list[str]) -> str:
    """The command an argument list names (its first word that is not an option), for the line
    of a stop that came before the parser said."""
    return next((a for a in argv if not a.startswith("-")), "")


def interrupted(command: str) -> int:
    """Say the one line of a command stopped by Ctrl-C or SIGTERM; its exit code, 130.

    CPython is also told the KeyboardInterrupt was handled: one that passed through an exec()
    of source text on its way here (dataclasses and namedtuple build their methods so, at every
    import: torch's take seconds) left the interpreter's "unhandled KeyboardInterrupt" flag
    set, and `python -m labkit` then killed itself with SIGINT at its exit, after the line (-2
    to its parent, not 130). Running any source text clears that flag."""
    Stop.raised = True  # a SIGTERM from here on: let pass, the command is over
    log.error("labkit%s: %s", f" {command}" if command else "", INTERRUPTED)
    exec("")  # noqa: S102 - empty: only the interpreter's reset at the start of an exec
    return 130
