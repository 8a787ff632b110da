"""Datasets the Trainer reads, and the read-ahead settings loaders share.

A :class:`Dataset` is a recipe, not a container: ``train(partition)`` opens a fresh
iterator of batches for one process, ``val(partition)`` an iterable of validation
batches. A batch is a mapping from field name to a NumPy array whose axis 0 is the
example axis. The Trainer owns iteration order, epochs and resume; loaders own
reading and decoding, and use :class:`Loading` to read ahead of the consumer.

This module imports no JAX, so loader worker processes stay cheap to start.
"""

from __future__ import annotations

import concurrent.futures as futures
import multiprocessing
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import numpy as np

from dew_pipe._validate import check_int

__all__ = ["Batch", "Dataset", "Loading", "Partition", "Prefetch", "check_batch"]

T = TypeVar("T")
U = TypeVar("U")
Batch = Mapping[str, np.ndarray]


class _PartitionFields(NamedTuple):
    index: int
    count: int


class Partition(_PartitionFields):
    """The slice of the data one process reads: ``(index, count)``.

    ``index`` is this process's index (``jax.process_index()``) and ``count`` the
    number of processes. It unpacks like a tuple.

    Args:
        index: process index, ``0 <= index < count``.
        count: number of processes, at least 1.

    Raises:
        ValueError: for an index outside ``[0, count)`` or a count below 1.

    Example:
        >>> Partition(0, 2).local_batch(8)
        4
    """

    __slots__ = ()

    def __new__(cls, index: int, count: int) -> Partition:
        count = check_int("Partition.count", count, minimum=1)
        index = check_int("Partition.index", index, minimum=0)
        if index >= count:
            raise ValueError(f"Partition.index={index}; expected an int below count={count}")
        return super().__new__(cls, index, count)

    def local_batch(self, batch: int) -> int:
        """Rows of a global batch of ``batch`` examples that this process supplies.

        Raises:
            ValueError: when ``batch`` does not divide evenly among the processes.
        """
        if batch % self.count:
            raise ValueError(
                f"batch={batch} does not divide among {self.count} processes; "
                "expected a multiple of the process count"
            )
        return batch // self.count

    def owns(self, record: int) -> bool:
        """Whether record number ``record`` belongs to this process (round robin)."""
        return record % self.count == self.index


@dataclass(frozen=True)
class Dataset:
    """Training and validation batches for :class:`dew_pipe.Trainer`.

    Args:
        train: called with a :class:`Partition`, returns an iterator of training batches
            (``{field: np.ndarray}`` with ``batch // partition.count`` rows each). The
            trainer calls it again to start another epoch when an iterator ends, and on
            resume, after which it skips the batches already consumed (or restores the
            iterator's own ``get_state()`` when it has ``get_state``/``set_state``).
        val: called with a :class:`Partition`, returns validation batches; ``None`` when
            there is no validation data.
        records: number of training examples in one epoch, ``None`` when unknown or
            unbounded. Used to report epochs.
        batch: examples per training step, summed over all processes.

    Raises:
        TypeError: when ``train``/``val`` are not callable or a count is not an int.
        ValueError: when ``batch`` is missing or below 1, or ``records`` is negative.

    Example:
        >>> import itertools
        >>> batch = {"x": np.zeros((4, 3), np.float32)}
        >>> data = Dataset(train=lambda partition: itertools.repeat(batch), val=None,
        ...                records=4, batch=4)
        >>> next(data.open_train(Partition(0, 1)))["x"].shape
        (4, 3)
    """

    train: Callable[[Partition], Iterator[Batch]]
    val: Callable[[Partition], Iterable[Batch]] | None = None
    records: int | None = None
    batch: int | None = None

    def __post_init__(self) -> None:
        if not callable(self.train):
            raise TypeError(
                f"Dataset.train={self.train!r} is not callable; "
                "expected a function of a Partition returning an iterator of batches"
            )
        if self.val is not None and not callable(self.val):
            raise TypeError(
                f"Dataset.val={self.val!r} is not callable; "
                "expected None or a function of a Partition returning batches"
            )
        if self.batch is None:
            raise ValueError("Dataset.batch is missing; expected the examples per step, an int")
        check_int("Dataset.batch", self.batch, minimum=1)
        if self.records is not None:
            check_int("Dataset.records", self.records, minimum=0)

    def open_train(self, partition: Partition) -> Iterator[Batch]:
        """Open a fresh training iterator for ``partition``."""
        source = self.train(partition)
        if not isinstance(source, Iterable):
            raise TypeError(
                f"Dataset.train returned {type(source).__name__}; expected an iterator of batches"
            )
        return source if isinstance(source, Iterator) else iter(source)

    def open_val(self, partition: Partition) -> Iterator[Batch]:
        """Open the validation batches for ``partition``.

        Raises:
            ValueError: when the dataset has no ``val``.
        """
        if self.val is None:
            raise ValueError("Dataset.val is None; expected a validation source for evaluation")
        source = self.val(partition)
        if not isinstance(source, Iterable):
            raise TypeError(
                f"Dataset.val returned {type(source).__name__}; expected an iterable of batches"
            )
        return iter(source)


