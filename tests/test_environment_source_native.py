"""EnvironmentSource on the native server: many sessions' turns share the continuous batch,
every call packs byte for byte as the server returned it, and a Trainer trains through
``RolloutScheduler`` on multi-turn episodes (the scripted-server cases are in
``test_environment_source.py``).
"""

from __future__ import annotations

import numpy as np
import pytest

from dew_pipe.inference import EnvironmentSource
from dew_pipe.objectives.rl import EpisodeStatus, Observation, pack
from dew_pipe.objectives.rl.sessions import Status, Task

# ------------------------------------------------------------------ on the native server

NATIVE_EOS = tuple(range(24, 32))  # a quarter of the tiny vocabulary: turns end after ~4 ids
NATIVE_P, NATIVE_R, NATIVE_T = 20, 6, 3


class Counter:
    """An append-only environment: ``1 + sample % 3`` turns, each answered with one id."""

    def __init__(self, task, identity) -> None:
        self.turns = 1 + identity.sample % NATIVE_T
        self.first = [1 + task.id % 20, 3]
        self.exited = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.exited = True

    def reset(self):
        return Observation(self.first)

    def step(self, action):
        self.turns -= 1
        if self.turns == 0:
            return Observation(status="completed", detail=str(action.tokens.size))
        return Observation([*action.context.tolist(), *action.tokens.tolist(), 4])


def counting_reward(task, episode) -> float:
    """Varies within a group, so advantages are not all zero."""
    return float(sum(a.tokens.size for a in episode.actions) % 3)


class RecordingServer:
    """Forwards to a NativeRolloutServer and keeps every draw it returned."""

    def __init__(self, native) -> None:
        self.native, self.server, self.draws = native, native.server, []

    @property
    def version(self):
        return self.native.version

    def submit(self, prompt_ids, max_new_tokens, *, seed=None):
        future = self.native.submit(prompt_ids, max_new_tokens, seed=seed)
        future.add_done_callback(lambda f: f.cancelled() or self.draws.append(f.result()))
        return future

    def load(self, variables, version):
        self.native.load(variables, version)


@pytest.fixture(scope="module")
def native():
    from serving_helpers import tiny_model

    from dew_pipe.inference import NativeRolloutServer, Server, ServeTask
    from dew_pipe.sampling import Sampling

    model, variables = tiny_model(0)
    sampling = Sampling(eos_id=NATIVE_EOS, temperature=1.0)
    server = NativeRolloutServer(
        Server.from_task(
            ServeTask(model, variables, sampling),
            slots=8,
            capacity=NATIVE_P + NATIVE_R - 1,
            buckets=(NATIVE_P,),  # one prompt width: fewer prefill compiles
        )
    )
    yield model, variables, server
    server.close()


