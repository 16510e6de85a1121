"""RLOO, CoRPO, GPG and PPO: hand-computed advantages, their losses, and short learning runs; every train_*.py
runs a step; the worked examples of docs/algorithms.md (ReMax, distillation, RAFT++) built from its code
blocks' own lines and trained."""
import glob
import json
import importlib
import math
import sys
import os
from types import SimpleNamespace

import pytest
import torch

import common
import train_corpo
import train_gpg
import train_grpo
import train_ppo
import train_rloo
from conftest import ROOT, assert_grad_close, code_blocks, docs_page, mean_of, read_metrics, undocumented
from rlmini import data, packing
from test_train_grpo import SHARED_METRICS, _rows_without_timing, _same


def train(module, tmp_path, *argv):
    return module.main(["--out_dir", str(tmp_path), "--wandb", "false", "--engine", "hf", *argv])


# ---------------------------------------------------------------------------------------------- RLOO


def test_rloo_advantage_is_leave_one_out():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.3, 0.9, 0.1, 0.5])
    a = train_rloo.compute_advantages(r, 4)
    brute = torch.tensor([r[g * 4 + i] - (r[g * 4:(g + 1) * 4].sum() - r[g * 4 + i]) / 3
                          for g in range(2) for i in range(4)])
    torch.testing.assert_close(a, brute)
    assert a[:4].tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])


def test_rloo_needs_two_completions(tmp_path):
    with pytest.raises(SystemExit, match="--group_size 1: must be >= 2"):
        train(train_rloo, tmp_path, "--group_size", "1")


def test_rloo_kl_in_reward_runs_and_keeps_the_loss_kl_free(tmp_path):
    run = train(train_rloo, tmp_path, "--task", "calibration", "--steps", "3", "--prompts_per_step", "8",
                "--beta", "0.1", "--kl_in_reward", "true", "--run_name", "klr")
    rows = read_metrics(run.run_dir)
    assert all(r["kl"] >= 0 for r in rows) and rows[-1]["kl"] > 0
    args = SimpleNamespace(clip_eps=0.2, clip_eps_high=0.0, ratio_level="token", beta=0.1, kl_in_reward=True)
    logp, ref = torch.tensor([[-1.0]]), torch.tensor([[-2.0]])
    token_loss, stats = train_rloo.policy_loss(logp, logp, ref, torch.zeros(1), torch.ones(1, 1), args)
    assert token_loss.item() == 0.0 and stats["kl"].item() > 0  # logged, not in the loss


# ---------------------------------------------------------------------------------------------- CoRPO


def test_corpo_never_rewards_a_failure_where_grpo_does():
    r = torch.tensor([-1.0, -0.8, -0.9, -0.7])  # all failures (threshold 0); mean -0.85
    grpo = train_grpo.compute_advantages(r, 4, std_norm=False)
    corpo = train_corpo.compute_advantages(r, 4, r_min_correct=0.0)
    assert (grpo > 0).sum() == 2  # -0.8 and -0.7 beat the mean: GRPO reinforces them
    assert torch.equal(corpo, r)  # baseline clamped at R_min_correct = 0: every failure negative
    assert (corpo > 0).sum() == 0


def test_corpo_warns_once_on_a_binary_task_and_not_on_a_graded_one(tmp_path, capsys):
    """On a 0/1 reward with R_min_correct 1 CoRPO's advantages are never positive: one warning at start, on
    the terminal as the runs' warnings are, naming the graded tasks; none on a graded task, none when the
    user's --r_min_correct lets a correct reply stand above the baseline, none when another reward part
    (here a format weight) grades the replies."""
    import train_corpo
    base = ["--out_dir", str(tmp_path), "--engine", "hf", "--steps", "1", "--prompts_per_step", "2",
            "--group_size", "2", "--wandb", "false", "--save_every", "-1"]
    for argv, warned in ((["--task", "sums:9"], 1), (["--task", "ordinal"], 0),
                         (["--task", "sums:9", "--r_min_correct", "0.5", "--run_name", "half"], 0),
                         (["--task", "sums:9", "--format_weight", "0.5", "--run_name", "fw"], 0)):
        train_corpo.main([*base, *argv])
        lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("warning: ")]
        assert len(lines) == warned, lines
    train_corpo.main([*base, "--task", "addition", "--run_name", "a"])
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("warning: ")]
    assert line == ("warning: --task addition rewards 0 or 1: CoRPO's baseline max(R_min_correct 1, mean) is "
                    "then 1, so no advantage is positive (0 right, -1 wrong) and the policy only moves away "
                    "from what it sampled; CoRPO is for graded rewards: --task ordinal or sums_graded")


def test_corpo_adaptive_becomes_the_group_mean_and_static_stays():
    r = torch.tensor([1.0, 0.5, 0.8, 0.2])  # mean 0.625 above the threshold 0.5
    assert train_corpo.compute_advantages(r, 4, 0.5).tolist() == pytest.approx([0.375, -0.125, 0.175, -0.425])
    assert train_corpo.compute_advantages(r, 4, 0.5,
                                          "static").tolist() == pytest.approx([0.5, 0.0, 0.3, -0.3])


# ---------------------------------------------------------------------------------------------- GPG


def test_gpg_alpha_on_a_batch_with_degenerate_groups():
    r = torch.tensor([1, 1, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0, 1, 0, 1, 0], dtype=torch.float32)
    adv, alpha = train_gpg.compute_advantages(r, 4)
    assert alpha == 2.0  # B = 16, M = 8 completions in all-equal groups
    expected = 2.0 * torch.tensor([0, 0, 0, 0, -0.25, 0.75, -0.25, -0.25, 0, 0, 0, 0, 0.5, -0.5, 0.5, -0.5])
    torch.testing.assert_close(adv, expected)
    adv, alpha = train_gpg.compute_advantages(r, 4, std_norm=True, eps=0.0)  # F_norm = std
    assert adv[5].item() == pytest.approx(2.0 * 0.75 / 0.5)
    _, alpha = train_gpg.compute_advantages(torch.zeros(8), 4)
    assert alpha == 1.0  # nothing valid: no gradient, no blow-up


