"""Evaluation: the metrics the evaluation-practice reference ("GRPO for Reasoning-Model Post-Training", 2026)
and Bereket & Leskovec (2025) ask for, as a library and as a command.

    python eval.py --model runs/demo/final --task addition --n 16 --k 1,4,16   # JSON, Markdown, plots
    python eval.py --model Qwen/Qwen2.5-0.5B-Instruct --task gsm8k --n 8 --k 1,8 --limit 200
    python eval.py compare runs/grpo-calibration-tiny-s0 runs/rloo-calibration-tiny-s0   # no wandb needed
    python eval.py audit --reward math --file labelled.jsonl  # verifier recall/precision vs human labels
    python eval.py contamination --task gsm8k:data/gsm8k_{split}.jsonl --ngram 13
    python eval.py completions runs/grpo-addition-tiny-s0 --step 50 --worst 5  # from --log_completions
    python eval.py bias --model smollm2 --task sums_levels --n 64 --G 8 --out DIR  # HA-DW's Theorem 1

Library: pass_at_k (unbiased, stable), maj_at_k and mean_at_k with bootstrap intervals,
expected_calibration_error (Bereket & Leskovec's right-closed bins), auroc and brier (scikit-learn),
reliability_diagram (PNG), verifier_audit, and evaluate(run) which every train_*.py calls every --eval_every
steps (eval/* metrics and runs/<run>/eval.json).
"""
import argparse
import collections
import dataclasses
import hashlib
import json
import math
import os
import re
import sys
import typing

import numpy as np
import torch

import common
import rewards
from rlmini import (data, datafiles, dist, durable, engine, faults, models, options, progress, quiet,
                    reward_fns, reward_model, runlog, server, tools)

TOOL_OPTIONS = ("tools", "tool_format", "max_turns", "tool_timeout", "tool_memory_mb", "tool_output_chars",
                "tool_workers", "tool_sandbox", "env")  # the trainers' (common.Args), taken as they are
TASK_OPTIONS = ("task_config", "rg_size", "rg_allow_slow")  # rg: tasks, likewise
SERVER_OPTIONS = ("server_url", "server_timeout", "server_concurrency")  # --engine server, as in training
# rewards beyond a function (rlmini/reward_model.py::RewardArgs, the judge's): a task evaluated as trained
REWARD_OPTIONS = tuple(f for f in common.Args.__dataclass_fields__
                       if f.startswith(("reward_model", "reward_norm", "reward_concurrency", "reward_timeout",
                                        "judge_")))

# ---------------------------------------------------------------------------------------------- metrics


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k) (Chen et al. 2021),
    computed as a product so large n does not overflow."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n (got n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def _majority(preds: list, correct: list):
    """The most common prediction (ties: the first to appear) and whether it is correct."""
    valid = [(p, c) for p, c in zip(preds, correct) if p is not None]
    if not valid:
        return False
    counts = collections.Counter(p for p, _ in valid)
    best = max(counts.values())
    winner = next(p for p, _ in valid if counts[p] == best)
    return any(c for p, c in valid if p == winner)


def maj_at_k(preds: list, correct: list, k: int, draws: int = 32, seed: int = 0) -> np.ndarray:
    """Majority-vote accuracy at k per question: the mean over `draws` random k-subsets of its n
    samples (all of them when k == n). preds/correct: one list per question."""
    rng = np.random.default_rng(seed)
    out = []
    for p, c in zip(preds, correct):
        n = len(p)
        if k > n:
            raise ValueError(f"maj@{k} needs at least {k} samples per question (got {n})")
        subsets = [np.arange(n)] if k == n else [rng.choice(n, k, replace=False) for _ in range(draws)]
        out.append(np.mean([_majority([p[i] for i in s], [c[i] for i in s]) for s in subsets]))
    return np.array(out, dtype=np.float64)


def mean_at_k(correct: list, k: int) -> np.ndarray:
    """Average correctness of the first k samples, per question."""
    return np.array([np.mean(c[:k]) for c in correct], dtype=np.float64)


def bootstrap_ci(per_question, level: float = 0.95, draws: int = 1000, seed: int = 0) -> tuple:
    """Percentile bootstrap interval of the mean over questions."""
    x = np.asarray(per_question, dtype=np.float64)
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, len(x), size=(draws, len(x)))].mean(1)
    return float(np.quantile(means, (1 - level) / 2)), float(np.quantile(means, 1 - (1 - level) / 2))


def _check_probs(probs, labels):
    probs = np.asarray(probs, dtype=np.float64)
    labels = np.asarray(labels, dtype=np.float64)
    if probs.shape != labels.shape or probs.ndim != 1:
        raise ValueError(f"probs and labels must be 1-D and the same length (got {probs.shape}, "
                         f"{labels.shape})")
    if len(probs) == 0:
        raise ValueError("no predictions")
    if np.any(np.isnan(probs)) or np.any((probs < 0) | (probs > 1)):
        raise ValueError("probabilities must lie in [0, 1]")
    if not np.all(np.isin(labels, (0, 1))):
        raise ValueError("labels must be 0 or 1")
    return probs, labels


def expected_calibration_error(probs, labels, n_bins: int = 10) -> float:
    """ECE = sum_b n_b/N |mean prediction_b - mean label_b| over equal-width, right-closed bins
    (lo, hi], as Bereket & Leskovec computed it (Guo et al. 2017); a prediction of exactly 0 goes
    to the first bin."""
    probs, labels = _check_probs(probs, labels)
    edges = np.linspace(0.0, 1.0, n_bins + 1)
    ece = 0.0
    for b, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
        in_bin = (probs > lo) & (probs <= hi)
        if b == 0:
            in_bin |= probs == 0.0
        if in_bin.any():
            ece += in_bin.mean() * abs(probs[in_bin].mean() - labels[in_bin].mean())
    return float(ece)


def auroc(probs, labels) -> float:
    """Area under the ROC curve (scikit-learn); NaN when only one class is present."""
    from sklearn.metrics import roc_auc_score
    probs, labels = _check_probs(probs, labels)
    return float(roc_auc_score(labels, probs)) if len(set(labels.tolist())) == 2 else float("nan")


def brier(probs, labels) -> float:
    from sklearn.metrics import brier_score_loss
    probs, labels = _check_probs(probs, labels)
    return float(brier_score_loss(labels, probs))


