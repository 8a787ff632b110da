"""pack, chain_lengths and rows_needed: chains, placement, columns, status rules, errors."""

from __future__ import annotations

import statistics

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from session_strategies import call, sessions_strategy, trains

from dew_pipe.objectives.rl.sessions import (
    Call,
    Session,
    Status,
    chain_lengths,
    pack,
    rows_needed,
)

CORE = {
    "input_ids": np.int32,
    "text_segment_ids": np.int32,
    "text_positions": np.int32,
    "response_mask": np.int32,
    "old_log_probs": np.float32,
    "behavior_log_probs": np.float32,
    "advantages": np.float32,
    "versions": np.int32,
    "session_index": np.int32,
    "call_index": np.int32,
    "session_weights": np.float32,
}


def session(calls, reward=1.0, status="COMPLETED", task=0, group=0, sample=0):
    return Session(task, group, sample, 0, calls, status, reward)


# ---------------------------------------------------------------- reference implementations


def reference_advantages(rewards, groups, estimator):
    """Plain-Python estimators, written from their definitions (verl's conventions)."""
    members = {}
    for k, g in enumerate(groups):
        members.setdefault(g, []).append(k)
    out = [0.0] * len(rewards)
    for ks in members.values():
        values = [rewards[k] for k in ks]
        for k in ks:
            if len(ks) == 1:
                out[k] = rewards[k] / (1 + 1e-6) if estimator == "group" else rewards[k]
            elif estimator == "group":
                mean = statistics.fmean(values)
                out[k] = (rewards[k] - mean) / (statistics.stdev(values) + 1e-6)
            elif estimator == "mean":
                out[k] = rewards[k] - statistics.fmean(values)
            else:
                others = [rewards[m] for m in ks if m != k]
                out[k] = rewards[k] - statistics.fmean(others)
    return out


def reference_training(sessions, truncation, estimator):
    """The training sessions' indices, their (task, group) keys and reference advantages."""
    training = [i for i, s in enumerate(sessions) if trains(s, truncation)]
    rewards = [
        0.0
        if sessions[i].status is Status.TRUNCATED and truncation == "zero"
        else sessions[i].reward
        for i in training
    ]
    keys = [(sessions[i].task, sessions[i].group) for i in training]
    return training, keys, reference_advantages(rewards, keys, estimator)


def unpack(batch, n_sessions):
    """Recover, per (session, call), sampled ids, likelihoods, versions and prompt ids."""
    found = {}
    rows, _ = batch["input_ids"].shape
    for r in range(rows):
        sampled = np.flatnonzero(batch["response_mask"][r])
        for c in sampled:
            key = (int(batch["session_index"][r, c]), int(batch["call_index"][r, c]))
            found.setdefault(key, []).append((r, c))
    calls = {}
    for key, places in found.items():
        r = places[0][0]
        columns = [c for _, c in places]
        first = columns[0]
        segment = batch["text_segment_ids"][r]
        start = int(np.flatnonzero(segment == segment[first])[0])
        calls[key] = {
            "prompt": batch["input_ids"][r, start:first],
            "sampled": batch["input_ids"][r, columns],
            "behavior": batch["behavior_log_probs"][r, columns],
            "old": batch["old_log_probs"][r, columns],
            "versions": batch["versions"][r, columns],
            "rows": {row for row, _ in places},
        }
    return calls


# ------------------------------------------------------------------------- properties


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=sessions_strategy(min_sampled=1),
    extra=st.integers(0, 12),
    truncation=st.sampled_from(["mask", "score", "zero"]),
)
def test_unpacking_recovers_every_call_exactly(data, extra, truncation):
    sessions, _ = data
    width = max([c.length for s in sessions for c in s.calls], default=1) + extra
    batch = pack(sessions, width, truncation=truncation)
    calls = unpack(batch, len(sessions))
    expected = {
        (i, j) for i, s in enumerate(sessions) if trains(s, truncation) for j in range(len(s.calls))
    }
    assert set(calls) == expected
    for (i, j), got in calls.items():
        want = sessions[i].calls[j]
        np.testing.assert_array_equal(got["prompt"], want.prompt_ids)
        np.testing.assert_array_equal(got["sampled"], want.sampled_ids)
        np.testing.assert_array_equal(got["behavior"], want.behavior_log_probs)
        raw = want.behavior_log_probs if want.log_probs is None else want.log_probs
        np.testing.assert_array_equal(got["old"], raw)
        assert set(got["versions"].tolist()) == {want.version}
        assert len(got["rows"]) == 1  # a call never straddles rows


