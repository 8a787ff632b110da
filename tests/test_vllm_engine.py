"""The HTTP rollout servers and SafetensorsReload against a real vLLM on loopback.

The session fixture ``vllm_engine`` (tests/vllm_helpers.py) serves a tiny Qwen3 checkpoint
with processed log-probabilities. Draws are checked against dew_pipe's own scoring of the
same ids (``GRPOObjective.packed_log_probs`` over ``pack``ed sessions of the draws, on the
weights the engine reads: the bfloat16 checkpoint in float32), which is the mismatch a
trainer sees. vLLM computes in float32 here too; the largest difference measured was
4.3e-6 nats (the first test prints it), and the tolerance is 1e-4 (a push of other weights
moves them by more than 0.1, which the push test checks).

Every test that pushes weights restores the launch weights (``vllm_engine.restore``) when
it ends, so tests can run in any order.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
import urllib.request

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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
from dew_pipe.objectives.rl import GRPOObjective, pack
from dew_pipe.objectives.rl.sessions import Session
from dew_pipe.sampling import Sampling

pytestmark = pytest.mark.slow
ATOL = 1e-4  # engine (float32, vLLM's kernels) against dew_pipe's scoring of the same ids
PROMPTS = ([5, 6, 7, 8], [9, 9], [3, 13, 4, 12, 11], [7])
WIDTH = 32


class Weights:
    """The publisher of tests that never push: a fixed version."""

    def __init__(self, version: int = 0) -> None:
        self.version = version

    def load(self, variables, version):
        raise AssertionError("this test does not push weights")


def completion(engine) -> OpenAICompletion:
    return OpenAICompletion(engine.name, f"{engine.url}/v1")


def scored(engine, variables, draws, temperature: float = 1.0) -> list[np.ndarray]:
    """dew_pipe's log-probabilities of each draw's sampled ids (packed, as a trainer scores)."""
    sessions = [
        Session(0, i, 0, 0, [d.call()], "COMPLETED", 0.0, detail="") for i, d in enumerate(draws)
    ]
    batch = pack(sessions, WIDTH, rows=len(draws), estimator="mean")
    objective = GRPOObjective(
        engine.pretrained.model,
        seq_len=WIDTH - 1,
        sampling_temperature=None if temperature == 1.0 else temperature,
    )
    columns = {
        k: jnp.asarray(batch[k]) for k in ("input_ids", "text_segment_ids", "text_positions")
    }
    scores = np.asarray(jax.jit(objective.packed_log_probs)(variables, columns))
    out = []
    for i, draw in enumerate(draws):
        where = (batch["session_index"] == i) & (batch["response_mask"] > 0)
        out.append(scores[where])
        np.testing.assert_array_equal(batch["behavior_log_probs"][where], draw.behavior_log_probs)
    return out


def wait_until_engine_has(engine, futures, timeout: float = 60.0) -> None:
    """Waits until vLLM runs or queues every request of ``futures`` (or they finished)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not all(f.done() for f in futures):
        with urllib.request.urlopen(f"{engine.url}/metrics", timeout=10) as response:
            text = response.read().decode()
        held = sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(("vllm:num_requests_running{", "vllm:num_requests_waiting{"))
        )
        if held >= sum(not f.done() for f in futures):
            return
        time.sleep(0.01)


def filtered(logits: np.ndarray, top_k: int) -> np.ndarray:
    """log_softmax over the top-k logits of each row (-inf elsewhere), in float64."""
    kth = np.sort(logits, axis=-1)[:, -top_k][:, None]
    kept = np.where(logits >= kth, logits, -np.inf)
    return kept - np.logaddexp.reduce(kept, axis=-1, keepdims=True)


