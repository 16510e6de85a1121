"""Seed 000's question through the real trainers: the built-in tiny model on the `calibration` task
(20 categories, log-likelihood reward), one run per algorithm, each evaluated on the held-out questions
(prediction per question = mean of its sampled probabilities; ECE, AUROC, accuracy at 0.5).

    python reproduce/seed000_lm.py                                   # six algorithms, seed 0
    python reproduce/seed000_lm.py --seeds 0,1,2,3,4 --algos grpo,grpo_nostd,rloo,ppo  # the tuning seeds

Seeds 0-4 fixed the configuration (the defaults below); 5-9 are held out (`make reproduce` runs them).
"""
import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from eval import plot_curves, write_results  # noqa: E402
from rlmini import runlog  # noqa: E402

CURVE_KEYS = ("eval/ece", "eval/auroc", "entropy")  # kept per step in results.json; drawn by curves()

# name -> (label, script, flags): every trainer with its defaults; only GRPO's std switch differs
ALGOS = {
    "grpo": ("GRPO", "train_grpo.py", []),
    "grpo_nostd": ("GRPO (no std)", "train_grpo.py", ["--std_norm", "false"]),
    "rloo": ("RLOO", "train_rloo.py", []),
    "ppo": ("PPO", "train_ppo.py", []),
    "gpg": ("GPG", "train_gpg.py", []),
    "corpo": ("CoRPO", "train_corpo.py", []),
}


def run_one(algo: str, seed: int, a, threads: int) -> dict:
    """Train one algorithm, evaluate at the end; returns the eval/* metrics and the predictions."""
    label, script, flags = ALGOS[algo]
    name = f"{algo}-s{seed}"
    cmd = [sys.executable, os.path.join(ROOT, script), "--task", "calibration", "--engine", a.engine,
           "--steps", str(a.steps), "--prompts_per_step", str(a.prompts_per_step), "--group_size",
           str(a.group_size),
           "--micro_batch_size", str(a.prompts_per_step * a.group_size),  # one forward: 2x faster on CPU
           "--lr", str(a.lr), "--lr_schedule", a.lr_schedule, "--warmup", str(a.warmup), "--seed", str(seed),
           "--eval_every", str(a.eval_every or a.steps), "--eval_n", str(a.eval_n),
           "--eval_limit", str(a.eval_limit), "--save_every", str(a.steps), "--out_dir", a.out, "--run_name",
           name,
           "--overwrite", "true", "--wandb", "false", *flags]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    with open(os.path.join(a.out, name, "eval.json")) as f:
        ev = json.load(f)
    rows = runlog.read_metrics(os.path.join(a.out, name, "metrics.jsonl"))
    curve = {key: {r["step"]: r[key] for r in rows if key in r} for key in CURVE_KEYS}
    return {"algo": algo, "label": label, "seed": seed, "seconds": time.time() - t0,
            "command": " ".join(cmd[1:]),
            **{k: ev[f"eval/{k}"] for k in ("ece", "auroc", "accuracy", "brier", "reward")},
            "curve": curve, "predictions": ev["predictions"]}


def oracle(seed: int, eval_limit: int) -> dict:
    """The task's true rates as predictions on the same held-out questions (the task's seed is the run's)."""
    import rewards
    from eval import auroc, brier, expected_calibration_error
    test = rewards.load_task("calibration", seed=seed).test[: eval_limit or None]
    p, y = np.array([e["p_true"] for e in test]), np.array([e["answer"] for e in test])
    return {"algo": "oracle", "label": "true rates p_c (oracle)", "seed": seed,
            "ece": expected_calibration_error(p, y),
            "auroc": auroc(p, y), "accuracy": float(np.mean((p > 0.5) == (y == 1))), "brier": brier(p, y)}


