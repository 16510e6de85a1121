"""Shared machinery: log-probs, batches, data order, arguments, atomic checkpoints, HF rollouts, greedy
decoding, common.generate."""
import copy
import json
import os
import re

import pytest
import torch

import common
import train_grpo
import train_rloo
from conftest import ROOT, assert_grad_close
from rlmini import checkpoint as ckpt
from rlmini import data, engine, logprobs, models, packing, runlog


def _naive_logprobs(model, batch, temperature):
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    logits = out.logits[:, :-1].float()
    lp = (logits / temperature).log_softmax(-1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    return lp * batch["mask"]


@pytest.mark.parametrize("chunk", [1, 3, 4096])
def test_chunked_logprobs_match_full_log_softmax_values_and_gradients(tiny_addition, chunk):
    model, tok, _ = tiny_addition
    prompts = [[4, 13, 5, 14], [6, 13, 7, 14], [3, 13, 3, 14]]
    comps = [[5, 6, 1], [12], [3, 4, 5, 6]]
    batch = packing.make_batch(prompts, comps, tok.pad_token_id, torch.device("cpu"))
    ours, entropy = logprobs.token_logprobs(model, batch, 0.7, chunk_tokens=chunk, with_entropy=True)
    ref = _naive_logprobs(model, batch, 0.7)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    g1 = torch.autograd.grad(ours.sum(), list(model.parameters()))
    g2 = torch.autograd.grad(_naive_logprobs(model, batch, 0.7).sum(), list(model.parameters()))
    for a, b in zip(g1, g2):
        assert_grad_close(a, b, rel=1e-5)
    assert (entropy[batch["mask"] > 0] > 0).all() and (entropy[batch["mask"] == 0] == 0).all()


def test_one_chunk_on_cpu_is_kept_not_recomputed_with_the_same_bits(tiny_addition, monkeypatch):
    """On CPU a micro-batch of one vocabulary chunk is not checkpointed (no recomputation in backward): its
    log-probs, entropies and gradients equal the checkpointed pass's bit for bit, at T = 1 (no division) and
    T = 0.7; two chunks or more are still checkpointed."""
    model, tok, _ = tiny_addition
    batch = packing.make_batch([[4, 13, 5, 14], [6, 13, 7, 14]], [[5, 6, 1], [12, 3, 4, 5, 6]],
                               tok.pad_token_id, torch.device("cpu"))
    calls, checkpoint, default = [], torch.utils.checkpoint.checkpoint, logprobs.recompute_chunks

    def counted(*a, **k):
        calls.append(1)
        return checkpoint(*a, **k)
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", counted)

    def run(temperature, recompute, **kw):
        monkeypatch.setattr(logprobs, "recompute_chunks", recompute)
        calls.clear()
        model.zero_grad(set_to_none=True)
        logp, entropy = logprobs.token_logprobs(model, batch, temperature, with_entropy=True, **kw)
        (logp * batch["mask"]).sum().backward()
        return logp.detach(), entropy, [p.grad.clone() for p in model.parameters()], len(calls)
    for temperature in (1.0, 0.7):
        (lp, ent, grads, n), (lp_c, ent_c, grads_c, n_c) = (run(temperature, default),
                                                            run(temperature, lambda h, c: True))
        assert (n, n_c) == (0, 1) and torch.equal(lp, lp_c) and torch.equal(ent, ent_c)
        assert all(torch.equal(a, b) for a, b in zip(grads, grads_c))
    assert run(1.0, default, chunk_tokens=3)[3] == 3  # 8 targets in chunks of 3: each recomputed


def test_the_entropy_as_a_metric_keeps_no_vocabulary_buffers_through_the_backward(tiny_addition):
    """The first pass's entropy is a metric: computed without a graph (entropy_grad False), the backward of
    the log-probs leaves no [chunk, vocab] tensor alive. With a graph no gradient reaches, the checkpoint's
    recomputation kept two per chunk until the entropy died (the trainer before this fix: 10 GB more at 16k
    tokens on Qwen2.5-1.5B, benchmarks/gpu_runs.json). Values and gradients are the same bit for bit."""
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    model, tok, _ = tiny_addition
    vocab = model.get_output_embeddings().weight.shape[0]
    batch = packing.make_batch([[4, 13, 5, 14], [6, 13, 7, 14]], [[5, 6, 1], [12, 3, 4, 5, 6]],
                               tok.pad_token_id, torch.device("cpu"))
    seen = []

    class Watch(TorchDispatchMode):  # every [chunk, vocab] tensor made (chunks of 2), by its storage
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            seen.extend(weakref.ref(t.untyped_storage()) for t in tree_leaves(out)
                        if torch.is_tensor(t) and t.dim() == 2 and t.shape[1] == vocab and len(t) <= 2)
            return out
    results = {}
    for graph in (False, True):
        seen.clear()
        model.zero_grad(set_to_none=True)
        with Watch():
            logp, entropy = logprobs.token_logprobs(model, batch, 0.7, chunk_tokens=2, with_entropy=True,
                                                    entropy_grad=graph)
            (logp * batch["mask"]).sum().backward()
        results[graph] = (logp.detach(), entropy.detach(), [p.grad.clone() for p in model.parameters()],
                          len({id(ref()) for ref in seen} - {id(None)}), entropy.requires_grad)
        del logp, entropy
    chunks = -(-int(batch["mask"].sum()) // 2)
    assert results[False][3:] == (0, False) and results[True][3:] == (2 * chunks, True)
    (logp, entropy, grads), (logp_g, entropy_g, grads_g) = results[False][:3], results[True][:3]
    assert torch.equal(logp, logp_g) and torch.equal(entropy, entropy_g)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_g))


