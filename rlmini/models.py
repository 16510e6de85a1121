"""The policy and its relatives: the built-in tiny model, loading a hub or local model, LoRA (peft), the
frozen KL reference, and the compute dtype (autocast)."""
import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile

import torch

from rlmini import dist
from rlmini.logprobs import check_output_head
from rlmini.packing import enable_packing, exact_attention, use_kernel

CACHE_DIR = os.environ.get("RLMINI_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "rlmini"))
TINY_CONFIG = dict(hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                   tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=10000.0, initializer_range=0.02)
SPECIAL = ["<pad>", "</s>", "<unk>"]  # ids 0, 1, 2


def build_tiny_model(alphabet: list, seed: int = 0, cache_dir: str = CACHE_DIR) -> str:
    """A random-initialised Qwen3 (head_dim 64, which vLLM's CPU kernels accept) with a character-level
    tokenizer over `alphabet` (multi-character entries stay single tokens), saved once to a cache folder so
    vLLM and transformers both load it from disk."""
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
                                     unk_token="<unk>",
                                     model_max_length=TINY_CONFIG["max_position_embeddings"])
    config = Qwen3Config(vocab_size=len(vocab), bos_token_id=None, eos_token_id=1, pad_token_id=0,
                         **TINY_CONFIG)
    # the caller's RNG stream is the same whether the cache was warm or not
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=os.path.dirname(path), prefix=f".{key}-")
    model.save_pretrained(tmp)
    hf_tok.save_pretrained(tmp)
    # transformers writes models on global rank 0 only
    if not os.path.exists(os.path.join(tmp, "config.json")):
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"rank {dist.rank()}: transformers wrote no model into {tmp}; build the tiny "
                           f"model (models.model_path) before torch.distributed is initialised")
    try:
        os.rename(tmp, path)  # atomic: a concurrent builder either wins or finds it done
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def prompt_style(model: str) -> str:
    """'tiny' for the built-in model and checkpoints trained from it (final/ carries a marker), else 'chat'.
    """
    marker = os.path.join(model, "rlmini.json")
    if model == "tiny" or (os.path.exists(marker) and json.load(open(marker)).get("prompt_style") == "tiny"):
        return "tiny"
    return "chat"


def model_path(model: str, task) -> str:
    """The folder the policy is read from: --model, or the built-in tiny model for the task's alphabet, built
    on first use (call it before torch.distributed starts: under torchrun transformers saves a model on rank 0
    only, so the other ranks could not build it)."""
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
        raise SystemExit(f"--model {model}: no such folder (a hub id is owner/name, e.g. "
                         f"Qwen/Qwen2.5-0.5B-Instruct)")
    files = os.listdir(model)
    missing = [what for what, ok in (
        ("config.json", "config.json" in files),
        ("weights (*.safetensors or pytorch_model*.bin)",
         any(f.endswith((".safetensors", ".bin")) for f in files)),
        ("a tokenizer (tokenizer.json or tokenizer_config.json)",
         any(f in files for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))),
    ) if not ok]
    if missing:
        raise SystemExit(f"--model {model}: the folder has no {', no '.join(missing)}: not a Hugging Face "
                         f"model folder (runs/<run>/final is one)")