def test_gpg_loss_is_the_plain_policy_gradient():
    logp = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv = torch.tensor([2.0, -1.0])
    # no ratio involved
    token_loss, stats = train_gpg.policy_loss(logp, logp.detach() - 5.0, None, adv, mask, None)
    loss = common.aggregate(token_loss, mask, "token-mean", 2, 3, 2)
    (g,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(g, torch.tensor([[-2.0, -2.0], [1.0, 0.0]]) / 3)
    assert stats["clipped"].sum() == 0


def test_groups_split_and_join_round_trip():
    r = data.Rollouts([[1], [1], [2], [2]], [[5, 1], [6], [7, 1], [8]],
                      [[-1.0, -2.0], [-3.0], [-4.0, -5.0], [-6.0]],
                        [True, False, True, False])
    rewards, correct, fmt = torch.tensor([1.0, 0.0, 0.0, 0.0]), torch.tensor([1.0, 0, 0, 0]), torch.ones(4)
    groups = data.split_groups(["a", "b"], r, rewards, correct, fmt, 2)
    assert [g[0] for g in groups] == ["a", "b"] and groups[1][1].completion_ids == [[7, 1], [8]]
    ex, back, rw, cr, fm = data.join_groups(groups[::-1])
    assert ex == ["b", "a"] and back.completion_ids == [[7, 1], [8], [5, 1], [6]]
    assert rw.tolist() == [0.0, 0.0, 1.0, 0.0] and back.finished == [True, False, True, False]


def test_gpg_beta_th_keeps_sampling_until_enough_groups_are_valid(tmp_path):
    run = train(train_gpg, tmp_path, "--steps", "4", "--prompts_per_step", "8", "--beta_th", "0.5",
                "--max_sampling_rounds", "4", "--run_name", "bt")
    rows = read_metrics(run.run_dir)
    B = 8 * 8
    for r in rows:
        assert 1 <= r["sampling/rounds"] <= 4
        assert r["sampling/extra_rollouts"] == (r["sampling/rounds"] - 1) * B
        assert r["gpg/valid_frac"] == pytest.approx(1 / r["gpg/alpha"])
        if r["sampling/rounds"] < 4:  # stopped because the rule was met
            assert r["gpg/valid_frac"] >= 0.5
    assert max(r["sampling/rounds"] for r in rows) > 1  # early on most addition groups are all-wrong
    assert run.data_pos == sum(r["sampling/rounds"] for r in rows) * 8  # extra rounds consume prompts


# ---------------------------------------------------------------------------------------------- PPO


def test_gae_against_hand_computation_with_masks():
    gamma, lam = 0.9, 0.8
    values = torch.tensor([[0.5, 0.2, 0.1], [0.3, 0.4, 9.9]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # second completion has 2 tokens
    adv, ret = train_ppo.compute_advantages(torch.tensor([1.0, -1.0]), values, mask, gamma, lam)
    # completion 1: rewards (0, 0, 1)
    d2 = 1.0 - 0.1
    d1 = 0 + gamma * 0.1 - 0.2
    d0 = 0 + gamma * 0.2 - 0.5
    a2 = d2
    a1 = d1 + gamma * lam * a2
    a0 = d0 + gamma * lam * a1
    # completion 2: rewards (0, -1), the padded value 9.9 must not leak in
    e1 = -1.0 - 0.4
    e0 = gamma * 0.4 - 0.3
    b1, b0 = e1, e0 + gamma * lam * e1
    torch.testing.assert_close(adv, torch.tensor([[a0, a1, a2], [b0, b1, 0.0]]))
    torch.testing.assert_close(ret, (torch.tensor([[a0, a1, a2], [b0, b1, 0.0]]) + values) * mask)
    # gamma = lam = 1: A_t = R - V(s_t), the seeds' setting
    adv, _ = train_ppo.compute_advantages(torch.tensor([1.0, -1.0]), values, mask)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.8, 0.9], [-1.3, -1.4, 0.0]]))


def test_clipped_value_loss_values():
    v, v_old, ret = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.5, 0.0]]), torch.tensor([[2.0, 1.0]])
    mask = torch.ones(1, 2)
    # token 1: unclipped (1-2)^2 = 1, clipped V = 0.7 -> (0.7-2)^2 = 1.69 -> max 1.69; token 2: 1
    assert train_ppo.value_loss(v, v_old, ret, mask, 0.2, 2).item() == pytest.approx(0.5 * (1.69 + 1.0) / 2)
    assert train_ppo.value_loss(v, v_old, ret, mask, 0.0, 2).item() == pytest.approx(0.5 * (1.0 + 1.0) / 2)


@pytest.mark.slow
@pytest.mark.parametrize("lora_rank", [0, 8])
def test_value_loss_falls_on_a_fixed_target(tiny_addition, lora_rank):
    _, tok, path = tiny_addition
    torch.manual_seed(0)
    args = SimpleNamespace(lora_rank=lora_rank, lora_alpha=0.0, lora_targets="all-linear", lora_dropout=0.0,
                           gradient_checkpointing=False, packing=True)
    critic = train_ppo.load_critic(path, torch.device("cpu"), torch.float32, args)
    if lora_rank:  # its own adapters and its whole value head train; the backbone is frozen
        trainable = [n for n, p in critic.named_parameters() if p.requires_grad]
        assert any("score" in n for n in trainable) and all("lora_" in n or "score" in n for n in trainable)
        # the head is not adapted, it trains whole
        assert not any("score" in n and "lora_" in n for n in trainable)
    opt = torch.optim.AdamW(common.trainable_parameters(critic), lr=1e-3)
    batch = packing.make_batch([[4, 13, 5, 14], [6, 13, 7, 14]], [[5, 6, 1], [12, 1]], tok.pad_token_id,
                               torch.device("cpu"))
    target = torch.tensor([[0, 0, 0, 0.3, -0.5, 0.8], [0, 0, 0, 1.0, -1.0, 0]])[:, :batch["mask"].shape[1]]
    target = target * batch["mask"]
    losses = []
    for _ in range(60):
        values = train_ppo.critic_values(critic, batch)
        loss = train_ppo.value_loss(values, values.detach(), target, batch["mask"], 0.0, batch["mask"].sum())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] > 0.1 and losses[-1] < 0.05 * losses[0]


def test_ppo_resume_restores_the_critic(tmp_path):
    opts = ["--steps", "4", "--save_every", "2", "--prompts_per_step", "8", "--task", "calibration",
            "--group_size", "2"]
    train(train_ppo, tmp_path, *opts, "--run_name", "straight")
    train(train_ppo, tmp_path, *opts[:1], "2", *opts[2:], "--run_name", "split")
    train(train_ppo, tmp_path, *opts, "--run_name", "split", "--resume", "true")
    _same(_rows_without_timing(tmp_path / "straight"), _rows_without_timing(tmp_path / "split"))
    a = torch.load(tmp_path / "straight" / "checkpoint.pt", weights_only=False)["algo_state"]
    b = torch.load(tmp_path / "split" / "checkpoint.pt", weights_only=False)["algo_state"]
    for k in a["critic"]["model"]:
        assert torch.equal(a["critic"]["model"][k], b["critic"]["model"][k]), k
    assert a["critic"]["optimizer"]["state"].keys() == b["critic"]["optimizer"]["state"].keys()


def test_ppo_critic_warmup_keeps_the_policy_still(tmp_path):
    run = train(train_ppo, tmp_path, "--steps", "2", "--critic_warmup", "2", "--task", "calibration",
                "--prompts_per_step", "8", "--run_name", "warm")
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(run.model_path)
    for (n, a), (_, b) in zip(base.named_parameters(), run.model.named_parameters()):
        assert torch.equal(a, b.detach()), n
    critic = run.critic
    assert critic.score.weight.abs().sum() > 0  # the critic trained (its head starts at 0)


# ---------------------------------------------------------------------------------------------- learning


@pytest.mark.slow
@pytest.mark.parametrize("module,extra", [
    (train_rloo, []),
    (train_gpg, []),
    (train_ppo, []),
    (train_ppo, ["--group_size", "1", "--prompts_per_step", "128"]),  # classic PPO: one completion per prompt
])
def test_each_algorithm_learns_addition(tmp_path, module, extra):
    run = train(module, tmp_path, "--steps", "150", "--run_name", "learn", *extra)
    rows = read_metrics(run.run_dir)
    assert SHARED_METRICS <= set(rows[0]) and not undocumented(rows[0], run.algo)  # docs/metrics.md names all
    start, end = mean_of(rows, "reward/mean", 0, 10), mean_of(rows, "reward/mean", 130, 150)
    assert end > start + 0.15, (start, end)


@pytest.mark.slow
def test_corpo_and_grpo_learn_ordinal_and_only_grpo_rewards_failures(tmp_path):
    corpo = read_metrics(train(train_corpo, tmp_path, "--task", "ordinal", "--steps", "150", "--run_name",
                               "c").run_dir)
    grpo = read_metrics(
        train(train_grpo, tmp_path, "--task", "ordinal", "--steps", "150", "--run_name", "g").run_dir
    )
    for rows in (corpo, grpo):
        start, end = mean_of(rows, "reward/mean", 0, 10), mean_of(rows, "reward/mean", 130, 150)
        assert end > start + 0.4, (start, end)
    fpf = lambda rows: [r["adv/failed_pos_frac"] for r in rows if "adv/failed_pos_frac" in r]
    assert max(fpf(corpo)) == 0.0  # by construction
    assert mean_of([{"x": v} for v in fpf(grpo)], "x", 0, 10) > 0.05  # seed 004 Fig. 1: 18% early in GRPO


