"""Seed 000's second experiment on real weights: SmolLM2-135M-Instruct (`--model smollm2`) predicts the
probability of a stochastic outcome (`--task calibration_plain`: 20 categories with hidden rates, one outcome
per question drawn once, the log-likelihood of the outcome as reward, invalid = the floor), trained by GRPO,
GRPO without the std, RLOO and PPO on the same budget; each run evaluated on the held-out questions with seed
000's protocol (a question's prediction is the mean of its sampled probabilities): ECE (10 bins), AUROC,
accuracy at 0.5, Brier; curves on 500 held-out questions every --eval_every steps, the final evaluation on
all 2,000 by eval.py; the verdict by `eval.py compare`.

    python reproduce/seed000_smollm2.py --seeds 5 6 7 --algos grpo grpo_nostd rloo ppo   # docs/seed000.md
    python reproduce/seed000_smollm2.py --seeds 0 1 2 3 4 --out runs/seed000_smollm2_tune  # the tuning seeds

A finished run (final/ and its evaluation) is reused; an interrupted one continues from its checkpoint, or
starts again without one; a folder trained with another configuration is refused, naming the flag. Prints a
line per run; writes DIR/results.json (a list of {algo, seed, ece, auroc, accuracy, brier, minutes}),
DIR/table.md, DIR/details.json (curves, histograms, eval.py compare's verdict) and DIR/seed000_smollm2.png.
"""
import contextlib
import importlib
import json
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import eval as evaluation  # noqa: E402
from rlmini import options, runlog  # noqa: E402

# name -> (label, script, its own flags): each trainer with its defaults; only GRPO's std switch differs
ALGOS = {
    "grpo": ("GRPO", "train_grpo.py", ["--std_norm", "true"]),
    "grpo_nostd": ("GRPO (no std)", "train_grpo.py", ["--std_norm", "false"]),
    "rloo": ("RLOO", "train_rloo.py", []),
    "ppo": ("PPO", "train_ppo.py", []),
}
METRICS = ("ece", "auroc", "accuracy", "brier")


def parser():
    p = options.Parser(prog="reproduce/seed000_smollm2.py", description=__doc__.split("\n\n")[0],
                       allow_abbrev=False)
    p.add_argument("--seeds", nargs="+", type=seed_type, default=[5, 6, 7], help="seeds (non-negative)")
    p.add_argument("--algos", nargs="+", choices=list(ALGOS), default=list(ALGOS), help="algorithms")
    run_arguments(p, "runs/seed000_smollm2", 100, 8, "the task's")
    p.add_argument("--eval_every", type=int, default=20, help="curves: evaluate every N steps")
    p.add_argument("--curve_limit", type=int, default=500, help="curves: held-out questions")
    p.add_argument("--eval_n", type=int, default=4, help="samples per held-out question (curves and final)")
    p.add_argument("--final_limit", type=int, default=0, help="final evaluation: questions (0: all 2,000)")
    return p


def seed_type(text: str) -> int:
    if not text.isdigit():
        raise ValueError(text)
    return int(text)


seed_type.__name__ = "non-negative integer seed"  # argparse names the type in its one-line refusal


def run_arguments(p, out: str, steps: int, max_new_tokens: int, tokens: str) -> None:
    """The options every SmolLM2 reproduction shares (its own defaults): where (`out`: results/ is in git,
    its runs' weights ignored), the policy, the batch, the learning rate, reply tokens (`tokens`: what 0
    means), the engine and more trainer flags."""
    p.add_argument("--out", default=out, help="runs, results, figure")
    p.add_argument("--model", default="smollm2", help="the policy (tiny: the tests' few steps)")
    p.add_argument("--steps", type=int, default=steps, help="training steps per run")
    p.add_argument("--prompts_per_step", type=int, default=8, help="questions per step")
    p.add_argument("--group_size", type=int, default=8, help="completions per question")
    p.add_argument("--lr", type=float, default=2e-5, help="learning rate, every run")
    p.add_argument("--max_new_tokens", type=int, default=max_new_tokens,
                   help=f"reply tokens, training and evaluation (0: {tokens})")
    p.add_argument("--engine", default="vllm", choices=["vllm", "hf"], help="rollout and evaluation engine")
    p.add_argument("--flags", default="", help="more trainer flags for every run")


