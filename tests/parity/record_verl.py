"""Record verl 0.9.1's GRPO losses, advantages and rollout corrections on fixed tensors.

Runs only in the isolated reference environment (torch 2.13 CPU, ``verl==0.9.1``
installed with ``--no-deps`` plus the modules its import asks for: ray,
tensordict, omegaconf, codetiming, orjson), which ``benchmarks/reference_env.sh``
builds as ``.reference-venv/``; dew_pipe never imports torch or verl. From the
repository root:

    .reference-venv/bin/python tests/parity/record_verl.py

writes ``tests/parity/fixtures/verl_grpo.npz``: for every seed the random inputs
(``s{seed}.in.*``) and verl's outputs (``s{seed}.{case}.*``): losses, their
gradients with respect to ``log_prob`` by torch autograd, metrics, weights and
masks. ``tests/test_grpo_losses.py`` and ``tests/test_advantage_parity.py``
compare dew_pipe's JAX functions with them at 1e-6.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
import verl
from verl.trainer.config.algorithm import RolloutCorrectionConfig
from verl.trainer.ppo import core_algos as ca
from verl.trainer.ppo import rollout_corr_helper as rc
from verl.workers.config import ActorConfig
from verl.workers.config.actor import PolicyLossConfig

OUT = Path(__file__).resolve().parent / "fixtures" / "verl_grpo.npz"
SHAPES = {0: (4, 7), 1: (5, 9), 2: (6, 6)}
AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "seq-mean-token-mean",
)
VANILLA_CLIPS = ((0.2, 0.2, 3.0), (0.2, 0.28, 3.0), (0.1, 0.3, 1.5))
KL_KINDS = ("k1", "abs", "k2", "k3", "low_var_kl", "k3+", "k1+")
BAND = (0.5, 2.0)  # IcePop / token_k1 band on the ratio
SEQ_SUM = (0.4, 2.5)  # seq_sum_k1 band
SEQ_MEAN = (0.8, 1.25)  # seq_mean_k1 band
# Behavior minus old log-probability per row, so some sequences leave each band.
ROW_BIAS = np.array([0.0, 0.4, -0.8, 0.05, 0.7, -0.1])


def actor_config(low: float, high: float, dual: float = 3.0, **extra) -> ActorConfig:
    """The smallest ActorConfig that makes verl's loss functions callable on CPU."""
    return ActorConfig(
        strategy="fsdp",
        ppo_micro_batch_size_per_gpu=1,
        rollout_n=1,
        clip_ratio=0.2,
        clip_ratio_low=low,
        clip_ratio_high=high,
        clip_ratio_c=dual,
        **extra,
    )


def make_inputs(seed: int) -> dict[str, np.ndarray]:
    """Random per-token tensors with right-padded masks of varied lengths.

    Padding holds finite garbage, so a loss that reads it would fail the comparison.
    Seed 2 has an empty row, which sequence-level reductions must skip.
    """
    rng = np.random.default_rng(seed)
    rows, width = SHAPES[seed]
    lengths = rng.integers(1, width + 1, size=rows)
    lengths[0] = width
    if seed == 2:
        lengths[-1] = 0
    mask = (np.arange(width)[None, :] < lengths[:, None]).astype(np.float32)
    old = (-np.abs(rng.normal(size=(rows, width))) * 1.5 - 0.05).astype(np.float32)
    # Mostly small moves, and a few far ones so the dual clip and the k3 clamps engage.
    step = rng.normal(scale=0.3, size=old.shape)
    far = rng.random(size=old.shape) < 0.2
    step[far] = rng.choice([-1.0, 1.0], size=far.sum()) * rng.uniform(1.2, 2.5, size=far.sum())
    return {
        "mask": mask,
        "old_log_prob": old,
        "log_prob": (old + step).astype(np.float32),
        "rollout_log_prob": (
            old + ROW_BIAS[:rows, None] + rng.normal(scale=0.2, size=old.shape)
        ).astype(np.float32),
        "ref_log_prob": (old + rng.normal(scale=0.3, size=old.shape)).astype(np.float32),
        "advantages": rng.normal(size=old.shape).astype(np.float32),
        "upstream": rng.normal(size=old.shape).astype(np.float32),
    }


def t(array: np.ndarray, grad: bool = False) -> torch.Tensor:
    return torch.tensor(array, dtype=torch.float32, requires_grad=grad)


