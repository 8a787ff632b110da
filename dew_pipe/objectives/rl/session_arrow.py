"""Session and task records as Arrow rows: the one mapping between the records and the wire.

The wire format of tasks and sessions (schemas, plain-row conversion, column helpers) is
:mod:`dew_pipe.rollout_batches`, re-exported by :mod:`dew_pipe.batches`; the records are
:class:`~dew_pipe.objectives.rl.sessions.Session`, :class:`~dew_pipe.objectives.rl.sessions.Call`
and :class:`~dew_pipe.objectives.rl.sessions.Task`. This module maps one onto the other, and
everything that moves records across stages, files, processes and Beam goes through it:

* :func:`session_row` (a session as the row mapping of the sessions batch), :func:`to_arrow`
  and :func:`from_arrow` (sessions as a sessions batch and back; reading back shares memory:
  every id, likelihood and routing array of the returned calls is a read-only view of the
  batch's buffers, and every record goes through the same validation as a live one);
* :func:`task_row` and :func:`task_from_row` (a task as a row of the tasks batch and back).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa

from dew_pipe.objectives.rl.session_records import Call, Session, Task, check_sessions
from dew_pipe.rollout_batches import sessions_from_arrow, sessions_to_arrow

__all__ = ["from_arrow", "session_row", "task_from_row", "task_row", "to_arrow"]

_TASK_TEXT = ("data_source", "ground_truth", "extra_info")


def session_row(session: Session) -> dict[str, Any]:
    """A session as the row mapping :func:`dew_pipe.batches.sessions_to_arrow` takes.

    Arrays stay the record's NumPy arrays (no copy).

    Args:
        session: the record.

    Returns:
        ``{"task_id", "group", "sample", "attempt", "status", "reward", "components",
        "detail", "calls"}``, each call ``{"prompt_ids", "sampled_ids",
        "behavior_log_probs", "raw_log_probs", "finish_reason", "version", "support",
        "routed_experts"}``.

    Example:
        >>> s = Session(3, 0, 1, 0, [Call([1, 2], [3], [-0.5], "stop", 0)], "COMPLETED", 1.0)
        >>> row = session_row(s)
        >>> row["status"], row["calls"][0]["sampled_ids"].tolist()
        ('COMPLETED', [3])
    """
    return {
        "task_id": session.task,
        "group": session.group,
        "sample": session.sample,
        "attempt": session.attempt,
        "status": session.status.name,
        "reward": session.reward,
        "components": dict(session.components),
        "detail": session.detail,
        "calls": [
            {
                "prompt_ids": call.prompt_ids,
                "sampled_ids": call.sampled_ids,
                "behavior_log_probs": call.behavior_log_probs,
                "raw_log_probs": call.log_probs,
                "finish_reason": call.finish_reason,
                "version": call.version,
                "support": None if call.support is None else list(call.support),
                "routed_experts": call.routed_experts,
            }
            for call in session.calls
        ],
    }


def to_arrow(sessions: Sequence[Session]) -> pa.RecordBatch:
    """Sessions as one Arrow record batch of :func:`dew_pipe.batches.sessions_schema`.

    Args:
        sessions: the records, in order. Routing records, when any call has them, must share
            ``[layers, top_k]`` and dtype (the schema carries them).

    Returns:
        One row per session.

    Raises:
        TypeError: not a sequence of Session.
        ValueError: routing records of different shapes or dtypes, or a value the wire
            format cannot hold (a group or version beyond int32).

    Example:
        >>> s = Session(3, 0, 1, 0, [Call([1, 2], [3], [-0.5], "stop", 0)], "COMPLETED", 1.0)
        >>> to_arrow([s]).column("task_id").to_pylist()
        [3]
    """
    check_sessions(sessions)
    try:
        return sessions_to_arrow([session_row(session) for session in sessions])
    except pa.ArrowInvalid as error:  # e.g. an int32 column overflowing
        raise ValueError(f"sessions: a value does not fit the sessions schema: {error}") from error


def from_arrow(batch: pa.RecordBatch) -> list[Session]:
    """Sessions from a record batch of :func:`dew_pipe.batches.sessions_schema`.

    Args:
        batch: a sessions batch (from :func:`to_arrow`, a stage, or a Parquet file).

    Returns:
        The records; their arrays are read-only views of the batch's buffers.

    Raises:
        TypeError, ValueError: a batch of another schema, or a row that fails the
            validation of :class:`Session` / :class:`Call` (the error names the session).

    Example:
        >>> s = Session(3, 0, 1, 0, [Call([1, 2], [3], [-0.5], "stop", 0)], "COMPLETED", 1.0)
        >>> from_arrow(to_arrow([s])) == [s]
        True
    """
    out = []
    for i, row in enumerate(sessions_from_arrow(batch)):
        try:
            calls = [
                Call(
                    c["prompt_ids"],
                    c["sampled_ids"],
                    c["behavior_log_probs"],
                    c["finish_reason"],
                    c["version"],
                    log_probs=c["raw_log_probs"],
                    routed_experts=c.get("routed_experts"),
                    support=c["support"],
                )
                for c in row["calls"]
            ]
            out.append(
                Session(
                    row["task_id"],
                    row["group"],
                    row["sample"],
                    row["attempt"],
                    calls,
                    row["status"],
                    row["reward"],
                    row["components"],
                    row["detail"],
                )
            )
        except (TypeError, ValueError) as error:
            raise type(error)(f"sessions batch row {i}: {error}") from error
    return out


def task_row(task: Task) -> dict[str, Any]:
    """A :class:`Task` as a row of the tasks batch (:data:`dew_pipe.batches.TASKS_SCHEMA`).

    ``Task.data`` must be None (a task known by its id) or a mapping with any of
    ``prompt`` (token ids), ``data_source``, ``ground_truth`` and ``extra_info`` (text),
    as :func:`dew_pipe.objectives.rl.prompt_tasks` makes them.

    Raises:
      TypeError: ``data`` of another kind.
      ValueError: a mapping with other keys.

    Example:
      >>> task_row(Task(4, {"prompt": [1, 2], "ground_truth": "7"}))["ground_truth"]
      '7'
    """
    row: dict[str, Any] = {"task_id": task.id}
    if task.data is None:
        return row
    if not isinstance(task.data, Mapping):
        raise TypeError(
            f"Task.data of task {task.id} is a {type(task.data).__name__}; tasks cross stages "
            "as Arrow rows, so expected None or a mapping of prompt, data_source, "
            "ground_truth, extra_info"
        )
    unknown = sorted(set(task.data) - {"prompt", *_TASK_TEXT})
    if unknown:
        raise ValueError(
            f"Task.data of task {task.id} has key {unknown[0]!r}; expected only prompt, "
            "data_source, ground_truth and extra_info"
        )
    row.update(task.data)
    return row


def task_from_row(row: Mapping[str, Any]) -> Task:
    """The :class:`Task` a tasks-batch row stands for (the inverse of :func:`task_row`).

    A row with no prompt and empty metadata is an id-only task (``data`` None); any other
    row gives ``data = {"prompt", "data_source", "ground_truth", "extra_info"}``.

    Example:
      >>> task_from_row({"task_id": 3, "prompt": None, "data_source": "",
      ...                "ground_truth": "", "extra_info": ""})
      Task(id=3, data=None)
    """
    text = {k: row.get(k, "") or "" for k in _TASK_TEXT}
    prompt = row.get("prompt")
    if prompt is None and not any(text.values()):
        return Task(int(row["task_id"]), None)
    return Task(int(row["task_id"]), {"prompt": prompt, **text})
