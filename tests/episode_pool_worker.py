"""One process of the multi-process episode checks (tests/test_episode_pool.py).

    python tests/episode_pool_worker.py PROCESS_ID NUM_PROCESSES PORT OUT.npz CASE

The global batch is tasks 0-3, two samples each; process ``p`` of two holds tasks
``2p, 2p + 1``. A task's environment answers with a tool result until the task's number of
calls is reached (one call for tasks 0 and 1, three for tasks 2 and 3), so the two processes'
episodes take different numbers of turns. CASE:

* ``train``: one EpisodeRollout collection and one GRPO update; saves every episode's
  actions, the packed rows this process returned, the metrics and the updated parameters.
  With NUM_PROCESSES 1 (and two host devices) it is the one-process reference.
* ``tool-failure``: the tool of task 0, sample 0 raises on its first call (on process 0),
  while process 1's episodes still run.
* ``mismatch``: process 1 passes one task row instead of two, then max_turns=2 instead of 3.

Every case saves what each environment saw (opened, exited, the exception it exited under)
and each error raised, and exits 0.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax

process_id, processes, port, out, case = sys.argv[1:6]
process_id, processes = int(process_id), int(processes)
if processes > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"localhost:{port}", num_processes=processes, process_id=process_id)
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import optax  # noqa: E402
from test_tool_episodes import BUDGET, D0, PROMPT, Q0, RESULT, SAMPLING, USER, ToolPolicy  # noqa: E402

from dew_pipe import Trainer  # noqa: E402
from dew_pipe.inference import TextGeneration  # noqa: E402
from dew_pipe.objectives.rl import EpisodeRollout, GRPOObjective, Observation  # noqa: E402

CALLS = {0: 1, 1: 1, 2: 3, 3: 3}  # tool calls before a task's episode completes
opened: list[Environment] = []
batches: list[int] = []


class Environment:
    """Task t: each turn gets a tool result until CALLS[t] turns, then completes."""

    def __init__(self, episode_id) -> None:
        self.id, self.steps = episode_id, 0
        self.entered = self.exited = False
        self.exit_error: BaseException | None = None
        opened.append(self)

    def __enter__(self) -> Environment:
        self.entered = True
        return self

    def __exit__(self, kind, error, traceback) -> None:
        self.exited, self.exit_error = True, error

    def reset(self) -> Observation:
        return Observation([USER, Q0 + self.id.task % 4])

    def step(self, action) -> Observation:
        self.steps += 1
        faulty = case == "tool-failure" and (self.id.task, self.id.sample) == (0, 0)
        if faulty:
            raise RuntimeError("the square tool crashed")
        if self.steps < CALLS[self.id.task]:
            return Observation([USER, Q0 + self.id.task % 4, RESULT, D0 + self.steps])
        return Observation(status="completed", detail=str(self.steps))


def verify(episode) -> float:
    """A reward that differs within groups: the sampled ids' sum modulo 7, over 7."""
    return float(sum(int(a.tokens.sum()) for a in episode.actions) % 7) / 7.0


class Counting:
    """The policy, counting the batch calls (every process must make the same number)."""

    def __init__(self, policy) -> None:
        self.policy, self.model = policy, policy.model

    def bind(self, state) -> Counting:
        self.policy.bind(state)
        return self

    def batch(self, contexts, budget, key, sampling):
        batches.append(len(contexts))
        return self.policy.batch(contexts, budget, key, sampling)


model = ToolPolicy()
objective = GRPOObjective(model, seq_len=PROMPT + BUDGET - 1)
trainer = Trainer(objective, optax.sgd(0.5), key=jax.random.key(0))
state = trainer.initial_state()
policy = Counting(TextGeneration(model, state.params))


def rollout(max_turns: int = 3) -> EpisodeRollout:
    return EpisodeRollout(
        policy,
        Environment,
        verify,
        max_prompt_tokens=PROMPT,
        max_new_tokens=BUDGET,
        max_turns=max_turns,
        groups=2,
        sampling=SAMPLING,
    )


def host(array) -> np.ndarray:
    return np.asarray(array.addressable_data(0))


every = np.arange(4, dtype=np.int32)
rows = 4 // processes
mine = {"task_id": every[process_id * rows : (process_id + 1) * rows]}
key = jax.random.key(7)
saved: dict[str, np.ndarray] = {}
errors: list[dict] = []


def failed(error: BaseException) -> None:
    errors.append({"type": type(error).__name__, "message": str(error)})


if case == "train":
    hook = rollout()
    batch = hook(state, mine, key)
    new_state, metrics = trainer.train_step(state, batch)
    for i, episode in enumerate(hook.last_episodes):
        saved[f"turns/{i}"] = np.int32(len(episode.actions))
        saved[f"reward/{i}"] = np.float64(episode.reward)
        saved[f"id/{i}"] = np.array(
            [episode.id.task, episode.id.step, episode.id.sample, episode.id.seed], np.int64
        )
        for j, action in enumerate(episode.actions):
            for name in ("context", "tokens", "log_probs", "behavior_log_probs"):
                saved[f"action/{i}/{j}/{name}"] = getattr(action, name)
    saved.update({f"batch/{name}": value for name, value in batch.items()})
    saved.update({f"metric/{name}": np.float64(v) for name, v in hook.metrics().items()})
    saved["loss"] = host(metrics["loss"])
    for path, leaf in jax.tree_util.tree_flatten_with_path(new_state.params)[0]:
        saved["param/" + jax.tree_util.keystr(path)] = host(leaf)
elif case == "tool-failure":
    try:
        rollout()(state, mine, key)
    except Exception as error:
        failed(error)
elif case == "mismatch":
    try:
        rollout()(state, {"task_id": mine["task_id"][: 1 + (process_id == 0)]}, key)
    except Exception as error:
        failed(error)
    try:
        rollout(max_turns=3 - process_id)(state, mine, key)
    except Exception as error:
        failed(error)
else:
    raise SystemExit(f"unknown case {case!r}")

environments = [
    {
        "task": env.id.task,
        "sample": env.id.sample,
        "entered": env.entered,
        "exited": env.exited,
        "exit_error": None if env.exit_error is None else str(env.exit_error),
    }
    for env in opened
]
report = {"errors": errors, "environments": environments, "batches": batches}
np.savez(out, report=np.frombuffer(json.dumps(report).encode(), np.uint8), **saved)
