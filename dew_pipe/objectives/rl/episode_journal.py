"""`EpisodeJournal`: tool episodes kept in SQLite so a killed collection resumes where it was.

``EpisodeRollout(..., journal=EpisodeJournal("run/episodes"))`` writes every collection's
progress to ``rank-NNNNN.sqlite`` in the directory, one database per JAX process, in WAL
mode with FULL synchronous commits (each commit is on disk before the collection goes on).
What it commits, and when:

* **the first observation** of each episode, with an environment snapshot
  (``get_state()``), right after its ``reset()``;
* **the draws** of each lock-step round (every slot's action: context, sampled ids, raw and
  behavior log-probabilities, termination flag, policy step) before the first tool of that
  round runs;
* **each completed turn** (the action, the observation, the episode's status, detail and
  reward once verified, and a fresh snapshot while it still runs) right after its tool call
  and before the next tool call; the last one is on disk before the rollout returns, so
  before the update.

After a crash, the trainer restores its checkpoint and calls the rollout with the same
state, batch and key. The journal finds the collection journaled at that step and checks
that it is the same one: task identities, training clocks (step and committed updates), the
collection key, sampling controls, the rollout's budgets, the topology (process index and
count, device counts) and a digest of the local policy (SHA-256 of this process's weight
shards, read once per collection). Any difference is refused with a :class:`JournalError`
naming the fields, a different policy at the same clocks in its own words. When all agree,
finished episodes come back whole, with their rewards (not verified again, their
environment never reopened; ``record`` sees them again); running ones reopen their
environment and ``set_state`` its last snapshot; and a round whose draws were journaled
reuses them instead of sampling, so its tools see the very actions the crashed process
sent. A tool call that ran between its round's draws and its turn's commit runs again:
environments make such effects idempotent with the episode identity and the action. A
collection that fails (an exception or a cancellation) is discarded from the journal; an
interrupt (KeyboardInterrupt, SystemExit) keeps it, like a crash.

One writer per rank: the journal holds an ``flock`` on ``rank-NNNNN.lock`` from its first
use until :meth:`EpisodeJournal.close` (or the process's end, even by SIGKILL), and a second
writer is refused. Records are kept until the trainer has checkpointed twice past them
(:meth:`EpisodeJournal.checkpointed`, called by the Trainer through the rollout; saves may be
asynchronous, and the previous one is complete once the next has started), so checkpoint
regularly to bound the file. Use one journal directory per run.

Example:
    >>> import tempfile
    >>> journal = EpisodeJournal(tempfile.mkdtemp())
    >>> journal.steps()
    []
    >>> journal.close()
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import io
import json
import os
import sqlite3
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from dew_pipe._validate import check_int
from dew_pipe.objectives.rl.episodes import Action, EpisodeStatus, Observation, Origin

__all__ = ["EpisodeJournal", "JournalError", "SavedSlot", "policy_digest"]

FORMAT = 1
_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS collections (
    step INTEGER PRIMARY KEY, identity TEXT NOT NULL, policy TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS slots (
    step INTEGER, slot INTEGER, first BLOB NOT NULL, first_status TEXT NOT NULL,
    first_detail TEXT NOT NULL, status TEXT NOT NULL, detail TEXT NOT NULL, reward REAL,
    snapshot BLOB, PRIMARY KEY (step, slot));
CREATE TABLE IF NOT EXISTS draws (
    step INTEGER, round INTEGER, slot INTEGER, action BLOB NOT NULL,
    PRIMARY KEY (step, round, slot));
CREATE TABLE IF NOT EXISTS turns (
    step INTEGER, slot INTEGER, turn INTEGER, action BLOB NOT NULL, context BLOB,
    status TEXT NOT NULL, detail TEXT NOT NULL, PRIMARY KEY (step, slot, turn));
"""
_TABLES = ("collections", "slots", "draws", "turns")


class JournalError(ValueError):
    """The journal cannot serve this collection: another writer holds it, its records belong
    to another collection at the same clocks, or its file cannot be read."""


