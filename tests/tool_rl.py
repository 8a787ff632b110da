"""PPO and GRPO on the calculator tool task in the library view, for the learning check.

Imported by ``tests/test_ppo_learning.py`` and ``benchmarks/ppo_vs_grpo.py`` (which puts
``tests/`` on the path); it must not import pytest. Everything runs in one process: the
task's tool in-process (:meth:`~dew_pipe.tasks.tool_calc.ToolCalcTask.local_environment`,
the worker's own code), episodes collected by ``EpisodeRollout`` through ``TextGeneration``,
and the Trainer.

* :func:`sft` is the task's warm-up (``train_sft``): both kinds of turn, answered at once
  under greedy decoding.
* :func:`held_out` is the task's held-out success: one greedy episode per test problem,
  scored by the task's verifier (what ``ToolCalcTask.success`` measures through a server).
* :func:`train` runs ``updates`` updates of PPO (``PPOObjective`` + ``PPORollout``) or GRPO
  (``GRPOObjective`` + ``EpisodeRollout``) from the SFT policy on the same cohorts (the same
  problems, ``groups`` episodes each), probing held-out success every ``every`` updates.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax

from dew_pipe import Dataset, Trainer
from dew_pipe.inference import TextGeneration
from dew_pipe.objectives.rl import (
    EpisodeRollout,
    GRPOObjective,
    PPOObjective,
    PPORollout,
    ValueHead,
)
from dew_pipe.sampling import Sampling
from dew_pipe.tasks.recipe import SFTRecipe, train_sft
from dew_pipe.tasks.tool_calc import ToolCalcTask


@dataclasses.dataclass(frozen=True)
class Setting:
    """One learning run: the task, the warm-up and the RL budget.

    Attributes:
      digits, min_digits: operand sizes of the products.
      tool_share: share of the warm-up's transcripts that call the tool.
      sft_steps: SFT updates of the warm-up (the task's default recipe otherwise).
      updates: RL updates; prompts: problems per update; groups: episodes per problem.
      learning_rate: Adam's learning rate of the RL phase.
      every: RL updates between held-out probes.
      test_size: held-out problems (one greedy episode each).
      seed: seeds the task, the warm-up, the sampling.
    """

    digits: int = 2
    min_digits: int = 2
    tool_share: float = 0.4
    sft_steps: int = 250
    updates: int = 30
    prompts: int = 8
    groups: int = 4
    learning_rate: float = 3e-3
    every: int = 10
    test_size: int = 64
    seed: int = 0

    def task(self) -> ToolCalcTask:
        return ToolCalcTask(
            self.seed, self.digits, min_digits=self.min_digits, tool_share=self.tool_share,
            test_size=self.test_size,
        )  # fmt: skip


def sft(setting: Setting) -> tuple[ToolCalcTask, Any, Any]:
    """``(task, model, params)`` after the warm-up."""
    task = setting.task()
    recipe = SFTRecipe(steps=setting.sft_steps, warmup=max(1, setting.sft_steps // 10))
    model, state = train_sft(task, recipe, key=jax.random.key(setting.seed), progress=False)
    return task, model, jax.device_get(state.params)


def episodes(task: ToolCalcTask, policy: Any, problems: list, groups: int, sampling: Sampling):
    """An EpisodeRollout over ``problems`` (a batch's ``task_id`` indexes them)."""

    def environment(episode_id: Any) -> Any:
        return task.local_environment(problems[episode_id.task])

    def verifier(episode: Any) -> float:
        return task.verify(problems[episode.id.task], episode)

    return EpisodeRollout(
        policy, environment, verifier, max_prompt_tokens=task.max_prompt_tokens,
        max_new_tokens=task.max_new_tokens, max_turns=task.max_turns, groups=groups,
        sampling=sampling,
    )  # fmt: skip


class HeldOut:
    """Held-out success of greedy episodes, one per test problem."""

    def __init__(self, task: ToolCalcTask, model: Any, params: Any) -> None:
        self.problems = task.tasks("test")
        greedy = Sampling(eos_id=task.eos_id, temperature=0.0)
        self.policy = TextGeneration(model, params)
        self.rollout = episodes(task, self.policy, self.problems, 1, greedy)
        self.ids = {"task_id": np.arange(len(self.problems), dtype=np.int32)}

    def __call__(self, policy_variables: Any) -> float:
        state = _State(policy_variables)
        found = self.rollout.collect(state, self.ids, jax.random.key(0))
        return float(np.mean([e.reward or 0.0 for e in found]))


@dataclasses.dataclass
class _State:
    params: Any
    step: int = 0
    updates: int = 0


def train(
    algorithm: str,
    setting: Setting,
    task: ToolCalcTask,
    model: Any,
    params: Any,
    *,
    probe: Callable[[int, float], None] | None = None,
) -> dict[str, Any]:
    """``updates`` RL updates of ``algorithm`` ("ppo" or "grpo") from the SFT ``params``.

    Returns:
      ``{"curve": [(updates, held-out success), ...], "seconds": wall seconds of each
      interval of ``every`` updates (probes excluded; the first includes the compiles),
      "rollout": the rollout's metrics of each update}``; the curve starts at 0 updates.
    """
    problems = task.tasks("train", setting.prompts * setting.updates)
    width = task.max_prompt_tokens + task.max_new_tokens
    sampling = Sampling(eos_id=task.eos_id, temperature=1.0)
    if algorithm == "ppo":
        critic = ValueHead(SFTRecipe().model(task))
        objective: Any = PPOObjective(model, width - 1, critic=critic, pretrained=params)
        policy = objective.policy(objective.init(jax.random.key(1)))
        collect = episodes(task, policy, problems, setting.groups, sampling)
        rollout: Any = PPORollout(objective, collect, gamma=1.0, lam=0.95)
    elif algorithm == "grpo":
        objective = GRPOObjective(model, width - 1, pretrained=params)
        rollout = collect = episodes(
            task, TextGeneration(model, params), problems, setting.groups, sampling
        )
    else:
        raise ValueError(f"algorithm is {algorithm!r}; expected 'ppo' or 'grpo'")
    held_out = HeldOut(task, model, params)
    rewards: list[dict[str, float]] = []
    trainer = Trainer(
        objective, optax.adam(setting.learning_rate), key=jax.random.key(setting.seed + 1),
        rollout=rollout, progress=False,
        log=lambda record: rewards.append(
            {k.removeprefix("rollout/"): v for k, v in record.items() if k.startswith("rollout/")}
        ),
    )  # fmt: skip

    def batches(partition: Any) -> Any:  # a fresh stream each time: fit skips what it ran
        n = setting.prompts
        return (
            {"task_id": np.arange(k * n, (k + 1) * n, dtype=np.int32)} for k in itertools.count()
        )

    data = Dataset(train=batches, val=None, records=None, batch=setting.prompts)
    curve = [(0, held_out(params))]
    if probe is not None:
        probe(*curve[-1])
    state, intervals = None, []
    for done in range(setting.every, setting.updates + 1, setting.every):
        start = time.monotonic()
        state = trainer.fit(data, steps=done, log_every=1, state=state)
        intervals.append(round(time.monotonic() - start, 2))
        policy_variables = objective.reference(state.params) if algorithm == "ppo" else state.params
        curve.append((int(state.updates), held_out(jax.device_get(policy_variables))))
        if probe is not None:
            probe(*curve[-1])
    return {"curve": curve, "seconds": intervals, "rollout": rewards}
