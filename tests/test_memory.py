"""The memory plan (rlmini/memplan.py): exact parameter counts, the parts by hand, the plan against torch's
own memory trackers on real configurations at 8k tokens (1 and 8 simulated ranks; full, LoRA, reference, PPO,
a mixture of experts), AdamW's state made before vLLM sizes itself without changing training, and the
one-line refusals."""
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT
from rlmini import memplan

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import memory  # noqa: E402

GiB = memplan.GiB


@pytest.mark.parametrize("name", ["qwen2.5-1.5b-instruct", "qwen2.5-7b-instruct", "llama-3.1-8b-instruct",
                                  "gemma-2-2b-it"])
def test_counts_are_the_published_sizes_and_the_models_own(name):
    from transformers import AutoModelForCausalLM
    c = memplan.count(memory.config(name))
    published = {"qwen2.5-1.5b-instruct": 1.544, "qwen2.5-7b-instruct": 7.616, "llama-3.1-8b-instruct": 8.030,
                 "gemma-2-2b-it": 2.614}
    assert c["total"] / 1e9 == pytest.approx(published[name], abs=0.001)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(memory.config(name))
    layer = model.model.layers[0]
    assert c["layer"] == sum(p.numel() for p in layer.parameters())
    assert c["root"] == c["total"] - c["layers"] * c["layer"]
    assert c["tensors"] == len(list(model.parameters()))


def test_a_mixture_of_experts_holds_every_expert_and_runs_top_k(capsys):
    """Qwen3-30B-A3B's config: the count holds all 128 experts of every layer (weights, gradients and AdamW's
    moments: what the plan shards) and the FLOPs' count runs top-8 of them, each equal to a hand count from
    the config's sizes; the MLP width of the activations is top-8 experts' (8 x 768)."""
    cfg = memory.config("qwen3-30b-a3b")
    h, layers, experts, top, i = (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_experts,
                                  cfg.num_experts_per_tok, cfg.moe_intermediate_size)
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    attention = h * q + 2 * h * kv + q * h + 2 * cfg.head_dim  # q, k, v, o and q/k norms
    per_layer = attention + experts * h + 2 * h  # the router, two norms
    embeddings = 2 * cfg.vocab_size * h + h  # untied embedding and head, the final norm
    total = layers * (per_layer + experts * 3 * h * i) + embeddings
    active = layers * (per_layer + top * 3 * h * i) + embeddings
    c = memplan.count(cfg)
    assert (c["total"], c["active"]) == (total, active)  # 30.53B, 3.35B
    assert c["intermediate"] == top * i and c["router"] > 0
    import train_grpo
    with pytest.raises(SystemExit):  # it does not fit 8 x 80 GB without checkpointing: the row all the same
        train_grpo.main(["--plan_only", "true", "--model", os.path.join(memory.CONFIGS, "qwen3-30b-a3b.json"),
                         "--gpus", "8", "--task", "gsm8k"])
    line = capsys.readouterr().out
    held = float(line.split("weights+grads+AdamW ")[1].split()[0]) * 2**30
    assert held == pytest.approx(16 * total / 8, rel=1e-3)  # fp32 weights, gradients, two moments / 8 ranks


def test_lora_count_is_what_peft_creates():
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Qwen2Config
    cfg = Qwen2Config(hidden_size=64, num_hidden_layers=3, intermediate_size=96, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=100, tie_word_embeddings=False)
    for targets in ("all-linear", "q_proj,v_proj"):
        c = memplan.count(cfg, lora_rank=8, lora_targets=targets)
        model = get_peft_model(AutoModelForCausalLM.from_config(cfg), LoraConfig(
            r=8, target_modules=targets if targets == "all-linear" else targets.split(",")))
        trained = [p for p in model.parameters() if p.requires_grad]
        assert c["lora"] == sum(p.numel() for p in trained) and c["lora_tensors"] == len(trained)


TOY = dict(total=1000, layers=2, layer=300, root=400, largest=200, tensors=10, lora=40, lora_tensors=4,
           hidden=8, intermediate=16, kv_per_token_layer=8, kv_heads=2, heads=4, head_dim=2, vocab=50,
           embedding=400, norms=2, tied=False, softcap=False, context=4096)


