"""A rollout's plumbing behind common.rollout and common.generate: sampling through the engine (with
--tools, multi-turn), continuing partial completions, scoring and shaping the rewards, and --async_steps'
requests ahead of the update."""
import numbers
import sys
import time

import numpy as np
import torch

from rlmini import data, dist, faults, tools
from rlmini.batches import Batch, Keep, Scored
from rlmini.dist import rank


def overlong_penalty(rollouts, limit: int, buffer: int, penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), scaled by `penalty`, one value per
    completion: 0 up to limit - buffer tokens, then falling linearly to -penalty at the limit (longer is
    impossible here: generation stops at the limit). For the reward only, never for correctness."""
    length = torch.tensor([len(c) for c in rollouts.completion_ids], dtype=torch.float32)
    if buffer == 0:
        return torch.zeros_like(length)
    return penalty * ((limit - buffer - length) / buffer).clamp(-1.0, 0.0)


def sample(run, examples: list, n: int, temperature: float, seed: int, prefixes=None) -> data.Rollouts:
    """generate's sampling: the engine's (with --tools, multi-turn) completions, not yet scored; what
    --async_steps runs in the background (the server engine makes no collective). `prefixes`: continue one
    partial completion per example instead (continue_prefixes)."""
    if prefixes is not None:
        return _continue(run, examples, prefixes, n, temperature, seed)
    mine = examples or run.task.train[:1]  # FSDP2: a rank with nothing still joins every forward
    pool = run.toolbox.env if run.toolbox is not None else None
    instances, prompts, per = None, [e["prompt"] for e in mine], n
    if pool is not None:  # --env: an instance per rollout, reset with its example (rlmini/envs.py)
        instances, prompts, per = pool.begin(mine, n)
    try:
        prompt_ids = data.encode_prompts(run.tokenizer, prompts, run.style == "chat", run.toolbox)
        rollouts = tools.generate(run.engine, run.toolbox, run.tokenizer, prompt_ids, per, run.max_new_tokens,
                                  temperature, seed, instances)
    finally:  # the rollouts are over (or failed): get_reward of each, the instances back in the pool
        env_rewards = pool.end(instances, rewards=sys.exc_info()[0] is None) if pool is not None else None
    rollouts.env_rewards = env_rewards
    for f in rollouts.lists() if not examples else ():  # the stand-in's completions are dropped
        setattr(rollouts, f, [])
    return rollouts


def check_prefixes(prefixes, examples: list, budget: int, vocab: int) -> list:
    """common.generate's `prefixes` as lists of ints, one per example, each a token id of the model and no
    longer than the budget; else one line naming the example."""
    if not isinstance(prefixes, (list, tuple)) or len(prefixes) != len(examples):
        got = len(prefixes) if isinstance(prefixes, (list, tuple)) else type(prefixes).__name__
        raise ValueError(f"common.generate: prefixes: one list of token ids per example ({len(examples)} "
                         f"examples, got {got}); repeat an example for several prefixes")
    out = []
    for k, (prefix, example) in enumerate(zip(prefixes, examples)):
        name = f"common.generate: the prefix of example {k} ({str(example.get('prompt', ''))[:40]!r})"
        if isinstance(prefix, (torch.Tensor, np.ndarray)):  # e.g. a slice of a tensor row
            prefix = prefix.tolist()
        if not isinstance(prefix, (list, tuple)) or not all(
                isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in prefix):
            raise ValueError(f"{name} is not a list of token ids (ints): {str(prefix)[:60]}")
        outside = [t for t in prefix if not 0 <= t < vocab]
        if outside:
            raise ValueError(f"{name} holds token id {outside[0]}, outside the model's vocabulary of {vocab}")
        if len(prefix) > budget:
            raise ValueError(f"{name} is {len(prefix)} tokens, longer than the budget of {budget} "
                             f"(--max_new_tokens, else the task's)")
        out.append([int(t) for t in prefix])
    return out


def continue_prefixes(engine, prompt_ids: list, prefixes: list, n: int, budget: int, temperature: float,
                      seed: int, stand_in: list) -> data.Rollouts:
    """n continuations of each prompt + prefix (a partial completion, token ids), each with what is left of
    the budget, in one engine call. Each completion returned is prefix + continuation; prefix_lengths says
    where the sampled part starts; sampler_logprobs are the continuation's, after prefix_lengths zeros (the
    prefix was not sampled here). A prefix that ends in EOS or fills the budget comes back as it is, nothing
    sampled. A rank with nothing to continue still calls the engine once, on `stand_in` (the HF engine's
    forwards are collectives under torchrun, and so is --vllm_tp's request exchange), and drops it."""
    eos = engine.eos_ids
    live = [i for i, x in enumerate(prefixes) if len(x) < budget and not (x and x[-1] in eos)]
    r = engine.generate([list(prompt_ids[i]) + prefixes[i] for i in live] or [stand_in], n,
                        [budget - len(prefixes[i]) for i in live] or [1], temperature, seed)
    at = {i: k * n for k, i in enumerate(live)}  # the first of prompt i's n rows in the engine's output
    out = data.Rollouts([], [], [], [], engine.pad_id, prefix_lengths=[])
    out.versions = [] if r.versions is not None else None
    out.routes = [] if r.routes is not None else None  # MoE: prompt + prefix + continuation's
    for i, (prompt, prefix) in enumerate(zip(prompt_ids, prefixes)):
        for j in range(n):
            k = at[i] + j if i in at else None
            tokens, logps = (r.completion_ids[k], r.sampler_logprobs[k]) if k is not None else ([], [])
            out.prompt_ids.append(list(prompt))
            out.completion_ids.append(prefix + tokens)
            out.sampler_logprobs.append([0.0] * len(prefix) + logps)
            out.finished.append(r.finished[k] if k is not None else bool(prefix) and prefix[-1] in eos)
            out.prefix_lengths.append(len(prefix))
            if out.versions is not None:
                out.versions.append(r.versions[k if k is not None else 0])
            if out.routes is not None:  # nothing sampled: none (the trainer routes it itself)
                out.routes.append(r.routes[k] if k is not None else None)
    return out


def _continue(run, examples: list, prefixes, n: int, temperature: float, seed: int) -> data.Rollouts:
    if run.toolbox is not None:
        raise ValueError("common.generate: prefixes with --tools or --env: a partial trajectory's tool calls "
                         "and environment state are not replayed; sample whole trajectories instead")
    config = getattr(run.model, "config", None)
    vocab = getattr(config, "vocab_size", None) or len(run.tokenizer)
    try:
        prefixes, refused = check_prefixes(prefixes, examples, run.max_new_tokens, vocab), None
    except ValueError as e:
        refused = e
    if dist.all_sum(float(refused is not None)):  # every rank stops, none waits in the engine's collectives
        raise refused or ValueError("common.generate: another rank's prefixes were refused (its line names "
                                    "the example)")
    chat = run.style == "chat"
    prompt_ids = data.encode_prompts(run.tokenizer, [e["prompt"] for e in examples], chat)
    stand_in = data.encode_prompts(run.tokenizer, [run.task.train[0]["prompt"]], chat)[0]
    return continue_prefixes(run.engine, prompt_ids, prefixes, n, run.max_new_tokens, temperature, seed,
                             stand_in)


def score(run, examples: list, n: int, rollouts: data.Rollouts) -> Scored:
    """generate's scoring: the task's reward, shaped (the format bonus, the overlong penalty), checked."""
    args = run.args
    rewards, correct, fmt, scores = data.score_rollouts(run.task, run.tokenizer, examples, rollouts, n)
    rewards = rewards + args.format_weight * fmt  # the format bonus, in the reward only
    rewards = rewards + overlong_penalty(rollouts, run.max_new_tokens, args.overlong_buffer,
                                         args.overlong_penalty)
    # NaN/inf: stop or skip; a --reward function raising on every completion: stop
    faults.check_rewards(rewards, examples, n, run.step + 1, args.on_nonfinite, scores, run.task.reward_names)
    return Scored(examples, rollouts, rewards, correct, fmt, data.reward_parts(scores, run.task.reward_names),
                  scores)


def ahead(run) -> tuple:
    """--async_steps K: (examples, n, rollouts) of this step's first round, requested up to K steps ago (now,
    at the first step and after --resume: the batch in flight at a checkpoint is regenerated), after which
    the rounds of the next steps, up to K ahead, are requested before this step's update starts."""
    args, G = run.args, run.args.group_size

    def request(step):
        redrawn = bool(run.redraw)  # after --resume, the batches in flight at the checkpoint come first
        pos = run.redraw.pop(0) if redrawn else run.data_pos  # a checkpoint saves each one's position
        examples, end = data.prompt_batch(run.task.train, pos, args.prompts_per_step, args.seed)
        run.data_pos = run.data_pos if redrawn else end
        mine, seed = dist.shard(examples), data.rollout_seed(args.seed, step, rank(), 0)
        run.ahead.append((pos, mine, run.engine.submit(sample, run, mine, G, args.temperature, seed)))

    if not run.ahead:
        request(run.step)
    pos, examples, future = run.ahead.pop(0)
    rollouts = run.engine.wait(future)
    for step in range(run.step + 1 + len(run.ahead), min(run.step + args.async_steps + 1, args.steps)):
        request(step)
    return examples, G, rollouts


def resample(run, keep: Keep | None = None) -> Batch:
    """common.rollout's rounds: this rank's share of --prompts_per_step prompts, G completions each, sampled
    and scored (a first round --async_steps requested earlier); with `keep`, more rounds of new prompts until
    enough groups have a spread in `keep.on` (every rank agrees), the spread-less ones topping the batch up.
    """
    args, G = run.args, run.args.group_size
    run.times = {"start": time.perf_counter()}
    on = keep.on if keep else "correct"
    kept, rounds, generated, first = [], 0, 0, None
    while True:
        if rounds == 0 and args.async_steps:  # sampled while earlier steps updated; the next ones requested
            scored = score(run, *ahead(run))
        else:
            examples, run.data_pos = data.prompt_batch(run.task.train, run.data_pos, args.prompts_per_step,
                                                       args.seed)
            seed = data.rollout_seed(args.seed, run.step, rank(), rounds)
            mine = dist.shard(examples)
            scored = score(run, mine, G, sample(run, mine, G, args.temperature, seed))
        first = first or (scored.rewards, scored.correct, scored.fmt, scored.parts)
        groups = data.split_groups(scored.examples, scored.rollouts, scored.rewards, scored.correct,
                                   scored.fmt, G)
        spread = [getattr(g, on).min() < getattr(g, on).max() for g in groups]
        same = [g for g, s in zip(groups, spread) if not s]  # the last round's: they top the batch up
        kept += [g for g, s in zip(groups, spread) if s] if keep else groups
        rounds, generated = rounds + 1, generated + len(scored)
        if keep is None:
            break
        if keep.min_valid is None:
            enough = dist.all_sum(max(len(scored.examples) - len(kept), 0)) == 0  # no rank misses a group
        else:
            enough = dist.all_sum(len(kept)) >= keep.min_valid  # valid groups, all ranks
        if enough or rounds >= keep.max_rounds:
            break
    examples, rollouts, rewards, correct, fmt = data.join_groups((kept + same)[:len(scored.examples)])
    # DAPO's overlong filtering (Yu et al. 2025, sec. 3.4): completions cut by the length limit leave the loss
    in_loss = torch.tensor(rollouts.finished, dtype=torch.float32)
    in_loss = in_loss if args.mask_truncated else torch.ones(len(rewards))
    return Batch(examples, rollouts, rewards, correct, fmt, first, rounds, generated, on if keep else "",
                 in_loss, getattr(run.engine, "pushes", None))
