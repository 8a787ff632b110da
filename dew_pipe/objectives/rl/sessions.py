"""Session records and the functions over them: the spec's ``dew_pipe.objectives.rl.sessions``.

A :class:`Call` is one engine request of a harness session, a :class:`Session` one run of a
harness on a :class:`Task`, :class:`Status` how it ended, and a :class:`SessionSource` turns
tasks into futures of sessions (all defined in :mod:`~dew_pipe.objectives.rl.session_records`).
The functions that work on them live in their own modules and are importable from here too:

* :func:`pack`, :func:`chain_lengths`, :func:`rows_needed` (:mod:`~dew_pipe.objectives.rl.packing`):
  sessions into fixed ``[rows, width]`` training rows;
* :func:`session_metrics` (:mod:`~dew_pipe.objectives.rl.session_stats`): what to log about a
  batch of sessions and its packed rows;
* :func:`to_arrow`, :func:`from_arrow` (:mod:`~dew_pipe.objectives.rl.session_arrow`): sessions
  as the Arrow sessions batch that crosses stages, files and processes.

The records are imported with this module (NumPy only); the functions on first use, so
importing the records does not import pyarrow. Those modules import the records from
``session_records``, never from here, so no import circle forms.

Example:
    >>> from dew_pipe.objectives.rl.sessions import Call, Session, pack
    >>> call = Call([5, 6], [7, 2], [-0.2, -0.1], "stop", version=3)
    >>> pack([Session(0, 0, 0, 0, [call], "COMPLETED", 1.0)], width=4)["input_ids"].tolist()
    [[5, 6, 7, 2]]
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dew_pipe._lazy import lazy_exports
from dew_pipe.objectives.rl.session_records import Call, Session, SessionSource, Status, Task

if TYPE_CHECKING:
    from dew_pipe.objectives.rl.packing import chain_lengths, pack, rows_needed
    from dew_pipe.objectives.rl.session_arrow import from_arrow, to_arrow
    from dew_pipe.objectives.rl.session_stats import session_metrics

_LAZY: dict[str, str] = {
    "pack": "dew_pipe.objectives.rl.packing",
    "chain_lengths": "dew_pipe.objectives.rl.packing",
    "rows_needed": "dew_pipe.objectives.rl.packing",
    "session_metrics": "dew_pipe.objectives.rl.session_stats",
    "to_arrow": "dew_pipe.objectives.rl.session_arrow",
    "from_arrow": "dew_pipe.objectives.rl.session_arrow",
}

__all__ = [
    "Call",
    "Session",
    "SessionSource",
    "Status",
    "Task",
    "chain_lengths",
    "from_arrow",
    "pack",
    "rows_needed",
    "session_metrics",
    "to_arrow",
]
_, __getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
