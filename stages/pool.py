"""Where the processes of a multi-process trainer meet: agreements and the pooled rescoring.

A multi-process trainer runs one :class:`~dew_pipe.stages.scheduler.RolloutScheduler` per
process, each on its own source over the task rows its data stream reads, each packing its
own ``N`` rows; the step's batch is every process's rows together, placed by the Trainer as
it places any batch (``jax.make_array_from_process_local_data`` over the mesh's ``data``
axis), so no rollout crosses a process. The processes meet twice per batch, always on the
Trainer's thread and in the same order, so their collectives never interleave with the
update's:

1. at the weight push: every process calls ``weights.load`` (the publisher decides which
   process sends; ``Publication`` sends from process 0), after the processes have checked
   that each is healthy and that they serve the same version, and they agree on its outcome;
2. at the proximal rescoring, which runs once over the pool's batch: one compiled call
   scores every process's rows under the trainer's current weights, each process keeping
   its own rows back.

Before each meeting every process says whether its own part failed (a source that raised,
a group whose chains cannot fit ``N`` rows, a push that failed), so a failure on one process
raises on every process, naming that process, instead of leaving the others waiting in a
collective. The agreements are small host buffers exchanged with
``jax.experimental.multihost_utils`` (device collectives: every process must call them).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from dew_pipe.stages.rescore import SCORED

__all__ = ["ProcessPool"]
_MESSAGE_BYTES = 2048  # of a failure's message, shared with the other processes


class ProcessPool:
    """This process's place among the trainer's processes, and the meetings they hold.

    Args:
      objective: the GRPO objective whose ``packed_log_probs`` rescores the pool's batch.

    Example (a sketch: every process of a ``jax.distributed`` job runs it)::

        pool = ProcessPool(objective)
        pool.meet("pushing version 3", failure)  # raises on every process if any failed
        old = pool.rescore(state.params, columns, version=3)  # this process's rows
    """

    def __init__(self, objective: Any) -> None:
        self.index = jax.process_index()
        self.count = jax.process_count()
        self.objective = objective
        self._scorers: dict[Any, Any] = {}  # compiled once per (mesh, shardings)

    def meet(self, what: str, failure: BaseException | None, value: int = 0) -> list[int]:
        """Every process says how its part of ``what`` went; all raise if any failed.

        Args:
          what: the step, for messages ("pushing version 3").
          failure: this process's exception, or None.
          value: an int each process shares (the served version), returned per process.

        Returns:
          ``value`` of every process, by process index.

        Raises:
          this process's ``failure`` itself, or RuntimeError naming the first process that
          failed and its message.
        """
        message = b"" if failure is None else f"{type(failure).__name__}: {failure}".encode()
        buffer = np.zeros(2 + 8 + _MESSAGE_BYTES, np.uint8)
        buffer[0] = 1 if failure is None else 2
        buffer[2:10] = np.frombuffer(np.int64(value).tobytes(), np.uint8)
        message = message[:_MESSAGE_BYTES]
        buffer[10 : 10 + len(message)] = np.frombuffer(message, np.uint8)
        gathered = np.asarray(multihost_utils.process_allgather(buffer), np.uint8)
        gathered = gathered.reshape(self.count, buffer.size)
        if failure is not None:
            raise failure
        failed = [p for p in range(self.count) if gathered[p, 0] != 1]
        if failed:
            p = failed[0]
            text = gathered[p, 10:].tobytes().rstrip(b"\0").decode(errors="replace")
            raise RuntimeError(
                f"RolloutScheduler: {what} failed on process {p} of {self.count}, so every "
                f"process stops: {text}"
            )
        return [
            int(np.frombuffer(gathered[p, 2:10].tobytes(), np.int64)[0]) for p in range(self.count)
        ]

    def rescore(self, params: Any, columns: dict[str, np.ndarray], version: int) -> np.ndarray:
        """``old_log_probs`` of this process's rows, scored once over the pool's batch.

        Every process calls it with its own rows (the same shapes); the rows are placed
        over the mesh of ``params`` as the Trainer places a batch, scored in one compiled
        call, and each process gets its own rows back, 0 off the sampled ids.

        Raises:
          ValueError: (on every process) a sampled id whose likelihood is not finite on
            some process; ``params`` not laid out on a mesh.
        """
        sharding, replicated = _shardings(params)
        feed = {name: columns[name] for name in (*SCORED, "response_mask") if name in columns}
        placed = {
            name: jax.make_array_from_process_local_data(sharding, value)
            for name, value in feed.items()
        }
        key = (sharding, tuple(sorted(feed)))
        if key not in self._scorers:
            self._scorers[key] = jax.jit(self._score, out_shardings=(sharding, replicated))
        scores, finite = self._scorers[key](params, placed)
        if not bool(np.asarray(finite.addressable_data(0))):
            raise ValueError(
                f"rescore: the log-probability of a sampled id under version {version} is not "
                "finite (on at least one process)"
            )
        return _local_rows(scores)

    def _score(self, params: Any, feed: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
        scored = self.objective.packed_log_probs(
            params, {k: v for k, v in feed.items() if k in SCORED}
        )
        sampled = feed["response_mask"] == 1
        finite = jnp.all(jnp.where(sampled, jnp.isfinite(scored), True))
        return jnp.where(sampled, scored, 0.0).astype(jnp.float32), finite


def _shardings(params: Any) -> tuple[NamedSharding, NamedSharding]:
    """The Trainer's batch layout, read off its (replicated) parameters: rows split over
    every axis of their mesh, as ``Trainer`` splits a batch over its ``data`` axis."""
    leaves = jax.tree.leaves(params)
    sharding = getattr(leaves[0], "sharding", None) if leaves else None
    if not isinstance(sharding, NamedSharding):
        raise ValueError(
            f"rescore: the trainer's parameters are laid out by {type(sharding).__name__}; "
            "expected a NamedSharding over the Trainer's mesh (a multi-process Trainer's state)"
        )
    mesh = sharding.mesh
    return NamedSharding(mesh, PartitionSpec(mesh.axis_names)), NamedSharding(mesh, PartitionSpec())


def _local_rows(array: jax.Array) -> np.ndarray:
    """This process's rows of a row-split global array, in row order."""
    shards = sorted(array.addressable_shards, key=lambda s: s.index[0].start or 0)
    return np.concatenate([np.asarray(s.data) for s in shards])
