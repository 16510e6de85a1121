"""Issue 13's exact speed-ups against the plain computation they replace: the packed micro-batch (no
padding, each prompt computed once for its completions) against right-padded rows, on log-probs, entropies,
values and gradients, for several group sizes, prompt lengths, architectures (GQA, sliding window, Llama),
LoRA and activation checkpointing; and the HF engine's sampling loop (one prefill per prompt, finished
sequences leaving the batch) against a naive sampler that recomputes every sequence from scratch."""
import copy
import math

import pytest
import torch
from transformers import (
    AutoModelForTokenClassification,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import common
import train_grpo
import train_ppo
from conftest import assert_grad_close
from rlmini import engine, logprobs, models, packing, runlog
from rollout_double import record_first_step

V = 40


def qwen3(**kw):
    config = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=128, pad_token_id=0,
                  eos_token_id=1)
    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(**{**config, **kw})).float()


def llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=1,
                                        max_position_embeddings=128,
                                        pad_token_id=0, eos_token_id=1)).float()


def pair(model):
    """(packed, padded): two copies with the same weights, the first routed through packed_attention."""
    padded = copy.deepcopy(model)
    assert packing.enable_packing(model) and packing.packing_enabled(model)
    assert not packing.packing_enabled(padded)
    return model, padded


