"""Faults and bad inputs (issue "Nothing lost, nothing silent"): non-finite rewards and gradients, a collapsed
policy, runs protected from being overwritten or shared, resume against changed options or another algorithm,
a torn metrics line, and one-line errors at the entry points."""
import errno
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import common
import train_grpo
import train_ppo
import train_rloo
from conftest import ROOT, read_metrics
from rlmini import checkpoint, faults, rollouts, runlog

BASE = ["--wandb", "false", "--engine", "hf", "--prompts_per_step", "4", "--group_size", "4"]


def train(script, tmp_path, *argv):
    return script.main(["--out_dir", str(tmp_path), *BASE, *argv])


def finite_checkpoint(run_dir):
    state = torch.load(os.path.join(run_dir, "checkpoint.pt"), weights_only=False)
    return all(torch.isfinite(v).all() for v in state["model"].values())


# ------------------------------------------------------------------------------------------ non-finite values


def nan_at_step(monkeypatch, step):
    """The overlong penalty (added to every reward) returns NaN for the first completion at `step` (every
    step from `-step` on when negative)."""
    calls, penalty = [], common.overlong_penalty

    def nan_penalty(rollouts, *a):
        calls.append(1)
        out = penalty(rollouts, *a)
        if len(calls) == step or -len(calls) <= step < 0:
            out[0] = float("nan")
        return out
    monkeypatch.setattr(rollouts, "overlong_penalty", nan_penalty)


def test_a_nan_reward_stops_the_run_naming_it(tmp_path, monkeypatch):
    nan_at_step(monkeypatch, 2)
    with pytest.raises(faults.NonFiniteError, match=r"step 2: 1 non-finite reward\(s\), the first nan for "
                                                    r"completion 1 of prompt '\d\+\d='"):
        train(train_grpo, tmp_path, "--steps", "3", "--save_every", "1", "--run_name", "r")
    assert [r["step"] for r in read_metrics(tmp_path / "r")] == [1]
    assert finite_checkpoint(tmp_path / "r")


def test_a_nan_reward_with_skip_skips_that_update_only(tmp_path, monkeypatch):
    nan_at_step(monkeypatch, 2)
    skipped = train(train_grpo, tmp_path, "--steps", "2", "--on_nonfinite", "skip", "--run_name", "skip")
    monkeypatch.undo()
    straight = train(train_grpo, tmp_path, "--steps", "1", "--run_name", "one")
    rows = read_metrics(skipped.run_dir)
    assert [r["nonfinite/skipped"] for r in rows] == [0, 1] and "grad_norm" not in rows[1]
    for a, b in zip(skipped.model.parameters(), straight.model.parameters()):  # step 2 changed nothing
        assert torch.equal(a, b)
    assert finite_checkpoint(skipped.run_dir)


def test_a_run_whose_every_update_is_skipped_stops_after_five_steps(tmp_path, monkeypatch):
    nan_at_step(monkeypatch, -2)  # from step 2 on: a run that trains nothing must not end with status 0
    with pytest.raises(faults.NonFiniteError, match=r"^step 6: every update of the last 5 steps was skipped"):
        train(train_grpo, tmp_path, "--steps", "9", "--on_nonfinite", "skip", "--run_name", "dead")
    assert [r["nonfinite/skipped"] for r in read_metrics(tmp_path / "dead")] == [0, 1, 1, 1, 1]


def test_skipped_steps_count_only_steps_that_tried_an_update():
    run = SimpleNamespace(skipped_steps=0, step=0)
    # (skipped, updates) per step: a step with nothing to update (a filter kept nothing) neither counts nor
    # breaks the streak; one update made resets it
    for skipped, updates in [(1, 0)] * 4 + [(0, 0), (1, 1), (1, 0), (0, 0)] + [(2, 0)] * 3:
        run.step += 1
        faults.check_skipped(run, SimpleNamespace(skipped=skipped, updates=updates))
    assert run.skipped_steps == 4
    with pytest.raises(faults.NonFiniteError, match="^step 12: every update of the last 5 steps"):
        run.step += 1
        faults.check_skipped(run, SimpleNamespace(skipped=1, updates=0))


