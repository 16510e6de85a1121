"""LLM judges: a reward read from an OpenAI-compatible server's answer to a grading prompt (docs/rewards.md,
"LLM judges").

make_judge(args, tokenizer) gives a batched reward function, fn(prompts=, completions=, examples=, finished=)
-> list[float] in [0, 1], or None without --judge_url. It is a plain (sync) function that runs its own
concurrency: one asyncio loop per call (asyncio.run; in a worker thread if the caller already runs a loop),
so no client outlives the loop it was made in. fn.step_metrics() returns this rank's sums since its last call.
A step's verdict (more than half failed: stop; every score on a 0-1 scale: warn) is over the global batch:
every rank calls the judge once per step, and the counts are summed over ranks (dist.all_sum), so every
rank decides alike. A JudgeError passes through rlmini/reward_fns.py::_call_batch and stops the run in one
line, whatever --on_nonfinite (a judge that fails scores nothing).

Client: the project's one, httpx2's AsyncClient (rlmini/httpclient.py: its retry rule and backoff). The
`openai` client (3.x, on httpx2) retries by its own rule (x-should-retry, 408, 409, 429, >= 500:
openai/_base_client.py::BaseClient._should_retry), out of the caller's sight; ours is the documented one
(timeouts, connection errors, 429 and 5xx, each retry counted), and the judge reads two endpoints' JSON
(/models, /chat/completions or /completions): the openai package would add its models and nothing used.
"""
import asyncio
import collections
import concurrent.futures
import math
import os
import re
import string
import sys
import time
from dataclasses import dataclass
from typing import Literal

from rlmini import dist, httpclient
from rlmini.datafiles import prompt_text
from rlmini.faults import JudgeError
from rlmini.options import arg
from rlmini.task import DataError, begun_reply

PROBE_S = 30.0     # the start-up probe's deadline
SLACK_S = 10.0     # the batch bound's slack beyond its requests' own deadlines
FIELDS = ("prompt", "completion", "answer", "scale")  # the template's own fields; an example's columns too

DEFAULT_TEMPLATE = """You are grading a response to a task.

Task:
{prompt}

Reference answer (may be empty):
{answer}

Response:
{completion}

Rate the response from 0 (wrong or useless) to {scale} (correct and complete). Give a one-sentence reason,
then the score alone as a number on the last line."""


@dataclass
class JudgeArgs:
    """The LLM judge's options (a mixin of common.Args; eval.py takes them as they are)."""
    judge_url: str = arg("", "an OpenAI-compatible server http://HOST:PORT/v1 that judges completions")
    judge_model: str = arg("", "the judge's model name on --judge_url ('' = the one model it serves)")
    judge_prompt: str = arg("", "template file: {prompt} {completion} {answer} {scale}, example columns")
    judge_api: Literal["chat", "completions"] = arg("chat", "endpoint: /chat/completions or /completions")
    judge_scale: float = arg(10.0, "--judge_parse last-number: the score's scale, 0..scale -> [0, 1]", gt=0)
    judge_parse: Literal["last-number", "rubric"] = arg(
        "last-number", "score: the last number / scale, or the share of numbered yes/no lines saying yes")
    judge_concurrency: int = arg(16, "judge requests in flight per rank", ge=1)
    judge_timeout: float = arg(60.0, "seconds one judge request may take", gt=0)
    judge_retries: int = arg(3, "retries of a request (timeout, connection error, 429, 5xx), backoff", ge=0)
    judge_on_error: Literal["worst", "stop"] = arg(
        "worst", "failed or unparseable judgement: score 0 and warn (stop if > half of a step), or stop")
    judge_api_key_env: str = arg("OPENAI_API_KEY", "the NAME of the environment variable holding the key")
    judge_max_tokens: int = arg(256, "the judge's answer budget in tokens", ge=1)
    judge_temperature: float = arg(0.0, "the judge's sampling temperature", ge=0)
    judge_cache: int = arg(100_000, "judgements kept in memory by their inputs (LRU; 0 = no cache)", ge=0)


def template_fields(template: str, where: str) -> set:
    """The {fields} of a judge template; SystemExit naming `where` if it does not parse or a field is not a
    plain name ({example.x}, {0})."""
    try:
        names = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as e:
        raise SystemExit(f"{where}: cannot parse the template ({e}; write a literal brace as {{{{ or }}}})")
    bad = sorted(n for n in names if not n.isidentifier())
    if bad:
        raise SystemExit(f"{where}: field {{{bad[0]}}} is not a name: use {{prompt}}, {{completion}}, "
                         f"{{answer}}, {{scale}} or an example column")
    return names


