"""GRPO's advantage and loss against hand-computed values and the textbook policy gradient."""
import math
from types import SimpleNamespace

import pytest
import torch

import common
import train_grpo as grpo
from conftest import assert_grad_close
from rlmini import logprobs, packing


def loss_args(**kw):
    base = dict(clip_eps=0.2, clip_eps_high=0.0, ratio_level="token", beta=0.0, surrogate="clip")
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
    got = common.aggregate(TOKEN_LOSS, MASK, mode, n_seqs=2, n_tokens=4, max_len=5)
    assert got.item() == pytest.approx(expected)


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"])
def test_aggregation_invariant_to_micro_batching(mode):
    torch.manual_seed(0)
    loss = torch.randn(6, 5)
    mask = (torch.rand(6, 5) > 0.3).float()
    mask[:, 0] = 1
    n_tok = mask.sum().item()
    whole = common.aggregate(loss, mask, mode, 6, n_tok, 5)
    parts = sum(common.aggregate(loss[i:i + 2], mask[i:i + 2], mode, 6, n_tok, 5) for i in range(0, 6, 2))
    assert parts.item() == pytest.approx(whole.item(), rel=1e-6)


def test_bad_aggregation_mode_names_flag():
    with pytest.raises(ValueError, match="--loss_agg"):
        common.aggregate(TOKEN_LOSS, MASK, "sum", 2, 4, 5)


def _batch_and_logp(model, tok, completions):
    prompts = [tok("3+4=", add_special_tokens=False)["input_ids"]] * len(completions)
    comps = [tok(c, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for c in completions]
    batch = packing.make_batch(prompts, comps, tok.pad_token_id, torch.device("cpu"))
    logp, _ = logprobs.token_logprobs(model, batch, 1.0)
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
    loss = common.aggregate(token_loss, mask, mode, 3, mask.sum().item(), 4)
    g_ours = torch.autograd.grad(loss, list(model.parameters()))

    _, logp2 = _batch_and_logp(model, tok, ["7", "12", "5"])
    lengths = mask.sum(1)
    w = 1 / (3 * lengths) if mode == "seq-mean-token-mean" else torch.full((3,), 1 / lengths.sum().item())
    textbook = -(adv * w * (logp2 * mask).sum(1)).sum()
    g_ref = torch.autograd.grad(textbook, list(model.parameters()))
    total = torch.cat([g.flatten() for g in g_ref]).norm()  # a layer whose gradient is ~0: the model's scale
    for (name, _), a, b in zip(model.named_parameters(), g_ours, g_ref):
        assert_grad_close(a, b, rel=1e-5, name=name, floor=float(total))


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
    token_loss, stats = grpo.policy_loss(logp, old, None, torch.tensor([1.0]), mask,
                                         loss_args(clip_eps_high=1.5))
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
    token_loss, stats = grpo.policy_loss(logp, logp, ref, torch.zeros(1), torch.ones(1, 2),
                                         loss_args(beta=0.1))
    d = -0.5
    assert stats["kl"][0, 0].item() == pytest.approx(math.exp(d) - d - 1)
    assert stats["kl"][0, 1].item() == 0.0
    assert token_loss[0, 0].item() == pytest.approx(0.1 * (math.exp(d) - d - 1))


# ----------------------------------------------------------------------------------------- float32 edge cases


@pytest.mark.parametrize("value", [math.log(0.01), 0.1, -0.7, 1 / 3])
@pytest.mark.parametrize("G", [2, 3, 8, 16])
def test_an_all_equal_group_gets_exactly_zero_advantage_in_float32(value, G):
    """log(0.01) * 8 in float32 used to give +0.316 (the mean off by one rounding step, / (std + 1e-6))."""
    import train_corpo
    import train_gpg
    import train_rloo
    r = torch.full((2 * G,), value, dtype=torch.float32)
    assert torch.equal(grpo.compute_advantages(r, G, std_norm=True), torch.zeros(2 * G))
    assert torch.equal(grpo.compute_advantages(r, G, std_norm=False), torch.zeros(2 * G))
    assert torch.equal(train_gpg.compute_advantages(r, G, std_norm=True)[0], torch.zeros(2 * G))
    assert torch.equal(train_rloo.compute_advantages(r, G), torch.zeros(2 * G))
    assert torch.equal(train_corpo.compute_advantages(r, G, r_min_correct=value - 1.0), torch.zeros(2 * G))
    assert grpo.compute_advantages(r, G).dtype == torch.float32


def test_advantages_match_a_float64_reference_on_random_groups():
    g = torch.Generator().manual_seed(0)
    r = torch.randn(64, generator=g) * 3 + 1
    ref = r.double().view(-1, 8)
    ref = ((ref - ref.mean(1, keepdim=True)) / (ref.std(1, keepdim=True) + 1e-6)).flatten()
    assert torch.allclose(grpo.compute_advantages(r, 8).double(), ref, atol=1e-6, rtol=0)


def test_ppo_whitening_does_not_amplify_rounding_on_a_constant_batch():
    import train_ppo
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    const = torch.full((2, 4), math.log(0.01)) * mask
    assert torch.equal(train_ppo.whiten(const, mask), torch.zeros(2, 4))
    x = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 5.0, 0.0, 0.0]])
    w = train_ppo.whiten(x, mask)
    valid = w[mask > 0].double()
    assert valid.mean().abs() < 1e-6 and valid.var().item() == pytest.approx(1.0, abs=1e-6)
    assert torch.equal(w[mask == 0], torch.zeros(3))


