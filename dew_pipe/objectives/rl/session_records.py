"""Session records: what a rollout engine or recording gateway reports about one harness run.

A :class:`Call` is one request to the engine: the exact context ids it read, the ids it drew
and the likelihoods it reported for them. A :class:`Session` is one run of a harness on a
:class:`Task`: its calls in submission order, how it ended (:class:`Status`) and what the
verifier said. A :class:`SessionSource` turns tasks into futures of sessions.

These records are the in-memory API; import them from their public path,
:mod:`dew_pipe.objectives.rl.sessions`, which also carries the functions over them (``pack``,
``session_metrics``, ``to_arrow``...). They are defined here, apart from that module, so the
modules of those functions can import the records without an import circle.

Arrays held by a record are NumPy arrays that the record never writes to: ids are int32,
likelihoods float32, routing keeps the engine's integer dtype. Records compare equal when
every field and every array element is equal.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Protocol, Self, TypeVar, runtime_checkable

import numpy as np

__all__ = ["Call", "ParsedStatus", "Session", "SessionSource", "Status", "Task", "check_sessions"]

_INT32_MAX = np.iinfo(np.int32).max
_INT32, _FLOAT32 = np.dtype(np.int32), np.dtype(np.float32)
_R = TypeVar("_R")


class ParsedStatus(enum.StrEnum):
    """A status enum that reads its members from their values or names (`parse`)."""

    @classmethod
    def parse(cls, value: Any) -> Self:
        """Accept a member, its value (``"completed"``) or its name (``"COMPLETED"``).

        Raises:
            ValueError: anything else, listing the names.

        Example:
            >>> Status.parse("TRUNCATED") is Status.TRUNCATED
            True
        """
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            if value in cls._value2member_map_:
                return cls(value)
            if value in cls.__members__:
                return cls[value]
        raise ValueError(f"status: expected one of {[s.name for s in cls]}, got {value!r}")


class Status(ParsedStatus):
    """How a session ended; decides whether and how it trains (see :func:`pack`)."""

    COMPLETED = "completed"
    """The harness finished and the verifier scored it. Trains on its reward."""
    TRUNCATED = "truncated"
    """A context, token, turn or time limit ended it. Trains as ``pack(truncation=...)`` says."""
    AGENT_ERROR = "agent_error"
    """The policy's own failure (bad tool call, crash it caused). Trains on its reward."""
    INFRA_ERROR = "infra_error"
    """Infrastructure failed (engine, sandbox, verifier). Never trains; retried by schedulers."""
    CANCELLED = "cancelled"
    """Stopped from outside (timeout, staleness, admission). Never trains."""


@dataclasses.dataclass(frozen=True)
class Task:
    """One unit of work a :class:`SessionSource` runs: an id and its payload.

    Args:
        id: identifies the task; sessions of one task share it (an int, the ``task_id`` of
            the tasks batch).
        data: whatever the source, environment and verifier read (prompt ids, metadata...).

    Example:
        >>> Task(3, {"prompt": [1, 2, 3]}).id
        3
    """

    id: int
    data: Any = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "id", _integer("Task.id", self.id))


def _frozen(array: np.ndarray) -> np.ndarray:
    view = array.view()
    view.flags.writeable = False
    return view


def _ids(field: str, value: Any, *, nonempty: bool = False) -> np.ndarray:
    """Nonnegative int32 token ids from any integer sequence; bools and floats refused."""
    if type(value) is np.ndarray and value.dtype == _INT32 and value.ndim == 1:
        array, high = value, None  # what servers hand over: int32 needs no range check above
    else:
        array, high = np.asarray(value), _INT32_MAX
        if array.size == 0 and array.ndim == 1 and array.dtype != np.bool_:
            array = array.astype(np.int32)
        if array.dtype == np.bool_ or not np.issubdtype(array.dtype, np.integer):
            raise TypeError(f"{field}: expected integer token ids, got dtype {array.dtype}")
        if array.ndim != 1:
            raise ValueError(f"{field}: expected a 1-D sequence of ids, got shape {array.shape}")
    if nonempty and array.size == 0:
        raise ValueError(f"{field}: expected at least one id, got none")
    if array.size and (array.min() < 0 or (high is not None and array.max() > high)):
        bad = int(np.flatnonzero((array < 0) | (array > _INT32_MAX))[0])
        raise ValueError(
            f"{field}: expected ids in [0, {_INT32_MAX}], got {array[bad]} at index {bad}"
        )
    return _frozen(array.astype(np.int32, copy=False))


