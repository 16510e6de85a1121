"""LoRA merge against peft's own merge_and_unload (issue 37, item 1) on a random tiny model of every family of
tests/test_architectures.py and a plain Qwen2 (q, k, v biases): many have linear biases (Qwen2, Phi,
GPT-NeoX, Starcoder2, GPT-2), some tied embeddings, GPT-2 stores its linear layers (in, out) (Conv1D). B is
random, so the update is a sizeable part of each adapted weight. Three paths: what the merge push streams
(rlmini/engine.py::named_weights), the adapter push's folder (engine.py::save_adapter), and the final export
(rlmini/checkpoint.py::save_final) reloaded by transformers."""
import copy
import json
import os

import pytest
import torch
import transformers
from safetensors.torch import load_file
from conftest import assert_grad_close
from test_architectures import BASE, FAMILIES, build

import common
from rlmini import checkpoint, engine, models

CASES = {**FAMILIES, "qwen2": ("Qwen2Config", dict(num_key_value_heads=2))}
MOE = ("qwen3-moe", "mixtral", "olmoe")  # all-linear would adapt their fused experts: refused
IDS = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16, 17, 18]])
REPORT = {}  # case -> (max |ours - peft|, max |ours - peft| / |peft| (norms), adapted weights); pytest -s


class _Tok:  # save_final writes the tokenizer too; what it writes is not tested here
    def save_pretrained(self, path):
        pass


def base_model(family: str):
    if family in FAMILIES:
        return build(family)
    cls, kw = CASES[family]
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**{**BASE, **kw}))


def lora_model(family: str, targets: str = "all-linear", dtype=torch.float32):
    """The family's random model in `dtype` with adapters of rank 4, alpha 12 (scale 3), B random; random
    biases, so that one carried wrongly shows. Also a copy of the base."""
    model = base_model(family).to(dtype)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=g))
    fresh = copy.deepcopy(model)
    model = models.add_lora(model, common.Args(lora_rank=4, lora_alpha=12.0, lora_targets=targets))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model, fresh


@pytest.mark.parametrize("family", MOE)
def test_lora_on_a_mixture_of_experts_fused_experts_is_refused_in_one_line(family):
    """transformers 5 fuses a layer's experts into 3-D parameters; peft's all-linear wraps them as
    parameters, which the push's merge (per linear layer) does not cover: refused, naming them and the
    attention targets that work (tested above on Mixtral)."""
    with pytest.raises(SystemExit, match=r"^--lora_targets all-linear: model.layers.0.mlp.experts is a "
                                         r"mixture of experts' fused experts, .* --lora_targets "
                                         r"q_proj,k_proj,v_proj,o_proj$"):
        lora_model(family)


def logits(model):
    with torch.no_grad():  # eval: GPT-2's config has dropout
        return model.eval()(input_ids=IDS).logits.double()


@pytest.mark.slow
@pytest.mark.parametrize("family, targets", [(f, "all-linear") for f in CASES if f not in MOE] + [
    ("qwen2", "q_proj,k_proj,down_proj"), ("gpt2", "c_attn,c_proj"), ("phi-biased-head", "q_proj,dense"),
    ("mixtral", "q_proj,k_proj,v_proj,o_proj")])
