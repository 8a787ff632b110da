"""The causal decoder against a plain NumPy reference, packed rows, the cache, and errors."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew_pipe import models
from dew_pipe.models import RopeScaling, TransformerConfig

VOCAB = 48

SMALL = dict(
    vocab_size=VOCAB,
    emb_features=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    mlp_features=48,
    max_seq_len=24,
    qk_norm=True,
    tie_embeddings=True,
    rope_theta=500.0,
)


# ---------------------------------------------------------------- NumPy reference


def _rms(x, scale, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def _rotate(x, positions, inv_freq):
    angles = positions[..., None].astype(np.float64) * inv_freq  # [B, S, d/2]
    cos, sin = np.cos(angles)[:, :, None], np.sin(angles)[:, :, None]
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def reference_logits(cfg: TransformerConfig, params, tokens, segment_ids=None, positions=None):
    """Float64 forward pass written independently of the module (loops, repeated K/V)."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    B, S = tokens.shape
    seg = np.ones((B, S), int) if segment_ids is None else np.asarray(segment_ids)
    pos = np.broadcast_to(np.arange(S), (B, S)) if positions is None else np.asarray(positions)
    inv_freq = cfg.inverse_frequencies().astype(np.float64)
    H, K, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    allowed = np.zeros((B, S, S), bool)
    for b in range(B):
        for i in range(S):
            for j in range(i + 1):
                allowed[b, i, j] = seg[b, i] > 0 and seg[b, i] == seg[b, j]
    x = p["embed"][tokens]
    for layer in range(cfg.num_layers):
        lp = jax.tree.map(lambda a, layer=layer: a[layer], p["layers"])
        h = _rms(x, lp["attn_norm"]["scale"], cfg.norm_eps)
        q = (h @ lp["attn"]["q"]).reshape(B, S, H, d)
        k = (h @ lp["attn"]["k"]).reshape(B, S, K, d)
        v = (h @ lp["attn"]["v"]).reshape(B, S, K, d)
        if cfg.qk_norm:
            q = _rms(q, lp["attn"]["q_norm"]["scale"], cfg.norm_eps)
            k = _rms(k, lp["attn"]["k_norm"]["scale"], cfg.norm_eps)
        q, k = _rotate(q, pos, inv_freq), _rotate(k, pos, inv_freq)
        k, v = np.repeat(k, H // K, axis=2), np.repeat(v, H // K, axis=2)
        scores = np.einsum("bshd,bthd->bhst", q, k) / math.sqrt(d)
        scores = np.where(allowed[:, None], scores, -np.inf)
        scores = scores - scores.max(-1, keepdims=True)
        weights = np.exp(scores)
        weights /= weights.sum(-1, keepdims=True)
        attn = np.einsum("bhst,bthd->bshd", weights, v).reshape(B, S, H * d)
        x = x + attn @ lp["attn"]["o"]
        h = _rms(x, lp["mlp_norm"]["scale"], cfg.norm_eps)
        gate = h @ lp["mlp"]["gate"]
        x = x + (gate / (1 + np.exp(-gate)) * (h @ lp["mlp"]["up"])) @ lp["mlp"]["down"]
    x = _rms(x, p["final_norm"]["scale"], cfg.norm_eps)
    head = p["embed"].T if cfg.tie_embeddings else p["lm_head"]
    return x @ head


def _random_params(model, seed):
    """Random weights: matrices N(0, 0.3), norm scales around one (NumPy, no compiles)."""
    shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 2), jnp.int32))
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        noise = rng.normal(size=leaf.shape)
        scale = any(getattr(p, "key", None) == "scale" for p in path)
        return jnp.asarray(1.0 + 0.2 * noise if scale else 0.3 * noise, leaf.dtype)

    return jax.tree_util.tree_map_with_path(draw, shapes)


@pytest.fixture(scope="module")
def small():
    model = models.build("causal_transformer", **SMALL)
    variables = _random_params(model, 0)
    forward = jax.jit(model.apply)
    return model, variables, forward


def _tokens(seed, shape):
    return np.random.default_rng(seed).integers(0, VOCAB, shape).astype(np.int32)


# ---------------------------------------------------------------- forward


