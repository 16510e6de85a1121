"""Every logged metric of a step, named once for every script: the step's token-weighted sums over its
micro-batches (StepStats; summed over ranks by common.check_sampler), and the metrics over the global batch
(step_metrics), each equal to its 1-rank value on the same batch (docs/metrics.md)."""
import math
import time

import torch

from rlmini import faults, memstats, reward_model, runlog, tools
from rlmini.batches import Batch, Micro, PreUpdate
from rlmini.dist import all_gather, all_sum, local_slice, world_size


class StepStats:
    """A step's diagnostics: token-weighted sums over its micro-batches (then over ranks, in check_sampler)
    and its optimizer steps. The metrics they become are named here and in step_metrics, once for every
    script. The sums stay on the device in float64 (each value adds as .item() would give it, so the totals
    are the same to the bit) until check_sampler copies them to the host at once: on CUDA every .item() is a
    host sync, and add() would cost about ten per micro-batch."""

    def __init__(self):
        names = ["loss/policy", "entropy", "logprob/sampler_diff", "is/mean", "is/clip_frac", "is/kl",
                 "perf/computed", "perf/padded"]  # and clip_frac, kl, kl/old once a loss's info gives them
        self.sums = dict.fromkeys(names, 0.0)
        self.tokens, self.updates, self.skipped, self.grad_norm = 0.0, 0, 0, 0.0
        self.totals = {}

    def _add(self, name: str, value) -> None:
        self.sums[name] = self.sums.get(name, 0.0) + value.detach().double()

    def add(self, micro: Micro, loss, old, entropy, info: dict, is_info: dict | None = None, value_loss=None,
            value_clipped=None) -> None:
        """One micro-batch: its loss (this rank's share), pi_old and the entropies of its tokens, the
        surrogate's `info`, the rollout correction's `is_info` (without one, the is/* metrics measure the
        sampler's mismatch, nothing corrected: sampler_mismatch); PPO's value loss and clipped values. Each
        key of `info` is optional, its metric logged only when given: "clipped" (1 where the clipped branch
        is active: clip_frac), "ratio" (pi / pi_old: kl/old), "kl" (per-token KL to the reference: kl). An
        idle micro-batch (torchrun's repeat) adds nothing to the losses, whatever the loss made of it."""
        s, mask, add = self.sums, micro.mask, self._add
        s["perf/computed"] += micro.computed
        s["perf/padded"] += micro.padded
        self.tokens = self.tokens + mask.sum().double()
        if not micro.idle:  # a per-sequence loss of a repeat with zero masks need not be 0 (its gradient is)
            add("loss/policy", loss.detach().double() / world_size())  # this rank's share (FSDP2 averages)
        if "clipped" in info:
            add("clip_frac", (info["clipped"] * mask).sum())
        if "kl" in info:
            add("kl", (info["kl"] * mask).sum())
        if "ratio" in info:
            log_r = torch.log(info["ratio"].clamp(min=1e-30))
            add("kl/old", ((torch.exp(-log_r) + log_r - 1) * mask).sum())
        if micro.epoch == 0:  # once per rollout token: the sampler against pi_old
            add("entropy", (entropy * mask).sum())
            add("logprob/sampler_diff", ((micro.sampler_logp - old).abs() * mask).sum())
            if is_info is None:
                w, kl = sampler_mismatch(old, micro.sampler_logp, mask)
                is_info = {"w": w, "changed": torch.zeros_like(w), "kl": kl}
            for key, name in (("w", "is/mean"), ("changed", "is/clip_frac"), ("kl", "is/kl")):
                add(name, (is_info[key] * mask).sum())
            if micro.route_agree is not None:  # a mixture of experts with the sampler's routes
                add("moe/route_agree", micro.route_agree[0])
                add("moe/route_decisions", micro.route_agree[1])
        if value_loss is not None:  # the key on every rank, an idle one's too (all_sum of the same keys)
            add("value/loss", value_loss.detach().double() / world_size() * (not micro.idle))
            add("value/clip_frac", value_clipped.sum())


def sampler_mismatch(old_logp, sampler_logp, mask) -> tuple:
    """Per token, detached: w = pi_old / pi_sampler, the weight that undoes the sampler/trainer mismatch, and
    the k3 estimate of KL(sampler || pi_old), e^d - 1 - d with d = log w (Yao et al. 2025; Schulman 2020)."""
    log_w = ((old_logp - sampler_logp) * mask).detach()
    return torch.exp(log_w), torch.expm1(log_w) - log_w


