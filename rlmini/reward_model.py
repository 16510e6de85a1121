"""Rewards beyond a Python function (docs/rewards.md): a sequence-classification reward model
(--reward_model) and the LLM judge (rlmini/judge.py, --judge_url), bound to --reward's reserved names `rm`
and `judge` (rlmini/reward_fns.py::with_reward_functions); their options (RewardArgs, a mixin of
common.Args), their scorers and their logged sums (the reward model's memory:
rlmini/memplan.py::reward_model_share). A reward model scores the policy's decoded text with its own
tokenizer and chat template, never the policy's ids."""
import contextlib
import math
import sys
from dataclasses import dataclass
from typing import Literal

import torch

from rlmini import dist, faults, models, reward_fns
from rlmini.options import arg
from rlmini.task import begun_reply

PLAIN = "{prompt}\n{completion}"  # what a reward model without a chat template reads


@dataclass
class RewardArgs:
    """The options of rewards beyond a function, shared by the trainers and eval.py."""
    reward_model: str = arg("", "a sequence-classification reward model (folder or hub id): --reward's 'rm'; "
                                "without --reward it is the reward")
    reward_model_tokens: int = arg(0, "--reward_model: tokens per scoring micro-batch, padding included (0 = "
                                      "--micro_batch_tokens, else 16384)", ge=0)
    reward_model_offload: bool = arg(False, "--reward_model: kept in CPU memory between scorings (CUDA)")
    reward_norm: Literal["none", "running", "group"] = arg(
        "none", "--reward_model's score: raw, z-scored by a running mean/std (all ranks, all steps), or per "
                "prompt group")
    reward_concurrency: int = arg(32, "async reward functions: calls in flight per rank", ge=1)
    reward_timeout: float = arg(300.0, "seconds for an async batch's calls, a sync call, the reward model's "
                                       "forwards (past it the run stops; judge: --judge_timeout)", gt=0)


def check(path: str, files: bool = True):
    """The reward model's config, refused in one line unless a sequence classifier with one label; a local
    folder must hold its weights and tokenizer too (models.check_model_folder), unless `files` is False
    (the memory plan: its config alone)."""
    import transformers
    models.check_model_folder(path, "--reward_model", config_only=not files)
    try:
        config = transformers.AutoConfig.from_pretrained(path)
    except Exception as e:  # an unknown hub id (offline), a config.json transformers cannot read
        raise SystemExit(f"--reward_model {path}: cannot read its config ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:120]})") from None
    archs = getattr(config, "architectures", None) or []
    if not any(a.endswith("ForSequenceClassification") for a in archs):
        raise SystemExit(f"--reward_model {path}: a {', '.join(archs) or 'model of no architecture'}, not a "
                         f"sequence classifier (AutoModelForSequenceClassification, one label)")
    if config.num_labels != 1:
        raise SystemExit(f"--reward_model {path}: {config.num_labels} labels; a reward model has one (a "
                         f"scalar score)")
    return config


def scoring_tokens(args) -> int:
    """Tokens per scoring micro-batch, padding included: --reward_model_tokens, else --micro_batch_tokens,
    else 16384 (the scorer's and the memory plan's one rule)."""
    return args.reward_model_tokens or getattr(args, "micro_batch_tokens", 0) or 16384


def render(tokenizer, prompt, completion: str) -> list:
    """The reward model's token ids of (prompt, completion): the conversation with the completion as the
    assistant's turn in its own chat template, or PLAIN where it has none (with its special tokens)."""
    prompt, begun = begun_reply(prompt)  # a reply begun in the prompt: the completion continues it
    completion = begun + completion
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        text = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": completion}],
                                             tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]  # the template has them (TRL's way)
    text = prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)
    return tokenizer(PLAIN.format(prompt=text, completion=completion))["input_ids"]


def micro_batches(lengths: list, tokens: int) -> list:
    """Consecutive index ranges whose padded size (count x longest) stays within `tokens` (at least one
    sequence each)."""
    out, start, longest = [], 0, 0
    for k, n in enumerate(lengths):
        if k > start and max(longest, n) * (k - start + 1) > tokens:
            out.append(range(start, k))
            start, longest = k, 0
        longest = max(longest, n)
    return out + ([range(start, len(lengths))] if start < len(lengths) else [])


