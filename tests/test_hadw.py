"""HA-DW (seed 001): Theorem 1, the direction of Phi, the anchor update, its cold start, resume."""
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import common
import train_gpg
import train_grpo
from conftest import read_metrics
from test_train_grpo import _rows_without_timing, _same

# Theorem 1 at G = 8, from ../shared/notes/algorithms.md
PUBLISHED_G8 = {0.125: 0.1904, 0.25: 0.2778, 0.5: 0.5, 0.75: 0.7222, 0.9: 0.8244}


def theorem1(p, G):
    """E[p_hat | 1 <= R <= G-1] = (p - p^G) / (1 - (1-p)^G - p^G)."""
    return (p - p ** G) / (1 - (1 - p) ** G - p ** G)


@pytest.mark.parametrize("p,published", sorted(PUBLISHED_G8.items()))
def test_theorem1_closed_form_exact_sum_and_monte_carlo(p, published):
    G = 8
    assert theorem1(p, G) == pytest.approx(published, abs=5e-5)
    # exact: condition the binomial on a non-degenerate group
    w = [math.comb(G, r) * p ** r * (1 - p) ** (G - r) for r in range(1, G)]
    exact = sum(r / G * wr for r, wr in zip(range(1, G), w)) / sum(w)
    assert exact == pytest.approx(theorem1(p, G), rel=1e-12)
    rng = np.random.default_rng(int(p * 1000))
    R = rng.binomial(G, p, size=400_000)
    R = R[(R >= 1) & (R <= G - 1)]
    assert (R / G).mean() == pytest.approx(published, abs=0.004)
    # the group baseline overestimates p for hard prompts, underestimates it for easy ones
    assert (theorem1(p, G) > p) if p < 0.5 else (theorem1(p, G) <= p)


def _yaml(tmp_path, text):
    (tmp_path / "c.yaml").write_text(text + "\n")
    return tmp_path / "c.yaml"


def _reweight(rewards, state, eta=0.1, window=50, lam=1.3, group_size=4, anchor="kalman",
              threshold=0.5):
    rewards = torch.tensor(rewards, dtype=torch.float32)
    advantages = train_grpo.compute_advantages(rewards, group_size, std_norm=False)
    args = SimpleNamespace(group_size=group_size, hadw_eta=eta, hadw_window=window, hadw_lambda=lam,
                           hadw_anchor=anchor, hadw_threshold=threshold)
    new, info = common.hadw_reweight(rewards, advantages, state, args)
    return advantages, new, info


def test_grpo_and_gpg_reweight_with_the_one_hadw():
    import inspect
    for module in (train_grpo, train_gpg):
        assert "common.hadw_reweight(rewards, advantages, run.hadw, args)" in inspect.getsource(module.main)


def test_phi_direction_in_the_four_cases():
    state = {"anchor": 0.5}
    # group 1: hard (1 of 4 correct, p_hat .25 < C .5); group 2: easy (3 of 4, p_hat .75 > C)
    adv, new, info = _reweight([1, 0, 0, 0, 1, 1, 1, 0], state)
    phi = (new / adv).tolist()
    lam, M = 1.3, 0.25
    assert phi[0] == pytest.approx(lam * math.exp(M))    # hard, correct: boosted
    assert phi[1] == pytest.approx(lam * math.exp(-M))   # hard, wrong: damped
    assert phi[4] == pytest.approx(lam * math.exp(-M))   # easy, correct: damped
    assert phi[7] == pytest.approx(lam * math.exp(M))    # easy, wrong: boosted
    assert info["hadw/anchor"] == 0.5
    assert info["hadw/phi_hard"] == pytest.approx(lam * (math.exp(M) + 3 * math.exp(-M)) / 4)
    only_hard = _reweight([1, 0, 0, 0], {"anchor": 0.5})[2]  # no easy prompt: phi_easy absent, not NaN
    assert "hadw/phi_hard" in only_hard and "hadw/phi_easy" not in only_hard


