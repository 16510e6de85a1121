"""The run folder and everything written into it to continue or use a run: the folder's lock, the options a
resumed run may change, atomic checkpoints (one file, or torch.distributed.checkpoint shards under torchrun),
exact restore, and final/ (the policy in HF format)."""
import contextlib
import dataclasses
import errno
import json
import os
import pickle
import shutil
import sys
import time
import traceback

import torch

from rlmini import dist, durable, reward_model
from rlmini.data import rng_state, set_rng_state
from rlmini.engine import adapter_state, named_weights, save_adapter
from rlmini.faults import NonFiniteError, in_chain
from rlmini.models import is_lora

# what a finished or running run leaves in its folder (with what was left by a save or removal cut short);
# --overwrite removes them, each only where it is ours (_not_ours): the folder's config.json names a run
RUN_FILES = ("metrics.jsonl", "rollouts.jsonl", "config.json", "eval.json", "checkpoint.pt", "checkpoint",
             "checkpoint.old", "checkpoint.tmp", "final", "final.tmp", "final.old", "checkpoint.pt.tmp",
             "checkpoint.pt.removed", "checkpoint.removed", "checkpoint.old.removed", "final.removed")
SHARDED = ("checkpoint", "checkpoint.old")  # torchrun's checkpoint folder, and the one a swap left aside
# options a resumed run may change freely: how it is run, logged and checked, not what it learns
RESUMABLE_CHANGES = {
    "steps", "resume", "out_dir", "run_name", "config", "overwrite", "allow_option_changes", "eval_every",
    "eval_n", "eval_limit", "save_every", "keep_checkpoint", "wandb", "wandb_project", "wandb_group",
    "wandb_tags", "log_completions", "push_check_every", "push_check_tol", "sampler_diff_tol",
    "dist_timeout", "on_nonfinite", "micro_batch_size", "gradient_checkpointing", "engine",
    "vllm_gpu_memory_utilization", "vllm_sleep", "print_every", "verbose", "packing", "packed_attention",
    "micro_batch_tokens", "lora_push", "vllm_seed", "vllm_tp", "server_url", "server_push",
    "server_push_dir", "server_timeout", "server_concurrency", "run_lock"}


def prepare_run_dir(args, inputs: dict | None = None) -> str:
    """The run's folder, claimed by rank 0 before any rank touches it (_claim: checked, locked, on --overwrite
    emptied of the earlier run's files); its refusal reaches every rank as one line, so none waits. `inputs`:
    {flag: path} of what the run reads (--model, ...), none of which may lie where the run writes."""
    run_dir = os.path.join(args.out_dir, args.run_name)
    why = None
    if dist.rank() == 0:
        try:
            _DOOMED[run_dir] = _claim(args, run_dir, inputs or {})
        except SystemExit as e:
            why = str(e)
        except Exception as e:  # noqa: BLE001 - any failure of rank 0's reaches every rank as its one line
            why = f"{run_dir}: {type(e).__name__}: {e}"
    line = dist.from_rank0(why)
    if line is not None:
        raise SystemExit(line)
    return run_dir


_DOOMED = {}  # run folder -> the earlier run's entries --overwrite removes once start-up has passed


def replace_earlier_run(run_dir: str) -> None:
    """--overwrite: the earlier run's entries (_claim's list) removed, once every start-up check has passed
    (a server down, a plan that cannot fit, a model that fails to load leave the earlier run as it was);
    rank 0 removes, its failure reaches every rank in one line."""
    why = None
    if dist.rank() == 0:
        try:
            for f in _DOOMED.pop(run_dir, []):
                durable.remove(os.path.join(run_dir, f))
        except OSError as e:
            why = (f"--overwrite true: could not remove the earlier run's {e.filename or run_dir} "
                   f"({e.strerror})")
    line = dist.from_rank0(why)
    if line is not None:
        raise SystemExit(line)


