"""Rollout: submits tasks to a SessionSource, stamps what comes back, resubmits on orders.

The stage owns every submission in flight. It takes task batches from ``tasks`` as far as
the trainer lets it (``ahead`` batches past the one handed over, when ``handover`` is
connected), submits ``groups + oversample`` samples of each task, and puts each finished
session on ``sessions`` relabelled with the identity it was submitted under and stamped
(see :mod:`dew_pipe.stages.messages`). Orders from pack resubmit samples, cancel tickets
and release packed batches.

Two cancellations are the stage's own, because it holds the clock and the submission
versions: a session still running ``timeout`` seconds after its submission, and one whose
submission version lags the trainer by more than ``max_lag`` at a handover. Both are
cancelled without waiting for the source and reported at once as CANCELLED sessions with
``cause`` "timeout" or "stale_running"; what the source returns for them later is dropped.

A source whose future raises (instead of resolving to a session with a status) is broken:
the stage fails with that exception, and ``close`` cancels everything still running.

With a :class:`~dew_pipe.stages.journal.Journal` the stage replays a resumed run's
journaled sessions. At the run's first handover it learns the trainer's position and
version (those the run resumed at) and loads the journal from that position on; each task
batch it takes then looks up every sample in the journal before submitting it. A sample
found there is not submitted: its session is put on ``sessions`` as if it had just
finished (stamped with its original submission version), and the plan names it
(``Plan.replayed``) so pack counts it. One with a call sampled after the version the run
resumed at comes from weights that died with the old process; it goes out with ``cause``
"stale", so pack resubmits the sample. Journaled sessions of the batch that match no sample
are dropped and counted (``Journal.counts["unmatched"]``).
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import itertools
import time
from collections.abc import Callable, Iterator

import pyarrow as pa

from dew_pipe._validate import check_float, check_int
from dew_pipe.batches import TASKS_SCHEMA, tasks_from_arrow
from dew_pipe.flow import Cancelled, EndOfStream, Port, Stage, StageContext
from dew_pipe.objectives.rl.session_arrow import task_from_row
from dew_pipe.objectives.rl.sessions import Session, SessionSource, Status, Task
from dew_pipe.stages.journal import Entry, Journal
from dew_pipe.stages.messages import (
    SESSION_ROWS,
    Handover,
    Orders,
    Plan,
    Stamps,
    stamp_sessions,
)

__all__ = ["Rollout"]

_POLL_S = 0.05  # how often a wait on futures alone looks at the cancellation flag
# How long a stopping rollout waits for pack's final order. Pack sends it within
# milliseconds of seeing the handovers end; the bound only matters for a hand-wired graph
# whose pack is not paced by handovers and so never sends one.
_LAST_ORDERS_S = 5.0


@dataclasses.dataclass
class _Live:
    """One submission in flight."""

    future: cf.Future
    task: Task
    batch: int
    group: int
    sample: int
    attempt: int
    version: int
    submitted_at: float
    finished_at: float | None = None
    seq: int = 0  # submission order, which each emitted batch keeps

    @property
    def ticket(self) -> tuple[int, int, int]:
        return (self.group, self.sample, self.attempt)

    def describe(self) -> str:
        return (
            f"task {self.task.id} (batch {self.batch}, group {self.group}, sample "
            f"{self.sample}, attempt {self.attempt})"
        )


class Rollout(Stage):
    """Runs tasks on a :class:`~dew_pipe.objectives.rl.sessions.SessionSource`.

    Ports:
      tasks (in): task batches (:data:`~dew_pipe.batches.TASKS_SCHEMA`).
      orders (in, optional): :class:`~dew_pipe.stages.messages.Orders` from pack.
      handover (in, optional): :class:`~dew_pipe.stages.messages.Handover` from update;
        connected, it paces the stage and ending it ends the stage.
      sessions (out): stamped sessions (:data:`~dew_pipe.stages.messages.SESSION_ROWS`).
      plans (out, optional): a :class:`~dew_pipe.stages.messages.Plan` per task batch, put
        before any of its samples is submitted.

    Args:
      source: where sessions come from (``submit``, ``cancel``, ``close``). One with
        ``submit_many`` gets each task batch, and each order's resubmissions, in one call.
      groups: samples each task needs (G).
      oversample: extra samples submitted per task (K); pack keeps the first G.
      ahead: task batches submitted beyond the one the trainer was handed (with
        ``handover`` connected; without it every batch is submitted as it arrives).
      max_lag: cancel a running session once the trainer's version is more than this
        many updates past its submission version; None never does.
      timeout: cancel a session still running this many seconds after submission.
      version: returns the version weights serve now, read at every submission; None
        uses the ``served`` version of the last handover (0 before the first).
      group_ids: where group ids come from (share one across runs of a scheduler so ids
        stay unique); default ``itertools.count()``.
      owns_source: close the source when the stage closes.
      journal: replay the journaled sessions of a resumed run instead of submitting those
        samples (needs ``handover`` with the trainer's ``position``); None never does.
      emit_rows: finished sessions gathered before they go out on ``sessions`` together
        (each batch crossing to pack costs a fixed conversion, so a few large ones cost
        far less than many small ones). A batch goes out before that once the last running
        sample of a task batch finished, once nothing else runs, or once its oldest session
        waited ``linger`` seconds. 1 puts out whatever finished at once.
      linger: the longest a finished session waits to be put out (seconds >= 0).
      name: the stage's name.

    Attributes:
      submitted: submissions made to the source, readable after a run.
      replayed: samples served from the journal instead.

    Raises:
      ValueError, TypeError: bad arguments.

    Example:
      >>> import concurrent.futures as cf
      >>> from dew_pipe.flow import Pipeline, Sink, Source
      >>> from dew_pipe.batches import TASKS_SCHEMA, tasks_to_arrow
      >>> from dew_pipe.objectives.rl.sessions import Call
      >>> class Echo:
      ...     def submit(self, task, *, group, sample, attempt):
      ...         f = cf.Future()
      ...         call = Call(task.data["prompt"], [2], [-0.5], "stop", 0)
      ...         f.set_result(Session(task, group, sample, attempt, [call], "COMPLETED", 1.0))
      ...         return f
      ...     def cancel(self, future): pass
      ...     def close(self): pass
      >>> got = []
      >>> p = Pipeline("rollout-example")
      >>> p.chain(Source("tasks", [tasks_to_arrow([{"task_id": 5, "prompt": [1]}])],
      ...                output_type=TASKS_SCHEMA),
      ...         Rollout(Echo(), groups=2), Sink("keep", got.append, input_type=SESSION_ROWS),
      ...         capacity=2)
      >>> _ = p.run(timeout=10)
      >>> sum(b.num_rows for b in got)
      2
    """

    def __init__(
        self,
        source: SessionSource,
        *,
        groups: int,
        oversample: int = 0,
        ahead: int = 1,
        max_lag: int | None = None,
        timeout: float | None = None,
        version: Callable[[], int] | None = None,
        group_ids: Iterator[int] | None = None,
        owns_source: bool = False,
        journal: Journal | None = None,
        emit_rows: int = 256,
        linger: float = 0.05,
        name: str = "rollout",
    ) -> None:
        super().__init__(
            name,
            inputs={
                "tasks": TASKS_SCHEMA,
                "orders": Port(Orders, required=False, doc="resubmit / cancel / release"),
                "handover": Port(Handover, required=False, doc="the trainer's progress"),
            },
            outputs={
                "sessions": SESSION_ROWS,
                "plans": Port(Plan, required=False, doc="one per task batch taken"),
            },
        )
        for method in ("submit", "cancel"):
            if not callable(getattr(source, method, None)):
                raise TypeError(
                    f"source={source!r} has no {method}(); expected a SessionSource "
                    "(submit, cancel, close)"
                )
        if version is not None and not callable(version):
            raise TypeError(f"version={version!r}; expected None or a callable returning an int")
        self.source = source
        self.groups = check_int("groups", groups, minimum=1)
        self.samples = self.groups + check_int("oversample", oversample, minimum=0)
        self.ahead = check_int("ahead", ahead, minimum=0)
        self.max_lag = check_int("max_lag", max_lag, minimum=0, allow_none=True)
        self.timeout = check_float("timeout", timeout, above=0.0, allow_none=True)
        self._version_fn = version
        self._group_ids = itertools.count() if group_ids is None else group_ids
        if journal is not None and not isinstance(journal, Journal):
            raise TypeError(f"journal={journal!r}; expected None or a Journal")
        self.owns_source = owns_source
        self.journal = journal
        self.emit_rows = check_int("emit_rows", emit_rows, minimum=1)
        self.linger = check_float("linger", linger, minimum=0.0)
        self.submitted = 0
        self.replayed = 0

    # ------------------------------------------------------------------ lifecycle

    def open(self) -> None:
        self._live: dict[tuple[int, int, int], _Live] = {}
        # Tickets of finished futures, in finishing order (some no longer live: cancelled).
        self._finished: collections.deque[tuple[int, int, int]] = collections.deque()
        self._tasks: dict[int, Task] = {}  # group -> task, until its batch is released
        self._batch_groups: dict[int, list[int]] = {}
        self._next_batch = 0
        self._handed = -1
        self._served = 0
        # Sessions that finished without the source: our own cancellations, and replays.
        self._reported: list[tuple[Session, Stamps]] = []
        self._ready: list[_Live] = []  # finished, not yet put out (see emit_rows)
        self._running: collections.Counter[int] = collections.Counter()  # batch -> live
        self._final = False  # pack said no order follows
        self._position: int | None = None  # the trainer's position at batch 0 (journal)
        self._resumed_at = 0  # the trainer's version at batch 0 (journal)

    def close(self) -> None:
        live, self._live = list(self._live.values()), {}
        try:
            for item in live:
                self.source.cancel(item.future)
        finally:
            if self.owns_source:
                self.source.close()

    # ------------------------------------------------------------------ loop

    def run(self, ctx: StageContext) -> None:
        paced = ctx.connected("handover")
        while True:
            self._expire()
            ending = paced and ctx.ended("handover")
            self._emit(ctx, flush=ending)
            if ending:
                self._last_orders(ctx)
                return  # nobody trains on anything else; close() cancels what runs
            ports = [p for p in ("orders", "handover") if ctx.connected(p) and not ctx.ended(p)]
            # Paced, batch j waits for the handover of batch j - ahead (batch 0 for the
            # first ones), so it is submitted under the weights served after that push.
            handed = self._handed
            may_take = not paced or (handed >= 0 and self._next_batch <= handed + self.ahead)
            if may_take and not ctx.ended("tasks"):
                ports.append("tasks")
            if not ports:
                if not self._live:
                    return
                self._await(ctx)
                continue
            try:
                got = ctx.get_any(ports, timeout=self._wait_s())
            except EndOfStream:
                continue
            if got is None:
                continue
            port, item = got
            if port == "tasks":
                self._take(ctx, item)
            elif port == "orders":
                self._obey(ctx, item)
            else:
                self._hand(item)

    def _last_orders(self, ctx: StageContext) -> None:
        """Carry out what pack ordered until its final order, so that every submission
        pack counts reaches the source (close() then cancels what still runs)."""
        if not ctx.connected("orders") or self._final:
            return
        deadline = time.monotonic() + _LAST_ORDERS_S
        while (left := deadline - time.monotonic()) > 0:
            try:
                orders = ctx.get("orders", timeout=left)
            except EndOfStream:
                return
            if orders is None:
                continue
            self._obey(ctx, orders)
            if self._final:
                return

    def _await(self, ctx: StageContext) -> None:
        """Every input has ended: wait for a live future (or a deadline) to finish."""
        futures = [live.future for live in self._live.values()]
        left = self._wait_s()
        wait = _POLL_S if left is None else min(_POLL_S, left)
        done, _ = cf.wait(futures, timeout=max(wait, 0.001), return_when=cf.FIRST_COMPLETED)
        if not done and ctx.cancelled:
            raise Cancelled()
        ctx.heartbeat()

    # ------------------------------------------------------------------ submissions

    def _version(self) -> int:
        if self._version_fn is None:
            return self._served
        value = self._version_fn()
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise TypeError(f"version() returned {value!r}; expected an int >= 0")
        return value

    def _take(self, ctx: StageContext, rb: pa.RecordBatch) -> None:
        tasks = [task_from_row(row) for row in tasks_from_arrow(rb)]
        batch = self._next_batch
        if not tasks:
            raise ValueError(f"task batch {batch} has no rows; expected at least one task")
        self._next_batch += 1
        version = self._version()
        groups = [next(self._group_ids) for _ in tasks]
        replays = self._claim(batch, tasks, groups)
        if ctx.connected("plans"):
            ids, replayed = tuple(t.id for t in tasks), tuple(sorted(replays))
            plan = Plan(batch, tuple(groups), ids, self.samples, version, replayed)
            ctx.put("plans", plan)  # before any result of the batch can reach pack
        self._batch_groups[batch] = groups
        wanted = []
        for task, group in zip(tasks, groups, strict=True):
            self._tasks[group] = task
            for sample in range(self.samples):
                entry = replays.get((group, sample))
                if entry is None:
                    wanted.append((batch, group, sample, 0))
                else:
                    self._replay(batch, task, group, sample, entry)
        self._submit(ctx, wanted, version)

    def _submit(
        self, ctx: StageContext, wanted: list[tuple[int, int, int, int]], version: int
    ) -> None:
        """Submits ``(batch, group, sample, attempt)`` each under ``version``, in order.

        A source with ``submit_many`` gets them in one call (a server then sees the whole
        batch at once); any other source one ``submit`` each.
        """
        if not wanted:
            return
        requests = [
            (self._tasks[group], group, sample, attempt) for _, group, sample, attempt in wanted
        ]
        many = getattr(self.source, "submit_many", None)
        if callable(many):
            futures = many(requests)
            if not isinstance(futures, list) or len(futures) != len(requests):
                got = (
                    f"a list of {len(futures)}"
                    if isinstance(futures, list)
                    else f"a {type(futures).__name__}"
                )
                raise TypeError(
                    f"source.submit_many returned {got} for {len(requests)} requests; "
                    "expected a list of one Future per request, in order"
                )
        else:
            futures = [
                self.source.submit(task, group=group, sample=sample, attempt=attempt)
                for task, group, sample, attempt in requests
            ]
        now = time.monotonic()
        finished_queue = self._finished
        for (batch, group, sample, attempt), (task, *_), future in zip(
            wanted, requests, futures, strict=True
        ):
            if not isinstance(future, cf.Future):
                raise TypeError(
                    f"the source returned a {type(future).__name__} for task {task.id}; "
                    "expected a concurrent.futures.Future of a Session"
                )
            live = _Live(future, task, batch, group, sample, attempt, version, now)
            live.seq = self.submitted

            def finished(_: cf.Future, live: _Live = live) -> None:
                live.finished_at = time.monotonic()
                finished_queue.append(live.ticket)  # deque.append: safe from the source's thread

            future.add_done_callback(finished)
            ctx.track(future)
            self._live[live.ticket] = live
            self._running[batch] += 1
            self.submitted += 1

    def _claim(
        self, batch: int, tasks: list[Task], groups: list[int]
    ) -> dict[tuple[int, int], Entry]:
        """The journaled sessions of this batch's samples, by ``(group, sample)``."""
        if self.journal is None:
            return {}
        if self._position is None:
            raise RuntimeError(f"{self.name}: took task batch {batch} before any handover")
        position = self._position + batch
        replays = {}
        for row, (task, group) in enumerate(zip(tasks, groups, strict=True)):
            for sample in range(self.samples):
                entry = self.journal.claim(position, row, sample, task.id)
                if entry is not None:
                    replays[(group, sample)] = entry
        self.journal.release(position)
        return replays

    def _replay(self, batch: int, task: Task, group: int, sample: int, entry: Entry) -> None:
        """Put a journaled session out as the first attempt of ``(group, sample)``."""
        session = dataclasses.replace(
            entry.session, task=task.id, group=group, sample=sample, attempt=0
        )
        newest = max((c.version for c in session.calls), default=entry.submitted_version)
        cause = ""
        if newest > self._resumed_at:  # sampled from weights that died with the old run
            cause = "stale"
            session = dataclasses.replace(
                session,
                detail=f"replayed from the journal: a call of version {newest}, after the "
                f"version {self._resumed_at} the run resumed at",
            )
        stamps = Stamps(batch, entry.submitted_version, entry.latency, cause, task)
        self._reported.append((session, stamps))
        self.replayed += 1

    def _obey(self, ctx: StageContext, orders: Orders) -> None:
        self._final = self._final or orders.final
        # Resubmissions first: pack may order one and cancel it again in the same message.
        wanted = []
        for order in orders.resubmit:
            if order.group not in self._tasks:
                raise RuntimeError(
                    f"orders: resubmit group {order.group} of batch {order.batch}, which was "
                    "already released (pack and rollout disagree)"
                )
            wanted.append((order.batch, order.group, order.sample, order.attempt))
        if wanted:
            self._submit(ctx, wanted, self._version())
        for ticket in orders.cancel:
            live = self._drop(tuple(ticket))
            if live is not None:
                self.source.cancel(live.future)
        for batch in orders.release:
            groups = set(self._batch_groups.pop(batch, ()))
            for group in groups:
                self._tasks.pop(group, None)
            for ticket in [t for t, live in self._live.items() if live.group in groups]:
                self.source.cancel(self._drop(ticket).future)

    def _hand(self, handover: Handover) -> None:
        if self.journal is not None and self._position is None:
            if handover.position is None:
                raise ValueError(
                    f"{self.name}: a journal replays sessions by the trainer's position, but "
                    f"the handover of batch {handover.batch} carries none"
                )
            self._position = handover.position - handover.batch
            self._resumed_at = handover.version
            self.journal.resume(self._position)
        self._handed = max(self._handed, handover.batch)
        self._served = handover.served
        if self.max_lag is None:
            return
        for ticket, live in list(self._live.items()):
            lag = handover.version - live.version
            if lag > self.max_lag and not live.future.done():
                self._drop(ticket)
                self.source.cancel(live.future)
                detail = (
                    f"cancelled running: submitted under version {live.version}, the trainer "
                    f"is at {handover.version} (max_lag {self.max_lag})"
                )
                self._reported.append(self._cancelled(live, "stale_running", detail))

    def _expire(self) -> None:
        if self.timeout is None or not self._live:
            return
        now = time.monotonic()
        for ticket, live in list(self._live.items()):
            if now - live.submitted_at >= self.timeout and not live.future.done():
                self._drop(ticket)
                self.source.cancel(live.future)
                detail = (
                    f"timed out: still running {now - live.submitted_at:.3f} s after submission"
                )
                self._reported.append(self._cancelled(live, "timeout", detail))

    def _wait_s(self) -> float | None:
        """How long the loop may block: until the next timeout or the end of a linger."""
        deadline, linger = self._until_deadline(), self._linger_left()
        if linger == float("inf"):
            return deadline
        linger = max(0.0, linger)
        return linger if deadline is None else min(deadline, linger)

    def _until_deadline(self) -> float | None:
        if self.timeout is None or not self._live:
            return None
        first = min(live.submitted_at for live in self._live.values())
        return max(0.0, first + self.timeout - time.monotonic())

    # ------------------------------------------------------------------ results

    def _cancelled(self, live: _Live, cause: str, detail: str) -> tuple[Session, Stamps]:
        session = Session(
            live.task.id, live.group, live.sample, live.attempt, (), Status.CANCELLED, None, {},
            detail,
        )  # fmt: skip
        latency = time.monotonic() - live.submitted_at
        return session, Stamps(live.batch, live.version, latency, cause, live.task)

    def _result(self, live: _Live) -> tuple[Session, Stamps]:
        future = live.future
        if future.cancelled():
            raise RuntimeError(
                f"the source cancelled the future of {live.describe()} unasked; a source "
                "resolves a stopped session to a CANCELLED Session"
            )
        error = future.exception()
        if error is not None:
            error.add_note(f"raised by the source for {live.describe()}")
            raise error
        session = future.result()
        if not isinstance(session, Session):
            raise TypeError(
                f"the source resolved {live.describe()} to a {type(session).__name__}; "
                "expected a Session"
            )
        identity = (live.task.id, live.group, live.sample, live.attempt)
        if (session.task, session.group, session.sample, session.attempt) != identity:
            session = dataclasses.replace(
                session,
                task=live.task.id,
                group=live.group,
                sample=live.sample,
                attempt=live.attempt,
            )
        end = live.finished_at if live.finished_at is not None else time.monotonic()
        return session, Stamps(live.batch, live.version, end - live.submitted_at, "", live.task)

    def _drop(self, ticket: tuple[int, int, int]) -> _Live | None:
        """Forgets a live submission (finished, cancelled or released)."""
        live = self._live.pop(ticket, None)
        if live is not None:
            left = self._running[live.batch] - 1
            if left:
                self._running[live.batch] = left
            else:
                del self._running[live.batch]
        return live

    def _emit(self, ctx: StageContext, *, flush: bool = False) -> None:
        """Puts out what finished: our own reports at once, finished sessions in batches of
        ``emit_rows`` (sooner when a task batch's last sample finished, when nothing else
        runs, when the oldest waited ``linger``, or with ``flush``)."""
        completes = False
        while self._finished:
            live = self._drop(self._finished.popleft())
            if live is not None:
                self._ready.append(live)
                completes = completes or live.batch not in self._running
        ready = self._ready
        if ready and not (
            flush
            or completes
            or self._reported
            or len(ready) >= self.emit_rows
            or not self._live
            or self._linger_left() <= 0
        ):
            return
        out, self._reported, self._ready = self._reported, [], []
        ready.sort(key=lambda live: live.seq)
        out.extend(self._result(live) for live in ready)
        if out:
            ctx.put("sessions", stamp_sessions([s for s, _ in out], [st for _, st in out]))

    def _linger_left(self) -> float:
        """Seconds until the first finished session waiting to go out has lingered enough
        (inf when none waits). The ready list is in finishing order."""
        if not self._ready:
            return float("inf")
        return (self._ready[0].finished_at or 0.0) + self.linger - time.monotonic()
