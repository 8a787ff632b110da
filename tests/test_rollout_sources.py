"""PromptSource: one draw per sample, scored on a thread pool, with a status for every end.

Statuses, failures and cancellation run against a scripted server whose draws the test
resolves by hand; the last test runs the source over the native server (greedy bfloat16,
an EOS pair chosen from `generate`'s own continuations) and prompt rows read by
`prompt_tasks`.
"""

from __future__ import annotations

import concurrent.futures as cf
import math
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from serving_helpers import (
    PROBES,
    bfloat16_model,
    choose_eos,
    greedy_references,
    tiny_model,
    until_eos,
)

from dew_pipe.data.text_columns import encode_text_column
from dew_pipe.inference import Draw, NativeRolloutServer, PromptSource, Server, ServeTask
from dew_pipe.inference.reward_function import join_ids
from dew_pipe.objectives.rl import prompt_tasks
from dew_pipe.objectives.rl.sessions import Session, SessionSource, Status, Task
from dew_pipe.sampling import Sampling

EOS = 2
TASK = Task(
    7,
    {
        "prompt": np.array([5, 6], np.int32),
        "data_source": "src",
        "ground_truth": "4 9",
        "extra_info": "{}",
    },
)


class ScriptedServer:
    """A RolloutServer whose draws stay pending until the test resolves them."""

    def __init__(self, version: int = 3) -> None:
        self.version = version
        self.requests: list[tuple[list[int], int, int, cf.Future]] = []
        self.closed = False

    def submit(self, prompt_ids, max_new_tokens, *, seed=None):
        future = cf.Future()
        self.requests.append((list(map(int, prompt_ids)), max_new_tokens, seed, future))
        return future

    def load(self, variables, version):
        self.version = version

    def close(self):
        self.closed = True


def draw(sampled, finish, version=1, prompt=(5, 6)):
    n = len(sampled)
    return Draw(
        list(prompt),
        sampled,
        -np.linspace(0.1, 0.5, n),
        finish,
        version=version,
        submitted_version=3,
        log_probs=-np.linspace(0.2, 0.9, n),
    )


class Recorder:
    """A reward that records its arguments and the thread it ran on."""

    def __init__(self, value=1.0) -> None:
        self.value = value
        self.calls: list[tuple[str, str, str, str]] = []
        self.threads: list[str] = []

    def __call__(self, data_source, completion, ground_truth, extra_info):
        self.calls.append((data_source, completion, ground_truth, extra_info))
        self.threads.append(threading.current_thread().name)
        return self.value(completion) if callable(self.value) else self.value


@pytest.fixture
def scripted():
    server, reward = ScriptedServer(), Recorder(lambda text: float(text == "4 9"))
    source = PromptSource(server, reward, max_new_tokens=4, workers=2)
    yield server, reward, source
    source.close()


# ------------------------------------------------------------------ statuses


def test_eos_completes_the_budget_truncates_and_both_are_scored(scripted):
    server, reward, source = scripted
    assert isinstance(source, SessionSource)
    stopped = source.submit(TASK, group=1, sample=0, attempt=0)
    truncated = source.submit(TASK, group=1, sample=1, attempt=2)
    assert [r[:2] for r in server.requests] == [([5, 6], 4), ([5, 6], 4)]
    d1, d2 = draw([4, 9, EOS], "stop", version=1), draw([4, 9, 9, 9], "length", version=2)
    server.requests[0][3].set_result(d1)
    server.requests[1][3].set_result(d2)
    s1, s2 = stopped.result(timeout=10), truncated.result(timeout=10)
    assert (s1.status, s1.reward, s1.task, s1.group, s1.sample, s1.attempt) == (
        Status.COMPLETED,
        1.0,
        7,
        1,
        0,
        0,
    )
    assert (s2.status, s2.reward, s2.sample, s2.attempt) == (Status.TRUNCATED, 0.0, 1, 2)
    assert s1.calls == (d1.call(),) and s2.calls == (d2.call(),)
    assert (s1.calls[0].version, s2.calls[0].version) == (1, 2)  # the draws' oldest versions
    # Built without re-running Session's checks: the record they would have made.
    for got in (s1, s2):
        checked = Session(got.task, got.group, got.sample, got.attempt, got.calls, got.status,
                          got.reward, {}, "")  # fmt: skip
        assert got == checked and vars(got) == vars(checked)
        assert type(got.reward) is float and type(got.group) is int and got.components == {}
    # The reward reads the task's metadata and the text without the EOS that ended the draw.
    assert sorted(reward.calls) == [("src", "4 9", "4 9", "{}"), ("src", "4 9 9 9", "4 9", "{}")]
    assert all(name.startswith("prompt-reward") for name in reward.threads)


