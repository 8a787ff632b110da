"""One collection of :class:`~dew_pipe.objectives.rl.EpisodeRollout`: its slots and the rules
that move them (steps 2-5 of the rollout's docstring), with the journal's commit points.

A :class:`Slot` is one episode being collected; a :class:`Collection` opens the slots, runs
the lock-step rounds (draw every running slot, then step each environment), settles each
episode as it ends (verify while open, release, record) and, on any failure, aborts them
all. With a journal (:mod:`~dew_pipe.objectives.rl.episode_journal`) it commits each slot
after its reset and after each turn, and a round's draws before its first tool call; a
resumed collection rebuilds the slots from those records instead (finished episodes whole,
running ones by ``set_state`` of their last snapshot) and reuses journaled draws.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from dew_pipe.objectives.rl.episode_journal import JournaledCollection, JournalError, SavedSlot
from dew_pipe.objectives.rl.episodes import (
    Action,
    Episode,
    EpisodeCancelled,
    EpisodeFailure,
    EpisodeId,
    EpisodeStatus,
    Observation,
    Origin,
    Transition,
    is_cancellation,
)

__all__ = ["Collection", "Slot", "cause_of"]

INERT = np.zeros(1, np.int32)  # a finished slot's prompt in a lock-step round; output unused


class Slot:
    """One episode being collected: its environment and what it has recorded so far."""

    def __init__(self, episode_id: EpisodeId) -> None:
        self.id = episode_id
        self.manager: Any = None  # what the factory returned (its __exit__ releases)
        self.env: Any = None  # what __enter__ returned (reset/step are called on it)
        self.open = False
        self.first: Observation | None = None
        self.transitions: list[Transition] = []
        self.status = EpisodeStatus.RUNNING
        self.detail = ""
        self.reward: float | None = None
        self.recorded = False
        self.pending: Action | None = None  # sent to step(), no observation back yet

    def episode(self, origin: Origin) -> Episode:
        first = self.first
        if first is None:  # reset never returned: the failure stands in for its observation
            first = Observation(status=EpisodeStatus.ERROR, detail=self.detail)
        return Episode(
            self.id,
            first,
            self.transitions,
            self.status,
            self.detail,
            self.reward,
            origin=origin,
        )

    @property
    def context(self) -> np.ndarray:
        last = self.transitions[-1].observation if self.transitions else self.first
        return last.context

    def restore(self, saved: SavedSlot) -> None:
        """Takes the journal's record of this slot."""
        self.first = saved.first
        self.transitions = [Transition(a, o) for a, o in saved.transitions]
        self.status, self.detail, self.reward = saved.status, saved.detail, saved.reward


