"""Hand-written backward passes of the decoder against autodiff and NumPy references.

Covers `self_attend` (blocked causal attention), `attend_step` (a decode step against a
head-major cache), `head_cross_entropy` (fused LM head and
softmax cross-entropy), the SwiGLU MLP, the RMS norm, the rotary angles, the unrolled layer
loop against the layer scan, and LMObjective's fused loss against the plain-logits loss.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew_pipe import LMObjective, models
from dew_pipe.models import attention
from dew_pipe.models.cross_entropy import head_cross_entropy
from dew_pipe.models.self_attention import self_attend
from dew_pipe.models.transformer import _narrow_rms_norm, dense, rms_norm, swiglu

# ---------------------------------------------------------------- attention

B, S, H, K, D = 2, 16, 4, 2, 8


def _qkv(seed, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, S, H, D)) * D**-0.5
    k, v = rng.normal(size=(B, S, K, D)), rng.normal(size=(B, S, K, D))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


# Row 0: two documents then padding; row 1: left padding then one document.
SEGMENTS = np.array([[1] * 6 + [2] * 7 + [0] * 3, [0] * 4 + [1] * 12], np.int32)
REAL = SEGMENTS > 0


def _numpy_attention(q, k, v, mask):
    """Float64 reference with repeated K/V; rows that attend nothing average all values."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    k, v = np.repeat(k, H // K, axis=2), np.repeat(v, H // K, axis=2)
    scores = np.einsum("bshd,bthd->bhst", q, k)
    scores = np.where(mask[:, None], scores, -1e30)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return np.einsum("bhst,bthd->bshd", weights, v)


@pytest.fixture(scope="module")
def attention_grads():
    """value_and_grad of a weighted sum of outputs over real rows, per implementation."""
    mask = attention.causal_segment_mask(jnp.asarray(SEGMENTS))
    weight = jnp.asarray(
        np.random.default_rng(9).normal(size=(B, S, H, D)) * REAL[:, :, None, None]
    )

    def make(fn):
        return jax.jit(
            jax.value_and_grad(lambda q, k, v: jnp.sum(fn(q, k, v, mask) * weight), (0, 1, 2))
        )

    return mask, {
        "autodiff": make(lambda q, k, v, m: attention.attend(q, [(k, v, m)])),
        "blocks1": make(lambda q, k, v, m: self_attend(q, k, v, m)),
        "blocks2": make(lambda q, k, v, m: self_attend(q, k, v, m, causal=True, blocks=2)),
        "blocks4": make(lambda q, k, v, m: self_attend(q, k, v, m, causal=True, blocks=4)),
    }


def test_self_attend_forward_matches_numpy_on_real_rows():
    q, k, v = _qkv(0)
    mask = attention.causal_segment_mask(jnp.asarray(SEGMENTS))
    want = _numpy_attention(q, k, v, np.asarray(mask))
    run = jax.jit(self_attend, static_argnames=("causal", "blocks"))
    for blocks in (1, 2, 4):
        got = np.asarray(run(q, k, v, mask, causal=True, blocks=blocks))
        np.testing.assert_allclose(got[REAL], want[REAL], atol=2e-6, rtol=1e-5)
        assert np.isfinite(got).all()  # padding rows too
    # Without blocking, rows that attend nothing match attend's uniform average as well.
    np.testing.assert_allclose(np.asarray(run(q, k, v, mask)), want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("name", ["blocks1", "blocks2", "blocks4"])
def test_self_attend_gradients_match_autodiff(attention_grads, name):
    _, fns = attention_grads
    q, k, v = _qkv(1)
    value, grads = fns[name](q, k, v)
    want_value, want_grads = fns["autodiff"](q, k, v)
    np.testing.assert_allclose(value, want_value, rtol=1e-5)
    for got, want in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-4)


def test_self_attend_arbitrary_mask_and_plain_multi_head():
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.normal(size=(1, 8, 2, 4)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, 8, 2, 4)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(1, 8, 2, 4)), jnp.float32)
    mask = jnp.asarray(rng.random((1, 8, 8)) < 0.6)  # not causal: no blocking allowed

    def loss(fn):
        return jax.jit(jax.grad(lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v))), (0, 1, 2)))(q, k, v)

    got = loss(lambda q, k, v: self_attend(q, k, v, mask))
    want = loss(lambda q, k, v: attention.attend(q, [(k, v, mask)]))
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)


