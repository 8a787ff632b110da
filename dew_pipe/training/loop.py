"""One call of ``Trainer.fit``: the step loop and its host-side bookkeeping.

Each step:

1. read the next batch (and ``read_ahead`` more, so host reading overlaps the
   device's work on the previous update);
2. resolve the NaN guard of the previous step (the one host-device sync per step);
3. ``batch = rollout(state, batch, key)`` on the host, when there is a rollout;
4. check the batch and place it on the mesh (``Trainer._place``); dispatch the update;
5. log, evaluate and checkpoint when due (then call ``rollout.checkpointed(step)``, when the
   rollout has that method).

The loop owns the run's :class:`~dew_pipe.training.data_stream.BatchStream`,
:class:`~dew_pipe.training.log.TrainLog` and the trainer's
:class:`~dew_pipe.training.checkpoints.Checkpoints`, and closes them all in :meth:`FitLoop.close`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import jax
import numpy as np

from dew_pipe.data.dataset import Dataset, Partition, check_batch
from dew_pipe.training.checkpoints import Checkpoints
from dew_pipe.training.data_stream import BatchStream
from dew_pipe.training.log import TrainLog
from dew_pipe.training.step import NonFiniteError, TrainState

__all__ = ["FitLoop"]

# fold_in constant that separates the rollout's key stream from the update's splits.
_ROLLOUT_STREAM = 0x524F4C4C

Metrics = dict[str, jax.Array]


class Trainer(Protocol):
    """What the loop uses of :class:`dew_pipe.training.trainer.Trainer` (which imports this
    module, so the loop names the trainer by this protocol instead of importing it)."""

    rollout: Any
    run_dir: Path | None
    log: Callable[[dict[str, Any]], None] | None
    progress: bool | None
    guard: str | None
    checkpoint_every: int | None
    _step: Callable[[TrainState, Metrics], tuple[TrainState, Metrics]]

    def _place(self, batch: Mapping[str, Any], where: str, *, update: bool = False) -> Metrics: ...

    def evaluate(
        self, state: TrainState, data: Dataset, batches: int | None = None
    ) -> dict[str, float]: ...


def _rollout_metrics(rollout: Any) -> dict[str, float]:
    """The host metrics a rollout reports about its last call, as ``rollout/<name>``.

    A rollout may offer ``metrics() -> Mapping[str, float]`` (rewards, lengths...); they
    join that step's metrics, so records average them over the interval like the loss.
    """
    report = getattr(rollout, "metrics", None)
    if report is None or not callable(report):
        return {}
    values = report()
    if not isinstance(values, Mapping):
        raise TypeError(
            f"rollout.metrics() returned {type(values).__name__}; expected a mapping of "
            "names to numbers"
        )
    out = {}
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise TypeError(f"rollout.metrics()[{name!r}] is {value!r}; expected a real number")
        out[f"rollout/{name}"] = float(value)
    return out


class FitLoop:
    """One call of ``Trainer.fit``: the loop and the host-side bookkeeping it needs."""

    def __init__(
        self,
        trainer: Trainer,
        data: Dataset,
        partition: Partition,
        rows: int,
        state: TrainState,
        position: dict[str, Any],
        meta: dict[str, Any],
        checkpoints: Checkpoints | None,
    ) -> None:
        self.trainer = trainer
        self.data = data
        self.rows = rows
        self.state = state
        self.step = int(state.step)
        self.saved_step = self.step if meta else None
        self.skipped = int(meta.get("skipped_nonfinite", 0))
        self.checkpoints = checkpoints
        self.stream: BatchStream | None = None
        self.log: TrainLog | None = None
        self.pending: dict[str, jax.Array] | None = None  # metrics whose guard is unresolved
        self.shapes: dict[str, tuple[tuple[int | None, ...], np.dtype]] | None = None
        self.rows_vary = bool(getattr(trainer.rollout, "rows_vary", False))
        self._position = position
        self._partition = partition

    def loop(
        self,
        steps: int,
        log_every: int,
        eval_every: int | None,
        eval_batches: int | None,
        until: Callable[[Any], bool] | None = None,
    ):
        trainer = self.trainer
        if self.step >= steps:
            return self.state
        self.stream = BatchStream(self.data, self._partition, self._position)
        self.log = TrainLog(
            trainer.run_dir,
            trainer.log,
            trainer.progress,
            steps=steps,
            start=self.step,
            examples_per_step=self.data.batch,
            records=self.data.records,
        )
        read_ahead = max(0, int(getattr(trainer.rollout, "read_ahead", 1)))
        while self.step < steps:
            self.stream.fill(1 + read_ahead)  # overlaps the update still in flight
            self.resolve()
            batch = self.stream.next()
            where = f"training batch {self.step + 1}"
            check_batch(batch, self.rows, where=where)
            reported: dict[str, float] = {}
            if trainer.rollout is not None:
                key = jax.random.fold_in(self.state.rng, _ROLLOUT_STREAM)
                batch = trainer.rollout(self.state, batch, key)
                reported = _rollout_metrics(trainer.rollout)
            placed = trainer._place(batch, where, update=True)
            self._check_shapes(placed, where)
            self.state, self.pending = trainer._step(self.state, placed)
            if reported:
                self.pending = {**self.pending, **reported}
            self.step += 1
            self.log.add(self.pending)
            stop = False
            if until is not None:
                self.resolve()  # the NaN guard first: until sees an applied update
                stop = bool(until(self.state))
            due_log = self.step % log_every == 0 or self.step == steps or stop
            due_eval = eval_every is not None and self.step % eval_every == 0
            due_save = self._save_due(steps) or (stop and self.checkpoints is not None)
            if due_log or due_eval or due_save:
                self.resolve()
            if due_log:
                self.log.flush(self.step, int(self.state.updates), self.skipped)
            if due_eval:
                self._eval(eval_batches)
            if due_save:
                self._save()
            if stop:
                break
        self.resolve()
        return self.state

    def _check_shapes(self, batch: Mapping[str, jax.Array], where: str) -> None:
        """Every batch has the first one's layout; with ``rows_vary``, but for its rows."""
        shapes = {name: (tuple(v.shape), np.dtype(v.dtype)) for name, v in batch.items()}
        if self.rows_vary:  # (_place has checked that every field has the same rows)
            shapes = {name: ((None, *shape[1:]), dtype) for name, (shape, dtype) in shapes.items()}
        if self.shapes is None:
            self.shapes = shapes
            return
        for name in sorted(set(shapes) | set(self.shapes)):
            now, first = shapes.get(name), self.shapes.get(name)
            if now != first:
                more = " but for its rows" if self.rows_vary else ""
                raise ValueError(
                    f"{where} field {name!r} is {now} (shape, dtype) but the first batch had "
                    f"{first}; expected one layout for every batch{more} (a new layout "
                    "would compile the update again)"
                )

    def _save_due(self, steps: int) -> bool:
        if self.checkpoints is None:
            return False
        every = self.trainer.checkpoint_every
        return self.step == steps or (every is not None and self.step % every == 0)

    def resolve(self) -> None:
        """Apply the NaN guard to the last dispatched step (a host-device sync)."""
        if self.pending is None or self.trainer.guard is None:
            self.pending = None
            return
        metrics, self.pending = self.pending, None
        if bool(metrics["finite"]):
            return
        if self.trainer.guard == "skip":
            self.skipped += 1
            return
        values = {k: float(v) for k, v in jax.device_get(metrics).items()}
        bad = [name for name, v in values.items() if not np.isfinite(v)]
        step = self.step
        self.step -= 1
        raise NonFiniteError(
            f"non-finite {', '.join(bad)} at step {step} (loss={values['loss']}, "
            f"grad_norm={values['grad_norm']}); the update was not applied. Pass "
            "nan_guard='skip' to skip such batches",
            step,
            values,
            self.state,
        )

    def _eval(self, batches: int | None) -> None:
        results = self.trainer.evaluate(self.state, self.data, batches)
        record = {"step": self.step, "updates": int(self.state.updates)}
        record.update({f"val/{name}": value for name, value in results.items()})
        self.log.write(record)

    def _save(self) -> None:
        if self.saved_step == self.step:
            return
        meta = {"data": self.stream.position(), "skipped_nonfinite": self.skipped}
        self.checkpoints.save(self.state, meta)
        self.saved_step = self.step
        # A rollout that keeps work across runs (RolloutScheduler's journal) learns of the
        # save, so it can forget what the checkpoint before this one trained on.
        checkpointed = getattr(self.trainer.rollout, "checkpointed", None)
        if callable(checkpointed):
            checkpointed(self.step)

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
        if self.log is not None:
            self.log.close()
        if self.checkpoints is not None:
            self.checkpoints.close()
