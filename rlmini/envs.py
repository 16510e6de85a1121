"""Environment classes (--env module:Class) in TRL's `environment_factory` contract, run by the multi-turn
tool loop (rlmini/tools.py), so that an environment written for TRL runs here unchanged
(docs/environments.md):

  - `Class()` takes no argument; instances are pooled, one per rollout in flight, and reused through `reset`
    (trl/trainer/grpo_trainer.py::GRPOTrainer._generate_and_score_completions: the pool, its cursor).
  - `reset(**example)` is called once per rollout with the example's columns; text it returns is appended to
    the prompt's last (user) message, with no separator, as TRL does.
  - Every public method but `reset`, `get_reward` and `close` is a tool: its JSON schema comes from its
    signature, type hints and Google-style docstring (transformers.utils.get_json_schema, what TRL's chat
    template rendering uses). A method may be `async`.
  - `get_reward()` (optional, may be `async`) is called once per rollout after it ends: the reward part `env`,
    weight 1 beside the task's reward (rlmini/reward_fns.py::with_reward_functions).
  - `close()` (optional; TRL never calls it) is called on every instance once, when the run ends.

Every call into an instance runs in a daemon thread with a deadline (--tool_timeout): an instance whose call
ran past it is discarded (its thread may still be running), never reset again nor asked for a reward. A call
that calls sys.exit fails as one that raises does ("called sys.exit(N)"), but a tool's ends the run too; a
KeyboardInterrupt in a call is raised again in the main thread."""
import asyncio
import atexit
import inspect
import json
import math
import sys
import threading

from rlmini.reward_fns import import_function
from rlmini.task import DataError, begun_reply

NOT_TOOLS = ("reset", "get_reward", "close")


class TimedOut:
    """The outcome of a job that did not finish before its deadline (bounded)."""


def bounded(jobs: list, workers: int, limit: float) -> list:
    """Run zero-argument callables in daemon threads, `workers` at a time, each allowed `limit` seconds: their
    return values, the exception a job raised (SystemExit too: `failure` names it), or TimedOut where it had
    not returned by the batch's deadline (its thread is abandoned: it cannot hold the process at exit). A job
    that raises KeyboardInterrupt ends the wait: it is raised again here, in the calling thread."""
    out, gate, lock = [TimedOut] * len(jobs), threading.BoundedSemaphore(workers), threading.Lock()
    left, interrupted, over = [len(jobs)], [], threading.Event()

    def work(k):
        with gate:
            try:
                out[k] = _result(jobs[k]())
            except BaseException as e:  # its outcome: left to the thread, sys.exit and Ctrl-C would pass for
                out[k] = e              # a hang (threading drops the one, prints the other's traceback)
                if isinstance(e, KeyboardInterrupt):
                    interrupted.append(k)
        with lock:
            left[0] -= 1
            if not left[0] or interrupted:
                over.set()

    for k in range(len(jobs)):
        threading.Thread(target=work, args=(k,), daemon=True).start()
    if jobs:
        over.wait(timeout=math.ceil(len(jobs) / workers) * (limit + 1) + 1)
    if interrupted:
        raise KeyboardInterrupt from None
    return list(out)


def failure(outcome, limit: str) -> str | None:
    """What went wrong in a bounded job, by its outcome, or None (it returned); `limit` names the deadline."""
    if outcome is TimedOut:
        return f"did not return within {limit}"
    if isinstance(outcome, SystemExit):
        return f"called sys.exit({'' if outcome.code is None else repr(outcome.code)})"
    return f"raised {type(outcome).__name__}: {outcome}" if isinstance(outcome, Exception) else None


def _result(value):
    """An `async` method's value: its coroutine run to the end in this (worker) thread."""
    return asyncio.run(value) if inspect.iscoroutine(value) else value


def with_observation(prompt, observation):
    """The prompt with reset's text appended: a text prompt's end, or a conversation's last message's content
    (trl/trainer/grpo_trainer.py::GRPOTrainer._generate_and_score_completions: `content + observation`)."""
    if observation is None:
        return prompt
    if isinstance(prompt, str):
        return prompt + observation
    prompt, begun = begun_reply(prompt)  # a reply begun: the observation goes to the message before it
    if not prompt:
        raise DataError("--env: a prompt that is only a begun assistant reply has no message to add reset's "
                        "text to")
    return prompt[:-1] + [{**prompt[-1], "content": prompt[-1]["content"] + observation}] + (
        [{"role": "assistant", "content": begun}] if begun else [])


