"""The few errors the flow runtime raises, and the one count check that raises BuildError."""

from __future__ import annotations

from typing import Any

from dew_pipe._validate import check_int


class FlowError(Exception):
    """Base class of the flow runtime's errors."""


class BuildError(FlowError, ValueError):
    """A pipeline wired wrongly; raised while it is built, before any stage runs."""


def check_count(owner: str, name: str, value: Any) -> int:
    """``value`` as an int >= 1 (workers, capacities), else a BuildError naming ``owner``."""
    try:
        return check_int(name, value, minimum=1)
    except (TypeError, ValueError):
        raise BuildError(f"{owner}: {name}={value!r}, expected an int >= 1") from None


class StageFailed(FlowError, RuntimeError):
    """A stage raised (or timed out); the original exception is ``__cause__``.

    Attributes:
      stage: the failing stage's name.
      item: index of the input item it was working on, when known (0-based), else None.
      stuck: names of threads that did not stop after cancellation (see ``Run.wait``).
    """

    def __init__(self, message: str, *, stage: str, item: int | None = None):
        super().__init__(message)
        self.stage = stage
        self.item = item
        self.stuck: tuple[str, ...] = ()


class Deadlock(StageFailed):
    """Stages of a cycle wait on each other's full edges; ``stage`` is one of them."""


class StageTimeout(FlowError, TimeoutError):
    """A stage spent longer than its ``timeout`` in its own code without progress."""


class Cancelled(FlowError, RuntimeError):
    """The run was cancelled (from outside, or because another stage failed)."""

    def __init__(self, message: str = "cancelled"):
        super().__init__(message)
        self.stuck: tuple[str, ...] = ()


class RunTimeout(Cancelled, TimeoutError):
    """The whole run took longer than ``run(timeout=...)``."""


class EndOfStream(Exception):  # noqa: N818 - a signal, not an error
    """Every edge into the port(s) a stage reads has ended and been drained.

    ``StageContext.get`` raises it; a stage that lets it escape from ``run`` has finished
    normally.
    """
