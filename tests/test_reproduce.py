"""Seed 000 reproduction (reproduce/): the tabular replication's pieces, and the replication itself at
reduced steps against the published Table 1."""
import math
import os
import sys

import numpy as np
import pytest
import torch

from conftest import ROOT, assert_grad_close

sys.path.insert(0, os.path.join(ROOT, "reproduce"))
import seed000_lm as lm  # noqa: E402
import seed000_tabular as tab  # noqa: E402

import train_grpo  # noqa: E402
import train_ppo  # noqa: E402


def test_data_is_the_notebooks_draw():
    """default_rng(2) in the notebook's order: the true rates reproduce the published accuracy exactly."""
    categories, outcomes, p_true = tab.make_data()
    assert len(categories) == 10_000 and categories.min() == 0 and categories.max() == 19
    assert tab.oracle()["accuracy"] == 0.7514  # Table 1: 0.7514 for every algorithm
    assert abs(tab.oracle()["auroc"] - 0.8228) < 0.001  # Table 1: 0.8228-0.8229 for the calibrated rows
    assert abs(outcomes.mean().item() - p_true[categories.numpy()].mean()) < 0.02


def test_reward_is_the_log_likelihood():
    tokens = torch.tensor([0, 49, 98, 69])  # probabilities 0.01, 0.50, 0.99, 0.70
    outcomes = torch.tensor([1.0, 0.0, 0.0, 1.0])
    expected = [math.log(0.01), math.log(0.5), math.log(0.01), math.log(0.7)]
    assert torch.allclose(tab.log_likelihood_reward(tokens, outcomes), torch.tensor(expected), atol=1e-6)


def test_sampling_follows_the_softmax():
    logits = torch.randn(tab.N_CATEGORIES, tab.N_TOKENS) * 2
    categories = torch.arange(tab.N_CATEGORIES).repeat_interleave(50)
    tokens = tab.sample_tokens(logits, categories, 400, torch.Generator().manual_seed(0))
    assert tokens.min() >= 0 and tokens.max() < tab.N_TOKENS
    probs = torch.softmax(logits, -1)
    for c in (0, 7, 19):
        freq = torch.bincount(tokens[categories == c].flatten(), minlength=tab.N_TOKENS).double() / 20_000
        se = (probs[c].double() * (1 - probs[c].double()) / 20_000).sqrt()
        assert ((freq - probs[c].double()).abs() <= 5 * se + 1e-4).all()


def test_advantages_are_the_trainers():
    rewards = torch.tensor([-0.1, -2.0, -0.5, -0.7, -1.0, -0.2])
    g = rewards.view(-1, 3)
    assert torch.allclose(tab.advantages("grpo", rewards, None, 3),
                          ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-5)).flatten())
    assert torch.allclose(tab.advantages("grpo_nostd", rewards, None, 3),
                          (g - g.mean(1, keepdim=True)).flatten())
    assert torch.allclose(tab.advantages("rloo", rewards, None, 3),
                          (g - g.mean(1, keepdim=True)).flatten() * 1.5)
    values = torch.tensor([0.5, -1.0, 0.0, 0.0, 2.0, -0.3])
    assert torch.allclose(tab.advantages("ppo", rewards, values, 1), rewards - values)
    assert torch.equal(tab.advantages("reinforce", rewards, None, 1), rewards)


