"""A run never loses what it did not write (docs/outputs.md): every removal takes only a run's own entries
(named, with their marker), inputs are never outputs, the newest state wins or the run says why, every
publishing rename is durable before anything is removed, and locks and lines say what is true. On one process
and on 2 gloo ranks; the server's push folder in tests/test_server.py too."""
import errno
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import common
import train_grpo
from conftest import ROOT, read_metrics
from rlmini import checkpoint, durable, faults, server, smollm2

BASE = ["--wandb", "false", "--engine", "hf", "--prompts_per_step", "4", "--group_size", "4"]


def train(tmp_path, *argv):
    return train_grpo.main(["--out_dir", str(tmp_path), *BASE, *argv])


def user_files(folder) -> dict:
    """A user's file and folder beside a deletion site; returns what they hold, to compare after."""
    os.makedirs(os.path.join(folder, "keep"), exist_ok=True)
    for name, text in (("notes.txt", "mine"), (os.path.join("keep", "data.txt"), "also mine")):
        with open(os.path.join(folder, name), "w") as f:
            f.write(text)
    return survived(folder)


def survived(folder) -> dict:
    return {name: open(os.path.join(folder, name)).read() for name in ("notes.txt", os.path.join("keep",
                                                                                                  "data.txt"))
            if os.path.exists(os.path.join(folder, name))}


# ------------------------------------------------------------------------------------- the run folder


