"""How close a GRPO step comes to what one CPU thread can do: the FLOPs a step needs against a one-thread
fp32 matmul benchmark on the same machine.

    python benchmarks/flops.py --json r.json          # the steps benchmarks/vs_trl.py --json measured
    python benchmarks/flops.py --model smollm2 --prompt_tokens 49 --completion_tokens 20 --prompts 8 --group 8

The FLOPs a step needs, from the tokens each step really had (each group's prompt length and its G completion
lengths, as vs_trl.py records them for both sides), with nothing wasted: the prompt computed once per group,
no padding, no recomputation. Only matrix products count (2 FLOPs a multiply-add): per position the linear
layers (q, k, v, o, gate, up, down) of every layer, and per key attended the QK and AV products of every
layer (4 x heads x head_dim); the LM head (hidden x vocabulary) only where a log-probability is needed.

- rollout (sampling): the prefill of the prompt once per group, then for each completion its tokens but the
  last one fed back one at a time, each attending to the prompt and the completion so far; the LM head on the
  prompt's last position once per group (its G samples share the distribution) and on each fed-back token.
- update: the same positions, keys and LM-head rows (a completion token's log-probability comes from the
  position before it; the last sampled token feeds nothing) forward, and twice that backward: 3x.

The limit: one thread (torch.set_num_threads(1)) multiplying fp32 matrices of the model's shapes: for
each linear layer and the LM head, [M x in] @ [in x out] forward and, for the update, both products of its
backward ([M x out] @ [out x in], [in x M] @ [M x out]), M the tokens of a step's micro-batch (the update) or
the rows of a decoding step (the rollout); best of --reps CPU-timed runs, weighted by how often each shape
occurs per token. The share of the limit = needed FLOPs / measured CPU-seconds / the limit.
"""
import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def dims(path: str) -> dict:
    cfg = json.load(open(os.path.join(path, "config.json")))
    heads = cfg["num_attention_heads"]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return {"hidden": cfg["hidden_size"], "inter": cfg["intermediate_size"],
            "layers": cfg["num_hidden_layers"], "heads": heads,
            "kv_heads": cfg.get("num_key_value_heads", heads), "head_dim": hd,
            "vocab": cfg["vocab_size"]}


def linear_shapes(d: dict) -> list:
    """(in, out, count per token) of every matrix product of one position, the LM head apart."""
    h, q, kv = d["hidden"], d["heads"] * d["head_dim"], d["kv_heads"] * d["head_dim"]
    n = d["layers"]
    return [(h, q, n), (h, kv, 2 * n), (q, h, n), (h, d["inter"], 2 * n), (d["inter"], h, n)]


def per_token(d: dict) -> dict:
    """FLOPs of one position's linear layers, one LM-head row, one attended key (all layers)."""
    return {"body": sum(2 * i * o * n for i, o, n in linear_shapes(d)), "head": 2 * d["hidden"] * d["vocab"],
            "key": 4 * d["heads"] * d["head_dim"] * d["layers"]}


def forward_counts(groups: list) -> dict:
    """Positions, LM-head rows and attended keys a forward needs for groups [[prompt_len, [completion lens]]]:
    the prompt once, each completion's tokens but its last one after it (see the module's docstring)."""
    pos = rows = keys = 0
    for p, cs in groups:
        fed = [max(c - 1, 0) for c in cs]
        pos += p + sum(fed)
        rows += (1 if any(cs) else 0) + sum(fed)
        keys += p * (p + 1) // 2 + sum(f * p + f * (f + 1) // 2 for f in fed)
    return {"positions": pos, "head_rows": rows, "keys": keys}


def step_flops(d: dict, groups: list) -> dict:
    """The FLOPs of one step: rollout (a forward's worth, decoded) and update (3 forwards' worth)."""
    n, t = forward_counts(groups), per_token(d)
    fwd = n["positions"] * t["body"] + n["head_rows"] * t["head"] + n["keys"] * t["key"]
    return {"rollout": fwd, "update": 3 * fwd, "head_share": n["head_rows"] * t["head"] / fwd,
            "attention_share": n["keys"] * t["key"] / fwd, **n}


