"""Guards and user errors: a non-finite reward, loss or gradient stops the run (or skips the update), rollouts
that did not come from the policy stop it, a collapsed policy is warned about, and bad input ends in one line
naming it (exit 2) instead of a traceback; Ctrl-C ends in one line saying how to continue (exit 130); a reward
call that never returns ends the process (deadline)."""
import contextlib
import faulthandler
import math
import os
import shlex
import signal
import sys
import threading
import time

import torch

from rlmini import dist, quiet
from rlmini.task import DataError


def in_chain(e: BaseException, match):
    """The first exception of e's chain (e, then each one's __cause__ or __context__) that `match` accepts, or
    None: a library may re-raise the error that matters as another type (vLLM's start-up, torch.save)."""
    seen = set()
    while e is not None and id(e) not in seen:
        if match(e):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


class NonFiniteError(RuntimeError):
    """A NaN or infinite reward, loss or gradient norm, with --on_nonfinite stop."""


class RolloutMismatchError(RuntimeError):
    """The trainer does not reproduce the sampler's log-probs: the rollouts came from another policy."""


class ServerError(RuntimeError):
    """--engine server: the server is unreachable, answered an error, or is not the one the trainer needs."""


class EngineStateError(RuntimeError):
    """The engine was asked to generate while asleep (between run.engine.sleep() and its push)."""


class PushError(RuntimeError):
    """A weight push did not take effect: the engine does not reproduce the trainer on the probe."""


class JudgeError(RuntimeError):
    """--judge_url: judgements failed beyond --judge_on_error's policy (rlmini/judge.py)."""


_WATCH = {"cond": threading.Condition(), "until": None, "what": "", "seconds": 0.0, "thread": None}
BACKSTOP_S = 10.0  # faulthandler's C timer, this long past a deadline: for a call that holds the GIL


@contextlib.contextmanager
def deadline(seconds: float, what: str):
    """Past `seconds` the process ends (status 2) with one line naming `what`: a running Python call, or a
    forward inside FSDP's collectives, cannot be cancelled, and waiting would hang the run. Under torchrun
    the agent then stops the other ranks (torch/distributed/elastic/agent/server/api.py::
    SimpleElasticAgent._invoke_run). One watchdog thread serves every call (arming it takes a lock, not a
    thread); a call that holds the GIL (a regex backtracking in C) keeps that thread from running, so
    faulthandler's C timer ends the process BACKSTOP_S later, printing where it hung (status 1). os._exit
    skips atexit (an --env's close(), wandb's finish); checkpoints are written whole or not at all."""
    w = _WATCH
    with w["cond"]:
        if w["thread"] is None:
            w["thread"] = threading.Thread(target=_watch, daemon=True, name="rlmini-deadline")
            w["thread"].start()
        w.update(until=time.monotonic() + seconds, what=what, seconds=seconds)
        w["cond"].notify()
    out = _fault_file()
    if out is not None:  # a notebook's or pytest's stderr has no descriptor: no backstop there
        faulthandler.dump_traceback_later(seconds + BACKSTOP_S, exit=True, file=out)
    try:
        yield
    finally:
        if out is not None:
            faulthandler.cancel_dump_traceback_later()
        with w["cond"]:
            w["until"] = None


def _fault_file():
    """Where faulthandler writes: stderr, else the process's own, when it has a file descriptor; else None."""
    for stream in (sys.stderr, sys.__stderr__):
        try:
            stream.fileno()
            return stream
        except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both of the last two
            continue
    return None


def _watch() -> None:
    w = _WATCH
    with w["cond"]:
        while w["until"] is None or time.monotonic() < w["until"]:
            w["cond"].wait(None if w["until"] is None else w["until"] - time.monotonic())
        print(f"error: {w['what']}: no answer within --reward_timeout {w['seconds']:g} s; a running call "
              f"cannot be cancelled, so the run ends here (its last checkpoint is intact)", file=sys.stderr,
              flush=True)
        os._exit(2)


os.register_at_fork(after_in_child=lambda: _WATCH.update(cond=threading.Condition(), until=None, thread=None))


