"""What only CUDA runs, against doubles of torch.cuda, vLLM's sleep-mode allocator and torch.distributed: the
memory metrics under vLLM's sleep (rlmini/memstats.py), the eager NCCL communicator (dist.setup_device) and
server mode's free-memory check (server.check_trainer_memory). Unverified on a GPU until one is lent."""
import os
import sys
import types

import pytest
import torch

from rlmini import dist, engine, memstats, server

GB = 1e9


class Device:
    """torch.cuda's counters over one simulated GPU: the trainer's tensors and vLLM's sleep-mode pool. Torch
    counts the pool's tensors as allocated and reserved whether they sleep or not (their blocks stay alive,
    vllm/device_allocator/cumem.py::CuMemAllocator.sleep only unmaps the pages); mem_get_info sees only the
    mapped ones."""

    def __init__(self, pool: dict, total=80 * GB, context=1 * GB):
        self.pool, self.total, self.context = pool, total, context  # pool: tag -> [bytes, asleep]
        self.trainer = self.peak = self.peak_reserved = 0.0
        self.reset_peak_memory_stats()

    def counted(self):  # what torch's allocator counts: the pool's segments hold 1% of slack
        pool = sum(b for b, _ in self.pool.values())
        return self.trainer + pool, self.trainer + 1.01 * pool

    def alloc(self, nbytes):
        self.trainer += nbytes
        allocated, reserved = self.counted()
        self.peak, self.peak_reserved = max(self.peak, allocated), max(self.peak_reserved, reserved)

    def reset_peak_memory_stats(self):
        self.peak, self.peak_reserved = self.counted()

    def mem_get_info(self, device=None):
        mapped = sum(1.01 * b for b, asleep in self.pool.values() if not asleep)
        return self.total - self.context - self.trainer - mapped, self.total

    def install(self, monkeypatch):
        for name in ("mem_get_info", "reset_peak_memory_stats"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: self.peak)
        monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: self.peak_reserved)
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
        # vLLM's allocator as memstats.asleep reads it: pointer_to_data (is_asleep) and each tag's MemPools,
        # whose snapshot() lists segments (torch's MemPool.snapshot, as CuMemAllocator._trim reads it)
        data = {i: Allocation(self.pool, tag) for i, tag in enumerate(self.pool)}
        def segments(i, tag):
            size = self.pool[tag][0]
            return [{"address": i, "allocated_size": size, "total_size": 1.01 * size}]
        pools = {tag: [(types.SimpleNamespace(snapshot=lambda i=i, tag=tag: segments(i, tag)), None)]
                 for i, tag in enumerate(self.pool)}
        allocator = types.SimpleNamespace(pointer_to_data=data, allocator_and_pools=pools)
        cumem = types.SimpleNamespace(CuMemAllocator=types.SimpleNamespace(instance=allocator))
        monkeypatch.setitem(sys.modules, "vllm.device_allocator.cumem", cumem)
        monkeypatch.setattr(memstats, "_fewest", [float("inf")] * 2)


class Allocation:
    """An entry of CuMemAllocator.pointer_to_data: its tag and whether it sleeps."""

    def __init__(self, pool, tag):
        self.pool, self.tag = pool, tag

    @property
    def is_asleep(self):
        return self.pool[self.tag][1]


class LLM:
    """vLLM's LLM as VLLMEngine drives it: sleep(level=2) unmaps every tag, wake_up(tags) maps those."""

    def __init__(self, device):
        self.device = device

    def sleep(self, level):
        for entry in self.device.pool.values():
            entry[1] = True

    def wake_up(self, tags):
        for tag in tags:
            self.device.pool[tag][1] = False

    def apply_model(self, fn):
        return [fn(torch.nn.Linear(1, 1))]


