"""Seed 000's synthetic experiment (Bereket & Leskovec 2025, sec. 3.3; Tables 1 and 2), run with the
advantage and loss functions of our trainers: train_grpo.py, train_rloo.py and train_ppo.py, imported.

The "language model" is a 20 x 99 logit table: category -> one token meaning a probability 0.01..0.99.
10,000 questions (numpy default_rng(2): category, then the 20 category rates, then one outcome per
question; this order reproduces the published accuracy 0.7514 exactly), log-likelihood reward, every
step samples every question, AdamW lr 3e-3, torch seed 0, as the authors' notebook did.

    python reproduce/seed000_tabular.py                          # all 13 rows, 50,000 gradient steps each
    python reproduce/seed000_tabular.py --steps 5000 --rows on   # on-policy rows only, shorter

Off-policy rows take `updates` gradient steps per rollout with the clipped surrogate, and the clip is
applied (the notebook computed the clipped loss and then overwrote it with the unclipped one). Every row
takes the same number of gradient steps, so an off-policy row samples steps / updates rollouts (neither
the paper nor the notes say which of the two its 50,000 steps counted).
"""
import argparse
import multiprocessing
import os
import sys
import time
import types
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402
import train_grpo  # noqa: E402
import train_ppo  # noqa: E402
import train_rloo  # noqa: E402
from eval import auroc, expected_calibration_error, write_results  # noqa: E402

N_QUESTIONS, N_CATEGORIES, N_TOKENS = 10_000, 20, 99
TOKEN_PROB = torch.arange(1, N_TOKENS + 1, dtype=torch.float32) / 100  # token k means probability (k+1)/100

# (algorithm, gradient steps per rollout, clip eps) -> published (ECE, AUROC, accuracy). On-policy rows:
# Table 1 at 4 digits as in ../shared/notes/algorithms.md; off-policy rows: Table 2 (3 digits).
PUBLISHED = {
    ("grpo", 1, None): (0.2386, 0.7504, 0.7514), ("grpo_nostd", 1, None): (0.0019, 0.8228, 0.7514),
    ("rloo", 1, None): (0.0020, 0.8229, 0.7514), ("ppo", 1, None): (0.0052, 0.8229, 0.7514),
    ("reinforce", 1, None): (0.0053, 0.8228, 0.7514),
    ("grpo", 10, 0.2): (0.239, 0.751, 0.751), ("grpo", 10, 0.001): (0.239, 0.751, 0.751),
    ("grpo_nostd", 10, 0.2): (0.005, 0.823, 0.751), ("grpo_nostd", 10, 0.001): (0.005, 0.823, 0.751),
    ("ppo", 10, 0.2): (0.008, 0.823, 0.751), ("ppo", 10, 0.001): (0.008, 0.823, 0.751),
    ("rloo", 10, 0.2): (0.004, 0.823, 0.751), ("rloo", 10, 0.001): (0.004, 0.823, 0.751),
}
GROUP_SIZE = {"grpo": 10, "grpo_nostd": 10, "rloo": 10, "ppo": 1, "reinforce": 1}  # rollouts per question
NAMES = {"grpo": "GRPO", "grpo_nostd": "GRPO (no std)", "rloo": "RLOO", "ppo": "PPO",
         "reinforce": "REINFORCE"}


def make_data(seed: int = 2):
    """(categories [Q], outcomes [Q], true rates [20]) in the notebook's draw order."""
    rng = np.random.default_rng(seed)
    categories = rng.integers(0, N_CATEGORIES, N_QUESTIONS)
    p_true = rng.uniform(0, 1, N_CATEGORIES)
    outcomes = rng.binomial(1, p_true[categories])
    return torch.as_tensor(categories), torch.as_tensor(outcomes, dtype=torch.float32), p_true


def sample_tokens(logits, categories, n, generator):
    """n tokens per question from its category's row: inverse CDF of softmax(logits[c])."""
    cdf = torch.softmax(logits.detach(), -1).cumsum(-1)[categories]
    u = torch.rand(len(categories), n, generator=generator)
    return torch.searchsorted(cdf, u).clamp(max=N_TOKENS - 1)


def log_likelihood_reward(tokens, outcomes):
    """r = a log q + (1 - a) log(1 - q) (seed 000 sec. 3.1)."""
    q = TOKEN_PROB[tokens]
    return torch.where(outcomes.bool(), q.log(), (-q).log1p())