@pytest.mark.parametrize("module", [train_grpo, train_ppo])
@pytest.mark.parametrize("clip_eps", [0.2, 0.01])
def test_cell_aggregation_gives_the_per_sample_gradient(module, clip_eps):
    """Summing advantages per (category, token, sign) cell must give exactly the loss and gradient of the
    per-sample clipped surrogate, also off-policy where some cells are clipped."""
    gen = torch.Generator().manual_seed(0)
    old = torch.randn(tab.N_CATEGORIES, tab.N_TOKENS, generator=gen)
    logits = (old + 0.05 * torch.randn(old.shape, generator=gen)).requires_grad_()  # ratio != 1
    categories = torch.randint(0, tab.N_CATEGORIES, (3000,), generator=gen)
    tokens = tab.sample_tokens(old, categories, 1, gen).flatten()
    adv = torch.randn(3000, generator=gen)
    cells = categories * tab.N_TOKENS + tokens
    old_logp = torch.log_softmax(old, -1).flatten()

    cell, adv_sum, count = tab.aggregate_by_token(cells, adv)
    assert count.sum() == (adv != 0).sum()
    loss, stats = tab.surrogate_loss(module, logits, old_logp, cell, adv_sum, len(adv), clip_eps)
    (grad,) = torch.autograd.grad(loss, logits)

    logp = torch.log_softmax(logits, -1).flatten()[cells].unsqueeze(1)
    mask = torch.ones_like(logp)
    hp = type("hp", (),
              {"ratio_level": "token", "clip_eps": clip_eps, "clip_eps_high": 0.0, "surrogate": "clip"})
    a = adv.unsqueeze(1) if module is train_ppo else adv
    token_loss, per_sample = module.policy_loss(logp, old_logp[cells].unsqueeze(1), None, a, mask, hp)
    ref = token_loss.mean()
    (ref_grad,) = torch.autograd.grad(ref, logits)
    assert torch.allclose(loss, ref, atol=1e-6)
    assert_grad_close(grad, ref_grad, rel=1e-6)
    clipped = float((stats["clipped"].squeeze(1) * count).sum()) / len(adv)
    assert clipped == pytest.approx(per_sample["clipped"].mean().item(), abs=1e-6)
    if clip_eps == 0.01:
        assert clipped > 0.2  # the small clip range is active: the test exercises the clipped branch


def test_off_policy_clip_is_applied():
    """The notebook overwrote the clipped loss, so its clip 0.2 and 0.001 rows were identical; ours are not.
    """
    wide = tab.train("grpo_nostd", updates=10, clip_eps=0.2, steps=300, log_every=300)
    narrow = tab.train("grpo_nostd", updates=10, clip_eps=0.001, steps=300, log_every=300)
    assert narrow["history"][-1]["clipfrac"] > 0.3
    assert wide["history"][-1]["clipfrac"] < narrow["history"][-1]["clipfrac"]
    assert wide["probs"] != narrow["probs"]


# The replication at 5,000 of the notebook's 50,000 steps (about a minute and a half, two processes).
# Measured at 5,000 steps with torch seeds 0 and 1: GRPO ECE 0.203 / 0.202 (paper 0.2386) and AUROC 0.808 /
# 0.807 (paper 0.7504; it falls further as the predictions reach 0.01 / 0.99); no-std and RLOO ECE 0.0029 /
# 0.0023 (paper 0.0019-0.0020), AUROC 0.8228 / 0.8232 (paper 0.8228-0.8229); PPO, one rollout per question,
# converges slower: ECE 0.019 (paper 0.0052); accuracy 0.7514 in every row. Tolerances: calibrated
# rows ECE within 0.005 of the paper (PPO 0.02), AUROC within 0.005, accuracy within 0.002; GRPO ECE within
# 0.05 of the paper and AUROC at least 0.01 below the calibrated rows'.
REDUCED_STEPS = 5000


@pytest.fixture(scope="module")
def reduced():
    return {r["algo"]: r for r in tab.run_rows([(a, 1, None) for a in ("grpo", "grpo_nostd", "rloo", "ppo")],
                                               REDUCED_STEPS, jobs=2)}


@pytest.mark.slow
def test_reduced_replication_near_published(reduced):
    for algo, r in reduced.items():
        ece, auc, acc = tab.PUBLISHED[(algo, 1, None)]
        assert abs(r["accuracy"] - acc) <= 0.002, (algo, r["accuracy"])
        if algo == "grpo":
            assert abs(r["ece"] - ece) < 0.05, (algo, r["ece"])
        else:
            assert abs(r["ece"] - ece) < (0.02 if algo == "ppo" else 0.005), (algo, r["ece"])
            assert abs(r["auroc"] - auc) < 0.005, (algo, r["auroc"])
            assert r["auroc"] > reduced["grpo"]["auroc"] + 0.01, (algo, r["auroc"], reduced["grpo"]["auroc"])


