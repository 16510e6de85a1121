"""`make gpu-check` (scripts/gpu_check.py) on CPU: the built-in model's rung passes and fills the table where
a CPU has numbers; a failing rung exits non-zero with one line naming it; the checks against the memory plan
and the tolerances, and the numbers behind the table, on a made-up run folder."""
import json
import math
import os
import subprocess
import sys

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import gpu_check  # noqa: E402

SMALL = ["--steps", "3", "--prompts_per_step", "4", "--group_size", "4"]  # 16 completions of 4 tokens a step


def gpu_check_run(out, *flags) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu_check.py"), "--out", str(out),
                           *flags], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def row_of(text: str, start: str) -> dict:
    line = next(x for x in text.splitlines() if x.startswith(start))
    return dict(zip(gpu_check.COLUMNS, (c.strip() for c in line.strip().strip("|").split(" | "))))


def test_the_built_in_model_passes_on_cpu_with_vllm(tmp_path):
    proc = gpu_check_run(tmp_path, *SMALL)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    text = open(tmp_path / "gpu_check.md").read()
    assert text in proc.stdout and text.startswith("`make gpu-check` ") and ": CPU, torch " in text
    row = row_of(text, "| 1 | tiny |")
    assert (row["GPUs"], row["dtype"], row["result"]) == ("1", "float32", "ok"), row
    for column in ("rollout tok/s/GPU", "vLLM alone tok/s", "update tok/s/GPU", "push s"):
        assert float(row[column].replace(",", "")) > 0, (column, row)
    diff, tol = row["sampler_diff (tol)"].rstrip(")").split(" (")
    assert 0 <= float(diff) <= 1e-5 and float(tol) >= 1e-3, row  # fp32 vLLM against the trainer: ~1e-7
    for column in ("rollout GB plan / peak", "update GB plan / peak", "push GB plan / peak"):
        assert row[column] == "n/a / n/a", (column, row)  # no CUDA memory to measure
    assert row["MFU"] == "n/a", row
    check, tol = row["push check (tol)"].rstrip(")").split(" (")
    assert 0 <= float(check) <= float(tol) and float(check) <= 1e-5, row  # fp32: the probe agrees to ~1e-7
    assert row_of(text, "| 2 |")["result"] == "skipped: CPU runs the built-in model only"
    assert all(os.path.getsize(tmp_path / f"1-tiny-{log}.log") for log in ("train", "vllm-alone"))


def test_a_failing_rung_exits_1_with_one_line_naming_it(tmp_path):
    proc = gpu_check_run(tmp_path, *SMALL, "--lr", "-1")  # passed through to train_grpo.py, which refuses it
    assert proc.returncode == 1, proc.stdout + proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("gpu-check: rung 1 (tiny) failed: training exited 1: bad option (command line): "
                           "--lr -1.0: must be > 0 (log: "), last
    assert "Traceback" not in proc.stderr
    assert "| 1 | tiny | - |" in proc.stdout and "| not run: rung 1 failed |" not in proc.stdout  # CPU: no 2
    assert "FAILED: training exited 1" in open(tmp_path / "gpu_check.md").read()


def test_bad_input_gets_one_line():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu_check.py"), "--steps", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr.strip() == (
        "gpu-check: --steps 1: at least 2 (the first step is warm-up, left out of the numbers)"), proc.stderr


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


ALONE = {"device": "NVIDIA H100 80GB HBM3", "params": 1e9, "tokens_per_s": 400.0,
         "prompt_tokens": [40, 40, 40]}
PLAN = {"rollout_gb": 30.0, "update_gb": 40.0, "push_gb": 35.0, "margin_gb": 2.0, "device": "cuda"}