def test_self_attend_padding_rows_pass_no_score_gradient():
    q, k, v = _qkv(4)
    mask = attention.causal_segment_mask(jnp.asarray(SEGMENTS))
    only_padding = jnp.asarray(~REAL, jnp.float32)[:, :, None, None]
    grads = jax.jit(
        jax.grad(
            lambda q, k: jnp.sum(self_attend(q, k, v, mask, causal=True, blocks=4) * only_padding),
            (0, 1),
        )
    )(q, k)
    assert all(float(jnp.max(jnp.abs(g))) == 0.0 for g in grads)


def test_self_attend_bfloat16_is_close_to_float32():
    mask = attention.causal_segment_mask(jnp.asarray(SEGMENTS))
    q, k, v = _qkv(5)
    want = self_attend(q, k, v, mask, causal=True)
    got = self_attend(*_qkv(5, jnp.bfloat16), mask, causal=True)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32)[REAL], np.asarray(want)[REAL], atol=0.05)


def test_self_attend_bfloat16_gradients_are_close_to_float32():
    # The bfloat16 backward makes row-major copies for its key and value gradients; every
    # gradient must stay within bfloat16 rounding of the float32 one, jitted.
    mask = attention.causal_segment_mask(jnp.asarray(SEGMENTS))
    weight = jnp.asarray(np.random.default_rng(6).normal(size=(B, S, H, D)), jnp.float32)

    def loss(q, k, v):
        out = self_attend(q, k, v, mask, causal=True).astype(jnp.float32)
        return jnp.sum(jnp.where(jnp.asarray(REAL)[..., None, None], out * weight, 0.0))

    grads = jax.jit(jax.grad(loss, (0, 1, 2)))
    want = grads(*_qkv(5))
    got = grads(*_qkv(5, jnp.bfloat16))
    for name, g, w in zip("qkv", got, want, strict=True):
        assert g.dtype == jnp.bfloat16, name
        g, w = np.asarray(g, np.float32), np.asarray(w)
        error = np.linalg.norm(g - w) / np.linalg.norm(w)
        assert 0 < error < 0.02, (name, error)


def test_self_attend_queries_at_some_columns_match_numpy_and_autodiff():
    # The last block under features(columns=): the sampled columns' queries on every key.
    q, k, v = _qkv(6)
    mask = attention.causal_segment_mask(jnp.asarray(SEGMENTS))
    columns = jnp.asarray([[2, 5, 7, 12, 14], [4, 6, 9, 13, 15]])  # padding row 14 included
    q_cols = jnp.take_along_axis(q, columns[:, :, None, None], axis=1)
    mask_cols = jnp.take_along_axis(mask, columns[:, :, None], axis=1)
    got = np.asarray(jax.jit(self_attend)(q_cols, k, v, mask_cols))
    want = _numpy_attention(q_cols, k, v, np.asarray(mask_cols))
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)
    # The full sequence's output at those columns, as the model used to compute it.
    full = _numpy_attention(q, k, v, np.asarray(mask))
    real = np.take_along_axis(REAL, np.asarray(columns), axis=1)
    np.testing.assert_allclose(
        got[real],
        np.take_along_axis(full, np.asarray(columns)[:, :, None, None], axis=1)[real],
        atol=2e-6,
        rtol=1e-5,
    )

    weight = jnp.asarray(np.random.default_rng(8).normal(size=q_cols.shape), jnp.float32)

    def grads(fn):
        return jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v) * weight), (0, 1, 2)))(
            q_cols, k, v
        )

    got_grads = grads(lambda q, k, v: self_attend(q, k, v, mask_cols))
    want_grads = grads(lambda q, k, v: attention.attend(q, [(k, v, mask_cols)]))
    for a, b in zip(got_grads, want_grads, strict=True):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)