def reliability_diagram(curves: dict, path: str, n_bins: int = 10) -> None:
    """PNG: observed frequency against mean prediction per bin (marker area ~ share of predictions),
    one panel per named (probs, labels); a dict of such dicts draws one row of panels per key."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = curves if curves and all(isinstance(v, dict) for v in curves.values()) else {"": curves}
    n_cols = max(len(r) for r in rows.values())
    fig, axes = plt.subplots(len(rows), n_cols, figsize=(2.9 * n_cols, 3.1 * len(rows)), squeeze=False)
    edges = np.linspace(0, 1, n_bins + 1)
    for i, (row_name, row) in enumerate(rows.items()):
        for j in range(len(row), n_cols):
            axes[i][j].axis("off")
        for ax, (name, (probs, labels)) in zip(axes[i], row.items()):
            probs, labels = _check_probs(probs, labels)
            # right-closed, as ECE
            idx = np.clip(np.searchsorted(edges, probs, side="left") - 1, 0, n_bins - 1)
            used = [b for b in range(n_bins) if (idx == b).any()]
            xs, ys = [probs[idx == b].mean() for b in used], [labels[idx == b].mean() for b in used]
            ax.plot([0, 1], [0, 1], "k--", lw=0.8)
            ax.plot(xs, ys, "-", lw=1, color="C0")
            ax.scatter(xs, ys, s=[4 + 300 * (idx == b).mean() for b in used], color="C0", zorder=3)
            ax.set_title(f"{name}\nECE {expected_calibration_error(probs, labels):.3f}", fontsize=9)
            ax.set_xlabel("predicted probability", fontsize=8)
            ax.set_xlim(0, 1), ax.set_ylim(0, 1)
        label = f"{row_name}\nobserved frequency" if row_name else "observed frequency"
        axes[i][0].set_ylabel(label, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------- verifier audit (contamination: rewards.py)


def verifier_audit(score, rows: list, source: str = "audit", lines=None) -> dict:
    """A reward function `score(completion, example, finished)` against human labels. rows: {completion,
    answer, label}; label 1 = the completion is correct. Recall = share of human-correct rows the verifier
    accepts ("GRPO for Reasoning-Model Post-Training", 2026: rule-based verifiers missed 14%), precision =
    share of accepted rows that are correct."""
    tp = fp = fn = tn = 0
    disagree = []
    for i, row in enumerate(rows):
        for key in ("completion", "answer", "label"):
            if key not in row:
                raise rewards.DataError(f"{source}: {datafiles.where(lines, i)}: missing field '{key}' (has: "
                                        f"{sorted(row)})")
        if row["label"] not in (0, 1, True, False):
            raise rewards.DataError(f"{source}: {datafiles.where(lines, i)}: label must be 0 or 1 (got "
                                    f"{row['label']!r})")
        verdict = score(str(row["completion"]), {"answer": row["answer"]}, True).correct >= 1.0
        human = bool(row["label"])
        tp += verdict and human
        fp += verdict and not human
        fn += (not verdict) and human
        tn += (not verdict) and not human
        if verdict != human:
            disagree.append({"row": datafiles.where(lines, i), "verifier": int(verdict), "human": int(human),
                             **row})
    return {"rows": len(rows), "recall": tp / (tp + fn) if tp + fn else float("nan"),
            "precision": tp / (tp + fp) if tp + fp else float("nan"), "tp": tp, "fp": fp, "fn": fn, "tn": tn,
            "disagreements": disagree}


# ------------------------------------------------------------------------------------- evaluating a policy


def summarize(task, examples: list, scores: list, n: int, ks: list, boot: bool = False) -> dict:
    """Metrics from n scored samples per question (scores grouped by question)."""
    correct = [[s.correct >= 1.0 for s in scores[i * n:(i + 1) * n]] for i in range(len(examples))]
    preds = [[s.pred for s in scores[i * n:(i + 1) * n]] for i in range(len(examples))]
    out = {"questions": len(examples), "n": n,
           "format_fail": 1.0 - float(np.mean([s.format_ok for s in scores])),
           "reward": float(np.mean([s.reward for s in scores]))}
    for k in ks:
        per_q = {f"pass@{k}": np.array([pass_at_k(n, sum(c), k) for c in correct]),
                 f"maj@{k}": maj_at_k(preds, correct, k), f"mean@{k}": mean_at_k(correct, k)}
        for name, v in per_q.items():
            out[name] = float(v.mean())
            if boot:
                out[f"{name}_ci95"] = bootstrap_ci(v)
    if scores and scores[0].tools is not None:  # --tools: calls per sample, share calling, failed calls
        calls = np.array([s.tools["calls"] for s in scores], dtype=float)
        errors = sum(s.tools["errors"] for s in scores)
        out.update(tool_calls=float(calls.mean()), tool_call_frac=float((calls > 0).mean()),
                   tool_error_rate=errors / calls.sum() if calls.sum() else math.nan)
    if "task/scorer_errors" in task.stats:  # rg: scorers that raised (each scored 0)
        out["scorer_errors"] = sum(s.error is not None for s in scores)
    if task.kind == "ordinal":
        out["pass_rate"] = float(np.mean([s.reward >= task.pass_threshold for s in scores]))
    for tag in SUBSET_TAGS:  # by level (sums_levels): each value's questions, pass@k of each k
        values = tag_values(examples, tag)
        if values is not None and len(set(values)) > 1:
            out[f"by_{tag}"] = {str(v): {"questions": values.count(v), **{
                f"pass@{k}": float(np.mean([pass_at_k(n, sum(c), k) for c, x in zip(correct, values)
                                            if x == v])) for k in ks}}
                for v in sorted(set(values), key=lambda v: (isinstance(v, str), v))}
    if boot:  # each question's own values, for a paired comparison of two policies (eval.py compare)
        out["per_question"] = per_question(task, examples, scores, n, [k for k in ks if k > 1])
    if task.kind == "probability":
        probs, labels = probability_predictions(scores, examples, n)
        out.update(ece=expected_calibration_error(probs, labels), auroc=auroc(probs, labels),
                   brier=brier(probs, labels), accuracy=float(np.mean((probs > 0.5) == (labels == 1))),
                   predictions={"probs": probs.tolist(), "labels": labels.tolist()})
    return out


def question_id(index: int, example) -> str:
    """A held-out question's identity across evaluations: a hash of its place in the held-out split, its
    prompt (text or chat messages) and its answer (calibration's 2,000 questions share 20 prompts and 2
    answers)."""
    key = json.dumps([index, example["prompt"], example.get("answer")], sort_keys=True, default=str)
    return hashlib.sha256(key.encode()).hexdigest()[:16]


SUBSET_TAGS = ("level", "family", "difficulty")  # an example's tags, kept per question for a subset


def tag_values(examples: list, tag: str):
    """Every example's `tag`, or None unless each has one of one plain kind (a number or a text): a user's
    jsonl column of that name holding gaps, lists or mixed kinds is no subset, and is left alone."""
    values = [e.get(tag) if isinstance(e, dict) else None for e in examples]
    kinds = {(float if isinstance(v, (int, float)) and not isinstance(v, bool) else type(v)) for v in values}
    return values if values and len(kinds) == 1 and kinds <= {float, str} else None


def per_question(task, examples: list, scores: list, n: int, ks: tuple = ()) -> dict:
    """Per question, in order: its id, pass@1 (the share of its n samples that are correct) and mean reward
    (and, on an ordinal task, the share at or above the pass threshold), pass@k for each k in `ks`, and the
    examples' tags (SUBSET_TAGS) where every example has it."""
    blocks = [scores[i * n:(i + 1) * n] for i in range(len(examples))]
    out = {"id": [question_id(i, e) for i, e in enumerate(examples)],
           "pass@1": [float(np.mean([s.correct >= 1.0 for s in b])) for b in blocks],
           "reward": [float(np.mean([s.reward for s in b])) for b in blocks]}
    if task.kind == "ordinal":
        out["pass_rate"] = [float(np.mean([s.reward >= task.pass_threshold for s in b])) for b in blocks]
    for k in ks:  # unbiased pass@k per question (Chen et al. 2021), for a paired pass@k (eval.py compare)
        out[f"pass@{k}"] = [pass_at_k(n, sum(s.correct >= 1.0 for s in b), k) for b in blocks]
    for tag in SUBSET_TAGS:  # what a subset names (eval.py compare --subset level=3)
        if (values := tag_values(examples, tag)) is not None:
            out[tag] = values
    return out


def probability_predictions(scores, examples, n):
    """One prediction per question: the mean of its n sampled probabilities (Bereket & Leskovec's protocol),
    skipping invalid samples; a question with no valid sample predicts 0.5."""
    probs, labels = [], []
    for i, ex in enumerate(examples):
        valid = [s.prob for s in scores[i * n:(i + 1) * n] if s.prob is not None]
        probs.append(float(np.mean(valid)) if valid else 0.5)
        labels.append(ex["answer"])
    return np.array(probs), np.array(labels)


def sample_and_score(run, examples: list, n: int, seed: int) -> list:
    """The Score of n samples of every example, in order (n per example). Under torchrun each rank samples
    its block of the examples (`seed` differs per rank) and every rank gets all the scores back: metrics
    such as ECE cannot be averaged over shards, they are computed once on all predictions."""
    # training's own generation (--tools: multi-turn), so pass@k compares with training; a rank without
    # examples (more ranks than examples) still joins the HF engine's forwards, collectives under FSDP2
    scored = common.generate(run, dist.shard(examples), n, seed=seed)
    for s, st in zip(scored.scores, scored.rollouts.tool_stats or []):
        s.tools = st
    return dist.all_gather_objects(scored.scores)


