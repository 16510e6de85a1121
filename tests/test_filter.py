"""A filter of completions (common.keep_completions): the normalisers of every --loss_agg, the loss and its
gradient are those of the batch without the dropped completions; dropped rows are never computed; a
minibatch with none kept is not yielded; a rank with none kept joins with an idle micro-batch; the
pre-update pass stays aligned with the batch. 2 ranks: tests/test_distributed.py."""
from types import SimpleNamespace

import pytest
import torch

import common
from conftest import assert_grad_close
from rlmini import batches, data, logprobs

PROMPTS = [[4, 13, 5, 14], [6, 13, 7, 14]]  # two groups of 4
COMPLETIONS = [[5, 1], [6, 6, 1], [7], [5, 5, 5, 1], [12, 1], [8, 9, 1], [11], [6, 1]]


def make_batch(rows, group_size, in_loss=None):
    """A scored Batch of COMPLETIONS[rows] (each group's prompt), rewards = row index."""
    r = data.Rollouts([PROMPTS[i // 4] for i in rows], [COMPLETIONS[i] for i in rows],
                      [[-1.0] * len(COMPLETIONS[i]) for i in rows], [True] * len(rows), 0)
    rewards = torch.tensor(rows, dtype=torch.float32)
    in_loss = torch.ones(len(rows)) if in_loss is None else in_loss
    return batches.Batch([{"prompt": "p"}] * (len(rows) // group_size), r, rewards, rewards, rewards,
                         (rewards,) * 4, 1, len(rows), "", in_loss)


def fake_run(model, group_size, loss_agg="token-mean", micro_batch_size=2, updates=1, minibatches=1):
    args = SimpleNamespace(seed=0, updates_per_rollout=updates, minibatches=minibatches,
                           group_size=group_size, micro_batch_size=micro_batch_size, micro_batch_tokens=0,
                           loss_agg=loss_agg)
    return SimpleNamespace(args=args, step=0, model=model, device=torch.device("cpu"))


def loss_and_grad(model, run, batch, advantages):
    """GPG's -log pi A per token, aggregated as the scripts do, accumulated over micro-batches."""
    model.zero_grad(set_to_none=True)
    total, seen = 0.0, []
    for mb in common.minibatches(run, batch):
        for micro in mb:
            logp, _ = logprobs.token_logprobs(model, micro.layout, 1.0)
            token_loss = -logp * micro.advantages(advantages)  # this rank's, or the global batch's
            loss = common.aggregate(token_loss, micro.loss_mask, run.args.loss_agg, mb.n_seqs, mb.n_tokens, 8)
            loss.backward()
            total, seen = total + loss.item(), seen + [(micro.rows, micro.idle)]
    return total, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, seen


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_a_filtered_batch_trains_as_the_batch_of_its_kept_completions(tiny_addition, loss_agg):
    """Completions 1, 2, 4 and 6 kept (6 also out of the loss: --mask_truncated), in micro-batches of 2: the
    normalisers count the kept completions in the loss (3 and their 7 tokens), the loss and the fp32 gradient
    are those of a batch of those 4 completions alone, and only they are computed."""
    model = tiny_addition[0]
    in_loss = torch.tensor([1.0, 1, 1, 1, 1, 1, 0, 1])
    advantages = torch.tensor([0.5, -1.0, 2.0, 0.3, -0.7, 1.5, 0.9, -0.2])
    keep = torch.tensor([0, 1, 1, 0, 1, 0, 1, 0], dtype=torch.bool)
    batch = common.keep_completions(make_batch(list(range(8)), 4, in_loss), keep)
    run = fake_run(model, 4, loss_agg)
    (mb,) = common.minibatches(run, batch)
    assert (mb.n_seqs, mb.n_tokens) == (3, 3 + 1 + 2)  # rows 1, 2, 4 in the loss: 3, 1 and 2 tokens
    loss, grads, seen = loss_and_grad(model, run, batch, advantages)
    kept = [1, 2, 4, 6]
    assert sorted(i for rows, idle in seen for i in rows) == kept and not any(idle for _, idle in seen)
    alone = make_batch(kept, 1, in_loss[kept])  # groups of 1: any order of them is one minibatch
    loss_alone, grads_alone, _ = loss_and_grad(model, fake_run(model, 1, loss_agg), alone, advantages[kept])
    assert loss == pytest.approx(loss_alone, rel=1e-6)
    norm = torch.cat([g.flatten() for g in grads_alone.values()]).norm().item()
    assert grads.keys() == grads_alone.keys() and norm > 0
    for name in grads:
        assert_grad_close(grads[name], grads_alone[name], rel=1e-5, name=name, floor=norm)


def test_a_minibatch_with_nothing_kept_is_not_yielded_and_is_counted(tiny_addition):
    """--minibatches 2, --updates_per_rollout 2: the group with nothing kept makes no minibatch in either
    pass (batch.empty_updates 2); keeping nothing at all makes none, and none is computed."""
    model = tiny_addition[0]
    batch = common.keep_completions(make_batch(list(range(8)), 4), [1, 0, 1, 0, 0, 0, 0, 0])
    run = fake_run(model, 4, updates=2, minibatches=2)
    yielded = [mb.rows for mb in common.minibatches(run, batch)]
    assert yielded == [[0, 1, 2, 3]] * 2 and batch.empty_updates == 2
    nothing = common.keep_completions(make_batch(list(range(8)), 4), torch.zeros(8))
    assert list(common.minibatches(run, nothing)) == [] and nothing.empty_updates == 4
    args = SimpleNamespace(temperature=1.0, micro_batch_size=2, micro_batch_tokens=0)
    cpu = SimpleNamespace(args=args, device=torch.device("cpu"), dtype=torch.float32)
    got = common.logprobs(cpu, nothing, model)  # zeros of each completion's length, none computed
    assert all(torch.equal(x, torch.zeros(len(c))) for x, c in zip(got, COMPLETIONS)) and len(got) == 8


def test_the_pre_update_pass_skips_dropped_rows_and_stays_aligned(tiny_addition):
    """ragged_pass (pi_old, a reference's or any model's log-probs) computes the kept rows only: theirs equal
    the unfiltered pass's, a dropped row's are zeros of its length, so the lists stay aligned."""
    model = tiny_addition[0]
    full = make_batch(list(range(8)), 4)
    batch = common.keep_completions(full, [1, 0, 0, 1, 0, 1, 1, 0])
    seen = []

    def forward(micro):
        seen.extend(micro.rows)
        return {"logp": logprobs.token_logprobs(model, micro.layout, 1.0)[0]}
    with torch.no_grad():
        got = batches.ragged_pass(batch, forward, 2, 0, model, torch.device("cpu"))["logp"]
        want = batches.ragged_pass(full, forward, 2, 0, model, torch.device("cpu"))["logp"]
    assert seen[:4] == [0, 3, 5, 6] and [len(x) for x in got] == [len(c) for c in COMPLETIONS]
    for i in range(8):  # the kept rows packed with others than in the full pass: the same to rounding
        if i in (0, 3, 5, 6):
            torch.testing.assert_close(got[i], want[i], rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(got[i], torch.zeros(len(COMPLETIONS[i])))


def test_a_rank_with_nothing_kept_joins_with_an_idle_micro_batch(tiny_addition, monkeypatch):
    """By construction, what torchrun's other rank would force: this rank keeps none of a minibatch that
    another rank runs 2 micro-batches of (most_micro_batches 2). It runs 2 idle micro-batches built from its
    first row (forward and backward join FSDP2's collectives) whose masks are zero: no loss, no gradient."""
    model = tiny_addition[0]
    batch = common.keep_completions(make_batch(list(range(8)), 4), [0] * 4 + [1] * 4)
    monkeypatch.setattr(batches, "most_micro_batches", lambda rows: 2)
    rows = list(batches.update_schedule(batch, [0, 1, 2, 3], 2))
    assert rows == [([0], True), ([0], True)]
    mb = batches.Minibatch(batch, [0, 1, 2, 3], 0, 1.0, 1.0, 2, 0, model, torch.device("cpu"))
    micros = list(mb)
    assert len(micros) == 2 and all(m.idle and not m.mask.any() and not m.loss_mask.any() for m in micros)
    model.zero_grad(set_to_none=True)
    for micro in micros:
        logp, _ = logprobs.token_logprobs(model, micro.layout, 1.0)
        loss = common.aggregate(-logp, micro.loss_mask, "token-mean", 1.0, 1.0, 8)
        loss.backward()
        assert loss.item() == 0.0
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


@pytest.mark.parametrize("keep, message", [
    ([1, 0, 1], "give one bool or 0/1 per completion, this rank's 8 or the global batch's 8 \\(got 3"),
    ([0.5] * 8, "give one bool or 0/1 per completion"),
])
def test_a_bad_filter_is_refused_in_one_line(keep, message):
    with pytest.raises(ValueError, match=message):
        common.keep_completions(make_batch(list(range(8)), 4), keep)


TWO_RANKS = """import os, sys, types, torch
sys.path[:0] = [{root!r}, os.path.join({root!r}, "tests")]
from transformers import AutoModelForCausalLM
import common
from rlmini import dist
from test_filter import fake_run, loss_and_grad, make_batch
torch.set_num_threads(1)
dist.setup_device(types.SimpleNamespace(dtype="float32", dist_timeout=120))
model = dist.shard_model(AutoModelForCausalLM.from_pretrained({path!r}, dtype=torch.float32), torch.float32)
r = dist.rank()
batch = make_batch(list(range(4 * r, 4 * r + 4)), 4)  # rank 0 the first group, rank 1 the second
batch = common.keep_completions(batch, torch.tensor({keep}))  # the global batch's: each rank its block
advantages = torch.tensor({advantages})
loss, grads, seen = loss_and_grad(model, fake_run(model, 4, micro_batch_size=1), batch, advantages)
grads = {{n: dist.full_tensor(g).cpu() for n, g in grads.items()}}
total = dist.all_sum(loss) / 2  # each rank's share of a loss normalised by half the global counts
torch.save({{"loss": total, "grads": grads, "seen": seen}}, os.path.join({out!r}, "rank%d.pt" % r))
"""


@pytest.mark.slow
def test_a_rank_with_nothing_kept_under_torchrun_gives_the_one_rank_result(tmp_path, tiny_addition):
    """2 gloo ranks, FSDP2: rank 0 keeps none of its group, rank 1 two of its completions (micro-batches of
    1). Rank 0 runs two idle micro-batches of its first row beside rank 1's two (no hang: the collectives
    match), and the loss and the gathered gradient equal one process's on the global batch."""
    import os
    import subprocess
    import sys
    from conftest import ROOT
    keep, advantages = [0, 0, 0, 0, 1, 0, 1, 0], [0.5, -1.0, 2.0, 0.3, -0.7, 1.5, 0.9, -0.2]
    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS.format(root=ROOT, path=tiny_addition[2], keep=keep, advantages=advantages,
                                       out=str(tmp_path)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(script)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    assert ranks[0]["seen"] == [([0], True), ([0], True)] and ranks[1]["seen"] == [([0], False), ([2], False)]
    model = tiny_addition[0]
    batch = common.keep_completions(make_batch(list(range(8)), 4), keep)
    run = fake_run(model, 4, micro_batch_size=1)
    loss, grads, _ = loss_and_grad(model, run, batch, torch.tensor(advantages))
    norm = torch.cat([g.flatten() for g in grads.values()]).norm().item()
    for got in ranks:
        assert got["loss"] == pytest.approx(loss, rel=1e-5)
        for name, g in grads.items():
            assert_grad_close(got["grads"][name], g, rel=1e-5, name=name, floor=norm)
