"""Test-only fault injection and tracing, installed from outside the package.

conftest.py puts this folder first on PYTHONPATH, so every Python process the tests start
(torchrun's agents and ranks, papermill's kernels, `labkit` commands) imports this module at
start-up. It registers one labkit.training.extensions trainer hook (importing nothing heavy),
which reads the variables below when a rank's Trainer is built, and adds nothing where none is
set (so a rank forked from a warm process started before the test set them reads the test's):

  LABKIT_TEST_FAULT=<method>:<rank>:<step>[:raise|kill|hang]  that rank fails at that step
      (counted from 0 in this process), so tests can check what a real crashed, killed or hung
      rank does to a run. Only on torchrun's first attempt, so an elastic restart can succeed.
  LABKIT_TEST_SLOW=<rank>:<seconds>  that asynchronous-PS worker sleeps so long after each
      backward (AsyncParameterServer.step_delay), so the others run ahead of it.
  LABKIT_TEST_LATE=<rank>:<seconds>  that rank sleeps so long before each training step (any
      method), so it arrives last at every synchronisation point and the others wait for it.
  LABKIT_TEST_TRACE=<path>  the asynchronous-PS server appends one JSON line per grant and
      per applied gradient (AsyncParameterServer.tracer).
  LABKIT_TEST_PERTURB=<method>:<rank>:<step>[:ulp|nan]  before that step (counted from 0 in
      this process) that rank's copy of the model's first parameter changes in one element,
      by one ulp (the default) or to NaN, and stops sharing memory with what the method keeps
      in sync (a parameter server's flat buffer, which the pull overwrites): with ulp the
      replicas differ from then on, as a bug in a method's synchronisation would leave them;
      with nan that rank's loss is not a number at that step.
  LABKIT_TEST_FILL=<path>:<bytes>  rank 0, once its Trainer is built (after every preflight),
      fills the filesystem holding <path> with the file <path>, leaving <bytes> free: the disk
      then runs out for real at the first large write (the first checkpoint).
  LABKIT_TEST_WORKER=<method>:<rank>:<step>:<bus|kill>  before that step that rank's DataLoader
      workers (its fork server's children) get SIGBUS or SIGKILL, as a full /dev/shm or the kernel's
      out-of-memory killer would do to them.
  LABKIT_TEST_CUDA_OOM=<method>:<rank>:<step>  before that step that rank asks the GPU for
      1 TiB: a real torch.OutOfMemoryError.
  LABKIT_TEST_PAUSE=<method>:<rank>:<epoch>:<step>:<folder>  that rank (rank * for every rank,
      method * for any), before that step of that epoch (step counted from 0 in the epoch, epoch
      from 1), writes its pid to <folder>/paused-<rank> and waits until <folder>/release exists:
      a test acts on a run at exactly that moment (kill it, signal it) instead of racing its
      clock (tests/helpers.Pause). Only on torchrun's first attempt, and once per process.
  LABKIT_TEST_COUNT=<path>  every call of a function that resolves or checks a config
      (_COUNTED), and every read of a resolved.json, appends "<who> <pid> <function>" to
      <path>; who is rank (a process torchrun started), kernel (a notebook's) or driver (any
      other: the labkit command). Wrapped at start-up, before labkit's modules import them,
      where the variable is set and in every warm process (its forks read the variable at
      each call, from their clients' environment).
  LABKIT_TEST_CENSUS=<folder>  every Python process the tests start appends one line to
      <folder>/starts.tsv at start-up: pid, parent pid, the test that started it (pytest's
      PYTEST_CURRENT_TEST, inherited) and its command line. tools/suite_census.py counts them
      by kind (torchrun agent, rank, kernel, labkit command) and by test: what the suite starts.
"""
import os


def _at(name: str, method: str, rank: int):
    """(step, extra fields) of a <method>:<rank>:<step>[:...] variable meant for this rank."""
    try:
        m, r, s, *rest = os.environ.get(name, "").split(":")
        return (int(s), rest) if m == method and int(r) == rank else None
    except ValueError:
        return None


