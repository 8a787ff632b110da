"""The child side of `dew_pipe.inference.ProcessRolloutServer`: a `Server` in its own process.

Run as ``python -m dew_pipe.inference.servers.process_worker FD`` by the parent, which holds
the other end of the socket ``FD``. Nothing here imports JAX before the setup message has
been read: the CPU affinity is applied first, so XLA sizes its thread pool to the cores this
process may use, and the parent's environment (``XLA_FLAGS``, ``JAX_PLATFORMS``,
``CUDA_VISIBLE_DEVICES``...) is read by a fresh interpreter.

Protocol (pickled tuples over `multiprocessing.connection.Connection`):

parent -> child
    ``setup``: ``{"cpus": set | None, "task": bytes, "options": dict}`` (first message)
    ``("submit", rid, prompt, budget, seed)``, ``("submit_many", rids, prompts, budget,
    seeds)``, ``("cancel", rid)``,
    ``("load", token, variables, version)``, ``("counters", token)``, ``("close",)``
child -> parent
    ``("ready", version, info)`` or ``("failed", error)`` after the setup;
    per request exactly one of ``("draw", rid, Draw)``, ``("draw_failed", rid, error)``,
    ``("cancelled", rid)``; ``("loaded", token, version)`` / ``("load_failed", token,
    error)`` once the push serves (the child reads on meanwhile: later submissions queue
    behind it); ``("counters", token, ServerCounters)``; ``("closed",)`` last.
    After ``ready`` one thread sends them, in order; messages that are waiting together
    travel as one ``("batch", [message, ...])`` (the draws a decode call finishes at once).

The child ends when told to close or when the parent's end of the socket closes (the
parent exited), closing its server first.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any

__all__ = ["main", "portable"]


def portable(error: BaseException) -> BaseException:
    """``error`` itself when it survives pickling, else a RuntimeError with its text.

    Example:
        >>> type(portable(ValueError("x"))).__name__
        'ValueError'
    """
    try:
        clone = pickle.loads(pickle.dumps(error))
    except Exception:  # noqa: BLE001 - anything unpicklable is reported as text
        return RuntimeError(f"{type(error).__name__}: {error}")
    if str(clone) != str(error):
        return RuntimeError(f"{type(error).__name__}: {error}")
    return clone


class _Worker:
    """Serves the parent's requests with one `Server` (main thread reads, callbacks reply)."""

    def __init__(self, connection: Connection, server: Any) -> None:
        self.connection = connection
        self.server = server
        self._lock = threading.Lock()
        self._futures: dict[int, Any] = {}
        self._outbox: list[tuple] = []
        self._out = threading.Condition()
        self._sender = threading.Thread(
            target=self._send_loop, name="dew-process-worker-sender", daemon=True
        )
        self._sender.start()

    def send(self, message: tuple) -> None:
        """Queues ``message`` for the parent (sent in order by the sender thread)."""
        with self._out:
            self._outbox.append(message)
            self._out.notify()

    def _send_loop(self) -> None:
        while True:
            with self._out:
                while not self._outbox:
                    self._out.wait()
                messages, self._outbox = self._outbox, []
            # A send that fails means the parent is gone: there is nobody left to tell.
            with contextlib.suppress(OSError, EOFError, ValueError):
                self.connection.send(messages[0] if len(messages) == 1 else ("batch", messages))
            if any(message[0] == "closed" for message in messages):
                return

    def serve(self) -> None:
        try:
            while True:
                try:
                    message = self.connection.recv()
                except (EOFError, OSError):
                    return  # the parent exited
                if message[0] == "close":
                    return
                self._handle(message)
        finally:
            self.server.close()  # fails unfinished draws; their callbacks reply
            self.send(("closed",))
            self._sender.join()

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "submit":
            _, rid, prompt, budget, seed = message
            self._submit(rid, prompt, budget, seed)
        elif kind == "submit_many":
            _, rids, prompts, budget, seeds = message
            self._submit_many(rids, prompts, budget, seeds)
        elif kind == "cancel":
            with self._lock:
                future = self._futures.get(message[1])
            if future is not None:
                future.cancel()
        elif kind == "load":
            # Without waiting: the requests read after it queue behind the push.
            _, token, variables, version = message
            try:
                future = self.server.reload(variables, version, wait=False)
            except BaseException as error:  # noqa: BLE001 - reported to the caller
                self.send(("load_failed", token, portable(error)))
                return
            future.add_done_callback(lambda done: self._loaded(token, done))
        elif kind == "counters":
            self.send(("counters", message[1], self.server.counters()))
        else:
            raise ValueError(f"server worker: unknown message {kind!r}")

    def _loaded(self, token: int, future: Any) -> None:
        error = future.exception()
        if error is None:
            self.send(("loaded", token, future.result()))
        else:
            self.send(("load_failed", token, portable(error)))

    def _submit(self, rid: int, prompt: Any, budget: int, seed: int | None) -> None:
        try:
            future = self.server.submit(prompt, budget, seed=seed)
        except BaseException as error:  # noqa: BLE001 - the server is closed or failed
            self.send(("draw_failed", rid, portable(error)))
            return
        with self._lock:
            self._futures[rid] = future
        future.add_done_callback(lambda done: self._reply(rid, done))

    def _submit_many(self, rids: list[int], prompts: list, budget: int, seeds: list) -> None:
        try:
            futures = self.server.submit_many(prompts, budget, seeds=seeds)
        except BaseException as error:  # noqa: BLE001 - the server is closed or failed
            for rid in rids:
                self.send(("draw_failed", rid, portable(error)))
            return
        with self._lock:
            self._futures.update(zip(rids, futures, strict=True))
        for rid, future in zip(rids, futures, strict=True):
            future.add_done_callback(lambda done, rid=rid: self._reply(rid, done))

    def _reply(self, rid: int, future: Any) -> None:
        with self._lock:
            self._futures.pop(rid, None)
        if future.cancelled():
            self.send(("cancelled", rid))
        elif future.exception() is not None:
            self.send(("draw_failed", rid, portable(future.exception())))
        else:
            self.send(("draw", rid, future.result()))


def _setup(connection: Connection) -> Any:
    """Reads the setup, pins the process, builds the server (imports JAX here, not before)."""
    setup = connection.recv()
    cpus = setup["cpus"]
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    task = pickle.loads(setup["task"])
    from dew_pipe.inference.servers.engine import Server

    return Server.from_task(task, **setup["options"])


def main(argv: list[str]) -> int:
    """Entry point: ``argv[1]`` is the file descriptor of the socket to the parent."""
    if len(argv) != 2 or not argv[1].isdigit():
        print("usage: python -m dew_pipe.inference.servers.process_worker FD", file=sys.stderr)
        return 2
    connection = Connection(int(argv[1]))
    try:
        server = _setup(connection)
    except (EOFError, OSError):
        return 1  # the parent went away during the setup
    except BaseException as error:  # noqa: BLE001 - reported to the parent, which raises it
        connection.send(("failed", portable(error)))
        return 1
    import jax

    info = {
        "pid": os.getpid(),
        "cpus": sorted(os.sched_getaffinity(0)),
        "devices": [str(d) for d in jax.devices()],
    }
    worker = _Worker(connection, server)
    worker.send(("ready", server.version, info))
    worker.serve()
    connection.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
