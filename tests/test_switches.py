"""The researchers' switches of issue 12 against hand values and textbook gradients: GRPO's batch-level
std (REINFORCE++-baseline), the top-entropy token mask (Wang et al. 2025), the entropy bonus, DAPO dynamic
sampling (Yu et al. 2025, sec. 3.2) and the completion log (rollouts.jsonl, eval.py completions)."""
import json
import math
import os
from types import SimpleNamespace

import pytest
import torch

import eval as evaluation
import train_grpo
import train_rloo
from conftest import assert_grad_close, read_metrics
from rlmini import dist, logprobs, models, packing, runlog
from rollout_double import addition_rewards, record_first_step

# ---------------------------------------------------------------------------------------------- --std_level


def test_batch_std_is_reinforce_pp_baseline_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    # group-centred: [.75, -.25, -.25, -.25], [.5, .5, -.5, -.5]; unbiased batch std: sqrt(1.75 / 7) = .5
    batch = train_grpo.compute_advantages(rewards, 4, std_norm=True, eps=0.0, std_level="batch")
    assert batch.tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5, 1.0, 1.0, -1.0, -1.0])
    # group level divides each group by its own std: sqrt(0.25) = 0.5 and sqrt(1/3)
    group = train_grpo.compute_advantages(rewards, 4, std_norm=True, eps=0.0, std_level="group")
    s3 = 3 ** 0.5
    assert group.tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5, 0.5 * s3, 0.5 * s3, -0.5 * s3, -0.5 * s3])
    # not TRL's "batch" (std of the raw rewards, 0.5345 here): that would give 1.4031 for the first completion
    assert batch[0].item() != pytest.approx(0.75 / rewards.std().item())
    # an all-equal batch has no signal: exactly zero, not NaN
    assert train_grpo.compute_advantages(torch.ones(8), 4, std_level="batch").tolist() == [0.0] * 8
    # without the std the level does not matter (Dr. GRPO)
    assert train_grpo.compute_advantages(rewards, 4, std_norm=False, std_level="batch").tolist() == \
        train_grpo.compute_advantages(rewards, 4, std_norm=False).tolist()


# ----------------------------------------------------------------------------------------- top-entropy tokens


def test_top_share_threshold_keeps_the_right_tokens():
    x = torch.tensor([0.1, 0.5, 0.3, 0.9, 0.7, 0.2, 0.4, 0.6, 0.8, 1.0])
    # 2 of 10 (0.2 * 10 is not rounded up to 3)
    assert dist.top_share_threshold([x], 0.2) == pytest.approx(0.9)
    assert dist.top_share_threshold([x], 0.25) == pytest.approx(0.8)  # ceil(2.5) = 3 tokens: 1.0, 0.9, 0.8
    assert dist.top_share_threshold([x], 1.0) == pytest.approx(0.1)   # all
    assert dist.top_share_threshold([x], 0.01) == pytest.approx(1.0)  # at least one token
    assert int((x >= dist.top_share_threshold([x], 0.5)).sum()) == 5
    ties = torch.tensor([1.0, 1.0, 1.0, 0.0])
    assert int((ties >= dist.top_share_threshold([ties[:2], ties[2:]], 0.25)).sum()) == 3  # ties all stay
    assert dist.top_share_threshold([], 0.2) == float("inf")  # nothing in the loss: no token passes


