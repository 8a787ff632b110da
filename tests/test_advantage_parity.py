"""Outcome advantage estimators against verl 0.9.1 (fixture from tests/parity/record_verl.py).

verl returns each response's advantage repeated over its response mask; the recorded
groups include a singleton, a group of equal rewards (zero spread) and groups of two to
four, with binary rewards in one draw and continuous ones in the others.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dew_pipe.objectives.rl.advantages import compute_advantages

FIXTURE = Path(__file__).parent / "parity" / "fixtures" / "verl_grpo.npz"


@pytest.fixture(scope="module")
def verl() -> dict[str, np.ndarray]:
    with np.load(FIXTURE) as data:
        return {k: data[k] for k in data.files if k.startswith("adv")}


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(
    "estimator, recorded",
    [("group", "grpo"), ("mean", "mean"), ("rloo", "rloo")],
)
def test_estimator_matches_verl(verl, seed, estimator, recorded):
    key = f"adv{seed}"
    scores, index, mask = verl[f"{key}.in.scores"], verl[f"{key}.in.index"], verl[f"{key}.in.mask"]
    ours = compute_advantages(scores, index, estimator)
    assert ours.dtype == np.float32 and ours.shape == scores.shape
    expected = verl[f"{key}.{recorded}"]
    np.testing.assert_allclose(ours[:, None] * mask, expected, rtol=1e-6, atol=1e-6)
    # The fixture is not degenerate: some advantages are far from zero, the tied group is 0.
    assert np.abs(expected).max() > 0.3
    tied = index == 3
    np.testing.assert_array_equal(ours[tied], 0.0)


def test_group_ids_need_not_be_sorted_or_dense(verl):
    """verl groups by equal index values; shuffled, sparse ids give the same advantages."""
    scores, index = verl["adv1.in.scores"], verl["adv1.in.index"]
    relabelled = np.array([1000 - 37 * g for g in index])
    for estimator in ("group", "mean", "rloo"):
        np.testing.assert_array_equal(
            compute_advantages(scores, relabelled, estimator),
            compute_advantages(scores, index, estimator),
        )
