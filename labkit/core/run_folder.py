"""The one reader of a run folder: every command that looks into one (report, runs, diff,
reproduce, continue, the explorer, a sweep's report) opens it here.

    folder = RunFolder("runs/latest")             # never fails: reads on demand
    folder.kind, folder.config, folder.env        # "experiment" | "repeats" | ...; {} when absent
    folder.result_paths("ddp")                     # where the method's result files lie
    RunFolder.experiment("runs/a")                 # strict: an experiment's folder or one line

It opens any run folder labkit writes (an experiment, its repeats, a sweep, a bench, a
reproduction, failed or interrupted ones) and the older shapes readers accept: result files
straight in the folder (the guide's scripts) or in method folders without config.json. Where
each file lies is labkit.core.layout's; what a result file means is the analysis' (it reads
them through :func:`read_json`). Nothing here writes.
"""
from __future__ import annotations

import json
import os
from functools import cached_property
from pathlib import Path
from typing import Any, Optional

from . import layout
from .errors import ConfigError
from .lockfile import parse_lock
from .results import Result, ResultError, read_result
from .methods import METHOD_ORDER, RESULT_FILES, MethodSpec, is_name, register, result_file_of

# "run": one method's run (`labkit run --out DIR`: its result file straight in the folder,
# beside the resolved.json its launcher wrote), or the guide's scripts' loose result files
KINDS = ("experiment", "repeats", "sweep", "bench", "reproduction", "run")
# config fields that say where a run went or how it printed, not what it measured
NOT_PARAMETERS = ("out", "progress", "runs_dir", "tag", "cell_timeout", "report", "nodes", "method")


class RunFolderError(ConfigError):
    """Not a run folder of the kind asked for, or a corrupt one: one line naming the problem."""


def read_json(path: str | os.PathLike) -> Any:
    """A JSON document of a run folder (or a loose result file); OSError or ValueError (a
    JSONDecodeError, a UnicodeDecodeError) when it cannot be read."""
    return json.loads(Path(path).read_text())


def parameters(config: dict) -> dict[str, Any]:
    """What a run measured with, from its config.json: the training config and the
    experiment's parameters in one dict (the experiment's win), without NOT_PARAMETERS."""
    exp, train = config.get("experiment") or {}, config.get("train") or {}
    nodes = exp.get("nodes") if isinstance(exp.get("nodes"), dict) else {}
    # an emulated cluster is what the run measured on (a real node's place is not)
    emulated = ({"emulate_nodes": nodes["emulate_nodes"], "link": nodes.get("link") or "unshaped"}
                if nodes.get("emulate_nodes") else {})
    return {k: v for k, v in {**train, **exp, **emulated}.items() if k not in NOT_PARAMETERS}


def goodputs(link: dict) -> list[float]:
    """Every goodput (Mbit/s) an emulated link's probe measured: each node, up and down."""
    return [g[k] for g in link.get("goodput_mbit") or [] for k in ("up", "down")
            if isinstance(g.get(k), (int, float))]


def describe_link(link: Optional[dict]) -> str:
    """An emulated link as a result file records it (labkit.launch.cluster.link_record), in a few
    words: "2 nodes x 2 ranks, 100mbit, measured 93-95 Mbit/s"; "" for none."""
    if not isinstance(link, dict):
        return ""
    got = goodputs(link)
    return (f"{link.get('nodes')} nodes x {link.get('ranks_per_node')} ranks, {link.get('link')}"
            + (f", measured {min(got):.0f}-{max(got):.0f} Mbit/s" if got else ""))


def recorded(result: Result) -> Optional[MethodSpec]:
    """Register the method spec a result file records (labkit.training.result_file); None for
    a file without one, or one that names a key another method holds."""
    d = result.method_spec
    if not isinstance(d, dict) or d.get("builtin"):
        return None
    ref = result.config.get("method") if isinstance(result.config, dict) else None
    try:  # known by its key, and by the reference its run was given
        return register(MethodSpec.from_dict(d), *([ref] if isinstance(ref, str) else []))
    except (ConfigError, TypeError, ValueError):
        return None


