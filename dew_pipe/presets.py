"""Named process presets: ``presets.Flow()`` is a rectified flow with velocity prediction.

A preset is a frozen bundle of settings; calling it builds the
:class:`~dew_pipe.diffusion.Process` an objective uses, so a configuration can name a preset
(``presets.Flow(shift=3.0)``) before anything is built::

    process = presets.Flow()()

Example:
    >>> from dew_pipe import presets
    >>> presets.Flow()().prediction
    'velocity'
"""

from __future__ import annotations

import dataclasses

from dew_pipe.diffusion import Process

__all__ = ["Flow"]


@dataclasses.dataclass(frozen=True)
class Flow:
    """Rectified flow (``x_t = (1 - t) x0 + t eps``) trained to predict ``eps - x0``.

    Args:
        noise_level: ``a`` of Flow-GRPO's sampling SDE, ``sigma_t = a * sqrt(t / (1 - t))``
            (0.7, the paper's setting; 0 samples by the ODE alone).
        shift: SD3's sampling-grid time shift (1 keeps the grid uniform).
        time_sampling: ``"uniform"`` or ``"logit_normal"`` training times.

    Calling the preset returns the :class:`~dew_pipe.diffusion.Process`; bad settings are
    refused then, with the setting named.
    """

    noise_level: float = 0.7
    shift: float = 1.0
    time_sampling: str = "uniform"

    def __call__(self) -> Process:
        return Process(
            noise_level=self.noise_level,
            shift=self.shift,
            time_sampling=self.time_sampling,
            prediction="velocity",
        )
