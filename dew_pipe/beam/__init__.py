"""Apache Beam transforms for offline jobs on recorded sessions: read, pack, journal.

They reuse the functions of the streaming path (``pack``, ``compute_advantages``, the Arrow
sessions and packed-rows formats of :mod:`dew_pipe.batches`) and run on Beam's local
runners here, or on Flink, Spark or Dataflow when one machine is not enough.

* :class:`ReadSessions`: JSON lines and Parquet files of sessions into a PCollection.
* :class:`ReadVerlRows`: JSON lines of verl agent-loop rows, as sessions.
* :class:`PackSessions`: group by (task, group), compute advantages, cut batches, ``pack``.
* :class:`WritePacked`: one Parquet file per packed batch plus a manifest of every session.
* :class:`JournalSessions`: sessions to sharded Parquet files of the sessions schema.
* :func:`run_pack_job`: the whole job (also ``dew-pipe pack``).

Importing this package imports Apache Beam (about a second); nothing else in dew_pipe does.
"""

from dew_pipe.beam.job import PackSummary, read_manifest, read_packed, run_pack_job
from dew_pipe.beam.journal import JournalSessions
from dew_pipe.beam.packing import (
    MANIFEST_SCHEMA,
    PackedBatch,
    PackSessions,
    ScoredGroup,
    WritePacked,
    score_group,
)
from dew_pipe.beam.sources import ReadSessions, SessionDataError, session_to_json
from dew_pipe.beam.verl_source import ReadVerlRows

__all__ = [
    "MANIFEST_SCHEMA",
    "JournalSessions",
    "PackSessions",
    "PackSummary",
    "PackedBatch",
    "ReadSessions",
    "ReadVerlRows",
    "ScoredGroup",
    "SessionDataError",
    "WritePacked",
    "read_manifest",
    "read_packed",
    "run_pack_job",
    "score_group",
    "session_to_json",
]
