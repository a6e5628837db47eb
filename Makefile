# One-command set-up and runs; each target works on a fresh machine (Python 3.11, Debian/Ubuntu):
# it creates .venv, installs everything and registers the project's Jupyter kernel first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
ARGS   ?=

.PHONY: setup experiment test lab clean-venv

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch/torchvision are pinned in pyproject.toml (2.14.1 / 0.29.1)
	$(BIN)/pip install -e '.[test]'
	# the named kernel the notebooks ask for, inside the venv
	$(BIN)/python -m ipykernel install --sys-prefix --name labkit --display-name "Python (labkit)"
	touch $@

# The whole comparison on the embedded default (digits on CPU; see README), ending with the
# path of the report. Extra flags: make experiment ARGS="--epochs 1 --tag quick"
experiment: setup
	$(BIN)/labkit experiment $(ARGS)

test: setup
	$(BIN)/python -m pytest -q $(ARGS)

# JupyterLab on the project's kernel, notebooks/ open
lab: setup
	$(BIN)/jupyter lab --notebook-dir=. notebooks/run_method.ipynb

clean-venv:
	rm -rf $(VENV)