def test_cov_tokens_centre_over_the_batch_and_pick_the_top_share_or_a_random_share_of_the_band():
    """common.cov_tokens (Clip-Cov, KL-Cov; Cui et al. 2025): Cov_t = (log pi_t - mean)(A_t - mean), the means
    over the tokens in the loss only (a completion cut by --mask_truncated or dropped is not counted), by
    hand; KL-Cov's top ceil(share N); Clip-Cov's ceil(r N) of the band's tokens, uniformly drawn, the same
    draw for the same seed and step, another for another step, all of the band when it has fewer; exactly
    ceil(share N) when values tie (all advantages equal, log-probs repeated), the ties in global order."""
    import common

    class Rows(SimpleNamespace):
        def __len__(self):
            return len(self.kept)
    logp = [torch.tensor([-0.1, -2.0, -0.5]), torch.tensor([-3.0, -0.2]), torch.tensor([-1.0, -9.0]),
            torch.tensor([-0.3])]
    adv = torch.tensor([1.0, -1.0, 5.0, 2.0])
    batch = Rows(in_loss=torch.tensor([1.0, 1.0, 0.0, 1.0]), kept=torch.tensor([1.0, 1.0, 1.0, 1.0]))
    run = SimpleNamespace(args=SimpleNamespace(seed=0), step=0)
    x = torch.tensor([-0.1, -2.0, -0.5, -3.0, -0.2, -0.3], dtype=torch.float64)  # the 6 tokens in the loss
    a = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, 2.0], dtype=torch.float64)
    cov = (x - x.mean()) * (a - a.mean())  # means -6.1 / 6 and 0.5
    assert cov.tolist() == pytest.approx([0.4583, -0.4917, 0.2583, 2.975, -1.225, 1.075], abs=1e-4)
    top = common.cov_tokens(run, batch, logp, adv, 2 / 6)  # KL-Cov: the two largest, 2.975 and 1.075
    assert [t.tolist() for t in top] == [[0, 0, 0], [1, 0], [0, 0], [1]]
    assert sum(int(t.sum()) for t in common.cov_tokens(run, batch, logp, adv, 0.5)) == 3  # ceil(0.5 * 6)
    band = (0.2, 2.0)  # 0.4583, 0.2583, 1.075: three tokens in the band
    picks = []
    for step in range(40):
        run.step = step
        chosen = common.cov_tokens(run, batch, logp, adv, 1 / 6, band)  # one token of six
        flat = torch.cat(chosen)
        assert flat.sum() == 1 and flat[[0, 2, 7]].sum() == 1 and chosen[2].sum() == 0
        assert all(torch.equal(c, d) for c, d in zip(chosen, common.cov_tokens(run, batch, logp, adv, 1 / 6,
                                                                                band)))
        picks.append(int(flat.nonzero()))
    assert set(picks) == {0, 2, 7}  # each of the band's tokens drawn in some step
    everything = common.cov_tokens(run, batch, logp, adv, 0.9, band)  # ceil(5.4) = 6 > 3: the whole band
    assert torch.cat(everything).nonzero().flatten().tolist() == [0, 2, 7]
    run.args.seed = 20_000_000  # (seed * 1000003 + step) * 1000003 passes 2^63: the seed is taken mod 2^63
    assert torch.cat(common.cov_tokens(run, batch, logp, adv, 1 / 6, band)).sum() == 1
    equal = common.cov_tokens(run, batch, logp, torch.full((4,), 0.7), 0.5)  # Cov 0 everywhere: all tied
    assert [t.tolist() for t in equal] == [[1, 1, 1], [0, 0], [0, 0], [0]]  # ceil(0.5 * 6), in global order
    tied = [torch.tensor([0.0, -1.0, 0.0]), torch.tensor([0.0, 0.0]), torch.zeros(1), torch.zeros(1)]
    top = common.cov_tokens(run, batch, tied, torch.tensor([1.0, 1.0, 0.0, -1.0]), 2 / 6)  # 4 tied on top
    assert [t.tolist() for t in top] == [[1, 0, 1], [0, 0], [0], [0]]  # the first two of the tied four
    batch.kept = torch.zeros(4)  # nothing in the loss: nothing chosen
    assert sum(t.sum() for t in common.cov_tokens(run, batch, logp, adv, 0.5)) == 0


