"""The real-model experiment of docs/results.md: GRPO (or another trainer) on the built-in
SmolLM2-135M-Instruct (`--model smollm2`) and `--task sums`, each seed trained, then the base model and every
run's final policy evaluated greedy on the 500 held-out sums (`eval.py --temperature 0`: pass@1 with its 95%
interval), in one table and one figure of the training reward.

    python reproduce/smollm2.py                                 # GRPO, seeds 0 1 2 (~20 min a seed, 2 cores)
    python reproduce/smollm2.py --scripts train_rloo.py train_gpg.py train_corpo.py train_ppo.py --seeds 0
    python reproduce/smollm2.py --report_only true    # the table and figure from the runs already there
    python reproduce/smollm2.py --flags "--lora_rank 16 --lr 3e-4" --tag lora16-lr3e-4 --seeds 0 1  # LoRA
    python reproduce/smollm2.py --task sums_graded --scripts train_grpo.py train_corpo.py \
        --out_dir runs/smollm2_graded                           # partial credit: CoRPO against GRPO

A run folder that holds final/ and an evaluation is reused, so an interrupted reproduction continues. The
table and the verdict (`eval.py compare`: IQM over seeds; A - B paired over the held-out questions and over
seeds, against the base model too) cover every finished run of --out_dir, whatever its --flags; written to
<out_dir>/table.md and results.json.
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
TRAIN = ["--model", "smollm2", "--prompts_per_step", "8", "--group_size", "8",
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


def evaluate(model: str, out: str, task: str = "sums") -> dict:
    """Greedy held-out pass@1 of `model` on `task` (eval.py), reused when already written with each
    question's result (what eval.py compare pairs)."""
    path = os.path.join(out, "eval.json")
    if not os.path.exists(path) or "per_question" not in json.load(open(path)):
        run(["eval.py", "--model", model, "--task", task, "--temperature", "0", "--out", out], out + ".log")
    return json.load(open(path))


def train(script: str, seed: int, out_dir: str, flags: list, name: str, task: str = "sums") -> str:
    """One run (reused when its final/ exists, refused when trained otherwise); its folder."""
    folder = os.path.join(out_dir, name)
    if not os.path.exists(os.path.join(folder, "final", "config.json")):
        os.makedirs(out_dir, exist_ok=True)
        wall = run([script, *TRAIN, "--task", task, *flags, "--seed", str(seed), "--out_dir", out_dir,
                    "--run_name", name], os.path.join(out_dir, name + ".log"))
        with open(os.path.join(folder, "wall_s.json"), "w") as f:
            json.dump({"wall_s": wall, "flags": flags, "task": task}, f)
    done = json.load(open(os.path.join(folder, "wall_s.json")))
    if done.get("flags", []) != flags:  # a folder of another configuration is never reported as this one
        sys.exit(f"{folder} was trained with --flags {' '.join(done.get('flags', []))!r}, not "
                 f"{' '.join(flags)!r}: give another --tag or --out_dir")
    if done.get("task", "sums") != task:
        sys.exit(f"{folder} was trained with --task {done.get('task', 'sums')}, not {task}: give another "
                 f"--out_dir")
    return folder