def test_anchor_update_on_a_hand_made_sequence():
    state = {}
    ys = []
    for y_batch in ([1, 0, 1, 0], [1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]):  # y = .5, .25, .75, 1
        ys.append(_reweight(y_batch, state, eta=0.1, window=3)[2])
    # step 1: prior = y_1 = .5; window empty -> eta_t = eta; C+ = .5
    assert ys[0]["hadw/anchor"] == 0.5 and ys[0]["hadw/eta"] == 0.1
    # step 2: prior .5; one anchor in the window -> eta_t = eta; C+ = .9 * .5 + .1 * .25 = .475
    assert ys[1]["hadw/anchor"] == 0.5 and ys[1]["hadw/eta"] == 0.1
    # step 3: prior .475; window [.5, .475], population std .0125 -> eta_t = .00125
    assert ys[2]["hadw/anchor"] == pytest.approx(0.475) and ys[2]["hadw/eta"] == pytest.approx(0.00125)
    c3 = 0.475 * (1 - 0.00125) + 0.00125 * 0.75
    # step 4: prior c3; window [.5, .475, c3]
    assert ys[3]["hadw/anchor"] == pytest.approx(c3)
    assert ys[3]["hadw/eta"] == pytest.approx(0.1 * np.std([0.5, 0.475, c3]))
    assert state["anchor"] == pytest.approx((1 - ys[3]["hadw/eta"]) * c3 + ys[3]["hadw/eta"] * 1.0)
    assert len(state["history"]) == 3  # the window keeps the last m anchors


def test_a_nan_reward_step_leaves_the_anchor_as_it_was():
    """--on_nonfinite skip skips that step's update; before, its NaN became the anchor, for good (and every
    later step's advantages NaN)."""
    state = {}
    _reweight([1.0, 0.0, 0.0, 0.0], state)
    kept = dict(state)
    _, _, info = _reweight([1.0, float("nan"), 0.0, 0.0], state)
    assert state == kept and info == {}
    _, new, _ = _reweight([1.0, 0.0, 1.0, 0.0], state)
    assert torch.isfinite(new).all()


def test_cold_start_a_constant_window_cannot_freeze_the_anchor():
    """Read literally (eta_t = eta * std) the anchor would stay at 0 forever after all-zero batches."""
    state = {}
    for _ in range(5):
        info = _reweight([0, 0, 0, 0], state)[2]
        assert info["hadw/eta"] == 0.1  # constant window: fall back to eta
    assert state["anchor"] == 0.0
    _reweight([1, 1, 1, 1], state)
    assert state["anchor"] == pytest.approx(0.1)  # it moves as soon as accuracy does


def test_resume_with_the_anchor_gives_the_same_run(tmp_path):
    opts = ["--engine", "hf", "--task", "mixed", "--hadw", "true", "--prompts_per_step", "8", "--save_every",
            "2",
            "--out_dir", str(tmp_path), "--wandb", "false"]
    train_grpo.main([*opts, "--steps", "4", "--run_name", "straight"])
    train_grpo.main([*opts, "--steps", "2", "--run_name", "split"])
    run = train_grpo.main([*opts, "--steps", "4", "--run_name", "split", "--resume", "true"])
    rows = _rows_without_timing(tmp_path / "straight")
    _same(rows, _rows_without_timing(tmp_path / "split"))
    assert {"hadw/anchor", "hadw/eta"} <= set(rows[-1])  # each side's Phi where it has prompts, else absent
    assert all(not math.isnan(r[k]) for r in rows for k in ("hadw/phi_hard", "hadw/phi_easy") if k in r)
    a = torch.load(tmp_path / "straight" / "checkpoint.pt", weights_only=False)["algo_state"]["hadw"]
    assert a == run.hadw and len(a["history"]) == 4


def test_gpg_and_the_dapo_gspo_settings_take_hadw(tmp_path):
    base = ["--engine", "hf", "--task", "mixed", "--hadw", "true", "--steps", "2", "--prompts_per_step", "8",
            "--out_dir", str(tmp_path), "--wandb", "false"]
    runs = [train_gpg.main([*base, "--run_name", "gpg"]),
            train_grpo.main([*base, "--run_name", "dapo", "--loss_agg", "token-mean", "--clip_eps_high",
                             "0.28"]),
            train_grpo.main([*base, "--run_name", "gspo", "--ratio_level", "sequence", "--clip_eps", "3e-4"])]
    for run in runs:
        assert "hadw/anchor" in read_metrics(run.run_dir)[-1] and run.hadw["history"]


def test_mean_anchor_is_the_moving_average_of_recent_accuracies(tmp_path):
    state = {}
    anchors = [_reweight(y, state, window=2, anchor="mean")[2]["hadw/anchor"]
               for y in ([1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0])]  # y = .25, .5, 1, 0
    assert anchors == pytest.approx([0.25, 0.25, 0.375, 0.75])  # first: y_1; then the mean of the last m = 2
    with pytest.raises(SystemExit, match=r"argument --hadw_anchor: invalid choice: 'median' \(choose from "
                                         r"'kalman', 'mean', 'fixed'\)"):  # at parse time
        common.parse_args(train_grpo.Args, ["--config", str(_yaml(tmp_path, "hadw_anchor: median"))])


