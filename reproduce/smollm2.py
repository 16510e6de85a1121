"""The real-model experiment of docs/results.md: GRPO (or another trainer) on the built-in
SmolLM2-135M-Instruct (`--model smollm2`) and `--task sums`, each seed trained, then the base model and every
run's final policy evaluated greedy on the 500 held-out sums (`eval.py --temperature 0`: pass@1 with its 95%
interval), in one table and one figure of the training reward.

    python reproduce/smollm2.py                                 # GRPO, seeds 0 1 2 (~20 min a seed, 2 cores)
    python reproduce/smollm2.py --scripts train_rloo.py train_gpg.py train_corpo.py train_ppo.py --seeds 0
    python reproduce/smollm2.py --report_only true    # the table and figure from the runs already there
    python reproduce/smollm2.py --flags "--lora_rank 16 --lr 3e-4" --tag lora16-lr3e-4 --seeds 0 1  # LoRA

A run folder that holds final/ and an evaluation is reused, so an interrupted reproduction continues.
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the configuration of every run (docs/results.md): 8 prompts x 8 completions of up to 32 tokens, lr 2e-5
TRAIN = ["--model", "smollm2", "--task", "sums", "--prompts_per_step", "8", "--group_size", "8",
         "--lr", "2e-5", "--steps", "20", "--save_every", "0", "--wandb", "false", "--print_every", "1",
         "--overwrite", "true"]


def run(cmd: list, log: str) -> float:
    """Run `cmd` from the repository root, its output in `log`; its wall seconds, or exit with its tail."""
    start = time.perf_counter()
    os.makedirs(os.path.dirname(log), exist_ok=True)
    with open(log, "w") as f:
        done = subprocess.run([sys.executable, *cmd], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    if done.returncode:
        sys.exit(f"{cmd[0]} failed ({done.returncode}); its log: {log}\n" + open(log).read()[-2000:])
    return time.perf_counter() - start


def evaluate(model: str, out: str) -> dict:
    """Greedy held-out pass@1 of `model` on sums (eval.py), reused when already written."""
    path = os.path.join(out, "eval.json")
    if not os.path.exists(path):
        run(["eval.py", "--model", model, "--task", "sums", "--temperature", "0", "--out", out], out + ".log")
    return json.load(open(path))


def train(script: str, seed: int, out_dir: str, flags: list, name: str) -> dict:
    """One run (reused when its final/ exists): its folder, wall minutes, per-step training rewards."""
    folder = os.path.join(out_dir, name)
    if not os.path.exists(os.path.join(folder, "final", "config.json")):
        os.makedirs(out_dir, exist_ok=True)
        wall = run([script, *TRAIN, *flags, "--seed", str(seed), "--out_dir", out_dir, "--run_name", name],
                   os.path.join(out_dir, name + ".log"))
        with open(os.path.join(folder, "wall_s.json"), "w") as f:
            json.dump({"wall_s": wall, "flags": flags}, f)
    done = json.load(open(os.path.join(folder, "wall_s.json")))
    if done.get("flags", []) != flags:  # a folder of another configuration is never reported as this one
        sys.exit(f"{folder} was trained with --flags {' '.join(done.get('flags', []))!r}, not "
                 f"{' '.join(flags)!r}: give another --tag or --out_dir")
    steps = [json.loads(line) for line in open(os.path.join(folder, "metrics.jsonl"))]
    rewards = [m["reward/mean"] for m in steps if "reward/mean" in m]
    wall = done["wall_s"]
    return {"name": name, "folder": folder, "minutes": wall / 60, "rewards": rewards}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scripts", nargs="+", default=["train_grpo.py"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--out_dir", default=os.path.join(ROOT, "runs", "smollm2"))
    p.add_argument("--figure", default=os.path.join(ROOT, "docs", "figures", "smollm2_sums.png"))
    p.add_argument("--report_only", type=lambda s: s.lower() == "true", default=False)
    p.add_argument("--flags", default="", help="more trainer flags for every run, e.g. \"--lora_rank 16\"")
    p.add_argument("--tag", default="", help="added to the run names (runs with other --flags need one)")
    a = p.parse_args(argv)
    flags = a.flags.split()
    base = evaluate("smollm2", os.path.join(a.out_dir, "eval-base"))
    runs = []
    for script in a.scripts:
        for seed in a.seeds:
            name = f"{script[6:-3]}{'-' + a.tag if a.tag else ''}-s{seed}"
            if a.report_only and not os.path.exists(os.path.join(a.out_dir, name, "final")):
                continue
            r = train(script, seed, a.out_dir, flags, name)
            r["eval"] = evaluate(os.path.join(r["folder"], "final"), os.path.join(a.out_dir, "eval-" + name))
            runs.append(r)
    ci = lambda e: "[{:.3f}, {:.3f}]".format(*e["pass@1_ci95"])  # noqa: E731
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; held-out greedy pass@1 on 500 sums")
    print("| run | pass@1 before | after | format_fail before / after | training reward, first and last 5 "
          "steps | min |")
    print("|---|---|---|---|---|---|")
    for r in runs:
        e, first, last = r["eval"], r["rewards"][:5], r["rewards"][-5:]
        above = ("**above**" if e["pass@1_ci95"][0] > base["pass@1_ci95"][1]
                 else "below" if e["pass@1_ci95"][1] < base["pass@1_ci95"][0] else "overlaps")
        print(f"| {r['name']} | {base['pass@1']:.3f} {ci(base)} | {e['pass@1']:.3f} {ci(e)} ({above}) | "
              f"{base['format_fail']:.3f} / {e['format_fail']:.3f} | "
              f"{sum(first) / len(first):.3f}, {sum(last) / len(last):.3f} | {r['minutes']:.1f} |")
    if runs and a.figure:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for r in runs:
            ax.plot(range(1, len(r["rewards"]) + 1), r["rewards"], label=r["name"])
        ax.set(xlabel="step", ylabel="training reward (8 x 8 samples)", ylim=(0, 1),
               title="SmolLM2-135M-Instruct on sums (0..49)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(a.figure, dpi=120)
        print(f"wrote {a.figure}")


if __name__ == "__main__":
    main()
