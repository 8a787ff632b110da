"""A pass-rate curriculum: prompt batches that rest the prompts the policy already solves.

GRPO learns only from groups whose completions earn different rewards. Once a policy solves
a prompt every time, its group has zero advantage and the batch slot it fills is spent
(with its sampling cost) on nothing. :class:`PassRateCurriculum` serves prompt batches from
a fixed pool and skips each prompt whose last group was solved, for ``rest`` passes over the
pool; every other prompt (never seen, mixed, never solved) is served in pool order.

Feedback comes from the rollout: :meth:`PassRateCurriculum.watch` wraps a rollout hook that
keeps ``last_sessions`` (``SampledRollout``) and reports each prompt's group after every
call, or call :meth:`PassRateCurriculum.observe` yourself with the pool indices and rewards.
The batches carry the pool index of each prompt in the column ``pool_index``.

The record of solved prompts lives in this object: a run resumed from a checkpoint starts
with an empty one (every prompt served again until its next group is solved).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from dew_pipe._validate import check_int
from dew_pipe.data.dataset import Batch, Dataset, Partition

__all__ = ["PassRateCurriculum"]

INDEX = "pool_index"


class PassRateCurriculum:
    """Prompt batches from ``pool`` that skip prompts whose last group was solved.

    Args:
        pool: the prompt pool, column name -> array whose axis 0 is the prompt (``N`` rows;
            the columns a Prompts batch has: ``prompt``, ``prompt_length``, ...). It must
            not already have a ``pool_index`` column.
        batch: prompts per batch (``1 <= batch <= N``).
        solved: a completion counts as solving its prompt when its reward is at least this;
            a prompt is solved when every completion of its last group did.
        rest: passes over the pool a solved prompt sits out (>= 1). After them it is served
            again; a prompt solved again rests again.

    Attributes:
        served: prompts served so far; skipped: turns skipped because the prompt rested.

    Raises:
        TypeError: a pool that is not a mapping of arrays.
        ValueError: an empty pool, columns of different lengths, a ``pool_index`` column, a
            batch or rest out of range, a non-finite ``solved``.

    Example:
        >>> pool = {"prompt": np.arange(8, dtype=np.int32).reshape(4, 2),
        ...         "prompt_length": np.full(4, 2, np.int32)}
        >>> curriculum = PassRateCurriculum(pool, batch=2)
        >>> batches = curriculum.dataset().open_train(Partition(0, 1))
        >>> first = next(batches)
        >>> first["pool_index"].tolist()
        [0, 1]
        >>> curriculum.observe(first["pool_index"], np.array([[1.0, 1.0], [1.0, 0.0]]))
        >>> [next(batches)["pool_index"].tolist() for _ in range(2)]
        [[2, 3], [1, 2]]
    """

    def __init__(
        self, pool: Mapping[str, Any], batch: int, *, solved: float = 1.0, rest: int = 1
    ) -> None:
        if not isinstance(pool, Mapping) or not pool:
            raise TypeError(
                f"pool is {type(pool).__name__}; expected a nonempty mapping of column name "
                "-> array (axis 0: the prompt)"
            )
        columns = {name: np.asarray(value) for name, value in pool.items()}
        if INDEX in columns:
            raise ValueError(
                f"pool has a column {INDEX!r}; the curriculum writes that column itself"
            )
        sizes = {name: (value.shape[0] if value.ndim else None) for name, value in columns.items()}
        if len(set(sizes.values())) != 1 or None in sizes.values():
            raise ValueError(f"pool columns have rows {sizes}; expected one row count for all")
        self.size = next(iter(sizes.values()))
        if self.size == 0:
            raise ValueError("pool has 0 rows; expected at least one prompt")
        self.pool = columns
        self.batch = check_int("batch", batch, minimum=1, maximum=self.size)
        self.solved = float(solved)
        if not np.isfinite(self.solved):
            raise ValueError(f"solved is {solved!r}; expected a finite reward")
        self.rest = check_int("rest", rest, minimum=1)
        self.served = 0
        self.skipped = 0
        self._lock = threading.Lock()
        self._until = np.zeros(self.size, np.int64)  # the pass a prompt may be served again
        self._pass = np.zeros(self.size, np.int64)  # the pass each prompt was last served in

    # ------------------------------------------------------------------ serving

    def dataset(self) -> Dataset:
        """The batches as a :class:`Dataset` for ``Trainer.fit`` (no validation split)."""
        return Dataset(train=self._batches, batch=self.batch)

    def _batches(self, partition: Partition) -> Iterator[Batch]:
        """Endless batches of this process's prompts (round robin over the pool)."""
        mine = np.array([i for i in range(self.size) if partition.owns(i)], np.int64)
        if mine.size == 0:
            raise ValueError(
                f"the pool's {self.size} prompts leave none to process {partition.index} of "
                f"{partition.count}; expected at least one prompt per process"
            )
        local = partition.local_batch(self.batch)
        position, passes = 0, 0
        while True:
            pick: list[int] = []
            while len(pick) < local:  # ends: a rest lasts a bounded number of passes
                index = int(mine[position])
                position += 1
                if position == mine.size:
                    position, passes = 0, passes + 1
                with self._lock:
                    resting = self._until[index] > passes
                    if resting:
                        self.skipped += 1
                    else:
                        self._pass[index] = passes
                        self.served += 1
                if not resting:
                    pick.append(index)
            rows = np.asarray(pick, np.int64)
            out = {name: value[rows] for name, value in self.pool.items()}
            out[INDEX] = rows
            yield out

    # ------------------------------------------------------------------ feedback

    def observe(self, indices: Any, rewards: Any) -> None:
        """Records each prompt's last group: ``rewards[b]`` are the group of ``indices[b]``.

        Args:
            indices: ``[B]`` pool indices (a batch's ``pool_index``).
            rewards: ``[B, G]`` finite rewards, or a list of ``B`` groups of any sizes.

        Raises:
            ValueError: an index outside the pool, a count that does not match, an empty
                group or a non-finite reward.
        """
        indices = np.asarray(indices)
        if indices.ndim != 1 or indices.dtype.kind not in "iu":
            raise ValueError(
                f"indices have dtype {indices.dtype} and shape {indices.shape}; expected [B] "
                "integer pool indices"
            )
        groups = [np.asarray(group, np.float64).reshape(-1) for group in rewards]
        if len(groups) != indices.size:
            raise ValueError(
                f"rewards have {len(groups)} groups for {indices.size} indices; expected one "
                "group per index"
            )
        for b, (index, group) in enumerate(zip(indices.tolist(), groups, strict=True)):
            if not 0 <= index < self.size:
                raise ValueError(
                    f"indices[{b}] is {index}; expected a pool index in [0, {self.size})"
                )
            if group.size == 0 or not np.isfinite(group).all():
                raise ValueError(
                    f"rewards[{b}] is {group.tolist()}; expected a nonempty group of finite rewards"
                )
        with self._lock:
            for index, group in zip(indices.tolist(), groups, strict=True):
                solved = bool((group >= self.solved).all())
                self._until[index] = self._pass[index] + 1 + self.rest if solved else 0

    def watch(self, rollout: Callable[..., Any]) -> Callable[..., Any]:
        """A rollout hook that calls ``rollout`` and reports its groups to :meth:`observe`.

        ``rollout`` must keep ``last_sessions`` (as ``SampledRollout`` does): sessions whose
        ``group`` is the batch row and whose ``reward`` is the completion's. Its ``metrics``
        are passed on, with ``curriculum/served`` and ``curriculum/skipped`` (cumulative
        prompt turns). The hook's ``read_ahead`` is 0, so under ``Trainer.fit`` each batch
        is drawn after the previous batch's groups were observed.
        """
        return _Watched(self, rollout)

    def solved_prompts(self) -> int:
        """Prompts whose last observed group was solved (resting, or to rest on their turn)."""
        with self._lock:
            return int((self._until > 0).sum())