def forward_scores(model, ids: list, pad_id: int, device) -> torch.Tensor:
    """The score head's value at each sequence's last token (right-padded), computed in fp32 from the head's
    input, taken by a hook: a real token equal to the pad id is never mistaken for padding, as the pooling of
    transformers/modeling_layers.py::GenericForSequenceClassification.forward would (rightmost non-pad id),
    and a bf16 head's rounding (steps of 0.03 near 5, ties under --reward_norm group) is not in the score.
    no_grad, not inference_mode: FSDP2's world-size-1 unshard preserves version counters, which inference
    tensors lack (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py::FSDPParamGroup.wait_for_unshard).
    No KV cache: the model's config would make one of every layer (use_cache)."""
    width = max(len(x) for x in ids)
    input_ids = torch.tensor([x + [pad_id] * (width - len(x)) for x in ids], device=device)
    mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids], device=device)
    rows, last = torch.arange(len(ids), device=device), torch.tensor([len(x) - 1 for x in ids], device=device)
    seen = []

    def head(module, inputs, output):  # inside the forward: an FSDP2 root's weight is gathered here
        bias = None if module.bias is None else module.bias.float()
        with torch.autocast(inputs[0].device.type, enabled=False):  # fp32 under any caller's autocast too
            hidden = inputs[0][rows, last].float()
            seen.append(torch.nn.functional.linear(hidden, module.weight.float(), bias))
    hook = model.score.register_forward_hook(head)
    try:
        with torch.no_grad():
            model(input_ids=input_ids, attention_mask=mask, use_cache=False)
    finally:
        hook.remove()
    return seen[0][:, 0].cpu()


def normalise(raw: torch.Tensor, groups: list, how: str, state: dict, update: bool = True) -> torch.Tensor:
    """--reward_norm: `group`, each prompt group's z-score (std 0: 0); `running`, the z-score by the mean and
    std of every score so far, all ranks (Chan et al.'s merge of (count, mean, M2), this batch included);
    `state` holds them (saved in checkpoints); `update` False: used as they are (evaluation). A NaN or inf
    score stays what it is (--on_nonfinite decides) and never enters a mean or a std: one would poison the
    group's scores, or the running state (and every later reward, and the checkpoint) for good."""
    finite = torch.isfinite(raw)
    if how == "group":
        out = raw.clone()
        for g in groups:
            x, ok = raw[g], finite[g]
            if ok.any():
                out[g] = torch.where(ok, (x - x[ok].mean()) / (x[ok].std(unbiased=False) + 1e-6), x)
        return out
    if how == "running" and update:
        kept = raw[finite].double()
        s = dist.all_sum({"n": float(len(kept)), "sum": kept.sum().item(), "sq": (kept ** 2).sum().item()})
        if s["n"]:
            n, mean = s["n"], s["sum"] / s["n"]
            m2 = max(s["sq"] - n * mean * mean, 0.0)
            c, mu, M2 = state.get("n", 0.0), state.get("mean", 0.0), state.get("m2", 0.0)
            delta, total = mean - mu, c + n
            state.update(n=total, mean=mu + delta * n / total, m2=M2 + m2 + delta * delta * c * n / total)
    if how == "running":
        std = math.sqrt(state["m2"] / state["n"]) if state.get("n") else 1.0
        return (raw - state.get("mean", 0.0)) / (std + 1e-6)
    return raw


def make_reward_model(args):
    """--reward_model's batched scorer f(prompts=, completions=, examples=, finished=) -> [float] (its
    config checked now; the model loaded by load(), in common.setup), with step_metrics() and the running
    normalisation's `state`."""
    path, how = args.reward_model, args.reward_norm
    check(path)
    held = {"sums": {"reward/rm_raw_sum": 0.0, "reward/rm_raw_count": 0.0}, "state": {}, "update": True}

    def load(device, dtype):
        from transformers import AutoTokenizer
        model = models.load_frozen(path, device, dtype, kind="sequence-classification")
        if not isinstance(getattr(model, "score", None), torch.nn.Linear):
            raise SystemExit(f"--reward_model {path}: no linear `score` head (a {type(model).__name__}); the "
                             f"Llama/Qwen-style sequence classifiers have one")
        tok = AutoTokenizer.from_pretrained(path)
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        context = getattr(model.config, "max_position_embeddings", None) or 4096
        budget = scoring_tokens(args)
        offload = args.reward_model_offload and device.type == "cuda"
        held.update(model=model.to("cpu") if offload else model, tok=tok, pad=pad or 0, device=device,
                    context=context, budget=budget, offload=offload)

    def score(prompts: list, completions: list, examples: list, finished: list) -> list:
        if "model" not in held:
            raise RuntimeError("--reward_model: scored before it was loaded (reward_model.load)")
        model, device = held["model"], held["device"]
        ids = [render(held["tok"], p, c) for p, c in zip(prompts, completions)]
        ids = [x[-held["context"]:] for x in ids]  # the longest keep their end: what the head reads
        batches = micro_batches([len(x) for x in ids], held["budget"])
        n = len(batches)
        if dist.many_ranks():  # FSDP2: every rank joins every forward; fewer batches run a one-token dummy
            n = int(dist.all_gather(torch.tensor([n])).max())
        if held["offload"]:
            model.to(device)
        first = f" (first prompt {str(prompts[0])[:60]!r})" if prompts else ""
        try:  # timed once the ranks have met (the all_gather): waiting for a slower rank is no hang
            with faults.deadline(args.reward_timeout, f"--reward_model on a batch of {len(ids)}{first}"):
                raw = [forward_scores(model, [ids[k] for k in batches[b]] if b < len(batches)
                                      else [[held["pad"]]], held["pad"], device) for b in range(n)]
            dist.reshard_frozen(model)  # FSDP2 keeps a root gathered after its forward: not into the update
        finally:
            if held["offload"]:
                model.to("cpu")
                torch.cuda.empty_cache()
        raw = torch.cat(raw[:len(batches)]) if batches else torch.zeros(0)
        held["sums"]["reward/rm_raw_sum"] += raw.double().sum().item()
        held["sums"]["reward/rm_raw_count"] += len(raw)
        groups, start = [], 0  # a prompt's completions are consecutive (data.score_rollouts)
        for k in range(1, len(examples) + 1):
            if k == len(examples) or examples[k] is not examples[start]:
                groups.append(slice(start, k))
                start = k
        return normalise(raw, groups, how, held["state"], held["update"]).tolist()  # NaN: --on_nonfinite

    def step_metrics() -> dict:
        out, held["sums"] = held["sums"], dict.fromkeys(held["sums"], 0.0)
        return out

    score.load, score.step_metrics, score.state, score.held = load, step_metrics, held["state"], held
    return score


