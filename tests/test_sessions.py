"""Session records, advantage estimators and session_metrics."""

from __future__ import annotations

import concurrent.futures as cf
import doctest
import importlib
import math

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from session_strategies import sessions_strategy

from dew_pipe import batches
from dew_pipe.objectives.rl import session_arrow
from dew_pipe.objectives.rl.advantages import (
    compute_advantages,
    group_advantages,
    mean_advantages,
    rloo_advantages,
)
from dew_pipe.objectives.rl.sessions import (
    Call,
    Session,
    SessionSource,
    Status,
    Task,
    from_arrow,
    pack,
    session_metrics,
    to_arrow,
)
from dew_pipe.rollout_batches import check_sessions_batch


def good_call(**overrides):
    fields = dict(
        prompt_ids=[1, 2, 3],
        sampled_ids=[4, 5],
        behavior_log_probs=[-0.5, -1.5],
        finish_reason="stop",
        version=2,
    )
    fields.update(overrides)
    return Call(**fields)


# ----------------------------------------------------------------------------- Call


def test_call_normalizes_and_freezes():
    call = good_call(prompt_ids=np.array([1, 2, 3], np.int64), log_probs=(-0.25, -1.0))
    assert call.prompt_ids.dtype == np.int32 and call.sampled_ids.dtype == np.int32
    assert call.behavior_log_probs.dtype == np.float32 and call.log_probs.dtype == np.float32
    assert call.length == 5
    np.testing.assert_array_equal(call.old_log_probs, [-0.25, -1.0])
    np.testing.assert_array_equal(good_call().old_log_probs, [-0.5, -1.5])
    with pytest.raises(ValueError, match="read-only"):
        call.prompt_ids[0] = 9
    empty = good_call(sampled_ids=[], behavior_log_probs=[], finish_reason="abort")
    assert empty.sampled_ids.shape == (0,) and empty.sampled_ids.dtype == np.int32
    # caller's array is left writable
    mine = np.array([1, 2], np.int32)
    good_call(prompt_ids=mine)
    mine[0] = 3


def test_call_equality_is_elementwise():
    assert good_call() == good_call()
    assert good_call() != good_call(version=3)
    assert good_call() != good_call(log_probs=[-0.5, -1.5])
    assert good_call(support=[[4, 1], [5]]) != good_call(support=[[4], [5]])
    routed = np.zeros((5, 1, 2), np.int8)
    assert good_call(routed_experts=routed) == good_call(routed_experts=routed.copy())
    assert good_call(routed_experts=routed) != good_call(routed_experts=routed.astype(np.int16))


@pytest.mark.parametrize(
    ("overrides", "error", "message"),
    [
        ({"prompt_ids": []}, ValueError, r"Call.prompt_ids: expected at least one id"),
        ({"prompt_ids": [1, -2]}, ValueError, r"Call.prompt_ids: expected ids in .*-2 at index 1"),
        ({"prompt_ids": [True, False]}, TypeError, r"Call.prompt_ids: expected integer.*bool"),
        ({"sampled_ids": [4.0, 5.0]}, TypeError, r"Call.sampled_ids: expected integer.*float64"),
        ({"sampled_ids": [[4, 5]]}, ValueError, r"Call.sampled_ids: expected a 1-D"),
        ({"sampled_ids": [4, 2**31]}, ValueError, r"Call.sampled_ids: expected ids in"),
        (
            {"behavior_log_probs": [-0.5]},
            ValueError,
            r"behavior_log_probs: expected one entry.*\(2,\), got \(1,\)",
        ),
        (
            {"behavior_log_probs": [-0.5, np.nan]},
            ValueError,
            r"behavior_log_probs: expected finite float32 values, got nan at index 1",
        ),
        (
            {"behavior_log_probs": [-0.5, -1e300]},
            ValueError,
            r"behavior_log_probs: expected finite float32 values, got -1e\+300 at index 1",
        ),
        ({"behavior_log_probs": [True, False]}, TypeError, r"behavior_log_probs: expected real"),
        ({"log_probs": [-0.5, -1.0, -2.0]}, ValueError, r"Call.log_probs: expected one entry"),
        ({"log_probs": [np.inf, -1.0]}, ValueError, r"Call.log_probs: expected finite float32"),
        ({"finish_reason": None}, TypeError, r"Call.finish_reason: expected a str"),
        ({"version": True}, TypeError, r"Call.version: expected an int"),
        ({"version": -1}, ValueError, r"Call.version: expected an int >= 0, got -1"),
        ({"version": 1.0}, TypeError, r"Call.version: expected an int"),
        (
            {"routed_experts": np.zeros((6, 2, 2), np.int16)},
            ValueError,
            r"1 <= n <= 5.*\(6, 2, 2\)",
        ),
        (
            {"routed_experts": np.zeros((5, 2), np.int16)},
            ValueError,
            r"routed_experts: expected shape",
        ),
        ({"routed_experts": np.zeros((5, 2, 2))}, TypeError, r"routed_experts: expected integer"),
        ({"routed_experts": -np.ones((5, 2, 2), np.int16)}, ValueError, r"nonnegative"),
        (
            {"support": [[4]]},
            ValueError,
            r"Call.support: expected one entry per sampled id \(2\), got 1",
        ),
        ({"support": [[4], [6, 7]]}, ValueError, r"Call.support\[1\]: the sampled id 5 is not in"),
        ({"support": [[4, 4], [5]]}, ValueError, r"Call.support\[0\]: expected distinct ids"),
        ({"support": [[], [5]]}, ValueError, r"Call.support\[0\]: expected at least one id"),
        ({"support": np.array([[4], [5]])}, TypeError, r"Call.support: expected a sequence"),
    ],
)
def test_call_refuses_bad_fields(overrides, error, message):
    with pytest.raises(error, match=message):
        good_call(**overrides)


