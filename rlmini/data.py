"""Seeds, the prompt stream, prompt token ids, and a rollout batch's groups and scores."""
import hashlib
import json
import random
import sys
import typing
import weakref
from dataclasses import dataclass

import numpy as np
import torch

import rewards
from rlmini import datafiles, reward_fns, reward_model
from rlmini.options import arg


@dataclass
class TaskArgs:
    """rg: tasks' options (reasoning-gym, rlmini/rg.py::rg_task), in common.Args."""
    task_config: str = arg("", "rg: tasks: YAML/JSON file of each generator's config, {name: {key: value}}")
    rg_size: int = arg(1000, "rg: tasks: training examples (a tenth more are held out)", ge=1)
    rg_allow_slow: bool = arg(False, "rg: tasks: allow generators over 2 s per 1,000 items (docs/tasks.md)")
    rg_curriculum: float = arg(0.0, "rg: tasks: a level up when eval/pass@1 reaches it (0: off)", ge=0, le=1)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rollout_seed(seed: int, step: int, rank: int, sampling_round: int = 0) -> int:
    """The sampling seed of one generate call: distinct for every (--seed, step, rank, sampling round), the
    same in every script; evaluation uses step -1 (the same draws at every evaluation)."""
    return _seed(f"rollout/{seed}/{step}/{rank}/{sampling_round}")


def extra_seed(seed: int, step: int, rank: int, call: int) -> int:
    """The seed of a script's own common.generate call (one without a seed): the k-th such call of a step
    has call = k (0, 1, ...), under a key of its own, so it never draws a training round's or evaluation's
    samples, and adding a call after it leaves its draws as they were."""
    return _seed(f"extra/{seed}/{step}/{rank}/{call}")


def _seed(key: str) -> int:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "little") & 0x7FFF_FFFF  # vLLM's range


