"""ProcessRolloutServer: the native server in a child process, behind the RolloutServer API.

Draws are checked against an uncached forward pass of the same weights (raw and behavior
log-probabilities) and against the in-process `Server` for the same seeds; a push is
checked the same way under the new weights. Failure paths: bad arguments (raised here,
before anything is sent), bad prompts (the child's ValueError, carried back), a child that
dies (every waiting caller fails), close with draws in flight. One child serves most tests
(its start and compiles cost a few seconds); the failure tests start their own.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal

import jax.numpy as jnp
import numpy as np
import pytest
from serving_helpers import Reference, other_weights, tiny_model, wait_for

from dew_pipe.inference import (
    ProcessRolloutServer,
    RolloutServer,
    Server,
    ServerCounters,
    ServeTask,
)
from dew_pipe.sampling import Sampling

SAMPLING = Sampling(temperature=0.7, top_k=6)  # no EOS: every draw runs to its budget
OPTIONS = dict(slots=4, capacity=24, steps_per_call=2)
PROMPTS = ([5, 9, 2, 17, 30, 4], [11, 3, 8], [21], [7, 7, 1, 29], [14, 2])


@pytest.fixture(scope="module")
def tiny():
    model, variables = tiny_model(0)
    return model, variables, other_weights(variables), Reference(model)


@pytest.fixture(scope="module")
def child(tiny):
    model, variables, _, _ = tiny
    server = ProcessRolloutServer(
        ServeTask(model, variables, SAMPLING),
        cpus={0},
        env={"DEW_PIPE_MARK": "child"},
        warm_up=True,  # compiled before the start is reported: no stall in any test below
        **OPTIONS,
    )
    assert server.counters().prefills == 0  # the warm-up's padding prefills count nothing
    yield server
    server.close()


def check_likelihoods(draw, reference, variables, prompt, budget):
    raw, behavior, _ = reference.draw(variables, prompt, draw.sampled_ids, SAMPLING)
    assert draw.prompt_ids.tolist() == prompt
    assert draw.sampled_ids.size == budget and draw.finish_reason == "length"
    np.testing.assert_allclose(draw.log_probs, raw, atol=2e-5, rtol=0)
    np.testing.assert_allclose(draw.behavior_log_probs, behavior, atol=2e-5, rtol=0)


def test_draws_match_an_uncached_reference_and_the_in_process_server(child, tiny):
    model, variables, _, reference = tiny
    assert isinstance(child, RolloutServer)
    futures = [child.submit(p, 6, seed=s) for s, p in enumerate(PROMPTS)]
    draws = [f.result(timeout=120) for f in futures]
    with Server.from_task(ServeTask(model, variables, SAMPLING), **OPTIONS) as local:
        expected = [local.submit(p, 6, seed=s).result(timeout=120) for s, p in enumerate(PROMPTS)]
    for prompt, draw, same in zip(PROMPTS, draws, expected, strict=True):
        check_likelihoods(draw, reference, variables, prompt, 6)
        assert draw.sampled_ids.tolist() == same.sampled_ids.tolist()  # the seed fixes it
        assert (draw.version, draw.submitted_version) == (0, 0)
    counters = child.counters()
    assert isinstance(counters, ServerCounters) and counters.finished >= len(PROMPTS)


def test_submit_many_equals_submit_on_each_and_checks_every_entry(child):
    seeds = list(range(40, 40 + len(PROMPTS)))
    one_by_one = [child.submit(p, 5, seed=s) for p, s in zip(PROMPTS, seeds, strict=True)]
    together = child.submit_many(PROMPTS, 5, seeds=seeds)
    assert len(together) == len(PROMPTS)
    for single, batched in zip(one_by_one, together, strict=True):
        a, b = single.result(timeout=120), batched.result(timeout=120)
        assert a.sampled_ids.tolist() == b.sampled_ids.tolist()
        # Rows prefilled in other company sum in another order: float rounding apart.
        np.testing.assert_allclose(a.log_probs, b.log_probs, atol=1e-5, rtol=0)
        assert b.seed == a.seed
    # A prompt the child cannot serve fails its own future; the rest are drawn.
    mixed = child.submit_many([PROMPTS[0], list(range(1, 21)), PROMPTS[1]], 6, seeds=[1, 2, 3])
    with pytest.raises(ValueError, match=r"needs 25 cache positions.*capacity is 24"):
        mixed[1].result(timeout=120)
    assert [f.result(timeout=120).sampled_ids.size for f in (mixed[0], mixed[2])] == [6, 6]
    before = child.counters().finished
    with pytest.raises(TypeError, match=r"prompts\[1\]: prompt_ids has dtype float"):
        child.submit_many([[1, 2], [1.5, 2.0]], 2)
    with pytest.raises(ValueError, match=r"seeds has 1 entries for 2 prompts"):
        child.submit_many([[1, 2], [3]], 2, seeds=[0])
    with pytest.raises(ValueError, match=r"seeds\[1\]: seed is -1"):
        child.submit_many([[1, 2], [3]], 2, seeds=[0, -1])
    with pytest.raises(ValueError, match="max_new_tokens is 0"):
        child.submit_many([[1, 2]], 0)
    assert child.submit_many([], 3) == []
    assert child.counters().finished == before  # nothing was sent


def test_submit_many_past_the_childs_room_goes_in_parts(tiny):
    model, variables, _, _ = tiny
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(11)]
    with ProcessRolloutServer(
        ServeTask(model, variables, SAMPLING), queue=2, **OPTIONS
    ) as server:  # room for 2 + 4 unfinished draws
        futures = server.submit_many(prompts, 4, seeds=list(range(11)))
        draws = [f.result(timeout=120) for f in futures]
        alone = [server.submit(prompts[i], 4, seed=i).result(timeout=120) for i in (0, 7, 10)]
    assert [d.prompt_ids.tolist() for d in draws] == prompts
    assert [draws[i].sampled_ids.tolist() for i in (0, 7, 10)] == [
        d.sampled_ids.tolist() for d in alone
    ]


def test_the_child_runs_on_the_cores_and_environment_it_was_given(child):
    assert child.info["pid"] == child.pid != os.getpid()
    assert os.sched_getaffinity(child.pid) == {0} and child.info["cpus"] == [0]
    with open(f"/proc/{child.pid}/environ", "rb") as f:
        assert b"DEW_PIPE_MARK=child" in f.read().split(b"\0")
    assert "DEW_PIPE_MARK" not in os.environ


def test_load_serves_new_weights_from_the_next_draw_and_moves_the_version(tiny):
    model, variables, new_variables, reference = tiny
    with ProcessRolloutServer(ServeTask(model, variables, SAMPLING), **OPTIONS) as server:
        before = server.submit(PROMPTS[0], 4, seed=1).result(timeout=120)
        pushed = server.load(new_variables, 7)  # returns without waiting for the child
        assert server.version == 7
        # Submitted before the push is known to have served: it starts on its weights.
        after = server.submit(PROMPTS[0], 4, seed=1).result(timeout=120)
        check_likelihoods(after, reference, new_variables, PROMPTS[0], 4)
        assert (after.version, after.submitted_version) == (7, 7)
        assert pushed.result(timeout=120) == 7 and server.counters().reloads == 1
        assert before.version == 0 and not np.allclose(before.log_probs, after.log_probs)
        with pytest.raises(ValueError, match="version is -1"):
            server.load(new_variables, -1)
        params = variables["params"]
        with pytest.raises(ValueError, match=r"\['params'\]\['embed'\] has shape \(3, 3\)"):
            server.load({"params": {**params, "embed": jnp.zeros((3, 3))}}, 8)
        with pytest.raises(TypeError, match="expected a floating dtype"):
            server.load({"params": {**params, "embed": params["embed"].astype(jnp.int32)}}, 8)
        with pytest.raises(TypeError, match="expected a variables mapping"):
            server.load(params, 8)
        assert server.version == 7 and server.counters().reloads == 1  # nothing was sent


def test_cancel_releases_the_request_in_the_child(child):
    before = child.counters()
    futures = [child.submit(PROMPTS[1], 16, seed=s) for s in range(12)]  # more than slots
    cancelled = [f for f in futures[4:] if f.cancel()]
    assert cancelled  # nothing has come back this early
    for future in futures:
        if future not in cancelled:
            assert future.result(timeout=120).sampled_ids.size == 16
    for future in cancelled:
        with pytest.raises(cf.CancelledError):
            future.result()

    def settled():
        counters = child.counters()
        return counters.active == 0 and counters.waiting == 0

    wait_for(settled, what="the child to drain")
    after = child.counters()
    # Each request ended in the child exactly once: drawn to the end, or dropped on cancel
    # (a cancel that arrives after the draw finished leaves it finished).
    ended = after.finished + after.cancelled - before.finished - before.cancelled
    assert ended == 12 and after.cancelled - before.cancelled <= len(cancelled)


def test_bad_requests_raise_here_or_fail_their_future(child):
    with pytest.raises(ValueError, match=r"needs 25 cache positions.*capacity is 24"):
        child.submit(list(range(1, 21)), 6).result(timeout=120)
    with pytest.raises(ValueError, match=r"ids in \[0, 40\].*vocab_size"):
        child.submit([0, 40], 2).result(timeout=120)
    with pytest.raises(TypeError, match="prompt_ids has dtype float"):
        child.submit([1.5, 2.0], 2)
    with pytest.raises(ValueError, match="max_new_tokens is 0"):
        child.submit([1, 2], 0)
    for seed in (-1, 2**32, True):
        with pytest.raises(ValueError, match="seed is"):
            child.submit([1, 2], 2, seed=seed)


@pytest.mark.parametrize(
    "options, error, match",
    [
        (dict(cpus={4096}), ValueError, "cpus is"),
        (dict(cpus=set()), ValueError, "cpus is"),
        (dict(cpus=3), TypeError, "cpus is 3"),
        (dict(device="cpu"), TypeError, "device is not an option"),
        (dict(env=["XLA_FLAGS"]), TypeError, "env is"),
        (dict(env={"OMP_NUM_THREADS": 1}), TypeError, "env is"),
        (dict(start_timeout="5"), ValueError, "start_timeout is '5'"),
        (dict(start_timeout=0), ValueError, "start_timeout is 0"),
    ],
)
def test_bad_options_are_refused_before_a_child_starts(tiny, options, error, match):
    model, variables, _, _ = tiny
    with pytest.raises(error, match=match):
        ProcessRolloutServer(ServeTask(model, variables, SAMPLING), **{**OPTIONS, **options})


def test_options_the_child_server_refuses_raise_its_error_here(tiny):
    model, variables, _, _ = tiny
    with pytest.raises(ValueError, match="max_seq_len=32"):  # checked by Server, in the child
        ProcessRolloutServer(ServeTask(model, variables, SAMPLING), slots=2, capacity=33)
    with pytest.raises(TypeError, match="warm_up is 1; expected a bool"):
        ProcessRolloutServer(ServeTask(model, variables, SAMPLING), slots=2, capacity=8, warm_up=1)


def test_a_dead_child_fails_every_waiting_caller_and_later_requests(tiny):
    model, variables, _, _ = tiny
    server = ProcessRolloutServer(ServeTask(model, variables, SAMPLING), **OPTIONS)
    try:
        server.submit(PROMPTS[0], 2, seed=0).result(timeout=120)  # compiled and serving
        futures = [server.submit(PROMPTS[0], 16, seed=s) for s in range(40)]
        pushed = server.load(variables, 1)  # in flight behind the draws
        os.kill(server.pid, signal.SIGKILL)
        error = pushed.exception(timeout=120)  # served before the kill, or failed with it
        assert error is None or "exited with code -9" in str(error)
        for future in futures:  # each finished before the kill or failed with the exit
            error = future.exception(timeout=120)
            assert error is None or "exited with code -9" in str(error)
        assert any(f.exception() is not None for f in futures)
        with pytest.raises(RuntimeError, match="exited with code -9"):
            server.submit(PROMPTS[0], 2)
        with pytest.raises(RuntimeError, match="exited with code -9"):
            server.load(variables, 1)
        with pytest.raises(RuntimeError, match="exited with code -9"):
            server.counters()
    finally:
        server.close()


def test_close_fails_unfinished_draws_and_is_idempotent(tiny):
    model, variables, _, _ = tiny
    server = ProcessRolloutServer(ServeTask(model, variables, SAMPLING), **OPTIONS)
    futures = [server.submit(PROMPTS[2], 16, seed=s) for s in range(40)]
    server.close()
    assert server._process.returncode == 0
    outcomes = [f.exception(timeout=1) for f in futures]  # all resolved by close
    for error in outcomes:
        assert error is None or "closed before this request finished" in str(error)
    assert any(error is not None for error in outcomes)
    with pytest.raises(RuntimeError, match="is closed"):
        server.submit(PROMPTS[0], 2)
    with pytest.raises(RuntimeError, match="is closed"):
        server.load(variables, 1)
    server.close()  # idempotent


def test_a_child_that_cannot_start_is_reported():
    with pytest.raises(RuntimeError, match="exited with code"):
        ProcessRolloutServer(
            ServeTask(None, {"params": {}}, SAMPLING),
            slots=1,
            capacity=8,
            python="/bin/false",
        )


def test_docstring_example_of_the_worker_runs():
    import doctest

    from dew_pipe.inference.servers import process_worker

    failed, tried = doctest.testmod(process_worker)
    assert failed == 0 and tried >= 1
