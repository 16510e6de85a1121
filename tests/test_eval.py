"""eval.py: metrics against hand computation and brute force, contamination, audit, the command line."""
import argparse
import itertools
import json
import math
import os
import re

import numpy as np
import pytest
import torch

import eval as ev
import rewards
from conftest import VLLM_INFO, run_script
from eval import expected_calibration_error, probability_predictions
from rlmini import datafiles, optim


def test_ece_hand_computed():
    probs = [0.05, 0.15, 0.18, 0.95, 0.92, 0.55]
    labels = [0, 0, 1, 1, 1, 0]
    # bins (0,.1]: {.05|0}; (.1,.2]: {.15,.18|0,1}; (.5,.6]: {.55|0}; (.9,1]: {.95,.92|1,1}
    expected = (1 / 6) * 0.05 + (2 / 6) * abs(0.165 - 0.5) + (1 / 6) * 0.55 + (2 / 6) * abs(0.935 - 1.0)
    assert expected_calibration_error(probs, labels) == pytest.approx(expected)


def test_ece_bins_are_right_closed_and_zero_goes_to_the_first():
    # 0.1 sits on an edge: it belongs to (0, 0.1], together with 0.0
    assert expected_calibration_error([0.0, 0.1], [0, 0]) == pytest.approx(0.05)
    # 0.1 and 0.1000001 fall in different bins: (0,.1] and (.1,.2]
    ece = expected_calibration_error([0.1, 0.1000001], [1, 0])
    assert ece == pytest.approx(0.5 * 0.9 + 0.5 * 0.1000001)


def test_ece_perfect_and_worst_and_one_class():
    assert expected_calibration_error([1.0, 1.0, 0.0], [1, 1, 0]) == 0.0
    assert expected_calibration_error([1.0, 0.0], [0, 1]) == 1.0
    assert expected_calibration_error([0.3] * 10, [0] * 10) == pytest.approx(0.3)


@pytest.mark.parametrize("probs,labels,message", [
    ([0.5, 1.2], [0, 1], r"\[0, 1\]"),
    ([0.5, float("nan")], [0, 1], r"\[0, 1\]"),
    ([0.5], [0, 1], "same length"),
    ([], [], "no predictions"),
])
def test_ece_rejects_bad_input(probs, labels, message):
    with pytest.raises(ValueError, match=message):
        expected_calibration_error(probs, labels)


def test_prediction_per_question_is_the_mean_of_valid_samples():
    S = rewards.Score
    scores = [S(0, 0, 1, 0.2), S(0, 0, 1, 0.4), S(0, 0, 0, None), S(0, 0, 0, None)]
    probs, labels = probability_predictions(scores, [{"answer": 1}, {"answer": 0}], 2)
    assert probs.tolist() == pytest.approx([0.3, 0.5]) and labels.tolist() == [1, 0]


def test_lr_warmup_is_linear_then_constant():
    f = optim.lr_lambda(4)
    assert [f(k) for k in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert optim.lr_lambda(0)(0) == 1.0


def test_lr_decay_reaches_zero_at_the_last_step():
    lin, cos = optim.lr_lambda(2, "linear", 6), optim.lr_lambda(2, "cosine", 6)
    assert [lin(k) for k in range(7)] == pytest.approx([0.5, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0])
    # cosine: 1/2 (1 + cos(pi t)) at t = (k - 2) / 4
    assert [cos(k) for k in range(7)] == pytest.approx([0.5, 1.0, 1.0, 0.8535534, 0.5, 0.1464466, 0.0])
    assert cos(50) == 0.0 and optim.lr_lambda(0, "constant", 6)(5) == 1.0


def test_lr_schedule_resumes_where_it_stopped():
    """A resumed run restores the optimizer's and the scheduler's state_dicts (checkpoint.resume) and rebuilds
    the same lambda from the same options: the lr goes on as in a straight run."""
    def make():
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, optim.lr_lambda(2, "cosine", 8))
    opt, sched = make()
    straight = []
    for _ in range(8):
        straight.append(opt.param_groups[0]["lr"])
        opt.step(), sched.step()
    opt, sched = make()
    for _ in range(3):
        opt.step(), sched.step()
    state = opt.state_dict(), sched.state_dict()
    opt, sched = make()
    opt.load_state_dict(state[0]), sched.load_state_dict(state[1])
    resumed = []
    for _ in range(5):
        resumed.append(opt.param_groups[0]["lr"])
        opt.step(), sched.step()
    assert resumed == straight[3:] and straight[2] == 1e-3 and straight[-1] < 1e-4


# ----------------------------------------------------------------------------------------- pass@k, maj@k, CIs