@pytest.mark.parametrize(
    ("overrides", "error", "message"),
    [
        ({"prompt_ids": np.zeros(0, np.int32)}, ValueError, r"prompt_ids: expected at least one"),
        (
            {"prompt_ids": np.array([1, -2], np.int32)},
            ValueError,
            r"Call.prompt_ids: expected ids in \[0, 2147483647\], got -2 at index 1",
        ),
        ({"sampled_ids": np.array([4, -5], np.int32)}, ValueError, r"got -5 at index 1"),
        (
            {"behavior_log_probs": np.array([-0.5, np.nan], np.float32)},
            ValueError,
            r"behavior_log_probs: expected finite float32 values, got nan at index 1",
        ),
        (
            {"log_probs": np.array([-0.5, -np.inf], np.float32)},
            ValueError,
            r"Call.log_probs: expected finite float32 values, got -inf at index 1",
        ),
        (
            {"behavior_log_probs": np.array([-0.5], np.float32)},
            ValueError,
            r"behavior_log_probs: expected one entry.*\(2,\), got \(1,\)",
        ),
    ],
)
def test_call_checks_server_arrays_too(overrides, error, message):
    """int32 ids and float32 likelihoods, as servers hand them over, take a shorter path
    through the checks; it refuses the same faults with the same messages."""
    with pytest.raises(error, match=message):
        good_call(**overrides)


def test_call_keeps_server_arrays_as_frozen_views():
    ids, likely = np.array([4, 5], np.int32), np.array([-0.5, -1.5], np.float32)
    call = good_call(sampled_ids=ids, behavior_log_probs=likely, log_probs=likely)
    assert np.shares_memory(call.sampled_ids, ids) and np.shares_memory(call.log_probs, likely)
    with pytest.raises(ValueError, match="read-only"):
        call.sampled_ids[0] = 9
    ids[0] = 7  # the caller's arrays stay writable
    likely[0] = -2.0


def test_check_eos():
    good_call(sampled_ids=[4, 0], finish_reason="stop").check_eos(0)
    good_call(sampled_ids=[4, 5], finish_reason="length").check_eos((0, 9))
    good_call(sampled_ids=[4, 9], finish_reason="stop").check_eos((0, 9))
    with pytest.raises(ValueError, match=r"1 id\(s\) follow EOS 0 at index 0"):
        good_call(sampled_ids=[0, 5]).check_eos(0)
    with pytest.raises(ValueError, match=r"ends on EOS 0, so expected 'stop', got 'length'"):
        good_call(sampled_ids=[4, 0], finish_reason="length").check_eos([0])


# ----------------------------------------------------------------------------- Session


