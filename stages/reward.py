"""Reward: scores the sessions a source left unscored, on a pool of worker threads.

Where the reward is computed is the source's choice. ``PromptSource`` and
``EnvironmentSource`` score each session themselves as soon as it finishes (on their own
thread pool, while the environment or sandbox is still open), so verification overlaps
generation and nothing needs rescoring here; their sessions pass through this stage
untouched. A source that only records what the model did (a gateway replaying traces, say)
leaves ``reward`` None, and this stage scores those sessions with ``score`` on ``workers``
threads: verification that runs programs or waits on a service releases the GIL, so the
threads overlap it with the rest of the pipeline.

A session is scored when it has no reward and its status can train (COMPLETED,
AGENT_ERROR, TRUNCATED). A ``score`` that raises or returns a non-finite value makes the
session INFRA_ERROR (the verifier failed, not the policy), which the scheduler retries.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import threading
from collections.abc import Callable, Mapping
from typing import Any

import pyarrow as pa

from dew_pipe.flow import Map
from dew_pipe.objectives.rl.sessions import Session, Status, Task
from dew_pipe.stages.messages import SESSION_ROWS, stamp_sessions, unstamp_sessions

__all__ = ["Reward", "Score"]

#: ``score(task, session) -> reward`` or ``(reward, components)``.
Score = Callable[[Task, Session], float | tuple[float, Mapping[str, float]]]

_SCORED = (Status.COMPLETED, Status.AGENT_ERROR, Status.TRUNCATED)


class Reward(Map):
    """Scores unscored sessions with ``score``; passes everything else through.

    Ports: ``in`` and ``out``, stamped sessions (:data:`~dew_pipe.stages.messages.SESSION_ROWS`).

    Args:
      score: ``score(task, session)`` returning a finite reward, or ``(reward, components)``;
        ``task`` is the :class:`~dew_pipe.objectives.rl.sessions.Task` the session ran
        (its prompt and metadata). None passes every batch through unchanged (the source
        scores its own sessions).
      workers: threads scoring batches at once (only with ``score``).
      name: the stage's name.

    Example:
      >>> from dew_pipe.objectives.rl.sessions import Call
      >>> from dew_pipe.stages.messages import Stamps
      >>> s = Session(1, 0, 0, 0, [Call([1], [7], [-0.1], "stop", 0)], "COMPLETED")
      >>> rb = stamp_sessions([s], [Stamps(0, 0, 0.1, task=Task(1, {"ground_truth": "7"}))])
      >>> hit = lambda task, s: float(str(s.calls[-1].sampled_ids[-1]) == task.data["ground_truth"])
      >>> unstamp_sessions(Reward(hit).apply(rb))[0][0].reward
      1.0
    """

    def __init__(self, score: Score | None = None, *, workers: int = 4, name: str = "reward"):
        if score is not None and not callable(score):
            raise TypeError(f"score={score!r}; expected None or score(task, session)")
        super().__init__(
            name,
            input_type=SESSION_ROWS,
            workers=workers if score is not None else 1,
            ordered=False,
        )
        self.score = score
        self.scored = 0  # sessions scored; failed: of those, the ones whose score raised
        self.failed = 0
        self._lock = threading.Lock()  # the counters are bumped from the worker threads

    def apply(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        if self.score is None:
            return batch
        sessions, stamps = unstamp_sessions(batch)
        todo = [i for i, s in enumerate(sessions) if s.reward is None and s.status in _SCORED]
        if not todo:
            return batch
        for i in todo:
            sessions[i] = self._scored(sessions[i], stamps[i].task)
        return stamp_sessions(sessions, stamps)

    def _scored(self, session: Session, task: Task | None) -> Session:
        with self._lock:
            self.scored += 1
        try:
            value = self.score(task if task is not None else Task(session.task), session)
            reward, components = _split(value)
        except Exception as error:  # the verifier failed: an infrastructure failure
            with self._lock:
                self.failed += 1
            detail = f"reward failed: {type(error).__name__}: {error}"
            return dataclasses.replace(session, status=Status.INFRA_ERROR, detail=detail)
        return dataclasses.replace(session, reward=reward, components=components)


def _split(value: Any) -> tuple[float, dict[str, float]]:
    components: Mapping[str, float] = {}
    if isinstance(value, tuple):
        if len(value) != 2 or not isinstance(value[1], Mapping):
            raise TypeError(f"score returned {value!r}; expected a float or (float, components)")
        value, components = value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"score returned {value!r}; expected a finite float")
    if not math.isfinite(value):
        raise ValueError(f"score returned {value}; expected a finite float")
    return float(value), {str(k): float(v) for k, v in components.items()}