@settings(max_examples=150, deadline=None)
@given(
    data=sessions_strategy(),
    extra=st.integers(0, 12),
    truncation=st.sampled_from(["mask", "score", "zero"]),
)
def test_rows_needed_agrees_with_pack(data, extra, truncation):
    sessions, structure = data
    width = max([c.length for s in sessions for c in s.calls], default=1) + extra
    lengths = chain_lengths(sessions, width, truncation=truncation)
    expected = [
        sessions[i].calls[chain[-1]].length
        for i, chains in enumerate(structure)
        if trains(sessions[i], truncation)
        for chain in chains
    ]
    assert lengths.tolist() == expected
    needed = rows_needed(lengths, width)
    batch = pack(sessions, width, truncation=truncation)
    assert batch["input_ids"].shape == (needed, width)
    assert np.count_nonzero(batch["text_segment_ids"]) == sum(expected)
    # first-fit: no two rows could have shared one row
    used = np.count_nonzero(batch["text_segment_ids"], axis=1)
    for a in range(needed):
        for b in range(a + 1, needed):
            assert used[a] + used[b] > width
    if needed:
        with pytest.raises(ValueError, match=f"need {needed} rows"):
            pack(sessions, width, rows=needed - 1, truncation=truncation)
    assert pack(sessions, width, rows=needed + 1, truncation=truncation)["input_ids"].shape == (
        needed + 1,
        width,
    )


@settings(max_examples=100, deadline=None)
@given(
    data=sessions_strategy(),
    extra=st.integers(0, 6),
    truncation=st.sampled_from(["mask", "score", "zero"]),
    estimator=st.sampled_from(["group", "mean", "rloo"]),
)
def test_columns_are_consistent(data, extra, truncation, estimator):
    sessions, structure = data
    width = max([c.length for s in sessions for c in s.calls], default=1) + extra
    batch = pack(sessions, width, estimator=estimator, truncation=truncation)
    for name, dtype in CORE.items():
        assert batch[name].dtype == dtype and batch[name].shape == batch["input_ids"].shape
    assert "routed" not in batch and "support_ids" not in batch
    training, _, reference = reference_training(sessions, truncation, estimator)
    advantage = dict(zip(training, reference, strict=True))
    chains_of = {
        i: [sessions[i].calls[c[-1]] for c in structure[i]] for i in training if structure[i]
    }
    seen = []
    for r in range(batch["input_ids"].shape[0]):
        segment = batch["text_segment_ids"][r]
        real = np.flatnonzero(segment)
        # chains sit back to back from column 0; padding only at the end of the row
        assert real.tolist() == list(range(real.size))
        assert not batch["input_ids"][r, real.size :].any()
        assert not batch["advantages"][r, real.size :].any()
        assert set(batch["session_index"][r, real.size :].tolist()) <= {-1}
        for seg in np.unique(segment[real]):
            cols = np.flatnonzero(segment == seg)
            np.testing.assert_array_equal(batch["text_positions"][r, cols], np.arange(cols.size))
            owners = set(batch["session_index"][r, cols].tolist()) - {-1}
            assert len(owners) <= 1
            i = owners.pop() if owners else None
            if i is None:  # a chain without sampled ids: find its session by its ids
                continue
            ids = batch["input_ids"][r, cols]
            match = [
                k
                for k, c in enumerate(chains_of[i])
                if np.array_equal(ids, c.prompt_ids.tolist() + c.sampled_ids.tolist())
            ]
            assert match, "a packed chain is not one of its session's chains"
            seen.append((i, match[0]))
            assert np.all(batch["advantages"][r, cols] == np.float32(advantage[i]))
            total = sum(c.sampled_ids.size for c in sessions[i].calls)
            np.testing.assert_allclose(batch["session_weights"][r, cols], 1.0 / total, rtol=1e-7)
    # the reference advantages match to float32 rounding
    for i in training:
        got = batch["advantages"][batch["session_index"] == i]
        if got.size:
            np.testing.assert_allclose(got, advantage[i], rtol=1e-6, atol=1e-6)
    # session-mean from the weights: sum(m*w) counts the sessions with sampled ids
    m, w = batch["response_mask"], batch["session_weights"]
    trained_sessions = {i for i in training if any(c.sampled_ids.size for c in sessions[i].calls)}
    np.testing.assert_allclose((m * w).sum(), len(trained_sessions), rtol=1e-5)


