"""The asynchronous GRPO graph: its settings, how its stages are wired, and its one builder.

::

    tasks ─► rollout ─► reward ─► pack ─► rescore ─► update ─► (the Trainer, or its own step)
               ▲ │ └── plans ───► ▲ │ ▲      ▲         │ │
               │ │                │ │ └──────┼─────────┘ │  handover (feedback)
               │ └────────────────┼─┘ orders (feedback)   │
               └──────────────────┼─────────────────────┘ │  handover (feedback)
                                  │   pack ─ records ─► update
                                  └ rescore ◄─ params (feedback) ◄ update

:class:`GraphSettings` holds what shapes the graph (batch sizes, lag bounds, admission and
advantage rules), checked once when it is made; :meth:`GraphSettings.check_objective`
checks the objective against them. :func:`build_graph` makes the stages from the settings
and :func:`wire` connects them. Both views call it:

* ``RolloutScheduler`` (library view) with an ``Inlet`` of task batches and a
  :class:`~dew_pipe.stages.handoff.Handoff` update stage, whose ``trainer`` input and
  ``batches`` output it connects to the Trainer's thread;
* :func:`grpo_pipeline` (pipeline view: ``pipelines/grpo_async.py``,
  ``pipelines/arithmetic.py``) with a :class:`TaskBatches` source and a
  :class:`~dew_pipe.stages.train.Train` update stage that trains on each batch itself.

Resume: given a :class:`~dew_pipe.stages.journal.Journal`, the graph keeps the sessions
it has finished but not trained on, and a resumed run replays them instead of sampling
them again (pack records, rollout replays; see :mod:`dew_pipe.stages.journal`).

Why lag stays bounded: rollout takes task batch ``j`` only once update has handed over
batch ``j - ahead``, and submits it under the version served then, which a push keeps
within ``sync_every - 1`` of the trainer's; batch ``j`` trains at most ``ahead`` updates
later. So a first submission is at most ``ahead + sync_every - 1`` updates stale when it
trains, whatever the queue capacities below; that is why ``GraphSettings`` refuses a
``max_lag`` below it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from dew_pipe._validate import check_float, check_int
from dew_pipe.batches import TASKS_SCHEMA, tasks_to_arrow
from dew_pipe.data.dataset import Dataset, Partition
from dew_pipe.flow import Pipeline, Source, Stage
from dew_pipe.objectives.rl.advantages import ESTIMATORS
from dew_pipe.objectives.rl.packing import TRUNCATIONS
from dew_pipe.objectives.rl.session_arrow import task_row
from dew_pipe.objectives.rl.sessions import SessionSource, Task
from dew_pipe.objectives.rl.task_rows import task_ids
from dew_pipe.stages.handoff import Handoff, served_version
from dew_pipe.stages.journal import Journal
from dew_pipe.stages.pack import Pack
from dew_pipe.stages.protocols import (
    LikelihoodScorer,
    TrainingState,
    TrainingStep,
    WeightsPublisher,
)
from dew_pipe.stages.rescore import Rescore
from dew_pipe.stages.reward import Reward, Score
from dew_pipe.stages.rollout import Rollout
from dew_pipe.stages.train import Train, UpdateLog

if TYPE_CHECKING:  # a type only: the objective module loads JAX
    from dew_pipe.objectives.rl.grpo import GRPOObjective

__all__ = [
    "GraphSettings",
    "TaskBatches",
    "build_graph",
    "grpo_pipeline",
    "rescorer",
    "task_batch",
    "wire",
]

# Session batches between rollout, reward and pack: rollout emits one batch per wake-up
# (every session finished since the last), so 8 absorbs a burst while reward is busy;
# more would only delay backpressure.
SESSION_CAPACITY = 8
# Handovers and weights: one per training batch, consumed at once by stages that never
# block on them; 4 is slack, not a working depth.
CONTROL_CAPACITY = 4


@dataclasses.dataclass(frozen=True)
class GraphSettings:
    """What shapes the asynchronous GRPO graph, checked once here for both views.

    Args:
      width: W, ids per packed row (the objective's ``seq_len`` is ``W - 1``).
      rows: N, rows per batch; size it for the chains a group can split into.
      groups: G, sessions trained per task (at least 2: advantages compare them).
      max_lag: the most updates an admitted session's oldest call may lag the version it
        trains at; at least ``ahead + sync_every - 1``, the lag a first submission reaches
        by construction (see the module docstring).
      ahead: task batches submitted beyond the one being trained.
      sync_every: push weights once the served version is this many updates behind.
      oversample: K extra sessions per task; the first G to finish are admitted.
      admit: pack a batch once this many of its groups are complete and cancel the rest;
        None waits for all of them.
      timeout: cancel and resubmit a session still running this many seconds after its
        submission (a failed attempt); None never does.
      max_attempts: failed attempts a sample may have before its group is abandoned
        (every resubmission, whatever its cause, uses one).
      truncation: "mask", "score" or "zero" for TRUNCATED sessions (see ``pack``).
      estimator: the advantage estimator: "group", "mean" or "rloo".
      support_capacity: C, when calls record sampling supports.
      share_prompts: pack each group's prompt once for all of its sessions
        (``pack(..., share_prompts=True)``); the rows carry ``text_prefix_segments``.
      reward_workers: threads of the reward stage.
      audit: keep every submission's ticket in pack's ledger (memory grows with the run;
        for tests and debugging).

    Raises:
      TypeError: a setting of the wrong type; ValueError: one out of range, or ``max_lag``
        below ``ahead + sync_every - 1``.

    Example:
      >>> GraphSettings(width=64, rows=16, groups=4, ahead=2, max_lag=2).sync_every
      1
      >>> GraphSettings(width=64, rows=16, groups=4, ahead=2, max_lag=1)
      Traceback (most recent call last):
      ...
      ValueError: max_lag is 1 with ahead=2 and sync_every=1; expected at least ahead + sync_every - 1 = 2, the lag a first submission reaches by construction
    """

    width: int
    rows: int
    groups: int
    max_lag: int = 1
    ahead: int = 1
    sync_every: int = 1
    oversample: int = 0
    admit: int | None = None
    timeout: float | None = None
    max_attempts: int = 3
    truncation: str = "mask"
    estimator: str = "group"
    support_capacity: int | None = None
    reward_workers: int = 4
    audit: bool = False
    share_prompts: bool = False

    def __post_init__(self) -> None:
        def keep(name: str, value: Any) -> None:  # a NumPy int arrives, a Python int is kept
            object.__setattr__(self, name, value)

        keep("width", check_int("width", self.width, minimum=2))
        keep("rows", check_int("rows", self.rows, minimum=1))
        keep("groups", check_int("groups", self.groups, minimum=2))
        for name in ("max_lag", "ahead", "oversample"):
            keep(name, check_int(name, getattr(self, name), minimum=0))
        for name in ("sync_every", "max_attempts", "reward_workers"):
            keep(name, check_int(name, getattr(self, name), minimum=1))
        for name in ("admit", "support_capacity"):
            keep(name, check_int(name, getattr(self, name), minimum=1, allow_none=True))
        keep("timeout", check_float("timeout", self.timeout, above=0.0, allow_none=True))
        if self.truncation not in TRUNCATIONS:
            raise ValueError(f"truncation is {self.truncation!r}; expected one of {TRUNCATIONS}")
        if self.estimator not in ESTIMATORS:
            raise ValueError(
                f"estimator is {self.estimator!r}; expected one of {tuple(sorted(ESTIMATORS))}"
            )
        for name in ("audit", "share_prompts"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} is {getattr(self, name)!r}; expected a bool")
        bound = self.ahead + self.sync_every - 1
        if self.max_lag < bound:
            raise ValueError(
                f"max_lag is {self.max_lag} with ahead={self.ahead} and sync_every="
                f"{self.sync_every}; expected at least ahead + sync_every - 1 = {bound}, the "
                "lag a first submission reaches by construction"
            )

    def check_objective(self, objective: GRPOObjective) -> None:
        """Refuse an objective these settings cannot train.

        Raises:
          TypeError: it has no ``packed_log_probs`` (not a GRPO objective).
          ValueError: its ``seq_len`` is not ``width - 1``, or ``max_lag`` lets sessions
            lag while it has no ``behavior_importance`` to weight them.
        """
        if not callable(getattr(objective, "packed_log_probs", None)):
            raise TypeError(
                f"objective {type(objective).__name__} has no packed_log_probs(params, batch); "
                "expected a GRPOObjective"
            )
        seq_len = getattr(objective, "seq_len", None)
        if seq_len != self.width - 1:
            raise ValueError(
                f"objective.seq_len={seq_len!r} with width={self.width}; expected "
                f"GRPOObjective(seq_len=width - 1 = {self.width - 1})"
            )
        options = getattr(objective, "options", None)
        if self.max_lag > 0 and getattr(options, "behavior_importance", None) is None:
            raise ValueError(
                f"max_lag={self.max_lag} lets sessions lag the trainer, so the objective "
                "must weight each token by proximal over behavior: set GRPOObjective("
                "behavior_importance=...) to a TIS cap (2.0) or an IcePop band (0.5, 2.0)"
            )


def rescorer(objective: GRPOObjective) -> LikelihoodScorer | None:
    """What the rescore stage calls for ``objective``: its jitted ``packed_log_probs``, or
    None when it scores the proximal policy in its own step (``proximal_in_step=True``), so
    the graph has no rescore stage. Compiles nothing until called."""
    if getattr(objective, "proximal_in_step", False) is True:
        return None
    import jax  # here, not at the top: the settings and wiring above need no JAX

    return jax.jit(objective.packed_log_probs)


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


def build_graph(
    settings: GraphSettings,
    *,
    tasks: Stage,
    source: SessionSource,
    weights: WeightsPublisher,
    scorer: LikelihoodScorer | None,
    reward: Score | None = None,
    trainer: TrainingStep | None = None,
    steps: int | None = None,
    state: TrainingState | Callable[[], TrainingState] | None = None,
    log: UpdateLog | None = None,
    until: Callable[[TrainingState], bool] | None = None,
    owns_source: bool = False,
    group_ids: Iterator[int] | None = None,
    journal: Journal | None = None,
    values: Stage | None = None,
    name: str = "grpo",
) -> Pipeline:
    """The graph's stages made from ``settings`` and wired, in a new pipeline.

    Args:
      settings: the graph's settings.
      tasks: the stage of task batches, named "tasks" (a :class:`TaskBatches`, an Inlet).
      source: the SessionSource rollout submits to.
      weights: the publisher ``source`` samples from.
      scorer: what rescore calls (:func:`rescorer`); None leaves the rescore stage out and
        pack feeds update directly (``old_log_probs`` then stay the engine's, for an
        objective that scores the proximal policy in its own step).
      reward: ``score(task, session)`` for a source that leaves sessions unscored; None
        trusts the source's rewards.
      trainer: None makes the update stage a :class:`~dew_pipe.stages.handoff.Handoff`
        whose ``trainer`` input and ``batches`` output the caller connects (the library
        view); a trainer makes it a :class:`~dew_pipe.stages.train.Train` that runs
        ``steps`` updates from ``state`` itself, calling ``log`` after each (the pipeline
        view).
      steps, state, log, until: the ``Train`` stage's, with a trainer.
      owns_source: rollout closes ``source`` when the run ends.
      group_ids: where rollout's group ids come from (shared across runs, ids stay unique).
      journal: a :class:`~dew_pipe.stages.journal.Journal` that pack records kept
        sessions in and rollout replays a resumed run's in-flight sessions from (one
        journal, both stages); None: a resumed run samples everything in flight again.
      values: a stage to put between pack and update instead of rescore, with rescore's
        ports (PPO's :class:`~dew_pipe.stages.values.Values`, which rescores too); then
        ``scorer`` must be None.
      name: the pipeline's name.

    Returns:
      The pipeline; its stages are "tasks", "rollout", "reward", "pack", "rescore" (unless
      ``scorer`` is None), ``values`` (when given) and "update".

    Raises:
      TypeError, ValueError: a collaborator or option the stages refuse.
    """
    s = settings
    if values is not None and scorer is not None:
        raise ValueError(
            f"values={values.name!r} and a scorer: the values stage takes rescore's place "
            "(and rescores itself), so pass scorer=None"
        )
    if values is not None and s.share_prompts:
        raise ValueError(
            f"values={values.name!r} with share_prompts=True; the critic reads each chain "
            "whole, so expected share_prompts=False"
        )
    if values is not None and (s.estimator, s.truncation) != ("reward", "mask"):
        raise ValueError(
            f"values={values.name!r} with estimator={s.estimator!r} and truncation="
            f"{s.truncation!r}; the values stage reads each episode's reward from pack and "
            "masks truncated ones, so expected estimator='reward' and truncation='mask'"
        )
    served = lambda: served_version(weights)  # noqa: E731 - read at every submission
    rollout = Rollout(
        source, groups=s.groups, oversample=s.oversample, ahead=s.ahead, max_lag=s.max_lag,
        timeout=s.timeout, version=served, group_ids=group_ids, owns_source=owns_source,
        journal=journal,
    )  # fmt: skip
    pack = Pack(
        width=s.width, rows=s.rows, groups=s.groups, admit=s.admit, max_lag=s.max_lag,
        max_attempts=s.max_attempts, truncation=s.truncation, estimator=s.estimator,
        support_capacity=s.support_capacity, audit=s.audit, journal=journal,
        share_prompts=s.share_prompts,
    )  # fmt: skip
    shape = {
        "width": s.width,
        "support_capacity": s.support_capacity,
        "share_prompts": s.share_prompts,
    }
    update: Handoff
    if trainer is None and until is not None:
        raise ValueError(
            "until is set but trainer is None: only the Train stage (a trainer's) stops "
            "itself; the library view's caller decides when to stop"
        )
    if trainer is None:
        update = Handoff(weights=weights, sync_every=s.sync_every, **shape)
    else:
        update = Train(
            trainer, steps=steps, weights=weights, sync_every=s.sync_every, state=state,
            log=log, until=until, **shape,
        )  # fmt: skip
    pipeline = Pipeline(name)
    for stage in (
        tasks,
        rollout,
        Reward(reward, workers=s.reward_workers),
        pack,
        *([] if scorer is None else [Rescore(scorer, **shape)]),
        *([] if values is None else [values]),
        update,
    ):
        pipeline.add(stage)
    middle = values.name if values is not None else None if scorer is None else "rescore"
    wire(pipeline, ahead=s.ahead, reward_workers=s.reward_workers, rescore=middle)
    return pipeline


def grpo_pipeline(
    *,
    tasks: Source,
    source: SessionSource,
    weights: WeightsPublisher,
    trainer: TrainingStep,
    score: Score | None,
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
    state: TrainingState | Callable[[], TrainingState] | None = None,
    log: UpdateLog | None = None,
    until: Callable[[TrainingState], bool] | None = None,
    journal: Journal | None = None,
    name: str = "grpo_async",
    share_prompts: bool = False,
) -> Pipeline:
    """The asynchronous GRPO graph around any source, publisher and trainer (pipeline view).

    tasks → rollout → reward → pack → rescore → update, made by :func:`build_graph`; the
    update stage (a :class:`~dew_pipe.stages.train.Train`) owns the training state, runs
    ``trainer.train_step`` ``steps`` times, then ends, which ends the pipeline. Its ``state``
    attribute holds the newest state (``pipeline.stages["update"].state``).

    Args:
      tasks: the stage of task batches (a :class:`TaskBatches`, named "tasks").
      source: the SessionSource rollout submits to (closed by rollout when the run ends).
      weights: the publisher the source samples from, e.g. a ``NativeRolloutServer``.
      trainer: the ``dew_pipe.Trainer`` whose ``train_step`` runs each update; its
        objective's ``packed_log_probs`` rescores every batch (unless it was built with
        ``proximal_in_step=True``).
      score: ``score(task, session)`` for a source that leaves sessions unscored; None
        trusts the source's rewards (``PromptSource`` scores its own).
      width, rows, groups, max_lag, ahead, sync_every, oversample, timeout, truncation,
        estimator, max_attempts, reward_workers, share_prompts: the :class:`GraphSettings`.
      steps: updates to train.
      state: the training state to start from, or a function returning it, called when
        the run starts; None: ``trainer.initial_state()``.
      log: ``log(step, metrics, record)`` after each update (``Train``'s ``UpdateLog``).
      until: ``until(state)`` after each update and its ``log``; true ends the run there
        (early stopping, e.g. on an accuracy probe), as reaching ``steps`` does.
      journal: the rollout journal (see :func:`build_graph`); whoever saves the update
        stage's state calls ``journal.checkpointed(int(state.step))`` after each save.
      name: the pipeline's name.

    Returns:
      The pipeline (run it with ``pipeline.run()`` or ``RunContext.run_pipeline``).

    Raises:
      TypeError, ValueError: a setting :class:`GraphSettings` refuses, an objective
        :meth:`GraphSettings.check_objective` refuses, and the stages' own checks.

    Example (a sketch; ``pipelines/grpo_async.py`` runs a complete one)::

        p = grpo_pipeline(tasks=TaskBatches(data, prompt_tasks), source=source,
                          weights=server, trainer=trainer, score=None, width=16, rows=32,
                          groups=8, steps=100, truncation="zero")
        p.run()
        trained = p.stages["update"].state
    """
    settings = GraphSettings(
        width=width, rows=rows, groups=groups, max_lag=max_lag, ahead=ahead,
        sync_every=sync_every, oversample=oversample, timeout=timeout,
        max_attempts=max_attempts, truncation=truncation, estimator=estimator,
        reward_workers=reward_workers, share_prompts=share_prompts,
    )  # fmt: skip
    if not isinstance(trainer, TrainingStep):
        raise TypeError(f"trainer={trainer!r}; expected a dew_pipe.Trainer")
    settings.check_objective(trainer.objective)
    return build_graph(
        settings, tasks=tasks, source=source, weights=weights,
        scorer=rescorer(trainer.objective), reward=score, trainer=trainer, steps=steps,
        state=state, log=log, until=until, owns_source=True, journal=journal, name=name,
    )  # fmt: skip


def task_batch(tasks: list[Task]) -> pa.RecordBatch:
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
      start: batches to skip first (over epochs): a resumed run's data position, the
        ``step`` of the state it resumes from, so each batch meets the position it had
        (and a journal's in-flight sessions are replayed into it).
      name: the stage's name.

    Raises:
      TypeError: ``data`` is not a Dataset, ``tasks`` not callable, ``batches`` or
        ``start`` not an int; ValueError: ``batches`` or ``start`` below 0.

    Example:
      >>> import itertools, numpy as np
      >>> data = Dataset(train=lambda p: itertools.repeat({"task_id": np.arange(2)}), batch=2)
      >>> stage = TaskBatches(data, batches=3)
      >>> [b.num_rows for b in stage.items()]
      [2, 2, 2]
      >>> counting = Dataset(train=lambda p: ({"task_id": np.arange(k, k + 1)} for k in range(3)),
      ...                    batch=1)
      >>> [b.column("task_id")[0].as_py() for b in TaskBatches(counting, batches=3, start=2).items()]
      [2, 0, 1]
    """

    def __init__(
        self,
        data: Dataset,
        tasks: Callable[[Mapping[str, np.ndarray]], list[Task]] = task_ids,
        *,
        batches: int | None = None,
        start: int = 0,
        name: str = "tasks",
    ) -> None:
        if not isinstance(data, Dataset):
            raise TypeError(f"data is a {type(data).__name__}; expected a dew_pipe.Dataset")
        if not callable(tasks):
            raise TypeError(f"tasks={tasks!r}; expected a function of a batch returning Tasks")
        batches = check_int("batches", batches, minimum=0, allow_none=True)
        start = check_int("start", start, minimum=0)
        super().__init__(name, output_type=TASKS_SCHEMA)
        self.data, self.reader, self.batches, self.start = data, tasks, batches, start

    def items(self) -> Iterator[pa.RecordBatch]:
        count, skip = 0, self.start
        while self.batches is None or count < self.batches:
            iterator = self.data.open_train(Partition(0, 1))
            empty = True
            try:
                for batch in iterator:
                    empty = False
                    if skip:
                        skip -= 1
                        continue
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
