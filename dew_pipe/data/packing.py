"""Pack variable-length token documents into fixed-width rows.

Documents are placed first-fit in decreasing order of length (FFD): each goes into the earliest
row with room for it, and a new row opens only when none has. FFD needs at most about
11/9 of the optimal number of rows, and in practice fills rows to within a few percent
when documents are short next to the row width. A max-segment tree over the rows' free space
finds the earliest row with room in O(log rows), so packing a million documents is quick.

Every row carries four arrays: token ids, roles, segment ids (1, 2, ... per document in the
row, 0 on padding) and positions (0, 1, ... restarting per document, 0 on padding).
"""

from __future__ import annotations

import abc
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from dew_pipe.data.dataset import Partition

__all__ = ["ResumableBatches", "RowBatches", "first_fit", "pack_documents", "padded_batches"]


class _FreeSpace:
    """Free space of up to ``capacity`` rows, with "first row holding at least n" queries."""

    def __init__(self, capacity: int, width: int) -> None:
        size = 1
        while size < capacity:
            size *= 2
        self.size = size
        self.tree = np.full(2 * size, width, dtype=np.int64)  # every row starts empty

    def first_with(self, need: int) -> int:
        node = 1
        while node < self.size:
            node = 2 * node if self.tree[2 * node] >= need else 2 * node + 1
        return node - self.size

    def take(self, row: int, amount: int) -> None:
        node = row + self.size
        self.tree[node] -= amount
        node //= 2
        while node:
            self.tree[node] = max(self.tree[2 * node], self.tree[2 * node + 1])
            node //= 2


def first_fit(lengths: Sequence[int], width: int) -> list[list[int]]:
    """Assign documents to rows of ``width`` tokens, first-fit decreasing.

    Args:
        lengths: the length of each document, each in ``[1, width]``.
        width: tokens per row.

    Returns:
        The rows, in the order they were opened; each lists its documents' indices in the
        order they were placed (longest first; ties in input order).

    Raises:
        ValueError: a length outside ``[1, width]``, or ``width`` below 1.

    Example:
        >>> first_fit([3, 5, 2, 4], width=6)
        [[1], [3, 2], [0]]
    """
    if width < 1:
        raise ValueError(f"width must be at least 1, got {width}")
    lengths = np.asarray(lengths, dtype=np.int64)
    bad = np.flatnonzero((lengths < 1) | (lengths > width))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"lengths[{i}] is {int(lengths[i])}; expected a length in [1, {width}]")
    order = np.argsort(-lengths, kind="stable")
    free = _FreeSpace(max(len(lengths), 1), width)
    rows: list[list[int]] = []
    for doc in order.tolist():
        row = free.first_with(int(lengths[doc]))
        if row == len(rows):
            rows.append([])
        rows[row].append(doc)
        free.take(row, int(lengths[doc]))
    return rows


def pack_documents(
    tokens: Sequence[np.ndarray],
    roles: Sequence[np.ndarray],
    width: int,
    *,
    pad_id: int = 0,
) -> dict[str, np.ndarray]:
    """Pack documents into ``[rows, width]`` arrays with first-fit decreasing.

    Args:
        tokens: each document's token ids (1-D integer arrays of length 1 to ``width``).
        roles: each document's role per token, same lengths as ``tokens``.
        width: tokens per row.
        pad_id: token id written into padding slots.

    Returns:
        ``text`` (int32), ``text_roles`` (int8), ``text_segment_ids`` (int32, 0 = padding) and
        ``text_positions`` (int32), each ``[rows, width]``.

    Raises:
        ValueError: mismatched lengths between ``tokens`` and ``roles``, or a document that
            is empty or longer than ``width``.

    Example:
        >>> out = pack_documents([np.array([7, 8]), np.array([9])],
        ...                      [np.array([2, 3]), np.array([2])], width=4)
        >>> out["text"].tolist(), out["text_segment_ids"].tolist()
        ([[7, 8, 9, 0]], [[1, 1, 2, 0]])
    """
    if len(tokens) != len(roles):
        raise ValueError(f"got {len(tokens)} token documents but {len(roles)} role documents")
    for i, (ids, rs) in enumerate(zip(tokens, roles, strict=True)):
        if len(ids) != len(rs):
            raise ValueError(f"document {i} has {len(ids)} tokens but {len(rs)} roles")
    rows = first_fit([len(ids) for ids in tokens], width)
    text = np.full((len(rows), width), pad_id, dtype=np.int32)
    text_roles = np.zeros((len(rows), width), dtype=np.int8)
    segments = np.zeros((len(rows), width), dtype=np.int32)
    positions = np.zeros((len(rows), width), dtype=np.int32)
    for r, docs in enumerate(rows):
        start = 0
        for segment, doc in enumerate(docs, start=1):
            end = start + len(tokens[doc])
            text[r, start:end] = tokens[doc]
            text_roles[r, start:end] = roles[doc]
            segments[r, start:end] = segment
            positions[r, start:end] = np.arange(end - start)
            start = end
    return {
        "text": text,
        "text_roles": text_roles,
        "text_segment_ids": segments,
        "text_positions": positions,
    }