# ---------------------------------------------------------------------------------------------- every script


def loop_metrics(row: dict) -> set:
    """What the loop logs of any script's step (rlmini/metrics.py::step_metrics): reward/*, len/*, time/*,
    perf/tokens_per_s always; loss/policy, grad_norm and entropy when an update happened (a filter may leave
    none: filter/empty_updates; --on_nonfinite skip: nonfinite/skipped). An algorithm's own (adv/*, clip_frac)
    are the script's to test."""
    always = {"reward/mean", "reward/std", "reward/correct", "reward/format", "len/mean", "len/truncated",
              "time/rollout", "time/update", "time/push", "perf/tokens_per_s"}
    updated = not row.get("filter/empty_updates") and not row.get("nonfinite/skipped")
    return always | ({"loss/policy", "grad_norm", "entropy"} if updated else set())


SCRIPTS = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "train_*.py")))
SHIPPED = ("train_grpo", "train_ppo", "train_rloo", "train_gpg", "train_corpo")


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_runs_a_step(tmp_path, script):
    """Every train_*.py found (a new one too): a step on the HF engine with the flags its Args.smoke_flags
    declares, every logged metric named in docs/metrics.md or the script's own page (Args.docs_page)."""
    module = importlib.import_module(script)
    try:
        run = train(module, tmp_path, "--steps", "1", "--prompts_per_step", "4", "--group_size", "2",
                    *module.Args.smoke_flags)
    except (Exception, SystemExit) as e:
        raise AssertionError(f"{script}.py: one step failed ({e}); if it needs flags, set Args.smoke_flags "
                             f"in {script}.py") from e
    rows = read_metrics(run.run_dir)
    assert len(rows) == 1, f"{script}.py: {len(rows)} rows of metrics for one step"
    lacks = sorted(loop_metrics(rows[0]) - set(rows[0]))
    assert not lacks, f"{script}.py: the loop's metrics {lacks} are not logged (common.step_metrics)"
    if script in SHIPPED:  # the five of the product log the algorithms' shared metrics too (adv/*, clip_frac)
        lacks = sorted(SHARED_METRICS - set(rows[0]))
        assert not lacks, f"{script}.py: the shared metrics {lacks} are not logged"
    missing = undocumented(rows[0], run.algo, docs_page(script))
    assert not missing, f"{script}.py: metrics {missing} are named neither in docs/metrics.md nor in " \
                        f"{docs_page(script)}; add them there"


DOCS = None  # in an edit of EXAMPLES: the worked example's next run of lines in docs/algorithms.md

# {name: edits of the copied script, in the docs' order}: (the key of a line, or of its first and last lines,
# DOCS) puts the docs' next run in their place, (key, "") deletes them (the docs say so in words), (old, new)
# replaces text, new as the docs' prose gives it
EXAMPLES = {
    "remax": [("batch = common.rollout(", DOCS), ("advantages = compute_advantages(common.all_gather", DOCS),
              ("metrics = common.step_metrics(", DOCS), ('algo="rloo"', 'algo="remax"'),
              ("min_group_size: ClassVar[int] = 2  # the group baseline needs two completions of a prompt",
               "min_group_size: ClassVar[int] = 1")],
    "distill": [(('"""RLOO (Kool', "unbiased advantage (Bereket"), DOCS), ("kl_in_reward: bool", DOCS),
                ("min_group_size", DOCS), (("def compute_advantages(", "return advantages.flatten()"), DOCS),
                ("adv = advantages.unsqueeze(1)", DOCS), ("token_loss = token_loss + (0.0 if", DOCS),
                ("ref_model = common.load_reference(", DOCS), ("pre = common.pre_update(", DOCS),
                (("rewards = batch.rewards", "local = advantages["), DOCS),
                ("token_loss, info = policy_loss(", DOCS), ("metrics = common.step_metrics(", DOCS),
                ('algo="rloo"', 'algo="distill"')],
    "raft": [(('"""RLOO (Kool', "python train_rloo.py --model"), DOCS), ("kl_in_reward: bool", ""),
             ("min_group_size", DOCS), (("def compute_advantages(", "return advantages.flatten()"), DOCS),
             ("token_loss = token_loss + (0.0 if", DOCS), ("batch = common.rollout(", DOCS),
             (("run.engine.sleep()", "local = advantages["), DOCS), ("token_loss, info = policy_loss(", DOCS),
             ("metrics = common.step_metrics(", DOCS), ('algo="rloo"', 'algo="raft"')],
    "vineppo": [(('"""RLOO (Kool', "python train_rloo.py --model"), DOCS), ("kl_in_reward: bool", DOCS),
                ("min_group_size", DOCS), (("def compute_advantages(", "return advantages.flatten()"), DOCS),
                ("adv = advantages.unsqueeze(1)", DOCS), ("token_loss = token_loss + (0.0 if", DOCS),
                ("batch = common.rollout(", DOCS), (("run.engine.sleep()", "pre = common.pre_update("), DOCS),
                (("# ---- ALGORITHM: advantages over", "local = advantages["), DOCS),
                ("token_loss, info = policy_loss(", DOCS), ("metrics = common.step_metrics(", DOCS),
                ('algo="rloo"', 'algo="vineppo"')],
    "onlinedpo": [(('"""RLOO (Kool', "python train_rloo.py --model"), DOCS),
                  (("loss_agg: Literal", "kl_in_reward: bool"), DOCS), ("min_group_size", DOCS),
                  (("def compute_advantages(", "return advantages.flatten()"), DOCS),
                  (("def policy_loss(", "return token_loss, stats"), DOCS),
                  ("ref_model = common.load_reference(", DOCS), ("batch = common.rollout(", DOCS),
                  (("run.engine.sleep()", "local = advantages["), DOCS),
                  ("for mb in common.minibatches(", DOCS),
                  (("old = pre.old_logp(", "run.max_new_tokens)"), DOCS), ("stats.add(micro", DOCS),
                  ("metrics = common.step_metrics(", DOCS), ('algo="rloo"', 'algo="onlinedpo"')],
    "sapo": [("surrogate: Literal[", DOCS), ('stats["clipped"] = (ratio > 1 + eps_high)', DOCS),
             ('algo="grpo"', 'algo="sapo"')],
    "gmpo": [("clip_eps: float = arg(", DOCS), ("surrogate: Literal[", DOCS),
             ('raise ValueError("--std_level batch', DOCS),
             ('stats["clipped"] = (ratio > 1 + eps_high)', DOCS), ('algo="grpo"', 'algo="gmpo"')],
    "clipcov": [("max_sampling_rounds: int", DOCS), ("def policy_loss(", DOCS),
                ('stats["clipped"] = (ratio > 1 + eps_high)', DOCS), ("pre = common.pre_update(", DOCS),
                ("local = advantages[common.local_slice", DOCS),
                (("token_loss, info = policy_loss(", "micro.loss_mask, args, is_weight)"), DOCS),
                ('algo="grpo"', 'algo="clipcov"')],
    "klcov": [("surrogate: Literal[", DOCS), ('raise ValueError("--std_level batch', DOCS),
              ("def policy_loss(", DOCS),
              ('stats["clipped"] = (ratio > 1 + eps_high)', DOCS), ("pre = common.pre_update(", DOCS),
              ("local = advantages[common.local_slice", DOCS),
              (("token_loss, info = policy_loss(", "micro.loss_mask, args, is_weight)"), DOCS),
              ('algo="grpo"', 'algo="klcov"')],
    "luspo": [(("loss_agg: Literal", '"loss aggregation: GRPO'), ""), ("ratio_level: Literal", DOCS),
              (("loss = common.aggregate(", "run.max_new_tokens)"), DOCS), ('algo="grpo"', 'algo="luspo"')],
    "vespo": [(("loss_agg: Literal", '"loss aggregation: GRPO'), DOCS), ("surrogate: Literal[", DOCS),
              ('stats["clipped"] = (ratio > 1 + eps_high)', DOCS), ('algo="grpo"', 'algo="vespo"')],
}


