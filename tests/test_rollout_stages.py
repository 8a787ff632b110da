"""The RL stages one by one, and wired by hand in a user's pipeline without a trainer."""

import dataclasses
import threading
from concurrent.futures import Future

import numpy as np
import pytest
from rollout_fakes import FakeObjective, FakeSource, FakeState, FakeWeights, Outcome, task_data

from dew_pipe.batches import TASKS_SCHEMA, packed_from_arrow, packed_schema, packed_to_arrow
from dew_pipe.data.dataset import Dataset
from dew_pipe.flow import BuildError, Pipeline, Sink, Source, StageFailed
from dew_pipe.objectives.rl.session_arrow import task_from_row, task_row
from dew_pipe.objectives.rl.sessions import Call, Session, Task, pack
from dew_pipe.stages import (
    Pack,
    Rescore,
    Reward,
    Rollout,
    TaskBatches,
    Train,
    grpo_pipeline,
    publish,
)
from dew_pipe.stages.graph import GraphSettings, build_graph, task_batch
from dew_pipe.stages.handoff import Pushes
from dew_pipe.stages.messages import (
    SESSION_ROWS,
    Proximal,
    SchedulerRecord,
    Stamps,
    stamp_sessions,
    unstamp_sessions,
)

W = 16


def _session(reward=None, status="COMPLETED", task=3):
    return Session(task, 0, 0, 0, [Call([1, 2], [5, 6], [-0.1, -0.2], "stop", 0)], status, reward)


def test_stamps_and_tasks_round_trip_through_arrow():
    tasks = [Task(1), Task(2, {"prompt": np.array([4, 5], np.int32), "ground_truth": "9"})]
    rows = [task_row(t) for t in tasks]
    back = [task_from_row(r) for r in rows]
    assert back[0] == Task(1, None)
    assert back[1].data["prompt"].tolist() == [4, 5] and back[1].data["ground_truth"] == "9"
    sessions = [_session(1.0, task=1), _session(0.5, "TRUNCATED", task=2)]
    stamps = [Stamps(0, 3, 0.25, "", tasks[0]), Stamps(1, 4, 0.5, "timeout", tasks[1])]
    rb = stamp_sessions(sessions, stamps)
    assert rb.schema.names[: len(SESSION_ROWS.names) - 8] == SESSION_ROWS.names[:8]
    got, got_stamps = unstamp_sessions(rb)
    assert got == sessions
    assert [(s.batch, s.submitted_version, s.latency, s.cause) for s in got_stamps] == [
        (0, 3, 0.25, ""),
        (1, 4, 0.5, "timeout"),
    ]
    assert got_stamps[1].task.data["prompt"].tolist() == [4, 5]
    # Without the tasks (what pack reads): the same sessions and stamps, no Task built.
    bare, bare_stamps = unstamp_sessions(rb, tasks=False)
    assert bare == sessions and [s.task for s in bare_stamps] == [None, None]
    assert [dataclasses.replace(s, task=None) for s in got_stamps] == bare_stamps
    with pytest.raises(TypeError, match="Task.data of task 5 is a list"):
        task_row(Task(5, [1, 2]))
    with pytest.raises(ValueError, match="has key 'answer'"):
        task_row(Task(5, {"answer": "1"}))


def test_reward_scores_unscored_sessions_and_turns_failures_into_infra_errors():
    def score(task, session):
        if task.data["ground_truth"] == "crash":
            raise RuntimeError("sandbox gone")
        if task.data["ground_truth"] == "nan":
            return float("nan")
        return 1.0, {"format": 0.5}

    tasks = [Task(1, {"ground_truth": g}) for g in ("ok", "crash", "nan", "ok")]
    sessions = [_session(None, task=1) for _ in range(3)] + [_session(0.25, task=1)]
    rb = stamp_sessions(sessions, [Stamps(0, 0, 0.1, "", t) for t in tasks])
    stage = Reward(score, workers=2)
    out, _ = unstamp_sessions(stage.apply(rb))
    assert (out[0].reward, out[0].components) == (1.0, {"format": 0.5})
    assert out[1].status.name == "INFRA_ERROR" and "sandbox gone" in out[1].detail
    assert out[2].status.name == "INFRA_ERROR" and "expected a finite float" in out[2].detail
    assert out[3].reward == 0.25  # scored by the source: left alone
    assert (stage.scored, stage.failed) == (3, 2)
    assert Reward().apply(rb) is rb  # without a score function: passed through


