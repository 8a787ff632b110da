"""Bounded queues between stages, and the inbox that all edges into one stage share.

Every edge into a stage uses that stage's ``Inbox`` condition. One lock per consumer is what
lets a stage wait on several inputs at once (``get_any``) and lets the supervisor take a
consistent look at a whole cycle (every inbox of the cycle, locked in a fixed order) to
decide that it has drained. A producer blocked on a full edge waits on the consumer's
condition too; ``notify_all`` wakes both sides, which at a few waiters per inbox costs less
than a second condition would.

An edge is *closed* when its producer finishes (end of stream), or, for a feedback edge, when
its cycle has drained. It is *consumer_done* when its consumer finishes: later puts return at
once and count as ``dropped``, as do items still queued, so a producer never blocks on a
consumer that is gone and nothing vanishes without a count.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

from dew_pipe.flow.errors import Cancelled, FlowError


class Inbox:
    """The condition and wait state of one stage's inputs (all fields guarded by ``cond``).

    Attributes:
      idle: the stage is blocked in an untimed get with nothing tracked outstanding, and no
        input event has happened since it started waiting (cleared by every such event).
      outstanding: futures the stage tracks (``ctx.track``) that have not finished.
      woken: a tracked future finished since the stage last returned from a get.
      done: the stage's thread has finished.
    """

    __slots__ = ("cond", "idle", "outstanding", "woken", "done")

    def __init__(self) -> None:
        self.cond = threading.Condition(threading.Lock())
        self.idle = False
        self.outstanding = 0
        self.woken = False
        self.done = False


class Edge:
    """One bounded queue from a producer's output port to a consumer's input port.

    Counters (read without the lock by snapshots; each is consistent on its own):
    ``items`` put, ``max_depth`` reached, ``put_wait`` seconds producers waited for room,
    ``get_wait`` seconds the consumer waited before this edge delivered, ``dropped`` items
    put or left after the consumer finished.
    """

    __slots__ = (
        "name",
        "producer",
        "src_port",
        "consumer",
        "dst_port",
        "capacity",
        "feedback",
        "inbox",
        "buf",
        "closed",
        "consumer_done",
        "items",
        "max_depth",
        "put_wait",
        "get_wait",
        "dropped",
    )

    def __init__(
        self,
        producer: str,
        src_port: str,
        consumer: str,
        dst_port: str,
        capacity: int,
        feedback: bool,
        inbox: Inbox,
    ) -> None:
        self.name = f"{producer}.{src_port}->{consumer}.{dst_port}"
        self.producer, self.src_port = producer, src_port
        self.consumer, self.dst_port = consumer, dst_port
        self.capacity = capacity
        self.feedback = feedback
        self.inbox = inbox
        self.buf: deque[Any] = deque()
        self.closed = False
        self.consumer_done = False
        self.items = 0
        self.max_depth = 0
        self.put_wait = 0.0
        self.get_wait = 0.0
        self.dropped = 0

    def put(self, item: Any, cancelled: threading.Event) -> float:
        """Append ``item``, waiting while the edge is full; returns the seconds waited.

        Raises:
          Cancelled: the run was cancelled while waiting.
          FlowError: the edge was closed as a drained feedback edge (a stage emitted work
            into a cycle after it had promised, by waiting idle, that it would not).
        """
        inbox = self.inbox
        waited = 0.0
        with inbox.cond:
            if cancelled.is_set():
                raise Cancelled()
            if len(self.buf) >= self.capacity and not self.consumer_done:
                start = time.monotonic()
                while len(self.buf) >= self.capacity and not self.consumer_done:
                    if cancelled.is_set():
                        raise Cancelled()
                    inbox.cond.wait()
                waited = time.monotonic() - start
                self.put_wait += waited
            if self.consumer_done:
                self.dropped += 1
                return waited
            if self.closed:
                raise FlowError(
                    f"edge {self.name} was closed because its cycle had drained; a stage in "
                    "the cycle emitted new work after waiting idle (see dew_pipe.flow docs)"
                )
            self.buf.append(item)
            self.items += 1
            if len(self.buf) > self.max_depth:
                self.max_depth = len(self.buf)
            inbox.idle = False
            inbox.cond.notify_all()
        return waited

    def close(self) -> None:
        """Mark end of stream (the producer finished, or the cycle drained)."""
        with self.inbox.cond:
            self.closed = True
            self.inbox.idle = False
            self.inbox.cond.notify_all()

    def abandon(self) -> None:
        """The consumer finished: count what is queued as dropped and release producers."""
        with self.inbox.cond:
            self.consumer_done = True
            self.dropped += len(self.buf)
            self.buf.clear()
            self.inbox.cond.notify_all()

    @property
    def drained(self) -> bool:
        """Closed and empty: this edge will deliver nothing more (read under the lock)."""
        return self.closed and not self.buf
