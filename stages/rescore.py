"""Rescore: replaces ``old_log_probs`` with the trainer's current (proximal) likelihoods.

Engines report the likelihood of each sampled id under the weights they served, which may
be ``max_lag`` updates old. Before a batch trains, this stage scores every sampled id
again under the weights the trainer is about to update, and stores the result as
``old_log_probs``: the proximal policy of decoupled PPO (AReaL). ``behavior_log_probs``
keeps what the engine reported, so the objective's ``behavior_importance`` can weight
each token by proximal over behavior.

Each packed batch is matched with one :class:`~dew_pipe.stages.messages.Proximal` from the
update stage, in order; the weights it carries are the trainer's live ones, valid only
until that batch's update runs, which waits for this stage's output.
"""

from __future__ import annotations

import numpy as np

from dew_pipe.batches import packed_from_arrow, packed_schema, packed_to_arrow
from dew_pipe.flow import EndOfStream, Stage, StageContext
from dew_pipe.stages.messages import Proximal
from dew_pipe.stages.protocols import LikelihoodScorer

__all__ = ["SCORED", "Rescore"]

SCORED = (
    "input_ids",
    "text_segment_ids",
    "text_positions",
    "text_prefix_segments",
    "support_ids",
    "support_columns",
)
"""The packed columns the scorer reads: the chains, and the recorded supports when a batch
has them."""


class Rescore(Stage):
    """Scores packed rows under the trainer's current weights.

    Ports:
      rows (in, out): packed rows; out carries the rescored ``old_log_probs``.
      params (in): one :class:`~dew_pipe.stages.messages.Proximal` per batch, in order.

    Args:
      score: ``score(params, columns) -> [N, W]`` log-probability of each id given its
        chain's prefix, as ``GRPOObjective.packed_log_probs`` (jitted) computes it.
        ``columns`` holds input_ids, text_segment_ids, text_positions and, when present,
        support_ids and support_columns.
      width: W, ids per row.
      support_capacity: C, when the rows carry supports.
      name: the stage's name.

    Example:
      >>> stage = Rescore(lambda params, cols: np.zeros(cols["input_ids"].shape), width=8)
      >>> sorted(stage.inputs)
      ['params', 'rows']
    """

    def __init__(
        self,
        score: LikelihoodScorer,
        *,
        width: int,
        support_capacity: int | None = None,
        share_prompts: bool = False,
        name: str = "rescore",
    ) -> None:
        if not callable(score):
            raise TypeError(f"score={score!r}; expected score(params, columns) -> [N, W]")
        schema = packed_schema(
            width, support_capacity=support_capacity, share_prompts=share_prompts
        )
        super().__init__(
            name, inputs={"rows": schema, "params": Proximal}, outputs={"rows": schema}
        )
        self.score = score

    def run(self, ctx: StageContext) -> None:
        for index, batch in enumerate(ctx.read("rows")):
            proximal = self._proximal(ctx)
            if proximal is None:
                return
            if proximal.batch != index:
                raise RuntimeError(
                    f"rescore: batch {index} came with the weights of batch {proximal.batch}; "
                    "pack and update disagree on the batch order"
                )
            columns = dict(packed_from_arrow(batch))
            columns["old_log_probs"] = self._rescored(proximal, columns)
            ctx.put("rows", packed_to_arrow(columns))

    def _proximal(self, ctx: StageContext) -> Proximal | None:
        while True:
            try:
                item = ctx.get("params")
            except EndOfStream:
                return None
            if item is not None:
                return item

    def _rescored(self, proximal: Proximal, columns: dict[str, np.ndarray]) -> np.ndarray:
        feed = {name: columns[name] for name in SCORED if name in columns}
        scored = np.asarray(self.score(proximal.params, feed))
        shape = columns["input_ids"].shape
        if scored.shape != shape:
            raise ValueError(
                f"rescore: score returned shape {scored.shape}; expected {shape} like input_ids"
            )
        sampled = columns["response_mask"] == 1
        if not np.isfinite(scored[sampled]).all():
            raise ValueError(
                f"rescore: the log-probability of a sampled id under version {proximal.version} "
                "is not finite"
            )
        return np.where(sampled, scored, 0.0).astype(np.float32)
