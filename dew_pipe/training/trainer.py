"""The Trainer: runs an Objective's loss under one compiled, data-parallel update.

Strategy: the state is built by a jitted init so it lands replicated on a one-axis
device mesh (axis ``"data"``); every batch is split along its example axis over that
axis, so XLA computes the global loss and all-reduces the gradient. The update
donates the state's buffers: a state handed to ``fit`` must not be read afterwards.

Each step of ``fit``:

1. read the next batch (and ``read_ahead`` more, so host reading overlaps the
   device's work on the previous update);
2. resolve the NaN guard of the previous step (the one host-device sync per step);
3. ``batch = rollout(state, batch, key)`` on the host, when there is a rollout;
4. check the batch and place it on the mesh; dispatch the update;
5. log, evaluate and checkpoint when due.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dew_pipe.checkpoint import Checkpoints
from dew_pipe.data.dataset import Dataset, Partition, check_batch
from dew_pipe.data_stream import BatchStream
from dew_pipe.objectives.base import Objective
from dew_pipe.train_log import TrainLog
from dew_pipe.update import TrainState, build_update, init_state

__all__ = ["NonFiniteError", "TrainState", "Trainer"]

# fold_in constant that separates the rollout's key stream from the update's splits.
_ROLLOUT_STREAM = 0x524F4C4C


class NonFiniteError(FloatingPointError):
    """The loss or gradient of a step was NaN or infinite.

    Attributes:
        step: the step that failed (``state.step`` it would have reached).
        metrics: that step's metrics, as floats.
        state: the state before the failed step (nothing was applied).
    """

    def __init__(self, message: str, step: int, metrics: dict[str, float], state: TrainState):
        super().__init__(message)
        self.step = step
        self.metrics = metrics
        self.state = state


def _check_objective(objective: Any) -> None:
    for name in ("init", "loss", "evaluate", "summarize"):
        if not callable(getattr(objective, name, None)):
            raise TypeError(
                f"objective {type(objective).__name__} has no method {name!r}; "
                "expected the Objective protocol (init, loss, evaluate, summarize)"
            )
    if not hasattr(objective, "ema_decay"):
        raise TypeError(f"objective {type(objective).__name__} has no attribute 'ema_decay'")
    decay = objective.ema_decay
    if decay is not None and (
        isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 <= decay <= 1.0
    ):
        raise ValueError(f"objective.ema_decay={decay!r}; expected None or a float in [0, 1]")


def _check_count(name: str, value: Any, minimum: int, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name}={value!r}; expected an int >= {minimum}")


def _guard_mode(nan_guard: Any) -> str | None:
    modes = {True: "raise", "raise": "raise", "skip": "skip", False: None, None: None}
    if not isinstance(nan_guard, (bool, str, type(None))) or nan_guard not in modes:
        raise ValueError(f"nan_guard={nan_guard!r}; expected True, False, 'raise' or 'skip'")
    return modes[nan_guard]


def _as_key(key: Any) -> jax.Array:
    if isinstance(key, jax.Array) and jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        if key.shape != ():
            raise ValueError(f"key has shape {key.shape}; expected a single key, shape ()")
        return key
    if isinstance(key, (jax.Array, np.ndarray)) and key.dtype == np.uint32 and key.shape == (2,):
        return jax.random.wrap_key_data(key)  # legacy raw key
    raise TypeError(f"key={key!r}; expected a typed PRNG key such as jax.random.key(0)")


class Trainer:
    """Train an objective with an optax optimizer.

    Args:
        objective: what to train (see :class:`dew_pipe.objectives.base.Objective`).
        optimizer: an optax gradient transformation over the full variables mapping.
        key: a typed PRNG key (``jax.random.key(seed)``); it seeds init and the run.
        rollout: ``batch = rollout(state, batch, key)`` runs on the host before each
            update and may replace the batch (sampling, rewards, packing). If it has an
            int attribute ``read_ahead``, the trainer keeps that many batches read
            beyond the one handed to it (default 1). The state's buffers are donated
            to the update as soon as the rollout returns: a rollout that keeps using
            ``state.params`` afterwards (a background engine, say) must copy them.
            If it has a method ``metrics()`` returning ``{name: number}`` about its last
            call, those numbers join the step's metrics as ``rollout/<name>``.
        run_dir: directory for ``metrics.jsonl`` and ``checkpoints/``; ``fit`` resumes
            from its newest checkpoint. ``None`` writes nothing.
        checkpoint_every: save every this many steps (and at the end of ``fit``). With a
            ``run_dir`` and ``None``, only the end of ``fit`` is saved.
        accumulate: microbatches per optimizer update. Their gradients are averaged
            with the objective's ``"tokens"`` metric as weights (equal weights when it
            reports none), which equals one step on the concatenated batch for a
            loss that is a mean over tokens.
        nan_guard: ``True``/``"raise"`` raises :class:`NonFiniteError` on a NaN/Inf loss
            or gradient, leaving the state as it was; ``"skip"`` consumes such a
            batch without learning from it and counts it (``skipped_nonfinite``);
            ``False`` turns the check off (and its per-step host sync).
        log: called with each metrics record (a dict), or ``None``.
        progress: show a rich progress bar; ``None`` shows it on a terminal/notebook.
        keep_checkpoints: how many recent checkpoints to keep.
        devices: the devices of the data-parallel mesh; ``None`` uses every device.

    Raises:
        TypeError, ValueError: for arguments of the wrong type or out of range.

    Example:
        >>> trainer = Trainer(objective, optax.adamw(1e-3), key=jax.random.key(2))  # doctest: +SKIP
        >>> state = trainer.fit(data, steps=20, log_every=10)  # doctest: +SKIP
        >>> int(state.step)  # doctest: +SKIP
        20
    """

    def __init__(
        self,
        objective: Objective,
        optimizer: optax.GradientTransformation,
        *,
        key: jax.Array,
        rollout: Callable[[TrainState, Mapping[str, np.ndarray], jax.Array], Any] | None = None,
        run_dir: str | Path | None = None,
        checkpoint_every: int | None = None,
        accumulate: int = 1,
        nan_guard: bool | str = True,
        log: Callable[[dict[str, Any]], None] | None = None,
        progress: bool | None = None,
        keep_checkpoints: int = 3,
        devices: Sequence[jax.Device] | None = None,
    ) -> None:
        _check_objective(objective)
        if not (
            callable(getattr(optimizer, "init", None))
            and callable(getattr(optimizer, "update", None))
        ):
            raise TypeError(f"optimizer={optimizer!r}; expected an optax GradientTransformation")
        if rollout is not None and not callable(rollout):
            raise TypeError(f"rollout={rollout!r}; expected None or rollout(state, batch, key)")
        if log is not None and not callable(log):
            raise TypeError(f"log={log!r}; expected None or a callable taking a dict")
        if progress is not None and not isinstance(progress, bool):
            raise TypeError(f"progress={progress!r}; expected None, True or False")
        _check_count("checkpoint_every", checkpoint_every, 1, allow_none=True)
        _check_count("accumulate", accumulate, 1)
        _check_count("keep_checkpoints", keep_checkpoints, 1)
        if checkpoint_every is not None and run_dir is None:
            raise ValueError(
                f"checkpoint_every={checkpoint_every} needs a run_dir; expected run_dir=<directory>"
            )
        self.objective = objective
        self.optimizer = optimizer
        self.key = _as_key(key)
        self.rollout = rollout
        self.run_dir = None if run_dir is None else Path(run_dir)
        self.checkpoint_every = checkpoint_every
        self.accumulate = int(accumulate)
        self.guard = _guard_mode(nan_guard)
        self.log = log
        self.progress = progress
        self.keep_checkpoints = int(keep_checkpoints)
        devices = list(jax.devices() if devices is None else devices)
        if not devices:
            raise ValueError("devices=[]; expected at least one device")
        self.mesh = Mesh(np.array(devices), ("data",))
        self.replicated = NamedSharding(self.mesh, PartitionSpec())
        self.batch_sharding = NamedSharding(self.mesh, PartitionSpec("data"))
        init = functools.partial(init_state, objective, optimizer, accumulate=self.accumulate)
        self._init = jax.jit(init, out_shardings=self.replicated)
        update = build_update(objective, optimizer, accumulate=self.accumulate, guard=self.guard)
        self._update = jax.jit(update, donate_argnums=0, out_shardings=self.replicated)
        self._evaluate = jax.jit(objective.evaluate, out_shardings=self.replicated)

    # ----------------------------------------------------------------- state

    def initial_state(self) -> TrainState:
        """A fresh state from ``key``, built by the compiled init and replicated.

        ``fit`` without a checkpoint starts from this same state.
        """
        return self._init(self.key)

    def _checkpoints(self) -> Checkpoints | None:
        if self.run_dir is None:
            return None
        return Checkpoints(self.run_dir / "checkpoints", keep=self.keep_checkpoints)

    def _restore(self, checkpoints: Checkpoints) -> tuple[TrainState, dict[str, Any]]:
        template = jax.eval_shape(self._init, self.key)
        impl = str(jax.random.key_impl(self.key))
        return checkpoints.restore(template, self.replicated, impl)

    # ----------------------------------------------------------------- batches

    def _place(self, batch: Mapping[str, Any], where: str) -> dict[str, jax.Array]:
        """Check a host batch and split it over the mesh's ``data`` axis."""
        arrays = check_batch(batch, where=where)
        rows = next(iter(arrays.values())).shape[0]
        devices = self.mesh.size // jax.process_count()
        if rows % devices:
            raise ValueError(
                f"{where} has {rows} examples, which do not divide across {devices} devices; "
                f"expected a multiple of {devices}"
            )
        validate = getattr(self.objective, "validate", None)
        if validate is not None:
            validate(arrays)
        if jax.process_count() == 1:
            return jax.device_put(arrays, self.batch_sharding)
        return {
            name: jax.make_array_from_process_local_data(self.batch_sharding, value)
            for name, value in arrays.items()
        }

    def train_step(
        self, state: TrainState, batch: Mapping[str, Any]
    ) -> tuple[TrainState, dict[str, jax.Array]]:
        """One compiled update on a host batch, as ``fit`` runs it, for callers that drive
        the steps themselves (the update stage of a pipeline).

        The batch is checked (``objective.validate``), split over the mesh's ``data`` axis
        and given to the donated update: ``state`` must not be read afterwards. No rollout,
        logging, checkpoint or NaN-guard handling runs here; ``metrics["finite"]`` is the
        guard's verdict (with ``nan_guard="raise"`` a non-finite step returns the state
        unchanged, so raise on it).

        Returns:
            ``(new state, metrics)``; the metrics are device scalars.

        Raises:
            ValueError, TypeError: a batch the objective refuses.

        Example:
            >>> state, metrics = trainer.train_step(trainer.initial_state(), batch)  # doctest: +SKIP
        """
        return self._update(state, self._place(batch, "batch"))

    # ----------------------------------------------------------------- evaluation

    def evaluate(
        self, state: TrainState, data: Dataset, batches: int | None = None
    ) -> dict[str, float]:
        """Validation numbers for ``state.params`` over ``data.val``.

        Args:
            state: the state to evaluate (not donated).
            data: a dataset with ``val``.
            batches: evaluate at most this many batches; ``None`` reads them all.

        Returns:
            ``objective.summarize`` of the summed ``objective.evaluate`` outputs.

        Raises:
            ValueError: when ``data.val`` is None or yields no batches.
        """
        _check_count("eval_batches", batches, 1, allow_none=True)
        partition = Partition(jax.process_index(), jax.process_count())
        totals: dict[str, float] = {}
        count = 0
        source = data.open_val(partition)
        try:
            for batch in source:
                if batches is not None and count >= batches:
                    break
                placed = self._place(batch, f"validation batch {count + 1}")
                sums = jax.device_get(self._evaluate(state.params, placed))
                for name, value in sums.items():  # float64 on the host: no drift over batches
                    totals[name] = totals.get(name, 0.0) + float(value)
                count += 1
        finally:
            close = getattr(source, "close", None)
            if close is not None:
                close()
        if count == 0:
            raise ValueError("Dataset.val yielded no batches; expected at least one")
        return {name: float(value) for name, value in self.objective.summarize(totals).items()}

    # ----------------------------------------------------------------- fit

    def fit(
        self,
        data: Dataset,
        *,
        steps: int,
        log_every: int = 100,
        eval_every: int | None = None,
        eval_batches: int | None = None,
        state: TrainState | None = None,
    ) -> TrainState:
        """Train until ``state.step == steps`` and return the final state.

        The run starts from ``state`` when given (its buffers are donated: do not
        read it afterwards), else from the newest checkpoint in ``run_dir``, else from
        :meth:`initial_state`. The data resumes at the batch after the last one the
        state consumed.

        Args:
            data: the training (and validation) data.
            steps: the step to stop at; a state already there is returned unchanged.
            log_every: write a metrics record every this many steps (and at the end).
            eval_every: evaluate every this many steps; needs ``data.val``.
            eval_batches: validation batches per evaluation; ``None`` reads all.
            state: a state to continue from.

        Returns:
            The final :class:`TrainState`.

        Raises:
            NonFiniteError: on a NaN/Inf loss or gradient with ``nan_guard="raise"``.
            ValueError: for bad arguments or batches (naming the field and shapes).
        """
        if not isinstance(data, Dataset):
            raise TypeError(f"data is a {type(data).__name__}; expected a dew_pipe.Dataset")
        _check_count("steps", steps, 0)
        _check_count("log_every", log_every, 1)
        _check_count("eval_every", eval_every, 1, allow_none=True)
        _check_count("eval_batches", eval_batches, 1, allow_none=True)
        if eval_every is not None and data.val is None:
            raise ValueError(f"eval_every={eval_every} but Dataset.val is None; expected val data")
        partition = Partition(jax.process_index(), jax.process_count())
        rows = partition.local_batch(data.batch)
        checkpoints = self._checkpoints()
        run = None
        try:
            meta: dict[str, Any] = {}
            if state is None and checkpoints is not None and checkpoints.latest() is not None:
                state, meta = self._restore(checkpoints)
            elif state is None:
                state = self.initial_state()
            position = meta.get("data") or {"consumed": int(state.step)}
            run = _Run(self, data, partition, rows, state, position, meta, checkpoints)
            return run.loop(steps, log_every, eval_every, eval_batches)
        finally:
            if run is not None:
                run.close()
            elif checkpoints is not None:
                checkpoints.close()


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