def loss_and_grad(fn, log_prob: np.ndarray) -> tuple[np.ndarray, np.ndarray, dict]:
    """Run ``fn(log_prob_tensor) -> (loss, metrics)`` and backpropagate to log_prob."""
    lp = t(log_prob, grad=True)
    loss, metrics = fn(lp)
    loss.backward()
    return loss.detach().numpy(), lp.grad.numpy().copy(), metrics


def record_policy_losses(out: dict, key: str, x: dict[str, np.ndarray]) -> None:
    """compute_policy_loss_{vanilla,gspo,cispo} over agg modes, with and without weights."""
    old, adv, mask = t(x["old_log_prob"]), t(x["advantages"]), t(x["mask"])
    tis, _ = rc.compute_rollout_correction_weights(
        t(x["old_log_prob"] - x["rollout_log_prob"]), mask, "token", 2.0
    )
    out[f"{key}.in.tis_weights"] = tis.numpy()
    for i, (low, high, dual) in enumerate(VANILLA_CLIPS):
        cfg = actor_config(low, high, dual)
        for mode in AGG_MODES:
            for weighted in (False, True):
                if weighted and mode != "token-mean":
                    continue
                name = f"{key}.vanilla{i}.{mode}{'.tis' if weighted else ''}"
                loss, grad, met = loss_and_grad(
                    lambda lp, cfg=cfg, mode=mode, w=weighted: ca.compute_policy_loss_vanilla(
                        old, lp, adv, mask, mode, cfg, tis if w else None
                    ),
                    x["log_prob"],
                )
                out[f"{name}.loss"], out[f"{name}.grad"] = loss, grad
                out[f"{name}.clipfrac"] = np.float32(met["actor/pg_clipfrac"])
                out[f"{name}.clipfrac_lower"] = np.float32(met["actor/pg_clipfrac_lower"])
                out[f"{name}.ppo_kl"] = np.float32(met["actor/ppo_kl"])
    for name_fn, fn in (
        ("gspo", ca.compute_policy_loss_gspo),
        ("cispo", ca.compute_policy_loss_cispo),
    ):
        for i, (low, high) in enumerate(((0.2, 0.2), (3e-4, 4e-4), (0.2, 0.28))):
            cfg = actor_config(low, high)
            for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
                for weighted in (False, True):
                    name = f"{key}.{name_fn}{i}.{mode}{'.tis' if weighted else ''}"
                    loss, grad, met = loss_and_grad(
                        lambda lp, fn=fn, cfg=cfg, mode=mode, w=weighted: fn(
                            old, lp, adv, mask, mode, cfg, tis if w else None
                        ),
                        x["log_prob"],
                    )
                    out[f"{name}.loss"], out[f"{name}.grad"] = loss, grad
                    out[f"{name}.clipfrac"] = np.float32(met["actor/pg_clipfrac"])
                    out[f"{name}.ppo_kl"] = np.float32(met["actor/ppo_kl"])


def record_agg_and_kl(out: dict, key: str, x: dict[str, np.ndarray]) -> None:
    """agg_loss of a random loss matrix in every mode; kl_penalty values and gradients."""
    mask = t(x["mask"])
    for mode in AGG_MODES:
        lp = t(x["upstream"], grad=True)
        loss = ca.agg_loss(lp * lp, mask, mode)
        loss.backward()
        out[f"{key}.agg.{mode}.loss"] = loss.detach().numpy()
        out[f"{key}.agg.{mode}.grad"] = lp.grad.numpy().copy()
    ref = t(x["ref_log_prob"])
    for kind in KL_KINDS:
        lp = t(x["log_prob"], grad=True)
        value = ca.kl_penalty(lp, ref, kind)
        loss = ca.agg_loss(value, mask, "token-mean")
        loss.backward()
        out[f"{key}.kl.{kind}.value"] = value.detach().numpy()
        out[f"{key}.kl.{kind}.loss"] = loss.detach().numpy()
        out[f"{key}.kl.{kind}.grad"] = lp.grad.numpy().copy()


