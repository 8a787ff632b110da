"""Compiled generation and TextGeneration against an uncached forward pass, step by step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_sampling import log_softmax, reference_filtered

from dew_pipe import models
from dew_pipe.inference import Generation, TextGeneration, decode_step, generate
from dew_pipe.inference.generation import Generated
from dew_pipe.objectives.rl.sessions import Call
from dew_pipe.sampling import Sampling

CONFIG = dict(
    vocab_size=32,
    emb_features=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    mlp_features=48,
    max_seq_len=32,
    qk_norm=True,
    tie_embeddings=True,
    init_std=0.3,  # spread logits: greedy choices far from ties
)
PROMPTS = [[5, 9, 2, 17, 30, 4], [11, 3, 8], [21]]
WIDTH = 6
PAD = 31


def left_padded(prompts, width=WIDTH, pad=PAD):
    out = np.full((len(prompts), width), pad, np.int32)
    for b, p in enumerate(prompts):
        out[b, width - len(p) :] = p
    return out, np.array([len(p) for p in prompts], np.int32)


@pytest.fixture(scope="module")
def setup():
    model = models.build("causal_transformer", **CONFIG)
    variables = model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))

    @jax.jit
    def forward(variables, tokens, segments):
        return model.apply(variables, tokens, segments)

    def full_logits(variables, ids):
        """Uncached logits of one sequence ([len(ids), V]), right-padded to one shape."""
        tokens = np.zeros((1, CONFIG["max_seq_len"]), np.int32)
        segments = np.zeros_like(tokens)
        tokens[0, : len(ids)], segments[0, : len(ids)] = ids, 1
        return np.asarray(forward(variables, tokens, segments))[0, : len(ids)]

    return model, variables, full_logits


def naive_greedy(full_logits, variables, prompt, steps):
    """Re-runs the whole uncached forward for every new id and takes the argmax."""
    ids, lps = [], []
    for _ in range(steps):
        logits = full_logits(variables, list(prompt) + ids)[-1]
        ids.append(int(logits.argmax()))
        lps.append(log_softmax(logits)[ids[-1]])
    return ids, np.array(lps)


# ---------------------------------------------------------------- generate


def test_greedy_equals_a_naive_uncached_loop_and_stops_at_eos(setup):
    model, variables, full_logits = setup
    steps = 5
    refs = [naive_greedy(full_logits, variables, p, steps) for p in PROMPTS]
    eos = (refs[0][0][2], refs[1][0][0])  # a tuple: row 0 stops by step 2, row 1 at once
    prompts, lengths = left_padded(PROMPTS)
    budgets = np.array([steps, steps, 2])  # per-row budgets within one compiled width
    out = generate(
        model, variables, prompts, lengths, budgets, jax.random.key(0), Sampling(eos, 0), pad_id=PAD
    )
    assert out.ids.shape == (3, steps)
    stops = 0
    for b, (ids, lps) in enumerate(refs):
        hits = [i for i, t in enumerate(ids) if t in eos and i < budgets[b]]
        n = hits[0] + 1 if hits else budgets[b]
        stops += bool(hits)
        assert int(out.lengths[b]) == n and bool(out.stopped[b]) == bool(hits)
        np.testing.assert_array_equal(out.ids[b, :n], ids[:n])
        np.testing.assert_allclose(out.log_probs[b, :n], lps[:n], atol=2e-5)
        np.testing.assert_array_equal(out.behavior_log_probs[b], np.zeros(steps))
        np.testing.assert_array_equal(out.ids[b, n:], PAD)
        np.testing.assert_array_equal(out.log_probs[b, n:], 0.0)
    assert 1 <= stops < len(PROMPTS)  # both a natural stop and a budget stop were covered
    assert out.support is None


def test_sampled_ids_carry_raw_and_filtered_log_probs(setup):
    model, variables, full_logits = setup
    controls = dict(temperature=0.7, top_k=5, top_p=0.9)
    prompts, lengths = left_padded(PROMPTS)
    out = generate(
        model, variables, prompts, lengths, 6, jax.random.key(4), Sampling(**controls), support=True
    )
    for b, prompt in enumerate(PROMPTS):
        n = int(out.lengths[b])
        assert n == 6 and not out.stopped[b]
        ids = [int(i) for i in out.ids[b, :n]]
        logits = full_logits(variables, prompt + ids)[len(prompt) - 1 : -1]  # predicts each id
        want = reference_filtered(logits, **controls)
        rows = np.arange(n)
        np.testing.assert_allclose(out.log_probs[b, :n], log_softmax(logits)[rows, ids], atol=2e-5)
        np.testing.assert_allclose(out.behavior_log_probs[b, :n], want[rows, ids], atol=2e-5)
        np.testing.assert_array_equal(np.asarray(out.support[b, :n]), np.isfinite(want))


def test_first_draw_frequencies_match_behavior_probabilities(setup):
    model, variables, full_logits = setup
    rows = 2048
    prompt = PROMPTS[1]
    prompts, lengths = left_padded([prompt] * rows, width=len(prompt))
    sampling = Sampling(temperature=1.5, top_k=6)
    out = generate(model, variables, prompts, lengths, 1, jax.random.key(7), sampling)
    probs = np.exp(reference_filtered(full_logits(variables, prompt)[-1:], 1.5, top_k=6)[0])
    counts = np.bincount(np.asarray(out.ids[:, 0]), minlength=probs.size)
    assert (counts[probs == 0] == 0).all()
    expected = rows * probs[probs > 0]
    chi2 = ((counts[probs > 0] - expected) ** 2 / expected).sum()
    assert chi2 < 25.7  # chi-square quantile at p = 1e-4 for 5 degrees of freedom
    np.testing.assert_allclose(
        np.exp(out.behavior_log_probs[:, 0]), probs[np.asarray(out.ids[:, 0])], rtol=1e-5
    )


@pytest.mark.parametrize("lanes", [2, 3])
def test_lanes_give_the_one_call_greedy_outputs(setup, lanes):
    model, variables, _ = setup
    prompts, lengths = left_padded(PROMPTS)
    budgets = np.array([5, 3, 4])  # per-row budgets; with 2 lanes the second is padded
    one = generate(model, variables, prompts, lengths, budgets, jax.random.key(0), Sampling(7, 0))
    split = generate(
        model, variables, prompts, lengths, budgets, jax.random.key(0), Sampling(7, 0), lanes=lanes
    )
    for field in ("ids", "lengths", "stopped", "behavior_log_probs"):
        np.testing.assert_array_equal(getattr(split, field), getattr(one, field), err_msg=field)
    np.testing.assert_allclose(split.log_probs, one.log_probs, atol=1e-6)
    assert split.support is None


def test_each_lane_samples_its_rows_with_its_own_key(setup):
    model, variables, _ = setup
    prompts, lengths = left_padded(PROMPTS)
    key, sampling = jax.random.key(3), Sampling(temperature=1.3, top_k=8)
    split = generate(model, variables, prompts, lengths, 4, key, sampling, support=True, lanes=2)
    assert split.ids.shape == (3, 4) and split.support.shape == (3, 4, CONFIG["vocab_size"])
    for lane, rows in enumerate(([0, 1], [2, 2])):  # lane 1: row 2 and its padding copy
        alone = generate(
            model,
            variables,
            prompts[rows],
            lengths[rows],
            4,
            jax.random.fold_in(key, lane),
            sampling,
            support=True,
        )
        kept = slice(2 * lane, min(2 * lane + 2, 3))
        real = len(range(3)[kept])
        for field in Generated._fields:
            np.testing.assert_array_equal(
                getattr(split, field)[kept], getattr(alone, field)[:real], err_msg=field
            )


@pytest.mark.parametrize("lanes", [1, 2])
def test_repeats_draw_what_the_repeated_prompts_draw(setup, lanes):
    """One prefill per prompt, its cache copied to the G rows of its group: the same draws
    as the prompts repeated G times, with per-row budgets and EOS stops mixed in."""
    model, variables, _ = setup
    prompts, lengths = left_padded(PROMPTS)
    groups, key = 3, jax.random.key(5)
    sampling = Sampling(eos_id=(4, 9), temperature=1.4, top_k=12)
    budgets = np.array([6, 2, 5, 4, 6, 1, 3, 6, 5])  # [B * G], each group mixed
    repeated = generate(
        model,
        variables,
        np.repeat(prompts, groups, 0),
        np.repeat(lengths, groups),
        budgets,
        key,
        sampling,
        support=True,
        pad_id=PAD,
    )
    shared = generate(
        model, variables, prompts, lengths, budgets, key, sampling, support=True, pad_id=PAD,
        repeats=groups,
    )  # fmt: skip
    if lanes > 1:  # lanes take whole groups: the lanes' keys give other draws, same shapes
        shared = generate(
            model, variables, prompts, lengths, budgets, key, sampling, pad_id=PAD,
            repeats=groups, lanes=lanes,
        )  # fmt: skip
        first = generate(
            model, variables, prompts[:2], lengths[:2], budgets[:6], jax.random.fold_in(key, 0),
            sampling, pad_id=PAD, repeats=groups,
        )  # fmt: skip
        second = generate(
            model, variables, prompts[2:], lengths[2:], budgets[6:], jax.random.fold_in(key, 1),
            sampling, pad_id=PAD, repeats=groups,
        )  # fmt: skip
        repeated = Generated(
            *(
                None if a is None else np.concatenate([a, b])
                for a, b in zip(first, second, strict=True)
            )
        )
    assert shared.ids.shape == (len(PROMPTS) * groups, 6)
    for field in ("ids", "lengths", "stopped", "support"):
        want, got = getattr(repeated, field), getattr(shared, field)
        if want is None:
            assert got is None, field
            continue
        np.testing.assert_array_equal(got, want, err_msg=field)
    for field in ("log_probs", "behavior_log_probs"):  # a few float32 ulps: batch shapes
        np.testing.assert_allclose(
            getattr(shared, field), getattr(repeated, field), rtol=1e-6, atol=1e-6
        )
    out = np.asarray(shared.ids)
    assert len({tuple(row) for row in out}) > len(PROMPTS)  # groups' rows differ: own noise
    assert bool(np.asarray(shared.stopped).any()) and not bool(np.asarray(shared.stopped).all())
    np.testing.assert_array_equal(np.asarray(shared.lengths) <= budgets, True)


def test_repeats_prefill_each_prompt_once(setup):
    """The prefill's projections run on the B prompts' B * P positions, not B * G * P (the
    leading dimension of the compiled call's matmuls, read off its jaxpr)."""
    model, variables, _ = setup
    prompts, lengths = left_padded(PROMPTS)
    groups = 4

    def rows(prompts, lengths, **kwargs):
        jaxpr = jax.make_jaxpr(
            lambda v: generate(model, v, prompts, lengths, 3, jax.random.key(0), **kwargs).ids
        )(variables)
        dots = (eq for eq in _equations(jaxpr.jaxpr) if eq.primitive.name == "dot_general")
        return {eq.outvars[0].aval.shape[0] for eq in dots}

    prompt_positions = len(PROMPTS) * WIDTH
    shared = rows(prompts, lengths, repeats=groups)
    assert prompt_positions in shared and prompt_positions * groups not in shared, shared
    repeated = rows(np.repeat(prompts, groups, 0), np.repeat(lengths, groups))
    assert prompt_positions * groups in repeated, repeated


def _equations(jaxpr):
    """Every equation of a jaxpr, nested ones (jit, loops, conds) included."""
    for eq in jaxpr.eqns:
        yield eq
        for value in eq.params.values():
            inner = getattr(value, "jaxpr", None)
            if inner is not None:
                yield from _equations(getattr(inner, "jaxpr", inner))
            elif isinstance(value, tuple | list):
                for item in value:
                    inner = getattr(item, "jaxpr", None)
                    if inner is not None:
                        yield from _equations(getattr(inner, "jaxpr", inner))


@pytest.mark.parametrize("split_layers", [True, False])
def test_decode_step_leaves_a_finished_rows_cache_alone(setup, split_layers):
    model, variables, _ = setup
    prompts, lengths = left_padded(PROMPTS[:2])
    slots = 10

    @jax.jit
    def two_steps(variables):
        start = WIDTH - lengths
        columns = jnp.arange(WIDTH)[None]
        real = columns >= start[:, None]
        _, cache = model.apply(
            variables, prompts, real.astype(jnp.int32), jnp.where(real, columns - start[:, None], 0),
            cache=model.init_cache(2, slots), cache_index=-start, method="features",
        )  # fmt: skip
        step = decode_step(model, variables, split_layers=split_layers)
        state = step.start(cache)
        ids = jnp.array([4, 6])
        first, state = step(
            state, ids, jnp.asarray(lengths), jnp.asarray(lengths), jnp.ones(2, bool)
        )
        before = step.finish(state)
        active = jnp.array([True, False])
        second, state = step(state, ids, jnp.asarray(lengths) + 1, jnp.asarray(lengths) + 1, active)
        return first, second, before, step.finish(state)

    first, second, before, after = jax.device_get(two_steps(variables))
    for name in ("key", "value"):  # [layers, rows, slots, kv heads, head_dim]: row 1 as it was
        np.testing.assert_array_equal(after[name][:, 1], before[name][:, 1])
    np.testing.assert_array_equal(after["positions"][1], before["positions"][1])
    np.testing.assert_array_equal(before["positions"][1, :5], [0, 1, 2, 3, -1])
    np.testing.assert_array_equal(after["positions"][0], list(range(8)) + [-1, -1])
    assert np.abs(after["key"][:, 0, 7] - before["key"][:, 0, 7]).max() > 0  # row 0 wrote
    # The step's logits are the uncached forward's: prompt + fed ids, last position.
    full = models.build("causal_transformer", **CONFIG)
    want = full.apply(variables, np.array([PROMPTS[0] + [4, 4]]))[0, -1]
    np.testing.assert_allclose(second[0], want, atol=2e-5)


def test_split_step_equals_the_cached_model_step_and_resets_rows(setup):
    model, variables, full_logits = setup

    @jax.jit
    def run(step, cache):  # the step is a pytree argument: weights sliced once, outside
        state, logits = step.start(cache), []
        for t, ids in enumerate([[1, 2, 3], [4, 5, 6], [7, 8, 9]]):
            active = jnp.array([True, t < 2, t < 1])
            pos = jnp.full(3, t)
            out_t, state = step(state, jnp.array(ids), pos, pos, active)
            logits.append(out_t)
        # Row 0 takes a new sequence from slot 0; rows 1 and 2 keep theirs.
        state = step.reset(state, jnp.array([True, False, False]))
        fresh, state = step(state, jnp.array([10, 0, 0]), jnp.zeros(3, int), jnp.zeros(3, int),
                            jnp.array([True, False, False]))  # fmt: skip
        return jnp.stack(logits), fresh, step.finish(state)

    out = {}
    for split in (True, False):
        step = decode_step(model, variables, split_layers=split)
        out[split] = jax.device_get(run(step, model.init_cache(3, 6)))
    np.testing.assert_allclose(out[True][0], out[False][0], atol=1e-5)
    np.testing.assert_allclose(out[True][1], out[False][1], atol=1e-5)
    # Entries reach about 4: the split step's joined q/k/v matmul sums in its own order,
    # which moves a float32 result by a few ulps of that scale (1e-6), not of each entry.
    for name in ("key", "value"):
        np.testing.assert_allclose(out[True][2][name], out[False][2][name], atol=4e-6)
    for split in (True, False):
        positions = out[split][2]["positions"]
        np.testing.assert_array_equal(positions[:, :3], [[0, -1, -1], [0, 1, -1], [0, -1, -1]])
        logits = out[split][0]  # [step, row, V]: each row's last active step
        last = [logits[2, 0], logits[1, 1], logits[0, 2]]
        want = [full_logits(variables, ids)[-1] for ids in ([1, 4, 7], [2, 5], [3])]
        np.testing.assert_allclose(last, want, atol=2e-5)
        np.testing.assert_allclose(out[split][1][0], full_logits(variables, [10])[-1], atol=2e-5)


def test_decode_step_refuses_to_split_other_models(setup):
    _, variables, _ = setup
    with pytest.raises(TypeError, match="split_layers=True needs a CausalTransformer"):
        decode_step(object(), variables, split_layers=True)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (dict(prompts=np.zeros((2,), np.int32)), ValueError, "prompts has shape \\(2,\\)"),
        (dict(prompts=np.zeros((2, 3), np.float32)), TypeError, "prompts has dtype float32"),
        (
            dict(prompt_lengths=np.array([3, 0])),
            ValueError,
            "prompt_lengths has values in \\[0, 3\\]",
        ),
        (dict(prompt_lengths=np.array([3, 4])), ValueError, "each in \\[1, 3\\]"),
        (dict(prompt_lengths=np.array([3])), ValueError, "prompt_lengths has shape \\(1,\\)"),
        (dict(prompts=np.full((2, 3), 32, np.int32)), ValueError, "ids in \\[32, 32\\]"),
        (dict(max_new_tokens=0), ValueError, "max_new_tokens is 0"),
        (dict(max_new_tokens=np.array([2, 0])), ValueError, "a budget of 0"),
        (dict(max_new_tokens=np.array([2])), ValueError, "max_new_tokens has shape \\(1,\\)"),
        (dict(max_new_tokens=np.array([2.0, 1.0])), TypeError, "max_new_tokens has dtype"),
        (dict(capacity=1), ValueError, "capacity is 1; expected at least the largest budget 2"),
        (dict(max_new_tokens=31), ValueError, "exceeds the model's max_seq_len=32"),
        (dict(sampling=Sampling(eos_id=40)), ValueError, "eos_id contains 40"),
        (dict(sampling="greedy"), TypeError, "sampling is 'greedy'"),
        (dict(pad_id=-1), ValueError, "pad_id is -1"),
        (dict(lanes=0), ValueError, "lanes is 0"),
        (dict(lanes=3), ValueError, "lanes is 3"),
        (dict(lanes=2.0), TypeError, "lanes is 2.0"),
        (dict(repeats=0), ValueError, "repeats is 0"),
        (
            dict(repeats=2, max_new_tokens=np.array([2, 1])),
            ValueError,
            "shape \\(2,\\); expected an int or \\[4\\]",
        ),
    ],
)
def test_generate_refuses_bad_input(setup, change, error, match):
    model, variables, _ = setup
    args = dict(
        prompts=np.ones((2, 3), np.int32),
        prompt_lengths=np.array([3, 1]),
        max_new_tokens=2,
        sampling=Sampling(),
        pad_id=0,
        capacity=None,
        lanes=1,
        repeats=1,
    )
    args.update(change)
    with pytest.raises(error, match=match):
        generate(
            model, variables, args["prompts"], args["prompt_lengths"], args["max_new_tokens"],
            jax.random.key(0), args["sampling"], pad_id=args["pad_id"], capacity=args["capacity"],
            lanes=args["lanes"], repeats=args["repeats"],
        )  # fmt: skip


# ---------------------------------------------------------------- TextGeneration


@pytest.fixture(scope="module")
def policy(setup):
    model, variables, _ = setup
    return TextGeneration(model, variables, buckets=(8, 32))


GREEDY = Sampling(eos_id=PAD, temperature=0)  # shared so the tests below share compiles


def test_text_generation_matches_generate_and_buckets_compiles(setup, policy):
    model, variables, full_logits = setup
    one = policy(PROMPTS[0], 4, jax.random.key(0), GREEDY)
    assert isinstance(one, Generation)
    ref, lps = naive_greedy(full_logits, variables, PROMPTS[0], 4)
    np.testing.assert_array_equal(one.context_ids, PROMPTS[0])
    np.testing.assert_array_equal(one.ids, ref)
    np.testing.assert_allclose(one.log_probs, lps, atol=2e-5)
    assert one.finish_reason == "length" and not one.stopped and one.support is None
    # Another context length and a budget of 3 run in the same compiled shape (context
    # bucket 8, budget room 4); the budget is enforced inside the loop.
    compiles = _compiles()
    short = policy(PROMPTS[2], 3, jax.random.key(0), GREEDY)
    assert _compiles() == compiles
    ref2, _ = naive_greedy(full_logits, variables, PROMPTS[2], 3)
    np.testing.assert_array_equal(short.ids, ref2)
    assert short.finish_reason == "length"
    # A row's draws do not depend on the other rows of its batch.
    sampled = Sampling(temperature=1.0, top_k=8)
    a = policy.batch([PROMPTS[0], PROMPTS[1]], 4, jax.random.key(3), sampled)
    b = policy.batch([PROMPTS[0], PROMPTS[2]], 4, jax.random.key(3), sampled)
    np.testing.assert_array_equal(a[0].ids, b[0].ids)
    np.testing.assert_array_equal(a[0].behavior_log_probs, b[0].behavior_log_probs)
    assert [g.context_ids.tolist() for g in b] == [PROMPTS[0], PROMPTS[2]]


def _compiles() -> int:
    from dew_pipe.inference import generation

    return generation._compiled._cache_size()  # jit's count of compiled variants


def test_text_generation_stops_on_eos_and_records_support(setup):
    model, variables, full_logits = setup
    ref, _ = naive_greedy(full_logits, variables, PROMPTS[1], 4)
    policy = TextGeneration(model, variables, buckets=(8,), record_support=True)
    out = policy(PROMPTS[1], 6, jax.random.key(1), Sampling(eos_id=ref[1], temperature=0))
    np.testing.assert_array_equal(out.ids, ref[:2])
    assert out.finish_reason == "stop" and out.stopped
    assert [s.tolist() for s in out.support] == [[i] for i in ref[:2]]
    call = out.call(version=3)
    assert isinstance(call, Call) and call.version == 3 and call.finish_reason == "stop"
    np.testing.assert_array_equal(call.old_log_probs, out.log_probs)
    np.testing.assert_array_equal(call.prompt_ids, PROMPTS[1])


def test_bind_swaps_the_weights(setup):
    model, variables, full_logits = setup
    policy = TextGeneration(model, variables, buckets=(8,))
    other = model.init(jax.random.key(9), jnp.zeros((1, 4), jnp.int32))
    assert policy.bind(other) is policy and policy.variables is other
    out = policy(PROMPTS[0], 3, jax.random.key(0), GREEDY)
    ref, lps = naive_greedy(full_logits, other, PROMPTS[0], 3)
    np.testing.assert_array_equal(out.ids, ref)
    np.testing.assert_allclose(out.log_probs, lps, atol=2e-5)

    class State:
        params = variables

    policy.bind(State())
    assert policy.variables is variables
    with pytest.raises(ValueError, match="snapshot does not match"):
        policy.bind({"params": {"embed": jnp.zeros((2, 2))}})
    with pytest.raises(TypeError, match="snapshot is list"):
        policy.bind([1])


@pytest.mark.parametrize(
    ("contexts", "budget", "sampling", "error", "match"),
    [
        ([[]], 2, Sampling(), ValueError, "contexts\\[0\\] has shape \\(0,\\)"),
        ([[1, 40]], 2, Sampling(), ValueError, "contexts\\[0\\] holds ids in \\[1, 40\\]"),
        ([[1], [0.5]], 2, Sampling(), TypeError, "contexts\\[1\\] has dtype float64"),
        ([[1] * 30], 4, Sampling(), ValueError, "needs 33 positions"),
        ([[1]], 0, Sampling(), ValueError, "max_new_tokens is 0"),
        ([[1]], 2, None, TypeError, "sampling is None"),
        ([], 2, Sampling(), ValueError, "contexts is empty"),
        ("abc", 2, Sampling(), TypeError, "contexts is str"),
    ],
)
def test_text_generation_refuses_bad_calls(policy, contexts, budget, sampling, error, match):
    with pytest.raises(error, match=match):
        policy.batch(contexts, budget, jax.random.key(0), sampling)


def test_text_generation_refuses_bad_settings(setup):
    model, variables, _ = setup
    with pytest.raises(ValueError, match="buckets is \\(8, 4\\)"):
        TextGeneration(model, variables, buckets=(8, 4))
    with pytest.raises(ValueError, match="max_seq_len=32"):
        TextGeneration(model, variables, buckets=(64,))
    with pytest.raises(ValueError, match="pad_id is 32"):
        TextGeneration(model, variables, pad_id=32)
    with pytest.raises(TypeError, match="expected a variables mapping"):
        TextGeneration(model, None)
    assert TextGeneration(model, variables).buckets == (16, 32)