def test_forward_matches_numpy_reference(small):
    model, variables, forward = small
    tokens = _tokens(1, (2, 10))
    got = forward(variables, tokens)
    assert got.dtype == jnp.float32 and got.shape == (2, 10, VOCAB)
    want = reference_logits(model.config, variables["params"], tokens)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-4, rtol=1e-4)


def test_untied_mha_with_llama3_rope_matches_reference():
    cfg = dict(
        SMALL,
        num_kv_heads=None,
        qk_norm=False,
        tie_embeddings=False,
        num_layers=1,
        rope_scaling=dict(
            kind="llama3", factor=4.0, original_max_position_embeddings=16, high_freq_factor=2.0
        ),
    )
    model = models.build("causal_transformer", **cfg)
    assert model.config.rope_scaling == RopeScaling("llama3", 4.0, 1.0, 2.0, 16)
    variables = _random_params(model, 3)
    assert (
        "lm_head" in variables["params"] and "q_norm" not in variables["params"]["layers"]["attn"]
    )
    tokens = _tokens(2, (2, 9))
    got = jax.jit(model.apply)(variables, tokens)
    want = reference_logits(model.config, variables["params"], tokens)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-4, rtol=1e-4)


def test_llama3_frequencies_are_blended():
    scaling = RopeScaling("llama3", factor=8.0, original_max_position_embeddings=64)
    base = 1.0 / 10000.0 ** (np.arange(0, 16, 2) / 16)
    got = scaling.inverse_frequencies(base.astype(np.float32))
    wavelen = 2 * np.pi / base
    high = wavelen < 64 / 4.0
    low = wavelen > 64 / 1.0
    assert high.any() and low.any() and (~high & ~low).any()
    np.testing.assert_allclose(got[high], base[high], rtol=1e-6)
    np.testing.assert_allclose(got[low], base[low] / 8.0, rtol=1e-6)
    mid = ~high & ~low
    assert np.all(got[mid] < base[mid]) and np.all(got[mid] > base[mid] / 8.0)


def test_packed_rows_equal_separate_documents(small):
    _, variables, forward = small
    first, second = _tokens(4, (1, 6)), _tokens(5, (1, 7))
    packed = np.zeros((1, 16), np.int32)
    packed[0, :6], packed[0, 6:13] = first[0], second[0]
    segments = np.array([[1] * 6 + [2] * 7 + [0] * 3], np.int32)
    positions = np.array([list(range(6)) + list(range(7)) + [0] * 3], np.int32)
    got = np.asarray(forward(variables, packed, segments, positions))
    np.testing.assert_allclose(got[0, :6], np.asarray(forward(variables, first))[0], atol=1e-5)
    np.testing.assert_allclose(got[0, 6:13], np.asarray(forward(variables, second))[0], atol=1e-5)
    assert np.isfinite(got).all()


def test_features_and_logits_compose(small):
    model, variables, forward = small
    tokens = _tokens(6, (2, 5))
    hidden = jax.jit(lambda v, t: model.apply(v, t, method="features"))(variables, tokens)
    assert hidden.shape == (2, 5, SMALL["emb_features"])
    logits = jax.jit(lambda v, h: model.apply(v, h, method="logits"))(variables, hidden[:, 1:3])
    np.testing.assert_allclose(logits, np.asarray(forward(variables, tokens))[:, 1:3], atol=1e-5)