def record_corrections(out: dict, key: str, x: dict[str, np.ndarray]) -> None:
    """Rollout-correction weights, rejection masks and off-policy metrics."""
    mask = t(x["mask"])
    log_ratio = t(x["old_log_prob"] - x["rollout_log_prob"])
    for name, threshold in (
        ("tis2", 2.0),
        ("tis1.5", 1.5),
        ("icepop", f"{BAND[0]}_{BAND[1]}"),
        ("icepop_narrow", "0.8_1.25"),
    ):
        weights, met = rc.compute_rollout_correction_weights(log_ratio, mask, "token", threshold)
        out[f"{key}.is.{name}.weights"] = weights.numpy()
        out[f"{key}.is.{name}.ess"] = np.float32(met["rollout_is_eff_sample_size"])
        if "rollout_is_oob_ratio" in met:
            out[f"{key}.is.{name}.oob"] = np.float32(met["rollout_is_oob_ratio"])
    for name, option, threshold in (
        ("seq_sum", "seq_sum_k1", f"{SEQ_SUM[0]}_{SEQ_SUM[1]}"),
        ("seq_mean", "seq_mean_k1", f"{SEQ_MEAN[0]}_{SEQ_MEAN[1]}"),
        ("band", "token_k1", f"{1 / BAND[1]}_{1 / BAND[0]}"),
    ):
        kept, met = rc.compute_rollout_rejection_mask(log_ratio, mask, option, threshold)
        out[f"{key}.rs.{name}.mask"] = kept.numpy()
        out[f"{key}.rs.{name}.masked_fraction"] = np.float32(
            met[f"rollout_rs_{option}_masked_fraction"]
        )
        removed = float((x["mask"] - kept.numpy()).sum())
        if option != "token_k1" and not 0 < removed < x["mask"].sum():
            sys.exit(f"{key} {option}: the band keeps or rejects everything; pick other bounds")
    met = rc.compute_offpolicy_metrics(t(x["old_log_prob"]), t(x["rollout_log_prob"]), mask)
    out[f"{key}.offpolicy.kl"] = np.float32(met["kl"])
    out[f"{key}.offpolicy.k3_kl"] = np.float32(met["k3_kl"])


def record_composites(out: dict, key: str, x: dict[str, np.ndarray], beta: float = 0.05) -> None:
    """The whole per-token objective, composed the way verl's ppo_loss composes it.

    Decoupled mode (old_log_probs recomputed): weights and rejection mask from
    compute_rollout_correction_and_rejection_mask, then the policy loss over the
    rejected mask plus ``beta`` times the k3 KL over the same mask. Bypass mode
    (old = rollout): compute_policy_loss_bypass_mode with token_k1 + seq_sum_k1 +
    seq_mean_k1 rejection, plus the KL over the original mask (verl's ppo_loss reads
    the batch's response_mask, which bypass mode leaves untouched).
    """
    old, roll, ref = t(x["old_log_prob"]), t(x["rollout_log_prob"]), t(x["ref_log_prob"])
    adv, mask = t(x["advantages"]), t(x["mask"])
    decoupled = (
        (
            "ppo_tis_sum",
            "vanilla",
            "token",
            2.0,
            "seq_sum_k1",
            f"{SEQ_SUM[0]}_{SEQ_SUM[1]}",
            "token-mean",
        ),
        (
            "ppo_icepop_mean",
            "vanilla",
            "token",
            "0.5_2.0",
            "seq_mean_k1",
            "0.8_1.25",
            "seq-mean-token-mean",
        ),
        ("gspo_tis", "gspo", "token", 1.5, None, None, "seq-mean-token-mean"),
        (
            "cispo_icepop_sum",
            "cispo",
            "token",
            "0.5_2.0",
            "seq_sum_k1",
            f"{SEQ_SUM[0]}_{SEQ_SUM[1]}",
            "token-mean",
        ),
    )
    for name, loss_mode, is_level, is_threshold, rs, rs_threshold, agg in decoupled:
        weights_proto, kept, _ = rc.compute_rollout_correction_and_rejection_mask(
            old, roll, mask, is_level, is_threshold, False, rs, rs_threshold
        )
        weights = weights_proto.batch["rollout_is_weights"]
        cfg = actor_config(0.2, 0.28)
        fn = ca.get_policy_loss_fn(loss_mode)

        def total(lp, fn=fn, cfg=cfg, kept=kept, weights=weights, agg=agg):
            pg, met = fn(old, lp, adv, kept, agg, cfg, weights)
            kl = ca.agg_loss(ca.kl_penalty(lp, ref, "low_var_kl"), kept, agg)
            return pg + beta * kl, met

        loss, grad, _ = loss_and_grad(total, x["log_prob"])
        out[f"{key}.composite.{name}.loss"], out[f"{key}.composite.{name}.grad"] = loss, grad
        out[f"{key}.composite.{name}.mask"] = kept.numpy()
    bypass = (
        ("bypass_all", "token_k1,seq_sum_k1,seq_mean_k1", "token-mean"),
        ("bypass_band_mean", "token_k1", "seq-mean-token-mean"),
    )
    band = f"{1 / BAND[1]}_{1 / BAND[0]}"
    for name, rs, agg in bypass:
        thresholds = ",".join(
            {"token_k1": band, "seq_sum_k1": "0.2_5.0", "seq_mean_k1": "0.7_1.4"}[o]
            for o in rs.split(",")
        )
        correction = RolloutCorrectionConfig(
            rollout_is=None, rollout_rs=rs, rollout_rs_threshold=thresholds, bypass_mode=True
        )
        cfg = actor_config(
            0.2, 0.28, policy_loss=PolicyLossConfig("bypass_mode", rollout_correction=correction)
        )

        def total(lp, cfg=cfg, agg=agg):
            pg, met = ca.compute_policy_loss_bypass_mode(roll, lp, adv, mask, agg, cfg)
            kl = ca.agg_loss(ca.kl_penalty(lp, ref, "low_var_kl"), mask, agg)
            return pg + beta * kl, met

        loss, grad, met = loss_and_grad(total, x["log_prob"])
        out[f"{key}.composite.{name}.loss"], out[f"{key}.composite.{name}.grad"] = loss, grad
        out[f"{key}.composite.{name}.kl"] = np.float32(met["rollout_corr/kl"])
        out[f"{key}.composite.{name}.k3_kl"] = np.float32(met["rollout_corr/k3_kl"])
        out[f"{key}.composite.{name}.masked"] = np.float32(
            met["rollout_corr/rollout_rs_masked_fraction"]
        )
        if not 0 < out[f"{key}.composite.{name}.masked"] < 1:
            sys.exit(f"{key} {name}: bypass rejection keeps or rejects everything")