def run_all(algos, seeds, a) -> list:
    jobs = max(1, a.jobs)
    threads = max(1, (os.cpu_count() or 1) // jobs)
    todo = [(algo, seed) for seed in seeds for algo in algos]
    with ThreadPoolExecutor(jobs) as pool:
        return list(pool.map(lambda x: run_one(x[0], x[1], a, threads), todo))


def table(results: list, eval_limit: int) -> str:
    """Markdown: one row per algorithm, with one seed its values; with several, the interquartile mean over
    seeds and its 95% stratified-bootstrap interval (eval.py's estimators, Agarwal et al. 2021); last, the
    true rates of the same questions. With several seeds also: ECE per seed, ECE over steps (IQM across
    seeds), and against GRPO the probability of improvement over pairs of seeds and the per-seed ratio."""
    from eval import (
        aggregate_scores,
        probability_of_improvement,
        probability_of_improvement_ci,
        stratified_bootstrap_ci,
    )
    seeds = list(dict.fromkeys(r["seed"] for r in results))
    results = results + [oracle(s, eval_limit) for s in seeds]
    algos = list(dict.fromkeys(r["algo"] for r in results))
    runs = {a: {r["seed"]: r for r in results if r["algo"] == a} for a in algos}
    label = {a: next(iter(runs[a].values()))["label"] for a in algos}
    lines = ["| algorithm | ECE | AUROC | accuracy | Brier | seeds |", "|---|---|---|---|---|---|"]
    for algo in algos:
        rs = list(runs[algo].values())

        def cell(key):
            v = [r[key] for r in rs]
            if len(v) == 1:
                return f"{v[0]:.3f}"
            lo, hi = stratified_bootstrap_ci(v, "iqm")
            return f"{aggregate_scores(v, 'iqm'):.3f} [{lo:.3f}, {hi:.3f}]"
        lines.append(f"| {label[algo]} | {cell('ece')} | {cell('auroc')} | {cell('accuracy')} | "
                     f"{cell('brier')} | {','.join(str(r['seed']) for r in rs)} |")
    if len(seeds) < 2:
        return "\n".join(lines)
    lines += ["", "| ECE per seed | " + " | ".join(f"seed {s}" for s in seeds) + " |",
              "|---|" + "---|" * len(seeds)]
    lines += [f"| {label[a]} | " + " | ".join(f"{runs[a][s]['ece']:.3f}" if s in runs[a] else ""
                                             for s in seeds) + " |" for a in algos]
    steps = sorted({int(t) for r in results for t in r.get("curve", {}).get("eval/ece", {})})
    if len(steps) > 1:  # the curves' numbers: converged means the last columns agree
        lines += ["", "| ECE at step (IQM over seeds) | " + " | ".join(map(str, steps)) + " |",
                  "|---|" + "---|" * len(steps)]
        for a in algos:
            if a == "oracle":
                continue
            # step keys are ints after a run, strings after a round trip through results.json
            ece = [{int(t): v for t, v in r["curve"]["eval/ece"].items()} for r in runs[a].values()]
            per_step = [[c[t] for c in ece if t in c] for t in steps]
            lines.append(f"| {label[a]} | " + " | ".join(f"{aggregate_scores(v, 'iqm'):.3f}" if v else ""
                                                         for v in per_step) + " |")
    if "grpo" in runs:
        lines += ["", "| X | P(ECE of GRPO > ECE of X), pairs of seeds [95% interval] | ECE of GRPO / ECE of "
                  "X per seed: range (values) |", "|---|---|---|"]
        g = runs["grpo"]
        for a in algos:
            if a in ("grpo", "oracle"):
                continue
            x = runs[a]
            ece_g, ece_x = [r["ece"] for r in g.values()], [r["ece"] for r in x.values()]
            p = probability_of_improvement(ece_g, ece_x)
            lo, hi = probability_of_improvement_ci(ece_g, ece_x)
            ratio = [g[s]["ece"] / x[s]["ece"] for s in seeds if s in g and s in x]
            values = ", ".join(f"{v:.1f}" for v in ratio)
            lines.append(f"| {label[a]} | {p:.2f} [{lo:.2f}, {hi:.2f}] | "
                         f"{min(ratio):.1f} to {max(ratio):.1f} ({values}) |")
    return "\n".join(lines)


def curves(results: list, path: str) -> None:
    """ECE, AUROC and entropy over steps, one line per algorithm: the IQM across seeds with a 95% band
    (eval.py's compare plot)."""
    groups = {}
    for r in results:
        rows = {}
        for key, c in r["curve"].items():
            for t, v in c.items():
                rows.setdefault(int(t), {"step": int(t)})[key] = v
        groups.setdefault(r["label"], []).append([rows[t] for t in sorted(rows)])
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    plot_curves(groups, list(CURVE_KEYS), path)


def parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--algos", default=",".join(ALGOS), help=f"comma-separated, from {','.join(ALGOS)}")
    p.add_argument("--seeds", default="0", help="comma-separated seeds (one run per algorithm and seed)")
    p.add_argument("--steps", type=int, default=300, help="training steps per run")
    # 128 prompts commit early to a two-cluster answer (ECE flat at 0.08); 512 tell the categories apart
    p.add_argument("--prompts_per_step", type=int, default=512, help="prompts per rollout batch")
    p.add_argument("--group_size", type=int, default=8, help="completions per prompt")
    p.add_argument("--lr", type=float, default=3e-4, help="learning rate (same for every algorithm)")
    p.add_argument("--lr_schedule", default="constant", choices=["constant", "linear", "cosine"],
                   help="lr after the warm-up: constant, or decaying to 0 at the last step")
    p.add_argument("--warmup", type=int, default=0, help="linear lr warm-up steps")
    p.add_argument("--eval_every", type=int, default=50,
                   help="evaluate every this many steps (0: at the end)")
    p.add_argument("--eval_n", type=int, default=8, help="samples per held-out question")
    p.add_argument("--eval_limit", type=int, default=2000, help="held-out questions (0 = all 2,000)")
    p.add_argument("--engine", default="hf", choices=["hf", "vllm"],
                   help="rollout engine (hf is faster for the tiny model)")
    p.add_argument("--jobs", type=int, default=2, help="runs in parallel")
    p.add_argument("--out", default="runs/seed000_lm", help="folder for the runs, results.json and table.md")
    return p


def main(argv=None):
    a = parser().parse_args(argv)
    algos = [x for x in a.algos.split(",") if x]
    unknown = sorted(set(algos) - set(ALGOS))
    if unknown:
        raise SystemExit(f"--algos: unknown {unknown}; choose from {','.join(ALGOS)}")
    seeds = [int(s) for s in a.seeds.split(",") if s]
    t0 = time.time()
    results = run_all(algos, seeds, a)
    write_results(a.out, {"config": vars(a), "wall_seconds": time.time() - t0, "results": results},
                  table(results, a.eval_limit))
    curves(results, os.path.join(a.out, "curves.png"))
    print(f"{len(results)} runs in {time.time() - t0:.0f} s")
    return results


if __name__ == "__main__":
    main()