def test_plan_by_hand():
    c, free = TOY, dict(context=0.0, workspace=0.0, gpu_bytes=100 * GiB)
    one = memplan.plan(c, ranks=1, compute_bytes=2, tokens=10, checkpointing=False, **free)
    assert one["weights"] == 4000 and one["grads"] == 4000 and one["adam"] == 8000 + 512 * 10
    per_layer = 8 * 16 + 15 * 8 + 8 * 8 * 2  # layer_activation_bytes at bf16
    cast = 2 * (1000 - 400)  # autocast's bf16 copies of every master but the (untied) input embedding
    head = 2 * 50 * 8  # the head's gradient, and in one process its recomputed cast
    fwd, bwd = 12 * 10 * 50, 20 * 10 * 50 + 2 * head  # three fp32 [chunk, vocab] buffers; five
    outside = 17 * 8 * 10
    assert one["activations"] == 10 * 2 * per_layer + outside + cast + max(fwd, bwd)
    assert one["update"] == one["persistent"] + 4000 + one["activations"]
    ckpt = memplan.plan(c, ranks=1, tokens=10, checkpointing=True, **free)
    # the checkpoint inputs in the fp32 residual stream; the forward's end (every cast cached) or a backward
    assert ckpt["activations"] == 10 * 2 * 4 * 8 + outside + max(cast + fwd, bwd, 10 * per_layer + 2 * 300)
    four = memplan.plan(c, ranks=4, tokens=10, reference=True, **free)
    assert (four["weights"], four["grads"]) == (1000, 1000)  # sharded
    assert four["reference"] == 2 * 1000 / 4  # bf16 shards; its root resharded after each pass
    assert four["working"] == 2 * 400  # the policy's gathered root
    lora = memplan.plan(c, ranks=1, tokens=10, lora_rank=8, reference=True, **free)
    assert lora["weights"] == 4 * 40 + 2 * 1000 and lora["adam"] == 8 * 40 + 512 * 4
    assert lora["reference"] == 0  # its base with the adapters off
    ppo = memplan.plan(c, ranks=1, tokens=10, critic=True, **free)
    critic = 1000 - 50 * 8 + 8 + 1  # the backbone and a one-row head, no LM head
    assert ppo["weights"] == 4 * (1000 + critic) and ppo["adam"] == 8 * (1000 + critic) + 512 * (10 + 11)
    teacher = dict(TOY, total=3000, root=900)
    extra = memplan.plan(c, ranks=4, tokens=10, reference=True, frozen=[teacher], **free)
    assert extra["reference"] - four["reference"] == 2 * 3000 / 4  # a frozen model more
    vllm = dict(max_num_seqs=4, max_len=100, dtype_bytes=2, batched_tokens=64, cudagraph=GiB)
    p = memplan.plan(c, tokens=10, vllm=vllm, **free)
    kv_token = 2 * 8 * 2
    assert p["kv_token"] == kv_token
    want = (2 * 1000 + 4 * 100 * kv_token + 64 * (2 * 16 + 4 * 8) * 2 + 2 * 4 * 50 * 4 + GiB
            + memplan.VLLM_OVERHEAD)
    assert p["vllm_want"] == want and p["share"] == pytest.approx(want / (100 * GiB))  # all it can fill
    assert p["rollout"] == p["persistent"] + want
    # its weights and what every wake-up restores (CUDA graphs, runtime pool, workspace), a parameter gathered
    assert p["push"] == p["persistent"] + 2 * 1000 + GiB + memplan.VLLM_WAKE + (4 + 2) * 200
    # a reward model: held in every phase; it scores beside vLLM awake, whose share makes room for it
    rm = memplan.plan(c, tokens=10, vllm=vllm, reward_model=1000.0, reward_scoring=3 * GiB, **free)
    assert rm["persistent"] - p["persistent"] == rm["update"] - p["update"] == 1000
    assert rm["rollout"] == rm["persistent"] + want + 3 * GiB  # 100 GiB: vLLM still gets all it can fill
    tight = dict(free, gpu_bytes=10 * GiB)
    rm = memplan.plan(c, tokens=10, vllm=vllm, reward_model=1000.0, reward_scoring=5.5 * GiB, **tight)
    room = 10 * GiB - memplan.margin(10 * GiB) - rm["persistent"] - 5.5 * GiB
    assert rm["vllm"] == pytest.approx(room) and room < want
    assert rm["rollout"] == pytest.approx(10 * GiB - memplan.margin(10 * GiB))
    assert p["update"] == one["update"]  # asleep, vLLM keeps nothing (its CUDA graphs offloaded too)
    awake = memplan.plan(c, tokens=10, vllm={**vllm, "sleep": False}, **free)
    assert awake["update"] - one["update"] == pytest.approx(want)  # without sleep it stays whole
    assert awake["push"] == awake["persistent"] + want + (4 + 2) * 200  # the push too: nothing to wake
    nccl = memplan.plan(c, ranks=4, tokens=10, reference=True, communicators=3, context=GiB, workspace=0.0,
                        gpu_bytes=100 * GiB)
    assert nccl["outside"] == GiB + 3 * memplan.NCCL_COMM  # the CUDA context and three communicators
    assert nccl["update"] - four["update"] == nccl["outside"] == nccl["rollout"] - four["rollout"]