@torch.no_grad()
def evaluate(run) -> dict:
    """Held-out metrics (eval/*) for the run's current policy: pass@1, pass@k and maj@k with
    k = --eval_n, format failures, and for probability tasks ECE, AUROC, Brier; also writes
    <run_dir>/eval.json. The rollout engine is left as it was found: awake, with the policy's
    weights (the training loop pushed them just before); it is never put to sleep here."""
    args = run.args
    examples = run.task.test[: args.eval_limit or None]
    counts = dict(run.task.stats)  # the step's counters: evaluation's own are reported as eval/*
    with reward_model.evaluating(run.task):  # --reward_norm running: not moved by held-out scores
        scores = sample_and_score(run, examples, args.eval_n,
                                  seed=data.rollout_seed(args.seed, -1, dist.rank()))
    run.task.stats.update(counts)
    full = summarize(run.task, examples, scores, args.eval_n, sorted({1, args.eval_n}))
    k = args.eval_n
    metrics = {"eval/pass@1": full["pass@1"], "eval/pass@k": full[f"pass@{k}"],
               "eval/maj@k": full[f"maj@{k}"],
               "eval/format_fail": full["format_fail"], "eval/reward": full["reward"]}
    for key in ("ece", "auroc", "brier", "accuracy", "pass_rate", "tool_calls", "tool_call_frac",
                "tool_error_rate", "scorer_errors"):
        if key in full:
            metrics[f"eval/{key}"] = full[key]
    for value, m in full.get("by_level", {}).items():  # sums_levels: each level's pass@1 over steps
        metrics[f"eval/pass@1_level{value}"] = m["pass@1"]
    if run.task.on_eval is not None:  # rg: --rg_curriculum raises the level here (every rank alike)
        metrics.update(run.task.on_eval(run.task, metrics))
    if dist.rank() == 0:  # every prediction: the scores of all ranks were gathered
        extra = {"predictions": full["predictions"]} if "predictions" in full else {}
        write_out(run.run_dir, "eval.json", {"step": run.step, "k": k, **metrics, **extra})
    return metrics


# ---------------------------------------------------------------------------------------------- command line


def write_out(out_dir: str, name: str, obj) -> str:
    """Write a string, or an object as JSON, to out_dir/name (creating the folder) atomically and durably
    (rlmini/durable.py::write_text: a reader sees the old file or the new one); returns the path."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    durable.write_text(path, obj if isinstance(obj, str) else json.dumps(obj, indent=2))
    return path


def write_results(out_dir: str, results: dict, table: str) -> None:
    """A reproduction's output: results.json and table.md in out_dir; the table is printed."""
    write_out(out_dir, "results.json", results)
    write_out(out_dir, "table.md", table + "\n")
    print(table)
    print(f"wrote {out_dir}/results.json, table.md")


def _markdown(rows: list, columns: list) -> str:
    fmt = lambda v: f"{v:.4f}" if isinstance(v, float) else ("" if v is None else str(v))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _model_name(model: str) -> str:
    """runs/<run>/final -> <run>; a hub id or other path -> its last part."""
    parts = model.rstrip("/").split("/")
    return parts[-2] if parts[-1] == "final" and len(parts) > 1 else parts[-1]


def trained_by(model: str) -> dict:
    """The options of the run whose final policy `model` is (runs/<run>/final: the run folder's config.json,
    with its --task and --seed), or {} for any other model."""
    path = os.path.join(os.path.dirname(os.path.normpath(model)), "config.json")
    if not os.path.isdir(model) or not os.path.isfile(path):
        return {}
    with open(path) as f:
        config = json.load(f)
    return config if isinstance(config, dict) and "algo" in config and "seed" in config else {}


def check_held_out(examples: list, a, trained: dict, load) -> None:
    """Refuse in one line to score a run on held-out questions of its own task that its training split
    held and its own held-out split did not: a task whose split follows --seed (addition) at another seed."""
    seed = trained.get("seed")
    if a.split != "test" or trained.get("task") != a.task or seed in (None, a.seed):
        return
    key = lambda e: json.dumps([e["prompt"], e["answer"]], sort_keys=True, default=str)  # noqa: E731
    theirs = load(seed)
    seen = {key(e) for e in theirs.train} - {key(e) for e in theirs.test}  # mixed holds out its train's pairs
    leaked = sum(key(e) in seen for e in examples)
    if leaked:
        raise SystemExit(f"--seed {a.seed}: {leaked} of the {len(examples)} held-out questions of --task "
                         f"{a.task} at this seed are in the training split of {a.model} (trained with --seed "
                         f"{seed}); evaluate with --seed {seed}, the default for a run's final/")


def _task_name(spec: str) -> str:
    """--task as part of a folder name, one name per spec: a plain spec as it is, `name:rest` as name-rest
    (addition:14 -> addition-14; task names have no '-'), and where anything else had to be replaced (a
    path's '/', a second ':') or the name is long, a hash of the whole spec after it, so jsonl:a/b-c.jsonl
    and jsonl:a-b/c.jsonl stay apart."""
    name, colon, rest = spec.partition(":")
    safe = re.sub(r"[^A-Za-z0-9._,=-]", "-", rest)
    readable = f"{name}-{safe}" if colon else name
    if safe == rest and len(readable) <= 80:
        return readable
    return f"{readable[:80]}-{hashlib.sha256(spec.encode()).hexdigest()[:8]}"


@dataclasses.dataclass
class SampleArgs(common.Args):
    """The trainers' options as evaluation uses them: nothing trains, so --dtype float16 and greedy decoding
    (--temperature 0) are allowed."""
    temperature: float = common.arg(1.0, "sampling temperature; 0: greedy (one completion a question)", ge=0)
    trains = False


