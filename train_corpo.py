"""CoRPO (Garg & Venkatesh 2025) in one file: GRPO's loop with a correctness-clamped baseline,
max(R_min_correct, group mean), so that a failed completion never gets a positive advantage, for
ordinal (partial-credit) rewards. The static variant uses R_min_correct alone.

    python train_corpo.py --task ordinal                      # built-in tiny model, partial credit (CPU ok)
    python train_corpo.py --task ordinal --baseline static    # Garg & Venkatesh 2025, sec. 3.2
    python train_corpo.py --model Qwen/Qwen2.5-0.5B-Instruct --task jsonl:ratings.jsonl --r_min_correct 0.5
"""
import time
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

import common
from common import arg
from eval import evaluate


@dataclass
class Args(common.Args):
    baseline: Literal["adaptive", "static"] = arg("adaptive", "max(R_min_correct, group mean), or R_min_correct")
    r_min_correct: float | None = arg(None, "minimum reward of a correct completion (default: the task's threshold)")
    loss_agg: Literal["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"] = arg(
        "seq-mean-token-mean", "loss aggregation: GRPO | DAPO | Dr. GRPO")
    clip_eps: float = arg(0.2, "PPO clip range below 1 (and above, unless clip_eps_high is set)")
    clip_eps_high: float = arg(0.0, "clip range above 1; DAPO clip-higher uses 0.28 (0 = clip_eps)")
    ratio_level: Literal["token", "sequence"] = arg("token", "importance ratio per token, or GSPO's per sequence")
    beta: float = arg(0.0, "k3 KL penalty to the initial policy (0 = no reference model is loaded)")
    dynamic_sampling: bool = arg(False, "DAPO: drop groups whose completions all got the same outcome, sample more")
    max_sampling_rounds: int = arg(20, "dynamic sampling: most sampling rounds per step (then the batch is topped up)")
    min_group_size: ClassVar[int] = 2  # the adaptive baseline's group mean needs two completions


# ---------------------------------------------------------------------------------------------- advantages


def compute_advantages(rewards, group_size, r_min_correct, baseline="adaptive"):
    """CoRPO: A_i = r_i - max(R_min_correct, mean(r)) (Garg & Venkatesh 2025, sec. 3.3); the static
    variant A_i = r_i - R_min_correct (sec. 3.2). No std normalisation (the paper skips it)."""
    r = rewards.double().view(-1, group_size)  # float64: an all-equal group's mean is exact, so its A is exactly 0
    b = torch.full_like(r[:, :1], r_min_correct)
    if baseline == "adaptive":
        b = torch.maximum(b, r.mean(dim=1, keepdim=True))
    return (r - b).flatten().to(rewards.dtype)


# ---------------------------------------------------------------------------------------------- loss


def rollout_correction(old_logp, sampler_logp, mask, args):
    """Rollout correction (Yao et al. 2025): per-token weights w = pi_old / pi_sampler, detached, that
    undo the sampler/trainer mismatch (bf16 vLLM kernels sample from a slightly different policy).
    token-tis truncates w at is_cap; token-mis zeroes tokens whose w is outside [is_low, is_high];
    seq-mis zeroes whole completions whose geometric-mean w is outside. Returns (weights or None, stats)."""
    log_w = ((old_logp - sampler_logp) * mask).detach()
    w = torch.exp(log_w)
    if args.rollout_correction == "token-tis":  # truncated IS: min(w, C)
        weight, dropped = w.clamp(max=args.is_cap), w > args.is_cap
    elif args.rollout_correction == "token-mis":  # masked IS: w inside [lo, hi], else 0
        dropped = (w < args.is_low) | (w > args.is_high)
        weight = w * ~dropped
    elif args.rollout_correction == "seq-mis":  # a completion whose geometric-mean w is outside [lo, hi] is dropped
        geo_w = torch.exp(log_w.sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1))
        dropped = ((geo_w < args.is_low) | (geo_w > args.is_high)).expand_as(w)
        weight = w * ~dropped
    else:
        weight, dropped = None, torch.zeros_like(w, dtype=torch.bool)
    return weight, {"w": w, "changed": dropped.float(), "kl": torch.expm1(log_w) - log_w}  # k3 of KL(sampler || pi_old)


