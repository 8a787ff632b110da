"""`NativeRolloutServer`: the `RolloutServer` interface over the in-process `Server`.

Draws come from the continuous-batching `dew_pipe.inference.Server` and carry raw and
behavior likelihoods; `load` copies a trainer's variables into the served buffers in place
between two decode steps (`Server.reload`), cast to the served precision, and returns
without waiting for that step: the push is ordered before later submissions. It is also a
weights publisher for the rollout scheduler: ``load(params, version)`` and ``version``.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np

from dew_pipe._validate import check_int
from dew_pipe.inference.servers.engine import Server, ServerCounters
from dew_pipe.inference.servers.interface import Draw

__all__ = ["NativeRolloutServer"]


class NativeRolloutServer:
    """A `RolloutServer` backed by a `Server` it owns (closing one closes the other).

    Args:
        server: the continuous-batching server, e.g. ``Server.from_task(task, slots=8,
            capacity=256)``.

    Raises:
        TypeError: ``server`` is not a `Server`.

    Example:
        >>> server = NativeRolloutServer(Server.from_task(task, slots=8, capacity=256))  # doctest: +SKIP
        >>> draw = server.submit([1, 5, 9], 16, seed=3).result()   # doctest: +SKIP
        >>> draw.log_probs is not None, draw.version   # doctest: +SKIP
        (True, 0)
        >>> server.load(state.params, int(state.updates)).result()   # doctest: +SKIP
        1
        >>> server.close()   # doctest: +SKIP
    """

    def __init__(self, server: Server) -> None:
        if not isinstance(server, Server):
            raise TypeError(
                f"server is {type(server).__name__}; expected a dew_pipe.inference.Server"
            )
        self.server = server

    @property
    def version(self) -> int:
        """The weights version new draws are served under."""
        return self.server.version

    def submit(
        self,
        prompt_ids: Sequence[int] | np.ndarray,
        max_new_tokens: int,
        *,
        seed: int | None = None,
    ) -> Future[Draw]:
        """Queues one draw; see `Server.submit` (cancel the future to stop it)."""
        return self.server.submit(prompt_ids, max_new_tokens, seed=seed)

    def submit_many(
        self,
        prompts: Sequence[Sequence[int] | np.ndarray],
        max_new_tokens: int,
        *,
        seeds: Sequence[int | None] | None = None,
    ) -> list[Future[Draw]]:
        """Queues several draws together; see `Server.submit_many`."""
        return self.server.submit_many(prompts, max_new_tokens, seeds=seeds)

    def load(self, variables: Any, version: int) -> Future[int]:
        """Serves ``variables`` as ``version`` from the next decode step on, without waiting.

        Returns at once with a future resolved with ``version`` once the weights serve. The
        push is ordered before later submissions (they start on the new weights) and
        ``version`` moves at once; the server's own copy is made before this returns, so
        the caller may donate its arrays right after. Draws in flight continue, keeping
        the oldest version that produced their ids.

        Args:
            variables: ``{"params": ...}`` (or a ``TrainState``), any floating precision.
            version: the version to serve it as (an int >= 0).

        Returns:
            The push's future (`Server.reload` with ``wait=False``); call ``.result()`` to
            wait for it.

        Raises:
            TypeError / ValueError: a tree that does not match the served one, a bad
                version.
            RuntimeError: the server is closed or failed.
        """
        version = check_int("version", version, minimum=0)
        return self.server.reload(variables, version, wait=False)

    def counters(self) -> ServerCounters:
        """The server's counters (`Server.counters`)."""
        return self.server.counters()

    def close(self) -> None:
        """Closes the server: its thread stops and unfinished draws fail."""
        self.server.close()

    def __enter__(self) -> NativeRolloutServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
