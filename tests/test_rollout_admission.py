"""Admission rules of the pack stage, driven directly (no threads): one test per rule."""

import numpy as np
import pytest

from dew_pipe.objectives.rl.sessions import Call, Session, pack
from dew_pipe.stages.admission import Admission
from dew_pipe.stages.messages import Handover, Plan, Stamps

W = 16


def session(task, group, sample, attempt=0, status="COMPLETED", reward=1.0, version=0, n=2):
    calls = [] if n == 0 else [Call([1, 2], np.arange(3, 3 + n), np.full(n, -0.5), "stop", version)]
    return Session(task, group, sample, attempt, calls, status, reward)


def stamps(batch=0, version=0, latency=0.01, cause=""):
    return Stamps(batch, version, latency, cause)


def admission(**kw):
    settings = dict(width=W, rows=4, groups=2, max_attempts=3, audit=True)
    settings.update(kw)
    return Admission(**settings)


def outcomes(a):
    return {t.key: (t.outcome, t.cause) for t in a.ledger.values()}


def test_completed_and_agent_error_train_on_their_reward():
    a = admission()
    a.plan(Plan(0, (10,), (7,), 2, 0))
    done = [session(7, 10, 0, reward=1.0), session(7, 10, 1, status="AGENT_ERROR", reward=0.0)]
    for s in done:
        a.finished(s, stamps())
    [(batch, record)] = a.ready(paced=False)
    expected = pack(done, W, rows=4)
    for name, column in expected.items():
        np.testing.assert_array_equal(batch[name], column, err_msg=name)
    assert (record.admitted_groups, record.admitted_sessions, record.submitted) == (1, 2, 2)
    assert record.accounted == record.submitted
    assert a.take_orders().release == (0,)


@pytest.mark.parametrize("truncation", ["mask", "score", "zero"])
def test_truncated_completes_its_group_and_trains_as_truncation_says(truncation):
    a = admission(truncation=truncation)
    a.plan(Plan(0, (0,), (3,), 2, 0))
    a.finished(session(3, 0, 0, reward=1.0), stamps())
    a.finished(session(3, 0, 1, status="TRUNCATED", reward=0.5), stamps())
    [(batch, record)] = a.ready(paced=False)
    assert record.admitted_sessions == 2
    trained = set(np.unique(batch["session_index"][batch["response_mask"] == 1]).tolist())
    assert trained == ({0} if truncation == "mask" else {0, 1})
    if truncation != "mask":  # the two rewards (1 and 0.5 or 0) differ: nonzero advantages
        advantages = batch["advantages"][batch["response_mask"] == 1]
        assert np.all(advantages != 0)


def test_truncated_without_reward_under_score_is_a_failed_attempt():
    a = admission(truncation="score")
    a.plan(Plan(0, (0,), (3,), 2, 0))
    a.finished(session(3, 0, 1, status="TRUNCATED", reward=None), stamps())
    orders = a.take_orders()
    assert [(r.sample, r.attempt, r.cause) for r in orders.resubmit] == [(1, 1, "unscored")]
    # under "mask" the same truncation needs no reward and is kept
    b = admission(truncation="mask")
    b.plan(Plan(0, (0,), (3,), 2, 0))
    b.finished(session(3, 0, 1, status="TRUNCATED", reward=None), stamps())
    assert not b.take_orders().resubmit


@pytest.mark.parametrize(
    "status,cause", [("INFRA_ERROR", "infra_error"), ("CANCELLED", "cancelled")]
)
def test_failures_retry_up_to_max_attempts_then_abandon_the_group(status, cause):
    a = admission(max_attempts=3)
    a.plan(Plan(0, (5,), (9,), 2, 0))
    a.finished(session(9, 5, 0), stamps())
    for attempt in range(2):
        a.finished(session(9, 5, 1, attempt, status=status, reward=None, n=0), stamps())
        [order] = a.take_orders().resubmit
        assert (order.group, order.sample, order.attempt, order.cause) == (5, 1, attempt + 1, cause)
    a.finished(session(9, 5, 1, 2, status=status, reward=None, n=0), stamps())
    assert not a.take_orders().resubmit  # the third failure abandons the sample and group
    [(batch, record)] = a.ready(paced=False)
    assert (record.abandoned_groups, record.admitted_groups) == (1, 0)
    assert record.resubmitted == {cause: 2}
    assert record.abandoned == 2  # the kept sample 0 and the last attempt of sample 1
    assert record.accounted == record.submitted == 4
    assert not batch["response_mask"].any()