def test_an_exploding_update_stops_before_the_weights_turn_nan(tmp_path):
    with pytest.raises(faults.NonFiniteError, match="the gradient norm is (nan|inf)"):
        train(train_grpo, tmp_path, "--steps", "10", "--lr", "1e30", "--grad_clip", "0", "--save_every", "1",
              # (seed 0: stops at step 4)
              "--prompts_per_step", "32", "--group_size", "8", "--run_name", "lr")
    assert finite_checkpoint(tmp_path / "lr")


def test_ppo_skips_a_nonfinite_update_of_policy_or_critic(tmp_path, monkeypatch):
    nan_at_step(monkeypatch, 1)
    run = train(train_ppo, tmp_path, "--steps", "1", "--on_nonfinite", "skip", "--run_name", "ppo")
    assert read_metrics(run.run_dir)[0]["nonfinite/skipped"] == 1
    assert finite_checkpoint(run.run_dir)


def test_no_checkpoint_is_written_from_nonfinite_weights(tmp_path):
    run = train(train_grpo, tmp_path, "--steps", "1", "--run_name", "ck")
    before = open(os.path.join(run.run_dir, "checkpoint.pt"), "rb").read()
    with torch.no_grad():
        next(run.model.parameters())[0, 0] = float("inf")
    with pytest.raises(faults.NonFiniteError, match="1 non-finite weights; no checkpoint was written"):
        common.checkpoint(run)
    assert open(os.path.join(run.run_dir, "checkpoint.pt"), "rb").read() == before


def test_a_collapsed_policy_is_reported_once_per_streak(capsys):
    run = SimpleNamespace(quiet_steps=0, step=0, args=SimpleNamespace(lr=1e6))
    signal = [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    for g in signal:
        run.step += 1
        faults.warn_on_collapse(run, {"grad_norm": g, "entropy": 2.0, "reward/mean": 0.0})
    err = capsys.readouterr().err
    assert err.count("no learning signal for 5 steps") == 1 and "step 6:" in err and "--lr 1000000.0" in err
    # entropy at its floor
    faults.warn_on_collapse(run, {"grad_norm": 0.3, "entropy": 0.0, "reward/mean": 0.0})
    assert run.quiet_steps == 2


# --------------------------------------------------------------------------------------------- protected runs


def test_an_existing_run_is_not_overwritten_without_asking(tmp_path):
    train(train_grpo, tmp_path, "--steps", "1", "--run_name", "x")
    rows = open(tmp_path / "x" / "metrics.jsonl").read()
    with pytest.raises(SystemExit, match=r"x already holds a run \(metrics.jsonl, config.json, "
                                         r"checkpoint.pt, final\): pass --resume true to continue it, "
                                         r"--overwrite true to replace it"):
        train(train_grpo, tmp_path, "--steps", "2", "--run_name", "x")
    assert open(tmp_path / "x" / "metrics.jsonl").read() == rows
    run = train(train_grpo, tmp_path, "--steps", "2", "--run_name", "x", "--overwrite", "true",
                "--save_every", "0")
    assert [r["step"] for r in read_metrics(run.run_dir)] == [1, 2]


def test_a_second_process_on_the_same_run_folder_is_refused(tmp_path):
    run_dir = tmp_path / "busy"
    run_dir.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, sys, time\n"
        f"f = open({str(run_dir / '.lock')!r}, 'a+'); fcntl.lockf(f, fcntl.LOCK_EX); f.write('4242'); "
        "f.flush()\n"
        "print('locked', flush=True); time.sleep(120)")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(SystemExit, match=r"busy is in use by another training process \(pid 4242"):
            train(train_grpo, tmp_path, "--steps", "1", "--run_name", "busy")
    finally:
        holder.kill()
        holder.wait()
    train(train_grpo, tmp_path, "--steps", "1", "--run_name", "busy")  # a dead holder leaves no stale lock


