# One-command set-up and runs. `make experiment` and `make test` work on a fresh machine:
# they create .venv, install everything (Debian packages included) and then run.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
NPROC  ?= 4
EPOCHS ?= 3

.PHONY: setup experiment test lab clean-venv

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch/torchvision are pinned in pyproject.toml (2.14.1 / 0.29.1)
	$(BIN)/pip install -e '.[test]'
	touch $@

# The experiment on the embedded default (digits, gloo, resnet18_small): the three methods,
# one after another, into one new folder under runs/.
experiment: setup
	@out=runs/$$(date +%Y-%m-%d_%H-%M-%S)_experiment; \
	for m in ddp allreduce ps; do \
	  OMP_NUM_THREADS=1 $(BIN)/torchrun --standalone --nproc_per_node=$(NPROC) -m labkit.train \
	    --method $$m --epochs $(EPOCHS) --batch-size 32 --out $$out || exit 1; \
	done; echo "results in $$out"

test: setup
	$(BIN)/python -m pytest -q

clean-venv:
	rm -rf $(VENV)