def run_flags(a, task: str, seed: int) -> list:
    """The trainer's flags run_arguments' options give one run of `task`, seeded `seed`."""
    return ["--model", a.model, "--task", task, "--engine", a.engine, "--steps", str(a.steps),
            "--prompts_per_step", str(a.prompts_per_step), "--group_size", str(a.group_size),
            "--lr", str(a.lr), "--max_new_tokens", str(a.max_new_tokens), "--seed", str(seed)]


def train_flags(a, algo: str, seed: int) -> list:
    """The trainer's flags of one run: what its folder records and a reuse compares."""
    return [*run_flags(a, "calibration_plain", seed), "--eval_every", str(a.eval_every), "--eval_limit",
            str(a.curve_limit), "--eval_n", str(a.eval_n), *ALGOS[algo][2], *a.flags.split()]


def differing(folder: str, script: str, flags: list):
    """How the run in `folder` was trained otherwise than `script` with `flags` ('--flag OLD (now NEW)', from
    its config.json, which holds every option), or None (the same, or nothing trained yet). The flags are
    typed by the trainer's own parser, so a value reads as the trainer reads it (the last of a repeated flag,
    `yes` for true, 2e-5 for 0.00002)."""
    path = os.path.join(folder, "config.json")
    if not os.path.exists(path):
        return None
    config = json.load(open(path))
    if config.get("script", script) != script:
        return f"the script {config['script']} (now {script})"
    args = options.parse_args(importlib.import_module(script[:-3]).Args, flags)
    given = dict(zip(flags[::2], flags[1::2]))
    for flag, value in given.items():
        name = flag[2:].replace("-", "_")
        if config.get(name) != getattr(args, name):
            return f"{flag} {config.get(name)} (now {value})"
    return None


def call(cmd: list, log: str, record: dict, key: str, record_path: str) -> None:
    """Run a repository script, its output added to `log`, its wall seconds added to record[key] and saved
    however it ends (an interrupted run's minutes count when it continues); exit with the log's tail if it
    failed."""
    start = time.perf_counter()
    try:
        with open(log, "a") as f:
            done = subprocess.run([sys.executable, *cmd], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                  env={**os.environ, "WANDB_MODE": "disabled"})
    finally:
        record[key] += time.perf_counter() - start
        with open(record_path, "w") as f:
            json.dump(record, f)
    if done.returncode:
        sys.exit(f"{cmd[0]} failed ({done.returncode}); its log: {log}\n" + open(log).read()[-2000:])


def check_flags(a) -> None:
    """--flags: pairs of --flag value (every reproduction's more trainer flags)."""
    if len(a.flags.split()) % 2 or not all(f.startswith("--") for f in a.flags.split()[::2]):
        raise SystemExit(f"bad option: --flags {a.flags!r}: pairs of --flag value")


def train(a, script: str, name: str, flags: list, folder: str, save_every: int) -> tuple:
    """One run of `script` in a.out/name: reused when its final/ is there, continued from its checkpoint
    when interrupted, else started again; its minutes in a.out/name.json. Returns (the record, whether it
    trained now)."""
    record_path = os.path.join(a.out, f"{name}.json")  # its minutes, training and evaluation
    other = differing(folder, script, flags)
    if other:
        sys.exit(f"{folder}: trained with another configuration: {other}; give another --out")
    record = json.load(open(record_path)) if os.path.exists(record_path) else {"train_s": 0.0, "eval_s": 0.0}
    os.makedirs(a.out, exist_ok=True)
    again = os.path.exists(os.path.join(folder, "checkpoint.pt")) or os.path.isdir(
        os.path.join(folder, "checkpoint"))  # interrupted: continue from its checkpoint, else start again
    if os.path.exists(os.path.join(folder, "final", "config.json")) or (landed(folder, record) and not again):
        return record, False
    record["train_s"] = record["train_s"] if again else 0.0
    call([script, *flags, "--out_dir", a.out, "--run_name", name, "--wandb", "false",
          "--save_every", str(save_every), "--keep_checkpoint", "false",
          *(["--resume", "true"] if again else ["--overwrite", "true"])],
         os.path.join(a.out, f"{name}.log"), record, "train_s", record_path)
    record["finished"] = True  # its small files alone (landed without final/) make it a finished run
    with open(record_path, "w") as f:
        json.dump(record, f)
    return record, True


