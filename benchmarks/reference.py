"""Where the benchmarks find the reference interpreter (PyTorch, transformers, TRL).

The torch sides of ``dpo_step.py``, ``generate.py`` and ``train_step.py`` run in a separate
interpreter, the reference environment, because dew_pipe never imports torch. Build it once
from the repository root with::

    benchmarks/reference_env.sh            # creates .reference-venv/

A benchmark then takes the interpreter from ``--reference-python PATH``, else from the
``DEW_PIPE_REFERENCE_PYTHON`` environment variable, else ``.reference-venv/bin/python`` at the
repository root, and stops with one line saying how to get one when none of them exists.
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

__all__ = ["ENV_VAR", "add_reference_argument", "reference_python"]

ENV_VAR = "DEW_PIPE_REFERENCE_PYTHON"
DEFAULT = Path(__file__).resolve().parents[1] / ".reference-venv" / "bin" / "python"


def add_reference_argument(parser: argparse.ArgumentParser) -> None:
    """Adds ``--reference-python PATH`` to ``parser``."""
    parser.add_argument(
        "--reference-python",
        metavar="PATH",
        help=f"interpreter with torch + transformers (default: ${ENV_VAR}, else "
        ".reference-venv/bin/python; build it with benchmarks/reference_env.sh)",
    )


def reference_python(given: str | None) -> str:
    """The reference interpreter: ``given``, else ``$DEW_PIPE_REFERENCE_PYTHON``, else the default.

    Raises:
        SystemExit: with a one-line message, when that interpreter does not exist.
    """
    python = given or os.environ.get(ENV_VAR) or str(DEFAULT)
    if Path(python).is_file() or shutil.which(python):
        return python
    raise SystemExit(
        f"reference Python {python!r} not found: run benchmarks/reference_env.sh (it creates "
        f".reference-venv), or pass --reference-python PATH or set {ENV_VAR}"
    )
