"""Recipes: ready compositions of the Trainer, the objectives and the datasets.

``chain``
    :class:`Recipe` and :class:`Stage` (``dew_pipe.recipes.chain``): SFT, DPO and GRPO stages
    one after another on one decoder, each starting from the previous stage's policy, each
    restored from its own directory when it was trained before.
``samples``
    the ``sample`` previews a stage writes: completions of its own prompts.

Names resolve lazily, so ``import dew_pipe.recipes`` does not import JAX.

Example:
    >>> from dew_pipe.recipes import Recipe, Stage
    >>> Stage.__module__
    'dew_pipe.recipes.chain'
"""

from __future__ import annotations

from dew_pipe._lazy import lazy_exports

_LAZY: dict[str, str] = {
    "OBJECTIVES": "dew_pipe.recipes.chain",
    "Recipe": "dew_pipe.recipes.chain",
    "Stage": "dew_pipe.recipes.chain",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
