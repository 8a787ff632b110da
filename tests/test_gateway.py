"""Gateway against a real rllm-model-gateway 0.1.0 in front of the shared real vLLM engine.

What is checked against the real components: readiness (a healthy worker and models
answered through the gateway), a two-call chat session read back from the gateway's traces
as `Call` records whose ids are the chat template's ids and whose log-probabilities equal
dew_pipe's own scoring of the same ids, the stamp refused by this release (it has no
``/admin/weight_version``), deletion, and a dead worker: readiness times out naming it, calls
answer 500 and leave no trace, and a live worker added through the admin route makes the
gateway ready again. Without the gateway's route the stamped-trace path is checked on
trace records as the stamping gateway writes them (``call_of_trace``).

Failures the real gateway does not produce on demand use no server at all: a socket that
listens and never answers (every request must give up within its timeout) and a port
nothing listens on.
"""

from __future__ import annotations

import doctest
import json
import socket
import time
import uuid

import numpy as np
import pytest
from gateway_helpers import (
    dead_url,
    engine_log_probs,
    post,
    stamping_gateway_python,
    start_gateway,
)

from dew_pipe.inference import Publication, SafetensorsReload
from dew_pipe.objectives.rl import gateway as gateway_module
from dew_pipe.objectives.rl.gateway import Gateway, GatewayError, call_of_trace
from dew_pipe.objectives.rl.sessions import Session

LOGPROB_ATOL = 5e-5  # engine vs our float64 scoring of the same bfloat16 weights: measured <= 4e-6


def _trace(**fields):
    base = {
        "trace_id": "t9",
        "prompt_token_ids": [5, 6, 14],
        "completion_token_ids": [7, 2],
        "logprobs": [-0.5, -1.25],
        "finish_reason": "stop",
    }
    return {**base, **fields}


# ---------------------------------------------------------------- records, no server


def test_docstring_examples_run():
    assert doctest.testmod(gateway_module, optionflags=doctest.ELLIPSIS).failed == 0


def test_a_stamped_trace_keeps_its_own_version():
    call = call_of_trace(_trace(weight_version=7), version=3)
    assert call.version == 7  # the gateway's stamp wins over the caller's fallback
    assert call.prompt_ids.tolist() == [5, 6, 14] and call.sampled_ids.tolist() == [7, 2]
    np.testing.assert_array_equal(call.behavior_log_probs, np.float32([-0.5, -1.25]))
    assert call.log_probs is None  # remote draws carry no raw likelihood
    assert call_of_trace(_trace(), version=3).version == 3


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"prompt_token_ids": []}, "prompt_token_ids"),
        ({"completion_token_ids": None}, "completion_token_ids is missing"),
        ({"logprobs": None}, "logprobs is missing for 2 sampled ids"),
        ({"logprobs": [-0.5]}, "one entry per sampled id"),
        ({"finish_reason": None}, "finish_reason"),
        ({"completion_token_ids": [7, -2]}, "expected ids in"),
        ({"weight_version": -1}, "version"),
    ],
)
def test_malformed_traces_are_refused_naming_the_trace(fields, message):
    with pytest.raises(ValueError, match=message) as info:
        call_of_trace(_trace(**fields), version=0)
    assert "trace 't9'" in str(info.value)


def test_a_trace_without_any_version_is_refused():
    with pytest.raises(ValueError, match="no weight_version"):
        call_of_trace(_trace())


def test_urls_are_checked_and_loopback_is_the_default():
    with pytest.raises(ValueError, match="not a loopback address"):
        Gateway("http://192.168.1.4:9090")
    assert Gateway("http://192.168.1.4:9090", trusted_network=True).url == "http://192.168.1.4:9090"
    assert Gateway("http://localhost:9090/").url == "http://localhost:9090"
    gateway = Gateway("http://[::1]:9090", sandbox_url="http://10.0.0.2:8080/")
    assert gateway.session_url("s1") == "http://10.0.0.2:8080/sessions/s1/v1"
    for bad in ("ftp://127.0.0.1", "127.0.0.1:9090", "http://127.0.0.1:9?x=1"):
        with pytest.raises(ValueError, match="url"):
            Gateway(bad)
    with pytest.raises(ValueError, match="timeout"):
        Gateway("http://127.0.0.1:9", timeout=0)
    for bad in ("a/b", "", "x?y", ".."):
        with pytest.raises((TypeError, ValueError), match="session"):
            gateway.session_url(bad)


def test_a_gateway_that_never_answers_fails_every_step_on_time():
    with socket.socket() as silent:  # listens (the kernel accepts) but never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        gateway = Gateway(url, timeout=0.4)
        for step, call in [
            ("stamp", lambda: gateway.stamp(1)),
            ("traces", lambda: gateway.traces("s")),
            ("delete", lambda: gateway.delete("s")),
            ("workers", gateway.workers),
        ]:
            start = time.monotonic()
            with pytest.raises(GatewayError, match=f"gateway {step}: .* {url}/") as info:
                call()
            assert time.monotonic() - start < 2.0
            assert "no answer within 0.4 s" in str(info.value)
        start = time.monotonic()
        with pytest.raises(GatewayError, match="not ready within 1 s"):
            gateway.ready(1.0, interval=0.1)
        assert time.monotonic() - start < 3.0