def test_a_no_grad_forward_by_hand_and_a_soft_capped_models_eager_attention():
    """A scoring forward (a reward model's): per token 2h + 3i in the compute dtype, and per token pair the
    padding mask, a byte; a soft-capped model (Gemma 2) runs eager attention: a compute-dtype mask, and per
    head its scores, their soft-capped copy, the fp32 softmax and its cast (3 cb + 4 bytes a pair)."""
    from transformers import Gemma2Config
    c = dict(hidden=8, intermediate=16, context=4096, heads=4, attn_softcap=False)
    assert memplan.inference_activation_bytes(c, 10, 2) == 10 * 2 * (16 + 48) + 100
    c.update(attn_softcap=True, context=6)  # a row is at most the context long
    assert memplan.inference_activation_bytes(c, 10, 2) == 10 * 2 * (16 + 48) + 2 * 60 + 4 * 60 * (6 + 4)
    gemma = Gemma2Config(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=8, vocab_size=64, num_labels=1)
    d = memplan.classifier_counts(gemma)
    assert d["attn_softcap"] and d["heads"] == 2 and d["layer"] > 0 and d["root"] == 64 * 16 + 16 + 16


@pytest.mark.slow
def test_the_hf_engines_rollout_by_hand_and_against_its_generate():
    """hf_rollout_bytes: the KV cache of every sequence at full length (fp32 keys in an fp32 residual stream),
    one layer's attention over it, the step's logits and autocast's weight casts; or the prefill. And against
    a live count of what HFEngine.generate allocates on a real Qwen2.5-0.5B cut to 2 layers (the CPU runs the
    same autocast and attention code as CUDA)."""
    c = TOY
    B, S, V = 4, 10, 50
    kv = B * S * 2 * 2 * 2 * (4 + 2)
    attention = B * S * 4 * (2 * (4 + 2 + 2) + 8) + 16 * B * S  # copies, casts; fp32 scores; masks
    decode = kv + 2 * 2 * V + max(1200 + 6 * B * V + max(attention, 2 * B * V), 14 * B * V)
    prefill = 1200 + 2 * S * (8 * 16 + 15 * 8 + 8 * 8 * 2) + 2 * S * S + 2 * kv / B
    assert memplan.hf_rollout_bytes(c, seqs=B, prompts=2, max_len=S) == max(decode, prefill) + 2**20
    lora = memplan.hf_rollout_bytes(c, seqs=B, prompts=2, max_len=S, lora_rank=8)  # bf16 keys, the adapters
    assert lora < memplan.hf_rollout_bytes(c, seqs=B, prompts=2, max_len=S)
    real = memplan.count(memory._cut(memory.config("qwen2.5-0.5b-instruct"), 2))
    got = memory.track_rollout("qwen2.5-0.5b-instruct", layers=2, prompts=2, n=4, prompt=37, new_tokens=8)
    plan = memplan.hf_rollout_bytes(real, seqs=8, prompts=2, max_len=37 + 8)
    assert got <= plan <= 1.15 * got, (got, plan)


