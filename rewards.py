"""Tasks and verifiers.

A task is a train split and a held-out test split of examples (a dict with at least "prompt" and "answer")
plus a `score(completion, example, finished)` that returns correctness and format separately ("GRPO for
Reasoning-Model Post-Training", 2026: report them apart). Synthetic tasks are generated in-process from a
seed, so everything runs offline; gsm8k and math read the real datasets through `datasets`, or local files.

Prompt styles: "tiny" is the terse format the built-in random-initialised model can learn from scratch (a
character-level tokenizer covering the task's alphabet); "chat" is the natural-language instruction a
pretrained model gets (wrapped in its chat template by common.py).
"""
import asyncio
import difflib
import hashlib
import importlib
import importlib.util
import inspect
import json
import math
import os
import random
import re
import string
import sys
import traceback
from dataclasses import dataclass, field, replace
from typing import Callable

OUTPUT_MARK = "```output"  # modmul, the code tool format: the model asks for the last block's output (ToRA)

# Bereket & Leskovec 2025, App. A.7: unparseable prediction = worst in-range log-likelihood
LOG_FLOOR = math.log(0.01)


@dataclass
class Score:
    reward: float        # what the policy gradient sees
    correct: float       # 1/0 correctness (probability tasks: thresholded prediction == outcome)
    format_ok: float     # 1/0: answer parseable and the completion ended with EOS
    prob: float | None = None   # probability tasks: the predicted P(yes)
    pred: str | None = None     # the extracted answer (what majority voting counts)
    # --reward: each function's unweighted value, in the order of Task.reward_names
    parts: tuple = ()
    tools: dict | None = None   # --tools: the trajectory's tool_stats (eval.py summarises them)
    error: str | None = None    # the task's scorer raised (rg: tasks): what it raised; the reward is 0


@dataclass
class Task:
    name: str
    kind: str                  # "binary" | "probability" | "ordinal"
    train: list
    test: list
    score: Callable            # (completion_text, example, finished) -> Score
    pass_threshold: float      # reward >= this counts as passed (Garg & Venkatesh 2025: R_min_correct)
    alphabet: list = field(default_factory=list)  # tokens the tiny model's tokenizer must cover
    max_new_tokens: int = 512  # default generation budget for this task and style
    # --reward: the functions' names (logged as reward/<name>)
    reward_names: list = field(default_factory=list)
    # counters of the task's own since the last step (rg: task/scorer_errors): summed over ranks and logged
    stats: dict = field(default_factory=dict)
    # called by eval.py::evaluate with (task, the evaluation's metrics): more metrics (rg: --rg_curriculum)
    on_eval: Callable | None = None
    # with a batched or async --reward function, a reward model or a judge: (texts, examples, finished, envs)
    # -> [Score], the whole rank's batch at once (data.score_rollouts); None: `score` per completion
    score_batch: Callable | None = None
    sources: dict = field(default_factory=dict)  # "rm" / "judge": their batched callables (reward_model.py)


class DataError(ValueError):
    """Bad input data: the message names the file and the row."""


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


