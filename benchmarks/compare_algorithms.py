"""Every algorithm's short CPU run on the built-in tasks: reward at the start and the end, the share
of failed completions given a positive advantage, and the wall time. Prints a Markdown table.

    python benchmarks/compare_algorithms.py                    # 150 steps each, HF engine, seed 0
    python benchmarks/compare_algorithms.py --steps 300 --seed 1 --engine vllm
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = [("grpo", "addition"), ("rloo", "addition"), ("ppo", "addition"), ("gpg", "addition"),
        ("grpo", "ordinal"), ("corpo", "ordinal")]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine", default="hf")
    args = p.parse_args()
    k = max(1, min(10, args.steps // 10))
    print(f"| script | task | reward, first {k} steps | reward, last {k} steps | failed_pos_frac, first {k} "
          f"| wall s |")
    print("|---|---|---|---|---|---|")
    for algo, task in RUNS:
        with tempfile.TemporaryDirectory() as out:
            t0 = time.perf_counter()
            subprocess.run([sys.executable, os.path.join(ROOT, f"train_{algo}.py"), "--task", task, "--steps",
                            str(args.steps), "--seed", str(args.seed), "--engine", args.engine, "--out_dir",
                            out,
                            "--run_name", "r", "--wandb", "false", "--save_every", "0"],
                           check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            wall = time.perf_counter() - t0
            with open(os.path.join(out, "r", "metrics.jsonl")) as f:
                rows = [json.loads(line) for line in f]
        first = statistics.mean(r["reward/mean"] for r in rows[:k])
        last = statistics.mean(r["reward/mean"] for r in rows[-k:])
        fpf = [r["adv/failed_pos_frac"] for r in rows[:k] if "adv/failed_pos_frac" in r]  # absent: no failure
        print(f"| train_{algo}.py | {task} | {first:.3f} | {last:.3f} | "
              f"{statistics.mean(fpf) if fpf else float('nan'):.3f} | {wall:.0f} |")


if __name__ == "__main__":
    main()