def micro_batch(n_prompts, group_size, prompt_len, seed=0, shuffle=True, min_len=1, max_len=12):
    """Prompts of about `prompt_len` tokens, `group_size` ragged completions each, interleaved across groups.
    """
    g = torch.Generator().manual_seed(seed)
    prompts, completions = [], []
    for u in range(n_prompts):
        p = torch.randint(2, V, (max(1, prompt_len - u % 3),), generator=g).tolist()
        for _ in range(group_size):
            length = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
            completions.append(torch.randint(2, V, (length,), generator=g).tolist())
            prompts.append(p)
    order = torch.randperm(len(prompts), generator=g).tolist() if shuffle else range(len(prompts))
    return [prompts[i] for i in order], [completions[i] for i in order]


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def compare(packed, padded, prompts, completions, temperature=0.7, gradients=True):
    batch = packing.make_batch(prompts, completions, 0, torch.device("cpu"))
    weights = torch.randn(batch["mask"].shape, generator=torch.Generator().manual_seed(1))
    out = []
    for model in (packed, padded):
        model.zero_grad(set_to_none=True)
        logp, entropy = logprobs.token_logprobs(model, batch, temperature, with_entropy=True)
        if gradients:
            ((logp * weights).sum() + entropy.sum()).backward()
        out.append((logp.detach(), entropy.detach(), grads(model)))
    (lp1, e1, g1), (lp2, e2, g2) = out
    torch.testing.assert_close(lp1, lp2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(e1, e2, rtol=1e-5, atol=1e-5)
    assert g1.keys() == g2.keys() and (g1 or not gradients)
    total = sum(g.double().norm() ** 2 for g in g2.values()) ** 0.5 if g2 else 0.0
    for name in g1:  # a layer whose gradient is zero but for rounding is compared at the model's scale
        assert_grad_close(g1[name], g2[name], rel=1e-5, name=name, floor=float(total))
    return batch


# ---------------------------------------------------------------------------------------------- the layout


def test_make_batch_layouts_by_hand():
    prompts, completions = [[3, 4], [6], [3, 4]], [[8, 9, 1], [10, 1, 2, 5], [7]]
    b = packing.make_batch(prompts, completions, 0, torch.device("cpu"))
    assert b["input_ids"].tolist() == [[3, 4, 8, 9, 1], [6, 10, 1, 2, 5], [3, 4, 7, 0, 0]]
    assert b["attention_mask"].tolist() == [[1] * 5, [1] * 5, [1, 1, 1, 0, 0]]
    assert b["mask"].tolist() == [[0, 1, 1, 1], [1, 1, 1, 1], [0, 1, 0, 0]]
    assert b["targets"].tolist() == [8, 9, 1, 10, 1, 2, 5, 7]
    p = b["packed"]
    # the prompt [3, 4] once, then every completion; positions continue each completion's own prompt
    assert p["input_ids"].tolist() == [[3, 4, 6, 8, 9, 1, 10, 1, 2, 5, 7]]
    assert p["position_ids"].tolist() == [[0, 1, 0, 2, 3, 4, 1, 2, 3, 4, 2]]
    # each completion token is predicted by the token before it: its prompt's last token for the first one
    assert p["pred"].tolist() == [1, 3, 4, 2, 6, 7, 8, 1]
    assert p["computed"] == 11 and packing.padded_tokens(b, torch.nn.Module()) == (15, 2)
    # attention rows of the completions: keys = their prompt, then themselves up to the query
    q_idx, q_valid, k_idx, allowed, _, _ = p["rows"][1]
    assert q_idx[1].tolist() == [6, 7, 8, 9] and k_idx[1].tolist()[:1] == [2]
    assert allowed[1, 0].tolist() == [True, False, True, False, False, False]  # [6 | pad slot | 10 1 2 5]


def test_group_permutation_keeps_groups_whole():
    perm = common.group_permutation(12, 3, torch.Generator().manual_seed(0))
    assert sorted(perm.tolist()) == list(range(12))
    assert all(perm[i + 1] - perm[i] == 1 and perm[i] % 3 == 0 for i in range(0, 12, 3))
    assert perm.tolist() != list(range(12))
    assert common.group_permutation(5, 1, torch.Generator().manual_seed(0)).tolist() == \
        torch.randperm(5, generator=torch.Generator().manual_seed(0)).tolist()


# ---------------------------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("group_size,prompt_len,max_len", [(1, 1, 12), (3, 5, 12), (8, 17, 12), (4, 9, 70)])
def test_packed_equals_padded_logprobs_entropy_and_gradients(group_size, prompt_len, max_len):
    packed, padded = pair(qwen3())
    prompts, completions = micro_batch(4, group_size, prompt_len, seed=group_size, max_len=max_len)
    batch = compare(packed, padded, prompts, completions)
    if max_len > 64:  # completions of 1 to 70 tokens: several length classes, each its own attention rows
        # <= 16, 17-32, 33-64, 65-128 tokens
        classes = {max(4, math.ceil(math.log2(len(c)))) for c in completions}
        assert len(classes) >= 3 and len(batch["packed"]["rows"]) == 1 + len(classes)
    n_prompt_tokens = sum(len(p) for p in {tuple(p) for p in prompts})
    # no padding, prompts once
    assert batch["packed"]["computed"] == n_prompt_tokens + sum(map(len, completions))


def test_packed_equals_padded_with_checkpointing_lora_and_other_architectures():
    prompts, completions = micro_batch(3, 4, 6, seed=7)
    compare(*pair(llama()), prompts, completions)  # grouped-query attention with one key/value head
    compare(*pair(qwen3(use_sliding_window=True, sliding_window=4, max_window_layers=0,
                        layer_types=["sliding_attention", "full_attention"])), prompts, completions)
    packed, padded = pair(qwen3())
    for m in (packed, padded):
        common.prepare_for_training(m, gradient_checkpointing=True, packing=False)
    compare(packed, padded, prompts, completions)
    args = common.parse_args(common.Args, ["--lora_rank", "4"])
    packed, padded = pair(qwen3())
    packed, padded = common.add_lora(packed, args), common.add_lora(padded, args)
    torch.manual_seed(3)
    for a, b in zip(packed.parameters(), padded.parameters()):  # B != 0, so the adapters matter
        with torch.no_grad():
            a.copy_(a + 0.1 * torch.randn_like(a) if a.requires_grad else a)
            b.copy_(a)
    compare(packed, padded, prompts, completions)
    compare(models.AdaptersOff(packed), models.AdaptersOff(padded), prompts, completions, gradients=False)


def test_packed_handles_an_empty_completion_and_a_lone_sequence():
    packed, padded = pair(qwen3())
    compare(packed, padded, [[5, 6, 7], [5, 6, 7], [9]], [[4, 4], [], [8, 1]])
    compare(packed, padded, [[5]], [[3]])


def test_index_rows_is_indexing_with_a_fixed_order_backward():
    """index_rows(x, i) == x[i]; its gradient sums each repeated row's gradients (by hand, in float64), and is
    bitwise the same on every call: on CPU with several threads, x[i]'s backward adds repeated rows with
    atomics, a different float sum almost every time on this input (measured: 300 distinct gradients in 300
    calls)."""
    torch.manual_seed(0)
    x = torch.randn(50, 2, 64, requires_grad=True)
    index = torch.randint(0, 10, (256, 8))  # rows 0-9 read ~200 times each, by both threads' halves
    up = torch.randn(256, 8, 2, 64)
    assert torch.equal(packing.index_rows(x, index), x[index])
    seen = set()
    for _ in range(20):
        x.grad = None
        (packing.index_rows(x, index) * up).sum().backward()
        seen.add(x.grad.numpy().tobytes())
    assert len(seen) == 1
    by_hand = torch.zeros(50, 2, 64, dtype=torch.float64)
    for i, r in enumerate(index.flatten().tolist()):
        by_hand[r] += up.view(-1, 2, 64)[i].double()
    torch.testing.assert_close(x.grad.double(), by_hand, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="the race needs two threads")
def test_packed_gradients_are_bitwise_repeatable_with_threads():
    """A prompt's keys, values and last hidden state are read by each of its G completions: their gradients
    are sums over the group, which must come out the same on every run (exact resume, seed comparisons).
    Groups interleaved, so both threads of a backward add into the same prompt rows; with x[i] in place of
    index_rows every one of 20 backward passes gave other gradients."""
    model = qwen3()
    assert packing.enable_packing(model)
    batch = packing.make_batch(*micro_batch(32, 8, 9, seed=1), 0, torch.device("cpu"))
    seen = set()
    for _ in range(10):
        model.zero_grad()
        logp, entropy = logprobs.token_logprobs(model, batch, 0.7, with_entropy=True)
        (logp.sum() + entropy.sum()).backward()
        seen.add(b"".join(p.grad.numpy().tobytes() for p in model.parameters()))
    assert len(seen) == 1


def test_ppo_critic_values_packed_equal_padded():
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, num_labels=1, pad_token_id=0)
    packed = AutoModelForTokenClassification.from_config(config).float()
    padded = copy.deepcopy(packed)
    common.prepare_for_training(packed, False, packing=True)
    common.prepare_for_training(padded, False, packing=False)
    batch = packing.make_batch(*micro_batch(3, 4, 5, seed=2), 0, torch.device("cpu"))
    v1, v2 = train_ppo.critic_values(packed, batch), train_ppo.critic_values(padded, batch)
    torch.testing.assert_close(v1, v2, rtol=1e-5, atol=1e-6)
    assert (v1[batch["mask"] == 0] == 0).all() and (v1[batch["mask"] > 0] != 0).all()
    (v1 ** 2).sum().backward(), (v2 ** 2).sum().backward()
    for name, g in grads(packed).items():
        assert_grad_close(g, grads(padded)[name], rel=1e-5, name=name)