FIX = os.path.join(os.path.dirname(__file__), "fixtures")


@pytest.mark.parametrize("n,c,k",
                         [(n, c, k) for n in range(1, 8) for c in range(n + 1) for k in range(1, n + 1)])
def test_pass_at_k_equals_brute_force_enumeration(n, c, k):
    outcomes = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    brute = sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)
    assert ev.pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12)


def test_pass_at_k_is_stable_for_large_n_and_rejects_bad_input():
    assert ev.pass_at_k(10_000, 1, 1) == pytest.approx(1e-4)
    assert 0.0 < ev.pass_at_k(2000, 3, 100) < 1.0
    with pytest.raises(ValueError, match="1 <= k <= n"):
        ev.pass_at_k(4, 2, 5)


def test_majority_vote_hand_computed():
    preds = [["3", "3", "5", None], ["7", "8", "8", "9"], [None, None, None, None]]
    correct = [[True, True, False, False], [True, False, False, False], [False] * 4]
    assert ev.maj_at_k(preds, correct, 4).tolist() == [1.0, 0.0, 0.0]
    # k = 1 over random draws: the share of correct samples among all draws approaches c/n
    assert ev.maj_at_k(preds, correct, 1, draws=4000)[0] == pytest.approx(0.5, abs=0.03)
    # a tie goes to the first answer seen
    assert ev.maj_at_k([["4", "2"]], [[False, True]], 2).tolist() == [0.0]


def test_bootstrap_interval_covers_the_true_mean():
    rng = np.random.default_rng(1)
    hits = 0
    for rep in range(100):
        sample = rng.random(200) < 0.3
        lo, hi = ev.bootstrap_ci(sample, draws=400, seed=rep)
        hits += lo <= 0.3 <= hi
    assert 88 <= hits <= 100  # nominal 95%


def test_auroc_and_brier_known_values():
    probs, labels = [0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]
    assert ev.auroc(probs, labels) == pytest.approx(0.75)
    assert ev.brier(probs, labels) == pytest.approx((0.01 + 0.16 + 0.4225 + 0.04) / 4)
    assert np.isnan(ev.auroc([0.2, 0.3], [1, 1]))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        ev.brier([0.5, -0.1], [0, 1])
    with pytest.raises(ValueError, match="labels must be 0 or 1"):
        ev.auroc([0.5, 0.1], [0, 2])


