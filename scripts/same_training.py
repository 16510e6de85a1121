"""Does a change leave training bit-for-bit unchanged? Short fixed-seed runs of every trainer (both engines,
LoRA, 2-rank torchrun, every shared switch, resume), recorded on two code trees and compared.

    python scripts/same_training.py --before REV                  # REV in a git worktree vs this tree
    python scripts/same_training.py record OUT.json [--tree DIR]  # one tree's fingerprints
    python scripts/same_training.py compare BEFORE.json AFTER.json

A run's fingerprint: a sha256 of every tensor of its final checkpoint (policy, optimizer state, PPO's
critic, RNG states, HA-DW's state) and of final/ (the policy in HF format; LoRA: merged and adapters), and
every logged value but wall-clock times, plus rollouts.jsonl and eval.json. `compare` prints, per run,
whether the weights are identical and which logged values differ, and how much; it exits 1 when any
weights or training values (rewards, advantages, losses, gradient norms, lr) differ.
"""
import argparse
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = ["--engine", "hf", "--steps", "3", "--prompts_per_step", "8", "--group_size", "4",
        "--micro_batch_size", "8", "--save_every", "0", "--seed", "1"]
OWN_REWARD = ["--reward", "task,docs/examples/my_rewards.py:starts_with_answer_digit", "--reward_weights",
              "1,0.5"]
