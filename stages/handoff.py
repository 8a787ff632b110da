"""Handoff: publishes weight versions, announces each handover, hands the batch on.

For each batch ``i`` the stage

1. sends the trainer's live weights to rescore (a ``Proximal``), so rescoring overlaps
   the push of step 2;
2. pushes the weights through ``weights.load(params, version)`` when the served version
   has fallen ``sync_every`` updates behind (or is ahead, after a restore from an older
   checkpoint); a push that leaves the served version where it was is tried once more,
   then fails the run (:func:`publish`). A publisher whose ``load`` returns a future (the
   native and process servers) is not waited for: its push is ordered before the
   submissions that follow, and its outcome is checked at the next push (:class:`Pushes`);
3. announces the handover (``Handover(i, version, served, pushed, position)``) to rollout,
   which may then submit batches up to ``i + ahead``, and to pack, which checks lag against
   ``version``; ``position`` (the trainer's step) files journaled sessions for a resume;
4. waits for batch ``i``, packed and rescored, with its record;
5. hands it on.

Two stages share steps 1-4 and differ in step 5 and in where the weights come from:

* :class:`Handoff` (library view): a :class:`~dew_pipe.stages.messages.Step` on the
  ``trainer`` port, put there by ``RolloutScheduler`` from the Trainer's own thread, starts
  each batch; the batch goes back on ``batches`` and the Trainer runs its compiled update.
* :class:`~dew_pipe.stages.train.Train` (pipeline view): owns a training state and runs
  the trainer's step on each batch itself.

The weights sent to rescore are the trainer's live arrays: the update that donates them
only runs once the rescored batch is back, so neither stage copies them.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Future
from typing import Any

import pyarrow as pa

from dew_pipe._validate import check_int
from dew_pipe.batches import packed_schema
from dew_pipe.flow import EndOfStream, Port, Stage, StageContext
from dew_pipe.stages.messages import Handed, Handover, Proximal, SchedulerRecord, Step
from dew_pipe.stages.protocols import WeightsPublisher

__all__ = ["Handoff", "Pushes", "publish", "served_version"]

Ports = dict[str, Any]


def served_version(weights: WeightsPublisher) -> int:
    """``weights.version``, checked: the version the publisher serves now.

    Raises:
      TypeError: ``version`` is missing or not an int >= 0.

    Example:
      >>> class Weights:
      ...     version = 2
      >>> served_version(Weights())
      2
    """
    version = getattr(weights, "version", None)
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise TypeError(f"weights.version is {version!r}; expected the served version, an int >= 0")
    return version


class Pushes:
    """The last weight push still in flight, checked before the next one and at the end.

    A publisher whose ``load`` returns a future (``NativeRolloutServer``,
    ``ProcessRolloutServer``) pushes without blocking: the push is ordered before the
    submissions that follow it, so the handover may be announced at once and the server
    applies the weights at its next step. Its failure surfaces here, at the next push or
    at :meth:`settle`, naming the version; at most one push is in flight.

    Example:
      >>> from concurrent.futures import Future
      >>> pushes, pending = Pushes(), Future()
      >>> pushes.track(pending, 3)
      >>> pending.set_result(3)
      >>> pushes.settle()
    """

    def __init__(self) -> None:
        self._pending: tuple[Future, int] | None = None

    def track(self, future: Future, version: int) -> None:
        """Keeps ``future``, the push of ``version``, after settling the one before."""
        self.settle()
        self._pending = (future, version)

    def settle(self) -> None:
        """Waits for the push in flight, if any.

        Raises:
          RuntimeError: it failed (chained from its error).
        """
        pending, self._pending = self._pending, None
        if pending is not None:
            _wait(*pending)


def publish(
    weights: WeightsPublisher,
    params: Any,
    version: int,
    sync_every: int,
    pushes: Pushes | None = None,
) -> tuple[int, bool, float]:
    """Push ``params`` as ``version`` when the served version is ``sync_every`` behind.

    Args:
      weights: the publisher.
      params: the trainer's variables.
      version: the trainer's version (``TrainState.updates``).
      sync_every: push once the served version is this many updates behind.
      pushes: where a push that returned a future stays in flight (checked at the next
        push); None waits for it here.

    Returns:
      ``(served version, pushed, seconds the call took)``.

    Raises:
      RuntimeError: two pushes in a row left the served version unchanged, or a push
        failed (the one waited for here, or the one before in ``pushes``).

    Example:
      >>> class Weights:
      ...     version = 0
      ...     def load(self, params, version):
      ...         self.version = version
      >>> publish(Weights(), {}, 3, sync_every=2)[:2]
      (3, True)
    """
    served = served_version(weights)
    if served == version or 0 < version - served < sync_every:
        return served, False, 0.0
    start = time.monotonic()
    if pushes is not None:
        pushes.settle()  # the push before must have served before this one starts
    for _ in range(2):
        pending = weights.load(params, version)
        if isinstance(pending, Future):
            if pushes is None:
                _wait(pending, version)
            else:
                pushes.track(pending, version)
        now = served_version(weights)
        if now == version:
            return now, True, time.monotonic() - start
    raise RuntimeError(
        f"weights.load(params, {version}) left the served version at {now} twice; expected "
        f"it to serve version {version} after the push"
    )


def _wait(future: Future, version: int) -> None:
    try:
        future.result()
    except BaseException as error:
        raise RuntimeError(f"the weights push of version {version} failed") from error


class Handoff(Stage):
    """Publishes versions and hands each batch back to the Trainer (the library view).

    Ports:
      rows (in): packed (and rescored) rows, one batch per handover, in order.
      records (in, optional): the :class:`~dew_pipe.stages.messages.SchedulerRecord` of
        each batch, from pack.
      trainer (in): a :class:`~dew_pipe.stages.messages.Step` per batch, from the Trainer.
      handover (out, optional): :class:`~dew_pipe.stages.messages.Handover` per batch.
      params (out, optional): :class:`~dew_pipe.stages.messages.Proximal` per batch.
      batches (out): :class:`~dew_pipe.stages.messages.Handed` per batch, to the Trainer.

    Args:
      width: W, ids per row.
      support_capacity: C, when rows carry supports.
      weights: the publisher; None publishes nothing and reports the trainer's version as
        served.
      sync_every: push when the served version is this many updates behind.
      name: the stage's name ("update": the node where the graph's updates happen).

    Raises:
      TypeError: ``weights`` is not a publisher; ValueError: ``sync_every`` below 1.

    Example:
      >>> stage = Handoff(width=64, sync_every=2)
      >>> sorted(stage.inputs), sorted(stage.outputs)
      (['records', 'rows', 'trainer'], ['batches', 'handover', 'params'])
    """

    def __init__(
        self,
        *,
        width: int,
        support_capacity: int | None = None,
        weights: WeightsPublisher | None = None,
        sync_every: int = 1,
        name: str = "update",
        share_prompts: bool = False,
    ) -> None:
        schema = packed_schema(
            width, support_capacity=support_capacity, share_prompts=share_prompts
        )
        inputs, outputs = self._ports(schema)
        super().__init__(name, inputs=inputs, outputs=outputs)
        if weights is not None and not isinstance(weights, WeightsPublisher):
            raise TypeError(f"weights={weights!r}; expected a publisher with load(params, version)")
        self.weights = weights
        self.sync_every = check_int("sync_every", sync_every, minimum=1)
        self._pushes = Pushes()

    @staticmethod
    def _ports(rows: pa.Schema) -> tuple[Ports, Ports]:
        """The stage's inputs and outputs (``Train`` has the same without the Trainer's)."""
        inputs = {
            "rows": rows,
            "records": Port(SchedulerRecord, required=False),
            "trainer": Port(Step, doc="the Trainer's handovers"),
        }
        outputs = {
            "handover": Port(Handover, required=False),
            "params": Port(Proximal, required=False),
            "batches": Port(Handed, doc="each batch, back to the Trainer"),
        }
        return inputs, outputs

    def run(self, ctx: StageContext) -> None:
        for index, step in enumerate(ctx.read("trainer")):
            if step.batch != index:
                raise RuntimeError(f"{self.name}: step for batch {step.batch}, expected {index}")
            served = self._serve(
                ctx, index, step.version, step.params, step.position, published=step.published
            )
            if served is None:
                return
            ctx.put("batches", Handed(index, *served))
        self._pushes.settle()

    def _serve(
        self,
        ctx: StageContext,
        index: int,
        version: int,
        params: Any,
        position: int | None,
        *,
        published: tuple[int, bool, float] | None = None,
    ) -> tuple[pa.RecordBatch, SchedulerRecord | None] | None:
        """Publish, hand over, wait for the batch: ``(rows, record)``, None at end of stream.

        ``position`` is the trainer's step as it takes the batch (None when unknown);
        ``published`` a push the caller already made (then this stage pushes nothing).
        """
        # Rescoring needs only the trainer's weights, so it may run during the push; the
        # handover must follow the push call, since rollout submits the next batch under
        # the version it announces. A publisher that returns a future has ordered the push
        # before those submissions, so the handover need not wait for the server to reach
        # a step boundary: the push stays in flight (checked at the next one).
        ctx.put("params", Proximal(index, version, params))
        if published is not None:
            served, pushed, push_s = published
        elif self.weights is None:
            served, pushed, push_s = version, False, 0.0
        else:
            served, pushed, push_s = publish(
                self.weights, params, version, self.sync_every, self._pushes
            )
        ctx.put("handover", Handover(index, version, served, pushed, position))
        start = time.monotonic()
        rows = _next(ctx, "rows")
        if rows is None:
            self._pushes.settle()
            return None
        record = _next(ctx, "records") if ctx.connected("records") else None
        if record is not None:
            waited = time.monotonic() - start
            record = dataclasses.replace(record, waited_s=waited, push_s=push_s)
        return rows, record


def _next(ctx: StageContext, port: str) -> Any:
    """The next item on ``port`` (skipping Nones), or None at end of stream."""
    while True:
        try:
            item = ctx.get(port)
        except EndOfStream:
            return None
        if item is not None:
            return item
