"""LLM judges (rlmini/judge.py) against a scripted OpenAI-compatible double on 127.0.0.1: the parse rules,
the template's fields, the start-up probe, retries, timeouts, the failure policies and their counts, the
cache, the concurrency bound, the key (sent, never in the run folder), a 2-step training run and eval.py with
the judge as the reward. The real `vllm serve` judge is in tests/test_server.py."""
import argparse
import dataclasses
import json
import os
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import common
import eval as ev
import train_grpo
from rlmini import judge
from rlmini.faults import JudgeError

KEY = "sk-test-7f3a9c-never-written"
MODEL = "judge-double"


class Double:
    """A scripted judge server: the completion (between <C> and </C> in the prompt) says what to answer.
    GOOD<n>: "... <n>"; NONUM: no number; SLOW: sleeps past the timeout; E500: 500 twice, then "8"; R429: 429
    once, then "5"; A401: 401; anything else: its length mod 11. Records requests, headers, max in flight."""

    def __init__(self, delay=0.05):
        self.delay, self.lock, self.seen, self.auth = delay, threading.Lock(), {}, set()
        self.in_flight = self.max_in_flight = 0
        double = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code, body):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                double.auth.add(self.headers.get("Authorization"))
                self._send(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with double.lock:
                    double.auth.add(self.headers.get("Authorization"))
                    double.in_flight += 1
                    double.max_in_flight = max(double.max_in_flight, double.in_flight)
                try:
                    code, text = double.answer(body)
                finally:
                    with double.lock:
                        double.in_flight -= 1
                if code != 200:
                    return self._send(code, {"error": {"message": f"scripted {code}"}})
                self._send(200, {"choices": [{"index": 0, "message": {"role": "assistant",
                                                                      "content": text}}]})

        class Server(ThreadingHTTPServer):
            request_queue_size = 64  # socketserver's 5 would drop the SYNs of a burst (a 1 s retransmit)

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.server.handle_error = lambda *a: None  # a client gone after its timeout (SLOW): not an error
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self, body) -> tuple:
        text = body["messages"][0]["content"]
        c = re.search(r"<C>(.*?)</C>", text, re.S).group(1)
        with self.lock:
            n = self.seen[c] = self.seen.get(c, 0) + 1
        time.sleep(self.delay)
        if c == "SLOW":
            time.sleep(1.0)
            return 200, "10"
        if c == "E500" and n <= 2:
            return 500, ""
        if c == "R429" and n == 1:
            return 429, ""
        if c == "A401":
            return 401, ""
        if c.startswith("GOOD"):
            return 200, f"The response is fine. Score: {c[4:]}/10"
        return 200, {"NONUM": "I cannot grade this.", "E500": "8", "R429": "5"}.get(c, str(len(c) % 11))


@pytest.fixture(scope="module")
def double():
    d = Double()
    yield d
    d.server.shutdown()


def _args(url, **kw):
    a = {f.name: f.default for f in dataclasses.fields(judge.JudgeArgs)}
    a.update({"judge_url": url, "judge_model": MODEL, "judge_timeout": 0.3, "judge_retries": 2,
              "judge_concurrency": 3, **kw})
    return argparse.Namespace(**a)


def _judge(url, tmp_path, monkeypatch, **kw):
    (tmp_path / "t.txt").write_text("Grade <C>{completion}</C> for {prompt} (ref {answer}, 0-{scale}).")
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    monkeypatch.setattr(judge, "BACKOFF_S", 0.01)
    return judge.make_judge(_args(url, judge_prompt=str(tmp_path / "t.txt"), **kw), None,
                            columns=["prompt", "answer"])


def _call(fn, completions):
    n = len(completions)
    return fn(prompts=["q"] * n, completions=completions, examples=[{"prompt": "q", "answer": "1"}] * n,
              finished=[True] * n)