def test_the_plan_divides_the_engines_weights_and_kv_cache_by_tp(tmp_path, monkeypatch, capsys):
    """--vllm_tp: a rank holds 1/tp of vLLM's weights, of a token's KV cache (up to the KV heads: past them
    each rank holds one, replicated) and of a prefill chunk's activations, for the group's batch (tp ranks'
    sequences); the push adds its 1/tp of the weights. plan_run passes the group's batch and tp."""
    c = dict(TOY, kv_per_token_layer=4)
    base = dict(max_num_seqs=4, max_len=100, dtype_bytes=2, batched_tokens=64, cudagraph=GiB)
    for tp, kv_token in ((1, 16), (2, 8), (4, 8)):  # 2 * 4 * 2 bytes over min(tp, 2 KV heads)
        p = memplan.plan(c, tokens=10, vllm={**base, "max_num_seqs": 4 * tp, "tp": tp}, gpu_bytes=100 * GiB)
        assert p["kv_token"] == kv_token
        want = (2 * 1000 / tp + 4 * tp * 100 * kv_token + 64 * (2 * 16 + 4 * 8) * 2 / tp + 2 * 4 * tp * 50 * 4
                + GiB + memplan.VLLM_OVERHEAD)
        assert p["vllm_want"] == pytest.approx(want)
        assert p["push"] == pytest.approx(memplan.CONTEXT + p["persistent"] + 2 * 1000 / tp + GiB
                                          + memplan.VLLM_WAKE + (4 + 2) * 200)  # each rank's graphs, pools
    from rlmini import dist
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (79.2 * GiB, 79.2 * GiB))
    monkeypatch.setattr(dist, "distributed", lambda: True)
    monkeypatch.setenv("WORLD_SIZE", "8")
    path = os.path.join(memory.CONFIGS, "qwen2.5-32b-instruct.json")  # LoRA, 8 ranks: docs/multi-gpu.md

    def run(tp):
        args = _cuda_run_args(gradient_checkpointing=True, lora_rank=16, vllm_tp=tp)
        return memplan.plan_run(args, "grpo", path, torch.device("cuda", 0), torch.bfloat16, 2048,
                                str(tmp_path))
    with pytest.raises(SystemExit, match="vLLM needs at least 66.4 GiB"):  # a whole bf16 engine per rank
        run(1)
    push_one = json.load(open(tmp_path / "memory_plan.json"))["push_gb"] * 1e9
    four = run(4)
    weights = 2 * memplan.count_cached(path, 16, "all-linear")["total"]  # bf16
    assert four["why"] is None and four["max_num_seqs"] == 4 * 64  # 64 prompts x 8 / 8 ranks, 4 ranks' worth
    # the trainer's group, vLLM's world group (split at once from it) and its TP group's torch and PyNccl
    # communicators, outside its share
    assert four["nccl"] == 4 * memplan.NCCL_COMM
    assert push_one - four["push"] == pytest.approx(weights * 3 / 4 - 2 * memplan.NCCL_COMM)


