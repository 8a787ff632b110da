"""Asynchronous GRPO as a pipeline file: RolloutScheduler's stages, declared and run here.

    dew-pipe run pipelines/grpo_async.py [--set steps=60 --set max_lag=2 --set ahead=2 ...]

    tasks ─► rollout ─► reward ─► pack ─► rescore ─► update (runs the Trainer's step)
               ▲ ▲                 │ ▲      ▲           │
               │ └──── orders ─────┘ └──────┴─ handovers, weights (feedback) ─┘

The same builder, :func:`dew_pipe.stages.build_graph`, makes ``RolloutScheduler``'s graph;
here :func:`dew_pipe.stages.grpo_pipeline` calls it with a ``Train`` update stage, which
owns the TrainState and runs ``Trainer.train_step`` itself instead of handing batches to
``Trainer.fit``.

The toy task needs nothing downloaded: prompts are random ids, and the reward is the share
of sampled ids equal to the task's target id (its ``ground_truth``). ``ToySource`` samples
each completion from the weights ``ToyWeights`` serves, on its own threads, so sampling
overlaps the update; it leaves sessions unscored and the reward stage scores them. A
completion that ends on EOS is COMPLETED, one that uses its whole budget TRUNCATED (and
scored, ``truncation="score"``). Reward climbs from about ``1 / vocab`` in a few dozen
updates. Larger jobs swap in a real server and source and keep the rest of the graph
(``pipelines/arithmetic.py`` builds it with :func:`~dew_pipe.stages.build_graph`).
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dew_pipe import Dataset, Trainer, models
from dew_pipe.data.text_columns import encode_text_column
from dew_pipe.flow import Pipeline, RunContext
from dew_pipe.objectives.rl import GRPOObjective, prompt_tasks
from dew_pipe.objectives.rl.sessions import Call, Session, Task
from dew_pipe.stages import TaskBatches, grpo_pipeline
from dew_pipe.stages.messages import SchedulerRecord

EOS = 1  # the toy vocabulary's end-of-sequence id; 0 pads


class ToyWeights:
    """A weights publisher: ``load`` keeps a host copy of the trainer's weights.

    Attributes:
      version: the served version.
    """

    def __init__(self, params: Any = None, version: int = 0) -> None:
        self._lock = threading.Lock()
        self._params = None if params is None else jax.device_get(params)
        self.version = version

    def load(self, params: Any, version: int) -> None:
        copy = jax.device_get(params)  # a copy: the trainer donates its buffers
        with self._lock:
            self._params, self.version = copy, version

    def snapshot(self) -> tuple[Any, int]:
        """The weights and version served now."""
        with self._lock:
            return self._params, self.version


class ToySource:
    """A SessionSource sampling one completion per session from ``weights``' decoder.

    Args:
      model: the decoder.
      weights: the publisher sampled from.
      prompt_len: P, ids of every prompt.
      max_new_tokens: R, the completion budget.
      workers: sampling threads.
      seed: seeds the per-session keys.
    """

    def __init__(
        self,
        model: Any,
        weights: ToyWeights,
        *,
        prompt_len: int,
        max_new_tokens: int,
        workers: int = 2,
        seed: int = 0,
    ) -> None:
        self.weights = weights
        self.budget = max_new_tokens
        self._pool = cf.ThreadPoolExecutor(workers, thread_name_prefix="toy-source")
        self._stops: dict[int, threading.Event] = {}
        self._lock = threading.Lock()
        self._key = jax.random.key(seed)
        self._count = itertools.count()
        self._draw = jax.jit(_sampler(model, prompt_len, max_new_tokens))

    def submit(self, task: Task, *, group: int, sample: int, attempt: int) -> cf.Future:
        params, version = self.weights.snapshot()  # the version it is submitted under
        key = jax.random.fold_in(self._key, next(self._count))
        stop = threading.Event()
        future = self._pool.submit(
            self._run, task, group, sample, attempt, params, version, key, stop
        )
        with self._lock:
            self._stops[id(future)] = stop
        future.add_done_callback(self._forget)
        return future

    def _forget(self, future: cf.Future) -> None:
        with self._lock:
            self._stops.pop(id(future), None)

    def _run(self, task, group, sample, attempt, params, version, key, stop) -> Session:
        identity = (task.id, group, sample, attempt)
        if stop.is_set():
            return Session(*identity, (), "CANCELLED", detail="cancelled before sampling")
        prompt = np.asarray(task.data["prompt"], np.int32)
        ids, log_probs = (np.asarray(a) for a in self._draw(params, jnp.asarray(prompt), key))
        end = np.flatnonzero(ids == EOS)
        n = int(end[0]) + 1 if end.size else self.budget
        finish = "stop" if end.size else "length"
        call = Call(prompt, ids[:n], log_probs[:n], finish, version, log_probs=log_probs[:n])
        status = "COMPLETED" if end.size else "TRUNCATED"
        return Session(*identity, [call], status)  # unscored: the reward stage scores it

    def cancel(self, future: cf.Future) -> None:
        with self._lock:
            stop = self._stops.get(id(future))
        if stop is not None:
            stop.set()

    def close(self) -> None:
        with self._lock:
            for stop in self._stops.values():
                stop.set()
        self._pool.shutdown(wait=True)


def _sampler(model: Any, prompt_len: int, budget: int) -> Callable:
    """``draw(params, prompt [P], key) -> (ids [R], log_probs [R])`` at temperature 1.

    Reruns the whole (tiny) decoder for each new id: a toy, not a serving engine.
    """

    def draw(params, prompt, key):
        tokens = jnp.zeros((1, prompt_len + budget), jnp.int32).at[0, :prompt_len].set(prompt)

        def step(t, carry):
            tokens, log_probs, key = carry
            key, sub = jax.random.split(key)
            logits = model.apply(params, tokens)[0, prompt_len + t - 1]
            token = jax.random.categorical(sub, logits)
            log_probs = log_probs.at[t].set(jax.nn.log_softmax(logits)[token])
            return tokens.at[0, prompt_len + t].set(token), log_probs, key

        init = (tokens, jnp.zeros(budget, jnp.float32), key)
        tokens, log_probs, _ = jax.lax.fori_loop(0, budget, step, init)
        return tokens[0, prompt_len:], log_probs

    return draw


def target_share(task: Task, session: Session) -> float:
    """The reward: share of the sampled ids (EOS aside) equal to the task's target id."""
    target = int(task.data["ground_truth"])
    sampled = np.concatenate([c.sampled_ids for c in session.calls])
    sampled = sampled[sampled != EOS]
    return float(np.mean(sampled == target)) if sampled.size else 0.0


