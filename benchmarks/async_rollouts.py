"""Lock-step (--async_steps 0) against one-step-off (--async_steps 1) rollouts through a real vLLM server, and
the GPU memory of the generation layouts from the trainer's plan (rlmini/memplan.py::plan); docs/scale.md.

    python benchmarks/async_rollouts.py                      # the server and the trainer share this machine
    python benchmarks/async_rollouts.py --trainer_cpus 1     # the trainer on CPU 1 (vLLM binds to CPU 0)
    python benchmarks/async_rollouts.py --plan_only          # the memory table alone

It starts `python -m vllm.entrypoints.openai.api_server` on the built-in tiny model (bounded wait for /health,
killed at exit whatever happens), runs train_grpo.py --engine server for --steps steps in each mode,
alternating the modes --repeats times (other processes' load drifts), drops the first --warmup steps of each
run and prints the means of the trainer's own clocks (metrics.jsonl: time/rollout, time/update, time/push,
perf/tokens_per_s), the completions' length, and the staleness and importance weights of the samples. The
workload makes generation a real share of the step: 256 completions of up to 64 tokens, at --lr 3e-5 (at the
tiny model's default 3e-4 it learns to answer in ~5 tokens within a few steps).

What it shows: the mechanism works end to end: with K = 1 the rollout of step t+1 is sampled while step t
updates, so the trainer's wait for samples (time/rollout) shrinks to what is left of it, every sample is one
push old (rollout/staleness 1, max 1), and the truncated IS weights pi_old / pi_sampler stay near 1 on a
small policy change.

What it cannot show: a GPU speed-up. On a CPU of a few cores the server and the trainer compete for the same
cores (and for those of anything else running: the load column), so the update slows while a rollout runs
beside it, and the speed-up measured here may be small, nil or negative, and varies from run to run. A
speed-up on GPUs needs the server on GPUs of its own; there the step tends to max(rollout, update) + push
instead of rollout + update + push.
"""
import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from rlmini import memplan, server  # noqa: E402

GiB = memplan.GiB
KEYS = ("time/rollout", "time/update", "time/push", "perf/tokens_per_s", "len/mean", "rollout/staleness",
        "is/mean", "is/kl")


def start_server(args, log):
    """The vLLM server (rlmini/server.py::launch_local) of the trainer's --model tiny, /health answering."""
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", args.port)) == 0:
            raise SystemExit(f"port {args.port} is taken: --port another")
    import rewards
    from rlmini.models import build_tiny_model
    proc = server.launch_local(build_tiny_model(rewards.addition_task("tiny", 0).alphabet), args.port, log)
    try:
        server.wait_local(proc, args.port, args.start_timeout)
    except server.ServerError as e:
        raise SystemExit(f"{e}: {log.name}") from None
    return proc


def train(args, k: int, out_dir: str, name: str) -> list:
    """One run of train_grpo.py --async_steps k: its metrics after the warm-up, and the load average."""
    cmd = [sys.executable, os.path.join(ROOT, "train_grpo.py"), "--engine", "server", "--server_url",
           f"http://127.0.0.1:{args.port}", "--steps", str(args.steps), "--async_steps", str(k),
           "--max_new_tokens", str(args.max_new_tokens), "--prompts_per_step", str(args.prompts_per_step),
           "--group_size", str(args.group_size), "--lr", str(args.lr), "--wandb", "false",
           "--out_dir", out_dir, "--run_name", name, "--overwrite", "true"]
    env, pin = dict(os.environ), None
    if args.trainer_cpus:
        cpus = {int(c) for c in args.trainer_cpus.split(",")}
        env["OMP_NUM_THREADS"], pin = str(len(cpus)), (lambda: os.sched_setaffinity(0, cpus))
    load = os.getloadavg()[0]
    with open(os.path.join(out_dir, f"{name}.log"), "w") as log:
        proc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=pin,
                              timeout=args.run_timeout, cwd=ROOT)
    if proc.returncode:
        raise SystemExit(f"--async_steps {k}: train_grpo.py failed ({proc.returncode}): {log.name}")
    rows = [json.loads(line) for line in open(os.path.join(out_dir, name, "metrics.jsonl"))]
    return [dict(r, load=load) for r in rows if r["step"] > args.warmup]


def summary(rows: list) -> dict:
    """The means of KEYS (and of the load) over the steps of all runs of one mode; maxima of the others."""
    out = {key: sum(r[key] for r in rows) / len(rows) for key in KEYS + ("load",)}
    out["step"] = out["time/rollout"] + out["time/update"] + out["time/push"]
    out["stale_max"] = max(r["rollout/staleness_max"] for r in rows)
    out["is_clip"] = max(r["is/clip_frac"] for r in rows)
    return out


def timing_table(results: dict) -> str:
    rows = ["| mode | s/step | time/rollout | time/update | time/push | tokens/s | len "
            "| staleness mean / max | is/mean | is/kl | is/clip_frac max | load | speed-up |",
            "|---" * 13 + "|"]
    base = results[0]["step"]
    for k, r in results.items():
        name = "lock-step (K=0)" if k == 0 else f"{k}-step-off (K={k})"
        rows.append(f"| {name} | {r['step']:.2f} | {r['time/rollout']:.2f} | {r['time/update']:.2f} | "
                    f"{r['time/push']:.2f} | {r['perf/tokens_per_s']:.0f} | {r['len/mean']:.1f} | "
                    f"{r['rollout/staleness']:.2f} / "
                    f"{r['stale_max']:.0f} | {r['is/mean']:.4f} | {r['is/kl']:.1e} | {r['is_clip']:.4f} | "
                    f"{r['load']:.1f} | "
                    f"{base / r['step']:.2f}x |")
    return "\n".join(rows)


