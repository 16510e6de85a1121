"""The memory model of benchmarks/memory.py: parameter counts against transformers' own models, and the
per-GPU figures by hand."""
import os
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import memory  # noqa: E402

SMALL = dict(hidden=64, layers=3, intermediate=96, heads=4, kv_heads=2, vocab=100)


@pytest.mark.parametrize("tied", [True, False])
def test_parameter_count_equals_the_transformers_model(tied):
    from transformers import AutoModelForCausalLM, Qwen2Config
    s = {**SMALL, "tied": tied}
    cfg = Qwen2Config(hidden_size=64, num_hidden_layers=3, intermediate_size=96, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=100, tie_word_embeddings=tied)
    model = AutoModelForCausalLM.from_config(cfg)
    assert memory.parameters(s)["total"] == sum(p.numel() for p in model.parameters())
    layer = model.model.layers[0]
    assert memory.parameters(s)["layer"] == sum(p.numel() for p in layer.parameters())


def test_qwen25_sizes_are_the_published_ones():
    counts = {k: memory.parameters(s)["total"] / 1e9 for k, s in memory.SHAPES.items()}
    assert counts == pytest.approx({"0.5B": 0.494, "1.5B": 1.544, "7B": 7.616, "14B": 14.770}, abs=0.001)


def test_memory_by_hand():
    s = {**SMALL, "tied": False}
    p = memory.parameters(s)
    one = memory.memory(s, 1, sharded=False, compute_bytes=4, tokens=10, logit_tokens=5, checkpointing=False)
    gb = 1e9
    assert one["weights"] == pytest.approx(4 * p["total"] / gb)
    assert one["adam"] == pytest.approx(8 * p["total"] / gb)
    assert one["working"] == 0  # fp32 compute: no cast copies
    per_token_layer = 4 * (10 * 64 + 4 * 32 + 4 * 96)
    # the projection's backward: 5 fp32 buffers of the 5 scored positions x the vocabulary
    assert one["activations"] == pytest.approx((10 * 3 * per_token_layer + 5 * 5 * 100 * 4) / gb)
    four = memory.memory(s, 4, sharded=True, compute_bytes=4, tokens=10, logit_tokens=5, checkpointing=False)
    for k in ("weights", "grads", "adam"):  # FSDP2 splits the states over the ranks
        assert four[k] == pytest.approx(one[k] / 4)
    gathered, gradients = 2 * 4 * (p["root"] + 2 * p["layer"]), 8 * (p["root"] + p["layer"])
    assert four["working"] == pytest.approx((gathered + gradients) / gb)
    ckpt = memory.memory(s, 1, sharded=False, compute_bytes=4, tokens=10, logit_tokens=5, checkpointing=True)
    assert ckpt["activations"] == pytest.approx((10 * (3 * 4 * 64 + per_token_layer) + 5 * 5 * 100 * 4) / gb)
    rows = memory.memory(s, 1, sharded=False, compute_bytes=4, tokens=10, logit_tokens=5, checkpointing=True,
                         attention_rows=[(2, 3, 7), (1, 4, 4)])  # the CPU kernel's boolean masks
    assert rows["activations"] - ckpt["activations"] == pytest.approx((2 * 3 * 7 + 16) / gb)
    assert memory.chunk_for(100) == 4096 and memory.chunk_for(151936) == 1766  # 1 GiB per fp32 buffer
    awake = memory.memory(s, 1, sharded=False, vllm_gb=50.0)
    assert awake["peak"] == pytest.approx(awake["rollout"]) and awake["rollout"] > awake["update"]


def test_lora_memory_by_hand():
    s = {**SMALL, "tied": False}
    p, gb = memory.parameters(s), 1e9
    h, i, kv = 64, 96, 32
    # r = 8: r (in + out) per layer
    adapters = 3 * 8 * ((h + h) + 2 * (h + kv) + (h + h) + 2 * (h + i) + (i + h))
    assert memory.lora_parameters(s, 8) == adapters
    full = memory.memory(s, 1, sharded=False, compute_bytes=2, tokens=10, logit_tokens=5, reference=True)
    lora = memory.memory(s, 1, sharded=False, compute_bytes=2, tokens=10, logit_tokens=5, reference=True,
                         lora_rank=8)
    assert lora["weights"] == pytest.approx((2 * p["total"] + 4 * adapters) / gb)  # bf16 base + fp32 adapters
    assert lora["grads"] == pytest.approx(4 * adapters / gb)
    assert lora["adam"] == pytest.approx(8 * adapters / gb)
    assert lora["reference"] == 0 and full["reference"] > 0  # the reference is the base with the adapters off
    assert lora["working"] == pytest.approx(2 * adapters / gb)  # only the adapters are cast by autocast
    assert lora["activations"] == full["activations"]
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Qwen2Config
    cfg = Qwen2Config(hidden_size=64, num_hidden_layers=3, intermediate_size=96, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=100, tie_word_embeddings=False)
    model = get_peft_model(
        AutoModelForCausalLM.from_config(cfg), LoraConfig(r=8, target_modules="all-linear")
    )
    assert adapters == sum(p.numel() for p in model.parameters() if p.requires_grad)  # what peft creates
