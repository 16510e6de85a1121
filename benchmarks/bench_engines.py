"""Throughput of the default GRPO run with each rollout engine: a table of steps/s and where the
time goes (rollout, update, weight push), plus reward before and after.

    python benchmarks/bench_engines.py                  # tiny model, addition, 100 steps per engine
    python benchmarks/bench_engines.py --steps 300 --engines vllm
    python benchmarks/bench_engines.py --model Qwen/Qwen2.5-0.5B-Instruct --task gsm8k --steps 5 --engines hf
Each engine runs in its own process (a vLLM engine is process-wide). Prints a Markdown table.
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


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--engines", default="hf,vllm")
    p.add_argument("--skip", type=int, default=5, help="first steps left out of the timing (warm-up)")
    args, extra = p.parse_known_args()
    rows = []
    for engine in args.engines.split(","):
        with tempfile.TemporaryDirectory() as out:
            t0 = time.perf_counter()
            cmd = [sys.executable, os.path.join(ROOT, "train_grpo.py"), "--engine", engine, "--steps",
                   str(args.steps),
                   "--out_dir", out, "--run_name", "bench", "--wandb", "false", "--save_every", "0", *extra]
            subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            wall = time.perf_counter() - t0
            with open(os.path.join(out, "bench", "metrics.jsonl")) as f:
                m = [json.loads(line) for line in f][args.skip:]
        step_s = [r["time/rollout"] + r["time/update"] + r["time/push"] for r in m]
        mean = lambda k: statistics.mean(r[k] for r in m)
        k = max(1, min(10, len(m) // 5))
        rows.append((engine, 1 / statistics.mean(step_s), mean("time/rollout"), mean("time/update"),
                     mean("time/push"), mean("perf/tokens_per_s"),
                     statistics.mean(r["reward/mean"] for r in m[:k]),
                     statistics.mean(r["reward/mean"] for r in m[-k:]), wall))
    print("| engine | steps/s | rollout s | update s | push s | tokens/s | reward first | reward last "
          "| wall s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]:.2f} | {r[2]:.3f} | {r[3]:.3f} | {r[4]:.3f} | {r[5]:.0f} | {r[6]:.3f} | "
              f"{r[7]:.3f} | {r[8]:.0f} |")


if __name__ == "__main__":
    main()
