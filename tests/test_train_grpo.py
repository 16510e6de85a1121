"""train_grpo.py end to end on CPU: it learns, it resumes exactly, every option runs."""
import json
import math
import os
import shutil

import pytest
import torch

import train_grpo
from conftest import mean_of, read_metrics, run_script, undocumented
from rlmini import checkpoint, dist

SHARED_METRICS = {"reward/mean", "reward/correct", "reward/format", "adv/mean", "adv/abs_mean",
                  "loss/policy", "grad_norm", "clip_frac", "entropy", "len/mean", "time/rollout",
                  "time/update", "time/push", "perf/tokens_per_s"}
NOT_REPRODUCIBLE = ("time/", "perf/", "tools/seconds")  # clocks


def train(tmp_path, *argv):
    return train_grpo.main(["--out_dir", str(tmp_path), "--wandb", "false", *argv])


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_addition_reward_rises_hf_engine(tmp_path, seed):
    run = train(tmp_path, "--engine", "hf", "--steps", "150", "--seed", str(seed), "--run_name", "add")
    rows = read_metrics(run.run_dir)
    start, end = mean_of(rows, "reward/mean", 0, 10), mean_of(rows, "reward/mean", 130, 150)
    assert start < 0.1 and end > start + 0.15, (start, end)
    assert SHARED_METRICS <= set(rows[0]) and not undocumented(rows[0], "grpo")  # docs/metrics.md names all
    # the final policy is exported in HF format and loads back with the trained weights
    from transformers import AutoModelForCausalLM
    final = AutoModelForCausalLM.from_pretrained(os.path.join(run.run_dir, "final"))
    for (n, a), (_, b) in zip(final.named_parameters(), run.model.named_parameters()):
        assert torch.equal(a, b.detach()), n
    assert json.load(open(os.path.join(run.run_dir, "config.json")))["steps"] == 150


@pytest.mark.slow
def test_addition_reward_rises_vllm_engine(tmp_path):
    run_script("train_grpo.py", ["--engine", "vllm", "--steps", "150", "--out_dir", str(tmp_path),
                                 "--run_name", "add", "--wandb", "false", "--eval_every", "150"])
    rows = read_metrics(os.path.join(tmp_path, "add"))
    start, end = mean_of(rows, "reward/mean", 0, 10), mean_of(rows, "reward/mean", 130, 150)
    assert start < 0.1 and end > start + 0.15, (start, end)
    # the trainer recomputes what vLLM sampled: per-token log-probs agree (fp32, CPU)
    assert max(r["logprob/sampler_diff"] for r in rows) < 1e-4
    for key in ("eval/pass@1", "eval/pass@k", "eval/maj@k", "eval/format_fail"):
        assert key in rows[-1], key
    assert rows[-1]["eval/pass@1"] <= rows[-1]["eval/pass@k"]
    assert json.load(open(os.path.join(tmp_path, "add", "eval.json")))["step"] == 150


@pytest.mark.slow
def test_lr_schedule_counts_optimizer_steps(tmp_path):
    """--lr_schedule decays over steps x updates_per_rollout x minibatches optimizer steps (here 3 x 2 x 2):
    after step s the logged lr is the one for optimizer step 4 s, linear to 0 after 2 warm-up steps."""
    run = train(tmp_path, "--engine", "hf", "--steps", "3", "--run_name", "sched", "--lr", "1e-3",
                "--lr_schedule", "linear", *OFF_POLICY[:-1], "2")
    lrs = [r["lr"] for r in read_metrics(run.run_dir)]
    assert lrs == pytest.approx([1e-3 * (1 - (4 * s - 2) / 10) for s in (1, 2, 3)]), lrs  # 0.8, 0.4, 0 x lr


def _rows_without_timing(run_dir):
    return [{k: v for k, v in r.items() if not k.startswith(NOT_REPRODUCIBLE)} for r in read_metrics(run_dir)]


def _same(a, b):
    assert len(a) == len(b)
    for ra, rb in zip(a, b):
        assert ra.keys() == rb.keys()
        for k in ra:
            assert (math.isnan(ra[k]) and math.isnan(rb[k])) or ra[k] == rb[k], (ra["step"], k, ra[k], rb[k])


OFF_POLICY = ["--updates_per_rollout", "2", "--minibatches", "2", "--prompts_per_step", "8", "--warmup", "3"]