def test_the_plan_holds_against_the_gpu_runs():
    """Each GPU run of benchmarks/gpu_runs.json planned from its configuration, as the trainer plans it: per
    phase, the plan's part in torch's allocator is at least the measured peak and at most 15% above it. The
    runs marked entropy_graph kept the entropy's graph (two fp32 [completion tokens, vocab] buffers of a
    micro-batch: a full one's in the update, the last one's in the next rollout and push); those bytes are
    taken off first. The others ran the code as it is (the same configurations, measured again)."""
    import common
    import train_grpo
    runs = json.load(open(os.path.join(ROOT, "benchmarks", "gpu_runs.json")))["runs"]
    for run in runs:
        args = common.parse_args(train_grpo.Args, [*run["argv"], "--model", "m", "--wandb", "false"])
        c = memplan.count(memplan.load_config(os.path.join(ROOT, run["config"])))
        args.micro_batch_tokens = tokens = run["micro_batch_tokens"]  # startup.build's, a chat model
        prompt, new = run["prompt_tokens"], run["completion_tokens"]
        max_len = min(c["context"], 2 * prompt + new + 8)  # startup.build's bound
        p, _ = memplan.plan_for(args, "grpo", c, ranks=1, dtype=torch.bfloat16, max_len=max_len,
                                gpu_bytes=run["gpu_memory_gib"] * GiB)
        per, seqs = tokens // (prompt + new), args.prompts_per_step * args.group_size  # batches.micro_rows
        last = seqs - (seqs - 1) // per * per
        graph = {"update": 8 * c["vocab"] * per * new, "rollout": 8 * c["vocab"] * last * new}
        graph["push"] = graph["rollout"]
        graph = graph if run["entropy_graph"] else dict.fromkeys(graph, 0)
        for phase, measured in run["measured_gb"].items():
            expected = measured * 1e9 - graph[phase]
            planned = p[phase] - p["outside"]
            assert expected <= planned <= 1.15 * expected, (run["name"], phase, planned / 1e9, expected / 1e9)


def test_the_load_peak_counts_one_tensor_in_the_files_dtype_on_the_device_and_two_on_rank_0s_host():
    """rlmini/dist.py::fill_from_rank0 broadcasts each tensor in the file's dtype and casts in the shard's
    copy; rank 0 reads one tensor ahead into pinned memory. By hand, for 1,000 parameters (largest tensor
    100, LoRA adapters 10) over 4 ranks from bf16 weights: fp32 masters 4,000 / 4 + 2 x 100 on each device,
    2 x 2 x 100 on the host; a LoRA base 2 x 1,000 + 4 x 10 over 4 ranks + 200; a bf16 frozen model beside
    the masters (4,000 + 2,000) / 4 + 200; fp32 weights 4 x 100 in transit, 800 on the host. One process:
    the policy whole on the device and on the host."""
    c = {"total": 1000, "largest": 100, "lora": 10}
    assert memplan.load_peak(c, ranks=4) == {"device": 1200, "host": 400}
    assert memplan.load_peak(c, ranks=4, lora_rank=8) == {"device": 710, "host": 400}
    assert memplan.load_peak(c, ranks=4, frozen=[{"total": 1000}]) == {"device": 1700, "host": 400}
    assert memplan.load_peak(c, ranks=4, file_bytes=4) == {"device": 1400, "host": 800}
    assert memplan.load_peak(c, ranks=1) == {"device": 4000, "host": 4000}


def test_plan_only_prints_the_plan_from_the_config_alone(capsys):
    """--plan_only: from a config.json, no GPU, no weights, no data: the one-line plan, the load's peak,
    exit 0 when it fits, else 1 with the reason; a config that cannot be read names the file; an unknown
    model type names it."""
    import train_grpo
    path = os.path.join(memory.CONFIGS, "qwen2.5-32b-instruct.json")
    flags = ["--plan_only", "true", "--model", path, "--gradient_checkpointing", "true", "--gpus", "16",
             "--gpus_per_node", "8", "--prompts_per_step", "64"]
    with pytest.raises(SystemExit) as e:
        train_grpo.main([*flags, "--vllm_tp", "4"])
    out = capsys.readouterr().out.splitlines()
    assert e.value.code == 0 and out[0].startswith("memory plan per rank (GiB of 79.20): update")
    assert out[0].endswith("; fits") and "rollout" in out[0] and "push" in out[0]
    c = memplan.count(memplan.load_config(path))
    load = memplan.load_peak(c, ranks=16)  # the fp32 shards and one whole bf16 tensor; rank 0's two, pinned
    assert load["device"] == 4 * c["total"] / 16 + 2 * c["largest"] and load["host"] == 2 * 2 * c["largest"]
    assert (load["device"], load["host"]) == (9_748_104_448, 3_114_270_720)  # 32.76B; the largest 778.6M
    assert out[1].startswith("load peak: ") and f"{load['host'] / GiB:.2f} GiB of the model in host" in out[1]
    assert "16 GPUs, 2 nodes of 8" in out[1]
    with pytest.raises(SystemExit, match=r"memory plan: vLLM needs at least .* GiB"):
        train_grpo.main(flags)  # one whole bf16 engine per GPU does not fit beside the trainer
    with pytest.raises(SystemExit, match="cannot read the model's config /nonexistent/config.json"):
        train_grpo.main([*flags[:2], "--model", "/nonexistent"])
    bad = os.path.join(ROOT, "runs", "plan-only-test-config.json")
    os.makedirs(os.path.dirname(bad), exist_ok=True)
    with open(bad, "w") as f:
        json.dump({"model_type": "no-such-model"}, f)
    with pytest.raises(SystemExit, match=r"model type 'no-such-model' is unknown") as e:
        train_grpo.main([*flags[:2], "--model", bad])
    assert bad in str(e.value)
    os.remove(bad)