def advantages(algo, rewards, values, group_size):
    """Each trainer's own estimator; rewards [Q * G] grouped by question, values [Q * G] (PPO only)."""
    if algo == "grpo":  # seed 000's notebook: unbiased std, eps 1e-5
        return train_grpo.compute_advantages(rewards, group_size, std_norm=True, eps=1e-5)
    if algo == "grpo_nostd":
        return train_grpo.compute_advantages(rewards, group_size, std_norm=False)
    if algo == "rloo":  # G - 1 as in the paper's eq. (Kool 2019); the notebook divided by G
        return train_rloo.compute_advantages(rewards, group_size)
    if algo == "ppo":  # GAE with gamma = lam = 1 over a one-token answer: A = r - V(category)
        ones = torch.ones(len(rewards), 1)
        return train_ppo.compute_advantages(rewards, values.unsqueeze(1), ones)[0].squeeze(1)
    if algo == "reinforce":
        return rewards
    raise ValueError(f"unknown algorithm {algo!r}")


def aggregate_by_token(cells, advantages):
    """The clipped surrogate is linear in A for a fixed sign of A, and every sample in a (category, token)
    cell has the same ratio, so summing positive and negative advantages per cell gives the same loss and
    gradient as the 100,000 per-sample terms (tests/test_reproduce.py checks it). Returns the cell index of
    each entry, its summed advantage and its number of samples."""
    n_cells = N_CATEGORIES * N_TOKENS
    pos, neg = advantages.clamp(min=0), advantages.clamp(max=0)
    sums = torch.cat([torch.zeros(n_cells).index_add_(0, cells, pos),
                      torch.zeros(n_cells).index_add_(0, cells, neg)])
    counts = torch.cat([torch.zeros(n_cells).index_add_(0, cells, (advantages > 0).float()),
                        torch.zeros(n_cells).index_add_(0, cells, (advantages < 0).float())])
    keep = counts > 0
    return torch.arange(2 * n_cells)[keep] % n_cells, sums[keep], counts[keep]


def surrogate_loss(module, logits, old_logp, cell, adv, n_samples, clip_eps):
    """The trainer's policy_loss and aggregate ('token-mean' over the n_samples one-token answers)."""
    logp = torch.log_softmax(logits, -1).flatten()[cell].unsqueeze(1)
    mask = torch.ones_like(logp)
    hp = types.SimpleNamespace(ratio_level="token", clip_eps=clip_eps, clip_eps_high=0.0, surrogate="clip")
    adv = adv.unsqueeze(1) if module is train_ppo else adv  # PPO's advantages are per token
    token_loss, stats = module.policy_loss(logp, old_logp[cell].unsqueeze(1), None, adv, mask, hp)
    return common.aggregate(token_loss, mask, "token-mean", n_samples, n_samples, 1), stats


def evaluate(logits, categories, outcomes, generator, n_samples: int = 100):
    """Prediction per question = mean of n sampled probabilities (the notebook's protocol)."""
    tokens = sample_tokens(logits, categories, n_samples, generator)
    probs = TOKEN_PROB[tokens].mean(1).numpy().astype(np.float64)
    labels = outcomes.numpy().astype(int)
    return {"ece": expected_calibration_error(probs, labels), "auroc": auroc(probs, labels),
            "accuracy": float(np.mean((probs > 0.5) == (labels == 1))), "probs": probs.tolist()}


def expected_ece(logits, categories, outcomes):
    """ECE of the exact mean prediction (no sampling), cheap enough to log during training."""
    mean_pred = (torch.softmax(logits.detach(), -1) @ TOKEN_PROB)[categories].double().numpy()
    return expected_calibration_error(mean_pred, outcomes.numpy().astype(int))