# (name, script, argv, ranks); a name ending in "+resume" is the same run stopped after 2 steps and resumed
CASES = [
    ("grpo", "train_grpo.py", [], 1),
    ("rloo", "train_rloo.py", [], 1),
    ("corpo", "train_corpo.py", ["--task", "ordinal"], 1),
    ("gpg", "train_gpg.py", [], 1),
    ("ppo", "train_ppo.py", [], 1),
    ("ppo-classic", "train_ppo.py", ["--group_size", "1", "--prompts_per_step", "16"], 1),
    *[(f"{algo}-vllm", f"train_{algo}.py",
       ["--engine", "vllm", *(["--task", "ordinal"] if algo == "corpo" else [])],
       1) for algo in ("grpo", "rloo", "corpo", "gpg", "ppo")],
    ("grpo-lora", "train_grpo.py", ["--lora_rank", "8", "--lr", "1e-3"], 1),
    ("rloo-lora-kl", "train_rloo.py", ["--lora_rank", "4", "--beta", "0.05", "--lora_dropout", "0.1"], 1),
    ("ppo-lora", "train_ppo.py", ["--lora_rank", "4", "--lora_targets", "q_proj,v_proj"], 1),
    ("grpo-2ranks", "train_grpo.py", ["--hadw", "true", "--beta", "0.05", "--std_level", "batch"], 2),
    ("gpg-2ranks", "train_gpg.py", ["--beta_th", "0.9", "--log_completions", "4"], 2),
    ("ppo-2ranks", "train_ppo.py", ["--whiten_advantages", "true", "--minibatches", "2"], 2),
    ("rloo-2ranks-lora", "train_rloo.py", ["--lora_rank", "4", "--beta", "0.05", "--kl_in_reward", "true",
                                           "--dynamic_sampling", "true"], 2),
    # the switches every script shares (on GRPO), then each script's own
    ("grpo-offpolicy", "train_grpo.py", ["--updates_per_rollout", "2", "--minibatches", "2"], 1),
    ("grpo-overlong", "train_grpo.py", ["--max_new_tokens", "3", "--mask_truncated", "true",
                                        "--overlong_buffer", "2"], 1),
    ("grpo-entropy", "train_grpo.py", ["--entropy_coef", "0.01", "--top_entropy_quantile", "0.2"], 1),
    ("grpo-tis", "train_grpo.py", ["--rollout_correction", "token-tis", "--is_cap", "1.5"], 1),
    ("grpo-mis", "train_grpo.py", ["--rollout_correction", "token-mis", "--minibatches", "2"], 1),
    ("grpo-seqmis", "train_grpo.py", ["--rollout_correction", "seq-mis", "--updates_per_rollout", "2"], 1),
    ("grpo-padded", "train_grpo.py", ["--packing", "false"], 1),
    ("grpo-checkpointing", "train_grpo.py",
     ["--gradient_checkpointing", "true", "--micro_batch_size", "5"], 1),
    ("grpo-rewards", "train_grpo.py", [*OWN_REWARD, "--format_weight", "0.5"], 1),
    ("grpo-optim", "train_grpo.py", ["--warmup", "2", "--weight_decay", "0.1", "--grad_clip", "0.05",
                                     "--temperature", "0.7", "--lr", "1e-3"], 1),
    ("grpo-logs", "train_grpo.py", ["--log_completions", "5", "--eval_every", "2", "--eval_limit", "6",
                                    "--eval_n", "3"], 1),
    ("grpo-calibration", "train_grpo.py", ["--task", "calibration", "--brier", "true", "--eval_every", "3",
                                           "--eval_limit", "8"], 1),
    ("grpo-config", "train_grpo.py", ["--config", "{config}"], 1),
    ("grpo-kl", "train_grpo.py", ["--beta", "0.05", "--clip_eps_high", "0.28", "--loss_agg", "token-mean"],
     1),
    ("grpo-drgrpo", "train_grpo.py", ["--std_norm", "false", "--loss_agg", "seq-mean-token-sum-norm"], 1),
    ("grpo-batchstd", "train_grpo.py", ["--std_level", "batch", "--adv_eps", "1e-5"], 1),
    ("grpo-cispo", "train_grpo.py", ["--surrogate", "cispo", "--updates_per_rollout", "2"], 1),
    ("grpo-gspo", "train_grpo.py", ["--ratio_level", "sequence", "--minibatches", "2"], 1),
    ("grpo-hadw", "train_grpo.py", ["--hadw", "true", "--steps", "4"], 1),
    ("grpo-hadw-mean", "train_grpo.py", ["--hadw", "true", "--hadw_anchor", "mean"], 1),
    ("grpo-dynamic", "train_grpo.py", ["--dynamic_sampling", "true", "--max_sampling_rounds", "3"], 1),
    ("rloo-kl-reward", "train_rloo.py", ["--beta", "0.05", "--kl_in_reward", "true"], 1),
    ("rloo-dynamic", "train_rloo.py", ["--dynamic_sampling", "true", "--mask_truncated", "true"], 1),
    ("corpo-static", "train_corpo.py", ["--task", "ordinal", "--baseline", "static", "--beta", "0.05"], 1),
    ("corpo-rmin", "train_corpo.py",
     ["--task", "ordinal", "--r_min_correct", "0.5", "--dynamic_sampling", "true"], 1),
    ("gpg-norm", "train_gpg.py",
     ["--beta_th", "0.6", "--std_norm", "true", "--loss_agg", "seq-mean-token-mean"], 1),
    ("gpg-switches", "train_gpg.py", ["--rollout_correction", "token-tis", "--entropy_coef", "0.01",
                                      "--mask_truncated", "true"], 1),
    ("ppo-kl", "train_ppo.py", ["--beta", "0.05", "--vf_clip", "0", "--critic_lr", "1e-3"], 1),
    ("ppo-warmup", "train_ppo.py", ["--critic_warmup", "2", "--whiten_advantages", "true", "--gamma", "0.9",
                                    "--lam", "0.8", "--updates_per_rollout", "2"], 1),
    ("ppo-switches", "train_ppo.py", ["--top_entropy_quantile", "0.5", "--rollout_correction", "token-mis",
                                      "--packing", "false", "--log_completions", "3"], 1),
    ("grpo+resume", "train_grpo.py", ["--hadw", "true", "--steps", "4"], 1),
    ("ppo+resume", "train_ppo.py", ["--steps", "4", "--minibatches", "2"], 1),
    ("gpg-vllm+resume", "train_gpg.py", ["--engine", "vllm", "--steps", "4"], 1),
]
CONFIG = "lr: 0.0005\nbeta: 0.02\nstd_norm: false\ntemperature: 0.9\n"
WALL_CLOCK = ("time/", "perf/tokens_per_s")
# logged values that are training quantities (the rest are diagnostics, whose summation order may change)
TRAINING = ("reward", "adv/", "loss/", "grad_norm", "lr", "value/loss", "gpg/", "hadw/", "sampling/", "len/")


def tensor_hash(t) -> str:
    import torch
    t = t.detach().cpu().contiguous().reshape(-1)
    raw = t.view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)
    return hashlib.sha256(str((t.dtype, tuple(t.shape))).encode() + raw.numpy().tobytes()).hexdigest()[:16]


