"""Sampling controls and the per-step sampler against a NumPy reference of each filter."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew_pipe.sampling import Sampling, argmax, filtered_logits, sample

# ---------------------------------------------------------------- NumPy reference


def reference_filtered(logits, temperature, top_k=None, top_p=None, min_p=None):
    """Float64 log-probabilities of the behavior distribution (-inf outside the support).

    Written from the definitions: temperature, keep the k largest, keep the shortest
    descending prefix reaching top_p of the renormalised mass, drop ids below min_p times
    the largest probability.
    """
    x = np.asarray(logits, np.float64) / temperature
    out = np.empty_like(x)
    for r, row in enumerate(x):
        keep = np.ones(row.shape, bool)
        if top_k is not None:
            keep &= row >= np.sort(row)[::-1][min(top_k, row.size) - 1]
        if top_p is not None:
            probs = np.where(keep, np.exp(row - row.max()), 0.0)
            probs /= probs.sum()
            mass = 0.0
            chosen = np.zeros(row.shape, bool)
            for i in sorted(np.flatnonzero(keep), key=lambda i: (-row[i], i)):
                if mass >= top_p:
                    break
                chosen[i] = True
                mass += probs[i]
            keep &= chosen
        if min_p is not None:
            probs = np.where(keep, np.exp(row - row.max()), 0.0)
            keep &= probs >= min_p * probs.max()
        kept = np.where(keep, row, -np.inf)
        out[r] = kept - (kept.max() + np.log(np.exp(kept - kept.max()).sum()))
    return out


def log_softmax(x):
    x = np.asarray(x, np.float64)
    top = x.max(-1, keepdims=True)
    return x - top - np.log(np.exp(x - top).sum(-1, keepdims=True))


@pytest.fixture(scope="module")
def logits():
    return np.random.default_rng(0).normal(size=(6, 40)).astype(np.float32) * 2.0


# ---------------------------------------------------------------- controls


def test_defaults_and_normalisation():
    s = Sampling()
    assert (s.eos_id, s.temperature, s.top_k, s.top_p, s.min_p) == (None, 1.0, None, None, None)
    assert s.eos_ids == () and not s.greedy and not s.transforms
    assert Sampling(eos_id=[3, 5]).eos_id == (3, 5)
    assert Sampling(eos_id=np.int64(4)).eos_ids == (4,)
    assert Sampling(temperature=0).greedy and Sampling(temperature=0).transforms
    assert Sampling(top_k=3).transforms and not Sampling(top_p=1.0, min_p=0.0).transforms
    assert hash(Sampling(eos_id=(1, 2), top_k=4)) == hash(Sampling(eos_id=[1, 2], top_k=4))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(eos_id=-1), ValueError, "eos_id is -1"),
        (dict(eos_id=True), TypeError, "eos_id is True"),
        (dict(eos_id=2.0), TypeError, "eos_id is 2.0"),
        (dict(eos_id=()), ValueError, "nonempty tuple"),
        (dict(eos_id=(3, 3)), ValueError, "distinct"),
        (dict(eos_id=(3, -2)), ValueError, "eos_id is -2"),
        (dict(temperature=-0.5), ValueError, "temperature is -0.5"),
        (dict(temperature=math.nan), ValueError, "temperature is nan"),
        (dict(temperature=math.inf), ValueError, "temperature is inf"),
        (dict(temperature="1"), TypeError, "temperature is '1'"),
        (dict(top_k=0), ValueError, "top_k is 0"),
        (dict(top_k=2.0), TypeError, "top_k is 2.0"),
        (dict(top_k=True), TypeError, "top_k is True"),
        (dict(top_p=0.0), ValueError, r"top_p is 0.0; expected a number in \(0.0, 1.0\]"),
        (dict(top_p=1.5), ValueError, "top_p is 1.5"),
        (dict(min_p=-0.1), ValueError, "min_p is -0.1"),
        (dict(min_p=1.01), ValueError, "min_p is 1.01"),
    ],
)
def test_bad_controls_name_the_field(kwargs, error, match):
    with pytest.raises(error, match=match):
        Sampling(**kwargs)


def test_eos_checks():
    s = Sampling(eos_id=(2, 7))
    assert np.asarray(s.is_eos(jnp.array([1, 2, 7, 9]))).tolist() == [False, True, True, False]
    assert not np.asarray(Sampling().is_eos(jnp.array([0, 2]))).any()
    s.check_vocab(8)
    with pytest.raises(ValueError, match="eos_id contains 7; expected ids below vocab_size=7"):
        s.check_vocab(7)


# ---------------------------------------------------------------- sampler


def test_argmax_takes_the_first_maximum_and_stays_in_range():
    x = jnp.array(
        [[1.0, 3.0, 3.0, 0.0], [-jnp.inf, -1.0, -jnp.inf, -1.0], [0.0, jnp.nan, 1.0, 2.0]]
    )
    assert np.asarray(argmax(x)).tolist() == [1, 1, 3]
    rows = np.random.default_rng(1).normal(size=(5, 33)).astype(np.float32)
    np.testing.assert_array_equal(argmax(jnp.asarray(rows)), rows.argmax(-1))


@pytest.mark.parametrize(
    "controls",
    [
        dict(temperature=0.7),
        dict(temperature=1.3, top_k=5),
        dict(temperature=1.0, top_p=0.6),
        dict(temperature=0.8, min_p=0.2),
        dict(temperature=0.9, top_k=12, top_p=0.8, min_p=0.05),
        dict(temperature=2.0, top_k=100),  # k above the vocabulary keeps everything
    ],
)
def test_filtered_distribution_matches_reference(logits, controls):
    got = np.asarray(jax.nn.log_softmax(filtered_logits(logits, Sampling(**controls))))
    want = reference_filtered(logits, **controls)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], atol=1e-5)
    assert (np.isfinite(want).sum(-1) >= 1).all()


def test_top_k_compiles_to_a_top_k_not_a_sort_of_the_row():
    # A slice of top_k's values makes XLA sort the whole row (10x slower per decode step on
    # CPU at k=40 of 1024 ids); the k-th value is taken as the minimum of the k instead.
    x = jnp.zeros((4, 256), jnp.float32)
    text = jax.jit(lambda x: filtered_logits(x, Sampling(top_k=8))).lower(x).compile().as_text()
    assert " sort(" not in text


def test_filtered_logits_refuse_greedy(logits):
    with pytest.raises(ValueError, match="sampling is greedy"):
        filtered_logits(logits, Sampling(temperature=0))


def test_greedy_picks_the_argmax_with_zero_behavior_log_prob(logits):
    out = sample(logits, jax.random.key(0), Sampling(temperature=0, top_k=3), support=True)
    ids = np.asarray(out.ids)
    np.testing.assert_array_equal(ids, logits.argmax(-1))
    want = log_softmax(logits)[np.arange(len(ids)), ids]
    np.testing.assert_allclose(out.log_probs, want, atol=1e-6)
    np.testing.assert_array_equal(out.behavior_log_probs, np.zeros(len(ids)))
    np.testing.assert_array_equal(np.asarray(out.support), np.eye(40, dtype=bool)[ids])


@pytest.mark.parametrize("controls", [dict(temperature=0.6, top_k=4), dict(top_p=0.7, min_p=0.1)])
def test_draws_report_raw_and_behavior_log_probs(logits, controls):
    s = Sampling(**controls)
    out = jax.jit(sample, static_argnames=("sampling", "support"))(
        logits, jax.random.key(3), sampling=s, support=True
    )
    ids = np.asarray(out.ids)
    rows = np.arange(len(ids))
    want = reference_filtered(logits, **{"temperature": 1.0, **controls})
    assert np.isfinite(want[rows, ids]).all()  # never outside the support
    np.testing.assert_allclose(out.behavior_log_probs, want[rows, ids], atol=1e-5)
    np.testing.assert_allclose(out.log_probs, log_softmax(logits)[rows, ids], atol=1e-5)
    np.testing.assert_array_equal(np.asarray(out.support), np.isfinite(want))


def test_untransformed_sampling_reports_equal_likelihoods(logits):
    out = sample(logits, jax.random.key(5), Sampling())
    np.testing.assert_array_equal(out.log_probs, out.behavior_log_probs)


def _chi_square_bound(df: int) -> float:
    # Wilson-Hilferty approximation of the chi-square quantile at p = 1e-4 (z = 3.719):
    # a correct sampler exceeds it once in ten thousand seeds.
    z = 3.719
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize(
    "controls", [dict(temperature=1.0), dict(temperature=0.5, top_k=4), dict(top_p=0.8)]
)
def test_empirical_frequencies_match_behavior_probabilities(controls):
    row = np.array([1.2, 0.3, -0.4, 0.9, -1.5, 0.0], np.float32)
    draws = 40_000
    s = Sampling(**controls)
    out = jax.jit(sample, static_argnames=("sampling",))(
        np.tile(row, (draws, 1)), jax.random.key(11), sampling=s
    )
    counts = np.bincount(np.asarray(out.ids), minlength=row.size)
    probs = np.exp(reference_filtered(row[None], **{"temperature": 1.0, **controls})[0])
    assert (counts[probs == 0] == 0).all()
    kept = probs > 0
    expected = draws * probs[kept]
    chi2 = float(((counts[kept] - expected) ** 2 / expected).sum())
    assert chi2 < _chi_square_bound(max(int(kept.sum()) - 1, 1)), (counts, expected)
    np.testing.assert_allclose(
        np.exp(np.asarray(out.behavior_log_probs[:10])), probs[np.asarray(out.ids[:10])], rtol=1e-5
    )