def test_gradients_are_finite_with_padding_and_remat_matches():
    cfg = dict(SMALL, num_layers=2, max_seq_len=8)
    plain = models.build("causal_transformer", **cfg)
    remat = models.build("causal_transformer", **dict(cfg, remat="dots_saveable"))
    variables = _random_params(plain, 7)
    tokens = _tokens(8, (2, 8))
    segments = np.array([[1, 1, 1, 2, 2, 0, 0, 0], [0] * 8], np.int32)

    def loss(model):
        def fn(v):
            logits = model.apply(v, tokens, segments)
            return jnp.sum(jax.nn.log_softmax(logits)[..., 0] * (segments > 0))

        return jax.jit(jax.value_and_grad(fn))

    value, grads = loss(plain)(variables)
    value_r, grads_r = loss(remat)(variables)
    assert np.isfinite(value) and all(np.isfinite(g).all() for g in jax.tree.leaves(grads))
    np.testing.assert_allclose(value_r, value, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads_r), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "change",
    [{}, {"scan_layers": True}, {"remat": "dots_saveable"}],
    ids=["unrolled", "scan", "remat"],
)
def test_features_on_columns_equal_the_whole_rows_there(change):
    """features(columns=c) is features()[c], values and gradients, over packed rows with
    padding, several documents per row and padding columns asked for."""
    model = models.build("causal_transformer", **dict(SMALL, max_seq_len=10, **change))
    variables = _random_params(model, 23)
    tokens = _tokens(24, (3, 10))
    segments = np.array([[1] * 4 + [2] * 5 + [0], [1] * 10, [1] * 3 + [0] * 7], np.int32)
    positions = np.array([[*range(4), *range(5), 0], [*range(10)], [0, 1, 2] + [0] * 7])
    columns = np.array([[3, 8, 1, 4], [9, 0, 5, 6], [2, 0, 7, 1]], np.int32)
    weights = np.random.default_rng(25).normal(size=(3, 4, SMALL["emb_features"]))

    def taken(v):
        hidden = model.apply(v, tokens, segments, positions, method="features")
        return jnp.take_along_axis(hidden, columns[:, :, None], axis=1)

    def picked(v):
        return model.apply(v, tokens, segments, positions, method="features", columns=columns)

    want, got = jax.jit(taken)(variables), jax.jit(picked)(variables)
    assert got.shape == (3, 4, SMALL["emb_features"])
    real = (np.take_along_axis(segments, columns, axis=1) > 0)[..., None]
    np.testing.assert_allclose(np.where(real, got, 0), np.where(real, want, 0), atol=2e-6)
    assert np.isfinite(got).all()  # a padding column attends nothing: finite all the same

    def grads(fn):
        return jax.jit(jax.grad(lambda v: jnp.sum(jnp.where(real, fn(v), 0) * weights)))(variables)

    for a, b in zip(jax.tree.leaves(grads(picked)), jax.tree.leaves(grads(taken)), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_increasing_columns_promise_gives_the_same_values_and_gradients():
    """features(columns=c, increasing_columns=True) with 96 increasing columns of 128 (two
    blocks of 48 queries in the last block, the second reading keys up to 128 - 96 + 96):
    the same hidden states and gradients as without the promise and as features()[c]."""
    model = models.build("causal_transformer", **dict(SMALL, max_seq_len=128))
    variables = _random_params(model, 41)
    tokens = _tokens(42, (2, 128))
    segments = np.array([[1] * 50 + [2] * 70 + [0] * 8, [0] * 10 + [1] * 118], np.int32)
    positions = np.where(segments > 0, np.arange(128) - np.array([[0], [10]]), 0)
    positions[0, 50:120] = np.arange(70)
    rng = np.random.default_rng(43)
    columns = np.sort(np.stack([rng.choice(128, 96, replace=False) for _ in range(2)]), axis=1)
    columns = columns.astype(np.int32)
    real = (np.take_along_axis(segments, columns, axis=1) > 0)[..., None]
    weights = rng.normal(size=(2, 96, SMALL["emb_features"])) * real

    def picked(v, **promise):
        return model.apply(
            v, tokens, segments, positions, method="features", columns=columns, **promise
        )

    def taken(v):
        hidden = model.apply(v, tokens, segments, positions, method="features")
        return jnp.take_along_axis(hidden, columns[:, :, None], axis=1)

    promised = jax.jit(lambda v: picked(v, increasing_columns=True))
    got = promised(variables)
    for want in (jax.jit(picked)(variables), jax.jit(taken)(variables)):
        np.testing.assert_allclose(np.where(real, got, 0), np.where(real, want, 0), atol=2e-6)

    def grads(fn):
        return jax.jit(jax.grad(lambda v: jnp.sum(fn(v) * weights)))(variables)

    got_grads = grads(lambda v: picked(v, increasing_columns=True))
    for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(grads(picked)), strict=True):
        # float32 rounding of softmax sums taken over other key spans, at each leaf's scale
        np.testing.assert_allclose(a, b, atol=4e-6 * np.abs(b).max(), rtol=1e-5)
    # The promise changes the computation: the second block's scores read 128 keys, the
    # first block's only 80 (and without the promise every block reads 128).
    text = str(jax.make_jaxpr(lambda v: picked(v, increasing_columns=True))(variables))
    assert ",80]" in text and ",80]" not in str(jax.make_jaxpr(picked)(variables))
    with pytest.raises(TypeError, match="increasing_columns is 1; expected a bool"):
        picked(variables, increasing_columns=1)


