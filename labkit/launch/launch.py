"""The launcher: validate, build the torchrun command, run it, stream, keep logs, explain failures.

    from .launch import launch
    result = launch(cfg, nproc=4, out_dir="runs/x/ddp")   # live output, per-rank logs
    result.check()                                         # LaunchError with one clear message

Every subprocess gets an argument list, never a shell string.
"""
from __future__ import annotations

import logging
import os
import shlex
import signal
import subprocess
import time
from typing import IO, Optional

from labkit.core import layout
from labkit.core.config import TrainConfig
from labkit.core.files import atomic_write_json
from labkit.core.log import transcript
from labkit.core.methods import key_of
from labkit.core.procs import die_with_parent, started_by
from labkit.core.resources import oom_kills
from labkit.core.status import INTERRUPTED_WHY, Status

from . import warm
from .emulated import launch_emulated
from .failures import explain_failure
from .launch_params import Nodes
from .torchrun_job import (LaunchError, LaunchResult, Throttle, check_out, checked_config,  # noqa: F401
                           environment, log_dir_of, mark_ended, shown_ranks, torchrun_command,
                           validate, warn, write_resolved)
from .torchrun_output import TorchrunOutput

# LaunchError, check_out, validate, write_resolved: the launcher's API, defined with the job's parts
__all__ = ["launch", "LaunchError", "LaunchResult", "check_out", "validate", "warn",
           "write_resolved", "mark_ended", "torchrun_command"]

log = logging.getLogger(__name__)


def launch(cfg: TrainConfig, nproc: int, out_dir: str, nodes: Nodes = Nodes(),
           stream: Optional[IO[str]] = None, env: Optional[dict] = None,
           throttle_s: float = 2.0, module: str = "labkit.train",
           extra: tuple[str, ...] = (), resolved: Optional[str] = None) -> LaunchResult:
    """Validate, then run one method under torchrun and wait for it.

    Raises ConfigError (in seconds, before spawning) for bad input; returns a LaunchResult
    whose ``message`` explains a failed rank. ``resolved``: the resolved.json ``cfg`` was read
    from (labkit.core.resolved; labkit experiment wrote it, having checked everything for this
    machine), so nothing is checked again and the ranks read that file; without it, the
    checked config is written to ``out_dir`` for the ranks.
    """
    stream = stream or transcript(__name__)  # the reporting ranks' lines, at INFO
    if nodes.emulated:  # one torchrun per emulated node (labkit.launch.emulated)
        return launch_emulated(cfg, nproc, out_dir, nodes, stream, env, throttle_s, module,
                               extra, resolved)
    if resolved is None:
        cfg, resolved = checked_config(cfg, nproc, out_dir, nodes, module)
    log_dir = log_dir_of(out_dir, nodes)
    show = shown_ranks(cfg, nproc)
    cmd = torchrun_command(cfg, nproc, log_dir, nodes, show, module, extra, resolved)
    t0, started, kills = time.monotonic(), time.time(), oom_kills()
    try:
        full_env = environment(nproc, env, nodes.max_restarts)
        # the agent forked by a warm process on this machine that fits this process, where
        # there is one (labkit.launch.warm): a node of several too, each node on its own host
        returncode, text = _run(warm.through(cmd, full_env), full_env, Throttle(stream, throttle_s))
    except KeyboardInterrupt:
        mark_ended(out_dir, cfg.result_file, Status.INTERRUPTED, INTERRUPTED_WHY)
        raise
    res = LaunchResult(cfg.method, returncode, out_dir, log_dir, cmd, time.monotonic() - t0,
                       started_at=started)
    if not res.ok:
        after = oom_kills()
        why = explain_failure(key_of(cfg.method), returncode, text, log_dir, nodes.multi,
                              oom=None if kills is None or after is None else after > kills)
        res.message, res.failed_rank, res.log_tail = why.message, why.rank, why.lines
        res.explained_from = why.error_file
    _record(res, cfg, nproc, nodes, text)
    return res


def _record(res: LaunchResult, cfg: TrainConfig, nproc: int, nodes: Nodes, text: str) -> None:
    """torchrun.log, the result file of a failed run marked failed, launch.json; on a disk too
    full for them the run's own message still stands (it says so when the disk is why)."""
    cmd, out_dir = res.command, res.out_dir
    try:
        with open(os.path.join(res.log_dir, layout.TORCHRUN_LOG), "w") as f:
            f.write(" ".join(cmd) + "\n\n" + text)
        if not res.ok:
            mark_ended(out_dir, cfg.result_file, Status.FAILED, res.message.splitlines()[0])
        # paths inside out_dir relative to it (the command runs from there), so a run folder
        # that is copied or moved does not point back at where it ran
        atomic_write_json(os.path.join(out_dir, layout.launch_file(nodes.node_rank)), layout.portable({
            "method": cfg.method, "nproc": nproc, "command": cmd, "command_line": shlex.join(cmd),
            "returncode": res.returncode, "wall_time": res.wall_time, "failed_rank": res.failed_rank,
            "message": res.message, "explained_from": res.explained_from, **res.times(),
            "launched_from": started_by()}, out_dir))  # the notebook's kernel: cold, or forked warm
    except OSError as e:
        if res.ok:
            raise
        warn([f"could not record the failure in {out_dir} ({e.strerror})"])


def _run(cmd: list[str], env: dict, out: "Throttle") -> tuple[int, str]:
    """Run torchrun, streaming what the shown ranks print (labkit.launch.torchrun_output decides
    which lines; the others are debug lines); (exit code, all it printed). Any exception here
    (Ctrl-C included) stops torchrun and every rank first."""
    captured: list[str] = []
    reader = TorchrunOutput()
    log.debug("torchrun: %s", shlex.join(cmd))
    # start_new_session: Ctrl-C in a notebook reaches us, and we stop the whole group
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                            text=True, bufsize=1, errors="replace", start_new_session=True,
                            preexec_fn=_die_with_parent)
    try:
        for raw in proc.stdout:
            captured.append(raw)
            for line in reader.feed(raw):
                if line.shown:
                    out.line(line.text, is_progress=line.progress)
                elif line.text.strip():
                    log.debug("%s", line.text)
        proc.wait()
    except BaseException:
        _stop(proc)
        raise
    return proc.returncode, "".join(captured)


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM if the launching process dies (a Jupyter kernel
    shut down, a killed job), so torchrun stops its ranks instead of running on orphaned (not
    Linux: Ctrl-C and _stop still stop the group)."""
    die_with_parent(signal.SIGTERM)


def _stop(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """Stop torchrun and every rank: SIGINT to the group, then SIGKILL after ``grace``."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass
