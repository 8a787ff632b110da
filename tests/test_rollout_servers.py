"""The native rollout server: continuous batching, likelihoods, reloads, seeds, failures.

Draws are checked against an uncached forward pass (raw and behavior log-probabilities,
supports) and against `generate` (greedy ids). Interleavings that matter (a request joining
a running batch, a reload in the middle of a draw, cancellation, close) are made
deterministic with `GatedServer`, whose decode calls each wait for a permit.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from serving_helpers import (
    PROBES,
    GatedServer,
    Reference,
    bfloat16_model,
    choose_eos,
    greedy_references,
    other_weights,
    tiny_model,
    until_eos,
    wait_for,
)

from dew_pipe.inference import (
    Draw,
    NativeRolloutServer,
    RolloutServer,
    Server,
    ServeTask,
    TextGeneration,
    served_precision,
)
from dew_pipe.inference.decoding import LayerCache
from dew_pipe.sampling import Sampling

SAMPLING = Sampling(temperature=0.7, top_k=6)  # no EOS: every draw runs to its budget
OPTIONS = dict(slots=4, capacity=24, steps_per_call=2, record_support=True)
P1, P2, P3 = [5, 9, 2, 17, 30, 4], [11, 3, 8], [21]


@pytest.fixture(scope="module")
def tiny():
    model, variables = tiny_model(0)
    return model, variables, other_weights(variables), Reference(model)


@pytest.fixture(scope="module")
def server(tiny):
    model, variables, _, _ = tiny
    server = Server.from_task(ServeTask(model, variables, SAMPLING), **OPTIONS)
    yield server
    server.close()


@pytest.fixture
def gated(tiny):
    """A fresh gated server with the module server's compiled shapes (no new compile)."""
    model, variables, _, _ = tiny
    server = GatedServer(model, variables, SAMPLING, **OPTIONS)
    yield server
    server.permits.release(10_000)
    server.close()


def check_against_reference(draw: Draw, reference: Reference, variables, prompt, budget):
    raw, behavior, support = reference.draw(variables, prompt, draw.sampled_ids, SAMPLING)
    assert draw.prompt_ids.tolist() == prompt
    assert draw.sampled_ids.size == budget and draw.finish_reason == "length"
    assert not draw.stopped
    np.testing.assert_allclose(draw.log_probs, raw, atol=2e-5, rtol=0)
    np.testing.assert_allclose(draw.behavior_log_probs, behavior, atol=2e-5, rtol=0)
    assert [s.tolist() for s in draw.support] == [s.tolist() for s in support]
    assert all(t in s for t, s in zip(draw.sampled_ids, draw.support, strict=True))


# ------------------------------------------------------------------ draws and likelihoods


def test_draws_carry_the_raw_and_behavior_likelihoods_of_an_uncached_reference(server, tiny):
    _, variables, _, reference = tiny
    jobs = [(P1, 7, 1), (P2, 12, 2), (P3, 5, 3), (P2, 1, 4)]
    futures = [server.submit(p, budget, seed=seed) for p, budget, seed in jobs]
    for (prompt, budget, seed), future in zip(jobs, futures, strict=True):
        draw = future.result(timeout=120)
        check_against_reference(draw, reference, variables, prompt, budget)
        assert (draw.version, draw.submitted_version, draw.seed) == (0, 0, seed)
        call = draw.call()
        assert call.version == 0 and call.finish_reason == "length"
        np.testing.assert_array_equal(call.log_probs, draw.log_probs)
    counters = server.counters()
    assert counters.finished >= len(jobs) and counters.active == 0 and counters.waiting == 0


def test_draws_from_the_server_are_read_only_arrays_of_the_checked_dtypes(server):
    draw = server.submit(P1, 4, seed=2).result(timeout=120)
    arrays = (draw.prompt_ids, draw.sampled_ids, draw.behavior_log_probs, draw.log_probs)
    assert [a.dtype for a in arrays] == [np.int32, np.int32, np.float32, np.float32]
    assert [a.shape for a in arrays] == [(6,), (4,), (4,), (4,)]
    assert not any(a.flags.writeable for a in arrays)
    rebuilt = Draw(
        draw.prompt_ids.tolist(),
        draw.sampled_ids.tolist(),
        draw.behavior_log_probs.tolist(),
        draw.finish_reason,
        draw.version,
        draw.submitted_version,
        log_probs=draw.log_probs.tolist(),
        seed=draw.seed,
    )  # what the checked constructor makes of the same values
    for name in ("prompt_ids", "sampled_ids", "behavior_log_probs", "log_probs"):
        np.testing.assert_array_equal(getattr(draw, name), getattr(rebuilt, name))
    assert (draw.finish_reason, draw.version, draw.routed_experts) == (
        rebuilt.finish_reason,
        rebuilt.version,
        None,
    )
    assert len(draw.support) == 4  # this server records each id's kept ids
    assert all(k.dtype == np.int32 and not k.flags.writeable for k in draw.support)
    call = draw.call()
    np.testing.assert_array_equal(call.sampled_ids, draw.sampled_ids)
    assert call.version == draw.version


def _server_built(prompt, ids, behavior, raw, *, support=None):
    from dew_pipe.inference.servers.interface import server_draw

    arrays = [np.array(prompt, np.int32), np.array(ids, np.int32)]
    likelihoods = [
        np.array(behavior, np.float32),
        None if raw is None else np.array(raw, np.float32),
    ]
    return server_draw(*arrays, likelihoods[0], "length", 3, 3, likelihoods[1], support=support)


@pytest.mark.parametrize("raw", [[-0.5, -1.25], None])
def test_a_server_built_draw_gives_the_call_the_checked_constructor_gives(raw, monkeypatch):
    import pickle

    from dew_pipe.objectives.rl.sessions import Call

    draw = _server_built([4, 9, 1], [7, 0], [-0.25, -2.0], raw)
    checked = Call([4, 9, 1], [7, 0], [-0.25, -2.0], "length", 3, log_probs=raw)

    def unchecked(self):
        raise AssertionError("the server checked these arrays already")

    monkeypatch.setattr(Call, "__post_init__", unchecked)  # the marked draw skips them
    for made in (draw.call(), pickle.loads(pickle.dumps(draw)).call()):  # as the process server
        assert made == checked and type(made.version) is int and made.routed_experts is None
        for name in ("prompt_ids", "sampled_ids", "behavior_log_probs", "log_probs"):
            got, want = getattr(made, name), getattr(checked, name)
            if want is None:
                assert got is None
                continue
            assert got.dtype == want.dtype and got.tobytes() == want.tobytes()
            assert not got.flags.writeable


@pytest.mark.parametrize(
    "prompt, ids, behavior, raw, error",
    [
        ([4, 9], [7, 2], [-0.25, np.nan], None, "Call.behavior_log_probs: expected finite"),
        ([4, 9], [7, 2], [-0.25, -1.0], [-np.inf, -1.0], "Call.log_probs: expected finite"),
        ([4, -9], [7, 2], [-0.25, -1.0], None, "Call.prompt_ids: expected ids in"),
        ([4, 9], [7, -2], [-0.25, -1.0], None, "Call.sampled_ids: expected ids in"),
    ],
)
def test_a_server_built_draw_that_fails_the_call_checks_still_raises(
    prompt, ids, behavior, raw, error
):
    import pickle

    draw = _server_built(prompt, ids, behavior, raw)
    for made in (draw, pickle.loads(pickle.dumps(draw))):
        with pytest.raises(ValueError, match=error):
            made.call()


def test_a_server_built_draw_with_support_goes_through_the_checks():
    support = (np.array([7, 3], np.int32), np.array([5], np.int32))  # 2 is not in its support
    draw = _server_built([4, 9], [7, 2], [-0.25, -1.0], None, support=support)
    with pytest.raises(ValueError, match=r"Call.support\[1\]: the sampled id 2 is not in"):
        draw.call()


def test_a_seed_fixes_the_draw_whatever_shares_the_batch(server):
    alone = server.submit(P1, 10, seed=11).result(timeout=120)
    mates = [server.submit(P2, 12, seed=s) for s in (1, 2)]
    again = server.submit(P1, 10, seed=11)
    mates += [server.submit(P3, 3, seed=s) for s in (3, 4, 5)]
    crowded = again.result(timeout=120)
    np.testing.assert_array_equal(crowded.sampled_ids, alone.sampled_ids)
    np.testing.assert_allclose(crowded.log_probs, alone.log_probs, atol=1e-5, rtol=0)
    np.testing.assert_allclose(
        crowded.behavior_log_probs, alone.behavior_log_probs, atol=1e-5, rtol=0
    )
    others = [server.submit(P1, 10, seed=s).result(timeout=120) for s in (12, 13)]
    assert any(not np.array_equal(o.sampled_ids, alone.sampled_ids) for o in others)
    for future in mates:
        future.result(timeout=120)


def test_the_cache_is_kept_per_layer_and_updated_in_place(server):
    # A stacked cache would be sliced into layers and stacked back by every decode call
    # (two copies of the whole cache per call); the server keeps one array per layer.
    cache = server._cache
    assert isinstance(cache, LayerCache) and len(cache.keys) == server.model.config.num_layers
    pointers = [x.unsafe_buffer_pointer() for x in jax.tree.leaves(cache)]
    server.submit(P1, 9, seed=5).result(timeout=120)  # a prefill and several decode calls
    after = [x.unsafe_buffer_pointer() for x in jax.tree.leaves(server._cache)]
    assert after == pointers


def test_host_inputs_reuse_each_compiled_step(server):
    """The server hands its per-call inputs to the compiled steps as host arrays; a repeat
    of the same joins and decode calls finds every step compiled already."""
    from dew_pipe.inference.servers import engine_steps

    def serve():  # one request at a time: the same joining shapes every round
        for prompt, seed in ((P1, 21), (P2, 22), (P3, 23)):
            server.submit(prompt, 5, seed=seed).result(timeout=120)

    serve()
    before = compiled(engine_steps)
    serve()
    assert compiled(engine_steps) == before
    leaves = jax.tree.leaves((server._cache, server._state))
    assert {leaf.devices().pop() for leaf in leaves} == {server.device}


def compiled(engine_steps) -> tuple[int, int, int, int]:
    """Compiled shapes so far of the server's steps (encode, place, begin, advance)."""
    steps = (engine_steps.encode, engine_steps.place, engine_steps.begin, engine_steps.advance)
    return tuple(step._cache_size() for step in steps)


def test_warm_up_compiles_every_shape_before_serving_and_changes_no_draw(tiny):
    """A warmed-up server compiles each prefill shape (distinct-prompt bucket x prompt
    width, joining-row bucket x distinct-prompt bucket) and the decode call once, in its
    constructor; joins of any size then compile nothing, and the draws are those of a
    server that compiles as it goes."""
    from dew_pipe.inference.servers import engine_steps

    model, variables, _, _ = tiny
    options = dict(OPTIONS, capacity=20, buckets=(8, 20))  # shapes no other test compiles
    task = ServeTask(model, variables, Sampling(temperature=0.8, top_k=5))  # nor sampling
    before = compiled(engine_steps)
    warm = Server.from_task(task, warm_up=True, **options)
    try:
        after = compiled(engine_steps)
        # encode: prompt buckets 1, 2, 4 at widths 8 and 20; place: (1, 1), (2, 1), (2, 2),
        # (4, 1), (4, 2), (4, 4); begin: 1, 2, 4; one decode call
        assert tuple(a - b for a, b in zip(after, before, strict=True)) == (6, 6, 3, 1)
        assert warm.counters().prefills == warm.counters().steps == 0
        long = [3, *range(1, 12)]  # 12 ids: the width-20 bucket
        requests = [(P1, 31), (long, 32), (P2, 33), (P3, 34), (long[:9], 35), (P1, 36)]
        requests += [(P2, 37), (P2, 38), (P2, 39)]  # one prompt's group: a shared prefill

        def serve(server):
            draws = [server.submit(P2, 4, seed=30).result(timeout=120)]  # one row alone
            futures = [server.submit(p, 4, seed=s) for p, s in requests]  # joins of 1-4
            return draws + [f.result(timeout=120) for f in futures]

        warm_draws = serve(warm)
        assert compiled(engine_steps) == after
        assert warm.counters().prefills >= 2
    finally:
        warm.close()
    cold = Server.from_task(task, **options)
    try:
        cold_draws = serve(cold)
    finally:
        cold.close()
    for a, b in zip(warm_draws, cold_draws, strict=True):
        np.testing.assert_array_equal(a.sampled_ids, b.sampled_ids)
        np.testing.assert_array_equal(a.log_probs, b.log_probs)


# ------------------------------------------------------------------ joins and reloads


def test_a_request_joins_the_running_batch_and_a_reload_lands_mid_draw(gated, tiny):
    _, variables, new_variables, reference = tiny
    x = gated.submit(P1, 9, seed=3)
    wait_for(lambda: gated.parked == 1, what="x to start")
    gated.permits.release(2)  # two calls: x has 1 + 2 + 2 ids
    wait_for(lambda: gated.parked == 3, what="two decode calls")
    y = gated.submit(P2, 4, seed=4)  # queued behind the call waiting for its permit
    reloader = threading.Thread(target=gated.reload, args=(new_variables, 1))
    reloader.start()
    wait_for(lambda: bool(gated._reloads), what="the reload to be queued")
    gated.permits.release(1)  # x's ids 5 and 6 on the old weights; then reload, y joins
    reloader.join(timeout=120)
    assert not reloader.is_alive() and gated.version == 1
    gated.permits.release(100)
    dx, dy = x.result(timeout=120), y.result(timeout=120)

    # x: ids 0..6 come from the old weights; ids 7 and 8 from the new ones, which read
    # the keys and values the old weights left in x's cache. Its version is the oldest.
    assert (dx.version, dx.submitted_version) == (0, 0)
    old = reference.draw(variables, P1, dx.sampled_ids, SAMPLING)[0]
    switched = reference.switched(variables, new_variables, P1, dx.sampled_ids, fed_old=6)
    np.testing.assert_allclose(dx.log_probs, np.r_[old[:7], switched], atol=2e-5, rtol=0)
    assert not np.allclose(dx.log_probs[7:], old[7:], atol=1e-3)
    # y was submitted under version 0 but every id came from version 1.
    assert (dy.version, dy.submitted_version) == (1, 0)
    check_against_reference(dy, reference, new_variables, P2, 4)

    counters = gated.counters()
    assert counters.reloads == 1 and counters.version == 1
    assert counters.joined == 2 and counters.joined_mid_flight == 1
    assert counters.rows_per_step.get(2, 0) >= 1  # x and y decoded in one step
    assert counters.steps == sum(counters.rows_per_step.values())
    after = gated.submit(P3, 2, seed=5)
    gated.permits.release(10)
    assert (after.result(timeout=120).version, after.result().submitted_version) == (1, 1)


def test_a_push_returns_at_once_ordered_before_later_submissions(gated, tiny):
    _, variables, new_variables, reference = tiny
    x = gated.submit(P1, 6, seed=3)
    wait_for(lambda: gated.parked == 1, what="x's first decode call")
    given = jax.tree.map(jnp.copy, new_variables)
    pushed = gated.reload(given, 1, wait=False)
    for leaf in jax.tree.leaves(given):
        leaf.delete()  # the caller donates its arrays as soon as the push returns
    # Not applied yet (the thread is inside a decode call), yet version 1 is announced.
    assert not pushed.done() and gated.version == 1 and gated.counters().version == 0
    y = gated.submit(P2, 4, seed=4)  # after the push: must start on its weights
    gated.permits.release(100)
    assert pushed.result(timeout=120) == 1
    dx, dy = x.result(timeout=120), y.result(timeout=120)
    assert (dy.version, dy.submitted_version) == (1, 1)
    check_against_reference(dy, reference, new_variables, P2, 4)
    assert (dx.version, dx.submitted_version) == (0, 0)  # its first ids: version 0
    counters = gated.counters()
    assert counters.version == 1 and counters.reloads == 1


def test_pushes_queued_at_one_step_all_resolve_and_the_newest_serves(gated, tiny):
    _, variables, new_variables, reference = tiny
    x = gated.submit(P1, 4, seed=3)
    wait_for(lambda: gated.parked == 1, what="x's first decode call")
    first = gated.reload(new_variables, 1, wait=False)
    second = gated.reload(variables, 2, wait=False)
    third = gated.reload(new_variables, wait=False)  # None: one more than announced
    y = gated.submit(P2, 4, seed=4)
    gated.permits.release(100)
    assert [f.result(timeout=120) for f in (first, second, third)] == [1, 2, 3]
    x.result(timeout=120)
    dy = y.result(timeout=120)
    assert (dy.version, dy.submitted_version) == (3, 3)
    check_against_reference(dy, reference, new_variables, P2, 4)
    assert gated.counters().reloads == 3 and gated.counters().version == 3


def test_a_push_still_pending_fails_when_the_server_closes(gated, tiny):
    _, _, new_variables, _ = tiny
    gated.submit(P1, 16, seed=3)
    wait_for(lambda: gated.parked == 1, what="a decode call")
    pushed = gated.reload(new_variables, 4, wait=False)
    closer = threading.Thread(target=gated.close)
    closer.start()
    gated.permits.release(1)  # the call in progress ends; the thread stops before the push
    closer.join(timeout=120)
    assert isinstance(pushed.exception(timeout=120), RuntimeError)
    assert "closed" in str(pushed.exception())


def test_reload_refuses_a_tree_that_does_not_match(server, tiny):
    _, variables, _, _ = tiny
    params = variables["params"]
    wrong_shape = {"params": {**params, "embed": jnp.zeros((3, 3))}}
    with pytest.raises(ValueError, match=r"\['params'\]\['embed'\] has shape \(3, 3\)"):
        server.reload(wrong_shape)
    as_ints = {"params": {**params, "embed": params["embed"].astype(jnp.int32)}}
    with pytest.raises(TypeError, match="expected a floating dtype"):
        server.reload(as_ints)
    missing = {"params": {k: v for k, v in params.items() if k != "embed"}}
    with pytest.raises(ValueError, match="tree structure"):
        server.reload(missing)
    with pytest.raises(TypeError, match="expected a variables mapping"):
        server.reload(params)
    with pytest.raises(ValueError, match="version is -1"):
        server.reload(variables, version=-1)
    assert server.counters().reloads == 0


# ------------------------------------------------------------------ cancel, close, failure


def test_cancel_withdraws_a_queued_request_and_frees_a_running_row(gated):
    a = gated.submit(P1, 16, seed=0)
    wait_for(lambda: gated.parked == 1, what="a to start")
    others = [gated.submit(P2, 3, seed=s) for s in (1, 2, 3)]
    queued = gated.submit(P3, 3, seed=4)  # joins only once a row is free
    wait_for(lambda: gated.counters().waiting == 4, what="four queued")
    assert a.cancel() and queued.cancel()
    gated.permits.release(100)
    for future in others:
        assert future.result(timeout=120).sampled_ids.size == 3
    wait_for(lambda: gated.counters().active == 0, what="rows to empty")
    counters = gated.counters()
    assert counters.cancelled == 2 and counters.finished == 3 and counters.joined == 4
    with pytest.raises(cf.CancelledError):
        a.result()
    assert queued.cancelled()


def test_close_fails_pending_draws_and_joins_the_thread(gated):
    futures = [gated.submit(P1, 16, seed=s) for s in range(6)]
    wait_for(lambda: gated.parked == 1, what="a draw to start")
    closer = threading.Thread(target=gated.close)
    closer.start()
    gated.permits.release(1)  # the call in progress ends; the thread then stops
    closer.join(timeout=120)
    assert not closer.is_alive() and not gated._thread.is_alive()
    for future in futures:
        with pytest.raises(RuntimeError, match="closed before this request finished"):
            future.result(timeout=1)
    assert gated.counters().failed == 6
    with pytest.raises(RuntimeError, match="is closed"):
        gated.submit(P1, 2)
    with pytest.raises(RuntimeError, match="is closed"):
        gated.reload(gated.variables)
    gated.close()  # idempotent


def test_a_failure_in_the_server_thread_fails_every_draw_and_the_next_submit(gated):
    boom = OSError("device lost")
    gated.fail_with = boom
    futures = [gated.submit(P1, 8, seed=s) for s in range(6)]
    gated.permits.release(1)
    for future in futures:
        error = future.exception(timeout=120)
        assert isinstance(error, RuntimeError) and error.__cause__ is boom
        assert "OSError: device lost" in str(error)
    with pytest.raises(RuntimeError, match="thread failed") as info:
        gated.submit(P1, 2)
    assert info.value.__cause__ is boom
    with pytest.raises(RuntimeError, match="thread failed"):
        gated.reload(gated.variables)
    gated._thread.join(timeout=60)
    assert not gated._thread.is_alive()


def test_a_full_queue_blocks_submit_until_a_row_takes_a_request(tiny):
    model, variables, _, _ = tiny
    server = GatedServer(model, variables, SAMPLING, queue=1, **OPTIONS)
    try:
        first = server.submit(P1, 4, seed=0)
        wait_for(lambda: server.parked == 1, what="the first draw to start")
        second = server.submit(P2, 4, seed=1)  # fills the queue
        third: list = []
        blocked = threading.Thread(target=lambda: third.append(server.submit(P3, 4, seed=2)))
        blocked.start()
        blocked.join(timeout=0.3)
        assert blocked.is_alive() and not third  # waiting for room in the queue
        server.permits.release(1)  # after this call the second request joins a row
        blocked.join(timeout=120)
        assert not blocked.is_alive() and len(third) == 1
        server.permits.release(100)
        for future in (first, second, third[0]):
            assert future.result(timeout=120).sampled_ids.size == 4
    finally:
        server.permits.release(10_000)
        server.close()


def test_submit_from_a_done_callback_never_waits_for_the_server_itself(tiny):
    model, variables, _, _ = tiny
    server = GatedServer(model, variables, SAMPLING, queue=1, **OPTIONS)
    outcomes: list = []

    def resubmit(future):  # runs on the server thread, which is the one that makes room
        try:
            outcomes.append(server.submit(P3, 2, seed=8))
            outcomes.append(server.submit(P3, 2, seed=9))
        except RuntimeError as error:
            outcomes.append(error)

    try:
        first = server.submit(P3, 2, seed=7)  # needs one gated decode call to finish
        first.add_done_callback(resubmit)
        server.permits.release(100)
        first.result(timeout=120)
        wait_for(lambda: len(outcomes) == 2, what="the callback")
        assert isinstance(outcomes[0], cf.Future)
        assert isinstance(outcomes[1], RuntimeError) and "queue is full" in str(outcomes[1])
        assert outcomes[0].result(timeout=120).sampled_ids.size == 2
    finally:
        server.permits.release(10_000)
        server.close()


# ------------------------------------------------------------------ submitting many at once


def test_submit_many_draws_what_submit_draws_and_takes_seeds_from_the_same_stream(tiny):
    model, variables, _, _ = tiny
    prompts, budgets = (P1, P2, P3, P2), 4

    def draws(many, **seeds):
        server = Server(model, variables, SAMPLING, seed=11, **OPTIONS)
        try:
            if many:
                futures = server.submit_many(prompts, budgets, **seeds)
            else:
                given = seeds.get("seeds") or [None] * len(prompts)
                futures = [
                    server.submit(p, budgets, seed=s) for p, s in zip(prompts, given, strict=True)
                ]
            return [f.result(timeout=120) for f in futures]
        finally:
            server.close()

    for seeds in ({}, {"seeds": [3, None, 5, None]}):  # the server's stream fills the Nones
        one, many = draws(False, **seeds), draws(True, **seeds)
        assert [d.seed for d in one] == [d.seed for d in many]
        for a, b in zip(one, many, strict=True):
            np.testing.assert_array_equal(a.prompt_ids, b.prompt_ids)
            np.testing.assert_array_equal(a.sampled_ids, b.sampled_ids)
            np.testing.assert_allclose(a.log_probs, b.log_probs, atol=1e-6, rtol=0)
    assert [d.seed for d in many][::2] == [3, 5]


def test_submit_many_starts_an_idle_burst_in_one_prefill(tiny):
    server = gated_with(tiny)  # no gathering window: single submits would start at once
    try:
        futures = server.submit_many([P1, P2, P3, P1], 3, seeds=[0, 1, 2, 3])
        wait_for(lambda: server.parked == 1, what="the burst to start")
        counters = server.counters()
        assert (counters.prefills, counters.joined, counters.active) == (1, 4, 4)
        server.permits.release(100)
        assert [f.result(timeout=120).sampled_ids.size for f in futures] == [3, 3, 3, 3]
    finally:
        server.permits.release(10_000)
        server.close()


def test_submit_many_larger_than_the_queue_waits_for_room_chunk_by_chunk(tiny):
    model, variables, _, _ = tiny
    server = GatedServer(model, variables, SAMPLING, queue=2, **OPTIONS)
    try:
        prompts = [P1, P2, P3] * 3  # 9 requests: 4 rows, then a queue of 2
        got: list = []
        caller = threading.Thread(
            target=lambda: got.append(server.submit_many(prompts, 3, seeds=list(range(9))))
        )
        caller.start()
        wait_for(lambda: server.parked == 1, what="the first four to start")
        caller.join(timeout=0.3)
        assert caller.is_alive() and not got  # blocked with the queue full, not past it
        assert server.counters().waiting == 2
        server.permits.release(10_000)
        caller.join(timeout=120)
        assert not caller.is_alive() and len(got[0]) == 9
        assert [f.result(timeout=120).seed for f in got[0]] == list(range(9))
    finally:
        server.permits.release(10_000)
        server.close()


def test_submit_many_refuses_bad_arguments_before_queueing_any(server):
    before = server.counters()
    with pytest.raises(TypeError, match=r"prompts\[1\]: prompt_ids has dtype float"):
        server.submit_many([P1, [1.5, 2.0], P2], 3)
    with pytest.raises(ValueError, match=r"seeds has 1 entries for 2 prompts"):
        server.submit_many([P1, P2], 3, seeds=[4])
    with pytest.raises(ValueError, match=r"seeds\[1\]: seed is -1"):
        server.submit_many([P1, P2], 3, seeds=[4, -1])
    with pytest.raises(ValueError, match="max_new_tokens is 0"):
        server.submit_many([P1, P2], 0)
    after = server.counters()
    assert (after.finished, after.failed, after.waiting) == (
        before.finished,
        before.failed,
        before.waiting,
    )
    # A prompt the server cannot serve fails its own future; the others are drawn.
    good, bad, last = server.submit_many([P1, [0, 40], P2], 3, seeds=[1, 2, 3])
    with pytest.raises(ValueError, match=r"ids in \[0, 40\].*vocab_size"):
        bad.result(timeout=5)
    assert (
        good.result(timeout=120).sampled_ids.size == last.result(timeout=120).sampled_ids.size == 3
    )
    assert server.counters().failed == before.failed + 1
    assert server.submit_many([], 3) == []


def test_submit_many_from_a_done_callback_never_waits_for_the_server_itself(tiny):
    model, variables, _, _ = tiny
    server = GatedServer(model, variables, SAMPLING, queue=1, **OPTIONS)
    outcomes: list = []

    def resubmit(future):  # the server thread: a full queue would wait for itself
        try:
            outcomes.append(server.submit_many([P3, P3], 2, seeds=[8, 9]))
        except RuntimeError as error:
            outcomes.append(error)

    try:
        first = server.submit(P3, 2, seed=7)
        first.add_done_callback(resubmit)
        server.permits.release(100)
        first.result(timeout=120)
        wait_for(lambda: len(outcomes) == 1, what="the callback")
        assert isinstance(outcomes[0], RuntimeError) and "queue is full" in str(outcomes[0])
    finally:
        server.permits.release(10_000)
        server.close()


def test_native_rollout_server_submits_many_through_its_server(tiny):
    model, variables, _, _ = tiny
    native = NativeRolloutServer(Server(model, variables, SAMPLING, **OPTIONS))
    try:
        futures = native.submit_many([P1, P2], 3, seeds=[5, 6])
        alone = native.submit(P1, 3, seed=5).result(timeout=120)
        np.testing.assert_array_equal(futures[0].result(timeout=120).sampled_ids, alone.sampled_ids)
        assert futures[1].result(timeout=120).seed == 6
    finally:
        native.close()


# ------------------------------------------------------------------ gathering a burst


def gated_with(tiny, **options):
    model, variables, _, _ = tiny
    return GatedServer(model, variables, SAMPLING, **{**OPTIONS, **options})


def test_an_idle_server_gathers_a_burst_into_one_prefill(tiny):
    server = gated_with(tiny, gather_s=60.0)
    try:
        first = [server.submit(p, 3, seed=s) for s, p in enumerate((P1, P2, P3))]
        threading.Event().wait(0.3)  # far less than the window: nothing may start
        assert server.counters().prefills == 0 and server.parked == 0
        last = server.submit(P2, 3, seed=3)  # the fourth request fills every free row
        wait_for(lambda: server.parked == 1, what="the burst to start")
        counters = server.counters()
        assert (counters.prefills, counters.joined, counters.active) == (1, 4, 4)
        server.permits.release(100)
        for future in (*first, last):
            assert future.result(timeout=120).sampled_ids.size == 3
    finally:
        server.permits.release(10_000)
        server.close()


def test_a_push_during_the_gather_window_does_not_start_the_burst_early(tiny):
    """A weight push wakes an idle server; it applies the push and keeps gathering, so the
    requests that arrive after it still start in the same prefill as those before."""
    model, variables, _, _ = tiny
    server = gated_with(tiny, gather_s=60.0)
    try:
        first = [server.submit(p, 3, seed=s) for s, p in enumerate((P1, P2))]
        assert server.reload(variables, 1, wait=False).result(timeout=60) == 1
        threading.Event().wait(0.3)  # the push has landed; the window is still open
        assert server.counters().prefills == 0 and server.parked == 0
        rest = [server.submit(p, 3, seed=2 + s) for s, p in enumerate((P3, P1))]
        wait_for(lambda: server.parked == 1, what="the burst to start")
        counters = server.counters()
        assert (counters.prefills, counters.joined, counters.reloads) == (1, 4, 1)
        server.permits.release(100)
        for future in (*first, *rest):
            assert future.result(timeout=120).version == 1
    finally:
        server.permits.release(10_000)
        server.close()


def test_draws_of_one_prompt_that_join_together_share_its_prefill(tiny):
    """A group's draws joining in one prefill run their prompt through the decoder once;
    each still draws from its own seed exactly what it draws alone, checked against the
    uncached reference."""
    model, variables, _, reference = tiny
    prompts, seeds = [P1, P2, P1, P1], [50, 51, 52, 53]
    server = Server(model, variables, SAMPLING, **OPTIONS)
    try:
        shared = [f.result(timeout=120) for f in server.submit_many(prompts, 5, seeds=seeds)]
        counters = server.counters()
        alone = [
            server.submit(p, 5, seed=s).result(timeout=120)
            for p, s in zip(prompts, seeds, strict=True)
        ]
        after = server.counters()
    finally:
        server.close()
    assert (counters.prefills, counters.joined, counters.prompts_prefilled) == (1, 4, 2)
    assert (after.prefills - counters.prefills, after.prompts_prefilled) == (4, 6)
    for together, single, prompt in zip(shared, alone, prompts, strict=True):
        np.testing.assert_array_equal(together.sampled_ids, single.sampled_ids)
        np.testing.assert_allclose(together.log_probs, single.log_probs, atol=1e-6, rtol=0)
        check_against_reference(together, reference, variables, prompt, 5)
    assert len({tuple(d.sampled_ids) for d in shared[::2]}) == 2  # P1's draws differ


def serve_in_waves(tiny, join_rows):
    """Eight draws of mixed budgets on 4 rows, started as one gathered burst of four."""
    server = Server(tiny[0], tiny[1], SAMPLING, gather_s=60.0, join_rows=join_rows, **OPTIONS)
    try:
        budgets = (2, 3, 5, 6, 6, 5, 3, 2)
        futures = [server.submit(P2, b, seed=40 + i) for i, b in enumerate(budgets)]
        draws = [future.result(timeout=120) for future in futures]
        return draws, server.counters()
    finally:
        server.close()


def test_join_rows_lets_a_wave_finish_before_the_next_joins(tiny):
    each, each_counts = serve_in_waves(tiny, join_rows=1)
    waves, wave_counts = serve_in_waves(tiny, join_rows=4)
    # One row at a time: the queued draws join as rows finish, while others decode.
    assert each_counts.joined_mid_flight >= 2 and each_counts.prefills >= 3
    # join_rows=slots: the second four join together once the first four have all ended.
    assert (wave_counts.prefills, wave_counts.joined, wave_counts.joined_mid_flight) == (2, 8, 0)
    assert wave_counts.prefills < each_counts.prefills
    # ...at the price of idle rows: the waves take more steps of fewer busy rows.
    assert wave_counts.steps > each_counts.steps and max(wave_counts.rows_per_step) == 4
    # The policy moves draws between calls and rows, never changes what they sample.
    for a, b in zip(each, waves, strict=True):
        np.testing.assert_array_equal(a.sampled_ids, b.sampled_ids)
        np.testing.assert_allclose(a.log_probs, b.log_probs, atol=1e-5, rtol=0)


def test_the_window_starts_a_partial_burst_once_the_oldest_request_waited_it(tiny):
    server = gated_with(tiny, gather_s=0.4)
    try:
        start = threading.Event()
        submitted = cf.Future()

        def late():  # a second request 0.1 s into the first one's window
            start.wait()
            threading.Event().wait(0.1)
            submitted.set_result(server.submit(P2, 2, seed=1))

        helper = threading.Thread(target=late)
        helper.start()
        began = time.monotonic()
        early = server.submit(P1, 2, seed=0)
        start.set()
        wait_for(lambda: server.parked == 1, what="the window to end")
        waited = time.monotonic() - began
        helper.join()
        counters = server.counters()
        assert waited >= 0.4 and (counters.prefills, counters.joined) == (1, 2)
        server.permits.release(100)
        assert early.result(timeout=120).sampled_ids.size == 2
        assert submitted.result().result(timeout=120).sampled_ids.size == 2
    finally:
        server.permits.release(10_000)
        server.close()


def test_a_busy_server_never_waits_for_a_window(tiny):
    server = gated_with(tiny, gather_s=60.0)
    try:
        # Four requests fill the rows and start at once; one of them ends after one call.
        running = [server.submit(P1, 6, seed=s) for s in range(3)]
        running.append(server.submit(P2, 2, seed=3))
        wait_for(lambda: server.parked == 1, what="the first call")
        joiner = server.submit(P3, 2, seed=9)  # joins the freed row, not after 60 s
        server.permits.release(1)
        wait_for(lambda: server.parked == 2, what="the second call")
        counters = server.counters()
        assert (counters.prefills, counters.joined_mid_flight, counters.active) == (2, 1, 4)
        server.permits.release(100)
        for future in (*running, joiner):
            future.result(timeout=120)
    finally:
        server.permits.release(10_000)
        server.close()


# ------------------------------------------------------------------ bad input


def test_bad_requests_fail_their_future_or_raise(server):
    too_long = server.submit(list(range(1, 21)), 6)  # 20 + 6 - 1 = 25 > capacity 24
    with pytest.raises(ValueError, match=r"needs 25 cache positions.*capacity is 24.*19 ids"):
        too_long.result(timeout=5)
    with pytest.raises(ValueError, match=r"ids in \[0, 40\].*vocab_size"):
        server.submit([0, 40], 2).result(timeout=5)
    with pytest.raises(ValueError, match="nonempty 1-D"):
        server.submit([], 2).result(timeout=5)
    with pytest.raises(TypeError, match="prompt_ids has dtype float"):
        server.submit([1.5, 2.0], 2)
    with pytest.raises(ValueError, match="max_new_tokens is 0"):
        server.submit([1, 2], 0)
    with pytest.raises(TypeError, match="max_new_tokens is 2.0"):
        server.submit([1, 2], 2.0)
    for seed in (-1, 2**32, True):
        with pytest.raises(ValueError, match="seed is"):
            server.submit([1, 2], 2, seed=seed)
    assert server.counters().failed >= 3


@pytest.mark.parametrize(
    "options, error, match",
    [
        (dict(slots=0), ValueError, "slots is 0"),
        (dict(capacity=33), ValueError, "max_seq_len=32"),
        (dict(queue=0), ValueError, "queue is 0"),
        (dict(steps_per_call=1.5), TypeError, "steps_per_call is 1.5"),
        (dict(dtype=jnp.int32), ValueError, "expected a floating dtype"),
        (dict(dtype="fast"), TypeError, "expected a floating dtype or 'auto'"),
        (dict(buckets=(8, 4)), ValueError, "buckets is"),
        (dict(sampling=Sampling(eos_id=40)), ValueError, "vocab_size=32"),
        (dict(sampling="greedy"), TypeError, "expected a dew_pipe.sampling.Sampling"),
        (dict(gather_s=-0.5), ValueError, "gather_s is -0.5"),
        (dict(gather_s=float("nan")), ValueError, "gather_s is nan"),
        (dict(join_rows=0), ValueError, "join_rows is 0"),
        (dict(join_rows=3), ValueError, "join_rows is 3; expected at most slots=2"),
        (dict(join_rows=True), TypeError, "join_rows is True"),
        (dict(warm_up="yes"), TypeError, "warm_up is 'yes'; expected a bool"),
    ],
)
def test_bad_options_are_refused_before_any_thread_starts(tiny, options, error, match):
    model, variables, _, _ = tiny
    options = {"slots": 2, "capacity": 16, **options}
    sampling = options.pop("sampling", None)
    before = threading.active_count()
    with pytest.raises(error, match=match):
        Server(model, variables, sampling, **options)
    assert threading.active_count() == before


def test_from_task_reads_a_text_generation_and_copies_its_weights(server, tiny):
    model, variables, _, _ = tiny
    policy = TextGeneration(model, variables, record_support=True)
    with Server.from_task(
        policy, sampling=SAMPLING, slots=4, capacity=24, steps_per_call=2
    ) as other:
        assert other.record_support and other.sampling == SAMPLING
        pointers = [x.unsafe_buffer_pointer() for x in jax.tree.leaves(other.variables)]
        assert not set(pointers) & {x.unsafe_buffer_pointer() for x in jax.tree.leaves(variables)}
        mine = other.submit(P2, 5, seed=21).result(timeout=120)
    theirs = server.submit(P2, 5, seed=21).result(timeout=120)
    np.testing.assert_array_equal(mine.sampled_ids, theirs.sampled_ids)


def test_from_task_needs_a_model_and_variables():
    with pytest.raises(TypeError, match="expected an object with model and variables"):
        Server.from_task(object(), slots=2, capacity=16)
    with pytest.raises(TypeError, match="expected a dew_pipe.inference.Server"):
        NativeRolloutServer(object())


# ------------------------------------------------------------------ bfloat16, greedy, EOS


@pytest.fixture(scope="module")
def bf16(tiny):
    """A greedy bfloat16 server over float32 variables, with an EOS pair from the probes."""
    model, variables, new_variables, _ = tiny
    served = bfloat16_model(model)
    cast = jax.tree.map(lambda x: x.astype(jnp.bfloat16), variables)
    refs = greedy_references(served, cast)
    eos, probes = choose_eos(refs)
    sampling = Sampling(eos_id=eos, temperature=0)
    native = NativeRolloutServer(
        Server.from_task(
            ServeTask(model, variables, sampling),
            slots=2,
            capacity=24,
            dtype=jnp.bfloat16,
            steps_per_call=4,
        )
    )
    yield native, served, refs, eos, probes
    native.close()


def test_bfloat16_greedy_draws_equal_generate_and_stop_on_either_eos(bf16):
    native, _, refs, eos, probes = bf16
    assert isinstance(native, RolloutServer)
    config = native.server.model.config
    assert config.param_dtype == jnp.bfloat16
    # on a CPU the activations and cache stay float32 (bfloat16 elementwise ops are emulated)
    assert config.dtype == (jnp.float32 if native.server.device.platform == "cpu" else jnp.bfloat16)
    futures = [native.submit(PROBES[i], 8, seed=i) for i in probes]
    draws = [f.result(timeout=120) for f in futures]
    for i, draw in zip(probes, draws, strict=True):
        expected = until_eos(refs[i], eos)
        assert draw.sampled_ids.tolist() == expected
        assert draw.finish_reason == ("stop" if expected[-1] in eos else "length")
        np.testing.assert_array_equal(draw.behavior_log_probs, 0.0)  # greedy: certain
    assert [d.sampled_ids[-1] for d in draws[:2]] == list(eos)  # each EOS id ends a draw
    assert draws[2].finish_reason == "length" and draws[2].sampled_ids.size == 8


def test_served_precision_is_bfloat16_only_where_the_cpu_multiplies_it_natively():
    assert served_precision("cpu", frozenset({"avx2", "fma"})) == np.float32
    assert served_precision("cpu", frozenset({"avx2", "avx512f", "avx512bw"})) == np.float32
    assert served_precision("cpu", frozenset({"avx512f", "avx512_bf16"})) == jnp.bfloat16
    assert served_precision("cpu", frozenset({"amx_bf16", "amx_tile"})) == jnp.bfloat16
    assert served_precision("gpu", frozenset()) == jnp.bfloat16


def test_auto_serves_in_this_machines_precision(tiny):
    model, variables, _, _ = tiny
    task = ServeTask(model, variables, SAMPLING)
    with Server.from_task(task, slots=2, capacity=24, dtype="auto") as server:
        want = served_precision(server.device.platform)
        assert server.dtype == want
        assert {leaf.dtype for leaf in jax.tree.leaves(server.variables)} == {want}
        assert server.submit(P1, 3, seed=0).result(timeout=120).sampled_ids.size == 3


def test_load_casts_float32_weights_into_the_served_bfloat16_buffers_in_place(bf16, tiny):
    native, served, _, eos, _ = bf16
    _, _, new_variables, _ = tiny
    leaves = jax.tree.leaves(native.server.variables)
    assert all(leaf.dtype == jnp.bfloat16 for leaf in leaves)
    pointers = [leaf.unsafe_buffer_pointer() for leaf in leaves]
    pushed = native.load(new_variables, 5)
    assert native.version == 5  # at once, before the push has served
    assert pushed.result(timeout=120) == 5 and native.counters().reloads == 1
    reloaded = jax.tree.leaves(native.server.variables)
    assert [leaf.unsafe_buffer_pointer() for leaf in reloaded] == pointers  # in place
    for got, given in zip(reloaded, jax.tree.leaves(new_variables), strict=True):
        assert not given.is_deleted()  # the caller's float32 arrays are untouched
        np.testing.assert_array_equal(
            np.asarray(got, np.float32), np.asarray(given.astype(jnp.bfloat16), np.float32)
        )
    refs = greedy_references(served, jax.tree.map(lambda x: x.astype(jnp.bfloat16), new_variables))
    futures = [native.submit(p, 8, seed=0) for p in PROBES]
    draws = [f.result(timeout=120) for f in futures]
    for ref, draw in zip(refs, draws, strict=True):
        assert draw.sampled_ids.tolist() == until_eos(ref, eos)
        assert (draw.version, draw.submitted_version) == (5, 5)
    with pytest.raises(ValueError, match="version is -2"):
        native.load(new_variables, -2)


def test_docstring_examples_run():
    import doctest
    import importlib

    attempted = 0
    for name in (
        "servers.interface",
        "servers.engine_setup",
        "prompt_source",
        "reward_function",
    ):
        module = importlib.import_module(f"dew_pipe.inference.{name}")
        failed, tried = doctest.testmod(module)
        assert failed == 0, name
        attempted += tried
    assert attempted >= 5
