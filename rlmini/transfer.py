"""GPU weight push to a `vllm serve` over vLLM's own NCCL weight transfer (vLLM 0.32, backend "nccl").

The server must be started with the RL routes and the NCCL engine on its workers:
    VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --weight-transfer-config '{"backend": "nccl"}' ...
and trainer rank 0 must reach the server's GPUs over NCCL (the same fabric: NVLink, InfiniBand or RoCE).

One init (start(), once per run), in vLLM's order
(vllm/distributed/weight_transfer/nccl_engine.py::NCCLTrainerWeightTransferEngine.trainer_init):
    GET  /get_world_size                      (ours: the NCCL group is 1 trainer + TP*PP*DP workers)
    POST /init_weight_transfer_engine {"init_info": {master_address, master_port, rank_offset: 1, world_size,
         packed, packed_buffer_size_bytes, packed_num_buffers}}  concurrently with rank 0 opening the group
         as NCCL rank 0 (StatelessProcessGroup's TCPStore on master_address:master_port + PyNcclCommunicator).
One push (push(version), every step), in vLLM's order (NCCLTrainerWeightTransferEngine.send_weights):
    POST /pause?mode=wait                     (ours: start_weight_update puts the layers on the meta device
                                               for layerwise reload, so nothing may generate until the finish;
                                               the pause also clears the prefix cache, KV of the old weights)
    POST /start_weight_update                 (workers: initialize_layerwise_reload)
    POST /update_weights {"update_info": {names, dtype_names, shapes}}  concurrently with the packed broadcast
         (1 GiB buffers, 2 of them, by default): the workers receive and call model.load_weights per buffer
    POST /finish_weight_update {"weight_version": "<version>"}  (workers: finalize_layerwise_reload, which
         runs process_weights_after_loading; then the engine records the version, as /update_weight_version)
    POST /resume                              (ours; only after a push that finished: a failed push leaves the
                                               server paused rather than serving half-loaded weights)
The caller must not wrap push() in its own /pause ... /resume: push() does it.
"""
import logging
import socket
import threading
from urllib.parse import urlparse

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo
from vllm.distributed.weight_transfer.packed_tensor import DEFAULT_PACKED_BUFFER_SIZE_BYTES

from rlmini import dist, httpclient
from rlmini.engine import pushed_weights
from rlmini.faults import ServerError

SERVER_FLAG = """--weight-transfer-config '{"backend": "nccl"}'"""


class TransferError(ServerError):
    """A weight push to the server failed; the message is one line naming the problem."""


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit] + "..."


class Client(HTTPVLLMWeightSyncClient):
    """vLLM's HTTP client for the weight-sync routes on ours (rlmini/httpclient.py; every upstream route goes
    through _post), with one-line errors that read the server's answer (the upstream one raises requests'
    status line, which drops it), the pause routes, and the version a push sets at its finish (vLLM's engine
    calls finish_weight_update() with no version)."""

    def __init__(self, base_url: str, timeout: float):
        super().__init__(base_url, timeout)
        self.version: str | None = None
        self.wake: threading.Event | None = None  # set on a failed call: a push waiting on NCCL stops at once
        self.failure: TransferError | None = None

    def _request(self, method: str, path: str, json: dict | None = None) -> dict:
        url = f"{self.base_url}/{path}"
        try:  # not retried: /update_weights runs beside an NCCL broadcast that a second one would not meet
            response = httpclient.send(httpclient.shared("--server_push nccl"), method, url, json=json,
                                       timeout=self.timeout)
        except httpclient.NoAnswer as e:
            raise self._fail(f"{method} {url} failed: {_one_line(e)}") from None
        if response.status_code == 404:
            raise self._fail(f"{url} is not a route of the server: start vllm serve with "
                             "VLLM_SERVER_DEV_MODE=1")
        # vllm/v1/worker/gpu_worker.py::Worker._check_weight_transfer_engine's message, in the 500's body
        if "Weight transfer not configured" in response.text:
            raise self._fail(f"the server at {self.base_url} has no weight transfer engine: start vllm serve "
                             f"with {SERVER_FLAG}")
        if response.status_code >= 400:
            raise self._fail(f"{method} {url} answered {response.status_code}: {_one_line(response.text)}")
        return response.json() if response.content else {}

    def _fail(self, message: str) -> TransferError:
        self.failure = TransferError(message)
        if self.wake is not None:
            self.wake.set()
        return self.failure

    def _post(self, path: str, json: dict | None = None) -> None:
        self._request("POST", path, json)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        super().finish_weight_update(weight_version if weight_version is not None else self.version)

    def world_size(self) -> int:
        return int(self._request("GET", "get_world_size")["world_size"])


