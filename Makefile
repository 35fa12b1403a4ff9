# Set-up and the two everyday jobs. `make demo` and `make test` work on a fresh machine.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup vllm-env demo demo-quick wheel-demo test test-fast test-bf16-on test-bf16-off lint bench gpu-check clean

$(BIN)/specdec: pyproject.toml
	bash scripts/setup.sh $(VENV)
	@touch $@

setup: $(BIN)/specdec

# The serving engine's own environment (vLLM pins its own torch and transformers): specdec reaches it across a
# process boundary only (specdec/vllm_env.py).
VLLM_VENV ?= .venv-vllm
$(VLLM_VENV)/bin/vllm:
	bash scripts/setup_vllm.sh $(VLLM_VENV)

vllm-env: $(VLLM_VENV)/bin/vllm

demo: setup
	$(BIN)/specdec demo

demo-quick: setup
	$(BIN)/specdec demo --quick

# The quick demo as `pip install` gives it: the built wheel in a fresh venv (scripts/wheel_venv.py), run from a
# temporary folder that holds no checkout (its outputs land there).
wheel-demo: setup
	dir=$$(mktemp -d) && specdec=$$($(BIN)/python scripts/wheel_venv.py $$dir) && cd $$dir && echo "specdec demo --quick in $$dir" && $$specdec demo --quick

# The engine tests start real vLLM servers: the test run builds vLLM's venv first (once).
test: setup vllm-env
	$(BIN)/python -m pytest -q

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow"

# The fast tests with specdec's native-bf16 choices (mixed_precision=auto, dtype=bf16-if-native) forced on or off
# (SPECDEC_CPU_BF16, docs/usage.md): a CPU of either kind (AVX512-BF16/AMX or AVX2) then runs the other's paths.
test-bf16-on: setup
	SPECDEC_CPU_BF16=on $(BIN)/python -m pytest -q -m "not slow"

test-bf16-off: setup
	SPECDEC_CPU_BF16=off $(BIN)/python -m pytest -q -m "not slow"

lint: setup
	$(BIN)/ruff check .

bench: setup
	$(BIN)/python bench/decode.py

# The prepared GPU check (bench/gpu_check.py): 8B shapes on a CUDA device, tiny ones elsewhere; a results page in
# docs/results/. A lent GPU machine first needs the wheels of scripts/gpu_wheels.sh (docs/usage.md, "Checking on a GPU").
gpu-check: setup
	$(BIN)/python bench/gpu_check.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) outputs .pytest_cache