def _adopt_swapped(run_dir: str) -> None:
    """Rank 0, under the lock: a torchrun checkpoint save killed between its two renames left the newer
    checkpoint.tmp/ whole (meta.pt is written last, after every shard and .metadata) and the older one as
    checkpoint.old/: the newer is renamed in, so the newest state wins."""
    path, tmp = os.path.join(run_dir, "checkpoint"), os.path.join(run_dir, "checkpoint.tmp")
    whole = all(os.path.isfile(os.path.join(tmp, f)) for f in ("meta.pt", ".metadata"))
    if not os.path.exists(path) and os.path.isdir(tmp) and whole:
        durable.publish(tmp, path)


OUTPUTS = ("out_dir", "run_name", "server_push_dir")  # options naming where a run writes


def inputs(args) -> dict:
    """{flag: path} of the local files and folders a run reads: every option naming an existing path
    (--model, --critic_model, --reward_model, --config, --task_config, --judge_prompt, ...), a jsonl: or hf:
    task's file, a --reward or --env module's file (module.py:function)."""
    found = {}
    for f in dataclasses.fields(args):
        value = getattr(args, f.name)
        if f.name in OUTPUTS or not isinstance(value, str) or not value:
            continue
        if f.name == "task":
            value = value.split(":", 1)[1] if value.startswith(("jsonl:", "hf:")) else ""
        for part in value.split(","):
            path = next((p for p in (part, part.rsplit(":", 1)[0]) if p and os.path.exists(p)), None)
            if path is not None:
                found.setdefault(f"--{f.name}", path)
    return found


def _claim(args, run_dir: str, inputs: dict) -> list:
    """Rank 0: --resume needs a checkpoint (one kind: both is refused, naming their steps); an existing run
    is refused unless --overwrite; no input may lie where the run writes; then the folder is made and locked,
    and with --overwrite the earlier run's files go, only where they are ours and once the lock is held."""
    if os.path.exists(args.out_dir) and not os.path.isdir(args.out_dir):
        raise SystemExit(f"--out_dir {args.out_dir}: is a file, not a folder")
    for flag, path in inputs.items():  # inputs are never outputs (checked before anything is removed)
        hit = next((f for f in (*RUN_FILES, "push") if durable.inside(path, os.path.join(run_dir, f))), None)
        if hit is None and os.path.realpath(path) == os.path.realpath(run_dir):  # its config.json, its files
            raise SystemExit(f"{flag} {path} is the run folder {run_dir} itself, into which this run writes "
                             f"(config.json, final/, ...): choose another --run_name")
        if hit is not None:
            raise SystemExit(f"{flag} {path} lies in {os.path.join(run_dir, hit)}, which this run writes or "
                             f"replaces: copy it elsewhere first, or choose another --run_name")
    found = [f for f in RUN_FILES if os.path.lexists(os.path.join(run_dir, f))]
    if args.resume:
        _check_resumable(run_dir, found)
    if found and not args.resume and not args.overwrite:
        raise SystemExit(f"{run_dir} already holds a run ({', '.join(found)}): pass --resume true to "
                         f"continue it, --overwrite true to replace it, or another --run_name")
    doomed = found if args.overwrite and not args.resume else []
    if doomed and (why := _not_ours(run_dir, doomed)):
        raise SystemExit(f"--overwrite true: {run_dir} {why}: not removed; move them, or choose another "
                         f"--run_name")
    try:
        os.makedirs(run_dir, exist_ok=True)
    except OSError as e:  # --out_dir under a file, no permission, ...
        raise SystemExit(f"--out_dir {args.out_dir}: cannot create {run_dir} ({e.strerror})") from None
    if args.run_lock:
        lock_run_dir(run_dir)
    if args.resume:
        _adopt_swapped(run_dir)
    # the marker last: a removal cut short leaves the folder still recognisably a run's
    return sorted(doomed, key=lambda f: f == "config.json")