def computed_flops(d: dict, groups: list, side: str) -> dict:
    """What each side computes by its design, an estimate from the same tokens (attention counted causal).
    ours: the prefill of each prompt once, left-padded to the step's longest, finished completions leaving
    the decoding batch (rlmini/engine.py::HFEngine); the update packed (each prompt once, every completion's
    last token too), the LM head on every completion token and recomputed in the backward (checkpointed
    chunks: rlmini/logprobs.py::token_logprobs). TRL: transformers' generate on G copies of each prompt, every
    row computed until the step's longest completion ends; the update padded to the step's longest prompt and
    completion, the LM head on completion-length + 1 positions of every row."""
    t = per_token(d)
    width, longest = max(p for p, _ in groups), max(c for _, cs in groups for c in cs)
    rows = sum(len(cs) for _, cs in groups)
    if side == "ours":
        fed = sum(max(c - 1, 0) for _, cs in groups for c in cs)
        keys = len(groups) * width * (width + 1) // 2 + sum(
            f * width + f * (f + 1) // 2 for _, cs in groups for f in (max(c - 1, 0) for c in cs))
        rollout = (len(groups) * width + fed) * t["body"] + (len(groups) + fed) * t["head"] + keys * t["key"]
        pos = sum(p + sum(cs) for p, cs in groups)
        keys = sum(p * (p + 1) // 2 + sum(c * p + c * (c + 1) // 2 for c in cs) for p, cs in groups)
        head = sum(c for _, cs in groups for c in cs)
        update = 3 * (pos * t["body"] + keys * t["key"]) + 4 * head * t["head"]
    else:
        dec = max(longest - 1, 0)
        keys = rows * (width * (width + 1) // 2 + dec * width + dec * (dec + 1) // 2)
        rollout = rows * ((width + dec) * t["body"] + (1 + dec) * t["head"]) + keys * t["key"]
        n = width + longest
        update = 3 * rows * (n * t["body"] + (longest + 1) * t["head"] + n * (n + 1) // 2 * t["key"])
    return {"rollout": rollout, "update": update}


def matmul_rate(d: dict, m: int, backward: bool, reps: int) -> dict:
    """One thread's fp32 GFLOP/s on the model's shapes at M rows: per shape and weighted per token."""
    import torch
    torch.set_num_threads(1)
    shapes = [*linear_shapes(d), (d["hidden"], d["vocab"], 1)]
    out, flops, seconds = {}, 0.0, 0.0
    for i, o, n in shapes:
        x, w, dy = torch.randn(m, i), torch.randn(i, o), torch.randn(m, o)
        products = [(x, w, torch.empty(m, o))]
        if backward:
            products += [(dy, w.t(), torch.empty(m, i)), (x.t(), dy, torch.empty(i, o))]
        for a, b, c in products:
            torch.mm(a, b, out=c)  # warm
            best = min(_timed(lambda: torch.mm(a, b, out=c)) for _ in range(reps))
            f = 2 * a.shape[0] * a.shape[1] * b.shape[1]
            out.setdefault(f"{i}x{o}", []).append(f / best / 1e9)
            flops, seconds = flops + n * f, seconds + n * best
    return {"mix": flops / seconds / 1e9, "shapes": {k: min(v) for k, v in out.items()}}


def _timed(fn) -> float:
    start = time.thread_time()
    fn()
    return time.thread_time() - start


def model_path(model: str) -> str:
    if os.path.isdir(model):
        return model
    sys.path.insert(0, ROOT)
    import rewards
    from rlmini import models
    return models.model_path(model, rewards.load_task("addition", "tiny", 0))


def measured(report: dict, d: dict) -> dict:
    """Per side: the counted steps' mean tokens, FLOPs and CPU-seconds per phase (over every pair)."""
    skip, out = report["skip"], {}
    for side in ("ours", "trl"):
        steps = [m for pair in report["pairs"] for m in pair[side]["marks"][skip:]]
        f = [step_flops(d, m["groups"]) for m in steps]
        done = [computed_flops(d, m["groups"], side) for m in steps]
        micro_tokens = statistics.mean(x["positions"] for x in f) / (report["config"]["prompts"]
                                                                       * report["config"]["group"]
                                                                       / report["config"]["micro"])
        out[side] = {"steps": len(steps), "micro_tokens": micro_tokens,
                     "len": statistics.mean(c for m in steps for _, cs in m["groups"] for c in cs),
                     "computed_rollout": statistics.mean(x["rollout"] for x in done),
                     "computed_update": statistics.mean(x["update"] for x in done),
                     "prompt": statistics.mean(statistics.mean(p for p, _ in m["groups"]) for m in steps),
                     **{k: statistics.mean(x[k] for x in f) for k in ("rollout", "update", "head_share",
                                                                      "attention_share", "positions")},
                     "rollout_s": statistics.mean(m["rollout"] for m in steps),
                     "update_s": statistics.mean(m["update"] for m in steps),
                     "step_s": statistics.mean(
                         (pair[side]["marks"][-1]["cpu"] - pair[side]["marks"][skip - 1]["cpu"])
                         / (len(pair[side]["marks"]) - skip) for pair in report["pairs"])}
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="benchmarks/vs_trl.py --json's output: its model, tokens and CPU-seconds")
    p.add_argument("--model", default="smollm2", help="without --json: tiny | smollm2 | a model folder")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--prompt_tokens", type=int, default=49)
    p.add_argument("--completion_tokens", type=int, default=20)
    p.add_argument("--micro_tokens", type=int, default=0, help="M of the update's products; 0: from the step")
    p.add_argument("--decode_rows", type=int, default=0,
                   help="M of the rollout's products; 0: prompts x group")
    p.add_argument("--reps", type=int, default=5, help="timed runs of each product (the best counts)")
    args = p.parse_args()
    report = json.load(open(args.json)) if args.json else None
    path = report["config"]["path"] if report else model_path(args.model)
    d = dims(path)
    t = per_token(d)
    print(f"model {path}: {d}\nper position: linear layers {t['body'] / 1e6:.1f} MFLOP, LM head "
          f"{t['head'] / 1e6:.1f} MFLOP a row, attention {t['key'] / 1e3:.1f} kFLOP a key")
    if report:
        sides = measured(report, d)
        c = report["config"]
        rows = args.decode_rows or c["prompts"] * c["group"]
        micro = args.micro_tokens or round(sides["ours"]["micro_tokens"])
    else:
        groups = [[args.prompt_tokens, [args.completion_tokens] * args.group]] * args.prompts
        f = step_flops(d, groups)
        sides = {"config": {**f, "steps": 0}}
        rows = args.decode_rows or args.prompts * args.group
        micro = args.micro_tokens or round(f["positions"] / 2)
    import torch
    print(f"one-thread fp32 matmul (torch {torch.__version__}, best of {args.reps}, CPU time) ...",
          flush=True)
    upd = matmul_rate(d, micro, True, args.reps)
    dec = matmul_rate(d, rows, False, args.reps)
    limit = upd["mix"]
    print(f"\nthe limit: {limit:.1f} GFLOP/s (the model's shapes at M = {micro} rows, forward and backward "
          f"products, weighted per token); at a decoding step's M = {rows} rows, forward: {dec['mix']:.1f}")
    print("| product | GFLOP/s at M = " + str(micro) + " (fwd, dX, dW: the slowest) | forward at M = "
          + str(rows) + " |\n|---|---|---|")
    for k in upd["shapes"]:
        print(f"| {k} | {upd['shapes'][k]:.1f} | {dec['shapes'][k]:.1f} |")
    print()
    for side, s in sides.items():
        if not s["steps"]:
            print(f"per step: rollout {s['rollout'] / 1e9:.1f} GFLOP, update {s['update'] / 1e9:.1f} GFLOP "
                  f"(LM head {s['head_share']:.0%}, attention {s['attention_share']:.1%} of a forward)")
            continue
        print(f"{side}: {s['steps']} steps; prompt {s['prompt']:.1f} tokens, completion {s['len']:.2f} mean; "
              f"LM head {s['head_share']:.0%} and attention {s['attention_share']:.1%} of a forward's FLOPs")
        print("| phase | GFLOP per step (needed) | CPU-s per step | achieved GFLOP/s | share of the limit | "
              "GFLOP computed by design (estimate) |")
        print("|---|---|---|---|---|---|")
        phases = (("rollout", s["rollout"], s["rollout_s"], s["computed_rollout"]),
                  ("update", s["update"], s["update_s"], s["computed_update"]),
                  ("step", s["rollout"] + s["update"], s["step_s"],
                   s["computed_rollout"] + s["computed_update"]))
        for phase, flops, sec, done in phases:
            print(f"| {phase} | {flops / 1e9:.1f} | {sec:.2f} | {flops / sec / 1e9:.1f} | "
                  f"{flops / sec / 1e9 / limit:.0%} | {done / 1e9:.1f} ({done / flops:.2f}x) |")
        print()


if __name__ == "__main__":
    main()