@pytest.mark.slow
def test_overwrite_removes_only_the_runs_own_files_and_refuses_a_folder_not_ours(tmp_path, capsys):
    """--overwrite (and a resume, and a run's end) leaves a user's files in the run folder; a folder holding
    names a run writes but no run's config.json is refused, nothing removed."""
    run = train(tmp_path, "--steps", "2", "--save_every", "1", "--run_name", "x")
    mine = user_files(run.run_dir)
    train(tmp_path, "--steps", "3", "--run_name", "x", "--resume", "true")
    out = capsys.readouterr().out
    assert f"--resume: {run.run_dir} continues from step 2 (its checkpoint); nothing dropped" in out
    run = train(tmp_path, "--steps", "1", "--run_name", "x", "--overwrite", "true", "--keep_checkpoint",
                "false")
    assert survived(run.run_dir) == mine and [r["step"] for r in read_metrics(run.run_dir)] == [1]
    assert not os.path.exists(os.path.join(run.run_dir, "checkpoint.pt"))
    before = sorted(os.listdir(run.run_dir))  # an --overwrite whose start-up fails leaves the earlier run
    with pytest.raises(faults.ServerError, match=r"--server_url http://127.0.0.1:9: no vLLM server answers"):
        train(tmp_path, "--steps", "1", "--run_name", "x", "--overwrite", "true", "--engine", "server",
              "--server_url", "http://127.0.0.1:9", "--server_timeout", "5")
    assert sorted(os.listdir(run.run_dir)) == before and os.path.isdir(os.path.join(run.run_dir, "final"))
    theirs = tmp_path / "theirs"
    (theirs / "final").mkdir(parents=True)  # a user's folder that happens to use our names
    (theirs / "final" / "weights.bin").write_text("precious")
    (theirs / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(SystemExit, match=r"--overwrite true: \S+theirs holds metrics.jsonl, final but no "
                                         r"config.json of a run .*: not removed"):
        train(tmp_path, "--steps", "1", "--run_name", "theirs", "--overwrite", "true")
    (theirs / "config.json").write_text(json.dumps({"algo": "grpo", "lr": 1e-3}))  # a run's, from before ids
    with pytest.raises(SystemExit, match=r"holds final without the rlmini.json a run writes into it"):
        train(tmp_path, "--steps", "1", "--run_name", "theirs", "--overwrite", "true")
    assert (theirs / "final" / "weights.bin").read_text() == "precious"


@pytest.mark.slow
def test_a_resume_names_its_step_and_the_rows_it_drops_and_refuses_two_checkpoints(tmp_path, capsys):
    run = train(tmp_path, "--steps", "2", "--save_every", "1", "--run_name", "r")
    with open(os.path.join(run.run_dir, "metrics.jsonl"), "a") as f:  # rows logged after that checkpoint
        f.write(json.dumps({"step": 3, "reward/mean": 0.0}) + "\n" + json.dumps({"step": 4}) + "\n")
    run = train(tmp_path, "--steps", "3", "--run_name", "r", "--resume", "true")
    assert (f"--resume: {run.run_dir} continues from step 2 (its checkpoint); metrics.jsonl: dropped 2 rows "
            f"(steps 3-4); those steps are trained again") in capsys.readouterr().out
    assert [r["step"] for r in read_metrics(run.run_dir)] == [1, 2, 3]
    shards = os.path.join(run.run_dir, "checkpoint")  # a torchrun run's, older, beside the plain one's
    os.makedirs(shards)
    torch.save({"step": 1}, os.path.join(shards, "meta.pt"))
    with pytest.raises(SystemExit, match=r"--resume true: \S+r holds two checkpoints, \S+checkpoint.pt "
                                         r"\(step 3, from a plain process\) and \S+checkpoint/ \(step 1, "
                                         r"from torchrun\); remove the one not to continue"):
        train(tmp_path, "--steps", "4", "--run_name", "r", "--resume", "true")


def test_inputs_are_never_outputs(tmp_path):
    """An input at a path the run writes or replaces is refused, naming both, before anything is removed."""
    run = train(tmp_path, "--steps", "1", "--run_name", "m")
    final = os.path.join(run.run_dir, "final")
    config = tmp_path / "c.yaml"
    config.write_text("lr: 0.001\n")
    os.makedirs(os.path.join(run.run_dir, "push"))
    shutil.copy(config, os.path.join(run.run_dir, "push", "c.yaml"))
    for argv, flag in ((["--model", final, "--run_name", "m", "--overwrite", "true"], "--model"),
                       (["--model", final, "--run_name", "m", "--resume", "true", "--steps", "2"], "--model"),
                       (["--config", os.path.join(run.run_dir, "push", "c.yaml"), "--run_name", "m",
                         "--overwrite", "true"], "--config")):
        with pytest.raises(SystemExit, match=rf"^{flag} \S+ lies in \S+m/(final|push), which this run writes "
                                             rf"or replaces"):
            train(tmp_path, "--steps", "1", *argv)
    assert os.path.isfile(os.path.join(final, "rlmini.json"))
    assert os.path.exists(os.path.join(run.run_dir, "checkpoint.pt"))
    import train_ppo
    with pytest.raises(SystemExit, match=r"^--critic_model \S+m/final lies in \S+m/final"):  # any path option
        train_ppo.main(["--out_dir", str(tmp_path), *BASE, "--steps", "1", "--critic_model", final,
                        "--run_name", "m", "--overwrite", "true"])
    shutil.copytree(final, tmp_path / "model")  # a model folder given as the run folder: its config.json
    with pytest.raises(SystemExit, match=r"^--model \S+model is the run folder \S+model itself"):
        train(tmp_path, "--steps", "1", "--model", str(tmp_path / "model"), "--run_name", "model")
    assert sorted(os.listdir(tmp_path / "model")) == sorted(os.listdir(final))


def test_every_publishing_rename_is_synced_and_final_is_durable_before_the_checkpoint_goes(tmp_path,
                                                                                         monkeypatch):
    """By construction: the file-system calls of a run that writes checkpoints, metrics and config, then
    final/, then removes its checkpoint (--keep_checkpoint false), recorded in order. After every rename an
    fsync of the folder holding its target comes before the next rename or removal; every file of final/ is
    fsynced before checkpoint.pt is removed."""
    events = []
    real = {name: getattr(os, name) for name in ("rename", "replace", "fsync", "remove")}

    def record(name):
        def call(*a, **k):
            if name == "fsync":
                events.append(("fsync", os.readlink(f"/proc/self/fd/{a[0]}")))
            else:
                events.append((name, *map(os.path.abspath, map(str, a[:2]))))
            return real[name](*a, **k)
        return call
    for name in real:
        monkeypatch.setattr(os, name, record(name))
    run = train(tmp_path, "--steps", "2", "--save_every", "1", "--run_name", "d", "--keep_checkpoint",
                "false")
    run_dir = os.path.abspath(run.run_dir)
    monkeypatch.undo()
    mine = [e for e in events if run_dir in e[-1] or run_dir in e[1]]
    renames = [k for k, e in enumerate(mine) if e[0] in ("rename", "replace")]
    assert len(renames) >= 5  # memory_plan.json, config.json, 2 checkpoints, final/ swapped in
    for k in renames:
        target = mine[k][2]
        nxt = next((j for j in range(k + 1, len(mine)) if mine[j][0] in ("rename", "replace", "remove")),
                   len(mine))
        assert ("fsync", os.path.dirname(target)) in mine[k + 1:nxt], mine[k]
    gone = next(k for k, e in enumerate(mine) if e == ("remove", os.path.join(run_dir, "checkpoint.pt")))
    synced = {e[1] for e in mine[:gone] if e[0] == "fsync"}
    files = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(run_dir, "final")) for f in fs]
    assert files and all(f.replace(f"{os.sep}final{os.sep}", f"{os.sep}final.tmp{os.sep}") in synced
                         for f in files)
    assert os.path.join(run_dir, "final") in {mine[k][2] for k in renames if k < gone}


