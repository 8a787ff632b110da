"""Record verl's PPO pieces on fixed tensors: GAE over multi-turn episodes, the clipped
policy and value losses, and autograd gradients of their composite through a tiny model.

Runs only in the isolated reference environment (``benchmarks/reference_env.sh`` builds
``.reference-venv/``: torch 2.13 CPU and ``verl==0.9.1`` from PyPI, installed with
``--no-deps``); dew_pipe never imports torch or verl. From the repository root:

    .reference-venv/bin/python tests/parity/record_verl_ppo.py

writes ``tests/parity/fixtures/verl_ppo.npz``. The numbers come from the verl 0.9.1 wheel
as installed; it records no git revision, so ``meta`` keeps the version and the SHA-256 of
the two files every recorded function lives in (``verl/trainer/ppo/core_algos.py`` and
``verl/utils/torch_functional.py``), which pins the code that produced them.

Two parts, read by ``tests/test_ppo.py``:

* ``gae.*``: episodes of one to three tool turns in verl's multi-turn response layout
  (actions, then the observation ids the tool returned, mask 1 on actions only), the
  verifier's score on the last action id, random values on every id (observations
  included: verl must skip them), and ``compute_gae_advantage_return``'s whitened
  advantages and returns for several ``(gamma, lam)``.
* ``model.*``: the same kind of episodes as token rows, a bigram policy (a ``[V, V]``
  logit table: the logits after id ``t`` are row ``t``), a frozen reference table, and a
  critic of trainable token features (``[V, H]``) under a scalar head (``[H, 1]`` kernel,
  ``[1]`` bias): the value before id ``t`` is ``features[prev] @ kernel + bias``. For each
  case, ``compute_policy_loss_vanilla`` (with the token TIS weights of
  ``compute_rollout_correction_weights`` where the case has a cap), ``kl_penalty``
  ("low_var_kl") under ``agg_loss`` token-mean and ``compute_value_loss``, composed as
  ``pg + beta * kl + value_coefficient * vf``, and torch autograd's gradient of that
  composite with respect to all four parameter arrays.

The episode structure (prompt, actions, observations, rewards) is stored as JSON in
``meta`` so the test can rebuild the same episodes as dew_pipe sessions and pack them.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import torch
import verl
from verl.trainer.ppo import core_algos as ca
from verl.trainer.ppo import rollout_corr_helper as rc
from verl.workers.config import ActorConfig

OUT = Path(__file__).resolve().parent / "fixtures" / "verl_ppo.npz"
VOCAB, HIDDEN = 19, 4  # the vocabulary of tests/test_tool_episodes.py; token-feature width
GAE_SETTINGS = ((1.0, 0.95), (0.97, 0.9), (0.9, 1.0), (1.0, 0.0))
# (name, clip_low, clip_high, dual_clip, beta, value_coefficient, value_clip, tis_cap)
CASES = (
    ("plain", 0.2, 0.2, 3.0, 0.03, 0.5, 0.2, None),
    ("tis", 0.2, 0.28, 3.0, 0.1, 0.25, 0.5, 2.0),
)


def make_episodes(rng: np.random.Generator, turns: list[int]) -> list[dict]:
    """Episodes: a 2-id prompt, then turns of 1-3 action ids, 2 observation ids between."""
    episodes = []
    for count in turns:
        prompt = rng.integers(2, VOCAB, size=2).tolist()
        steps = []
        for k in range(count):
            action = rng.integers(1, VOCAB, size=int(rng.integers(1, 4))).tolist()
            observation = rng.integers(2, VOCAB, size=2).tolist() if k < count - 1 else []
            steps.append({"action": action, "observation": observation})
        episodes.append({"prompt": prompt, "turns": steps, "reward": float(rng.normal())})
    return episodes


def response_layout(episode: dict) -> tuple[list[int], list[int]]:
    """verl's multi-turn response of an episode: ids and mask (1 on actions)."""
    ids, mask = [], []
    for step in episode["turns"]:
        ids += step["action"] + step["observation"]
        mask += [1] * len(step["action"]) + [0] * len(step["observation"])
    return ids, mask


