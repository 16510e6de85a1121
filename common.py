"""The loop's vocabulary: the options every trainer shares, the run, and one call for each event of a step.

    args = common.parse_args(Args)              # the script's Args: these options and its own
    run = common.setup(args, algo="grpo")       # task, model, engine, optimizer, run folder (or --resume)
    batch = common.rollout(run, keep)           # G completions per prompt, scored (keep: resampling)
    batch = common.keep_completions(batch, kept)  # only these completions in the update (RAFT's filter)
    extra = common.generate(run, batch.examples, 1, temperature=0)  # more, scored alike: before the sleep
    run.engine.sleep()                          # until run.engine.push() the engine refuses to generate
    pre = common.pre_update(run, batch, ref)    # pi_old, the reference's log-probs, entropies
    lp = common.logprobs(run, batch, teacher)   # any model's log-probs, laid out like batch.sampler_logp
    for mb in common.minibatches(run, batch):   # whole groups; each yields its micro-batches
    common.optimizer_step(run, stats)           # clip, guard against NaN/inf, step
    common.check_sampler(run, batch, stats)     # the trainer reproduced the sampler's log-probs
    metrics = common.step_metrics(...)          # every metric over the global batch (rlmini/metrics.py)

The algorithms (advantages, losses) live in the train_*.py scripts, the plumbing in rlmini/ (one concern per
module); the switches several algorithms share live here.
"""
import os
import sys
import time
from dataclasses import dataclass, replace
from typing import ClassVar, Literal

import numpy as np
import torch

from rlmini import checkpoint as ckpt, memstats, reward_model
from rlmini import data, dist, faults, memplan, models, moe, optim, runlog, server, startup, tools
from rlmini.batches import (Batch, Keep, Micro, Minibatch, PreUpdate, Scored, batch_logprobs,
                            group_permutation, ragged_pass, this_ranks)

# what the scripts use as it is: collectives, the entry point's guard, what PPO's critic is built from
from rlmini.dist import all_gather, all_mean_var, all_sum, local_slice, rank, world_size  # noqa: F401
from rlmini.faults import user_errors  # noqa: F401
from rlmini.judge import JudgeArgs
from rlmini.logprobs import to_ragged, token_logprobs  # noqa: F401
from rlmini.metrics import StepStats, sampler_mismatch, step_metrics  # noqa: F401
from rlmini.models import (add_lora, autocast, load_pretrained, prepare_for_training,  # noqa: F401
                           trainable_parameters)
from rlmini.options import arg, check_ranks, parse_args, validate  # noqa: F401
from rlmini.packing import model_forward, to_batch_layout  # noqa: F401
from rlmini.rollouts import overlong_penalty, resample, sample, score  # noqa: F401
from rlmini.startup import Run

# ---------------------------------------------------------------------------------------------- options


