"""Tool episodes on two JAX processes (CPU, ``jax.distributed`` on localhost) against one.

The pair runs ``tests/episode_pool_worker.py``: process 0 holds tasks whose episodes end
after one tool call, process 1 tasks that take three, so the processes' episodes have
different turn counts. The reference is one process over the same four tasks on two host
devices. Checked: each process's actions, likelihoods and projected rows are exactly its
block of the reference, and one GRPO update gives the reference's loss and parameters bit
for bit; a tool failure on one process and mismatched settings end the collection on both,
each releasing every environment it opened. The message formats of the exchange are checked
without processes, on a stand-in for the collective.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from process_group import run_group
from test_tool_episodes import EOS, Harness, ScriptedPolicy, episode_rollout, tasks

from dew_pipe.objectives.rl import Action, Episode, EpisodeId, Observation, Transition
from dew_pipe.objectives.rl import episode_pool as pool
from dew_pipe.objectives.rl.episode_collection import Collection
from dew_pipe.objectives.rl.episodes import Origin

WORKER = Path(__file__).resolve().parent / "episode_pool_worker.py"


def _run(processes: int, case: str, tmp_path: Path) -> list[dict]:
    outs = [tmp_path / f"{case}_{processes}_{i}.npz" for i in range(processes)]
    # the reference: one process on the pair's two devices
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"} if processes == 1 else {}
    run_group(WORKER, outs, case, env=env)
    results = []
    for out in outs:
        saved = dict(np.load(out))
        saved["report"] = json.loads(saved["report"].tobytes())
        results.append(saved)
    return results


@pytest.mark.slow
def test_two_processes_match_one_process_exactly(tmp_path):
    (single,) = _run(1, "train", tmp_path)
    pair = _run(2, "train", tmp_path)
    turns = [[int(rank[f"turns/{i}"]) for i in range(4)] for rank in pair]
    assert turns == [[int(single[f"turns/{i}"]) for i in range(4 * p, 4 * p + 4)] for p in (0, 1)]
    assert max(turns[0]) == 1 and max(turns[1]) == 3  # the processes' episodes differ in length
    # the same number of generation rounds on both, each over all eight slots
    assert pair[0]["report"]["batches"] == pair[1]["report"]["batches"] == [8, 8, 8]
    assert single["report"]["batches"] == [8, 8, 8]
    for p, rank in enumerate(pair):
        actions = [k for k in rank if k.startswith("action/")]
        assert len(actions) == 4 * sum(turns[p])
        for name in actions:
            _, i, j, field = name.split("/")
            reference = single[f"action/{int(i) + 4 * p}/{j}/{field}"]
            assert rank[name].dtype == reference.dtype, name
            assert rank[name].tobytes() == reference.tobytes(), name
        for i in range(4):
            reward = rank[f"reward/{i}"]
            assert reward.tobytes() == single[f"reward/{i + 4 * p}"].tobytes()
            # the episode's identity, its environment seed included, is the global slot's
            np.testing.assert_array_equal(rank[f"id/{i}"], single[f"id/{i + 4 * p}"])
    columns = [k for k in single if k.startswith("batch/")]
    assert {"batch/input_ids", "batch/advantages", "batch/session_index"} <= set(columns)
    for name in columns:
        rows = single[name].shape[0] // 2
        for p, rank in enumerate(pair):
            np.testing.assert_array_equal(rank[name], single[name][p * rows : (p + 1) * rows], name)
    # session indices are global: process 1's rows name sessions 4-7
    assert set(np.unique(pair[1]["batch/session_index"])) - {-1} <= set(range(4, 8))
    assert (single["batch/advantages"] != 0).any()
    for name in [k for k in single if k.startswith("metric/")] + ["loss"]:
        for rank in pair:
            assert rank[name].tobytes() == single[name].tobytes(), name
    params = [k for k in single if k.startswith("param/")]
    assert params
    for name in params:
        for rank in pair:
            assert rank[name].tobytes() == single[name].tobytes(), name
    for rank in pair:
        assert all(e["entered"] and e["exited"] for e in rank["report"]["environments"])


@pytest.mark.slow
def test_a_tool_failure_on_one_process_ends_the_collection_on_both(tmp_path):
    first, second = _run(2, "tool-failure", tmp_path)
    (own,) = first["report"]["errors"]
    (peer,) = second["report"]["errors"]
    assert own["type"] == peer["type"] == "EpisodeFailure"
    assert "task 0, step 0, sample 0" in own["message"] and "square tool crashed" in own["message"]
    assert peer["message"].startswith("process 0 ended the collection: ")
    assert "square tool crashed" in peer["message"]
    # both stopped before a second generation round
    assert first["report"]["batches"] == second["report"]["batches"] == [8]
    for rank in (first, second):
        environments = rank["report"]["environments"]
        assert len(environments) == 4
        assert all(e["entered"] and e["exited"] for e in environments)
    # process 1's episodes were still running: each exited under the collection's failure
    running = [e for e in second["report"]["environments"] if e["exit_error"] is not None]
    assert running and all("square tool crashed" in e["exit_error"] for e in running)
    assert all(e["exit_error"] for e in first["report"]["environments"] if e["task"] == 1)


@pytest.mark.slow
def test_mismatched_settings_fail_on_both_processes_before_anything_opens(tmp_path):
    for rank in _run(2, "mismatch", tmp_path):
        rows, turns = rank["report"]["errors"]
        assert rows["type"] == turns["type"] == "ValueError"
        assert "rows differs (process 0: 2, process 1: 1)" in rows["message"]
        assert "settings.max_turns differs (process 0: 3, process 1: 2)" in turns["message"]
        assert rank["report"]["environments"] == [] and rank["report"]["batches"] == []


# ---------------------------------------------------------------------------- no processes


class Exchange:
    """A stand-in for the collective: this process's payload among the others' given ones."""

    def __init__(self, index: int, others: list[bytes]) -> None:
        self.index, self.count, self.others = index, len(others) + 1, others
        self.sent: list[bytes] = []

    def exchange(self, payload: bytes) -> list[bytes]:
        self.sent.append(payload)
        return [*self.others[: self.index], payload, *self.others[self.index :]]


def test_episodes_travel_as_bytes_exactly():
    origin = Origin()
    action = Action(
        [2, 5], [3, EOS], [-0.5, -1e-30], [-0.25, np.float32(-3.4e38)], True, 3, origin=origin
    )
    cut = Action([2, 9], [4, 4], [-1.0, -2.0], [-1.5, -2.5], False, 3, origin=origin)
    episodes = [
        Episode(
            EpisodeId(7, 2, 1, 2**32 - 1),
            Observation([2, 5], detail="hello ✓"),
            [
                Transition(action, Observation([2, 9])),
                Transition(cut, Observation(status="truncated", detail="budget")),
            ],
            "truncated",
            "budget",
            0.1 + 0.2,
            origin=origin,
        ),
        Episode(
            EpisodeId(-3, 2, 0, 0), Observation(status="error", detail="no start"), (), "error"
        ),
    ]
    other = Origin()
    back = pool.episodes_from_bytes(pool.episodes_to_bytes(episodes), other)
    assert back == episodes  # ids, observations, transitions, status, detail, reward
    assert back[0].reward == 0.1 + 0.2
    for a, b in zip(back[0].actions, episodes[0].actions, strict=True):
        for name in ("context", "tokens", "log_probs", "behavior_log_probs"):
            assert getattr(a, name).tobytes() == getattr(b, name).tobytes()
            assert getattr(a, name).dtype == getattr(b, name).dtype
    assert all(e.origin is other and all(a.origin is other for a in e.actions) for e in back)
    assert pool.episodes_from_bytes(pool.episodes_to_bytes([]), other) == []


def test_agree_names_the_setting_that_differs_and_each_value():
    mine = {"rows": 2, "settings": {"groups": 4, "max_turns": 3}}
    theirs = json.dumps(pool._flat({"rows": 2, "settings": {"groups": 4, "max_turns": 3}}))
    pool.agree(Exchange(0, [theirs.encode()]), mine)  # the same: nothing raised
    other = json.dumps(pool._flat({"rows": 2, "settings": {"groups": 8, "max_turns": 3}}))
    with pytest.raises(
        ValueError, match=r"settings\.groups differs \(process 0: 8, process 1: 4\)"
    ):
        pool.agree(Exchange(1, [other.encode()]), mine)


def _standing_payload(failure=None, contexts=()):
    exchange = Exchange(0, [])
    pool.standing(exchange, failure, contexts)
    return exchange.sent[0]


def test_standing_returns_the_global_contexts_in_slot_order():
    theirs = _standing_payload(None, [None, np.array([4, 5, 6], np.int32)])
    failures, everyone = pool.standing(Exchange(0, [theirs]), None, [np.array([1], np.int32), None])
    assert failures == []
    assert [None if c is None else c.tolist() for c in everyone] == [[1], None, None, [4, 5, 6]]
    assert all(c is None or c.dtype == np.int32 for c in everyone)


def test_standing_reports_a_peer_failure_and_drops_every_context():
    theirs = _standing_payload(("episode (task 3) failed: the tool hung", True))
    failures, everyone = pool.standing(Exchange(1, [theirs]), None, [np.array([1, 2], np.int32)])
    assert failures == [(0, "episode (task 3) failed: the tool hung", True)]
    assert everyone == [None, None]


def test_a_peer_failure_releases_every_open_environment_and_records_each_episode():
    recorded = []
    harness = Harness()
    rollout = episode_rollout(ScriptedPolicy(), harness, record=recorded.append, groups=2)
    ids = [EpisodeId(2, 0, g, g) for g in range(2)]
    run = Collection(rollout, ids, 0, Origin())
    run.open(0)
    run.open(1)
    error = run.abort_for_peer(1, "episode (task 5) failed: RuntimeError('down')", False)
    assert str(error).startswith("process 1 ended the collection: episode (task 5) failed")
    assert [e.exited for e in harness.environments] == [True, True]
    assert all(e.exit_error is error for e in harness.environments)
    assert [e.status.value for e in recorded] == ["error", "error"]
    assert all("process 1 ended the collection" in e.detail for e in recorded)
    assert len(error.episodes) == 2 and error.status.value == "error"
    cancelled = Collection(rollout, ids, 0, Origin())
    cancelled.open(0)
    stopped = cancelled.abort_for_peer(0, "cancelled", True)
    assert type(stopped).__name__ == "EpisodeCancelled" and stopped.status.value == "cancelled"


def test_one_process_keeps_its_single_process_path(monkeypatch):
    """With one process nothing is exchanged (no collective is called)."""
    monkeypatch.setattr(
        pool.Ranks, "exchange", lambda self, payload: pytest.fail("exchanged on one process")
    )
    rollout = episode_rollout(ScriptedPolicy(), Harness(), groups=2)
    state = type("S", (), {"step": 0, "updates": 0, "params": None})()
    batch = rollout(state, tasks(1, 2), jax.random.key(0))
    assert batch["input_ids"].shape[0] == 2 * 2 * rollout.max_turns