def cmd_evaluate(argv) -> dict:
    p = options.Parser(prog="eval.py", description="Evaluate a policy on a task's held-out split.")
    p.add_argument("--model", default="tiny", help="hub id, local path (e.g. runs/<run>/final) or 'tiny'")
    p.add_argument("--task", default="addition",
                   help="as in training: addition, calibration, ordinal, gsm8k, math, jsonl:PATH, "
                        "hf:DATASET, rg:NAME[,NAME...]")
    p.add_argument("--jsonl_reward", default="math", choices=sorted(rewards.JSONL_REWARDS),
                   help="jsonl:/hf: scoring")
    p.add_argument("--prompt_column", default="prompt", help="jsonl:/hf: the prompt's column")
    p.add_argument("--answer_column", default="answer", help="jsonl:/hf: the answer's column")
    p.add_argument("--system_prompt", default="", help="a system message opening every prompt (chat models)")
    p.add_argument("--n", type=int, default=None, help="samples per question (default 16; greedy: 1)")
    p.add_argument("--k", default=None, help="comma-separated k for pass@k, maj@k, mean@k (each <= n; "
                                             "default 1,4,16, each at most --n; greedy: 1)")
    p.add_argument("--split", default="test", choices=["test", "train"])
    p.add_argument("--limit", type=int, default=0, help="questions (0 = all)")
    p.add_argument("--engine", default="vllm", choices=["vllm", "hf", "server"],
                   help="vLLM in-process, a sampling loop (hf), or a `vllm serve` of --model (server)")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="sampling temperature; 0: greedy decoding, one completion per question (pass@1)")
    p.add_argument("--max_new_tokens", type=int, default=0, help="0 = the task's default")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="compute dtype (auto: CUDA bf16)")
    p.add_argument("--seed", type=int, default=None, help="the task's split and the sampling (default: the "
                   "run's own --seed when --model is a run's final/, else 0)")
    p.add_argument("--out", default="", help="output folder (default runs/eval-<model>-<task>, the task's "
                                             "whole spec: addition:14 -> addition-14)")
    p.add_argument("--verbose", type=options.boolean, default=False,
                   help="the libraries' output on the terminal instead of in <out>/logs/rank<R>.log")
    for name in TOOL_OPTIONS + TASK_OPTIONS + SERVER_OPTIONS + REWARD_OPTIONS:  # the trainers' options
        f = common.Args.__dataclass_fields__[name]
        choices = typing.get_args(f.type) if typing.get_origin(f.type) is typing.Literal else None
        kind = options.boolean if f.type is bool else str if choices else type(f.default)
        p.add_argument(f"--{name}", type=kind, default=f.default, help=f.metadata.get("help", ""),
                       choices=choices)
    a = p.parse_args(argv)
    trained = trained_by(a.model)  # a run's final/: its own split by default (addition's follows --seed)
    a.seed = trained.get("seed", 0) if a.seed is None else a.seed
    greedy = a.temperature == 0
    if a.n is not None and a.n < 1:  # given, and not a sample: never read as "the default"
        raise SystemExit(f"--n {a.n}: must be >= 1")
    if greedy and (a.n not in (None, 1) or a.k not in (None, "1")):
        given = " ".join(f"--{f} {v}" for f, v in (("n", a.n), ("k", a.k)) if v not in (None, 1, "1"))
        raise SystemExit(f"--temperature 0 {given}: greedy decoding gives one completion per question "
                         f"(n = 1, pass@1 only); drop {given}, or sample at a temperature > 0")
    a.n = a.n if a.n is not None else 1 if greedy else 16
    # pass@k needs k <= n: the default list follows --n (--n 2: 1,2), a --k the user gave is checked below
    a.k = a.k or ",".join(str(min(k, a.n)) for k in (1, 4, 16))
    for flag, value, low in (("--n", a.n, 1), ("--limit", a.limit, 0),
                             ("--max_new_tokens", a.max_new_tokens, 0)):
        if value < low:
            raise SystemExit(f"{flag} {value}: must be >= {low}")
    if not a.temperature >= 0:
        raise SystemExit(f"--temperature {a.temperature}: must be >= 0 (0: greedy decoding)")
    try:
        ks = sorted({int(k) for k in a.k.split(",")})
    except ValueError:
        raise SystemExit(f"--k {a.k}: a comma-separated list of integers, e.g. 1,4,16") from None
    if not ks or min(ks) < 1 or max(ks) > a.n:
        raise SystemExit(f"--k {a.k}: every k must lie in 1..--n ({a.n})")
    if a.engine == "vllm":
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    out = a.out or os.path.join("runs", f"eval-{_model_name(a.model)}-{_task_name(a.task)}")
    if all(os.path.isfile(os.path.join(out, f)) for f in ("config.json", "metrics.jsonl")):
        raise SystemExit(f"--out {out}: a training run's folder (config.json, metrics.jsonl): its eval.json "
                         f"and logs/ are the run's; choose another --out, e.g. {os.path.join(out, 'eval')}")
    counted = {}  # the sampling's progress count, once it began (a Ctrl-C line says how far it got)

    def interrupted() -> str:
        c, again = counted.get("now"), f"run it again with: {faults.rerun_command(sys.argv)}"
        if os.path.exists(os.path.join(out, "eval.json")) and c and c["done"] == c["total"]:
            return (f"interrupted (Ctrl-C) while writing {out}: eval.json is whole, the rest may not be; "
                    f"{again}")
        done = f"after {c['done']} of {c['total']} completions" if c else "while loading"
        return (f"interrupted (Ctrl-C) {done}: no results written to {out} (eval.json is written once every "
                f"question is scored); {again}")
    faults.watch(None, interrupted)
    quiet.start(a)  # the libraries' output to <out>/logs/rank<R>.log (an entry point's; --verbose: here)
    quiet.to_run_dir(out, resume=False)
    tool_options = {k: getattr(a, k) for k in TOOL_OPTIONS + SERVER_OPTIONS + REWARD_OPTIONS}
    try:
        args = SampleArgs(model=a.model, task=a.task, engine=a.engine, temperature=a.temperature, seed=a.seed,
                          max_new_tokens=a.max_new_tokens, dtype=a.dtype, **tool_options)
    except ValueError as e:  # a range (options.validate)
        raise SystemExit(f"bad option: {e}") from None
    style = models.prompt_style(a.model)
    load = lambda seed: rewards.load_task(  # noqa: E731
        a.task, style=style, seed=seed, jsonl_reward=a.jsonl_reward, prompt_column=a.prompt_column,
        answer_column=a.answer_column, **{k: getattr(a, k) for k in TASK_OPTIONS})
    task = load(a.seed)
    check_held_out(task.test[: a.limit or None], a, trained, load)  # --split train: nothing to check
    task = datafiles.with_system_prompt(task, a.system_prompt)
    task = reward_fns.with_reward_functions(task, "", "", env=a.env, sources=reward_model.sources(args),
                                            concurrency=a.reward_concurrency, timeout=a.reward_timeout)
    models.model_path(a.model, task)  # builds the tiny model on first use, before torch.distributed starts
    device, dtype = dist.setup_device(args)
    model, tok, path = models.load_model(args, task, device, dtype)
    data.check_vocabulary(task, tok, style, a.model, a.task)  # a tiny checkpoint on another task's prompts
    model.eval()
    reward_model.load(task, args, tok, device, dtype)  # --reward_model, --judge_url: as in training
    max_new = a.max_new_tokens or task.max_new_tokens
    examples = (task.test if a.split == "test" else task.train)[: a.limit or None]
    longest = max(len(x) for x in data.encode_prompts(tok, [e["prompt"] for e in examples], style == "chat"))
    max_len = min(getattr(model.config, "max_position_embeddings", 4096), longest + max_new + 8)
    if a.engine == "server":  # a server down, or serving another model than --model: one line
        served = server.check_server(a.server_url, args, tok, dtype, max_len, args.server_timeout)
        rollouts = server.ServerEngine(args, model, tok, device, dtype, served, push=False)
        probe = data.encode_prompts(tok, [examples[0]["prompt"]], style == "chat")[0]
        server.check_serves(rollouts, probe, min(16, max_new), a.model)
    else:
        rollouts = engine.make_engine(args, path, model, tok, device, dtype, max_len)
    run = argparse.Namespace(args=args, tokenizer=tok, style=style, engine=rollouts, model=model,
                             max_new_tokens=max_new, device=device, dtype=dtype, task=task, step=0,
                             toolbox=tools.make_toolbox(args, "", style, tok))
    faults.watch(run, interrupted)  # a Ctrl-C closes the engine too
    with progress.counting(len(dist.shard(examples)) * a.n, "eval") as count:  # a bar with its ETA
        counted["now"] = count
        scores = sample_and_score(run, examples, a.n, seed=data.rollout_seed(a.seed, -1, dist.rank()))
    getattr(run.toolbox, "close", lambda: None)()  # --env's instances
    result = {"model": a.model, "task": a.task, "split": a.split, "seed": a.seed,
              "temperature": a.temperature, "decoding": "greedy" if greedy else "sampled",
              **summarize(task, examples, scores, a.n, ks, boot=True)}
    if greedy:  # one completion: maj@1 and mean@1 are pass@1 again
        result = {k: v for k, v in result.items() if not k.startswith(("maj@", "mean@"))}
    # torchrun: every rank holds the same result (scores were gathered); rank 0 writes it
    if dist.rank() != 0:
        return result
    write_out(out, "eval.json", result)
    interval = lambda m, k: "[{:.3f}, {:.3f}]".format(*result[f"{m}@{k}_ci95"])
    shown = ("pass",) if greedy else ("pass", "maj", "mean")
    rows = [{"k": k, **{m: result[f"{m}@{k}"] for m in shown},
             **{f"{m} 95% CI": interval(m, k) for m in shown if m != "mean"}} for k in ks]
    table = _markdown(rows, ["k", "pass", "pass 95% CI"] + ([] if greedy else ["maj", "maj 95% CI", "mean"]))
    names = ("format_fail", "reward", "pass_rate", "ece", "auroc", "brier", "accuracy", "tool_calls",
             "tool_call_frac", "tool_error_rate", "scorer_errors")
    extra = {k: result[k] for k in names if k in result}
    table += "\n" + _markdown([extra], list(extra))
    how = "greedy (temperature 0): n=1, pass@1 only" if greedy else f"n={a.n}, temperature {a.temperature:g}"
    title = f"# {a.model} on {a.task} ({a.split}, {len(examples)} questions, {how})\n\n"
    write_out(out, "eval.md", title + table)
    _plot_pass_at_k(result, ks, os.path.join(out, "pass_at_k.png"))
    if task.kind == "probability":
        pred = result["predictions"]
        reliability_diagram({_model_name(a.model): (pred["probs"], pred["labels"])},
                            os.path.join(out, "reliability.png"))
    print(title + table, end="")
    figure = ", reliability.png" if task.kind == "probability" else ""
    print(f"wrote {out}/eval.json, eval.md, pass_at_k.png{figure}")
    return result


def _plot_pass_at_k(result, ks, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(4, 3))
    for m in [m for m in ("pass", "maj", "mean") if f"{m}@{ks[0]}" in result]:  # greedy: pass only
        ax.plot(ks, [result[f"{m}@{k}"] for k in ks], "o-", label=f"{m}@k")
    ax.set_xscale("log", base=2), ax.set_xlabel("k (samples)"), ax.set_ylabel("accuracy")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------- across seeds
# Aggregate metrics over a few runs, as rliable recommends (Agarwal et al. 2021, "Deep RL at the Edge of the
# Statistical Precipice"): interquartile mean, stratified-bootstrap percentile intervals, probability of
# improvement. Scores are [runs, tasks] arrays (one task: a column); every aggregate maps [reps, runs, tasks]
# to [reps].


def _trim_mean(x, axis):
    from scipy.stats import trim_mean
    return trim_mean(x, 0.25, axis=axis)


