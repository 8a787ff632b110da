"""Sessions into a Beam pipeline: JSON lines and Parquet files of the sessions schema.

Two file formats carry recorded sessions, told apart by their suffix:

* **JSON lines** (``.jsonl``, ``.ndjson``, optionally ``.gz``): one JSON object per line, with
  the fields :func:`dew_pipe.batches.sessions_to_arrow` takes (``task_id``, ``group``,
  ``sample``, ``attempt``, ``status``, ``reward``, ``components``, ``detail`` and ``calls``,
  each call with ``prompt_ids``, ``sampled_ids``, ``behavior_log_probs``, ``raw_log_probs``,
  ``finish_reason``, ``version``, ``support``, ``routed_experts``). :func:`session_to_json`
  writes exactly that object: ``session_row`` of :mod:`dew_pipe.objectives.rl.session_arrow`
  with its arrays as lists. JSON has no integer widths, so routing read from JSON lines is
  int64; likelihoods written from float32 read back bit for bit.
* **Parquet** (``.parquet``) of :func:`dew_pipe.batches.sessions_schema`: what
  :func:`dew_pipe.objectives.rl.sessions.to_arrow` produces and what
  :class:`dew_pipe.beam.JournalSessions` writes.

Every record goes through the validation of a live :class:`Session` / :class:`Call`. Lines
are converted in batches (one Arrow conversion per batch); when a batch fails, its rows are
converted one by one so the error names the file and the session that is wrong.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import apache_beam as beam
import pyarrow as pa
import pyarrow.parquet as pq
from apache_beam.io import fileio
from apache_beam.io.filesystems import FileSystems
from apache_beam.metrics import Metrics

from dew_pipe import batches
from dew_pipe.objectives.rl.session_arrow import from_arrow, session_row
from dew_pipe.objectives.rl.sessions import Session

__all__ = [
    "JSONL_SUFFIXES",
    "PARQUET_SUFFIXES",
    "ReadSessions",
    "SessionDataError",
    "convert_rows",
    "session_to_json",
]

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".jsonl.gz", ".ndjson.gz")
"""File name endings read as JSON lines (gzip by the ``.gz`` ending)."""
PARQUET_SUFFIXES = (".parquet",)
"""File name endings read as Parquet files of the sessions schema."""

METRICS_NAMESPACE = "dew_pipe.beam"
"""Namespace of the Beam counters the transforms of this package report."""

# Prefixes the record converters put before a message; replaced by the session's identity.
_ROW_PREFIX = re.compile(r"^(sessions batch row|session) \d+: ")


class SessionDataError(ValueError):
    """Input a job cannot use: a malformed file, a session that breaks a rule of ``pack``.

    The message names the file or batch and the session (task, group, sample, attempt) that
    is wrong. Raised inside a Beam worker, it reaches the caller of
    :func:`dew_pipe.beam.run_pack_job` as itself, without Beam's stack.
    """


def _plain(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def session_to_json(session: Session) -> dict[str, Any]:
    """A session as the JSON object of one line of a sessions ``.jsonl`` file.

    Args:
        session: the record.

    Returns:
        A mapping of plain Python values; ``json.dumps`` of it is one JSONL line that
        :class:`ReadSessions` reads back as an equal session (routing as int64).

    Example:
        >>> from dew_pipe.objectives.rl.sessions import Call
        >>> s = Session(3, 0, 1, 0, [Call([1, 2], [3], [-0.5], "stop", 0)], "COMPLETED", 1.0)
        >>> json.dumps(session_to_json(s))[:44]
        '{"task_id": 3, "group": 0, "sample": 1, "att'
    """
    row = session_row(session)
    row["calls"] = [{k: _plain(v) for k, v in call.items()} for call in row["calls"]]
    return row


def _identity(row: Mapping[str, Any] | None) -> str:
    """``session (task t, group g, sample s, attempt a)`` from whatever fields a row has."""
    row = row if isinstance(row, Mapping) else {}
    parts = [f"{name} {row.get(key, '?')}" for name, key in _IDENTITY]
    return f"session ({', '.join(parts)})"


_IDENTITY = (("task", "task_id"), ("group", "group"), ("sample", "sample"), ("attempt", "attempt"))


def _named(source: str, row: Mapping[str, Any] | None, error: Exception) -> SessionDataError:
    message = _ROW_PREFIX.sub("", str(error))
    return SessionDataError(f"{source}: {_identity(row)}: {message}")


def convert_rows(
    items: Sequence[tuple[Any, ...]],
    convert: Callable[[Sequence[tuple[Any, ...]]], list[Any]],
    source: Callable[[tuple[Any, ...]], str],
) -> list[Any]:
    """``convert(items)``, or on failure each item alone, raising for the first bad one.

    Each item is a tuple whose first entry maps the session's identity fields (``task_id``,
    ``group``, ``sample``, ``attempt``, whichever it has); ``convert`` gets whole items, and
    ``source(item)`` names where the item came from. The one-by-one pass makes the error
    name the session, and items that only fail together (routing of different shapes in one
    Arrow batch) still convert.
    """
    try:
        return convert(items)
    except (TypeError, ValueError, pa.ArrowException):
        pass
    out = []
    for item in items:
        try:
            out.extend(convert([item]))
        except (TypeError, ValueError, pa.ArrowException) as error:
            raise _named(source(item), item[0], error) from error
    return out


def _sessions_from_rows(items: Sequence[tuple[Mapping[str, Any], str]]) -> list[Session]:
    return from_arrow(batches.sessions_to_arrow([row for row, _ in items]))


def _parse_line(element: tuple[str, str]) -> Iterator[tuple[dict[str, Any], str]]:
    filename, line = element
    if not line.strip():
        return
    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        raise SessionDataError(
            f"{filename}: a line is not JSON ({error.msg}, column {error.colno}): {line[:60]!r}"
        ) from error
    if not isinstance(row, dict):
        raise SessionDataError(
            f"{filename}: expected one JSON object per line, got a {type(row).__name__}: "
            f"{line[:60]!r}"
        )
    yield row, filename


class _JsonToSessions(beam.DoFn):
    """A batch of ``(row, filename)`` pairs to sessions."""

    def __init__(self) -> None:
        self.read = Metrics.counter(METRICS_NAMESPACE, "sessions_read")

    def process(self, pairs: list[tuple[dict[str, Any], str]]) -> Iterator[Session]:
        sessions = convert_rows(pairs, _sessions_from_rows, lambda item: item[1])
        self.read.inc(len(sessions))
        yield from sessions


class _ReadParquet(beam.DoFn):
    """An opened Parquet file to ``(filename, table)`` pairs, one per record batch.

    Beam's own Parquet reader reports a file that is not Parquet ("magic bytes not found")
    without naming it; this one names the file in a :class:`SessionDataError`.
    """

    def process(self, readable: fileio.ReadableFile) -> Iterator[tuple[str, pa.Table]]:
        filename = readable.metadata.path
        with readable.open() as handle:
            try:
                parquet = pq.ParquetFile(handle)
                for batch in parquet.iter_batches():
                    yield filename, pa.Table.from_batches([batch])
            except (pa.ArrowException, OSError) as error:
                raise SessionDataError(
                    f"{filename}: not a readable Parquet file of sessions ({error})"
                ) from error


class _ParquetToSessions(beam.DoFn):
    """A ``(filename, table)`` pair of a sessions Parquet file to sessions."""

    def __init__(self) -> None:
        self.read = Metrics.counter(METRICS_NAMESPACE, "sessions_read")

    def process(self, element: tuple[str, pa.Table]) -> Iterator[Session]:
        filename, table = element
        try:  # the schema alone, so a missing column is not blamed on a session
            batches.sessions_from_arrow(pa.RecordBatch.from_pylist([], schema=table.schema))
        except (TypeError, ValueError) as error:
            raise SessionDataError(f"{filename}: {error}") from error
        for batch in table.to_batches():
            try:
                sessions = from_arrow(batch)
            except (TypeError, ValueError):  # find the row, to name its session
                keys = [key for _, key in _IDENTITY]
                items = [
                    (batch.select(keys).slice(i, 1).to_pylist()[0], batch.slice(i, 1), filename)
                    for i in range(batch.num_rows)
                ]
                sessions = convert_rows(items, _sessions_from_slices, lambda item: item[2])
            self.read.inc(len(sessions))
            yield from sessions


def _sessions_from_slices(items: Sequence[tuple[Any, pa.RecordBatch, str]]) -> list[Session]:
    return from_arrow(pa.concat_batches([batch for _, batch, _ in items]))


def _suffix_kind(pattern: str) -> str:
    lower = pattern.lower()
    if lower.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if lower.endswith(PARQUET_SUFFIXES):
        return "parquet"
    raise ValueError(
        f"inputs: {pattern!r} ends in neither {' nor '.join(JSONL_SUFFIXES + PARQUET_SUFFIXES)}; "
        "expected JSON lines or Parquet files of sessions"
    )


class ReadSessions(beam.PTransform):
    """Read recorded sessions from JSON-lines and Parquet files into a PCollection.

    Args:
        patterns: one file pattern or several (globs; any file system Beam knows, e.g.
            ``gs://``). The format follows each pattern's suffix (see the module docstring).
        validate: check when the pipeline is built that every pattern matches a file.

    Returns:
        (from ``expand``) a PCollection of :class:`Session`, in no particular order.

    Raises:
        ValueError: (when built) no pattern, an unknown suffix, or a pattern that matches
            no file.
        SessionDataError: (when run) a line that is not JSON, a Parquet file without the
            sessions columns, or a record that fails validation; names the file and session.

    Example:
        >>> import tempfile, os
        >>> from dew_pipe.objectives.rl.sessions import Call
        >>> s = Session(3, 0, 1, 0, [Call([1, 2], [3], [-0.5], "stop", 0)], "COMPLETED", 1.0)
        >>> path = os.path.join(tempfile.mkdtemp(), "s.jsonl")
        >>> with open(path, "w") as f:
        ...     _ = f.write(json.dumps(session_to_json(s)) + "\\n")
        >>> with beam.Pipeline("FnApiRunner") as p:
        ...     _ = p | ReadSessions(path) | beam.Map(lambda s: print(s.describe()))
        task 3, group 0, sample 1, attempt 0, COMPLETED
    """

    def __init__(self, patterns: str | Sequence[str], *, validate: bool = True) -> None:
        super().__init__()
        if isinstance(patterns, str):
            patterns = [patterns]
        patterns = list(patterns)
        if not patterns or not all(isinstance(p, str) and p for p in patterns):
            raise ValueError(f"inputs: expected one or more file patterns, got {patterns!r}")
        self.kinds = {"jsonl": [], "parquet": []}
        for pattern in patterns:
            self.kinds[_suffix_kind(pattern)].append(pattern)
        if validate:
            for pattern in patterns:
                if not _matches(pattern):
                    raise ValueError(f"inputs: no file matches {pattern!r}")

    def expand(self, pbegin: beam.pvalue.PBegin) -> beam.PCollection:
        parts = []
        if self.kinds["jsonl"]:
            parts.append(
                pbegin
                | "JsonlPatterns" >> beam.Create(self.kinds["jsonl"])
                | "ReadLines" >> beam.io.ReadAllFromText(with_filename=True)
                | "ParseJson" >> beam.FlatMap(_parse_line)
                | "BatchRows" >> beam.BatchElements(min_batch_size=16, max_batch_size=512)
                | "RowsToSessions" >> beam.ParDo(_JsonToSessions())
            )
        if self.kinds["parquet"]:
            parts.append(
                pbegin
                | "ParquetPatterns" >> beam.Create(self.kinds["parquet"])
                | "MatchParquet" >> fileio.MatchAll()
                | "OpenParquet" >> fileio.ReadMatches()
                | "ReadParquet" >> beam.ParDo(_ReadParquet())
                | "TablesToSessions" >> beam.ParDo(_ParquetToSessions())
            )
        if len(parts) == 1:
            return parts[0]
        return tuple(parts) | "Merge" >> beam.Flatten()


def _matches(pattern: str) -> bool:
    try:
        return bool(FileSystems.match([pattern])[0].metadata_list)
    except Exception:  # Beam raises BeamIOError for a pattern that matches nothing
        return False