def sums_task(style: str, seed: int, max_operand: int = 49, n_test: int = 500) -> Task:
    """a + b with a, b in [0, max_operand], asked as a pretrained chat model answers it: the answer is the
    last number of the reply ("12 + 13 = 25."), which must end (EOS). The task for --model smollm2, which
    never writes \\boxed{} (addition's chat format) but writes its sums as equations: greedy, it starts at
    about 0.2 held-out pass@1 on 0..49 (docs/results.md). `n_test` pairs are held out (at most a fifth)."""
    pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    n_test = min(n_test, len(pairs) // 5)
    random.Random(seed).shuffle(pairs)
    examples = [{"prompt": f"{a}+{b}=" if style == "tiny" else
                 f"What is {a} + {b}? Answer with the number only.", "answer": a + b} for a, b in pairs]
    train, test = _split(examples, n_test)

    def score(completion: str, example: dict, finished: bool) -> Score:
        pred = last_number(completion)
        if not finished or pred is None:
            return Score(0.0, 0.0, 0.0)
        ok = float(float(pred) == example["answer"])
        return Score(ok, ok, 1.0, pred=pred)

    return Task("sums", "binary", train, test, score, pass_threshold=1.0, alphabet=DIGITS + ["+", "="],
                max_new_tokens=4 if style == "tiny" else 32)


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


def calibration_task(style: str, seed: int, n_categories: int = 20, n_questions: int = 10_000,
                     n_test: int = 2_000, brier: bool = False) -> Task:
    """Seed 000's probability-prediction task: per-category p ~ U(0,1), one Bernoulli outcome per
    question drawn once; the prompt names only the category; the answer is a probability 1..99 %.

    Train and test questions share the categories and their p, with independent outcomes.
    """
    rng = random.Random(seed)
    p_cat = [rng.random() for _ in range(n_categories)]
    examples = []
    for _ in range(n_questions + n_test):
        c = rng.randrange(n_categories)
        outcome = int(rng.random() < p_cat[c])
        if style == "tiny":
            prompt = f"{c:02d}:"
        else:
            prompt = (f"An experiment belongs to category C{c:02d}. How likely is it that its outcome is "
                      f"positive? Respond with a probability from 1-99, representing 1% to 99% chance. "
                      f"Enclose your answer in <answer> </answer> tags.")
        examples.append({"prompt": prompt, "answer": outcome, "category": c, "p_true": p_cat[c]})
    train, test = _split(examples, n_test)

    def score(completion: str, example: dict, finished: bool) -> Score:
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
    return Task("calibration", "probability", train, test, score, pass_threshold=threshold,
                alphabet=DIGITS + [":"] + PERCENT_TOKENS, max_new_tokens=1 if style == "tiny" else 64)


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


def where(lines, i: int) -> str:
    """Where row i came from: its 1-based line in the file (`lines` from read_jsonl_numbered), else its
    1-based position (hub datasets)."""
    return f"line {lines[i]}" if lines else f"row {i + 1}"


def _require(row: dict, keys: tuple, source: str, at: str) -> None:
    if not isinstance(row, dict):
        raise DataError(f"{source}: {at}: expected an object, got {type(row).__name__}")
    for k in keys:
        if k not in row:
            raise DataError(f"{source}: {at}: missing field '{k}' (has: {sorted(row)})")
        if not isinstance(row[k], (str, int, float)) or str(row[k]).strip() == "":
            raise DataError(f"{source}: {at}: field '{k}' is empty or not text")


def parse_gsm8k_rows(rows, source: str, lines=None) -> list:
    """GSM8K rows {question, answer: '... #### 72'} -> examples with the final number."""
    out = []
    for i, row in enumerate(rows):
        _require(row, ("question", "answer"), source, where(lines, i))
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
        _require(row, ("problem",), source, where(lines, i))
        answer = row.get("answer")
        if answer is None:
            _require(row, ("solution",), source, where(lines, i))
            answer = last_boxed(row["solution"])
            if answer is None:
                raise DataError(f"{source}: {where(lines, i)}: solution has no \\boxed{{}} answer")
        out.append({"prompt": f"{row['problem']}\n{MATH_INSTRUCTION}", "answer": str(answer)})
    return out


ROLES = ("system", "user", "assistant", "tool")


def _conversation(messages: list, source: str, at: str, column: str) -> list:
    """A conversational prompt: a list of {"role", "content"} messages, the last one the user's."""
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise DataError(f"{source}: {at}: column '{column}', message {j + 1}: expected "
                            f"{{\"role\": one of {', '.join(ROLES)}, \"content\": text}}, got {str(m)[:80]}")
    if not messages or messages[-1]["role"] != "user":
        raise DataError(f"{source}: {at}: column '{column}': a conversation must end with a user message")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def parse_rows(rows, source: str, lines=None, prompt_column: str = "prompt",
               answer_column: str = "answer") -> list:
    """A user's own rows (jsonl:PATH, hf:DATASET): a prompt (text, or a conversation: a list of {role,
    content} messages for the chat template) and an answer, under the given column names; every other field is
    kept (the --reward functions get them)."""
    out = []
    for i, row in enumerate(rows):
        at = where(lines, i)
        if not isinstance(row, dict):
            raise DataError(f"{source}: {at}: expected an object, got {type(row).__name__}")
        for col, flag in ((prompt_column, "--prompt_column"), (answer_column, "--answer_column")):
            if col not in row:
                raise DataError(f"{source}: {at}: missing column '{col}' (has: {', '.join(sorted(row))}); "
                                f"name yours with {flag}")
        prompt, answer = row[prompt_column], row[answer_column]
        if isinstance(prompt, list):
            prompt = _conversation(prompt, source, at, prompt_column)
        elif not isinstance(prompt, (str, int, float)) or isinstance(prompt, bool) or not str(prompt).strip():
            raise DataError(f"{source}: {at}: column '{prompt_column}' is empty or not text/messages")
        else:
            prompt = str(prompt)
        if not isinstance(answer, (str, int, float)) or isinstance(answer, bool) or not str(answer).strip():
            raise DataError(f"{source}: {at}: column '{answer_column}' is empty or not text")
        out.append({**row, "prompt": prompt, "answer": answer})
    return out


def prompt_text(prompt) -> str:
    """The text of a prompt: itself, or a conversation's message contents joined."""
    return prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)


def with_system_prompt(task: Task, text: str) -> Task:
    """Every prompt as a conversation opening with the --system_prompt (replacing the conversation's own)."""
    if not text:
        return task
    if text.startswith("rg:"):  # reasoning-gym's own system prompts, by name (reasoning_gym.utils)
        from reasoning_gym.utils import SYSTEM_PROMPTS
        if text[3:] not in SYSTEM_PROMPTS:
            raise SystemExit(f"--system_prompt {text}: reasoning-gym's prompts are rg:"
                             f"{', rg:'.join(SYSTEM_PROMPTS)}")
        text = SYSTEM_PROMPTS[text[3:]]
    system = {"role": "system", "content": text}

    def convert(e):
        p = e["prompt"]
        if isinstance(p, str):
            messages = [{"role": "user", "content": p}]
        else:
            messages = [m for m in p if m["role"] != "system"]
        return {**e, "prompt": [system] + messages}
    task.train, task.test = [convert(e) for e in task.train], [convert(e) for e in task.test]
    return task