def test_session_normalizes():
    s = Session(Task(7, {"p": 1}), 1, 2, 0, [good_call()], "AGENT_ERROR", 1, {"format": 0})
    assert s.task == 7 and s.status is Status.AGENT_ERROR and s.reward == 1.0
    assert isinstance(s.calls, tuple) and s.components == {"format": 0.0}
    assert Session(np.int64(7), 1, 2, 0, [], Status.CANCELLED).task == 7
    assert Status.parse("infra_error") is Status.INFRA_ERROR
    assert s == Session(7, 1, 2, 0, (good_call(),), Status.AGENT_ERROR, 1.0, {"format": 0.0})
    assert s != Session(7, 1, 2, 1, (good_call(),), Status.AGENT_ERROR, 1.0, {"format": 0.0})


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        ((1.5, 0, 0, 0, [], "COMPLETED"), TypeError, r"Session.task: expected an int"),
        (("t", 0, 0, 0, [], "COMPLETED"), TypeError, r"Session.task: expected an int"),
        ((0, 0, -1, 0, [], "COMPLETED"), ValueError, r"Session.sample: expected an int >= 0"),
        ((0, 0, 0, -1, [], "COMPLETED"), ValueError, r"Session.attempt: expected an int >= 0"),
        ((0, 0, 0, 0, ["x"], "COMPLETED"), TypeError, r"Session.calls\[0\]: expected a Call"),
        ((0, 0, 0, 0, None, "COMPLETED"), TypeError, r"Session.calls: expected a sequence"),
        ((0, 0, 0, 0, [], "DONE"), ValueError, r"status: expected one of \['COMPLETED'"),
        (
            (0, 0, 0, 0, [], "COMPLETED", float("nan")),
            ValueError,
            r"Session.reward: expected a finite",
        ),
        ((0, 0, 0, 0, [], "COMPLETED", True), TypeError, r"Session.reward: expected a real"),
        ((0, 0, 0, 0, [], "COMPLETED", 1.0, {"a": np.inf}), ValueError, r"components\['a'\]"),
        ((0, 0, 0, 0, [], "COMPLETED", 1.0, {1: 0.0}), TypeError, r"expected str keys"),
        ((0, 0, 0, 0, [], "COMPLETED", 1.0, {}, 3), TypeError, r"Session.detail: expected a str"),
    ],
)
def test_session_refuses_bad_fields(args, error, message):
    with pytest.raises(error, match=message):
        Session(*args)


def test_task_and_source_protocol():
    with pytest.raises(TypeError, match="Task.id"):
        Task("a")

    class Echo:
        def submit(self, task, *, group, sample, attempt):
            future = cf.Future()
            call = Call(task.data, [1], [-0.1], "stop", 0)
            future.set_result(Session(task, group, sample, attempt, [call], "COMPLETED", 1.0))
            return future

        def cancel(self, future):
            future.cancel()

        def close(self):
            pass

    source = Echo()
    assert isinstance(source, SessionSource)
    assert not isinstance(object(), SessionSource)
    session = source.submit(Task(4, [9, 9]), group=1, sample=2, attempt=0).result()
    assert (session.task, session.group, session.sample) == (4, 1, 2)


# ------------------------------------------------------------------------ advantages


def test_estimators_on_worked_numbers():
    rewards = [1.0, 0.0, 0.5, 2.0, 2.0, 3.0]
    groups = [0, 0, 0, 1, 1, 2]
    std = np.std([1.0, 0.0, 0.5], ddof=1)  # 0.5, unbiased as torch.std
    np.testing.assert_allclose(
        group_advantages(rewards, groups),
        [0.5 / (std + 1e-6), -0.5 / (std + 1e-6), 0.0, 0.0, 0.0, 3.0 / (1 + 1e-6)],
        rtol=1e-6,
    )
    np.testing.assert_allclose(mean_advantages(rewards, groups), [0.5, -0.5, 0.0, 0, 0, 3.0])
    np.testing.assert_allclose(
        rloo_advantages(rewards, groups), [1.0 - 0.25, 0.0 - 0.75, 0.5 - 0.5, 0, 0, 3.0]
    )
    assert group_advantages(rewards, groups).dtype == np.float32
    # group ids need not be contiguous or sorted
    np.testing.assert_allclose(
        compute_advantages([5.0, 1.0, 3.0], [9, -4, 9], "rloo"), [2.0, 1.0, -2.0]
    )
    assert compute_advantages([], [], "group").shape == (0,)


