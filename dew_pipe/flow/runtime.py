"""Run: the threads of one pipeline execution, and the supervisor that watches them.

Every stage runs in its own daemon thread named ``flow:<pipeline>:<stage>`` (a map's worker
threads add ``/worker_<i>``). A supervisor thread (``flow:<pipeline>:supervisor``) ticks every
``_TICK_S`` seconds (``_SLOW_TICK_S`` when no stage has a timeout), or sooner when nudged, to

* cancel the run when the outside ``cancel`` event is set or the run's ``timeout`` passes,
* fail a stage that spent longer than its ``timeout`` in its own code,
* end each cycle's feedback edges once the cycle has drained (see ``dew_pipe.flow``),
* call ``on_metrics`` every ``metrics_every`` seconds, and
* once every stage has finished (or ``join_timeout`` after cancellation), join the threads.

While any run is running, the cyclic garbage collector is tuned for a process whose work
is the pipeline (:class:`_Collector`): what was alive at the start (modules, models,
compiled functions) is frozen out of its scans (``gc.freeze``) and its thresholds are
raised to at least ``_GC_THRESHOLDS``; the last run to end restores both. A full
collection walks every tracked object with every thread stopped; on the embedded job's
GRPO phase (2-core AVX2 EPYC) the defaults spent 6.1 of 60 s in 22 full collections, about
0.28 s each, and an update took 1.40 s; frozen and raised, 0.24 s in one, 1.05 s an update.

The first failure wins: it cancels the run, and what other stages raise afterwards (often a
consequence) is kept in ``Run.secondary`` but not raised.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from dew_pipe.flow.edges import Edge, Inbox
from dew_pipe.flow.errors import (
    BuildError,
    Cancelled,
    Deadlock,
    EndOfStream,
    FlowError,
    RunTimeout,
    StageFailed,
    StageTimeout,
)
from dew_pipe.flow.metrics import EdgeStats, FlowSnapshot, StageStats
from dew_pipe.flow.stage import Stage, StageContext, StageState

# Supervisor tick: the latency of stage timeouts, outside cancellation and the end of a
# drained cycle (an idle stage in a cycle nudges the supervisor at once, so that path is
# faster). 20 ms keeps each below what a person notices and costs ~50 wake-ups a second.
# A run whose stages have no timeout waits up to _SLOW_TICK_S instead (the run's own
# timeout and on_metrics get a wake-up at their time): each wake-up costs the stages'
# threads a GIL hand-over, about 0.1 ms of a core, which a pipeline sharing its core with
# the update pays in update time.
_TICK_S = 0.02
_SLOW_TICK_S = 0.1
_WAIT_SLICE_S = 0.1  # Run.wait wakes this often to let the main thread handle signals
# Collector thresholds while a run runs (generation 0 allocations, then collections of the
# younger generation before an older one is collected): full collections become rare.
_GC_THRESHOLDS = (20_000, 20, 100)


class _Collector:
    """Reference-counted GC tuning for the runs of this process (see the module docstring).

    Thresholds are only raised (a user's higher setting stays); a disabled collector
    (``gc.disable()`` or a first threshold of 0) is left alone, and so is a process that
    froze objects itself (it is not frozen again, nor unfrozen after).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runs = 0
        self._saved: tuple[int, ...] | None = None
        self._froze = False

    def enter(self) -> None:
        with self._lock:
            self._runs += 1
            # threshold 0 also turns collection off: a user's choice, like gc.disable()
            if self._runs == 1 and gc.isenabled() and gc.get_threshold()[0] > 0:
                self._saved = gc.get_threshold()
                # a process that froze objects itself (before forking...) keeps its freeze
                self._froze = gc.get_freeze_count() == 0
                if self._froze:
                    gc.freeze()
                raised = (max(a, b) for a, b in zip(self._saved, _GC_THRESHOLDS, strict=True))
                gc.set_threshold(*raised)

    def exit(self) -> None:
        with self._lock:
            self._runs -= 1
            if self._runs == 0 and self._saved is not None:
                gc.set_threshold(*self._saved)
                if self._froze:
                    gc.unfreeze()
                self._saved = None


_COLLECTOR = _Collector()


@dataclass
class _Cycle:
    stages: frozenset[str]
    inboxes: list[Inbox]  # in stage order: the supervisor locks them in this order
    feedback: list[Edge]
    inputs: list[Edge]  # every edge into a stage of the cycle
    ended: bool = False
    stuck_ticks: int = 0  # consecutive ticks a wait-for loop was seen


class Graph(Protocol):
    """What a run reads of the pipeline it runs; ``Pipeline`` is the implementation (the
    protocol keeps this module from importing the one that starts it)."""

    name: str

    @property
    def stages(self) -> Mapping[str, Stage]: ...

    @property
    def edges(self) -> Sequence[Any]: ...  # EdgeSpec: src, src_port, dst, dst_port, ...

    def cyclic_groups(self) -> list[tuple[frozenset[str], list[Any]]]: ...


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


class Run:
    """One execution of a pipeline; created by ``Pipeline.start``.

    Attributes:
      pipeline: the pipeline being run.
      secondary: ``(stage, exception)`` raised after the run was already failing.

    Example:
      >>> import itertools
      >>> from dew_pipe.flow import Cancelled, Pipeline, Sink, Source
      >>> p = Pipeline("background")
      >>> p.chain(Source("src", itertools.count, output_type=int),
      ...         Sink("keep", lambda x: None, input_type=int), capacity=4)
      >>> run = p.start()
      >>> run.snapshot().stages["keep"].state in ("pending", "opening", "running")
      True
      >>> run.cancel("enough")
      >>> try:
      ...     run.wait(timeout=10)
      ... except Cancelled as e:
      ...     print(e)
      enough
    """

    def __init__(
        self,
        pipeline: Graph,
        *,
        timeout: float | None,
        cancel: threading.Event | None,
        on_metrics: Callable[[FlowSnapshot], Any] | None,
        metrics_every: float,
        join_timeout: float,
    ) -> None:
        for label, value in (("timeout", timeout), ("metrics_every", metrics_every)):
            if value is not None and not value > 0:
                raise BuildError(f"{label}={value!r}: expected seconds > 0")
        if not join_timeout >= 0:
            raise BuildError(f"join_timeout={join_timeout!r}: expected seconds >= 0")
        self.pipeline = pipeline
        self.secondary: list[tuple[str, BaseException]] = []
        self._outside = cancel
        self._on_metrics = on_metrics
        self._metrics_every = metrics_every
        self._join_timeout = join_timeout
        self._cancelled = threading.Event()
        self._wake = threading.Event()
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._error: FlowError | None = None
        self._final: FlowSnapshot | None = None
        self._stuck: list[str] = []
        self._claim_stages()
        try:
            self._build()
        except BaseException:
            self._release(self.pipeline.stages)
            raise
        self._t0 = time.monotonic()
        self._deadline = None if timeout is None else self._t0 + timeout
        self._timeout = timeout
        self._start_threads()

    # ------------------------------------------------------------------ public

    @property
    def done(self) -> bool:
        """Whether every thread has finished (or been given up on) and the outcome is known."""
        return self._done.is_set()

    def cancel(self, reason: str = "cancelled from outside") -> None:
        """Ask every stage to stop; ``wait`` then raises ``Cancelled(reason)``."""
        self._stop(Cancelled(reason))

    def wait(self, timeout: float | None = None) -> FlowSnapshot:
        """Wait for the run to end; returns the final counters.

        A KeyboardInterrupt while waiting cancels the run, waits for it, and re-raises.

        Raises:
          TimeoutError: ``timeout`` passed with the run still going (it keeps running).
          StageFailed: the first stage failure (original as ``__cause__``).
          Cancelled: cancelled from outside; ``RunTimeout`` past the run's timeout.
        Either error lists, in its message and ``stuck``, threads that did not stop within
        ``join_timeout`` of cancellation. Python cannot kill a thread: one stuck in a
        blocking call that ignores cancellation is left running as a daemon thread (it does
        not keep the process alive) and its stage stays claimed until the thread ends.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            finished = self._done.is_set()
            while not finished:  # in slices, so a signal's KeyboardInterrupt is seen promptly
                left = _WAIT_SLICE_S if deadline is None else deadline - time.monotonic()
                if left <= 0:
                    break
                finished = self._done.wait(min(left, _WAIT_SLICE_S))
        except KeyboardInterrupt:
            self.cancel("interrupted")
            self._done.wait()
            self._supervisor.join()
            raise
        if not finished:
            raise TimeoutError(f"pipeline {self.pipeline.name!r} still running after {timeout} s")
        # The supervisor sets _done as its last act; joining it means that, once wait
        # returns, no thread of the run is left (a caller counting threads saw it linger).
        self._supervisor.join()
        if self._error is not None:
            raise self._error
        assert self._final is not None
        return self._final

    def snapshot(self) -> FlowSnapshot:
        """Current counters of every stage and edge (each counter read atomically)."""
        now = time.monotonic()
        stages = {}
        for name, st in self._states.items():
            start = st.started if st.started is not None else now
            end = st.finished if st.finished is not None else now
            blocked = now - st.blocked_since if st.blocked_since and st.finished is None else 0.0
            elapsed = max(0.0, end - start)
            busy = max(0.0, elapsed - st.get_wait - st.put_wait - blocked)
            stages[name] = StageStats(
                name, st.state, st.items_in, st.items_out, st.discarded, busy,
                st.get_wait, st.put_wait, elapsed, st.error,
            )  # fmt: skip
        edges = {
            e.name: EdgeStats(
                e.name,
                e.capacity,
                e.feedback,
                e.items,
                len(e.buf),
                e.max_depth,
                e.put_wait,
                e.get_wait,
                e.dropped,
                e.closed,
            )  # fmt: skip
            for e in self._edges
        }
        return FlowSnapshot(self.pipeline.name, now - self._t0, stages, edges)

    # ------------------------------------------------------------------ set-up

    def _claim_stages(self) -> None:
        with _CLAIMS:
            busy = [s for s in self.pipeline.stages.values() if s._active is not None]
            if busy:
                raise BuildError(
                    f"stage {busy[0].name!r} is already running in another run; a stage "
                    "object can be in one running pipeline at a time"
                )
            for stage in self.pipeline.stages.values():
                stage._active = self

    def _release(self, names) -> None:
        with _CLAIMS:
            for name in names:
                stage = self.pipeline.stages[name]
                if stage._active is self:
                    stage._active = None

    def _build(self) -> None:
        p = self.pipeline
        self._inboxes = {name: Inbox() for name in p.stages}
        self._states = {name: StageState(name, s.timeout) for name, s in p.stages.items()}
        self._timed_stages = any(s.timeout is not None for s in p.stages.values())
        self._edges = [
            Edge(e.src, e.src_port, e.dst, e.dst_port, e.capacity, e.feedback, self._inboxes[e.dst])
            for e in p.edges
        ]
        self._in = {name: [e for e in self._edges if e.consumer == name] for name in p.stages}
        self._out = {name: [e for e in self._edges if e.producer == name] for name in p.stages}
        order = list(p.stages)
        self._cycles = []
        for members, feedback in p.cyclic_groups():
            names = sorted(members, key=order.index)
            fb = {f.name for f in feedback}
            self._cycles.append(
                _Cycle(
                    members,
                    [self._inboxes[n] for n in names],
                    [e for e in self._edges if e.name in fb],
                    [e for e in self._edges if e.consumer in members],
                )
            )
        self._contexts = {}
        for name, stage in p.stages.items():
            by_port_in = {
                port: [e for e in self._in[name] if e.dst_port == port] for port in stage.inputs
            }
            by_port_out = {
                port: [e for e in self._out[name] if e.src_port == port] for port in stage.outputs
            }
            self._contexts[name] = StageContext(
                stage, self._states[name], self._inboxes[name], by_port_in, by_port_out,
                self._cancelled, f"flow:{p.name}:{name}", self._idle_nudge(name),
            )  # fmt: skip

    def _idle_nudge(self, name: str) -> Callable[[], None] | None:
        """What stage ``name`` calls on going idle: wake the supervisor once every stage of
        one of its cycles is idle or done, the only time a drained cycle can end.

        The flags of the other stages are read without their locks; a stage going idle
        sets its flag before it looks, so of two going idle at once the later one sees
        the other, and anything missed here is seen at the next tick.
        """
        cycles = [c.inboxes for c in self._cycles if name in c.stages]
        if not cycles:
            return None
        wake = self._wake.set

        def nudge() -> None:
            if any(all(i.done or i.idle for i in inboxes) for inboxes in cycles):
                wake()

        return nudge

    def _start_threads(self) -> None:
        _COLLECTOR.enter()  # left by the supervisor when the run is done
        self._threads = {
            name: threading.Thread(
                target=self._stage_main, args=(name,), name=ctx.thread_name, daemon=True
            )
            for name, ctx in self._contexts.items()
        }
        self._supervisor = threading.Thread(
            target=self._supervise, name=f"flow:{self.pipeline.name}:supervisor", daemon=True
        )
        started = []
        try:
            for thread in self._threads.values():
                thread.start()
                started.append(thread)
        except BaseException as exc:  # e.g. the OS refused a thread: stop what started
            self._stop(
                StageFailed(f"could not start stage threads: {_one_line(exc)}", stage="<start>")
            )
            for name, thread in self._threads.items():
                if thread not in started:
                    self._finish(name, "cancelled")
        try:
            self._supervisor.start()
        except BaseException:
            _COLLECTOR.exit()
            raise

    # ------------------------------------------------------------------ stage threads

    def _stage_main(self, name: str) -> None:
        stage, ctx, st = self.pipeline.stages[name], self._contexts[name], self._states[name]
        st.started = time.monotonic()
        opened, outcome = False, "done"
        try:
            st.state = "opening"
            stage.open()
            opened = True
            st.state = "running"
            st.last_progress = time.monotonic()
            stage.run(ctx)
        except EndOfStream:
            pass
        except Cancelled as exc:
            if not self._cancelled.is_set():  # a Cancelled of the stage's own making
                outcome = "failed" if self._fail(name, exc, ctx.item) else "cancelled"
            else:
                outcome = "cancelled"
        except BaseException as exc:
            outcome = "failed" if self._fail(name, exc, ctx.item) else "cancelled"
        finally:
            if opened:
                st.state = "closing"
                try:
                    stage.close()
                except BaseException as exc:
                    if self._fail(name, exc, None, during="close"):
                        outcome = "failed"
            if outcome == "done" and self._cancelled.is_set():
                outcome = "cancelled"
            self._finish(name, outcome)
            self._release([name])  # also when the supervisor gave up on this thread

    def _finish(self, name: str, outcome: str) -> None:
        st = self._states[name]
        st.state, st.finished = outcome, time.monotonic()
        for edge in self._out[name]:
            edge.close()  # end of stream downstream
        for edge in self._in[name]:
            edge.abandon()  # producers upstream stop blocking; leftovers counted as dropped
        inbox = self._inboxes[name]
        with inbox.cond:
            inbox.done = True
        self._wake.set()

    def _fail(self, name: str, exc: BaseException, item: int | None, during: str = "") -> bool:
        """Record a failure; True when it is the run's first (it then cancels the run)."""
        with self._lock:
            if self._error is not None or self._cancelled.is_set():
                self.secondary.append((name, exc))
                return False
            where = f" on item {item}" if item is not None else ""
            where += f" in {during}()" if during else ""
            error = StageFailed(
                f"stage {name!r} failed{where}: {_one_line(exc)}", stage=name, item=item
            )
            error.__cause__, error.__suppress_context__ = exc, True
            self._error = error
            if name in self._states:
                self._states[name].error = _one_line(exc)
        self._cancel_all()
        return True

    def _stop(self, error: FlowError) -> None:
        with self._lock:
            if self._error is None and not self._cancelled.is_set():
                self._error = error
        self._cancel_all()

    def _cancel_all(self) -> None:
        self._cancelled.set()
        for inbox in self._inboxes.values():
            with inbox.cond:
                inbox.cond.notify_all()
        self._wake.set()

    # ------------------------------------------------------------------ supervisor

    def _supervise(self) -> None:
        give_up = None
        next_metrics = self._t0 + self._metrics_every
        try:
            while not all(inbox.done for inbox in self._inboxes.values()):
                self._wake.wait(self._tick(next_metrics, give_up))
                self._wake.clear()
                now = time.monotonic()
                if self._outside is not None and self._outside.is_set():
                    self.cancel()
                if self._deadline is not None and now > self._deadline:
                    self._stop(
                        RunTimeout(
                            f"pipeline {self.pipeline.name!r} did not finish within {self._timeout} s"
                        )
                    )
                self._check_timeouts(now)
                self._end_drained_cycles()
                if self._cancelled.is_set():
                    give_up = give_up or now + self._join_timeout
                    if now > give_up:
                        break
                if self._on_metrics is not None and now >= next_metrics:
                    next_metrics = now + self._metrics_every
                    self._report()
        except BaseException as exc:  # a bug here must not leave the run hanging
            self._fail("<supervisor>", exc, None)
            give_up = time.monotonic() + self._join_timeout
        finally:
            self._join(give_up)
            if self._on_metrics is not None:
                self._report()
            self._final = self.snapshot()
            _COLLECTOR.exit()
            self._done.set()

    def _tick(self, next_metrics: float, give_up: float | None) -> float:
        """Seconds the supervisor may sleep: ``_TICK_S`` while a stage has a timeout, the
        run is cancelled or a cycle looks stuck; else ``_SLOW_TICK_S``, cut short by the
        run's deadline and the next metrics report."""
        if give_up is not None or self._timed_stages or any(c.stuck_ticks for c in self._cycles):
            return _TICK_S
        wait = _SLOW_TICK_S
        now = time.monotonic()
        if self._deadline is not None:
            wait = min(wait, self._deadline - now)
        if self._on_metrics is not None:
            wait = min(wait, next_metrics - now)
        return max(wait, 0.001)

    def _check_timeouts(self, now: float) -> None:
        for name, st in self._states.items():
            if st.timeout is None or st.state != "running" or st.blocked_since is not None:
                continue
            idle = now - st.last_progress
            if idle > st.timeout:
                exc = StageTimeout(f"no progress for {idle:.2f} s (timeout={st.timeout} s)")
                self._fail(name, exc, self._contexts[name].item)

    def _end_drained_cycles(self) -> None:
        """End a cycle's feedback edges once nothing in or into the cycle can produce more.

        Drained: every stage of the cycle has finished or waits idle (untimed get, nothing
        tracked, no event since), every edge into the cycle is empty, and every such edge
        from outside it has closed. Checked with all the cycle's inboxes locked, so no
        stage can change state or receive an item in between.
        """
        for cycle in self._cycles:
            if cycle.ended:
                continue
            for inbox in cycle.inboxes:
                inbox.cond.acquire()
            try:
                drained = all(i.done or i.idle for i in cycle.inboxes) and all(
                    not e.buf and (e.closed or e.consumer_done or e.producer in cycle.stages)
                    for e in cycle.inputs
                )
                loop = self._wait_loop(cycle)
                cycle.stuck_ticks = cycle.stuck_ticks + 1 if loop else 0
                if drained:
                    cycle.ended = True
                    for edge in cycle.feedback:
                        edge.closed = True  # inline: edge.close() would retake the lock
                    for inbox in cycle.inboxes:
                        inbox.idle = False
                        inbox.cond.notify_all()
            finally:
                for inbox in reversed(cycle.inboxes):
                    inbox.cond.release()
            if cycle.stuck_ticks >= 2:  # twice: a put seen just before it waited is not stuck
                self._deadlock(loop)

    def _wait_loop(self, cycle: _Cycle) -> list[Edge]:
        """Edges of a loop of stages each blocked putting on the next one's full edge."""
        for start in cycle.stages:
            path: list[Edge] = []
            seen: set[str] = set()
            name = start
            while name not in seen:
                seen.add(name)
                edge = self._states[name].waiting_on
                full = edge is not None and len(edge.buf) >= edge.capacity
                if not full or edge.consumer not in cycle.stages or edge.consumer_done:
                    break
                path.append(edge)
                name = edge.consumer
            else:
                first = next(i for i, e in enumerate(path) if e.producer == name)
                return path[first:]
        return []

    def _deadlock(self, loop: list[Edge]) -> None:
        waits = ", ".join(
            f"{e.producer!r} waits for room on {e.name} ({len(e.buf)}/{e.capacity})" for e in loop
        )
        error = Deadlock(
            f"pipeline {self.pipeline.name!r} deadlocked in a cycle: {waits}; give the feedback "
            "edge room for every item the cycle can hold, or admit fewer items into it",
            stage=loop[0].producer,
        )
        self._stop(error)

    def _report(self) -> None:
        try:
            self._on_metrics(self.snapshot())
        except Exception as exc:
            self._fail("on_metrics", exc, None)

    def _join(self, give_up: float | None) -> None:
        finished = []
        for name, thread in self._threads.items():
            if not thread.is_alive() and thread.ident is None:  # never started
                finished.append(name)
                continue
            remaining = None if give_up is None else max(0.0, give_up - time.monotonic())
            thread.join(remaining)
            if thread.is_alive():
                self._stuck.append(thread.name)
            else:
                finished.append(name)
        for thread in threading.enumerate():  # map workers of a stage that did not stop
            prefix = f"flow:{self.pipeline.name}:"
            if thread.name.startswith(prefix) and "/worker" in thread.name and thread.is_alive():
                owner = thread.name[len(prefix) :].split("/")[0]
                if owner not in finished:
                    self._stuck.append(thread.name)
        self._release(finished)
        if self._stuck and self._error is not None:
            self._error.stuck = tuple(self._stuck)
            note = (
                f"; {len(self._stuck)} thread(s) did not stop within {self._join_timeout} s of "
                f"cancellation and were left running: {', '.join(self._stuck)}"
            )
            self._error.args = (str(self._error) + note,)


_CLAIMS = threading.Lock()  # guards Stage._active across concurrent starts