def test_a_training_step_is_the_same_packed_or_padded(tmp_path, monkeypatch):
    """The first GRPO step's gradients (one micro-batch of 12 completions across 3 groups, two of them split)
    and its logged metrics do not depend on --packing; perf/pad_frac is 0 packed and the padding share padded.
    """
    runs = {}
    for packed in ("true", "false"):
        with monkeypatch.context() as m:
            runs[packed] = record_first_step(m, train_grpo, [
                "--out_dir", str(tmp_path / packed), "--prompts_per_step", "4", "--group_size", "4",
                "--micro_batch_size", "6", "--packing", packed])
    (run1, batches1, grads1, _), (_, batches2, grads2, _) = runs["true"], runs["false"]
    assert batches1[0].completion_ids == batches2[0].completion_ids
    for a, b in zip(grads1[0], grads2[0]):
        assert_grad_close(a, b, rel=1e-5)
    m1, m2 = (runlog.read_metrics(str(tmp_path / p / run1.args.run_name / "metrics.jsonl"))[0] for p in runs)
    for key in ("loss/policy", "grad_norm", "entropy", "logprob/sampler_diff", "kl/old"):
        assert m1[key] == pytest.approx(m2[key], rel=1e-4, abs=1e-6), key
    r = batches1[0]
    computed = sum(len(p) for p in {tuple(p) for p in r.prompt_ids}) + sum(map(len, r.completion_ids))
    real = sum(len(p) + len(c) for p, c in zip(r.prompt_ids, r.completion_ids))
    assert m1["perf/pad_frac"] == 0.0 and computed < real
    assert 0 < m2["perf/pad_frac"] < 1


