"""Generated tasks: data, tokenizer, reward and evaluation made from a seed, nothing downloaded.

``arithmetic`` (the task), ``problems`` (its problems and exact-match rule),
``char_tokenizer``, ``recipe`` (its SFT recipe) and ``plot`` (the figure of a run's
metrics). Jobs that use them are pipeline files (``pipelines/arithmetic.py``).

Names resolve lazily (module ``__getattr__``), so importing this package loads neither JAX
nor transformers.
"""

from __future__ import annotations

from dew_pipe._lazy import lazy_exports

_LAZY: dict[str, str] = {
    "ArithmeticTask": "dew_pipe.tasks.arithmetic",
    "reward": "dew_pipe.tasks.arithmetic",
    "Problems": "dew_pipe.tasks.problems",
    "is_correct": "dew_pipe.tasks.problems",
    "build_char_tokenizer": "dew_pipe.tasks.char_tokenizer",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
