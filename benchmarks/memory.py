"""Per-GPU memory of a training step: what each rank holds, by model size, number of GPUs and options.

    python benchmarks/memory.py                                  # docs/multi-gpu.md: 0.5B-14B, 1-16 GPUs
    python benchmarks/memory.py --model 7B --gpus 8 --beta 0.04 --critic --no-checkpointing
    python benchmarks/memory.py --model 7B --gpus 1 --lora_rank 16 --beta 0.04   # LoRA on one GPU
    python benchmarks/memory.py --measure                        # the model against measured peak RSS on CPU
    python benchmarks/memory.py --measure --ranks 2              # ... under torchrun, FSDP2 over 2 gloo ranks

The model (one process: a plain module; torchrun: FSDP2 over the ranks, see dist.shard_model):
- policy: fp32 master weights, fp32 gradients and AdamW's two fp32 moments, 16 bytes per parameter,
  divided by the number of ranks under FSDP2;
- working weights in the compute dtype: one process under autocast holds a compute-dtype copy of every
  weight while it trains (bf16: 2 bytes per parameter; none in fp32); FSDP2 holds the root unit
  (embeddings, LM head, final norm: gathered from forward to backward) and two decoder layers (the one
  computing and the one prefetched), twice while gathering (the all-gather buffer and the parameters
  copied out of it), plus their unsharded gradients and fp32 reduce-scatter input in backward;
- activations of one micro-batch: per token and decoder layer about (10 h + 4 kv + 4 i) values saved for
  backward (h hidden size, kv key/value width, i MLP width; attention by FlashAttention/SDPA, no score
  matrix), or with --gradient_checkpointing each layer's input plus one layer recomputed; and the LM
  head's chunk of fp32 logits (token_logprobs: logprobs.chunk_for positions at a time), 5 buffers of chunk x
  vocab in its backward; the CPU attention kernel's boolean masks (rows x queries x keys per row set);
- reference model (--beta > 0): weights in the compute dtype, sharded, its gathered units;
- PPO's critic: the policy's backbone again with its own gradients and AdamW state;
- LoRA (--lora_rank r): the base frozen in the compute dtype (no master copy, gradients or AdamW state), the
  adapters r (in + out) per linear layer of the attention and MLP trained like full weights (16 bytes each);
  the reference model is the base with its adapters off (nothing more), PPO's critic its own base copy and
  adapters;
- vLLM: --vllm_gpu_memory_utilization of the GPU while it generates, and at least its own bf16 copy of
  the whole model (each rank's engine holds all of it) plus a few GB of KV cache; asleep (level 2)
  during the update.
The peak is the larger of the rollout phase (states without gradients, vLLM awake) and the update phase (vLLM
asleep): the backward (states, gradients, working weights, activations) or the optimizer step (states,
gradients and AdamW's foreach temporaries, about 4 bytes per local parameter). Not counted: the CUDA context
(about 0.5-1 GB), the allocator's fragmentation, vLLM's CUDA graphs and what level-2 sleep keeps.
"""
import argparse
import os
import resource
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from rlmini.logprobs import chunk_for  # noqa: E402

GB = 1e9
# Qwen2.5 shapes (config.json): hidden, layers, MLP width, attention and key/value heads, vocabulary, tied
SHAPES = {
    "0.5B": dict(hidden=896, layers=24, intermediate=4864, heads=14, kv_heads=2, vocab=151936, tied=True),
    "1.5B": dict(hidden=1536, layers=28, intermediate=8960, heads=12, kv_heads=2, vocab=151936, tied=True),
    "7B": dict(hidden=3584, layers=28, intermediate=18944, heads=28, kv_heads=4, vocab=152064, tied=False),
    "14B": dict(hidden=5120, layers=48, intermediate=13824, heads=40, kv_heads=8, vocab=152064, tied=False),
}


def parameters(s: dict) -> dict:
    """Parameter counts: one decoder layer (q/k/v with bias, o, gated MLP, two norms), the root unit
    (embeddings, LM head unless tied, final norm) and the whole model."""
    h, i, kv = s["hidden"], s["intermediate"], s["hidden"] // s["heads"] * s["kv_heads"]
    layer = (h * h + h) + 2 * (h * kv + kv) + h * h + 3 * h * i + 2 * h
    root = s["vocab"] * h * (1 if s["tied"] else 2) + h
    return {"layer": layer, "root": root, "total": s["layers"] * layer + root}


def lora_parameters(s: dict, rank: int) -> int:
    """Adapter parameters: r (in + out) for each of q, k, v, o, gate, up and down in every layer."""
    h, i, kv = s["hidden"], s["intermediate"], s["hidden"] // s["heads"] * s["kv_heads"]
    return s["layers"] * rank * (2 * h + 2 * (h + kv) + 2 * h + 2 * (h + i) + (i + h))