def test_token_draws_equal_own_scoring(vllm_engine):
    engine = vllm_engine
    server = OpenAIRolloutServer(completion(engine), Sampling(eos_id=engine.task.eos_id), Weights())
    try:
        futures = [server.submit(p, 10, seed=11 + i) for i, p in enumerate(PROMPTS)]
        draws = [f.result(timeout=120) for f in futures]
        again = server.submit(PROMPTS[0], 10, seed=11).result(timeout=120)
    finally:
        server.close()
    for prompt, draw in zip(PROMPTS, draws, strict=True):
        assert draw.prompt_ids.tolist() == prompt and draw.version == 0 and draw.log_probs is None
        if draw.finish_reason == "stop":
            assert draw.sampled_ids[-1] == engine.task.eos_id
        else:
            assert draw.sampled_ids.size == 10 and engine.task.eos_id not in draw.sampled_ids
    assert again.sampled_ids.tolist() == draws[0].sampled_ids.tolist()  # seeded
    own = scored(engine, engine.variables, draws)
    worst = max(
        float(np.abs(d.behavior_log_probs - o).max()) for d, o in zip(draws, own, strict=True)
    )
    print(f"largest |vLLM - dew_pipe| log-probability: {worst:.2e}")  # the docstring's figure
    for draw, mine in zip(draws, own, strict=True):
        np.testing.assert_allclose(draw.behavior_log_probs, mine, atol=ATOL, rtol=0)


def test_temperature_needs_processed_logprobs(vllm_engine):
    engine = vllm_engine
    sampling = Sampling(temperature=0.7)
    with pytest.raises(ValueError, match="processed_logprobs"):
        OpenAIRolloutServer(completion(engine), sampling, Weights())
    server = OpenAIRolloutServer(completion(engine), sampling, Weights(), processed_logprobs=True)
    try:
        draws = [server.submit(p, 8, seed=3).result(timeout=120) for p in PROMPTS[:2]]
    finally:
        server.close()
    for draw, own in zip(draws, scored(engine, engine.variables, draws, 0.7), strict=True):
        np.testing.assert_allclose(draw.behavior_log_probs, own, atol=ATOL, rtol=0)


def test_eos_ends_a_draw_and_is_kept(vllm_engine):
    engine = vllm_engine
    free = OpenAIRolloutServer(completion(engine), Sampling(), Weights())
    try:
        ids = free.submit(PROMPTS[2], 12, seed=5).result(timeout=120).sampled_ids.tolist()
    finally:
        free.close()
    eos = ids[3]  # same seed, same draw: it now stops at the first occurrence of this id
    stopping = OpenAIRolloutServer(completion(engine), Sampling(eos_id=eos), Weights())
    try:
        draw = stopping.submit(PROMPTS[2], 12, seed=5).result(timeout=120)
    finally:
        stopping.close()
    assert draw.finish_reason == "stop" and draw.sampled_ids.tolist() == ids[: ids.index(eos) + 1]


def test_generate_route_filtered_likelihoods_and_versions(vllm_engine):
    engine = vllm_engine
    sampling = Sampling(top_k=4)
    with pytest.raises(ValueError, match="top_k"):
        VLLMGenerateServer(engine.url, Sampling(), Weights())
    server = VLLMGenerateServer(engine.url, sampling, Weights(version=0))
    try:
        draws = [server.submit(p, 8, seed=9 + i).result(timeout=120) for i, p in enumerate(PROMPTS)]
    finally:
        server.close()
    forward = jax.jit(engine.pretrained.model.apply)
    for prompt, draw in zip(PROMPTS, draws, strict=True):
        ids = [*prompt, *draw.sampled_ids[:-1].tolist()]
        tokens = np.zeros((1, WIDTH), np.int32)
        tokens[0, : len(ids)] = ids  # right padding: causal attention never reads it
        logits = np.asarray(forward(engine.variables, jnp.asarray(tokens)), np.float64)[0]
        own = filtered(logits[len(prompt) - 1 :], 4)[
            np.arange(draw.sampled_ids.size), draw.sampled_ids
        ]
        np.testing.assert_allclose(draw.behavior_log_probs, own, atol=ATOL, rtol=0)
        assert draw.support is None  # vLLM's CPU build cannot build the sampling mask
        assert draw.version == 0  # "default" (launch) or "0" (restored): version 0