def check_batch(
    batch: Any, rows: int | None = None, *, where: str = "batch"
) -> dict[str, np.ndarray]:
    """Check that ``batch`` is a mapping of numeric arrays sharing axis 0.

    Args:
        batch: the mapping to check.
        rows: the number of examples expected on axis 0, or ``None`` for any.
        where: how the batch is named in errors (e.g. ``"training batch 3"``).

    Returns:
        A dict of the same fields as NumPy arrays (no copy where already arrays).

    Raises:
        TypeError: for a non-mapping, a non-string field name or a non-numeric field.
        ValueError: for an empty batch, a scalar field, or mismatched example counts.
    """
    if not isinstance(batch, Mapping):
        raise TypeError(f"{where} is a {type(batch).__name__}; expected a mapping of arrays")
    if not batch:
        raise ValueError(f"{where} has no fields; expected at least one array")
    out: dict[str, np.ndarray] = {}
    first: tuple[str, int] | None = None
    for name, value in batch.items():
        if not isinstance(name, str):
            raise TypeError(f"{where} has field name {name!r}; expected str")
        array = np.asarray(value)
        if array.dtype.kind not in "biuf":
            raise TypeError(
                f"{where} field {name!r} has dtype {array.dtype}; expected a numeric or bool array"
            )
        if array.ndim == 0:
            raise ValueError(
                f"{where} field {name!r} is a scalar; expected axis 0 to be the example axis"
            )
        if first is None:
            first = (name, array.shape[0])
        elif array.shape[0] != first[1]:
            raise ValueError(
                f"{where} field {name!r} has {array.shape[0]} rows but {first[0]!r} has "
                f"{first[1]}; expected every field to share axis 0"
            )
        out[name] = array
    assert first is not None
    if rows is not None and first[1] != rows:
        raise ValueError(f"{where} has {first[1]} rows (field {first[0]!r}); expected {rows}")
    return out


