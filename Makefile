# `make demo` and `make test` create the environment if it is missing (cached under ~/.cache/rlmini).
PY = "$$(bash scripts/setup_env.sh)/bin/python"

.PHONY: demo test test-fast bench gpu-check reproduce env

demo:  ## GRPO on the built-in tiny model, sums of 0..14 (CPU, offline, vLLM rollouts), held-out pass@1 at the end
	$(PY) train_grpo.py --run_name demo --task addition:14 --eval_every 50 --eval_n 8 --overwrite true --wandb false $(ARGS)

test:  ## the whole test suite (CPU, offline)
	$(PY) -m pytest -q --durations=15 tests $(ARGS)

test-fast:  ## the edit loop's tier: every test file's fast tests, the `slow` ones left out (CPU, offline)
	$(PY) -m pytest -q -m "not slow" --durations=5 tests $(ARGS)

bench:  ## throughput table for each engine
	$(PY) benchmarks/bench_engines.py $(ARGS)

gpu-check:  ## certify a GPU machine offline: every trainer, then built 1.5B and 7B (LoRA) models, checked, in one table (docs/gpu.md); the python at hand if it has torch, transformers and safetensors
	"$$(bash scripts/setup_env.sh --python-at-hand)" scripts/gpu_check.py $(ARGS)

reproduce:  ## seed 000 end to end: tabular Tables 1-2 and the six trainers on `calibration`; rewrites the block in docs/seed000.md
	$(PY) reproduce/seed000.py $(ARGS)

env:  ## print the environment's path (building it if needed)
	@bash scripts/setup_env.sh
