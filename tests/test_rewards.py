"""Tasks and verifiers: synthetic tasks, the real-dataset parsers on local fixtures, bad input."""
import math
import os

import pytest

import rewards
from rlmini import models, reward_fns

FIX = os.path.join(os.path.dirname(__file__), "fixtures")


def test_addition_needs_eos_and_exact_sum():
    task = rewards.load_task("addition")
    ex = {"prompt": "7+8=", "answer": 15}
    assert task.score("15", ex, True) == rewards.Score(1.0, 1.0, 1.0, pred="15")
    assert task.score("15", ex, False).reward == 0.0          # truncated: no EOS
    assert task.score("14", ex, True) == rewards.Score(0.0, 0.0, 1.0, pred="14")
    assert task.score("1+5", ex, True).format_ok == 0.0
    assert len(task.train) == 80 and len(task.test) == 20
    train_pairs = {e["prompt"] for e in task.train}
    assert not train_pairs & {e["prompt"] for e in task.test}   # held out
    wide = rewards.load_task("addition:49")  # operands 0..49: 2,500 pairs, a fifth held out
    assert len(wide.train) == 2000 and len(wide.test) == 500 and task.alphabet == wide.alphabet
    assert len({e["prompt"] for e in wide.train + wide.test}) == 2500 and wide.test[0]["prompt"] == "10+16="
    assert wide.score("26", wide.test[0], True).correct == 1.0
    with pytest.raises(rewards.DataError, match="addition takes the largest operand >= 1, e.g. addition:19"):
        rewards.load_task("addition:x")


def test_calibration_task_follows_seed_000():
    task = rewards.load_task("calibration", seed=3)
    assert len(task.train) == 10_000
    cats = {e["category"]: e["p_true"] for e in task.train + task.test}
    assert len(cats) == 20 and all(0 < p < 1 for p in cats.values())
    # outcomes are Bernoulli(p_category): the empirical rate tracks p within sampling error
    for c, p in cats.items():
        outs = [e["answer"] for e in task.train if e["category"] == c]
        assert abs(sum(outs) / len(outs) - p) < 4 * math.sqrt(p * (1 - p) / len(outs)) + 1e-9
    ex1, ex0 = {"answer": 1}, {"answer": 0}
    assert task.score("70%", ex1, False).reward == pytest.approx(math.log(0.7))
    assert task.score("70%", ex0, True).reward == pytest.approx(math.log(0.3))
    assert task.score("70%", ex0, True).correct == 0.0 and task.score("70%", ex1, True).correct == 1.0
    assert task.score("70%", ex1, True).prob == pytest.approx(0.7)
    bad = task.score("7", ex1, True)
    assert bad.reward == pytest.approx(math.log(0.01)) and bad.format_ok == 0.0 and bad.prob is None


def test_calibration_chat_format_and_brier():
    task = rewards.load_task("calibration", style="chat", brier=True)
    ex = {"answer": 1}
    assert task.score("I think <answer>80</answer>", ex, True).reward == pytest.approx(-(1 - 0.8) ** 2)
    assert task.score("<answer>0</answer>", ex, True).format_ok == 0.0  # out of 1..99
    assert task.score("<answer>100</answer>", ex, True).reward == -1.0
    assert task.pass_threshold == pytest.approx(-0.25)


def test_ordinal_levels_and_threshold():
    task = rewards.load_task("ordinal")
    ex = {"answer": 5}
    assert [task.score(d, ex, True).reward for d in "5467391"] == [1.0, 0.5, 0.5, 0.0, 0.0, -0.5, -0.5]
    assert task.score("5", ex, False).reward == -1.0 and task.score("55", ex, True).reward == -1.0
    assert task.pass_threshold == 0.5
    assert all(e["answer"] <= 9 for e in task.train)


def test_gsm8k_parser_on_local_files():
    task = rewards.load_task(f"gsm8k:{FIX}/gsm8k_{{split}}.jsonl")
    assert [e["answer"] for e in task.train] == ["72", "10", "1550"]
    assert task.test[0]["answer"] == "7"
    assert "\\boxed{}" in task.train[0]["prompt"]
    assert task.score("so \\boxed{72}", task.train[0], True).correct == 1.0
    assert task.score("so \\boxed{72.0}", task.train[0], True).correct == 1.0  # math-verify: numeric equality
    assert task.score("so \\boxed{71}", task.train[0], True) == rewards.Score(0.0, 0.0, 1.0, pred="71")
    assert task.score("no box, 72", task.train[0], True) == rewards.Score(0.0, 0.0, 0.0)