def policy_loss(logp, old_logp, ref_logp, advantages, mask, args, is_weight=None):
    """Per-token clipped surrogate (Schulman et al. 2017, eq. 7), optionally with GSPO's sequence ratio
    and a k3 KL; `is_weight` (rollout correction) multiplies the policy-gradient term, not the KL."""
    log_ratio = (logp - old_logp) * mask
    if args.ratio_level == "sequence":  # GSPO-token (Zheng et al. 2025): the value of s_i = exp(mean_t log ratio),
        seq = log_ratio.sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)  # the gradient of each token
        log_ratio = (seq.detach() + logp - logp.detach()) * mask  # (= GSPO's when advantages are per sequence)
    ratio = torch.exp(log_ratio)
    adv = advantages.unsqueeze(1)
    eps_high = args.clip_eps_high or args.clip_eps
    clipped_ratio = torch.clamp(ratio, 1 - args.clip_eps, 1 + eps_high)
    token_loss = -torch.min(ratio * adv, clipped_ratio * adv)
    stats = {"clipped": ((ratio * adv) > (clipped_ratio * adv)).float(), "ratio": ratio.detach()}
    if is_weight is not None:
        token_loss = token_loss * is_weight
    if ref_logp is not None:  # k3 estimator of KL(pi || ref), unbiased and positive (Schulman 2020)
        kl = torch.expm1(ref_logp - logp) - (ref_logp - logp)  # = e^d - d - 1, exact for small d
        token_loss = token_loss + args.beta * kl
        stats["kl"] = kl.detach()
    return token_loss, stats


def aggregate(token_loss, mask, loss_agg, n_seqs, n_tokens, max_len):
    """This micro-batch's share of the minibatch loss. Normalisers (n_seqs, n_tokens) count the
    whole optimisation minibatch, so gradient accumulation does not change the result."""
    if loss_agg == "token-mean":  # DAPO (Yu et al. 2025) eq. 12: sum over all tokens / all tokens
        return (token_loss * mask).sum() / n_tokens
    if loss_agg == "seq-mean-token-mean":  # GRPO (Shao et al. 2024) eq. 3: mean over tokens, then completions
        return ((token_loss * mask).sum(1) / mask.sum(1).clamp(min=1)).sum() / n_seqs
    if loss_agg == "seq-mean-token-sum-norm":  # Dr. GRPO (Liu et al. 2025): token sum / (G * L_max), L_max a constant
        return (token_loss * mask).sum() / (n_seqs * max_len)
    raise ValueError(f"--loss_agg {loss_agg!r}: choose seq-mean-token-mean, token-mean or seq-mean-token-sum-norm")


# ---------------------------------------------------------------------------------------------- training