def test_estimators_refuse_bad_input():
    with pytest.raises(ValueError, match=r"rewards: expected finite values, got nan at index 1"):
        group_advantages([1.0, np.nan], [0, 0])
    with pytest.raises(ValueError, match=r"groups: expected shape \(2,\)"):
        mean_advantages([1.0, 0.0], [0])
    with pytest.raises(TypeError, match="rewards: expected real numbers"):
        rloo_advantages([True, False], [0, 0])
    with pytest.raises(
        ValueError, match=r"estimator: expected one of \['group', 'mean', 'reward', 'rloo'\]"
    ):
        compute_advantages([1.0], [0], "grpo")


# ------------------------------------------------------------------- session_metrics


def metrics_sessions():
    def s(status, reward, calls, sample, components=None):
        return Session(0, 0, sample, 0, calls, status, reward, components or {})

    a = Call([1], [2, 3], [-1.0, -1.0], "stop", 3)
    b = Call([1, 2, 3, 4], [5], [-1.0], "stop", 4)  # extends a
    c = Call([9], [8, 7, 6], [-1.0] * 3, "length", 1)
    return [
        s("COMPLETED", 1.0, [a, b], 0, {"format": 1.0}),
        s("TRUNCATED", 0.5, [c], 1, {"format": 0.0}),
        s("INFRA_ERROR", None, [c], 2),
        s("AGENT_ERROR", 0.0, [Call([1], [2], [-1.0], "stop", 5)], 3),
    ]


@pytest.mark.parametrize("truncation", ["mask", "score", "zero"])
def test_session_metrics(truncation):
    sessions = metrics_sessions()
    batch = pack(sessions, 8, truncation=truncation)
    m = session_metrics(
        sessions, batch, latencies=[1.0, 2.0, 3.0, 10.0], version=5, truncation=truncation
    )
    assert (
        m["sessions/count"] == 4 and m["sessions/truncated"] == 1 and m["sessions/cancelled"] == 0
    )
    assert m["chains/count"] == 4 and m["chains/calls_per_chain"] == 5 / 4
    truncated_masked = 1.0 if truncation == "mask" else 0.0
    assert m["masked/completed"] == 0.0 and m["masked/agent_error"] == 0.0
    assert m["masked/infra_error"] == 1.0 and m["masked/truncated"] == truncated_masked
    assert "masked/cancelled" not in m
    trained = 3 + 1 + (3 if truncation != "mask" else 0)
    assert m["masked/all"] == pytest.approx(1 - trained / 10)
    assert m["reward/mean"] == pytest.approx(0.5)
    trained_rewards = {"mask": [1.0, 0.0], "score": [1.0, 0.5, 0.0], "zero": [1.0, 0.0, 0.0]}
    assert m["reward/trained_mean"] == pytest.approx(np.mean(trained_rewards[truncation]))
    assert m["reward/component/format"] == 0.5
    np.testing.assert_allclose(
        [m["latency/p50"], m["latency/p90"], m["latency/p99"], m["latency/max"]],
        np.percentile([1.0, 2.0, 3.0, 10.0], [50, 90, 99]).tolist() + [10.0],
    )
    assert m["version/lag_max"] == 4 and m["version/lag_mean"] == pytest.approx((2 + 4 + 4 + 0) / 4)
    assert m["version/oldest"] == 1
    assert m["pack/rows"] == batch["input_ids"].shape[0]
    assert m["pack/fill"] == pytest.approx(
        np.count_nonzero(batch["text_segment_ids"]) / batch["input_ids"].size
    )


def test_session_metrics_masked_shares_per_status_count_every_session_of_it():
    # A hand-made batch training part of each session's sampled ids: the share per status
    # pools that status's sessions (1 - trained / sampled), sessions in any order.
    def s(status, sampled, group):
        n = sampled
        call = Call([1], list(range(2, 2 + n)), [-1.0] * n, "length", 0)
        return Session(0, group, 0, 0, [call], status, 0.0)

    sessions = [s("COMPLETED", 3, 0), s("TRUNCATED", 4, 1), s("COMPLETED", 2, 2),
                s("AGENT_ERROR", 5, 3)]  # fmt: skip
    trained = [2, 1, 2, 5]  # ids of each session the batch trains on
    width = sum(trained)
    index = np.repeat(np.arange(4, dtype=np.int32), trained)[None, :]
    batch = {
        "response_mask": np.ones((1, width), np.int32),
        "session_index": index,
        "text_segment_ids": np.ones((1, width), np.int32),
    }
    m = session_metrics(sessions, batch)
    assert m["masked/completed"] == 1.0 - 4 / 5
    assert m["masked/truncated"] == 1.0 - 1 / 4
    assert m["masked/agent_error"] == 0.0
    assert m["masked/all"] == pytest.approx(1.0 - 10 / 14)
    assert not any(k in m for k in ("masked/infra_error", "masked/cancelled"))


