"""Progress over a long engine call (eval.py's questions): `counting(total, what)` opens it, the engines call
`advance(k)` as completions finish (each engine as it can: vLLM's own per-request bar, the HF engine's
decoding steps, the server engine's requests). Rank 0 shows a bar with its ETA on a terminal, else a line at
a tenth when the last was PRINT_EVERY_S ago or more; nothing is counted outside `counting` (training's
rollouts)."""
import contextlib
import datetime
import sys
import threading
import time

from rlmini import dist

_NOW = {}  # the open count's state (counting yields it): done, total, what, start, printed, tenths, bar
_LOCK = threading.Lock()  # the server engine's request threads advance it
PRINT_EVERY_S = 10.0  # without a terminal: seconds between lines at least (a short evaluation prints none)


@contextlib.contextmanager
def counting(total: int, what: str):
    """Count `total` completions (this rank's) until the block ends; yields the state (its "done")."""
    now = time.perf_counter()
    state = {"done": 0, "total": total, "what": what, "start": now, "printed": now, "tenths": 0, "bar": None}
    if dist.rank() == 0 and total and sys.stderr.isatty():
        from tqdm import tqdm
        state["bar"] = tqdm(total=total, desc=what, unit=" completions", dynamic_ncols=True, leave=False)
    _NOW["state"] = state
    try:
        yield state
    finally:
        if state["bar"] is not None:
            state["bar"].close()
        _NOW.clear()


def active() -> bool:
    return bool(_NOW)


def advance(k: int) -> None:
    """k more completions finished (capped at the total: --vllm_tp's engines finish their group's too)."""
    with _LOCK:
        _advance(k)


def _advance(k: int) -> None:
    s = _NOW.get("state")
    k = min(k, s["total"] - s["done"]) if s is not None else 0
    if k <= 0:  # nothing counted, or this rank had nothing to count (a stand-in row under torchrun)
        return
    s["done"] += k
    if s["bar"] is not None:
        s["bar"].update(k)
    elif dist.rank() == 0 and s["done"] * 10 // s["total"] > s["tenths"]:
        s["tenths"] = s["done"] * 10 // s["total"]
        now = time.perf_counter()
        if now - s["printed"] < PRINT_EVERY_S:
            return
        s["printed"], elapsed = now, now - s["start"]
        left = elapsed / s["done"] * (s["total"] - s["done"])
        clock = lambda x: str(datetime.timedelta(seconds=round(x)))  # noqa: E731
        print(f"{s['what']}: {s['done']}/{s['total']} completions | {clock(elapsed)} | ETA {clock(left)}",
              flush=True)


def vllm_bar(*args, **kwargs):
    """vLLM's progress bars (LLM.generate(use_tqdm=vllm_bar)), silent; the one of finished requests
    (vllm/entrypoints/common/offline.py::_run_engine updates it by a request's completions) counted here."""
    import io

    from tqdm import tqdm

    class Counted(tqdm):
        def update(self, n=1):
            advance(int(n))
            return super().update(n)
    # its other bar counts prompts rendered before sampling ("Rendering prompts"): not completions
    kind = Counted if str(kwargs.get("desc", "")).startswith("Processed") else tqdm
    return kind(*args, **{**kwargs, "file": io.StringIO(), "mininterval": 3600})