def test_interleaved_tasks_each_draw_and_score_their_own_prompt(scripted):
    """A task is read once for a run of its samples; another task in between is read
    afresh, and each session keeps its own task's prompt and metadata."""
    server, reward, source = scripted
    other = Task(8, {"prompt": np.array([3], np.int32), "ground_truth": "1", "extra_info": "x"})
    futures = [
        source.submit(task, group=g, sample=k, attempt=0)
        for task, g, k in ((TASK, 1, 0), (TASK, 1, 1), (other, 2, 0), (TASK, 1, 2))
    ]
    assert [r[0] for r in server.requests] == [[5, 6], [5, 6], [3], [5, 6]]
    for (prompt, *_, future), sampled in zip(server.requests, ([4], [5], [1], [4]), strict=True):
        future.set_result(draw(sampled, "length", prompt=prompt))
    sessions = [f.result(timeout=10) for f in futures]
    assert [s.task for s in sessions] == [7, 7, 8, 7]
    assert [s.calls[0].prompt_ids.tolist() for s in sessions] == [[5, 6], [5, 6], [3], [5, 6]]
    assert sorted(reward.calls) == [
        ("", "1", "1", "x"),
        ("src", "4", "4 9", "{}"),
        ("src", "4", "4 9", "{}"),
        ("src", "5", "4 9", "{}"),
    ]
    with pytest.raises(TypeError, match="expected a sessions.Task"):
        source.submit({"prompt": [1]}, group=3, sample=0, attempt=0)


def test_a_failed_draw_is_an_infrastructure_error(scripted):
    server, reward, source = scripted
    future = source.submit(TASK, group=0, sample=0, attempt=1)
    server.requests[0][3].set_exception(RuntimeError("engine down"))
    session = future.result(timeout=10)
    assert session.status is Status.INFRA_ERROR and session.reward is None
    assert session.calls == () and session.attempt == 1
    assert session.detail == "draw failed: RuntimeError: engine down"
    assert reward.calls == []


def test_a_draw_with_non_finite_likelihoods_is_an_infrastructure_error(scripted):
    server, reward, source = scripted
    future = source.submit(TASK, group=0, sample=0, attempt=0)
    broken = Draw([5, 6], [4, EOS], [-0.1, np.nan], "stop", 1, 1)
    server.requests[0][3].set_result(broken)
    session = future.result(timeout=10)
    assert session.status is Status.INFRA_ERROR and session.calls == ()
    assert session.detail.startswith("draw failed: ValueError: Call.behavior_log_probs")
    assert reward.calls == []


def _raises(*args):
    raise KeyError("no verifier")


@pytest.mark.parametrize(
    "value, detail",
    [
        (_raises, "reward failed: KeyError: 'no verifier'"),
        (lambda *a: math.nan, "reward failed: ValueError: reward returned nan; expected a finite"),
        (lambda *a: -math.inf, "reward failed: ValueError: reward returned -inf"),
        (lambda *a: True, "reward failed: TypeError: reward returned True"),
        (lambda *a: "1.0", "reward failed: TypeError: reward returned '1.0'"),
    ],
)
def test_a_failed_reward_is_an_infrastructure_error_that_keeps_the_call(value, detail):
    server = ScriptedServer()
    with PromptSource(server, value, max_new_tokens=4) as source:
        future = source.submit(TASK, group=0, sample=0, attempt=0)
        sampled = draw([4, EOS], "stop")
        server.requests[0][3].set_result(sampled)
        session = future.result(timeout=10)
    assert session.status is Status.INFRA_ERROR and session.reward is None
    assert session.calls == (sampled.call(),)
    assert session.detail.startswith(detail)


