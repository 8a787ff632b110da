"""Objectives: pure losses the Trainer differentiates.

Names resolve lazily (module ``__getattr__``) so importing the package costs nothing until a
name is used. To export a new name, add it to ``_LAZY`` with the module that defines it.
"""

from __future__ import annotations

from dew_pipe._lazy import lazy_exports

_LAZY: dict[str, str] = {
    "LMObjective": "dew_pipe.objectives.lm",
    "DiffusionObjective": "dew_pipe.objectives.diffusion",
    "Objective": "dew_pipe.training.objective",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