@dataclass
class Args(data.TaskArgs, tools.ToolArgs, server.ServerArgs, memplan.PlanArgs, reward_model.RewardArgs,
           JudgeArgs):
    """Options shared by every algorithm (and, from its base classes, those of the task, the tools, the server
    engine, --plan_only, the reward model and the judge). Each script subclasses this with its own."""
    model: str = arg("tiny", "tiny (random-init Qwen3) | smollm2 (SmolLM2-135M-Instruct) | hub id | path")
    task: str = arg("addition", "addition | sums | sums_graded | calibration | calibration_plain | ordinal | "
                    "mixed | gsm8k | math | jsonl: | hf: | rg: (docs/tasks.md)")
    steps: int = arg(200, "training steps (one rollout batch each)", ge=1)
    prompts_per_step: int = arg(32, "prompts per rollout batch (all ranks together)", ge=1)
    group_size: int = arg(8, "completions sampled per prompt (G)", ge=1)
    lr: float = arg(3e-4, "learning rate (tiny model: 3e-4; a pretrained 0.5B-7B model: ~1e-6)", gt=0)
    warmup: int = arg(0, "linear lr warm-up steps (optimizer steps)", ge=0)
    lr_schedule: Literal["constant", "linear", "cosine"] = arg(
        "constant", "after the warm-up: constant lr, or a linear or cosine decay to 0 at the last step")
    weight_decay: float = arg(0.0, "AdamW weight decay", ge=0)
    max_new_tokens: int = arg(0, "generation budget; 0 = the task's default", ge=0)
    temperature: float = arg(1.0, "sampling temperature (log-probs are taken at the same temperature)", gt=0)
    seed: int = arg(0, "seed for data order, sampling and initialisation")
    engine: Literal["vllm", "hf", "server"] = arg(
        "vllm", "rollout engine: vLLM in-process, a sampling loop (hf), or a running `vllm serve` (server)")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = arg("auto", "compute dtype (auto: CUDA bf16; "
                                                                  "float16: eval.py only)")
    micro_batch_size: int = arg(64, "sequences per forward/backward (gradient accumulation)", ge=1)
    micro_batch_tokens: int = arg(0, "and at most this many prompt+completion tokens (verl's "
                                     "ppo_max_token_len_per_gpu); 0: 16384 for a hub model, off for tiny",
                                  ge=0)
    updates_per_rollout: int = arg(1, "passes (epochs) over each rollout batch", ge=1)
    minibatches: int = arg(1, "optimizer steps per pass: the rollout batch is split into this many", ge=1)
    grad_clip: float = arg(1.0, "max global grad norm (0 = off)", ge=0)
    gradient_checkpointing: bool = arg(False, "trade compute for activation memory")
    packing: bool = arg(True, "padding-free packed micro-batches, each prompt once per group (exact)")
    packed_attention: Literal["auto", "flex", "rows"] = arg(
        "auto", "packed attention: flex (FlexAttention, memory linear in tokens), rows (sdpa per row set); "
                "auto: flex on CUDA")
    lora_rank: int = arg(0, "LoRA rank r (peft): only adapters train, the base stays frozen (0 = off)", ge=0)
    lora_alpha: float = arg(0.0, "LoRA alpha: the update is (alpha / r) B A (0 = 2 r)", ge=0)
    lora_targets: str = arg("all-linear", "modules given adapters: all-linear (attention, MLP) or names, a,b")
    lora_dropout: float = arg(0.0, "dropout on the adapters' input in the gradient passes", ge=0, lt=1)
    lora_push: Literal["merge", "adapter"] = arg(
        "merge", "LoRA into vLLM: W + s BA merged in the dtype (bf16 rounds updates below one step of W), or "
                 "adapter: vLLM's own LoRA, the adapters loaded by path at each push")
    rollout_correction: Literal["auto", "off", "token-tis", "token-mis", "seq-mis"] = arg(
        "auto", "sampler/trainer mismatch correction (Yao et al. 2025); auto: token-tis with vLLM in "
                "bf16/fp16")
    routing_replay: bool = arg(False, "a mixture of experts: the trainer's forward routes each token to the "
                                      "experts the sampler chose (R3; rlmini/moe.py)")
    is_cap: float = arg(2.0, "token-tis: the weight pi_old / pi_sampler is truncated at this cap", gt=0)
    is_low: float = arg(0.5, "token-mis / seq-mis: tokens (completions) weighted below it are dropped", ge=0)
    is_high: float = arg(2.0, "token-mis / seq-mis: tokens (completions) weighted above it are dropped", gt=0)
    sampler_diff_tol: float = arg(0.0, "stop if mean |sampler - trainer| logprob > it; 0 = by dtype", ge=0)
    out_dir: str = arg("runs", "runs are written to out_dir/run_name")
    run_name: str = arg("", "default: <algo>-<task>-<model>-s<seed>")
    wandb: bool = arg(True, "log to wandb (offline when WANDB_API_KEY is unset)")
    wandb_project: str = arg("rlmini", "wandb project")
    wandb_group: str = arg("", "wandb group, e.g. one per algorithm so that its seeds group together")
    wandb_tags: str = arg("", "wandb tags, comma-separated")
    eval_every: int = arg(0, "evaluate on the held-out split every N steps and at the end (0 = off)", ge=0)
    eval_n: int = arg(4, "samples per held-out prompt in evaluation", ge=1)
    eval_limit: int = arg(0, "held-out prompts used in evaluation (0 = all)", ge=0)
    save_every: int = arg(50, "checkpoint every N steps and at the end (0: only at the end; -1: never, nor "
                              "final/)", ge=-1)
    keep_checkpoint: bool = arg(True, "keep the resume checkpoint when the run ends (false: final/ only, "
                                      "removed once final/ is written: the run cannot be extended)")
    resume: bool = arg(False, "continue from out_dir/run_name/checkpoint.pt (one process, either engine; "
                              "torchrun: checkpoint/)")
    format_weight: float = arg(0.0, "add this times the format score to the reward")
    reward: str = arg("", "your reward functions, module:function[,...] ('task' = the task's verifier)")
    reward_weights: str = arg("", "--reward: comma-separated weights, one per function (default 1 each)")
    overlong_buffer: int = arg(0, "DAPO soft overlong punishment: linear penalty in the last N tokens", ge=0)
    overlong_penalty: float = arg(1.0, "DAPO soft overlong punishment: the penalty at the limit", ge=0)
    mask_truncated: bool = arg(False, "DAPO overlong filtering: completions cut by the limit leave the loss")
    entropy_coef: float = arg(0.0, "entropy bonus: subtract this times the entropy from the loss", ge=0)
    top_entropy_quantile: float = arg(1.0, "train on the top rho share of tokens by entropy (Wang: 0.2)",
                                      gt=0, le=1)
    log_completions: int = arg(0, "write this many completions per step to rollouts.jsonl (and wandb)", ge=0)
    decontaminate: int = arg(0, "drop training prompts sharing a word n-gram this long with a test one", ge=0)
    brier: bool = arg(False, "calibration task: Brier reward instead of log-likelihood")
    jsonl_reward: Literal["math", "exact"] = arg("math", "reward for jsonl:PATH and hf:DATASET tasks")
    prompt_column: str = arg("prompt", "jsonl:/hf: tasks: the prompt's column (text or a list of messages)")
    answer_column: str = arg("answer", "jsonl:/hf: tasks: the reference answer's column")
    system_prompt: str = arg("", "a system message opening every prompt (chat models)")
    vllm_gpu_memory_utilization: float = arg(0.0, "share of GPU memory vLLM may take; 0: what the memory "
                                                  "plan leaves it (memplan.plan_run)", ge=0, le=1)
    vllm_seed: Literal["request", "engine"] = arg(
        "request", "vLLM sampling seeds: per request (each prompt's samples fixed by seed, step and index; "
                   "vLLM's V1 runner samples them one by one) or one engine stream (the process's RNG: "
                   "torch's, NumPy's under vLLM's V2 runner; one process only)")
    vllm_sleep: bool = arg(True, "CUDA only: free vLLM's memory (sleep level 2) while the trainer updates")
    vllm_tp: int = arg(1, "torchrun: N consecutive ranks share one vLLM engine, tensor parallel over them",
                       ge=1)
    push_check_every: int = arg(10, "check vLLM against the trainer on a probe every N steps (0 = off)", ge=0)
    push_check_tol: float = arg(0.0, "mean |logprob diff| allowed on the probe; 0 = by dtype", ge=0)
    config: str = arg("", "YAML or JSON file of options; command-line flags override it")
    dist_timeout: int = arg(1800, "torchrun: seconds a rank waits in a collective before the run stops", ge=1)
    on_nonfinite: Literal["stop", "skip"] = arg("stop", "NaN/inf reward, loss or gradient: stop, or skip")
    overwrite: bool = arg(False, "replace an existing run of the same out_dir/run_name (default: refuse)")
    run_lock: bool = arg(True, "lock the run folder against a second run (false: a filesystem without locks, "
                               "e.g. NFS without lockd; keep a second run out of it yourself)")
    allow_option_changes: bool = arg(False, "--resume with options that change the experiment (listed)")
    print_every: int = arg(10, "without a terminal (cluster job, nohup, CI): a line every N steps", ge=0)
    verbose: bool = arg(False, "the libraries' output (vLLM, transformers, warnings, progress bars) on the "
                               "terminal instead of in the run folder's logs/ (rlmini/quiet.py)")
    min_group_size: ClassVar[int] = 1  # scripts with a group baseline raise it to 2
    trains: ClassVar[bool] = True  # eval.py's options sample only: --dtype float16 is allowed there
    # what the generic tests (tests/test_siblings.py, tests/test_docs.py) need of a script: its page
    # ("" = docs/<name>.md for train_<name>.py) and the flags one step on the built-in model needs
    docs_page: ClassVar[str] = ""
    smoke_flags: ClassVar[tuple] = ()
    frozen_models: ClassVar[tuple] = ()  # fields naming frozen models (a teacher): the plan counts them
    not_applied: ClassVar[tuple] = ()  # shared options the script ignores: refused when set (parse_args)

    def __post_init__(self):
        validate(self)


