"""A tiny objective and data for Trainer tests (fast compiles, NumPy-checkable numbers).

Also imported by the multi-device subprocess test, so it must not import pytest.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np

from dew_pipe import Dataset

FEATURES = 3
TIME = 4


class MaskedRegression:
    """Masked squared error of a linear map, averaged over counted positions ("tokens").

    Batch: ``x [B, T, F]``, ``y [B, T]``, ``mask [B, T]`` (1 = counted) and ``poison [B]``
    (all ones normally; a zero makes the gradient NaN while the loss stays finite).
    """

    def __init__(self, ema_decay: float | None = None) -> None:
        self.ema_decay = ema_decay

    def init(self, key: jax.Array):
        return {
            "params": {
                "w": jax.random.normal(key, (FEATURES,), jnp.float32),
                "b": jnp.full((), 0.1, jnp.float32),
            }
        }

    def _errors(self, params, batch):
        p = params["params"]
        prediction = batch["x"] @ p["w"] + p["b"]
        return (prediction - batch["y"]) ** 2 * batch["mask"]

    def loss(self, params, batch, key, ema):
        errors = self._errors(params, batch)
        tokens = jnp.sum(batch["mask"])
        loss = jnp.sum(errors) / jnp.maximum(tokens, 1.0)
        # 0 * sqrt(0) is 0, but its gradient is 0 * inf = NaN: a poisoned gradient only.
        trap = 0.0 * jnp.sqrt(jnp.sum(jnp.abs(params["params"]["w"])) * jnp.min(batch["poison"]))
        return loss + trap, {"tokens": tokens, "mean_y": jnp.mean(batch["y"])}

    def evaluate(self, params, batch):
        return {
            "squared_error": jnp.sum(self._errors(params, batch)),
            "tokens": jnp.sum(batch["mask"]),
        }

    def summarize(self, totals):
        return {"mse": totals["squared_error"] / totals["tokens"]}


def make_batch(seed: int, rows: int = 8, counted: int | None = None) -> dict[str, np.ndarray]:
    """A batch whose mask counts ``counted`` positions (random when None)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, TIME, FEATURES)).astype(np.float32)
    y = rng.normal(size=(rows, TIME)).astype(np.float32)
    mask = np.zeros(rows * TIME, np.float32)
    n = int(rng.integers(1, rows * TIME + 1)) if counted is None else counted
    mask[rng.permutation(rows * TIME)[:n]] = 1.0
    return {"x": x, "y": y, "mask": mask.reshape(rows, TIME), "poison": np.ones(rows, np.float32)}


def numpy_loss_grad(params, batch):
    """Loss and gradient of MaskedRegression in float64 NumPy (the independent reference)."""
    w = np.asarray(params["params"]["w"], np.float64)
    b = float(params["params"]["b"])
    x, y, m = (np.asarray(batch[k], np.float64) for k in ("x", "y", "mask"))
    residual = (x @ w + b - y) * m
    count = max(m.sum(), 1.0)
    loss = (residual**2).sum() / count
    grad_w = 2 * np.einsum("btf,bt->f", x, residual) / count
    grad_b = 2 * residual.sum() / count
    return loss, {"w": grad_w, "b": grad_b}


def cycling(batches: list[dict[str, np.ndarray]], records: int | None = None) -> Dataset:
    """A dataset repeating ``batches`` forever."""
    rows = len(next(iter(batches[0].values())))
    return Dataset(
        train=lambda partition: itertools.cycle(batches),
        val=lambda partition: batches,
        records=records,
        batch=rows,
    )


def host(tree):
    """Copy a tree of arrays to host NumPy (before donation can invalidate it)."""
    return jax.tree.map(lambda a: np.array(a, copy=True), tree)