def test_entropy_gradient_through_the_chunked_projection_is_the_analytic_one():
    """H = -sum_v p_v log p_v with z = h W^T / T: dH/dz_v = -p_v (log p_v + H) / T, so dH/dW = dz^T h and
    dH/dh = dz W; our checkpointed, chunked projection must give exactly these gradients."""
    torch.manual_seed(0)
    d, V, T = 6, 11, 0.7
    batch = packing.make_batch([[3, 4], [6]], [[8, 9, 1], [10, 1, 2, 5]], 0, torch.device("cpu"))
    head = torch.nn.Linear(d, V, bias=False)
    hidden = torch.randn(*batch["input_ids"].shape, d, requires_grad=True)

    class Decoder(torch.nn.Module):  # stands in for the transformer: its last hidden state is `hidden`
        def forward(self):
            return (hidden,)

    class Model(torch.nn.Module):
        config = SimpleNamespace()  # no logit scaling or soft cap

        def __init__(self):
            super().__init__()
            self.decoder = Decoder()

        def forward(self, **kw):
            self.decoder()
            return SimpleNamespace(logits=None)

        def get_decoder(self):
            return self.decoder

        def get_output_embeddings(self):
            return head
    model = Model()
    # 7 tokens: 4 chunks
    _, entropy = logprobs.token_logprobs(model, batch, T, chunk_tokens=2, with_entropy=True,
                                         entropy_grad=True)
    assert entropy.requires_grad
    (entropy * batch["mask"]).sum().backward()
    with torch.no_grad():
        at = batch["mask"] > 0
        h = hidden[:, :-1][at]  # position t predicts token t + 1
        logp = torch.log_softmax(h @ head.weight.T / T, -1)
        H = -(logp.exp() * logp).sum(-1, keepdim=True)
        dz = -logp.exp() * (logp + H) / T
        torch.testing.assert_close(H.squeeze(1), entropy[at].detach())
        dh = torch.zeros_like(hidden)
        dh[:, :-1][at] = dz @ head.weight
    assert_grad_close(head.weight.grad, dz.T @ h, rel=1e-5, name="dH/dW")
    assert_grad_close(hidden.grad, dh, rel=1e-5, name="dH/dh")


@pytest.mark.parametrize("rho,coef", [(0.3, 0.0), (0.3, 0.05), (1.0, 0.05)])
def test_top_entropy_mask_and_entropy_bonus_give_the_textbook_gradient(tmp_path, monkeypatch, rho, coef):
    """On-policy GRPO, token-mean: grad of -(sum_i A_i sum_t 1[H_it >= tau] log pi_it + c sum_it H_it) /
    N_tokens, tau the smallest of the top ceil(rho N) entropies of the batch (Wang et al. 2025); N counts
    every token."""
    run, batches, grads, tok = record_first_step(monkeypatch, train_grpo, [
        "--out_dir", str(tmp_path), "--prompts_per_step", "4", "--group_size", "4", "--micro_batch_size", "3",
        "--loss_agg", "token-mean", "--top_entropy_quantile", str(rho), "--entropy_coef", str(coef)])
    r = batches[0]
    # the initial weights again
    model = models.load_model(run.args, run.task, torch.device("cpu"), torch.float32)[0]
    advantages = train_grpo.compute_advantages(addition_rewards(run, tok, r), 4)
    batch = packing.make_batch(r.prompt_ids, r.completion_ids, r.pad_id, torch.device("cpu"))
    logp, entropy = logprobs.token_logprobs(model, batch, 1.0, with_entropy=True, entropy_grad=coef > 0)
    mask = batch["mask"]
    H = entropy.detach()[mask > 0]
    k = max(1, math.ceil(round(rho * H.numel(), 6)))  # ceil(rho * N) without float noise
    tau = H.sort(descending=True).values[k - 1]
    top = (entropy.detach() >= tau) * mask
    assert int(top.sum()) >= k and (rho == 1.0 or int(top.sum()) < H.numel())
    loss = -(advantages[:, None] * logp * top).sum() / mask.sum() - coef * (entropy * mask).sum() / mask.sum()
    loss.backward()
    for ours, (name, p) in zip(grads[0], model.named_parameters()):
        assert_grad_close(ours, p.grad, rel=1e-4, name=name)
    threshold = read_metrics(run.run_dir)[0].get("entropy/threshold")
    # absent when off
    assert threshold == pytest.approx(tau.item(), rel=1e-5) if rho < 1 else threshold is None