def test_plan_only_refuses_a_config_without_the_model_sizes(tmp_path, capsys):
    """--plan_only on a config.json naming only its model_type (was: the plan of transformers' default llama,
    6.74B parameters, without a word) or leaving out a size: one line naming the file and the fields."""
    import train_grpo
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(SystemExit, match=rf"^--plan_only: {bare}/config.json: no vocab_size, hidden_size, "
                                         r"intermediate_size, num_hidden_layers, num_attention_heads, "
                                         r"max_position_embeddings: the plan would take transformers' "
                                         r"defaults for 'llama', not your model's sizes"):
        train_grpo.main(["--plan_only", "true", "--model", str(bare)])
    config = json.load(open(os.path.join(memory.CONFIGS, "qwen2.5-0.5b-instruct.json")))
    del config["intermediate_size"]
    (tmp_path / "cut.json").write_text(json.dumps(config))
    with pytest.raises(SystemExit, match=r"cut.json: no intermediate_size: the plan would take"):
        train_grpo.main(["--plan_only", "true", "--model", str(tmp_path / "cut.json")])
    assert "memory plan per rank" not in capsys.readouterr().out
    gpt2 = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 2, "vocab_size": 128,
            "n_positions": 64}  # a family's own names (attribute_map); GPT-2 has no intermediate_size
    assert memplan.missing_sizes(gpt2, memplan.load_config(gpt2)) == []


CASES = memory.CASES  # 1 and 8 ranks; full, LoRA, a reference, PPO's critic, an MoE; checkpointing or not


@pytest.fixture(scope="module")
def tracked():
    """Every case of benchmarks/memory.py::CASES tracked in one process of its own: a fake process group of 8
    ranks, FakeTensorMode and FlexAttention's patched checks stay out of the test process."""
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "memory.py"), "--track", "--json"],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return {tuple(r["case"]): r for r in map(json.loads, out.stdout.splitlines())}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}r{'-lora' * bool(c[2])}{'-ref' * c[3]}"
                                             f"{'-ppo' * c[4]}{'-nockpt' * (not c[5])}" for c in CASES])
def test_the_plan_holds_against_torchs_memory_trackers(case, tracked):
    """Built as the trainer builds it under FakeTensorMode (benchmarks/memory.py::track), one packed
    micro-batch of 8192 tokens with gradients accumulating, then AdamW's step: the plan's persistent state
    equals what MemTracker / FSDPMemTracker count to 0.1% (a frozen model's root resharded after its
    pass), and its update peak is at least theirs and at most 10% above."""
    r = tracked[tuple(case)]
    (got, plan), update = r["persistent"], r["update"]
    assert plan == pytest.approx(got, rel=1e-3)
    assert 1.0 <= update[1] / update[0] <= 1.10, [u / GiB for u in update]


