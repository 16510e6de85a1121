"""Examples from rows: a user's JSONL file or Hugging Face dataset (a prompt that may be a conversation, an
answer, every other column kept), the text of a prompt, --system_prompt, and contamination (word n-grams
shared by training and held-out prompts, seed 002). The built-in datasets' own row formats (GSM8K, MATH) are
tasks and live in rewards.py."""
import json
import os
import sys

from rlmini.task import DataError, Task


def where(lines, i: int) -> str:
    """Where row i came from: its 1-based line in the file (`lines` from read_jsonl_numbered), else its
    1-based position (hub datasets)."""
    return f"line {lines[i]}" if lines else f"row {i + 1}"


def require_fields(row: dict, keys: tuple, source: str, at: str) -> None:
    if not isinstance(row, dict):
        raise DataError(f"{source}: {at}: expected an object, got {type(row).__name__}")
    for k in keys:
        if k not in row:
            raise DataError(f"{source}: {at}: missing field '{k}' (has: {sorted(row)})")
        if not isinstance(row[k], (str, int, float)) or str(row[k]).strip() == "":
            raise DataError(f"{source}: {at}: field '{k}' is empty or not text")

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

def dataset_splits(spec: str) -> tuple[dict, str]:
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


def hub_rows(path: str, name: str | None, split: str, task: str) -> list:
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


def read_split(local: str | None, hub: tuple, split: str, task: str = "") -> tuple[list, str, list | None]:
    """(rows, source, line numbers or None) from a local file (offline) or from the hub (the real thing users
    run)."""
    if local:
        path = local.replace("{split}", split)
        rows, lines = read_jsonl_numbered(path)
        return rows, path, lines
    path, name, hub_split = hub
    return hub_rows(path, name, hub_split[split], task), f"{path}[{hub_split[split]}]", None


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
