"""GRPO (Shao et al. 2024, DeepSeekMath) in one file, with the switches the follow-up papers argue about:
std normalisation on or off (off = Dr. GRPO, Liu et al. 2025), the loss aggregation, DAPO's clip-higher,
GSPO's sequence-level ratio, an optional k3 KL penalty to a frozen reference, and HA-DW reweighting.

    python train_grpo.py                                      # built-in tiny model on `addition` (CPU ok)
    python train_grpo.py --task calibration --std_norm false  # Bereket & Leskovec 2025: calibrated without the std
    python train_grpo.py --model Qwen/Qwen2.5-0.5B-Instruct --task gsm8k --lr 1e-6 --max_new_tokens 512
"""
import time
from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np
import torch

import common
from common import arg
from eval import evaluate


@dataclass
class Args(common.Args):
    std_norm: bool = arg(True, "divide advantages by the group std (false = Dr. GRPO)")
    std_level: Literal["group", "batch"] = arg("group", "std over each group, or REINFORCE++-baseline's over the batch")
    adv_eps: float = arg(1e-6, "epsilon added to the group std (verl 1e-6; Bereket & Leskovec's code 1e-5)")
    loss_agg: Literal["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"] = arg(
        "seq-mean-token-mean", "loss aggregation: GRPO | DAPO | Dr. GRPO")
    clip_eps: float = arg(0.2, "PPO clip range below 1 (and above, unless clip_eps_high is set)")
    clip_eps_high: float = arg(0.0, "clip range above 1; DAPO clip-higher uses 0.28 (0 = clip_eps)")
    ratio_level: Literal["token", "sequence"] = arg("token", "importance ratio per token, or GSPO's per sequence")
    surrogate: Literal["clip", "cispo"] = arg("clip", "PPO's clipped ratio, or CISPO's clipped detached weight x log pi")
    beta: float = arg(0.0, "k3 KL penalty to the initial policy (0 = no reference model is loaded)")
    hadw: bool = arg(False, "HA-DW difficulty reweighting of the advantages (arXiv 2601.08521; binary rewards)")
    hadw_eta: float = arg(0.1, "HA-DW forgetting rate eta (eta_t = eta * std of recent anchors)")
    hadw_window: int = arg(50, "HA-DW: anchors in the std window (m)")
    hadw_lambda: float = arg(1.3, "HA-DW lambda_scale (the paper's best, Table 7)")
    hadw_anchor: Literal["kalman", "mean"] = arg("kalman", "HA-DW anchor: sec. 3 Kalman update | app. F moving mean")
    dynamic_sampling: bool = arg(False, "DAPO: drop groups whose completions all got the same outcome, sample more")
    max_sampling_rounds: int = arg(20, "dynamic sampling: most sampling rounds per step (then the batch is topped up)")
    min_group_size: ClassVar[int] = 2  # the group baseline needs two completions of a prompt


# ---------------------------------------------------------------------------------------------- advantages


def compute_advantages(rewards, group_size, std_norm=True, eps=1e-6, std_level="group"):
    """GRPO: A_i = (r_i - mean(r)) / (std(r) + eps) within each group of G completions of a prompt
    (Shao et al. 2024, sec. 4.1.2; unbiased std as in Bereket & Leskovec's code). Without the std it
    is Dr. GRPO's r_i - mean(r), proportional to an unbiased estimate (Bereket & Leskovec 2025, App. A.1).
    std_level="batch": REINFORCE++-baseline (Hu et al. 2025, sec. 3): the group-centred values divided by
    their std over the whole batch (their batch mean is 0), not the std of the raw rewards (TRL's "batch")."""
    r = rewards.double().view(-1, group_size)  # float64: an all-equal group's mean is exact, so its A is exactly 0
    advantages = r - r.mean(dim=1, keepdim=True)
    if std_norm and std_level == "group":
        advantages = advantages / (r.std(dim=1, keepdim=True) + eps)
    elif std_norm:  # one std for every completion of the (global) batch
        advantages = advantages / (advantages.std() + eps)
    return advantages.flatten().to(rewards.dtype)


