"""VinePPO, the worked example of docs/algorithms.md (train_vineppo.py built from the page's own lines),
against GRPO on the built-in tiny model: the same task, steps, prompts per step, completions per prompt and
seeds. Per run: the training reward (first and last 10 steps), held-out pass@1 at the end (45 sums, 8
samples each), the continuations VinePPO samples per step, the rollout's share of a step, the minutes.

    python reproduce/vineppo.py                          # seeds 0-4, both arms (~17 min on 2 cores)
    python reproduce/vineppo.py --seeds 5 6 --steps 50  # other seeds or budgets: other run folders

A finished run (its metrics.jsonl reaching --steps) is reused. Writes OUT/results.json and OUT/table.md: the
per-run table, then `eval.py compare`'s verdict over the seeds (IQM of held-out pass@1 with 95% stratified-
bootstrap intervals, and P(GRPO beats VinePPO)).
"""
import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, ROOT)


def flags(args, seed: int) -> list:
    return ["--engine", "hf", "--task", "addition:14", "--steps", str(args.steps), "--prompts_per_step",
            str(args.prompts_per_step), "--group_size", str(args.group_size), "--seed", str(seed),
            "--eval_every", str(args.steps), "--eval_n", "8", "--save_every", "-1", "--wandb", "false",
            "--print_every", "0", "--out_dir", args.out]


def read(path: str) -> list:
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []


def train(script: str, name: str, argv: list, out: str, steps: int) -> tuple:
    """(metrics rows, minutes) of a run, reused when it reached `steps`."""
    metrics, timing = os.path.join(out, name, "metrics.jsonl"), os.path.join(out, name, "minutes.json")
    rows = read(metrics)
    if not rows or rows[-1]["step"] != steps or not os.path.exists(timing):
        start = time.perf_counter()
        env = {**os.environ, "PYTHONPATH": ROOT, "WANDB_MODE": "disabled"}
        done = subprocess.run([sys.executable, script, *argv, "--run_name", name, "--overwrite", "true"],
                              cwd=ROOT, env=env, capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"{name}: {script} failed ({done.returncode}):\n{done.stderr[-2000:]}")
        json.dump({"minutes": (time.perf_counter() - start) / 60}, open(timing, "w"))
        rows = read(metrics)
    return rows, json.load(open(timing))["minutes"]


def summary(algo: str, seed: int, rows: list, minutes: float) -> dict:
    mean = lambda key, part: sum(r[key] for r in part) / len(part)  # noqa: E731
    times = {k: sum(r.get(f"time/{k}", 0.0) for r in rows) for k in ("rollout", "update", "push")}
    return {"algo": algo, "seed": seed, "reward_first10": mean("reward/mean", rows[:10]),
            "reward_last10": mean("reward/mean", rows[-10:]), "heldout_pass@1": rows[-1]["eval/pass@1"],
            "continuations_per_step": mean("vineppo/continuations", rows) if algo == "vineppo" else 0.0,
            "rollout_share": times["rollout"] / sum(times.values()), "minutes": minutes}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--prompts_per_step", type=int, default=32)
    p.add_argument("--group_size", type=int, default=8)
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "vineppo"))
    args = p.parse_args()
    if any(s < 0 for s in args.seeds):
        sys.exit(f"--seeds {args.seeds}: seeds are non-negative integers")
    os.makedirs(args.out, exist_ok=True)
    from test_siblings import worked_example
    script = os.path.join(args.out, "train_vineppo.py")
    open(script, "w").write(worked_example("vineppo"))  # as docs/algorithms.md builds it, today
    results, folders = [], {"grpo": [], "vineppo": []}
    for seed in args.seeds:
        for algo, path in (("grpo", os.path.join(ROOT, "train_grpo.py")), ("vineppo", script)):
            name = f"{algo}-s{seed}-{args.steps}x{args.prompts_per_step}x{args.group_size}"
            folders[algo].append(os.path.join(args.out, name))
            rows, minutes = train(path, name, flags(args, seed), args.out, args.steps)
            results.append(summary(algo, seed, rows, minutes))
            r = results[-1]
            print(f"{algo:8s} seed {seed}: reward {r['reward_first10']:.3f} -> {r['reward_last10']:.3f} | "
                  f"held-out pass@1 {r['heldout_pass@1']:.3f} | rollout {r['rollout_share']:.0%} of a step | "
                  f"{r['minutes']:.1f} min", flush=True)
    json.dump(results, open(os.path.join(args.out, "results.json"), "w"), indent=1)
    lines = ["| arm | seed | training reward, first -> last 10 steps | held-out pass@1 | continuations / "
             "step | rollout share | minutes |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['algo']} | {r['seed']} | {r['reward_first10']:.3f} -> {r['reward_last10']:.3f} | "
              f"{r['heldout_pass@1']:.3f} | {r['continuations_per_step']:.0f} | {r['rollout_share']:.0%} | "
              f"{r['minutes']:.1f} |" for r in results]
    compare = subprocess.run([sys.executable, os.path.join(ROOT, "eval.py"), "compare", "--out",
                              os.path.join(args.out, "compare"), "--metric", "eval/pass@1,reward/mean"]
                             + [f"--group={a}={','.join(f)}" for a, f in folders.items()],
                             cwd=ROOT, capture_output=True, text=True)
    if compare.returncode:
        sys.exit(f"eval.py compare failed:\n{compare.stderr[-2000:]}")
    verdict = compare.stdout[compare.stdout.index("Per group"):] if len(args.seeds) > 1 else ""
    open(os.path.join(args.out, "table.md"), "w").write("\n".join(lines) + "\n\n" + verdict)
    print("\n".join(lines) + "\n\n" + verdict)


if __name__ == "__main__":
    main()