# ---------------------------------------------------------------------------------------------- the run


def setup(args, algo: str) -> Run:
    """Seeds, task, run folder, device, model, engine, optimizer and log; on --resume, the checkpoint
    (rlmini/startup.py::build)."""
    return startup.build(args, algo)


def zero_one_rewards(run) -> bool:
    """Every reward of the run is 0 or 1: a binary task scored by its own verifier alone (no --reward
    functions, reward model, judge, format weight or overlong penalty; rg: scorers give partial credit)."""
    a = run.args
    return (run.task.kind == "binary" and not a.task.startswith("rg:")
            and not (a.reward or a.reward_model or a.judge_url or a.format_weight or a.overlong_buffer))


def warn(text: str) -> None:
    """One line on the terminal, rank 0's: `warning: text` (as the run's other warnings)."""
    if rank() == 0:
        print(f"warning: {text}", file=sys.stderr, flush=True)


def load_reference(run):
    """The frozen initial policy of a KL term (after --resume too); LoRA: the policy with its adapters off."""
    return models.load_reference(run.args, run.task, run.device, run.dtype, run.model)


def load_frozen(run, path: str):
    """A frozen causal LM (a teacher) that shares the policy's tokenizer (else refused in one line), loaded as
    the reference is (rlmini/models.py::load_frozen); declare its field in Args.frozen_models for the plan."""
    return models.load_frozen(path, run.device, run.dtype, packing=run.args.packing, tokenizer=run.tokenizer,
                              policy=run.args.model)


