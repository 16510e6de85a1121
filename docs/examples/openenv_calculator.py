"""OpenEnv through --env (docs/environments.md): an OpenEnv environment server of our own, and `Calculator`, a
class in TRL's environment_factory contract that plays it over OpenEnv's WebSocket client (one server session
per instance, so one per rollout in flight).

    python docs/examples/openenv_calculator.py --port 8011 &          # the server: uvicorn, no Docker
    OPENENV_URL=http://127.0.0.1:8011 python train_grpo.py --task modmul --engine hf \\
        --env docs/examples/openenv_calculator.py:Calculator

The server evaluates integer expressions (calculator_env.py's evaluator) and rewards each step whose value is
the episode's answer; `get_reward` reads the episode's total from the server's state.
"""
import argparse
import ast
import json
import os
import sys
import threading
import uuid

import requests

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from calculator_env import _evaluate  # noqa: E402

URL = "http://127.0.0.1:8000"  # OPENENV_URL overrides it


class Calculator:
    """The OpenEnv calculator's episode, as an environment class: `python` is one step of the server's."""

    def __init__(self):
        from openenv.core import GenericEnvClient
        url = os.environ.get("OPENENV_URL", URL)
        try:  # a server that does not answer is refused at once, in one line (the run does not start)
            requests.get(f"{url}/health", timeout=5).raise_for_status()
        except requests.RequestException as e:
            raise ConnectionError(f"the OpenEnv server {url} does not answer ({type(e).__name__})") from None
        self.client = GenericEnvClient(base_url=url, connect_timeout_s=5, message_timeout_s=10).sync()
        self.client.connect()

    def reset(self, **example) -> str | None:
        """A new episode on the server, told the example's answer."""
        self.client.reset(answer=str(example.get("answer")))
        return None

    def python(self, code: str) -> str:
        """Evaluate an integer expression: numbers, + - * // %, parentheses.

        Args:
            code: the expression, e.g. "37*48%7"
        """
        result = self.client.step({"code": code}).observation
        if result.get("error"):
            raise ValueError(result["error"])
        return result["result"]

    def get_reward(self) -> float:
        """The episode's total reward, as the server counted it."""
        return float(self.client.state()["total_reward"])

    def close(self) -> None:
        self.client.close()


def app(log: str = ""):
    """The server's FastAPI app (OpenEnv's create_fastapi_app); each step's reward is appended to `log`."""
    from openenv.core.env_server.http_server import create_fastapi_app
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action, Observation, State

    class CalcAction(Action):
        code: str

    class CalcObservation(Observation):
        result: str = ""
        error: str = ""

    lock = threading.Lock()

    class CalculatorEnvironment(Environment):
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self):
            super().__init__()
            self.answer, self._state = "", State(episode_id="", step_count=0, total_reward=0.0)

        def reset(self, seed=None, episode_id=None, answer: str = "", **kwargs) -> CalcObservation:
            self.answer = answer
            self._state = State(episode_id=episode_id or uuid.uuid4().hex, step_count=0, total_reward=0.0)
            return CalcObservation(done=False, reward=0.0)

        def step(self, action: CalcAction, timeout_s=None, **kwargs) -> CalcObservation:
            self._state.step_count += 1
            try:
                value, error = str(_evaluate(ast.parse(action.code.strip(), mode="eval").body)), ""
            except (ValueError, SyntaxError, ZeroDivisionError, RecursionError) as e:
                value, error = "", f"{type(e).__name__}: {e}"
            reward = float(value != "" and value == self.answer)
            self._state.total_reward += reward
            if log:
                with lock, open(log, "a") as f:
                    f.write(json.dumps({"episode": self._state.episode_id, "reward": reward}) + "\n")
            return CalcObservation(done=False, reward=reward, result=value, error=error)

        @property
        def state(self) -> State:
            return self._state

    return create_fastapi_app(CalculatorEnvironment, CalcAction, CalcObservation, max_concurrent_envs=256)


if __name__ == "__main__":
    import uvicorn
    p = argparse.ArgumentParser(description="The OpenEnv calculator server, on 127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--log", default="", help="append each step's reward to this JSONL file")
    a = p.parse_args()
    uvicorn.run(app(a.log), host="127.0.0.1", port=a.port, log_level="warning")
