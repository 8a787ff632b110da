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

With ``journal=EpisodeJournal(directory)`` (:mod:`~dew_pipe.objectives.rl.episode_journal`)
a collection commits each reset, each round's draws and each turn as it goes, and a call
at a step the journal holds (a restart from a checkpoint after a crash) resumes from those
records: same actions, same rewards, no completed tool call run again. The environments
must then offer ``get_state``/``set_state``. The slots and their rules live in
:mod:`~dew_pipe.objectives.rl.episode_collection`.

On several JAX processes each process opens the environments of its own task rows and the
rounds sample every process's slots in one global ``policy.batch`` call; failures are
settled together before each round, and every process projects all the episodes and keeps
its own rows (:mod:`~dew_pipe.objectives.rl.episode_pool`). The journal is refused there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dew_pipe._validate import check_int
from dew_pipe.objectives.rl.episode_collection import INERT, Collection, cause_of
from dew_pipe.objectives.rl.episode_journal import EpisodeJournal
from dew_pipe.objectives.rl.episode_pool import (
    Ranks,
    agree,
    describe_failure,
    gather_episodes,
    standing,
)
from dew_pipe.objectives.rl.episode_sessions import pack_episodes
from dew_pipe.objectives.rl.episodes import (
    Episode,
    EpisodeId,
    EpisodeStatus,
    Origin,
    is_cancellation,
)
from dew_pipe.sampling import Sampling