@pytest.mark.parametrize("scan", [None, True], ids=["unrolled", "scan"])
def test_columns_as_wide_as_the_rows_are_still_taken(scan):
    """K == S: a reordering of every column comes back in the asked order."""
    model = models.build("causal_transformer", **dict(SMALL, max_seq_len=6, scan_layers=scan))
    variables = _random_params(model, 31)
    tokens = _tokens(32, (2, 6))
    columns = np.array([[5, 4, 3, 2, 1, 0], [2, 0, 1, 5, 3, 4]], np.int32)
    hidden = model.apply(variables, tokens, method="features")
    got = model.apply(variables, tokens, columns=columns, method="features")
    want = np.take_along_axis(np.asarray(hidden), columns[:, :, None], axis=1)
    np.testing.assert_allclose(got, want, atol=2e-6)


def test_the_last_block_runs_on_the_columns_only():
    """Unrolled, the last block's MLP sees [B, K] rows; under the scan every block is whole."""
    tokens = jnp.zeros((2, 10), jnp.int32)
    columns = jnp.zeros((2, 3), jnp.int32)
    mlp = f"f32[{2 * 3},{SMALL['mlp_features']}]"
    for scan, expected in ((None, True), (True, False)):
        model = models.build("causal_transformer", **dict(SMALL, max_seq_len=10, scan_layers=scan))
        variables = _random_params(model, 0)
        text = str(
            jax.make_jaxpr(
                lambda v, m=model: m.apply(v, tokens, columns=columns, method="features")
            )(variables)
        )
        assert (mlp in text) is expected


def test_bad_columns_name_the_field(cached):
    model, variables, cache, _ = cached
    tokens = jnp.zeros((2, 4), jnp.int32)

    def call(columns, **kw):
        return jax.eval_shape(
            lambda v: model.apply(v, tokens, columns=columns, method="features", **kw), variables
        )

    with pytest.raises(TypeError, match="columns has dtype float32"):
        call(jnp.zeros((2, 1), jnp.float32))
    with pytest.raises(ValueError, match=r"columns has shape \(2,\); expected \[2, K\]"):
        call(jnp.zeros((2,), jnp.int32))
    with pytest.raises(ValueError, match=r"columns has shape \(3, 1\)"):
        call(jnp.zeros((3, 1), jnp.int32))
    with pytest.raises(ValueError, match=r"K from 1 to 4"):
        call(jnp.zeros((2, 5), jnp.int32))
    with pytest.raises(ValueError, match="columns applies to uncached calls"):
        call(
            jnp.zeros((2, 1), jnp.int32),
            cache=model.init_cache(2, 8),
            cache_index=jnp.zeros(2, jnp.int32),
        )


def test_unrolled_layer_scan_gives_the_same_logits(small):
    _, variables, forward = small
    unrolled = models.build("causal_transformer", **dict(SMALL, scan_unroll=2))
    tokens = _tokens(19, (2, 10))
    got = jax.jit(unrolled.apply)(variables, tokens)
    np.testing.assert_allclose(got, np.asarray(forward(variables, tokens)), atol=1e-5)


def test_bfloat16_compute_is_close_to_float32(small):
    model, variables, forward = small
    bf16 = models.build("causal_transformer", **dict(SMALL, dtype=jnp.bfloat16))
    tokens = _tokens(9, (1, 8))
    got = jax.jit(bf16.apply)(variables, tokens)
    assert got.dtype == jnp.float32
    want = np.asarray(forward(variables, tokens))
    # bfloat16 keeps 8 bits of mantissa: errors of a few percent of the logit scale.
    scale = np.abs(want).max()
    assert np.abs(np.asarray(got) - want).max() < 0.05 * scale
    assert np.abs(np.asarray(got) - want).max() > 0  # it really ran in bfloat16


