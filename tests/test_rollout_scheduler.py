"""RolloutScheduler end to end on fake sources: the staleness bound, the accounting of every
submission, each rule through the real pipeline, failures, resume, and construction checks.

Sessions are made up by tests/rollout_fakes.py and the objective's rescoring is a cheap
stand-in; tests/test_rollout_trainer.py runs the real GRPO objective through the Trainer.
"""

import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rollout_fakes import (
    FakeObjective,
    FakeSource,
    FakeState,
    FakeWeights,
    Outcome,
    drive,
    task_data,
)

from dew_pipe.data.dataset import Partition
from dew_pipe.flow import StageFailed
from dew_pipe.objectives.rl import RolloutScheduler, prompt_tasks, task_ids
from dew_pipe.training.data_stream import BatchStream

W = 16


def scheduler(source, weights, **kw):
    settings = dict(width=W, rows=8, groups=2, audit=True)
    settings.update(kw)
    objective = settings.pop("objective", FakeObjective(W))
    return RolloutScheduler(objective, source, weights, **settings)


def flow_threads(name="rollout-scheduler"):
    return [t.name for t in threading.enumerate() if t.name.startswith(f"flow:{name}:")]


def check_accounting(sched, source, records):
    """Every submission the source saw has exactly one outcome, and the records add up."""
    ledger = {t.key: t for t in sched.ledger}
    submitted = [(s.group, s.sample, s.attempt) for s in source.submitted]
    assert len(submitted) == len(set(submitted))
    assert set(submitted) == set(ledger)
    assert all(t.outcome is not None for t in ledger.values())
    totals = sched.totals
    outcomes = ("admitted", "resubmitted", "discarded", "cancelled", "abandoned")
    assert totals["submitted"] == len(submitted) == sum(totals[o] for o in outcomes)
    for record in records:
        assert record.accounted == record.submitted
        assert record.admitted_sessions == record.metrics["sessions/count"]
    recorded = {r.batch for r in records}
    unrecorded = [t for t in ledger.values() if t.batch not in recorded]
    assert sum(r.submitted for r in records) + len(unrecorded) == totals["submitted"]
    assert sum(r.admitted_sessions for r in records) == totals["admitted"]
    assert all(t.outcome != "admitted" for t in unrecorded)  # batches never handed over


def check_lag(batches, versions, records, max_lag):
    for batch, version, record in zip(batches, versions, records, strict=True):
        sampled = batch["versions"][batch["response_mask"] == 1]
        assert sampled.size == 0 or version - sampled.min() <= max_lag
        assert record.version == version
        assert record.lag is None or record.lag <= max_lag


# ----------------------------------------------------------------------------- property


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)
@given(
    seed=st.integers(0, 2**16),
    ahead=st.integers(0, 2),
    sync_every=st.integers(1, 2),
    slack=st.integers(0, 1),
    oversample=st.integers(0, 1),
    admit=st.sampled_from([None, 2]),
    truncation=st.sampled_from(["mask", "score", "zero"]),
    rows=st.integers(2, 6),
)
def test_random_stage_timings_keep_the_lag_bound_and_account_for_every_session(
    seed, ahead, sync_every, slack, oversample, admit, truncation, rows
):
    rng = np.random.default_rng(seed)
    lock = threading.Lock()

    def script(submission):
        with lock:
            status = rng.choice(
                ["COMPLETED", "TRUNCATED", "AGENT_ERROR", "INFRA_ERROR", "CANCELLED"],
                p=[0.65, 0.12, 0.08, 0.1, 0.05],
            )
            return Outcome(
                delay=float(rng.uniform(0, 0.004)),
                status=str(status),
                reward=None if rng.random() < 0.3 else float(rng.random()),
                sampled=int(rng.integers(1, 4)),
                calls=int(rng.integers(1, 3)),
                stale=int(rng.random() < 0.1) * 3,
            )

    def reward(task, session):  # a verifier that sometimes fails
        if (session.group + session.sample + session.attempt) % 7 == 3:
            raise RuntimeError("verifier down")
        return float(session.sample % 2)

    max_lag = ahead + sync_every - 1 + slack
    weights = FakeWeights()
    source = FakeSource(weights, script, seed=seed)
    records = []
    sched = scheduler(
        source, weights, rows=rows, ahead=ahead, sync_every=sync_every, max_lag=max_lag,
        oversample=oversample, admit=admit, truncation=truncation, reward=reward,
        max_attempts=4, log=records.append,
    )  # fmt: skip
    try:
        batches, versions, _ = drive(sched, task_data(9, 3), steps=4)
    finally:
        sched.close()
        source.close()
    assert [r.batch for r in records] == [0, 1, 2, 3]
    assert sched.forced_stops == 0  # the stop was graceful: every stage ended on its own
    check_lag(batches, versions, records, max_lag)
    check_accounting(sched, source, records)
    assert all(b["input_ids"].shape == (rows, W) for b in batches)
    assert not flow_threads()


