"""Thin derived stages: a source of items, a map (optionally on a worker pool) and a sink.

Each takes a callable, or can be subclassed overriding ``items`` / ``apply`` / ``consume``
(and ``open`` / ``close`` for state, as for any ``Stage``).
"""

from __future__ import annotations

import concurrent.futures as cf
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from dew_pipe.flow.errors import BuildError, Cancelled, EndOfStream
from dew_pipe.flow.ports import Port, PortType
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
    consumer of its port has finished.

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
            for index, item in enumerate(iterator):
                ctx.item = index
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
        At most ``workers`` items are in the pool at a time.
      ordered: emit results in input order (a slow item holds back later ones); with
        False, in completion order.
      in_port, out_port: port names.
      timeout: as for ``Stage`` (time waiting for a worker's result counts).

    A failure names the index of the item whose ``fn`` raised.

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
        if not isinstance(workers, int) or workers < 1:
            raise BuildError(f"stage {name!r}: workers={workers!r}, expected an int >= 1")
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
        prefix = f"{ctx.thread_name}/worker"
        with cf.ThreadPoolExecutor(self.workers, thread_name_prefix=prefix) as pool:
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
