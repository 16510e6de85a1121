"""HA-DW demonstration (seed 001): GRPO without HA-DW, with it (the Kalman anchor of sec. 3, our
default) and with appendix F's moving-average anchor, on `mixed` (easy: copy a digit, a+0; hard: a
real single-digit sum), several seeds, CPU. Reports accuracy on the hard prompts, the easy ones and
overall (n samples per prompt of the final policy, all 55 pairs) with the spread across seeds, the
anchor at the end, and writes the table into docs/hadw.md between its RESULTS markers.

    python benchmarks/hadw_demo.py                       # 3 seeds x 300 steps, about 7 minutes on 2 cores
    python benchmarks/hadw_demo.py --seeds 0,1,2,3,4 --steps 400 --hard_frac 0.7
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
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import rewards  # noqa: E402
from rlmini import data, engine  # noqa: E402


def accuracy_by_difficulty(path, task, n, seed):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    sampler = engine.HFEngine(model, tok)
    prompts = data.encode_prompts(tok, [e["prompt"] for e in task.test], False)
    r = sampler.generate(prompts, n, task.max_new_tokens, 1.0, seed)
    _, correct, _, _ = data.score_rollouts(task, tok, task.test, r, n)
    per_prompt = correct.view(-1, n).mean(1)
    hard = torch.tensor([e["difficulty"] == "hard" for e in task.test])
    return per_prompt[hard].mean().item(), per_prompt[~hard].mean().item(), per_prompt.mean().item()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--hard_frac", type=float, default=0.5)
    p.add_argument("--n", type=int, default=16, help="samples per prompt in the final evaluation")
    p.add_argument("--no_write", action="store_true", help="print only; leave docs/hadw.md alone")
    a = p.parse_args()
    seeds = [int(s) for s in a.seeds.split(",")]
    task_spec = f"mixed:{a.hard_frac}"
    task = rewards.load_task(task_spec)
    variants = {"GRPO": [], "GRPO + HA-DW (kalman anchor)": ["--hadw", "true", "--hadw_anchor", "kalman"],
                "GRPO + HA-DW (mean anchor, app. F)": ["--hadw", "true", "--hadw_anchor", "mean"]}
    results = {v: [] for v in variants}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        for seed in seeds:
            for k, (variant, flags) in enumerate(variants.items()):
                name = f"v{k}-{seed}"
                subprocess.run([sys.executable, os.path.join(ROOT, "train_grpo.py"), "--engine", "hf",
                                "--task", task_spec,
                                "--steps", str(a.steps), "--seed", str(seed), *flags, "--out_dir", out,
                                "--run_name", name, "--wandb", "false", "--save_every", "0"],
                               check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                with open(os.path.join(out, name, "metrics.jsonl")) as f:
                    anchor = json.loads(f.readlines()[-1]).get("hadw/anchor", float("nan"))
                accuracy = accuracy_by_difficulty(os.path.join(out, name, "final"), task, a.n, 10_000 + seed)
                results[variant].append((*accuracy, anchor))
    wall = time.perf_counter() - t0

    def cell(vals):
        return f"{statistics.mean(vals):.3f} ± {statistics.stdev(vals) if len(vals) > 1 else 0.0:.3f}"

    lines = ["| run | hard prompts | easy prompts | all prompts | per seed (all) | final anchor |",
             "|---|---|---|---|---|---|"]
    for variant, rows in results.items():
        anchors = ", ".join("-" if r[3] != r[3] else f"{r[3]:.3f}" for r in rows)
        lines.append(f"| {variant} | {cell([r[0] for r in rows])} | {cell([r[1] for r in rows])} | "
                     f"{cell([r[2] for r in rows])} | {', '.join(f'{r[2]:.3f}' for r in rows)} | {anchors} |")
    table = "\n".join(lines)
    header = (f"`python benchmarks/hadw_demo.py --seeds {a.seeds} --steps {a.steps} --hard_frac "
              f"{a.hard_frac} --n {a.n}` (tiny model, HF engine, 32 prompts x 8 per step; mean ± std over "
              f"{len(seeds)} seeds; {wall / 60:.1f} min on this machine, {os.cpu_count()} cores):")
    print(header + "\n\n" + table)
    if not a.no_write:
        doc = os.path.join(ROOT, "docs", "hadw.md")
        text = open(doc).read()
        start, end = text.index("<!-- RESULTS -->"), text.index("<!-- /RESULTS -->")
        with open(doc, "w") as f:
            f.write(text[:start] + "<!-- RESULTS -->\n" + header + "\n\n" + table + "\n" + text[end:])


if __name__ == "__main__":
    main()