def check_rewards(rewards, examples: list, group_size: int, step: int, on_nonfinite: str, scores: list = (),
                  names: list = ()) -> None:
    """Every reward finite, or the run stops naming the first bad one (its prompt, its value, and the --reward
    function behind it when one is: Score.failed); with --on_nonfinite skip one warning line names it, and
    the step's update is skipped by the gradient guard (a NaN reward makes its group's advantages, the loss
    and the gradient NaN). A --reward function (of `names`) that raised on every completion of the step
    scores nothing: the run stops whatever --on_nonfinite. Every rank decides alike, on global counts."""
    bad = (~torch.isfinite(rewards)).nonzero().flatten().tolist()
    raised = {f"raised/{n}": sum(any(f[:2] == (n, "raised") for f in s.failed) for s in scores)
              for n in names}
    counts = dist.all_sum({"bad": len(bad), "n": len(rewards), **raised})
    if not counts["bad"]:
        return
    first = None
    if bad:
        k = bad[0]
        why = (scores[k].failed[0][2] if k < len(scores) and scores[k].failed else
               "from the task's reward, --reward, --env's get_reward, --format_weight or the overlong "
               "penalty")
        first = (f"the first {rewards[k].item()} for completion {k % group_size + 1} of prompt "
                 f"{str(examples[k // group_size]['prompt'])[:80]!r} ({why})")
    first = next(m for m in dist.all_gather_objects([first]) if m)  # the lowest rank's: one line, all ranks
    msg = f"step {step}: {int(counts['bad'])} non-finite reward(s), {first}"
    every = [n for n in names if counts[f"raised/{n}"] == counts["n"]]
    if every:
        raise NonFiniteError(f"{msg}; --reward {every[0]} raised on all {int(counts['n'])} completions of "
                             f"the step: a reward that scores nothing stops the run, whatever --on_nonfinite")
    if on_nonfinite == "stop":
        raise NonFiniteError(f"{msg}; stopped (--on_nonfinite skip would skip the update)")
    if dist.rank() == 0:
        print(f"warning: {msg}; the update of this step is skipped", file=sys.stderr)


def check_skipped(run, stats, steps: int = 5) -> None:
    """Stop (status 2) when every update of `steps` steps in a row was skipped for a NaN/inf reward, loss or
    gradient (--on_nonfinite skip): such a run trains nothing and would otherwise end with status 0. A step
    with nothing to update (no update tried) neither counts nor breaks the streak."""
    if stats.skipped and not stats.updates:
        run.skipped_steps += 1
    elif stats.updates:
        run.skipped_steps = 0
    if run.skipped_steps >= steps:
        raise NonFiniteError(f"step {run.step}: every update of the last {steps} steps was skipped (a "
                             f"NaN/inf reward, loss or gradient: the warnings above name it); the run trains "
                             f"nothing, so it stops (--on_nonfinite skip skips single updates only)")


def nonfinite(value: float, what: str, step: int, on_nonfinite: str) -> bool:
    """True when `value` (the same on every rank: a global norm or sum) is NaN or infinite and --on_nonfinite
    is skip (the caller skips the update); raises NonFiniteError with --on_nonfinite stop. False if finite."""
    if math.isfinite(value):
        return False
    msg = f"step {step}: the {what} is {value}"
    if on_nonfinite == "stop":
        raise NonFiniteError(f"{msg}; stopped before the optimizer step, so the weights and the last "
                             f"checkpoint are finite (lower --lr, keep --grad_clip on; --on_nonfinite skip "
                             f"skips such updates)")
    if dist.rank() == 0:
        print(f"warning: {msg}; this update is skipped (--on_nonfinite skip)", file=sys.stderr)
    return True


def default_sampler_diff_tol(dtype) -> float:
    """Mean |sampler - trainer| log-prob of sampled tokens beyond which a step is broken, not noisy: fp32
    engines agree to ~1e-7 (HF and vLLM on CPU); in bf16 vLLM and the trainer differed by 1.4e-3 here (CPU,
    tiny model), more with GPU kernels and long completions; stale weights by 0.1 and up."""
    return 1e-3 if dtype == torch.float32 else 0.1


