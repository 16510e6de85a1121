"""The memory plan: what each rank holds in each phase of a step, from the model's config alone, made before
anything large is loaded; vLLM's share of the GPU follows from it. One model of memory: the trainer
(common.setup), --plan_only (no GPU, no weights), benchmarks/memory.py and the docs tables call plan().

Parameters are counted exactly from the architecture built on the meta device (no weights, no download). The
activations are structural formulas checked against torch's own memory trackers on real configurations
(tests/test_memory.py; benchmarks/memory.py --track), the HF engine's rollout against a live-bytes count
of its generate, and the whole against the GPU runs in benchmarks/gpu_runs.json.

Phases, per rank (the update runs with vLLM asleep, level 2; rollout and push with it awake). Each phase's
figure is the device memory it needs: what torch's allocator holds (max_memory_allocated's basis) plus
`outside`, the CUDA context and the NCCL communicators, which are not in the allocator.
- persistent: policy weights (fp32 masters; LoRA: the base in the compute dtype plus fp32 adapters), AdamW's
  two fp32 moments and its step counters, the frozen models (a reference, later a teacher or a reward model:
  `frozen`, in the compute dtype: --beta's reference, the models a script declares in Args.frozen_models),
  PPO's critic and its AdamW, all sharded over the ranks under FSDP2 (a frozen model's root reshards after
  each pass: rlmini/dist.py::reshard_frozen), and WORKSPACE. A frozen model stays on the GPU from its load
  to the run's end (no offload between its uses). The trainer materialises AdamW's state before vLLM starts
  (materialize_adamw).
- update: persistent + gradients + the activations of one micro-batch (--micro_batch_tokens) at the larger of
  its forward's end (the checkpoint inputs, autocast's cached compute-dtype weights, the entropy's three fp32
  [chunk, vocab] buffers) and its backward (the vocabulary chunk's five, the head's gradient; or one layer
  recomputed); vLLM asleep keeps nothing on the GPU; with --vllm_sleep false it keeps its whole share.
- rollout: persistent + vLLM's share (weights, KV cache, activations, CUDA graphs); or the HF engine's
  generate (hf_rollout_bytes: the KV cache of the rank's whole rollout batch at full length, one layer's
  attention over it, a step's logits, autocast's weights); and at the first step the set-up's zero
  gradients (materialize_adamw).
- push: persistent + vLLM's weights (woken first) and what every wake-up restores with them (its CUDA graphs,
  runtime pool and workspace: VLLM_WAKE) + one gathered parameter in transit, before its KV cache (+
  --server_push nccl's packed buffers).
- a reward model (--reward_model): its weights in every phase (none with --reward_model_offload), and while it
  scores, in the rollout with vLLM awake, what scoring adds (reward_model_share).
- load: the peak while the models load (load_peak), on the device and in host memory per node.
"""
import functools
import json
import os
from dataclasses import dataclass

import torch

from rlmini import durable
from rlmini.logprobs import chunk_for
from rlmini.options import arg


@dataclass
class PlanArgs:
    """--plan_only's options: the plan of a run on GPUs this machine may not have (plan_only)."""
    plan_only: bool = arg(False, "print the memory plan for --gpus GPUs from the model's config and exit")
    gpus: int = arg(1, "--plan_only: GPUs (ranks) the run would use (nodes x GPUs per node)", ge=1)
    gpus_per_node: int = arg(8, "--plan_only: GPUs per node (host memory is per node)", ge=1)
    gpu_memory_gb: float = arg(79.2, "--plan_only: GiB per GPU as torch shows it (80 GB H100: 79.2)", gt=0)
    plan_prompt_tokens: int = arg(512, "--plan_only: the longest prompt, in tokens (no data is read)", ge=1)
    cpu_memory_gb: float = arg(0.0, "CPU runs: GiB of host memory the plan must fit (0: what the machine has "
                               "available, MemAvailable or the cgroup's limit)", ge=0)


GiB = 2**30
CONTEXT = 1.0 * GiB  # CUDA context and the cuBLAS/cuDNN handles outside torch's allocator, per process
# one NCCL communicator's buffers (outside torch's allocator): NVIDIA/nccl#864 saw 1.6 GB for one after an
# all-reduce and about 6 GB for three; #964 0.54-0.69 GB on 4 A100s; #986: linear in the channels (more for
# H100 NVLink's bandwidth, NVLS more again), flat beyond 2 nodes. Conservative; NCCL_NVLS_ENABLE=0 saves some
NCCL_COMM = 2.0 * GiB
# what torch's allocator holds that the CPU trackers cannot see: cuBLAS/cuBLASLt workspaces (32 MiB per handle
# and stream on Hopper), compiled kernels' buffers, a step's small tensors. The GPU runs (benchmarks/
# gpu_runs.json) held 0.10 GB beyond weights and AdamW between steps, their update peaks 0.11-0.48 GB above
# the tracker's on the same code
WORKSPACE = 0.5 * GiB
VLLM_OVERHEAD = 1.5 * GiB  # vLLM's non-torch memory and the sampler's buffers beyond its profiled peak
CUDAGRAPH = 1.0 * GiB  # vLLM's captured CUDA graphs, inside its share while awake (eager on CPU: none)
# vLLM's "runtime" pool (the KV cache's init state) and "workspace" scratch: like the CUDA graphs, restored by
# any wake-up (vllm/device_allocator/cumem.py::CuMemAllocator.wake_up loads back every tag but the deferrable
# weights and kv_cache), so the push's wake_up(["weights"]) brings them back too. Not measured here: a bound
VLLM_WAKE = 0.5 * GiB
MIN_MARGIN = 2 * GiB  # the allocator's fragmentation and what no term above counts
# vLLM's packed NCCL weight transfer (vllm/distributed/weight_transfer/packed_tensor.py: DEFAULT_PACKED_
# BUFFER_SIZE_BYTES, DEFAULT_PACKED_NUM_BUFFERS; rlmini/transfer.py uses its defaults)
PACKED_BUFFER, PACKED_BUFFERS = 1 * GiB, 2


def margin(gpu_bytes: float) -> float:
    return max(MIN_MARGIN, 0.05 * gpu_bytes)


