"""Journal rollouts: write sessions to Parquet files of the sessions schema.

The files are what :func:`dew_pipe.objectives.rl.sessions.to_arrow` produces, sharded:
``dew_pipe.batches.read_parquet`` + ``from_arrow`` read them in process, and
:class:`dew_pipe.beam.ReadSessions` reads them back into a pipeline (for instance to pack
them offline with :class:`dew_pipe.beam.PackSessions`).

The rollout journal that lets a resumed ``RolloutScheduler`` replay its in-flight sessions
(:mod:`dew_pipe.stages.journal`) writes files of this same format from the running
pipeline, one per chunk, with each session's stamps in the Parquet schema metadata;
``ReadSessions`` reads them too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import apache_beam as beam
import pyarrow as pa

from dew_pipe import batches
from dew_pipe._validate import check_int
from dew_pipe.beam.sources import SessionDataError, convert_rows
from dew_pipe.objectives.rl.session_arrow import session_row
from dew_pipe.objectives.rl.sessions import Session
from dew_pipe.rollout_batches import routing_spec

__all__ = ["JournalSessions"]


def sessions_table(sessions: Sequence[Session], routed_experts: Any = None) -> pa.Table:
    """Sessions as a table of ``sessions_schema(routed_experts=routed_experts)``.

    Raises:
        SessionDataError: a session the schema cannot hold (routing when none was declared,
            routing of another shape or dtype, a value beyond int32); names the session.
    """
    spec = None if routed_experts is None else routing_spec(routed_experts)
    rows = [(session_row(s), s) for s in sessions]
    if spec is None:
        for session in sessions:
            for j, call in enumerate(session.calls):
                if call.routed_experts is not None:
                    shape = [*call.routed_experts.shape[1:], str(call.routed_experts.dtype)]
                    raise SessionDataError(
                        f"journal: session ({session.describe()}): calls[{j}] recorded "
                        f"routed_experts, but the journal was declared without them; pass "
                        f"routed_experts=({shape[0]}, {shape[1]}, {shape[2]!r})"
                    )

    def convert(items):
        return [batches.sessions_to_arrow([row for row, _ in items], routed_experts=spec)]

    parts = convert_rows(rows, convert, lambda item: "journal")
    return pa.Table.from_batches(parts, schema=batches.sessions_schema(routed_experts=spec))


class JournalSessions(beam.PTransform):
    """Write a PCollection of sessions to sharded Parquet files of the sessions schema.

    Args:
        file_path_prefix: where the shards go: ``PREFIX-SSSSS-of-NNNNN.parquet``.
        routed_experts: ``(layers, top_k, dtype)`` when calls record routing (every record
            must then have that shape and dtype); None when none do.
        num_shards: number of files; 0 lets the runner choose.
        batch_size: most sessions per Arrow batch (a Parquet row group holds one or more).

    Returns:
        (from ``expand``) a PCollection of the written file names.

    Raises:
        TypeError, ValueError: (when built) a bad argument.
        SessionDataError: (when run) a session the schema cannot hold; names the session.

    Example:
        >>> import glob, os, tempfile
        >>> from dew_pipe.objectives.rl.sessions import Call, from_arrow
        >>> s = Session(3, 0, 1, 0, [Call([1, 2], [3], [-0.5], "stop", 0)], "COMPLETED", 1.0)
        >>> prefix = os.path.join(tempfile.mkdtemp(), "sessions")
        >>> with beam.Pipeline("FnApiRunner") as p:
        ...     _ = p | beam.Create([s]) | JournalSessions(prefix, num_shards=1)
        >>> [path] = glob.glob(prefix + "-*.parquet")
        >>> from_arrow(batches.read_parquet(path).to_batches()[0]) == [s]
        True
    """

    def __init__(
        self,
        file_path_prefix: str,
        *,
        routed_experts: tuple[int, int, Any] | None = None,
        num_shards: int = 0,
        batch_size: int = 256,
    ) -> None:
        super().__init__()
        if not isinstance(file_path_prefix, str) or not file_path_prefix:
            raise ValueError(f"file_path_prefix: expected a path, got {file_path_prefix!r}")
        self.spec = None if routed_experts is None else routing_spec(routed_experts)
        self.num_shards = check_int("num_shards", num_shards, minimum=0)
        self.batch_size = check_int("batch_size", batch_size, minimum=1)
        self.prefix = file_path_prefix

    def expand(self, sessions: beam.PCollection) -> beam.PCollection:
        return (
            sessions
            | "Batch" >> beam.BatchElements(min_batch_size=1, max_batch_size=self.batch_size)
            | "ToArrow" >> beam.Map(sessions_table, self.spec)
            | "Write"
            >> beam.io.WriteToParquetBatched(
                self.prefix,
                batches.sessions_schema(routed_experts=self.spec),
                file_name_suffix=".parquet",
                num_shards=self.num_shards,
                use_compliant_nested_type=True,
            )
        )