def test_math_parser_takes_the_last_boxed_answer():
    task = rewards.load_task(f"math:{FIX}/math_{{split}}.jsonl")
    assert task.train[0]["answer"] == "\\frac{3}{4}"
    assert task.train[1]["answer"] == "2\\sqrt{2}"
    assert task.score("thus \\boxed{0.75}", task.train[0], True).correct == 1.0
    assert task.score("thus \\boxed{\\sqrt{8}}", task.train[1], True).correct == 1.0
    assert task.score("thus \\boxed{3}", task.train[1], True).correct == 0.0


def test_last_boxed_handles_nested_braces():
    assert rewards.last_boxed("a \\boxed{1} b \\boxed{\\frac{1}{2}} c") == "\\frac{1}{2}"
    assert rewards.last_boxed("\\boxed{unclosed") is None
    assert rewards.last_boxed("nothing") is None


def test_own_jsonl_with_held_out_file_and_exact_reward():
    task = rewards.load_task(f"jsonl:{FIX}/own.jsonl", jsonl_reward="exact")
    assert len(task.train) == 3 and len(task.test) == 1
    assert task.score("\\boxed{Paris}", task.train[2], True).correct == 1.0
    math_task = rewards.load_task(f"jsonl:{FIX}/own.jsonl")
    assert math_task.score("\\boxed{2.5}", math_task.train[1], True).correct == 1.0


@pytest.mark.parametrize("spec,message", [
    (f"gsm8k:{FIX}/gsm8k_bad.jsonl", r"gsm8k_bad.jsonl: line 2: answer has no '#### <number>'"),
    (f"gsm8k:{FIX}/gsm8k_missing.jsonl", r"gsm8k_missing.jsonl: line 3: missing field 'question'"),
    (f"gsm8k:{FIX}/gsm8k_badjson.jsonl", r"gsm8k_badjson.jsonl: line 2: not valid JSON"),
    (f"math:{FIX}/math_bad.jsonl", r"math_bad.jsonl: line 2: solution has no \\boxed"),
    (f"jsonl:{FIX}/own_bad.jsonl", r"own_bad.jsonl: line 2: column 'prompt' is empty"),
    (f"jsonl:{FIX}/nope.jsonl", r"nope.jsonl: file not found"),
    ("jsonl", r"needs a path"),
    ("sudoku", r"unknown task"),
])
def test_bad_input_names_file_and_row(spec, message):
    with pytest.raises(rewards.DataError, match=message):
        rewards.load_task(spec)


def test_line_numbers_are_the_files_own_and_bad_files_are_named(tmp_path):
    """1-based physical lines, blank lines counted (they used to be skipped by one count and not the other).
    """
    bad = tmp_path / "blank.jsonl"
    bad.write_text('{"prompt": "a", "answer": "1"}\n\n\n{"prompt": "b"}\n')
    with pytest.raises(rewards.DataError, match=r"blank.jsonl: line 4: missing column 'answer'"):
        rewards.load_task(f"jsonl:{bad}")
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes('{"prompt": "a", "answer": "1"}\n{"prompt": "caf\u00e9", "answer": '
                      '"2"}\n'.encode("latin-1"))
    with pytest.raises(rewards.DataError, match=r"latin.jsonl: line 2: not UTF-8 text \(byte 15 of the line"):
        rewards.load_task(f"jsonl:{latin}")
    with pytest.raises(rewards.DataError, match="is a folder, not a JSONL file"):
        rewards.load_task(f"jsonl:{tmp_path}")
    # were: IndexError, 2,000 all-hard prompts, a bare ValueError
    for spec in ("mixed:-1", "mixed:2", "mixed:x"):
        with pytest.raises(rewards.DataError, match=r"share of hard prompts in \[0, 1\]"):
            rewards.load_task(spec)


def test_unknown_jsonl_reward_names_flag():
    with pytest.raises(rewards.DataError, match="--jsonl_reward"):
        rewards.load_task(f"jsonl:{FIX}/own.jsonl", jsonl_reward="llm")


