"""A rollout's plumbing behind common.rollout and common.generate: sampling through the engine (with
--tools, multi-turn), scoring and shaping the rewards, and --async_steps' requests ahead of the update."""
import sys
import time

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


def sample(run, examples: list, n: int, temperature: float, seed: int) -> data.Rollouts:
    """generate's sampling: the engine's (with --tools, multi-turn) completions, not yet scored; what
    --async_steps runs in the background (the server engine makes no collective)."""
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
