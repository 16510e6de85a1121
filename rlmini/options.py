"""Options: each field's help and valid range (arg), the check of a whole set of options (validate), and the
parser (parse_args): --config files become command-line flags, so one parser types every value."""
import argparse
import dataclasses
import inspect
import json
import math
import os
import sys
import typing
from dataclasses import field
from typing import Literal

from rlmini.dist import world_size


def arg(default, help: str, ge=None, gt=None, le=None, lt=None, only_with=None):
    """A dataclass field with its one-line help (--help) and its valid range, checked when options are parsed;
    only_with=(name, value): the option does something only when option `name` is `value`, and only where
    `name` itself applies (its own only_with, followed; set without it, parse_args refuses it in one line)."""
    return field(default=default, metadata={"help": help, "range": (ge, gt, le, lt), "only_with": only_with})


def validate(args) -> None:
    """Choices and ranges of every option (from each field's arg(...)) and the options that must agree; raises
    ValueError naming the flag."""
    if getattr(args, "temperature", 1) == 0 and args.trains:  # before the range check, which gives no reason
        raise ValueError("--temperature 0: greedy decoding is no distribution to train on (a prompt's "
                         "completions are one, every group advantage 0, and its log-probs are not those of "
                         "what sampled them, so the ratio pi / pi_sampler is meaningless); train at a "
                         "temperature > 0 and ask common.generate(run, examples, 1, temperature=0) for "
                         "greedy completions")
    for f in dataclasses.fields(args):
        v, flag = getattr(args, f.name), f"--{f.name}"
        if v is None:  # an optional option left unset
            continue
        if typing.get_origin(f.type) is Literal and v not in typing.get_args(f.type):
            raise ValueError(f"{flag} {v!r}: choose one of {', '.join(typing.get_args(f.type))}")
        if isinstance(v, float) and not math.isfinite(v):  # --lr inf, --beta nan: never meaningful
            raise ValueError(f"{flag} {v!r}: must be a finite number")
        ge, gt, le, lt = f.metadata.get("range", (None,) * 4)
        if not ((ge is None or v >= ge) and (gt is None or v > gt) and (le is None or v <= le)
                and (lt is None or v < lt)):
            raise ValueError(f"{flag} {v!r}: must be {range_text(ge, gt, le, lt)}")
    if args.group_size < args.min_group_size:
        why = " (the group baseline needs two completions of each prompt)" if args.min_group_size > 1 else ""
        raise ValueError(f"--group_size {args.group_size}: must be >= {args.min_group_size}{why}")
    if (args.prompts_per_step * args.group_size) % args.minibatches:
        raise ValueError(f"--minibatches {args.minibatches} must divide prompts_per_step * group_size = "
                         f"{args.prompts_per_step * args.group_size}")
    if args.is_low > args.is_high:
        raise ValueError(f"--is_low {args.is_low} must not exceed --is_high {args.is_high}")
    if getattr(args, "vllm_seed", "request") == "engine" and int(os.environ.get("WORLD_SIZE", 1)) > 1:
        # the stream is the process's RNG (torch's or NumPy's), the same on every rank; checkpoints: rank 0's
        raise ValueError("--vllm_seed engine: one process only (under torchrun every rank would draw the "
                         "same stream); use --vllm_seed request")
    engine = getattr(args, "engine", "vllm")
    if engine == "server" and not getattr(args, "server_url", ""):
        raise ValueError("--engine server needs --server_url http://HOST:PORT of a running vLLM server "
                         "(docs/scale.md)")
    if engine == "server" and getattr(args, "vllm_seed", "request") == "engine":
        raise ValueError("--vllm_seed engine: the server's RNG is not the trainer's to save; use --vllm_seed "
                         "request with --engine server")
    if engine == "server" and getattr(args, "lora_push", "merge") == "adapter":
        raise ValueError("--lora_push adapter: with --engine server the adapters are merged into the pushed "
                         "weights; use --lora_push merge")
    if getattr(args, "async_steps", 0) and engine != "server":
        raise ValueError(f"--async_steps {args.async_steps}: rollouts overlap the update only with --engine "
                         f"server (an in-process engine shares the trainer's GPU, asleep while it updates)")
    if getattr(args, "routing_replay", False) and engine == "server":  # vllm serve: /v1/completions
        raise ValueError("--routing_replay: not wired for --engine server yet (it samples through "
                         "/v1/completions, which returns no routes; vLLM's /inference/v1/generate returns "
                         "routed_experts); use --engine vllm or hf")
    if getattr(args, "routing_replay", False) and (getattr(args, "tools", "") or getattr(args, "env", "")):
        raise ValueError("--routing_replay: with --tools or --env a trajectory is sampled over several "
                         "turns, whose routes are not joined; train without them or without replay")
    tp = getattr(args, "vllm_tp", 1)
    ranks = args.gpus if getattr(args, "plan_only", False) else int(os.environ.get("WORLD_SIZE", 1))
    if tp > 1 and args.engine != "vllm":
        raise ValueError(f"--vllm_tp {tp}: vLLM's tensor parallelism needs --engine vllm (not {args.engine})")
    if ranks % tp:
        raise ValueError(f"--vllm_tp {tp} must divide the number of ranks ({ranks}): each group of {tp} "
                         f"consecutive ranks shares one engine")
    if args.dtype == "float16" and args.trains:  # fp16's 5-bit exponent flushes small gradients to 0 unscaled
        raise ValueError("--dtype float16: training in fp16 needs gradient scaling, which this trainer does "
                         "not do; use bfloat16 (eval.py samples in float16 if asked)")


