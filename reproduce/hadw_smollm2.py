"""HA-DW (seed 001) at its own scale on real weights: SmolLM2-135M-Instruct (`--model smollm2`) on
`--task sums_levels` (sums of 1-, 2- and 3-digit operands, each question tagged with its level), GRPO against
GRPO + HA-DW with its sec. 3 evolving anchor (`--hadw_anchor kalman`) and with a fixed threshold
(`--hadw_anchor fixed`, the paper's ablation), at 8 x 8; curves of sampled held-out pass@1 by level every
--eval_every steps, the final policy evaluated greedy on every held-out question by eval.py (pass@1 overall
and per level); the verdict by `eval.py compare`, overall and per level (--subset level=L).

    python reproduce/hadw_smollm2.py --seeds 5 6 7 --arms grpo hadw fixed       # docs/hadw.md
    python reproduce/hadw_smollm2.py --seeds 0 1 2 3 4 --out results/hadw_smollm2_tune   # the tuning seeds

Seeds 0-4 are for tuning, 5-7 held out; 8 and up are reserved (refused). A finished run (final/, or its small
files alone as results/ lands them in git, and its evaluation) is reused; an interrupted one continues from
its checkpoint, or starts again without one; a folder trained with another configuration is refused, naming
the flag. Prints a line per run; writes DIR/results.json (a list of {arm, seed, accuracy, by_level: {level:
accuracy}, minutes}), DIR/table.md, DIR/details.json (curves, hadw/anchor over steps, eval.py compare's
verdicts) and DIR/hadw_smollm2.png.
"""
import contextlib
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import seed000_smollm2 as base  # noqa: E402  (its plumbing: differing, call)
import eval as evaluation  # noqa: E402
from rlmini import options, runlog  # noqa: E402

TASK = "sums_levels"
# name -> (label, its own flags): GRPO's loop in every arm; the anchor rule named in each HA-DW arm
ARMS = {
    "grpo": ("GRPO", []),
    "hadw": ("GRPO + HA-DW (kalman anchor)", ["--hadw", "true", "--hadw_anchor", "kalman"]),
    "fixed": ("GRPO + HA-DW (fixed anchor)", ["--hadw", "true", "--hadw_anchor", "fixed"]),
}
RESERVED = 8  # seeds from 8 up are reserved: never run


def seed_type(text: str) -> int:
    if not text.isdigit() or int(text) >= RESERVED:
        raise ValueError(text)
    return int(text)


seed_type.__name__ = "seed (0-4 tuning, 5-7 held out; 8 and up reserved)"  # argparse's one-line refusal


def parser():
    p = options.Parser(prog="reproduce/hadw_smollm2.py", description=__doc__.split("\n\n")[0],
                       allow_abbrev=False)
    p.add_argument("--seeds", nargs="+", type=seed_type, default=[5, 6, 7], help="seeds, 0 to 7")
    p.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS), help="arms")
    base.run_arguments(p, "results/hadw_smollm2", 120, 0, "the task's, 32")
    p.add_argument("--threshold", type=float, default=0.5, help="the fixed arm's anchor C (--hadw_threshold)")
    p.add_argument("--eval_every", type=int, default=20, help="curves: evaluate every N steps")
    p.add_argument("--curve_limit", type=int, default=110, help="curves: held-out questions (levels mixed)")
    p.add_argument("--eval_n", type=int, default=2, help="curves: samples per held-out question")
    p.add_argument("--final_limit", type=int, default=0, help="final greedy evaluation: questions (0: all)")
    return p


def train_flags(a, arm: str, seed: int) -> list:
    """The trainer's flags of one run: what its folder records and a reuse compares."""
    own = ARMS[arm][1] + (["--hadw_threshold", str(a.threshold)] if arm == "fixed" else [])
    return [*base.run_flags(a, TASK, seed), "--eval_every", str(a.eval_every), "--eval_limit",
            str(a.curve_limit), "--eval_n", str(a.eval_n), *own, *a.flags.split()]


