"""Each --rollout_correction mode on a short GRPO run with a real sampler/trainer mismatch: vLLM
sampling in bf16 (its own CPU kernels) against the trainer in bf16 autocast with fp32 master weights.
Prints a Markdown table: reward at the start and the end, the mismatch (mean |sampler - trainer|
log-prob, k3 KL), the mean weight and the share of tokens the mode truncated or dropped.

    python benchmarks/rollout_correction.py                       # 100 steps per mode, bf16, vLLM, seed 0
    python benchmarks/rollout_correction.py --steps 300 --dtype float32 --engine hf
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
MODES = ["off", "token-tis", "token-mis", "seq-mis"]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--engine", default="vllm")
    p.add_argument("--task", default="addition")
    args = p.parse_args()
    k = max(1, min(10, args.steps // 10))
    print(f"| mode | reward, first {k} | reward, last {k} | sampler_diff | is/kl | is/mean | is/clip_frac | wall s |")
    print("|---|---|---|---|---|---|---|---|")
    for mode in MODES:
        with tempfile.TemporaryDirectory() as out:
            t0 = time.perf_counter()
            subprocess.run([sys.executable, os.path.join(ROOT, "train_grpo.py"), "--task", args.task, "--steps",
                            str(args.steps), "--seed", str(args.seed), "--engine", args.engine, "--dtype", args.dtype,
                            "--rollout_correction", mode, "--out_dir", out, "--run_name", "r", "--wandb", "false",
                            "--save_every", "0"], check=True, cwd=ROOT, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
            wall = time.perf_counter() - t0
            with open(os.path.join(out, "r", "metrics.jsonl")) as f:
                rows = [json.loads(line) for line in f]
        mean = lambda key, part=rows: statistics.mean(r[key] for r in part)  # noqa: E731
        print(f"| {mode} | {mean('reward/mean', rows[:k]):.3f} | {mean('reward/mean', rows[-k:]):.3f} | "
              f"{mean('logprob/sampler_diff'):.2e} | {mean('is/kl'):.2e} | {mean('is/mean'):.5f} | "
              f"{mean('is/clip_frac'):.2e} | {wall:.0f} |")


if __name__ == "__main__":
    main()
