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
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

from rlmini import dist

OUTPUT_MARK = "```output"  # code format: the model asks for the last block's output (ToRA's stop word)
_BLOCK = re.compile(r"```([A-Za-z_][\w.-]*)[ \t]*\n(.*?)```", re.S)
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
STATS = ("turns", "calls", "errors", "timeouts", "seconds", "tool_tokens", "turn_limit")


@dataclass
class Result:
    """What one call returned to the model, and how it went."""
    text: str
    error: bool = False
    timed_out: bool = False
    seconds: float = 0.0


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


# ---------------------------------------------------------------------------------------------- the tools

_RUNNER = r'''
import ast, os, resource, sys
limit = int(os.environ["RLMINI_TOOL_MEMORY"])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
cpu = int(os.environ["RLMINI_TOOL_CPU"])
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 20, 64 << 20))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
scratch = os.path.realpath(os.getcwd())
forbidden = [os.path.realpath(p) for p in os.environ["RLMINI_TOOL_FORBIDDEN"].split(os.pathsep) if p]
REFUSED = {"os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.kill",
           "os.killpg", "subprocess.Popen", "pty.spawn", "os.chdir", "socket.connect", "socket.bind"}
WRITES = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.symlink", "os.link",
          "os.truncate", "os.utime", "shutil.rmtree", "shutil.move", "shutil.copyfile"}
def inside(path, root):
    path = os.path.realpath(path)
    return path == root or path.startswith(root + os.sep)
def guard(event, args):
    if event in REFUSED:
        raise PermissionError(f"{event} is not allowed in the python tool")
    if event in ("open", "os.listdir", "os.scandir") or event in WRITES:
        path = args[0] if args else None
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        if not isinstance(path, str):
            return
        mode, flags = (args[1], args[2]) if event == "open" else (None, 0)
        write = (event in WRITES or isinstance(mode, str) and any(c in mode for c in "wax+")
                 or isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC))
        if write and not inside(path, scratch) or any(inside(path, f) for f in forbidden):
            raise PermissionError(f"the python tool may not {'write' if write else 'read'} {path}")
source = sys.stdin.read()
sys.addaudithook(guard)
try:
    tree = ast.parse(source, "<tool>")
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    namespace = {"__name__": "__main__"}
    exec(compile(tree, "<tool>", "exec"), namespace)
    if last is not None:  # like a notebook cell: the value of a final expression is shown
        value = eval(compile(ast.Expression(last.value), "<tool>", "eval"), namespace)
        if value is not None:
            print(repr(value))
except BaseException as e:  # the traceback from the tool's own code on (none of this runner's frames)
    import traceback
    tb = e.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != "<tool>":
        tb = tb.tb_next
    lines = (traceback.format_exception(type(e), e, tb) if tb is not None
             else traceback.format_exception_only(type(e), e))
    sys.stdout.flush()
    sys.stderr.write("".join(lines))
    sys.exit(1)
'''


