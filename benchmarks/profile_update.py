"""Where the update's time goes: torch's profiler over one update of train_grpo.py on gpu-check's rungs (the
1.5B full fine-tune and the 7B LoRA on a GPU, random weights of their real shapes; on CPU a one-layer 0.5B),
its operators grouped (matrix products, attention, casts and copies, the optimizer, elementwise and the rest),
the ten largest by self time, and a Chrome trace. For issue 52's MFU work: the first GPU lease runs it in
one call.

    python benchmarks/profile_update.py --out /tmp/prof                       # a GPU: 1.5B, then 7B LoRA
    python benchmarks/profile_update.py --rungs qwen2.5-0.5b-1l --out /tmp/prof   # CPU (a check)
    python benchmarks/profile_update.py --rungs qwen2.5-1.5b --flags "--micro_batch_size 16"  # a change

Each rung runs in its own process (`--worker`): gpu-check's flags for the rung (scripts/gpu_check.py::
ladder), 3 steps, the update of step 2 profiled (from common.pre_update to common.check_sampler, as
benchmarks/vs_trl.py times it), vLLM asleep as in training (HF engine where vLLM is missing). Writes
<out>/<rung>.md (the tables) and <out>/<rung>.trace.json.
"""
import argparse
import importlib.util
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

# an operator's group: the first whose words appear in its name (lower case)
GROUPS = [("attention", ("attention", "sdpa", "flash", "_efficient_")),
          ("matrix products", ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear",
                               "gemm", "cublas", "aten::baddbmm")),
          ("optimizer", ("optimizer", "adam", "_foreach", "clip_grad")),
          ("casts and copies", ("aten::to", "aten::_to_copy", "aten::copy_", "aten::contiguous",
                                "aten::clone", "memcpy", "aten::cat")),
          ("collectives", ("nccl", "c10d", "all_gather", "reduce_scatter", "all_reduce"))]
PROFILED_STEP = 2


def group_of(name: str) -> str:
    low = name.lower()
    return next((g for g, words in GROUPS if any(w in low for w in words)), "elementwise and the rest")


def worker(rung_name: str, out: str, extra: list) -> None:
    """One rung in this process: train 3 steps, profile step 2's update, write the tables and the trace."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    import common
    import gpu_check
    import train_grpo
    cuda = torch.cuda.is_available()
    rung = next((r for r in gpu_check.ladder(torch.cuda.device_count()) if r.name == rung_name), None)
    if rung is None:
        names = [r.name for r in gpu_check.ladder(torch.cuda.device_count())]
        raise SystemExit(f"--rungs {rung_name}: not a rung on this machine ({', '.join(names)})")
    flags = list(rung.flags)
    if rung.config:
        root = gpu_check.scratch([rung], torch.cuda.device_count())
        flags = ["--model", gpu_check.model_folder(rung, 900, root)[0], *flags]
    engine = [] if importlib.util.find_spec("vllm") else ["--engine", "hf"]
    state = {"step": 0}
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    prof = profile(activities=activities, record_shapes=True)
    pre_update, check_sampler = common.pre_update, common.check_sampler

    def profiled_pre_update(*a, **kw):
        state["step"] += 1
        if state["step"] == PROFILED_STEP:
            if cuda:
                torch.cuda.synchronize()
            prof.start()
        return pre_update(*a, **kw)

    def profiled_check_sampler(*a, **kw):
        if state["step"] == PROFILED_STEP:
            if cuda:
                torch.cuda.synchronize()
            prof.stop()
        return check_sampler(*a, **kw)
    common.pre_update, common.check_sampler = profiled_pre_update, profiled_check_sampler
    train_grpo.main([*flags, *engine, "--steps", "3", "--save_every", "-1", "--wandb", "false",
                     "--out_dir", out, "--run_name", f"profile-{rung_name}", *extra])
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if getattr(e, key, 0) > 0]
    total = sum(getattr(e, key) for e in events) or 1
    groups = {}
    for e in events:
        groups[group_of(e.key)] = groups.get(group_of(e.key), 0) + getattr(e, key)
    unit = "GPU" if cuda else "CPU"
    lines = [f"# the update of step {PROFILED_STEP}, {rung_name} ({' '.join(flags + engine + extra)})", "",
             f"{unit} self time: {total / 1e3:.1f} ms", "", "| group | ms | share |", "|---|---|---|"]
    lines += [f"| {g} | {t / 1e3:.1f} | {t / total:.1%} |"
              for g, t in sorted(groups.items(), key=lambda x: -x[1])]
    lines += ["", "| operator | group | calls | ms | share |", "|---|---|---|---|---|"]
    for e in sorted(events, key=lambda e: -getattr(e, key))[:10]:
        lines.append(f"| {e.key} | {group_of(e.key)} | {e.count} | {getattr(e, key) / 1e3:.1f} | "
                     f"{getattr(e, key) / total:.1%} |")
    text = "\n".join(lines)
    with open(os.path.join(out, f"{rung_name}.md"), "w") as f:
        f.write(text + "\n")
    prof.export_chrome_trace(os.path.join(out, f"{rung_name}.trace.json"))
    print(text, flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rungs", nargs="+", default=None,
                   help="gpu-check rungs (default: qwen2.5-1.5b qwen2.5-7b-lora on a GPU, qwen2.5-0.5b-1l on "
                        "CPU)")
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "profile_update"), help="tables and traces")
    p.add_argument("--flags", default="", help="more trainer flags for every rung (a change to measure)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    if a.worker:
        return worker(a.worker, a.out, a.flags.split())
    if a.rungs is None:
        import torch
        a.rungs = ["qwen2.5-1.5b", "qwen2.5-7b-lora"] if torch.cuda.is_available() else ["qwen2.5-0.5b-1l"]
    failed = []
    for rung in a.rungs:  # one process a rung: a CUDA context and a vLLM engine are process-wide
        done = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", rung, "--out", a.out,
                               "--flags", a.flags], cwd=ROOT)
        if done.returncode:
            failed.append(rung)
    json.dump({"rungs": a.rungs, "failed": failed}, open(os.path.join(a.out, "summary.json"), "w"))
    if failed:
        raise SystemExit(f"profile_update: {', '.join(failed)} failed (their output is above)")


if __name__ == "__main__":
    main()
