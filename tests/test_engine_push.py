"""Weight pushes and the HTTP servers' rules without an engine: refusals, failure injection.

The real engine paths run against vLLM in tests/test_vllm_engine.py. Here a tiny loopback
HTTP server (`Replica`) injects what a real vLLM will not produce on demand: a reset that
answers HTTP 200 with ``success: false``, a failing step, SGLang's 400 refusal, and a
replica that accepts connections and never answers. Its request log shows the exact
sequence a push sent. Request bodies of the OpenAI routes are checked against the engines'
own request models: vLLM 0.32.0's ``CompletionRequest`` and ``GenerateRequest``, SGLang's
``CompletionRequest`` (python/sglang/srt/entrypoints/openai/protocol.py at 004c82e).
"""

from __future__ import annotations

import http.server
import json
import socket
import threading
import time

import numpy as np
import pytest
from process_group import run_group
from vllm_helpers import tiny_pretrained

from dew_pipe.inference import (
    EngineError,
    JSONClient,
    OpenAICompletion,
    OpenAIRolloutServer,
    Publication,
    SafetensorsReload,
    VLLMGenerateServer,
)
from dew_pipe.models.hf import load_pretrained
from dew_pipe.sampling import Sampling

VLLM_SEQUENCE = [
    "/pause?mode=wait",
    "/collective_rpc",
    "/reset_prefix_cache",
    "/update_weight_version",
    "/resume",
]


class Replica:
    """A loopback HTTP server answering each path with a chosen (status, JSON body)."""

    def __init__(self, answers: dict[str, tuple[int, object]] | None = None) -> None:
        self.answers = answers or {}
        self.requests: list[tuple[str, object]] = []
        replica = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - the http.server hook name
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                replica.requests.append((self.path, json.loads(raw) if raw else None))
                status, body = replica.answers.get(self.path, (200, {"success": True}))
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST  # noqa: N815

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def paths(self) -> list[str]:
        return [path for path, _ in self.requests]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)


@pytest.fixture
def replicas():
    made: list[Replica] = []

    def make(answers=None) -> Replica:
        made.append(Replica(answers))
        return made[-1]

    yield make
    for replica in made:
        replica.close()


