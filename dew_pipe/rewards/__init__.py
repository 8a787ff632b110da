"""Verifiable rewards: functions with the `RewardFunction` signature that check a completion.

``reward(data_source, completion, ground_truth, extra_info) -> float``, so each one plugs
into `dew_pipe.inference.SampledRollout` and `dew_pipe.inference.PromptSource` as it is:

- ``math_answers``: `MathReward`, the last ``\\boxed{}`` answer compared with the reference
  as an exact rational (``0.5``, ``1/2`` and ``\\frac{1}{2}`` agree; ``0.333`` and ``1/3``
  do not), parsed with ``latex2sympy2_extended``.
- ``code_tests``: `CodeReward`, the last fenced python block run once per stdin/stdout test
  case on a `dew_pipe.sandbox.SandboxFleet`; the share of cases whose output matches line
  by line, or all-or-nothing.

Names resolve lazily (module ``__getattr__``), so importing this package loads neither
SymPy nor the sandbox.
"""

from __future__ import annotations

from dew_pipe._lazy import lazy_exports

_LAZY: dict[str, str] = {
    "MathReward": "dew_pipe.rewards.math_answers",
    "last_boxed": "dew_pipe.rewards.math_answers",
    "parse_rational": "dew_pipe.rewards.math_answers",
    "CodeReward": "dew_pipe.rewards.code_tests",
    "last_python_block": "dew_pipe.rewards.code_tests",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