class _Watched:
    # The Trainer reads no batch ahead of this hook, so each batch is drawn after the groups
    # of the one before it were observed (drawing from the pool costs next to nothing).
    read_ahead = 0

    def __init__(self, curriculum: PassRateCurriculum, rollout: Callable[..., Any]) -> None:
        if not callable(rollout):
            raise TypeError(f"rollout is {rollout!r}; expected rollout(state, batch, key)")
        self.curriculum, self.rollout = curriculum, rollout
        self.rows_vary = bool(getattr(rollout, "rows_vary", False))  # the Trainer reads it

    def __call__(self, state: Any, batch: Mapping[str, Any], key: Any) -> Any:
        if INDEX not in batch:
            raise ValueError(
                f"batch has no {INDEX!r} column; a watched rollout reads the batches of "
                "PassRateCurriculum.dataset()"
            )
        out = self.rollout(state, batch, key)
        sessions = getattr(self.rollout, "last_sessions", None)
        if sessions is None:
            raise TypeError(
                f"{type(self.rollout).__name__} keeps no last_sessions; watch() needs a "
                "rollout like SampledRollout, or call observe() yourself"
            )
        indices = np.asarray(batch[INDEX])
        groups: list[list[float]] = [[] for _ in range(indices.size)]
        for session in sessions:
            if session.reward is not None:
                groups[session.group].append(session.reward)
        scored = [b for b, group in enumerate(groups) if group]
        self.curriculum.observe(indices[scored], [groups[b] for b in scored])
        return out

    def metrics(self) -> dict[str, float]:
        inner = getattr(self.rollout, "metrics", None)
        out = dict(inner()) if callable(inner) else {}
        out["curriculum/served"] = float(self.curriculum.served)
        out["curriculum/skipped"] = float(self.curriculum.skipped)
        return out

    def __getattr__(self, name: str) -> Any:  # checkpointed() and the rest of the hook
        return getattr(self.rollout, name)