def test_push_read_back_by_engine_and_load_pretrained(vllm_engine):
    engine = vllm_engine
    moved = jax.tree.map(
        lambda x: 1.2 * x + 0.05 * jnp.cos(jnp.arange(x.size).reshape(x.shape)), engine.variables
    )
    push = SafetensorsReload(engine.pretrained, engine.directory, [engine.url], "vllm", timeout=120)
    weights = Publication(push)
    sampling = Sampling(eos_id=engine.task.eos_id)
    server = OpenAIRolloutServer(completion(engine), sampling, weights)
    generate = VLLMGenerateServer(engine.url, Sampling(top_k=50), weights)
    try:
        # Draws in flight when the push lands: /pause?mode=wait lets them finish on the old
        # weights, so they keep the version they were submitted under.
        before = [server.submit(p, 40, seed=1) for p in PROMPTS]
        wait_until_engine_has(engine, before)  # a request still in our queue would be
        server.load(moved, 1)  # held by the pause and drawn from the new weights
        after = [server.submit(p, 10, seed=1).result(timeout=120) for p in PROMPTS]
        spans = generate.submit(PROMPTS[0], 6, seed=2).result(timeout=120)
        before = [f.result(timeout=120) for f in before]
        served = load_pretrained(engine.directory).variables
    finally:
        server.close()
        generate.close()
        engine.restore()
    assert weights.version == 1 and push.timings["publish"] > 0
    expected = jax.tree.map(lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32), moved)
    for got, want in zip(jax.tree.leaves(served), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)  # bfloat16 on disk, read back
    assert {d.version for d in before} == {0} and {d.version for d in after} == {1}
    assert spans.version == 1  # the token route's weight_versions span says "1"
    for draw, own in zip(before, scored(engine, engine.variables, before), strict=True):
        np.testing.assert_allclose(draw.behavior_log_probs, own, atol=ATOL, rtol=0)
    for draw, own in zip(after, scored(engine, served, after), strict=True):
        np.testing.assert_allclose(draw.behavior_log_probs, own, atol=ATOL, rtol=0)
    stale = scored(engine, engine.variables, after)  # the old weights do not explain them
    assert (
        max(np.abs(d.behavior_log_probs - s).max() for d, s in zip(after, stale, strict=True)) > 0.1
    )


def test_engine_refusals_and_cancellation(vllm_engine):
    engine = vllm_engine
    server = OpenAIRolloutServer(completion(engine), Sampling(), Weights(), max_in_flight=4)
    try:
        with pytest.raises(EngineError, match="400") as caught:
            server.submit([5, 600], 4, seed=0).result(timeout=60)  # outside the vocabulary
        assert caught.value.status == 400
        capped = server.submit([5] * 40, 40, seed=0).result(timeout=60)
        assert capped.finish_reason == "length"  # vLLM caps a draw at --max-model-len (64)
        assert capped.sampled_ids.size <= 64 - 40
        # A draw on its way can be cancelled. A quiet machine's vLLM may finish its 62 ids
        # within 10 ms, before the cancel, so try shorter waits until one cancel lands.
        cancelled = []
        for seed, wait in enumerate((0.01, 0.005, 0.002, 0.0)):
            long = server.submit([5, 6], 60, seed=seed)
            time.sleep(wait)
            if long.cancel():
                cancelled.append(wait)
                assert long.cancelled()
                break
            assert long.result(timeout=60).sampled_ids.size > 0  # it finished first
        assert cancelled, "no draw could be cancelled, even right after submitting it"
        draw = server.submit([5, 6], 3, seed=0).result(timeout=60)  # the engine still serves
        assert draw.sampled_ids.size == 3
        pending = [server.submit([5, 6], 60, seed=s) for s in range(6)]
    finally:
        server.close()
    for future in pending:  # closing fails (or had finished) every draw, none hangs
        assert future.done()
        if future.exception() is not None:
            assert isinstance(future.exception(), RuntimeError)
    with pytest.raises(RuntimeError, match="closed"):
        server.submit([5], 2)


def test_models_route_names_the_served_model(vllm_engine):
    models = JSONClient(vllm_engine.url).get("/v1/models")
    assert [m["id"] for m in models["data"]] == [vllm_engine.name]
    assert models["data"][0]["root"] == str(vllm_engine.directory)


def test_concurrent_draws_share_the_engine(vllm_engine):
    engine = vllm_engine
    server = OpenAIRolloutServer(completion(engine), Sampling(), Weights(), max_in_flight=16)
    try:
        start = time.monotonic()
        futures = [server.submit(PROMPTS[i % 4], 16, seed=i) for i in range(16)]
        draws = [f.result(timeout=120) for f in cf.as_completed(futures)]
        elapsed = time.monotonic() - start
    finally:
        server.close()
    assert len(draws) == 16 and all(d.sampled_ids.size == 16 for d in draws)
    assert elapsed < 60