def test_decode_turns_ids_into_the_completion_and_must_return_text():
    server = ScriptedServer()
    words = {4: "four", 9: "nine"}
    reward = Recorder()
    with PromptSource(
        server, reward, decode=lambda ids: " ".join(words[int(i)] for i in ids), max_new_tokens=4
    ) as source:
        good = source.submit(TASK, group=0, sample=0, attempt=0)
        server.requests[0][3].set_result(draw([4, 9, EOS], "stop"))
        assert good.result(timeout=10).status is Status.COMPLETED
    assert reward.calls[0][1] == "four nine"
    server = ScriptedServer()
    with PromptSource(server, reward, decode=lambda ids: ids, max_new_tokens=4) as source:
        bad = source.submit(TASK, group=0, sample=0, attempt=0)
        server.requests[0][3].set_result(draw([4, EOS], "stop"))
        session = bad.result(timeout=10)
    assert session.status is Status.INFRA_ERROR
    assert session.detail.startswith("reward failed: TypeError: decode returned ndarray")


def test_each_draw_is_scored_as_it_finishes_on_the_pool(scripted):
    server, _, _ = scripted
    release = threading.Event()
    order: list[str] = []

    def slow_reward(data_source, completion, ground_truth, extra_info):
        if completion == "1":
            release.wait(10)  # the first draw's verifier is still running...
        order.append(completion)
        return 0.0

    with PromptSource(server, slow_reward, max_new_tokens=4, workers=2) as source:
        first = source.submit(TASK, group=0, sample=0, attempt=0)
        second = source.submit(TASK, group=0, sample=1, attempt=0)
        third = source.submit(TASK, group=0, sample=2, attempt=0)
        server.requests[-3][3].set_result(draw([1], "length"))
        server.requests[-2][3].set_result(draw([2], "length"))
        # ...while the second one is scored and resolved, and the third still draws.
        assert second.result(timeout=10).reward == 0.0
        assert not first.done() and not third.done()
        release.set()
        assert first.result(timeout=10).status is Status.TRUNCATED
        server.requests[-1][3].set_result(draw([3], "length"))
        third.result(timeout=10)
    assert order == ["2", "1", "3"]


def test_a_wave_of_finished_draws_is_scored_by_at_most_workers_jobs():
    """Draws finishing together queue for the pool's jobs, each of which scores until the
    queue is empty; a draw finishing after every job has ended starts a new one."""
    server, running, peak = ScriptedServer(), [0], [0]
    lock = threading.Lock()

    def reward(data_source, completion, ground_truth, extra_info):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        threading.Event().wait(0.002)
        with lock:
            running[0] -= 1
        return float(completion)

    with PromptSource(server, reward, max_new_tokens=4, workers=3) as source:
        futures = [source.submit(TASK, group=0, sample=k, attempt=0) for k in range(60)]
        for k, (*_, future) in enumerate(server.requests):
            future.set_result(draw([k], "length"))
        assert [f.result(timeout=30).reward for f in futures] == [float(k) for k in range(60)]
        assert peak[0] <= 3 and len(source._pool._threads) <= 3
        assert source._drainers == 0 and not source._arrived  # every job ended
        late = source.submit(TASK, group=1, sample=0, attempt=0)
        server.requests[-1][3].set_result(draw([7], "length"))
        assert late.result(timeout=10).reward == 7.0


# ------------------------------------------------------------------ cancel and close


def test_cancel_stops_the_draw_and_resolves_cancelled(scripted):
    server, reward, source = scripted
    future = source.submit(TASK, group=0, sample=0, attempt=0)
    source.cancel(future)
    session = future.result(timeout=1)
    assert session.status is Status.CANCELLED and session.calls == () and session.reward is None
    assert server.requests[0][3].cancelled()  # the server drops the draw
    done = source.submit(TASK, group=0, sample=1, attempt=0)
    server.requests[1][3].set_result(draw([4, 9, EOS], "stop"))
    assert done.result(timeout=10).status is Status.COMPLETED
    source.cancel(done)  # a finished session is left alone
    source.cancel(cf.Future())  # so is a future the source never made
    assert done.result().status is Status.COMPLETED
    assert len(reward.calls) == 1


