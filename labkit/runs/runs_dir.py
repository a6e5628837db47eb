"""The runs/ folder: each new run folder in it (runs/<YYYY-MM-DD_HH-MM-SS>[_<tag>]/, never an
existing one), the runs/latest link that points at the newest, and runs/index.html. (Reading a
run folder: labkit.core.run_folder.)"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional

from labkit.core import layout
from labkit.core.config import ConfigError
from labkit.core.files import folder_stamp


def new_run_dir(runs_dir: Optional[str | os.PathLike], tag: Optional[str] = None) -> Path:
    """Create runs/<YYYY-MM-DD_HH-MM-SS>[_<tag>]/ under ``runs_dir`` (None: the project's runs/,
    from any folder: layout.runs_root); an existing folder is never reused."""
    if tag and not all(c.isalnum() or c in "-_." for c in tag):
        raise ConfigError(f"tag {tag!r} may only hold letters, digits, '-', '_' and '.'")
    root = layout.runs_root(runs_dir)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create runs folder {str(root)!r}: {e.strerror}") from None
    if not os.access(root, os.W_OK):
        raise ConfigError(f"runs folder {str(root)!r} is not writable")
    while True:
        name = folder_stamp() + (f"_{tag}" if tag else "")
        d = root / name
        try:
            d.mkdir()
            break
        except FileExistsError:
            time.sleep(1.0)  # same second as another experiment: take the next one
    _point_latest(root, name)
    return d


def _point_latest(root: Path, name: str) -> None:
    link, tmp = root / layout.LATEST, root / f".{layout.LATEST}-{os.getpid()}"
    try:
        if tmp.is_symlink():
            tmp.unlink()
        tmp.symlink_to(name)
        os.replace(tmp, link)  # atomic switch of the pointer
    except OSError:
        pass  # a file system without symlinks: the folder itself is what matters


def write_index(runs_dir: str | os.PathLike) -> Optional[Path]:
    """runs/index.html, the lab notebook of every run folder (labkit.runs.runs_index),
    rewritten atomically; None, and nothing changed, when it cannot be written."""
    from . import runs_index
    from labkit.core.files import atomic_path

    root = Path(runs_dir)
    try:
        page = runs_index.html_page(runs_index.scan(root), root)
        with atomic_path(str(root / layout.RUNS_INDEX)) as tmp:
            Path(tmp).write_text(page)
    except OSError:
        return None
    return root / layout.RUNS_INDEX