def test_parse_rules():
    p = judge.parse_score
    assert p("Reasonable. 7", "last-number", 10) == 0.7
    assert p("Score: 7/10", "last-number", 10) == 0.7 and p("8 out of 10", "last-number", 10) == 0.8
    assert p("2 of the 3 steps hold; score 4.5", "last-number", 10) == 0.45
    assert p("<think>maybe 10</think> so 3", "last-number", 10) == pytest.approx(0.3)
    assert p("4", "last-number", 5) == 0.8 and p("0", "last-number", 10) == 0.0
    assert p("11", "last-number", 10) is None and p("-1", "last-number", 10) is None  # off the scale
    assert p("no number here", "last-number", 10) is None
    assert p("1. yes\n2) No\n3. YES, it does\nNotes: 4. no", "rubric", 10) == pytest.approx(2 / 3)
    assert p("yes yes", "rubric", 10) is None


def test_template_and_probe_are_refused_in_one_line(double, tmp_path, monkeypatch):
    def refused(template=None, columns=("prompt", "answer"), **kw):
        if template is not None:
            (tmp_path / "p.txt").write_text(template)
            kw["judge_prompt"] = str(tmp_path / "p.txt")
        with pytest.raises(SystemExit) as e:
            judge.make_judge(_args(double.url, **kw), None, columns=columns)
        assert "\n" not in str(e.value)
        return str(e.value)

    assert "unknown field {rubric}" in refused("{completion} {rubric}")
    assert "cannot parse" in refused("{completion} {prompt")
    assert "no {completion}" in refused("{prompt}")
    assert "{0}" in refused("{completion} {0}")
    assert "file not found" in refused(judge_prompt=str(tmp_path / "missing.txt"))
    (tmp_path / "ok.txt").write_text("{completion} {topic}")  # an example column is a field
    assert judge.make_judge(_args(double.url, judge_prompt=str(tmp_path / "ok.txt")), None,
                            columns=["prompt", "topic"]).model == MODEL
    assert f"serves {MODEL}" in refused(judge_model="gpt-9")
    assert judge.make_judge(_args(double.url, judge_model=""), None).model == MODEL  # its one model
    closed = double.url.replace(str(double.server.server_address[1]), "9")  # port 9: nothing listens
    assert "no answer to GET" in refused(judge_url=closed)
    listener = socket.socket()  # accepts, never answers: refused at the probe's deadline
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    monkeypatch.setattr(judge, "PROBE_S", 1.0)
    start = time.perf_counter()
    assert "within 1 s" in refused(judge_url=f"http://127.0.0.1:{listener.getsockname()[1]}/v1")
    assert time.perf_counter() - start < 5
    listener.close()


def test_scripted_answers_counts_retries_cache_and_bound(double, tmp_path, monkeypatch, capsys):
    timeout = 0.6  # SLOW sleeps 1 s; a quick answer on a loaded machine must not time out (an extra retry)
    fn, _ = _judge(double.url, tmp_path, monkeypatch, judge_timeout=timeout), double.auth.clear()
    batch = ["GOOD7", "GOOD7", "GOOD3", "NONUM", "SLOW", "E500", "R429", "A401", "GOOD10", "GOOD0", "abcd"]
    start = time.perf_counter()
    scores = _call(fn, batch)
    took = time.perf_counter() - start
    assert scores == pytest.approx([0.7, 0.7, 0.3, 0, 0, 0.8, 0.5, 0, 1.0, 0, 0.4])
    m = fn.step_metrics()
    assert {k: m[k] for k in ("judge/calls", "judge/cache_hits", "judge/failures", "judge/parse_failures",
                              "judge/retries")} == {"judge/calls": 10, "judge/cache_hits": 1,
                                                    "judge/failures": 2, "judge/parse_failures": 1,
                                                    "judge/retries": 5}  # SLOW 2, E500 2, R429 1, A401 0
    assert double.seen["A401"] == 1 and double.seen["E500"] == 3 and double.seen["SLOW"] == 3
    assert m["judge/latency_s"] >= 3 * timeout  # SLOW's three timeouts at least
    assert took < timeout * 3 + 0.1 + 2  # nothing waits past the deadlines (3 tries of SLOW, backoff, slack)
    err = capsys.readouterr().err
    assert "warning: judge: 3 of 11 judgements scored 0, the worst value" in err and KEY not in err
    assert double.max_in_flight == 3  # --judge_concurrency 3 bounds it, and is reached
    assert double.auth == {f"Bearer {KEY}"}
    assert fn.step_metrics()["judge/calls"] == 0  # reset by the call
    _call(fn, batch)  # judged answers come from the cache; failures are asked again
    m = fn.step_metrics()
    assert (m["judge/calls"], m["judge/cache_hits"], m["judge/failures"], m["judge/parse_failures"]) == (
        2, 9, 2, 1)
    assert double.seen["GOOD3"] == 1 and double.seen["A401"] == 2