def test_resume_refuses_changed_options_and_another_algorithm(tmp_path):
    train(train_grpo, tmp_path, "--steps", "1", "--run_name", "g")
    with pytest.raises(SystemExit, match=r"options differ .*--group_size 4 -> 8; --lr 0.0003 -> 0.001\. Pass "
                                         r"--allow_option_changes true"):
        train(train_grpo, tmp_path, "--steps", "2", "--run_name", "g", "--resume", "true", "--group_size",
              "8",
              "--lr", "1e-3")
    for script in (train_rloo, train_ppo):  # was: silently continued (RLOO), KeyError 'critic' (PPO)
        with pytest.raises(SystemExit, match="was trained by train_grpo.py, not train_(rloo|ppo).py"):
            train(script, tmp_path, "--steps", "2", "--run_name", "g", "--resume", "true")
    run = train(train_grpo, tmp_path, "--steps", "2", "--run_name", "g", "--resume", "true", "--eval_every",
                "2",
                "--eval_limit", "2")  # how the run is logged and evaluated may change
    assert read_metrics(run.run_dir)[-1]["step"] == 2
    run = train(train_grpo, tmp_path, "--steps", "3", "--run_name", "g", "--resume", "true", "--lr", "1e-4",
                "--allow_option_changes", "true")
    assert json.load(open(os.path.join(run.run_dir, "config.json")))["lr"] == 1e-4


def test_resume_drops_a_torn_last_metrics_line(tmp_path, capsys):
    train(train_grpo, tmp_path, "--steps", "2", "--run_name", "t", "--save_every", "1")
    with open(tmp_path / "t" / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "reward/me')  # a crash in the middle of a write
    run = train(train_grpo, tmp_path, "--steps", "3", "--run_name", "t", "--resume", "true")
    assert [r["step"] for r in read_metrics(run.run_dir)] == [1, 2, 3]
    assert "dropped a torn last line (line 3" in capsys.readouterr().err


def test_keep_checkpoint_false_leaves_final_only_and_resume_says_why(tmp_path, capsys):
    """--keep_checkpoint false: the checkpoints written while it ran (--save_every 1) are removed once final/
    is written, nothing half-removed is left, the run says so; --resume then names why in one line."""
    run = train(train_grpo, tmp_path, "--steps", "2", "--run_name", "k", "--save_every", "1",
                "--keep_checkpoint", "false")
    left = os.listdir(run.run_dir)
    assert "final" in left and not [f for f in left if f.startswith("checkpoint")], left
    assert "removed checkpoint.pt (--keep_checkpoint false): the run cannot be extended with --resume" in \
        capsys.readouterr().out
    with pytest.raises(SystemExit, match=r"^--resume true: \S+k finished without its checkpoint "
                                         r"\(--keep_checkpoint false\); final/ holds the weights but not "
                                         r"the optimizer: start a new run from them, the same command with "
                                         r"--model (\S+k/final) and without --resume, --run_name and "
                                         r"--overwrite") as e:
        train(train_grpo, tmp_path, "--steps", "3", "--run_name", "k", "--resume", "true")
    final = str(e.value).split("--model ")[1].split()[0]
    # the advice works: the new run is named after k (was: ...-final-..., and --run_name k deleted final/)
    new = train(train_grpo, tmp_path, "--steps", "1", "--model", final)
    assert os.path.basename(new.run_dir) == "grpo-addition-k-s0" and os.path.isdir(final)
    with pytest.raises(SystemExit, match=r"--model \S+k/final lies in \S+k/final, which this run writes or "
                                         r"replaces"):  # the same run name, --overwrite: refused, kept
        train(train_grpo, tmp_path, "--steps", "1", "--model", final, "--run_name", "k", "--overwrite",
              "true")
    assert os.path.isfile(os.path.join(final, "rlmini.json"))


def test_resume_without_a_checkpoint_creates_nothing(tmp_path):
    with pytest.raises(SystemExit, match="--resume true: no checkpoint in"):
        train(train_grpo, tmp_path, "--steps", "1", "--run_name", "none", "--resume", "true")
    assert not (tmp_path / "none").exists()


# ---------------------------------------------------------------------------------------------- entry points


@pytest.mark.slow
@pytest.mark.parametrize("argv, message", [
    (["--task", "jsonl:/nonexistent/data.jsonl"], "/nonexistent/data.jsonl"),
    (["--out_dir", "README.md"], "--out_dir README.md: is a file, not a folder"),
])
def test_bad_input_is_one_line_and_exit_2_at_the_entry_point(tmp_path, argv, message):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "train_grpo.py"), "--out_dir", str(tmp_path),
                           *BASE, "--steps", "1", *argv], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "WANDB_MODE": "disabled"})
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not os.listdir(tmp_path)  # nothing created


