"""The Trainer: runs an Objective's loss under one compiled, data-parallel update.

Strategy: the state is built by a jitted init so it lands replicated on a one-axis
device mesh (axis ``"data"``); every batch is split along its example axis over that
axis, so XLA computes the global loss and all-reduces the gradient. The update
donates the state's buffers: a state handed to ``fit`` or ``train_step`` must not be
read afterwards.

Two ways in, one path to the device: ``fit`` runs the whole loop
(:class:`~dew_pipe.training.loop.FitLoop`: data, rollout, NaN guard, log, evaluation,
checkpoints); ``train_step`` runs one update for callers that drive the steps themselves
(the update stage of a pipeline). Both check and place every batch in ``Trainer._place``.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dew_pipe._validate import check_int
from dew_pipe.data.dataset import Dataset, Partition, check_batch
from dew_pipe.training.checkpoints import Checkpoints
from dew_pipe.training.loop import FitLoop
from dew_pipe.training.objective import Objective
from dew_pipe.training.step import TrainState, build_update, init_state

__all__ = ["Trainer"]


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
        objective: what to train (see :class:`dew_pipe.training.objective.Objective`).
        optimizer: an optax gradient transformation over the full variables mapping.
        key: a typed PRNG key (``jax.random.key(seed)``); it seeds init and the run.
        rollout: ``batch = rollout(state, batch, key)`` runs on the host before each
            update and may replace the batch (sampling, rewards, packing). If it has an
            int attribute ``read_ahead``, the trainer keeps that many batches read
            beyond the one handed to it (default 1). The state's buffers are donated
            to the update as soon as the rollout returns: a rollout that keeps using
            ``state.params`` afterwards (a background engine, say) must copy them.
            If it has a method ``metrics()`` returning ``{name: number}`` about its last
            call, those numbers join the step's metrics as ``rollout/<name>``. Every
            batch must have the first one's layout, unless the rollout's attribute
            ``rows_vary`` is true: then only the leading (row) dimension may change, and
            the update compiles once per row count it meets. If it has
            a method ``checkpointed(step)``, ``fit`` calls it after starting each save.
        run_dir: directory for ``metrics.jsonl`` and ``checkpoints/``; ``fit`` resumes
            from its newest checkpoint (to resume from an older one, move the newer step
            directories out of ``checkpoints/``). ``None`` writes nothing.
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
        checkpoint_every = check_int(
            "checkpoint_every", checkpoint_every, minimum=1, allow_none=True
        )
        accumulate = check_int("accumulate", accumulate, minimum=1)
        keep_checkpoints = check_int("keep_checkpoints", keep_checkpoints, minimum=1)
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
        self.accumulate = accumulate
        self.guard = _guard_mode(nan_guard)
        self.log = log
        self.progress = progress
        self.keep_checkpoints = keep_checkpoints
        devices = list(jax.devices() if devices is None else devices)
        if not devices:
            raise ValueError("devices=[]; expected at least one device")
        self.mesh = Mesh(np.array(devices), ("data",))
        self.replicated = NamedSharding(self.mesh, PartitionSpec())
        self.batch_sharding = NamedSharding(self.mesh, PartitionSpec("data"))
        init = functools.partial(init_state, objective, optimizer, accumulate=self.accumulate)
        self._init = jax.jit(init, out_shardings=self.replicated)
        update = build_update(objective, optimizer, accumulate=self.accumulate, guard=self.guard)
        # The one compiled step (training/step.py) that fit and train_step dispatch; it
        # donates the state it is given.
        self._step = jax.jit(update, donate_argnums=0, out_shardings=self.replicated)
        self._evaluate = jax.jit(objective.evaluate, out_shardings=self.replicated)
        # Where the last fit left its data: (dataset, step, stream position). A fit that
        # continues that state on that dataset resumes there instead of replaying every
        # batch consumed so far (what a bare step count allows).
        self._left_off: tuple[Dataset, int, dict[str, Any]] | None = None

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

    def _place(
        self, batch: Mapping[str, Any], where: str, *, update: bool = False
    ) -> dict[str, jax.Array]:
        """Check a host batch and split it over the mesh's ``data`` axis.

        ``update=True`` marks a batch an update will consume (``fit`` and ``train_step``
        both place theirs here); it must hold at least one example, because the optimizer
        would otherwise still commit a step (weight decay and momentum move the parameters
        on a zero gradient) and count it in ``state.updates``.
        """
        arrays = check_batch(batch, where=where)
        name, first = next(iter(arrays.items()))
        rows = first.shape[0]
        if update and rows == 0:
            raise ValueError(
                f"{where} has 0 rows (field {name!r} has shape {first.shape}); expected at "
                "least one example: an update on an empty batch would still move the "
                "parameters (weight decay, momentum)"
            )
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
            ValueError, TypeError: a batch with no rows, or one the objective refuses
                (nothing is dispatched, so ``state`` is still usable).

        Example:
            >>> state, metrics = trainer.train_step(trainer.initial_state(), batch)  # doctest: +SKIP
        """
        return self._step(state, self._place(batch, "batch", update=True))

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
        batches = check_int("batches", batches, minimum=1, allow_none=True)
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

    def _resume_position(self, data: Dataset, step: int) -> dict[str, Any]:
        """The data position for a fit of ``data`` from a state at ``step``: where the
        last fit stopped when it stopped there on the same dataset, else the step count
        (the stream then reads and drops that many batches)."""
        left = self._left_off
        if left is not None and left[0] is data and left[1] == step:
            return copy.deepcopy(left[2])
        return {"consumed": step}

    def _remember_position(self, data: Dataset, run: FitLoop) -> None:
        if run.stream is None:  # the state was already at ``steps``: nothing was read
            return
        try:
            self._left_off = (data, run.step, run.stream.position())  # a fresh dict
        except TypeError:  # an iterator state that is not JSON: resume by replay
            self._left_off = None

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
        until: Callable[[TrainState], bool] | None = None,
    ) -> TrainState:
        """Train until ``state.step == steps`` (or ``until`` says so) and return the final state.

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
            until: ``until(state)`` after every step, with the state that step left (its
                NaN guard already applied); a true result ends the fit there, with the
                step's record logged and, with a ``run_dir``, a checkpoint saved, as at
                ``steps``. A later ``fit`` of the same data continues from that batch.

        Returns:
            The final :class:`TrainState`.

        Raises:
            NonFiniteError: on a NaN/Inf loss or gradient with ``nan_guard="raise"``.
            CheckpointError: when the newest checkpoint cannot be read, or
                (``CheckpointMismatchError``) holds another setup's state.
            ValueError: for bad arguments or batches (naming the field and shapes).
        """
        if not isinstance(data, Dataset):
            raise TypeError(f"data is a {type(data).__name__}; expected a dew_pipe.Dataset")
        steps = check_int("steps", steps, minimum=0)
        log_every = check_int("log_every", log_every, minimum=1)
        eval_every = check_int("eval_every", eval_every, minimum=1, allow_none=True)
        eval_batches = check_int("eval_batches", eval_batches, minimum=1, allow_none=True)
        if until is not None and not callable(until):
            raise TypeError(f"until is {until!r}; expected None or a function of the state")
        if eval_every is not None and data.val is None:
            raise ValueError(f"eval_every={eval_every} but Dataset.val is None; expected val data")
        partition = Partition(jax.process_index(), jax.process_count())
        rows = partition.local_batch(data.batch)
        checkpoints = self._checkpoints()
        run: FitLoop | None = None
        try:
            meta: dict[str, Any] = {}
            if state is None and checkpoints is not None and checkpoints.latest() is not None:
                state, meta = self._restore(checkpoints)
            elif state is None:
                state = self.initial_state()
            position = meta.get("data") or self._resume_position(data, int(state.step))
            run = FitLoop(self, data, partition, rows, state, position, meta, checkpoints)
            state = run.loop(steps, log_every, eval_every, eval_batches, until)
            self._remember_position(data, run)
            return state
        finally:
            if run is not None:
                run.close()
            elif checkpoints is not None:
                checkpoints.close()