def train(algo: str, updates: int = 1, clip_eps: float | None = None, steps: int = 50_000, seed: int = 0,
          data_seed: int = 2, lr: float = 3e-3, critic_lr: float = 1e-5, log_every: int = 1000) -> dict:
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    categories, outcomes, _ = make_data(data_seed)
    G = GROUP_SIZE[algo]
    module = {"rloo": train_rloo, "ppo": train_ppo}.get(algo, train_grpo)
    cat_rep, out_rep = categories.repeat_interleave(G), outcomes.repeat_interleave(G)  # grouped by question
    logits = torch.zeros(N_CATEGORIES, N_TOKENS, requires_grad=True)
    opt = torch.optim.AdamW([logits], lr=lr)  # torch defaults otherwise (weight_decay 0.01), as the notebook
    values = torch.zeros(N_CATEGORIES, requires_grad=True)  # PPO's value model: one scalar per category
    critic_opt = torch.optim.AdamW([values], lr=critic_lr)
    ones = torch.ones(len(cat_rep), 1)  # the mask of one-token answers, for PPO's value loss
    history, t0 = [], time.time()
    for step in range(1, steps // updates + 1):  # one rollout per step; `updates` gradient steps each
        tokens = sample_tokens(logits, categories, G, generator).flatten()
        rewards = log_likelihood_reward(tokens, out_rep)
        old_values = values.detach()[cat_rep] if algo == "ppo" else None
        adv = advantages(algo, rewards, old_values, G)  # from the pre-step value (PPO)
        cell, adv_sum, count = aggregate_by_token(cat_rep * N_TOKENS + tokens, adv)
        old_logp = torch.log_softmax(logits.detach(), -1).flatten()
        clipped = 0.0
        for _ in range(updates):
            loss, stats = surrogate_loss(module, logits, old_logp, cell, adv_sum, len(rewards),
                                         clip_eps or 0.0)
            opt.zero_grad()
            loss.backward()
            opt.step()
            clipped += float((stats["clipped"].squeeze(1) * count).sum()) / len(rewards) / updates
            if algo == "ppo":  # one MSE step per gradient step on the policy; returns = r (gamma = lam = 1)
                v_loss = train_ppo.value_loss(values[cat_rep].unsqueeze(1), old_values.unsqueeze(1),
                                              rewards.unsqueeze(1), ones, 0.0, len(rewards))
                critic_opt.zero_grad()
                v_loss.backward()
                critic_opt.step()
        if (step * updates) % log_every == 0 or step == steps // updates:
            history.append({"step": step * updates, "reward": float(rewards.mean()), "clipfrac": clipped,
                            "ece": expected_ece(logits, categories, outcomes), "seconds": time.time() - t0})
    result = evaluate(logits, categories, outcomes, generator)
    result.update(algo=algo, updates=updates, clip_eps=clip_eps, steps=steps, seed=seed, history=history,
                  labels=outcomes.int().tolist(), seconds=time.time() - t0,
                  published=PUBLISHED.get((algo, updates, clip_eps)))
    return result


def oracle(data_seed: int = 2) -> dict:
    """Metrics of the true rates (the best any policy can do on these realised outcomes)."""
    categories, outcomes, p_true = make_data(data_seed)
    probs, labels = p_true[categories.numpy()], outcomes.numpy().astype(int)
    return {"ece": expected_calibration_error(probs, labels), "auroc": auroc(probs, labels),
            "accuracy": float(np.mean((probs > 0.5) == (labels == 1)))}


def row_name(r: dict) -> str:
    return NAMES[r["algo"]] + (f", {r['updates']} updates, clip {r['clip_eps']}" if r["updates"] > 1 else "")


def table(results: list, ref: dict | None = None) -> str:
    """Markdown: ours next to the published numbers."""
    lines = ["| algorithm | ECE (ours) | ECE (paper) | AUROC (ours) | AUROC (paper) | accuracy (ours) | "
             "accuracy (paper) |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        pub = r["published"] or (float("nan"),) * 3
        lines.append(f"| {row_name(r)} | {r['ece']:.4f} | {pub[0]:g} | {r['auroc']:.4f} | {pub[1]:g} | "
                     f"{r['accuracy']:.4f} | {pub[2]:g} |")
    if ref:
        lines.append(f"| true rates p_c (oracle) | {ref['ece']:.4f} | | {ref['auroc']:.4f} | | "
                     f"{ref['accuracy']:.4f} | |")
    return "\n".join(lines)


ROWS = {"on": [(a, 1, None) for a in ("grpo", "grpo_nostd", "rloo", "ppo", "reinforce")],
        "off": [(a, 10, eps) for a in ("grpo", "grpo_nostd", "rloo", "ppo") for eps in (0.2, 0.001)]}


def _run(kw):
    torch.set_num_threads(1)
    return train(**kw)


def run_rows(rows, steps: int, seed: int = 0, jobs: int = 2) -> list:
    kws = [dict(algo=a, updates=u, clip_eps=e, steps=steps, seed=seed) for a, u, e in rows]
    if jobs <= 1:
        return [_run(kw) for kw in kws]
    # spawned, not forked: a child forked after the parent ran OpenMP regions can hang in libgomp (seen here)
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(_run, kws))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=50_000, help="gradient steps per run (the notebook's 50,000)")
    p.add_argument("--rows", default="all", choices=["all", "on", "off"],
                   help="on-policy rows, off-policy rows or both")
    p.add_argument("--seed", type=int, default=0, help="torch seed for sampling (the notebook's 0)")
    p.add_argument("--jobs", type=int, default=max(1, min(4, os.cpu_count() or 1)), help="runs in parallel")
    p.add_argument("--out", default="runs/seed000_tabular", help="folder for results.json and table.md")
    a = p.parse_args(argv)
    rows = ROWS["on"] + ROWS["off"] if a.rows == "all" else ROWS[a.rows]
    t0 = time.time()
    results = run_rows(rows, a.steps, a.seed, a.jobs)
    ref = oracle()
    write_results(a.out, {"steps": a.steps, "seed": a.seed, "wall_seconds": time.time() - t0, "oracle": ref,
                          "results": results}, table(results, ref))
    print(f"{len(rows)} runs x {a.steps} steps in {time.time() - t0:.0f} s")
    return results


if __name__ == "__main__":
    main()
