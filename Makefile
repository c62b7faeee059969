# Two entry points for a fresh checkout (see README.md):
#   make demo   - install into .venv, then run the Multi30k pipeline on the bundled data
#   make test   - install into .venv, then run the test suite
# The local setup pins the CPU build of torch (pyproject.toml keeps `torch>=2.3` for real users).

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0

.PHONY: install demo test completions clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet $(TORCH) -e '.[test,plot,ct2,serve,hf,tensorboard,wandb]'
	$(BIN)/python -m attn_cli.decode.native  # the C++ decoder step, built now, not at first use
	touch $@

demo: install
	PATH="$(abspath $(BIN)):$$PATH" $(MAKE) -C examples/multi30k

test: install
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m pytest -q

completions: install
	$(BIN)/python completions/generate.py

clean:
	rm -rf $(VENV) examples/multi30k/work
