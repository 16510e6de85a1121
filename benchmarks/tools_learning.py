"""The learning curves of tool runs against the same runs without tools (docs/tools.md, "Learning to use the
tool"): reward/correct averaged over windows of steps, and, with tools, the share of trajectories that called.

    for s in 0 1; do
      python train_grpo.py --task modmul --engine hf --tools python --steps 150 --seed $s --run_name tools-s$s
      python train_grpo.py --task modmul --engine hf --steps 150 --seed $s --run_name notools-s$s
    done
    python benchmarks/tools_learning.py runs/tools-s0 runs/notools-s0 runs/tools-s1 runs/notools-s1
"""
import json
import os
import sys

WINDOWS = [(1, 10), (41, 50), (91, 100), (141, 150)]


def main(runs):
    print("| run | " + " | ".join(f"steps {a}-{b}" for a, b in WINDOWS) + " |")
    print("|---|" + "---|" * len(WINDOWS))
    for run in runs:
        by_step = {}
        for line in open(os.path.join(run, "metrics.jsonl")):
            row = json.loads(line)
            by_step[row["step"]] = row
        cells = []
        for a, b in WINDOWS:
            rows = [by_step[s] for s in range(a, b + 1) if s in by_step]
            if len(rows) < b - a + 1:
                cells.append("-")
                continue
            cell = f"{sum(r['reward/correct'] for r in rows) / len(rows):.3f}"
            if "tools/call_frac" in rows[0]:
                cell += f" (calls {sum(r['tools/call_frac'] for r in rows) / len(rows):.2f})"
            cells.append(cell)
        print(f"| {os.path.basename(run.rstrip('/'))} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
