"""`make gpu-check` (scripts/gpu_check.py) on CPU: the built-in model's rung and a fixture-config model cut to
one layer pass and fill the table where a CPU has numbers, with vLLM and with the HF engine (vLLM's columns
n/a); a failing run exits non-zero with one line naming it; the checks against the memory plan and the
tolerances, the MFU's FLOPs and the numbers behind the table, on a made-up run folder."""
import json
import math
import os
import subprocess
import sys

import pytest
from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import gpu_check  # noqa: E402

SMALL = ["--steps", "3", "--prompts_per_step", "4", "--group_size", "2"]  # 8 completions of 4 tokens a step


def gpu_check_run(out, *flags) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu_check.py"), "--out", str(out),
                           *flags], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


def row_of(text: str, start: str) -> dict:
    line = next(x for x in text.splitlines() if x.startswith(start))
    return dict(zip(gpu_check.COLUMNS, (c.strip() for c in line.strip().strip("|").split(" | "))))


def check_cpu_row(row: dict, steps: str, vllm: bool) -> None:
    assert (row["GPUs"], row["dtype"], row["steps"], row["result"]) == ("1", "float32", steps, "ok"), row
    up, compiled = row["start-up s (compile)"].rstrip(")").split(" (")
    assert float(row["time s"]) >= float(up) > 0 and float(compiled) >= 0, row
    for column in ("rollout tok/s/GPU", "update tok/s/GPU"):
        assert float(row[column].replace(",", "")) > 0, (column, row)
    diff, tol = row["sampler_diff (tol)"].rstrip(")").split(" (")
    assert 0 <= float(diff) <= 1e-5 and float(tol) >= 1e-3, row  # fp32 engines against the trainer: ~1e-7
    for column in ("rollout GB plan / peak", "update GB plan / peak", "push GB plan / peak"):
        assert row[column] == "n/a / n/a", (column, row)  # no CUDA memory to measure
    assert row["MFU"] == "n/a", row
    check, tol = row["push check (tol)"].rstrip(")").split(" (")
    if vllm:
        assert 0 <= float(check) <= float(tol) and float(check) <= 1e-5, row  # fp32: the probe agrees
        assert float(row["push s"]) > 0, row
    else:
        assert check == "n/a" and row["push s"] == "n/a" and row["vLLM alone tok/s"] == "n/a", row


@pytest.mark.slow
def test_the_built_in_model_passes_on_cpu_with_vllm(tmp_path):
    proc = gpu_check_run(tmp_path, *SMALL, "--rungs", "tiny", "--scripts", "grpo")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    text = open(tmp_path / "gpu_check.md").read()
    assert text in proc.stdout and text.startswith("`make gpu-check` ") and ": CPU, torch " in text
    assert ", --engine vllm, " in text and "n/a: " not in text
    row = row_of(text, "| 1 | tiny | grpo |")
    check_cpu_row(row, "3", vllm=True)
    assert float(row["vLLM alone tok/s"].replace(",", "")) > 0, row
    assert all(os.path.getsize(tmp_path / f"1-tiny-grpo-{log}.log") for log in ("train", "vllm-alone"))
    log = open(tmp_path / "1-tiny-grpo-train.log").read()  # the start-up phases; the rungs save nothing
    assert [x.split(" ")[1] for x in log.splitlines() if x.startswith("start-up: ")] == [
        "model", "engine", "first"], log
    last = log.strip().splitlines()[-1]
    assert last.startswith("nothing saved (--save_every -1); metrics in /") and last.endswith(
        "/1-tiny-grpo/metrics.jsonl"), last


# What an environment of torch, transformers, peft and safetensors alone lacks (a lent GPU machine's python;
# huggingface_hub 2.x brings httpx2, not httpx): hidden from every process of the run by a sitecustomize
MINIMAL_LACKS = ("vllm", "httpx", "wandb", "datasets", "math_verify", "reasoning_gym", "openenv", "gguf",
                 "matplotlib", "sklearn", "scipy", "pandas", "pyarrow", "requests", "aiohttp", "openai",
                 "fastapi", "pytest", "tiktoken", "sentencepiece", "triton")
HIDE = """import importlib.machinery, sys
class Hidden(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.partition(".")[0] in {lacks!r}:
            return None
        return importlib.machinery.PathFinder.find_spec(name, path, target)
sys.meta_path = [Hidden if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
"""