@pytest.mark.slow
def test_reduced_replication_grpo_heads_for_the_extremes(reduced):
    """GRPO's ECE grows through training (predictions pushed to 0.01 / 0.99); the others' falls."""
    grpo, nostd = reduced["grpo"]["history"], reduced["grpo_nostd"]["history"]
    assert grpo[-1]["ece"] > grpo[len(grpo) // 2]["ece"] and nostd[-1]["ece"] < nostd[0]["ece"]
    probs = np.array(reduced["grpo"]["probs"])
    assert np.mean((probs < 0.1) | (probs > 0.9)) > 0.5


# --------------------------------------------------------------------------------------------- language model

# ECE at step 150 (eval every 50) on the tuning seeds 0-4, `reproduce/seed000_lm.py --steps 200 --seeds
# 0,1,2,3,4` (a constant lr: its first 150 steps are a 150-step run's): GRPO 0.214, 0.200, 0.215, 0.199,
# 0.175;
# no-std 0.048-0.077; RLOO 0.049-0.072; PPO 0.046-0.086. Every GRPO ECE rises from step 100 to 150 (by 0.045
# or more), every other falls (by 0.012 or more). At 200 (the test's length until 2026-11-28, 25% longer):
# GRPO 0.191-0.246, the others 0.037-0.067.
LM_STEPS, GRPO_ECE_ABOVE, CALIBRATED_ECE_BELOW = 150, 0.16, 0.10


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["grpo", "grpo_nostd"])
def test_lm_grpo_overconfident_others_calibrated(tmp_path, algo):
    """Seed 000's claim through the real trainers: docs/seed000.md's configuration (seed000_lm.py's defaults)
    for 150 of its 300 steps, on tuning seed 0, one algorithm a test (about 60 s each on 2 cores). Measured
    on seed 0: ECE GRPO 0.214, no-std 0.077, RLOO 0.072, PPO 0.086. Asserted, with the margins all five
    tuning seeds keep (above): GRPO above 0.16, without the std below 0.10; GRPO's ECE rises from step 100
    to 150 and the other's falls. The claim's cause, the std, is the one switch between the two; RLOO and
    PPO (a further 4 minutes of the suite's 30) are the reproduction's (reproduce/seed000_lm.py, its page)."""
    args = lm.parser().parse_args(["--out", str(tmp_path), "--steps", str(LM_STEPS), "--jobs", "1"])
    (r,) = lm.run_all([algo], [0], args)
    assert 0 < r["brier"] < 0.5 and 0.3 < r["accuracy"] <= 1 and len(r["predictions"]["probs"]) == 2000
    curve = r["curve"]["eval/ece"]
    assert sorted(curve) == list(range(50, LM_STEPS + 1, 50)) and curve[LM_STEPS] == r["ece"], curve
    if algo == "grpo":
        assert r["ece"] > GRPO_ECE_ABOVE and curve[LM_STEPS] > curve[100], curve
    else:
        assert r["ece"] < CALIBRATED_ECE_BELOW and curve[LM_STEPS] < curve[100], curve