# ------------------------------------------------------------------------------------------- dynamic sampling


@pytest.mark.parametrize("script", [train_grpo, train_rloo])
def test_dynamic_sampling_keeps_only_groups_with_both_outcomes(tmp_path, monkeypatch, script):
    """On the rollout double (completions fixed by the prompt's text: some groups all wrong), the trained
    batch holds, in order, the first groups with a correct and a wrong completion over the sampling rounds."""
    run, batches, _, tok = record_first_step(monkeypatch, script, [
        "--out_dir", str(tmp_path), "--prompts_per_step", "8", "--group_size", "4", "--dynamic_sampling",
        "true",
        "--max_sampling_rounds", "10", "--log_completions", "32"])
    row = read_metrics(run.run_dir)[0]
    mixed, zero_first = [], None
    for r in batches:
        correct = addition_rewards(run, tok, r).view(-1, 4)
        ok = (correct.amax(1) > correct.amin(1)).tolist()
        zero_first = 1 - sum(ok) / len(ok) if zero_first is None else zero_first
        mixed += [r.prompt_ids[4 * g] for g, v in enumerate(ok) if v]
    assert len(batches) == row["sampling/rounds"] > 1  # the double makes some groups all wrong
    assert row["sampling/extra_rollouts"] == (len(batches) - 1) * 32
    assert row["frac_reward_zero_std"] == pytest.approx(zero_first) and zero_first > 0
    assert row["sampling/kept_zero_std"] == 0.0
    assert run.data_pos == 8 * len(batches)  # each round consumes new prompts
    logged = [json.loads(line) for line in open(os.path.join(run.run_dir, "rollouts.jsonl"))]
    assert len(logged) == 32  # the whole trained batch: its prompts are the first 8 mixed groups, in order
    prompts = [tok.decode(p, skip_special_tokens=True) for p in mixed[:8]]
    assert [x["prompt"] for x in logged[::4]] == prompts
    for g in range(8):
        assert 0 < sum(x["correct"] for x in logged[4 * g:4 * g + 4]) < 4


def test_dynamic_sampling_tops_up_at_the_round_limit(tmp_path, monkeypatch):
    """At --max_sampling_rounds the batch is filled up with the last round's zero-variance groups (after the
    kept ones), as GPG does, so that every rank trains on the same number of completions."""
    run, batches, _, tok = record_first_step(monkeypatch, train_grpo, [
        "--out_dir", str(tmp_path), "--prompts_per_step", "8", "--group_size", "4", "--dynamic_sampling",
        "true",
        "--max_sampling_rounds", "1", "--log_completions", "32"])
    row = read_metrics(run.run_dir)[0]
    assert len(batches) == row["sampling/rounds"] == 1 and row["sampling/extra_rollouts"] == 0
    zero = row["frac_reward_zero_std"]
    assert 0 < zero < 1 and row["sampling/kept_zero_std"] == pytest.approx(zero)
    logged = [json.loads(line) for line in open(os.path.join(run.run_dir, "rollouts.jsonl"))]
    varied = [0 < sum(x["correct"] for x in logged[4 * g:4 * g + 4]) < 4 for g in range(8)]
    assert len(logged) == 32 and varied == sorted(varied, reverse=True)  # kept groups first, then the others


# --------------------------------------------------------------------------------------------- completion log


