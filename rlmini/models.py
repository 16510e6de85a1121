"""The policy and its relatives: the built-in tiny model, loading a hub or local model, LoRA (peft), the
frozen KL reference, and the compute dtype (autocast)."""
import contextlib
import hashlib
import json
import logging
import math
import os
import re
import shutil
import tempfile

import torch

from rlmini import dist, durable, smollm2
from rlmini.stfile import safetensors_header
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
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(path), prefix=f".{key}-")
    except OSError as e:  # a read-only cache without this model
        raise SystemExit(f"--model tiny: the cache {cache_dir} holds no tiny model for this task's alphabet "
                         f"and cannot take one ({e.strerror}): set RLMINI_CACHE to a writable "
                         f"folder") from None
    model.save_pretrained(tmp)
    hf_tok.save_pretrained(tmp)
    # transformers writes models on global rank 0 only
    if not os.path.exists(os.path.join(tmp, "config.json")):
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"rank {dist.rank()}: transformers wrote no model into {tmp}; build the tiny "
                           f"model (models.model_path) before torch.distributed is initialised")
    durable.fsync_tree(tmp)  # whole on disk before it is named: a power cut leaves no empty weights file
    try:
        os.rename(tmp, path)  # atomic: a concurrent builder either wins or finds it done
        durable.fsync_dir(os.path.dirname(path))
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # our own build: the winner's folder stands
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
    only, so the other ranks could not build it), or the built-in SmolLM2 (builtin_path)."""
    if model == "tiny":
        return build_tiny_model(task.alphabet)
    return builtin_path(model)


def builtin_path(model: str) -> str:
    """`model` as a folder: 'smollm2' is the built-in SmolLM2-135M-Instruct (builtin), a local folder is
    checked, a hub id passes to transformers."""
    if model == smollm2.NAME:
        return builtin(model)
    check_model_folder(model)
    return model


def builtin(path: str) -> str:
    """'smollm2' as its folder (rlmini/smollm2.py: built once under the cache, one builder at a time); any
    other path or hub id as given."""
    return smollm2.folder(CACHE_DIR) if path == smollm2.NAME else path


def check_model_folder(model: str, flag: str = "--model", config_only: bool = False) -> None:
    """`flag` names a local folder (it exists, or it looks like a path): say what is missing there, rather
    than transformers' guesses (a bad hub id, a tokenizer backend problem, an OSError). A hub id passes.
    `config_only` (a memory plan): a config.json file, or a folder with one, is enough."""
    looks_local = os.path.exists(model) or model.startswith((".", "/", "~")) or model.count("/") > 1
    if not looks_local or (config_only and os.path.isfile(model) and model.endswith(".json")):
        return
    if os.path.isfile(model):  # e.g. the config.json inside the folder
        raise SystemExit(f"{flag} {model}: a file, not a model folder (give the folder: "
                         f"{os.path.dirname(model) or '.'})")
    if not os.path.isdir(model):
        raise SystemExit(f"{flag} {model}: no such folder (a hub id is owner/name, e.g. "
                         f"Qwen/Qwen2.5-0.5B-Instruct)")
    files = os.listdir(model)
    tokenizer = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    missing = [what for what, ok in (
        ("config.json", "config.json" in files),
        ("weights (*.safetensors or pytorch_model*.bin)",
         config_only or any(f.endswith((".safetensors", ".bin")) for f in files)),
        ("tokenizer files (tokenizer.json or tokenizer_config.json)",
         config_only or any(f in files for f in tokenizer)),
    ) if not ok]
    if missing:
        raise SystemExit(f"{flag} {model}: the folder has no {', no '.join(missing)}: not a Hugging Face "
                         f"model folder (the save_pretrained of a model and of its tokenizer write one)")
    for name in [] if config_only else sorted(f for f in files if f.endswith(".safetensors")):
        header = safetensors_header(os.path.join(model, name))  # a file cut short: one line, not a traceback
        if isinstance(header, str):
            raise SystemExit(f"{flag} {model}: {header}")


def load_tokenizer(path: str):
    """The model's tokenizer, with a pad token (its EOS where it has none)."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(args, task, device, dtype, tokenizer=None):
    """(policy, tokenizer, path on disk), sharded under torchrun (load_pretrained). The policy keeps fp32
    master weights; compute runs in `dtype` through autocast. With --lora_rank the base is frozen in `dtype`
    (bf16 on CUDA) and only the adapters train, in fp32 (peft). The model is left in training mode with its
    dropout off."""
    from transformers import AutoModelForCausalLM
    path = model_path(args.model, task)
    use_kernel(args.packed_attention)
    tokenizer = tokenizer or load_tokenizer(path)

    def prepare(model):
        model = prepare_for_training(model, args.gradient_checkpointing, args.packing)
        return add_lora(model, args) if args.lora_rank else model
    model, _ = load_pretrained(AutoModelForCausalLM, path, device, dtype if args.lora_rank else torch.float32,
                               dtype, prepare, check_head=args.model)
    return model, tokenizer, path


