"""Environment classes in TRL's environment_factory contract (--env, rlmini/envs.py) and OpenEnv through the
same door (docs/examples/openenv_calculator.py): tools, rewards, faults, bad classes, a run of each."""
import json
import os
import re
import signal
import socket
import string
import subprocess
import sys
import time

import pytest
import requests
import torch

import common
import rewards
import train_grpo
from conftest import ROOT, read_metrics
from rlmini import data, envs, models, reward_fns, tools
from test_tools import Scripted, tool_chat_model  # noqa: F401 (a fixture)

CALCULATOR = os.path.join(ROOT, "docs", "examples", "calculator_env.py")
OPENENV = os.path.join(ROOT, "docs", "examples", "openenv_calculator.py")
RUN = ["--engine", "hf", "--task", "modmul", "--steps", "2", "--group_size", "4", "--wandb", "false",
       "--save_every", "0"]


def _module(tmp_path, body: str, name: str = "my_env") -> str:
    path = tmp_path / f"{name}.py"
    path.write_text(f"import sys\nsys.path.insert(0, {os.path.dirname(CALCULATOR)!r})\n" + body)
    return str(path)


RECORDED = """
import asyncio, time
from calculator_env import Calculator

class Recorded(Calculator):
    '''The example, recording what the pool does with it.'''
    def reset(self, **example):
        self.seen, self.resets = sorted(example), getattr(self, "resets", 0) + 1
        return super().reset(**example)

    def close(self):
        self.closed = getattr(self, "closed", 0) + 1

    async def get_reward(self):
        await asyncio.sleep(0)
        return super().get_reward()

    async def shout(self, text: str, times: int = 1) -> str:
        '''Say it louder.

        Args:
            text: what to say
            times: how often
        '''
        await asyncio.sleep(0)
        return text.upper() * times

    def hang(self, seconds: float) -> str:
        '''Sleep.

        Args:
            seconds: how long
        '''
        time.sleep(seconds)
        return "awake"

    def _helper(self):
        return 0
"""


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer
    alphabet = rewards.load_task("modmul").alphabet + list(string.printable)  # errors' text reads as text
    return AutoTokenizer.from_pretrained(models.build_tiny_model(alphabet))


# ----------------------------------------------------------------------------------------------- the contract


def test_methods_become_tools_and_reset_text_joins_the_prompt(tmp_path):
    """Public methods but reset/get_reward/close are the tools, with transformers' schema; reset gets the
    example's columns, its text is appended to a text prompt or a conversation's last message (as TRL does),
    each rollout of an example its own instance; code-format text is converted to the parameter's type; async
    methods and an async get_reward run; get_reward's values come back per rollout."""
    pool = envs.Pool(f"{_module(tmp_path, RECORDED)}:Recorded", 2.0, 4)
    assert sorted(pool.tools) == ["hang", "python", "shout"]
    shout = next(s for s in pool.schemas if s["function"]["name"] == "shout")["function"]["parameters"]
    assert shout["properties"]["times"]["type"] == "integer" and shout["required"] == ["text"]
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "Q:"}]
    examples = [{"prompt": "37*48%7", "answer": 5, "hint": " use the tool"},
                {"prompt": chat, "answer": 3, "hint": " go"}]
    lent, prompts, per = pool.begin(examples, 2)
    assert per == 2 and prompts == ["37*48%7 use the tool", chat[:1] + [{"role": "user", "content": "Q: go"}]]
    assert len({id(x) for x in lent}) == 4 and all(x.seen == ["answer", "hint", "prompt"] for x in lent)
    assert pool.call(lent[0], "python", "37*48%7\n") == "5" and pool.call(lent[2], "python", {"code": "1+2"})
    assert pool.call(lent[1], "shout", '{"text": "a", "times": 2}') == "AA"
    with pytest.raises(ValueError):
        pool.call(lent[1], "hang", "soon")  # a float parameter: the block's text is no number
    assert pool.end(lent) == [1.0, 0.0, 1.0, 0.0]
    again, _, _ = pool.begin(examples, 3)  # the four reused through reset, two more made
    assert len(pool.instances) == 6 and sum(x.resets for x in pool.instances) == 10
    pool.end(again)
    pool.close()
    pool.close()
    assert [x.closed for x in pool.instances] == [1] * 6


