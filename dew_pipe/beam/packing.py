"""Group, score and pack sessions in a Beam pipeline, with the functions the streaming path uses.

**Steps.** Sessions are keyed by (task, group) and grouped; :func:`score_group` checks each
group against the rules of :func:`~dew_pipe.objectives.rl.sessions.pack` (no chain longer
than the width, a reward on every session that trains, no session twice) and computes its
advantages with :func:`~dew_pipe.objectives.rl.advantages.compute_advantages`. Groups are
then cut into batches and each batch is packed by ``pack`` itself.

**Batches.** Packing first-fit decreasing into ``[rows, width]`` needs a batch's chains in
one place, so batching is the job's one global decision. It is made deterministically: the
(task, group) keys of all groups are collected (keys only, a few bytes per group) and
sorted; batch ``b`` holds the groups of ranks ``[b * G, (b + 1) * G)`` for
``groups_per_batch=G`` (every group in one batch when G is None). Groups are never split,
so group-relative advantages are the same however the input is batched.

**What equals what.** Within a batch, sessions are ordered by (task, group, sample,
attempt), and the batch is exactly ``pack(those sessions, width, rows, estimator,
truncation, support_capacity)``: every column, array for array. That ordering is what
``session_index`` refers to; the manifest (:data:`MANIFEST_SCHEMA`) maps each
``(batch, session_index)`` back to its session. Against ``pack`` on the same sessions in
any other order, the batch holds the same chains (ids, mask, likelihoods, advantages,
versions, weights and the session and call of every sampled id) in the same number of
rows; only which row, and where in it, a chain lands can differ, since first-fit
decreasing breaks ties between equal lengths by order. And since advantages are computed
within groups, the chains of all batches together are the chains ``pack`` gives on the
whole input at once.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import re
from collections.abc import Iterable, Iterator
from typing import Any

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from apache_beam.io.filesystems import FileSystems
from apache_beam.metrics import Metrics

from dew_pipe._validate import check_int
from dew_pipe.beam.sources import METRICS_NAMESPACE, SessionDataError
from dew_pipe.objectives.rl.advantages import ESTIMATORS, compute_advantages
from dew_pipe.objectives.rl.packing import TRUNCATIONS, pack, session_chains, trains
from dew_pipe.objectives.rl.session_arrow import session_row
from dew_pipe.objectives.rl.sessions import Session, Status

__all__ = [
    "MANIFEST_SCHEMA",
    "PackSessions",
    "PackedBatch",
    "ScoredGroup",
    "WritePacked",
    "packed_name",
    "score_group",
]

#: One row per input session: where it went and what it trained on.
MANIFEST_SCHEMA = pa.schema(
    [
        pa.field("task_id", pa.int64(), False),
        pa.field("group", pa.int32(), False),
        pa.field("sample", pa.int32(), False),
        pa.field("attempt", pa.int32(), False),
        pa.field("status", pa.string(), False),
        pa.field("reward", pa.float64()),  # null: never scored
        pa.field("trains", pa.bool_(), False),  # takes part in its group's baseline
        pa.field("advantage", pa.float32()),  # null when it does not train
        pa.field("chains", pa.int32(), False),  # chains it put in the rows (0 unless trains)
        pa.field("batch", pa.int32(), False),  # which packed file
        pa.field("session_index", pa.int32(), False),  # its session_index in that file
    ]
)


# The manifest's columns that are the session's own, written as the sessions batch writes them.
_SESSION_COLUMNS = ("task_id", "group", "sample", "attempt", "status", "reward")


@dataclasses.dataclass(frozen=True)
class ScoredGroup:
    """The sessions of one (task, group), checked and scored.

    Attributes:
        task: the task id.
        group: the group number.
        sessions: the group's sessions ordered by (sample, attempt).
        advantages: one per session; None for a session that does not train.
        chains: chains each session puts in the rows (0 for one that does not train).
    """

    task: int
    group: int
    sessions: tuple[Session, ...]
    advantages: tuple[float | None, ...]
    chains: tuple[int, ...]

    @property
    def key(self) -> tuple[int, int]:
        """``(task, group)``, the order batches are cut in."""
        return (self.task, self.group)


def score_group(
    sessions: Iterable[Session],
    *,
    width: int,
    estimator: str = "group",
    truncation: str = "mask",
) -> ScoredGroup:
    """Check one group's sessions against ``pack``'s rules and compute their advantages.

    Args:
        sessions: every session of one (task, group), in any order.
        width: the row width; a longer chain is an error.
        estimator: ``"group"``, ``"mean"`` or ``"rloo"``.
        truncation: ``"mask"``, ``"score"`` or ``"zero"`` for TRUNCATED sessions.

    Returns:
        The group, ordered by (sample, attempt), with the advantages ``pack`` gives it.

    Raises:
        SessionDataError: a session appears twice, a chain is longer than ``width``, or a
            session that trains has no reward; names the session.
        ValueError: no sessions, or sessions of different groups.

    Example:
        >>> from dew_pipe.objectives.rl.sessions import Call
        >>> call = Call([5, 6], [7, 2], [-0.2, -0.1], "stop", version=3)
        >>> group = score_group([Session(0, 0, s, 0, [call], "COMPLETED", float(s))
        ...                      for s in (1, 0)], width=8)
        >>> [round(a, 4) for a in group.advantages]
        [-0.7071, 0.7071]
    """
    ordered = sorted(sessions, key=lambda s: (s.sample, s.attempt))
    if not ordered:
        raise ValueError("sessions: expected at least one session of the group, got none")
    key = (ordered[0].task, ordered[0].group)
    chains, rewards = [], []
    for k, session in enumerate(ordered):
        if (session.task, session.group) != key:
            raise ValueError(
                f"sessions: expected one (task, group), got {key} and "
                f"{(session.task, session.group)}"
            )
        if k and (session.sample, session.attempt) == (
            ordered[k - 1].sample,
            ordered[k - 1].attempt,
        ):
            raise SessionDataError(f"session ({session.describe()}): appears twice in the input")
        if not trains(session, truncation):
            chains.append(0)
            continue
        chains.append(_check_chains(session, width))
        if session.status is Status.TRUNCATED and truncation == "zero":
            rewards.append(0.0)
        elif session.reward is None:
            raise SessionDataError(
                f"session ({session.describe()}): reward is None, but a session that trains "
                "needs its verifier reward"
            )
        else:
            rewards.append(session.reward)
    scored = iter(compute_advantages(np.asarray(rewards), np.zeros(len(rewards)), estimator))
    advantages = tuple(float(next(scored)) if trains(s, truncation) else None for s in ordered)
    return ScoredGroup(key[0], key[1], tuple(ordered), advantages, tuple(chains))


def _check_chains(session: Session, width: int) -> int:
    """Number of chains the session makes; raises for one longer than ``width``."""
    chains = session_chains(session.calls)
    for chain in chains:
        length = session.calls[chain[-1]].length
        if length > width:
            raise SessionDataError(
                f"session ({session.describe()}): calls {chain[0]}..{chain[-1]} form a chain "
                f"of {length} ids, longer than width {width}"
            )
    return len(chains)


@dataclasses.dataclass(frozen=True)
class PackedBatch:
    """One packed training batch and the manifest rows of its sessions.

    Attributes:
        index: the batch's number, from 0.
        count: how many batches the job makes.
        rows: the packed rows (:func:`dew_pipe.batches.packed_schema`), exactly what
            ``pack(..., arrow=True)`` returns for the batch's sessions in manifest order.
        manifest: one :data:`MANIFEST_SCHEMA` row per session, by ``session_index``.
    """

    index: int
    count: int
    rows: pa.RecordBatch
    manifest: tuple[dict[str, Any], ...]


def packed_name(index: int, count: int) -> str:
    """File name of batch ``index`` of ``count``: ``packed-00003-of-00010.parquet``."""
    return f"packed-{index:05d}-of-{count:05d}.parquet"


def pack_groups(
    index: int,
    count: int,
    groups: Iterable[ScoredGroup],
    *,
    width: int,
    rows: int | None,
    estimator: str,
    truncation: str,
    support_capacity: int | None,
) -> PackedBatch:
    """Pack the groups of one batch with ``pack``; errors name the batch and the session."""
    ordered = sorted(groups, key=lambda g: g.key)
    sessions = [s for g in ordered for s in g.sessions]
    try:
        packed = pack(sessions, width, rows, estimator, truncation, support_capacity, arrow=True)
    except ValueError as error:
        message = re.sub(
            r"sessions\[(\d+)\]",
            lambda m: f"session ({sessions[int(m.group(1))].describe()})",
            str(error),
        )
        where = f"batch {index} (groups {ordered[0].key}..{ordered[-1].key})"
        raise SessionDataError(f"{where}: {message}") from error
    manifest = []
    for group in ordered:
        for session, advantage, chains in zip(
            group.sessions, group.advantages, group.chains, strict=True
        ):
            row = session_row(session)
            manifest.append(
                {
                    **{name: row[name] for name in _SESSION_COLUMNS},
                    "trains": advantage is not None,
                    "advantage": advantage,
                    "chains": chains,
                    "batch": index,
                    "session_index": len(manifest),
                }
            )
    return PackedBatch(index, count, packed, tuple(manifest))


class _Score(beam.DoFn):
    def __init__(self, width: int, estimator: str, truncation: str) -> None:
        self.options = {"width": width, "estimator": estimator, "truncation": truncation}
        self.groups = Metrics.counter(METRICS_NAMESPACE, "groups")

    def process(self, element: tuple[tuple[int, int], Iterable[Session]]) -> Iterator[ScoredGroup]:
        self.groups.inc()
        yield score_group(element[1], **self.options)


def _assign(group: ScoredGroup, keys: list[tuple[int, int]], per_batch: int | None):
    """``(batch, (count, group))`` from the group's rank among all sorted keys."""
    if per_batch is None:
        return 0, (1, group)
    rank = bisect.bisect_left(keys, group.key)
    return rank // per_batch, (math.ceil(len(keys) / per_batch), group)


