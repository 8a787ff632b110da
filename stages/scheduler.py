"""RolloutScheduler: the Trainer's rollout for any SessionSource, run as a pipeline of stages.

The scheduler is the library view of :mod:`dew_pipe.stages.graph`: the same rollout,
reward, pack, rescore and update stages, with an ``Inlet`` that carries the Trainer's
handovers into ``update`` and an ``Outlet`` that carries each packed, rescored batch back.
Sessions run on the source's own threads while the Trainer runs its compiled update
(JAX releases the GIL there), so rollout and update overlap.

Stream and batches: ``scheduler.tasks(dataset)`` wraps the training data so that each
batch is registered as the Trainer's prefetch reads it (the scheduler sets ``read_ahead =
ahead``). When the Trainer hands over batch ``i`` the scheduler pushes weights if due and
lets batches ``i + 1 .. i + ahead`` be submitted; batch ``i`` itself was submitted
``ahead`` handovers earlier (or now, for the first one). Nothing is read beyond the
Trainer's own prefetch, so a checkpoint's data position stays the Trainer's: a resumed
run reads the in-flight batches again and submits them again. Opening the stream anew
(another ``fit``, a resume) stops the pipeline, cancelling the sessions the old stream
left running; a new epoch of the same stream does not.

Accounting: every submission ends in exactly one outcome (see ``totals`` and, with
``audit=True``, ``ledger``), including those still running when the pipeline stops: a stop
(``close``, a reopened stream) is graceful, so pack learns of every submission rollout made
before deciding the rest as cancelled. After a stage failure the run is cancelled at once
and the accounting covers what pack had learned by then.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
from dew_pipe.stages.admission import Ticket
from dew_pipe.stages.graph import task_batch, wire
from dew_pipe.stages.messages import Handed, SchedulerRecord, Step
from dew_pipe.stages.pack import Pack
from dew_pipe.stages.rescore import Rescore
from dew_pipe.stages.reward import Reward, Score
from dew_pipe.stages.rollout import Rollout
from dew_pipe.stages.update import Update, _served

from dew_pipe.batches import TASKS_SCHEMA, packed_from_arrow
from dew_pipe.data.dataset import Dataset, Partition
from dew_pipe.flow import EndOfStream, FlowError, FlowSnapshot, Inlet, Outlet, Pipeline
from dew_pipe.objectives.rl.advantages import ESTIMATORS
from dew_pipe.objectives.rl.packing import TRUNCATIONS
from dew_pipe.objectives.rl.sessions import SessionSource, Task
from dew_pipe.objectives.rl.task_rows import task_ids

__all__ = ["RolloutScheduler", "SchedulerRecord"]

# Seconds a graceful stop may take before the pipeline is cancelled instead: the stages
# only have to notice their inputs ended and cancel what runs, which takes milliseconds.
_STOP_S = 5.0


@dataclasses.dataclass(eq=False)
class _Registered:
    batch: Any  # the object the Trainer read (matched by identity)
    tasks: Any  # its task batch (Arrow)
    pushed: bool = False


@dataclasses.dataclass(eq=False)
class _Stream:
    exhausted: bool = False


@dataclasses.dataclass(eq=False)
class _Parts:
    run: Any
    tasks: Inlet
    trainer: Inlet
    outlet: Outlet
    pack: Pack


def _count(name: str, value: Any, minimum: int, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
        expected = f"None or an int >= {minimum}" if allow_none else f"an int >= {minimum}"
        raise ValueError(f"{name}={value!r}; expected {expected}")


class RolloutScheduler:
    """Asynchronous GRPO rollouts from a SessionSource, as the Trainer's ``rollout``.

    Args:
      objective: the GRPO objective (``GRPOObjective(seq_len=width - 1, ...)``); its
        ``packed_log_probs`` rescores every batch under the trainer's current weights,
        unless it was built with ``proximal_in_step=True`` and scores them in its own
        training step (the pipeline then has no rescore stage).
      source: a :class:`~dew_pipe.objectives.rl.sessions.SessionSource`.
      weights: the publisher the source samples from: ``load(params, version)`` and an int
        ``version`` (the served version; a ``NativeRolloutServer``, a ``Publication``).
      width: W, ids per packed row.
      rows: N, rows per batch; size it for the chains a group can split into.
      groups: G, sessions per task (at least 2: advantages compare them).
      tasks: turns a training batch into Tasks: :func:`~dew_pipe.objectives.rl.task_ids`
        (default) or :func:`~dew_pipe.objectives.rl.prompt_tasks`.
      max_lag: the most updates an admitted session's oldest call may lag the version it
        trains at; at least ``ahead + sync_every - 1``. Any lag needs the objective's
        ``behavior_importance``.
      ahead: task batches submitted beyond the one being trained.
      sync_every: push weights once the served version is this many updates behind.
      oversample: K extra sessions per task; the first G to finish are admitted.
      admit: pack a batch once this many of its groups are complete; cancel the rest.
      timeout: cancel and resubmit a session still running this many seconds after its
        submission (a failed attempt).
      max_attempts: failed attempts a sample may have before its group is abandoned
        (every resubmission, whatever its cause, uses one).
      truncation: "mask" (default), "score" or "zero" for TRUNCATED sessions.
      support_capacity: C, when calls record sampling supports.
      log: called with a :class:`SchedulerRecord` per batch.
      estimator: the advantage estimator: "group", "mean" or "rloo".
      reward: ``score(task, session)`` for sources that leave sessions unscored (see
        :mod:`dew_pipe.stages.reward`); None trusts the source's rewards.
      reward_workers: threads scoring with ``reward``.
      audit: keep every submission's :class:`~dew_pipe.stages.admission.Ticket` in
        ``ledger`` (memory grows with the run; for tests and debugging).

    Raises:
      TypeError, ValueError: bad arguments, naming the one at fault; ``max_lag`` below
        ``ahead + sync_every - 1``; any lag without ``behavior_importance``; a multi-process
        trainer (``jax.process_count() > 1``).

    Example (a sketch: ``source`` and ``server`` come from ``dew_pipe.inference``)::

        scheduler = RolloutScheduler(objective, source, server, width=64, rows=16, groups=4)
        trainer = Trainer(objective, optax.adamw(1e-5), key=jax.random.key(0), rollout=scheduler)
        state = trainer.fit(scheduler.tasks(data), steps=100)
        scheduler.close()
    """

    def __init__(
        self,
        objective: Any,
        source: SessionSource,
        weights: Any,
        *,
        width: int,
        rows: int,
        groups: int,
        tasks: Callable[[Mapping[str, np.ndarray]], list[Task]] = task_ids,
        max_lag: int = 1,
        ahead: int = 1,
        sync_every: int = 1,
        oversample: int = 0,
        admit: int | None = None,
        timeout: float | None = None,
        max_attempts: int = 3,
        truncation: str = "mask",
        support_capacity: int | None = None,
        log: Callable[[SchedulerRecord], Any] | None = None,
        estimator: str = "group",
        reward: Score | None = None,
        reward_workers: int = 4,
        audit: bool = False,
    ) -> None:
        self._check(objective, source, weights, locals())
        self.objective, self.source, self.weights = objective, source, weights
        self.width, self.rows, self.groups = int(width), int(rows), int(groups)
        self.tasks_reader = tasks
        self.max_lag, self.ahead, self.sync_every = int(max_lag), int(ahead), int(sync_every)
        self.oversample, self.admit, self.timeout = int(oversample), admit, timeout
        self.max_attempts, self.truncation = int(max_attempts), truncation
        self.support_capacity, self.log, self.estimator = support_capacity, log, estimator
        self.reward, self.reward_workers, self.audit = reward, int(reward_workers), audit
        self.read_ahead = self.ahead  # the Trainer reads this many batches past batch i
        self.last_record: SchedulerRecord | None = None
        self.forced_stops = 0  # stops that had to cancel the pipeline (see _stop)
        self._lock = threading.RLock()
        self._group_ids = itertools.count()  # unique over every run of this scheduler
        self._fifo: list[_Registered] = []
        self._stream: _Stream | None = None
        self._parts: _Parts | None = None
        self._handed = 0
        self._error: BaseException | None = None
        self._scorer: Callable | None = None
        self._finished: list[Any] = []  # admissions of runs that ended

    @staticmethod
    def _check(objective: Any, source: Any, weights: Any, args: dict[str, Any]) -> None:
        import jax

        if jax.process_count() > 1:
            raise ValueError(
                f"RolloutScheduler: jax.process_count() is {jax.process_count()}; one trainer "
                "process owns the scheduler, so multi-process trainers are refused"
            )
        _count("width", args["width"], 2)
        _count("rows", args["rows"], 1)
        _count("groups", args["groups"], 2)
        for name in ("ahead", "oversample", "max_lag"):
            _count(name, args[name], 0)
        for name in ("sync_every", "max_attempts", "reward_workers"):
            _count(name, args[name], 1)
        _count("admit", args["admit"], 1, allow_none=True)
        _count("support_capacity", args["support_capacity"], 1, allow_none=True)
        bound = args["ahead"] + args["sync_every"] - 1
        if args["max_lag"] < bound:
            raise ValueError(
                f"max_lag={args['max_lag']}; expected at least ahead + sync_every - 1 = {bound}, "
                "the lag a first submission can reach by construction"
            )
        timeout = args["timeout"]
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0
        ):
            raise ValueError(f"timeout={timeout!r}; expected None or seconds > 0")
        if args["truncation"] not in TRUNCATIONS:
            raise ValueError(f"truncation={args['truncation']!r}; expected one of {TRUNCATIONS}")
        if args["estimator"] not in ESTIMATORS:
            raise ValueError(
                f"estimator={args['estimator']!r}; expected one of {sorted(ESTIMATORS)}"
            )
        for name in ("tasks", "log", "reward"):
            if args[name] is not None and not callable(args[name]):
                raise TypeError(f"{name}={args[name]!r}; expected a callable")
        if not isinstance(source, SessionSource):
            raise TypeError(f"source={source!r}; expected a SessionSource (submit, cancel, close)")
        if not callable(getattr(weights, "load", None)):
            raise TypeError(f"weights={weights!r}; expected a publisher with load(params, version)")
        _served(weights)
        if not callable(getattr(objective, "packed_log_probs", None)):
            raise TypeError(
                f"objective {type(objective).__name__} has no packed_log_probs(params, batch); "
                "expected a GRPOObjective"
            )
        seq_len = getattr(objective, "seq_len", None)
        if seq_len != args["width"] - 1:
            raise ValueError(
                f"objective.seq_len={seq_len!r} with width={args['width']}; expected "
                f"GRPOObjective(seq_len=width - 1 = {args['width'] - 1})"
            )
        options = getattr(objective, "options", None)
        if args["max_lag"] > 0 and getattr(options, "behavior_importance", None) is None:
            raise ValueError(
                f"max_lag={args['max_lag']} lets sessions lag the trainer, so the objective "
                "must weight each token by proximal over behavior: set GRPOObjective("
                "behavior_importance=...) to a TIS cap (2.0) or an IcePop band (0.5, 2.0)"
            )

    # ------------------------------------------------------------------ the stream

    def tasks(self, dataset: Dataset) -> Dataset:
        """``dataset`` with every training batch registered here as the Trainer reads it.

        Validation data passes through unchanged. Train on the result:
        ``trainer.fit(scheduler.tasks(dataset), steps=...)``.

        Raises:
          TypeError: ``dataset`` is not a Dataset.
        """
        if not isinstance(dataset, Dataset):
            raise TypeError(f"dataset is a {type(dataset).__name__}; expected a dew_pipe.Dataset")

        def train(partition: Partition) -> Iterator[Any]:
            return self._registering(dataset, partition)

        return Dataset(train=train, val=dataset.val, records=dataset.records, batch=dataset.batch)

    def _registering(self, dataset: Dataset, partition: Partition) -> Iterator[Any]:
        marker = _Stream()
        self._opened(marker)
        inner = dataset.open_train(partition)
        try:
            for batch in inner:
                self._register(batch)
                yield batch
            marker.exhausted = True  # an epoch ended: the next open continues this stream
        finally:
            close = getattr(inner, "close", None)
            if close is not None:
                close()

    def _opened(self, marker: _Stream) -> None:
        with self._lock:
            previous, self._stream = self._stream, marker
            if previous is not None and not previous.exhausted:
                self._reset("reopened")

    def _register(self, batch: Any) -> None:
        tasks = self.tasks_reader(batch)
        if not isinstance(tasks, list | tuple) or not all(isinstance(t, Task) for t in tasks):
            raise TypeError(f"tasks(batch) returned {tasks!r}; expected a list of Task")
        with self._lock:
            self._fifo.append(_Registered(batch, task_batch(list(tasks))))

    def _match(self, batch: Any) -> tuple[_Registered, list[_Registered]]:
        """The registered entry the Trainer hands over, and the entries read after it."""
        fifo = self._fifo
        found = [k for k, entry in enumerate(fifo) if entry.batch is batch]
        if not found:
            raise ValueError(
                "RolloutScheduler was handed a batch it did not see read; train on "
                "scheduler.tasks(dataset) so each batch is registered as the Trainer reads it"
            )
        # The Trainer reads `ahead` batches past the one it hands over; a dataset that
        # yields one object repeatedly matches several entries, so take that position.
        near = [k for k in found if len(fifo) - 1 - k <= self.ahead]
        k = near[0] if near else found[-1]
        if any(entry.pushed for entry in fifo[:k]):
            raise RuntimeError(
                "the Trainer skipped a batch whose rollouts were already submitted; a "
                "scheduler expects batches handed over in the order they were read"
            )
        # Entries before k were read without being handed over (a resume replaying the
        # stream to its checkpointed position); nothing was submitted for them.
        entry, self._fifo = fifo[k], fifo[k + 1 :]
        return entry, list(self._fifo)

    # ------------------------------------------------------------------ the Trainer's hook

    def __call__(self, state: Any, batch: Mapping[str, np.ndarray], key: Any) -> dict:
        """Hand over ``batch``; returns it as packed, rescored rows ``{name: [N, W]}``.

        The sessions come from the source (``key`` is unused: sources own their sampling).
        Blocks until the batch's groups are admitted.

        Raises:
          ValueError: a batch not read through :meth:`tasks`.
          StageFailed: a stage of the pipeline failed (the source raised, a group's chains
            cannot fit ``rows``, a push did not move the served version...), naming it;
            the original exception is its ``__cause__``.
        """
        del key
        with self._lock:
            entry, after = self._match(batch)
            parts = self._running()
            for item in (entry, *after[: self.ahead]):
                if not item.pushed:
                    self._put(parts.tasks, item.tasks)
                    item.pushed = True
            index = self._handed
            self._put(parts.trainer, Step(index, int(state.updates), state.params))
            try:
                handed: Handed = parts.outlet.get()
            except EndOfStream:
                self._raise_failure()
            self._handed += 1
        record = handed.record
        self.last_record = record
        if self.log is not None and record is not None:
            self.log(record)
        return dict(packed_from_arrow(handed.rows))

    def metrics(self) -> dict[str, float]:
        """The last batch's figures, for the Trainer's log (it prefixes ``rollout/``).

        Returns:
          ``lag``, ``waited_s``, ``push_s``, group and session counts, ``resubmitted/<cause>``
          and the batch's ``session_metrics`` (rewards, latencies, version lag...); empty
          before the first batch.

        Example:
          >>> RolloutScheduler.metrics.__doc__ is not None
          True
        """
        record = self.last_record
        if record is None:
            return {}
        names = (
            "lag", "waited_s", "push_s", "admitted_groups", "admitted_sessions", "submitted",
            "discarded", "cancelled", "abandoned", "abandoned_groups", "cut_groups",
        )  # fmt: skip
        out = {n: float(getattr(record, n)) for n in names if getattr(record, n) is not None}
        out.update({f"resubmitted/{k}": float(v) for k, v in record.resubmitted.items()})
        out.update({k: float(v) for k, v in record.metrics.items()})
        return out

    def snapshot(self) -> FlowSnapshot | None:
        """Counters of the running pipeline: per stage (busy and waiting seconds, items) and
        per edge (items, depth, seconds its producer waited for room and its consumer waited
        for an item); None when no pipeline runs (before the first handover, after
        ``close``). A new stream (another ``fit``) starts a new pipeline with fresh counters.

        Example (a sketch: after ``trainer.fit(scheduler.tasks(data), ...)``)::

            snapshot = scheduler.snapshot()
            snapshot.edges["update.batches->batches.in"].get_wait_s  # the Trainer's wait
            snapshot.stages["rescore"].busy_s
        """
        parts = self._parts
        return None if parts is None else parts.run.snapshot()

    def _put(self, inlet: Inlet, item: Any) -> None:
        try:
            inlet.put(item)
        except FlowError:
            self._raise_failure()

    def _raise_failure(self) -> None:
        parts = self._parts
        try:
            parts.run.wait()
        except FlowError as error:
            self._error = error
            self._retire()
            raise
        self._retire()
        self._error = RuntimeError("the rollout pipeline ended before handing the batch over")
        raise self._error

    # ------------------------------------------------------------------ the pipeline

    def _running(self) -> _Parts:
        if self._error is not None:
            raise self._error
        if self._parts is None:
            self._parts = self._start()
        return self._parts

    def _score(self) -> Callable:
        if self._scorer is None:
            import jax

            self._scorer = jax.jit(self.objective.packed_log_probs)
        return self._scorer

    def _start(self) -> _Parts:
        tasks = Inlet("tasks", output_type=TASKS_SCHEMA, capacity=self.ahead + 1)
        trainer = Inlet("trainer", output_type=Step, capacity=1)
        outlet = Outlet("batches", input_type=Handed, capacity=1)
        rollout = Rollout(
            self.source,
            groups=self.groups,
            oversample=self.oversample,
            ahead=self.ahead,
            max_lag=self.max_lag,
            timeout=self.timeout,
            version=lambda: _served(self.weights),
            group_ids=self._group_ids,
        )
        pack = Pack(
            width=self.width,
            rows=self.rows,
            groups=self.groups,
            admit=self.admit,
            max_lag=self.max_lag,
            max_attempts=self.max_attempts,
            truncation=self.truncation,
            estimator=self.estimator,
            support_capacity=self.support_capacity,
            audit=self.audit,
        )
        common = {"width": self.width, "support_capacity": self.support_capacity}
        # An objective that takes the proximal likelihoods from its own forward pass needs
        # no rescoring: pack hands its rows straight to update.
        in_step = getattr(self.objective, "proximal_in_step", False) is True
        stages = [
            tasks,
            rollout,
            Reward(self.reward, workers=self.reward_workers),
            pack,
            *([] if in_step else [Rescore(self._score(), **common)]),
            Update(weights=self.weights, sync_every=self.sync_every, **common),
            trainer,
            outlet,
        ]
        pipeline = Pipeline("rollout-scheduler")
        for stage in stages:
            pipeline.add(stage)
        wire(
            pipeline,
            ahead=self.ahead,
            reward_workers=self.reward_workers,
            rescore=None if in_step else "rescore",
        )
        pipeline.connect("trainer", "update.trainer", capacity=1)
        pipeline.connect("update.batches", "batches", capacity=1)
        return _Parts(pipeline.start(), tasks, trainer, outlet, pack)

    def _retire(self) -> None:
        parts, self._parts = self._parts, None
        if parts is not None:
            self._finished.append(parts.pack.admission)

    def _stop(self, cause: str) -> None:
        parts = self._parts
        if parts is None:
            return
        parts.pack.shutdown_cause = cause
        # Closing the inlets ends update, then everything downstream of the handovers, so
        # pack sees every submission rollout made before it stops (exact accounting).
        parts.tasks.end()
        parts.trainer.end()
        try:
            parts.run.wait(timeout=_STOP_S)
        except TimeoutError:  # update was waiting for a batch nobody will collect
            self.forced_stops += 1
            parts.run.cancel(f"rollout scheduler {cause}")
            with contextlib.suppress(FlowError):
                parts.run.wait()
        except FlowError:
            pass  # a failure the Trainer has already been told about
        self._retire()

    def _reset(self, cause: str) -> None:
        self._stop(cause)
        self._fifo = []
        self._handed = 0
        self._error = None

    def close(self) -> None:
        """Stop the pipeline, cancelling every session still running (idempotent).

        The source stays open: it belongs to whoever created it. Called from another
        thread while the Trainer waits in a call, it cancels the pipeline first; that call
        then raises ``Cancelled``.
        """
        if not self._lock.acquire(blocking=False):
            parts = self._parts
            if parts is not None:
                parts.pack.shutdown_cause = "closed"
                parts.run.cancel("rollout scheduler closed")
            self._lock.acquire()
        try:
            self._reset("closed")
            self._stream = None
        finally:
            self._lock.release()

    def __enter__(self) -> RolloutScheduler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ accounting

    def _admissions(self) -> list[Any]:
        current = [] if self._parts is None else [self._parts.pack.admission]
        return [*self._finished, *current]

    @property
    def totals(self) -> collections.Counter:
        """Submissions and their outcomes over every run so far.

        Keys: ``submitted``, each outcome (``admitted``, ``resubmitted``, ``discarded``,
        ``cancelled``, ``abandoned``) and ``resubmitted/<cause>``. Submissions still in
        flight have no outcome yet.
        """
        total: collections.Counter = collections.Counter()
        for admission in self._admissions():
            total.update(admission.totals)
        return total

    @property
    def ledger(self) -> list[Ticket]:
        """Every submission with its outcome (all of them with ``audit=True``; otherwise
        only those of batches not yet packed)."""
        return [t for admission in self._admissions() for t in admission.ledger.values()]