def plan_table(gpu_gb: float = 79.2, tokens: int = 16384) -> str:
    """Per-GPU GiB of a GRPO step (bf16, checkpointing, 64 rollout sequences of 2048 tokens per engine):
    trainer only (--engine server: vLLM on GPUs of its own), and vLLM colocated on every GPU (--vllm_tp 1)
    or across groups of 4 GPUs (--vllm_tp 4). KV: full-length sequences its cache holds at once, of 64."""
    rows = ["| model | GPUs | layout | weights+grads+AdamW | activations | vLLM (share) | KV | update "
            "| rollout | push | fits |", "|---" * 11 + "|"]
    f = lambda x: f"{x / GiB:.1f}"  # noqa: E731
    for name, gpus in (("qwen2.5-7b-instruct", 8), ("qwen2.5-32b-instruct", 8), ("qwen2.5-32b-instruct", 16)):
        c = memplan.count(memplan.load_config(os.path.join(ROOT, "tests", "fixtures", "configs",
                                                           f"{name}.json")))
        for tp in (None, 1, 4):
            vllm = None if tp is None else dict(max_num_seqs=64, max_len=2048, dtype_bytes=2, tp=tp)
            p = memplan.plan(c, ranks=gpus, tokens=tokens, checkpointing=True, vllm=vllm, server=tp is None,
                             gpu_bytes=gpu_gb * GiB,
                             communicators=memplan.nccl_communicators(gpus, tp is not None, tp or 1))
            usable = p["gpu"] - p["margin"]
            over = [k for k in ("update", "rollout", "push") if p[k] > usable]
            over += ["vLLM's minimum"] if "vllm_min" in p and p["vllm"] < p["vllm_min"] else []
            layout, share, kv = "server (trainer only)", "-", "-"
            if tp:
                layout, share = f"colocated --vllm_tp {tp}", f"{f(p['vllm'])} ({p['share']:.2f})"
                kv = min(p["seqs"], 64)
            rows.append(f"| {name.split('-instruct')[0]} | {gpus} | {layout} | "
                        f"{f(p['weights'] + p['grads'] + p['adam'])} | {f(p['activations'])} | {share} | "
                        f"{kv} | {f(p['update'])} | {f(p['rollout'])} | {f(p['push'])} | "
                        f"{'yes' if p['why'] is None else 'no: ' + ', '.join(over)} |")
    return "\n".join(rows)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=18831)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the means")
    p.add_argument("--repeats", type=int, default=2, help="runs of each mode, alternating")
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--prompts_per_step", type=int, default=32)
    p.add_argument("--group_size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--trainer_cpus", default="", help="pin the trainer to these CPUs, e.g. 1 (default: all)")
    p.add_argument("--start_timeout", type=int, default=240, help="seconds the server may take to start")
    p.add_argument("--run_timeout", type=int, default=900, help="seconds a training run may take")
    p.add_argument("--plan_only", action="store_true")
    args = p.parse_args()
    print("Per-GPU memory (GiB) of a GRPO step on GPUs of 80 GB (79.2 GiB), full fine-tuning in bf16, "
          "gradient checkpointing,\n16384 tokens per micro-batch; vLLM sized for 64 sequences of 2048 tokens "
          "(rlmini/memplan.py::plan):\n")
    print(plan_table() + "\n", flush=True)
    if args.plan_only:
        return
    out_dir = tempfile.mkdtemp(prefix="rlmini_async_bench_")
    proc = None
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))  # the finally below stops the server
    try:
        with open(os.path.join(out_dir, "server.log"), "w") as log:
            t = time.time()
            proc = start_server(args, log)
            print(f"server up in {time.time() - t:.0f} s (logs and runs: {out_dir})", flush=True)
            runs = {0: [], 1: []}
            for i in range(args.repeats):
                for k in (0, 1):
                    runs[k] += train(args, k, out_dir, f"k{k}-{i}")
    finally:
        server.stop_local(proc)
    results = {k: summary(rows) for k, rows in runs.items()}
    pin = f"the trainer pinned to CPU {args.trainer_cpus}" if args.trainer_cpus else "sharing all CPUs"
    print(f"\nGRPO on `addition`, the built-in tiny model (fp32), {args.prompts_per_step} prompts x "
          f"{args.group_size} completions of up to {args.max_new_tokens} tokens per step, --lr {args.lr:g};\n"
          f"means of steps {args.warmup + 1}-{args.steps} of {args.repeats} runs of {args.steps} steps per "
          f"mode, alternating; {os.cpu_count()} CPUs, a local vLLM server (its compute bound to CPU 0 by "
          f"vLLM)\nand the trainer {pin}; load: the 1-minute load average at each run's start:\n")
    print(timing_table(results))
    print("\ns/step = time/rollout + time/update + time/push (the trainer's clocks; with K=1 time/rollout "
          "is the wait for what is\nleft of a rollout requested a step earlier). The server and the trainer "
          "share these cores with each other and\nwith other processes (load), so the speed-up here varies "
          "from run to run and says nothing about GPUs, where the\nserver has devices of its own. What holds "
          "anywhere: every K=1 batch is exactly one push stale, and the token\nIS weights "
          "pi_old / pi_sampler stay near 1 (K=0 in fp32: the correction is off, sampler and trainer agree).")


if __name__ == "__main__":
    main()