def test_rescore_replaces_old_log_probs_on_sampled_ids_only():
    sessions = [_session(float(k), task=1 + k) for k in range(2)]  # two sessions, not one twice
    columns = pack(sessions, W, rows=2)
    rb = packed_to_arrow(columns)
    got = []
    p = Pipeline("rescore")
    p.add(Source("rows", [rb], output_type=packed_schema(W)))
    p.add(Source("params", [Proximal(0, 7, 3.0)], output_type=Proximal))
    p.add(Rescore(lambda params, cols: -params * cols["input_ids"], width=W))
    p.add(Sink("keep", got.append, input_type=packed_schema(W)))
    p.connect("rows", "rescore.rows", capacity=1)
    p.connect("params", "rescore.params", capacity=1)
    p.connect("rescore", "keep", capacity=1)
    p.run(timeout=10)
    out = packed_from_arrow(got[0])
    mask = columns["response_mask"] == 1
    np.testing.assert_array_equal(out["old_log_probs"][mask], -3.0 * columns["input_ids"][mask])
    assert np.all(out["old_log_probs"][~mask] == 0)
    np.testing.assert_array_equal(out["behavior_log_probs"], columns["behavior_log_probs"])


def test_publish_pushes_only_when_due_and_refuses_a_push_that_does_not_land():
    weights = FakeWeights(version=3)
    assert publish(weights, {}, 4, sync_every=2) == (3, False, 0.0)
    served, pushed, _ = publish(weights, {}, 5, sync_every=2)
    assert (served, pushed, weights.pushes) == (5, True, [5])
    served, pushed, _ = publish(weights, {}, 2, sync_every=2)  # a restore to an older state
    assert (served, pushed) == (2, True)
    stuck = FakeWeights(stuck=True)
    with pytest.raises(RuntimeError, match=r"load\(params, 1\) left the served version at 0"):
        publish(stuck, {}, 1, sync_every=1)
    assert stuck.pushes == [1, 1]


class FuturePublisher:
    """A publisher whose pushes return futures the test resolves (as a server's do)."""

    def __init__(self) -> None:
        self.version, self.futures = 0, []

    def load(self, params, version):
        self.version = version
        self.futures.append(Future())
        return self.futures[-1]


def test_a_push_returning_a_future_is_not_waited_for_but_checked_at_the_next():
    weights, pushes = FuturePublisher(), Pushes()
    assert publish(weights, {}, 1, 1, pushes)[:2] == (1, True)
    assert not weights.futures[0].done()  # returned while the push was still in flight
    weights.futures[0].set_result(1)
    assert publish(weights, {}, 2, 1, pushes)[:2] == (2, True)
    weights.futures[1].set_exception(OSError("device lost"))
    with pytest.raises(RuntimeError, match="push of version 2 failed") as info:
        publish(weights, {}, 3, 1, pushes)  # the failure surfaces at the next push
    assert isinstance(info.value.__cause__, OSError) and len(weights.futures) == 2
    publish(weights, {}, 3, 1, pushes)
    weights.futures[2].set_exception(OSError("gone"))
    with pytest.raises(RuntimeError, match="push of version 3 failed"):
        pushes.settle()  # and at the end of the stream
    pushes.settle()  # nothing left in flight


def test_without_a_tracker_publish_waits_for_the_push():
    weights = FuturePublisher()
    done = threading.Timer(0.2, lambda: weights.futures[0].set_result(1))
    done.start()
    _, pushed, seconds = publish(weights, {}, 1, 1)
    assert pushed and weights.futures[0].done() and seconds >= 0.15
    weights.version = 1
    failing = threading.Timer(0.1, lambda: weights.futures[1].set_exception(OSError("x")))
    failing.start()
    with pytest.raises(RuntimeError, match="push of version 2 failed"):
        publish(weights, {}, 2, 1)


def _standalone(source, tasks, *, groups=2, rows=4, score=None):
    """A user's graph without trainer: tasks -> rollout -> reward -> pack -> sinks."""
    got, records = [], []
    p = Pipeline("user-graph")
    p.add(Source("tasks", [task_batch(t) for t in tasks], output_type=TASKS_SCHEMA))
    p.add(Rollout(source, groups=groups))
    p.add(Reward(score))
    p.add(Pack(width=W, rows=rows, groups=groups))
    p.add(Sink("keep", got.append, input_type=packed_schema(W)))
    p.add(Sink("records", records.append, input_type=SchedulerRecord))
    p.connect("tasks", "rollout.tasks", capacity=2)
    p.connect("rollout.sessions", "reward", capacity=4)
    p.connect("rollout.plans", "pack.plans", capacity=4)
    p.connect("reward", "pack.sessions", capacity=4)
    p.connect("pack.rows", "keep", capacity=2)
    p.connect("pack.records", "records", capacity=2)
    p.connect("pack.orders", "rollout.orders", capacity=16, feedback=True)
    return p, got, records