def check_sampler_diff(diff: float, step: int, tol: float) -> None:
    """The per-step guard: the trainer recomputes the log-prob of every sampled token; if the mean difference
    to the sampler's values is beyond `tol` the rollouts did not come from this policy."""
    if not diff <= tol:  # NaN fails too
        raise RolloutMismatchError(
            f"step {step}: the trainer's log-probs of the sampled tokens differ from the sampler's by "
            f"{diff:.4g} on average (> --sampler_diff_tol {tol:.3g}). The rollouts did not come from the "
            f"policy being trained. Likely causes: vLLM sampled from stale or discarded weights (a weight "
            f"push that did not take effect; an engine woken from sleep level 2 without a push), a different "
            f"dtype or temperature in the engine and the trainer, or a tokenizer/chat-template mismatch. "
            f"Nothing of this step was saved.")


def warn_on_collapse(run, metrics: dict, steps: int = 5) -> None:
    """Warn once per streak when the policy has had no gradient, or an entropy at its floor, for `steps` steps
    in a row: a collapsed policy (an --lr far too high) or a reward that never varies trains on and learns
    nothing, silently. A step that computed nothing (a filter kept no completion: no entropy) neither counts
    nor breaks the streak."""
    if "entropy" not in metrics:
        return
    grad_norm = metrics.get("grad_norm", float("nan"))  # absent: every update was skipped (not quiet)
    quiet = grad_norm < 1e-12 or metrics["entropy"] < 1e-4
    run.quiet_steps = run.quiet_steps + 1 if quiet else 0
    if run.quiet_steps == steps and dist.rank() == 0:
        print(f"warning: step {run.step}: no learning signal for {steps} steps (grad_norm "
              f"{grad_norm:.3g}, entropy {metrics['entropy']:.3g}, reward/mean "
              f"{metrics['reward/mean']:.3g}): the policy may have collapsed (--lr {run.args.lr} too high?) "
              f"or every group's rewards are equal", file=sys.stderr)


# ---------------------------------------------------------------------------------------------- Ctrl-C

REFUSED = 2  # every one-line refusal of bad input (options, files, models, tasks, data); 1: a traceback
INTERRUPTED = 130  # the shell's status for a process ended by SIGINT (128 + 2)
_WATCHED = {}  # what an interrupt closes and reports (startup.build, eval.py: watch)


def watch(run=None, describe=None) -> None:
    """From now on a Ctrl-C closes `run`'s engine, environments and log, and prints `describe()` (default:
    interrupt_line, a trainer's); watch() forgets both."""
    _WATCHED.clear()
    _WATCHED.update(run=run, describe=describe)


def interrupted(argv: list) -> str:
    """Ctrl-C (SIGINT; under torchrun every rank gets it, and torchrun passes on a second, ignored from
    here on): the wandb run, the engine and the environments are closed (what they print still goes to the
    run's log: user_errors calls this inside the quiet scope); returns the one line rank 0 prints: the step
    it was in, the last checkpoint and the command that continues from it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the second SIGINT ends nothing half-closed
    run, describe = _WATCHED.pop("run", None), _WATCHED.pop("describe", None)
    try:
        line = describe() if describe is not None else interrupt_line(run, argv)
    except Exception as e:  # the line must not fail the close
        line = f"interrupted (Ctrl-C); run it again with: {rerun_command(argv)} ({type(e).__name__}: {e})"
    for name in ("log", "engine", "toolbox") if run is not None else ():
        part = getattr(run, name, None)
        with contextlib.suppress(Exception):  # closing what an interrupt cut short is best effort
            part.close(INTERRUPTED) if name == "log" else getattr(part, "close", lambda: None)()
    return line


def interrupt_line(run, argv: list) -> str:
    """'interrupted (Ctrl-C) in step 8 of 20; last checkpoint runs/x/checkpoint.pt (step 5); continue with:
    python train_grpo.py ... --resume true', or what to rerun when nothing was saved."""
    if run is None:
        return ("interrupted (Ctrl-C) during start-up, before step 1: nothing was trained; rerun the command "
                "(with --overwrite true if it made its run folder)")
    args, step = run.args, run.step
    if getattr(run.log, "last_step", step) < step:  # after run.step += 1: its evaluation, log or checkpoint
        step -= 1
    where = f"in step {step + 1} of {args.steps}" if step < args.steps else f"after step {step}, saving"
    command = rerun_command(argv, "--resume", "--overwrite")
    if getattr(run, "final", None):  # the end's saves were done: nothing of the run is lost
        kept = (f" and its checkpoint (step {run.checkpoint_step})" if run.checkpoint_step is not None
                else "")
        return f"interrupted (Ctrl-C) after the run finished: the model is saved in {run.final}{kept}"
    if run.checkpoint_step is None:
        every = {0: "only at the end", -1: "never"}.get(args.save_every, f"every {args.save_every} steps")
        return (f"interrupted (Ctrl-C) {where}; no checkpoint yet (--save_every {args.save_every}: "
                f"{every}); start again with: {command} --overwrite true")
    name = "checkpoint/" if dist.sharded() else "checkpoint.pt"
    return (f"interrupted (Ctrl-C) {where}; last checkpoint {os.path.join(run.run_dir, name)} (step "
            f"{run.checkpoint_step}); continue with: {command} --resume true")


