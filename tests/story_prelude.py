"""The spec's "TinyStories decoder", at test size: a small decoder trained on generated stories.

The spec's SFT, DPO and GRPO examples continue a decoder trained on TinyStories and reuse its
``model``, ``lm_state`` and ``tokenizer``. Nothing downloads here, so :func:`story_decoder`
trains a stand-in with ``LMObjective`` on the project's generated corpus
(:mod:`dew_pipe.data.stories`). Only the first ``seq_len + 1`` tokens of each story are
trained on: the examples condition on the corpus's opening line, and short rows keep the
prelude to about 15 s of CPU. After it, about one completion in ten of the GRPO example's
prompt mentions a dog, close to the corpus rate (:func:`dew_pipe.data.stories.dog_rate`).

Imported by tests and benchmarks (``benchmarks/grpo_story.py`` puts ``tests/`` on the path);
it must not import pytest.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import numpy as np
import optax

from dew_pipe import Dataset, LMObjective, Trainer, TrainState, models
from dew_pipe.data.stories import generate_stories

#: The decoder: two layers of width 128, context 32 (the GRPO example needs 9 + 8 ids).
STORY_DECODER = dict(emb_features=128, num_layers=2, num_heads=4, mlp_features=512, max_seq_len=32)


class StoryDecoder(NamedTuple):
    """What the spec's examples reuse from the TinyStories section."""

    model: Any
    lm_state: TrainState
    tokenizer: Any


def story_rows(tokenizer: Any, seq_len: int, *, count: int = 3000, seed: int = 0) -> np.ndarray:
    """The first ``seq_len + 1`` ids of each generated story, ``[count, seq_len + 1]`` int32.

    Raises:
        ValueError: a story shorter than ``seq_len + 1`` ids.
    """
    rows = [tokenizer.encode(story)[: seq_len + 1] for story in generate_stories(count, seed=seed)]
    short = [i for i, row in enumerate(rows) if len(row) < seq_len + 1]
    if short:
        raise ValueError(f"story {short[0]} has fewer than seq_len + 1 = {seq_len + 1} ids")
    return np.asarray(rows, np.int32)


def story_decoder(
    tokenizer: Any,
    *,
    steps: int = 150,
    batch: int = 64,
    seq_len: int = 16,
    learning_rate: float = 3e-3,
    seed: int = 0,
    config: Mapping[str, Any] | None = None,
) -> StoryDecoder:
    """Train :data:`STORY_DECODER` on story openings with ``LMObjective`` and AdamW.

    Args:
        tokenizer: the story tokenizer (``dew_pipe.data.stories.story_tokenizer``).
        steps: optimizer updates (150 reach a training loss of about 0.55 nats).
        batch: rows per update, drawn with replacement from the corpus.
        seq_len: predicted positions per row.
        learning_rate: AdamW's step size.
        seed: seed of the row draws and of the initialization.
        config: decoder settings that replace those of :data:`STORY_DECODER`.

    Returns:
        ``StoryDecoder(model, lm_state, tokenizer)``.
    """
    rows = story_rows(tokenizer, seq_len)
    settings = {**STORY_DECODER, **(config or {})}
    model = models.build("causal_transformer", vocab_size=len(tokenizer), **settings)

    def train(partition: Any):
        del partition
        draw = np.random.default_rng(seed)
        while True:
            yield {"text": rows[draw.integers(0, len(rows), batch)]}

    data = Dataset(train=train, val=None, records=len(rows), batch=batch)
    objective = LMObjective(model, seq_len, ema_decay=None)
    trainer = Trainer(
        objective, optax.adamw(learning_rate), key=jax.random.key(seed), progress=False
    )
    lm_state = trainer.fit(data, steps=steps, log_every=steps)
    return StoryDecoder(model, lm_state, tokenizer)
