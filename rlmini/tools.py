"""Tools and multi-turn rollouts: a completion may stop at a tool call; the call runs; its output is tokenised
once and appended; generation continues from the whole token sequence, until an answer, --max_turns or the
length limit (which counts every token, tool output included).

The trajectory is built from token ids only: the sampled tokens as sampled, each tool output tokenised once,
never the history decoded and re-encoded (that changes tokens at the boundaries, and the trainer would score
tokens the sampler never produced). `policy_mask` marks which tokens the policy sampled (1) and which a tool
wrote (0): the loss, the guard and every token statistic see the first kind only (packing.make_batch).

Two call formats:
  code  tool-integrated reasoning's convention (ToRA, Gou et al. 2024; Qwen2.5-Math): the model writes a
        fenced block (```python, or ```<tool>) and then ```output; generation stops there, the last block
        runs, and "\\n<output>\\n```\\n" is appended. Works for base models.
  chat  the chat template's own format: tool definitions rendered by the template, Hermes-style
        <tool_call>{"name": ..., "arguments": {...}}</tool_call> calls in a finished assistant turn, results
        appended as `tool` messages rendered by the template.
"""
import ast
import hashlib
import json
import math
import operator
import re
import secrets
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Literal

from rlmini import dist, envs, moe, sandbox
from rlmini.data import Rollouts
from rlmini.options import arg
from rlmini.reward_fns import import_function
from rlmini.task import OUTPUT_MARK, DataError


@dataclass
class ToolArgs:
    """--tools and --env options (docs/tools.md, docs/environments.md), in common.Args and eval.py's."""
    tools: str = arg("", "tools the policy may call: python, calculator, module:function[,...] (empty: none)")
    tool_format: Literal["code", "chat"] = arg(
        "code", "calls as ```python blocks then ```output (base models), or the chat template's tool calls")
    max_turns: int = arg(4, "--tools: generation turns per completion at most (calls + 1)", ge=1)
    tool_timeout: float = arg(5.0, "--tools: wall-clock (and CPU) seconds per call", gt=0)
    tool_memory_mb: int = arg(1024, "--tools: the python tool's memory limit (address space), MiB", ge=64)
    tool_output_chars: int = arg(2000, "--tools: a longer tool output is cut to this many characters", ge=1)
    tool_workers: int = arg(8, "--tools: calls running at once", ge=1)
    env: str = arg("", "an environment class, module:Class, in TRL's environment_factory contract")
    tool_sandbox: Literal["auto", "namespaces", "landlock", "none"] = arg(
        "auto", "--tools python: a call's confinement (docs/tools.md); auto: the strongest here, none: none")


_BLOCK = re.compile(r"```([A-Za-z_][\w.-]*)[ \t]*\n(.*?)```", re.S)
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
STATS = ("turns", "calls", "errors", "raised", "timeouts", "seconds", "tool_tokens", "turn_limit")


@dataclass
class Result:
    """What one call returned to the model, and how it went."""
    text: str
    error: bool = False
    timed_out: bool = False
    seconds: float = 0.0
    raised: bool = False  # the tool (a function, an --env method) raised an exception


@dataclass
class Toolbox:
    """The tools of a run and how calls are made and bounded (--tools and the --tool_* options)."""
    tools: dict                 # name -> function (str -> str in the code format, **arguments in chat)
    fmt: str = "code"           # "code" | "chat"
    max_turns: int = 4
    timeout: float = 5.0        # seconds of wall-clock (and CPU) time per call
    memory_mb: int = 1024       # the python tool's address-space limit
    output_chars: int = 2000    # a longer output is cut to this, with a note saying how much was cut
    workers: int = 8            # calls running at once
    forbidden: list = field(default_factory=list)  # folders the python tool may not read (the run's)
    schemas: list = field(default_factory=list)    # chat: the tool definitions the template renders
    turn_end: str = ""          # chat: the token text that ends an assistant turn in the template
    sandbox: str = "auto"       # the python tool's confinement (--tool_sandbox, rlmini/sandbox.py)
    scratch_root: str = ""      # where the python tool's scratch folders go (sandbox.scratch_parent)
    env: object = None          # --env: the environment class's instances (rlmini/envs.py::Pool)

    def close(self) -> None:
        """The run's end (common.finish, eval.py): --env's instances are closed."""
        if self.env is not None:
            self.env.close()