class ResumableBatches(Iterator[dict[str, np.ndarray]], abc.ABC):
    """Endless batches whose global batch ``n`` depends only on ``n``: resumable from a count.

    A subclass says what this process's slice of global batch ``n`` is
    (:meth:`batch_at`); this class counts the batches consumed and saves and restores that
    count (``get_state``/``set_state``, what a checkpoint records of the data position), so
    a resumed run reads exactly the batches it would have read.

    Args:
        batch: rows per global batch.
        partition: this process's ``(index, count)``; it takes the contiguous rows
            ``offset .. offset + local - 1`` of each global batch.

    Raises:
        ValueError: ``batch`` not divisible by the process count.
    """

    def __init__(self, batch: int, partition: Partition) -> None:
        self.batch = batch
        self.local = partition.local_batch(batch)
        self.offset = partition.index * self.local
        self.next_batch = 0

    @abc.abstractmethod
    def batch_at(self, n: int) -> dict[str, np.ndarray]:
        """This process's rows of global batch ``n``."""

    def __next__(self) -> dict[str, np.ndarray]:
        out = self.batch_at(self.next_batch)
        self.next_batch += 1
        return out

    def get_state(self) -> dict[str, Any]:
        """The position to resume from: the number of global batches consumed."""
        return {"next_batch": self.next_batch}

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Resume at ``state["next_batch"]``, as returned by :meth:`get_state`."""
        value = state.get("next_batch") if isinstance(state, Mapping) else None
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"state is {state!r}; expected {{'next_batch': int >= 0}}")
        self.next_batch = int(value)


class RowBatches(ResumableBatches):
    """Endless batches of packed rows, epoch after epoch, resumable from a batch count.

    Global batch ``n`` holds rows ``n * batch`` to ``(n + 1) * batch - 1`` of an endless stream
    that visits every row once per epoch; with ``shuffle`` each epoch's order is a permutation
    drawn from ``(seed, epoch)``, so batch ``n`` is the same on every process, in every run.
    A process takes its contiguous ``batch // count`` slice of each global batch.

    Args:
        rows: ``{field: [rows, width]}`` arrays sharing axis 0 (at least one row).
        batch: rows per global batch.
        partition: this process's ``(index, count)``.
        shuffle: reorder the rows each epoch.
        seed: seed of the orders.

    Raises:
        ValueError: no rows, or ``batch`` not divisible by the process count.

    Example:
        >>> it = RowBatches({"x": np.arange(3)[:, None]}, 2, Partition(0, 1), shuffle=False)
        >>> [next(it)["x"].ravel().tolist() for _ in range(2)]
        [[0, 1], [2, 0]]
    """

    def __init__(
        self,
        rows: Mapping[str, np.ndarray],
        batch: int,
        partition: Partition,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        self.rows = dict(rows)
        self.count = len(next(iter(self.rows.values())))
        if self.count == 0:
            raise ValueError("rows is empty; expected at least one packed row")
        super().__init__(batch, partition)
        self.shuffle, self.seed = shuffle, seed
        self._epoch, self._order = -1, np.arange(self.count)

    def _order_of(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            self._epoch = epoch
            if self.shuffle:
                self._order = np.random.default_rng([self.seed, epoch]).permutation(self.count)
        return self._order

    def batch_at(self, n: int) -> dict[str, np.ndarray]:
        start = n * self.batch + self.offset
        picks = np.empty(self.local, dtype=np.int64)
        for i, k in enumerate(range(start, start + self.local)):
            picks[i] = self._order_of(k // self.count)[k % self.count]
        return {name: array[picks] for name, array in self.rows.items()}


def padded_batches(
    rows: Mapping[str, np.ndarray], batch: int, partition: Partition, *, pad_id: int = 0
) -> list[dict[str, np.ndarray]]:
    """Every row once, in order, as batches; the last one filled with padding rows.

    Padding rows hold ``pad_id`` tokens with segment 0, role 0 and position 0, so they carry
    no loss and shapes stay fixed. A process takes its ``batch // count`` slice of each batch.

    Args:
        rows: ``{field: [rows, width]}`` arrays sharing axis 0.
        batch: rows per global batch.
        partition: this process's ``(index, count)``.
        pad_id: token id of padding rows (in the ``text`` field).

    Returns:
        The batches, ``ceil(rows / batch)`` of them.

    Example:
        >>> out = padded_batches({"text": np.ones((3, 2), np.int32)}, 2, Partition(0, 1))
        >>> [b["text"].tolist() for b in out]
        [[[1, 1], [1, 1]], [[1, 1], [0, 0]]]
    """
    local = partition.local_batch(batch)
    count = len(next(iter(rows.values())))
    total = -(-count // batch) * batch
    full = {}
    for name, array in rows.items():
        fill = pad_id if name == "text" else 0
        pad = np.full((total - count, *array.shape[1:]), fill, dtype=array.dtype)
        full[name] = np.concatenate([array, pad])
    out = []
    for start in range(0, total, batch):
        lo = start + partition.index * local
        out.append({name: array[lo : lo + local] for name, array in full.items()})
    return out
