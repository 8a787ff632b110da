"""The asynchronous GRPO graph: how rollout, reward, pack, rescore and update are wired.

::

    tasks ─► rollout ─► reward ─► pack ─► rescore ─► update ─► (the Trainer, or its own step)
               ▲ │ └── plans ───► ▲ │ ▲      ▲         │ │
               │ │                │ │ └──────┼─────────┘ │  handover (feedback)
               │ └────────────────┼─┘ orders (feedback)   │
               └──────────────────┼─────────────────────┘ │  handover (feedback)
                                  │   pack ─ records ─► update
                                  └ rescore ◄─ params (feedback) ◄ update

Both views build it with :func:`wire`: ``RolloutScheduler`` with an ``Inlet`` of trainer
steps into ``update`` and an ``Outlet`` of handed batches out of it, and
:func:`grpo_pipeline` (used by ``pipelines/grpo_async.py`` and the arithmetic job of
:mod:`dew_pipe.tasks.job`) with a ``Source`` of task batches and an ``Update`` that runs the
trainer's step itself.

Why lag stays bounded: rollout takes task batch ``j`` only once update has handed over
batch ``j - ahead``, and submits it under the version served then, which a push keeps
within ``sync_every - 1`` of the trainer's; batch ``j`` trains at most ``ahead`` updates
later. So a first submission is at most ``ahead + sync_every - 1`` updates stale when it
trains, whatever the queue capacities below.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pyarrow as pa
from dew_pipe.stages.messages import SchedulerRecord

from dew_pipe.batches import TASKS_SCHEMA, tasks_to_arrow
from dew_pipe.data.dataset import Dataset, Partition
from dew_pipe.flow import Pipeline, Source
from dew_pipe.objectives.rl.session_arrow import task_row
from dew_pipe.objectives.rl.task_rows import task_ids

__all__ = ["TaskBatches", "grpo_pipeline", "task_batch", "wire"]

# Session batches between rollout, reward and pack: rollout emits one batch per wake-up
# (every session finished since the last), so 8 absorbs a burst while reward is busy;
# more would only delay backpressure.
SESSION_CAPACITY = 8
# Handovers and weights: one per training batch, consumed at once by stages that never
# block on them; 4 is slack, not a working depth.
CONTROL_CAPACITY = 4


def wire(
    pipeline: Pipeline,
    *,
    ahead: int,
    reward_workers: int = 1,
    tasks: str = "tasks",
    rollout: str = "rollout",
    reward: str | None = "reward",
    pack: str = "pack",
    rescore: str | None = "rescore",
    update: str = "update",
) -> None:
    """Connect the stages of the graph (already added to ``pipeline``) by their names.

    Args:
      pipeline: holds the stages named below.
      ahead: task batches rollout may run ahead of the trainer; sizes the tasks edge.
      reward_workers: the reward stage's worker threads; sizes the orders edge.
      tasks: the stage whose output is task batches (a Source, or an Inlet).
      rollout, reward, pack, rescore, update: the stages' names; ``reward=None`` feeds
        rollout straight into pack, ``rescore=None`` pack straight into update (then
        ``old_log_probs`` stay the engine's).

    Raises:
      BuildError: a stage is missing or a port type does not fit.
    """
    # Task batches: the trainer registers up to ahead + 1 of them before rollout may take
    # the last (it waits for the handover), and one more is being read: ahead + 2.
    pipeline.connect(tasks, f"{rollout}.tasks", capacity=ahead + 2)
    if reward is None:
        pipeline.connect(f"{rollout}.sessions", f"{pack}.sessions", capacity=SESSION_CAPACITY)
    else:
        pipeline.connect(f"{rollout}.sessions", reward, capacity=SESSION_CAPACITY)
        pipeline.connect(reward, f"{pack}.sessions", capacity=SESSION_CAPACITY)
    # One plan per task batch taken; pack reads them first, so ahead + 2 never fills.
    pipeline.connect(f"{rollout}.plans", f"{pack}.plans", capacity=ahead + 2)
    if rescore is None:
        pipeline.connect(f"{pack}.rows", f"{update}.rows", capacity=1)
    else:
        # Pack emits batch i only after its handover, so one batch is ever in flight here.
        pipeline.connect(f"{pack}.rows", f"{rescore}.rows", capacity=1)
        pipeline.connect(f"{rescore}.rows", f"{update}.rows", capacity=1)
        pipeline.connect(f"{update}.params", f"{rescore}.params", capacity=2, feedback=True)
    pipeline.connect(f"{pack}.records", f"{update}.records", capacity=2)
    # Orders close the cycle rollout -> reward -> pack -> rollout. Pack puts at most one
    # per input it takes, and while rollout is blocked on a full sessions edge pack can
    # still take everything between them (two session edges, the reward pool and the
    # item reward holds) plus the handovers, so that many always fit: no deadlock.
    orders = 2 * SESSION_CAPACITY + reward_workers + 1 + 2 * CONTROL_CAPACITY
    pipeline.connect(f"{pack}.orders", f"{rollout}.orders", capacity=orders, feedback=True)
    for stage in (rollout, pack):
        pipeline.connect(
            f"{update}.handover", f"{stage}.handover", capacity=CONTROL_CAPACITY, feedback=True
        )


def task_batch(tasks: list[Any]) -> pa.RecordBatch:
    """Tasks as one Arrow task batch (:data:`~dew_pipe.batches.TASKS_SCHEMA`).

    Raises:
      ValueError: no tasks.
      TypeError: a task whose ``data`` cannot cross stages (see ``session_arrow.task_row``).

    Example:
      >>> from dew_pipe.objectives.rl.sessions import Task
      >>> task_batch([Task(3), Task(4)]).column("task_id").to_pylist()
      [3, 4]
    """
    if not tasks:
        raise ValueError("tasks: a batch has no tasks; expected at least one")
    return tasks_to_arrow([task_row(t) for t in tasks])


class TaskBatches(Source):
    """A Source of task batches read from a Dataset (the pipeline view's first stage).

    Args:
      data: the training data; ``data.train`` is read epoch after epoch.
      tasks: turns a batch into Tasks (``task_ids``, ``prompt_tasks``, or your own).
      batches: stop after this many (None: run until the consumer stops).
      name: the stage's name.

    Example:
      >>> import itertools, numpy as np
      >>> data = Dataset(train=lambda p: itertools.repeat({"task_id": np.arange(2)}), batch=2)
      >>> stage = TaskBatches(data, batches=3)
      >>> [b.num_rows for b in stage.items()]
      [2, 2, 2]
    """

    def __init__(
        self, data: Dataset, tasks=task_ids, *, batches: int | None = None, name: str = "tasks"
    ) -> None:
        if not isinstance(data, Dataset):
            raise TypeError(f"data is a {type(data).__name__}; expected a dew_pipe.Dataset")
        if not callable(tasks):
            raise TypeError(f"tasks={tasks!r}; expected a function of a batch returning Tasks")
        if batches is not None and (
            isinstance(batches, bool) or not isinstance(batches, int) or batches < 0
        ):
            raise ValueError(f"batches={batches!r}; expected None or an int >= 0")
        super().__init__(name, output_type=TASKS_SCHEMA)
        self.data, self.reader, self.batches = data, tasks, batches

    def items(self) -> Iterator[pa.RecordBatch]:
        count = 0
        while self.batches is None or count < self.batches:
            iterator = self.data.open_train(Partition(0, 1))
            empty = True
            try:
                for batch in iterator:
                    empty = False
                    if self.batches is not None and count >= self.batches:
                        return
                    yield task_batch(self.reader(batch))
                    count += 1
            finally:
                close = getattr(iterator, "close", None)
                if close is not None:
                    close()
            if empty:
                raise ValueError("Dataset.train yielded no batches; expected at least one")


def grpo_pipeline(
    *,
    tasks: Source,
    source: Any,
    weights: Any,
    trainer: Any,
    score: Callable[[Any, Any], float] | None,
    width: int,
    rows: int,
    groups: int,
    steps: int,
    max_lag: int = 1,
    ahead: int = 1,
    sync_every: int = 1,
    oversample: int = 0,
    timeout: float | None = None,
    truncation: str = "mask",
    estimator: str = "group",
    max_attempts: int = 3,
    reward_workers: int = 2,
    log: Callable[[int, dict[str, float], SchedulerRecord | None], None] | None = None,
    name: str = "grpo_async",
) -> Pipeline:
    """The asynchronous GRPO graph around any source, publisher and trainer.

    tasks → rollout → reward → pack → rescore → update, wired by :func:`wire`; the update
    stage owns the ``TrainState`` (``pipeline.stages["update"].state``; set it before the run
    to start from a given state, else ``trainer.initial_state()``) and runs
    ``trainer.train_step`` ``steps`` times, then ends, which ends the pipeline.

    Args:
      tasks: the stage of task batches (a :class:`TaskBatches`, named "tasks").
      source: the SessionSource rollout submits to (closed by rollout when the run ends).
      weights: the publisher the source samples from (``load(params, version)``,
        ``version``), e.g. a ``NativeRolloutServer``.
      trainer: the ``dew_pipe.Trainer`` whose ``train_step`` runs each update; its
        objective's ``packed_log_probs`` rescores every batch.
      score: ``score(task, session)`` for a source that leaves sessions unscored; None
        trusts the source's rewards (``PromptSource`` scores its own).
      width, rows, groups, max_lag, ahead, sync_every, oversample, timeout, truncation,
      estimator, max_attempts: as :class:`~dew_pipe.stages.scheduler.RolloutScheduler`.
      steps: updates to train.
      reward_workers: the reward stage's threads.
      log: ``log(step, metrics, record)`` after each update (see ``Update``).
      name: the pipeline's name.

    Returns:
      The pipeline (run it with ``pipeline.run()`` or ``RunContext.run_pipeline``).

    Raises:
      ValueError: ``max_lag`` below ``ahead + sync_every - 1``, and the stages' own checks.

    Example (a sketch; ``pipelines/grpo_async.py`` runs a complete one)::

        p = grpo_pipeline(tasks=TaskBatches(data, prompt_tasks), source=source,
                          weights=server, trainer=trainer, score=None, width=16, rows=32,
                          groups=8, steps=100, truncation="zero")
        p.stages["update"].state = trainer.initial_state()
        p.run()
    """
    import jax
    from dew_pipe.stages.pack import Pack
    from dew_pipe.stages.rescore import Rescore
    from dew_pipe.stages.reward import Reward
    from dew_pipe.stages.rollout import Rollout
    from dew_pipe.stages.update import Update

    if max_lag < ahead + sync_every - 1:
        raise ValueError(
            f"max_lag={max_lag}; expected at least ahead + sync_every - 1 = "
            f"{ahead + sync_every - 1}"
        )
    p = Pipeline(name)
    p.add(tasks)
    p.add(
        Rollout(
            source, groups=groups, oversample=oversample, ahead=ahead, max_lag=max_lag,
            timeout=timeout, version=lambda: weights.version, owns_source=True,
        )
    )  # fmt: skip
    p.add(Reward(score, workers=reward_workers))
    p.add(
        Pack(
            width=width, rows=rows, groups=groups, max_lag=max_lag, max_attempts=max_attempts,
            truncation=truncation, estimator=estimator,
        )
    )  # fmt: skip
    in_step = getattr(trainer.objective, "proximal_in_step", False) is True
    if not in_step:  # else the objective scores the proximal policy in its own step
        p.add(Rescore(jax.jit(trainer.objective.packed_log_probs), width=width))
    p.add(
        Update(
            width=width, weights=weights, sync_every=sync_every, trainer=trainer, steps=steps,
            log=log,
        )
    )  # fmt: skip
    wire(p, ahead=ahead, reward_workers=reward_workers, rescore=None if in_step else "rescore")
    return p