def _check_resumable(run_dir: str, found: list) -> None:
    """--resume: one checkpoint to continue from, or one line on why there is none."""
    sharded = [f for f in SHARDED if f in found]
    if "checkpoint.pt" in found and sharded:
        pt, folder = os.path.join(run_dir, "checkpoint.pt"), os.path.join(run_dir, sharded[0])
        raise SystemExit(f"--resume true: {run_dir} holds two checkpoints, {pt} (step {_step(pt)}, from a "
                         f"plain process) and {folder}/ (step {_step(os.path.join(folder, 'meta.pt'))}, from "
                         f"torchrun); remove the one not to continue (or pass --run_name of a copy holding "
                         f"the other)")
    if "checkpoint.pt" not in found and not sharded and "final" in found:  # --keep_checkpoint false
        final = os.path.join(run_dir, "final")
        raise SystemExit(f"--resume true: {run_dir} finished without its checkpoint (--keep_checkpoint "
                         f"false); final/ holds the weights but not the optimizer: start a new run from "
                         f"them, the same command with --model {final} and without --resume, --run_name and "
                         f"--overwrite (the new run is named after this one)")
    if "checkpoint.pt" not in found and not sharded:
        raise SystemExit(f"--resume true: no checkpoint in {run_dir} (checkpoint.pt, or checkpoint/ under "
                         f"torchrun)")


