"""Admission: which sessions train in which batch, and what to resubmit or cancel.

Pure bookkeeping without threads or queues: the pack stage feeds it plans, finished
sessions and handovers, sends the orders it accumulates and packs the batches it declares
ready; tests drive it directly.

**Tickets.** Every submission is a ticket ``(group, sample, attempt)``; the first attempts
come from a batch's :class:`~dew_pipe.stages.messages.Plan`, later ones from this object's
own resubmissions. Each ticket ends in exactly one outcome, decided here once: admitted,
resubmitted (with a cause), discarded, cancelled or abandoned. A result that comes back
for a ticket already decided (a cancelled one that finished anyway) changes nothing.

**Rules**, in the order a finished session meets them:

1. Its group is no longer open (complete, cut, abandoned, or closed because ``admit``
   groups of the batch are in): discarded.
2. A failure is resubmitted under a new attempt: INFRA_ERROR, CANCELLED (by the source, or
   by rollout for a timeout or a stale submission), TRUNCATED without a reward under
   ``truncation="score"``, and a session whose oldest call lags the trainer by more than
   ``max_lag``. Each failure uses one of the sample's ``max_attempts``; the last one
   abandons the sample, and the group with it once its remaining samples cannot make G.
3. Anything else (COMPLETED and AGENT_ERROR with a reward, TRUNCATED under "mask" and
   "zero") is kept. The first G kept complete the group; the group's other submissions
   are cancelled. A complete group is admitted when its chains fit the batch's N rows
   beside the groups admitted before it, and cut otherwise; one that needs more than N
   rows on its own raises.

Lag is measured against the version the batch trains at once its handover is known, and
against the newest trainer version seen before that (a lower bound, since versions only
grow). At a handover every kept session of that batch and later ones is checked again,
and a stale one leaves its group (which reopens) and is resubmitted.

A batch is ready when every group is admitted, cut or abandoned, or when ``admit`` groups
are admitted (the rest are cancelled), and, when handovers pace the pipeline, once its
handover has arrived. Batches are packed in order.

**Replays.** After a resume, rollout may serve a first attempt from the rollout journal
(:mod:`dew_pipe.stages.journal`) instead of the source; its plan names those tickets
(``Plan.replayed``). They are counted (``totals["replayed"]``, ``SchedulerRecord.replayed``)
and otherwise meet the rules above like any finished session. With ``journal=True`` every
session kept from the source is also handed out by :meth:`Admission.take_kept` for the pack
stage to journal.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable

import numpy as np

from dew_pipe._validate import check_int
from dew_pipe.objectives.rl.packing import TRUNCATIONS, chain_lengths, pack, rows_needed
from dew_pipe.objectives.rl.session_stats import session_metrics
from dew_pipe.objectives.rl.sessions import Session, Status
from dew_pipe.stages.messages import Handover, Orders, Plan, Resubmit, SchedulerRecord, Stamps

__all__ = ["OUTCOMES", "Admission", "Kept", "Ticket"]

#: The outcomes a ticket can end in.
OUTCOMES = ("admitted", "resubmitted", "discarded", "cancelled", "abandoned")

Key = tuple[int, int, int]  # (group, sample, attempt)


@dataclasses.dataclass(frozen=True)
class Kept:
    """A session kept from the source: its batch, its task's row, the session, its stamps."""

    batch: int
    row: int
    session: Session
    stamps: Stamps


@dataclasses.dataclass
class Ticket:
    """One submission and what became of it.

    Attributes:
      key: ``(group, sample, attempt)``.
      batch: the task batch it belongs to.
      task: the task id.
      outcome: one of :data:`OUTCOMES`, or None while undecided.
      cause: why it was resubmitted (a :data:`~dew_pipe.stages.messages.CAUSES` entry) or
        abandoned, or what discarded or cancelled it ("surplus", "cut", "admit",
        "abandoned", and the shutdown cause).
    """

    key: Key
    batch: int
    task: int
    outcome: str | None = None
    cause: str = ""
    kept: bool = False  # finished and held by its group, outcome still open
    replayed: bool = False  # served from the rollout journal, not the source


@dataclasses.dataclass
class _Kept:
    session: Session
    latency: float
    submitted_version: int
    ticket: Ticket


