# The two commands a new user runs: `make demo` and `make test`. Both build .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test soak lint fmt protos bench-gpu clean

# CPU torch: the local wheel where the machine has one, else PyTorch's CPU index (an unpinned
# torch from PyPI would pull a multi-GB CUDA build). The worker extra then finds it installed.
TORCH_VERSION ?= 2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -U pip
	if $(BIN)/pip install -q --no-index --no-deps torch==$(TORCH_VERSION) 2>/dev/null; then \
	  $(BIN)/pip install -q torch==$(TORCH_VERSION); \
	else \
	  $(BIN)/pip install -q torch --index-url $(TORCH_CPU_INDEX); \
	fi
	$(BIN)/pip install -q -e '.[worker,plot,dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/dsv4 demo

test: $(STAMP) lint
	$(BIN)/python -m pytest -q

# ~2.5 min: dsv4 loadtest against dsv4 up, blocks and RSS checked (not in `make test`).
soak: $(STAMP)
	DSV4TEST_SOAK=1 $(BIN)/python -m pytest -q -s tests/e2e/test_soak.py

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports  # the import rules of pyproject.toml (docs/architecture.md#import-rules)
	$(BIN)/python tools/line_budget.py

fmt: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

protos: $(STAMP)
	$(BIN)/python protos/gen.py

bench-gpu:
	bash benchmarks/run_h200.sh

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .import_linter_cache
