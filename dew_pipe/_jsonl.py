"""The one writer of a run directory's JSON-lines files (``metrics.jsonl``), and their reader.

It sits at the lowest floor (standard library only) so both writers of records can use
it: the flow runtime's :class:`dew_pipe.flow.MetricsWriter` (``flow``, ``values`` and
``event`` records) and the Trainer's :class:`dew_pipe.training.log.TrainLog` (training and
validation records). Each decides what goes in a record; this module decides how a record
reaches the file: one JSON object per line, appended, written whole under a lock (several
threads may share a file) and flushed at once, so ``tail -f`` and a crash see every line.

:func:`read_objects` reads such a file back (a run's metrics, recorded sessions), one object
per line, and names the file and the line of anything else.

Example:
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "m.jsonl")
    >>> with JsonLines(path) as lines:
    ...     lines.write({"step": 1, "loss": 0.5})
    >>> open(path).read()
    '{"step": 1, "loss": 0.5}\\n'
    >>> list(read_objects(path))
    [(1, {'step': 1, 'loss': 0.5})]
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

__all__ = ["JsonLines", "read_objects"]


class JsonLines:
    """Appends one JSON object per line to ``path`` (opened now, created if missing).

    Args:
        path: the file; its directory must exist.
        default: ``json.dumps``'s fallback for values it cannot encode, or None.
        allow_nan: write NaN and Infinity as JSON's non-standard literals; with False a
            non-finite float raises ``ValueError`` (clean the record first).
    """

    def __init__(
        self,
        path: str | Path,
        *,
        default: Callable[[Any], Any] | None = None,
        allow_nan: bool = True,
    ) -> None:
        self.path = Path(path)
        self._default = default
        self._allow_nan = allow_nan
        self._file = self.path.open("a", encoding="utf-8")
        self._lock = threading.Lock()

    def write(self, record: Mapping[str, Any]) -> None:
        """Append ``record`` as one line and flush it.

        Raises:
            ValueError: when the file is closed (or a non-finite float with ``allow_nan=False``).
            TypeError: for a value neither JSON nor ``default`` can encode.
        """
        line = json.dumps(dict(record), default=self._default, allow_nan=self._allow_nan)
        with self._lock:
            if self._file.closed:
                raise ValueError(f"metrics file {self.path} is closed")
            self._file.write(line + "\n")
            self._file.flush()

    def close(self) -> None:
        """Close the file; later writes raise ``ValueError``. Closing twice is harmless."""
        with self._lock:
            self._file.close()

    def __enter__(self) -> JsonLines:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_objects(path: str | os.PathLike[str]) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` for each line of a JSON-lines file; blank lines are skipped.

    Raises:
        FileNotFoundError: no such file.
        ValueError: a line that is not JSON, or JSON that is not an object, naming the file and
            the line (1-based).
    """
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(
                    f"{path} line {number} is not JSON ({error.msg} at char {error.pos}); "
                    "expected one JSON object per line"
                ) from error
            if not isinstance(value, dict):
                raise ValueError(
                    f"{path} line {number} is a JSON {type(value).__name__}; expected one JSON "
                    "object per line"
                )
            yield number, value
