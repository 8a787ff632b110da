"""The offline pack job: files of sessions in, a folder of packed training batches out.

``run_pack_job`` builds ``ReadSessions | PackSessions | WritePacked`` and runs it on a Beam
runner; ``dew-pipe pack`` is its command line. The output folder holds one
``packed-BBBBB-of-NNNNN.parquet`` per batch, ``manifest-*.parquet`` (see
:mod:`dew_pipe.beam.packing` for what each holds and how it compares with ``pack``) and
``_SUCCESS``, the completion marker (JSON: the job's counters and files).

**All or nothing.** The job writes into a staging folder beside the output
(``.<name>.staging-<id>``, on the same file system) and publishes only once the runner
reports DONE: on a local disk, when the output folder is missing or empty, by renaming the
staging folder onto it (atomic); otherwise file by file, packed files first, then the
manifest, then ``_SUCCESS`` last. A failed job removes its staging folder and leaves the
output as it was, so a failure never leaves files that look finished, and an ``overwrite``
that fails keeps the earlier complete output. A process killed outright leaves its hidden
staging folder behind (never the output); it can be deleted, and a rerun ignores it. ``read_manifest`` refuses a folder without
``_SUCCESS`` (a publication cut short, or files of an unfinished writer). A folder holding an
earlier job's files (complete or not) is refused unless ``overwrite``, so two runs never mix.

**Runners.** ``"DirectRunner"`` (the default) runs on Beam's FnApiRunner in this process, or
on ``workers`` local worker processes. Beam's own DirectRunner would first try the Prism
runner, which downloads a binary from GitHub at run time and falls back to the FnApiRunner
when it cannot; going to the FnApiRunner directly keeps the job offline and its start-up
short. Any other name (``"PrismRunner"``, ``"FlinkRunner"``, ``"SparkRunner"``,
``"DataflowRunner"``...) goes to Beam unchanged, with ``beam_args`` for its options.

**Errors.** A bad argument or input pattern raises ValueError before anything runs. Bad data
found while running raises :class:`SessionDataError` with the one-line message the worker
raised (naming the file or batch and the session), whichever runner carried it back.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import apache_beam as beam
import numpy as np
import pyarrow as pa
from apache_beam.io.filesystems import FileSystems
from apache_beam.io.localfilesystem import LocalFileSystem
from apache_beam.metrics.metric import MetricsFilter
from apache_beam.options.pipeline_options import PipelineOptions

from dew_pipe import batches
from dew_pipe._validate import check_int
from dew_pipe.beam.packing import PackSessions, WritePacked
from dew_pipe.beam.sources import METRICS_NAMESPACE, ReadSessions, SessionDataError
from dew_pipe.beam.verl_source import ReadVerlRows

__all__ = ["PackSummary", "read_manifest", "read_packed", "run_pack_job"]

MARKER = "_SUCCESS"  # written last: its presence says the folder holds one finished job
_OUTPUT_GLOBS = (MARKER, "packed-*.parquet", "manifest-*.parquet")  # marker first: see _publish
# How a SessionDataError raised in a worker appears in the text Beam carries back: as the
# exception itself (in process, with " [while running 'step']" appended) or as the last
# line of a formatted traceback (worker processes, remote runners).
_MESSAGE = re.compile(r"SessionDataError: (.+?)(?: \[while running '[^']*'\])*$", re.MULTILINE)


@dataclasses.dataclass(frozen=True)
class PackSummary:
    """What a pack job did, from the job's Beam counters.

    Attributes:
        sessions: sessions read.
        groups: (task, group) groups.
        trained: sessions that train (the others are in the manifest with ``trains`` false).
        batches: packed files written.
        rows: rows in all batches.
        chains: chains placed.
        tokens: real (non-padding) ids in all rows.
        width: ids per row.
        files: the packed files, in batch order.
        seconds: wall time of the run.
    """

    sessions: int
    groups: int
    trained: int
    batches: int
    rows: int
    chains: int
    tokens: int
    width: int
    files: tuple[str, ...]
    seconds: float

    @property
    def fill(self) -> float:
        """Real ids over row capacity (``tokens / (rows * width)``); 0 without rows."""
        return self.tokens / (self.rows * self.width) if self.rows else 0.0


def run_pack_job(
    inputs: str | Sequence[str],
    output: str | Path,
    *,
    width: int,
    rows: int | None = None,
    groups_per_batch: int | None = None,
    estimator: str = "group",
    truncation: str = "mask",
    support_capacity: int | None = None,
    runner: str = "DirectRunner",
    workers: int = 1,
    beam_args: Sequence[str] = (),
    overwrite: bool = False,
    input_format: str = "sessions",
    samples: int | None = None,
) -> PackSummary:
    """Pack recorded sessions into Parquet training batches with Apache Beam.

    Args:
        inputs: file patterns of sessions (``.jsonl`` / ``.parquet``; see
            :class:`dew_pipe.beam.ReadSessions`).
        output: folder for the packed files, the manifest and ``_SUCCESS``; created if
            missing. Nothing appears there unless the job succeeds (see the module docstring).
        width, rows, groups_per_batch, estimator, truncation, support_capacity: as
            :class:`dew_pipe.beam.PackSessions`.
        runner: ``"DirectRunner"`` (local, see the module docstring) or any Beam runner name.
        workers: local worker processes (DirectRunner); 1 runs in this process.
        beam_args: further Beam pipeline options, e.g. ``["--temp_location=gs://b/tmp"]``.
        overwrite: replace the packed files, manifests and marker of an earlier job in
            ``output`` once this job has succeeded; without it such files are an error.
        input_format: ``"sessions"`` (the files hold sessions) or ``"verl"`` (JSON lines of
            verl ``AgentLoopOutput`` rows; see :class:`dew_pipe.beam.ReadVerlRows`).
        samples: verl's ``rollout.n`` for native verl rows (``input_format="verl"`` only).

    Returns:
        A :class:`PackSummary`.

    Raises:
        ValueError: a bad argument, a pattern matching no file, an output that is a file, or
            an output folder holding an earlier job's files.
        SessionDataError: bad data found while running; names the file or batch and session.

    Example:
        >>> import json, os, tempfile
        >>> from dew_pipe.beam import session_to_json
        >>> from dew_pipe.objectives.rl.sessions import Call, Session
        >>> call = Call([5, 6], [7, 2], [-0.2, -0.1], "stop", version=3)
        >>> folder = tempfile.mkdtemp()
        >>> with open(os.path.join(folder, "s.jsonl"), "w") as f:
        ...     for s in range(4):
        ...         line = session_to_json(Session(0, 0, s, 0, [call], "COMPLETED", float(s)))
        ...         _ = f.write(json.dumps(line) + "\\n")
        >>> summary = run_pack_job(os.path.join(folder, "*.jsonl"), os.path.join(folder, "out"),
        ...                        width=8)
        >>> summary.sessions, summary.batches, summary.rows, round(summary.fill, 3)
        (4, 1, 2, 1.0)
    """
    workers = check_int("workers", workers, minimum=1)
    if not isinstance(runner, str) or not runner:
        raise ValueError(f"runner: expected a Beam runner name, got {runner!r}")
    transform = PackSessions(
        width=width,
        rows=rows,
        groups_per_batch=groups_per_batch,
        estimator=estimator,
        truncation=truncation,
        support_capacity=support_capacity,
    )
    if input_format == "verl":
        read = ReadVerlRows(inputs, samples=samples)
    elif input_format == "sessions":
        if samples is not None:
            raise ValueError(
                "samples: only verl rows are grouped by samples; pass input_format='verl'"
            )
        read = ReadSessions(inputs)
    else:
        raise ValueError(f"input_format: expected 'sessions' or 'verl', got {input_format!r}")
    output = str(output)
    earlier = _check_output(output, overwrite)
    staging = _staging(output)
    options = PipelineOptions(
        list(beam_args),
        direct_num_workers=workers,
        direct_running_mode="multi_processing" if workers > 1 else "in_memory",
    )
    start = time.perf_counter()
    try:
        FileSystems.mkdirs(staging)
        pipeline = beam.Pipeline(runner=_runner(runner), options=options)
        _ = pipeline | "ReadSessions" >> read | "PackSessions" >> transform | WritePacked(staging)
        counters = _run(pipeline)
        seconds = time.perf_counter() - start
        staged = sorted(_match(FileSystems.join(staging, "packed-*.parquet")))
        names = tuple(FileSystems.split(path)[1] for path in staged)
        _write_marker(staging, counters, names, seconds)
        _publish(staging, output, earlier)
    except BaseException:
        _remove(staging)  # nothing of a failed job stays behind, not even half a publication
        raise
    files = tuple(FileSystems.join(output, name) for name in names)
    return PackSummary(
        sessions=counters.get("sessions_read", 0),
        groups=counters.get("groups", 0),
        trained=counters.get("trained", 0),
        batches=counters.get("batches", 0),
        rows=counters.get("rows", 0),
        chains=counters.get("chains", 0),
        tokens=counters.get("tokens", 0),
        width=int(width),
        files=files,
        seconds=seconds,
    )


def _runner(name: str) -> Any:
    if name in ("DirectRunner", "FnApiRunner"):
        from apache_beam.runners.portability.fn_api_runner import FnApiRunner

        return FnApiRunner()
    return name


def _match(pattern: str) -> list[str]:
    try:
        return [m.path for m in FileSystems.match([pattern])[0].metadata_list]
    except Exception:  # BeamIOError: nothing matches
        return []


def _run(pipeline: beam.Pipeline) -> dict[str, int]:
    """Run the job to the end; its counters. Bad data raises ``SessionDataError``."""
    try:
        result = pipeline.run()
        state = result.wait_until_finish()
    except Exception as error:
        message = _data_error(error)
        if message is None:
            raise
        raise SessionDataError(message) from error
    if state is not None and str(state) not in ("DONE", "PipelineState.DONE"):
        raise RuntimeError(f"the Beam job ended in state {state}, expected DONE")
    return _counters(result)


def _local(path: str) -> bool:
    return isinstance(FileSystems.get_filesystem(path), LocalFileSystem)


def _check_output(output: str, overwrite: bool) -> list[str]:
    """The files of an earlier job in ``output`` (refused unless ``overwrite``)."""
    if _local(output) and os.path.exists(output) and not os.path.isdir(output):
        raise ValueError(f"output: {output} is a file; expected a folder (or a new path)")
    earlier = [p for g in _OUTPUT_GLOBS for p in _match(FileSystems.join(output, g))]
    if earlier and not overwrite:
        raise ValueError(
            f"output: {output} already holds {len(earlier)} packed or manifest file(s) or "
            f"marker of an earlier job (e.g. {Path(earlier[0]).name}); pass overwrite=True "
            "(--overwrite) or choose another folder"
        )
    return earlier


def _staging(output: str) -> str:
    parent, name = FileSystems.split(output.rstrip("/") or output)
    return FileSystems.join(parent, f".{name}.staging-{uuid.uuid4().hex[:12]}")


def _write_marker(folder: str, counters: dict[str, int], files: tuple[str, ...], seconds: float):
    record = {"counters": counters, "files": list(files), "seconds": round(seconds, 3)}
    with FileSystems.create(FileSystems.join(folder, MARKER)) as handle:
        handle.write((json.dumps(record, indent=2, sort_keys=True) + "\n").encode())


def _publish(staging: str, output: str, earlier: list[str]) -> None:
    """Move the staged files under their final names; the marker last."""
    if _local(output) and not earlier:
        try:
            os.rename(staging, output)  # atomic; works onto a missing or an empty folder
            return
        except OSError:
            pass  # the folder holds other files: publish file by file
    if earlier:
        FileSystems.delete(earlier)  # the marker first (_OUTPUT_GLOBS' order): never a stale one
    if not FileSystems.exists(output):
        FileSystems.mkdirs(output)
    staged = [
        p for g in _OUTPUT_GLOBS[1:] + (MARKER,) for p in _match(FileSystems.join(staging, g))
    ]
    targets = [FileSystems.join(output, FileSystems.split(p)[1]) for p in staged]
    FileSystems.rename(staged, targets)
    _remove(staging)


def _remove(folder: str) -> None:
    try:
        if FileSystems.exists(folder):
            FileSystems.delete([folder])
    except Exception:  # best effort: the error being raised, if any, matters more
        pass


def _data_error(error: BaseException) -> str | None:
    """The message of the first SessionDataError in a Beam failure, or None."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        own = isinstance(error, SessionDataError)
        text = f"SessionDataError: {error}" if own else str(error)
        match = _MESSAGE.search(text)
        if match:
            return match.group(1)
        error = error.__cause__ or error.__context__
    return None


