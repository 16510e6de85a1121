"""Sharded loading under torchrun (models.load_streamed): 2 gloo ranks build each model on the meta
device, shard it, and fill the shards from rank 0's stream. Each rank's peak host memory while loading
stays well under one copy of the model, and what the ranks hold, gathered, equals transformers'
from_pretrained (frozen models: untied with biases, tied in bf16, a one-label sequence classifier, bf16
weights into a bf16 model, a Mixtral whose fused experts are read from the file's per-expert tensors) and
the one-process path (the policy, with and without LoRA, bf16 weights into fp32 masters and into a bf16
LoRA base, and PPO's critic: the same tensors and the same RNG draws after loading), bit for bit. One
launch for every case; ranks that list other tensors stop in one line.

    torchrun --nproc_per_node 2 tests/test_sharded_load.py OUT   # the ranks' side (written by the test)
"""
import argparse
import json
import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from rlmini import dist, models  # noqa: E402


def qwen2(folder, layers=2, hidden=64, inter=128, vocab=300, tied=False, cls="Qwen2ForCausalLM", dtype=None,
          **kw):
    """A random Qwen2 (linear biases) saved as safetensors (in `dtype`: fp32 unless given), with the built-in
    model's tokenizer."""
    import transformers
    config = transformers.Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                                      num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2,
                                      tie_word_embeddings=tied, pad_token_id=0, **kw)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        getattr(transformers, cls)(config).to(dtype or torch.float32).save_pretrained(folder)
    tiny = models.build_tiny_model(list("0123456789+="))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        with open(os.path.join(tiny, f)) as src, open(os.path.join(folder, f), "w") as dst:
            dst.write(src.read())
    return folder


