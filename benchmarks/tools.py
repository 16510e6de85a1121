"""What a tool call costs on this machine: the python tool (a fresh interpreter per call,
rlmini/tools.py::python) under each --tool_sandbox mode, and the calculator (in process), run through
tools.run_calls with 1 and --tool_workers at a time, as a step's batch of calls runs them.

    python benchmarks/tools.py [--calls 64] [--workers 1,4,8] [--sandbox namespaces,landlock,none]

Per row: wall-clock seconds for the batch, calls per second, and the mean and median seconds a call took
inside its worker (spawn, confinement, limits, the code, clean-up)."""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from rlmini import sandbox, tools  # noqa: E402

CODE = {"python": "37 * 48 % 7", "calculator": "37 * 48 % 7"}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=64)
    p.add_argument("--workers", default="1,4,8")
    p.add_argument("--sandbox", default="namespaces,landlock,none", help="--tool_sandbox modes to time")
    a = p.parse_args()
    print(f"{a.calls} calls of `{CODE['python']}`, {os.cpu_count()} CPUs\n")
    print("| tool | --tool_sandbox | workers | batch s | calls/s | s per call (mean, median; in its worker) "
          "|")
    print("|---|---|---|---|---|---|")
    runs = [("python", m) for m in a.sandbox.split(",")] + [("calculator", "-")]
    for name, mode in runs[:-1]:
        sandbox.plan(mode)  # a mode this machine lacks: its one-line refusal, before anything is timed
    for name, mode in runs:
        for w in [int(x) for x in a.workers.split(",")]:
            box = tools.Toolbox({"python": tools.python, "calculator": tools.calculator}, workers=w,
                                sandbox=mode if mode != "-" else "none")
            tools.run_calls(box, [(name, CODE[name])])  # the probe, once per mode, is not a call's cost
            start = time.perf_counter()
            out = tools.run_calls(box, [(name, CODE[name])] * a.calls)
            wall = time.perf_counter() - start
            assert all(r.text.strip() == "5" for r in out), out[0]
            per = sorted(r.seconds for r in out)
            print(f"| {name} | {mode} | {w} | {wall:.2f} | {a.calls / wall:.0f} | {sum(per) / len(per):.4f}, "
                  f"{per[len(per) // 2]:.4f} |")


if __name__ == "__main__":
    main()
