"""What the RL stages pass each other: stamped session batches and a few control records.

Data travels as Arrow:

* task batches: :data:`dew_pipe.batches.TASKS_SCHEMA`, one row per task;
* stamped sessions (:data:`SESSION_ROWS`): the sessions batch of :mod:`dew_pipe.batches`
  plus the columns the scheduler adds to every session it got back from a source;
* packed rows: :func:`dew_pipe.batches.packed_schema`.

Control travels as small frozen Python records: :class:`Plan` (rollout to pack: a task
batch was taken), :class:`Orders` (pack to rollout: resubmit, cancel, release),
:class:`Handover` (update to rollout and pack: the trainer took batch ``i`` at version
``v``), :class:`Proximal` (update to rescore: the weights to rescore batch ``i`` under),
:class:`Step` and :class:`Handed` (the trainer's thread to the update stage and back), and
:class:`SchedulerRecord`, the accounting of one batch.

A submission is named by its ticket ``(group, sample, attempt)``: group ids are unique over
a scheduler's life and every resubmission of a sample bumps its attempt, so no two
submissions share a ticket.

Stamp columns of :data:`SESSION_ROWS` (one value per session):

=================== ============== ========================================================
column              type           meaning
=================== ============== ========================================================
batch               int64          the task batch (0, 1, ... in the order rollout took them)
submitted_version   int32          weights version served when the session was submitted
latency             float64        seconds from submission to finish
cause               string         "" for a session the source returned; "timeout" or
                                   "stale_running" for one rollout cancelled itself
prompt              list<int32>    the task's prompt ids (null for id-only tasks)
data_source         string         the task's metadata (empty when it has none)
ground_truth        string
extra_info          string
=================== ============== ========================================================

The last four are the task's columns of :data:`~dew_pipe.batches.TASKS_SCHEMA`, written with
``tasks_to_arrow(task_row(task))`` and read back with ``task_from_row``.

The ``calls`` column is on every batch but not in the port type: its struct type depends on
whether calls recorded expert routing, so each stage reads it with ``from_arrow``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa

from dew_pipe.batches import TASKS_SCHEMA, sessions_schema, tasks_from_arrow, tasks_to_arrow
from dew_pipe.objectives.rl.session_arrow import from_arrow, task_from_row, task_row, to_arrow
from dew_pipe.objectives.rl.sessions import Session, Task

__all__ = [
    "CAUSES",
    "SESSION_ROWS",
    "Handed",
    "Handover",
    "Orders",
    "Plan",
    "Proximal",
    "Resubmit",
    "SchedulerRecord",
    "Stamps",
    "Step",
    "stamp_sessions",
    "unstamp_sessions",
]

#: Why a submission was replaced by another: the source reported INFRA_ERROR or CANCELLED,
#: the scheduler timed it out, it came back (or was still running) too stale to train on,
#: or it was TRUNCATED without a reward under ``truncation="score"``.
CAUSES = ("infra_error", "cancelled", "timeout", "stale", "stale_running", "unscored")

_STAMPS = [
    pa.field("batch", pa.int64(), False),
    pa.field("submitted_version", pa.int32(), False),
    pa.field("latency", pa.float64(), False),
    pa.field("cause", pa.string(), False),
]
# The task's own columns, as the tasks batch has them (its task_id is the session's).
_TASK_COLUMNS = [field for field in TASKS_SCHEMA if field.name != "task_id"]

#: Port type of stamped sessions: every sessions column but ``calls``, the stamps, the task.
SESSION_ROWS = pa.schema(
    [f for f in sessions_schema() if f.name != "calls"] + _STAMPS + _TASK_COLUMNS
)


@dataclasses.dataclass(frozen=True)
class Stamps:
    """The scheduler's stamps of one session (see the module docstring)."""

    batch: int
    submitted_version: int
    latency: float
    cause: str = ""
    task: Task | None = None