def record_gae(out: dict, meta: dict) -> None:
    rng = np.random.default_rng(7)
    episodes = make_episodes(rng, [1, 3, 2, 3, 1, 2, 2])
    layouts = [response_layout(e) for e in episodes]
    width = max(len(ids) for ids, _ in layouts) + 1  # a padded tail on every row
    mask = np.zeros((len(episodes), width), np.float32)
    rewards = np.zeros_like(mask)
    for b, (_, row) in enumerate(layouts):
        mask[b, : len(row)] = row
        rewards[b, int(np.flatnonzero(row)[-1])] = episodes[b]["reward"]
    # Values everywhere, observation and padding ids included: verl's recursion must skip them.
    values = rng.normal(size=mask.shape).astype(np.float32)
    out["gae.mask"], out["gae.values"], out["gae.rewards"] = mask, values, rewards
    for i, (gamma, lam) in enumerate(GAE_SETTINGS):
        advantages, returns = ca.compute_gae_advantage_return(
            torch.tensor(rewards), torch.tensor(values), torch.tensor(mask), gamma, lam
        )
        out[f"gae.{i}.advantages"] = advantages.numpy()
        out[f"gae.{i}.returns"] = returns.numpy()
    meta["gae_episodes"] = episodes
    meta["gae_settings"] = GAE_SETTINGS


def actor_config(low: float, high: float, dual: float) -> ActorConfig:
    """The smallest ActorConfig that makes verl's loss functions callable on CPU."""
    return ActorConfig(
        strategy="fsdp",
        ppo_micro_batch_size_per_gpu=1,
        rollout_n=1,
        clip_ratio=0.2,
        clip_ratio_low=low,
        clip_ratio_high=high,
        clip_ratio_c=dual,
    )


