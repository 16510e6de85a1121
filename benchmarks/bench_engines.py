"""Throughput of the default GRPO run with each rollout engine: a table of steps/s and where the
time goes (rollout, update, weight push), plus reward before and after.

    python benchmarks/bench_engines.py                  # tiny model, addition, 100 steps per engine
    python benchmarks/bench_engines.py --steps 300 --engines vllm
    python benchmarks/bench_engines.py --model Qwen/Qwen2.5-0.5B-Instruct --task gsm8k --steps 5 --engines hf
Each engine runs in its own process (a vLLM engine is process-wide). Prints a Markdown table.
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from rlmini import runlog  # noqa: E402


def train(argv: list, out: str, run_name: str, launcher=(sys.executable,), env=None, timeout=None,
          script: str = "train_grpo.py"):
    """`script` (train_grpo.py) with `argv` into out/run_name, in its own process (a vLLM engine is
    process-wide; `launcher`: python, or torchrun's command): (exit status, None after `timeout` seconds; its
    stdout and stderr; the rows of its metrics.jsonl, [] if none)."""
    cmd = [*launcher, os.path.join(ROOT, script), *argv, "--out_dir", out, "--run_name", run_name,
           "--wandb", "false"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        output, code = proc.communicate(timeout=timeout)[0], proc.returncode
    except subprocess.TimeoutExpired:
        proc.terminate()  # torchrun passes SIGTERM on to its workers
        try:
            output = proc.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            output = proc.communicate()[0]
        code = None
    path = os.path.join(out, run_name, "metrics.jsonl")
    return code, output, runlog.read_metrics(path) if os.path.exists(path) else []


def last_line(output: str) -> str:
    """What a failed run said last: its one-line error, or a traceback's last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    return (errors or lines or ["no output"])[-1]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--engines", default="hf,vllm")
    p.add_argument("--skip", type=int, default=5, help="first steps left out of the timing (warm-up)")
    args, extra = p.parse_known_args()
    rows = []
    for engine in args.engines.split(","):
        with tempfile.TemporaryDirectory() as out:
            t0 = time.perf_counter()
            code, output, m = train(["--engine", engine, "--steps", str(args.steps), "--save_every", "0",
                                     *extra], out, "bench")
            if code != 0:
                raise SystemExit(f"bench: --engines {engine} failed: {last_line(output)}")
            wall = time.perf_counter() - t0
            m = m[args.skip:]
        step_s = [r["time/rollout"] + r["time/update"] + r["time/push"] for r in m]
        mean = lambda k: statistics.mean(r[k] for r in m)
        k = max(1, min(10, len(m) // 5))
        rows.append((engine, 1 / statistics.mean(step_s), mean("time/rollout"), mean("time/update"),
                     mean("time/push"), mean("perf/tokens_per_s"),
                     statistics.mean(r["reward/mean"] for r in m[:k]),
                     statistics.mean(r["reward/mean"] for r in m[-k:]), wall))
    print("| engine | steps/s | rollout s | update s | push s | tokens/s | reward first | reward last "
          "| wall s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]:.2f} | {r[2]:.3f} | {r[3]:.3f} | {r[4]:.3f} | {r[5]:.0f} | {r[6]:.3f} | "
              f"{r[7]:.3f} | {r[8]:.0f} |")


if __name__ == "__main__":
    main()