def sources(args) -> dict:
    """{"rm": --reward_model's scorer, "judge": --judge_url's} (None where not given), for
    reward_fns.with_reward_functions; the judge is bound to the policy's tokenizer by load()."""
    out = {"rm": make_reward_model(args) if getattr(args, "reward_model", "") else None, "judge": None}
    if getattr(args, "judge_url", ""):
        held = {}

        def judge(prompts: list, completions: list, examples: list, finished: list) -> list:
            fn = held["fn"]
            out = fn(prompts=prompts, completions=completions, examples=examples, finished=finished)
            if hasattr(out, "__await__"):
                out = reward_fns.run_async([out], 1, args.reward_timeout, "--judge_url")[0]
                if isinstance(out, Exception):
                    raise out
            return out

        judge.held = held
        judge.step_metrics = lambda: getattr(held.get("fn"), "step_metrics", dict)()
        out["judge"] = judge
    return out


def load(task, args, tokenizer, device, dtype) -> None:
    """common.setup, before the engine (vLLM sizes itself with the reward model held): load the reward model,
    make the judge (rlmini/judge.py::make_judge)."""
    if "rm" in task.sources:
        task.sources["rm"].load(device, dtype)
    if "judge" in task.sources:
        from rlmini import judge
        columns = (task.train or task.test)[0].keys()  # a template field no example has is named at start-up
        task.sources["judge"].held["fn"] = judge.make_judge(args, tokenizer, columns=columns)


def source_metrics(task) -> dict:
    """The step's logged sums of the reward model and the judge, over all ranks (one all-reduce): X_sum and
    X_count become X_mean (reward/rm_raw_mean: the reward model's score before --reward_norm). A
    step_metrics() returns the same keys on every rank at every call (they are summed in one all-reduce)."""
    sums = {}
    for fn in task.sources.values():
        sums.update(getattr(fn, "step_metrics", dict)())
    if not sums:
        return {}
    sums = dist.all_sum(sums)
    out = {k: v for k, v in sums.items() if not k.endswith(("_sum", "_count"))}
    for k in sums:
        if k.endswith("_sum") and k[:-4] + "_count" in sums:
            n = sums[k[:-4] + "_count"]
            if n:  # a mean over nothing is absent, not NaN
                out[k[:-4] + "_mean"] = sums[k] / n
    return out


@contextlib.contextmanager
def evaluating(task):
    """Held-out scoring in a training run (eval.py::evaluate): the running normalisation is used, not
    updated, and the logged sums stay the training steps'."""
    held = getattr(task.sources.get("rm"), "held", None)
    if held is None:
        yield
        return
    sums, held["update"] = dict(held["sums"]), False
    try:
        yield
    finally:
        held["sums"], held["update"] = sums, True


def norm_state(task) -> dict:
    """--reward_norm running: its (count, mean, M2), for the checkpoint."""
    rm = task.sources.get("rm")
    return dict(rm.state) if rm is not None else {}


def restore_norm_state(task, state: dict) -> None:
    if task.sources.get("rm") is not None and state:
        task.sources["rm"].state.update(state)
        print(f"--reward_norm: resumed at mean {state['mean']:.4g} over {state['n']:.0f} scores",
              file=sys.stderr)
