"""Packed attention at real lengths on this CPU: the row sets (sdpa per row set, the CPU default) against
FlexAttention over the block mask (the CUDA default; compiled here for a fixed shape, since torch has no CPU
kernel for FlexAttention's backward or for dynamic shapes). G completions of L tokens after one prompt of
P tokens, Qwen2.5-1.5B's attention shape scaled down in heads (H query heads, KV heads, head_dim 128).

    python benchmarks/attention.py [--lengths 1024,2048,4096,8192] [--group 4] [--prompt 256]

Per row: the layout's own tensors (row sets: index and [rows, Lq, Lk] mask tensors; flex: four spans and
positions of N entries, plus the block tables) counted by construction, the forward's time (second call),
and the process's peak resident memory above its start (each measurement in its own process; for flex it
includes torch.compile's own, a few hundred MB)."""
import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def layout_bytes(packed) -> int:
    rows = packed["rows"]
    if isinstance(rows, list):
        return sum(t.numel() * t.element_size() for r in rows for t in r)
    mask = rows.block_mask(None)
    tensors = [rows.spans, rows.pos, rows.offset, mask.kv_num_blocks, mask.kv_indices,
               mask.full_kv_num_blocks, mask.full_kv_indices]
    return sum(t.numel() * t.element_size() for t in tensors)


def measure(kernel: str, length: int, group: int, prompt: int, heads: int, kv_heads: int) -> dict:
    from torch.nn.attention.flex_attention import flex_attention

    from rlmini import packing
    start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.perf_counter()
    batch = packing.make_batch([[5] * prompt] * group, [[6] * length] * group, 0, torch.device("cpu"),
                               kernel=kernel)
    build = time.perf_counter() - t
    n = batch["packed"]["computed"]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, n, 128, generator=g)
    k, v = (torch.randn(1, kv_heads, n, 128, generator=g) for _ in range(2))
    if kernel == "flex":
        compiled = torch.compile(flex_attention)  # a fixed shape: CPU inductor fails on dynamic ones here

        def run():
            return compiled(q, k, v, block_mask=batch["packed"]["rows"].block_mask(None), enable_gqa=True)
    else:
        attention = packing.packed_attention(None)

        def run():
            return attention(None, q, k, v, None, packed_rows=batch["packed"]["rows"])[0]
    run()
    t = time.perf_counter()
    run()
    forward = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"kernel": kernel, "L": length, "N": n, "layout_MB": layout_bytes(batch["packed"]) / 2**20,
            "build_s": build, "forward_s": forward, "peak_rss_MB": (peak - start) / 1024}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="1024,2048,4096,8192")
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv_heads", type=int, default=2)
    p.add_argument("--one", default="", help=argparse.SUPPRESS)  # kernel,length: measure in this process
    a = p.parse_args()
    if a.one:
        kernel, length = a.one.split(",")
        print(json.dumps(measure(kernel, int(length), a.group, a.prompt, a.heads, a.kv_heads)))
        return
    print(f"G={a.group} completions of L tokens after a {a.prompt}-token prompt; {a.heads} query heads, "
          f"{a.kv_heads} KV heads, head_dim 128; fp32 forward, {torch.get_num_threads()} threads")
    print("| L | N | kernel | layout MB | build s | forward s | peak RSS MB |")
    print("|---|---|---|---|---|---|---|")
    for length in map(int, a.lengths.split(",")):
        for kernel in ("rows", "flex"):
            argv = [sys.executable, __file__, "--one", f"{kernel},{length}", "--group", str(a.group),
                    "--prompt", str(a.prompt), "--heads", str(a.heads), "--kv_heads", str(a.kv_heads)]
            out = subprocess.run(argv, capture_output=True, text=True)
            if out.returncode:
                print(f"| {length} | | {kernel} | failed: {out.stderr.strip().splitlines()[-1][:80]} |")
                continue
            r = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"| {length} | {r['N']} | {kernel} | {r['layout_MB']:.2f} | {r['build_s']:.3f} | "
                  f"{r['forward_s']:.3f} | {r['peak_rss_MB']:.0f} |")


if __name__ == "__main__":
    main()
