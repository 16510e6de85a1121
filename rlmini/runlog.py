"""What a run logs: metrics.jsonl (always), wandb (optional), rollouts.jsonl (sampled completions), a
progress bar or, without a terminal, a line every --print_every steps, and its start-up phases (startup)."""
import dataclasses
import datetime
import json
import math
import os
import secrets
import sys
import time

import torch

from rlmini import data, datafiles, dist, durable, quiet


class RunLog:
    """metrics.jsonl (always), wandb (optional), and a progress bar; rank 0 writes, the other ranks do
    nothing."""

    def __init__(self, args, run_dir: str, start_step: int, total: int, algo: str):
        # made last in common.setup: the engine's start-up phase ends here
        startup("engine", f" ({args.engine}: started, calibrated on a probe"
                          f"{', the checkpoint restored' if args.resume else ''})")
        status("first step: rollout")
        self.rank0 = dist.rank() == 0
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.wandb = None
        self.bar = None
        if not self.rank0:
            return
        # a resumed run rewrites the steps after its checkpoint, and says which
        dropped = {name: truncate_metrics(os.path.join(run_dir, name), start_step)
                   for name in ("metrics.jsonl", "rollouts.jsonl")}
        if args.resume:
            print(resume_line(run_dir, start_step, dropped), flush=True)
        config = {"algo": algo, "script": f"train_{algo}.py", "run_id": run_id(run_dir, args),
                  **dataclasses.asdict(args)}
        durable.write_text(os.path.join(run_dir, "config.json"), json.dumps(config, indent=2))
        if args.wandb:
            import wandb
            # WANDB_MODE, as wandb reads it, else online with a key and offline without
            key = os.environ.get("WANDB_API_KEY")
            mode = os.environ.get("WANDB_MODE") or ("online" if key else "offline")
            tags = [t.strip() for t in args.wandb_tags.split(",") if t.strip()]
            with quiet.to_log():  # its banner and notices: the run's log (on the terminal with --verbose)
                self.wandb = wandb.init(project=args.wandb_project, name=args.run_name, id=config["run_id"],
                                        group=args.wandb_group or None, tags=tags or None, config=config,
                                        dir=run_dir, mode=mode, resume="allow")
                where = (self.wandb.url if mode == "online" else "" if mode == "disabled" else
                         f"offline, in {os.path.dirname(self.wandb.dir)} (wandb sync uploads it)")
            if where:
                print(f"wandb run: {where}", flush=True)  # the one line of wandb's worth the terminal
        from tqdm import tqdm
        self.bar = tqdm(total=total, initial=start_step, dynamic_ncols=True, disable=not sys.stderr.isatty()
                        and not os.environ.get("RLMINI_PROGRESS"))
        # no terminal: a line every N steps
        self.print_every = 0 if not self.bar.disable else args.print_every
        self.start, self.start_step, self.total = time.perf_counter(), start_step, total
        self.last_step = start_step  # the last step logged (a Ctrl-C after run.step += 1 is still in it)

    def log(self, step: int, metrics: dict) -> None:
        self.last_step = step
        if not self.rank0:
            return
        row = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.wandb is not None:
            self.wandb.log(row, step=step)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(reward=f"{row.get('reward/mean', float('nan')):.3f}")
        if self.print_every and (step % self.print_every == 0 or step == self.total):
            seconds = (time.perf_counter() - self.start) / (step - self.start_step)
            print(progress_line(step, self.total, row, seconds), flush=True)

    def completions(self, step: int, rows: list) -> None:
        """rows (dicts, one per completion) to rollouts.jsonl and, with wandb, a Table keyed by the step."""
        if not self.rank0 or not rows:
            return
        with open(os.path.join(os.path.dirname(self.path), "rollouts.jsonl"), "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        if self.wandb is not None:
            import wandb
            columns = list(rows[0])
            cell = lambda v: v if isinstance(v, (str, int, float, bool)) else json.dumps(v)  # noqa: E731
            table = wandb.Table(columns=columns, data=[[cell(r[c]) for c in columns] for r in rows])
            self.wandb.log({"completions": table}, step=step)

    def close(self, exit_code: int = 0) -> None:
        """The bar closed, the summary line (not for an interrupted run: exit_code 130), wandb's run finished
        with `exit_code`."""
        if self.bar is not None:
            self.bar.close()
        if self.rank0 and os.path.exists(self.path) and not exit_code:
            print(summary_line(read_metrics(self.path)), flush=True)
        if self.wandb is not None:
            with quiet.to_log():  # its summary and sync notices
                self.wandb.finish(exit_code=exit_code)
            self.wandb = None


def run_id(run_dir: str, args) -> str:
    """The run folder's own id (the wandb run id), kept in its config.json: a resumed run keeps it, a new run
    or an --overwrite gets a fresh one, so two runs of one name in different out_dirs never share a wandb run.
    A folder written before ids existed keeps the name it was logged under."""
    path = os.path.join(run_dir, "config.json")
    if args.resume and os.path.exists(path):
        return json.load(open(path)).get("run_id") or args.run_name.replace("/", "-")
    return f"{args.run_name.replace('/', '-')}-{secrets.token_hex(4)}"  # the OS's randomness: no RNG consumed


def log_completions(run, examples: list, rollouts, reward_values, correct, fmt, advantages, n: int,
                    kept=None) -> None:
    """n completions of this step's global batch, drawn by a generator seeded with (seed, step), written by
    rank 0 to rollouts.jsonl (and wandb): step, prompt, completion, reward, correct, format, advantage (per
    completion; PPO: its tokens' mean; None: left out), length, truncated; with --tools, the turns (policy
    and tool text) and the trajectory's tool_stats; with `kept` (common.keep_completions), whether the
    update kept it. Every rank passes its own shard."""
    if n == 0:
        return
    B, G = len(rollouts.completion_ids), run.args.group_size
    total, first = int(dist.all_sum(B)), dist.rank() * B  # every rank holds B completions, in rank order
    draws = torch.Generator().manual_seed(run.args.seed * 1_000_003 + run.step)
    chosen = torch.randperm(total, generator=draws)
    rows = []
    for g in sorted(chosen[:n].tolist()):
        if first <= g < first + B:
            k = g - first
            example, completion = examples[k // G], rollouts.completion_ids[k]
            rows.append({"step": run.step, "index": g, "prompt": datafiles.prompt_text(example["prompt"]),
                         "answer": str(example.get("answer", "")),
                         "completion": run.tokenizer.decode(completion, skip_special_tokens=True),
                         "reward": float(reward_values[k]), "correct": float(correct[k]),
                         "format": float(fmt[k]),
                         **({"advantage": float(advantages[k])} if advantages is not None else {}),
                         "length": len(completion), "truncated": not rollouts.finished[k],
                         **({"kept": bool(kept[k])} if kept is not None else {})})
            if rollouts.policy_mask is not None:  # --tools: the policy's turns and the tools' outputs
                rows[-1]["turns"] = data.turns_text(run.tokenizer, completion, rollouts.policy_mask[k])
                rows[-1]["tool_stats"] = rollouts.tool_stats[k]
    run.log.completions(run.step, dist.all_gather_objects(rows))


def progress_line(step: int, total: int, row: dict, seconds_per_step: float) -> str:
    """One compact line for logs without a terminal: step, the key metrics, time per step and ETA."""
    keys = [("reward/mean", "reward"), ("reward/correct", "correct"), ("len/mean", "len"),
            ("entropy", "entropy"), ("kl", "kl"), ("grad_norm", "grad"), ("eval/pass@1", "eval pass@1")]
    parts = [f"{name} {row[k]:.3g}" for k, name in keys if k in row and math.isfinite(row[k])]
    eta = datetime.timedelta(seconds=round(seconds_per_step * (total - step)))
    return f"step {step}/{total} | " + " | ".join(parts) + f" | {seconds_per_step:.2f} s/step | ETA {eta}"


def summary_line(rows: list, last: int = 10) -> str:
    """The run in one line: the training reward (mean of the first and last `last` steps; in a run shorter
    than 2 `last` steps, of its first and last halves, never overlapping) beside the latest held-out pass@1
    (--eval_every): a rise on the training prompts alone may be memorisation."""
    reward = [r["reward/mean"] for r in rows if math.isfinite(r.get("reward/mean", math.nan))]
    if not reward:
        return "no step logged"
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    k = min(last, len(reward) // 2)
    if k == 0:
        text = f"training reward {reward[0]:.3f} (1 step)"
    else:
        of = "" if k == last else f" of {len(reward)}"
        text = (f"training reward {mean(reward[:k]):.3f} -> {mean(reward[-k:]):.3f} (first, last {k}{of} "
                f"steps)")
    held = [r for r in rows if "eval/pass@1" in r]
    if not held:
        return text + " | held-out pass@1: not evaluated (--eval_every N)"
    return text + f" | held-out pass@1 {held[-1]['eval/pass@1']:.3f} at step {held[-1]['step']}"


def truncate_metrics(path: str, start_step: int) -> list:
    """Keep the rows of steps up to start_step (a resumed run rewrites the later ones); returns the steps of
    the rows dropped. A torn last line (a crash in the middle of a write) is dropped; a bad line before it
    stops the run, naming it."""
    if not os.path.exists(path):
        return []
    rows = datafiles.read_jsonl_numbered(path, allow_empty=True, drop_torn_last=True)[0]
    dropped = [r["step"] for r in rows if r["step"] > start_step]
    durable.write_text(path, "".join(json.dumps(r) + "\n" for r in rows if r["step"] <= start_step))
    return dropped


def resume_line(run_dir: str, step: int, dropped: dict) -> str:
    """'--resume: runs/x continues from step 4 (its checkpoint); metrics.jsonl: dropped 2 rows (steps 5-6),
    logged after that checkpoint: they are trained again'."""
    line = f"--resume: {run_dir} continues from step {step} (its checkpoint)"
    for name, steps in dropped.items():
        if steps:
            span = f"step {steps[0]}" if min(steps) == max(steps) else f"steps {min(steps)}-{max(steps)}"
            line += f"; {name}: dropped {len(steps)} row{'s' * (len(steps) > 1)} ({span})"
    return line + ("; those steps are trained again" if any(dropped.values()) else "; nothing dropped")


def read_metrics(path: str) -> list:
    """The rows of a metrics.jsonl (or rollouts.jsonl); DataError naming the file and line of a bad one."""
    return datafiles.read_jsonl_numbered(path, allow_empty=True)[0]


_STARTUP = {"clock": None, "compiled": 0.0}  # the last phase's end, torch.compile's seconds by then


def compile_seconds() -> float:
    """Seconds torch.compile (dynamo, with its backend: inductor and Triton on CUDA) has spent in this
    process, from dynamo's own timer (torch/_dynamo/utils.py::compilation_time_metrics, the time of each
    _compile.compile_inner); 0 if nothing imported dynamo (importing it takes seconds)."""
    metrics = getattr(sys.modules.get("torch._dynamo.utils"), "compilation_time_metrics", {})
    return float(sum(metrics.get("_compile.compile_inner", [])))


def startup(phase: str = "", detail: str = "") -> None:
    """The start-up, one line per phase on rank 0 with its seconds and torch.compile's share of them (a first
    compile on a fresh machine can take a minute): `phase` ended now. No phase: the clock starts
    (common.setup).
    "first step" ends the start-up: later calls print nothing until the clock starts again."""
    now, compiled = time.perf_counter(), compile_seconds()
    last, since = _STARTUP["clock"], _STARTUP["compiled"]
    _STARTUP.update(clock=now if phase != "first step" else None, compiled=compiled)
    if not phase or last is None or dist.rank() != 0:
        return
    spent = f"; torch.compile {compiled - since:.1f} s of it" if compiled - since >= 0.05 else ""
    from tqdm import tqdm
    tqdm.write(f"start-up: {phase} {now - last:.1f} s{detail}{spent}")  # above the bar the first step finds
    sys.stdout.flush()


def status(doing: str) -> None:
    """On a terminal, during the start-up: what it is doing now ('start-up: starting the vllm engine ...'),
    on rank 0, as a line the next line overwrites (it ends in a carriage return, and every line of ours is
    longer). Without a terminal (a log file, CI) nothing: each phase's own line follows when it ends."""
    if _STARTUP["clock"] is None or dist.rank() != 0 or not sys.stdout.isatty():
        return
    sys.stdout.write(f"start-up: {doing} ..."[:56] + "\r")
    sys.stdout.flush()


def first_step(times: dict, now: float) -> None:
    """The first step's start-up line (the reference or critic loaded before it, then its rollout, update and
    push; the first update compiles FlexAttention on CUDA); nothing after it."""
    if _STARTUP["clock"] is not None:
        t = times
        before = t["start"] - _STARTUP["clock"]  # the reference, the critic, the log (wandb) are made here
        startup("first step", f" (before it {before:.1f}: rollout {t['update'] - t['start']:.1f}, update "
                              f"{t['update_end'] - t['update']:.1f}, push {now - t['push']:.1f})")
