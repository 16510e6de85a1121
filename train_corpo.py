"""CoRPO (Garg & Venkatesh 2025) in one file: GRPO's loop with the baseline max(R_min_correct, group mean),
so a failed completion never gets a positive advantage on ordinal (partial-credit) rewards (static: R_min).

    python train_corpo.py --task ordinal                       # the built-in tiny model, partial credit (CPU)
    python train_corpo.py --task ordinal --baseline static     # Garg & Venkatesh 2025, sec. 3.2
    python train_corpo.py --model Qwen/Qwen2.5-0.5B-Instruct --task jsonl:ratings.jsonl --r_min_correct 0.5
"""
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

import common
from common import arg
from eval import evaluate


@dataclass
class Args(common.Args):
    baseline: Literal["adaptive", "static"] = arg("adaptive", "max(R_min_correct, mean) or R_min_correct")
    r_min_correct: float | None = arg(None, "minimum reward of a correct completion (default: the task's)")
    loss_agg: Literal["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"] = arg(
        "seq-mean-token-mean", "loss aggregation: GRPO | DAPO | Dr. GRPO")
    clip_eps: float = arg(0.2, "PPO clip range below 1 (and above, unless clip_eps_high is set)", gt=0)
    clip_eps_high: float = arg(0.0, "clip range above 1; DAPO clip-higher uses 0.28 (0 = clip_eps)", ge=0)
    ratio_level: Literal["token", "sequence"] = arg("token", "ratio per token, or GSPO's per sequence")
    beta: float = arg(0.0, "KL penalty to the initial policy (0 = no reference model is loaded)", ge=0)
    dynamic_sampling: bool = arg(False, "DAPO: drop groups whose completions share one outcome, sample more")
    max_sampling_rounds: int = arg(20, "dynamic sampling: rounds per step at most, then topped up", ge=1)
    min_group_size: ClassVar[int] = 2  # the group baseline needs two completions of a prompt
    smoke_flags: ClassVar[tuple] = ("--task", "ordinal")  # CoRPO's threshold needs a graded reward


# ---------------------------------------------------------------------------------------------- advantages


def compute_advantages(rewards, group_size, r_min_correct, baseline="adaptive"):
    """CoRPO: A_i = r_i - max(R_min_correct, mean(r)) (Garg & Venkatesh 2025, sec. 3.3); the static variant
    A_i = r_i - R_min_correct (sec. 3.2). No std normalisation (the paper skips it)."""
    r = rewards.double().view(-1, group_size)  # float64: an all-equal group's mean is exact, so A = 0 exactly
    b = torch.full_like(r[:, :1], r_min_correct)
    if baseline == "adaptive":
        b = torch.maximum(b, r.mean(dim=1, keepdim=True))
    return (r - b).flatten().to(rewards.dtype)


# ---------------------------------------------------------------------------------------------- loss


def policy_loss(logp, old_logp, ref_logp, advantages, mask, args, is_weight=None):
    """Per-token clipped surrogate (Schulman et al. 2017, eq. 7), optionally with GSPO's sequence ratio and a
    k3 KL; `is_weight` (rollout correction) multiplies the policy-gradient term, not the KL."""
    log_ratio = (logp - old_logp) * mask
    if args.ratio_level == "sequence":  # GSPO-token (Zheng et al. 2025): value s_i, token gradients
        seq = log_ratio.sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)
        log_ratio = (seq.detach() + logp - logp.detach()) * mask
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


# ---------------------------------------------------------------------------------------------- training


def main(argv=None):
    args = common.parse_args(Args, argv)
    run = common.setup(args, algo="corpo")
    ref_model = common.load_reference(run) if args.beta > 0 else None  # the initial policy
    r_min = run.task.pass_threshold if args.r_min_correct is None else args.r_min_correct
    if common.zero_one_rewards(run) and r_min >= 1:  # R_min_correct is for graded rewards (Garg & Venkatesh)
        common.warn(f"--task {args.task} rewards 0 or 1: CoRPO's baseline max(R_min_correct {r_min:g}, mean) "
                    f"is then 1, so no advantage is positive (0 right, -1 wrong) and the policy only moves "
                    f"away from what it sampled; CoRPO is for graded rewards: --task ordinal or sums_graded")
    # DAPO dynamic sampling (Yu et al. 2025, sec. 3.2): groups of one outcome carry no advantage: resample
    keep = common.Keep("correct", args.max_sampling_rounds) if args.dynamic_sampling else None

    while run.step < args.steps:
        # ---- rollout: G completions per prompt, sampled by the engine from the weights it was last pushed
        batch = common.rollout(run, keep)
        run.engine.sleep()  # CUDA vLLM: free its memory for the update (level 2: weights discarded)
        pre = common.pre_update(run, batch, ref_model)  # pi_old (off-policy), pi_ref, entropies

        # ---- ALGORITHM: advantages over the global batch (every rank's groups), then this rank's rows
        rewards = common.all_gather(batch.rewards)
        advantages = compute_advantages(rewards, args.group_size, r_min, args.baseline)
        local = advantages[common.local_slice(len(batch))]

        # ---- update: --updates_per_rollout passes, each split into --minibatches optimizer steps
        stats = common.StepStats()
        for mb in common.minibatches(run, batch):
            for micro in mb:
                logp, entropy = common.policy_logprobs(run, micro)
                old = pre.old_logp(micro, logp)
                is_weight, is_info = common.rollout_correction(old, micro.sampler_logp, micro.mask, args)
                token_loss, info = policy_loss(logp, old, pre.ref_logp(micro), micro.per_seq(local),
                                               micro.loss_mask, args, is_weight)
                token_loss = common.entropy_terms(token_loss, entropy, pre, micro, args)
                loss = common.aggregate(token_loss, micro.loss_mask, args.loss_agg, mb.n_seqs, mb.n_tokens,
                                        run.max_new_tokens)
                loss.backward()
                stats.add(micro, loss, old, entropy, info, is_info)
            common.optimizer_step(run, stats)  # clip; a NaN/inf norm stops the run or skips the update

        # ---- guard, push, log, evaluate, checkpoint
        common.check_sampler(run, batch, stats)  # the trainer reproduces the sampler's log-probs
        run.engine.push()  # the updated weights into vLLM (wakes it); the HF engine samples the policy itself
        if args.push_check_every and (run.step + 1) % args.push_check_every == 0:
            run.engine.check_push(run.probe, args.push_check_tol)  # vLLM reproduces the trainer on a probe
        run.step += 1
        metrics = common.step_metrics(run, batch, pre, stats, advantages)
        if args.eval_every and (run.step % args.eval_every == 0 or run.step == args.steps):
            metrics.update(evaluate(run))  # held-out pass@k (and calibration) with the weights just pushed
        run.log.log(run.step, metrics)
        if args.save_every > 0 and run.step % args.save_every == 0:
            common.checkpoint(run)

    common.finish(run)
    return run


if __name__ == "__main__":
    with common.user_errors():  # bad data, a NaN: one line naming it (exit 2), no traceback
        main()