def test_stages_wired_by_hand_run_to_the_end_with_retries_over_the_feedback_edge():
    weights = FakeWeights()
    # every sample fails once (the verifier is down on attempt 0), then succeeds
    source = FakeSource(weights, lambda s: Outcome(delay=0.002, reward=None))
    tasks = [[Task(i), Task(i + 10)] for i in range(3)]

    def score(task, session):
        if session.attempt == 0:
            raise ConnectionError("verifier down")
        return float(session.sample)

    p, got, records = _standalone(source, tasks, score=score)
    snapshot = p.run(timeout=30)  # ends once the retry cycle has drained
    source.close()
    assert len(got) == 3 and [r.batch for r in records] == [0, 1, 2]
    for record in records:
        assert record.resubmitted == {"infra_error": 4} and record.admitted_sessions == 4
        assert record.accounted == record.submitted == 8 and record.version is None
    assert len(source.submitted) == 24
    assert snapshot.dropped == 0


class BatchSource(FakeSource):
    """A FakeSource that also takes a list of submissions in one call."""

    def __init__(self, *args, reply=None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[int] = []
        self.reply = reply

    def submit_many(self, requests):
        self.calls.append(len(requests))
        futures = [
            self.submit(task, group=group, sample=sample, attempt=attempt)
            for task, group, sample, attempt in requests
        ]
        return futures if self.reply is None else self.reply(futures)


def test_a_source_with_submit_many_gets_each_batch_and_each_order_in_one_call():
    def script(s):  # attempt 0 of odd samples fails: pack orders them again
        return Outcome(
            delay=0.002,
            status="INFRA_ERROR" if s.attempt == 0 and s.sample % 2 else "COMPLETED",
            reward=1.0,
        )

    runs = {}
    for name, source in (
        ("one-by-one", FakeSource(FakeWeights(), script)),
        ("many", BatchSource(FakeWeights(), script)),
    ):
        tasks = [[Task(i), Task(i + 10)] for i in range(3)]
        p, got, records = _standalone(source, tasks)
        p.run(timeout=30)
        source.close()
        runs[name] = (source, got, records)
    single, many = runs["one-by-one"][0], runs["many"][0]
    ordered = lambda src: sorted((r.task, r.sample, r.attempt) for r in src.submitted)  # noqa: E731
    assert ordered(single) == ordered(many) and len(many.submitted) == 18
    # each batch of 2 tasks x 2 samples in one call, then each order's resubmissions
    assert many.calls[:1] == [4] and sum(many.calls) == 18 and len(many.calls) < 18
    assert [r.admitted_sessions for r in runs["many"][2]] == [4, 4, 4]
    assert [r.resubmitted for r in runs["many"][2]] == [
        r.resubmitted for r in runs["one-by-one"][2]
    ]


@pytest.mark.parametrize(
    "reply, message",
    [
        (lambda futures: futures[:-1], "returned a list of 3 for 4 requests"),
        (tuple, "returned a tuple for 4 requests"),
        (lambda futures: [*futures[:-1], "done"], "returned a str for task 10"),
    ],
)
def test_a_submit_many_that_answers_wrongly_stops_the_rollout_naming_it(reply, message):
    source = BatchSource(FakeWeights(), reply=reply)
    p, _, _ = _standalone(source, [[Task(0), Task(10)]])
    with pytest.raises(StageFailed, match=message):
        p.run(timeout=30)
    source.close()


def _emitted(script, tasks, **options):
    """Session batches a lone Rollout puts out, with the seconds after the start each came."""
    import time

    source = FakeSource(FakeWeights(), script)
    got, start = [], time.monotonic()
    p = Pipeline("emit")
    p.chain(
        Source("tasks", [task_batch(t) for t in tasks], output_type=TASKS_SCHEMA),
        Rollout(source, groups=4, **options),
        Sink(
            "keep", lambda rb: got.append((time.monotonic() - start, rb)), input_type=SESSION_ROWS
        ),
        capacity=4,
    )
    p.run(timeout=30)
    source.close()
    return [(at, [(s.task, s.sample) for s in unstamp_sessions(rb)[0]]) for at, rb in got]


def staggered(s):  # samples of a task finish one after another; task 2 starts later
    return Outcome(delay=0.01 * (s.sample + 1) + (0.3 if s.task == 2 else 0.0))


def test_finished_sessions_go_out_together_once_their_task_batch_is_done():
    tasks = [[Task(0), Task(1)], [Task(2)]]
    batches = _emitted(staggered, tasks, linger=5.0)  # no linger bound: only batch ends
    # gathering up to 256 (the default): one session batch per task batch, in order
    assert [rows for _, rows in batches] == [
        [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2), (1, 3)],
        [(2, 0), (2, 1), (2, 2), (2, 3)],
    ]
    # emit_rows=1 puts out whatever finished at once: the staggered samples come apart
    each = _emitted(staggered, tasks, emit_rows=1)
    assert len(each) > 2 and sorted(r for _, rows in each for r in rows) == sorted(
        r for _, rows in batches for r in rows
    )
    # emit_rows=3: batches of three as they finish, and the rest of a task batch at its end
    threes = _emitted(staggered, [[Task(0), Task(1)]], emit_rows=3, linger=5.0)
    assert all(len(rows) >= 3 for _, rows in threes[:-1]) and len(threes) >= 2


