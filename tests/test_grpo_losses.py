"""GRPO loss pieces against verl 0.9.1 (fixture from tests/parity/record_verl.py).

Every loss is compared with verl's value and with the gradient torch autograd took
with respect to ``log_prob``, at 1e-6 (absolute, plus 1e-6 relative for sums that
grow past 1). Bad options and inputs are checked at the end.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew_pipe.objectives.rl import losses as L
from dew_pipe.objectives.rl.policy import PolicyOptions, policy_loss

FIXTURE = Path(__file__).parent / "parity" / "fixtures" / "verl_grpo.npz"
SEEDS = (0, 1, 2)
AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "seq-mean-token-mean",
)
TOL = {"rtol": 1e-6, "atol": 1e-6}


@pytest.fixture(scope="module")
def verl() -> dict[str, np.ndarray]:
    with np.load(FIXTURE) as data:
        return {k: data[k] for k in data.files}


@pytest.fixture(scope="module")
def meta(verl) -> dict:
    return json.loads(verl["meta"].tobytes().decode())


def inputs(verl: dict, seed: int) -> dict[str, jax.Array]:
    prefix = f"s{seed}.in."
    return {k[len(prefix) :]: jnp.asarray(v) for k, v in verl.items() if k.startswith(prefix)}


def check(actual, expected, what: str) -> None:
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), err_msg=what, **TOL)


def value_and_grad(fn, log_prob):
    return jax.value_and_grad(fn)(log_prob)


@pytest.mark.parametrize("seed", SEEDS)
def test_vanilla_matches_verl(verl, meta, seed):
    x = inputs(verl, seed)
    engaged = 0.0
    for i, (low, high, dual) in enumerate(meta["vanilla_clips"]):
        for mode in AGG_MODES:
            for weighted in (False, True) if mode == "token-mean" else (False,):
                name = f"s{seed}.vanilla{i}.{mode}{'.tis' if weighted else ''}"

                def loss(lp, low=low, high=high, dual=dual, mode=mode, weighted=weighted):
                    t = L.ppo_clip_loss(
                        lp,
                        x["old_log_prob"],
                        x["advantages"],
                        epsilon_low=low,
                        epsilon_high=high,
                        dual_clip=dual,
                    )
                    token = t.loss * x["tis_weights"] if weighted else t.loss
                    return L.aggregate(token, x["mask"], mode), t

                (value, terms), grad = jax.value_and_grad(loss, has_aux=True)(x["log_prob"])
                check(value, verl[f"{name}.loss"], name)
                check(grad, verl[f"{name}.grad"], f"{name} grad")
                check(L.masked_mean(terms.clipped, x["mask"]), verl[f"{name}.clipfrac"], name)
                check(
                    L.masked_mean(terms.clipped_lower, x["mask"]),
                    verl[f"{name}.clipfrac_lower"],
                    name,
                )
                check(L.masked_mean(-terms.log_ratio, x["mask"]), verl[f"{name}.ppo_kl"], name)
                engaged += float(verl[f"{name}.clipfrac_lower"])
    assert engaged > 0, "no case engages the dual clip; the fixture does not test it"


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kind", ["gspo", "cispo"])
def test_gspo_and_cispo_match_verl(verl, seed, kind):
    x = inputs(verl, seed)
    for i, (low, high) in enumerate(((0.2, 0.2), (3e-4, 4e-4), (0.2, 0.28))):
        for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
            for weighted in (False, True):
                name = f"s{seed}.{kind}{i}.{mode}{'.tis' if weighted else ''}"

                def loss(lp, low=low, high=high, mode=mode, weighted=weighted):
                    clip = {"epsilon_low": low, "epsilon_high": high}
                    if kind == "gspo":
                        t = L.gspo_loss(lp, x["old_log_prob"], x["advantages"], x["mask"], **clip)
                    else:
                        t = L.cispo_loss(lp, x["old_log_prob"], x["advantages"], **clip)
                    token = t.loss * x["tis_weights"] if weighted else t.loss
                    return L.aggregate(token, x["mask"], mode), t

                (value, terms), grad = jax.value_and_grad(loss, has_aux=True)(x["log_prob"])
                check(value, verl[f"{name}.loss"], name)
                check(grad, verl[f"{name}.grad"], f"{name} grad")
                check(L.masked_mean(terms.clipped, x["mask"]), verl[f"{name}.clipfrac"], name)
                check(L.masked_mean(-terms.log_ratio, x["mask"]), verl[f"{name}.ppo_kl"], name)


@pytest.mark.parametrize("seed", SEEDS)
def test_aggregation_modes_match_verl(verl, seed):
    x = inputs(verl, seed)
    for mode in AGG_MODES:
        value, grad = value_and_grad(
            lambda u, mode=mode: L.aggregate(u * u, x["mask"], mode), x["upstream"]
        )
        check(value, verl[f"s{seed}.agg.{mode}.loss"], mode)
        check(grad, verl[f"s{seed}.agg.{mode}.grad"], f"{mode} grad")


def test_session_mean_groups_tokens_across_rows():
    """A session split over two rows counts once, with the mean of all its tokens."""
    loss = jnp.array([[1.0, 3.0, 0.0], [5.0, 2.0, 4.0]])
    mask = jnp.array([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    sessions = jnp.array([[7, 7, 0], [7, 9, 9]])
    # session 7: tokens 1, 3, 5 -> 3; session 9: tokens 2, 4 -> 3; padding never forms a group.
    assert float(L.aggregate(loss, mask, "session-mean", sessions)) == pytest.approx(3.0)
    sessions = jnp.array([[7, 7, 0], [8, 9, 9]])  # 7: 2, 8: 5, 9: 3
    assert float(L.aggregate(loss, mask, "session-mean", sessions)) == pytest.approx(10 / 3)
    # A fully masked session leaves the denominator.
    masked = mask.at[1, 0].set(0.0)
    assert float(L.aggregate(loss, masked, "session-mean", sessions)) == pytest.approx(2.5)
    assert float(L.aggregate(loss, jnp.zeros_like(mask), "session-mean", sessions)) == 0.0
    assert float(L.aggregate(loss, jnp.zeros_like(mask), "token-mean")) == 0.0


@pytest.mark.parametrize("seed", SEEDS)
def test_kl_estimators_match_verl(verl, seed):
    x = inputs(verl, seed)
    for kind in ("k1", "abs", "k2", "k3", "low_var_kl", "k3+", "k1+"):
        name = f"s{seed}.kl.{kind}"
        check(L.kl_penalty(x["log_prob"], x["ref_log_prob"], kind), verl[f"{name}.value"], name)
        value, grad = value_and_grad(
            lambda lp, kind=kind: L.aggregate(L.kl_penalty(lp, x["ref_log_prob"], kind), x["mask"]),
            x["log_prob"],
        )
        check(value, verl[f"{name}.loss"], name)
        check(grad, verl[f"{name}.grad"], f"{name} grad")
    assert float(jnp.max(verl[f"s{seed}.kl.k3.value"])) > 1.0, (
        "k3 far from the reference is not exercised"
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_importance_weights_match_verl(verl, seed):
    x = inputs(verl, seed)
    log_ratio = x["old_log_prob"] - x["rollout_log_prob"]
    for name, cap in (("tis2", 2.0), ("tis1.5", 1.5)):
        weights = L.truncated_importance_weights(log_ratio, x["mask"], cap)
        check(weights, verl[f"s{seed}.is.{name}.weights"], name)
        ess = L.mismatch_metrics(x["old_log_prob"], x["rollout_log_prob"], x["mask"], weights, cap)[
            "ess"
        ]
        check(ess, verl[f"s{seed}.is.{name}.ess"], f"{name} ess")
    for name, (low, high) in (("icepop", (0.5, 2.0)), ("icepop_narrow", (0.8, 1.25))):
        weights, outside = L.icepop_weights(log_ratio, x["mask"], low, high)
        check(weights, verl[f"s{seed}.is.{name}.weights"], name)
        check(L.masked_mean(outside, x["mask"]), verl[f"s{seed}.is.{name}.oob"], f"{name} oob")
        ess = L.mismatch_metrics(
            x["old_log_prob"], x["rollout_log_prob"], x["mask"], weights, high
        )["ess"]
        check(ess, verl[f"s{seed}.is.{name}.ess"], f"{name} ess")
    assert float(verl[f"s{seed}.is.icepop_narrow.oob"]) > 0


@pytest.mark.parametrize("seed", SEEDS)
def test_rejection_masks_match_verl(verl, meta, seed):
    x = inputs(verl, seed)
    log_ratio = x["old_log_prob"] - x["rollout_log_prob"]
    cases = (
        ("seq_sum", L.sequence_keep(log_ratio, x["mask"], *meta["seq_sum"], reduce="sum")),
        ("seq_mean", L.sequence_keep(log_ratio, x["mask"], *meta["seq_mean"], reduce="mean")),
        ("band", L.band_keep(log_ratio, *meta["band"])),
    )
    for name, keep in cases:
        expected = verl[f"s{seed}.rs.{name}.mask"]
        np.testing.assert_array_equal(np.asarray(x["mask"] * keep), expected, err_msg=name)
        check(
            L.masked_mean(1.0 - keep, x["mask"]), verl[f"s{seed}.rs.{name}.masked_fraction"], name
        )
        assert 0 < float(verl[f"s{seed}.rs.{name}.masked_fraction"]) < 1


@pytest.mark.parametrize("seed", SEEDS)
def test_mismatch_metrics_match_verl(verl, seed):
    x = inputs(verl, seed)
    m = L.mismatch_metrics(x["old_log_prob"], x["rollout_log_prob"], x["mask"])
    check(m["kl"], verl[f"s{seed}.offpolicy.kl"], "kl")
    check(m["k3_kl"], verl[f"s{seed}.offpolicy.k3_kl"], "k3_kl")
    same = L.mismatch_metrics(x["old_log_prob"], x["old_log_prob"], x["mask"])
    assert float(same["kl"]) == 0.0 and float(same["k3_kl"]) == 0.0
    assert float(same["ess"]) == pytest.approx(1.0, abs=1e-6)


DECOUPLED = {
    "ppo_tis_sum": dict(policy_loss="ppo", behavior_importance=2.0, sequence_mask=(0.4, 2.5)),
    "ppo_icepop_mean": dict(
        policy_loss="ppo",
        behavior_importance=(0.5, 2.0),
        geometric_mask=(0.8, 1.25),
        aggregation="session-mean",
    ),
    "gspo_tis": dict(
        policy_loss="gspo", dual_clip=None, behavior_importance=1.5, aggregation="session-mean"
    ),
    "cispo_icepop_sum": dict(
        policy_loss="cispo",
        dual_clip=None,
        behavior_importance=(0.5, 2.0),
        sequence_mask=(0.4, 2.5),
    ),
}
BYPASS = {
    "bypass_all": dict(
        behavior_importance=(0.5, 2.0), sequence_mask=(0.2, 5.0), geometric_mask=(0.7, 1.4)
    ),
    "bypass_band_mean": dict(behavior_importance=(0.5, 2.0), aggregation="session-mean"),
}


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("case", sorted(DECOUPLED) + sorted(BYPASS))
def test_composite_objective_matches_verl(verl, meta, seed, case):
    """policy_loss composes corrections, surrogate, aggregation and k3 KL as verl does."""
    x = inputs(verl, seed)
    bypass = case in BYPASS
    options = PolicyOptions(
        beta=meta["beta"], epsilon_low=0.2, epsilon_high=0.28, **(BYPASS | DECOUPLED)[case]
    )

    def loss(lp):
        return policy_loss(
            options,
            lp,
            advantages=x["advantages"],
            response_mask=x["mask"],
            behavior_log_prob=x["rollout_log_prob"],
            old_log_prob=None if bypass else x["old_log_prob"],
            ref_log_prob=x["ref_log_prob"],
        )

    (value, metrics), grad = jax.value_and_grad(loss, has_aux=True)(x["log_prob"])
    name = f"s{seed}.composite.{case}"
    check(value, verl[f"{name}.loss"], name)
    check(grad, verl[f"{name}.grad"], f"{name} grad")
    if bypass:
        check(metrics["mismatch/kl"], verl[f"{name}.kl"], "bypass mismatch kl")
        check(metrics["mismatch/k3_kl"], verl[f"{name}.k3_kl"], "bypass mismatch k3")
        assert float(metrics["tokens"]) == pytest.approx(
            float(x["mask"].sum()) * (1 - float(verl[f"{name}.masked"]))
        )
    else:
        assert float(metrics["tokens"]) == float(verl[f"{name}.mask"].sum())
        check(metrics["mismatch/kl"], verl[f"s{seed}.offpolicy.kl"], "mismatch kl")


def test_bypass_refuses_a_truncation_cap():
    lp = jnp.zeros((1, 2))
    with pytest.raises(ValueError, match="behavior_importance.*old_log_probs"):
        policy_loss(
            PolicyOptions(behavior_importance=2.0),
            lp,
            advantages=lp,
            response_mask=jnp.ones((1, 2)),
            behavior_log_prob=lp,
        )


def test_reference_needed_when_beta_positive():
    lp = jnp.zeros((1, 2))
    with pytest.raises(ValueError, match="ref_log_prob"):
        policy_loss(
            PolicyOptions(beta=0.1),
            lp,
            advantages=lp,
            response_mask=jnp.ones((1, 2)),
            behavior_log_prob=lp,
            old_log_prob=lp,
        )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"beta": -0.1}, "beta"),
        ({"beta": float("nan")}, "beta"),
        ({"epsilon_low": 1.0}, "epsilon_low"),
        ({"epsilon_high": -0.1}, "epsilon_high"),
        ({"dual_clip": 1.0}, "dual_clip"),
        ({"dual_clip": True}, "dual_clip"),
        ({"policy_loss": "gspo", "dual_clip": 2.0}, "dual_clip"),
        ({"policy_loss": "grpo"}, "policy_loss"),
        ({"aggregation": "seq-mean"}, "aggregation"),
        ({"behavior_importance": 0.0}, "behavior_importance"),
        ({"behavior_importance": True}, "behavior_importance"),
        ({"behavior_importance": (2.0, 0.5)}, "behavior_importance"),
        ({"behavior_importance": "2.0"}, "behavior_importance"),
        ({"sequence_mask": (0.0, 2.0)}, "sequence_mask"),
        ({"sequence_mask": 2.0}, "sequence_mask"),
        ({"geometric_mask": (1.0, 2.0, 3.0)}, "geometric_mask"),
        ({"kl_estimator": "k4"}, "kl_estimator"),
    ],
)
def test_bad_options_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PolicyOptions(**kwargs)


def test_bad_arguments_of_pure_functions():
    x = jnp.zeros((2, 3))
    with pytest.raises(ValueError, match="aggregation"):
        L.aggregate(x, x, "seq-mean")
    with pytest.raises(ValueError, match="kl estimator"):
        L.kl_penalty(x, x, "k4")
    with pytest.raises(ValueError, match="reduce"):
        L.sequence_keep(x, x, 0.5, 2.0, reduce="max")
    with pytest.raises(ValueError, match="groups"):
        L.aggregate(x, x, "session-mean", jnp.zeros((3, 2), jnp.int32))


def test_chain_ids_separate_chains_and_rows():
    seg = jnp.array([[1, 1, 2, 0], [1, 2, 2, 2]])
    ids = np.asarray(L.chain_ids(seg))
    assert ids[0, 0] == ids[0, 1] != ids[0, 2]
    assert len({ids[0, 0], ids[0, 2], ids[0, 3], ids[1, 0], ids[1, 1]}) == 5
