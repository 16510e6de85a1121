"""A run and how it starts: common.setup builds the Run (task, model, engine, optimizer, run folder and log;
on --resume, the checkpoint) that every call of a step takes."""
import os
from dataclasses import dataclass, field

import torch

from rlmini import checkpoint as ckpt, data, dist, engine, faults, memplan, models, moe, optim, quiet, runlog
from rlmini import reward_model, server, tools
from rlmini.models import trainable_parameters
from rlmini.options import check_ranks


@dataclass
class Run:
    """Everything a training loop needs, built by setup() from the options."""
    args: object
    algo: str               # the script's algorithm ("grpo", ...), stored in checkpoints
    run_dir: str
    device: torch.device
    dtype: torch.dtype
    task: object
    style: str              # prompt format: "tiny" (terse, no chat template) or "chat"
    model: object
    tokenizer: object
    model_path: str
    engine: object          # engine.VLLMEngine or engine.HFEngine
    optimizer: object
    scheduler: object
    max_new_tokens: int
    probe: tuple            # (prompt, completion) that the push check scores in both engines
    toolbox: object = None  # --tools (tools.Toolbox), None without
    log: runlog.RunLog = None
    step: int = 0
    data_pos: int = 0       # position in the endless, shuffled prompt stream
    hadw: dict = field(default_factory=dict)  # HA-DW's cross-batch anchor (--hadw)
    critic: object = None   # PPO's value model and its optimizer (add_critic)
    critic_optimizer: object = None
    resumed: dict = field(default_factory=dict)  # after --resume: the checkpoint (torchrun: its meta.pt)
    quiet_steps: int = 0    # steps in a row without entropy or gradient (faults.warn_on_collapse)
    skipped_steps: int = 0  # steps in a row whose every update was skipped (faults.check_skipped)
    extra_calls: tuple = (-1, 0)  # (step, common.generate calls of the script's own in it): their seeds
    times: dict = field(default_factory=dict)  # this step's clock readings (the time/* metrics)
    plan: dict = field(default_factory=dict)  # the memory plan (memplan.plan_run); CUDA: measured per phase
    ahead: list = field(default_factory=list)  # --async_steps: (data_pos, examples, future) requested
    redraw: list = field(default_factory=list)  # after --resume: data positions of the batches then in flight
    checkpoint_step: int | None = None  # the step the last checkpoint holds (a Ctrl-C line names it)
    final: str | None = None  # final/ once written and durable (a Ctrl-C after it says the model is saved)


def build(args, algo: str) -> Run:
    """common.setup: seeds, task, run folder, device, model, engine, optimizer and log; on --resume, the
    checkpoint."""
    memplan.plan_only(args, algo)  # --plan_only: the plan from the config alone, then exit
    faults.watch()  # a Ctrl-C from here to the Run: "during start-up"
    check_ranks(args)
    data.seed_everything(args.seed)
    runlog.startup()  # rank 0 prints each start-up phase: model, engine, first step, with their seconds
    runlog.status(f"task and model ({args.model})")  # on a terminal: what it does until its line
    quiet.start(args)  # the libraries' output to a log (the run folder's below), our lines to the terminal
    model_tag = os.path.basename(args.model.rstrip("/"))
    if model_tag == "final":  # a run's final/: named after that run, so that two such runs never collide
        model_tag = os.path.basename(os.path.dirname(os.path.abspath(args.model)))
    args.run_name = args.run_name or f"{algo}-{args.task.split(':')[0]}-{model_tag}-s{args.seed}"
    style = models.prompt_style(args.model)
    args.micro_batch_tokens = args.micro_batch_tokens or (0 if style == "tiny" else 16384)
    task = data.load_task(args, style)
    path = models.model_path(args.model, task)  # builds the tiny model on first use, before torch.distributed
    tokenizer = models.load_tokenizer(path)
    data.check_vocabulary(task, tokenizer, style, args.model, args.task)  # a tiny checkpoint on another task
    device, dtype = dist.setup_device(args)  # torchrun: the group first, so rank 0's claim reaches every rank
    # after the data and the model's tokenizer (no folder left by either); rank 0 locks it before any rank
    # writes into it, and no input may lie where the run writes
    run_dir = ckpt.prepare_run_dir(args, ckpt.inputs(args))
    quiet.to_run_dir(run_dir, args.resume)  # logs/rank<R>.log
    args.server_push_dir = args.server_push_dir or os.path.join(run_dir, "push")
    args.rollout_correction = engine.correction_for(args, dtype)
    max_new = args.max_new_tokens or task.max_new_tokens
    context = getattr(memplan.load_config(path), "max_position_embeddings", 4096)
    max_prompt = data.fit_prompts(task, tokenizer, style == "chat", max_new, context, args.task)
    max_len = min(context, max_prompt * 2 + max_new + 8)
    if args.engine == "server":  # a server down, or serving another model: one line before anything loads
        served = server.check_server(args.server_url, args, tokenizer, dtype, max_len, args.server_timeout)
    # what each rank will hold, before anything large is loaded: one line; a plan that cannot fit stops here
    plan = memplan.plan_run(args, algo, path, device, dtype, max_len, run_dir, (max_prompt, max_new))
    server.check_trainer_memory(args, device, plan)  # --engine server: `vllm serve` on these GPUs?
    model, tokenizer, path = models.load_model(args, task, device, dtype, tokenizer)  # torchrun: sharded
    moe.prepare(args, model)  # a mixture of experts: routes captured, compared, replayed (--routing_replay)
    reward_model.load(task, args, tokenizer, device, dtype)  # --reward_model, --judge_url: before vLLM sizes
    runlog.startup("model", f" (task, memory plan, {args.model} built or loaded)")
    runlog.status(f"starting the {args.engine} engine")
    optimizer = optim.adamw(trainable_parameters(model), args.lr, args.weight_decay)  # LoRA: the adapters
    memplan.materialize_adamw(optimizer)  # its state exists before vLLM sizes itself (bit-identical training)
    scheduler = optim.schedule(optimizer, args)
    probe_prompt = data.encode_prompts(tokenizer, [task.train[0]["prompt"]], style == "chat")[0]
    sampler = (server.ServerEngine(args, model, tokenizer, device, dtype, served) if args.engine == "server"
               else engine.make_engine(args, path, model, tokenizer, device, dtype, max_len, plan["share"]))
    # both guards' tolerances: the dtype's floor, or more where the engines already differ at start
    probe, push_base, guard_base = sampler.calibrate(probe_prompt, min(16, max_new), args.seed,
                                                     args.temperature)
    args.push_check_tol = args.push_check_tol or max(engine.default_push_tol(dtype), 5 * push_base)
    args.sampler_diff_tol = args.sampler_diff_tol or max(faults.default_sampler_diff_tol(dtype),
                                                          10 * guard_base)
    ckpt.replace_earlier_run(run_dir)  # --overwrite: the earlier run goes once start-up has passed
    run = Run(args, algo, run_dir, device, dtype, task, style, model, tokenizer, path, sampler, optimizer,
              scheduler, max_new, probe, tools.make_toolbox(args, run_dir, style, tokenizer), plan=plan)
    if args.resume:
        ckpt.resume(run)  # the policy, its optimizer and schedule, the step, data position, RNG, HA-DW
    run.log = runlog.RunLog(args, run_dir, run.step, args.steps, algo)
    faults.watch(run)  # Ctrl-C from here on: closed, and one line on how to continue (faults.interrupted)
    return run
