"""The types a reward speaks: a completion's Score, a Task (its examples and its verifier) and DataError (bad
input, named in one line). rewards.py (tasks and verifiers) and the modules that score build on these: no
module under rlmini/ imports rewards.py but the two that build a run's task from its flags
(rlmini/data.py::load_task; rlmini/memplan.py, the tiny model's alphabet)."""
from dataclasses import dataclass, field
from typing import Callable

OUTPUT_MARK = "```output"  # modmul, the code tool format: the model asks for the last block's output (ToRA)


def begun_reply(prompt) -> tuple:
    """(the prompt before the assistant's reply, the reply's given beginning): a conversation ending with an
    assistant message is a reply begun that the completion continues (rlmini/data.py::encode_prompts), so a
    reward model, a judge or an environment sees (conversation, beginning + completion); else (prompt, "")."""
    if isinstance(prompt, list) and prompt and prompt[-1].get("role") == "assistant":
        return prompt[:-1], prompt[-1]["content"]
    return prompt, ""


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
    # --reward functions that made this reward NaN/inf: (name, "raised" | "nonfinite", why), for
    # faults.check_rewards to name
    failed: tuple = ()


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
    # what of the task a checkpoint keeps (rg: --rg_curriculum's level), and (task, that state) -> None, which
    # --resume calls to put the task back where the run was (rlmini/checkpoint.py::save and ::resume)
    state: dict = field(default_factory=dict)
    restore: Callable | None = None
    # with a batched or async --reward function, a reward model or a judge: (texts, examples, finished, envs)
    # -> [Score], the whole rank's batch at once (data.score_rollouts); None: `score` per completion
    score_batch: Callable | None = None
    sources: dict = field(default_factory=dict)  # "rm" / "judge": their batched callables (reward_model.py)


class DataError(ValueError):
    """Bad input data: the message names the file and the row."""
