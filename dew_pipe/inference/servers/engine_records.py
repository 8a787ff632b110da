"""What the `Server` thread keeps about its work: requests, reloads and counters."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from concurrent.futures import Future, InvalidStateError
from typing import Any

import numpy as np

__all__ = ["Reload", "Request", "ServerCounters", "resolve"]


@dataclasses.dataclass(frozen=True)
class ServerCounters:
    """A snapshot of what a `Server` has done.

    Attributes:
        steps: decode steps run (each gives every busy row one more id).
        calls: compiled decode calls (each runs up to ``steps_per_call`` steps).
        prefills: compiled prefill calls (each starts one or more requests).
        joined: requests started in a row.
        joined_mid_flight: of those, the ones started while another row was decoding.
        prompts_prefilled: prompts run through the decoder by the prefills; requests that
            join together with the same prompt (a group's draws) share one, so this is
            ``joined`` less the shared ones.
        finished: draws resolved with a result.
        cancelled: draws dropped because their future was cancelled.
        failed: futures failed (bad prompt, close, a failure of the thread).
        reloads: weight reloads applied.
        rows_per_step: histogram ``{busy rows: steps}`` over every decode step.
        active: rows decoding now.
        waiting: requests queued now.
        version: the weights version served now.
    """

    steps: int
    calls: int
    prefills: int
    joined: int
    joined_mid_flight: int
    prompts_prefilled: int
    finished: int
    cancelled: int
    failed: int
    reloads: int
    rows_per_step: Mapping[int, int]
    active: int
    waiting: int
    version: int


@dataclasses.dataclass(eq=False)
class Request:
    """One submitted draw: its inputs, and the ids and likelihoods sampled so far."""

    future: Future
    prompt: np.ndarray
    budget: int
    seed: int
    submitted_version: int
    version: int | None = None  # oldest version that produced one of its ids
    ids: list[np.ndarray] = dataclasses.field(default_factory=list)
    log_probs: list[np.ndarray] = dataclasses.field(default_factory=list)
    behavior: list[np.ndarray] = dataclasses.field(default_factory=list)
    support: list[np.ndarray] = dataclasses.field(default_factory=list)
    count: int = 0
    arrived: float = 0.0  # time.monotonic() at submission (the gather window counts from it)

    def record(self, version: int, ids, log_probs, behavior, support) -> None:
        self.version = version if self.version is None else min(self.version, version)
        self.ids.append(ids)
        self.log_probs.append(log_probs)
        self.behavior.append(behavior)
        if support is not None:
            self.support.extend(np.flatnonzero(kept).astype(np.int32) for kept in support)
        self.count += len(ids)


@dataclasses.dataclass(eq=False)
class Reload:
    """A pending weight push: the server's own copy of the variables (in the served dtype)
    and the future resolved with ``version`` once they serve (or failed)."""

    variables: Any
    version: int
    future: Future = dataclasses.field(default_factory=Future)


def resolve(future: Future, result: Any = None, error: BaseException | None = None) -> None:
    """Resolves ``future`` with ``result`` or ``error`` unless it is already done (a
    cancelled push's future stays cancelled)."""
    try:
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)
    except InvalidStateError:
        pass