# ---------------------------------------------------------------------------------------------- HF sampling


def naive_sample(model, prompt_ids, n, max_new_tokens, temperature, seed, eos):
    """Reference sampler: every step recomputes each running sequence from its tokens (no cache, no padding),
    samples the running ones together in the engine's order with its sampler (engine.sample_rows, tested
    against the softmax in test_common.py), and drops those that produced EOS."""
    gen = torch.Generator().manual_seed(seed)
    seqs = [list(p) for p in prompt_ids for _ in range(n)]
    done, out, lps = [False] * len(seqs), [[] for _ in seqs], [[] for _ in seqs]
    with torch.no_grad():
        for _ in range(max_new_tokens):
            running = [i for i in range(len(seqs)) if not done[i]]
            if not running:
                break
            logits = torch.stack([model(input_ids=torch.tensor([seqs[i]])).logits[0, -1] for i in running])
            logp = torch.log_softmax(logits.float() / temperature, -1)
            tok, _ = engine.sample_rows(logits, temperature, gen)
            for j, i in enumerate(running):
                seqs[i].append(int(tok[j]))
                out[i].append(int(tok[j]))
                lps[i].append(float(logp[j, tok[j]]))
                done[i] = int(tok[j]) == eos
    return out, lps


def test_hf_sampling_loop_equals_a_naive_sampler():
    model = qwen3().eval()
    with torch.no_grad():  # make EOS likely enough that sequences end at different steps
        model.lm_head.weight[1] += 0.5 * model.model.embed_tokens.weight.std()
        model.model.norm.weight.fill_(3.0)
    sampler = engine.HFEngine(model, type("Tokenizer", (), {"eos_token_id": 1, "pad_token_id": 0})())
    prompts = [[5, 6, 7, 8], [9], [10, 11]]
    calls = []
    model.register_forward_pre_hook(lambda m, a, k: calls.append(k["input_ids"].shape), with_kwargs=True)
    r = sampler.generate(prompts, 4, 10, 0.8, 123)
    assert calls[0] == (3, 4)  # one prefill per prompt (left-padded), not one per sample
    # then one token per step; finished rows leave
    assert all(s[1] == 1 for s in calls[1:]) and calls[-1][0] < 12
    ref_tokens, ref_logps = naive_sample(model, prompts, 4, 10, 0.8, 123, eos=1)
    assert r.completion_ids == ref_tokens
    for a, b in zip(r.sampler_logprobs, ref_logps):
        assert a == pytest.approx(b, abs=1e-5)
    assert r.prompt_ids == [p for p in prompts for _ in range(4)]
    assert r.finished == [bool(c) and c[-1] == 1 for c in r.completion_ids]
    lengths = {len(c) for c in r.completion_ids}
    assert len(lengths) > 2 and max(lengths) == 10 and not all(r.finished) and any(r.finished)
    again = sampler.generate(prompts, 4, 10, 0.8, 123)
    assert again.completion_ids == r.completion_ids  # the seed fixes every sample


def test_hf_sampling_draws_from_the_tempered_policy():
    """First-token frequencies over 4,000 samples match softmax(logits / T): total variation below 0.05,
    while a sampler at T = 1 instead of 0.5 would be more than 0.1 away."""
    model = qwen3().eval()
    with torch.no_grad():
        model.model.norm.weight.fill_(4.0)  # a peaked but not degenerate next-token distribution
        probs = torch.softmax(model(input_ids=torch.tensor([[3, 4]])).logits[0, -1] / 0.5, -1)
    sampler = engine.HFEngine(model, type("Tokenizer", (), {"eos_token_id": 1, "pad_token_id": 0})())
    r = sampler.generate([[3, 4]], 4000, 1, 0.5, 0)
    freq = torch.bincount(torch.tensor([c[0] for c in r.completion_ids]), minlength=V).float() / 4000
    assert 0.5 * (freq - probs).abs().sum() < 0.05
    tempered_wrong = torch.softmax(torch.log(probs) * 0.5, -1)  # what T = 1 would sample
    assert 0.5 * (tempered_wrong - probs).abs().sum() > 0.1