def token_rows(episodes: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """Append-only token rows (prompt, then every turn) and the action mask over targets.

    ``ids [B, L]`` right padded with 0; ``mask [B, L - 1]`` is 1 where target ``j + 1`` (read
    from position ``j``) is an action id: verl's response mask with the prompt included as
    zeros, which token-mean reductions do not see.
    """
    rows = [e["prompt"] + response_layout(e)[0] for e in episodes]
    marks = [[0] * len(e["prompt"]) + response_layout(e)[1] for e in episodes]
    length = max(len(r) for r in rows)
    ids = np.zeros((len(rows), length), np.int64)
    mask = np.zeros((len(rows), length - 1), np.float32)
    for b, (row, mark) in enumerate(zip(rows, marks, strict=True)):
        ids[b, : len(row)] = row
        mask[b, : len(row) - 1] = mark[1:]
    return ids, mask


def composite(
    case: tuple, ids: np.ndarray, mask: np.ndarray, params: dict, inputs: dict, dtype: torch.dtype
) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """verl's composite loss of one case and its autograd gradients, computed in ``dtype``."""
    _, low, high, dual, beta, coefficient, clip, cap = case
    prev, target = torch.tensor(ids[:, :-1]), torch.tensor(ids[:, 1:])
    p = {k: torch.tensor(v, dtype=dtype, requires_grad=k != "reference") for k, v in params.items()}
    t = {k: torch.tensor(v, dtype=dtype) for k, v in inputs.items()}
    m = torch.tensor(mask, dtype=dtype)

    def log_probs(table: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(table[prev], dim=-1).gather(-1, target[..., None])[..., 0]

    lp = log_probs(p["table"])
    values = (p["features"][prev] @ p["kernel"])[..., 0] + p["bias"]
    weights = None
    if cap is not None:
        weights, _ = rc.compute_rollout_correction_weights(
            t["old_log_prob"] - t["rollout_log_prob"], m, "token", cap
        )
    pg, met = ca.compute_policy_loss_vanilla(
        t["old_log_prob"], lp, t["advantages"], m, "token-mean", actor_config(low, high, dual),
        weights,
    )  # fmt: skip
    ref = log_probs(p["reference"]).detach()
    kl = ca.agg_loss(ca.kl_penalty(lp, ref, "low_var_kl"), m, "token-mean")
    vf, vf_clipfrac = ca.compute_value_loss(
        values, t["returns"], t["old_values"], m, clip, "token-mean"
    )
    total = pg + beta * kl + coefficient * vf
    total.backward()
    arrays = {"loss": total.detach().numpy(), "pg_loss": pg.detach().numpy()}
    arrays.update(kl_loss=kl.detach().numpy(), value_loss=vf.detach().numpy())
    for name, tensor in p.items():
        if name != "reference":
            arrays[f"grad.{name}"] = tensor.grad.numpy().copy()
    fractions = {
        "pg_clipfrac": float(met["actor/pg_clipfrac"]),
        "value_clipfrac": float(vf_clipfrac),
    }
    return arrays, fractions


def record_model(out: dict, meta: dict) -> None:
    """The composite through the tiny model, in float32 (verl as it runs) and float64.

    The float64 run is the same verl code on the same inputs: it tells the test how far
    verl's own float32 result is from the exact one, so the test can require dew_pipe to
    be no further. Magnitudes stay small (losses below 0.25, gradients below 0.125), where
    one float32 ulp is below the comparison's bars.
    """
    rng = np.random.default_rng(11)
    episodes = make_episodes(rng, [2, 1, 3, 2, 3, 1, 2, 3])
    ids, mask = token_rows(episodes)
    params = {
        "table": rng.normal(size=(VOCAB, VOCAB)).astype(np.float32),
        "features": rng.normal(size=(VOCAB, HIDDEN)).astype(np.float32),
        "kernel": (0.5 * rng.normal(size=(HIDDEN, 1))).astype(np.float32),
        "bias": np.array([0.1], np.float32),
    }
    params["reference"] = (params["table"] + 0.3 * rng.normal(size=(VOCAB, VOCAB))).astype(
        np.float32
    )
    with torch.no_grad():
        prev, target = torch.tensor(ids[:, :-1]), torch.tensor(ids[:, 1:])
        table = torch.tensor(params["table"])
        log_prob = torch.log_softmax(table[prev], -1).gather(-1, target[..., None])[..., 0]
        features, kernel = torch.tensor(params["features"]), torch.tensor(params["kernel"])
        vpreds = ((features[prev] @ kernel)[..., 0] + float(params["bias"][0])).numpy()
        log_prob = log_prob.numpy()
    # Mostly small moves, a few far ones, so both clips engage; garbage off the mask.
    step = rng.normal(scale=0.3, size=mask.shape)
    far = rng.random(size=mask.shape) < 0.25
    step[far] = rng.choice([-1.0, 1.0], size=far.sum()) * rng.uniform(1.2, 2.5, size=far.sum())
    inputs = {
        "old_log_prob": (log_prob - step).astype(np.float32),
        "advantages": (0.3 * rng.normal(size=mask.shape)).astype(np.float32),
        "old_values": (vpreds + rng.normal(scale=0.4, size=mask.shape)).astype(np.float32),
    }
    inputs["rollout_log_prob"] = (
        inputs["old_log_prob"] + rng.normal(scale=0.4, size=mask.shape)
    ).astype(np.float32)
    inputs["returns"] = (vpreds + rng.normal(scale=0.5, size=mask.shape)).astype(np.float32)
    out["model.ids"], out["model.mask"] = ids, mask
    for name, value in {**params, **inputs}.items():
        out[f"model.{name}"] = value
    for case in CASES:
        key = f"model.{case[0]}"
        arrays, fractions = composite(case, ids, mask, params, inputs, torch.float32)
        exact, _ = composite(case, ids, mask, params, inputs, torch.float64)
        for name, value in arrays.items():
            out[f"{key}.{name}"] = value
        for name, value in exact.items():
            out[f"{key}.f64.{name}"] = value
        for name, value in fractions.items():
            out[f"{key}.{name}"] = np.float32(value)
            if not 0 < value < 1:
                sys.exit(f"{case[0]}: {name} is {value}; pick tensors where the clip engages")
        if abs(float(arrays["loss"])) >= 0.25 or any(
            np.abs(v).max() >= 0.125 for k, v in arrays.items() if k.startswith("grad.")
        ):
            sys.exit(
                f"{case[0]}: a loss or gradient left the range where one ulp is below the bars: {float(arrays['loss'])}, {[float(np.abs(v).max()) for k, v in arrays.items() if k.startswith('grad.')]}"
            )
    meta["model_episodes"] = episodes
    meta["cases"] = CASES


def sha256(module_path: str) -> str:
    return hashlib.sha256(Path(module_path).read_bytes()).hexdigest()


def main() -> None:
    torch.manual_seed(0)
    out: dict[str, np.ndarray] = {}
    meta: dict = {
        "verl": verl.__version__,
        "torch": torch.__version__,
        "core_algos.py sha256": sha256(ca.__file__),
        "torch_functional.py sha256": sha256(sys.modules["verl.utils.torch_functional"].__file__),
        "vocab": VOCAB,
        "hidden": HIDDEN,
    }
    record_gae(out, meta)
    record_model(out, meta)
    out["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(OUT, **out)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes, {len(out)} arrays)")


if __name__ == "__main__":
    main()
