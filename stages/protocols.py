"""What the stages call on their collaborators, as small protocols.

The stages never import a concrete engine or trainer: rollout submits to a
:class:`~dew_pipe.objectives.rl.sessions.SessionSource`, the handoff and training stages
push weights through a :class:`WeightsPublisher`, rescore calls a
:class:`LikelihoodScorer`, and the training stage drives a :class:`TrainingStep` whose
states are :class:`TrainingState`. Anything with these methods fits: the inference servers
(``NativeRolloutServer``, ``ProcessRolloutServer``, a ``Publication``) are publishers, a
``dew_pipe.Trainer`` is a training step, ``jax.jit(GRPOObjective(...).packed_log_probs)`` is a
scorer, and the test fakes are all of them.

``WeightsPublisher`` and ``TrainingStep`` are runtime-checkable, so a constructor can refuse
a collaborator without the methods before anything runs (``isinstance`` checks only that the
names exist, not their signatures).

Example:
    >>> class Weights:
    ...     version = 0
    ...     def load(self, params, version):
    ...         self.version = version
    >>> isinstance(Weights(), WeightsPublisher)
    True
    >>> isinstance(object(), WeightsPublisher)
    False
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np

__all__ = ["LikelihoodScorer", "TrainingState", "TrainingStep", "WeightsPublisher"]


@runtime_checkable
class WeightsPublisher(Protocol):
    """Serves weights to the engine rollout samples from.

    Attributes:
      version: the weights version served now (an int >= 0); sessions are stamped with it.
    """

    version: int

    def load(self, params: Any, version: int) -> Any:
        """Serve ``params`` as ``version`` from now on (the caller may donate ``params``
        afterwards, so a publisher that keeps them copies them).

        Returns None when the push is complete, or a ``concurrent.futures.Future`` of a
        push still in flight (a rollout server's ``load``), which must already be ordered
        before every later submission and have moved ``version``; the stages check it
        at the next push."""
        ...


class LikelihoodScorer(Protocol):
    """``score(params, columns) -> [N, W]``: each id's log-probability given its prefix.

    ``columns`` holds ``input_ids``, ``text_segment_ids``, ``text_positions`` (and, when the
    batch records them, ``support_ids`` and ``support_columns``) as ``[N, W]`` arrays;
    ``GRPOObjective.packed_log_probs`` (jitted) is one.
    """

    def __call__(self, params: Any, columns: Mapping[str, np.ndarray]) -> Any: ...


class TrainingState(Protocol):
    """What the stages read of a training state (``dew_pipe.TrainState`` is one).

    Attributes:
      params: the variables being trained.
      updates: optimizer updates committed (an int or an int scalar array): the version.
    """

    params: Any
    updates: Any


@runtime_checkable
class TrainingStep(Protocol):
    """A trainer the training stage drives itself (``dew_pipe.Trainer`` is one).

    Attributes:
      objective: the objective trained; its ``packed_log_probs`` rescores batches.
    """

    objective: Any

    def initial_state(self) -> TrainingState:
        """A fresh state to start from."""
        ...

    def train_step(
        self, state: TrainingState, batch: Mapping[str, np.ndarray]
    ) -> tuple[TrainingState, Mapping[str, Any]]:
        """One update on a packed batch: ``(new state, metrics)``; ``state`` is donated."""
        ...
