"""Where the time of a step goes, and what packing, prefix sharing and the HF sampling loop are worth:
three tables (Markdown), one thread, fp32 CPU unless --device says otherwise.

    python benchmarks/speed.py                       # all three tables, about 10 minutes on 2 CPU cores
    python benchmarks/speed.py --tables update       # only the update table
    python benchmarks/speed.py --model /path/to/Qwen2.5-0.5B --device cuda --dtype bfloat16 --tables update

1. update: one rollout batch's forward + backward as the trainer runs it (micro-batches of whole groups),
   packed (one padding-free sequence per micro-batch, each prompt once) against padded rows (--packing false),
   on synthetic long-tailed completion lengths (log-uniform in [8, 256] tokens by default) and fixed ones.
2. sampling: the HF engine's loop (one prefill per prompt, finished sequences leave the batch) against
   transformers' generate on the same model, prompts and budget (the random-init tiny model's completions
   run to their EOS, which it samples rarely: a long tail).
3. scaling: train_grpo.py steps (tiny model, addition, HF engine) against prompts per step and G.
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import common  # noqa: E402
import rewards  # noqa: E402
from rlmini import engine, logprobs, models, packing  # noqa: E402


def load(args, packing: bool):
    a = common.parse_args(common.Args, ["--model", args.model, "--packing", str(packing).lower()])
    task = rewards.load_task("addition", models.prompt_style(args.model), 0)
    model, tok, _ = models.load_model(a, task, torch.device(args.device), torch.float32)
    return model, tok


def synthetic(n_prompts, G, prompt_len, lengths, vocab, seed=0):
    """Rollout-shaped token lists: n_prompts prompts of prompt_len tokens, G completions each, lengths from
    `lengths` ("loguniform:LO:HI", log-uniform in [LO, HI], or a fixed number)."""
    g = torch.Generator().manual_seed(seed)
    prompts, completions = [], []
    for _ in range(n_prompts):
        p = torch.randint(2, vocab, (prompt_len,), generator=g).tolist()
        for _ in range(G):
            if lengths.startswith("loguniform:"):
                lo, hi = map(int, lengths.split(":")[1:])
                u = torch.rand(1, generator=g).item()
                n = int(math.exp(math.log(lo) + u * (math.log(hi) - math.log(lo))))
            else:
                n = int(lengths)
            prompts.append(p)
            completions.append(torch.randint(2, vocab, (n,), generator=g).tolist())
    return prompts, completions


def time_update(model, prompts, completions, micro, device, dtype, reps):
    """Seconds (median of reps) of forward + backward over every micro-batch, and (computed, padded) tokens.
    """
    times, computed, padded = [], 0, 0
    for r in range(reps + 1):
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        computed = padded = 0
        for s in range(0, len(prompts), micro):
            batch = packing.make_batch(prompts[s:s + micro], completions[s:s + micro], 0, device)
            with common.autocast(device, dtype):
                logp, _ = logprobs.token_logprobs(model, batch, 1.0)
            logp.sum().backward()
            c, p = packing.padded_tokens(batch, model)
            computed, padded = computed + c, padded + p
        if device.type == "cuda":
            torch.cuda.synchronize()
        if r:  # the first is warm-up
            times.append(time.perf_counter() - t)
    return statistics.median(times), computed, padded


def table_update(args):
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    models = {True: load(args, True)[0], False: load(args, False)[0]}
    vocab = models[True].config.vocab_size
    print("\n### Update: forward + backward of one rollout batch (micro-batches of whole groups)\n")
    print("| prompts x G | prompt tokens | completion tokens | layout | token positions computed | padding "
          "share | s | speed-up |")
    print("|---|---|---|---|---|---|---|---|")
    cases = [(32, 8, 4, "3"), (32, 8, 64, "loguniform:8:256"), (16, 16, 64, "loguniform:8:256"),
             (32, 8, 16, "32"), (32, 8, 16, "128"), (8, 8, 256, "loguniform:8:256")]
    for n, G, P, lengths in cases:
        prompts, completions = synthetic(n, G, P, lengths, vocab)
        L = [len(c) for c in completions]
        res = {}
        for packed in (False, True):
            res[packed] = time_update(models[packed], prompts, completions, args.micro_batch_size, device,
                                      dtype,
                                      args.reps)
        for packed in (False, True):
            s, computed, padded = res[packed]
            print(f"| {n} x {G} | {P} | {lengths.replace('loguniform', 'log-uniform')} (mean "
                  f"{statistics.mean(L):.0f}, max {max(L)}) | {'packed' if packed else 'padded'} "
                  f"| {computed:,} | {padded / computed:.1%} | {s:.3f} | {res[False][0] / s:.2f}x |",
                  flush=True)


def table_sampling(args):
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    model, tok = load(args, True)
    sampler = engine.HFEngine(model, tok, device, dtype)
    from transformers import GenerationConfig
    print("\n### HF engine sampling: our loop against transformers' generate (same prompts, budget, "
          "temperature 1)\n")
    print("| prompts x G | max new tokens | ours s | generate s | speed-up | mean / max length (ours) |")
    print("|---|---|---|---|---|---|")
    vocab = model.config.vocab_size
    for n, G, budget in [(32, 8, 4), (32, 8, 64), (32, 8, 256), (8, 32, 256)]:
        prompts = synthetic(n, 1, 8, "1", vocab)[0]
        ours, theirs = [], []
        for r in range(args.reps + 1):
            t = time.perf_counter()
            out = sampler.generate(prompts, G, budget, 1.0, r)
            if r:
                ours.append(time.perf_counter() - t)
            ids = torch.tensor([p for p in prompts for _ in range(G)])  # equal lengths: no padding needed
            gen = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=budget,
                                   eos_token_id=sampler.tokenizer.eos_token_id, pad_token_id=sampler.pad_id,
                                   use_cache=True)
            model.eval()
            t = time.perf_counter()
            with torch.no_grad(), common.autocast(device, dtype):
                model.generate(input_ids=ids.to(device), attention_mask=torch.ones_like(ids).to(device),
                               generation_config=gen)
            if r:
                theirs.append(time.perf_counter() - t)
            model.train()
        L = [len(c) for c in out.completion_ids]
        a, b = statistics.median(ours), statistics.median(theirs)
        print(f"| {n} x {G} | {budget} | {a:.3f} | {b:.3f} | {b / a:.2f}x | {statistics.mean(L):.1f} / "
              f"{max(L)} |",
              flush=True)


def table_scaling(args):
    print("\n### Scaling: train_grpo.py steps (tiny model, addition, HF engine, fp32, one thread)\n")
    print("| prompts/step | G | completions/step | s/step | rollout s | update s | steps/s |")
    print("|---|---|---|---|---|---|---|")
    for n, G in [(8, 8), (32, 8), (128, 8), (32, 4), (32, 16)]:
        with tempfile.TemporaryDirectory() as out:
            env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
            subprocess.run([sys.executable, os.path.join(ROOT, "train_grpo.py"), "--engine", "hf", "--steps",
                            str(args.steps), "--prompts_per_step", str(n), "--group_size", str(G),
                            "--out_dir", out,
                            "--run_name", "s", "--wandb", "false", "--save_every", "0"], check=True, env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            with open(os.path.join(out, "s", "metrics.jsonl")) as f:
                m = [json.loads(line) for line in f][5:]
        mean = lambda k: statistics.mean(r[k] for r in m)  # noqa: E731
        step = mean("time/rollout") + mean("time/update") + mean("time/push")
        print(f"| {n} | {G} | {n * G} | {step:.3f} | {mean('time/rollout'):.3f} | {mean('time/update'):.3f} "
              f"| {1 / step:.2f} |", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tables", default="update,sampling,scaling")
    p.add_argument("--model", default="tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--micro_batch_size", type=int, default=64)
    p.add_argument("--reps", type=int, default=3, help="timed repetitions (median), after one warm-up")
    p.add_argument("--steps", type=int, default=25, help="scaling: steps per run (the first 5 left out)")
    args = p.parse_args()
    torch.set_num_threads(1 if args.device == "cpu" else torch.get_num_threads())
    torch.manual_seed(0)
    for name in args.tables.split(","):
        {"update": table_update, "sampling": table_sampling, "scaling": table_scaling}[name](args)


if __name__ == "__main__":
    main()