def run_one(a, arm: str, seed: int) -> tuple:
    """Train (or reuse, or continue) one run and evaluate its final policy greedy; its row and details."""
    name = f"{arm}-s{seed}"
    folder, ev_dir = os.path.join(a.out, name), os.path.join(a.out, f"eval-{name}")
    record_path = os.path.join(a.out, f"{name}.json")
    record, trained = base.train(a, "train_grpo.py", name, train_flags(a, arm, seed), folder, 25)
    if trained:
        record.update(eval_s=0.0, final_limit=None)  # a new final policy: an earlier evaluation is stale
    path = os.path.join(ev_dir, "eval.json")
    ev = json.load(open(path)) if os.path.exists(path) else {}
    if not ev or record.get("final_limit") != a.final_limit:  # none, or of another size
        base.need_weights(folder, f"its greedy evaluation (--final_limit {a.final_limit})")
        record.update(eval_s=0.0, final_limit=a.final_limit)
        base.call(["eval.py", "--model", os.path.join(folder, "final"), "--task", TASK, "--engine", a.engine,
                   "--temperature", "0", "--limit", str(a.final_limit), "--seed", str(seed),
                   "--max_new_tokens", str(a.max_new_tokens), "--out", ev_dir],
                  os.path.join(a.out, f"eval-{name}.log"), record, "eval_s", record_path)
        ev = json.load(open(path))
    rows = runlog.read_metrics(os.path.join(folder, "metrics.jsonl"))
    levels = sorted(ev["by_level"], key=int)
    curve = {key: {r["step"]: r[f"eval/pass@1{suffix}"] for r in rows if f"eval/pass@1{suffix}" in r}
             for key, suffix in [("all", "")] + [(L, f"_level{L}") for L in levels]}
    anchor = {r["step"]: r["hadw/anchor"] for r in rows if "hadw/anchor" in r}
    minutes = (record["train_s"] + record["eval_s"]) / 60
    by_level = {L: ev["by_level"][L]["pass@1"] for L in levels}
    row = {"arm": arm, "seed": seed, "accuracy": ev["pass@1"], "by_level": by_level,
           "minutes": round(minutes, 2)}
    print(f"{arm} seed {seed}: greedy pass@1 {ev['pass@1']:.3f} ("
          + ", ".join(f"level {L} {v:.3f}" for L, v in by_level.items())
          + f"), format_fail {ev['format_fail']:.3f} ({minutes:.1f} min)", flush=True)
    return row, {"arm": arm, "seed": seed, "curve": curve, "anchor": anchor, "questions": ev["questions"],
                 "format_fail": ev["format_fail"], "train_minutes": record["train_s"] / 60,
                 "eval_minutes": record["eval_s"] / 60}


def verdicts(a, levels: list) -> dict:
    """eval.py compare over the arms' runs: held-out greedy pass@1 overall and of each level (--subset)."""
    groups = [f"--group={arm}=" + ",".join(os.path.join(a.out, f"{arm}-s{s}") for s in a.seeds)
              for arm in a.arms]
    out = {}
    for key, subset in [("all", [])] + [(L, ["--subset", f"level={L}"]) for L in levels]:
        cmp = os.path.join(a.out, "compare" if key == "all" else f"compare-level{key}")
        with open(cmp + ".log", "w") as log, contextlib.redirect_stdout(log):  # its tables: in compare*/
            out[key] = evaluation.main(["compare", *groups, "--metric", "heldout/pass@1", *subset,
                                        "--out", cmp])
    return out