def test_completion_log_rows_resume_and_the_eval_command(tmp_path, capsys):
    argv = ["--out_dir", str(tmp_path), "--wandb", "false", "--engine", "hf", "--prompts_per_step", "4",
            "--group_size", "2", "--log_completions", "3", "--run_name", "log", "--save_every", "1"]
    run = train_grpo.main([*argv, "--steps", "2"])
    path = os.path.join(run.run_dir, "rollouts.jsonl")
    rows = [json.loads(line) for line in open(path)]
    assert [r["step"] for r in rows] == [1, 1, 1, 2, 2, 2]
    assert set(rows[0]) >= {"step", "prompt", "completion", "reward", "correct", "format", "advantage",
                            "length",
                            "truncated"}
    for r in rows:
        assert r["prompt"].endswith("=") and r["length"] >= 1 and isinstance(r["truncated"], bool)
        assert not r["truncated"] or r["length"] == run.max_new_tokens
    # from step 2's checkpoint: no duplicate step
    train_grpo.main([*argv, "--steps", "3", "--resume", "true"])
    assert [json.loads(line)["step"] for line in open(path)] == [1, 1, 1, 2, 2, 2, 3, 3, 3]
    # a resume from an older checkpoint rewrites the later steps
    runlog.truncate_metrics(path, 1)
    assert [json.loads(line)["step"] for line in open(path)] == [1, 1, 1]
    out = evaluation.main(["completions", run.run_dir, "--worst", "2", "--best", "1"])
    printed = capsys.readouterr().out
    assert out["step"] == 1 and len(out["worst"]) == 2 and len(out["best"]) == 1
    assert out["worst"][0]["reward"] <= out["worst"][1]["reward"] <= out["best"][0]["reward"]
    assert "worst" in printed and "best" in printed
    with pytest.raises(SystemExit, match="no completions of step 7"):
        evaluation.main(["completions", run.run_dir, "--step", "7"])


@pytest.mark.slow
def test_dynamic_sampling_learns_faster_per_optimizer_step(tmp_path):
    """From the random tiny model most addition groups are all wrong (zero variance, no signal); with dynamic
    sampling every optimizer step sees 16 groups with signal. Measured on the current code, reward over steps
    21-40 with it / without, seeds 0-4: 0.090 / 0.013, 0.066 / 0.042, 0.068 / 0.037, 0.095 / 0.043, 0.157 /
    0.052 (at least 1.57x and +0.024; over steps 31-40 alone seed 1 gives only 1.37x)."""
    argv = ["--out_dir", str(tmp_path), "--wandb", "false", "--engine", "hf", "--steps", "40",
            "--prompts_per_step", "16", "--save_every", "0"]
    with_ds = read_metrics(train_grpo.main([*argv, "--run_name", "ds", "--dynamic_sampling", "true",
                                            "--max_sampling_rounds", "8"]).run_dir)
    without = read_metrics(train_grpo.main([*argv, "--run_name", "plain"]).run_dir)
    assert all(r["sampling/kept_zero_std"] == 0 for r in with_ds if r["sampling/rounds"] < 8)
    assert max(r["sampling/rounds"] for r in with_ds) > 1 and all(r["sampling/rounds"] == 1 for r in without)
    late = lambda rows: sum(r["reward/mean"] for r in rows[20:]) / 20  # the policy's own rate (first round)
    assert late(with_ds) > 1.3 * late(without) and late(with_ds) > late(without) + 0.015, \
        (late(with_ds), late(without))


def test_completion_log_goes_to_a_wandb_table_keyed_by_the_step(tmp_path):
    import wandb
    logged = []
    log = runlog.RunLog.__new__(runlog.RunLog)  # rank 0's logger, with a stand-in for the wandb run
    log.rank0, log.path = True, str(tmp_path / "metrics.jsonl")
    log.wandb = SimpleNamespace(log=lambda data, step: logged.append((data, step)))
    rows = [{"step": 3, "prompt": "1+2=", "completion": "3", "reward": 1.0, "truncated": False},
            {"step": 3, "prompt": "2+2=", "completion": "5", "reward": 0.0, "truncated": False}]
    log.completions(3, rows)
    (data, step), = logged
    table = data["completions"]
    assert step == 3 and isinstance(table, wandb.Table)
    assert table.columns == ["step", "prompt", "completion", "reward", "truncated"]
    assert table.data == [[3, "1+2=", "3", 1.0, False], [3, "2+2=", "5", 0.0, False]]
    assert [json.loads(line) for line in open(tmp_path / "rollouts.jsonl")] == rows
