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


# ------------------------------------------------------------------------- losses over whole groups


def test_whole_groups_micro_batches_never_split_a_group():
    """micro_rows with a group size: cuts between groups only, at most max_seqs rows and max_tokens tokens
    a micro-batch, a group over the budget a micro-batch of its own; the micro-batch numbers its groups."""
    batch = make_batch(list(range(8)), 2)  # groups of 2: rows 0-1, 2-3, 4-5, 6-7
    # prompt+completion tokens per row: 6 7 5 8 6 7 5 6
    assert batches.micro_rows(batch, list(range(8)), 3, 0, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert batches.micro_rows(batch, list(range(8)), 4, 0, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert batches.micro_rows(batch, [4, 5, 0, 1, 6, 7], 8, 24, 2) == [[4, 5], [0, 1, 6, 7]]  # 13+13 > 24
    assert batches.micro_rows(batch, [4, 5, 0, 1, 6, 7], 8, 12, 2) == [[4, 5], [0, 1], [6, 7]]  # 13 > 12
    assert batches.micro_rows(batch, list(range(8)), 1, 0, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]  # over
    assert batches.micro_rows(batch, [0, 2, 3, 7], 2, 0, 2) == [[0], [2, 3], [7]]  # kept rows of a group
    micro = batches.micro_batch(batch, [6, 7, 2, 3], None, torch.device("cpu"), group_size=2)
    assert micro.groups.tolist() == [0, 0, 1, 1]
    assert micro.per_group(torch.tensor([1.0, 2.0, 3.0, 4.0])).tolist() == [3.0, 7.0]
    with pytest.raises(ValueError, match="whole_groups=True"):
        batches.micro_batch(batch, [6, 7], None, torch.device("cpu")).per_group(torch.ones(2))


SIGNS = torch.tensor([1.0, -1.0, 0.5, 0.0, -0.3, 2.0, 1.0, -1.0])  # a loss over each group's rows


def group_loss_and_grads(model, run, batch, over="groups", signs=SIGNS):
    """Per minibatch: a loss per group, -log sigmoid(sum_i s_i log pi(y_i)) (or per completion, its
    -log sigmoid(s_i log pi(y_i))), aggregated by common.aggregate_over and accumulated over micro-batches.
    """
    out = []
    for mb in common.minibatches(run, batch, whole_groups=True):
        model.zero_grad(set_to_none=True)
        total = 0.0
        for micro in mb:
            logp, _ = logprobs.token_logprobs(model, micro.layout, 1.0)
            seq = micro.per_seq(signs) * (logp * micro.loss_mask).sum(1)
            loss = -torch.nn.functional.logsigmoid(micro.per_group(seq) if over == "groups" else seq)
            loss = common.aggregate_over(loss, micro, mb, over)
            loss.backward()
            total += loss.item()
        out.append((mb.rows, total, {n: p.grad.clone() for n, p in model.named_parameters()
                                     if p.grad is not None}))
    return out


def textbook(model, batch, rows, over):
    """The same mean over the groups (completions) of `rows` in the loss and kept, in one plain forward each.
    """
    losses = {}
    model.zero_grad(set_to_none=True)
    for i in rows:
        if batch.kept[i] and batch.in_loss[i]:
            layout = make_batch([i], 1).rollouts
            ids = torch.tensor([layout.prompt_ids[0] + layout.completion_ids[0]])
            logits = model(input_ids=ids).logits[0, :-1].float().log_softmax(-1)
            n = len(layout.completion_ids[0])
            logp = logits[-n:].gather(1, ids[0, -n:, None]).sum()
            key = i // 2 if over == "groups" else i
            losses[key] = losses.get(key, 0.0) + SIGNS[i] * logp
    loss = sum(-torch.nn.functional.logsigmoid(x) for x in losses.values()) / len(losses)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("over", ["groups", "seqs"])
def test_whole_groups_gradient_is_the_same_for_any_micro_batch_size_and_minibatches(tiny_addition, over):
    """Groups of 2, row 3 dropped (keep_completions), row 6 out of the loss (--mask_truncated): for
    --micro_batch_size 1, 3, 8 and --minibatches 1, 2, each minibatch's loss and fp32 gradient are the
    mean over its groups (completions) of the loss computed group by group in plain forwards; idle
    micro-batches add nothing."""
    model = tiny_addition[0]
    in_loss = torch.tensor([1.0, 1, 1, 1, 1, 1, 0, 1])
    batch = common.keep_completions(make_batch(list(range(8)), 2, in_loss), [1, 1, 1, 0, 1, 1, 1, 1])
    hands = {}
    for minibatches in (1, 2):
        want = None
        for size in (1, 3, 8):
            run = fake_run(model, 2, micro_batch_size=size, minibatches=minibatches)
            got = group_loss_and_grads(model, run, batch, over)
            assert len(got) == minibatches
            for rows, loss, grads in got:
                if tuple(rows) not in hands:
                    hands[tuple(rows)] = textbook(model, batch, rows, over)
                hand_loss, hand = hands[tuple(rows)]
                assert loss == pytest.approx(hand_loss, rel=1e-5), (minibatches, size, rows)
                norm = torch.cat([g.flatten() for g in hand.values()]).norm().item()
                assert norm > 0 and grads.keys() == hand.keys()
                for name in grads:
                    assert_grad_close(grads[name], hand[name], rel=1e-5, name=name, floor=norm)
            want = want or [rows for rows, _, _ in got]
            assert [rows for rows, _, _ in got] == want  # the same split whatever the micro-batch size


def test_whole_groups_need_minibatches_that_divide_the_groups(tiny_addition):
    """4 groups of 2 on this rank: --minibatches 2 and 4 split them whole; 8 (one completion each) is refused
    in one line naming the flag and the groups."""
    batch = make_batch(list(range(8)), 2)
    for m in (2, 4):
        run = fake_run(None, 2, minibatches=m)
        got = [mb.rows for mb in common.minibatches(run, batch, whole_groups=True)]
        assert len(got) == m and all(len({i // 2 for i in rows}) * 2 == len(rows) for rows in got)
    with pytest.raises(SystemExit, match=r"^--minibatches 8 must divide each rank's groups per step \(4\)"):
        list(common.minibatches(fake_run(None, 2, minibatches=8), batch, whole_groups=True))


def test_whole_groups_idle_micro_batches_add_no_loss_nor_gradient(tiny_addition, monkeypatch):
    """A rank with nothing kept (torchrun's idle repeats): a per-group loss of its zero-mask rows is
    log 2, not 0, yet aggregate_over makes it 0 with no gradient, and StepStats logs no loss for it."""
    model = tiny_addition[0]
    batch = common.keep_completions(make_batch(list(range(8)), 2), [0] * 4 + [1] * 4)
    monkeypatch.setattr(batches, "most_micro_batches", lambda rows: 2)
    mb = batches.Minibatch(batch, [0, 1, 2, 3], 0, 1.0, 1.0, 2, 0, model, torch.device("cpu"), 2.0, 2)
    model.zero_grad(set_to_none=True)
    stats = common.StepStats()
    for micro in mb:
        logp, entropy = logprobs.token_logprobs(model, micro.layout, 1.0, with_entropy=True)
        per_group = -torch.nn.functional.logsigmoid(micro.per_group((logp * micro.loss_mask).sum(1)))
        assert micro.idle and per_group.tolist() == pytest.approx([0.6931472])
        loss = common.aggregate_over(per_group, micro, mb, "groups")
        loss.backward()
        stats.add(micro, per_group.sum(), logp.detach(), entropy, {})  # no rollout correction: no is_info
        assert loss.item() == 0.0
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())
    assert common.all_sum(stats.sums)["loss/policy"] == 0.0


def test_pre_update_gives_each_dropped_completion_a_tensor_of_its_length(tiny_addition):
    """need_old=True (or off-policy), top-entropy and values: with nothing kept, pi_old, the entropies and
    the values are zeros of each completion's length (as the reference's log-probs are), not None."""
    model = tiny_addition[0]
    batch = common.keep_completions(make_batch(list(range(8)), 4), torch.zeros(8))
    args = SimpleNamespace(updates_per_rollout=1, minibatches=1, lora_dropout=0.0, temperature=1.0,
                           top_entropy_quantile=0.5, micro_batch_size=2, micro_batch_tokens=0)
    run = SimpleNamespace(args=args, times={}, model=model, device=torch.device("cpu"), dtype=torch.float32)
    pre = common.pre_update(run, batch, model, values=lambda layout: torch.zeros(layout["mask"].shape),
                            need_old=True)
    for got in (pre.old, pre.ref, pre.entropy, pre.values):
        assert [x.tolist() for x in got] == [[0.0] * len(c) for c in COMPLETIONS]
    args.top_entropy_quantile = 1.0
    pre = common.pre_update(run, batch, need_old=True)
    assert [len(x) for x in pre.old] == [len(c) for c in COMPLETIONS] and pre.entropy == [None] * 8


TWO_RANKS_GROUPS = """import os, sys, types, torch
sys.path[:0] = [{root!r}, os.path.join({root!r}, "tests")]
from transformers import AutoModelForCausalLM
import common
from rlmini import dist
from test_filter import SIGNS, fake_run, group_loss_and_grads, make_batch
torch.set_num_threads(1)
dist.setup_device(types.SimpleNamespace(dtype="float32", dist_timeout=120))
model = dist.shard_model(AutoModelForCausalLM.from_pretrained({path!r}, dtype=torch.float32), torch.float32)
r = dist.rank()
batch = make_batch(list(range(4 * r, 4 * r + 4)), 2)  # rank 0 groups 0 and 1, rank 1 groups 2 and 3
batch = common.keep_completions(batch, torch.tensor({keep}))  # the global batch's: each rank its block
(rows, loss, grads), = group_loss_and_grads(model, fake_run(model, 2, micro_batch_size=1), batch,
                                            signs=SIGNS[4 * r:4 * r + 4])
grads = {{n: dist.full_tensor(g).cpu() for n, g in grads.items()}}
torch.save({{"loss": dist.all_sum(loss) / 2, "grads": grads}}, os.path.join({out!r}, "rank%d.pt" % r))
"""


@pytest.mark.slow
def test_whole_groups_under_torchrun_give_the_one_rank_result(tmp_path, tiny_addition):
    """2 gloo ranks, FSDP2, a loss per group of 2 in micro-batches of 1 (each group one micro-batch): rank 0
    keeps one completion (one micro-batch, then idle), rank 1 all four (two). The normaliser counts the groups
    of both ranks (3), so the loss and the gathered gradient equal one process's on the global batch."""
    import os
    import subprocess
    import sys
    from conftest import ROOT
    keep = [0, 1, 0, 0, 1, 1, 1, 1]
    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS_GROUPS.format(root=ROOT, path=tiny_addition[2], keep=keep, out=str(tmp_path)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(script)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    model = tiny_addition[0]
    batch = common.keep_completions(make_batch(list(range(8)), 2), keep)
    ((_, loss, grads),) = group_loss_and_grads(model, fake_run(model, 2, micro_batch_size=1), batch)
    norm = torch.cat([g.flatten() for g in grads.values()]).norm().item()
    for got in (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)):
        assert got["loss"] == pytest.approx(loss, rel=1e-5)
        for name, g in grads.items():
            assert_grad_close(got["grads"][name], g, rel=1e-5, name=name, floor=norm)