def stamp_sessions(sessions: Sequence[Session], stamps: Sequence[Stamps]) -> pa.RecordBatch:
    """Sessions and their stamps as one :data:`SESSION_ROWS` batch (with ``calls``).

    Example:
      >>> from dew_pipe.objectives.rl.sessions import Call
      >>> s = Session(1, 0, 0, 0, [Call([1], [2], [-0.1], "stop", 0)], "COMPLETED", 1.0)
      >>> stamp_sessions([s], [Stamps(0, 0, 0.5)]).column("latency").to_pylist()
      [0.5]
    """
    if len(sessions) != len(stamps):
        raise ValueError(f"stamps: {len(stamps)} for {len(sessions)} sessions, expected one each")
    rb = to_arrow(list(sessions))
    # The samples of a group share their Task: each distinct task is written once, then
    # repeated by index (a batch of G samples per task writes 1/G of the rows).
    rows: list[dict[str, Any]] = []
    first: dict[Any, int] = {}
    index = []
    for session, st in zip(sessions, stamps, strict=True):
        key = ("task", id(st.task)) if st.task is not None else ("id", session.task)
        at = first.get(key)
        if at is None:
            at = first[key] = len(rows)
            rows.append(task_row(st.task) if st.task is not None else {"task_id": session.task})
        index.append(at)
    tasks = tasks_to_arrow(rows).take(pa.array(index, pa.int32()))
    columns = {
        "batch": pa.array([s.batch for s in stamps], pa.int64()),
        "submitted_version": pa.array([s.submitted_version for s in stamps], pa.int32()),
        "latency": pa.array([float(s.latency) for s in stamps], pa.float64()),
        "cause": pa.array([s.cause for s in stamps], pa.string()),
    }
    columns.update({field.name: tasks.column(field.name) for field in _TASK_COLUMNS})
    for field in (*_STAMPS, *_TASK_COLUMNS):
        rb = rb.append_column(field, columns[field.name])
    return rb


def unstamp_sessions(
    batch: pa.RecordBatch, *, tasks: bool = True
) -> tuple[list[Session], list[Stamps]]:
    """The sessions and stamps of a :data:`SESSION_ROWS` batch.

    Args:
      batch: the stamped sessions.
      tasks: rebuild each stamp's :class:`Task` from the task columns; False leaves
        ``Stamps.task`` None, for a reader that never looks at it (pack).

    Raises:
      ValueError: a batch without the stamp columns or ``calls``, naming the column.
    """
    for field in (*_STAMPS, *_TASK_COLUMNS, pa.field("calls", pa.null())):
        if field.name not in batch.schema.names:
            raise ValueError(f"stamped sessions: missing column {field.name!r}")
    sessions = from_arrow(batch.select(sessions_schema().names))
    rows = tasks_from_arrow(batch.select(TASKS_SCHEMA.names)) if tasks else None
    columns = {
        name: batch.column(name).to_pylist()
        for name in ("batch", "submitted_version", "latency", "cause")
    }
    stamps = [
        Stamps(
            columns["batch"][i],
            columns["submitted_version"][i],
            columns["latency"][i],
            columns["cause"][i],
            None if rows is None else task_from_row(rows[i]),
        )
        for i in range(batch.num_rows)
    ]
    return sessions, stamps


# ----------------------------------------------------------------------------- control


@dataclasses.dataclass(frozen=True)
class Plan:
    """Rollout to pack: task batch ``batch`` was taken and every sample of it submitted.

    Attributes:
      batch: the task batch's number.
      groups: the group id given to each task, in row order.
      tasks: the task ids, in row order.
      samples: submissions per group (``groups + oversample`` of the scheduler).
      version: the weights version they were submitted under.
      replayed: ``(group, sample)`` of the first attempts served from the rollout journal
        (:mod:`dew_pipe.stages.journal`) instead of the source.
    """

    batch: int
    groups: tuple[int, ...]
    tasks: tuple[int, ...]
    samples: int
    version: int
    replayed: tuple[tuple[int, int], ...] = ()


@dataclasses.dataclass(frozen=True)
class Resubmit:
    """Submit sample ``sample`` of ``group`` (task batch ``batch``) again as ``attempt``."""

    batch: int
    group: int
    sample: int
    attempt: int
    cause: str


@dataclasses.dataclass(frozen=True)
class Orders:
    """Pack to rollout: resubmissions, tickets to cancel, and batches whose work is over.

    Attributes:
      resubmit: samples to submit again, each under a new attempt.
      cancel: tickets ``(group, sample, attempt)`` to cancel; their results are dropped.
      release: task batches that are packed (or given up); rollout forgets their tasks.
      final: pack will send no more orders (it stopped packing once the handovers ended);
        a stopping rollout carries out every order up to this one, so each submission
        pack counted did reach the source.
    """

    resubmit: tuple[Resubmit, ...] = ()
    cancel: tuple[tuple[int, int, int], ...] = ()
    release: tuple[int, ...] = ()
    final: bool = False

    def __bool__(self) -> bool:
        return bool(self.resubmit or self.cancel or self.release or self.final)


@dataclasses.dataclass(frozen=True)
class Handover:
    """From the update node to rollout and pack: the trainer now waits for batch ``batch``.

    The update node is a :class:`~dew_pipe.stages.handoff.Handoff` in the library view and a
    :class:`~dew_pipe.stages.train.Train` in the pipeline view; both send these.

    Attributes:
      batch: the batch number (the trainer's ``i``-th batch of this run).
      version: the trainer's version (``TrainState.updates``) it will train batch ``batch`` at.
      served: the version the weights publisher serves after any push.
      pushed: whether a push ran for this handover.
      position: the trainer's step (``TrainState.step``, its data position) as it takes
        the batch; the rollout journal files sessions under it. None when unknown.
    """

    batch: int
    version: int
    served: int
    pushed: bool = False
    position: int | None = None


