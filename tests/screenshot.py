"""A PNG of a rendered report page, for the tests that check it is not blank (test-only, so it
lives here and not in labkit.orchestrate.export)."""
from __future__ import annotations

import os
from pathlib import Path

from labkit.orchestrate.export import run_chromium
from labkit.core.files import atomic_path


def screenshot(html_path: str | os.PathLike, png_path: str | os.PathLike,
               width: int = 1200, height: int = 1600) -> Path:
    """A PNG of the top ``width`` x ``height`` pixels of the page; raises ChromiumError."""
    png_path = Path(png_path)
    with atomic_path(str(png_path)) as tmp:
        run_chromium("--screenshot", ".png", Path(html_path), tmp,
                     [f"--window-size={width},{height}", "--hide-scrollbars"])
    return png_path
