"""Test-only fault injection and tracing, installed from outside the package.

conftest.py puts this folder first on PYTHONPATH, so every Python process the tests start
(torchrun's agents and ranks, papermill's kernels, `labkit` commands) imports this module at
start-up. With none of the variables below set it does nothing (and imports nothing heavy);
with one set it registers a labkit.training.hooks trainer hook, which the rank's Trainer calls:

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
"""
import os

_NAMES = ("LABKIT_TEST_FAULT", "LABKIT_TEST_SLOW", "LABKIT_TEST_LATE", "LABKIT_TEST_TRACE",
          "LABKIT_TEST_PERTURB")


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


def _install() -> None:
    import json

    from labkit.training import hooks

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

    hooks.on_trainer(on_trainer)


if any(os.environ.get(n) for n in _NAMES):
    try:
        _install()
    except ImportError:  # a Python without labkit (e.g. a tool's own interpreter)
        pass
