"""A run folder made by ``labkit experiment`` as the comparisons read it (``labkit reproduce``'s
verdicts, the environment comparison): its config.json, environment.json and result files.

Bad input (not a run folder, a missing or corrupt config.json, a method the run did not
have) raises :class:`ReproduceError`, a ConfigError: one line, exit 2 in the CLI.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

from labkit.core import layout
from labkit.core.config import ConfigError
from labkit.core.methods import is_name, result_file_of


class ReproduceError(ConfigError):
    """Bad input for a comparison: one line naming the problem."""


@dataclass
class RunRecord:
    """A run folder as the comparison reads it."""
    path: Path
    config: dict                       # config.json
    methods: dict[str, dict]           # method (or variant) -> its resolved TrainConfig dict
    env: dict = field(default_factory=dict)  # environment.json ({} when absent)

    def method_dir(self, method: str) -> Path:
        return self.path / method

    def result_path(self, method: str) -> Path:
        return self.method_dir(method) / result_file_of(self.methods[method]["method"])

    def result(self, method: str) -> Optional[dict]:
        """The method's result file, or None when it is missing or unreadable."""
        try:
            return json.loads(self.result_path(method).read_text())
        except (OSError, ValueError):
            return None


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ReproduceError(f"{str(path)!r} is not valid JSON (line {e.lineno}, column "
                             f"{e.colno}): the {what} is corrupt") from None
    except OSError as e:
        raise ReproduceError(f"cannot read {str(path)!r}: {e.strerror}") from None


def load_run_record(run_dir: str | os.PathLike) -> RunRecord:
    """Read a run folder written by ``labkit experiment``; ReproduceError when it is not one."""
    run = Path(run_dir)
    if not run.exists():
        raise ReproduceError(f"{str(run)!r} does not exist")
    if not run.is_dir():
        raise ReproduceError(f"{str(run)!r} is not a folder (expected a run folder made by "
                             f"labkit experiment)")
    from .report.load import discover

    discover(run)  # methods of one's own: named as their result files record them
    cfg_path = run / layout.CONFIG
    if not cfg_path.exists():
        if (run / layout.EXPERIMENT).exists() or (run / layout.ENVIRONMENT).exists():
            raise ReproduceError(f"{str(run)!r} has no config.json: the run folder is incomplete "
                                 f"and cannot be reproduced")
        raise ReproduceError(f"{str(run)!r} is not a run folder (no config.json; labkit "
                             f"experiment makes run folders)")
    config = _read_json(cfg_path, "run's config")
    resolved = config.get("resolved") if isinstance(config, dict) else None
    if not isinstance(resolved, dict) or not resolved or not all(
            isinstance(c, dict) and is_name(c.get("method")) for c in resolved.values()):
        raise ReproduceError(f"{str(cfg_path)!r} is not a labkit experiment config (no "
                             f"'resolved' methods)")
    env_path = run / layout.ENVIRONMENT
    env = _read_json(env_path, "environment record") if env_path.exists() else {}
    return RunRecord(run, config, resolved, env if isinstance(env, dict) else {})


def select_methods(rec: RunRecord, methods: Optional[Iterable[str]] = None) -> list[str]:
    """The methods to compare: all of the run's, or those asked for, each one the run had."""
    if methods is None:
        return list(rec.methods)
    chosen = list(methods)
    missing = [m for m in chosen if m not in rec.methods]
    if missing or not chosen:
        raise ReproduceError(f"run {str(rec.path)!r} has no method {', '.join(missing) or '(none)'}"
                             f" (it ran: {', '.join(rec.methods)})")
    return chosen