def finished(out_dir: str, task: str) -> list:
    """Every run of out_dir trained and evaluated (this invocation's and earlier ones', any --flags): its
    name, folder, wall minutes, per-step training rewards and adv/failed_pos_frac, and evaluation."""
    out = []
    for name in sorted(os.listdir(out_dir)):
        folder, ev = os.path.join(out_dir, name), os.path.join(out_dir, "eval-" + name, "eval.json")
        if not (os.path.exists(os.path.join(folder, "wall_s.json")) and os.path.exists(ev)):
            continue
        done = json.load(open(os.path.join(folder, "wall_s.json")))
        if done.get("task", "sums") != task:
            sys.exit(f"{folder} was trained with --task {done.get('task', 'sums')}, not {task}: one task a "
                     f"--out_dir")
        steps = [json.loads(line) for line in open(os.path.join(folder, "metrics.jsonl"))]
        out.append({"name": name, "folder": folder, "minutes": done["wall_s"] / 60, "flags": done["flags"],
                    "rewards": [m["reward/mean"] for m in steps if "reward/mean" in m],
                    "failed_pos": [m["adv/failed_pos_frac"] for m in steps if "adv/failed_pos_frac" in m],
                    "eval": json.load(open(ev))})
    arm = lambda r: (r["name"].rsplit("-s", 1)[0], int(r["name"].rsplit("-s", 1)[1]))  # noqa: E731
    return sorted(out, key=arm)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scripts", nargs="+", default=["train_grpo.py"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--task", default="sums", help="sums, or sums_graded (partial credit: CoRPO's kind)")
    p.add_argument("--out_dir", default=os.path.join(ROOT, "runs", "smollm2"))
    p.add_argument("--figure", default=os.path.join(ROOT, "docs", "figures", "smollm2_sums.png"))
    p.add_argument("--report_only", type=lambda s: s.lower() == "true", default=False)
    p.add_argument("--flags", default="", help="more trainer flags for every run, e.g. \"--lora_rank 16\"")
    p.add_argument("--tag", default="", help="added to the run names (runs with other --flags need one)")
    a = p.parse_args(argv)
    flags = a.flags.split()
    base_dir = os.path.join(a.out_dir, "eval-base")
    base = evaluate("smollm2", base_dir, a.task)
    for script in [] if a.report_only else a.scripts:
        for seed in a.seeds:
            name = f"{script[6:-3]}{'-' + a.tag if a.tag else ''}-s{seed}"
            folder = train(script, seed, a.out_dir, flags, name, a.task)
            evaluate(os.path.join(folder, "final"), os.path.join(a.out_dir, "eval-" + name), a.task)
    runs = finished(a.out_dir, a.task)
    graded = "pass_rate" in base  # an ordinal task: the share of replies at or above its pass threshold
    ci = lambda e: "[{:.3f}, {:.3f}]".format(*e["pass@1_ci95"])  # noqa: E731
    mean = lambda x: sum(x) / len(x) if x else None  # noqa: E731
    cell = lambda v: "" if v is None else f"{v:.3f}"  # noqa: E731
    lines = [f"machine: {platform.machine()}, {os.cpu_count()} cores; held-out greedy pass@1 on "
             f"{base['questions']} {a.task}",
             "| run | pass@1 before | after | " + ("pass_rate before / after | " if graded else "")
             + "format_fail before / after | training reward, first and last 5 steps | adv/failed_pos_frac | "
             "min |", "|---|---|---|" + ("---|" if graded else "") + "---|---|---|---|"]
    for r in runs:
        e, first, last = r["eval"], r["rewards"][:5], r["rewards"][-5:]
        above = ("**above**" if e["pass@1_ci95"][0] > base["pass@1_ci95"][1]
                 else "below" if e["pass@1_ci95"][1] < base["pass@1_ci95"][0] else "overlaps")
        rate = f"{base['pass_rate']:.3f} / {e['pass_rate']:.3f} | " if graded else ""
        lines.append(f"| {r['name']} | {base['pass@1']:.3f} {ci(base)} | {e['pass@1']:.3f} {ci(e)} "
                     f"({above}) | {rate}{base['format_fail']:.3f} / {e['format_fail']:.3f} | "
                     f"{cell(mean(first))}, {cell(mean(last))} | {cell(mean(r['failed_pos']))} | "
                     f"{r['minutes']:.1f} |")
    print("\n".join(lines))
    if runs:  # the verdict: eval.py compare (IQM over seeds, the paired bootstrap over questions and seeds)
        metric = "heldout/pass@1,heldout/pass_rate" if graded else "heldout/pass@1"
        cmp = os.path.join(a.out_dir, "compare")
        run(["eval.py", "compare", *[r["folder"] for r in runs], base_dir, "--metric", metric, "--out",
             cmp], cmp + ".log")
        verdict = json.load(open(os.path.join(cmp, "comparison.json")))
        table = open(os.path.join(cmp, "comparison.md")).read()
        print(table[table.index("Per group"):] if "Per group" in table else table, end="")
        with open(os.path.join(a.out_dir, "results.json"), "w") as f:
            strip = lambda e: {k: v for k, v in e.items() if k != "per_question"}  # noqa: E731
            json.dump({"task": a.task, "base": strip(base),
                       "runs": [{"name": r["name"], "flags": r["flags"], "minutes": r["minutes"],
                                 "rewards": r["rewards"],
                                 "adv/failed_pos_frac": mean(r["failed_pos"]), **strip(r["eval"])}
                                for r in runs],
                       "groups": verdict["groups"], "paired": verdict.get("paired", [])}, f, indent=1)
        with open(os.path.join(a.out_dir, "table.md"), "w") as f:
            f.write("\n".join(lines) + "\n\n" + table)
        print(f"wrote {a.out_dir}/results.json, table.md")
    if runs and a.figure:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 3.5))
        arms = {}
        for r in runs:  # each arm's seeds in one colour, their mean drawn thick
            arms.setdefault(r["name"].rsplit("-s", 1)[0], []).append(r["rewards"])
        for arm, curves in arms.items():
            steps = min(len(c) for c in curves)
            mid = [sum(c[t] for c in curves) / len(curves) for t in range(steps)]
            line, = ax.plot(range(1, steps + 1), mid, lw=2, label=f"{arm} ({len(curves)} seeds)")
            for c in curves if len(curves) > 1 else []:
                ax.plot(range(1, len(c) + 1), c, lw=0.6, alpha=0.4, color=line.get_color())
        ax.set(xlabel="step", ylabel="training reward (8 x 8 samples)", ylim=None if graded else (0, 1),
               title=f"SmolLM2-135M-Instruct on {a.task}")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(a.figure, dpi=120)
        print(f"wrote {a.figure}")


if __name__ == "__main__":
    main()
