"""A training script run against a test double of vLLM's CUDA sleep mode, on CPU.

    python tests/engine_double.py MODE REPORT train_grpo.py [flags...]

MODE discard: the engine "sleeps" as on CUDA at level 2, which throws its weights away; the double
overwrites vLLM's weights with random ones at every sleep (wake_up is a no-op), so anything that
samples before the next push samples from garbage. MODE stale: every weight push silently does
nothing, so vLLM keeps sampling from the initial weights. MODE noise: the sampler's log-probs are
shifted by +0.5 (a sampler/trainer mismatch). REPORT receives {"sleeps": n, "pushes": n} as JSON.
"""
import atexit
import json
import os
import runpy
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402

mode, report, script, *flags = sys.argv[1:]
counts = {"sleeps": 0, "pushes": 0}
atexit.register(lambda: json.dump(counts, open(report, "w")))
make_engine, push_weights, generate = common.make_engine, common.push_weights, common.generate


def make_engine_double(args, model_path, tokenizer, device, dtype, max_len):
    engine = make_engine(args, model_path, tokenizer, device, dtype, max_len)
    if mode == "discard":
        from transformers import AutoModelForCausalLM
        shapes = [(n, p.shape) for n, p in AutoModelForCausalLM.from_pretrained(model_path).named_parameters()]

        def sleep(level=1):
            assert level == 2
            counts["sleeps"] += 1
            common.load_into_vllm(engine, [(n, 0.5 * torch.randn(s)) for n, s in shapes])

        engine.sleep_mode = True
        engine.llm.sleep, engine.llm.wake_up = sleep, lambda tags=None: None
    return engine


def push_double(engine, model, dtype):
    counts["pushes"] += 1
    if mode != "stale":
        push_weights(engine, model, dtype)


def generate_double(*a, **k):
    r = generate(*a, **k)
    if mode == "noise":
        r.sampler_logprobs = [[x + 0.5 for x in lp] for lp in r.sampler_logprobs]
    return r


common.make_engine, common.push_weights, common.generate = make_engine_double, push_double, generate_double
sys.argv = [script, *flags]
runpy.run_path(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), script), run_name="__main__")