def memory(s: dict, ranks: int, sharded: bool, compute_bytes: int = 2, tokens: int = 8192,
           logit_tokens: int = 4096, checkpointing: bool = True, reference: bool = False,
           critic: bool = False, vllm_gb: float = 0.0, lora_rank: int = 0, attention_rows: list = ()) -> dict:
    """GB per GPU of each part and the peak; `tokens` computed per micro-batch (packed or padded),
    `logit_tokens` of them scored; `attention_rows`: (rows, queries, keys) of each row set of the CPU kernel,
    whose boolean masks are built once per micro-batch (FlexAttention's layout is O(tokens): nothing)."""
    p = parameters(s)
    h, i, kv = s["hidden"], s["intermediate"], s["hidden"] // s["heads"] * s["kv_heads"]
    share = ranks if sharded else 1
    models = 1 + critic  # the critic trains like the policy (its head is one row, its LM head absent)
    trained = lora_parameters(s, lora_rank) if lora_rank else p["total"]
    weights, grads, adam = (k * trained / share * models for k in (4, 4, 8))
    if lora_rank:  # + the frozen base in the compute dtype
        weights += compute_bytes * p["total"] / share * models
    if sharded:  # the root and two layers gathered in the compute dtype (all-gather buffer, then parameters),
        # and the unsharded gradients of the root and a layer with their fp32 reduce-scatter input; a LoRA
        # base has no gradients (the adapters' are in `grads`)
        gathered = 2 * compute_bytes * (p["root"] + 2 * p["layer"])
        working = gathered + (compute_bytes + 4) * (p["root"] + p["layer"]) * (not lora_rank)
    else:  # autocast's cached casts (a LoRA base is stored in the compute dtype already)
        working = (trained if lora_rank else p["total"]) * (compute_bytes if compute_bytes < 4 else 0)
    per_layer = compute_bytes * (10 * h + 4 * kv + 4 * i)  # bytes per token
    if checkpointing:
        activations = tokens * (s["layers"] * compute_bytes * h + per_layer)
    else:
        activations = tokens * s["layers"] * per_layer
    # the chunked fp32 projection's backward: the recomputed logits, logits / T, logsumexp's softmax, the
    # gather's scattered gradient and their sum (5 buffers, measured 5.3 on CPU with the weight's gradient)
    activations += 5 * min(logit_tokens, chunk_for(s["vocab"])) * s["vocab"] * 4
    activations += sum(r * q * k for r, q, k in attention_rows)  # bool masks
    ref = 0.0
    if reference and not lora_rank:  # LoRA: the base with the adapters off
        ref = compute_bytes * (p["total"] / share + (p["root"] + 2 * p["layer"] if sharded else 0))
    rollout = weights + adam + ref + vllm_gb * GB
    step = weights + grads + adam + ref + 4 * trained / share * models  # AdamW's foreach temporaries
    update = max(weights + grads + adam + working + activations + ref, step)
    parts = {"weights": weights, "grads": grads, "adam": adam, "working": working, "activations": activations,
             "reference": ref, "vllm": vllm_gb * GB, "rollout": rollout, "update": update,
             "peak": max(rollout, update)}
    return {k: v / GB for k, v in parts.items()}