def python(code: str, box: "Toolbox") -> Result:
    """The built-in python tool: `code` in a fresh interpreter process (its own session, so the whole process
    group is killed at the end), in a scratch folder of its own that is removed afterwards, with an address-
    space limit, a CPU-time and a wall-clock limit, no fork/exec/kill, no writes outside the scratch folder
    and no reads of the run folder (an audit hook: a guard against accidents, not a security boundary
    against hostile code: run untrusted models in a container). Output (stdout and stderr) beyond a few times
    the kept length is not read; errors, time-outs and signals come back as the output."""
    start = time.perf_counter()
    scratch = tempfile.mkdtemp(prefix="rlmini-tool-")
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": scratch, "TMPDIR": scratch,
           "LANG": "C.UTF-8", "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "RLMINI_TOOL_MEMORY": str(box.memory_mb << 20),
           "RLMINI_TOOL_CPU": str(math.ceil(box.timeout) + 1),
           "RLMINI_TOOL_FORBIDDEN": os.pathsep.join(os.path.realpath(f) for f in box.forbidden)}
    cap = 4 * box.output_chars + 4096  # bytes read at most: megabytes of output are never held
    chunks, size, timed_out = [], 0, False
    try:
        proc = subprocess.Popen([sys.executable, "-I", "-c", _RUNNER], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=scratch, env=env,
                                start_new_session=True)
        try:
            proc.stdin.write(code.encode("utf-8", "replace"))
            proc.stdin.close()
        except BrokenPipeError:
            pass
        fd, deadline = proc.stdout.fileno(), start + box.timeout
        while True:
            left = deadline - time.perf_counter()
            if left <= 0:
                timed_out = True
                break
            if not select.select([fd], [], [], left)[0]:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            chunks.append(chunk[:max(cap - size, 0)])
            size += len(chunk)
            if size >= cap:  # enough to show: the rest is not read
                break
        _kill_group(proc)
        proc.stdout.close()
        status = proc.wait()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    text = b"".join(chunks).decode("utf-8", "replace")
    seconds = time.perf_counter() - start
    if timed_out or status == -signal.SIGXCPU:  # the wall clock, or the CPU-time limit behind it
        return Result(_cut(text, box.output_chars) + "\n" + _timeout_text(box), True, True, seconds)
    if status < 0 and size < cap:
        name = signal.Signals(-status).name if -status in signal.Signals._value2member_map_ else str(-status)
        return Result(_cut(text, box.output_chars) + f"\nthe process was killed by {name}", True, False,
                      seconds)
    return Result(_cut(text, box.output_chars, size if size >= cap else None),
                  status not in (0, None) and size < cap, False, seconds)


def _kill_group(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the process and anything it started in its session
    except (ProcessLookupError, PermissionError):
        pass


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
    """The run's Toolbox from --tools (python, calculator, module:function for the user's own; empty: none)
    and the --tool_* options; None without tools. Chat format: the template must render tool definitions."""
    from rewards import DataError, import_function
    names = [x.strip() for x in args.tools.split(",") if x.strip()]
    if not names:
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
    box = Toolbox(tools, args.tool_format, args.max_turns, args.tool_timeout, args.tool_memory_mb,
                  args.tool_output_chars, args.tool_workers, [run_dir] if run_dir else [], schemas)
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


def run_call(box: Toolbox, name: str, arguments) -> Result:
    """One call: the tool's output, or the error or time-out as text, never an exception."""
    start = time.perf_counter()
    fn = box.tools.get(name)
    if fn is None:
        return Result(f"error: no tool named {name!r} (tools: {', '.join(box.tools)})", True)
    if fn is python:
        code = arguments if isinstance(arguments, str) else arguments.get("code", "")
        return python(code if isinstance(code, str) else str(code), box)
    try:
        out = fn(arguments) if isinstance(arguments, str) else fn(**arguments)
        result = Result(_cut(str(out), box.output_chars), False, False, time.perf_counter() - start)
    except Exception as e:  # the tool's failure is the model's observation
        result = Result(_cut(f"{type(e).__name__}: {e}", box.output_chars), True, False,
                        time.perf_counter() - start)
    if result.seconds > box.timeout:  # a function cannot be stopped; its late output is not shown
        return Result(_timeout_text(box), True, True, result.seconds)
    return result


def _timeout_text(box) -> str:
    return f"TimeoutError: the call ran past {box.timeout:g} s and was stopped"


def run_calls(box: Toolbox, calls: list) -> list:
    """[(name, arguments)] -> [Result], `box.workers` at a time, in daemon threads: a function tool (the
    user's, the calculator) that never returns is reported as timed out when the batch's deadline passes and
    its thread is abandoned (it cannot hold the run at exit)."""
    results, gate = [None] * len(calls), threading.BoundedSemaphore(box.workers)

    def work(k, name, arguments):
        with gate:
            results[k] = run_call(box, name, arguments)

    threads = [threading.Thread(target=work, args=(k, *c), daemon=True) for k, c in enumerate(calls)]
    for t in threads:
        t.start()
    deadline = time.perf_counter() + math.ceil(len(calls) / box.workers) * (box.timeout + 1) + 1
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.perf_counter()))
    return [r if r is not None else Result(_timeout_text(box), True, True, box.timeout) for r in results]


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
             seed: int):
    """n trajectories per prompt. Without tools: engine.generate. With: turn 0 samples n per prompt (stopping
    at a call); each later turn continues every live trajectory from its token ids (vLLM: one batch, prefix
    cache), with what is left of the length budget. Returns Rollouts with policy_mask and tool_stats."""
    if box is None:
        return engine.generate(prompt_ids, n, max_new_tokens, temperature, seed)
    from rlmini.data import Rollouts  # data imports this module
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
            found = _calls(box, tokenizer, prompts[i], ids[i], toks, r.finished[k])
            if not found:
                continue
            if turn + 1 == box.max_turns:  # the turn limit: the call is not run, the trajectory ends
                stats[i]["turn_limit"] = 1
                finished[i] = False
            elif len(ids[i]) < max_new_tokens:  # at the length limit a call has no room for its output
                calls.append((i, found))
                finished[i] = False
        flat = [c for _, found in calls for c in found if not isinstance(c, str)]
        results = iter(run_calls(box, flat))
        live = []
        for i, found in calls:
            out = [Result(c, True) if isinstance(c, str) else next(results) for c in found]
            names = [c[0] if not isinstance(c, str) else "error" for c in found]
            s = stats[i]
            s["calls"] += len(out)
            s["errors"] += sum(o.error for o in out)
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
        if (dist.all_sum(float(len(live))) if dist.many_ranks() else len(live)) == 0:
            break  # no rank has a trajectory left to continue
    return Rollouts(prompts, ids, logps, finished, engine.pad_id, masks, stats)


