"""Per-GPU memory of a training step, from the plan the trainer itself makes (rlmini/memplan.py::plan), and
the plan checked against torch's memory trackers on real configurations built from their config dicts.

    python benchmarks/memory.py                          # docs/multi-gpu.md: Qwen2.5 0.5B-32B, Llama 8B/70B
    python benchmarks/memory.py --models llama-3.1-8b-instruct --gpus 8 --beta 0.04 --critic
    python benchmarks/memory.py --models qwen2.5-32b-instruct --gpus 8,16 --vllm_tp 4,8   # vLLM TP
    python benchmarks/memory.py --track                  # the plan against MemTracker / FSDPMemTracker

--track builds each model the way the trainer does (models.prepare_for_training, packed FlexAttention,
LoRA, a reference, PPO's critic; FSDP2 over 8 simulated ranks on a fake process group) under torch's
FakeTensorMode: real shapes and dtypes, no storage. It runs what one update holds at once: the persistent
state with AdamW's moments materialised, two packed micro-batches of 8192 tokens (512-token prompt, 8
completions of 960) forward and backward with gradients accumulating, and the optimizer step. torch's
MemTracker (FSDPMemTracker under FSDP2) counts every tensor the step creates. Not counted by either side:
the CUDA context, NCCL, cuBLAS's workspaces and the allocator's fragmentation (the plan's CONTEXT, NCCL_COMM,
WORKSPACE and margin). track_rollout counts what the HF engine's generate allocates, for real on a model cut
to a few layers.
"""
import argparse
import copy
import json
import os
import sys
import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from rlmini import memplan  # noqa: E402

CONFIGS = os.path.join(ROOT, "tests", "fixtures", "configs")
GiB = memplan.GiB
DOCS = ("qwen2.5-0.5b-instruct", "qwen2.5-1.5b-instruct", "qwen2.5-7b-instruct", "qwen2.5-14b-instruct",
        "qwen2.5-32b-instruct", "llama-3.1-8b-instruct", "llama-3.1-70b-instruct")


def config(name: str):
    return memplan.load_config(os.path.join(CONFIGS, f"{name}.json"))


def table(args) -> str:
    """One row per model, GPU count and --vllm_tp (one that divides the GPUs): the plan's parts and phases on
    an `args.gpu_gb` GPU."""
    rows = ["| model | params | GPUs | vLLM TP | weights+grads+AdamW | working | activations | reference "
            "| vLLM (share) | update | rollout | push | fits |", "|---" * 13 + "|"]
    for name in args.models.split(","):
        c = memplan.count(config(name), args.lora_rank)
        for g, tp in [(int(g), int(tp)) for g in args.gpus.split(",") for tp in args.vllm_tp.split(",")
                      if int(g) % int(tp) == 0]:
            # the engine of tp ranks decodes their rollout batches together (memplan.engine_batch)
            vllm = dict(max_num_seqs=args.max_num_seqs * tp, max_len=args.max_len, dtype_bytes=2, tp=tp)
            p = memplan.plan(c, ranks=g, tokens=args.tokens, checkpointing=args.checkpointing,
                             reference=args.beta > 0, critic=args.critic, lora_rank=args.lora_rank, vllm=vllm,
                             gpu_bytes=args.gpu_gb * GiB, share=args.vllm_share,
                             communicators=memplan.nccl_communicators(g, True, tp))
            f = lambda x: f"{x / GiB:.1f}"  # noqa: E731
            rows.append(f"| {name} | {c['total'] / 1e9:.2f}B | {g} | {tp} | "
                        f"{f(p['weights'] + p['grads'] + p['adam'])} "
                        f"| {f(p['working'])} | {f(p['activations'])} | {f(p['reference'])} | "
                        f"{f(p['vllm'])} ({p['share']:.2f}) | {f(p['update'])} | {f(p['rollout'])} | "
                        f"{f(p['push'])} | {'yes' if p['why'] is None else 'no: ' + _binding(p)} |")
    return "\n".join(rows)


def _binding(p: dict) -> str:
    """What does not fit, in a word or two."""
    usable = p["gpu"] - p["margin"]
    over = [k for k in ("update", "rollout", "push") if p[k] > usable]
    if "vllm_min" in p and p["vllm"] < p["vllm_min"]:
        over.append("vLLM's weights")
    return ", ".join(over)


# ------------------------------------------------------------------------------------ torch's trackers

