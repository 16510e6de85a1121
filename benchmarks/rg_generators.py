"""Every reasoning-gym generator, timed and checked once on this machine: the CPU seconds to make 1,000 items
with its default config (create_dataset, then each item; CPU time of the process, which other load on a
shared machine barely moves), and the gold-answer check: each item's gold answer wrapped in <answer> tags,
extracted by the task's rule (rlmini/rg.py::rg_extract) and scored by the generator's score_answer, must score
1.0. A generator over --limit CPU seconds is supported only behind --rg_allow_slow (rg.RG_SLOW); one
still running after --cpu_limit CPU seconds is stopped (a profiling timer) and reported as such.

    python benchmarks/rg_generators.py [--items 1000] [--limit 2] [--cpu_limit 15] [--out rg_generators.json]

Prints a Markdown table (docs/tasks.md lists its result) and the RG_SLOW dict for rlmini/rg.py."""
import argparse
import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from rlmini import rg  # noqa: E402


class Stopped(BaseException):
    """The generator used up its CPU seconds (not an Exception: generators retry on those)."""


def _stop(signum, frame):
    raise Stopped()


def one(name: str, items: int, cpu_limit: float) -> dict:
    """CPU seconds for `items` items of generator `name`, then the gold-answer check on them."""
    # SIGPROF after cpu_limit CPU seconds of this process, then every 0.5 s (a bare except may swallow one)
    signal.setitimer(signal.ITIMER_PROF, cpu_limit, 0.5)
    try:
        cpu = time.process_time()
        ds = rg.rg_dataset(name, {}, 1234, items)
        entries = [ds[i] for i in range(items)]
        out = {"name": name, "cpu_s": time.process_time() - cpu}
        checked = [e for e in entries if e["answer"] is not None]
        scores = [ds.score_answer(rg.rg_extract(f"<answer>{e['answer']}</answer>", "chat", True), e)
                  for e in checked]
        out.update(answer_none=items - len(checked), checked=len(checked),
                   gold_1=sum(s == 1.0 for s in scores), gold_min=min(scores, default=None))
    except Stopped:
        out = {"name": name, "cpu_s": out["cpu_s"] if "out" in locals() else None, "stopped": cpu_limit}
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--items", type=int, default=1000)
    p.add_argument("--limit", type=float, default=2.0, help="supported: under this many CPU seconds")
    p.add_argument("--cpu_limit", type=float, default=15.0,
                   help="a generator is stopped after this many CPU seconds (timing and check)")
    p.add_argument("--only", default="", help="comma-separated generators (default: all)")
    p.add_argument("--out", default="")
    a = p.parse_args()
    signal.signal(signal.SIGPROF, _stop)
    names = a.only.split(",") if a.only else sorted(rg.rg_registry())  # imports reasoning_gym first
    one("chain_sum", 10, a.cpu_limit)  # the first dataset of a process pays ~0.8 s of lazy set-up: not timed
    rows = []
    for name in names:
        rows.append(one(name, a.items, a.cpu_limit))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(f"| generator | CPU s / {a.items:,} items | gold answers scoring 1.0 | answer None | supported |")
    print("|---|---|---|---|---|")
    for r in rows:
        ok = r.get("cpu_s") is not None and r["cpu_s"] < a.limit
        t = f"{r['cpu_s']:.2f}" if r.get("cpu_s") is not None else f"> {a.cpu_limit:.0f} (stopped)"
        gold = f"{r['gold_1']} / {r['checked']}" if "checked" in r else "not checked (stopped)"
        print(f"| {r['name']} | {t} | {gold} | {r.get('answer_none', '')} | {'yes' if ok else 'no'} |")
    slow = {r["name"]: round(r["cpu_s"], 1) if r.get("cpu_s") is not None else r["stopped"] for r in rows
            if r.get("cpu_s") is None or r["cpu_s"] >= a.limit}
    print(f"\nRG_SLOW = {slow}")
    if a.out:
        json.dump(rows, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