@dataclasses.dataclass(frozen=True, eq=False)
class Proximal:
    """From the update node to rescore: score batch ``batch`` under ``params`` (``version``).

    ``params`` are the trainer's live weights: valid until that batch's update runs, which
    waits for the rescored batch, so rescore must not keep them past it.
    """

    batch: int
    version: int
    params: Any


@dataclasses.dataclass(frozen=True, eq=False)
class Step:
    """The trainer's thread to the update stage: hand over batch ``batch`` at ``version``
    (the Trainer's step ``position``, when its state has one). ``published`` is the push
    the caller already made (``(served, pushed, seconds)`` as ``publish`` returns them):
    on a multi-process trainer the push is a meeting of every process, made on the
    Trainer's thread, so the update stage must not push again."""

    batch: int
    version: int
    params: Any
    position: int | None = None
    published: tuple[int, bool, float] | None = None


@dataclasses.dataclass(frozen=True)
class SchedulerRecord:
    """The accounting of one training batch, handed to ``RolloutScheduler(log=...)``.

    Every submission made for the batch ends in exactly one of ``admitted_sessions``,
    ``resubmitted`` (by cause), ``discarded``, ``cancelled`` and ``abandoned``, so
    ``submitted`` is their sum.

    Attributes:
      batch: the batch's number in this stream (0 for the first batch handed over).
      version: the trainer's version (updates) the batch trains at; None without a trainer.
      served: the weights version served when the batch was handed over.
      pushed: whether weights were pushed at that handover.
      oldest_version: the oldest call version among the admitted sessions (None if none).
      lag: ``version - oldest_version`` (None when either is unknown).
      admitted_groups: groups in the batch; admitted_sessions: their sessions.
      submitted: submissions made for the batch, every attempt counted.
      resubmitted: submissions replaced by another, by cause (:data:`CAUSES`).
      discarded: sessions that came back but were not needed (a group already complete,
        a cut group, the batch already full under ``admit``).
      cancelled: submissions cancelled while running and not replaced.
      abandoned: sessions of abandoned groups, and samples that used up their attempts.
      cancellations: cancel requests sent for the batch (cancelled, timeouts, stale ones).
      abandoned_groups: groups given up after a sample used up ``max_attempts``.
      cut_groups: complete groups whose chains did not fit beside the earlier ones.
      waited_s: seconds from the handover until the batch was ready to train.
      push_s: seconds the weight push took at that handover.
      replayed: of ``submitted``, the sessions served from the rollout journal after a
        resume instead of the source (each then has an outcome like any submission).
      metrics: ``session_metrics`` over the admitted sessions and the packed batch, with
        each session's latency from submission to finish.
    """

    batch: int
    version: int | None
    served: int | None
    pushed: bool
    oldest_version: int | None
    lag: int | None
    admitted_groups: int
    admitted_sessions: int
    submitted: int
    resubmitted: Mapping[str, int]
    discarded: int
    cancelled: int
    abandoned: int
    cancellations: int
    abandoned_groups: int
    cut_groups: int
    waited_s: float = 0.0
    push_s: float = 0.0
    metrics: Mapping[str, float] = dataclasses.field(default_factory=dict)
    replayed: int = 0

    @property
    def accounted(self) -> int:
        """Submissions with an outcome: equals ``submitted`` for every emitted record."""
        return (
            self.admitted_sessions
            + sum(self.resubmitted.values())
            + self.discarded
            + self.cancelled
            + self.abandoned
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain values for JSON logs; ``metrics`` keys are prefixed ``rollout/``.

        Example:
          >>> r = SchedulerRecord(0, 1, 1, False, 0, 1, 2, 8, 8, {}, 0, 0, 0, 0, 0, 0)
          >>> r.to_dict()["scheduler/lag"]
          1
        """
        out: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "metrics":
                out.update({f"rollout/{k}": v for k, v in value.items()})
            elif field.name == "resubmitted":
                out.update({f"scheduler/resubmitted/{k}": v for k, v in value.items()})
            else:
                out[f"scheduler/{field.name}"] = value
        return out


@dataclasses.dataclass(frozen=True, eq=False)
class Handed:
    """The update stage to the trainer's thread: batch ``batch``, packed and rescored."""

    batch: int
    rows: pa.RecordBatch
    record: SchedulerRecord | None
