"""Fake sources, weights and objectives for the rollout scheduler and stage tests.

Imported by tests/test_rollout_scheduler.py and tests/test_rollout_stages.py; it must not
import pytest. Sessions are made up (random ids and likelihoods), their timing and outcome
scripted per submission, so tests can steer every admission rule.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import itertools
import threading
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np

from dew_pipe.data.dataset import Dataset, Partition
from dew_pipe.objectives.rl.policy import PolicyOptions
from dew_pipe.objectives.rl.sessions import Call, Session
from dew_pipe.training.data_stream import BatchStream

VOCAB = 13


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What one submission does: sleep ``delay`` s, then end as ``status``.

    ``calls`` calls of ``sampled`` ids each; ``stale`` makes every call report a version
    that many updates older than the one served at submission; ``reward`` None leaves the
    session unscored; ``raises`` makes the future raise it instead; ``support`` records a
    top-2 sampling support per sampled id; ``prompt`` is the first call's prompt length (the
    same ids for every sample of a task).
    """

    delay: float = 0.0
    status: str = "COMPLETED"
    reward: float | None = 1.0
    sampled: int = 2
    calls: int = 1
    stale: int = 0
    raises: BaseException | None = None
    support: bool = False
    prompt: int = 1


@dataclasses.dataclass(frozen=True)
class Submission:
    task: int
    group: int
    sample: int
    attempt: int
    version: int


class FakeWeights:
    """A publisher: ``load`` moves ``version`` (unless ``stuck``), counting the pushes."""

    def __init__(self, version: int = 0, stuck: bool = False) -> None:
        self.version = version
        self.stuck = stuck
        self.pushes: list[int] = []

    def load(self, params: Any, version: int) -> None:
        self.pushes.append(version)
        if not self.stuck:
            self.version = version


class FakeSource:
    """Runs each submission on a thread; ``script(submission) -> Outcome`` decides it."""

    def __init__(
        self,
        weights: FakeWeights,
        script: Callable[[Submission], Outcome] = lambda s: Outcome(),
        *,
        seed: int = 0,
        workers: int = 16,
    ) -> None:
        self.weights = weights
        self.script = script
        self.pool = cf.ThreadPoolExecutor(workers, thread_name_prefix="fake-source")
        self.lock = threading.Lock()
        self.rng = np.random.default_rng(seed)
        self.submitted: list[Submission] = []
        self.cancel_requests = 0
        self._stops: dict[int, threading.Event] = {}

    def submit(self, task, *, group, sample, attempt) -> cf.Future:
        record = Submission(task.id, group, sample, attempt, self.weights.version)
        outcome = self.script(record)
        stop = threading.Event()
        with self.lock:
            self.submitted.append(record)
            seed = int(self.rng.integers(2**31))
        future = self.pool.submit(self._run, task, record, outcome, stop, seed)
        self._stops[id(future)] = stop
        return future

    def _run(self, task, record: Submission, outcome: Outcome, stop, seed: int) -> Session:
        if outcome.raises is not None:
            raise outcome.raises
        if stop.wait(outcome.delay):
            return Session(task.id, record.group, record.sample, record.attempt, (), "CANCELLED")
        rng = np.random.default_rng(seed)
        calls = []
        context = [1 + (task.id + k) % (VOCAB - 1) for k in range(outcome.prompt)]
        for _ in range(outcome.calls):
            sampled = rng.integers(1, VOCAB, outcome.sampled)
            version = max(0, record.version - outcome.stale)
            kept = [[t, t % (VOCAB - 1) + 1] for t in sampled] if outcome.support else None
            behavior = -rng.uniform(0.1, 2.0, sampled.size)
            calls.append(Call(context, sampled, behavior, "stop", version, support=kept))
            context = [*context, *sampled.tolist(), 1]
        reward = outcome.reward
        return Session(
            task.id, record.group, record.sample, record.attempt, calls, outcome.status, reward
        )

    def cancel(self, future: cf.Future) -> None:
        with self.lock:
            self.cancel_requests += 1
        stop = self._stops.get(id(future))
        if stop is not None:
            stop.set()

    def close(self) -> None:
        for stop in self._stops.values():
            stop.set()
        self.pool.shutdown(wait=True)


class FakeObjective:
    """Just enough of GRPOObjective for the scheduler: a cheap ``packed_log_probs``.

    The "log-probability" of id ``t`` is ``-0.1 * t`` scaled by ``params["scale"]``, so a
    test can tell which parameters rescored a batch.
    """

    def __init__(
        self, width: int, behavior_importance: Any = 2.0, proximal_in_step: bool = False
    ) -> None:
        self.seq_len = width - 1
        self.options = PolicyOptions(behavior_importance=behavior_importance)
        self.proximal_in_step = proximal_in_step

    def packed_log_probs(self, params, batch):
        ids = jnp.asarray(batch["input_ids"], jnp.float32)
        return -0.1 * ids * params["scale"]


@dataclasses.dataclass
class FakeState:
    updates: int
    params: dict


def task_data(tasks: int, batch: int) -> Dataset:
    """``task_id`` batches of ``batch`` rows counting up from 0, ``tasks`` per epoch."""

    def train(partition: Partition):
        for start in range(0, tasks, batch):
            yield {"task_id": np.arange(start, start + batch, dtype=np.int32)}

    return Dataset(train=train, val=None, records=tasks, batch=batch)


def drive(scheduler, data: Dataset, steps: int, *, start: int = 0, stream=None):
    """Run ``steps`` batches through ``scheduler`` the way the Trainer's loop does.

    Returns the packed batches, the versions they were handed over at, and the stream.
    """
    stream = stream or BatchStream(scheduler.tasks(data), Partition(0, 1), None)
    batches, versions = [], []
    for step in itertools.count(start):
        if step >= start + steps:
            break
        stream.fill(1 + scheduler.read_ahead)
        batch = stream.next()
        state = FakeState(step, {"scale": jnp.float32(1.0 + step)})
        batches.append(scheduler(state, batch, None))
        versions.append(step)
    return batches, versions, stream
