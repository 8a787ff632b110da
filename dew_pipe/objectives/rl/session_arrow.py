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

import numpy as np
import pyarrow as pa

from dew_pipe.objectives.rl.session_records import (
    Call,
    Session,
    Status,
    Task,
    assemble,
    check_sessions,
)
from dew_pipe.rollout_batches import (
    SESSION_STATUSES,
    assemble_sessions,
    check_sessions_batch,
    sessions_from_arrow,
)

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
    # A Session checked every field when it was made, so its rows skip the row checks of
    # sessions_to_arrow (half the cost of writing a batch); only what the records leave
    # open is checked here: routing shapes must agree across calls, ints must fit int32.
    rows = [session_row(session) for session in sessions]
    routing = _routing(rows)
    try:
        return assemble_sessions(rows, routing)
    except pa.ArrowInvalid as error:  # e.g. an int32 column overflowing
        raise ValueError(f"sessions: a value does not fit the sessions schema: {error}") from error


def _routing(rows: list[dict[str, Any]]) -> tuple[int, int, np.dtype] | None:
    """``(layers, top_k, dtype)`` the calls' routing records share, or None when none has one.

    Raises:
        ValueError: a record of another ``[layers, top_k]`` or dtype than the first, naming
            the session and call.
    """
    routing = None
    for i, row in enumerate(rows):
        for j, call in enumerate(row["calls"]):
            routed = call["routed_experts"]
            if routed is None:
                continue
            spec = (routed.shape[1], routed.shape[2], routed.dtype)
            if routing is None:
                routing = spec
            elif spec != routing:
                raise ValueError(
                    f"session {i}: calls[{j}].routed_experts: has shape {list(routed.shape)} "
                    f"of {routed.dtype}, expected [n, {routing[0]}, {routing[1]}] of "
                    f"{routing[2]} like the first routed call (a batch carries one routing shape)"
                )
    return routing


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
    routing = check_sessions_batch(batch)
    fast = _columnar(batch, routing)
    return fast if fast is not None else _row_by_row(batch)


def _row_by_row(batch: pa.RecordBatch) -> list[Session]:
    """The records of a batch, each through the checks of :class:`Session` and :class:`Call`
    (what :func:`from_arrow` falls back to when a column check fails: it names the row)."""
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


# ----------------------------------------------------------------------------- columnar read

_STATUS = {name: Status[name] for name in SESSION_STATUSES}
_REQUIRED = ("task_id", "group", "sample", "attempt", "status", "components", "detail", "calls")


def _list_column(column: pa.ListArray, lo: int, hi: int):
    """``(values, offsets)`` of calls ``lo:hi`` of a list column, or None when the values
    hold nulls (the row-by-row reader then names them). Values are read-only views."""
    if column.values.null_count:
        return None
    values = column.values.to_numpy(zero_copy_only=False)
    values.flags.writeable = False  # a no-op on Arrow's own (zero-copy) buffers
    return values, column.offsets.to_numpy()[lo : hi + 1]


def _columnar(batch: pa.RecordBatch, routing: Any) -> list[Session] | None:
    """The records of a batch whose every value passes the record checks column by column,
    built without checking each record again; None when a column check fails or a call
    recorded support or routing (those are checked record by record).
    """
    if any(batch.column(name).null_count for name in _REQUIRED):
        return None
    calls = batch.column("calls")
    struct = calls.values
    call_offsets = calls.offsets.to_numpy()
    lo, hi = int(call_offsets[0]), int(call_offsets[-1])
    if struct.null_count:
        return None
    child = dict(zip([f.name for f in struct.type], struct.flatten(), strict=True))
    for name in ("prompt_ids", "sampled_ids", "behavior_log_probs", "finish_reason", "version"):
        if child[name].null_count:
            return None
    columns = {}
    for name in ("prompt_ids", "sampled_ids", "behavior_log_probs", "raw_log_probs"):
        columns[name] = _list_column(child[name], lo, hi)
        if columns[name] is None:
            return None
    prompt, prompt_at = columns["prompt_ids"]
    sampled, sampled_at = columns["sampled_ids"]
    behavior, behavior_at = columns["behavior_log_probs"]
    raw, raw_at = columns["raw_log_probs"]
    raw_valid = child["raw_log_probs"].is_valid().to_numpy(zero_copy_only=False)[lo:hi]
    lengths = np.diff(sampled_at)
    if (
        np.any(np.diff(prompt_at) < 1)
        or (prompt[prompt_at[0] : prompt_at[-1]] < 0).any()
        or (sampled[sampled_at[0] : sampled_at[-1]] < 0).any()
        or np.any(np.diff(behavior_at) != lengths)
        or not np.isfinite(behavior[behavior_at[0] : behavior_at[-1]]).all()
        or np.any(np.diff(raw_at)[raw_valid] != lengths[raw_valid])
        or not np.isfinite(raw[raw_at[0] : raw_at[-1]]).all()
    ):
        return None
    versions = child["version"].to_numpy()[lo:hi]
    if (versions < 0).any():
        return None
    reward = batch.column("reward")
    components = batch.column("components")
    scores = components.items
    if (
        (batch.column("sample").to_numpy() < 0).any()
        or (batch.column("attempt").to_numpy() < 0).any()
        or not np.isfinite(reward.fill_null(0.0).to_numpy()).all()
        or scores.null_count
        or not np.isfinite(scores.to_numpy(zero_copy_only=False)).all()
    ):
        return None
    statuses = batch.column("status").to_pylist()
    if not set(statuses) <= _STATUS.keys():
        return None

    # Support (distinct ids holding the sampled one) and routing lengths are per-record
    # questions: a batch that records either is read row by row.
    recorded = ["support"] + (["routed_experts"] if routing is not None else [])
    if any(child[name].is_valid().to_numpy(zero_copy_only=False)[lo:hi].any() for name in recorded):
        return None
    reasons = child["finish_reason"].to_pylist()[lo:hi]
    versions = versions.tolist()
    built = [
        assemble(
            Call,
            {
                "prompt_ids": prompt[prompt_at[j] : prompt_at[j + 1]],
                "sampled_ids": sampled[sampled_at[j] : sampled_at[j + 1]],
                "behavior_log_probs": behavior[behavior_at[j] : behavior_at[j + 1]],
                "finish_reason": reasons[j],
                "version": versions[j],
                "log_probs": raw[raw_at[j] : raw_at[j + 1]] if raw_valid[j] else None,
                "routed_experts": None,
                "support": None,
            },
        )
        for j in range(hi - lo)
    ]

    scalars = {name: batch.column(name).to_pylist() for name in ("task_id", "group", "sample")}
    attempts, rewards = batch.column("attempt").to_pylist(), reward.to_pylist()
    details, parts = batch.column("detail").to_pylist(), components.to_pylist()
    out = []
    for i in range(batch.num_rows):
        first, last = call_offsets[i] - lo, call_offsets[i + 1] - lo
        fields = {
            "task": scalars["task_id"][i],
            "group": scalars["group"][i],
            "sample": scalars["sample"][i],
            "attempt": attempts[i],
            "calls": tuple(built[first:last]),
            "status": _STATUS[statuses[i]],
            "reward": rewards[i],
            "components": dict(parts[i]),
            "detail": details[i],
        }
        out.append(assemble(Session, fields))
    return out
