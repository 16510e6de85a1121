"""Where a decoding step's CPU time goes: the HF engine (rlmini/engine.py::HFEngine.generate) sampling one
training batch, under torch's profiler, each operator's self time charged to the part of the step it ran in:
the body (the decoder layers: matrix products, attention, the rest), the LM head, the sampler, and what no
operator accounts for (Python, the cache's bookkeeping). Three variants: `before` (issue 52's starting point:
log_softmax over the vocabulary then torch.multinomial, and transformers' masked sdpa copying the KV cache
per query head), `sampler` (engine.sample_rows, the copy kept) and `after` (today's: engine.sample_rows and
rlmini/packing.py::_grouped_sdpa).

    python benchmarks/profile_decode.py                                   # SmolLM2, 8 prompts x 8, 32 tokens
    python benchmarks/profile_decode.py --model tiny --prompts 32 --max_new_tokens 16

One thread (benchmarks/vs_trl.py's setting), fp32, the vs_trl.py --model smollm2 configuration's batch: a
warm-up batch first, then per variant one batch timed without the profiler (CPU-seconds per decoding step)
and one profiled (the table's wall milliseconds: the profiler adds its own overhead, the shares are what
to read; an idle machine, or the wall clock counts the waits).
Writes <out>/profile_decode.md and one Chrome trace per variant.
"""
import argparse
import contextlib
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
PARTS = ("body", "lm_head", "sampler")


def multinomial_rows(logits, temperature, gen):
    """The engine's sampler before issue 52: a full log-softmax, then one exponential variate per vocabulary
    entry inside torch.multinomial."""
    import torch
    logp = torch.log_softmax(logits.float() / temperature, -1)
    tok = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(1)
    return tok, logp.gather(1, tok[:, None]).squeeze(1)


def labelled(fn, label):
    """`fn` inside a profiler range named `label` (what its operators are charged to)."""
    import torch

    def wrapped(*a, **kw):
        with torch.profiler.record_function(label):
            return fn(*a, **kw)
    return wrapped


def part_of(event) -> str:
    """The labelled range an operator ran in (its nearest ancestor among PARTS), else 'other'."""
    e = event.cpu_parent
    while e is not None:
        if e.name in PARTS:
            return e.name
        e = e.cpu_parent
    return "other ops"


def op_group(name: str) -> str:
    low = name.lower()
    if any(w in low for w in ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear")):
        return "matrix products"
    return "attention" if any(w in low for w in ("attention", "sdpa")) else "rest"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="tiny | smollm2 | a local model folder")
    p.add_argument("--task", default="addition:14")
    p.add_argument("--prompts", type=int, default=8, help="prompts in the batch")
    p.add_argument("--group", type=int, default=8, help="completions per prompt")
    p.add_argument("--max_new_tokens", type=int, default=32)
    p.add_argument("--variants", nargs="+", default=["before", "sampler", "after"],
                   choices=["before", "sampler", "after"], help="what to profile, in this order")
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "profile_decode"), help="table and traces")
    a = p.parse_args(argv)
    import torch
    from torch.profiler import ProfilerActivity, profile

    import common
    import train_grpo
    from rlmini import engine, packing
    torch.set_num_threads(1)
    os.makedirs(a.out, exist_ok=True)
    args = common.parse_args(train_grpo.Args, [
        "--model", a.model, "--task", a.task, "--engine", "hf", "--prompts_per_step", str(a.prompts),
        "--group_size", str(a.group), "--max_new_tokens", str(a.max_new_tokens), "--wandb", "false",
        "--out_dir", a.out, "--run_name", "run", "--overwrite", "true"])
    run = common.setup(args, algo="grpo")
    model = run.engine.model
    body = model.get_decoder()
    body.forward = labelled(body.forward, "body")
    head = model.get_output_embeddings()
    head.forward = labelled(head.forward, "lm_head")
    examples = run.task.train[:a.prompts]
    grouped = packing._grouped_on_cpu
    copied = lambda *a: False  # noqa: E731 (transformers' path: repeat_kv, then sdpa)
    variants = {"before": (multinomial_rows, copied), "sampler": (engine.sample_rows, copied),
                "after": (engine.sample_rows, grouped)}
    common.generate(run, examples, a.group, seed=0)  # warm-up
    lines = [f"# one decoding batch: {a.model}, {a.prompts} prompts x {a.group}, up to {a.max_new_tokens} "
             f"new tokens, HF engine, fp32, 1 thread", ""]
    summary = []
    for name in a.variants:
        sampler, packing._grouped_on_cpu = variants[name]
        engine.sample_rows = labelled(sampler, "sampler")
        start = time.process_time()
        scored = common.generate(run, examples, a.group, seed=1)
        cpu = time.process_time() - start
        steps = max(len(c) for c in scored.rollouts.completion_ids)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            profiled_start = time.perf_counter()  # the profiler's times are wall times
            common.generate(run, examples, a.group, seed=1)
            profiled = time.perf_counter() - profiled_start
        charged = {}
        for e in prof.events():
            if e.name in PARTS or e.name.startswith("ProfilerStep") or e.self_cpu_time_total <= 0:
                continue
            key = (part_of(e), op_group(e.name) if part_of(e) == "body" else "")
            charged[key] = charged.get(key, 0.0) + e.self_cpu_time_total / 1e3
        charged[("python and the rest", "")] = max(profiled * 1e3 - sum(charged.values()), 0.0)
        total = sum(charged.values())
        summary.append((name, cpu / steps * 1e3, charged.get(("sampler", ""), 0) / total))
        lines += [f"## {name}", "",
                  f"{cpu:.2f} CPU-s for the batch unprofiled, {steps} decoding steps: "
                  f"{cpu / steps * 1e3:.1f} ms a step (profiled, wall: {profiled / steps * 1e3:.1f} ms)", "",
                  "| part | operators | ms a step (profiled) | share |", "|---|---|---|---|"]
        for (part, group), ms in sorted(charged.items(), key=lambda x: -x[1]):
            lines.append(f"| {part} | {group or '-'} | {ms / steps:.2f} | {ms / total:.1%} |")
        lines.append("")
        prof.export_chrome_trace(os.path.join(a.out, f"decode-{name}.trace.json"))
    lines += ["| variant | ms a decoding step (unprofiled) | sampler's share |", "|---|---|---|"]
    lines += [f"| {n} | {ms:.1f} | {share:.1%} |" for n, ms, share in summary]
    text = "\n".join(lines)
    with open(os.path.join(a.out, "profile_decode.md"), "w") as f:
        f.write(text + "\n")
    print(text, flush=True)
    with contextlib.suppress(Exception):
        run.engine.sleep()


if __name__ == "__main__":
    main()
