# Two entry points (see README): `make demo` and `make test`.
# Every target bootstraps what it needs, idempotently: stamps are rebuilt only when their inputs change.
PYTHON ?= python3
VENV := .venv
VLLM_VENV := .venv-vllm
STAMPS := .stamps
PY := $(VENV)/bin/python
# Torch threads per pytest worker: two workers on two cores.
TEST_ENV := TRITON_INTERPRET=1 TRITON_DEFAULT_FP_FUSION=1 OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1

.PHONY: setup setup-vllm test test-fast lint format bench clean

setup: $(STAMPS)/venv
setup-vllm: $(STAMPS)/vllm

$(STAMPS)/venv: pyproject.toml
	@mkdir -p $(STAMPS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch lies on this disk; a bare `torch` would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	@touch $@

$(STAMPS)/vllm: scripts/setup_vllm_cpu.sh
	@mkdir -p $(STAMPS)
	bash scripts/setup_vllm_cpu.sh $(VLLM_VENV)
	@touch $@

# One formatter configuration for the repository ([tool.ruff.format] in pyproject.toml).
lint: $(STAMPS)/venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Sort imports (the one lint rule that formatting owns), then format.
format: $(STAMPS)/venv
	$(VENV)/bin/ruff check --select I --fix .
	$(VENV)/bin/ruff format .

test: $(STAMPS)/venv $(STAMPS)/vllm lint
	$(TEST_ENV) $(PY) -m pytest -n 2 --dist loadgroup --timeout 900 tests

test-fast: $(STAMPS)/venv
	$(TEST_ENV) $(PY) -m pytest -n 2 --dist loadgroup -m "not vllm and not slow" tests

# The main job on the CPU embedded default: tiny GPT-OSS (real o200k vocabulary) warm-started offline, then GRPO
# with python tool calls in the sandbox and rollouts from a vllm-cpu server (weights pushed every step).
# Extra flags: make demo DEMO_ARGS="--seed 1 --rollout_backend transformers".
DEMO_ENV := OMP_NUM_THREADS=2 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
DEMO_CONFIG := examples/configs/retool_cpu_demo.yaml
demo: $(STAMPS)/venv $(STAMPS)/vllm
	$(DEMO_ENV) $(VENV)/bin/accelerate launch --cpu --num_processes 1 --num_machines 1 --mixed_precision no \
		--dynamo_backend no examples/retool_grpo.py --config $(DEMO_CONFIG) $(DEMO_ARGS)

# The retrospective's finding at small scale: the default twice (fa3_sink vs sink-less training attention,
# rollouts from the sink-aware vLLM engine both times), curves overlaid in runs/sink-ablation/plots.
demo-sinks: $(STAMPS)/venv $(STAMPS)/vllm
	$(DEMO_ENV) $(PY) examples/sink_ablation.py --config $(DEMO_CONFIG) --output_dir runs/sink-ablation $(DEMO_ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(STAMPS)
