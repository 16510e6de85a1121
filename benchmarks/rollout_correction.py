"""Each --rollout_correction mode on a short GRPO run with a real sampler/trainer mismatch: vLLM
sampling in bf16 (its own CPU kernels) against the trainer in bf16 autocast with fp32 master weights.
Prints a Markdown table: reward at the start and the end, the mismatch (mean |sampler - trainer|
log-prob, k3 KL), the mean weight and the share of tokens the mode truncated or dropped.

    python benchmarks/rollout_correction.py                       # 100 steps per mode, bf16, vLLM, seed 0
    python benchmarks/rollout_correction.py --dtype float32 --engine hf --sampler_temperature 1.5

--sampler_temperature T makes the mismatch large and known: the engine samples at T while the
trainer's policy is at --temperature 1 (the sampler's log-probs are its own, at T), so w is a true
importance ratio pi_trainer / pi_sampler and the guard is widened to let the run go on.
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
HOT = """import runpy, sys
from rlmini.engine import HFEngine, VLLMEngine
def hot(generate):
    return lambda engine, prompt_ids, n, max_new_tokens, temperature, seed: generate(
        engine, prompt_ids, n, max_new_tokens, {t}, seed)
HFEngine.generate, VLLMEngine.generate = hot(HFEngine.generate), hot(VLLMEngine.generate)
sys.argv = ["train_grpo.py", *sys.argv[1:]]
runpy.run_path("train_grpo.py", run_name="__main__")
"""


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--engine", default="vllm")
    p.add_argument("--task", default="addition")
    p.add_argument("--sampler_temperature", type=float, default=0.0,
                   help="sample at this temperature (0 = as trained)")
    args = p.parse_args()
    # the engine samples at --sampler_temperature: generate wrapped, then the script run as __main__
    launch = ([sys.executable, "-c", HOT.format(t=args.sampler_temperature)] if args.sampler_temperature
              else [sys.executable, os.path.join(ROOT, "train_grpo.py")])
    extra = ["--sampler_diff_tol", "100"] if args.sampler_temperature else []
    k = max(1, min(10, args.steps // 10))
    print(f"| mode | reward, first {k} | reward, last {k} | sampler_diff | is/kl | is/mean | is/clip_frac "
          f"| wall s |")
    print("|---|---|---|---|---|---|---|---|")
    for mode in MODES:
        with tempfile.TemporaryDirectory() as out:
            t0 = time.perf_counter()
            subprocess.run([*launch, "--task", args.task, "--steps", str(args.steps), "--seed",
                            str(args.seed),
                            "--engine", args.engine, "--dtype", args.dtype, "--rollout_correction", mode,
                            "--out_dir", out, "--run_name", "r", "--wandb", "false", "--save_every", "0",
                            *extra],
                           check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            wall = time.perf_counter() - t0
            with open(os.path.join(out, "r", "metrics.jsonl")) as f:
                rows = [json.loads(line) for line in f]
        mean = lambda key, part=rows: statistics.mean(r[key] for r in part)  # noqa: E731
        print(f"| {mode} | {mean('reward/mean', rows[:k]):.3f} | {mean('reward/mean', rows[-k:]):.3f} | "
              f"{mean('logprob/sampler_diff'):.2e} | {mean('is/kl'):.2e} | {mean('is/mean'):.5f} | "
              f"{mean('is/clip_frac'):.2e} | {wall:.0f} |")


if __name__ == "__main__":
    main()
