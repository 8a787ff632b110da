"""Metrics over a batch of sessions and the packed rows built from them: :func:`session_metrics`.

It counts chains and training sessions by the rules of :mod:`~dew_pipe.objectives.rl.packing`
(``session_chains``, ``trains``), so the figures describe exactly what ``pack`` trained on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dew_pipe._validate import check_int
from dew_pipe.objectives.rl.packing import check_truncation, session_chains, trains
from dew_pipe.objectives.rl.session_records import Session, Status, check_sessions

__all__ = ["session_metrics"]

_QUANTILES = (("p50", 50.0), ("p90", 90.0), ("p99", 99.0))
_STATUSES = tuple(Status)
_STATUS_CODE = {status: code for code, status in enumerate(_STATUSES)}


def session_metrics(
    sessions: Sequence[Session],
    batch: Mapping[str, np.ndarray],
    latencies: Sequence[float] | None = None,
    version: int | None = None,
    truncation: str = "mask",
) -> dict[str, float]:
    """Summarize sessions and their packed batch for logging.

    Keys (a key whose population is empty is left out):

    - ``sessions/count``, ``sessions/<status>``: how many sessions, by status.
    - ``chains/count``, ``chains/calls_per_chain``: strict chains over all sessions' calls and
      the mean number of calls each holds (1.0 means no call extended the previous one).
    - ``masked/all``, ``masked/<status>``: share of sampled ids that carry no loss in
      ``batch`` (``response_mask`` 0 or absent), overall and by status.
    - ``reward/mean``: mean verifier reward of sessions that have one;
      ``reward/trained_mean``: mean reward the batch trains on (after ``truncation``);
      ``reward/component/<name>``: mean of each reward component.
    - ``latency/p50``, ``/p90``, ``/p99``, ``/max``: seconds, when ``latencies`` is given.
    - ``version/lag_mean``, ``version/lag_max``, ``version/oldest``: updates between
      ``version`` and each session's oldest call, when ``version`` is given.
    - ``pack/rows``, ``pack/fill``: rows of the batch and the share of its ids that are real.

    Args:
        sessions: the sessions ``batch`` was packed from, in the same order.
        batch: the packed columns (``response_mask``, ``session_index``,
            ``text_segment_ids`` are read).
        latencies: seconds from submission to finish, one per session.
        version: the trainer's current policy version.
        truncation: the mode the batch was packed with.

    Returns:
        ``{name: float}``.

    Raises:
        TypeError: not a sequence of Session, or a ``version`` that is not an int.
        ValueError: an unknown ``truncation``, a negative ``version``, misaligned latencies, a negative or non-finite latency, a session
            version newer than ``version``, or a batch that does not match the sessions.

    Example:
        >>> from dew_pipe.objectives.rl.sessions import Call, pack
        >>> s = [Session(0, 0, k, 0, [Call([1], [2, 3], [-1.0, -1.0], "stop", 2)],
        ...              "COMPLETED" if k else "TRUNCATED", float(k)) for k in range(2)]
        >>> m = session_metrics(s, pack(s, 8), version=3)
        >>> m["masked/truncated"], m["masked/completed"], m["version/lag_max"]
        (1.0, 0.0, 1.0)
    """
    check_sessions(sessions)
    check_truncation(truncation)
    metrics: dict[str, float] = {"sessions/count": float(len(sessions))}
    for status in Status:
        metrics[f"sessions/{status.value}"] = float(sum(s.status is status for s in sessions))
    chains = sum(len(session_chains(s.calls)) for s in sessions)
    calls = sum(len(s.calls) for s in sessions)
    metrics["chains/count"] = float(chains)
    if chains:
        metrics["chains/calls_per_chain"] = calls / chains
    metrics.update(_masked(sessions, batch))
    metrics.update(_rewards(sessions, truncation))
    if latencies is not None:
        metrics.update(_latency(sessions, latencies))
    if version is not None:
        metrics.update(_lag(sessions, version))
    return metrics


def _masked(sessions: Sequence[Session], batch: Mapping[str, np.ndarray]) -> dict[str, float]:
    for name in ("response_mask", "session_index", "text_segment_ids"):
        if name not in batch:
            raise ValueError(f"batch: expected a packed batch with column {name!r}")
    mask = np.asarray(batch["response_mask"]) != 0
    index = np.asarray(batch["session_index"])
    if index.shape != mask.shape:
        raise ValueError(
            f"batch['session_index']: expected shape {mask.shape} like response_mask, "
            f"got {index.shape}"
        )
    trained_ids = index[mask]
    if trained_ids.size and (trained_ids.min() < 0 or trained_ids.max() >= len(sessions)):
        raise ValueError(
            f"batch['session_index']: expected indices in [0, {len(sessions)}) on sampled ids, "
            f"got {trained_ids.min()}..{trained_ids.max()}; was it packed from these sessions?"
        )
    trained = np.bincount(trained_ids, minlength=len(sessions))
    sampled = np.array([sum(c.sampled_ids.size for c in s.calls) for s in sessions], np.int64)
    if np.any(trained > sampled):
        i = int(np.argmax(trained > sampled))
        raise ValueError(
            f"batch: holds {trained[i]} sampled ids of sessions[{i}], which has {sampled[i]}; "
            f"was it packed from these sessions?"
        )
    segments = np.asarray(batch["text_segment_ids"])
    out = {"pack/rows": float(segments.shape[0]) if segments.ndim else 0.0}
    if segments.size:
        out["pack/fill"] = float(np.count_nonzero(segments) / segments.size)
    if sampled.sum():
        out["masked/all"] = float(1.0 - trained.sum() / sampled.sum())
    # Per-status sums of integer counts (exact in float64 far beyond any batch).
    codes = np.fromiter((_STATUS_CODE[s.status] for s in sessions), np.intp, len(sessions))
    by_status = np.bincount(codes, weights=sampled, minlength=len(_STATUSES))
    trained_by_status = np.bincount(codes, weights=trained, minlength=len(_STATUSES))
    for code, status in enumerate(_STATUSES):
        total = int(by_status[code])
        if total:
            kept = int(trained_by_status[code])
            out[f"masked/{status.value}"] = float(1.0 - kept / total)
    return out


def _rewards(sessions: Sequence[Session], truncation: str) -> dict[str, float]:
    out: dict[str, float] = {}
    scored = [s.reward for s in sessions if s.reward is not None]
    if scored:
        out["reward/mean"] = float(np.mean(scored))
    trained = [
        0.0 if s.status is Status.TRUNCATED and truncation == "zero" else s.reward
        for s in sessions
        if trains(s, truncation)
    ]
    if trained and all(r is not None for r in trained):
        out["reward/trained_mean"] = float(np.mean(trained))
    names = sorted({name for s in sessions for name in s.components})
    for name in names:
        values = [s.components[name] for s in sessions if name in s.components]
        out[f"reward/component/{name}"] = float(np.mean(values))
    return out


def _latency(sessions: Sequence[Session], latencies: Any) -> dict[str, float]:
    seconds = np.asarray(latencies, dtype=np.float64)
    if seconds.shape != (len(sessions),):
        raise ValueError(
            f"latencies: expected one per session, shape ({len(sessions)},), got {seconds.shape}"
        )
    if not np.all(np.isfinite(seconds)) or (seconds.size and seconds.min() < 0):
        raise ValueError(f"latencies: expected finite seconds >= 0, got {seconds.tolist()}")
    if not seconds.size:
        return {}
    values = np.percentile(seconds, [q for _, q in _QUANTILES])
    out = {f"latency/{name}": float(v) for (name, _), v in zip(_QUANTILES, values, strict=True)}
    out["latency/max"] = float(seconds.max())
    return out


def _lag(sessions: Sequence[Session], version: Any) -> dict[str, float]:
    version = check_int("version", version, minimum=0)
    oldest = np.array([min(c.version for c in s.calls) for s in sessions if s.calls], np.int64)
    if not oldest.size:
        return {}
    if oldest.max() > version:
        raise ValueError(
            f"version: a session has a call of version {oldest.max()}, newer than the "
            f"current version {version}"
        )
    lag = version - oldest
    return {
        "version/lag_mean": float(lag.mean()),
        "version/lag_max": float(lag.max()),
        "version/oldest": float(oldest.min()),
    }