def main(argv=None):
    args = common.parse_args(Args, argv)
    run = common.setup(args, algo="corpo")
    r_min = run.task.pass_threshold if args.r_min_correct is None else args.r_min_correct
    model, tok, device, dtype = run.model, run.tokenizer, run.device, run.dtype
    ref_model = None
    if args.beta > 0:  # frozen copy of the initial policy (after --resume: of the base model)
        ref_model = common.load_reference(args, run.task, device, dtype, model)  # LoRA: adapters off

    while run.step < args.steps:
        step_start = time.perf_counter()
        # ---- rollout: G completions for each prompt, sampled by the engine from the weights it was last pushed;
        # DAPO dynamic sampling (Yu et al. 2025, sec. 3.2): groups whose completions all got the same outcome
        # carry no advantage, so they are dropped and new prompts sampled until every rank's batch is full
        t0 = time.perf_counter()
        kept, rounds, generated, first_round = [], 0, 0, None
        while True:
            examples, run.data_pos = common.prompt_batch(run.task.train, run.data_pos, args.prompts_per_step, args.seed)
            examples = common.shard(examples)
            prompt_ids = common.encode_prompts(tok, [e["prompt"] for e in examples], run.style == "chat")
            rollouts = common.generate(run.engine, model, prompt_ids, args.group_size, run.max_new_tokens, args.temperature,
                                       common.rollout_seed(args.seed, run.step, common.rank(), rounds), device, dtype)
            rewards, correct, fmt, scores = common.score_rollouts(run.task, tok, examples, rollouts, args.group_size)
            rewards = rewards + args.format_weight * fmt  # optional format bonus, in the reward only
            rewards = rewards + common.overlong_penalty(rollouts, run.max_new_tokens, args.overlong_buffer,
                                                       args.overlong_penalty)  # DAPO eq. 13, reward only
            common.check_rewards(rewards, examples, args.group_size, run.step + 1, args.on_nonfinite)  # NaN/inf: stop or skip
            parts = common.reward_parts(scores, run.task.reward_names)  # --reward: each function's own value
            first_round = first_round if rounds else (rewards, correct, fmt, parts)  # reward/*: the first round
            groups = common.split_groups(examples, rollouts, rewards, correct, fmt, args.group_size)
            same = [g for g in groups if g.correct.min() == g.correct.max()]  # on the raw outcome, not the reward
            kept += [g for g in groups if g.correct.min() < g.correct.max()] if args.dynamic_sampling else groups
            rounds, generated = rounds + 1, generated + len(rollouts.completion_ids)
            short = common.all_sum(max(len(examples) - len(kept), 0))  # groups still missing, all ranks
            if short == 0 or rounds >= args.max_sampling_rounds:  # (then topped up with the last round's others)
                break
        examples, rollouts, rewards, correct, fmt = common.join_groups((kept + same)[:len(examples)])
        common.engine_sleep(run.engine)  # CUDA vLLM: free its memory for the update (level 2: weights discarded)
        time_rollout = time.perf_counter() - t0

        # ---- update: updates_per_rollout passes, each split into `minibatches` optimizer steps
        t0 = time.perf_counter()
        B = len(rollouts.completion_ids)
        lengths = torch.tensor([len(c) for c in rollouts.completion_ids], dtype=torch.float32)
        keep = torch.tensor(rollouts.finished, dtype=torch.float32) if args.mask_truncated else torch.ones(B)
        micro = args.micro_batch_size
        sampler_logp = [torch.tensor(lp, dtype=torch.float32) for lp in rollouts.sampler_logprobs]
        # on-policy, pi_old is the update's own first forward; with --lora_dropout it comes from a pass without it
        on_policy = args.updates_per_rollout == 1 and args.minibatches == 1 and not args.lora_dropout
        top_entropy = args.top_entropy_quantile < 1
        old_logp, ref_logp, old_entropy = [None] * B, [None] * B, [None] * B
        with torch.no_grad():
            for s in range(0, B, micro):
                idx = list(range(s, min(s + micro, B)))
                if not on_policy or top_entropy:  # pi_old, recomputed by the trainer (not the sampler's values)
                    batch, logp, entropy = common.rollout_logprobs(model, rollouts, idx, args.temperature, device, dtype,
                                                                   with_entropy=top_entropy)
                    old_logp[s:s + len(idx)] = common.to_ragged(logp, batch["mask"])
                    if top_entropy:
                        old_entropy[s:s + len(idx)] = common.to_ragged(entropy, batch["mask"])
                if ref_model is not None:
                    batch, logp, _ = common.rollout_logprobs(ref_model, rollouts, idx, args.temperature, device, dtype)
                    ref_logp[s:s + len(idx)] = common.to_ragged(logp, batch["mask"])

        # ---- advantages, over the global batch (every rank's completions, in one process's order); then this rank's
        rewards_all = common.all_gather(rewards)
        advantages_all = compute_advantages(rewards_all, args.group_size, r_min, args.baseline)
        advantages = advantages_all[common.local_slice(B)]
        # Wang et al. 2025 ("Beyond the 80/20 rule"): the loss keeps only the tokens whose entropy under pi_old is in
        # the top rho share of the global batch's tokens (of the completions in the loss)
        tau = common.top_share_threshold([old_entropy[i] for i in range(B) if keep[i]],
                                         args.top_entropy_quantile) if top_entropy else float("nan")

        sums = {"loss/policy": 0.0, "clip_frac": 0.0, "kl": 0.0, "kl/old": 0.0, "entropy": 0.0,
                "logprob/sampler_diff": 0.0, "is/mean": 0.0, "is/clip_frac": 0.0, "is/kl": 0.0,
                "perf/computed": 0.0, "perf/padded": 0.0}
        n_opt_steps, n_skipped, tokens_seen, grad_norm_sum = 0, 0, 0.0, 0.0
        shuffle = torch.Generator().manual_seed(args.seed * 1_000_003 + run.step)  # a function of the step: resumable
        for epoch in range(args.updates_per_rollout):
            perm = common.group_permutation(B, args.group_size, shuffle)  # whole groups: a micro-batch shares prompts
            for mb in perm.chunk(args.minibatches):
                mb = mb.tolist()
                # normalisers: the completions in the loss (DAPO overlong filtering drops truncated ones), all ranks,
                # divided by the number of ranks since FSDP2 averages gradients over ranks
                n_seqs = max(common.all_sum(float(keep[mb].sum())), 1.0) / common.world_size()
                n_tokens = max(common.all_sum(float((lengths[mb] * keep[mb]).sum())), 1.0) / common.world_size()
                for s in range(0, len(mb), micro):
                    idx = mb[s:s + micro]
                    batch, logp, entropy = common.rollout_logprobs(model, rollouts, idx, args.temperature, device,
                                                                   dtype, with_entropy=epoch == 0 or args.entropy_coef > 0)
                    mask = batch["mask"]
                    computed, padded = common.padded_tokens(batch, model)  # token positions the forward ran, padding
                    sums["perf/computed"] += computed
                    sums["perf/padded"] += padded
                    loss_mask = mask * keep[idx].unsqueeze(1).to(device)  # --mask_truncated
                    old = logp.detach() if on_policy else common.to_padded(old_logp, idx, mask)
                    ref = common.to_padded(ref_logp, idx, mask) if ref_model is not None else None
                    sampler = common.to_padded(sampler_logp, idx, mask)
                    is_weight, is_stats = rollout_correction(old, sampler, mask, args)  # Yao et al. 2025
                    token_loss, stats = policy_loss(logp, old, ref, advantages[idx].to(device), loss_mask, args, is_weight)
                    if top_entropy:  # only the high-entropy ("forking") tokens; the normalisers stay (Wang et al. 2025)
                        token_loss = token_loss * (common.to_padded(old_entropy, idx, mask) >= tau)
                    if args.entropy_coef:  # entropy bonus, its gradient through the chunked projection
                        token_loss = token_loss - args.entropy_coef * entropy
                    loss = aggregate(token_loss, loss_mask, args.loss_agg, n_seqs, n_tokens, run.max_new_tokens)
                    loss.backward()
                    # diagnostics, token-weighted
                    tokens_seen += mask.sum().item()
                    sums["loss/policy"] += loss.item() / common.world_size()  # this rank's share (FSDP2 averages)
                    sums["clip_frac"] += (stats["clipped"] * mask).sum().item()
                    sums["kl"] += (stats["kl"] * mask).sum().item() if "kl" in stats else 0.0
                    log_r = torch.log(stats["ratio"].clamp(min=1e-30))
                    sums["kl/old"] += ((torch.exp(-log_r) + log_r - 1) * mask).sum().item()
                    if epoch == 0:  # once per rollout token: the sampler against pi_old
                        sums["entropy"] += (entropy * mask).sum().item()
                        sums["logprob/sampler_diff"] += ((sampler - old).abs() * mask).sum().item()
                        for key, name in (("w", "is/mean"), ("changed", "is/clip_frac"), ("kl", "is/kl")):
                            sums[name] += (is_stats[key] * mask).sum().item()
                grad_norm = common.clip_grad_norm(model, args.grad_clip)  # over every rank's shard
                if common.nonfinite(grad_norm, "gradient norm", run.step + 1, args.on_nonfinite):  # stop, or skip
                    run.optimizer.zero_grad(set_to_none=True)
                    n_skipped += 1
                    continue
                run.optimizer.step()
                run.scheduler.step()
                run.optimizer.zero_grad(set_to_none=True)
                grad_norm_sum += grad_norm
                n_opt_steps += 1
        time_update = time.perf_counter() - t0

        # ---- guard: the trainer must reproduce the sampler's log-probs (stale or discarded engine weights)
        totals = common.all_sum({**sums, "tokens": tokens_seen, "first_pass_tokens": float(lengths.sum())})  # all ranks
        sampler_diff = totals["logprob/sampler_diff"] / totals["first_pass_tokens"]
        common.check_sampler_diff(sampler_diff, run.step + 1, args.sampler_diff_tol)
        common.nonfinite(totals["loss/policy"], "loss", run.step + 1, args.on_nonfinite)

        # ---- push: the updated weights into vLLM (wakes it; no-op for the HF engine), checked on a probe
        t0 = time.perf_counter()
        common.push_weights(run.engine, model, dtype)
        if args.push_check_every and (run.step + 1) % args.push_check_every == 0:
            common.check_push(run.engine, model, run.probe, args.temperature, args.push_check_tol, device, dtype)
        time_push = time.perf_counter() - t0
        run.step += 1

        # ---- log (metric names shared by every train_*.py), over the global batch: per-completion values gathered
        # from every rank and token sums over ranks, so that each metric is its 1-rank value on the same batch
        first_all = [common.all_gather(x) for x in first_round]  # reward/* logs the first sampling round
        lengths_all, G = common.all_gather(lengths), args.group_size
        trained = common.all_gather(correct).view(-1, G)  # outcomes of the trained groups (dynamic sampling's filter)
        finished_all = common.all_gather(torch.tensor(rollouts.finished, dtype=torch.float32))
        failed = rewards_all < run.task.pass_threshold
        metrics = {
            "reward/mean": first_all[0].mean().item(),
            "reward/std": first_all[0].std().item() if len(first_all[0]) > 1 else 0.0,
            "reward/correct": first_all[1].mean().item(), "reward/format": first_all[2].mean().item(),
            **{f"reward/{name}": first_all[3][:, j].mean().item() for j, name in enumerate(run.task.reward_names)},
            "frac_reward_zero_std":  # TRL's name: the first round's groups whose rewards are all equal
                (first_all[0].view(-1, G).amax(1) == first_all[0].view(-1, G).amin(1)).float().mean().item(),
            "sampling/rounds": rounds, "sampling/extra_rollouts": common.all_sum(generated - B),
            "sampling/kept_zero_std": (trained.amax(1) == trained.amin(1)).float().mean().item(),
            "adv/mean": advantages_all.mean().item(), "adv/abs_mean": advantages_all.abs().mean().item(),
            "adv/failed_pos_frac": (advantages_all[failed] > 0).float().mean().item() if failed.any() else float("nan"),
            "loss/policy": totals["loss/policy"] / (n_opt_steps + n_skipped), "nonfinite/skipped": n_skipped,
            "kl": totals["kl"] / totals["tokens"] if ref_model is not None else float("nan"),
            "kl/old": totals["kl/old"] / totals["tokens"], "clip_frac": totals["clip_frac"] / totals["tokens"],
            "entropy": totals["entropy"] / totals["first_pass_tokens"], "logprob/sampler_diff": sampler_diff,
            "is/mean": totals["is/mean"] / totals["first_pass_tokens"],
            "is/clip_frac": totals["is/clip_frac"] / totals["first_pass_tokens"],
            "is/kl": totals["is/kl"] / totals["first_pass_tokens"],
            "grad_norm": grad_norm_sum / n_opt_steps if n_opt_steps else float("nan"),  # NaN: every update skipped
            "lr": run.scheduler.get_last_lr()[0], "entropy/threshold": tau,
            "len/mean": lengths_all.mean().item(), "len/truncated": 1.0 - finished_all.mean().item(),
            "time/rollout": time_rollout, "time/update": time_update, "time/push": time_push,  # this rank's (rank 0 logs)
            "perf/tokens_per_s": totals["first_pass_tokens"] / (time.perf_counter() - step_start),  # all ranks
            "perf/pad_frac": totals["perf/padded"] / max(totals["perf/computed"], 1.0),  # the update's forwards
        }
        common.warn_on_collapse(run, metrics)  # no gradient or no entropy for several steps in a row
        common.log_completions(run, examples, rollouts, rewards, correct, fmt, advantages, args.log_completions)
        # ---- evaluation (the engine holds the weights just pushed and stays awake for the next rollout)
        if args.eval_every and (run.step % args.eval_every == 0 or run.step == args.steps):
            metrics.update(evaluate(run))
        run.log.log(run.step, metrics)
        if args.save_every and run.step % args.save_every == 0:
            common.checkpoint(run)

    common.finish(run)
    return run


if __name__ == "__main__":
    with common.user_errors():  # bad data, a NaN: one line naming it (exit 2), no traceback
        main()
