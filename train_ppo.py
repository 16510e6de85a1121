"""PPO (Schulman et al. 2017) for language models in one file: GRPO's loop with a learned value model (a
transformers backbone and a scalar head) and GAE (Schulman et al. 2016) in place of the group baseline; the
clipped value loss; the critic has its own learning rate and optional warm-up steps.

    python train_ppo.py --group_size 1                         # classic PPO: one completion per prompt
    python train_ppo.py --task calibration                     # PPO stays calibrated (Bereket 2025)
    python train_ppo.py --model Qwen/Qwen2.5-0.5B-Instruct --task gsm8k --lr 1e-6 --max_new_tokens 512
"""
from dataclasses import dataclass
from typing import Literal

import torch

import common
from common import arg
from eval import evaluate


@dataclass
class Args(common.Args):
    gamma: float = arg(1.0, "discount (Bereket & Leskovec: 1, A_t = R - V(s_t) with lam 1)", ge=0, le=1)
    lam: float = arg(1.0, "GAE lambda (1 = the unbiased Monte-Carlo advantage)", ge=0, le=1)
    critic_model: str = arg("", "value model backbone (default: initialised from the policy)")
    critic_lr: float = arg(0.0, "critic learning rate (0 = 10 x lr: 1e-5 vs 1e-6 in Bereket 2025)", ge=0)
    vf_clip: float = arg(0.2, "value clip range around the old values (0 = off)", ge=0)
    critic_warmup: int = arg(0, "first steps train only the critic", ge=0)
    whiten_advantages: bool = arg(False, "batch-normalise advantages (verl's default; biased)")
    loss_agg: Literal["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"] = arg(
        "seq-mean-token-mean", "loss aggregation: GRPO | DAPO | Dr. GRPO")
    clip_eps: float = arg(0.2, "PPO clip range below 1 (and above, unless clip_eps_high is set)", gt=0)
    clip_eps_high: float = arg(0.0, "clip range above 1; DAPO clip-higher uses 0.28 (0 = clip_eps)", ge=0)
    ratio_level: Literal["token", "sequence"] = arg("token", "ratio per token, or GSPO's per sequence")
    beta: float = arg(0.0, "KL penalty to the initial policy (0 = no reference model is loaded)", ge=0)


# ---------------------------------------------------------------------------------------------- advantages


def compute_advantages(rewards, values, mask, gamma=1.0, lam=1.0):
    """GAE (Schulman et al. 2016, eq. 16) per token of [B, T] completions (left-aligned, mask 1 on
    tokens): delta_t = r_t + gamma V(s_{t+1}) - V(s_t), A_t = delta_t + gamma lam A_{t+1}; the outcome
    reward arrives on the last token and V after it is 0. Returns (advantages, returns = A + V)."""
    B, T = values.shape
    last = mask.sum(1).long() - 1
    token_rewards = torch.zeros_like(values)
    token_rewards[torch.arange(B), last] = rewards
    advantages = torch.zeros_like(values)
    next_adv, next_value = torch.zeros(B), torch.zeros(B)
    for t in reversed(range(T)):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        next_adv = (delta + gamma * lam * next_adv) * mask[:, t]
        next_value = values[:, t] * mask[:, t]
        advantages[:, t] = next_adv
    return advantages, (advantages + values) * mask


def whiten(advantages, mask, eps=1e-8):
    """(A - mean) / sqrt(var + eps) over the tokens of the global batch (every rank's), in float64: a constant
    batch gives exactly 0 (its mean is exact), and a tiny variance is not blown up into unit advantages."""
    a = advantages.double()
    mean, var = common.all_mean_var(a[mask > 0])
    return ((a - mean) * (var + eps) ** -0.5 * mask).to(advantages.dtype)


# ---------------------------------------------------------------------------------------------- critic


def load_critic(path, device, dtype, args):
    """Value model: a transformers backbone with a scalar head on every position (token classification
    with one label; the head zero-initialised, V = 0 at start, and no dropout: it regresses), sharded like
    the policy (models.load_pretrained). A model of its own, not the policy's: with --lora_rank, its own
    frozen copy of the base in `dtype` with its own adapters, the head trained in full (fp32)."""
    from transformers import AutoModelForTokenClassification

    def head_of(critic):
        return [(n, m) for n, m in critic.named_modules() if isinstance(m, torch.nn.Linear)
                and m.out_features == 1][-1]

    def prepare(critic):
        head_name, head = head_of(critic)
        torch.nn.init.zeros_(head.float().weight)  # the head trains in fp32, from V = 0
        if head.bias is not None:
            torch.nn.init.zeros_(head.bias)
        critic = common.prepare_for_training(critic, args.gradient_checkpointing, args.packing)
        if args.lora_rank:
            critic = common.add_lora(critic, args, extra_trainable=[head], exclude=[head_name])
        return critic
    base_dtype = dtype if args.lora_rank else torch.float32
    critic, new = common.load_pretrained(AutoModelForTokenClassification, path, device, base_dtype, dtype,
                                         prepare, new=lambda critic: [head_of(critic)[0]], num_labels=1)
    if common.rank() == 0:  # transformers' load report, a table that reads like a failure, in one line
        print(f"critic: value head {', '.join(new)} initialised (new), backbone from {path}")
    return critic


def critic_values(critic, batch):
    """V(s_t) for every position, [B, T-1] aligned with batch["mask"] (state before token t+1)."""
    out, pick = common.model_forward(critic, batch)  # packed or padded: pick takes the states before tokens
    return common.to_batch_layout(pick(out.logits)[:, 0].float(), batch)