# ----------------------------------------------------------------------------- rules


def test_first_submissions_lag_at_most_ahead_plus_sync_every_minus_one():
    weights = FakeWeights()
    source = FakeSource(weights, lambda s: Outcome(delay=0.001))
    records = []
    with scheduler(source, weights, ahead=2, sync_every=2, max_lag=3, log=records.append) as s:
        batches, versions, _ = drive(s, task_data(8, 2), steps=6)
    source.close()
    check_lag(batches, versions, records, 3)
    assert max(r.lag for r in records) == 3  # the bound is reached, never passed
    assert weights.pushes == [2, 4]  # pushed whenever the served version fell 2 behind
    assert [r.pushed for r in records] == [False, False, True, False, True, False]
    assert all(r.resubmitted == {} for r in records)


def test_rescoring_uses_the_weights_of_the_handover():
    weights = FakeWeights()
    source = FakeSource(weights)
    with scheduler(source, weights) as s:
        batches, versions, _ = drive(s, task_data(4, 2), steps=3)
    source.close()
    for batch, step in zip(batches, versions, strict=True):
        mask = batch["response_mask"] == 1
        expected = -0.1 * batch["input_ids"] * (1.0 + step)  # FakeObjective under step's params
        np.testing.assert_allclose(batch["old_log_probs"][mask], expected[mask], rtol=1e-6)
        assert np.all(batch["old_log_probs"][~mask] == 0)
        assert not np.allclose(batch["old_log_probs"][mask], batch["behavior_log_probs"][mask])


def test_an_objective_scoring_the_proximal_policy_in_step_skips_rescoring():
    weights = FakeWeights()
    source = FakeSource(weights, lambda s: Outcome(delay=0.001))
    objective = FakeObjective(W, proximal_in_step=True)
    records = []
    with scheduler(
        source, weights, objective=objective, ahead=1, max_lag=1, log=records.append
    ) as s:
        batches, _, _ = drive(s, task_data(4, 2), steps=3)
        snapshot = s.snapshot()
    source.close()
    assert "rescore" not in snapshot.stages
    assert snapshot.edges["pack.rows->update.rows"].items == 3
    assert len(records) == 3 and max(r.lag for r in records) <= 1
    for batch in batches:  # the engine's likelihoods pass through untouched
        mask = batch["response_mask"] == 1
        assert mask.any()
        np.testing.assert_array_equal(
            batch["old_log_probs"][mask], batch["behavior_log_probs"][mask]
        )


def test_snapshot_reports_the_running_pipelines_edges_and_stages():
    weights = FakeWeights()
    source = FakeSource(weights, lambda s: Outcome(delay=0.001))
    with scheduler(source, weights, ahead=1, max_lag=1) as s:
        assert s.snapshot() is None  # nothing runs before the first handover
        drive(s, task_data(4, 2), steps=3)
        # The fourth batch's rollout runs on after the last handover, and the counters of
        # two edges are not read at one instant, so wait (bounded) for reward to pass on
        # every session rollout gave it; a session lost between them times this out.
        deadline = time.monotonic() + 10.0
        while True:
            snapshot = s.snapshot()
            sessions = snapshot.edges["rollout.sessions->reward.in"].items
            if snapshot.edges["reward.out->pack.sessions"].items == sessions:
                break
            assert time.monotonic() < deadline, snapshot.edges
            time.sleep(0.01)
    source.close()
    assert s.snapshot() is None  # closed
    edges = snapshot.edges
    # Three batches were handed over, and rollout took the fourth (ahead=1) at the last one.
    assert edges["update.batches->batches.in"].items == 3
    assert edges["trainer.out->update.trainer"].items == 3
    assert edges["tasks.out->rollout.tasks"].items == 4
    assert edges["pack.rows->rescore.rows"].items == 3
    assert sessions >= 1
    assert all(e.put_wait_s >= 0 and e.get_wait_s >= 0 for e in edges.values())
    assert {"rollout", "reward", "pack", "rescore", "update"} <= set(snapshot.stages)
    assert snapshot.stages["rescore"].items_in >= 6  # a batch and its weights per handover