# ------------------------------------------------------------------------------------------- the end of a run


def full_disk(*a, **k):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_final_save_that_fails_leaves_a_checkpoint_in_its_place_and_says_what_survived(tmp_path,
                                                                                        monkeypatch):
    """--keep_checkpoint false: final/ fails (a full disk) -> a checkpoint of the last step in its place,
    kept, and one line; when that fails too, the line names the last periodic checkpoint, which is kept."""
    from transformers import PreTrainedModel
    monkeypatch.setattr(PreTrainedModel, "save_pretrained", full_disk)
    with pytest.raises(SystemExit, match=r"could not write \S+f1/final \(No space left on device\); the "
                                         r"previous \S+final \(or \S+final.old\), if any, is intact; wrote "
                                         r"\S+f1/checkpoint.pt \(step 2\) in its place and kept it: --resume "
                                         r"true writes final/ from it$"):
        train(tmp_path, "--steps", "2", "--save_every", "0", "--run_name", "f1", "--keep_checkpoint",
              "false")
    assert torch.load(tmp_path / "f1" / "checkpoint.pt", weights_only=True, mmap=True)["step"] == 2
    assert not [f for f in os.listdir(tmp_path / "f1") if f.startswith("final")]
    real_save = checkpoint._write
    calls = []

    def second_fails(path, state):  # the step-2 checkpoint is written, the one in final/'s place is not
        calls.append(path)
        if len(calls) > 1:
            full_disk()
        real_save(path, state)
    monkeypatch.setattr(checkpoint, "_write", second_fails)
    with pytest.raises(SystemExit, match=r"nor could a checkpoint be written in its place \(could not write "
                                         r"\S+checkpoint.pt \(No space left on device\); the previous "
                                         r"checkpoint is intact\); what survives: \S+f2/checkpoint.pt \(step "
                                         r"2\), its last"):
        train(tmp_path, "--steps", "3", "--save_every", "2", "--run_name", "f2", "--keep_checkpoint", "false")
    assert torch.load(tmp_path / "f2" / "checkpoint.pt", weights_only=True, mmap=True)["step"] == 2
    calls[:] = ["every write fails"]
    with pytest.raises(SystemExit, match=r"no weights of this run survive \(no checkpoint "
                                         r"was written: --save_every 0\)"):
        train(tmp_path, "--steps", "1", "--save_every", "0", "--run_name", "f3", "--keep_checkpoint", "false")