def _fill(spec: str) -> None:
    """Fill the filesystem of the file ``path`` so that only ``leave`` bytes stay free."""
    path, leave = spec.rsplit(":", 1)
    st = os.statvfs(os.path.dirname(path))
    n = st.f_bavail * st.f_frsize - int(leave)
    if n > 0:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.posix_fallocate(fd, 0, n)
        finally:
            os.close(fd)


def _kill_workers(how: str) -> None:
    import signal
    import time

    import psutil

    sig = signal.SIGBUS if how == "bus" else signal.SIGKILL
    me = psutil.Process()
    for p in me.children(recursive=True):
        if p.ppid() != me.pid:  # a loader worker: the fork server's child (labkit.training.workers)
            p.send_signal(sig)
    time.sleep(0.5)


def _cuda_oom() -> None:
    import torch

    torch.empty(1 << 40, dtype=torch.uint8, device="cuda")


def _fault(method: str, rank: int):
    spec = os.environ.get("LABKIT_TEST_FAULT", "")
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return None
    try:
        m, r, s, *kind = spec.split(":")
        return (int(s), kind[0] if kind else "raise") if m == method and int(r) == rank else None
    except ValueError:
        return None


def _perturb_at(method: str, rank: int):
    try:
        m, r, s, *kind = os.environ.get("LABKIT_TEST_PERTURB", "").split(":")
        return (int(s), kind[0] if kind else "ulp") if m == method and int(r) == rank else None
    except ValueError:
        return None


def _perturb(trainer, kind: str) -> None:
    import torch

    p = next(trainer.model.parameters())
    with torch.no_grad():
        copy = p.detach().clone()  # its own memory: no pull or broadcast writes it any more
        flat = copy.view(-1)
        up = torch.tensor(float("inf"), dtype=flat.dtype)
        flat[0] = float("nan") if kind == "nan" else torch.nextafter(flat[0], up)
        p.data = copy


def _fail(kind: str, step: int) -> None:
    import signal
    import time

    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "hang":
        while True:  # a rank stuck outside any collective: its peers time out waiting for it
            time.sleep(60)
    raise RuntimeError(f"injected fault (LABKIT_TEST_FAULT) at step {step}")


def _slow(rank: int, name: str = "LABKIT_TEST_SLOW") -> float:
    try:
        r, s = os.environ.get(name, "").split(":")
        return float(s) if int(r) == rank else 0.0
    except ValueError:
        return 0.0


def _pause_at(method: str, rank: int):
    """(epoch, step, folder) of LABKIT_TEST_PAUSE when it is meant for this rank."""
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return None
    try:
        m, r, e, s, folder = os.environ.get("LABKIT_TEST_PAUSE", "").split(":", 4)
        mine = m in (method, "*") and (r == "*" or int(r) == rank)
        return (int(e), int(s), folder) if mine else None
    except ValueError:
        return None