def _step(path: str):
    """The step a checkpoint file holds, read without loading its tensors (mmap), or '?'."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)["step"]
    except Exception:  # noqa: BLE001 - a damaged file: its step is unknown, the refusal still names it
        return "?"


def _not_ours(run_dir: str, names: list) -> str | None:
    """Why `names` in run_dir may not be a run's of ours, or None: the folder's config.json must name a run
    (written at every run's start: a run id, or a folder from before ids, its algorithm), and each entry be
    of its kind (final/ with rlmini.json, checkpoint/ with meta.pt, files as files)."""
    try:
        with open(os.path.join(run_dir, "config.json")) as f:
            config = json.load(f)
        if not isinstance(config, dict) or not ("run_id" in config or "algo" in config):
            raise ValueError
    except (OSError, ValueError):
        return (f"holds {', '.join(names)} but no config.json of a run (written by every run): not a run "
                f"folder of ours")
    for name in names:
        path = os.path.join(run_dir, name)
        folder = os.path.isdir(path) and not os.path.islink(path)
        need = {"final": "rlmini.json", "checkpoint": "meta.pt", "checkpoint.old": "meta.pt"}.get(name)
        if need and not (folder and os.path.exists(os.path.join(path, need))):
            return f"holds {name} without the {need} a run writes into it"
        if name.endswith((".jsonl", ".json", ".pt")) and not os.path.isfile(path):
            return f"holds {name}, which is not a file"
    return None


_LOCKS = {}  # run folder -> the open lock file this process holds
# a lock held by another process (lockf: EACCES or EAGAIN); any other error is the filesystem's
_HELD = (errno.EACCES, errno.EAGAIN)


def lock_run_dir(run_dir: str) -> None:
    """An exclusive POSIX lock on run_dir/.lock: a second process training into the same folder stops at once.
    POSIX locks belong to the process (a resumed run in the same process takes it again) and the system drops
    them when the process ends, however it ends: a crash leaves no stale lock. A filesystem without locks
    (NFS without lockd: ENOLCK; some FUSE and parallel filesystems: ENOTSUP, ENOSYS) is named as such."""
    import fcntl
    path = os.path.join(os.path.abspath(run_dir), ".lock")
    if path in _LOCKS:
        return
    try:
        f = open(path, "a+")
    except OSError as e:  # a .lock another user made, a read-only folder
        raise SystemExit(f"{run_dir}: cannot open its lock {path} ({e.strerror}): choose another --run_name "
                         f"(or --out_dir)") from None
    try:
        fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        if e.errno not in _HELD:
            raise SystemExit(f"{run_dir}: its filesystem cannot lock {path} ({e.strerror or e}); pass "
                             f"--run_lock false to run without the lock (then keep a second run out of "
                             f"this folder yourself)") from None
        raise SystemExit(f"{run_dir} is in use by another training process (pid {holder}, lock {path}): wait "
                         f"for it to finish or choose another --run_name") from None
    f.seek(0), f.truncate(), f.write(str(os.getpid())), f.flush()
    _LOCKS[path] = f


def check_resumed_options(saved: dict, args, algo: str, run_dir: str) -> None:
    """A resumed run continues the same experiment: the same algorithm, and the same options but for those in
    RESUMABLE_CHANGES (unless --allow_option_changes; the changes are printed either way)."""
    if saved.get("algo", algo) != algo:
        raise SystemExit(f"--resume: {run_dir} was trained by train_{saved['algo']}.py, not train_{algo}.py; "
                         f"resume it with train_{saved['algo']}.py or start a new run (another --run_name)")
    now = dataclasses.asdict(args)
    changed = [f"--{k} {saved['args'][k]!r} -> {now[k]!r}" for k in sorted(now)
               if k in saved.get("args", {}) and k not in RESUMABLE_CHANGES and saved["args"][k] != now[k]]
    if changed and not args.allow_option_changes:
        raise SystemExit(f"--resume: options differ from the checkpoint's in {run_dir}: "
                         f"{'; '.join(changed)}. Pass --allow_option_changes true to continue with them "
                         f"anyway")
    if changed:
        print(f"--resume with changed options (--allow_option_changes): {'; '.join(changed)}",
              file=sys.stderr)


def save_checkpoint(path: str, state: dict) -> None:
    """Write to a temporary file, fsync, then rename over the old one: an interrupted save leaves the previous
    checkpoint intact."""
    tmp = f"{path}.tmp"
    with _partial_removed(path, tmp, "the previous checkpoint is intact"):
        _write(tmp, state)
    durable.publish(tmp, path)


def _write(path: str, state: dict) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


@contextlib.contextmanager
def _partial_removed(path: str, tmp: str, kept: str):
    """A failed write of tmp (file or folder) removes it; a full or failing disk then ends the run in one line
    naming path and what is `kept`, any other error keeps its traceback."""
    try:
        yield
    except BaseException as e:
        with contextlib.suppress(OSError):
            shutil.rmtree(tmp) if os.path.isdir(tmp) else os.remove(tmp)
        disk = disk_error(e)
        if disk is None:
            raise
        raise SystemExit(_could_not_write(path, disk, kept)) from None


def _could_not_write(path: str, why: str, kept: str) -> str:
    return f"could not write {path} ({why}); {kept}"


DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EROFS)


def disk_error(e: BaseException):
    """What a full or failing disk said in e's chain, or None. torch.save meets a failed write again in its
    zip writer's __exit__ and raises a RuntimeError there, the OSError its __context__
    (torch/serialization.py::_open_zipfile_writer_buffer); safetensors raises a SafetensorError, no OSError,
    whose text names the errno ("... (os error 28)"); torch.distributed.checkpoint raises on every rank a
    CheckpointException holding each failed rank's error (torch/distributed/checkpoint/utils.py::
    _DistWrapper.all_reduce)."""
    x = _disk_failure(e)
    if x is None:
        return None
    return x.strerror if isinstance(x, OSError) and x.strerror else str(x)


def _disk_failure(e: BaseException):
    """The exception of disk_error's message: in e's chain, or in a CheckpointException's ranks' errors."""
    if type(e).__name__ == "CheckpointException":  # torch.distributed.checkpoint's: {rank: (error, trace)}
        for failure, _ in e.failures.values():
            if (found := _disk_failure(failure)) is not None:
                return found
    return in_chain(e, lambda x: isinstance(x, OSError) and x.errno in DISK_ERRNOS
                    or any(f"(os error {n})" in str(x) for n in DISK_ERRNOS))


def _shard_writer(path: str):
    """torch.distributed.checkpoint's FileSystemWriter, a full disk raised as its OSError: dcp pickles each
    rank's error to rank 0 and back (torch/distributed/checkpoint/utils.py::_DistWrapper.all_reduce), which
    drops the __context__ where torch.save's zip writer leaves the OSError (see disk_error)."""
    from torch.distributed.checkpoint import FileSystemWriter

    class Writer(FileSystemWriter):
        def write_data(self, plan, planner):
            try:
                return super().write_data(plan, planner)
            except Exception as e:
                x = _disk_failure(e)
                if x is None or x is e:
                    raise
                raise x from None
    return Writer(path)


