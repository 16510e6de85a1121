"""Rewards beyond a per-completion function (docs/rewards.md): batched and async --reward functions, the
reserved names rm and judge, and --reward_model (rlmini/reward_model.py), with reward models built here: a
random one with its own chat tokenizer, and one whose score is known by construction."""
import asyncio
import math
import os
import subprocess
import sys
import tempfile
import types

import pytest
import torch

import rewards
from chat_model import EVEN, build_reward_model, build_chat_model
from conftest import ROOT, read_metrics, run_script
from rlmini import judge as judge_module
from rlmini import faults, memplan, reward_fns, reward_model

TMP = tempfile.gettempdir()
KNOWN, RANDOM = os.path.join(TMP, "rlmini-test-rm-known"), os.path.join(TMP, "rlmini-test-rm-random")
EXAMPLES = [{"prompt": "1+2=", "answer": 3}, {"prompt": "2+2=", "answer": 4}]
TEXTS = ["3", "4", "12", "5"]


def task():
    return rewards.load_task("addition", style="tiny", seed=0)


def per(prompt, completion, example, finished):
    return float(len(completion))


def many(prompts, completions, examples, finished):
    return [float(len(c)) for c in completions]


async def one_async(prompt, completion, example, finished):
    await asyncio.sleep(0.01)
    return float(len(completion))


async def many_async(prompts, completions, examples, finished):
    return [float(len(c)) for c in completions]