def test_sampling_supports_reach_the_packed_batch():
    weights = FakeWeights()
    source = FakeSource(weights, lambda s: Outcome(sampled=3, support=True))
    with scheduler(source, weights, support_capacity=24) as s:
        [batch], _, _ = drive(s, task_data(2, 2), steps=1)
    source.close()
    assert batch["support_ids"].shape == (8, 24)
    used = batch["support_columns"] >= 0
    assert used.sum() == 2 * 2 * 3 * 2  # 4 sessions, 3 sampled ids, 2 kept ids each
    rows = np.nonzero(used)[0]
    assert np.all(batch["response_mask"][rows, batch["support_columns"][used]] == 1)


def test_timeout_cancels_and_resubmits_a_straggler():
    weights = FakeWeights()
    slow_once = lambda s: Outcome(delay=5.0 if (s.sample, s.attempt) == (1, 0) else 0.0)  # noqa: E731
    source = FakeSource(weights, slow_once)
    records = []
    start = time.monotonic()
    with scheduler(source, weights, timeout=0.2, ahead=0, max_lag=0, log=records.append,
                   objective=FakeObjective(W, behavior_importance=None)) as s:  # fmt: skip
        drive(s, task_data(2, 1), steps=1)
    assert time.monotonic() - start < 3.0  # the 5 s straggler was not waited for
    source.close()
    [record] = records
    assert record.resubmitted == {"timeout": 1} and record.cancellations == 1
    assert source.cancel_requests >= 1
    assert record.admitted_sessions == 2


def test_stale_running_sessions_are_cancelled_at_the_handover():
    weights = FakeWeights()
    # batch 1's sessions hang until cancelled; the trainer then jumps 5 updates at once
    source = FakeSource(
        weights, lambda s: Outcome(delay=30.0 if s.attempt == 0 and s.task >= 2 else 0.0)
    )
    records = []
    with scheduler(source, weights, max_lag=1, log=records.append) as s:
        stream = drive(s, task_data(8, 2), steps=1)[2]
        stream.fill(2)
        s(FakeState(5, {"scale": np.float32(1.0)}), stream.next(), None)
    source.close()
    assert records[1].resubmitted == {"stale_running": 4}
    assert records[1].version == 5 and records[1].lag == 0


def test_a_source_that_raises_stops_the_run_naming_rollout_with_no_thread_left():
    weights = FakeWeights()
    boom = ConnectionError("engine unreachable")
    source = FakeSource(weights, lambda s: Outcome(delay=30.0, raises=boom if s.sample else None))
    s = scheduler(source, weights)
    stream = BatchStream(s.tasks(task_data(4, 1)), Partition(0, 1), None)
    state = FakeState(0, {"scale": 1.0})
    start = time.monotonic()
    for _ in range(2):  # the scheduler stays failed until its stream is opened again
        stream.fill(2)
        with pytest.raises(StageFailed, match="stage 'rollout' failed.*engine unreachable") as info:
            s(state, stream.next(), None)
        assert info.value.stage == "rollout" and info.value.__cause__ is boom
        assert not flow_threads()
    assert time.monotonic() - start < 5  # the 30 s sessions were cancelled, not awaited
    assert source.cancel_requests >= 1
    s.close()
    source.close()