def rerun_command(argv: list, *drop) -> str:
    """The command line that started this process (python or torchrun, the script, its flags but `drop`)."""
    return shlex.join([*_launcher(), *_without(argv, *drop)])


def _launcher() -> list:
    """How this process was started: python, or torchrun with its process counts."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return ["python"]
    local, world = int(os.environ.get("LOCAL_WORLD_SIZE", 1)), dist.world_size()
    nodes = [f"--nnodes={world // local}"] if world != local else []
    return ["torchrun", *nodes, f"--nproc_per_node={local}"]


def _without(argv: list, *flags) -> list:
    """argv without the boolean `flags` and their values (--resume, --resume true, --resume=true)."""
    out, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if a.split("=", 1)[0] in flags:
            nxt = argv[i + 1].lower() if i + 1 < len(argv) else ""
            skip = "=" not in a and nxt in ("true", "false", "yes", "no", "1", "0")
            continue
        out.append(a)
    return out


@contextlib.contextmanager
def user_errors():
    """A train_*.py entry point (and eval.py's): bad input (options, files, models, tasks, data), non-finite
    values and a failed guard (rollouts not from the policy, a weight push that did not take effect) end in
    one line naming the problem and exit status 2 (REFUSED), not a traceback (a traceback is for our bugs:
    1); Ctrl-C in one line saying how to continue, status 130 (interrupted). Within it common.setup moves
    the libraries' output to the run folder's log (rlmini/quiet.py), the terminal restored before an error
    is printed."""
    line = error = None
    previous, ignoring = signal.getsignal(signal.SIGINT), False  # the caller's handler (a notebook's)
    try:
        with quiet.entry_point():
            try:
                yield
            except KeyboardInterrupt:
                ignoring = True  # interrupted() ignores SIGINT from its first line on
                line = interrupted(sys.argv)  # closed inside the quiet scope: wandb's lines go to the log
    except (DataError, NonFiniteError) as e:
        error = f"error: {e}"
    except (RolloutMismatchError, PushError, EngineStateError, ServerError, JudgeError) as e:
        error = f"error: {type(e).__name__}: {e}"
    except KeyboardInterrupt:  # a second Ctrl-C, in the quiet scope's own end
        line = line or "interrupted (Ctrl-C)"
    except SystemExit as e:
        if not isinstance(e.code, str):  # exit(0), exit(2)
            raise
        error = e.code  # a refusal in one line (an option, a file, a model, a task): status 2
    finally:
        _WATCHED.clear()  # the run is over: nothing of it kept alive here
        # the caller's handler back (a notebook goes on); under torchrun its second SIGINT stays ignored
        if ignoring and previous is not None and "TORCHELASTIC_RUN_ID" not in os.environ:
            signal.signal(signal.SIGINT, previous)
    if error is not None:
        print(error, file=sys.stderr)
    if line is not None and dist.rank() == 0:  # after a Ctrl-C whose close failed too: how to continue
        print(line, file=sys.stderr, flush=True)
    if error is not None or line is not None:
        raise SystemExit(INTERRUPTED if line is not None else REFUSED)