def test_lm_table_reports_seeds_ratios_and_curves(tmp_path):
    """The held-out report's numbers, from made-up runs: ECE per seed, the per-seed GRPO/X ratio and its
    range, P(GRPO's ECE > X's) over pairs of seeds, and the ECE-over-steps IQM; the curves figure."""
    def run(algo, label, seed, ece, curve):
        return {"algo": algo, "label": label, "seed": seed, "ece": ece, "auroc": 0.7, "accuracy": 0.7,
                "brier": 0.2, "curve": {"eval/ece": curve, "eval/auroc": {50: 0.6, 100: 0.7},
                                        "entropy": {1: 4.0, 50: 2.0, 100: 1.0}}}
    results = [
        run("grpo", "GRPO", 5, 0.20, {50: 0.1, 100: 0.20}),
        run("grpo", "GRPO", 6, 0.12, {50: 0.1, 100: 0.12}),
        run("rloo", "RLOO", 5, 0.05, {50: 0.1, 100: 0.05}),
        run("rloo", "RLOO", 6, 0.15, {50: 0.1, 100: 0.15})]
    md = lm.table(results, eval_limit=100)
    assert "| GRPO | 0.200 | 0.120 |" in md and "| RLOO | 0.050 | 0.150 |" in md
    # pairs (GRPO, RLOO): 0.20 > 0.05, 0.20 > 0.15, 0.12 > 0.05, 0.12 < 0.15: P = 3/4
    # ratios per seed: 0.20 / 0.05 = 4.0 and 0.12 / 0.15 = 0.8
    assert "| RLOO | 0.75 [" in md and "| 0.8 to 4.0 (4.0, 0.8) |" in md
    # IQM of two values is their mean: step 100 -> (0.20 + 0.12) / 2 for GRPO
    assert "| ECE at step (IQM over seeds) | 50 | 100 |" in md and "| GRPO | 0.100 | 0.160 |" in md
    assert "true rates p_c (oracle)" in md
    lm.curves(results, str(tmp_path / "curves.png"))
    assert (tmp_path / "curves.png").stat().st_size > 0


# ------------------------------------------------------------------------------------ docs/seed000.md


def test_the_block_is_replaced_between_the_markers(tmp_path):
    import seed000
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{seed000.BEGIN}\nold\n{seed000.END}\noutro\n")
    seed000.write_page(str(readme), f"{seed000.BEGIN}\nnew\n{seed000.END}")
    assert readme.read_text() == f"intro\n{seed000.BEGIN}\nnew\n{seed000.END}\noutro\n"
    readme.write_text("no markers")
    with pytest.raises(SystemExit, match="markers"):
        seed000.write_page(str(readme), "x")


def test_the_page_holds_the_generated_result():
    import seed000
    text = open(os.path.join(ROOT, "docs", "seed000.md")).read()
    block = text.split(seed000.BEGIN)[1].split(seed000.END)[0]
    assert "Generated by `make reproduce`" in block and "| GRPO (no std), 10 updates, clip 0.001 |" in block
    assert os.path.exists(os.path.join(ROOT, "docs", "figures", "seed000_reliability.png"))


# ----------------------------------------------------------------------------------- seed 000 on SmolLM2
import seed000_smollm2 as sm  # noqa: E402

SM_SMALL = ["--model", "tiny", "--engine", "hf", "--steps", "2", "--prompts_per_step", "4", "--group_size",
            "2", "--eval_every", "1", "--curve_limit", "20", "--eval_n", "2", "--final_limit", "40",
            "--max_new_tokens", "0"]


