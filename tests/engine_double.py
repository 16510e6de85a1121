"""A training script run against a test double of vLLM's CUDA sleep mode, on CPU.

    python tests/engine_double.py MODE REPORT train_grpo.py [flags...]

MODE discard: the engine "sleeps" as on CUDA at level 2, which throws its weights away; the double overwrites
vLLM's weights with random ones at every sleep (waking is a no-op), so anything that samples before the next
push samples from garbage. MODE stale: every weight push silently does nothing, so vLLM keeps sampling from
the initial weights. MODE noise: the sampler's log-probs are shifted by +0.5 (a sampler/trainer mismatch).
REPORT receives {"sleeps": n, "pushes": n} as JSON.
"""
import atexit
import json
import os
import runpy
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from rlmini import engine  # noqa: E402

mode, report, script, *flags = sys.argv[1:]
counts = {"sleeps": 0, "pushes": 0}
atexit.register(lambda: json.dump(counts, open(report, "w")))
make_engine, push, generate = engine.make_engine, engine.VLLMEngine.push, engine.VLLMEngine.generate


def make_engine_double(args, path, *a, **k):
    sampler = make_engine(args, path, *a, **k)
    if mode == "discard":  # the real engine's sleep and push, over an LLM whose sleep discards its weights
        from transformers import AutoModelForCausalLM
        shapes = [(n, p.shape) for n, p in AutoModelForCausalLM.from_pretrained(path).named_parameters()]

        def sleep(level=1):
            assert level == 2
            counts["sleeps"] += 1
            sampler.load([(n, 0.5 * torch.randn(s)) for n, s in shapes])

        sampler.sleep_mode = True
        sampler.llm.sleep, sampler.llm.wake_up = sleep, lambda tags=None: None
    return sampler


def push_double(sampler):
    counts["pushes"] += 1
    push(sampler)


if mode == "stale":  # the push runs (the engine wakes), its weight load does nothing
    engine.VLLMEngine.load = lambda sampler, weights: None


def generate_double(sampler, *a, **k):
    r = generate(sampler, *a, **k)
    if mode == "noise":
        r.sampler_logprobs = [[x + 0.5 for x in lp] for lp in r.sampler_logprobs]
    return r


engine.make_engine, engine.VLLMEngine.push, engine.VLLMEngine.generate = make_engine_double, push_double, \
    generate_double
sys.argv = [script, *flags]
runpy.run_path(
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), script), run_name="__main__"
)