@pytest.mark.parametrize("script, argv, message", [
    ("train_grpo", ["--lr", "-1"], "bad option (command line): --lr -1.0: must be > 0"),
    ("train_grpo", ["--nosuch", "1"], "unknown option(s) ['--nosuch', '1']: see --help for the options"),
    ("train_grpo", ["--task", "nosuch"], "error: --task 'nosuch': unknown task; choose addition[:N]"),
    ("train_rloo", ["--group_size", "1"], "--group_size 1: must be >= 2 (the group baseline needs two"),
    ("train_grpo", ["--model", "/nonexistent/model"], "--model /nonexistent/model: no such folder"),
    ("eval", ["--nosuch", "1"], "bad option (command line): unrecognized arguments: --nosuch 1"),
    ("eval", ["--n", "0"], "--n 0: must be >= 1"),
    ("eval", ["--task", "nosuch"], "error: --task 'nosuch': unknown task"),
    ("eval", ["--model", "/nonexistent/model"], "--model /nonexistent/model: no such folder"),
])
def test_every_refusal_is_one_line_and_exit_status_2(tmp_path, script, argv, message, capsys):
    """One convention for bad input at both entry points (the trainers, eval.py): options, tasks, models,
    whatever raises it, end in one line and status 2 (faults.REFUSED); 1 is a traceback, 130 a Ctrl-C."""
    import importlib
    entry = importlib.import_module(script).main
    with pytest.raises(SystemExit) as e:
        with faults.user_errors():
            entry([*argv, "--out_dir" if script != "eval" else "--out", str(tmp_path / "o")])
    assert e.value.code == faults.REFUSED == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and message in err[-1] and "Traceback" not in "".join(err), err


