"""The user's own reward functions (--reward module:function[,...] --reward_weights w[,...], docs/rewards.md):
importing them, calling each in its form (per completion or batched, sync or async), reading what it returns,
and the task they reward together with the verifier, an --env's get_reward, a reward model and a judge."""
import asyncio
import contextlib
import importlib
import importlib.util
import inspect
import math
import os
import sys
import traceback
from dataclasses import replace

from rlmini import faults
from rlmini.task import DataError, Score, Task


RESERVED_REWARD_NAMES = ("mean", "std", "correct", "format")  # reward/<these> are logged already


def import_function(item: str, flag: str = "--reward"):
    """The function named by `module:function` (an importable module, or a path to a .py file)."""
    module_name, sep, fn_name = item.rpartition(":")
    if not sep or not module_name or not fn_name:
        extra = " or 'task' (the task's own verifier)" if flag == "--reward" else ""
        raise DataError(f"{flag} {item!r}: expected module:function (e.g. my_module:my_function, "
                        f"path/to/file.py:my_function){extra}")
    try:
        if module_name.endswith(".py"):
            if not os.path.isfile(module_name):
                raise DataError(f"{flag} {item}: no such file {module_name}")
            spec = importlib.util.spec_from_file_location(os.path.basename(module_name)[:-3], module_name)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            # `python train_grpo.py` puts the script's folder first, not the cwd
            if os.getcwd() not in sys.path:
                sys.path.append(os.getcwd())
            module = importlib.import_module(module_name)
    except DataError:
        raise
    except Exception as e:  # a missing module, or an error inside it
        raise DataError(f"{flag} {item}: cannot import {module_name} ({type(e).__name__}: {e})") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise DataError(f"{flag} {item}: {module_name} has no function {fn_name!r} (it has: "
                        f"{', '.join(found)})")
    return fn


ENV_REWARD = "env"  # --reward's name for the --env class's get_reward (rlmini/envs.py)
SOURCES = {"rm": "--reward_model", "judge": "--judge_url"}  # reserved names bound by their own flags


def reward_functions(spec: str, weights: str, env_reward: bool = False, sources: dict | None = None) -> list:
    """[(name, function, None for the task's verifier or ENV_REWARD for --env's get_reward, weight)] from
    --reward and --reward_weights; with `env_reward` (an --env class with get_reward), `env` is added with
    weight 1 (beside 'task' when --reward is empty) unless --reward lists it, as TRL adds the environment's
    reward to its reward functions (trl/trainer/grpo_trainer.py::GRPOTrainer.__init__). `sources`: "rm" and
    "judge" bound to their batched callables (None: not given); with an empty --reward, those given replace
    the task's verifier as the reward (RLHF's setting), weight 1 each."""
    sources = {k: v for k, v in (sources or {}).items() if v is not None}
    items = [x.strip() for x in spec.split(",") if x.strip()]
    if weights.strip() and not items:  # the weights of rm, judge or env would be guessed, so name them
        raise DataError(f"--reward_weights {weights}: weights of --reward's functions, but --reward is empty "
                        f"(name them: --reward task,rm --reward_weights 1,0.5)")
    try:
        ws = [float(w) for w in weights.split(",")] if weights.strip() else [1.0] * len(items)
    except ValueError:
        raise DataError(f"--reward_weights {weights!r}: expected comma-separated numbers, e.g. "
                        "1,0.1") from None
    if len(ws) != len(items):
        raise DataError(f"--reward_weights {weights!r}: {len(ws)} weight(s) for {len(items)} reward "
                        f"function(s)")
    if not all(math.isfinite(w) for w in ws):
        raise DataError(f"--reward_weights {weights!r}: every weight must be a finite number")
    if ENV_REWARD in items and not env_reward:
        raise DataError(f"--reward {spec!r}: '{ENV_REWARD}' is the reward of an --env class with a "
                        f"get_reward method; there is none")
    for name, flag in SOURCES.items():
        if name in items and name not in sources:
            raise DataError(f"--reward {spec!r}: '{name}' is the score of {flag}; there is none (give "
                            f"{flag})")
    if not items and sources:
        items, ws = [n for n in SOURCES if n in sources], [1.0] * len(sources)
    if env_reward and ENV_REWARD not in items:
        items, ws = (items or ["task"]) + [ENV_REWARD], (ws or [1.0]) + [1.0]
    out, bound = [], ("task", ENV_REWARD, *SOURCES)
    for item, w in zip(items, ws):
        name = item if item in bound else item.rpartition(":")[2]
        if (name in RESERVED_REWARD_NAMES or name in [n for n, _, _ in out]
                or (name in bound and name != item)):
            raise DataError(f"--reward {spec!r}: the name {name!r} is taken (logged as reward/{name}); "
                            f"rename the function (reserved: {', '.join(RESERVED_REWARD_NAMES)}, env, rm, "
                            f"judge, and each name once)")
        fn = (None if item == "task" else ENV_REWARD if item == ENV_REWARD else sources[item]
              if item in SOURCES else import_function(item))
        out.append((name, fn, w))
    return out


