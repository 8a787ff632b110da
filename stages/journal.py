"""The rollout journal: sessions finished but not yet trained on, kept on disk for a resume.

Without a journal a resumed asynchronous run samples again everything that was in flight
when it stopped. With one, pack records every session it keeps (finished, scored, held by
its group) and rollout, when a resumed run takes the same task batch again, replays the
journaled sessions instead of submitting those samples to the source. Replays go through
admission like any finished session, so the usual rules decide them: one whose oldest call
lags the version its batch trains at by more than ``max_lag`` is resubmitted (cause
"stale"), and so is one sampled from weights the restored trainer never had (a call
version above the version the run resumed at: those weights died with the old process).
Every replay is a submission with one outcome, counted in ``totals["replayed"]`` and in
each :class:`~dew_pipe.stages.messages.SchedulerRecord`'s ``replayed``.

**Positions.** A journaled session is filed under its batch's *position*: the trainer's
step (``TrainState.step``, the data position a checkpoint stores) when that batch is handed
over. The update node puts it on every :class:`~dew_pipe.stages.messages.Handover`, so
rollout and pack both map their run-local batch numbers onto positions, and a resumed run,
which re-reads its data from the checkpoint's position, meets each in-flight batch at the
position it had before. Within a batch a session is matched by its task's row and its
sample index, and the task id must agree (otherwise the entry is dropped, counted in
``counts["unmatched"]``, with a warning).

**Files.** The journal is a directory of Parquet files of the sessions schema
(:func:`dew_pipe.batches.sessions_schema`, what :class:`dew_pipe.beam.JournalSessions`
writes and :class:`dew_pipe.beam.ReadSessions` reads), one per chunk pack recorded, named
``<position>-<run>-<seq>.parquet``; the schema's metadata (key ``dew_pipe.journal``) holds
each session's row, submission version and latency. Each file is written under a temporary
name and renamed (:func:`dew_pipe.batches.write_parquet`), so a process killed mid-write
leaves a ``.partial`` file that is never read, never a half-written journal that looks
complete. Where a sample was journaled more than once (a later run, a later attempt), the
newest file wins.

**Pruning.** ``resume(position)`` deletes the files of positions below the one the run
resumes at (trained on by the restored state). ``checkpointed(position)`` (the Trainer calls
it through ``RolloutScheduler.checkpointed`` after each save) deletes those below the
*previous* checkpoint's position: saves are asynchronous, and the previous one is known to
be on disk once the next has started, so the journal always covers the newest complete
checkpoint. The journal therefore holds the sessions of every batch since the checkpoint
before the newest: checkpoint regularly (``Trainer(checkpoint_every=...)``) to bound it.
Use one journal directory per run directory (``run_dir / "rollouts"``), written by one
process at a time. Files are renamed into place but not fsynced: they survive a killed
process, not a lost machine (a file damaged that way stops the resume with an error
naming it; delete it and its sessions are sampled again).

Example:
    >>> import tempfile
    >>> from dew_pipe.objectives.rl.sessions import Call
    >>> journal = Journal(tempfile.mkdtemp())
    >>> s = Session(7, 0, 1, 0, [Call([1, 2], [3], [-0.5], "stop", 0)], "COMPLETED", 1.0)
    >>> journal.record([Entry(5, 0, s, submitted_version=0, latency=0.2)])
    >>> again = Journal(journal.directory)
    >>> again.resume(position=5)
    >>> again.claim(5, row=0, sample=1, task=7).session == s
    True
    >>> again.claim(5, row=0, sample=1, task=7) is None  # claimed once
    True
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import os
import re
import threading
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from dew_pipe._validate import check_int
from dew_pipe.batches import read_parquet, write_parquet
from dew_pipe.objectives.rl.session_arrow import from_arrow, to_arrow
from dew_pipe.objectives.rl.sessions import Session

__all__ = ["Entry", "Journal", "read_journal"]

#: Schema metadata key of a journal file: JSON with each row's stamps.
METADATA_KEY = b"dew_pipe.journal"
_FORMAT = 1
_NAME = re.compile(r"^(\d+)-(\d+)-(\d+)\.parquet$")


@dataclasses.dataclass(frozen=True)
class Entry:
    """One journaled session.

    Attributes:
      position: its batch's position (the trainer's step when the batch is handed over).
      row: its task's row in the task batch.
      session: the session as pack kept it (scored; its group, sample and attempt are those
        of the run that sampled it).
      submitted_version: the weights version served when it was submitted.
      latency: seconds from submission to finish.
    """

    position: int
    row: int
    session: Session
    submitted_version: int
    latency: float


def _write(path: Path, entries: Sequence[Entry]) -> None:
    stamps = {
        "format": _FORMAT,
        "position": [e.position for e in entries],
        "row": [e.row for e in entries],
        "submitted_version": [e.submitted_version for e in entries],
        "latency": [e.latency for e in entries],
    }
    rb = to_arrow([e.session for e in entries])
    write_parquet(path, rb.replace_schema_metadata({METADATA_KEY: json.dumps(stamps).encode()}))


def _read(path: Path) -> list[Entry]:
    """The entries of one journal file; ValueError naming the file when it is not one."""
    try:
        table = read_parquet(path)
    except (OSError, pa.ArrowException) as error:
        raise ValueError(f"journal file {path} cannot be read: {error}") from error
    raw = (table.schema.metadata or {}).get(METADATA_KEY)
    if raw is None:
        raise ValueError(f"journal file {path}: no {METADATA_KEY.decode()!r} metadata")
    stamps = json.loads(raw)
    if stamps.get("format") != _FORMAT:
        raise ValueError(f"journal file {path}: format {stamps.get('format')!r}, expected 1")
    try:
        sessions = [s for rb in table.to_batches() for s in from_arrow(rb)]
    except (TypeError, ValueError) as error:
        raise ValueError(f"journal file {path}: {error}") from error
    columns = ("position", "row", "submitted_version", "latency")
    if any(len(stamps.get(c, ())) != len(sessions) for c in columns):
        raise ValueError(f"journal file {path}: stamps for another number of sessions")
    return [
        Entry(stamps["position"][i], stamps["row"][i], session,
              stamps["submitted_version"][i], stamps["latency"][i])
        for i, session in enumerate(sessions)
    ]  # fmt: skip


def _files(directory: Path) -> list[tuple[int, int, int, Path]]:
    """``(position, run, seq, path)`` of the complete journal files, oldest first."""
    out = []
    for path in directory.iterdir():
        match = _NAME.match(path.name)
        if match:
            position, run, seq = (int(g) for g in match.groups())
            out.append((position, run, seq, path))
    return sorted(out, key=lambda f: (f[1], f[2], f[0]))


def _rows(path: Path) -> int:
    """Sessions in a journal file by its footer (0 when unreadable: it is deleted anyway)."""
    try:
        return pq.read_metadata(path).num_rows
    except (OSError, pa.ArrowException):
        return 0


def read_journal(directory: str | os.PathLike) -> list[Entry]:
    """Every entry of a journal directory, oldest file first (duplicates included).

    Raises:
      ValueError: a file that is not a journal file, naming it.
    """
    return [e for *_, path in _files(Path(directory)) for e in _read(path)]


class Journal:
    """The journal of one run directory (see the module docstring).

    Shared by the rollout stage (``resume``, ``claim``, ``release``), the pack stage
    (``record``) and whoever saves checkpoints (``checkpointed``); its methods are
    thread-safe.

    Args:
      directory: where the files go (created if missing).

    Attributes:
      counts: ``loaded`` (entries found by the last resume for its batches), ``consumed``
        (entries of positions the restored state had trained on), ``superseded`` (older
        copies of a sample journaled again), ``replayed``, ``unmatched`` (entries whose
        batch was taken without them: another task at that row, or a sample index beyond
        the samples per group), ``recorded``.

    Raises:
      NotADirectoryError: ``directory`` (or a folder above it) is a file.
    """

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        for path in (self.directory, *self.directory.parents):
            if path.exists() and not path.is_dir():
                raise NotADirectoryError(
                    f"journal directory {self.directory}: {path} is a file; expected a "
                    "directory (or nothing) there"
                )
        self.directory.mkdir(parents=True, exist_ok=True)
        self.counts: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self._entries: dict[tuple[int, int, int], Entry] = {}  # (position, row, sample)
        self._run = self._next_run()
        self._seq = itertools.count()
        self._checkpoints: list[int] = []

    def _next_run(self) -> int:
        return 1 + max((run for _, run, _, _ in _files(self.directory)), default=-1)

    def resume(self, position: int) -> None:
        """A run starts at ``position``: load what later positions journaled, forget the rest.

        Files of earlier positions are deleted (the state the run resumed from trained on
        them), as are leftover ``.partial`` files of an interrupted write.

        Raises:
          ValueError: a file that is not a journal file, naming it.
        """
        position = check_int("position", position, minimum=0)
        with self._lock:
            self._entries = {}
            for path in self.directory.glob("*.partial"):
                path.unlink(missing_ok=True)
            for file_position, _, _, path in _files(self.directory):
                if file_position < position:
                    self.counts["consumed"] += _rows(path)
                    path.unlink(missing_ok=True)
                    continue
                try:
                    entries = _read(path)
                except ValueError as error:
                    raise ValueError(
                        f"{error}; delete it to resume without it (its sessions are then "
                        "sampled again)"
                    ) from error
                for entry in entries:  # oldest file first: a newer copy replaces it
                    key = (entry.position, entry.row, entry.session.sample)
                    if key in self._entries:
                        self.counts["superseded"] += 1
                    self._entries[key] = entry
            self.counts["loaded"] += len(self._entries)
            self._run = self._next_run()

    def claim(self, position: int, row: int, sample: int, task: int) -> Entry | None:
        """The journaled session for this sample, once; None when there is none (or it
        belongs to another task, which ``release`` then counts as unmatched)."""
        with self._lock:
            entry = self._entries.get((position, row, sample))
            if entry is None or entry.session.task != task:
                return None
            del self._entries[(position, row, sample)]
            self.counts["replayed"] += 1
            return entry

    def release(self, position: int) -> int:
        """Forget the entries of ``position`` nobody claimed (its batch was taken without
        them); returns how many, counted as ``unmatched`` and warned about."""
        with self._lock:
            left = [key for key in self._entries if key[0] == position]
            for key in left:
                del self._entries[key]
            self.counts["unmatched"] += len(left)
        if left:
            warnings.warn(
                f"journal {self.directory}: {len(left)} session(s) journaled for the batch at "
                f"position {position} match none of its tasks' samples (did the data or "
                "groups/oversample change?); they were not replayed",
                RuntimeWarning,
                stacklevel=2,
            )
        return len(left)

    def record(self, entries: Iterable[Entry]) -> None:
        """Write ``entries`` (one file per position), each file atomically."""
        by_position: dict[int, list[Entry]] = collections.defaultdict(list)
        for entry in entries:
            by_position[entry.position].append(entry)
        with self._lock:
            for position, chunk in sorted(by_position.items()):
                name = f"{position:010d}-{self._run:04d}-{next(self._seq):06d}.parquet"
                _write(self.directory / name, chunk)
                self.counts["recorded"] += len(chunk)

    def checkpointed(self, position: int) -> None:
        """A checkpoint at ``position`` was started: delete the files of positions below
        the previous checkpoint's, which is complete on disk by now."""
        position = check_int("position", position, minimum=0)
        with self._lock:
            self._checkpoints = [*self._checkpoints[-1:], position]
            if len(self._checkpoints) < 2:
                return
            floor = self._checkpoints[0]
            for file_position, _, _, path in _files(self.directory):
                if file_position < floor:
                    path.unlink(missing_ok=True)

    def pending(self) -> int:
        """Entries loaded by the last resume and not yet claimed or released."""
        with self._lock:
            return len(self._entries)

    def __repr__(self) -> str:
        return f"Journal({str(self.directory)!r})"