class _Pack(beam.DoFn):
    def __init__(self, **options: Any) -> None:
        self.options = options
        self.counters = {
            name: Metrics.counter(METRICS_NAMESPACE, name)
            for name in ("batches", "rows", "tokens", "chains", "sessions", "trained")
        }

    def process(self, element: tuple[int, Iterable[tuple[int, ScoredGroup]]]):
        index, members = element
        members = list(members)
        batch = pack_groups(index, members[0][0], [g for _, g in members], **self.options)
        segments = batch.rows.column("text_segment_ids").flatten().to_numpy()
        for name, value in (
            ("batches", 1),
            ("rows", batch.rows.num_rows),
            ("tokens", int(np.count_nonzero(segments))),
            ("chains", sum(row["chains"] for row in batch.manifest)),
            ("sessions", len(batch.manifest)),
            ("trained", sum(row["trains"] for row in batch.manifest)),
        ):
            self.counters[name].inc(value)
        yield batch


def _key(session: Session) -> tuple[tuple[int, int], Session]:
    return (session.task, session.group), session


class PackSessions(beam.PTransform):
    """Sessions to packed training batches: group, score, cut into batches, ``pack``.

    Args:
        width: ids per row.
        rows: rows of every batch (unused ones all padding); None: as many as each
            batch's chains need.
        groups_per_batch: (task, group) groups per batch, cut in sorted key order; None
            puts every group in one batch.
        estimator: ``"group"`` (GRPO), ``"mean"`` (Dr.GRPO) or ``"rloo"``.
        truncation: ``"mask"``, ``"score"`` or ``"zero"`` for TRUNCATED sessions.
        support_capacity: as ``pack``'s; required when calls recorded supports.

    Returns:
        (from ``expand``) a PCollection of :class:`PackedBatch`.

    Raises:
        TypeError, ValueError: (when built) a bad argument.
        SessionDataError: (when run) a session twice, a chain longer than ``width``, a
            training session without reward, a batch needing more than ``rows`` rows.

    Example:
        >>> from dew_pipe.objectives.rl.sessions import Call
        >>> call = Call([5, 6], [7, 2], [-0.2, -0.1], "stop", version=3)
        >>> sessions = [Session(0, 0, s, 0, [call], "COMPLETED", float(s)) for s in (0, 1)]
        >>> with beam.Pipeline("FnApiRunner") as p:
        ...     _ = (p | beam.Create(sessions) | PackSessions(width=8)
        ...          | beam.Map(lambda b: print(b.rows.num_rows, len(b.manifest))))
        1 2
    """

    def __init__(
        self,
        *,
        width: int,
        rows: int | None = None,
        groups_per_batch: int | None = None,
        estimator: str = "group",
        truncation: str = "mask",
        support_capacity: int | None = None,
    ) -> None:
        super().__init__()
        width = check_int("width", width, minimum=1)
        for name, value in (
            ("rows", rows),
            ("groups_per_batch", groups_per_batch),
            ("support_capacity", support_capacity),
        ):
            check_int(name, value, minimum=1, allow_none=True)
        if estimator not in ESTIMATORS:
            raise ValueError(f"estimator: expected one of {sorted(ESTIMATORS)}, got {estimator!r}")
        if truncation not in TRUNCATIONS:
            raise ValueError(f"truncation: expected one of {list(TRUNCATIONS)}, got {truncation!r}")
        self.width, self.groups_per_batch = width, groups_per_batch
        self.estimator, self.truncation = estimator, truncation
        self.rows, self.support_capacity = rows, support_capacity

    def expand(self, sessions: beam.PCollection) -> beam.PCollection:
        groups = (
            sessions
            | "KeyByGroup" >> beam.Map(_key)
            | "GroupByTaskGroup" >> beam.GroupByKey()
            | "Score" >> beam.ParDo(_Score(self.width, self.estimator, self.truncation))
        )
        keys = (
            groups
            | "Keys" >> beam.Map(lambda g: g.key)
            | "AllKeys" >> beam.combiners.ToList()
            | "SortKeys" >> beam.Map(sorted)
        )
        options = {
            "width": self.width,
            "rows": self.rows,
            "estimator": self.estimator,
            "truncation": self.truncation,
            "support_capacity": self.support_capacity,
        }
        return (
            groups
            | "AssignBatch"
            >> beam.Map(_assign, beam.pvalue.AsSingleton(keys), self.groups_per_batch)
            | "GroupByBatch" >> beam.GroupByKey()
            | "Pack" >> beam.ParDo(_Pack(**options))
        )


