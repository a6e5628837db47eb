"""A rank says where it stood when its run went wrong, into its own log (stderr), for the
launcher to name (labkit.launch.failures) and for a person to read:

- :func:`dump_live`: every thread's Python stack, the main thread's position first as one
  marker line. Called from the SIGTERM thread (labkit.training.lifecycle), so a rank that hung
  in a method's own code, stopped by torchrun because another rank timed out waiting for it,
  still shows where it was; and by the stall watchdog (:func:`watch`).
- :func:`mark_raised`: the marker line of a rank whose exception ends it (a collective that
  timed out: where it waited), from the exception's traceback.

The marker's words are labkit.core.stacks'. Python's faulthandler would dump the frames too,
but raw, and without the position in the user's code a failure's line needs.
"""
from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from typing import Callable, Optional

from labkit.core import stacks


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def dump_live(how: str, file=None) -> str:
    """Write the marker line of the main thread's position, then every thread's stack, to
    ``file`` (stderr); the position."""
    file = file or sys.stderr
    frames = sys._current_frames()
    main = frames.get(threading.main_thread().ident)
    where = stacks.position(stacks.of_frame(main)) if main is not None else ""
    lines = [stacks.mark(_rank(), how, where)]
    names = {t.ident: t.name for t in threading.enumerate()}
    for ident, frame in frames.items():
        if ident == threading.get_ident():
            continue  # this thread: the dump itself
        lines.append(f"{stacks.DUMP} thread {names.get(ident, ident)} (most recent call last):")
        lines += [f"{stacks.DUMP} {l}" for chunk in traceback.format_stack(frame)
                  for l in chunk.rstrip("\n").splitlines()]
    try:
        file.write("\n".join(lines) + "\n")
        file.flush()
    except (OSError, ValueError):
        pass
    return where


def mark_raised(e: BaseException, file=None) -> str:
    """Write the marker line of where ``e`` was raised in the rank's code; the position."""
    where = stacks.position(stacks.of_traceback(e.__traceback__), waiting=False)
    how = "timed out" if stacks.TIMED_OUT.search(str(e)) else f"raised {type(e).__name__}"
    try:
        print(stacks.mark(_rank(), how, where), file=file or sys.stderr, flush=True)
    except (OSError, ValueError):
        pass
    return where


def watch(progress: Callable[[], object], bound_s: float,
          give_up: Callable[[str], None], every: float = 1.0) -> threading.Thread:
    """A daemon thread that calls ``give_up(position)`` after dumping every stack, once
    ``progress()`` has returned the same value for ``bound_s`` seconds: a rank stuck where no
    collective's timeout can end it (every rank waiting in its own code). ``give_up`` ends the
    process."""
    def run() -> None:
        last, since = progress(), time.monotonic()
        while True:
            time.sleep(every)
            now = progress()
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since > bound_s:
                give_up(dump_live(f"{stacks.STALLED} {bound_s:g} s"))
                return
    t = threading.Thread(target=run, name="labkit-stall-watch", daemon=True)
    t.start()
    return t


def stalled_line(method: str, rank: int, bound_s: float, where: Optional[str]) -> str:
    """The one line of a rank that the watchdog ended."""
    at = f" at {where}" if where else ""
    return (f"{method} failed: rank {rank} {stacks.STALLED} {bound_s:g} s (twice --timeout){at}: "
            f"it waits in its own code, where no collective's timeout can end it")