def rng_state() -> dict:
    """Every RNG's state in types torch.load(weights_only=True) reads: NumPy's key array as a tensor."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(), "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos,
                                                     has_gauss, gauss], "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.int64).astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def load_task(args, style: str):
    """The task of --task with its options: --system_prompt, --reward functions (and --env's get_reward),
    --decontaminate."""
    if args.rg_curriculum and not (args.task.startswith("rg:") and args.eval_every):
        raise SystemExit(f"--rg_curriculum {args.rg_curriculum}: needs an rg: task and --eval_every (the "
                         f"level rises after an evaluation)")
    task = rewards.load_task(args.task, style=style, seed=args.seed, brier=args.brier,
                             jsonl_reward=args.jsonl_reward, prompt_column=args.prompt_column,
                             answer_column=args.answer_column, task_config=args.task_config,
                             rg_size=args.rg_size, rg_allow_slow=args.rg_allow_slow,
                             rg_curriculum=args.rg_curriculum)
    if args.system_prompt and style != "chat":
        raise SystemExit("--system_prompt: the built-in tiny model has no chat template; use a chat model "
                         "(--model)")
    task = datafiles.with_system_prompt(task, args.system_prompt)
    task = reward_fns.with_reward_functions(task, args.reward, args.reward_weights, args.env,
                                            reward_model.sources(args), args.reward_concurrency,
                                            args.reward_timeout)
    if args.decontaminate:
        task.train, dropped = datafiles.decontaminate(task.train, task.test, args.decontaminate)
        if not task.train:
            raise SystemExit(f"--decontaminate {args.decontaminate}: every training prompt overlaps the "
                             f"held-out split")
        print(f"decontaminate: dropped {dropped} training prompts sharing a {args.decontaminate}-gram with "
              f"the test split")
    return task


def fit_prompts(task, tokenizer, chat: bool, max_new: int, context: int, flag: str) -> int:
    """Drop (and count) the prompts of each split that leave no room for a completion of `max_new` tokens in
    the model's context; returns the longest prompt kept, in tokens."""
    max_prompt = 0
    for split in ("train", "test"):
        examples = getattr(task, split)
        lengths = [len(p) for p in encode_prompts(tokenizer, [e["prompt"] for e in examples], chat)]
        fits = [n + max_new <= context for n in lengths]
        if not any(fits):
            raise SystemExit(f"--task {flag}: every {split} prompt is longer than the model's context "
                             f"({context} tokens) less --max_new_tokens {max_new}")
        if not all(fits):
            first = fits.index(False)
            print(f"--task {flag}: dropped {fits.count(False)} of {len(fits)} {split} prompts longer than "
                  f"the model's context ({context} tokens) less --max_new_tokens {max_new}; the first, "
                  f"#{first + 1} ({lengths[first]} tokens): {examples[first]['prompt'][:60]!r}",
                  file=sys.stderr)
            setattr(task, split, [e for e, ok in zip(examples, fits) if ok])
        max_prompt = max(max_prompt, max(n for n, ok in zip(lengths, fits) if ok))
    return max_prompt


def check_vocabulary(task, tokenizer, style: str, model: str, flag: str) -> None:
    """The tiny model's character-level tokenizer covers the alphabet of the task it was built for
    (rewards.py::Task.alphabet; models.build_tiny_model): a prompt with a character outside it would be
    trained on as <unk>, so the first such prompt stops the start-up in one line naming it and the character.
    Real tokenizers are not checked: theirs is a rare fallback, not a task the model cannot read."""
    unk = tokenizer.unk_token_id
    if style != "tiny" or unk is None:
        return
    for split in ("train", "test"):
        prompts = [e["prompt"] for e in getattr(task, split)]
        k = next((k for k, ids in enumerate(encode_prompts(tokenizer, prompts, False)) if unk in ids), None)
        if k is None:
            continue
        enc = tokenizer(prompts[k], add_special_tokens=False, return_offsets_mapping=True)
        start, end = enc["offset_mapping"][enc["input_ids"].index(unk)]
        raise SystemExit(f"--model {model} on --task {flag}: {split} prompt #{k + 1} {prompts[k][:60]!r} has "
                         f"{prompts[k][start:end]!r}, which the tiny model's tokenizer (the alphabet of the "
                         f"task it was built for) reads as <unk>: use a real tokenizer, e.g. --model smollm2")


def prompt_batch(examples: list, pos: int, n: int, seed: int) -> tuple[list, int]:
    """n examples from position `pos` of an endless, epoch-wise shuffled stream; returns the new position. The
    order depends only on (seed, epoch), so a resumed run sees the same prompts."""
    out, orders, size = [], {}, len(examples)
    while len(out) < n:
        epoch, i = divmod(pos, size)
        if epoch not in orders:
            orders[epoch] = list(range(size))
            random.Random(seed * 7919 + epoch).shuffle(orders[epoch])
        out.append(examples[orders[epoch][i]])
        pos += 1
    return out, pos


def encode_prompts(tokenizer, prompts: list, chat: bool, toolbox=None) -> list:
    """Token ids of each prompt; a pretrained model with a chat template gets it applied (a text prompt as the
    user's message, a conversation as it is), the prompt ending with the assistant's turn opening; with
    --tool_format chat, the template also renders the tools' definitions. A conversation ending with an
    assistant message is a reply begun: its text is given, the completion continues it (transformers'
    continue_final_message, the turn left open; --task calibration_plain)."""
    schemas = toolbox.schemas if toolbox is not None and toolbox.fmt == "chat" else None
    template = chat and getattr(tokenizer, "chat_template", None)
    if not template and any(isinstance(p, list) for p in prompts):
        raise rewards.DataError("conversational prompts (lists of messages) need a model with a chat "
                                "template; this one has none (the built-in tiny model never does)")
    cache = _PROMPT_IDS.setdefault(tokenizer, {})  # the same prompts come back every epoch: tokenised once
    tools_key, out = json.dumps(schemas), []
    for p in prompts:
        key = (bool(template), p if isinstance(p, str) else json.dumps(p, sort_keys=True), tools_key)
        if key not in cache:
            messages = [{"role": "user", "content": p}] if isinstance(p, str) else p
            begun = messages[-1].get("role") == "assistant"
            cache[key] = (tokenizer.apply_chat_template(messages, add_generation_prompt=not begun,
                                                        continue_final_message=begun, tokenize=True,
                                                        return_dict=False, tools=schemas)
                          if template else tokenizer(p, add_special_tokens=False)["input_ids"])
        out.append(list(cache[key]))
    return out


_PROMPT_IDS = weakref.WeakKeyDictionary()  # tokenizer -> {(chat template?, prompt): token ids}


@dataclass
class Rollouts:
    """What an engine returns: n completions per prompt, grouped by prompt."""
    prompt_ids: list        # per completion (prompts repeated group_size times, grouped)
    completion_ids: list    # sampled tokens, EOS included when sampled
    sampler_logprobs: list  # the sampler's log-prob of each sampled token (temperature applied)
    finished: list          # True where the completion ended with EOS ("stop"), False at "length"
    pad_id: int = 0         # padding id for the trainer's batches
    policy_mask: list | None = None  # with tools: per token 1 sampled by the policy, 0 written by a tool
    tool_stats: list | None = None   # with tools: per completion {turns, calls, errors, ...} (tools.STATS)
    versions: list | None = None     # --engine server: per completion the weight push it was sampled from
    env_rewards: list | None = None  # --env with get_reward: per completion its value (None: discarded)
    prefix_lengths: list | None = None  # common.generate(prefixes=): per completion, its given tokens
    routes: list | None = None  # a mixture of experts: per completion [P + L - 1, layers, k] (rlmini/moe.py)

    def lists(self) -> tuple:
        """The per-completion fields present (what groups are cut from and joined into)."""
        return tuple(f for f in _PER_COMPLETION if getattr(self, f) is not None)


_PER_COMPLETION = ("prompt_ids", "completion_ids", "sampler_logprobs", "finished", "policy_mask",
                   "tool_stats", "versions", "env_rewards", "prefix_lengths", "routes")


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
        part = Rollouts([], [], [], [], rollouts.pad_id)
        for f in rollouts.lists():
            setattr(part, f, getattr(rollouts, f)[k])
        out.append(Group(ex, part, rewards[k], correct[k], fmt[k]))
    return out


def join_groups(groups: list) -> tuple:
    """The inverse: (examples, rollouts, rewards, correct, fmt) of a list of Groups, in order."""
    rollouts = Rollouts([], [], [], [], groups[0].rollouts.pad_id)
    for f in groups[0].rollouts.lists():
        setattr(rollouts, f, [x for g in groups for x in getattr(g.rollouts, f)])
    return ([g.example for g in groups], rollouts,
            *[torch.cat([getattr(g, f) for g in groups]) for f in ("rewards", "correct", "fmt")])


def score_rollouts(task, tokenizer, examples: list, rollouts: Rollouts, group_size: int):
    """(reward, correct, format score, Score objects), one per completion (examples are repeated group_size
    times). The task's reward only: any bonus is the training loop's business."""
    scores, masks, texts = [], rollouts.policy_mask, []
    for k, toks in enumerate(rollouts.completion_ids):
        texts.append(tokenizer.decode(toks, skip_special_tokens=True) if masks is None
                     else policy_text(tokenizer, toks, masks[k]))  # a tool cannot write the answer
    if task.score_batch is not None:  # batched/async functions, a reward model, a judge: once for the batch
        envs = rollouts.env_rewards or [None] * len(texts)
        scores = task.score_batch(texts, [examples[k // group_size] for k in range(len(texts))],
                                  list(rollouts.finished), envs)
    for k, text in enumerate(texts if task.score_batch is None else ()):
        env = {"env": rollouts.env_rewards[k]} if rollouts.env_rewards is not None else {}  # --env's reward
        scores.append(task.score(text, examples[k // group_size], rollouts.finished[k], **env))
    reward = torch.tensor([s.reward for s in scores], dtype=torch.float32)
    correct = torch.tensor([s.correct for s in scores], dtype=torch.float32)
    fmt = torch.tensor([s.format_ok for s in scores], dtype=torch.float32)
    return reward, correct, fmt, scores


def reward_parts(scores: list, names: list) -> torch.Tensor:
    """[completions, functions]: each --reward function's unweighted value (logged as reward/<name>)."""
    return torch.tensor([list(s.parts) for s in scores], dtype=torch.float32).view(len(scores), len(names))


def turns_text(tokenizer, ids: list, mask: list) -> list:
    """[{"role": "policy" | "tool", "text"}] of a trajectory, its runs of policy and tool tokens in order
    (--log_completions)."""
    out, start = [], 0
    for k in range(1, len(ids) + 1):
        if k == len(ids) or mask[k] != mask[start]:
            out.append({"role": "policy" if mask[start] else "tool",
                        "text": tokenizer.decode(ids[start:k], skip_special_tokens=True)})
            start = k
    return out


def policy_text(tokenizer, ids: list, mask: list) -> str:
    """What a verifier reads: the policy's own turns joined by line breaks (tool output left out, so that a
    tool cannot write the answer)."""
    return "\n".join(t["text"] for t in turns_text(tokenizer, ids, mask) if t["role"] == "policy")