def batched(fn) -> bool:
    """A batched reward function takes lists (f(prompts=, completions=, examples=, finished=), TRL's
    convention): told apart from the per-completion form by its parameters' plural names."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: the per-completion form
        return False
    return "completions" in params


_LOOP = None  # one event loop for every async reward function (a client made in it stays usable)
ASYNC_GRACE_S = 10.0  # the watchdog's slack past an async batch's own deadline (a call that blocks the loop)
F32_MAX = 3.4028234663852886e38  # the reward tensors are float32: a larger finite value becomes inf there


def run_async(coroutines: list, concurrency: int, timeout: float, what: str) -> list:
    """The coroutines' results, at most `concurrency` in flight, all within `timeout` seconds (else a
    DataError naming `what`); an exception (or a SystemExit) is returned in place of its result."""
    global _LOOP
    _LOOP = _LOOP or asyncio.new_event_loop()
    gate = asyncio.Semaphore(concurrency) if coroutines else None

    async def bounded(c):
        async with gate:
            try:
                return await c
            except SystemExit as e:  # asyncio re-raises it out of the loop, past return_exceptions
                return e

    async def every():
        return await asyncio.gather(*[bounded(c) for c in coroutines], return_exceptions=True)

    try:
        return _LOOP.run_until_complete(asyncio.wait_for(every(), timeout))
    except asyncio.TimeoutError:
        raise DataError(f"{what}: no answer within --reward_timeout {timeout:g} s") from None


def _origin(e: BaseException) -> str:
    """' (file.py:line)' where an exception was raised, for its one-line message."""
    tb = traceback.extract_tb(e.__traceback__)
    return f" ({os.path.basename(tb[-1].filename)}:{tb[-1].lineno})" if tb else ""


def _exited(e: SystemExit, at: str) -> DataError:
    return DataError(f"{at} called sys.exit({e.code!r}): a reward function returns a value; the run stops "
                     f"(whatever --on_nonfinite)")


def _batch_values(out, n: int, at: str) -> list:
    """A batched reward function's output as n values, or DataError in one line: the contract is one
    dimension of numbers as long as the batch (a list, a tuple, a 1-D numpy array or tensor); a mapping (its
    keys), a set (no order), a string (its characters) or more dimensions would otherwise train on garbage."""
    ndim = getattr(out, "ndim", None)
    sequence = isinstance(out, (list, tuple)) or ndim == 1
    if isinstance(out, (str, bytes, dict, set, frozenset)) or not sequence:
        what = f"{ndim}-D {type(out).__name__}" if ndim not in (None, 1) else type(out).__name__
        raise DataError(f"{at} returned a {what}: a batched reward function returns a list (or tuple, 1-D "
                        f"array) of {n} numbers, one per completion")
    if len(out) != n:
        raise DataError(f"{at} returned {len(out)} values: a batched reward function returns one value per "
                        f"completion ({n})")
    return [v.item() if hasattr(v, "item") and getattr(v, "ndim", 0) == 0 else v for v in out]


def _call_batch(name: str, fn, texts: list, examples: list, finished: list, concurrency: int,
                timeout: float) -> list:
    """One reward function's raw values over a batch (an exception in place of a value that raised), in
    whichever form it takes: per completion or batched, sync or async, under a watchdog of --reward_timeout
    (the judge bounds its own requests). What scores nothing stops the run whatever --on_nonfinite, in one
    line: a reward model or judge that fails, a batched function that raises, a sys.exit()."""
    who = SOURCES.get(name, f"--reward {name}")
    first = f" (first prompt {str(examples[0]['prompt'])[:60]!r})" if examples else ""
    at = f"{who} on a batch of {len(texts)}{first}"
    is_async = inspect.iscoroutinefunction(fn)
    # the judge bounds its own requests, the reward model its forwards (after its ranks met)
    guard = (contextlib.nullcontext() if name in SOURCES else
             faults.deadline(timeout + (ASYNC_GRACE_S if is_async else 0.0), at))
    if batched(fn):
        kw = dict(prompts=[e["prompt"] for e in examples], completions=texts, examples=examples,
                  finished=finished)
        try:
            with guard:
                out = run_async([fn(**kw)], 1, timeout, at)[0] if is_async else fn(**kw)
            if isinstance(out, BaseException):
                raise out
        except (DataError, faults.JudgeError):
            raise
        except SystemExit as e:
            raise _exited(e, at) from None
        except Exception as e:
            what = "failed" if name in SOURCES else "raised"
            raise DataError(f"{at} {what}: {type(e).__name__}: {e}{_origin(e)}; a reward that scores no "
                            f"completion stops the run (whatever --on_nonfinite)") from None
        return _batch_values(out, len(texts), at)
    calls = [dict(prompt=e["prompt"], completion=t, example=e, finished=f)
             for t, e, f in zip(texts, examples, finished)]
    with guard:
        if is_async:
            return run_async([fn(**kw) for kw in calls], concurrency, timeout, at)
        out = []
        for kw in calls:
            try:
                out.append(fn(**kw))
            except (Exception, SystemExit) as e:  # a SystemExit stops the run in value(), naming the prompt
                out.append(e)
        return out


def with_reward_functions(task: Task, spec: str, weights: str, env: str = "", sources: dict | None = None,
                          concurrency: int = 32, timeout: float = 300.0) -> Task:
    """The task, rewarded by sum_i w_i r_i over the --reward functions ('task' = the task's own verifier).
    A function is called per completion as f(prompt=, completion=, example=, finished=), or, batched, once
    per rank's batch as f(prompts=, completions=, examples=, finished=) -> list (batched()); either may be
    `async def`, run concurrently (at most `concurrency` calls in flight, all within `timeout` seconds; a
    sync call past it ends the run: faults.deadline). A value is a float or a Score (the first Score's
    correct/format_ok replace the verifier's: reward/correct and pass@k read them). A per-completion call
    that raises, or a value that is NaN, inf or beyond float32, makes the reward NaN and is named in
    Score.failed; faults.check_rewards then stops the run or, with --on_nonfinite skip, skips the step's
    update, and stops it anyway when one function raised on every completion of the step (all ranks).
    `env`: --env module:Class; one with get_reward adds its value, passed to the score as `env=`
    (data.py::score_rollouts; None for a discarded instance: 0). `sources`: {"rm": ..., "judge": ...},
    batched callables (None: absent), listed in --reward as rm and judge (reward_functions); a callable's
    optional step_metrics() is logged (reward_model.source_metrics)."""
    env_reward = bool(env) and callable(getattr(import_function(env, flag="--env"), "get_reward", None))
    sources = {k: v for k, v in (sources or {}).items() if v is not None}
    if not spec.strip() and not weights.strip() and not env_reward and not sources:
        return task
    fns, verifier = reward_functions(spec, weights, env_reward, sources), task.score

    def value(name: str, out, completion: str, example: dict) -> tuple:
        """(float, Score or None, None or (name, "raised" | "nonfinite", why)) of one raw value."""
        at = f"prompt {str(example['prompt'])[:60]!r}, completion {completion[:60]!r}"
        if isinstance(out, SystemExit):
            raise _exited(out, f"--reward {name} on {at}")
        if isinstance(out, Exception):
            why = f"--reward {name} raised {type(out).__name__}: {out}{_origin(out)} on {at}"
            return float("nan"), None, (name, "raised", why)
        outcome = out if isinstance(out, Score) else None
        out = out.reward if outcome is not None else out
        try:  # a str would parse; an array of two numbers or 10**400 would raise
            v = float(out) if not isinstance(out, (str, bytes)) and hasattr(out, "__float__") else None
        except (TypeError, ValueError, OverflowError):
            v = None
        if v is None:
            raise DataError(f"--reward {name} returned {type(out).__name__} {str(out)[:60]!r} on {at}: "
                            f"expected a float or a rewards.Score")
        if not abs(v) <= F32_MAX:  # NaN, inf, or a finite value float32 cannot hold
            beyond = ", beyond float32's range (the rewards' type)" if math.isfinite(v) else ""
            return v, outcome, (name, "nonfinite", f"--reward {name} returned {v:g}{beyond} on {at}")
        return v, outcome, None

    def combine(completion, example, finished, env, raw: dict) -> Score:
        """One completion's Score: its parts, unweighted, and their weighted sum, in --reward's order."""
        base, parts, outcome, failed = verifier(completion, example, finished), [], None, []
        for name, fn, w in fns:
            if fn is None or fn is ENV_REWARD:
                parts.append(base.reward if fn is None else 0.0 if env is None else env)
                continue
            out = raw[name] if name in raw else _call_batch(name, fn, [completion], [example], [finished],
                                                            concurrency, timeout)[0]
            v, got, why = value(name, out, completion, example)
            outcome, failed = outcome or got, failed + ([why] if why else [])
            parts.append(v)
        outcome = outcome or base
        return Score(sum(w * v for (_, _, w), v in zip(fns, parts)), outcome.correct, outcome.format_ok,
                     base.prob, outcome.pred, tuple(parts), error=base.error, failed=tuple(failed))

    def score(completion: str, example: dict, finished: bool, env: float | None = None) -> Score:
        return combine(completion, example, finished, env, {})

    # batched, async, rm and judge: evaluated once over the rank's batch; the rest per completion, as above
    at_once = [(name, fn) for name, fn, _ in fns if fn is not None and fn is not ENV_REWARD
               and (name in sources or batched(fn) or inspect.iscoroutinefunction(fn))]

    def score_batch(texts: list, examples: list, finished: list, envs: list) -> list:
        raw = {name: _call_batch(name, fn, texts, examples, finished, concurrency, timeout)
               for name, fn in at_once if texts or name in sources}  # rm: every rank joins its forwards
        return [combine(t, e, f, v, {name: r[k] for name, r in raw.items()})
                for k, (t, e, f, v) in enumerate(zip(texts, examples, finished, envs))]

    return replace(task, score=score, reward_names=[n for n, _, _ in fns],
                   score_batch=score_batch if at_once else None, sources=sources)