def test_bfloat16_compute_gradients_are_close_to_float32():
    # Mixed precision training: float32 parameters, bfloat16 products. The gradients are
    # float32 and within bfloat16 rounding of the float32 model's; every product of the
    # backward pass, not only of the forward, reads bfloat16 operands.
    config = dict(SMALL, tie_embeddings=False)
    full = models.build("causal_transformer", **config)
    half = models.build("causal_transformer", **dict(config, dtype=jnp.bfloat16))
    variables = _random_params(full, 3)
    tokens = _tokens(4, (2, 12))

    def loss(model):
        def nll(variables):
            logits = model.apply(variables, tokens[:, :-1])
            picked = jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1)
            return -jnp.mean(picked)

        return jax.jit(jax.value_and_grad(nll))

    (want_loss, want), (got_loss, got) = loss(full)(variables), loss(half)(variables)
    assert abs(float(got_loss) - float(want_loss)) < 0.02 * abs(float(want_loss))
    for (path, g), w in zip(
        jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True
    ):
        assert g.dtype == jnp.float32, path
        error = np.linalg.norm(np.asarray(g) - np.asarray(w)) / np.linalg.norm(np.asarray(w))
        assert 0 < error < 0.05, (jax.tree_util.keystr(path), error)
    lowered = loss(half).lower(variables).as_text()
    dots = [line for line in lowered.splitlines() if "dot_general" in line and "->" in line]
    projections = [line for line in dots if "x32x" in line or "x48x" in line]
    # Forward and backward: 7 projections per layer and the head, three products each.
    assert len(projections) == 3 * (2 * 7 + 1)
    assert all("xf32>" not in line.split("->")[0] for line in projections)


def test_bfloat16_weights_with_float32_compute_multiply_in_bfloat16(small):
    # What a CPU server runs: weights stored in bfloat16, activations in float32. Every
    # matmul must read the weights as stored (never widened to float32) and accumulate in
    # float32, so the logits are those of the float32 model on bfloat16-rounded weights,
    # up to the rounding of each matmul's activations to bfloat16.
    _, variables, forward = small
    mixed = models.build("causal_transformer", **dict(SMALL, param_dtype=jnp.bfloat16))
    half = jax.tree.map(lambda x: x.astype(jnp.bfloat16), variables)
    tokens = _tokens(9, (1, 8))
    got = np.asarray(jax.jit(mixed.apply)(half, tokens))
    rounded = jax.tree.map(lambda x: x.astype(jnp.float32), half)
    want = np.asarray(forward(rounded, tokens))
    error = np.abs(got - want).max()
    assert 0 < error < 0.05 * np.abs(want).max()
    lowered = jax.jit(mixed.apply).lower(half, tokens).as_text()
    dots = [line for line in lowered.splitlines() if "dot_general" in line and "->" in line]
    projections = [line for line in dots if "x32xbf16" in line or "x48xbf16" in line]
    assert len(projections) == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer; the head
    assert all(line.rstrip().endswith("xf32>") for line in projections)
    assert not any("32x48xf32" in line or "48x32xf32" in line for line in dots)


def test_param_dtype_is_respected():
    model = models.build("causal_transformer", **dict(SMALL, param_dtype=jnp.bfloat16))
    variables = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 2), jnp.int32))
    assert {x.dtype for x in jax.tree.leaves(variables)} == {jnp.dtype(jnp.bfloat16)}


# ---------------------------------------------------------------- cache

CACHE_SLOTS = 16


def _alone(forward, variables, sequences):
    """Each sequence's logits on its own, computed in one packed row (see the packed test)."""
    width = SMALL["max_seq_len"]
    tokens, segments, positions = (np.zeros((1, width), np.int32) for _ in range(3))
    start = 0
    for doc, seq in enumerate(sequences, 1):
        end = start + len(seq)
        tokens[0, start:end], segments[0, start:end] = seq, doc
        positions[0, start:end] = np.arange(len(seq))
        start = end
    assert start <= width
    logits = np.asarray(forward(variables, tokens, segments, positions))[0]
    out, start = [], 0
    for seq in sequences:
        out.append(logits[start : start + len(seq)])
        start += len(seq)
    return out


@pytest.fixture(scope="module")
def cached(small):
    model, variables, forward = small

    @jax.jit
    def step(variables, cache, tokens, segments, positions, index):
        return model.apply(variables, tokens, segments, positions, cache=cache, cache_index=index)

    return model, variables, forward, step


