import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import common  # noqa: E402
import rewards  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def read_metrics(run_dir):
    return common.read_metrics(os.path.join(run_dir, "metrics.jsonl"))


def run_script(script: str, args: list, timeout: int = 1200) -> subprocess.CompletedProcess:
    """Run a train_*.py in its own process (vLLM engines are process-wide singletons)."""
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, script), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{script} {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


@pytest.fixture(scope="session")
def tiny_addition():
    """(model, tokenizer, path) of the built-in tiny model for the addition task."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    task = rewards.load_task("addition")
    path = common.build_tiny_model(task.alphabet)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), AutoTokenizer.from_pretrained(path), path


def mean_of(rows, key, lo, hi):
    vals = [r[key] for r in rows[lo:hi]]
    return sum(vals) / len(vals)


__all__ = ["read_metrics", "run_script", "mean_of", "json"]
