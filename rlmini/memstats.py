"""What each phase of a step held on the GPU, measured (CUDA only): the `memory/*` metrics logged beside the
memory plan's figures (rlmini/memplan.py::plan), true while vLLM sleeps.

vLLM's sleep-mode tensors live in a torch MemPool fed by its own allocator
(vllm/device_allocator/cumem.py::CuMemAllocator.use_memory_pool). Sleep unmaps their pages
(CuMemAllocator.sleep: unmap_and_release, data.is_asleep = True) but the tensors stay alive, so torch's
allocator still counts them as allocated and reserved; vLLM itself measures with mem_get_info for this reason
(vllm/utils/mem_utils.py::memory_profiling, "memory_reserved() ... goes negative when pluggable allocators
(e.g. cumem) bypass PyTorch's tracking"). mem_get_info is true but instant, and a phase's peak is wanted, so:
a phase's peak is torch's peak (max_memory_allocated) less the bytes that slept throughout it, the fewest
asleep at any reading in the phase (`track`, called by the engine at each sleep and wake-up). Torch counts
the pool's tensors as allocated from creation to the end, awake or not, so what torch counts beyond the
trainer's own is constant and the sleeping share of it is not on the device. The sleeping bytes are read
from the pool's own segments (torch's MemPool.snapshot: allocated_size, total_size per segment, the way
CuMemAllocator._trim reads them) of the allocations vLLM marks asleep (CuMemAllocator.pointer_to_data).
"""
import math
import sys

import torch

PHASES = ("rollout", "update", "push")
_fewest = [math.inf, math.inf]  # the fewest (allocated, reserved) bytes asleep since the last phase_end


def asleep() -> tuple:
    """(allocated, reserved) bytes of vLLM's sleep-mode pool that are asleep now: pages unmapped, tensors
    alive (torch counts them). (0, 0) without vLLM's allocator in this process (the HF engine, no sleep)."""
    cumem = sys.modules.get("vllm.device_allocator.cumem")  # never imported here: only if vLLM loaded it
    allocator = getattr(getattr(cumem, "CuMemAllocator", None), "instance", None)
    if allocator is None:
        return 0, 0
    sleeping = {ptr for ptr, data in allocator.pointer_to_data.items() if data.is_asleep}
    allocated = reserved = 0
    for pools in allocator.allocator_and_pools.values():
        for pool, _ in pools:
            for segment in pool.snapshot():
                if segment["address"] in sleeping:
                    allocated += segment["allocated_size"]
                    reserved += segment["total_size"]
    return allocated, reserved


def track() -> None:
    """A reading of what sleeps now, for the peak of the phase under way (the engine calls it before a sleep
    and after a wake-up: the moments the fewest bytes sleep)."""
    if torch.cuda.is_available():
        now = asleep()
        _fewest[:] = [min(a, b) for a, b in zip(_fewest, now)]


def phase_end(name: str, store: dict) -> None:
    """CUDA: the peak of the phase that ends now into `store` as memory/<name>_*_gb, then a new peak begins.
    peak: torch's allocated peak less what slept through the whole phase (the module's docstring); reserved:
    the same for torch's reserved peak; device: the whole device's use now (mem_get_info: the CUDA context,
    NCCL and other processes included; a sleeping page is free there)."""
    if not torch.cuda.is_available():
        return
    track()
    slept = [0 if math.isinf(x) else x for x in _fewest]
    free, total = torch.cuda.mem_get_info()
    store[f"memory/{name}_peak_gb"] = (torch.cuda.max_memory_allocated() - slept[0]) / 1e9
    store[f"memory/{name}_reserved_gb"] = (torch.cuda.max_memory_reserved() - slept[1]) / 1e9
    store[f"memory/{name}_device_gb"] = (total - free) / 1e9
    torch.cuda.reset_peak_memory_stats()
    _fewest[:] = asleep()  # the next phase begins with what sleeps now


def metrics(times: dict, p: dict, engine) -> dict:
    """CUDA: each phase's measured peak (memory/<phase>_peak_gb, _reserved_gb, _device_gb; phase_end) beside
    the plan's (memory/<phase>_plan_gb), this rank's; and the push check's value on the steps it ran
    (push/check_diff). The push phase ends in the engine's push, before vLLM's KV cache wakes
    (engine.py::VLLMEngine.push, its `measured`); an engine without one (HF, server) ends it here."""
    measured = getattr(engine, "measured", None)
    if measured:
        times.update(measured)
        measured.clear()
    else:
        phase_end("push", times)
    out = {k: v for k, v in times.items() if k.startswith("memory/")}
    if out:
        # like with like: the plan's part in torch's allocator, without the CUDA context and NCCL (`outside`)
        out.update({f"memory/{phase}_plan_gb": (p[phase] - p.get("outside", 0.0)) / 1e9 for phase in PHASES})
    diff, engine.last_check = getattr(engine, "last_check", None), None
    if diff is not None:
        out["push/check_diff"] = diff
    return out