class _Group:
    def __init__(self, group: int, task: int, batch: int, samples: int, row: int) -> None:
        self.group, self.task, self.batch, self.row = group, task, batch, row
        self.failures = [0] * samples
        self.live: list[Ticket | None] = [None] * samples  # the sample's undecided ticket
        self.kept: list[_Kept] = []
        self.lengths: np.ndarray | None = None  # chain lengths once admitted
        self.state = "open"  # open, admitted, cut, abandoned, closed


class _Batch:
    def __init__(self, index: int) -> None:
        self.index = index
        self.groups: list[_Group] = []
        self.tickets: list[Ticket] = []
        self.admitted: list[_Group] = []  # in completion order
        self.version: int | None = None
        self.served: int | None = None
        self.pushed = False
        self.counts: collections.Counter[str] = collections.Counter()
        self.resubmitted: collections.Counter[str] = collections.Counter()


class Admission:
    """Admission state of every batch in flight (see the module docstring for the rules).

    Args:
      width: W, ids per packed row.
      rows: N, rows per packed batch.
      groups: G, sessions each group trains on.
      admit: pack a batch once this many of its groups are admitted (None: all of them).
      max_lag: most updates an admitted session's oldest call may lag; None: no limit.
      max_attempts: failures a sample may have; the last one abandons it.
      truncation: "mask", "score" or "zero", as for ``pack``.
      estimator: the advantage estimator, as for ``pack``.
      support_capacity: as for ``pack``.
      share_prompts: as for ``pack``: a group's sessions share one copy of their prompt,
        and a group's room in the batch is counted the same way.
      audit: keep every ticket in ``ledger`` for the whole run (tests); otherwise the
        tickets of packed batches are dropped and only ``totals`` keep count.
      journal: hand every session kept from the source out through :meth:`take_kept`.
      clock: seconds, for the records.

    Example:
      >>> from dew_pipe.objectives.rl.sessions import Call
      >>> a = Admission(width=8, rows=1, groups=2)
      >>> a.plan(Plan(0, (0,), (7,), 2, 0))
      >>> for k in range(2):
      ...     s = Session(7, 0, k, 0, [Call([1, 2], [3], [-0.1], "stop", 0)], "COMPLETED", float(k))
      ...     a.finished(s, Stamps(0, 0, 0.01))
      >>> [(r.admitted_groups, r.submitted) for _, r in a.ready(paced=False)]
      [(1, 2)]
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
        journal: bool = False,
        clock: Callable[[], float] = time.monotonic,
        share_prompts: bool = False,
    ) -> None:
        self.width = check_int("width", width, minimum=1)
        self.rows = check_int("rows", rows, minimum=1)
        self.groups = check_int("groups", groups, minimum=1)
        self.admit = check_int("admit", admit, minimum=1, allow_none=True)
        self.max_lag = check_int("max_lag", max_lag, minimum=0, allow_none=True)
        self.max_attempts = check_int("max_attempts", max_attempts, minimum=1)
        if truncation not in TRUNCATIONS:
            raise ValueError(f"truncation is {truncation!r}; expected one of {TRUNCATIONS}")
        self.truncation = truncation
        self.estimator = estimator
        self.support_capacity = support_capacity
        if not isinstance(share_prompts, bool):
            raise TypeError(f"share_prompts is {share_prompts!r}; expected a bool")
        self.share_prompts = share_prompts
        self.audit = audit
        self.journal = journal
        self.clock = clock
        self.ledger: dict[Key, Ticket] = {}
        self.totals: collections.Counter[str] = collections.Counter()
        self.late = 0  # results of tickets already decided, ignored
        self.version: int | None = None  # the newest trainer version seen
        self.draining: str | None = None  # the cause, once the run is stopping
        self._groups: dict[int, _Group] = {}
        self._batches: dict[int, _Batch] = {}
        self._handovers: dict[int, Handover] = {}  # arrived before their plan
        self._next = 0  # the next batch to pack
        self._resubmit: list[Resubmit] = []
        self._cancel: list[Key] = []
        self._release: list[int] = []
        self._kept_out: list[Kept] = []

    # ------------------------------------------------------------------ inputs

    def plan(self, plan: Plan) -> None:
        """Register a task batch and the first attempt of each of its samples."""
        if plan.batch in self._batches or plan.batch < self._next:
            raise ValueError(f"plan: batch {plan.batch} was planned before")
        if plan.samples < self.groups:
            raise ValueError(
                f"plan: batch {plan.batch} submits {plan.samples} samples per group, fewer "
                f"than groups={self.groups}"
            )
        batch = _Batch(plan.batch)
        for row, (group, task) in enumerate(zip(plan.groups, plan.tasks, strict=True)):
            g = _Group(group, task, plan.batch, plan.samples, row)
            for sample in range(plan.samples):
                g.live[sample] = self._ticket((group, sample, 0), batch, task)
            batch.groups.append(g)
            self._groups[group] = g
        for group, sample in plan.replayed:
            self.ledger[(group, sample, 0)].replayed = True
            batch.counts["replayed"] += 1
            self.totals["replayed"] += 1
        self._batches[plan.batch] = batch
        handover = self._handovers.pop(plan.batch, None)
        if handover is not None:
            self._hand(batch, handover)

    def knows(self, batch: int) -> bool:
        """Whether ``batch`` was planned (or already packed)."""
        return batch in self._batches or batch < self._next

    def finished(self, session: Session, stamps: Stamps) -> None:
        """Take a finished session (relabelled with its ticket, stamped by rollout).

        Raises:
          ValueError: a session no plan or resubmission names; a COMPLETED or AGENT_ERROR
            session without a reward; a group whose chains need more than N rows.
        """
        key = (session.group, session.sample, session.attempt)
        ticket = self.ledger.get(key)
        if ticket is None:
            if stamps.batch < self._next:  # its batch is packed and its tickets forgotten
                self.late += 1
                return
            raise ValueError(
                f"session {session.describe()} of batch {stamps.batch} was never submitted: "
                "no plan or resubmission names it"
            )
        if ticket.outcome is not None or ticket.kept:
            self.late += 1
            return
        if self.draining is not None:  # nothing trains any more: no retries, no batches
            self._final(ticket, "discarded", self.draining)
            return
        group = self._groups[session.group]
        if group.live[session.sample] is ticket:
            group.live[session.sample] = None
        batch = self._batches[ticket.batch]
        if stamps.cause in ("timeout", "stale_running"):
            batch.counts["cancellations"] += 1
        if group.state != "open":
            self._final(ticket, "discarded", "surplus")
            return
        cause = self._failure(session, stamps, batch)
        if cause is not None:
            self._retry(group, session.sample, ticket, cause)
            return
        ticket.kept = True
        group.kept.append(_Kept(session, float(stamps.latency), stamps.submitted_version, ticket))
        if self.journal and not ticket.replayed:  # a replay is in the journal already
            self._kept_out.append(Kept(ticket.batch, group.row, session, stamps))
        if len(group.kept) >= self.groups:
            self._complete(group)

    def handover(self, handover: Handover) -> None:
        """The trainer waits for batch ``handover.batch`` at ``handover.version``."""
        self.version = (
            handover.version if self.version is None else max(self.version, handover.version)
        )
        batch = self._batches.get(handover.batch)
        if batch is None:
            self._handovers[handover.batch] = handover
        else:
            self._hand(batch, handover)
        for index in sorted(self._batches):
            if index >= handover.batch:
                self._recheck(self._batches[index])

    def take_orders(self) -> Orders:
        """The orders accumulated since the last call (possibly empty)."""
        orders = Orders(tuple(self._resubmit), tuple(self._cancel), tuple(self._release))
        self._resubmit, self._cancel, self._release = [], [], []
        return orders

    def take_kept(self) -> list[Kept]:
        """The sessions kept from the source since the last call, for the journal."""
        out, self._kept_out = self._kept_out, []
        return out

    def ready(self, paced: bool) -> list[tuple[dict[str, np.ndarray], SchedulerRecord]]:
        """Pack every batch that is ready, in order: ``[(packed columns, record)]``.

        Args:
          paced: handovers pace the pipeline, so a batch also waits for its handover.
        """
        out = []
        while (batch := self._batches.get(self._next)) is not None:
            if paced and batch.version is None:
                break
            complete = all(g.state != "open" for g in batch.groups)
            if not complete and not (self.admit and len(batch.admitted) >= self.admit):
                break
            out.append(self._pack(batch))
            del self._batches[batch.index]
            self._next += 1
        return out

    def drain(self, cause: str) -> None:
        """The run is stopping: sessions still arriving are discarded with ``cause``, and
        nothing is resubmitted or packed any more (see :meth:`shutdown` for the rest)."""
        self.draining = cause

    def shutdown(self, cause: str) -> None:
        """Decide every open ticket as the run stops: kept ones discarded, running ones
        cancelled (rollout cancels them as it closes; no orders are sent)."""
        for batch in self._batches.values():
            for ticket in batch.tickets:
                if ticket.outcome is None:
                    self._final(ticket, "discarded" if ticket.kept else "cancelled", cause)

    # ------------------------------------------------------------------ rules

    def _ticket(self, key: Key, batch: _Batch, task: int) -> Ticket:
        if key in self.ledger:
            raise RuntimeError(f"ticket {key} was issued twice")
        ticket = Ticket(key, batch.index, task)
        self.ledger[key] = ticket
        batch.tickets.append(ticket)
        self.totals["submitted"] += 1
        return ticket

    def _final(self, ticket: Ticket, outcome: str, cause: str = "") -> None:
        if ticket.outcome is not None:  # an internal invariant: one outcome per ticket
            raise RuntimeError(f"ticket {ticket.key} decided twice ({ticket.outcome}, {outcome})")
        ticket.outcome, ticket.cause, ticket.kept = outcome, cause, False
        batch = self._batches[ticket.batch]
        if outcome == "resubmitted":
            batch.resubmitted[cause] += 1
            self.totals[f"resubmitted/{cause}"] += 1
        else:
            batch.counts[outcome] += 1
        self.totals[outcome] += 1

    def _failure(self, session: Session, stamps: Stamps, batch: _Batch) -> str | None:
        """Why a finished session cannot be kept, or None when it can."""
        if stamps.cause:
            return stamps.cause
        status = session.status
        if status is Status.INFRA_ERROR:
            return "infra_error"
        if status is Status.CANCELLED:
            return "cancelled"
        if session.reward is None:
            if status is Status.TRUNCATED and self.truncation == "score":
                return "unscored"
            if status in (Status.COMPLETED, Status.AGENT_ERROR):
                raise ValueError(
                    f"session {session.describe()} has no reward; a source scores the "
                    "sessions it completes (or give the scheduler a reward function)"
                )
        if self._stale(session, stamps.submitted_version, batch):
            return "stale"
        return None

    def _stale(self, session: Session, submitted: int, batch: _Batch) -> bool:
        reference = batch.version if batch.version is not None else self.version
        if reference is None or self.max_lag is None:
            return False
        oldest = min((c.version for c in session.calls), default=submitted)
        return reference - oldest > self.max_lag

    def _retry(self, group: _Group, sample: int, ticket: Ticket, cause: str) -> None:
        group.failures[sample] += 1
        if group.failures[sample] >= self.max_attempts:
            self._final(ticket, "abandoned", cause)
            possible = len(group.kept) + sum(t is not None for t in group.live)
            if possible < self.groups:
                self._abandon(group)
            return
        self._final(ticket, "resubmitted", cause)
        batch = self._batches[group.batch]
        attempt = ticket.key[2] + 1
        group.live[sample] = self._ticket((group.group, sample, attempt), batch, group.task)
        self._resubmit.append(Resubmit(batch.index, group.group, sample, attempt, cause))

    def _cancel_live(self, group: _Group, cause: str) -> None:
        for sample, ticket in enumerate(group.live):
            if ticket is not None:
                self._final(ticket, "cancelled", cause)
                self._batches[group.batch].counts["cancellations"] += 1
                self._cancel.append(ticket.key)
                group.live[sample] = None

    def _drop_kept(self, group: _Group, outcome: str, cause: str) -> None:
        for kept in group.kept:
            self._final(kept.ticket, outcome, cause)
        group.kept = []

    def _abandon(self, group: _Group) -> None:
        group.state = "abandoned"
        self._batches[group.batch].counts["abandoned_groups"] += 1
        self._drop_kept(group, "abandoned", "abandoned")
        self._cancel_live(group, "abandoned")

    def _complete(self, group: _Group) -> None:
        batch = self._batches[group.batch]
        sessions = [k.session for k in group.kept]
        lengths = chain_lengths(
            sessions, self.width, self.truncation, share_prompts=self.share_prompts
        )
        # Every chain fits a row of its own, so k chains never need more than k rows: below
        # that count the placement cannot refuse, and is not run (it costs a Python loop
        # over the batch's chains for every group that completes).
        alone = lengths.size if lengths.size <= self.rows else rows_needed(lengths, self.width)
        if alone > self.rows:
            raise ValueError(
                f"rows={self.rows}: the {len(sessions)} sessions of task {group.task} (group "
                f"{group.group}) split into {lengths.size} chains that need {alone} rows of "
                f"width {self.width} on their own; size rows for the chains a group can make"
            )
        before = [g.lengths for g in batch.admitted]
        union = np.concatenate([*before, lengths]) if before else lengths
        if union.size <= self.rows or rows_needed(union, self.width) <= self.rows:
            group.state = "admitted"
            group.lengths = lengths
            batch.admitted.append(group)
        else:
            group.state = "cut"
            batch.counts["cut_groups"] += 1
            self._drop_kept(group, "discarded", "cut")
        self._cancel_live(group, "surplus")
        if self.admit is not None and len(batch.admitted) >= self.admit:
            self._close_open(batch, "admit")

    def _close_open(self, batch: _Batch, cause: str) -> None:
        for group in batch.groups:
            if group.state == "open":
                group.state = "closed"
                self._drop_kept(group, "discarded", cause)
                self._cancel_live(group, cause)

    def _hand(self, batch: _Batch, handover: Handover) -> None:
        batch.version, batch.served = handover.version, handover.served
        batch.pushed = handover.pushed

    def _recheck(self, batch: _Batch) -> None:
        """Evict kept sessions that turned stale; their groups reopen."""
        for group in batch.groups:
            if group.state not in ("open", "admitted"):
                continue
            stale = [k for k in group.kept if self._stale(k.session, k.submitted_version, batch)]
            if not stale:
                continue
            if group.state == "admitted":
                group.state, group.lengths = "open", None
                batch.admitted.remove(group)
            group.kept = [k for k in group.kept if k not in stale]
            for kept in stale:
                kept.ticket.kept = False
                if group.state == "open":
                    self._retry(group, kept.session.sample, kept.ticket, "stale")
                else:  # an earlier retry abandoned the group
                    self._final(kept.ticket, "abandoned", "stale")

    # ------------------------------------------------------------------ packing

    def _pack(self, batch: _Batch) -> tuple[dict[str, np.ndarray], SchedulerRecord]:
        self._close_open(batch, "admit")
        sessions, latencies = [], []
        for group in batch.admitted:
            for kept in group.kept:
                sessions.append(kept.session)
                latencies.append(kept.latency)
            self._drop_kept(group, "admitted", "")
        undecided = [t.key for t in batch.tickets if t.outcome is None]
        if undecided:  # an internal invariant: every ticket is decided by now
            raise RuntimeError(f"batch {batch.index}: tickets {undecided[:3]} still undecided")
        columns = pack(
            sessions,
            self.width,
            rows=self.rows,
            estimator=self.estimator,
            truncation=self.truncation,
            support_capacity=self.support_capacity,
            share_prompts=self.share_prompts,
        )
        metrics = session_metrics(
            sessions,
            columns,
            latencies=latencies,
            version=batch.version,
            truncation=self.truncation,
        )
        versions = [c.version for s in sessions for c in s.calls]
        oldest = min(versions) if versions else None
        lag = None if oldest is None or batch.version is None else batch.version - oldest
        counts = batch.counts
        record = SchedulerRecord(
            batch=batch.index,
            version=batch.version,
            served=batch.served,
            pushed=batch.pushed,
            oldest_version=oldest,
            lag=lag,
            admitted_groups=len(batch.admitted),
            admitted_sessions=len(sessions),
            submitted=len(batch.tickets),
            resubmitted=dict(batch.resubmitted),
            discarded=counts["discarded"],
            cancelled=counts["cancelled"],
            abandoned=counts["abandoned"],
            cancellations=counts["cancellations"],
            abandoned_groups=counts["abandoned_groups"],
            cut_groups=counts["cut_groups"],
            metrics=metrics,
            replayed=counts["replayed"],
        )
        self._release.append(batch.index)
        for group in batch.groups:
            del self._groups[group.group]
        if not self.audit:
            for ticket in batch.tickets:
                del self.ledger[ticket.key]
        return columns, record
