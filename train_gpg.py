"""GPG (Chu et al. 2025) in one file: GRPO's loop with the plain policy-gradient loss -log pi * A (no ratio,
clipping, KL or reference), the group advantage scaled by alpha = B / (B - M), and the beta_th resampling.

    python train_gpg.py                                        # the built-in tiny model on `addition` (CPU)
    python train_gpg.py --beta_th 0.6 --std_norm true          # the paper's Table 1 rows
    python train_gpg.py --model Qwen/Qwen2.5-0.5B-Instruct --task gsm8k --lr 1e-6 --max_new_tokens 512
"""
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

import common
from common import arg
from eval import evaluate


@dataclass
class Args(common.Args):
    std_norm: bool = arg(False, "F_norm = the group std instead of 1 (Chu et al. 2025, eq. 6; 1 by default)")
    adv_eps: float = arg(1e-6, "added to the std (verl 1e-6; Bereket & Leskovec's code 1e-5)", ge=0)
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = arg(
        "token-mean", "loss aggregation: GPG eq. 5 | GRPO | Dr. GRPO")
    beta_th: float = arg(0.5, "resample until valid groups >= beta_th x prompts (code 0.5, paper 0.6)",
                         ge=0, le=1)
    hadw: bool = arg(False, "HA-DW difficulty reweighting of the advantages (arXiv 2601.08521; 0/1 rewards)")
    hadw_eta: float = arg(0.1, "HA-DW Kalman rate eta", ge=0, le=1, only_with=("hadw_anchor", "kalman"))
    hadw_window: int = arg(50, "HA-DW: anchors in the std window (m)", ge=1, only_with=("hadw", True))
    hadw_lambda: float = arg(1.3, "HA-DW lambda_scale (Table 7's best)", gt=0, only_with=("hadw", True))
    hadw_anchor: Literal["kalman", "mean", "fixed"] = arg(
        "kalman", "HA-DW anchor: sec. 3 Kalman | app. F moving mean | fixed", only_with=("hadw", True))
    hadw_threshold: float = arg(0.5, "HA-DW's fixed anchor C", ge=0, le=1, only_with=("hadw_anchor", "fixed"))
    max_sampling_rounds: int = arg(20, "the beta_th rule: rounds per step at most (authors' code: 20)", ge=1)
    min_group_size: ClassVar[int] = 2  # the group baseline needs two completions of a prompt
    smoke_flags: ClassVar[tuple] = ("--beta_th", "0")  # one step: no resampling rounds on an untrained model


# ---------------------------------------------------------------------------------------------- advantages


def compute_advantages(rewards, group_size, std_norm=False, eps=1e-6):
    """GPG: A_i = alpha (r_i - mean(r)) / F_norm (Chu et al. 2025, eqs. 6-8), alpha = B / (B - M), M the
    completions in groups whose rewards are all equal (no gradient, eq. 7). verl's `gpg` uses bsz /
    count_nonzero(scores) instead, another quantity: we follow the paper and the authors' code (B - M)."""
    r = rewards.double().view(-1, group_size)  # float64: an all-equal group's mean is exact, so A = 0 exactly
    advantages = r - r.mean(dim=1, keepdim=True)
    if std_norm:
        advantages = advantages / (r.std(dim=1, keepdim=True) + eps)
    valid = (r.max(dim=1).values > r.min(dim=1).values).float().sum() * group_size
    alpha = r.numel() / valid.item() if valid > 0 else 1.0
    return alpha * advantages.flatten().to(rewards.dtype), alpha


# ---------------------------------------------------------------------------------------------- loss


def policy_loss(logp, old_logp, ref_logp, advantages, mask, args, is_weight=None):
    """GPG eq. 5: the policy gradient itself, -log pi(o_t) A; no ratio, clipping or KL; `is_weight` (rollout
    correction) multiplies it."""
    token_loss = -logp * advantages.unsqueeze(1)
    ratio = torch.exp((logp - old_logp) * mask).detach()  # only for the kl/old diagnostic
    if is_weight is not None:
        token_loss = token_loss * is_weight
    return token_loss, {"clipped": torch.zeros_like(logp), "ratio": ratio}


# ---------------------------------------------------------------------------------------------- training


def main(argv=None):
    args = common.parse_args(Args, argv)
    run = common.setup(args, algo="gpg")
    ref_model = None  # GPG has no reference model
    # the beta_th rule (Chu et al. 2025, Alg. 1; authors' code): resample until valid groups fill beta_th
    keep = common.Keep("rewards", args.max_sampling_rounds, min_valid=args.beta_th * args.prompts_per_step)

    while run.step < args.steps:
        # ---- rollout: G completions per prompt, sampled by the engine from the weights it was last pushed
        batch = common.rollout(run, keep)
        run.engine.sleep()  # CUDA vLLM: free its memory for the update (level 2: weights discarded)
        pre = common.pre_update(run, batch, ref_model)  # pi_old (off-policy), pi_ref, entropies

        # ---- ALGORITHM: advantages over the global batch (every rank's groups), then this rank's rows
        rewards = common.all_gather(batch.rewards)
        advantages, alpha = compute_advantages(rewards, args.group_size, args.std_norm, args.adv_eps)
        extra = {"gpg/alpha": alpha, "gpg/valid_frac": 1 / alpha}
        if args.hadw:  # HA-DW (arXiv 2601.08521): reweight by difficulty against the cross-batch anchor
            advantages, info = common.hadw_reweight(rewards, advantages, run.hadw, args)
            extra.update(info)
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
