"""``.reference-venv/bin/python tools/parity_ppo.py``: the spec's path for the PPO parity recording.

Runs ``tests/parity/record_verl_ppo.py`` as it is (it must run in the reference environment
``benchmarks/reference_env.sh`` builds, with torch and verl 0.9.1): verl's GAE over multi-turn
episodes, its clipped policy and value losses and their autograd gradients through a small
model, written to ``tests/parity/fixtures/verl_ppo.npz`` for ``tests/test_ppo.py``.
"""

from __future__ import annotations

import runpy
from pathlib import Path

if __name__ == "__main__":
    script = Path(__file__).resolve().parents[1] / "tests" / "parity" / "record_verl_ppo.py"
    runpy.run_path(str(script), run_name="__main__")
