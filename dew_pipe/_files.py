"""Files that appear whole or not at all: write beside the target, then rename it in.

A reader (a person, an engine loading weights, a rerun of a job) must never find half a file
where a finished one belongs. :func:`write_atomic` has ``write`` fill a temporary file in the
target's folder (so the rename stays on one file system, where ``os.replace`` is atomic) and
moves it onto the target only once ``write`` has returned; a failure removes the temporary
file and leaves the target as it was.

Example:
    >>> import tempfile
    >>> target = Path(tempfile.mkdtemp()) / "notes.txt"
    >>> write_atomic(target, lambda path: Path(path).write_text("done")).read_text()
    'done'
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["write_atomic"]


def write_atomic(path: str | os.PathLike[str], write: Callable[[str], Any]) -> Path:
    """Write ``path`` through ``write(temporary path)`` beside it, then move it in.

    The file gets mode 0644 (``mkstemp`` makes 0600; servers often run as another user).

    Returns:
        ``path`` as a Path.

    Raises:
        FileNotFoundError: the folder of ``path`` does not exist.
        whatever ``write`` raises (the temporary file is removed first).
    """
    path = Path(path)
    if not path.parent.is_dir():
        raise FileNotFoundError(f"{path}: the folder {path.parent} does not exist")
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(handle)
    try:
        write(temporary)
        os.chmod(temporary, 0o644)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    return path