def test_materialized_adamw_trains_bit_for_bit_the_same():
    """AdamW's state made before vLLM sizes itself (memplan.materialize_adamw) changes no step: parameters and
    moments equal a lazily-initialised twin's after three steps with weight decay and a warm-up schedule."""
    torch.manual_seed(0)
    a = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
    b = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
    b.load_state_dict(a.state_dict())
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, fused=True) for m in (a, b)]
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda k: (k + 1) / 3) for o in opts]
    memplan.materialize_adamw(opts[1])
    assert all(torch.count_nonzero(s["exp_avg"]) == 0 and s["step"] == 0 for s in opts[1].state.values())
    assert torch.equal(a[0].weight, b[0].weight)  # the lr-0 step moved nothing
    ptrs = [s["exp_avg"].data_ptr() for s in opts[1].state.values()]
    for step in range(3):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        for m, o, s in zip((a, b), opts, scheds):
            m(x).pow(2).mean().backward()
            o.step()
            s.step()
            o.zero_grad(set_to_none=True)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opts[0].state[p][k], opts[1].state[q][k])
    assert [s["exp_avg"].data_ptr() for s in opts[1].state.values()] == ptrs  # no state allocated by a step


def test_no_persistent_allocation_after_the_engine_is_sized(tmp_path, monkeypatch):
    """The order, checked: in setup AdamW's state exists when the engine is made (the policy's first step
    allocates none), and what a script loads after setup (PPO's critic and its AdamW, a reference) is what the
    plan reserved for it, to the byte (fp32 on CPU)."""
    import common
    import train_ppo
    from rlmini import engine
    events = []
    made = engine.make_engine
    monkeypatch.setattr(engine, "make_engine", lambda *a, **k: events.append("engine") or made(*a, **k))
    materialize = memplan.materialize_adamw
    monkeypatch.setattr(memplan, "materialize_adamw", lambda o: events.append("adamw") or materialize(o))
    args = train_ppo.Args(engine="hf", steps=1, prompts_per_step=4, group_size=2, beta=0.1, wandb=False,
                          out_dir=str(tmp_path), save_every=0)
    run = common.setup(args, "ppo")
    assert events == ["adamw", "engine"]
    state = {id(p): s["exp_avg"].data_ptr() for p, s in run.optimizer.state.items()}
    assert len(state) == len(common.trainable_parameters(run.model))
    critic = train_ppo.load_critic(run.model_path, run.device, run.dtype, args)
    common.add_critic(run, critic, lr=1e-4)
    ref = common.load_reference(run)
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    critic_bytes = nbytes(run.critic.parameters()) + nbytes(
        v for s in run.critic_optimizer.state.values() for v in s.values())
    policy_bytes = nbytes(run.model.parameters()) + nbytes(
        v for s in run.optimizer.state.values() for v in s.values())
    p = run.plan
    assert p["reference"] == nbytes(ref.parameters())
    # the plan's step counters are 512-byte CUDA blocks; on CPU each is 4 bytes
    blocks = len(run.optimizer.state) + len(run.critic_optimizer.state)
    assert p["weights"] + p["adam"] - 508 * blocks == policy_bytes + critic_bytes
    batch = common.rollout(run)
    run.engine.sleep()
    for mb in common.minibatches(run, batch):  # a step: no new AdamW state
        for micro in mb:
            logp, _ = common.policy_logprobs(run, micro)
            (logp * micro.mask).sum().backward()
        common.optimizer_step(run, common.StepStats())
    assert {id(p): s["exp_avg"].data_ptr() for p, s in run.optimizer.state.items()} == state


def _cuda_run_args(**kw):
    import common
    return common.Args(engine="vllm", prompts_per_step=64, group_size=8, micro_batch_tokens=16384, **kw)