def test_a_ctrl_c_after_final_says_the_model_is_saved_and_keeps_the_users_files(tmp_path, monkeypatch,
                                                                              capsys):
    """A real SIGINT inside the checkpoint's removal (--keep_checkpoint false: after final/ is durable): one
    line saying where the model is, status 130; the user's files beside the run stay, final/ whole."""
    import signal
    import time
    os.makedirs(tmp_path / "c")
    mine = user_files(tmp_path / "c")
    real = checkpoint.durable.remove

    def interrupted(path):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)  # the handler runs at the next bytecode: KeyboardInterrupt is raised in here
        real(path)
    monkeypatch.setattr(checkpoint.durable, "remove", interrupted)
    argv = ["--out_dir", str(tmp_path), *BASE, "--steps", "2", "--save_every", "1", "--run_name", "c",
            "--keep_checkpoint", "false"]
    try:
        with pytest.raises(SystemExit, match="^130$"):
            with faults.user_errors():
                train_grpo.main(argv)
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line == f"interrupted (Ctrl-C) after the run finished: the model is saved in {tmp_path}/c/final"
    assert survived(tmp_path / "c") == mine and os.path.isfile(tmp_path / "c" / "final" / "rlmini.json")


# ------------------------------------------------------------------------------------------- locks and caches


def test_a_filesystem_without_locks_is_named_and_run_lock_false_runs(tmp_path, monkeypatch):
    import fcntl

    def no_locks(*a):
        raise OSError(errno.ENOLCK, "No locks available")
    monkeypatch.setattr(fcntl, "lockf", no_locks)
    with pytest.raises(SystemExit, match=r"\S+nolock: its filesystem cannot lock \S+\.lock \(No locks "
                                         r"available\); pass --run_lock false to run without the lock"):
        train(tmp_path, "--steps", "1", "--run_name", "nolock")
    train(tmp_path, "--steps", "1", "--run_name", "nolock", "--run_lock", "false")


def test_a_read_only_cache_without_the_model_is_one_line(tmp_path, monkeypatch):
    """A read-only cache (a shared, prebuilt one: the filesystem says EROFS to every write, as a double here,
    since root ignores modes) that lacks the model: one line naming the folder and RLMINI_CACHE, for the
    built-in SmolLM2 and the tiny model; a cache that holds the model is read as it is."""
    from rlmini import models

    makedirs = os.makedirs

    def read_only(path, *a, **k):
        if str(path).startswith(str(tmp_path)):
            raise OSError(errno.EROFS, "Read-only file system")
        return makedirs(path, *a, **k)
    monkeypatch.setattr(os, "makedirs", read_only)
    with pytest.raises(SystemExit, match=r"^--model smollm2: \S+ is not built and its cache cannot take a "
                                         r"build \(Read-only file system\): set RLMINI_CACHE to a writable"):
        smollm2.folder(str(tmp_path))
    with pytest.raises(SystemExit, match=r"^--model tiny: the cache \S+ holds no tiny model for this task's "
                                         r"alphabet and cannot take one \(Read-only file system\): set "
                                         r"RLMINI_CACHE"):
        models.build_tiny_model(["1", "2", "+", "="], cache_dir=str(tmp_path))
    monkeypatch.undo()
    built = models.build_tiny_model(["1", "2", "+", "="], cache_dir=str(tmp_path))
    monkeypatch.setattr(os, "makedirs", read_only)
    assert models.build_tiny_model(["1", "2", "+", "="], cache_dir=str(tmp_path)) == built


def test_a_build_killed_between_its_renames_is_taken_not_thrown_away(tmp_path):
    """smollm2's build moves a damaged folder aside, then renames the finished one in: killed in between, the
    next start takes the finished build (its record checks out) instead of removing it."""
    out = smollm2.path(str(tmp_path))
    work = os.path.join(os.path.dirname(out), ".build-killed")
    staged = os.path.join(work, "model")
    os.makedirs(staged)
    with open(os.path.join(staged, "config.json"), "w") as f:
        f.write("{}")
    smollm2._write_json(os.path.join(staged, "rlmini-source.json"), {"files": smollm2._record(staged)})
    lines = []
    assert smollm2.folder(str(tmp_path), log=lines.append) == out
    assert os.path.isfile(os.path.join(out, "config.json")) and not os.path.exists(work)
    assert lines == [f"smollm2: took the finished build a killed process left ({out})"]


# ----------------------------------------------------------------------------------------- the push folder


