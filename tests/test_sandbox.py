"""SubprocessEnvironment with a real worker process (tests/episode_helpers.py: the square tool).

Round trips of every request, then each way a worker can fail its episode (a hang, an
exceeded memory or CPU limit, a crash, malformed or oversized output, an error reply, an
outlived parent): each ends as a WorkerError that says what happened, promptly, with the
worker gone. Last, a full EpisodeRollout cohort through workers equals the same cohort
through the in-memory Harness, array for array, and a worker that fails mid-cohort aborts
the collection with every worker gone.
"""

from __future__ import annotations

import doctest
import json
import os
import signal
import subprocess
import sys
import time
import types

import jax
import numpy as np
import pytest
from episode_helpers import LIMITS, square_environment
from fault_helpers import ROOT
from sandbox_helpers import alive, wait_until
from test_tool_episodes import (
    CALL,
    D0,
    EOS,
    Q0,
    RESULT,
    USER,
    Harness,
    ScriptedPolicy,
    episode_rollout,
    tasks,
    tool_policy,  # noqa: F401 - the module-scoped fixture
)

from dew_pipe.objectives.rl import (
    Action,
    EpisodeFailure,
    EpisodeId,
    EpisodeStatus,
    Observation,
    SubprocessEnvironment,
)
from dew_pipe.objectives.rl.subprocess_environment import WorkerError
from dew_pipe.sandbox import SandboxLimits

EPISODE = EpisodeId(task=6, step=3, sample=1, seed=11)


def _action(context, tokens=(CALL, EOS)) -> Action:
    n = len(tokens)
    return Action(context, list(tokens), [-0.5] * n, [-0.25] * n, stopped=True, policy_step=2)


def test_round_trips_reset_step_and_snapshots(tmp_path):
    factory = square_environment(tmp_path)
    with factory(EPISODE) as env:
        first = env.reset()
        assert first == Observation([USER, Q0 + 2], detail=first.detail)
        pid = int(first.detail)
        assert alive(pid) and env.directory is not None
        directory = env.directory
        after = env.step(_action(first.context))
        assert after.running and after.context.tolist() == [USER, Q0 + 2, CALL, EOS, RESULT, D0 + 4]
        snapshot = env.get_state()
        assert json.loads(snapshot) == {"episode": vars_of(EPISODE), "x": 2, "calls": 1}
        done = env.step(_action(after.context, (D0 + 4, EOS)))
        assert done.status is EpisodeStatus.COMPLETED and done.detail == str(D0 + 4)
        assert done.context is None
        env.set_state(snapshot)  # acknowledged; the worker's state is the snapshot again
        assert json.loads(env.get_state()) == json.loads(snapshot)
    assert wait_until(lambda: not alive(pid))
    assert not (tmp_path / directory).exists()


def vars_of(episode: EpisodeId) -> dict:
    return {name: getattr(episode, name) for name in ("task", "step", "sample", "seed")}


def test_a_snapshot_restores_into_a_fresh_worker(tmp_path):
    factory = square_environment(tmp_path)
    with factory(EPISODE) as env:
        first = env.reset()
        env.step(_action(first.context))
        snapshot = env.get_state()
    with factory(EPISODE) as env:  # a new process: no reset, only the snapshot
        env.set_state(snapshot)
        assert json.loads(env.get_state())["calls"] == 1


FAILURES = [
    # (FAULT, limits, what the message says)
    ("hang:step", SandboxLimits(wall_seconds=1.0), "no reply to step within the session's"),
    ("memory:step", LIMITS, "MemoryError"),
    ("cpu:step", SandboxLimits(cpu_seconds=1, wall_seconds=20), "exceeded its CPU time"),
    ("crash:step", LIMITS, "killed by signal SIGSEGV"),
    ("exit:reset", LIMITS, "exited with status 3; its stderr ends: the tool lost its database"),
    ("garbage:step", LIMITS, "a line that is not JSON: 'this is not json'"),
    ("huge:step", SandboxLimits(output_bytes=10_000), "longer than SandboxLimits.output_bytes"),
    ("error:step", LIMITS, "reported an error on step: the tool is down"),
    ("extra:reset", LIMITS, r"unknown field\(s\) \['contexts'\]"),
    ("badcontext:reset", LIMITS, "bad observation .*integer token ids"),
    ("noack:set_state", LIMITS, 'expected {"restored": true}'),
]


@pytest.mark.parametrize("fault, limits, message", FAILURES, ids=[f[0] for f in FAILURES])
def test_each_worker_failure_is_a_clear_error_and_leaves_no_worker(
    tmp_path, fault, limits, message
):
    factory = square_environment(tmp_path, limits, FAULT=fault)
    start = time.monotonic()
    with factory(EPISODE) as env:
        launched = env._launched
        with pytest.raises(WorkerError, match=message) as caught:
            if fault.endswith(":reset"):
                env.reset()
            else:
                first = env.reset()
                if fault.endswith(":set_state"):
                    env.set_state(env.get_state())
                else:
                    env.step(_action(first.context))
        assert "episode (task 6, step 3, sample 1, seed 11)" in str(caught.value)
        assert launched._process.poll() is not None  # killed at once, not at the exit
        with pytest.raises(WorkerError, match="after the worker failed"):
            env.get_state()
    assert time.monotonic() - start < limits.wall_seconds + 10


