"""Ctrl-C (rlmini/faults.py::interrupted): a SIGINT in any phase of a step (rollout, update, push, evaluation)
ends a trainer in one line naming the step, the last checkpoint and the command that continues (exit 130),
and that command continues the run; the same with a real Ctrl-C to the whole process group on the HF and
vLLM engines and under 2 gloo ranks, and in eval.py."""
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest
import torch

import common
import train_grpo
from conftest import ROOT, read_metrics, run_script
from rlmini import engine, faults
from rlmini.task import DataError

BASE = ["--wandb", "false", "--engine", "hf", "--prompts_per_step", "4", "--group_size", "4"]
LINE = re.compile(r"^interrupted \(Ctrl-C\) in step (\d+) of (\d+); last checkpoint (\S+) \(step (\d+)\); "
                  r"continue with: (.+) --resume true$")


@pytest.fixture
def sigint_restored():
    """interrupted() ignores SIGINT from then on (a second one ends nothing half-closed): undo it here; and
    start from Python's own handler, whatever an earlier test of the session left (one ran with SIGINT
    not reaching the run once in the whole suite, never alone)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _interrupt_on(monkeypatch, owner, name, call):
    """A real SIGINT to this process from inside owner.name on its call-th call."""
    calls, real = [], getattr(owner, name)

    def wrapped(*a, **k):
        calls.append(1)
        if len(calls) == call:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the handler runs at the next bytecode: KeyboardInterrupt is raised in here
        return real(*a, **k)
    monkeypatch.setattr(owner, name, wrapped)


@pytest.mark.parametrize("phase, owner, name, call, step", [
    ("rollout", engine.HFEngine, "generate", 4, 3),  # calls: steps 1, 2, step 2's evaluation, step 3
    ("update", common, "optimizer_step", 3, 3),
    ("push", engine.HFEngine, "push", 3, 3),
    ("evaluation", train_grpo, "evaluate", 2, 4),  # every 2 steps: the second is step 4's, before its save
])
def test_ctrl_c_in_each_phase_is_one_line_and_its_command_continues(phase, owner, name, call, step, tmp_path,
                                                                     monkeypatch, capsys, sigint_restored):
    argv = ["train_grpo.py", "--out_dir", str(tmp_path), *BASE, "--steps", "6", "--save_every", "2",
            "--eval_every", "2", "--eval_limit", "4", "--run_name", "r", "--overwrite", "true"]
    monkeypatch.setattr(sys, "argv", argv)
    closed = []
    monkeypatch.setattr(engine.HFEngine, "close", lambda self: closed.append(1), raising=False)
    _interrupt_on(monkeypatch, owner, name, call)
    with pytest.raises(SystemExit) as e:
        with faults.user_errors():
            train_grpo.main(argv[1:])
    assert e.value.code == 130
    err = capsys.readouterr().err.strip().splitlines()  # in-process: the libraries' lines are not moved
    assert [x for x in err if x.startswith("interrupted")] == err[-1:] and "Traceback" not in str(err), err
    m = LINE.match(err[-1])
    assert m, err[-1]
    assert m.groups()[:4] == (str(step), "6", os.path.join(str(tmp_path), "r", "checkpoint.pt"), "2"), err[-1]
    command = shlex.split(m.group(5))
    assert command[:2] == ["python", "train_grpo.py"] and "--overwrite" not in command, command
    assert closed == [1]  # the engine was closed
    if phase == "rollout":
        monkeypatch.undo()
        run = train_grpo.main(command[2:] + ["--resume", "true"])  # the printed command, as a user runs it
        assert [r["step"] for r in read_metrics(run.run_dir)] == list(range(1, 7))


def test_ctrl_c_before_a_checkpoint_and_during_start_up_say_what_to_rerun(tmp_path, monkeypatch, capsys,
                                                                          sigint_restored):
    argv = ["train_grpo.py", "--out_dir", str(tmp_path), *BASE, "--steps", "5", "--run_name", "r",
            "--resume=false"]
    monkeypatch.setattr(sys, "argv", argv)
    _interrupt_on(monkeypatch, common, "optimizer_step", 2)
    with pytest.raises(SystemExit, match="^130$"):
        with faults.user_errors():
            train_grpo.main(argv[1:])
    assert not [f for f in os.listdir(tmp_path / "r") if f.startswith("checkpoint")]
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line == ("interrupted (Ctrl-C) in step 2 of 5; no checkpoint yet (--save_every 50: every 50 "
                    f"steps); start again with: python train_grpo.py --out_dir {tmp_path} "
                    f"{' '.join(BASE)} --steps 5 --run_name r --overwrite true"), line
    signal.signal(signal.SIGINT, signal.default_int_handler)
    monkeypatch.setattr(common, "setup", lambda *a, **k: os.kill(os.getpid(), signal.SIGINT) or time.sleep(1))
    with pytest.raises(SystemExit, match="^130$"):
        with faults.user_errors():
            train_grpo.main(argv[1:])
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "interrupted (Ctrl-C) during start-up, before step 1: nothing was trained; rerun the command (with "
        "--overwrite true if it made its run folder)")


@pytest.mark.parametrize("failure", [DataError("the log could not be closed"), OSError(28, "No space left")])
def test_sigint_is_the_callers_again_when_the_close_after_a_ctrl_c_fails(failure, monkeypatch, capsys,
                                                                       sigint_restored):
    """interrupted() ignores SIGINT while it closes; an error ending that close (here the terminal's restore)
    must not leave it ignored for the rest of the process (a notebook, a test session): the caller's
    handler is back. A refusal's line is printed, then how to continue, status 130; anything else is ours
    (a traceback)."""
    mine = lambda *a: None  # noqa: E731  the caller's own handler
    signal.signal(signal.SIGINT, mine)
    faults.watch()  # nothing an earlier test watched

    def failing_stop():
        raise failure
    monkeypatch.setattr(faults.quiet, "stop", failing_stop)
    with pytest.raises(SystemExit if isinstance(failure, DataError) else OSError) as e:
        with faults.user_errors():
            raise KeyboardInterrupt
    assert signal.getsignal(signal.SIGINT) is mine
    if isinstance(failure, DataError):
        assert e.value.code == 130
        assert capsys.readouterr().err.strip().splitlines() == [
            "error: the log could not be closed",
            "interrupted (Ctrl-C) during start-up, before step 1: nothing was trained; rerun the command "
            "(with --overwrite true if it made its run folder)"]


def _ctrl_c(cmd: list, ready: str, timeout: float = 300, wandb: str = "disabled") -> tuple:
    """Start cmd in its own process group, wait for `ready` in its output, then Ctrl-C the whole group as a
    terminal does; (exit status, every output line)."""
    env = {**os.environ, "WANDB_MODE": wandb, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    lines, deadline = [], time.monotonic() + timeout
    try:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if ready in line:
                break
            assert time.monotonic() < deadline, lines
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, lines + out.splitlines()


@pytest.mark.slow
def test_a_real_ctrl_c_on_vllm_is_one_line_and_its_command_resumes_exactly(tmp_path):
    """Ctrl-C to the process group of a vLLM run printing a line a step (no terminal): the output is the
    run's own lines then ours, no traceback, no library line; exit 130. The printed command, run to step 4,
    logs what 4 steps straight log (one process: checkpoint.pt, as with the HF engine, though vLLM started a
    process group of one). (Merged with test_train_grpo.py's vLLM resume test, whose split half this run is.
    The HF engine: the in-process tests above send the signal from inside each phase, and the torchrun test
    below Ctrl-Cs its process group.)"""
    from test_train_grpo import _rows_without_timing, _same
    common_args = ["--engine", "vllm", "--save_every", "2", "--out_dir", str(tmp_path), "--wandb", "false",
                   "--prompts_per_step", "8"]
    run_script("train_grpo.py", [*common_args, "--steps", "4", "--run_name", "straight"])
    status, lines = _ctrl_c([sys.executable, "train_grpo.py", *common_args, "--steps", "400", "--print_every",
                             "1", "--run_name", "split"], "step 3/400")
    assert status == 130, lines
    m = LINE.match(lines[-1])
    assert m and m.group(4) in ("2", "4"), lines[-3:]  # step 4's save may have finished before the signal
    ours = ("memory plan", "start-up:", "step ", "interrupted (Ctrl-C)")
    assert all(line.startswith(ours) for line in lines), [x for x in lines if not x.startswith(ours)]
    split = tmp_path / "split"
    assert (split / "checkpoint.pt").exists() and not (split / "checkpoint").exists()
    command = shlex.split(m.group(5))
    run_script(command[1], [*command[2:], "--steps", "4", "--resume", "true"])
    _same(_rows_without_timing(tmp_path / "straight"), _rows_without_timing(split))
    assert torch.load(split / "checkpoint.pt", weights_only=True)["step"] == 4


@pytest.mark.slow
def test_a_real_ctrl_c_under_torchrun_is_one_line_from_rank_0_and_its_command_continues(tmp_path):
    """2 gloo ranks: Ctrl-C to the group (torchrun, both workers; torchrun passes a second SIGINT on): rank 0
    prints our line once, no worker prints a traceback (torchrun's own warnings and SignalException
    traceback follow: its agent's, not ours), and what a real wandb run (offline) says at its start and as
    it is closed goes to the run's log, one `wandb run:` line of ours on the terminal instead (merged with
    test_runlog.py's wandb test);
    the torchrun command it prints continues the run, which, with --keep_checkpoint false, ends with final/
    and without its sharded checkpoint/."""
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    args = ["--out_dir", str(tmp_path), *BASE, "--steps", "400", "--save_every", "2", "--print_every", "1",
            "--run_name", "c", "--wandb", "true"]
    status, lines = _ctrl_c([*launch, "--nproc_per_node", "2", "train_grpo.py", *args], "step 3/400",
                            wandb="offline")
    assert not [x for x in lines if x.startswith("wandb:")], lines  # its banner, notices, summary: the log
    assert "wandb: " in open(tmp_path / "c" / "logs" / "rank0.log").read()
    (where,) = [x for x in lines if x.startswith("wandb run: ")]  # ours instead, once
    assert where.startswith(f"wandb run: offline, in {tmp_path / 'c' / 'wandb' / 'offline-run-'}"), where
    ours = [x for x in lines if x.startswith("interrupted")]
    assert len(ours) == 1 and LINE.match(ours[0]), lines
    m = LINE.match(ours[0])
    assert m.group(3) == os.path.join(str(tmp_path), "c", "checkpoint/") and int(m.group(4)) >= 2, ours
    assert not [x for x in lines if "train_grpo.py\", line" in x or x.startswith("[rank")], lines
    frames = [x for x in lines if x.strip().startswith('File "')]  # torchrun's traceback only
    assert all("/torch/" in x or "runpy" in x for x in frames) and status != 0, frames
    command = shlex.split(m.group(5))
    assert command[:3] == ["torchrun", "--nproc_per_node=2", "train_grpo.py"], command
    steps = int(m.group(4)) + 1
    done = subprocess.run([*launch, *command[1:], "--steps", str(steps), "--resume", "true",
                           "--keep_checkpoint", "false"], cwd=ROOT,
                          env={**os.environ, "WANDB_MODE": "disabled"}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [r["step"] for r in read_metrics(tmp_path / "c")] == list(range(1, steps + 1))
    left = os.listdir(tmp_path / "c")
    assert "final" in left and not [f for f in left if f.startswith("checkpoint")], left
    assert "removed checkpoint (--keep_checkpoint false)" in done.stdout, done.stdout[-2000:]


def test_ctrl_c_in_eval_says_how_far_it_got_and_writes_nothing(tmp_path, monkeypatch, capsys,
                                                                sigint_restored):
    """eval.py: a SIGINT while sampling (after the engine's first finished completions) ends in one line:
    how many completions of how many were done, that nothing was written, and the command to run again."""
    import eval as evaluation
    from rlmini import progress
    argv = ["eval.py", "--engine", "hf", "--n", "4", "--k", "1,4", "--limit", "6", "--out",
            str(tmp_path / "e")]
    monkeypatch.setattr(sys, "argv", argv)
    real = progress._advance

    def advance(k):
        real(k)
        if progress._NOW["state"]["done"]:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
    monkeypatch.setattr(progress, "_advance", advance)
    with pytest.raises(SystemExit, match="^130$"):
        with faults.user_errors():
            evaluation.main(argv[1:])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    m = re.match(rf"^interrupted \(Ctrl-C\) after (\d+) of 24 completions: no results written to "
                 rf"{tmp_path}/e "
                 rf"\(eval.json is written once every question is scored\); run it again with: (.+)$", line)
    assert m and 0 < int(m.group(1)) < 24, line
    assert shlex.split(m.group(2)) == ["python", *argv] and not (tmp_path / "e" / "eval.json").exists()