def fingerprint(obj, prefix="") -> dict:
    """{path: hash} of every tensor and plain value in a nested checkpoint structure."""
    import numpy as np
    import torch
    out = {}
    if isinstance(obj, torch.Tensor):
        out[prefix] = tensor_hash(obj)
    elif isinstance(obj, dict):
        for k in sorted(obj, key=str):
            out.update(fingerprint(obj[k], f"{prefix}/{k}"))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(fingerprint(v, f"{prefix}/{i}"))
    elif isinstance(obj, np.ndarray):  # NumPy's RNG keys before checkpoints held them as an int64 tensor
        out[prefix] = tensor_hash(torch.from_numpy(obj.astype(np.int64)))
    else:
        out[prefix] = repr(obj)
    return out


def load(path: str):
    """A checkpoint of this tool's own runs, of either format: weights only, with NumPy's arrays allowed for a
    revision from before checkpoints held NumPy's RNG keys as a tensor."""
    import numpy as np
    import torch
    allowed = [np._core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    with torch.serialization.safe_globals(allowed):
        return torch.load(path, map_location="cpu", weights_only=True)


def weights_fingerprint(run_dir: str) -> dict:
    """The final checkpoint (one process: checkpoint.pt; torchrun: checkpoint/, read through a conversion to
    one file) and final/ (safetensors), as {path: hash}; the saved options are left out (new options may
    appear)."""
    from safetensors.torch import load_file
    out = {}
    path = os.path.join(run_dir, "checkpoint.pt")
    if not os.path.exists(path):
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
        path = os.path.join(tempfile.mkdtemp(), "converted.pt")
        dcp_to_torch_save(os.path.join(run_dir, "checkpoint"), path)
        meta = load(os.path.join(run_dir, "checkpoint", "meta.pt"))
        state = {**load(path), **meta}
    else:
        state = load(path)
    state.pop("args", None)
    out.update(fingerprint(state, "checkpoint"))
    for folder, _, files in os.walk(os.path.join(run_dir, "final")):
        for f in sorted(files):
            if f.endswith(".safetensors"):
                rel = os.path.relpath(os.path.join(folder, f), run_dir)
                out.update(fingerprint(dict(load_file(os.path.join(folder, f))), rel))
    return out


def read_jsonl(path: str) -> list:
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []


def run_case(tree: str, case, out_dir: str, python: str) -> dict:
    name, script, argv, ranks = case
    config = os.path.join(out_dir, "config.yaml")
    with open(config, "w") as f:
        f.write(CONFIG)
    argv = [BASE_ARG.replace("{config}", config) for BASE_ARG in BASE + argv]
    launcher = [python] if ranks == 1 else [python, "-m", "torch.distributed.run", "--standalone",
                                            "--nproc_per_node", str(ranks)]
    env = {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "PYTHONHASHSEED": "0"}
    if ranks > 1:
        env["OMP_NUM_THREADS"] = "1"
    common = [*launcher, os.path.join(tree, script), "--out_dir", out_dir, "--run_name", name, "--wandb",
              "false"]
    commands = [common + argv]
    if name.endswith("+resume"):  # 2 steps with a checkpoint, then the rest from it
        steps = argv[len(argv) - 1 - argv[::-1].index("--steps") + 1]  # the last --steps given
        commands = [common + argv + ["--steps", "2", "--save_every", "2"],
                    common + argv + ["--steps", steps, "--resume", "true"]]
    for cmd in commands:
        # code before 2026-11-23 could abort a finished torchrun rank at exit: retried
        for attempt in range(3):
            proc = subprocess.run(cmd + ["--overwrite", "true"] * (attempt > 0), cwd=tree, env=env,
                                  capture_output=True, text=True, timeout=1200)
            if proc.returncode == 0 or "terminate called without an active exception" not in proc.stderr:
                break
        if proc.returncode != 0:
            return {"error": proc.stderr[-3000:]}
    run_dir = os.path.join(out_dir, name)
    metrics = [{k: v for k, v in row.items() if not k.startswith(WALL_CLOCK)}
               for row in read_jsonl(os.path.join(run_dir, "metrics.jsonl"))]
    evaluation = json.load(open(os.path.join(run_dir, "eval.json"))) if os.path.exists(
        os.path.join(run_dir, "eval.json")) else None
    return {"weights": weights_fingerprint(run_dir), "metrics": metrics,
            "rollouts": read_jsonl(os.path.join(run_dir, "rollouts.jsonl")), "eval": evaluation}


def record(tree: str, path: str, only=None, python=sys.executable) -> dict:
    results = {}
    out_dir = tempfile.mkdtemp(prefix="same-training-")
    for case in CASES:
        if only and case[0] not in only:
            continue
        results[case[0]] = run_case(tree, case, out_dir, python)
        status = "error" if "error" in results[case[0]] else f"{len(results[case[0]]['metrics'])} steps"
        print(f"{os.path.basename(os.path.abspath(tree))}: {case[0]:22s} {status}", flush=True)
        with open(path, "w") as f:
            json.dump(results, f)
    shutil.rmtree(out_dir, ignore_errors=True)
    return results


def differs(a, b) -> float:
    """0 when equal (NaN equals NaN), else the relative difference (inf for a missing value or a type change).
    """
    if a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)):
        return 0.0
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isfinite(a) and math.isfinite(b):
        return abs(a - b) / max(abs(a), abs(b), 1e-300)
    return math.inf