def add_critic(run, critic, lr: float) -> None:
    """PPO's value model (sharded like the policy) beside it, with an AdamW of its own, restored on --resume
    and saved in every checkpoint."""
    run.critic = critic
    run.critic_optimizer = optim.adamw(trainable_parameters(run.critic), lr, run.args.weight_decay)
    memplan.materialize_adamw(run.critic_optimizer)  # reserved in the plan, made now
    if run.args.resume:
        ckpt.restore(run, "critic", run.critic, run.critic_optimizer)


def checkpoint(run) -> None:
    """checkpoint.pt (one process, either engine; torchrun: checkpoint/ in shards), atomically: everything
    --resume needs."""
    ckpt.save(run)


def finish(run) -> None:
    """The last checkpoint and final/ (the policy in HF format), then one line saying where they went, then a
    barrier: no rank exits before every rank has saved (the process group ends at exit: dist.setup_device)."""
    run.log.close()  # the progress bar ends before the save's line
    start = time.perf_counter()
    if run.args.save_every >= 0:  # -1: a benchmark writes no checkpoint and no final/ (scripts/gpu_check.py)
        ckpt.save_end(run, since=start)  # --keep_checkpoint false: removed once final/ is durable
    elif rank() == 0:
        print(f"nothing saved (--save_every -1); metrics in {os.path.join(run.run_dir, 'metrics.jsonl')}",
              flush=True)
    for part in (run.engine, run.toolbox):  # the server engine's request threads, --env's instances
        getattr(part, "close", lambda: None)()
    dist.barrier()


# ---------------------------------------------------------------------------------------------- a step


def generate(run, examples: list, n: int, temperature: float | None = None, seed: int | None = None,
             prefixes: list | None = None) -> Scored:
    """n completions of each of this rank's `examples`, sampled by the engine from the weights it was last
    pushed (with --tools, multi-turn), scored and shaped exactly as training rollouts are (the format bonus,
    the overlong penalty; a NaN/inf reward stops the run or warns, every rank alike). temperature: None is
    --temperature, 0 greedy. seed: None is extra_seed(run)'s, apart from the training rounds' seeds.
    prefixes: one partial completion per example (token ids, e.g. a slice of a batch row's completion):
    n continuations of prompt + prefix each, with the budget left (--max_new_tokens less the prefix), returned
    whole (prefix + continuation, scored whole; rollouts.prefix_lengths marks where sampling began, the
    prefix's sampler log-probs zeros); one that ends in EOS or fills the budget comes back as it is, scored.

    Call it before run.engine.sleep(): from there to run.engine.push() the engine refuses to generate
    (EngineStateError). Under torchrun every rank calls it (the HF engine's forwards are collectives), a
    rank without examples on a stand-in it drops. For batch.examples (as many on every rank),
    all_gather(scored.rewards) is the global batch's, its prompts in all_gather(batch.rewards)'s order."""
    temperature = run.args.temperature if temperature is None else temperature
    if n < 1 or not temperature >= 0:
        raise ValueError(f"common.generate: n {n}, temperature {temperature}: n must be >= 1 and the "
                         f"temperature >= 0 (0: greedy)")
    seed = extra_seed(run) if seed is None else seed
    return score(run, examples, n, sample(run, examples, n, temperature, seed, prefixes))


def extra_seed(run) -> int:
    """The seed of the next common.generate call without one, counted as that call: the k-th of a step draws
    with rlmini/data.py::extra_seed(--seed, step, rank, k). A script sampling through run.engine itself
    takes its seeds here, drawing what common.generate would."""
    k = run.extra_calls[1] if run.extra_calls[0] == run.step else 0
    run.extra_calls = (run.step, k + 1)
    return data.extra_seed(run.args.seed, run.step, rank(), k)


def rollout(run, keep: Keep | None = None) -> Batch:
    """G completions of each of this rank's prompts (generate), sampled by the engine from the weights it was
    last pushed, and scored; with `keep`, groups without a spread are replaced by new prompts' groups (Keep;
    the rounds: rlmini/rollouts.py::resample)."""
    return resample(run, keep)


