"""Run by tests/test_dpo.py in a subprocess with 8 simulated CPU devices.

XLA_FLAGS=--xla_force_host_platform_device_count=8 must be set before JAX is imported,
hence a separate process. Trains DPO on the spec's eight pairs (one per device) for three
steps on all 8 devices and on one, and checks that every step's loss and reward margin
agree. Tolerance: 1e-6 relative, since on 8 devices XLA all-reduces per-shard sums in
another order (a few float32 ulps); a lost or doubled shard would move the loss by far more.
Prints "ok" when every check passes.
"""

from __future__ import annotations

import json

import jax
import optax

from dew_pipe import Trainer, models
from dew_pipe.data import PreferencePairs
from dew_pipe.objectives.rl import DPOObjective

ROWS = [
    {"chosen": [1, 2, 3, 5], "rejected": [1, 2, 4, 5], "chosen_mask": [0, 0, 1, 1]},
    {"chosen": [1, 6, 3, 5], "rejected": [1, 6, 4, 5], "rejected_mask": [0, 0, 1, 1]},
    {"chosen": [7, 3, 5], "rejected": [7, 4, 4, 5], "chosen_mask": [0, 1, 1]},
    {"chosen": [2, 6], "rejected": [2, 4, 4], "rejected_mask": [0, 1, 1]},
]


def run(devices) -> list[dict]:
    data = PreferencePairs(
        records=tuple(json.dumps(row) for row in ROWS * 2), seq_len=4, shuffle=False
    ).load(batch=8)
    model = models.build(
        "causal_transformer",
        vocab_size=8,
        emb_features=16,
        num_layers=1,
        num_heads=2,
        mlp_features=32,
        max_seq_len=4,
    )
    records: list[dict] = []
    trainer = Trainer(
        DPOObjective(model, seq_len=3, beta=0.1),
        optax.adam(1e-2),
        key=jax.random.key(0),
        devices=devices,
        log=records.append,
        progress=False,
    )
    trainer.fit(data, steps=3, log_every=1)
    return records


def main() -> None:
    assert jax.device_count() == 8, jax.devices()
    many, one = run(jax.devices()), run(jax.devices()[:1])
    assert len(many) == len(one) == 3
    for step, (a, b) in enumerate(zip(many, one, strict=True), 1):
        for name in ("loss", "rewards/margins", "rewards/chosen", "tokens", "grad_norm"):
            scale = max(abs(b[name]), 1e-3)
            assert abs(a[name] - b[name]) <= 1e-6 * scale, (step, name, a[name], b[name])
    assert many[-1]["rewards/margins"] > 0, many[-1]  # it learned, on 8 devices too
    print("ok")


if __name__ == "__main__":
    main()