class Pool:
    """--env's instances: the tools and schemas read from the class, instances lent one per rollout (begin)
    and taken back with their rewards (end), a hung one discarded; close() closes every instance once."""

    def __init__(self, spec: str, timeout: float, workers: int, on_nonfinite: str = "stop"):
        cls = import_function(spec, flag="--env")
        if not inspect.isclass(cls):
            raise SystemExit(f"--env {spec}: {getattr(cls, '__name__', cls)} is not a class")
        self.spec, self.cls, self.name = spec, cls, cls.__name__
        self.timeout, self.workers, self.on_nonfinite = timeout, workers, on_nonfinite
        self.limit = f"--tool_timeout {timeout:g} s"  # how a call's deadline is named in a failure
        if not callable(getattr(cls, "reset", None)):
            raise SystemExit(f"--env {spec}: the class {self.name} has no reset method (reset(**example) "
                             f"starts an episode; docs/environments.md)")
        # the class's functions, as TRL lists them (getmembers on an instance would evaluate properties)
        names = [n for n, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
                 if n not in NOT_TOOLS and not n.startswith("_")]
        if not names:
            raise SystemExit(f"--env {spec}: the class {self.name} exposes no tool (a public method other "
                             f"than {', '.join(NOT_TOOLS)})")
        self.lock, self.free, self.hung, self.closed = threading.Lock(), [], [], False
        self.instances = []  # every instance made: close() closes them all
        probe = self._new()  # built at start, like TRL's: a constructor that fails (a server down) stops here
        self.tools = {n: getattr(cls, n) for n in names}
        self.schemas = [self._schema(probe, n) for n in names]
        self.params = {n: list(inspect.signature(getattr(probe, n)).parameters.values()) for n in names}
        self.has_reward = callable(getattr(cls, "get_reward", None))
        self.free.append(probe)
        atexit.register(self.close)  # a run that stops early; the normal end closes through Toolbox.close

    def _schema(self, instance, name: str) -> dict:
        from transformers.utils import get_json_schema
        try:
            return get_json_schema(getattr(instance, name))
        except Exception as e:  # no docstring, an undocumented or untyped parameter: its message names it
            raise SystemExit(f"--env {self.spec}: the tool {self.name}.{name} has no JSON schema: "
                             f"{type(e).__name__}: {e}") from None

    def _new(self):
        made = bounded([self.cls], 1, max(self.timeout, 30.0))[0]  # a constructor may connect to a server
        what = failure(made, f"{max(self.timeout, 30.0):g} s")
        if what:
            raise SystemExit(f"--env {self.spec}: {self.name}() {what}")
        with self.lock:
            self.instances.append(made)
        return made

    # ------------------------------------------------------------------------------------------ episodes

    def begin(self, examples: list, n: int) -> tuple:
        """One instance per rollout (n per example), each reset with its example's columns: (instances,
        prompts, n per prompt). Prompts are per example (n) when every rollout of an example got the same text
        from reset, else per rollout (1)."""
        B = len(examples) * n
        with self.lock:
            lent, self.free = self.free[:B], self.free[B:]
        lent += [self._new() for _ in range(B - len(lent))]
        out = bounded([lambda k=k: lent[k].reset(**dict(examples[k // n])) for k in range(B)], self.workers,
                      self.timeout)
        bad = next((k for k, o in enumerate(out) if not (o is None or isinstance(o, str))), None)
        if bad is not None:
            o = out[bad]
            self.end(lent, rewards=False, lost=[k for k, x in enumerate(out) if x is TimedOut])
            what = failure(o, self.limit) or f"returned {type(o).__name__}, not text or None"
            raise DataError(f"--env {self.spec}: {self.name}.reset {what} (example "
                            f"{str(examples[bad // n].get('prompt'))[:60]!r})")
        prompts = [with_observation(examples[k // n]["prompt"], out[k]) for k in range(B)]
        if all(prompts[k] == prompts[k - k % n] for k in range(B)):
            return lent, prompts[::n], n
        return lent, prompts, 1

    def call(self, instance, name: str, arguments):
        """A tool call on the rollout's instance: chat format, the call's arguments; code format, the block's
        text as the method's one parameter (converted to its int/float/bool/str hint), or a JSON object of
        its parameters. Raises what the method raises (the tool loop returns it to the policy); sys.exit as a
        SystemExit naming the method, which ends the run."""
        if any(instance is h for h in self.hung):
            raise TimeoutError("the environment stopped answering: an earlier call ran past --tool_timeout")
        if isinstance(arguments, str):
            arguments = self._from_text(name, arguments)
        try:
            return _result(getattr(instance, name)(**arguments))
        except SystemExit as e:  # the environment ends the run (tools.run_calls raises it), not the episode
            raise SystemExit(f"--env {self.spec}: {self.name}.{name} {failure(e, self.limit)}") from None

    def _from_text(self, name: str, text: str) -> dict:
        params = self.params[name]
        if len(params) == 1:
            hint, value = params[0].annotation, text.strip()
            if hint in (int, float):
                value = hint(value)
            elif hint is bool:
                value = value.lower() in ("1", "true", "yes")
            return {params[0].name: value}
        if not params:
            return {}
        arguments = json.loads(text)
        if not isinstance(arguments, dict):
            raise ValueError(f"{name} takes {', '.join(p.name for p in params)}: write them as a JSON object")
        return arguments

    def discard(self, instance) -> None:
        """An instance whose call ran past its deadline: never lent again (close() still tries it)."""
        with self.lock:
            if not any(instance is h for h in self.hung):
                self.hung.append(instance)

    def end(self, lent: list, rewards: bool = True, lost: tuple = ()) -> list | None:
        """The rollouts are over: each instance's get_reward() (None for a discarded one, which gets 0 in the
        reward), then the instances back in the pool. A get_reward that raises, runs past --tool_timeout or
        returns no number stops the run naming it (--on_nonfinite skip: NaN, and the update is skipped)."""
        for k in lost:
            self.discard(lent[k])
        live = [k for k, inst in enumerate(lent) if not any(inst is h for h in self.hung)]
        values = None
        if rewards and self.has_reward:
            out = bounded([lambda k=k: lent[k].get_reward() for k in live], self.workers, self.timeout)
            values = [None] * len(lent)
            for k, o in zip(live, out):
                if o is TimedOut:
                    self.discard(lent[k])
                values[k] = self._reward(o)
        with self.lock:
            self.free += [inst for inst in lent if not any(inst is h for h in self.hung)]
        return values

    def _reward(self, o) -> float:
        try:
            value = float(o) if not isinstance(o, (str, bytes)) and hasattr(o, "__float__") else None
        except (TypeError, ValueError):
            value = None
        if value is not None and math.isfinite(value):
            return value
        what = failure(o, self.limit) or f"returned {o!r}, not a finite number"
        if isinstance(o, SystemExit):  # it scores nothing: the run stops, whatever --on_nonfinite
            raise DataError(f"--env {self.spec}: {self.name}.get_reward {what}")
        if self.on_nonfinite == "stop":
            raise DataError(f"--env {self.spec}: {self.name}.get_reward {what} (--on_nonfinite skip would "
                            f"skip such updates)")
        print(f"warning: --env {self.spec}: {self.name}.get_reward {what}; the reward is NaN and this update "
              f"is skipped", file=sys.stderr)
        return math.nan

    def close(self) -> None:
        """close() on every instance made, once (each bounded by --tool_timeout; a failure is a warning)."""
        with self.lock:
            if self.closed:
                return
            self.closed, instances = True, list(self.instances)
        closers = [getattr(inst, "close", None) for inst in instances]
        out = bounded([c for c in closers if callable(c)], self.workers, self.timeout)
        failed = [o for o in out if failure(o, self.limit)]
        if failed:
            first = failure(failed[0], self.limit)
            print(f"warning: --env {self.spec}: {len(failed)} of {len(out)} {self.name}.close() calls failed "
                  f"(the first {first})", file=sys.stderr)