def keep_completions(batch: Batch, keep) -> Batch:
    """The batch with only the completions `keep` marks (bool or 0/1, one per completion: this rank's, or the
    global batch's in all_gather's order) in the update; call it before pre_update. A dropped completion is
    never computed: not in pre_update's passes nor common.logprobs (its values there are zeros of its
    length), not in the loss, its normalisers or the update's metrics (minibatches); a minibatch left with
    none on any rank makes no optimizer step (filter/empty_updates). Calls compose: kept is their product."""
    mine = this_ranks(torch.as_tensor(keep).flatten().float().cpu(), len(batch))
    if mine is None or not ((mine == 0) | (mine == 1)).all():
        raise ValueError(f"common.keep_completions: give one bool or 0/1 per completion, this rank's "
                         f"{len(batch)} or the global batch's {len(batch) * world_size()} (got "
                         f"{len(torch.as_tensor(keep).flatten())} values)")
    return replace(batch, kept=batch.kept * mine, filtered=True)


@torch.no_grad()
def pre_update(run, batch: Batch, ref_model=None, values=None, need_old: bool = False) -> PreUpdate:
    """One pass over the batch before the update: pi_old (recomputed by the trainer, not the sampler's
    values) when the update is off-policy or `need_old`, the reference's log-probs (KL), the entropies of
    --top_entropy_quantile, and `values(layout)` (PPO's critic)."""
    args, B, T = run.args, len(batch), run.args.temperature
    run.times["update"] = time.perf_counter()
    runlog.status("first step: update")  # on a terminal, during the start-up only
    memstats.phase_end("rollout", run.times)  # CUDA: the rollout's peak memory, vLLM awake (memory/* metrics)
    # on-policy, pi_old is the update's own first forward; with --lora_dropout it comes from a pass without it
    on_policy = (args.updates_per_rollout == 1 and args.minibatches == 1 and not args.lora_dropout
                 and not need_old)
    top_entropy = args.top_entropy_quantile < 1

    def forward(micro):
        with autocast(run.device, run.dtype):
            logp, entropy = (token_logprobs(run.model, moe.layout(micro, args.routing_replay), T,
                                            with_entropy=top_entropy)
                             if not on_policy or top_entropy else (None, None))
            return {"old": logp, "entropy": entropy, "values": values and values(micro.layout)}
    # what the pass computes is there for every completion, zeros for a dropped one, even if all were dropped
    wanted = [name for name, on in (("old", not on_policy or top_entropy), ("entropy", top_entropy),
                                     ("values", values is not None)) if on]
    out = ragged_pass(batch, forward, args.micro_batch_size, args.micro_batch_tokens, run.model, run.device,
                      wanted)
    ref = logprobs(run, batch, ref_model) if ref_model is not None else None
    pre = PreUpdate(on_policy, out.get("old", [None] * B), ref, out.get("entropy", [None] * B),
                    out.get("values", [None] * B))
    if top_entropy:  # Wang et al. 2025: the top rho share of the global batch's tokens in the loss
        in_loss = [pre.entropy[i] for i in range(B) if batch.in_loss[i] and batch.kept[i]]
        pre.tau = dist.top_share_threshold(in_loss, args.top_entropy_quantile)
    return pre


def logprobs(run, batch: Batch, model) -> list:
    """log model(token) of this rank's completions at --temperature (the policy, a reference, a teacher), no
    gradient: one fp32 CPU 1-D tensor per completion, aligned with batch.sampler_logp (tool output left out).
    Every rank calls it (rlmini/batches.py::batch_logprobs)."""
    a = run.args
    return batch_logprobs(batch, model, a.temperature, a.micro_batch_size, a.micro_batch_tokens, run.device,
                          run.dtype)


