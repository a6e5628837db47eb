"""Write run_method.ipynb's parameters cell from labkit's one source of defaults.

    .venv/bin/python tools/parameters_cell.py

The cell is labkit.launch.launch_params.parameters_cell(): TrainConfig's fields and the launcher's,
with their defaults and help text. Run this after changing a default or a field;
tests/test_notebooks.py fails while the notebook's cell differs.
"""
from pathlib import Path

import nbformat

from labkit.launch.launch_params import parameters_cell

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "run_method.ipynb"

if __name__ == "__main__":
    nb = nbformat.read(NOTEBOOK, as_version=4)
    cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    cell.source = parameters_cell()
    nbformat.write(nb, NOTEBOOK)
    print(f"wrote the parameters cell of {NOTEBOOK}")