def range_text(ge=None, gt=None, le=None, lt=None) -> str:
    """'>= 1', '> 0', 'in [0, 1]', 'in (0, 1]', ... (--help and the errors)."""
    low = (">=", ge, "[") if ge is not None else (">", gt, "(") if gt is not None else None
    high = ("<=", le, "]") if le is not None else ("<", lt, ")") if lt is not None else None
    if low and high:
        return f"in {low[2]}{low[1]:g}, {high[1]:g}{high[2]}"
    op, bound, _ = low or high
    return f"{op} {bound:g}"


class Parser(argparse.ArgumentParser):
    """argparse, but a bad option ends in one line naming it (argparse prints its usage and exits 2; our
    refusals are one line, status 2: faults.user_errors)."""

    def __init__(self, *args, source: str = "command line", **kwargs):
        super().__init__(*args, **kwargs)
        self.source = source

    def error(self, message):
        raise SystemExit(f"bad option ({self.source}): {message}")


def parse_args(cls, argv=None):
    """`cls` (a subclass of Args) from the command line; a --config file's options become command-line flags
    placed before the others (so the parser types them, and a flag given again overrides). Flags are never
    abbreviated (--temp is not --temperature). A bad option ends in one line naming it."""
    argv = list(sys.argv[1:] if argv is None else argv)
    argv = [x for a in argv for x in (a.split("=", 1) if a.startswith("--config=") else [a])]
    source = "command line"
    if "--config" in argv:
        path = argv[argv.index("--config") + 1] if argv.index("--config") + 1 < len(argv) else "--"
        argv = config_flags(path, cls) + argv
        source = f"command line or --config {path}"

    about = (sys.modules[cls.__module__].__doc__ or "").split("\n\n")[0]
    parser = Parser(description=about, allow_abbrev=False, usage="%(prog)s [--option value ...]",
                    source=source)
    for f, group in help_order(cls, parser):
        kind = next((t for t in typing.get_args(f.type) if t is not type(None)), f.type)  # X | None -> X
        options = {"default": f.default, "help": f.metadata.get("help", ""), "type": kind}
        if f.name in getattr(cls, "not_applied", ()):  # refused when set: not in --help
            options["help"] = argparse.SUPPRESS
        if typing.get_origin(f.type) is Literal:
            options.update(type=str, choices=typing.get_args(f.type))
        elif kind is bool:  # --flag, --flag true, --flag false
            options.update(type=boolean, nargs="?", const=True)
        group.add_argument(f"--{f.name}", **options)
    values, unknown = parser.parse_known_args(argv)
    if unknown:  # flags are never abbreviated: --temp is not --temperature
        raise SystemExit(f"unknown option(s) {unknown}: see --help for the options")
    given = [a[2:].split("=", 1)[0] for a in argv if a.startswith("--")]  # set by the user, not defaults
    refused = [name for name in getattr(cls, "not_applied", ()) if name in given]
    if refused:  # accepted, it would do nothing
        raise SystemExit(f"--{refused[0]}: {script_name(cls)} does not apply this shared option (Args."
                         f"not_applied: {', '.join(cls.not_applied)}); it would do nothing: leave it unset")
    try:
        args = cls(**vars(values))
    except ValueError as e:
        raise SystemExit(f"bad option ({source}): {e}") from None
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for f in fields.values():  # set by the user where it does nothing: refused, as not_applied is
        condition, seen = (f.metadata.get("only_with") if f.name in given else None), set()
        while condition and condition[0] not in seen:  # applies only where the option it names applies
            name, value = condition
            seen.add(name)
            if getattr(args, name) != value:
                shown = str(value).lower() if isinstance(value, bool) else value
                raise SystemExit(f"--{f.name}: applies only with --{name} {shown} (here "
                                 f"{getattr(args, name)}); it would do nothing: leave it unset")
            condition = fields[name].metadata.get("only_with")
    return args