def load_checkpoint(path: str) -> dict:
    """weights_only: tensors and plain values only, so a checkpoint replaced by someone else runs nothing."""
    if not os.path.exists(path):
        raise SystemExit(f"--resume: no checkpoint at {path}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:  # a global outside the allowed types: not a checkpoint of ours
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SystemExit(f"--resume: {path} holds more than tensors and plain values, refused "
                         f"(weights_only): {first}") from None


# what torch.distributed.checkpoint's .metadata pickle names: its own metadata classes, dtypes, sizes, paths
_METADATA_GLOBALS = {"torch.distributed.checkpoint.metadata": None,
                     "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
                     "torch.serialization": {"_get_layout"}, "torch": {"Size"},
                     "pathlib": {"PosixPath", "PurePosixPath"}, "collections": {"OrderedDict"}}


def check_sharded_metadata(path: str) -> None:
    """torch.distributed.checkpoint unpickles a checkpoint folder's .metadata with no restriction: read it
    first with an unpickler that finds only the globals such a file holds (and torch's dtypes), so a folder
    written by someone else stops here in one line, its code never run."""
    class Unpickler(pickle.Unpickler):
        def find_class(self, module, name):
            names = _METADATA_GLOBALS.get(module, set())
            found = getattr(torch, name, None) if module == "torch" else None
            if names is None or name in names or isinstance(found, torch.dtype):
                return super().find_class(module, name)
            raise pickle.UnpicklingError(f"{module}.{name} is not a checkpoint's metadata")

    metadata = os.path.join(path, ".metadata")
    try:
        with open(metadata, "rb") as f:
            Unpickler(f).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError) as e:
        raise SystemExit(f"--resume: {metadata} holds more than a checkpoint's metadata, refused: "
                         f"{e}") from None


