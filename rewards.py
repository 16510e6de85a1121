"""Tasks and verifiers.

A task is a train split and a held-out test split of examples (a dict with at least "prompt" and "answer")
plus a `score(completion, example, finished)` that returns correctness and format separately ("GRPO for
Reasoning-Model Post-Training", 2026: report them apart). Synthetic tasks are generated in-process from a
seed, so everything runs offline; gsm8k and math read the real datasets through `datasets`, or local files.

Prompt styles: "tiny" is the terse format the built-in random-initialised model can learn from scratch (a
character-level tokenizer covering the task's alphabet); "chat" is the natural-language instruction a
pretrained model gets (wrapped in its chat template by common.py).
"""
import math
import os
import random
import re
import string

from rlmini.rg import rg_task
from rlmini.datafiles import dataset_splits, parse_rows, read_split, require_fields, where
from rlmini.task import OUTPUT_MARK, DataError, Score, Task  # noqa: F401 (what a reward writes against)

# Bereket & Leskovec 2025, App. A.7: unparseable prediction = worst in-range log-likelihood
LOG_FLOOR = math.log(0.01)

# ----------------------------------------------------------------------------------------------
# answer extraction


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (balanced braces), or None."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j]
    return None


def math_equal(pred: str, gold: str) -> bool:
    """Symbolic equivalence through math-verify (latex and plain numbers)."""
    from math_verify import parse, verify
    gold_parsed = parse(gold if "$" in gold else f"\\boxed{{{gold}}}")
    pred_parsed = parse(f"\\boxed{{{pred}}}")
    return bool(gold_parsed) and bool(pred_parsed) and verify(gold_parsed, pred_parsed)


def score_boxed_math(completion: str, example: dict, finished: bool) -> Score:
    pred = last_boxed(completion)
    if pred is None or not finished:
        return Score(0.0, 0.0, 0.0)
    ok = float(math_equal(pred, str(example["answer"])))
    return Score(ok, ok, 1.0, pred=pred.replace(" ", ""))


def score_exact(completion: str, example: dict, finished: bool) -> Score:
    """Exact match of the last boxed answer, or of the whole stripped completion if none."""
    pred = last_boxed(completion)
    pred = completion.strip() if pred is None else pred.strip()
    if not finished or not pred:
        return Score(0.0, 0.0, 0.0)
    ok = float(pred == str(example["answer"]).strip())
    return Score(ok, ok, 1.0, pred=pred)


# ----------------------------------------------------------------------------------------------
# synthetic tasks (generated from a seed, offline)

DIGITS = list("0123456789")


def _split(examples: list, n_test: int) -> tuple[list, list]:
    return examples[n_test:], examples[:n_test]


def addition_task(style: str, seed: int, max_operand: int = 9, n_test: int | None = None) -> Task:
    """a+b= with a, b in [0, max_operand]; the answer is the decimal sum followed by EOS.

    Binary reward. Built so that a random-initialised model finds a few correct answers by chance
    (1-2 digit answers over a 15-token vocabulary, ~2% at the start) and RL takes it from there.
    Of the (max_operand + 1)^2 pairs, n_test (default: a fifth) are held out: the test split measures
    generalisation to unseen sums.
    """
    pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    n_test = len(pairs) // 5 if n_test is None else n_test
    random.Random(seed).shuffle(pairs)
    examples = []
    for a, b in pairs:
        if style == "tiny":
            prompt = f"{a}+{b}="
        else:
            prompt = f"What is {a} + {b}? Give only the final answer in \\boxed{{}}."
        examples.append({"prompt": prompt, "answer": a + b})
    train, test = _split(examples, n_test)

    def score(completion: str, example: dict, finished: bool) -> Score:
        text = last_boxed(completion) if style != "tiny" else completion
        text = (text or "").strip()
        if not finished or not text.isdigit():
            return Score(0.0, 0.0, 0.0)
        ok = float(int(text) == example["answer"])
        return Score(ok, ok, 1.0, pred=str(int(text)))

    return Task("addition", "binary", train, test, score, pass_threshold=1.0,
                alphabet=DIGITS + ["+", "="], max_new_tokens=4 if style == "tiny" else 256)