def test_prefill_then_decode_equals_full_forward(cached):
    model, variables, forward, step = cached
    tokens = _tokens(10, (2, 11))
    want = np.asarray(forward(variables, tokens))
    cache = model.init_cache(2, CACHE_SLOTS)
    ones = np.ones((2, 4), np.int32)
    logits, cache = step(
        variables, cache, tokens[:, :4], ones, np.tile(np.arange(4), (2, 1)), np.zeros(2, np.int32)
    )
    np.testing.assert_allclose(logits, want[:, :4], atol=1e-5)
    hidden, same = jax.jit(
        lambda v, c: model.apply(
            v, tokens[:, :4], cache=c, cache_index=jnp.zeros(2, jnp.int32), method="features"
        )
    )(variables, model.init_cache(2, CACHE_SLOTS))
    head = jax.jit(lambda v, h: model.apply(v, h, method="logits"))(variables, hidden[:, -1])
    np.testing.assert_allclose(head, want[:, 3], atol=1e-5)  # features + logits, cached
    np.testing.assert_array_equal(same["positions"], cache["positions"])
    for t in range(4, 11):
        pos = np.full((2, 1), t, np.int32)
        logits, cache = step(
            variables, cache, tokens[:, t : t + 1], ones[:, :1], pos, np.full(2, t, np.int32)
        )
        np.testing.assert_allclose(logits[:, 0], want[:, t], atol=1e-5)
    assert np.array_equal(cache["positions"][:, :11], np.tile(np.arange(11), (2, 1)))
    assert (np.asarray(cache["positions"][:, 11:]) == -1).all()


def test_left_padded_prompts_equal_each_prompt_alone(cached):
    model, variables, forward, step = cached
    short, long_ = _tokens(11, 3), _tokens(12, 4)
    tail = _tokens(13, (2, 3))
    prompt = np.zeros((2, 4), np.int32)
    prompt[0, 1:], prompt[1] = short, long_
    segments = np.array([[0, 1, 1, 1], [1, 1, 1, 1]], np.int32)
    positions = np.array([[0, 0, 1, 2], [0, 1, 2, 3]], np.int32)
    cache = model.init_cache(2, CACHE_SLOTS)
    first, cache = step(variables, cache, prompt, segments, positions, np.zeros(2, np.int32))
    got_short, got_long = [np.asarray(first[0, 1:])], [np.asarray(first[1])]
    lengths = np.array([3, 4])
    for t in range(3):
        pos = (lengths + t)[:, None].astype(np.int32)
        logits, cache = step(
            variables,
            cache,
            tail[:, t : t + 1],
            np.ones((2, 1), np.int32),
            pos,
            np.full(2, 4 + t, np.int32),
        )
        got_short.append(np.asarray(logits[0]))
        got_long.append(np.asarray(logits[1]))
    want_short, want_long = _alone(
        forward, variables, [np.r_[short, tail[0]], np.r_[long_, tail[1]]]
    )
    np.testing.assert_allclose(np.concatenate(got_short), want_short, atol=1e-5)
    np.testing.assert_allclose(np.concatenate(got_long), want_long, atol=1e-5)
    assert cache["positions"][0, 0] == -1  # the pad slot stays empty


def _call(step, variables, cache, rows):
    """One cached call; rows = [(tokens, first position, write index)], padded to the width."""
    width = 4 if any(len(toks) > 1 for toks, _, _ in rows) else 1  # two compiled shapes
    tokens, segments, positions = (np.zeros((len(rows), width), np.int32) for _ in range(3))
    index = np.zeros(len(rows), np.int32)
    for b, (toks, pos, at) in enumerate(rows):
        tokens[b, : len(toks)], segments[b, : len(toks)] = toks, 1
        positions[b, : len(toks)] = pos + np.arange(len(toks))
        index[b] = at
    logits, cache = step(variables, cache, tokens, segments, positions, index)
    return [np.asarray(logits[b, : len(toks)]) for b, (toks, _, _) in enumerate(rows)], cache


