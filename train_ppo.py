"""PPO (Schulman et al. 2017) for language models in one file: GRPO's loop with a learned value model
(a transformers backbone and a scalar head) and GAE (Schulman et al. 2016) in place of the group
baseline; clipped value loss; the critic has its own learning rate and optional warm-up steps.

    python train_ppo.py --group_size 1                        # classic PPO: one completion per prompt
    python train_ppo.py --task calibration                    # Bereket & Leskovec 2025: PPO stays calibrated
    python train_ppo.py --model Qwen/Qwen2.5-0.5B-Instruct --task gsm8k --lr 1e-6 --max_new_tokens 512
"""
import time
from dataclasses import dataclass
from typing import Literal

import torch

import common
from common import arg
from eval import evaluate


@dataclass
class Args(common.Args):
    gamma: float = arg(1.0, "discount (1 in Bereket & Leskovec's runs: A_t = R - V(s_t) with lam 1)")
    lam: float = arg(1.0, "GAE lambda (1 = unbiased Monte-Carlo advantage)")
    critic_model: str = arg("", "value model backbone (default: initialised from the policy)")
    critic_lr: float = arg(0.0, "critic learning rate (0 = 10 x lr, as 1e-5 vs 1e-6 in Bereket & Leskovec 2025)")
    vf_clip: float = arg(0.2, "value clip range around the old values (0 = off)")
    critic_warmup: int = arg(0, "first steps train only the critic")
    whiten_advantages: bool = arg(False, "batch-normalise advantages (verl's default; biased)")
    loss_agg: Literal["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"] = arg(
        "seq-mean-token-mean", "loss aggregation: GRPO | DAPO | Dr. GRPO")
    clip_eps: float = arg(0.2, "PPO clip range below 1 (and above, unless clip_eps_high is set)")
    clip_eps_high: float = arg(0.0, "clip range above 1; DAPO clip-higher uses 0.28 (0 = clip_eps)")
    ratio_level: Literal["token", "sequence"] = arg("token", "importance ratio per token, or GSPO's per sequence")
    beta: float = arg(0.0, "k3 KL penalty to the initial policy (0 = no reference model is loaded)")

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
    """(A - mean) / sqrt(var + eps) over the tokens of the global batch (every rank's), in float64: a
    constant batch gives exactly 0 (its mean is exact), and a tiny variance is not blown up into unit advantages."""
    a = advantages.double()
    mean, var = common.all_mean_var(a[mask > 0])
    return ((a - mean) * (var + eps) ** -0.5 * mask).to(advantages.dtype)


def load_critic(path, device, dtype, args):
    """Value model: a transformers backbone with a scalar head on every position (token classification
    with one label; the head zero-initialised, V = 0 at start, and no dropout: it regresses). A model of its
    own, not the policy's: with --lora_rank, its own frozen copy of the base in `dtype` with its own adapters,
    the head trained in full (fp32)."""
    from transformers import AutoModelForTokenClassification
    critic = AutoModelForTokenClassification.from_pretrained(path, num_labels=1,
                                                             dtype=dtype if args.lora_rank else torch.float32)
    head_name, head = [(n, m) for n, m in critic.named_modules() if isinstance(m, torch.nn.Linear)
                       and m.out_features == 1][-1]
    torch.nn.init.zeros_(head.float().weight), head.bias is not None and torch.nn.init.zeros_(head.bias)
    critic = common.prepare_for_training(critic, args.gradient_checkpointing, args.packing)
    if args.lora_rank:
        critic = common.add_lora(critic, args, extra_trainable=[head], exclude=[head_name])
    return critic.to(device)


def critic_values(critic, batch):
    """V(s_t) for every position, [B, T-1] aligned with batch["mask"] (state before token t+1)."""
    out, pick = common.model_forward(critic, batch)  # packed or padded: pick takes the positions before each token
    return common.to_batch_layout(pick(out.logits)[:, 0].float(), batch)


def value_loss(values, old_values, returns, mask, vf_clip, n_tokens):
    """Clipped value loss (PPO2, as in verl): 0.5 max((V - R)^2, (clip(V, V_old +- eps) - R)^2), token-mean."""
    loss = (values - returns) ** 2
    if vf_clip > 0:
        clipped = old_values + (values - old_values).clamp(-vf_clip, vf_clip)
        loss = torch.max(loss, (clipped - returns) ** 2)
    return 0.5 * (loss * mask).sum() / n_tokens


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
    adv = advantages  # per token (GAE)
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


