"""GRPO's advantage and loss against hand-computed values and the textbook policy gradient."""
import math
from types import SimpleNamespace

import pytest
import torch

import common
import train_grpo as grpo


def loss_args(**kw):
    base = dict(clip_eps=0.2, clip_eps_high=0.0, ratio_level="token", beta=0.0)
    return SimpleNamespace(**{**base, **kw})


def test_advantages_hand_computed():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0])
    # group 1: mean .5, unbiased std sqrt(1/3); group 2: mean .25, unbiased std .5
    a = grpo.compute_advantages(r, 4, std_norm=True, eps=0.0)
    s3 = math.sqrt(3) / 2  # 0.5 / sqrt(1/3)
    assert torch.allclose(a, torch.tensor([s3, -s3, -s3, s3, -0.5, -0.5, -0.5, 1.5]), atol=1e-6)
    a = grpo.compute_advantages(r, 4, std_norm=False)  # Dr. GRPO
    assert torch.allclose(a, torch.tensor([0.5, -0.5, -0.5, 0.5, -0.25, -0.25, -0.25, 0.75]))


def test_advantages_degenerate_group_is_zero_not_nan():
    a = grpo.compute_advantages(torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0]), 3, std_norm=True, eps=1e-6)
    assert torch.equal(a, torch.zeros(6))


def test_advantages_eps_is_added_to_std():
    r = torch.tensor([0.0, 2.0])  # unbiased std sqrt(2)
    a = grpo.compute_advantages(r, 2, std_norm=True, eps=0.5)
    assert torch.allclose(a, torch.tensor([-1.0, 1.0]) / (math.sqrt(2) + 0.5))


TOKEN_LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])


@pytest.mark.parametrize("mode,expected", [
    ("seq-mean-token-mean", (2.0 + 4.0) / 2),       # mean over tokens, then over sequences
    ("token-mean", (1 + 2 + 3 + 4) / 4),            # over all tokens
    ("seq-mean-token-sum-norm", (1 + 2 + 3 + 4) / (2 * 5)),  # / (G * L_max), L_max = 5
])
def test_aggregation_hand_computed(mode, expected):
    got = grpo.aggregate(TOKEN_LOSS, MASK, mode, n_seqs=2, n_tokens=4, max_len=5)
    assert got.item() == pytest.approx(expected)


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"])
def test_aggregation_invariant_to_micro_batching(mode):
    torch.manual_seed(0)
    loss = torch.randn(6, 5)
    mask = (torch.rand(6, 5) > 0.3).float()
    mask[:, 0] = 1
    n_tok = mask.sum().item()
    whole = grpo.aggregate(loss, mask, mode, 6, n_tok, 5)
    parts = sum(grpo.aggregate(loss[i:i + 2], mask[i:i + 2], mode, 6, n_tok, 5) for i in range(0, 6, 2))
    assert parts.item() == pytest.approx(whole.item(), rel=1e-6)


def test_bad_aggregation_mode_names_flag():
    with pytest.raises(ValueError, match="--loss_agg"):
        grpo.aggregate(TOKEN_LOSS, MASK, "sum", 2, 4, 5)


def _batch_and_logp(model, tok, completions):
    prompts = [tok("3+4=", add_special_tokens=False)["input_ids"]] * len(completions)
    comps = [tok(c, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for c in completions]
    batch = common.make_batch(prompts, comps, tok.pad_token_id, torch.device("cpu"))
    logp, _ = common.token_logprobs(model, batch, 1.0)
    return batch, logp


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "token-mean"])
def test_on_policy_gradient_is_the_policy_gradient_estimator(tiny_addition, mode):
    """One on-policy update: ratio == 1 exactly, and the clipped-surrogate gradient equals
    -sum_i A_i w_i sum_t grad log pi(o_it) with the aggregation's weights w_i."""
    model, tok, _ = tiny_addition
    adv = torch.tensor([1.5, -0.5, -1.0])
    batch, logp = _batch_and_logp(model, tok, ["7", "12", "5"])
    mask = batch["mask"]
    token_loss, stats = grpo.policy_loss(logp, logp.detach(), None, adv, mask, loss_args())
    assert torch.equal(stats["ratio"][mask > 0], torch.ones(int(mask.sum())))
    assert stats["clipped"].sum() == 0
    loss = grpo.aggregate(token_loss, mask, mode, 3, mask.sum().item(), 4)
    g_ours = torch.autograd.grad(loss, list(model.parameters()))

    _, logp2 = _batch_and_logp(model, tok, ["7", "12", "5"])
    lengths = mask.sum(1)
    w = 1 / (3 * lengths) if mode == "seq-mean-token-mean" else torch.full((3,), 1 / lengths.sum().item())
    textbook = -(adv * w * (logp2 * mask).sum(1)).sum()
    g_ref = torch.autograd.grad(textbook, list(model.parameters()))
    for a, b in zip(g_ours, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_clipping_zeroes_gradient_outside_the_trust_region():
    logp = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5]])).requires_grad_()
    old = torch.log(torch.tensor([[0.25, 0.25, 0.6, 0.6]]))  # ratios 2, 2, 0.833, 0.833
    mask = torch.ones(1, 4)
    for adv, clipped in [(1.0, [1, 1, 0, 0]), (-1.0, [0, 0, 0, 0])]:
        token_loss, stats = grpo.policy_loss(logp, old, None, torch.tensor([adv]), mask, loss_args())
        assert stats["clipped"][0].tolist() == clipped
        (g,) = torch.autograd.grad(token_loss.sum(), logp)
        for t in range(4):  # d(-ratio*A)/dlogp = -ratio*A where not clipped
            ratio = (0.5 / old[0, t].exp()).item()
            expected = 0.0 if clipped[t] else -ratio * adv
            assert g[0, t].item() == pytest.approx(expected, rel=1e-5, abs=1e-7)
    # clip-higher (DAPO): eps_high 1.5 lets a ratio of 2 through for A > 0
    token_loss, stats = grpo.policy_loss(logp, old, None, torch.tensor([1.0]), mask, loss_args(clip_eps_high=1.5))
    assert stats["clipped"].sum() == 0
    # the clipped value itself: ratio 2, A = 1 -> -(1 + 0.2)
    token_loss, _ = grpo.policy_loss(logp, old, None, torch.tensor([1.0]), mask, loss_args())
    assert token_loss[0, 0].item() == pytest.approx(-1.2)


def test_gspo_sequence_ratio_is_exp_of_mean_token_log_ratio():
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, 0.0, 0.0]])
    old = torch.tensor([[-1.5, -2.0, -2.9], [-1.2, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    _, stats = grpo.policy_loss(logp, old, None, torch.zeros(2), mask, loss_args(ratio_level="sequence"))
    s0 = math.exp((0.5 + 0.0 - 0.1) / 3)
    s1 = math.exp(0.2)
    assert stats["ratio"][0].tolist() == pytest.approx([s0] * 3)
    assert stats["ratio"][1, 0].item() == pytest.approx(s1)


def test_k3_kl_value_and_zero_at_reference():
    logp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -2.0]])
    token_loss, stats = grpo.policy_loss(logp, logp, ref, torch.zeros(1), torch.ones(1, 2), loss_args(beta=0.1))
    d = -0.5
    assert stats["kl"][0, 0].item() == pytest.approx(math.exp(d) - d - 1)
    assert stats["kl"][0, 1].item() == 0.0
    assert token_loss[0, 0].item() == pytest.approx(0.1 * (math.exp(d) - d - 1))