def test_rows_at_different_offsets_continuous_batching(cached):
    """Row 1 joins while row 0 decodes; both calls shapes ([2, 4] and [2, 1]) are reused."""
    model, variables, forward, step = cached
    a, b = _tokens(14, 8), _tokens(15, 6)
    cache = model.init_cache(2, CACHE_SLOTS)
    got_a, got_b = [], []
    out, cache = _call(step, variables, cache, [(a[:4], 0, 0), ([], 0, 0)])
    got_a += out[0:1]
    out, cache = _call(step, variables, cache, [(a[4:5], 4, 4), ([], 0, 0)])
    got_a += out[0:1]
    # Row 0 decodes one token (the rest of its row is padding) while row 1 prefills.
    out, cache = _call(step, variables, cache, [(a[5:6], 5, 5), (b[:4], 0, 0)])
    got_a, got_b = got_a + out[0:1], got_b + out[1:2]
    for t in range(2):
        out, cache = _call(
            step,
            variables,
            cache,
            [(a[6 + t : 7 + t], 6 + t, 6 + t), (b[4 + t : 5 + t], 4 + t, 4 + t)],
        )
        got_a, got_b = got_a + out[0:1], got_b + out[1:2]
    want_a, want_b = _alone(forward, variables, [a, b])
    np.testing.assert_allclose(np.concatenate(got_a), want_a, atol=1e-5)
    np.testing.assert_allclose(np.concatenate(got_b), want_b, atol=1e-5)


def test_reset_cache_lets_a_row_take_a_new_sequence(cached):
    model, variables, forward, step = cached
    old, new = _tokens(16, 3), _tokens(17, 4)
    cache = model.init_cache(2, CACHE_SLOTS)
    # The old sequence sat three slots in (left padding): slots 3..5 hold positions 0..2.
    padded = np.zeros((2, 6), np.int32)
    padded[0, 3:] = old
    segments = np.array([[0, 0, 0, 1, 1, 1], [0] * 6], np.int32)
    positions = np.array([[0, 0, 0, 0, 1, 2], [0] * 6], np.int32)
    _, stale = step(variables, cache, padded, segments, positions, np.zeros(2, np.int32))
    (want,) = _alone(forward, variables, [new])
    fresh = model.reset_cache(stale, np.array([True, False]))
    assert (np.asarray(fresh["positions"][0]) == -1).all()
    assert np.array_equal(fresh["positions"][1], stale["positions"][1])
    got, _ = _call(step, variables, fresh, [(new, 0, 0), ([], 0, 0)])
    np.testing.assert_allclose(got[0], want, atol=1e-5)
    # Without the reset, slots 4 and 5 (positions 1, 2) leak into the new sequence.
    leaked, _ = _call(step, variables, stale, [(new, 0, 0), ([], 0, 0)])
    assert np.abs(leaked[0][1:] - want[1:]).max() > 1e-2


def test_padding_step_and_out_of_range_writes_leave_real_slots_alone(cached):
    model, variables, _, step = cached
    tokens = _tokens(18, (2, 4))
    cache = model.init_cache(2, CACHE_SLOTS)
    ones = np.ones((2, 4), np.int32)
    pos = np.tile(np.arange(4, dtype=np.int32), (2, 1))
    _, cache = step(variables, cache, tokens, ones, pos, np.zeros(2, np.int32))
    before = jax.tree.map(np.asarray, cache)
    # Row 0 finished (segment 0 at its next slot); row 1 writes past the end of the cache.
    _, after = step(
        variables,
        cache,
        tokens,
        np.array([[0] * 4, [1] * 4], np.int32),
        pos,
        np.array([4, CACHE_SLOTS - 2], np.int32),
    )
    after = jax.tree.map(np.asarray, after)
    np.testing.assert_array_equal(after["positions"][0, :8], [0, 1, 2, 3, -1, -1, -1, -1])
    np.testing.assert_array_equal(after["key"][:, 0, :4], before["key"][:, 0, :4])
    np.testing.assert_array_equal(after["positions"][1, :4], [0, 1, 2, 3])  # nothing wrapped
    np.testing.assert_array_equal(after["key"][:, 1, :4], before["key"][:, 1, :4])
    np.testing.assert_array_equal(after["positions"][1, -2:], [0, 1])


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (
            dict(num_heads=3, num_kv_heads=None),
            "emb_features \\(32\\) is not divisible by num_heads \\(3\\)",
        ),
        (dict(num_kv_heads=3), "num_kv_heads \\(3\\) must divide num_heads \\(4\\)"),
        (dict(head_dim=7), "head_dim is 7"),
        (dict(num_layers=0), "num_layers is 0"),
        (dict(vocab_size=2.5), "vocab_size is 2.5"),
        (dict(rope_theta=-1.0), "rope_theta is -1.0"),
        (dict(dtype=jnp.int32), "dtype is int32"),
        (dict(remat="bogus"), "remat is 'bogus'"),
        (dict(rope_scaling=dict(kind="yarn", factor=2.0)), "rope_scaling.kind is 'yarn'"),
        (dict(rope_scaling=dict(kind="linear", factor=0.0)), "rope_scaling.factor is 0.0"),
    ],
)
def test_bad_config_values_name_the_field(change, match):
    with pytest.raises(ValueError, match=match):
        models.build("causal_transformer", **dict(SMALL, **change))


