"""What the HTTP rollout servers share: futures over requests, seeds, cancellation, pushes.

`OpenAIRolloutServer` and `VLLMGenerateServer` differ only in the request they build and
how they read the answer; `RemoteServer` does the rest of the `RolloutServer` contract:

- ``submit`` checks its arguments, stamps the version the publisher serves now, picks a
  seed when none is given (every request carries one) and returns a future at once; one
  worker thread per request in flight waits on the engine.
- cancelling the future aborts the request's connection; vLLM aborts a request whose
  client went away, so the engine stops spending time on it.
- ``load`` is the publisher's (``weights.load``: a `Publication` over a weight push);
  ``version`` is the publisher's version.
- ``close`` fails the draws still waiting with RuntimeError and refuses new ones.
"""

from __future__ import annotations

import abc
import contextlib
import threading
from collections.abc import Sequence
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from typing import Any

import numpy as np

from dew_pipe._validate import check_int
from dew_pipe.inference.servers.engine_setup import SEED_LIMIT, prompt_array, request_seed
from dew_pipe.inference.servers.http_json import EngineError, Request
from dew_pipe.inference.servers.interface import Draw
from dew_pipe.sampling import Sampling

__all__ = ["RemoteServer", "check_publisher", "check_remote_sampling"]


def check_publisher(weights: Any) -> Any:
    """``weights`` if it has ``load(variables, version)`` and an int ``version``.

    Raises:
        TypeError: anything else (named).
    """
    if not callable(getattr(weights, "load", None)) or not isinstance(
        getattr(weights, "version", None), int
    ):
        raise TypeError(
            f"weights is {type(weights).__name__}; expected a publisher with load(variables, "
            f"version) and an int version, such as Publication(SafetensorsReload(...))"
        )
    return weights


def check_remote_sampling(sampling: Any) -> Sampling:
    """``sampling`` if it is a `Sampling` an engine can sample from with a likelihood.

    Raises:
        TypeError: not a Sampling.
        ValueError: greedy decoding (temperature 0): an engine reports the model's
            likelihood of the argmax id, not the 1 of a certain choice.
    """
    if not isinstance(sampling, Sampling):
        raise TypeError(f"sampling is {type(sampling).__name__}; expected a Sampling")
    if sampling.greedy:
        raise ValueError(
            "sampling.temperature is 0 (greedy); a remote engine reports the argmax id's "
            "model likelihood, not the behavior likelihood 1 of a certain choice; expected "
            "a temperature > 0"
        )
    return sampling


class RemoteServer(abc.ABC):
    """The `RolloutServer` requests over HTTP; subclasses build and read the requests.

    Args:
        weights: the publisher (``load(variables, version)``, ``version``) that pushes
            weights into the engine, e.g. ``Publication(SafetensorsReload(...))``.
        max_in_flight: requests sent at once (one waiting thread each); further
            submissions queue here.
        seed: seeds the stream of request seeds used when ``submit`` gets none.
    """

    def __init__(self, weights: Any, *, max_in_flight: int = 64, seed: int = 0) -> None:
        self.weights = check_publisher(weights)
        workers = check_int("max_in_flight", max_in_flight, minimum=1)
        self._seeds = np.random.default_rng(check_int("seed", seed, minimum=0))
        self._lock = threading.Lock()
        self._closed = False
        self._requests: dict[Future, Request | None] = {}
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix=type(self).__name__)

    # --- what a subclass provides -----------------------------------------------------

    @abc.abstractmethod
    def _request(self, prompt: np.ndarray, budget: int, seed: int) -> Request:
        """The HTTP request drawing one completion of ``prompt``."""

    @abc.abstractmethod
    def _draw(
        self, answer: Any, prompt: np.ndarray, budget: int, seed: int, submitted: int
    ) -> Draw:
        """The `Draw` in the engine's ``answer`` (ValueError/KeyError/TypeError if none)."""

    # --- the RolloutServer requests -------------------------------------------------------

    @property
    def version(self) -> int:
        """The weights version new submissions are stamped with (the publisher's)."""
        return self.weights.version

    def submit(
        self,
        prompt_ids: Sequence[int] | np.ndarray,
        max_new_tokens: int,
        *,
        seed: int | None = None,
    ) -> Future[Draw]:
        """Sends one draw request; returns its future at once.

        Args:
            prompt_ids: the ids the engine reads (1-D, nonnegative).
            max_new_tokens: the budget (>= 1).
            seed: ``[0, 2**32)``; None takes the next seed of this server's stream.

        Returns:
            A future `Draw`; it fails with `EngineError` when the engine refuses the request
            (an id outside its vocabulary, a prompt past its context) or cannot be reached,
            and with RuntimeError when the server closes first. Cancel it to abort the
            request.

        Raises:
            TypeError / ValueError: a bad budget, seed or prompt.
            RuntimeError: the server is closed.
        """
        budget = check_int("max_new_tokens", max_new_tokens, minimum=1)
        prompt = prompt_array(prompt_ids)
        if prompt.ndim != 1 or prompt.size == 0 or int(prompt.min()) < 0:
            raise ValueError(
                f"prompt_ids has shape {prompt.shape} and ids {prompt.tolist()[:8]}; expected "
                f"a nonempty 1-D list of nonnegative ids"
            )
        seed = request_seed(seed)
        future: Future[Draw] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{type(self).__name__} is closed")
            if seed is None:
                seed = int(self._seeds.integers(SEED_LIMIT))
            request = self._request(prompt, budget, seed)
            self._requests[future] = request
        submitted = self.version
        future.add_done_callback(self._on_done)
        self._pool.submit(self._run, future, request, prompt, budget, seed, submitted)
        return future

    def _on_done(self, future: Future) -> None:
        with self._lock:
            request = self._requests.pop(future, None)
        if future.cancelled() and request is not None:
            request.abort()

    def _run(self, future: Future, request: Request, prompt, budget, seed, submitted) -> None:
        if future.done():
            return  # cancelled (or failed by close) while queued
        try:
            draw = self._draw(request.send(), prompt, budget, seed, submitted)
        except BaseException as error:  # delivered through the future
            if isinstance(error, ValueError | KeyError | TypeError | IndexError):
                error = EngineError(
                    f"{request.url}: the engine's answer does not hold a draw: {error}",
                    url=request.url,
                    step=request.step,
                )
            with contextlib.suppress(InvalidStateError):  # cancelled or closed meanwhile
                future.set_exception(error)
            return
        with contextlib.suppress(InvalidStateError):  # cancelled or closed: dropped
            future.set_result(draw)

    def load(self, variables: Any, version: int) -> Future[int]:
        """Pushes ``variables`` as ``version`` through the publisher (``weights.load``).

        Returns the publisher's future when it gives one, else a done future: an engine
        push over HTTP completes inside the call.
        """
        version = check_int("version", version, minimum=0)
        pending = self.weights.load(variables, version)
        if isinstance(pending, Future):
            return pending
        done: Future[int] = Future()
        done.set_result(version)
        return done

    def close(self) -> None:
        """Fails unfinished draws with RuntimeError, aborts their requests, stops the threads."""
        with self._lock:
            self._closed = True
            pending = list(self._requests.items())
        error = RuntimeError(f"{type(self).__name__} was closed before the draw finished")
        for future, request in pending:
            if request is not None:
                request.abort()
            with contextlib.suppress(InvalidStateError):
                future.set_exception(error)
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> RemoteServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
