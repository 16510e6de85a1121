"""The memory plan: what each rank holds in each phase of a step, from the model's config alone, made before
anything large is loaded; vLLM's share of the GPU follows from it. One model of memory: the trainer
(common.setup), benchmarks/memory.py and the docs tables all call plan().

Parameters are counted exactly from the architecture built on the meta device (no weights, no download).
Activations per token are a structural formula checked against torch's own memory trackers on real
configurations at 8k tokens (tests/test_memory.py; benchmarks/memory.py --track prints the comparison).

Phases, per rank (the update runs with vLLM asleep, level 2; rollout and push with it awake):
- persistent: policy weights (fp32 masters; LoRA: the base in the compute dtype plus fp32 adapters), AdamW's
  two fp32 moments and its step counters, the reference (--beta > 0), PPO's critic and its AdamW; all sharded
  over the ranks under FSDP2. The trainer materialises AdamW's state before vLLM starts (materialize_adamw).
- update: persistent + gradients + the working copies (autocast's compute-dtype weights, or FSDP2's gathered
  units) + the saved activations of one micro-batch (--micro_batch_tokens) + the larger of the chunked LM
  head's fp32 buffers and (checkpointing) one layer recomputed; vLLM asleep keeps nothing on the GPU (its
  CUDA graphs are offloaded too); with --vllm_sleep false it keeps its whole share.
- rollout: persistent + vLLM's share (weights, KV cache, activations, CUDA graphs) + the CUDA context.
- push: persistent + vLLM's weights (woken first) + one gathered parameter in transit, before its KV cache.
"""
import functools
import json
import os

import torch

from rlmini.logprobs import chunk_for

GiB = 2**30
CONTEXT = 1.0 * GiB  # CUDA context and the NCCL/cuBLAS workspaces outside torch's allocator, per process
VLLM_OVERHEAD = 1.5 * GiB  # vLLM's non-torch memory and the sampler's buffers beyond its profiled peak
NCCL_BUFFERS = 2 * GiB  # --server_push nccl: rlmini/transfer.py's packed buffers
CUDAGRAPH = 1.0 * GiB  # vLLM's captured CUDA graphs, inside its share while awake (eager on CPU: none)
MIN_MARGIN = 2 * GiB  # the allocator's fragmentation and what no term above counts


