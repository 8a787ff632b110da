"""Tool episodes: the Environment protocol and the records of one multi-turn episode.

An *episode* is one run of a policy against an environment you supply. The environment is
a context manager; ``reset()`` gives the first :class:`Observation` (the exact context ids
the model reads) and ``step(action)`` takes one finished model turn (an :class:`Action`)
and gives either the exact next context (status RUNNING) or a terminal result. It owns
decoding, tool-call validation, chat formatting, execution, timeouts and its resources;
dew_pipe never executes generated code itself. An environment may also offer
``get_state() -> bytes`` and ``set_state(bytes)`` (snapshots; only a journal needs them).

Records, all frozen and compared by value:

* :class:`EpisodeId`: task, attempted step, sample index and seed, what the environment
  factory receives;
* :class:`Observation` with its :class:`EpisodeStatus` (running, completed, truncated,
  cancelled, error) and a free-text detail;
* :class:`Action`: one model call exactly as the policy returned it (context, sampled ids,
  raw and behavior log-probabilities, the EOS termination flag, the policy step);
* :class:`Transition` ``(action, observation)`` and :class:`Episode`, the first observation
  followed by the transitions, with the final status, detail and the verifier's reward.

Failures: :class:`EpisodeFailure` carries the partial episode; :class:`EpisodeCancelled`
(a subclass) is what both ``asyncio.CancelledError`` and
``concurrent.futures.CancelledError`` become, with the original cancellation as
``__cause__`` (None when the environment itself returned a CANCELLED observation).

Episodes and actions also keep an *origin*: an opaque identity of the collection binding
(one ``policy.bind``) that produced them. It is not a version you set nor a hash of the
weights, it never takes part in equality, and projection
(:mod:`~dew_pipe.objectives.rl.episode_sessions`) refuses to mix two of them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import dataclasses
import itertools
import math
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from dew_pipe._validate import check_int
from dew_pipe.objectives.rl.session_records import Call, ParsedStatus
from dew_pipe.objectives.rl.session_records import _ids as _token_ids

__all__ = [
    "Action",
    "Environment",
    "Episode",
    "EpisodeCancelled",
    "EpisodeFailure",
    "EpisodeId",
    "EpisodeStatus",
    "Observation",
    "Origin",
    "Transition",
    "is_cancellation",
]

CANCELLATIONS = (asyncio.CancelledError, cf.CancelledError)
"""The cancellation types that become :class:`EpisodeCancelled` (distinct classes in 3.8+)."""


def is_cancellation(error: BaseException) -> bool:
    """True for an asyncio or concurrent.futures cancellation.

    Example:
        >>> is_cancellation(asyncio.CancelledError()), is_cancellation(ValueError())
        (True, False)
    """
    return isinstance(error, CANCELLATIONS)


class EpisodeStatus(ParsedStatus):
    """Where an episode stands after an observation."""

    RUNNING = "running"
    """The environment waits for the next model turn; the observation carries its context."""
    COMPLETED = "completed"
    """The environment ended the episode; the verifier scores it and it trains."""
    TRUNCATED = "truncated"
    """A context, token or turn limit ended it; scored, but masked out of training."""
    CANCELLED = "cancelled"
    """Stopped from outside (a cancellation); never trains."""
    ERROR = "error"
    """The environment or its resources failed; never trains."""


class Origin:
    """The identity of one collection binding (internal; compared by identity only).

    Its number only makes messages readable; two bindings never share an Origin object.
    """

    _numbers = itertools.count(1)

    def __init__(self) -> None:
        self.number = next(self._numbers)

    def __repr__(self) -> str:
        return f"<collection binding {self.number}>"


@dataclasses.dataclass(frozen=True)
class EpisodeId:
    """What an environment factory receives: which episode to open.

    Args:
        task: the task id (the ``task_id`` row of the input batch).
        step: the attempted-work clock (the trainer's ``state.step``) it was collected at.
        sample: its index within the task's group (>= 0).
        seed: a random seed for the environment (>= 0), drawn from the collection key.

    Example:
        >>> EpisodeId(task=3, step=0, sample=1, seed=42).task
        3
    """

    task: int
    step: int
    sample: int
    seed: int

    def __post_init__(self) -> None:
        put = object.__setattr__
        put(self, "task", check_int("EpisodeId.task", self.task))
        put(self, "step", check_int("EpisodeId.step", self.step, minimum=0))
        put(self, "sample", check_int("EpisodeId.sample", self.sample, minimum=0))
        put(self, "seed", check_int("EpisodeId.seed", self.seed, minimum=0))


@dataclasses.dataclass(frozen=True, eq=False)
class Observation:
    """What the environment says after a reset or a step.

    Args:
        context: ``[P]`` the exact ids the model reads next; required (nonempty) while
            RUNNING, optional on a terminal observation (a final transcript, say).
        status: an :class:`EpisodeStatus` or its name; RUNNING by default.
        detail: free text for the verifier and the logs (a result, an error message...).

    Raises:
        TypeError / ValueError: a context that is not 1-D nonnegative integer ids, a
            RUNNING observation without one, an unknown status, a detail that is not a str.

    Example:
        >>> Observation([2, 5]).status, Observation(status="completed", detail="4").detail
        (<EpisodeStatus.RUNNING: 'running'>, '4')
    """

    context: np.ndarray | None = None
    status: EpisodeStatus = EpisodeStatus.RUNNING
    detail: str = ""

    def __post_init__(self) -> None:
        put = object.__setattr__
        put(self, "status", EpisodeStatus.parse(self.status))
        if self.context is not None:
            put(self, "context", _token_ids("Observation.context", self.context, nonempty=True))
        elif self.status is EpisodeStatus.RUNNING:
            raise ValueError(
                "Observation.context is None; a RUNNING observation must carry the exact "
                "context ids the model reads next"
            )
        if not isinstance(self.detail, str):
            raise TypeError(f"Observation.detail is {self.detail!r}; expected a str")

    @property
    def running(self) -> bool:
        """True while the episode waits for another model turn."""
        return self.status is EpisodeStatus.RUNNING

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Observation):
            return NotImplemented
        if (self.status, self.detail) != (other.status, other.detail):
            return False
        if self.context is None or other.context is None:
            return self.context is None and other.context is None
        return np.array_equal(self.context, other.context)

    __hash__ = None  # type: ignore[assignment]  # holds arrays


@dataclasses.dataclass(frozen=True, eq=False)
class Action:
    """One finished model turn, exactly as the policy returned it.

    Args:
        context: ``[P]`` the context ids the model read (nonempty).
        tokens: ``[S]`` the sampled ids, EOS included when EOS ended the turn (S >= 1).
        log_probs: ``[S]`` raw model log-probabilities of the sampled ids.
        behavior_log_probs: ``[S]`` log-probabilities under the distribution they were drawn
            from (temperature and filters applied).
        stopped: the termination flag: True when EOS ended the turn, False when the budget
            did.
        policy_step: the committed update clock of the weights that sampled it (>= 0).
        origin: the collection binding that produced it (internal; see the module docstring).

    Raises:
        TypeError / ValueError: as :class:`~dew_pipe.objectives.rl.sessions.Call` (empty
            context, negative or non-integer ids, misaligned or non-finite likelihoods), no
            sampled id, a non-bool ``stopped``.

    Example:
        >>> a = Action([2, 5], [3, 1], [-0.5, -0.2], [-0.4, -0.1], stopped=True, policy_step=0)
        >>> a.call().finish_reason
        'stop'
    """

    context: np.ndarray
    tokens: np.ndarray
    log_probs: np.ndarray
    behavior_log_probs: np.ndarray
    stopped: bool
    policy_step: int
    origin: Origin | None = dataclasses.field(default=None, repr=False, kw_only=True)

    def __post_init__(self) -> None:
        if not isinstance(self.stopped, bool | np.bool_):
            raise TypeError(f"Action.stopped is {self.stopped!r}; expected True or False")
        # The Call record holds the one set of checks for ids and likelihoods.
        call = Call(
            self.context,
            self.tokens,
            self.behavior_log_probs,
            "stop" if self.stopped else "length",
            self.policy_step,
            log_probs=self.log_probs,
        )
        if call.sampled_ids.size == 0:
            raise ValueError("Action.tokens is empty; expected at least one sampled id")
        put = object.__setattr__
        put(self, "context", call.prompt_ids)
        put(self, "tokens", call.sampled_ids)
        put(self, "log_probs", call.log_probs)
        put(self, "behavior_log_probs", call.behavior_log_probs)
        put(self, "stopped", bool(self.stopped))
        put(self, "policy_step", call.version)
        put(self, "_call", call)

    def call(self) -> Call:
        """This action as the session record ``pack`` trains on (version = policy step)."""
        return self._call  # type: ignore[attr-defined]

    def check_eos(self, eos_ids: Sequence[int]) -> None:
        """Check the termination flag against the configured EOS ids.

        Raises:
            ValueError: ids after an EOS, a stopped action that does not end on EOS, or one
                that ends on EOS without being stopped.

        Example:
            >>> Action([2], [4], [-1.0], [-1.0], stopped=True, policy_step=0).check_eos([1])
            Traceback (most recent call last):
            ...
            ValueError: Action.stopped is True but the last sampled id 4 is not an EOS id (1,)
        """
        eos = tuple(int(i) for i in eos_ids)
        hits = np.flatnonzero(np.isin(self.tokens, eos))
        if hits.size and hits[0] != self.tokens.size - 1:
            raise ValueError(
                f"Action.tokens: {self.tokens.size - 1 - int(hits[0])} id(s) follow EOS "
                f"{int(self.tokens[hits[0]])} at index {int(hits[0])}; a turn ends at EOS"
            )
        if self.stopped and not hits.size:
            raise ValueError(
                f"Action.stopped is True but the last sampled id {int(self.tokens[-1])} is "
                f"not an EOS id {eos}"
            )
        if hits.size and not self.stopped:
            raise ValueError(
                f"Action.stopped is False but the draw ends on EOS {int(self.tokens[-1])}"
            )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Action):
            return NotImplemented
        return self.stopped == other.stopped and self._call == other._call  # type: ignore[attr-defined]

    __hash__ = None  # type: ignore[assignment]  # holds arrays


@dataclasses.dataclass(frozen=True)
class Transition:
    """One model turn and what followed it.

    ``observation`` is the environment's reply to ``action``; for an action that was never
    sent to the environment (it ran out of budget) it is the TRUNCATED observation the
    rollout wrote in its place, without a context.
    """

    action: Action
    observation: Observation

    def __post_init__(self) -> None:
        if not isinstance(self.action, Action):
            raise TypeError(f"Transition.action is {type(self.action).__name__}; expected Action")
        if not isinstance(self.observation, Observation):
            raise TypeError(
                f"Transition.observation is {type(self.observation).__name__}; expected Observation"
            )

    __hash__ = None  # type: ignore[assignment]  # holds arrays


@dataclasses.dataclass(frozen=True)
class Episode:
    """One episode: its identity, first observation, transitions and outcome.

    Args:
        id: the :class:`EpisodeId` the environment was opened with.
        first: the observation ``reset()`` returned.
        transitions: the model turns in order.
        status: how it stands: RUNNING while partial, else its terminal status.
        detail: why it ended (the environment's terminal detail, or the limit that hit).
        reward: the verifier's finite reward, None until scored.
        origin: the collection binding that produced it (internal; see the module docstring).

    Raises:
        TypeError / ValueError: fields of the wrong type, a non-finite reward.

    Example:
        >>> first = Observation([2, 6])
        >>> e = Episode(EpisodeId(0, 0, 0, 7), first, (), "running")
        >>> e.actions, e.context.tolist()
        ((), [2, 6])
    """

    id: EpisodeId
    first: Observation
    transitions: tuple[Transition, ...] = ()
    status: EpisodeStatus = EpisodeStatus.RUNNING
    detail: str = ""
    reward: float | None = None
    origin: Origin | None = dataclasses.field(default=None, compare=False, kw_only=True)

    def __post_init__(self) -> None:
        put = object.__setattr__
        if not isinstance(self.id, EpisodeId):
            raise TypeError(f"Episode.id is {type(self.id).__name__}; expected EpisodeId")
        if not isinstance(self.first, Observation):
            raise TypeError(f"Episode.first is {type(self.first).__name__}; expected Observation")
        if isinstance(self.transitions, Transition) or not isinstance(self.transitions, Sequence):
            raise TypeError(
                f"Episode.transitions is {type(self.transitions).__name__}; expected a sequence "
                "of Transition"
            )
        for i, transition in enumerate(self.transitions):
            if not isinstance(transition, Transition):
                raise TypeError(
                    f"Episode.transitions[{i}] is {type(transition).__name__}; expected Transition"
                )
        put(self, "transitions", tuple(self.transitions))
        put(self, "status", EpisodeStatus.parse(self.status))
        if not isinstance(self.detail, str):
            raise TypeError(f"Episode.detail is {self.detail!r}; expected a str")
        if self.reward is not None:
            reward = self.reward
            if isinstance(reward, bool) or not isinstance(
                reward, int | float | np.integer | np.floating
            ):
                raise TypeError(f"Episode.reward is {reward!r}; expected a finite float")
            if not math.isfinite(float(reward)):
                raise ValueError(f"Episode.reward is {reward!r}; expected a finite float")
            put(self, "reward", float(reward))

    @property
    def actions(self) -> tuple[Action, ...]:
        """The sampled actions in order (the calls a session trains on)."""
        return tuple(t.action for t in self.transitions)

    @property
    def last(self) -> Observation:
        """The latest observation (``first`` before any transition)."""
        return self.transitions[-1].observation if self.transitions else self.first

    @property
    def context(self) -> np.ndarray | None:
        """The context the model would read next (the latest observation's)."""
        return self.last.context

    def describe(self) -> str:
        """A short identity for messages."""
        i = self.id
        return f"episode (task {i.task}, step {i.step}, sample {i.sample}, seed {i.seed})"

    __hash__ = None  # type: ignore[assignment]  # holds arrays


class EpisodeFailure(Exception):
    """An episode (and with it its collection) failed; nothing of the collection trains.

    Attributes:
        episode: the partial :class:`Episode` it happened in, with its final status.
        episodes: every episode of the collection as it stood (partial ones included).
        status: ``episode.status`` (ERROR, or CANCELLED for :class:`EpisodeCancelled`).
    """

    def __init__(self, message: str, episode: Episode, episodes: Sequence[Episode] = ()) -> None:
        super().__init__(message)
        self.episode = episode
        self.episodes = tuple(episodes) or (episode,)

    @property
    def status(self) -> EpisodeStatus:
        return self.episode.status


class EpisodeCancelled(EpisodeFailure):
    """An episode was cancelled: its status is CANCELLED.

    ``__cause__`` is the original ``asyncio.CancelledError`` or
    ``concurrent.futures.CancelledError``; None when the environment itself returned a
    CANCELLED observation. The environment has already exited under that original exception
    when this is raised.
    """


@runtime_checkable
class Environment(Protocol):
    """One episode's environment, used as a context manager.

    ``__enter__`` acquires its resources and returns the object ``reset``/``step`` are called
    on; ``__exit__`` releases them, after verification, and sees the exception that ended
    the episode when one did (a cancellation exits under the original cancellation). A
    release that raises throws the episode out instead of scoring it.

    Optional: ``get_state() -> bytes`` and ``set_state(state: bytes) -> None`` snapshot the
    tool and workspace state (needed only by a journal).

    Example:
        >>> class Echo:
        ...     def __enter__(self): return self
        ...     def __exit__(self, *exc): return None
        ...     def reset(self): return Observation([2, 6])
        ...     def step(self, action):
        ...         return Observation(status="completed", detail=str(action.tokens.tolist()))
        >>> isinstance(Echo(), Environment)
        True
    """

    def __enter__(self) -> Any: ...

    def __exit__(self, exc_type: Any, exc: Any, traceback: Any) -> bool | None: ...

    def reset(self) -> Observation:
        """The first observation (RUNNING, with the first context)."""
        ...

    def step(self, action: Action) -> Observation:
        """The exact next context (RUNNING) or a terminal result after ``action``."""
        ...
