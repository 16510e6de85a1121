"""Evaluation: metrics on the held-out split, used by every train_*.py.

`evaluate(run)` samples `eval_n` completions per held-out prompt with the run's engine and reports
correctness and format apart (seed 002), and for probability tasks the calibration error (seed 000).
"""
import json
import os

import numpy as np
import torch

import common


def expected_calibration_error(probs, labels, n_bins: int = 10) -> float:
    """ECE = sum_b n_b/N |mean prediction_b - mean label_b| over equal-width, right-closed bins
    (lo, hi], as seed 000's authors computed it (Guo et al. 2017); a prediction of exactly 0 goes
    to the first bin."""
    probs = np.asarray(probs, dtype=np.float64)
    labels = np.asarray(labels, dtype=np.float64)
    if probs.shape != labels.shape or probs.ndim != 1:
        raise ValueError(f"probs and labels must be 1-D and the same length (got {probs.shape}, {labels.shape})")
    if len(probs) == 0:
        raise ValueError("no predictions")
    if np.any((probs < 0) | (probs > 1)) or np.any(np.isnan(probs)):
        raise ValueError("probabilities must lie in [0, 1]")
    edges = np.linspace(0.0, 1.0, n_bins + 1)
    ece = 0.0
    for b, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
        in_bin = (probs > lo) & (probs <= hi)
        if b == 0:
            in_bin |= probs == 0.0
        if in_bin.any():
            ece += in_bin.mean() * abs(probs[in_bin].mean() - labels[in_bin].mean())
    return float(ece)


@torch.no_grad()
def evaluate(run) -> dict:
    """Held-out metrics (eval/*) for the run's current policy; also writes <run_dir>/eval.json."""
    args, task = run.args, run.task
    examples = task.test[: args.eval_limit or None]
    examples = common.shard(examples)
    prompt_ids = common.encode_prompts(run.tokenizer, [e["prompt"] for e in examples], args.model != "tiny")
    rollouts = common.generate(run.engine, run.model, prompt_ids, args.eval_n, run.max_new_tokens, args.temperature,
                               seed=args.seed + 7_777_777, device=run.device, dtype=run.dtype)
    rewards, correct, fmt, scores = common.score_rollouts(task, run.tokenizer, examples, rollouts, args.eval_n, 0.0)
    metrics = {"eval/pass@1": correct.mean().item(), "eval/reward": rewards.mean().item(),
               "eval/format_fail": 1.0 - fmt.mean().item()}
    if task.kind == "probability":
        probs, labels = probability_predictions(scores, examples, args.eval_n)
        metrics["eval/ece"] = expected_calibration_error(probs, labels)
    metrics = common.all_mean(metrics)
    if common.dist_info()[0] == 0:
        with open(os.path.join(run.run_dir, "eval.json"), "w") as f:
            json.dump({"step": run.step, **metrics}, f, indent=2)
    common.sleep(run.engine)
    return metrics


def probability_predictions(scores, examples, n):
    """One prediction per question: the mean of its n sampled probabilities (seed 000's protocol),
    skipping invalid samples; a question with no valid sample predicts 0.5."""
    probs, labels = [], []
    for i, ex in enumerate(examples):
        valid = [s.prob for s in scores[i * n:(i + 1) * n] if s.prob is not None]
        probs.append(float(np.mean(valid)) if valid else 0.5)
        labels.append(ex["answer"])
    return np.array(probs), np.array(labels)