class RunFolder:
    """One run folder, read on demand. The documents (``config``, ``env``, ``status``) are
    {} when absent or unreadable; :meth:`read` and :meth:`strict` say why instead."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunFolder({str(self.path)!r})"

    # ---------------------------------------------------------------- files
    def file(self, name: str) -> Path:
        return self.path / name

    def has(self, name: str) -> bool:
        return (self.path / name).exists()

    def read(self, name: str) -> Any:
        """A JSON document of the folder; OSError or ValueError when it cannot be read."""
        return read_json(self.path / name)

    def get(self, name: str, default: Any = None) -> Any:
        """A JSON document of the folder, or ``default`` when it is missing or unreadable."""
        try:
            return read_json(self.path / name)
        except (OSError, ValueError):
            return default

    def strict(self, name: str, what: str) -> Any:
        """A JSON document of the folder, or a one-line RunFolderError naming the problem."""
        path = self.path / name
        try:
            return read_json(path)
        except json.JSONDecodeError as e:
            raise RunFolderError(f"{str(path)!r} is not valid JSON (line {e.lineno}, column "
                                 f"{e.colno}): the {what} is corrupt") from None
        except OSError as e:
            raise RunFolderError(f"cannot read {str(path)!r}: {e.strerror}") from None

    def _dict(self, name: str) -> dict:
        doc = self.get(name)
        return doc if isinstance(doc, dict) else {}

    # ---------------------------------------------------------------- documents
    @cached_property
    def config(self) -> dict:
        """config.json: the experiment's parameters and each method's resolved config."""
        return self._dict(layout.CONFIG)

    @cached_property
    def env(self) -> dict:
        """environment.json: what ran where."""
        return self._dict(layout.ENVIRONMENT)

    @cached_property
    def status(self) -> dict:
        """experiment.json: each method's status, the run order."""
        return self._dict(layout.EXPERIMENT)

    @property
    def methods(self) -> dict[str, dict]:
        """Method (or variant) -> its resolved TrainConfig dict, as config.json records them."""
        resolved = self.config.get("resolved")
        return resolved if isinstance(resolved, dict) else {}

    @property
    def parameters(self) -> dict[str, Any]:
        """The run's parameters (:func:`parameters` of its config.json)."""
        return parameters(self.config)

    @property
    def target_accuracy(self) -> Optional[float]:
        """`labkit experiment --target-accuracy`; None for a folder written before the flag."""
        return self._experiment_number("target_accuracy")

    @property
    def target(self) -> Optional[float]:
        """`labkit experiment --target`: the target of the workload's first validation figure
        (a loss for a language model), in its unit; None where it was not given."""
        return self._experiment_number("target")

    def _experiment_number(self, key: str) -> Optional[float]:
        """A number of config.json's experiment parameters; None where absent or not one."""
        exp = self.config.get("experiment")
        v = exp.get(key) if isinstance(exp, dict) else None
        return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    def lock_file(self, env: Optional[dict] = None) -> Optional[Path]:
        """The requirements.lock that environment.json (or ``env``) names, where it lies now;
        None without one."""
        lock = ((self.env if env is None else env).get("packages") or {}).get("file")
        path = layout.resolve_in_run(self.path, lock) if lock else None
        return path if path and path.exists() else None

    def package_versions(self, env: Optional[dict] = None) -> Optional[dict[str, str]]:
        """{package: version} of :meth:`lock_file`; None without one."""
        path = self.lock_file(env)
        return parse_lock(path.read_text()) if path else None

    # ---------------------------------------------------------------- what it is
    @property
    def kind(self) -> str:
        """One of KINDS; ValueError when the folder is none of them."""
        for kind, name in (("sweep", layout.SWEEP), ("bench", layout.BENCH),
                           ("reproduction", layout.REPRODUCTION)):
            if self.has(name):
                return kind
        if self.repeats:
            return "repeats"
        if self.has(layout.CONFIG) or self.has(layout.EXPERIMENT) or self.found_methods():
            return "experiment"
        if self.loose_methods() or self.has(layout.resolved_file()):
            return "run"
        raise ValueError("not a run folder (no config.json, experiment.json, resolved.json, "
                         "results_*.json, sweep.json or bench.json)")

    @property
    def repeats(self) -> list[Path]:
        """repeat-1/, repeat-2/, ... in order; [] without repeats."""
        return layout.repeat_dirs(self.path)

    # ---------------------------------------------------------------- result files
    def discover(self) -> None:
        """Register the methods of one's own whose result files lie here (in the method
        folders, their repeats', or loose), before the registry's order is walked."""
        run = self.path
        found = [*run.glob("results_*.json"), *run.glob("*/results_*.json"),
                 *run.glob(layout.REPEAT_PREFIX + "*/*/results_*.json")]
        for path in sorted(found):
            try:
                recorded(read_result(path))
            except ResultError:
                continue

    def found_methods(self) -> list[str]:
        """The methods with a result file in their own folder (<run>/<method>/), in order."""
        return [m for m, f in RESULT_FILES.items() if (self.path / m / f).exists()]

    def loose_methods(self) -> list[str]:
        """The methods with a result file straight in the folder (<run>/<file>: a `labkit run`
        folder, the guide's scripts'), in order."""
        return [m for m, f in RESULT_FILES.items() if (self.path / f).is_file()]

    def result_paths(self, method: str) -> list[Path]:
        """Where ``method``'s result files are expected: one per repeat with repeats, else
        <run>/<method>/<file>, or the loose <run>/<file> when only that one exists."""
        name = RESULT_FILES[method]
        if self.repeats:
            return [d / method / name for d in self.repeats]
        inside, loose = self.path / method / name, self.path / name
        return [loose if not inside.exists() and loose.exists() else inside]

    def has_results(self) -> bool:
        """Whether any method has a result file where :meth:`result_paths` looks (the methods
        of one's own discovered first)."""
        self.discover()
        return any(p.is_file() for m in METHOD_ORDER for p in self.result_paths(m))

    # ---------------------------------------------------------------- an experiment's folder
    @classmethod
    def experiment(cls, path: str | os.PathLike) -> "RunFolder":
        """A folder written by ``labkit experiment``, with its config and environment read now:
        RunFolderError (one line) when it is not one, or its config.json is corrupt."""
        run = Path(path)
        if not run.exists():
            raise RunFolderError(f"{str(run)!r} does not exist")
        if not run.is_dir():
            raise RunFolderError(f"{str(run)!r} is not a folder (expected a run folder made by "
                                 f"labkit experiment)")
        self = cls(run)
        self.discover()  # methods of one's own: named as their result files record them
        if not self.has(layout.CONFIG):
            if self.has(layout.SWEEP):  # each point is an experiment's folder
                points = sorted(p.name for p in run.iterdir() if (p / layout.CONFIG).is_file())
                raise RunFolderError(f"{str(run)!r} is a sweep's folder: give one of its points "
                                     f"({', '.join(points) or 'none has started'})")
            if self.has(layout.EXPERIMENT) or self.has(layout.ENVIRONMENT):
                raise RunFolderError(f"{str(run)!r} has no config.json: the run folder is "
                                     f"incomplete and cannot be reproduced")
            raise RunFolderError(f"{str(run)!r} is not a run folder (no config.json; labkit "
                                 f"experiment makes run folders)")
        config = self.strict(layout.CONFIG, "run's config")
        resolved = config.get("resolved") if isinstance(config, dict) else None
        if not isinstance(resolved, dict) or not resolved or not all(
                isinstance(c, dict) and is_name(c.get("method")) for c in resolved.values()):
            raise RunFolderError(f"{str(self.file(layout.CONFIG))!r} is not a labkit experiment "
                                 f"config (no 'resolved' methods)")
        env = self.strict(layout.ENVIRONMENT, "environment record") if self.has(layout.ENVIRONMENT) else {}
        self.config, self.env = config, env if isinstance(env, dict) else {}
        return self

    def method_dir(self, method: str) -> Path:
        return self.path / method

    def result_path(self, method: str) -> Path:
        """The result file of one of the experiment's methods (or variants)."""
        return self.method_dir(method) / result_file_of(self.methods[method]["method"])

    def result(self, method: str) -> Optional[Result]:
        """The method's result file, or None when it is missing or unreadable."""
        try:
            return read_result(self.result_path(method))
        except ResultError:
            return None

    def link(self) -> str:
        """The emulated link its methods ran on (describe_link of the first result file that
        records one, with the goodputs of all, repeats too), "" for a run on one machine."""
        links = []
        for path in sorted(self.path.rglob("results_*.json")):  # every method, every repeat
            try:
                link = read_result(path).link
            except ResultError:
                continue
            if isinstance(link, dict):
                links.append(link)
        if not links:
            return ""
        return describe_link({**links[0], "goodput_mbit": [g for x in links for g in x.get("goodput_mbit") or []]})
