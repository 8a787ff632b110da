"""Stage: a named unit with typed ports and an explicit lifecycle, and the context it runs in.

A stage's thread calls ``open()``, then ``run(ctx)``, then ``close()`` (always, once ``open``
returned). ``run`` moves items with ``ctx.get`` / ``ctx.put``; when it returns (or lets
``EndOfStream`` escape) its outputs end and its inputs are released.

Waiting: ``get`` blocks until an item arrives, the port ends (``EndOfStream``), a future the
stage tracks finishes, or the run is cancelled (``Cancelled``). An untimed ``get`` with no
tracked futures outstanding is a promise: the stage will emit nothing until new input
arrives. That promise is what lets a cycle end (see ``dew_pipe.flow``); a stage that works on
its own between gets (polling a server, say) should wait with a timeout or track its futures.
"""

from __future__ import annotations

import abc
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from dew_pipe.flow.errors import BuildError, Cancelled, EndOfStream
from dew_pipe.flow.ports import Port, PortType, as_port, describe, item_mismatch

if TYPE_CHECKING:
    from dew_pipe.flow.edges import Edge, Inbox


class Stage(abc.ABC):
    """Base class of every stage. Subclasses implement ``run``; ``open``/``close`` optional.

    Args:
      name: unique in its pipeline; no dots (``"stage.port"`` names an endpoint).
      inputs: port name -> type (an Arrow schema, a Python class, or a ``Port``).
      outputs: port name -> type, likewise.
      timeout: seconds the stage may spend in its own code without touching a queue or
        calling ``ctx.heartbeat()`` before the run fails naming it; None: no limit.
        ``open`` and ``close`` are not timed (they may load weights or compile).

    Example (a stage that doubles an int stream and counts what it saw):
      >>> from dew_pipe.flow import Pipeline, Sink, Source
      >>> class Double(Stage):
      ...     def __init__(self):
      ...         super().__init__("double", inputs={"in": int}, outputs={"out": int})
      ...
      ...     def open(self):
      ...         self.seen = 0
      ...
      ...     def run(self, ctx):
      ...         for x in ctx.read("in"):
      ...             self.seen += 1
      ...             ctx.put("out", 2 * x)
      >>> out, double = [], Double()
      >>> p = Pipeline("example")
      >>> p.chain(Source("src", lambda: range(3), output_type=int), double,
      ...         Sink("keep", out.append, input_type=int), capacity=2)
      >>> _ = p.run(timeout=10)
      >>> out, double.seen
      ([0, 2, 4], 3)
    """

    def __init__(
        self,
        name: str,
        *,
        inputs: Mapping[str, Port | PortType] | None = None,
        outputs: Mapping[str, Port | PortType] | None = None,
        timeout: float | None = None,
    ) -> None:
        if not isinstance(name, str) or not name or "." in name or name.strip() != name:
            raise BuildError(f"stage name {name!r}: expected a non-empty string without dots")
        if timeout is not None and not timeout > 0:
            raise BuildError(f"stage {name!r}: timeout={timeout!r}, expected seconds > 0 or None")
        self.name = name
        self.inputs: dict[str, Port] = {k: as_port(v) for k, v in (inputs or {}).items()}
        self.outputs: dict[str, Port] = {k: as_port(v) for k, v in (outputs or {}).items()}
        for port in (*self.inputs, *self.outputs):
            if not isinstance(port, str) or not port or "." in port:
                raise BuildError(f"stage {name!r}: port name {port!r}, expected text without dots")
        self.timeout = timeout
        self._active: object | None = None  # the Run using this stage, if any

    def open(self) -> None:  # noqa: B027 - optional hook
        """Acquire resources (load weights, start a server). Runs in the stage's thread."""

    @abc.abstractmethod
    def run(self, ctx: StageContext) -> None:
        """Move items: read inputs with ``ctx.get``/``ctx.read``, write with ``ctx.put``."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what ``open`` acquired. Called once ``open`` returned, on every exit path."""

    def __repr__(self) -> str:
        ins = ", ".join(f"{k}: {describe(p.type, 1)}" for k, p in self.inputs.items())
        outs = ", ".join(f"{k}: {describe(p.type, 1)}" for k, p in self.outputs.items())
        return f"{type(self).__name__}({self.name!r}, in=[{ins}], out=[{outs}])"