@pytest.mark.slow
def test_reset_text_joins_the_message_before_a_begun_reply():
    """A conversation ending with an assistant message (a reply begun, --task calibration_plain): reset's text
    is added to the message before it, the beginning stays last for the completion to continue."""
    from rlmini.task import begun_reply
    user = {"role": "user", "content": "Q?"}
    begun = [user, {"role": "assistant", "content": "It is"}]
    assert begun_reply(begun) == ([user], "It is") and begun_reply([user]) == ([user], "")
    assert begun_reply("Q?") == ("Q?", "")
    assert envs.with_observation(begun, " [obs]") == [{"role": "user", "content": "Q? [obs]"}, begun[1]]
    assert envs.with_observation([user], " [obs]") == [{"role": "user", "content": "Q? [obs]"}]
    with pytest.raises(rewards.DataError, match="only a begun assistant reply"):
        envs.with_observation(begun[1:], " [obs]")


def test_a_raising_method_is_a_tool_error_and_a_hung_instance_is_discarded(tmp_path, tok):
    """In a rollout: a method that raises answers the policy with the error (tools/raised); one that hangs is
    stopped at --tool_timeout, its instance discarded (no reward asked: 0, never lent again)."""
    spec = f"{_module(tmp_path, RECORDED)}:Recorded"
    box = tools.make_toolbox(common.Args(env=spec, tool_timeout=0.5))
    pool = box.env
    prompt = tok("```python\n37*48%7\n```\n", add_special_tokens=False)["input_ids"]
    bad = tok("```python\n37*\n```\n", add_special_tokens=False)["input_ids"]
    lent, _, _ = pool.begin([{"prompt": "a", "answer": 5}, {"prompt": "b", "answer": 5}], 1)
    engine = Scripted(tok, [["```output", "5</s>"], ["```output", "1</s>"]])
    r = tools.generate(engine, box, tok, [prompt, bad], 1, 16, 1.0, 0, lent)
    text = [tok.decode(c) for c in r.completion_ids]
    assert "\n5\n```\n" in text[0] and "SyntaxError" in text[1]
    assert [s["raised"] for s in r.tool_stats] == [0, 1] and [s["errors"] for s in r.tool_stats] == [0, 1]
    assert pool.end(lent) == [1.0, 0.0]
    lent, _, _ = pool.begin([{"prompt": "c", "answer": 5}], 2)
    start = time.perf_counter()
    out = tools.run_calls(box, [("hang", "30"), ("python", "2*3"), ("python", "1+1")],
                          [lent[0], lent[0], lent[1]])
    assert time.perf_counter() - start < 6
    assert out[0].timed_out and "TimeoutError" in out[0].text and out[2].text == "2"
    assert out[1].timed_out  # queued behind the hung call on the same instance
    assert pool.call(lent[1], "python", "1+1") == "2"
    with pytest.raises(TimeoutError, match="stopped answering"):
        pool.call(lent[0], "python", "1+1")
    assert pool.end(lent) == [None, 0.0]
    assert not any(x is lent[0] for x in pool.free)
    fresh, _, _ = pool.begin([{"prompt": "d", "answer": 1}], 2)
    assert not any(x is lent[0] for x in fresh)
    reward = reward_fns.with_reward_functions(rewards.load_task("modmul"), "", "", env=spec)
    assert reward.reward_names == ["task", "env"]
    assert reward.score("x", {"answer": 1}, True, env=None).reward == 0.0  # a discarded instance: 0
    weighted = reward_fns.with_reward_functions(rewards.load_task("modmul"), "env,task", "0.5,2", env=spec)
    assert weighted.score("```output1", {"answer": 1}, True, env=1.0).parts == (1.0, 1.0)
    assert weighted.score("```output1", {"answer": 1}, True, env=1.0).reward == 2.5
    pool.close()