def step_metrics(run, batch: Batch, pre: PreUpdate, stats: StepStats, advantages=None, extra=None) -> dict:
    """The step's metrics over the global batch: per-completion values gathered from every rank, and token
    sums over ranks, so each equals its 1-rank value on the same batch (docs/metrics.md); a metric that does
    not apply to the run is absent. `advantages`: one per completion (1-D, the global batch's or this rank's)
    or per token (this rank's, a list like batch.sampler_logp): advantage_metrics; None: no adv/* metrics.
    `extra`: the script's own metrics (global_means). Also writes --log_completions and warns about a
    collapsed policy."""
    now, t, G, tot = time.perf_counter(), run.times, run.args.group_size, stats.totals
    first = [all_gather(x) for x in batch.first]  # reward/* logs the first sampling round: the policy's rates
    rewards, lengths = all_gather(batch.rewards), all_gather(batch.lengths)
    finished = all_gather(torch.tensor(batch.rollouts.finished, dtype=torch.float32))
    first_groups = first[0].view(-1, G)
    stale = all_gather(batch.staleness)  # --async_steps: pushes between sampling and this update
    updates, n, tokens = stats.updates + stats.skipped, tot["first_pass_tokens"], tot["tokens"]
    adv_metrics, local_adv = (advantage_metrics(advantages, batch, rewards, run.task.pass_threshold)
                              if advantages is not None else ({}, None))
    metrics = {
        "reward/mean": first[0].mean().item(),
        "reward/std": first[0].std().item() if len(first[0]) > 1 else 0.0,
        "reward/correct": first[1].mean().item(), "reward/format": first[2].mean().item(),
        **{f"reward/{name}": first[3][:, j].mean().item() for j, name in enumerate(run.task.reward_names)},
        "frac_reward_zero_std": (first_groups.amax(1) == first_groups.amin(1)).float().mean().item(),  # TRL's
        "sampling/rounds": batch.rounds, "sampling/extra_rollouts": all_sum(batch.generated - len(batch)),
        **adv_metrics, "nonfinite/skipped": stats.skipped, "lr": run.scheduler.get_last_lr()[0],
        "len/mean": lengths.mean().item(), "len/truncated": 1.0 - finished.mean().item(),
        "rollout/staleness": stale.mean().item(), "rollout/staleness_max": stale.max().item(),  # pushes
        "time/rollout": t["update"] - t["start"], "time/update": t["update_end"] - t["update"],
        "time/push": now - t["push"],  # this rank's clock (rank 0 logs)
        "perf/tokens_per_s": tot["generated_tokens"] / (now - t["start"]),  # every rank's tokens
        "perf/pad_frac": tot["perf/padded"] / max(tot["perf/computed"], 1.0),  # the update's forwards
        "perf/update_tokens": tot["perf/computed"],
    }
    if updates:  # else a filter left nothing to update (filter/empty_updates)
        metrics["loss/policy"] = tot["loss/policy"] / updates
    if n:  # over the tokens the update computed (the kept completions'): none, none of these
        metrics.update({name: tot[name] / n for name in ("entropy", "logprob/sampler_diff", "is/mean",
                                                         "is/clip_frac", "is/kl")})
    # what the loss's info gave (StepStats.add): a KL term or a logged KL (the reference was loaded), ...
    metrics.update({k: tot[k] / tokens for k in ("kl/old", "clip_frac", "kl") if k in tot and tokens})
    if tot.get("moe/route_decisions"):  # (token, MoE layer) pairs where the trainer's top-k is the sampler's
        metrics["moe/route_agree"] = tot["moe/route_agree"] / tot["moe/route_decisions"]
    if batch.spread_on:  # a Keep resampling filter: the trained groups left without a spread
        trained = all_gather(getattr(batch, batch.spread_on)).view(-1, G)
        metrics["sampling/kept_zero_std"] = (trained.amax(1) == trained.amin(1)).float().mean().item()
    if batch.filtered:  # common.keep_completions: the share of completions and of groups it kept
        kept = all_gather(batch.kept).view(-1, G)
        metrics.update({"filter/kept_frac": kept.mean().item(),
                        "filter/kept_groups": (kept.amax(1) > 0).float().mean().item(),
                        "filter/empty_updates": batch.empty_updates})
    if stats.updates:  # else every optimizer step was skipped (--on_nonfinite skip)
        metrics["grad_norm"] = stats.grad_norm / stats.updates
    if not math.isnan(pre.tau):  # --top_entropy_quantile < 1
        metrics["entropy/threshold"] = pre.tau
    metrics.update(memstats.metrics(run.times, run.plan, run.engine))  # CUDA: each phase's peak memory
    runlog.first_step(t, now)  # the start-up's last line
    if "value/loss" in tot:  # PPO's critic
        metrics["value/loss"] = tot["value/loss"] / updates
        metrics["value/clip_frac"] = tot["value/clip_frac"] / tot["tokens"]
    if batch.rollouts.tool_stats is not None:  # --tools
        metrics.update(tool_metrics(batch.rollouts))
    metrics.update(task_counts(run.task))  # rg: task/scorer_errors
    metrics.update(reward_model.source_metrics(run.task))  # reward/rm_raw_mean, judge/* (all ranks)
    metrics.update(global_means(extra or {}))
    faults.warn_on_collapse(run, metrics)  # no gradient or no entropy for several steps in a row
    faults.check_skipped(run, stats)  # every update skipped for several steps in a row: stop
    runlog.log_completions(run, batch.examples, batch.rollouts, batch.rewards, batch.correct, batch.fmt,
                           local_adv, run.args.log_completions, batch.kept if batch.filtered else None)
    return metrics