def table(args) -> str:
    rows = ["| model | params | GPUs | weights+grads+Adam | working | activations | reference | vLLM | peak "
            "| fits 80 GB |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for name in args.model.split(","):
        s = SHAPES[name]
        for g in [int(x) for x in args.gpus.split(",")]:
            # whole bf16 model + KV
            vllm_gb = max(args.vllm_share * args.gpu_gb, 2 * parameters(s)["total"] / GB + 4)
            m = memory(s, g, sharded=g > 1, tokens=args.tokens, logit_tokens=args.tokens // 2,
                       checkpointing=args.checkpointing, reference=args.beta > 0, critic=args.critic,
                       vllm_gb=vllm_gb,
                       lora_rank=args.lora_rank)
            rows.append(f"| {name} | {parameters(s)['total'] / 1e9:.2f}B | {g} | "
                        f"{m['weights'] + m['grads'] + m['adam']:.1f} | {m['working']:.1f} | "
                        f"{m['activations']:.1f} | {m['reference']:.1f} | {m['vllm']:.0f} | {m['peak']:.1f} "
                        f"| {'yes' if m['peak'] <= args.gpu_gb else 'no'} |")
    return "\n".join(rows)


# -------------------------------------------------------------------------------------------- measured on CPU

# Qwen2.5-1.5B scaled down in width (1536 -> 256, 12/2 heads of 128 -> 4/2 heads of 64) and depth (28 -> 8)
MEASURE_SHAPE = dict(hidden=256, layers=8, intermediate=1536, heads=4, kv_heads=2, vocab=32000, tied=False)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure_worker(group: int, prompt: int, length: int, checkpointing: bool) -> None:
    """Two optimizer steps of the MEASURE_SHAPE model in fp32 on CPU on one packed micro-batch: one prompt of
    `prompt` tokens and `group` completions of `length` tokens, as the trainer runs it (token_logprobs over
    the completions, backward, AdamW); prints this rank's peak RSS increase and the model's figure."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from rlmini import dist, logprobs, models, packing
    torch.manual_seed(0)
    s = MEASURE_SHAPE
    cfg = Qwen2Config(hidden_size=s["hidden"], num_hidden_layers=s["layers"],
                      intermediate_size=s["intermediate"], num_attention_heads=s["heads"],
                      num_key_value_heads=s["kv_heads"], vocab_size=s["vocab"], tie_word_embeddings=s["tied"],
                      max_position_embeddings=prompt + length)
    device, dtype = dist.setup_device(argparse.Namespace(dtype="float32"))
    g = torch.Generator().manual_seed(0)
    completions = [torch.randint(3, s["vocab"], (length,), generator=g).tolist() for _ in range(group)]
    base = rss_bytes()
    with torch.device("meta"):  # built without storage and sharded first: no whole model on any rank
        model = dist.shard_model(AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa"), dtype)
    model.to_empty(device=device)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    rotary = model.model.rotary_emb  # its tables are buffers computed at construction: build them for real
    for name, buf in type(rotary)(config=cfg).named_buffers():
        rotary.register_buffer(name, buf, persistent=False)
    models.prepare_for_training(model, checkpointing, packing=True)
    batch = packing.make_batch([[5] * prompt] * group, completions, 0, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(2):
        logp, _ = logprobs.token_logprobs(model, batch, 1.0)
        (-(logp * batch["mask"]).sum() / batch["mask"].sum()).backward()
        dist.clip_grad_norm(list(model.parameters()), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    ranks = dist.world_size()
    m = memory(s, ranks, sharded=dist.distributed() and ranks > 1, compute_bytes=4,
               tokens=batch["packed"]["computed"], logit_tokens=group * length, checkpointing=checkpointing,
               attention_rows=[(group, length, prompt + length)])
    print(f"| {ranks} | {parameters(s)['total'] / 1e6:.0f}M | {prompt} + {group} x {length} | "
          f"{'on' if checkpointing else 'off'} | {dist.rank()} | {m['update']:.2f} | {peak / GB:.2f} | "
          f"{peak / GB / m['update']:.2f} |", flush=True)
    dist.barrier()


def measure(args) -> None:
    print("| ranks | params | micro-batch (prompt + G x completion) | checkpointing | rank | model: update "
          "peak (GB) | measured: peak RSS increase (GB) | ratio |")
    print("|---|---|---|---|---|---|---|---|", flush=True)
    for length in map(int, args.lengths.split(",")):
        worker = [os.path.abspath(__file__), "--measure-worker", "--group", str(args.group), "--prompt",
                  str(args.prompt), "--length", str(length)]
        worker += [] if args.checkpointing else ["--no-checkpointing"]
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]
        cmd = [sys.executable, *worker] if args.ranks == 1 else [*torchrun, str(args.ranks), *worker]
        subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, stderr=subprocess.DEVNULL)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="0.5B,1.5B,7B,14B", help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--gpus", default="1,8,16", help="comma-separated GPU counts (above 1: FSDP2)")
    p.add_argument("--gpu_gb", type=float, default=80.0)
    p.add_argument("--tokens", type=int, default=8192,
                   help="tokens per micro-batch (e.g. 8 sequences of 1024)")
    p.add_argument("--no-checkpointing", dest="checkpointing", action="store_false",
                   help="without --gradient_checkpointing (default: with)")
    p.add_argument("--beta", type=float, default=0.0, help="> 0: a reference model is loaded")
    p.add_argument("--critic", action="store_true", help="PPO: a critic as large as the policy")
    p.add_argument("--lora_rank", type=int, default=0,
                   help="LoRA adapters of this rank on a frozen base (0 = full)")
    p.add_argument("--vllm_share", type=float, default=0.3, help="--vllm_gpu_memory_utilization")
    p.add_argument("--measure", action="store_true", help="compare the model with a measured CPU run")
    p.add_argument("--measure-worker", dest="worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ranks", type=int, default=1, help="--measure: torchrun processes (FSDP2 above 1)")
    p.add_argument("--group", type=int, default=4, help="--measure: completions of the prompt")
    p.add_argument("--prompt", type=int, default=256, help="--measure: prompt tokens")
    p.add_argument("--lengths", default="1024,4096,8192", help="--measure: completion lengths to run")
    p.add_argument("--length", type=int, default=1024, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        measure_worker(args.group, args.prompt, args.length, args.checkpointing)
    elif args.measure:
        measure(args)
    else:
        print(f"Per-GPU memory (GB) of a GRPO update in bf16, {args.tokens} tokens per micro-batch, gradient "
              f"checkpointing {'on' if args.checkpointing else 'off'}, vLLM share {args.vllm_share} of "
              f"{args.gpu_gb:.0f} GB or its bf16 "
              f"weights + 4 GB of KV cache if more"
              f"{', reference model' if args.beta > 0 else ''}{', PPO critic' if args.critic else ''}"
              f"{f', LoRA rank {args.lora_rank}' if args.lora_rank else ''}:\n")
        print(table(args))


if __name__ == "__main__":
    main()