# ---------------------------------------------------------------------------------------------- the tools

def python(code: str, box: "Toolbox") -> Result:
    """The built-in python tool: `code` in a fresh interpreter process (its own session, so the whole process
    group is killed at the end) confined as --tool_sandbox says (rlmini/sandbox.py: namespaces, Landlock,
    seccomp, rlimits), in a scratch folder of its own that is removed afterwards, with address-space, CPU-time
    and wall-clock limits. Output (stdout and stderr) beyond a few times the kept length is not read; errors,
    time-outs, signals and the kernel's refusals come back as the output."""
    plan = sandbox.plan(box.sandbox)  # probed once per process, before the first call's clock starts
    start = time.perf_counter()
    scratch = tempfile.mkdtemp(prefix="call-", dir=box.scratch_root or sandbox.scratch_parent(""))
    config = sandbox.call_config(plan, scratch, box.memory_mb, box.timeout, box.forbidden)
    cap = 4 * box.output_chars + 4096  # bytes read at most: megabytes of output are never held
    try:
        out, size, status, timed_out = sandbox.run(code, config, box.timeout, cap)
    finally:
        sandbox.remove_tree(scratch)
    text = out.decode("utf-8", "replace")
    seconds = time.perf_counter() - start
    if timed_out or status == -signal.SIGXCPU:  # the wall clock, or the CPU-time limit behind it
        return Result(_cut(text, box.output_chars) + "\n" + _timeout_text(box), True, True, seconds)
    if status < 0 and size < cap:
        name = signal.Signals(-status).name if -status in signal.Signals._value2member_map_ else str(-status)
        return Result(_cut(text, box.output_chars) + f"\nthe process was killed by {name}", True, False,
                      seconds)
    return Result(_cut(text, box.output_chars, size if size >= cap else None),
                  status not in (0, None) and size < cap, False, seconds)