def minibatches(run, batch: Batch, whole_groups: bool = False):
    """--updates_per_rollout passes over the batch in a random order of whole groups (a micro-batch shares
    its prompts), each split into --minibatches optimizer steps. The normalisers count the completions in the
    loss and kept (keep_completions), and the groups with one, over all ranks; a minibatch with none kept on
    any rank is not yielded (counted in batch.empty_updates): no forward, backward or optimizer step, so the
    lr schedule, counted in optimizer steps, does not advance either. `whole_groups`: no micro-batch splits
    a group (a loss over pairs or groups: micro.groups, micro.per_group, aggregate_over); a group over the
    --micro_batch_size / --micro_batch_tokens budget is a micro-batch of its own, however long."""
    args, G = run.args, run.args.group_size
    shuffle = torch.Generator().manual_seed(args.seed * 1_000_003 + run.step)  # the step's own: resumable
    if whole_groups and (len(batch) // G) % args.minibatches:
        raise SystemExit(f"--minibatches {args.minibatches} must divide each rank's groups per step "
                         f"({len(batch) // G}) for a loss over whole groups")
    for epoch in range(args.updates_per_rollout):
        for rows in group_permutation(len(batch), G, shuffle).chunk(args.minibatches):
            rows = rows.tolist()
            in_loss = batch.in_loss[rows] * batch.kept[rows]
            groups = len({i // G for i, x in zip(rows, in_loss.tolist()) if x})  # with one in the loss
            n = all_sum({"seqs": float(in_loss.sum()), "tokens": float((batch.lengths[rows] * in_loss).sum()),
                         "kept": float(batch.kept[rows].sum()), "groups": float(groups)})
            if not n["kept"]:  # AdamW would still move every weight (its momentum): no step at all
                batch.empty_updates += 1
                continue
            n_seqs, n_tokens = max(n["seqs"], 1.0) / world_size(), max(n["tokens"], 1.0) / world_size()
            yield Minibatch(batch, rows, epoch, n_seqs, n_tokens, args.micro_batch_size,
                            args.micro_batch_tokens, run.model, run.device,
                            max(n["groups"], 1.0) / world_size(), G if whole_groups else 0)


def policy_logprobs(run, micro: Micro) -> tuple:
    """The policy's log-probs of the micro-batch's tokens, with their gradient, and its entropies (in the
    first pass, or with --entropy_coef, whose gradient flows through them). A mixture of experts with the
    sampler's routes: routed by them (--routing_replay), and the first pass's agreement kept (route_agree).
    """
    with autocast(run.device, run.dtype):
        out = token_logprobs(run.model, moe.layout(micro, run.args.routing_replay), run.args.temperature,
                             with_entropy=micro.epoch == 0 or run.args.entropy_coef > 0,
                             entropy_grad=run.args.entropy_coef > 0)
    if micro.epoch == 0:  # (0, 0) without routes: a model with routers adds the keys on every rank
        micro.route_agree = moe.agreement(run.model, micro.mask)
    return out


def optimizer_step(run, stats) -> None:
    """Clip the global gradient norm (the policy's, and PPO's critic's), then step the optimizers and the lr
    schedule, unless a norm is NaN/inf: --on_nonfinite stops the run, or skips this update."""
    grad_norm = norm = dist.clip_grad_norm(trainable_parameters(run.model), run.args.grad_clip)
    optimizers = [run.optimizer]
    if run.critic is not None:
        norm = grad_norm + dist.clip_grad_norm(trainable_parameters(run.critic), run.args.grad_clip)
        optimizers.append(run.critic_optimizer)
    what = "gradient norm" if run.critic is None else "policy or value gradient norm"
    if faults.nonfinite(norm, what, run.step + 1, run.args.on_nonfinite):
        stats.skipped += 1
    else:
        run.optimizer.step()
        run.scheduler.step()
        for optimizer in optimizers[1:]:
            optimizer.step()
        stats.grad_norm, stats.updates = stats.grad_norm + grad_norm, stats.updates + 1
    for optimizer in optimizers:
        optimizer.zero_grad(set_to_none=True)


# -------------------------------------------------------------------------------------- switches losses share


def rollout_correction(old_logp, sampler_logp, mask, args):
    """Rollout correction (Yao et al. 2025): per-token weights w = pi_old / pi_sampler, detached, that undo
    the sampler/trainer mismatch (bf16 vLLM kernels sample from a slightly different policy). token-tis
    truncates w at is_cap; token-mis zeroes tokens whose w is outside [is_low, is_high]; seq-mis zeroes whole
    completions whose geometric-mean w is outside. Returns (weights or None, stats)."""
    w, kl = sampler_mismatch(old_logp, sampler_logp, mask)
    if args.rollout_correction == "token-tis":  # truncated IS: min(w, C)
        weight, dropped = w.clamp(max=args.is_cap), w > args.is_cap
    elif args.rollout_correction == "token-mis":  # masked IS: w inside [lo, hi], else 0
        dropped = (w < args.is_low) | (w > args.is_high)
        weight = w * ~dropped
    elif args.rollout_correction == "seq-mis":  # a completion with a geometric-mean w outside [lo, hi] drops
        log_w = ((old_logp - sampler_logp) * mask).detach()
        geo_w = torch.exp(log_w.sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1))
        dropped = ((geo_w < args.is_low) | (geo_w > args.is_high)).expand_as(w)
        weight = w * ~dropped
    else:
        weight, dropped = None, torch.zeros_like(w, dtype=torch.bool)
    return weight, {"w": w, "changed": dropped.float(), "kl": kl}


def entropy_terms(token_loss, entropy, pre: PreUpdate, micro: Micro, args):
    """The token loss with the entropy switches: only the tokens whose pi_old entropy is in the batch's top
    rho share (Wang et al. 2025; the normalisers stay), and an entropy bonus through the chunked projection.
    """
    if args.top_entropy_quantile < 1:
        token_loss = token_loss * (micro.per_token(pre.entropy) >= pre.tau)
    if args.entropy_coef:
        token_loss = token_loss - args.entropy_coef * entropy
    return token_loss


def cov_tokens(run, batch: Batch, logp: list, advantages, share: float, band: tuple | None = None) -> list:
    """Clip-Cov's and KL-Cov's tokens (Cui et al. 2025, eq. 10): Cov_t = (log pi(y_t) - mean log pi)(A_t -
    mean A), the means over the global batch's tokens in the loss (every rank's); the top `share` by Cov_t
    (KL-Cov, eq. 13), or with `band` (lo, hi) a uniform random `share` of those with lo < Cov_t < hi
    (Clip-Cov, eq. 11; all when fewer; eq. 11 and verl floor r N, here ceil), drawn per completion from
    --seed, the step and its place in the global batch; exactly ceil(share N), ties (as verl's topk) in
    global order: neither --micro_batch_size nor torchrun changes the choice. `logp` ragged as pre.old,
    `advantages` one per completion of this rank; a 0/1 tensor each."""
    used, adv = (batch.in_loss * batch.kept).tolist(), advantages.detach().double().cpu().tolist()
    n = all_sum({"n": sum(len(x) * u for x, u in zip(logp, used)),
                 "adv": sum(len(x) * a * u for x, a, u in zip(logp, adv, used)),
                 "logp": sum(float(x.double().sum()) * u for x, u in zip(logp, used))})
    mean_logp, mean_adv = n["logp"] / max(n["n"], 1), n["adv"] / max(n["n"], 1)
    cov = [((x.detach().double().cpu() - mean_logp) * (a - mean_adv)).float() for x, a in zip(logp, adv)]
    if band is None:
        ranked, inside = cov, [torch.ones_like(c, dtype=torch.bool) for c in cov]
    else:  # the band's tokens in a random order (uniform draws, the rest last): the top is a uniform pick
        seed = ((run.args.seed * 1_000_003 + run.step) * 1_000_003 + local_slice(len(batch)).start) % 2**63
        inside = [(c > band[0]) & (c < band[1]) for c in cov]
        draws = [torch.rand(len(c), generator=torch.Generator().manual_seed(seed + i))
                 for i, c in enumerate(cov)]
        ranked = [torch.where(b, d, -torch.inf) for b, d in zip(inside, draws)]
    top = iter(dist.top_share_mask([r for r, u in zip(ranked, used) if u], share))  # exactly ceil(share N)
    return [(next(top) & b).float() if u else torch.zeros_like(r) for r, b, u in zip(ranked, inside, used)]


def aggregate(token_loss, mask, loss_agg, n_seqs, n_tokens, max_len):
    """This micro-batch's share of the minibatch loss. The normalisers (n_seqs, n_tokens) count the whole
    minibatch, so gradient accumulation does not change the result."""
    if loss_agg == "token-mean":  # DAPO (Yu et al. 2025) eq. 12: sum over all tokens / all tokens
        return (token_loss * mask).sum() / n_tokens
    if loss_agg == "seq-mean-token-mean":  # GRPO (Shao et al. 2024) eq. 3: mean over tokens, then completions
        return ((token_loss * mask).sum(1) / mask.sum(1).clamp(min=1)).sum() / n_seqs
    if loss_agg == "seq-mean-token-sum-norm":  # Dr. GRPO (Liu et al. 2025): token sum / (G * L_max), L fixed
        return (token_loss * mask).sum() / (n_seqs * max_len)
    raise ValueError(f"--loss_agg {loss_agg!r}: choose seq-mean-token-mean, token-mean or "
                     f"seq-mean-token-sum-norm")


def aggregate_over(loss, micro: Micro, mb: Minibatch, over: Literal["seqs", "groups"]):
    """This micro-batch's share of the minibatch mean of a loss per completion (`loss` [b], over="seqs") or
    per group ([g], over="groups", in micro.groups' order; minibatches(whole_groups=True)): divided by the
    completions in the loss (mb.n_seqs) or the groups with one (mb.n_groups), over all ranks, so neither the
    micro-batch size nor torchrun changes the gradient; rows without a token in the loss (an idle repeat,
    --mask_truncated) and groups without such a row add nothing."""
    if over == "seqs":
        return (loss * micro.in_loss).sum() / mb.n_seqs
    if over == "groups":
        return (loss * (micro.per_group(micro.in_loss) > 0)).sum() / mb.n_groups
    raise ValueError(f"common.aggregate_over: over={over!r}: choose seqs or groups")


def hadw_reweight(rewards, advantages, state, args):
    """HA-DW (arXiv 2601.08521, 2026), a plug-in for group advantages (GRPO, GPG): A_i * Phi_i with Phi_i =
    lam exp(D_i M), D_i = -sign(A_i) sign(p_hat - C), M = |p_hat - C|, C the cross-batch difficulty anchor;
    updates `state`. args: group_size, hadw_eta (eta), hadw_window (m), hadw_lambda, hadw_anchor (and
    hadw_threshold for "fixed"). Binary
    rewards (y_t = batch accuracy). Anchor (sec. 3): C+ = (1 - eta_t) C- + eta_t y_t, eta_t = clamp(eta
    std(last `window` anchors), 0, 1). Cold start, which the paper leaves open: the first prior is y_1, and
    eta_t = eta while the window holds fewer than 2 distinct anchors. anchor="mean": appendix F, C_t^- = the
    mean of the last m batch accuracies; anchor="fixed": C_t^- = hadw_threshold every step (docs/hadw.md)."""
    group_size, eta, window, lam = args.group_size, args.hadw_eta, args.hadw_window, args.hadw_lambda
    y = rewards.float().mean().item()
    if not np.isfinite(y):  # its update is skipped (--on_nonfinite skip): keep the NaN out of the anchor
        return advantages, {}
    prior = y if state.get("anchor") is None else state["anchor"]  # C_t^-
    if args.hadw_anchor == "mean":  # appendix F: the anchor is a moving average of recent batch accuracies
        prior = float(np.mean(state["accuracies"])) if state.get("accuracies") else y
        state["accuracies"] = (state.get("accuracies", []) + [y])[-window:]
    elif args.hadw_anchor == "fixed":  # arXiv 2601.08521's ablation: its evolving C_t beats a fixed threshold
        prior = args.hadw_threshold
    p_hat = rewards.float().view(-1, group_size).mean(1, keepdim=True).expand(-1, group_size).flatten()
    diff = p_hat - prior
    phi = lam * torch.exp(-torch.sign(advantages) * torch.sign(diff) * diff.abs())  # a constant: no gradient
    info = {"hadw/anchor": prior}  # and eta_t, each side's mean Phi where it has prompts
    if args.hadw_anchor != "fixed":  # the Kalman update (a fixed anchor has no state)
        history = state.get("history", [])[-window:]  # the last m posterior anchors
        sigma = float(np.std(history)) if len(history) >= 2 else 0.0  # population std
        eta_t = min(max(eta * sigma, 0.0), 1.0) if sigma > 0 else eta
        posterior = (1 - eta_t) * prior + eta_t * y  # C_t^+, the next prior
        state.update(anchor=posterior, history=(history + [posterior])[-window:])
        info["hadw/eta"] = eta_t
    hard, easy = diff < 0, diff > 0
    info.update({f"hadw/phi_{side}": phi[on].mean().item() for side, on in (("hard", hard), ("easy", easy))
                 if on.any()})
    return advantages * phi, info


# ---------------------------------------------------------------------------------------------- the guard


def check_sampler(run, batch: Batch, stats: StepStats) -> None:
    """The guard: the trainer's log-probs of the sampled tokens equal the sampler's (else the rollouts came
    from stale or discarded weights), and the loss is finite. Sums the step's diagnostics over ranks."""
    run.times["update_end"] = time.perf_counter()
    memstats.phase_end("update", run.times)  # CUDA: the update's peak memory, vLLM asleep
    tokens = {"tokens": stats.tokens, "first_pass_tokens": float((batch.lengths * batch.kept).sum()),
              "generated_tokens": float(batch.lengths.sum())}  # the update computes the kept ones only
    stats.totals = all_sum({**stats.sums, **tokens})
    computed = stats.totals["first_pass_tokens"]  # 0: the filter kept nothing, nothing to check
    # --async_steps: stale samples differ from the trainer by design; each push was probed instead
    if computed and (batch.pushes is None or not all_sum(float(batch.staleness.sum()))):
        diff = stats.totals["logprob/sampler_diff"] / computed
        faults.check_sampler_diff(diff, run.step + 1, run.args.sampler_diff_tol)
    faults.nonfinite(stats.totals["loss/policy"], "loss", run.step + 1, run.args.on_nonfinite)
    run.times["push"] = time.perf_counter()
    runlog.status("first step: push")
