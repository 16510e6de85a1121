"""Reward functions of your own, for --reward (docs/own-experiment.md). Each is called once per
completion with keyword arguments and returns a float (or a rewards.Score, whose correct/format_ok then
replace the task verifier's):

    python train_grpo.py --task jsonl:tests/fixtures/own_fields.jsonl --jsonl_reward exact \\
        --reward task,docs/examples/my_rewards.py:length_penalty --reward_weights 1,0.5

The run's reward is 1 x the task's verifier + 0.5 x length_penalty; metrics.jsonl logs both, unweighted,
as reward/task and reward/length_penalty.
"""


def length_penalty(prompt: str, completion: str, example: dict, finished: bool) -> float:
    """Minus the share of the example's character budget (its own `max_chars` field, else 8) that the
    completion overruns, down to -1; a completion cut off by --max_new_tokens gets -1."""
    if not finished:
        return -1.0
    budget = example.get("max_chars", 8)
    return -min(1.0, max(0, len(completion) - budget) / budget)


def starts_with_answer_digit(prompt: str, completion: str, example: dict, finished: bool) -> float:
    """Partial credit: 1 if the completion starts with the answer's first character (a shaped reward)."""
    return float(completion[:1] == str(example["answer"])[:1])
