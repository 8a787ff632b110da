"""HarborSource: real Harbor trials through a real rllm-model-gateway to the shared vLLM engine.

One trial runs Harbor 0.25.0 (its own Python 3.12 environment) on tests/harbor/answer_task
with the test plugins of tests/harbor/: a host-side agent that makes one chat call at the
gateway session Harbor hands it, in a no-network bubblewrap environment, and a verifier
whose reward says the answer reached the sandbox. The session must come back COMPLETED with
that reward and with the call the engine made, read from the gateway's traces (prompt ids
of the chat template, log-probabilities equal to dew_pipe's scoring), labelled with the
publisher's version. Then the gateway's only worker goes dead (replaced through the admin
routes), and the next trial is an INFRA_ERROR while a new source refuses to start. Cancel
and the trial timeout end the trial's process group.

Without Harbor's Python 3.12 environment, the gateway's environment or bubblewrap, the real
tests skip saying which is missing (under CI they fail).
"""

from __future__ import annotations

import doctest
import time

import numpy as np
import pytest
from gateway_helpers import (
    HARBOR_PLUGINS,
    dead_url,
    delete,
    engine_log_probs,
    harbor_python,
    post,
    python312_present,
    require,
    start_gateway,
)

from dew_pipe.objectives.rl import harbor as harbor_module
from dew_pipe.objectives.rl.harbor import Gateway, GatewayError, HarborSource, status_of
from dew_pipe.objectives.rl.sessions import SessionSource, Status, Task

TASK = HARBOR_PLUGINS / "answer_task"
AGENT = "dew_harbor_plugins:ChatOnceAgent"
ENVIRONMENT = "dew_harbor_plugins:BubblewrapEnvironment"
LOGPROB_ATOL = 5e-5  # as in test_gateway.py (measured <= 4e-6)


class Publisher:
    """The scheduler's weights publisher as HarborSource reads it: only its version."""

    version = 6


# ---------------------------------------------------------------- without servers


@pytest.mark.parametrize(
    "outcome, status, reward",
    [
        ({"cause": None, "reward": 0.5}, Status.COMPLETED, 0.5),
        ({"cause": None, "reward": None}, Status.INFRA_ERROR, None),
        ({"cause": "agent_exhausted_budget", "reward": 1.0, "reward_valid": True}, Status.TRUNCATED, 1.0),
        ({"cause": "agent_exhausted_budget", "reward": None, "reward_valid": False}, Status.TRUNCATED, None),
        ({"cause": "agent_refused_task", "reward": 0.0, "reward_valid": True}, Status.AGENT_ERROR, 0.0),
        ({"cause": "agent_refused_task", "reward": None}, Status.INFRA_ERROR, None),
        ({"cause": "cancelled", "reward": None}, Status.CANCELLED, None),
        ({"cause": "model_provider_failed", "reward": 1.0, "reward_valid": False}, Status.INFRA_ERROR, None),
        ({"cause": "sandbox_failed", "reward": None}, Status.INFRA_ERROR, None),
        ({"cause": "verifier_failed", "reward": None}, Status.INFRA_ERROR, None),
        ({"cause": "unclassified", "reward": 1.0}, Status.INFRA_ERROR, None),
    ],
)  # fmt: skip
def test_harbor_failure_causes_map_to_statuses(outcome, status, reward):
    assert status_of(outcome)[:2] == (status, reward)


def test_status_details_name_the_exception():
    outcome = {"cause": "sandbox_failed", "exception": "HealthcheckError", "message": "no shell"}
    assert status_of(outcome)[2] == "sandbox_failed: HealthcheckError: no shell"


def _source(tmp_path, **overrides):
    settings = dict(
        harbor="/bin/true",
        model="tiny",
        trials=tmp_path / "trials",
        agent=AGENT,
        environment=ENVIRONMENT,
    )
    return HarborSource(
        Gateway("http://127.0.0.1:9", sandbox_url="http://127.0.0.1:8"), **{**settings, **overrides}
    )


def test_the_trial_config_points_the_agent_at_its_gateway_session(tmp_path):
    source = _source(
        tmp_path,
        config={"agent": {"kwargs": {"k": 1}}, "timeout_multiplier": 2.0},
        agent="terminus-2",
        environment="docker",
    )
    config = source.trial_config("dew-x", TASK)
    assert config["agent"] == {
        "name": "terminus-2",
        "model_name": "tiny",
        "base_url": "http://127.0.0.1:8/sessions/dew-x/v1",  # the sandbox URL, not the admin one
        "kwargs": {"k": 1},
    }
    assert config["environment"] == {"type": "docker"}
    assert config["task"] == {"path": str(TASK)} and config["timeout_multiplier"] == 2.0
    assert config["trial_name"] == "dew-x" and config["trials_dir"] == str(tmp_path / "trials")
    plugins = _source(tmp_path).trial_config("dew-y", TASK)
    assert plugins["agent"]["import_path"] == AGENT
    assert plugins["environment"] == {"import_path": ENVIRONMENT}