def test_masked_grouped_attention_on_cpu_shares_the_kv_heads_and_equals_transformers(monkeypatch):
    """Generation's masked attention (left padding) with fewer key than query heads: transformers' sdpa copies
    the KV cache once per query head of a group (repeat_kv); the packed wrapper's CPU path gives sdpa the
    mask and enable_gqa instead, with transformers' values (a decoding step and a prefill, float and bool
    masks), and a model's cached sampling gives the same tokens and log-probs as before, repeat_kv unused."""
    from transformers.integrations import sdpa_attention
    attend = packing.packed_attention(sdpa_attention.sdpa_attention_forward)
    module = type("Layer", (), {"num_key_value_groups": 3, "is_causal": True})()
    g = torch.Generator().manual_seed(0)
    for q_len, kv_len in ((1, 37), (5, 5)):
        q, k, v = (torch.randn(4, h, n, 16, generator=g) for h, n in ((6, q_len), (2, kv_len), (2, kv_len)))
        allowed = torch.ones(4, 1, q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)
        allowed[1, ..., :3] = False  # a left-padded row
        for mask in (allowed, torch.zeros(allowed.shape).masked_fill(~allowed, -1e9)):
            want, _ = sdpa_attention.sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)
            got, _ = attend(module, q, k, v, mask, scaling=0.25)
            assert got.shape == want.shape == (4, q_len, 6, 16) and got.is_contiguous()
            torch.testing.assert_close(got, want, atol=1e-6 * float(want.abs().max()), rtol=0)
    model = qwen3().eval()  # 4 query heads on 2 KV heads
    sampler = engine.HFEngine(model, type("Tokenizer", (), {"eos_token_id": 1, "pad_token_id": 0})())
    before = sampler.generate([[5, 6, 7, 8], [9]], 3, 6, 1.0, 7)
    assert packing.enable_packing(model)

    def copied(*a):
        raise AssertionError("repeat_kv called")
    monkeypatch.setattr(sdpa_attention, "repeat_kv", copied)
    after = sampler.generate([[5, 6, 7, 8], [9]], 3, 6, 1.0, 7)
    assert after.completion_ids == before.completion_ids
    for a, b in zip(after.sampler_logprobs, before.sampler_logprobs):
        assert a == pytest.approx(b, abs=1e-5)


def test_a_model_whose_packed_forward_differs_keeps_padded_rows(monkeypatch, capsys):
    """enable_packing compares packed and padded forwards on a small batch first; a model that computes
    something the packed rows do not (soft-capping, sinks, ...; here a packed attention made wrong on purpose)
    trains on padded rows, with a note."""
    from transformers import AttentionInterface
    packing.enable_packing(qwen3())  # registers packed_sdpa
    good = AttentionInterface._global_mapping["packed_sdpa"]

    def broken(*args, packed_rows=None, **kw):  # as if the model's attention did something the rows ignore
        out, weights = good(*args, packed_rows=packed_rows, **kw)
        return (out + 0.1 if packed_rows is not None else out), weights
    monkeypatch.setitem(AttentionInterface._global_mapping, "packed_sdpa", broken)
    model = qwen3()
    assert not packing.enable_packing(model) and model.config._attn_implementation == "sdpa"
    assert "--packing is off for this model (Qwen3ForCausalLM)" in capsys.readouterr().err


def _dense_from_rows(prompts, completions, window=None):
    """[N, N] allowed (query, key) pairs of the packed sequence from the row-set layout (tested above against
    padded attention), with a sliding window applied as packed_attention applies it."""
    p = packing.make_batch(prompts, completions, 0, torch.device("cpu"), kernel="rows")["packed"]
    n = p["computed"]
    dense = torch.zeros(n, n, dtype=torch.long)
    for q_idx, q_valid, k_idx, allowed, q_pos, k_pos in p["rows"]:
        if window is not None:
            allowed = allowed & (q_pos[:, :, None] - k_pos[:, None, :] < window)
        for r in range(len(q_idx)):  # padding key slots index token 0: counted, so they cannot erase it
            rows, keys = torch.broadcast_tensors(q_idx[r][q_valid[r]][:, None], k_idx[r][None, :])
            dense.index_put_((rows, keys), allowed[r][q_valid[r]].long(), accumulate=True)
    return dense > 0


