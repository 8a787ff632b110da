"""A training process for tests/test_episode_recovery.py: Trainer + EpisodeRollout +
SubprocessEnvironment (the square worker of episode_helpers) + EpisodeJournal + checkpoints.

    python episode_recovery_worker.py RUN_DIR STEPS KILL

on two simulated CPU devices (the test sets XLA_FLAGS). It trains ``ToolPolicy`` with GRPO
for STEPS steps, checkpointing every step, resuming from RUN_DIR's checkpoint and journal
when they exist. After each collection it writes ``actions/<step>.json`` (every action's
ids and likelihood bytes, status and reward of each episode); at the end ``params.npy``.
The workers append each completed square call to ``audit.jsonl``. KILL is where this
process SIGKILLs itself, or is paused for the test to kill it:

* ``none``;
* ``before:S:N``: at the N-th tool call of the collection at step S, before it is sent;
* ``during:S:G``: the square call of sample G at step S pauses (the worker creates
  ``paused`` and sleeps) and the test kills this process from outside;
* ``after:S``: once the collection at step S has returned (every turn committed), before
  its update.

It prints one JSON line when it starts (the checkpoint it resumes from) and one per step
(the turns the rollout took from the journal).
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import sys
from pathlib import Path

import jax
import numpy as np
import optax
from episode_helpers import square_environment
from test_tool_episodes import BUDGET, PROMPT, SAMPLING, TURNS, ToolPolicy, tasks, verify

from dew_pipe import Dataset, Trainer
from dew_pipe.inference import TextGeneration
from dew_pipe.objectives.rl import EpisodeJournal, EpisodeRollout, GRPOObjective


def _kill() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


class KillBeforeCall:
    """The environment factory, with a SIGKILL before the N-th tool call at step S."""

    def __init__(self, factory, step: int, nth: int) -> None:
        self.factory, self.step, self.nth, self.calls = factory, step, nth, 0

    def __call__(self, episode_id):
        session = self.factory(episode_id)
        if episode_id.step == self.step:
            send = session.step

            def step(action):
                self.calls += 1
                if self.calls == self.nth:
                    _kill()
                return send(action)

            session.step = step
        return session


class Recorded:
    """The rollout, writing each collection's actions (and SIGKILLing itself after step S)."""

    def __init__(self, rollout: EpisodeRollout, run_dir: Path, kill_after: int | None) -> None:
        self.rollout, self.run_dir, self.kill_after = rollout, run_dir, kill_after

    def __getattr__(self, name):  # metrics, checkpointed, read_ahead
        return getattr(self.rollout, name)

    def __call__(self, state, batch, key):
        step = int(state.step)
        packed = self.rollout(state, batch, key)
        episodes = [
            {
                "status": e.status.value,
                "reward": e.reward,
                "actions": [
                    [a.context.tolist(), a.tokens.tolist(), a.log_probs.tobytes().hex()]
                    + [a.behavior_log_probs.tobytes().hex(), a.policy_step]
                    for a in e.actions
                ],
            }
            for e in self.rollout.last_episodes
        ]
        folder = self.run_dir / "actions"
        folder.mkdir(exist_ok=True)
        (folder / f"{step}.json").write_text(json.dumps(episodes))
        restored = self.rollout.metrics().get("journal/restored_turns")
        print(json.dumps({"step": step, "restored": restored}), flush=True)
        if step == self.kill_after:
            _kill()
        return packed


def main(run_dir: Path, steps: int, kill: str) -> None:
    what, *where = kill.split(":")
    where = [int(w) for w in where]
    env = {"AUDIT": str(run_dir / "audit.jsonl")}
    if what == "during":
        env.update(PAUSE=str(run_dir / "paused"), PAUSE_AT=f"{where[0]}:{where[1]}")
    factory = square_environment(run_dir, **env)
    if what == "before":
        factory = KillBeforeCall(factory, *where)
    model = ToolPolicy()
    objective = GRPOObjective(model, seq_len=PROMPT + BUDGET - 1)
    variables = objective.init(jax.random.key(3))
    rollout = EpisodeRollout(
        TextGeneration(model, variables),
        factory,
        verify,
        max_prompt_tokens=PROMPT,
        max_new_tokens=BUDGET,
        max_turns=TURNS,
        groups=2,
        sampling=SAMPLING,
        journal=EpisodeJournal(run_dir / "episodes"),
    )
    trainer = Trainer(
        objective,
        optax.sgd(0.5),
        key=jax.random.key(5),
        rollout=Recorded(rollout, run_dir, where[0] if what == "after" else None),
        run_dir=run_dir,
        checkpoint_every=1,
        progress=False,
    )
    data = Dataset(
        train=lambda partition: (tasks(2 + k % 2, 1 + k % 3) for k in itertools.count()),
        val=None,
        records=None,
        batch=2,
    )
    saved = run_dir / "checkpoints"  # complete steps only (orbax writes into temporary names)
    steps_saved = (
        [int(p.name) for p in saved.iterdir() if p.name.isdigit()] if saved.exists() else []
    )
    latest = max(steps_saved, default=None)
    print(json.dumps({"devices": jax.device_count(), "resumed": latest}), flush=True)
    state = trainer.fit(data, steps=steps, log_every=1)
    np.save(run_dir / "params.npy", np.asarray(state.params["params"]["table"]))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