def test_tiny_tokenizer_round_trips_every_task_alphabet():
    from transformers import AutoTokenizer
    for name in ("addition", "calibration", "ordinal"):
        task = rewards.load_task(name)
        tok = AutoTokenizer.from_pretrained(models.build_tiny_model(task.alphabet))
        for ex in task.train[:20]:
            ids = tok(ex["prompt"], add_special_tokens=False)["input_ids"]
            assert tok.unk_token_id not in ids
            assert tok.decode(ids) == ex["prompt"]
    tok = AutoTokenizer.from_pretrained(models.build_tiny_model(rewards.load_task("calibration").alphabet))
    ids = tok("37%", add_special_tokens=False)["input_ids"]
    assert len(ids) == 1 and tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True) == "37%"


def test_an_unreachable_hub_dataset_is_one_line_naming_it_and_the_local_way(monkeypatch):
    """`--task gsm8k` offline (or a hub that does not answer): one line naming the dataset and
    --task gsm8k:PATH, not datasets' ConnectionError traceback."""
    import datasets

    def unreachable(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (LocalEntryNotFoundError)\nmore")
    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    for task, dataset in (("gsm8k", "openai/gsm8k"), ("math", "DigitalLearningGmbH/MATH-lighteval")):
        with pytest.raises(rewards.DataError) as e:
            rewards.load_task(task)
        message = str(e.value)
        assert "\n" not in message and dataset in message and f"--task {task}:PATH" in message
        assert "ConnectionError" in message


def test_sums_reads_the_last_number_of_the_reply_and_needs_eos():
    """sums (the real model's task): the answer is the last number the reply writes, as a chat model writes
    sums ("12 + 13 = 25."), thousands separators and decimals read whole; truncated or numberless is a format
    failure; 0..49 holds out 500 pairs, disjoint from training, the same split for every style and seed."""
    task = rewards.load_task("sums", style="chat")
    ex = {"prompt": "What is 12 + 13? Answer with the number only.", "answer": 25}
    assert task.score("12 + 13 = 25.", ex, True) == rewards.Score(1.0, 1.0, 1.0, pred="25")
    assert task.score("The sum is 25.0", ex, True).correct == 1.0
    assert task.score("12 + 13 = 24, not 25? No: 24", ex, True) == rewards.Score(0.0, 0.0, 1.0, pred="24")
    assert task.score("12 + 13 = 25", ex, False) == rewards.Score(0.0, 0.0, 0.0)  # cut off: no EOS
    assert task.score("twenty-five", ex, True).format_ok == 0.0
    assert rewards.last_number("a total of 1,234 apples, or -3.5") == "-3.5"
    assert rewards.last_number("1,234") == "1234" and rewards.last_number("12,13") == "13"
    assert len(task.train) == 2000 and len(task.test) == 500 and task.max_new_tokens == 32
    assert not {e["prompt"] for e in task.train} & {e["prompt"] for e in task.test}
    other = rewards.load_task("sums", style="chat", seed=5)  # a run of seed 5 is evaluated on the same 500
    assert (other.train, other.test) == (task.train, task.test)  # (eval.py's default --seed is 0)
    assert task.test[0]["prompt"].startswith("What is ") and task.test[0]["answer"] == sum(
        int(x) for x in task.test[0]["prompt"][8:].split("?")[0].split(" + "))
    small = rewards.load_task("sums:9", style="tiny")  # at most a fifth held out
    assert len(small.test) == 20 and small.test[0]["prompt"].endswith("=")
    with pytest.raises(rewards.DataError, match="sums takes the largest operand >= 2, e.g. sums:49"):
        rewards.load_task("sums:1")


def test_sums_graded_gives_partial_credit_by_distance_on_the_same_questions():
    """sums_graded (CoRPO's setting on the real model): the questions and split of sums, reward 1 / 0.75 /
    0.5 / 0.25 / 0 for an answer off by 0..4, -0.5 farther, -1 for none; correct means exact; an ordinal
    task with pass threshold 0.5, so off by two passes (eval.py's pass_rate) and off by three fails."""
    graded, plain = rewards.load_task("sums_graded", style="chat"), rewards.load_task("sums", style="chat")
    assert (graded.train, graded.test) == (plain.train, plain.test)
    assert (graded.kind, graded.pass_threshold, graded.name) == ("ordinal", 0.5, "sums_graded")
    ex = {"prompt": "What is 12 + 13? Answer with the number only.", "answer": 25}
    for reply, reward, correct in (("12 + 13 = 25.", 1.0, 1.0), ("24", 0.75, 0.0), ("It is 27", 0.5, 0.0),
                                   ("22", 0.25, 0.0), ("29", 0.0, 0.0), ("21.5", 0.125, 0.0),
                                   ("30", -0.5, 0.0), ("-25", -0.5, 0.0), ("twenty-five", -1.0, 0.0)):
        s = graded.score(reply, ex, True)
        assert (s.reward, s.correct) == (reward, correct), reply
        assert (s.reward >= graded.pass_threshold) == (reply in ("12 + 13 = 25.", "24", "It is 27")), reply
    assert graded.score("25", ex, False) == rewards.Score(-1.0, 0.0, 0.0)  # cut off: no answer
    assert len(rewards.load_task("sums_graded:9", style="tiny").test) == 20
    with pytest.raises(rewards.DataError, match="sums_graded takes the largest operand >= 2"):
        rewards.load_task("sums_graded:x")


def test_sums_levels_holds_each_level_out_and_trains_on_every_level_equally():
    """sums_levels (HA-DW on SmolLM2): level L sums two L-digit operands (level 1: 0..9) in sums' chat form,
    tagged with its level; held out per level: 100 pairs (level 1: a fifth of its 100), disjoint from the
    train split, which holds 1,000 of each level; scored like sums (the last number of a finished reply)."""
    task = rewards.load_task("sums_levels", style="chat", seed=0)
    assert task.name == "sums_levels" and task.kind == "binary" and task.max_new_tokens == 32
    count = lambda xs, L: sum(e["level"] == L for e in xs)  # noqa: E731
    assert [count(task.test, L) for L in (1, 2, 3)] == [20, 100, 100]
    assert [count(task.train, L) for L in (1, 2, 3)] == [1000, 1000, 1000]
    assert not {e["prompt"] for e in task.train} & {e["prompt"] for e in task.test}
    operands = lambda e: frozenset(e["prompt"][len("What is "):].split("?")[0].split(" + "))  # noqa: E731
    assert not {operands(e) for e in task.train} & {operands(e) for e in task.test}  # nor b + a for a + b
    # level 1: the pairs neither of whose orders is held out (20 held: 66 of the other 80), repeated
    assert len({e["prompt"] for e in task.train if e["level"] == 1}) == 66
    for e in task.test + task.train:
        a, b = (int(x) for x in e["prompt"][len("What is "):].split("?")[0].split(" + "))
        assert e["answer"] == a + b and e["prompt"].endswith("? Answer with the number only.")
        lo = 0 if e["level"] == 1 else 10 ** (e["level"] - 1)
        assert lo <= a < 10 ** e["level"] and lo <= b < 10 ** e["level"]
    ex = {"prompt": "What is 345 + 678? Answer with the number only.", "answer": 1023, "level": 3}
    assert task.score("345 + 678 = 1,023.", ex, True) == rewards.Score(1.0, 1.0, 1.0, pred="1023")
    assert task.score("345 + 678 = 1013", ex, True) == rewards.Score(0.0, 0.0, 1.0, pred="1013")
    assert task.score("345 + 678 = 1023", ex, False) == rewards.Score(0.0, 0.0, 0.0)  # no EOS
    assert rewards.load_task("sums_levels", style="chat", seed=5).test == task.test  # every seed's: paired
    tiny = rewards.load_task("sums_levels:2", style="tiny")
    assert {e["level"] for e in tiny.test} == {1, 2} and tiny.test[0]["prompt"].endswith("=")
    for spec in ("sums_levels:1", "sums_levels:5", "sums_levels:x"):
        with pytest.raises(rewards.DataError, match="sums_levels takes the number of levels, 2 to 4"):
            rewards.load_task(spec)


@pytest.mark.parametrize("name,symbol,value", [("subtraction", "-", lambda a, b: a - b),
                                               ("products", "*", lambda a, b: a * b),
                                               ("sums3", "+", lambda *x: sum(x))])
def test_out_of_domain_families_are_sums_chat_form_with_its_verifier(name, symbol, value):
    """subtraction, products and sums3 (CoRPO out of domain): sums' chat question and verifier, operands in
    range (subtraction never negative, products from 2), distinct questions, a held-out split disjoint from
    training, tagged with the family."""
    task = rewards.load_task(name, style="chat", seed=1)
    top = rewards.ARITH_FAMILIES[name][0]
    assert task.score is rewards.load_task("sums").score is rewards.score_last_number  # sums' verifier
    assert task.kind == "binary" and task.pass_threshold == 1.0
    assert not {e["prompt"] for e in task.train} & {e["prompt"] for e in task.test}
    prompts = [e["prompt"] for e in task.train + task.test]
    assert len(prompts) == len(set(prompts)) and 0 < len(task.test) <= len(prompts) // 5
    for e in task.train + task.test:
        ops = [int(x) for x in e["prompt"][len("What is "):].split("?")[0].split(f" {symbol} ")]
        assert e["answer"] == value(*ops) and e["family"] == name
        assert all((2 if name == "products" else 0) <= x <= top for x in ops) and e["answer"] >= 0
    ex = task.test[0]
    assert task.score(f"The answer is {ex['answer']}.", ex, True) == rewards.Score(1.0, 1.0, 1.0,
                                                                                   pred=str(ex["answer"]))
    assert task.score(f"{ex['answer'] + 1}", ex, True).correct == 0.0
    assert rewards.load_task(name, style="chat", seed=6).test == task.test  # every seed's: paired
    small = rewards.load_task(f"{name}:4", style="tiny")
    assert small.test[0]["prompt"].endswith("=") and symbol in small.alphabet
    with pytest.raises(rewards.DataError, match=f"{name} takes the largest operand >= "):
        rewards.load_task(f"{name}:1")


def test_calibration_plain_reads_the_first_percentage_of_a_begun_reply():
    """calibration_plain (seed 000 on SmolLM2): calibration's questions, categories and outcomes, asked with
    the assistant's reply begun; the prediction is the reply's first percentage, rounded, valid in 1..99."""
    plain, paper = rewards.load_task("calibration_plain", style="chat"), rewards.load_task("calibration",
                                                                                           style="chat")
    strip = lambda rows: [{k: v for k, v in e.items() if k != "prompt"} for e in rows]  # noqa: E731
    assert strip(plain.train) == strip(paper.train) and strip(plain.test) == strip(paper.test)
    assert (plain.kind, plain.name, plain.pass_threshold) == ("probability", "calibration_plain",
                                                              paper.pass_threshold)
    ex = plain.test[0]
    assert ex["prompt"][1]["role"] == "assistant" and f"C{ex['category']:02d}" in ex["prompt"][0]["content"]
    pos, neg = dict(ex, answer=1), dict(ex, answer=0)
    for reply, k in ((" 30%.", 30), (" approximately 34.6 %, and 20% of", 35), (" 0.62, so 62%", 62),
                     (" 99%", 99), (" 1%", 1)):
        s = plain.score(reply, pos, False)  # a reply cut off after its percentage counts as well
        assert s.prob == k / 100 and s.reward == pytest.approx(math.log(k / 100)) and s.format_ok == 1.0
        assert plain.score(reply, neg, True).reward == pytest.approx(math.log(1 - k / 100))
    floor = plain.score(" about a half", pos, True).reward
    for reply in (" about a half", " 0.4%", " 100%", " 250%", " 62"):  # no percentage, or outside 1..99
        s = plain.score(reply, pos, True)
        assert (s.prob, s.format_ok, s.reward) == (None, 0.0, floor), reply
    assert floor == rewards.calibration_reward(None, 1, False)


def test_reward_weights_without_reward_is_refused():
    """--reward_weights weighs --reward's functions: given without --reward (was: silently ignored, the
    task's verifier the reward at weight 1; beside --reward_model: "1 weight(s) for 0 reward function(s)")
    it is refused in one line naming both flags."""
    def rm(prompts, completions, examples, finished):
        return [0.0] * len(prompts)
    for sources in (None, {"rm": rm}):
        with pytest.raises(rewards.DataError, match=r"^--reward_weights 2: weights of --reward's functions, "
                                                    r"but --reward is empty") as e:
            reward_fns.with_reward_functions(rewards.load_task("addition"), "", "2", sources=sources)
        assert "\n" not in str(e.value)
