"""Episodes as sessions: tool episodes train through the same ``pack`` as any rollout.

:func:`session_of` turns one :class:`~dew_pipe.objectives.rl.episodes.Episode` into a
:class:`~dew_pipe.objectives.rl.sessions.Session` whose calls are its actions, each exactly
as the policy returned it (context, sampled ids, raw log-probabilities into
``old_log_probs``, behavior ones into ``behavior_log_probs``, the policy step as version):
nothing is retokenized or rescored. ``pack`` then merges a call into the previous call's
chain only when its context starts with that call's context plus its sampled ids (an
append-only chat template); any other context starts a new chain, so a template that
re-renders history splits chains instead of splicing ids the model never read together.
Observations are context, never targets: only sampled ids (EOS included) carry loss mass.

Statuses map as: COMPLETED -> COMPLETED (trains on its reward), TRUNCATED -> TRUNCATED
(``pack_episodes`` masks it: no rows, no part in its group's baseline), CANCELLED ->
CANCELLED, ERROR -> INFRA_ERROR (neither trains).

:func:`pack_episodes` is the projection of one collection: it refuses episodes (or actions
within an episode) that come from two collection bindings, by their internal origin
identity, even when their clocks match.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from dew_pipe._validate import check_int
from dew_pipe.objectives.rl.episodes import Episode, EpisodeStatus
from dew_pipe.objectives.rl.packing import pack
from dew_pipe.objectives.rl.session_records import Session, Status

__all__ = ["STATUSES", "pack_episodes", "session_of"]

STATUSES: dict[EpisodeStatus, Status] = {
    EpisodeStatus.COMPLETED: Status.COMPLETED,
    EpisodeStatus.TRUNCATED: Status.TRUNCATED,
    EpisodeStatus.CANCELLED: Status.CANCELLED,
    EpisodeStatus.ERROR: Status.INFRA_ERROR,
}
"""The session status of each terminal episode status."""


def session_of(episode: Episode, group: int, *, attempt: int = 0) -> Session:
    """The session of ``episode``: its actions as calls, its status, reward and detail.

    Args:
        episode: a finished episode (not RUNNING).
        group: the group its advantage is computed in, with its task (the input row).
        attempt: failed attempts before it (>= 0).

    Returns:
        ``Session(task=episode.id.task, group, sample=episode.id.sample, attempt, calls)``.

    Raises:
        TypeError: ``episode`` is not an Episode.
        ValueError: a RUNNING episode; a COMPLETED one without a reward; an action whose
            origin is not the episode's (records of two collection bindings).

    Example:
        >>> from dew_pipe.objectives.rl.episodes import (
        ...     Action, EpisodeId, Observation, Transition)
        >>> act = Action([2, 6], [3, 1], [-0.5, -0.2], [-0.4, -0.1], True, 0)
        >>> done = Observation(status="completed", detail="36")
        >>> e = Episode(EpisodeId(0, 0, 0, 7), Observation([2, 6]), [Transition(act, done)],
        ...             "completed", reward=1.0)
        >>> s = session_of(e, group=0)
        >>> s.status, s.calls[0].sampled_ids.tolist(), s.calls[0].log_probs.tolist()
        (<Status.COMPLETED: 'completed'>, [3, 1], [-0.5, -0.20000000298023224])
    """
    if not isinstance(episode, Episode):
        raise TypeError(f"episode is {type(episode).__name__}; expected an Episode")
    group = check_int("group", group)
    if episode.status is EpisodeStatus.RUNNING:
        raise ValueError(
            f"{episode.describe()} is still RUNNING; only finished episodes become sessions"
        )
    if episode.status is EpisodeStatus.COMPLETED and episode.reward is None:
        raise ValueError(
            f"{episode.describe()} is COMPLETED without a reward; expected the verifier's reward"
        )
    for k, action in enumerate(episode.actions):
        if action.origin is not episode.origin:
            raise ValueError(
                f"{episode.describe()}: action {k} comes from {action.origin!r} but the "
                f"episode from {episode.origin!r}; records of two collection bindings cannot "
                "be projected together"
            )
    return Session(
        episode.id.task,
        group,
        episode.id.sample,
        check_int("attempt", attempt, minimum=0),
        [action.call() for action in episode.actions],
        STATUSES[episode.status],
        episode.reward,
        detail=episode.detail,
    )


def pack_episodes(
    episodes: Sequence[Episode],
    groups: Sequence[int],
    width: int,
    rows: int | None = None,
    estimator: str = "group",
) -> dict[str, np.ndarray]:
    """The packed GRPO batch of one collection's episodes.

    Args:
        episodes: finished episodes of one collection binding; ``session_index`` refers to
            positions in this list.
        groups: the group of each episode (its input row), one per episode.
        width: ids per row, ``max_prompt_tokens + max_new_tokens``
            (``GRPOObjective(seq_len=width - 1)``).
        rows: rows of the batch (``B * G * max_turns`` keeps one shape); None: as needed.
        estimator: ``"group"``, ``"mean"`` or ``"rloo"`` over each group's scored episodes.

    Returns:
        ``pack``'s columns; truncated episodes are masked (no rows, out of the baseline).

    Raises:
        TypeError / ValueError: as :func:`session_of` and ``pack``; ``groups`` of another
            length; episodes from two collection bindings (names both).
    """
    if isinstance(episodes, Episode) or not isinstance(episodes, Sequence):
        raise TypeError(f"episodes is {type(episodes).__name__}; expected a list of Episode")
    if len(groups) != len(episodes):
        raise ValueError(
            f"groups has {len(groups)} entries for {len(episodes)} episodes; expected one each"
        )
    origin: Any = None
    for i, episode in enumerate(episodes):
        if not isinstance(episode, Episode):
            raise TypeError(f"episodes[{i}] is {type(episode).__name__}; expected an Episode")
        if i == 0:
            origin = episode.origin
        elif episode.origin is not origin:
            raise ValueError(
                f"episodes[{i}] comes from {episode.origin!r} but episodes[0] from {origin!r}; "
                "project the batches of separate collections on their own"
            )
    sessions = [session_of(e, g) for e, g in zip(episodes, groups, strict=True)]
    return pack(sessions, width=width, rows=rows, estimator=estimator, truncation="mask")
