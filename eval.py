"""Evaluation: the metrics the evaluation-practice reference ("GRPO for Reasoning-Model
Post-Training", 2026) and Bereket & Leskovec (2025) ask for, as a library and as a command.

    python eval.py --model runs/demo/final --task addition --n 16 --k 1,4,16   # JSON, Markdown, plots
    python eval.py --model Qwen/Qwen2.5-0.5B-Instruct --task gsm8k --n 8 --k 1,8 --limit 200
    python eval.py compare runs/grpo-calibration-tiny-s0 runs/rloo-calibration-tiny-s0   # no wandb needed
    python eval.py audit --reward math --file labelled.jsonl  # verifier recall/precision vs human labels
    python eval.py contamination --task gsm8k:data/gsm8k_{split}.jsonl --ngram 13
    python eval.py completions runs/grpo-addition-tiny-s0 --step 50 --worst 5 --best 5  # from --log_completions

Library: pass_at_k (unbiased, stable), maj_at_k and mean_at_k with bootstrap intervals,
expected_calibration_error (Bereket & Leskovec's right-closed bins), auroc and brier (scikit-learn),
reliability_diagram (PNG), verifier_audit, and evaluate(run) which
every train_*.py calls every --eval_every steps (eval/* metrics and runs/<run>/eval.json).
"""
import argparse
import collections
import json
import math
import os
import sys

import numpy as np
import torch