def test_a_retry_that_succeeds_rejoins_its_group():
    a = admission()
    a.plan(Plan(0, (5,), (9,), 2, 0))
    a.finished(session(9, 5, 0), stamps())
    a.finished(session(9, 5, 1, 0, status="INFRA_ERROR", reward=None), stamps())
    a.take_orders()
    a.finished(session(9, 5, 1, 1, reward=0.0), stamps())
    [(_, record)] = a.ready(paced=False)
    assert record.admitted_sessions == 2 and record.resubmitted == {"infra_error": 1}


def test_stale_session_is_discarded_and_resubmitted():
    a = admission(max_lag=1)
    a.handover(Handover(0, version=3, served=3))
    a.plan(Plan(0, (0,), (1,), 2, 3))
    a.finished(session(1, 0, 0, version=1), stamps(version=3))  # 3 - 1 > 1: stale
    assert [o.cause for o in a.take_orders().resubmit] == ["stale"]
    a.finished(session(1, 0, 1, version=2), stamps(version=3))  # lag 1: fine
    assert not a.take_orders().resubmit


def test_handover_evicts_sessions_that_turned_stale_and_reopens_the_group():
    a = admission(max_lag=1)
    a.plan(Plan(0, (0,), (1,), 2, 0))
    a.finished(session(1, 0, 0, version=0), stamps())
    a.finished(session(1, 0, 1, version=1), stamps(version=1))
    assert a.ready(paced=True) == []  # complete, but its handover has not come
    a.handover(Handover(0, version=2, served=2))  # sample 0 now lags 2 > 1
    [order] = a.take_orders().resubmit
    assert (order.sample, order.attempt, order.cause) == (0, 1, "stale")
    assert a.ready(paced=True) == []  # the group reopened
    a.finished(session(1, 0, 0, 1, version=2), stamps(version=2))
    [(batch, record)] = a.ready(paced=True)
    assert record.lag == 1 and record.oldest_version == 1 and record.version == 2
    assert batch["versions"][batch["response_mask"] == 1].min() >= 1


def test_timeouts_and_stale_running_cancellations_from_rollout_are_failed_attempts():
    a = admission()
    a.plan(Plan(0, (0,), (1,), 2, 0))
    a.finished(session(1, 0, 0, status="CANCELLED", reward=None, n=0), stamps(cause="timeout"))
    a.finished(
        session(1, 0, 1, status="CANCELLED", reward=None, n=0), stamps(cause="stale_running")
    )
    causes = sorted(o.cause for o in a.take_orders().resubmit)
    assert causes == ["stale_running", "timeout"]
    a.finished(session(1, 0, 0, 1), stamps())
    a.finished(session(1, 0, 1, 1), stamps())
    [(_, record)] = a.ready(paced=False)
    assert record.cancellations == 2 and record.accounted == record.submitted == 4


def test_oversample_admits_the_first_g_to_finish_and_cancels_the_rest():
    a = admission()
    a.plan(Plan(0, (0,), (1,), 4, 0))  # G = 2, K = 2
    a.finished(session(1, 0, 2, reward=0.0), stamps())
    a.finished(session(1, 0, 0, reward=1.0), stamps())
    assert sorted(a.take_orders().cancel) == [(0, 1, 0), (0, 3, 0)]
    a.finished(session(1, 0, 1), stamps())  # finished anyway: already decided
    [(batch, record)] = a.ready(paced=False)
    assert record.admitted_sessions == 2 and record.cancelled == 2 and a.late == 1
    samples = {t.key[1]: t.outcome for t in a.ledger.values()}
    assert samples == {0: "admitted", 1: "cancelled", 2: "admitted", 3: "cancelled"}


def test_admit_packs_the_first_m_groups_and_cancels_the_rest():
    a = admission(admit=1)
    a.plan(Plan(0, (0, 1), (1, 2), 2, 0))
    a.finished(session(2, 1, 0), stamps())  # group 1 (task 2) finishes first
    a.finished(session(1, 0, 0), stamps())
    a.finished(session(2, 1, 1), stamps())
    [(batch, record)] = a.ready(paced=False)
    assert record.admitted_groups == 1 and record.discarded == 1 and record.cancelled == 1
    assert set(np.unique(batch["session_index"][batch["response_mask"] == 1])) == {0, 1}
    assert outcomes(a)[(0, 0, 0)] == ("discarded", "admit")