def table(rows: list, verdict: dict) -> str:
    """Per run (overall and by level), then per arm and each pair of arms: the paired difference of greedy
    pass@1 on the held-out questions with both intervals, IQM over seeds, P(A beats B) (eval.py compare)."""
    levels = sorted({L for r in rows for L in r["by_level"]}, key=int)
    lines = ["| arm | seed | pass@1 | " + " | ".join(f"level {L}" for L in levels) + " | minutes |",
             "|---" * (4 + len(levels)) + "|"]
    lines += [f"| {ARMS[r['arm']][0]} | {r['seed']} | {r['accuracy']:.3f} | "
              + " | ".join(f"{r['by_level'][L]:.3f}" for L in levels) + f" | {r['minutes']:.1f} |"
              for r in rows]
    iv = lambda v: "[{:+.3f}, {:+.3f}]".format(*v)  # noqa: E731
    paired = [(key, p) for key, v in verdict.items() for p in v.get("paired", [])]
    if paired:
        lines += ["", "| questions | A - B | runs | difference | 95% (questions) | 95% (seeds and "
                  "questions) | verdict |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {'all' if key == 'all' else f'level {key}'} | {p['a']} - {p['b']} | "
                  f"{p['runs'][0]} / {p['runs'][1]} | {p['diff']:+.4f} | {iv(p['ci95_questions'])} | "
                  f"{iv(p['ci95_seeds_questions'])} | {p['verdict']} |" for key, p in paired]
    groups = verdict.get("all", {}).get("groups", {})
    if any(len(g["runs"]) > 1 for g in groups.values()):
        lines += ["", "| arm | seeds | pass@1 IQM [95%] |", "|---|---|---|"]
        for arm, g in groups.items():
            e = g["heldout/pass@1"]
            lines.append(f"| {ARMS[arm][0]} | {len(g['runs'])} | {e['iqm']:.3f} [{e['ci95'][0]:.3f}, "
                         f"{e['ci95'][1]:.3f}] |")
        wins = verdict["all"].get("improvement", [])
        if wins:
            lines += ["", "| A beats B | P over pairs of seeds [95%] |", "|---|---|"]
            lines += [f"| {w['a']} > {w['b']} | {w['p']:.2f} [{w['ci95'][0]:.2f}, {w['ci95'][1]:.2f}] |"
                      for w in wins]
    return "\n".join(lines)


def figure(details: list, path: str) -> None:
    """Sampled held-out pass@1 over steps, one panel per level and one for all (each arm: the mean over its
    seeds), and hadw/anchor over steps (each HA-DW run)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys = ["all"] + sorted({k for d in details for k in d["curve"]} - {"all"}, key=int)
    fig, axes = plt.subplots(1, len(keys) + 1, figsize=(3.2 * (len(keys) + 1), 3), squeeze=False)
    colours = {arm: f"C{i}" for i, arm in enumerate(ARMS)}
    for ax, key in zip(axes[0], keys):
        for arm in dict.fromkeys(d["arm"] for d in details):
            series = [{int(t): v for t, v in d["curve"].get(key, {}).items()} for d in details
                      if d["arm"] == arm]
            steps = sorted(set.intersection(*(set(s) for s in series)))
            if steps:
                ax.plot(steps, [np.mean([s[t] for s in series]) for t in steps], "o-", ms=3,
                        color=colours[arm], label=f"{ARMS[arm][0]} ({len(series)})")
        ax.set(title="all levels" if key == "all" else f"level {key}", xlabel="step",
               ylabel="held-out pass@1 (sampled)" if key == "all" else None)
    axes[0][0].legend(fontsize=6)
    right = axes[0][-1]
    for d in details:
        if d["anchor"]:
            steps = sorted(int(t) for t in d["anchor"])
            anchor = {int(t): v for t, v in d["anchor"].items()}
            right.plot(steps, [anchor[t] for t in steps], color=colours[d["arm"]], lw=1)
    right.set(title="hadw/anchor", xlabel="step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    a = parser().parse_args(argv)
    a.arms, a.seeds = list(dict.fromkeys(a.arms)), list(dict.fromkeys(a.seeds))
    base.check_flags(a)
    import train_grpo
    for arm in a.arms:  # every run's options, refused in one line before the first run trains
        options.parse_args(train_grpo.Args, train_flags(a, arm, a.seeds[0]))
    rows, details = [], []
    for seed in a.seeds:  # seed by seed: an interrupted reproduction has whole seeds of every arm
        for arm in a.arms:
            row, detail = run_one(a, arm, seed)
            rows.append(row)
            details.append(detail)
    verdict = verdicts(a, sorted({L for r in rows for L in r["by_level"]}, key=int))
    text = table(rows, verdict)
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(rows, f, indent=1)
    with open(os.path.join(a.out, "details.json"), "w") as f:
        json.dump({"config": vars(a), "runs": details, "compare": verdict}, f, indent=1)
    with open(os.path.join(a.out, "table.md"), "w") as f:
        f.write(text + "\n")
    figure(details, os.path.join(a.out, "hadw_smollm2.png"))
    print(text)
    print(f"wrote {a.out}/results.json, table.md, details.json, hadw_smollm2.png")
    return rows


if __name__ == "__main__":
    main()