def hunks(lines: list) -> list:
    """A code block's lines split at its `...` lines (the script's lines it leaves out)."""
    out = [[]]
    for line in lines:
        out[-1].append(line) if line.strip() != "..." else out.append([])
    return [h for h in out if h]


def worked_example(name: str, tmp_path=None) -> str:
    """train_<name>.py built from the code blocks docs/algorithms.md shows after `cp train_X.py
    train_<name>.py`: each run of their lines that train_X.py lacks (with the script's line just before it in
    the block, if any) goes where EXAMPLES[name] says; then each block's hunks must be lines of the result, in
    order. Its text, also written to tmp_path/train_<name>.py if given."""
    blocks = [b for b in code_blocks("docs/algorithms.md") if b.copy and b.copy[1] == f"train_{name}.py"]
    text = open(os.path.join(ROOT, blocks[0].copy[0])).read()
    docs = open(os.path.join(ROOT, "docs", "algorithms.md")).read()
    known, runs = {line for line in text.splitlines() if line.strip()}, []
    for hunk in (h for b in blocks for h in hunks(b.lines)):
        for i, line in enumerate(hunk):
            if line in known:
                continue
            if i and hunk[i - 1] not in known:
                runs[-1].append(line)
            else:
                runs.append(hunk[i - 1:i + 1] if i else [line])
    for old, new in EXAMPLES[name]:
        if new is not DOCS and new:
            assert text.count(old) == 1 and new in docs, (name, old, new)
            text = text.replace(old, new)
            continue
        lines = text.splitlines(keepends=True)
        keys = [old] if isinstance(old, str) else old
        at = [[i for i, line in enumerate(lines) if key in line] for key in keys]
        assert all(len(i) == 1 for i in at), f"{name}: {old} is not one line of the script: {at}"
        assert new == "" or runs, f"{name}: {old}: docs/algorithms.md has no run of lines left for it"
        text = "".join(lines[:at[0][0]] + [line + "\n" for line in (runs.pop(0) if new is DOCS else [])]
                       + lines[at[-1][0] + 1:])
    assert not runs, f"docs/algorithms.md: the {name} example's lines {runs} have no place in EXAMPLES"
    for block in blocks:
        at = 0
        for hunk in hunks(block.lines):
            at = ("\n" + text).find("\n" + "\n".join(hunk) + "\n", at) + 1
            assert at, f"docs/algorithms.md:{block.line}: not lines of train_{name}.py as built: {hunk}"
    if tmp_path is not None:
        (tmp_path / f"train_{name}.py").write_text(text)
    return text


def test_a_remax_script_written_as_the_docs_say_trains_on_its_greedy_baseline(tmp_path, monkeypatch):
    """train_rloo.py copied, with the ReMax lines of docs/algorithms.md (the greedy completion's reward as
    each prompt's baseline, from one common.generate call before the sleep): it trains with one sample per
    prompt or several, and its advantages are the rewards less the baselines."""
    worked_example("remax", tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "train_remax", raising=False)  # another test's module of that name
    remax = importlib.import_module("train_remax")
    for G in (1, 3):
        run = train(remax, tmp_path, "--steps", "1", "--prompts_per_step", "8", "--group_size", str(G),
                    "--format_weight", "0.5", "--run_name", f"g{G}")
        (r,) = read_metrics(run.run_dir)
        assert r["adv/mean"] == pytest.approx(r["reward/mean"] - r["remax/baseline"], abs=1e-6)
        assert run.algo == "remax" and run.extra_calls == (0, 1)  # one call of its own in the step


def test_a_distillation_script_written_as_the_docs_say_lowers_its_reverse_kl(tmp_path, monkeypatch):
    """train_rloo.py copied, with the on-policy distillation lines of docs/algorithms.md (common.load_frozen,
    common.logprobs, per-token advantages): the student's reverse KL to a teacher (the tiny model with another
    output layer) falls by half in 10 steps (measured: 8.6 -> 3.7 and 8.7 -> 4.3 nats per token, seeds 0 and
    1; asserted: below 0.7x)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from rewards import load_task
    from rlmini import models
    worked_example("distill", tmp_path)
    student = models.build_tiny_model(load_task("addition").alphabet)
    teacher = AutoModelForCausalLM.from_pretrained(student)
    with torch.no_grad():  # another output layer, 4x sharper: a reverse KL of ~8.6 nats per token at start
        w = teacher.get_output_embeddings().weight
        w.add_(torch.randn(w.shape, generator=torch.Generator().manual_seed(0)) * w.std()).mul_(4.0)
    teacher.save_pretrained(tmp_path / "teacher")
    models.load_tokenizer(student).save_pretrained(tmp_path / "teacher")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "train_distill", raising=False)
    distill = importlib.import_module("train_distill")
    run = train(distill, tmp_path, "--steps", "10", "--prompts_per_step", "16", "--group_size", "2",
                "--lr", "1e-3", "--teacher", str(tmp_path / "teacher"))
    kl = [r["distill/reverse_kl"] for r in read_metrics(run.run_dir)]
    print("reverse KL per step", [round(k, 4) for k in kl])
    assert run.algo == "distill" and min(kl) > 0
    assert sum(kl[-2:]) / 2 < 0.7 * sum(kl[:2]) / 2, kl
    frozen = common.load_frozen(run, str(tmp_path / "teacher"))
    assert not frozen.training and not any(p.requires_grad for p in frozen.parameters())
    assert run.plan["reference"] == sum(p.numel() * p.element_size() for p in frozen.parameters())  # declared
    # bad input: one line each, naming the model (and the policy's, for a tokenizer)
    tokenizer = models.load_tokenizer(student)
    tokenizer.add_tokens(["<extra>"])
    tokenizer.save_pretrained(tmp_path / "teacher")
    with pytest.raises(SystemExit, match=r"teacher: its tokenizer is not the policy's \(tiny\): another"):
        common.load_frozen(run, str(tmp_path / "teacher"))
    AutoModelForSequenceClassification.from_config(teacher.config).save_pretrained(tmp_path / "scorer")
    with pytest.raises(SystemExit, match="scorer: a Qwen3ForSequenceClassification, not a causal LM"):
        common.load_frozen(run, str(tmp_path / "scorer"))
    with pytest.raises(SystemExit, match="nowhere: no such file or folder"):
        common.load_frozen(run, str(tmp_path / "nowhere"))


def test_a_raft_script_written_as_the_docs_say_trains_on_the_correct_completions_only(tmp_path, monkeypatch):
    """train_rloo.py copied, with the RAFT++ lines of docs/algorithms.md (common.keep_completions), on the
    rollout double (a quarter of the completions correct; at step 2 none): step 1 computes the correct
    completions only, in pi_old's pass and the update (its loss is -1: the ratio is 1 on-policy), a share
    of RLOO's tokens on the same batch; step 2 keeps nothing, computes nothing, and moves no weight nor the
    optimizer's state, logging filter/empty_updates 1, no update metric, and no collapse."""
    from rlmini import batches
    from rlmini.engine import HFEngine
    from rollout_double import generate_double, with_trainer_logprobs
    worked_example("raft", tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "train_raft", raising=False)
    raft = importlib.import_module("train_raft")
    calls, computed, before = [], [], {}

    def double(engine, *a, **k):  # the second call (step 2): every completion unfinished, so wrong
        r = generate_double(engine, *a, **k)
        calls.append(len(calls))
        if len(calls) == 2:
            nine = engine.tokenizer.convert_tokens_to_ids("9")
            r.completion_ids, r.finished = [[nine] * 3 for _ in r.completion_ids], [False] * len(r.finished)
            r = with_trainer_logprobs(r, engine.model, 1.0, engine.device, engine.dtype)
            before.update({n: p.detach().clone() for n, p in engine.model.named_parameters()})
        computed.append([])
        return r

    micro_batch = batches.micro_batch
    monkeypatch.setattr(HFEngine, "generate", double)
    monkeypatch.setattr(batches, "micro_batch", lambda batch, rows, *a, **k: computed[-1].append(list(rows))
                        or micro_batch(batch, rows, *a, **k))
    argv = ["--prompts_per_step", "8", "--group_size", "4", "--micro_batch_size", "4", "--log_completions",
            "32", "--run_name", "raft"]
    run = train(raft, tmp_path, "--steps", "2", *argv)
    one, two = read_metrics(run.run_dir)
    logged = [json.loads(line) for line in open(os.path.join(run.run_dir, "rollouts.jsonl"))]
    correct = [x["index"] for x in logged if x["step"] == 1 and x["correct"] > 0]
    assert all(x["kept"] == (x["correct"] > 0) for x in logged) and 0 < len(correct) < 32
    assert one["filter/kept_frac"] == len(correct) / 32 and 0 < one["filter/kept_groups"] <= 1
    assert sorted(i for rows in computed[0] for i in rows) == sorted(correct * 2)  # pi_old pass, update
    assert one["filter/empty_updates"] == 0 and one["loss/policy"] == pytest.approx(-1.0, abs=1e-6)
    assert one["clip_frac"] == 0 and one["kl/old"] == pytest.approx(0, abs=1e-6) and one["grad_norm"] > 0
    assert "adv/mean" not in one and "sampling/kept_zero_std" not in one
    # step 2: nothing kept, nothing computed, nothing moved
    assert computed[1] == [] and two["filter/kept_frac"] == 0 and two["filter/empty_updates"] == 1
    update = {"loss/policy", "grad_norm", "entropy", "logprob/sampler_diff", "is/mean", "clip_frac", "kl/old"}
    assert not update & set(two) and two["perf/update_tokens"] == 0 and two["nonfinite/skipped"] == 0
    assert all(torch.equal(before[n], p.detach()) for n, p in run.model.named_parameters())
    assert [s["step"].item() for s in run.optimizer.state.values()] == [1] * len(run.optimizer.state)
    assert run.scheduler.last_epoch == 1 and run.quiet_steps == 0 and run.skipped_steps == 0
    # RLOO on the same batch computes every completion: RAFT's share of its update tokens
    calls.clear()
    rloo = read_metrics(train(train_rloo, tmp_path, "--steps", "1", *argv[:-1], "rloo").run_dir)[0]
    share = one["perf/update_tokens"] / rloo["perf/update_tokens"]
    print(f"RAFT computes {share:.3f} of RLOO's update tokens ({len(correct)} of 32 completions kept)")
    assert len(correct) / 32 <= share < 0.5


