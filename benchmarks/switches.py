"""What each of the researchers' switches does, on the built-in tasks: short runs with the switch off and on,
one table (Markdown). Every number is a mean over the last `--last` steps of a run unless the column says
otherwise; `reward` is the policy's own first-round success rate (comparable with resampling on or off).

    python benchmarks/switches.py                       # ~4 min on 2 CPU cores (HF engine, tiny model)
    python benchmarks/switches.py --steps 80 --seed 1   # longer, another seed

Rows (each against its own baseline row, same seed and steps):
- dynamic sampling (GRPO, addition): the trained batch's zero-variance share falls to 0, the reward per
  optimizer step rises, at the price of extra rollouts;
- overlong handling (GRPO, addition: a completion with no EOS within the task's 4 tokens is truncated, 14%
  of the baseline's late batches; every correct answer fits in 3, so a 1-token buffer penalises only
  wrong ones): the soft penalty drives len/truncated down, masking leaves truncation unpunished;
- entropy bonus and top-entropy tokens (GRPO, addition): entropy rises with the bonus; the mask keeps the
  top share of tokens (entropy/threshold);
- --std_level batch and --surrogate cispo (GRPO, addition, 2 passes x 2 minibatches for CISPO).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ROWS = [  # (switch, the run's flags); the first row of each block is its baseline
    ("baseline", []),
    ("--dynamic_sampling true", ["--dynamic_sampling", "true", "--max_sampling_rounds", "8"]),
    ("--entropy_coef 0.05", ["--entropy_coef", "0.05"]),
    ("--top_entropy_quantile 0.2", ["--top_entropy_quantile", "0.2"]),
    ("--std_level batch", ["--std_level", "batch"]),
    ("2 passes x 2 minibatches", ["--updates_per_rollout", "2", "--minibatches", "2"]),
    ("  + --surrogate cispo", ["--updates_per_rollout", "2", "--minibatches", "2", "--surrogate", "cispo"]),
    ("--mask_truncated true", ["--mask_truncated", "true"]),
    ("--overlong_buffer 1", ["--overlong_buffer", "1"]),
    ("--overlong_buffer 1 --overlong_penalty 0.1", ["--overlong_buffer", "1", "--overlong_penalty", "0.1"]),
]
COLUMNS = ["reward", "frac_reward_zero_std", "sampling/kept_zero_std", "sampling/rounds", "rollouts",
           "entropy",
           "entropy/threshold", "clip_frac", "adv/abs_mean", "len/mean", "len/truncated"]


def run(name, flags, steps, seed, prompts, out):
    cmd = [sys.executable, os.path.join(ROOT, "train_grpo.py"), "--engine", "hf", "--wandb", "false",
           "--steps",
           str(steps), "--prompts_per_step", str(prompts), "--seed", str(seed), "--save_every", "0",
           "--out_dir", out,
           "--run_name", name, *flags]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "WANDB_MODE": "disabled"})
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in open(os.path.join(out, name, "metrics.jsonl"))]
    return rows, time.perf_counter() - t0


def summary(rows, last, group_size, prompts):
    tail = rows[-last:]
    mean = lambda k: sum(r[k] for r in tail) / len(tail)
    out = {k: mean(k) for k in COLUMNS if k in tail[0]}
    out["reward"] = mean("reward/mean")
    # all steps
    out["rollouts"] = sum(r["sampling/extra_rollouts"] for r in rows) + len(rows) * group_size * prompts
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--last", type=int, default=10, help="average the metrics over the last N steps")
    p.add_argument("--prompts", type=int, default=16, help="prompts per step (8 completions each)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    table = []
    with tempfile.TemporaryDirectory() as out:
        for i, (label, flags) in enumerate(ROWS):
            rows, seconds = run(f"row{i}", flags, a.steps, a.seed, a.prompts, out)
            table.append((label, summary(rows, a.last, 8, a.prompts)))
            print(f"{label}: done in {seconds:.0f} s", file=sys.stderr)
    print(f"GRPO on `addition`, tiny model, HF engine, {a.prompts} prompts x 8, {a.steps} steps, seed "
          f"{a.seed}; means over the last {a.last} steps (rollouts: all steps)\n")
    print("| switch | " + " | ".join(COLUMNS) + " |")
    print("|---|" + "---|" * len(COLUMNS))
    for label, s in table:
        cells = [f"{s[k]:.0f}" if k == "rollouts" else f"{s[k]:.3f}" if k in s else "" for k in COLUMNS]
        print(f"| {label} | " + " | ".join(cells) + " |")
    return table


if __name__ == "__main__":
    main()