def test_bad_arguments_and_tasks_are_refused(tmp_path):
    with pytest.raises(ValueError, match="harbor: .* not an executable file"):
        _source(tmp_path, harbor=tmp_path / "python")
    with pytest.raises(TypeError, match="gateway"):
        HarborSource(
            "http://127.0.0.1:9", harbor="/bin/true", model="m", trials=tmp_path, agent=AGENT
        )
    with pytest.raises(TypeError, match="agent"):
        _source(tmp_path, agent="")
    with pytest.raises(TypeError, match="weights.version"):
        _source(tmp_path, weights=object())
    with pytest.raises(TypeError, match="env"):
        _source(tmp_path, env={"A": 1})
    source = _source(tmp_path)
    assert isinstance(source, SessionSource)  # what RolloutScheduler draws from
    with pytest.raises(ValueError, match="not a Harbor task"):
        source.submit(Task(0, str(tmp_path)), group=0, sample=0, attempt=0)
    with pytest.raises(ValueError, match="expected 'path'"):
        source.submit(Task(0, {"dir": str(TASK)}), group=0, sample=0, attempt=0)
    with pytest.raises(TypeError, match="sessions.Task"):
        source.submit(str(TASK), group=0, sample=0, attempt=0)
    source.close()
    with pytest.raises(RuntimeError, match="closed"):
        source.submit(Task(0, str(TASK)), group=0, sample=0, attempt=0)


def test_a_gateway_that_is_not_ready_fails_the_first_submission(tmp_path):
    source = _source(tmp_path, ready_timeout=0.3)
    start = time.monotonic()
    with pytest.raises(GatewayError, match="not ready within 0.3 s"):
        source.submit(Task(0, str(TASK)), group=0, sample=0, attempt=0)
    assert time.monotonic() - start < 3.0
    source.close()


def test_the_runner_is_beside_the_module_and_the_examples_run():
    assert harbor_module.RUNNER.is_file()
    assert doctest.testmod(harbor_module).failed == 0


# ---------------------------------------------------------------- real trials


@pytest.fixture
def harbor_env():
    """Harbor's interpreter and the environment the plugins need, or a skip saying why."""
    python = require(harbor_python(), "Harbor (Python 3.12)", present=python312_present())
    try:
        from dew_pipe.sandbox.runners import find_bwrap

        bwrap = find_bwrap()
    except Exception as error:  # noqa: BLE001 - any reason bwrap is unusable skips
        pytest.skip(f"no bubblewrap for the Harbor environment: {error}")
    return python, {"PYTHONPATH": str(HARBOR_PLUGINS), "DEW_HARBOR_BWRAP": bwrap}


def _real_source(gateway_url, python, env, tmp_path, **overrides):
    settings = dict(
        harbor=python,
        model="tiny",
        trials=tmp_path / "trials",
        agent=AGENT,
        environment=ENVIRONMENT,
        env=env,
        weights=Publisher(),
        workers=1,
        ready_timeout=30.0,
        trial_timeout=300.0,
    )
    return HarborSource(Gateway(gateway_url, timeout=60), **{**settings, **overrides})


@pytest.mark.slow
def test_a_real_trial_and_then_a_dead_worker(vllm_engine, harbor_env, tmp_path):
    python, env = harbor_env
    with start_gateway([vllm_engine.url + "/v1"], tmp_path, health_check_interval=0.5) as running:
        with _real_source(running.url, python, env, tmp_path) as source:
            session = source.submit(Task(3, str(TASK)), group=1, sample=2, attempt=0).result(300)
            assert session.status is Status.COMPLETED, session.detail
            assert (session.task, session.group, session.sample, session.attempt) == (3, 1, 2, 0)
            assert session.reward == 1.0
            (call,) = session.calls
            tokenizer = vllm_engine.task.tokenizer()
            assert (
                call.prompt_ids.tolist() == tokenizer("12+34=", add_special_tokens=False).input_ids
            )
            assert call.version == Publisher.version  # unstamped gateway: the submission's
            own = engine_log_probs(vllm_engine, call.prompt_ids.tolist(), call.sampled_ids.tolist())
            np.testing.assert_allclose(call.behavior_log_probs, own, atol=LOGPROB_ATOL, rtol=0)
            name = session.detail.removeprefix("trial ")
            assert (tmp_path / "trials" / name / "result.json").is_file()
            assert source.gateway.traces(name) == []  # read, then deleted from the gateway

            # the only worker goes dead: calls now answer 500 and record nothing
            assert post(running.url + "/admin/workers", {"url": dead_url()})[0] == 200
            assert delete(running.url + "/admin/workers/0") == 200
            failed = source.submit(Task(3, str(TASK)), group=1, sample=2, attempt=1).result(300)
            assert failed.status is Status.INFRA_ERROR and failed.reward is None
            assert failed.calls == () and "500" in failed.detail, failed.detail

        time.sleep(2.0)  # three failed probes at 0.5 s: the gateway now counts it dead
        fresh = _real_source(running.url, python, env, tmp_path, ready_timeout=2.0)
        with pytest.raises(GatewayError, match="0 healthy of 1 workers"):
            fresh.submit(Task(3, str(TASK)), group=1, sample=2, attempt=2)
        fresh.close()


@pytest.mark.slow
def test_cancel_and_the_trial_timeout_end_the_trial_process(vllm_engine, harbor_env, tmp_path):
    python, env = harbor_env
    with start_gateway([vllm_engine.url + "/v1"], tmp_path) as running:
        with _real_source(running.url, python, env, tmp_path, workers=2) as source:
            future = source.submit(Task(0, str(TASK)), group=0, sample=0, attempt=0)
            deadline = time.monotonic() + 30
            while (trial := source._pending.get(future)) is None or trial.process is None:
                assert time.monotonic() < deadline, "the trial process never started"
                time.sleep(0.05)
            source.cancel(future)
            assert future.result(1).status is Status.CANCELLED
            trial.process.wait(30)  # SIGTERM reached its group; the runner cancelled the trial

        with _real_source(running.url, python, env, tmp_path, trial_timeout=0.5) as source:
            session = source.submit(Task(0, str(TASK)), group=0, sample=0, attempt=0).result(60)
            assert session.status is Status.INFRA_ERROR
            assert "outlived trial_timeout=0.5 s" in session.detail
