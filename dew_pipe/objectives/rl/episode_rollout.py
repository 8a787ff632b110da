"""`EpisodeRollout`: the trainer's rollout hook for multi-turn tool episodes.

One call turns a batch of ``task_id`` rows ``[B]`` into the packed ``[B * G * K, P + R]``
batch a ``GRPOObjective(seq_len=P + R - 1)`` trains on (G ``groups``, K ``max_turns``,
P ``max_prompt_tokens``, R ``max_new_tokens``). A collection:

1. **Binds** the policy to the trainer's state once (``policy.bind(state)``) and gives the
   binding a fresh origin identity, which every episode and action keeps.
2. **Opens** B * G environments, slot ``b * G + g`` with ``EpisodeId(task_id[b],
   state.step, g, seed)`` (seeds drawn from the key), enters each and calls ``reset()``.
3. **Samples in lock-step rounds**, at most K: every slot is a row of one
   ``policy.batch(contexts, R, round_key, sampling)`` call, finished slots holding an inert
   one-id prompt whose output is thrown away, so a row's random draws depend on the key and
   its slot only. (A policy without ``batch`` is called once per running slot with
   ``fold_in(round_key, slot)``.) Each result becomes an :class:`Action` with its raw and
   behavior log-probabilities as the policy returned them, checked against the EOS ids.
4. **Steps** each environment with its action. A response that used its whole budget
   without EOS is TRUNCATED and never sent to the environment. An observation whose
   context is longer than P truncates the episode (the observation is recorded whole), and
   so does a RUNNING observation after the K-th model call.
5. **Settles** each episode as soon as it ends: the verifier scores it while its
   environment is still open, then the environment exits; a release that raises throws
   the episode out (status ERROR, no reward, no training). ``record`` gets each episode.
6. **Packs** the episodes with :func:`~dew_pipe.objectives.rl.episode_sessions.pack_episodes`
   (group = input row; truncated episodes masked and out of the baseline).

An exception anywhere (environment, policy, verifier, ``record``), an environment that
reports ERROR and any cancellation abort the whole collection before the update: every open
environment exits under that exception, ``record`` gets the failed partial episodes, and
:class:`EpisodeFailure` (or :class:`EpisodeCancelled`, for asyncio and concurrent.futures
cancellations, the original as ``__cause__``) is raised. ``KeyboardInterrupt`` and
``SystemExit`` release the environments the same way and propagate unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dew_pipe._validate import check_int
from dew_pipe.objectives.rl.episode_sessions import pack_episodes
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
from dew_pipe.sampling import Sampling

__all__ = ["EpisodeRollout"]

_INERT = np.zeros(1, np.int32)  # a finished slot's prompt in a lock-step round; output unused
_SEEDS, _ROUNDS = 0, 1  # fold_in constants splitting the collection key


class EpisodeRollout:
    """Collects ``groups`` tool episodes per task and packs them for GRPO.

    Pass it to ``Trainer(..., rollout=rollout)``; see the module docstring for the steps.

    Args:
        policy: a bindable sampling policy, ``dew_pipe.inference.TextGeneration(model,
            variables)``: ``policy.bind(state)`` once per collection, then
            ``policy.batch(contexts, budget, key, sampling)`` (or ``policy(context, budget,
            key, sampling)``) returning Generations (``ids``, ``log_probs``,
            ``behavior_log_probs``, ``finish_reason``).
        environment: the factory: ``environment(EpisodeId) -> Environment`` (a context
            manager; see :class:`~dew_pipe.objectives.rl.episodes.Environment`).
        verifier: ``verifier(Episode) -> float``, a finite reward; it sees the status, the
            detail and every transition, and runs while the environment is open.
        max_prompt_tokens: P, the longest context the model reads (>= 1).
        max_new_tokens: R, the response budget of each model call (>= 1).
        max_turns: K, the most model calls per episode (>= 1).
        groups: G, episodes per task (>= 1; GRPO needs 2 or more to compare).
        sampling: EOS ids (at least one: EOS ends an action), temperature and filters.
        journal: must be None: ``EpisodeJournal`` (crash recovery) is not part of this
            version of dew_pipe, and a journal given here is refused rather than ignored.
        record: ``record(Episode)``, called with each finished episode and, when a
            collection fails, with each failed partial one.

    Attributes:
        last_episodes: the ``B * G`` episodes of the last successful call, in slot order
            (``session_index``).

    Raises:
        TypeError: a policy without ``bind`` (or without ``batch`` and ``__call__``), a
            factory, verifier or record that is not callable, a sampling that is not a
            `Sampling`.
        ValueError: a count out of range; a sampling without EOS ids; ``journal`` given;
            P + R - 1 longer than the policy model's ``max_seq_len``.

    Example:
        >>> rollout = EpisodeRollout(TextGeneration(model, variables), factory, verify,
        ...                          max_prompt_tokens=8, max_new_tokens=3, max_turns=3,
        ...                          groups=4, sampling=Sampling(eos_id=1))  # doctest: +SKIP
        >>> batch = rollout(state, {"task_id": np.array([0, 1])}, key)   # doctest: +SKIP
        >>> batch["input_ids"].shape   # B * G * K rows of P + R ids   # doctest: +SKIP
        (24, 11)
    """

    def __init__(
        self,
        policy: Any,
        environment: Callable[[EpisodeId], Any],
        verifier: Callable[[Episode], float],
        max_prompt_tokens: int,
        max_new_tokens: int,
        max_turns: int,
        groups: int,
        sampling: Sampling,
        journal: Any = None,
        record: Callable[[Episode], Any] | None = None,
    ) -> None:
        if not callable(getattr(policy, "bind", None)):
            raise TypeError(
                f"policy is {type(policy).__name__}; expected a bindable policy such as "
                "dew_pipe.inference.TextGeneration(model, variables)"
            )
        if not (callable(getattr(policy, "batch", None)) or callable(policy)):
            raise TypeError(f"policy is {type(policy).__name__}; expected .batch(...) or a call")
        for name, value in (("environment", environment), ("verifier", verifier)):
            if not callable(value):
                raise TypeError(f"{name} is {value!r}; expected a callable")
        if record is not None and not callable(record):
            raise TypeError(f"record is {record!r}; expected None or record(episode)")
        if journal is not None:
            raise ValueError(
                f"journal is {journal!r}; this version of dew_pipe has no EpisodeJournal "
                "(crash recovery of episodes), so expected journal=None"
            )
        if not isinstance(sampling, Sampling):
            raise TypeError(f"sampling is {sampling!r}; expected a dew_pipe.sampling.Sampling")
        if not sampling.eos_ids:
            raise ValueError(
                f"sampling is {sampling!r} without eos_id; expected at least one EOS id "
                "(EOS ends each model turn)"
            )
        self.policy = policy
        self.environment = environment
        self.verifier = verifier
        self.max_prompt_tokens = check_int("max_prompt_tokens", max_prompt_tokens, minimum=1)
        self.max_new_tokens = check_int("max_new_tokens", max_new_tokens, minimum=1)
        self.max_turns = check_int("max_turns", max_turns, minimum=1)
        self.groups = check_int("groups", groups, minimum=1)
        self.sampling = sampling
        self.record = record
        self._check_model()
        self.last_episodes: list[Episode] = []
        self._metrics: dict[str, float] = {}

    def _check_model(self) -> None:
        """Checks what the policy's model says about sizes now, before any compile."""
        config = getattr(getattr(self.policy, "model", None), "config", None)
        longest = getattr(config, "max_seq_len", None)
        need = self.max_prompt_tokens + self.max_new_tokens - 1
        if isinstance(longest, int) and need > longest:
            raise ValueError(
                f"max_prompt_tokens ({self.max_prompt_tokens}) + max_new_tokens "
                f"({self.max_new_tokens}) - 1 = {need} exceeds the policy model's "
                f"max_seq_len={longest}"
            )
        vocab = getattr(config, "vocab_size", None)
        if isinstance(vocab, int):
            self.sampling.check_vocab(vocab)

    @property
    def width(self) -> int:
        """Ids per packed row, P + R (``GRPOObjective(seq_len=width - 1)``)."""
        return self.max_prompt_tokens + self.max_new_tokens

    # ------------------------------------------------------------------ the hook

    def __call__(self, state: Any, batch: Mapping[str, Any], key: jax.Array) -> dict[str, Any]:
        """Collects and packs one batch of tasks under ``state``'s parameters.

        Args:
            state: the trainer's `TrainState` (``params`` bound, ``step`` the attempted
                clock in the episode ids, ``updates`` the policy step of every action).
            batch: ``{"task_id": [B] ints}`` (other fields are ignored).
            key: the PRNG key of this collection.

        Returns:
            The packed columns, each ``[B * G * K, P + R]``.

        Raises:
            EpisodeFailure / EpisodeCancelled: see the module docstring.
            TypeError / ValueError: a batch without integer ``task_id`` rows, a state
                without ``step``/``updates``.
        """
        episodes = self.collect(state, batch, key)
        packed = pack_episodes(
            episodes,
            [i // self.groups for i in range(len(episodes))],
            width=self.width,
            rows=len(episodes) * self.max_turns,
        )
        self.last_episodes = episodes
        self._metrics = _summary(episodes)
        return packed

    def collect(self, state: Any, batch: Mapping[str, Any], key: jax.Array) -> list[Episode]:
        """The finished episodes of one collection, in slot order (``b * G + g``).

        Same arguments and errors as calling the rollout; nothing is packed.
        """
        tasks = _task_ids(batch)
        step, version = _clocks(state)
        bound = self.policy.bind(state)
        policy = self.policy if bound is None else bound
        n = tasks.size * self.groups
        seeds = np.asarray(jax.random.bits(jax.random.fold_in(key, _SEEDS), (n,), jnp.uint32))
        ids = [
            EpisodeId(int(tasks[i // self.groups]), step, i % self.groups, int(seeds[i]))
            for i in range(n)
        ]
        run = _Collection(self, ids, version)
        try:
            for slot in run.slots:
                run.open(slot)
            rounds = jax.random.fold_in(key, _ROUNDS)
            for turn in range(self.max_turns):
                if not run.running():
                    break
                run.turn(policy, jax.random.fold_in(rounds, turn))
        except BaseException as error:
            raise run.abort(error) from _cause(error)
        return [slot.episode(run.origin) for slot in run.slots]

    def metrics(self) -> dict[str, float]:
        """Numbers about the last call's episodes, for logging (empty before the first).

        ``reward/mean`` and ``reward/positive`` over scored episodes, ``episode/turns``
        (model calls per episode), ``episode/completed`` and ``episode/truncated`` (shares),
        ``response/length`` (sampled ids per call, EOS included).
        """
        return dict(self._metrics)


class _Slot:
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


class _Collection:
    """The slots of one collection and the rules that move them (module docstring, 2-5)."""

    def __init__(self, rollout: EpisodeRollout, ids: Sequence[EpisodeId], version: int) -> None:
        self.rollout = rollout
        self.slots = [_Slot(i) for i in ids]
        self.version = version
        self.origin = Origin()
        self.at: _Slot | None = None  # the slot whose environment or verifier runs now

    def running(self) -> list[int]:
        return [i for i, s in enumerate(self.slots) if s.status is EpisodeStatus.RUNNING]

    def open(self, slot: _Slot) -> None:
        self.at = slot
        manager = self.rollout.environment(slot.id)
        slot.env = manager.__enter__()
        slot.manager, slot.open = manager, True
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

    def turn(self, policy: Any, key: jax.Array) -> None:
        running = self.running()
        self.at = None
        drawn = self.draw(policy, running, key)
        for i, generation in zip(running, drawn, strict=True):
            slot = self.slots[i]
            self.at = slot
            action = self.action(slot, generation)
            if not action.stopped:
                detail = (
                    f"the response used max_new_tokens={self.rollout.max_new_tokens} without "
                    "EOS; not sent to the environment"
                )
                cut = Observation(status=EpisodeStatus.TRUNCATED, detail=detail)
                slot.transitions.append(Transition(action, cut))
                self.finish(slot, EpisodeStatus.TRUNCATED, detail)
                continue
            slot.pending = action
            self.observe(slot, slot.env.step(action), action)

    def draw(self, policy: Any, running: list[int], key: jax.Array) -> list[Any]:
        budget, sampling = self.rollout.max_new_tokens, self.rollout.sampling
        if callable(getattr(policy, "batch", None)):
            contexts = [_INERT] * len(self.slots)
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

    def action(self, slot: _Slot, generation: Any) -> Action:
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

    def observe(self, slot: _Slot, observation: Any, action: Action | None) -> None:
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

    def finish(self, slot: _Slot, status: EpisodeStatus, detail: str) -> None:
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

    def report(self, slot: _Slot) -> None:
        slot.recorded = True
        if self.rollout.record is not None:
            self.rollout.record(slot.episode(self.origin))

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


def _cause(error: BaseException) -> BaseException | None:
    """What the raised wrapper's ``__cause__`` is: the original, unless it is the wrapper."""
    if isinstance(error, EpisodeFailure) or not (
        isinstance(error, Exception) or is_cancellation(error)
    ):
        return error.__cause__
    return error


def _reward(value: Any, slot: _Slot) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise TypeError(
            f"the verifier returned {type(value).__name__} {value!r} for {slot.id}; "
            "expected a finite float"
        )
    if not math.isfinite(float(value)):
        raise ValueError(f"the verifier returned {value} for {slot.id}; expected a finite float")
    return float(value)


def _task_ids(batch: Mapping[str, Any]) -> np.ndarray:
    if not isinstance(batch, Mapping) or "task_id" not in batch:
        fields = sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__
        raise ValueError(
            f"batch has no field 'task_id' (got {fields}); EpisodeRollout reads integer "
            "task_id rows [B]"
        )
    tasks = np.asarray(batch["task_id"])
    if tasks.dtype.kind not in "iu" or tasks.ndim != 1 or tasks.size == 0:
        raise ValueError(
            f"batch field 'task_id' is {tasks.dtype} with shape {tasks.shape}; expected "
            "integers of shape [B], B >= 1"
        )
    return tasks


def _clocks(state: Any) -> tuple[int, int]:
    """(attempted step, committed updates) of a TrainState."""
    if not (hasattr(state, "step") and hasattr(state, "updates")):
        raise TypeError(
            f"state is {type(state).__name__}; expected the trainer's TrainState (with "
            "params, step and updates)"
        )
    return int(state.step), int(state.updates)


def _summary(episodes: Sequence[Episode]) -> dict[str, float]:
    rewards = np.array([e.reward for e in episodes if e.reward is not None], np.float64)
    lengths = [a.tokens.size for e in episodes for a in e.actions]
    status = np.array([e.status for e in episodes])
    out = {
        "episode/turns": float(np.mean([len(e.actions) for e in episodes])),
        "episode/completed": float(np.mean(status == EpisodeStatus.COMPLETED)),
        "episode/truncated": float(np.mean(status == EpisodeStatus.TRUNCATED)),
        "response/length": float(np.mean(lengths)) if lengths else 0.0,
    }
    if rewards.size:
        out["reward/mean"] = float(rewards.mean())
        out["reward/positive"] = float((rewards > 0).mean())
    return out