@pytest.mark.slow
def test_chat_format_calls_methods_by_the_templates_tool_calls(tool_chat_model):
    """--tool_format chat: the template renders the methods' schemas, and a <tool_call> runs the method on the
    rollout's instance with its arguments, as in TRL."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tool_chat_model)
    box = tools.make_toolbox(common.Args(model=tool_chat_model, env=f"{CALCULATOR}:Calculator",
                                         tool_format="chat"), style="chat", tokenizer=tok)
    assert [s["function"]["name"] for s in box.schemas] == ["python"]
    lent, prompts, per = box.env.begin([{"prompt": "What is 37 * 48 mod 7?", "answer": 5}], 2)
    ids = data.encode_prompts(tok, prompts, True, box)
    assert "Evaluate an integer expression" in tok.decode(ids[0])
    call = '<tool_call>{"name": "python", "arguments": {"code": "37*48%7"}}</tool_call><|im_end|>'
    engine = Scripted(tok, [[call, "\\boxed{5}<|im_end|>"], ["\\boxed{4}<|im_end|>"]])
    r = tools.generate(engine, box, tok, ids, per, 200, 1.0, 0, lent)
    assert [s["calls"] for s in r.tool_stats] == [1, 0] and "5" in tok.decode(r.completion_ids[0])
    assert box.env.end(lent) == [1.0, 0.0]
    box.close()


def test_bad_environment_classes_are_refused_in_one_line(tmp_path):
    def refused(body, match, cls="E"):
        with pytest.raises(SystemExit) as e:
            envs.Pool(f"{_module(tmp_path, body, 'bad_' + str(abs(hash(body))))}:{cls}", 1.0, 2)
        assert re.search(match, str(e.value)) and "\n" not in str(e.value), str(e.value)

    refused("class E:\n    def step(self, a: str) -> str:\n        '''S.\n\n        Args:\n            a: x\n"
            "        '''\n", r"E has no reset method")
    refused("class E:\n    def reset(self, **kw): pass\n    def get_reward(self): return 1\n"
            "    def _x(self): pass\n", r"E exposes no tool")
    refused("class E:\n    def reset(self, **kw): pass\n    def guess(self, number) -> str:\n"
            "        '''G.\n\n        Args:\n            number: n\n        '''\n", r"E\.guess .*number")
    refused("class E:\n    def reset(self, **kw): pass\n    def guess(self, number: int) -> str:\n"
            "        '''G.'''\n", r"E\.guess .*number")
    refused("from calculator_env import Calculator\nclass E(Calculator):\n"
            "    def __init__(self): raise OSError('no server')\n", r"E\(\) raised OSError: no server")
    refused("from calculator_env import Calculator\nclass E(Calculator):\n"
            "    def __init__(self): sys.exit(3)\n", r"E\(\) called sys\.exit\(3\)$")
    refused("def E(): pass\n", "not a class")
    with pytest.raises(rewards.DataError, match="'env' is the reward of an --env class"):
        reward_fns.with_reward_functions(rewards.load_task("modmul"), "task,env", "")
    with pytest.raises(rewards.DataError, match="reset raised KeyError"):
        path = _module(tmp_path, "from calculator_env import Calculator\nclass E(Calculator):\n"
                       "    def reset(self, **kw): return kw['missing']\n", "bad_reset")
        envs.Pool(f"{path}:E", 1.0, 2).begin([{"prompt": "p", "answer": 1}], 2)


ENDING = """
import time
from calculator_env import Calculator

class Ending(Calculator):
    '''Calls sys.exit(3) in the method the example's `end` column names (^C: raises KeyboardInterrupt).'''
    def reset(self, **example):
        self.end = example["end"]
        self._end("reset")
        time.sleep(20 if self.end == "hang" else 0)
        return super().reset(**example)

    def _end(self, method):
        if self.end == method:
            sys.exit(3)
        if self.end == method + "^C":
            raise KeyboardInterrupt

    def step(self, action: str) -> str:
        '''Act.

        Args:
            action: what to do
        '''
        self._end("step")
        return action

    def get_reward(self):
        self._end("get_reward")
        return super().get_reward()

    def close(self):
        sys.exit()