def test_memory_per_phase_is_true_while_vllm_sleeps(monkeypatch):
    """One step of the loop (rollout, sleep, update, push) on a simulated GPU: vLLM's weights 3 GB and KV
    cache 10 GB in its sleep-mode pool; the trainer's 5 GB, plus 1 GB in the rollout, 20 GB of activations
    in the update and 0.5 GB of a gathered parameter in the push. What was on the device: rollout
    5+1+3+10 = 19, update 5+20 = 25 (torch's own peak says 38: it counts the sleeping pool), push
    5+0.5+3 = 8.5, measured before the KV cache wakes (the plan's push phase)."""
    device = Device({"weights": [3 * GB, False], "kv_cache": [10 * GB, False]})
    device.install(monkeypatch)
    tokenizer = types.SimpleNamespace(eos_token_id=1, pad_token_id=0)
    sampler = engine.VLLMEngine(LLM(device), torch.nn.Linear(1, 1), tokenizer, torch.device("cpu"),
                                torch.float32, sleep_mode=True)
    sampler.load = lambda weights: (device.alloc(0.5 * GB), device.alloc(-0.5 * GB))  # one parameter
    times = {}
    device.alloc(5 * GB)  # the trainer's persistent state
    device.reset_peak_memory_stats()
    for step in range(2):
        device.alloc(1 * GB), device.alloc(-1 * GB)  # the rollout's trainer-side tensors
        sampler.sleep()
        memstats.phase_end("rollout", times)  # common.pre_update
        device.alloc(20 * GB), device.alloc(-20 * GB)  # activations
        memstats.phase_end("update", times)  # common.check_sampler
        assert device.peak == 5 * GB + 13 * GB  # torch's view after the update: the pool still counted
        sampler.push()
        m = memstats.metrics(times, {"rollout": 20 * GB, "update": 26 * GB, "push": 9 * GB}, sampler)
        peaks = {phase: round(m[f"memory/{phase}_peak_gb"], 6) for phase in memstats.PHASES}
        assert peaks == {"rollout": 19.0, "update": 25.0, "push": 8.5}, (step, peaks)
        reserved = {phase: round(m[f"memory/{phase}_reserved_gb"], 6) for phase in memstats.PHASES}
        assert reserved == {"rollout": 19.13, "update": 25.0, "push": 8.53}, (step, reserved)
        assert m["memory/update_device_gb"] == pytest.approx(6.0)  # at its end: context and trainer
        assert m["memory/push_device_gb"] == pytest.approx(1 + 5 + 3.03)  # the KV cache still asleep
        assert m["memory/update_plan_gb"] == 26 and not sampler.measured
        assert not any(asleep for _, asleep in device.pool.values())  # the push woke everything


def test_without_sleep_or_vllm_the_peaks_are_torchs_and_on_cpu_nothing_is_logged(monkeypatch):
    sampler = types.SimpleNamespace(last_check=0.25)
    assert memstats.metrics({}, {}, sampler) == {"push/check_diff": 0.25}  # CPU: no memory/*
    device = Device({})  # the HF engine: no sleep-mode pool
    device.install(monkeypatch)
    monkeypatch.setitem(sys.modules, "vllm.device_allocator.cumem", None)
    assert memstats.asleep() == (0, 0)
    times = {}
    device.alloc(7 * GB), device.alloc(-2 * GB)
    for phase in ("rollout", "update"):
        memstats.phase_end(phase, times)
    m = memstats.metrics(times, {"rollout": 8e9, "update": 9e9, "push": 6e9}, sampler)  # the push ends here
    assert (m["memory/rollout_peak_gb"], m["memory/update_peak_gb"], m["memory/push_peak_gb"]) == (7, 5, 5)
    assert m["memory/push_device_gb"] == 80 - 74 and "push/check_diff" not in m  # read once


def test_nccl_communicator_is_made_at_init_and_gloo_is_unchanged(monkeypatch):
    """dist.setup_device under torchrun: on CUDA, init_process_group gets device_id (NCCL forms the
    communicator at once: torch/distributed/distributed_c10d.py::init_process_group) and a barrier follows;
    on CPU, gloo as before."""
    calls = []
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.distributed, "init_process_group",
                        lambda backend, **kw: calls.append((backend, kw)))
    monkeypatch.setattr(torch.distributed, "barrier", lambda **kw: calls.append("barrier"))
    monkeypatch.setattr(dist.atexit, "register", lambda fn: None)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    args = types.SimpleNamespace(dtype="auto", dist_timeout=60)
    assert dist.setup_device(args) == (torch.device("cpu"), torch.float32)
    assert [c[0] for c in calls] == ["gloo"] and "device_id" not in calls[0][1]
    calls.clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    assert dist.setup_device(args) == (torch.device("cuda", 1), torch.bfloat16)
    assert calls[0] == ("set_device", torch.device("cuda", 1))
    backend, kw = calls[1]
    assert backend == "nccl" and kw["device_id"] == torch.device("cuda", 1) and kw["timeout"].seconds == 60
    assert calls[2:] == ["barrier"]


def test_server_mode_names_a_gpu_that_vllm_serve_took(monkeypatch):
    """--engine server: before the model loads, the rank's GPU must have the plan's need free (beyond the CUDA
    context already made); `vllm serve` on the same GPU leaves too little, and the line says so."""
    GiB = 2**30
    plan = {"peak": 41 * GiB}  # memplan.plan's largest phase, the context (1 GiB) included
    args = types.SimpleNamespace(engine="server")
    free = [12.1 * GiB]
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free[0], 79.2 * GiB))
    with pytest.raises(SystemExit) as e:
        server.check_trainer_memory(args, torch.device("cuda", 0), plan)
    assert str(e.value).startswith("--engine server: GPU 0 (rank 0) has 12.1 GiB free of 79.2 GiB but the "
                                   "trainer's memory plan needs 40.0 GiB: is `vllm serve` on the trainer's "
                                   "GPUs? start it with "
                                   "CUDA_VISIBLE_DEVICES"), e.value
    free[0] = 40 * GiB  # exactly the need: enough
    server.check_trainer_memory(args, torch.device("cuda", 0), plan)
    free[0] = 0
    server.check_trainer_memory(types.SimpleNamespace(engine="vllm"), torch.device("cuda", 0), plan)  # vLLM
    server.check_trainer_memory(args, torch.device("cpu"), plan)  # no GPU to check