@pytest.mark.parametrize("seed,window", [(0, None), (1, None), (2, 3), (3, 100), (4, None)])
def test_flex_block_mask_is_the_packed_attention_pattern(seed, window):
    """FlexLayout's spans and block mask, built without an [N, N] tensor, against the row sets: the same
    allowed pairs; every allowed pair inside a computed block; a block marked full is allowed throughout; no
    computed block is empty. Layouts of 1-6 blocks of 128 (a short last block), windows shorter and longer
    than the sequences."""
    from torch.nn.attention.flex_attention import _DEFAULT_SPARSE_BLOCK_SIZE as B
    prompts, completions = micro_batch(1 + seed, 3, 20 + 30 * seed, seed=seed, max_len=40 + 60 * seed)
    reference = _dense_from_rows(prompts, completions, window)
    layout = packing.make_batch(prompts, completions, 0, torch.device("cpu"), kernel="flex")["packed"]["rows"]
    n = layout.n
    a1, b1, a2, b2 = layout.windowed(window)
    kv = torch.arange(n)
    spans = ((a1[:, None] <= kv) & (kv < b1[:, None])) | ((a2[:, None] <= kv) & (kv < b2[:, None]))
    assert torch.equal(spans, reference)
    mask = layout.block_mask(window)
    nb = (n + B - 1) // B
    blocks = torch.zeros(nb, nb, dtype=torch.long)  # 0 skipped, 1 partial (masked), 2 full
    for table, kind in (((mask.kv_num_blocks, mask.kv_indices), 1),
                        ((mask.full_kv_num_blocks, mask.full_kv_indices), 2)):
        for qb in range(nb):
            blocks[qb, table[1][0, 0, qb, :table[0][0, 0, qb]].long()] = kind
    padded = torch.zeros(nb * B, nb * B, dtype=torch.bool)
    padded[:n, :n] = reference
    per_block = padded.view(nb, B, nb, B).transpose(1, 2)  # [qb, kb, B, B]
    valid = torch.zeros(nb * B, nb * B, dtype=torch.bool)
    valid[:n, :n] = True
    valid = valid.view(nb, B, nb, B).transpose(1, 2)
    some, every = per_block.any((2, 3)), (per_block | ~valid).all((2, 3))
    assert torch.equal(blocks > 0, some)  # computed exactly where something is allowed
    assert torch.equal(blocks == 2, some & every)  # full exactly where everything is


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "sliding", "softcap"])
def test_flex_attention_equals_the_row_sets(arch):
    """Eager FlexAttention on CPU (CUDA compiles the same call) against the row-set path: log-probs with GQA
    (Llama 4 heads / 1 KV head), a sliding window (Qwen3, 5 tokens) and Gemma 2's attention soft cap with
    scores past the cap. Forward only: torch has no FlexAttention backward on CPU; on CUDA the backward is
    torch's own, of the same mask and score_mod."""
    import test_architectures as archs
    if arch == "llama":
        model = llama()
    elif arch == "sliding":
        model = qwen3(use_sliding_window=True, sliding_window=5, max_window_layers=0)
    else:
        model = archs.build("gemma2-softcap")
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.data *= 30
    models.prepare_for_training(model, gradient_checkpointing=False, packing=True)
    prompts, completions = micro_batch(3, 3, 60, seed=5, max_len=150)
    out = {}
    with torch.no_grad():
        for kernel in ("rows", "flex"):
            batch = packing.make_batch(prompts, completions, 0, torch.device("cpu"), kernel=kernel)
            out[kernel] = logprobs.token_logprobs(model, batch, 0.7)[0]
    assert (out["rows"] - out["flex"]).abs().max() <= 1e-5


