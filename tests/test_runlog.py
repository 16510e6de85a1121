"""What a run logs for comparing runs in wandb: each run folder has its own id (two runs of one name in
different out_dirs, or a run replaced with --overwrite, never share a wandb run; --resume continues its own),
the logged config names the algorithm and the script, and --wandb_group / --wandb_tags reach wandb."""
import json
from types import SimpleNamespace

import pytest

import common
import train_grpo
import train_rloo
from rlmini import runlog


@pytest.fixture
def fake_wandb(monkeypatch):
    """wandb.init recording its arguments (the run it returns logs nothing)."""
    import wandb
    calls = []

    def init(**kwargs):
        calls.append(kwargs)
        return SimpleNamespace(log=lambda *a, **k: None, finish=lambda **k: None, url="https://wandb.test/r",
                               dir="/tmp/wandb/offline-run-r/files")
    monkeypatch.setattr(wandb, "init", init)
    return calls


def _log(tmp_path, out, *argv):
    args = common.parse_args(train_grpo.Args,
                             ["--run_name", "sweep", "--out_dir", str(tmp_path / out), *argv])
    (tmp_path / out / "sweep").mkdir(parents=True, exist_ok=True)
    return runlog.RunLog(args, str(tmp_path / out / "sweep"), 0, 3, "grpo")


def test_each_run_folder_has_its_own_wandb_id_kept_on_resume(tmp_path, fake_wandb):
    _log(tmp_path, "lr1")
    _log(tmp_path, "lr2")
    first, second = (call["id"] for call in fake_wandb)
    assert first != second and first.startswith("sweep-") and second.startswith("sweep-")
    _log(tmp_path, "lr1", "--resume", "true")  # continues its own wandb run
    assert fake_wandb[-1]["id"] == first and fake_wandb[-1]["resume"] == "allow"
    _log(tmp_path, "lr1", "--overwrite", "true")  # a replaced run is a new one
    assert fake_wandb[-1]["id"] not in (first, second)
    assert json.load(open(tmp_path / "lr1" / "sweep" / "config.json"))["run_id"] == fake_wandb[-1]["id"]


def test_a_folder_from_before_ids_resumes_under_its_name(tmp_path, fake_wandb):
    (tmp_path / "old" / "sweep").mkdir(parents=True)
    (tmp_path / "old" / "sweep" / "config.json").write_text(json.dumps({"steps": 3}))
    _log(tmp_path, "old", "--resume", "true")
    assert fake_wandb[-1]["id"] == "sweep"


def test_config_names_the_algorithm_and_wandb_gets_group_and_tags(tmp_path, fake_wandb):
    run = train_rloo.main(["--out_dir", str(tmp_path), "--engine", "hf", "--steps", "1",
                           "--prompts_per_step", "4", "--group_size", "2", "--wandb_group", "rloo-lr3e-4",
                           "--wandb_tags", "sweep, seed0", "--save_every", "0"])
    (call,) = fake_wandb
    assert call["group"] == "rloo-lr3e-4" and call["tags"] == ["sweep", "seed0"]
    assert call["config"]["algo"] == "rloo" and call["config"]["script"] == "train_rloo.py"
    assert call["config"]["lr"] == 3e-4 and call["name"] == run.args.run_name
    saved = json.load(open(tmp_path / run.args.run_name / "config.json"))
    assert saved["algo"] == "rloo" and saved["run_id"] == call["id"]


def test_a_run_ends_with_its_training_reward_beside_its_held_out_accuracy(tmp_path, fake_wandb, capsys):
    """The last line a run prints: the training reward's first and last 10 steps' means (hand-computed; in a
    run shorter than 20 steps, of its halves, which never overlap) and the latest held-out pass@1, or that
    none was measured."""
    log = _log(tmp_path, "a")
    for step in range(1, 13):  # rewards 0.1 .. 1.2; held-out at steps 6 and 12
        log.log(step, {"reward/mean": step / 10, **({"eval/pass@1": step / 24} if step % 6 == 0 else {})})
    log.close()
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == ("training reward 0.350 -> 0.950 (first, last 6 of 12 steps) | held-out pass@1 0.500 at "
                    "step 12")
    rows = [{"step": s, "reward/mean": s / 10} for s in range(1, 26)]
    assert runlog.summary_line(rows).startswith("training reward 0.550 -> 2.050 (first, last 10 steps) | ")
    assert runlog.summary_line(rows[:5]).startswith("training reward 0.150 -> 0.450 (first, last 2 of 5 "
                                                    "steps)")
    assert runlog.summary_line(rows[:1]) == ("training reward 0.100 (1 step) | held-out pass@1: not "
                                             "evaluated (--eval_every N)")