import common
import rewards

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
        raise ValueError(f"probs and labels must be 1-D and the same length (got {probs.shape}, {labels.shape})")
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
            idx = np.clip(np.searchsorted(edges, probs, side="left") - 1, 0, n_bins - 1)  # right-closed, as ECE
            used = [b for b in range(n_bins) if (idx == b).any()]
            xs, ys = [probs[idx == b].mean() for b in used], [labels[idx == b].mean() for b in used]
            ax.plot([0, 1], [0, 1], "k--", lw=0.8)
            ax.plot(xs, ys, "-", lw=1, color="C0")
            ax.scatter(xs, ys, s=[4 + 300 * (idx == b).mean() for b in used], color="C0", zorder=3)
            ax.set_title(f"{name}\nECE {expected_calibration_error(probs, labels):.3f}", fontsize=9)
            ax.set_xlabel("predicted probability", fontsize=8)
            ax.set_xlim(0, 1), ax.set_ylim(0, 1)
        axes[i][0].set_ylabel(f"{row_name}\nobserved frequency" if row_name else "observed frequency", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------- verifier audit (contamination: rewards.py)


def verifier_audit(score, rows: list, source: str = "audit", lines=None) -> dict:
    """A reward function `score(completion, example, finished)` against human labels. rows: {completion, answer, label}; label 1 =
    the completion is correct. Recall = share of human-correct rows the verifier accepts ("GRPO for Reasoning-Model Post-Training", 2026:
    rule-based verifiers missed 14%), precision = share of accepted rows that are correct."""
    tp = fp = fn = tn = 0
    disagree = []
    for i, row in enumerate(rows):
        for key in ("completion", "answer", "label"):
            if key not in row:
                raise rewards.DataError(f"{source}: {rewards.where(lines, i)}: missing field '{key}' (has: {sorted(row)})")
        if row["label"] not in (0, 1, True, False):
            raise rewards.DataError(f"{source}: {rewards.where(lines, i)}: label must be 0 or 1 (got {row['label']!r})")
        verdict = score(str(row["completion"]), {"answer": row["answer"]}, True).correct >= 1.0
        human = bool(row["label"])
        tp += verdict and human
        fp += verdict and not human
        fn += (not verdict) and human
        tn += (not verdict) and not human
        if verdict != human:
            disagree.append({"row": rewards.where(lines, i), "verifier": int(verdict), "human": int(human), **row})
    return {"rows": len(rows), "recall": tp / (tp + fn) if tp + fn else float("nan"),
            "precision": tp / (tp + fp) if tp + fp else float("nan"), "tp": tp, "fp": fp, "fn": fn, "tn": tn,
            "disagreements": disagree}


# ---------------------------------------------------------------------------------------------- evaluating a policy


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
    if task.kind == "ordinal":
        out["pass_rate"] = float(np.mean([s.reward >= task.pass_threshold for s in scores]))
    if task.kind == "probability":
        probs, labels = probability_predictions(scores, examples, n)
        out.update(ece=expected_calibration_error(probs, labels), auroc=auroc(probs, labels),
                   brier=brier(probs, labels), accuracy=float(np.mean((probs > 0.5) == (labels == 1))),
                   predictions={"probs": probs.tolist(), "labels": labels.tolist()})
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
    mine = common.shard(examples)
    # a rank with no example (more ranks than examples) still generates, on a stand-in it then drops:
    # under FSDP2 every forward of the HF engine is a collective that all ranks must join
    batch = mine or examples[:1]
    prompt_ids = common.encode_prompts(run.tokenizer, [e["prompt"] for e in batch], run.style == "chat")
    rollouts = common.generate(run.engine, run.model, prompt_ids, n, run.max_new_tokens, run.args.temperature,
                               seed=seed, device=run.device, dtype=run.dtype)
    scores = common.score_rollouts(run.task, run.tokenizer, batch, rollouts, n)[3][:len(mine) * n]
    return common.all_gather_objects(scores)


@torch.no_grad()
def evaluate(run) -> dict:
    """Held-out metrics (eval/*) for the run's current policy: pass@1, pass@k and maj@k with
    k = --eval_n, format failures, and for probability tasks ECE, AUROC, Brier; also writes
    <run_dir>/eval.json. The rollout engine is left as it was found: awake, with the policy's
    weights (the training loop pushed them just before); it is never put to sleep here."""
    args = run.args
    examples = run.task.test[: args.eval_limit or None]
    scores = sample_and_score(run, examples, args.eval_n, seed=common.rollout_seed(args.seed, -1, common.rank()))
    full = summarize(run.task, examples, scores, args.eval_n, sorted({1, args.eval_n}))
    k = args.eval_n
    metrics = {"eval/pass@1": full["pass@1"], "eval/pass@k": full[f"pass@{k}"], "eval/maj@k": full[f"maj@{k}"],
               "eval/format_fail": full["format_fail"], "eval/reward": full["reward"]}
    for key in ("ece", "auroc", "brier", "accuracy", "pass_rate"):
        if key in full:
            metrics[f"eval/{key}"] = full[key]
    if common.rank() == 0:  # every prediction: the scores of all ranks were gathered
        extra = {"predictions": full["predictions"]} if "predictions" in full else {}
        write_out(run.run_dir, "eval.json", {"step": run.step, "k": k, **metrics, **extra})
    return metrics


# ---------------------------------------------------------------------------------------------- command line


def write_out(out_dir: str, name: str, obj) -> str:
    """Write a string, or an object as JSON, to out_dir/name (creating the folder); returns the path."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    with open(path, "w") as f:
        f.write(obj if isinstance(obj, str) else json.dumps(obj, indent=2))
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


def cmd_evaluate(argv) -> dict:
    p = argparse.ArgumentParser(prog="eval.py", description="Evaluate a policy on a task's held-out split.")
    p.add_argument("--model", default="tiny", help="hub id, local path (e.g. runs/<run>/final) or 'tiny'")
    p.add_argument("--task", default="addition", help="as in training: addition, calibration, ordinal, gsm8k, math, jsonl:PATH")
    p.add_argument("--n", type=int, default=16, help="samples per question")
    p.add_argument("--k", default="1,4,16", help="comma-separated k for pass@k, maj@k, mean@k (each <= n)")
    p.add_argument("--split", default="test", choices=["test", "train"])
    p.add_argument("--limit", type=int, default=0, help="questions (0 = all)")
    p.add_argument("--engine", default="vllm", choices=["vllm", "hf"])
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max_new_tokens", type=int, default=0, help="0 = the task's default")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="", help="output folder (default runs/eval-<model>-<task>)")
    a = p.parse_args(argv)
    for flag, value, low in (("--n", a.n, 1), ("--limit", a.limit, 0), ("--max_new_tokens", a.max_new_tokens, 0)):
        if value < low:
            raise SystemExit(f"{flag} {value}: must be >= {low}")
    if not a.temperature > 0:
        raise SystemExit(f"--temperature {a.temperature}: must be > 0")
    try:
        ks = sorted({int(k) for k in a.k.split(",")})
    except ValueError:
        raise SystemExit(f"--k {a.k}: a comma-separated list of integers, e.g. 1,4,16") from None
    if not ks or min(ks) < 1 or max(ks) > a.n:
        raise SystemExit(f"--k {a.k}: every k must lie in 1..--n ({a.n})")
    if a.engine == "vllm":
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    args = common.Args(model=a.model, task=a.task, engine=a.engine, temperature=a.temperature, seed=a.seed,
                       max_new_tokens=a.max_new_tokens, dtype=a.dtype)
    style = common.prompt_style(a.model)
    task = rewards.load_task(a.task, style=style, seed=a.seed)
    common.model_path(a.model, task)  # builds the tiny model on first use, before torch.distributed starts
    device, dtype = common.setup_device(args)
    model, tok, path = common.load_model(args, task, device, dtype)
    model.eval()
    max_new = a.max_new_tokens or task.max_new_tokens
    examples = (task.test if a.split == "test" else task.train)[: a.limit or None]
    engine = common.make_engine(args, path, tok, device, dtype, max_len=min(
        getattr(model.config, "max_position_embeddings", 4096),
        max(len(x) for x in common.encode_prompts(tok, [e["prompt"] for e in examples], style == "chat")) + max_new + 8))
    run = argparse.Namespace(args=args, tokenizer=tok, style=style, engine=engine, model=model, max_new_tokens=max_new,
                             device=device, dtype=dtype, task=task)
    scores = sample_and_score(run, examples, a.n, seed=common.rollout_seed(a.seed, -1, common.rank()))
    result = {"model": a.model, "task": a.task, "split": a.split, "temperature": a.temperature,
              **summarize(task, examples, scores, a.n, ks, boot=True)}
    if common.rank() != 0:  # torchrun: every rank holds the same result (scores were gathered); rank 0 writes it
        return result
    out = a.out or os.path.join("runs", f"eval-{_model_name(a.model)}-{a.task.split(':')[0]}")
    write_out(out, "eval.json", result)
    rows = [{"k": k, **{m: result[f"{m}@{k}"] for m in ("pass", "maj", "mean")},
             **{f"{m} 95% CI": "[{:.3f}, {:.3f}]".format(*result[f"{m}@{k}_ci95"]) for m in ("pass", "maj")}} for k in ks]
    table = _markdown(rows, ["k", "pass", "pass 95% CI", "maj", "maj 95% CI", "mean"])
    extra = {k: result[k] for k in ("format_fail", "reward", "pass_rate", "ece", "auroc", "brier", "accuracy") if k in result}
    table += "\n" + _markdown([extra], list(extra))
    write_out(out, "eval.md", f"# {a.model} on {a.task} ({a.split}, {len(examples)} questions, n={a.n})\n\n" + table)
    _plot_pass_at_k(result, ks, os.path.join(out, "pass_at_k.png"))
    if task.kind == "probability":
        pred = result["predictions"]
        reliability_diagram({_model_name(a.model): (pred["probs"], pred["labels"])}, os.path.join(out, "reliability.png"))
    print(table, end="")
    print(f"wrote {out}/eval.json, eval.md, pass_at_k.png" + (", reliability.png" if task.kind == "probability" else ""))
    return result


def _plot_pass_at_k(result, ks, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(4, 3))
    for m in ("pass", "maj", "mean"):
        ax.plot(ks, [result[f"{m}@{k}"] for k in ks], "o-", label=f"{m}@k")
    ax.set_xscale("log", base=2), ax.set_xlabel("k (samples)"), ax.set_ylabel("accuracy"), ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


COMPARE_KEYS = ["reward/mean", "reward/correct", "adv/failed_pos_frac", "entropy", "eval/pass@1", "eval/pass@k",
                "eval/maj@k", "eval/format_fail", "eval/ece", "eval/auroc", "eval/brier", "eval/accuracy"]


def cmd_compare(argv) -> dict:
    p = argparse.ArgumentParser(prog="eval.py compare", description="Compare runs from their metrics.jsonl, no wandb needed.")
    p.add_argument("runs", nargs="+", help="run folders (each with metrics.jsonl)")
    p.add_argument("--out", default=os.path.join("runs", "compare"))
    p.add_argument("--last", type=int, default=10, help="training metrics: mean of the last N steps")
    a = p.parse_args(argv)
    data = {}
    for r in a.runs:
        path = os.path.join(r, "metrics.jsonl")
        if not os.path.exists(path):
            raise SystemExit(f"compare: {path}: file not found")
        rows = common.read_metrics(path)  # DataError naming a bad line
        missing = next((i + 1 for i, row in enumerate(rows) if not isinstance(row, dict) or "step" not in row), None)
        if missing:
            raise SystemExit(f"compare: {path}: row {missing} has no 'step': not a metrics.jsonl")
        data[os.path.basename(r.rstrip("/"))] = rows
    rows = []
    for name, m in data.items():
        row = {"run": name, "steps": m[-1]["step"] if m else 0}
        for key in COMPARE_KEYS:
            vals = [x[key] for x in m if key in x and not math.isnan(x[key])]
            if vals:  # eval/* : the last evaluation; training metrics: mean of the last N steps
                row[key] = vals[-1] if key.startswith("eval/") else float(np.mean(vals[-a.last:]))
        rows.append(row)
    columns = ["run", "steps"] + [k for k in COMPARE_KEYS if any(k in r for r in rows)]
    table = _markdown(rows, columns)
    write_out(a.out, "comparison.md", table)
    write_out(a.out, "comparison.json", rows)
    _plot_curves(data, [k for k in ("reward/mean", "eval/pass@1", "eval/ece") if k in columns],
                 os.path.join(a.out, "curves.png"))
    print(table, end="")
    print(f"wrote {a.out}/comparison.md, comparison.json, curves.png")
    return {"rows": rows}


def _plot_curves(data, keys, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, max(1, len(keys)), figsize=(4 * max(1, len(keys)), 3), squeeze=False)
    for ax, key in zip(axes[0], keys):
        for name, m in data.items():
            pts = [(x["step"], x[key]) for x in m if key in x and not math.isnan(x[key])]
            if pts:
                ax.plot(*zip(*pts), "o-" if len(pts) < 20 else "-", label=name, ms=3)
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


def cmd_audit(argv) -> dict:
    p = argparse.ArgumentParser(prog="eval.py audit", description="The reward function against human labels.")
    p.add_argument("--reward", default="math", choices=sorted(rewards.JSONL_REWARDS),
                   help="the verifier: math (math-verify on the last \\boxed{}, as gsm8k/math) | exact")
    p.add_argument("--file", required=True, help="JSONL: {completion, answer, label (1 = correct)} per line")
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    rows, lines = rewards.read_jsonl_numbered(a.file)
    result = verifier_audit(rewards.JSONL_REWARDS[a.reward], rows, a.file, lines)
    return _report(a.out, "audit.json", result,
                   f"{a.file}: {result['rows']} rows, recall {result['recall']:.3f}, precision {result['precision']:.3f}, "
                   f"{len(result['disagreements'])} disagreements",
                   [f"{d['row']}: verifier {d['verifier']} human {d['human']}: {str(d['completion'])[:100]!r}"
                    for d in result["disagreements"]])


def cmd_contamination(argv) -> dict:
    p = argparse.ArgumentParser(prog="eval.py contamination", description="Word n-gram overlap of training and evaluation prompts.")
    p.add_argument("--task", required=True, help="checks the task's train split against its test split")
    p.add_argument("--ngram", type=int, default=13)
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    if a.ngram < 1:
        raise SystemExit(f"--ngram {a.ngram}: must be >= 1 (a 0-gram is in every prompt)")
    task = rewards.load_task(a.task, style="chat")
    result = rewards.ngram_overlap([e["prompt"] for e in task.train], [e["prompt"] for e in task.test], a.ngram)
    return _report(a.out, "contamination.json", result,
                   f"{a.task}: {len(result['pairs'])} of {len(task.test)} held-out prompts ({result['share']:.1%}) "
                   f"share a {a.ngram}-gram with a training prompt",
                   [f"test {q['eval']} ~ train {q['train']}: {q['ngram']!r}" for q in result["pairs"]])


def cmd_completions(argv) -> dict:
    p = argparse.ArgumentParser(prog="eval.py completions",
                                description="The worst and best completions of a training step, from the rollouts.jsonl "
                                            "that --log_completions writes: where reward hacking shows first.")
    p.add_argument("run", help="run folder (with rollouts.jsonl)")
    p.add_argument("--step", type=int, default=0, help="the training step (0 = the last one logged)")
    p.add_argument("--worst", type=int, default=5, help="how many of the lowest-ranked completions")
    p.add_argument("--best", type=int, default=5, help="how many of the highest-ranked completions")
    p.add_argument("--by", default="reward", choices=["reward", "advantage", "length"], help="ranking key")
    a = p.parse_args(argv)
    path = os.path.join(a.run, "rollouts.jsonl")
    if not os.path.exists(path):
        raise SystemExit(f"completions: {path}: file not found (train with --log_completions N to write it)")
    rows = common.read_metrics(path)  # DataError naming a bad line
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
            print(f"  reward {r['reward']:+.3f} adv {r['advantage']:+.3f} correct {r['correct']:.0f} len {r['length']}"
                  f"{' (truncated)' if r['truncated'] else ''}  {r['prompt'][-60:]!r} -> {r['completion'][:200]!r}")
    return result


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"compare": cmd_compare, "audit": cmd_audit, "contamination": cmd_contamination,
                "completions": cmd_completions}
    if argv and argv[0] in commands:
        return commands[argv[0]](argv[1:])
    return cmd_evaluate(argv)


if __name__ == "__main__":
    try:
        main()
    except rewards.DataError as e:
        raise SystemExit(f"error: {e}") from None