def _tracker_class(fsdp: bool):
    """torch's MemTracker (FSDPMemTracker), with FlexAttention's higher-order operators passed through to the
    fake mode, a module called again at the top level (the chunked LM head) allowed, and only the global peak
    kept per operation (its per-module peaks cost O(modules) per op)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker

    class Tracker(FSDPMemTracker if fsdp else MemTracker):
        supports_higher_order_operators = True
        where = ""  # the pass and module of the peak

        def _pre_fw_hook(self, module, inputs):
            try:
                super()._pre_fw_hook(module, inputs)
            except NotImplementedError:  # "multiple iterative calls": the head, once per logit chunk
                pass

        def _post_fw_hook(self, module, inputs, outputs):
            if module in self.memory_tracking:  # not the head called again (above): its stats are unused
                super()._post_fw_hook(module, inputs, outputs)

        def _pre_bw_hook(self, module, args):
            if module in self.memory_tracking:
                super()._pre_bw_hook(module, args)

        def _post_bw_hook(self, module, args):
            if module in self.memory_tracking:
                super()._post_bw_hook(module, args)

        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            # a frozen parameter (a LoRA base) takes no gradient hook; its gradients count as temporaries
            frozen = any(not p.requires_grad for p in module.parameters())
            return super()._track_module_params_and_buffers(module, install_grad_hooks and not frozen)

        def _update_peak_stats(self, peak_state):
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]:
                    self._peak_mem[dev], self._peak_mem_snap[dev] = snap[_TOTAL_KEY], copy.deepcopy(snap)
                    # where the peak is: the pass and the innermost module running
                    self.where = (("backward" if self._mod_tracker.is_bw else "forward")
                                  + " " + max(self._mod_tracker.parents, key=len, default=""))

        def total(self, kind: str = "current") -> int:
            return sum(s[_TOTAL_KEY] for s in self.get_tracker_snapshot(kind).values())
    return Tracker


def _fake_batch(mode, groups=((512, 8, 960),), windows=(None,)):
    """make_batch's packed FlexAttention layout of one micro-batch, built for real and then turned into fake
    tensors (block masks included: their construction reads values). `groups`: per distinct prompt, (its
    tokens, its completions, their tokens)."""
    from rlmini import packing
    g = torch.Generator().manual_seed(0)
    prompts, comps = [], []
    for k, (prompt, n, length) in enumerate(groups):
        prompts += [[5 + k] * prompt] * n
        comps += [torch.randint(3, 1000, (length,), generator=g).tolist() for _ in range(n)]
    batch = packing.make_batch(prompts, comps, 0, "cpu", kernel="flex")
    layout = batch["packed"]["rows"]
    masks = {w: layout.block_mask(w) for w in windows}
    fake = lambda x: mode.from_tensor(x) if isinstance(x, torch.Tensor) else x  # noqa: E731
    for bm in masks.values():
        for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
                     "q_indices", "full_q_num_blocks", "full_q_indices"):
            if getattr(bm, name) is not None:
                setattr(bm, name, fake(getattr(bm, name)))
    layout.masks.update(masks)
    out = {k: fake(v) for k, v in batch.items() if k not in ("packed", "target_index")}
    out["target_index"] = tuple(fake(t) for t in batch["target_index"])
    out["packed"] = {**batch["packed"], **{k: fake(batch["packed"][k]) for k in ("input_ids", "position_ids",
                                                                                   "pred")}}
    return out


class _FlexOnFakeTensors:
    """FlexAttention's eager path on fake CPU tensors: skip its CPU-backward refusal and its compile wrapper,
    so the operator's own fake rule gives the kernel's outputs (out, logsumexp: memory linear in tokens, as
    the compiled CUDA kernel's) without computing anything."""

    def __enter__(self):
        import torch.nn.attention.flex_attention as fa
        self.fa, self.saved = fa, (fa._validate_device, fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG)
        fa._validate_device, fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = (lambda *a: None), True

    def __exit__(self, *exc):
        self.fa._validate_device, self.fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = self.saved


def _local_tensors(objects: list) -> list:
    """The local shards of modules' parameters and optimizers' states (DTensors under FSDP2)."""
    out = []
    for obj in objects:
        tensors = (list(obj.parameters()) if isinstance(obj, torch.nn.Module)
                   else [v for st in obj.state.values() for v in st.values() if torch.is_tensor(v)])
        out += [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    return out


def _fake_process_group(ranks: int) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if ranks > 1:
        torch.distributed.init_process_group("fake", store=FakeStore(), rank=0, world_size=ranks)


def track(name: str, ranks: int = 1, lora_rank: int = 0, reference: bool = False, critic: bool = False,
          checkpointing: bool = True, dtype=torch.bfloat16, micro_batches: int = 1, groups=((512, 8, 960),),
          entropy_graph: bool = False) -> dict:
    """Bytes the trackers count on one rank: `persistent` (at the step's start) and `update` (the peak of the
    micro-batches' forward/backward and the optimizer step), for the trainer's build of model `name`, on
    micro-batches laid out as `groups` (_fake_batch). `entropy_graph`: the entropy keeps its graph though no
    gradient reaches it, as the trainer did before rlmini/logprobs.py::_chunk_logprobs computed it without
    one (the code of the GPU runs in benchmarks/gpu_runs.json)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    from rlmini import dist, logprobs, packing
    from rlmini.models import add_lora, prepare_for_training, trainable_parameters
    cfg = config(name)
    _fake_process_group(ranks)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    args = argparse.Namespace(lora_rank=lora_rank, lora_alpha=0.0, lora_targets="all-linear",
                              lora_dropout=0.0)
    window = getattr(cfg, "sliding_window", None)
    batch = _fake_batch(mode, groups, windows=(None, window) if window else (None,))
    packing.use_kernel("flex")
    base = dtype if lora_rank else torch.float32  # models.load_model: fp32 masters, a LoRA base in the dtype

    def build(cls, labels=None, **kw):  # on the meta device (peft's adapters too); fake storage comes later
        c = cfg
        if labels:
            c = copy.deepcopy(cfg)
            c.num_labels = labels
        with torch.device("meta"):
            model = cls.from_config(c, attn_implementation="sdpa", **kw)
        return model

    def materialize(model):  # to_empty unties shared tensors: tie them again, as from_pretrained leaves them
        model = model.to_empty(device="cpu")
        model.tie_weights()
        return model

    try:  # built, prepared and sharded on the meta device (as the trainer orders it), then given fake storage
        policy = build(AutoModelForCausalLM, dtype=base)
        policy = prepare_for_training(policy, checkpointing, packing=True)
        policy = dist.shard_model(add_lora(policy, args) if lora_rank else policy, dtype)
        ref = value = value_opt = None
        if reference and not lora_rank:  # models.load_reference
            ref = build(AutoModelForCausalLM, dtype=dtype)
            packing.exact_attention(ref)
            packing.enable_packing(ref)
            ref = dist.shard_model(ref.eval().requires_grad_(False), dtype)
        if critic:  # train_ppo.py::load_critic
            value = prepare_for_training(build(AutoModelForTokenClassification, labels=1, dtype=base),
                                         checkpointing, packing=True)
            head = [(n, m) for n, m in value.named_modules() if isinstance(m, torch.nn.Linear)
                    and m.out_features == 1][-1]
            value = add_lora(value, args, [head[1]], [head[0]]) if lora_rank else value
            value = dist.shard_model(value, dtype)
        with mode, _FlexOnFakeTensors():
            policy, ref, value = (materialize(m) if m is not None else None for m in (policy, ref, value))
            opt = torch.optim.AdamW(trainable_parameters(policy), lr=1e-6, fused=True)
            memplan.materialize_adamw(opt)
            if value is not None:
                value_opt = torch.optim.AdamW(trainable_parameters(value), lr=1e-6, fused=True)
                memplan.materialize_adamw(value_opt)
            extra = [x for x in (ref, value, value_opt) if x is not None]
            if ranks > 1:  # FSDPMemTracker follows the policy's units; the others' shards are counted as such
                from torch.distributed._tools.fsdp2_mem_tracker import _FSDPRefType
                tracker = _tracker_class(True)(policy, opt)
                for t in _local_tensors(extra):  # its track_external drops the "Other" kind: name the kind
                    tracker._update_and_maybe_create_winfos(t, _FSDPRefType.SHARDED_PARAM)
            else:
                tracker = _tracker_class(False)()
                tracker.track_external(policy, opt, *extra)
            with tracker:
                persistent = tracker.total()
                with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
                    if ref is not None:  # common.pre_update: the reference's log-probs
                        logprobs.token_logprobs(ref, batch, 1.0)
                        dist.reshard_frozen(ref)  # as rlmini/batches.py::batch_logprobs does
                for model in (policy, value):  # gradients already accumulated, as from the 2nd micro-batch on
                    for param in trainable_parameters(model) if model is not None else []:
                        param.grad = torch.zeros_like(param)
                for _ in range(micro_batches):
                    tracker.reset_mod_stats()  # per-module stats only: each micro-batch calls the root again
                    with torch.autocast("cpu", dtype=dtype):  # the loop keeps the last entropy until the next
                        logp, entropy = logprobs.token_logprobs(policy, batch, 1.0, with_entropy=True,
                                                                entropy_grad=entropy_graph)
                    (-(logp * batch["mask"]).sum() / batch["mask"].sum()).backward()
                    if value is not None:  # train_ppo.py: the critic's forward and loss after the policy's
                        with torch.autocast("cpu", dtype=dtype):
                            out, pick = packing.model_forward(value, batch)
                            v = pick(out.logits)[:, 0].float()
                        (v ** 2).mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if value_opt is not None:
                    value_opt.step()
                    value_opt.zero_grad(set_to_none=True)
                return {"persistent": persistent, "update": tracker.total("peak"), "where": tracker.where,
                        "snapshot": tracker.get_tracker_snapshot("peak")}
    finally:
        packing.use_kernel("auto")
        _fake_process_group(1)


class _LiveBytes(TorchDispatchMode):
    """Bytes of the storages made under it that are still alive, and their peak, on real tensors: what a run
    allocates beyond what existed before (a view or an in-place result shares an input's storage: not new)."""

    def __init__(self):
        super().__init__()
        self.now = self.peak = 0
        self.live = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        known = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if torch.is_tensor(t)}
        for t in tree_leaves(out):
            if torch.is_tensor(t) and t.device.type != "meta":
                st = t.untyped_storage()
                if st._cdata not in known and st._cdata not in self.live and st.nbytes():
                    self.live[st._cdata] = st.nbytes()
                    self.now += st.nbytes()
                    weakref.finalize(st, self._free, st._cdata)
        self.peak = max(self.peak, self.now)
        return out

    def _free(self, key):
        self.now -= self.live.pop(key, 0)


def track_rollout(name: str, layers: int = 2, prompts: int = 2, n: int = 4, prompt: int = 37,
                  new_tokens: int = 24, lora_rank: int = 0, dtype=torch.bfloat16) -> int:
    """The peak bytes the HF engine's generate allocates (rlmini/engine.py::HFEngine.generate), run for real
    on the CPU on model `name` cut to `layers` decoder layers, built as the trainer builds the policy (fp32
    masters under autocast, or a LoRA base in the dtype): `prompts` prompts of `prompt` tokens, n completions
    each, every one `new_tokens` long (no stop token)."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from rlmini.engine import HFEngine
    from rlmini.models import add_lora, prepare_for_training
    cfg = _cut(config(name), layers)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype if lora_rank else torch.float32,
                                             attn_implementation="sdpa")
    model = prepare_for_training(model, True, packing=True)
    if lora_rank:
        model = add_lora(model, argparse.Namespace(lora_rank=lora_rank, lora_alpha=0.0,
                                                   lora_targets="all-linear", lora_dropout=0.0))
    engine = HFEngine(model, SimpleNamespace(eos_token_id=None, pad_token_id=0), torch.device("cpu"), dtype)
    engine.eos_ids = frozenset()  # every completion runs to new_tokens: the plan's case
    from rlmini import packing
    # the attention CUDA runs (transformers' repeat_kv under a mask), not the CPU's grouped kernel
    grouped, packing._grouped_on_cpu = packing._grouped_on_cpu, lambda *a: False
    try:
        with _LiveBytes() as live:
            engine.generate([[5 + k] * prompt for k in range(prompts)], n, new_tokens, 1.0, seed=0)
    finally:
        packing._grouped_on_cpu = grouped
    return live.peak


def _cut(cfg, layers: int):
    """The config with its first `layers` decoder layers."""
    cfg = copy.deepcopy(cfg)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    text.num_hidden_layers = layers
    if getattr(text, "layer_types", None):
        text.layer_types = text.layer_types[:layers]
    return cfg


def planned(name: str, ranks: int = 1, lora_rank: int = 0, reference: bool = False, critic: bool = False,
            checkpointing: bool = True, compute_bytes: int = 2, tokens: int = 8192) -> dict:
    """The plan's figures for what track() runs: the trainer's part (no CUDA context, no vLLM)."""
    c = memplan.count(config(name), lora_rank)
    p = memplan.plan(c, ranks=ranks, compute_bytes=compute_bytes, tokens=tokens, checkpointing=checkpointing,
                     reference=reference, critic=critic, lora_rank=lora_rank, context=0.0, workspace=0.0)
    return {"persistent": p["persistent"], "update": p["update"]}


CASES = [  # (model, ranks, LoRA rank, reference, critic, checkpointing)
    ("qwen2.5-1.5b-instruct", 1, 0, False, False, True),
    ("qwen2.5-1.5b-instruct", 1, 0, False, False, False),
    ("qwen2.5-7b-instruct", 1, 16, True, False, True),
    ("llama-3.1-8b-instruct", 8, 0, True, False, True),
    ("gemma-2-2b-it", 1, 0, False, False, False),
    ("gemma-2-2b-it", 1, 0, False, False, True),
    ("qwen2.5-1.5b-instruct", 8, 0, False, True, True),
    ("qwen3-30b-a3b", 8, 0, False, False, False),  # a mixture of experts: 48 layers' activations
]


def compare(cases=CASES) -> list:
    rows = []
    for case in cases:
        t = time.time()
        kw = dict(zip(("ranks", "lora_rank", "reference", "critic", "checkpointing"), case[1:]))
        got, plan = track(case[0], **kw), planned(case[0], **kw)
        rows.append((case, got, plan, time.time() - t))
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(DOCS), help=f"comma-separated, of {CONFIGS}/*.json")
    p.add_argument("--gpus", default="1,8,16", help="comma-separated GPU counts (above 1: FSDP2)")
    p.add_argument("--gpu_gb", type=float, default=79.2, help="GiB per GPU (an 80 GB H100 shows 79.2)")
    p.add_argument("--tokens", type=int, default=16384, help="--micro_batch_tokens (a hub model's default)")
    p.add_argument("--no-checkpointing", dest="checkpointing", action="store_false")
    p.add_argument("--beta", type=float, default=0.0, help="> 0: a reference model")
    p.add_argument("--critic", action="store_true", help="PPO's critic")
    p.add_argument("--lora_rank", type=int, default=0)
    p.add_argument("--vllm_share", type=float, default=0.0, help="--vllm_gpu_memory_utilization (0: plan's)")
    p.add_argument("--max_num_seqs", type=int, default=64, help="a rank's rollout batch (prompts x G/ranks)")
    p.add_argument("--vllm_tp", default="1", help="comma-separated --vllm_tp values (ranks per engine)")
    p.add_argument("--max_len", type=int, default=2048, help="vLLM's max_model_len (prompt + completion)")
    p.add_argument("--track", action="store_true", help="the plan against torch's memory trackers")
    p.add_argument("--json", action="store_true", help="--track: one JSON line per case (for the tests)")
    args = p.parse_args()
    if args.track and args.json:
        for case, got, plan, secs in compare():
            print(json.dumps({"case": list(case), "persistent": [got["persistent"], plan["persistent"]],
                              "update": [got["update"], plan["update"]]}), flush=True)
        return
    if args.track:
        print("| model | ranks | LoRA | reference | critic | checkpointing | tracker: persistent / update GiB"
              " | plan | plan / tracker (update) | s |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for case, got, plan, secs in compare():
            print(f"| {case[0]} | {case[1]} | {case[2] or '-'} | {case[3]} | {case[4]} | {case[5]} | "
                  f"{got['persistent'] / GiB:.2f} / {got['update'] / GiB:.2f} | "
                  f"{plan['persistent'] / GiB:.2f} / {plan['update'] / GiB:.2f} | "
                  f"{plan['update'] / got['update']:.3f} | {secs:.0f} |", flush=True)
        return
    print(f"Per-GPU memory (GiB) of a GRPO step in bf16 on {args.gpu_gb:.1f} GiB GPUs, {args.tokens} tokens "
          f"per micro-batch, checkpointing {'on' if args.checkpointing else 'off'}, vLLM sized by the plan "
          f"({args.max_num_seqs} sequences of {args.max_len} tokens)"
          f"{', reference' if args.beta > 0 else ''}{', PPO critic' if args.critic else ''}"
          f"{f', LoRA rank {args.lora_rank}' if args.lora_rank else ''}:\n")
    print(table(args))


if __name__ == "__main__":
    main()