def test_cancel_while_the_reward_runs_drops_its_result():
    server = ScriptedServer()
    entered, release = threading.Event(), threading.Event()

    def reward(*args):
        entered.set()
        release.wait(10)
        return 1.0

    with PromptSource(server, reward, max_new_tokens=4) as source:
        future = source.submit(TASK, group=0, sample=0, attempt=0)
        server.requests[0][3].set_result(draw([4, EOS], "stop"))
        assert entered.wait(10)
        source.cancel(future)
        release.set()
        assert future.result(timeout=10).status is Status.CANCELLED


def test_close_cancels_what_is_pending_and_refuses_new_work(scripted):
    server, _, source = scripted
    futures = [source.submit(TASK, group=0, sample=s, attempt=0) for s in range(3)]
    source.close()
    assert [f.result(timeout=1).status for f in futures] == [Status.CANCELLED] * 3
    assert all(r[3].cancelled() for r in server.requests)
    assert not server.closed  # the server may be shared; its owner closes it
    with pytest.raises(RuntimeError, match="PromptSource is closed"):
        source.submit(TASK, group=0, sample=0, attempt=0)


# ------------------------------------------------------------------ seeds and bad input


def test_seeds_are_fixed_by_the_submission_identity(scripted):
    server, _, source = scripted
    for group, sample, attempt in [(0, 0, 0), (0, 0, 0), (0, 1, 0), (0, 0, 1), (1, 0, 0)]:
        source.submit(TASK, group=group, sample=sample, attempt=attempt)
    seeds = [r[2] for r in server.requests]
    assert seeds[0] == seeds[1] and len(set(seeds[1:])) == 4
    assert all(0 <= s < 2**32 for s in seeds)
    other = PromptSource(server, Recorder(), max_new_tokens=4, seed=1)
    other.submit(TASK, group=0, sample=0, attempt=0)
    assert server.requests[-1][2] != seeds[0]
    other.close()


def test_bad_tasks_and_settings_are_refused(scripted):
    server, reward, source = scripted
    with pytest.raises(TypeError, match="expected a sessions.Task"):
        source.submit({"prompt": [1]}, group=0, sample=0, attempt=0)
    with pytest.raises(ValueError, match="expected 'prompt' ids"):
        source.submit(Task(1, {"ids": [1]}), group=0, sample=0, attempt=0)
    with pytest.raises(TypeError, match=r"data\['ground_truth'\] is 3; expected a str"):
        source.submit(Task(1, {"prompt": [1], "ground_truth": 3}), group=0, sample=0, attempt=0)
    with pytest.raises(TypeError, match="prompt has dtype float"):
        source.submit(Task(1, [1.0, 2.0]), group=0, sample=0, attempt=0)
    with pytest.raises(ValueError, match="sample is -1"):
        source.submit(TASK, group=0, sample=-1, attempt=0)
    assert server.requests == []
    with pytest.raises(TypeError, match="expected a RolloutServer"):
        PromptSource(object(), reward, max_new_tokens=4)
    with pytest.raises(TypeError, match="reward is 3"):
        PromptSource(server, 3, max_new_tokens=4)
    with pytest.raises(ValueError, match="max_new_tokens is 0"):
        PromptSource(server, reward, max_new_tokens=0)
    with pytest.raises(ValueError, match="workers is 0"):
        PromptSource(server, reward, max_new_tokens=4, workers=0)


def test_a_server_that_refuses_the_request_breaks_the_source():
    class Closed(ScriptedServer):
        def submit(self, prompt_ids, max_new_tokens, *, seed=None):
            raise RuntimeError("the rollout server is closed")

    with PromptSource(Closed(), Recorder(), max_new_tokens=4) as source:
        with pytest.raises(RuntimeError, match="rollout server is closed"):
            source.submit(TASK, group=0, sample=0, attempt=0)
        assert source._pending == {}