def test_build_refuses_unknown_names_and_options():
    with pytest.raises(ValueError, match="model name 'gpt' is unknown"):
        models.build("gpt")
    with pytest.raises(TypeError, match="unknown option\\(s\\) \\['hidden_size'\\]"):
        models.build("causal_transformer", **dict(SMALL, hidden_size=3))
    missing = {k: v for k, v in SMALL.items() if k != "max_seq_len"}
    with pytest.raises(TypeError, match="missing required option\\(s\\) \\['max_seq_len'\\]"):
        models.build("causal_transformer", **missing)


def test_bad_inputs_name_the_field(cached):
    model, variables, _, _ = cached
    apply = model.apply
    tokens = jnp.zeros((1, 4), jnp.int32)
    with pytest.raises(TypeError, match="tokens has dtype float32"):
        jax.eval_shape(apply, variables, jnp.zeros((1, 4), jnp.float32))
    with pytest.raises(ValueError, match="tokens has shape \\(4,\\)"):
        jax.eval_shape(apply, variables, jnp.zeros((4,), jnp.int32))
    with pytest.raises(ValueError, match="sequence length 25; expected at most max_seq_len=24"):
        jax.eval_shape(apply, variables, jnp.zeros((1, 25), jnp.int32))
    with pytest.raises(ValueError, match="segment_ids has shape \\(1, 3\\)"):
        jax.eval_shape(apply, variables, tokens, jnp.ones((1, 3), jnp.int32))
    with pytest.raises(TypeError, match="positions has dtype float32"):
        jax.eval_shape(apply, variables, tokens, None, jnp.ones((1, 4), jnp.float32))
    with pytest.raises(ValueError, match="expected last axis emb_features=32"):
        jax.eval_shape(lambda v: apply(v, jnp.zeros((2, 5)), method="logits"), variables)


def test_bad_cache_arguments_name_the_field(cached):
    model, variables, _, _ = cached
    tokens = jnp.zeros((2, 4), jnp.int32)
    cache = model.init_cache(2, 8)

    def call(**kwargs):
        return jax.eval_shape(lambda v: model.apply(v, tokens, **kwargs), variables)

    with pytest.raises(ValueError, match="cache_index is None"):
        call(cache=cache)
    with pytest.raises(ValueError, match="cache_index has shape \\(3,\\)"):
        call(cache=cache, cache_index=jnp.zeros(3, jnp.int32))
    with pytest.raises(ValueError, match="cache\\['key'\\] has shape \\(2, 3, 8, 2, 8\\)"):
        call(cache=model.init_cache(3, 8), cache_index=0)
    with pytest.raises(ValueError, match="the cache holds only 2 slots"):
        call(cache=model.init_cache(2, 2), cache_index=0)
    with pytest.raises(ValueError, match="cache is \\['key'\\]"):
        call(cache={"key": cache["key"]}, cache_index=0)
    with pytest.raises(
        ValueError, match="init_cache length is 25; expected at most max_seq_len=24"
    ):
        model.init_cache(1, 25)
    with pytest.raises(ValueError, match="init_cache batch is 0"):
        model.init_cache(0, 4)
    logits, new = call(cache=cache, cache_index=3)  # a scalar index serves every row
    assert logits.shape == (2, 4, VOCAB) and new["positions"].shape == (2, 8)


def test_a_float32_cache_serves_a_bfloat16_model(small):
    _, variables, _ = small
    bf16 = models.build("causal_transformer", **dict(SMALL, dtype=jnp.bfloat16))
    cache = bf16.init_cache(2, 8, dtype=jnp.float32)
    tokens = jnp.zeros((2, 3), jnp.int32)
    logits, new = jax.eval_shape(
        lambda v, c: bf16.apply(v, tokens, cache=c, cache_index=jnp.zeros(2, jnp.int32)),
        variables,
        cache,
    )
    assert logits.dtype == jnp.float32 and new["key"].dtype == jnp.float32
