"""EnvironmentSource: tool episodes as sessions, every turn a request to a RolloutServer.

The statuses, failures and cancellation run the square-tool harness of
``test_tool_episodes`` against two scripted servers that need no compile: one answers each
request at once from the harness's right script (``AutoServer``), the other leaves every
draw pending until the test resolves or cancels it (``PendingServer``). The native server's
cases (exact records, a shared batch, a Trainer through ``RolloutScheduler``) are in
``test_environment_source_native.py``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import math
import threading
import time

import numpy as np
import pytest
from test_tool_episodes import (
    BUDGET,
    CALL,
    D0,
    EOS,
    PAD,
    PROMPT,
    Q0,
    RESULT,
    TURNS,
    USER,
    Harness,
    scripted,
    verify,
)

from dew_pipe.inference import Draw, EnvironmentSource
from dew_pipe.objectives.rl import EpisodeStatus, Observation
from dew_pipe.objectives.rl.sessions import SessionSource, Status, Task


def _likelihoods(context, ids):
    """Made-up distinct raw and behavior log-probabilities of a draw."""
    raw = -0.1 * np.arange(1, len(ids) + 1, dtype=np.float32) - np.float32(0.01 * len(context))
    return raw, raw * np.float32(1.5)


class AutoServer:
    """A RolloutServer answering each request at once with ``script(context, budget)``."""

    def __init__(self, script=scripted, version: int = 2) -> None:
        self.script, self.version = script, version
        self.requests: list[tuple[list[int], int, int]] = []
        self.draws: list[Draw] = []
        self._lock = threading.Lock()

    def submit(self, prompt_ids, max_new_tokens, *, seed=None):
        context = [int(i) for i in prompt_ids]
        ids = np.asarray(self.script(context, max_new_tokens), np.int32)
        raw, behavior = _likelihoods(context, ids)
        finish = "stop" if ids[-1] == EOS else "length"
        draw = Draw(context, ids, behavior, finish, self.version, self.version, log_probs=raw)
        with self._lock:
            self.requests.append((context, max_new_tokens, seed))
            self.draws.append(draw)
        future = cf.Future()
        future.set_result(draw)
        return future

    def load(self, variables, version):
        self.version = version


class PendingServer(AutoServer):
    """A RolloutServer whose draws stay pending until the test resolves them."""

    def __init__(self) -> None:
        super().__init__()
        self.futures: list[cf.Future] = []

    def submit(self, prompt_ids, max_new_tokens, *, seed=None):
        future = cf.Future()
        with self._lock:
            self.requests.append(([int(i) for i in prompt_ids], max_new_tokens, seed))
            self.futures.append(future)
        return future

    def wait_for(self, n: int) -> cf.Future:
        deadline = time.monotonic() + 10
        while len(self.futures) < n:
            assert time.monotonic() < deadline, f"the source made {len(self.futures)} requests"
            time.sleep(0.002)
        return self.futures[n - 1]

    def answer(self, n: int, ids) -> Draw:
        future = self.wait_for(n)
        context, _, _ = self.requests[n - 1]
        raw, behavior = _likelihoods(context, ids)
        finish = "stop" if ids[-1] == EOS else "length"
        draw = Draw(context, ids, behavior, finish, self.version, self.version, log_probs=raw)
        future.set_result(draw)
        return draw


def make_source(server, harness, *, verifier=None, **kw) -> EnvironmentSource:
    settings = dict(max_prompt_tokens=PROMPT, max_new_tokens=BUDGET, max_turns=TURNS, workers=4)
    settings.update(kw)
    verifier = verifier or (lambda task, episode: verify(episode))
    return EnvironmentSource(server, lambda task, identity: harness(identity), verifier, **settings)


def run_one(source, task=None, sample=0, attempt=0, group=1):
    task = Task(2) if task is None else task
    return source.submit(task, group=group, sample=sample, attempt=attempt).result(timeout=10)


# ------------------------------------------------------------------ completed episodes


def test_a_tool_episode_completes_with_exact_calls_and_is_scored_while_open():
    server, harness, seen = AutoServer(), Harness(), []

    def verifier(task, episode):
        env = harness.environments[-1]
        seen.append((task, episode, env.entered and not env.exited))  # still open
        return verify(episode)

    with make_source(server, harness, verifier=verifier) as source:
        assert isinstance(source, SessionSource)
        session = run_one(source, Task(6, {"x": 2}), sample=3, attempt=1, group=5)
    x = 6 % 4
    assert (session.task, session.group, session.sample, session.attempt) == (6, 5, 3, 1)
    assert (session.status, session.reward, session.detail) == (Status.COMPLETED, 1.0, "13")
    # Every call is the server's draw itself: ids, both likelihoods and version.
    assert session.calls == tuple(d.call() for d in server.draws)
    first, then = [USER, Q0 + x], [USER, Q0 + x, CALL, EOS, RESULT, D0 + x * x]
    assert [r[:2] for r in server.requests] == [(first, BUDGET), (then, BUDGET)]
    assert [c.version for c in session.calls] == [2, 2]
    (task, episode, was_open), env = seen[0], harness.environments[0]
    assert task == Task(6, {"x": 2}) and was_open and env.exited and env.exit_error is None
    assert episode.status is EpisodeStatus.COMPLETED and episode.reward is None
    assert [a.tokens.tolist() for a in episode.actions] == [[CALL, EOS], [D0 + x * x, EOS]]
    np.testing.assert_array_equal(episode.actions[0].log_probs, server.draws[0].log_probs)
    assert episode.id.task == 6 and episode.id.sample == 3 and episode.id.step == 2


def test_seeds_are_fixed_by_the_submission_and_the_turn():
    server = AutoServer()
    identities = []

    def environment(task, identity):
        identities.append(identity)
        return Harness()(identity)

    verifier = lambda task, episode: verify(episode)  # noqa: E731
    with EnvironmentSource(
        server, environment, verifier, max_prompt_tokens=PROMPT, max_new_tokens=BUDGET,
        max_turns=TURNS,
    ) as source:  # fmt: skip
        for group, sample, attempt in [(0, 0, 0), (0, 0, 0), (0, 1, 0), (0, 0, 1), (1, 0, 0)]:
            run_one(source, Task(2), sample=sample, attempt=attempt, group=group)
    seeds = [r[2] for r in server.requests]
    assert seeds[0:2] == seeds[2:4] and seeds[0] != seeds[1]  # a repeat draws the same
    assert len(set(seeds[2:])) == 8 and all(0 <= s < 2**32 for s in seeds)
    episode_seeds = [i.seed for i in identities]
    assert episode_seeds[0] == episode_seeds[1] and len(set(episode_seeds[1:])) == 4


# ------------------------------------------------------------------ truncation


def test_a_budget_hit_is_truncated_scored_and_never_sent_to_the_tool():
    server, harness = AutoServer(lambda context, budget: [PAD] * budget), Harness()
    with make_source(server, harness) as source:
        session = run_one(source)
    assert session.status is Status.TRUNCATED and session.reward == 0.0
    assert session.calls == (server.draws[0].call(),) and session.calls[0].finish_reason == "length"
    assert "max_new_tokens=3 without EOS" in session.detail
    assert harness.environments[0].steps == 0 and harness.environments[0].exited


def test_a_long_context_truncates_without_being_submitted_or_cut():
    episodes = []
    server = AutoServer(lambda context, budget: [CALL, EOS])  # calls the tool again and again
    with make_source(
        server, Harness(), max_prompt_tokens=9, max_turns=5,
        record=lambda task, episode: episodes.append(episode),
    ) as source:  # fmt: skip
        session = run_one(source)
    # Contexts of 2, 6 and 10 ids: the third is longer than 9, so only two calls were made.
    assert session.status is Status.TRUNCATED and len(session.calls) == 2
    assert [len(r[0]) for r in server.requests] == [2, 6]
    assert session.detail == "the context has 10 ids, more than max_prompt_tokens=9"
    assert episodes[0].last.context.size == 10  # recorded whole


def test_max_turns_caps_the_model_calls():
    server = AutoServer(lambda context, budget: [CALL, EOS])
    with make_source(server, Harness(), max_prompt_tokens=32, max_turns=2) as source:
        session = run_one(source)
    assert session.status is Status.TRUNCATED and len(session.calls) == 2
    assert session.detail == "max_turns=2 model calls reached while the environment runs"
    assert session.reward == 0.0


# ------------------------------------------------------------------ infrastructure failures


@pytest.mark.parametrize(
    "fault, detail, calls",
    [
        ("reset", "reset() raised RuntimeError: the sandbox did not start", 0),
        ("step", "step() raised RuntimeError: the tool crashed", 1),
        ("error", "the environment reported ERROR: the tool server went away", 1),
    ],
)
def test_an_environment_that_raises_or_reports_error_is_an_infrastructure_error(
    fault, detail, calls
):
    server, harness = AutoServer(), Harness(fault=fault)
    with make_source(server, harness) as source:
        session = run_one(source)
    assert session.status is Status.INFRA_ERROR and session.reward is None
    assert session.detail == detail and len(session.calls) == calls
    env = harness.environments[0]
    assert env.exited
    if fault in ("reset", "step"):  # released under the original exception
        assert isinstance(env.exit_error, RuntimeError) and str(env.exit_error) in detail
    else:
        assert env.exit_error is None


def test_an_environment_that_reports_cancelled_ends_cancelled():
    harness = Harness(fault="cancelled")
    with make_source(AutoServer(), harness) as source:
        session = run_one(source)
    assert session.status is Status.CANCELLED and session.reward is None
    assert session.detail == "the tool server went away" and harness.environments[0].exited


@pytest.mark.parametrize("fault", ["futures-cancel", "asyncio-cancel"])
def test_a_cancellation_raised_by_the_environment_ends_cancelled(fault):
    harness = Harness(fault=fault)
    with make_source(AutoServer(), harness) as source:
        session = run_one(source)
    assert session.status is Status.CANCELLED
    kind = cf.CancelledError if fault == "futures-cancel" else asyncio.CancelledError
    assert isinstance(harness.environments[0].exit_error, kind)


def test_a_failed_release_throws_the_episode_out():
    harness = Harness(fault="release")
    with make_source(AutoServer(), harness) as source:
        session = run_one(source)
    assert session.status is Status.INFRA_ERROR and session.reward is None
    assert session.detail == (
        "releasing the environment failed: OSError: could not remove the workspace"
    )
    assert len(session.calls) == 2  # the calls it made are kept for the record


def test_bad_environments_are_infrastructure_errors():
    class Bad:
        def __init__(self, what):
            self.what = what

        def __enter__(self):
            if self.what == "enter":
                raise OSError("no workspace")
            return self

        def __exit__(self, *exc):
            self.exc = exc

        def reset(self):
            if self.what == "terminal":
                return Observation(status="completed", detail="done already")
            return Observation([USER, Q0]) if self.what == "step" else "not an observation"

        def step(self, action):
            return {"context": [1, 2]}

    def factory(task, identity):
        if task.data == "factory":
            raise ValueError("unknown task")
        return Bad(task.data)

    verifier = lambda task, episode: 0.0  # noqa: E731
    with EnvironmentSource(
        AutoServer(), factory, verifier, max_prompt_tokens=PROMPT, max_new_tokens=BUDGET,
        max_turns=TURNS,
    ) as source:  # fmt: skip
        details = {what: run_one(source, Task(0, what)).detail for what in
                   ("factory", "enter", "reset", "terminal", "step")}  # fmt: skip
        statuses = {run_one(source, Task(0, what)).status for what in details}
    assert statuses == {Status.INFRA_ERROR}
    assert details == {
        "factory": "opening the environment failed: ValueError: unknown task",
        "enter": "opening the environment failed: OSError: no workspace",
        "reset": "reset() returned str; expected an Observation",
        "terminal": "reset() returned a completed observation; expected RUNNING with the first "
        "context",
        "step": "step() returned dict; expected an Observation",
    }


def test_a_failed_draw_is_an_infrastructure_error_that_keeps_the_earlier_calls():
    server, harness = PendingServer(), Harness()
    with make_source(server, harness) as source:
        future = source.submit(Task(2), group=0, sample=0, attempt=0)
        first = server.answer(1, [CALL, EOS])
        server.wait_for(2).set_exception(RuntimeError("engine down"))
        session = future.result(timeout=10)
        assert session.status is Status.INFRA_ERROR and session.calls == (first.call(),)
        assert session.detail == "draw failed: RuntimeError: engine down"
        assert isinstance(harness.environments[0].exit_error, RuntimeError)
        broken = source.submit(Task(2), group=0, sample=1, attempt=0)
        pending = server.wait_for(3)
        pending.set_result(Draw(server.requests[2][0], [CALL, EOS], [-0.1, np.nan], "stop", 2, 2))
        session = broken.result(timeout=10)
    assert session.status is Status.INFRA_ERROR and session.calls == ()
    assert session.detail.startswith("draw failed: ValueError: Call.behavior_log_probs")


def test_a_draw_that_disagrees_with_the_served_eos_is_an_infrastructure_error():
    from dew_pipe.inference import NativeRolloutServer

    class Engine:  # what a NativeRolloutServer's Server says about itself
        capacity, sampling = 64, type("S", (), {"eos_ids": (EOS,)})()

    server = AutoServer(lambda context, budget: [CALL, EOS, CALL])  # ids after EOS
    server.server = Engine()
    assert not isinstance(server, NativeRolloutServer)
    with make_source(server, Harness()) as source:
        session = run_one(source)
    assert session.status is Status.INFRA_ERROR
    assert session.detail.startswith("draw failed: ValueError: Call.sampled_ids: 1 id(s) follow")


def _raises(task, episode):
    raise KeyError("no verifier")


@pytest.mark.parametrize(
    "verifier, detail",
    [
        (_raises, "the verifier failed: KeyError: 'no verifier'"),
        (lambda t, e: math.nan, "the verifier failed: ValueError: the verifier returned nan"),
        (lambda t, e: True, "the verifier failed: TypeError: the verifier returned True"),
        (lambda t, e: "1", "the verifier failed: TypeError: the verifier returned '1'"),
    ],
)
def test_a_verifier_crash_is_an_infrastructure_error_released_under_it(verifier, detail):
    harness = Harness()
    with make_source(AutoServer(), harness, verifier=verifier) as source:
        session = run_one(source)
    assert session.status is Status.INFRA_ERROR and session.reward is None
    assert session.detail.startswith(detail) and len(session.calls) == 2
    env = harness.environments[0]
    assert env.exited and str(env.exit_error) in session.detail


def test_a_server_that_refuses_a_turn_breaks_the_source_after_releasing():
    class Closed(AutoServer):
        def submit(self, prompt_ids, max_new_tokens, *, seed=None):
            raise RuntimeError("the rollout server is closed")

    harness = Harness()
    with make_source(Closed(), harness) as source:
        future = source.submit(Task(2), group=0, sample=0, attempt=0)
        with pytest.raises(RuntimeError, match="rollout server is closed"):
            future.result(timeout=10)
        assert source._pending == {}
    assert harness.environments[0].exited


def test_an_interrupt_in_the_environment_releases_it_and_propagates():
    harness = Harness(fault="interrupt")
    with make_source(AutoServer(), harness) as source:
        future = source.submit(Task(2), group=0, sample=0, attempt=0)
        with pytest.raises(KeyboardInterrupt):
            future.result(timeout=10)
    assert harness.environments[0].exited


def test_a_record_hook_sees_every_episode_and_a_raising_one_breaks_the_source():
    episodes = []
    with make_source(
        AutoServer(), Harness(fault="error", at=1),
        record=lambda task, episode: episodes.append((task.id, episode)),
    ) as source:  # fmt: skip
        run_one(source, sample=0)
        run_one(source, sample=1)
    assert [(t, e.status, e.reward) for t, e in episodes] == [
        (2, EpisodeStatus.COMPLETED, 1.0),
        (2, EpisodeStatus.ERROR, None),
    ]

    def broken(task, episode):
        raise ValueError("metrics disk full")

    with (
        make_source(AutoServer(), Harness(), record=broken) as source,
        pytest.raises(ValueError, match="metrics disk full"),
    ):
        source.submit(Task(2), group=0, sample=0, attempt=0).result(timeout=10)


# ------------------------------------------------------------------ versions


def test_each_call_keeps_the_version_of_its_own_draw_across_a_push():
    server, harness = PendingServer(), Harness()
    with make_source(server, harness) as source:
        future = source.submit(Task(1), group=0, sample=0, attempt=0)
        server.answer(1, [CALL, EOS])  # drawn at version 2
        server.wait_for(2)
        server.load(None, 5)  # a push between the two turns
        server.answer(2, [D0 + 1, EOS])
        session = future.result(timeout=10)
    assert session.status is Status.COMPLETED and [c.version for c in session.calls] == [2, 5]


# ------------------------------------------------------------------ cancellation


def test_cancel_mid_draw_cancels_the_draw_and_releases_the_environment():
    server, harness = PendingServer(), Harness()
    with make_source(server, harness) as source:
        future = source.submit(Task(2), group=0, sample=0, attempt=0)
        server.answer(1, [CALL, EOS])
        draw = server.wait_for(2)  # the second turn is being drawn
        source.cancel(future)
        session = future.result(timeout=10)
        assert draw.cancelled()  # the server drops it from its queue or row
        assert session.status is Status.CANCELLED and session.reward is None
        assert len(session.calls) == 1 and session.detail == "cancelled by the caller"
        env = harness.environments[0]
        assert env.exited and isinstance(env.exit_error, cf.CancelledError)
        assert env.steps == 1
        source.cancel(future)  # a finished session is left alone
        source.cancel(cf.Future())  # so is a future the source never made
        assert len(server.requests) == 2


def test_cancel_during_a_step_stops_at_the_next_turn():
    entered, release = threading.Event(), threading.Event()

    class Slow(Harness):
        def __call__(self, identity):
            env = super().__call__(identity)
            step = env.step

            def slow(action):
                entered.set()
                release.wait(10)
                return step(action)

            env.step = slow
            return env

    server, harness = AutoServer(), Slow()
    with make_source(server, harness) as source:
        future = source.submit(Task(2), group=0, sample=0, attempt=0)
        assert entered.wait(10)
        source.cancel(future)
        assert not future.done()  # resolved once the environment is released
        release.set()
        session = future.result(timeout=10)
    assert session.status is Status.CANCELLED and len(server.requests) == 1
    assert harness.environments[0].steps == 1 and harness.environments[0].exited


def test_cancel_before_the_episode_starts_resolves_at_once_and_opens_nothing():
    server, harness = PendingServer(), Harness()
    with make_source(server, harness, workers=1) as source:
        running = source.submit(Task(2), group=0, sample=0, attempt=0)
        waiting = source.submit(Task(2), group=0, sample=1, attempt=0)
        server.wait_for(1)
        source.cancel(waiting)
        assert waiting.result(timeout=1).status is Status.CANCELLED
        server.answer(1, [CALL, EOS])
        server.answer(2, [D0 + 4, EOS])
        assert running.result(timeout=10).status is Status.COMPLETED
    assert len(harness.environments) == 1


def test_close_cancels_releases_and_refuses_new_work():
    server, harness = PendingServer(), Harness()
    source = make_source(server, harness)
    futures = [source.submit(Task(2), group=0, sample=s, attempt=0) for s in range(3)]
    server.wait_for(3)
    source.close()
    assert [f.result(timeout=1).status for f in futures] == [Status.CANCELLED] * 3
    assert all(f.cancelled() for f in server.futures)
    assert all(env.exited for env in harness.environments)
    with pytest.raises(RuntimeError, match="EnvironmentSource is closed"):
        source.submit(Task(2), group=0, sample=0, attempt=0)


# ------------------------------------------------------------------ bad input


def test_bad_tasks_and_settings_are_refused():
    server, harness = AutoServer(), Harness()
    with make_source(server, harness) as source:
        with pytest.raises(TypeError, match="expected a sessions.Task"):
            source.submit(3, group=0, sample=0, attempt=0)
        with pytest.raises(ValueError, match="sample is -1"):
            source.submit(Task(1), group=0, sample=-1, attempt=0)
    verifier = lambda task, episode: 0.0  # noqa: E731
    settings = dict(max_prompt_tokens=8, max_new_tokens=3, max_turns=2)
    with pytest.raises(TypeError, match="expected a RolloutServer"):
        EnvironmentSource(object(), harness, verifier, **settings)
    with pytest.raises(TypeError, match="environment is 3"):
        EnvironmentSource(server, 3, verifier, **settings)
    with pytest.raises(TypeError, match="verifier is None"):
        EnvironmentSource(server, harness, None, **settings)
    with pytest.raises(TypeError, match="record is 1"):
        EnvironmentSource(server, harness, verifier, record=1, **settings)
    for name in ("max_prompt_tokens", "max_new_tokens", "max_turns", "workers"):
        with pytest.raises(ValueError, match=f"{name} is 0; expected an int >= 1"):
            EnvironmentSource(server, harness, verifier, **(settings | {name: 0}))

    class Engine:
        capacity, sampling = 9, None

    server.server = Engine()
    with pytest.raises(ValueError, match=r"\+ max_new_tokens \(3\) - 1 = 10 exceeds the server"):
        EnvironmentSource(server, harness, verifier, **settings)


def test_environment_source_is_exported_where_the_spec_names_it():
    import dew_pipe.objectives.rl as rl

    assert rl.EnvironmentSource is EnvironmentSource