def bad_config(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("make_argv, message", [
    (lambda t: ["--config"], "--config needs a file"),  # was: IndexError
    # was: ScannerError
    (lambda t: ["--config", bad_config(t, "c.yaml", "lr: [0.1\n")], r"c.yaml: not valid YAML"),
    (lambda t: ["--config", bad_config(t, "l.yaml", "lr: [1, 2]\n")],  # was: TypeError
     r"l.yaml: option\(s\) \['lr'\] need a single value"),
    (lambda t: ["--config", bad_config(t, "s.yaml", "- 1\n- 2\n")], r"expected a mapping of option: value"),
    (lambda t: ["--config", bad_config(t, "f.yaml", "save_every: 1.7\n")],
     r"--save_every: invalid int value: '1.7'"),
    (lambda t: ["--lr", "-1"], r"--lr -1.0: must be > 0"),
    (lambda t: ["--lr", "inf"], r"--lr inf: must be a finite number"),
    (lambda t: ["--temperature", "0"], r"--temperature 0: greedy decoding is no distribution to train on"),
    (lambda t: ["--grad_clip", "-1"], r"--grad_clip -1.0: must be >= 0"),  # was: gradient ascent
    (lambda t: ["--max_new_tokens", "-1"], r"--max_new_tokens -1: must be >= 0"),
    # was: "bad hub id"
    (lambda t: ["--model", "/nonexistent/model"], r"--model /nonexistent/model: no such folder"),
    # empty folder
    (lambda t: ["--model", str(t)], r"the folder has no config.json, no weights .* no tokenizer files"),
    (lambda t: ["--out_dir", os.path.join(ROOT, "README.md", "runs")], r"cannot create .*README.md/runs/x"),
])
def test_bad_options_and_models_are_one_line(tmp_path, make_argv, message):
    with pytest.raises(SystemExit, match=message):
        train_grpo.main(["--out_dir", str(tmp_path / "out"), *BASE, "--steps", "1", "--run_name", "x",
                         *make_argv(tmp_path)])


def test_a_tiny_checkpoint_on_prompts_its_tokenizer_cannot_read_is_refused(tmp_path, tiny_addition):
    """The tiny model's tokenizer covers its task's alphabet only: a checkpoint trained on addition given an
    rg: task (was: every prompt letter trained on as <unk>) stops training and evaluation at start-up in one
    line naming the model, the task, the prompt and the character; a tiny model built for the task passes."""
    import re

    import eval as ev
    import rewards
    from rlmini import checkpoint as ckpt
    from rlmini import data, models
    model, tok, _ = tiny_addition
    final = str(tmp_path / "final")
    ckpt.save_final(model, tok, final, "tiny")
    message = (rf"{re.escape(final)} on --task rg:basic_arithmetic: train prompt #1 'Calculate .*' has 'C', "
               r"which the tiny model's tokenizer .* reads as <unk>: use a real tokenizer, e.g. --model "
               r"smollm2")
    task = ["--task", "rg:basic_arithmetic", "--rg_size", "20"]
    with pytest.raises(SystemExit, match=message):
        train(train_grpo, tmp_path / "out", "--model", final, *task, "--steps", "1")
    assert not (tmp_path / "out").exists()  # refused before the run's folder is made
    with pytest.raises(SystemExit, match=message):
        ev.cmd_evaluate(["--model", final, *task, "--n", "1", "--engine", "hf", "--out", str(tmp_path / "e")])
    odd = SimpleNamespace(train=[{"prompt": "1+2="}], test=[{"prompt": "3+4="}, {"prompt": "5\u00d76="}])
    with pytest.raises(SystemExit, match=r"--model m on --task odd: test prompt #2 '5\u00d76=' has '\u00d7'"):
        data.check_vocabulary(odd, tok, "tiny", "m", "odd")
    data.check_vocabulary(odd, tok, "chat", "m", "odd")  # a real tokenizer's <unk> is its own business
    rg = rewards.load_task("rg:basic_arithmetic", rg_size=20)
    built = models.load_tokenizer(models.build_tiny_model(rg.alphabet))
    data.check_vocabulary(rg, built, "tiny", "tiny", "rg:basic_arithmetic")


def test_unknown_and_abbreviated_flags_and_bad_choices_are_refused(tmp_path):
    for flag in (["--temp", "0.5"], ["--no_such_flag", "1"]):  # --temp was silently --temperature
        with pytest.raises(SystemExit, match=r"unknown option\(s\) \['%s', '%s'\]: see --help" % tuple(flag)):
            train_grpo.main(["--out_dir", str(tmp_path), *BASE, *flag])
    with pytest.raises(SystemExit, match=r"bad option \(command line\): argument --loss_agg: invalid choice: "
                                         r"'mean'"):  # one line, not argparse's usage screen
        train_grpo.main(["--out_dir", str(tmp_path), *BASE, "--loss_agg", "mean"])


# -------------------------------------------------------------------------------------- killed and full disks

# the disk fills after `room` bytes of this file: torch's writers meet it as on a real disk
FULL = """class Full:
    def __init__(self, f, room): self.f, self.room = f, room
    def write(self, b):
        if memoryview(b).nbytes > self.room: raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= memoryview(b).nbytes; return self.f.write(b)
    def __getattr__(self, name): return getattr(self.f, name)"""

DYING_SAVE = """
import errno, os, signal, sys, torch
sys.path.insert(0, {root!r})
import train_grpo
real, calls = torch.save, [0]
{full}
def save(obj, f, *a, **k):  # the {k}-th checkpoint write is cut short
    calls[0] += 1
    if calls[0] == {k}:
        if {enospc}:  # torch then raises a RuntimeError from its writer's __exit__, the OSError its context
            return real(obj, Full(f, 1000), *a, **k)
        f.write(b"half a checkpoint"); f.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    return real(obj, f, *a, **k)
torch.save = save
with train_grpo.common.user_errors():  # the entry point's own, as `python train_grpo.py` runs it
    train_grpo.main({argv!r})
"""


def dying_run(argv, k, enospc=False):
    code = DYING_SAVE.format(root=ROOT, k=k, enospc=enospc, argv=argv, full=FULL)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "WANDB_MODE": "disabled"})


