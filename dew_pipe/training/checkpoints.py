"""Training checkpoints: a TrainState plus JSON run metadata, through orbax.

Layout under the run directory::

    checkpoints/<step>/state/   orbax StandardSave of the state's arrays
    checkpoints/<step>/meta/    JSON: data position, skipped batches, key implementation

The typed PRNG key is stored as its raw ``key_data`` (uint32) with the name of its
implementation in the metadata, so it comes back bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from dew_pipe.training.step import TrainState

__all__ = ["CheckpointMismatchError", "Checkpoints"]

FORMAT = 1


class CheckpointMismatchError(ValueError):
    """A checkpoint's contents do not fit the trainer that tries to restore it."""


def _to_tree(state: TrainState) -> dict[str, Any]:
    tree = {
        "step": state.step,
        "updates": state.updates,
        "params": state.params,
        "opt_state": state.opt_state,
        "rng": jax.random.key_data(state.rng),
    }
    if state.ema is not None:  # orbax stores no None leaves
        tree["ema"] = state.ema
    return tree


class Checkpoints:
    """A bounded series of training checkpoints in ``directory``.

    Args:
        directory: where step folders go (created if missing).
        keep: how many recent checkpoints to keep, at least 1; older ones are deleted.
        asynchronous: write in a background thread. The state is copied off the
            device buffers before :meth:`save` returns, so the update may then donate
            them.

    Example:
        >>> checkpoints = Checkpoints(run_dir / "checkpoints", keep=2)  # doctest: +SKIP
        >>> checkpoints.save(state, {"data": {"consumed": 3}})  # doctest: +SKIP
    """

    def __init__(self, directory: str | Path, *, keep: int, asynchronous: bool = True) -> None:
        self.directory = Path(directory)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=asynchronous
        )
        self._manager = ocp.CheckpointManager(
            self.directory.absolute(), options=options, item_names=("state", "meta")
        )

    def latest(self) -> int | None:
        """The newest saved step, or ``None`` when there is none."""
        return self._manager.latest_step()

    def save(self, state: TrainState, meta: dict[str, Any]) -> None:
        """Save ``state`` under its step, with JSON-serializable ``meta``."""
        step = int(state.step)
        meta = dict(meta, format=FORMAT, step=step, rng_impl=str(jax.random.key_impl(state.rng)))
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(_to_tree(state)), meta=ocp.args.JsonSave(meta)
            ),
            force=True,
        )

    def restore(
        self, template: TrainState, sharding: jax.sharding.Sharding, rng_impl: str
    ) -> tuple[TrainState, dict[str, Any]]:
        """Restore the newest checkpoint into the structure of ``template``.

        Args:
            template: a state with the expected structure (arrays or
                ``jax.ShapeDtypeStruct``), e.g. from ``jax.eval_shape``.
            sharding: where every restored array is placed.
            rng_impl: the PRNG implementation name the key must have.

        Returns:
            The restored state and its metadata.

        Raises:
            FileNotFoundError: when there is no checkpoint.
            CheckpointMismatchError: when the checkpoint does not fit ``template``.
        """
        step = self.latest()
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}; expected a saved step")
        meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))[
            "meta"
        ]
        if meta.get("format") != FORMAT:
            raise CheckpointMismatchError(
                f"checkpoint {self.directory / str(step)} has format {meta.get('format')!r}; "
                f"expected {FORMAT}"
            )
        if meta.get("rng_impl") != rng_impl:
            raise CheckpointMismatchError(
                f"checkpoint {self.directory / str(step)} holds a {meta.get('rng_impl')!r} key; "
                f"expected {rng_impl!r} (the trainer's key)"
            )
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
            jax.eval_shape(_to_tree, template),
        )
        try:
            tree = self._manager.restore(
                step,
                args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)),
            )["state"]
        except (ValueError, KeyError, TypeError) as error:
            raise CheckpointMismatchError(
                f"checkpoint {self.directory / str(step)} does not match this trainer's state "
                f"(objective, optimizer, ema_decay or accumulate changed?): {error}"
            ) from error
        state = TrainState(
            step=tree["step"],
            updates=tree["updates"],
            params=tree["params"],
            opt_state=tree["opt_state"],
            ema=tree.get("ema"),
            rng=jax.random.wrap_key_data(tree["rng"], impl=rng_impl),
        )
        return state, meta

    def wait(self) -> None:
        """Block until every started save is on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Finish pending saves and release the manager's threads."""
        self._manager.close()
