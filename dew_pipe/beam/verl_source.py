"""verl agent-loop rows into a Beam pipeline: JSON-lines files of ``AgentLoopOutput`` rows.

Each line of such a file is one row as :func:`dew_pipe.objectives.rl.verl.to_verl` writes it,
or as ``json.dumps(output.model_dump())`` of a verl ``AgentLoopOutput`` (arrays as lists),
and :func:`~dew_pipe.objectives.rl.verl.from_verl` turns them into sessions with all its
rules and refusals (media rows are refused: the pack job trains a text model).

Order matters for native verl rows, so each file is read whole, in order, by one worker:
verl repeats every prompt ``rollout.n`` times in a row, and with ``samples=n`` rows
``k*n .. k*n + n - 1`` of a file are the samples of its task ``k``. Native rows have no task
ids, so the files are numbered in sorted path order and a file's sessions take its number as
their group: the groups of two files never mix. Rows Dew wrote keep the identity they carry,
and every row of one session must be in one file.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from typing import Any

import apache_beam as beam
from apache_beam.io.filesystems import FileSystems
from apache_beam.metrics import Metrics

from dew_pipe._validate import check_int
from dew_pipe.beam.sources import JSONL_SUFFIXES, METRICS_NAMESPACE, SessionDataError
from dew_pipe.objectives.rl.sessions import Session
from dew_pipe.objectives.rl.verl import from_verl
from dew_pipe.objectives.rl.verl_rows import check_eos

__all__ = ["ReadVerlRows", "read_verl_file"]

_ROW = re.compile(r"rows\[(\d+)\]")


def read_verl_file(
    path: str, group: int, samples: int | None, eos: tuple[int, ...] | None = None
) -> list[Session]:
    """The sessions of one JSON-lines file of verl rows (see the module docstring).

    Args:
        path: the file (any file system Beam knows; ``.gz`` is decompressed).
        group: the group its native rows get.
        samples: verl's ``rollout.n`` for native rows; None when Dew wrote them.
        eos: EOS ids to check every call against, or None.

    Returns:
        The sessions, in the order of their first rows.

    Raises:
        SessionDataError: a line that is not a JSON object, or a row ``from_verl`` refuses;
            the message names the file and the line.

    Example:
        >>> import os, tempfile
        >>> row = {"prompt_ids": [1, 2], "response_ids": [3], "response_mask": [1],
        ...        "response_logprobs": [-0.5], "reward_score": 1.0,
        ...        "extra_fields": {"min_global_steps": 0}}
        >>> path = os.path.join(tempfile.mkdtemp(), "rows.jsonl")
        >>> with open(path, "w") as f:
        ...     _ = f.write(json.dumps(row) + "\\n" + json.dumps(row) + "\\n")
        >>> [s.describe() for s in read_verl_file(path, group=3, samples=2)]
        ['task 0, group 3, sample 0, attempt 0, COMPLETED', 'task 0, group 3, sample 1, attempt 0, COMPLETED']
    """
    rows: list[Any] = []
    lines: list[int] = []
    with FileSystems.open(path) as handle:
        for number, raw in enumerate(iter(handle.readline, b""), start=1):  # gzip: no __iter__
            text = raw.decode("utf-8")
            if not text.strip():
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as error:
                raise SessionDataError(
                    f"{path}: line {number} is not JSON ({error.msg}, column {error.colno})"
                ) from error
            if not isinstance(row, dict):
                raise SessionDataError(
                    f"{path}: line {number}: expected one JSON object per line (a verl row), "
                    f"got a {type(row).__name__}"
                )
            rows.append(row)
            lines.append(number)
    try:
        trajectories = from_verl(rows, samples=samples, eos=eos, group=group)
    except (TypeError, ValueError) as error:
        message = _ROW.sub(lambda m: f"line {lines[int(m.group(1))]}", str(error))
        raise SessionDataError(f"{path}: {message}") from error
    return [t.session for t in trajectories]


class _ReadFile(beam.DoFn):
    """``(group, path)`` to the file's sessions."""

    def __init__(self, samples: int | None, eos: tuple[int, ...] | None) -> None:
        self.samples, self.eos = samples, eos
        self.read = Metrics.counter(METRICS_NAMESPACE, "sessions_read")

    def process(self, element: tuple[int, str]) -> Iterator[Session]:
        group, path = element
        sessions = read_verl_file(path, group, self.samples, self.eos)
        self.read.inc(len(sessions))
        yield from sessions


class ReadVerlRows(beam.PTransform):
    """Read JSON-lines files of verl agent-loop rows into a PCollection of sessions.

    Args:
        patterns: one file pattern or several (globs), each ending in a JSON-lines suffix
            (``.jsonl``, ``.ndjson``, optionally ``.gz``).
        samples: verl's ``rollout.n``, needed for native verl rows (see the module
            docstring); rows Dew wrote need none.
        eos: EOS id(s) every call is checked against (``Call.check_eos``), or None.

    Returns:
        (from ``expand``) a PCollection of :class:`Session`, in no particular order.

    Raises:
        ValueError: (when built) no pattern, a pattern that is not JSON lines, or one that
            matches no file; a bad ``samples`` or ``eos``.
        SessionDataError: (when run) a bad line or row, naming the file and line.

    Example:
        >>> import os, tempfile
        >>> row = {"prompt_ids": [1, 2], "response_ids": [3], "response_mask": [1],
        ...        "response_logprobs": [-0.5], "reward_score": 1.0,
        ...        "extra_fields": {"min_global_steps": 0}}
        >>> path = os.path.join(tempfile.mkdtemp(), "rows.jsonl")
        >>> with open(path, "w") as f:
        ...     _ = f.write(json.dumps(row) + "\\n")
        >>> with beam.Pipeline("FnApiRunner") as p:
        ...     _ = p | ReadVerlRows(path, samples=1) | beam.Map(lambda s: print(s.describe()))
        task 0, group 0, sample 0, attempt 0, COMPLETED
    """

    def __init__(
        self,
        patterns: str | Sequence[str],
        *,
        samples: int | None = None,
        eos: int | Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        if isinstance(patterns, str):
            patterns = [patterns]
        patterns = list(patterns)
        if not patterns or not all(isinstance(p, str) and p for p in patterns):
            raise ValueError(f"inputs: expected one or more file patterns, got {patterns!r}")
        for pattern in patterns:
            if not pattern.lower().endswith(JSONL_SUFFIXES):
                raise ValueError(
                    f"inputs: {pattern!r} does not end in {' or '.join(JSONL_SUFFIXES)}; verl "
                    "rows are read from JSON-lines files"
                )
        self.samples = check_int("samples", samples, minimum=1, allow_none=True)
        self.eos = check_eos(eos)
        files: set[str] = set()
        for pattern in patterns:
            try:
                matched = FileSystems.match([pattern])[0].metadata_list
            except Exception:  # Beam raises BeamIOError for a pattern that matches nothing
                matched = []
            if not matched:
                raise ValueError(f"inputs: no file matches {pattern!r}")
            files.update(m.path for m in matched)
        self.files = sorted(files)  # numbered in this order: a file's number is its group

    def expand(self, pbegin: beam.pvalue.PBegin) -> beam.PCollection:
        return (
            pbegin
            | "VerlFiles" >> beam.Create(list(enumerate(self.files)))
            | "VerlRowsToSessions" >> beam.ParDo(_ReadFile(self.samples, self.eos))
        )