class NamedWeightsSource(WeightSource):
    """rlmini.engine.pushed_weights as vLLM's WeightSource: iteration gathers one parameter at a time (a
    collective under FSDP2, so every rank iterates); metadata is learnt by one such pass, the first time it
    is asked for (inside send_weights, on every rank), since LoRA merges rename parameters."""

    def __init__(self, model, dtype: torch.dtype, device: torch.device):
        self.model, self.dtype, self.device = model, dtype, device
        self._meta: list[ParamMeta] | None = None

    def metadata(self) -> list[ParamMeta]:
        if self._meta is None:
            weights = pushed_weights(self.model, self.dtype)
            self._meta = [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in weights]
        return self._meta

    def __iter__(self):
        for name, tensor in pushed_weights(self.model, self.dtype):
            yield name, tensor.to(self.device)


def _route_address(url: str) -> str:
    """This host's address on the route to the server (what the server's workers dial for the rendezvous)."""
    parsed = urlparse(url)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((parsed.hostname, parsed.port or 80))  # UDP: no packet is sent, only the route is chosen
        return s.getsockname()[0]


def _free_port(address: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return s.getsockname()[1]


class NCCLTransfer:
    """Push the trainer's weights to a vLLM server over NCCL. start() once and push(version) per update, on
    every rank (the gathers are collectives); rank 0 alone talks to the server, the others discard."""

    def __init__(self, url: str, model, dtype: torch.dtype, timeout: float, device, *,
                 master_address: str | None = None, buffer_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES):
        self.url, self.timeout, self.device = url.rstrip("/"), timeout, torch.device(device)
        self.master_address, self.buffer_bytes = master_address, buffer_bytes
        self.source = NamedWeightsSource(model, dtype, self.device)
        self.client = Client(self.url, timeout)
        self.engine = None

    def start(self) -> None:
        rank = dist.rank()
        if rank != 0:  # a non-sender opens nothing (nccl_engine.py: trainer_init returns at `not is_sender`)
            self.engine = WeightTransferTrainerFactory.trainer_init(
                self._init_info(rank, "", 0, 0), client=self.client, source=self.source)
            return
        address = self.master_address or _route_address(self.url)
        info = self._init_info(0, address, _free_port(address), 1 + self.client.world_size())
        self.engine = self._bounded(lambda: WeightTransferTrainerFactory.trainer_init(
            info, client=self.client, source=self.source), f"the NCCL rendezvous with {self.url}")

    def _init_info(self, rank: int, address: str, port: int, world_size: int) -> NCCLTrainerInitInfo:
        return NCCLTrainerInitInfo(master_address=address, master_port=port, world_size=world_size, rank=rank,
                                   packed=True, packed_buffer_size_bytes=self.buffer_bytes)

    def push(self, version: str) -> None:
        if self.engine is None:
            raise TransferError("NCCLTransfer.push before start: call start() once after the model is loaded")
        if not self.engine.is_sender:
            self.engine.send_weights()
            return
        self.client.version = str(version)
        self.client._post("pause?mode=wait")
        self._bounded(self.engine.send_weights, f"the NCCL push of version {version} to {self.url}")
        self.client._post("resume")

    def close(self) -> None:
        """Release the group on both sides; best effort, for the end of a run."""
        if self.engine is None:
            return
        engine, self.engine = self.engine, None
        if engine.is_sender:
            try:
                self.client.shutdown_weight_transfer_engine()
            except TransferError as e:
                logging.getLogger(__name__).warning("%s", e)
        engine.shutdown()

    def _bounded(self, fn, what: str):
        """fn() on a side thread, waited for at most `timeout` seconds and no longer than the first failed
        HTTP call: an NCCL wait for a peer that refused the request would otherwise never return."""
        wake, box = threading.Event(), {}
        self.client.wake, self.client.failure = wake, None

        def run():
            try:
                if self.device.type == "cuda":  # the current device is per thread; vLLM reads it
                    torch.cuda.set_device(self.device)
                box["value"] = fn()
            except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread below
                box["error"] = e
            wake.set()

        threading.Thread(target=run, name="rlmini-nccl", daemon=True).start()
        finished = wake.wait(self.timeout)
        self.client.wake = None
        if self.client.failure is not None:
            raise self.client.failure
        if not finished:
            raise TransferError(f"{what} took over {self.timeout:.0f} s: check that the server's GPUs reach "
                                "this host over NCCL (same fabric, NCCL_SOCKET_IFNAME)")
        if "error" in box:
            error = box["error"]
            raise error if isinstance(error, TransferError) else TransferError(
                f"{what} failed: {type(error).__name__}: {_one_line(error)}") from error
        return box["value"]