def test_more_than_half_failed_or_on_error_stop_stops(double, tmp_path, monkeypatch):
    fn = _judge(double.url, tmp_path, monkeypatch)
    assert _call(fn, ["NONUM", "A401", "GOOD5", "GOOD6"]) == [0, 0, 0.5, 0.6]  # half: scored, not stopped
    with pytest.raises(JudgeError, match=r"2 of 3 judgements of this step failed \(more than half"):
        _call(fn, ["NONUM", "A401", "GOOD5"])
    assert fn.step_metrics()["judge/failures"] == 2
    fn = _judge(double.url, tmp_path, monkeypatch, judge_on_error="stop")
    with pytest.raises(JudgeError, match=r"HTTP 401 .*--judge_on_error stop"):
        _call(fn, ["GOOD1", "A401", "GOOD2"])
    with pytest.raises(JudgeError, match=r"no score in the answer 'I cannot grade this.'"):
        _call(fn, ["GOOD1", "NONUM"])


def test_two_steps_trained_on_the_judge_key_never_in_the_run_folder(double, tmp_path, monkeypatch):
    (tmp_path / "t.txt").write_text("Grade <C>{completion}</C>")
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    double.auth.clear()
    run = train_grpo.main(["--engine", "hf", "--steps", "2", "--prompts_per_step", "4", "--group_size", "4",
                           "--out_dir", str(tmp_path), "--run_name", "judged", "--wandb", "false",
                           "--judge_url", double.url, "--judge_model", MODEL,
                           "--judge_prompt", str(tmp_path / "t.txt"), "--eval_every", "2", "--eval_n", "1",
                           "--eval_limit", "4", "--save_every", "2"])
    rows = [json.loads(x) for x in open(os.path.join(run.run_dir, "metrics.jsonl"))]
    train = [r for r in rows if "judge/calls" in r]
    assert len(train) == 2 and all(r["reward/judge"] == r["reward/mean"] for r in train)
    assert all(r["judge/calls"] + r["judge/cache_hits"] >= 16 and r["judge/failures"] == 0 for r in train)
    assert double.auth == {f"Bearer {KEY}"}
    for root, _, files in os.walk(tmp_path / "judged"):
        for f in files:
            with open(os.path.join(root, f), "rb") as fh:
                assert KEY.encode() not in fh.read(), f


def test_eval_scores_with_the_judge(double, tmp_path, monkeypatch):
    (tmp_path / "t.txt").write_text("Grade <C>GOOD7</C>, not {completion}")
    result = ev.cmd_evaluate(["--task", "addition", "--n", "2", "--k", "1,2", "--limit", "3", "--engine",
                              "hf", "--out", str(tmp_path / "ev"), "--judge_url", double.url, "--judge_model",
                              MODEL, "--judge_prompt", str(tmp_path / "t.txt")])
    assert result["reward"] == pytest.approx(0.7)  # the judge's score, not the verifier's 0/1


def test_a_run_whose_judge_fails_stops_in_one_line(double, tmp_path, capsys):
    (tmp_path / "t.txt").write_text("Grade <C>NONUM</C>, not {completion}")  # every answer unparseable
    with pytest.raises(SystemExit) as e:
        with common.user_errors():
            train_grpo.main(["--engine", "hf", "--steps", "2", "--prompts_per_step", "2", "--group_size", "2",
                             "--out_dir", str(tmp_path), "--wandb", "false", "--judge_url", double.url,
                             "--judge_model", MODEL, "--judge_prompt", str(tmp_path / "t.txt")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and "JudgeError: judge: 4 of 4 judgements of this step failed" in err[-1], err