class _Run:
    """One call of ``fit``: the loop and the host-side bookkeeping it needs."""

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
        self.shapes: dict[str, tuple[tuple[int, ...], np.dtype]] | None = None
        self._position = position
        self._partition = partition

    def loop(self, steps: int, log_every: int, eval_every: int | None, eval_batches: int | None):
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
            placed = trainer._place(batch, where)
            self._check_shapes(placed, where)
            self.state, self.pending = trainer._update(self.state, placed)
            if reported:
                self.pending = {**self.pending, **reported}
            self.step += 1
            self.log.add(self.pending)
            due_log = self.step % log_every == 0 or self.step == steps
            due_eval = eval_every is not None and self.step % eval_every == 0
            due_save = self._save_due(steps)
            if due_log or due_eval or due_save:
                self.resolve()
            if due_log:
                self.log.flush(self.step, int(self.state.updates), self.skipped)
            if due_eval:
                self._eval(eval_batches)
            if due_save:
                self._save()
        self.resolve()
        return self.state

    def _check_shapes(self, batch: Mapping[str, jax.Array], where: str) -> None:
        shapes = {name: (tuple(v.shape), np.dtype(v.dtype)) for name, v in batch.items()}
        if self.shapes is None:
            self.shapes = shapes
            return
        for name in sorted(set(shapes) | set(self.shapes)):
            now, first = shapes.get(name), self.shapes.get(name)
            if now != first:
                raise ValueError(
                    f"{where} field {name!r} is {now} (shape, dtype) but the first batch had "
                    f"{first}; expected one layout for every batch (a new layout would "
                    "compile the update again)"
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

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
        if self.log is not None:
            self.log.close()
        if self.checkpoints is not None:
            self.checkpoints.close()
