"""The rollout engine's life in the training loop (generate, sleep, update, push + check, evaluate),
the per-step sampler/trainer guard, and the rollout correction end to end.

vLLM's sleep mode exists only on CUDA; tests/engine_double.py emulates its level-2 sleep on CPU
(weights overwritten with garbage at every sleep), and a push that silently does nothing."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

import common
import train_gpg
import train_grpo
from conftest import ROOT, VLLM_INFO, not_ours, read_metrics
from rlmini import engine, faults
from rlmini.engine import HFEngine, VLLMEngine

DOUBLE = os.path.join(ROOT, "tests", "engine_double.py")


def run_double(tmp_path, mode, *flags):
    report = tmp_path / f"{mode}.json"
    proc = subprocess.run([sys.executable, DOUBLE, mode, str(report), "train_grpo.py", "--out_dir",
                           str(tmp_path),
                           "--run_name", mode, "--wandb", "false", "--prompts_per_step", "8", *flags],
                          cwd=ROOT, env={**os.environ, "WANDB_MODE": "disabled"}, capture_output=True,
                          text=True,
                          timeout=900)
    return proc, json.load(open(report))


@pytest.mark.slow
def test_level2_sleep_with_evaluation_every_step_trains_on_the_pushed_weights(tmp_path):
    """Before the fix, evaluate() put the engine to sleep (level 2 discards vLLM's weights) after the
    push, so the next step sampled from garbage; now evaluation leaves the engine awake with the
    pushed weights, and a sleeping engine refuses to generate."""
    proc, counts = run_double(tmp_path, "discard", "--steps", "4", "--eval_every", "1", "--eval_limit", "8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not not_ours(proc.stdout, proc.stderr)  # vLLM's output is in the run's log (rlmini/quiet.py)
    assert VLLM_INFO.search(open(tmp_path / "discard" / "logs" / "rank0.log").read())
    assert counts == {"sleeps": 4, "pushes": 4}  # the double really discarded the weights after every rollout
    rows = read_metrics(tmp_path / "discard")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["logprob/sampler_diff"] < 1e-4 and "eval/pass@1" in r for r in rows)


@pytest.mark.slow
def test_stale_engine_weights_stop_the_run_at_the_next_step(tmp_path):
    """Pushes that do nothing: the run stops at the first step after the weights first changed (a step whose
    rewards are all equal has no gradient, and vLLM's stale weights are then still the policy's)."""
    proc, counts = run_double(tmp_path, "stale", "--steps", "4", "--push_check_every", "0")
    assert proc.returncode != 0
    rows = read_metrics(tmp_path / "stale")  # the failing step was never logged or saved
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)) and len(rows) < 4
    err = proc.stderr.splitlines()  # one line: the libraries' output went to the run's log
    assert len(err) == 1 and err[0].startswith(f"error: RolloutMismatchError: step {len(rows) + 1}:"), err
    assert "stale or discarded weights" in err[0] and not not_ours(proc.stdout)
    assert proc.returncode == 2
    assert rows[-1]["grad_norm"] > 0 and all(r["grad_norm"] == 0 for r in rows[:-1])
    assert counts["pushes"] == len(rows)


def test_a_sleeping_engine_refuses_to_generate_on_every_device(tiny_addition):
    """From sleep() to push() both engines refuse to generate, also where sleeping frees nothing (CPU vLLM,
    the HF engine): a script that generates in the wrong place of the step fails in CPU tests too, not only
    on CUDA, where vLLM would sample from discarded weights. The message names the fix."""
    model, tok, _ = tiny_addition
    for sampler in (VLLMEngine(None, None, tok, sleep_mode=False), HFEngine(model, tok)):
        sampler.sleep()
        with pytest.raises(engine.EngineStateError, match=r"generate\(\) after run.engine.sleep\(\): .* call "
                                                          r"common.generate before run.engine.sleep\(\)"):
            sampler.generate([[4, 13, 5, 14]], 2, 4, 1.0, 0)
    sampler.push()  # the HF engine: awake again
    assert len(sampler.generate([[4, 13, 5, 14]], 2, 4, 1.0, 0).completion_ids) == 2


def test_extra_generation_after_the_engine_sleeps_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    """A script that asks for extra completions after run.engine.sleep() (here: in place of pre_update) stops
    at once, in one line naming the fix, exit status 2."""
    pre_update = common.pre_update

    def late(run, batch, *a, **k):
        common.generate(run, batch.examples, 1, temperature=0)
        return pre_update(run, batch, *a, **k)

    monkeypatch.setattr(common, "pre_update", late)
    with pytest.raises(SystemExit) as stop, common.user_errors():
        train(tmp_path, "--steps", "1", "--run_name", "late")
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        "error: EngineStateError: generate() after run.engine.sleep(): the engine sleeps from the end of the "
        "rollout to run.engine.push()")


def train(tmp_path, *argv, module=train_grpo):
    return module.main(["--out_dir", str(tmp_path), "--wandb", "false", "--engine", "hf",
                        "--prompts_per_step", "8",
                        *argv])


def shift_sampler_logprobs(monkeypatch, noise):
    """Emulate a sampler that disagrees with the trainer: its log-probs are shifted token by token."""
    generate = HFEngine.generate

    def shifted(*a, **k):
        r = generate(*a, **k)
        r.sampler_logprobs = [[x + noise(x) for x in lp] for lp in r.sampler_logprobs]
        return r

    monkeypatch.setattr(HFEngine, "generate", shifted)


def test_guard_names_the_step_and_the_causes(tmp_path, monkeypatch):
    shift_sampler_logprobs(monkeypatch, lambda x: 0.01)
    with pytest.raises(faults.RolloutMismatchError, match=r"step 1: .* by 0.01 on average .*> "
                                                          r"--sampler_diff_tol 0.001"):
        train(tmp_path, "--steps", "2", "--run_name", "g")
    assert not os.path.exists(tmp_path / "g" / "checkpoint.pt")
    # the flag moves it
    run = train(tmp_path, "--steps", "1", "--run_name", "g2", "--sampler_diff_tol", "0.02")
    assert read_metrics(run.run_dir)[0]["logprob/sampler_diff"] == pytest.approx(0.01, rel=1e-3)


def _rows(run):
    return [{k: v for k,
             v in r.items() if not k.startswith(("time/", "perf/"))} for r in read_metrics(run.run_dir)]


@pytest.mark.parametrize("mode", ["token-tis", "token-mis", "seq-mis"])
def test_with_agreeing_fp32_engines_every_correction_leaves_the_run_unchanged(tmp_path, mode):
    """HF engine, fp32: sampler and trainer agree to ~1e-7, so the weights are 1 to 1e-6 and the run
    equals the uncorrected one (to float rounding: the weights are 1 +- 1e-7, not exactly 1)."""
    off = _rows(train(tmp_path, "--steps", "3", "--run_name", "off"))
    on = _rows(train(tmp_path, "--steps", "3", "--run_name", mode, "--rollout_correction", mode))
    for a, b in zip(off, on):
        assert abs(b["is/mean"] - 1) < 1e-6 and b["is/clip_frac"] == 0 and b["is/kl"] < 1e-10
        for k in a:
            same = a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6)
            assert (math.isnan(a[k]) and math.isnan(b[k])) or same, k


@pytest.mark.parametrize("mode", ["off", "token-tis", "token-mis", "seq-mis"])
def test_each_correction_reacts_to_an_injected_mismatch(tmp_path, monkeypatch, mode):
    g = torch.Generator().manual_seed(0)
    shift_sampler_logprobs(monkeypatch, lambda x: float(torch.randn(1, generator=g)) * 0.7)
    rows = read_metrics(train(tmp_path, "--steps", "2", "--run_name", mode, "--rollout_correction", mode,
                              "--sampler_diff_tol", "10").run_dir)
    for r in rows:
        assert r["is/kl"] > 0.05 and 0.4 < r["logprob/sampler_diff"] < 0.8
        # N(0, .7) log-noise leaves [1/2, 2] for some tokens
        assert (r["is/clip_frac"] == 0) == (mode == "off")
        if mode == "seq-mis":
            assert r["is/clip_frac"] < 0.5  # whole completions dropped: their geometric mean is the outlier


def test_gpg_first_sampling_round_draws_what_grpo_draws(tmp_path):
    """One seed function for every script: at the same --seed, GPG's first round samples GRPO's batch."""
    a = read_metrics(train(tmp_path, "--steps", "1", "--run_name", "grpo").run_dir)[0]
    b = read_metrics(train(tmp_path, "--steps", "1", "--run_name", "gpg", "--beta_th", "0",
                           module=train_gpg).run_dir)[0]
    keys = ("len/mean", "reward/format", "len/truncated")
    assert [a[k] for k in keys] == [b[k] for k in keys]
