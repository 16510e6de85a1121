"""A small environment in TRL's environment_factory contract (docs/environments.md): the same class runs as
`GRPOTrainer(environment_factory=Calculator)` in TRL and as `--env` here.

    python train_grpo.py --task modmul --env docs/examples/calculator_env.py:Calculator --engine hf

Its one tool is named `python` so that the built-in tiny model's modmul prompts (a ```python block, then the
policy's ```output) call it; a chat model calls it by the template's tool calls (--tool_format chat). The
expressions are evaluated over a small syntax tree, never by exec: the policy writes them.
"""
import ast
import operator

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
        ast.Mod: operator.mod, ast.USub: operator.neg}


def _evaluate(node):
    if isinstance(node, ast.Constant) and type(node.value) is int and abs(node.value) < 10**12:
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"not an integer expression: {ast.unparse(node)}")


class Calculator:
    """Integer arithmetic with a memory of the episode's results; the reward: a result equal to the answer."""

    def __init__(self):
        self.answer, self.results = None, []

    def reset(self, **example) -> str | None:
        """A new episode for one rollout of `example` (its columns: prompt, answer, ...). Text returned here
        is appended to the prompt: the example's `hint` column, if the data set has one."""
        self.answer, self.results = example.get("answer"), []
        return example.get("hint")

    def python(self, code: str) -> str:
        """Evaluate an integer expression: numbers, + - * // %, parentheses.

        Args:
            code: the expression, e.g. "37*48%7"
        """
        value = _evaluate(ast.parse(code.strip(), mode="eval").body)
        self.results.append(value)
        return str(value)

    def get_reward(self) -> float:
        """1 when a result of this episode equals the example's answer, else 0."""
        return float(self.answer is not None and str(self.answer) in map(str, self.results))