def test_a_group_that_cannot_fit_the_rows_stops_the_run_naming_pack():
    weights = FakeWeights()
    source = FakeSource(weights, lambda s: Outcome(sampled=12))  # 13-id chains, a row each
    s = scheduler(source, weights, rows=1)
    with pytest.raises(StageFailed, match="stage 'pack' failed.*need 2 rows") as info:
        drive(s, task_data(2, 1), steps=1)
    assert isinstance(info.value.__cause__, ValueError)
    s.close()
    source.close()
    assert not flow_threads()


def test_a_push_that_does_not_move_the_version_is_tried_once_more_then_raises():
    weights = FakeWeights(stuck=True)
    source = FakeSource(weights)
    s = scheduler(source, weights)
    with pytest.raises(StageFailed, match="stage 'update'.*left the served version at 0"):
        drive(s, task_data(4, 1), steps=3)
    assert weights.pushes == [1, 1]
    s.close()
    source.close()


def test_reopening_the_stream_cancels_the_old_rollouts_and_resubmits_them():
    weights = FakeWeights()
    hang = lambda s: Outcome(delay=30.0 if s.task == 1 and s.group < 2 else 0.0)  # noqa: E731
    source = FakeSource(weights, hang)
    records = []
    with scheduler(source, weights, log=records.append) as s:
        drive(s, task_data(4, 1), steps=1)  # batch 1 (task 1) is in flight, hanging
        data = task_data(4, 1)
        # a resumed fit: a new stream replays batch 0, then hands over batch 1 again
        stream = BatchStream(s.tasks(data), Partition(0, 1), {"consumed": 1})
        drive(s, data, steps=1, start=1, stream=stream)
        ledger = s.ledger
    source.close()
    old = [t for t in ledger if t.task == 1 and t.key[0] < 2]
    assert [t.outcome for t in old] == ["cancelled", "cancelled"]
    assert {t.cause for t in old} == {"reopened"}
    again = [x for x in source.submitted if x.task == 1 and x.group >= 2]
    assert len(again) == 2 and records[-1].admitted_sessions == 2
    assert source.cancel_requests >= 2
    assert [x.task for x in source.submitted if x.group >= 2][:2] == [1, 1]  # no replay of 0


def test_unregistered_batches_are_refused():
    weights = FakeWeights()
    source = FakeSource(weights)
    with scheduler(source, weights) as s, pytest.raises(ValueError, match="scheduler.tasks"):
        s(None, {"task_id": np.arange(2)}, None)
    source.close()


def test_prompt_rows_reach_the_source_as_tasks_with_their_prompt():
    from dew_pipe.data.dataset import Dataset
    from dew_pipe.data.text_columns import encode_text_column

    batch = {
        "prompt": np.array([[0, 4, 5], [6, 7, 8]], np.int32),
        "prompt_length": np.array([2, 3], np.int32),
        "ground_truth": encode_text_column(["12", "3"], field="ground_truth"),
        "task_id": np.array([7, 8], np.int32),
    }
    seen = []
    weights = FakeWeights()

    class Recording(FakeSource):
        def submit(self, task, **kw):
            seen.append(task)
            return super().submit(task, **kw)

    source = Recording(weights)
    data = Dataset(train=lambda p: iter([batch, batch]), batch=2)
    with scheduler(source, weights, tasks=prompt_tasks) as s:
        drive(s, data, steps=1)
    source.close()
    first = {t.id: t.data for t in seen}
    assert first[7]["prompt"].tolist() == [4, 5] and first[7]["ground_truth"] == "12"
    assert first[8]["prompt"].tolist() == [6, 7, 8] and first[8]["ground_truth"] == "3"


# ----------------------------------------------------------------------------- construction


@pytest.mark.parametrize(
    "kw,message",
    [
        (dict(ahead=2, sync_every=1, max_lag=1), "max_lag is 1 with .*; expected at least .* = 2"),
        (dict(ahead=1, sync_every=3, max_lag=2), "max_lag is 2 with .*; expected at least .* = 3"),
        (dict(groups=1), "groups is 1; expected an int >= 2"),
        (dict(width=20), r"objective.seq_len=15 with width=20"),
        (dict(truncation="drop"), "truncation is 'drop'"),
        (dict(estimator="best"), "estimator is 'best'"),
        (dict(admit=0), "admit is 0"),
        (dict(timeout=0), "timeout is 0"),
        (dict(max_attempts=0), "max_attempts is 0"),
    ],
)
def test_construction_refuses_bad_settings(kw, message):
    weights = FakeWeights()
    with pytest.raises(ValueError, match=message):
        scheduler(FakeSource(weights), weights, **kw)