def test_sessions_share_the_native_batch_and_pack_exactly_what_the_server_returned(native):
    _, _, server = native
    recording, environments = RecordingServer(server), []

    def environment(task, identity):
        environments.append(Counter(task, identity))
        return environments[-1]

    before = server.counters()
    with EnvironmentSource(
        recording, environment, counting_reward, max_prompt_tokens=NATIVE_P,
        max_new_tokens=NATIVE_R, max_turns=NATIVE_T, workers=12,
    ) as source:  # fmt: skip
        futures = [
            source.submit(Task(t), group=t, sample=s, attempt=0) for t in range(3) for s in range(4)
        ]
        sessions = [f.result(timeout=120) for f in futures]
    after = server.counters()
    assert all(env.exited for env in environments) and len(environments) == 12
    assert {s.status for s in sessions} <= {Status.COMPLETED, Status.TRUNCATED}
    assert max(len(s.calls) for s in sessions) == NATIVE_T
    # Turns of different sessions joined rows while other sessions were decoding.
    assert after.joined - before.joined == sum(len(s.calls) for s in sessions)
    assert after.joined_mid_flight > before.joined_mid_flight
    busy = {k: v - before.rows_per_step.get(k, 0) for k, v in after.rows_per_step.items()}
    assert max(k for k, v in busy.items() if v > 0) >= 4
    # Every call is a draw the server returned, and pack copies it byte for byte.
    returned = {(d.prompt_ids.tobytes(), d.sampled_ids.tobytes()): d for d in recording.draws}
    batch = pack(sessions, NATIVE_P + NATIVE_R, rows=12 * NATIVE_T, truncation="score")
    for i, session in enumerate(sessions):
        for k, call in enumerate(session.calls):
            draw = returned[(call.prompt_ids.tobytes(), call.sampled_ids.tobytes())]
            assert call == draw.call() and call.log_probs.tobytes() == draw.log_probs.tobytes()
            where = np.nonzero(
                (batch["session_index"] == i) & (batch["call_index"] == k)
                & (batch["response_mask"] == 1)
            )  # fmt: skip
            assert batch["input_ids"][where].tobytes() == draw.sampled_ids.tobytes()
            assert batch["old_log_probs"][where].tobytes() == draw.log_probs.tobytes()
            assert batch["behavior_log_probs"][where].tobytes() == (
                draw.behavior_log_probs.tobytes()
            )
    # Append-only contexts merge each session's calls into one chain.
    chains = batch["text_segment_ids"].max(axis=1).sum()
    assert chains == len(sessions)


@pytest.mark.slow
def test_a_trainer_runs_through_the_scheduler_on_multi_turn_episodes(native):
    import itertools

    import jax
    import optax

    from dew_pipe import Dataset, Trainer
    from dew_pipe.objectives.rl import GRPOObjective, RolloutScheduler

    model, variables, server = native
    server.load(variables, 0)
    width = NATIVE_P + NATIVE_R
    objective = GRPOObjective(model, seq_len=width - 1, pretrained=variables,
                              behavior_importance=2.0)  # fmt: skip
    episodes, records = [], []
    source = EnvironmentSource(
        server, Counter, counting_reward, max_prompt_tokens=NATIVE_P, max_new_tokens=NATIVE_R,
        max_turns=NATIVE_T, workers=8, record=lambda task, episode: episodes.append(episode),
    )  # fmt: skip
    rows = {"task_id": np.array([3, 8])}
    data = Dataset(train=lambda p: itertools.repeat(rows), val=None, records=2, batch=2)
    scheduler = RolloutScheduler(
        objective, source, server, width=width, rows=2 * 4 * NATIVE_T, groups=4,
        log=records.append,
    )  # fmt: skip
    try:
        trainer = Trainer(objective, optax.adam(1e-2), key=jax.random.key(0), rollout=scheduler)
        state = trainer.fit(scheduler.tasks(data), steps=4, log_every=2)
    finally:
        scheduler.close()
        source.close()
    counters = server.counters()
    assert int(state.updates) == 4 and len(records) == 4
    assert counters.version == records[-1].served == 3
    for record in records:
        assert record.admitted_groups == 2 and record.admitted_sessions == 8
        assert record.lag is not None and 0 <= record.lag <= 1
        assert record.metrics["chains/calls_per_chain"] > 1  # multi-turn chains trained
    # The next batch's episodes still in flight when the scheduler closes are recorded as
    # cancelled, some before their first turn; the rest ran to their own end.
    ended = [e for e in episodes if e.status is not EpisodeStatus.CANCELLED]
    assert len(ended) >= 4 * 8
    turns = [len(e.actions) for e in ended]
    assert max(turns) == NATIVE_T and min(turns) == 1
    versions = {a.policy_step for e in episodes for a in e.actions}
    assert versions >= {0, 1, 2}  # turns sampled by the pushed weights
    moved = jax.tree.map(lambda a, b: float(np.abs(a - b).max()), state.params, variables)
    assert max(jax.tree.leaves(moved)) > 0