def landed(folder: str, record: dict) -> bool:
    """A finished run kept as its small files only (config, metrics, its record and evaluations, as results/
    holds them in git): reused as it stands; an evaluation it lacks cannot be made without final/."""
    return bool(record.get("finished")) and os.path.exists(os.path.join(folder, "metrics.jsonl"))


def need_weights(folder: str, what: str) -> None:
    """Before evaluating `folder`'s final policy: a landed run without its weights is refused in one line."""
    if not os.path.exists(os.path.join(folder, "final", "config.json")):
        sys.exit(f"{folder}: landed without its weights (no final/), so {what} cannot be made: give the "
                 f"options it was evaluated with, or another --out to train it again")


def run_one(a, algo: str, seed: int) -> dict:
    """Train (or reuse, or continue) one run and evaluate its final policy; its results row and details."""
    name = f"{algo}-s{seed}"
    folder, ev_dir = os.path.join(a.out, name), os.path.join(a.out, f"eval-{name}")
    record_path = os.path.join(a.out, f"{name}.json")
    record, _ = train(a, ALGOS[algo][1], name, train_flags(a, algo, seed), folder, 50)
    path = os.path.join(ev_dir, "eval.json")
    ev = json.load(open(path)) if os.path.exists(path) else {}
    if (ev.get("n"), ev.get("questions")) != (a.eval_n, a.final_limit or 2000):  # none, or of another size
        need_weights(folder, f"its evaluation (--eval_n {a.eval_n}, --final_limit {a.final_limit})")
        record["eval_s"] = 0.0
        call(["eval.py", "--model", os.path.join(folder, "final"), "--task", "calibration_plain", "--engine",
              a.engine, "--n", str(a.eval_n), "--k", "1", "--limit", str(a.final_limit), "--seed", str(seed),
              "--max_new_tokens", str(a.max_new_tokens), "--out", ev_dir],
             os.path.join(a.out, f"eval-{name}.log"), record, "eval_s", record_path)
        ev = json.load(open(path))
    rows = runlog.read_metrics(os.path.join(folder, "metrics.jsonl"))
    curve = {k: {r["step"]: r[f"eval/{k}"] for r in rows if f"eval/{k}" in r} for k in METRICS}
    minutes = (record["train_s"] + record["eval_s"]) / 60
    row = {"algo": algo, "seed": seed, **{k: ev[k] for k in METRICS}, "minutes": round(minutes, 2)}
    print(f"{algo} seed {seed}: ECE {ev['ece']:.3f}, AUROC {ev['auroc']:.3f}, accuracy {ev['accuracy']:.3f}, "
          f"Brier {ev['brier']:.3f}, format_fail {ev['format_fail']:.3f} ({minutes:.1f} min)", flush=True)
    hist = np.histogram(ev["predictions"]["probs"], bins=10, range=(0, 1))[0].tolist()
    return row, {"algo": algo, "seed": seed, "curve": curve, "histogram": hist,
                 "format_fail": ev["format_fail"], "questions": ev["questions"], "n": ev["n"],
                 "train_minutes": record["train_s"] / 60, "eval_minutes": record["eval_s"] / 60}


