"""Every reasoning-gym generator, timed and checked once on this machine: the seconds to make 1,000 items with
its default config (create_dataset, then each item; CPU seconds of the process, which other load on a shared
machine barely moves, and wall-clock), and the gold-answer check: each item's gold answer wrapped as the
extraction rule reads it (rewards.py::rg_extract, chat style) and scored by the task's own scorer
(rewards.py::rg_task) must score 1.0. A generator over --limit s is supported only behind --rg_allow_slow
(rewards.RG_SLOW); one over --cpu_limit CPU seconds is stopped and reported as such.

    python benchmarks/rg_generators.py [--items 1000] [--limit 2] [--cpu_limit 15] [--out rg_generators.json]

Prints a Markdown table (docs/tasks.md lists its result) and the RG_SLOW dict for rewards.py."""
import argparse
import json
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def one(name: str, items: int, cpu_limit: float) -> None:
    """Time `items` items of generator `name` (printed at once), then check every gold answer through the
    task's scorer; the kernel stops the process after `cpu_limit` CPU seconds (RLIMIT_CPU)."""
    import resource
    resource.setrlimit(resource.RLIMIT_CPU, (int(cpu_limit), int(cpu_limit) + 1))
    import rewards
    rewards.rg_registry()  # imports reasoning_gym: not the generator's time
    cpu, wall = time.process_time(), time.perf_counter()
    ds = rewards.rg_dataset(name, {}, 1234, items)
    entries = [ds[i] for i in range(items)]
    out = {"cpu_s": time.process_time() - cpu, "wall_s": time.perf_counter() - wall,
           "answer_none": sum(e["answer"] is None for e in entries)}
    print(f"\nRESULT {json.dumps(out)}", flush=True)  # a generator may print to stdout itself
    task = rewards.rg_task(name, "chat", 0, size=items)
    checked = [e for e in task.train + task.test if e["answer"] is not None]
    scores = [task.score(f"<answer>{e['answer']}</answer>", e, True) for e in checked]
    out = {"checked": len(checked), "gold_1": sum(s.reward == 1.0 for s in scores),
           "gold_min": min((s.reward for s in scores), default=None),
           "scorer_errors": task.stats["task/scorer_errors"]}
    print(f"\nRESULT {json.dumps(out)}", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--items", type=int, default=1000)
    p.add_argument("--limit", type=float, default=2.0, help="supported: under this many CPU seconds")
    p.add_argument("--cpu_limit", type=float, default=15.0,
                   help="a generator's process is stopped after this many CPU seconds (timing and check)")
    p.add_argument("--only", default="", help="comma-separated generators (default: all)")
    p.add_argument("--out", default="")
    p.add_argument("--one", default="", help=argparse.SUPPRESS)  # the child process: one generator
    a = p.parse_args()
    if a.one:
        one(a.one, a.items, a.cpu_limit)
        return
    import torch
    torch.set_num_threads(2)
    import rewards
    names = a.only.split(",") if a.only else sorted(rewards.rg_registry())
    rows = []
    for name in names:  # one process each: a slow generator is stopped, and none warms another's caches
        cmd = [sys.executable, __file__, "--one", name, "--items", str(a.items), "--cpu_limit",
               str(a.cpu_limit)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        row = {"name": name, "cpu_s": None, "stopped": a.cpu_limit}
        for line in proc.stdout.splitlines():
            row.update(json.loads(line[7:]) if line.startswith("RESULT ") else {})
        if proc.returncode not in (0, -signal.SIGXCPU, -signal.SIGKILL):
            row["error"] = (proc.stderr.strip() or "no output").splitlines()[-1][:200]
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    print("| generator | CPU s / 1,000 | wall s | gold 1.0 / checked | answer None | supported |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        ok = r.get("cpu_s") is not None and r["cpu_s"] < a.limit
        t = f"{r['cpu_s']:.2f}" if r.get("cpu_s") is not None else f"> {a.cpu_limit:.0f} (stopped)"
        gold = f"{r['gold_1']} / {r['checked']}" if "checked" in r else r.get("error", "not run (stopped)")
        print(f"| {r['name']} | {t} | {r.get('wall_s', float('nan')):.2f} | {gold} | "
              f"{r.get('answer_none', '')} | {'yes' if ok else 'no'} |")
    slow = {r["name"]: round(r["cpu_s"], 1) if r.get("cpu_s") is not None else r["stopped"] for r in rows
            if r.get("cpu_s") is None or r["cpu_s"] >= a.limit}
    print(f"\nRG_SLOW = {slow}")
    if a.out:
        json.dump(rows, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
