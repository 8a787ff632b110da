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
    remat = models.build("causal_transformer", **dict(cfg, remat=True, scan_unroll=2))
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


def test_param_dtype_is_respected():
    model = models.build("causal_transformer", **dict(SMALL, param_dtype=jnp.bfloat16))
    variables = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 2), jnp.int32))
    assert {x.dtype for x in jax.tree.leaves(variables)} == {jnp.dtype(jnp.bfloat16)}
