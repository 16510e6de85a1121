"""Ranks, devices and collectives under torchrun (the identity in one process), and FSDP2 sharding.

Every batch statistic is built from global sums and counts (all_sum) or from every rank's values in one
process's order (all_gather), never averaged per rank, so each logged metric equals its 1-rank value.
"""
import atexit
import datetime
import hashlib
import math
import os

import torch


def rank() -> int:
    """This process's rank under torchrun (0 on one process)."""
    return int(os.environ.get("RANK", 0))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", 1))


def setup_device(args) -> tuple[torch.device, torch.dtype]:
    """This rank's device and the compute dtype; under torchrun (any number of ranks), starts the process
    group (NCCL on CUDA, gloo on CPU) with a bounded wait: a rank stuck in a collective stops the run with an
    error after --dist_timeout seconds instead of hanging it. On CUDA the NCCL communicator is made now, with
    most of its memory, before the plan reads the free memory and before vLLM sizes its share: device_id
    makes init_process_group create it at once (torch/distributed/distributed_c10d.py::init_process_group,
    "the communicator is immediately formed", eager_connect_single_device) rather than at the first
    collective, and a barrier on it waits for every rank's. Not all: NCCL 2.22+ allocates some algorithms'
    buffers at their first use, and every later new_group (vLLM's included) is split from this one at once,
    with buffers of its own; the plan's NCCL_COMM per communicator bounds both (memplan.plan_for)."""
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if torchrun() and not torch.distributed.is_initialized():
        timeout = _TIMEOUT[0] = datetime.timedelta(seconds=getattr(args, "dist_timeout", 1800))
        cuda = {"device_id": device} if device.type == "cuda" else {}  # gloo: lazy as before, nothing to bind
        torch.distributed.init_process_group("nccl" if cuda else "gloo", timeout=timeout, **cuda)
        atexit.register(_end_process_group)
        if cuda:
            torch.distributed.barrier()  # the bound device's communicator, on every rank, before vLLM starts
    name = args.dtype if args.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    return device, getattr(torch, name)


def barrier() -> None:
    """Every rank has come this far (at the end of a run: every rank has written its last save)."""
    if many_ranks():
        torch.distributed.barrier()


def _end_process_group() -> None:
    """At exit (registered by setup_device), the process group ends before the interpreter does: left to the
    interpreter's own teardown, gloo's threads die unjoined now and then ("terminate called without an active
    exception", SIGABRT) and torchrun reports a finished run as FAILED. Not at the end of a run: a second run
    in the same process would build a new default group on the old one's store keys and hang."""
    if distributed():
        torch.distributed.destroy_process_group()


def distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def torchrun() -> bool:
    """Launched by torchrun, any number of ranks (one included): setup_device starts its process group."""
    return world_size() > 1 or "TORCHELASTIC_RUN_ID" in os.environ


def sharded() -> bool:
    """A process group of several ranks, or torchrun's of one, is up: models are FSDP2-sharded (shard_model),
    checkpoints and final/ saved from shards (rlmini/checkpoint.py). Not in a plain process, where
    distributed() is true too once vLLM has started its own in-process group of one."""
    return distributed() and (torchrun() or torch.distributed.get_world_size() > 1)


def many_ranks() -> bool:
    """A process group of more than one rank: collectives have something to do. (vLLM in one process
    initialises a group of one; a sum or gather over it is the identity, so none is run.)"""
    return distributed() and torch.distributed.get_world_size() > 1