"""


def test_sys_exit_in_the_environment_ends_the_run_and_ctrl_c_reaches_the_main_thread(tmp_path, capfd):
    """sys.exit in reset, a tool or get_reward ends the run in one line naming the method (reset, get_reward:
    as when they raise; a tool: SystemExit, never the policy's observation); in close, a warning. Ctrl-C in
    a call is KeyboardInterrupt in the main thread at once, the other calls not waited for. Before, each was
    a call that "did not return within --tool_timeout", the threads printing tracebacks."""
    box = tools.make_toolbox(common.Args(env=f"{_module(tmp_path, ENDING)}:Ending", tool_timeout=30))
    pool, start = box.env, time.perf_counter()
    with pytest.raises(rewards.DataError, match=r": Ending\.reset called sys\.exit\(3\) \(example 'p'\)$"):
        pool.begin([{"prompt": "p", "answer": 1, "end": "reset"}], 2)
    lent, _, _ = pool.begin([{"prompt": "q", "answer": 1, "end": "step"}], 1)
    assert tools.run_calls(box, [("python", "1+1")], lent)[0].text == "2"
    with pytest.raises(SystemExit, match=r"^--env \S+:Ending: Ending\.step called sys\.exit\(3\)$"):
        tools.run_calls(box, [("python", "1+1"), ("step", "go")], lent * 2)
    lent, _, _ = pool.begin([{"prompt": "r", "answer": 1, "end": "get_reward"}], 1)
    pool.on_nonfinite = "skip"  # a reward that calls sys.exit scores nothing: it stops, skip or not
    with pytest.raises(rewards.DataError, match=r": Ending\.get_reward called sys\.exit\(3\)$"):
        pool.end(lent)
    examples = [{"prompt": "s", "answer": 1, "end": "hang"}, {"prompt": "t", "answer": 1, "end": "reset^C"}]
    with pytest.raises(KeyboardInterrupt):
        pool.begin(examples, 1)
    assert time.perf_counter() - start < 10  # nothing waited for --tool_timeout, nor for the hung reset
    pool.close()
    err = capfd.readouterr().err
    assert re.search(r"of \d+ Ending\.close\(\) calls failed \(the first called sys\.exit\(\)\)\n$", err)
    assert "Traceback" not in err and "Exception in thread" not in err, err
    own = tools.make_toolbox(common.Args(tools=f"{_module(tmp_path, EXITS, 'exits')}:leave"))
    with pytest.raises(SystemExit, match=r"^--tools leave called sys\.exit\(3\)$"):  # a --tools function's
        tools.run_calls(own, [("leave", "now")])


EXITS = """
def leave(code: str) -> str:
    '''Leave.

    Args:
        code: ignored
    '''
    sys.exit(3)
"""


# ---------------------------------------------------------------------------------------------- runs


def _tool_outputs(row) -> list:
    return [t["text"] for t in row["turns"] if t["role"] == "tool"]


def test_the_example_environment_trains_on_the_built_in_model(tmp_path):
    """docs/examples/calculator_env.py, 2 GRPO steps of the tiny model on modmul with the HF engine: each
    rollout's reward is the task's plus the environment's (1 when a tool output was the answer), instances are
    one per rollout, reused through reset, and closed at the end."""
    spec = f"{_module(tmp_path, RECORDED)}:Recorded"
    run = train_grpo.main(["--out_dir", str(tmp_path), "--env", spec, "--prompts_per_step", "4",
                           "--log_completions", "16", "--max_turns", "3", *RUN])
    rows = read_metrics(run.run_dir)
    for row in rows:
        assert row["reward/mean"] == pytest.approx(row["reward/task"] + row["reward/env"])
        assert row["logprob/sampler_diff"] < 1e-4 and "tools/raised" in row
    logged = [json.loads(x) for x in open(os.path.join(run.run_dir, "rollouts.jsonl"))]
    assert len(logged) == 32 and any(_tool_outputs(r) for r in logged)
    for r in logged:  # a call ran the prompt's block (whose value is the answer) unless the policy wrote one
        own = any("```python" in t["text"] for t in r["turns"] if t["role"] == "policy")
        env = float(any(t.strip().removesuffix("```").strip() == r["answer"] for t in _tool_outputs(r)) or
                    not own and r["tool_stats"]["calls"] > r["tool_stats"]["errors"])
        assert r["reward"] == r["correct"] + env, r
    assert sum(r["reward"] - r["correct"] for r in logged) / 16 == pytest.approx(
        sum(row["reward/env"] for row in rows))
    pool = run.toolbox.env
    assert len(pool.instances) == 16 and sum(x.resets for x in pool.instances) == 32
    assert all(x.closed == 1 for x in pool.instances)


def test_eval_runs_the_environment(tmp_path):
    import eval as evaluation
    out = evaluation.cmd_evaluate(["--task", "modmul", "--engine", "hf", "--env", f"{CALCULATOR}:Calculator",
                                   "--n", "2", "--k", "1,2", "--limit", "4", "--out", str(tmp_path / "ev")])
    assert out["n"] == 2 and "tool_calls" in out and 0 <= out["reward"] <= 2


# ---------------------------------------------------------------------------------------------- OpenEnv


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def openenv_server(tmp_path):
    """The example's OpenEnv server under uvicorn on 127.0.0.1, a free port; up within 90 s or the test fails;
    killed (with its process group) at the end."""
    pytest.importorskip("openenv")
    port, log, out = _free_port(), tmp_path / "steps.jsonl", open(tmp_path / "server.out", "w")
    proc = subprocess.Popen([sys.executable, OPENENV, "--port", str(port), "--log", str(log)],
                            stdout=out, stderr=out, start_new_session=True)  # a file: a pipe would fill
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 90
    while True:
        try:
            if requests.get(f"{url}/health", timeout=1).ok:
                break
        except requests.RequestException:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the OpenEnv server did not start: {(tmp_path / 'server.out').read_text()}")
        time.sleep(0.2)
    try:
        yield proc, url, log
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


@pytest.mark.slow
def test_openenv_trains_over_its_websocket_client(tmp_path, openenv_server, monkeypatch):
    """Two GRPO steps against our OpenEnv server: the episodes' rewards the server counted are the run's
    reward/env; a URL that does not answer is refused at start; a dead server stops the run in one line."""
    proc, url, log = openenv_server
    monkeypatch.setenv("OPENENV_URL", url)
    spec = f"{OPENENV}:Calculator"
    run = train_grpo.main(["--out_dir", str(tmp_path), "--env", spec, "--prompts_per_step", "4",
                           "--max_turns", "3", *RUN])
    rows = read_metrics(run.run_dir)
    steps = [json.loads(x) for x in open(log)]
    assert steps and sum(s["reward"] for s in steps) == pytest.approx(sum(r["reward/env"] * 16 for r in rows))
    assert sum(r["tools/calls"] * 16 for r in rows) == pytest.approx(len(steps))
    print("openenv reward/env per step:", [r["reward/env"] for r in rows])
    pool = envs.Pool(spec, 2.0, 2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    with pytest.raises(rewards.DataError, match=r"Calculator\.reset raised") as e:
        pool.begin([{"prompt": "p", "answer": 1}], 1)  # the instance made at start: its session is gone
    assert "\n" not in str(e.value)
    pool.close()
    monkeypatch.setenv("OPENENV_URL", f"http://127.0.0.1:{_free_port()}")
    with pytest.raises(SystemExit, match=r"Calculator\(\) raised ConnectionError: the OpenEnv server .* does "
                                         r"not answer") as e:
        envs.Pool(spec, 2.0, 2)
    assert "\n" not in str(e.value)