class _Pusher:
    """ServerEngine's push and close without a server: its requests recorded."""

    def __init__(self, root, run_dir, nonce):
        self.engine = object.__new__(server.ServerEngine)
        e = self.engine
        e.folder, e.run_dir, e.nonce, e.pushed, e.made_root, e.pushes = root, run_dir, nonce, [], False, 0
        e.inflight, e.transfer, e.repack, e.probe, e.asleep = [], None, False, None, True
        e.model, e.dtype = torch.nn.Linear(2, 2), torch.float32
        e.calls = []
        e._call = lambda path, body: e.calls.append((path, body))


def test_a_push_root_keeps_a_users_files_and_another_runs_pushes(tmp_path):
    """Each push removes only this run's previous push; the first also what an earlier run of the same run
    folder left (its marker names the folder); the end removes this run's last push, and the root only if the
    run made it and it is empty. Two runs share a root."""
    root = str(tmp_path / "shared")
    mine = user_files(root)
    a, b = _Pusher(root, str(tmp_path / "a"), "aaaa"), _Pusher(root, str(tmp_path / "b"), "bbbb")
    stale = server.write_safetensors(iter([("w", torch.ones(2))]), root, 7, "dead", str(tmp_path / "a"))
    live = server.write_safetensors(iter([("w", torch.ones(2))]), root, 3, "live", str(tmp_path / "a"))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    marker = os.path.join(stale, server.PUSH_MARKER)
    with open(marker) as f:
        dead = {**json.load(f), "pid": gone.pid}  # its writer killed: it never came to its close
    with open(marker, "w") as f:
        json.dump(dead, f)
    for k in range(2):
        a.engine.push()
        b.engine.push()
        ours = sorted(f for f in os.listdir(root) if f.startswith(server.PUSH_PREFIX))
        assert ours == [f"rlmini-push-aaaa-v{k + 1}", f"rlmini-push-bbbb-v{k + 1}", "rlmini-push-live-v3"]
    # run a's folder's earlier run, killed before its close, went; a live process's push of it stays
    assert not os.path.exists(stale) and os.path.exists(live)
    a.engine.close()
    assert sorted(os.listdir(root)) == ["keep", "notes.txt", "rlmini-push-bbbb-v2", "rlmini-push-live-v3"]
    assert survived(root) == mine
    b.engine.close()
    assert sorted(os.listdir(root)) == ["keep", "notes.txt", "rlmini-push-live-v3"]
    fresh = _Pusher(str(tmp_path / "new"), str(tmp_path / "c"), "cccc")
    fresh.engine.push()
    fresh.engine.close()
    assert not os.path.exists(tmp_path / "new")  # made by the run, empty: removed


# --------------------------------------------------------------------------------------------- 2 gloo ranks

