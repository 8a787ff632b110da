"""One process of the two-process Flow-GRPO check (tests/test_flow_grpo_two_process.py).

    python tests/flow_grpo_worker.py PROCESS_ID NUM_PROCESSES PORT OUT.npz

Runs one FlowRollout call on this process's share of a fixed two-row source batch and one
Flow-GRPO update, then saves the rows it returned, the reward calls it made, the loss and
the updated parameters. With NUM_PROCESSES 1 it is the one-process reference run.
"""

from __future__ import annotations

import sys

import jax

process_id, processes, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
if processes > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"localhost:{port}", num_processes=processes, process_id=process_id)

import numpy as np  # noqa: E402
import optax  # noqa: E402

from dew_pipe import Field, InputSpec, Trainer, models, presets  # noqa: E402
from dew_pipe.objectives.rl import FlowGRPOObjective, FlowRollout  # noqa: E402

model = models.SimpleDiT(
    output_channels=1, patch_size=2, emb_features=8, num_layers=1, num_heads=2, mlp_ratio=2
)
objective = FlowGRPOObjective(
    model, presets.Flow()(), InputSpec(Field("image", (4, 4, 1))), beta=0.01, steps=5
)
calls = []


def fine_brightness(images, batch):
    """Brightness plus a float64 offset far below float32 resolution, per row."""
    calls.append(len(images))
    return images.mean(axis=(1, 2, 3)).astype(np.float64) + np.arange(len(images)) * 2.0**-40


rollout = FlowRollout(objective, fine_brightness, groups=4, steps=5, train_steps=2)
trainer = Trainer(objective, optax.sgd(0.5), key=jax.random.key(0))
state = trainer.initial_state()
initial = {
    jax.tree_util.keystr(path): np.asarray(leaf.addressable_data(0))
    for path, leaf in jax.tree_util.tree_flatten_with_path(state.params)[0]
}
source = np.zeros((2, 4, 4, 1), np.uint8)
source[1] = 255  # two distinguishable source rows
rows = 2 // processes
local = {"image": source[process_id * rows : (process_id + 1) * rows]}
batch = rollout(state, local, jax.random.key(7))
state, metrics = trainer.train_step(state, batch)


def host(array):
    return np.asarray(array.addressable_data(0))


params = {
    jax.tree_util.keystr(path): host(leaf)
    for path, leaf in jax.tree_util.tree_flatten_with_path(state.params)[0]
}
np.savez(
    out,
    calls=np.array(calls, np.int64),
    loss=host(metrics["loss"]),
    **{f"batch/{name}": value for name, value in batch.items()},
    **{f"param/{name}": value for name, value in params.items()},
    **{f"initial/{name}": value for name, value in initial.items()},
)
