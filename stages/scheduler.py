"""RolloutScheduler: the Trainer's rollout for any SessionSource, run as a pipeline of stages.

The scheduler is the library view of :mod:`dew_pipe.stages.graph`: the graph that
:func:`~dew_pipe.stages.graph.build_graph` makes from the scheduler's
:class:`~dew_pipe.stages.graph.GraphSettings`, whose update stage is a
:class:`~dew_pipe.stages.handoff.Handoff`, with an ``Inlet`` that carries the Trainer's
handovers into it and an ``Outlet`` that carries each packed, rescored batch back.
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

Resume without losing in-flight rollouts: with ``journal=run_dir / "rollouts"`` the
sessions finished but not yet trained on are kept on disk as they finish (see
:mod:`dew_pipe.stages.journal`), and a resumed run, in this process or a new one after a
crash, replays those still within ``max_lag`` of the restored trainer instead of sampling
them again; the rest are resubmitted (cause "stale"). The Trainer tells the scheduler of
each checkpoint (:meth:`RolloutScheduler.checkpointed`), which lets the journal forget
what a complete checkpoint has trained on.

Several processes: a multi-process trainer runs one scheduler per process; they meet on
the Trainer's thread at each push and at the rescoring of the pool's batch
(:mod:`dew_pipe.stages.pool`), so this process's pipeline has no rescore stage then.

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
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from dew_pipe.batches import TASKS_SCHEMA, packed_from_arrow
from dew_pipe.data.dataset import Dataset, Partition
from dew_pipe.flow import EndOfStream, FlowError, FlowSnapshot, Inlet, Outlet, Run
from dew_pipe.objectives.rl.sessions import SessionSource, Task
from dew_pipe.objectives.rl.task_rows import task_ids
from dew_pipe.stages.admission import Ticket
from dew_pipe.stages.graph import GraphSettings, build_graph, rescorer, task_batch
from dew_pipe.stages.handoff import publish, served_version
from dew_pipe.stages.journal import Journal
from dew_pipe.stages.messages import Handed, SchedulerRecord, Step
from dew_pipe.stages.pack import Pack
from dew_pipe.stages.protocols import LikelihoodScorer, TrainingState, WeightsPublisher
from dew_pipe.stages.reward import Score

if TYPE_CHECKING:  # a type only: the objective module loads JAX
    from dew_pipe.objectives.rl.grpo import GRPOObjective

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
    run: Run
    tasks: Inlet
    trainer: Inlet
    outlet: Outlet
    pack: Pack


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
      tasks: turns a training batch into Tasks: :func:`~dew_pipe.objectives.rl.task_ids`
        (default) or :func:`~dew_pipe.objectives.rl.prompt_tasks`.
      log: called with a :class:`SchedulerRecord` per batch.
      reward: ``score(task, session)`` for sources that leave sessions unscored (see
        :mod:`dew_pipe.stages.reward`); None trusts the source's rewards.
      width, rows, groups, max_lag, ahead, sync_every, oversample, admit, timeout,
        max_attempts, truncation, support_capacity, estimator, reward_workers, audit,
        share_prompts: the
        graph's :class:`~dew_pipe.stages.graph.GraphSettings`, documented there (kept as
        ``settings``). ``max_lag`` is at least ``ahead + sync_every - 1``, and any lag
        needs the objective's ``behavior_importance``; ``audit`` keeps every submission's
        :class:`~dew_pipe.stages.admission.Ticket` in ``ledger``.
      journal: a directory (or a :class:`~dew_pipe.stages.journal.Journal`) where the
        sessions finished but not yet trained on are kept, so that a resumed run replays
        those still within ``max_lag`` instead of sampling them again; put it in the
        Trainer's run directory (``run_dir / "rollouts"``). None (the default): a resumed
        run samples everything that was in flight again. Needs a state with ``step``
        (``dew_pipe.TrainState``).

    Raises:
      TypeError, ValueError: bad arguments, naming the one at fault; ``max_lag`` below
        ``ahead + sync_every - 1``; any lag without ``behavior_importance``; on a
        multi-process trainer, a ``journal`` or an objective with ``proximal_in_step=True``.

    On a multi-process trainer (``jax.process_count() > 1``) every process builds its own
    scheduler, on its own source, and trains on ``scheduler.tasks(data)``, so each runs the
    task rows its data stream reads and packs its own ``rows``; the processes meet at the
    weight push and at the proximal rescoring, which runs once over the pool's batch, and
    a failure on one process raises on all (see :mod:`dew_pipe.stages.pool`).

    Example (a sketch: ``source`` and ``server`` come from ``dew_pipe.inference``)::

        scheduler = RolloutScheduler(objective, source, server, width=64, rows=16, groups=4)
        trainer = Trainer(objective, optax.adamw(1e-5), key=jax.random.key(0), rollout=scheduler)
        state = trainer.fit(scheduler.tasks(data), steps=100)
        scheduler.close()
    """

    def __init__(
        self,
        objective: GRPOObjective,
        source: SessionSource,
        weights: WeightsPublisher,
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
        journal: str | os.PathLike | Journal | None = None,
        share_prompts: bool = False,
    ) -> None:
        self.settings = GraphSettings(
            width=width, rows=rows, groups=groups, max_lag=max_lag, ahead=ahead,
            sync_every=sync_every, oversample=oversample, admit=admit, timeout=timeout,
            max_attempts=max_attempts, truncation=truncation, estimator=estimator,
            support_capacity=support_capacity, reward_workers=reward_workers, audit=audit,
            share_prompts=share_prompts,
        )  # fmt: skip
        for name, value in (("tasks", tasks), ("log", log), ("reward", reward)):
            if value is not None and not callable(value):
                raise TypeError(f"{name}={value!r}; expected a callable")
        if not isinstance(source, SessionSource):
            raise TypeError(f"source={source!r}; expected a SessionSource (submit, cancel, close)")
        if not isinstance(weights, WeightsPublisher):
            raise TypeError(f"weights={weights!r}; expected a publisher with load(params, version)")
        served_version(weights)
        if journal is not None and not isinstance(journal, Journal):
            if not isinstance(journal, str | os.PathLike):
                raise TypeError(f"journal={journal!r}; expected None, a directory or a Journal")
            journal = Journal(journal)
        self.journal: Journal | None = journal
        self.settings.check_objective(objective)
        self._pool = _pool_for(objective, journal)
        self.objective, self.source, self.weights = objective, source, weights
        self.tasks_reader, self.log, self.reward = tasks, log, reward
        self.read_ahead = self.settings.ahead  # the Trainer reads this many batches past i
        self.last_record: SchedulerRecord | None = None
        self.forced_stops = 0  # stops that had to cancel the pipeline (see _stop)
        self._lock = threading.RLock()
        self._group_ids = itertools.count()  # unique over every run of this scheduler
        self._fifo: list[_Registered] = []
        self._stream: _Stream | None = None
        self._parts: _Parts | None = None
        self._handed = 0
        self._error: BaseException | None = None
        self._scorer: LikelihoodScorer | None = None  # compiled once, kept across runs
        self._finished: list[Any] = []  # admissions of runs that ended

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
        near = [k for k in found if len(fifo) - 1 - k <= self.settings.ahead]
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

    def __call__(
        self, state: TrainingState, batch: Mapping[str, np.ndarray], key: Any
    ) -> dict[str, np.ndarray]:
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
        if self._pool is not None:
            return self._pooled(state, batch)
        with self._lock:
            entry, after = self._match(batch)
            parts = self._running()
            for item in (entry, *after[: self.settings.ahead]):
                if not item.pushed:
                    self._put(parts.tasks, item.tasks)
                    item.pushed = True
            index = self._handed
            position = getattr(state, "step", None)
            if position is None and self.journal is not None:
                raise TypeError(
                    f"RolloutScheduler(journal=...) files sessions by the trainer's step, but "
                    f"the state ({type(state).__name__}) has no 'step'"
                )
            position = None if position is None else int(position)
            step = Step(index, int(state.updates), state.params, position)
            self._put(parts.trainer, step)
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

    def _pooled(self, state: TrainingState, batch: Mapping[str, np.ndarray]) -> dict:
        """``__call__`` on a multi-process trainer: the same handover, with the push and
        the rescoring as meetings of every process (see :mod:`dew_pipe.stages.pool`)."""
        pool, ahead = self._pool, self.settings.ahead
        version, failure = int(state.updates), None
        with self._lock:
            index, served = self._handed, -1
            try:
                entry, after = self._match(batch)
                parts = self._running()
                for item in (entry, *after[:ahead]):
                    if not item.pushed:
                        self._put(parts.tasks, item.tasks)
                        item.pushed = True
                position = getattr(state, "step", None)
                position = None if position is None else int(position)
                served = served_version(self.weights)
            except Exception as error:  # told to every process at the meeting, then raised
                failure = error
            versions = pool.meet(f"handing over batch {index}", failure, served)
            if len(set(versions)) > 1:
                raise RuntimeError(
                    f"RolloutScheduler: the processes serve weights versions {versions} at "
                    f"batch {index}; expected one version (every process pushes the same)"
                )
            published = None
            try:
                published = publish(self.weights, state.params, version, self.settings.sync_every)
            except Exception as error:
                failure = error
            pool.meet(f"pushing weights version {version}", failure)
            try:
                self._put(parts.trainer, Step(index, version, state.params, position, published))
                try:
                    handed: Handed = parts.outlet.get()
                except EndOfStream:
                    self._raise_failure()
            except Exception as error:
                failure = error
            pool.meet(f"admitting batch {index}", failure)
            columns = dict(packed_from_arrow(handed.rows))
            columns["old_log_probs"] = pool.rescore(state.params, columns, version)
            self._handed += 1
        self.last_record = handed.record
        if self.log is not None and handed.record is not None:
            self.log(handed.record)
        return columns

    def checkpointed(self, step: int) -> None:
        """The Trainer started saving a checkpoint at ``step`` (``fit`` calls this after
        each save): the journal may forget the batches the checkpoint before it trained on.
        Does nothing without a journal.

        Example:
          >>> RolloutScheduler.checkpointed.__doc__ is not None
          True
        """
        if self.journal is not None:
            self.journal.checkpointed(step)

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
            "discarded", "cancelled", "abandoned", "abandoned_groups", "cut_groups", "replayed",
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

    def _start(self) -> _Parts:
        ahead = self.settings.ahead
        tasks = Inlet("tasks", output_type=TASKS_SCHEMA, capacity=ahead + 1)
        trainer = Inlet("trainer", output_type=Step, capacity=1)
        outlet = Outlet("batches", input_type=Handed, capacity=1)
        if self._scorer is None and self._pool is None:  # a pool rescores on the Trainer's thread
            self._scorer = rescorer(self.objective)
        pipeline = build_graph(
            self.settings, tasks=tasks, source=self.source, weights=self.weights,
            scorer=self._scorer, reward=self.reward, group_ids=self._group_ids,
            journal=self.journal, name="rollout-scheduler",
        )  # fmt: skip
        pipeline.add(trainer)
        pipeline.add(outlet)
        pipeline.connect("trainer", "update.trainer", capacity=1)
        pipeline.connect("update.batches", "batches", capacity=1)
        return _Parts(pipeline.start(), tasks, trainer, outlet, pipeline.stages["pack"])

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
        ``cancelled``, ``abandoned``), ``resubmitted/<cause>`` and ``replayed`` (of the
        submissions, those served from the journal). Submissions still in flight have no
        outcome yet.
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


def _pool_for(objective: Any, journal: Journal | None) -> Any:
    """The meetings of a multi-process trainer's processes; None on one process.

    What a pool has not been made to do is refused: a journal (its replay after a resume
    is per process, and no test shows the processes' replays agree) and an objective that
    scores the proximal policy in its own step (the pool rescores on the Trainer's thread).
    """
    import jax

    if jax.process_count() == 1:
        return None
    if journal is not None:
        raise ValueError(
            f"RolloutScheduler(journal=...): jax.process_count() is {jax.process_count()}; "
            "a journal is supported on a one-process trainer only"
        )
    if getattr(objective, "proximal_in_step", False) is True:
        raise ValueError(
            f"RolloutScheduler: jax.process_count() is {jax.process_count()}, and the "
            "objective scores the proximal policy in its own step (proximal_in_step=True); "
            "a multi-process trainer's scheduler rescores the pool's batch itself, so it "
            "needs proximal_in_step=False"
        )
    from dew_pipe.stages.pool import ProcessPool

    return ProcessPool(objective)
