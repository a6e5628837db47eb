# One-command set-up and runs; each target works on a fresh machine (Python 3.11 or later with
# its venv module, Debian/Ubuntu): it creates .venv, installs everything and registers the
# project's Jupyter kernel first. What a machine lacks is said in one line (README, first screen).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
ARGS   ?=
# pytest-xdist workers: most tests wait on subprocesses (torchrun agents importing, collective
# timeouts, Ctrl-C handling), so two workers keep 2 cores busy
TEST_WORKERS ?= 2

.PHONY: setup system-deps slurm-deps experiment test test-fast lab clean-venv

# JupyterLab settings the project decides for its lab's users: no "Would you like to get notified
# about official Jupyter news?" prompt (the lab is for one job, and makes no request out).
# Settings overrides of the venv's JupyterLab (jupyterlab_server reads overrides.d/*.json of its
# app settings folder; overrides.json there stays the user's own). A file target: a venv set up
# before gets it too, and a second make copies nothing.
LAB_OVERRIDES := $(VENV)/share/jupyter/lab/settings/overrides.d/labkit.json

setup: $(STAMP) $(LAB_OVERRIDES) system-deps

# Debian packages: Chromium prints the report to PDF offline (nbconvert's webpdf would try to
# download its own), poppler-utils checks the PDF in the tests. Installed when missing and root.
# A Chromium counts when it answers --version, under the names labkit.orchestrate.export looks for:
# Ubuntu has no chromium package, and its chromium-browser without the snap is a stub.
CHROMIUM_OK = for b in chromium chromium-browser google-chrome; do $$b --version >/dev/null 2>&1 && exit 0; done; exit 1
NO_CHROMIUM = echo "note: no Chromium that runs here (Ubuntu: snap install chromium): the report is written as HTML only, no PDF"
system-deps:
	@if ($(CHROMIUM_OK)) && command -v pdfinfo >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends poppler-utils \
	  && { ($(CHROMIUM_OK)) || DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium \
	       || $(NO_CHROMIUM); }; \
	elif ($(CHROMIUM_OK)); then echo "note: the tests' PDF checks need poppler-utils: sudo apt-get install poppler-utils"; \
	else echo "note: the PDF report needs Chromium: sudo apt-get install chromium poppler-utils (Ubuntu: snap install chromium); HTML is written without it"; fi

# Debian's Slurm and munge for tests/test_slurm.py, which starts its own controller and two node
# daemons and submits slurm/labkit.sbatch and `labkit sweep --slurm` to them. Installed when
# missing and root; otherwise those tests skip, saying how to install it.
slurm-deps:
	@if command -v slurmctld >/dev/null 2>&1 && command -v slurmd >/dev/null 2>&1 && command -v munged >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends slurm-wlm munge; \
	else echo "note: the Slurm tests need Slurm: sudo apt-get install slurm-wlm munge (they skip without it)"; fi

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "make: no $(PYTHON): install Python 3.11 or later (sudo apt-get install python3 python3-venv)"; exit 1; }
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "make: labkit needs Python 3.11 or later, $(PYTHON) is $$($(PYTHON) -V 2>&1): make PYTHON=python3.11 ..."; exit 1; }
	@$(PYTHON) -c 'import ensurepip, venv' 2>/dev/null || { echo "make: $(PYTHON) cannot create a venv: sudo apt-get install python3-venv"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	# torch/torchvision are pinned in pyproject.toml (2.14.1 / 0.29.1)
	$(BIN)/pip install -e '.[test]'
	# the named kernel the notebooks ask for, inside the venv
	$(BIN)/python -m ipykernel install --sys-prefix --name labkit --display-name "Python (labkit)"
	touch $@

$(LAB_OVERRIDES): tools/jupyterlab/overrides.json $(STAMP)
	mkdir -p $(@D)
	cp $< $@

# The whole comparison on the embedded default (digits on CPU; see README), ending with the
# path of the report. Extra flags: make experiment ARGS="--epochs 1 --tag quick"
experiment: setup
	$(BIN)/labkit experiment $(ARGS)

# the whole suite: what CI runs (.ci/run). docs/testing.md: the kinds of test, the session's
# shared runs, the pause hook. -rs: the summary lists each skip with its reason (on CI, as root,
# only the GPU tests skip)
test: setup slurm-deps
	$(BIN)/python -m pytest -q -rs -n $(TEST_WORKERS) --dist loadgroup $(ARGS)

# the inner loop: the unit tests (in-process, nothing started) and the warm ones but those marked
# slow: every built-in method's exactness and bytes on the wire, its ranks forked from a warm
# interpreter (tests/warm.py). Under 90 s on 2 cores (docs/testing.md). Not a substitute for
# make test before a commit
test-fast: setup
	$(BIN)/python -m pytest -q -rs -n $(TEST_WORKERS) --dist loadgroup -m "(unit or warm) and not slow" $(ARGS)

# JupyterLab on the project's kernel, notebooks/ open, on this machine only (127.0.0.1). As root
# (containers, cloud notebooks) Jupyter refuses to start without --allow-root: given then only.
# Extra options: make lab LAB_ARGS="--port=8899 --no-browser"
LAB_ARGS ?=
lab: setup
	$(BIN)/jupyter lab --ip=127.0.0.1 --notebook-dir=. $$([ "$$(id -u)" = 0 ] && echo --allow-root) $(LAB_ARGS) notebooks/run_method.ipynb

clean-venv:
	rm -rf $(VENV)
