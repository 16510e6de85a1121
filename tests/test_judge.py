"""LLM judges (rlmini/judge.py) against a scripted OpenAI-compatible double on 127.0.0.1: the parse rules,
the template's fields, the start-up probe, retries, timeouts, the failure policies and their counts, the
cache, the concurrency bound, the key (sent, never in the run folder), answers cut off before their verdict,
a 0-1 judge under a larger scale, the step's verdict over every rank's judgements (a test double of
dist.all_sum), a 2-step training run and eval.py with the judge as the reward. The real `vllm serve` judge
is in tests/test_server.py."""
import argparse
import dataclasses
import json
import os
import re
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import common
import rewards
import eval as ev
import train_grpo
from rlmini import dist, httpclient, judge, reward_fns
from rlmini.faults import JudgeError

KEY = "sk-test-7f3a9c-never-written"
MODEL = "judge-double"


class Double:
    """A scripted judge server: the completion (between <C> and </C> in the prompt) says what to answer.
    GOOD<n>: "... <n>/10"; UNIT<x>: "<x>" (a judge on a 0-1 scale); NONUM: no number; THINK: a number inside
    an unclosed <think>; LONG: "... 8" with finish_reason "length"; SLOW: sleeps past the timeout; E500: 500
    twice, then "8"; R429: 429 once, then "5"; A401: 401; anything else: its length mod 11. Records
    requests, headers, max in flight."""

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
                    code, text, *finish = double.answer(body)
                finally:
                    with double.lock:
                        double.in_flight -= 1
                if code != 200:
                    return self._send(code, {"error": {"message": f"scripted {code}"}})
                self._send(200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                              "finish_reason": (finish or ["stop"])[0]}]})

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
        if c.startswith("UNIT"):
            return 200, c[4:]
        if c == "THINK":
            return 200, "<think>The response is right, so 9"
        if c == "LONG":
            return 200, "<think>Short.</think> Score: 8", "length"
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
    monkeypatch.setattr(httpclient, "BACKOFF_S", 0.01)
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
    # an example without the column: the template cannot render, which stops the run (no NaN to skip)
    fn = judge.make_judge(_args(double.url, judge_prompt=str(tmp_path / "ok.txt")), None)
    task = reward_fns.with_reward_functions(rewards.load_task("addition"), "", "", sources={"judge": fn})
    with pytest.raises(rewards.DataError, match=r"^--judge_prompt: field \{topic\} is not a column of the "
                                                r"example with prompt '1\+2='$"):
        task.score_batch(["3"], [{"prompt": "1+2=", "answer": 3}], [True], [None])
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


def test_a_machine_without_the_http_client_is_told_in_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "httpx2", None)  # as if not installed: its import raises ImportError
    with pytest.raises(SystemExit, match=r"^--judge_url: the HTTP client is not installed: pip install "
                                         r"'httpx2>=2.0,<3' \(requirements-common.txt\)$"):
        judge.make_judge(_args("http://127.0.0.1:9/v1"), None)


@pytest.mark.slow
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


def test_a_0_1_judge_under_a_larger_scale_is_counted_and_warned(double, tmp_path, monkeypatch, capsys):
    """"0.9" under --judge_scale 10 reads 0.09: counted (judge/unit_range), and a step whose every score lies
    in [0, 1] warns in one line naming the scale and the fix. "7/10" is still 7; zeros alone warn nothing."""
    fn = _judge(double.url, tmp_path, monkeypatch)

    def warned():
        return [x for x in capsys.readouterr().err.splitlines() if "lies in [0, 1]" in x]

    assert _call(fn, ["UNIT0.9", "UNIT0.5", "GOOD0", "NONUM"]) == pytest.approx([0.09, 0.05, 0, 0])
    assert fn.step_metrics()["judge/unit_range"] == 2
    lines = warned()
    assert len(lines) == 1 and "on --judge_scale 10 (2 of 3 in (0, 1])" in lines[0], lines
    assert "--judge_scale 1," in lines[0] and "--judge_prompt" in lines[0]
    assert _call(fn, ["UNIT0.9", "GOOD7"]) == pytest.approx([0.09, 0.7])  # 7/10 is 7: not every score
    assert fn.step_metrics()["judge/unit_range"] == 1 and warned() == []
    assert _call(fn, ["GOOD0", "GOOD0"]) == [0, 0] and warned() == []  # 0 is the bottom of either scale
    fn = _judge(double.url, tmp_path, monkeypatch, judge_scale=1)
    assert _call(fn, ["UNIT0.9", "UNIT0.5"]) == pytest.approx([0.9, 0.5])
    assert fn.step_metrics()["judge/unit_range"] == 0 and warned() == []