def _comm_device() -> torch.device:
    """Where collective buffers live: NCCL needs CUDA tensors, gloo CPU ones."""
    if torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_sum(values):
    """Sum over ranks, in float64, of a number or of each value of a dict of numbers or 0-d tensors (one
    device's): one all-reduce and one copy to the host for them all. On one process the identity, but that
    tensors become numbers, in one copy (common.StepStats keeps its sums on the device)."""
    keys = sorted(values) if isinstance(values, dict) else [None]
    items = [values[k] if k is not None else values for k in keys]
    held = [i for i, v in enumerate(items) if isinstance(v, torch.Tensor)]
    if many_ranks():
        device = _comm_device()
        t = torch.stack([torch.as_tensor(v, dtype=torch.float64).to(device) for v in items])
        torch.distributed.all_reduce(t)
        items = t.tolist()
    elif held:
        for i, v in zip(held, torch.stack([items[i].double() for i in held]).tolist()):
            items[i] = v
    else:
        return values
    out = dict(zip(keys, items))
    return out if isinstance(values, dict) else out[None]


def all_gather(x: torch.Tensor) -> torch.Tensor:
    """Every rank's tensor concatenated along dim 0 in rank order: the global batch, in the order of one
    process (shard() gives each rank a contiguous block). Every rank passes the same shape."""
    if not many_ranks():
        return x
    if 0 in x.shape[1:]:  # e.g. no --reward functions: empty on every rank alike
        return x.new_empty((x.shape[0] * world_size(), *x.shape[1:]))
    local = x.to(_comm_device())
    parts = [torch.empty_like(local) for _ in range(world_size())]
    torch.distributed.all_gather(parts, local)
    return torch.cat(parts).to(x.device)


def all_gather_ragged(x: torch.Tensor) -> torch.Tensor:
    """Every rank's 1-D tensor concatenated in rank order, whatever their lengths: two tensor collectives (the
    lengths, then the tensors padded to the longest), no pickling."""
    if not many_ranks():
        return x
    lengths = all_gather(torch.tensor([x.numel()], device=x.device)).tolist()
    padded = x.new_zeros(1, max(lengths))
    padded[0, :x.numel()] = x
    parts = all_gather(padded)
    return torch.cat([part[:n] for part, n in zip(parts, lengths)])


def all_gather_objects(items: list) -> list:
    """Every rank's list of picklable objects, concatenated in rank order (lengths may differ)."""
    if not many_ranks():
        return items
    parts = [None] * world_size()
    torch.distributed.all_gather_object(parts, items)
    return [x for part in parts for x in part]