def test_a_slow_sample_holds_the_finished_ones_back_at_most_linger_seconds():
    def slow_last(s):
        return Outcome(delay=1.5 if s.sample == 3 else 0.0)

    (first_at, first), (last_at, last) = _emitted(slow_last, [[Task(0)]], linger=0.1)
    assert first == [(0, 0), (0, 1), (0, 2)] and last == [(0, 3)]
    assert first_at < 1.0 <= last_at  # the fast three did not wait for the slow one


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(emit_rows=0), "emit_rows is 0"),
        (dict(emit_rows=2.5), "emit_rows is 2.5"),
        (dict(linger=-0.1), "linger is -0.1"),
        (dict(linger=float("nan")), "linger is nan"),
    ],
)
def test_bad_emit_options_are_refused(options, match):
    with pytest.raises((TypeError, ValueError), match=match):
        Rollout(FakeSource(FakeWeights()), groups=2, **options)


def test_a_stage_that_raises_in_a_user_graph_stops_it_naming_the_stage():
    weights = FakeWeights()
    source = FakeSource(weights, lambda s: Outcome(raises=OSError("disk full")))
    p, _, _ = _standalone(source, [[Task(1)]])
    with pytest.raises(StageFailed, match="stage 'rollout' failed.*disk full") as info:
        p.run(timeout=30)
    source.close()
    assert isinstance(info.value.__cause__, OSError)
    assert not [t for t in threading.enumerate() if t.name.startswith("flow:user-graph:")]


def test_port_types_are_checked_when_the_graph_is_built():
    p = Pipeline("mismatch")
    p.add(Pack(width=W, rows=2, groups=2))
    p.add(Sink("narrow", lambda rb: None, input_type=packed_schema(W + 1)))
    with pytest.raises(BuildError, match="field 'input_ids' is fixed_size_list<item: int32>"):
        p.connect("pack.rows", "narrow", capacity=1)


def test_task_batches_reads_a_dataset_into_task_batches():
    data = Dataset(train=lambda p: iter([{"task_id": np.array([1, 2])}]), batch=2)
    stage = TaskBatches(data, batches=3)
    assert [b.column("task_id").to_pylist() for b in stage.items()] == [[1, 2]] * 3
    empty = Dataset(train=lambda p: iter([]), batch=2)
    with pytest.raises(ValueError, match="yielded no batches"):
        list(TaskBatches(empty, batches=1).items())


class _CountingTrainer:
    """A trainer the Train stage can drive: each step bumps the version, keeps the batch."""

    def __init__(self, objective):
        self.objective = objective
        self.batches = []

    def initial_state(self):
        raise AssertionError("the state given to the pipeline is the one to start from")

    def train_step(self, state, batch):
        self.batches.append(batch)
        return FakeState(state.updates + 1, state.params), {"loss": 0.5}