def test_an_answer_cut_off_before_its_verdict_is_a_parse_failure(double, tmp_path, monkeypatch, capsys):
    """A number inside an unclosed <think>, or an answer the judge's token budget cut (finish_reason
    "length", a number after the reasoning or not), is no score: a parse failure naming why, cached as the
    answer."""
    fn = _judge(double.url, tmp_path, monkeypatch)
    assert _call(fn, ["THINK", "LONG", "GOOD7", "GOOD8"]) == pytest.approx([0, 0, 0.7, 0.8])
    m = fn.step_metrics()
    assert (m["judge/parse_failures"], m["judge/failures"]) == (2, 0)
    err = capsys.readouterr().err
    assert "2 of 4 judgements scored 0" in err, err
    assert "the first: the answer was cut off inside its reasoning (unclosed <think>): '<think>The" in err
    with pytest.raises(JudgeError, match=r"2 of 2 judgements .* the first: the answer was cut off inside"):
        _call(fn, ["THINK", "LONG"])
    m = fn.step_metrics()
    assert (m["judge/calls"], m["judge/cache_hits"], m["judge/parse_failures"]) == (0, 2, 2)
    fn = _judge(double.url, tmp_path, monkeypatch, judge_on_error="stop")
    with pytest.raises(JudgeError, match=r"cut off at --judge_max_tokens 256 \(finish_reason length\): "
                                         r"'<think>Short.</think> Score: 8'; stopped"):
        _call(fn, ["GOOD1", "LONG"])


def test_the_steps_verdict_is_over_every_ranks_judgements(double, tmp_path, monkeypatch, capsys):
    """dist.all_sum's test double adds another rank's sums of the step: more than half failed, a failure
    under --judge_on_error stop and the 0-1 warning are decided on the global batch, alike on every rank;
    every call joins the sum once, a rank whose own batch stopped too."""
    other, sums = {}, []

    def all_sum(mine):
        sums.append(dict(mine))
        return {k: v + other.get(k, 0) for k, v in mine.items()}

    monkeypatch.setattr(dist, "all_sum", all_sum)
    fn = _judge(double.url, tmp_path, monkeypatch)
    other.update(judgements=3, scored=3)
    assert _call(fn, ["NONUM", "A401", "GOOD5"]) == [0, 0, 0.5]  # 2 of 3 here, 2 of 6 in all: scored
    assert "2 of 3 judgements scored 0" in capsys.readouterr().err  # this rank's own warning
    other.clear(), other.update(judgements=4, failures=1, parse_failures=3)
    with pytest.raises(JudgeError, match=r"judge: 4 of 6 judgements of this step failed \(more than half; 1 "
                                         r"failed requests, 3 unparseable answers\); the first: a judgement "
                                         r"failed on another rank; stopped"):
        _call(fn, ["GOOD5", "GOOD6"])  # all good here
    other.clear(), other.update(stopped=1)
    with pytest.raises(JudgeError, match="another rank stopped this step's judgements"):
        _call(fn, ["GOOD5"])
    other.clear(), other.update(judgements=1, scored=1)  # the other rank's score is above 1
    _call(fn, ["UNIT0.9"])
    assert "lies in [0, 1]" not in capsys.readouterr().err
    other.update(at_most_unit=1, unit_range=1)
    _call(fn, ["UNIT0.9"])
    assert "on --judge_scale 10 (2 of 2 in (0, 1])" in capsys.readouterr().err
    assert [len(s) for s in sums] == [7] * 5 and [s["judgements"] for s in sums] == [3, 2, 1, 1, 1]
    fn, sums[:] = _judge(double.url, tmp_path, monkeypatch, judge_on_error="stop"), []
    other.clear(), other.update(judgements=1, failures=1)
    with pytest.raises(JudgeError, match=r"judge: a judgement failed on another rank; stopped \(--judge_on_"):
        _call(fn, ["GOOD5"])
    other.clear()
    with pytest.raises(JudgeError, match=r"HTTP 401 .*--judge_on_error stop"):
        _call(fn, ["A401", "GOOD5"])  # its batch stopped at the failure, after which it joined the sum
    assert [s["stopped"] for s in sums] == [0, 1]


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
    """Under --on_nonfinite skip too: a judge that fails scores nothing (before: every update skipped, status
    0)."""
    (tmp_path / "t.txt").write_text("Grade <C>NONUM</C>, not {completion}")  # every answer unparseable
    with pytest.raises(SystemExit) as e:
        with common.user_errors():
            train_grpo.main(["--engine", "hf", "--steps", "2", "--prompts_per_step", "2", "--group_size", "2",
                             "--out_dir", str(tmp_path), "--wandb", "false", "--judge_url", double.url,
                             "--judge_model", MODEL, "--judge_prompt", str(tmp_path / "t.txt"),
                             "--on_nonfinite", "skip"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and "JudgeError: judge: 4 of 4 judgements of this step failed" in err[-1], err
