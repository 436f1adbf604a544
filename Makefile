PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_WORKERS ?= 2

.PHONY: test demo gpu-check bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[test]'
	touch $(STAMP)

# The CPU suite runs the Triton kernels on the interpreter (tiny shapes); scripts/gpu-check runs them on CUDA.
test: $(STAMP)
	$(BIN)/ruff check src tests scripts
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -n $(PYTEST_WORKERS) -m "not gpu and not slow" tests

demo: $(STAMP)
	$(BIN)/dsa-indexer demo

gpu-check:
	scripts/gpu-check

clean:
	rm -rf $(VENV)