@pytest.mark.slow
def test_sigkill_during_a_checkpoint_write_then_resume_equals_a_straight_run(tmp_path):
    argv = ["--out_dir", str(tmp_path), *BASE, "--steps", "4", "--save_every", "1"]
    straight = train(train_grpo, tmp_path, "--steps", "4", "--save_every", "1", "--run_name", "straight")
    proc = dying_run([*argv, "--run_name", "killed"], k=3)  # killed while writing step 3's checkpoint
    assert proc.returncode == -9
    assert [r["step"] for r in read_metrics(tmp_path / "killed")] == [1, 2, 3]  # step 3 logged, not saved
    assert torch.load(tmp_path / "killed" / "checkpoint.pt", weights_only=False)["step"] == 2  # intact
    resumed = train(train_grpo, tmp_path, "--steps", "4", "--save_every", "1", "--run_name", "killed",
                    "--resume", "true")
    assert [r["step"] for r in read_metrics(resumed.run_dir)] == [1, 2, 3, 4]  # none duplicated or missing
    for a, b in zip(straight.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_a_full_disk_during_a_save_leaves_the_previous_checkpoint(tmp_path):
    proc = dying_run(["--out_dir", str(tmp_path), *BASE, "--steps", "3", "--save_every", "1", "--run_name",
                      "full"],
                     k=2, enospc=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "checkpoint.pt (No space left on device); the previous checkpoint is intact" in proc.stderr
    assert torch.load(tmp_path / "full" / "checkpoint.pt", weights_only=False)["step"] == 1
    assert not (tmp_path / "full" / "checkpoint.pt.tmp").exists()


SAFETENSORS_FULL = type("SafetensorError", (Exception,), {})  # no OSError: the errno only in its text


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, "No space left on device"), SAFETENSORS_FULL(
    "Error while serializing: I/O error: No space left on device (os error 28)")])
def test_a_full_disk_during_the_final_save_keeps_the_previous_one_and_leaves_no_partial_one(tmp_path, error):
    from transformers import GPT2Config, GPT2LMHeadModel
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=1, n_embd=8, vocab_size=16, n_positions=8))
    final = tmp_path / "final"
    final.mkdir()
    (final / "before").write_text("the previous final/")
    real = model.save_pretrained

    def full(path, **kw):  # half the weights written, then the disk is full
        real(path, **kw)
        with open(os.path.join(path, "model.safetensors"), "r+b") as f:
            f.truncate(100)
        raise error
    model.save_pretrained = full
    tokenizer = SimpleNamespace(save_pretrained=lambda path: None)
    with pytest.raises(SystemExit, match=r"could not write .*final \(.*No space left on device.*\); the"):
        checkpoint.save_final(model, tokenizer, str(final))
    assert os.listdir(final) == ["before"] and not (tmp_path / "final.tmp").exists()


