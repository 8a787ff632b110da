"""Values: PPO's stage between pack and update, where a batch gets its critic and GAE targets.

In the pipeline view PPO runs the same graph as GRPO with this stage in the place of
``Rescore``: tasks → rollout → reward → pack → values → update. Pack packs each batch with
``estimator="reward"``, so every sampled id carries its episode's reward in
``advantages``; then, under the weights the trainer is about to update (the
:class:`~dew_pipe.stages.messages.Proximal` the update stage sends for each batch), this
stage

1. rescores ``old_log_probs`` with the policy (the proximal policy, as ``Rescore`` does;
   ``rescore=False`` keeps the engine's raw likelihoods);
2. scores the chains with the critic (``PPOObjective.values``): ``old_values``;
3. runs :func:`~dew_pipe.objectives.rl.gae.episode_gae` over each episode's actions in draw
   order and writes the whitened ``advantages`` and the ``returns``

with the same functions ``PPORollout`` uses in the library view, so both views train
``PPOObjective`` on the same targets. The rows it puts out carry the PPO columns
(``packed_schema(width, ppo=True)``).

:class:`PolicyWeights` is the other half: the trainer's state holds the policy and the
critic, the rollout server serves only the policy, so the publisher the graph pushes to
picks the policy subtree out of every push.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dew_pipe._validate import check_float
from dew_pipe.batches import packed_from_arrow, packed_schema, packed_to_arrow
from dew_pipe.flow import EndOfStream, Stage, StageContext
from dew_pipe.objectives.rl.gae import episode_gae
from dew_pipe.stages.messages import Proximal
from dew_pipe.stages.protocols import WeightsPublisher

__all__ = ["PolicyWeights", "Values"]


class PolicyWeights:
    """A publisher that serves the policy subtree of PPO variables.

    Args:
        publisher: what serves the policy (a ``NativeRolloutServer``).
        objective: the ``PPOObjective`` (its ``policy_variables`` picks the subtree).

    Attributes:
        version: the served version (the wrapped publisher's).

    Example:
        >>> class Server:
        ...     version = 0
        ...     def load(self, params, version):
        ...         self.params, self.version = params, version
        >>> class Objective:
        ...     def policy_variables(self, variables):
        ...         return variables["policy"]
        >>> server = Server()
        >>> PolicyWeights(server, Objective()).load({"policy": 1, "critic": 2}, 3)
        >>> server.params, server.version
        (1, 3)
    """

    def __init__(self, publisher: WeightsPublisher, objective: Any) -> None:
        if not isinstance(publisher, WeightsPublisher):
            raise TypeError(f"publisher={publisher!r}; expected one with load(params, version)")
        if not callable(getattr(objective, "policy_variables", None)):
            raise TypeError(f"objective={objective!r}; expected a PPOObjective")
        self.publisher, self.objective = publisher, objective

    @property
    def version(self) -> int:
        return self.publisher.version

    def load(self, params: Any, version: int) -> Any:
        """Serve the policy subtree of ``params`` as ``version``; returns what the wrapped
        publisher's ``load`` returns (a push's future, for a rollout server)."""
        return self.publisher.load(self.objective.policy_variables(params), version)


class Values(Stage):
    """Critic values, proximal rescoring and GAE targets for each packed batch.

    Ports:
      rows (in): packed rows from pack (``estimator="reward"``).
      params (in): one :class:`~dew_pipe.stages.messages.Proximal` per batch, in order.
      rows (out): the rows with ``old_log_probs`` rescored and ``old_values``,
        ``advantages`` and ``returns`` written.

    Args:
      objective: the ``PPOObjective`` being trained (its ``values`` and
        ``packed_log_probs`` are jitted here; nothing compiles until the first batch).
      width: W, ids per row.
      gamma: discount per action id, in ``[0, 1]``.
      lam: GAE's lambda, in ``[0, 1]``.
      rescore: replace ``old_log_probs`` with the proximal policy's likelihoods.
      support_capacity: C, when the rows carry supports.
      name: the stage's name.

    Raises:
      TypeError: an objective without ``values``; ValueError: ``gamma`` or ``lam`` out of
        range; (while running) a batch with exactly one trainable action id, or a batch
        paired with another batch's weights.

    Example:
      >>> class Objective:
      ...     def values(self, params, batch): ...
      ...     def packed_log_probs(self, params, batch): ...
      >>> stage = Values(Objective(), width=8)
      >>> sorted(stage.inputs), "returns" in stage.outputs["rows"].type.names
      (['params', 'rows'], True)
    """

    def __init__(
        self,
        objective: Any,
        *,
        width: int,
        gamma: float = 1.0,
        lam: float = 0.95,
        rescore: bool = True,
        support_capacity: int | None = None,
        name: str = "values",
    ) -> None:
        if not callable(getattr(objective, "values", None)):
            raise TypeError(f"objective={objective!r}; expected a PPOObjective with values()")
        if not isinstance(rescore, bool):
            raise TypeError(f"rescore={rescore!r}; expected True or False")
        super().__init__(
            name,
            inputs={"rows": packed_schema(width, support_capacity=support_capacity),
                    "params": Proximal},
            outputs={"rows": packed_schema(width, support_capacity=support_capacity, ppo=True)},
        )  # fmt: skip
        self.objective = objective
        self.gamma = check_float("gamma", gamma, minimum=0.0, maximum=1.0)
        self.lam = check_float("lam", lam, minimum=0.0, maximum=1.0)
        self.rescore = rescore
        self._values: Any = None
        self._score: Any = None

    def _jit(self) -> None:
        import jax  # here, not at the top: building the graph loads and compiles nothing

        self._values = jax.jit(self.objective.values)
        if self.rescore:
            self._score = jax.jit(self.objective.packed_log_probs)

    def run(self, ctx: StageContext) -> None:
        for index, batch in enumerate(ctx.read("rows")):
            proximal = _next_params(ctx)
            if proximal is None:
                return
            if proximal.batch != index:
                raise RuntimeError(
                    f"{self.name}: batch {index} came with the weights of batch "
                    f"{proximal.batch}; pack and update disagree on the batch order"
                )
            ctx.put(
                "rows", packed_to_arrow(self.targets(proximal.params, packed_from_arrow(batch)))
            )

    def targets(self, params: Any, columns: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The batch ``columns`` with the PPO targets under ``params`` (see the module
        docstring); the rewards are read from ``advantages``."""
        if self._values is None:
            self._jit()
        columns = dict(columns)
        mask = columns["response_mask"] == 1
        actions = int(mask.sum())
        if actions == 1:
            raise ValueError(
                f"{self.name}: the batch has exactly one trainable action id; its whitened "
                "advantage is undefined"
            )
        values = np.zeros(mask.shape, np.float32)
        if actions:
            if self._score is not None:
                scored = np.asarray(self._score(params, columns))
                columns["old_log_probs"] = np.where(mask, scored, 0.0).astype(np.float32)
            values = np.where(mask, np.asarray(self._values(params, columns)), 0.0)
        advantages, returns = episode_gae(
            columns, values, columns["advantages"], gamma=self.gamma, lam=self.lam
        )
        columns.update(old_values=values.astype(np.float32), advantages=advantages, returns=returns)
        return columns


def _next_params(ctx: StageContext) -> Proximal | None:
    """The next Proximal (skipping Nones), or None at end of stream."""
    while True:
        try:
            item = ctx.get("params")
        except EndOfStream:
            return None
        if item is not None:
            return item