def nccl_buffers(c: dict, compute_bytes: int = 2) -> float:
    """--server_push nccl on the sender (rank 0): vLLM's producer (packed_tensor.py::
    packed_nccl_broadcast_producer) keeps PACKED_BUFFERS packed chunks in flight, each up to the buffer size
    plus one tensor (pack_tensors stops once past the size), and while it packs the next one holds that
    chunk's parameters (rlmini/transfer.py yields fresh gathered, cast copies) beside their torch.cat."""
    return (PACKED_BUFFERS + 1) * (PACKED_BUFFER + compute_bytes * c["largest"])


def load_config(path_or_dict):
    """A transformers config from a model folder, a config.json path, or its dict (no download)."""
    from transformers import AutoConfig
    if isinstance(path_or_dict, dict):
        return AutoConfig.for_model(**path_or_dict)
    if str(path_or_dict).endswith(".json"):
        with open(path_or_dict) as f:
            return AutoConfig.for_model(**json.load(f))
    return AutoConfig.from_pretrained(path_or_dict)


def _targets(name: str, targets: str) -> bool:
    if targets == "all-linear":
        return True
    return any(name == t or name.endswith("." + t) for t in targets.split(","))


def count(config, lora_rank: int = 0, lora_targets: str = "all-linear") -> dict:
    """Exact counts from the model built on the meta device: parameters in all, per decoder layer (the class
    FSDP2 shards by), in the root (embeddings, head, final norm), the largest tensor, the input embedding,
    LoRA adapter parameters on --lora_targets (r (in + out) per linear layer of the decoder), and the widths
    the activations and the KV cache use. A mixture of experts holds every expert (total) but runs top-k of
    them a token (active: FLOPs, MFU), and its MLP width per token is top-k experts' (with the router's)."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    classes = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in classes]
    total = sum(p.numel() for p in model.parameters())
    per_layer = [sum(p.numel() for p in m.parameters()) for m in layers]
    head = model.get_output_embeddings()
    lora = adapted = 0
    for layer in layers:
        for name, m in layer.named_modules():
            if isinstance(m, torch.nn.Linear) and lora_rank and _targets(name, lora_targets):
                lora, adapted = lora + lora_rank * (m.in_features + m.out_features), adapted + 1
    first = layers[0] if layers else model
    norms = sum(1 for m in first.modules() if "norm" in type(m).__name__.lower())
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = text.hidden_size
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    # a mixture of experts: each token runs top-k of E routed experts (the FLOPs' count, MFU), all are held
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in f".{n}")
    n_experts = max(int(getattr(text, k, 0) or 0) for k in ("num_experts", "num_local_experts",
                                                              "n_routed_experts"))
    top_k = int(getattr(text, "num_experts_per_tok", 0) or 0)
    active = total - routed + (routed * top_k // n_experts if n_experts else routed)
    width = getattr(text, "intermediate_size", 4 * text.hidden_size)  # the MLP's, per token
    if n_experts:  # top-k experts' widths (a shared expert's beside them)
        width = top_k * (getattr(text, "moe_intermediate_size", None) or width) + (
            getattr(text, "shared_expert_intermediate_size", 0) or 0)
    return {"total": total, "active": active, "layers": len(layers), "layer": max(per_layer, default=0),
            "root": total - sum(per_layer), "largest": max(p.numel() for p in model.parameters()),
            "tensors": len(list(model.parameters())), "lora": lora, "lora_tensors": 2 * adapted,
            "hidden": hidden, "intermediate": width,
            # a MoE layer per token (transformers' grouped_mm experts): the router's logits (compute dtype)
            # and softmax (fp32) over E, the hidden state copied to each of its top-k experts and each
            # expert's output (kept for the routing weight's product), the indices (int64) and weights
            "router": (6 * n_experts + 4 * top_k * hidden + 38 * top_k) if n_experts else 0,
            "kv_per_token_layer": 2 * kv_heads * head_dim, "kv_heads": kv_heads, "heads": heads,
            "head_dim": head_dim, "vocab": head.weight.shape[0],
            "embedding": model.get_input_embeddings().weight.numel(), "norms": max(norms, 2),
            "tied": head.weight is model.get_input_embeddings().weight,
            "context": getattr(text, "max_position_embeddings", 4096),
            "softcap": getattr(text, "final_logit_softcapping", None) is not None,
            "attn_softcap": getattr(text, "attn_logit_softcapping", None) is not None}


@functools.lru_cache(maxsize=8)
def count_cached(path: str, lora_rank: int, lora_targets: str) -> dict:
    return count(load_config(path), lora_rank, lora_targets)


def layer_activation_bytes(c: dict, compute_bytes: int) -> float:
    """Bytes per token per decoder layer saved for backward, under autocast over fp32 masters (bf16: 2):
    the MLP's four i-wide tensors (gate, up, the activation, their product) and, per h, the fp32 residual's
    norms (8h each) and the compute-dtype casts and q/k/v/out (15h); a mixture of experts' router and copies
    beside (count's "router"). Checked by the tracker on Qwen2.5, Llama-3.1, Gemma-2 and Qwen3-30B-A3B
    (tests/test_memory.py)."""
    h, i = c["hidden"], c["intermediate"]
    return (8 * i + 15 * h + 8 * h * c["norms"] + c.get("router", 0)) * compute_bytes / 2


def _cast_weights(c: dict, compute_bytes: int) -> float:
    """Autocast's compute-dtype copies of every fp32 master a forward reads (a whole model's: torch caches
    each cast of a leaf that requires grad until the autocast region ends, aten/src/ATen/autocast_mode.cpp::
    cached_cast); the input embedding is looked up, not cast (a tied head is cast once)."""
    return compute_bytes * (c["total"] - (0 if c["tied"] else c["embedding"]))


def hf_rollout_bytes(c: dict, *, seqs: int, prompts: int, max_len: int, ranks: int = 1,
                     compute_bytes: int = 2, lora_rank: int = 0) -> float:
    """What the HF engine's generate (rlmini/engine.py::HFEngine.generate) adds to a rank's persistent state:
    `seqs` sequences (the rank's rollout batch) of up to `max_len` tokens, from `prompts` prompts. Its peak is
    the last decoding step: the KV cache of every sequence at full length (the keys in fp32 where the residual
    stream is, autocast over fp32 masters: the rotary embedding's fp32 cos/sin promote them), one layer's
    attention over it (transformers' sdpa repeats keys and values for every head when a mask is given,
    integrations/sdpa_attention.py::repeat_kv, and autocast casts fp32 keys for sdpa), beside the forward's
    cached weight casts, the last step's logits and log-softmax and the new logits; or the sampling of a step
    (logits, their fp32 copy divided by the temperature, the last and new log-softmax). The prefill of the
    prompts (left-padded, one layer at a time, and their causal mask) when it is larger."""
    cb, fp32_stream = compute_bytes, ranks == 1 and not lora_rank and compute_bytes < 4
    kb, vb = (4 if fp32_stream else cb), cb
    B, S, V, hd = seqs, max_len, c["vocab"], c["head_dim"]
    kv = B * S * c["layers"] * c["kv_heads"] * hd * (kb + vb)
    # (and sdpa's math kernel's fp32 scores and softmax for the step's one query; the [B, S] masks)
    attention = B * S * c["heads"] * (hd * (kb + vb + (cb if kb != cb else 0)) + 8) + 16 * B * S
    if fp32_stream:  # every weight cast, cached for the step's forward
        weights = _cast_weights(c, cb)
    elif ranks > 1:  # FSDP2: the root stays gathered (no backward reshards it), a layer and the next
        weights = cb * (c["root"] + 2 * c["layer"])
    else:  # a LoRA base in the compute dtype: its adapters' casts
        weights = cb * c["lora"]
    # the prefill's logits stay with its output through the loop
    decode = kv + cb * prompts * V + max(weights + (cb + 4) * B * V + max(attention, cb * B * V),
                                         (cb + 12) * B * V)
    tokens = prompts * S  # a prompt is at most the length less one new token: bounded by S
    prefill = weights + tokens * layer_activation_bytes(c, cb) + prompts * S * S + tokens / S * kv / B
    return max(decode, prefill) + 2**20  # and the loop's small tensors (ids, positions, tokens): under 1 MiB


def plan(c: dict, *, ranks: int = 1, compute_bytes: int = 2, tokens: int = 8192, checkpointing: bool = False,
         reference: bool = False, frozen: list | None = None, critic: bool = False, lora_rank: int = 0,
         vllm: dict | None = None, hf: dict | None = None, gpu_bytes: float = 80 * GiB,
         share: float = 0.0, context: float = CONTEXT, communicators: int = 0, server: bool = False,
         push_buffers: float = 0.0, workspace: float = WORKSPACE,
         reward_model: float = 0.0, reward_scoring: float = 0.0) -> dict:
    """Bytes per rank of each part and each phase for counts `c` (count()). `ranks`: FSDP2 shards over them
    (1: a plain module under autocast). `tokens`: one micro-batch's tokens (--micro_batch_tokens), all of them
    scored. `frozen`: the counts (count()) of the frozen models beside the policy, each in the compute dtype
    and sharded like it; `reference` adds the policy's own (--beta > 0; a LoRA policy's reference is its base
    with the adapters off: none). `vllm`: None, else dict(max_num_seqs, max_len, dtype_bytes, sleep, tp,
    cudagraph): the engine each rank (or each group of tp ranks, max_num_seqs the group's) holds, a tp
    rank its 1/tp of the weights, the KV cache and the activations. `hf`: the HF engine's rollout, dict(seqs,
    prompts, max_len) of hf_rollout_bytes. `share`: --vllm_gpu_memory_utilization (0: the plan's own, what
    the trainer leaves free). `context`: the CUDA context (0 on CPU). `communicators`: NCCL communicators on a
    rank (each NCCL_COMM, created before vLLM sizes itself). `server`: --engine server (a push gathers every
    parameter). `push_buffers`: --server_push nccl's packed buffers in the push (nccl_buffers; rank 0's,
    counted on each). `reward_model`: its bytes per rank held in every phase, `reward_scoring` what its
    scoring adds in the rollout phase, beside vLLM awake (reward_model_share). Returns the parts, the phases,
    `outside`
    (the part of each phase outside torch's allocator), vLLM's share, the load peaks (load_peak) and, when
    something does not fit `gpu_bytes`, `why` (one line with the flags that would make it fit)."""
    n, cb, h, V = ranks, compute_bytes, c["hidden"], c["vocab"]
    P, L = c["total"], c["lora"] if lora_rank else 0
    frozen = list(frozen or []) + ([c] if reference and not lora_rank else [])
    # PPO's critic: the policy's backbone and a one-row value head, without its LM head (unless tied)
    Vc = P - (0 if c["tied"] else V * h) + h + 1
    trained = (L or P) + critic * (L + h + 1 if lora_rank else Vc)
    weights = 4 * trained / n + (cb * (P + critic * Vc) / n if lora_rank else 0)
    grads = 4 * trained / n
    tensors = c["lora_tensors"] if lora_rank else c["tensors"]
    tensors += critic * (tensors + 2 - (not c["tied"] and not lora_rank))  # its head's two, no LM head
    adam = 8 * trained / n + 512 * tensors  # + one step counter per tensor (a 512-byte CUDA block each)
    ref = sum(cb * f["total"] / n for f in frozen)  # its root resharded after a pass (dist.reshard_frozen)
    fp32_stream = n == 1 and not lora_rank and cb < 4  # autocast over fp32 masters: the residual is fp32
    stream = 4 if fp32_stream else cb
    per_layer = layer_activation_bytes(c, cb)
    rows = min(tokens, chunk_for(V))  # positions per vocabulary chunk (rlmini/logprobs.py::token_logprobs)
    # the chunked projection (rlmini/logprobs.py::_chunk_logprobs): its forward holds three fp32 [chunk,
    # vocab] buffers (logits / T, the entropy's softmax and product; at T = 1 one fewer: a bound); its
    # backward five (the recomputed logits, the gradients of the gather and of logsumexp), the head's
    # gradient in the compute dtype (none for a frozen LoRA base), in one process the head's recomputed
    # cast, Gemma 2's soft cap its tanh
    head_grad = cb * V * h * (not lora_rank)
    chunk_fwd = 12 * rows * V
    chunk_bwd = (20 + cb * c["softcap"]) * rows * V + head_grad + (cb * V * h if fp32_stream else 0)
    outside_layers = 17 * h * tokens  # embeddings, final norm, the picked hidden states (fp32), and gradient
    # Gemma 2's soft-capped attention: a FlexAttention score_mod keeps the layer's tensors outside its MLP
    # through non-reentrant checkpointing (the tracker, eager on fake tensors; the compiled CUDA kernel not
    # seen): counted, to be safe
    escaped = (15 + 8 * c["norms"]) * h * cb / 2 if c.get("attn_softcap") else 0.0
    cast = _cast_weights(c, cb) if fp32_stream else (L * cb if lora_rank else 0.0)  # autocast's cached copies
    layer = c["layer"] * (c["lora"] / max(P, 1) if lora_rank else 1)  # a layer's trained parameters
    if n > 1:  # FSDP2: the root stays gathered from forward to backward; a layer's backward holds it and the
        # next gathered, its unsharded gradient and the fp32 reduce-scatter input
        working, layer_bwd = cb * c["root"], 2 * cb * c["layer"] + (cb + 4) * layer
    else:  # one process: autocast's copies of one layer's weights in its recompute
        working, layer_bwd = 0.0, cb * c["layer"] * fp32_stream
    if checkpointing:  # each layer's input kept; in backward one layer recomputed at a time
        saved = tokens * c["layers"] * (stream * h + escaped) + outside_layers
        transient = max(cast + chunk_fwd, chunk_bwd, tokens * per_layer + layer_bwd)
    else:  # every layer's activations, and autocast's weight copies, kept for backward
        saved = tokens * c["layers"] * per_layer + outside_layers + cast
        transient = max(chunk_fwd, chunk_bwd)
    activations = saved + transient  # PPO's critic runs its backward after the policy's: no more at once
    persistent = weights + adam + ref + reward_model + workspace
    outside = context + communicators * NCCL_COMM  # not in torch's allocator
    asleep = 0.0
    if vllm:
        tp = vllm.get("tp", 1)
        vb = vllm.get("dtype_bytes", cb)
        v_weights = vb * P / tp
        # past the KV heads a rank holds one, replicated (vllm/model_executor/layers/linear.py::
        # QKVParallelLinear.__init__, num_kv_head_replicas)
        kv_token = c["layers"] * c["kv_per_token_layer"] * vb / min(tp, c.get("kv_heads", tp))
        kv_need = vllm["max_num_seqs"] * vllm["max_len"] * kv_token
        kv_min = vllm["max_len"] * kv_token
        # its profiled peak: one prefill chunk's MLP and residual, and the sampler's fp32 logits
        v_act = (vllm.get("batched_tokens", 16384) * (2 * c["intermediate"] + 4 * h) * vb / tp
                 + 2 * vllm["max_num_seqs"] * V * 4)
        graphs = vllm.get("cudagraph", CUDAGRAPH)
        v_min = v_weights + kv_min + v_act + graphs + VLLM_OVERHEAD
        v_want = v_weights + kv_need + v_act + graphs + VLLM_OVERHEAD
        # asleep, its CUDA graphs go to host memory with the rest (engine.py::_start_vllm,
        # sleep_mode_offload_cudagraph): nothing stays; without sleep vLLM stays whole through the update
        asleep = 0.0 if vllm.get("sleep", True) else None
    # the push: one parameter gathered in fp32 and cast for vLLM; a no-grad forward (calibrate, the push
    # check) leaves an FSDP2 root gathered until the next backward
    push_extra = (4 + cb) * c["largest"] if vllm or server else 0.0
    gathered = cb * c["root"] if n > 1 else 0.0
    fixed, given = outside + margin(gpu_bytes), share > 0
    if vllm and not given:  # what the trainer leaves free while vLLM is awake (scoring: common.rollout)
        share = (gpu_bytes - fixed - persistent - gathered - max(push_extra, reward_scoring)) / gpu_bytes
        share = max(0.0, min(share, v_want / gpu_bytes))  # no more than the KV cache the rollout batch fills
    v_bytes = share * gpu_bytes if vllm else 0.0
    if vllm and asleep is None:
        asleep = v_bytes
    hf_bytes = hf_rollout_bytes(c, **hf, ranks=n, compute_bytes=cb, lora_rank=lora_rank) if hf else 0.0
    update = outside + persistent + grads + working + activations + asleep
    # the first step's rollout phase also holds the set-up: materialize_adamw's zero gradients; a reward model
    # scores beside vLLM awake, after the HF engine's generate has let go of its cache
    rollout = outside + persistent + max(v_bytes + gathered + reward_scoring, hf_bytes, reward_scoring, grads)
    # wake_up(["weights"]) restores more than the weights; an engine that never sleeps is whole all along
    sleeps = vllm and vllm.get("sleep", True)
    woken = (v_weights + graphs + VLLM_WAKE if sleeps else v_bytes) + gathered if vllm else 0.0
    push = outside + persistent + woken + push_extra + push_buffers
    load = load_peak(c, ranks=n, compute_bytes=cb, lora_rank=lora_rank, frozen=frozen)
    out = {"weights": weights, "grads": grads, "adam": adam, "reference": ref, "working": working,
           "activations": activations, "reward_model": reward_model, "reward_scoring": reward_scoring,
           "persistent": persistent,
           "update": update, "rollout": rollout,
           "push": push, "peak": max(update, rollout, push), "vllm": v_bytes, "hf": hf_bytes, "share": share,
           "given": given, "gpu": gpu_bytes, "margin": margin(gpu_bytes), "outside": outside,
           "nccl": communicators * NCCL_COMM, "load_device": outside + load["device"],
           "load_host": load["host"], "why": None}
    if vllm:
        seqs = int(max(0.0, v_bytes - (v_min - kv_min)) // max(kv_min, 1))  # full-length sequences at once
        out.update(vllm_min=v_min, vllm_want=v_want, kv_token=kv_token, seqs=seqs,
                   max_num_seqs=vllm["max_num_seqs"])
    out["why"] = _why_not(out, tokens=tokens, checkpointing=checkpointing, lora_rank=lora_rank, ranks=n)
    return out


def load_peak(c: dict, *, ranks: int = 1, compute_bytes: int = 2, file_bytes: int = 2, lora_rank: int = 0,
              frozen: list | None = None) -> dict:
    """The peak bytes while the models load: `device` per rank (what torch's allocator holds; the plan adds
    `outside`) and `host` per node. `file_bytes`: the checkpoint's dtype (bf16 hub weights: 2).
    Under torchrun (ranks > 1, rlmini/models.py::load_streamed): every rank builds the models on the meta
    device; global rank 0 reads one tensor at a time from the safetensors files and broadcasts it in the
    file's dtype, and each rank casts its FSDP2 shard out of it (rlmini/dist.py::fill_from_rank0). On the
    device: the shards of everything loaded (the policy's fp32 masters, or a LoRA base in the compute dtype
    and fp32 adapters; each frozen model in the compute dtype) plus one whole tensor in the file's dtype; the
    shard's cast needs no more (copy_ on one device converts in its kernel). In host memory, on rank 0's node
    only: the tensor read and the one read ahead, in one pinned buffer of two halves (on CUDA: dist._Staging;
    read straight from the file, no other copy). One process: the policy is built whole in host memory (fp32
    masters; a LoRA base in the compute dtype) and moved to the device, where it is whole; a frozen model
    loads after it the same way."""
    cb, P, big = compute_bytes, c["total"], c["largest"]
    policy = cb * P + 4 * c["lora"] if lora_rank else 4 * P
    frozen_bytes = sum(cb * f["total"] for f in frozen or [])
    if ranks == 1:
        return {"device": policy + frozen_bytes, "host": max(policy, cb * max([0] + [f["total"] for f in
                                                                                        frozen or []]))}
    device = (policy + frozen_bytes) / ranks + big * file_bytes
    return {"device": device, "host": 2 * big * file_bytes}


def _why_not(p: dict, tokens: int, checkpointing: bool, lora_rank: int, ranks: int):
    """None if the plan fits, else one line: the numbers and the flags that would make it fit."""
    usable = p["gpu"] - p["margin"]
    g = lambda x: f"{x / GiB:.1f}"  # noqa: E731
    hints = []
    if not checkpointing:
        hints.append("--gradient_checkpointing true")
    if tokens > 2048:
        hints.append(f"--micro_batch_tokens {tokens // 2}")
    if not lora_rank:
        hints.append("--lora_rank 16")
    hints.append(f"more ranks (FSDP2 shards weights, gradients and AdamW: {ranks} now)")
    fixed = (f"CUDA context and {p['nccl'] / NCCL_COMM:.0f} NCCL communicators {g(p['outside'])}, "
             if p["nccl"] else "")
    if p["load_device"] > usable:
        return (f"loading the models needs {g(p['load_device'])} GiB per rank of {g(p['gpu'])} GiB (less a "
                f"{g(p['margin'])} GiB margin); try " + ", ".join(hints[-2:]))
    if p["update"] > usable:
        return (f"the update needs {g(p['update'])} GiB per rank of {g(p['gpu'])} GiB (less a "
                f"{g(p['margin'])} GiB margin): {fixed}weights+grads+AdamW "
                f"{g(p['weights'] + p['grads'] + p['adam'])}, activations {g(p['activations'])} at {tokens} "
                f"tokens per micro-batch, working copies {g(p['working'])}, reference {g(p['reference'])}, "
                f"reward model {g(p['reward_model'])}; try "
                + ", ".join(hints + ["--reward_model_offload true"] * bool(p["reward_model"])))
    if "vllm_min" in p and p["vllm"] < p["vllm_min"]:
        what = "--vllm_gpu_memory_utilization gives" if p["given"] else "the trainer leaves"
        return (f"vLLM needs at least {g(p['vllm_min'])} GiB (its weights and one sequence's KV cache) but "
                f"{what} it {g(p['vllm'])} GiB of {g(p['gpu'])} GiB (trainer {g(p['persistent'])} GiB "
                f"persistent); try " + ", ".join(hints[-2:] + ["a shorter --max_new_tokens"]))
    scoring = p.get("reward_scoring", 0.0)
    if p["hf"] and p["rollout"] > usable:
        return (f"the HF engine's rollout needs {g(p['rollout'])} GiB per rank of {g(p['gpu'])} GiB (less a "
                f"{g(p['margin'])} GiB margin): trainer {g(p['persistent'])}, generate {g(p['hf'])} (the KV "
                f"cache of the rank's whole rollout batch at full length)"
                + (f" or the reward model's scoring {g(scoring)}" if scoring else "")
                + "; try fewer --prompts_per_step or --group_size, a shorter --max_new_tokens, more ranks, "
                "or --engine vllm" + (", a smaller --reward_model_tokens" if scoring else ""))
    if p["rollout"] > usable or p["push"] > usable:
        return (f"with vLLM awake a rank needs {g(max(p['rollout'], p['push']))} GiB of {g(p['gpu'])} GiB "
                f"(less a {g(p['margin'])} GiB margin): trainer {g(p['persistent'])}, vLLM {g(p['vllm'])} "
                f"(share {p['share']:.2f})" + (f", reward model scoring {g(scoring)}" if scoring else "")
                + "; lower --vllm_gpu_memory_utilization or set it to 0 (the plan's own)"
                + (", or a smaller --reward_model_tokens" if scoring else ""))
    return None


def describe(p: dict, tokens: int, checkpointing: bool, where: str = "") -> str:
    """The plan as one line, printed at start-up: the update's parts, the rollout and the push."""
    g = lambda x: f"{x / GiB:.2f}"  # noqa: E731
    where = where or f"GiB of {g(p['gpu'])}"
    line = (f"memory plan per rank ({where}): update {g(p['update'])} = weights+grads+AdamW "
            f"{g(p['weights'] + p['grads'] + p['adam'])} + activations {g(p['activations'])} "
            f"({tokens} tokens, checkpointing {'on' if checkpointing else 'off'}) + working {g(p['working'])}"
            + (f" + frozen {g(p['reference'])}" if p["reference"] else "")
            + (f" + reward model {g(p['reward_model'])}" if p.get("reward_model") else "")
            + (f" + CUDA context and NCCL {g(p['outside'])}" if p["outside"] else ""))
    if "vllm_min" in p:
        line += (f"; rollout {g(p['rollout'])} with vLLM {g(p['vllm'])} (share {p['share']:.2f}: KV cache "
                 f"for {min(p['seqs'], p['max_num_seqs'])} of {p['max_num_seqs']} sequences at full length)")
    elif p["hf"]:
        line += f"; rollout {g(p['rollout'])} with the HF engine's generate {g(p['hf'])}"
    else:
        line += f"; rollout {g(p['rollout'])}"
    if p.get("reward_scoring"):
        line += f" (reward model scoring {g(p['reward_scoring'])})"
    line += f"; push {g(p['push'])}"
    return line + ("" if where.startswith("CPU") else "; fits" if p["why"] is None else "; DOES NOT FIT")


def materialize_adamw(optimizer) -> None:
    """Create AdamW's state now, as its first step() would (exp_avg, exp_avg_sq, step), without changing
    training by a bit: one step at lr 0 with zero gradients (p - 0 * u = p; weight decay multiplies by 1),
    then
    the step counters back to 0. torch creates the state lazily (torch/optim/adam.py::Adam._init_group); made
    before vLLM sizes itself, it is in the memory vLLM sees as taken."""
    if any(optimizer.state.values()):
        return
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    saved = [(g, g["lr"]) for g in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g, _ in saved:
        g["lr"] = 0.0 if not torch.is_tensor(g["lr"]) else torch.zeros_like(g["lr"])
    try:
        optimizer.step()
    finally:
        for g, lr in saved:
            g["lr"] = lr
        for p in params:
            p.grad = None
    for state in optimizer.state.values():
        if "step" in state:
            state["step"].zero_()


def write(p: dict, run_dir: str, device: str) -> None:
    """memory_plan.json in the run folder (make gpu-check compares it with the measured peaks), in GB; on a
    CPU (`device`) the trainer's part only, without a GPU to fit."""
    keys = ("update", "rollout", "push", "persistent", "activations", "vllm", "hf", "outside", "load_device",
            "load_host", "margin", "gpu")
    data = {f"{k}_gb": p[k] / 1e9 for k in keys} | {"share": p["share"], "device": device}
    # what torch's allocator holds in each phase: max_memory_allocated's basis (rlmini/memstats.py)
    data |= {f"{k}_allocator_gb": (p[k] - p["outside"]) / 1e9 for k in ("update", "rollout", "push")}
    durable.write_text(os.path.join(run_dir, "memory_plan.json"), json.dumps(data, indent=1))


def nccl_communicators(ranks: int, vllm: bool, tp: int = 1, server_push: bool = False) -> int:
    """NCCL communicators on a rank (plan_for): the trainer's group under torchrun, and there vLLM's world
    group (split at once); vLLM's tensor-parallel group's torch and PyNccl ones (tp > 1); --server_push
    nccl's."""
    return (ranks > 1) * (1 + vllm) + 2 * (vllm and tp > 1) + server_push


def engine_batch(args, ranks: int) -> int:
    """vLLM's max_num_seqs: an engine's whole rollout batch (a rank's, or its --vllm_tp group's) decodes
    together."""
    return max(1, min(1024, args.prompts_per_step // max(ranks, 1) * args.group_size * args.vllm_tp))


def plan_for(args, algo: str, c: dict, *, ranks: int, dtype, max_len: int, gpu_bytes: float,
             cuda: bool = True, lengths: tuple | None = None) -> tuple[dict, int]:
    """(plan(), tokens per micro-batch) for a run's options on `ranks` ranks: the trainer's (plan_run) and
    --plan_only's one model of a run. The engine each rank holds (vLLM's batch, the HF engine's rollout batch
    and, with --eval_every and --eval_limit, its evaluation batch), the frozen reference of --beta and the
    models of Args.frozen_models, PPO's critic, and the NCCL communicators: the trainer's process group
    (torchrun); under torchrun vLLM's world-sized device group (vllm/distributed/parallel_state.py::
    init_distributed_environment, init_world_group), which, the default group being bound to a device
    (dist.setup_device), torch splits from it at once (torch/distributed/distributed_c10d.py::
    _new_process_group_helper, split_from; its size-1 groups are not counted); vLLM's tensor-parallel group
    (--vllm_tp > 1: its torch group and its own PyNccl communicator), all made before vLLM's memory snapshot
    (vllm/v1/worker/gpu_worker.py::init_device), so outside its share; and --server_push nccl's. `lengths`:
    (the longest prompt, the completion budget) in tokens, when the task's prompts are known (plan_run)."""
    prompts = max(1, args.prompts_per_step // ranks)
    # a micro-batch holds at most a rank's whole step: never plan more tokens than its sequences can have
    step = prompts * args.group_size * max_len
    if lengths and not (getattr(args, "tools", "") or getattr(args, "env", "")):  # multi-turn: max_len bounds
        prompt, new = lengths
        G = args.group_size
        step = prompts * (prompt + G * new if args.packing else G * (prompt + new))
    tokens = min(args.micro_batch_tokens or args.micro_batch_size * max_len, step)
    vllm = hf = None
    if args.engine == "vllm" and cuda:
        vllm = dict(max_num_seqs=engine_batch(args, ranks), max_len=max_len, tp=args.vllm_tp,
                    dtype_bytes=dtype.itemsize, sleep=args.vllm_sleep, batched_tokens=max(max_len, 16384),
                    cudagraph=CUDAGRAPH)
    if args.engine == "hf":  # evaluation generates a rank's share of --eval_limit prompts at once
        evals = -(-args.eval_limit // ranks) if args.eval_every and args.eval_limit else 0
        seqs = max(prompts * args.group_size, evals * args.eval_n)
        hf = dict(seqs=seqs, prompts=max(prompts, evals), max_len=max_len)
    nccl = args.engine == "server" and getattr(args, "server_push", "disk") == "nccl" and cuda
    communicators = cuda * nccl_communicators(ranks, args.engine == "vllm", args.vllm_tp, nccl)
    p = plan(c, ranks=ranks, compute_bytes=dtype.itemsize, tokens=tokens,
             checkpointing=args.gradient_checkpointing, reference=getattr(args, "beta", 0.0) > 0,
             frozen=[frozen_counts(args, f) for f in getattr(args, "frozen_models", ())
                     if getattr(args, f, 1)],  # a path left empty: no model
             critic=algo == "ppo", lora_rank=args.lora_rank, vllm=vllm, hf=hf, gpu_bytes=gpu_bytes,
             share=args.vllm_gpu_memory_utilization, context=CONTEXT if cuda else 0.0,
             communicators=communicators, server=args.engine == "server",
             push_buffers=nccl_buffers(c, dtype.itemsize) if nccl else 0.0,
             workspace=WORKSPACE if cuda else 0.0,
             **reward_model_share(args, ranks, dtype, cuda))
    return p, tokens


def inference_activation_bytes(c: dict, tokens: int, compute_bytes: int) -> float:
    """A no-grad forward's peak beyond the weights for `tokens` (padding included): within one decoder layer
    the residual, the normed input and the MLP's gate, up and activation (2h + 3i per token; nothing is kept
    for a backward, no KV cache: use_cache=False), and the padding mask, per token pair of a row (at most
    tokens x min(tokens, context) pairs): a byte (sdpa's boolean mask), or under the eager attention of a
    soft-capped model (packing.exact_attention) a compute-dtype mask and each head's scores, soft-capped
    copy and fp32 softmax (transformers/models/gemma2/modeling_gemma2.py::eager_attention_forward)."""
    cb, pairs = compute_bytes, tokens * min(tokens, c["context"])
    mask = cb * pairs + c["heads"] * pairs * (3 * cb + 4) if c.get("attn_softcap") else pairs
    return tokens * cb * (2 * c["hidden"] + 3 * c["intermediate"]) + mask


def classifier_counts(config) -> dict:
    """A sequence classifier's parameters counted on the meta device (its own class, any family): in all, in
    its largest decoder layer (FSDP2's unit: _no_split_modules) and in the root (embeddings, final norm, the
    score head), with the widths its no-grad forward uses (inference_activation_bytes)."""
    from transformers import AutoModelForSequenceClassification
    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(config)
    classes = set(getattr(model, "_no_split_modules", None) or [])
    per_layer = [sum(p.numel() for p in m.parameters()) for m in model.modules()
                 if type(m).__name__ in classes]
    total = sum(p.numel() for p in model.parameters())
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = text.hidden_size
    return {"total": total, "layer": max(per_layer, default=0), "root": total - sum(per_layer),
            "hidden": hidden, "intermediate": getattr(text, "intermediate_size", None) or 4 * hidden,
            "heads": text.num_attention_heads,
            "context": getattr(text, "max_position_embeddings", None) or 4096,
            "attn_softcap": bool(getattr(text, "attn_logit_softcapping", None))}


def reward_model_share(args, ranks: int, dtype, cuda: bool = True) -> dict:
    """--reward_model's terms per rank (none without one): `reward_model`, held in every phase (its weights in
    the compute dtype, sharded over the ranks; none with --reward_model_offload on CUDA, where it waits in CPU
    memory), and `reward_scoring`, what scoring adds in the rollout phase, beside vLLM awake (rlmini/
    reward_model.py::make_reward_model): an offloaded model's shards moved in; under FSDP2 its root gathered
    (resharded after scoring: dist.reshard_frozen) and two decoder layers (the one computing and the next
    gathered ahead, as the update counts them); one scoring micro-batch's no-grad activations
    (reward_model.scoring_tokens)."""
    if not getattr(args, "reward_model", ""):
        return {"reward_model": 0.0, "reward_scoring": 0.0}
    from rlmini import reward_model
    config = reward_model.check(args.reward_model, files=False)  # --plan_only has no weights to look for
    cb = dtype.itemsize
    c = classifier_counts(config)
    weights = cb * c["total"] / ranks
    offload = args.reward_model_offload and cuda
    gathered = cb * (c["root"] + 2 * c["layer"]) if ranks > 1 else 0.0
    scoring = (weights if offload else 0.0) + gathered + inference_activation_bytes(
        c, reward_model.scoring_tokens(args), cb)
    return {"reward_model": 0.0 if offload else weights, "reward_scoring": scoring}


def frozen_counts(args, field: str) -> dict:
    """The counts of the frozen model a script names in `field` (Args.frozen_models: a folder, or a
    config.json for --plan_only), or a one-line error naming the flag."""
    if not hasattr(args, field):
        raise SystemExit(f"{type(args).__name__}.frozen_models names {field!r}, not one of its fields")
    path = getattr(args, field)
    try:
        return count(load_config(path), 0, args.lora_targets)
    except (OSError, ValueError) as e:
        raise SystemExit(f"--{field} {path}: cannot read its config for the memory plan "
                         f"({type(e).__name__})") from None


def plan_run(args, algo: str, path: str, device, dtype, max_len: int, run_dir: str,
             lengths: tuple | None = None) -> dict:
    """The trainer's plan (common.setup, before the model loads): this run's options on this rank's device.
    Prints it as one line (rank 0) and writes memory_plan.json; on CUDA a plan that does not fit stops the run
    in one line with the numbers and the flags that would make it fit. vLLM's share is the plan's `share`."""
    from rlmini import dist, reward_model
    c = count_cached(path, args.lora_rank, args.lora_targets)
    ranks = dist.world_size() if dist.distributed() else 1
    cuda = device.type == "cuda"
    gpu = torch.cuda.mem_get_info(device)[1] if cuda else 80 * GiB
    p, tokens = plan_for(args, algo, c, ranks=ranks, dtype=dtype, max_len=max_len, gpu_bytes=gpu, cuda=cuda,
                         lengths=lengths)
    if dist.rank() == 0:
        print(describe(p, tokens, args.gradient_checkpointing, "" if cuda else "CPU, GiB; no GPU to fit"),
              flush=True)
        write(p, run_dir, device.type)
    if cuda and p["why"] is not None:
        raise SystemExit(f"memory plan: {p['why']}")
    if not cuda:  # rank 0's reading for every rank (one verdict); the ranks of a node share its memory
        here = host_available() if dist.rank() == 0 else None
        available = args.cpu_memory_gb * GiB or dist.from_rank0(here)
        check_host(p, tokens, available, bool(args.cpu_memory_gb), int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    return p


def host_available() -> float:
    """Bytes this process may still take on the host: MemAvailable, or less under a cgroup's memory limit."""
    out = float("inf")
    try:
        with open("/proc/meminfo") as f:
            out = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        pass
    for limit, used in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),  # cgroup v2, v1
                        ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                         "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit) as a, open(used) as b:
                out = min(out, int(a.read()) - int(b.read()))
        except (OSError, ValueError):  # "max": no limit
            continue
    return out


def check_host(p: dict, tokens: int, available: float, given: bool, local: int = 1) -> None:
    """A CPU run whose largest phase, on each of the `local` ranks sharing this host, would not fit the host's
    memory stops before loading, in one line naming the micro-batch that would fit."""
    need = max(p["update"], p["rollout"], p["push"])
    if local * need <= available:
        return
    act = p["activations"] / max(tokens, 1)
    fit = int(max(0.0, available / local - (need - p["activations"])) / act) if act else 0
    source = "given by --cpu_memory_gb" if given else "available here (MemAvailable or the cgroup's limit)"
    hint = f"--micro_batch_tokens {fit}" if fit >= 64 else "a smaller model or --lora_rank"
    ranks = f" on each of {local} ranks" if local > 1 else ""
    raise SystemExit(f"memory plan: the update needs {need / GiB:.1f} GiB of host memory{ranks} ({tokens} "
                     f"tokens a micro-batch), more than the {available / GiB:.1f} GiB {source}: try {hint}, "
                     f"or --cpu_memory_gb to plan for more")


def plan_only(args, algo: str) -> None:
    """--plan_only true: the plan of this run on --gpus GPUs of --gpu_memory_gb GiB (--gpus_per_node a node),
    in bf16 on CUDA unless --dtype says otherwise, from the model's config alone (--model: a folder with a
    config.json, or a config.json; no weights, no GPU, no torch.distributed, no task data). Prints the
    plan's line, the load's peak (device per rank, host memory per node) and whether it fits, then exits: 0
    when it fits, else 1 with the reason and the flags that would help (the trainer's own refusal). The
    sequences' length bound: the longest prompt is --plan_prompt_tokens, the completion --max_new_tokens
    (0: 512, the largest task default), as common.setup bounds them. Nothing happens without the flag."""
    if not getattr(args, "plan_only", False):
        return
    from rlmini import models
    c = _read_counts(args)
    ranks, per_node = args.gpus, min(args.gpus_per_node, args.gpus)
    if ranks % per_node:
        raise SystemExit(f"--plan_only: --gpus {ranks} is not a whole number of nodes of --gpus_per_node "
                         f"{per_node}")
    if ranks % args.vllm_tp:
        raise SystemExit(f"--plan_only: --vllm_tp {args.vllm_tp} must divide --gpus {ranks}")
    dtype = getattr(torch, "bfloat16" if args.dtype == "auto" else args.dtype)
    tiny = models.prompt_style(args.model) == "tiny"
    args.micro_batch_tokens = args.micro_batch_tokens or (0 if tiny else 16384)  # as common.setup sets it
    max_len = min(c["context"], 2 * args.plan_prompt_tokens + (args.max_new_tokens or 512) + 8)
    gpu = args.gpu_memory_gb * GiB
    p, tokens = plan_for(args, algo, c, ranks=ranks, dtype=dtype, max_len=max_len, gpu_bytes=gpu)
    g = lambda x: f"{x / GiB:.2f}"  # noqa: E731
    nodes = ranks // per_node
    print(describe(p, tokens, args.gradient_checkpointing), flush=True)
    print(f"load peak: {g(p['load_device'])} GiB on each GPU, {g(p['load_host'])} GiB of the model in host "
          f"memory on a node ({ranks} GPU{'s' * (ranks > 1)}, {nodes} node{'s' * (nodes > 1)} of {per_node}; "
          f"{c['total'] / 1e9:.2f}B parameters, sequences up to {max_len} tokens)", flush=True)
    if p["why"] is not None:
        raise SystemExit(f"memory plan: {p['why']}")
    raise SystemExit(0)


def _read_counts(args) -> dict:
    """The counts of --model's config (a folder, a config.json, or a built-in model), or a one-line
    error naming the file."""
    from transformers import AutoConfig

    from rlmini import smollm2
    if args.model == "tiny":  # built on first use from the task's alphabet (rlmini/models.py::model_path)
        from rewards import load_task

        from rlmini import models
        path = os.path.join(models.build_tiny_model(load_task(args.task).alphabet), "config.json")
    elif args.model == smollm2.NAME:  # its config ships with the code: no download to plan
        path = smollm2.CONFIG
    else:
        path = args.model if args.model.endswith(".json") else os.path.join(args.model, "config.json")
    try:
        with open(path) as f:
            config = json.load(f)
        kind = config["model_type"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        why = "no model_type in it" if isinstance(e, (KeyError, TypeError)) else str(e).split(": '")[0]
        raise SystemExit(f"--plan_only: cannot read the model's config {path}: {why}") from None
    try:
        built = AutoConfig.for_model(**config)
    except (ValueError, KeyError) as e:
        raise SystemExit(f"--plan_only: {path}: model type {kind!r} is unknown to transformers "
                         f"({type(e).__name__})") from None
    missing = missing_sizes(config, built)
    if missing:  # transformers would fill them in (llama: 6.74B): a plan of a model nobody described
        raise SystemExit(f"--plan_only: {path}: no {', '.join(missing)}: the plan would take transformers' "
                         f"defaults for {kind!r}, not your model's sizes (give the model's own config.json)")
    return count(built, args.lora_rank, args.lora_targets)


SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "max_position_embeddings")  # what count() reads that sets a model's size and context


def missing_sizes(raw: dict, config) -> list:
    """The SIZE_FIELDS the config's class has that its config.json `raw` does not give, under their own name
    or the family's (GPT-2's n_embd: attribute_map); a multimodal config's from its text_config."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    given = (raw.get("text_config") or {}) if text is not config else raw
    return [f for f in SIZE_FIELDS if hasattr(text, f)
            and f not in given and text.attribute_map.get(f, f) not in given]