@pytest.mark.slow
def test_seed000_smollm2_runs_reuses_continues_and_refuses(tmp_path, capsys):
    """reproduce/seed000_smollm2.py on the tiny model, two steps a run: results.json is the list the issue
    names, with eval.py's final values; one line per run; a second call trains nothing; a run interrupted
    after its checkpoint continues from it; another configuration in the folder, an unknown algorithm and a
    seed that is not a non-negative integer are refused in one line naming them."""
    import json
    import shutil
    import subprocess
    out = tmp_path / "s"
    rows = sm.main([*SM_SMALL, "--seeds", "3", "--algos", "grpo", "--out", str(out)])
    printed = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in printed if line.endswith(" min)")] == ["grpo seed 3"]
    saved = json.load(open(out / "results.json"))
    assert saved == rows and set(saved[0]) == {"algo", "seed", "ece", "auroc", "accuracy", "brier", "minutes"}
    ev = json.load(open(out / "eval-grpo-s3" / "eval.json"))
    assert (saved[0]["algo"], saved[0]["seed"], saved[0]["ece"], saved[0]["auroc"], saved[0]["brier"]) == (
        "grpo", 3, ev["ece"], ev["auroc"], ev["brier"])
    assert ev["questions"] == 40 and ev["n"] == 2 and saved[0]["minutes"] > 0
    curve = json.load(open(out / "details.json"))["runs"][0]["curve"]["ece"]
    assert sorted(int(t) for t in curve) == [1, 2]  # the curve: every step here (--eval_every 1)
    assert (out / "seed000_smollm2.png").stat().st_size > 0
    assert "| GRPO | 3 |" in (out / "table.md").read_text()
    assert not (out / "grpo-s3" / "checkpoint.pt").exists()  # --keep_checkpoint false: final/ only
    # reused: nothing trained or evaluated again
    stamp = os.path.getmtime(out / "grpo-s3" / "metrics.jsonl")
    assert sm.main([*SM_SMALL, "--seeds", "3", "--algos", "grpo", "--out", str(out)]) == rows
    assert os.path.getmtime(out / "grpo-s3" / "metrics.jsonl") == stamp
    # interrupted after its last checkpoint, before final/ and the evaluation: continued with --resume
    a = sm.parser().parse_args([*SM_SMALL, "--out", str(out)])
    subprocess.run([sys.executable, os.path.join(ROOT, "train_grpo.py"), *sm.train_flags(a, "grpo", 3),
                    "--out_dir", str(out), "--run_name", "grpo-s3", "--wandb", "false", "--save_every", "1",
                    "--overwrite", "true"], cwd=ROOT, check=True, capture_output=True)
    shutil.rmtree(out / "grpo-s3" / "final"), shutil.rmtree(out / "eval-grpo-s3")
    sm.main([*SM_SMALL, "--seeds", "3", "--algos", "grpo", "--out", str(out)])
    assert "the checkpoint restored" in open(out / "grpo-s3.log").read().split("memory plan")[-1]
    assert (out / "eval-grpo-s3" / "eval.json").exists() and not (out / "grpo-s3" / "checkpoint.pt").exists()
    # refusals, one line each
    for argv, message in (([*SM_SMALL, "--seeds", "3", "--algos", "grpo", "--lr", "1e-3"],
                           r"grpo-s3: trained with another configuration: --lr 2e-05 \(now 0.001\)"),
                          ([*SM_SMALL, "--seeds", "3", "--algos", "grpo_nostd"], None),
                          (["--algos", "gpg"], r"argument --algos: invalid choice: 'gpg'"),
                          (["--seeds", "-1"], r"invalid non-negative integer seed value: '-1'"),
                          (["--seeds", "1.5"], r"invalid non-negative integer seed value: '1.5'")):
        if message is None:  # GRPO's folder taken for GRPO without std: the std switch named
            shutil.copytree(out / "grpo-s3", out / "grpo_nostd-s3")
            message = r"grpo_nostd-s3: trained with another configuration: --std_norm True \(now false\)"
        with pytest.raises(SystemExit, match=message) as e:
            sm.main([*argv, "--out", str(out)])
        assert "\n" not in str(e.value)


# ------------------------------------------------------------ seeds 001 (HA-DW) and 004 (CoRPO) on SmolLM2
import corpo_ood as co  # noqa: E402
import hadw_smollm2 as hs  # noqa: E402

TINY = ["--model", "tiny", "--engine", "hf", "--steps", "2", "--prompts_per_step", "4", "--group_size", "2"]
HS_SMALL = [*TINY, "--eval_every", "1", "--curve_limit", "12", "--eval_n", "2", "--final_limit", "12"]
CO_SMALL = [*TINY, "--eval_n", "4", "--eval_limit", "6", "--ood", "sums3:9"]