class _WriteBatch(beam.DoFn):
    """Writes one batch to ``output/packed-BBBBB-of-NNNNN.parquet``; yields the path.

    Written under a temporary name and renamed, through Beam's file systems; the content is
    a function of the input, so a retried bundle writes the same file again.
    """

    def __init__(self, output: str) -> None:
        self.output = output

    def process(self, batch: PackedBatch) -> Iterator[str]:
        path = FileSystems.join(self.output, packed_name(batch.index, batch.count))
        temporary = f"{path}.partial"
        handle = FileSystems.create(temporary)
        try:
            pq.write_table(pa.Table.from_batches([batch.rows]), handle)
        finally:
            handle.close()
        FileSystems.rename([temporary], [path])
        yield path


class WritePacked(beam.PTransform):
    """Write packed batches: one Parquet file per batch and a manifest of every session.

    ``output/packed-BBBBB-of-NNNNN.parquet`` holds batch B exactly as ``pack`` returned it
    (the packed-rows schema, nothing added, so ``dew_pipe.batches.read_parquet`` and
    ``packed_from_arrow`` read it as a training batch); ``output/manifest-*.parquet``
    (:data:`MANIFEST_SCHEMA`) says which session each ``(batch, session_index)`` is.

    Args:
        output: the folder (any file system Beam knows); it must exist.

    Returns:
        (from ``expand``) a PCollection of the packed files' paths.

    Example:
        >>> import os, tempfile
        >>> from dew_pipe.objectives.rl.sessions import Call
        >>> call = Call([5, 6], [7, 2], [-0.2, -0.1], "stop", version=3)
        >>> out = tempfile.mkdtemp()
        >>> with beam.Pipeline("FnApiRunner") as p:
        ...     _ = (p | beam.Create([Session(0, 0, 0, 0, [call], "COMPLETED", 1.0)])
        ...          | PackSessions(width=8) | WritePacked(out))
        >>> sorted(os.listdir(out))
        ['manifest-00000-of-00001.parquet', 'packed-00000-of-00001.parquet']
    """

    def __init__(self, output: str) -> None:
        super().__init__()
        self.output = output

    def expand(self, batches: beam.PCollection) -> beam.PCollection:
        _ = (
            batches
            | "ManifestRows" >> beam.FlatMap(lambda batch: batch.manifest)
            | "WriteManifest"
            >> beam.io.WriteToParquet(
                FileSystems.join(self.output, "manifest"),
                MANIFEST_SCHEMA,
                file_name_suffix=".parquet",
            )
        )
        return batches | "WriteBatches" >> beam.ParDo(_WriteBatch(self.output))