# ---------------------------------------------------------------------------------------------- GSPO-token


def close(tensor, expected):
    torch.testing.assert_close(tensor, torch.tensor(expected, dtype=tensor.dtype), atol=1e-6, rtol=1e-6)


def test_ppo_gspo_token_keeps_per_token_advantages_in_the_gradient():
    """GSPO-token (Zheng et al. 2025): s_i,t = sg[s_i] pi/sg[pi]; with A = [[1, -1]] the old form gave [[0,
    0]]."""
    import train_ppo
    args = loss_args(ratio_level="sequence", clip_eps=0.2)
    old = torch.tensor([[-1.0, -2.0]])
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    mask = torch.ones(1, 2)
    token_loss, stats = train_ppo.policy_loss(logp, old, None, torch.tensor([[1.0, -1.0]]), mask, args)
    common.aggregate(token_loss, mask, "seq-mean-token-mean", 1, 2, 2).backward()
    close(logp.grad, [[-0.5, 0.5]])  # -s_i A_t / |y| with s_i = 1
    # off-policy: the value of every token's ratio is the sequence ratio, its gradient s_i * grad log pi_t
    logp = torch.tensor([[-0.9, -2.05]], requires_grad=True)
    token_loss, stats = train_ppo.policy_loss(logp, old, None, torch.tensor([[1.0, -1.0]]), mask, args)
    s = math.exp((0.1 - 0.05) / 2)
    assert stats["ratio"][0].tolist() == pytest.approx([s, s])
    common.aggregate(token_loss, mask, "seq-mean-token-mean", 1, 2, 2).backward()
    close(logp.grad, [[-s / 2, s / 2]])


def test_grpo_gspo_token_gradient_equals_the_sequence_form_for_sequence_advantages():
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -0.3, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv = torch.tensor([0.7, -1.2])
    start = torch.tensor([[-0.95, -2.02, -0.49], [-1.03, -0.31, 0.0]])
    logp = start.clone().requires_grad_(True)
    token_loss, _ = grpo.policy_loss(logp, old, None, adv, mask,
                                     loss_args(ratio_level="sequence", clip_eps=0.5))
    common.aggregate(token_loss, mask, "seq-mean-token-mean", 2, 5, 3).backward()
    ref = start.clone().requires_grad_(True)  # GSPO as published: one ratio per sequence, through its mean
    s = torch.exp(((ref - old) * mask).sum(1) / mask.sum(1))
    (-(s * adv)).mean().backward()
    assert_grad_close(logp.grad, ref.grad * mask, rel=1e-6)


# ----------------------------------------------------------------------------------------- rollout correction


def correction_args(mode, cap=2.0, lo=0.5, hi=2.0):
    return SimpleNamespace(rollout_correction=mode, is_cap=cap, is_low=lo, is_high=hi, **vars(loss_args()))


OLD = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -0.3, 0.0]])
SAMPLER = OLD - torch.tensor([[1.0, 0.0, -1.0], [0.2, 0.1, 0.0]])  # log w = old - sampler
CMASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def test_rollout_weights_equal_hand_computed_values_for_every_mode():
    e = math.e
    w, stats = common.rollout_correction(OLD, SAMPLER, CMASK, correction_args("off"))
    assert w is None and stats["changed"].sum() == 0
    close(stats["w"], [[e, 1.0, 1 / e], [math.exp(0.2), math.exp(0.1), 1.0]])
    k3 = lambda lw: math.exp(lw) - 1 - lw  # noqa: E731
    close(stats["kl"], [[k3(1), 0.0, k3(-1)], [k3(0.2), k3(0.1), 0.0]])
    w, stats = common.rollout_correction(OLD, SAMPLER, CMASK, correction_args("token-tis"))  # min(w, 2)
    close(w, [[2.0, 1.0, 1 / e], [math.exp(0.2), math.exp(0.1), 1.0]])
    assert stats["changed"].tolist() == [[1, 0, 0], [0, 0, 0]]
    # w if 0.5 <= w <= 2
    w, stats = common.rollout_correction(OLD, SAMPLER, CMASK, correction_args("token-mis"))
    close(w, [[0.0, 1.0, 0.0], [math.exp(0.2), math.exp(0.1), 1.0]])
    assert stats["changed"].tolist() == [[1, 0, 1], [0, 0, 0]]
    # geometric means: row 0 exp(0/3) = 1 (kept), row 1 exp(0.3/2) = 1.16 (kept); bounds [1.1, 2] drop row 0
    w, stats = common.rollout_correction(OLD, SAMPLER, CMASK, correction_args("seq-mis", lo=1.1))
    close(w, [[0.0, 0.0, 0.0], [math.exp(0.2), math.exp(0.1), 1.0]])
    assert stats["changed"][0].tolist() == [1, 1, 1] and stats["changed"][1].tolist() == [0, 0, 0]
    w, _ = common.rollout_correction(OLD, SAMPLER, CMASK, correction_args("seq-mis"))
    close(w, [[e, 1.0, 1 / e], [math.exp(0.2), math.exp(0.1), 1.0]])