def _counters(result: Any) -> dict[str, int]:
    totals: dict[str, int] = {}
    query = result.metrics().query(MetricsFilter().with_namespace(METRICS_NAMESPACE))
    for counter in query["counters"]:
        value = counter.committed if counter.committed is not None else counter.attempted
        name = counter.key.metric.name
        totals[name] = totals.get(name, 0) + int(value or 0)
    return totals


def read_packed(path: str | Path) -> dict[str, np.ndarray]:
    """One packed file of a pack job as the ``{name: array}`` batch the objectives read.

    Raises:
        ValueError: the file is not a packed-rows batch (names the column).

    Example:
        >>> import os, tempfile
        >>> from dew_pipe.objectives.rl.sessions import Call, Session, pack
        >>> call = Call([5, 6], [7, 2], [-0.2, -0.1], "stop", version=3)
        >>> batch = pack([Session(0, 0, 0, 0, [call], "COMPLETED", 1.0)], 8, arrow=True)
        >>> path = os.path.join(tempfile.mkdtemp(), "p.parquet")
        >>> _ = batches.write_parquet(path, batch)
        >>> read_packed(path)["input_ids"].tolist()
        [[5, 6, 7, 2, 0, 0, 0, 0]]
    """
    table = batches.read_parquet(path)
    columns = [column.combine_chunks() for column in table.columns]
    return batches.packed_from_arrow(pa.RecordBatch.from_arrays(columns, schema=table.schema))


