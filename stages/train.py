"""Train: the pipeline view's update stage, which trains on each batch itself.

It publishes versions and hands each batch over exactly as
:class:`~dew_pipe.stages.handoff.Handoff` does for the Trainer of the library view (steps
1-4 there), then, instead of handing the batch back, runs ``trainer.train_step`` on it. It
owns the training state: it starts from the one it was given (or the trainer's initial
state, built when the run starts, so building a pipeline compiles nothing), runs ``steps``
updates and ends, which ends the rest of the pipeline.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import pyarrow as pa

from dew_pipe._validate import check_int
from dew_pipe.batches import packed_from_arrow
from dew_pipe.flow import Cancelled, Port, StageContext
from dew_pipe.stages.handoff import Handoff, Ports
from dew_pipe.stages.messages import Handover, Proximal, SchedulerRecord
from dew_pipe.stages.protocols import TrainingState, TrainingStep, WeightsPublisher

__all__ = ["Train", "UpdateLog", "update_values"]

UpdateLog = Callable[[int, dict[str, float], SchedulerRecord | None], None]
"""``log(step, metrics, record)`` after each update: the step number (0 first), the
update's metrics as floats, and the batch's record (None without a records edge)."""


def update_values(
    metrics: Mapping[str, float], record: SchedulerRecord | None, **extra: Any
) -> dict[str, Any]:
    """What a pipeline job logs of one update (an :data:`UpdateLog`'s arguments), rounded.

    ``loss`` (5 places), ``grad_norm`` and ``entropy`` (4), then ``extra`` as given, then
    from the batch's record ``reward`` (its ``reward/mean``, 4 places), ``lag`` and
    ``waited_s`` (3). Values that are missing, None or NaN are left out.

    Example:
      >>> import types
      >>> record = types.SimpleNamespace(metrics={"reward/mean": 0.53125}, lag=1, waited_s=0.25)
      >>> update_values({"loss": 0.1234567, "entropy": float("nan")}, record, tag=3)
      {'loss': 0.12346, 'tag': 3, 'reward': 0.5312, 'lag': 1, 'waited_s': 0.25}
    """
    nan = float("nan")
    values: dict[str, Any] = {
        "loss": round(metrics["loss"], 5),
        "grad_norm": round(metrics.get("grad_norm", nan), 4),
        "entropy": round(metrics.get("entropy", nan), 4),
        **extra,
    }
    if record is not None:
        reward = record.metrics.get("reward/mean")
        values["reward"] = None if reward is None else round(reward, 4)
        values["lag"] = record.lag
        values["waited_s"] = round(record.waited_s, 3)
    return {k: v for k, v in values.items() if v is not None and v == v}


class Train(Handoff):
    """Publishes versions, hands each batch over and trains on it (the pipeline view).

    Ports:
      rows, records (in); handover, params (out): as :class:`Handoff`.

    Args:
      trainer: the trainer whose ``train_step`` runs each update (a ``dew_pipe.Trainer``).
      steps: updates to run; the stage then ends.
      width: W, ids per row.
      support_capacity: C, when rows carry supports.
      weights: the publisher rollout samples from; None publishes nothing.
      sync_every: push when the served version is this many updates behind.
      state: the state to start from, or a function returning it, called when the run
        starts; None: ``trainer.initial_state()``. The state is donated to the first step;
        a second run continues from the newest state.
      log: ``log(step, metrics, record)`` after each update (:data:`UpdateLog`).
      until: ``until(state)`` after each update and its ``log``, with the new state; a
        true result ends the stage there, as reaching ``steps`` does.
      name: the stage's name.

    Attributes:
      state: the newest training state (the final one once the run ended).

    Raises:
      TypeError, ValueError: bad arguments, naming the one at fault.
      FloatingPointError: (while running) an update with a non-finite loss or gradient.

    Example:
      >>> class Trainer:
      ...     objective = None
      ...     def initial_state(self): ...
      ...     def train_step(self, state, batch): ...
      >>> stage = Train(Trainer(), steps=10, width=64)
      >>> sorted(stage.inputs), sorted(stage.outputs)
      (['records', 'rows'], ['handover', 'params'])
    """

    def __init__(
        self,
        trainer: TrainingStep,
        *,
        steps: int,
        width: int,
        support_capacity: int | None = None,
        weights: WeightsPublisher | None = None,
        sync_every: int = 1,
        state: TrainingState | Callable[[], TrainingState] | None = None,
        log: UpdateLog | None = None,
        until: Callable[[TrainingState], bool] | None = None,
        name: str = "update",
        share_prompts: bool = False,
    ) -> None:
        super().__init__(
            width=width,
            support_capacity=support_capacity,
            share_prompts=share_prompts,
            weights=weights,
            sync_every=sync_every,
            name=name,
        )
        if not isinstance(trainer, TrainingStep):
            raise TypeError(f"trainer={trainer!r}; expected a dew_pipe.Trainer")
        if log is not None and not callable(log):
            raise TypeError(f"log={log!r}; expected None or log(step, metrics, record)")
        if until is not None and not callable(until):
            raise TypeError(f"until={until!r}; expected None or until(state) -> bool")
        self.trainer = trainer
        self.steps = check_int("steps", steps, minimum=0)
        self.log, self.until = log, until
        self._initial_state = state
        self.state: TrainingState | None = None

    @staticmethod
    def _ports(rows: pa.Schema) -> tuple[Ports, Ports]:
        inputs = {"rows": rows, "records": Port(SchedulerRecord, required=False)}
        outputs = {
            "handover": Port(Handover, required=False),
            "params": Port(Proximal, required=False),
        }
        return inputs, outputs

    def _first_state(self) -> TrainingState:
        """The newest state (a run again continues from it), else the one given, else the
        trainer's initial state; only one is kept, as each is donated to the next step."""
        if self.state is not None:
            return self.state
        given, self._initial_state = self._initial_state, None
        if given is None:
            return self.trainer.initial_state()
        return given() if callable(given) else given

    def run(self, ctx: StageContext) -> None:
        state = self.state = self._first_state()
        for index in range(self.steps):
            if ctx.cancelled:
                raise Cancelled()
            position = getattr(state, "step", None)
            position = None if position is None else int(position)
            served = self._serve(ctx, index, int(state.updates), state.params, position)
            if served is None:
                return
            rows, record = served
            state, metrics = self.trainer.train_step(state, packed_from_arrow(rows))
            self.state = state
            values = {k: float(v) for k, v in jax.device_get(metrics).items()}
            if not values.get("finite", 1.0):
                raise FloatingPointError(
                    f"update {index}: non-finite loss or gradient (loss={values.get('loss')}, "
                    f"grad_norm={values.get('grad_norm')})"
                )
            ctx.heartbeat()
            if self.log is not None:
                self.log(index, values, record)
            if self.until is not None and self.until(state):
                break
        self._pushes.settle()  # the last push's failure is this run's too