def check_fields(names: set, columns, where: str) -> None:
    """Every field is the template's own or a column of the task's examples; SystemExit naming the field."""
    unknown = sorted(names - set(FIELDS) - set(columns))
    if unknown:
        raise SystemExit(f"{where}: unknown field {{{unknown[0]}}} (known: {', '.join(FIELDS)}, and the "
                         f"examples' columns {', '.join(sorted(set(columns) - set(FIELDS))) or '(none)'})")


NUMBER = re.compile(r"(-?\d+(?:\.\d+)?)(?:\s*(?:/|out of)\s*\d+(?:\.\d+)?)?", re.IGNORECASE)
RUBRIC_ITEM = re.compile(r"^\s*\d+\s*[.):]\s*\**\s*(yes|no)\b", re.IGNORECASE | re.MULTILINE)


def parse_score(text: str, rule: str, scale: float) -> float | None:
    """The judge's answer as a score in [0, 1], None if it gives none. Text up to a closing </think> is the
    judge's reasoning and is skipped (an answer cut off inside it is refused before: _answer_text).
    last-number: the last number; "7/10" and "7 out of 10" read as 7; a value outside [0, scale] is no score
    (the judge used another scale: clamping would hide that). rubric: lines "1. yes" / "2) no"
    (case-insensitive), the share that say yes; no such line is no score."""
    text = text.rpartition("</think>")[2]
    if rule == "rubric":
        items = [x.lower() for x in RUBRIC_ITEM.findall(text)]
        return items.count("yes") / len(items) if items else None
    found = NUMBER.findall(text)
    if not found:
        return None
    value = float(found[-1])
    return value / scale if 0 <= value <= scale else None


class _Failed(Exception):
    """A request with no usable answer after its retries (its text says why)."""


class _CutOff(Exception):
    """An answer cut off before its verdict (its text says where): kept in the cache as the answer, scored as
    a parse failure."""