def group_gather_objects(item, size: int) -> list:
    """Every rank's picklable `item` in this rank's group of `size` consecutive ranks (rank // size), in rank
    order; size 1: [item], no collective. Every rank of the world calls it the first time (the groups are
    made then, each by all ranks: torch.distributed.new_group is collective over the world)."""
    if size == 1:
        return [item]
    if size not in _groups:  # gloo: the objects are pickled on the host, whatever the default backend
        made = [torch.distributed.new_group(list(range(first, first + size)), backend="gloo",
                                            timeout=_TIMEOUT[0]) for first in range(0, world_size(), size)]
        _groups[size] = made[rank() // size]
    parts = [None] * size
    torch.distributed.all_gather_object(parts, item, group=_groups[size])
    return parts


_groups = {}  # group_gather_objects': this rank's group, by size
_TIMEOUT = [None]  # --dist_timeout, for groups made later (None: torch's default)


def all_mean_var(x: torch.Tensor) -> tuple[float, float]:
    """Mean and unbiased variance of the values of x on every rank together, in float64 and in two passes (the
    mean first), so that a constant batch has exactly its value as mean and 0 variance."""
    x = x.detach().double().flatten().cpu()
    n = all_sum({"n": x.numel(), "sum": x.sum().item()})
    mean = n["sum"] / n["n"] if n["n"] else float("nan")
    squares = all_sum(((x - mean) ** 2).sum().item())
    return mean, squares / (n["n"] - 1) if n["n"] > 1 else float("nan")


def local_slice(n: int) -> slice:
    """This rank's rows of a gathered batch in which every rank holds n rows."""
    return slice(rank() * n, (rank() + 1) * n)


def shard(items: list) -> list:
    """This rank's contiguous block of a list: rank r of W takes items [r n / W, (r + 1) n / W), so the ranks'
    blocks concatenated in rank order are the list itself (see all_gather)."""
    n, ranks, r = len(items), world_size(), rank()
    return items[r * n // ranks:(r + 1) * n // ranks]


def shard_model(model, dtype):
    """FSDP2 (torch's fully_shard) under torchrun, the identity in a plain process. Each decoder layer (the
    model's `_no_split_modules`) and then the whole model become units whose parameters, gradients and
    optimizer state live sharded over the ranks: a unit all-gathers its parameters for its forward and
    backward and reduce-scatters (averages) the gradients. Mixed precision: the sharded master weights stay
    fp32, compute runs in `dtype`, gradients are reduced in fp32. The root unit keeps its parameters gathered
    from forward to backward (reshard_after_forward=False; FSDP2's own default for the root), so
    token_logprobs' chunked projection, which runs after the forward, reads the whole output embedding, and
    its gradient is reduce-scattered with the root's. In a plain process, vLLM's group of one (started
    before a critic or reference loads) shards nothing: sharded()."""
    if not sharded():
        return model
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    layer_classes = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
    if not layers:
        raise ValueError(f"FSDP2: {type(model).__name__} names no decoder layer class in _no_split_modules")
    for layer in layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy, reshard_after_forward=False)
    return model


def reshard_frozen(model) -> None:
    """A frozen FSDP2 model's root unit reshards after a no-grad pass (FSDPModule.reshard: torch/distributed/
    fsdp/_fully_shard/_fully_shard.py): shard_model keeps it gathered for a backward that never comes. A
    trained model (the policy) and a plain module are left as they are."""
    from torch.distributed.fsdp import FSDPModule
    if isinstance(model, FSDPModule) and not any(p.requires_grad for p in model.parameters()):
        model.reshard()


def reshard(model) -> None:
    """Every FSDP2 unit of `model` sharded again (FSDPModule.reshard) after a forward outside the update (a
    start-up probe): shard_model keeps the root gathered for a backward, and an optimizer built meanwhile
    would get its gathered plain tensors beside the layers' DTensors. A plain module: nothing."""
    from torch.distributed.fsdp import FSDPModule
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a sharded (DTensor) parameter or value, gathered from every rank (a collective:
    every rank calls it, in the same order); a plain tensor as it is."""
    from torch.distributed.tensor import DTensor
    return t.full_tensor() if isinstance(t, DTensor) else t


def clip_grad_norm(parameters: list, max_norm: float) -> float:
    """Clip the global gradient norm (over every rank's shard) to max_norm (0 = off); the norm before
    clipping."""
    norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm or float("inf"))
    return full_tensor(norm).item()


def top_count(share: float, n: int) -> int:
    """ceil(share * n), at least 1: the count of the top `share` of n values."""
    return max(1, math.ceil(share * n - 1e-9))  # 0.2 * 10 is 2.0000000000000004 in floating point


def top_share_threshold(values: list, share: float) -> float:
    """The smallest of the largest ceil(share * N) of the values (a list of tensors, on any device), N counted
    over every rank (values >= it are the top `share`; ties may add a few). Exact: every rank's values are
    gathered."""
    local = torch.cat([v.detach().float().flatten() for v in values]).cpu() if values else torch.zeros(0)
    x = all_gather_ragged(local)
    if x.numel() == 0:
        return float("inf")
    k = top_count(share, x.numel())
    return x.kthvalue(x.numel() - k + 1).values.item()


def top_share_mask(values: list, share: float) -> list:
    """The largest ceil(share * N) of the values (a list of 1-D tensors, N counted over every rank) as a bool
    tensor each: exactly that many, ties taken in global order (rank, then list, then position), so neither
    the ranks nor how a batch is split changes the choice. Exact: every rank's values are gathered."""
    local = torch.cat([v.detach().float().flatten() for v in values]).cpu() if values else torch.zeros(0)
    x = all_gather_ragged(local).cpu()
    lengths = all_gather(torch.tensor([local.numel()])).tolist() if many_ranks() else [local.numel()]
    start = sum(lengths[:rank()])
    k = min(x.numel(), top_count(share, x.numel()))
    chosen = torch.zeros(x.numel(), dtype=torch.bool)
    chosen[torch.sort(x, descending=True, stable=True).indices[:k]] = True  # stable: ties in global order
    return list(chosen[start:start + local.numel()].split([v.numel() for v in values])) if values else []


# what gloo's broadcast takes (torch/csrc/distributed/c10d/ProcessGroupGloo.cpp: "Invalid scalar type" else)
GLOO_DTYPES = {torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8,
               torch.int32, torch.int64, torch.bool}


def fill_from_rank0(targets: list, read, dtypes: list | None) -> None:
    """Fill a sharded model's parameters (DTensor shards) and buffers from whole tensors that only global rank
    0 reads, one at a time: `targets` is [(name, tensor)] in the same order on every rank (checked first:
    _check_same_targets), `dtypes` (rank 0's; None elsewhere) the dtype of each tensor where rank 0 reads it
    (the file's), `read(name, out)` (rank 0 only) fills `out`, a contiguous tensor of that dtype and the
    target's shape. Each is broadcast from rank 0 in the file's dtype (half the bytes of an fp32 master's from
    bf16 weights) into one buffer on the collectives' device, and each rank casts its own shard out of it in
    the copy (on one device copy_ converts in its kernel, no temporary: aten/src/ATen/native/cuda/Copy.cu::
    copy_requires_temporaries), so a rank holds at most one whole tensor beside its shards. A blocking
    CPU-to-CUDA `.to(dtype=...)` would convert on the host first (Copy.cu::copy_kernel_cuda,
    conversion_device), a second host copy of each tensor in the target's dtype. On CUDA rank 0 reads into two
    pinned halves of one host buffer and reads tensor k+1 while k goes to the device and is broadcast
    (_Staging). Modelled on torch/distributed/_state_dict_utils.py::_broadcast_state_dict (the dtypes sent
    once, then each tensor in its own dtype), ::_broadcast_tensors and ::_distribute_tensors (which need the
    whole state dict on rank 0)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    device = _comm_device()
    dtypes = _check_same_targets(targets, dtypes)
    root = rank() == 0
    staging = _Staging(targets, dtypes, read) if root and device.type == "cuda" and targets else None
    try:
        with torch.no_grad():
            for i, (name, target) in enumerate(targets):
                if staging:
                    whole = staging.to_device(i, device)
                elif device.type == "cuda" or dtypes[i] in GLOO_DTYPES:
                    whole = torch.empty(target.shape, dtype=dtypes[i], device=device)
                    if root:
                        read(name, whole)
                else:  # gloo has no float8 or uint16..64: such a tensor crosses in the target's dtype
                    whole = torch.empty(target.shape, dtype=dtypes[i] if root else target.dtype)
                    if root:
                        read(name, whole)
                        whole = whole.to(target.dtype)
                torch.distributed.broadcast(whole, src=0)
                if staging:  # the host reads the next tensor while the device copies and broadcasts this one
                    staging.read_ahead(i + 1)
                if isinstance(target, DTensor):
                    shape, offset = compute_local_shape_and_global_offset(whole.shape, target.device_mesh,
                                                                          target.placements)
                    target.to_local().copy_(whole[tuple(slice(o, o + n) for n, o in zip(shape, offset))])
                else:
                    target.copy_(whole)
                del whole
    finally:  # unpinned even when a read fails, once the copies in flight are done
        if staging:
            staging.close()


def _check_same_targets(targets: list, dtypes: list | None) -> list:
    """Rank 0's `dtypes` on every rank, after one all-gather of each rank's hash of its (name, shape, dtype)
    list and rank 0's dtypes: a rank that lists other tensors, or the same in another order, would broadcast
    into the wrong buffers (or wait for a broadcast that never comes), so every rank stops with the same line
    naming the ranks that differ (torch/distributed/distributed_c10d.py::all_gather_object: pickled, within
    the group's timeout)."""
    listing = repr([(name, tuple(t.shape), str(t.dtype)) for name, t in targets])
    digest = hashlib.sha256(listing.encode()).hexdigest()[:12]
    gathered = all_gather_objects([(digest, dtypes if rank() == 0 else None)])
    differ = [r for r, (d, _) in enumerate(gathered) if d != gathered[0][0]]
    if differ:
        who = f"ranks {', '.join(map(str, differ))} list" if len(differ) > 1 else f"rank {differ[0]} lists"
        raise SystemExit(f"sharded load: {who} other tensors (names, shapes, dtypes: hash "
                         f"{gathered[differ[0]][0]}) than rank 0 ({gathered[0][0]}): every rank must build "
                         f"the same model")
    return gathered[0][1]


class _Staging:
    """Rank 0's host side of fill_from_rank0 on CUDA: one buffer of twice the largest tensor, pinned in place
    (torch/cuda/_pin_memory_utils.py::pin_memory, cudaHostRegister, as torch/distributed/
    _state_dict_utils.py::_create_cpu_state_dict pins), its halves taking tensors in turn: k is copied to the
    device from one half (non_blocking: asynchronous only from pinned memory) while k+1 is read into the
    other, never more than one ahead. Not the caching host allocator (torch.empty(pin_memory=True)): it
    rounds each block up to a power of two and keeps every size it saw pinned after the load (aten/src/ATen/
    core/CachingHostAllocator.h::CachingHostAllocatorImpl::allocate). Its waits are on rank 0's own copies,
    which follow the earlier broadcasts on the stream: a rank that never joins one is ended by the group's
    timeout (torch/distributed/distributed_c10d.py::init_process_group: the collective aborted, the process
    stopped)."""

    def __init__(self, targets, dtypes, read):
        try:  # a private module (torch 2.4 on): without it the buffer stays pageable, the copies synchronous
            from torch.cuda import _pin_memory_utils
        except ImportError:
            _pin_memory_utils = None
        self.items = [(name, t.shape, dtype) for (name, t), dtype in zip(targets, dtypes)]
        self.read, self.pins = read, _pin_memory_utils
        largest = max(math.prod(s) * d.itemsize for _, s, d in self.items)
        self.half = (largest + 63) // 64 * 64  # the second half aligned for any dtype's view
        self.buffer = torch.empty(2 * self.half, dtype=torch.uint8)
        if self.pins:
            self.pins.pin_memory(self.buffer.data_ptr(), self.buffer.numel())
        self.copied = [None, None]  # each half's last copy to the device: the half is free once it is done
        self.read_ahead(0)

    def view(self, i):
        name, shape, dtype = self.items[i]
        start = i % 2 * self.half
        return self.buffer[start:start + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)

    def read_ahead(self, i):
        if i < len(self.items):
            if self.copied[i % 2] is not None:  # the half's last tensor (i - 2) reached the device
                self.copied[i % 2].synchronize()
            self.read(self.items[i][0], self.view(i))

    def to_device(self, i, device):
        whole = self.view(i).to(device, non_blocking=self.pins is not None)
        self.copied[i % 2] = torch.cuda.Event()
        self.copied[i % 2].record()
        return whole

    def close(self):
        torch.cuda.current_stream().synchronize()  # the last copies read the buffer
        if self.pins:
            self.pins.unpin_memory(self.buffer.data_ptr())
        del self.buffer


def from_rank0(obj):
    """Rank 0's picklable `obj` on every rank (what only rank 0 read, e.g. a file's index, or its one-line
    error, so that every rank stops alike and none waits in a collective for one that stopped)."""
    if not many_ranks():
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]