def test_the_memory_limit_names_itself(tmp_path):
    factory = square_environment(tmp_path, FAULT="memory:step")
    with factory(EPISODE) as env, pytest.raises(WorkerError) as caught:
        env.step(_action(env.reset().context))
    assert f"SandboxLimits.memory_bytes={LIMITS.memory_bytes}" in str(caught.value)


def test_the_parent_dying_kills_the_worker(tmp_path):
    """A trainer killed with SIGKILL leaves no worker and no working directory behind (the
    supervisor sweeps, then removes the directory it was handed)."""
    code = f"""
import sys, time
sys.path[:0] = [{str(ROOT / "tests")!r}]
from pathlib import Path
from episode_helpers import square_environment
from dew_pipe.objectives.rl import EpisodeId
env = square_environment(Path({str(tmp_path)!r}))(EpisodeId(0, 0, 0, 0)).__enter__()
print(env.reset().detail, env._launched.pid, env.directory, flush=True)
time.sleep(60)
"""
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        worker, supervisor, directory = parent.stdout.readline().split()
        worker, supervisor = int(worker), int(supervisor)
        assert alive(worker) and alive(supervisor) and os.path.isdir(directory)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        assert wait_until(lambda: not alive(worker) and not alive(supervisor), 10)
        assert not os.path.exists(directory)
    finally:
        parent.kill()
        parent.wait()


def test_construction_refuses_bad_arguments(tmp_path):
    with pytest.raises(TypeError, match="sequence of str"):
        SubprocessEnvironment("python3 worker.py")
    with pytest.raises(ValueError, match="command is empty"):
        SubprocessEnvironment([])
    with pytest.raises(TypeError, match="SandboxLimits"):
        SubprocessEnvironment(["true"], {"wall_seconds": 1})
    with pytest.raises(TypeError, match="str -> str"):
        SubprocessEnvironment(["true"], env={"N": 1})
    with pytest.raises(TypeError, match="EpisodeId"):
        SubprocessEnvironment(["true"])((0, 0, 0, 0))
    env = SubprocessEnvironment(["true"])(EPISODE)
    with pytest.raises(RuntimeError, match="outside the session's context"):
        env.reset()
    with square_environment(tmp_path)(EPISODE) as env:
        env.reset()
    with pytest.raises(RuntimeError, match="outside the session's context"):
        env.reset()  # after the exit
    with pytest.raises(RuntimeError, match="a session runs once"):
        env.__enter__()


# ---------------------------------------------------------------------------- a cohort


def test_a_full_cohort_through_workers_equals_the_in_memory_harness(tool_policy, tmp_path):  # noqa: F811
    _, variables, policy = tool_policy
    state = types.SimpleNamespace(step=np.int32(0), updates=np.int32(0), params=variables)
    workers = episode_rollout(policy, square_environment(tmp_path))
    harness = episode_rollout(policy, Harness())
    through_workers = workers(state, tasks(2, 3), jax.random.key(4))
    in_memory = harness(state, tasks(2, 3), jax.random.key(4))
    assert sorted(through_workers) == sorted(in_memory)
    for name, column in in_memory.items():
        assert through_workers[name].tobytes() == column.tobytes(), name
    ours, theirs = workers.last_episodes, harness.last_episodes
    assert [e.actions for e in ours] == [e.actions for e in theirs]
    assert [(e.status, e.reward) for e in ours] == [(e.status, e.reward) for e in theirs]
    assert {e.status for e in ours} >= {EpisodeStatus.COMPLETED}
    assert any(len(e.actions) == 2 for e in ours)  # the tool was called and answered
    pids = [int(e.first.detail) for e in ours]
    assert len(set(pids)) == 8 and wait_until(lambda: not any(alive(p) for p in pids))


def test_a_worker_failing_mid_cohort_aborts_the_collection_and_stops_every_worker(tmp_path):
    seen = []
    factory = square_environment(tmp_path, SandboxLimits(wall_seconds=1.5), FAULT="hang:step")
    rollout = episode_rollout(ScriptedPolicy(), factory, record=seen.append)
    state = types.SimpleNamespace(step=np.int32(0), updates=np.int32(0), params=None)
    start = time.monotonic()
    with pytest.raises(EpisodeFailure, match="no reply to step") as caught:
        rollout(state, tasks(2), jax.random.key(0))
    assert time.monotonic() - start < 10  # the first step hangs: the deadline ends it
    assert isinstance(caught.value.__cause__, WorkerError)
    assert caught.value.episode.status is EpisodeStatus.ERROR
    pids = [int(e.first.detail) for e in seen]
    assert len(pids) == 4 and wait_until(lambda: not any(alive(p) for p in pids))


def test_docstring_examples_run():
    from dew_pipe.objectives.rl import subprocess_environment

    failed, attempted = doctest.testmod(subprocess_environment, raise_on_error=False)
    assert failed == 0 and attempted >= 8