def load_tokenizer(path: str):
    """The model's tokenizer, with a pad token (its EOS where it has none)."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(args, task, device, dtype, tokenizer=None):
    """(policy, tokenizer, path on disk). The policy keeps fp32 master weights; compute runs in `dtype`
    through autocast. With --lora_rank the base is frozen in `dtype` (bf16 on CUDA) and only the adapters
    train, in fp32 (peft). The model is left in training mode with its dropout off."""
    from transformers import AutoModelForCausalLM
    path = model_path(args.model, task)
    use_kernel(args.packed_attention)
    tokenizer = tokenizer or load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype if args.lora_rank else torch.float32)
    model = model.to(device)
    check_output_head(model, args.model)
    model = prepare_for_training(model, args.gradient_checkpointing, args.packing)
    if args.lora_rank:
        model = add_lora(model, args)
    return model, tokenizer, path


def prepare_for_training(model, gradient_checkpointing: bool, packing: bool = True):
    """Dropout off (the policy gradient and the push check need pi_theta to be the policy that sampled; a
    critic regresses), then training mode: transformers checkpoints a layer only in training mode, so
    --gradient_checkpointing in eval mode silently keeps every activation. Non-reentrant checkpointing, the
    kind PyTorch recommends (it also runs under no_grad, as the pre-update passes do). --packing: attention
    through packing.packed_attention (packing.enable_packing), over attention that computes what the model
    defines (packing.exact_attention)."""
    exact_attention(model)
    if packing:
        enable_packing(model)
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        # attention kernels' float dropout rates
        for attr in ("attention_dropout", "dropout", "attn_dropout"):
            if isinstance(getattr(m, attr, None), float):
                setattr(m, attr, 0.0)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    return model.train()


def add_lora(model, args, extra_trainable=(), exclude=()):
    """peft LoRA adapters (Hu et al. 2021) on --lora_targets: W x + (alpha / r) B A x with A random, B = 0
    (the policy starts as the base); every base weight frozen; `extra_trainable` modules (PPO's value head)
    train. A named target must be a linear layer of the attention or MLP (torch Linear, GPT-2's Conv1D):
    the push merges those only, and vLLM's LoRA has no adapters on embeddings."""
    from peft import LoraConfig, get_peft_model
    from transformers.pytorch_utils import Conv1D
    targets, outer = args.lora_targets, {model.get_input_embeddings(), model.get_output_embeddings()}
    if targets != "all-linear":  # peft's own choice excludes the output layer
        targets = [t.strip() for t in targets.split(",") if t.strip()]
        linear = sorted({n.rpartition(".")[2] for n, m in model.named_modules()
                         if isinstance(m, (torch.nn.Linear, Conv1D)) and m not in outer})
        for t in targets:  # peft's match, peft/tuners/tuners_utils.py::check_target_module_exists
            found = [(n, m) for n, m in model.named_modules() if (n == t or n.endswith(f".{t}"))
                     and not any(n == e or n.endswith(f".{e}") for e in exclude)]
            if not found:
                raise SystemExit(f"--lora_targets {args.lora_targets}: no module named {t} in the model "
                                 f"(its linear layers: {','.join(linear)})")
            name, bad = next(((n, m) for n, m in found if not isinstance(m, (torch.nn.Linear, Conv1D))
                              or m in outer), (None, None))
            if bad is not None:
                what = ("the output layer" if bad is model.get_output_embeddings() else "the embedding"
                        if bad in outer else f"a {type(bad).__name__}")
                raise SystemExit(f"--lora_targets {args.lora_targets}: {t} ({name}) is {what}, not a linear "
                                 f"layer of the attention or MLP ({','.join(linear)})")
    config = LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha or 2 * args.lora_rank,
                        target_modules=targets, lora_dropout=args.lora_dropout, bias="none",
                        exclude_modules=list(exclude) or None)
    try:  # adapters in fp32 when the base is bf16 (autocast_adapter_dtype)
        model = get_peft_model(model, config)
    except ValueError as e:  # anything else peft refuses, in one line
        raise SystemExit(f"--lora_targets {args.lora_targets}: {str(e).splitlines()[0]}") from None
    for m in extra_trainable:
        m.requires_grad_(True)
    return model.train()


def is_lora(model) -> bool:
    return hasattr(model, "peft_config")


def trainable_parameters(model) -> list:
    """What the optimizer updates: every parameter, or with LoRA the adapters (and any head set trainable)."""
    return [p for p in model.parameters() if p.requires_grad]


def load_reference(args, task, device, dtype, policy=None):
    """The frozen reference policy of a KL term: the base model in the compute dtype (no fp32 master copy, no
    gradients, no optimizer state), sharded like the policy under torchrun. A LoRA policy's reference is its
    own base with the adapters off: no second copy."""
    from transformers import AutoModelForCausalLM
    if policy is not None and is_lora(policy):
        return AdaptersOff(policy)
    model = AutoModelForCausalLM.from_pretrained(model_path(args.model, task), dtype=dtype).to(device)
    exact_attention(model)
    if args.packing:
        enable_packing(model)
    return dist.shard_model(model.eval().requires_grad_(False), dtype)


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
    """Compute in `dtype` (bf16 on CUDA) over fp32 master weights; nothing to do in fp32."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)