def _cut(text: str, chars: int, size: int | None = None) -> str:
    """At most `chars` characters: the first and the last half (an error's message is at its end), with a note
    of how much was cut (`size`: bytes produced, when more than `text` holds)."""
    if len(text) <= chars and (size is None or size <= len(text.encode())):
        return text
    total = f"{len(text)} characters" if size is None else f"at least {size} bytes"
    head = chars - chars // 2
    return (text[:head] + f"\n[output cut: {total}, the first {head} and the last {chars // 2} shown]\n"
            + text[len(text) - chars // 2:])


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
        ast.USub: operator.neg, ast.UAdd: operator.pos}
_FUNCS = {"sqrt": math.sqrt, "log": math.log, "exp": math.exp, "sin": math.sin, "cos": math.cos,
          "tan": math.tan, "abs": abs, "round": round, "floor": math.floor, "ceil": math.ceil,
          "factorial": math.factorial, "gcd": math.gcd, "comb": math.comb}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression: numbers, + - * / // % **, parentheses, pi, e and sqrt, log, exp,
    sin, cos, tan, abs, round, floor, ceil, factorial, gcd, comb.

    Args:
        expression: the expression, e.g. "37 * 48 % 7" or "sqrt(2) ** 2"
    """
    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.Name) and node.id in ("pi", "e"):
            return getattr(math, node.id)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and (abs(b) > 1000 or abs(a) > 1e6 and abs(b) > 10):
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](a, b)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCS
                and not node.keywords):
            args = [ev(a) for a in node.args]
            if node.func.id == "factorial" and args and args[0] > 1000:
                raise ValueError("factorial argument too large")
            return _FUNCS[node.func.id](*args)
        raise ValueError(f"not allowed in the calculator: {ast.unparse(node)}")
    return str(ev(ast.parse(expression.strip(), mode="eval")))


BUILT_IN = {"python": python, "calculator": calculator}
SCHEMAS = {
    "python": {"type": "function", "function": {
        "name": "python", "description": "Run Python code; the output (and a final expression's value) is "
                                         "returned.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string", "description":
                                                                  "the code to run"}},
                       "required": ["code"]}}},
}


def make_toolbox(args, run_dir: str = "", style: str = "tiny", tokenizer=None):
    """The run's Toolbox from --tools (python, calculator, module:function for the user's own; empty: none),
    --env's methods and the --tool_* options; None without tools. Chat format: the template must render tool
    definitions."""
    names = [x.strip() for x in args.tools.split(",") if x.strip()]
    if not names and not args.env:
        return None
    tools, schemas = {}, []
    for item in names:
        if item in BUILT_IN:
            name, fn = item, BUILT_IN[item]
        else:
            fn = import_function(item, flag="--tools")
            name = fn.__name__
        if name in tools:
            raise DataError(f"--tools {args.tools}: two tools are named {name!r}")
        tools[name] = fn
        if args.tool_format == "chat":
            schemas.append(_schema(name, fn, item))
    pool = envs.Pool(args.env, args.tool_timeout, args.tool_workers, args.on_nonfinite) if args.env else None
    for name, fn in (pool.tools.items() if pool else ()):
        if name in tools:
            raise DataError(f"--env {args.env}: its tool {name!r} has the name of a --tools tool")
        tools[name] = fn
    schemas += pool.schemas if pool and args.tool_format == "chat" else []
    box = Toolbox(tools, args.tool_format, args.max_turns, args.tool_timeout, args.tool_memory_mb,
                  args.tool_output_chars, args.tool_workers, [run_dir] if run_dir else [], schemas,
                  sandbox=args.tool_sandbox, env=pool)
    if python in tools.values():  # the confinement, said in one line, before any call runs
        if run_dir:
            sandbox.check_run_dir(run_dir)
        plan = sandbox.plan(args.tool_sandbox)
        if dist.rank() == 0:
            one = " in one process" if plan["mode"] != "none" else ""
            limits = f"a call: {args.tool_memory_mb} MiB of memory{one}, {args.tool_timeout:g} s"
            print(f"{plan['line']}; {limits}", file=sys.stderr, flush=True)
        box.scratch_root = sandbox.scratch_parent(run_dir, dist.rank())
    if args.tool_format == "chat":
        if style != "chat" or not getattr(tokenizer, "chat_template", None):
            raise SystemExit("--tool_format chat: the model has no chat template (the built-in tiny model "
                             "never does); use --tool_format code")
        box.turn_end = tokenizer.eos_token
        turn_suffix(tokenizer, box, [("python", "x")], box.turn_end)  # raises if tool messages do not render
        probe = [{"role": "user", "content": "u"}]
        plain, with_tools = (tokenizer.apply_chat_template(probe, tools=t, tokenize=False)
                             for t in (None, schemas))
        if plain == with_tools:
            raise SystemExit(f"--tool_format chat: the chat template of --model {args.model} does not render "
                             f"the tool definitions; use --tool_format code")
    return box


def _schema(name: str, fn, item: str) -> dict:
    if name in SCHEMAS:
        return SCHEMAS[name]
    from transformers.utils import get_json_schema
    try:
        return get_json_schema(fn)
    except Exception as e:  # no docstring, an undocumented or untyped argument
        raise SystemExit(f"--tools {item}: --tool_format chat needs a JSON schema, read from the function's "
                         f"type hints and Google-style docstring: {e}") from None


def run_call(box: Toolbox, name: str, arguments, instance=None) -> Result:
    """One call (an --env method on the rollout's `instance`): the tool's output, or the error or time-out as
    text, never an exception."""
    start = time.perf_counter()
    fn = box.tools.get(name)
    if fn is None:
        return Result(f"error: no tool named {name!r} (tools: {', '.join(box.tools)})", True)
    if fn is python:
        code = arguments if isinstance(arguments, str) else arguments.get("code", "")
        return python(code if isinstance(code, str) else str(code), box)
    try:
        if box.env is not None and name in box.env.tools:
            out = box.env.call(instance, name, arguments)
        else:
            try:
                out = fn(arguments) if isinstance(arguments, str) else fn(**arguments)
            except SystemExit as e:  # the run ends (run_calls raises it), in one line naming the tool
                raise SystemExit(f"--tools {name} {envs.failure(e, '')}") from None
        result = Result(_cut(str(out), box.output_chars), False, False, time.perf_counter() - start)
    except Exception as e:  # the tool's failure is the model's observation
        result = Result(_cut(f"{type(e).__name__}: {e}", box.output_chars), True, False,
                        time.perf_counter() - start, raised=True)
    if result.seconds > box.timeout:  # a function cannot be stopped; its late output is not shown
        return Result(_timeout_text(box), True, True, result.seconds)
    return result


def _timeout_text(box) -> str:
    return f"TimeoutError: the call ran past {box.timeout:g} s and was stopped"


def run_calls(box: Toolbox, calls: list, instances: list | None = None) -> list:
    """[(name, arguments)] -> [Result], `box.workers` at a time, in daemon threads (rlmini/envs.py::bounded);
    the calls on one --env instance (`instances`: per call, or None) in order, in one thread. A function tool
    (the user's, the calculator, an --env method) that never returns is reported as timed out when the
    batch's deadline passes and its thread is abandoned (it cannot hold the run at exit); its --env instance
    is discarded."""
    instances = instances or [None] * len(calls)
    jobs, results = {}, [None] * len(calls)
    for k, inst in enumerate(instances):  # one job per instance; each call without one, a job of its own
        jobs.setdefault(("call", k) if inst is None else ("env", id(inst)), []).append(k)

    def job(ks):
        for k in ks:
            results[k] = run_call(box, *calls[k], instances[k])

    longest = max((len(ks) for ks in jobs.values()), default=1)
    limit = longest * (box.timeout + 1) - 1  # one call each: --tool_timeout, as before --env
    outcomes = envs.bounded([lambda ks=ks: job(ks) for ks in jobs.values()], box.workers, limit)
    ended = [o for o in outcomes if isinstance(o, SystemExit)]  # sys.exit in a tool: the run ends here
    if ended:
        raise ended[0]
    results = [r if r is not None else Result(_timeout_text(box), True, True, box.timeout) for r in results]
    for r, inst in zip(results, instances):
        if r.timed_out and inst is not None:
            box.env.discard(inst)
    return [Result(clean_output(r.text), r.error, r.timed_out, r.seconds, r.raised) for r in results]


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def clean_output(text: str) -> str:
    """A tool's output as plain text: each control character but tab and line feed is written out as \\xNN
    (carriage returns, ANSI escapes, NUL reach the model as what they are, never as controls)."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


# ---------------------------------------------------------------------------------------------- call formats


def parse_code_call(text: str):
    """Code format: (tool, code) of the last fenced block before the final ```output, or an error string if
    the text asks for output without a closed block before it; None if it does not ask."""
    end = text.rfind(OUTPUT_MARK)
    if end < 0:
        return None
    blocks = [b for b in _BLOCK.finditer(text[:end]) if b.group(1) != "output"]  # not earlier outputs
    if not blocks:
        return "error: ```output without a ```python block before it"
    name, code = blocks[-1].group(1), blocks[-1].group(2)
    return ("python" if name in ("py", "python3") else name), code


def parse_chat_calls(text: str) -> list:
    """Chat format: [(name, arguments) or an error string] of each <tool_call> in the turn."""
    out = []
    for body in _TOOL_CALL.findall(text):
        try:
            call = json.loads(body)
            args = call.get("arguments", call.get("parameters", {}))
            args = json.loads(args) if isinstance(args, str) else args
            if not isinstance(call.get("name"), str) or not isinstance(args, dict):
                raise ValueError("needs a string 'name' and an object 'arguments'")
            out.append((call["name"], args))
        except (ValueError, AttributeError) as e:
            out.append(f"error: could not parse the tool call {body.strip()[:200]!r}: {e}")
    return out


def turn_suffix(tokenizer, box: Toolbox, results: list, end_text: str) -> str:
    """Chat format: the text the template puts after an assistant turn ending in `end_text` (the turn-end
    token the model sampled) for the tool messages `results` [(name, text)], up to the next assistant turn's
    opening. Rendered on a stand-in conversation, then cut after the stand-in assistant turn's end: the
    sampled history is never re-rendered."""
    mark = "rlmini-assistant-turn"
    convo = [{"role": "user", "content": "u"}, {"role": "assistant", "content": mark}]
    tools = [{"role": "tool", "name": name, "content": text} for name, text in results]
    try:
        full = tokenizer.apply_chat_template(convo + tools, tools=box.schemas or None, tokenize=False,
                                             add_generation_prompt=True)
    except Exception as e:
        raise SystemExit(f"--tool_format chat: the chat template cannot render tool messages: "
                         f"{type(e).__name__}: {e}") from None
    at = full.rfind(mark)
    end = full.find(end_text, at) if end_text and at >= 0 else -1
    if end < 0:
        raise SystemExit(f"--tool_format chat: the chat template does not end an assistant turn with "
                         f"{end_text!r}, the token the model ends its turns with")
    return full[end + len(end_text):]


# ---------------------------------------------------------------------------------------------- rollouts


def turn_seed(seed: int, turn: int) -> int:
    """The sampling seed of a continuation turn: distinct per (rollout seed, turn); turn 0 uses `seed`."""
    if turn == 0:
        return seed
    digest = hashlib.sha256(f"turn/{seed}/{turn}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFF_FFFF


def generate(engine, box, tokenizer, prompt_ids: list, n: int, max_new_tokens: int, temperature: float,
             seed: int, instances: list | None = None, routes: bool = False):
    """n trajectories per prompt. Without tools: engine.generate. With: turn 0 samples n per prompt (stopping
    at a call); each later turn continues every live trajectory from its token ids (vLLM: one batch, prefix
    cache), with what is left of the length budget. `instances`: per trajectory, the --env instance its
    calls go to. Returns Rollouts with policy_mask and tool_stats. `routes`: without tools, a mixture of
    experts' routes too (moe.ask; with tools --routing_replay is refused)."""
    if box is None:
        return engine.generate(prompt_ids, n, max_new_tokens, temperature, seed, **(moe.ask(engine) if routes
                                                                                    else {}))
    B = len(prompt_ids) * n
    prompts = [list(prompt_ids[i // n]) for i in range(B)]
    ids, logps, masks = [[] for _ in range(B)], [[] for _ in range(B)], [[] for _ in range(B)]
    stats = [dict.fromkeys(STATS, 0) for _ in range(B)]
    finished = [False] * B
    stop = [OUTPUT_MARK] if box.fmt == "code" else None
    live = list(range(B))
    for turn in range(box.max_turns):
        if turn == 0:
            r = engine.generate(prompt_ids, n, max_new_tokens, temperature, seed, stop=stop)
        else:  # a rank with nothing left still samples a stand-in: FSDP2's forwards are collectives
            r = engine.generate([prompts[i] + ids[i] for i in live] or [prompts[0]], 1,
                                [max_new_tokens - len(ids[i]) for i in live] or [1], temperature,
                                turn_seed(seed, turn), stop=stop)
        calls = []  # (trajectory, [(name, arguments) or an error string])
        for k, i in enumerate(live):
            toks = r.completion_ids[k]
            ids[i] += toks
            logps[i] += r.sampler_logprobs[k]
            masks[i] += [1] * len(toks)
            stats[i]["turns"] += 1
            finished[i] = r.finished[k]
            found = _calls(box, tokenizer, prompts[i], ids[i], masks[i], toks, r.finished[k])
            if not found:
                continue
            if turn + 1 == box.max_turns:  # the turn limit: the call is not run, the trajectory ends
                stats[i]["turn_limit"] = 1
                finished[i] = False
            elif len(ids[i]) < max_new_tokens:  # at the length limit a call has no room for its output
                calls.append((i, found))
                finished[i] = False
        flat = [(c, i) for i, found in calls for c in found if not isinstance(c, str)]
        results = iter(run_calls(box, [c for c, _ in flat], [instances[i] if instances else None
                                                             for _, i in flat]))
        live = []
        for i, found in calls:
            out = [Result(c, True) if isinstance(c, str) else next(results) for c in found]
            names = [c[0] if not isinstance(c, str) else "error" for c in found]
            s = stats[i]
            s["calls"] += len(out)
            s["errors"] += sum(o.error for o in out)
            s["raised"] += sum(o.raised for o in out)
            s["timeouts"] += sum(o.timed_out for o in out)
            s["seconds"] += sum(o.seconds for o in out)
            response = _response_ids(box, tokenizer, [(nm, o.text) for nm, o in zip(names, out)])
            response = response[:max_new_tokens - len(ids[i])]  # the length limit counts tool output too
            ids[i] += response
            logps[i] += [0.0] * len(response)
            masks[i] += [0] * len(response)
            s["tool_tokens"] += len(response)
            if len(ids[i]) < max_new_tokens:
                live.append(i)
        # the HF engine's forwards are collectives: every rank steps until none has a trajectory left; a
        # server's requests are not (and run in a background thread with --async_steps)
        lockstep = dist.many_ranks() and getattr(engine, "collective", True)
        if (dist.all_sum(float(len(live))) if lockstep else len(live)) == 0:
            break
    versions = [engine.pushes] * B if hasattr(engine, "pushes") else None  # one version: a push waits
    return Rollouts(prompts, ids, logps, finished, engine.pad_id, masks, stats, versions)


def _calls(box, tokenizer, prompt: list, ids: list, mask: list, turn: list, ended: bool) -> list:
    """The calls a turn ends with: code format, at most one (the turn stopped at ```output); chat format,
    every <tool_call> of a turn the model ended itself."""
    if box.fmt == "code":
        if ended or OUTPUT_MARK not in tokenizer.decode(turn[-len(OUTPUT_MARK) - 2:]):
            return []
        # the block may open in the prompt or an earlier turn: the prompt and the policy's turns, for parsing
        # only (a block a tool printed is never run)
        runs, start = [], 0
        for k in range(1, len(ids) + 1):
            if k == len(ids) or mask[k] != mask[start]:
                runs += [ids[start:k]] if mask[start] else []
                start = k
        text = "\n".join([tokenizer.decode(prompt + runs[0])] + [tokenizer.decode(r) for r in runs[1:]])
        call = parse_code_call(text)
        return [call] if call is not None else []
    if not ended or tokenizer.decode(turn[-1:]) != box.turn_end:  # another EOS ends the trajectory
        return []
    return parse_chat_calls(tokenizer.decode(turn))


def _response_ids(box, tokenizer, results: list) -> list:
    """The tool output's tokens, tokenised once and appended after the sampled ones. A tool's text is only
    ever text: a special token's string in it (`<|im_end|>`, `</s>`) is tokenised as ordinary characters, so
    it cannot end a turn or open a role; in the chat format only the template's own parts are special."""
    if box.fmt == "code":
        text = "\n" + "\n".join(t for _, t in results).rstrip("\n") + "\n```\n"
        return _text_ids(tokenizer, text)
    marks = [f"rlmini-tool-output-{k}-{secrets.token_hex(8)}" for k in range(len(results))]
    rendered = turn_suffix(tokenizer, box, [(name, m) for (name, _), m in zip(results, marks)], box.turn_end)
    pieces = re.split("(" + "|".join(marks) + ")", rendered)
    if [p for p in pieces if p in marks] != marks:  # the template rewrites a message's text: defuse instead
        specials = set(tokenizer.all_special_tokens) | set(getattr(tokenizer, "added_tokens_encoder", {}))
        safe = [(name, _defuse(text, sorted(specials, key=len, reverse=True))) for name, text in results]
        text = turn_suffix(tokenizer, box, safe, box.turn_end)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    ids, texts = [], dict(zip(marks, (t for _, t in results)))
    for piece in pieces:
        ids += (_text_ids(tokenizer, texts[piece]) if piece in texts
                else tokenizer(piece, add_special_tokens=False)["input_ids"]) if piece else []
    return ids


def _text_ids(tokenizer, text: str) -> list:
    return tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]


def _defuse(text: str, specials: list) -> str:
    """A special token's string broken by a word joiner (U+2060) after its first character."""
    for s in specials:
        if len(s) > 1:
            text = text.replace(s, s[0] + "\u2060" + s[1:])
    return text