@pytest.mark.parametrize("flags, message", [
    ({}, r"memory plan: the update needs \d+\.\d GiB per rank of 79\.2 GiB .* try "
         r"--gradient_checkpointing true, --micro_batch_tokens 8192, --lora_rank 16, more ranks"),
    ({"gradient_checkpointing": True, "vllm_gpu_memory_utilization": 0.9},
     r"memory plan: with vLLM awake a rank needs .* lower --vllm_gpu_memory_utilization"),
    ({"gradient_checkpointing": True, "vllm_sleep": False, "vllm_gpu_memory_utilization": 0.6},
     r"memory plan: the update needs .* reference 0\.0"),  # vLLM awake through the update starves it
    ({"gradient_checkpointing": True, "vllm_gpu_memory_utilization": 0.02},
     r"memory plan: vLLM needs at least .* --vllm_gpu_memory_utilization gives it 1\.6 GiB"),
])
def test_a_plan_that_cannot_fit_stops_in_one_line_before_loading(flags, message, tmp_path, monkeypatch):
    """Qwen2.5-1.5B, full fine-tune, one 80 GB GPU (the CUDA queries are test doubles): without checkpointing
    at 16384 tokens per micro-batch the update cannot fit; a share that starves the trainer or vLLM is
    refused."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (79.2 * GiB, 79.2 * GiB))
    path = os.path.join(memory.CONFIGS, "qwen2.5-1.5b-instruct.json")
    args = _cuda_run_args(**flags)
    with pytest.raises(SystemExit, match=message) as e:
        memplan.plan_run(args, "grpo", path, torch.device("cuda", 0), torch.bfloat16, 1600, str(tmp_path))
    assert "\n" not in str(e.value)
    plan = json.load(open(tmp_path / "memory_plan.json"))  # written before it stopped
    assert plan["gpu_gb"] == pytest.approx(79.2 * GiB / 1e9)


def test_the_plan_fits_with_checkpointing_and_gives_vllm_the_rest(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (79.2 * GiB, 79.2 * GiB))
    path = os.path.join(memory.CONFIGS, "qwen2.5-1.5b-instruct.json")
    p = memplan.plan_run(_cuda_run_args(gradient_checkpointing=True), "grpo", path, torch.device("cuda", 0),
                         torch.bfloat16, 1600, str(tmp_path))
    line = capsys.readouterr().out.strip()
    assert line.startswith("memory plan per rank (GiB of 79.20): update") and line.endswith("; fits")
    assert p["why"] is None and 0.3 < p["share"] < 0.9
    assert p["rollout"] <= 79.2 * GiB - p["margin"] and p["update"] <= 79.2 * GiB - p["margin"]


def test_a_cpu_plan_counts_a_steps_tokens_and_the_hosts_memory(monkeypatch):
    """A micro-batch never holds more than a rank's step: packed, each group's prompt once and G completions
    (SmolLM2 on sums: 8 x (46 + 8 x 32) tokens, not 16,384); a CPU plan above the host's memory stops in
    one line naming the tokens that would fit, and --cpu_memory_gb overrides what the machine says."""
    import common
    import train_grpo
    from rlmini import smollm2
    c = memplan.count(memplan.load_config(smollm2.CONFIG))
    args = common.parse_args(train_grpo.Args, ["--prompts_per_step", "8", "--group_size", "8",
                                               "--micro_batch_tokens", "16384", "--wandb", "false"])
    kw = dict(ranks=1, dtype=torch.float32, max_len=132, gpu_bytes=80 * GiB, cuda=False)
    p, tokens = memplan.plan_for(args, "grpo", c, lengths=(46, 32), **kw)
    assert tokens == 8 * (46 + 8 * 32)
    assert memplan.plan_for(args, "grpo", c, **kw)[1] == 8 * 8 * 132  # no lengths: max_len bounds a sequence
    args.packing = False
    assert memplan.plan_for(args, "grpo", c, lengths=(46, 32), **kw)[1] == 8 * 8 * (46 + 32)
    assert memplan.host_available() > 0
    memplan.check_host(p, tokens, p["update"] + 1, given=False)  # fits: nothing happens
    line = (r"^memory plan: the update needs .* GiB of host memory \(2416 tokens a micro-batch\), more than "
            r"the 4.0 GiB given by --cpu_memory_gb: try --micro_batch_tokens \d+, or --cpu_memory_gb to plan "
            r"for more$")
    with pytest.raises(SystemExit, match=line) as e:
        memplan.check_host(p, tokens, 4 * GiB, given=True)
    fit = int(str(e.value).split("--micro_batch_tokens ")[1].split(",")[0])
    rest, act = p["update"] - p["activations"], p["activations"] / tokens
    assert rest + fit * act <= 4 * GiB < rest + (fit + 1) * act
    with pytest.raises(SystemExit, match=r"GiB of host memory on each of 2 ranks \(2416 tokens"):
        memplan.check_host(p, tokens, 1.5 * p["update"], given=False, local=2)  # torchrun: ranks share a node