FIRST_RUN = ("model", "task", "steps", "prompts_per_step", "group_size", "lr")  # --help's first group


def help_order(cls, parser) -> list:
    """(field, argparse group) in --help's order: the options a first run sets, then the script's own (its
    algorithm's), then each base class's (every trainer's, the task's, the tools', ...), under headings."""
    fields, out = {f.name: f for f in dataclasses.fields(cls)}, []
    first = [fields[n] for n in FIRST_RUN if n in fields]
    if first:
        group = parser.add_argument_group("a first run")
        out += [(f, group) for f in first]
    for c in cls.__mro__:
        taken = {f.name for f, _ in out}
        own = [fields[n] for n in inspect.get_annotations(c) if n in fields and n not in taken]
        if not own:
            continue
        doc = c.__doc__ or ""
        if doc.startswith(f"{c.__name__}("):  # a dataclass without its own docstring: a script's Args
            title = f"{script_name(c)}'s own"
        else:
            title = doc.split("\n")[0].split(" (")[0].rstrip(":.")
        group = parser.add_argument_group(title)
        out += [(f, group) for f in own]
    return out


def script_name(cls) -> str:
    """The file of a script's Args: train_x.py."""
    return os.path.basename(sys.argv[0] if cls.__module__ == "__main__" else f"{cls.__module__}.py")


def boolean(text: str) -> bool:
    if text.lower() in ("true", "yes", "1"):
        return True
    if text.lower() in ("false", "no", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def config_flags(path: str, cls) -> list:
    """The options of a YAML or JSON file as command-line flags; one line naming the file if it cannot be
    read."""
    if path.startswith("--"):
        raise SystemExit("--config needs a file: --config run.yaml (YAML or JSON)")
    if not os.path.isfile(path):
        raise SystemExit(f"--config {path}: file not found")
    import yaml
    yaml_file = path.endswith((".yaml", ".yml"))
    with open(path) as f:
        try:
            cfg = (yaml.safe_load(f) if yaml_file else json.load(f)) or {}
        except (yaml.YAMLError, json.JSONDecodeError) as e:
            raise SystemExit(f"--config {path}: not valid {'YAML' if yaml_file else 'JSON'}: "
                             f"{' '.join(str(e).split())}") from None
    if not isinstance(cfg, dict):
        raise SystemExit(f"--config {path}: expected a mapping of option: value, got a {type(cfg).__name__}")
    unknown = sorted(set(cfg) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
        raise SystemExit(f"--config {path}: unknown option(s) {unknown}")
    nested = sorted(k for k, v in cfg.items() if isinstance(v, (dict, list)))
    if nested:
        raise SystemExit(f"--config {path}: option(s) {nested} need a single value")
    return [x for k, v in cfg.items() if v is not None for x in (f"--{k}", str(v))]


def check_ranks(args) -> None:
    """torchrun: every rank must do the same work (the same forwards, backwards and optimizer steps), or a
    collective waits for a rank that never comes. Checked when a training run starts."""
    ranks = world_size()
    if args.prompts_per_step % ranks:
        raise SystemExit(f"--prompts_per_step {args.prompts_per_step} must be a multiple of the number of "
                         f"ranks ({ranks}, torchrun): each rank samples the same share of the prompts")
    per_rank = args.prompts_per_step // ranks * args.group_size
    if per_rank % args.minibatches:
        raise SystemExit(f"--minibatches {args.minibatches} must divide each rank's completions per step, "
                         f"prompts_per_step / ranks * group_size = {per_rank}")


