# Two commands do all the set-up on a fresh CPU machine:
#   make demo   - 2 CPU ranks (gloo), a small GPT, passes on, schedule summary printed
#   make test   - the whole test suite (what CI runs through .ci/run, beside the torch matrix)
# Both create .venv and install the package with CPU torch pinned by constraints/cpu.txt.
#   make test-torch TORCH=2.15.0 - one release of the CI matrix, in a cached venv of its own
#                                  (QUICK=all: every torch-sensitive quick test there too)

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test test-quick test-torch lint install clean docs

$(STAMP): pyproject.toml constraints/cpu.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -c constraints/cpu.txt -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/torchrun --standalone --nproc-per-node 2 examples/gpt_demo.py

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-quick: $(STAMP)
	$(BIN)/python -m pytest -m "not slow"

test-torch:
	@test -n "$(TORCH)" || { echo "usage: make test-torch TORCH=2.15.0"; exit 2; }
	bash .ci/test-torch $(TORCH)

lint: $(STAMP)
	$(BIN)/ruff check fsdp_overlap_plugin tests examples benchmarks
	$(BIN)/ruff format --check fsdp_overlap_plugin tests examples benchmarks

docs: $(STAMP)
	$(BIN)/python -c "from fsdp_overlap_plugin.config.docs import config_markdown as m; print(m(), end='')" > docs/config.md

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