def load_pretrained(cls, path, device, dtype, compute_dtype, prepare, new=None, check_head=None, **config):
    """(model, names of its new parameters): a transformers Auto class `cls` from `path` in `dtype`, prepared
    by `prepare` (dropout, packing, LoRA: on meta parameters under torchrun), sharded (dist.shard_model,
    compute in `compute_dtype`) on `device`. `new(model)` names the modules the checkpoint may lack (a value
    head): transformers initialises them; any other parameter it lacks stops the load. `check_head`: the
    --model whose output layer logprobs.check_output_head checks.

    Under torchrun with safetensors weights no rank holds the whole model (load_streamed); in one process,
    or from .bin weights, transformers' from_pretrained on the CPU, then moved whole to `device`."""
    path = builtin(path)  # a critic or a frozen model may be the built-in one
    if dist.many_ranks() and dist.from_rank0(weight_index(path) is not None if dist.rank() == 0 else None):
        return load_streamed(cls, path, device, dtype, compute_dtype, prepare, new, check_head, **config)
    if dist.many_ranks() and dist.rank() == 0:
        print(f"{path}: no *.safetensors weights: every rank loads the whole model before sharding")
    # transformers' load report (transformers/utils/loading_report.py::log_state_dict_report, logged by
    # modeling_utils): a table that reads like a failure; what it says, new heads, callers say in one line
    logger = logging.getLogger("transformers.modeling_utils")
    logger.addFilter(_no_load_report)
    try:
        model, info = cls.from_pretrained(path, dtype=dtype, output_loading_info=True, **config)
    finally:
        logger.removeFilter(_no_load_report)
    allowed = _parameters_of(model, new(model) if new else [])
    missing = [k for k in info["missing_keys"] if k not in allowed]
    if missing:
        raise SystemExit(f"{path}: the checkpoint has no {', '.join(missing[:3])} for {type(model).__name__}")
    model = model.to(device)
    if check_head:
        check_output_head(model, check_head)
    model = dist.shard_model(prepare(model), compute_dtype)
    return model, sorted(k for k in info["missing_keys"] if k in allowed)


def _no_load_report(record) -> bool:
    return "LOAD REPORT" not in str(record.msg)


def weight_index(path: str) -> dict | None:
    """{checkpoint key: its safetensors file} of a model folder or hub id (one file, or several listed in
    model.safetensors.index.json); None where there are none (.bin weights)."""
    from safetensors import safe_open
    folder = path
    if not os.path.isdir(path):  # a hub id: its cached snapshot (transformers downloads all of it)
        from huggingface_hub import snapshot_download
        folder = snapshot_download(path, allow_patterns=["*.json", "*.safetensors"])
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        return {k: os.path.join(folder, f) for k, f in json.load(open(index))["weight_map"].items()}
    out = {}
    for name in sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")):
        with safe_open(os.path.join(folder, name), "pt") as f:
            out.update(dict.fromkeys(f.keys(), os.path.join(folder, name)))
    return out or None