def test_flex_layout_is_linear_in_tokens():
    """An 8k-token completion: the layout's spans and the block mask are O(tokens) (largest tensor <= 4 N
    entries; the block table, (N / 128)^2, stays under N up to 16k tokens), where the row sets hold
    [rows, Lq, Lk] masks."""
    prompts, completions = [[5] * 512, [5] * 512], [[6] * 8192, [7] * 8000]
    layout = packing.make_batch(prompts, completions, 0, torch.device("cpu"), kernel="flex")["packed"]["rows"]
    n = layout.n
    mask = layout.block_mask(None)
    tensors = [layout.spans, layout.pos, layout.offset, mask.kv_num_blocks, mask.kv_indices,
               mask.full_kv_num_blocks, mask.full_kv_indices, mask.q_num_blocks, mask.q_indices]
    assert n == 512 + 8192 + 8000
    assert max(t.numel() for t in tensors) <= 4 * n
    assert mask.kv_indices.numel() == ((n + 127) // 128) ** 2 < 1.1 * n  # N^2 / 128^2
    # the row sets for the same batch: one row of 8192 queries over 512 + 8192 keys
    assert 8192 * (512 + 8192) > 4000 * n


@pytest.mark.slow
def test_flex_compiles_few_known_variants_and_stops_past_the_limit(monkeypatch):
    """The compiled FlexAttention of the CUDA path, counted on CPU with a counting (non-inductor) backend over
    what a training step runs: the policy (fp32 weights under bf16 autocast: its q and k leave the rotary
    embedding in fp32, v in bf16) with and without gradients, the reference in bf16, micro-batches of one
    block of 128 tokens and of several, of varying lengths. q and k cast to v's dtype: 4 variants (grad or
    not, one block or more), under torch's recompile_limit of 8; uncast, 6. Past the limit the run stops in
    one line instead of running eager flex (N x N scores). Gemma 2's soft cap traces with gradients."""
    import torch.nn.attention.flex_attention as flex
    from torch._dynamo.testing import CompileCounter
    monkeypatch.setattr(flex, "_validate_device", lambda *a: None)  # CPU refuses grad inputs before tracing
    policy = qwen3()
    models.prepare_for_training(policy, gradient_checkpointing=False, packing=True)
    reference = copy.deepcopy(policy).to(torch.bfloat16).requires_grad_(False)
    cpu = torch.device("cpu")
    lengths = [(2, 3, 10, 12), (2, 3, 40, 60), (1, 2, 5, 3), (2, 2, 70, 90)]  # 53, 251, 8, 296 tokens
    batches = [packing.make_batch(*micro_batch(n, g, p, seed=i, max_len=m), 0, cpu, kernel="flex")
               for i, (n, g, p, m) in enumerate(lengths)]
    assert [b["packed"]["computed"] <= 128 for b in batches] == [True, False, True, False]

    def step(batch):
        with models.autocast(cpu, torch.bfloat16):
            with torch.no_grad():
                logprobs.token_logprobs(policy, batch, 0.7)
                logprobs.token_logprobs(reference, batch, 0.7)
            logprobs.token_logprobs(policy, batch, 0.7, with_entropy=True)
    torch._dynamo.reset()
    try:
        counter = CompileCounter()
        monkeypatch.setitem(packing._FLEX, "backend", counter)
        for batch in batches:
            step(batch)
        assert counter.frame_count == 4
        torch._dynamo.reset()
        monkeypatch.setitem(packing._FLEX, "backend", CompileCounter())
        # config.patch restores the field itself (a monkeypatched config module hides it from later readers)
        with torch._dynamo.config.patch(recompile_limit=3), pytest.raises(
                RuntimeError, match=r"recompile_limit = 3 compiled variants \(this call: grad, "
                                    r"q/k/v bfloat16/bfloat16/bfloat16, 251 tokens\).*rows"):
            for batch in batches:
                step(batch)
        torch._dynamo.reset()
        layout = batches[1]["packed"]["rows"]
        q, k, v = (torch.randn(1, h, layout.n, 8, requires_grad=True) for h in (4, 2, 2))
        packing._flex_attention(q, k, v, layout.block_mask(), 0.25, 0.02)  # a float cap failed to trace
    finally:
        torch._dynamo.reset()
