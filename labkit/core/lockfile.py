"""requirements.lock: every distribution installed where a run ran, one ``name==version`` a
line, so ``pip install -r requirements.lock`` installs them again. The writer (the environment
record, labkit.runs.record) and the readers (labkit reproduce, the report's package list) share
this one definition of the format.
"""
from __future__ import annotations

import json
import re
from typing import Optional

PROJECT = "labkit"


def normalize(name: str) -> str:
    """PEP 503 name normalisation: ``Jinja2``, ``jinja2`` and ``jinja_2`` differ only in form,
    ``typing_extensions`` and ``typing-extensions`` are one distribution."""
    return re.sub(r"[-_.]+", "-", name).lower()


def distributions() -> dict[str, dict]:
    """Every distribution the running interpreter can import, by normalised name:
    {"name": as published, "version", "direct_url": PEP 610 URL or None (editable, local
    path or VCS install: not on an index under that version)}.

    A name found twice on sys.path keeps its first, the one ``import`` would load."""
    from importlib import metadata

    found: dict[str, dict] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if not name:
            continue  # a broken .dist-info without metadata
        key = normalize(name)
        if key in found:
            continue
        url = None
        raw = dist.read_text("direct_url.json")
        if raw:
            try:
                info = json.loads(raw)
                url = info.get("url")
                if info.get("dir_info", {}).get("editable"):
                    url = f"editable: {url}"
            except ValueError:
                pass
        found[key] = {"name": name, "version": dist.version, "direct_url": url}
    return dict(sorted(found.items()))


def requirements_lock(dists: Optional[dict[str, dict]] = None) -> str:
    """requirements.lock text: ``name==version`` per distribution, sorted by normalised name.

    This project, and anything installed from a local path, a VCS or in editable mode, cannot
    be fetched from an index by version: such lines are comments naming where they came from
    (the project itself is installed with ``pip install -e .`` from the recorded commit)."""
    dists = distributions() if dists is None else dists
    lines = ["# every distribution installed where this run ran (labkit.runs.record); "
             "pip install -r requirements.lock"]
    for key, d in dists.items():
        if key == PROJECT:
            lines.append(f"# {d['name']}=={d['version']}  (this project: install the recorded "
                         f"commit with pip install -e .)")
        elif d["direct_url"]:
            lines.append(f"# {d['name']}=={d['version']}  (not from an index: {d['direct_url']})")
        else:
            lines.append(f"{d['name']}=={d['version']}")
    return "\n".join(lines) + "\n"


def parse_lock(text: str) -> dict[str, str]:
    """requirements.lock text -> {normalised name: version}; comments, this project included,
    are not packages to install."""
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, _, version = line.partition("==")
        out[normalize(name)] = version.strip()
    return out
