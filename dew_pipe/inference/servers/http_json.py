"""JSON over HTTP to an inference engine, with a deadline on every request.

The HTTP backends (`OpenAIRolloutServer`, `VLLMGenerateServer`) and the weight publishers
(`SafetensorsReload`, `NCCLPush`) talk to engines through `JSONClient`: one POST or GET,
a JSON body each way, the standard library's ``http.client`` underneath (no new
dependency). Every request has a deadline: the socket timeout of each blocking step
(connect, send, the status line, each read of the body) is at most the time left when it
starts, and the body is read in chunks with the deadline checked between them, so an
engine that accepts the connection and never answers fails the request when the deadline
passes instead of hanging its caller (one trickling its body byte by byte fails within
twice the deadline).
Whatever goes wrong (refused connection, timeout, a status other than 2xx, a body that is
not JSON) raises `EngineError`, which names the URL and the step that failed.

A request can also be aborted from another thread (`Request.abort` shuts its socket down),
which is how a rollout server stops a draw whose future was cancelled: vLLM aborts a
request whose client went away.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time
import urllib.parse
from typing import Any

from dew_pipe._validate import check_float

__all__ = ["EngineError", "JSONClient", "Request"]

# What an error message quotes of an engine's reply body.
_EXCERPT = 400


class EngineError(RuntimeError):
    """A request to an inference engine failed, or the engine refused what it was asked.

    Attributes:
        url: the URL requested (for a push: the replica's root URL and the route).
        step: what the request was for (``"pause"``, ``"reload_weights"``...), or None.
        status: the HTTP status when the engine answered, else None (no answer at all).
        body: the parsed JSON (or the text) of the engine's answer, when there was one.
    """

    def __init__(
        self,
        message: str,
        *,
        url: str,
        step: str | None = None,
        status: int | None = None,
        body: Any = None,
    ) -> None:
        super().__init__(message)
        self.url, self.step, self.status, self.body = url, step, status, body


class Request:
    """One request in flight; `abort` (from any thread) makes it fail at once.

    Made by `JSONClient.request`; `send` runs it on the calling thread.
    """

    def __init__(
        self, client: JSONClient, method: str, path: str, body: Any, timeout: float, step: str
    ) -> None:
        self.client, self.method, self.path, self.body = client, method, path, body
        self.timeout, self.step = timeout, step
        self.url = client.url(path)
        self._lock = threading.Lock()
        self._connection: http.client.HTTPConnection | None = None
        self.aborted = False

    def abort(self) -> None:
        """Shuts the request's socket down; `send` then raises `EngineError` (idempotent)."""
        with self._lock:
            self.aborted = True
            connection = self._connection
        sock = getattr(connection, "sock", None)
        if sock is not None:
            with contextlib.suppress(OSError):  # already closed
                sock.shutdown(socket.SHUT_RDWR)

    def _fail(self, message: str, **fields: Any) -> EngineError:
        what = f" ({self.step})" if self.step else ""
        return EngineError(f"{self.method} {self.url}{what}: {message}", url=self.url,
                           step=self.step, **fields)  # fmt: skip

    def send(self) -> Any:
        """Runs the request; returns the engine's JSON answer (None for an empty body).

        Raises:
            EngineError: no connection, the deadline passed, the request was aborted, a
                status other than 2xx, or a body that is not JSON.
        """
        deadline = time.monotonic() + self.timeout
        payload = None if self.body is None else json.dumps(self.body).encode()
        headers = {"Accept": "application/json"}
        if payload is not None:
            headers["Content-Type"] = "application/json"
        connection = self.client.connect(self.timeout)
        with self._lock:
            if self.aborted:
                raise self._fail("aborted before it was sent")
            self._connection = connection
        try:
            status, raw = self._exchange(connection, payload, headers, deadline)
        except (OSError, http.client.HTTPException) as error:
            if self.aborted:
                raise self._fail("aborted") from error
            if isinstance(error, TimeoutError) or time.monotonic() >= deadline:
                raise self._fail(f"no answer within {self.timeout:g} s") from error
            raise self._fail(f"{type(error).__name__}: {error}") from error
        finally:
            connection.close()
        text = raw.decode("utf-8", errors="replace")
        try:
            parsed = json.loads(text) if text.strip() else None
        except json.JSONDecodeError:
            parsed = None
            if 200 <= status < 300:
                raise self._fail(
                    f"answered {status} with a body that is not JSON: {text[:_EXCERPT]!r}",
                    status=status, body=text,
                ) from None  # fmt: skip
        if not 200 <= status < 300:
            shown = text[:_EXCERPT] if text else "(empty body)"
            raise self._fail(f"answered HTTP {status}: {shown}", status=status,
                             body=parsed if parsed is not None else text)  # fmt: skip
        return parsed

    def _exchange(
        self,
        connection: http.client.HTTPConnection,
        payload: bytes | None,
        headers: dict[str, str],
        deadline: float,
    ) -> tuple[int, bytes]:
        def left() -> float:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("deadline passed")
            return remaining

        connection.timeout = left()
        connection.connect()
        with self._lock:
            if self.aborted:  # abort() ran before the socket existed: nothing to shut down
                raise ConnectionAbortedError("aborted")
        connection.request(self.method, self.client.target(self.path), payload, headers)
        connection.sock.settimeout(left())  # each read below waits at most this long
        response = connection.getresponse()
        chunks = []
        while True:
            left()  # a body trickling in past the deadline fails too
            chunk = response.read(1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
        return response.status, b"".join(chunks)


class JSONClient:
    """Sends JSON requests to one engine's root URL.

    Args:
        base_url: the engine's root, ``http://host:port`` (a path prefix is kept, e.g.
            ``http://host:port/v1``).
        timeout: default seconds a request may take from connecting to its last byte.

    Raises:
        ValueError: a URL that is not http(s)://host[:port][/path], or a bad timeout.

    Example:
        >>> client = JSONClient("http://127.0.0.1:8000/", timeout=5)
        >>> client.url("/v1/completions")
        'http://127.0.0.1:8000/v1/completions'
    """

    def __init__(self, base_url: str, *, timeout: float = 60.0) -> None:
        if not isinstance(base_url, str):
            raise TypeError(f"base_url is {base_url!r}; expected a str like http://host:port")
        parts = urllib.parse.urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"base_url is {base_url!r}; expected http(s)://host[:port][/path]")
        if parts.query or parts.fragment:
            raise ValueError(f"base_url is {base_url!r}; expected no query or fragment")
        try:
            parts.port  # noqa: B018 - raises ValueError for a malformed port
        except ValueError as error:
            raise ValueError(f"base_url is {base_url!r}; its port is not a number") from error
        self.timeout = check_float("timeout", timeout, above=0.0)
        self._parts = parts
        self._prefix = parts.path.rstrip("/")
        self.base_url = urllib.parse.urlunsplit((parts.scheme, parts.netloc, self._prefix, "", ""))

    def __repr__(self) -> str:
        return f"JSONClient({self.base_url!r}, timeout={self.timeout:g})"

    def target(self, path: str) -> str:
        """The request target for ``path`` (prefix included, query kept)."""
        return self._prefix + "/" + path.lstrip("/")

    def url(self, path: str) -> str:
        """The full URL of ``path``."""
        return f"{self._parts.scheme}://{self._parts.netloc}{self.target(path)}"

    def connect(self, timeout: float) -> http.client.HTTPConnection:
        """An unopened connection to the engine (opened by the request that uses it)."""
        kind = http.client.HTTPSConnection if self._parts.scheme == "https" else (
            http.client.HTTPConnection
        )  # fmt: skip
        return kind(self._parts.hostname, self._parts.port, timeout=timeout)

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        timeout: float | None = None,
        step: str | None = None,
    ) -> Request:
        """A `Request` ready to `send` (keep it to `abort` it from another thread)."""
        seconds = self.timeout if timeout is None else check_float("timeout", timeout, above=0.0)
        return Request(self, method, path, body, seconds, step)

    def post(
        self, path: str, body: Any = None, *, timeout: float | None = None, step: str | None = None
    ) -> Any:
        """POSTs ``body`` as JSON to ``path``; the engine's JSON answer (see `Request.send`)."""
        return self.request("POST", path, body, timeout=timeout, step=step).send()

    def get(self, path: str, *, timeout: float | None = None, step: str | None = None) -> Any:
        """GETs ``path``; the engine's JSON answer (see `Request.send`)."""
        return self.request("GET", path, timeout=timeout, step=step).send()