def _pause(folder: str, rank: int) -> None:
    import time

    held = os.path.join(folder, f"paused-{rank}")
    with open(held + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(held + ".tmp", held)  # whole or absent
    while not os.path.exists(os.path.join(folder, "release")):
        time.sleep(0.02)


def _install() -> None:
    import json

    from labkit.training import extensions

    def on_trainer(trainer) -> None:
        fault = _fault(trainer.cfg.method, trainer.ctx.rank)
        if fault:
            def check(tr, step: int) -> None:
                if step == fault[0]:
                    _fail(fault[1], step)
            trainer.step_callbacks.append(check)
        at = _perturb_at(trainer.cfg.method, trainer.ctx.rank)
        if at is not None:
            trainer.step_callbacks.append(lambda tr, step: _perturb(tr, at[1]) if step == at[0] else None)
        m, r = trainer.cfg.method, trainer.ctx.rank
        pause = _pause_at(m, r)
        if pause is not None:
            held = []

            def hold(tr, step: int) -> None:
                if not held and tr.epoch == pause[0] and tr.step == pause[1]:
                    held.append(step)
                    _pause(pause[2], tr.ctx.rank)
            trainer.step_callbacks.append(hold)
        fill = os.environ.get("LABKIT_TEST_FILL")
        if fill and r == 0 and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            _fill(fill)
        worker = _at("LABKIT_TEST_WORKER", m, r)
        if worker is not None:
            trainer.step_callbacks.append(
                lambda tr, step: _kill_workers(worker[1][0]) if step == worker[0] else None)
        oom = _at("LABKIT_TEST_CUDA_OOM", m, r)
        if oom is not None:
            trainer.step_callbacks.append(lambda tr, step: _cuda_oom() if step == oom[0] else None)
        late = _slow(trainer.ctx.rank, "LABKIT_TEST_LATE")
        if late:
            import time
            trainer.step_callbacks.append(lambda tr, step: time.sleep(late))
        s = trainer.strategy
        if hasattr(s, "step_delay"):
            s.step_delay = _slow(trainer.ctx.rank)
        path = os.environ.get("LABKIT_TEST_TRACE")
        if path and hasattr(s, "tracer"):
            def trace(event: dict) -> None:
                with open(path, "a") as f:
                    f.write(json.dumps(event) + "\n")
            s.tracer = trace

    extensions.on_trainer(on_trainer)


_COUNTED = (("labkit.core.params", "check_values"), ("labkit.workloads", "resolve"),
            ("labkit.training.preflight", "preflight"), ("labkit.training.budget", "machine"),
            ("labkit.launch.torchrun_job", "validate"), ("labkit.core.resolved", "read"))


def _count() -> None:
    import functools
    import importlib
    import sys

    def counted(f, name):
        @functools.wraps(f)
        def call(*a, **k):
            path = os.environ.get("LABKIT_TEST_COUNT")  # a process forked warm: the client's
            if path:
                # sys.argv as it is by now (at start-up, `python -m ipykernel_launcher` reads "-m")
                who = ("rank" if "LOCAL_RANK" in os.environ else
                       "kernel" if "ipykernel" in sys.argv[0] else "driver")
                with open(path, "a") as out:
                    out.write(f"{who} {os.getpid()} {name}\n")
            return f(*a, **k)
        return call

    for module, name in _COUNTED:
        m = importlib.import_module(module)
        setattr(m, name, counted(getattr(m, name), name))


def _census(folder: str) -> None:
    import sys

    test = os.environ.get("PYTEST_CURRENT_TEST", "-").rsplit(" (", 1)[0]
    line = "\t".join((str(os.getpid()), str(os.getppid()), test,
                      " ".join(sys.orig_argv).replace("\t", " ").replace("\n", " ")))
    # one write of a short line to a file opened for appending: lines from processes starting
    # at once do not interleave
    fd = os.open(os.path.join(folder, "starts.tsv"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line[:4000] + "\n").encode())
    finally:
        os.close(fd)


if os.environ.get("LABKIT_TEST_CENSUS"):
    try:
        _census(os.environ["LABKIT_TEST_CENSUS"])
    except OSError:  # the folder is gone: the census is not the test
        pass

# where it is set, and in a warm process (labkit.launch.warm: conftest's, one per pytest worker,
# or an experiment's), whose forks take the variable from their clients: the record's path is
# read at each call (the counted modules import no torch: 0.4 s at a warm process's start)
if os.environ.get("LABKIT_TEST_COUNT") or "labkit.launch.warm" in __import__("sys").orig_argv:
    try:
        _count()
    except ImportError:  # a Python without labkit
        pass

# always: the hook reads the variables above when a Trainer is built, not at start-up, so a rank
# forked from a warm process started before a test set them (conftest's, one per pytest worker)
# gets the test's; without them it adds nothing to the Trainer
try:
    _install()
except ImportError:  # a Python without labkit (e.g. a tool's own interpreter)
    pass