def policy_digest(params: Any) -> str:
    """SHA-256 over this process's shards of every leaf (path, dtype, shape and bytes).

    A leaf replicated over local devices is read once (shards are taken by distinct index).

    Example:
        >>> policy_digest({"w": np.zeros(2, np.float32)}) == policy_digest({"w": np.zeros(2)})
        False
    """
    digest = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        digest.update(jax.tree_util.keystr(path).encode())
        if isinstance(leaf, jax.Array):
            shards = {str(s.index): s for s in leaf.addressable_shards}
            parts = [(index, np.asarray(shards[index].data)) for index in sorted(shards)]
        else:
            parts = [("", np.asarray(leaf))]
        for index, data in parts:
            digest.update(f"{index}|{data.dtype.str}|{data.shape}|".encode())
            digest.update(np.ascontiguousarray(data).tobytes())
    return digest.hexdigest()


def topology() -> dict[str, int]:
    """Where this process stands: its index, the process count and the device counts."""
    return {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "devices": jax.device_count(),
        "local_devices": jax.local_device_count(),
    }


def _key_hex(key: Any) -> str:
    if isinstance(key, jax.Array) and jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    return np.asarray(key).tobytes().hex()


@dataclasses.dataclass(frozen=True)
class SavedSlot:
    """One slot as the journal last committed it (what recovery rebuilds it from)."""

    first: Observation
    transitions: tuple[tuple[Action, Observation], ...]
    status: EpisodeStatus
    detail: str
    reward: float | None
    snapshot: bytes | None