@pytest.fixture
def silent():
    """A socket that accepts connections (the kernel's backlog) and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()


@pytest.fixture(scope="module")
def tiny():
    return tiny_pretrained()[1]


def test_vllm_sequence_and_version(tiny, tmp_path, replicas):
    a, b = replicas(), replicas()
    push = SafetensorsReload(tiny, tmp_path / "ckpt", [a.url, b.url], "vllm", timeout=10)
    weights = Publication(push, version=2)
    weights.load(tiny.variables, 3)
    for replica in (a, b):
        assert replica.paths == VLLM_SEQUENCE
        bodies = dict(replica.requests)
        assert bodies["/collective_rpc"] == {"method": "reload_weights"}
        assert bodies["/update_weight_version"] == {"new_version": "3"}
    assert weights.version == 3
    reread = load_pretrained(tmp_path / "ckpt")
    assert str(reread.config.dtype).endswith("bfloat16")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ckpt.staging")]


def test_refused_reset_fails_the_push_and_leaves_the_replica_paused(tiny, tmp_path, replicas):
    good = replicas()
    bad = replicas({"/reset_prefix_cache": (200, {"success": False})})
    push = SafetensorsReload(tiny, tmp_path / "ckpt", [good.url, bad.url], "vllm", timeout=10)
    weights = Publication(push)
    with pytest.raises(EngineError, match="reset_prefix_cache.*success false") as caught:
        weights.load(tiny.variables, 1)
    assert caught.value.url == f"{bad.url}/reset_prefix_cache"
    assert caught.value.step == "reset_prefix_cache" and "1 of 2 replicas" in str(caught.value)
    assert weights.version == 0  # a failed push leaves the version where it was
    assert bad.paths == VLLM_SEQUENCE[:3]  # paused, never resumed
    assert good.paths == VLLM_SEQUENCE  # the other replica ran its whole sequence


@pytest.mark.parametrize("step", ["/pause?mode=wait", "/collective_rpc", "/resume"])
def test_a_failing_step_is_named(tiny, tmp_path, replicas, step):
    bad = replicas({step: (500, {"error": "boom"})})
    push = SafetensorsReload(tiny, tmp_path / "ckpt", [bad.url], "vllm", timeout=10)
    with pytest.raises(EngineError, match="HTTP 500") as caught:
        push(tiny.variables, 1)
    assert caught.value.status == 500 and caught.value.url.startswith(bad.url)
    assert bad.paths == VLLM_SEQUENCE[: VLLM_SEQUENCE.index(step) + 1]


def test_a_replica_that_never_answers_fails_on_time(tiny, tmp_path, replicas, silent):
    good = replicas()
    push = SafetensorsReload(tiny, tmp_path / "ckpt", [good.url, silent], "vllm", timeout=1.0)
    weights = Publication(push)
    start = time.monotonic()
    with pytest.raises(EngineError, match="no answer within 1 s") as caught:
        weights.load(tiny.variables, 1)
    assert time.monotonic() - start < 5.0
    assert caught.value.url == f"{silent}/pause?mode=wait" and caught.value.step == "pause"
    assert weights.version == 0 and good.paths == VLLM_SEQUENCE


def test_an_unreachable_replica_is_named(tiny, tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"  # closed when the block ends
    push = SafetensorsReload(tiny, tmp_path / "ckpt", [url], "vllm", timeout=5)
    with pytest.raises(EngineError, match="ConnectionRefusedError") as caught:
        push(tiny.variables, 1)
    assert caught.value.step == "pause"


def test_sglang_call_and_its_refusal(tiny, tmp_path, replicas):
    # SGLang's /update_weights_from_disk answers 400 {"success": false, "message": ...} on a
    # failed load (python/sglang/srt/entrypoints/http_server.py, update_weights_from_disk).
    bad = replicas({"/update_weights_from_disk": (400, {"success": False, "message": "no"})})
    push = SafetensorsReload(tiny, tmp_path / "ckpt", [bad.url], "sglang", timeout=10)
    weights = Publication(push, version=5)
    with pytest.raises(EngineError, match="HTTP 400"):
        weights.load(tiny.variables, 6)
    assert weights.version == 5
    path, body = bad.requests[0]
    assert path == "/update_weights_from_disk" and len(bad.requests) == 1
    assert body == {
        "model_path": str((tmp_path / "ckpt").resolve()),
        "flush_cache": True,
        "abort_all_requests": False,
        "weight_version": "6",
    }
    ok = replicas({"/update_weights_from_disk": (200, {"success": False, "message": "no"})})
    with pytest.raises(EngineError, match="success false"):
        SafetensorsReload(tiny, tmp_path / "ckpt", [ok.url], "sglang")(tiny.variables, 6)


def test_publication_stamps_and_keeps_its_version_on_failure():
    stamps, pushes = [], []

    def push(variables, version):
        pushes.append(version)
        if version == 3:
            raise EngineError("refused", url="http://replica", step="reload_weights")

    weights = Publication(push, version=1, stamp=stamps.append)
    weights.load({}, 2)
    with pytest.raises(EngineError, match="refused"):
        weights.load({}, 3)
    assert (weights.version, pushes, stamps) == (2, [2, 3], [1, 2])

    def failing_stamp(version):
        if version == 4:
            raise RuntimeError("gateway down")
        stamps.append(version)

    weights = Publication(push, version=0, stamp=failing_stamp)
    with pytest.raises(RuntimeError, match="gateway down"):
        weights.load({}, 4)
    assert weights.version == 0  # the push went through, the stamp did not


def test_push_arguments_are_checked(tiny, tmp_path):
    with pytest.raises(ValueError, match="engine is 'tgi'"):
        SafetensorsReload(tiny, tmp_path, ["http://a:1"], "tgi")
    with pytest.raises(ValueError, match="nonempty list"):
        SafetensorsReload(tiny, tmp_path, [], "vllm")
    with pytest.raises(ValueError, match="twice"):
        SafetensorsReload(tiny, tmp_path, ["http://a:1", "http://a:1/"], "vllm")
    with pytest.raises(ValueError, match="http"):
        SafetensorsReload(tiny, tmp_path, ["a:1"], "vllm")
    with pytest.raises(TypeError, match="Pretrained"):
        SafetensorsReload(object(), tmp_path, ["http://a:1"], "vllm")
    with pytest.raises(TypeError, match="push"):
        Publication("not callable")


class Weights:
    version = 0

    def load(self, variables, version):
        self.version = version


def test_completion_request_fields():
    vllm = OpenAICompletion("m", "http://127.0.0.1:1/v1")
    body = vllm.body(np.array([4, 5]), max_tokens=3, sampling=Sampling(eos_id=(2, 3)), seed=9)
    assert body == {
        "model": "m", "prompt": [4, 5], "max_tokens": 3, "temperature": 1.0, "logprobs": 0,
        "seed": 9, "return_tokens_as_token_ids": True, "ignore_eos": True,
        "stop_token_ids": [2, 3],
    }  # fmt: skip
    sglang = OpenAICompletion("m", "http://127.0.0.1:1/v1", provider="sglang")
    body = sglang.body([[4, 5], [6]], max_tokens=3, sampling=Sampling(eos_id=2, temperature=0.6))
    assert body == {
        "model": "m", "prompt": [[4, 5], [6]], "max_tokens": 3, "temperature": 0.6,
        "logprobs": 0, "return_token_ids": True, "stop_token_ids": [2],
    }  # fmt: skip
    assert sglang.body("text", max_tokens=1)["ignore_eos"] is True  # no EOS: never stops early
    with pytest.raises(ValueError, match="provider"):
        OpenAICompletion("m", "http://127.0.0.1:1/v1", provider="tgi")
    with pytest.raises(ValueError, match="prompt"):
        vllm.body([1.5, 2], max_tokens=1)


def test_completion_answers_are_read_by_provider():
    vllm = OpenAICompletion("m", "http://127.0.0.1:1/v1")
    answer = {  # vLLM 0.32.0, as the real engine answered in tests/test_vllm_engine.py
        "model": "m",
        "choices": [{
            "index": 0, "text": "+2", "finish_reason": "stop", "stop_reason": 2,
            "logprobs": {"tokens": ["token_id:14", "token_id:2"],
                         "token_logprobs": [-0.65, -1.8]},
        }],
    }  # fmt: skip
    choice = vllm.parse(answer).choices[0]
    assert choice.tokens.tolist() == [14, 2] and choice.finish_reason == "stop"
    np.testing.assert_allclose(choice.log_probs, [-0.65, -1.8], rtol=1e-6)
    answer["choices"][0]["logprobs"]["tokens"] = ["+", "2"]
    with pytest.raises(ValueError, match="token_id"):
        vllm.parse(answer)
    sglang = OpenAICompletion("m", "http://127.0.0.1:1/v1", provider="sglang")
    choice = sglang.parse({  # SGLang's CompletionResponseChoice with return_token_ids
        "model": "m",
        "choices": [{"index": 0, "text": "ab", "finish_reason": "length", "token_ids": [7, 8],
                     "logprobs": {"tokens": ["a", "b"], "token_logprobs": [-0.1, -0.2]}}],
    }).choices[0]  # fmt: skip
    assert choice.tokens.tolist() == [7, 8] and choice.finish_reason == "length"


def test_servers_refuse_what_the_engine_cannot_report():
    vllm = OpenAICompletion("m", "http://127.0.0.1:1/v1")
    sglang = OpenAICompletion("m", "http://127.0.0.1:1/v1", provider="sglang")
    for sampling in (Sampling(top_k=5), Sampling(top_p=0.9), Sampling(min_p=0.1)):
        for completion in (vllm, sglang):
            with pytest.raises(ValueError, match="filtered policy"):
                OpenAIRolloutServer(completion, sampling, Weights(), processed_logprobs=False)
    with pytest.raises(ValueError, match="processed_logprobs"):
        OpenAIRolloutServer(vllm, Sampling(temperature=0.5), Weights())
    with pytest.raises(ValueError, match="greedy"):
        OpenAIRolloutServer(vllm, Sampling(temperature=0), Weights(), processed_logprobs=True)
    with pytest.raises(ValueError, match="routed_experts"):
        OpenAIRolloutServer(sglang, Sampling(), Weights(), routing=True)
    OpenAIRolloutServer(sglang, Sampling(temperature=0.5), Weights()).close()  # any temperature
    with pytest.raises(TypeError, match="publisher"):
        OpenAIRolloutServer(vllm, Sampling(), object())
    with pytest.raises(ValueError, match="top_k"):
        VLLMGenerateServer("http://127.0.0.1:1", Sampling(top_p=0.9), Weights())


def test_generate_route_reads_masks_versions_and_routing():
    server = VLLMGenerateServer("http://127.0.0.1:1", Sampling(eos_id=2, top_k=3), Weights())
    routing = np.arange(2 * 4 * 2, dtype=np.uint8).reshape(4, 2, 2)
    import base64
    import io

    buffer = io.BytesIO()
    np.save(buffer, routing, allow_pickle=False)
    # GenerateTokensChoice of vllm/entrypoints/scale_out/token_in_token_out/protocol.py
    # (0.32.0): sampling_mask is one list of kept ids per sampled id; weight_versions spans
    # output positions [start, end); routed_experts is base64 .npy bytes.
    answer = {"choices": [{
        "index": 0, "finish_reason": "stop", "token_ids": [5, 2],
        "logprobs": {"content": [{"token_id": 5, "logprob": -0.5, "top_logprobs": []},
                                 {"token_id": 2, "logprob": -0.7, "top_logprobs": []}]},
        "sampling_mask": [[5, 9, 1], [2, 4, 6]],
        "weight_versions": [{"version": "7", "start": 0, "end": 1},
                            {"version": "8", "start": 1, "end": 2}],
        "routed_experts": base64.b64encode(buffer.getvalue()).decode(),
    }]}  # fmt: skip
    draw = server._draw(answer, np.array([3, 4, 5]), 4, 11, submitted=7)
    assert [s.tolist() for s in draw.support] == [[5, 9, 1], [2, 4, 6]]
    assert draw.version == 7 and draw.submitted_version == 7 and draw.seed == 11
    assert draw.routed_experts is None  # routing=False
    answer["choices"][0]["weight_versions"] = [{"version": "default", "start": 0, "end": 2}]
    assert server._draw(answer, np.array([3]), 4, 1, submitted=9).version == 0  # launch
    answer["choices"][0]["sampling_mask"] = [[9, 1], [2]]  # misses the sampled id 5
    with pytest.raises(ValueError, match="support"):
        server._draw(answer, np.array([3]), 4, 1, submitted=0).call()
    server.close()
    routed = VLLMGenerateServer(
        "http://127.0.0.1:1", Sampling(eos_id=2, top_k=3), Weights(), routing=True
    )
    answer["choices"][0]["sampling_mask"] = None
    draw = routed._draw(answer, np.array([3, 4, 5]), 4, 1, submitted=0)
    np.testing.assert_array_equal(draw.routed_experts, routing)
    assert draw.call().routed_experts.shape == (4, 2, 2)
    del answer["choices"][0]["routed_experts"]
    with pytest.raises(EngineError, match="routed_experts"):
        routed._draw(answer, np.array([3]), 4, 1, submitted=0)
    routed.close()


def test_draw_rules_against_a_replica(replicas):
    bad = replicas({
        "/v1/completions": (200, {"model": "m", "choices": [{
            "index": 0, "text": "", "finish_reason": "stop",
            "logprobs": {"tokens": ["token_id:4"], "token_logprobs": [-0.1]}}]}),
    })  # fmt: skip
    server = OpenAIRolloutServer(
        OpenAICompletion("m", f"{bad.url}/v1"), Sampling(eos_id=2), Weights()
    )
    try:
        with pytest.raises(EngineError, match="not on an EOS id"):
            server.submit([1, 2], 4).result(timeout=10)
        _, body = bad.requests[0]
        assert 0 <= body["seed"] < 2**32  # every request carries a seed
    finally:
        server.close()


def test_client_deadline_and_urls(silent):
    client = JSONClient(silent, timeout=0.5)
    start = time.monotonic()
    with pytest.raises(EngineError, match="no answer within 0.5 s"):
        client.get("/health", step="health")
    assert time.monotonic() - start < 3
    assert JSONClient("http://h:1/v1/").url("/completions") == "http://h:1/v1/completions"
    for bad in ("ftp://h:1", "http://", "http://h:x", "http://h:1/?q=1"):
        with pytest.raises(ValueError, match="base_url"):
            JSONClient(bad)


@pytest.mark.slow
def test_two_processes_push_once_and_agree_on_failure(tmp_path, replicas):
    from pathlib import Path

    good = replicas()
    bad = replicas({"/reset_prefix_cache": (200, {"success": False})})
    worker = Path(__file__).resolve().parent / "push_worker.py"
    outs = [tmp_path / f"{i}.json" for i in range(2)]
    run_group(worker, outs, good.url, bad.url, str(tmp_path / "ckpt"))
    first, second = (json.loads(out.read_text()) for out in outs)
    assert "model.safetensors" in first["written"] and second["written"] == []  # process 0
    assert first["after_good"] == second["after_good"] == 1
    assert good.paths == VLLM_SEQUENCE  # one push reached the replica, not one per process
    assert bad.paths == VLLM_SEQUENCE[:3]
    assert "success false" in first["bad"]
    assert "failed on process 0" in second["bad"] and "success false" in second["bad"]
    assert first["after_bad"] == second["after_bad"] == 1


def test_an_aborted_request_fails_at_once(silent):
    client = JSONClient(silent, timeout=30)
    early = client.request("GET", "/health", step="health")
    early.abort()
    with pytest.raises(EngineError, match="aborted"):
        early.send()
    waiting = client.request("GET", "/health", step="health")
    errors: list[BaseException] = []

    def send():
        try:
            waiting.send()
        except EngineError as error:
            errors.append(error)

    thread = threading.Thread(target=send)
    start = time.monotonic()
    thread.start()
    time.sleep(0.2)  # connected, waiting for an answer that never comes
    waiting.abort()
    thread.join(5)
    assert not thread.is_alive() and time.monotonic() - start < 5
    assert len(errors) == 1 and "aborted" in str(errors[0])


def test_docstring_examples_run():
    import doctest

    from dew_pipe.inference.servers import (
        http_json,
        nccl_push,
        openai_completions,
        publication,
        vllm_generate,
    )

    attempted = 0
    for module in (http_json, openai_completions, vllm_generate, publication, nccl_push):
        failed, tried = doctest.testmod(module, raise_on_error=False)
        assert failed == 0, module.__name__
        attempted += tried
    assert attempted >= 10
