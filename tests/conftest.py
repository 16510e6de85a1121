import collections
import importlib
import json
import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import rewards  # noqa: E402
from rlmini import models, runlog, sandbox  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: left out of `make test-fast` (2 s or more on 2 cores; every "
                                       "file keeps one test in the fast tier)")


def tool_sandbox() -> str:
    """--tool_sandbox for tests that run the python tool: auto where the machine confines it (Landlock and
    seccomp), else none (the audit hook), where tests/test_sandbox.py says in its skips what is missing."""
    if not TOOL_SANDBOX:
        try:
            sandbox.plan("auto")
            TOOL_SANDBOX.append("auto")
        except SystemExit:
            TOOL_SANDBOX.append("none")
    return TOOL_SANDBOX[0]


TOOL_SANDBOX = []


def read_metrics(run_dir):
    return runlog.read_metrics(os.path.join(run_dir, "metrics.jsonl"))


def run_script(script: str, args: list, timeout: int = 1200) -> subprocess.CompletedProcess:
    """Run a train_*.py in its own process (vLLM engines are process-wide singletons)."""
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, script), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{script} {' '.join(args)} failed:\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


@pytest.fixture(scope="session")
def tiny_addition():
    """(model, tokenizer, path) of the built-in tiny model for the addition task."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    task = rewards.load_task("addition")
    path = models.build_tiny_model(task.alphabet)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(path), path


def assert_grad_close(actual, expected, rel: float = 1e-5, name: str = "", floor: float = 0.0) -> None:
    """fp32 gradients equal to `rel` of the expected gradient's norm (or of `floor`, e.g. the whole model's
    gradient norm, where this tensor's gradient is zero but for rounding). The same sum in another order
    (another CPU, thread count or kernel) moves single elements by more than a fixed per-element atol."""
    err = (actual.double() - expected.double()).norm().item()
    scale = max(expected.double().norm().item(), floor, 1e-30)
    assert err <= rel * scale, f"{name}: |actual - expected| {err:.3g} > {rel:g} x {scale:.3g}"


def docs_page(script: str) -> str:
    """A train_<name>.py's page: its Args.docs_page (common.Args), else docs/<name>.md."""
    return importlib.import_module(script).Args.docs_page or f"docs/{script[len('train_'):]}.md"


def no_page(script: str, page: str) -> str:
    """The one line a train_*.py without its page gets (tests/test_docs.py, test_siblings.py)."""
    return f"{script}.py: no docs page {page}; add it, or set Args.docs_page in {script}.py"


def undocumented(keys, algo: str, page: str = "") -> list:
    """The logged metric names that neither docs/metrics.md nor the algorithm's page (default
    docs/<algo>.md) names (in backticks); a missing page fails in one line saying what to add."""
    paths = ("docs/metrics.md", page or f"docs/{algo}.md")
    if not os.path.exists(os.path.join(ROOT, paths[1])):
        raise AssertionError(no_page(f"train_{algo}", paths[1]))
    pages = "".join(open(os.path.join(ROOT, p)).read() for p in paths)
    return sorted(k for k in keys if k != "step" and f"`{k}`" not in pages)


Block = collections.namedtuple("Block", "page line lang lines copy")


def code_blocks(page: str) -> list:
    """Every fenced code block of a docs page (path from the root), as a Block: its first line's number, its
    language (may be ""), its lines, and the (source, copy) of the last `cp train_X.py train_Y.py` before it
    (its worked example), or None."""
    blocks, copy, inside = [], None, False
    for number, line in enumerate(open(os.path.join(ROOT, page)).read().splitlines(), 1):
        if line.lstrip().startswith("```") and (not inside or line.strip() == "```"):
            inside = not inside
            blocks += [Block(page, number + 1, line.strip()[3:], [], copy)] if inside else []
        elif inside:
            blocks[-1].lines.append(line)
        else:
            copy = (re.findall(r"`cp (train_\w+\.py) (train_\w+\.py)`", line) or [copy])[-1]
    assert not inside, f"{page}:{blocks[-1].line}: a code block never closed"
    return blocks


_ENV_AT_START = set(os.environ)


@pytest.fixture(autouse=True)
def _no_vllm_logging_left_behind():
    """An engine started in this process sets vLLM's logging variables (rlmini/engine.py::_start_vllm):
    a trainer started later in a subprocess would inherit them instead of choosing its own."""
    yield
    for key in ("VLLM_LOGGING_LEVEL", "VLLM_LOGGING_STREAM"):
        if key not in _ENV_AT_START:
            os.environ.pop(key, None)


# the lines a trainer prints itself (rlmini/quiet.py); any other line on the terminal is a library's
OUR_LINES = re.compile(r"(memory plan per rank|start-up: (model|engine|first step) |step \d+/\d+ \| |"
                       r"training reward |saved |nothing saved |warning: |error: |wandb run: |"
                       r"removed checkpoint)")
VLLM_INFO = re.compile(r"\(\S+ pid=\d+\) INFO ")  # a line of vLLM's logging (vllm/logger.py::_FORMAT)


def not_ours(*outputs: str) -> list:
    """The lines of a run's stdout and stderr that the trainer did not print itself."""
    lines = [line for text in outputs for line in text.splitlines() if line.strip()]
    return [line for line in lines if not OUR_LINES.match(line)]


def mean_of(rows, key, lo, hi):
    vals = [r[key] for r in rows[lo:hi]]
    return sum(vals) / len(vals)


__all__ = ["read_metrics", "run_script", "not_ours", "VLLM_INFO", "mean_of", "assert_grad_close",
           "undocumented", "docs_page", "code_blocks", "no_page", "json"]