class EpisodeJournal:
    """The crash-recovery journal of an :class:`EpisodeRollout` (see the module docstring).

    Args:
        directory: the journal's folder (created on first use); one per run.

    Raises:
        TypeError: ``directory`` is not a path.
        JournalError: (on first use) another writer holds this rank's journal, or its file
            is not a journal of this format.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        if not isinstance(directory, str | os.PathLike):
            raise TypeError(f"directory is {directory!r}; expected a path (str or os.PathLike)")
        self.directory = Path(directory)
        self._db: sqlite3.Connection | None = None
        self._lock_fd: int | None = None
        self._mutex = threading.Lock()
        self._checkpoints: list[int] = []
        self.path: Path | None = None

    def __repr__(self) -> str:
        return f"EpisodeJournal({str(self.directory)!r})"

    # ------------------------------------------------------------------ the file

    def open(self) -> None:
        """Takes this rank's lock and opens its database (idempotent; done on first use)."""
        if self._db is not None:
            return
        rank = jax.process_index()
        lock = self.directory / f"rank-{rank:05d}.lock"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            raise JournalError(
                f"{self}: cannot open {lock} ({error}); expected a directory the journal can "
                "write (or nothing) at that path"
            ) from error
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise JournalError(
                f"{self}: rank {rank}'s journal {lock.with_suffix('.sqlite')} is held by "
                f"another writer (pid {holder}); one process writes a journal at a time, so "
                "give each run its own journal directory"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self.path = lock.with_suffix(".sqlite")
        db = None
        try:
            db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            self._prepare(db)
        except BaseException as error:
            if db is not None:
                db.close()
            os.close(fd)
            if isinstance(error, sqlite3.DatabaseError):
                raise JournalError(
                    f"{self}: {self.path} is not a readable journal: {error}"
                ) from error
            raise
        self._db, self._lock_fd = db, fd

    def _prepare(self, db: sqlite3.Connection) -> None:
        """WAL mode, FULL synchronous commits, the tables, and the format check."""
        mode = db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if mode != "wal":
            raise JournalError(f"{self}: {self.path} refused WAL mode (journal_mode={mode})")
        db.execute("PRAGMA synchronous=FULL")
        db.executescript(_SCHEMA)
        stored = db.execute("SELECT value FROM meta WHERE name = 'format'").fetchone()
        if stored is None:
            db.execute("INSERT INTO meta VALUES ('format', ?)", (str(FORMAT),))
        elif stored[0] != str(FORMAT):
            raise JournalError(
                f"{self}: {self.path} has journal format {stored[0]}; expected {FORMAT}"
            )

    def close(self) -> None:
        """Closes the database and releases the lock (idempotent)."""
        with self._mutex:
            if self._db is not None:
                self._db.close()
                self._db = None
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None

    def __enter__(self) -> EpisodeJournal:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextlib.contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One committed transaction (durable on return: synchronous=FULL)."""
        with self._mutex:
            db = self._connection()
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

    def _connection(self) -> sqlite3.Connection:
        if self._db is None:
            self.open()
        return self._db

    def steps(self) -> list[int]:
        """The steps of the collections the journal holds, in order."""
        with self._mutex:
            rows = self._connection().execute("SELECT step FROM collections ORDER BY step")
            return [int(step) for (step,) in rows]

    def checkpointed(self, step: int) -> None:
        """A checkpoint at ``step`` was started: drops the collections below the previous
        checkpoint's step, which is complete on disk by now."""
        step = check_int("step", step, minimum=0)
        self._checkpoints = [*self._checkpoints[-1:], step]
        if len(self._checkpoints) == 2:
            with self._write() as db:
                for table in _TABLES:
                    db.execute(f"DELETE FROM {table} WHERE step < ?", (self._checkpoints[0],))

    # ------------------------------------------------------------------ collections

    def begin(
        self, step: int, settings: Mapping[str, Any], key: Any, params: Any, origin: Origin
    ) -> JournaledCollection:
        """The journal of the collection at ``step``: the one journaled there, or a new one.

        Args:
            step: the attempted-work clock (``state.step``).
            settings: what else identifies the collection (tasks, updates, sampling,
                budgets), JSON-serializable; the journal adds the key, the topology and
                the policy digest.
            key: the collection's PRNG key.
            params: the policy's weights (their local shards are digested).
            origin: the collection binding restored actions are given.

        Raises:
            JournalError: a collection is journaled at ``step`` with another identity.
        """
        identity = {**settings, "key": _key_hex(key), "topology": topology()}
        identity = json.loads(json.dumps(identity, sort_keys=True))  # tuples become lists
        policy = policy_digest(params)
        with self._write() as db:
            row = db.execute(
                "SELECT identity, policy FROM collections WHERE step = ?", (step,)
            ).fetchone()
            if row is None:
                db.execute(
                    "INSERT INTO collections VALUES (?, ?, ?)",
                    (step, json.dumps(identity, sort_keys=True), policy),
                )
                return JournaledCollection(self, step, origin, resumed=False)
        self._check(step, json.loads(row[0]), identity, row[1], policy)
        return JournaledCollection(self, step, origin, resumed=True)

    def _check(
        self, step: int, stored: dict[str, Any], here: dict[str, Any], was: str, now: str
    ) -> None:
        names = {
            "tasks": "task identities",
            "updates": "training clocks (committed updates)",
            "key": "the collection key",
            "sampling": "sampling controls",
            "settings": "rollout budgets (max_prompt_tokens, max_new_tokens, max_turns, groups)",
            "topology": "topology",
        }
        differ = [
            f"{names.get(field, field)}: {stored.get(field)!r} there, {here.get(field)!r} here"
            for field in sorted(set(stored) | set(here))
            if stored.get(field) != here.get(field)
        ]
        where = f"{self}: the collection journaled at step {step} ({self.path})"
        fix = (
            "; use one journal directory per run (a fresh directory samples again), or "
            "resume the run that wrote it"
        )
        if differ:
            raise JournalError(f"{where} is another collection: " + "; ".join(differ) + fix)
        if was != now:
            raise JournalError(
                f"{where} was sampled by a different policy at the same clocks (step {step}, "
                f"{here.get('updates')} updates): local policy digest {was[:16]}... there, "
                f"{now[:16]}... here; recovery needs the weights the checkpoint restores" + fix
            )


class JournaledCollection:
    """What one collection reads from and commits to the journal (used by EpisodeRollout)."""

    def __init__(self, journal: EpisodeJournal, step: int, origin: Origin, resumed: bool) -> None:
        self.journal, self.step, self.origin, self.resumed = journal, step, origin, resumed
        self.restored_turns = 0

    def slot(self, index: int) -> SavedSlot | None:
        """The slot as last committed, or None (never journaled, or a new collection)."""
        if not self.resumed:
            return None
        with self.journal._mutex:
            db = self.journal._connection()
            row = db.execute(
                "SELECT first, first_status, first_detail, status, detail, reward, snapshot "
                "FROM slots WHERE step = ? AND slot = ?",
                (self.step, index),
            ).fetchone()
            turns = db.execute(
                "SELECT action, context, status, detail FROM turns "
                "WHERE step = ? AND slot = ? ORDER BY turn",
                (self.step, index),
            ).fetchall()
        if row is None:
            return None
        first = Observation(_array(row[0]), row[1], row[2])
        transitions = tuple(
            (self._action(blob), Observation(_array(context), status, detail))
            for blob, context, status, detail in turns
        )
        self.restored_turns += len(transitions)
        return SavedSlot(first, transitions, EpisodeStatus.parse(row[3]), row[4], row[5], row[6])

    def draws(self, round_index: int) -> dict[int, Action] | None:
        """The actions journaled for a round, by slot; None when it was not journaled."""
        if not self.resumed:
            return None
        with self.journal._mutex:
            rows = (
                self.journal._connection()
                .execute(
                    "SELECT slot, action FROM draws WHERE step = ? AND round = ?",
                    (self.step, round_index),
                )
                .fetchall()
            )
        return {int(slot): self._action(blob) for slot, blob in rows} or None

    def save_draws(self, round_index: int, actions: Mapping[int, Action]) -> None:
        """Commits a round's actions before any of its tools runs."""
        with self.journal._write() as db:
            db.executemany(
                "INSERT OR REPLACE INTO draws VALUES (?, ?, ?, ?)",
                [(self.step, round_index, i, _action_blob(a)) for i, a in actions.items()],
            )

    def commit(
        self,
        index: int,
        first: Observation,
        transition: tuple[int, Action, Observation] | None,
        status: EpisodeStatus,
        detail: str,
        reward: float | None,
        snapshot: bytes | None,
    ) -> None:
        """Commits a slot's standing and, when given, its newest turn, in one transaction."""
        with self.journal._write() as db:
            if transition is not None:
                turn, action, observation = transition
                db.execute(
                    "INSERT OR REPLACE INTO turns VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (
                        self.step,
                        index,
                        turn,
                        _action_blob(action),
                        _blob(observation.context),
                        observation.status.value,
                        observation.detail,
                    ),
                )
            db.execute(
                "INSERT OR REPLACE INTO slots VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    self.step,
                    index,
                    _blob(first.context),
                    first.status.value,
                    first.detail,
                    status.value,
                    detail,
                    reward,
                    snapshot,
                ),
            )

    def discard(self) -> None:
        """Forgets this collection (it failed: a retry samples it again)."""
        with self.journal._write() as db:
            for table in _TABLES:
                db.execute(f"DELETE FROM {table} WHERE step = ?", (self.step,))

    def _action(self, blob: bytes) -> Action:
        with np.load(io.BytesIO(blob), allow_pickle=False) as arrays:
            return Action(
                arrays["context"],
                arrays["tokens"],
                arrays["log_probs"],
                arrays["behavior_log_probs"],
                bool(arrays["stopped"]),
                int(arrays["policy_step"]),
                origin=self.origin,
            )


def _action_blob(action: Action) -> bytes:
    buffer = io.BytesIO()
    np.savez(
        buffer,
        context=action.context,
        tokens=action.tokens,
        log_probs=action.log_probs,
        behavior_log_probs=action.behavior_log_probs,
        stopped=np.bool_(action.stopped),
        policy_step=np.int64(action.policy_step),
    )
    return buffer.getvalue()


def _blob(array: np.ndarray | None) -> bytes | None:
    if array is None:
        return None
    buffer = io.BytesIO()
    np.save(buffer, np.asarray(array), allow_pickle=False)
    return buffer.getvalue()


def _array(blob: bytes | None) -> np.ndarray | None:
    return None if blob is None else np.load(io.BytesIO(blob), allow_pickle=False)
