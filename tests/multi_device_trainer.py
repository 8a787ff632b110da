"""Run by tests/test_trainer.py in a subprocess with 8 simulated CPU devices.

XLA_FLAGS=--xla_force_host_platform_device_count=8 must be set before JAX is imported,
hence a separate process. Prints "ok" when every check passes.

Tolerance: on 8 devices each device reduces its shard and XLA all-reduces the partial
sums, so float32 sums are added in another order than on one device. A reordered sum is
off by a few ulps (float32 eps = 1.2e-7) of the magnitude of its terms, not of its
result, so entries that nearly cancel can differ by much more than their own relative
precision. The check is therefore normwise per leaf: max |a - b| <= 1e-6 * max |b|
(about 8 ulps of the leaf's scale; measured: at most 4.4e-7), and plain 1e-6 relative
for the scalar loss and gradient norm (measured: at most 2e-7). A real error (a missing
or double-counted shard, a wrong denominator) moves results by 10% or more.
"""

from __future__ import annotations

import itertools

import jax
import numpy as np
import optax
from trainer_helpers import MaskedRegression, make_batch

from dew_pipe import Dataset, LMObjective, Trainer, models

RTOL = 1e-6
worst = {"scalar": 0.0, "leaf": 0.0}  # largest relative errors seen, printed at the end


def fit(objective, optimizer, batch, devices, steps):
    records = []
    rows = len(next(iter(batch.values())))
    data = Dataset(train=lambda partition: itertools.repeat(batch), val=None, batch=rows)
    trainer = Trainer(
        objective, optimizer, key=jax.random.key(3), devices=devices, log=records.append
    )
    state = trainer.fit(data, steps=steps, log_every=1)
    return trainer, state, records


def compare(objective, optimizer, batch, steps):
    many, state8, records8 = fit(objective, optimizer, batch, jax.devices(), steps)
    one, state1, records1 = fit(objective, optimizer, batch, jax.devices()[:1], steps)
    assert many.mesh.size == 8 and one.mesh.size == 1
    leaf = jax.tree.leaves(state8.params)[0]
    assert len(leaf.sharding.device_set) == 8 and leaf.sharding.is_fully_replicated
    for r8, r1 in zip(records8, records1, strict=True):
        for name in ("loss", "grad_norm"):
            np.testing.assert_allclose(r8[name], r1[name], rtol=RTOL)
            worst["scalar"] = max(worst["scalar"], abs(r8[name] - r1[name]) / abs(r1[name]))
    for a, b in zip(jax.tree.leaves(state8.params), jax.tree.leaves(state1.params), strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        error, scale = np.max(np.abs(a - b)), np.max(np.abs(b))
        assert error <= RTOL * scale, (a.shape, error, scale)
        worst["leaf"] = max(worst["leaf"], error / scale)


def main() -> None:
    assert jax.device_count() == 8, jax.devices()
    batch = make_batch(0, rows=16)
    # SGD with lr 1: the parameter change is the gradient itself.
    compare(MaskedRegression(), optax.sgd(1.0), batch, steps=1)
    compare(MaskedRegression(), optax.adam(0.1), batch, steps=3)

    model = models.build(
        "causal_transformer",
        vocab_size=32,
        emb_features=16,
        num_layers=1,
        num_heads=2,
        mlp_features=32,
        max_seq_len=8,
    )
    rng = np.random.default_rng(0)
    text = rng.integers(0, 32, (16, 9)).astype(np.int32)
    segments = np.ones_like(text)
    segments[:, 5:] = 2  # two packed documents per row
    segments[::3, 7:] = 0  # and some padding
    lm_batch = {"text": text, "text_segment_ids": segments}
    compare(LMObjective(model, seq_len=8, ema_decay=None), optax.sgd(1.0), lm_batch, steps=1)

    odd = make_batch(1, rows=12)
    data = Dataset(train=lambda partition: itertools.repeat(odd), val=None, batch=12)
    trainer = Trainer(MaskedRegression(), optax.sgd(0.1), key=jax.random.key(0))
    try:
        trainer.fit(data, steps=1)
    except ValueError as error:
        message = str(error)
        assert "12 examples" in message and "8 devices" in message, message
    else:
        raise AssertionError("a batch of 12 on 8 devices was not refused")
    print(
        f"ok: largest relative error {worst['scalar']:.2e} (scalars), {worst['leaf']:.2e} (leaves)"
    )


if __name__ == "__main__":
    main()
