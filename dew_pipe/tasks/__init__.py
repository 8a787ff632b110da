"""Generated tasks: data, tokenizer, reward and evaluation made from a seed, nothing downloaded.

``arithmetic`` (the task), ``problems`` (its problems and exact-match rule),
``char_tokenizer``, ``recipe`` (its SFT recipe) and ``plot`` (the figure of a run's
metrics); ``code_task`` (programs by example, graded by running them) and ``programs`` (its
operations, examples and hidden cases). Jobs that use them are pipeline files
(``pipelines/arithmetic.py``, ``pipelines/rlvr.py``).

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
    "CodeTask": "dew_pipe.tasks.code_task",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