def advantage_metrics(advantages, batch: Batch, rewards, threshold: float) -> tuple:
    """(adv/* over the global batch, this rank's one advantage per completion for --log_completions).
    Per completion (1-D: the global batch's, all_gather's order, or this rank's): means over completions,
    adv/failed_pos_frac the share of failed completions (reward < threshold; `rewards`: the global batch's)
    with a positive advantage. Per token (a list of this rank's 1-D tensors, like batch.sampler_logp): means
    over every rank's tokens, adv/failed_pos_frac the share of failed completions' tokens with a positive
    advantage, a completion's own its token mean. adv/failed_pos_frac is absent when nothing failed."""
    if isinstance(advantages, (list, tuple)):
        failed = (batch.rewards < threshold).tolist()
        none = [torch.zeros(0, dtype=torch.float64)]
        a = [x.detach().cpu().double().flatten() for x in advantages]
        flat, bad = torch.cat(a + none), torch.cat([x for x, f in zip(a, failed) if f] + none)
        s = all_sum({"n": flat.numel(), "sum": flat.sum(), "abs": flat.abs().sum(), "failed": bad.numel(),
                     "failed_pos": (bad > 0).sum()})
        out = {"adv/mean": s["sum"] / max(s["n"], 1), "adv/abs_mean": s["abs"] / max(s["n"], 1)}
        if s["failed"]:
            out["adv/failed_pos_frac"] = s["failed_pos"] / s["failed"]
        return out, torch.stack([x.detach().cpu().sum() / max(len(x), 1) for x in advantages])
    if len(advantages) == len(batch) and world_size() > 1:  # this rank's: gather the global batch's
        advantages = all_gather(advantages)
    if len(advantages) != len(rewards):
        raise ValueError(f"step_metrics: {len(advantages)} advantages for a global batch of {len(rewards)} "
                         f"completions: give one per completion (this rank's or all) or a list per token")
    failed = rewards < threshold
    out = {"adv/mean": advantages.mean().item(), "adv/abs_mean": advantages.abs().mean().item()}
    if failed.any():
        out["adv/failed_pos_frac"] = (advantages[failed] > 0).float().mean().item()
    return out, advantages[local_slice(len(batch))]


def global_means(extra: dict) -> dict:
    """A script's own metrics, summed over ranks in one all-reduce: a number is logged as it is (the script
    made it global), a tensor or a list of tensors (this rank's values) as the mean of its elements over every
    rank's, a (sum, count) pair (this rank's) as the sum over ranks / the count over ranks. None, or a mean of
    nothing, is left out: a metric that does not apply is absent, not NaN."""
    out, sums = {}, {}
    for name, v in extra.items():
        if isinstance(v, (torch.Tensor, list)):
            x = torch.cat([t.detach().double().flatten().cpu() for t in ([v] if torch.is_tensor(v) else v)]
                          + [torch.zeros(0, dtype=torch.float64)])
            v = (x.sum(), x.numel())
        if isinstance(v, tuple):
            sums[(name, "count")], sums[(name, "sum")] = v[1], v[0]
        elif v is not None:
            out[name] = v
    sums = all_sum(sums) if sums else {}
    out.update({name: sums[(name, "sum")] / sums[(name, "count")] for name, what in sums
                if what == "sum" and sums[(name, "count")]})
    return out


def tool_metrics(rollouts) -> dict:
    """--tools: calls, turns, errors, time-outs, tool time and the tool's share of the tokens, over the global
    batch (per trajectory; rates per call)."""
    per = all_gather(torch.tensor([[st[k] for k in tools.STATS] for st in rollouts.tool_stats],
                                  dtype=torch.float64))
    st = dict(zip(tools.STATS, per.T))
    calls, tokens = st["calls"].sum().item(), all_sum(float(sum(len(c) for c in rollouts.completion_ids)))
    return {"tools/calls": st["calls"].mean().item(),
            "tools/call_frac": (st["calls"] > 0).double().mean().item(),
            "tools/turns": st["turns"].mean().item(),
            **({"tools/success_rate": 1 - st["errors"].sum().item() / calls} if calls else {}),
            "tools/errors": st["errors"].sum().item(), "tools/timeouts": st["timeouts"].sum().item(),
            "tools/raised": st["raised"].sum().item(),
            "tools/seconds": st["seconds"].sum().item(), "tools/turn_limit": st["turn_limit"].mean().item(),
            "tools/token_frac": st["tool_tokens"].sum().item() / max(tokens, 1.0)}


def task_counts(task) -> dict:
    """The task's own counters (rewards.Task.stats; rg: task/scorer_errors) since the last step, summed over
    ranks, then reset: what every scoring on this rank counted (the step's rollouts, a script's own
    common.generate calls; evaluation takes its own out, eval.py::evaluate)."""
    if not task.stats:
        return {}
    totals = all_sum(dict(task.stats))
    task.stats.update(dict.fromkeys(task.stats, 0))
    return totals