def test_session_metrics_refuses_mismatches():
    sessions = metrics_sessions()
    batch = pack(sessions, 8)
    with pytest.raises(ValueError, match=r"latencies: expected one per session, shape \(4,\)"):
        session_metrics(sessions, batch, latencies=[1.0])
    with pytest.raises(ValueError, match="latencies: expected finite seconds"):
        session_metrics(sessions, batch, latencies=[1.0, -1.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="newer than the current version 2"):
        session_metrics(sessions, batch, version=2)
    with pytest.raises(ValueError, match=r"session_index.*was it packed from these sessions"):
        session_metrics(sessions[:1], batch)
    with pytest.raises(ValueError, match="column 'session_index'"):
        session_metrics(sessions, {"response_mask": batch["response_mask"]})
    assert "latency/p50" not in session_metrics([], pack([], 4), latencies=[])


# ------------------------------------------------------------------------ docstrings


@pytest.mark.parametrize(
    "module",
    ["advantages", "sessions", "session_records", "packing", "session_stats", "session_arrow"],
)
def test_docstring_examples_run(module):
    mod = importlib.import_module(f"dew_pipe.objectives.rl.{module}")
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


# ------------------------------------------------------------------------ Arrow


@settings(max_examples=60, deadline=None)
@given(data=sessions_strategy(with_extras=True))
def test_arrow_round_trip_of_random_sessions(data):
    sessions, _ = data
    assert from_arrow(to_arrow(sessions)) == sessions


def test_arrow_round_trip_keeps_everything_and_shares_memory(tmp_path):
    routed = np.arange(2 * 3 * 2, dtype=np.uint8).reshape(2, 3, 2)
    sessions = [
        Session(
            5,
            -1,
            3,
            2,
            [
                good_call(log_probs=[-0.25, -0.125], routed_experts=routed, support=[[4, 0], [5]]),
                good_call(sampled_ids=[], behavior_log_probs=[], finish_reason="abort", version=7),
            ],
            "AGENT_ERROR",
            0.25,
            {"tests": 0.5, "format": 1.0},
            "tool call malformed",
        ),
        Session(6, 0, 0, 0, [], "INFRA_ERROR", None, {}, "engine down"),
    ]
    record = to_arrow(sessions)
    back = from_arrow(record)
    assert back == sessions
    assert back[0].calls[0].routed_experts.dtype == np.uint8
    assert back[1].reward is None and back[0].components == {"tests": 0.5, "format": 1.0}
    # reading back is zero-copy: the call arrays point into the batch's buffers
    calls = record.column("calls").values
    for field, array in (
        ("prompt_ids", back[0].calls[1].prompt_ids),
        ("behavior_log_probs", back[0].calls[0].behavior_log_probs),
        ("raw_log_probs", back[0].calls[0].log_probs),
    ):
        buffer = calls.field(field).values.buffers()[1]
        address = array.__array_interface__["data"][0]
        assert buffer.address <= address < buffer.address + buffer.size, field
    assert not back[0].calls[0].sampled_ids.flags.writeable
    path = batches.write_parquet(tmp_path / "sessions.parquet", record)
    table = batches.read_parquet(path, schema=record.schema)
    assert from_arrow(table.to_batches()[0]) == sessions


def test_arrow_refuses_what_it_cannot_hold():
    a = good_call(routed_experts=np.zeros((2, 3, 2), np.int16))
    b = good_call(routed_experts=np.zeros((2, 4, 2), np.int16))
    with pytest.raises(ValueError, match=r"routed_experts"):
        to_arrow([Session(0, 0, 0, 0, [a, b], "COMPLETED", 1.0)])
    with pytest.raises(ValueError, match="does not fit the sessions schema"):
        to_arrow([Session(0, 2**40, 0, 0, [], "COMPLETED", 1.0)])
    with pytest.raises(TypeError, match=r"sessions\[0\]: expected a Session"):
        to_arrow(["x"])
    # a batch whose rows fail validation names the row
    rows = [
        {
            "task_id": 0,
            "group": 0,
            "sample": 0,
            "attempt": 0,
            "status": "COMPLETED",
            "reward": 1.0,
            "calls": [
                {
                    "prompt_ids": [],
                    "sampled_ids": [1],
                    "behavior_log_probs": [-1.0],
                    "finish_reason": "stop",
                    "version": 0,
                }
            ],
        }
    ]
    with pytest.raises(
        ValueError, match=r"sessions batch row 0: Call.prompt_ids: expected at least one id"
    ):
        from_arrow(batches.sessions_to_arrow(rows))


@settings(max_examples=40, deadline=None)
@given(data=sessions_strategy(with_extras=True), start=st.integers(0, 3))
def test_columnar_read_matches_the_record_checks(data, start):
    # from_arrow checks whole columns and builds records unchecked; the row-by-row reader
    # runs every record's own checks: both must read the same records, also off a slice
    sessions, _ = data
    batch = to_arrow(sessions)
    for part in (batch, batch.slice(min(start, batch.num_rows))):
        fast, checked = from_arrow(part), session_arrow._row_by_row(part)
        assert fast == checked
        routing = check_sessions_batch(part)
        per_record = any(
            c.support is not None or c.routed_experts is not None for x in checked for c in x.calls
        )
        # the fast path read it, unless a call recorded support or routing
        assert (session_arrow._columnar(part, routing) is None) == per_record
        for session in fast:
            assert isinstance(session.calls, tuple) and isinstance(session.status, Status)
            for c in session.calls:
                assert not c.prompt_ids.flags.writeable and not c.sampled_ids.flags.writeable
                assert c.prompt_ids.dtype == np.int32 and c.behavior_log_probs.dtype == np.float32


def _rows_with(mutate):
    rows = []
    for i in range(3):
        call = {
            "prompt_ids": [1, 2],
            "sampled_ids": [3, 4],
            "behavior_log_probs": [-0.5, -0.25],
            "raw_log_probs": [-0.4, -0.2],
            "finish_reason": "stop",
            "version": 1,
            "support": None,
        }
        rows.append(
            {
                "task_id": i,
                "group": 0,
                "sample": i,
                "attempt": 0,
                "status": "COMPLETED",
                "reward": 1.0,
                "components": [("exact", 1.0)],
                "detail": "",
                "calls": [call],
            }
        )
    mutate(rows[1], rows[1]["calls"][0])
    # from_pylist checks types only: the values below are what a foreign writer could send
    return pa.RecordBatch.from_pylist(rows, schema=batches.sessions_schema())


@pytest.mark.parametrize(
    "mutate, error, message",
    [
        (lambda s, c: c.update(prompt_ids=[]), ValueError, "Call.prompt_ids: expected at least"),
        (lambda s, c: c.update(sampled_ids=[-3, 4]), ValueError, "Call.sampled_ids: expected ids"),
        (lambda s, c: c.update(behavior_log_probs=[math.nan, -1.0]), ValueError, "finite"),
        (lambda s, c: c.update(behavior_log_probs=[-1.0]), ValueError, "one entry per sampled"),
        (lambda s, c: c.update(raw_log_probs=[-1.0, -1.0, -1.0]), ValueError, "Call.log_probs"),
        (lambda s, c: c.update(raw_log_probs=[math.inf, -1.0]), ValueError, "Call.log_probs"),
        (lambda s, c: c.update(version=-1), ValueError, "Call.version: expected an int >= 0"),
        (lambda s, c: c.update(support=[[3], [5]]), ValueError, r"Call.support\[1\]"),
        (lambda s, c: c.update(finish_reason=None), TypeError, "Call.finish_reason"),
        (lambda s, c: s.update(sample=-1), ValueError, "Session.sample"),
        (lambda s, c: s.update(attempt=-2), ValueError, "Session.attempt"),
        (lambda s, c: s.update(status="DONE"), ValueError, "status"),
        (lambda s, c: s.update(reward=math.inf), ValueError, "Session.reward"),
        (lambda s, c: s.update(components=[("a", math.nan)]), ValueError, "Session.components"),
        (lambda s, c: s.update(detail=None), TypeError, "Session.detail"),
    ],
)
def test_columnar_read_names_the_row_a_column_check_fails(mutate, error, message):
    good = _rows_with(lambda s, c: None)
    assert [s.task for s in from_arrow(good)] == [0, 1, 2]
    assert session_arrow._columnar(good, None) is not None
    assert session_arrow._columnar(_rows_with(mutate), None) is None  # the column check saw it
    with pytest.raises(error, match=f"sessions batch row 1: .*{message}"):
        from_arrow(_rows_with(mutate))