def value_loss(values, old_values, returns, mask, vf_clip, n_tokens):
    """Clipped value loss (PPO2, as in verl): 0.5 max((V - R)^2, (clip(V, V_old +- eps) - R)^2), token mean.
    """
    loss = (values - returns) ** 2
    if vf_clip > 0:
        clipped = old_values + (values - old_values).clamp(-vf_clip, vf_clip)
        loss = torch.max(loss, (clipped - returns) ** 2)
    return 0.5 * (loss * mask).sum() / n_tokens


def explained_variance(values, returns):
    """1 - Var(R - V) / Var(R) over the tokens of the global batch (every rank's)."""
    v, r = torch.cat(values).cpu().double(), torch.cat(returns).cpu().double()
    var_r, var_residual = common.all_mean_var(r)[1], common.all_mean_var(r - v)[1]
    return 1 - var_residual / var_r if var_r > 0 else None  # None: absent (returns all equal)


# ---------------------------------------------------------------------------------------------- loss


def policy_loss(logp, old_logp, ref_logp, advantages, mask, args, is_weight=None):
    """Per-token clipped surrogate (Schulman et al. 2017, eq. 7), optionally with GSPO's sequence ratio and a
    k3 KL; `is_weight` (rollout correction) multiplies the policy-gradient term, not the KL."""
    log_ratio = (logp - old_logp) * mask
    if args.ratio_level == "sequence":  # GSPO-token (Zheng et al. 2025): value s_i, token gradients
        seq = log_ratio.sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)
        log_ratio = (seq.detach() + logp - logp.detach()) * mask
    ratio = torch.exp(log_ratio)
    adv = advantages  # [b, T-1] per token (GAE), or [b, 1] per completion: micro.advantages
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
    run = common.setup(args, algo="ppo")
    critic = load_critic(args.critic_model or run.model_path, run.device, run.dtype, args)
    common.add_critic(run, critic, lr=args.critic_lr or 10 * args.lr)  # sharded, its own AdamW, checkpointed
    ref_model = common.load_reference(run) if args.beta > 0 else None  # the initial policy

    while run.step < args.steps:
        # ---- rollout: G completions per prompt, sampled by the engine from the weights it was last pushed
        batch = common.rollout(run)
        run.engine.sleep()  # CUDA vLLM: free its memory for the update (level 2: weights discarded)
        # pi_old (off-policy), pi_ref, entropies, and the critic's V(s_t) before the update
        pre = common.pre_update(run, batch, ref_model, values=lambda x: critic_values(run.critic, x))

        # ---- ALGORITHM: GAE on the pre-update values, per token of this rank's completions
        values = torch.nn.utils.rnn.pad_sequence([v.cpu() for v in pre.values], batch_first=True)
        mask = (torch.arange(values.shape[1]) < batch.lengths[:, None]).float()
        token_adv, returns = compute_advantages(batch.rewards, values, mask, args.gamma, args.lam)
        if args.whiten_advantages:
            token_adv = whiten(token_adv, mask)  # over every rank's tokens
        advantages, ret_seq = common.to_ragged(token_adv, mask), common.to_ragged(returns, mask)

        # ---- update: --updates_per_rollout passes, each split into --minibatches optimizer steps
        stats = common.StepStats()
        for mb in common.minibatches(run, batch):
            for micro in mb:
                logp, entropy = common.policy_logprobs(run, micro)
                old = pre.old_logp(micro, logp)
                is_weight, is_info = common.rollout_correction(old, micro.sampler_logp, micro.mask, args)
                token_loss, info = policy_loss(logp, old, pre.ref_logp(micro), micro.advantages(advantages),
                                               micro.loss_mask, args, is_weight)
                token_loss = common.entropy_terms(token_loss, entropy, pre, micro, args)
                loss = common.aggregate(token_loss, micro.loss_mask, args.loss_agg, mb.n_seqs, mb.n_tokens,
                                        run.max_new_tokens)
                if run.step >= args.critic_warmup:  # during the critic's warm-up the policy stays put
                    loss.backward()
                with common.autocast(run.device, run.dtype):
                    v = critic_values(run.critic, micro.layout)
                v_old = micro.per_token(pre.values)  # --mask_truncated: the critic skips them too
                returns = micro.per_token(ret_seq)
                v_loss = value_loss(v, v_old, returns, micro.loss_mask, args.vf_clip, mb.n_tokens)
                v_loss.backward()
                v_clipped = ((v - v_old).abs() > args.vf_clip).float() * micro.mask * (args.vf_clip > 0)
                stats.add(micro, loss, old, entropy, info, is_info, v_loss, v_clipped)
            common.optimizer_step(run, stats)  # policy and critic; a NaN/inf norm stops or skips the update

        # ---- guard, push, log, evaluate, checkpoint
        common.check_sampler(run, batch, stats)  # the trainer reproduces the sampler's log-probs
        run.engine.push()  # the updated weights into vLLM (wakes it); the HF engine samples the policy itself
        if args.push_check_every and (run.step + 1) % args.push_check_every == 0:
            run.engine.check_push(run.probe, args.push_check_tol)  # vLLM reproduces the trainer on a probe
        run.step += 1
        extra = {"value/mean": pre.values, "value/explained_var": explained_variance(pre.values, ret_seq)}
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
