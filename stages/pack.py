"""Pack: admits finished sessions into groups and batches, packs them into fixed rows.

The stage wraps :class:`~dew_pipe.stages.admission.Admission` (where every rule lives) in
the flow runtime: it reads plans, finished sessions and handovers, sends the orders
admission makes back to rollout (the feedback edge), and puts each ready batch on ``rows``
as Arrow packed rows, in batch order, with its :class:`~dew_pipe.stages.messages.
SchedulerRecord` on ``records``.

With ``handover`` connected a batch waits for its handover (so lag is checked against the
version it will train at); once the handovers end the stage packs nothing more, discards
what still comes back and ends with its inputs, so every submission rollout made is
accounted for. Without it, batches go out as soon as they are complete and lag is not
checked.

With a :class:`~dew_pipe.stages.journal.Journal`, every session admission keeps from the
source is written to it as soon as it is kept, filed under its batch's position (the
trainer's step, which the handovers carry), so a resumed run can replay it.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from dew_pipe.batches import packed_schema, packed_to_arrow
from dew_pipe.flow import EndOfStream, Port, Stage, StageContext
from dew_pipe.stages.admission import Admission, Kept
from dew_pipe.stages.journal import Entry, Journal
from dew_pipe.stages.messages import SESSION_ROWS, Handover, Orders, Plan, SchedulerRecord

__all__ = ["Pack"]


class Pack(Stage):
    """Admission and packing of sessions into ``[rows, width]`` training batches.

    Ports:
      sessions (in): stamped sessions (from reward, or straight from rollout).
      plans (in): a :class:`~dew_pipe.stages.messages.Plan` per task batch, from rollout.
      handover (in, optional): the trainer's handovers, from update.
      rows (out): packed rows (:func:`~dew_pipe.batches.packed_schema`), one batch per plan.
      orders (out): resubmissions, cancellations and releases, to rollout (feedback).
      records (out, optional): one :class:`~dew_pipe.stages.messages.SchedulerRecord`
        per packed batch, put right after it.

    Args:
      width, rows, groups, admit, max_lag, max_attempts, truncation, estimator,
      support_capacity, audit: see :class:`~dew_pipe.stages.admission.Admission`.
      journal: where kept sessions are recorded for a resume (needs ``handover`` and
        handovers that carry the trainer's ``position``); None records nothing.
      name: the stage's name.

    Attributes:
      admission: the bookkeeping of the current (or last) run, created by ``open``.
      shutdown_cause: the cause recorded for tickets still open when the stage closes.

    Example:
      >>> stage = Pack(width=64, rows=8, groups=4, max_lag=1)
      >>> sorted(stage.inputs), sorted(stage.outputs)
      (['handover', 'plans', 'sessions'], ['orders', 'records', 'rows'])
      >>> stage.outputs["rows"].type.field("input_ids").type
      FixedSizeListType(fixed_size_list<item: int32>[64])
    """

    def __init__(
        self,
        *,
        width: int,
        rows: int,
        groups: int,
        admit: int | None = None,
        max_lag: int | None = None,
        max_attempts: int = 3,
        truncation: str = "mask",
        estimator: str = "group",
        support_capacity: int | None = None,
        audit: bool = False,
        journal: Journal | None = None,
        share_prompts: bool = False,
        name: str = "pack",
    ) -> None:
        super().__init__(
            name,
            inputs={
                "sessions": SESSION_ROWS,
                "plans": Plan,
                "handover": Port(Handover, required=False, doc="the trainer's progress"),
            },
            outputs={
                "rows": packed_schema(
                    width, support_capacity=support_capacity, share_prompts=share_prompts
                ),
                "orders": Orders,
                "records": Port(SchedulerRecord, required=False, doc="one per batch"),
            },
        )
        self._settings: dict[str, Any] = dict(
            width=width,
            rows=rows,
            groups=groups,
            admit=admit,
            max_lag=max_lag,
            max_attempts=max_attempts,
            truncation=truncation,
            estimator=estimator,
            support_capacity=support_capacity,
            audit=audit,
            journal=journal is not None,
            share_prompts=share_prompts,
        )
        if journal is not None and not isinstance(journal, Journal):
            raise TypeError(f"journal={journal!r}; expected None or a Journal")
        self.journal = journal
        self.admission = Admission(**self._settings)  # checks the settings now
        self.shutdown_cause = "shutdown"

    def open(self) -> None:
        self.admission = Admission(**self._settings)
        self._position: int | None = None  # the position of this run's batch 0
        self._unfiled: list[Kept] = []  # kept before that position was known

    def close(self) -> None:
        self.admission.shutdown(self.shutdown_cause)

    def run(self, ctx: StageContext) -> None:
        paced = ctx.connected("handover")
        while True:
            if paced and ctx.ended("handover") and self.admission.draining is None:
                # The trainer is gone. Tell rollout no order follows (it carries out those
                # before stopping), and keep reading until it has stopped, so every
                # submission is known and decided; close() decides what still runs.
                self.admission.drain(self.shutdown_cause)
                ctx.put("orders", Orders(final=True))
            ports = [p for p in ("plans", "sessions", "handover") if not ctx.ended(p)]
            if not ports:
                return
            try:
                got = ctx.get_any(ports)
            except EndOfStream:
                continue
            if got is None:
                continue
            port, item = got
            if port == "plans":
                self.admission.plan(item)
            elif port == "handover":
                self._position_of(item)
                self.admission.handover(item)
            else:
                self._take(ctx, item)
            if self.admission.draining is None:
                self._flush(ctx, paced)

    def _take(self, ctx: StageContext, batch: pa.RecordBatch) -> None:
        from dew_pipe.stages.messages import unstamp_sessions

        sessions, stamps = unstamp_sessions(batch, tasks=False)  # admission never reads them
        for session, stamp in zip(sessions, stamps, strict=True):
            if not self.admission.knows(stamp.batch):
                self._drain_plans(ctx)  # rollout put the plan before submitting
            self.admission.finished(session, stamp)

    def _drain_plans(self, ctx: StageContext) -> None:
        while True:
            try:
                plan = ctx.get("plans", timeout=0)
            except EndOfStream:
                return
            if plan is None:
                return
            self.admission.plan(plan)

    def _position_of(self, handover: Handover) -> None:
        if self.journal is None or self._position is not None:
            return
        if handover.position is None:
            raise ValueError(
                f"{self.name}: a journal files sessions under the trainer's position, but "
                f"the handover of batch {handover.batch} carries none"
            )
        self._position = handover.position - handover.batch

    def _journal(self) -> None:
        """Record the sessions kept since the last flush (atomically, one file each)."""
        self._unfiled.extend(self.admission.take_kept())
        if self.journal is None or not self._unfiled or self._position is None:
            return  # (a session read before the first handover waits for its position)
        base, kept, self._unfiled = self._position, self._unfiled, []
        self.journal.record(
            Entry(base + k.batch, k.row, k.session, k.stamps.submitted_version, k.stamps.latency)
            for k in kept
        )

    def _flush(self, ctx: StageContext, paced: bool) -> None:
        self._journal()
        ready = self.admission.ready(paced)
        orders = self.admission.take_orders()
        if orders:
            ctx.put("orders", orders)
        for columns, record in ready:
            ctx.put("rows", packed_to_arrow(columns))
            ctx.put("records", record)
