"""Session records to and from the Arrow sessions batch of :mod:`dew_pipe.batches`.

The wire format (one row per session, its calls as a nested list) is defined there; this
module maps it onto :class:`~dew_pipe.objectives.rl.sessions.Session` and
:class:`~dew_pipe.objectives.rl.sessions.Call`. Reading back shares memory: every id,
likelihood and routing array of the returned calls is a read-only view of the batch's
buffers, and every record goes through the same validation as a live one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from dew_pipe import batches
from dew_pipe.objectives.rl.sessions import Call, Session

__all__ = ["from_arrow", "to_arrow"]


def _call_row(call: Call) -> dict[str, Any]:
    return {
        "prompt_ids": call.prompt_ids,
        "sampled_ids": call.sampled_ids,
        "behavior_log_probs": call.behavior_log_probs,
        "raw_log_probs": call.log_probs,
        "finish_reason": call.finish_reason,
        "version": call.version,
        "support": None if call.support is None else list(call.support),
        "routed_experts": call.routed_experts,
    }


def to_arrow(sessions: Sequence[Session]) -> pa.RecordBatch:
    """Sessions as one Arrow record batch of :func:`dew_pipe.batches.sessions_schema`.

    Args:
        sessions: the records, in order. Routing records, when any call has them, must share
            ``[layers, top_k]`` and dtype (the schema carries them).

    Returns:
        One row per session.

    Raises:
        TypeError: an element is not a Session.
        ValueError: routing records of different shapes or dtypes, or a value the wire
            format cannot hold (a group or version beyond int32).

    Example:
        >>> s = Session(3, 0, 1, 0, [Call([1, 2], [3], [-0.5], "stop", 0)], "COMPLETED", 1.0)
        >>> to_arrow([s]).column("task_id").to_pylist()
        [3]
    """
    rows = []
    for i, session in enumerate(sessions):
        if not isinstance(session, Session):
            raise TypeError(f"sessions[{i}]: expected a Session, got {type(session).__name__}")
        rows.append(
            {
                "task_id": session.task,
                "group": session.group,
                "sample": session.sample,
                "attempt": session.attempt,
                "status": session.status.name,
                "reward": session.reward,
                "components": dict(session.components),
                "detail": session.detail,
                "calls": [_call_row(call) for call in session.calls],
            }
        )
    try:
        return batches.sessions_to_arrow(rows)
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
    for i, row in enumerate(batches.sessions_from_arrow(batch)):
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
