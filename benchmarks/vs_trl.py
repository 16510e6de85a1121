"""Our train_grpo.py against TRL's GRPOTrainer on one identical configuration: the built-in tiny model,
`addition`, 32 prompts x 8 completions per step, fp32 on CPU, one thread each, the same optimizer, loss and
sampling; interleaved A/B pairs; prints the median ratio of steps per CPU-second.

    python -m venv /tmp/trl && /tmp/trl/bin/pip install torch==2.13.0+cpu trl==1.16.0 transformers==5.19.0
    python benchmarks/vs_trl.py --trl_python /tmp/trl/bin/python                  # 5 pairs x 40 steps
    python benchmarks/vs_trl.py --trl_python /tmp/trl/bin/python --ours_root /tmp/old  # another checkout

TRL is installed only for this benchmark (in a virtual environment of its own), not a dependency of the
project. Each run is its own process; the first --skip steps (warm-up) are left out of the timing. Steps per
CPU-second = steps / process CPU seconds (user + system) between the end of step --skip and the last step.
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

# the configuration both sides run, written out once (TRL's names on the right)
PROMPTS, G, MICRO, LR, CLIP, SEED = 32, 8, 64, 3e-4, 0.2, 0
OURS = ["--engine", "hf", "--task", "addition", "--prompts_per_step", str(PROMPTS), "--group_size", str(G),
        "--micro_batch_size", str(MICRO), "--lr", str(LR), "--warmup", "0", "--weight_decay", "0",
        "--grad_clip", "1.0",
        "--temperature", "1.0", "--dtype", "float32", "--seed", str(SEED), "--loss_agg",
        "seq-mean-token-mean",
        "--std_norm", "true", "--clip_eps", str(CLIP), "--beta", "0", "--updates_per_rollout", "1",
        "--minibatches", "1",
        "--wandb", "false", "--save_every", "0", "--eval_every", "0", "--print_every", "1000000"]
TRL = dict(per_device_train_batch_size=MICRO, gradient_accumulation_steps=PROMPTS * G // MICRO,
           num_generations=G,
           learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9,
           adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0, temperature=1.0, top_p=1.0, top_k=0,
           repetition_penalty=1.0, loss_type="grpo", scale_rewards="group", epsilon=CLIP, beta=0.0,
           num_iterations=1,
           disable_dropout=True, use_vllm=False, use_cpu=True, bf16=False, fp16=False, seed=SEED,
           logging_steps=1,
           report_to="none", save_strategy="no", dataloader_num_workers=0, log_completions=False,
           mask_truncated_completions=False)


def worker_ours(steps: int, out: str, root: str) -> dict:
    sys.path.insert(0, root)
    import torch
    torch.set_num_threads(1)
    import train_grpo
    from rlmini import runlog
    marks = []
    log = runlog.RunLog.log

    def timed_log(self, step, metrics):
        log(self, step, metrics)
        marks.append((time.process_time(), time.perf_counter(), metrics["reward/mean"], metrics["len/mean"]))
    runlog.RunLog.log = timed_log
    train_grpo.main([*OURS, "--steps", str(steps), "--out_dir", out, "--run_name", "bench"])
    return {"marks": marks}


def worker_trl(steps: int, out: str, root: str) -> dict:
    import torch
    torch.set_num_threads(1)
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    sys.path.insert(0, root)
    import rewards  # the same task and verifier (standard library only)
    task = rewards.load_task("addition", "tiny", SEED)
    path = os.environ["RLMINI_TINY_PATH"]
    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token

    def reward(completions, completion_ids, answer, **kw):
        return [task.score(c, {"answer": a}, bool(ids) and ids[-1] == tok.eos_token_id).reward
                for c, ids, a in zip(completions, completion_ids, answer)]
    marks = []

    class Timer(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                marks.append((time.process_time(), time.perf_counter(), logs["reward"],
                              logs.get("completions/mean_length", float("nan"))))
    data = Dataset.from_list([{"prompt": e["prompt"], "answer": e["answer"]} for e in task.train])
    config = GRPOConfig(output_dir=out, max_steps=steps, max_completion_length=task.max_new_tokens, **TRL)
    GRPOTrainer(model=path, reward_funcs=reward, args=config, train_dataset=data, processing_class=tok,
                callbacks=[Timer()]).train()
    return {"marks": marks}


def run(side: str, python: str, steps: int, root: str, tiny_path: str) -> dict:
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "WANDB_MODE": "disabled",
               "HF_HUB_OFFLINE": "1", "RLMINI_TINY_PATH": tiny_path, "TOKENIZERS_PARALLELISM": "false"}
        t0 = time.perf_counter()
        res = subprocess.run([python, os.path.abspath(__file__), "--worker", side, "--steps", str(steps),
                              "--out", out,
                              "--ours_root", root], env=env, cwd=out, capture_output=True, text=True)
        if res.returncode:
            sys.exit(f"{side} run failed:\n{res.stderr[-3000:]}")
        r = json.loads(res.stdout.strip().splitlines()[-1])
        r["first_step_s"] = r["marks"][0][1] - t0 if r["marks"] else float("nan")
        return r


def summary(r: dict, skip: int) -> dict:
    m = r["marks"]
    cpu = m[-1][0] - m[skip - 1][0]
    tail = m[len(m) // 2:]
    return {"sps": (len(m) - skip) / cpu, "steps": len(m),
            "reward": statistics.mean(x[2] for x in tail), "len": statistics.mean(x[3] for x in tail)}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trl_python", default=sys.executable, help="a Python with trl installed")
    p.add_argument("--ours_root", default=ROOT, help="the checkout of this project to time")
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--skip", type=int, default=5, help="warm-up steps left out of the timing")
    p.add_argument("--worker", choices=["ours", "trl"], help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        res = (worker_ours if args.worker == "ours" else worker_trl)(args.steps, args.out, args.ours_root)
        print(json.dumps(res))
        return
    sys.path.insert(0, ROOT)
    import rewards
    from rlmini import models
    tiny_path = models.model_path("tiny", rewards.load_task("addition", "tiny", SEED))
    versions = ("import trl, transformers, torch; "
                "print(trl.__version__, transformers.__version__, torch.__version__)")
    trl_version = subprocess.run([args.trl_python, "-c", versions], capture_output=True, text=True)
    print(f"TRL / transformers / torch of the TRL side: "
          f"{trl_version.stdout.strip() or trl_version.stderr[-300:]}")
    print(f"ours: {' '.join(OURS)}\nTRL GRPOConfig: {TRL}\n")
    rows = []
    for i in range(args.pairs):
        order = ["ours", "trl"] if i % 2 == 0 else ["trl", "ours"]
        res = {side: run(side, sys.executable if side == "ours" else args.trl_python, args.steps,
                         args.ours_root,
                         tiny_path) for side in order}
        s = {side: summary(res[side], args.skip) for side in res}
        rows.append((i + 1, s["ours"], s["trl"], res["ours"]["first_step_s"], res["trl"]["first_step_s"]))
        print(f"pair {i + 1}: ours {s['ours']['sps']:.2f} steps/CPU-s, TRL {s['trl']['sps']:.2f}, ratio "
              f"{s['ours']['sps'] / s['trl']['sps']:.2f}", flush=True)
    print("\n| pair | ours steps/CPU-s | TRL steps/CPU-s | ratio | ours to step 1 (s) | TRL to step 1 (s) | "
          "ours reward / len (2nd half) | TRL reward / len |")
    print("|---|---|---|---|---|---|---|---|")
    for i, o, t, fo, ft in rows:
        print(f"| {i} | {o['sps']:.2f} | {t['sps']:.2f} | {o['sps'] / t['sps']:.2f} | {fo:.1f} | {ft:.1f} | "
              f"{o['reward']:.3f} / {o['len']:.2f} | {t['reward']:.3f} / {t['len']:.2f} |")
    ratios = [o["sps"] / t["sps"] for _, o, t, _, _ in rows]
    print(f"\nmedian ratio (ours / TRL steps per CPU-second): {statistics.median(ratios):.2f} (min "
          f"{min(ratios):.2f}, max {max(ratios):.2f}; {args.pairs} interleaved pairs x {args.steps} steps, "
          f"first {args.skip} left out)")


if __name__ == "__main__":
    main()