@pytest.mark.parametrize("module", ["train_grpo", "train_rloo", "train_corpo", "train_gpg", "train_ppo"])
@pytest.mark.parametrize("mode", ["token-tis", "token-mis", "seq-mis"])
def test_corrected_gradient_is_the_is_weighted_policy_gradient(module, mode):
    """On-policy (ratio 1), the loss gradient equals -(1/N) sum_i A_i (1/|y_i|) sum_t w~_it grad log pi_it,
    the truncated/masked IS-weighted policy-gradient estimator; the KL term is not weighted."""
    import importlib
    m = importlib.import_module(module)
    args = correction_args(mode)
    adv = torch.tensor([0.8, -1.5])
    logp = OLD.clone().requires_grad_(True)
    w, _ = common.rollout_correction(OLD, SAMPLER, CMASK, args)
    token_adv = adv[:, None].expand(-1, 3) if module == "train_ppo" else adv
    token_loss, _ = m.policy_loss(logp, OLD, None, token_adv, CMASK, args, w)
    common.aggregate(token_loss, CMASK, "seq-mean-token-mean", 2, 5, 3).backward()
    expected = -(adv[:, None] * w * CMASK / CMASK.sum(1, keepdim=True)) / 2
    assert_grad_close(logp.grad, expected, rel=1e-6)
    assert not hasattr(m, "rollout_correction")  # one estimator for every script: common.rollout_correction


def test_the_correction_does_not_weight_the_kl_term():
    args = SimpleNamespace(**{**vars(correction_args("token-tis")), "beta": 0.1})
    logp = OLD.clone().requires_grad_(True)
    ref = OLD - 0.3
    token_loss, stats = grpo.policy_loss(logp, OLD, ref, torch.zeros(2), CMASK, args,
                                         torch.full_like(OLD, 5.0))
    assert torch.allclose(token_loss, 0.1 * stats["kl"])  # advantage 0: only the unweighted KL remains


def test_cispo_gradient_is_the_truncated_detached_weight_times_the_advantage():
    """CISPO (MiniMax 2025, eq. 4-5): d loss / d log pi = -sg(min(r, 1 + eps_high)) A per token; a token
    whose ratio is clipped keeps that gradient (PPO's clipped surrogate gives it none)."""
    old = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]])
    logp = (old + torch.tensor([[0.0, 0.5, -0.5], [0.1, 1.0, -2.0]])).requires_grad_()
    adv = torch.tensor([1.0, -2.0])
    mask = torch.ones(2, 3)
    args = SimpleNamespace(clip_eps=0.2, clip_eps_high=0.28, ratio_level="token", beta=0.0, surrogate="cispo")
    token_loss, stats = grpo.policy_loss(logp, old, None, adv, mask, args)
    token_loss.sum().backward()
    r = torch.exp(logp.detach() - old)
    expected = -torch.clamp(r, max=1.28) * adv.unsqueeze(1)
    torch.testing.assert_close(logp.grad, expected)
    assert stats["clipped"].tolist() == [[0.0, 1.0, 0.0], [0.0, 1.0, 0.0]]
    assert logp.grad[0, 1] != 0  # clipped (r = e^0.5 > 1.28), still a gradient
    ppo = logp.detach().clone().requires_grad_()
    clip_args = SimpleNamespace(**{**vars(args), "surrogate": "clip"})
    grpo.policy_loss(ppo, old, None, adv, mask, clip_args)[0].sum().backward()
    assert ppo.grad[0, 1] == 0  # PPO: the clipped token of a positive advantage gets none


def test_cispo_on_policy_is_reinforce():
    """One on-policy update without rollout correction: r = 1, so CISPO's gradient is -A grad log pi
    (REINFORCE with the group advantage), the same as the clipped surrogate's."""
    logp = torch.tensor([[-1.0, -0.3], [-2.0, -0.7]], requires_grad=True)
    adv = torch.tensor([0.5, -1.5])
    args = SimpleNamespace(clip_eps=0.2, clip_eps_high=0.0, ratio_level="token", beta=0.0, surrogate="cispo")
    grpo.policy_loss(logp, logp.detach(), None, adv, torch.ones(2, 2), args)[0].sum().backward()
    torch.testing.assert_close(logp.grad, -adv.unsqueeze(1).expand(2, 2))