class _Failure:
    """Carries a producer's exception through the queue to the consumer."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


_END = object()


def _produce(source: Iterable[Any], out: queue.Queue, stop: threading.Event) -> None:
    """Producer thread body: fill ``out`` from ``source`` until done or stopped."""
    iterator = iter(source)
    try:
        for item in iterator:
            while not stop.is_set():
                try:
                    out.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if stop.is_set():
                return
        item = _END
    except BaseException as error:  # re-raised in the consumer
        item = _Failure(error)
    finally:
        close = getattr(iterator, "close", None)
        if close is not None:
            close()
    while not stop.is_set():
        try:
            out.put(item, timeout=0.1)
            return
        except queue.Full:
            continue


class Prefetch(Iterator[T]):
    """Iterate ``source`` in a background thread, keeping up to ``buffer`` items ready.

    Order is kept. An exception raised by the source is raised again from ``next``
    in the consuming thread. ``close()`` (or leaving a ``with`` block) stops the
    thread and closes the source.

    Args:
        source: the iterable to read ahead of the consumer.
        buffer: items that may wait ready, at least 1. The queue is bounded so a fast
            reader cannot fill memory ahead of a slow trainer.

    Example:
        >>> with Prefetch(range(3), buffer=2) as items:
        ...     list(items)
        [0, 1, 2]
    """

    def __init__(self, source: Iterable[T], buffer: int) -> None:
        check_int("Prefetch.buffer", buffer, minimum=1)
        self._queue: queue.Queue = queue.Queue(maxsize=buffer)
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(
            target=_produce,
            args=(source, self._queue, self._stop),
            name="dew-prefetch",
            daemon=True,
        )
        self._thread.start()

    def __next__(self) -> T:
        if self._done:
            raise StopIteration
        item = self._queue.get()
        if item is _END:
            self._done = True
            raise StopIteration
        if isinstance(item, _Failure):
            self._done = True
            raise item.error
        return item

    def close(self) -> None:
        """Stop the reader thread and release the source."""
        self._done = True
        self._stop.set()
        while True:  # unblock a producer waiting on a full queue
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout=5.0)

    def __enter__(self) -> Prefetch[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not self._done:
            self._stop.set()


def _ordered_map(
    fn: Callable[[T], U], items: Iterable[T], pool: futures.Executor, window: int
) -> Iterator[U]:
    """Apply ``fn`` on ``pool`` with at most ``window`` calls in flight, in input order."""
    pending: deque[futures.Future] = deque()
    try:
        for item in items:
            pending.append(pool.submit(fn, item))
            if len(pending) >= window:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for future in pending:
            future.cancel()
        pool.shutdown(wait=True, cancel_futures=True)


@dataclass(frozen=True)
class Loading:
    """How a loader reads and decodes ahead of the trainer.

    Args:
        workers: processes that run the decode function (CPU-bound Python work such
            as tokenization). 0 keeps the work in this process. Processes are started
            with ``spawn`` (forking a process that runs JAX threads is unsafe), so the
            function must be picklable.
        threads: threads that run the decode function when ``workers`` is 0; more
            than 1 helps I/O-bound reads and libraries that release the GIL.
        read_buffer: finished items allowed to wait ahead of the consumer; 0 reads
            only on demand. Memory grows with it, so it is small by default.

    Raises:
        TypeError: for a non-int setting.
        ValueError: for ``workers < 0``, ``threads < 1`` or ``read_buffer < 0``.

    Example:
        >>> with Loading(workers=0, threads=2, read_buffer=2).map(abs, [-1, 2, -3]) as out:
        ...     list(out)
        [1, 2, 3]
    """

    workers: int = 0
    threads: int = 1
    read_buffer: int = 2

    def __post_init__(self) -> None:
        check_int("Loading.workers", self.workers, minimum=0)
        check_int("Loading.threads", self.threads, minimum=1)
        check_int("Loading.read_buffer", self.read_buffer, minimum=0)

    def prefetch(self, source: Iterable[T]) -> LoadingIterator[T]:
        """Read ``source`` in a background thread, ``read_buffer`` items ahead."""
        return self.map(None, source)

    def map(self, fn: Callable[[T], U] | None, items: Iterable[T]) -> LoadingIterator[U]:
        """Apply ``fn`` to each item ahead of the consumer, keeping input order.

        Args:
            fn: the decode function, or ``None`` to pass items through unchanged.
            items: the inputs, read in the consuming thread when a pool is used.

        Returns:
            A :class:`LoadingIterator`; close it (or use ``with``) to stop the work early.
        """
        if fn is not None and self.workers > 0:
            context = multiprocessing.get_context("spawn")
            pool = futures.ProcessPoolExecutor(self.workers, mp_context=context)
            return LoadingIterator(_ordered_map(fn, items, pool, self.workers + self.read_buffer))
        if fn is not None and self.threads > 1:
            pool = futures.ThreadPoolExecutor(self.threads, thread_name_prefix="dew-load")
            return LoadingIterator(_ordered_map(fn, items, pool, self.threads + self.read_buffer))
        source: Iterable[Any] = items if fn is None else map(fn, items)
        if self.read_buffer == 0:
            return LoadingIterator(iter(source))
        return LoadingIterator(Prefetch(source, self.read_buffer))


class LoadingIterator(Iterator[T]):
    """The iterator :meth:`Loading.map` returns: iterate it, then ``close()`` it."""

    def __init__(self, inner: Iterator[T]) -> None:
        self._inner = inner

    def __next__(self) -> T:
        return next(self._inner)

    def close(self) -> None:
        """Stop reading ahead and release threads, processes and the source."""
        close = getattr(self._inner, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> LoadingIterator[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