def test_a_group_that_does_not_fit_beside_earlier_ones_is_cut():
    a = admission(rows=1, groups=2)  # one row of 16: two chains of 5 ids fit, four do not
    a.plan(Plan(0, (0, 1), (1, 2), 2, 0))
    for group, task in ((0, 1), (1, 2)):
        for sample in range(2):
            a.finished(session(task, group, sample, n=3), stamps())
    [(batch, record)] = a.ready(paced=False)
    assert (record.admitted_groups, record.cut_groups, record.discarded) == (1, 1, 2)
    assert batch["input_ids"].shape == (1, W)


def test_a_group_whose_chains_cannot_fit_the_rows_on_its_own_raises():
    a = admission(rows=1, groups=2)
    a.plan(Plan(0, (0,), (1,), 2, 0))
    a.finished(session(1, 0, 0, n=10), stamps())  # 12 ids: a row each
    with pytest.raises(ValueError, match=r"rows=1: .* need 2 rows of width 16 on their own"):
        a.finished(session(1, 0, 1, n=10), stamps())


def test_placement_runs_only_when_a_batch_has_more_chains_than_rows(monkeypatch):
    """k chains always fit k rows, so below that count admission skips first-fit (a Python
    loop over the batch per completed group); above it, the placement decides as before."""
    import dew_pipe.stages.admission as module

    calls = []

    def counted(lengths, width):
        calls.append(len(lengths))
        return module.rows_needed.__wrapped__(lengths, width)

    counted.__wrapped__ = module.rows_needed
    monkeypatch.setattr(module, "rows_needed", counted)
    a = admission(rows=4, groups=2)  # two groups of two one-chain sessions: 4 chains, 4 rows
    a.plan(Plan(0, (0, 1), (1, 2), 2, 0))
    for group, task in ((0, 1), (1, 2)):
        for sample in range(2):
            a.finished(session(task, group, sample, n=3), stamps())
    [(_, record)] = a.ready(paced=False)
    assert record.admitted_groups == 2 and calls == []
    b = admission(rows=1, groups=2)  # the cut case above: 2 then 4 chains for one row
    b.plan(Plan(0, (0, 1), (1, 2), 2, 0))
    for group, task in ((0, 1), (1, 2)):
        for sample in range(2):
            b.finished(session(task, group, sample, n=3), stamps())
    [(_, record)] = b.ready(paced=False)
    assert (record.admitted_groups, record.cut_groups) == (1, 1) and calls == [2, 2, 2, 4]


def test_completed_without_reward_raises_naming_the_session():
    a = admission()
    a.plan(Plan(0, (0,), (1,), 2, 0))
    with pytest.raises(ValueError, match="task 1, group 0, sample 0.*has no reward"):
        a.finished(session(1, 0, 0, reward=None), stamps())


def test_a_session_nobody_submitted_is_refused():
    a = admission()
    with pytest.raises(ValueError, match="never submitted"):
        a.finished(session(1, 0, 0), stamps())


def test_batches_wait_for_their_handover_and_go_out_in_order():
    a = admission()
    a.handover(Handover(0, version=0, served=0))  # may arrive before the plan
    for b in (0, 1):
        a.plan(Plan(b, (b,), (b,), 2, 0))
    for sample in range(2):
        a.finished(session(1, 1, sample), stamps(batch=1))
    assert a.ready(paced=True) == []  # batch 1 is complete but batch 0 is not
    for sample in range(2):
        a.finished(session(0, 0, sample), stamps(batch=0))
    assert [r.batch for _, r in a.ready(paced=True)] == [0]
    a.handover(Handover(1, version=1, served=1))
    assert [r.batch for _, r in a.ready(paced=True)] == [1]


def test_shutdown_decides_every_open_ticket_once():
    a = admission()
    a.plan(Plan(0, (0,), (1,), 2, 0))
    a.finished(session(1, 0, 0), stamps())
    a.shutdown("closed")
    assert outcomes(a) == {(0, 0, 0): ("discarded", "closed"), (0, 1, 0): ("cancelled", "closed")}
    assert a.totals["submitted"] == 2 == a.totals["discarded"] + a.totals["cancelled"]