class BatchScripted(ScriptedServer):
    """A scripted server that also takes a batch of draws in one call."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[int] = []

    def submit_many(self, prompts, max_new_tokens, *, seeds=None):
        self.batches.append(len(prompts))
        seeds = [None] * len(prompts) if seeds is None else seeds
        return [self.submit(p, max_new_tokens, seed=s) for p, s in zip(prompts, seeds, strict=True)]


OTHER = Task(8, {"prompt": np.array([3], np.int32), "ground_truth": "1", "extra_info": "x"})
REQUESTS = [(TASK, 1, 0, 0), (OTHER, 2, 0, 0), (TASK, 1, 1, 2)]


@pytest.mark.parametrize("batched", [True, False], ids=["submit_many", "one-by-one"])
def test_submit_many_is_submit_in_order(batched):
    """One server call when the server takes batches, else one submit each; either way the
    prompts, budgets and seeds are those of the same submits in order."""
    single, many = ScriptedServer(), BatchScripted() if batched else ScriptedServer()
    reward = Recorder(lambda text: float(text == "4 9"))
    with (
        PromptSource(single, reward, max_new_tokens=4) as one,
        PromptSource(many, reward, max_new_tokens=4) as both,
    ):
        for task, group, sample, attempt in REQUESTS:
            one.submit(task, group=group, sample=sample, attempt=attempt)
        futures = both.submit_many(REQUESTS)
        assert [r[:3] for r in many.requests] == [r[:3] for r in single.requests]
        assert [r[0] for r in many.requests] == [[5, 6], [3], [5, 6]]
        if batched:
            assert many.batches == [3]
        for (prompt, *_, future), sampled in zip(
            many.requests, ([4, 9, EOS], [1], [7]), strict=True
        ):
            future.set_result(
                draw(sampled, "stop" if sampled[-1] == EOS else "length", prompt=prompt)
            )
        sessions = [f.result(timeout=10) for f in futures]
        assert both.submit_many([]) == []
    assert [(s.task, s.group, s.sample, s.attempt) for s in sessions] == [
        (t.id, g, k, a) for t, g, k, a in REQUESTS
    ]
    assert [s.status for s in sessions] == [Status.COMPLETED, Status.TRUNCATED, Status.TRUNCATED]
    assert [s.reward for s in sessions] == [1.0, 0.0, 0.0]


def test_submit_many_refuses_a_bad_request_before_submitting_any():
    server = BatchScripted()
    with PromptSource(server, Recorder(), max_new_tokens=4) as source:
        with pytest.raises(TypeError, match=r"requests\[1\] is \(7, 0\); expected a \(task"):
            source.submit_many([REQUESTS[0], (7, 0)])
        with pytest.raises(ValueError, match=r"requests\[2\]: sample is -1"):
            source.submit_many([*REQUESTS[:2], (TASK, 0, -1, 0)])
        with pytest.raises(TypeError, match=r"requests\[0\]: .*expected a sessions.Task"):
            source.submit_many([({"prompt": [1]}, 0, 0, 0)])
        assert server.requests == [] and source._pending == {}


def test_submit_many_that_the_server_refuses_breaks_the_source_and_cancels_what_it_queued():
    class Refusing(BatchScripted):
        def submit_many(self, prompts, max_new_tokens, *, seeds=None):
            raise RuntimeError("the rollout server is closed")

    class RefusesTheSecond(ScriptedServer):  # no submit_many: one submit each
        def submit(self, prompt_ids, max_new_tokens, *, seed=None):
            if self.requests:
                raise RuntimeError("the rollout server is closed")
            return super().submit(prompt_ids, max_new_tokens, seed=seed)

    for server in (Refusing(), RefusesTheSecond()):
        with PromptSource(server, Recorder(), max_new_tokens=4) as source:
            with pytest.raises(RuntimeError, match="rollout server is closed"):
                source.submit_many(REQUESTS)
            assert source._pending == {}
            assert all(r[3].cancelled() for r in server.requests)
    assert len(server.requests) == 1  # the draw queued before the refusal, now cancelled


def test_prompt_source_is_exported_where_the_spec_names_it():
    import dew_pipe.objectives.rl as rl

    assert rl.PromptSource is PromptSource
    assert join_ids(np.array([3, 14])) == "3 14"


# ------------------------------------------------------------------ on the native server


def test_prompt_rows_through_the_native_server():
    model, variables = tiny_model(0)
    served = bfloat16_model(model)
    refs = greedy_references(served, jax.tree.map(lambda x: x.astype(jnp.bfloat16), variables))
    eos, probes = choose_eos(refs)
    expected = [until_eos(refs[i], eos) for i in probes]
    answers = [join_ids(ids[:-1] if ids[-1] in eos else ids) for ids in expected]
    prompts = [PROBES[i] for i in probes]
    width = max(map(len, prompts))
    rows = {
        "prompt": np.array([[0] * (width - len(p)) + p for p in prompts], np.int32),
        "prompt_length": np.array([len(p) for p in prompts], np.int32),
        "data_source": encode_text_column(["probe"] * 3),
        "ground_truth": encode_text_column([answers[0], "wrong", answers[2]]),
        "extra_info": encode_text_column(["", "", ""]),
        "task_id": np.array([10, 11, 12]),
    }
    server = NativeRolloutServer(
        Server.from_task(
            ServeTask(model, variables, Sampling(eos_id=eos, temperature=0)),
            slots=2,
            capacity=24,
            dtype=jnp.bfloat16,
            steps_per_call=4,
        )
    )

    def exact(data_source, completion, ground_truth, extra_info):
        assert data_source == "probe"
        return float(completion == ground_truth)

    try:
        with PromptSource(server, exact, max_new_tokens=8) as source:
            tasks = prompt_tasks(rows)
            futures = [
                source.submit(task, group=g, sample=s, attempt=0)
                for g, task in enumerate(tasks)
                for s in range(2)
            ]
            sessions = [f.result(timeout=120) for f in futures]
    finally:
        server.close()
    for k, session in enumerate(sessions):
        i = k // 2
        assert session.task == 10 + i and session.group == i and session.sample == k % 2
        assert session.status is (Status.TRUNCATED if i == 2 else Status.COMPLETED)
        assert session.reward == (0.0 if i == 1 else 1.0)
        (call,) = session.calls
        assert call.sampled_ids.tolist() == expected[i] and call.version == 0
        assert call.finish_reason == ("length" if i == 2 else "stop")
        np.testing.assert_array_equal(call.behavior_log_probs, 0.0)
        assert call.log_probs is not None and np.all(call.log_probs < 0)


@pytest.mark.slow
def test_the_scheduler_trains_on_prompt_source_sessions_and_pushes_to_the_native_server():
    import itertools

    import optax

    from dew_pipe import Dataset, Trainer
    from dew_pipe.objectives.rl import GRPOObjective, RolloutScheduler

    model, variables = tiny_model(0)
    objective = GRPOObjective(model, seq_len=15, pretrained=variables, behavior_importance=2.0)
    server = NativeRolloutServer(
        Server.from_task(
            ServeTask(model, variables, Sampling(eos_id=2, temperature=1.0)), slots=8, capacity=16
        )
    )
    source = PromptSource(
        server, lambda ds, text, gt, extra: float(text.count(gt)), max_new_tokens=8
    )
    rows = {
        "prompt": np.array([[0, 5, 9, 3], [7, 1, 4, 6]], np.int32),
        "prompt_length": np.array([3, 4], np.int32),
        "data_source": encode_text_column(["x", "x"]),
        "ground_truth": encode_text_column(["7", "9"]),
        "extra_info": encode_text_column(["", ""]),
    }
    data = Dataset(train=lambda p: itertools.repeat(rows), val=None, records=2, batch=2)
    records = []
    scheduler = RolloutScheduler(
        objective,
        source,
        server,
        width=16,
        rows=8,
        groups=4,
        tasks=prompt_tasks,
        truncation="score",
        log=records.append,
    )
    try:
        trainer = Trainer(objective, optax.adam(1e-2), key=jax.random.key(0), rollout=scheduler)
        state = trainer.fit(scheduler.tasks(data), steps=4, log_every=2)
    finally:
        scheduler.close()
        source.close()
        server.close()
    counters = server.counters()
    assert int(state.updates) == 4 and len(records) == 4
    assert counters.reloads == sum(r.pushed for r in records) >= 3
    assert counters.version == records[-1].served == 3
    for record in records:
        assert record.admitted_groups == 2 and record.admitted_sessions == 8
        assert record.lag is not None and 0 <= record.lag <= 1
    assert counters.finished >= 32