def hadw_reweight(rewards, advantages, group_size, state, eta, window, lam, anchor="kalman"):
    """HA-DW (arXiv 2601.08521, 2026): A_i * Phi_i with Phi_i = lam * exp(D_i * M), D_i = -sign(A_i)
    sign(p_hat - C), M = |p_hat - C|, C the cross-batch difficulty anchor; updates `state`.

    Hard prompt (group accuracy p_hat below the anchor): correct answers are boosted, wrong ones
    damped; easy prompt: the reverse. Binary rewards (y_t = batch accuracy). Anchor update (sec. 3):
    C+ = (1 - eta_t) C- + eta_t y_t, eta_t = clamp(eta * std(last `window` anchors), 0, 1). Cold start
    (the paper leaves it open; read literally a constant window freezes the anchor): the first prior
    is y_1, and eta_t = eta while the window holds fewer than 2 distinct anchors. anchor="mean" is the
    paper's appendix F variant: C_t^- = mean of the last m batch accuracies.
    """
    y = rewards.float().mean().item()
    prior = y if state.get("anchor") is None else state["anchor"]  # C_t^-
    if anchor == "mean":  # appendix F: the anchor is a moving average of recent batch accuracies
        prior = float(np.mean(state["accuracies"])) if state.get("accuracies") else y
        state["accuracies"] = (state.get("accuracies", []) + [y])[-window:]
    p_hat = rewards.float().view(-1, group_size).mean(1, keepdim=True).expand(-1, group_size).flatten()
    diff = p_hat - prior
    phi = lam * torch.exp(-torch.sign(advantages) * torch.sign(diff) * diff.abs())  # a constant: no gradient
    history = state.get("history", [])[-window:]  # the last m posterior anchors
    sigma = float(np.std(history)) if len(history) >= 2 else 0.0  # population std
    eta_t = min(max(eta * sigma, 0.0), 1.0) if sigma > 0 else eta
    posterior = (1 - eta_t) * prior + eta_t * y  # C_t^+, the next prior
    state.update(anchor=posterior, history=(history + [posterior])[-window:])
    hard, easy = diff < 0, diff > 0
    info = {"hadw/anchor": prior, "hadw/eta": eta_t,
            "hadw/phi_hard": phi[hard].mean().item() if hard.any() else float("nan"),
            "hadw/phi_easy": phi[easy].mean().item() if easy.any() else float("nan")}
    return advantages * phi, info


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
    """Per-token clipped surrogate (Schulman et al. 2017, eq. 7) or CISPO's, optionally with GSPO's sequence
    ratio and a k3 KL; `is_weight` (rollout correction) multiplies the policy-gradient term, not the KL."""
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
    if args.surrogate == "cispo":  # CISPO (MiniMax 2025, eq. 4-5): sg(min(r, 1 + eps_high)) A log pi; no lower bound
        weight = torch.clamp(ratio, max=1 + eps_high).detach()  # (the paper sets eps_low^IS large), so a clipped
        token_loss = -weight * adv * logp  # token keeps its gradient, with a truncated weight
        stats["clipped"] = (ratio > 1 + eps_high).float()
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
    run = common.setup(args, algo="grpo")
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
        advantages_all = compute_advantages(rewards_all, args.group_size, args.std_norm, args.adv_eps,
                                            args.std_level)
        if args.hadw:  # HA-DW (arXiv 2601.08521): reweight by difficulty against the cross-batch anchor
            advantages_all, hadw_info = hadw_reweight(rewards_all, advantages_all, args.group_size, run.algo_state.
                                                      setdefault("hadw", {}), args.hadw_eta, args.hadw_window,
                                                      args.hadw_lambda, args.hadw_anchor)
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
        metrics.update(hadw_info if args.hadw else {})
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
