"""GRPO (Shao et al. 2024) in one file, with the switches the follow-up papers argue about: the std (off: Dr.
GRPO), the loss aggregation, DAPO's clip-higher, GSPO's sequence ratio, CISPO, a k3 KL penalty, HA-DW.

    python train_grpo.py                                       # the built-in tiny model on `addition` (CPU)
    python train_grpo.py --task calibration --std_norm false   # calibrated without the std (Bereket 2025)
    python train_grpo.py --model Qwen/Qwen2.5-0.5B-Instruct --task gsm8k --lr 1e-6 --max_new_tokens 512
"""
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

import common
from common import arg
from eval import evaluate


@dataclass
class Args(common.Args):
    std_norm: bool = arg(True, "divide advantages by the group std (false = Dr. GRPO)")
    std_level: Literal["group", "batch"] = arg("group", "std of each group, or of the batch (REINFORCE++)")
    adv_eps: float = arg(1e-6, "added to the std (verl 1e-6; Bereket & Leskovec's code 1e-5)", ge=0)
    loss_agg: Literal["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"] = arg(
        "seq-mean-token-mean", "loss aggregation: GRPO | DAPO | Dr. GRPO")
    clip_eps: float = arg(0.2, "PPO clip range below 1 (and above, unless clip_eps_high is set)", gt=0)
    clip_eps_high: float = arg(0.0, "clip range above 1; DAPO clip-higher uses 0.28 (0 = clip_eps)", ge=0)
    ratio_level: Literal["token", "sequence"] = arg("token", "ratio per token, or GSPO's per sequence")
    surrogate: Literal["clip", "cispo"] = arg("clip", "PPO's clipped ratio, or CISPO's clipped weight")
    beta: float = arg(0.0, "KL penalty to the initial policy (0 = no reference model is loaded)", ge=0)
    hadw: bool = arg(False, "HA-DW difficulty reweighting of the advantages (arXiv 2601.08521; 0/1 rewards)")
    hadw_eta: float = arg(0.1, "HA-DW Kalman rate eta", ge=0, le=1, only_with=("hadw_anchor", "kalman"))
    hadw_window: int = arg(50, "HA-DW: anchors in the std window (m)", ge=1, only_with=("hadw", True))
    hadw_lambda: float = arg(1.3, "HA-DW lambda_scale (Table 7's best)", gt=0, only_with=("hadw", True))
    hadw_anchor: Literal["kalman", "mean", "fixed"] = arg(
        "kalman", "HA-DW anchor: sec. 3 Kalman | app. F moving mean | fixed", only_with=("hadw", True))
    hadw_threshold: float = arg(0.5, "HA-DW's fixed anchor C", ge=0, le=1, only_with=("hadw_anchor", "fixed"))
    dynamic_sampling: bool = arg(False, "DAPO: drop groups whose completions share one outcome, sample more")
    max_sampling_rounds: int = arg(20, "dynamic sampling: rounds per step at most, then topped up", ge=1)
    min_group_size: ClassVar[int] = 2  # the group baseline needs two completions of a prompt

    def __post_init__(self):
        super().__post_init__()
        if self.std_level == "batch" and not self.std_norm:
            raise ValueError("--std_level batch sets the level of the std division: it needs --std_norm true")


# ---------------------------------------------------------------------------------------------- advantages


def compute_advantages(rewards, group_size, std_norm=True, eps=1e-6, std_level="group"):
    """GRPO: A_i = (r_i - mean(r)) / (std(r) + eps) in each group (Shao et al. 2024, sec. 4.1.2); no std: Dr.
    GRPO. std_level="batch": REINFORCE++-baseline (Hu et al. 2025, sec. 3), the std of the centred batch."""
    r = rewards.double().view(-1, group_size)  # float64: an all-equal group's mean is exact, so A = 0 exactly
    advantages = r - r.mean(dim=1, keepdim=True)
    if std_norm and std_level == "group":
        advantages = advantages / (r.std(dim=1, keepdim=True) + eps)
    elif std_norm:  # one std for every completion of the (global) batch
        advantages = advantages / (advantages.std() + eps)
    return advantages.flatten().to(rewards.dtype)


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
    if args.surrogate == "cispo":  # CISPO (MiniMax 2025, eq. 4-5): sg(min(r, 1 + eps_high)) A log pi
        weight = torch.clamp(ratio, max=1 + eps_high).detach()  # no lower clip: every token keeps a gradient
        token_loss = -weight * adv * logp
        stats["clipped"] = (ratio > 1 + eps_high).float()
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
    run = common.setup(args, algo="grpo")
    ref_model = common.load_reference(run) if args.beta > 0 else None  # the initial policy
    # DAPO dynamic sampling (Yu et al. 2025, sec. 3.2): groups of one outcome carry no advantage: resample
    keep = common.Keep("correct", args.max_sampling_rounds) if args.dynamic_sampling else None

    while run.step < args.steps:
        # ---- rollout: G completions per prompt, sampled by the engine from the weights it was last pushed
        batch = common.rollout(run, keep)
        run.engine.sleep()  # CUDA vLLM: free its memory for the update (level 2: weights discarded)
        pre = common.pre_update(run, batch, ref_model)  # pi_old (off-policy), pi_ref, entropies

        # ---- ALGORITHM: advantages over the global batch (every rank's groups), then this rank's rows
        rewards = common.all_gather(batch.rewards)
        advantages = compute_advantages(rewards, args.group_size, args.std_norm, args.adv_eps, args.std_level)
        extra = {}
        if args.hadw:  # HA-DW (arXiv 2601.08521): reweight by difficulty against the cross-batch anchor
            advantages, extra = common.hadw_reweight(rewards, advantages, run.hadw, args)
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
        metrics = common.step_metrics(run, batch, pre, stats, advantages, extra)
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