def test_a_vineppo_script_written_as_the_docs_say_values_each_chunk_by_its_continuations(tmp_path,
                                                                                         monkeypatch):
    """train_rloo.py copied, with the VinePPO lines of docs/algorithms.md (common.generate with prefixes):
    each step continues M times from every chunk start of its completions (the empty prefix included), and the
    logged advantages are, token by token, V(next chunk) - V(own chunk) computed here from the continuations'
    rewards (the last chunk's next value: the completion's reward); compute_advantages by hand."""
    worked_example("vineppo", tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "train_vineppo", raising=False)
    vineppo = importlib.import_module("train_vineppo")
    values, rewards = [torch.tensor([0.25, 0.5]), torch.tensor([0.75])], torch.tensor([1.0, 0.0])
    adv = vineppo.compute_advantages(values, rewards, [[0, 2], [0]], torch.tensor([5.0, 1.0]))
    assert [a.tolist() for a in adv] == [[0.25, 0.25, 0.5, 0.5, 0.5], [-0.75]]
    seen = []
    rollout, generate = common.rollout, common.generate
    monkeypatch.setattr(common, "rollout", lambda *a, **k: seen.append(rollout(*a, **k)) or seen[-1])
    monkeypatch.setattr(common, "generate",
                        lambda *a, **k: seen.append((a, k, generate(*a, **k))) or seen[-1][2])
    run = train(vineppo, tmp_path, "--steps", "2", "--prompts_per_step", "4", "--group_size", "2", "--chunks",
                "3", "--continuations", "3", "--format_weight", "0.5", "--max_new_tokens", "6")
    rows = read_metrics(run.run_dir)
    assert run.algo == "vineppo" and len(seen) == 4 and len(rows) == 2
    for step, (batch, ((_, examples, n), kwargs, vines), r) in enumerate(zip(seen[::2], seen[1::2], rows)):
        starts = [sorted({len(c) * i // 3 for i in range(3)}) for c in batch.rollouts.completion_ids]
        prefixes = [c[:s] for c, js in zip(batch.rollouts.completion_ids, starts) for s in js]
        assert n == 3 and kwargs["prefixes"] == prefixes and len(vines) == 3 * len(prefixes)
        owners = [j for j, js in enumerate(starts) for _ in js]
        assert [e["prompt"] for e in examples] == [batch.examples[j // 2]["prompt"] for j in owners]
        values, at, tokens = vines.rewards.view(-1, 3).mean(1).tolist(), 0, []
        for j, js in enumerate(starts):
            v = values[at:at + len(js)] + [batch.rewards[j].item()]
            ends = js[1:] + [len(batch.rollouts.completion_ids[j])]
            tokens += [v[i + 1] - v[i] for i in range(len(js)) for _ in range(ends[i] - js[i])]
            at += len(js)
        assert r["adv/mean"] == pytest.approx(sum(tokens) / len(tokens), abs=1e-6)
        assert r["vineppo/continuations"] == len(vines) and r["grad_norm"] > 0
        v0 = [values[sum(map(len, starts[:j]))] for j in range(len(starts))]
        assert r["vineppo/v0"] == pytest.approx(sum(v0) / len(v0), abs=1e-6)


def test_an_online_dpo_script_written_as_the_docs_say_takes_the_textbook_dpo_gradient(tmp_path, monkeypatch):
    """train_rloo.py copied, with the online DPO lines of docs/algorithms.md (whole groups, a loss per pair):
    its pairs by hand; on one step (the reference perturbed, so that the margins are not 0; the optimizer
    step replaced by a record of the gradient) each minibatch's gradient is the textbook DPO gradient of its
    pairs, -log sigmoid(beta [(log pi(y_w) - log ref(y_w)) - (log pi(y_l) - log ref(y_l))]) averaged over
    them, log pi(y) summed over y's tokens in a plain forward, for micro-batches of 64 and 1 completions
    (--minibatches 1) and of 3 (--minibatches 2); the shared options it does not apply are refused in one
    line."""
    from transformers import AutoModelForCausalLM
    worked_example("onlinedpo", tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "train_onlinedpo", raising=False)
    dpo = importlib.import_module("train_onlinedpo")
    pairs = dpo.compute_pairs(torch.tensor([0.5, 1.0, 0.0, 1.0, 0.3, 0.3, 0.3, 0.3, 0.2, 0.0, 0.9, 0.1]), 4)
    assert pairs.tolist() == [0, 1, -1, 0, 0, 0, 0, 0, 0, -1, 1, 0]  # ties: the first; all equal: no pair
    with pytest.raises(SystemExit, match="^--entropy_coef: train_onlinedpo.py does not apply this shared"):
        dpo.main(["--entropy_coef", "0.01"])
    seen, load_reference, keep_completions = {}, common.load_reference, common.keep_completions

    def perturbed(run):  # the reference another model than the policy: DPO's margins are not 0
        ref = load_reference(run)
        with torch.no_grad():
            for p in ref.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.02)
        return seen.setdefault("ref", ref)

    def record(run, stats):  # each minibatch's gradient; no step: every minibatch sees the same weights
        seen["grads"].append({n: p.grad.clone() for n, p in run.model.named_parameters()
                              if p.grad is not None})
        run.optimizer.zero_grad(set_to_none=True)
    monkeypatch.setattr(common, "load_reference", perturbed)
    monkeypatch.setattr(common, "optimizer_step", record)
    monkeypatch.setattr(common, "keep_completions", lambda batch, keep: seen.update(
        batch=keep_completions(batch, keep)) or seen["batch"])
    minibatches = common.minibatches
    monkeypatch.setattr(common, "minibatches", lambda *a, **k: (seen["rows"].append(mb.rows) or mb
                                                                 for mb in minibatches(*a, **k)))
    plain = {}
    for m, size in ((1, 64), (1, 1), (2, 3)):
        seen.update(grads=[], rows=[])
        run = train(dpo, tmp_path, "--steps", "1", "--prompts_per_step", "8", "--group_size", "4",
                    "--format_weight", "0.5", "--beta", "0.5", "--micro_batch_size", str(size),
                    "--minibatches", str(m), "--run_name", f"m{m}-{size}", "--save_every", "-1")
        batch, rewards = seen["batch"], seen["batch"].rewards.view(-1, 4)
        pairs = {g: (4 * g + int(rewards[g].argmax()), 4 * g + int(rewards[g].argmin())) for g in range(8)
                 if rewards[g].max() > rewards[g].min()}  # group: (y_w, y_l)
        assert batch.kept.nonzero().flatten().tolist() == sorted(i for p in pairs.values() for i in p)
        assert len(seen["grads"]) == len(seen["rows"]) == m and 0 < len(pairs) < 8
        if not plain:  # the policy and the reference in plain HF forwards: the same weights
            for name, model in (("policy", run.model), ("ref", seen["ref"])):
                plain[name] = AutoModelForCausalLM.from_config(run.model.config).float()
                plain[name].load_state_dict(model.state_dict())
        for rows, grads in zip(seen["rows"], seen["grads"]):
            r = batch.rollouts
            plain["policy"].zero_grad(set_to_none=True)

            def logp(model, i):  # log pi(y) summed over y's tokens
                ids = torch.tensor([r.prompt_ids[i] + r.completion_ids[i]])
                out = model(input_ids=ids).logits[0, len(r.prompt_ids[i]) - 1:-1].log_softmax(-1)
                return out.gather(1, ids[0, len(r.prompt_ids[i]):, None]).sum()
            losses = []
            for w, l in (pairs[g] for g in sorted({i // 4 for i in rows}) if g in pairs):
                with torch.no_grad():
                    ref = logp(plain["ref"], w) - logp(plain["ref"], l)
                margin = logp(plain["policy"], w) - logp(plain["policy"], l) - ref
                losses.append(-torch.nn.functional.logsigmoid(0.5 * margin))
            torch.stack(losses).mean().backward()
            want = {n: p.grad for n, p in plain["policy"].named_parameters() if p.grad is not None}
            norm = torch.cat([g.flatten() for g in want.values()]).norm().item()
            assert norm > 0 and grads.keys() == want.keys(), (m, size)
            for name in grads:
                assert_grad_close(grads[name], want[name], rel=1e-5, name=f"{m} {size} {name}", floor=norm)


def test_a_sapo_script_written_as_the_docs_say_gates_the_ratio_softly(tmp_path, monkeypatch):
    """train_grpo.py copied, with the SAPO lines of docs/algorithms.md: policy_loss is -f(r) A, f(r) =
    sigmoid(tau (r - 1)) 4 / tau with tau by the advantage's sign, its gradient in log pi f'(r) r A; 2 steps
    whose logged loss is -(2 / tau_i) A_i averaged over the completions (on-policy r = 1 at every token)."""
    worked_example("sapo", tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "train_sapo", raising=False)
    sapo = importlib.import_module("train_sapo")
    args = sapo.Args(surrogate="sapo", tau_pos=1.0, tau_neg=3.0)
    g = torch.Generator().manual_seed(0)
    logp, old = torch.randn(3, 4, generator=g).requires_grad_(), torch.randn(3, 4, generator=g)
    adv, mask = torch.tensor([1.5, -0.5, 0.0]), torch.ones(3, 4)
    loss, info = sapo.policy_loss(logp, old, None, adv, mask, args)
    r, tau = torch.exp(logp - old).detach(), torch.tensor([1.0, 3.0, 3.0])[:, None]
    gate = torch.sigmoid(tau * (r - 1))
    torch.testing.assert_close(loss, -gate * 4 / tau * adv[:, None])
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, -4 * gate * (1 - gate) * r * adv[:, None])  # d f(r) / d log pi
    assert not info["clipped"].any()
    seen, compute = [], sapo.compute_advantages
    monkeypatch.setattr(sapo, "compute_advantages",
                        lambda *a, **k: seen.append(compute(*a, **k)) or seen[-1])
    run = train(sapo, tmp_path, "--steps", "2", "--prompts_per_step", "8", "--group_size", "4", "--surrogate",
                "sapo", "--tau_pos", "1", "--tau_neg", "3", "--format_weight", "0.5", "--micro_batch_size",
                "5")
    rows = read_metrics(run.run_dir)
    assert run.algo == "sapo" and len(rows) == len(seen) == 2
    for a, row in zip(seen, rows):
        assert a.abs().sum() > 0
        want = (-2 / torch.where(a > 0, 1.0, 3.0) * a).mean().item()
        assert row["loss/policy"] == pytest.approx(want, abs=1e-6) and row["clip_frac"] == 0


def load_example(name: str, tmp_path, monkeypatch):
    """The train_<name>.py a test just built into tmp_path (worked_example), imported afresh."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, f"train_{name}", raising=False)  # another test's module of that name
    return importlib.import_module(f"train_{name}")


def record_advantages(module, monkeypatch, shift: float = 0.0) -> list:
    """Each step's advantages (compute_advantages' output), moved by `shift` where given: a baseline off the
    group mean, so that a loss averaged over completions is not 0 on-policy."""
    seen, compute = [], module.compute_advantages
    monkeypatch.setattr(module, "compute_advantages",
                        lambda *a, **k: seen.append(compute(*a, **k) + shift) or seen[-1])
    return seen


def record_batches(monkeypatch) -> list:
    """Each step's batch as common.pre_update receives it (lengths, in_loss, kept: a hand loss's inputs)."""
    batches, pre_update = [], common.pre_update
    monkeypatch.setattr(common, "pre_update",
                        lambda run, batch, *a, **k: batches.append(batch) or pre_update(run, batch, *a, **k))
    return batches


def test_a_gmpo_script_written_as_the_docs_say_takes_the_geometric_mean_of_the_clipped_ratios(tmp_path,
                                                                                          monkeypatch):
    """train_grpo.py copied, with the GMPO lines of docs/algorithms.md: policy_loss is -A (prod_t
    clip(r_t))^(1/|o|) on every token, r_t clipped to (e^-0.4, e^0.4) on the side the sign of A makes
    pessimistic (verl's sgn(A) min(sgn(A) log r, sgn(A) clip(log r))), its gradient that of the mean over
    completions, zero through a clipped token, counted clipped only where A is not 0 (as verl); another
    --loss_agg and --top_entropy_quantile are refused; 2 steps (advantages moved off the group mean) whose
    logged loss is -A averaged over the completions (on-policy every ratio is 1)."""
    import math
    worked_example("gmpo", tmp_path)
    gmpo = load_example("gmpo", tmp_path, monkeypatch)
    with pytest.raises(ValueError, match="--surrogate gmpo averages over completions"):
        gmpo.Args(loss_agg="token-mean")
    with pytest.raises(ValueError, match="no --top_entropy_quantile"):
        gmpo.Args(top_entropy_quantile=0.2)
    args = gmpo.Args()  # --surrogate gmpo --clip_eps 0.4, the defaults
    g = torch.Generator().manual_seed(0)
    logp = (torch.randn(3, 5, generator=g) * 0.5).requires_grad_()
    old = logp.detach() + torch.randn(3, 5, generator=g) * 0.4
    adv, mask = torch.tensor([1.5, -0.5, 0.0]), torch.tensor([[1, 1, 1, 1, 0], [1.0] * 5, [1, 1, 0, 0, 0]])
    loss, info = gmpo.policy_loss(logp, old, None, adv, mask, args)
    r, a = torch.exp(logp - old), adv[:, None]
    clip = torch.clamp(r, math.exp(-0.4), math.exp(0.4))
    sided = torch.where(mask > 0, torch.where(a > 0, torch.minimum(r, clip), torch.maximum(r, clip)), 1.0)
    want = -sided.prod(1) ** (1 / mask.sum(1)) * adv
    torch.testing.assert_close(loss, want[:, None].expand(3, 5))
    (got,) = torch.autograd.grad(common.aggregate(loss, mask, "seq-mean-token-mean", 3, 12, 5), logp)
    (grad,) = torch.autograd.grad(want.mean(), logp)
    torch.testing.assert_close(got, grad)
    cut = (torch.where(mask > 0, sided, r) != r) & (a != 0)
    assert (r[2, :2] < math.exp(-0.4)).any()  # A = 0 there: the clamp moves it, but it is no clip (verl)
    assert cut.any() and torch.equal(info["clipped"], cut.float())
    assert (got[cut] == 0).all() and (got[~cut & (mask > 0) & (a != 0)] != 0).all()
    seen = record_advantages(gmpo, monkeypatch, shift=0.3)
    run = train(gmpo, tmp_path, "--steps", "2", "--prompts_per_step", "4", "--group_size", "4",
                "--format_weight", "0.5", "--micro_batch_size", "8")
    rows = read_metrics(run.run_dir)
    assert run.algo == "gmpo" and len(rows) == len(seen) == 2
    for a, row in zip(seen, rows):
        assert row["loss/policy"] == pytest.approx(-a.mean().item(), abs=1e-6) and row["clip_frac"] == 0


def test_a_clipcov_script_written_as_the_docs_say_cuts_the_chosen_tokens_for_any_micro_batch(tmp_path,
                                                                                          monkeypatch):
    """train_grpo.py copied, with the Clip-Cov lines of docs/algorithms.md: policy_loss with --beta cuts the
    chosen tokens' clipped surrogate, not their k3 KL, and so its gradient; 2 steps (a wide band, r 0.3, so
    that exactly ceil(r N) tokens are cut; the optimizer step replaced by a record of the gradient) on
    micro-batches of 64 and of 6 completions: each step's logged loss is the hand computation's from the
    tokens common.cov_tokens chose, -A_i (1 - cut_i / |o_i|) averaged over the completions (on-policy every
    ratio is 1), and its gradient is the same for both sizes (the choice is made over the global batch before
    the micro-batches).
    """
    worked_example("clipcov", tmp_path)
    clipcov = load_example("clipcov", tmp_path, monkeypatch)
    args = clipcov.Args(beta=0.04)
    g = torch.Generator().manual_seed(3)
    logp = (torch.randn(3, 4, generator=g) * 0.5).requires_grad_()
    old = logp.detach() + torch.randn(3, 4, generator=g) * 0.3
    ref = logp.detach() + torch.randn(3, 4, generator=g)
    cut, adv = (torch.rand(3, 4, generator=g) > 0.5).float(), torch.tensor([1.5, -0.5, 1.0])
    mask = torch.ones(3, 4)
    loss, info = clipcov.policy_loss(logp, old, ref, adv, mask, args, None, cut)
    r, a, d = torch.exp(logp - old).detach(), adv[:, None], (ref - logp).detach()
    surrogate = -torch.minimum(r * a, r.clamp(0.8, 1.2) * a)
    torch.testing.assert_close(loss, surrogate * (1 - cut) + 0.04 * (torch.exp(d) - d - 1))
    loss.sum().backward()
    kl_grad, moved = 0.04 * (1 - torch.exp(d)), (r * a <= r.clamp(0.8, 1.2) * a).float()  # unclipped
    torch.testing.assert_close(logp.grad, -r * a * moved * (1 - cut) + kl_grad)
    assert cut.any() and (moved * (1 - cut)).any() and (kl_grad[cut > 0].abs() > 1e-3).all()
    seen, chosen, grads, cov_tokens = record_advantages(clipcov, monkeypatch), [], [], common.cov_tokens
    monkeypatch.setattr(common, "cov_tokens", lambda run, batch, *a: chosen.append(
        (batch, cov_tokens(run, batch, *a))) or chosen[-1][1])

    def record(run, stats):  # the gradient, counted as an update (the loss is logged), no step
        grads.append({n: p.grad.clone() for n, p in run.model.named_parameters() if p.grad is not None})
        run.optimizer.zero_grad(set_to_none=True)
        stats.updates += 1
    monkeypatch.setattr(common, "optimizer_step", record)
    result = {}
    for size in (64, 6):
        run = train(clipcov, tmp_path, "--steps", "2", "--prompts_per_step", "4", "--group_size", "4",
                    "--format_weight", "0.5", "--save_every", "-1", "--clip_cov_lb", "-100", "--clip_cov_ub",
                    "100", "--clip_cov_ratio", "0.3", "--micro_batch_size", str(size),
                    "--run_name", f"m{size}")
        rows = read_metrics(run.run_dir)
        assert run.algo == "clipcov" and len(rows) == len(seen) == len(chosen) == len(grads) == 2
        for a, (batch, cut), row in zip(seen, chosen, rows):
            used = batch.in_loss * batch.kept
            share = torch.tensor([float(c.sum()) / len(c) for c in cut])  # cut_i / |o_i|
            assert sum(float(c.sum()) for c in cut) == math.ceil(0.3 * float(batch.lengths @ used) - 1e-9)
            want = (-a * (1 - share) * used).sum() / used.sum()
            assert (share * a).abs().sum() > 0.1
            assert row["loss/policy"] == pytest.approx(want.item(), abs=1e-5)
        result[size] = [c for _, c in chosen], list(grads)
        seen.clear(), chosen.clear(), grads.clear()
    (cut64, grad64), (cut6, grad6) = result[64], result[6]
    assert all(torch.equal(x, y) for a, b in zip(cut64, cut6) for x, y in zip(a, b))  # the same tokens
    for want, got in zip(grad64, grad6):
        norm = torch.cat([g.flatten() for g in want.values()]).norm().item()
        assert norm > 0 and got.keys() == want.keys()
        for name in want:
            assert_grad_close(got[name], want[name], rel=1e-5, name=name, floor=norm)


def test_a_klcov_script_written_as_the_docs_say_penalises_the_top_covariance_tokens(tmp_path, monkeypatch):
    """train_grpo.py copied, with the KL-Cov lines of docs/algorithms.md: policy_loss is -r A + beta k_t
    |log r| (no clip), its gradient -r A + beta k_t sign(log r) in log pi; --minibatches 1 (on-policy, |log r|
    0) is refused; 2 steps of 2 minibatches (k 0.2, advantages moved off the group mean) in which exactly
    ceil(k N) tokens are chosen, these and only these reach the penalty, and whose logged loss is the hand
    computation's, -r A + beta |log r| on the chosen tokens, from the ratios of each update."""
    worked_example("klcov", tmp_path)
    klcov = load_example("klcov", tmp_path, monkeypatch)
    with pytest.raises(ValueError, match="on-policy"):
        klcov.Args(minibatches=1)
    args = klcov.Args(kl_cov_coef=0.7)
    g = torch.Generator().manual_seed(1)
    logp = torch.randn(3, 4, generator=g).requires_grad_()
    old = logp.detach() + torch.randn(3, 4, generator=g) * 0.3
    top = (torch.rand(3, 4, generator=g) > 0.5).float()
    adv, mask = torch.tensor([1.5, -0.5, 0.0]), torch.ones(3, 4)
    loss, info = klcov.policy_loss(logp, old, None, adv, mask, args, None, top)
    r, a = torch.exp(logp - old).detach(), adv[:, None]
    torch.testing.assert_close(loss, -r * a + 0.7 * top * (logp - old).abs())
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, -r * a + 0.7 * top * torch.sign(logp - old))
    assert not info["clipped"].any()
    seen, chosen, calls = record_advantages(klcov, monkeypatch, shift=0.3), [], []
    cov_tokens, policy_loss, aggregate = common.cov_tokens, klcov.policy_loss, common.aggregate
    monkeypatch.setattr(common, "cov_tokens", lambda run, batch, *a: chosen.append(
        (batch, cov_tokens(run, batch, *a))) or calls.append([]) or chosen[-1][1])
    monkeypatch.setattr(klcov, "policy_loss", lambda *a: calls[-1].append(
        [a[0].detach(), a[1], a[3], a[4], a[-1]]) or policy_loss(*a))
    monkeypatch.setattr(common, "aggregate", lambda *a: calls[-1][-1].append(a[3]) or aggregate(*a))
    run = train(klcov, tmp_path, "--steps", "2", "--prompts_per_step", "4", "--group_size", "4",
                "--format_weight", "0.5", "--micro_batch_size", "5", "--kl_cov_ratio", "0.2")
    rows = read_metrics(run.run_dir)
    assert run.algo == "klcov" and run.args.minibatches == 2 and len(rows) == len(seen) == len(chosen) == 2
    for (batch, top), step, row in zip(chosen, calls, rows):
        n = float(batch.lengths @ (batch.in_loss * batch.kept))
        count = sum(float(t.sum()) for t in top)
        assert count == sum(float(c[4].sum()) for c in step) == math.ceil(0.2 * n - 1e-9)
        loss, penalty = 0.0, 0.0
        for logp, old, adv, mask, k, n_seqs in step:  # every micro-batch of both minibatches
            log_r = (logp - old) * mask
            per_seq = lambda x: ((x * mask).sum(1) / mask.sum(1).clamp(min=1)).sum()  # noqa: E731
            loss += per_seq(-log_r.exp() * adv[:, None] + k * log_r.abs()) / n_seqs / 2  # 2 updates; beta 1
            penalty += per_seq(k * log_r.abs()) / n_seqs / 2
        assert penalty > 1e-4 and row["loss/policy"] == pytest.approx(float(loss), abs=1e-6)


def test_a_luspo_script_written_as_the_docs_say_weights_each_completion_by_its_length(tmp_path, monkeypatch):
    """train_grpo.py copied, with the LUSPO lines of docs/algorithms.md: 2 steps whose logged loss is the
    hand computation's, -|o_i| A_i averaged over the completions (on-policy GSPO's sequence ratio is 1), from
    the batch's lengths."""
    worked_example("luspo", tmp_path)
    luspo = load_example("luspo", tmp_path, monkeypatch)
    seen, batches = record_advantages(luspo, monkeypatch), record_batches(monkeypatch)
    run = train(luspo, tmp_path, "--steps", "2", "--prompts_per_step", "4", "--group_size", "4",
                "--format_weight", "0.5", "--micro_batch_size", "8")
    rows = read_metrics(run.run_dir)
    assert run.algo == "luspo" and run.args.ratio_level == "sequence" and len(rows) == len(seen) == 2
    for a, batch, row in zip(seen, batches, rows):
        used = batch.in_loss * batch.kept
        want = (-batch.lengths * a * used).sum() / used.sum()
        assert abs(want) > 0.05 and row["loss/policy"] == pytest.approx(want.item(), abs=1e-5)


def test_a_vespo_script_written_as_the_docs_say_weights_the_policy_gradient_by_a_gamma_kernel(tmp_path,
                                                                                        monkeypatch):
    """train_grpo.py copied, with the VESPO lines of docs/algorithms.md: policy_loss is -phi(w) A log pi,
    phi(w) = e^lam w^k e^(-lam w) of the sequence ratio w = prod_t r_t, (k, lam) = (2, 3) for A >= 0 and
    (3, 2) below, detached: its gradient -phi(w) A in log pi; 2 steps whose logged loss is the hand
    computation's, -A log pi summed over the batch's tokens over their number (on-policy phi(1) = 1), log
    pi the sampler's."""
    worked_example("vespo", tmp_path)
    vespo = load_example("vespo", tmp_path, monkeypatch)
    args = vespo.Args()
    g = torch.Generator().manual_seed(2)
    logp = (torch.randn(3, 4, generator=g) - 1).requires_grad_()
    old = logp.detach() + torch.randn(3, 4, generator=g) * 0.2
    adv, mask = torch.tensor([1.5, -0.5, 0.0]), torch.tensor([[1.0] * 4, [1, 1, 1, 0], [1, 0, 0, 0]])
    loss, info = vespo.policy_loss(logp, old, None, adv, mask, args)
    w = torch.where(mask > 0, torch.exp(logp - old), 1.0).prod(1).detach()
    k, lam = torch.tensor([2.0, 3.0, 2.0]), torch.tensor([3.0, 2.0, 3.0])
    phi = (torch.e ** lam * w ** k * torch.exp(-lam * w))[:, None]
    assert 0 < phi.min() < 0.99 and phi.max() != 1  # the ratios are off 1: the kernel acts
    torch.testing.assert_close(loss, -phi * adv[:, None] * logp)
    (loss * mask).sum().backward()
    torch.testing.assert_close(logp.grad, -phi * adv[:, None] * mask)
    assert not info["clipped"].any()
    seen, batches = record_advantages(vespo, monkeypatch), record_batches(monkeypatch)
    run = train(vespo, tmp_path, "--steps", "2", "--prompts_per_step", "4", "--group_size", "4",
                "--format_weight", "0.5", "--micro_batch_size", "8")
    rows = read_metrics(run.run_dir)
    assert run.algo == "vespo" and len(rows) == len(seen) == 2
    for a, batch, row in zip(seen, batches, rows):
        used = (batch.in_loss * batch.kept).tolist()
        total = sum(-a[i] * batch.sampler_logp[i].sum() for i in range(len(used)) if used[i])
        want = total / sum(len(batch.sampler_logp[i]) for i in range(len(used)) if used[i])
        assert row["loss/policy"] == pytest.approx(want.item(), rel=1e-4)