@settings(max_examples=100, deadline=None)
@given(
    data=sessions_strategy(),
    extra=st.integers(0, 6),
    truncation=st.sampled_from(["mask", "score", "zero"]),
    estimator=st.sampled_from(["group", "mean", "rloo"]),
    multiple=st.sampled_from([None, 1, 2, 3, 4]),
)
def test_dropping_zero_advantage_groups_keeps_every_other_session_as_it_was(
    data, extra, truncation, estimator, multiple
):
    sessions, _ = data
    width = max([c.length for s in sessions for c in s.calls], default=1) + extra
    full = pack(sessions, width, estimator=estimator, truncation=truncation)
    kept = pack(
        sessions,
        width,
        estimator=estimator,
        truncation=truncation,
        drop_zero_advantage=True,
        row_multiple=multiple,
    )
    # The groups to drop, from the reference estimators: every advantage exactly 0.
    training, keys, reference = reference_training(sessions, truncation, estimator)
    moving = {k for k, a in zip(keys, reference, strict=True) if np.float32(a) != 0}
    expected = {i for i, k in zip(training, keys, strict=True) if k in moving}
    full_calls, kept_calls = unpack(full, len(sessions)), unpack(kept, len(sessions))
    assert {i for i, _ in kept_calls} == {i for i, _ in full_calls if i in expected}
    for key, got in kept_calls.items():  # each kept call exactly as the full batch has it
        want = full_calls[key]
        for name in ("prompt", "sampled", "behavior", "old", "versions"):
            np.testing.assert_array_equal(got[name], want[name])
    for i in expected:  # baselines from the whole group, before the others left
        np.testing.assert_array_equal(
            np.unique(kept["advantages"][kept["session_index"] == i]),
            np.unique(full["advantages"][full["session_index"] == i]),
        )
    dropped = [i for i in training if i not in expected]
    assert not np.isin(kept["session_index"], dropped).any()
    # rows: what the kept chains need, rounded up to the multiple (one at least)
    needed = rows_needed(
        chain_lengths([sessions[i] for i in sorted(expected)], width, truncation=truncation),
        width,
    )
    rows = needed if multiple is None else max(1, -(-needed // multiple)) * multiple
    assert kept["input_ids"].shape == (rows, width)


def test_dropped_groups_and_row_multiples_by_hand():
    def draw(ids):
        return Call([1, 2], ids, [-0.5] * len(ids), "stop", 0)

    sessions = [
        session([draw([3])], 1.0, group=0, sample=0),
        session([draw([4])], 1.0, group=0, sample=1),  # all right: dropped
        session([draw([3])], 0.0, group=1, sample=0),
        session([draw([4, 5])], 1.0, group=1, sample=1),  # differ: kept
        session([draw([6])], 1.0, "TRUNCATED", group=2, sample=0),
        session([draw([6])], 0.0, group=2, sample=1),  # equal under "zero": dropped
    ]
    batch = pack(sessions, 4, truncation="zero", drop_zero_advantage=True, row_multiple=3)
    assert batch["input_ids"].shape == (3, 4)  # two chains need two rows; a multiple of 3
    assert sorted(set(batch["session_index"][batch["response_mask"] == 1].tolist())) == [2, 3]
    np.testing.assert_array_equal(batch["input_ids"][2], [0, 0, 0, 0])
    a = 0.5 / (np.sqrt(0.5) + 1e-6)
    assert set(np.unique(batch["advantages"][batch["session_index"] == 2])) == {np.float32(-a)}
    scored = pack(sessions, 4, truncation="score", drop_zero_advantage=True)  # 1 vs 0 in group 2
    assert sorted(set(scored["session_index"][scored["response_mask"] == 1].tolist())) == [
        2, 3, 4, 5,
    ]  # fmt: skip
    # "reward" leaves an advantage on every rewarded session, so only reward-0 groups go:
    # under "mask" group 2 trains its second session alone, on reward 0
    rewarded = pack(sessions, 4, estimator="reward", drop_zero_advantage=True)
    assert sorted(set(rewarded["session_index"][rewarded["response_mask"] == 1].tolist())) == [
        0, 1, 2, 3,
    ]  # fmt: skip
    # nothing to train: one multiple of padding rows, or none with the default multiple
    flat = sessions[:2]
    assert pack(flat, 4, drop_zero_advantage=True, row_multiple=4)["input_ids"].shape == (4, 4)
    assert pack(flat, 4, drop_zero_advantage=True, row_multiple=1)["input_ids"].shape == (1, 4)
    assert pack(flat, 4, drop_zero_advantage=True)["input_ids"].shape == (0, 4)
    assert pack(flat, 4, row_multiple=4)["input_ids"].shape == (4, 4)  # 2 rows, rounded up
    assert pack(flat, 4, rows=2, drop_zero_advantage=True)["input_ids"].shape == (2, 4)
    with pytest.raises(ValueError, match="row_multiple is 0; expected None or an int >= 1"):
        pack(flat, 4, row_multiple=0)
    with pytest.raises(TypeError, match="drop_zero_advantage: expected True or False, got 1"):
        pack(flat, 4, drop_zero_advantage=1)


# ------------------------------------------------------------------- worked examples


def test_chain_merges_only_on_the_whole_chain():
    first = call([1, 2], [3, 4], version=1)
    merged = call([1, 2, 3, 4, 9, 9], [5], version=2)  # observation 9 9, then draw 5
    prompt_only = call([1, 2, 3, 4, 9, 9, 5, 8], [6])  # extends merged too: same chain
    split = call([1, 2, 7], [8])  # starts with first's prompt only: new chain
    s = session([first, merged, prompt_only, split])
    assert chain_lengths([s], 13).tolist() == [9, 4]
    batch = pack([s], width=13)
    np.testing.assert_array_equal(batch["input_ids"], [[1, 2, 3, 4, 9, 9, 5, 8, 6, 1, 2, 7, 8]])
    np.testing.assert_array_equal(batch["response_mask"], [[0, 0, 1, 1, 0, 0, 1, 0, 1, 0, 0, 0, 1]])
    np.testing.assert_array_equal(
        batch["text_segment_ids"], [[1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2]]
    )
    np.testing.assert_array_equal(
        batch["text_positions"], [[0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2, 3]]
    )
    np.testing.assert_array_equal(
        batch["call_index"], [[-1, -1, 0, 0, -1, -1, 1, -1, 2, -1, -1, -1, 3]]
    )
    np.testing.assert_array_equal(
        batch["versions"], [[-1, -1, 1, 1, -1, -1, 2, -1, 0, -1, -1, -1, 0]]
    )
    # one column fewer: the two chains no longer share a row
    assert pack([s], width=12)["input_ids"].shape == (2, 12)
    # a call that only shares the previous prompt is never merged
    assert chain_lengths([session([first, call([1, 2, 5, 6], [7])])], 8).tolist() == [4, 5]


def test_first_fit_decreasing_layout():
    calls = {n: call(list(range(1, n)), [n]) for n in (3, 6, 2, 5)}
    sessions = [session([calls[n]], reward=float(n), sample=k) for k, n in enumerate(calls)]
    assert rows_needed(chain_lengths(sessions, 8), 8) == 2
    batch = pack(sessions, width=8, rows=3)
    # longest first: 6 -> row 0, 5 -> row 1, 3 -> row 1, 2 -> row 0; row 2 is padding
    np.testing.assert_array_equal(
        batch["input_ids"],
        [[1, 2, 3, 4, 5, 6, 1, 2], [1, 2, 3, 4, 5, 1, 2, 3], [0] * 8],
    )
    np.testing.assert_array_equal(
        batch["session_index"],
        [[-1] * 5 + [1, -1, 2], [-1] * 4 + [3, -1, -1, 0], [-1] * 8],
    )
    assert not batch["session_weights"][2].any() and not batch["text_segment_ids"][2].any()
    assert rows_needed([], 8) == 0
    assert pack([], 8)["input_ids"].shape == (0, 8)


def test_old_log_probs_raw_when_recorded():
    a = Call([1], [2, 3], [-1.0, -2.0], "stop", 0, log_probs=[-0.5, -0.25])
    b = Call([4], [5], [-3.0], "length", 0)
    batch = pack([session([a, b])], width=5)
    np.testing.assert_array_equal(batch["old_log_probs"], [[0, -0.5, -0.25, 0, -3.0]])
    np.testing.assert_array_equal(batch["behavior_log_probs"], [[0, -1.0, -2.0, 0, -3.0]])


def group_of(statuses, rewards):
    return [
        session([call([1, 2], [3 + k])], reward=r, status=st_, sample=k)
        for k, (st_, r) in enumerate(zip(statuses, rewards, strict=True))
    ]


@pytest.mark.parametrize(
    ("truncation", "trained", "rewards"),
    [
        ("mask", [0, 1, 2], [1.0, 0.0, 0.5]),
        ("score", [0, 1, 2, 3], [1.0, 0.0, 0.5, 0.75]),
        ("zero", [0, 1, 2, 3], [1.0, 0.0, 0.5, 0.0]),
    ],
)
def test_status_rules(truncation, trained, rewards):
    statuses = ["COMPLETED", "AGENT_ERROR", "COMPLETED", "TRUNCATED", "INFRA_ERROR", "CANCELLED"]
    sessions = group_of(statuses, [1.0, 0.0, 0.5, 0.75, 100.0, None])
    batch = pack(sessions, width=3, truncation=truncation)
    assert batch["input_ids"].shape == (len(trained), 3)
    got = {
        int(i): float(a)
        for i, a in zip(batch["session_index"][:, 2], batch["advantages"][:, 2], strict=True)
    }
    assert sorted(got) == trained
    want = reference_advantages(rewards, [0] * len(rewards), "group")
    np.testing.assert_allclose([got[i] for i in trained], want, rtol=1e-6)


def test_groups_are_task_and_group():
    # same group number, different tasks: two separate groups of two
    s = [
        session([call([1], [2])], reward=r, task=t, group=0, sample=k)
        for k, (t, r) in enumerate([(0, 1.0), (0, 0.0), (7, 5.0), (7, 3.0)])
    ]
    adv = pack(s, 2, estimator="mean")["advantages"][:, 0]
    order = pack(s, 2)["session_index"][:, 1]
    got = dict(zip(order.tolist(), adv.tolist(), strict=True))
    assert got == {0: 0.5, 1: -0.5, 2: 1.0, 3: -1.0}
    got = pack(s, 2, estimator="rloo")["advantages"][:, 0]
    assert sorted(got.tolist()) == [-2.0, -1.0, 1.0, 2.0]


def test_session_weights_across_chains():
    a = session([call([1], [2, 3]), call([9], [4])], sample=0, reward=1.0)  # 3 sampled ids
    b = session([call([1], [2])], sample=1, reward=0.0)  # 1 sampled id
    c = session([call([1, 2], [])], sample=2, reward=0.5)  # none: weight 0
    batch = pack([a, b, c], width=16)
    w, seg = batch["session_weights"][0], batch["text_segment_ids"][0]
    assert np.all(w[seg == 0] == 0)
    values = sorted(set(w[seg > 0].tolist()))
    np.testing.assert_allclose(values, [0.0, 1 / 3, 1.0], rtol=1e-7)
    loss = np.arange(16, dtype=np.float32)
    m = batch["response_mask"][0]
    means = [loss[(batch["session_index"][0] == i) & (m == 1)].mean() for i in (0, 1)]
    np.testing.assert_allclose((loss * m * w).sum() / (m * w).sum(), np.mean(means), rtol=1e-6)


def test_routing_all_some_and_overwrite():
    r1 = np.arange(3 * 2 * 2, dtype=np.int16).reshape(3, 2, 2)  # covers 3 of call 1's 4 ids
    r2 = np.full((6, 2, 2), 7, np.int16)  # covers 6 of call 2's 7 ids
    c1 = call([1, 2], [3, 4], routed_experts=r1)
    c2 = call([1, 2, 3, 4, 5], [6, 7], routed_experts=r2)
    c3 = call([8], [9])  # no record
    batch = pack([session([c1, c2, c3])], width=10)
    experts, routed = batch["routed_experts"], batch["routed"]
    assert experts.shape == (1, 10, 2, 2) and experts.dtype == np.int16 and routed.dtype == bool
    np.testing.assert_array_equal(routed[0], [1] * 6 + [0] * 4)
    assert np.all(experts[0, :6] == 7)  # the later call's record replaces the earlier one
    assert not experts[0, 6:].any()
    only_first = pack([session([c1])], width=4)
    np.testing.assert_array_equal(only_first["routed_experts"][0, :3], r1)
    np.testing.assert_array_equal(only_first["routed"][0], [1, 1, 1, 0])
    bad = call([1], [2], routed_experts=np.zeros((2, 3, 2), np.int16))
    with pytest.raises(ValueError, match=r"routed_experts: expected \[n, 2, 2\] int16"):
        pack([session([c1]), session([bad], sample=1)], width=8)
    wrong_dtype = call([1], [2], routed_experts=np.zeros((2, 2, 2), np.int32))
    with pytest.raises(ValueError, match="int32"):
        pack([session([c1]), session([wrong_dtype], sample=1)], width=8)


def test_support_columns():
    a = call([1], [2, 3], support=[[2, 5, 6], [3]])
    b = call([1, 2, 3, 4], [7], support=[[8, 7]])
    c = call([9], [4])  # no support: scored over the full vocabulary
    batch = pack([session([a, b]), session([c], sample=1)], width=8, support_capacity=8)
    np.testing.assert_array_equal(batch["support_ids"], [[2, 5, 6, 3, 8, 7, -1, -1]])
    np.testing.assert_array_equal(batch["support_columns"], [[1, 1, 1, 2, 4, 4, -1, -1]])
    ids = batch["input_ids"][0, batch["support_columns"][0, :6]]
    assert ids.tolist() == [2, 2, 2, 3, 7, 7]
    with pytest.raises(ValueError, match="support_capacity: calls recorded a support"):
        pack([session([a])], width=8)
    with pytest.raises(ValueError, match=r"row 0 holds 6 support ids.*needs support_capacity >= 6"):
        pack([session([a, b])], width=8, support_capacity=5)
    plain = pack([session([c])], width=4, support_capacity=3)
    assert plain["support_ids"].tolist() == [[-1, -1, -1]]


def test_errors_name_what_is_wrong():
    long = session([call([1] * 6, [2, 3])], sample=4)
    with pytest.raises(
        ValueError, match=r"sessions\[0\] \(task 0, group 0, sample 4.*8 ids, longer than width 7"
    ):
        pack([long], width=7)
    with pytest.raises(ValueError, match=r"sessions\[0\].*longer than width 7"):
        chain_lengths([long], 7)
    masked = session([call([1] * 6, [2, 3])], status="TRUNCATED")
    assert pack([masked], width=7)["input_ids"].shape == (0, 7)  # masked: never placed
    two = [session([call([1, 2], [3])], sample=k) for k in range(3)]
    with pytest.raises(ValueError, match=r"need 2 rows of width 6, but rows=1"):
        pack(two, width=6, rows=1)
    unscored = session([call([1], [2])], reward=None)
    with pytest.raises(ValueError, match=r"sessions\[0\].*reward is None"):
        pack([unscored], width=4)
    assert pack([session([call([1], [2])], reward=None, status="TRUNCATED")], 4, truncation="zero")[
        "advantages"
    ].shape == (1, 4)
    with pytest.raises(ValueError, match="estimator"):
        pack(two, 8, estimator="ppo")
    with pytest.raises(ValueError, match="truncation"):
        pack(two, 8, truncation="drop")
    with pytest.raises(ValueError, match="width"):
        pack(two, 0)
    with pytest.raises(ValueError, match="rows"):
        pack(two, 8, rows=-1)
    with pytest.raises(TypeError, match=r"sessions\[1\]: expected a Session"):
        pack([two[0], "x"], 8)
    with pytest.raises(ValueError, match=r"lengths: expected values in \[1, 4\]"):
        rows_needed([5], 4)


def test_the_same_session_twice_is_refused_naming_both_indices():
    a = session([call([1, 2], [3])], reward=1.0, sample=0)
    b = session([call([1, 2], [4])], reward=0.0, sample=1)
    pattern = (
        r"sessions\[2\] \(task 0, group 0, sample 1, attempt 0, COMPLETED\): the same "
        r"session as sessions\[1\]"
    )
    with pytest.raises(ValueError, match=pattern):
        pack([a, b, b], width=8)  # b would train twice and count twice in the baseline
    # the identity decides, not the content: a second record of (task, group, sample, attempt)
    again = session([call([7], [8, 9])], reward=0.5, sample=0)
    with pytest.raises(
        ValueError, match=r"sessions\[2\] .*sample 0.*same session as sessions\[0\]"
    ):
        pack([a, b, again], width=8)
    # a session that would not train is still one session, given once
    cancelled = session([call([1], [2])], reward=None, status="CANCELLED", sample=5)
    with pytest.raises(
        ValueError, match=r"sessions\[1\] .*CANCELLED.*same session as sessions\[0\]"
    ):
        pack([cancelled, cancelled], width=8)
    # another attempt, sample, group or task is another session
    others = [
        Session(0, 0, 1, 1, [call([1], [2])], "COMPLETED", 0.0),
        Session(0, 1, 1, 0, [call([1], [2])], "COMPLETED", 0.0),
        Session(1, 0, 1, 0, [call([1], [2])], "COMPLETED", 0.0),
    ]
    assert pack([a, b, *others], width=8)["input_ids"].shape[0] >= 1


def test_a_duplicate_would_have_moved_the_baseline():
    """What the rule prevents: pack on [a, b, b] would weigh b twice in the group mean."""
    a = session([call([1], [2])], reward=1.0, sample=0)
    b = session([call([1], [3])], reward=0.0, sample=1)
    c = session([call([1], [4])], reward=0.0, sample=2)  # b's twin under its own identity
    twice = pack([a, b, c], width=4)["advantages"][:, 0]
    once = pack([a, b], width=4)["advantages"][:, 0]
    assert not np.allclose(sorted(twice.tolist())[-1], sorted(once.tolist())[-1])
    with pytest.raises(ValueError, match="same session"):
        pack([a, b, b], width=4)


@settings(max_examples=100, deadline=None)
@given(data=sessions_strategy(with_extras=True, min_sampled=1), extra=st.integers(0, 6))
def test_routing_and_support_follow_their_calls(data, extra):
    sessions, structure = data
    width = max([c.length for s in sessions for c in s.calls], default=1) + extra
    supported = any(c.support is not None for s in sessions for c in s.calls)
    capacity = 2 * width  # every support here holds 2 ids per sampled id
    batch = pack(sessions, width, truncation="score", support_capacity=capacity)
    routed_any = any(c.routed_experts is not None for s in sessions for c in s.calls)
    assert ("routed" in batch) == routed_any
    assert batch["support_ids"].shape == (batch["input_ids"].shape[0], capacity)
    if not supported:
        assert (batch["support_ids"] == -1).all()
    # expected routing and support per (row, column), built call by call from the records
    for r in range(batch["input_ids"].shape[0]):
        want_routed = np.zeros(width, bool)
        want_experts = np.zeros((width, 2, 2), np.int16)
        want_support = []
        segment = batch["text_segment_ids"][r]
        for seg in np.unique(segment[segment > 0]):
            cols = np.flatnonzero(segment == seg)
            owners = set(batch["session_index"][r, cols].tolist()) - {-1}
            if not owners:
                continue
            i = owners.pop()
            calls_here = sorted(set(batch["call_index"][r, cols].tolist()) - {-1})
            chain = next(c for c in structure[i] if calls_here[0] in c)
            for j in chain:
                c = sessions[i].calls[j]
                if c.routed_experts is not None:
                    n = c.routed_experts.shape[0]
                    want_routed[cols[0] : cols[0] + n] = True
                    want_experts[cols[0] : cols[0] + n] = c.routed_experts
                if c.support is not None:
                    start = cols[0] + c.prompt_ids.size
                    want_support += [(start + k, kept) for k, kept in enumerate(c.support)]
        if routed_any:
            np.testing.assert_array_equal(batch["routed"][r], want_routed)
            np.testing.assert_array_equal(batch["routed_experts"][r], want_experts)
        want_support.sort(key=lambda e: e[0])
        ids = [int(x) for _, kept in want_support for x in kept]
        columns = [col for col, kept in want_support for _ in kept]
        pad = [-1] * (capacity - len(ids))
        assert batch["support_ids"][r].tolist() == ids + pad
        assert batch["support_columns"][r].tolist() == columns + pad
        # every supported column holds a sampled id that its support contains
        for col, kept in want_support:
            assert batch["response_mask"][r, col] == 1
            assert batch["input_ids"][r, col] in kept


def test_arrow_round_trip_is_exact_and_zero_copy():
    from dew_pipe import batches

    r1 = np.arange(12, dtype=np.int16).reshape(3, 2, 2)
    sessions = [
        Session(
            0,
            0,
            0,
            0,
            [call([1, 2], [3, 4], routed_experts=r1, support=[[3, 9], [4]])],
            "COMPLETED",
            1.0,
        ),
        Session(0, 0, 1, 0, [call([5], [6], raw=[-0.125])], "COMPLETED", 0.0),
    ]
    plain = pack(sessions, 8, support_capacity=4)
    record = pack(sessions, 8, support_capacity=4, arrow=True)
    assert record.schema.equals(
        batches.packed_schema(8, routed_experts=(2, 2, np.int16), support_capacity=4)
    )
    back = batches.packed_from_arrow(record)
    assert set(back) == set(plain)
    for name, array in plain.items():
        assert back[name].dtype == array.dtype and back[name].shape == array.shape
        np.testing.assert_array_equal(back[name], array)
    # from Arrow: views of the batch's buffers, not copies (routed is bit-packed in Arrow)
    for name, array in back.items():
        if name == "routed":
            continue
        column = record.column(name)
        while isinstance(column, pa.FixedSizeListArray):
            column = column.flatten()
        buffer = column.buffers()[1]
        address = array.__array_interface__["data"][0]
        assert buffer.address <= address < buffer.address + buffer.size, name


def _first_fit_decreasing(lengths: list[int], width: int) -> tuple[list[int], list[int], int]:
    """The textbook placement, one scan of the open rows per chain (the reference)."""
    row, offset, free = [0] * len(lengths), [0] * len(lengths), []
    for i in sorted(range(len(lengths)), key=lambda k: -lengths[k]):  # stable
        r = next((k for k, room in enumerate(free) if room >= lengths[i]), len(free))
        if r == len(free):
            free.append(width)
        row[i], offset[i] = r, width - free[r]
        free[r] -= lengths[i]
    return row, offset, len(free)


@pytest.mark.parametrize("spread", ["any", "long", "short"])
def test_placement_is_first_fit_decreasing(spread):
    from dew_pipe.objectives.rl.packing import _place

    rng = np.random.default_rng({"any": 0, "long": 1, "short": 2}[spread])
    for _ in range(300):
        width = int(rng.integers(1, 40))
        low, high = {"any": (1, width), "long": (max(1, width // 2), width)}.get(
            spread, (1, max(1, width // 4))
        )
        lengths = rng.integers(low, high + 1, int(rng.integers(0, 60))).astype(np.int64)
        row, offset, used = _place(lengths, width)
        assert (row.tolist(), offset.tolist(), used) == _first_fit_decreasing(
            lengths.tolist(), width
        )
        assert rows_needed(lengths, width) == used