SHARDED_FULL = """import contextlib, errno, os, sys, torch
sys.path.insert(0, {root!r})
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh
from rlmini import checkpoint
torch.distributed.init_process_group("gloo")
rank = torch.distributed.get_rank()
mesh = init_device_mesh("cpu", (2,))
{full}
fail = {{}}
real_stream, real_save = FileSystem.create_stream, torch.save
@contextlib.contextmanager
def stream(self, path, mode):  # dcp's files: (rank, name's end) meets a full disk
    with real_stream(self, path, mode) as f:
        hit = fail.get("stream") and fail["stream"][0] == rank and str(path).endswith(fail["stream"][1])
        yield Full(f, 100) if hit else f
def save_meta(obj, f, *a, **k):  # rank 0's meta.pt: a full disk, or another error
    if fail.get("meta") and rank == 0 and getattr(f, "name", "").endswith("meta.pt"):
        if fail["meta"] == "value":
            raise ValueError("not a disk's")
        f = Full(f, 100)
    return real_save(obj, f, *a, **k)
FileSystem.create_stream, torch.save = stream, save_meta
path = os.path.join({out!r}, "checkpoint")
def save(step, **failure):
    fail.clear(); fail.update(failure)
    state = {{"w": distribute_tensor(torch.arange(4096.) + step, mesh, [Shard(0)])}}
    try:
        checkpoint.save_sharded_checkpoint(path, state, {{"step": step}})
        said = "saved"
    except SystemExit as e:
        said = str(e)
    except Exception as e:
        said = type(e).__name__
    torch.distributed.barrier()
    return said, os.path.exists(path + ".tmp")
out = [save(1), save(2, stream=(1, ".distcp")), save(3, stream=(0, ".distcp")),
       save(4, stream=(0, ".metadata.tmp")), save(5, meta="full"), save(6, meta="value")]
out.append(torch.load(os.path.join(path, "meta.pt"))["step"])
out.append(save(7))
w = distribute_tensor(torch.zeros(4096), mesh, [Shard(0)])
dcp.load({{"w": w}}, checkpoint_id=path)
out.append(torch.equal(w.to_local(), (torch.arange(4096.) + 7).chunk(2)[rank]))
os.write(1, ("RESULT %d %r\\n" % (rank, out)).encode())
torch.distributed.destroy_process_group()
"""


@pytest.mark.slow
def test_a_full_disk_during_a_sharded_checkpoint_stops_every_rank_in_one_line(tmp_path):
    """torchrun: a full disk in a shard (rank 1's, rank 0's), in dcp's .metadata or in rank 0's meta.pt stops
    every rank with the same line (none left waiting in a collective), the partial folder removed, the
    previous checkpoint kept; another error on rank 0 keeps its traceback there and names it on the others."""
    script = tmp_path / "full.py"
    script.write_text(SHARDED_FULL.format(root=ROOT, out=str(tmp_path), full=FULL))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(script)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = sorted(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))
    kept = "the previous checkpoint is intact"
    full = (f"could not write {tmp_path / 'checkpoint'} (No space left on device); {kept}", False)
    named = f"could not write {tmp_path / 'checkpoint'} (rank 0: ValueError: not a disk's); {kept}"
    other = {0: ("ValueError", False), 1: (named, False)}
    assert results == [f"RESULT {r} {[('saved', False), *[full] * 4, other[r], 1, ('saved', False), True]!r}"
                       for r in (0, 1)], proc.stdout[-2000:]


# ------------------------------------------------------------------------------------ logs without a terminal


def test_without_a_terminal_a_line_every_n_steps(tmp_path, capsys):
    train(train_grpo, tmp_path, "--steps", "5", "--print_every", "2", "--run_name", "quiet", "--save_every",
          "0")
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("step ")]
    assert [x.split(" |")[0] for x in lines] == ["step 2/5", "step 4/5", "step 5/5"]  # and the last step
    assert "| reward " in lines[0] and " s/step | ETA 0:00:" in lines[0]
    line = runlog.progress_line(50, 200, {"reward/mean": 0.25, "kl": float("nan"), "len/mean": 3.0}, 1.5)
    assert line == "step 50/200 | reward 0.25 | len 3 | 1.50 s/step | ETA 0:03:45"  # NaN metrics left out


def test_prompts_longer_than_the_context_are_dropped_and_counted(tmp_path, capsys):
    data = tmp_path / "long.jsonl"
    rows = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(20)]
    rows[3]["prompt"] = "x" * 600  # the tiny model's context is 512 tokens (one per character here)
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = train(train_grpo, tmp_path, "--task", f"jsonl:{data}", "--steps", "1", "--max_new_tokens", "8",
                "--run_name", "long", "--save_every", "0", "--jsonl_reward", "exact")
    err = capsys.readouterr().err
    assert (
        "dropped 1 of 18 train prompts longer than the model's context (512 tokens) less --max_new_tokens 8; "
        "the first, #4 (6" in err
    )
    assert len(run.task.train) == 17 and all(len(e["prompt"]) < 600 for e in run.task.train)
