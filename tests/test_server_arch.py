"""--engine server on an architecture vLLM 0.32 runs only through its Transformers backend (GPT-NeoX): the
in-process engine refuses it (the backend would decorate the trainer's own transformers class), a `vllm serve`
process runs it in its own process, and the trainer samples from it, pushes its weights (safetensors +
reload_weights) and checks the probe after every push. A random GPT-NeoX (head_dim 64, untied head, partial
rotary) with the built-in tokenizer and the tiny prompt style, on the calibration task (a dense reward: every
step moves the policy, so each push changes what the server must reproduce); fp32, CPU."""
import json
import os
import socket
import subprocess
import sys

import pytest
import torch
import transformers

import rewards
from conftest import ROOT, read_metrics, run_script
from rlmini import models
from rlmini import server as server_mod

START_S = 150  # the server's start-up bound: ~35 s on an idle 2-core machine, more when the cores are shared
ARCH = "GPTNeoXForCausalLM"


def build_neox(folder: str) -> str:
    """A random GPT-NeoX with the built-in tokenizer, marked to take the built-in model's prompt style."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        models.build_tiny_model(rewards.load_task("calibration").alphabet))
    config = transformers.GPTNeoXConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, rotary_pct=0.25, max_position_embeddings=512, tie_word_embeddings=False,
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config).float()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    with open(os.path.join(folder, "rlmini.json"), "w") as f:
        json.dump({"prompt_style": "tiny"}, f)
    return folder


def free_port() -> int:
    for port in range(18900, 19000):  # the range this project's tests start servers in
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    pytest.skip("no free port in 18900-18999 for the vLLM server")


class Server:
    """A local vLLM server (rlmini/server.py::launch_local) of the model, started in the background."""

    def __init__(self, model: str, log: str):
        self.port, self.log = free_port(), log
        self.url = f"http://127.0.0.1:{self.port}"
        with open(log, "w") as out:
            self.proc = server_mod.launch_local(model, self.port, out)

    def wait_ready(self) -> float:
        """Seconds it took to answer /health; skips if vLLM cannot serve the architecture at all."""
        try:
            return server_mod.wait_local(self.proc, self.port, START_S)
        except server_mod.ServerError:
            tail = open(self.log).read()[-3000:]
            if ARCH in tail and "not supported" in tail:
                pytest.skip(f"this vLLM cannot serve {ARCH} at all: {tail.strip().splitlines()[-1]}")
            raise AssertionError(f"the vLLM server did not start:\n{tail}") from None

    def kill(self) -> None:
        server_mod.stop_local(self.proc)


@pytest.fixture
def neox_server(tmp_path):
    model = build_neox(str(tmp_path / "neox"))
    server = Server(model, str(tmp_path / "server.log"))
    try:
        yield model, server
    finally:
        server.kill()


def test_a_transformers_backend_architecture_trains_through_the_server(neox_server, tmp_path):
    from vllm.model_executor.models import ModelRegistry
    model, server = neox_server
    native = getattr(ModelRegistry.models.get(ARCH), "module_name", "")
    assert not native or native.endswith(".transformers"), f"vLLM implements {ARCH} itself now: pick another"
    runs = str(tmp_path / "runs")
    base = ["train_grpo.py", "--model", model, "--task", "calibration", "--out_dir", runs, "--wandb", "false"]
    # while the server starts: the in-process engine refuses the architecture in one line, naming the server
    refused = subprocess.run([sys.executable, *base, "--engine", "vllm", "--steps", "1", "--run_name", "v"],
                             cwd=ROOT, env={**os.environ, "WANDB_MODE": "disabled"}, capture_output=True,
                             text=True, timeout=120)
    last = refused.stderr.strip().splitlines()[-1]
    assert refused.returncode != 0 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert "--engine server" in last and ARCH in last, refused.stderr[-3000:]

    server.wait_ready()
    run_script(base[0], [*base[1:], "--engine", "server", "--server_url", server.url, "--steps", "2",
                           "--push_check_every", "1", "--prompts_per_step", "4", "--group_size", "4",
                           "--max_new_tokens", "4", "--run_name", "s"], timeout=180)
    run_dir = os.path.join(runs, "s")
    steps = [r for r in read_metrics(run_dir) if "step" in r]
    assert [r["step"] for r in steps] == [1, 2]
    diffs = [r["push/check_diff"] for r in steps]
    assert all(d <= 2e-3 for d in diffs), diffs  # the fp32 push tolerance
    assert os.path.exists(os.path.join(run_dir, "final", "model.safetensors"))
    # the check could fail: the trained policy's log-probs are far from those of the weights the server loaded
    ids = torch.tensor([list(range(3, 23))])
    load = transformers.AutoModelForCausalLM.from_pretrained
    with torch.no_grad():
        start, final = (torch.log_softmax(load(p)(ids).logits, -1)
                        for p in (model, os.path.join(run_dir, "final")))
    assert (start - final).abs().mean() > 10 * 2e-3