AGGREGATES = {  # rliable's metrics.aggregate_*: over all runs and tasks together (median: of the task means)
    # the middle 50% of the scores (25% cut at each end)
    "iqm": lambda s: _trim_mean(s.reshape(len(s), -1), axis=1),
    "mean": lambda s: s.reshape(len(s), -1).mean(1),
    "median": lambda s: np.median(s.mean(1), axis=1),
}


def _scores(scores) -> np.ndarray:
    x = np.asarray(scores, dtype=np.float64)
    x = x[:, None] if x.ndim == 1 else x
    if x.ndim != 2 or not len(x) or not np.isfinite(x).all():
        raise ValueError(f"scores: a non-empty [runs, tasks] array of finite numbers, got shape {x.shape}")
    return x


def aggregate_scores(scores, name: str = "iqm") -> float:
    """The aggregate `name` (iqm | mean | median) of [runs, tasks] (or [runs]) scores."""
    return float(AGGREGATES[name](_scores(scores)[None])[0])


def stratified_bootstrap_ci(scores, name: str = "iqm", reps: int = 2000, level: float = 0.95,
                            seed: int = 0) -> tuple:
    """Percentile interval of the aggregate: each replicate draws, for every task separately, as many runs as
    there are with replacement (rliable's StratifiedBootstrap: tasks are strata, runs are resampled within).
    """
    x = _scores(scores)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(x), size=(reps, *x.shape))  # [reps, runs, tasks]: a run index per task
    values = AGGREGATES[name](np.take_along_axis(np.broadcast_to(x, idx.shape), idx, axis=1))
    return float(np.quantile(values, (1 - level) / 2)), float(np.quantile(values, 1 - (1 - level) / 2))


def probability_of_improvement(x, y) -> float:
    """P(X > Y): the mean over tasks of the Mann-Whitney U statistic of X's runs against Y's, over (n m)
    pairs, ties counting one half (rliable's metrics.probability_of_improvement)."""
    x, y = _scores(x), _scores(y)
    if x.shape[1] != y.shape[1]:
        raise ValueError(f"probability_of_improvement: {x.shape[1]} tasks against {y.shape[1]}")
    a, b = x[:, None, :], y[None, :, :]  # [n, m, tasks]
    return float(((a > b) + 0.5 * (a == b)).mean(axis=(0, 1)).mean())


def probability_of_improvement_ci(x, y, reps: int = 2000, level: float = 0.95, seed: int = 0) -> tuple:
    """Percentile interval of P(X > Y), X's and Y's runs each resampled within every task."""
    x, y = _scores(x), _scores(y)
    rng = np.random.default_rng(seed)
    values = []
    for _ in range(reps):
        xs = np.take_along_axis(x, rng.integers(0, len(x), size=x.shape), axis=0)
        ys = np.take_along_axis(y, rng.integers(0, len(y), size=y.shape), axis=0)
        values.append(probability_of_improvement(xs, ys))
    return float(np.quantile(values, (1 - level) / 2)), float(np.quantile(values, 1 - (1 - level) / 2))


def curve_band(curves, reps: int = 1000, level: float = 0.95, seed: int = 0) -> tuple:
    """IQM across runs at each step of [runs, steps] curves, and its bootstrap band: a replicate draws the
    runs once for every step (rliable's sample-efficiency curves)."""
    x = np.asarray(curves, dtype=np.float64)
    rng = np.random.default_rng(seed)
    # [reps, runs, steps]: one draw of runs for all steps
    samples = x[rng.integers(0, len(x), size=(reps, len(x)))]
    values = _trim_mean(samples, axis=1)
    low, high = np.quantile(values, (1 - level) / 2, axis=0), np.quantile(values, 1 - (1 - level) / 2, axis=0)
    return _trim_mean(x, axis=0), low, high


COMPARE_KEYS = ["reward/mean", "reward/correct", "adv/failed_pos_frac", "entropy", "eval/pass@1",
                "eval/pass@k", "eval/maj@k", "eval/format_fail", "eval/ece", "eval/auroc", "eval/brier",
                "eval/accuracy"]
# a final evaluation by eval.py (its eval.json): the run's policy on the held-out split
HELDOUT_KEYS = ["heldout/pass@1", "heldout/pass_rate", "heldout/reward", "heldout/format_fail", "heldout/ece",
                "heldout/auroc", "heldout/brier", "heldout/accuracy"]
LOWER_IS_BETTER = {"adv/failed_pos_frac", "eval/format_fail", "eval/ece", "eval/brier", "heldout/format_fail",
                   "heldout/ece", "heldout/brier"}


def _eval_json(folder: str):
    """eval.py's eval.json in `folder` (None if there is none; training's own eval.json is not one)."""
    path = os.path.join(folder, "eval.json")
    if not os.path.exists(path):
        return None
    try:
        e = json.load(open(path))
    except (OSError, ValueError):  # a run still writing its own (training's) eval.json: not an evaluation
        return None
    return e if isinstance(e, dict) and "decoding" in e else None


PASS_K = re.compile(r"pass@\d+")  # pass@k of any k an evaluation computed: heldout/pass@16 beside pass@1


def question_subset(per_q: dict, subset: str, source: str) -> tuple:
    """(heldout/* values, per-question values) of the questions whose tag (SUBSET_TAGS) equals the value of
    `subset` ("level=3", "family=subtraction"): each per-question metric's mean over those questions."""
    tag, _, value = subset.partition("=")
    if not per_q or tag not in per_q:
        raise SystemExit(f"compare: --subset {subset}: {source} has no per-question {tag!r} (tags an "
                         f"evaluation keeps: {', '.join(SUBSET_TAGS)}, where its task's examples have them)")
    keep = [i for i, v in enumerate(per_q[tag]) if str(v) == value]
    if not keep:
        raise SystemExit(f"compare: --subset {subset}: no question of {source} has {tag} {value} (it has "
                         f"{', '.join(sorted({str(v) for v in per_q[tag]}))})")
    chosen = {k: [v[i] for i in keep] for k, v in per_q.items()}
    values = {f"heldout/{k}": float(np.mean(v)) for k, v in chosen.items()
              if k not in ("id",) + SUBSET_TAGS}
    return values, chosen


def _read_evaluation(folder: str, template: str, subset: str = ""):
    """(heldout/* values, per-question values, its path) of the run's final evaluation: an eval.py folder
    itself, else the folder `template` names ({run}: the folder, {parent}, {name}); (None, None, None).
    `subset` (TAG=VALUE): the metrics of those questions only (question_subset)."""
    run = folder.rstrip("/")
    try:
        places = [run] + ([template.format(run=run, parent=os.path.dirname(run) or ".",
                                           name=os.path.basename(run))] if template else [])
    except (KeyError, IndexError, ValueError) as e:
        raise SystemExit(f"compare: --eval {template!r}: a template of {{run}}, {{parent}} and {{name}} "
                         f"({type(e).__name__}: {e})") from None
    for place in places:
        e = _eval_json(place)
        if e is not None:  # a metric eval.py could not compute (AUROC of one class: NaN) is left out
            keys = [h.split("/")[1] for h in HELDOUT_KEYS] + [k for k in e if PASS_K.fullmatch(k)]
            values = {f"heldout/{k}": e[k] for k in keys if isinstance(e.get(k), (int, float))
                      and math.isfinite(e[k])}
            path = os.path.join(place, "eval.json")
            if subset:
                return (*question_subset(e.get("per_question"), subset, path), path)
            return values, e.get("per_question"), path
    return None, None, None


def _read_run(r: str) -> list:
    path = os.path.join(r, "metrics.jsonl")
    if not os.path.exists(path):
        if _eval_json(r) is not None:  # an evaluation alone (eval.py --out), e.g. the base model's
            return []
        raise SystemExit(f"compare: {path}: file not found (nor an eval.py eval.json in {r})")
    rows = runlog.read_metrics(path)  # DataError naming a bad line
    missing = next((i + 1 for i, row in enumerate(rows) if not isinstance(row, dict) or "step" not in row),
                   None)
    if missing:
        raise SystemExit(f"compare: {path}: row {missing} has no 'step': not a metrics.jsonl")
    return rows


def final_value(rows: list, key: str, last: int):
    """eval/*: the last evaluation; a training metric: the mean of its last `last` logged values (None if
    absent)."""
    vals = [x[key] for x in rows if isinstance(x.get(key), (int, float)) and not math.isnan(x[key])]
    if not vals:
        return None
    return vals[-1] if key.startswith("eval/") else float(np.mean(vals[-last:]))