RANKS = """import errno, json, os, shutil, subprocess, sys
sys.path.insert(0, {root!r})
import torch
import train_grpo
from rlmini import checkpoint, dist, quiet
out = {out!r}
base = ["--out_dir", out, "--wandb", "false", "--engine", "hf", "--prompts_per_step", "4",
        "--group_size", "4"]
said = []
def attempt(*argv):
    try:
        with quiet.entry_point():  # as `python train_grpo.py` runs it: the libraries' output to logs/
            train_grpo.main([*base, *argv])
        said.append("ok")
    except SystemExit as e:
        said.append(str(e))
attempt("--steps", "2", "--save_every", "1", "--run_name", "a")
run_dir = os.path.join(out, "a")
if dist.rank() == 0:  # a save killed between its renames: the newer checkpoint.tmp/, the older .old/
    os.rename(os.path.join(run_dir, "checkpoint"), os.path.join(run_dir, "checkpoint.tmp"))
    shutil.copytree(os.path.join(run_dir, "checkpoint.tmp"), os.path.join(run_dir, "checkpoint.old"))
    meta = os.path.join(run_dir, "checkpoint.old", "meta.pt")
    torch.save({{**torch.load(meta, weights_only=True), "step": 1}}, meta)
torch.distributed.barrier()
attempt("--steps", "3", "--run_name", "a", "--resume", "true")  # continues from step 2, the newer
log = os.path.join(run_dir, "logs", "rank1.log")
torch.distributed.barrier()
if dist.rank() == 0:
    with open(log, "a") as f:
        f.write("the running job's line" + chr(10))
torch.distributed.barrier()
if dist.rank() == 0:
    for name, text in (("notes.txt", "mine"), ("keep/data.txt", "also mine")):
        os.makedirs(os.path.join(out, "a", "keep"), exist_ok=True)
        open(os.path.join(out, "a", name), "w").write(text)
    torch.save({{"step": 9}}, os.path.join(out, "a", "checkpoint.pt"))  # a plain process's, beside shards
attempt("--steps", "3", "--run_name", "a")  # refused on rank 0: every rank gets the line
attempt("--steps", "3", "--run_name", "a", "--resume", "true")  # two checkpoints: refused
kept = "the running job's line" in open(log).read()  # the refused runs' rank 1 never touched the folder
if dist.rank() == 0:
    os.remove(os.path.join(out, "a", "checkpoint.pt"))
real = checkpoint._write_final
def full(*a, **k):
    raise OSError(errno.ENOSPC, "No space left on device")
checkpoint._write_final = full
attempt("--steps", "3", "--run_name", "a", "--resume", "true", "--keep_checkpoint", "false")
checkpoint._write_final = real
attempt("--steps", "1", "--run_name", "a", "--overwrite", "true")
busy = os.path.join(out, "b")  # another job's run folder, its lock held, its rank 1 logging
if dist.rank() == 0:
    os.makedirs(os.path.join(busy, "logs"))
    with open(os.path.join(busy, "logs", "rank1.log"), "w") as f:
        f.write("the running job's line" + chr(10))
    code = ("import fcntl, sys, time; f = open(sys.argv[1], 'a+'); fcntl.lockf(f, fcntl.LOCK_EX); "
            "print('locked', flush=True); time.sleep(120)")
    holder = subprocess.Popen([sys.executable, "-c", code, os.path.join(busy, ".lock")],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
torch.distributed.barrier()
attempt("--steps", "1", "--run_name", "b", "--overwrite", "true")  # in use: refused before any rank writes
kept = kept and "the running job's line" in open(os.path.join(busy, "logs", "rank1.log")).read()
if dist.rank() == 0:
    holder.kill()
with open(os.path.join(out, f"said{{dist.rank()}}.json"), "w") as f:
    json.dump(said + [kept], f)
"""


@pytest.mark.slow
def test_two_ranks_keep_a_users_files_and_every_rank_hears_rank_0(tmp_path):
    """torchrun, 2 gloo ranks: rank 0's refusals (a run there, two checkpoints) reach rank 1 as the same line,
    no rank waits; a failed final/ leaves checkpoint/ of the last step in its place on every rank's word; an
    --overwrite leaves the user's files."""
    script = tmp_path / "ranks.py"
    script.write_text(RANKS.format(root=ROOT, out=str(tmp_path / "runs")))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                           "2", str(script)], cwd=ROOT, capture_output=True, text=True, timeout=400,
                          env={**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    said = {r: json.load(open(tmp_path / "runs" / f"said{r}.json")) for r in (0, 1)}
    assert said[0] == said[1], said  # every rank heard the same
    ok, newer, exists, two, full, over, busy, kept = said[0]
    assert kept and "is in use by another training process" in busy  # no refused rank truncated a log
    assert ok == "ok" and newer == "ok" and over == "ok" and "already holds a run" in exists
    assert "holds two checkpoints" in two and "(step 9, from a plain process)" in two and "(step 3," in two
    assert "No space left on device" in full and "checkpoint (step 3) in its place and kept it" in full
    run_dir = tmp_path / "runs" / "a"
    assert (run_dir / "notes.txt").read_text() == "mine" and (run_dir / "keep" / "data.txt").exists()
    assert [r["step"] for r in read_metrics(run_dir)] == [1]
    assert f"--resume: {run_dir} continues from step 2 (its checkpoint); nothing dropped" in proc.stdout
