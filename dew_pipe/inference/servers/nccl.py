"""NCCL and the CUDA runtime through ctypes: the few calls `NCCLPush` makes, no torch.

`NCCL(library)` loads a ``libnccl.so.2`` (the engine's own: NCCL refuses a peer of another
version) and binds ``ncclGetVersion``, ``ncclGetUniqueId``, ``ncclCommInitRank``,
``ncclAllReduce``, ``ncclBroadcast``, ``ncclCommGetAsyncError``, ``ncclCommAbort`` and
``ncclGetErrorString``, with the C signatures of nccl.h. `CUDARuntime(library)` binds
``cudaSetDevice``, ``cudaStreamCreateWithFlags``, ``cudaStreamQuery`` and
``cudaGetErrorString`` from ``libcudart.so.12``. Loading checks that every symbol is
there, so a wrong file fails when the push is built, naming the file and the symbol.

Every call's status is checked: a failure raises `NCCLError` with NCCL's (or CUDA's) own
message. The unique id is the 128-byte ``ncclUniqueId`` struct, passed by value to
``ncclCommInitRank`` as nccl.h declares it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path

__all__ = ["UNIQUE_ID_BYTES", "CUDARuntime", "NCCLError", "NCCL"]

UNIQUE_ID_BYTES = 128  # NCCL_UNIQUE_ID_BYTES in nccl.h
UINT8, FLOAT32 = 1, 7  # ncclDataType_t: ncclUint8, ncclFloat32
SUM = 0  # ncclRedOp_t: ncclSum
IN_PROGRESS = 7  # ncclResult_t: ncclInProgress
NOT_READY = 600  # cudaError_t: cudaErrorNotReady (cudaStreamQuery on a busy stream)
NON_BLOCKING = 1  # cudaStreamNonBlocking


class NCCLError(RuntimeError):
    """An NCCL or CUDA call failed, or its library could not be loaded."""


class UniqueId(ctypes.Structure):
    """``ncclUniqueId``: 128 opaque bytes every rank of a group shares."""

    _fields_ = [("internal", ctypes.c_byte * UNIQUE_ID_BYTES)]


def _load(library: str | os.PathLike[str], what: str) -> ctypes.CDLL:
    path = str(library)
    if os.sep in path and not Path(path).is_file():
        raise NCCLError(f"{what} library {path} does not exist")
    try:
        return ctypes.CDLL(path)
    except OSError as error:
        raise NCCLError(f"{what} library {path} could not be loaded: {error}") from error


def _bind(lib: ctypes.CDLL, path: str, name: str, restype, argtypes) -> None:
    try:
        function = getattr(lib, name)
    except AttributeError as error:
        raise NCCLError(f"{path} has no symbol {name}; is it a {name[:4]} library?") from error
    function.restype, function.argtypes = restype, argtypes


class NCCL:
    """The NCCL calls of a weight broadcast (see the module docstring).

    Args:
        library: path of ``libnccl.so.2`` (for a pip-installed vLLM,
            ``<venv>/lib/python3.X/site-packages/nvidia/nccl/lib/libnccl.so.2``).

    Raises:
        NCCLError: the file is missing, cannot be loaded, or lacks an NCCL symbol.
    """

    def __init__(self, library: str | os.PathLike[str]) -> None:
        self.path = str(library)
        self.lib = _load(library, "NCCL")
        c_int, ptr, comm = ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p
        for name, argtypes in (
            ("ncclGetVersion", [ctypes.POINTER(c_int)]),
            ("ncclGetUniqueId", [ctypes.POINTER(UniqueId)]),
            ("ncclCommInitRank", [ctypes.POINTER(comm), c_int, UniqueId, c_int]),
            ("ncclAllReduce", [ptr, ptr, ctypes.c_size_t, c_int, c_int, comm, ptr]),
            ("ncclBroadcast", [ptr, ptr, ctypes.c_size_t, c_int, c_int, comm, ptr]),
            ("ncclCommGetAsyncError", [comm, ctypes.POINTER(c_int)]),
            ("ncclCommAbort", [comm]),
        ):
            _bind(self.lib, self.path, name, c_int, argtypes)
        _bind(self.lib, self.path, "ncclGetErrorString", ctypes.c_char_p, [c_int])

    def _check(self, result: int, call: str) -> None:
        if result != 0:
            message = self.lib.ncclGetErrorString(result) or b"unknown error"
            raise NCCLError(f"{call} failed with NCCL error {result}: {message.decode()}")

    def version(self) -> int:
        """NCCL's version code (e.g. 22703 for 2.27.3)."""
        value = ctypes.c_int()
        self._check(self.lib.ncclGetVersion(ctypes.byref(value)), "ncclGetVersion")
        return value.value

    def unique_id(self) -> bytes:
        """A fresh ``ncclUniqueId`` (128 bytes) for a new group."""
        uid = UniqueId()
        self._check(self.lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        return bytes(uid.internal)

    def init_rank(self, world_size: int, unique_id: bytes, rank: int) -> int:
        """Joins the group of ``unique_id`` as ``rank``; blocks until every rank joined."""
        if len(unique_id) != UNIQUE_ID_BYTES:
            raise NCCLError(f"unique id has {len(unique_id)} bytes; expected {UNIQUE_ID_BYTES}")
        uid = UniqueId()
        ctypes.memmove(uid.internal, unique_id, UNIQUE_ID_BYTES)
        comm = ctypes.c_void_p()
        self._check(
            self.lib.ncclCommInitRank(ctypes.byref(comm), world_size, uid, rank),
            "ncclCommInitRank",
        )
        return comm.value

    def all_reduce(self, buffer: int, count: int, dtype: int, comm: int, stream: int) -> None:
        """In-place sum all-reduce of ``count`` elements at device address ``buffer``."""
        self._check(
            self.lib.ncclAllReduce(buffer, buffer, count, dtype, SUM, comm, stream), "ncclAllReduce"
        )

    def broadcast(self, buffer: int, nbytes: int, root: int, comm: int, stream: int) -> None:
        """Broadcasts ``nbytes`` at device address ``buffer`` from ``root`` (enqueued)."""
        self._check(
            self.lib.ncclBroadcast(buffer, buffer, nbytes, UINT8, root, comm, stream),
            "ncclBroadcast",
        )

    def async_error(self, comm: int) -> None:
        """Raises the error a communicator's asynchronous operations hit, if any."""
        state = ctypes.c_int()
        self._check(
            self.lib.ncclCommGetAsyncError(comm, ctypes.byref(state)), "ncclCommGetAsyncError"
        )
        if state.value not in (0, IN_PROGRESS):
            self._check(state.value, "an NCCL operation")

    def abort(self, comm: int) -> None:
        """Aborts a communicator (``ncclCommDestroy`` would wait for the peers, which an
        engine keeps until it exits)."""
        self._check(self.lib.ncclCommAbort(comm), "ncclCommAbort")


class CUDARuntime:
    """The CUDA runtime calls of a weight broadcast.

    Args:
        library: path or name of ``libcudart.so.12``; None looks for ``libcudart.so.12``
            beside NCCL (``nvidia/cuda_runtime/lib``, the pip layout) and then on the
            loader's path.

    Raises:
        NCCLError: no runtime found, or one that lacks a CUDA symbol.
    """

    def __init__(self, library: str | os.PathLike[str] | None = None, *, near: str | None = None):
        if library is None:
            library = self._find(near)
        self.path = str(library)
        self.lib = _load(library, "CUDA runtime")
        c_int, ptr = ctypes.c_int, ctypes.c_void_p
        for name, argtypes in (
            ("cudaSetDevice", [c_int]),
            ("cudaStreamCreateWithFlags", [ctypes.POINTER(ptr), ctypes.c_uint]),
            ("cudaStreamQuery", [ptr]),
        ):
            _bind(self.lib, self.path, name, c_int, argtypes)
        _bind(self.lib, self.path, "cudaGetErrorString", ctypes.c_char_p, [c_int])

    @staticmethod
    def _find(near: str | None) -> str:
        if near is not None:
            candidate = Path(near).resolve().parent.parent.parent / "cuda_runtime" / "lib"
            for path in sorted(candidate.glob("libcudart.so*")):
                return str(path)
        found = ctypes.util.find_library("cudart")
        if found is None:
            raise NCCLError(
                "no CUDA runtime (libcudart.so.12) beside the NCCL library or on the loader's "
                "path; pass cudart= its path"
            )
        return found

    def _check(self, result: int, call: str) -> None:
        if result != 0:
            message = self.lib.cudaGetErrorString(result) or b"unknown error"
            raise NCCLError(f"{call} failed with CUDA error {result}: {message.decode()}")

    def set_device(self, index: int) -> None:
        """Makes CUDA device ``index`` current on the calling thread."""
        self._check(self.lib.cudaSetDevice(index), "cudaSetDevice")

    def stream(self) -> int:
        """A new non-blocking stream (it never waits on the legacy default stream)."""
        stream = ctypes.c_void_p()
        self._check(
            self.lib.cudaStreamCreateWithFlags(ctypes.byref(stream), NON_BLOCKING),
            "cudaStreamCreateWithFlags",
        )
        return stream.value

    def idle(self, stream: int) -> bool:
        """True once every operation enqueued on ``stream`` has finished."""
        result = self.lib.cudaStreamQuery(stream)
        if result == NOT_READY:
            return False
        self._check(result, "cudaStreamQuery")
        return True