def paired_difference(a, b, reps: int = 2000, level: float = 0.95, seed: int = 0) -> dict:
    """Arm A against arm B on the same held-out questions: a and b are [runs, questions] per-question scores
    (each run's row in the same question order). The difference of the means over runs and questions, with
    two percentile intervals: over questions (one draw of questions for both arms, the runs held fixed: how
    much the verdict owes to which questions were asked) and over seeds and questions (each arm's runs
    drawn within the arm too: what a new set of seeds would give)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1] or not a.size or not b.size:
        raise ValueError(f"paired_difference: [runs, questions] arrays on the same questions, got {a.shape} "
                         f"and {b.shape}")
    rng = np.random.default_rng(seed)
    q = rng.integers(0, a.shape[1], size=(reps, a.shape[1]))  # the same questions for both arms
    over_q = np.take(a.mean(0), q).mean(1) - np.take(b.mean(0), q).mean(1)

    def seeds_and_questions(x):  # a draw of the arm's runs (as weights: how often each was drawn), then q
        drawn = rng.integers(0, len(x), size=(reps, len(x)))
        weights = (drawn[:, :, None] == np.arange(len(x))).mean(1)  # [reps, runs]
        return np.take_along_axis(weights @ x, q, axis=1).mean(1)
    over_sq = seeds_and_questions(a) - seeds_and_questions(b)
    tail = (1 - level) / 2
    ci = lambda v: [float(np.quantile(v, tail)), float(np.quantile(v, 1 - tail))]  # noqa: E731
    return {"diff": float(a.mean() - b.mean()), "ci95_questions": ci(over_q),
            "ci95_seeds_questions": ci(over_sq), "runs": [len(a), len(b)], "questions": int(a.shape[1])}


def group_runs(runs: list, groups: list, pattern: str) -> dict:
    """{group: [run folders]}: --group NAME=GLOB[,GLOB] lists, else the runs grouped by the `pattern` regex's
    'group' (or first) capture of each folder's name; a name that does not match is its own group."""
    import glob
    import re
    if groups:
        out = {}
        for spec in groups:
            name, sep, globs = spec.partition("=")
            if not sep or not name or not globs:
                raise SystemExit(f"compare: --group {spec!r}: expected NAME=GLOB[,GLOB...], e.g. "
                                 f"grpo='runs/grpo-*'")
            found = sorted({p for g in globs.split(",") for p in glob.glob(g) if os.path.isdir(p)})
            if not found:
                raise SystemExit(f"compare: --group {spec!r}: no run folder matches {globs!r}")
            out[name] = found
        return out
    try:
        regex = re.compile(pattern)
    except re.error as e:
        raise SystemExit(f"compare: --pattern {pattern!r}: not a regular expression ({e})") from None
    out = {}
    for r in runs:
        name = os.path.basename(r.rstrip("/"))
        m = regex.search(name)
        key = (m.groupdict().get("group") or (m.group(1) if regex.groups else None)) if m else None
        out.setdefault(key or name, []).append(r)
    return out


def cmd_compare(argv) -> dict:
    p = options.Parser(prog="eval.py compare",
                                description="Compare runs, and groups of runs across seeds (IQM with 95% "
                                "stratified-bootstrap intervals, Agarwal et al. 2021), from their "
                                "metrics.jsonl; no wandb needed.")
    p.add_argument("runs", nargs="*", help="run folders (each with metrics.jsonl)")
    p.add_argument("--group", action="append", default=[],
                   help="NAME=GLOB[,GLOB]: the runs of one group, e.g. grpo='runs/grpo-*' (repeat per group)")
    p.add_argument("--pattern", default=r"^(?P<group>.+)-s\d+$",
                   help="without --group: runs whose names give the same 'group' capture form a group")
    p.add_argument("--metric", default="", help="comma-separated metrics for P(A beats B) (default "
                   "heldout/pass@1, else eval/pass@1, else reward/correct); lower is better for "
                   + ", ".join(sorted(LOWER_IS_BETTER)))
    p.add_argument("--eval", default="{parent}/eval-{name}",
                   help="where a run's final evaluation (eval.py's eval.json) lies: {run} the run folder, "
                        "{parent} its folder, {name} its name; '' for none (an eval.py folder given as a run "
                        "is read as it is)")
    p.add_argument("--out", default=os.path.join("runs", "compare"))
    p.add_argument("--last", type=int, default=10, help="training metrics: mean of the last N steps")
    p.add_argument("--reps", type=int, default=2000, help="bootstrap replicates")
    p.add_argument("--subset", default="", help="TAG=VALUE: the held-out metrics (heldout/*, the paired "
                   "table) of those questions only, e.g. level=3 (tags: " + ", ".join(SUBSET_TAGS) + ")")
    a = p.parse_args(argv)
    if a.last < 1 or a.reps < 1:
        raise SystemExit(f"compare: --last {a.last} and --reps {a.reps} must be >= 1")
    if a.subset and not re.fullmatch(r"[a-z_]+=\S+", a.subset):
        raise SystemExit(f"compare: --subset {a.subset!r}: expected TAG=VALUE, e.g. level=3")
    groups = group_runs(a.runs, a.group, a.pattern)
    if not groups:
        raise SystemExit("compare: no runs given (run folders, or --group NAME=GLOB)")
    data = {os.path.basename(r.rstrip("/")): _read_run(r) for rs in groups.values() for r in rs}
    evals = {os.path.basename(r.rstrip("/")): _read_evaluation(r, a.eval, a.subset)
             for rs in groups.values() for r in rs}
    rows = []
    for name, m in data.items():
        row = {"run": name, "steps": m[-1]["step"] if m else 0}
        row.update({k: v for k in COMPARE_KEYS if (v := final_value(m, k, a.last)) is not None})
        row.update(evals[name][0] or {})
        rows.append(row)
    pass_k = sorted({k for r in rows for k in r if k.startswith("heldout/pass@")} - set(HELDOUT_KEYS),
                    key=lambda k: int(k.split("@")[1]))  # heldout/pass@4, pass@16: as the evaluations hold
    columns = ["run", "steps"] + [k for k in COMPARE_KEYS + HELDOUT_KEYS + pass_k
                                  if any(k in r for r in rows)]
    table = _markdown(rows, columns)
    result = {"runs": rows, "groups": {}, "improvement": []}
    by_run = {r["run"]: r for r in rows}
    members = {g: [os.path.basename(r.rstrip("/")) for r in rs] for g, rs in groups.items()}
    for g, names in members.items():  # each metric over the group's runs that have it
        entry = {"runs": names}
        for k in columns[2:]:
            x = [by_run[n][k] for n in names if k in by_run[n]]
            if x:
                lo, hi = stratified_bootstrap_ci(x, "iqm", a.reps)
                entry[k] = {"n": len(x), "iqm": aggregate_scores(x, "iqm"),
                            "mean": aggregate_scores(x, "mean"), "median": aggregate_scores(x, "median"),
                            "ci95": [lo, hi], "values": x}
        result["groups"][g] = entry
    if any(len(names) > 1 for names in members.values()):  # seeds: a verdict per group, with intervals
        cell = lambda e: f"{e['iqm']:.4f} [{e['ci95'][0]:.3f}, {e['ci95'][1]:.3f}]" if e else ""
        grows = [{"group": g, "runs": len(e["runs"]), **{k: cell(e.get(k)) for k in columns[2:]}}
                 for g, e in result["groups"].items()]
        table += ("\nPer group: IQM over runs [95% stratified-bootstrap interval] (Agarwal et al. 2021)\n\n"
                  + _markdown(grows, ["group", "runs"] + columns[2:]))
        have = lambda k: sum(k in result["groups"][g] for g in members)  # noqa: E731
        default = next((k for k in ("heldout/pass@1", "eval/pass@1", "reward/correct") if have(k) > 1),
                       columns[-1])
        metrics = a.metric.split(",") if a.metric else [default]
        names = list(members)
        for k in metrics:
            if k not in columns:
                raise SystemExit(f"compare: --metric {k}: no run logged it "
                                 f"(logged: {', '.join(columns[2:])})")
            sign = -1.0 if k in LOWER_IS_BETTER else 1.0
            for i, ga in enumerate(names):
                for gb in names[i + 1:]:
                    xa, xb = result["groups"][ga].get(k), result["groups"][gb].get(k)
                    if not xa or not xb:
                        continue
                    xa, xb = sign * np.array(xa["values"]), sign * np.array(xb["values"])
                    lo, hi = probability_of_improvement_ci(xa, xb, a.reps)
                    result["improvement"].append({"metric": k, "a": ga, "b": gb,
                                                  "p": probability_of_improvement(xa, xb), "ci95": [lo, hi]})
        if result["improvement"]:
            prow = [{"metric": r["metric"], "A beats B": f"{r['a']} > {r['b']}",
                     "P": f"{r['p']:.3f} [{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}]"}
                    for r in result["improvement"]]
            table += ("\nProbability of improvement P(A beats B) over pairs of runs (ties 1/2) [95% "
                      "interval]\n\n" + _markdown(prow, ["metric", "A beats B", "P"]))
    paired = paired_table(members, evals, a.metric, a.reps)
    if paired:
        result["paired"] = paired
        iv = lambda v: "[{:+.3f}, {:+.3f}]".format(*v)  # noqa: E731
        prow = [{"metric": r["metric"], "A - B": f"{r['a']} - {r['b']}", "runs": "{} / {}".format(*r["runs"]),
                 "difference": f"{r['diff']:+.4f}", "questions": iv(r["ci95_questions"]),
                 "seeds and questions": iv(r["ci95_seeds_questions"]), "verdict": r["verdict"]}
                for r in paired]
        table += ("\nPaired on the held-out questions: A - B, the mean over runs and questions [95% interval "
                  "resampling the questions; resampling the seeds and the questions]; the verdict is the "
                  "second's\n\n" + _markdown(prow, ["metric", "A - B", "runs", "difference", "questions",
                                                    "seeds and questions", "verdict"]))
    if a.subset:  # which questions the held-out numbers are of
        result["subset"] = a.subset
        table = f"Held-out metrics (heldout/*, paired) of the questions with {a.subset}\n\n" + table
    write_out(a.out, "comparison.md", table)
    write_out(a.out, "comparison.json", result)
    keys = [k for k in ("reward/mean", "eval/pass@1", "eval/ece") if k in columns]
    curves = {g: [data[n] for n in names] for g, names in members.items()}
    plot_curves(curves, keys, os.path.join(a.out, "curves.png"), a.reps)
    print(table, end="")
    print(f"wrote {a.out}/comparison.md, comparison.json, curves.png")
    return result