def compare(before: dict, after: dict) -> bool:
    """Print a line per run; True when every run's weights and training values are bit-identical."""
    ok = True
    for name in before:
        a, b = before[name], after.get(name)
        if b is None or "error" in a or "error" in b:
            print(f"{name:22s} not comparable: "
                  f"{'missing' if b is None else (a.get('error') or b.get('error'))[-300:]}")
            ok = False
            continue
        wa, wb = a["weights"], b["weights"]
        changed = sorted(k for k in wa if wa[k] != wb.get(k)) + sorted(set(wb) - set(wa))
        weights = "weights identical" if not changed else f"WEIGHTS DIFFER ({len(changed)}: {changed[:3]})"
        training, diagnostic, new = {}, {}, set()
        if len(a["metrics"]) != len(b["metrics"]):
            training["steps"] = math.inf
        for ra, rb in zip(a["metrics"], b["metrics"]):
            new |= set(rb) - set(ra)
            for k in ra:
                d = differs(ra[k], rb.get(k, math.nan if ra[k] is not None else None))
                if d:
                    into = training if k.startswith(TRAINING) else diagnostic
                    into[k] = max(into.get(k, 0.0), d)
        logs = [what for what in ("rollouts", "eval") if a[what] != b[what]]
        if changed or training or logs:
            ok = False
        parts = [weights, "training values "
                          "identical" if not training else f"TRAINING VALUES DIFFER {training}"]
        if diagnostic:
            parts.append("diagnostics differ by at "
                         "most " + ", ".join(f"{k} {v:.1e}" for k, v in diagnostic.items()))
        if logs:
            parts.append(f"{' and '.join(logs).upper()} DIFFER")
        if new:
            parts.append(f"new metrics {sorted(new)}")
        print(f"{name:22s} " + "; ".join(parts))
    return ok


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("command", nargs="?", choices=["record", "compare"],
                   help="record one tree, or compare two records")
    p.add_argument("files", nargs="*", help="record: OUT.json; compare: BEFORE.json AFTER.json")
    p.add_argument("--tree", default=ROOT, help="record: the code tree to run (default: this one)")
    p.add_argument("--before", default="",
                   help="a git revision: record it (in a worktree) and this tree, compare")
    p.add_argument("--only", default="", help="comma-separated case names (default: all)")
    p.add_argument("--out", default="same_training", help="--before: folder for the two records")
    a = p.parse_args(argv)
    only = set(a.only.split(",")) - {""}
    if a.command == "record":
        record(a.tree, a.files[0], only)
    elif a.command == "compare":
        before, after = (json.load(open(f)) for f in a.files)
        sys.exit(0 if compare(before, after) else 1)
    elif a.before:
        os.makedirs(a.out, exist_ok=True)
        tree = tempfile.mkdtemp(prefix="same-training-before-")
        subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", tree, a.before], check=True,
                       capture_output=True)
        try:
            before = record(tree, os.path.join(a.out, "before.json"), only)
        finally:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", tree], capture_output=True)
        after = record(ROOT, os.path.join(a.out, "after.json"), only)
        sys.exit(0 if compare(before, after) else 1)
    else:
        p.error("give a command (record, compare) or --before REV")


if __name__ == "__main__":
    main()