class Collection:
    """The slots of one collection and the rules that move them (see the module docstring).

    Args:
        rollout: the EpisodeRollout (its factory, verifier, budgets, sampling and record).
        ids: the episode identities, in slot order.
        version: the committed update clock every action carries.
        origin: the identity of this collection's binding.
        journal: this collection's journal records, or None.
    """

    def __init__(
        self,
        rollout: Any,
        ids: Sequence[EpisodeId],
        version: int,
        origin: Origin,
        journal: JournaledCollection | None = None,
    ) -> None:
        self.rollout = rollout
        self.slots = [Slot(i) for i in ids]
        self.version = version
        self.origin = origin
        self.journal = journal
        self.at: Slot | None = None  # the slot whose environment or verifier runs now

    def running(self) -> list[int]:
        return [i for i, s in enumerate(self.slots) if s.status is EpisodeStatus.RUNNING]

    # ------------------------------------------------------------------ opening

    def open(self, index: int) -> None:
        """Enters slot ``index``'s environment and resets it (or restores it from the journal)."""
        slot = self.slots[index]
        saved = self.journal.slot(index) if self.journal is not None else None
        if saved is not None and saved.status is not EpisodeStatus.RUNNING:
            slot.restore(saved)  # finished before the crash: its environment stays closed
            self.report(slot)
            return
        self.at = slot
        manager = self.rollout.environment(slot.id)
        slot.env = manager.__enter__()
        slot.manager, slot.open = manager, True
        if self.journal is not None:
            _check_snapshots(slot)
        if saved is not None:
            slot.restore(saved)
            slot.env.set_state(saved.snapshot)
            return
        first = slot.env.reset()
        if isinstance(first, Observation) and first.status in (
            EpisodeStatus.COMPLETED,
            EpisodeStatus.TRUNCATED,
        ):
            raise ValueError(
                f"reset() returned a {first.status.value} observation; expected RUNNING with "
                "the first context"
            )
        self.observe(slot, first, None)
        self.commit(index, new_turn=False)

    # ------------------------------------------------------------------ one round

    def turn(self, policy: Any, key: jax.Array, round_index: int) -> None:
        """One lock-step round: draw (or reuse the journaled draws), then step each slot."""
        running = self.running()
        actions = self.journal.draws(round_index) if self.journal is not None else None
        if actions is None:
            self.at = None
            actions = self.actions(running, self.draw(policy, running, key))
            if self.journal is not None:
                self.journal.save_draws(round_index, actions)
        self.send(running, actions, round_index)

    def actions(self, running: list[int], drawn: Sequence[Any]) -> dict[int, Action]:
        """The running slots' Actions from their Generations (checked), by slot."""
        actions = {}
        for i, generation in zip(running, drawn, strict=True):
            self.at = self.slots[i]
            actions[i] = self.action(self.slots[i], generation)
        return actions

    def send(self, running: list[int], actions: dict[int, Action], round_index: int) -> None:
        """Sends each running slot's action to its environment (or truncates it)."""
        for i in running:
            slot = self.slots[i]
            if len(slot.transitions) > round_index:
                continue  # committed before a crash
            self.at = slot
            action = self._journaled(i, actions) if self.journal is not None else actions[i]
            if not action.stopped:
                detail = (
                    f"the response used max_new_tokens={self.rollout.max_new_tokens} without "
                    "EOS; not sent to the environment"
                )
                cut = Observation(status=EpisodeStatus.TRUNCATED, detail=detail)
                slot.transitions.append(Transition(action, cut))
                self.finish(slot, EpisodeStatus.TRUNCATED, detail)
            else:
                slot.pending = action
                self.observe(slot, slot.env.step(action), action)
            self.commit(i, new_turn=True)

    def _journaled(self, index: int, actions: dict[int, Action]) -> Action:
        """Slot ``index``'s action of a round, checked against the slot as restored."""
        slot, action = self.slots[index], actions.get(index)
        where = f"{self.journal.journal}: step {self.journal.step}, {slot.id}"
        if action is None:
            raise JournalError(f"{where}: the round's draws hold no action for this slot")
        if action.context.tobytes() != slot.context.tobytes():
            raise JournalError(
                f"{where}: the journaled action read another context than the restored "
                "episode's; the journal does not belong to this collection"
            )
        action.check_eos(self.rollout.sampling.eos_ids)
        return action

    def draw(self, policy: Any, running: list[int], key: jax.Array) -> list[Any]:
        budget, sampling = self.rollout.max_new_tokens, self.rollout.sampling
        if callable(getattr(policy, "batch", None)):
            contexts = [INERT] * len(self.slots)
            for i in running:
                contexts[i] = self.slots[i].context
            out = list(policy.batch(contexts, budget, key, sampling))
            if len(out) != len(contexts):
                raise ValueError(
                    f"policy.batch returned {len(out)} generations for {len(contexts)} contexts"
                )
            return [out[i] for i in running]
        return [
            policy(self.slots[i].context, budget, jax.random.fold_in(key, i), sampling)
            for i in running
        ]

    def action(self, slot: Slot, generation: Any) -> Action:
        ids = np.asarray(generation.ids)
        if ids.size > self.rollout.max_new_tokens:
            raise ValueError(
                f"the policy returned {ids.size} ids for a budget of "
                f"max_new_tokens={self.rollout.max_new_tokens}"
            )
        action = Action(
            slot.context,
            ids,
            generation.log_probs,
            generation.behavior_log_probs,
            generation.finish_reason == "stop",
            self.version,
            origin=self.origin,
        )
        action.check_eos(self.rollout.sampling.eos_ids)
        return action

    # ------------------------------------------------------------------ observing, settling

    def observe(self, slot: Slot, observation: Any, action: Action | None) -> None:
        """Records what the environment returned and ends the episode where a rule says so."""
        if not isinstance(observation, Observation):
            what = "reset()" if action is None else "step()"
            raise TypeError(
                f"{slot.id}: {what} returned {type(observation).__name__}; expected an Observation"
            )
        if action is None:
            slot.first = observation
        else:
            slot.transitions.append(Transition(action, observation))
            slot.pending = None
        status, detail = observation.status, observation.detail
        rollout = self.rollout
        if status is EpisodeStatus.ERROR:
            slot.status, slot.detail = status, detail
            raise EpisodeFailure(
                f"{slot.episode(self.origin).describe()}: the environment reported ERROR: {detail}",
                slot.episode(self.origin),
            )
        if status is EpisodeStatus.CANCELLED:
            slot.status, slot.detail = status, detail
            raise EpisodeCancelled(
                f"{slot.episode(self.origin).describe()}: the environment cancelled it: {detail}",
                slot.episode(self.origin),
            )
        if status is not EpisodeStatus.RUNNING:
            self.finish(slot, status, detail)
        elif observation.context.size > rollout.max_prompt_tokens:
            self.finish(
                slot,
                EpisodeStatus.TRUNCATED,
                f"the context has {observation.context.size} ids, more than "
                f"max_prompt_tokens={rollout.max_prompt_tokens}",
            )
        elif len(slot.transitions) >= rollout.max_turns:
            self.finish(
                slot,
                EpisodeStatus.TRUNCATED,
                f"max_turns={rollout.max_turns} model calls reached while the environment runs",
            )

    def finish(self, slot: Slot, status: EpisodeStatus, detail: str) -> None:
        """Verify while the environment is open, then release it, then record."""
        slot.status, slot.detail = status, detail
        self.at = slot
        slot.reward = _reward(self.rollout.verifier(slot.episode(self.origin)), slot)
        slot.open = False
        try:
            slot.manager.__exit__(None, None, None)
        except Exception as error:  # the episode is thrown out instead of scored
            slot.status, slot.reward = EpisodeStatus.ERROR, None
            slot.detail = f"releasing the environment failed: {error!r}"
        self.report(slot)

    def commit(self, index: int, *, new_turn: bool) -> None:
        """Commits slot ``index`` (and its newest turn) to the journal, with a snapshot of its
        environment while it still runs; nothing without a journal."""
        if self.journal is None:
            return
        slot = self.slots[index]
        snapshot = None
        if slot.open:
            snapshot = slot.env.get_state()
            if not isinstance(snapshot, bytes):
                raise TypeError(
                    f"{slot.id}: get_state() returned {type(snapshot).__name__}; expected bytes"
                )
        newest = None
        if new_turn:
            last = slot.transitions[-1]
            newest = (len(slot.transitions) - 1, last.action, last.observation)
        self.journal.commit(
            index, slot.first, newest, slot.status, slot.detail, slot.reward, snapshot
        )

    def report(self, slot: Slot) -> None:
        slot.recorded = True
        if self.rollout.record is not None:
            self.rollout.record(slot.episode(self.origin))

    # ------------------------------------------------------------------ failing

    def abort(self, error: BaseException) -> BaseException:
        """Fails every unfinished slot, exits every open environment under ``error``,
        records the failed episodes and returns the exception to raise."""
        cancelled = is_cancellation(error) or isinstance(error, EpisodeCancelled)
        status = EpisodeStatus.CANCELLED if cancelled else EpisodeStatus.ERROR
        culprit = self.at or next(
            (s for s in self.slots if s.status is EpisodeStatus.RUNNING), self.slots[0]
        )
        if not isinstance(error, EpisodeFailure):  # those set their episode's status already
            culprit.status, culprit.reward = status, None
            culprit.detail = f"{type(error).__name__}: {error}"
        if culprit.pending is not None:  # keep the action step() was handling when it failed
            ended = Observation(status=culprit.status, detail=culprit.detail)
            culprit.transitions.append(Transition(culprit.pending, ended))
            culprit.pending = None
        for slot in self.slots:
            if slot.status is EpisodeStatus.RUNNING:
                slot.status = status
                slot.detail = f"aborted with its collection: {culprit.id} failed"
        self._release(error)
        self._forget(error)
        episode = culprit.episode(self.origin)
        episodes = [s.episode(self.origin) for s in self.slots]
        if isinstance(error, EpisodeFailure):
            error.episode, error.episodes = episode, tuple(episodes)
            return error
        if not isinstance(error, Exception) and not is_cancellation(error):
            return error  # KeyboardInterrupt, SystemExit: released, then propagated as is
        kind = EpisodeCancelled if cancelled else EpisodeFailure
        what = "was cancelled" if cancelled else f"failed: {error!r}"
        return kind(f"{episode.describe()} {what}", episode, episodes)

    def abort_for_peer(self, process: int, message: str, cancelled: bool) -> EpisodeFailure:
        """Ends this process's part of a collection another process failed: every unfinished
        slot fails, every open environment exits under the returned exception, every episode
        is recorded."""
        kind = EpisodeCancelled if cancelled else EpisodeFailure
        status = EpisodeStatus.CANCELLED if cancelled else EpisodeStatus.ERROR
        what = f"process {process} ended the collection: {message}"
        for slot in self.slots:
            if slot.status is EpisodeStatus.RUNNING:
                slot.status, slot.detail = status, f"aborted with its collection: {what}"
        episodes = [s.episode(self.origin) for s in self.slots]
        error = kind(f"{what} (this process released its environments)", episodes[0], episodes)
        self._release(error)
        return error

    def _release(self, error: BaseException) -> None:
        """Exits every open environment under ``error``, then records every episode not yet
        recorded; what fails on the way becomes a note on ``error``."""
        for slot in self.slots:
            if slot.open:
                slot.open = False
                try:
                    slot.manager.__exit__(type(error), error, error.__traceback__)
                except Exception as release:
                    error.add_note(
                        f"releasing the environment of {slot.id} also failed: {release!r}"
                    )
        for slot in self.slots:
            if not slot.recorded:
                try:
                    self.report(slot)
                except Exception as failure:
                    error.add_note(f"record() raised on {slot.id}: {failure!r}")

    def _forget(self, error: BaseException) -> None:
        """A failed collection leaves nothing to resume (a retry samples it again); an
        interrupt keeps its records like a crash, and so does a journal it found wrong."""
        failed = isinstance(error, Exception) or is_cancellation(error)
        if self.journal is None or not failed or isinstance(error, JournalError):
            return
        try:
            self.journal.discard()
        except Exception as failure:
            error.add_note(f"discarding the journaled collection also failed: {failure!r}")


def cause_of(error: BaseException) -> BaseException | None:
    """What the raised wrapper's ``__cause__`` is: the original, unless it is the wrapper."""
    if isinstance(error, EpisodeFailure) or not (
        isinstance(error, Exception) or is_cancellation(error)
    ):
        return error.__cause__
    return error


def _check_snapshots(slot: Slot) -> None:
    env = slot.env
    if not (
        callable(getattr(env, "get_state", None)) and callable(getattr(env, "set_state", None))
    ):
        raise TypeError(
            f"{slot.id}: the environment {type(env).__name__} has no get_state() and "
            "set_state(); an EpisodeJournal restores turns from environment snapshots, so "
            "give the environment both or pass journal=None"
        )


def _reward(value: Any, slot: Slot) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise TypeError(
            f"the verifier returned {type(value).__name__} {value!r} for {slot.id}; "
            "expected a finite float"
        )
    if not math.isfinite(float(value)):
        raise ValueError(f"the verifier returned {value} for {slot.id}; expected a finite float")
    return float(value)