def test_a_refused_connection_names_the_url_and_step():
    url = dead_url().removesuffix("/v1")
    with pytest.raises(
        GatewayError, match=f"gateway traces: GET {url}/sessions/s/traces .*Connection ?Refused"
    ):
        Gateway(url, timeout=2).traces("s")


# ---------------------------------------------------------------- the real gateway


@pytest.fixture(scope="module")
def live(vllm_engine, tmp_path_factory):
    with start_gateway([vllm_engine.url + "/v1"], tmp_path_factory.mktemp("gateway")) as running:
        gateway = Gateway(running.url, timeout=120)
        gateway.ready(60)
        yield gateway


def _chat(gateway: Gateway, session: str, messages, max_tokens: int = 5):
    status, body = post(
        gateway.session_url(session) + "/chat/completions",
        {"model": "tiny", "messages": messages, "max_tokens": max_tokens, "seed": 3},
        timeout=120,
    )
    assert status == 200, body
    return json.loads(body)


@pytest.mark.slow  # the real vLLM engine
def test_ready_sees_a_healthy_worker(live):
    live.ready(5)
    workers = live.workers()
    assert workers["healthy"] == 1 and workers["total"] == 1


@pytest.mark.slow  # the real vLLM engine
def test_a_session_reads_back_as_the_calls_the_engine_made(live, vllm_engine):
    session = f"read-{uuid.uuid4().hex[:6]}"
    first = [{"role": "user", "content": "12+34="}]
    reply = _chat(live, session, first)
    answer = reply["choices"][0]["message"]["content"]
    second = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "5+5="}]
    _chat(live, session, second, max_tokens=3)

    calls = live.calls(session, version=4)
    tokenizer = vllm_engine.task.tokenizer()
    assert len(calls) == 2
    for call, messages in zip(calls, (first, second), strict=True):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert call.prompt_ids.tolist() == tokenizer(text, add_special_tokens=False).input_ids
        assert call.version == 4  # this gateway stamps nothing: the caller's version
        call.check_eos(vllm_engine.task.eos_id)
        own = engine_log_probs(vllm_engine, call.prompt_ids.tolist(), call.sampled_ids.tolist())
        np.testing.assert_allclose(call.behavior_log_probs, own, atol=LOGPROB_ATOL, rtol=0)
    assert calls[0].sampled_ids.size == 5 or calls[0].finish_reason == "stop"
    record = Session(0, 0, 0, 0, calls, "COMPLETED", 1.0)
    assert record.calls[1].prompt_ids.size > record.calls[0].prompt_ids.size

    with pytest.raises(GatewayError, match=f"session '{session}', call 0 .*no weight_version"):
        live.calls(session)
    assert live.delete(session) == 2
    assert live.calls(session, version=0) == ()


@pytest.mark.slow  # the real vLLM engine
def test_this_release_cannot_stamp_and_says_so(live):
    with pytest.raises(GatewayError, match="HTTP 404.*no /admin/weight_version route"):
        live.stamp(1)
    with pytest.raises(GatewayError, match="no /admin/weight_version route"):
        Publication(lambda variables, version: None, version=0, stamp=live.stamp)


@pytest.mark.slow  # the real vLLM engine
def test_a_stamping_gateway_labels_calls_with_the_published_version(vllm_engine, tmp_path):
    python = stamping_gateway_python()
    if python is None:
        pytest.skip(
            "no stamping rllm-model-gateway: PyPI's 0.1.0 predates /admin/weight_version; set "
            "DEW_PIPE_STAMPING_GATEWAY_PYTHON to one installed from the rllm repository"
        )
    with start_gateway([vllm_engine.url + "/v1"], tmp_path, python=python) as running:
        gateway = Gateway(running.url, timeout=120)
        gateway.ready(60)
        push = SafetensorsReload(
            vllm_engine.pretrained, vllm_engine.directory, [vllm_engine.url], "vllm"
        )
        weights = Publication(push, version=0, stamp=gateway.stamp)  # stamps v0 at once
        session, ask = "stamped", [{"role": "user", "content": "1+2="}]
        _chat(gateway, session, ask)
        try:
            weights.load(vllm_engine.variables, 1)  # the launch weights again, as version 1
            _chat(gateway, session, ask)
        finally:
            vllm_engine.restore()
        # the gateway's stamps win over the fallback version
        assert [call.version for call in gateway.calls(session, version=9)] == [0, 1]


@pytest.mark.slow  # the real vLLM engine
def test_a_dead_worker_fails_readiness_and_records_nothing(vllm_engine, tmp_path):
    with start_gateway([dead_url()], tmp_path, health_check_interval=0.2) as running:
        gateway = Gateway(running.url, timeout=10)
        with pytest.raises(GatewayError, match="0 healthy of 1 workers"):
            gateway.ready(3.0, interval=0.2)
        status, body = post(
            gateway.session_url("dead") + "/chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": "1+1="}], "max_tokens": 2},
        )
        assert status == 500  # the gateway's plain-text answer while no worker is healthy
        assert gateway.calls("dead", version=0) == ()
        status, _ = post(running.url + "/admin/workers", {"url": vllm_engine.url + "/v1"})
        assert status == 200
        gateway.ready(30, interval=0.2)  # a live worker beside the dead one