class _AdaptersStayOnCPU(torch.overrides.TorchFunctionMode):
    """peft moves new adapters to their base layer's device (peft/tuners/tuners_utils.py::
    _move_adapter_to_device_of_base_layer): on a meta base they stay on the CPU with their values (the RNG
    draws of a real base's) and its dtype cast, for load_streamed to place."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.Tensor.to and isinstance(out, torch.Tensor) and out.is_meta and not args[0].is_meta:
            return args[0].to(dtype=out.dtype)
        return out


def load_streamed(cls, path, device, dtype, compute_dtype, prepare, new=None, check_head=None, **config):
    """load_pretrained under torchrun: every rank builds the model from its config with its parameters on the
    meta device (no memory; the `new` modules on the CPU, initialised by transformers' _init_weights as
    from_pretrained does: the same RNG draws), prepares and shards it (dist.shard_model), and gives its shards
    memory on `device` (FSDP2's to_empty: torch/distributed/fsdp/_fully_shard/_fully_shard.py::
    FSDPModule._apply). Non-persistent buffers (rotary inv_freq) are recomputed by _init_weights, as
    from_pretrained does (transformers/modeling_utils.py::_move_missing_keys_from_meta_to_device). Then global
    rank 0 reads the safetensors weights one tensor at a time (straight from the file at the header's offset)
    and broadcasts each in the file's dtype, every rank casting its shard out of it (dist.fill_from_rank0). A
    rank holds its shards and one whole tensor in the file's dtype; rank 0 alone reads, one tensor ahead."""
    from transformers import AutoConfig
    with torch.device("meta"):
        model = cls.from_config(AutoConfig.from_pretrained(path, **config), dtype=dtype)
    base, new_modules = model, (new(model) if new else [])
    for name in new_modules:
        module = base.get_submodule(name)
        module.to_empty(device="cpu")
        base._init_weights(module)
    with _AdaptersStayOnCPU():
        model = prepare(model)
    kept = {n: p.detach() for n, p in model.named_parameters() if not p.is_meta}  # new heads, adapters
    model = dist.shard_model(model, compute_dtype)
    model.to_empty(device=device)
    _recompute_buffers(base, path)
    targets = [(n, p) for n, p in model.named_parameters()] + _persistent_buffers(model)
    index, sources, error = (weight_index(path), {}, None) if dist.rank() == 0 else (None, {}, None)
    if dist.rank() == 0:
        sources, error = _checkpoint_sources(targets, kept, index, base, path)
    error = dist.from_rank0(error)
    if error:
        raise SystemExit(error)

    def read(name, out):
        if name in kept:
            out.copy_(kept[name])
        else:
            _read_parts(sources[name], out)
    dtypes = [kept[n].dtype if n in kept else sources[n][0][2] for n, _ in targets] \
        if dist.rank() == 0 else None
    dist.fill_from_rank0(targets, read, dtypes)
    if check_head:  # the root's parameters (the output layer) gathered for the probe, as after a forward
        model.unshard()
        check_output_head(model, check_head)
        model.reshard()
    return model, sorted(n for n in _parameters_of(base, new_modules))


def _checkpoint_sources(targets, kept, index, base, path) -> tuple[dict, str | None]:
    """({target name: [(file, byte offset, dtype, shape, strides, offset)]}, None), or ({}, a one-line error):
    the checkpoint tensors each target is read from: its own, under its name or with or without the base
    model's prefix (a base model's checkpoint for a head model, or the reverse, as from_pretrained allows;
    peft's wrapping names removed; strides None: the whole target), or, where transformers keeps the family
    in a layout of its own (a mixture of experts' fused experts, renamed modules), the checkpoint tensors its
    own mapping gives (_checkpoint_parts), each into its strided place in the target."""
    sources, headers, prefix, layouts = {}, {}, base.base_model_prefix, {}
    for name, target in targets:
        if name in kept:
            continue
        plain = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        parts = _checkpoint_parts(base, plain, tuple(target.shape), layouts)
        if isinstance(parts, str):
            return {}, f"{path}: {parts}"
        sources[name] = []
        for wanted, shape, strides, at in parts:
            key = next((k for k in (wanted, wanted.removeprefix(prefix + "."), f"{prefix}.{wanted}")
                        if k in index), None)
            if key is None:
                return {}, f"{path}: the checkpoint has no tensor for {wanted} (nor {prefix}.{wanted})"
            file = index[key]
            if file not in headers:
                headers[file] = safetensors_header(file)
            if isinstance(headers[file], str):
                return {}, headers[file]
            dtype, disk_shape, offset = headers[file][key]
            if isinstance(dtype, str):
                return {}, (f"{path}: {key} is {dtype} in the checkpoint, a dtype the sharded load does not "
                            f"read")
            if disk_shape != list(shape):
                return {}, (f"{path}: {key} has shape {disk_shape} in the checkpoint, the model's "
                            f"{wanted} {list(shape)}")
            if sources[name] and dtype != sources[name][0][2]:
                return {}, f"{path}: {key} is {dtype} in the checkpoint, the other parts of {plain} are not"
            sources[name].append((file, offset, dtype, shape, strides, at))
    return sources, None


def _checkpoint_parts(model, name: str, shape: tuple, layouts: dict) -> list | str:
    """[(checkpoint key, shape, strides, offset)]: where each checkpoint tensor of in-memory parameter `name`
    lies in it, derived from transformers' own mapping between the two layouts, run backwards as
    save_pretrained runs it (transformers/core_model_loading.py::revert_weight_conversion) on the target's
    element indices: each part must be a strided view of the target (fused experts are: E experts' gate and
    up rows), the parts covering every element once. [(name, shape, None, 0)] where the layouts agree; a
    one-line reason where the mapping cannot be read this way. `layouts`: the places found so far, by the
    names with their numbers masked (every layer's experts lie alike: the indices are made once)."""
    from transformers.core_model_loading import revert_weight_conversion
    keys = list(revert_weight_conversion(model, {name: torch.empty(shape, device="meta")}))
    if keys == [name]:
        return [(name, shape, None, 0)]
    masked = (re.sub(r"\d+", "#", name), shape, tuple(re.sub(r"\d+", "#", k) for k in keys))
    if masked in layouts:
        return [(k, *place) for k, place in zip(keys, layouts[masked])]
    n = math.prod(shape)
    index = torch.arange(n, dtype=torch.int32 if n < 2**31 else torch.int64).view(shape)
    seen, parts = torch.zeros(n, dtype=torch.bool), []
    for key, idx in revert_weight_conversion(model, {name: index}).items():
        at = idx.flatten()[0].item() if idx.numel() else 0
        strides = [(idx[tuple(1 if j == d else 0 for j in range(idx.dim()))].item() - at) if k > 1 else 1
                   for d, k in enumerate(idx.shape)]
        if min(strides, default=0) < 0 or not torch.equal(index.view(-1).as_strided(idx.shape, strides, at),
                                                          idx):
            return f"transformers' mapping makes {key} of {name} in a way the sharded load cannot read"
        covered = seen.as_strided(idx.shape, strides, at)
        if covered.any():
            return f"transformers' mapping reads {name} twice, the sharded load cannot"
        covered.fill_(True)
        parts.append((key, tuple(idx.shape), tuple(strides), at))
    if not seen.all():
        return f"transformers' mapping leaves part of {name} unread: not supported on many ranks"
    if [k for k, *_ in parts] == keys:
        layouts[masked] = [tuple(place) for _, *place in parts]
    return parts


def _read_parts(parts: list, out: torch.Tensor) -> None:
    """A target's checkpoint tensors (_checkpoint_sources) into `out` (contiguous, the file's dtype): one
    straight into it, or each part (a fused tensor's experts) into its strided place."""
    flat = out.view(-1)
    for file, offset, _, shape, strides, at in parts:
        if strides is None:
            _read_into(file, offset, out)
        else:
            part = torch.empty(shape, dtype=out.dtype)
            _read_into(file, offset, part)
            flat.as_strided(shape, strides, flat.storage_offset() + at).copy_(part)


def _read_into(file: str, offset: int, out: torch.Tensor) -> None:
    """out's bytes from the file at `offset`, read straight into out's memory (on CUDA rank 0's pinned
    buffer): no second copy of the tensor, which safe_open's get_tensor is (its own storage)."""
    view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
    with open(file, "rb", buffering=0) as f:
        f.seek(offset)
        done = 0
        while done < len(view):  # one read returns at most about 2 GiB on Linux
            got = f.readinto(view[done:])
            if not got:
                raise OSError(f"{file}: ends inside a tensor at byte {offset + done}")
            done += got


def _parameters_of(model, module_names) -> list:
    return [f"{m}.{n}" for m in module_names for n, _ in model.get_submodule(m).named_parameters()]


def _persistent_buffers(model) -> list:
    return [(f"{m}.{b}" if m else b, t) for m, module in model.named_modules()
            for b, t in module._buffers.items()
            if t is not None and b not in module._non_persistent_buffers_set]


def _recompute_buffers(model, path) -> None:
    """Non-persistent buffers after to_empty: transformers' _init_weights recomputes them (rotary
    embeddings' inv_freq); one it does not recompute stops the load by name."""
    for name, module in model.named_modules():
        buffers = [b for b, t in module._buffers.items()
                   if t is not None and b in module._non_persistent_buffers_set]
        if not buffers:
            continue
        for b in buffers:
            if module._buffers[b].is_floating_point():
                module._buffers[b].fill_(float("nan"))
        with torch.no_grad():
            model._init_weights(module)
        stale = [b for b in buffers if module._buffers[b].is_floating_point()
                 and module._buffers[b].isnan().any()]
        if stale:
            raise SystemExit(f"{path}: sharded load: transformers does not recompute {name}.{stale[0]}: "
                             f"not supported on many ranks")


def prepare_for_training(model, gradient_checkpointing: bool, packing: bool = True):
    """Dropout off (the policy gradient and the push check need pi_theta to be the policy that sampled; a
    critic regresses), then training mode: transformers checkpoints a layer only in training mode, so
    --gradient_checkpointing in eval mode silently keeps every activation. Non-reentrant checkpointing, the
    kind PyTorch recommends (it also runs under no_grad, as the pre-update passes do). --packing: attention
    through packing.packed_attention (packing.enable_packing), over attention that computes what the model
    defines (packing.exact_attention). A mixture of experts routes each token alike in either layout."""
    exact_attention(model)
    if getattr(model.config, "output_router_logits", False):  # a mixture of experts' load-balancing loss:
        model.config.output_router_logits = False  # not added to the RL loss, so its router logits go unasked
    if packing:
        enable_packing(model)
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        # attention kernels' float dropout rates; Mixtral's (PhiMoE's) training-mode noise on a router's input
        for attr in ("attention_dropout", "dropout", "attn_dropout", "jitter_noise", "input_jitter_noise"):
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
    # a mixture of experts' fused experts (transformers 5: one 3-D tensor per layer) are no linear layer:
    # peft wraps them as parameters, which the push's merge (W + (alpha / r) B A per linear) does not cover
    named = model.named_modules()
    fused = sorted({n.removeprefix("base_model.model.").replace(".base_layer", "") for n, m in named
                    if hasattr(m, "base_layer") and not isinstance(m.base_layer, (torch.nn.Linear, Conv1D))
                    and not hasattr(m.base_layer, "base_layer")})
    if fused:
        raise SystemExit(f"--lora_targets {args.lora_targets}: {fused[0]} is a mixture of experts' fused "
                         f"experts, whose adapters the weight push cannot merge yet: name the attention's "
                         f"layers, e.g. --lora_targets q_proj,k_proj,v_proj,o_proj")
    for m in extra_trainable:
        m.requires_grad_(True)
    return model.train()


def is_lora(model) -> bool:
    return hasattr(model, "peft_config")


def trainable_parameters(model) -> list:
    """What the optimizer updates: every parameter, or with LoRA the adapters (and any head set trainable)."""
    return [p for p in model.parameters() if p.requires_grad]


def load_reference(args, task, device, dtype, policy=None):
    """The frozen reference policy of a KL term: the base model (load_frozen). A LoRA policy's reference is
    its own base with the adapters off: no second copy."""
    if policy is not None and is_lora(policy):
        return AdaptersOff(policy)
    return load_frozen(model_path(args.model, task), device, dtype, packing=args.packing)


FROZEN = {"causal": "AutoModelForCausalLM", "sequence-classification": "AutoModelForSequenceClassification"}


def load_frozen(path, device, dtype, kind: str = "causal", packing: bool = True, tokenizer=None,
                policy: str = "the policy"):
    """A frozen model (the KL reference; a teacher; a reward model: kind "sequence-classification", one
    label): in the compute dtype (no fp32 master copy, no gradients, no optimizer state), in eval mode,
    sharded like the policy under torchrun (load_pretrained: loaded without a whole copy on any rank); a
    causal LM's attention through packing.packed_attention (--packing). `tokenizer`: the policy's (model
    `policy`), which a causal LM at `path` must share (check_frozen)."""
    import transformers
    if kind not in FROZEN:
        raise ValueError(f"load_frozen: kind {kind!r} is not one of {', '.join(FROZEN)}")
    path = builtin(path)
    if tokenizer is not None:
        check_frozen(path, tokenizer, policy)

    def prepare(model):
        exact_attention(model)
        if packing and kind == "causal":
            enable_packing(model)
        return model.eval().requires_grad_(False)
    config = {"num_labels": 1} if kind == "sequence-classification" else {}
    cls = getattr(transformers, FROZEN[kind])
    return load_pretrained(cls, path, device, dtype, dtype, prepare, **config)[0]


PROBE_TEXT = "Frozen models score the policy's tokens: 12 + 7 = 19.\n<|im_end|> \u00dcn\u00efcode,\ttabs  x"
CAUSAL = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")  # transformers' causal LM class names


def check_frozen(path: str, tokenizer, policy: str) -> None:
    """`path` is a causal LM folder whose tokenizer is the policy's (`tokenizer`, of model `policy`): the same
    vocabulary, the same ids of a probe text and the same special ids; else one line naming both models."""
    from transformers import AutoConfig
    hub_id = not os.path.exists(path) and not path.startswith((".", "/", "~")) and path.count("/") == 1
    for what in () if hub_id else (path, os.path.join(path, "config.json")):  # hub ids: transformers
        if not os.path.exists(what):
            raise SystemExit(f"frozen model {path}: no such file or folder: {what} (the policy is {policy})")
    arch = getattr(AutoConfig.from_pretrained(path), "architectures", None) or []
    if not any(a.endswith(CAUSAL) for a in arch):
        raise SystemExit(f"frozen model {path}: a {', '.join(arch) or 'model of no architecture'}, not a "
                         f"causal LM: it gives no token log-probs (the policy is {policy})")
    other = load_tokenizer(path)
    specials = ("bos_token_id", "eos_token_id", "pad_token_id")
    why = ("another vocabulary" if other.get_vocab() != tokenizer.get_vocab() else
           "another encoding of a probe text" if other.encode(PROBE_TEXT) != tokenizer.encode(PROBE_TEXT) else
           next((f"another {s} ({getattr(other, s)}, not {getattr(tokenizer, s)})" for s in specials
                 if getattr(other, s) != getattr(tokenizer, s)), None))
    if why:
        raise SystemExit(f"frozen model {path}: its tokenizer is not the policy's ({policy}): {why}")


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
