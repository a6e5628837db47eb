"""Bad input: shown to the user as one line naming the problem, never as a traceback."""
from __future__ import annotations


class ConfigError(ValueError):
    """Bad input (a flag, a parameter, a data folder, a file): one line, exit 2."""

    def _render_traceback_(self) -> list[str]:
        # IPython shows this instead of the traceback in a notebook cell (JupyterLab, papermill):
        # the frames of labkit's own checks would bury the one line that says what to change
        return [f"\x1b[0;31m{type(self).__name__}\x1b[0m: {self}"]