def _run(coro):
    """asyncio.run, in a worker thread when this thread already runs a loop (an async caller)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def _headers(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


async def _probe(url: str, headers: dict):
    async with httpclient.load("--judge_url").AsyncClient(headers=headers) as client:
        return await httpclient.asend(client, "GET", f"{url}/models", timeout=PROBE_S)


def probe(url: str, model: str, key: str, key_env: str) -> str:
    """The judge's model name, once the server at `url` answers GET /models within PROBE_S seconds and serves
    it ('' = the one model it serves); else SystemExit in one line."""
    try:
        r = _run(_probe(url, _headers(key)))
    except httpclient.NoAnswer as e:
        raise SystemExit(f"--judge_url {url}: no answer to GET {url}/models within {PROBE_S:g} s "
                         f"({httpclient.why(e.error)})") from None
    if r.status_code != 200:
        hint = f" (check the key in ${key_env})" if r.status_code in (401, 403) else ""
        raise SystemExit(f"--judge_url {url}: GET /models answered HTTP {r.status_code} "
                         f"{' '.join(r.text[:120].split())}{hint}")
    try:
        served = [m["id"] for m in r.json()["data"]]
    except (ValueError, KeyError, TypeError):
        raise SystemExit(f"--judge_url {url}: GET /models did not answer an OpenAI model list: "
                         f"{' '.join(r.text[:120].split())}") from None
    if model in served or (not model and len(served) == 1):
        return model or served[0]
    raise SystemExit(f"--judge_model {model!r}: {url} serves {', '.join(served) or 'no model'}"
                     f"{'' if model else ' (name one)'}")


class Judge:
    """The batched reward function (make_judge). State: the cache (an LRU dict of inputs -> the judge's
    answer text, or _CutOff) and this rank's counts since the last step_metrics()."""

    def __init__(self, args, model: str, template: str, key: str):
        self.a, self.model, self.template, self.key = args, model, template, key
        self.cache = collections.OrderedDict()
        self.counts = dict.fromkeys(("judge/calls", "judge/cache_hits", "judge/failures",
                                     "judge/parse_failures", "judge/unit_range", "judge/retries",
                                     "judge/latency_s"), 0.0)

    def step_metrics(self) -> dict:
        """This rank's sums since the last call (summed over ranks by the caller). The mean latency of a
        request (its retries and waits included) is judge/latency_s / judge/calls of the sums."""
        out, self.counts = self.counts, dict.fromkeys(self.counts, 0.0)
        return out

    def render(self, prompt, completion: str, example: dict) -> str:
        prompt, begun = begun_reply(prompt)  # a reply begun in the prompt is the completion's beginning
        values = {**example, "prompt": prompt_text(prompt), "completion": begun + completion,
                  "answer": example.get("answer") or "", "scale": f"{self.a.judge_scale:g}"}
        try:
            return self.template.format_map(values)
        except KeyError as e:
            raise DataError(f"--judge_prompt: field {{{e.args[0]}}} is not a column of the example with "
                            f"prompt {prompt_text(prompt)[:60]!r}") from None

    def __call__(self, prompts: list, completions: list, examples: list, finished: list) -> list:
        """The batch's scores. Every rank's call joins one all_sum of the step's counts, whatever happens to
        its own batch, so that the step's verdict is the global batch's and the same on every rank."""
        a, keys = self.a, []
        try:
            texts = [self.render(p, c, e) for p, c, e in zip(prompts, completions, examples)]
            keys = [(self.model, a.judge_api, t, a.judge_max_tokens, a.judge_temperature) for t in texts]
            answers, stopped = _run(self._batch(keys)), None
        except Exception as e:  # a template that cannot render, too: raised once the other ranks know
            answers, stopped = {}, e
        # unit range: a raw score in (0, 1] on a larger scale; 0 is the bottom of both, a sign of neither
        unit = 1 / a.judge_scale if a.judge_parse == "last-number" and a.judge_scale > 1 else -1.0
        step = dict.fromkeys(("judgements", "failures", "parse_failures", "scored", "at_most_unit",
                              "unit_range", "stopped"), 0)
        scores, first = [], None
        for key in keys if stopped is None else ():
            value, why = _verdict(answers[key], a)
            if value is None:
                step["failures" if isinstance(answers[key], _Failed) else "parse_failures"] += 1
                first = first or why
            else:
                step["scored"] += 1
                step["at_most_unit"] += value <= unit
                step["unit_range"] += 0 < value <= unit
            scores.append(0.0 if value is None else value)
        for kind in ("failures", "parse_failures", "unit_range"):
            self.counts[f"judge/{kind}"] += step[kind]
        step.update(judgements=len(keys), stopped=int(stopped is not None))
        total = {k: int(v) for k, v in dist.all_sum(step).items()}
        if stopped is not None:
            raise stopped
        if total["stopped"]:
            raise JudgeError("judge: another rank stopped this step's judgements (its error line says why)")
        bad, mine = total["failures"] + total["parse_failures"], step["failures"] + step["parse_failures"]
        first = first or "a judgement failed on another rank"
        if bad and a.judge_on_error == "stop":
            raise JudgeError(f"judge: {first}; stopped (--judge_on_error stop)")
        if bad * 2 > total["judgements"]:
            raise JudgeError(f"judge: {bad} of {total['judgements']} judgements of this step failed (more "
                             f"than half; {total['failures']} failed requests, {total['parse_failures']} "
                             f"unparseable answers); the first: {first}; stopped (check --judge_url, "
                             f"--judge_prompt, --judge_parse)")
        if mine:
            print(f"warning: judge: {mine} of {len(keys)} judgements scored 0, the worst value "
                  f"(--judge_on_error worst; {step['failures']} failed requests, {step['parse_failures']} "
                  f"unparseable answers); the first: {first}", file=sys.stderr)
        if total["unit_range"] and total["at_most_unit"] == total["scored"] and dist.rank() == 0:
            print(f"warning: judge: every score of this step lies in [0, 1] on --judge_scale "
                  f"{a.judge_scale:g} ({total['unit_range']} of {total['scored']} in (0, 1]), read as at "
                  f"most {unit:g}: a judge answering on a 0-1 scale needs --judge_scale 1, or a template "
                  f"asking for 0 to {a.judge_scale:g} (--judge_prompt)", file=sys.stderr)
        return scores

    async def _batch(self, keys: list) -> dict:
        """{key: answer text, _CutOff or _Failed} for the distinct keys; cached ones are not sent. With
        --judge_on_error stop the first failed request stops the batch (JudgeError), cancelling the others."""
        a, out = self.a, {}
        for key in dict.fromkeys(keys):
            if key in self.cache:
                self.cache.move_to_end(key)
                out[key] = self.cache[key]
        todo = [k for k in dict.fromkeys(keys) if k not in out]
        self.counts["judge/calls"] += len(todo)
        self.counts["judge/cache_hits"] += len(keys) - len(todo)
        if not todo:
            return out
        gate = asyncio.Semaphore(a.judge_concurrency)
        path = "/chat/completions" if a.judge_api == "chat" else "/completions"
        httpx2 = httpclient.load("--judge_url")
        limits = httpx2.Limits(max_connections=a.judge_concurrency)
        async with httpx2.AsyncClient(base_url=a.judge_url, headers=_headers(self.key),
                                      timeout=a.judge_timeout, limits=limits) as client:
            async def one(key):
                async with gate:
                    start = time.perf_counter()
                    try:
                        out[key] = await self._request(client, path, key)
                    except _CutOff as e:
                        out[key] = e
                    except _Failed as e:
                        out[key] = e
                        if a.judge_on_error == "stop":
                            raise JudgeError(f"judge: request failed: {e}; stopped (--judge_on_error stop)")
                    finally:
                        self.counts["judge/latency_s"] += time.perf_counter() - start
            # every request has its deadline; this bounds the batch even so (waves of `concurrency` requests)
            per_request = a.judge_timeout * (a.judge_retries + 1) + httpclient.BACKOFF_CAP_S * a.judge_retries
            bound = per_request * math.ceil(len(todo) / a.judge_concurrency) + SLACK_S
            tasks = [asyncio.create_task(one(k)) for k in todo]
            try:
                await asyncio.wait_for(asyncio.gather(*tasks), bound)
            except asyncio.TimeoutError:
                raise JudgeError(f"judge: {len(todo)} requests took more than {bound:g} s together") from None
            finally:
                for t in tasks:
                    t.cancel()
        for key in todo:
            if a.judge_cache and not isinstance(out[key], _Failed):  # a failure is asked again next time
                self.cache[key] = out[key]
                if len(self.cache) > a.judge_cache:
                    self.cache.popitem(last=False)
        return out

    async def _request(self, client, path: str, key: tuple) -> str:
        """The judge's answer text, by rlmini/httpclient.py's retry rule (timeouts, connection errors, 429 and
        5xx; each retry counted); _Failed after the last try or at once on another HTTP error or a malformed
        answer; _CutOff for an answer cut off before its verdict."""
        model, api, text, max_tokens, temperature = key
        body = {"model": model, "max_tokens": max_tokens, "temperature": temperature,
                **({"messages": [{"role": "user", "content": text}]} if api == "chat" else {"prompt": text})}
        tries = self.a.judge_retries + 1
        try:
            r = await httpclient.asend(client, "POST", path, json=body, timeout=self.a.judge_timeout,
                                       retries=self.a.judge_retries, on_retry=self._retried)
        except httpclient.NoAnswer as e:
            raise _Failed(str(e)) from None
        if r.status_code == 200:
            return _answer_text(r, api, max_tokens)
        raise _Failed(f"HTTP {r.status_code} {' '.join(r.text[:100].split())}"
                      f"{f' ({tries} tries)' if httpclient.retryable(r.status_code) else ''}")

    def _retried(self) -> None:
        self.counts["judge/retries"] += 1