def test_any_lag_requires_behavior_importance():
    weights = FakeWeights()
    objective = FakeObjective(W, behavior_importance=None)
    with pytest.raises(ValueError, match="max_lag=1 .*behavior_importance"):
        scheduler(FakeSource(weights), weights, objective=objective)
    # a synchronous schedule (no lag) does not need it
    scheduler(FakeSource(weights), weights, objective=objective, ahead=0, max_lag=0).close()


def test_multi_process_trainers_refuse_what_the_pool_does_not_do(monkeypatch, tmp_path):
    import jax

    monkeypatch.setattr(jax, "process_count", lambda: 3)
    weights = FakeWeights()
    with pytest.raises(ValueError, match=r"journal=...\): jax.process_count\(\) is 3; a journal"):
        scheduler(FakeSource(weights), weights, journal=tmp_path / "rollouts")
    objective = FakeObjective(W, proximal_in_step=True)
    with pytest.raises(ValueError, match="is 3, and the objective scores the proximal policy"):
        scheduler(FakeSource(weights), weights, objective=objective)
    pooled = scheduler(FakeSource(weights), weights)  # the rest runs (tests/test_rollout_pool.py)
    assert pooled._pool is not None and pooled._pool.count == 3
    pooled.close()


def test_sources_and_publishers_are_checked():
    weights = FakeWeights()
    with pytest.raises(TypeError, match="expected a SessionSource"):
        scheduler(object(), weights)
    with pytest.raises(TypeError, match="load"):
        scheduler(FakeSource(weights), object())


def test_task_readers():
    assert [t.id for t in task_ids({"task_id": np.array([3, 4])})] == [3, 4]
    with pytest.raises(ValueError, match="no field 'task_id'"):
        task_ids({"prompt": np.zeros((2, 3), np.int32)})
    with pytest.raises(ValueError, match="'prompt_length' is 0 in row 1"):
        prompt_tasks({"prompt": np.ones((2, 3), np.int32), "prompt_length": np.array([1, 0])})


def test_close_from_another_thread_cancels_a_waiting_call():
    from dew_pipe.flow import Cancelled

    weights = FakeWeights()
    source = FakeSource(weights, lambda s: Outcome(delay=30.0))
    s = scheduler(source, weights)
    threading.Timer(0.3, s.close).start()
    start = time.monotonic()
    with pytest.raises(Cancelled, match="closed"):
        drive(s, task_data(2, 1), steps=1)
    assert time.monotonic() - start < 10
    s.close()  # idempotent
    source.close()
    assert not flow_threads()
    assert s.totals["cancelled"] == s.totals["submitted"] == 4  # batches 0 and 1


@pytest.mark.parametrize("ahead", [0, 2])
def test_nothing_is_submitted_beyond_ahead_batches_past_the_one_handed_over(ahead):
    weights = FakeWeights()
    source = FakeSource(weights)
    with scheduler(source, weights, ahead=ahead, max_lag=max(ahead, 1)) as s:
        stream = BatchStream(s.tasks(task_data(12, 1)), Partition(0, 1), None)
        stream.fill(1 + s.read_ahead)  # the Trainer's prefetch registers batches...
        time.sleep(0.1)
        assert source.submitted == []  # ...but nothing runs before the first handover
        for step in range(3):
            stream.fill(1 + s.read_ahead)
            s(FakeState(step, {"scale": np.float32(1)}), stream.next(), None)
            allowed = set(range(step + 1 + ahead))
            deadline = time.monotonic() + 5  # rollout takes its credit on its own thread
            while {x.task for x in source.submitted} != allowed and time.monotonic() < deadline:
                assert {x.task for x in source.submitted} <= allowed
                time.sleep(0.005)
            time.sleep(0.05)
            assert {x.task for x in source.submitted} == allowed
    source.close()