def test_the_numbers_and_the_checks_on_a_made_up_run(tmp_path):
    # step 1 is warm-up: its peak is left out
    rows = [step(1, **{"memory/update_peak_gb": 99.0}), step(2), step(3, **{"time/rollout": 1.5})]
    s = gpu_check.summarise(made_up_run(tmp_path, rows, PLAN), rows, ALONE, world=2)
    assert s["rollout_tps"] == 2 * 160 / 2.0 / 2  # 160 tokens a step over 2 s, per GPU of 2
    assert s["update_tps"] == 2 * (40 + 160) / 4.0 / 2  # prompts once per group, and completions
    assert math.isclose(s["mfu"], 6 * 1e9 * s["update_tps"] / 989e12)
    assert s["update"] == (40.0, 39.0, 41.0) and s["push_s"] == 0.25
    assert gpu_check.failures(s, rows) == []
    cells = dict(zip(gpu_check.COLUMNS[2:-1], gpu_check.cells(s)))
    assert cells["update GB plan / peak"] == "40.0+2.0 / 39.0 (41.0)" and cells["MFU"] == "0.0%"
    assert cells["sampler_diff (tol)"] == "0.01 (0.1)" and cells["push check (tol)"] == "0.001 (0.05)"

    bad = [rows[0], step(2, **{"memory/update_peak_gb": 42.5, "loss/policy": math.nan}),
           step(3, **{"logprob/sampler_diff": 0.2, "push/check_diff": 0.06, "nonfinite/skipped": 1.0})]
    assert gpu_check.failures(gpu_check.summarise(str(tmp_path), bad, ALONE, 2), bad) == [
        "non-finite loss/policy", "1 updates skipped for a NaN/inf gradient",
        "logprob/sampler_diff 0.2 > tolerance 0.1", "push/check_diff 0.06 > tolerance 0.05",
        "update peak 42.50 GB > plan 40.00 GB + margin 2.00 GB"]


def test_without_the_plan_or_the_trainers_memory_metrics_the_table_says_n_a(tmp_path):
    rows = [{k: v for k, v in step(k).items() if not k.startswith(("memory/", "push/"))} for k in (1, 2)]
    s = gpu_check.summarise(made_up_run(tmp_path, rows), rows, {**ALONE, "device": "NVIDIA H100 PCIe"}, 1)
    cells = dict(zip(gpu_check.COLUMNS[2:-1], gpu_check.cells(s)))
    assert cells["rollout GB plan / peak"] == "n/a / n/a" and cells["MFU"] == "n/a"  # no peak for a PCIe H100
    assert cells["push check (tol)"] == "n/a (0.05)" and gpu_check.failures(s, rows) == []


def test_peak_flops_by_device_name():
    assert gpu_check.peak_flops("NVIDIA H100 80GB HBM3") == gpu_check.peak_flops("NVIDIA H200") == 989e12
    assert gpu_check.peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert gpu_check.peak_flops("NVIDIA L40S") == 362e12
    assert gpu_check.peak_flops("NVIDIA H100 NVL") is None and gpu_check.peak_flops("cpu") is None


def test_the_cached_model_is_the_smallest_causal_lm(tmp_path):
    def repo(name, architecture, weights: int, tokenizer=True):
        snapshot = tmp_path / f"models--org--{name}" / "snapshots" / "abc"
        snapshot.mkdir(parents=True)
        (snapshot / "config.json").write_text(json.dumps({"architectures": [architecture]}))
        (snapshot / "model.safetensors").write_bytes(b"0" * weights)
        if tokenizer:
            (snapshot / "tokenizer.json").write_text("{}")
        return str(snapshot)
    assert gpu_check.cached_model(str(tmp_path / "none")) is None
    repo("big", "Qwen2ForCausalLM", 5000)
    small = repo("small", "LlamaForCausalLM", 3000)
    repo("encoder", "BertModel", 10)
    repo("no-tokenizer", "Qwen2ForCausalLM", 10, tokenizer=False)
    assert gpu_check.cached_model(str(tmp_path)) == ("org/small", small)


def test_the_ladder(monkeypatch):
    assert gpu_check.ladder("org/m", 0)[1][4] == "skipped: CPU runs the built-in model only"
    hub = ("hub", "org/m", ["--model", "org/m", *gpu_check.HUB_FLAGS], {}, "")
    tiny = ("tiny", "tiny", ["--model", "tiny", "--task", "addition"], {}, "")
    assert gpu_check.ladder("org/m", 2) == [tiny, hub]
    monkeypatch.setattr(gpu_check, "cached_model", lambda: None)
    assert gpu_check.ladder("", 1)[1][4].startswith("skipped: no causal LM in the Hugging Face cache")
    monkeypatch.setattr(gpu_check, "cached_model", lambda: ("org/small", "/cache/snapshot"))
    name, label, flags, env, note = gpu_check.ladder("", 1)[1]  # read offline from the cache's own folder
    assert (label, flags[:2], note) == ("org/small", ["--model", "/cache/snapshot"], "")
    assert env == {"HF_HUB_OFFLINE": "1"}