def test_reliability_diagram_writes_a_png(tmp_path):
    from PIL import Image
    one_row = {"a": ([0.1, 0.9, 0.5], [0, 1, 1]), "b": ([0.3, 0.3], [0, 1])}
    ev.reliability_diagram(one_row, str(tmp_path / "r.png"))
    assert open(tmp_path / "r.png", "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    ev.reliability_diagram({"row 1": one_row, "row 2": {"c": ([0.2], [1])}}, str(tmp_path / "grid.png"))
    (w1, h1), (w2, h2) = Image.open(tmp_path / "r.png").size, Image.open(tmp_path / "grid.png").size
    assert w2 == w1 and h2 > 1.8 * h1  # a dict of dicts: one row of panels per key


# --------------------------------------------------------------------------------------- contamination, audit


def test_contamination_finds_a_planted_overlap_and_decontaminate_drops_it():
    shared = "a farmer has seventeen sheep and all but nine run away how many are left now"
    train = [{"prompt": "completely different words here about apples and pears"},
             {"prompt": f"Question: {shared}? Think."}, {"prompt": "short"}]
    test = [{"prompt": f"{shared} today"},
            {"prompt": "nothing in common with the training prompts at all really"}]
    found = datafiles.ngram_overlap([e["prompt"] for e in train], [e["prompt"] for e in test], n=13)
    assert found["share"] == 0.5 and [(p["eval"], p["train"]) for p in found["pairs"]] == [(0, 1)]
    assert len(found["pairs"][0]["ngram"].split()) == 13
    kept, dropped = datafiles.decontaminate(train, test, 13)
    assert dropped == 1 and kept == [train[0], train[2]]


def test_verifier_audit_counts_a_planted_miss():
    rows = [{"completion": "so \\boxed{72}", "answer": "72", "label": 1},
            {"completion": "the answer is 72", "answer": "72", "label": 1},   # correct, but unboxed: a miss
            {"completion": "\\boxed{71}", "answer": "72", "label": 0},
            {"completion": "\\boxed{0.5}", "answer": "\\frac{1}{2}", "label": 1}]
    out = ev.verifier_audit(rewards.score_boxed_math, rows)
    assert (out["tp"], out["fn"], out["fp"], out["tn"]) == (2, 1, 0, 1)
    assert out["recall"] == pytest.approx(2 / 3) and out["precision"] == 1.0
    assert [d["row"] for d in out["disagreements"]] == ["row 2"]


def test_verifier_audit_names_bad_rows():
    with pytest.raises(rewards.DataError, match="audit: row 1: missing field 'label'"):
        ev.verifier_audit(rewards.score_exact, [{"completion": "x", "answer": "x"}])
    with pytest.raises(rewards.DataError, match="row 1: label must be 0 or 1"):
        ev.verifier_audit(rewards.score_exact, [{"completion": "x", "answer": "x", "label": "yes"}])


# ------------------------------------------------------------------------------------------- the command line


@pytest.mark.slow
def test_cli_end_to_end_on_a_tiny_trained_checkpoint(tmp_path):
    import train_grpo
    for name in ("a", "b"):
        train_grpo.main(["--engine", "hf", "--task", "calibration", "--steps", "3", "--prompts_per_step", "8",
                         "--out_dir", str(tmp_path), "--run_name", name, "--wandb", "false", "--eval_every",
                         "3",
                         "--eval_limit", "50", "--seed", str(ord(name))])
    out = tmp_path / "eval"
    run_script("eval.py",
               ["--model", str(tmp_path / "a" / "final"), "--task", "calibration", "--n", "4", "--k", "1,2,4",
                           "--limit", "40", "--engine", "hf", "--out", str(out)])
    result = json.load(open(out / "eval.json"))
    assert result["questions"] == 40 and result["n"] == 4
    assert result["seed"] == ord("a")  # a run's final/: its own split by default
    for key in ("pass@1", "pass@4", "maj@2", "mean@4", "ece", "auroc", "brier", "accuracy", "format_fail"):
        assert key in result, key
    assert result["pass@1"] <= result["pass@2"] <= result["pass@4"]
    lo, hi = result["pass@1_ci95"]
    assert lo <= result["pass@1"] <= hi
    assert all((out / name).exists() for name in ("eval.md", "pass_at_k.png", "reliability.png"))
    each = result["per_question"]  # for eval.py compare's paired bootstrap
    assert len(set(each["id"])) == 40 and np.mean(each["pass@1"]) == pytest.approx(result["pass@1"])
    assert np.mean(each["reward"]) == pytest.approx(result["reward"])
    assert each["pass@1"] == [c / 4 for c in np.rint(np.array(each["pass@1"]) * 4)]
    cmp = tmp_path / "cmp"  # each run's final evaluation read from {parent}/eval (both read this one)
    run_script("eval.py", ["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(cmp), "--eval",
                           "{parent}/eval"])
    compared = json.load(open(cmp / "comparison.json"))
    rows = compared["runs"]
    assert [r["run"] for r in rows] == ["a", "b"] and all("eval/ece" in r for r in rows)
    assert rows[0]["heldout/pass@1"] == result["pass@1"] and rows[0]["heldout/ece"] == result["ece"]
    assert compared["paired"][0]["diff"] == 0 and compared["paired"][0]["verdict"].startswith("within noise")
    assert (cmp / "curves.png").exists() and "| run |" in open(cmp / "comparison.md").read()


def test_a_run_is_not_scored_on_questions_its_training_split_held(tmp_path, monkeypatch):
    """addition's held-out split follows --seed: a run trained at seed 1 evaluated at seed 0 would be scored
    on sums it trained on. eval.py refuses that in one line naming the count; a run's own seed is the
    default (eval.py::trained_by); any other model, or the run's seed, is not checked against a run."""
    run = tmp_path / "r"
    (run / "final").mkdir(parents=True)
    json.dump({"algo": "grpo", "task": "addition:14", "seed": 1}, open(run / "config.json", "w"))
    train = {e["prompt"] for e in rewards.load_task("addition:14", seed=1).train}
    leaked = sum(e["prompt"] in train for e in rewards.load_task("addition:14", seed=0).test[:30])
    assert leaked > 0  # the case is real: most of seed 0's held-out sums are seed 1's training sums
    monkeypatch.chdir(tmp_path)
    argv = ["--model", str(run / "final"), "--task", "addition:14", "--limit", "30", "--engine", "hf"]
    with pytest.raises(SystemExit) as e:
        ev.cmd_evaluate([*argv, "--seed", "0", "--out", "e0"])
    assert str(e.value) == (f"--seed 0: {leaked} of the 30 held-out questions of --task addition:14 at this "
                            f"seed are in the training split of {run / 'final'} (trained with --seed 1); "
                            f"evaluate with --seed 1, the default for a run's final/")
    assert ev.trained_by(str(run / "final"))["seed"] == 1 and ev.trained_by("tiny") == {}
    assert ev.trained_by(str(run)) == {}  # the run folder itself is not a model
    mixed = lambda seed: rewards.load_task("mixed", seed=seed)  # noqa: E731  held out: every pair
    at_0 = argparse.Namespace(split="test", task="mixed", seed=0, model="m")
    assert ev.check_held_out(mixed(0).test, at_0, {"task": "mixed", "seed": 1}, mixed) is None
    for seed in ([], ["--seed", "1"]):  # the run's own split passes the check; then its (absent) weights fail
        with pytest.raises(SystemExit, match="not a Hugging Face model folder"):
            ev.cmd_evaluate([*argv, *seed, "--out", "e1"])


@pytest.mark.slow
def test_cli_audit_and_contamination(tmp_path):
    labelled = tmp_path / "labels.jsonl"
    labelled.write_text("\n".join(json.dumps(r) for r in [
        {"completion": "\\boxed{4}", "answer": "4", "label": 1},
        {"completion": "4", "answer": "4", "label": 1}]))
    proc = run_script("eval.py", ["audit", "--file", str(labelled), "--out", str(tmp_path)])
    assert "recall 0.500" in proc.stdout and json.load(open(tmp_path / "audit.json"))["fn"] == 1
    proc = run_script("eval.py",
                      ["contamination", "--task", f"gsm8k:{FIX}/gsm8k_{{split}}.jsonl", "--ngram", "5"])
    assert "of 1 held-out prompts" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("argv,message", [
    (["audit", "--file", "missing.jsonl"], "missing.jsonl: file not found"),
    (["audit", "--file", os.path.join(FIX, "own.jsonl")], "own.jsonl: line 1: missing field 'completion'"),
    (["compare", "no/such/run"], "no/such/run/metrics.jsonl: file not found"),
    (["--n", "2", "--k", "1,4"], "every k must lie in 1..--n"),
    (["--n", "2", "--k", "1,4,16"], r"--k 1,4,16: every k must lie in 1..--n \(2\)"),  # given: refused
    (["--k", "1,x"], "--k 1,x: a comma-separated list of integers"),  # was: a ValueError traceback
    (["--limit", "-25"], "--limit -25: must be >= 0"),
    (["--n", "0"], "--n 0: must be >= 1"),  # was: run with 16
    (["--temperature", "0", "--n", "0"], "--n 0: must be >= 1"),
    (["--temperature", "0", "--n", "4"], r"--temperature 0 --n 4: greedy decoding gives one completion per "),
    (["--temperature", "-1"], r"--temperature -1.0: must be >= 0 \(0: greedy decoding\)"),
    (["compare", os.path.join(FIX, "nostep")], "row 1 has no 'step': not a metrics.jsonl"),  # was: KeyError
    # was: 100% contaminated
    (["contamination", "--task", "addition", "--ngram", "0"], "--ngram 0: must be >= 1"),
])
def test_cli_bad_input_gives_a_clear_error(argv, message):
    with pytest.raises(AssertionError, match=message) as e:
        run_script("eval.py", argv)
    assert "Traceback" not in str(e.value)


def test_the_default_k_follows_n(tmp_path):
    """--n without --k: the default 1,4,16 with each k at most --n (was, for --n 2: "--k 1,4,16: every k
    must lie in 1..--n (2)", a --k the user never gave); --n 16 and above keep 1,4,16."""
    argv = ["--task", "addition", "--limit", "2", "--engine", "hf", "--max_new_tokens", "4"]
    for n, ks in (("2", [1, 2]), ("8", [1, 4, 8])):
        result = ev.cmd_evaluate([*argv, "--n", n, "--out", str(tmp_path / n)])
        assert sorted(int(k[5:]) for k in result if k.startswith("pass@") and "_" not in k) == ks


def test_the_output_folder_names_the_whole_task_spec(tmp_path, monkeypatch):
    """Without --out: runs/eval-<model>-<task> with the task's whole spec (was: addition and addition:14 both
    wrote runs/eval-tiny-addition); a spec with a path or a second ':' is made safe and keeps a hash of
    itself, so specs that read alike stay apart."""
    for spec, name in (("addition", "addition"), ("addition:14", "addition-14"), ("mixed:0.5", "mixed-0.5"),
                       ("rg:chain_sum=2,basic_arithmetic", "rg-chain_sum=2,basic_arithmetic")):
        assert ev._task_name(spec) == name
    paths = ["jsonl:a/b-c.jsonl", "jsonl:a-b/c.jsonl", "jsonl:a-b-c.jsonl", "hf:org/ds:cfg", "hf:org/ds-cfg",
             "gsm8k:data/gsm8k_{split}.jsonl", "rg:" + ",".join(["basic_arithmetic"] * 9)]
    names = [ev._task_name(s) for s in paths]
    assert len(set(names)) == len(paths) and all(re.fullmatch(r"[A-Za-z0-9._,=-]{1,89}", n) for n in names)
    assert names[0].startswith("jsonl-a-b-c.jsonl-") and names[2] == "jsonl-a-b-c.jsonl"
    monkeypatch.chdir(tmp_path)
    for spec in ("addition", "addition:14"):
        ev.cmd_evaluate(["--task", spec, "--n", "1", "--limit", "2", "--engine", "hf", "--max_new_tokens",
                         "4"])
    assert sorted(os.listdir(tmp_path / "runs")) == ["eval-tiny-addition", "eval-tiny-addition-14"]
    assert json.load(open(tmp_path / "runs" / "eval-tiny-addition-14" / "eval.json"))["task"] == "addition:14"


def test_evaluation_samples_in_float16_which_training_refuses(tmp_path, monkeypatch):
    """--dtype float16: the options check refuses it for training (no gradient scaler) and its message
    points to eval.py, which samples in float16."""
    import common
    import train_grpo
    with pytest.raises(SystemExit, match="--dtype float16: training in fp16 needs gradient scaling"):
        common.parse_args(train_grpo.Args, ["--dtype", "float16"])
    from rlmini import engine
    seen, make = [], engine.make_engine
    monkeypatch.setattr(engine, "make_engine", lambda args, path, model, tok, device, dtype, max_len:
                        seen.append(dtype) or make(args, path, model, tok, device, dtype, max_len))
    result = ev.cmd_evaluate(["--task", "addition", "--n", "2", "--k", "1,2", "--limit", "3", "--engine",
                              "hf", "--max_new_tokens", "4", "--dtype", "float16", "--out", str(tmp_path)])
    assert seen == [torch.float16] and result["questions"] == 3


RECORD = """import json, runpy, sys
import common
generate, seen = common.generate, []
def record(*a, **k):
    scored = generate(*a, **k)
    seen.extend(scored.rollouts.completion_ids)
    return scored
common.generate = record
sys.argv = ["eval.py", *sys.argv[2:]]
runpy.run_path("eval.py", run_name="__main__")
json.dump(seen, open(OUT, "w"))
"""


def greedy_eval(tmp_path, model_dir: str, task: str, *flags) -> tuple:
    """eval.py --temperature 0 in its own process (a vLLM engine is one per process): (eval.json, the
    completions it scored, stdout), next to transformers' generate(do_sample=False) of the same prompts."""
    import subprocess
    import sys
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from conftest import ROOT
    from rlmini import data, engine
    out = tmp_path / "eval"
    code = RECORD.replace("OUT", repr(str(tmp_path / "seen.json")))
    argv = ["--model", model_dir, "--task", task, "--temperature", "0", "--limit", "12", "--max_new_tokens",
            "8", "--dtype", "float32", "--out", str(out), *flags]
    proc = subprocess.run([sys.executable, "-c", code, "eval.py", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "WANDB_MODE": "disabled"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    # quiet: the terminal holds eval.py's own lines (the table, where it wrote), the libraries' are in its log
    shown = [x for x in (proc.stdout + proc.stderr).splitlines() if x.strip()]
    assert all(x.startswith(("# ", "|", "wrote ", "eval: ")) for x in shown), shown
    assert (out / "logs" / "rank0.log").exists()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(model_dir)
    examples = rewards.load_task(task).test[:12]
    ids = torch.tensor(data.encode_prompts(tok, [e["prompt"] for e in examples], False))  # one length
    eos = engine.stop_ids(tok, model)
    seqs = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=8, eos_token_id=sorted(eos), pad_token_id=tok.pad_token_id)
    seqs = seqs[:, ids.shape[1]:].tolist()
    expected = [s[:next((k + 1 for k, t in enumerate(s) if t in eos), len(s))] for s in seqs]
    return json.load(open(out / "eval.json")), json.load(open(tmp_path / "seen.json")), expected, proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("engine_name", ["hf", "vllm"])
def test_greedy_evaluation_is_transformers_greedy_generate(tmp_path, tiny_addition, engine_name):
    """--temperature 0 on both in-process engines: one completion per question, token for token transformers'
    generate(do_sample=False) in fp32 (a perturbed tiny model, whose greedy completions vary), pass@1 only,
    and the output says it was greedy."""
    from test_common import perturbed
    from rlmini import checkpoint as ckpt
    _, tok, _ = tiny_addition
    final = str(tmp_path / "final")
    ckpt.save_final(perturbed(tiny_addition[0]), tok, final, "tiny")
    result, seen, expected, stdout = greedy_eval(tmp_path, final, "addition", "--engine", engine_name)
    assert seen == expected and len({tuple(c) for c in seen}) > 3
    task = rewards.load_task("addition")
    correct = [task.score(tok.decode(c, skip_special_tokens=True), e, c[-1:] == [tok.eos_token_id]).correct
               for c, e in zip(expected, task.test)]
    assert result["pass@1"] == np.mean(correct) and result["n"] == 1 and result["decoding"] == "greedy"
    assert "maj@1" not in result and "mean@1" not in result and result["temperature"] == 0
    assert "greedy (temperature 0): n=1, pass@1 only" in stdout and "| maj |" not in stdout
    if engine_name == "vllm":  # its INFO lines went to the log, not the terminal
        assert VLLM_INFO.search(open(tmp_path / "eval" / "logs" / "rank0.log").read())


# ------------------------------------------------------------------------ HA-DW's Theorem 1 (eval.py bias)


@pytest.mark.parametrize("p,G", [(0.125, 8), (0.5, 8), (0.9, 8), (0.3, 2), (0.05, 16)])
def test_theorem1_is_the_conditional_expectation_of_a_bernoulli_group(p, G):
    """E[p_hat | 0 < R < G] for R ~ Binomial(G, p), summed over R, equals the closed form (p - p^G) /
    (1 - p^G - (1-p)^G); and the measured side (G of n samples, hypergeometric) tends to it as n grows."""
    w = [math.comb(G, r) * p ** r * (1 - p) ** (G - r) for r in range(1, G)]
    exact = sum(r / G * x for r, x in zip(range(1, G), w)) / sum(w)
    assert ev.theorem1(p, G) == pytest.approx(exact, rel=1e-12)
    n = 20000
    mean, chance = ev.nondegenerate_group_mean(round(p * n), n, G)
    assert mean == pytest.approx(ev.theorem1(p, G), abs=2e-3) and chance == pytest.approx(sum(w), abs=2e-3)
    assert ev.theorem1(0.125, 8) == pytest.approx(0.1904, abs=5e-5)  # the notes' table (algorithms.md)


def test_nondegenerate_group_mean_hand_computed():
    # n = 4 samples, c = 2 correct, G = 2: of the 6 pairs 4 hold one correct -> E = 1/2, P = 4/6
    assert ev.nondegenerate_group_mean(2, 4, 2) == pytest.approx((0.5, 4 / 6))
    # n = 5, c = 2, G = 3: R = 1 in C(2,1) C(3,2) = 6 triples, R = 2 in C(2,2) C(3,1) = 3, of C(5,3) = 10
    assert ev.nondegenerate_group_mean(2, 5, 3) == pytest.approx(((6 / 3 + 3 * 2 / 3) / 9, 9 / 10))
    mean, chance = ev.nondegenerate_group_mean(0, 8, 4)  # never solved: no non-degenerate group
    assert math.isnan(mean) and chance == 0.0
    assert ev.nondegenerate_group_mean(8, 8, 8)[1] == 0.0
    with pytest.raises(ValueError, match="2 <= G <= n"):
        ev.nondegenerate_group_mean(1, 4, 5)


def test_group_bias_per_level_hand_computed():
    """Two level-1 questions (2 and 0 of 4 correct) and one level-2 (1 of 4), groups of 2: level 1's
    non-degenerate groups come from its first question only (P 4/6): c/n 1/2, E[p_hat | nd] 1/2, the two
    samples outside the group 1/2, bias 0; level 2: P 3/6, E 1/2, c/n 1/4, outside the group (4 * 1/4 - 2 *
    1/2) / 2 = 0 (its one correct sample is in every non-degenerate group), bias +1/2; Theorem 1 at 1/4 and
    G 2: 1/2."""
    per_q = {"id": ["a", "b", "c"], "pass@1": [0.5, 0.0, 0.25], "level": [1, 1, 2]}
    out = ev.group_bias(per_q, 4, 2)
    assert out["1"]["questions"] == 2 and out["1"]["p"] == pytest.approx(0.25)
    assert out["1"]["p_nondegenerate"] == pytest.approx((4 / 6 + 0) / 2)
    assert (out["1"]["p_weighted"], out["1"]["e_phat"], out["1"]["bias"]) == pytest.approx((0.5, 0.5, 0.0))
    assert (out["2"]["p_weighted"], out["2"]["e_phat"], out["2"]["p_rest"]) == pytest.approx((0.25, 0.5, 0.0))
    assert out["2"]["bias"] == pytest.approx(0.5)
    assert out["2"]["theorem1"] == pytest.approx(0.5)
    # all: weights 4/6 and 3/6: p = (4/6 * 1/2 + 3/6 * 1/4) / (7/6), E = 1/2
    assert out["all"]["p_weighted"] == pytest.approx((4 / 6 * 0.5 + 3 / 6 * 0.25) / (7 / 6))
    assert out["all"]["e_phat"] == pytest.approx(0.5) and out["all"]["questions"] == 3
    solved = ev.group_bias({"id": ["a"], "pass@1": [1.0]}, 4, 2)  # no tag: "all"; no nd group: no bias
    assert set(solved) == {"all"} and "bias" not in solved["all"]
    with pytest.raises(ValueError, match="G 4 must lie in 2..n-1"):  # no sample outside the group
        ev.group_bias(per_q, 4, 4)


@pytest.mark.parametrize("p, n, G", [(0.1, 16, 8), (0.3, 9, 8), (0.7, 32, 4)])
def test_group_bias_is_theorem_1s_bias_in_expectation(p, n, G):
    """Questions of one true p, each scored n times (c ~ Bin(n, p)): the measured bias over many of them is
    Theorem 1's E[p_hat | nd] - p, exactly in expectation (here the expectation over c, by its binomial
    weights: no sampling noise), whatever n - G; the naive e_phat - p_weighted is (n - G)/n of it."""
    weights = np.array([math.comb(n, c) * p ** c * (1 - p) ** (n - c) for c in range(n + 1)])
    per_q = {"id": list(range(n + 1)), "pass@1": [c / n for c in range(n + 1)]}
    stats = [ev.nondegenerate_group_mean(c, n, G) for c in range(n + 1)]
    w = weights * np.array([s[1] for s in stats])  # each c's share of the non-degenerate groups
    e_phat = sum(wi * s[0] for wi, s in zip(w, stats) if wi > 0) / w.sum()
    p_weighted = sum(wi * c / n for c, wi in enumerate(w)) / w.sum()
    assert e_phat == pytest.approx(ev.theorem1(p, G), rel=1e-9)
    truth = ev.theorem1(p, G) - p
    assert e_phat - p_weighted == pytest.approx((n - G) / n * truth, rel=1e-9)
    # group_bias on a population holding each c in proportion to its probability (2 x 10^4 questions)
    reps = np.round(weights * 2e4).astype(int)
    big = {"id": [], "pass@1": [c / n for c in range(n + 1) for _ in range(reps[c])]}
    big["id"] = list(range(len(big["pass@1"])))
    assert ev.group_bias(big, n, G)["all"]["bias"] == pytest.approx(truth, rel=2e-2)


@pytest.mark.slow
def test_bias_command_on_the_tiny_model_a_few_questions(tmp_path):
    """eval.py bias samples through eval.py (its eval.json, n a question) and writes bias.json per level;
    --from reads that evaluation again without sampling; a G above n, or no --out, is refused in one line."""
    out = tmp_path / "b"
    result = ev.main(["bias", "--model", "tiny", "--task", "sums_levels", "--engine", "hf", "--n", "6",
                      "--limit", "9", "--G", "4", "--out", str(out)])
    saved = json.load(open(out / "bias.json"))
    assert saved == json.loads(json.dumps(result)) and (saved["n"], saved["G"]) == (6, 4)
    levels = {str(x) for x in json.load(open(out / "eval.json"))["per_question"]["level"]}
    assert set(saved["bias"]) == {"all"} | levels and len(levels) > 1  # --limit 9 takes every level
    assert saved["bias"]["all"]["questions"] == 9
    assert ev.main(["bias", "--from", str(out), "--G", "4"])["bias"] == result["bias"]
    for argv, message in ((["--from", str(out), "--G", "6"], r"--G 6: must lie in 2..n-1 \(6 samples"),
                          (["--model", "tiny", "--n", "8", "--out=x"],
                           r"--G 8: must lie in 2..n-1 \(--n 8\)"),
                          (["--model", "tiny"], "--out DIR"),
                          (["--from", str(tmp_path)], "no eval.py eval.json")):
        with pytest.raises(SystemExit, match=message) as e:
            ev.main(["bias", *argv])
        assert "\n" not in str(e.value)


# ------------------------------------------------------------- compare: pass@k per question, subsets


def test_per_question_pass_at_k_and_tags_and_by_level():
    """summarize(boot=True): each question's unbiased pass@k (not only pass@1) and its level; by_level: each
    level's pass@k. Hand-computed: 4 samples, pass@2 of c correct = 1 - C(4-c, 2) / C(4, 2)."""
    task = rewards.load_task("sums_levels", style="chat")
    examples = [dict(task.test[0], level=1), dict(task.test[1], level=2), dict(task.test[2], level=2)]
    correct = [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]]
    scores = [rewards.Score(float(c), float(c), 1.0) for row in correct for c in row]
    out = ev.summarize(task, examples, scores, 4, [1, 2], boot=True)
    pq = out["per_question"]
    assert pq["pass@2"] == pytest.approx([1 - 3 / 6, 1 - 1 / 6, 0.0]) and pq["level"] == [1, 2, 2]
    assert pq["pass@1"] == pytest.approx([0.25, 0.5, 0.0])
    assert out["by_level"]["1"] == {"questions": 1, "pass@1": 0.25, "pass@2": pytest.approx(0.5)}
    assert out["by_level"]["2"]["pass@2"] == pytest.approx((5 / 6 + 0) / 2)
    assert out["pass@2"] == pytest.approx(np.mean(pq["pass@2"]))
    plain = ev.summarize(rewards.load_task("sums"), examples[:1], scores[:4], 4, [1], boot=True)
    assert "pass@2" not in plain["per_question"] and "by_level" not in plain  # one level: no by_level
    # a user's jsonl rows keep every column: a "level" with gaps, or of mixed kinds or lists, is no subset
    for odd in ([1, None, 2], [1, "2", 2], [[1], [2], [2]]):
        user = [dict(e, level=v) for e, v in zip(examples, odd)]
        out = ev.summarize(task, user, scores, 4, [1, 2], boot=True)
        assert "by_level" not in out and "level" not in out["per_question"], odd


def _eval_with(folder, pass1, pass16, level):
    os.makedirs(folder, exist_ok=True)
    ids = [f"q{i}" for i in range(len(pass1))]
    json.dump({"model": "m", "task": "t", "decoding": "sampled", "n": 16, "pass@1": float(np.mean(pass1)),
               "pass@16": float(np.mean(pass16)), "format_fail": 0.0,
               "per_question": {"id": ids, "pass@1": pass1, "reward": pass1, "pass@16": pass16,
                                "level": level}}, open(os.path.join(folder, "eval.json"), "w"))


def test_compare_pairs_pass_at_k_and_a_named_subset(tmp_path):
    """compare reads heldout/pass@16 beside pass@1 and pairs it per question; --subset level=2 gives the
    metrics of those questions only (each arm's mean over them, the paired difference on them); a tag the
    evaluations lack, or a value none has, is refused in one line."""
    level = [1, 1, 2, 2]
    # arm b solves level 2's questions more often at k = 16 on both seeds; level 1 the same
    for s in (0, 1):
        _eval_with(tmp_path / f"a-s{s}", [0.5, 0.25, 0.0, 0.0], [1.0, 0.75, 0.0, 0.25], level)
        _eval_with(tmp_path / f"b-s{s}", [0.5, 0.25, 0.125, 0.0], [1.0, 0.75, 0.5, 0.75], level)
    runs = [str(tmp_path / f"{g}-s{s}") for g in "ab" for s in (0, 1)]
    r = ev.main(["compare", *runs, "--metric", "heldout/pass@1,heldout/pass@16", "--out", str(tmp_path / "c"),
                 "--reps", "200"])
    assert r["runs"][0]["heldout/pass@16"] == pytest.approx(0.5) and r["runs"][2]["heldout/pass@16"] == 0.75
    paired = {x["metric"]: x for x in r["paired"]}
    assert paired["heldout/pass@16"]["diff"] == pytest.approx(0.5 - 0.75)  # a - b over 4 questions
    assert paired["heldout/pass@1"]["diff"] == pytest.approx(-0.125 / 4)
    assert "heldout/pass@16" in open(tmp_path / "c" / "comparison.md").read()
    sub = ev.main(["compare", *runs, "--metric", "heldout/pass@16", "--subset", "level=2", "--out",
                   str(tmp_path / "c2"), "--reps", "200"])
    assert sub["subset"] == "level=2" and sub["runs"][0]["heldout/pass@16"] == pytest.approx(0.125)
    assert sub["runs"][2]["heldout/pass@16"] == pytest.approx(0.625)
    assert sub["paired"][0]["questions"] == 2 and sub["paired"][0]["diff"] == pytest.approx(0.125 - 0.625)
    one = ev.main(["compare", *runs, "--subset", "level=1", "--out", str(tmp_path / "c3"), "--reps", "50"])
    assert one["paired"][0]["diff"] == 0.0
    for subset, message in (("family=x", "has no per-question 'family'"),
                            ("level=7", r"no question of \S+ has level 7 \(it has 1, 2\)"),
                            ("level", "expected TAG=VALUE")):
        with pytest.raises(SystemExit, match=message) as e:
            ev.main(["compare", *runs, "--subset", subset, "--out", str(tmp_path / "c4")])
        assert "\n" not in str(e.value)
