"""DAPO's overlong handling (Yu et al. 2025, sec. 3.4): the soft punishment (eq. 13) by hand, and overlong
filtering (--mask_truncated) against the textbook gradient on a fixed batch."""
import pytest
import torch

import common
import train_grpo
from conftest import assert_grad_close
from rlmini import data, logprobs, models, packing
from rollout_double import addition_rewards, record_first_step


def test_soft_overlong_penalty_by_hand():
    r = data.Rollouts([], [[0] * n for n in (5, 6, 7, 8, 10)], [], [], 0)
    assert common.overlong_penalty(r, 10, 4, 1.0).tolist() == pytest.approx([0.0, 0.0, -0.25, -0.5, -1.0])
    assert common.overlong_penalty(r, 10, 4, 0.5).tolist() == pytest.approx([0.0, 0.0, -0.125, -0.25, -0.5])
    assert common.overlong_penalty(r, 10, 0, 1.0).tolist() == [0.0] * 5  # off


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
def test_mask_truncated_gives_the_gradient_of_the_finished_completions_only(tmp_path, monkeypatch, loss_agg):
    """On-policy GRPO (ratio 1, clip inactive): the gradient is -sum over kept completions of A_i grad log pi,
    normalised over the kept tokens (token-mean) or kept completions (seq-mean); advantages still use every
    completion of the group."""
    run, batches, grads, tok = record_first_step(monkeypatch, train_grpo, [
        "--out_dir", str(tmp_path), "--prompts_per_step", "4", "--group_size", "4", "--micro_batch_size", "3",
        "--loss_agg", loss_agg, "--mask_truncated", "true"])
    r = batches[0]
    assert 0 < sum(r.finished) < len(r.finished)  # the batch has both kinds
    # the initial weights again
    model = models.load_model(run.args, run.task, torch.device("cpu"), torch.float32)[0]
    rewards = addition_rewards(run, tok, r)
    advantages = train_grpo.compute_advantages(rewards, 4)
    kept = [i for i, f in enumerate(r.finished) if f]
    batch = packing.make_batch([r.prompt_ids[i] for i in kept], [r.completion_ids[i] for i in kept], r.pad_id,
                              torch.device("cpu"))
    logp, _ = logprobs.token_logprobs(model, batch, 1.0)
    per_seq = (logp * batch["mask"]).sum(1)
    if loss_agg == "token-mean":
        loss = -(advantages[kept] * per_seq).sum() / batch["mask"].sum()
    else:
        loss = -(advantages[kept] * per_seq / batch["mask"].sum(1)).sum() / len(kept)
    loss.backward()
    for ours, (name, p) in zip(grads[0], model.named_parameters()):
        assert_grad_close(ours, p.grad, rel=1e-4, name=name)