@pytest.mark.slow
def test_resume_gives_the_same_metrics_hf(tmp_path):
    train(tmp_path, "--engine", "hf", "--steps", "6", "--save_every", "3", "--run_name", "straight",
          *OFF_POLICY)
    half = train(tmp_path, "--engine", "hf", "--steps", "3", "--save_every", "3", "--run_name", "split",
                 *OFF_POLICY)
    _save_as_a_vllm_run_did(half, tmp_path / "legacy")
    # a crash after step 3's checkpoint: the resumed run rewrites steps 4.. and matches
    for name in ("split", "legacy"):
        train(tmp_path, "--engine", "hf", "--steps", "6", "--save_every", "3", "--run_name", name, "--resume",
              "true", *OFF_POLICY)
        _same(_rows_without_timing(tmp_path / "straight"), _rows_without_timing(tmp_path / name))
    assert (tmp_path / "legacy" / "checkpoint.pt").exists()  # its next saves: a plain process's file
    a = torch.load(tmp_path / "straight" / "checkpoint.pt", weights_only=False)
    b = torch.load(tmp_path / "split" / "checkpoint.pt", weights_only=False)
    assert a["step"] == b["step"] == 6 and a["data_pos"] == b["data_pos"]
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k


def _save_as_a_vllm_run_did(run, run_dir):
    """A copy of `run` whose checkpoint is the checkpoint/ folder a one-process --engine vllm run wrote before
    save followed dist.sharded (vLLM's in-process group of one took the torchrun branch)."""
    shutil.copytree(run.run_dir, run_dir, ignore=shutil.ignore_patterns("checkpoint.pt", ".lock"))
    run.run_dir = str(run_dir)
    torch.distributed.init_process_group("gloo", init_method=f"file://{run_dir}.store", rank=0, world_size=1)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(dist, "sharded", lambda: True)
            checkpoint.save(run)
    finally:
        torch.distributed.destroy_process_group()
    assert sorted(os.listdir(run_dir / "checkpoint")) == [".metadata", "__0_0.distcp", "meta.pt"]


@pytest.mark.parametrize("extra", [
    ["--loss_agg", "token-mean", "--clip_eps_high", "0.28"],                   # DAPO
    ["--ratio_level", "sequence", "--clip_eps", "3e-4", "--clip_eps_high", "4e-4"],  # GSPO
    ["--loss_agg", "seq-mean-token-sum-norm", "--std_norm", "false"],          # Dr. GRPO
    # KL
    ["--beta", "0.04", "--updates_per_rollout", "2", "--micro_batch_size", "5", "--task", "calibration"],
    ["--task", "ordinal", "--gradient_checkpointing", "true"],
])
def test_every_variant_runs_and_logs_sane_metrics(tmp_path, extra):
    run = train(tmp_path, "--engine", "hf", "--steps", "3", "--prompts_per_step", "8", "--run_name", "v",
                *extra)
    rows = read_metrics(run.run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert 0 <= r["clip_frac"] <= 1 and r["entropy"] > 0 and r["len/mean"] >= 1
        assert abs(r["adv/mean"]) < 1e-5  # group-centred advantages
        assert not math.isnan(r["loss/policy"])
    if "--beta" in extra:
        assert all(r["kl"] >= 0 for r in rows) and rows[-1]["kl"] > 0  # k3 is non-negative
    else:
        assert all("kl" not in r for r in rows)  # no reference: absent, not NaN


def test_on_policy_run_never_clips(tmp_path):
    run = train(tmp_path, "--engine", "hf", "--steps", "3", "--prompts_per_step", "8", "--run_name", "on")
    rows = read_metrics(run.run_dir)
    assert all(r["clip_frac"] == 0.0 and r["kl/old"] == 0.0 for r in rows)


def test_failed_positive_fraction_on_ordinal(tmp_path):
    run = train(tmp_path, "--engine", "hf", "--task", "ordinal", "--steps", "5", "--prompts_per_step", "16",
                "--run_name", "o")
    rows = read_metrics(run.run_dir)
    # a random policy on a partial-credit task: GRPO does reward some failures (seed 004, Fig. 1)
    assert max(r.get("adv/failed_pos_frac", 0) for r in rows) > 0.05


def test_decontaminate_drops_overlapping_training_prompts(tmp_path):
    shared = "one two three four five six seven eight nine ten eleven twelve thirteen"
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"prompt": f"{shared} plus", "answer": "1"}, {"prompt": "clean prompt", "answer": "2"},
        {"prompt": "another clean one", "answer": "3"}]))
    (tmp_path / "d.test.jsonl").write_text(json.dumps({"prompt": f"so {shared}", "answer": "1"}))
    run = train(tmp_path, "--engine", "hf", "--task", f"jsonl:{tmp_path}/d.jsonl", "--steps", "1",
                "--prompts_per_step", "2", "--group_size", "2", "--max_new_tokens", "4", "--decontaminate",
                "13",
                "--run_name", "dc")
    assert [e["answer"] for e in run.task.train] == ["2", "3"]