def test_self_attend_rejects_shapes_that_disagree():
    q, k, v = _qkv(0)
    mask = attention.causal_segment_mask(jnp.asarray(SEGMENTS))
    with pytest.raises(ValueError, match=r"mask \(2, 16, 15\); expected .*\[B, S, T\]"):
        self_attend(q, k, v, mask[:, :, :15])
    with pytest.raises(
        ValueError, match="causal attention needs at least as many keys as queries; got 5 and 16"
    ):
        self_attend(q, k[:, :5], v[:, :5], mask[:, :, :5], causal=True)


@pytest.mark.parametrize("blocks", [2, 3, 6])
def test_self_attend_causal_queries_at_increasing_columns_skip_only_unseen_keys(blocks):
    """Queries at strictly increasing columns keep the causal promise with fewer queries than
    keys: each block reads keys up to T - S + its end, and values and gradients equal the
    unpromised call's on every query that attends something."""
    q, k, v = _qkv(11)
    mask = attention.causal_segment_mask(jnp.asarray(SEGMENTS))
    # Six increasing columns a row, padding columns (row 0's 13-15, row 1's 0-3) among them.
    columns = jnp.asarray([[0, 3, 6, 9, 12, 15], [1, 4, 5, 10, 11, 14]])
    q_cols = jnp.take_along_axis(q, columns[:, :, None, None], axis=1)
    mask_cols = jnp.take_along_axis(mask, columns[:, :, None], axis=1)
    real = np.take_along_axis(REAL, np.asarray(columns), axis=1)
    weight = jnp.asarray(
        np.random.default_rng(12).normal(size=q_cols.shape) * real[:, :, None, None], jnp.float32
    )

    def run(**promise):
        def loss(q, k, v):
            return jnp.sum(self_attend(q, k, v, mask_cols, **promise) * weight)

        return jax.jit(jax.value_and_grad(loss, (0, 1, 2)))(q_cols, k, v)

    def outputs(**promise):
        return np.asarray(jax.jit(lambda: self_attend(q_cols, k, v, mask_cols, **promise))())

    want = _numpy_attention(q_cols, k, v, np.asarray(mask_cols))
    got = outputs(causal=True, blocks=blocks)
    np.testing.assert_allclose(got[real], want[real], atol=2e-6, rtol=1e-5)
    (value, grads), (want_value, want_grads) = run(causal=True, blocks=blocks), run()
    np.testing.assert_allclose(value, want_value, rtol=1e-5)
    for a, b in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)
    # The blocks really skip keys: columns out of order break the promise and the result.
    shuffled = columns[:, ::-1]
    q_back = jnp.take_along_axis(q, shuffled[:, :, None, None], axis=1)
    mask_back = jnp.take_along_axis(mask, shuffled[:, :, None], axis=1)
    broken = np.asarray(self_attend(q_back, k, v, mask_back, causal=True, blocks=blocks))
    honest = _numpy_attention(q_back, k, v, np.asarray(mask_back))
    assert not np.allclose(broken[real[:, ::-1]], honest[real[:, ::-1]], atol=1e-3)


def test_self_attend_rejects_blocks_that_do_not_divide():
    q, k, v = _qkv(0)
    mask = attention.causal_segment_mask(jnp.asarray(SEGMENTS))
    with pytest.raises(
        ValueError, match="blocks is 3; expected a positive divisor of the length 16"
    ):
        self_attend(q, k, v, mask, causal=True, blocks=3)


def _step_inputs(dtype):
    """One query per row over a cache of S slots (some masked, row 1 all but the new one),
    in `attend`'s slot-major layout (the tests make `attend_step`'s head-major one)."""
    rng = np.random.default_rng(11)
    q = jnp.asarray(rng.normal(size=(B, 1, H, D)) * D**-0.5, dtype)
    k, v = (jnp.asarray(rng.normal(size=(B, S, K, D)), dtype) for _ in range(2))
    k_new, v_new = (jnp.asarray(rng.normal(size=(B, 1, K, D)), dtype) for _ in range(2))
    old = rng.random((B, 1, S)) < 0.6
    old[1] = False  # a row with nothing cached attends to its own entry alone
    new = np.ones((B, 1, 1), bool)
    return q, (k, v, jnp.asarray(old)), (k_new, v_new, jnp.asarray(new))


