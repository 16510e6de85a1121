"""CoRPO (seed 004) out of domain on real weights: SmolLM2-135M-Instruct (`--model smollm2`) trained on
`--task sums_graded` (partial credit) by GRPO, by the static baseline (`train_corpo.py --baseline static`)
and by CoRPO (`--baseline adaptive`), each final policy evaluated in domain (sums_graded's held-out sums)
and on out-of-domain families it never trained on (rewards.py::ARITH_FAMILIES: subtraction, products,
sums3, in `sums`' chat form and verifier): exact-answer pass@16 (16 samples a question, the unbiased
estimator) with pass@1 beside it, the measure of the paper's Table 1; the verdict by `eval.py compare`, one
call per task.

    python reproduce/corpo_ood.py --seeds 5 6 7 --arms grpo static corpo         # docs/corpo.md
    python reproduce/corpo_ood.py --seeds 0 1 2 3 4 --out results/corpo_ood_tune     # the tuning seeds

Seeds 0-4 are for tuning, 5-7 held out; 8 and up are reserved (refused). A finished run (final/, or its small
files alone as results/ lands them in git, and its evaluations) is reused; an interrupted one continues from
its checkpoint, or starts again without one; a folder trained with another configuration is refused, naming
the flag. Prints a line per run; writes DIR/results.json (a list of {arm, seed, in_domain, ood: {task:
pass@16}, in_domain_pass1, ood_pass1: {task: pass@1}, minutes}), DIR/table.md and DIR/details.json (eval.py
compare's verdict of each task).
"""
import contextlib
import importlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import seed000_smollm2 as base  # noqa: E402  (its plumbing: differing, call)
from hadw_smollm2 import seed_type  # noqa: E402  (seeds 0-7; 8 and up reserved)
import eval as evaluation  # noqa: E402
from rlmini import options  # noqa: E402

TASK = "sums_graded"
# name -> (label, script, its own flags)
ARMS = {
    "grpo": ("GRPO", "train_grpo.py", []),
    "static": ("static baseline", "train_corpo.py", ["--baseline", "static"]),
    "corpo": ("CoRPO", "train_corpo.py", ["--baseline", "adaptive"]),
}
# the out-of-domain families at the operand ranges where the base model's pass@16 lies in 0.1..0.9
# (docs/corpo.md, measured)
OOD = ["subtraction", "products", "sums3"]


def parser():
    p = options.Parser(prog="reproduce/corpo_ood.py", description=__doc__.split("\n\n")[0],
                       allow_abbrev=False)
    p.add_argument("--seeds", nargs="+", type=seed_type, default=[5, 6, 7], help="seeds, 0 to 7")
    p.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS), help="arms")
    p.add_argument("--ood", nargs="+", default=OOD, help="out-of-domain tasks (rewards.py specs, e.g. "
                   "products:19)")
    base.run_arguments(p, "results/corpo_ood", 100, 0, "the task's, 32")
    p.add_argument("--eval_n", type=int, default=16, help="final evaluations: samples per question (pass@n)")
    p.add_argument("--eval_limit", type=int, default=40, help="final evaluations: questions of each task")
    return p


def train_flags(a, arm: str, seed: int) -> list:
    """The trainer's flags of one run: what its folder records and a reuse compares."""
    return [*base.run_flags(a, TASK, seed), "--eval_every", "0", *ARMS[arm][2], *a.flags.split()]


def _key(task: str) -> str:
    return task.replace(":", "-")  # a folder's name: products:19 -> eval-grpo-s5-products-19


def run_one(a, arm: str, seed: int) -> dict:
    """Train (or reuse, or continue) one run and evaluate its final policy on every task; its results row."""
    name = f"{arm}-s{seed}"
    folder, script = os.path.join(a.out, name), ARMS[arm][1]
    record_path = os.path.join(a.out, f"{name}.json")
    record, trained = base.train(a, script, name, train_flags(a, arm, seed), folder, 25)
    if trained:
        record.update(eval_s=0.0, evaluated={})  # a new final policy: earlier evaluations are stale
    ks = sorted({1, a.eval_n})
    done = record.setdefault("evaluated", {})  # task -> (n, limit) of its evaluation
    results = {}
    for task in [TASK] + a.ood:
        ev_dir = os.path.join(a.out, f"eval-{name}-{_key(task)}")
        path = os.path.join(ev_dir, "eval.json")
        if not os.path.exists(path) or done.get(task) != [a.eval_n, a.eval_limit]:
            base.need_weights(folder, f"its evaluation on {task} (--eval_n {a.eval_n}, --eval_limit "
                                      f"{a.eval_limit})")
            call_start = record["eval_s"]
            base.call(["eval.py", "--model", os.path.join(folder, "final"), "--task", task, "--engine",
                       a.engine, "--n", str(a.eval_n), "--k", ",".join(map(str, ks)), "--limit",
                       str(a.eval_limit), "--seed", str(seed), "--max_new_tokens", str(a.max_new_tokens),
                       "--out", ev_dir],
                      os.path.join(a.out, f"eval-{name}.log"), record, "eval_s", record_path)
            done[task] = [a.eval_n, a.eval_limit]
            record.setdefault("eval_task_s", {})[task] = record["eval_s"] - call_start
            json.dump(record, open(record_path, "w"))
        results[task] = json.load(open(path))
    k = f"pass@{a.eval_n}"
    minutes = (record["train_s"] + record["eval_s"]) / 60
    row = {"arm": arm, "seed": seed, "in_domain": results[TASK][k],
           "ood": {t: results[t][k] for t in a.ood}, "in_domain_pass1": results[TASK]["pass@1"],
           "ood_pass1": {t: results[t]["pass@1"] for t in a.ood}, "minutes": round(minutes, 2)}
    print(f"{arm} seed {seed}: {k} in domain {row['in_domain']:.3f}, "
          + ", ".join(f"{t} {v:.3f}" for t, v in row["ood"].items()) + f" ({minutes:.1f} min)", flush=True)
    return row