def margin(gpu_bytes: float) -> float:
    return max(MIN_MARGIN, 0.05 * gpu_bytes)


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
    FSDP2 shards by), in the root (embeddings, head, final norm), the largest tensor, LoRA adapter parameters
    on --lora_targets (r (in + out) per linear layer of the decoder), and the widths the activations use."""
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
    return {"total": total, "layers": len(layers), "layer": max(per_layer, default=0),
            "root": total - sum(per_layer), "largest": max(p.numel() for p in model.parameters()),
            "tensors": len(list(model.parameters())), "lora": lora, "lora_tensors": 2 * adapted,
            "hidden": hidden, "intermediate": getattr(text, "intermediate_size", 4 * hidden),
            "kv_per_token_layer": 2 * kv_heads * head_dim, "kv_heads": kv_heads,
            "vocab": head.weight.shape[0], "norms": max(norms, 2),
            "tied": head.weight is model.get_input_embeddings().weight,
            "softcap": getattr(text, "final_logit_softcapping", None) is not None,
            "attn_softcap": getattr(text, "attn_logit_softcapping", None) is not None}


@functools.lru_cache(maxsize=8)
def count_cached(path: str, lora_rank: int, lora_targets: str) -> dict:
    return count(load_config(path), lora_rank, lora_targets)


def layer_activation_bytes(c: dict, compute_bytes: int) -> float:
    """Bytes per token per decoder layer saved for backward, under autocast over fp32 masters (bf16: 2):
    the MLP's four i-wide tensors (gate, up, the activation, their product) and, per h, the fp32 residual's
    norms (8h each) and the compute-dtype casts and q/k/v/out (15h). Checked by the tracker on Qwen2.5,
    Llama-3.1 and Gemma-2 within 1% (tests/test_memory.py)."""
    h, i = c["hidden"], c["intermediate"]
    return (8 * i + 15 * h + 8 * h * c["norms"]) * compute_bytes / 2


def plan(c: dict, *, ranks: int = 1, compute_bytes: int = 2, tokens: int = 8192, checkpointing: bool = False,
         reference: bool = False, critic: bool = False, lora_rank: int = 0, vllm: dict | None = None,
         gpu_bytes: float = 80 * GiB, share: float = 0.0, context: float = CONTEXT,
         push_buffers: float = 0.0, reward_model: float = 0.0) -> dict:
    """Bytes per rank of each part and each phase for counts `c` (count()). `ranks`: FSDP2 shards over them
    (1: a plain module under autocast). `tokens`: one micro-batch's tokens (--micro_batch_tokens), all of them
    scored. `vllm`: None (the HF engine), else dict(max_num_seqs, max_len, dtype_bytes, sleep, tp,
    cudagraph): the engine each rank (or each group of tp ranks, max_num_seqs the group's) holds, a tp
    rank its 1/tp of the weights, the KV cache and the activations. `share`: --vllm_gpu_memory_utilization
    (0: the plan's own, what the trainer leaves free). `context`: the CUDA context (0 on CPU).
    `push_buffers`: --server_push nccl's packed buffers in the push (rank 0's, counted on each).
    `reward_model`: its bytes per rank (reward_model.py::reward_model_bytes), held in every phase. Returns the
    parts, the phases, vLLM's share and, when
    something does not fit `gpu_bytes`, `why` (one line with the flags that would make it fit)."""
    n, cb, h = ranks, compute_bytes, c["hidden"]
    P, L = c["total"], c["lora"] if lora_rank else 0
    # PPO's critic: the policy's backbone and a one-row value head, without its LM head (unless tied)
    V = P - (0 if c["tied"] else c["vocab"] * h) + h + 1
    trained = (L or P) + critic * (L + h + 1 if lora_rank else V)
    weights = 4 * trained / n + (cb * (P + critic * V) / n if lora_rank else 0)
    grads = 4 * trained / n
    tensors = c["lora_tensors"] if lora_rank else c["tensors"]
    tensors += critic * (tensors + 2 - (not c["tied"] and not lora_rank))  # its head's two, no LM head
    adam = 8 * trained / n + 512 * tensors  # + one step counter per tensor (a 512-byte CUDA block each)
    ref = cb * P / n if reference and not lora_rank else 0.0  # LoRA: the base with the adapters off
    per_layer = layer_activation_bytes(c, cb)
    logit_rows = min(tokens, chunk_for(c["vocab"]))
    # the chunked projection's backward with the entropy of the first pass (common.policy_logprobs): 12 fp32
    # [chunk, vocab] buffers (18 with a final soft cap, Gemma 2), and the head's gradient in the compute dtype
    # (none for a frozen LoRA base); one process also holds the head's cast copy (an fp32 master head)
    head = cb * c["vocab"] * h * (not lora_rank)
    logits = (18 if c["softcap"] else 12) * logit_rows * c["vocab"] * 4 + head
    outside = 17 * h * tokens  # embeddings, final norm and the picked hidden states, fp32, and their gradient
    # Gemma 2's soft-capped attention: a FlexAttention score_mod keeps the layer's tensors outside its MLP
    # through non-reentrant checkpointing (the tracker, eager on fake tensors; the compiled CUDA kernel not
    # seen): counted, to be safe
    escaped = (15 + 8 * c["norms"]) * h * cb / 2 if c.get("attn_softcap") else 0.0
    saved = tokens * c["layers"] * (4 * h + escaped if checkpointing else per_layer) + outside
    recompute = tokens * per_layer if checkpointing else 0.0  # in backward, one layer at a time
    layer = c["layer"] * (c["lora"] / max(P, 1) if lora_rank else 1)  # a layer's trained parameters
    if n > 1:  # FSDP2: the root stays gathered from forward to backward; a layer's backward holds it and the
        # next gathered, its unsharded gradient and the fp32 reduce-scatter input
        working = cb * c["root"]
        transient = max(logits, recompute + 2 * cb * c["layer"] + (cb + 4) * layer)
    elif checkpointing:  # autocast's compute-dtype copies, one layer's at a time (recomputed in backward)
        working = layer * cb * (cb < 4)
        transient = max(logits + head * (cb < 4), recompute)
    else:  # autocast's compute-dtype copies of the trained weights, kept for backward (a LoRA base: none)
        working = ((L if lora_rank else P) + critic * (0 if lora_rank else V)) * cb * (cb < 4)
        transient = logits + head * (cb < 4)
    activations = saved + transient  # PPO's critic runs its backward after the policy's: no more at once
    persistent = weights + adam + ref + reward_model
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
                 + 2 * vllm["max_num_seqs"] * c["vocab"] * 4)
        graphs = vllm.get("cudagraph", CUDAGRAPH)
        v_min = v_weights + kv_min + v_act + graphs + VLLM_OVERHEAD
        v_want = v_weights + kv_need + v_act + graphs + VLLM_OVERHEAD
        # asleep, its CUDA graphs go to host memory with the rest (engine.py::_start_vllm,
        # sleep_mode_offload_cudagraph): nothing stays; without sleep vLLM stays whole through the update
        asleep = 0.0 if vllm.get("sleep", True) else None
    push_extra = (4 + cb) * c["largest"]  # one parameter gathered in fp32 and cast for vLLM
    fixed, given = context + margin(gpu_bytes), share > 0
    if vllm and not given:  # what the trainer leaves free while vLLM is awake
        share = (gpu_bytes - fixed - persistent - push_extra) / gpu_bytes
        share = max(0.0, min(share, v_want / gpu_bytes))  # no more than the KV cache the rollout batch fills
    v_bytes = share * gpu_bytes if vllm else 0.0
    if vllm and asleep is None:
        asleep = v_bytes
    update = context + persistent + grads + working + activations + asleep
    rollout = context + persistent + v_bytes
    push = context + persistent + (v_weights if vllm else 0) + push_extra + push_buffers
    out = {"weights": weights, "grads": grads, "adam": adam, "reference": ref, "reward_model": reward_model,
           "working": working,
           "activations": activations, "logits": logits, "persistent": persistent, "update": update,
           "rollout": rollout, "push": push, "peak": max(update, rollout, push), "vllm": v_bytes,
           "share": share, "given": given, "gpu": gpu_bytes, "margin": margin(gpu_bytes), "why": None}
    if vllm:
        seqs = int(max(0.0, v_bytes - (v_min - kv_min)) // max(kv_min, 1))  # full-length sequences at once
        out.update(vllm_min=v_min, vllm_want=v_want, kv_token=kv_token, seqs=seqs,
                   max_num_seqs=vllm["max_num_seqs"])
    out["why"] = _why_not(out, tokens=tokens, checkpointing=checkpointing, lora_rank=lora_rank, ranks=n)
    return out


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
    if p["update"] > usable:
        return (f"the update needs {g(p['update'])} GiB per rank of {g(p['gpu'])} GiB (less a "
                f"{g(p['margin'])} "
                f"GiB margin): weights+grads+AdamW {g(p['weights'] + p['grads'] + p['adam'])}, activations "
                f"{g(p['activations'])} at {tokens} tokens per micro-batch, working copies "
                f"{g(p['working'])}, "
                f"reference {g(p['reference'])}, reward model {g(p['reward_model'])}; try "
                + ", ".join(hints + ["--reward_model_offload true"] * bool(p["reward_model"])))
    if "vllm_min" in p and p["vllm"] < p["vllm_min"]:
        what = "--vllm_gpu_memory_utilization gives" if p["given"] else "the trainer leaves"
        return (f"vLLM needs at least {g(p['vllm_min'])} GiB (its weights and one sequence's KV cache) but "
                f"{what} it {g(p['vllm'])} GiB of {g(p['gpu'])} GiB (trainer {g(p['persistent'])} GiB "
                f"persistent); try " + ", ".join(hints[-2:] + ["a shorter --max_new_tokens"]))
    if p["rollout"] > usable or p["push"] > usable:
        return (f"with vLLM awake a rank needs {g(max(p['rollout'], p['push']))} GiB of {g(p['gpu'])} GiB "
                f"(less "
                f"a {g(p['margin'])} GiB margin): trainer {g(p['persistent'])}, vLLM {g(p['vllm'])} (share "
                f"{p['share']:.2f}); lower --vllm_gpu_memory_utilization or set it to 0 (the plan's own)")
    return None


def describe(p: dict, tokens: int, checkpointing: bool, where: str = "") -> str:
    """The plan as one line, printed at start-up."""
    g = lambda x: f"{x / GiB:.2f}"  # noqa: E731
    where = where or f"GiB of {g(p['gpu'])}"
    line = (f"memory plan per rank ({where}): update {g(p['update'])} = weights+grads+AdamW "
            f"{g(p['weights'] + p['grads'] + p['adam'])} + activations {g(p['activations'])} "
            f"({tokens} tokens, "
            f"checkpointing {'on' if checkpointing else 'off'}) + working {g(p['working'])}"
            + (f" + reference {g(p['reference'])}" if p["reference"] else "")
            + (f" + reward model {g(p['reward_model'])}" if p.get("reward_model") else ""))
    if "vllm_min" in p:
        line += (f"; rollout {g(p['rollout'])} with vLLM {g(p['vllm'])} (share {p['share']:.2f}: KV cache "
                 f"for {min(p['seqs'], p['max_num_seqs'])} of {p['max_num_seqs']} sequences at full length); "
                 f"push {g(p['push'])}")
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
    keys = ("update", "rollout", "push", "persistent", "activations", "vllm", "margin", "gpu")
    data = {f"{k}_gb": p[k] / 1e9 for k in keys} | {"share": p["share"], "device": device}
    with open(os.path.join(run_dir, "memory_plan.json"), "w") as f:
        json.dump(data, f, indent=1)


def engine_batch(args, ranks: int) -> int:
    """vLLM's max_num_seqs: an engine's whole rollout batch (a rank's, or its --vllm_tp group's) decodes
    together."""
    return max(1, min(1024, args.prompts_per_step // max(ranks, 1) * args.group_size * args.vllm_tp))


def plan_run(args, algo: str, path: str, device, dtype, max_len: int, run_dir: str) -> dict:
    """The trainer's plan (common.setup, before the model loads): this run's options on this rank's device.
    Prints it as one line (rank 0) and writes memory_plan.json; on CUDA a plan that does not fit stops the run
    in one line with the numbers and the flags that would make it fit. vLLM's share is the plan's `share`."""
    from rlmini import dist, reward_model
    c = count_cached(path, args.lora_rank, args.lora_targets)
    ranks = dist.world_size() if dist.distributed() else 1
    cuda = device.type == "cuda"
    tokens = args.micro_batch_tokens or args.micro_batch_size * max_len
    vllm = None
    if args.engine == "vllm":
        vllm = dict(max_num_seqs=engine_batch(args, ranks), max_len=max_len, tp=args.vllm_tp,
                    dtype_bytes=dtype.itemsize, sleep=args.vllm_sleep, batched_tokens=max(max_len, 16384),
                    cudagraph=CUDAGRAPH if cuda else 0.0)
    # vLLM's packed NCCL broadcast: two 1 GiB buffers (weight_transfer/packed_tensor.py, its defaults)
    nccl = args.engine == "server" and getattr(args, "server_push", "disk") == "nccl"
    gpu = torch.cuda.mem_get_info(device)[1] if cuda else 80 * GiB
    p = plan(c, ranks=ranks, compute_bytes=dtype.itemsize, tokens=tokens,
             checkpointing=args.gradient_checkpointing,
             reference=getattr(args, "beta", 0.0) > 0, critic=algo == "ppo", lora_rank=args.lora_rank,
             vllm=vllm if cuda else None, gpu_bytes=gpu, share=args.vllm_gpu_memory_utilization,
             context=CONTEXT if cuda else 0.0, push_buffers=NCCL_BUFFERS if nccl and cuda else 0.0,
             reward_model=reward_model.reward_model_bytes(reward_model.check(args.reward_model), ranks,
                                                          dtype.itemsize, args.reward_model_offload)
             if getattr(args, "reward_model", "") else 0.0)
    if dist.rank() == 0:
        print(describe(p, tokens, args.gradient_checkpointing, "" if cuda else "CPU, GiB; no GPU to fit"),
              flush=True)
        write(p, run_dir, device.type)
    if cuda and p["why"] is not None:
        raise SystemExit(f"memory plan: {p['why']}")
    return p