def test_attend_step_matches_numpy_and_attend():
    q, (k, v, old), (k_new, v_new, new) = _step_inputs(jnp.float32)
    head_major = (jnp.transpose(k, (0, 2, 3, 1)), jnp.swapaxes(v, 1, 2), old)
    got = jax.jit(attention.attend_step)(q, head_major, (k_new, v_new, new))
    assert got.shape == (B, 1, H, D) and got.dtype == jnp.float32
    keys = np.concatenate([np.asarray(k), np.asarray(k_new)], axis=1)
    values = np.concatenate([np.asarray(v), np.asarray(v_new)], axis=1)
    mask = np.concatenate([np.asarray(old), np.asarray(new)], axis=2)
    np.testing.assert_allclose(
        np.asarray(got), _numpy_attention(q, keys, values, mask), rtol=1e-5, atol=1e-6
    )
    # Row 1 sees only its new entry: its output is that entry's value, per kv head.
    np.testing.assert_allclose(
        np.asarray(got)[1, 0], np.repeat(np.asarray(v_new)[1, 0], H // K, axis=0), atol=1e-6
    )
    slot_major = attention.attend(q, [(k, v, old), (k_new, v_new, new)])
    np.testing.assert_allclose(np.asarray(got), np.asarray(slot_major), rtol=1e-5, atol=1e-6)


def test_attend_step_bfloat16_is_close_to_float32():
    q, (k, v, old), new_part = _step_inputs(jnp.float32)
    want = attention.attend_step(
        q, (jnp.transpose(k, (0, 2, 3, 1)), jnp.swapaxes(v, 1, 2), old), new_part
    )
    low = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v, new_part[0], new_part[1])]
    got = attention.attend_step(
        low[0],
        (jnp.transpose(low[1], (0, 2, 3, 1)), jnp.swapaxes(low[2], 1, 2), old),
        (low[3], low[4], new_part[2]),
    )
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=0.05)


def test_attend_step_rejects_more_than_one_query():
    q, (k, v, old), (k_new, v_new, new) = _step_inputs(jnp.float32)
    two = jnp.concatenate([q, q], axis=1)
    with pytest.raises(ValueError, match=r"one query and one new entry per row; got query"):
        attention.attend_step(
            two, (jnp.transpose(k, (0, 2, 3, 1)), jnp.swapaxes(v, 1, 2), old), (k_new, v_new, new)
        )


# ---------------------------------------------------------------- cross-entropy

N, F, V = 12, 6, 10