def _answer_text(r, api: str, max_tokens: int) -> str:
    """The text of a judge's OpenAI answer; _Failed if it is none, _CutOff if it stops before its verdict:
    at the token budget (finish_reason "length", even with a number after the reasoning: the verdict may
    come later) or inside its reasoning (an unclosed <think>). A number in either is no verdict."""
    try:
        choice = r.json()["choices"][0]
        text = choice["message"]["content"] if api == "chat" else choice["text"]
        reason = choice.get("finish_reason")
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        raise _Failed(f"not an OpenAI completion: {' '.join(r.text[:100].split())}") from None
    start = repr(" ".join(str(text or "")[:80].split()))
    if reason == "length":
        raise _CutOff(f"cut off at --judge_max_tokens {max_tokens} (finish_reason length): {start}")
    if not isinstance(text, str):
        raise _Failed(f"no text in the answer: {' '.join(r.text[:100].split())}")
    if text.rfind("<think>") > text.rfind("</think>"):
        raise _CutOff(f"cut off inside its reasoning (unclosed <think>): {start}")
    return text


def _verdict(answer, a) -> tuple:
    """(score, '') of an answer of _batch's, or (None, why it gives none)."""
    if isinstance(answer, _Failed):
        return None, f"request failed: {answer}"
    if isinstance(answer, _CutOff):
        return None, f"the answer was {answer}"
    value = parse_score(answer, a.judge_parse, a.judge_scale)
    if value is None:
        return None, (f"no score in the answer {' '.join(answer[:80].split())!r} "
                      f"(--judge_parse {a.judge_parse})")
    return value, ""


def make_judge(args, tokenizer=None, columns=None) -> Judge | None:
    """The judge of --judge_url (None without it), probed at start-up; its template's fields checked against
    the examples' `columns` when given (a field missing from an example is named when it is scored).
    tokenizer: unused (the judge reads text; the policy's chat template is never the judge's)."""
    if not args.judge_url:
        return None
    if args.judge_prompt:
        if not os.path.isfile(args.judge_prompt):
            raise SystemExit(f"--judge_prompt {args.judge_prompt}: file not found")
        with open(args.judge_prompt) as f:
            template = f.read()
    else:
        template = DEFAULT_TEMPLATE
    where = f"--judge_prompt {args.judge_prompt or '(built-in)'}"
    names = template_fields(template, where)
    if "completion" not in names:
        raise SystemExit(f"{where}: the template has no {{completion}}: the judge would not see what it "
                         f"judges")
    if columns is not None:
        check_fields(names, columns, where)
    key = os.environ.get(args.judge_api_key_env, "")  # read here, kept on the judge only: never on args
    model = probe(args.judge_url.rstrip("/"), args.judge_model, key, args.judge_api_key_env)
    return Judge(args, model, template, key)