def test_make_batch_marks_exactly_the_completion_targets():
    b = packing.make_batch([[7, 8, 9], [7]], [[1], [2, 3, 1]], 0, torch.device("cpu"))
    assert b["input_ids"].tolist() == [[7, 8, 9, 1], [7, 2, 3, 1]]
    # mask[t] = 1 where input_ids[t+1] is a completion token
    assert b["mask"].tolist() == [[0, 0, 1], [1, 1, 1]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 1, 1]]
    b = packing.make_batch([[7, 8]], [[5]], 0, torch.device("cpu"))
    assert b["mask"].tolist() == [[0, 1]]


def test_prompt_stream_is_epoch_shuffled_and_resumable():
    items = list(range(10))
    first, pos = data.prompt_batch(items, 0, 15, seed=1)
    assert sorted(first[:10]) == items and pos == 15
    again, _ = data.prompt_batch(items, 0, 15, seed=1)
    assert again == first
    a, p = data.prompt_batch(items, 0, 7, seed=1)
    b, _ = data.prompt_batch(items, p, 8, seed=1)
    assert a + b == first  # resuming from a position gives the same stream


def test_hf_rollouts_are_seeded_and_logprobs_match_trainer(tiny_addition):
    model, tok, _ = tiny_addition
    sampler = engine.HFEngine(model, tok)
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in ["3+4=", "12+9="]]
    cpu = torch.device("cpu")
    r1 = sampler.generate(prompts, 4, 4, 0.8, 5)
    r2 = sampler.generate(prompts, 4, 4, 0.8, 5)
    r3 = sampler.generate(prompts, 4, 4, 0.8, 6)
    assert r1.completion_ids == r2.completion_ids and r1.completion_ids != r3.completion_ids
    assert len(r1.completion_ids) == 8 and r1.prompt_ids[3] == prompts[0] and r1.prompt_ids[4] == prompts[1]
    for c, f in zip(r1.completion_ids, r1.finished):
        assert f == (c[-1] == tok.eos_token_id) and tok.eos_token_id not in c[:-1]
    batch = packing.make_batch(r1.prompt_ids, r1.completion_ids, tok.pad_token_id, cpu)
    with torch.no_grad():
        lp, _ = logprobs.token_logprobs(model, batch, 0.8)
    trainer = torch.cat([lp[i][batch["mask"][i] > 0] for i in range(8)])
    sampler = torch.tensor([x for s in r1.sampler_logprobs for x in s])
    torch.testing.assert_close(sampler, trainer, atol=1e-4, rtol=0)


def perturbed(model, scale: float = 0.3):
    """A copy of the random-initialised tiny model whose greedy completions vary (the copy's logits are flat:
    its argmax is one token over and over) and whose top logits stand apart (no near-ties for rounding)."""
    model = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return model