def test_fixed_anchor_is_the_threshold_every_step_with_hand_computed_phi(tmp_path):
    """--hadw_anchor fixed (the paper's ablation against its evolving C_t): C = --hadw_threshold at every
    step, whatever the accuracy; no Kalman state, no eta_t."""
    state = {}
    # y = .25: kalman's first prior would be .25; fixed at .3: group 1 (p_hat .25) hard, group 2 (p_hat .25)
    adv, new, info = _reweight([1, 0, 0, 0, 0, 1, 0, 0], state, anchor="fixed", threshold=0.3)
    lam, M = 1.3, 0.05
    up, down = lam * math.exp(M), lam * math.exp(-M)
    assert (new / adv).tolist() == pytest.approx([up, down, down, down, down, up, down, down])
    assert info == {"hadw/anchor": 0.3, "hadw/phi_hard": pytest.approx((up + 3 * down) / 4)}
    for batch in ([1, 1, 1, 1], [0, 0, 0, 0], [1, 1, 1, 0]):  # y = 1, 0, .75: the anchor never moves
        _, new, info = _reweight(batch, state, anchor="fixed", threshold=0.3)
        assert info["hadw/anchor"] == 0.3 and "hadw/eta" not in info
    # easy group at C = .3: p_hat .75, M = .45: its correct answers damped by exp(-.45), the wrong one boosted
    assert (new / train_grpo.compute_advantages(torch.tensor([1., 1, 1, 0]), 4, std_norm=False)).tolist() == \
        pytest.approx([lam * math.exp(-0.45)] * 3 + [lam * math.exp(0.45)])
    assert state == {}
    args = common.parse_args(train_grpo.Args, ["--hadw", "true", "--hadw_anchor", "fixed", "--hadw_threshold",
                                                "0.2"])
    assert (args.hadw_anchor, args.hadw_threshold) == ("fixed", 0.2)
    args = common.parse_args(train_grpo.Args, ["--hadw", "true", "--hadw_eta", "0.3", "--hadw_window", "9",
                                                "--hadw_lambda", "2"])  # every condition met: accepted
    assert (args.hadw_eta, args.hadw_window, args.hadw_lambda) == (0.3, 9, 2.0)
    for module in (train_grpo, train_gpg):  # the range declared in the field, checked at parse time
        with pytest.raises(SystemExit, match=r"--hadw_threshold 1.5: must be in \[0, 1\]"):
            common.parse_args(module.Args, ["--hadw_threshold", "1.5"])
        # set where it would do nothing (plain GRPO; another anchor rule): refused in one line, not ignored
        for argv, message in ((["--hadw_anchor", "fixed"], r"--hadw_anchor: applies only with --hadw true "
                                                          r"\(here False\)"),
                              (["--hadw", "true", "--hadw_threshold", "0.2"],
                               r"--hadw_threshold: applies only with --hadw_anchor fixed \(here kalman\)"),
                              (["--hadw_lambda", "2"], r"--hadw_lambda: applies only with --hadw true"),
                              (["--hadw_window", "9"], r"--hadw_window: applies only with --hadw true"),
                              (["--hadw_eta", "0.2"], r"--hadw_eta: applies only with --hadw true"),
                              # eta moves the Kalman anchor only: both of its conditions are checked
                              (["--hadw", "true", "--hadw_anchor", "mean", "--hadw_eta", "0.2"],
                               r"--hadw_eta: applies only with --hadw_anchor kalman \(here mean\)")):
            with pytest.raises(SystemExit, match=message) as e:
                common.parse_args(module.Args, argv)
            assert "\n" not in str(e.value)


def test_every_anchor_rule_logs_the_anchor_over_steps(tmp_path):
    """hadw/anchor is in every step's metrics whichever the rule: kalman (the default, sec. 3), mean,
    fixed."""
    for rule in ("kalman", "mean", "fixed"):
        threshold = ["--hadw_threshold", "0.25"] if rule == "fixed" else []
        run = train_grpo.main(["--engine", "hf", "--task", "mixed", "--hadw", "true", "--hadw_anchor", rule,
                               *threshold, "--steps", "3", "--prompts_per_step", "4",
                               "--group_size", "4", "--eval_every", "0", "--out_dir", str(tmp_path),
                               "--run_name", rule, "--wandb", "false"])
        rows = [r for r in read_metrics(run.run_dir) if "hadw/anchor" in r]
        assert [r["step"] for r in rows] == [1, 2, 3], rule
        if rule == "fixed":
            assert [r["hadw/anchor"] for r in rows] == [0.25] * 3
