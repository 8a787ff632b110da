"""Thin derived stages: a source of items, a map (optionally on a worker pool) and a sink.

Each takes a callable, or can be subclassed overriding ``items`` / ``apply`` / ``consume``
(and ``open`` / ``close`` for state, as for any ``Stage``). ``Inlet`` and ``Outlet`` join a
running pipeline to a thread outside it: one feeds items in, the other hands items out.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from dew_pipe._pool import WorkerPool
from dew_pipe.flow.errors import Cancelled, EndOfStream, FlowError, check_count
from dew_pipe.flow.ports import Port, PortType, item_mismatch
from dew_pipe.flow.stage import Stage, StageContext

# How often a stage waiting on its worker futures looks at the cancellation flag. Results
# wake the wait at once; this only bounds how long a cancelled run waits for the stage.
_CANCEL_POLL_S = 0.05


def _require_hook(stage: Stage, given: Any, hook: str, base: type) -> None:
    if given is None and getattr(type(stage), hook) is getattr(base, hook):
        raise TypeError(
            f"{base.__name__.lower()} {stage.name!r}: pass a callable or override {hook}()"
        )
    if given is not None and not callable(given) and hook != "items":
        raise TypeError(f"{base.__name__.lower()} {stage.name!r}: {given!r} is not callable")


class Source(Stage):
    """Emits the items of an iterable on one output port, then ends.

    Args:
      name: stage name.
      items: an iterable, or a zero-argument callable returning one (use a callable when
        the pipeline may run more than once: a generator object is exhausted after a run).
        Subclasses may override ``items()`` instead.
      output_type: the port's type (Arrow schema or class).
      out_port: the port's name.

    The source stops early, closing the iterator, when the run is cancelled or when every
    consumer of its port has finished. An iterator that raises fails the run naming the
    index of the item it was producing.

    Example:
      >>> import pyarrow as pa
      >>> Source("numbers", lambda: range(3), output_type=int).outputs["out"].type
      <class 'int'>
    """

    def __init__(
        self,
        name: str,
        items: Iterable[Any] | Callable[[], Iterable[Any]] | None = None,
        *,
        output_type: Port | PortType,
        out_port: str = "out",
        timeout: float | None = None,
    ) -> None:
        super().__init__(name, outputs={out_port: output_type}, timeout=timeout)
        _require_hook(self, items, "items", Source)
        self._items = items
        self.out_port = out_port

    def items(self) -> Iterable[Any]:
        """The items to emit (called once per run, in the stage's thread)."""
        return self._items() if callable(self._items) else self._items

    def run(self, ctx: StageContext) -> None:
        iterator = iter(self.items())
        try:
            for index in itertools.count():
                ctx.item = index  # before next(): an iterator that raises names its own item
                try:
                    item = next(iterator)
                except StopIteration:
                    return
                if ctx.cancelled or ctx.downstream_done(self.out_port):
                    return
                ctx.put(self.out_port, item)
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:
                close()


class Map(Stage):
    """Applies a function to each item: one output per input.

    Args:
      name: stage name.
      fn: ``item -> item``; subclasses may override ``apply`` instead.
      input_type: type of the input port.
      output_type: type of the output port (default: ``input_type``).
      workers: threads applying ``fn`` concurrently. For host-bound work that releases the
        GIL (NumPy, Arrow, subprocesses, I/O); pure-Python ``fn`` gains nothing from more.
        At most ``workers`` items are in the pool at a time. The threads are daemons
        (``dew_pipe._pool.WorkerPool``): one stuck in ``fn`` is reported by the run and
        never keeps the process from exiting.
      ordered: emit results in input order (a slow item holds back later ones); with
        False, in completion order.
      in_port, out_port: port names.
      timeout: as for ``Stage`` (time waiting for a worker's result counts).

    A failure names the index of the item whose ``fn`` raised; a timeout, the oldest item
    still in the pool.

    Example:
      >>> Map("double", lambda x: 2 * x, input_type=int, workers=2).workers
      2
    """

    def __init__(
        self,
        name: str,
        fn: Callable[[Any], Any] | None = None,
        *,
        input_type: Port | PortType,
        output_type: Port | PortType | None = None,
        workers: int = 1,
        ordered: bool = True,
        in_port: str = "in",
        out_port: str = "out",
        timeout: float | None = None,
    ) -> None:
        out = input_type if output_type is None else output_type
        super().__init__(
            name, inputs={in_port: input_type}, outputs={out_port: out}, timeout=timeout
        )
        workers = check_count(f"stage {name!r}", "workers", workers)
        _require_hook(self, fn, "apply", Map)
        self._fn = fn
        self.workers = workers
        self.ordered = ordered
        self.in_port, self.out_port = in_port, out_port

    def apply(self, item: Any) -> Any:
        """The function applied to each item (on a worker thread when ``workers > 1``)."""
        return self._fn(item)

    def run(self, ctx: StageContext) -> None:
        if self.workers == 1:
            for item in ctx.read(self.in_port):
                ctx.put(self.out_port, self.apply(item))
                if ctx.downstream_done(self.out_port):
                    return  # nobody reads on: stop, releasing the producer upstream
            return
        # Daemon threads: a worker stuck in ``fn`` never keeps the process alive at exit.
        with WorkerPool(self.workers, name=f"{ctx.thread_name}/worker") as pool:
            pending: deque[tuple[int, cf.Future]] = deque()
            try:
                self._pump(ctx, pool, pending)
            finally:
                for _, future in pending:
                    future.cancel()

    def _pump(self, ctx: StageContext, pool: cf.Executor, pending: deque) -> None:
        index, ended = 0, False
        while True:
            while pending:
                done = self._next_done(pending)
                if done is None:
                    break
                ctx.item, future = done
                ctx.put(self.out_port, future.result())  # re-raises the worker's error
            if (ended and not pending) or ctx.downstream_done(self.out_port):
                return
            if ended or len(pending) >= self.workers:
                self._wait(ctx, pending)
                continue
            try:
                item = ctx.get(self.in_port)  # None: a tracked result finished first
            except EndOfStream:
                ended = True
                continue
            if item is not None:
                pending.append((index, ctx.track(pool.submit(self.apply, item))))
                index += 1

    def _next_done(self, pending: deque) -> tuple[int, cf.Future] | None:
        if self.ordered:
            return pending.popleft() if pending[0][1].done() else None
        for k, (_, future) in enumerate(pending):
            if future.done():
                done = pending[k]
                del pending[k]
                return done
        return None

    def _wait(self, ctx: StageContext, pending: deque) -> None:
        """Block until the next emittable result is ready, or raise Cancelled."""
        watched = [pending[0][1]] if self.ordered else [f for _, f in pending]
        ctx.item = pending[0][0]  # a timeout meanwhile blames the oldest item in the pool
        while not ctx.cancelled:
            done, _ = cf.wait(watched, timeout=_CANCEL_POLL_S, return_when=cf.FIRST_COMPLETED)
            if done:
                return
        raise Cancelled()


class Sink(Stage):
    """Calls a function on each item of its one input port.

    Args:
      name: stage name.
      fn: ``item -> None``; subclasses may override ``consume`` instead.
      input_type: the port's type.
      in_port: the port's name.

    Example:
      >>> seen = []
      >>> Sink("collect", seen.append, input_type=int).inputs["in"].required
      True
    """

    def __init__(
        self,
        name: str,
        fn: Callable[[Any], Any] | None = None,
        *,
        input_type: Port | PortType,
        in_port: str = "in",
        timeout: float | None = None,
    ) -> None:
        super().__init__(name, inputs={in_port: input_type}, timeout=timeout)
        _require_hook(self, fn, "consume", Sink)
        self._fn = fn
        self.in_port = in_port

    def consume(self, item: Any) -> None:
        """What to do with each item."""
        self._fn(item)

    def run(self, ctx: StageContext) -> None:
        for item in ctx.read(self.in_port):
            self.consume(item)


class Inlet(Stage):
    """Feeds a running pipeline from another thread: ``put(item)`` there, items flow out here.

    The thread that owns the data (a training loop, a request handler) calls ``put``; the
    stage's own thread passes the items on, in order, on its one output port. ``end()``
    ends the stream once the items already put have gone out. An inlet serves one run.

    Args:
      name: stage name.
      output_type: the port's type; ``put`` checks each item against it.
      capacity: items ``put`` may hold before it blocks (on top of the edge's own room).
      out_port: the port's name.

    ``put`` raises ``FlowError`` once the stream was ended or its run has ended (failed,
    cancelled, or nobody reads on), so a producer never blocks on a pipeline that is gone;
    the run's own ``wait()`` then says why. Items still held when the run ends are counted
    in ``dropped``.

    Example:
      >>> from dew_pipe.flow import Pipeline, Sink
      >>> out, inlet = [], Inlet("feed", output_type=int, capacity=4)
      >>> p = Pipeline("fed")
      >>> p.chain(inlet, Sink("keep", out.append, input_type=int), capacity=2)
      >>> run = p.start()
      >>> for x in (1, 2, 3):
      ...     inlet.put(x)
      >>> inlet.end()
      >>> _ = run.wait(timeout=10)
      >>> out
      [1, 2, 3]
    """

    def __init__(
        self,
        name: str,
        *,
        output_type: Port | PortType,
        capacity: int = 1,
        out_port: str = "out",
    ) -> None:
        super().__init__(name, outputs={out_port: output_type})
        self.capacity = check_count(f"inlet {name!r}", "capacity", capacity)
        self.out_port = out_port
        self.dropped = 0
        self._items: deque[Any] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._finished = False

    def put(self, item: Any, timeout: float | None = None) -> None:
        """Hand ``item`` to the pipeline, waiting while ``capacity`` items are held.

        Raises:
          TypeError: ``item`` does not fit the port's type.
          FlowError: the stream was ended, or the inlet's run has ended.
          TimeoutError: ``timeout`` seconds passed without room.
        """
        reason = item_mismatch(item, self.outputs[self.out_port].type)
        if reason:
            raise TypeError(f"inlet {self.name!r}: {reason}")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while len(self._items) >= self.capacity and not (self._finished or self._closed):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"inlet {self.name!r}: no room within {timeout} s")
                self._cond.wait(left)
            if self._finished:
                raise FlowError(f"inlet {self.name!r}: its run has ended")
            if self._closed:
                raise FlowError(f"inlet {self.name!r}: the stream was ended; no more items")
            self._items.append(item)
            self._cond.notify_all()

    def end(self) -> None:
        """End the stream after the items already put (idempotent; not the ``close``
        lifecycle hook, which the runtime calls when the stage's thread ends)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def run(self, ctx: StageContext) -> None:
        try:
            while True:
                with self._cond:
                    while not self._items and not self._closed:
                        if ctx.cancelled:
                            raise Cancelled()
                        ctx.heartbeat()  # waiting for the outside thread is not stage work
                        self._cond.wait(_CANCEL_POLL_S)
                    if not self._items:
                        return
                    item = self._items.popleft()
                    self._cond.notify_all()
                ctx.put(self.out_port, item)
                if ctx.downstream_done(self.out_port):
                    return
        finally:
            with self._cond:
                self._finished = True
                self.dropped += len(self._items)
                self._items.clear()
                self._cond.notify_all()


class Outlet(Stage):
    """Hands a running pipeline's items to another thread: they arrive here, ``get()`` there.

    Args:
      name: stage name.
      input_type: the port's type.
      capacity: items held for ``get`` before the stage stops reading (backpressure).
      in_port: the port's name.

    ``get`` raises ``EndOfStream`` once the stage has finished (its input ended, or the run
    was cancelled or failed) and every held item was taken; call the run's ``wait()`` to
    learn which.

    Example:
      >>> from dew_pipe.flow import Pipeline, Source
      >>> outlet = Outlet("results", input_type=int)
      >>> p = Pipeline("drained")
      >>> p.chain(Source("src", lambda: range(3), output_type=int), outlet, capacity=1)
      >>> run = p.start()
      >>> [outlet.get(timeout=10) for _ in range(3)]
      [0, 1, 2]
      >>> _ = run.wait(timeout=10)
    """

    def __init__(
        self,
        name: str,
        *,
        input_type: Port | PortType,
        capacity: int = 1,
        in_port: str = "in",
    ) -> None:
        super().__init__(name, inputs={in_port: input_type})
        self.capacity = check_count(f"outlet {name!r}", "capacity", capacity)
        self.in_port = in_port
        self._items: deque[Any] = deque()
        self._cond = threading.Condition()
        self._finished = False

    def get(self, timeout: float | None = None) -> Any:
        """The next item, waiting up to ``timeout`` seconds (None: as long as it takes).

        Raises:
          EndOfStream: the stage finished and nothing is left to take.
          TimeoutError: ``timeout`` passed first.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._items:
                if self._finished:
                    raise EndOfStream(f"outlet {self.name!r}: the stream has ended")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"outlet {self.name!r}: nothing within {timeout} s")
                self._cond.wait(left)
            item = self._items.popleft()
            self._cond.notify_all()
            return item

    def run(self, ctx: StageContext) -> None:
        try:
            for item in ctx.read(self.in_port):
                with self._cond:
                    while len(self._items) >= self.capacity:
                        if ctx.cancelled:
                            raise Cancelled()
                        ctx.heartbeat()
                        self._cond.wait(_CANCEL_POLL_S)
                    self._items.append(item)
                    self._cond.notify_all()
        finally:
            with self._cond:
                self._finished = True
                self._cond.notify_all()
