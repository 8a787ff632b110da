"""The flow runtime: typed stages joined by bounded queues, one thread per stage.

Build a ``Pipeline`` of ``Stage`` objects (or the derived ``Source``, ``Map``, ``Sink``),
``connect`` output ports to input ports with a capacity per edge, then ``run()`` it (or
``start()`` it and ``wait()``/``cancel()`` the returned ``Run``). The runtime is generic: it
moves Arrow record batches or Python objects and knows nothing of what they mean.

End of stream
  A stage's outputs end when its thread finishes. An input port ends when every edge into
  it has ended and been drained; ``ctx.get`` then raises ``EndOfStream`` and ``ctx.read``
  stops. A consumer that finishes early releases its producers: their later puts return at
  once and count as ``dropped`` on the edge, and sources and maps stop when nobody reads on.

Cycles and feedback edges
  A cycle must contain an edge declared ``feedback=True`` (say pack -> rollout for
  resubmission). Plain end-of-stream cannot end a cycle (each stage would wait for the
  other), so the runtime ends it by draining: once every stage of the cycle has finished
  or waits idle in an untimed ``get`` with no tracked futures outstanding, every edge into
  the cycle is empty, and every such edge from outside the cycle has ended, nothing can
  ever produce more, and the cycle's feedback edges end. Their consumers see end of
  stream, finish, and end of stream flows on as usual. A stage in a cycle therefore must
  not hold work back until its inputs end: an idle wait promises it will emit nothing
  until new input arrives. A stage that polls (waits with a timeout) keeps its cycle
  open and must itself return when its work is done.

  Bounded queues in a cycle can deadlock: when every stage of a loop waits for room on the
  next one's full edge, none can move. The supervisor detects such a loop and fails the run
  with ``Deadlock`` naming the edges. Avoid it by giving the feedback edge room for every
  item the cycle can hold (the edges' capacities plus one per stage), or by having the
  stage that admits work into the cycle bound what it has in flight.

Failures and cancellation
  The first exception in any stage (or a stage past its ``timeout``) cancels the run and
  ``wait()``/``run()`` raise ``StageFailed`` naming the stage and, where known, the item,
  with the original as ``__cause__``. Cancellation is cooperative: blocked gets and puts
  wake at once and raise ``Cancelled``; long stage code checks ``ctx.cancelled`` or waits
  with ``ctx.wait``. Every thread is joined on every exit path; one stuck in a blocking
  call that ignores cancellation is reported after ``join_timeout`` and left as a daemon.
"""

from dew_pipe.flow.display import Display
from dew_pipe.flow.errors import (
    BuildError,
    Cancelled,
    Deadlock,
    EndOfStream,
    FlowError,
    RunTimeout,
    StageFailed,
    StageTimeout,
)
from dew_pipe.flow.forms import Inlet, Map, Outlet, Sink, Source
from dew_pipe.flow.job import RunContext
from dew_pipe.flow.metrics import EdgeStats, FlowSnapshot, MetricsWriter, StageStats
from dew_pipe.flow.pipeline import EdgeSpec, Pipeline
from dew_pipe.flow.ports import Port
from dew_pipe.flow.runtime import Run
from dew_pipe.flow.stage import Stage, StageContext

__all__ = [
    "BuildError",
    "Cancelled",
    "Deadlock",
    "Display",
    "EdgeSpec",
    "EdgeStats",
    "EndOfStream",
    "FlowError",
    "FlowSnapshot",
    "Inlet",
    "Map",
    "MetricsWriter",
    "Outlet",
    "Pipeline",
    "Port",
    "Run",
    "RunContext",
    "RunTimeout",
    "Sink",
    "Source",
    "Stage",
    "StageContext",
    "StageFailed",
    "StageStats",
    "StageTimeout",
]