def test_lora_merge_equals_peft_merge_and_unload(family, targets, tmp_path):
    model, fresh = lora_model(family, targets)
    base = dict(fresh.named_parameters())
    theirs = copy.deepcopy(model).merge_and_unload()
    ref = dict(theirs.named_parameters())
    ours = dict(engine.named_weights(model, torch.float32))
    assert list(ours) == list(ref) == list(base)  # the base model's HF names, in its order, tied once
    diff = max((ours[n] - ref[n]).abs().max().item() for n in ref)
    rel = max(((ours[n] - ref[n]).norm() / ref[n].norm()).item() for n in ref)
    adapted = [n for n in ref if not torch.equal(ref[n], base[n])]
    REPORT[f"{family} {targets}"] = (diff, rel, len(adapted))
    for n in ref:
        assert_grad_close(ours[n], ref[n], 1e-6, n)
    assert adapted and all(n.endswith(".weight") for n in adapted)  # biases pass through peft unchanged
    for n in adapted:  # a sizeable update: a merge that dropped it, or added it twice, fails above
        assert (ref[n] - base[n]).norm() > 0.1 * base[n].norm(), n
    for n in ref:
        if n not in adapted:
            assert torch.equal(ours[n], base[n]), n
    biases = [n for n in ref if n.endswith(".bias")]
    if family in ("qwen2", "phi-biased-head", "gpt2"):
        assert any(n.removesuffix(".bias") + ".weight" in adapted for n in biases)  # an adapted layer's bias
    # the adapter push's folder: what peft saves, and peft's load of it is our policy
    engine.save_adapter(model, engine.adapter_state(model), tmp_path / "ours")
    model.save_pretrained(tmp_path / "peft")
    mine, peft_files = load_file(tmp_path / "ours" / "adapter_model.safetensors"), load_file(
        tmp_path / "peft" / "adapter_model.safetensors")
    assert sorted(mine) == sorted(peft_files) and all(torch.equal(mine[k], peft_files[k]) for k in mine)
    config = [json.load(open(tmp_path / d / "adapter_config.json")) for d in ("ours", "peft")]
    assert config[0] == config[1]
    from peft import PeftModel
    reloaded = PeftModel.from_pretrained(fresh, tmp_path / "ours")
    policy = logits(model)
    assert_grad_close(logits(reloaded), policy, 1e-6, "adapter folder")
    # the final export: merged weights under the base's names, read by transformers as any model
    checkpoint.save_final(model, _Tok(), str(tmp_path / "final"))
    stored = load_file(tmp_path / "final" / "model.safetensors")
    assert not [k for k in stored if "lora_" in k or "base_layer" in k]
    from transformers import AutoModelForCausalLM
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "final", dtype=torch.float32)
    assert_grad_close(logits(final), logits(theirs), 1e-5, "final")
    assert_grad_close(logits(theirs), policy, 1e-5, "peft's merge")
    assert os.path.exists(tmp_path / "final" / "adapter" / "adapter_model.safetensors")


def test_lora_merge_in_bf16_rounds_once():
    """A bf16 base (as on CUDA) with fp32 adapters: the push merges in fp32 and rounds once, so each merged
    weight is W + s B A (peft's get_delta_weight) rounded to bf16, as peft's merge_and_unload gives it (it
    adds the fp32 update into the bf16 weight in place: one rounding too); biases are the base's."""
    model, fresh = lora_model("qwen2", dtype=torch.bfloat16)
    base = dict(fresh.named_parameters())
    ours = dict(engine.named_weights(model, torch.bfloat16))
    theirs = dict(copy.deepcopy(model).merge_and_unload().named_parameters())
    layers = {n.removeprefix("base_model.model."): m for n, m in model.named_modules()
              if hasattr(m, "lora_A")}
    for name, layer in layers.items():
        exact = base[f"{name}.weight"].float() + layer.get_delta_weight("default")
        assert torch.equal(ours[f"{name}.weight"], exact.to(torch.bfloat16)), name
        if f"{name}.bias" in base:
            assert torch.equal(ours[f"{name}.bias"], base[f"{name}.bias"]), name
    for n in theirs:  # within half a bf16 step (2^-9) of each weight's norm
        assert_grad_close(ours[n].float(), theirs[n].float(), 2 ** -9, n)
    assert all(w.dtype == torch.bfloat16 for w in ours.values()) and len(layers) == 14


def teardown_module():
    for case, (diff, rel, n) in REPORT.items():
        print(f"\n{case:40s} max |ours - peft| {diff:.3g}  rel {rel:.3g}  adapted weights {n}", end="")