__all__ = ["EpisodeRollout"]

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
        journal: an :class:`~dew_pipe.objectives.rl.EpisodeJournal` for crash recovery (the
            environments must have ``get_state``/``set_state``), or None.
        record: ``record(Episode)``, called with each finished episode and, when a
            collection fails, with each failed partial one.

    Attributes:
        last_episodes: the ``B * G`` episodes of the last successful call, in slot order
            (``session_index``).

    Raises:
        TypeError: a policy without ``bind`` (or without ``batch`` and ``__call__``), a
            factory, verifier or record that is not callable, a sampling that is not a
            `Sampling`, a journal that is not an EpisodeJournal.
        ValueError: a count out of range; a sampling without EOS ids; P + R - 1 longer than
            the policy model's ``max_seq_len``.

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
        journal: EpisodeJournal | None = None,
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
        if journal is not None and not isinstance(journal, EpisodeJournal):
            raise TypeError(
                f"journal is {journal!r}; expected None or "
                "dew_pipe.objectives.rl.EpisodeJournal(directory)"
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
        self.journal = journal
        self._check_model()
        self.last_episodes: list[Episode] = []
        self._metrics: dict[str, float] = {}
        self._restored: int | None = None

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
            JournalError: the journal holds another collection at this step, or another
                writer holds it (nothing was opened).
            TypeError / ValueError: a batch without integer ``task_id`` rows, a state
                without ``step``/``updates``; on several processes, settings, row counts,
                clocks or keys that differ between them (on every process, before anything
                opens), a journal, or a policy without ``batch``.
        """
        episodes = self.collect(state, batch, key)
        everyone, ranks = episodes, Ranks()
        if ranks.count > 1:  # one projection of every process's episodes; this block's rows
            everyone = gather_episodes(ranks, episodes, episodes[0].origin)
        packed = pack_episodes(
            everyone,
            [i // self.groups for i in range(len(everyone))],
            width=self.width,
            rows=len(everyone) * self.max_turns,
        )
        if ranks.count > 1:
            rows = len(episodes) * self.max_turns
            packed = {
                name: v[ranks.index * rows : (ranks.index + 1) * rows] for name, v in packed.items()
            }
        self.last_episodes = episodes
        self._metrics = _summary(everyone)
        return packed

    def collect(self, state: Any, batch: Mapping[str, Any], key: jax.Array) -> list[Episode]:
        """The finished episodes of one collection, in slot order (``b * G + g``).

        Same arguments and errors as calling the rollout; nothing is packed. On several
        processes, this process's episodes (its own task rows); every process must call it.
        """
        tasks = _task_ids(batch)
        step, version = _clocks(state)
        ranks = Ranks()
        if ranks.count > 1:
            return self._collect_together(ranks, state, tasks, step, version, key)
        origin = Origin()
        journaled = None
        if self.journal is not None:  # before anything opens: a refusal leaves it untouched
            journaled = self.journal.begin(
                step, self._identity(tasks, version), key, getattr(state, "params", None), origin
            )
        bound = self.policy.bind(state)
        policy = self.policy if bound is None else bound
        n = tasks.size * self.groups
        seeds = np.asarray(jax.random.bits(jax.random.fold_in(key, _SEEDS), (n,), jnp.uint32))
        ids = [
            EpisodeId(int(tasks[i // self.groups]), step, i % self.groups, int(seeds[i]))
            for i in range(n)
        ]
        run = Collection(self, ids, version, origin, journaled)
        try:
            for index in range(n):
                run.open(index)
            rounds = jax.random.fold_in(key, _ROUNDS)
            for turn in range(self.max_turns):
                if not run.running():
                    break
                run.turn(policy, jax.random.fold_in(rounds, turn), turn)
        except BaseException as error:
            raise run.abort(error) from cause_of(error)
        self._restored = None if journaled is None else journaled.restored_turns
        return [slot.episode(origin) for slot in run.slots]

    def _collect_together(
        self,
        ranks: Ranks,
        state: Any,
        tasks: np.ndarray,
        step: int,
        version: int,
        key: jax.Array,
    ) -> list[Episode]:
        """`collect` on several processes (:mod:`~dew_pipe.objectives.rl.episode_pool`)."""
        if self.journal is not None:
            raise ValueError(
                f"journal={self.journal!r} on {ranks.count} processes; an EpisodeJournal "
                "resumes one process's collection only: pass journal=None (a restart then "
                "samples the interrupted collection again from the checkpoint)"
            )
        if not callable(getattr(self.policy, "batch", None)):
            raise TypeError(
                f"policy is {type(self.policy).__name__} without batch(); on {ranks.count} "
                "processes every round samples all processes' slots in one policy.batch call"
            )
        agree(
            ranks,
            {
                **self._identity(np.zeros(0, np.int64), version),
                "rows": int(tasks.size),
                "step": step,
                "key": _key_words(key),
            },
        )
        origin = Origin()
        bound = self.policy.bind(state)
        policy = self.policy if bound is None else bound
        local = tasks.size * self.groups
        offset = ranks.index * local
        seeds = jax.random.bits(jax.random.fold_in(key, _SEEDS), (local * ranks.count,), jnp.uint32)
        seeds = np.asarray(seeds)[offset : offset + local]
        ids = [
            EpisodeId(int(tasks[i // self.groups]), step, i % self.groups, int(seeds[i]))
            for i in range(local)
        ]
        run = Collection(self, ids, version, origin)
        self._restored = None
        try:
            failure = self._rounds_together(ranks, run, policy, key, offset)
            if failure is None:
                return [slot.episode(origin) for slot in run.slots]
        except BaseException as error:  # an interrupt, or what failed on every process alike
            raise run.abort(error) from cause_of(error)
        if isinstance(failure, tuple):
            raise run.abort_for_peer(*failure)
        raise run.abort(failure) from cause_of(failure)

    def _rounds_together(
        self, ranks: Ranks, run: Collection, policy: Any, key: jax.Array, offset: int
    ) -> BaseException | tuple[int, str, bool] | None:
        """Opens the local slots and runs the rounds in step with the other processes.

        Returns None when the collection succeeded everywhere, this process's own failure,
        or ``(process, message, cancelled)`` of the first other process that failed; raises
        only what every process meets alike (the policy) or an interrupt.
        """
        failure: BaseException | None = None
        try:
            for index in range(len(run.slots)):
                run.open(index)
        except BaseException as error:
            if not _deferred(error):
                raise
            failure = error
        rounds = jax.random.fold_in(key, _ROUNDS)
        for turn in range(self.max_turns + 1):
            contexts = [
                slot.context if slot.status is EpisodeStatus.RUNNING else None for slot in run.slots
            ]
            said = None
            if failure is not None:
                culprit = None if run.at is None else run.at.episode(run.origin)
                said = describe_failure(failure, culprit)
            peers, everyone = standing(ranks, said, contexts)
            if failure is not None:
                return failure
            if peers:
                return peers[0]
            if turn == self.max_turns or all(c is None for c in everyone):
                return None
            run.at = None
            drawn = list(
                policy.batch(
                    [INERT if c is None else c for c in everyone],
                    self.max_new_tokens,
                    jax.random.fold_in(rounds, turn),
                    self.sampling,
                )
            )
            if len(drawn) != len(everyone):
                raise ValueError(
                    f"policy.batch returned {len(drawn)} generations for {len(everyone)} contexts"
                )
            running = run.running()
            try:
                mine = [drawn[offset + i] for i in running]
                run.send(running, run.actions(running, mine), turn)
            except BaseException as error:
                if not _deferred(error):
                    raise
                failure = error
        raise AssertionError("unreachable: the last round returns")

    def _identity(self, tasks: np.ndarray, updates: int) -> dict[str, Any]:
        """What the journal checks besides the key, topology and policy (JSON values)."""
        return {
            "tasks": tasks.tolist(),
            "updates": updates,
            "sampling": dataclasses.asdict(self.sampling),
            "settings": {
                "max_prompt_tokens": self.max_prompt_tokens,
                "max_new_tokens": self.max_new_tokens,
                "max_turns": self.max_turns,
                "groups": self.groups,
            },
        }

    def checkpointed(self, step: int) -> None:
        """Called by the Trainer after it starts a checkpoint: prunes the journal."""
        if self.journal is not None:
            self.journal.checkpointed(step)

    def metrics(self) -> dict[str, float]:
        """Numbers about the last call's episodes, for logging (empty before the first).

        ``reward/mean`` and ``reward/positive`` over scored episodes, ``episode/turns``
        (model calls per episode), ``episode/completed`` and ``episode/truncated`` (shares),
        ``response/length`` (sampled ids per call, EOS included); with a journal,
        ``journal/restored_turns`` (turns the last call took from the journal).
        """
        out = dict(self._metrics)
        if self._restored is not None and out:
            out["journal/restored_turns"] = float(self._restored)
        return out


def _key_words(key: jax.Array) -> list[int]:
    """A key's words as JSON (a typed key's data, or a raw uint32 key itself)."""
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    return np.asarray(key).reshape(-1).tolist()


def _deferred(error: BaseException) -> bool:
    """A failure the processes settle together at the next exchange (not an interrupt)."""
    return isinstance(error, Exception) or is_cancellation(error)


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
