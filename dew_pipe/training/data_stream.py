"""The trainer's view of a Dataset: epochs, read-ahead and a resumable position.

The position of the stream is the number of batches the trainer has consumed, plus
the epoch and the offset inside it. On resume the trainer re-opens the epoch and
either restores the iterator's own state (when it offers ``get_state`` and
``set_state``) or reads and discards the batches already consumed.

Read-ahead batches are read but not consumed: a checkpoint records the position of
the first batch not yet trained on, so batches read ahead are read again after a
resume.
"""

from __future__ import annotations

import copy
import json
from collections import deque
from collections.abc import Iterator
from typing import Any

from dew_pipe.data.dataset import Batch, Dataset, Partition

__all__ = ["BatchStream"]


def _resumable(iterator: Iterator[Any]) -> bool:
    return callable(getattr(iterator, "get_state", None)) and callable(
        getattr(iterator, "set_state", None)
    )


class BatchStream:
    """Training batches from ``data`` for one process, across epochs.

    Args:
        data: the dataset.
        partition: this process's slice.
        position: a value returned by :meth:`position` to resume from, or ``None``
            to start at the first batch.

    Raises:
        ValueError: when an epoch yields no batches at all.
    """

    def __init__(self, data: Dataset, partition: Partition, position: dict | None) -> None:
        self._data = data
        self._partition = partition
        self._ready: deque[tuple[Batch, dict[str, Any]]] = deque()
        self.consumed = 0
        self._epoch = 0
        self._in_epoch = 0
        self._iterator = data.open_train(partition)
        if position is None:
            return
        state = position.get("iterator_state")
        if state is not None and _resumable(self._iterator):
            self._epoch = int(position["epoch"])
            self._in_epoch = int(position["in_epoch"])
            self._iterator.set_state(state)
            self.consumed = int(position["consumed"])
            return
        for _ in range(int(position["consumed"])):  # no iterator state: replay
            self._read()
        self._ready.clear()
        self.consumed = int(position["consumed"])

    def _here(self) -> dict[str, Any]:
        here: dict[str, Any] = {"epoch": self._epoch, "in_epoch": self._in_epoch}
        if _resumable(self._iterator):
            # A deep copy: an iterator may hand out its live, mutable state.
            here["iterator_state"] = copy.deepcopy(self._iterator.get_state())
        return here

    def _read(self) -> None:
        """Read one more batch into the ready queue, starting a new epoch if needed."""
        here = self._here()
        try:
            batch = next(self._iterator)
        except StopIteration:
            if self._in_epoch == 0:
                raise ValueError(
                    f"Dataset.train yielded no batches in epoch {self._epoch}; "
                    "expected at least one batch per epoch"
                ) from None
            self._close_iterator()
            self._epoch += 1
            self._in_epoch = 0
            self._iterator = self._data.open_train(self._partition)
            here = self._here()
            try:
                batch = next(self._iterator)
            except StopIteration:
                raise ValueError(
                    f"Dataset.train yielded no batches in epoch {self._epoch}; "
                    "expected at least one batch per epoch"
                ) from None
        self._in_epoch += 1
        self._ready.append((batch, here))

    def fill(self, count: int) -> None:
        """Read until ``count`` batches are ready."""
        while len(self._ready) < count:
            self._read()

    def next(self) -> Batch:
        """Consume the next batch."""
        self.fill(1)
        batch, _ = self._ready.popleft()
        self.consumed += 1
        return batch

    @property
    def epoch(self) -> int:
        """The epoch of the next batch to consume."""
        return self._ready[0][1]["epoch"] if self._ready else self._epoch

    def position(self) -> dict[str, Any]:
        """Where the next unconsumed batch is, as a JSON-serializable dict.

        Raises:
            TypeError: when the iterator's ``get_state()`` is not JSON-serializable.
        """
        here = self._ready[0][1] if self._ready else self._here()
        state = here.get("iterator_state")
        try:
            json.dumps(state)
        except (TypeError, ValueError) as error:
            raise TypeError(
                f"the training iterator's get_state() returned {type(state).__name__}; "
                "expected a JSON-serializable value to store in the checkpoint"
            ) from error
        return dict(here, consumed=self.consumed)

    def _close_iterator(self) -> None:
        close = getattr(self._iterator, "close", None)
        if close is not None:
            close()

    def close(self) -> None:
        """Drop read-ahead batches and close the iterator."""
        self._ready.clear()
        self._close_iterator()
