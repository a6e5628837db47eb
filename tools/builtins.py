"""Write labkit/core/builtins.py from the built-in methods' and workloads' classes.

    .venv/bin/python tools/builtins.py

Run it after changing what a built-in declares (its spec, options, variants, preloads): the
processes that import no torch read that file (labkit.training.catalogue says why), and
tests/test_builtins.py fails while it differs from the classes.
"""
from pathlib import Path

from labkit.core.files import atomic_path
from labkit.training.catalogue import source

TARGET = Path(__file__).resolve().parent.parent / "labkit" / "core" / "builtins.py"

if __name__ == "__main__":
    with atomic_path(str(TARGET)) as tmp:
        Path(tmp).write_text(source())
    print(f"wrote {TARGET}")