def toy_prompts(batch: int, prompt_len: int, vocab: int, target: int, seed: int) -> Dataset:
    """Endless prompt batches (the ``Prompts`` layout) of random ids, all with ``target``."""

    def train(partition):
        rng = np.random.default_rng(seed)
        for start in itertools.count(0, batch):
            yield {
                "task_id": np.arange(start, start + batch, dtype=np.int32),
                "prompt": rng.integers(2, vocab, (batch, prompt_len)).astype(np.int32),
                "prompt_length": np.full(batch, prompt_len, np.int32),
                "ground_truth": encode_text_column([str(target)] * batch, field="ground_truth"),
            }

    return Dataset(train=train, val=None, records=None, batch=batch)


class GRPOJob:
    """What ``dew-pipe run`` runs: the pipeline, with per-update values logged.

    The initial TrainState is built (and served as version 0) when the run starts, by
    :meth:`initial_state`, which the update stage calls, so ``--dry-run`` compiles nothing.
    """

    def __init__(self, trainer: Trainer, weights: ToyWeights, steps: int) -> None:
        self.trainer = trainer
        self.weights = weights
        self.steps = steps
        self.pipeline: Pipeline | None = None  # set by pipeline() below
        self.rewards: list[float] = []
        self._context: RunContext | None = None

    def initial_state(self) -> Any:
        """The trainer's initial state, loaded into ``weights`` (which start empty) as
        version 0 before rollout's first submission (rollout waits for the first handover)."""
        state = self.trainer.initial_state()
        self.weights.load(state.params, 0)
        return state

    def log(self, step: int, metrics: dict[str, float], record: SchedulerRecord | None) -> None:
        reward = record.metrics.get("reward/mean", float("nan")) if record else float("nan")
        self.rewards.append(reward)
        if self._context is not None:
            values = {"loss": metrics["loss"], "reward": reward}
            if record is not None:
                values.update(lag=record.lag, waited_s=round(record.waited_s, 4))
            self._context.log(step=step + 1, **values)
            self._context.progress("updates", step + 1, self.steps)

    def run(self, context: RunContext) -> Any:
        self._context = context
        snapshot = context.run_pipeline(self.pipeline)
        k = max(1, len(self.rewards) // 5)
        first, last = np.mean(self.rewards[:k]), np.mean(self.rewards[-k:])
        context.print(
            f"grpo_async: mean reward {first:.3f} over the first {k} updates, {last:.3f} over "
            f"the last {k} ({len(self.rewards)} updates)"
        )
        return snapshot

    def __repr__(self) -> str:
        return self.pipeline.describe()


def pipeline(
    steps: int = 40,
    tasks_per_batch: int = 4,
    groups: int = 4,
    prompt_len: int = 4,
    max_new_tokens: int = 6,
    vocab: int = 16,
    target: int = 7,
    max_lag: int = 1,
    ahead: int = 1,
    sync_every: int = 1,
    lr: float = 0.01,
    workers: int = 2,
    seed: int = 0,
) -> GRPOJob:
    """Asynchronous GRPO on the toy task (settings as in the module docstring).

    ``steps`` updates of ``tasks_per_batch`` tasks times ``groups`` completions; rollouts
    run ``ahead`` batches ahead, weights are pushed every ``sync_every`` updates, and no
    admitted completion lags more than ``max_lag`` updates.
    """
    if not 2 <= target < vocab:
        raise ValueError(f"target={target}; expected an id in [2, {vocab}) (0 pads, 1 is EOS)")
    width = prompt_len + max_new_tokens  # one completion fills one row
    model = models.build(
        "causal_transformer", vocab_size=vocab, emb_features=32, num_layers=1, num_heads=2,
        mlp_features=64, max_seq_len=width,
    )  # fmt: skip
    objective = GRPOObjective(model, seq_len=width - 1, behavior_importance=(0.5, 2.0))
    trainer = Trainer(objective, optax.adam(lr), key=jax.random.key(seed), progress=False)
    weights = ToyWeights()  # serves the initial state once the job runs
    source = ToySource(
        model, weights, prompt_len=prompt_len, max_new_tokens=max_new_tokens, workers=workers,
        seed=seed + 1,
    )  # fmt: skip
    data = toy_prompts(tasks_per_batch, prompt_len, vocab, target, seed)
    job = GRPOJob(trainer, weights, steps)
    job.pipeline = grpo_pipeline(
        tasks=TaskBatches(data, prompt_tasks),
        source=source,
        weights=weights,
        trainer=trainer,
        score=target_share,
        width=width,
        rows=tasks_per_batch * groups,
        groups=groups,
        steps=steps,
        max_lag=max_lag,
        ahead=ahead,
        sync_every=sync_every,
        truncation="score",
        state=job.initial_state,
        log=job.log,
    )
    return job