def verdicts(a) -> dict:
    """eval.py compare over the arms' runs, once per task (each run's evaluation of that task)."""
    groups = [f"--group={arm}=" + ",".join(os.path.join(a.out, f"{arm}-s{s}") for s in a.seeds)
              for arm in a.arms]
    out = {}
    for task in [TASK] + a.ood:
        cmp = os.path.join(a.out, f"compare-{_key(task)}")
        with open(cmp + ".log", "w") as log, contextlib.redirect_stdout(log):  # its tables: in compare-*/
            out[task] = evaluation.main(["compare", *groups, "--eval", "{parent}/eval-{name}-" + _key(task),
                                         "--metric", f"heldout/pass@{a.eval_n},heldout/pass@1", "--out", cmp])
    return out


def table(rows: list, verdict: dict, n: int) -> str:
    """Per run: pass@n in domain and out of domain (pass@1 beside each); then each task's paired differences
    (both intervals, the verdict) and each arm's IQM over seeds (eval.py compare)."""
    ood = list(rows[0]["ood"]) if rows else []
    lines = [f"| arm | seed | {TASK} pass@{n} (pass@1) | "
             + " | ".join(f"{t} pass@{n} (pass@1)" for t in ood) + " | minutes |",
             "|---" * (4 + len(ood)) + "|"]
    lines += [f"| {ARMS[r['arm']][0]} | {r['seed']} | {r['in_domain']:.3f} ({r['in_domain_pass1']:.3f}) | "
              + " | ".join(f"{r['ood'][t]:.3f} ({r['ood_pass1'][t]:.3f})" for t in ood)
              + f" | {r['minutes']:.1f} |" for r in rows]
    iv = lambda v: "[{:+.3f}, {:+.3f}]".format(*v)  # noqa: E731
    paired = [(task, p) for task, v in verdict.items() for p in v.get("paired", [])]
    if paired:
        lines += ["", "| task | metric | A - B | runs | difference | 95% (questions) | 95% (seeds and "
                  "questions) | verdict |", "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {task} | {p['metric'].split('/')[1]} | {p['a']} - {p['b']} | {p['runs'][0]} / "
                  f"{p['runs'][1]} | {p['diff']:+.4f} | {iv(p['ci95_questions'])} | "
                  f"{iv(p['ci95_seeds_questions'])} | {p['verdict']} |" for task, p in paired]
    if any(len(g["runs"]) > 1 for v in verdict.values() for g in v.get("groups", {}).values()):
        lines += ["", f"| task | arm | seeds | pass@{n} IQM [95%] |", "|---|---|---|---|"]
        for task, v in verdict.items():
            for arm, g in v["groups"].items():
                e = g.get(f"heldout/pass@{n}")
                if e:
                    lines.append(f"| {task} | {ARMS[arm][0]} | {len(g['runs'])} | {e['iqm']:.3f} "
                                 f"[{e['ci95'][0]:.3f}, {e['ci95'][1]:.3f}] |")
    return "\n".join(lines)


def main(argv=None):
    a = parser().parse_args(argv)
    a.arms, a.seeds = list(dict.fromkeys(a.arms)), list(dict.fromkeys(a.seeds))
    base.check_flags(a)
    if a.eval_n < 2:
        raise SystemExit(f"bad option: --eval_n {a.eval_n}: pass@n needs n >= 2 samples a question")
    families = [t.partition(":")[0] for t in a.ood]
    unknown = [t for t, f in zip(a.ood, families) if f not in evaluation.rewards.ARITH_FAMILIES]
    if unknown or len(set(families)) < len(families):
        raise SystemExit(f"bad option: --ood {' '.join(a.ood)}: each of "
                         f"{', '.join(evaluation.rewards.ARITH_FAMILIES)} at most once, e.g. products:19")
    for task in a.ood:  # built now: a bad range is one line here, not after the first run has trained
        try:
            evaluation.rewards.load_task(task, style="chat")
        except (ValueError, SystemExit) as e:
            raise SystemExit(f"bad option: --ood {task}: {e}") from None
    for arm in a.arms:  # every run's options, refused in one line before the first run trains
        module = importlib.import_module(ARMS[arm][1].removesuffix(".py"))
        options.parse_args(module.Args, train_flags(a, arm, a.seeds[0]))
    rows = [run_one(a, arm, seed) for seed in a.seeds for arm in a.arms]  # seed by seed: whole seeds
    verdict = verdicts(a)
    text = table(rows, verdict, a.eval_n)
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(rows, f, indent=1)
    with open(os.path.join(a.out, "details.json"), "w") as f:
        json.dump({"config": vars(a), "compare": verdict}, f, indent=1)
    with open(os.path.join(a.out, "table.md"), "w") as f:
        f.write(text + "\n")
    print(text)
    print(f"wrote {a.out}/results.json, table.md, details.json")
    return rows


if __name__ == "__main__":
    main()