class StageState:
    """Mutable run-time state of one stage (counters read by snapshots without locks)."""

    __slots__ = (
        "name",
        "state",
        "items_in",
        "items_out",
        "discarded",
        "get_wait",
        "put_wait",
        "started",
        "finished",
        "blocked_since",
        "waiting_on",
        "last_progress",
        "timeout",
        "error",
    )

    def __init__(self, name: str, timeout: float | None) -> None:
        self.name = name
        self.state = "pending"  # pending, opening, running, closing, done, failed, cancelled
        self.items_in = 0
        self.items_out = 0
        self.discarded = 0
        self.get_wait = 0.0
        self.put_wait = 0.0
        self.started: float | None = None
        self.finished: float | None = None
        self.blocked_since: float | None = None  # inside a queue wait
        self.waiting_on: Edge | None = None  # the edge a put is in progress on
        self.last_progress = time.monotonic()
        self.timeout = timeout
        self.error: str | None = None


class StageContext:
    """What ``Stage.run`` uses to reach its ports, the cancellation flag and the clock.

    Call ``get``/``put`` from the stage's own thread (its counters and timeout clock assume
    one caller). Other threads the stage starts hand results back through futures it
    ``track``s, as ``Map`` does with its workers; the done callbacks that wake the stage
    run on those threads, which is safe.

    Attributes:
      name: the stage's name.
      item: index of the input item being processed, set by the derived forms and by
        ``read``; a stage may set it so a failure names the item. None when unknown.
    """

    def __init__(
        self,
        stage: Stage,
        state: StageState,
        inbox: Inbox,
        in_edges: Mapping[str, Sequence[Edge]],
        out_edges: Mapping[str, Sequence[Edge]],
        cancelled: threading.Event,
        thread_name: str,
        on_idle: Callable[[], None] | None,
    ) -> None:
        self.name = stage.name
        self.item: int | None = None
        self.thread_name = thread_name
        self._stage = stage
        self._state = state
        self._inbox = inbox
        self._in = {p: list(in_edges.get(p, ())) for p in stage.inputs}
        self._out = {p: list(out_edges.get(p, ())) for p in stage.outputs}
        self._cancelled = cancelled
        self._on_idle = on_idle  # nudges the supervisor when a stage in a cycle goes idle
        self._rr = 0  # round-robin start among input edges, for fairness

    # ------------------------------------------------------------------ cancellation, clock

    @property
    def cancelled(self) -> bool:
        """True once the run is cancelled; long loops should check it and return."""
        return self._cancelled.is_set()

    def wait(self, seconds: float) -> bool:
        """Sleep up to ``seconds``, waking early on cancellation; returns ``cancelled``.

        Counts as the stage's own time (a stage that only waits still times out).
        """
        return self._cancelled.wait(seconds)

    def heartbeat(self) -> None:
        """Record progress, resetting the stage's ``timeout`` clock."""
        self._state.last_progress = time.monotonic()

    def track(self, future: Future) -> Future:
        """Track a future the stage started: a pending ``get`` returns None when it finishes.

        While tracked futures are outstanding the stage never counts as idle, so a cycle it
        belongs to does not end under it.
        """
        inbox = self._inbox
        with inbox.cond:
            inbox.outstanding += 1

        def finished(_: Future) -> None:
            with inbox.cond:
                inbox.outstanding -= 1
                inbox.woken = True
                inbox.idle = False
                inbox.cond.notify_all()

        future.add_done_callback(finished)
        return future

    # ------------------------------------------------------------------ ports

    def connected(self, port: str) -> bool:
        """Whether the pipeline connected ``port`` (input or output) to any edge."""
        return bool(self._in[port]) if port in self._in else bool(self._edges_out(port))

    def downstream_done(self, port: str) -> bool:
        """Whether output ``port`` has edges and every consumer on them has finished.

        Items put then are only counted as dropped; a producer may as well stop.
        """
        edges = self._edges_out(port)
        return bool(edges) and all(e.consumer_done for e in edges)

    def ended(self, port: str) -> bool:
        """Whether every edge into input ``port`` has closed and been drained."""
        edges = self._edges_in(port)
        with self._inbox.cond:
            return all(e.drained for e in edges)

    def put(self, port: str, item: Any) -> None:
        """Send ``item`` to every edge of output ``port``, waiting while any is full.

        Raises:
          TypeError: ``item`` does not fit the port's type (naming stage, port and types).
          Cancelled: the run was cancelled while waiting.
        """
        edges = self._edges_out(port)
        if item is None:
            raise TypeError(f"stage {self.name!r} put None on port {port!r}; expected an item")
        reason = item_mismatch(item, self._stage.outputs[port].type)
        if reason:
            raise TypeError(f"stage {self.name!r} port {port!r}: {reason}")
        if not edges:
            self._state.discarded += 1
            self._state.items_out += 1
            return
        state = self._state
        state.blocked_since = time.monotonic()
        try:
            for edge in edges:
                state.waiting_on = edge
                state.put_wait += edge.put(item, self._cancelled)
        finally:
            state.waiting_on = None
            state.blocked_since = None
            state.last_progress = time.monotonic()
        state.items_out += 1

    def get(self, port: str, timeout: float | None = None) -> Any:
        """The next item of input ``port``.

        Returns None when ``timeout`` passes or a tracked future finishes first.

        Raises:
          EndOfStream: every edge into the port closed and drained.
          Cancelled: the run was cancelled.
        """
        got = self._get(self._edges_in(port), (port,), timeout)
        return None if got is None else got[1]

    def get_any(
        self, ports: Sequence[str] | None = None, timeout: float | None = None
    ) -> tuple[str, Any] | None:
        """The next item from any of ``ports`` (default: all inputs), as ``(port, item)``.

        Edges take turns, so a busy input does not starve another. Returns None when the
        timeout passes, a tracked future finishes, or one of the ports ends (check
        ``ended``); raises ``EndOfStream`` once all of them have ended.
        """
        ports = tuple(self._in) if ports is None else tuple(ports)
        edges = [e for p in ports for e in self._edges_in(p)]
        return self._get(edges, ports, timeout)

    def read(self, port: str) -> Iterator[Any]:
        """Iterate over input ``port`` until it ends, numbering items in ``ctx.item``."""
        while True:
            try:
                item = self.get(port)
            except EndOfStream:
                return
            if item is not None:
                self.item = self._state.items_in - 1
                yield item

    # ------------------------------------------------------------------ internals

    def _edges_in(self, port: str) -> list[Edge]:
        if port not in self._in:
            raise KeyError(
                f"stage {self.name!r} has no input port {port!r}; it has {list(self._in)}"
            )
        return self._in[port]

    def _edges_out(self, port: str) -> list[Edge]:
        if port not in self._out:
            raise KeyError(
                f"stage {self.name!r} has no output port {port!r}; it has {list(self._out)}"
            )
        return self._out[port]

    def _get(
        self, edges: list[Edge], ports: tuple[str, ...], timeout: float | None
    ) -> tuple[str, Any] | None:
        inbox, state, n = self._inbox, self._state, len(edges)
        deadline = None if timeout is None else time.monotonic() + timeout
        with inbox.cond:
            ended_before = sum(e.drained for e in edges)
            start = None
            try:
                while True:
                    if self._cancelled.is_set():  # before queued items: stop promptly
                        raise Cancelled()
                    for k in range(n):
                        edge = edges[(self._rr + k) % n]
                        if edge.buf:
                            item = edge.buf.popleft()
                            self._rr = (self._rr + k + 1) % max(n, 1)
                            inbox.cond.notify_all()  # room for a blocked producer
                            if start is not None:
                                edge.get_wait += time.monotonic() - start
                            state.items_in += 1
                            return edge.dst_port, item
                    ended = sum(e.drained for e in edges)
                    if ended == n:
                        raise EndOfStream(f"stage {self.name!r}: {', '.join(ports)} ended")
                    if ended > ended_before or inbox.woken:
                        inbox.woken = False
                        return None
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        return None
                    if start is None:
                        start = state.blocked_since = time.monotonic()
                    inbox.idle = remaining is None and inbox.outstanding == 0
                    if inbox.idle and self._on_idle is not None:
                        self._on_idle()
                    inbox.cond.wait(remaining)
                    inbox.idle = False
            finally:
                inbox.idle = False
                if start is not None:
                    state.get_wait += time.monotonic() - start
                    state.blocked_since = None
                state.last_progress = time.monotonic()
