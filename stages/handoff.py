"""Update: publishes weight versions, hands batches over, and (in a pipeline) trains on them.

For each batch ``i`` the stage

1. pushes the trainer's weights through ``weights.load(params, version)`` when the served
   version has fallen ``sync_every`` updates behind (or is ahead, after a restore from an
   older checkpoint); a push that leaves the served version where it was is tried once
   more, then fails the run;
2. announces the handover (``Handover(i, version, served)``) to rollout, which may then
   submit batches up to ``i + ahead``, and to pack, which checks lag against ``version``;
3. waits for batch ``i``, packed and rescored (under the live weights it sent to rescore
   as ``Proximal`` before step 1, so rescoring overlaps the push), with its record;
4. hands the batch on.

Two drivers differ only in step 4 and in where the weights come from:

* **library view** (``trainer=None``): a :class:`~dew_pipe.stages.messages.Step` on the
  ``trainer`` port, put there by ``RolloutScheduler`` from the Trainer's own thread, starts
  each batch; the batch goes back on ``batches`` and the Trainer runs its compiled update.
* **pipeline view** (``trainer=Trainer(...)``): the stage owns a ``TrainState`` and runs
  ``trainer.train_step`` on each batch itself, ``steps`` times, then ends, which ends the
  rest of the pipeline.

The weights sent to rescore are the trainer's live arrays: the update that donates them
only runs once the rescored batch is back, so neither driver copies them.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import pyarrow as pa
from dew_pipe.stages.messages import Handed, Handover, Proximal, SchedulerRecord, Step

from dew_pipe.batches import packed_from_arrow, packed_schema
from dew_pipe.flow import Cancelled, EndOfStream, Port, Stage, StageContext

__all__ = ["Update", "publish"]


def _served(weights: Any) -> int:
    version = getattr(weights, "version", None)
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise TypeError(f"weights.version is {version!r}; expected the served version, an int >= 0")
    return version


def publish(weights: Any, params: Any, version: int, sync_every: int) -> tuple[int, bool, float]:
    """Push ``params`` as ``version`` when the served version is ``sync_every`` behind.

    Args:
      weights: a publisher with ``load(params, version)`` and an int ``version``.
      params: the trainer's variables.
      version: the trainer's version (``TrainState.updates``).
      sync_every: push once the served version is this many updates behind.

    Returns:
      ``(served version, pushed, seconds the push took)``.

    Raises:
      RuntimeError: two pushes in a row left the served version unchanged.

    Example:
      >>> class Weights:
      ...     version = 0
      ...     def load(self, params, version):
      ...         self.version = version
      >>> publish(Weights(), {}, 3, sync_every=2)[:2]
      (3, True)
    """
    served = _served(weights)
    if served == version or 0 < version - served < sync_every:
        return served, False, 0.0
    start = time.monotonic()
    for _ in range(2):
        weights.load(params, version)
        now = _served(weights)
        if now == version:
            return now, True, time.monotonic() - start
    raise RuntimeError(
        f"weights.load(params, {version}) left the served version at {now} twice; expected "
        f"it to serve version {version} after the push"
    )


class Update(Stage):
    """Publishes versions and hands each batch over (see the module docstring).

    Ports:
      rows (in): packed (and rescored) rows, one batch per handover, in order.
      records (in, optional): the :class:`~dew_pipe.stages.messages.SchedulerRecord` of
        each batch, from pack.
      trainer (in, optional): :class:`~dew_pipe.stages.messages.Step` per batch (library
        view; required there).
      handover (out, optional): :class:`~dew_pipe.stages.messages.Handover` per batch.
      params (out, optional): :class:`~dew_pipe.stages.messages.Proximal` per batch.
      batches (out, optional): :class:`~dew_pipe.stages.messages.Handed` per batch
        (library view).

    Args:
      width: W, ids per row.
      support_capacity: C, when rows carry supports.
      weights: the publisher (``load(params, version)``, ``version``); None publishes
        nothing and reports the trainer's version as served.
      sync_every: push when the served version is this many updates behind.
      trainer: a ``dew_pipe.Trainer`` to run the update with (pipeline view).
      steps: batches to train on in the pipeline view.
      state: the ``TrainState`` to start from (default ``trainer.initial_state()``); it is
        donated.
      log: ``log(step, metrics, record)`` after each update (pipeline view): the step
        number, the update's metrics as floats, and the batch's record.
      name: the stage's name.

    Attributes:
      state: in the pipeline view, the newest ``TrainState``.

    Example (the library view's ports; ``RolloutScheduler`` feeds ``trainer``):
      >>> stage = Update(width=64, sync_every=2)
      >>> sorted(stage.inputs), sorted(stage.outputs)
      (['records', 'rows', 'trainer'], ['batches', 'handover', 'params'])
    """

    def __init__(
        self,
        *,
        width: int,
        support_capacity: int | None = None,
        weights: Any = None,
        sync_every: int = 1,
        trainer: Any = None,
        steps: int | None = None,
        state: Any = None,
        log: Callable[[int, dict[str, float], SchedulerRecord | None], None] | None = None,
        name: str = "update",
    ) -> None:
        super().__init__(
            name,
            inputs={
                "rows": packed_schema(width, support_capacity=support_capacity),
                "records": Port(SchedulerRecord, required=False),
                "trainer": Port(Step, required=False, doc="library view: batches to hand over"),
            },
            outputs={
                "handover": Port(Handover, required=False),
                "params": Port(Proximal, required=False),
                "batches": Port(Handed, required=False, doc="library view"),
            },
        )
        if weights is not None and not callable(getattr(weights, "load", None)):
            raise TypeError(f"weights={weights!r}; expected a publisher with load(params, version)")
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"sync_every={sync_every!r}; expected an int >= 1")
        if trainer is not None and not callable(getattr(trainer, "train_step", None)):
            raise TypeError(f"trainer={trainer!r}; expected a dew_pipe.Trainer")
        if trainer is not None and (
            isinstance(steps, bool) or not isinstance(steps, int) or steps < 0
        ):
            raise ValueError(f"steps={steps!r}; expected an int >= 0 with a trainer")
        if log is not None and not callable(log):
            raise TypeError(f"log={log!r}; expected None or log(step, metrics, record)")
        self.weights = weights
        self.sync_every = sync_every
        self.trainer = trainer
        self.steps = steps
        self.state = state
        self.log = log

    def run(self, ctx: StageContext) -> None:
        if self.trainer is not None:
            self._train(ctx)
            return
        if not ctx.connected("trainer"):
            raise ValueError(
                f"stage {self.name!r} has no trainer: pass trainer=Trainer(...) and steps, or "
                "connect its 'trainer' input to an Inlet of Step (RolloutScheduler does)"
            )
        for index, step in enumerate(ctx.read("trainer")):
            if step.batch != index:
                raise RuntimeError(f"update: step for batch {step.batch}, expected {index}")
            served = self._serve(ctx, index, step.version, step.params)
            if served is None:
                return
            ctx.put("batches", Handed(index, *served))

    def _train(self, ctx: StageContext) -> None:
        import jax

        state = self.trainer.initial_state() if self.state is None else self.state
        self.state = None  # donated below; only the newest state is kept
        for index in range(self.steps):
            if ctx.cancelled:
                raise Cancelled()
            version = int(state.updates)
            served = self._serve(ctx, index, version, state.params)
            if served is None:
                self.state = state
                return
            rows, record = served
            state, metrics = self.trainer.train_step(state, packed_from_arrow(rows))
            self.state = state
            values = {k: float(v) for k, v in jax.device_get(metrics).items()}
            if not values.get("finite", 1.0):
                raise FloatingPointError(
                    f"update {index}: non-finite loss or gradient (loss={values.get('loss')}, "
                    f"grad_norm={values.get('grad_norm')})"
                )
            ctx.heartbeat()
            if self.log is not None:
                self.log(index, values, record)

    def _serve(
        self, ctx: StageContext, index: int, version: int, params: Any
    ) -> tuple[pa.RecordBatch, SchedulerRecord | None] | None:
        """Publish, hand over, wait for the batch: ``(rows, record)``, None at end of stream."""
        # Rescoring needs only the trainer's weights, so it may run during the push (which
        # mostly waits for the server to reach a step boundary); the handover must follow
        # the push, since rollout submits the next batch under the version it announces.
        ctx.put("params", Proximal(index, version, params))
        if self.weights is None:
            served, pushed, push_s = version, False, 0.0
        else:
            served, pushed, push_s = publish(self.weights, params, version, self.sync_every)
        ctx.put("handover", Handover(index, version, served, pushed))
        start = time.monotonic()
        rows = self._next(ctx, "rows")
        if rows is None:
            return None
        record = self._next(ctx, "records") if ctx.connected("records") else None
        if record is not None:
            waited = time.monotonic() - start
            record = dataclasses.replace(record, waited_s=waited, push_s=push_s)
        return rows, record

    @staticmethod
    def _next(ctx: StageContext, port: str) -> Any:
        while True:
            try:
                item = ctx.get(port)
            except EndOfStream:
                return None
            if item is not None:
                return item