def explained_variance(values, returns):
    """1 - Var(R - V) / Var(R) over the tokens of the global batch (every rank's)."""
    v, r = torch.cat(values).cpu().double(), torch.cat(returns).cpu().double()
    var_r, var_residual = common.all_mean_var(r)[1], common.all_mean_var(r - v)[1]
    return 1 - var_residual / var_r if var_r > 0 else float("nan")


# ---------------------------------------------------------------------------------------------- training


def main(argv=None):
    args = common.parse_args(Args, argv)
    run = common.setup(args, algo="ppo")
    model, tok, device, dtype = run.model, run.tokenizer, run.device, run.dtype
    critic = common.shard_model(load_critic(args.critic_model or run.model_path, device, dtype, args),
                                dtype)  # torchrun: FSDP2, as the policy
    critic_opt = torch.optim.AdamW(common.trainable_parameters(critic), lr=args.critic_lr or 10 * args.lr,
                                   weight_decay=args.weight_decay, fused=True)
    if args.resume:  # the value model and its optimizer come back from the checkpoint
        common.restore(run, "critic", critic, critic_opt)
    run.algo_state["critic"] = (critic, critic_opt)  # checkpointed with the policy
    ref_model = None
    if args.beta > 0:  # frozen copy of the initial policy (after --resume: of the base model)
        ref_model = common.load_reference(args, run.task, device, dtype, model)  # LoRA: adapters off

    while run.step < args.steps:
        step_start = time.perf_counter()
        # ---- rollout: G completions for each prompt, sampled by the engine from the weights it was last pushed
        examples, run.data_pos = common.prompt_batch(run.task.train, run.data_pos, args.prompts_per_step, args.seed)
        examples = common.shard(examples)
        prompt_ids = common.encode_prompts(tok, [e["prompt"] for e in examples], run.style == "chat")
        t0 = time.perf_counter()
        rollouts = common.generate(run.engine, model, prompt_ids, args.group_size, run.max_new_tokens, args.temperature,
                                   common.rollout_seed(args.seed, run.step, common.rank()), device, dtype)
        common.engine_sleep(run.engine)  # CUDA vLLM: free its memory for the update (level 2: weights discarded)
        time_rollout = time.perf_counter() - t0
        rewards, correct, fmt, scores = common.score_rollouts(run.task, tok, examples, rollouts, args.group_size)
        rewards = rewards + args.format_weight * fmt  # optional format bonus, in the reward only
        rewards = rewards + common.overlong_penalty(rollouts, run.max_new_tokens, args.overlong_buffer,
                                                   args.overlong_penalty)  # DAPO eq. 13, reward only
        common.check_rewards(rewards, examples, args.group_size, run.step + 1, args.on_nonfinite)  # NaN/inf: stop or skip

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
        old_logp, ref_logp, old_entropy, old_values = [None] * B, [None] * B, [None] * B, [None] * B
        with torch.no_grad():
            for s in range(0, B, micro):
                idx = list(range(s, min(s + micro, B)))
                batch = common.rollout_batch(rollouts, idx, device)
                with common.autocast(device, dtype):
                    old_values[s:s + len(idx)] = common.to_ragged(critic_values(critic, batch), batch["mask"])
                if not on_policy or top_entropy:  # pi_old, recomputed by the trainer (not the sampler's values)
                    batch, logp, entropy = common.rollout_logprobs(model, rollouts, idx, args.temperature, device, dtype,
                                                                   with_entropy=top_entropy)
                    old_logp[s:s + len(idx)] = common.to_ragged(logp, batch["mask"])
                    if top_entropy:
                        old_entropy[s:s + len(idx)] = common.to_ragged(entropy, batch["mask"])
                if ref_model is not None:
                    batch, logp, _ = common.rollout_logprobs(ref_model, rollouts, idx, args.temperature, device, dtype)
                    ref_logp[s:s + len(idx)] = common.to_ragged(logp, batch["mask"])

        # ---- advantages: GAE on the pre-update values, per token
        padded_values = torch.nn.utils.rnn.pad_sequence([v.cpu() for v in old_values], batch_first=True)
        lengths_mask = (torch.arange(padded_values.shape[1]) < lengths[:, None]).float()
        token_adv, returns = compute_advantages(rewards, padded_values, lengths_mask, args.gamma, args.lam)
        if args.whiten_advantages:
            token_adv = whiten(token_adv, lengths_mask)  # over every rank's tokens
        adv_seq = common.to_ragged(token_adv, lengths_mask)
        ret_seq = common.to_ragged(returns, lengths_mask)
        advantages = (token_adv.sum(1) / lengths)  # per completion, for the shared adv/* metrics
        rewards_all, advantages_all = common.all_gather(rewards), common.all_gather(advantages)
        # Wang et al. 2025 ("Beyond the 80/20 rule"): the loss keeps only the tokens whose entropy under pi_old is in
        # the top rho share of the global batch's tokens (of the completions in the loss)
        tau = common.top_share_threshold([old_entropy[i] for i in range(B) if keep[i]],
                                         args.top_entropy_quantile) if top_entropy else float("nan")

        sums = {"loss/policy": 0.0, "clip_frac": 0.0, "kl": 0.0, "kl/old": 0.0, "entropy": 0.0,
                "logprob/sampler_diff": 0.0, "is/mean": 0.0, "is/clip_frac": 0.0, "is/kl": 0.0,
                "perf/computed": 0.0, "perf/padded": 0.0,
                "value/loss": 0.0, "value/clip_frac": 0.0}
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
                    token_loss, stats = policy_loss(logp, old, ref, common.to_padded(adv_seq, idx, mask), loss_mask, args,
                                                    is_weight)
                    if top_entropy:  # only the high-entropy ("forking") tokens; the normalisers stay (Wang et al. 2025)
                        token_loss = token_loss * (common.to_padded(old_entropy, idx, mask) >= tau)
                    if args.entropy_coef:  # entropy bonus, its gradient through the chunked projection
                        token_loss = token_loss - args.entropy_coef * entropy
                    loss = aggregate(token_loss, loss_mask, args.loss_agg, n_seqs, n_tokens, run.max_new_tokens)
                    if run.step >= args.critic_warmup:  # during critic warm-up the policy stays put
                        loss.backward()
                    with common.autocast(device, dtype):
                        values = critic_values(critic, batch)
                    v_old = common.to_padded(old_values, idx, mask)
                    v_loss = value_loss(values, v_old, common.to_padded(ret_seq, idx, mask), loss_mask, args.vf_clip,
                                        n_tokens)  # --mask_truncated: the critic skips them too
                    v_loss.backward()
                    sums["value/loss"] += v_loss.item() / common.world_size()  # as loss/policy
                    v_clipped = ((values - v_old).abs() > args.vf_clip).float() * mask
                    sums["value/clip_frac"] += v_clipped.sum().item() if args.vf_clip else 0.0
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
                critic_norm = common.clip_grad_norm(critic, args.grad_clip)
                if common.nonfinite(grad_norm + critic_norm, "policy or value gradient norm", run.step + 1,
                                    args.on_nonfinite):  # NaN/inf: stop, or skip this update
                    run.optimizer.zero_grad(set_to_none=True)
                    critic_opt.zero_grad(set_to_none=True)
                    n_skipped += 1
                    continue
                run.optimizer.step()
                run.scheduler.step()
                critic_opt.step()
                run.optimizer.zero_grad(set_to_none=True)
                critic_opt.zero_grad(set_to_none=True)
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
        correct_all, fmt_all, lengths_all = common.all_gather(correct), common.all_gather(fmt), common.all_gather(lengths)
        parts_all = common.all_gather(common.reward_parts(scores, run.task.reward_names))  # --reward, each function
        finished_all = common.all_gather(torch.tensor(rollouts.finished, dtype=torch.float32))
        failed = rewards_all < run.task.pass_threshold
        metrics = {
            "reward/mean": rewards_all.mean().item(), "reward/std": rewards_all.std().item() if len(rewards_all) > 1 else 0.0,
            "reward/correct": correct_all.mean().item(), "reward/format": fmt_all.mean().item(),
            **{f"reward/{name}": parts_all[:, j].mean().item() for j, name in enumerate(run.task.reward_names)},
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
            "value/loss": totals["value/loss"] / (n_opt_steps + n_skipped), "value/clip_frac": totals["value/clip_frac"] / totals["tokens"],
            "value/mean": common.all_mean_var(torch.cat(old_values))[0],
            "value/explained_var": explained_variance(old_values, ret_seq),
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