def table(rows: list, verdict: dict) -> str:
    """Per run, then per algorithm (IQM over seeds [95% stratified-bootstrap interval], eval.py compare), then
    P(GRPO's ECE is higher) against each other arm over pairs of seeds."""
    lines = ["| algorithm | seed | ECE | AUROC | accuracy | Brier | minutes |", "|---" * 7 + "|"]
    lines += [f"| {ALGOS[r['algo']][0]} | {r['seed']} | " + " | ".join(f"{r[k]:.3f}" for k in METRICS)
              + f" | {r['minutes']:.1f} |" for r in rows]
    groups = verdict.get("groups", {})
    if any(len(g["runs"]) > 1 for g in groups.values()):
        lines += ["", "| algorithm | seeds | " + " | ".join(f"{k} IQM [95%]" for k in ("ECE", "AUROC",
                                                                                        "accuracy", "Brier"))
                  + " |", "|---|---|---|---|---|---|"]
        for algo, g in groups.items():
            cell = lambda e: f"{e['iqm']:.3f} [{e['ci95'][0]:.3f}, {e['ci95'][1]:.3f}]"  # noqa: E731
            lines.append(f"| {ALGOS[algo][0]} | {len(g['runs'])} | "
                         + " | ".join(cell(g[f"heldout/{k}"]) for k in METRICS) + " |")
        wins = [w for w in verdict.get("improvement", []) if w["metric"] == "heldout/ece" and "grpo" in
                (w["a"], w["b"])]
        if wins:
            lines += ["", "| X | P(ECE of GRPO > ECE of X) over pairs of seeds [95%] |", "|---|---|"]
            for w in wins:  # compare gives P(a beats b), lower ECE better: GRPO's ECE higher = X beats GRPO
                if w["a"] == "grpo":
                    other, p, ci = w["b"], 1 - w["p"], [1 - w["ci95"][1], 1 - w["ci95"][0]]
                else:
                    other, p, ci = w["a"], w["p"], w["ci95"]
                lines.append(f"| {ALGOS[other][0]} | {p:.2f} [{ci[0]:.2f}, {ci[1]:.2f}] |")
    return "\n".join(lines)


def figure(details: list, path: str) -> None:
    """ECE over steps (each run) and the final predicted probabilities' histogram (each algorithm)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
    colours = {algo: f"C{i}" for i, algo in enumerate(ALGOS)}
    labelled = set()
    for d in details:
        ece = {int(t): v for t, v in d["curve"]["ece"].items()}
        left.plot(sorted(ece), [ece[t] for t in sorted(ece)], color=colours[d["algo"]], lw=1,
                  label=None if d["algo"] in labelled else ALGOS[d["algo"]][0])
        labelled.add(d["algo"])
    left.set(xlabel="step", ylabel="ECE (500 held-out)", title="calibration during training")
    left.legend(fontsize=8)
    edges = np.linspace(0, 1, 11)
    for algo in dict.fromkeys(d["algo"] for d in details):
        h = np.sum([d["histogram"] for d in details if d["algo"] == algo], axis=0)
        right.stairs(h / max(1, h.sum()), edges, color=colours[algo], label=ALGOS[algo][0])
    right.set(xlabel="predicted probability (final, mean of samples)", ylabel="share of questions",
              title="predictions")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    a = parser().parse_args(argv)
    a.algos, a.seeds = list(dict.fromkeys(a.algos)), list(dict.fromkeys(a.seeds))
    check_flags(a)
    rows, details = [], []
    for seed in a.seeds:  # seed by seed: an interrupted reproduction has whole seeds of every arm
        for algo in a.algos:
            row, detail = run_one(a, algo, seed)
            rows.append(row)
            details.append(detail)
    cmp = os.path.join(a.out, "compare")
    os.makedirs(a.out, exist_ok=True)
    with open(cmp + ".log", "w") as log, contextlib.redirect_stdout(log):  # its tables: in compare/
        verdict = evaluation.main(["compare", *[f"--group={algo}=" + ",".join(
            os.path.join(a.out, f"{algo}-s{s}") for s in a.seeds) for algo in a.algos],
            "--metric", ",".join(f"heldout/{k}" for k in METRICS), "--out", cmp])
    text = table(rows, verdict)
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(rows, f, indent=1)
    with open(os.path.join(a.out, "details.json"), "w") as f:
        json.dump({"config": {k: v for k, v in vars(a).items()}, "runs": details, "compare": verdict}, f,
                  indent=1)
    with open(os.path.join(a.out, "table.md"), "w") as f:
        f.write(text + "\n")
    figure(details, os.path.join(a.out, "seed000_smollm2.png"))
    print(text)
    print(f"wrote {a.out}/results.json, table.md, details.json, seed000_smollm2.png")
    return rows


if __name__ == "__main__":
    main()