def score_all(t, texts=TEXTS):
    examples = [EXAMPLES[k // 2 % 2] for k in range(len(texts))]
    if t.score_batch is None:
        return [t.score(x, e, True) for x, e in zip(texts, examples)]
    return t.score_batch(texts, examples, [True] * len(texts), [None] * len(texts))


def bind(fn, name="fn", spec=None, weights="1,0.5", **kw):
    module = types.ModuleType(f"rm_test_{name}")
    setattr(module, name, fn)
    sys.modules[module.__name__] = module
    return reward_fns.with_reward_functions(task(), spec or f"task,{module.__name__}:{name}", weights, **kw)


@pytest.mark.parametrize("fn", [many, one_async, many_async])
def test_batched_and_async_forms_give_the_per_completion_values(fn):
    """Every form of a function gives the per-completion form's parts and weighted sums, bit for bit."""
    expected, got = score_all(bind(per)), score_all(bind(fn))
    assert reward_fns.batched(fn) == fn.__name__.startswith("many") and not reward_fns.batched(per)
    assert [s.parts for s in got] == [s.parts for s in expected] and [s.reward for s in got] == \
        [s.reward for s in expected]
    assert got[2].parts[1] == 2.0 and got[2].reward == got[2].parts[0] + 0.5 * 2.0


def test_async_calls_are_bounded_and_a_slow_function_is_stopped_by_the_deadline():
    live, peak = [0], [0]

    async def counted(prompt, completion, example, finished):
        live[0] += 1
        peak[0] = max(peak[0], live[0])
        await asyncio.sleep(0.02)
        live[0] -= 1
        return 1.0

    score_all(bind(counted, concurrency=2), TEXTS * 3)
    assert peak[0] == 2

    async def slow(prompt, completion, example, finished):
        await asyncio.sleep(5)
        return 1.0

    with pytest.raises(rewards.DataError, match=r"--reward slow on a batch of 4 \(first prompt '1\+2='\): no "
                                                r"answer within --reward_timeout 0.2 s"):
        score_all(bind(slow, "slow", timeout=0.2))


def test_bad_batched_output_and_errors_are_one_line_naming_the_function_and_prompt():
    def short(prompts, completions, examples, finished):
        return [1.0]

    with pytest.raises(rewards.DataError, match=r"--reward short on a batch of 4 .* returned 1 values: a "
                                                r"batched reward function returns one value per completion"):
        score_all(bind(short, "short"))
    import numpy as np
    for out, what in (({k: 1.0 for k in "abcd"}, "dict"), ({1.0, 2.0, 3.0, 4.0}, "set"), ("1111", "str"),
                      (np.ones((4, 1)), "2-D ndarray"), (7.5, "float")):  # a dict's keys trained before
        def odd(prompts, completions, examples, finished, out=out):
            return out
        with pytest.raises(rewards.DataError, match=rf"--reward odd on a batch of 4 .* returned a {what}: a "
                                                    r"batched reward function returns a list"):
            score_all(bind(odd, "odd"))
    for out in (np.arange(4.0), torch.arange(4.0), (0.0, 1.0, 2.0, 3.0)):  # one dimension of numbers: read
        def fine(prompts, completions, examples, finished, out=out):
            return out
        got = score_all(bind(fine, "fine"))
        assert [g.parts[1] for g in got] == [0.0, 1.0, 2.0, 3.0]
        assert all(type(g.parts[1]) is float for g in got)

    def nan_third(prompts, completions, examples, finished):
        return [1.0, 1.0, math.nan, 1.0]

    t = bind(nan_third, "nan_third")
    got = score_all(t)  # NaN where it was, named for the step's check (faults.check_rewards)
    assert math.isnan(got[2].reward) and got[0].reward == got[0].parts[0] + 0.5
    assert got[2].failed == (("nan_third", "nonfinite", "--reward nan_third returned nan on prompt '2+2=', "
                                                       "completion '12'"),) and got[0].failed == ()
    with pytest.raises(faults.NonFiniteError, match=r"the first nan for completion 1 of prompt '2\+2=' "
                       r"\(--reward nan_third returned nan .*\); stopped \(--on_nonfinite skip would skip"):
        check(t, got, "stop")

    async def boom(prompt, completion, example, finished):
        raise KeyError("col")

    t = bind(boom, "boom")
    got = score_all(t)
    assert all(s.failed[0][:2] == ("boom", "raised") for s in got)
    assert "--reward boom raised KeyError: 'col' (test_reward_model.py:" in got[0].failed[0][2]
    for on in ("stop", "skip"):  # it raised on every completion: it scores nothing, skip or not
        with pytest.raises(faults.NonFiniteError, match=r"--reward boom raised on all 4 completions of the "
                           r"step: a reward that scores nothing stops the run, whatever --on_nonfinite$"):
            check(t, got, on)


def check(t, scores, on_nonfinite):
    """faults.check_rewards over score_all's batch (groups of 2), as rollouts.score calls it."""
    rewards_ = torch.tensor([s.reward for s in scores])
    faults.check_rewards(rewards_, EXAMPLES, 2, 1, on_nonfinite, scores, t.reward_names)


def test_a_function_raising_on_some_completions_is_skipped_one_line_a_step_and_reward_sources_stop(capsys):
    def some(prompt, completion, example, finished):
        if completion == "12":
            raise ValueError("odd")
        return 1.0

    t = bind(some, "some")
    got = score_all(t)
    assert [math.isnan(s.reward) for s in got] == [False, False, True, False]
    check(t, got, "skip")  # one line for the step, naming the function, the prompt and where it raised
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--reward some raised ValueError: odd (test_reward_model.py:" in err[0]
    assert err[0].endswith("the update of this step is skipped")

    def many_boom(prompts, completions, examples, finished):
        raise RuntimeError("down")

    def rm_boom(prompts, completions, examples, finished):
        raise RuntimeError("CUDA error: device-side assert")

    rm_task = reward_fns.with_reward_functions(task(), "", "", sources={"rm": rm_boom})
    for t, who in ((bind(many_boom, "many_boom"), "--reward many_boom"), (rm_task, "--reward_model")):
        with pytest.raises(rewards.DataError) as e:  # batched or a source: nothing scored, whatever the flag
            score_all(t)
        assert str(e.value).startswith(f"{who} on a batch of 4 (first prompt '1+2=') ")
        assert "a reward that scores no completion stops the run (whatever --on_nonfinite)" in str(e.value)
        assert "would skip" not in str(e.value)

    def judge_down(prompts, completions, examples, finished):
        raise faults.JudgeError("judge: 3 of 4 judgements of this step failed")

    t = reward_fns.with_reward_functions(task(), "", "", sources={"judge": judge_down})
    with pytest.raises(faults.JudgeError, match="3 of 4"):  # its own one line, not a NaN reward
        score_all(t)


@pytest.mark.parametrize("body, message", [
    ("import sys\ndef f(prompt, completion, example, finished):\n    sys.exit(3)\n",
     "--reward f on prompt '1+2=', completion '3' called sys.exit(3): a reward function returns a value"),
    ("import sys\ndef f(prompts, completions, examples, finished):\n    sys.exit(3)\n",
     "--reward f on a batch of 4 (first prompt '1+2=') called sys.exit(3): a reward function returns a "
     "value"),
    ("import sys\nasync def f(prompt, completion, example, finished):\n    sys.exit(3)\n",
     "--reward f on prompt '1+2=', completion '3' called sys.exit(3)"),
])
def test_sys_exit_in_a_reward_function_stops_in_one_line_not_with_its_status(tmp_path, body, message):
    (tmp_path / "exits.py").write_text(body)
    t = reward_fns.with_reward_functions(task(), f"task,{tmp_path / 'exits.py'}:f", "")
    with pytest.raises(rewards.DataError) as e:
        score_all(t)
    assert message in str(e.value)


def test_a_value_beyond_float32_is_blamed_on_its_function():
    def huge(prompt, completion, example, finished):
        return 1e300 if completion == "12" else 1.0

    t = bind(huge, "huge")
    got = score_all(t)
    assert got[2].failed[0][2].startswith("--reward huge returned 1e+300, beyond float32's range")
    with pytest.raises(faults.NonFiniteError, match=r"the first inf .*\(--reward huge returned 1e\+300, "
                                                    r"beyond float32's range"):
        check(t, got, "stop")


def test_rm_and_judge_are_reserved_and_bound_by_their_flags():
    def rm(prompts, completions, examples, finished):
        return [10.0 * len(c) for c in completions]

    for spec, message in (("task,rm", "'rm' is the score of --reward_model; there is none"),
                          ("judge", "'judge' is the score of --judge_url")):
        with pytest.raises(rewards.DataError, match=message):
            reward_fns.with_reward_functions(task(), spec, "")
    t = reward_fns.with_reward_functions(task(), "", "", sources={"rm": rm, "judge": None})
    assert t.reward_names == ["rm"]  # no --reward: the reward model replaces the verifier
    got = score_all(t)
    assert [s.reward for s in got] == [10.0, 10.0, 20.0, 10.0]
    assert [s.correct for s in got] == [1.0, 0.0, 0.0, 0.0]  # the verifier still gives reward/correct
    t = reward_fns.with_reward_functions(task(), "task,rm", "1,0.5", sources={"rm": rm})
    assert [s.reward for s in score_all(t)][:2] == [t.score("3", EXAMPLES[0], True).parts[0] + 5.0, 5.0]


@pytest.fixture(scope="module")
def models_built():
    return build_reward_model(KNOWN, known=True), build_reward_model(RANDOM)


def load(path, **options):
    args = reward_model.RewardArgs(reward_model=path, **options)
    fn = reward_model.make_reward_model(args)
    fn.load(torch.device("cpu"), torch.float32)
    return fn


def test_a_folder_that_is_no_one_label_sequence_classifier_is_refused(models_built, tmp_path):
    chat = build_chat_model(str(tmp_path / "chat"))
    with pytest.raises(SystemExit, match=r"--reward_model .*chat: a Qwen3ForCausalLM, not a sequence "
                                         r"classifier"):
        reward_model.check(chat)
    import transformers
    config = transformers.AutoConfig.from_pretrained(RANDOM)
    config.num_labels = 2
    config.save_pretrained(tmp_path / "two")
    with pytest.raises(SystemExit, match=r"two: 2 labels; a reward model has one"):
        reward_model.check(str(tmp_path / "two"), files=False)  # the plan reads its config alone
    with pytest.raises(SystemExit, match=r"--reward_model someone/no-such-rm: cannot read its config"):
        reward_model.check("someone/no-such-rm")  # a hub id goes to the hub (offline here)


@pytest.mark.parametrize("layout, message", [
    # was: traceback: OSError: Error no file named model.safetensors, or pytorch_model.bin, found in directory
    ("noweights", r"noweights: the folder has no weights \(\*.safetensors or pytorch_model\*.bin\): not a "),
    # was: traceback: OSError: Repo id must be in the form 'repo_name' or 'namespace/repo_name'
    ("full/config.json", r"full/config.json: a file, not a model folder \(give the folder: .*full\)$"),
    # was, at step 1: "Expected tensor for argument #1 'indices' to have one of ... scalar types: Long, Int"
    ("notokenizer", r"notokenizer: the folder has no tokenizer files \(tokenizer.json or tokenizer_config"),
    # was: "cannot read its config (OSError: Repo id must be in the form 'repo_name' or ..."
    ("nowhere", r"nowhere: no such folder \(a hub id is owner/name"),
])
def test_a_reward_model_folder_without_its_files_is_refused_in_one_line(models_built, tmp_path, layout,
                                                                        message):
    """--reward_model PATH: a folder that lacks the weights or the tokenizer, a path to its config.json or to
    nothing: one line naming the path and what is missing, before anything loads (the memory plan, which
    reads the config alone, takes a config.json and a folder without weights)."""
    import shutil
    every = os.listdir(RANDOM)
    files = {"noweights": [f for f in every if not f.endswith(".safetensors")],
             "notokenizer": [f for f in every if f.startswith(("config", "model"))], "full": every}
    for name, kept in files.items():
        os.makedirs(tmp_path / name)
        for f in kept:
            shutil.copy(os.path.join(RANDOM, f), tmp_path / name / f)
    path = str(tmp_path / layout)
    with pytest.raises(SystemExit, match=message) as e:
        reward_model.make_reward_model(reward_model.RewardArgs(reward_model=path))
    assert path in str(e.value) and "\n" not in str(e.value)
    if layout != "nowhere":
        assert reward_model.check(path, files=False).num_labels == 1


def test_the_known_reward_model_scores_by_hand(models_built):
    """Score = s_t / sqrt(1 + eps) of the last token t of "{prompt}\\n{completion}" in the reward model's own
    tokenizer (tests/chat_model.py::build_reward_model), in every micro-batch size."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(KNOWN)
    eps = reward_model.check(KNOWN).rms_norm_eps
    prompts, completions = ["1+2=", "2+2=", "3+3=", "5+4="], ["3", "42", "6 is it", "8"]
    last = [tok.decode(tok(f"{p}\n{c}")["input_ids"][-1])[-1] for p, c in zip(prompts, completions)]
    expected = [(1.0 if ch in EVEN else -1.0) / math.sqrt(1 + eps) for ch in last]
    assert sorted(set(expected)) == [-1 / math.sqrt(1 + eps), 1 / math.sqrt(1 + eps)]
    for tokens in (1, 10_000):  # one sequence per forward, all in one (padded)
        got = load(KNOWN, reward_model_tokens=tokens)(prompts=prompts, completions=completions,
                                                      examples=EXAMPLES * 2, finished=[True] * 4)
        assert got == pytest.approx(expected, rel=1e-5)


def test_the_random_reward_model_reads_its_own_chat_template_and_padding_changes_nothing(models_built):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(RANDOM)
    ids = reward_model.render(tok, "What is 2 + 3?", "5")
    assert tok.decode(ids) == ("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n5"
                               "<|im_end|>\n")
    # a reply begun in the prompt (--task calibration_plain): one assistant turn, its beginning + completion
    begun = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "It is"}]
    assert tok.decode(reward_model.render(tok, begun, " 5")) == (
        "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\nIt is 5<|im_end|>\n")
    ref = AutoModelForSequenceClassification.from_pretrained(RANDOM).eval()
    prompts, completions = ["What is 2 + 3?", "hi"], ["5", "a much longer completion than the other one"]
    expected = [ref(input_ids=torch.tensor([reward_model.render(tok, p, c)])).logits[0, 0].item()
                for p, c in zip(prompts, completions)]
    got = load(RANDOM, reward_model_tokens=10_000)(prompts=prompts, completions=completions,
                                                   examples=EXAMPLES, finished=[True, True])
    assert got == pytest.approx(expected, rel=1e-4, abs=1e-5 * max(map(abs, expected)))


def test_the_score_head_runs_in_fp32_without_a_kv_cache(models_built, monkeypatch):
    """A bf16 reward model: the score is the fp32 product of the head's (bf16) input and weight, not the bf16
    head's output, rounded to 8 bits; the forward builds no KV cache (the config's use_cache would)."""
    import transformers
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(RANDOM)
    model = AutoModelForSequenceClassification.from_pretrained(RANDOM, dtype=torch.bfloat16).eval()
    with torch.no_grad():  # a head whose bf16 output rounds visibly: scores near 5
        model.score.weight.mul_(50.0)
    ids = [reward_model.render(tok, "What is 2 + 3?", c) for c in ("5", "five, I think", "7")]
    made, init = [], transformers.DynamicCache.__init__
    monkeypatch.setattr(transformers.DynamicCache, "__init__",
                        lambda self, *a, **k: made.append(1) or init(self, *a, **k))
    # the head's input and bf16 output in the same (batched, right-padded) forward: bf16 kernels of a batch
    # and of one sequence differ by more than the tolerance on some CPUs (AMD EPYC: 0.016 at 19)
    captured = []
    hook = model.score.register_forward_hook(lambda m, i, o: captured.append((i[0], o)))
    got = reward_model.forward_scores(model, ids, tok.pad_token_id, torch.device("cpu"))
    hook.remove()
    assert made == [] and len(captured) == 1
    (hidden, out), last = captured[0], [len(x) - 1 for x in ids]
    fp32 = torch.stack([hidden[k, t].float() @ model.score.weight[0].float() for k, t in enumerate(last)])
    bf16 = torch.stack([out[k, t, 0].float() for k, t in enumerate(last)])
    assert got.dtype == torch.float32 and (got - fp32).abs().max() <= 1e-5 * fp32.abs().max()
    assert (bf16 - fp32).abs().max() > 1e-3 * fp32.abs().max()  # what the bf16 head would have given


def test_an_offloaded_reward_model_comes_in_to_score_and_goes_back_even_when_scoring_fails(models_built,
                                                                                          monkeypatch):
    """--reward_model_offload against a double of the device: the model is moved in before its first
    forward, back to CPU memory after the last (the cache emptied), also when a forward raises."""
    fn = load(KNOWN, reward_model_offload=True)
    held, events = fn.held, []
    held["offload"], held["device"] = True, "fake-cuda"  # CPU has nothing to offload to: a double
    model = held["model"]
    monkeypatch.setattr(model, "to", lambda where: events.append(f"to {where}") or model)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("empty_cache"))

    def forward(m, ids, pad, device):
        events.append(f"forward on {device}")
        if len(ids) == 1 and ids[0] == [pad]:
            raise RuntimeError("CUDA out of memory (a double)")
        return torch.zeros(len(ids))
    monkeypatch.setattr(reward_model, "forward_scores", forward)
    kw = dict(prompts=["1+2="], completions=["3"], examples=EXAMPLES[:1], finished=[True])
    assert fn(**kw) == [0.0]
    assert events == ["to fake-cuda", "forward on fake-cuda", "to cpu", "empty_cache"]
    events.clear()
    held["pad"] = reward_model.render(held["tok"], "1+2=", "3")[0]  # the next forward's ids: fail there
    monkeypatch.setattr(reward_model, "render", lambda tok, p, c: [held["pad"]])
    with pytest.raises(RuntimeError, match="out of memory"):
        fn(**kw)
    assert events == ["to fake-cuda", "forward on fake-cuda", "to cpu", "empty_cache"]


def test_normalisation_by_group_and_running_by_hand():
    raw = torch.tensor([1.0, 3.0, 2.0, 2.0])
    got = reward_model.normalise(raw, [slice(0, 2), slice(2, 4)], "group", {})
    assert got.tolist() == pytest.approx([-1.0, 1.0, 0.0, 0.0], abs=1e-5)
    state = {}
    reward_model.normalise(raw, [], "running", state)
    second = reward_model.normalise(torch.tensor([6.0, 10.0]), [], "running", state)
    every = torch.tensor([1.0, 3.0, 2.0, 2.0, 6.0, 10.0], dtype=torch.float64)
    assert state["n"] == 6 and state["mean"] == pytest.approx(every.mean().item())
    std = every.std(unbiased=False).item()
    assert second.tolist() == pytest.approx([(6 - 4) / std, (10 - 4) / std], rel=1e-5)


def test_a_nonfinite_score_stays_out_of_the_group_and_running_statistics():
    """A NaN or inf score is returned as it is (for --on_nonfinite) and never enters a mean or std: the
    running state after a batch with one equals the state of its finite scores; later rewards are finite."""
    nan, inf = float("nan"), float("inf")
    got = reward_model.normalise(torch.tensor([1.0, 3.0, nan, 2.0, inf, 2.0]), [slice(0, 3), slice(3, 6)],
                                 "group", {})
    assert got[:2].tolist() == pytest.approx([-1.0, 1.0], abs=1e-5) and math.isnan(got[2])
    assert got[3].item() == pytest.approx(0.0, abs=1e-6) and got[4].item() == inf and got[5].item() == 0.0
    poisoned, clean = {}, {}
    out = reward_model.normalise(torch.tensor([1.0, nan, 3.0, -inf]), [], "running", poisoned)
    reward_model.normalise(torch.tensor([1.0, 3.0]), [], "running", clean)
    assert poisoned == clean and clean["n"] == 2 and math.isnan(out[1]) and out[3].item() == -inf
    later = reward_model.normalise(torch.tensor([6.0, 10.0]), [], "running", poisoned)
    assert torch.isfinite(later).all() and poisoned["n"] == 4


def test_the_plan_counts_the_reward_model(models_built):
    config = reward_model.check(RANDOM)
    from transformers import AutoModelForSequenceClassification
    n = 2 * sum(p.numel() for p in AutoModelForSequenceClassification.from_config(config).parameters())
    args = types.SimpleNamespace(reward_model=RANDOM, reward_model_offload=False, reward_model_tokens=0,
                                 micro_batch_tokens=300)
    model = AutoModelForSequenceClassification.from_config(config)
    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    root = n / 2 - len(model.model.layers) * layer  # embeddings, norm, score head
    d = memplan.classifier_counts(config)
    assert (d["total"], d["layer"], d["root"]) == (n / 2, layer, root)
    assert (d["hidden"], d["intermediate"], d["heads"]) == (config.hidden_size, config.intermediate_size,
                                                            config.num_attention_heads)
    tokens = 300  # --micro_batch_tokens without --reward_model_tokens (reward_model.scoring_tokens)
    act = tokens * 2 * (2 * d["hidden"] + 3 * d["intermediate"]) + tokens * min(tokens, d["context"])
    bf16 = torch.bfloat16
    assert memplan.reward_model_share(args, 1, bf16) == {"reward_model": n, "reward_scoring": act}
    # FSDP2: the root gathered with two layers (the one computing, the next)
    assert memplan.reward_model_share(args, 2, bf16) == {
        "reward_model": n / 2, "reward_scoring": pytest.approx(2 * (root + 2 * layer) + act)}
    args.reward_model_offload = True  # CUDA: moved in to score, beside vLLM; CPU: nowhere to offload to
    assert memplan.reward_model_share(args, 1, bf16) == {"reward_model": 0.0, "reward_scoring": n + act}
    assert memplan.reward_model_share(args, 1, bf16, cuda=False)["reward_model"] == n
    args.reward_model_tokens = 50
    assert memplan.reward_model_share(args, 1, bf16)["reward_scoring"] == n + 50 * act / 300 - 50 * 250
    c = memplan.count(memplan.load_config(RANDOM + "-tokenizer"))  # the chat model built beside it
    with_rm, without = memplan.plan(c, reward_model=1e9), memplan.plan(c)
    assert with_rm["persistent"] - without["persistent"] == 1e9
    assert with_rm["update"] - without["update"] == 1e9


@pytest.mark.slow
def test_a_policy_trained_against_the_known_reward_model_moves_toward_what_it_prefers(models_built, tmp_path):
    """GRPO on the tiny model, the known reward model as the reward (no --reward): reward/rm rises."""
    proc = run_script("train_grpo.py", [
        "--engine", "hf", "--steps", "20", "--prompts_per_step", "8", "--group_size", "8",
        "--micro_batch_size", "64", "--save_every", "0", "--reward_model", KNOWN, "--out_dir", str(tmp_path),
        "--run_name", "rm"])
    last = proc.stdout.strip().splitlines()[-1]  # the final save's line (rlmini/checkpoint.py::save_final)
    assert last == (f"saved {tmp_path / 'rm' / 'final'} (model; {last.split('(model; ')[1].split(' ')[0]} s "
                    f"to save) and {tmp_path / 'rm' / 'metrics.jsonl'}"), last
    rows = read_metrics(tmp_path / "rm")
    first, last = [sum(r["reward/rm"] for r in part) / 5 for part in (rows[:5], rows[-5:])]
    assert all(r["reward/rm"] == pytest.approx(r["reward/mean"]) for r in rows)
    assert all(r["reward/rm_raw_mean"] == pytest.approx(r["reward/rm"]) for r in rows)
    assert last > first + 0.3, (first, last)


def test_the_judge_is_bound_lazily_and_its_step_metrics_are_logged(monkeypatch):
    """--judge_url: rlmini/judge.py::make_judge (here a double) binds the judge; an async batched judge runs
    on the shared loop and its step_metrics() sums are logged."""
    calls = []

    async def judge(prompts, completions, examples, finished):
        calls.append(len(completions))
        return [0.1 * len(c) for c in completions]

    judge.step_metrics = lambda: {"judge/failures": 2.0, "judge/latency_s": 0.5}
    monkeypatch.setattr(judge_module, "make_judge", lambda a, tok, columns=None: judge)
    args = types.SimpleNamespace(judge_url="http://127.0.0.1:1/v1", reward_model="", reward_timeout=5.0)
    t = reward_fns.with_reward_functions(task(), "task,judge", "1,2", sources=reward_model.sources(args))
    reward_model.load(t, args, None, torch.device("cpu"), torch.float32)
    got = score_all(t)
    assert calls == [4] and [s.parts[1] for s in got] == pytest.approx([0.1, 0.1, 0.2, 0.1])
    assert got[0].reward == pytest.approx(1.0 + 0.2)  # "3" is 1+2's answer
    assert reward_model.source_metrics(t) == {"judge/failures": 2.0, "judge/latency_s": 0.5}


def test_held_out_scoring_neither_moves_the_running_norm_nor_the_logged_sums(models_built):
    fn = load(KNOWN, reward_norm="running")
    kw = dict(prompts=["1+2=", "2+2="], completions=["3", "4"], examples=EXAMPLES, finished=[True, True])
    assert fn(**kw) == pytest.approx([-1.0, 1.0], abs=1e-5)  # raw -1, +1: mean 0, std 1
    state = dict(fn.state)
    t = types.SimpleNamespace(sources={"rm": fn})
    with reward_model.evaluating(t):
        assert fn(prompts=["1+2="], completions=["3"], examples=EXAMPLES[:1], finished=[True]) == \
            pytest.approx([-1.0], abs=1e-5)  # the running mean and std as they were
    assert fn.state == state  # the sums: the training call's +1 and -1 (float32 rounding), not the eval's -1
    sums = {"reward/rm_raw_sum": 0.0, "reward/rm_raw_count": 2.0}
    assert fn.step_metrics() == pytest.approx(sums, abs=1e-6)


HANG = """import re, sys, time, torch
import rewards
from rlmini import faults, reward_fns, reward_model
case, example = sys.argv[1], {"prompt": "1+2=", "answer": 3}
faults.BACKSTOP_S = 0.5  # the C timer's slack past the deadline, short for the test


def f(prompt, completion, example, finished):
    time.sleep(60) if case == "sleep" else re.match(r"(a+)+$", "a" * 40 + "b")  # the regex holds the GIL
    return 1.0


sys.modules["hang"] = sys.modules[__name__]
sources, spec = {}, "task,hang:f"
if case == "rm":
    reward_model.forward_scores = lambda *a, **k: time.sleep(60)
    fn = reward_model.make_reward_model(reward_model.RewardArgs(reward_model=sys.argv[2], reward_timeout=0.5))
    fn.load(torch.device("cpu"), torch.float32)
    sources, spec = {"rm": fn}, ""
t = reward_fns.with_reward_functions(rewards.load_task("addition"), spec, "", sources=sources, timeout=0.5)
t.score_batch(["3"], [example], [True], [None]) if t.score_batch else t.score("3", example, True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("case", ["sleep", "rm", "regex"])
def test_a_reward_past_the_deadline_ends_the_process_in_one_line(tmp_path, models_built, case):
    """A sync function or a reward model's forward cannot be cancelled: past --reward_timeout the process
    ends in one line naming it (status 2); one that holds the GIL (a regex backtracking in C) is ended by
    faulthandler's C timer, its traceback saying where it hung (status 1)."""
    (tmp_path / "hang_case.py").write_text(HANG)
    p = subprocess.run([sys.executable, str(tmp_path / "hang_case.py"), case, RANDOM], cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True, timeout=120)
    if case == "regex":
        assert p.returncode == 1 and "Timeout (0:00:01)!" in p.stderr
        assert 'hang_case.py", line 9 in f' in p.stderr  # where it hung
        return
    who = "--reward f on a batch of 1" if case == "sleep" else "--reward_model on a batch of 1"
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.strip().splitlines()[-1] == (
        f"error: {who} (first prompt '1+2='): no answer within --reward_timeout 0.5 s; a running call cannot "
        f"be cancelled, so the run ends here (its last checkpoint is intact)")