def _calls(box, tokenizer, prompt: list, ids: list, turn: list, ended: bool) -> list:
    """The calls a turn ends with: code format, at most one (the turn stopped at ```output); chat format,
    every <tool_call> of a turn the model ended itself."""
    if box.fmt == "code":
        if ended or OUTPUT_MARK not in tokenizer.decode(turn[-len(OUTPUT_MARK) - 2:]):
            return []
        # the block may open in the prompt or an earlier turn: the text up to here, for parsing only
        call = parse_code_call(tokenizer.decode(prompt + ids))
        return [call] if call is not None else []
    if not ended or tokenizer.decode(turn[-1:]) != box.turn_end:  # another EOS ends the trajectory
        return []
    return parse_chat_calls(tokenizer.decode(turn))


def _response_ids(box, tokenizer, results: list) -> list:
    """The tool output's tokens, tokenised once and appended after the sampled ones."""
    if box.fmt == "code":
        text = "\n" + "\n".join(t for _, t in results).rstrip("\n") + "\n```\n"
    else:
        text = turn_suffix(tokenizer, box, results, box.turn_end)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def turns_text(tokenizer, ids: list, mask: list) -> list:
    """[{"role": "policy" | "tool", "text"}] of a trajectory, its runs of policy and tool tokens in order
    (--log_completions)."""
    out, start = [], 0
    for k in range(1, len(ids) + 1):
        if k == len(ids) or mask[k] != mask[start]:
            out.append({"role": "policy" if mask[start] else "tool",
                        "text": tokenizer.decode(ids[start:k], skip_special_tokens=True)})
            start = k
    return out


def policy_text(tokenizer, ids: list, mask: list) -> str:
    """What a verifier reads: the policy's own turns joined by line breaks (tool output left out, so that a
    tool cannot write the answer)."""
    return "\n".join(t["text"] for t in turns_text(tokenizer, ids, mask) if t["role"] == "policy")