def _head(seed):
    rng = np.random.default_rng(seed)
    hidden = jnp.asarray(rng.normal(size=(2, N // 2, F)), jnp.float32)
    kernel = jnp.asarray(rng.normal(size=(F, V)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, V, (2, N // 2)), jnp.int32)
    return hidden, kernel, targets


def test_head_cross_entropy_matches_numpy():
    hidden, kernel, targets = _head(0)
    logits = np.asarray(hidden, np.float64) @ np.asarray(kernel, np.float64)
    top = logits.max(-1, keepdims=True)
    lse = (top + np.log(np.exp(logits - top).sum(-1, keepdims=True)))[..., 0]
    want = lse - np.take_along_axis(logits, np.asarray(targets)[..., None], -1)[..., 0]
    for chunk in (1 << 24, 3 * V, V):  # one chunk; 3 rows per chunk; 1 row per chunk
        nll, correct = head_cross_entropy(hidden, kernel, targets, chunk_elements=chunk)
        np.testing.assert_allclose(nll, want, rtol=1e-5)
        np.testing.assert_array_equal(correct, logits.argmax(-1) == np.asarray(targets))


@pytest.mark.parametrize("chunk", [1 << 24, 5 * V])  # 5 rows: 12 tokens padded to 15
def test_head_cross_entropy_gradients_match_optax(chunk):
    hidden, kernel, targets = _head(1)
    weight = jnp.linspace(0.5, 1.5, N).reshape(2, N // 2)

    def fused(h, w):
        return jnp.sum(head_cross_entropy(h, w, targets, chunk_elements=chunk)[0] * weight)

    def plain(h, w):
        logits = jnp.einsum("bsf,fv->bsv", h, w)
        return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, targets) * weight)

    got = jax.grad(fused, (0, 1))(hidden, kernel)
    want = jax.grad(plain, (0, 1))(hidden, kernel)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_head_cross_entropy_tied_kernel_and_ties():
    hidden, kernel, targets = _head(2)
    table = kernel.T  # a tied embedding [V, F]
    got = jax.value_and_grad(
        lambda t: jnp.sum(head_cross_entropy(hidden, t, targets, transposed=True)[0])
    )(table)
    want = jax.value_and_grad(lambda t: jnp.sum(head_cross_entropy(hidden, t.T, targets)[0]))(table)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    np.testing.assert_allclose(got[1], want[1], atol=1e-6)
    # All logits equal: argmax is the first id, so only target 0 counts as correct.
    _, correct = head_cross_entropy(hidden, jnp.zeros_like(kernel), targets)
    np.testing.assert_array_equal(correct, np.asarray(targets) == 0)


@pytest.mark.parametrize("transposed", [False, True])
def test_head_cross_entropy_in_bfloat16_matches_float64_on_rounded_operands(transposed):
    # bfloat16 hidden states: the products read bfloat16 operands (hidden, kernel, and the
    # logits' gradient) and accumulate in float32; the kernel gradient is not rounded.
    hidden, kernel, targets = _head(3)
    table = kernel.T if transposed else kernel
    half = jnp.asarray(hidden, jnp.bfloat16)
    weight = np.linspace(0.5, 1.5, N).reshape(2, N // 2)

    def loss(h, w):
        nll = head_cross_entropy(h, w, targets, transposed=transposed)[0]
        return jnp.sum(nll * weight)

    nll = head_cross_entropy(half, table, targets, transposed=transposed)[0]
    d_hidden, d_table = jax.jit(jax.grad(loss, (0, 1)))(half, table)
    assert d_hidden.dtype == jnp.bfloat16 and d_table.dtype == jnp.float32

    def rounded(a):
        return np.asarray(jnp.asarray(a, jnp.bfloat16), np.float64)

    h, w = rounded(hidden).reshape(N, F), rounded(kernel)
    logits = h @ w
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    ids = np.asarray(targets).reshape(N)
    want_nll = -np.log(probs[np.arange(N), ids])
    np.testing.assert_allclose(np.asarray(nll).reshape(N), want_nll, rtol=1e-5, atol=1e-5)
    d_logits = (probs - np.eye(V)[ids]) * weight.reshape(N, 1)
    d_logits = rounded(d_logits)  # the backward reads the logits' gradient in bfloat16
    want_hidden = rounded(d_logits @ w.T).reshape(hidden.shape)
    np.testing.assert_allclose(np.asarray(d_hidden, np.float64), want_hidden, rtol=2**-7, atol=1e-3)
    want_kernel = h.T @ d_logits
    np.testing.assert_allclose(
        np.asarray(d_table).T if transposed else d_table, want_kernel, rtol=1e-3, atol=1e-4
    )


def test_head_cross_entropy_rejects_mismatched_shapes():
    hidden, kernel, targets = _head(0)
    with pytest.raises(ValueError, match="expected hidden \\[..., D\\] and kernel \\[D, V\\]"):
        head_cross_entropy(hidden, kernel.T, targets)
    with pytest.raises(ValueError, match="targets has shape \\(2, 5\\)"):
        head_cross_entropy(hidden, kernel, targets[:, :5])
    with pytest.raises(ValueError, match="chunk_elements is 0"):
        head_cross_entropy(hidden, kernel, targets, chunk_elements=0)


def test_swiglu_backward_matches_autodiff():
    rng = np.random.default_rng(6)
    gate, up, d_out = (jnp.asarray(rng.normal(size=(5, 7)) * 3, jnp.float32) for _ in range(3))
    got = jax.vjp(swiglu, gate, up)[1](d_out)
    want = jax.vjp(lambda g, u: jax.nn.silu(g) * u, gate, up)[1](d_out)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def _bf16(values: np.ndarray) -> np.ndarray:
    """float64 values rounded to bfloat16 (round to nearest even), back in float64."""
    return np.asarray(jnp.asarray(values, jnp.float32).astype(jnp.bfloat16), np.float64)


def test_swiglu_in_bfloat16_rounds_silu_then_the_product():
    # PyTorch's arithmetic on bfloat16 tensors: silu computed wide and rounded, then the
    # product of two bfloat16 values rounded; not a rounding after each op of silu.
    rng = np.random.default_rng(16)
    gate, up = (_bf16(rng.normal(size=(64, 96)) * 3) for _ in range(2))
    got = swiglu(jnp.asarray(gate, jnp.bfloat16), jnp.asarray(up, jnp.bfloat16))
    assert got.dtype == jnp.bfloat16
    want = _bf16(_bf16(gate / (1 + np.exp(-gate))) * up)
    np.testing.assert_array_equal(np.asarray(got, np.float64), want)


def _numpy_rms_norm(x, scale, eps, d_out):
    inverse = 1 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    normed = x * inverse
    d_normed = d_out * scale
    d_x = inverse * (d_normed - normed * np.mean(d_normed * normed, axis=-1, keepdims=True))
    d_scale = np.sum((normed * d_out).reshape(-1, x.shape[-1]), axis=0)
    return normed * scale, d_x, d_scale


@pytest.mark.parametrize("shape", [(3, 5, 16), (7, 2, 3, 8)])
def test_rms_norm_gradients_match_numpy(shape):
    rng = np.random.default_rng(17)
    x, d_out = rng.normal(size=shape) * 2, rng.normal(size=shape)
    scale = rng.normal(size=shape[-1:])
    out, pullback = jax.vjp(
        lambda a, b: rms_norm(a, b, 1e-5, jnp.float32),
        jnp.asarray(x, jnp.float32),
        jnp.asarray(scale, jnp.float32),
    )
    d_x, d_scale = pullback(jnp.asarray(d_out, jnp.float32))
    want_out, want_d_x, want_d_scale = _numpy_rms_norm(x, scale, 1e-5, d_out)
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(d_x, want_d_x, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(d_scale, want_d_scale, rtol=1e-5, atol=1e-5)
    # and autodiff of the same arithmetic
    # the hand-written backward of narrower compute dtypes, run in float32, agrees too
    narrow = jax.vjp(
        lambda a, b: _narrow_rms_norm(a, b, 1e-5, jnp.float32),
        jnp.asarray(x, jnp.float32),
        jnp.asarray(scale, jnp.float32),
    )[1](jnp.asarray(d_out, jnp.float32))
    np.testing.assert_allclose(narrow[0], want_d_x, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(narrow[1], want_d_scale, rtol=1e-5, atol=1e-5)


def test_rms_norm_in_bfloat16_keeps_the_scale_gradient_in_float32():
    # The forward scales the rounded normed values by the rounded scale; the scale's
    # gradient sums float32 products of those (not products rounded to bfloat16), and
    # comes back float32 for a float32 scale.
    rng = np.random.default_rng(18)
    x = _bf16(rng.normal(size=(4, 33, 16)) * 2)
    d_out = _bf16(rng.normal(size=(4, 33, 16)))
    scale = rng.normal(size=(16,)).astype(np.float32)
    out, pullback = jax.vjp(
        lambda a, b: rms_norm(a, b, 1e-6, jnp.bfloat16),
        jnp.asarray(x, jnp.bfloat16),
        jnp.asarray(scale),
    )
    d_x, d_scale = pullback(jnp.asarray(d_out, jnp.bfloat16))
    assert (out.dtype, d_x.dtype, d_scale.dtype) == (jnp.bfloat16, jnp.bfloat16, jnp.float32)
    normed = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6)
    np.testing.assert_array_equal(np.asarray(out, np.float64), _bf16(_bf16(normed) * _bf16(scale)))
    want_d_scale = np.sum((_bf16(normed) * d_out).reshape(-1, 16), axis=0)
    np.testing.assert_allclose(d_scale, want_d_scale, rtol=2e-6, atol=1e-4)
    _, want_d_x, _ = _numpy_rms_norm(x, _bf16(scale), 1e-6, d_out)
    np.testing.assert_allclose(np.asarray(d_x, np.float64), want_d_x, rtol=1e-2, atol=1e-2)


def test_rotary_angles_are_computed_once_per_pass():
    # XLA's CPU backend fused the cosine into every rotation that read it; the decoder's
    # uncached pass computes the angles once (`rotary_angles_once`), with the same values.
    positions = jnp.asarray([[0, 1, 2, 7], [3, 0, 1, 2]], jnp.int32)
    inv_freq = jnp.asarray([1.0, 0.1, 0.01], jnp.float32)
    for a, b in zip(
        attention.rotary_angles_once(positions, inv_freq),
        attention.rotary_angles(positions, inv_freq),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)
    model = models.build(
        "causal_transformer", vocab_size=16, emb_features=16, num_layers=3, num_heads=2,
        mlp_features=32, max_seq_len=8, scan_layers=False,
    )  # fmt: skip
    tokens = jnp.ones((2, 8), jnp.int32)
    variables = model.init(jax.random.key(0), tokens)

    def loss(params):
        return jnp.sum(model.apply({"params": params}, tokens))

    compiled = jax.jit(jax.grad(loss)).lower(variables["params"]).compile().as_text()
    assert compiled.count(" cosine(") == 1, "the rotary cosine is computed more than once"


@pytest.mark.parametrize("shape", [(12, 5), (5, 12), (6, 6)])
def test_dense_gradients_match_numpy(shape):
    # A narrowing float32 projection (in > out) computes its kernel gradient with the
    # operands swapped; every orientation must give x^T g and g W^T.
    rng = np.random.default_rng(7)
    x = rng.normal(size=(3, 4, shape[0]))
    kernel, d_out = rng.normal(size=shape), rng.normal(size=(3, 4, shape[1]))
    out, pullback = jax.vjp(dense, jnp.asarray(x, jnp.float32), jnp.asarray(kernel, jnp.float32))
    d_x, d_kernel = pullback(jnp.asarray(d_out, jnp.float32))
    assert out.dtype == d_x.dtype == d_kernel.dtype == jnp.float32
    np.testing.assert_allclose(out, x @ kernel, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(d_x, d_out @ kernel.T, rtol=1e-5, atol=1e-5)
    flat_x, flat_d = x.reshape(-1, shape[0]), d_out.reshape(-1, shape[1])
    np.testing.assert_allclose(d_kernel, flat_x.T @ flat_d, rtol=1e-5, atol=1e-5)
    # Under jit too, where the barrier and the transpose are compiled.
    grads = jax.jit(jax.grad(lambda x, k: jnp.sum(jnp.sin(dense(x, k))), (0, 1)))
    want = jax.grad(lambda x, k: jnp.sum(jnp.sin(x @ k)), (0, 1))
    args = (jnp.asarray(x, jnp.float32), jnp.asarray(kernel, jnp.float32))
    for a, b in zip(grads(*args), want(*args), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(12, 5), (5, 12)])
def test_bfloat16_dense_gradients_are_float32_products_of_bfloat16_values(shape):
    # bfloat16 compute with float32 weights: each product reads bfloat16 operands (the
    # weights and the cotangent rounded first) and accumulates in float32. The output and
    # the input gradient are rounded once to bfloat16; the weight gradient is not rounded.
    rng = np.random.default_rng(8)
    x = rng.normal(size=(2, 3, shape[0]))
    kernel, d_out = rng.normal(size=shape), rng.normal(size=(2, 3, shape[1]))

    def rounded(a):
        return np.asarray(jnp.asarray(a, jnp.bfloat16), np.float64)

    args = (jnp.asarray(x, jnp.bfloat16), jnp.asarray(kernel, jnp.float32))
    out, pullback = jax.vjp(dense, *args)
    d_x, d_kernel = pullback(jnp.asarray(d_out, jnp.bfloat16))
    assert out.dtype == d_x.dtype == jnp.bfloat16 and d_kernel.dtype == jnp.float32
    bx, bk, bd = rounded(x), rounded(kernel), rounded(d_out)
    for got, want in ((out, bx @ bk), (d_x, bd @ bk.T)):
        got = np.asarray(got, np.float64)
        np.testing.assert_allclose(got, rounded(want), rtol=2**-8, atol=1e-6)
        assert np.abs(got - want).max() > 0  # rounded to bfloat16, not the exact product
    flat_x, flat_d = bx.reshape(-1, shape[0]), bd.reshape(-1, shape[1])
    np.testing.assert_allclose(d_kernel, flat_x.T @ flat_d, rtol=1e-5, atol=1e-5)
    # Jitted, where the row-major copies and the barrier are compiled: the same values.
    jitted = jax.jit(lambda x, k, d: jax.vjp(dense, x, k)[1](d))
    got = jitted(*args, jnp.asarray(d_out, jnp.bfloat16))
    for a, b in zip(got, (d_x, d_kernel), strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-6)


# ---------------------------------------------------------------- the decoder

CONFIG = dict(
    vocab_size=32,
    emb_features=16,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    mlp_features=24,
    max_seq_len=16,
)


def test_scan_layers_resolves_and_is_checked():
    assert not models.TransformerConfig(**CONFIG).uses_layer_scan
    assert models.TransformerConfig(**dict(CONFIG, num_layers=9)).uses_layer_scan
    assert models.TransformerConfig(**dict(CONFIG, scan_layers=True)).uses_layer_scan
    with pytest.raises(TypeError, match="scan_layers is 'yes'; expected None or a bool"):
        models.TransformerConfig(**dict(CONFIG, scan_layers="yes"))


@pytest.fixture(scope="module")
def lm_grads():
    """Loss and gradients of LMObjective for the scanned and unrolled layer loops."""
    rng = np.random.default_rng(7)
    batch = {
        "text": rng.integers(0, 32, (2, 13)).astype(np.int32),
        "text_segment_ids": np.array([[1] * 7 + [2] * 5 + [0], [0] * 3 + [1] * 10], np.int32),
    }
    batch["text_positions"] = np.array(
        [list(range(7)) + list(range(5)) + [0], [0] * 3 + list(range(10))], np.int32
    )
    out = {}
    for name, options in (("scan", dict(scan_layers=True)), ("unrolled", {})):
        model = models.build("causal_transformer", **CONFIG, **options)
        objective = LMObjective(model, seq_len=12, ema_decay=None)
        params = objective.init(jax.random.key(0))
        grad = jax.jit(jax.value_and_grad(objective.loss, has_aux=True))
        out[name] = (objective, params, grad(params, batch, jax.random.key(1)))
    return batch, out


def test_unrolled_layers_equal_the_scan(lm_grads):
    _, out = lm_grads
    (_, scan_params, ((loss, _), grads)) = out["scan"]
    (_, unrolled_params, ((loss_u, _), grads_u)) = out["unrolled"]
    # Initialization always runs through the scan, so both start from the same weights.
    for a, b in zip(jax.tree.leaves(scan_params), jax.tree.leaves(unrolled_params), strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(loss_u, loss, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads_u), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)


class _LogitsOnly:
    """The same decoder seen only through init/apply: LMObjective takes the logits path."""

    def __init__(self, model):
        self.config, self.init, self.apply = model.config, model.init, model.apply


def test_fused_loss_equals_the_logits_loss(lm_grads):
    batch, out = lm_grads
    objective, params, ((loss, metrics), grads) = out["unrolled"]
    plain = LMObjective(_LogitsOnly(objective.model), seq_len=12, ema_decay=None)
    assert objective._fused and not plain._fused
    (want, want_metrics), want_grads = jax.jit(jax.value_and_grad(plain.loss, has_aux=True))(
        params, batch, jax.random.key(1)
    )
    np.testing.assert_allclose(loss, want, rtol=1e-6)
    assert float(metrics["tokens"]) == float(want_metrics["tokens"]) == 19.0  # 10 + 9 by hand
    np.testing.assert_allclose(metrics["accuracy"], want_metrics["accuracy"])
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)
    sums = jax.jit(objective.evaluate)(params, batch)
    want_sums = jax.jit(plain.evaluate)(params, batch)
    for name in ("nll", "tokens", "correct"):
        np.testing.assert_allclose(sums[name], want_sums[name], rtol=1e-6)