LAST_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?!\d)|-?\d+(?:\.\d+)?")  # 1,234 and 12.5 are one number


def last_number(text: str) -> str | None:
    """The last number written in `text` ("17 + 25 = 42." -> "42"; "1,234" -> "1234"), or None."""
    found = LAST_NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


def sums_graded_reward(distance: float | None) -> float:
    """--task sums_graded: 1 for the sum, 0.75, 0.5, 0.25, 0 for an answer off by 1, 2, 3, 4, -0.5 farther,
    -1 for no answer (no number, or a reply that never ends): ordinal, as seed 004's rewards are."""
    if distance is None:
        return -1.0
    return 1.0 - distance / 4 if distance <= 4 else -0.5


def score_last_number(completion: str, example: dict, finished: bool) -> Score:
    """`sums`' binary verifier: 1 if the last number of a finished reply is the answer, else 0; no number,
    or a reply that never ends, is a format failure."""
    pred = last_number(completion)
    if not finished or pred is None:
        return Score(0.0, 0.0, 0.0)
    ok = float(float(pred) == example["answer"])
    return Score(ok, ok, 1.0, pred=pred)


def sums_task(style: str, max_operand: int = 49, n_test: int = 500, graded: bool = False) -> Task:
    """a + b with a, b in [0, max_operand], asked as a pretrained chat model answers it: the answer is the
    last number of the reply ("12 + 13 = 25."), which must end (EOS). The task for --model smollm2, which
    never writes \\boxed{} (addition's chat format) but writes its sums as equations: greedy, it starts at
    about 0.25 held-out pass@1 on 0..49 (docs/results.md). `n_test` pairs are held out (at most a fifth), the
    same for every --seed (drawn from seed 0: runs of every seed are evaluated on questions none trained on,
    and eval.py compare pairs them); --seed orders the training prompts (data.prompt_batch). b + a of a
    held-out a + b may be trained (sums_levels holds out both orders).
    `graded` (--task sums_graded): the same questions and split, partial credit by the answer's distance
    (sums_graded_reward), pass threshold 0.5 (off by 2 at most): CoRPO's setting (Garg & Venkatesh 2025)."""
    pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    n_test = min(n_test, len(pairs) // 5)
    random.Random(0).shuffle(pairs)  # not --seed: a run evaluated on another seed's split trained on it
    examples = [{"prompt": f"{a}+{b}=" if style == "tiny" else
                 f"What is {a} + {b}? Answer with the number only.", "answer": a + b} for a, b in pairs]
    train, test = _split(examples, n_test)

    def graded_score(completion: str, example: dict, finished: bool) -> Score:
        pred = last_number(completion)
        if not finished or pred is None:
            return Score(sums_graded_reward(None), 0.0, 0.0)
        distance = abs(float(pred) - example["answer"])
        return Score(sums_graded_reward(distance), float(distance == 0), 1.0, pred=pred)

    name, kind, threshold = ("sums_graded", "ordinal", 0.5) if graded else ("sums", "binary", 1.0)
    score = graded_score if graded else score_last_number
    return Task(name, kind, train, test, score, pass_threshold=threshold, alphabet=DIGITS + ["+", "="],
                max_new_tokens=4 if style == "tiny" else 32)


def _chat_arith(style: str, shown: str, answer: int, **tags) -> dict:
    """One question in `sums`' chat form ("What is 17 - 5? Answer with the number only."), or the tiny
    model's terse one ("17-5="), with its answer and tags (level, family)."""
    tiny = shown.replace(" ", "")
    return {"prompt": f"{tiny}=" if style == "tiny" else f"What is {shown}? Answer with the number only.",
            "answer": answer, **tags}


def sums_levels_task(style: str, levels: int = 3, per_level: int = 1000, n_test: int = 100) -> Task:
    """a + b at difficulty levels 1..`levels`: at level L both operands have L digits (level 1: 0..9), in
    `sums`' chat form, each example tagged with its "level" (HA-DW's hard and easy prompts on SmolLM2, seed
    001). Held out per level: `n_test` pairs, at most a fifth of the level's (level 1: 20 of its 100); the
    train split holds `per_level` draws of each level's other pairs, neither order of a held-out pair among
    them (level 1 repeats the 66 left), shuffled, so
    every level is trained on equally; both splits shuffled. The questions and split are the same for every
    --seed (drawn from seed 0), so runs of different seeds are evaluated on the same held-out questions and
    eval.py compare pairs them. Scored like `sums` (score_last_number)."""
    rng = random.Random(0)
    train, test = [], []
    for level in range(1, levels + 1):
        low, high = (0 if level == 1 else 10 ** (level - 1)), 10 ** level - 1
        size = (high - low + 1) ** 2
        held = min(n_test, size // 5)
        if size <= 5 * (held + per_level):  # every pair, shuffled
            pairs = [(a, b) for a in range(low, high + 1) for b in range(low, high + 1)]
            rng.shuffle(pairs)
        else:  # distinct pairs drawn without listing the level's million
            codes = rng.sample(range(size), held + per_level)
            pairs = [(low + c // (high - low + 1), low + c % (high - low + 1)) for c in codes]
        level_test = pairs[:held]
        held_out = {frozenset(p) for p in level_test}  # b + a is a + b: neither order of a held pair trains
        level_train = [p for p in pairs[held:] if frozenset(p) not in held_out]
        test += [_chat_arith(style, f"{a} + {b}", a + b, level=level) for a, b in level_test]
        train += [_chat_arith(style, f"{a} + {b}", a + b, level=level)
                  for a, b in (level_train[i % len(level_train)] for i in range(per_level))]
    rng.shuffle(train)
    rng.shuffle(test)  # levels mixed: eval.py --limit N takes some of each
    return Task("sums_levels", "binary", train, test, score_last_number, pass_threshold=1.0,
                alphabet=DIGITS + ["+", "="], max_new_tokens=levels + 3 if style == "tiny" else 32)


# out-of-domain families of `sums` (CoRPO, seed 004): name -> (default largest operand, symbol, terms, the
# answer); the questions are every tuple of operands in range (subtraction: a >= b, so no negative answer)
ARITH_FAMILIES = {
    "subtraction": (49, "-", 2, lambda x: x[0] - x[1]),
    "products": (19, "*", 2, math.prod),
    "sums3": (9, "+", 3, sum),
}


def arith_family_task(name: str, style: str, max_operand: int | None = None, n_test: int = 200,
                      size: int = 5000) -> Task:
    """An out-of-domain family in `sums`' chat form and verifier (score_last_number): `subtraction` a - b
    (0 <= b <= a), `products` a * b (operands from 2), `sums3` a + b + c, operands up to `max_operand`. At
    most `size` distinct questions, the same for every --seed (drawn from seed 0: every run is evaluated on
    the same ones, which eval.py compare pairs); `n_test` of them (at most a fifth) held out. A policy trained
    on `sums` never saw them: they measure what training carries out of domain."""
    default, symbol, terms, value = ARITH_FAMILIES[name]
    top = default if max_operand is None else max_operand
    low = 2 if name == "products" else 0
    rng = random.Random(0)
    width = top - low + 1
    count = min(size, width ** terms)
    tuples, seen = [], set()
    while len(tuples) < count:  # distinct tuples in random order, without listing every one
        t = tuple(rng.randint(low, top) for _ in range(terms))
        if name == "subtraction":
            t = tuple(sorted(t, reverse=True))
        if t not in seen:
            seen.add(t)
            tuples.append(t)
        if name == "subtraction" and len(seen) == width * (width + 1) // 2:
            break
    examples = [_chat_arith(style, f" {symbol} ".join(map(str, t)), value(t), family=name) for t in tuples]
    train, test = _split(examples, min(n_test, len(examples) // 5))
    return Task(name, "binary", train, test, score_last_number, pass_threshold=1.0,
                alphabet=DIGITS + [symbol, "="],
                max_new_tokens=terms * len(str(top)) + 1 if style == "tiny" else 32)


def mixed_task(style: str, seed: int, hard_frac: float = 0.5, size: int = 1000) -> Task:
    """Single-digit sums with a controlled share of hard prompts (for HA-DW, arXiv 2601.08521): easy = one
    operand is 0 (the answer is a copy of the other digit), hard = both operands >= 1 (a real sum),
    a + b <= 9 either way. The train split draws `size` prompts with `hard_frac` of them hard; the
    test split is all 55 pairs once, each tagged with its difficulty."""
    base = addition_task(style, seed, n_test=0)
    pairs = [e for e in base.train if e["answer"] <= 9]
    easy = [dict(e, difficulty="easy") for e in pairs if "0+" in e["prompt"] or "+0" in e["prompt"]]
    hard = [dict(e, difficulty="hard") for e in pairs if not ("0+" in e["prompt"] or "+0" in e["prompt"])]
    rng = random.Random(seed)
    n_hard = round(hard_frac * size)
    train = [rng.choice(hard) for _ in range(n_hard)] + [rng.choice(easy) for _ in range(size - n_hard)]
    rng.shuffle(train)
    return Task("mixed", "binary", train, easy + hard, base.score, pass_threshold=1.0, alphabet=base.alphabet,
                max_new_tokens=base.max_new_tokens)


def modmul_task(style: str, seed: int, modulus: int = 7, n_test: int = 200) -> Task:
    """(a * b) mod M for two-digit a and b, neither a multiple of M (every answer 1..M-1 equally likely): the
    task that needs a tool (--tools python). The tiny style's prompt is a python block computing it,
    "```python\n37*48%7\n```\n"; the answer is what the policy itself writes after the output mark
    (OUTPUT_MARK), then EOS. With the python tool the mark runs the block and its output comes back as
    context, so the policy can copy it; without, the mark is text and the policy can only guess (1/(M-1)).
    The chat style asks in words, answer in \\boxed{}."""
    # neither a multiple of 7: every answer 1-6 is equally likely, so no guess beats 1/6
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100) if a % modulus and b % modulus]
    random.Random(seed).shuffle(pairs)
    examples = []
    for a, b in pairs:
        prompt = (f"```python\n{a}*{b}%{modulus}\n```\n" if style == "tiny" else
                  f"What is ({a} * {b}) mod {modulus}? You may run Python: write a ```python block, then "
                  f"```output, and its output follows. Give the final answer in \\boxed{{}}.")
        examples.append({"prompt": prompt, "answer": a * b % modulus})
    train, test = _split(examples, n_test)

    def score(completion: str, example: dict, finished: bool) -> Score:
        # tiny: the answer follows the output mark, in the policy's own text (with or without a tool)
        after = completion.rsplit(OUTPUT_MARK, 1)[1] if OUTPUT_MARK in completion else ""
        text = (after if style == "tiny" else last_boxed(completion)) or ""
        text = text.strip()
        if not finished or not text.isdigit():
            return Score(0.0, 0.0, 0.0)
        ok = float(int(text) == example["answer"])
        return Score(ok, ok, 1.0, pred=str(int(text)))

    return Task("modmul", "binary", train, test, score, pass_threshold=1.0,
                alphabet=DIGITS + ["*", "%", "\n", "`", "```python", "```output", "\n```\n"],
                max_new_tokens=12 if style == "tiny" else 512)


PERCENT_TOKENS = [f"{k}%" for k in range(1, 100)]
_ANSWER_RE = re.compile(r"<answer>\s*(\d{1,2})\s*%?\s*</answer>", re.S)
_TINY_PROB_RE = re.compile(r"^\s*(\d{1,2})%")


def calibration_reward(q: float | None, outcome: int, brier: bool) -> float:
    """Seed 000: log-likelihood of the observed outcome (or Brier, -(a - q)^2); invalid = worst."""
    if q is None:
        return -1.0 if brier else LOG_FLOOR
    if brier:
        return -(outcome - q) ** 2
    return math.log(q) if outcome == 1 else math.log(1.0 - q)


# --task calibration_plain: the question, the reply begun (base SmolLM2 sampled at T 1: format_fail 0.32)
PLAIN_CALIBRATION_PROMPT = ("What percentage of experiments in category C{c:02d} have a positive outcome?",
                            "The percentage of experiments in category C{c:02d} with a positive outcome is")
_FIRST_PERCENT = re.compile(r"(\d+(?:\.\d+)?)\s*%")


def calibration_task(style: str, seed: int, n_categories: int = 20, n_questions: int = 10_000,
                     n_test: int = 2_000, brier: bool = False, plain: bool = False) -> Task:
    """Seed 000's probability-prediction task: per-category p ~ U(0,1), one Bernoulli outcome per
    question drawn once; the prompt names only the category; the answer is a probability 1..99 %.

    Train and test questions share the categories and their p, with independent outcomes. `plain`
    (--task calibration_plain): the same questions, asked as a small chat model answers them (SmolLM2 never
    writes the paper's <answer></answer> tags): the assistant's reply begun with "The percentage ... is", the
    prediction the first percentage the reply writes, rounded, valid in 1..99 %.
    """
    rng = random.Random(seed)
    p_cat = [rng.random() for _ in range(n_categories)]
    examples = []
    for _ in range(n_questions + n_test):
        c = rng.randrange(n_categories)
        outcome = int(rng.random() < p_cat[c])
        if style == "tiny":
            prompt = f"{c:02d}:"
        elif plain:
            prompt = [{"role": "user", "content": PLAIN_CALIBRATION_PROMPT[0].format(c=c)},
                      {"role": "assistant", "content": PLAIN_CALIBRATION_PROMPT[1].format(c=c)}]
        else:
            prompt = (f"An experiment belongs to category C{c:02d}. How likely is it that its outcome is "
                      f"positive? Respond with a probability from 1-99, representing 1% to 99% chance. "
                      f"Enclose your answer in <answer> </answer> tags.")
        examples.append({"prompt": prompt, "answer": outcome, "category": c, "p_true": p_cat[c]})
    train, test = _split(examples, n_test)

    def score(completion: str, example: dict, finished: bool) -> Score:
        if plain and style != "tiny":  # the reply's first percentage, rounded: "about 34.1% ..." -> 34
            m = _FIRST_PERCENT.search(completion)
            k = round(float(m.group(1))) if m else 0
        else:
            m = (_TINY_PROB_RE if style == "tiny" else _ANSWER_RE).search(completion)
            k = int(m.group(1)) if m else 0
        q = k / 100 if 1 <= k <= 99 else None  # out-of-range counts as invalid (Bereket & Leskovec 2025, A.7)
        a = example["answer"]
        reward = calibration_reward(q, a, brier)
        if q is None:
            return Score(reward, 0.0, 0.0, None)
        return Score(reward, float((q > 0.5) == (a == 1)), 1.0, q, pred=str(k))

    # a prediction at 50% is the uninformed baseline: better than that counts as passed
    threshold = calibration_reward(0.5, 1, brier)
    return Task("calibration_plain" if plain else "calibration", "probability", train, test, score,
                pass_threshold=threshold, alphabet=DIGITS + [":"] + PERCENT_TOKENS,
                max_new_tokens=1 if style == "tiny" else 16 if plain else 64)


ORDINAL_LEVELS = {0: 1.0, 1: 0.5, 2: 0.0}  # |answer - target| -> reward; farther: -0.5; invalid: -1


def ordinal_reward(pred: int | None, target: int) -> float:
    if pred is None:
        return -1.0
    return ORDINAL_LEVELS.get(abs(pred - target), -0.5)


def ordinal_task(style: str, seed: int, n_test: int = 10) -> Task:
    """Partial-credit single-digit addition: a+b= with a + b <= 9, answered by one digit.

    Ordinal reward: exact 1.0, off by one 0.5, off by two 0.0, farther -0.5, invalid -1.
    Pass threshold 0.5 (Garg & Venkatesh's R_min_correct): an answer off by two is a failure, yet it
    beats a group of worse failures, which is where GRPO gives failures a positive advantage.
    """
    pairs = [(a, b) for a in range(10) for b in range(10) if a + b <= 9]
    random.Random(seed).shuffle(pairs)
    examples = []
    for a, b in pairs:
        prompt = f"{a}+{b}=" if style == "tiny" else \
            f"What is {a} + {b}? Answer with a single digit in \\boxed{{}}."
        examples.append({"prompt": prompt, "answer": a + b})
    train, test = _split(examples, n_test)
    train = train + test  # 55 pairs in all: train on every pair, report the held-out ones too

    def score(completion: str, example: dict, finished: bool) -> Score:
        text = (last_boxed(completion) if style != "tiny" else completion) or ""
        text = text.strip()
        pred = int(text) if finished and len(text) == 1 and text.isdigit() else None
        reward = ordinal_reward(pred, example["answer"])
        return Score(reward, float(pred == example["answer"]), float(pred is not None),
                     pred=None if pred is None else str(pred))

    return Task("ordinal", "ordinal", train, test, score, pass_threshold=0.5,
                alphabet=DIGITS + ["+", "="], max_new_tokens=2 if style == "tiny" else 256)


# ----------------------------------------------------------------------------------------------
# real datasets (through `datasets`; a local .jsonl/.json/.parquet path works offline)

MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
def parse_gsm8k_rows(rows, source: str, lines=None) -> list:
    """GSM8K rows {question, answer: '... #### 72'} -> examples with the final number."""
    out = []
    for i, row in enumerate(rows):
        require_fields(row, ("question", "answer"), source, where(lines, i))
        if "####" not in row["answer"]:
            raise DataError(f"{source}: {where(lines, i)}: answer has no '#### <number>' final line")
        final = row["answer"].split("####")[-1].strip().replace(",", "")
        if not final:
            raise DataError(f"{source}: {where(lines, i)}: empty final answer after '####'")
        out.append({"prompt": f"{row['question']}\n{MATH_INSTRUCTION}", "answer": final})
    return out


def parse_math_rows(rows, source: str, lines=None) -> list:
    """MATH rows {problem, solution with \\boxed{}} (or an explicit 'answer' field)."""
    out = []
    for i, row in enumerate(rows):
        require_fields(row, ("problem",), source, where(lines, i))
        answer = row.get("answer")
        if answer is None:
            require_fields(row, ("solution",), source, where(lines, i))
            answer = last_boxed(row["solution"])
            if answer is None:
                raise DataError(f"{source}: {where(lines, i)}: solution has no \\boxed{{}} answer")
        out.append({"prompt": f"{row['problem']}\n{MATH_INSTRUCTION}", "answer": str(answer)})
    return out

GSM8K_HUB = ("openai/gsm8k", "main", {"train": "train", "test": "test"})
MATH_HUB = ("DigitalLearningGmbH/MATH-lighteval", None, {"train": "train", "test": "test"})
JSONL_REWARDS = {"math": score_boxed_math, "exact": score_exact}


def load_task(spec: str, style: str = "tiny", seed: int = 0, brier: bool = False, jsonl_reward: str = "math",
              prompt_column: str = "prompt", answer_column: str = "answer", task_config: str = "",
              rg_size: int = 1000, rg_allow_slow: bool = False, rg_curriculum: float = 0.0) -> Task:
    """Task from its name. Real datasets take an optional local path: `gsm8k:data/{split}.jsonl`.

    `jsonl:PATH` reads PATH (train) and PATH with .test before the extension if present (else the
    last 10% of PATH) as the held-out split; `hf:DATASET` any Hugging Face dataset (a hub id, ID:CONFIG,
    or local .jsonl/.json/.csv/.parquet files), its train split and its test (or validation) split. Both
    take their prompt and answer from `prompt_column` and `answer_column` (a prompt may be a conversation)
    and are scored by `jsonl_reward` (math | exact). `rg:NAME[=WEIGHT][,...]` mixes reasoning-gym generators
    (rg_task: `rg_size` training examples, each generator configured by the `task_config` file).
    """
    name, _, local = spec.partition(":")
    if name == "rg":
        return rg_task(local, style, seed, rg_size, task_config, rg_allow_slow, rg_curriculum)
    if task_config:
        raise DataError(f"--task_config {task_config}: configures rg: tasks only (--task {spec})")
    if name == "addition":  # addition[:MAX_OPERAND]
        if local and not (local.isdigit() and int(local) >= 1):
            raise DataError(f"--task {spec!r}: addition takes the largest operand >= 1, e.g. addition:19")
        return addition_task(style, seed, int(local) if local else 9)
    if name in ("sums", "sums_graded"):  # sums[:MAX_OPERAND], sums_graded[:MAX_OPERAND]
        if local and not (local.isdigit() and int(local) >= 2):
            raise DataError(f"--task {spec!r}: {name} takes the largest operand >= 2, e.g. {name}:49")
        return sums_task(style, int(local) if local else 49, graded=name == "sums_graded")
    if name == "sums_levels":  # sums_levels[:LEVELS]
        if local and not (local.isdigit() and 2 <= int(local) <= 4):
            raise DataError(f"--task {spec!r}: sums_levels takes the number of levels, 2 to 4, e.g. "
                            f"sums_levels:3")
        return sums_levels_task(style, int(local) if local else 3)
    if name in ARITH_FAMILIES:  # subtraction[:N], products[:N], sums3[:N]
        low = 3 if name == "products" else 2
        if local and not (local.isdigit() and int(local) >= low):
            raise DataError(f"--task {spec!r}: {name} takes the largest operand >= {low}, e.g. "
                            f"{name}:{ARITH_FAMILIES[name][0]}")
        return arith_family_task(name, style, int(local) if local else None)
    if name in ("calibration", "calibration_plain"):
        return calibration_task(style, seed, brier=brier, plain=name == "calibration_plain")
    if name == "ordinal":
        return ordinal_task(style, seed)
    if name == "modmul":  # modmul[:MODULUS]
        modulus = int(local) if local.isdigit() else (7 if not local else 0)
        if modulus < 2:
            raise DataError(f"--task {spec!r}: modmul takes a modulus >= 2, e.g. modmul:7")
        return modmul_task(style, seed, modulus)
    if name == "mixed":  # mixed[:HARD_FRAC]
        try:
            frac = float(local) if local else 0.5
        except ValueError:
            frac = float("nan")
        if not 0 <= frac <= 1:
            raise DataError(f"--task {spec!r}: mixed takes the share of hard prompts in [0, 1], e.g. "
                            f"mixed:0.5")
        return mixed_task(style, seed, frac)
    if name in ("gsm8k", "math"):
        hub, parse = (GSM8K_HUB, parse_gsm8k_rows) if name == "gsm8k" else (MATH_HUB, parse_math_rows)
        # (rows, source, line numbers) of each split
        splits = [parse(*read_split(local or None, hub, s, name)) for s in ("train", "test")]
        return Task(name, "binary", splits[0], splits[1], score_boxed_math, pass_threshold=1.0,
                    alphabet=list(string.printable), max_new_tokens=512)
    if name in ("jsonl", "hf"):
        if not local:
            raise DataError(f"--task {name}:PATH needs a path, e.g. jsonl:data/train.jsonl or "
                            f"hf:data/train.parquet")
        if jsonl_reward not in JSONL_REWARDS:
            raise DataError(f"--jsonl_reward {jsonl_reward!r}: choose one of {sorted(JSONL_REWARDS)}")
        cols = dict(prompt_column=prompt_column, answer_column=answer_column)
        test = None
        if name == "jsonl":  # PATH, and PATH with .test before the extension as the held-out split if present
            rows = parse_rows(*read_split(local, None, "train"), **cols)
            root, ext = os.path.splitext(local)
            if os.path.exists(f"{root}.test{ext}"):
                test = parse_rows(*read_split(f"{root}.test{ext}", None, "test"), **cols)
        else:  # its train split, and its test (else validation) split as the held-out one if present
            splits, source = dataset_splits(local)
            if "train" not in splits:
                raise DataError(f"--task hf:{local}: no 'train' split (has: {', '.join(splits)})")
            rows = parse_rows(splits["train"], f"{source}[train]", **cols)
            held = next((s for s in ("test", "validation") if s in splits), None)
            test = parse_rows(splits[held], f"{source}[{held}]", **cols) if held else None
        if test is None:  # the last 10% of the rows
            n_test = max(1, len(rows) // 10)
            rows, test = rows[:-n_test] or rows, rows[-n_test:]
        return Task(name, "binary", rows, test, JSONL_REWARDS[jsonl_reward], pass_threshold=1.0,
                    alphabet=list(string.printable), max_new_tokens=512)
    raise DataError(f"--task {spec!r}: unknown task; choose addition[:N], sums[:N], sums_graded[:N], "
                    f"sums_levels[:L], subtraction[:N], products[:N], sums3[:N], calibration, ordinal, "
                    f"mixed[:HARD_FRAC], modmul, gsm8k, math, jsonl:PATH, hf:DATASET or rg:NAME[,NAME...]")