def _dataset_rows(spec: str) -> tuple[dict, str]:
    """{split: rows} of a Hugging Face dataset: a hub id (ID or ID:CONFIG) or local files (.jsonl/.json, .csv,
    .parquet, or a folder of them), through `datasets`."""
    from datasets import DatasetDict, load_dataset
    path, _, config = spec.partition(":")
    builders = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
    ext = os.path.splitext(path)[1]
    try:
        if os.path.isfile(path):
            if ext not in builders:
                raise DataError(f"--task hf:{spec}: {path}: expected a .jsonl, .json, .csv or .parquet file")
            data = load_dataset(builders[ext], data_files=path)
        else:
            data = load_dataset(path, config or None)
    except DataError:
        raise
    except Exception as e:  # no such dataset, offline, a malformed file
        offline = os.environ.get("HF_HUB_OFFLINE")
        hint = " (HF_HUB_OFFLINE is set: the hub cannot be reached)" if offline else ""
        raise DataError(f"--task hf:{spec}: could not load the dataset{hint}: {type(e).__name__}: "
                        f"{str(e).splitlines()[0][:200] if str(e) else ''}") from None
    data = data if isinstance(data, DatasetDict) else DatasetDict(train=data)
    return {name: list(split) for name, split in data.items()}, path


def read_jsonl_numbered(path: str, allow_empty: bool = False,
                        drop_torn_last: bool = False) -> tuple[list, list]:
    """(objects, their 1-based line numbers) of the non-blank lines of a UTF-8 JSONL file; DataError naming
    the file and the line on any problem. drop_torn_last: a last line cut short by a crash mid-write (a log
    this project appends to) is dropped with a note instead."""
    if os.path.isdir(path):
        raise DataError(f"{path}: is a folder, not a JSONL file")
    if not os.path.exists(path):
        raise DataError(f"{path}: file not found")
    with open(path, "rb") as f:
        raws = f.read().splitlines()
    rows, lines = [], []
    for i, raw in enumerate(raws, 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: line {i}: not UTF-8 text (byte {e.start} of the line, "
                            f"{raw[e.start:e.start + 1]!r})") from None
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            if drop_torn_last and i == len(raws):
                print(f"{path}: dropped a torn last line (line {i}, a crash during a write)", file=sys.stderr)
                continue
            raise DataError(f"{path}: line {i}: not valid JSON ({e.msg})") from None
        lines.append(i)
    if not rows and not allow_empty:
        raise DataError(f"{path}: no rows")
    return rows, lines


def _hub_rows(path: str, name: str | None, split: str, task: str) -> list:
    """The rows of a hub dataset's split; a one-line DataError when it cannot be had (offline, a wrong id)."""
    from datasets import load_dataset
    try:
        return list(load_dataset(path, name, split=split))
    except Exception as e:
        offline = " (HF_HUB_OFFLINE is set)" if os.environ.get("HF_HUB_OFFLINE") else ""
        why = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
        local = f"--task {task}:PATH/{{split}}.jsonl"
        raise DataError(f"--task {task}: the dataset {path} could not be loaded{offline}: "
                        f"{type(e).__name__}: {why}; to read local files instead: {local}") from None


def _rows(local: str | None, hub: tuple, split: str, task: str = "") -> tuple[list, str, list | None]:
    """(rows, source, line numbers or None) from a local file (offline) or from the hub (the real thing users
    run)."""
    if local:
        path = local.replace("{split}", split)
        rows, lines = read_jsonl_numbered(path)
        return rows, path, lines
    path, name, hub_split = hub
    return _hub_rows(path, name, hub_split[split], task), f"{path}[{hub_split[split]}]", None


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
    if name == "sums":  # sums[:MAX_OPERAND]
        if local and not (local.isdigit() and int(local) >= 2):
            raise DataError(f"--task {spec!r}: sums takes the largest operand >= 2, e.g. sums:49")
        return sums_task(style, seed, int(local) if local else 49)
    if name == "calibration":
        return calibration_task(style, seed, brier=brier)
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
        splits = [parse(*_rows(local or None, hub, s, name)) for s in ("train", "test")]
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
            rows = parse_rows(*_rows(local, None, "train"), **cols)
            root, ext = os.path.splitext(local)
            if os.path.exists(f"{root}.test{ext}"):
                test = parse_rows(*_rows(f"{root}.test{ext}", None, "test"), **cols)
        else:  # its train split, and its test (else validation) split as the held-out one if present
            splits, source = _dataset_rows(local)
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
    raise DataError(f"--task {spec!r}: unknown task; choose addition[:N], sums[:N], calibration, ordinal, "
                    f"mixed[:HARD_FRAC], modmul, gsm8k, math, jsonl:PATH, hf:DATASET or rg:NAME[,NAME...]")


# ----------------------------------------------------------------------------------------------
# reasoning-gym (--task rg:NAME[=WEIGHT][,...]): procedural generators with their own verifiers, offline

# generators over 2 s per 1,000 items here: CPU seconds, "> N" where stopped (benchmarks/rg_generators.py)
RG_SLOW = {
    "advanced_geometry": "4", "codeio": "2.7", "countdown": "> 10", "futoshiki": "> 10",
    "game_of_life": "5.3", "game_of_life_halting": "2.7", "intermediate_integration": "> 10", "jugs": "3.7",
    "knight_swap": "> 4", "number_sequence": "> 4", "polynomial_equations": "> 4",
    "polynomial_multiplication": "> 4", "puzzle24": "> 4", "quantum_lock": "> 4", "rearc": "> 4",
    "rubiks_cube": "> 4", "simple_integration": "3.7", "sokoban": "> 4", "sudoku": "> 4",
    "word_ladder": "3.5", "zebra_puzzles": "> 4"}
RG_INSTRUCTION = "Give only the final answer between <answer> and </answer> tags."
RG_TAGS = ("<answer>", "</answer>")


def rg_registry() -> dict:
    """{name: (dataset class, config class)} of reasoning-gym's generators (its `composite` is our mix)."""
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError:
        raise SystemExit("--task rg:...: reasoning-gym is not installed (pip install -r "
                         "requirements-common.txt)") from None
    return {k: v for k, v in DATASETS.items() if k != "composite"}


def rg_mix(spec: str, allow_slow: bool = False) -> dict:
    """{generator: weight} of `chain_sum=2,leg_counting=1` (weight 1 if none); one line on a bad name."""
    registry, mix = rg_registry(), {}
    for item in [x.strip() for x in spec.split(",") if x.strip()] or [""]:
        name, eq, weight = item.partition("=")
        name = name.strip()
        if name not in registry:
            close = difflib.get_close_matches(name, list(registry), n=5, cutoff=0.5)
            hint = f"close names: {', '.join(close)}" if close else "the names are listed in docs/tasks.md"
            raise SystemExit(f"--task rg:{spec}: no reasoning-gym generator {name!r}; {hint}")
        try:
            w = float(weight) if eq else 1.0
        except ValueError:
            w = float("nan")
        if not (math.isfinite(w) and w > 0) or name in mix:
            raise SystemExit(f"--task rg:{spec}: {item!r}: each generator once, with a weight > 0 "
                             f"(rg:chain_sum=2,leg_counting=1)")
        if name in RG_SLOW and not allow_slow:
            raise SystemExit(f"--task rg:{spec}: {name} took {RG_SLOW[name]} CPU s per 1,000 items here "
                             f"(supported: under 2 s); --rg_allow_slow true uses it anyway")
        mix[name] = w
    return mix


def rg_configs(path: str, mix: dict) -> dict:
    """{generator: config} from --task_config (YAML or JSON, {name: {key: value}}), each key checked against
    the generator's config class; seed and size are the run's (--seed, --rg_size)."""
    if not path:
        return {name: {} for name in mix}
    if not os.path.isfile(path):
        raise SystemExit(f"--task_config {path}: file not found")
    import yaml  # YAML is a superset of JSON: one reader for both
    try:
        with open(path) as f:
            cfg = yaml.safe_load(f) or {}
    except yaml.YAMLError as e:
        raise SystemExit(f"--task_config {path}: not valid YAML/JSON: {' '.join(str(e).split())}") from None
    if not isinstance(cfg, dict) or not all(isinstance(v, dict) for v in cfg.values()):
        raise SystemExit(f"--task_config {path}: expected {{generator: {{key: value}}}}, e.g. chain_sum: "
                         f"{{max_terms: 2}}")
    extra = sorted(set(cfg) - set(mix))
    if extra:
        raise SystemExit(f"--task_config {path}: {extra[0]} is not in --task rg:{','.join(mix)}")
    registry = rg_registry()
    for name, keys in cfg.items():
        fields = [f for f in registry[name][1].__dataclass_fields__ if f not in ("seed", "size")]
        for key in keys:
            if key not in fields:
                why = ("set by --seed and --rg_size" if key in ("seed", "size") else
                       f"it has: {', '.join(fields)}")
                raise SystemExit(f"--task_config {path}: {name}: no config key {key!r} ({why})")
    return {name: dict(cfg.get(name, {})) for name in mix}


def rg_seed(seed: int, name: str) -> int:
    """A generator's base seed from --seed: its items draw from seed + index (reasoning-gym's convention)."""
    digest = hashlib.sha256(f"rg/{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x3FFF_FFFF  # room above it for both splits' indices


def rg_dataset(name: str, config: dict, seed: int, size: int, path: str = ""):
    """reasoning_gym.create_dataset with an explicit seed (None would draw a new one per instance)."""
    import reasoning_gym
    try:
        return reasoning_gym.create_dataset(name, seed=seed, size=max(size, 1), **config)
    except (AssertionError, ValueError, TypeError) as e:  # the config's own validate()
        where = f"--task_config {path}: " if path else "--task rg:"
        raise SystemExit(f"{where}{name}: bad config {config}: {type(e).__name__}: {e}") from None


def rg_extract(completion: str, style: str, finished: bool) -> str | None:
    """The answer by the documented rule (docs/tasks.md): chat, the last <answer>...</answer> (reasoning_gym.
    utils.extract_answer, stripped); tiny, whose prompt ends with <answer>, the completion up to its first
    </answer>, or all of it when it ended with EOS, stripped. None: no answer (a format failure); "" is an
    answer (some gold answers are empty)."""
    if style != "tiny":
        from reasoning_gym.utils import extract_answer
        return extract_answer(completion)
    if RG_TAGS[1] not in completion and not finished:
        return None
    return completion.split(RG_TAGS[1], 1)[0].strip()


def rg_level_config(name: str, curriculum, level: int) -> dict:
    """The config of a generator's reasoning-gym curriculum at a global level (seed and size left out)."""
    curriculum.set_global_level(level)
    config = curriculum.generate_configuration({})
    return {k: v for k, v in vars(config).items() if k not in ("seed", "size")}


def rg_task(spec: str, style: str, seed: int, size: int = 1000, task_config: str = "",
            allow_slow: bool = False, curriculum: float = 0.0) -> Task:
    """Examples of each generator of the mix (`spec` as rg_mix), drawn by weight, `size` for training and a
    tenth (at least 1) held out: the held-out items draw from seeds just past the training ones (disjoint
    ranges), and training items whose question is also held out are dropped (disjoint by content). Each
    example keeps reasoning-gym's entry (question, answer, metadata) and its generator's name ("rg"). The
    reward is the generator's score_answer on the extracted answer (partial credit kept); correct means 1.0;
    a scorer that raises scores 0 and is counted (task/scorer_errors). curriculum > 0: each generator's
    reasoning-gym curriculum, from level 0; Task.on_eval raises the level (all generators, new examples)
    after an evaluation whose pass@1 reaches it."""
    mix = rg_mix(spec, allow_slow)
    user, names, weights = rg_configs(task_config, mix), list(mix), list(mix.values())
    curricula = {}
    if curriculum:
        from reasoning_gym.factory import create_curriculum, has_curriculum
        missing = [n for n in names if not has_curriculum(n)]
        if missing:
            raise SystemExit(f"--rg_curriculum: {', '.join(missing)} has no reasoning-gym curriculum")
        curricula = {n: create_curriculum(n) for n in names}
    datasets = {}  # the current level's, which the scorer asks

    def build(level: int, size: int, note: bool = True) -> tuple:
        n_test = max(1, size // 10)
        rng = random.Random(f"rg/{seed}/mix")  # which generator each example comes from
        draws = {"train": rng.choices(names, weights, k=size), "test": rng.choices(names, weights, k=n_test)}
        items = {"train": {}, "test": {}}
        for name in names:  # --task_config's keys override the curriculum level's
            config = {**(rg_level_config(name, curricula[name], level) if curricula else {}), **user[name]}
            n_train, base = draws["train"].count(name), rg_seed(seed, name)
            datasets[name] = rg_dataset(name, config, base, n_train, task_config)
            held = rg_dataset(name, config, base + n_train, draws["test"].count(name), task_config)
            items["train"][name] = iter([datasets[name][i] for i in range(n_train)])
            items["test"][name] = iter([held[i] for i in range(draws["test"].count(name))])
        train, test = ([example(next(items[s][n]), n) for n in draws[s]] for s in ("train", "test"))
        held_out = {e["question"] for e in test}
        kept = [e for e in train if e["question"] not in held_out]
        if not kept:
            raise SystemExit(f"--task rg:{spec}: every training question is also held out (the config allows "
                             f"few distinct questions); widen it in --task_config")
        if len(kept) < len(train) and note:
            print(f"--task rg:{spec}: dropped {len(train) - len(kept)} of {len(train)} training examples "
                  f"whose question is held out", file=sys.stderr)
        return kept, test

    def example(entry: dict, name: str) -> dict:
        q = entry["question"]
        prompt = f"{q}\n{RG_TAGS[0]}" if style == "tiny" else f"{q}\n\n{RG_INSTRUCTION}"
        return {"prompt": prompt, "answer": entry["answer"], "question": q, "metadata": entry["metadata"],
                "rg": name}

    stats, state = {"task/scorer_errors": 0}, {"level": 0}

    def score(completion: str, ex: dict, finished: bool) -> Score:
        pred = rg_extract(completion, style, finished)
        if pred is None:
            return Score(0.0, 0.0, 0.0)
        try:
            value = float(datasets[ex["rg"]].score_answer(pred, ex))
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"score {value} outside [0, 1]")
        except Exception as e:  # a scorer that raises on odd input: the worst score, counted, never a stop
            stats["task/scorer_errors"] += 1
            return Score(0.0, 0.0, 1.0, pred=pred, error=f"{ex['rg']}: {type(e).__name__}: {e}"[:200])
        return Score(value, float(value >= 1.0), 1.0, pred=pred)

    def on_eval(task: Task, metrics: dict) -> dict:
        """--rg_curriculum: one level up when the held-out pass@1 reaches the threshold; the new examples
        take the current ones' system message, if any (--system_prompt)."""
        if metrics["eval/pass@1"] >= curriculum and state["level"] < top:
            state["level"] += 1
            first = task.train[0]["prompt"]
            opening = first[:-1] if isinstance(first, list) else None
            task.train, task.test = ([{**e, "prompt": opening + [{"role": "user", "content": e["prompt"]}]}
                                      if opening else e for e in split]
                                     for split in build(state["level"], size))
        return {"task/rg_level": state["level"]}

    # with a curriculum the tokenizer and the generation budget are sized for its top level too
    top = max((len(a.levels) - 1 for c in curricula.values() for a in c.attributes.values()), default=0)
    sizing = sum(build(top, 50, note=False), []) if curricula else []  # a sample of the top level
    train, test = build(0, size)
    texts = [e["prompt"] + str(e["answer"] or "") for e in train + test + sizing]
    answers = [len(str(e["answer"])) for e in train + test + sizing if e["answer"] is not None] or [30]
    return Task("rg", "binary", train, test, score, pass_threshold=1.0,
                alphabet=sorted(set("".join(texts))) + list(RG_TAGS),
                max_new_tokens=max(answers) + 2 if style == "tiny" else 512, stats=stats,
                on_eval=on_eval if curricula else None)


# ----------------------------------------------------------------------------------------------
# the user's own reward functions: --reward module:function[,...] --reward_weights w[,...]

RESERVED_REWARD_NAMES = ("mean", "std", "correct", "format")  # reward/<these> are logged already


def import_function(item: str, flag: str = "--reward"):
    """The function named by `module:function` (an importable module, or a path to a .py file)."""
    module_name, sep, fn_name = item.rpartition(":")
    if not sep or not module_name or not fn_name:
        extra = " or 'task' (the task's own verifier)" if flag == "--reward" else ""
        raise DataError(f"{flag} {item!r}: expected module:function (e.g. my_module:my_function, "
                        f"path/to/file.py:my_function){extra}")
    try:
        if module_name.endswith(".py"):
            if not os.path.isfile(module_name):
                raise DataError(f"{flag} {item}: no such file {module_name}")
            spec = importlib.util.spec_from_file_location(os.path.basename(module_name)[:-3], module_name)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            # `python train_grpo.py` puts the script's folder first, not the cwd
            if os.getcwd() not in sys.path:
                sys.path.append(os.getcwd())
            module = importlib.import_module(module_name)
    except DataError:
        raise
    except Exception as e:  # a missing module, or an error inside it
        raise DataError(f"{flag} {item}: cannot import {module_name} ({type(e).__name__}: {e})") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise DataError(f"{flag} {item}: {module_name} has no function {fn_name!r} (it has: "
                        f"{', '.join(found)})")
    return fn


ENV_REWARD = "env"  # --reward's name for the --env class's get_reward (rlmini/envs.py)
SOURCES = {"rm": "--reward_model", "judge": "--judge_url"}  # reserved names bound by their own flags


def reward_functions(spec: str, weights: str, env_reward: bool = False, sources: dict | None = None) -> list:
    """[(name, function, None for the task's verifier or ENV_REWARD for --env's get_reward, weight)] from
    --reward and --reward_weights; with `env_reward` (an --env class with get_reward), `env` is added with
    weight 1 (beside 'task' when --reward is empty) unless --reward lists it, as TRL adds the environment's
    reward to its reward functions (trl/trainer/grpo_trainer.py::GRPOTrainer.__init__). `sources`: "rm" and
    "judge" bound to their batched callables (None: not given); with an empty --reward, those given replace
    the task's verifier as the reward (RLHF's setting), weight 1 each."""
    sources = {k: v for k, v in (sources or {}).items() if v is not None}
    items = [x.strip() for x in spec.split(",") if x.strip()]
    try:
        ws = [float(w) for w in weights.split(",")] if weights.strip() else [1.0] * len(items)
    except ValueError:
        raise DataError(f"--reward_weights {weights!r}: expected comma-separated numbers, e.g. "
                        "1,0.1") from None
    if len(ws) != len(items):
        raise DataError(f"--reward_weights {weights!r}: {len(ws)} weight(s) for {len(items)} reward "
                        f"function(s)")
    if not all(math.isfinite(w) for w in ws):
        raise DataError(f"--reward_weights {weights!r}: every weight must be a finite number")
    if ENV_REWARD in items and not env_reward:
        raise DataError(f"--reward {spec!r}: '{ENV_REWARD}' is the reward of an --env class with a "
                        f"get_reward method; there is none")
    for name, flag in SOURCES.items():
        if name in items and name not in sources:
            raise DataError(f"--reward {spec!r}: '{name}' is the score of {flag}; there is none (give "
                            f"{flag})")
    if not items and sources:
        items, ws = [n for n in SOURCES if n in sources], [1.0] * len(sources)
    if env_reward and ENV_REWARD not in items:
        items, ws = (items or ["task"]) + [ENV_REWARD], (ws or [1.0]) + [1.0]
    out, bound = [], ("task", ENV_REWARD, *SOURCES)
    for item, w in zip(items, ws):
        name = item if item in bound else item.rpartition(":")[2]
        if (name in RESERVED_REWARD_NAMES or name in [n for n, _, _ in out]
                or (name in bound and name != item)):
            raise DataError(f"--reward {spec!r}: the name {name!r} is taken (logged as reward/{name}); "
                            f"rename the function (reserved: {', '.join(RESERVED_REWARD_NAMES)}, env, rm, "
                            f"judge, and each name once)")
        fn = (None if item == "task" else ENV_REWARD if item == ENV_REWARD else sources[item]
              if item in SOURCES else import_function(item))
        out.append((name, fn, w))
    return out


def batched(fn) -> bool:
    """A batched reward function takes lists (f(prompts=, completions=, examples=, finished=), TRL's
    convention): told apart from the per-completion form by its parameters' plural names."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: the per-completion form
        return False
    return "completions" in params


_LOOP = None  # one event loop for every async reward function (a client made in it stays usable)


def run_async(coroutines: list, concurrency: int, timeout: float, what: str) -> list:
    """The coroutines' results, at most `concurrency` in flight, all within `timeout` seconds (else a
    DataError naming `what`); an exception is returned in place of its result."""
    global _LOOP
    _LOOP = _LOOP or asyncio.new_event_loop()
    gate = asyncio.Semaphore(concurrency) if coroutines else None

    async def bounded(c):
        async with gate:
            return await c

    async def every():
        return await asyncio.gather(*[bounded(c) for c in coroutines], return_exceptions=True)

    try:
        return _LOOP.run_until_complete(asyncio.wait_for(every(), timeout))
    except asyncio.TimeoutError:
        raise DataError(f"{what}: no answer within --reward_timeout {timeout:g} s") from None


def _batch_values(out, n: int, at: str) -> list:
    """A batched reward function's output as n values, or DataError in one line: the contract is one
    dimension of numbers as long as the batch (a list, a tuple, a 1-D numpy array or tensor); a mapping (its
    keys), a set (no order), a string (its characters) or more dimensions would otherwise train on garbage."""
    ndim = getattr(out, "ndim", None)
    sequence = isinstance(out, (list, tuple)) or ndim == 1
    if isinstance(out, (str, bytes, dict, set, frozenset)) or not sequence:
        what = f"{ndim}-D {type(out).__name__}" if ndim not in (None, 1) else type(out).__name__
        raise DataError(f"{at} returned a {what}: a batched reward function returns a list (or tuple, 1-D "
                        f"array) of {n} numbers, one per completion")
    if len(out) != n:
        raise DataError(f"{at} returned {len(out)} values: a batched reward function returns one value per "
                        f"completion ({n})")
    return [v.item() if hasattr(v, "item") and getattr(v, "ndim", 0) == 0 else v for v in out]


def _call_batch(name: str, fn, texts: list, examples: list, finished: list, concurrency: int,
                timeout: float) -> list:
    """One reward function's raw values over a batch (an exception in place of a value that raised), in
    whichever form it takes: per completion or batched, sync or async."""
    at = f"--reward {name} on a batch of {len(texts)} (first prompt {str(examples[0]['prompt'])[:60]!r})"
    if batched(fn):
        kw = dict(prompts=[e["prompt"] for e in examples], completions=texts, examples=examples,
                  finished=finished)
        try:
            out = (run_async([fn(**kw)], 1, timeout, at)[0] if inspect.iscoroutinefunction(fn)
                   else fn(**kw))
        except DataError:
            raise
        except Exception as e:
            out = e
        if isinstance(out, Exception):
            return [out] * len(texts)
        return _batch_values(out, len(texts), at)
    calls = [dict(prompt=e["prompt"], completion=t, example=e, finished=f)
             for t, e, f in zip(texts, examples, finished)]
    if inspect.iscoroutinefunction(fn):
        return run_async([fn(**kw) for kw in calls], concurrency, timeout, at)
    out = []
    for kw in calls:
        try:
            out.append(fn(**kw))
        except Exception as e:
            out.append(e)
    return out


def with_reward_functions(task: Task, spec: str, weights: str, on_nonfinite: str = "stop",
                          env: str = "", sources: dict | None = None, concurrency: int = 32,
                          timeout: float = 300.0) -> Task:
    """The task, rewarded by sum_i w_i r_i over the --reward functions ('task' = the task's own verifier).
    A function is called per completion as f(prompt=, completion=, example=, finished=), or, batched, once
    per rank's batch as f(prompts=, completions=, examples=, finished=) -> list (batched()); either may be
    `async def`, run concurrently (at most `concurrency` calls in flight, all within `timeout` seconds). A
    value is a float or a Score (the first Score's correct/format_ok replace the verifier's: reward/correct
    and pass@k read them). A function that raises or returns NaN/inf stops the run naming it, the prompt and
    the value; with --on_nonfinite skip the reward becomes NaN and the step's update is skipped
    (common.check_rewards). `env`: --env module:Class; one with get_reward adds its value, passed to the
    score as `env=` (data.py::score_rollouts; None for a discarded instance: 0). `sources`: {"rm": ...,
    "judge": ...}, batched callables (None: absent), listed in --reward as rm and judge (reward_functions);
    a callable's optional step_metrics() is logged (reward_model.source_metrics)."""
    env_reward = bool(env) and callable(getattr(import_function(env, flag="--env"), "get_reward", None))
    sources = {k: v for k, v in (sources or {}).items() if v is not None}
    if not spec.strip() and not env_reward and not sources:
        return task
    fns, verifier = reward_functions(spec, weights, env_reward, sources), task.score

    def value(name: str, out, completion: str, example: dict) -> tuple:
        """(float, Score or None) of one raw value; a raised exception or NaN/inf is stopped or NaN."""
        at = f"prompt {str(example['prompt'])[:60]!r}, completion {completion[:60]!r}"
        if isinstance(out, Exception):
            tb = traceback.extract_tb(out.__traceback__)
            where_ = f" ({os.path.basename(tb[-1].filename)}:{tb[-1].lineno})" if tb else ""
            msg = f"--reward {name} raised {type(out).__name__}: {out}{where_} on {at}"
            if on_nonfinite == "stop":
                raise DataError(f"{msg} (--on_nonfinite skip would skip such updates)") from None
            print(f"warning: {msg}; the reward is NaN and this update is skipped", file=sys.stderr)
            out = float("nan")
        outcome = out if isinstance(out, Score) else None
        out = out.reward if outcome is not None else out
        if isinstance(out, (str, bytes)) or not hasattr(out, "__float__"):
            raise DataError(f"--reward {name} returned {type(out).__name__} {out!r} on {at}: expected a "
                            f"float or a rewards.Score")
        v = float(out)
        if not math.isfinite(v) and on_nonfinite == "stop":
            raise DataError(f"--reward {name} returned {v} on {at} (--on_nonfinite skip would skip "
                            f"such updates)")
        return v, outcome

    def combine(completion, example, finished, env, raw: dict) -> Score:
        """One completion's Score: its parts, unweighted, and their weighted sum, in --reward's order."""
        base, parts, outcome = verifier(completion, example, finished), [], None
        for name, fn, w in fns:
            if fn is None or fn is ENV_REWARD:
                parts.append(base.reward if fn is None else 0.0 if env is None else env)
                continue
            out = raw[name] if name in raw else _call_batch(name, fn, [completion], [example], [finished],
                                                            concurrency, timeout)[0]
            v, got = value(name, out, completion, example)
            outcome = outcome or got
            parts.append(v)
        outcome = outcome or base
        return Score(sum(w * v for (_, _, w), v in zip(fns, parts)), outcome.correct, outcome.format_ok,
                     base.prob, outcome.pred, tuple(parts), error=base.error)

    def score(completion: str, example: dict, finished: bool, env: float | None = None) -> Score:
        return combine(completion, example, finished, env, {})

    # batched, async, rm and judge: evaluated once over the rank's batch; the rest per completion, as above
    at_once = [(name, fn) for name, fn, _ in fns if fn is not None and fn is not ENV_REWARD
               and (name in sources or batched(fn) or inspect.iscoroutinefunction(fn))]

    def score_batch(texts: list, examples: list, finished: list, envs: list) -> list:
        raw = {name: _call_batch(name, fn, texts, examples, finished, concurrency, timeout)
               for name, fn in at_once if texts or name in sources}  # rm: every rank joins its forwards
        return [combine(t, e, f, v, {name: r[k] for name, r in raw.items()})
                for k, (t, e, f, v) in enumerate(zip(texts, examples, finished, envs))]

    return replace(task, score=score, reward_names=[n for n, _, _ in fns],
                   score_batch=score_batch if at_once else None, sources=sources)


# ----------------------------------------------------------------------------------------------
# contamination: word n-gram overlap of training and held-out prompts (seed 002)


def _ngrams(text, n: int) -> set:
    words = prompt_text(text).lower().split()
    return {" ".join(words[i : i + n]) for i in range(len(words) - n + 1)}


def ngram_overlap(train_prompts: list, eval_prompts: list, n: int = 13) -> dict:
    """Evaluation prompts sharing at least one word n-gram with a training prompt: the share, and
    the offending (eval index, train index, n-gram) pairs."""
    index = {}
    for j, p in enumerate(train_prompts):
        for g in _ngrams(p, n):
            index.setdefault(g, j)
    pairs = []
    for i, p in enumerate(eval_prompts):
        hit = next((g for g in _ngrams(p, n) if g in index), None)
        if hit is not None:
            pairs.append({"eval": i, "train": index[hit], "ngram": hit})
    return {"n": n, "share": len(pairs) / max(1, len(eval_prompts)), "pairs": pairs}


def decontaminate(train: list, test: list, n: int = 13) -> tuple:
    """Drop training examples that share an n-gram with any held-out prompt."""
    test_grams = set().union(*(_ngrams(e["prompt"], n) for e in test)) if test else set()
    kept = [e for e in train if not (_ngrams(e["prompt"], n) & test_grams)]
    return kept, len(train) - len(kept)