def read_manifest(output: str | Path, *, require_complete: bool = True) -> pa.Table:
    """The manifest of a pack job's output folder, one row per input session.

    Rows are sorted by (batch, session_index). See ``dew_pipe.beam.MANIFEST_SCHEMA``.

    Args:
        output: the job's output folder.
        require_complete: refuse a folder without the job's ``_SUCCESS`` marker (False for
            a folder that ``WritePacked`` wrote in a pipeline of your own).

    Raises:
        ValueError: the folder holds no manifest, or no ``_SUCCESS`` marker.
    """
    from dew_pipe.beam.packing import MANIFEST_SCHEMA

    if require_complete and not FileSystems.exists(FileSystems.join(str(output), MARKER)):
        raise ValueError(
            f"output: {output} has no {MARKER} marker; the pack job that wrote it did not "
            "finish (run it again with --overwrite)"
        )
    paths = sorted(_match(FileSystems.join(str(output), "manifest-*.parquet")))
    if not paths:
        raise ValueError(f"output: no manifest-*.parquet in {output}; not a pack job's output")
    tables = [batches.read_parquet(p, schema=MANIFEST_SCHEMA) for p in paths]
    table = pa.concat_tables(tables)
    return table.sort_by([("batch", "ascending"), ("session_index", "ascending")])
