# Two entry points, each working on a fresh machine with only Python 3.10+:
#   make demo   set up .venv, then estimate GPT-2's training step and plan checkpoints for a budget
#   make test   set up .venv, then run the test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test clean

# torch==2.13.0 first where no torch is present: a bare `torch` requirement pulls a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test,plan]'
	touch $@

demo: $(VENV)/.installed
	$(BIN)/memplan estimate gpt2 -b 8 -p fp32 -p amp-bf16 -o adamw -o sgd-momentum

test: $(VENV)/.installed
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV)