def paired_table(members: dict, evals: dict, metric: str, reps: int) -> list:
    """Every pair of groups whose runs all have a final evaluation with per-question values on the same
    questions: paired_difference of each held-out metric asked for (default heldout/pass@1). A pair on
    other questions is left out, with a note; an arm of one run has no seeds to resample (its verdict says
    so)."""
    keys = [k for k in (metric.split(",") if metric else ["heldout/pass@1"]) if k.startswith("heldout/")]
    have = {g: [evals[n] for n in names] for g, names in members.items()
            if all(evals[n][1] for n in names)}
    out, names = [], list(have)
    for k in keys:
        field = k.split("/", 1)[1]
        for i, ga in enumerate(names):
            for gb in names[i + 1:]:
                pa, pb = [e[1] for e in have[ga]], [e[1] for e in have[gb]]
                if not all(field in p for p in pa + pb):
                    continue
                ids = pa[0]["id"]
                odd = next((e[2] for e, p in zip(have[ga] + have[gb], pa + pb) if p["id"] != ids), None)
                if odd:
                    print(f"compare: {ga} - {gb} not paired: {odd} holds other held-out questions than "
                          f"{have[ga][0][2]} (or in another order)")
                    continue
                r = paired_difference([p[field] for p in pa], [p[field] for p in pb], reps)
                lo, hi = r["ci95_seeds_questions"]
                sign = -1 if k in LOWER_IS_BETTER else 1
                better = (ga if sign * lo > 0 else gb) if lo > 0 or hi < 0 else None  # 0 outside the interval
                single = [g for g, n in ((ga, len(pa)), (gb, len(pb))) if n == 1]
                verdict = f"{better} better" if better else "within noise"
                out.append({"metric": k, "a": ga, "b": gb, **r, "verdict": verdict + (
                    f" ({' and '.join(single)}: one run, its seed not resampled)" if single else "")})
    return out