def test_grpo_pipeline_trains_from_the_state_it_was_given_through_the_one_builder():
    weights = FakeWeights()
    trainer = _CountingTrainer(FakeObjective(W))
    made, logged = [], []

    def start():  # called once, when the run starts: building compiles nothing
        made.append(FakeState(0, {"scale": 2.0}))
        return made[-1]

    p = grpo_pipeline(
        tasks=TaskBatches(task_data(64, 2)), source=FakeSource(weights), weights=weights,
        trainer=trainer, score=None, width=W, rows=4, groups=2, steps=3, state=start,
        log=lambda step, metrics, record: logged.append((step, metrics["loss"], record.batch)),
    )  # fmt: skip
    assert not made and sorted(p.stages) == sorted(
        ["tasks", "rollout", "reward", "pack", "rescore", "update"]
    )
    assert isinstance(p.stages["update"], Train)
    p.run(timeout=30)
    assert len(made) == 1 and p.stages["update"].state.updates == 3
    assert logged == [(0, 0.5, 0), (1, 0.5, 1), (2, 0.5, 2)]
    assert weights.pushes == [1, 2]  # version 0 was served already; one push per update
    first = trainer.batches[0]  # rescored under the given state's scale 2: -0.2 per id
    mask = first["response_mask"] == 1
    np.testing.assert_allclose(first["old_log_probs"][mask], -0.2 * first["input_ids"][mask])


def test_until_ends_the_update_stage_and_the_run_after_the_update_it_accepts():
    weights = FakeWeights()
    trainer = _CountingTrainer(FakeObjective(W))
    logged, seen = [], []

    def until(state):  # after update 2's log, with its state: the run ends there
        seen.append((state.updates, len(logged)))
        return state.updates == 2

    p = grpo_pipeline(
        tasks=TaskBatches(task_data(64, 2)), source=FakeSource(weights), weights=weights,
        trainer=trainer, score=None, width=W, rows=4, groups=2, steps=10,
        state=FakeState(0, {"scale": 1.0}), until=until,
        log=lambda step, metrics, record: logged.append(step),
    )  # fmt: skip
    p.run(timeout=30)
    assert seen == [(1, 1), (2, 2)] and logged == [0, 1]
    assert p.stages["update"].state.updates == 2 and len(trainer.batches) == 2
    assert weights.pushes == [1]  # the stopped run pushes nothing after its last update
    with pytest.raises(TypeError, match=r"until=3; expected None or until\(state\) -> bool"):
        Train(trainer, steps=3, width=W, until=3)
    with pytest.raises(ValueError, match="until is set but trainer is None"):
        build_graph(
            GraphSettings(width=W, rows=4, groups=2), tasks=TaskBatches(task_data(8, 2)),
            source=FakeSource(weights), weights=weights, scorer=None, until=until,
        )  # fmt: skip


@pytest.mark.parametrize(
    "kw, error, message",
    [
        (dict(ahead=2), ValueError, "max_lag is 1 with ahead=2"),
        (dict(groups=1), ValueError, "groups is 1; expected an int >= 2"),
        (dict(width=W + 1), ValueError, "objective.seq_len=15 with width=17"),
        (dict(behavior_importance=None), ValueError, "max_lag=1 lets sessions lag"),
        (dict(steps=None), TypeError, "steps is None"),
    ],
)
def test_grpo_pipeline_refuses_what_the_scheduler_refuses(kw, error, message):
    weights = FakeWeights()
    objective = FakeObjective(W, behavior_importance=kw.pop("behavior_importance", 2.0))
    settings = dict(width=W, rows=4, groups=2, steps=3) | kw
    with pytest.raises(error, match=message):
        grpo_pipeline(
            tasks=TaskBatches(task_data(8, 2)), source=FakeSource(weights), weights=weights,
            trainer=_CountingTrainer(objective), score=None, **settings,
        )  # fmt: skip


def test_docstring_examples_of_the_stages_run():
    import doctest
    import importlib

    attempted = 0
    for name in ("admission", "graph", "messages", "pack", "rescore", "reward", "rollout"):
        module = importlib.import_module(f"dew_pipe.stages.{name}")
        failed, tried = doctest.testmod(module)
        assert failed == 0, name
        attempted += tried
    for name in (
        "dew_pipe.stages.handoff",
        "dew_pipe.stages.train",
        "dew_pipe.stages.protocols",
        "dew_pipe.objectives.rl.task_rows",
    ):
        failed, tried = doctest.testmod(importlib.import_module(name))
        assert failed == 0, name
        attempted += tried
    assert attempted >= 25
