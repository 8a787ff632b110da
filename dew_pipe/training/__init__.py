"""Training: the Trainer and the pieces it is made of, one module each.

``trainer``
    :class:`Trainer` (``dew_pipe.Trainer``): checks its arguments, builds the device mesh,
    compiles the init, the update and the evaluation, and places every batch on the mesh.
    ``Trainer.train_step`` runs one update for callers that drive the steps themselves
    (the update stage of a pipeline); ``Trainer.fit`` runs the whole loop.
``objective``
    :class:`Objective`, the protocol of what the Trainer trains (``init``, ``loss``,
    ``evaluate``, ``summarize``, ``ema_decay``), which ``dew_pipe.objectives`` implement.
``step``
    :class:`TrainState` (``dew_pipe.TrainState``) and the pure update step the Trainer
    compiles (``build_update``): the NaN guard (:class:`NonFiniteError`), gradient
    accumulation and the EMA.
``loop``
    :class:`FitLoop`, one call of ``fit``: read a batch, run the rollout, dispatch the
    update, then log, evaluate and checkpoint when due.
``data_stream``
    :class:`BatchStream`, the trainer's resumable cursor over a ``Dataset``: epochs,
    read-ahead and the position a checkpoint stores.
``checkpoints``
    :class:`Checkpoints`: a TrainState and the run's metadata on disk through orbax, and
    the errors that name a checkpoint which cannot be restored.
``log``
    :class:`TrainLog`: interval averages of the step metrics to ``metrics.jsonl`` (through
    :class:`dew_pipe._jsonl.JsonLines`, the run directory's one writer of JSON lines), a
    callback and a progress bar.

How ``Trainer.fit(data, steps=...)`` uses them: it restores the newest checkpoint of its
``run_dir`` (or takes ``state=``, or builds :meth:`Trainer.initial_state`), opens a
``BatchStream`` at the position that checkpoint recorded, and hands both to a ``FitLoop``,
which runs the compiled ``step`` until ``state.step == steps``, writing through ``TrainLog``
and saving through ``Checkpoints`` as they fall due.

Names resolve lazily, so ``import dew_pipe.training`` does not import JAX.

Example:
    >>> import dew_pipe.training as training
    >>> training.Trainer is __import__("dew_pipe").Trainer
    True
"""

from __future__ import annotations

from dew_pipe._lazy import lazy_exports

_LAZY: dict[str, str] = {
    "BatchStream": "dew_pipe.training.data_stream",
    "CheckpointError": "dew_pipe.training.checkpoints",
    "CheckpointMismatchError": "dew_pipe.training.checkpoints",
    "Checkpoints": "dew_pipe.training.checkpoints",
    "FitLoop": "dew_pipe.training.loop",
    "NonFiniteError": "dew_pipe.training.step",
    "Objective": "dew_pipe.training.objective",
    "TrainLog": "dew_pipe.training.log",
    "TrainState": "dew_pipe.training.step",
    "Trainer": "dew_pipe.training.trainer",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