def test_hf_greedy_decoding_is_transformers_greedy_generate(tiny_addition):
    """Temperature 0: the HF engine's completions are transformers' generate(do_sample=False) token for token
    (left-padded prompts of several lengths, up to the first EOS), each token's log-prob is the log-softmax of
    transformers' own untempered logits there (and the trainer's at temperature 1), and the n completions of
    a prompt are one, repeated."""
    _, tok, _ = tiny_addition
    model = perturbed(tiny_addition[0])
    sampler = engine.HFEngine(model, tok)
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in ["3+4=", "12+9=", "0+0=", "45+67="]]
    r = sampler.generate(prompts, 2, 12, 0.0, seed=1)
    assert r.completion_ids[::2] == r.completion_ids[1::2]
    assert r.sampler_logprobs[::2] == r.sampler_logprobs[1::2]
    assert r.completion_ids == sampler.generate(prompts, 2, 12, 0.0, seed=2).completion_ids  # no draw
    width = max(map(len, prompts))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts])
    out = model.generate(input_ids=ids, attention_mask=(ids != tok.pad_token_id).long(), do_sample=False,
                         max_new_tokens=12, eos_token_id=sorted(sampler.eos_ids),
                         pad_token_id=tok.pad_token_id, output_logits=True, return_dict_in_generate=True)
    logits = torch.stack(out.logits, 1).float().log_softmax(-1)
    for i, seq in enumerate(out.sequences[:, width:].tolist()):
        ends = [k for k, t in enumerate(seq) if t in sampler.eos_ids]
        expected = seq[:ends[0] + 1] if ends else seq
        assert r.completion_ids[2 * i] == expected and r.finished[2 * i] == bool(ends)
        theirs = logits[i, torch.arange(len(expected)), expected]
        torch.testing.assert_close(torch.tensor(r.sampler_logprobs[2 * i]), theirs, atol=1e-5, rtol=0)
    assert len({tuple(c) for c in r.completion_ids}) == 4 and any(r.finished)  # not one token over and over
    batch = packing.make_batch(r.prompt_ids, r.completion_ids, tok.pad_token_id, torch.device("cpu"))
    with torch.no_grad():
        lp, _ = logprobs.token_logprobs(model, batch, 1.0)
    trainer = torch.cat([lp[i][batch["mask"][i] > 0] for i in range(len(r.completion_ids))])
    torch.testing.assert_close(torch.tensor([x for s in r.sampler_logprobs for x in s]), trainer, atol=1e-4,
                               rtol=0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_samplers_frequencies_are_the_softmax_chi_square(temperature):
    """engine.sample_rows (inverse-CDF sampling): over 400,000 draws from fixed logits, the token counts fit
    softmax(logits / T) by Pearson's chi-square at p = 1e-4 (49 degrees of freedom); a masked (-inf) token is
    never drawn; each draw's log-prob is log_softmax's at that token within fp32 rounding of the logits'
    scale; and the draws follow the generator's seed."""
    from scipy.stats import chi2
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(50, generator=g) * 2.0
    logits[7] = -float("inf")
    n = 400_000
    rows = logits.expand(n, 50).contiguous()
    tok, logp = engine.sample_rows(rows, temperature, torch.Generator().manual_seed(1))
    counts = torch.bincount(tok, minlength=50).double()
    p = torch.softmax(logits.double() / temperature, -1)
    assert counts[7] == 0 and p[7] == 0
    keep = p > 0
    stat = float(((counts[keep] - n * p[keep]) ** 2 / (n * p[keep])).sum())
    assert stat < chi2.ppf(1 - 1e-4, int(keep.sum()) - 1), stat
    expected = torch.log_softmax(logits.float() / temperature, -1)[tok]
    torch.testing.assert_close(logp, expected, atol=1e-6 * float(logits[keep].abs().max()) * 4, rtol=0)
    again, _ = engine.sample_rows(rows[:1000], temperature, torch.Generator().manual_seed(1))
    other, _ = engine.sample_rows(rows[:1000], temperature, torch.Generator().manual_seed(2))
    assert torch.equal(again, tok[:1000]) and not torch.equal(other, again)
    # a 49,152-token vocabulary (SmolLM2's): one heavy token at its softmax share, log-probs as log_softmax's
    big = torch.randn(49_152, generator=g)
    big[1234] = 10.0
    share = float(torch.softmax(big / temperature, -1)[1234])
    tok, logp = engine.sample_rows(big.expand(2000, -1).contiguous(), temperature,
                                   torch.Generator().manual_seed(3))
    assert abs(float((tok == 1234).double().mean()) - share) < 4 * (share * (1 - share) / 2000) ** 0.5
    torch.testing.assert_close(logp, torch.log_softmax(big / temperature, -1)[tok], atol=1e-5, rtol=0)


def test_the_sampler_keeps_a_large_vocabularys_tail_and_refuses_nan():
    """A dominant token first, then Qwen's 151,936-token vocabulary of tokens at e^-17 (4e-8 each, 0.6% in
    all), each below half an fp32 ulp of a running sum of 1. The chunked sum draws the tail at its share
    (Poisson bounds, mean 25.0 of 4,000), across the vocabulary, and draws the tokens a one-pass fp32 running
    sum never draws (CPU torch rounds each partial sum to fp32: a token whose rounded sum does not move is
    never drawn, its neighbour at 3x its share). The last token (0 probability) is never drawn. NaN logits
    are refused in one line."""
    vocab = 151_936
    logits = torch.full((vocab,), -17.0)
    logits[0], logits[-1] = 0.0, -float("inf")
    tail = float(1 - torch.softmax(logits.double(), -1)[0])
    drawn = torch.cat([engine.sample_rows(logits.expand(500, -1), 1.0, torch.Generator().manual_seed(s))[0]
                       for s in range(8)])
    hits = drawn[drawn != 0]
    assert 4000 * tail == pytest.approx(25.0, abs=0.1) and 10 <= len(hits) <= 45, len(hits)
    assert hits.max() > vocab // 2 and hits.min() < vocab // 2 and int(drawn.max()) < vocab - 1
    one_pass = (logits - logits.max()).exp().cumsum(-1)  # where its fp32 value does not move, never drawn
    unreachable = torch.nonzero(one_pass[1:] == one_pass[:-1]).squeeze(1) + 1
    share = len(unreachable) / (vocab - 2)  # about 65% of the tail
    assert 0.3 < share < 0.9 and torch.isin(hits, unreachable).sum() >= 0.5 * share * len(hits)
    bad = torch.zeros(2, 100)
    bad[1, 3] = float("nan")
    with pytest.raises(engine.NonFiniteError, match="NaN or inf"):  # user_errors: one line
        engine.sample_rows(bad, 1.0, torch.Generator().manual_seed(0))


def hf_run(tmp_path, *argv):
    argv = ["--engine", "hf", "--out_dir", str(tmp_path), "--wandb", "false", "--prompts_per_step", "4",
            "--group_size", "3", *argv]
    return common.setup(common.parse_args(train_grpo.Args, argv), algo="grpo")


def test_generate_is_the_rollouts_path_and_seeds_a_scripts_own_calls_apart(tmp_path):
    """common.generate samples, scores and shapes as the rollout does (the rollout is built on it: with the
    rollout's seed it returns the rollout's batch); the format bonus and the overlong penalty by hand; a
    script's own calls draw from data.extra_seed, the k-th of a step its own, reproducibly; greedy gives one
    completion per prompt, repeated; a bad n or temperature is named."""
    run = hf_run(tmp_path, "--format_weight", "0.5", "--overlong_buffer", "2", "--max_new_tokens", "4")
    G, pos = 3, run.data_pos
    batch = common.rollout(run)
    again = common.generate(run, batch.examples, G, seed=data.rollout_seed(0, 0, 0, 0))
    assert again.rollouts.completion_ids == batch.rollouts.completion_ids and run.data_pos == pos + 4
    assert torch.equal(again.rewards, batch.rewards) and torch.equal(again.correct, batch.correct)
    lengths = []
    for k, (c, f) in enumerate(zip(again.rollouts.completion_ids, again.rollouts.finished)):
        s = run.task.score(run.tokenizer.decode(c, skip_special_tokens=True), again.examples[k // G], f)
        penalty = min(0.0, max(-1.0, (4 - 2 - len(c)) / 2))  # DAPO eq. 13: -1 at the limit of 4 tokens
        assert again.rewards[k].item() == pytest.approx(s.reward + 0.5 * s.format_ok + penalty)
        lengths.append(len(c))
    assert {3, 4} & set(lengths)  # the penalty bit
    first, second = (common.generate(run, batch.examples, G) for _ in range(2))
    assert run.extra_calls == (0, 2)
    extra = [data.extra_seed(0, 0, 0, k) for k in (0, 1)]
    for scored, seed in zip((first, second), extra):
        assert scored.rollouts.completion_ids == common.generate(run, batch.examples, G,
                                                                 seed=seed).rollouts.completion_ids
    assert len({str(x.rollouts.completion_ids) for x in (batch, first, second)}) == 3
    run.step = 1  # the count starts again at each step
    assert common.generate(run, batch.examples, 1).rollouts.completion_ids == common.generate(
        run, batch.examples, 1, seed=data.extra_seed(0, 1, 0, 0)).rollouts.completion_ids
    greedy = common.generate(run, batch.examples, 2, temperature=0)
    assert len(greedy) == 8 and greedy.rollouts.completion_ids[::2] == greedy.rollouts.completion_ids[1::2]
    assert greedy.parts.shape == (8, 0) and len(greedy.scores) == 8
    for n, t in ((0, 1.0), (1, -0.5)):
        with pytest.raises(ValueError, match=f"n {n}, temperature {t}: n must be >= 1"):
            common.generate(run, batch.examples, n, temperature=t)


def trainer_logprobs_after(model, r, temperature) -> list:
    """The trainer's log-probs of each completion's sampled part (after r.prefix_lengths), prompt + whole
    completion in one forward: what check_sampler compares with the sampler's."""
    batch = packing.make_batch(r.prompt_ids, r.completion_ids, 0, torch.device("cpu"))
    with torch.no_grad():
        lp, _ = logprobs.token_logprobs(model, batch, temperature)
    return [lp[i][batch["mask"][i] > 0][k:] for i, k in enumerate(r.prefix_lengths)]


def test_generate_continues_partial_completions_as_the_engine_would_have(tmp_path):
    """common.generate(prefixes=...): a greedy completion cut anywhere and continued greedily is the same
    completion token for token, its reward the same; sampled continuations keep their prefix, stay within the
    budget left, and their sampler log-probs equal the trainer's on prompt + prefix + continuation; a prefix
    ending in EOS or filling the budget comes back scored with nothing sampled (a call with none to continue
    still runs the engine once, on a stand-in); extra_seed(run) is the next call's seed; bad prefixes and
    --tools are refused in one line naming the example."""
    run = hf_run(tmp_path, "--max_new_tokens", "12")
    run.model.load_state_dict(perturbed(run.model).state_dict())  # varied greedy completions, no near-ties
    examples = run.task.test[:6]
    whole = common.generate(run, examples, 1, temperature=0).rollouts
    assert len({tuple(c) for c in whole.completion_ids}) > 2
    for cut in (lambda c: [], lambda c: c[:1], lambda c: c[:len(c) // 2], lambda c: c[:-1]):
        prefixes = [cut(c) for c in whole.completion_ids]
        again = common.generate(run, examples, 2, temperature=0, prefixes=prefixes)
        r = again.rollouts
        assert r.completion_ids == [c for c in whole.completion_ids for _ in range(2)]
        assert r.finished == [f for f in whole.finished for _ in range(2)]
        assert r.prefix_lengths == [len(p) for p in prefixes for _ in range(2)]
        assert torch.equal(again.rewards, common.generate(run, examples, 2, temperature=0).rewards)
    for temperature in (1.0, 0.7):
        prefixes = [c[:k] for k, c in enumerate(whole.completion_ids)]  # 0 to 5 tokens
        scored = common.generate(run, examples, 3, temperature=temperature, prefixes=prefixes)
        r = scored.rollouts
        assert len(scored) == 18 and r.prompt_ids == [p for p in whole.prompt_ids for _ in range(3)]
        for k, (c, lp) in enumerate(zip(r.completion_ids, r.sampler_logprobs)):
            assert c[:k // 3] == prefixes[k // 3] and len(c) <= 12 and len(lp) == len(c)
            assert lp[:k // 3] == [0.0] * (k // 3)
        sampled = [torch.tensor(lp[k:]) for lp, k in zip(r.sampler_logprobs, r.prefix_lengths)]
        assert sum(map(len, sampled)) > 20
        torch.testing.assert_close(torch.cat(sampled), torch.cat(trainer_logprobs_after(run.model, r,
                                                                                        temperature)),
                                   atol=1e-4, rtol=0)
    eos = run.tokenizer.eos_token_id
    ended, full = [5, 6, eos], [7] * 12  # nothing to sample: both come back, scored, on a stand-in call
    calls = []
    generate = run.engine.generate
    run.engine.generate = lambda *a, **k: calls.append(a[:4]) or generate(*a, **k)
    done = common.generate(run, examples[:2], 2, prefixes=[ended, full])
    run.engine.generate = generate
    assert done.rollouts.completion_ids == [ended, ended, full, full] and len(calls) == 1
    assert calls[0][1:4] == (2, [1], run.args.temperature) and calls[0][0] != [ended, full]  # the stand-in
    assert done.rollouts.finished == [True, True, False, False]
    texts = [run.tokenizer.decode(c, skip_special_tokens=True) for c in done.rollouts.completion_ids]
    expected = [run.task.score(t, examples[k // 2], f).reward
                for k, (t, f) in enumerate(zip(texts, done.rollouts.finished))]
    assert done.rewards.tolist() == pytest.approx(expected)
    # the seed convention: extra_seed(run) is the next call's, and counts as one
    run.step, run.extra_calls = 3, (0, 0)
    assert common.extra_seed(run) == data.extra_seed(0, 3, 0, 0) and run.extra_calls == (3, 1)
    drawn = common.generate(run, examples, 1, prefixes=[[]] * 6).rollouts.completion_ids
    assert run.extra_calls == (3, 2) and drawn == common.generate(
        run, examples, 1, seed=data.extra_seed(0, 3, 0, 1)).rollouts.completion_ids
    two = re.escape(f"the prefix of example 1 ({examples[1]['prompt'][:40]!r})")
    for prefixes, message in [([[1]], r"one list of token ids per example \(2 examples, got 1\)"),
                              ([[1], "12"], f"{two} is not a list of token ids \\(ints\\): 12"),
                              ([[1], [1.0]], f"{two} is not a list of token ids"),
                              ([[1], torch.tensor([1.0])], f"{two} is not a list of token ids"),
                              ([[1], torch.ones(1, 2).long()], f"{two} is not a list of token ids"),
                              ([[1], [True]], f"{two} is not a list of token ids"),
                              ([[1], [10 ** 6]], f"{two} holds token id 1000000, outside the model's"),
                              ([[1], [1] * 13], f"{two} is 13 tokens, longer than the budget of 12")]:
        with pytest.raises(ValueError, match=message):
            common.generate(run, examples[:2], 1, prefixes=prefixes)
    tensor = common.generate(run, examples[:1], 1, prefixes=[torch.tensor([5, 6])])  # a tensor's slice too
    assert tensor.rollouts.prefix_lengths == [2]
    run.toolbox = object()
    with pytest.raises(ValueError, match="prefixes with --tools or --env: a partial trajectory's tool calls"):
        common.generate(run, examples[:1], 1, prefixes=[[]])


def test_args_from_config_file_with_command_line_override(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("lr: 0.01\ngroup_size: 4\nstd_norm: false\n")
    args = common.parse_args(train_grpo.Args, ["--config", str(cfg), "--group_size", "6"])
    assert args.lr == 0.01 and args.group_size == 6 and args.std_norm is False
    js = tmp_path / "c.json"
    js.write_text(json.dumps({"clip_eps_high": 0.28}))
    assert common.parse_args(train_grpo.Args, ["--config", str(js)]).clip_eps_high == 0.28
    assert common.parse_args(train_grpo.Args, [f"--config={js}"]).clip_eps_high == 0.28  # read, not ignored


@pytest.mark.parametrize("argv,message", [
    (["--config", "nope.yaml"], "nope.yaml: file not found"),
    (["--group_size", "1"], r"--group_size 1: must be >= 2 \(the group baseline"),
    (["--prompts_per_step", "3", "--group_size", "3", "--minibatches", "2"], "--minibatches 2 must divide"),
    (["--clip_eps", "-0.5"], "--clip_eps -0.5: must be > 0"),
    (["--grad_clip", "-1"], "--grad_clip -1.0: must be >= 0"),
    (["--hadw_eta", "1.5"], r"--hadw_eta 1.5: must be in \[0, 1\]"),
    (["--is_low", "3"], "--is_low 3.0 must not exceed --is_high 2.0"),
    (["--dtype", "float16"], "--dtype float16: training in fp16 needs gradient scaling"),
    (["--temperature", "0"], r"--temperature 0: greedy decoding is no distribution to train on .* ask "
                             r"common.generate\(run, examples, 1, temperature=0\) for greedy completions$"),
])
def test_bad_arguments_name_the_flag(argv, message):
    with pytest.raises(SystemExit, match=message):
        common.parse_args(train_grpo.Args, argv)


@pytest.mark.parametrize("flag,value",
                         [("engine", "sglang"), ("rollout_correction", "tis"), ("loss_agg", "sum"),
                                        ("hadw_anchor", "median")])
def test_a_bad_choice_is_refused_with_the_choices_listed_from_the_command_line_and_a_config(
        tmp_path, flag, value):
    choices = rf"argument --{flag}: invalid choice: '{value}' \(choose from"
    with pytest.raises(SystemExit, match=r"bad option \(command line\): " + choices):
        common.parse_args(train_grpo.Args, [f"--{flag}", value])
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"{flag}: {value}\n")  # the config's options are parsed as flags: the same check
    with pytest.raises(SystemExit, match=r"bad option \(command line or --config .*c.yaml\): " + choices):
        common.parse_args(train_grpo.Args, ["--config", str(cfg)])


def test_config_values_are_type_and_range_checked(tmp_path):
    for text, message in [("save_every: 1.7", "--save_every: invalid int value: '1.7'"),
                          ("steps: true", "--steps: invalid int value: 'True'"),
                          ("lr: -0.1", "--lr -0.1: must be > 0"), ("eval_n: 0", "--eval_n 0: must be >= 1")]:
        cfg = tmp_path / "c.yaml"
        cfg.write_text(text + "\n")
        with pytest.raises(SystemExit, match=message):
            common.parse_args(train_grpo.Args, ["--config", str(cfg)])


def test_flags_are_never_abbreviated():
    with pytest.raises(SystemExit, match=r"unknown option\(s\) \['--temp', '0.5'\]"):
        common.parse_args(train_grpo.Args, ["--temp", "0.5"])  # not --temperature


@pytest.mark.parametrize("module", ["train_grpo", "train_rloo", "train_corpo", "train_gpg"])
def test_group_scripts_refuse_groups_of_one_and_ppo_accepts_them(module):
    import importlib
    with pytest.raises(SystemExit, match="--group_size 1: must be >= 2"):
        common.parse_args(importlib.import_module(module).Args, ["--group_size", "1"])
    import train_ppo
    assert common.parse_args(train_ppo.Args, ["--group_size", "1"]).group_size == 1


def test_rollout_seeds_differ_by_step_rank_and_round_and_fit_vllm():
    seeds = {data.rollout_seed(s, step, rank, rnd) for s in (0, 1) for step in (-1, 0, 1, 2)
             for rank in (0, 1, 7) for rnd in (0, 1, 2)}
    seeds |= {data.extra_seed(s, step, rank, k) for s in (0, 1) for step in (0, 1, 2) for rank in (0, 1, 7)
              for k in (0, 1, 2)}  # a script's own common.generate calls: never a training round's draws
    assert len(seeds) == 2 * 4 * 3 * 3 + 2 * 3 * 3 * 3 and all(0 <= x < 2**31 for x in seeds)
    assert data.rollout_seed(3, 5, 1) == data.rollout_seed(3, 5, 1, 0)  # first sampling round = the default


def test_config_file_unknown_key_is_named(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("learning_rate: 0.01\n")
    with pytest.raises(SystemExit, match=r"c.yaml: unknown option\(s\) \['learning_rate'\]"):
        common.parse_args(train_grpo.Args, ["--config", str(cfg)])


def test_interrupted_checkpoint_save_leaves_the_previous_one_intact(tmp_path, monkeypatch):
    path = str(tmp_path / "checkpoint.pt")
    ckpt.save_checkpoint(path, {"step": 1, "w": torch.ones(3)})
    real_save = torch.save

    def dying_save(obj, f, *a, **k):
        f.write(b"partial bytes")
        raise KeyboardInterrupt("killed mid-save")

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_checkpoint(path, {"step": 2, "w": torch.zeros(3)})
    monkeypatch.setattr(torch, "save", real_save)
    state = ckpt.load_checkpoint(path)
    assert state["step"] == 1 and torch.equal(state["w"], torch.ones(3))
    ckpt.save_checkpoint(path, {"step": 3})  # the next save replaces the stale temp file
    assert ckpt.load_checkpoint(path)["step"] == 3 and not os.path.exists(path + ".tmp")


def test_resume_without_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="no checkpoint at"):
        ckpt.load_checkpoint(str(tmp_path / "missing" / "checkpoint.pt"))


def test_each_launch_resumes_its_own_layout(tmp_path, monkeypatch):
    """A plain process reads checkpoint.pt (else an older one-process vLLM run's checkpoint/); torchrun reads
    checkpoint/, and refuses a plain process's checkpoint.pt in one line naming it."""
    ckpt.save_checkpoint(str(tmp_path / "checkpoint.pt"), {"step": 3})
    assert ckpt.load_resumed(str(tmp_path))["step"] == 3
    monkeypatch.setattr(ckpt.dist, "sharded", lambda: True)
    plain = r"checkpoint.pt was written by a plain process \(python train_\*.py\): resume it the same way"
    with pytest.raises(SystemExit, match=rf"^--resume: .*{plain}, not under torchrun$"):
        ckpt.load_resumed(str(tmp_path))


def test_building_the_tiny_model_leaves_the_callers_rng_alone(tmp_path):
    """A fresh cache used to reseed the global torch RNG (to 0), so a run's draws depended on whether the
    tiny model was already built."""
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    path = models.build_tiny_model(["1", "2", "+"], cache_dir=str(tmp_path))
    assert torch.equal(torch.rand(3), expected)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(path))


@pytest.mark.slow
def test_two_rank_torchrun_builds_the_tiny_model_on_every_node(tmp_path):
    """Under torchrun transformers saves a model on global rank 0 only. Each rank here has its own cache
    (as each node of a multi-node run has): when the tiny model was built after the process group
    started, rank 1 wrote a folder without weights into its cache and failed to load it."""
    import subprocess
    import sys
    per_rank_cache = 'RLMINI_CACHE="$0/rank$RANK" exec "$1" train_grpo.py "${@:2}"'
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                           "2", "--no-python",
                           "bash", "-c", per_rank_cache, str(tmp_path / "cache"), sys.executable,
                           "--engine", "hf", "--steps", "1", "--prompts_per_step", "4", "--group_size", "2",
                           "--out_dir", str(tmp_path), "--run_name", "fresh", "--wandb", "false"],
                          cwd=ROOT, env={**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for r in (0, 1):
        (built,) = os.listdir(tmp_path / "cache" / f"rank{r}" / "tiny")
        assert {"config.json",
                "model.safetensors"} <= set(os.listdir(tmp_path / "cache" / f"rank{r}" / "tiny" / built))
    assert [r["step"] for r in runlog.read_metrics(str(tmp_path / "fresh" / "metrics.jsonl"))] == [1]


def test_micro_batches_hold_a_token_budget():
    """--micro_batch_tokens: in order, at most max_seqs completions and max_tokens prompt+completion tokens
    per micro-batch; a completion longer than the budget goes alone; 0 keeps the sequence count only."""
    from rlmini import batches, data
    lengths = [3, 5, 2, 9, 1, 1, 1, 4]
    r = data.Rollouts([[1, 2]] * 8, [[7] * n for n in lengths], [[0.0] * n for n in lengths], [True] * 8, 0)
    batch = type("B", (), {"rollouts": r})()
    rows = list(range(8))
    assert batches.micro_rows(batch, rows, 64, 0) == [rows]
    assert batches.micro_rows(batch, rows, 3, 0) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    # tokens per row: 5 7 4 11 3 3 3 6
    assert batches.micro_rows(batch, rows, 64, 12) == [[0, 1], [2], [3], [4, 5, 6], [7]]
    assert batches.micro_rows(batch, rows, 2, 12) == [[0, 1], [2], [3], [4, 5], [6, 7]]
    assert batches.micro_rows(batch, [3, 0], 64, 10) == [[3], [0]]  # 11 > 10: alone
    assert batches.micro_rows(batch, [], 4, 10) == []


def test_the_engine_seed_stream_is_refused_under_torchrun(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit, match="--vllm_seed engine: one process only"):
        common.parse_args(train_grpo.Args, ["--vllm_seed", "engine"])
    common.parse_args(train_grpo.Args, [])  # the per-request default is fine


def test_step_stats_stay_on_the_device_until_one_copy_per_step(monkeypatch):
    """StepStats.add copies nothing to the host (each .item() is a host sync on CUDA; it made about ten per
    micro-batch); check_sampler's all_sum copies every sum in one .tolist(). The totals are, to the bit, the
    float64 sums of the values as .item() gives them, micro-batch by micro-batch."""
    from rlmini.batches import Micro
    g = torch.Generator().manual_seed(0)
    micros, expected = [], {}
    for epoch, rows in ((0, 3), (0, 2), (1, 3)):
        mask = (torch.rand(rows, 5, generator=g) > 0.3).float()
        layout = {"mask": mask}
        micro = Micro(list(range(rows)), epoch, layout, mask, torch.randn(rows, 5, generator=g), 17, 2)
        r = lambda: torch.rand(rows, 5, generator=g) + 0.5  # noqa: E731
        values = dict(loss=torch.randn((), generator=g), old=torch.randn(rows, 5, generator=g), entropy=r(),
                      info={"clipped": (r() > 1).float(), "ratio": r(), "kl": r()},
                      is_info={"w": r(), "changed": (r() > 1).float(), "kl": r()},
                      value_loss=torch.randn((), generator=g), value_clipped=(r() > 1).float() * mask)
        micros.append((micro, values))
        for name, x in (("tokens", mask.sum()), ("clip_frac", (values["info"]["clipped"] * mask).sum()),
                        ("loss/policy", values["loss"]), ("value/clip_frac", values["value_clipped"].sum())):
            expected[name] = expected.get(name, 0.0) + x.item()
        if epoch == 0:
            expected["entropy"] = expected.get("entropy", 0.0) + (values["entropy"] * mask).sum().item()
    stats, copies = common.StepStats(), []
    for method in ("item", "tolist", "__float__", "__int__", "__bool__", "cpu", "numpy"):
        real = getattr(torch.Tensor, method)
        monkeypatch.setattr(torch.Tensor, method, lambda self, *a, _m=method, _real=real, **k:
                            copies.append(_m) or _real(self, *a, **k))
    for micro, v in micros:
        stats.add(micro, v["loss"], v["old"], v["entropy"], v["info"], v["is_info"], v["value_loss"],
                  v["value_clipped"])
    assert copies == []
    totals = common.all_sum({**stats.sums, "tokens": stats.tokens})
    assert copies == ["tolist"]
    monkeypatch.undo()
    assert {k: totals[k] for k in expected} == expected  # bit for bit
    assert totals["perf/computed"] == 51 and totals["perf/padded"] == 6


def _batch(rollouts, rewards):
    """A Batch of these rollouts (scores as given), as common.rollout returns one."""
    from rlmini.batches import Batch
    n, rewards = len(rollouts.completion_ids), torch.tensor(rewards, dtype=torch.float32)
    return Batch([{}] * n, rollouts, rewards, rewards, rewards, (rewards,), 1, n, "correct", torch.ones(n))


def test_logprobs_of_a_model_are_its_plain_forward_aligned_with_the_sampler_with_and_without_tools(
        tiny_addition):
    """batches.batch_logprobs (common.logprobs): packed, micro-batched (3 of them, one cut by tokens), with
    the model's forward taken as a plain unpacked HF forward's; CPU fp32, one tensor per completion of
    exactly the sampler's tokens: with tools, a tool's output is context on both sides."""
    from transformers import AutoModelForCausalLM
    from rlmini import batches
    model, tok, path = tiny_addition
    packed = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert packing.enable_packing(packed)
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in ["3+4=", "12+9=", "7+7="]]
    r = engine.HFEngine(model, tok).generate(prompts, 3, 6, 0.8, 5)
    tool = copy.deepcopy(r)  # the same tokens, the second of each longer completion a tool's output
    tool.policy_mask = [[int(k != 1 or len(c) < 3) for k in range(len(c))] for c in r.completion_ids]
    assert any(0 in m for m in tool.policy_mask)
    for rollouts in (r, tool):
        batch = _batch(rollouts, [0.0] * 9)
        ours = batches.batch_logprobs(batch, packed, 0.8, 4, 24, torch.device("cpu"), torch.float32)
        assert len(batches.micro_rows(batch, list(range(9)), 4, 24)) >= 3
        masks = rollouts.policy_mask or [[1] * len(c) for c in rollouts.completion_ids]
        with torch.no_grad():
            plain = [_naive_logprobs(model, packing.make_batch([p], [c], 0, "cpu"), 0.8)[0, len(p) - 1:]
                     [torch.tensor(m, dtype=torch.bool)] for p, c, m in
                     zip(rollouts.prompt_ids, rollouts.completion_ids, masks)]
        assert [x.shape for x in ours] == [x.shape for x in plain] == [x.shape for x in batch.sampler_logp]
        assert all(x.device.type == "cpu" and x.dtype == torch.float32 and not x.requires_grad for x in ours)
        assert_grad_close(torch.cat(ours), torch.cat(plain), rel=1e-5)
        assert_grad_close(torch.cat(ours), torch.cat(batch.sampler_logp), rel=1e-5)  # the HF engine, fp32


def test_advantages_per_completion_or_per_token_reach_the_loss_and_the_metrics_alike():
    """Micro.advantages: a list per token -> [b, T-1], one per completion (this rank's or the global
    batch's) -> [b, 1]; advantage_metrics: hand-computed over completions, or over tokens."""
    from rlmini import batches, metrics
    r = data.Rollouts([[1, 2]] * 3, [[5, 6], [7], [5, 6, 7]], [[0.0] * 2, [0.0], [0.0] * 3], [True] * 3, 0)
    batch = _batch(r, [0.0, 1.0, 0.0])  # completions 0 and 2 failed (threshold 0.5)
    micro = batches.micro_batch(batch, [2, 0], None, "cpu")
    token = [torch.tensor([1.0, -2.0]), torch.tensor([0.5]), torch.tensor([-1.0, 3.0, 0.0])]
    seq = torch.tensor([1.0, -1.0, 0.5])
    assert micro.advantages(token).tolist() == [[0.0, -1.0, 3.0, 0.0], [0.0, 1.0, -2.0, 0.0]]  # [b, T-1]
    assert micro.advantages(seq).tolist() == [[0.5], [1.0]]
    with pytest.raises(ValueError, match="2 advantages for 3 completions per rank"):
        micro.advantages(seq[:2])
    out, local = metrics.advantage_metrics(token, batch, batch.rewards, 0.5)
    assert out == pytest.approx({"adv/mean": 1.5 / 6, "adv/abs_mean": 7.5 / 6, "adv/failed_pos_frac": 2 / 5})
    assert local.tolist() == pytest.approx([-0.5, 0.5, 2 / 3])
    out, local = metrics.advantage_metrics(seq, batch, batch.rewards, 0.5)
    assert out == pytest.approx({"adv/mean": 0.5 / 3, "adv/abs_mean": 2.5 / 3, "adv/failed_pos_frac": 1.0})
    assert torch.equal(local, seq)
    assert "adv/failed_pos_frac" not in metrics.advantage_metrics(token, batch, batch.rewards, -1.0)[0]
    assert "adv/failed_pos_frac" not in metrics.advantage_metrics(seq, batch, batch.rewards, -1.0)[0]
    means = metrics.global_means({"n": 2.5, "ragged": token, "t": seq, "pair": (3.0, 4), "no": None,
                                  "empty": [torch.zeros(0)], "none": (0.0, 0)})
    assert means == pytest.approx({"n": 2.5, "ragged": 0.25, "t": 0.5 / 3, "pair": 0.75})


def test_a_shared_option_the_script_does_not_apply_is_refused_when_set(tmp_path, capsys):
    """Args.not_applied: set on the command line or in --config, each such option is refused in one line
    naming it and the script; left at its default (--rollout_correction auto) it is not; --help hides it."""
    from dataclasses import dataclass
    from typing import ClassVar

    @dataclass
    class Args(train_rloo.Args):
        not_applied: ClassVar[tuple] = ("entropy_coef", "top_entropy_quantile", "rollout_correction")
    assert common.parse_args(Args, ["--beta", "0.1"]).rollout_correction == "auto"
    for argv in (["--entropy_coef", "0.01"], ["--top_entropy_quantile=0.2"], ["--rollout_correction", "off"]):
        name = argv[0][2:].split("=")[0]
        with pytest.raises(SystemExit, match=rf"^--{name}: test_common.py does not apply this shared option "
                                             rf"\(Args.not_applied: entropy_coef, top_entropy_quantile, "
                                             rf"rollout_correction\); it would do nothing: leave it unset$"):
            common.parse_args(Args, argv)
    (tmp_path / "c.yaml").write_text("entropy_coef: 0.01\n")
    with pytest.raises(SystemExit, match="^--entropy_coef: test_common.py does not apply"):
        common.parse_args(Args, ["--config", str(tmp_path / "c.yaml")])
    common.parse_args(train_rloo.Args, ["--entropy_coef", "0.01"])  # RLOO applies it
    with pytest.raises(SystemExit):
        common.parse_args(Args, ["--help"])
    shown = capsys.readouterr().out
    assert "--beta" in shown and "--is_cap" in shown and "--entropy_coef" not in shown