def record_advantages(out: dict, seed: int) -> None:
    """GRPO (std-normalized and Dr.GRPO mean-only) and RLOO outcome advantages.

    Groups of sizes 4, 3, 1, 2, 2 and 3 in shuffled order; one group with equal
    rewards (zero std), one singleton (verl: mean 0, std 1). The score sits on the last
    response token, as verl's reward managers place it.
    """
    rng = np.random.default_rng(100 + seed)
    sizes = [4, 3, 1, 2, 2, 3]
    index = np.concatenate([np.full(n, g) for g, n in enumerate(sizes)])
    rng.shuffle(index)
    rows, width = len(index), 5
    scores = (rng.integers(0, 2, size=rows) if seed == 0 else rng.normal(size=rows)).astype(
        np.float32
    )
    scores[index == 3] = 0.75
    lengths = rng.integers(1, width + 1, size=rows)
    mask = (np.arange(width)[None, :] < lengths[:, None]).astype(np.float32)
    rewards = np.zeros((rows, width), np.float32)
    rewards[np.arange(rows), lengths - 1] = scores
    key = f"adv{seed}"
    out[f"{key}.in.index"] = index.astype(np.int32)
    out[f"{key}.in.scores"] = scores
    out[f"{key}.in.mask"] = mask
    for name, kwargs in (
        ("grpo", {"norm_adv_by_std_in_grpo": True}),
        ("mean", {"norm_adv_by_std_in_grpo": False}),
    ):
        adv, _ = ca.compute_grpo_outcome_advantage(t(rewards), t(mask), index, **kwargs)
        out[f"{key}.{name}"] = adv.numpy()
    adv, _ = ca.compute_rloo_outcome_advantage(t(rewards), t(mask), index)
    out[f"{key}.rloo"] = adv.numpy()


def main() -> None:
    torch.manual_seed(0)
    out: dict[str, np.ndarray] = {}
    for seed in SHAPES:
        x = make_inputs(seed)
        key = f"s{seed}"
        for name, value in x.items():
            out[f"{key}.in.{name}"] = value
        record_policy_losses(out, key, x)
        record_agg_and_kl(out, key, x)
        record_corrections(out, key, x)
        record_composites(out, key, x)
        record_advantages(out, seed)
    meta = {
        "verl": verl.__version__,
        "torch": torch.__version__,
        "vanilla_clips": VANILLA_CLIPS,
        "band": BAND,
        "seq_sum": SEQ_SUM,
        "seq_mean": SEQ_MEAN,
        "beta": 0.05,
    }
    out["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(OUT, **out)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes, {len(out)} arrays)")


if __name__ == "__main__":
    main()