def plot_curves(groups, keys, path, reps=1000):
    """One panel per metric: a group of one run is its line; a group of several, the IQM across its runs at
    the steps they all logged, with a 95% bootstrap band."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, max(1, len(keys)), figsize=(4 * max(1, len(keys)), 3), squeeze=False)
    for ax, key in zip(axes[0], keys):
        for name, runs in groups.items():
            series = [{x["step"]: x[key] for x in m if key in x and not math.isnan(x[key])} for m in runs]
            steps = sorted(set.intersection(*(set(s) for s in series)))
            if not steps:
                continue
            curves = np.array([[s[t] for t in steps] for s in series])
            if len(runs) == 1:
                ax.plot(steps, curves[0], "o-" if len(steps) < 20 else "-", label=name, ms=3)
                continue
            mid, lo, hi = curve_band(curves, reps)
            if len(steps) == 1:  # one evaluation: a point with its interval
                ax.errorbar(steps, mid, yerr=[mid - lo, hi - mid], fmt="o", capsize=4,
                            label=f"{name} ({len(runs)} runs)")
                continue
            line, = ax.plot(steps, mid, "o-" if len(steps) < 20 else "-", label=f"{name} ({len(runs)} runs)",
                            ms=3)
            ax.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.2)
        ax.set_title(key, fontsize=9), ax.set_xlabel("step")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _report(out: str, name: str, result: dict, summary: str, details: list) -> dict:
    """Write result JSON (if --out), print a summary line and the first 20 details."""
    if out:
        write_out(out, name, result)
    print(summary)
    for line in details[:20]:
        print(f"  {line}")
    return result


def theorem1(p: float, G: int) -> float:
    """HA-DW's Theorem 1 (arXiv 2601.08521): for a Bernoulli(p) reward and a group of G, the group's mean
    given a non-degenerate group, E[p_hat | 0 < R < G] = (p - p^G) / (1 - p^G - (1 - p)^G)."""
    return (p - p ** G) / (1 - p ** G - (1 - p) ** G)


def nondegenerate_group_mean(c: int, n: int, G: int) -> tuple:
    """(E[p_hat | 0 < R < G], P(0 < R < G)) for a group of G of a question's n scored samples, c of them
    correct, drawn without replacement (hypergeometric R): the measured side of Theorem 1, exact for those
    samples; as n grows it tends to theorem1(c / n, G). (nan, 0) when no group of G is non-degenerate."""
    if not (0 <= c <= n and 2 <= G <= n):
        raise ValueError(f"nondegenerate_group_mean needs 0 <= c <= n and 2 <= G <= n (got c={c}, n={n}, "
                         f"G={G})")
    w = [math.comb(c, r) * math.comb(n - c, G - r) for r in range(1, G)]
    total = sum(w)
    if not total:
        return math.nan, 0.0
    return sum(r / G * x for r, x in zip(range(1, G), w)) / total, total / math.comb(n, G)


def group_bias(per_q: dict, n: int, G: int, tag: str = "level") -> dict:
    """Theorem 1 on a policy's own prompts, from each question's n samples (per_question's pass@1 = c / n):
    per value of `tag` (and "all"), the mean p = c / n; over the non-degenerate groups of G (each question
    weighted by its chance of one), E[p_hat | non-degenerate] against p. That p comes from the n - G samples
    outside the group (p_rest): the group's own samples are in c / n, so E[c / n | nd] = G/n E[p_hat | nd] +
    (n - G)/n p, and e_phat - p_weighted would show only (n - G)/n of the bias; hence p_rest = (n p_weighted
    - G e_phat) / (n - G), unbiased. `theorem1`: Theorem 1 at each question's c / n (a plug-in: biased
    upward for small n, beside the measured side)."""
    if not 2 <= G < n:
        raise ValueError(f"group_bias: G {G} must lie in 2..n-1 (n {n}): p is measured outside the group")
    counts = [round(x * n) for x in per_q["pass@1"]]
    values = per_q.get(tag, ["all"] * len(counts))
    out = {}
    for v in ["all"] + sorted({str(x) for x in values} - {"all"}, key=lambda s: (len(s), s)):
        cs = [c for c, x in zip(counts, values) if v == "all" or str(x) == v]
        stats = [nondegenerate_group_mean(c, n, G) for c in cs]
        w = np.array([s[1] for s in stats])
        row = {"questions": len(cs), "p": float(np.mean(cs) / n), "p_nondegenerate": float(w.mean())}
        if w.sum() > 0:
            on = w > 0
            p = np.array(cs, dtype=float)[on] / n
            row.update(p_weighted=float(np.average(p, weights=w[on])),
                       e_phat=float(np.average([s[0] for s in np.array(stats)[on]], weights=w[on])),
                       theorem1=float(np.average([theorem1(x, G) for x in p], weights=w[on])))
            row["p_rest"] = (n * row["p_weighted"] - G * row["e_phat"]) / (n - G)
            row["bias"] = row["e_phat"] - row["p_rest"]
        out[v] = row
    return out


def cmd_bias(argv) -> dict:
    """eval.py bias: HA-DW's Theorem 1 measured on a policy's own prompts (seed 001)."""
    p = options.Parser(prog="eval.py bias", description="Theorem 1 of HA-DW (arXiv 2601.08521) on a "
                       "policy's own prompts: E[p_hat | non-degenerate group of G] against p estimated from "
                       "--n samples a question, per level. Samples with eval.py (every evaluation option is "
                       "passed on), or reads an evaluation already made (--from).", allow_abbrev=False)
    p.add_argument("--G", type=int, default=8, help="group size (training's --group_size)")
    p.add_argument("--tag", default="level", help="per value of this per-question tag")
    p.add_argument("--from", dest="source", default="", help="an eval.py folder (its eval.json, n >= G) "
                   "instead of sampling")
    a, rest = p.parse_known_args(argv)
    sampling = options.Parser(prog="eval.py bias", allow_abbrev=False)  # what sampling takes, read first
    for flag, kind in (("--n", int), ("--out", str), ("--temperature", float), ("--k", str)):
        sampling.add_argument(flag, type=kind, default=None)
    s = sampling.parse_known_args(rest)[0]
    if not a.source and s.n is not None and not 2 <= a.G < s.n:  # refused before any sampling
        raise SystemExit(f"bias: --G {a.G}: must lie in 2..n-1 (--n {s.n}): p is measured outside the group")
    if a.source:
        e = _eval_json(a.source)
        if e is None or "per_question" not in e:
            raise SystemExit(f"bias: --from {a.source}: no eval.py eval.json with per-question values "
                             f"there")
        out = a.source
    else:
        if s.out is None:
            raise SystemExit("bias: --out DIR: where the evaluation and bias.json go")
        if s.temperature is not None or s.k is not None:
            raise SystemExit("bias: samples at temperature 1 with eval.py's own --k: drop --temperature/--k")
        if s.n is None:
            raise SystemExit(f"bias: --n N: samples a question, more than --G {a.G}")
        e = cmd_evaluate([*rest, "--k", "1"])
        out = s.out
    if not 2 <= a.G < e["n"]:
        raise SystemExit(f"bias: --G {a.G}: must lie in 2..n-1 ({e['n']} samples a question): p is measured "
                         f"outside the group")
    result = {"model": e.get("model"), "task": e.get("task"), "n": e["n"], "G": a.G,
              "by": a.tag, "bias": group_bias(e["per_question"], e["n"], a.G, a.tag)}
    rows = [{a.tag: v, "questions": r["questions"], "p (mean)": f"{r['p']:.3f}",
             "P(non-degenerate)": f"{r['p_nondegenerate']:.3f}",
             **({"p (outside the group)": f"{r['p_rest']:.3f}", "E[p_hat \\| nd]": f"{r['e_phat']:.3f}",
                 "Theorem 1": f"{r['theorem1']:.3f}", "bias": f"{r['bias']:+.3f}"} if "bias" in r else {})}
            for v, r in result["bias"].items()]
    columns = [a.tag, "questions", "p (mean)", "P(non-degenerate)", "p (outside the group)",
               "E[p_hat \\| nd]", "Theorem 1", "bias"]
    table = _markdown(rows, [c for c in columns if any(c in r for r in rows)])
    return _report(out, "bias.json", result, f"Theorem 1 on {e.get('model')} / {e.get('task')}: groups of "
                   f"{a.G} from {e['n']} samples a question\n\n{table}", [])


def cmd_audit(argv) -> dict:
    p = options.Parser(prog="eval.py audit", description="The reward function against human labels.")
    p.add_argument("--reward", default="math", choices=sorted(rewards.JSONL_REWARDS),
                   help="the verifier: math (math-verify on the last \\boxed{}, as gsm8k/math) | exact")
    p.add_argument("--file", required=True, help="JSONL: {completion, answer, label (1 = correct)} per line")
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    rows, lines = datafiles.read_jsonl_numbered(a.file)
    result = verifier_audit(rewards.JSONL_REWARDS[a.reward], rows, a.file, lines)
    return _report(a.out, "audit.json", result,
                   f"{a.file}: {result['rows']} rows, recall {result['recall']:.3f}, precision "
                   f"{result['precision']:.3f}, {len(result['disagreements'])} disagreements",
                   [f"{d['row']}: verifier {d['verifier']} human {d['human']}: {str(d['completion'])[:100]!r}"
                    for d in result["disagreements"]])


def cmd_contamination(argv) -> dict:
    p = options.Parser(prog="eval.py contamination",
                                description="Word n-gram overlap of training and evaluation prompts.")
    p.add_argument("--task", required=True, help="checks the task's train split against its test split")
    p.add_argument("--ngram", type=int, default=13)
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    if a.ngram < 1:
        raise SystemExit(f"--ngram {a.ngram}: must be >= 1 (a 0-gram is in every prompt)")
    task = rewards.load_task(a.task, style="chat")
    train, test = [e["prompt"] for e in task.train], [e["prompt"] for e in task.test]
    result = datafiles.ngram_overlap(train, test, a.ngram)
    return _report(a.out, "contamination.json", result,
                   f"{a.task}: {len(result['pairs'])} of {len(task.test)} held-out prompts "
                   f"({result['share']:.1%}) share a {a.ngram}-gram with a training prompt",
                   [f"test {q['eval']} ~ train {q['train']}: {q['ngram']!r}" for q in result["pairs"]])


def cmd_completions(argv) -> dict:
    p = options.Parser(prog="eval.py completions",
                                description="The worst and best completions of a training step, from the "
                                "rollouts.jsonl that --log_completions writes: where reward hacking shows "
                                "first.")
    p.add_argument("run", help="run folder (with rollouts.jsonl)")
    p.add_argument("--step", type=int, default=0, help="the training step (0 = the last one logged)")
    p.add_argument("--worst", type=int, default=5, help="how many of the lowest-ranked completions")
    p.add_argument("--best", type=int, default=5, help="how many of the highest-ranked completions")
    p.add_argument("--by", default="reward", choices=["reward", "advantage", "length"], help="ranking key")
    a = p.parse_args(argv)
    path = os.path.join(a.run, "rollouts.jsonl")
    if not os.path.exists(path):
        raise SystemExit(f"completions: {path}: file not found (train with --log_completions N to write it)")
    rows = runlog.read_metrics(path)  # DataError naming a bad line
    step = a.step or max((r["step"] for r in rows), default=0)
    chosen = sorted((r for r in rows if r["step"] == step), key=lambda r: r[a.by])
    if not chosen:
        steps = sorted({r["step"] for r in rows})
        raise SystemExit(f"completions: {path}: no completions of step {step} (logged: "
                         f"{f'steps {steps[0]} to {steps[-1]}' if steps else 'none'})")
    result = {"step": step, "worst": chosen[:a.worst], "best": chosen[::-1][:a.best]}
    print(f"{path}: step {step}, {len(chosen)} logged completions, by {a.by}")
    for name in ("worst", "best"):
        print(f"{name}:")
        for r in result[name]:
            cut = " (truncated)" if r["truncated"] else ""
            print(f"  reward {r['reward']:+.3f} adv {r['advantage']:+.3f} correct {r['correct']:.0f} len "
                  f"{r['length']}{cut}  {r['prompt'][-60:]!r} -> {r['completion'][:200]!r}")
    return result


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    faults.watch(None, lambda: f"interrupted (Ctrl-C); run it again with: {faults.rerun_command(sys.argv)}")
    commands = {"compare": cmd_compare, "audit": cmd_audit, "contamination": cmd_contamination,
                "completions": cmd_completions, "bias": cmd_bias}
    if argv and argv[0] in commands:
        return commands[argv[0]](argv[1:])
    return cmd_evaluate(argv)


if __name__ == "__main__":
    with common.user_errors():  # bad data, a server that does not serve --model: one line, not a traceback
        main()