def gemma2_tied(folder):
    import transformers
    config = transformers.Gemma2Config(vocab_size=300, hidden_size=64, intermediate_size=128,
                                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                       head_dim=16, tie_word_embeddings=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(2)
        transformers.Gemma2ForCausalLM(config).save_pretrained(folder)
    return folder


def policy_args(path, lora_rank):
    return argparse.Namespace(model=path, packed_attention="auto", gradient_checkpointing=False,
                              packing=True, lora_rank=lora_rank, lora_alpha=0.0, lora_targets="all-linear",
                              lora_dropout=0.0)


def high_water_kib(reset=False) -> int:
    """This process's peak resident memory (VmHWM, KiB); reset: from now (Linux's clear_refs 5)."""
    if reset:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    return int(re.search(r"VmHWM:\s+(\d+)", open("/proc/self/status").read()).group(1))


def held(model) -> dict:
    """Every tensor of the model's state dict, whole (gathered from the shards), and its buffers."""
    out = {k: dist.full_tensor(v).detach().clone() for k, v in model.state_dict().items()}
    return {**out, **{f"buffer:{k}": b.clone() for k, b in model.named_buffers()}}


def loads(folder: str) -> dict:
    """{case: (what the model holds, the RNG state after loading)}, on this process (torchrun or not)."""
    import train_ppo
    cpu, out = torch.device("cpu"), {}
    for lora in (0, 4):
        torch.manual_seed(0)
        args = policy_args(os.path.join(folder, "untied"), lora)
        model = models.load_model(args, None, cpu, torch.float32)[0]
        out[f"policy-lora{lora}"] = held(model), torch.get_rng_state()
        torch.manual_seed(0)
        critic = train_ppo.load_critic(os.path.join(folder, "untied"), cpu, torch.float32,
                                       policy_args(None, lora))
        out[f"critic-lora{lora}"] = held(critic), torch.get_rng_state()
    for lora, dtype in ((0, torch.float32), (4, torch.bfloat16)):  # bf16 weights: fp32 masters, a bf16 base
        torch.manual_seed(0)
        model = models.load_model(policy_args(os.path.join(folder, "bf16"), lora), None, cpu, dtype)[0]
        out[f"policy-bf16-file-lora{lora}"] = held(model), torch.get_rng_state()
    return out


def worker(folder: str) -> None:
    torch.set_num_threads(1)
    cpu, dtype = dist.setup_device(argparse.Namespace(dtype="float32", dist_timeout=120))
    frozen = {"untied": (models.load_frozen(os.path.join(folder, "untied"), cpu, torch.float32),
                         torch.float32),
              "tied-bf16": (models.load_frozen(os.path.join(folder, "gemma2"), cpu, torch.bfloat16),
                            torch.bfloat16),
              "reward": (models.load_frozen(os.path.join(folder, "reward"), cpu, torch.float32,
                                            kind="sequence-classification"), torch.float32),
              "bf16-file": (models.load_frozen(os.path.join(folder, "bf16"), cpu, torch.bfloat16),
                            torch.bfloat16),
              "moe": (models.load_frozen(os.path.join(folder, "mixtral"), cpu, torch.float32), torch.float32)}
    dist.barrier()  # the code the load runs is imported by now: what follows is the model's memory
    start = high_water_kib(reset=True)
    model = models.load_frozen(os.path.join(folder, "big"), cpu, torch.float32, packing=False)
    peak = high_water_kib() - start
    whole = held(model)
    del model
    result = {k: held(m) for k, (m, _) in frozen.items()}
    result["tied"] = frozen["tied-bf16"][0].get_output_embeddings().weight is \
        frozen["tied-bf16"][0].get_input_embeddings().weight
    result["sharded"] = all(type(p).__name__ == "DTensor" for m, _ in frozen.values() for p in m.parameters())
    result.update(loads(folder))
    json.dump({"peak_kib": peak}, open(os.path.join(folder, f"peak.rank{dist.rank()}.json"), "w"))
    if dist.rank() == 0:
        torch.save({**result, "big": whole}, os.path.join(folder, "two_ranks.pt"))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("sharded"))
    # ~50M parameters (200 MB in fp32): layers dominate, so that one copy is far above one rank's half
    qwen2(os.path.join(folder, "big"), layers=12, hidden=512, inter=2048, vocab=4096)
    qwen2(os.path.join(folder, "untied"))
    qwen2(os.path.join(folder, "bf16"), dtype=torch.bfloat16)
    qwen2(os.path.join(folder, "reward"), cls="Qwen2ForSequenceClassification", num_labels=1)
    gemma2_tied(os.path.join(folder, "gemma2"))
    from test_architectures import build  # fused experts in memory, per expert (and renamed) in the file
    build("mixtral").save_pretrained(os.path.join(folder, "mixtral"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.abspath(__file__), folder]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return folder, torch.load(os.path.join(folder, "two_ranks.pt")), proc.stdout + proc.stderr


@pytest.mark.slow
def test_each_rank_loads_with_well_under_one_copy_of_the_model(two_ranks):
    folder, result, _ = two_ranks
    size_kib = sum(t.numel() * t.element_size() for k, t in result["big"].items()
                   if not k.startswith("buffer:")) / 1024
    for r in (0, 1):
        peak = json.load(open(os.path.join(folder, f"peak.rank{r}.json")))["peak_kib"]
        print(f"rank {r}: peak while loading {peak / 1024:.0f} MiB, the model {size_kib / 1024:.0f} MiB")
        # its half of the shards and a few whole tensors in flight; one copy (from_pretrained) would be >= 1
        assert peak < 0.7 * size_kib, (r, peak, size_kib)


@pytest.mark.slow
def test_the_gathered_shards_are_from_pretrained(two_ranks):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    folder, result, _ = two_ranks
    assert result["sharded"] and result["tied"]
    for case, name, cls, dtype in (("big", "big", AutoModelForCausalLM, torch.float32),
                                   ("untied", "untied", AutoModelForCausalLM, torch.float32),
                                   ("tied-bf16", "gemma2", AutoModelForCausalLM, torch.bfloat16),
                                   ("bf16-file", "bf16", AutoModelForCausalLM, torch.bfloat16),
                                   ("reward", "reward", AutoModelForSequenceClassification, torch.float32),
                                   ("moe", "mixtral", AutoModelForCausalLM, torch.float32)):
        ref = cls.from_pretrained(os.path.join(folder, name), dtype=dtype)
        expected = held(ref)
        assert expected.keys() == result[case].keys(), case
        for k, v in expected.items():
            assert v.dtype == result[case][k].dtype and torch.equal(v, result[case][k]), (case, k)


@pytest.mark.slow
def test_policy_and_critic_load_as_in_one_process(two_ranks, capfd):
    """The policy (full and LoRA: the adapters' random initial values) and PPO's critic (its new head): the
    same tensors and the same RNG state after loading as the one-process path (from_pretrained)."""
    folder, result, stdout = two_ranks
    one = loads(folder)
    bf16 = models.safetensors_header(os.path.join(folder, "bf16", "model.safetensors"))
    assert {dtype for dtype, _, _ in bf16.values()} == {torch.bfloat16}  # the file the bf16 cases read
    assert one["policy-bf16-file-lora0"][0]["model.embed_tokens.weight"].dtype == torch.float32  # masters
    for case, (tensors, rng) in one.items():
        got, got_rng = result[case]
        assert tensors.keys() == got.keys(), case
        for k, v in tensors.items():
            assert v.dtype == got[k].dtype and torch.equal(v, got[k]), (case, k)
        assert torch.equal(rng, got_rng), case  # the sampling that follows draws the same numbers
    line = f"critic: value head score.bias, score.weight initialised (new), backbone from {folder}/untied"
    printed = capfd.readouterr()
    assert line in printed.out and line in stdout
    assert "LOAD REPORT" not in stdout + printed.out + printed.err  # transformers' table is not printed


FILL = """import argparse, os, sys, torch
sys.path.insert(0, {root!r})
from rlmini import dist
dist.setup_device(argparse.Namespace(dtype="float32", dist_timeout=60))
sent, broadcast = [], torch.distributed.broadcast
torch.distributed.broadcast = lambda t, src: (sent.append(str(t.dtype)), broadcast(t, src=src))
same = [("a", torch.zeros(3)), ("b", torch.zeros(2, dtype=torch.bfloat16))]
dist.fill_from_rank0(same, lambda name, out: out.fill_(1.0078125), [torch.bfloat16] * 2 if dist.rank() == 0
                     else None)
os.write(1, f"SAME {{dist.rank()}} {{sent}} {{[(t.dtype, t.tolist()) for _, t in same]}}\\n".encode())
names = ["a", "b"] if dist.rank() == 0 else ["a", "c"]
dtypes = [torch.bfloat16] * 2 if dist.rank() == 0 else None
try:
    dist.fill_from_rank0([(n, torch.zeros(3)) for n in names], lambda name, out: out.fill_(1), dtypes)
except SystemExit as e:  # one write: the ranks' lines do not interleave
    os.write(1, f"RANK {{dist.rank()}}: {{e}}\\n".encode())
    raise
os.write(1, b"RESULT loaded\\n")
"""


@pytest.mark.slow
def test_tensors_cross_in_the_files_dtype_and_ranks_that_list_others_stop_in_one_line(tmp_path):
    """fill_from_rank0 on 2 gloo ranks: bf16 file tensors are broadcast in bf16 and cast in each rank's copy
    (into fp32 and bf16 targets alike); when the second tensor has another name on rank 1, both ranks stop,
    each with the one line that names rank 1, before any broadcast (none waits for one that never comes)."""
    script = tmp_path / "fill.py"
    script.write_text(FILL.format(root=ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(script)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode != 0 and "RESULT" not in proc.stdout
    one = (r"sharded load: rank 1 lists other tensors \(names, shapes, dtypes: hash \w+\) than rank 0 "
           r"\(\w+\): every rank must build the same model")
    x = 1.0078125  # 1 + 2^-7: exact in bf16
    values = f"[(torch.float32, [{x}, {x}, {x}]), (torch.bfloat16, [{x}, {x}])]"
    assert sorted(line for line in proc.stdout.splitlines() if line.startswith("SAME")) == [
        f"SAME {r} ['torch.bfloat16', 'torch.bfloat16'] {values}" for r in (0, 1)], proc.stdout
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("RANK"))
    assert [line[:8] for line in lines] == ["RANK 0: ", "RANK 1: "], proc.stdout + proc.stderr[-3000:]
    assert all(re.fullmatch(one, line[8:]) for line in lines), lines
    assert re.search(one, proc.stderr)  # SystemExit prints it too (torchrun may stop rank 1 first)


def test_rank_0_on_cuda_reads_one_tensor_ahead_into_the_half_the_last_copy_left(monkeypatch):
    """dist._Staging (rank 0's host side on CUDA), its CUDA calls replaced by records: tensor k+1 is read into
    the other half while k is on its way, and only once the copy of k-1 (that half's last) is done; each view
    has its tensor's dtype and shape whatever the dtypes before it; one buffer of two halves of the largest
    tensor is pinned once, unpinned after the last copy."""
    import types
    events, pins = [], []

    class Event:
        def __init__(self):
            self.done = False
            events.append(self)

        def record(self):
            pass

        def synchronize(self):
            self.done = True

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: types.SimpleNamespace(synchronize=lambda: None))
    from torch.cuda import _pin_memory_utils
    monkeypatch.setattr(_pin_memory_utils, "pin_memory", lambda ptr, n: pins.append(("pin", n)))
    monkeypatch.setattr(_pin_memory_utils, "unpin_memory", lambda ptr: pins.append(("unpin",)))
    g = torch.Generator().manual_seed(0)
    files = {"a": torch.randn(3, 5, generator=g), "b": torch.randn(7, generator=g).bfloat16(),
             "c": torch.randn(2, 2, generator=g), "d": torch.randn(1, generator=g).double(),
             "e": torch.randn(5, generator=g).bfloat16()}
    reads = []

    def read(name, out):
        i = len(reads)
        assert i < 2 or events[i - 2].done, f"{name} read over tensor {i - 2}'s copy in flight"
        reads.append(name)
        out.copy_(files[name])

    targets = [(name, torch.zeros(t.shape)) for name, t in files.items()]  # fp32 targets: cast on copy
    staging = dist._Staging(targets, [t.dtype for t in files.values()], read)
    assert reads == ["a"] and pins == [("pin", 2 * 64)]  # 60 bytes, rounded to 64 for any dtype's view
    for i, (name, t) in enumerate(files.items()):
        whole = staging.to_device(i, torch.device("cpu")).clone()
        staging.read_ahead(i + 1)
        assert reads == list(files)[:i + 2] and whole.dtype == t.dtype and torch.equal(whole, t), name
    staging.close()
    assert pins == [("pin", 128), ("unpin",)]


def test_a_checkpoint_that_lacks_a_weight_is_refused_by_name(tmp_path):
    """A frozen model with a missing tensor (here a reward model's head) is refused in one line, not
    initialised at random."""
    path = qwen2(str(tmp_path / "causal"))
    with pytest.raises(SystemExit, match="the checkpoint has no score"):
        models.load_frozen(path, torch.device("cpu"), torch.float32, kind="sequence-classification")


if __name__ == "__main__":
    worker(sys.argv[1])


def test_a_dtype_gloo_cannot_send_crosses_in_the_targets_dtype(monkeypatch):
    """gloo broadcasts no float8 or uint16..64 ("Invalid scalar type"): on CPU such a tensor is cast by rank 0
    and sent in its target's dtype; what arrives is the file's values, exactly."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29547")
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    try:
        values = torch.tensor([0.5, -1.75, 3.0, 448.0]).to(torch.float8_e4m3fn)
        ids = torch.tensor([1, 2, 65535], dtype=torch.uint16)
        targets = [("w", torch.zeros(4)), ("ids", torch.zeros(3, dtype=torch.int64))]

        def read(name, out):
            out.copy_(values if name == "w" else ids)
        dist.fill_from_rank0(targets, read, [torch.float8_e4m3fn, torch.uint16])
        assert torch.equal(targets[0][1], values.float()) and targets[1][1].tolist() == [1, 2, 65535]
    finally:
        torch.distributed.destroy_process_group()
