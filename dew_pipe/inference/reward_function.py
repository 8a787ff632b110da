"""`RewardFunction`: the per-completion reward `SampledRollout` and `PromptSource` call.

A reward function reads strings and returns a finite score for one completion::

    reward(data_source, completion, ground_truth, extra_info) -> float

The three metadata strings are the prompt row's (`dew_pipe.data.Prompts` columns, or a
task's ``data``); the completion is the rollout's ``decode`` of the sampled ids without EOS
and padding, by default `join_ids`. This is not the ``Reward`` stage of
`dew_pipe.stages`: that stage scores whole sessions inside a pipeline with a ``Score``
function, for sources that leave their sessions unscored.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

__all__ = ["RewardFunction", "join_ids"]


class RewardFunction(Protocol):
    """``reward(data_source, completion, ground_truth, extra_info) -> float``.

    Any callable taking the four strings positionally will do (a function, a lambda, an
    object with ``__call__``). A reward that raises or returns a non-finite value fails
    that completion: `SampledRollout` raises, `PromptSource` records the session as
    INFRA_ERROR.

    Example:
        >>> def exact(data_source: str, completion: str, truth: str, extra: str) -> float:
        ...     return float(completion.strip() == truth)
        >>> reward: RewardFunction = exact
        >>> reward("arith", " 12 ", "12", "")
        1.0
    """

    def __call__(
        self, data_source: str, completion: str, ground_truth: str, extra_info: str, /
    ) -> float: ...


def join_ids(ids: Sequence[int] | np.ndarray) -> str:
    """The default ``decode``: ids as decimal numbers separated by single spaces.

    Example:
        >>> join_ids([5, 12, 3])
        '5 12 3'
    """
    return " ".join(str(int(i)) for i in ids)