@pytest.mark.parametrize("module", [hs, co])
def test_hadw_and_corpo_scripts_refuse_a_bad_arm_or_seed_in_one_line(module, tmp_path):
    """Seeds 8 and up are reserved (0-4 tune, 5-7 held out): refused before anything runs, as are an unknown
    arm and a seed that is no integer."""
    for argv, message in ((["--arms", "ppo"], r"argument --arms: invalid choice: 'ppo'"),
                          (["--seeds", "8"], r"invalid seed \(0-4 tuning, 5-7 held out; 8 and up reserved\) "
                                             r"value: '8'"),
                          (["--seeds", "5", "12"], r"value: '12'"),
                          (["--seeds", "-1"], r"value: '-1'"),
                          (["--flags=--lr"], r"--flags '--lr': pairs of --flag value"),
                          (["--flags=--lr -1"], r"--lr -1.0: must be > 0")):  # every arm's, before any run
        with pytest.raises(SystemExit, match=message) as e:
            module.main([*argv, "--out", str(tmp_path / "x")])
        assert "\n" not in str(e.value) and not (tmp_path / "x").exists()
    assert module.parser().parse_args([]).seeds == [5, 6, 7]  # the held-out seeds by default
    assert module.parser().parse_args([]).arms == list(module.ARMS)


def test_corpo_ood_refuses_an_unknown_family_and_a_pass_at_one():
    for argv, message in ((["--ood", "division"], r"--ood division: each of subtraction, products, sums3 at "
                                                  r"most once"),
                          (["--ood", "sums3", "sums3:9"], "at most once"),
                          (["--ood", "products:1"], r"--ood products:1: .*largest operand >= 3"),
                          (["--eval_n", "1"], r"--eval_n 1: pass@n needs n >= 2")):
        with pytest.raises(SystemExit, match=message):
            co.main(argv)