def _likelihoods(field: str, value: Any, length: int) -> np.ndarray:
    """Finite float32 log-probabilities, one per sampled id."""
    array = value if type(value) is np.ndarray else np.asarray(value)
    if array.dtype != _FLOAT32:  # float32 (what servers hand over) needs no cast
        if array.size == 0 and array.ndim == 1 and array.dtype != np.bool_:
            array = array.astype(np.float32)
        if array.dtype == np.bool_ or not np.issubdtype(array.dtype, np.number):
            raise TypeError(f"{field}: expected real log-probabilities, got dtype {array.dtype}")
    if array.shape != (length,):
        raise ValueError(
            f"{field}: expected one entry per sampled id, shape ({length},), got {array.shape}"
        )
    if array.dtype == _FLOAT32:
        single = array
    else:
        with np.errstate(over="ignore", invalid="ignore"):  # overflow is reported below
            single = array.astype(np.float32)
    if not np.isfinite(single).all():
        bad = int(np.flatnonzero(~np.isfinite(single))[0])
        raise ValueError(
            f"{field}: expected finite float32 values, got {array[bad]} at index {bad}"
        )
    return _frozen(single)


def _integer(field: str, value: Any, *, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{field}: expected an int, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{field}: expected an int >= {minimum}, got {value}")
    return int(value)


def _arrays_equal(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and np.array_equal(a, b)


@dataclasses.dataclass(frozen=True, eq=False)
class Call:
    """One engine request of a session, exactly as the engine served it.

    Args:
        prompt_ids: ``[P]`` the context ids the engine read, P >= 1.
        sampled_ids: ``[S]`` the ids it drew, EOS included on a natural stop; may be empty
            (a request aborted before its first token).
        behavior_log_probs: ``[S]`` the engine's log-probability of each sampled id under the
            distribution it actually sampled from (after temperature and filters).
        finish_reason: why the draw ended, as the engine says it (``"stop"`` on EOS or a stop
            sequence, ``"length"`` on the budget, ``"abort"``...).
        version: the policy version served when the request was submitted (>= 0).
        log_probs: ``[S]`` raw model log-probabilities of the sampled ids, when the engine
            reports them; ``pack`` puts them in ``old_log_probs`` (else the behavior ones).
        routed_experts: ``[n, layers, top_k]`` integer expert ids per position, in the
            engine's dtype, covering the call's ids (prompt then sampled) from position 0;
            ``n <= P + S`` (engines usually report one fewer than P + S: the last sampled id
            never goes through the model).
        support: one entry per sampled id: the ids the sampler kept (top-k/top-p support),
            each a nonempty set of distinct ids that holds the sampled id.

    Raises:
        TypeError: a field has the wrong type (float or bool ids, non-int version...).
        ValueError: an empty context, a negative id, misaligned or non-finite likelihoods,
            routing longer than the call, a support that misses its sampled id.

    The upper bound of ids (the vocabulary) and the agreement of ``finish_reason`` with EOS
    are left to the caller, which knows the model; :meth:`check_eos` does the latter.

    Example:
        >>> call = Call([1, 2, 3], [7, 2], [-0.5, -0.1], "stop", version=4)
        >>> call.sampled_ids.tolist(), call.old_log_probs.tolist()
        ([7, 2], [-0.5, -0.10000000149011612])
    """

    prompt_ids: np.ndarray
    sampled_ids: np.ndarray
    behavior_log_probs: np.ndarray
    finish_reason: str
    version: int
    log_probs: np.ndarray | None = None
    routed_experts: np.ndarray | None = None
    support: tuple[np.ndarray, ...] | None = None

    def __post_init__(self) -> None:
        put = object.__setattr__
        put(self, "prompt_ids", _ids("Call.prompt_ids", self.prompt_ids, nonempty=True))
        sampled = _ids("Call.sampled_ids", self.sampled_ids)
        put(self, "sampled_ids", sampled)
        n = sampled.size
        put(
            self,
            "behavior_log_probs",
            _likelihoods("Call.behavior_log_probs", self.behavior_log_probs, n),
        )
        if self.log_probs is not None:
            put(self, "log_probs", _likelihoods("Call.log_probs", self.log_probs, n))
        if not isinstance(self.finish_reason, str):
            raise TypeError(f"Call.finish_reason: expected a str, got {self.finish_reason!r}")
        put(self, "version", _integer("Call.version", self.version, minimum=0))
        if self.routed_experts is not None:
            put(self, "routed_experts", self._routing(self.routed_experts))
        if self.support is not None:
            put(self, "support", self._support(self.support))

    def _routing(self, value: Any) -> np.ndarray:
        array = np.asarray(value)
        if array.dtype == np.bool_ or not np.issubdtype(array.dtype, np.integer):
            raise TypeError(f"Call.routed_experts: expected integer expert ids, got {array.dtype}")
        total = self.length
        if array.ndim != 3 or not 1 <= array.shape[0] <= total:
            raise ValueError(
                f"Call.routed_experts: expected shape [n, layers, top_k] with 1 <= n <= "
                f"{total} (prompt + sampled ids), got {array.shape}"
            )
        if array.size and array.min() < 0:
            raise ValueError("Call.routed_experts: expected nonnegative expert ids")
        return _frozen(array)

    def _support(self, value: Any) -> tuple[np.ndarray, ...]:
        if isinstance(value, np.ndarray | str) or not isinstance(value, Sequence):
            raise TypeError(
                f"Call.support: expected a sequence of id arrays, one per sampled id, "
                f"got {type(value).__name__}"
            )
        if len(value) != self.sampled_ids.size:
            raise ValueError(
                f"Call.support: expected one entry per sampled id ({self.sampled_ids.size}), "
                f"got {len(value)}"
            )
        kept = []
        for i, entry in enumerate(value):
            ids = _ids(f"Call.support[{i}]", entry, nonempty=True)
            if np.unique(ids).size != ids.size:
                raise ValueError(f"Call.support[{i}]: expected distinct ids, got {ids.tolist()}")
            if not np.any(ids == self.sampled_ids[i]):
                raise ValueError(
                    f"Call.support[{i}]: the sampled id {int(self.sampled_ids[i])} is not in "
                    f"its support {ids.tolist()}"
                )
            kept.append(ids)
        return tuple(kept)

    @property
    def length(self) -> int:
        """Number of ids the call covers: prompt plus sampled."""
        return int(self.prompt_ids.size + self.sampled_ids.size)

    @property
    def old_log_probs(self) -> np.ndarray:
        """Raw log-probabilities when recorded, else the behavior ones (``old_log_probs``)."""
        return self.behavior_log_probs if self.log_probs is None else self.log_probs

    def check_eos(self, eos: int | Sequence[int]) -> None:
        """Check the draw against the model's EOS id(s).

        Args:
            eos: one EOS id or several.

        Raises:
            ValueError: a sampled id follows an EOS, or the draw ends on EOS while
                ``finish_reason`` is not ``"stop"``.

        Example:
            >>> Call([1], [5, 2], [-1.0, -1.0], "stop", 0).check_eos(2)
        """
        eos_ids = np.atleast_1d(np.asarray(eos))
        hits = np.flatnonzero(np.isin(self.sampled_ids, eos_ids))
        if hits.size and hits[0] != self.sampled_ids.size - 1:
            raise ValueError(
                f"Call.sampled_ids: {self.sampled_ids.size - 1 - int(hits[0])} id(s) follow "
                f"EOS {int(self.sampled_ids[hits[0]])} at index {int(hits[0])}; a draw ends at EOS"
            )
        if hits.size and self.finish_reason != "stop":
            raise ValueError(
                f"Call.finish_reason: the draw ends on EOS {int(self.sampled_ids[-1])}, "
                f"so expected 'stop', got {self.finish_reason!r}"
            )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Call):
            return NotImplemented
        if (self.finish_reason, self.version) != (other.finish_reason, other.version):
            return False
        for name in ("prompt_ids", "sampled_ids", "behavior_log_probs", "log_probs"):
            if not _arrays_equal(getattr(self, name), getattr(other, name)):
                return False
        if not _arrays_equal(self.routed_experts, other.routed_experts):
            return False
        if (self.support is None) != (other.support is None):
            return False
        return self.support is None or all(
            np.array_equal(a, b) for a, b in zip(self.support, other.support, strict=True)
        )

    __hash__ = None  # type: ignore[assignment]  # holds arrays


@dataclasses.dataclass(frozen=True)
class Session:
    """One harness session on one task: its calls, its outcome and its reward.

    Args:
        task: the task's id (a :class:`Task` is accepted and replaced by its id).
        group: the group the session's advantage is computed in, with its task.
        sample: its index within the group (>= 0).
        attempt: how many failed attempts preceded it (>= 0).
        calls: the engine calls in submission order (may be empty).
        status: how it ended; a :class:`Status` or its name.
        reward: the verifier's scalar reward, or None when it was never scored.
        components: named parts of the reward (for metrics), each finite.
        detail: free text from the harness or verifier (an error message...).

    Raises:
        TypeError: a field has the wrong type.
        ValueError: a negative sample/attempt, a non-finite reward or component.

    Example:
        >>> s = Session(Task(3), 0, 1, 0, [Call([1], [2], [-0.3], "stop", 0)], "COMPLETED", 1.0)
        >>> s.task, s.status
        (3, <Status.COMPLETED: 'completed'>)
    """

    task: int
    group: int
    sample: int
    attempt: int
    calls: tuple[Call, ...]
    status: Status
    reward: float | None = None
    components: Mapping[str, float] = dataclasses.field(default_factory=dict)
    detail: str = ""

    def __post_init__(self) -> None:
        put = object.__setattr__
        task = self.task.id if isinstance(self.task, Task) else self.task
        put(self, "task", _integer("Session.task", task))
        put(self, "group", _integer("Session.group", self.group))
        put(self, "sample", _integer("Session.sample", self.sample, minimum=0))
        put(self, "attempt", _integer("Session.attempt", self.attempt, minimum=0))
        if isinstance(self.calls, Call) or not isinstance(self.calls, Sequence):
            raise TypeError(f"Session.calls: expected a sequence of Call, got {self.calls!r}")
        for i, call in enumerate(self.calls):
            if not isinstance(call, Call):
                raise TypeError(f"Session.calls[{i}]: expected a Call, got {type(call).__name__}")
        put(self, "calls", tuple(self.calls))
        put(self, "status", Status.parse(self.status))
        if self.reward is not None:
            put(self, "reward", _finite("Session.reward", self.reward))
        if not isinstance(self.components, Mapping):
            raise TypeError(f"Session.components: expected a mapping, got {self.components!r}")
        components = {}
        for name, value in self.components.items():
            if not isinstance(name, str):
                raise TypeError(f"Session.components: expected str keys, got {name!r}")
            components[name] = _finite(f"Session.components[{name!r}]", value)
        put(self, "components", components)
        if not isinstance(self.detail, str):
            raise TypeError(f"Session.detail: expected a str, got {self.detail!r}")

    def describe(self) -> str:
        """A short identity for error messages: task, group, sample, attempt."""
        return (
            f"task {self.task!r}, group {self.group}, sample {self.sample}, "
            f"attempt {self.attempt}, {self.status.name}"
        )

    __hash__ = None  # type: ignore[assignment]  # holds arrays


def assemble(cls: type[_R], fields: Mapping[str, Any]) -> _R:
    """A ``Call`` or ``Session`` from fields that already hold what its checks would make of
    them, without running the checks.

    For readers that check a whole column of records at once (``from_arrow``): every
    field must be given, arrays read-only views of the right dtype, ``calls`` a tuple of
    Call, ``status`` a Status, ints and floats Python numbers.
    """
    record = object.__new__(cls)
    record.__dict__.update(fields)
    return record


def _finite(field: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise TypeError(f"{field}: expected a real number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{field}: expected a finite number, got {value}")
    return value


def check_sessions(sessions: Any) -> None:
    """Check that ``sessions`` is a sequence of :class:`Session` (what ``pack`` and friends take).

    Raises:
        TypeError: a single Session or a non-sequence, or an element that is not a Session
            (naming its index).

    Example:
        >>> check_sessions([Session(0, 0, 0, 0, [], "CANCELLED")])
        >>> check_sessions([None])
        Traceback (most recent call last):
        ...
        TypeError: sessions[0]: expected a Session, got NoneType
    """
    if isinstance(sessions, Session) or not isinstance(sessions, Sequence):
        raise TypeError(f"sessions: expected a sequence of Session, got {type(sessions).__name__}")
    for i, session in enumerate(sessions):
        if not isinstance(session, Session):
            raise TypeError(f"sessions[{i}]: expected a Session, got {type(session).__name__}")


@runtime_checkable
class SessionSource(Protocol):
    """Runs tasks and reports sessions: what a rollout scheduler draws from.

    ``submit`` starts one session of ``task`` and returns at once with a future; the future
    resolves to a :class:`Session` whatever the outcome (failures are statuses, not
    exceptions; an exception means the source itself is broken). The session carries the
    identity it was submitted under. ``cancel`` asks a running session to stop at its next
    opportunity; its future then resolves to a CANCELLED session. ``close`` releases what the
    source holds (threads, environments); submissions after it fail.

    A source may also offer ``submit_many(requests)``: a list of ``(task, group, sample,
    attempt)`` tuples in, one future per request out, in order, as ``submit`` on each would
    give. It is optional (not part of the protocol's check); the rollout stage hands it a
    whole task batch when it is there (`dew_pipe.inference.PromptSource` has one).

    Example:
        >>> import concurrent.futures as cf
        >>> class Echo:
        ...     def submit(self, task, *, group, sample, attempt):
        ...         future = cf.Future()
        ...         call = Call(task.data, [1], [-0.1], "stop", 0)
        ...         future.set_result(Session(task, group, sample, attempt, [call], "COMPLETED", 1.0))
        ...         return future
        ...     def cancel(self, future): pass
        ...     def close(self): pass
        >>> isinstance(Echo(), SessionSource)
        True
    """

    def submit(self, task: Task, *, group: int, sample: int, attempt: int) -> Future[Session]:
        """Start one session of ``task`` under this identity."""
        ...

    def cancel(self, future: Future[Session]) -> None:
        """Ask the session behind ``future`` to stop."""
        ...

    def close(self) -> None:
        """Release everything the source holds."""
        ...