@pytest.mark.slow
def test_the_hf_engine_is_certified_in_a_minimal_environment_with_vllms_columns_n_a(tmp_path):
    """Without vLLM, httpx, wandb, datasets... (MINIMAL_LACKS hidden, as on a lent GPU machine): every trainer
    imports, and gpu-check runs with the HF engine: the built-in model (PPO: its critic too) and
    Qwen2.5-0.5B's shapes cut to one layer, built here with random weights, its real vocabulary and the chat
    tokenizer; vLLM's columns n/a."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(HIDE.format(lacks=set(MINIMAL_LACKS)))
    path = os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env = {**os.environ, "PYTHONPATH": path, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    modules = "eval, rewards, train_grpo, train_rloo, train_gpg, train_corpo, train_ppo"
    code = (f"import importlib.util, {modules}\n"
            "assert importlib.util.find_spec('vllm') is None and importlib.util.find_spec('httpx') is None")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu_check.py"), "--out", str(out),
                           *SMALL, "--scripts", "ppo"], cwd=ROOT, env={**env, "PYTHONUNBUFFERED": "1"},
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    text = open(out / "gpu_check.md").read()
    assert ", vLLM not installed, --engine hf, " in text, text
    assert "\nvLLM columns n/a: vLLM is not installed" in text, text
    check_cpu_row(row_of(text, "| 1 | tiny | ppo |"), "2", vllm=False)
    check_cpu_row(row_of(text, "| 2 | qwen2.5-0.5b-1l | grpo |"), "3", vllm=False)
    built = json.load(open(os.path.join(gpu_check.SCRATCH, "rlmini-gpu-check", "qwen2.5-0.5b-instruct-1l",
                                        "config.json")))
    assert (built["num_hidden_layers"], built["vocab_size"], built["hidden_size"]) == (1, 151936, 896)


def test_a_failing_run_exits_1_with_one_line_naming_it(tmp_path):
    proc = gpu_check_run(tmp_path, *SMALL, "--lr", "-1")  # passed through to train_grpo.py, which refuses it
    assert proc.returncode == 1, proc.stdout + proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("gpu-check: rung 1 (tiny) grpo failed: training exited 2: bad option (command "
                           "line): --lr -1.0: must be > 0 (log: "), last
    assert "Traceback" not in proc.stderr
    assert "FAILED: training exited 2" in open(tmp_path / "gpu_check.md").read()
    assert "| 1 | tiny | rloo | - |" in proc.stdout
    assert "| not run: rung 1 (tiny) grpo failed |" in proc.stdout
    assert "| 2 | qwen2.5-0.5b-1l | grpo | - |" in proc.stdout  # nothing built after a failure


def test_bad_input_gets_one_line(monkeypatch):
    for flags, message in ((["--steps", "1"], "--steps 1: at least 2 (the first step is warm-up, left out of "
                                              "the numbers)"),
                           (["--scripts", "grpo,dpo"], "--scripts grpo,dpo: choose among "
                                                       "grpo,rloo,gpg,corpo,ppo"),
                           (["--rungs", "huge"], "--rungs huge: choose among tiny,qwen2.5-0.5b-1l"),
                           (["--engine", "server"], "--engine server: vllm or hf")):
        monkeypatch.setattr(sys, "argv", ["gpu_check.py", *flags])
        with pytest.raises(SystemExit) as e:
            gpu_check.main()
        assert str(e.value) == f"gpu-check: {message}"


def made_up_run(tmp_path, rows, plan=None):
    """A run folder as train_grpo.py writes it (config.json, with the plan the trainer will write)."""
    config = {"prompts_per_step": 4, "group_size": 4, "dtype": "bfloat16", "steps": len(rows),
              "updates_per_rollout": 1, "sampler_diff_tol": 0.1, "push_check_tol": 0.05}
    (tmp_path / "config.json").write_text(json.dumps(config))
    if plan:
        (tmp_path / "memory_plan.json").write_text(json.dumps(plan))
    return str(tmp_path)


def step(k, **over):
    row = {"step": k, "len/mean": 10.0, "time/rollout": 0.5, "time/update": 2.0, "time/push": 0.25,
           "reward/mean": 0.5, "loss/policy": 0.1, "grad_norm": 1.0, "entropy": 1.0, "nonfinite/skipped": 0.0,
           "logprob/sampler_diff": 0.01, "push/check_diff": 0.001}
    for phase, peak, reserved in (("rollout", 29.0, 31.0), ("update", 39.0, 41.0), ("push", 20.0, 21.0)):
        row.update({f"memory/{phase}_peak_gb": peak, f"memory/{phase}_reserved_gb": reserved})
    return {**row, **over}


ALONE = {"device": "NVIDIA H100 80GB HBM3", "tokens_per_s": 400.0}
COUNTS = {"params": 1e9, "steps": [[[7] * 10] * 4] * 3}  # 4 prompts of 10 tokens a step: 40
PLAN = {"rollout_allocator_gb": 30.0, "update_allocator_gb": 40.0, "push_allocator_gb": 35.0,
        "margin_gb": 2.0, "device": "cuda"}


def test_the_numbers_and_the_checks_on_a_made_up_run(tmp_path):
    # step 1 is warm-up: its peak is left out
    rows = [step(1, **{"memory/update_peak_gb": 99.0}), step(2), step(3, **{"time/rollout": 1.5})]
    s = gpu_check.summarise(made_up_run(tmp_path, rows, PLAN), rows, ALONE, 2, COUNTS)
    assert s["rollout_tps"] == 2 * 160 / 2.0 / 2  # 160 tokens a step over 2 s, per GPU of 2
    assert s["update_tps"] == 2 * (40 + 160) / 4.0 / 2  # prompts once per group, and completions
    gpu_check.add_mfu(s, ALONE["device"])
    assert math.isclose(s["mfu"], 6 * 1e9 * s["update_tps"] / 989e12)  # full fine-tune, no checkpointing
    assert s["update"] == (40.0, 39.0, 41.0) and s["push_s"] == 0.25
    assert gpu_check.failures(s, rows) == []
    s["wall"], s["startup"] = 61.2, (40.04, 31.5)
    cells = dict(zip(gpu_check.COLUMNS[3:-1], gpu_check.cells(s)))
    assert cells["update GB plan / peak"] == "40.0+2.0 / 39.0 (41.0)" and cells["MFU"] == "0.0%"
    assert cells["sampler_diff (tol)"] == "0.01 (0.1)" and cells["push check (tol)"] == "0.001 (0.05)"
    assert (cells["steps"], cells["time s"], cells["start-up s (compile)"]) == ("3", "61", "40.0 (31.5)")

    bad = [rows[0], step(2, **{"memory/update_peak_gb": 42.5, "loss/policy": math.nan}),
           step(3, **{"logprob/sampler_diff": 0.2, "push/check_diff": 0.06, "nonfinite/skipped": 1.0})]
    assert gpu_check.failures(gpu_check.summarise(str(tmp_path), bad, ALONE, 2, COUNTS), bad) == [
        "non-finite loss/policy", "1 updates skipped for a NaN/inf gradient",
        "logprob/sampler_diff 0.2 > tolerance 0.1", "push/check_diff 0.06 > tolerance 0.05",
        "update peak 42.50 GB > plan 40.00 GB + margin 2.00 GB"]


def test_without_the_plan_or_the_trainers_memory_metrics_the_table_says_n_a(tmp_path):
    rows = [{k: v for k, v in step(k).items() if not k.startswith(("memory/", "push/"))} for k in (1, 2)]
    s = gpu_check.summarise(made_up_run(tmp_path, rows), rows, {}, 1, COUNTS)
    gpu_check.add_mfu(s, "NVIDIA RTX 4090")  # not in the table
    cells = dict(zip(gpu_check.COLUMNS[3:-1], gpu_check.cells(s)))
    assert cells["rollout GB plan / peak"] == "n/a / n/a" and cells["MFU"] == "n/a"
    assert cells["push check (tol)"] == "n/a (0.05)" and cells["vLLM alone tok/s"] == "n/a"
    assert cells["start-up s (compile)"] == "n/a" and gpu_check.failures(s, rows) == []


def test_the_hf_engines_run_has_no_vllm_numbers(tmp_path):
    rows = [step(1), step(2)]
    made_up_run(tmp_path, rows, PLAN)
    cfg = json.load(open(tmp_path / "config.json"))
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "engine": "hf"}))
    s = gpu_check.summarise(str(tmp_path), rows, {}, 1)
    cells = dict(zip(gpu_check.COLUMNS[3:-1], gpu_check.cells(s)))
    assert (cells["push s"], cells["push check (tol)"], cells["vLLM alone tok/s"]) == ("n/a", "n/a (0.05)",
                                                                                       "n/a")


def test_peak_flops_by_device_name():
    assert gpu_check.peak_flops("NVIDIA H100 80GB HBM3") == gpu_check.peak_flops("NVIDIA H200") == 989e12
    assert gpu_check.peak_flops("NVIDIA H100 PCIe") == 756e12
    assert gpu_check.peak_flops("NVIDIA H100 NVL") == gpu_check.peak_flops("NVIDIA H200 NVL") == 835e12
    assert gpu_check.peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert gpu_check.peak_flops("NVIDIA L40S") == 362e12
    assert gpu_check.peak_flops("NVIDIA RTX 4090") is None and gpu_check.peak_flops("cpu") is None


def test_flops_per_token_counts_the_recompute_lora_the_critic_and_the_reference():
    n = 1e9
    assert gpu_check.flops_per_token({}, n) == 6 * n  # forward 2N, backward 4N
    assert gpu_check.flops_per_token({"gradient_checkpointing": True}, n) == 8 * n  # the forward again
    assert gpu_check.flops_per_token({"lora_rank": 16}, n) == 4 * n  # no weight gradients for the base
    lora = {"lora_rank": 16, "gradient_checkpointing": True, "beta": 0.04}  # + recompute, + the reference
    assert gpu_check.flops_per_token(lora, n) == 8 * n
    assert gpu_check.flops_per_token({"algo": "ppo"}, n) == 12 * n  # the critic, trained alike


def test_the_start_up_lines_are_read_with_their_compile_seconds():
    out = ("memory plan ...\nstart-up: model 3.1 s (task, memory plan, tiny built or loaded)\n"
           "start-up: engine 24.0 s (vllm: started, then calibrated on a probe); torch.compile 2.5 s of it\n"
           "start-up: first step 52.3 s (before it 0.2: rollout 4.1, update 47.8, push 0.2); torch.compile "
           "41.5 s of it\nstep 1/3 | reward 0\n")
    up, compiled = gpu_check.startup_seconds(out)
    assert math.isclose(up, 3.1 + 24.0 + 52.3) and math.isclose(compiled, 44.0)
    assert gpu_check.startup_seconds("no such lines") == (None, None)


def test_the_ladder_and_the_engine(monkeypatch):
    cpu, gpu = gpu_check.ladder(0), gpu_check.ladder(1, "org/m")
    assert [r.name for r in cpu] == ["tiny", "qwen2.5-0.5b-1l"] and cpu[0].scripts == gpu_check.SCRIPTS
    assert (cpu[1].config, cpu[1].layers) == ("qwen2.5-0.5b-instruct.json", 1)
    assert [r.name for r in gpu] == ["tiny", "qwen2.5-1.5b", "qwen2.5-7b-lora", "model"]
    lora = gpu[2].flags
    assert lora[lora.index("--lora_rank") + 1] == "16" and float(lora[lora.index("--beta") + 1]) > 0
    assert "--lora_rank" not in gpu[1].flags and gpu[3].flags[:2] == ["--model", "org/m"]
    extra = ["--lr", "1e-5", "--engine", "hf"]
    assert gpu_check.engine_choice(extra)[0] == "hf" and extra == ["--lr", "1e-5"]  # the flag is the check's
    monkeypatch.setattr(gpu_check.importlib.util, "find_spec", lambda name: None)  # no vLLM here
    engine, note = gpu_check.engine_choice([])
    assert engine == "hf" and note.startswith("vLLM columns n/a: vLLM is not installed here")


def test_each_start_up_phase_is_one_line_with_its_compile_seconds(monkeypatch, capsys):
    """rlmini/runlog.py::startup on a scripted clock and dynamo's compile timer: a line per phase, the first
    step's split, then nothing until the clock starts again."""
    import types

    from rlmini import runlog
    readings = [10.0, 13.5, 20.0, 60.0]
    monkeypatch.setattr(runlog.time, "perf_counter", lambda: readings.pop(0) if readings else 1e9)
    compiled = []
    monkeypatch.setitem(sys.modules, "torch._dynamo.utils",
                        types.SimpleNamespace(compilation_time_metrics={"_compile.compile_inner": compiled}))
    runlog.startup()
    runlog.startup("model", " (built)")
    compiled.append(2.0)
    runlog.startup("engine")
    compiled.append(30.0)
    runlog.first_step({"start": 21.0, "update": 25.0, "update_end": 55.0, "push": 58.0}, 60.0)
    runlog.startup("model")  # after the first step: the start-up is over
    assert capsys.readouterr().out.splitlines() == [
        "start-up: model 3.5 s (built)", "start-up: engine 6.5 s; torch.compile 2.0 s of it",
        "start-up: first step 40.0 s (before it 1.0: rollout 4.0, update 30.0, push 2.0); torch.compile "
        "30.0 s of it"]


def test_the_mfu_of_a_mixture_of_experts_counts_the_experts_a_token_runs(tmp_path):
    """A random Qwen3-MoE (2 layers, 4 experts of [32, 64] gate, up and down, top-2): gpu_check's FLOPs per
    token are the active parameters' (every weight but the 2 experts a token skips in each layer)."""
    from test_architectures import save_family
    folder = save_family("qwen3-moe", str(tmp_path / "moe"))
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"model": folder, "task": "addition", "steps": 1,
                                                 "prompts_per_step": 2}))
    from transformers import AutoModelForCausalLM
    total = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(folder).parameters())
    assert gpu_check.prompts(str(run))["params"] == total - 2 * (4 - 2) * 3 * 64 * 32