@pytest.mark.slow
def test_hadw_smollm2_runs_reuses_continues_and_refuses(tmp_path, capsys):
    """reproduce/hadw_smollm2.py on the tiny model, two steps of the fixed-anchor arm: results.json is the
    list the issue names ({arm, seed, accuracy, by_level, minutes}) with eval.py's greedy values; curves by
    level and hadw/anchor over steps in details.json; the figure; a second call trains nothing; a run
    interrupted after its checkpoint continues from it; another threshold in the folder is refused, named."""
    import json
    import shutil
    import subprocess
    out = tmp_path / "h"
    rows = hs.main([*HS_SMALL, "--seeds", "3", "--arms", "fixed", "--threshold", "0.25", "--out", str(out)])
    printed = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in printed if line.endswith(" min)")] == ["fixed seed 3"]
    saved = json.load(open(out / "results.json"))
    assert saved == json.loads(json.dumps(rows))
    assert set(saved[0]) == {"arm", "seed", "accuracy", "by_level", "minutes"}
    ev = json.load(open(out / "eval-fixed-s3" / "eval.json"))
    assert ev["questions"] == 12 and ev["decoding"] == "greedy" and saved[0]["accuracy"] == ev["pass@1"]
    assert saved[0]["by_level"] == {L: v["pass@1"] for L, v in ev["by_level"].items()}
    assert saved[0]["minutes"] > 0
    details = json.load(open(out / "details.json"))["runs"][0]
    assert set(details["curve"]) == {"all"} | set(ev["by_level"]) and len(ev["by_level"]) > 1  # levels mixed
    assert all(sorted(map(int, c)) == [1, 2] for c in details["curve"].values())  # --eval_every 1: each step
    assert list(details["anchor"].values()) == [0.25, 0.25]  # hadw/anchor over steps: the fixed threshold
    assert (out / "hadw_smollm2.png").stat().st_size > 0 and "| GRPO + HA-DW (fixed anchor) | 3 |" in (
        out / "table.md").read_text()
    stamp = os.path.getmtime(out / "fixed-s3" / "metrics.jsonl")
    same = [*HS_SMALL, "--seeds", "3", "--arms", "fixed", "--threshold", "0.25", "--out", str(out)]
    assert hs.main(same) == rows
    assert os.path.getmtime(out / "fixed-s3" / "metrics.jsonl") == stamp
    # landed: its small files only, as results/ holds them in git (.gitignore leaves final/ out): reused
    kept = tmp_path / "landed"
    shutil.copytree(out, kept, ignore=shutil.ignore_patterns("final", "checkpoint*"))
    assert hs.main([*same[:-1], str(kept)]) == rows and not (kept / "fixed-s3" / "final").exists()
    with pytest.raises(SystemExit, match=r"landed/fixed-s3: landed without its weights \(no final/\), so its "
                                         r"greedy evaluation \(--final_limit 6\) cannot be made") as e:
        hs.main([*same[:-1], str(kept), "--final_limit", "6"])
    assert "\n" not in str(e.value)
    a = hs.parser().parse_args([*HS_SMALL, "--threshold", "0.25", "--out", str(out)])
    subprocess.run([sys.executable, os.path.join(ROOT, "train_grpo.py"), *hs.train_flags(a, "fixed", 3),
                    "--out_dir", str(out), "--run_name", "fixed-s3", "--wandb", "false", "--save_every", "1",
                    "--overwrite", "true"], cwd=ROOT, check=True, capture_output=True)
    shutil.rmtree(out / "fixed-s3" / "final"), shutil.rmtree(out / "eval-fixed-s3")
    hs.main(same)
    assert "the checkpoint restored" in open(out / "fixed-s3.log").read().split("memory plan")[-1]
    assert (out / "eval-fixed-s3" / "eval.json").exists()
    with pytest.raises(SystemExit, match=r"fixed-s3: trained with another configuration: --hadw_threshold "
                                         r"0.25 \(now 0.5\)") as e:
        hs.main([*HS_SMALL, "--seeds", "3", "--arms", "fixed", "--out", str(out)])
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_corpo_ood_runs_reuses_and_refuses(tmp_path, capsys):
    """reproduce/corpo_ood.py on the tiny model, two steps of GRPO: results.json is the list the issue names
    ({arm, seed, in_domain, ood, in_domain_pass1, ood_pass1, minutes}) with eval.py's pass@n and pass@1 of
    each task; a second call trains and evaluates nothing; the static baseline's arm in GRPO's folder is
    refused, naming the script."""
    import json
    import shutil
    out = tmp_path / "c"
    rows = co.main([*CO_SMALL, "--seeds", "2", "--arms", "grpo", "--out", str(out)])
    saved = json.load(open(out / "results.json"))
    assert saved == rows and set(saved[0]) == {"arm", "seed", "in_domain", "ood", "in_domain_pass1",
                                               "ood_pass1", "minutes"}
    ind, ood = (json.load(open(out / f"eval-grpo-s2-{t}" / "eval.json")) for t in ("sums_graded", "sums3-9"))
    assert (ind["n"], ind["questions"], ood["n"], ood["questions"]) == (4, 6, 4, 6)
    assert (saved[0]["in_domain"], saved[0]["in_domain_pass1"]) == (ind["pass@4"], ind["pass@1"])
    assert saved[0]["ood"] == {"sums3:9": ood["pass@4"]}
    assert saved[0]["ood_pass1"] == {"sums3:9": ood["pass@1"]}
    assert "| GRPO | 2 |" in (out / "table.md").read_text()
    stamps = [os.path.getmtime(p) for p in (out / "grpo-s2" / "metrics.jsonl",
                                            out / "eval-grpo-s2-sums3-9" / "eval.json")]
    assert co.main([*CO_SMALL, "--seeds", "2", "--arms", "grpo", "--out", str(out)]) == rows
    assert stamps == [os.path.getmtime(p) for p in (out / "grpo-s2" / "metrics.jsonl",
                                                    out / "eval-grpo-s2-sums3-9" / "eval.json")]
    shutil.copytree(out / "grpo-s2", out / "static-s2")
    with pytest.raises(SystemExit, match=r"static-s2: trained with another configuration: the script "
                                         r"train_grpo.py \(now train_corpo.py\)") as e:
        co.main([*CO_SMALL, "--seeds", "2", "--arms", "static", "--out", str(out)])
    assert "\n" not in str(e.value)