def save_sharded_checkpoint(path: str, state: dict, meta: dict) -> None:
    """torchrun: every rank writes its own shards of `state` (torch.distributed.checkpoint) into path.tmp,
    rank 0 adds `meta` (meta.pt) and swaps the folder in for `path`: an interrupted save leaves the previous
    checkpoint intact. Across nodes, path must be on storage every node sees."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    tmp = f"{path}.tmp"
    if dist.rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    torch.distributed.barrier()
    failed = None
    try:
        dcp.save(state, checkpoint_id=tmp, storage_writer=_shard_writer(tmp))
    except CheckpointException as e:  # raised on every rank alike, once every rank's writes are over
        failed = e
    if failed is None and dist.rank() == 0:
        try:
            _write(os.path.join(tmp, "meta.pt"), meta)
            _swap_in(tmp, path)
        except Exception as e:
            failed = e
    if failed is not None and dist.rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    # rank 0's verdict reaches every rank, so that none waits in a collective for one that stopped
    disk = why = None
    if failed is not None:
        disk = disk_error(failed)
        why = disk or f"rank 0: {type(failed).__name__}: " + (str(failed).strip().splitlines() or [""])[0]
    line = dist.from_rank0(why and _could_not_write(path, why, "the previous checkpoint is intact"))
    if line is None:
        return
    if failed is not None and disk is None:
        raise failed  # not a disk's: its traceback
    raise SystemExit(line)


def _swap_in(tmp: str, path: str) -> None:
    """Replace folder `path` by the finished folder `tmp`, durably: tmp's files synced first; the old one is
    renamed aside, tmp renamed in, each rename synced, and the old one removed last, so a crash in between
    leaves path.old (sharded_checkpoint_dir falls back to it)."""
    durable.fsync_tree(tmp)
    old = f"{path}.old"
    if os.path.exists(path):
        shutil.rmtree(old, ignore_errors=True)  # a swap of ours cut short (named by us, in our run folder)
        durable.publish(path, old)
    durable.publish(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def sharded_checkpoint_dir(run_dir: str) -> str:
    """The torchrun checkpoint folder; after a save cut off between its two renames, the previous one."""
    path = os.path.join(run_dir, "checkpoint")
    return path if os.path.exists(path) or not os.path.exists(f"{path}.old") else f"{path}.old"


def reads_shards(run_dir: str) -> bool:
    """Whether --resume reads checkpoint/ (save's rule): under torchrun; in a plain process only without a
    checkpoint.pt (before save followed dist.sharded, a one-process --engine vllm run wrote checkpoint/:
    vLLM's in-process group of one took the torchrun branch)."""
    return dist.sharded() or not os.path.exists(os.path.join(run_dir, "checkpoint.pt"))


def load_resumed(run_dir: str) -> dict:
    """The saved state of a --resume run (checkpoint/: its meta.pt; the shards are read by restore)."""
    pt, folder = os.path.join(run_dir, "checkpoint.pt"), sharded_checkpoint_dir(run_dir)
    if not reads_shards(run_dir):
        return load_checkpoint(pt)
    if os.path.exists(pt) and not os.path.exists(folder):  # torchrun, on a plain process's run
        raise SystemExit(f"--resume: {pt} was written by a plain process (python train_*.py): resume it "
                         f"the same way, not under torchrun")
    return load_checkpoint(os.path.join(folder, "meta.pt"))


def remove(run) -> None:
    """--keep_checkpoint false at the end of a run, once final/ is durable (save_final synced it): its
    checkpoint.pt or checkpoint/ (and a checkpoint.old left by a save cut short) go, after a barrier (every
    rank is done with final/), each renamed first so that a removal cut short leaves no half checkpoint that
    --resume would take; rank 0 says so."""
    dist.barrier()
    run.checkpoint_step = None  # a Ctrl-C from here on has no checkpoint to offer
    if dist.rank() != 0:
        return
    gone = []
    for name in ("checkpoint.pt", "checkpoint", "checkpoint.old"):
        path = os.path.join(run.run_dir, name)
        if os.path.exists(path):
            durable.remove(path)
            gone.append(name)
    if gone:
        print(f"removed {' and '.join(gone)} (--keep_checkpoint false): the run cannot be extended with "
              f"--resume", flush=True)


def save_end(run, since: float) -> None:
    """The end of a run: the checkpoint (unless --keep_checkpoint false) and final/. With --keep_checkpoint
    false nothing is removed until final/ is durable; when final/ cannot be written, a checkpoint is tried in
    its place, and one line says what survived (which step, where) and what did not."""
    final = os.path.join(run.run_dir, "final")
    if run.args.keep_checkpoint:
        save(run)
        save_final(run.model, run.tokenizer, final, run.style, since=since)
        run.final = final
        return
    try:
        save_final(run.model, run.tokenizer, final, run.style, since=since)
    except (SystemExit, Exception) as e:  # every rank alike: a disk's one line, or rank 0's error named
        if not isinstance(e, SystemExit):  # rank 0's own error: its traceback, then the checkpoint
            traceback.print_exc()
        failed = str(e) if isinstance(e, SystemExit) else f"could not write {final} ({type(e).__name__}: {e})"
        try:
            save(run)
        except SystemExit as again:
            raise SystemExit(f"{failed}; nor could a checkpoint be written in its place ({again}); "
                             f"{_survives(run)}") from None
        raise SystemExit(f"{failed}; wrote {_checkpoint_path(run)} (step {run.step}) in its place and kept "
                         f"it: --resume true writes final/ from it") from None
    run.final = final
    remove(run)  # once final/ is durable (every rank's share of it written)


def _checkpoint_path(run) -> str:
    return os.path.join(run.run_dir, "checkpoint" if dist.sharded() else "checkpoint.pt")


def _survives(run) -> str:
    """What of a run's weights is left after its end failed to write them."""
    if run.checkpoint_step is None:
        return (f"no weights of this run survive (no checkpoint was written: --save_every "
                f"{run.args.save_every}); its metrics are in {os.path.join(run.run_dir, 'metrics.jsonl')}")
    return f"what survives: {_checkpoint_path(run)} (step {run.checkpoint_step}), its last checkpoint"


def save(run) -> None:
    """Everything needed to continue: the policy and its optimizer, PPO's critic and its optimizer, the
    scheduler, RNGs, step, data position, HA-DW's state and the task's (Task.state). The layout follows how
    the run was launched, whatever the engine (dist.sharded): a plain process writes checkpoint.pt (with
    --engine vllm too, whose in-process group of one is not torchrun's); torchrun, with any number of ranks
    (one included: FSDP2's DTensors do not load back from plain state dicts), writes checkpoint/, each rank
    its shards (torch.distributed.checkpoint)."""
    pairs = {"critic": (run.critic, run.critic_optimizer)} if run.critic is not None else {}
    meta = {"scheduler": run.scheduler.state_dict(), "rng": rng_state(), "step": run.step,
            # --async_steps: the batches in flight are not saved; --resume draws their prompts again
            "data_pos": run.data_pos, "redraw": [pos for pos, _, _ in run.ahead],
            "algo_state": {**({"hadw": run.hadw} if run.hadw else {}),
                           **({"reward_norm": norm} if (norm := reward_model.norm_state(run.task)) else {}),
                           **({"task": dict(run.task.state)} if run.task.state else {})},
            "args": dataclasses.asdict(run.args), "algo": run.algo}
    shards = [p.to_local() if hasattr(p, "to_local") else p for p in run.model.parameters()]  # FSDP2: mine
    bad = dist.all_sum(sum(int((~torch.isfinite(p.detach())).sum()) for p in shards))  # every rank's shards
    if bad:
        raise NonFiniteError(f"step {run.step}: the policy holds {int(bad)} non-finite weights; no "
                             f"checkpoint was written (the last one is intact)")
    if dist.sharded():
        from torch.distributed.checkpoint.state_dict import get_state_dict
        state = {}
        for key, (module, optimizer) in {"policy": (run.model, run.optimizer), **pairs}.items():
            parts = get_state_dict(module, optimizer, options=_state_options(module))
            state[key] = dict(zip(("model", "optimizer"), parts))
        save_sharded_checkpoint(os.path.join(run.run_dir, "checkpoint"), state, meta)
    elif dist.rank() == 0:
        meta["algo_state"].update({k: {"model": model_state(m), "optimizer": o.state_dict()}
                                   for k, (m, o) in pairs.items()})
        save_checkpoint(os.path.join(run.run_dir, "checkpoint.pt"),
                        {"model": model_state(run.model), "optimizer": run.optimizer.state_dict(), **meta})
    run.checkpoint_step = run.step


def model_state(model) -> dict:
    """The weights a checkpoint holds: all, or with LoRA only the trainable ones (the base is on disk
    already)."""
    if not is_lora(model):
        return model.state_dict()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in model.state_dict().items() if k in trainable}


def load_model_state(model, state: dict) -> None:
    """model_state's inverse; with LoRA every trainable weight must be there, and nothing else."""
    if not is_lora(model):
        model.load_state_dict(state)
        return
    missing, unexpected = model.load_state_dict(state, strict=False)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    if unexpected or trainable & set(missing):
        raise SystemExit(f"--resume: the checkpoint's adapters do not fit this model (missing "
                         f"{sorted(trainable & set(missing))[:3]}, unexpected {unexpected[:3]}): same "
                         f"--lora_* options?")


def _state_options(module):
    """torch.distributed.checkpoint: a LoRA model saves and loads its trainable weights only."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    return StateDictOptions(ignore_frozen_params=is_lora(module), strict=not is_lora(module))


def restore(run, key: str, module, optimizer) -> None:
    """Load the (module, optimizer) pair saved under `key` ("policy" or "critic") from the checkpoint of a
    --resume run, in place; from checkpoint/ (reads_shards) each rank reads its shards."""
    if not reads_shards(run.run_dir):  # taken out of run.resumed: the run keeps no second copy of the weights
        state = run.resumed if key == "policy" else run.resumed["algo_state"].pop(key)
        load_model_state(module, state.pop("model"))
        # load_state_dict builds the whole new state before dropping the old: drop the materialised zeros
        # first (memplan.materialize_adamw), so a resume with vLLM awake holds AdamW's state once, not twice
        optimizer.state.clear()
        optimizer.load_state_dict(state.pop("optimizer"))
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    parts = get_state_dict(module, optimizer, options=_state_options(module))
    state = {key: dict(zip(("model", "optimizer"), parts))}
    check_sharded_metadata(sharded_checkpoint_dir(run.run_dir))
    dcp.load(state, checkpoint_id=sharded_checkpoint_dir(run.run_dir))
    set_state_dict(module, optimizer, model_state_dict=state[key]["model"],
                   optim_state_dict=state[key]["optimizer"], options=_state_options(module))


def resume(run) -> None:
    """--resume: the checkpoint's policy, optimizer and lr schedule, step, data position, RNG states, HA-DW
    state and the task's (Task.restore) into `run` (its options checked against the saved ones first), then
    the weights into the engine."""
    run.resumed = load_resumed(run.run_dir)
    check_resumed_options(run.resumed, run.args, run.algo, run.run_dir)
    restore(run, "policy", run.model, run.optimizer)
    run.scheduler.load_state_dict(run.resumed["scheduler"])
    run.step, run.data_pos = run.resumed["step"], run.resumed["data_pos"]
    run.checkpoint_step = run.step
    run.redraw = list(run.resumed.get("redraw", []))  # common.ahead requests them first
    if run.redraw and not run.args.async_steps:  # resumed lock-step: the stream continues from the first
        run.data_pos, run.redraw = run.redraw[0], []
    run.hadw = run.resumed["algo_state"].get("hadw", {})
    reward_model.restore_norm_state(run.task, run.resumed["algo_state"].get("reward_norm", {}))
    if run.task.restore is not None:  # rg: --rg_curriculum's level, and its examples
        run.task.restore(run.task, run.resumed["algo_state"].get("task", {}))
    set_rng_state(run.resumed["rng"])
    run.engine.push()


def save_final(model, tokenizer, path: str, style: str = "chat", since: float | None = None) -> None:
    """The final policy in HF format (loadable by transformers and vLLM), written atomically by rank 0. Under
    FSDP2 the whole weights are gathered once, into rank 0's CPU memory (every rank calls this). LoRA: the
    merged model (W + (alpha / r) B A, in the base's dtype), and the adapters alone in path/adapter (peft's
    format: PeftModel.from_pretrained(base, path/adapter)). `since` (the end of a run, common.finish): rank 0
    then prints one line, where the model and the metrics went and the seconds since then."""
    state, adapters = None, None
    if is_lora(model):
        base_dtype = next(p.dtype for p in model.parameters() if not p.requires_grad)
        # a collective per tensor under FSDP2: every rank iterates, rank 0 keeps (host memory: one copy)
        merged = named_weights(model, base_dtype)
        state = {n: w.cpu() for n, w in merged if dist.rank() == 0}
        adapters = adapter_state(model)
    elif dist.sharded():  # not vLLM's group of one: a plain model saves its own weights, no second copy
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    failed = None
    if dist.rank() == 0:
        try:
            _write_final(model, tokenizer, path, style, state, adapters)
        except Exception as e:  # rank 0's verdict reaches every rank, none left waiting in a collective
            failed = e
    disk = why = None
    if failed is not None:
        disk = disk_error(failed)
        why = disk or f"rank 0: {type(failed).__name__}: " + (str(failed).strip().splitlines() or [""])[0]
    kept = f"the previous {path} (or {path}.old), if any, is intact"
    line = dist.from_rank0(why and _could_not_write(path, why, kept))
    if line is None:
        if since is not None and dist.rank() == 0:  # a save of many GB takes a while: what, and how long
            what = "merged model, adapter" if adapters is not None else "model"
            took = time.perf_counter() - since
            print(f"saved {path} ({what}; {took:.1f} s to save) and "
                  f"{os.path.join(os.path.dirname(path), 'metrics.jsonl')}", flush=True)
        return
    if failed is not None and disk is None:
        raise failed  # not a disk's: its traceback
    raise SystemExit(line)


def _write_final(model, tokenizer, path: str, style: str, state, adapters) -> None:
    """Rank 0's part of save_final: final.tmp/ written, synced, swapped in for final/ (_swap_in); a failure
    removes final.tmp/."""
    base = model.get_base_model() if adapters is not None else model
    tied = getattr(base, "all_tied_weights_keys", None) or {}
    for name in tied if state is not None else ():  # gathered, a tied head shares no storage with its source:
        state.pop(name, None)  # save_pretrained would write it as a second copy
    tmp = f"{path}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)  # a save of ours cut short (named by us)
    try:
        base.save_pretrained(tmp, state_dict=state)
        if adapters is not None:
            save_adapter(model, adapters, os.path.join(tmp, "adapter"))
        tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, "rlmini.json"), "w") as f:
            json.dump({"prompt_style": style}, f)
        _swap_in(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
